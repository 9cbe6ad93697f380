//! The dispatcher's state machine: which job may start, and what may be
//! confirmed. No I/O, no clock of its own, no tasks: the caller feeds it the
//! stream and the completions and starts the jobs it hands out.
//!
//! Rules:
//! - Jobs are numbered in stream order. Each job belongs to a *lane* (an
//!   endpoint, or the dead-letter lane), and an event routed to several
//!   endpoints is one job per lane.
//! - Jobs start in stream order, except that a job whose aggregate key is
//!   *claimed* in its lane (an earlier job of the same lane and key is
//!   ready or running) waits behind it: two jobs of one aggregate are never
//!   running together at one endpoint and keep commit order there. Lanes
//!   do not wait for each other.
//! - At most the lane's `max_in_flight` jobs of a lane run at once, and
//!   none starts while the lane is *held* (the handover of a parked
//!   endpoint back to live waits for its lane to be quiet).
//! - A lane *in stream order* ([`Scheduler::in_stream_order`]) starts no
//!   job while an earlier job of it waits on its aggregate: its jobs start
//!   strictly in stream order, though several may run (one request at a
//!   time carrying a batch of them, in that order).
//! - A job may instead be *handed off* ([`Scheduler::hand_off`]): given to
//!   a single writer that completes jobs in the order it is handed them
//!   (the dead-letter writer). Its aggregate's claim is released at the
//!   hand-off, so the aggregate's next job may be handed off behind it at
//!   once: the writer's order keeps commit order. A handed-off job counts
//!   toward no `max_in_flight`, and is pending until completed.
//! - A job may be *abandoned* ([`Scheduler::abandon`]): it will not be done
//!   by this pipeline. Its aggregate stays claimed in its lane for good:
//!   the jobs waiting behind it, and later ones of the aggregate there, are
//!   given back unstarted ([`Scheduler::take_abandoned`]).
//! - Every job belongs to the transaction open when it was added; the
//!   [`AckTracker`] confirms the end of the longest prefix of transactions
//!   whose jobs — at every lane — are all complete. An abandoned job is
//!   never complete.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use tokio::time::Instant;

use crate::ack::{AckTracker, Position, TxSeq};

/// The maps of the hot path hash with aHash (a few times faster than the
/// standard SipHash on short keys, and still seeded per process).
type FastMap<K, V> = std::collections::HashMap<K, V, ahash::RandomState>;
type FastSet<K> = std::collections::HashSet<K, ahash::RandomState>;

/// An aggregate key, shared by an event's jobs and the claims on it
/// (cloned by reference count, never copied).
pub type Key = Arc<str>;

/// What a started (or handed-off) job must hand back to
/// [`Scheduler::complete`].
#[derive(Debug, PartialEq, Eq)]
pub struct Ticket {
    /// The job's place in stream order.
    pub seq: u64,
    /// The job's lane (endpoint index).
    pub lane: usize,
    tx: TxSeq,
    key: Option<Key>,
    /// The event the job is part of (its jobs at every lane share it).
    event: u64,
    /// Handed off: its claim is released already and it is not running.
    handed_off: bool,
}

struct Job<W> {
    ticket: Ticket,
    work: W,
}

/// One lane's queues.
struct Queues<W> {
    max_in_flight: usize,
    /// Jobs free to start, by stream order.
    ready: BTreeMap<u64, Job<W>>,
    /// Jobs whose key is claimed by an earlier job, per key, in order.
    waiting: FastMap<Key, VecDeque<Job<W>>>,
    /// Keys with a job ready or running.
    claimed: FastSet<Key>,
    /// Keys of abandoned jobs: claimed for good.
    given_up: FastSet<Key>,
    /// Each job not yet complete, by stream order: when it was added and
    /// its event.
    added: BTreeMap<u64, (Instant, u64)>,
    running: usize,
    /// Jobs handed off and not yet complete.
    handed_off: usize,
    /// No job starts or is handed off while set ([`Scheduler::hold`]).
    held: bool,
    /// Its jobs are handed off, never started ([`Scheduler::drain`]).
    draining: bool,
    /// In stream order ([`Scheduler::in_stream_order`]): the positions of
    /// its jobs in `waiting`.
    in_order: Option<BTreeSet<u64>>,
}

impl<W> Queues<W> {
    fn new(max_in_flight: usize) -> Self {
        Queues {
            max_in_flight: max_in_flight.max(1),
            ready: BTreeMap::new(),
            waiting: FastMap::default(),
            claimed: FastSet::default(),
            given_up: FastSet::default(),
            added: BTreeMap::new(),
            running: 0,
            handed_off: 0,
            held: false,
            draining: false,
            in_order: None,
        }
    }

    /// The stream position of the first job that may start now.
    fn startable(&self) -> Option<u64> {
        if self.held || self.draining || self.running >= self.max_in_flight {
            return None;
        }
        let first = self.ready.keys().next().copied()?;
        // In stream order, an earlier job waiting on its aggregate comes
        // first.
        match self.in_order.as_ref().and_then(BTreeSet::first) {
            Some(&waiting) if waiting < first => None,
            _ => Some(first),
        }
    }

    /// `key`'s claim passes to its next waiting job (made ready), or ends.
    fn release(&mut self, key: Key) {
        let next = self.waiting.get_mut(&key).and_then(VecDeque::pop_front);
        match next {
            Some(next) => {
                if self.waiting.get(&key).is_some_and(VecDeque::is_empty) {
                    self.waiting.remove(&key);
                }
                if let Some(waiting) = &mut self.in_order {
                    waiting.remove(&next.ticket.seq);
                }
                self.ready.insert(next.ticket.seq, next);
            }
            None => {
                self.claimed.remove(&key);
            }
        }
    }
}

/// The dispatcher's pure core. `W` is the work a job carries; `P` the
/// position type of the source (an LSN for the stream).
pub struct Scheduler<P: Position, W> {
    tracker: AckTracker<P>,
    /// The transaction items are added to (between begin and commit).
    open: Option<TxSeq>,
    next_seq: u64,
    next_event: u64,
    /// Jobs not yet complete of each event that has any.
    remaining: FastMap<u64, u32>,
    lanes: Vec<Queues<W>>,
    /// Jobs given back unstarted behind an abandoned one, with their lane.
    abandoned: Vec<(usize, W)>,
}

impl<P: Position, W> Scheduler<P, W> {
    /// An empty one-lane scheduler that confirms from `start` and runs at
    /// most `max_in_flight` jobs at once (at least 1).
    pub fn new(start: P, max_in_flight: usize) -> Self {
        Self::with_lanes(start, &[max_in_flight])
    }

    /// An empty scheduler with one lane per entry of `max_in_flight` (each
    /// at least 1; at least one lane).
    pub fn with_lanes(start: P, max_in_flight: &[usize]) -> Self {
        let mut lanes: Vec<Queues<W>> = max_in_flight.iter().map(|m| Queues::new(*m)).collect();
        if lanes.is_empty() {
            lanes.push(Queues::new(1));
        }
        Scheduler {
            tracker: AckTracker::new(start),
            open: None,
            next_seq: 0,
            next_event: 0,
            remaining: FastMap::default(),
            lanes,
            abandoned: Vec::new(),
        }
    }

    /// From now on `lane` starts its jobs strictly in stream order: none
    /// while an earlier one waits on its aggregate (see the module doc).
    /// For a lane of one request at a time that carries batches, whose
    /// `max_in_flight` here is its batch size: without it a batch would
    /// take later events of other aggregates ahead of an earlier event
    /// waiting for its aggregate's previous one.
    pub fn in_stream_order(&mut self, lane: usize) {
        let l = &mut self.lanes[lane];
        debug_assert!(l.waiting.is_empty(), "set before any job waits");
        l.in_order.get_or_insert_with(BTreeSet::new);
    }

    /// A transaction begins.
    pub fn begin(&mut self) {
        debug_assert!(self.open.is_none(), "begin inside a transaction");
        self.open = Some(self.tracker.begin());
    }

    /// A job of the open transaction on lane 0; see [`Self::add_event`].
    pub fn add(&mut self, key: Option<Key>, work: W, now: Instant) {
        self.add_event(key, [(0, work)], now);
    }

    /// A job of the open transaction on `lane`; see [`Self::add_event`].
    pub fn add_to(&mut self, lane: usize, key: Option<Key>, work: W, now: Instant) {
        self.add_event(key, [(lane, work)], now);
    }

    /// An event of the open transaction with its aggregate key (`None`: no
    /// ordering constraint), added at `now`: one job per `(lane, work)`.
    ///
    /// # Panics
    /// Outside a transaction (the source always sends Begin first), or on a
    /// lane the scheduler does not have.
    pub fn add_event(
        &mut self,
        key: Option<Key>,
        jobs: impl IntoIterator<Item = (usize, W)>,
        now: Instant,
    ) {
        let tx = self.open.expect("source sends Begin before events");
        let event = self.next_event;
        self.next_event += 1;
        for (lane, work) in jobs {
            self.tracker.add_event(tx);
            *self.remaining.entry(event).or_default() += 1;
            let seq = self.next_seq;
            self.next_seq += 1;
            let l = &mut self.lanes[lane];
            l.added.insert(seq, (now, event));
            let job = Job {
                ticket: Ticket {
                    seq,
                    lane,
                    tx,
                    key: key.clone(),
                    event,
                    handed_off: false,
                },
                work,
            };
            match &job.ticket.key {
                Some(k) if l.given_up.contains(k) => {
                    l.added.remove(&seq);
                    self.abandoned.push((lane, job.work));
                }
                Some(k) if l.claimed.contains(k) => {
                    if let Some(waiting) = &mut l.in_order {
                        waiting.insert(seq);
                    }
                    l.waiting.entry(k.clone()).or_default().push_back(job);
                }
                Some(k) => {
                    l.claimed.insert(k.clone());
                    l.ready.insert(seq, job);
                }
                None => {
                    l.ready.insert(seq, job);
                }
            }
        }
    }

    /// The open transaction committed; `end` is its end position.
    ///
    /// # Panics
    /// Outside a transaction.
    pub fn commit(&mut self, end: P) {
        let tx = self.open.take().expect("source sends Begin before Commit");
        self.tracker.commit(tx, end);
    }

    /// The server reported its WAL end; adopted when nothing is pending
    /// and no transaction is open.
    pub fn keepalive(&mut self, wal_end: P) {
        if self.open.is_none() {
            self.tracker.keepalive(wal_end);
        }
    }

    /// The next job to start: the earliest in stream order among the lanes
    /// with a ready job and fewer than their `max_in_flight` running; it
    /// counts as running until completed, handed off or abandoned.
    pub fn next_job(&mut self) -> Option<(Ticket, W)> {
        let lane = (0..self.lanes.len())
            .filter_map(|i| self.lanes[i].startable().map(|seq| (seq, i)))
            .min()?
            .1;
        let l = &mut self.lanes[lane];
        let (_, job) = l.ready.pop_first()?;
        l.running += 1;
        Some((job.ticket, job.work))
    }

    /// The next ready job of `lane` (not held), handed off: its claim
    /// passes to the aggregate's next job at once (see the module doc).
    pub fn hand_off(&mut self, lane: usize) -> Option<(Ticket, W)> {
        let l = &mut self.lanes[lane];
        if l.held {
            return None;
        }
        let (_, mut job) = l.ready.pop_first()?;
        l.handed_off += 1;
        job.ticket.handed_off = true;
        if let Some(key) = job.ticket.key.clone() {
            l.release(key);
        }
        Some((job.ticket, job.work))
    }

    /// A running job is handed off after all (its endpoint was parked
    /// while it ran): as [`Self::hand_off`].
    pub fn hand_off_running(&mut self, ticket: &mut Ticket) {
        let l = &mut self.lanes[ticket.lane];
        debug_assert!(
            l.running > 0 && !ticket.handed_off,
            "hand off a running job"
        );
        l.running -= 1;
        l.handed_off += 1;
        ticket.handed_off = true;
        if let Some(key) = ticket.key.clone() {
            l.release(key);
        }
    }

    /// A started or handed-off job is done (delivered or dead-lettered):
    /// a running job's key passes to the next job of the aggregate in its
    /// lane, and the watermark may advance.
    pub fn complete(&mut self, ticket: Ticket) {
        let l = &mut self.lanes[ticket.lane];
        if ticket.handed_off {
            debug_assert!(l.handed_off > 0, "complete without a handed-off job");
            l.handed_off -= 1;
        } else {
            debug_assert!(l.running > 0, "complete without a running job");
            l.running -= 1;
        }
        self.tracker.complete(ticket.tx);
        l.added.remove(&ticket.seq);
        if let Some(n) = self.remaining.get_mut(&ticket.event) {
            *n -= 1;
            if *n == 0 {
                self.remaining.remove(&ticket.event);
            }
        }
        if !ticket.handed_off
            && let Some(key) = ticket.key
        {
            l.release(key);
        }
    }

    /// A running job will not be done by this pipeline (see the module
    /// doc): it stays pending, and its aggregate's jobs at its lane that
    /// wait behind it are given back ([`Self::take_abandoned`]).
    pub fn abandon(&mut self, ticket: Ticket) {
        let l = &mut self.lanes[ticket.lane];
        debug_assert!(l.running > 0 && !ticket.handed_off, "abandon a running job");
        l.running -= 1;
        l.added.remove(&ticket.seq);
        if let Some(key) = ticket.key {
            for job in l.waiting.remove(&key).unwrap_or_default() {
                l.added.remove(&job.ticket.seq);
                if let Some(waiting) = &mut l.in_order {
                    waiting.remove(&job.ticket.seq);
                }
                self.abandoned.push((ticket.lane, job.work));
            }
            l.given_up.insert(key);
        }
    }

    /// The lane and work of jobs given back unstarted behind abandoned
    /// ones, since the last call.
    pub fn take_abandoned(&mut self) -> Vec<(usize, W)> {
        std::mem::take(&mut self.abandoned)
    }

    /// The position safe to confirm.
    pub fn confirmed(&self) -> P {
        self.tracker.confirmed()
    }

    /// The end of the last committed transaction received.
    pub fn received(&self) -> P {
        self.tracker.received()
    }

    /// Jobs added and not yet complete (waiting, ready, running or handed
    /// off), over all lanes.
    pub fn pending(&self) -> usize {
        self.tracker.outstanding_events()
    }

    /// Jobs of `lane` added and not yet complete (abandoned ones aside).
    pub fn lane_pending(&self, lane: usize) -> usize {
        self.lanes[lane].added.len()
    }

    /// Jobs of `lane` running or handed off now: `0` is a quiet lane.
    pub fn lane_busy(&self, lane: usize) -> usize {
        let l = &self.lanes[lane];
        l.running + l.handed_off
    }

    /// Jobs of `lane` not yet complete whose event is done at every other
    /// lane: what `lane` alone still holds of the window.
    pub fn lane_exclusive(&self, lane: usize) -> usize {
        self.lanes[lane]
            .added
            .values()
            .filter(|(_, event)| self.remaining.get(event) == Some(&1))
            .count()
    }

    /// Makes `lane` one whose jobs are only handed off ([`Self::hand_off`]),
    /// never started (`true`: a parked endpoint's, the dead-letter lane), or
    /// one whose jobs start again.
    pub fn drain(&mut self, lane: usize, draining: bool) {
        self.lanes[lane].draining = draining;
    }

    /// Whether `lane`'s jobs are only handed off ([`Self::drain`]).
    pub fn is_draining(&self, lane: usize) -> bool {
        self.lanes[lane].draining
    }

    /// Holds `lane` (no job of it starts or is handed off; jobs running
    /// finish) or lets it go again. Jobs keep being added to a held lane.
    pub fn hold(&mut self, lane: usize, held: bool) {
        self.lanes[lane].held = held;
    }

    /// Jobs running now, over all lanes.
    pub fn running(&self) -> usize {
        self.lanes.iter().map(|l| l.running).sum()
    }

    /// When the oldest job not yet complete was added, over all lanes.
    pub fn oldest_pending_since(&self) -> Option<Instant> {
        (0..self.lanes.len())
            .filter_map(|i| self.lane_oldest_pending_since(i))
            .min()
    }

    /// When the oldest job of `lane` not yet complete was added.
    pub fn lane_oldest_pending_since(&self, lane: usize) -> Option<Instant> {
        self.lanes[lane].added.values().next().map(|(at, _)| *at)
    }

    /// No job is ready, running or handed off (waiting jobs always sit
    /// behind one).
    pub fn is_idle(&self) -> bool {
        self.lanes
            .iter()
            .all(|l| l.running == 0 && l.handed_off == 0 && l.ready.is_empty())
    }
}

#[cfg(test)]
mod tests;
