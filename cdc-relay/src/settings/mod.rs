//! Settings: validates the parsed command line and builds what the
//! pipeline runs with (connection parameters, the sink, the delivery and
//! relay configuration). Every error names the flag (and its environment
//! variable) to fix.

use std::time::Duration;

use crate::breaker::BreakerConfig;
use event_secret::{EventKeys, Source};

use crate::cli::{DeliveryArgs, GlobalArgs, PruneArgs, RunArgs, SecretArgs, SinkArgs};
use crate::dispatch::{DispatchConfig, Lane, Unrouted};
use crate::metrics::Metrics;
use crate::outbox::{OutboxColumns, TraceColumn};
use crate::prune::{PrunePlan, Schedule};
use crate::relay::{OnSlotLoss, RelayConfig};
use crate::routes::{EndpointSpec, RoutesError, RoutesFile};
use crate::sink::{HttpSink, Signer, Signing, SinkConfig, StatusPolicy};

mod database;

impl GlobalArgs {
    /// Outbox column names.
    pub fn columns(&self) -> OutboxColumns {
        OutboxColumns {
            id: self.id_column.clone(),
            event_type: self.type_column.clone(),
            payload: self.payload_column.clone(),
            aggregate_key: Some(self.aggregate_column.clone()).filter(|c| !c.is_empty()),
            trace: match self.trace_column.as_deref().map(str::trim) {
                None => Some(TraceColumn {
                    name: TraceColumn::DEFAULT.to_owned(),
                    required: false,
                }),
                Some("") => None,
                Some(name) => Some(TraceColumn {
                    name: name.to_owned(),
                    required: true,
                }),
            },
        }
    }
}

impl SecretArgs {
    /// The keys, read now (files included); the error names the setting.
    pub fn keys(&self) -> Result<EventKeys, String> {
        EventKeys::load(
            Source {
                value: self.event_secret.as_deref(),
                file: self.event_secret_file.as_deref(),
            },
            Source {
                value: self.event_secret_previous.as_deref(),
                file: self.event_secret_previous_file.as_deref(),
            },
        )
        .map_err(|e| e.to_string())
    }

    /// A signer for the keys read now, under `--signature-scheme`.
    pub fn signer(&self) -> Result<Signer, String> {
        Ok(Signer::new(self.signature_scheme, &self.keys()?))
    }
}

impl SinkArgs {
    /// The sinks' TLS files, each loaded once to check it (the error names
    /// the flag and the file).
    pub fn sink_tls(&self) -> Result<crate::sink::SinkTls, String> {
        let client_cert = match (&self.sink_client_cert, &self.sink_client_key) {
            (Some(c), Some(k)) => Some((c.clone(), k.clone())),
            (None, None) => None,
            _ => {
                return Err(
                    "--sink-client-cert (CDC_RELAY_SINK_CLIENT_CERT) and --sink-client-key \
                     (CDC_RELAY_SINK_CLIENT_KEY) go together: set both, or neither"
                        .into(),
                );
            }
        };
        let tls = crate::sink::SinkTls {
            ca_file: self.sink_ca_file.clone(),
            client_cert,
        };
        tls.check()?;
        Ok(tls)
    }

    /// Builds the HTTP sink; the error names the setting.
    pub fn build(&self) -> Result<HttpSink, String> {
        at_least(
            "--sink-connection-max-age",
            self.sink_connection_max_age,
            Duration::from_secs(1),
            "below it every request opens a connection",
        )?;
        at_least(
            "--sink-idle-timeout",
            self.sink_idle_timeout,
            Duration::from_secs(1),
            "below it a connection closes between two events",
        )?;
        let Some(url) = &self.sink_url else {
            return Err(
                "--sink-url (or CDC_RELAY_SINK_URL) is required: the inbox URL events are POSTed to, e.g. http://billing:8080/inbox"
                    .into(),
            );
        };
        // Its scheme, host and port were checked by its parser.
        let signer = self.secrets.signer()?;
        let tls = self.sink_tls()?;
        HttpSink::new(SinkConfig {
            url: url.clone(),
            signing: Signing::new(signer),
            connect_timeout: self.sink_connect_timeout,
            request_timeout: self.request_timeout,
            connection_max_age: self.sink_connection_max_age,
            idle_timeout: self.sink_idle_timeout,
            tls,
        })
        .map_err(|e| e.to_string())
    }
}

impl SinkArgs {
    /// The lanes of a routes file's endpoints, in file order, with these
    /// flags' shared settings (connect and pool timeouts, CA file,
    /// signature scheme) and `base` (the delivery flags) under each
    /// endpoint's own. `shutdown` bounds request timeouts. Their series and
    /// breakers are in a registry of their own until `Lane::in_registry`
    /// moves them to a relay's. The error names the file, the endpoint and
    /// the key, or the flag.
    pub fn routed_lanes(
        &self,
        file: &RoutesFile,
        base: &DispatchConfig,
        shutdown: Option<Duration>,
    ) -> Result<Vec<Lane<HttpSink>>, String> {
        let metrics = Metrics::new();
        file.endpoints
            .iter()
            .map(|e| {
                Ok(Lane::routed(
                    e.name.clone(),
                    e.event_types.clone(),
                    endpoint_config(file, e, base).map_err(|err| err.to_string())?,
                    self.endpoint_sink(file, e, shutdown)?,
                    &metrics,
                ))
            })
            .collect()
    }

    /// The HTTP sink of endpoint `e` of `file`: its URL, secret and request
    /// timeout, these flags' other settings. `shutdown` bounds the request
    /// timeout.
    pub fn endpoint_sink(
        &self,
        file: &RoutesFile,
        e: &EndpointSpec,
        shutdown: Option<Duration>,
    ) -> Result<HttpSink, String> {
        let keys = file.keys(e).map_err(|err| err.to_string())?;
        let request_timeout = e.request_timeout.unwrap_or(self.request_timeout);
        if let Some(s) = shutdown
            && request_timeout >= s
        {
            return Err(file.key_error(e, "request_timeout", format!(
                "{request_timeout:?} must be shorter than --shutdown-timeout ({s:?}) so in-flight requests can finish on shutdown"
            )));
        }
        let tls = self.sink_tls()?;
        HttpSink::new(SinkConfig {
            url: e.url.clone(),
            signing: Signing::new(Signer::new(self.secrets.signature_scheme, &keys)),
            connect_timeout: self.sink_connect_timeout,
            request_timeout,
            connection_max_age: self.sink_connection_max_age,
            idle_timeout: self.sink_idle_timeout,
            tls,
        })
        .map_err(|err| file.key_error(e, "url", err.to_string()))
    }
}

/// Endpoint `e`'s delivery settings: `base` (run's flags) with the file's
/// settings over it. The error names the file, the endpoint and the key.
pub fn endpoint_config(
    file: &RoutesFile,
    e: &EndpointSpec,
    base: &DispatchConfig,
) -> Result<DispatchConfig, RoutesError> {
    let backoff_base = e.backoff_base.unwrap_or(base.backoff_base);
    let backoff_cap = e.backoff_cap.unwrap_or(base.backoff_cap);
    if backoff_base.is_zero() || backoff_cap < backoff_base {
        return Err(file.error(
            e,
            "backoff_base",
            format!("must be above 0 and not above backoff_cap ({backoff_cap:?})"),
        ));
    }
    let policy = match &e.poison_statuses {
        Some(p) => StatusPolicy::new(p.clone()).map_err(|m| file.error(e, "poison_statuses", m))?,
        None => base.policy.clone(),
    };
    Ok(DispatchConfig {
        max_in_flight: e.max_in_flight.unwrap_or(base.max_in_flight),
        batch_max_events: e.batch_max_events.unwrap_or(base.batch_max_events),
        batch_max_bytes: e.batch_max_bytes.unwrap_or(base.batch_max_bytes),
        backoff_base,
        backoff_cap,
        retry_after_max: base.retry_after_max,
        policy,
        breaker: BreakerConfig {
            failure_threshold: e
                .failure_threshold
                .unwrap_or(base.breaker.failure_threshold),
            probe_interval: e.probe_interval.unwrap_or(base.breaker.probe_interval),
            storm_threshold: base.breaker.storm_threshold,
            retired_probe_interval: base.breaker.retired_probe_interval,
        },
        max_lag: e.max_lag,
        rate: e.rate,
        auto_resume: e.auto_resume,
    })
}

impl DeliveryArgs {
    /// The delivery settings; the error names the flags.
    pub fn dispatch(&self) -> Result<DispatchConfig, String> {
        if self.backoff_base.is_zero() || self.backoff_cap < self.backoff_base {
            return Err("--backoff-base must be > 0 and not above --backoff-cap".into());
        }
        at_least(
            "--probe-interval",
            self.probe_interval,
            Duration::from_millis(50),
            "below it an open circuit hammers the sink",
        )?;
        at_least(
            "--retired-probe-interval",
            self.retired_probe_interval,
            Duration::from_secs(1),
            "below it a retired endpoint is hammered",
        )?;
        Ok(DispatchConfig {
            max_in_flight: self.max_in_flight as usize,
            batch_max_events: self.batch_max_events as usize,
            batch_max_bytes: self.batch_max_bytes as usize,
            backoff_base: self.backoff_base,
            backoff_cap: self.backoff_cap,
            retry_after_max: self.retry_after_max,
            policy: StatusPolicy::new(self.poison_statuses.clone())?,
            breaker: BreakerConfig {
                failure_threshold: self.failure_threshold,
                probe_interval: self.probe_interval,
                storm_threshold: self.poison_storm_threshold,
                retired_probe_interval: self.retired_probe_interval,
            },
            max_lag: None,
            rate: None,
            auto_resume: true,
        })
    }
}

impl RunArgs {
    /// The relay's configuration and the lanes it delivers to (the one of
    /// `--sink-url`, or one per endpoint of `--routes`); the error names
    /// the flags, or the routes file, endpoint and key.
    pub fn relay(&self, g: &GlobalArgs) -> Result<(RelayConfig, Vec<Lane<HttpSink>>), String> {
        if self.sink.request_timeout >= self.shutdown_timeout {
            return Err(format!(
                "--request-timeout ({:?}) must be shorter than --shutdown-timeout ({:?}) so in-flight requests can finish on shutdown",
                self.sink.request_timeout, self.shutdown_timeout
            ));
        }
        at_least(
            "--slot-stats-interval",
            self.slot_stats_interval,
            Duration::from_secs(1),
            "below it the relay turns into a poller",
        )?;
        at_least(
            "--reconnect-max",
            self.reconnect_max,
            crate::relay::RECONNECT_BASE,
            "the first reconnect delay; below it every retry is immediate: hundreds of connection attempts a second",
        )?;
        at_least(
            "--ready-window",
            self.ready_window,
            Duration::from_secs(1),
            "below it /readyz fails whenever an event waits",
        )?;
        let dispatch = self.delivery.dispatch()?;
        let conn = g.conn()?;
        let replication = g.replication_conn()?;
        let (lanes, unrouted) = match &self.routes.routes {
            None => (
                vec![Lane::single(
                    dispatch.clone(),
                    self.sink.build()?,
                    &Metrics::new(),
                )],
                Unrouted::DeadLetter,
            ),
            Some(path) => {
                if self.on_gap == crate::relay::OnGap::Backfill {
                    return Err("--on-gap backfill is not supported with --routes yet (the backfill has one sink): use --on-gap tell and `cdc-relay backfill` per endpoint".into());
                }
                if self.on_slot_loss != OnSlotLoss::Stop {
                    return Err("--on-slot-loss recreate-and-backfill is not supported with --routes yet (the recovery backfill has one sink): use --on-slot-loss stop and `cdc-relay backfill` per endpoint".into());
                }
                let file = RoutesFile::load(path).map_err(|e| e.to_string())?;
                let lanes =
                    self.sink
                        .routed_lanes(&file, &dispatch, Some(self.shutdown_timeout))?;
                (lanes, file.unrouted)
            }
        };
        let cfg = RelayConfig {
            conn,
            replication,
            slot: g.slot.clone(),
            publications: g.publication.clone(),
            table: g.table.clone(),
            columns: g.columns(),
            application_name: self.application_name.clone(),
            dispatch,
            unrouted,
            window_events: self.delivery.max_pending_events as usize,
            window_bytes: self.delivery.max_pending_bytes,
            shutdown_timeout: self.shutdown_timeout,
            reconnect_max: self.reconnect_max,
            slot_stats_interval: self.slot_stats_interval,
            create_slot: self.create_slot,
            slot_create_timeout: g.slot_create_timeout,
            allow_non_utf8: self.allow_non_utf8,
            on_slot_loss: self.on_slot_loss,
            on_gap: self.on_gap,
            backfill_margin: self.backfill_margin,
            time_column: self.time_column.clone(),
            failover: self.failover,
            standbys: g.standbys()?,
            failover_max_lag: u64::from(self.failover_max_lag),
            max_retained_wal: self.max_retained_wal,
            shard: None,
            stop_at: self.stop_at_lsn,
            claims: None,
        };
        Ok((cfg, lanes))
    }

    /// `--shards N` with `--max-shards K`: `Some((N, min(K, N)))`, `None`
    /// unsharded; the error names the flags that do not go together.
    pub fn sharding(&self, g: &GlobalArgs) -> Result<Option<(u32, u32)>, String> {
        let Some(count) = g.shards else {
            if self.max_shards > 1 {
                return Err(
                    "--max-shards (CDC_RELAY_MAX_SHARDS) needs --shards (CDC_RELAY_SHARDS)".into(),
                );
            }
            return Ok(None);
        };
        if g.publication.len() != 1 {
            return Err(format!(
                "--shards takes one --publication (CDC_RELAY_PUBLICATION), the base of the shards' publication names; got {}",
                g.publication.join(",")
            ));
        }
        if self.on_gap == crate::relay::OnGap::Backfill {
            return Err("--on-gap backfill is not supported with --shards: its backfill would re-send every shard's rows. Use --on-gap tell (docs/operations.md#the-outbox-left-its-publication)".into());
        }
        if self.on_slot_loss == crate::relay::OnSlotLoss::RecreateAndBackfill {
            return Err("--on-slot-loss=recreate-and-backfill is not supported with --shards: its backfill would re-send every shard's rows. Use --on-slot-loss=stop and recover the shard by hand (docs/operations.md#sharding)".into());
        }
        if self.prune_older_than.is_some() {
            return Err(
                "--prune-older-than is not supported with --shards yet: the proof reads one slot"
                    .into(),
            );
        }
        for shard in crate::source::shards::Shard::all(count) {
            let slot = shard.name(&g.slot);
            crate::source::catalog::check_slot_name(&slot)
                .map_err(|e| format!("--slot with --shards {count}: {e}"))?;
        }
        Ok(Some((count, self.max_shards.min(count))))
    }

    /// The relay's opt-in pruning (`--prune-older-than`), `None` when off;
    /// the error names the flag.
    pub fn prune_schedule(&self, g: &GlobalArgs) -> Result<Option<Schedule>, String> {
        // Checked with or without --prune-older-than: a bad value is an
        // error when given, not when it would first be used.
        at_least(
            "--prune-interval",
            self.prune_interval,
            Duration::from_secs(1),
            "below it retention turns into a poller",
        )?;
        let Some(older_than) = self.prune_older_than else {
            return Ok(None);
        };
        Ok(Some(Schedule {
            plan: PrunePlan {
                table: g.table.clone(),
                id_column: g.id_column.clone(),
                time_column: self.time_column.clone(),
                slot: g.slot.clone(),
                older_than,
                batch_rows: self.prune_batch,
                pause: self.prune_pause,
            },
            interval: self.prune_interval,
            first_tick: self.prune_first_tick.unwrap_or(crate::prune::FIRST_TICK),
        }))
    }
}

impl PruneArgs {
    /// What `cdc-relay prune` prunes.
    pub fn plan(&self, g: &GlobalArgs) -> PrunePlan {
        PrunePlan {
            table: g.table.clone(),
            id_column: g.id_column.clone(),
            time_column: self.time_column.clone(),
            slot: g.slot.clone(),
            older_than: self.older_than,
            batch_rows: self.batch,
            pause: self.pause,
        }
    }
}

/// A duration setting's floor: `Err` naming `flag`, the floor and `why`
/// (what a smaller value would do) when `value` is below `min`.
fn at_least(flag: &str, value: Duration, min: Duration, why: &str) -> Result<(), String> {
    if value < min {
        return Err(format!(
            "{flag} must be at least {} ({why}); it is {}",
            humantime::format_duration(min),
            humantime::format_duration(value)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn run_args(extra: &[&str]) -> (GlobalArgs, RunArgs) {
        let mut argv = vec!["cdc-relay", "run", "--sink-url", "http://127.0.0.1:1/inbox"];
        argv.extend_from_slice(extra);
        let cli = Cli::try_parse_from(argv).unwrap();
        let Command::Run(run) = cli.command else {
            panic!("run")
        };
        (cli.global, *run)
    }

    #[test]
    fn relations_between_settings_name_the_flags() {
        let (g, run) = run_args(&["--request-timeout", "20s", "--shutdown-timeout", "10s"]);
        let err = run.relay(&g).unwrap_err();
        assert!(
            err.contains("--request-timeout") && err.contains("--shutdown-timeout"),
            "{err}"
        );
        let (_, run) = run_args(&["--backoff-base", "2s", "--backoff-cap", "1s"]);
        assert!(
            run.delivery
                .dispatch()
                .unwrap_err()
                .contains("--backoff-base")
        );
    }

    /// Issue 14, HTTP manners 1, 2 and 4: the defaults an operator gets.
    #[test]
    fn defaults_keep_http_manners() {
        let (g, run) = run_args(&[]);
        assert_eq!(run.delivery.retry_after_max, Duration::from_secs(60));
        assert!(run.sink.sink_connection_max_age <= Duration::from_secs(300));
        assert!(run.sink.sink_idle_timeout < Duration::from_secs(60));
        assert!(run.shutdown_timeout <= Duration::from_secs(5));
        // The default request timeout fits in the default shutdown budget.
        let err = run.relay(&g).map(|_| ()).unwrap_err();
        assert!(!err.contains("--shutdown-timeout"), "{err}");
    }

    #[test]
    fn config_fault_statuses_cannot_be_poison() {
        for bad in ["404", "400,401", "429"] {
            let (_, run) = run_args(&["--poison-statuses", bad]);
            let err = run.delivery.dispatch().unwrap_err();
            assert!(err.contains("--poison-statuses"), "{bad}: {err}");
        }
        let (_, run) = run_args(&["--poison-statuses", "400,409,422"]);
        assert!(run.delivery.dispatch().is_ok());
    }

    #[test]
    fn secrets_come_from_env_or_file() {
        let (_, mut run) = run_args(&[]);
        let secrets = &mut run.sink.secrets;
        secrets.event_secret = None;
        assert!(secrets.keys().unwrap_err().contains("EVENT_SECRET"));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "s3cret-s3cret-s3cret-s3cret-s3cret\n").unwrap();
        secrets.event_secret_file = Some(path.clone());
        assert_eq!(
            secrets.keys().unwrap().current().as_bytes(),
            b"s3cret-s3cret-s3cret-s3cret-s3cret"
        );
        secrets.event_secret_previous = Some("a,b".into());
        let err = secrets.keys().unwrap_err();
        assert!(
            err.starts_with("EVENT_SECRET_PREVIOUS contains a comma"),
            "{err}"
        );
    }

    #[test]
    fn endpoint_settings_override_the_flags() {
        let f = crate::routes::tests::parse(crate::routes::tests::GOOD).unwrap();
        let base = DispatchConfig {
            max_in_flight: 64,
            batch_max_events: 1,
            batch_max_bytes: 48 << 10,
            backoff_base: Duration::from_millis(50),
            backoff_cap: Duration::from_secs(1),
            retry_after_max: Duration::from_secs(60),
            policy: StatusPolicy::new(vec![400, 413, 422]).unwrap(),
            breaker: BreakerConfig {
                failure_threshold: 5,
                probe_interval: Duration::from_millis(500),
                storm_threshold: 10,
                retired_probe_interval: Duration::from_secs(60),
            },
            max_lag: None,
            rate: None,
            auto_resume: true,
        };
        let b = endpoint_config(&f, &f.endpoints[0], &base).unwrap();
        assert_eq!(b.max_in_flight, 8);
        assert_eq!(b.max_lag, Some(Duration::from_secs(600)));
        assert_eq!(a_lag(&f, &base), None, "absent: never parked for lag");
        let e = crate::routes::tests::parse(&crate::routes::tests::with("max_lag = \"500ms\""))
            .unwrap_err();
        assert_eq!(e.key.as_deref(), Some("max_lag"));
        assert_eq!(b.breaker.probe_interval, Duration::from_millis(250));
        assert_eq!(b.breaker.failure_threshold, 5);
        let a = endpoint_config(&f, &f.endpoints[1], &base).unwrap();
        assert_eq!(a.max_in_flight, 64);
        let bad = crate::routes::tests::parse(&crate::routes::tests::with(
            "backoff_base = \"2s\"\nbackoff_cap = \"1s\"",
        ))
        .unwrap();
        let e = endpoint_config(&bad, &bad.endpoints[0], &base).unwrap_err();
        assert_eq!(e.key.as_deref(), Some("backoff_base"));
    }

    fn a_lag(f: &RoutesFile, base: &DispatchConfig) -> Option<Duration> {
        endpoint_config(f, &f.endpoints[1], base).unwrap().max_lag
    }
}
