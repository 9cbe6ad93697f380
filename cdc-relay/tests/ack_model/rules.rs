//! The rules under test: the real [`AckTracker`], driven as the
//! dispatcher drives it, and deliberately broken rules that the checks
//! must catch (a check that cannot fail proves nothing).

use cdc_relay::ack::{AckTracker, TxSeq};
use cdc_relay::lsn::Lsn;
use std::fmt::Debug;
use std::hash::Hash;

/// The interface `dispatch.rs` uses; implemented by the real tracker and by
/// the broken rules below.
pub(crate) trait Rule: Clone + Debug + Eq + Hash + Send + Sync + 'static {
    type Seq: Copy + Debug + Eq + Hash + Ord + Send + Sync + 'static;
    const NAME: &'static str;
    /// A parked job completes only once its dead-letter row is committed
    /// (`false`: completes first, the row is written in a later step).
    const ROW_FIRST: bool = true;
    fn new(start: Lsn) -> Self;
    fn begin(&mut self) -> Self::Seq;
    fn add_event(&mut self, tx: Self::Seq);
    fn commit(&mut self, tx: Self::Seq, end_lsn: Lsn);
    fn complete(&mut self, tx: Self::Seq);
    fn keepalive(&mut self, wal_end: Lsn);
    fn confirmed(&self) -> Lsn;
    /// Event `event` of `tx` goes to `endpoints` endpoints: one tracker
    /// event each, as `dispatch::handle` adds one job per endpoint.
    fn add_routed(&mut self, tx: Self::Seq, _event: u8, endpoints: u8) {
        for _ in 0..endpoints {
            self.add_event(tx);
        }
    }
    /// One endpoint answered `event` of `tx` with a 2xx.
    fn complete_at(&mut self, tx: Self::Seq, _event: u8) {
        self.complete(tx);
    }
    /// A batch of the events in mask `batch` was answered, and the sink
    /// recorded those in `recorded`: the events whose jobs the relay
    /// completes. The dispatcher's rule: exactly the recorded ones (a 2xx
    /// records the whole batch; after a refusal only the halves that got a
    /// 2xx of their own are done).
    fn batch_done(_batch: u8, recorded: u8) -> u8 {
        recorded
    }
    /// `event` of `tx` was parked at one endpoint (its dead-letter row
    /// committed): the job is done there, as after a 2xx.
    fn park_at(&mut self, tx: Self::Seq, event: u8) {
        self.complete_at(tx, event);
    }
}

/// The code under test, unchanged.
impl Rule for AckTracker {
    type Seq = TxSeq;
    const NAME: &'static str = "cdc_relay::ack::AckTracker";
    fn new(start: Lsn) -> Self {
        AckTracker::new(start)
    }
    fn begin(&mut self) -> TxSeq {
        AckTracker::begin(self)
    }
    fn add_event(&mut self, tx: TxSeq) {
        AckTracker::add_event(self, tx)
    }
    fn commit(&mut self, tx: TxSeq, end_lsn: Lsn) {
        AckTracker::commit(self, tx, end_lsn)
    }
    fn complete(&mut self, tx: TxSeq) {
        AckTracker::complete(self, tx)
    }
    fn keepalive(&mut self, wal_end: Lsn) {
        AckTracker::keepalive(self, wal_end)
    }
    fn confirmed(&self) -> Lsn {
        AckTracker::confirmed(self)
    }
}

/// A broken rule wrapping the real tracker (`self.0`): every method but
/// `keepalive` (and whatever the rule overrides) is the tracker's own.
macro_rules! real_tracker_but_keepalive {
    () => {
        fn new(start: Lsn) -> Self {
            Self(AckTracker::new(start))
        }
        fn begin(&mut self) -> TxSeq {
            self.0.begin()
        }
        fn add_event(&mut self, tx: TxSeq) {
            self.0.add_event(tx)
        }
        fn commit(&mut self, tx: TxSeq, end_lsn: Lsn) {
            self.0.commit(tx, end_lsn)
        }
        fn complete(&mut self, tx: TxSeq) {
            self.0.complete(tx)
        }
        fn confirmed(&self) -> Lsn {
            self.0.confirmed()
        }
    };
}

/// Broken rule 1: confirms the end LSN of the highest *done* transaction,
/// ignoring undone ones before it (no prefix).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct HighestDone {
    /// (end LSN once committed, events not yet done) per transaction.
    txs: Vec<(Option<Lsn>, u8)>,
    confirmed: Lsn,
}

impl HighestDone {
    fn advance(&mut self) {
        for (end, outstanding) in &self.txs {
            if let (Some(end), 0) = (end, outstanding) {
                self.confirmed = self.confirmed.max(*end);
            }
        }
    }
}

impl Rule for HighestDone {
    type Seq = usize;
    const NAME: &'static str = "broken: highest completed commit";
    fn new(start: Lsn) -> Self {
        HighestDone {
            txs: Vec::new(),
            confirmed: start,
        }
    }
    fn begin(&mut self) -> usize {
        self.txs.push((None, 0));
        self.txs.len() - 1
    }
    fn add_event(&mut self, tx: usize) {
        self.txs[tx].1 += 1;
    }
    fn commit(&mut self, tx: usize, end_lsn: Lsn) {
        self.txs[tx].0 = Some(end_lsn);
        self.advance();
    }
    fn complete(&mut self, tx: usize) {
        self.txs[tx].1 -= 1;
        self.advance();
    }
    fn keepalive(&mut self, wal_end: Lsn) {
        if self.txs.iter().all(|(end, n)| end.is_some() && *n == 0) {
            self.confirmed = self.confirmed.max(wal_end);
        }
    }
    fn confirmed(&self) -> Lsn {
        self.confirmed
    }
}

/// Broken rule 2: the real tracker, except that a keepalive between
/// transactions is confirmed even while a delivery is still pending.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct EagerKeepalive {
    inner: AckTracker,
    keepalive: Lsn,
}

impl Rule for EagerKeepalive {
    type Seq = TxSeq;
    const NAME: &'static str = "broken: keepalive acked while a delivery is pending";
    fn new(start: Lsn) -> Self {
        EagerKeepalive {
            inner: AckTracker::new(start),
            keepalive: start,
        }
    }
    fn begin(&mut self) -> TxSeq {
        self.inner.begin()
    }
    fn add_event(&mut self, tx: TxSeq) {
        self.inner.add_event(tx)
    }
    fn commit(&mut self, tx: TxSeq, end_lsn: Lsn) {
        self.inner.commit(tx, end_lsn)
    }
    fn complete(&mut self, tx: TxSeq) {
        self.inner.complete(tx)
    }
    fn keepalive(&mut self, wal_end: Lsn) {
        if !self.inner.in_transaction() {
            self.keepalive = self.keepalive.max(wal_end);
        }
        self.inner.keepalive(wal_end)
    }
    fn confirmed(&self) -> Lsn {
        self.inner.confirmed().max(self.keepalive)
    }
}

/// Broken rule 3 (for the recovery check): the real tracker, but keepalives
/// are never confirmed, so WAL after the last outbox commit stays pinned.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct NoKeepalive(AckTracker);

impl Rule for NoKeepalive {
    type Seq = TxSeq;
    const NAME: &'static str = "broken: keepalives never confirmed";
    real_tracker_but_keepalive!();
    fn keepalive(&mut self, _: Lsn) {}
}

/// Broken rule 4 (two endpoints): an event counts once, done at the first
/// endpoint's 2xx, however many endpoints it is routed to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct FirstEndpointDone {
    inner: AckTracker,
    /// Events already done (a bitmask of event ids).
    done: u8,
}

impl Rule for FirstEndpointDone {
    type Seq = TxSeq;
    const NAME: &'static str = "broken: an event is done at its first endpoint's 2xx";
    fn new(start: Lsn) -> Self {
        FirstEndpointDone {
            inner: AckTracker::new(start),
            done: 0,
        }
    }
    fn begin(&mut self) -> TxSeq {
        self.inner.begin()
    }
    fn add_event(&mut self, tx: TxSeq) {
        self.inner.add_event(tx)
    }
    fn commit(&mut self, tx: TxSeq, end_lsn: Lsn) {
        self.inner.commit(tx, end_lsn)
    }
    fn complete(&mut self, tx: TxSeq) {
        self.inner.complete(tx)
    }
    fn keepalive(&mut self, wal_end: Lsn) {
        self.inner.keepalive(wal_end)
    }
    fn confirmed(&self) -> Lsn {
        self.inner.confirmed()
    }
    fn add_routed(&mut self, tx: TxSeq, _event: u8, _endpoints: u8) {
        self.inner.add_event(tx);
    }
    fn complete_at(&mut self, tx: TxSeq, event: u8) {
        if self.done & (1 << event) == 0 {
            self.done |= 1 << event;
            self.inner.complete(tx);
        }
    }
}

/// Broken rule 5 (parking): a parked event stays pending, as if parking
/// only stopped the sends. The slot then waits for the endpoint forever.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ParkedStaysPending(AckTracker);

impl Rule for ParkedStaysPending {
    type Seq = TxSeq;
    const NAME: &'static str = "broken: a parked event stays pending";
    real_tracker_but_keepalive!();
    fn keepalive(&mut self, wal_end: Lsn) {
        self.0.keepalive(wal_end)
    }
    fn park_at(&mut self, _tx: TxSeq, _event: u8) {}
}

/// Broken rule 6 (parking): a parked job completes when the endpoint is
/// parked, and its dead-letter row is written afterwards (as if
/// `Delivery::park_event` reported done before the insert returned): a
/// crash in between loses the event at that endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ParkedBeforeRow(AckTracker);

impl Rule for ParkedBeforeRow {
    type Seq = TxSeq;
    const NAME: &'static str = "broken: a parked job completes before its row is written";
    const ROW_FIRST: bool = false;
    real_tracker_but_keepalive!();
    fn keepalive(&mut self, wal_end: Lsn) {
        self.0.keepalive(wal_end)
    }
}

/// Broken rule 7 (batches): a batch's events are all done once any of them
/// is recorded, as if a split batch reported the first half's 2xx for the
/// whole batch. An event the sink refused is then never sent again.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BatchDoneWithFirst(AckTracker);

impl Rule for BatchDoneWithFirst {
    type Seq = TxSeq;
    const NAME: &'static str = "broken: a batch is done when its first part is";
    real_tracker_but_keepalive!();
    fn keepalive(&mut self, wal_end: Lsn) {
        self.0.keepalive(wal_end)
    }
    fn batch_done(batch: u8, _recorded: u8) -> u8 {
        batch
    }
}
