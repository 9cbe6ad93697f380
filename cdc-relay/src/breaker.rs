//! The circuit breaker with probe, and the poison-storm guard
//! (`docs/architecture.md#circuit-breaker`).
//!
//! ```text
//!            K consecutive transient failures,
//!            a poison storm, or a configuration fault
//!  Closed ───────────────────────────────────────────▶ Open
//!    ▲                                                  │ one probe (the longest waiting
//!    │                 first 2xx                        │ event) every probe interval
//!    └──────────────────────────────────────────────────┘
//! ```
//!
//! While open, dispatch pauses: every delivery waits in [`Breaker::admit`]
//! and only the one waiting longest may go, once per (jittered) probe
//! interval, so a dead downstream sees about two requests per second at the
//! 500 ms default, and a recovered one gets its next request within one
//! interval. The first 2xx closes the circuit and releases the whole window
//! at once.
//!
//! Slow start: until the sink answers (a 2xx or a poison verdict) — at start
//! and again after any failure — one attempt at a time goes out, so a relay
//! started while the sink is down, or a window of retries after an outage
//! begins, sends it one request at a time, not the whole window.
//!
//! Session start: until the sink has answered in this session, a failed
//! attempt is followed by the next only after a (jittered) probe interval,
//! the pace of an open circuit. A relay that starts or takes over the slot
//! knows nothing of the sink now — what it answered in an earlier session
//! may be long stale (a standby that held the slot before) — and must not
//! send the K failures that open its circuit back to back, nor its whole
//! window, on top of the probes a relay killed during the outage sent
//! (`docs/architecture.md#circuit-breaker`). Its first attempt still goes at
//! once, so a start with a healthy sink loses nothing.
//!
//! Pause: a `Retry-After` from the sink (a 429 or 503 asking for quiet)
//! holds every delivery in [`Breaker::admit`], probes included, until the
//! time it named (capped by `--retry-after-max`): the sink asked the relay,
//! not one event, to come back later.
//!
//! Storm guard: when poison verdicts hit `storm_threshold` distinct events in
//! a row (no 2xx between), the sink is more likely broken than the events:
//! dead-lettering stops, the circuit opens, and the events wait for a 2xx.
//! Only a 2xx to a request admitted after the run's first verdict counts
//! ([`Admission`] is numbered): one sent before it and answered late says
//! nothing of the sink now.
//!
//! Retired: a 410 Gone says the endpoint was retired on purpose (the
//! Standard Webhooks convention). The circuit opens as for a configuration
//! fault, the endpoint is marked retired (`cdc_relay_endpoint_retired`,
//! `/readyz`), and probes slow to `retired_probe_interval` (a minute by
//! default): nobody is coming back soon, and a probe every half second
//! would be a request every half second to a receiver that asked for none.
//! The first 2xx clears it like any open circuit.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::metrics::Metrics;

mod state;

pub use state::{Admission, STILL_OPEN_LOG_EVERY};
use state::{OpenSpell, State};

/// Breaker settings.
#[derive(Clone, Debug)]
pub struct BreakerConfig {
    /// Consecutive transient failures that open the circuit (K).
    pub failure_threshold: u32,
    /// Time between probes while open (stretched by up to 20 % of jitter).
    pub probe_interval: Duration,
    /// Distinct consecutive poison events that count as a storm.
    pub storm_threshold: u32,
    /// Time between probes while the endpoint is retired (410 Gone),
    /// stretched by jitter like `probe_interval`.
    pub retired_probe_interval: Duration,
}

/// Circuit state, as exported by the `cdc_relay_circuit_state` gauge.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CircuitState {
    /// Deliveries flow.
    Closed = 0,
    /// Deliveries wait; probes go out.
    Open = 1,
}

/// What an attempt told the breaker.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Signal {
    /// A 2xx.
    Success,
    /// A transient failure (timeout, connection error, 408/425/429/5xx).
    Transient,
    /// A configuration fault (401, 403, 404, 405, 3xx): opens at once; the
    /// hint says what to check (`sink::classify::config_fault_hint`).
    ConfigFault(&'static str),
    /// 410 Gone: opens at once, marks the endpoint retired, and probes
    /// only every `retired_probe_interval`.
    Retired,
    /// A poison verdict that was dead-lettered: the sink is up and judging
    /// events, so the circuit closes like on a 2xx (the poison run goes on).
    DeadLettered,
}

/// Shared by every delivery, and kept across sessions (a clone is the same
/// breaker): a reconnect neither closes an open circuit nor forgets a
/// poison storm, so a broken sink does not get a fresh window, nor a fresh
/// run of dead letters, every time the stream reconnects.
#[derive(Clone, Debug)]
pub struct Breaker {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    cfg: BreakerConfig,
    state: Mutex<State>,
    changed: Notify,
    metrics: Metrics,
    /// The endpoint's `cdc_relay_endpoint_circuit_state`.
    endpoint_state: Option<prometheus::IntGauge>,
    /// The endpoint's `cdc_relay_endpoint_retired`.
    retired: prometheus::IntGauge,
    /// Whether this breaker sets the relay-wide `cdc_relay_circuit_state`
    /// (the one endpoint of `--sink-url`; with `--routes` the per-endpoint
    /// gauge is the one to read).
    relay_wide: bool,
    /// The endpoint's name, in every log line (`default` for `--sink-url`).
    endpoint: String,
}

impl Breaker {
    /// A closed breaker for the one endpoint of `--sink-url`: it sets
    /// `cdc_relay_circuit_state` and the `default` endpoint's gauge.
    pub fn new(cfg: BreakerConfig, metrics: Metrics) -> Self {
        Self::build(
            cfg,
            metrics,
            true,
            crate::endpoint_metrics::DEFAULT_ENDPOINT,
        )
    }

    /// A closed breaker for one endpoint of a routes file: it sets that
    /// endpoint's `cdc_relay_endpoint_circuit_state` only.
    pub fn for_endpoint(cfg: BreakerConfig, metrics: Metrics, endpoint: &str) -> Self {
        Self::build(cfg, metrics, false, endpoint)
    }

    fn build(cfg: BreakerConfig, metrics: Metrics, relay_wide: bool, endpoint: &str) -> Self {
        let series = metrics.endpoints.endpoint(endpoint);
        if relay_wide {
            metrics.circuit_state.set(CircuitState::Closed as i64);
        }
        series.circuit_state.set(CircuitState::Closed as i64);
        series.retired.set(0);
        let shared = Shared {
            cfg,
            state: Mutex::new(State::closed()),
            changed: Notify::new(),
            metrics,
            endpoint_state: Some(series.circuit_state),
            retired: series.retired,
            relay_wide,
            endpoint: endpoint.to_owned(),
        };
        Breaker {
            shared: Arc::new(shared),
        }
    }

    /// A new session starts: the deliveries of the last one are gone (their
    /// tasks were dropped), so nothing waits and no probe is in flight. The
    /// circuit, the failure count and the storm stay as they were; that the
    /// sink answered does not: the session may begin long after the last
    /// answer (a standby that held the slot before takes it over again), so
    /// it starts like a fresh relay, one paced attempt at a time until the
    /// sink answers.
    pub fn new_session(&self) {
        let mut s = self.lock();
        s.waiting.clear();
        s.probe_in_flight = false;
        s.proven = false;
        s.answered = false;
        s.unanswered_since = None;
        drop(s);
        self.shared.changed.notify_waiters();
    }

    /// How long the sink may leave every attempt admitted since its last
    /// answer unanswered before it counts as silent: two probe intervals
    /// (1 s by default). A sink that answers anything within it, even
    /// slowly, is not silent.
    fn silence(&self) -> Duration {
        self.shared.cfg.probe_interval * 2
    }

    /// The current state.
    pub fn state(&self) -> CircuitState {
        self.lock().circuit
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared
            .state
            .lock()
            .expect("breaker state lock is never poisoned")
    }

    /// Waits until delivery `seq` (its stream order) may make an attempt.
    ///
    /// Deliveries that must wait (an open circuit, slow start, a pause)
    /// go in the order they began waiting, not in stream order: a delivery
    /// that failed and comes back after its backoff waits behind those
    /// already waiting, so one event the sink keeps failing cannot take
    /// every probe and hold back the events of other aggregates.
    pub async fn admit(&self, seq: u64) -> Admission {
        // This delivery's place in the queue, taken when it first waits.
        let mut place: Option<u64> = None;
        loop {
            let notified = self.shared.changed.notified();
            let wait_until = {
                let mut s = self.lock();
                if let Some(until) = s.paused_until.filter(|&u| u > Instant::now()) {
                    // The sink asked for quiet: nobody goes, not even a probe.
                    s.queue(&mut place, seq);
                    until
                } else {
                    s.paused_until = None;
                    let now = Instant::now();
                    let silent = s
                        .unanswered_since
                        .is_some_and(|t| now.saturating_duration_since(t) >= self.silence());
                    if s.circuit == CircuitState::Closed && s.proven && !silent {
                        if let Some(p) = place {
                            s.waiting.remove(&p);
                        }
                        s.unanswered_since.get_or_insert(now);
                        return s.admission(false);
                    }
                    // Open, or closed in slow start: the delivery waiting
                    // longest goes alone. Paced (one per probe interval)
                    // while open, and while the sink has never answered.
                    let mine = s.queue(&mut place, seq);
                    let oldest = s.waiting.first_key_value().map(|(p, _)| *p) == Some(mine);
                    let paced = s.circuit == CircuitState::Open || !s.answered;
                    if !oldest || s.probe_in_flight {
                        // Only the probe's outcome can change anything for this
                        // delivery, and `record` notifies. (Waiting until
                        // `next_probe_at`, already past while a probe is in
                        // flight, would spin until the probe returns.)
                        Instant::now() + Duration::from_secs(3600)
                    } else if !paced || Instant::now() >= s.next_probe_at {
                        s.probe_in_flight = true;
                        s.waiting.remove(&mine);
                        s.unanswered_since.get_or_insert(now);
                        return s.admission(true);
                    } else {
                        s.next_probe_at
                    }
                }
            };
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep_until(wait_until) => {}
            }
        }
    }

    /// Delivery `seq` stopped waiting in [`admit`](Self::admit) (the
    /// pipeline is stopping): it no longer counts as the oldest waiting one.
    pub fn withdraw(&self, seq: u64) {
        let removed = {
            let mut s = self.lock();
            let before = s.waiting.len();
            s.waiting.retain(|_, waiting| *waiting != seq);
            s.waiting.len() != before
        };
        if removed {
            self.shared.changed.notify_waiters();
        }
    }

    /// An admitted delivery makes no attempt after all (the pipeline is
    /// stopping, or its endpoint was parked meanwhile): a probe's turn
    /// passes to the next waiting delivery, with nothing recorded.
    pub fn release(&self, admission: Admission) {
        if admission.is_probe() {
            self.lock().probe_in_flight = false;
            self.shared.changed.notify_waiters();
        }
    }

    /// Records an attempt's outcome.
    pub fn record(&self, admission: Admission, signal: Signal, reason: &str) {
        let mut s = self.lock();
        if admission.is_probe() {
            s.probe_in_flight = false;
        }
        // An answer, or a failure the relay saw: not silence.
        s.unanswered_since = None;
        match signal {
            // A 2xx to a request admitted before the run of refusals began
            // says the sink took events then, not now (it may have turned
            // on every event since): an answer, but it neither ends the
            // run nor the storm, nor closes the circuit.
            Signal::Success if !s.poison_run.is_empty() && admission.number <= s.run_after => {
                s.proven = true;
                s.answered = true;
                s.consecutive_failures = 0;
            }
            Signal::Success => {
                s.proven = true;
                s.answered = true;
                s.consecutive_failures = 0;
                s.poison_run.clear();
                s.storm = false;
                if s.retired {
                    tracing::info!(endpoint = %self.shared.endpoint, "the endpoint is no longer retired: it answered 2xx after 410 Gone");
                    s.retired = false;
                    self.shared.retired.set(0);
                }
                if s.circuit == CircuitState::Open {
                    tracing::info!(endpoint = %self.shared.endpoint, "circuit closed: the sink answered 2xx; full window resumes");
                    self.set(&mut s, CircuitState::Closed);
                }
            }
            Signal::DeadLettered => {
                s.proven = true;
                s.answered = true;
                s.consecutive_failures = 0;
                s.retired = false;
                self.shared.retired.set(0);
                if s.circuit == CircuitState::Open {
                    tracing::info!(endpoint = %self.shared.endpoint, "circuit closed: the sink answers again");
                    self.set(&mut s, CircuitState::Closed);
                }
            }
            Signal::Transient => {
                // Back to one attempt at a time until the sink answers again:
                // the rest of the window must not pile retries onto a sink
                // that just failed.
                s.proven = false;
                s.consecutive_failures = s.consecutive_failures.saturating_add(1);
                if s.circuit == CircuitState::Closed
                    && s.consecutive_failures >= self.shared.cfg.failure_threshold
                {
                    tracing::warn!(
                        endpoint = %self.shared.endpoint,
                        failures = s.consecutive_failures,
                        reason,
                        probe_interval_ms = self.shared.cfg.probe_interval.as_millis() as u64,
                        "circuit opened: dispatch paused, probing"
                    );
                    self.set(&mut s, CircuitState::Open);
                }
            }
            Signal::ConfigFault(hint) => {
                s.proven = false;
                if s.circuit == CircuitState::Closed {
                    tracing::error!(
                        endpoint = %self.shared.endpoint,
                        reason,
                        hint,
                        "circuit opened: the sink rejects the relay itself; events are kept, not dead-lettered"
                    );
                    self.set(&mut s, CircuitState::Open);
                }
            }
            Signal::Retired => {
                s.proven = false;
                if !s.retired {
                    tracing::error!(
                        endpoint = %self.shared.endpoint,
                        reason,
                        probe_interval_s = self.shared.cfg.retired_probe_interval.as_secs(),
                        hint = RETIRED_HINT,
                        "the endpoint is retired: the sink answered 410 Gone; events are kept, not dead-lettered, and it is probed rarely"
                    );
                    s.retired = true;
                    self.shared.retired.set(1);
                }
                if s.circuit == CircuitState::Closed {
                    self.set(&mut s, CircuitState::Open);
                }
            }
        }
        let failed = matches!(
            signal,
            Signal::Transient | Signal::ConfigFault(_) | Signal::Retired
        );
        if admission.is_probe()
            && failed
            && s.circuit == CircuitState::Open
            && let Some((open_for, probes)) =
                s.open.as_mut().and_then(|o| o.probe_failed(Instant::now()))
        {
            tracing::warn!(
                endpoint = %self.shared.endpoint,
                open_for_s = open_for.as_secs(),
                failed_probes = probes,
                reason,
                "circuit still open: the sink keeps failing; dispatch stays paused, probing"
            );
        }
        if admission.is_probe() && (s.circuit == CircuitState::Open || !s.answered) {
            // The next paced attempt: a probe interval after this one ended.
            s.next_probe_at = Instant::now() + self.jittered_interval(s.retired);
        }
        drop(s);
        self.shared.changed.notify_waiters();
    }

    /// The sink asked for quiet (`Retry-After`): no attempt starts, probes
    /// included, before `until`. A later pause extends it; an earlier one
    /// changes nothing.
    pub fn pause_until(&self, until: Instant) {
        let mut s = self.lock();
        if s.paused_until.is_some_and(|u| u >= until) {
            return;
        }
        s.paused_until = Some(until);
        drop(s);
        self.shared.metrics.sink_pauses.inc();
        self.shared.changed.notify_waiters();
    }

    /// A poison verdict for `event_id`: `true` when the event may be
    /// dead-lettered, `false` during a storm (then the circuit is open and the
    /// event must wait like a transient failure).
    pub fn poison(&self, event_id: &str) -> bool {
        let mut s = self.lock();
        if s.storm {
            return false;
        }
        if s.poison_run.is_empty() {
            s.run_after = s.admitted;
        }
        s.poison_run.insert(event_id.to_owned());
        if s.poison_run.len() >= self.shared.cfg.storm_threshold as usize {
            s.storm = true;
            tracing::error!(
                endpoint = %self.shared.endpoint,
                distinct_events = s.poison_run.len(),
                "poison storm: the sink refuses every event; dead-lettering stopped and circuit opened until a 2xx"
            );
            if s.circuit == CircuitState::Closed {
                self.set(&mut s, CircuitState::Open);
            }
            drop(s);
            self.shared.changed.notify_waiters();
            return false;
        }
        true
    }

    fn set(&self, s: &mut State, to: CircuitState) {
        s.open = (to == CircuitState::Open).then(|| OpenSpell::new(Instant::now()));
        s.circuit = to;
        s.consecutive_failures = 0;
        s.probe_in_flight = false;
        s.next_probe_at = Instant::now() + self.jittered_interval(s.retired);
        if self.shared.relay_wide {
            self.shared.metrics.circuit_state.set(to as i64);
        }
        if let Some(g) = &self.shared.endpoint_state {
            g.set(to as i64);
        }
    }

    /// Whether a poison storm is on: refusals wait like transient failures
    /// until a 2xx.
    pub fn in_storm(&self) -> bool {
        self.lock().storm
    }

    /// Whether the endpoint's last answer was 410 Gone.
    pub fn is_retired(&self) -> bool {
        self.lock().retired
    }

    /// The probe interval (the retired one while the endpoint is retired)
    /// stretched by up to 20 %: never shorter, so an open circuit never
    /// sends more than one probe per interval.
    fn jittered_interval(&self, retired: bool) -> Duration {
        let interval = if retired {
            self.shared.cfg.retired_probe_interval
        } else {
            self.shared.cfg.probe_interval
        };
        let base = interval.as_secs_f64();
        Duration::from_secs_f64(base * rand::rng().random_range(1.0..=1.2))
    }
}

/// What to do about a 410 Gone.
pub const RETIRED_HINT: &str = "the receiver retired this endpoint on purpose (410 Gone): point --sink-url (or the routes file's url) at its replacement, or remove the endpoint from the routes file, then restart; its pending events are delivered then";

#[cfg(test)]
mod tests;
