//! Per-endpoint metric families: the same figures as the relay-wide ones
//! (which stay, as sums over every endpoint), labelled `endpoint`.
//!
//! Every relay has them: with `--routes` the label is the endpoint's
//! `name` from the routes file, with `--sink-url` it is `default`. One
//! label set in both modes, so a dashboard or an alert written per
//! endpoint works unchanged when a relay moves from `--sink-url` to a
//! routes file (`docs/operations.md#routes-file`).

use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};

/// The `endpoint` label value of the one endpoint of `--sink-url`.
pub const DEFAULT_ENDPOINT: &str = "default";

/// Latency buckets from 0.5 ms to 60 s, seconds (the relay-wide
/// histograms use them too).
pub(crate) fn latency_buckets() -> Vec<f64> {
    // Dense between 1 and 50 ms, where a healthy relay's deliveries land.
    vec![
        0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.035,
        0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ]
}

/// The labelled families, registered once per registry.
#[derive(Clone, Debug)]
pub struct EndpointFamilies {
    delivered: IntCounterVec,
    dead_lettered: IntCounterVec,
    retries: IntCounterVec,
    in_flight: IntGaugeVec,
    pending: IntGaugeVec,
    oldest_pending_age: GaugeVec,
    circuit_state: IntGaugeVec,
    retired: IntGaugeVec,
    parked: IntGaugeVec,
    parked_events: IntCounterVec,
    replayed: IntCounterVec,
    commit_to_delivery: HistogramVec,
    /// `cdc_relay_unrouted_events_total{action}`: events no endpoint's
    /// `event_types` matched, by `action` (`dead_letter`, `skip`).
    pub unrouted: IntCounterVec,
}

/// One endpoint's series (cheap to clone).
#[derive(Clone, Debug)]
pub struct EndpointMetrics {
    /// `cdc_relay_endpoint_events_delivered_total`: events that got a 2xx
    /// from this endpoint.
    pub delivered: IntCounter,
    /// `cdc_relay_endpoint_events_dead_lettered_total`: events this
    /// endpoint refused as poison, written to the dead-letter table.
    pub dead_lettered: IntCounter,
    retries: IntCounterVec,
    name: String,
    /// `cdc_relay_endpoint_in_flight`: requests to this endpoint in flight.
    pub in_flight: IntGauge,
    /// `cdc_relay_endpoint_pending_events`: events routed to this endpoint
    /// and not yet done there.
    pub pending: IntGauge,
    /// `cdc_relay_endpoint_oldest_pending_event_age_seconds`: age of the
    /// oldest event pending at this endpoint, seconds (0 when none): the
    /// alert that says which endpoint holds the slot back.
    pub oldest_pending_age: Gauge,
    /// `cdc_relay_endpoint_circuit_state`: 0 closed, 1 open, 2 probing.
    pub circuit_state: IntGauge,
    /// `cdc_relay_endpoint_retired`: 1 while the endpoint's last answer
    /// was 410 Gone (retired by its receiver; events kept, probed rarely),
    /// else 0.
    pub retired: IntGauge,
    /// `cdc_relay_endpoint_parked`: 1 while the endpoint is parked (its
    /// events go to the dead-letter table with reason `parked`), else 0.
    pub parked: IntGauge,
    /// `cdc_relay_endpoint_parked_events_total`: events of this endpoint
    /// written to the dead-letter table because it is parked.
    pub parked_events: IntCounter,
    /// `cdc_relay_endpoint_replayed_events_total`: parked events the relay
    /// replayed to this endpoint with a 2xx while resuming it.
    pub replayed: IntCounter,
    /// `cdc_relay_endpoint_commit_to_delivery_seconds`: commit time of the
    /// event's transaction to its live 2xx from this endpoint, seconds
    /// (replays of parked rows are not counted): whether one endpoint's
    /// trouble reaches the others' latency.
    pub commit_to_delivery: Histogram,
}

impl EndpointMetrics {
    /// Counts a retry to this endpoint with `reason`, a label from the
    /// fixed list `sink::REASONS`.
    pub fn retry(&self, reason: &str) {
        self.retries.with_label_values(&[&self.name, reason]).inc();
    }

    /// The `endpoint` label value.
    pub fn name(&self) -> &str {
        &self.name
    }
}

fn register<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

impl EndpointFamilies {
    /// Registers the families in `r`.
    pub fn register(r: &Registry) -> Self {
        let ep = &["endpoint"];
        let opts = Opts::new;
        EndpointFamilies {
            delivered: register(
                r,
                IntCounterVec::new(
                    opts(
                        "cdc_relay_endpoint_events_delivered_total",
                        "Events delivered with a 2xx, by endpoint",
                    ),
                    ep,
                )
                .expect("valid metric"),
            ),
            dead_lettered: register(
                r,
                IntCounterVec::new(
                    opts(
                        "cdc_relay_endpoint_events_dead_lettered_total",
                        "Events an endpoint refused as poison, dead-lettered, by endpoint",
                    ),
                    ep,
                )
                .expect("valid metric"),
            ),
            retries: register(
                r,
                IntCounterVec::new(
                    opts(
                        "cdc_relay_endpoint_retries_total",
                        "Delivery retries by endpoint and reason",
                    ),
                    &["endpoint", "reason"],
                )
                .expect("valid metric"),
            ),
            in_flight: register(
                r,
                IntGaugeVec::new(
                    opts(
                        "cdc_relay_endpoint_in_flight",
                        "Requests in flight, by endpoint",
                    ),
                    ep,
                )
                .expect("valid metric"),
            ),
            pending: register(
                r,
                IntGaugeVec::new(
                    opts(
                        "cdc_relay_endpoint_pending_events",
                        "Events routed to an endpoint and not yet done there, by endpoint",
                    ),
                    ep,
                )
                .expect("valid metric"),
            ),
            oldest_pending_age: register(
                r,
                GaugeVec::new(
                    opts(
                        "cdc_relay_endpoint_oldest_pending_event_age_seconds",
                        "Age of the oldest event pending at an endpoint, seconds (0 when none)",
                    ),
                    ep,
                )
                .expect("valid metric"),
            ),
            circuit_state: register(
                r,
                IntGaugeVec::new(
                    opts(
                        "cdc_relay_endpoint_circuit_state",
                        "Circuit breaker of an endpoint: 0 closed, 1 open, 2 probing",
                    ),
                    ep,
                )
                .expect("valid metric"),
            ),
            retired: register(
                r,
                IntGaugeVec::new(
                    opts(
                        "cdc_relay_endpoint_retired",
                        "1 while an endpoint's last answer was 410 Gone (retired: events kept, probed rarely), by endpoint",
                    ),
                    ep,
                )
                .expect("valid metric"),
            ),
            parked: register(
                r,
                IntGaugeVec::new(
                    opts(
                        "cdc_relay_endpoint_parked",
                        "1 while an endpoint is parked (its events are dead-lettered with reason parked), by endpoint",
                    ),
                    ep,
                )
                .expect("valid metric"),
            ),
            parked_events: register(
                r,
                IntCounterVec::new(
                    opts(
                        "cdc_relay_endpoint_parked_events_total",
                        "Events dead-lettered with reason parked because their endpoint is parked, by endpoint",
                    ),
                    ep,
                )
                .expect("valid metric"),
            ),
            replayed: register(
                r,
                IntCounterVec::new(
                    opts(
                        "cdc_relay_endpoint_replayed_events_total",
                        "Parked events the relay replayed with a 2xx while resuming their endpoint, by endpoint",
                    ),
                    ep,
                )
                .expect("valid metric"),
            ),
            commit_to_delivery: register(
                r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "cdc_relay_endpoint_commit_to_delivery_seconds",
                        "Transaction commit time to the event's live 2xx, seconds, by endpoint",
                    )
                    .buckets(latency_buckets()),
                    ep,
                )
                .expect("valid metric"),
            ),
            unrouted: {
                let c = register(r, IntCounterVec::new(opts("cdc_relay_unrouted_events_total", "Events no endpoint's event_types matched, by action (dead_letter, skip)"), &["action"]).expect("valid metric"));
                for action in ["dead_letter", "skip"] {
                    c.with_label_values(&[action]);
                }
                c
            },
        }
    }

    /// The endpoints whose `cdc_relay_endpoint_retired` is 1, by name.
    pub fn retired(&self) -> Vec<String> {
        use prometheus::core::Collector as _;
        self.retired
            .collect()
            .iter()
            .flat_map(|family| family.get_metric())
            .filter(|m| m.get_gauge().get_value() > 0.0)
            .filter_map(|m| m.get_label().first().map(|l| l.value().to_owned()))
            .collect()
    }

    /// The series of endpoint `name`, created at 0.
    pub fn endpoint(&self, name: &str) -> EndpointMetrics {
        let l = &[name];
        EndpointMetrics {
            delivered: self.delivered.with_label_values(l),
            dead_lettered: self.dead_lettered.with_label_values(l),
            retries: self.retries.clone(),
            name: name.to_owned(),
            in_flight: self.in_flight.with_label_values(l),
            pending: self.pending.with_label_values(l),
            oldest_pending_age: self.oldest_pending_age.with_label_values(l),
            circuit_state: self.circuit_state.with_label_values(l),
            retired: self.retired.with_label_values(l),
            parked: self.parked.with_label_values(l),
            parked_events: self.parked_events.with_label_values(l),
            replayed: self.replayed.with_label_values(l),
            commit_to_delivery: self.commit_to_delivery.with_label_values(l),
        }
    }
}
