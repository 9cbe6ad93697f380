//! Running a service binary: logs, pool, routes, both listeners, serve
//! until SIGTERM/SIGINT ([`run`]), and the process exit status
//! ([`exit_code`]). Apart from [`crate::server`] so that serving never
//! depends on the command line that configures it.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use crate::pool::Pool;
use anyhow::Context;
use tokio::net::TcpListener;

use crate::cli::ServiceArgs;
use crate::db::describe_target;
use crate::metrics::HttpMetrics;
use crate::server::{Routes, admin_router, serve, service_router, shutdown_signal};
use crate::telemetry::{Spans, init_tracing};

/// Connections the admin listener serves at once: its own small budget, as
/// the relay's, so a flood there takes no descriptors from the service.
pub const ADMIN_MAX_CONNECTIONS: usize = 16;

/// Header-read (and idle) timeout of the admin listener.
pub const ADMIN_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs a service: logs, pool (named `name` in `pg_stat_activity`), the
/// routes from `build` (given the pool, the metrics and the request spans
/// of `--otlp-endpoint`), bind, serve until SIGTERM/SIGINT. `name` is also
/// the metrics namespace and the default `service.name` of its spans.
pub async fn run<B>(name: &'static str, args: ServiceArgs, build: B) -> anyhow::Result<()>
where
    B: FnOnce(Pool, Arc<HttpMetrics>, Spans) -> anyhow::Result<Routes>,
{
    init_tracing(args.log.log_format)?;
    // Every setting is checked before the database is tried, so a bad one
    // is the first thing said, and exits 2.
    let target = describe_target(&args.db.pg_config(name).map_err(|e| BadSetting(e.into()))?);
    let pool = args.db.build_pool(name).map_err(|e| BadSetting(e.into()))?;
    let metrics = Arc::new(HttpMetrics::new(name)?);
    let counters = trace_context::Counters::register(metrics.registry(), name);
    let export = trace_context::Export::start(&args.trace, name, counters)
        .map_err(|e| BadSetting(e.into()))?;
    let prefilled = crate::db::prefill(&pool, args.db.prefill()).await;
    match &prefilled.failed {
        None => tracing::info!(database = %target, open = prefilled.opened, "database reachable"),
        Some(e) => {
            let what = if prefilled.opened == 0 {
                "database not reachable yet; requests get 503 until it is".to_owned()
            } else {
                format!(
                    "database reachable, but only {} of the {} connections of --pool-prefill opened at start; the server refused the others (its connection limits?), and a request that needs more than it allows gets 503 database_unavailable: lower --pool-size or raise the server's limit",
                    prefilled.opened, prefilled.wanted
                )
            };
            tracing::warn!(
                database = %target,
                error = %crate::db::PoolErrorReport(e),
                sqlstate = crate::db::pool_sqlstate(e),
                "{what}"
            );
        }
    }
    let spans = Spans::new(export.as_ref().map(|e| e.tracer().clone()));
    let routes = build(pool, Arc::clone(&metrics), spans)?;
    let admin = admin_router(routes.admin, Arc::clone(&metrics), &args.http);
    let router = service_router(routes.public, metrics, &args.http);
    let admin_listener = TcpListener::bind(args.admin_listen)
        .await
        .with_context(|| format!("cannot listen on {} (--admin-listen)", args.admin_listen))?;
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let drain = Duration::from_millis(args.http.request_timeout_ms);
    let limits = args.http.listen.limits(drain);
    let admin_limits = service_listener::Limits {
        header_read_timeout: ADMIN_HEADER_READ_TIMEOUT,
        max_connections: ADMIN_MAX_CONNECTIONS,
        drain_timeout: drain,
    };
    let admin_addr = admin_listener.local_addr()?;
    {
        // Before the `listening on` line, which says both are bound.
        let mut stdout = std::io::stdout().lock();
        let line = crate::telemetry::startup_line(
            &format!("admin endpoint on http://{admin_addr}"),
            &admin_addr.to_string(),
        );
        writeln!(stdout, "{line}")?;
        stdout.flush()?;
    }
    tracing::info!(%admin_addr, "admin endpoint (/metrics, /healthz) listening");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let admin_task = tokio::spawn(service_listener::serve(
        admin_listener,
        admin,
        admin_limits,
        async move {
            let mut stopped = stopped;
            let _ = stopped.wait_for(|s| *s).await;
        },
    ));
    let served = serve(listener, router, limits, async move {
        shutdown_signal().await;
        let _ = stop.send(true);
    })
    .await;
    let _ = admin_task.await;
    if let Some(export) = export {
        export.shutdown(Duration::from_secs(2)).await;
    }
    served?;
    tracing::info!("stopped");
    Ok(())
}

/// A setting the service cannot use (the database URL, an event secret,
/// the OTLP exporter's): the process exits 2, as for a flag the command
/// line refuses; the message names the setting.
#[derive(Debug)]
pub struct BadSetting(pub anyhow::Error);

impl std::fmt::Display for BadSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.0)
    }
}

impl std::error::Error for BadSetting {}

/// The process exit status for `result`: on error, prints `name: error: <cause chain>`
/// to stderr (no backtrace noise) and exits 2 for a [`BadSetting`], else 1.
pub fn exit_code(name: &str, result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: error: {e:#}");
            if e.chain().any(|cause| cause.is::<BadSetting>()) {
                std::process::ExitCode::from(2)
            } else {
                std::process::ExitCode::FAILURE
            }
        }
    }
}
