//! One job's life: attempts through the circuit breaker until the event is
//! done — a 2xx, or a committed dead-letter row.
//!
//! ```text
//!  breaker.admit ─▶ Sink::post ─▶ classify ─┬─ Delivered ─────────────────────────▶ done
//!        ▲                                  ├─ DeadLetter (not a storm) ─▶ store ──▶ done
//!        └──────────── backoff sleep ◀──────┴─ Retry | ConfigFault | storm
//! ```
//!
//! A dead-letter write is retried until it commits; the event stays pending
//! meanwhile. Only a lost store (the side connection closed) ends the
//! pipeline, and with it the session.
//!
//! Once the pipeline is stopping (shutdown), no new attempt starts: a
//! delivery waiting for the breaker or sleeping in backoff gives up at once
//! and its event stays pending (unconfirmed, so it is sent again after a
//! restart); an attempt already on the wire finishes.

use std::future::Future;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::breaker::{Admission, Breaker, Signal};
use crate::deadletter::{DeadLetterStore, NewDeadLetter, StoreError};
use crate::endpoint_metrics::EndpointMetrics;
use crate::metrics::Metrics;
use crate::outbox::{OutboxEvent, UnreadableRow};
use crate::pace::Pacer;
use crate::sink::{Attempt, Disposition, Prepared, Reason, Sink, classify, status_class};

use super::park::Park;
use super::{DispatchConfig, DispatchError};

/// How a job ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Finished {
    /// The event is done: delivered or dead-lettered.
    Done,
    /// The pipeline is stopping and the event is not done: it stays
    /// pending and is never confirmed by this session.
    Abandoned,
}

/// How one attempt went, judged ([`Delivery::attempt`]).
pub(super) enum Tried {
    /// A 2xx.
    Delivered,
    /// The endpoint refused the event itself (and no poison storm is on):
    /// it is to be dead-lettered.
    Poison(Reason, Attempt),
    /// Not delivered; worth retrying later (the endpoint failing, or a
    /// configuration fault).
    Failed {
        reason: Reason,
        retry_after: Option<std::time::Duration>,
        attempt: Attempt,
    },
}

/// How an interruptible wait of a delivery ended.
enum Waited<T> {
    Done(T),
    Stopping,
    Parked,
}

/// What a job does.
#[derive(Debug)]
pub enum Work {
    /// Deliver an event to the job's endpoint until it is done there (one
    /// job per endpoint the event is routed to, sharing the event).
    Deliver(Arc<OutboxEvent>),
    /// Dead-letter a row that cannot become an event.
    DeadLetter(Box<UnreadableRow>),
    /// Dead-letter an event no endpoint's `event_types` match (reason
    /// `unrouted`).
    Unrouted(Arc<OutboxEvent>),
}

/// What every delivery task of one endpoint shares (one allocation).
pub struct Delivery<S, D> {
    pub(super) cfg: DispatchConfig,
    pub(super) sink: S,
    pub(super) store: Arc<D>,
    metrics: Metrics,
    pub(super) endpoint: EndpointMetrics,
    /// The endpoint's name for its dead-letter rows; `None` for the one
    /// endpoint of `--sink-url`.
    pub(super) dead_letter_endpoint: Option<String>,
    pub(super) stopping: CancellationToken,
    pub(super) breaker: Breaker,
    pub(super) park: Park,
    /// The endpoint's rate cap (`rate`), shared by live deliveries and the
    /// replay of its parked rows.
    pub(super) pace: Option<Pacer>,
}

/// Where a [`Delivery`] sends and writes.
pub struct DeliveryParts<S, D> {
    /// Delivery settings of the endpoint.
    pub cfg: DispatchConfig,
    /// The endpoint.
    pub sink: S,
    /// Where dead letters are written.
    pub store: Arc<D>,
    /// Relay-wide metrics.
    pub metrics: Metrics,
    /// The endpoint's labelled series.
    pub endpoint: EndpointMetrics,
    /// The endpoint's name for its dead-letter rows (`None`: one-endpoint
    /// mode, the column stays NULL).
    pub dead_letter_endpoint: Option<String>,
    /// Cancelled when shutdown begins.
    pub stopping: CancellationToken,
    /// The endpoint's breaker.
    pub breaker: Breaker,
    /// The endpoint's parking switch: once thrown, its events are
    /// dead-lettered with reason `parked` instead of delivered.
    pub park: Park,
}

/// Counts one request in `cdc_relay_in_flight` (and its endpoint's) while
/// it lives, so an attempt abandoned mid-flight (its session ended) is
/// uncounted too.
struct InFlight<'a>(&'a Metrics, &'a EndpointMetrics);

impl<'a> InFlight<'a> {
    fn start(metrics: &'a Metrics, endpoint: &'a EndpointMetrics) -> Self {
        metrics.in_flight.inc();
        endpoint.in_flight.inc();
        InFlight(metrics, endpoint)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.dec();
        self.1.in_flight.dec();
    }
}

impl<S: Sink, D: DeadLetterStore> Delivery<S, D> {
    /// A delivery context for one endpoint of a pipeline.
    pub fn new(p: DeliveryParts<S, D>) -> Self {
        Delivery {
            pace: p.cfg.rate.map(Pacer::new),
            cfg: p.cfg,
            sink: p.sink,
            store: p.store,
            metrics: p.metrics,
            endpoint: p.endpoint,
            dead_letter_endpoint: p.dead_letter_endpoint,
            stopping: p.stopping,
            breaker: p.breaker,
            park: p.park,
        }
    }

    /// Does job `seq` (its place in stream order) until it is done, or
    /// until the pipeline stops with it not done.
    pub async fn run(&self, seq: u64, work: Work) -> Result<Finished, DispatchError> {
        match work {
            Work::Deliver(event) if self.park.is_parked() => self.park_event(&event).await,
            Work::Deliver(event) => self.deliver(seq, &event).await,
            Work::DeadLetter(row) => {
                tracing::warn!(event_id = %crate::shown(&row.event_id), problem = %row.problem, "unreadable outbox row");
                self.dead_letter(&NewDeadLetter::unreadable(&row)).await
            }
            Work::Unrouted(event) => {
                self.metrics
                    .endpoints
                    .unrouted
                    .with_label_values(&["dead_letter"])
                    .inc();
                self.dead_letter(&NewDeadLetter::unrouted(&event)).await
            }
        }
    }

    /// Waits for `wait` unless the pipeline starts stopping first (`None`).
    async fn unless_stopping<T>(&self, wait: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            biased;
            _ = self.stopping.cancelled() => None,
            t = wait => Some(t),
        }
    }

    /// Waits for `wait` unless the pipeline stops or the endpoint is parked
    /// first.
    async fn unless_interrupted<T>(&self, wait: impl Future<Output = T>) -> Waited<T> {
        tokio::select! {
            biased;
            _ = self.stopping.cancelled() => Waited::Stopping,
            _ = self.park.parked() => Waited::Parked,
            t = wait => Waited::Done(t),
        }
    }

    /// Writes `event`'s dead letter with reason `parked` (its endpoint is
    /// parked): the event is then done at this endpoint.
    async fn park_event(&self, event: &OutboxEvent) -> Result<Finished, DispatchError> {
        let row = NewDeadLetter::parked(event, self.endpoint.name(), &self.park.why());
        let done = self.write_dead_letter(&row, Write::Park).await?;
        if done == Finished::Done {
            self.endpoint.parked_events.inc();
        }
        Ok(done)
    }

    /// Delivers one event until it is done: a 2xx, or dead-lettered.
    async fn deliver(&self, seq: u64, event: &OutboxEvent) -> Result<Finished, DispatchError> {
        let request = self.sink.prepare(event);
        let mut backoff = self.backoff();
        let first_attempt = unix_micros();
        let mut attempts: u32 = 0;
        loop {
            let admission = match self.unless_interrupted(self.breaker.admit(seq)).await {
                Waited::Done(a) => a,
                Waited::Stopping => {
                    self.breaker.withdraw(seq);
                    return Ok(Finished::Abandoned);
                }
                Waited::Parked => {
                    self.breaker.withdraw(seq);
                    return self.park_event(event).await;
                }
            };
            // The rate cap after the breaker: deliveries held by an open
            // circuit do not all go at once when it closes.
            if let Some(pace) = &self.pace {
                match self.unless_interrupted(pace.wait()).await {
                    Waited::Done(()) => {}
                    Waited::Stopping => {
                        self.breaker.release(admission);
                        return Ok(Finished::Abandoned);
                    }
                    Waited::Parked => {
                        self.breaker.release(admission);
                        return self.park_event(event).await;
                    }
                }
            }
            attempts += 1;
            // Parking abandons an attempt on the wire: the endpoint is
            // stuck or slow, and the aggregate's later events must not wait
            // for its request timeout. It may have arrived; the replay of
            // its parked row then delivers it again (at-least-once).
            let tried = tokio::select! {
                biased;
                _ = self.park.parked() => None,
                tried = self.attempt(admission, event, &request, true) => Some(tried),
            };
            let Some(tried) = tried else {
                self.breaker.release(admission);
                return self.park_event(event).await;
            };
            let (reason, retry_after, attempt) = match tried {
                Tried::Delivered => {
                    tracing::debug!(event_id = %event.id, commit_lsn = %crate::shown(&event.commit_lsn), attempts, "delivered");
                    return Ok(Finished::Done);
                }
                Tried::Poison(r, attempt) => {
                    let mut row =
                        NewDeadLetter::rejected(event, &attempt, &r, attempts, first_attempt);
                    row.endpoint.clone_from(&self.dead_letter_endpoint);
                    let done = self.dead_letter(&row).await?;
                    if done == Finished::Done {
                        self.endpoint.dead_lettered.inc();
                    }
                    return Ok(done);
                }
                Tried::Failed {
                    reason,
                    retry_after,
                    attempt,
                } => (reason, retry_after, attempt),
            };
            let delay = backoff.next_delay(retry_after, &mut rand::rng());
            if attempts == 1 || attempts.is_multiple_of(20) {
                tracing::warn!(
                    endpoint = %self.endpoint.name(), event_id = %event.id, commit_lsn = %crate::shown(&event.commit_lsn), attempts,
                    reason = %reason, detail = %attempt.detail(),
                    retry_in_ms = delay.as_millis() as u64, "delivery failed; will retry"
                );
            }
            match self.unless_interrupted(tokio::time::sleep(delay)).await {
                Waited::Done(()) => {}
                Waited::Stopping => return Ok(Finished::Abandoned),
                Waited::Parked => return self.park_event(event).await,
            }
        }
    }

    /// Makes one attempt admitted by the breaker, judges it, and records
    /// the outcome in the breaker and the metrics (a `live` delivery counts
    /// as delivered; a replay of a parked row as replayed). A `Retry-After`
    /// pauses every delivery of the endpoint.
    pub(super) async fn attempt(
        &self,
        admission: Admission,
        event: &OutboxEvent,
        request: &Prepared,
        live: bool,
    ) -> Tried {
        let metrics = &self.metrics;
        let started = Instant::now();
        let attempt = {
            let _in_flight = InFlight::start(metrics, &self.endpoint);
            self.sink.post(&event.id, request).await
        };
        metrics
            .request_duration
            .observe(started.elapsed().as_secs_f64());
        let (outcome, signal, reason) = match classify(&attempt, &self.cfg.policy) {
            Disposition::Delivered => {
                self.breaker.record(admission, Signal::Success, "");
                count_attempt(metrics, "delivered", &attempt);
                if live {
                    metrics.events_delivered.inc();
                    self.endpoint.delivered.inc();
                    let since = seconds_since_commit(event.commit_time_micros);
                    metrics.commit_to_delivery.observe(since);
                    self.endpoint.commit_to_delivery.observe(since);
                } else {
                    self.endpoint.replayed.inc();
                }
                return Tried::Delivered;
            }
            Disposition::DeadLetter(r) if self.breaker.poison(&event.id) => {
                self.breaker
                    .record(admission, Signal::DeadLettered, &r.to_string());
                count_attempt(metrics, "dead_letter", &attempt);
                tracing::warn!(
                    endpoint = %self.endpoint.name(), event_id = %event.id, commit_lsn = %crate::shown(&event.commit_lsn), reason = %r,
                    detail = %attempt.detail(), "poison event: writing it to the dead-letter table"
                );
                return Tried::Poison(r, attempt);
            }
            // During a poison storm, poison waits like a transient failure.
            Disposition::DeadLetter(r) | Disposition::Retry(r) => ("retry", Signal::Transient, r),
            Disposition::ConfigFault(r) => ("config_fault", Signal::ConfigFault, r),
        };
        // The breaker logs the exact status; the metric gets the bounded label.
        self.breaker.record(admission, signal, &reason.to_string());
        count_attempt(metrics, outcome, &attempt);
        metrics.retries.with_label_values(&[reason.label]).inc();
        self.endpoint.retry(reason.label);
        let retry_after = match &attempt {
            Attempt::Response { retry_after, .. } => *retry_after,
            _ => None,
        };
        if let Some(asked) = retry_after {
            // The sink asked for quiet: every delivery waits, not just this one.
            let pause = asked.min(self.cfg.retry_after_max);
            self.breaker
                .pause_until(tokio::time::Instant::now() + pause);
            tracing::warn!(
                endpoint = %self.endpoint.name(), event_id = %event.id, reason = %reason, retry_after_s = asked.as_secs_f64(),
                pause_s = pause.as_secs_f64(), "the sink asked for quiet (Retry-After): every delivery pauses"
            );
        }
        Tried::Failed {
            reason,
            retry_after,
            attempt,
        }
    }

    /// Writes a dead-letter row, retrying until it is committed. The event
    /// stays pending meanwhile; a lost store ends the pipeline.
    async fn dead_letter(&self, row: &NewDeadLetter) -> Result<Finished, DispatchError> {
        self.write_dead_letter(row, Write::Insert).await
    }

    /// Writes a dead-letter row as `how` says, retrying until the store
    /// has it. The event stays pending meanwhile; a lost store ends the
    /// pipeline.
    async fn write_dead_letter(
        &self,
        row: &NewDeadLetter,
        how: Write,
    ) -> Result<Finished, DispatchError> {
        let mut backoff = self.backoff();
        loop {
            let written = match how {
                Write::Insert => self.store.insert(row).await.map(Some),
                Write::Park => self.store.park(row).await,
            };
            match written {
                Ok(id) => {
                    self.metrics.events_dead_lettered.inc();
                    if how == Write::Park {
                        // Parking was logged once; its rows are counted.
                        tracing::debug!(dead_letter_id = ?id, event_id = %crate::shown(&row.event_id), "parked");
                    } else {
                        tracing::warn!(dead_letter_id = id.unwrap_or_default(), event_id = %crate::shown(&row.event_id), error = %row.error, "dead-lettered");
                    }
                    return Ok(Finished::Done);
                }
                Err(StoreError::Lost(e)) => return Err(DispatchError::StoreLost(e)),
                Err(StoreError::Failed(e)) => {
                    tracing::error!(error = %e, event_id = %crate::shown(&row.event_id), "cannot write the dead-letter row; the event stays pending");
                    let delay = backoff.next_delay(None, &mut rand::rng());
                    if self
                        .unless_stopping(tokio::time::sleep(delay))
                        .await
                        .is_none()
                    {
                        return Ok(Finished::Abandoned);
                    }
                }
            }
        }
    }

    pub(super) fn backoff(&self) -> Backoff {
        Backoff::new(
            self.cfg.backoff_base,
            self.cfg.backoff_cap,
            self.cfg.retry_after_max,
        )
    }
}

/// How [`Delivery::write_dead_letter`] writes its row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Write {
    /// [`DeadLetterStore::insert`]: done once committed.
    Insert,
    /// [`DeadLetterStore::park`]: done once the store has it (queued behind
    /// the flush gate, or committed).
    Park,
}

fn count_attempt(metrics: &Metrics, outcome: &str, attempt: &Attempt) {
    metrics
        .delivery_attempts
        .with_label_values(&[outcome, status_class(attempt)])
        .inc();
}

/// PostgreSQL timestamps count microseconds from 2000-01-01 00:00:00 UTC.
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

/// Microseconds since the Unix epoch, now.
pub fn unix_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

fn seconds_since_commit(commit_time_micros: i64) -> f64 {
    let unix = commit_time_micros.saturating_add(PG_EPOCH_UNIX_MICROS);
    (unix_micros().saturating_sub(unix).max(0) as f64) / 1e6
}
