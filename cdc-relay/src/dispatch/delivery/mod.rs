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
//! Deliveries run on `Workers`: per lane, tasks that live as long as the
//! pipeline and deliver one job at a time.

use std::collections::VecDeque;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::lane::Lane;
use super::scheduler::Ticket;
use super::{DispatchError, Job, Persist, Work};
use crate::dead_letter::DeadLetterStore;
use crate::metrics::Metrics;
use crate::outbox::OutboxEvent;
use crate::sink::{Sink, encoder};

mod attempt;
mod batch;
mod judge;

pub use attempt::Finished;
use attempt::deliver;
use batch::deliver_group;

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
