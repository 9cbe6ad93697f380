//! The delivery pipeline: a bounded window, per-aggregate ordering,
//! pipelined requests with retries, dead letters, and the acknowledgement
//! watermark.
//!
//! ```text
//!  source ──Item──▶ run ──▶ Scheduler (pure: keys, max_in_flight, hand-offs, AckTracker)
//!    ▲  (stream        │        │ next_job                          │ hand_off (parked lanes, dead-letter lane)
//!    │   order)        │        ▼                                   ▼
//!    │                 │   delivery worker ─Sink::post─▶ classify dead-letter writer (group commit)
//!    │                 ◀── complete(ticket) ────────────────────────┘
//!    └── confirmed position (watch) ◀── Scheduler::confirmed
//! ```
//!
//! - [`lane`]: one endpoint (`--sink-url` is one lane, a routes file one
//!   per endpoint).
//! - [`window`]: the memory bound the source admits events through.
//! - [`scheduler`]: the state machine, free of I/O (unit- and
//!   property-tested).
//! - [`delivery`]: one event's attempts at one lane: the breaker, backoff,
//!   the poison event's dead letter; and the lanes' delivery workers.
//! - [`route`]: which lanes an event goes to.
//! - [`park`]: parking an endpoint that holds the slot back (its events
//!   dead-lettered with reason `parked`).
//! - [`replay`]: dead-letter rows as a source of this pipeline.
//! - [`resume`]: replaying a parked endpoint's rows and handing it back
//!   to live delivery.
//! - [`span`]: an attempt as a span of the event's stored trace.
//! - [`confirmed`]: what [`run`] publishes as confirmed.
//! - [`pipeline`]: what [`run`] takes and gives: the source's items, a
//!   lane's settings, what the lanes share, how a job and the run ended.
//!
//! Each event is one job per lane it is routed to, and its transaction is
//! done when all of them are (`docs/architecture.md#acknowledgement`).
//! Jobs that only write a dead-letter row — a parked lane's events, and
//! the *dead-letter lane* of unrouted events and unreadable rows — go to no
//! worker: the dispatcher hands them to the store's single writer in stream
//! order, and completes each once its row is committed.
//!
//! The two I/O seams are traits: [`Sink`] (the HTTP client) and
//! [`DeadLetterStore`] (the side connection), so the whole pipeline runs in
//! unit tests against a scripted sink in paused time. [`run`] is the only
//! writer of the confirmed position, which travels back to the source as a
//! value through a `watch` channel.

pub mod confirmed;
pub mod delivery;
pub mod lane;
pub mod park;
pub mod pipeline;
pub mod replay;
pub mod resume;
pub mod route;
pub mod scheduler;
pub mod span;
pub mod window;

#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::ack::Position;
use crate::dead_letter::{DeadLetterStore, NewDeadLetter, StoreError, Urgency, Written as Row};
use crate::metrics::Metrics;
use crate::outbox::{OutboxEvent, UnreadableRow};
use crate::sink::Sink;
use confirmed::DoneLog;
pub use confirmed::{Confirmed, DoneTx};
use delivery::{Ctx, Finished, Workers};
pub use lane::Lane;
use park::Parking;
pub use pipeline::{
    DispatchConfig, DispatchError, Ended, Item, Outcome, Persist, Pipeline, RetainedWal,
};
use resume::{Resume, Resumes};
pub use route::{Router, Unrouted};
use scheduler::{Scheduler, Ticket};
pub use window::{Window, WindowPermit};

/// What a job does.
#[derive(Debug)]
enum Work {
    /// Deliver an event to the job's lane until it is done there (one job
    /// per lane the event is routed to, sharing the event).
    Deliver(Arc<OutboxEvent>),
    /// Dead-letter a row that cannot become an event.
    DeadLetter(Box<UnreadableRow>),
    /// Dead-letter an event no lane takes (reason `unrouted`).
    Unrouted(Arc<OutboxEvent>),
}

/// A job: its work, and its room in the window, shared by the event's jobs
/// at every lane (released when the last is done).
type Job = (Work, Arc<WindowPermit>);

/// A dead-letter write of a handed-off job, and its result.
type Written = Pin<Box<dyn Future<Output = (Ticket, Job, Result<Row, StoreError>)> + Send>>;

/// Runs until `items` closes and everything admitted is done (or has been
/// given up: [`Persist::OneAttempt`]), then returns the final confirmed
/// position. Each event goes to the lanes
/// that take it ([`Lane::takes`]; lane `i` is `lanes[i]`), and to the
/// dead-letter lane (after them) when none does. Once `pipeline.stopping`
/// is cancelled no new attempt starts: it returns when `items` is closed
/// and the attempts on the wire have finished, with what was not done left
/// unconfirmed. Dropping the future aborts deliveries in flight (they are
/// redelivered after a restart: at-least-once). The confirmed position
/// (and the last done transaction with events) is published on
/// `confirmed` whenever it moves.
pub async fn run<P: Position, S: Sink, D: DeadLetterStore>(
    lanes: Vec<Lane<S>>,
    pipeline: Pipeline<D>,
    start: P,
    mut items: mpsc::Receiver<Item<P>>,
    confirmed: watch::Sender<Confirmed<P>>,
) -> Result<P, DispatchError> {
    let mut router = Router::new(
        lanes.iter().map(|l| l.takes.clone()).collect(),
        pipeline.unrouted,
    );
    let lanes: Vec<Arc<Lane<S>>> = lanes.into_iter().map(Arc::new).collect();
    let dead_letter_lane = lanes.len();
    // A batching lane runs up to its batch size times more jobs: its
    // workers take them in batches (`delivery::Workers::flush`).
    let mut limits: Vec<usize> = lanes
        .iter()
        .map(|l| l.cfg.max_in_flight * l.cfg.batch_max_events)
        .collect();
    limits.push(1);
    if pipeline.gauges {
        for l in &lanes {
            l.metrics.parked.set(i64::from(l.park.is_parked()));
        }
    }
    let metrics = pipeline.metrics.clone();
    let stopping = pipeline.stopping.clone();
    let mut workers = Workers::new(
        &lanes,
        Ctx {
            store: Arc::clone(&pipeline.store),
            metrics: metrics.clone(),
            stopping: stopping.clone(),
            persist: pipeline.persist,
        },
    );
    let mut parking = Parking::new(pipeline.wal_budget.clone(), pipeline.window.clone());
    let mut scheduler: Scheduler<P, Job> = Scheduler::with_lanes(start, &limits);
    // A batch of a lane in commit order takes events in stream order only
    // (without batches its limit of one does that already).
    for (i, l) in lanes.iter().enumerate() {
        if l.cfg.in_commit_order() && l.cfg.batch_max_events > 1 {
            scheduler.in_stream_order(i);
        }
    }
    let mut done = DoneLog::new();
    let mut skipped = Skipped::default();
    let mut writes: FuturesUnordered<Written> = FuturesUnordered::new();
    let mut items_open = true;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut resumes = Resumes::new(lanes.len());
    // What the window's waits came to at the last tick (for the counter).
    let mut window_waited = Duration::ZERO;
    let resume = |i: usize| Resume {
        lane: Arc::clone(&lanes[i]),
        index: i,
        store: Arc::clone(&pipeline.store),
        metrics: metrics.clone(),
        stopping: stopping.clone(),
    };
    for i in 0..lanes.len() {
        resumes.start(resume(i));
    }
    scheduler.drain(dead_letter_lane, true);
    loop {
        // A round hands at most PER_ROUND jobs to the writer: the moment
        // an endpoint is parked its whole backlog (thousands of events)
        // is ready to go, and the other lanes' events and answers wait
        // only for one round of it, not for all (the rest go in the next
        // rounds, in the same order).
        let mut handed_off = 0;
        if !stopping.is_cancelled() {
            for (i, lane) in lanes.iter().enumerate() {
                scheduler.drain(i, lane.park.is_parked());
            }
            for i in 0..=dead_letter_lane {
                if scheduler.is_draining(i) {
                    while handed_off < PER_ROUND
                        && let Some((ticket, job)) = scheduler.hand_off(i)
                    {
                        writes.push(write(&lanes, &pipeline, ticket, job));
                        handed_off += 1;
                    }
                }
            }
            while let Some((mut ticket, job)) = scheduler.next_job() {
                if !matches!(job.0, Work::Deliver(_)) {
                    // Only a draining lane's jobs write rows, and those
                    // are never started.
                    scheduler.hand_off_running(&mut ticket);
                    writes.push(write(&lanes, &pipeline, ticket, job));
                    continue;
                }
                workers.start(ticket, job);
            }
        }
        workers.flush(stopping.is_cancelled());
        for (lane, (work, _)) in scheduler.take_abandoned() {
            report(&pipeline, &work, lane, Outcome::NotAttempted);
        }
        resumes.answer_quiet(&scheduler);
        publish(&scheduler, &mut done, &confirmed, &pipeline);
        // Done: nothing left to start (or, stopping, to finish). A parked
        // lane's resume replays rows already done: it is not waited for,
        // but when stopping (it stops too).
        let ended = if stopping.is_cancelled() {
            resumes.is_empty()
        } else {
            scheduler.is_idle()
        };
        if !items_open && workers.is_idle() && writes.is_empty() && ended {
            return Ok(scheduler.confirmed());
        }
        tokio::select! {
            // A round takes what else is already queued (bounded), so the
            // bookkeeping above — starting jobs, publishing the confirmed
            // position, which wakes the source — runs once per batch, not
            // once per item or per answer.
            item = items.recv(), if items_open => match item {
                Some(item) => {
                    let mut next = Some(item);
                    let mut taken = 0;
                    while let Some(item) = next.take() {
                        handle(&mut scheduler, &mut done, &mut router, &mut skipped, dead_letter_lane, item, &pipeline);
                        taken += 1;
                        if taken < PER_ROUND {
                            next = match items.try_recv() {
                                Ok(item) => Some(item),
                                Err(mpsc::error::TryRecvError::Empty) => None,
                                Err(mpsc::error::TryRecvError::Disconnected) => {
                                    items_open = false;
                                    None
                                }
                            };
                        }
                    }
                }
                None => items_open = false,
            },
            joined = workers.next(), if !workers.is_idle() => {
                let mut joined = Some(joined);
                let mut taken = 0;
                while let Some((ticket, job, finished)) = joined.take() {
                    if let Some((ticket, job)) = delivered(&mut scheduler, &lanes, &pipeline, ticket, job, finished?) {
                        writes.push(write(&lanes, &pipeline, ticket, job));
                    }
                    taken += 1;
                    if taken < PER_ROUND {
                        joined = workers.try_next();
                    }
                }
            }
            Some((ticket, job, written)) = writes.next() => {
                let id = written.map_err(|e| DispatchError::StoreLost(e.to_string()))?;
                wrote(&lanes, &pipeline, ticket.lane, &job.0, id);
                report(&pipeline, &job.0, ticket.lane, Outcome::DeadLettered);
                scheduler.complete(ticket);
            }
            Some(h) = resumes.handover.recv() => resumes.handle(h, &mut scheduler, &lanes),
            Some(ended) = resumes.tasks.join_next() => {
                let (lane, r) = ended.expect("resume tasks do not panic");
                resumes.ended(lane);
                r?;
            }
            // More to hand off: the next round, after whatever else is
            // ready now.
            _ = tokio::task::yield_now(), if handed_off == PER_ROUND => {}
            // Stopping: wake up to stop starting and to see whether the
            // attempts on the wire are all done.
            _ = stopping.cancelled(), if !stopping.is_cancelled() => {}
            _ = tick.tick() => {
                if pipeline.gauges {
                    lane_gauges(&scheduler, &lanes, &metrics);
                    if let Some(w) = &pipeline.window {
                        metrics.window_events.set(i64::try_from(w.held()).unwrap_or(i64::MAX));
                        let waited = w.waited();
                        metrics.window_wait_seconds.inc_by(waited.saturating_sub(window_waited).as_secs_f64());
                        window_waited = waited;
                    }
                }
                for lane in parking.check(&scheduler, &lanes) {
                    resumes.start(resume(lane));
                }
            }
        }
    }
}

/// Items, finished deliveries, or jobs handed to the dead-letter writer,
/// taken in one round of [`run`]'s loop at most: enough to share the
/// round's bookkeeping, few enough that the other side (answers, or new
/// items) waits a bounded time.
const PER_ROUND: usize = 64;

/// Books a delivery's end: its job done, handed to the dead-letter
/// writer (its lane parked meanwhile: the job is returned, to be written),
/// or abandoned; `Failing` stops the pipeline.
fn delivered<P: Position, S, D: DeadLetterStore>(
    scheduler: &mut Scheduler<P, Job>,
    lanes: &[Arc<Lane<S>>],
    pipeline: &Pipeline<D>,
    mut ticket: Ticket,
    job: Job,
    finished: Finished,
) -> Option<(Ticket, Job)> {
    match finished {
        Finished::Delivered(status) => {
            if !pipeline.restreamed.is_empty()
                && let Work::Deliver(event) = &job.0
            {
                superseded(lanes, pipeline, ticket.lane, event);
            }
            report(pipeline, &job.0, ticket.lane, Outcome::Delivered(status));
            scheduler.complete(ticket);
        }
        Finished::DeadLettered => {
            report(pipeline, &job.0, ticket.lane, Outcome::DeadLettered);
            scheduler.complete(ticket);
        }
        Finished::Parked => {
            scheduler.hand_off_running(&mut ticket);
            return Some((ticket, job));
        }
        Finished::Stopped => scheduler.abandon(ticket),
        Finished::Kept(detail) => {
            report(pipeline, &job.0, ticket.lane, Outcome::Kept(detail));
            scheduler.abandon(ticket);
        }
        Finished::Failing(detail) => {
            report(pipeline, &job.0, ticket.lane, Outcome::Failing(detail));
            scheduler.abandon(ticket);
            pipeline.stopping.cancel();
        }
    }
    None
}

/// A live event delivered at lane `lane` that an earlier session had
/// dead-lettered (or parked) there and not confirmed
/// ([`Pipeline::restreamed`]): its row is removed, with its audit row, in
/// the background. A removal that fails leaves the row (a replay sends
/// the event again; the inbox deduplicates it) and says so.
fn superseded<S, D: DeadLetterStore>(
    lanes: &[Arc<Lane<S>>],
    pipeline: &Pipeline<D>,
    lane: usize,
    event: &OutboxEvent,
) {
    let endpoint = lanes[lane].dead_letter_endpoint().unwrap_or_default();
    let key = (event.id.clone(), endpoint.to_owned());
    let (None, Some(&id)) = (event.dead_letter_id, pipeline.restreamed.get(&key)) else {
        return;
    };
    let store = Arc::clone(&pipeline.store);
    let event_id = event.id.clone();
    tokio::spawn(async move {
        match store
            .replayed(&[id], crate::dead_letter::DELIVERED_WHEN_RESTREAMED)
            .await
        {
            Ok(()) => tracing::info!(dead_letter_id = id, event_id = %event_id,
                "an event an earlier session dead-lettered was delivered when the slot streamed it again: its dead-letter row is removed (audited)"),
            Err(e) => tracing::warn!(dead_letter_id = id, event_id = %event_id, error = %e,
                "an event an earlier session dead-lettered was delivered when the slot streamed it again, but its row could not be removed: a replay would send it again"),
        }
    });
}

/// Queues a handed-off job's dead-letter row now (the writer's order is
/// the hand-off order); the future gives the row's id once committed.
fn write<S, D: DeadLetterStore>(
    lanes: &[Arc<Lane<S>>],
    pipeline: &Pipeline<D>,
    ticket: Ticket,
    job: Job,
) -> Written {
    let (row, urgency) = match &job.0 {
        Work::Deliver(event) => {
            let lane = &lanes[ticket.lane];
            let row = NewDeadLetter::parked(event, &lane.name, &lane.park.why());
            (row, Urgency::Gather)
        }
        Work::DeadLetter(row) => (NewDeadLetter::unreadable(row), Urgency::Now),
        Work::Unrouted(event) => (NewDeadLetter::unrouted(event), Urgency::Now),
    };
    let written = pipeline.store.write(&row, urgency);
    Box::pin(async move { (ticket, job, written.await) })
}

/// Counts and logs a handed-off job's committed row (counted by what this
/// process did, also when the event reused the row it already had).
fn wrote<S, D>(
    lanes: &[Arc<Lane<S>>],
    pipeline: &Pipeline<D>,
    lane: usize,
    work: &Work,
    written: Row,
) {
    // `reused`: the event already had this row (re-streamed, backfilled).
    let (id, reused) = (written.id, !written.new);
    pipeline.metrics.events_dead_lettered.inc();
    match work {
        Work::Deliver(event) => {
            lanes[lane].metrics.parked_events.inc();
            // Parking was logged once; its rows are counted.
            tracing::debug!(dead_letter_id = id, reused, event_id = %event.id, endpoint = %lanes[lane].name, "parked");
        }
        Work::DeadLetter(row) => {
            tracing::warn!(dead_letter_id = id, reused, event_id = %crate::shown(&row.event_id), problem = %row.problem, "unreadable outbox row dead-lettered");
        }
        Work::Unrouted(event) => {
            pipeline
                .metrics
                .endpoints
                .unrouted
                .with_label_values(&[Unrouted::DeadLetter.as_str()])
                .inc();
            tracing::warn!(dead_letter_id = id, reused, event_id = %event.id, event_type = %event.event_type, "unrouted event dead-lettered");
        }
    }
}

/// Reports a delivery job's end on the pipeline's report channel, if any.
fn report<D>(pipeline: &Pipeline<D>, work: &Work, lane: usize, outcome: Outcome) {
    if let (Some(tx), Work::Deliver(event)) = (&pipeline.report, work) {
        let _ = tx.send(Ended {
            event: Arc::clone(event),
            lane,
            outcome,
        });
    }
}

/// Event types skipped as unrouted and already logged (`unrouted =
/// "skip"`), up to [`SKIP_LOGGED_TYPES`].
#[derive(Default)]
struct Skipped(HashSet<String>);

/// Distinct skipped event types logged before the rest are only counted.
const SKIP_LOGGED_TYPES: usize = 1000;

fn handle<P: Position, D>(
    scheduler: &mut Scheduler<P, Job>,
    done: &mut DoneLog<P>,
    router: &mut Router,
    skipped: &mut Skipped,
    dead_letter_lane: usize,
    item: Item<P>,
    pipeline: &Pipeline<D>,
) {
    let metrics = &pipeline.metrics;
    match item {
        Item::Begin => scheduler.begin(),
        Item::Event(event, permit) => {
            if pipeline.gauges {
                metrics.events_received.inc();
            }
            done.event(Some(&event.id));
            let key = event.aggregate_key.as_deref().map(scheduler::Key::from);
            let to = router.route(&event.event_type);
            let event = Arc::new(event);
            let permit = Arc::new(permit);
            let now = Instant::now();
            if to.is_empty() {
                match router.unrouted() {
                    Unrouted::DeadLetter => {
                        let work = (Work::Unrouted(event), permit);
                        scheduler.add_to(dead_letter_lane, None, work, now);
                    }
                    Unrouted::Skip => skip(skipped, &event, metrics),
                }
                return;
            }
            let jobs = to.iter().map(|lane| {
                (
                    *lane,
                    (Work::Deliver(Arc::clone(&event)), Arc::clone(&permit)),
                )
            });
            scheduler.add_event(key, jobs, now);
        }
        Item::Unreadable(row, permit) => {
            if pipeline.gauges {
                metrics.events_received.inc();
            }
            done.event(row.event_id.as_deref());
            let work = (Work::DeadLetter(row), Arc::new(permit));
            scheduler.add_to(dead_letter_lane, None, work, Instant::now());
        }
        Item::Commit {
            end,
            commit_time_micros,
        } => {
            scheduler.commit(end);
            done.commit(end, commit_time_micros);
            if pipeline.gauges {
                metrics.received_lsn.set(scheduler.received().gauge());
            }
        }
        Item::Keepalive { wal_end } => {
            if pipeline.gauges {
                metrics.server_wal_lsn.set(wal_end.gauge());
            }
            scheduler.keepalive(wal_end);
        }
    }
}

/// An unrouted event under `unrouted = "skip"`: counted, logged once per
/// type, and done at once (its window permit is released here).
fn skip(skipped: &mut Skipped, event: &OutboxEvent, metrics: &Metrics) {
    metrics
        .endpoints
        .unrouted
        .with_label_values(&[Unrouted::Skip.as_str()])
        .inc();
    if skipped.0.len() < SKIP_LOGGED_TYPES && skipped.0.insert(event.event_type.clone()) {
        tracing::warn!(
            event_type = %event.event_type, event_id = %event.id,
            "no endpoint of the routes file takes this event type; skipping it (unrouted = \"skip\"): this is logged once per type, cdc_relay_unrouted_events_total{{action=\"skip\"}} counts every one"
        );
    }
}

/// Each lane's pending gauges, and the relay's oldest pending event age.
fn lane_gauges<P: Position, W, S>(
    scheduler: &Scheduler<P, W>,
    lanes: &[Arc<Lane<S>>],
    metrics: &Metrics,
) {
    let age = |since: Option<Instant>| since.map_or(0.0, |t| t.elapsed().as_secs_f64());
    metrics
        .oldest_unconfirmed_event_age
        .set(age(scheduler.oldest_pending_since()));
    for (i, l) in lanes.iter().enumerate() {
        l.metrics
            .oldest_pending_age
            .set(age(scheduler.lane_oldest_pending_since(i)));
        l.metrics
            .pending
            .set(i64::try_from(scheduler.lane_pending(i)).unwrap_or(i64::MAX));
    }
}

/// Sends the confirmed position when it moved, marks progress for
/// `/readyz`, and sets the gauges derived from the scheduler's state.
fn publish<P: Position, W, D>(
    scheduler: &Scheduler<P, W>,
    done: &mut DoneLog<P>,
    confirmed: &watch::Sender<Confirmed<P>>,
    pipeline: &Pipeline<D>,
) {
    let position = scheduler.confirmed();
    let passed = done.passed(position);
    let advanced = confirmed.send_if_modified(|cur| {
        let changed = cur.position != position || passed.is_some();
        cur.position = position;
        if passed.is_some() {
            cur.last_done = passed;
        }
        changed
    });
    let pending = scheduler.pending();
    if advanced || pending == 0 {
        pipeline.health.progress();
    }
    if pipeline.gauges {
        pipeline.metrics.confirmed_lsn.set(position.gauge());
        pipeline
            .metrics
            .pending_events
            .set(i64::try_from(pending).unwrap_or(i64::MAX));
    }
}
