//! `cdc-relay run`: the admin endpoint, signal handling and the relay,
//! until SIGTERM/SIGINT or a definite error.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::outln;
use crate::admin::{self, Relays};
use crate::cli::{GlobalArgs, LogFormat, OnFatal, RunArgs, SecretArgs};
use crate::dispatch::Lane;
use crate::health::Health;
use crate::metrics::Metrics;
use crate::prune::{self, Schedule};
use crate::relay::{self, RelayConfig, ShardOf};
use crate::sink::{HttpSink, Signer, Signing};
use crate::source::shards::Shard;
use crate::source::stream::StreamError;
use crate::source::{ConnParams, SourceError};

/// `cdc-relay run`; returns the exit code (documented in `--help` and
/// `docs/operations.md`).
pub async fn command(g: &GlobalArgs, a: RunArgs) -> u8 {
    let built = a
        .relay(g)
        .and_then(|r| Ok((r, a.prune_schedule(g)?, a.sharding(g)?)));
    match built {
        Ok(((cfg, lanes), prune, sharding)) => {
            serve_and_run(cfg, lanes, prune, sharding, &a, g.log_format).await
        }
        // A flag, variable or file of the configuration: the same code as
        // a command line clap refuses.
        Err(msg) => super::config_refused(&msg),
    }
}

/// The process exit code for a relay that stopped for good (the table is
/// in `--help` and docs/operations.md; the shipped unit restarts only 1 and
/// 2, and 2 only a few times). A configuration error (a flag, variable or
/// file the relay reads) exits 2 before this applies.
/// 3 the database needs `setup` (slot, publication, table or column
/// missing); 4 the slot was invalidated; 5 the stream holds an outbox
/// change the relay cannot map (nothing after it acknowledged); 6 the slot
/// predates its publication; 7 the slot jumped ahead of where this process
/// left it (events skipped upstream); 1 anything else.
pub fn exit_code(e: &StreamError) -> u8 {
    match e {
        StreamError::Source(e) if e.is_misconnection() => 2,
        StreamError::Source(SourceError::ParkedUnrouted(_)) => 2,
        StreamError::Source(SourceError::SlotMissing { .. } | SourceError::NeedsSetup(_)) => 3,
        StreamError::Source(SourceError::SlotInvalidated { .. }) => 4,
        StreamError::Decode(_)
        | StreamError::Outbox(_)
        | StreamError::Source(SourceError::PayloadType(_) | SourceError::Unconvertible(_)) => 5,
        StreamError::Source(SourceError::SlotPredatesPublication { .. }) => 6,
        StreamError::Source(SourceError::SlotJumped { .. }) => 7,
        StreamError::Source(_) => 1,
    }
}

async fn serve_and_run(
    cfg: RelayConfig,
    lanes: Vec<Lane<HttpSink>>,
    prune: Option<Schedule>,
    sharding: Option<(u32, u32)>,
    a: &RunArgs,
    log_format: LogFormat,
) -> u8 {
    let metrics = Metrics::new();
    let export = match super::start_export(&a.trace, &metrics) {
        Ok(export) => export,
        Err(e) => return super::config_refused(&e.to_string()),
    };
    let tracer = export.as_ref().map(|e| e.tracer().clone());
    let lanes: Vec<_> = lanes
        .into_iter()
        .map(|l| l.traced(tracer.clone()))
        .collect();
    let health = Health::new(a.ready_window);
    let shutdown = CancellationToken::new();
    let units = units(&cfg, sharding, &metrics, &health, a);
    let relays = match sharding {
        None => Relays::one(metrics.clone(), health.clone()),
        Some(_) => Relays::sharded(
            metrics.clone(),
            health.clone(),
            units
                .iter()
                .map(|(_, m, h)| (m.clone(), h.clone()))
                .collect(),
        ),
    };
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
    outln!("{}", listening_line(log_format, &addr));
    let admin_stop = shutdown.clone();
    let admin = tokio::spawn(admin::serve(
        listener,
        relays,
        a.admin_max_connections,
        async move { admin_stop.cancelled().await },
    ));
    tokio::spawn(watch_signals(shutdown.clone()));
    let reload = match &a.routes.routes {
        None => Reload::Flags(a.sink.secrets.clone()),
        // The file was read and validated moments ago; re-read it for the
        // references only.
        Some(path) => match crate::routes::RoutesFile::load(path) {
            Ok(file) => Reload::Routes(file, a.sink.secrets.signature_scheme),
            Err(e) => return super::config_refused(&e.to_string()),
        },
    };
    let signings: Vec<Signing> = lanes.iter().map(|l| l.sink.signing().clone()).collect();
    tokio::spawn(reload_secrets_on_sighup(reload, signings, metrics.clone()));
    for l in &lanes {
        let signer = l.sink.signing().current();
        tracing::info!(
            source = %cfg.conn.display(),
            replication = %cfg.replication.as_ref().map_or_else(|| "the source's server".to_owned(), ConnParams::display),
            slot = %cfg.slot, endpoint = %l.name, sink = %l.sink.display_url(), admin = %addr,
            max_in_flight = l.cfg.max_in_flight, batch_max_events = l.cfg.batch_max_events,
            batch_max_bytes = l.cfg.batch_max_bytes, signature_scheme = %signer.scheme(),
            keys = %signer.keys(), shards = sharding.map_or(0, |(count, _)| count),
            max_shards = sharding.map_or(0, |(_, max)| max),
            traces = export.as_ref().map_or("off", |e| e.destination()), "cdc-relay starting"
        );
    }
    if let Some(schedule) = prune {
        tracing::info!(
            table = %schedule.plan.table, older_than = %humantime::format_duration(schedule.plan.older_than),
            interval = %humantime::format_duration(schedule.interval), "pruning delivered outbox rows older than the window"
        );
        tokio::spawn(prune::keep_pruning(
            cfg.conn.clone(),
            schedule,
            metrics.clone(),
            shutdown.clone(),
        ));
    }
    let result = run_relays(units, lanes, &shutdown).await;
    let code = match &result {
        Ok(()) => {
            tracing::info!("stopped");
            0
        }
        Err(failed) => {
            let (e, failed) = &**failed;
            let code = exit_code(e);
            tracing::error!(error = %e, code, "stopping");
            eprintln!("error: {e}");
            // 3-7 need an operator (the unit does not restart them); 1 exits
            // so the unit's restart can retry it.
            if a.on_fatal == OnFatal::Linger && code >= 3 && !shutdown.is_cancelled() {
                linger(code, e, &metrics, failed, &health, &shutdown).await;
            }
            code
        }
    };
    shutdown.cancel();
    if let Some(export) = export {
        export.shutdown(super::EXPORT_FLUSH).await;
    }
    let _ = admin.await;
    code
}

/// One relay's configuration, metrics and health.
type Unit = (RelayConfig, Metrics, Arc<Health>);

/// The relays the process runs: the one of `cfg` (with the process's
/// metrics and health), or one per shard, each with its slot, publication,
/// `shard`-labelled metrics and health, all sharing `--max-shards` claims.
fn units(
    cfg: &RelayConfig,
    sharding: Option<(u32, u32)>,
    metrics: &Metrics,
    health: &Arc<Health>,
    a: &RunArgs,
) -> Vec<Unit> {
    let Some((count, max)) = sharding else {
        return vec![(cfg.clone(), metrics.clone(), health.clone())];
    };
    let claims = Arc::new(tokio::sync::Semaphore::new(max as usize));
    let base = cfg.publications.first().cloned().unwrap_or_default();
    Shard::all(count)
        .map(|shard| {
            let unit = RelayConfig {
                slot: shard.name(&cfg.slot),
                publications: vec![shard.name(&base)],
                shard: Some(ShardOf {
                    shard,
                    publication_base: base.clone(),
                    slot_base: cfg.slot.clone(),
                }),
                claims: Some(Arc::clone(&claims)),
                ..cfg.clone()
            };
            (
                unit,
                Metrics::for_shard(&shard.tag()),
                Health::new(a.ready_window),
            )
        })
        .collect()
}

/// Runs every relay until all stop. The first definite error stops the
/// others (gracefully, as on SIGTERM) and is the result: one shard that
/// needs an operator means the outbox is not fully delivered, and another
/// process taking that shard would hit the same error.
async fn run_relays(
    units: Vec<Unit>,
    lanes: Vec<Lane<HttpSink>>,
    shutdown: &CancellationToken,
) -> Result<(), Box<(StreamError, Metrics)>> {
    let stop = shutdown.child_token();
    let mut relays = tokio::task::JoinSet::new();
    for (cfg, metrics, health) in units {
        // Each relay counts in its own registry, with breakers of its own.
        let lanes: Vec<Lane<HttpSink>> = lanes
            .iter()
            .cloned()
            .map(|l| {
                let sink = l.sink.clone().with_metrics(metrics.clone());
                l.in_registry(&metrics, sink)
            })
            .collect();
        let stop = stop.clone();
        relays.spawn(async move {
            let outcome = relay::run(cfg, lanes, metrics.clone(), health, stop).await;
            outcome.map_err(|e| Box::new((e, metrics)))
        });
    }
    let mut result = Ok(());
    while let Some(done) = relays.join_next().await {
        let outcome = done.unwrap_or_else(|e| {
            let e = SourceError::Definite(format!("a relay task failed: {e}")).into();
            Err(Box::new((e, Metrics::new())))
        });
        if let Err(failed) = outcome
            && result.is_ok()
        {
            stop.cancel();
            result = Err(failed);
        }
    }
    result
}

/// `--on-fatal linger`: the relay stopped for good with `code`; export
/// that on the process's `metrics` (and, for a lost slot, the slot's state
/// on the `failed` relay's: the shard's, with shards) and fail `/readyz`
/// until `shutdown`, so an alert sees a relay that would otherwise be gone.
async fn linger(
    code: u8,
    e: &StreamError,
    metrics: &Metrics,
    failed: &Metrics,
    health: &Health,
    shutdown: &CancellationToken,
) {
    metrics
        .halted
        .with_label_values(&[code.to_string().as_str()])
        .set(1);
    if let StreamError::Source(SourceError::SlotInvalidated { .. }) = e {
        for status in ["reserved", "extended", "unreserved"] {
            failed.slot_wal_status.with_label_values(&[status]).set(0);
        }
        failed.slot_wal_status.with_label_values(&["lost"]).set(1);
        failed.standby.set(0);
    }
    health.halt(code, &e.to_string());
    tracing::error!(
        code,
        "halted: serving /metrics (cdc_relay_halted) with /readyz failing until SIGTERM (--on-fatal linger); the process then exits {code}"
    );
    shutdown.cancelled().await;
}

/// The line on stdout that says the admin endpoint is bound:
/// `listening on http://ADDR`, or with `--log-format json` the same as a
/// JSON object shaped like the log's lines (`timestamp`, `level`,
/// `message`, `addr`, `target`), so every line a log shipper reads
/// parses.
fn listening_line(format: LogFormat, addr: &str) -> String {
    let message = format!("listening on http://{addr}");
    match format {
        LogFormat::Text => message,
        LogFormat::Json => serde_json::json!({
            "timestamp": humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
            "level": "INFO",
            "message": message,
            "addr": addr,
            "target": "cdc_relay::admin",
        })
        .to_string(),
    }
}

/// The first SIGTERM/SIGINT starts a graceful shutdown; a second one exits
/// at once (130) without draining.
async fn watch_signals(shutdown: CancellationToken) {
    let Some(mut signals) = super::StopSignals::install() else {
        return;
    };
    let first = signals.next().await;
    tracing::info!("{first}: shutting down");
    shutdown.cancel();
    signals.next().await;
    tracing::warn!("second signal: exiting without draining");
    std::process::exit(130);
}

/// On SIGHUP, reads the event secrets again (a `_FILE` picks up its new
/// contents; environment values cannot change under a running process) and
/// puts the new signer in place for every attempt from then on. An attempt
/// in flight finishes with the signer it read. A secret that does not load
/// changes nothing: the keys in use stay, and the error is logged and
/// counted.
/// Where SIGHUP re-reads the secrets from.
enum Reload {
    /// `EVENT_SECRET(_FILE)` and `EVENT_SECRET_PREVIOUS(_FILE)`: the one sink.
    Flags(SecretArgs),
    /// Each endpoint's references in the routes file (in lane order).
    Routes(crate::routes::RoutesFile, crate::sink::SignatureScheme),
}

impl Reload {
    /// The signers, one per endpoint in lane order; the error names the
    /// setting (or the endpoint and key).
    fn signers(&self) -> Result<Vec<Signer>, String> {
        match self {
            Reload::Flags(secrets) => Ok(vec![secrets.signer()?]),
            Reload::Routes(file, scheme) => file
                .endpoints
                .iter()
                .map(|e| {
                    Ok(Signer::new(
                        *scheme,
                        &file.keys(e).map_err(|e| e.to_string())?,
                    ))
                })
                .collect(),
        }
    }
}

async fn reload_secrets_on_sighup(reload: Reload, signings: Vec<Signing>, metrics: Metrics) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hangup) = signal(SignalKind::hangup()) else {
        tracing::error!("cannot install the SIGHUP handler: event secrets cannot be reloaded");
        return;
    };
    while hangup.recv().await.is_some() {
        if let Reload::Routes(started, _) = &reload {
            warn_of_routes_changes(started);
        }
        // All or nothing: one endpoint's bad secret keeps every endpoint's keys.
        match reload.signers() {
            Ok(signers) => {
                for (signing, signer) in signings.iter().zip(signers) {
                    tracing::info!(keys = %signer.keys(), "SIGHUP: event secrets reloaded; attempts from now on sign with them");
                    signing.replace(signer);
                }
                metrics.secret_reloads.with_label_values(&["ok"]).inc();
            }
            Err(error) => {
                tracing::error!(
                    %error,
                    "SIGHUP: event secrets NOT reloaded; still signing with the keys in use"
                );
                metrics.secret_reloads.with_label_values(&["error"]).inc();
            }
        }
    }
}

/// SIGHUP re-reads secrets only: a routes file edited since the start
/// (an endpoint's URL, a new endpoint) is not applied, and the operator
/// who sent SIGHUP to apply it is told so, with what differs.
fn warn_of_routes_changes(started: &crate::routes::RoutesFile) {
    match crate::routes::RoutesFile::load(&started.path) {
        Err(e) => tracing::warn!(
            path = %started.path.display(), error = %e,
            "SIGHUP: the routes file no longer loads; the relay goes on with the file it started with (secrets are re-read from its references). Fix the file before the next restart"
        ),
        Ok(now) => {
            if let Some(changes) = routes_changes(started, &now) {
                tracing::warn!(
                    path = %started.path.display(), %changes,
                    "SIGHUP: the routes file changed since the start, and SIGHUP applies only the event secrets (re-read from the references the relay started with): restart the relay to apply the rest"
                );
            }
        }
    }
}

/// What differs between the routes file the relay started with and the
/// file now, in words (`added: c; removed: a; changed: b`), or `None`.
fn routes_changes(
    started: &crate::routes::RoutesFile,
    now: &crate::routes::RoutesFile,
) -> Option<String> {
    let names = |f: &crate::routes::RoutesFile| -> Vec<String> {
        f.endpoints.iter().map(|e| e.name.clone()).collect()
    };
    let (before, after) = (names(started), names(now));
    let mut parts = Vec::new();
    let added: Vec<&str> = after
        .iter()
        .filter(|n| !before.contains(n))
        .map(String::as_str)
        .collect();
    let removed: Vec<&str> = before
        .iter()
        .filter(|n| !after.contains(n))
        .map(String::as_str)
        .collect();
    let changed: Vec<&str> = started
        .endpoints
        .iter()
        .filter(|e| now.endpoint(&e.name).is_some_and(|n| n != *e))
        .map(|e| e.name.as_str())
        .collect();
    for (what, list) in [("added", added), ("removed", removed), ("changed", changed)] {
        if !list.is_empty() {
            parts.push(format!("{what}: {}", list.join(", ")));
        }
    }
    if started.unrouted != now.unrouted {
        parts.push("unrouted changed".into());
    }
    if parts.is_empty() && before != after {
        parts.push("endpoints reordered".into());
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_routes_file_edited_since_the_start_is_described() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routes.toml");
        let entry = |name: &str, url: &str| {
            format!(
                "[[endpoint]]\nname = \"{name}\"\nurl = \"{url}\"\nevent_types = [\"*\"]\nsecret_env = \"S\"\n\n"
            )
        };
        let load = |text: String| {
            std::fs::write(&path, text).unwrap();
            crate::routes::RoutesFile::load(&path).unwrap()
        };
        let started = load(entry("a", "http://a/in") + &entry("b", "http://b/in"));
        assert_eq!(routes_changes(&started, &started.clone()), None);
        let now = load(entry("b", "http://b2/in") + &entry("c", "http://c/in"));
        assert_eq!(
            routes_changes(&started, &now).as_deref(),
            Some("added: c; removed: a; changed: b")
        );
        let now = load(entry("b", "http://b/in") + &entry("a", "http://a/in"));
        assert_eq!(
            routes_changes(&started, &now).as_deref(),
            Some("endpoints reordered")
        );
    }

    #[test]
    fn the_listening_line_follows_the_log_format() {
        assert_eq!(
            listening_line(LogFormat::Text, "127.0.0.1:9187"),
            "listening on http://127.0.0.1:9187"
        );
        let json: serde_json::Value =
            serde_json::from_str(&listening_line(LogFormat::Json, "127.0.0.1:9187"))
                .expect("a JSON line");
        assert_eq!(json["message"], "listening on http://127.0.0.1:9187");
        assert_eq!(json["addr"], "127.0.0.1:9187");
        assert_eq!(json["level"], "INFO");
        assert!(
            json["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')),
            "{json}"
        );
    }

    #[test]
    fn exit_codes_are_distinct() {
        let slot = || "s".to_owned();
        let missing: StreamError = SourceError::SlotMissing { slot: slot() }.into();
        let lost: StreamError = SourceError::SlotInvalidated {
            slot: slot(),
            reason: None,
            since: None,
        }
        .into();
        let auth: StreamError = SourceError::Definite("auth".into()).into();
        let no_publication: StreamError = SourceError::NeedsSetup("p".into()).into();
        let text_payload: StreamError = SourceError::PayloadType("t".into()).into();
        let predates: StreamError = SourceError::SlotPredatesPublication {
            slot: slot(),
            publication: "p".into(),
        }
        .into();
        let pooler: StreamError = SourceError::ThroughPooler { answer: "a".into() }.into();
        assert_eq!(
            [
                &missing,
                &lost,
                &auth,
                &no_publication,
                &text_payload,
                &predates,
                &pooler
            ]
            .map(exit_code),
            [3, 4, 1, 3, 5, 6, 2]
        );
    }
}
