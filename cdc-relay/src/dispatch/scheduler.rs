//! The dispatcher's state machine: which job may start, and what may be
//! confirmed. No I/O, no clock of its own, no tasks: the caller feeds it the
//! stream and the completions and starts the jobs it hands out.
//!
//! Rules:
//! - Jobs are numbered in stream order and start in that order, except
//!   that a job whose aggregate key is *claimed* (an earlier job with the
//!   same key is ready or running) waits behind it: two jobs of one
//!   aggregate are never running together and keep commit order.
//! - At most `max_in_flight` jobs run at once.
//! - Every job belongs to the transaction open when it was added; the
//!   [`AckTracker`] confirms the end of the longest prefix of transactions
//!   whose jobs are all complete.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use tokio::time::Instant;

use crate::ack::{AckTracker, Position, TxSeq};

/// What a started job must hand back to [`Scheduler::complete`].
#[derive(Debug, PartialEq, Eq)]
pub struct Ticket {
    /// The job's place in stream order.
    pub seq: u64,
    tx: TxSeq,
    key: Option<String>,
}

struct Job<W> {
    ticket: Ticket,
    work: W,
}

/// The dispatcher's pure core. `W` is the work a job carries; `P` the
/// position type of the source (an LSN for the stream).
pub struct Scheduler<P: Position, W> {
    max_in_flight: usize,
    tracker: AckTracker<P>,
    /// The transaction items are added to (between begin and commit).
    open: Option<TxSeq>,
    next_seq: u64,
    /// Jobs free to start, by stream order.
    ready: BTreeMap<u64, Job<W>>,
    /// Jobs whose key is claimed by an earlier job, per key, in order.
    waiting: HashMap<String, VecDeque<Job<W>>>,
    /// Keys with a job ready or running.
    claimed: HashSet<String>,
    /// When each job not yet complete was added, by stream order.
    added_at: BTreeMap<u64, Instant>,
    running: usize,
}

impl<P: Position, W> Scheduler<P, W> {
    /// An empty scheduler that confirms from `start` and runs at most
    /// `max_in_flight` jobs at once (at least 1).
    pub fn new(start: P, max_in_flight: usize) -> Self {
        Scheduler {
            max_in_flight: max_in_flight.max(1),
            tracker: AckTracker::new(start),
            open: None,
            next_seq: 0,
            ready: BTreeMap::new(),
            waiting: HashMap::new(),
            claimed: HashSet::new(),
            added_at: BTreeMap::new(),
            running: 0,
        }
    }

    /// A transaction begins.
    pub fn begin(&mut self) {
        debug_assert!(self.open.is_none(), "begin inside a transaction");
        self.open = Some(self.tracker.begin());
    }

    /// A job of the open transaction, with its aggregate key (`None`: no
    /// ordering constraint), added at `now`.
    ///
    /// # Panics
    /// Outside a transaction (the source always sends Begin first).
    pub fn add(&mut self, key: Option<String>, work: W, now: Instant) {
        let tx = self.open.expect("source sends Begin before events");
        self.tracker.add_event(tx);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.added_at.insert(seq, now);
        let job = Job {
            ticket: Ticket {
                seq,
                tx,
                key: key.clone(),
            },
            work,
        };
        match key {
            Some(key) if self.claimed.contains(&key) => {
                self.waiting.entry(key).or_default().push_back(job);
            }
            Some(key) => {
                self.claimed.insert(key);
                self.ready.insert(seq, job);
            }
            None => {
                self.ready.insert(seq, job);
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

    /// The next job to start, if one is ready and fewer than
    /// `max_in_flight` run; it counts as running until completed.
    pub fn next_job(&mut self) -> Option<(Ticket, W)> {
        if self.running >= self.max_in_flight {
            return None;
        }
        let (_, job) = self.ready.pop_first()?;
        self.running += 1;
        Some((job.ticket, job.work))
    }

    /// A started job is done (delivered or dead-lettered): release its key
    /// to the next job of the aggregate and let the watermark advance.
    pub fn complete(&mut self, ticket: Ticket) {
        debug_assert!(self.running > 0, "complete without a running job");
        self.running -= 1;
        self.tracker.complete(ticket.tx);
        self.added_at.remove(&ticket.seq);
        let Some(key) = ticket.key else { return };
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

    /// The position safe to confirm.
    pub fn confirmed(&self) -> P {
        self.tracker.confirmed()
    }

    /// The end of the last committed transaction received.
    pub fn received(&self) -> P {
        self.tracker.received()
    }

    /// Jobs added and not yet complete (waiting, ready or running).
    pub fn pending(&self) -> usize {
        self.tracker.outstanding_events()
    }

    /// Jobs running now.
    pub fn running(&self) -> usize {
        self.running
    }

    /// When the oldest job not yet complete was added.
    pub fn oldest_pending_since(&self) -> Option<Instant> {
        self.added_at.values().next().copied()
    }

    /// No job is ready or running (waiting jobs always sit behind one).
    pub fn is_idle(&self) -> bool {
        self.running == 0 && self.ready.is_empty()
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

    #[derive(Debug, Clone)]
    enum Step {
        /// A transaction whose events have these keys (`None`: no key).
        Tx(Vec<Option<u8>>),
        /// Complete the running job at this index (mod the running count).
        Complete(usize),
        /// Start whatever may start.
        Start,
        Keepalive,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            2 => proptest::collection::vec(proptest::option::of(0u8..4), 0..4).prop_map(Step::Tx),
            3 => any::<usize>().prop_map(Step::Complete),
            3 => Just(Step::Start),
            1 => Just(Step::Keepalive),
        ]
    }

    proptest! {
        /// Random streams and completion orders: no two running jobs share
        /// a key, never more than max_in_flight run, jobs of one key start
        /// in stream order, the confirmed position never passes a
        /// transaction with an incomplete job, and everything drains.
        #[test]
        fn keys_window_and_watermark_hold(
            max in 1usize..5,
            steps in proptest::collection::vec(step(), 1..150),
        ) {
            let now = Instant::now();
            let mut s: Scheduler<Lsn, (u64, Option<u8>, Lsn)> = Scheduler::new(lsn(100), max);
            let mut wal = 100u64;
            let mut running: Vec<(Ticket, Option<u8>)> = Vec::new();
            // end position of each incomplete job, by seq
            let mut incomplete: BTreeMap<u64, Lsn> = BTreeMap::new();
            let mut last_started: HashMap<u8, u64> = HashMap::new();
            let mut seq = 0u64;
            let mut start = |s: &mut Scheduler<Lsn, (u64, Option<u8>, Lsn)>,
                             running: &mut Vec<(Ticket, Option<u8>)>|
             -> Result<(), TestCaseError> {
                while let Some((ticket, (job_seq, key, _))) = s.next_job() {
                    prop_assert_eq!(ticket.seq, job_seq);
                    if let Some(k) = key {
                        prop_assert!(
                            running.iter().all(|(_, rk)| *rk != Some(k)),
                            "two jobs of key {} running", k
                        );
                        if let Some(prev) = last_started.insert(k, job_seq) {
                            prop_assert!(prev < job_seq, "key {} out of order", k);
                        }
                    }
                    running.push((ticket, key));
                    prop_assert!(running.len() <= max, "more than max_in_flight");
                    prop_assert_eq!(s.running(), running.len());
                }
                Ok(())
            };
            for step in steps {
                match step {
                    Step::Tx(keys) => {
                        s.begin();
                        wal += 10;
                        for key in &keys {
                            s.add(key.map(|k| k.to_string()), (seq, *key, lsn(wal)), now);
                            incomplete.insert(seq, lsn(wal));
                            seq += 1;
                        }
                        s.commit(lsn(wal));
                    }
                    Step::Complete(i) if !running.is_empty() => {
                        let (ticket, _) = running.swap_remove(i % running.len());
                        incomplete.remove(&ticket.seq);
                        s.complete(ticket);
                    }
                    Step::Complete(_) => {}
                    Step::Start => start(&mut s, &mut running)?,
                    Step::Keepalive => {
                        wal += 5;
                        s.keepalive(lsn(wal));
                    }
                }
                for end in incomplete.values() {
                    prop_assert!(s.confirmed() < *end, "confirmed {} passed an incomplete job ending {}", s.confirmed(), end);
                }
                prop_assert_eq!(s.pending(), incomplete.len());
            }
            // Drain: everything completes, whatever the order so far.
            loop {
                start(&mut s, &mut running)?;
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
