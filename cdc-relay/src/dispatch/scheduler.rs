//! The dispatcher's state machine: which job may start, and what may be
//! confirmed. No I/O, no clock of its own, no tasks: the caller feeds it the
//! stream and the completions and starts the jobs it hands out.
//!
//! Rules:
//! - Jobs are numbered in stream order. Each job belongs to a *lane* (an
//!   endpoint; one lane without `--routes`), and an event routed to several
//!   endpoints is one job per lane.
//! - Jobs start in stream order, except that a job whose aggregate key is
//!   *claimed* in its lane (an earlier job of the same lane and key is
//!   ready or running) waits behind it: two jobs of one aggregate are never
//!   running together at one endpoint and keep commit order there. Lanes
//!   do not wait for each other.
//! - At most the lane's `max_in_flight` jobs of a lane run at once, and
//!   none starts while the lane is *held* (the handover of a parked
//!   endpoint back to live waits for its lane to be quiet).
//! - Every job belongs to the transaction open when it was added; the
//!   [`AckTracker`] confirms the end of the longest prefix of transactions
//!   whose jobs — at every lane — are all complete.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use tokio::time::Instant;

use crate::ack::{AckTracker, Position, TxSeq};

/// What a started job must hand back to [`Scheduler::complete`].
#[derive(Debug, PartialEq, Eq)]
pub struct Ticket {
    /// The job's place in stream order.
    pub seq: u64,
    /// The job's lane (endpoint index).
    pub lane: usize,
    tx: TxSeq,
    key: Option<String>,
}

struct Job<W> {
    ticket: Ticket,
    work: W,
}

/// One lane's queues.
struct Lane<W> {
    max_in_flight: usize,
    /// Jobs free to start, by stream order.
    ready: BTreeMap<u64, Job<W>>,
    /// Jobs whose key is claimed by an earlier job, per key, in order.
    waiting: HashMap<String, VecDeque<Job<W>>>,
    /// Keys with a job ready or running.
    claimed: HashSet<String>,
    /// When each job not yet complete was added, by stream order.
    added_at: BTreeMap<u64, Instant>,
    running: usize,
    /// No job starts while set ([`Scheduler::hold`]).
    held: bool,
}

impl<W> Lane<W> {
    fn new(max_in_flight: usize) -> Self {
        Lane {
            max_in_flight: max_in_flight.max(1),
            ready: BTreeMap::new(),
            waiting: HashMap::new(),
            claimed: HashSet::new(),
            added_at: BTreeMap::new(),
            running: 0,
            held: false,
        }
    }

    /// The stream position of the first job that may start now.
    fn startable(&self) -> Option<u64> {
        if self.held || self.running >= self.max_in_flight {
            return None;
        }
        self.ready.keys().next().copied()
    }
}

/// The dispatcher's pure core. `W` is the work a job carries; `P` the
/// position type of the source (an LSN for the stream).
pub struct Scheduler<P: Position, W> {
    tracker: AckTracker<P>,
    /// The transaction items are added to (between begin and commit).
    open: Option<TxSeq>,
    next_seq: u64,
    lanes: Vec<Lane<W>>,
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
        let mut lanes: Vec<Lane<W>> = max_in_flight.iter().map(|m| Lane::new(*m)).collect();
        if lanes.is_empty() {
            lanes.push(Lane::new(1));
        }
        Scheduler {
            tracker: AckTracker::new(start),
            open: None,
            next_seq: 0,
            lanes,
        }
    }

    /// A transaction begins.
    pub fn begin(&mut self) {
        debug_assert!(self.open.is_none(), "begin inside a transaction");
        self.open = Some(self.tracker.begin());
    }

    /// A job of the open transaction on lane 0; see [`Self::add_to`].
    pub fn add(&mut self, key: Option<String>, work: W, now: Instant) {
        self.add_to(0, key, work, now);
    }

    /// A job of the open transaction on `lane`, with its aggregate key
    /// (`None`: no ordering constraint), added at `now`.
    ///
    /// # Panics
    /// Outside a transaction (the source always sends Begin first), or on a
    /// lane the scheduler does not have.
    pub fn add_to(&mut self, lane: usize, key: Option<String>, work: W, now: Instant) {
        let tx = self.open.expect("source sends Begin before events");
        self.tracker.add_event(tx);
        let seq = self.next_seq;
        self.next_seq += 1;
        let l = &mut self.lanes[lane];
        l.added_at.insert(seq, now);
        let job = Job {
            ticket: Ticket {
                seq,
                lane,
                tx,
                key: key.clone(),
            },
            work,
        };
        match key {
            Some(key) if l.claimed.contains(&key) => {
                l.waiting.entry(key).or_default().push_back(job);
            }
            Some(key) => {
                l.claimed.insert(key);
                l.ready.insert(seq, job);
            }
            None => {
                l.ready.insert(seq, job);
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
    /// counts as running until completed.
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

    /// A started job is done (delivered or dead-lettered): release its key
    /// to the next job of the aggregate in its lane and let the watermark
    /// advance.
    pub fn complete(&mut self, ticket: Ticket) {
        let l = &mut self.lanes[ticket.lane];
        debug_assert!(l.running > 0, "complete without a running job");
        l.running -= 1;
        self.tracker.complete(ticket.tx);
        l.added_at.remove(&ticket.seq);
        let Some(key) = ticket.key else { return };
        let next = l.waiting.get_mut(&key).and_then(VecDeque::pop_front);
        match next {
            Some(next) => {
                if l.waiting.get(&key).is_some_and(VecDeque::is_empty) {
                    l.waiting.remove(&key);
                }
                l.ready.insert(next.ticket.seq, next);
            }
            None => {
                l.claimed.remove(&key);
            }
        }
    }

    /// The position safe to confirm.
    pub fn confirmed(&self) -> P {
        self.tracker.confirmed()
    }

    /// The end of the last committed transaction received.
    pub fn received(&self) -> P {
        self.tracker.received()
    }

    /// Jobs added and not yet complete (waiting, ready or running), over
    /// all lanes.
    pub fn pending(&self) -> usize {
        self.tracker.outstanding_events()
    }

    /// Jobs of `lane` added and not yet complete.
    pub fn lane_pending(&self, lane: usize) -> usize {
        self.lanes[lane].added_at.len()
    }

    /// Jobs of `lane` running now.
    pub fn lane_running(&self, lane: usize) -> usize {
        self.lanes[lane].running
    }

    /// Holds `lane` (no job of it starts; jobs running finish) or lets it
    /// go again. Jobs keep being added to a held lane.
    pub fn hold(&mut self, lane: usize, held: bool) {
        self.lanes[lane].held = held;
    }

    /// The work of `lane`'s jobs not yet started (ready or waiting behind
    /// their aggregate), in no particular order.
    pub fn lane_queued(&self, lane: usize) -> impl Iterator<Item = &W> {
        let l = &self.lanes[lane];
        l.ready
            .values()
            .chain(l.waiting.values().flatten())
            .map(|j| &j.work)
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
        self.lanes[lane].added_at.values().next().copied()
    }

    /// No job is ready or running (waiting jobs always sit behind one).
    pub fn is_idle(&self) -> bool {
        self.lanes
            .iter()
            .all(|l| l.running == 0 && l.ready.is_empty())
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
        assert_eq!(s.lane_running(0), 1, "its running job finishes");
        s.complete(t0);
        s.complete(t1);
        assert_eq!(s.lane_running(0), 0);
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
        let queued: Vec<&str> = s.lane_queued(0).copied().collect();
        assert_eq!(queued, ["a2@0"], "waiting behind a1, not running");
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
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            2 => proptest::collection::vec((proptest::option::of(0u8..4), 0u8..4), 0..4).prop_map(Step::Tx),
            3 => any::<usize>().prop_map(Step::Complete),
            3 => Just(Step::Start),
            1 => Just(Step::Keepalive),
            1 => (0usize..2, any::<bool>()).prop_map(|(l, h)| Step::Hold(l, h)),
        ]
    }

    proptest! {
        /// Random streams over two lanes (events to one, both or neither)
        /// and completion orders, lanes held and let go: no two running
        /// jobs of a lane share a key, never more than a lane's
        /// max_in_flight run in it, no job of a held lane starts, jobs of
        /// one key start in stream order in each lane, the confirmed
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
            let mut start = |s: &mut Scheduler<Lsn, (u64, Option<u8>, Lsn)>,
                             running: &mut Vec<(Ticket, Option<u8>)>,
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
                            for lane in (0..2).filter(|l| mask & (1 << l) != 0) {
                                s.add_to(lane, key.map(|k| k.to_string()), (seq, *key, lsn(wal)), now);
                                incomplete.insert(seq, lsn(wal));
                                seq += 1;
                            }
                        }
                        s.commit(lsn(wal));
                    }
                    Step::Complete(i) if !running.is_empty() => {
                        let (ticket, _) = running.swap_remove(i % running.len());
                        incomplete.remove(&ticket.seq);
                        s.complete(ticket);
                    }
                    Step::Complete(_) => {}
                    Step::Start => start(&mut s, &mut running, &held)?,
                    Step::Keepalive => {
                        wal += 5;
                        s.keepalive(lsn(wal));
                    }
                    Step::Hold(lane, h) => {
                        held[lane] = h;
                        s.hold(lane, h);
                    }
                }
                for end in incomplete.values() {
                    prop_assert!(s.confirmed() < *end, "confirmed {} passed an incomplete job ending {}", s.confirmed(), end);
                }
                prop_assert_eq!(s.pending(), incomplete.len());
            }
            // Drain: everything completes, whatever the order so far.
            for lane in 0..2 {
                s.hold(lane, false);
            }
            loop {
                start(&mut s, &mut running, &[false, false])?;
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
