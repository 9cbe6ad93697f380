//! The acknowledgement watermark: which LSN may be confirmed to the server.
//!
//! PostgreSQL resumes a logical slot at its `confirmed_flush_lsn`, and decodes
//! again every transaction whose commit ends after it (PostgreSQL docs,
//! "Logical Decoding Concepts" → "Replication Slots"). Confirming an LSN is
//! therefore a promise: *every transaction that ends at or before it is done*.
//! A transaction is done when each of its outbox events got a 2xx or was
//! dead-lettered; a transaction without outbox events is done at its commit.
//!
//! Transactions arrive in commit order, so the safe position is the end LSN of
//! the longest prefix of done transactions. Deliveries complete in any order
//! (pipelining); an early completion behind an undelivered one moves nothing.
//!
//! When nothing is pending — no open transaction, no undone one — the relay
//! may confirm the position a keepalive reports: the server has nothing left
//! to send before it, so an idle outbox in a busy database does not pin WAL.

use std::collections::VecDeque;
use std::fmt;

use crate::lsn::Lsn;

/// A position in the source's order of transactions: what the tracker
/// confirms. The stream uses [`Lsn`]; a backfill, which re-reads rows from
/// the table, counts rows ([`crate::backfill::BackfillRow`]).
pub trait Position:
    Copy + Ord + Default + fmt::Debug + fmt::Display + Send + Sync + 'static
{
    /// The position as a Prometheus gauge value.
    fn gauge(self) -> i64;
}

impl Position for Lsn {
    fn gauge(self) -> i64 {
        Lsn::gauge(self)
    }
}

/// Identifies one transaction inside the tracker; handed out by
/// [`AckTracker::begin`] and strictly increasing in stream order.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TxSeq(u64);

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Tx<P> {
    seq: TxSeq,
    /// Set when the Commit message arrives; `None` while the transaction is
    /// still streaming.
    end_lsn: Option<P>,
    /// Events of this transaction not yet done.
    outstanding: usize,
}

impl<P> Tx<P> {
    fn is_done(&self) -> bool {
        self.end_lsn.is_some() && self.outstanding == 0
    }
}

/// Tracks transactions from Begin to done and derives the LSN that is safe to
/// confirm.
///
/// **Invariant:** [`confirmed`](Self::confirmed) is never ahead of the end LSN
/// of a transaction that still has an undone event, and never ahead of what
/// was received ([`received`](Self::received)). It never moves backwards.
///
/// Calls must follow the stream: `begin`, any number of `add_event`, `commit`,
/// then the next `begin`. `complete` may be called in any order, once per
/// event added. Misuse is a programming error and panics in debug builds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct AckTracker<P: Position = Lsn> {
    /// Transactions not yet popped as a done prefix, oldest first.
    pending: VecDeque<Tx<P>>,
    next_seq: u64,
    confirmed: P,
    received: P,
    /// Events added and not yet completed, across all pending transactions.
    outstanding_events: usize,
}

impl<P: Position> AckTracker<P> {
    /// A tracker that starts from `start` (the slot's `confirmed_flush_lsn`,
    /// or `0/0` when unknown).
    pub fn new(start: P) -> Self {
        AckTracker {
            pending: VecDeque::new(),
            next_seq: 0,
            confirmed: start,
            received: start,
            outstanding_events: 0,
        }
    }

    /// A Begin message arrived: open a transaction.
    pub fn begin(&mut self) -> TxSeq {
        debug_assert!(
            self.pending.back().is_none_or(|t| t.end_lsn.is_some()),
            "begin while a transaction is still open"
        );
        let seq = TxSeq(self.next_seq);
        self.next_seq += 1;
        self.pending.push_back(Tx {
            seq,
            end_lsn: None,
            outstanding: 0,
        });
        seq
    }

    /// An outbox event of the open transaction `tx` was handed to dispatch.
    pub fn add_event(&mut self, tx: TxSeq) {
        let t = self
            .find_mut(tx)
            .expect("add_event for an unknown transaction");
        debug_assert!(t.end_lsn.is_none(), "add_event after commit");
        t.outstanding += 1;
        self.outstanding_events += 1;
    }

    /// The Commit message of `tx` arrived; `end_lsn` is its end LSN (the
    /// position after the commit record, what a restart must pass).
    pub fn commit(&mut self, tx: TxSeq, end_lsn: P) {
        let t = self
            .find_mut(tx)
            .expect("commit for an unknown transaction");
        debug_assert!(t.end_lsn.is_none(), "commit twice");
        t.end_lsn = Some(end_lsn);
        self.received = self.received.max(end_lsn);
        self.advance();
    }

    /// One event of `tx` is done (delivered with a 2xx or dead-lettered).
    pub fn complete(&mut self, tx: TxSeq) {
        let t = self
            .find_mut(tx)
            .expect("complete for an unknown transaction");
        assert!(
            t.outstanding > 0,
            "complete called more often than add_event"
        );
        t.outstanding -= 1;
        self.outstanding_events -= 1;
        self.advance();
    }

    /// A keepalive reported `wal_end`: the server has sent everything before
    /// it. Confirms it only when nothing is pending.
    pub fn keepalive(&mut self, wal_end: P) {
        if self.pending.is_empty() {
            self.received = self.received.max(wal_end);
            self.confirmed = self.confirmed.max(wal_end);
        }
        self.check();
    }

    /// The LSN safe to send as flush/apply position in a standby status update.
    pub fn confirmed(&self) -> P {
        self.confirmed
    }

    /// The end LSN of the last committed transaction received (or the last
    /// keepalive position adopted).
    pub fn received(&self) -> P {
        self.received
    }

    /// Whether no transaction is open or undone.
    pub fn is_idle(&self) -> bool {
        self.pending.is_empty()
    }

    /// Events handed to dispatch and not yet done.
    pub fn outstanding_events(&self) -> usize {
        self.outstanding_events
    }

    /// Whether a transaction is open (Begin seen, Commit not yet).
    pub fn in_transaction(&self) -> bool {
        self.pending.back().is_some_and(|t| t.end_lsn.is_none())
    }

    fn find_mut(&mut self, tx: TxSeq) -> Option<&mut Tx<P>> {
        // Sequences are dense and ascending, so the position is an offset from
        // the front; a binary search keeps it right even if that changes.
        let i = self.pending.binary_search_by_key(&tx, |t| t.seq).ok()?;
        self.pending.get_mut(i)
    }

    fn advance(&mut self) {
        while let Some(front) = self.pending.front() {
            if !front.is_done() {
                break;
            }
            let end = front.end_lsn.expect("done implies committed");
            self.confirmed = self.confirmed.max(end);
            self.pending.pop_front();
        }
        self.check();
    }

    fn check(&self) {
        debug_assert!(self.received >= self.confirmed, "confirmed passed received");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn confirms_only_the_done_prefix() {
        let mut t = AckTracker::new(Lsn::new(100));
        let a = t.begin();
        t.add_event(a);
        t.commit(a, Lsn::new(200));
        let b = t.begin();
        t.add_event(b);
        t.add_event(b);
        t.commit(b, Lsn::new(300));
        let c = t.begin();
        t.commit(c, Lsn::new(400)); // no outbox events: done at commit

        t.complete(b);
        t.complete(b);
        assert_eq!(t.confirmed(), Lsn::new(100), "a is not delivered yet");
        t.complete(a);
        assert_eq!(t.confirmed(), Lsn::new(400), "a, b and c are done");
        assert!(t.is_idle());
    }

    #[test]
    fn keepalive_moves_only_when_idle() {
        let mut t = AckTracker::new(Lsn::new(10));
        t.keepalive(Lsn::new(50));
        assert_eq!(t.confirmed(), Lsn::new(50));

        let a = t.begin();
        t.keepalive(Lsn::new(90)); // mid-transaction
        assert_eq!(t.confirmed(), Lsn::new(50));
        t.add_event(a);
        t.commit(a, Lsn::new(80));
        t.keepalive(Lsn::new(95)); // a undelivered
        assert_eq!(t.confirmed(), Lsn::new(50));
        t.complete(a);
        assert_eq!(t.confirmed(), Lsn::new(80));
        t.keepalive(Lsn::new(95));
        assert_eq!(t.confirmed(), Lsn::new(95));
        t.keepalive(Lsn::new(60)); // never backwards
        assert_eq!(t.confirmed(), Lsn::new(95));
    }

    #[derive(Debug, Clone)]
    enum Step {
        /// A transaction with this many events, `gap` bytes of WAL after the last.
        Tx { events: usize, gap: u64 },
        /// Complete the pending event at this index (mod the pending count).
        Complete(usize),
        /// A keepalive `ahead` bytes past the last record the server read.
        Keepalive(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            1 => (0usize..4, 1u64..100).prop_map(|(events, gap)| Step::Tx { events, gap }),
            3 => any::<usize>().prop_map(Step::Complete),
            1 => (0u64..100).prop_map(Step::Keepalive),
        ]
    }

    proptest! {
        /// Random stream and random completion order: the confirmed LSN never
        /// passes the end of a transaction with an undelivered event, never
        /// moves back, and reaches the last end LSN once all is delivered.
        #[test]
        fn never_ahead_of_a_gap(steps in proptest::collection::vec(step(), 1..200)) {
            let mut t = AckTracker::new(Lsn::new(1_000));
            let mut wal = 1_000u64;
            // (tx, end_lsn) of each undelivered event
            let mut undelivered: Vec<(TxSeq, Lsn)> = Vec::new();
            let mut last = t.confirmed();
            let mut last_end = Lsn::new(1_000);
            for s in steps {
                match s {
                    Step::Tx { events, gap } => {
                        let tx = t.begin();
                        for _ in 0..events { t.add_event(tx); }
                        wal += gap;
                        t.commit(tx, Lsn::new(wal));
                        last_end = Lsn::new(wal);
                        undelivered.extend(std::iter::repeat_n((tx, Lsn::new(wal)), events));
                    }
                    Step::Complete(i) if !undelivered.is_empty() => {
                        let (tx, _) = undelivered.swap_remove(i % undelivered.len());
                        t.complete(tx);
                    }
                    Step::Complete(_) => {}
                    Step::Keepalive(ahead) => {
                        // The server reports what it has read; later commits end after it.
                        wal += ahead;
                        t.keepalive(Lsn::new(wal));
                    }
                }
                let c = t.confirmed();
                prop_assert!(c >= last, "moved backwards");
                last = c;
                for (_, end) in &undelivered {
                    prop_assert!(c < *end, "confirmed {c} passed undelivered commit ending {end}");
                }
            }
            while let Some((tx, _)) = undelivered.pop() { t.complete(tx); }
            prop_assert!(t.confirmed() >= last_end);
            prop_assert!(t.is_idle());
        }
    }
}
