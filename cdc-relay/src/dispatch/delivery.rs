//! One job's life at one lane: attempts through the circuit breaker until
//! the event is delivered, dead-lettered, or handed back.
//!
//! ```text
//!  breaker.admit ─▶ pace ─▶ Sink::post ─▶ classify ─┬─ Delivered ──────────────────────▶ Delivered
//!        ▲                                          ├─ DeadLetter (not a storm) ─▶ row ──▶ DeadLettered
//!        └──────────────── backoff sleep ◀──────────┴─ Retry | ConfigFault | Retired | storm
//!  the lane parked meanwhile ─▶ Parked (the dispatcher hands the job to the dead-letter writer)
//!  the pipeline stopping     ─▶ Stopped (the event stays pending)
//! ```
//!
//! A poison event's dead-letter row is written through the store, which
//! retries a failed write itself; the event stays pending meanwhile. Only a
//! lost store (the side connection closed) ends the pipeline, and with it
//! the session. A replayed dead letter refused again is recorded on its own
//! row instead ([`DeadLetterStore::refused`]).
//!
//! With [`Persist::OneAttempt`] (`dead-letter replay`) a job makes one
//! attempt: refused, it is [`Finished::Kept`]; failing, the pipeline stops
//! ([`Finished::Failing`]). With [`Persist::UntilFailing`] (a resume's
//! final pass) a failure stops the pipeline too.
//!
//! Once the pipeline is stopping (shutdown), no new attempt starts: a
//! delivery waiting for the breaker or sleeping in backoff gives up at once
//! and its event stays pending (unconfirmed, so it is sent again after a
//! restart); an attempt already on the wire finishes.
//!
//! Deliveries run on [`Workers`]: per lane, tasks that live as long as the
//! pipeline and deliver one job at a time.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::trace::TraceId;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::lane::Lane;
use super::scheduler::Ticket;
use super::span::{AttemptSpan, BatchSpans};
use super::{DispatchError, Job, Persist, Work};
use crate::backoff::Backoff;
use crate::breaker::{Admission, Signal};
use crate::dead_letter::{DeadLetterStore, NewDeadLetter, StoreError, Urgency};
use crate::endpoint_metrics::EndpointMetrics;
use crate::metrics::{AttemptOutcome, Metrics};
use crate::outbox::OutboxEvent;
use crate::sink::answers::{self, EventAnswer};
use crate::sink::{
    Attempt, Disposition, Prepared, Reason, ReasonLabel, Sink, classify, config_fault_hint,
    encoder, status_class,
};

/// What every delivery of one pipeline shares.
pub(super) struct Ctx<D> {
    /// Where poison events' dead letters go.
    pub(super) store: Arc<D>,
    /// Relay-wide series of attempts.
    pub(super) metrics: Metrics,
    /// Cancelled when the pipeline stops: no new attempt starts.
    pub(super) stopping: CancellationToken,
    /// Retry until done, or one attempt.
    pub(super) persist: Persist,
}

/// A job handed back by a worker, with how its delivery finished.
pub(super) type Delivered = (Ticket, Job, Result<Finished, DispatchError>);

/// What a worker is given: one job, or a batch (two or more jobs of its
/// lane, in the order the scheduler started them).
enum Given {
    One(Ticket, Job),
    Batch(Vec<(Ticket, Job)>),
}

/// What a worker hands back: the job, or the batch's jobs.
enum Handed {
    One(Delivered),
    Batch(Vec<Delivered>),
}

/// What a worker hands back: its lane and index, and the job(s).
type Answer = (usize, usize, Handed);

/// The delivery workers of one pipeline run. Each lane gets tasks as its
/// jobs need them, at most its `max_in_flight`, and they live as long as
/// the run: a job costs a message to an idle worker and one back, not a
/// task of its own (its allocation, scheduling and join). Dropping
/// `Workers` aborts them, and with them the attempts on the wire.
///
/// A lane with `batch_max_events` above 1 may have that many times more
/// jobs started (the scheduler's limit for it): they wait here until one
/// of its `max_in_flight` workers is free, which takes whatever waits, up
/// to the batch limits, as one request ([`Workers::flush`]). At a low
/// rate a worker is free at once and a job goes alone; under load the
/// jobs that came while every worker was busy go together.
pub(super) struct Workers<S, D> {
    lanes: Vec<Arc<Lane<S>>>,
    ctx: Arc<Ctx<D>>,
    /// Per lane, each worker's inbox (a worker's index is its place here).
    inboxes: Vec<Vec<mpsc::Sender<Given>>>,
    /// Per lane, the workers with no job.
    idle: Vec<Vec<usize>>,
    /// Per batching lane, the started jobs no worker has taken yet.
    waiting: Vec<VecDeque<(Ticket, Job)>>,
    /// Jobs handed back (a batch's, or waiting ones given up) and not yet
    /// taken by [`Workers::next`].
    ready: VecDeque<Delivered>,
    /// Jobs started and not yet taken back.
    busy: usize,
    answers_tx: mpsc::UnboundedSender<Answer>,
    answers: mpsc::UnboundedReceiver<Answer>,
    tasks: JoinSet<()>,
}

impl<S: Sink, D: DeadLetterStore> Workers<S, D> {
    /// No worker yet, for `lanes` (lane `i` is `lanes[i]`).
    pub(super) fn new(lanes: &[Arc<Lane<S>>], ctx: Ctx<D>) -> Self {
        let (answers_tx, answers) = mpsc::unbounded_channel();
        Self {
            lanes: lanes.to_vec(),
            ctx: Arc::new(ctx),
            inboxes: vec![Vec::new(); lanes.len()],
            idle: vec![Vec::new(); lanes.len()],
            waiting: (0..lanes.len()).map(|_| VecDeque::new()).collect(),
            ready: VecDeque::new(),
            busy: 0,
            answers_tx,
            answers,
            tasks: JoinSet::new(),
        }
    }

    /// Starts delivering `job` (a [`Work::Deliver`]) at its lane: on an
    /// idle worker or a new one, or, at a batching lane, among the jobs
    /// the next free worker takes ([`Workers::flush`]).
    pub(super) fn start(&mut self, ticket: Ticket, job: Job) {
        let lane = ticket.lane;
        self.busy += 1;
        if self.lanes[lane].cfg.batch_max_events > 1 {
            self.waiting[lane].push_back((ticket, job));
            return;
        }
        let worker = self.free_worker(lane);
        self.inboxes[lane][worker]
            .try_send(Given::One(ticket, job))
            .unwrap_or_else(|_| panic!("an idle worker's inbox is empty"));
    }

    /// Gives the batching lanes' waiting jobs to their free workers, as
    /// many per request as the lane's batch limits allow (a job larger than
    /// `batch_max_bytes` goes alone). While the pipeline stops (`stopping`)
    /// or the lane is parked, the waiting jobs are handed back as such
    /// instead: they were never attempted.
    pub(super) fn flush(&mut self, stopping: bool) {
        for lane in 0..self.lanes.len() {
            if self.waiting[lane].is_empty() {
                continue;
            }
            let cfg = &self.lanes[lane].cfg;
            let (max_events, max_bytes, max_workers) =
                (cfg.batch_max_events, cfg.batch_max_bytes, cfg.max_in_flight);
            let parked = self.lanes[lane].park.is_parked();
            if stopping || parked {
                let finished = if parked {
                    Finished::Parked
                } else {
                    Finished::Stopped
                };
                for (ticket, job) in self.waiting[lane].drain(..) {
                    self.ready.push_back((ticket, job, Ok(finished.clone())));
                }
                continue;
            }
            while !self.waiting[lane].is_empty()
                && (!self.idle[lane].is_empty() || self.inboxes[lane].len() < max_workers)
            {
                let mut bytes = 0;
                let mut batch = Vec::new();
                while let Some((_, (Work::Deliver(event), _))) = self.waiting[lane].front() {
                    let size = encoder::estimated_size(event);
                    if batch.len() == max_events || (!batch.is_empty() && bytes + size > max_bytes)
                    {
                        break;
                    }
                    bytes += size;
                    batch.extend(self.waiting[lane].pop_front());
                }
                let given = if batch.len() == 1 {
                    let (ticket, job) = batch.pop().expect("one job");
                    Given::One(ticket, job)
                } else {
                    Given::Batch(batch)
                };
                let worker = self.free_worker(lane);
                self.inboxes[lane][worker]
                    .try_send(given)
                    .unwrap_or_else(|_| panic!("an idle worker's inbox is empty"));
            }
        }
    }

    /// An idle worker of `lane`, or a new one.
    fn free_worker(&mut self, lane: usize) -> usize {
        match self.idle[lane].pop() {
            Some(w) => w,
            None => self.spawn(lane),
        }
    }

    fn spawn(&mut self, lane: usize) -> usize {
        let (inbox, mut jobs) = mpsc::channel::<Given>(1);
        let worker = self.inboxes[lane].len();
        self.inboxes[lane].push(inbox);
        let at = Arc::clone(&self.lanes[lane]);
        let ctx = Arc::clone(&self.ctx);
        let answers = self.answers_tx.clone();
        self.tasks.spawn(async move {
            while let Some(given) = jobs.recv().await {
                let handed = match given {
                    Given::One(ticket, job) => {
                        let Work::Deliver(event) = &job.0 else {
                            unreachable!("only deliveries are started")
                        };
                        let finished = deliver(&at, &ctx, ticket.seq, event).await;
                        Handed::One((ticket, job, finished))
                    }
                    Given::Batch(jobs) => {
                        let events: Vec<(u64, &OutboxEvent)> = jobs
                            .iter()
                            .map(|(ticket, job)| match &job.0 {
                                Work::Deliver(event) => (ticket.seq, &**event),
                                _ => unreachable!("only deliveries are started"),
                            })
                            .collect();
                        let finished = deliver_group(&at, &ctx, &events).await;
                        drop(events);
                        Handed::Batch(match finished {
                            Ok(f) => jobs
                                .into_iter()
                                .zip(f)
                                .map(|((t, j), f)| (t, j, Ok(f)))
                                .collect(),
                            Err(e) => jobs
                                .into_iter()
                                .map(|(t, j)| (t, j, Err(e.clone())))
                                .collect(),
                        })
                    }
                };
                if answers.send((lane, worker, handed)).is_err() {
                    break;
                }
            }
        });
        worker
    }

    /// Whether no job is being delivered.
    pub(super) fn is_idle(&self) -> bool {
        self.busy == 0
    }

    /// The next job handed back (waits for one).
    ///
    /// # Panics
    /// When a worker panicked.
    pub(super) async fn next(&mut self) -> Delivered {
        if let Some(d) = self.take_ready() {
            return d;
        }
        tokio::select! {
            Some(answer) = self.answers.recv() => self.back(answer),
            Some(ended) = self.tasks.join_next() => {
                panic!("delivery workers do not end while the run lasts: {ended:?}")
            }
        }
    }

    /// A job already handed back, if any.
    pub(super) fn try_next(&mut self) -> Option<Delivered> {
        if let Some(d) = self.take_ready() {
            return Some(d);
        }
        let answer = self.answers.try_recv().ok()?;
        Some(self.back(answer))
    }

    fn take_ready(&mut self) -> Option<Delivered> {
        let d = self.ready.pop_front()?;
        self.busy -= 1;
        Some(d)
    }

    fn back(&mut self, (lane, worker, handed): Answer) -> Delivered {
        self.idle[lane].push(worker);
        match handed {
            Handed::One(d) => {
                self.busy -= 1;
                d
            }
            Handed::Batch(jobs) => {
                self.ready.extend(jobs);
                self.take_ready().expect("a batch has jobs")
            }
        }
    }
}

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
enum Tried {
    /// A 2xx with this status.
    Delivered(u16),
    /// The endpoint refused the event itself (and no poison storm is on),
    /// or the batch as a whole.
    Poison(Reason, Attempt),
    /// A batch's 207: each named event's answer.
    PerEvent(HashMap<String, EventAnswer>),
    /// Not delivered; worth retrying later (the endpoint failing, or a
    /// configuration fault).
    Failed {
        reason: Reason,
        retry_after: Option<Duration>,
        attempt: Attempt,
    },
}

/// How an interruptible wait of a delivery ended.
enum Waited<T> {
    Done(T),
    Stopping,
    Parked,
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

/// Waits for `wait` unless the pipeline stops or the lane is parked first.
async fn unless_interrupted<S, D, T>(
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
enum Carried<'a> {
    /// One event, in the per-event format, with its attempt's span.
    One(&'a OutboxEvent),
    /// A batch: its events in body order, and its id.
    Batch(&'a [&'a OutboxEvent], &'a str),
}

/// How a request's attempts ended ([`until_answered`]).
enum Answered {
    /// A 2xx with this status: every event carried is done.
    Delivered(u16),
    /// Refused: the one event as poison (by this attempt), or the batch as
    /// a whole (it is split).
    Refused(Reason, Attempt),
    /// A batch answered per event: each named event's answer.
    PerEvent(HashMap<String, EventAnswer>),
    /// A batch failed [`SPLIT_AFTER`] attempts in a row: split it, so that
    /// one event the endpoint keeps failing holds back only its aggregate.
    Split,
    /// Not done: the wait was interrupted, or the sink is failing and the
    /// pipeline's [`Persist`] gives up.
    Ended(Finished),
}

/// Failed attempts in a row after which a batch is split
/// ([`Answered::Split`]).
const SPLIT_AFTER: u32 = 2;

/// Attempts `request` (carrying `carried`; `seq`: the breaker's place for
/// it, its first job's) through the breaker and the pace, retrying
/// failures with backoff (and `Retry-After`), until the endpoint answers
/// with a verdict, a batch has failed [`SPLIT_AFTER`] times, or the wait
/// is interrupted. `attempts` counts them.
async fn until_answered<S: Sink, D>(
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
            Tried::PerEvent(answers) => return Answered::PerEvent(answers),
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
        Answered::PerEvent(_) | Answered::Split => {
            unreachable!("only a batch is answered per event or split")
        }
        Answered::Ended(finished) => Ok(finished),
    }
}

/// A poison event at its end: kept as it was under
/// [`Persist::OneAttempt`], else dead-lettered with the refusal.
async fn poisoned<S, D: DeadLetterStore>(
    lane: &Lane<S>,
    ctx: &Ctx<D>,
    event: &OutboxEvent,
    (reason, attempt): (&Reason, &Attempt),
    attempts: u32,
    first_attempt: i64,
) -> Result<Finished, DispatchError> {
    if ctx.persist == Persist::OneAttempt {
        return Ok(Finished::Kept(attempt.detail()));
    }
    let mut row = NewDeadLetter::rejected(event, attempt, reason, attempts, first_attempt);
    row.endpoint = lane.dead_letter_endpoint().map(str::to_owned);
    dead_letter(lane, ctx, event, &row).await
}

/// The result of [`deliver_group`]: each event's end, in order.
type GroupDelivered<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<Finished>, DispatchError>> + Send + 'a>>;

/// Delivers `events` (each with its job's `seq`; of distinct aggregates:
/// the scheduler runs one job per aggregate at a time) at `lane` as one
/// request, a batch (`docs/architecture.md#batches`), until they are done
/// there or handed back; one event goes as [`deliver`] sends it. A 2xx
/// does every event; a failure retries the whole batch (backoff, breaker,
/// `Retry-After` as for one event); a refusal (poison, 413 included)
/// splits it in halves, each delivered the same way, until the refused
/// event is alone and dead-lettered as any poison event, and every other
/// event of the batch delivered. A 207 with per-event answers
/// ([`crate::sink::answers`]) judges each event by its own status: done,
/// dead-lettered, or sent again (with the other events not done, after a
/// backoff).
fn deliver_group<'a, S: Sink, D: DeadLetterStore>(
    lane: &'a Lane<S>,
    ctx: &'a Ctx<D>,
    events: &'a [(u64, &'a OutboxEvent)],
) -> GroupDelivered<'a> {
    Box::pin(async move {
        let mut done: Vec<Option<Finished>> = vec![None; events.len()];
        // The events not done yet, by index, in body order.
        let mut todo: Vec<usize> = (0..events.len()).collect();
        let first_attempt = crate::clock::unix_micros();
        let mut attempts: u32 = 0;
        let mut backoff = lane.backoff();
        while let Some(&first) = todo.first() {
            if let [i] = todo[..] {
                done[i] = Some(deliver(lane, ctx, events[i].0, events[i].1).await?);
                break;
            }
            let members: Vec<&OutboxEvent> = todo.iter().map(|&i| events[i].1).collect();
            let (id, request) = lane.sink.prepare_batch(&members);
            let carried = Carried::Batch(&members, &id);
            let answers =
                match until_answered(lane, ctx, events[first].0, carried, &request, &mut attempts)
                    .await
                {
                    Answered::Delivered(status) => {
                        tracing::debug!(batch = %id, events = members.len(), attempts, "delivered");
                        todo.iter()
                            .for_each(|&i| done[i] = Some(Finished::Delivered(status)));
                        break;
                    }
                    Answered::Ended(finished) => {
                        todo.iter().for_each(|&i| done[i] = Some(finished.clone()));
                        break;
                    }
                    Answered::Refused(..) | Answered::Split => {
                        // The halves go at once: a half whose event the
                        // endpoint keeps failing must not hold the other back.
                        let rest: Vec<(u64, &OutboxEvent)> =
                            todo.iter().map(|&i| events[i]).collect();
                        let (left, right) = rest.split_at(rest.len() / 2);
                        let (left, right) = tokio::join!(
                            deliver_group(lane, ctx, left),
                            deliver_group(lane, ctx, right)
                        );
                        let mut ends = left?;
                        ends.extend(right?);
                        todo.iter().zip(ends).for_each(|(&i, f)| done[i] = Some(f));
                        break;
                    }
                    Answered::PerEvent(answers) => answers,
                };
            let mut again = Vec::new();
            for &i in &todo {
                let event = events[i].1;
                let Some(answer) = answers.get(event.id.as_str()) else {
                    again.push((i, "not named in the answer".to_owned()));
                    continue;
                };
                let attempt = Attempt::Response {
                    status: answer.status,
                    retry_after: None,
                    excerpt: answer.error.clone(),
                };
                match classify(&attempt, &lane.cfg.policy) {
                    Disposition::Delivered => {
                        count_delivered(lane, &ctx.metrics, event);
                        done[i] = Some(Finished::Delivered(answer.status));
                    }
                    Disposition::DeadLetter(r) if lane.breaker.poison(&event.id) => {
                        tracing::warn!(
                            endpoint = %lane.name, event_id = %event.id, commit_lsn = %crate::shown(&event.commit_lsn), reason = %r,
                            batch = %id, detail = %attempt.detail(), "poison event: the endpoint refuses it (answered per event)"
                        );
                        let end =
                            poisoned(lane, ctx, event, (&r, &attempt), attempts, first_attempt);
                        done[i] = Some(end.await?);
                    }
                    _ => again.push((i, attempt.detail())),
                }
            }
            let Some((_, detail)) = again.first() else {
                break;
            };
            if ctx.persist != Persist::UntilDone {
                let failing = Finished::Failing(detail.clone());
                again
                    .iter()
                    .for_each(|&(i, _)| done[i] = Some(failing.clone()));
                break;
            }
            let delay = backoff.next_delay(None, &mut rand::rng());
            tracing::warn!(
                endpoint = %lane.name, batch = %id, events = again.len(), detail = %detail,
                retry_in_ms = delay.as_millis() as u64, "events of a batch answered per event are not done; will retry them"
            );
            todo = again.into_iter().map(|(i, _)| i).collect();
            let slept = unless_interrupted(lane, ctx, tokio::time::sleep(delay)).await;
            if !matches!(slept, Waited::Done(())) {
                let finished = interrupted(&slept);
                todo.iter().for_each(|&i| done[i] = Some(finished.clone()));
                break;
            }
        }
        Ok(done
            .into_iter()
            .map(|f| f.expect("every event of a batch ends"))
            .collect())
    })
}

/// One attempt of a batch, as [`attempt`] makes one for an event. A
/// refusal is not poison for the breaker's storm guard (it counts events,
/// and judges each once the batch is split down to it): the endpoint
/// answered, and the batch is split. A 207 is read as per-event answers;
/// one that does not read so is a refusal of the batch.
async fn attempt_batch<S: Sink, D>(
    lane: &Lane<S>,
    ctx: &Ctx<D>,
    admission: Admission,
    events: &[&OutboxEvent],
    id: &str,
    request: &Prepared,
    number: u32,
) -> Tried {
    let metrics = &ctx.metrics;
    let spans = BatchSpans::start(
        lane.tracer.as_ref(),
        &lane.name,
        (id, events),
        number,
        metrics.clock_skew.get(),
    );
    let started = Instant::now();
    let attempt = {
        let _in_flight = InFlight::start(metrics, &lane.metrics);
        let trace = spans.as_ref().and_then(BatchSpans::headers);
        lane.sink.post(id, request, trace).await
    };
    metrics
        .request_duration
        .observe(started.elapsed().as_secs_f64());
    let disposition = classify(&attempt, &lane.cfg.policy);
    if let Some(spans) = spans {
        spans.end(&attempt, failure_label(&disposition));
    }
    let (outcome, signal, reason) = match disposition {
        Disposition::Delivered => {
            if let Attempt::Response {
                status: 207,
                excerpt,
                ..
            } = &attempt
            {
                let why = match answers::parse(excerpt) {
                    Ok(answers) => {
                        // A 2xx for the breaker only when an event is done:
                        // that ends the storm guard's run of refusals.
                        let done = answers.values().any(|a| (200..300).contains(&a.status));
                        // During a storm, refusals wait like failures.
                        let signal = if done {
                            Signal::Success
                        } else if lane.breaker.in_storm() {
                            Signal::Transient
                        } else {
                            Signal::DeadLettered
                        };
                        lane.breaker.record(admission, signal, "http_207");
                        count_attempt(metrics, AttemptOutcome::Delivered, &attempt);
                        return Tried::PerEvent(answers);
                    }
                    Err(why) => why,
                };
                lane.breaker
                    .record(admission, Signal::DeadLettered, "http_207");
                count_attempt(metrics, AttemptOutcome::Split, &attempt);
                tracing::warn!(
                    endpoint = %lane.name, batch = %id, events = events.len(), why = %why,
                    "the endpoint answered the batch 207 without per-event answers (docs/architecture.md#batches): splitting it"
                );
                let r = Reason {
                    label: ReasonLabel::HttpOther,
                    status: Some(207),
                };
                return Tried::Poison(r, attempt);
            }
            lane.breaker.record(admission, Signal::Success, "");
            count_attempt(metrics, AttemptOutcome::Delivered, &attempt);
            for event in events {
                count_delivered(lane, metrics, event);
            }
            return Tried::Delivered(status_of(&attempt));
        }
        // During a poison storm, a refusal waits like a transient failure.
        Disposition::DeadLetter(r) if lane.breaker.in_storm() => {
            (AttemptOutcome::Retry, Signal::Transient, r)
        }
        Disposition::DeadLetter(r) => {
            // Answered, but no event done: the storm guard's run goes on.
            lane.breaker
                .record(admission, Signal::DeadLettered, &r.to_string());
            count_attempt(metrics, AttemptOutcome::Split, &attempt);
            tracing::info!(
                endpoint = %lane.name, batch = %id, events = events.len(), reason = %r,
                detail = %attempt.detail(), "the endpoint refuses the batch: splitting it"
            );
            return Tried::Poison(r, attempt);
        }
        Disposition::Retry(r) => (AttemptOutcome::Retry, Signal::Transient, r),
        Disposition::ConfigFault(r) => {
            let hint = config_fault_hint(&r, &attempt, metrics.clock_skew.get());
            (AttemptOutcome::ConfigFault, Signal::ConfigFault(hint), r)
        }
        Disposition::Retired(r) => (AttemptOutcome::Retired, Signal::Retired, r),
    };
    failed(
        lane,
        metrics,
        (admission, outcome, signal, reason),
        attempt,
        Carried::Batch(events, id),
    )
}

/// A batch's event ids for a log line: the first 20, then how many more.
fn ids_of(events: &[&OutboxEvent]) -> String {
    let mut ids: Vec<&str> = events.iter().take(20).map(|e| e.id.as_str()).collect();
    let more = format!("… and {} more", events.len().saturating_sub(20));
    if events.len() > 20 {
        ids.push(&more);
    }
    ids.join(",")
}

/// What an interrupted wait means for the job.
fn interrupted<T>(w: &Waited<T>) -> Finished {
    match w {
        Waited::Parked => Finished::Parked,
        _ => Finished::Stopped,
    }
}

/// Writes a poison event's dead letter (or, for a replayed dead letter,
/// records the refusal on its own row), waiting until it is committed; the
/// event stays pending meanwhile.
async fn dead_letter<S, D: DeadLetterStore>(
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
        Ok(id) => {
            if id.is_some() {
                ctx.metrics.events_dead_lettered.inc();
            }
            lane.metrics.dead_lettered.inc();
            tracing::warn!(dead_letter_id = id.or(event.dead_letter_id).unwrap_or_default(), event_id = %event.id, trace_id = trace_id(event), error = %row.error, "dead-lettered");
            Ok(Finished::DeadLettered)
        }
        Err(StoreError::Lost(e)) => Err(DispatchError::StoreLost(e)),
        Err(StoreError::Failed(e)) => unreachable!("the store retries failed writes itself: {e}"),
    }
}

/// Records replayed row `id` refused as poison, retrying until it is
/// committed; `false` when the pipeline stopped first (the row stays as it
/// was, and its aggregate waits behind it).
async fn refused<S, D: DeadLetterStore>(
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
async fn attempt<S: Sink, D>(
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
    let disposition = classify(&attempt, &lane.cfg.policy);
    if let Some(span) = span {
        span.end(&attempt, failure_label(&disposition));
    }
    let (outcome, signal, reason) = match disposition {
        Disposition::Delivered => {
            lane.breaker.record(admission, Signal::Success, "");
            count_attempt(metrics, AttemptOutcome::Delivered, &attempt);
            count_delivered(lane, metrics, event);
            return Tried::Delivered(status_of(&attempt));
        }
        Disposition::DeadLetter(r) if lane.breaker.poison(&event.id) => {
            lane.breaker
                .record(admission, Signal::DeadLettered, &r.to_string());
            count_attempt(metrics, AttemptOutcome::DeadLetter, &attempt);
            tracing::warn!(
                endpoint = %lane.name, event_id = %event.id, commit_lsn = %crate::shown(&event.commit_lsn), reason = %r,
                trace_id = trace_id(event), detail = %attempt.detail(), "poison event: the endpoint refuses it"
            );
            return Tried::Poison(r, attempt);
        }
        // During a poison storm, poison waits like a transient failure.
        Disposition::DeadLetter(r) | Disposition::Retry(r) => {
            (AttemptOutcome::Retry, Signal::Transient, r)
        }
        Disposition::ConfigFault(r) => {
            let hint = config_fault_hint(&r, &attempt, metrics.clock_skew.get());
            (AttemptOutcome::ConfigFault, Signal::ConfigFault(hint), r)
        }
        Disposition::Retired(r) => (AttemptOutcome::Retired, Signal::Retired, r),
    };
    failed(
        lane,
        metrics,
        (admission, outcome, signal, reason),
        attempt,
        Carried::One(event),
    )
}

/// The reason label an attempt's span records as `error.type`: `None`
/// when it was delivered.
fn failure_label(disposition: &Disposition) -> Option<&'static str> {
    match disposition {
        Disposition::Delivered => None,
        Disposition::DeadLetter(r)
        | Disposition::Retry(r)
        | Disposition::ConfigFault(r)
        | Disposition::Retired(r) => Some(r.label.as_str()),
    }
}

/// A delivered event in the metrics: delivered (with its commit-to-
/// delivery time) when live, replayed when it was a dead letter.
fn count_delivered<S>(lane: &Lane<S>, metrics: &Metrics, event: &OutboxEvent) {
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
fn status_of(attempt: &Attempt) -> u16 {
    match attempt {
        Attempt::Response { status, .. } => *status,
        _ => 200,
    }
}

/// Records an attempt that failed (neither delivered nor poison) in the
/// breaker and the metrics, and pauses every delivery of the lane when
/// the sink asked for quiet (`Retry-After`). `about`: the event id (or a
/// batch's id) for the log line.
fn failed<S>(
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
fn trace_id(event: &OutboxEvent) -> Option<tracing::field::DisplayValue<TraceId>> {
    event
        .trace
        .as_ref()
        .map(|cx| tracing::field::display(cx.trace_id()))
}

fn count_attempt(metrics: &Metrics, outcome: AttemptOutcome, attempt: &Attempt) {
    metrics
        .delivery_attempts
        .with_label_values(&[outcome.as_str(), status_class(attempt)])
        .inc();
}
