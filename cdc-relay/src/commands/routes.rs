//! `cdc-relay routes check FILE`: validates a routes file (its secrets'
//! references included) and prints which endpoints each event type of the
//! outbox's recent rows goes to.

use super::{ConfigError, connect, outln, report};
use crate::cli::GlobalArgs;
use crate::dispatch::{DispatchConfig, Router, Unrouted};
use crate::routes::RoutesFile;
use crate::routes::args::{CheckArgs, RoutesCommand};
use crate::source::catalog::{quote_ident, quote_table};

/// `cdc-relay routes …`; returns the exit code: 0 valid, 2 an invalid file
/// (the message names the file, the endpoint and the key), 1 the outbox
/// could not be read.
pub async fn command(g: &GlobalArgs, c: RoutesCommand) -> u8 {
    match c {
        RoutesCommand::Check(a) => report(check(g, &a).await),
    }
}

async fn check(g: &GlobalArgs, a: &CheckArgs) -> anyhow::Result<()> {
    let file = RoutesFile::load(&a.file).map_err(|e| ConfigError(e.to_string()))?;
    for e in &file.endpoints {
        file.keys(e).map_err(|e| ConfigError(e.to_string()))?;
    }
    let lanes = as_run_builds_it(&a.file, &file)?;
    outln!(
        "{}: valid, {} endpoint(s)",
        a.file.display(),
        file.endpoints.len()
    );
    for (e, cfg) in file.endpoints.iter().zip(&lanes) {
        let types: Vec<&str> = e.event_types.iter().map(|p| p.as_str()).collect();
        outln!(
            "  {:<20} {}  takes {}; {}",
            e.name,
            crate::redact::url(e.url.as_str()),
            types.join(", "),
            batching(cfg)
        );
    }
    let unrouted = match file.unrouted {
        Unrouted::DeadLetter => "dead-lettered (reason unrouted)",
        Unrouted::Skip => "skipped (counted, logged once per type)",
    };
    outln!("  events no endpoint takes are {unrouted}");
    if a.offline {
        return Ok(());
    }
    let client = connect(g).await?;
    let sql = format!(
        "SELECT t, count(*) FROM (SELECT {ty}::text AS t FROM {table} ORDER BY {time} DESC LIMIT $1) r \
         GROUP BY t ORDER BY t",
        ty = quote_ident(&g.type_column),
        table = quote_table(&g.table),
        time = quote_ident(&a.time_column),
    );
    let rows = client.query(&sql, &[&a.recent_rows]).await.map_err(|e| {
        anyhow::anyhow!(
            "reading event types from {}: {}",
            g.table,
            crate::db_message(&e)
        )
    })?;
    let router = router(&file);
    outln!(
        "event types in the last {} row(s) of {} (by {}):",
        a.recent_rows,
        g.table,
        a.time_column
    );
    let mut unrouted_types = 0;
    for r in &rows {
        let ty: Option<String> = r.get(0);
        let n: i64 = r.get(1);
        let Some(ty) = ty else {
            outln!(
                "  {:<32} {n:>8} row(s)  -> dead-lettered (NULL type: unreadable)",
                "(NULL)"
            );
            continue;
        };
        let lanes = router.matching(&ty);
        let to = if lanes.is_empty() {
            unrouted_types += 1;
            format!("UNROUTED: {unrouted}")
        } else {
            lanes
                .iter()
                .map(|l| file.endpoints[*l].name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        outln!("  {ty:<32} {n:>8} row(s)  -> {to}");
    }
    if rows.is_empty() {
        outln!("  (no rows)");
    }
    if unrouted_types > 0 {
        outln!("{unrouted_types} event type(s) match no endpoint");
    }
    Ok(())
}

/// The relay's router over the file's endpoints, in file order, as `run
/// --routes` builds it.
fn router(file: &RoutesFile) -> Router {
    Router::new(
        file.endpoints
            .iter()
            .map(|e| Some(e.event_types.clone()))
            .collect(),
        file.unrouted,
    )
}

/// How an endpoint's requests carry events, as `run` would send them.
fn batching(cfg: &DispatchConfig) -> String {
    if cfg.batch_max_events > 1 {
        format!(
            "batches of up to {} events and {}",
            cfg.batch_max_events,
            super::status::human_bytes(i64::try_from(cfg.batch_max_bytes).unwrap_or(i64::MAX))
        )
    } else {
        "one event per request".to_owned()
    }
}

/// Builds the file's endpoints as `run --routes FILE` would, with run's
/// flags as the environment sets them (`CDC_RELAY_*`), else their
/// defaults: a setting valid alone but not over them (a `backoff_base`
/// above the flags' cap, a 5xx in `poison_statuses`, a `request_timeout`
/// not below `--shutdown-timeout`) is refused here too, not first by
/// `run`. Returns each endpoint's delivery settings, in file order.
fn as_run_builds_it(
    path: &std::path::Path,
    file: &RoutesFile,
) -> anyhow::Result<Vec<DispatchConfig>> {
    use clap::Parser as _;
    let argv = [
        std::ffi::OsStr::new("cdc-relay"),
        std::ffi::OsStr::new("run"),
        std::ffi::OsStr::new("--routes"),
        path.as_os_str(),
    ];
    let run = match crate::cli::Cli::try_parse_from(argv) {
        Ok(crate::cli::Cli {
            command: crate::cli::Command::Run(run),
            ..
        }) => run,
        Ok(_) => unreachable!("the argv names run"),
        Err(e) => {
            return Err(ConfigError(format!(
                "run's settings from the environment: {}",
                e.to_string().trim_end()
            ))
            .into());
        }
    };
    let dispatch = run.delivery.dispatch().map_err(ConfigError)?;
    let lanes = run
        .sink
        .routed_lanes(file, &dispatch, Some(run.shutdown_timeout))
        .map_err(|e| {
            ConfigError(format!(
                "{e} (with run's flags as the environment sets them, else their defaults)"
            ))
        })?;
    Ok(lanes.into_iter().map(|l| l.cfg).collect())
}
