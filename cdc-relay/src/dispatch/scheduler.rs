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

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use tokio::time::Instant;

use crate::ack::{AckTracker, Position, TxSeq};

/// What a started (or handed-off) job must hand back to
/// [`Scheduler::complete`].
#[derive(Debug, PartialEq, Eq)]
pub struct Ticket {
    /// The job's place in stream order.
    pub seq: u64,
    /// The job's lane (endpoint index).
    pub lane: usize,
    tx: TxSeq,
    key: Option<String>,
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
    waiting: HashMap<String, VecDeque<Job<W>>>,
    /// Keys with a job ready or running.
    claimed: HashSet<String>,
    /// Keys of abandoned jobs: claimed for good.
    given_up: HashSet<String>,
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
}

impl<W> Queues<W> {
    fn new(max_in_flight: usize) -> Self {
        Queues {
            max_in_flight: max_in_flight.max(1),
            ready: BTreeMap::new(),
            waiting: HashMap::new(),
            claimed: HashSet::new(),
            given_up: HashSet::new(),
            added: BTreeMap::new(),
            running: 0,
            handed_off: 0,
            held: false,
            draining: false,
        }
    }

    /// The stream position of the first job that may start now.
    fn startable(&self) -> Option<u64> {
        if self.held || self.draining || self.running >= self.max_in_flight {
            return None;
        }
        self.ready.keys().next().copied()
    }

    /// `key`'s claim passes to its next waiting job (made ready), or ends.
    fn release(&mut self, key: String) {
        let next = self.waiting.get_mut(&key).and_then(VecDeque::pop_front);
        match next {
            Some(next) => {
                if self.waiting.get(&key).is_some_and(VecDeque::is_empty) {
                    self.waiting.remove(&key);
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
    remaining: HashMap<u64, u32>,
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
            remaining: HashMap::new(),
            lanes,
            abandoned: Vec::new(),
        }
    }

    /// A transaction begins.
    pub fn begin(&mut self) {
        debug_assert!(self.open.is_none(), "begin inside a transaction");
        self.open = Some(self.tracker.begin());
    }

    /// A job of the open transaction on lane 0; see [`Self::add_event`].
    pub fn add(&mut self, key: Option<String>, work: W, now: Instant) {
        self.add_event(key, [(0, work)], now);
    }

    /// A job of the open transaction on `lane`; see [`Self::add_event`].
    pub fn add_to(&mut self, lane: usize, key: Option<String>, work: W, now: Instant) {
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
        key: Option<String>,
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
mod tests {
    use super::*;
    use crate::lsn::Lsn;
    use proptest::prelude::*;

    fn lsn(n: u64) -> Lsn {
        Lsn::new(n)
    }

    #[test]
    fn one_job_per_key_and_at_most_max_in_flight() {
        let now = Instant::now();
        let mut s: Scheduler<Lsn, &str> = Scheduler::new(lsn(0), 2);
        s.begin();
        s.add(Some("a".into()), "a1", now);
        s.add(Some("a".into()), "a2", now);
        s.add(None, "x", now);
        s.add(Some("b".into()), "b1", now);
        s.commit(lsn(10));

        let (t1, w1) = s.next_job().unwrap();
        let (t2, w2) = s.next_job().unwrap();
        assert_eq!((w1, w2), ("a1", "x"), "a2 waits behind a1; x may pass it");
        assert!(s.next_job().is_none(), "max_in_flight = 2");
        s.complete(t2);
        let (t3, w3) = s.next_job().unwrap();
        assert_eq!(w3, "b1");
        s.complete(t1);
        let (t4, w4) = s.next_job().unwrap();
        assert_eq!(w4, "a2", "a1 done: a2 may go");
        assert_eq!(s.confirmed(), lsn(0), "a2 and b1 are not done");
        s.complete(t3);
        s.complete(t4);
        assert_eq!(s.confirmed(), lsn(10));
        assert!(s.is_idle());
        assert_eq!(s.pending(), 0);
    }

    #[test]
    fn a_held_lane_starts_nothing_and_keeps_its_jobs() {
        let now = Instant::now();
        let mut s: Scheduler<Lsn, &str> = Scheduler::with_lanes(lsn(0), &[4, 4]);
        s.begin();
        s.add_to(0, None, "x1@0", now);
        s.commit(lsn(10));
        let (t0, _) = s.next_job().unwrap();
        s.hold(0, true);
        s.begin();
        s.add_to(0, None, "x2@0", now);
        s.add_to(1, None, "y@1", now);
        s.commit(lsn(20));
        let (t1, w1) = s.next_job().unwrap();
        assert_eq!(w1, "y@1", "the other lane goes on");
        assert!(s.next_job().is_none(), "lane 0 is held");
        assert_eq!(s.lane_busy(0), 1, "its running job finishes");
        s.complete(t0);
        s.complete(t1);
        assert_eq!(s.lane_busy(0), 0);
        assert_eq!(s.confirmed(), lsn(10), "x2 waits, held");
        s.hold(0, false);
        let (t2, w2) = s.next_job().unwrap();
        assert_eq!(w2, "x2@0");
        s.complete(t2);
        assert_eq!(s.confirmed(), lsn(20));
    }

    #[test]
    fn a_blocked_lane_does_not_hold_the_other_back() {
        let now = Instant::now();
        let mut s: Scheduler<Lsn, &str> = Scheduler::with_lanes(lsn(0), &[1, 1]);
        s.begin();
        s.add_to(0, Some("a".into()), "a1@0", now);
        s.add_to(1, Some("a".into()), "a1@1", now);
        s.commit(lsn(10));
        s.begin();
        s.add_to(0, Some("a".into()), "a2@0", now);
        s.add_to(1, Some("a".into()), "a2@1", now);
        s.commit(lsn(20));
        let (t0, w0) = s.next_job().unwrap();
        let (t1, w1) = s.next_job().unwrap();
        assert_eq!((w0, w1), ("a1@0", "a1@1"), "one per lane, the same key");
        assert!(s.next_job().is_none());
        assert_eq!(
            (s.lane_pending(0), s.lane_busy(0)),
            (2, 1),
            "a2 waits behind a1, not running"
        );
        s.complete(t1);
        let (t2, w2) = s.next_job().unwrap();
        assert_eq!(w2, "a2@1", "lane 1 goes on while lane 0 is stuck");
        s.complete(t2);
        assert_eq!(s.confirmed(), lsn(0), "both transactions wait for lane 0");
        assert_eq!((s.lane_pending(0), s.lane_pending(1)), (2, 0));
        s.complete(t0);
        assert_eq!(s.confirmed(), lsn(10));
        let (t3, _) = s.next_job().unwrap();
        s.complete(t3);
        assert_eq!(s.confirmed(), lsn(20));

        // A lane at its max_in_flight with more ready does not stop a later
        // job of another lane (no head-of-line blocking across lanes).
        let mut s: Scheduler<Lsn, &str> = Scheduler::with_lanes(lsn(0), &[1, 1]);
        s.begin();
        s.add_to(0, None, "x1@0", now);
        s.add_to(0, None, "x2@0", now);
        s.add_to(1, None, "y@1", now);
        s.commit(lsn(10));
        let started: Vec<&str> = std::iter::from_fn(|| s.next_job().map(|(_, w)| w)).collect();
        assert_eq!(started, ["x1@0", "y@1"]);
    }

    #[test]
    fn a_hand_off_releases_the_claim_and_completes_in_its_own_time() {
        let now = Instant::now();
        let mut s: Scheduler<Lsn, &str> = Scheduler::with_lanes(lsn(0), &[1, 1]);
        s.begin();
        s.add_to(0, Some("a".into()), "a1", now);
        s.add_to(0, Some("a".into()), "a2", now);
        s.add_to(0, None, "x", now);
        s.commit(lsn(10));
        let (h1, w1) = s.hand_off(0).unwrap();
        let (h2, w2) = s.hand_off(0).unwrap();
        let (h3, w3) = s.hand_off(0).unwrap();
        assert_eq!(
            [w1, w2, w3],
            ["a1", "a2", "x"],
            "a2 follows a1 at once, in stream order; no max_in_flight"
        );
        assert!(s.hand_off(0).is_none() && s.next_job().is_none());
        s.begin();
        s.add_to(0, None, "y", now);
        s.commit(lsn(15));
        s.drain(0, true);
        assert!(s.next_job().is_none(), "a draining lane starts nothing");
        let (h4, _) = s.hand_off(0).unwrap();
        s.drain(0, false);
        s.complete(h4);
        assert_eq!((s.lane_busy(0), s.running()), (3, 0));
        s.complete(h1);
        s.complete(h3);
        assert_eq!(s.confirmed(), lsn(0), "a2 is still being written");
        s.complete(h2);
        assert_eq!(s.confirmed(), lsn(15));
        assert!(s.is_idle());

        // A running job handed off lets its aggregate's next job go.
        s.begin();
        s.add_to(1, Some("b".into()), "b1", now);
        s.add_to(1, Some("b".into()), "b2", now);
        s.commit(lsn(20));
        let (mut t1, _) = s.next_job().unwrap();
        assert!(s.next_job().is_none(), "b2 waits behind b1");
        s.hand_off_running(&mut t1);
        let (t2, w) = s.hand_off(1).unwrap();
        assert_eq!(w, "b2");
        s.hold(1, true);
        assert_eq!(s.lane_busy(1), 2, "both with the writer");
        s.complete(t2);
        s.complete(t1);
        assert_eq!((s.confirmed(), s.lane_busy(1)), (lsn(20), 0));
    }

    #[test]
    fn an_abandoned_job_holds_its_aggregate_and_gives_back_what_waits() {
        let now = Instant::now();
        let mut s: Scheduler<Lsn, &str> = Scheduler::new(lsn(0), 4);
        s.begin();
        s.add(Some("a".into()), "a1", now);
        s.add(Some("a".into()), "a2", now);
        s.add(Some("b".into()), "b1", now);
        s.commit(lsn(10));
        let (ta, _) = s.next_job().unwrap();
        let (tb, _) = s.next_job().unwrap();
        s.abandon(ta);
        assert_eq!(s.take_abandoned(), [(0, "a2")], "a2 must not overtake a1");
        s.begin();
        s.add(Some("a".into()), "a3", now);
        s.add(Some("c".into()), "c1", now);
        s.commit(lsn(20));
        assert_eq!(s.take_abandoned(), [(0, "a3")], "later ones of a too");
        let (tc, w) = s.next_job().unwrap();
        assert_eq!(w, "c1", "other aggregates go on");
        s.complete(tb);
        s.complete(tc);
        assert_eq!(s.confirmed(), lsn(0), "an abandoned job is never done");
        assert!(s.is_idle(), "nothing left to start or wait for");
    }

    #[test]
    fn what_a_lane_alone_holds_counts_events_done_everywhere_else() {
        let now = Instant::now();
        let mut s: Scheduler<Lsn, &str> = Scheduler::with_lanes(lsn(0), &[4, 4]);
        s.begin();
        s.add_event(None, [(0, "e1@0"), (1, "e1@1")], now);
        s.add_event(None, [(0, "e2@0"), (1, "e2@1")], now);
        s.add_event(None, [(1, "e3@1")], now);
        s.commit(lsn(10));
        assert_eq!((s.lane_exclusive(0), s.lane_exclusive(1)), (0, 1));
        let started: Vec<(Ticket, &str)> = std::iter::from_fn(|| s.next_job()).collect();
        for (t, w) in started {
            if w.ends_with("@0") {
                s.complete(t);
            }
        }
        assert_eq!(
            (s.lane_exclusive(0), s.lane_exclusive(1)),
            (0, 3),
            "lane 0 is done with e1 and e2: lane 1 alone holds all three, running ones included"
        );
    }

    #[derive(Debug, Clone)]
    enum Step {
        /// A transaction whose events have these keys (`None`: no key) and
        /// go to these lanes (bit 0: lane 0, bit 1: lane 1; 0 = none).
        Tx(Vec<(Option<u8>, u8)>),
        /// Complete the running job at this index (mod the running count).
        Complete(usize),
        /// Start whatever may start.
        Start,
        Keepalive,
        /// Hold lane (index mod 2), or let it go.
        Hold(usize, bool),
        /// Hand off every ready job of a lane to the writer.
        HandOff(usize),
        /// The writer completes its oldest job.
        Write,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            2 => proptest::collection::vec((proptest::option::of(0u8..4), 0u8..4), 0..4).prop_map(Step::Tx),
            3 => any::<usize>().prop_map(Step::Complete),
            3 => Just(Step::Start),
            1 => Just(Step::Keepalive),
            1 => (0usize..2, any::<bool>()).prop_map(|(l, h)| Step::Hold(l, h)),
            1 => (0usize..2).prop_map(Step::HandOff),
            2 => Just(Step::Write),
        ]
    }

    proptest! {
        /// Random streams over two lanes (events to one, both or neither)
        /// and completion orders, lanes held and let go, jobs handed off
        /// to a writer that completes them in order: no two running
        /// jobs of a lane share a key, never more than a lane's
        /// max_in_flight run in it, no job of a held lane starts or is
        /// handed off, jobs of one key start (or are handed off) in stream
        /// order in each lane, the confirmed
        /// position never passes a transaction with an incomplete job at
        /// any lane, and everything drains.
        #[test]
        fn keys_window_and_watermark_hold(
            max in (1usize..5, 1usize..5),
            steps in proptest::collection::vec(step(), 1..150),
        ) {
            let now = Instant::now();
            let maxes = [max.0, max.1];
            let mut s: Scheduler<Lsn, (u64, Option<u8>, Lsn)> = Scheduler::with_lanes(lsn(100), &maxes);
            let mut wal = 100u64;
            let mut running: Vec<(Ticket, Option<u8>)> = Vec::new();
            // end position of each incomplete job, by seq
            let mut incomplete: BTreeMap<u64, Lsn> = BTreeMap::new();
            let mut last_started: HashMap<(usize, u8), u64> = HashMap::new();
            let mut seq = 0u64;
            let mut held = [false, false];
            let mut writer: VecDeque<Ticket> = VecDeque::new();
            // lane and event number of each job, by seq
            let mut job_of: HashMap<u64, (usize, u64)> = HashMap::new();
            let mut event = 0u64;
            let start = |s: &mut Scheduler<Lsn, (u64, Option<u8>, Lsn)>,
                             running: &mut Vec<(Ticket, Option<u8>)>,
                             last_started: &mut HashMap<(usize, u8), u64>,
                             held: &[bool; 2]|
             -> Result<(), TestCaseError> {
                while let Some((ticket, (job_seq, key, _))) = s.next_job() {
                    prop_assert_eq!(ticket.seq, job_seq);
                    let lane = ticket.lane;
                    prop_assert!(!held[lane], "a job of held lane {} started", lane);
                    if let Some(k) = key {
                        prop_assert!(
                            running.iter().all(|(t, rk)| t.lane != lane || *rk != Some(k)),
                            "two jobs of key {} running in lane {}", k, lane
                        );
                        if let Some(prev) = last_started.insert((lane, k), job_seq) {
                            prop_assert!(prev < job_seq, "key {} out of order in lane {}", k, lane);
                        }
                    }
                    running.push((ticket, key));
                    let in_lane = running.iter().filter(|(t, _)| t.lane == lane).count();
                    prop_assert!(in_lane <= maxes[lane], "more than lane {}'s max_in_flight", lane);
                    prop_assert_eq!(s.running(), running.len());
                }
                Ok(())
            };
            for step in steps {
                match step {
                    Step::Tx(keys) => {
                        s.begin();
                        wal += 10;
                        for (key, mask) in &keys {
                            let mut jobs = Vec::new();
                            for lane in (0..2).filter(|l| mask & (1 << l) != 0) {
                                jobs.push((lane, (seq, *key, lsn(wal))));
                                incomplete.insert(seq, lsn(wal));
                                job_of.insert(seq, (lane, event));
                                seq += 1;
                            }
                            s.add_event(key.map(|k| k.to_string()), jobs, now);
                            event += 1;
                        }
                        s.commit(lsn(wal));
                    }
                    Step::Complete(i) if !running.is_empty() => {
                        let (ticket, _) = running.swap_remove(i % running.len());
                        incomplete.remove(&ticket.seq);
                        s.complete(ticket);
                    }
                    Step::Complete(_) => {}
                    Step::Start => start(&mut s, &mut running, &mut last_started, &held)?,
                    Step::Keepalive => {
                        wal += 5;
                        s.keepalive(lsn(wal));
                    }
                    Step::Hold(lane, h) => {
                        held[lane] = h;
                        s.hold(lane, h);
                    }
                    Step::HandOff(lane) => {
                        while let Some((ticket, (job_seq, key, _))) = s.hand_off(lane) {
                            prop_assert!(!held[lane], "a job of held lane {} handed off", lane);
                            if let Some(k) = key
                                && let Some(prev) = last_started.insert((lane, k), job_seq)
                            {
                                prop_assert!(prev < job_seq, "key {} handed off out of order in lane {}", k, lane);
                            }
                            writer.push_back(ticket);
                        }
                    }
                    Step::Write => {
                        if let Some(ticket) = writer.pop_front() {
                            incomplete.remove(&ticket.seq);
                            s.complete(ticket);
                        }
                    }
                }
                for end in incomplete.values() {
                    prop_assert!(s.confirmed() < *end, "confirmed {} passed an incomplete job ending {}", s.confirmed(), end);
                }
                prop_assert_eq!(s.pending(), incomplete.len());
                for lane in 0..2 {
                    let alone = incomplete
                        .keys()
                        .filter(|q| job_of[q].0 == lane)
                        .filter(|q| {
                            let ev = job_of[q].1;
                            incomplete.keys().filter(|o| job_of[o].1 == ev).count() == 1
                        })
                        .count();
                    prop_assert_eq!(s.lane_exclusive(lane), alone, "what lane {} holds alone", lane);
                }
            }
            // Drain: everything completes, whatever the order so far.
            for lane in 0..2 {
                s.hold(lane, false);
            }
            while let Some(ticket) = writer.pop_front() {
                incomplete.remove(&ticket.seq);
                s.complete(ticket);
            }
            loop {
                start(&mut s, &mut running, &mut last_started, &[false, false])?;
                let Some((ticket, _)) = running.pop() else { break };
                incomplete.remove(&ticket.seq);
                s.complete(ticket);
            }
            prop_assert!(incomplete.is_empty(), "jobs never started: {:?}", incomplete);
            prop_assert!(s.is_idle());
            prop_assert_eq!(s.confirmed(), s.received());
        }
    }
}
