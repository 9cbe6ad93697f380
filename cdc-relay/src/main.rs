//! The `cdc-relay` binary: parses the command line and runs a command.

use std::process::ExitCode;

use anyhow::Context;
use cdc_relay::admin::{self, Health};
use cdc_relay::config::{Cli, Command, GlobalArgs, LogFormat, RunArgs, SetupArgs, StatusArgs};
use cdc_relay::metrics::Metrics;
use cdc_relay::relay::{self, RelayConfig};
use cdc_relay::setup::{self, SetupPlan};
use cdc_relay::sink::{HttpSink, Signer, SinkConfig};
use cdc_relay::source;
use clap::Parser;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(&cli.global);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let code = runtime.block_on(async {
        match cli.command {
            Command::Setup(a) => report(setup_cmd(&cli.global, a).await),
            Command::Status(a) => report(status_cmd(&cli.global, a).await),
            Command::Run(a) => run_cmd(&cli.global, *a).await,
        }
    });
    ExitCode::from(code)
}

fn init_tracing(g: &GlobalArgs) {
    let filter = tracing_subscriber::EnvFilter::try_new(&g.log).unwrap_or_else(|e| {
        eprintln!("invalid --log filter {:?}: {e}; using info", g.log);
        tracing_subscriber::EnvFilter::new("info")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
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
        println!("{l}");
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
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        print!("{s}");
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
    let secret = a.secret()?;
    let ca = match &a.sink_ca_file {
        Some(p) => {
            Some(std::fs::read(p).map_err(|e| format!("--sink-ca-file {}: {e}", p.display()))?)
        }
        None => None,
    };
    let sink = HttpSink::new(SinkConfig {
        url: a.sink_url.clone(),
        signer: Signer::new(secret.as_bytes()),
        connect_timeout: a.sink_connect_timeout,
        request_timeout: a.request_timeout,
        ca_cert_pem: ca,
    })
    .map_err(|e| e.to_string())?;
    let cfg = RelayConfig {
        conn,
        slot: g.slot.clone(),
        publications: g.publication.clone(),
        table: g.table.clone(),
        columns: g.columns(),
        application_name: a.application_name.clone(),
        dispatch: a.dispatch(),
        window_events: a.max_pending_events as usize,
        window_bytes: a.max_pending_bytes,
        shutdown_timeout: a.shutdown_timeout,
        reconnect_max: a.reconnect_max,
        slot_stats_interval: a.slot_stats_interval,
    };
    Ok((cfg, sink))
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
    println!("listening on http://{addr}");
    let admin_stop = shutdown.clone();
    let admin = tokio::spawn(admin::serve(
        listener,
        metrics.clone(),
        health.clone(),
        async move { admin_stop.cancelled().await },
    ));
    tokio::spawn(watch_signals(shutdown.clone()));
    tracing::info!(
        source = %cfg.conn.display(), slot = %cfg.slot, sink = %sink.url(), admin = %addr,
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
