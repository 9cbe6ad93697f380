//! The operator commands: what `cdc-relay <command>` does, from parsed
//! arguments to printed output and an exit code.
//!
//! Commands are the process's edge, where errors become messages for an
//! operator: like the binary, they use `anyhow` with context. Everything
//! below them (the pipeline, the policies, the source) has typed errors.

pub mod backfill;
pub mod dead_letter;
pub mod prune;
pub mod routes;
pub mod run;
pub mod setup;
pub mod status;

use crate::cli::{Command, GlobalArgs};
use crate::source;

/// Runs `command` and returns the process exit code; errors are printed
/// to stderr.
pub async fn execute(global: GlobalArgs, command: Command) -> u8 {
    match command {
        Command::Setup(a) => report(lock_named(&global, setup::command(&global, a).await).await),
        Command::Status(a) => {
            let json = a.json;
            status::command(&global, a).await.unwrap_or_else(|e| {
                let error = format!("{e:#}");
                let code = report(Err(e));
                // A script reading `status --json` gets an object either
                // way: the error and the exit code, on stdout.
                if json {
                    outln!(
                        "{}",
                        serde_json::json!({ "healthy": false, "error": error, "exit_code": code })
                    );
                }
                code
            })
        }
        Command::Run(a) => run::command(&global, *a).await,
        Command::DeadLetter(c) => {
            report(lock_named(&global, dead_letter::command(&global, c).await).await)
        }
        Command::Backfill(a) => {
            report(lock_named(&global, backfill::command(&global, *a).await).await)
        }
        Command::Prune(a) => prune::command(&global, *a).await,
        Command::Routes(c) => routes::command(&global, c).await,
        Command::Completions { shell } => {
            let mut cli = crate::cli::Cli::command();
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut cli, "cdc-relay", &mut out);
            outln!("{}", String::from_utf8_lossy(&out).trim_end());
            0
        }
    }
}

/// A configuration mistake of a command (a flag, variable or file the
/// message names): the command exits 2, as `run` and clap do.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// The span export `--otlp-endpoint` asks for (`None`: tracing off), its
/// counters in `metrics`. A bad setting is a [`ConfigError`].
pub(crate) fn start_export(
    args: &trace_context::TraceArgs,
    metrics: &crate::metrics::Metrics,
) -> Result<Option<trace_context::Export>, ConfigError> {
    let counters = trace_context::Counters::register(metrics.registry(), "cdc_relay");
    // The collector's CA is read again for each new connection, as the
    // sinks' and the database's trust files are.
    let tls = match &args.certificate {
        Some(path) => Some(
            crate::sink::tls::roots_config(
                "--otlp-certificate (OTEL_EXPORTER_OTLP_CERTIFICATE)",
                path,
            )
            .map_err(ConfigError)?,
        ),
        None => None,
    };
    trace_context::Export::start_with_tls(args, "cdc-relay", counters, tls)
        .map_err(|e| ConfigError(e.to_string()))
}

/// How long a stopping command waits for its last spans to be exported.
pub(crate) const EXPORT_FLUSH: std::time::Duration = std::time::Duration::from_secs(2);

/// Prints a configuration error's notes on the flags it names that came
/// from the environment ([`crate::cli::environment_notes`]).
fn environment_notes(message: &str) {
    for note in crate::cli::environment_notes(message) {
        eprintln!("  note: {note}");
    }
}

/// Prints `message` as a refused configuration (the error line, then
/// [`environment_notes`]); the exit code 2.
pub(crate) fn config_refused(message: &str) -> u8 {
    eprintln!("error: {message}");
    environment_notes(message);
    2
}

fn report(r: anyhow::Result<()>) -> u8 {
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            let misconnected = e
                .downcast_ref::<source::SourceError>()
                .is_some_and(source::SourceError::is_misconnection);
            if let Some(ConfigError(message)) = e.downcast_ref::<ConfigError>() {
                environment_notes(message);
                2
            } else if misconnected {
                2
            } else {
                1
            }
        }
    }
}

/// SIGTERM and SIGINT: the signals that stop a command (`run`'s graceful
/// shutdown, `backfill`'s early stop).
pub(crate) struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Installs the handlers; `None`, logged, when they cannot be.
    pub(crate) fn install() -> Option<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Some(Self { term, int }),
            _ => {
                tracing::error!("cannot install signal handlers");
                None
            }
        }
    }

    /// Waits for the next one and names it: `SIGTERM` or `SIGINT`.
    pub(crate) async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// Refuses (exit 2) what `run` would stop with for its connections, so
/// `setup` and `status` say the same: a replication connection's URL
/// (`--replication-url`, else `--database-url`) that reaches a pooler or
/// proxy not carrying replication connections, a side connection through a
/// transaction-mode pool, and a `--replication-url` reaching another
/// database or server than `--database-url` ([`source::pairing`]). A
/// `--replication-url` that cannot log in fails with its own error.
async fn check_connections(g: &GlobalArgs, side: &tokio_postgres::Client) -> anyhow::Result<()> {
    let side_conn = g.conn().map_err(ConfigError)?;
    let replication = g.replication_conn().map_err(ConfigError)?;
    let stream_conn = replication.as_ref().unwrap_or(&side_conn);
    let checked = match source::transport::check_not_pooled(stream_conn).await {
        Ok(()) => source::pairing::check(side, &side_conn, replication.as_ref(), "cdc-relay").await,
        refused => refused,
    };
    match checked {
        Err(e) if e.is_misconnection() => Err(ConfigError(e.to_string()).into()),
        other => Ok(other?),
    }
}

/// A side SQL connection for a command, its lock waits bounded
/// (`lock_timeout`, [`source::lock_wait`]): a statement that waits for a
/// lock another session holds fails after 4 s instead of hanging the
/// command ([`lock_named`] then names the holders). The first statement is
/// bounded like the login: a pooler may let the login through and queue
/// the first statement for a server connection.
async fn connect(g: &GlobalArgs) -> anyhow::Result<tokio_postgres::Client> {
    let conn = g.conn().map_err(ConfigError)?;
    // Both URLs' settings are checked before either connects: a mistake
    // in --replication-url is said as such, not as what the first
    // connection ran into.
    g.replication_conn().map_err(ConfigError)?;
    let client = source::connect_sql(&conn, "cdc-relay").await?;
    let bound = conn.connect_timeout * 2;
    match tokio::time::timeout(bound, source::lock_wait::bound(&client)).await {
        Ok(bounded) => bounded?,
        Err(_) => return Err(source::stalled_login_named(&conn, bound).await.into()),
    };
    Ok(client)
}

/// `r`, with the sessions holding strong table locks now appended when its
/// error is a lock wait that ended at `lock_timeout` (read on a new
/// connection: the command's own may be gone with the error).
async fn lock_named<T>(g: &GlobalArgs, r: anyhow::Result<T>) -> anyhow::Result<T> {
    let Err(e) = r else { return r };
    let waited = e.chain().any(|c| {
        c.downcast_ref::<tokio_postgres::Error>()
            .is_some_and(crate::locks::is_lock_wait)
            || matches!(
                c.downcast_ref::<source::SourceError>(),
                Some(source::SourceError::LockWait { holders, .. }) if holders.is_empty()
            )
            // Transparent: the source error is not a link of its own.
            || matches!(
                c.downcast_ref::<crate::prune::PruneError>(),
                Some(crate::prune::PruneError::Source(source::SourceError::LockWait { holders, .. }))
                    if holders.is_empty()
            )
    });
    if !waited {
        return Err(e);
    }
    let holders = match connect(g).await {
        Ok(client) => crate::locks::holders(&client).await,
        Err(why) => format!("who holds it could not be read: {why:#}"),
    };
    Err(anyhow::anyhow!("{e:#}: {holders}"))
}

/// `println!` that ends the process quietly when stdout is a closed pipe
/// (`cdc-relay status | head`) instead of panicking, and with an error when
/// stdout cannot be written (a full disk).
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::commands::write_stdout_line(format_args!($($arg)*))
    };
}
pub(crate) use outln;

#[doc(hidden)]
pub fn write_stdout_line(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let written = out
        .write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
    match written {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("error: writing to stdout: {e}");
            std::process::exit(1);
        }
    }
}
