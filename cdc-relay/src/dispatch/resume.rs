//! Resuming a parked endpoint (`docs/architecture.md#parking`): its parked
//! rows are replayed oldest first ([`super::replay`]), then the dispatcher
//! turns it back to live at a moment it has proven safe.
//!
//! ```text
//!  parked ─▶ pass: replay parked rows, retried until done (the breaker paces a dead endpoint)
//!              │ ▲
//!              │ └──────── more than a handful left
//!              ▼ a handful or none
//!         Hold: the lane starts and hands off no job; quiet once none is running or with the writer
//!              ▼
//!         final pass: every parked row, read once the lane is quiet, stopping at the first failure
//!              ├─ all delivered (or refused as poison) ─▶ Release{live}: live delivery
//!              └─ otherwise ─▶ Release: still parked, back to passes
//! ```
//!
//! The order argument. While the endpoint is parked, the dispatcher hands
//! its jobs to the dead-letter writer in each aggregate's commit order (a
//! job is handed off only once the previous job of its aggregate at the
//! endpoint has been), the writer stores rows in the order it is handed
//! them, and row ids increase in that order. A pass replays rows oldest
//! first, one at a time within an aggregate (an aggregate's next row goes
//! only after the previous one got its 2xx, or was refused as poison),
//! several aggregates at once: the pipeline's rule, with row ids as stream
//! order. Once the lane is held and quiet, no job of the endpoint runs,
//! starts or waits for the writer, and a handed-off job is complete only
//! once its row is committed: every parked row is in the table and no new
//! one comes (but from another shard's relay, whose aggregates are not this
//! one's). The final pass reads after that. When it leaves none, everything
//! parked is at the endpoint, and everything not yet started is later in
//! commit order: the lane goes live. A relay that dies in between starts
//! the endpoint parked again while any parked row is left.
//!
//! `Resume::run` is the task's side; `Resumes` the dispatcher's (the tasks it
//! started, and the holds and releases it carries out). One session at a
//! time replays an endpoint's rows (an advisory lock, for the relays of
//! several shards and `dead-letter replay`).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::lane::Lane;
use super::replay::{self, Rows};
use super::scheduler::Scheduler;
use super::{DispatchError, Outcome, Persist, Pipeline};
use crate::ack::Position;
use crate::dead_letter::{DeadLetterStore, StoreError};
use crate::health::Health;
use crate::metrics::Metrics;
use crate::outbox::OutboxEvent;
use crate::sink::Sink;

/// What a resume task asks of the dispatcher.
#[derive(Debug)]
pub enum Handover {
    /// Start and hand off no job of `lane`, and answer `true` on `quiet`
    /// once none of its jobs runs or waits for the writer — or answer
    /// `false` at once, holding nothing, when the lane has more than
    /// `handful` jobs pending or one older than its `max_lag`: those are
    /// still to be parked (or would be parked again at once), so the
    /// endpoint is not caught up.
    Hold {
        /// The endpoint's lane.
        lane: usize,
        /// The most jobs the lane may have pending.
        handful: usize,
        /// Answered once the lane is quiet (`true`) or at once (`false`).
        quiet: oneshot::Sender<bool>,
    },
    /// Let `lane` go again; `live`: turn its endpoint back to live first
    /// (its parked rows are all replayed).
    Release {
        /// The endpoint's lane.
        lane: usize,
        /// Whether the endpoint goes back to live delivery.
        live: bool,
    },
}

/// Parked rows read per round trip.
const PAGE: i64 = 500;

/// Rows a pass replays before it looks at the handover again.
const PASS_ROWS: usize = 5000;

/// Between tries for the resume lock another session holds.
const LOCK_RETRY: Duration = Duration::from_secs(5);

/// Between two warnings that the replay has not caught up.
const BEHIND_WARN_EVERY: Duration = Duration::from_secs(300);

/// After a handover that did not go live (refused: the lane's backlog is
/// still queued; or the final pass failed), before the next pass.
const REFUSED_PAUSE: Duration = Duration::from_secs(1);

/// What a resume task works with: the parked endpoint's lane (its sink,
/// breaker, rate cap and series), the store, the relay-wide series of
/// attempts, and the session's stopping token.
pub(super) struct Resume<S, D> {
    pub(super) lane: Arc<Lane<S>>,
    pub(super) index: usize,
    pub(super) store: Arc<D>,
    pub(super) metrics: Metrics,
    pub(super) stopping: CancellationToken,
}

/// A parked endpoint's rows after a row id, a page at a time.
struct Parked<'a, D> {
    store: &'a D,
    endpoint: &'a str,
    after: i64,
}

impl<D: DeadLetterStore> Rows for Parked<'_, D> {
    async fn next_page(&mut self) -> Result<Vec<OutboxEvent>, StoreError> {
        let rows = self.store.parked(self.endpoint, self.after, PAGE).await?;
        if let Some(last) = rows.last() {
            self.after = last.id;
        }
        Ok(rows.into_iter().map(|r| r.event).collect())
    }

    async fn remove(&mut self, ids: &[i64]) -> Result<(), StoreError> {
        self.store
            .replayed(ids, crate::dead_letter::REPLAYED_ON_RESUME)
            .await
    }
}

impl<S: Sink, D: DeadLetterStore> Resume<S, D> {
    /// Replays the endpoint's parked rows and hands it back to live
    /// delivery; returns once it is live, or when the pipeline stops. An
    /// error only when the store is lost (the session ends).
    pub(super) async fn run(self, handover: mpsc::Sender<Handover>) -> Result<(), DispatchError> {
        let name = self.lane.name.clone();
        let mut told = false;
        loop {
            match self.store.resume_lock(&name, true).await {
                Ok(true) => break,
                Ok(false) if !told => {
                    told = true;
                    tracing::info!(endpoint = %name, "another session replays this endpoint's parked rows; waiting for it");
                }
                Ok(false) => {}
                Err(StoreError::Lost(e)) => return Err(DispatchError::StoreLost(e)),
                Err(StoreError::Failed(e)) => {
                    tracing::warn!(endpoint = %name, error = %e, "cannot take the resume lock; trying again");
                }
            }
            if !self.sleep(LOCK_RETRY).await {
                return Ok(());
            }
        }
        tracing::info!(endpoint = %name, "replaying the parked endpoint's rows, oldest first; it returns to live delivery when none is left");
        let out = self.drive(&handover).await;
        // Best effort: the lock goes with the session anyway.
        let _ = self.store.resume_lock(&name, false).await;
        out
    }

    /// Passes until a handover succeeds or the pipeline stops.
    async fn drive(&self, handover: &mpsc::Sender<Handover>) -> Result<(), DispatchError> {
        // A handful: what the endpoint takes in a moment, so the lane is
        // held only briefly while the final pass replays it.
        let handful = self.lane.cfg.max_in_flight.max(8);
        let mut replayed = 0usize;
        let mut progress = tokio::time::Instant::now();
        loop {
            let p = self.pass(Persist::UntilDone, PASS_ROWS).await?;
            tracing::debug!(endpoint = %self.lane.name, done = p.done, exhausted = p.exhausted, "resume: pass ended");
            replayed += p.done;
            if self.stopping.is_cancelled() {
                return Ok(());
            }
            if !p.exhausted || p.done > handful {
                self.behind(&mut progress, replayed);
                continue;
            }
            let (quiet, quieted) = oneshot::channel();
            let hold = Handover::Hold {
                lane: self.index,
                handful,
                quiet,
            };
            if handover.send(hold).await.is_err() {
                return Ok(()); // the dispatcher is gone
            }
            tracing::debug!(endpoint = %self.lane.name, "resume: hold asked");
            let held = tokio::select! {
                q = quieted => match q {
                    Ok(held) => held,
                    Err(_) => return Ok(()),
                },
                _ = self.stopping.cancelled() => return Ok(()),
            };
            if held {
                // Bounded: a failure ends it (the lane must not stay held
                // while the endpoint is down).
                let last = self.pass(Persist::UntilFailing, handful * 4).await;
                let live =
                    matches!(&last, Ok(p) if p.exhausted && p.unended.is_empty() && p.failed == 0);
                let _ = handover
                    .send(Handover::Release {
                        lane: self.index,
                        live,
                    })
                    .await;
                replayed += last.as_ref().map_or(0, |p| p.done);
                last?;
                if live {
                    tracing::info!(endpoint = %self.lane.name, replayed, "parked endpoint resumed: its parked rows are replayed and live delivery goes on");
                    return Ok(());
                }
            }
            // Not caught up yet (its backlog is still queued in the relay,
            // to be parked and then replayed), or the endpoint failed.
            self.behind(&mut progress, replayed);
            if !self.sleep(REFUSED_PAUSE).await {
                return Ok(());
            }
        }
    }

    /// Replays parked rows from the oldest, up to `limit` of them, through
    /// a pipeline of its own (the same sink, breaker and rate cap as the
    /// lane).
    async fn pass(&self, persist: Persist, limit: usize) -> Result<Pass, DispatchError> {
        let lane = (*self.lane).clone();
        let pipeline = Pipeline {
            persist,
            ..Pipeline::new(
                Arc::clone(&self.store),
                self.metrics.clone(),
                Health::new(Duration::from_secs(60)),
                self.stopping.child_token(),
            )
        };
        let mut rows = Parked {
            store: &*self.store,
            endpoint: &self.lane.name,
            after: 0,
        };
        let mut failed = 0;
        let r = replay::replay(lane, pipeline, &mut rows, limit, |e| {
            if matches!(e.outcome, Outcome::Failing(_)) {
                failed += 1;
            }
        })
        .await?;
        Ok(Pass {
            done: r.done,
            exhausted: r.exhausted,
            unended: r.unended,
            failed,
        })
    }

    /// Warns, every [`BEHIND_WARN_EVERY`], that the endpoint is still parked
    /// although it answers: its events come faster than it takes them.
    fn behind(&self, last: &mut tokio::time::Instant, replayed: usize) {
        if last.elapsed() >= BEHIND_WARN_EVERY {
            *last = tokio::time::Instant::now();
            tracing::warn!(
                endpoint = %self.lane.name, replayed,
                "the parked endpoint has not caught up: its events arrive faster than it takes them \
                 (rate, max_in_flight, its latency), or it fails; it stays parked, its backlog in the dead-letter table"
            );
        }
    }

    /// Waits `delay` unless the pipeline stops first (`false`).
    async fn sleep(&self, delay: Duration) -> bool {
        tokio::select! {
            _ = tokio::time::sleep(delay) => true,
            _ = self.stopping.cancelled() => false,
        }
    }
}

/// How a pass went.
#[derive(Debug)]
struct Pass {
    /// Rows done: delivered, or refused as poison.
    done: usize,
    /// It read every parked row there was.
    exhausted: bool,
    /// Rows read whose job never ended.
    unended: Vec<(i64, String)>,
    /// Rows whose attempt failed (the final pass stops at the first).
    failed: usize,
}

/// A resume task's future (boxed: a resume runs a pipeline of its own).
type Task = Pin<Box<dyn Future<Output = (usize, Result<(), DispatchError>)> + Send>>;

/// The resume tasks of parked endpoints and their handovers
/// ([`Resume::run`]).
pub(super) struct Resumes {
    /// Resume tasks, each returning its lane.
    pub(super) tasks: JoinSet<(usize, Result<(), DispatchError>)>,
    /// The lanes with a resume task, and the answer owed once held and
    /// quiet.
    resuming: HashMap<usize, Option<oneshot::Sender<bool>>>,
    pub(super) handover: mpsc::Receiver<Handover>,
    /// Cloned into every task.
    handover_tx: mpsc::Sender<Handover>,
}

impl Resumes {
    pub(super) fn new(lanes: usize) -> Self {
        let (handover_tx, handover) = mpsc::channel(lanes.max(1));
        Resumes {
            tasks: JoinSet::new(),
            resuming: HashMap::new(),
            handover,
            handover_tx,
        }
    }

    /// Whether no resume task runs.
    pub(super) fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// Starts `r`'s resume task if its endpoint is parked, resumes
    /// automatically and has none.
    pub(super) fn start<S: Sink, D: DeadLetterStore>(&mut self, r: Resume<S, D>) {
        let lane = r.index;
        if self.resuming.contains_key(&lane) || !r.lane.cfg.auto_resume || !r.lane.park.is_parked()
        {
            return;
        }
        self.resuming.insert(lane, None);
        let tx = self.handover_tx.clone();
        let task: Task = Box::pin(async move { (lane, r.run(tx).await) });
        self.tasks.spawn(task);
    }

    /// Lane `lane`'s resume task ended.
    pub(super) fn ended(&mut self, lane: usize) {
        self.resuming.remove(&lane);
    }

    pub(super) fn handle<P: Position, W, S>(
        &mut self,
        h: Handover,
        scheduler: &mut Scheduler<P, W>,
        lanes: &[Arc<Lane<S>>],
    ) {
        match h {
            Handover::Hold {
                lane,
                handful,
                quiet,
            } => {
                let overdue = match (
                    scheduler.lane_oldest_pending_since(lane),
                    lanes[lane].cfg.max_lag,
                ) {
                    (Some(since), Some(max)) => since.elapsed() > max,
                    _ => false,
                };
                if overdue || scheduler.lane_pending(lane) > handful {
                    let _ = quiet.send(false);
                    return;
                }
                scheduler.hold(lane, true);
                self.resuming.insert(lane, Some(quiet));
            }
            Handover::Release { lane, live } => {
                if live && lanes[lane].park.resume() {
                    lanes[lane].metrics.parked.set(0);
                }
                if let Some(q) = self.resuming.get_mut(&lane) {
                    *q = None;
                }
                scheduler.hold(lane, false);
            }
        }
    }

    /// Answers each held lane that has no job running or with the writer.
    pub(super) fn answer_quiet<P: Position, W>(&mut self, scheduler: &Scheduler<P, W>) {
        for (lane, q) in &mut self.resuming {
            if q.is_some() && scheduler.lane_busy(*lane) == 0 {
                let _ = q.take().map(|q| q.send(true));
            }
        }
    }
}
