//! A job's attempts at its lane, one event at a time: the breaker, the
//! request, the verdict, the backoff, the dead letter.

use std::future::Future;
use std::time::{Duration, Instant};

use opentelemetry::trace::TraceId;

use crate::backoff::Backoff;
use crate::breaker::{Admission, Signal};
use crate::dead_letter::{DeadLetterStore, NewDeadLetter, StoreError, Urgency};
use crate::dispatch::lane::Lane;
use crate::dispatch::span::AttemptSpan;
use crate::dispatch::{DispatchError, Persist};
use crate::endpoint_metrics::EndpointMetrics;
use crate::metrics::{AttemptOutcome, Metrics};
use crate::outbox::OutboxEvent;
use crate::sink::{Attempt, Disposition, Prepared, Reason, Sink, classify, status_class};

use super::Ctx;
use super::batch::{attempt_batch, ids_of};
use super::judge::{EventVerdict, Verdict, failure_label, judge, own_answer};

/// How a delivery ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finished {
    /// A 2xx with this status: done.
    Delivered(u16),
    /// Refused as poison, its dead-letter row committed: done.
    DeadLettered,
    /// Its lane was parked meanwhile: the dispatcher hands the job to the
    /// dead-letter writer.
    Parked,
    /// The pipeline is stopping and the event is not done: it stays
    /// pending and is never confirmed by this session.
    Stopped,
    /// [`Persist::OneAttempt`]: refused as poison and kept as it was (the
    /// answer's detail); not done, its aggregate's later jobs not tried.
    Kept(String),
    /// [`Persist::OneAttempt`] or [`Persist::UntilFailing`]: the sink is
    /// failing (the answer's detail); not done, and the pipeline stops.
    Failing(String),
}

/// How one attempt went, judged ([`attempt`]).
pub(super) enum Tried {
    /// A 2xx with this status.
    Delivered(u16),
    /// The endpoint refused the event itself (and no poison storm is on),
    /// or the batch as a whole.
    Poison(Reason, Attempt),
    /// A batch's 207: each event's verdict, in the order the batch
    /// carried them, and the answer's `Retry-After` (the events sent
    /// again wait at least that long).
    PerEvent(Vec<EventVerdict>, Option<Duration>),
    /// Not delivered; worth retrying later (the endpoint failing, or a
    /// configuration fault).
    Failed {
        reason: Reason,
        retry_after: Option<Duration>,
        attempt: Attempt,
    },
}

/// How an interruptible wait of a delivery ended.
pub(super) enum Waited<T> {
    Done(T),
    Stopping,
    Parked,
}

/// Counts one request in `cdc_relay_in_flight` (and its endpoint's) while
/// it lives, so an attempt abandoned mid-flight (its session ended) is
/// uncounted too.
pub(super) struct InFlight<'a>(&'a Metrics, &'a EndpointMetrics);

impl<'a> InFlight<'a> {
    pub(super) fn start(metrics: &'a Metrics, endpoint: &'a EndpointMetrics) -> Self {
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

/// Waits for `wait` unless the pipeline stops or the lane is parked first.
pub(super) async fn unless_interrupted<S, D, T>(
    lane: &Lane<S>,
    ctx: &Ctx<D>,
    wait: impl Future<Output = T>,
) -> Waited<T> {
    tokio::select! {
        biased;
        _ = ctx.stopping.cancelled() => Waited::Stopping,
        _ = lane.park.parked() => Waited::Parked,
        t = wait => Waited::Done(t),
    }
}

/// What one request carries.
#[derive(Clone, Copy)]
pub(super) enum Carried<'a> {
    /// One event, in the per-event format, with its attempt's span.
    One(&'a OutboxEvent),
    /// A batch: its events in body order, and its id.
    Batch(&'a [&'a OutboxEvent], &'a str),
}

/// How a request's attempts ended ([`until_answered`]).
pub(super) enum Answered {
    /// A 2xx with this status: every event carried is done.
    Delivered(u16),
    /// Refused: the one event as poison (by this attempt), or the batch as
    /// a whole (it is split).
    Refused(Reason, Attempt),
    /// A batch answered per event: each event's verdict, in body order,
    /// and the answer's `Retry-After`.
    PerEvent(Vec<EventVerdict>, Option<Duration>),
    /// A batch failed [`SPLIT_AFTER`] attempts in a row: split it, so that
    /// one event the endpoint keeps failing holds back only its aggregate.
    Split,
    /// Not done: the wait was interrupted, or the sink is failing and the
    /// pipeline's [`Persist`] gives up.
    Ended(Finished),
}

/// Failed attempts in a row after which a batch is split
/// ([`Answered::Split`]).
pub(super) const SPLIT_AFTER: u32 = 2;

/// Attempts `request` (carrying `carried`; `seq`: the breaker's place for
/// it, its first job's) through the breaker and the pace, retrying
/// failures with backoff (and `Retry-After`), until the endpoint answers
/// with a verdict, a batch has failed [`SPLIT_AFTER`] times, or the wait
/// is interrupted. `attempts` counts them.
pub(super) async fn until_answered<S: Sink, D>(
    lane: &Lane<S>,
    ctx: &Ctx<D>,
    seq: u64,
    carried: Carried<'_>,
    request: &Prepared,
    attempts: &mut u32,
) -> Answered {
    let mut backoff = lane.backoff();
    let mut failures = 0;
    loop {
        let admission = match unless_interrupted(lane, ctx, lane.breaker.admit(seq)).await {
            Waited::Done(a) => a,
            other => {
                lane.breaker.withdraw(seq);
                return Answered::Ended(interrupted(&other));
            }
        };
        // The rate cap after the breaker: deliveries held by an open
        // circuit do not all go at once when it closes.
        if let Some(pace) = &lane.pace {
            let waited = unless_interrupted(lane, ctx, pace.wait()).await;
            if !matches!(waited, Waited::Done(())) {
                lane.breaker.release(admission);
                return Answered::Ended(interrupted(&waited));
            }
        }
        *attempts += 1;
        let number = *attempts;
        // Parking abandons an attempt on the wire: the endpoint is stuck or
        // slow, and the aggregate's later events must not wait for its
        // request timeout. It may have arrived; the replay of its parked
        // row then delivers it again (at-least-once).
        let tried = tokio::select! {
            biased;
            _ = lane.park.parked() => None,
            tried = async {
                match carried {
                    Carried::One(event) => attempt(lane, ctx, admission, event, request, number).await,
                    Carried::Batch(events, id) => attempt_batch(lane, ctx, admission, events, id, request, number).await,
                }
            } => Some(tried),
        };
        let Some(tried) = tried else {
            lane.breaker.release(admission);
            return Answered::Ended(Finished::Parked);
        };
        let (reason, retry_after, attempt) = match tried {
            Tried::Delivered(status) => return Answered::Delivered(status),
            Tried::Poison(r, attempt) => return Answered::Refused(r, attempt),
            Tried::PerEvent(verdicts, retry_after) => {
                return Answered::PerEvent(verdicts, retry_after);
            }
            Tried::Failed { attempt, .. } if ctx.persist != Persist::UntilDone => {
                return Answered::Ended(Finished::Failing(attempt.detail()));
            }
            Tried::Failed {
                reason,
                retry_after,
                attempt,
            } => (reason, retry_after, attempt),
        };
        failures += 1;
        if let Carried::Batch(events, id) = carried
            && failures == SPLIT_AFTER
        {
            tracing::warn!(
                endpoint = %lane.name, batch = %id, events = events.len(), event_ids = %ids_of(events),
                reason = %reason, detail = %attempt.detail(), failures,
                "a batch keeps failing: splitting it (if only batches fail, check that the receiver takes batches)"
            );
            return Answered::Split;
        }
        let delay = backoff.next_delay(retry_after, &mut rand::rng());
        if number == 1 || number.is_multiple_of(20) {
            let (detail, retry_in_ms) = (attempt.detail(), delay.as_millis() as u64);
            match carried {
                Carried::One(event) => tracing::warn!(
                    endpoint = %lane.name, event_id = %event.id, commit_lsn = %crate::shown(&event.commit_lsn),
                    attempts = number, trace_id = trace_id(event), reason = %reason, detail, retry_in_ms,
                    "delivery failed; will retry"
                ),
                Carried::Batch(events, id) => tracing::warn!(
                    endpoint = %lane.name, batch = %id, events = events.len(), event_ids = %ids_of(events), attempts = number,
                    reason = %reason, detail, retry_in_ms, "batch delivery failed; will retry"
                ),
            }
        }
        let slept = unless_interrupted(lane, ctx, tokio::time::sleep(delay)).await;
        if !matches!(slept, Waited::Done(())) {
            return Answered::Ended(interrupted(&slept));
        }
    }
}

/// Delivers `event` (job `seq`, its place in stream order) at `lane` until
/// it is done there, or handed back (see the module doc). An error only
/// when the store is lost.
pub(super) async fn deliver<S: Sink, D: DeadLetterStore>(
    lane: &Lane<S>,
    ctx: &Ctx<D>,
    seq: u64,
    event: &OutboxEvent,
) -> Result<Finished, DispatchError> {
    let request = lane.sink.prepare(event);
    let first_attempt = crate::clock::unix_micros();
    let mut attempts: u32 = 0;
    match until_answered(lane, ctx, seq, Carried::One(event), &request, &mut attempts).await {
        Answered::Delivered(status) => {
            tracing::debug!(event_id = %event.id, commit_lsn = %crate::shown(&event.commit_lsn), trace_id = trace_id(event), attempts, "delivered");
            Ok(Finished::Delivered(status))
        }
        Answered::Refused(r, attempt) => {
            poisoned(lane, ctx, event, (&r, &attempt), attempts, first_attempt).await
        }
        Answered::PerEvent(..) | Answered::Split => {
            unreachable!("only a batch is answered per event or split")
        }
        Answered::Ended(finished) => Ok(finished),
    }
}

/// A poison event at its end: kept under [`Persist::OneAttempt`] (a
/// replayed row records the refusal on itself), else dead-lettered with
/// the refusal.
pub(super) async fn poisoned<S, D: DeadLetterStore>(
    lane: &Lane<S>,
    ctx: &Ctx<D>,
    event: &OutboxEvent,
    (reason, attempt): (&Reason, &Attempt),
    attempts: u32,
    first_attempt: i64,
) -> Result<Finished, DispatchError> {
    let mut row = NewDeadLetter::rejected(event, attempt, reason, attempts, first_attempt);
    row.endpoint = lane.dead_letter_endpoint().map(str::to_owned);
    if ctx.persist == Persist::OneAttempt {
        // A replayed row refused again says so (this refusal, its
        // attempt), tried once: the row is kept either way, and a replay
        // must not wait on it.
        if let Some(id) = event.dead_letter_id
            && let Err(e) = ctx.store.refused(id, &row).await
        {
            tracing::warn!(dead_letter_id = id, event_id = %event.id, error = %e,
                "cannot record the new refusal on the dead-letter row; it keeps its earlier error");
        }
        return Ok(Finished::Kept(attempt.detail()));
    }
    dead_letter(lane, ctx, event, &row).await
}

/// What an interrupted wait means for the job.
pub(super) fn interrupted<T>(w: &Waited<T>) -> Finished {
    match w {
        Waited::Parked => Finished::Parked,
        _ => Finished::Stopped,
    }
}

/// Writes a poison event's dead letter (or, for a replayed dead letter,
/// records the refusal on its own row), waiting until it is committed; the
/// event stays pending meanwhile.
pub(super) async fn dead_letter<S, D: DeadLetterStore>(
    lane: &Lane<S>,
    ctx: &Ctx<D>,
    event: &OutboxEvent,
    row: &NewDeadLetter,
) -> Result<Finished, DispatchError> {
    let written = match event.dead_letter_id {
        None => {
            let write = ctx.store.write(row, Urgency::Now);
            tokio::select! {
                biased;
                _ = ctx.stopping.cancelled() => return Ok(Finished::Stopped),
                w = write => w.map(Some),
            }
        }
        Some(id) => match refused(lane, ctx, id, row).await {
            Ok(true) => Ok(None),
            Ok(false) => return Ok(Finished::Stopped),
            Err(e) => Err(e),
        },
    };
    match written {
        Ok(written) => {
            // Counted by what this process did, as deliveries are: an
            // event that reuses the row it already had (re-streamed after
            // a restart, or backfilled) counts again, so a backfill's
            // rows add up to delivered plus dead-lettered.
            if written.is_some() {
                ctx.metrics.events_dead_lettered.inc();
            }
            lane.metrics.dead_lettered.inc();
            let id = written.map(|w| w.id).or(event.dead_letter_id);
            let reused = written.is_none_or(|w| !w.new);
            tracing::warn!(dead_letter_id = id.unwrap_or_default(), reused, event_id = %event.id, trace_id = trace_id(event), error = %row.error, "dead-lettered");
            Ok(Finished::DeadLettered)
        }
        Err(StoreError::Lost(e)) => Err(DispatchError::StoreLost(e)),
        Err(StoreError::Failed(e)) => unreachable!("the store retries failed writes itself: {e}"),
    }
}

/// Records replayed row `id` refused as poison, retrying until it is
/// committed; `false` when the pipeline stopped first (the row stays as it
/// was, and its aggregate waits behind it).
pub(super) async fn refused<S, D: DeadLetterStore>(
    lane: &Lane<S>,
    ctx: &Ctx<D>,
    id: i64,
    row: &NewDeadLetter,
) -> Result<bool, StoreError> {
    let mut backoff: Backoff = lane.backoff();
    loop {
        match ctx.store.refused(id, row).await {
            Ok(()) => return Ok(true),
            Err(e @ StoreError::Lost(_)) => return Err(e),
            Err(StoreError::Failed(e)) => {
                tracing::error!(error = %e, dead_letter_id = id, "cannot record a replayed dead letter as refused; trying again");
                let delay = backoff.next_delay(None, &mut rand::rng());
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = ctx.stopping.cancelled() => return Ok(false),
                }
            }
        }
    }
}

/// Makes one attempt admitted by the breaker, judges it, and records the
/// outcome in the breaker and the metrics (a live delivery counts as
/// delivered; a replayed dead letter as replayed). A `Retry-After` pauses
/// every delivery of the endpoint.
pub(super) async fn attempt<S: Sink, D>(
    lane: &Lane<S>,
    ctx: &Ctx<D>,
    admission: Admission,
    event: &OutboxEvent,
    request: &Prepared,
    number: u32,
) -> Tried {
    let metrics = &ctx.metrics;
    let span = AttemptSpan::start(
        lane.tracer.as_ref(),
        &lane.name,
        event,
        number,
        metrics.clock_skew.get(),
    );
    let started = Instant::now();
    let attempt = {
        let _in_flight = InFlight::start(metrics, &lane.metrics);
        let trace = span.as_ref().and_then(AttemptSpan::headers);
        lane.sink.post(&event.id, request, trace).await
    };
    metrics
        .request_duration
        .observe(started.elapsed().as_secs_f64());
    // A 207 is judged by the event's own answer in it; without one it is
    // not done.
    let (disposition, attempt) = match own_answer(attempt, &event.id) {
        Ok(attempt) => (classify(&attempt, &lane.cfg.policy), attempt),
        Err((reason, why, whole)) => {
            if number == 1 || number.is_multiple_of(20) {
                tracing::warn!(
                    endpoint = %lane.name, event_id = %event.id, why = %why, attempts = number,
                    "the endpoint answered 207 without the event's own answer in it (docs/architecture.md#batches): it is not done, and is sent again"
                );
            }
            (Disposition::Retry(reason), whole)
        }
    };
    if let Some(span) = span {
        span.end(&attempt, failure_label(&disposition));
    }
    match judge(lane, metrics, disposition, &attempt, &event.id) {
        Verdict::Delivered => {
            lane.breaker.record(admission, Signal::Success, "");
            count_attempt(metrics, AttemptOutcome::Delivered, &attempt);
            count_delivered(lane, metrics, event);
            Tried::Delivered(status_of(&attempt))
        }
        Verdict::Poison(r) => {
            lane.breaker
                .record(admission, Signal::DeadLettered, &r.to_string());
            count_attempt(metrics, AttemptOutcome::DeadLetter, &attempt);
            tracing::warn!(
                endpoint = %lane.name, event_id = %event.id, commit_lsn = %crate::shown(&event.commit_lsn), reason = %r,
                trace_id = trace_id(event), detail = %attempt.detail(), "poison event: the endpoint refuses it"
            );
            Tried::Poison(r, attempt)
        }
        Verdict::Failed(outcome, signal, reason) => failed(
            lane,
            metrics,
            (admission, outcome, signal, reason),
            attempt,
            Carried::One(event),
        ),
    }
}

/// A delivered event in the metrics: delivered (with its commit-to-
/// delivery time) when live, replayed when it was a dead letter.
pub(super) fn count_delivered<S>(lane: &Lane<S>, metrics: &Metrics, event: &OutboxEvent) {
    if event.dead_letter_id.is_none() {
        metrics.events_delivered.inc();
        lane.metrics.delivered.inc();
        let since = crate::clock::seconds_since(event.commit_time_micros, metrics.clock_skew.get());
        metrics.commit_to_delivery.observe(since);
        lane.metrics.commit_to_delivery.observe(since);
    } else {
        lane.metrics.replayed.inc();
    }
}

/// A 2xx attempt's status.
pub(super) fn status_of(attempt: &Attempt) -> u16 {
    match attempt {
        Attempt::Response { status, .. } => *status,
        _ => 200,
    }
}

/// Records an attempt that failed (neither delivered nor poison) in the
/// breaker and the metrics, and pauses every delivery of the lane when
/// the sink asked for quiet (`Retry-After`). `about`: the event id (or a
/// batch's id) for the log line.
pub(super) fn failed<S>(
    lane: &Lane<S>,
    metrics: &Metrics,
    (admission, outcome, signal, reason): (Admission, AttemptOutcome, Signal, Reason),
    attempt: Attempt,
    carried: Carried<'_>,
) -> Tried {
    // The breaker logs the exact status; the metric gets the bounded label.
    lane.breaker.record(admission, signal, &reason.to_string());
    count_attempt(metrics, outcome, &attempt);
    metrics
        .retries
        .with_label_values(&[reason.label.as_str()])
        .inc();
    lane.metrics.retry(reason.label.as_str());
    let retry_after = match &attempt {
        Attempt::Response { retry_after, .. } => *retry_after,
        _ => None,
    };
    if let Some(asked) = retry_after {
        // The sink asked for quiet: every delivery waits, not just this one.
        let pause = asked.min(lane.cfg.retry_after_max);
        lane.breaker
            .pause_until(tokio::time::Instant::now() + pause);
        let (retry_after_s, pause_s) = (asked.as_secs_f64(), pause.as_secs_f64());
        let quiet = "the sink asked for quiet (Retry-After): every delivery pauses";
        match carried {
            Carried::One(event) => tracing::warn!(
                endpoint = %lane.name, event_id = %event.id, trace_id = trace_id(event), reason = %reason,
                retry_after_s, pause_s, "{quiet}"
            ),
            Carried::Batch(events, id) => tracing::warn!(
                endpoint = %lane.name, batch = %id, events = events.len(), reason = %reason,
                retry_after_s, pause_s, "{quiet}"
            ),
        }
    }
    Tried::Failed {
        reason,
        retry_after,
        attempt,
    }
}

/// The `trace_id` field of an attempt's log lines: the stored trace's id,
/// absent for an event without one.
pub(super) fn trace_id(event: &OutboxEvent) -> Option<tracing::field::DisplayValue<TraceId>> {
    event
        .trace
        .as_ref()
        .map(|cx| tracing::field::display(cx.trace_id()))
}

pub(super) fn count_attempt(metrics: &Metrics, outcome: AttemptOutcome, attempt: &Attempt) {
    metrics
        .delivery_attempts
        .with_label_values(&[outcome.as_str(), status_class(attempt)])
        .inc();
}
