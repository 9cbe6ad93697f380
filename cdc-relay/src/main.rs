//! The `cdc-relay` binary: parses the command line, sets up logging and the
//! runtime, and runs the command (see [`cdc_relay::commands`]).

use std::process::ExitCode;

use cdc_relay::cli::{Cli, Command, GlobalArgs, LogFormat, default_worker_threads};
use cdc_relay::commands;

fn main() -> ExitCode {
    let cli = Cli::parse_args();
    init_tracing(&cli.global, matches!(cli.command, Command::Backfill(_)));
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    let threads = match &cli.command {
        Command::Run(a) => a.worker_threads.map(usize::from),
        _ => None,
    }
    .unwrap_or_else(|| {
        default_worker_threads(std::thread::available_parallelism().map_or(1, |n| n.get()))
    });
    builder.worker_threads(threads);
    let runtime = builder.enable_all().build().expect("tokio runtime");
    // The command runs as a task on the worker threads, not inside
    // `block_on` on the main thread: there every wake-up from a worker (one
    // per event received) would be a futex call to park/unpark this thread.
    let command = commands::execute(cli.global, cli.command);
    let code = runtime.block_on(async {
        match tokio::spawn(command).await {
            Ok(code) => code,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    });
    ExitCode::from(code)
}

/// Logs to stderr in the chosen format. For `backfill` (`progress_line`),
/// unless `--log` says otherwise, each event's retry and dead-letter
/// warnings drop to debug level: the progress line counts retries by reason
/// and the summary counts dead letters; on a terminal each log line first
/// clears the progress line so the two do not run together.
fn init_tracing(g: &GlobalArgs, progress_line: bool) {
    let default_filter = g.log == GlobalArgs::DEFAULT_LOG;
    let mut filter = tracing_subscriber::EnvFilter::try_new(&g.log)
        .unwrap_or_else(|e| {
            eprintln!(
                "error: invalid --log (CDC_RELAY_LOG) filter {:?}: {e}",
                g.log
            );
            std::process::exit(2);
        })
        // tokio-postgres logs statement parameters at debug: payloads must
        // never reach the logs, whatever the filter says.
        .add_directive(
            "tokio_postgres::query=info"
                .parse()
                .expect("a valid directive"),
        );
    if progress_line && default_filter {
        filter = filter.add_directive(
            "cdc_relay::dispatch::delivery=error"
                .parse()
                .expect("a valid directive"),
        );
    }
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let clear_line = progress_line && terminal;
    // A log line that cannot be written (stderr closed: a pipe whose reader
    // went away) is dropped: tracing-subscriber's default reports it with
    // `eprintln!`, which panics on that same stderr and would take down
    // the task that logged, the signal watcher included.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .log_internal_errors(false)
        .with_ansi(terminal)
        .with_writer(move || {
            let mut stderr = std::io::stderr();
            if clear_line {
                let _ = std::io::Write::write_all(&mut stderr, b"\r\x1b[K");
            }
            stderr
        });
    match g.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
