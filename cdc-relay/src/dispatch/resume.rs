//! Resuming a parked endpoint (`docs/architecture.md#parking`): its parked
//! rows are replayed oldest first, then the dispatcher turns it back to
//! live at a moment it has proven safe.
//!
//! ```text
//!  parked ─▶ pass: replay parked rows ──(failing: the breaker paces the next pass)──┐
//!              │ ▲                                                                   │
//!              │ └───────────── more than a handful left ◀───────────────────────────┘
//!              ▼ a handful or none
//!         Hold: the lane starts no job; quiet once none runs
//!              ▼
//!         final pass: every parked row, read after the lane's last parked write
//!              ├─ all delivered (or refused as poison) ─▶ Release{live}: live delivery
//!              └─ otherwise ─▶ Release: still parked, back to passes
//! ```
//!
//! The order argument. While the endpoint is parked, its jobs become
//! parked rows in per-aggregate commit order (a job starts only after the
//! previous job of its aggregate at the endpoint is complete), and row ids
//! increase in that order. A pass replays rows oldest first, one at a time
//! within an aggregate (an aggregate's next row goes only after the
//! previous one got its 2xx, or was refused as poison), several aggregates
//! at once; the first failure stops the pass, so no row overtakes an
//! earlier one of its aggregate. Once the lane is held and quiet, no job of
//! the endpoint runs or starts, so every parked row is queued for the
//! dead-letter writer and no new one comes (but from another shard's
//! relay, whose aggregates are not this one's); the final pass reads after
//! that, and a read of the parked rows waits until every row queued before
//! it is committed (`deadletter::GroupedStore`). When it finds none left,
//! everything parked is at the endpoint, and everything not yet started is
//! later in commit order: the lane goes live. A relay that dies in between
//! starts the endpoint parked again while any parked row is left.
//!
//! [`run`] is the task's side; [`Resumes`] the dispatcher's (the tasks it
//! started, and the holds and releases it carries out).
//!
//! Replays are paced by the endpoint's `rate` and go through its breaker,
//! so a dead endpoint sees the breaker's probes and nothing more. One
//! session at a time replays an endpoint's rows (an advisory lock, for the
//! relays of several shards).

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};

use tokio::task::JoinSet;

use super::DispatchError;
use super::delivery::{Delivery, Tried, unix_micros};
use super::park::Parking;
use super::scheduler::Scheduler;
use crate::ack::Position;
use crate::deadletter::{DeadLetterStore, NewDeadLetter, ParkedRow, StoreError};
use crate::endpoint_metrics::EndpointMetrics;
use crate::sink::Sink;

/// What a resume task asks of the dispatcher.
#[derive(Debug)]
pub enum Handover {
    /// Start no job of `lane` and answer `true` on `quiet` once none of
    /// its jobs runs — or answer `false` at once, holding nothing, when the
    /// lane has more than `handful` jobs pending or one older than its
    /// `max_lag`: those are still to be parked (or would be parked again at
    /// once), so the endpoint is not caught up.
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

/// Failed passes between two warnings.
const WARN_EVERY: u32 = 20;

/// Between two warnings that the replay has not caught up.
const BEHIND_WARN_EVERY: Duration = Duration::from_secs(300);

/// After the dispatcher refused a handover (the lane's backlog is still
/// queued), before the next pass.
const REFUSED_PAUSE: Duration = Duration::from_secs(1);

/// How a pass went.
#[derive(Debug, Default)]
struct Pass {
    /// Rows done: delivered, or refused as poison.
    handled: usize,
    /// It read every parked row there was.
    exhausted: bool,
    /// Why it stopped early (the endpoint failing, the table unreadable,
    /// the relay stopping).
    stopped: Option<String>,
}

/// Replays endpoint `lane`'s parked rows and hands it back to live
/// delivery; returns once it is live, or when the pipeline stops. An error
/// only when the store is lost (the session ends).
pub async fn run<S: Sink, D: DeadLetterStore>(
    d: Arc<Delivery<S, D>>,
    lane: usize,
    handover: mpsc::Sender<Handover>,
) -> Result<(), DispatchError> {
    let name = d.endpoint.name().to_owned();
    let mut told = false;
    loop {
        match d.store.resume_lock(&name, true).await {
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
        if !sleep(&d, LOCK_RETRY).await {
            return Ok(());
        }
    }
    tracing::info!(endpoint = %name, "replaying the parked endpoint's rows, oldest first; it returns to live delivery when none is left");
    let out = drive(&d, lane, &handover).await;
    // Best effort: the lock goes with the session anyway.
    let _ = d.store.resume_lock(&name, false).await;
    out
}

/// Passes until a handover succeeds or the pipeline stops.
async fn drive<S: Sink, D: DeadLetterStore>(
    d: &Delivery<S, D>,
    lane: usize,
    handover: &mpsc::Sender<Handover>,
) -> Result<(), DispatchError> {
    // A handful: what the endpoint takes in a moment, so the lane is held
    // only briefly while the final pass replays it.
    let handful = d.cfg.max_in_flight.max(8);
    let mut backoff = d.backoff();
    let mut failed: u32 = 0;
    let mut replayed = 0usize;
    let mut progress = tokio::time::Instant::now();
    loop {
        let p = pass(d, PASS_ROWS).await?;
        replayed += p.handled;
        if d.stopping.is_cancelled() {
            return Ok(());
        }
        if let Some(why) = &p.stopped {
            if failed.is_multiple_of(WARN_EVERY) {
                tracing::warn!(endpoint = %d.endpoint.name(), why = %why, replayed, "replaying the parked endpoint's rows stopped; trying again (its breaker paces the tries)");
            }
            failed += 1;
            let delay = backoff.next_delay(None, &mut rand::rng());
            if !sleep(d, delay).await {
                return Ok(());
            }
            continue;
        }
        failed = 0;
        backoff = d.backoff();
        if !p.exhausted || p.handled > handful {
            behind(d, &mut progress, replayed);
            continue;
        }
        let (quiet, quieted) = oneshot::channel();
        let hold = Handover::Hold {
            lane,
            handful,
            quiet,
        };
        if handover.send(hold).await.is_err() {
            return Ok(()); // the dispatcher is gone
        }
        let held = tokio::select! {
            q = quieted => match q {
                Ok(held) => held,
                Err(_) => return Ok(()),
            },
            _ = d.stopping.cancelled() => return Ok(()),
        };
        if !held {
            // Its backlog is still queued in the relay, to be parked and
            // then replayed: not caught up yet.
            behind(d, &mut progress, replayed);
            if !sleep(d, REFUSED_PAUSE).await {
                return Ok(());
            }
            continue;
        }
        let last = pass(d, handful * 4).await;
        let live = matches!(&last, Ok(p) if p.exhausted && p.stopped.is_none());
        let _ = handover.send(Handover::Release { lane, live }).await;
        replayed += last.as_ref().map_or(0, |p| p.handled);
        last?;
        if live {
            tracing::info!(endpoint = %d.endpoint.name(), replayed, "parked endpoint resumed: its parked rows are replayed and live delivery goes on");
            return Ok(());
        }
    }
}

/// Warns, every [`BEHIND_WARN_EVERY`], that the endpoint is still parked
/// although it answers: its events come faster than it takes them.
fn behind<S, D>(d: &Delivery<S, D>, last: &mut tokio::time::Instant, replayed: usize) {
    if last.elapsed() >= BEHIND_WARN_EVERY {
        *last = tokio::time::Instant::now();
        tracing::warn!(
            endpoint = %d.endpoint.name(), replayed,
            "the parked endpoint answers but has not caught up: its events arrive faster than it takes them \
             (rate, max_in_flight, its latency); it stays parked, its backlog in the dead-letter table"
        );
    }
}

/// Waits `delay` unless the pipeline stops first (`false`).
async fn sleep<S, D>(d: &Delivery<S, D>, delay: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(delay) => true,
        _ = d.stopping.cancelled() => false,
    }
}

/// Replays parked rows from the oldest, up to `limit` of them.
async fn pass<S: Sink, D: DeadLetterStore>(
    d: &Delivery<S, D>,
    limit: usize,
) -> Result<Pass, DispatchError> {
    let mut p = Pass::default();
    let mut after = 0;
    while p.handled < limit {
        if d.stopping.is_cancelled() {
            p.stopped = Some("the relay is stopping".into());
            return Ok(p);
        }
        let want = PAGE.min(i64::try_from(limit - p.handled).unwrap_or(PAGE));
        let rows = match d.store.parked(d.endpoint.name(), after, want).await {
            Ok(rows) => rows,
            Err(StoreError::Lost(e)) => return Err(DispatchError::StoreLost(e)),
            Err(StoreError::Failed(e)) => {
                p.stopped = Some(format!("cannot read the parked rows: {e}"));
                return Ok(p);
            }
        };
        let full = rows.len() as i64 == want;
        if let Some(last) = rows.last() {
            after = last.id;
        }
        let (handled, stopped) = page(d, rows).await?;
        p.handled += handled;
        if stopped.is_some() {
            p.stopped = stopped;
            return Ok(p);
        }
        if !full {
            p.exhausted = true;
            return Ok(p);
        }
    }
    Ok(p)
}

/// Replays one page: its aggregates at once (up to the endpoint's
/// `max_in_flight`), each aggregate's rows one after the other, then
/// removes the delivered rows. Returns the rows done and why it stopped
/// early.
async fn page<S: Sink, D: DeadLetterStore>(
    d: &Delivery<S, D>,
    rows: Vec<ParkedRow>,
) -> Result<(usize, Option<String>), DispatchError> {
    let mut chains: Vec<Vec<ParkedRow>> = Vec::new();
    let mut by_key: HashMap<String, usize> = HashMap::new();
    for row in rows {
        match row.event.aggregate_key.clone() {
            Some(k) => match by_key.get(&k) {
                Some(&i) => chains[i].push(row),
                None => {
                    by_key.insert(k, chains.len());
                    chains.push(vec![row]);
                }
            },
            None => chains.push(vec![row]),
        }
    }
    let stopped: OnceLock<String> = OnceLock::new();
    let done: Vec<Result<(Vec<i64>, usize), DispatchError>> = futures::stream::iter(chains)
        .map(|c| chain(d, c, &stopped))
        .buffer_unordered(d.cfg.max_in_flight.max(1))
        .collect()
        .await;
    let mut delivered = Vec::new();
    let mut refused = 0;
    let mut lost = None;
    for r in done {
        match r {
            Ok((ids, n)) => {
                delivered.extend(ids);
                refused += n;
            }
            Err(e) => lost = Some(e),
        }
    }
    // Rows delivered are removed even when the store failed elsewhere.
    let removed = remove(d, &delivered).await?;
    if let Some(e) = lost {
        return Err(e);
    }
    let stopped = stopped
        .into_inner()
        .or_else(|| (!removed).then(|| "the relay is stopping".to_owned()));
    Ok((delivered.len() + refused, stopped))
}

/// Replays one aggregate's rows in order until one fails; returns the rows
/// delivered and how many were refused as poison.
async fn chain<S: Sink, D: DeadLetterStore>(
    d: &Delivery<S, D>,
    rows: Vec<ParkedRow>,
    stopped: &OnceLock<String>,
) -> Result<(Vec<i64>, usize), DispatchError> {
    let mut delivered = Vec::new();
    let mut refused = 0;
    for row in rows {
        if stopped.get().is_some() {
            break;
        }
        let seq = u64::try_from(row.id).unwrap_or(0);
        let admission = tokio::select! {
            a = d.breaker.admit(seq) => a,
            _ = d.stopping.cancelled() => {
                d.breaker.withdraw(seq);
                break;
            }
        };
        // Another aggregate's row failed while this one waited for the
        // breaker: the endpoint is failing, so this row is not tried.
        if stopped.get().is_some() {
            d.breaker.release(admission);
            break;
        }
        if let Some(pace) = &d.pace
            && !until_stopping(d, pace.wait()).await
        {
            d.breaker.release(admission);
            break;
        }
        let request = d.sink.prepare(&row.event);
        match d.attempt(admission, &row.event, &request, false).await {
            Tried::Delivered => delivered.push(row.id),
            Tried::Poison(reason, attempt) => {
                let mut dl =
                    NewDeadLetter::rejected(&row.event, &attempt, &reason, 1, unix_micros());
                dl.endpoint.clone_from(&d.dead_letter_endpoint);
                if !write_refused(d, row.id, &dl).await? {
                    break;
                }
                d.endpoint.dead_lettered.inc();
                refused += 1;
            }
            Tried::Failed {
                reason, attempt, ..
            } => {
                let _ = stopped.set(format!("{reason}: {}", attempt.detail()));
                break;
            }
        }
    }
    Ok((delivered, refused))
}

/// Waits for `f` unless the pipeline stops first (`false`).
async fn until_stopping<S, D>(d: &Delivery<S, D>, f: impl Future<Output = ()>) -> bool {
    tokio::select! {
        () = f => true,
        _ = d.stopping.cancelled() => false,
    }
}

/// Records a parked row refused as poison, retrying until it is
/// committed; `false` when the pipeline stopped first (the row stays
/// parked, and its aggregate waits behind it).
async fn write_refused<S: Sink, D: DeadLetterStore>(
    d: &Delivery<S, D>,
    id: i64,
    row: &NewDeadLetter,
) -> Result<bool, DispatchError> {
    let mut backoff = d.backoff();
    loop {
        match d.store.refused(id, row).await {
            Ok(()) => return Ok(true),
            Err(StoreError::Lost(e)) => return Err(DispatchError::StoreLost(e)),
            Err(StoreError::Failed(e)) => {
                tracing::error!(error = %e, dead_letter_id = id, "cannot record a replayed parked row as refused; trying again");
                let delay = backoff.next_delay(None, &mut rand::rng());
                if !sleep(d, delay).await {
                    return Ok(false);
                }
            }
        }
    }
}

/// Removes delivered rows (with their audit rows), retrying until it is
/// committed. Stopping first leaves them (`false`): they are sent again
/// after a restart (at-least-once).
async fn remove<S: Sink, D: DeadLetterStore>(
    d: &Delivery<S, D>,
    ids: &[i64],
) -> Result<bool, DispatchError> {
    if ids.is_empty() {
        return Ok(true);
    }
    let mut backoff = d.backoff();
    loop {
        match d.store.replayed(ids).await {
            Ok(()) => return Ok(true),
            Err(StoreError::Lost(e)) => return Err(DispatchError::StoreLost(e)),
            Err(StoreError::Failed(e)) => {
                tracing::error!(error = %e, rows = ids.len(), "cannot remove replayed parked rows; trying again");
                let delay = backoff.next_delay(None, &mut rand::rng());
                if !sleep(d, delay).await {
                    return Ok(false);
                }
            }
        }
    }
}

/// The resume tasks of parked endpoints and their handovers
/// ([`resume`]).
pub(super) struct Resumes {
    /// Resume tasks, each returning its lane.
    pub(super) tasks: JoinSet<(usize, Result<(), DispatchError>)>,
    /// Whether lane `i` has a resume task.
    pub(super) running: Vec<bool>,
    /// Lanes held for a handover, with the answer owed once quiet.
    quiet: Vec<Option<oneshot::Sender<bool>>>,
    pub(super) handover: mpsc::Receiver<Handover>,
    /// Cloned into every task.
    handover_tx: mpsc::Sender<Handover>,
}

impl Resumes {
    pub(super) fn new(lanes: usize) -> Self {
        let (handover_tx, handover) = mpsc::channel(lanes.max(1));
        Resumes {
            tasks: JoinSet::new(),
            running: vec![false; lanes],
            quiet: (0..lanes).map(|_| None).collect(),
            handover,
            handover_tx,
        }
    }

    /// Starts lane `lane`'s resume task if its endpoint is parked, resumes
    /// automatically and has none.
    pub(super) fn start<S: Sink, D: DeadLetterStore>(
        &mut self,
        lane: usize,
        parking: &Parking,
        deliveries: &[Arc<Delivery<S, D>>],
    ) {
        if self.running[lane] || !parking.auto_resume[lane] || !parking.parks[lane].is_parked() {
            return;
        }
        self.running[lane] = true;
        let d = Arc::clone(&deliveries[lane]);
        let tx = self.handover_tx.clone();
        self.tasks
            .spawn(async move { (lane, run(d, lane, tx).await) });
    }

    pub(super) fn handle<P: Position, W>(
        &mut self,
        h: Handover,
        scheduler: &mut Scheduler<P, W>,
        parking: &Parking,
        metrics: &[EndpointMetrics],
    ) {
        match h {
            Handover::Hold {
                lane,
                handful,
                quiet,
            } => {
                let overdue = match (
                    scheduler.lane_oldest_pending_since(lane),
                    parking.max_lags[lane],
                ) {
                    (Some(since), Some(max)) => since.elapsed() > max,
                    _ => false,
                };
                if overdue || scheduler.lane_pending(lane) > handful {
                    let _ = quiet.send(false);
                    return;
                }
                scheduler.hold(lane, true);
                self.quiet[lane] = Some(quiet);
            }
            Handover::Release { lane, live } => {
                if live && parking.parks[lane].resume() {
                    metrics[lane].parked.set(0);
                }
                self.quiet[lane] = None;
                scheduler.hold(lane, false);
            }
        }
    }

    /// Answers each held lane that no job of runs any more.
    pub(super) fn answer_quiet<P: Position, W>(&mut self, scheduler: &Scheduler<P, W>) {
        for (lane, q) in self.quiet.iter_mut().enumerate() {
            if q.is_some() && scheduler.lane_running(lane) == 0 {
                let _ = q.take().map(|q| q.send(true));
            }
        }
    }
}
