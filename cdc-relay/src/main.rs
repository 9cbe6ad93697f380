//! The `cdc-relay` binary: parses the command line and runs a command.

use std::process::ExitCode;

use anyhow::Context;
use cdc_relay::admin::{self, Health};
use cdc_relay::backfill::{self, BackfillPlan};
use cdc_relay::config::{
    BackfillArgs, Cli, Command, DeadLetterCommand, GlobalArgs, LogFormat, ReplayArgs, RunArgs,
    SetupArgs, StatusArgs,
};
use cdc_relay::deadletter::{self, Removal};
use cdc_relay::metrics::Metrics;
use cdc_relay::outbox::OutboxEvent;
use cdc_relay::relay::{self, RelayConfig};
use cdc_relay::setup::{self, SetupPlan};
use cdc_relay::sink::HttpSink;
use cdc_relay::source;
use clap::Parser;
use tokio_util::sync::CancellationToken;

/// `println!` that ends the process quietly when stdout is a closed pipe
/// (`cdc-relay status | head`) instead of panicking, and with an error when
/// stdout cannot be written (a full disk).
macro_rules! outln {
    ($($arg:tt)*) => {
        write_stdout_line(format_args!($($arg)*))
    };
}

fn write_stdout_line(args: std::fmt::Arguments<'_>) {
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(&cli.global);
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Command::Run(a) = &cli.command
        && let Some(n) = a.worker_threads
    {
        builder.worker_threads(usize::from(n));
    }
    let runtime = builder.enable_all().build().expect("tokio runtime");
    // The command runs as a task on the worker threads, not inside
    // `block_on` on the main thread: there every wake-up from a worker (one
    // per event received) would be a futex call to park/unpark this thread.
    let command = async move {
        match cli.command {
            Command::Setup(a) => report(setup_cmd(&cli.global, a).await),
            Command::Status(a) => report(status_cmd(&cli.global, a).await),
            Command::Run(a) => run_cmd(&cli.global, *a).await,
            Command::DeadLetter(c) => report(dead_letter_cmd(&cli.global, c).await),
            Command::Backfill(a) => report(backfill_cmd(&cli.global, *a).await),
        }
    };
    let code = runtime.block_on(async {
        match tokio::spawn(command).await {
            Ok(code) => code,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    });
    ExitCode::from(code)
}

fn init_tracing(g: &GlobalArgs) {
    let filter = tracing_subscriber::EnvFilter::try_new(&g.log)
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
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match g.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn report(r: anyhow::Result<()>) -> u8 {
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}

async fn connect(g: &GlobalArgs) -> anyhow::Result<tokio_postgres::Client> {
    let conn = g.conn().map_err(anyhow::Error::msg)?;
    source::connect_sql(&conn, "cdc-relay")
        .await
        .with_context(|| format!("connecting to {}", conn.display()))
}

async fn setup_cmd(g: &GlobalArgs, a: SetupArgs) -> anyhow::Result<()> {
    let client = connect(g).await?;
    let plan = SetupPlan {
        table: g.table.clone(),
        columns: g.columns(),
        publication: g.publication.first().cloned().unwrap_or_default(),
        slot: g.slot.clone(),
        recreate_slot: a.recreate_slot,
    };
    let lines = setup::setup(&client, &plan).await?;
    for l in lines {
        outln!("{l}");
    }
    Ok(())
}

async fn status_cmd(g: &GlobalArgs, a: StatusArgs) -> anyhow::Result<()> {
    let client = connect(g).await?;
    let pubname = g.publication.first().cloned().unwrap_or_default();
    let s = setup::status(&client, &g.slot, &pubname)
        .await
        .context("reading the slot")?;
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        outln!("{}", s.to_string().trim_end());
    }
    Ok(())
}

async fn run_cmd(g: &GlobalArgs, a: RunArgs) -> u8 {
    match prepare_run(g, &a) {
        Ok((cfg, sink)) => serve_and_run(cfg, sink, &a).await,
        Err(msg) => {
            eprintln!("error: {msg}");
            1
        }
    }
}

fn prepare_run(g: &GlobalArgs, a: &RunArgs) -> Result<(RelayConfig, HttpSink), String> {
    a.validate()?;
    let conn = g.conn()?;
    let sink = a.sink.build()?;
    let cfg = RelayConfig {
        conn,
        slot: g.slot.clone(),
        publications: g.publication.clone(),
        table: g.table.clone(),
        columns: g.columns(),
        application_name: a.application_name.clone(),
        dispatch: a.delivery.dispatch(),
        window_events: a.delivery.max_pending_events as usize,
        window_bytes: a.delivery.max_pending_bytes,
        shutdown_timeout: a.shutdown_timeout,
        reconnect_max: a.reconnect_max,
        slot_stats_interval: a.slot_stats_interval,
        create_slot: a.create_slot,
    };
    Ok((cfg, sink))
}

async fn dead_letter_cmd(g: &GlobalArgs, c: DeadLetterCommand) -> anyhow::Result<()> {
    let mut client = connect(g).await?;
    match c {
        DeadLetterCommand::List { json } => {
            let rows = deadletter::list(&client).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&rows)?);
                return Ok(());
            }
            outln!(
                "{:>6}  {:<36}  {:<16}  {:>6}  {:>8}  error",
                "id",
                "event_id",
                "type",
                "status",
                "attempts"
            );
            for r in &rows {
                outln!(
                    "{:>6}  {:<36}  {:<16}  {:>6}  {:>8}  {}",
                    r.id,
                    r.event_id.as_deref().unwrap_or("(none)"),
                    r.event_type.as_deref().unwrap_or("(none)"),
                    r.http_status.map_or("-".into(), |s| s.to_string()),
                    r.attempts,
                    r.error.chars().take(80).collect::<String>()
                );
            }
            outln!("{} quarantined event(s)", rows.len());
        }
        DeadLetterCommand::Show { id } => {
            let row = deadletter::get(&client, id)
                .await?
                .with_context(|| format!("no dead-letter row {id}"))?;
            outln!("{}", serde_json::to_string_pretty(&row)?);
        }
        DeadLetterCommand::Replay(a) => replay(&mut client, *a).await?,
        DeadLetterCommand::Discard { id, reason } => {
            anyhow::ensure!(
                deadletter::remove(&mut client, id, Removal::Discard, reason.as_deref()).await?,
                "no dead-letter row {id}"
            );
            outln!("discarded dead-letter row {id} (kept in cdc_relay_dead_letter_audit)");
        }
    }
    Ok(())
}

async fn replay(client: &mut tokio_postgres::Client, a: ReplayArgs) -> anyhow::Result<()> {
    let sink = a.sink.build().map_err(anyhow::Error::msg)?;
    let ids: Vec<i64> = match a.id {
        Some(id) => vec![id],
        None => deadletter::list(client)
            .await?
            .iter()
            .map(|r| r.id)
            .collect(),
    };
    let mut failed = 0;
    for id in ids {
        let row = deadletter::get(client, id)
            .await?
            .with_context(|| format!("no dead-letter row {id}"))?;
        let (Some(event_id), Some(event_type)) = (row.event_id.clone(), row.event_type.clone())
        else {
            outln!(
                "row {id}: no event id or type; cannot be sent (discard it after fixing the source row)"
            );
            failed += 1;
            continue;
        };
        let event = OutboxEvent {
            id: event_id,
            event_type,
            payload: row.payload.clone().map(bytes::Bytes::from),
            aggregate_key: row.aggregate_key.clone(),
            commit_lsn: row.commit_lsn.parse().unwrap_or_default(),
            commit_time_micros: 0,
        };
        let (body, signature) = sink.prepare(&event);
        match sink.post(&event.id, body, &signature).await {
            cdc_relay::sink::Attempt::Response { status, .. } if (200..300).contains(&status) => {
                deadletter::remove(client, id, Removal::Replay, None).await?;
                outln!("row {id}: delivered ({status}); removed");
            }
            other => {
                outln!("row {id}: not delivered ({other:?}); kept");
                failed += 1;
            }
        }
    }
    anyhow::ensure!(failed == 0, "{failed} row(s) not replayed");
    Ok(())
}

async fn backfill_cmd(g: &GlobalArgs, a: BackfillArgs) -> anyhow::Result<()> {
    a.delivery.validate().map_err(anyhow::Error::msg)?;
    let sink = a.sink.build().map_err(anyhow::Error::msg)?;
    let mut reader = connect(g).await?;
    let store = std::sync::Arc::new(connect(g).await?);
    let plan = BackfillPlan {
        table: g.table.clone(),
        columns: g.columns(),
        time_column: a.time_column.clone(),
        since: a.since.clone(),
        until: a.until.clone(),
        window_events: a.delivery.max_pending_events as usize,
        window_bytes: a.delivery.max_pending_bytes,
    };
    let total = backfill::count(&reader, &plan).await?;
    eprintln!(
        "backfill: {total} row(s) in {} from {} to {}",
        plan.table,
        plan.since,
        plan.until.as_deref().unwrap_or("now")
    );
    let started = std::time::Instant::now();
    let mut last_print = std::time::Instant::now();
    let report = backfill::run(
        &mut reader,
        store,
        sink,
        a.delivery.dispatch(),
        &plan,
        |sent| {
            if last_print.elapsed() >= std::time::Duration::from_millis(500) || sent == total {
                eprint!("\rbackfill: {sent}/{total} handed to delivery");
                last_print = std::time::Instant::now();
            }
        },
    )
    .await?;
    eprintln!();
    outln!(
        "backfill done in {:.1} s: {} row(s) read, {} delivered, {} dead-lettered",
        started.elapsed().as_secs_f64(),
        report.rows,
        report.delivered,
        report.dead_lettered
    );
    Ok(())
}

async fn serve_and_run(cfg: RelayConfig, sink: HttpSink, a: &RunArgs) -> u8 {
    let metrics = Metrics::new();
    let health = Health::new(a.ready_window);
    let shutdown = CancellationToken::new();
    let listener = match tokio::net::TcpListener::bind(a.admin_listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot bind --admin-listen {}: {e}", a.admin_listen);
            return 1;
        }
    };
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    outln!("listening on http://{addr}");
    let admin_stop = shutdown.clone();
    let admin = tokio::spawn(admin::serve(
        listener,
        metrics.clone(),
        health.clone(),
        async move { admin_stop.cancelled().await },
    ));
    tokio::spawn(watch_signals(shutdown.clone()));
    tracing::info!(
        source = %cfg.conn.display(), slot = %cfg.slot, sink = %sink.display_url(), admin = %addr,
        max_in_flight = cfg.dispatch.max_in_flight, "cdc-relay starting"
    );
    let result = relay::run(cfg, sink, metrics, health, shutdown.clone()).await;
    shutdown.cancel();
    let _ = admin.await;
    match result {
        Ok(()) => {
            tracing::info!("stopped");
            0
        }
        Err(e) => {
            tracing::error!(error = %e, "stopping");
            eprintln!("error: {e}");
            u8::try_from(e.exit_code()).unwrap_or(1)
        }
    }
}

async fn watch_signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
    shutdown.cancel();
    // A second signal means "now".
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::warn!("second signal: exiting without draining");
    std::process::exit(130);
}
