//! Prometheus metrics (prefix `cdc_relay_`), one registry per relay.
//!
//! Names follow Prometheus conventions: units in the name (`_seconds`,
//! `_bytes`), counters end in `_total`. LSNs are exported as gauges holding
//! the byte position (f64 is exact up to 2^53 bytes = 8 PiB of WAL).

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// `cdc_relay_delivery_attempts_total{outcome}`: how an attempt was judged
/// (one per `sink::Disposition`, poison during a storm counted as a retry).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// A 2xx.
    Delivered,
    /// Poison: the event goes to the dead-letter table.
    DeadLetter,
    /// Transient (or poison during a storm): retried.
    Retry,
    /// The sink refuses the relay itself: retried, loudly.
    ConfigFault,
    /// 410 Gone: the endpoint is retired; retried rarely.
    Retired,
    /// A batch refused whole (a poison status, or a 207 without per-event
    /// answers): split in halves, its events judged apart.
    Split,
}

impl AttemptOutcome {
    /// Every outcome.
    pub const ALL: [AttemptOutcome; 6] = [
        AttemptOutcome::Delivered,
        AttemptOutcome::DeadLetter,
        AttemptOutcome::Retry,
        AttemptOutcome::ConfigFault,
        AttemptOutcome::Retired,
        AttemptOutcome::Split,
    ];

    /// The metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Delivered => "delivered",
            AttemptOutcome::DeadLetter => "dead_letter",
            AttemptOutcome::Retry => "retry",
            AttemptOutcome::ConfigFault => "config_fault",
            AttemptOutcome::Retired => "retired",
            AttemptOutcome::Split => "split",
        }
    }
}

/// Every `outcome` label of `cdc_relay_delivery_attempts_total`
/// ([`AttemptOutcome::as_str`]).
pub const OUTCOMES: [&str; 6] = {
    let mut out = [""; 6];
    let mut i = 0;
    while i < AttemptOutcome::ALL.len() {
        out[i] = AttemptOutcome::ALL[i].as_str();
        i += 1;
    }
    out
};

/// All relay metrics. Cheap to clone (every field is an `Arc` inside).
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// Outbox events read from the stream.
    pub events_received: IntCounter,
    /// Events that got a 2xx.
    pub events_delivered: IntCounter,
    /// Events written to the dead-letter table.
    pub events_dead_lettered: IntCounter,
    /// Delivery attempts by `outcome` (delivered, retry, dead_letter,
    /// config_fault, retired) and `status_class` (2xx … 5xx, none).
    pub delivery_attempts: IntCounterVec,
    /// Time from sending a request to its response, seconds.
    pub request_duration: Histogram,
    /// Commit timestamp of the event's transaction to its 2xx, seconds.
    pub commit_to_delivery: Histogram,
    /// Requests in flight now.
    pub in_flight: IntGauge,
    /// Events received and not yet done, once per endpoint an event goes
    /// to (with a routes file, more than the window holds).
    pub pending_events: IntGauge,
    /// `cdc_relay_window_events`: events the memory window holds, each once
    /// however many endpoints it goes to (`--max-pending-events` at most).
    pub window_events: IntGauge,
    /// `cdc_relay_window_wait_seconds_total`: time the stream waited for
    /// room in the memory window, seconds (it reads nothing meanwhile).
    pub window_wait_seconds: prometheus::Counter,
    /// End LSN of the last transaction received (bytes).
    pub received_lsn: IntGauge,
    /// LSN last confirmed to the server (bytes).
    pub confirmed_lsn: IntGauge,
    /// Server WAL end from the last keepalive or XLogData (bytes).
    pub server_wal_lsn: IntGauge,
    /// Age of the oldest event admitted and not yet done, seconds (0 when none).
    pub oldest_unconfirmed_event_age: prometheus::Gauge,
    /// Replication session restarts by `cause`.
    pub reconnects: IntCounterVec,
    /// 1 while waiting as a hot standby for the slot, else 0.
    pub standby: IntGauge,
    /// Retries by `reason`, a label from the fixed list
    /// `sink::REASONS` (`http_5xx`, `timeout`, ...):
    /// exact statuses go to the logs only.
    pub retries: IntCounterVec,
    /// Slot figures from the side connection: lag in bytes.
    pub slot_lag_bytes: IntGauge,
    /// WAL the slot keeps on the server, `pg_current_wal_lsn() -
    /// restart_lsn`, bytes: what `--max-retained-wal` bounds.
    pub retained_wal_bytes: IntGauge,
    /// `--max-retained-wal`, bytes (0: no budget), for the alert on
    /// retained WAL near it.
    pub retained_wal_budget_bytes: IntGauge,
    /// Logical slots of the relay's database other than its own.
    pub other_logical_slots: IntGauge,
    /// Circuit state: 0 closed, 1 open, 2 half-open (probing).
    pub circuit_state: IntGauge,
    /// Slot `wal_status` as a one-hot gauge by `status`.
    pub slot_wal_status: IntGaugeVec,
    /// Slot `safe_wal_size`, bytes (-1 when unlimited).
    pub slot_safe_wal_size_bytes: IntGauge,
    /// Standby status updates sent, by `cause`: `interval` (the periodic
    /// update, including ones carrying a new confirmed LSN) and
    /// `keepalive_reply` (the server asked for one).
    pub status_updates: IntCounterVec,
    /// 1 while the outbox is in a streamed publication (as the slot monitor
    /// last read), else 0.
    pub publication_includes_outbox: IntGauge,
    /// 1 while the server withholds the stream (its walsender stays behind
    /// the flushed WAL: `source::withheld`), else 0.
    pub stream_withheld: IntGauge,
    /// Times the outbox was found out of its publication, or out and back
    /// between two readings: each is a span whose inserts were not streamed.
    pub publication_gaps: IntCounter,
    /// Publication gaps whose window was re-sent from the table
    /// (`--on-gap backfill`).
    pub gaps_healed: IntCounter,
    /// Changes the stream carried that are not outbox inserts, by
    /// `relation` (`schema.table`; at most [`IGNORED_RELATIONS`] values,
    /// then `other`).
    pub ignored_changes: IntCounterVec,
    /// 1 while every standby listed with `--standby-url` holds a
    /// persistent, synced copy of the slot within `--failover-max-lag`.
    pub failover_ready: IntGauge,
    /// Standbys listed with `--standby-url` (0: failover not watched).
    pub failover_standbys: IntGauge,
    /// Sessions refused because the slot jumped ahead of where this
    /// process left it with events undelivered (the process then exits 7).
    pub slot_jumps: IntCounter,
    /// Seconds since the server last sent anything on the stream (or the
    /// watchdog last found the walsender reading our replies), at scrape time.
    pub seconds_since_server_message: prometheus::Gauge,
    /// `cdc_relay_clock_skew_seconds`: this machine's clock minus the
    /// database server's, seconds, from the last stream message's send time
    /// (the network delay included); positive: this clock is ahead.
    /// Delivery latency is corrected by it (`crate::clock`).
    pub clock_skew: prometheus::Gauge,
    /// Event secret reloads (SIGHUP) by `result`: `ok` (the new keys sign
    /// from the next attempt on) or `error` (the old keys stay; the log
    /// says why).
    pub secret_reloads: IntCounterVec,
    /// `cdc_relay_halted{code}`: 1 while the relay has stopped for good and
    /// lingers (`--on-fatal linger`), labelled with the exit code it will
    /// exit with; no series before.
    pub halted: IntGaugeVec,
    /// `cdc_relay_dead_letters_waiting`: rows in `cdc_relay_dead_letter`
    /// (events neither replayed nor discarded yet), as the slot monitor
    /// last counted them.
    pub dead_letters_waiting: prometheus::IntGauge,
    /// Times a sink's `Retry-After` paused every delivery (a later pause
    /// that extends one counts again).
    pub sink_pauses: IntCounter,
    /// Requests sent again at once on a new connection: the sink never
    /// processed them (an HTTP/2 stream refused or above a GOAWAY's last
    /// stream, a request canceled on an idle connection that had closed),
    /// or a kept-alive connection closed under them before any answer. At
    /// most once per attempt, and not sink failures.
    pub sink_fresh_connection_retries: IntCounter,
    /// Connections that refused requests (an HTTP/2 GOAWAY or
    /// `REFUSED_STREAM`) or closed under them (an HTTP/1.1 connection that
    /// had answered before): one per connection, however many requests it
    /// refused.
    pub sink_connection_events: IntCounter,
    /// `cdc_relay_pruned_rows_total`: outbox rows deleted by the relay's
    /// opt-in pruning (`run --prune-older-than`).
    pub pruned_rows: IntCounter,
    /// `cdc_relay_prune_failures_total`: ticks of the opt-in pruning that
    /// failed (or could not connect), each logged at WARN and tried again
    /// at the next tick.
    pub prune_failures: IntCounter,
    /// `cdc_relay_outbox_table_size_bytes`: the outbox's total size
    /// (`pg_total_relation_size`: heap, indexes, TOAST, every partition),
    /// bytes, as the last prune tick read it; 0 without pruning.
    pub outbox_table_bytes: IntGauge,
    /// The families labelled `endpoint` (`crate::endpoint_metrics`).
    pub endpoints: crate::endpoint_metrics::EndpointFamilies,
}

/// Distinct `relation` label values of `cdc_relay_ignored_changes_total`
/// before the rest count as `other`.
pub const IGNORED_RELATIONS: usize = 50;

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// `metric`, registered in `r`.
fn register<M: prometheus::core::Collector + Clone + 'static>(r: &Registry, metric: M) -> M {
    r.register(Box::new(metric.clone())).expect("unique metric");
    metric
}

fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    register(r, IntCounter::new(name, help).expect("valid metric"))
}

fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    register(r, IntGauge::new(name, help).expect("valid metric"))
}

fn float_gauge(r: &Registry, name: &str, help: &str) -> prometheus::Gauge {
    register(r, prometheus::Gauge::new(name, help).expect("valid metric"))
}

fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    register(
        r,
        IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"),
    )
}

fn histogram(r: &Registry, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    let opts = HistogramOpts::new(name, help).buckets(buckets);
    register(r, Histogram::with_opts(opts).expect("valid metric"))
}

/// `cdc_relay_status_updates_total{cause}`, both causes present from the
/// start so `rate()` has a zero to start from.
fn status_updates(r: &Registry) -> IntCounterVec {
    let c = counter_vec(
        r,
        "cdc_relay_status_updates_total",
        "Standby status updates sent to the server, by cause",
        &["cause"],
    );
    for cause in ["interval", "keepalive_reply"] {
        c.with_label_values(&[cause]);
    }
    c
}

impl Metrics {
    /// A fresh registry with every relay metric registered.
    pub fn new() -> Self {
        Self::registered(Registry::new())
    }

    /// The metrics of one shard's relay (`run --shards`): every series
    /// carries the label `shard="<k>of<N>"`. Render several with
    /// [`render_merged`].
    pub fn for_shard(tag: &str) -> Self {
        let labels = std::collections::HashMap::from([("shard".to_owned(), tag.to_owned())]);
        Self::registered(Registry::new_custom(None, Some(labels)).expect("a valid constant label"))
    }

    fn registered(r: Registry) -> Self {
        let oldest = float_gauge(
            &r,
            "cdc_relay_oldest_unconfirmed_event_age_seconds",
            "Age of the oldest event received and not yet delivered or dead-lettered, seconds",
        );
        let wal_status = register(
            &r,
            IntGaugeVec::new(
                Opts::new(
                    "cdc_relay_slot_wal_status",
                    "Slot wal_status (1 for the current status)",
                ),
                &["status"],
            )
            .expect("valid metric"),
        );
        let build_info = IntGaugeVec::new(
            Opts::new(
                "cdc_relay_build_info",
                "Always 1; the labels say which build runs (package version, git commit)",
            ),
            &["version", "commit"],
        )
        .expect("valid metric");
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION"), crate::GIT_COMMIT])
            .set(1);
        register(&r, build_info);
        Metrics {
            events_received: counter(
                &r,
                "cdc_relay_events_received_total",
                "Outbox events read from the slot",
            ),
            events_delivered: counter(
                &r,
                "cdc_relay_events_delivered_total",
                "Outbox events delivered with a 2xx",
            ),
            events_dead_lettered: counter(
                &r,
                "cdc_relay_events_dead_lettered_total",
                "Outbox events written to the dead-letter table",
            ),
            delivery_attempts: counter_vec(
                &r,
                "cdc_relay_delivery_attempts_total",
                "Delivery attempts by outcome and HTTP status class",
                &["outcome", "status_class"],
            ),
            request_duration: histogram(
                &r,
                "cdc_relay_request_duration_seconds",
                "Sink request duration, seconds",
                crate::endpoint_metrics::latency_buckets(),
            ),
            commit_to_delivery: histogram(
                &r,
                "cdc_relay_commit_to_delivery_seconds",
                "Transaction commit time to the event's 2xx, seconds",
                crate::endpoint_metrics::latency_buckets(),
            ),
            in_flight: gauge(&r, "cdc_relay_in_flight", "Sink requests in flight"),
            pending_events: gauge(
                &r,
                "cdc_relay_pending_events",
                "Events received and not yet done, once per endpoint an event goes to",
            ),
            window_events: gauge(
                &r,
                "cdc_relay_window_events",
                "Events the memory window holds (at most --max-pending-events)",
            ),
            window_wait_seconds: register(
                &r,
                prometheus::Counter::new(
                    "cdc_relay_window_wait_seconds_total",
                    "Time the stream waited for room in the memory window, seconds",
                )
                .expect("valid metric"),
            ),
            received_lsn: gauge(
                &r,
                "cdc_relay_received_lsn",
                "End LSN of the last transaction received (bytes)",
            ),
            confirmed_lsn: gauge(
                &r,
                "cdc_relay_confirmed_lsn",
                "LSN confirmed to the server (bytes)",
            ),
            server_wal_lsn: gauge(
                &r,
                "cdc_relay_server_wal_lsn",
                "Server WAL end seen on the stream (bytes)",
            ),
            oldest_unconfirmed_event_age: oldest,
            reconnects: counter_vec(
                &r,
                "cdc_relay_reconnects_total",
                "Replication session restarts by cause",
                &["cause"],
            ),
            standby: gauge(
                &r,
                "cdc_relay_standby",
                "1 while waiting as hot standby for the slot",
            ),
            retries: counter_vec(
                &r,
                "cdc_relay_retries_total",
                "Delivery retries by reason",
                &["reason"],
            ),
            slot_lag_bytes: gauge(
                &r,
                "cdc_relay_slot_lag_bytes",
                "pg_current_wal_lsn() - confirmed_flush_lsn of the slot (bytes)",
            ),
            retained_wal_bytes: gauge(
                &r,
                "cdc_relay_retained_wal_bytes",
                "pg_current_wal_lsn() - restart_lsn of the slot: WAL the slot keeps on the server (bytes)",
            ),
            retained_wal_budget_bytes: gauge(
                &r,
                "cdc_relay_retained_wal_budget_bytes",
                "--max-retained-wal: above it the endpoint holding the oldest pending event is parked (bytes; 0: no budget)",
            ),
            other_logical_slots: gauge(
                &r,
                "cdc_relay_other_logical_slots",
                "Logical slots of the relay's database other than its own (each can read every row change there)",
            ),
            circuit_state: gauge(
                &r,
                "cdc_relay_circuit_state",
                "Circuit breaker: 0 closed, 1 open, 2 probing",
            ),
            slot_wal_status: wal_status,
            slot_safe_wal_size_bytes: gauge(
                &r,
                "cdc_relay_slot_safe_wal_size_bytes",
                "Bytes of WAL that can still be written before the slot is lost (-1: unlimited)",
            ),
            status_updates: status_updates(&r),
            publication_includes_outbox: gauge(
                &r,
                "cdc_relay_publication_includes_outbox",
                "1 while the outbox table is in a streamed publication, else 0",
            ),
            stream_withheld: gauge(
                &r,
                "cdc_relay_stream_withheld",
                "1 while the server withholds the stream: the walsender sends nothing new while the WAL goes on (see the log)",
            ),
            publication_gaps: counter(
                &r,
                "cdc_relay_publication_gaps_total",
                "Spans in which the outbox was out of its publication (inserts not streamed: backfill them)",
            ),
            gaps_healed: counter(
                &r,
                "cdc_relay_gaps_healed_total",
                "Publication gaps whose window was re-sent from the table (--on-gap backfill)",
            ),
            ignored_changes: counter_vec(
                &r,
                "cdc_relay_ignored_changes_total",
                "Streamed changes that are not outbox inserts, by relation",
                &["relation"],
            ),
            failover_ready: gauge(
                &r,
                "cdc_relay_failover_ready",
                "1 while every listed standby holds a persistent, synced copy of the slot within --failover-max-lag",
            ),
            failover_standbys: gauge(
                &r,
                "cdc_relay_failover_standbys",
                "Standbys whose copy of the slot the relay watches (--standby-url)",
            ),
            slot_jumps: counter(
                &r,
                "cdc_relay_slot_jumps_total",
                "Times the slot was found ahead of where this relay left it with events undelivered",
            ),
            seconds_since_server_message: float_gauge(
                &r,
                "cdc_relay_seconds_since_server_message",
                "Seconds since the server last sent anything on the replication stream",
            ),
            clock_skew: float_gauge(
                &r,
                "cdc_relay_clock_skew_seconds",
                "This machine's clock minus the database server's, seconds, from the last stream message's send time (network delay included; positive: this clock is ahead)",
            ),
            secret_reloads: counter_vec(
                &r,
                "cdc_relay_secret_reloads_total",
                "Event secret reloads on SIGHUP by result (ok, error: the previous keys stay in use)",
                &["result"],
            ),
            halted: register(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "cdc_relay_halted",
                        "1 while the relay has stopped for good and lingers (--on-fatal linger); code = the exit code it exits with",
                    ),
                    &["code"],
                )
                .expect("valid metric"),
            ),
            dead_letters_waiting: gauge(
                &r,
                "cdc_relay_dead_letters_waiting",
                "Rows in cdc_relay_dead_letter: events neither replayed nor discarded yet (read by the slot monitor: exact below 10000, PostgreSQL's live-row count above)",
            ),
            sink_pauses: counter(
                &r,
                "cdc_relay_sink_pauses_total",
                "Times a Retry-After from the sink paused every delivery, probes included",
            ),
            sink_fresh_connection_retries: counter(
                &r,
                "cdc_relay_sink_fresh_connection_retries_total",
                "Requests sent again at once on a new connection: the sink never processed them (refused stream, GOAWAY, an idle connection found closed) or a kept-alive connection closed under them before any answer",
            ),
            sink_connection_events: counter(
                &r,
                "cdc_relay_sink_connection_events_total",
                "Sink connections that refused requests (GOAWAY, REFUSED_STREAM) or closed under them (an HTTP/1.1 connection that had answered before), once per connection",
            ),
            pruned_rows: counter(
                &r,
                "cdc_relay_pruned_rows_total",
                "Outbox rows deleted by the relay's pruning (run --prune-older-than): older than the window and proven delivered",
            ),
            prune_failures: counter(
                &r,
                "cdc_relay_prune_failures_total",
                "Ticks of the relay's pruning that failed or could not connect (a lock held past lock_timeout, a missing grant): logged at WARN, tried again at the next tick",
            ),
            outbox_table_bytes: gauge(
                &r,
                "cdc_relay_outbox_table_size_bytes",
                "Total size of the outbox table (heap, indexes, TOAST, partitions) at the last prune tick, bytes",
            ),
            endpoints: crate::endpoint_metrics::EndpointFamilies::register(&r),
            registry: r,
        }
        .prime()
    }

    /// Starts the known label values at 0 so `rate()` and alerts see a series
    /// before the first event of its kind.
    fn prime(self) -> Self {
        for cause in ["transient", "watchdog", "slot_active"] {
            self.reconnects.with_label_values(&[cause]);
        }
        for result in ["ok", "error"] {
            self.secret_reloads.with_label_values(&[result]);
        }
        for outcome in OUTCOMES {
            for class in ["2xx", "3xx", "4xx", "5xx", "none"] {
                self.delivery_attempts.with_label_values(&[outcome, class]);
            }
        }
        self
    }

    /// The registry's content in the Prometheus text exposition format.
    pub fn render(&self) -> String {
        encode(&self.registry.gather())
    }

    /// The underlying registry (to add process metrics or test).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }
}

/// `families` in the Prometheus text exposition format.
pub(crate) fn encode(families: &[prometheus::proto::MetricFamily]) -> String {
    let mut buf = Vec::new();
    TextEncoder::new()
        .encode(families, &mut buf)
        .expect("text encoding into a Vec cannot fail");
    String::from_utf8(buf).expect("the text format is UTF-8")
}

mod merged;
pub use merged::{PROCESS_FAMILIES, render_merged};

#[cfg(test)]
mod tests;
