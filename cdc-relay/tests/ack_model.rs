//! Model check of the acknowledgement rule
//! (`docs/architecture.md#acknowledgement`), with the `stateright` crate.
//!
//! The model is a PostgreSQL server with a fixed WAL, a logical slot, one
//! relay and an HTTP sink. The relay's acknowledgement state is the **real**
//! [`cdc_relay::ack::AckTracker`], driven exactly as `dispatch.rs` drives it
//! (Begin → `begin`, outbox insert → `add_event`, Commit → `commit`, a 2xx →
//! `complete`, a keepalive → `keepalive` only while no transaction is open);
//! status updates copy its `confirmed()` to the slot. Everything else is
//! nondeterministic: when the walsender sends the next message, when a
//! keepalive arrives, which pending delivery gets its 2xx next, when the sink
//! fails or recovers, when a status update goes out, and when the relay
//! crashes (its state is lost; the next session restarts from the slot's
//! `confirmed_flush_lsn`, as `relay.rs` does).
//!
//! Checked on every reachable state:
//! - safety: the slot's `confirmed_flush_lsn` never reaches the end LSN of a
//!   transaction that has an event the sink never acknowledged with a 2xx;
//! - monotonicity: a status update never moves the slot backwards;
//! - recovery (liveness): with no more crashes and the sink up, a state where
//!   every event was delivered and the slot confirmed the whole WAL is
//!   reachable (AG EF, computed over the explicit state graph below, since
//!   stateright's `eventually` only sees acyclic paths).
//!
//! Deliberately broken rules run through the same model and must be caught
//! with a counterexample (a check that cannot fail proves nothing): acking
//! the highest completed commit and acking a keepalive while a delivery is
//! pending break safety; never acking keepalives breaks recovery.
//!
//! **Two endpoints** (`run --routes`): the same model with two sinks that
//! fail and recover independently; even-numbered events go to both (fan-out),
//! odd ones to the second only. The dispatcher adds one tracker event per
//! (event, endpoint) and completes each on that endpoint's 2xx, so safety
//! reads: the slot never passes a transaction with an event some endpoint
//! it is routed to never acknowledged. The broken rule "an event is done at
//! its first endpoint's 2xx" must be caught.
//!
//! **Parking** (`docs/architecture.md#parking`): the two-endpoint model
//! where any pending delivery may instead be *parked* — its dead-letter row
//! committed (durable: it survives crashes), then its tracker event
//! completed, as `Delivery::park_event` does — and a parked event may later
//! be *replayed* to its endpoint while that endpoint is up. Safety counts
//! a parked row as done there; recovery asks for every parked row
//! replayed too. A further liveness property is parking's purpose: from
//! every reachable state where the second endpoint is down, with no crash
//! and that endpoint never back, the slot can still reach the end of the
//! WAL. Broken rules: "a parked event stays pending" must fail that
//! property, and "a parked job completes before its row is written" (a
//! crash in between loses the event) must fail safety.
//!
//! **Asynchronous parking** (`cdc_relay::durable`): a parked job
//! completes once its row is *queued* for the relay's dead-letter writer
//! (counted as promised first); the writer commits queued rows in queue
//! order with `synchronous_commit = off`, so a committed row is not durable
//! until the server flushes its WAL. The model adds the writer's commit
//! (the oldest queued row becomes committed), the server's WAL flush (the
//! oldest unflushed row becomes durable: WAL is flushed in order), the
//! flush poller (reports how many of this session's promised rows are
//! committed and flushed), a relay crash losing the queued rows, and a
//! *server* crash (every queued and unflushed row is lost; the relay's
//! session ends). Status updates carry the position the **real**
//! [`cdc_relay::durable::Held`] gate passed, offered the tracker's position
//! and the promised count after every step, as `dispatch::publish` does.
//! Safety counts only durable rows. Broken rules: "status updates carry the
//! tracker's position" (no gate) and "the gate counts committed rows, not
//! promised ones" must fail safety.
//!
//! Run: `cargo test -p cdc-relay --test ack_model -- --nocapture`.

use std::collections::{HashMap, VecDeque};
use std::fmt::{self, Debug};
use std::hash::Hash;
use std::marker::PhantomData;
use std::time::Instant;

use cdc_relay::ack::{AckTracker, TxSeq};
use cdc_relay::durable::Held;
use cdc_relay::lsn::Lsn;
use stateright::{Checker, Expectation, HasDiscoveries, Model, Path, Property};

// ---------------------------------------------------------------------------
// The rules under test.

/// The interface `dispatch.rs` uses; implemented by the real tracker and by
/// the broken rules below.
trait Rule: Clone + Debug + Eq + Hash + Send + Sync + 'static {
    type Seq: Copy + Debug + Eq + Hash + Ord + Send + Sync + 'static;
    const NAME: &'static str;
    /// A parked job completes only once its dead-letter row is committed
    /// (`false`: completes first, the row is written in a later step).
    const ROW_FIRST: bool = true;
    /// With asynchronous parking, status updates carry the position the
    /// flush gate passed (`false`: the tracker's own, ignoring flushes).
    const GATED: bool = true;
    /// With asynchronous parking, the gate needs every row promised
    /// (queued or committed) before the position was computed (`false`:
    /// only the rows the writer had committed).
    const COUNTS_PROMISED: bool = true;
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
struct HighestDone {
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
struct EagerKeepalive {
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
struct NoKeepalive(AckTracker);

impl Rule for NoKeepalive {
    type Seq = TxSeq;
    const NAME: &'static str = "broken: keepalives never confirmed";
    real_tracker_but_keepalive!();
    fn keepalive(&mut self, _: Lsn) {}
}

/// Broken rule 4 (two endpoints): an event counts once, done at the first
/// endpoint's 2xx, however many endpoints it is routed to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct FirstEndpointDone {
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
struct ParkedStaysPending(AckTracker);

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
struct ParkedBeforeRow(AckTracker);

impl Rule for ParkedBeforeRow {
    type Seq = TxSeq;
    const NAME: &'static str = "broken: a parked job completes before its row is written";
    const ROW_FIRST: bool = false;
    real_tracker_but_keepalive!();
    fn keepalive(&mut self, wal_end: Lsn) {
        self.0.keepalive(wal_end)
    }
}

/// Broken rule 7 (asynchronous parking): status updates carry the
/// tracker's position at once, as if the relay confirmed past a row whose
/// asynchronous commit the server has not flushed: a server crash then
/// loses the row after the slot passed its event.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Ungated(AckTracker);

impl Rule for Ungated {
    type Seq = TxSeq;
    const NAME: &'static str = "broken: confirms past a row before its commit is flushed";
    const GATED: bool = false;
    real_tracker_but_keepalive!();
    fn keepalive(&mut self, wal_end: Lsn) {
        self.0.keepalive(wal_end)
    }
}

/// Broken rule 8 (asynchronous parking): the gate needs only the rows the
/// writer had committed when the position was computed, not the rows
/// queued for it (as if `FlushGate::pass` read the committed count): a
/// relay crash then loses a queued row after the slot passed its event.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct CountsCommitted(AckTracker);

impl Rule for CountsCommitted {
    type Seq = TxSeq;
    const NAME: &'static str = "broken: the gate waits only for committed rows, not queued ones";
    const COUNTS_PROMISED: bool = false;
    real_tracker_but_keepalive!();
    fn keepalive(&mut self, wal_end: Lsn) {
        self.0.keepalive(wal_end)
    }
}

// ---------------------------------------------------------------------------
// The world: WAL, walsender, slot, relay, sinks.

/// One stretch of WAL, in commit order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Item {
    /// A committed transaction decoded and sent as Begin, this many outbox
    /// inserts, Commit (0: it touched only other published tables).
    Tx(u8),
    /// WAL the walsender reads without sending anything (unpublished tables,
    /// empty transactions skipped by pgoutput); only a keepalive reports it.
    Gap,
}

/// Where the slot was created.
const BASE: u64 = 100;
/// WAL bytes per item.
const STEP: u64 = 10;

/// End LSN of item `i` (for a transaction: the position after its commit
/// record, what `Commit.end_lsn` reports).
fn end_of(i: usize) -> Lsn {
    Lsn::new(BASE + STEP * (i as u64 + 1))
}

/// Start of item `i`'s commit record. The walsender's sent position while it
/// streams transaction `i`: it has read every record before the commit record
/// and is decoding that one. A restarted slot resends a transaction iff its
/// commit record starts at or after `confirmed_flush_lsn` (PostgreSQL skips
/// `commit origptr < start_decoding_at`), i.e. iff `end_of(i) > slot` here.
fn commit_start_of(i: usize) -> Lsn {
    Lsn::new(end_of(i).as_u64() - 1)
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State<R: Rule> {
    /// Which WAL of [`AckModel::wals`].
    wal: u8,
    /// The slot's `confirmed_flush_lsn`: survives crashes.
    slot: Lsn,
    crashes: u8,
    /// Per endpoint (the second unused with one endpoint).
    sink_up: [bool; 2],
    /// Per endpoint, events (global ids) it answered with a 2xx at least
    /// once, ever.
    delivered: [u8; 2],
    /// Per endpoint, events with a parked dead-letter row (durable; gone
    /// once replayed).
    parked: [u8; 2],
    /// Parked jobs completed whose row is not written yet (only with a rule
    /// that is not `ROW_FIRST`): lost on a crash.
    unwritten: Vec<(u8, u8)>,
    /// Asynchronous parking: parked rows committed and not yet flushed, in
    /// commit order: (event, endpoint, counted by the current session).
    /// Lost on a server crash; the oldest is flushed first.
    unflushed: Vec<(u8, u8, bool)>,
    /// A server crash lost an unflushed row (non-vacuity).
    lost_row: bool,
    /// A relay crash lost a queued row (non-vacuity).
    lost_queued: bool,
    // --- the current session: lost on a crash ---
    /// Next WAL item the walsender will decode.
    next: u8,
    /// Transaction being sent: (item, outbox inserts sent so far).
    streaming: Option<(u8, u8)>,
    /// The walsender's sent position (what a keepalive reports as wal_end).
    sent: Lsn,
    /// The dispatcher's open transaction (`Dispatcher::tx`).
    open: Option<R::Seq>,
    /// Deliveries handed to dispatch and not yet done: (event id,
    /// endpoint, transaction).
    pending: Vec<(u8, u8, R::Seq)>,
    /// The acknowledgement state under test.
    tracker: R,
    /// Asynchronous parking: parked rows queued for the writer and not yet
    /// committed, in queue order: (event, endpoint).
    queued: Vec<(u8, u8)>,
    /// Rows this session promised (`Flushes::promised`).
    promised: u8,
    /// How many of them (the first, in queue order) the poller reported
    /// committed and flushed.
    covered: u8,
    /// The real flush gate, offered the tracker's position after each step.
    gate: Held<Lsn>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Action {
    /// The walsender sends Begin of WAL item `.0`.
    Begin(u8),
    /// The walsender sends an outbox insert (global event id).
    Insert(u8),
    /// The walsender sends Commit of WAL item `.0`.
    Commit(u8),
    /// The walsender reads WAL item `.0` (a gap) and sends nothing.
    Skip(u8),
    /// A keepalive reporting this wal_end reaches the relay.
    Keepalive(Lsn),
    /// Endpoint `.1` answers event `.0` with a 2xx and the relay sees it.
    Deliver(u8, u8),
    /// Endpoint `.1` is parked for event `.0`: its row is committed, then
    /// the job completes.
    Park(u8, u8),
    /// The row of a parked job completed before it (not `ROW_FIRST`) is
    /// written.
    WriteRow(u8, u8),
    /// Event `.0`'s parked row is replayed to endpoint `.1` (up), which
    /// answers with a 2xx; the row is removed.
    Replay(u8, u8),
    SinkFails(u8),
    SinkRecovers(u8),
    /// A standby status update carries the relay's confirmed LSN to the slot.
    StatusUpdate(Lsn),
    /// The relay dies: pipeline dropped, a new session starts from the slot.
    Crash,
    /// Asynchronous parking: the writer commits the oldest queued row.
    WriterCommit,
    /// Asynchronous parking: the server flushes the oldest unflushed row.
    Flush,
    /// The flush poller reports this session's flushed commits.
    Poll,
    /// The server crashes: unflushed rows are lost, the relay's session
    /// ends and a new one starts from the slot.
    ServerCrash,
}

struct AckModel<R> {
    wals: Vec<Vec<Item>>,
    max_crashes: u8,
    /// 1, or 2 (`run --routes`: see [`AckModel::routes`]).
    endpoints: u8,
    /// Whether pending deliveries may be parked.
    parking: bool,
    /// Whether parked rows commit asynchronously (see the module doc).
    asynchronous: bool,
    _rule: PhantomData<fn() -> R>,
}

impl<R: Rule> AckModel<R> {
    fn new(wals: Vec<Vec<Item>>, max_crashes: u8) -> Self {
        for w in &wals {
            let events: u32 = w
                .iter()
                .map(|it| match it {
                    Item::Tx(n) => u32::from(*n),
                    Item::Gap => 0,
                })
                .sum();
            assert!(events <= 8, "event ids are a u8 bitmask");
        }
        AckModel {
            wals,
            max_crashes,
            endpoints: 1,
            parking: false,
            asynchronous: false,
            _rule: PhantomData,
        }
    }

    /// The same model with two endpoints.
    fn two_endpoints(mut self) -> Self {
        self.endpoints = 2;
        self
    }

    /// The two-endpoint model with parking.
    fn parking(mut self) -> Self {
        self.endpoints = 2;
        self.parking = true;
        self
    }

    /// The parking model with asynchronously committed rows.
    fn asynchronous(mut self) -> Self {
        self = self.parking();
        self.asynchronous = true;
        self
    }

    /// What a status update carries: the gate's position with asynchronous
    /// parking (unless the rule is not `GATED`), else the tracker's.
    fn ack(&self, s: &State<R>) -> Lsn {
        if self.asynchronous && R::GATED {
            s.gate.passed()
        } else {
            s.tracker.confirmed()
        }
    }

    /// Unflushed rows this session counted.
    fn counted_unflushed(s: &State<R>) -> u8 {
        s.unflushed.iter().filter(|u| u.2).count() as u8
    }

    /// This session's promised rows that are committed and flushed (a
    /// prefix of its queue: the writer commits in order, WAL flushes in
    /// order).
    fn flushed_of_session(s: &State<R>) -> u8 {
        s.promised - s.queued.len() as u8 - Self::counted_unflushed(s)
    }

    /// The endpoints event `e` goes to, as a bitmask: with two endpoints,
    /// even events to both (fan-out), odd ones to the second only.
    fn routes(&self, e: u8) -> u8 {
        match (self.endpoints, e % 2) {
            (1, _) => 0b01,
            (_, 0) => 0b11,
            _ => 0b10,
        }
    }

    /// Whether every endpoint event `e` goes to answered it with a 2xx or
    /// holds a parked row of it.
    fn done_everywhere(&self, s: &State<R>, e: u8) -> bool {
        (0..2).all(|ep| {
            self.routes(e) & (1 << ep) == 0 || (s.delivered[ep] | s.parked[ep]) & (1 << e) != 0
        })
    }

    /// Whether every endpoint event `e` goes to answered it with a 2xx.
    fn delivered_everywhere(&self, s: &State<R>, e: u8) -> bool {
        (0..2).all(|ep| self.routes(e) & (1 << ep) == 0 || s.delivered[ep] & (1 << e) != 0)
    }

    fn items(&self, s: &State<R>) -> &[Item] {
        &self.wals[usize::from(s.wal)]
    }

    fn events_in(&self, s: &State<R>, i: usize) -> u8 {
        match self.items(s)[i] {
            Item::Tx(n) => n,
            Item::Gap => 0,
        }
    }

    /// Global id of the first event of item `i`.
    fn first_event(&self, s: &State<R>, i: usize) -> u8 {
        (0..i).map(|j| self.events_in(s, j)).sum()
    }

    fn all_events(&self, s: &State<R>) -> u8 {
        let n = self.first_event(s, self.items(s).len());
        ((1u16 << n) - 1) as u8
    }

    fn wal_end(&self, s: &State<R>) -> Lsn {
        end_of(self.items(s).len() - 1)
    }

    /// A new session: everything the relay held is gone; the walsender
    /// starts at the slot (`sentPtr = confirmed_flush`) and resends every
    /// item ending after it.
    fn session(&self, s: &mut State<R>) {
        let next = (0..self.items(s).len())
            .find(|&i| end_of(i) > s.slot)
            .unwrap_or(self.items(s).len());
        s.next = next as u8;
        s.streaming = None;
        s.sent = s.slot;
        s.open = None;
        s.pending.clear();
        s.unwritten.clear();
        s.queued.clear();
        s.tracker = R::new(s.slot);
        // The server keeps the old session's unflushed rows; the new
        // session's counter does not count them.
        for u in &mut s.unflushed {
            u.2 = false;
        }
        s.promised = 0;
        s.covered = 0;
        s.gate = Held::new(s.slot);
    }

    /// The safety property, as a function so the broken rules can be tested
    /// against the same definition.
    fn safe(&self, s: &State<R>) -> bool {
        (0..self.items(s).len()).all(|i| {
            let first = self.first_event(s, i);
            let all_delivered =
                (first..first + self.events_in(s, i)).all(|e| self.done_everywhere(s, e));
            all_delivered || s.slot < end_of(i)
        })
    }

    fn goal(&self, s: &State<R>) -> bool {
        let all = self.all_events(s);
        (0..8)
            .filter(|e| all & (1 << e) != 0)
            .all(|e| self.delivered_everywhere(s, e))
            && s.slot == self.wal_end(s)
    }
}

impl<R: Rule> Model for AckModel<R> {
    type State = State<R>;
    type Action = Action;

    fn init_states(&self) -> Vec<State<R>> {
        (0..self.wals.len())
            .map(|w| {
                let mut s = State {
                    wal: w as u8,
                    slot: Lsn::new(BASE),
                    crashes: 0,
                    sink_up: [true; 2],
                    delivered: [0; 2],
                    parked: [0; 2],
                    unwritten: Vec::new(),
                    unflushed: Vec::new(),
                    lost_row: false,
                    lost_queued: false,
                    next: 0,
                    streaming: None,
                    sent: Lsn::new(BASE),
                    open: None,
                    pending: Vec::new(),
                    tracker: R::new(Lsn::new(BASE)),
                    queued: Vec::new(),
                    promised: 0,
                    covered: 0,
                    gate: Held::new(Lsn::new(BASE)),
                };
                self.session(&mut s);
                s
            })
            .collect()
    }

    fn actions(&self, s: &State<R>, actions: &mut Vec<Action>) {
        match s.streaming {
            Some((i, k)) if k < self.events_in(s, usize::from(i)) => {
                actions.push(Action::Insert(self.first_event(s, usize::from(i)) + k));
            }
            Some((i, _)) => actions.push(Action::Commit(i)),
            None => match self.items(s).get(usize::from(s.next)) {
                Some(Item::Tx(_)) => actions.push(Action::Begin(s.next)),
                Some(Item::Gap) => actions.push(Action::Skip(s.next)),
                None => {}
            },
        }
        actions.push(Action::Keepalive(s.sent));
        for ep in 0..self.endpoints {
            if s.sink_up[usize::from(ep)] {
                actions.extend(
                    s.pending
                        .iter()
                        .filter(|&&(_, p, _)| p == ep)
                        .map(|&(e, _, _)| Action::Deliver(e, ep)),
                );
                actions.push(Action::SinkFails(ep));
            } else {
                actions.push(Action::SinkRecovers(ep));
            }
            if self.parking {
                actions.extend(
                    s.unwritten
                        .iter()
                        .filter(|&&(_, p)| p == ep)
                        .map(|&(e, _)| Action::WriteRow(e, ep)),
                );
                actions.extend(
                    s.pending
                        .iter()
                        .filter(|&&(_, p, _)| p == ep)
                        .map(|&(e, _, _)| Action::Park(e, ep)),
                );
                if s.sink_up[usize::from(ep)] {
                    let parked = s.parked[usize::from(ep)];
                    actions.extend(
                        (0..8)
                            .filter(|e| parked & (1 << e) != 0)
                            .map(|e| Action::Replay(e, ep)),
                    );
                }
            }
        }
        if self.ack(s) != s.slot {
            actions.push(Action::StatusUpdate(self.ack(s)));
        }
        if s.crashes < self.max_crashes {
            actions.push(Action::Crash);
        }
        if self.asynchronous {
            if !s.queued.is_empty() {
                actions.push(Action::WriterCommit);
            }
            if !s.unflushed.is_empty() {
                actions.push(Action::Flush);
            }
            if (!s.unflushed.is_empty() || !s.queued.is_empty()) && s.crashes < self.max_crashes {
                actions.push(Action::ServerCrash);
            }
            if Self::flushed_of_session(s) != s.covered {
                actions.push(Action::Poll);
            }
        }
    }

    fn next_state(&self, s: &State<R>, action: Action) -> Option<State<R>> {
        let mut n = s.clone();
        match action {
            Action::Begin(i) => {
                n.streaming = Some((i, 0));
                n.sent = commit_start_of(usize::from(i));
                n.open = Some(n.tracker.begin());
            }
            Action::Insert(e) => {
                let (i, k) = n.streaming.expect("insert inside a transaction");
                n.streaming = Some((i, k + 1));
                let tx = n.open.expect("dispatcher saw Begin");
                let routes = self.routes(e);
                n.tracker.add_routed(tx, e, routes.count_ones() as u8);
                for ep in (0..2u8).filter(|ep| routes & (1 << ep) != 0) {
                    n.pending.push((e, ep, tx));
                }
                n.pending.sort();
            }
            Action::Commit(i) => {
                n.streaming = None;
                n.next = i + 1;
                n.sent = end_of(usize::from(i));
                let tx = n.open.take().expect("dispatcher saw Begin");
                n.tracker.commit(tx, end_of(usize::from(i)));
            }
            Action::Skip(i) => {
                n.next = i + 1;
                n.sent = end_of(usize::from(i));
            }
            Action::Keepalive(wal_end) => {
                // dispatch.rs: keepalives are ignored while a transaction is open.
                if n.open.is_none() {
                    n.tracker.keepalive(wal_end);
                }
            }
            Action::Deliver(e, ep) => {
                let at = n
                    .pending
                    .iter()
                    .position(|&(p, pe, _)| p == e && pe == ep)?;
                let (_, _, tx) = n.pending.remove(at);
                n.delivered[usize::from(ep)] |= 1 << e;
                n.tracker.complete_at(tx, e);
            }
            Action::Park(e, ep) => {
                let at = n
                    .pending
                    .iter()
                    .position(|&(p, pe, _)| p == e && pe == ep)?;
                let (_, _, tx) = n.pending.remove(at);
                if self.asynchronous {
                    // Promised, then queued; the job completes at once.
                    n.promised += 1;
                    n.queued.push((e, ep));
                } else if R::ROW_FIRST {
                    n.parked[usize::from(ep)] |= 1 << e;
                } else {
                    n.unwritten.push((e, ep));
                    n.unwritten.sort();
                }
                n.tracker.park_at(tx, e);
            }
            Action::WriteRow(e, ep) => {
                let at = n.unwritten.iter().position(|&u| u == (e, ep))?;
                n.unwritten.remove(at);
                n.parked[usize::from(ep)] |= 1 << e;
            }
            Action::Replay(e, ep) => {
                n.parked[usize::from(ep)] &= !(1 << e);
                n.delivered[usize::from(ep)] |= 1 << e;
            }
            Action::SinkFails(ep) => n.sink_up[usize::from(ep)] = false,
            Action::SinkRecovers(ep) => n.sink_up[usize::from(ep)] = true,
            Action::StatusUpdate(lsn) => n.slot = lsn,
            Action::Crash => {
                n.crashes += 1;
                n.lost_queued |= !n.queued.is_empty();
                self.session(&mut n);
            }
            Action::WriterCommit => {
                let (e, ep) = n.queued.remove(0);
                n.unflushed.push((e, ep, true));
            }
            Action::Flush => {
                let (e, ep, _) = n.unflushed.remove(0);
                n.parked[usize::from(ep)] |= 1 << e;
            }
            Action::Poll => n.covered = Self::flushed_of_session(&n),
            Action::ServerCrash => {
                n.crashes += 1;
                n.unflushed.clear();
                n.lost_row = true;
                self.session(&mut n);
            }
        }
        if self.asynchronous {
            // dispatch::publish after every step: the position, then the count.
            let needs = if R::COUNTS_PROMISED {
                n.promised
            } else {
                n.promised - n.queued.len() as u8
            };
            n.gate.offer(
                n.tracker.confirmed(),
                u64::from(needs),
                u64::from(n.covered),
            );
        }
        (n != *s).then_some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(SAFETY, |m: &Self, s: &State<R>| m.safe(s)),
            Property::always(
                "status updates never move the slot back",
                |m: &Self, s: &State<R>| m.ack(s) >= s.slot,
            ),
            // Non-vacuity: the interesting situations are reachable.
            Property::sometimes(
                "every event delivered, whole WAL confirmed",
                |m: &Self, s: &State<R>| m.goal(s),
            ),
            Property::sometimes(
                "a keepalive confirmed unpublished WAL",
                |m: &Self, s: &State<R>| {
                    m.items(s)
                        .iter()
                        .enumerate()
                        .any(|(i, it)| *it == Item::Gap && s.slot == end_of(i))
                },
            ),
            Property::sometimes(
                "a delivered event is redelivered after a crash",
                |_: &Self, s: &State<R>| {
                    s.pending
                        .iter()
                        .any(|&(e, ep, _)| s.delivered[usize::from(ep)] & (1 << e) != 0)
                },
            ),
            Property::sometimes(
                "a later event completes before an earlier one",
                |_: &Self, s: &State<R>| {
                    s.pending
                        .iter()
                        .any(|&(e, ep, _)| s.delivered[usize::from(ep)] >> e > 1)
                },
            ),
            Property::sometimes(
                "the slot passed an event parked at a down endpoint",
                |m: &Self, s: &State<R>| {
                    !m.parking
                        || (0..m.items(s).len()).any(|i| {
                            let first = m.first_event(s, i);
                            s.slot >= end_of(i)
                                && (first..first + m.events_in(s, i))
                                    .any(|e| !s.sink_up[1] && s.parked[1] & (1 << e) != 0)
                        })
                },
            ),
            Property::sometimes(
                "the gate held back a position whose parked row was not flushed",
                |m: &Self, s: &State<R>| !m.asynchronous || s.gate.passed() < s.tracker.confirmed(),
            ),
            Property::sometimes(
                "a server crash lost an unflushed parked row",
                |m: &Self, s: &State<R>| !m.asynchronous || s.lost_row,
            ),
            Property::sometimes(
                "a relay crash lost a queued parked row",
                |m: &Self, s: &State<R>| !m.asynchronous || s.lost_queued,
            ),
            Property::sometimes(
                "one endpoint is done with an event while the other is down",
                |m: &Self, s: &State<R>| {
                    m.endpoints == 2
                        && s.pending.iter().any(|&(e, ep, _)| {
                            !s.sink_up[usize::from(ep)]
                                && s.delivered[usize::from(1 - ep)] & (1 << e) != 0
                        })
                        || m.endpoints == 1
                },
            ),
        ]
    }
}

// ---------------------------------------------------------------------------
// Reporting.

struct Summary<'a, R: Rule>(&'a State<R>);

impl<R: Rule> fmt::Display for Summary<'_, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0;
        let bits = |m: u8| -> Vec<u8> { (0..8).filter(|e| m & (1 << e) != 0).collect() };
        write!(
            f,
            "slot={} relay.confirmed={} gate={} sent={} delivered={:?}/{:?} parked={:?}/{:?} queued={:?} unflushed={:?} pending(event,endpoint)={:?} sinks={:?} crashes={}",
            s.slot.as_u64(),
            s.tracker.confirmed().as_u64(),
            s.gate.passed().as_u64(),
            s.sent.as_u64(),
            bits(s.delivered[0]),
            bits(s.delivered[1]),
            bits(s.parked[0]),
            bits(s.parked[1]),
            s.queued,
            s.unflushed
                .iter()
                .map(|&(e, ep, _)| (e, ep))
                .collect::<Vec<_>>(),
            s.pending
                .iter()
                .map(|&(e, ep, _)| (e, ep))
                .collect::<Vec<_>>(),
            s.sink_up,
            s.crashes,
        )
    }
}

fn describe_wal(items: &[Item]) -> String {
    let mut out = Vec::new();
    let mut event = 0u8;
    for (i, it) in items.iter().enumerate() {
        match it {
            Item::Tx(n) => {
                let ids: Vec<u8> = (event..event + n).collect();
                event += n;
                out.push(format!(
                    "item {i}: tx events {ids:?} end {}",
                    end_of(i).as_u64()
                ));
            }
            Item::Gap => out.push(format!(
                "item {i}: unpublished WAL up to {}",
                end_of(i).as_u64()
            )),
        }
    }
    out.join("; ")
}

fn render<R: Rule>(model: &AckModel<R>, steps: Vec<(State<R>, Option<Action>)>) -> String {
    let mut out = format!(
        "  WAL: {}\n  start: {}\n",
        describe_wal(model.items(&steps[0].0)),
        Summary(&steps[0].0)
    );
    for w in steps.windows(2) {
        let action = w[0].1.expect("every step but the last has an action");
        out += &format!("  {action:?} -> {}\n", Summary(&w[1].0));
    }
    out
}

// ---------------------------------------------------------------------------
// Checks.

/// Every WAL of three transactions with 0–2 outbox events each (27), once
/// back to back and once with unpublished WAL (reported only by keepalives)
/// after each transaction: 54 initial states.
fn wals() -> Vec<Vec<Item>> {
    let mut out = Vec::new();
    for gaps in [false, true] {
        for a in 0..=2 {
            for b in 0..=2 {
                for c in 0..=2 {
                    let mut wal = Vec::new();
                    for events in [a, b, c] {
                        wal.push(Item::Tx(events));
                        if gaps {
                            wal.push(Item::Gap);
                        }
                    }
                    out.push(wal);
                }
            }
        }
    }
    out
}

const MAX_CRASHES: u8 = 2;

struct Outcome<R: Rule> {
    unique_states: usize,
    discoveries: HashMap<&'static str, Path<State<R>, Action>>,
}

fn run_stateright<R: Rule>(model: AckModel<R>, finish: HasDiscoveries) -> Outcome<R> {
    let started = Instant::now();
    let endpoints = model.endpoints;
    let checker = model.checker().finish_when(finish).spawn_bfs().join();
    let unique_states = checker.unique_state_count();
    println!(
        "[{}] stateright ({} endpoint(s)): {} unique states ({} transitions), max depth {}, {:.2?}",
        R::NAME,
        endpoints,
        unique_states,
        checker.state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    Outcome {
        unique_states,
        discoveries: checker.discoveries(),
    }
}

/// The explicit state graph of the recovery check.
struct Graph<R: Rule> {
    index: HashMap<State<R>, u32>,
    states: Vec<State<R>>,
    /// How each state was first reached (a shortest path, breadth-first).
    parent: Vec<Option<(u32, Action)>>,
    /// Reverse edges of the recovery transitions (no crash, no sink failure).
    back: Vec<Vec<u32>>,
    queue: VecDeque<u32>,
}

impl<R: Rule> Default for Graph<R> {
    fn default() -> Self {
        Graph {
            index: HashMap::new(),
            states: Vec::new(),
            parent: Vec::new(),
            back: Vec::new(),
            queue: VecDeque::new(),
        }
    }
}

impl<R: Rule> Graph<R> {
    fn add(&mut self, s: State<R>, from: Option<(u32, Action)>) -> u32 {
        if let Some(&id) = self.index.get(&s) {
            return id;
        }
        let id = u32::try_from(self.states.len()).expect("fewer than 2^32 states");
        self.index.insert(s.clone(), id);
        self.states.push(s);
        self.parent.push(from);
        self.back.push(Vec::new());
        self.queue.push_back(id);
        id
    }
}

/// Which transitions a liveness check may use, and what it must reach.
struct Liveness<R: Rule> {
    name: &'static str,
    /// Transitions the path may take.
    allowed: fn(&Action) -> bool,
    /// States the check starts from.
    from: fn(&State<R>) -> bool,
    /// What must be reachable.
    goal: fn(&AckModel<R>, &State<R>) -> bool,
}

/// Recovery (AG EF): from every reachable state, using neither crashes nor
/// sink failures (a failed sink may recover), some path reaches the goal:
/// every event delivered and the slot at the end of the WAL.
fn recovery<R: Rule>() -> Liveness<R> {
    Liveness {
        name: "recovery",
        allowed: |a| {
            !matches!(
                a,
                Action::Crash | Action::ServerCrash | Action::SinkFails(_)
            )
        },
        from: |_| true,
        goal: |m, s| m.goal(s),
    }
}

/// Parking's purpose (AG EF): from every reachable state where the second
/// endpoint is down, with no crash and that endpoint never back, some path
/// confirms the whole WAL.
fn moves_on_while_down<R: Rule>() -> Liveness<R> {
    Liveness {
        name: "the slot moves on while an endpoint is down",
        allowed: |a| {
            !matches!(
                a,
                Action::Crash | Action::ServerCrash | Action::SinkRecovers(1)
            )
        },
        from: |s| !s.sink_up[1],
        goal: |m, s| s.slot == m.wal_end(s),
    }
}

fn check_recovery<R: Rule>(model: &AckModel<R>) -> Result<usize, String> {
    check_liveness(model, &recovery())
}

/// Explores the whole graph breadth-first with the model's own transition
/// function, then runs a backward fixpoint from the goal states over the
/// allowed transitions. Returns the number of states, or a path to a start
/// state that cannot reach the goal and the best it can still reach.
fn check_liveness<R: Rule>(model: &AckModel<R>, l: &Liveness<R>) -> Result<usize, String> {
    let started = Instant::now();
    let mut g = Graph::default();
    for s in model.init_states() {
        g.add(s, None);
    }
    let mut actions = Vec::new();
    while let Some(id) = g.queue.pop_front() {
        let s = g.states[id as usize].clone();
        actions.clear();
        model.actions(&s, &mut actions);
        for &a in &actions {
            if let Some(n) = model.next_state(&s, a) {
                let nid = g.add(n, Some((id, a)));
                if (l.allowed)(&a) {
                    g.back[nid as usize].push(id);
                }
            }
        }
    }
    let Graph {
        states,
        parent,
        back,
        ..
    } = g;
    let mut can: Vec<bool> = states.iter().map(|s| (l.goal)(model, s)).collect();
    let goals = can.iter().filter(|g| **g).count();
    let mut queue: VecDeque<u32> = (0..states.len())
        .filter(|&i| can[i])
        .map(|i| i as u32)
        .collect();
    while let Some(id) = queue.pop_front() {
        for &p in &back[id as usize] {
            if !can[p as usize] {
                can[p as usize] = true;
                queue.push_back(p);
            }
        }
    }
    let starts = states.iter().filter(|s| (l.from)(s)).count();
    if let Some(stuck) = (0..states.len()).find(|&i| (l.from)(&states[i]) && !can[i]) {
        let mut steps = vec![(states[stuck].clone(), None)];
        let mut at = stuck;
        while let Some((p, a)) = parent[at] {
            steps.push((states[p as usize].clone(), Some(a)));
            at = p as usize;
        }
        // Each state paired with the action that leaves it, from the start.
        steps.reverse();
        let best = best_reachable(model, &states[stuck], l.allowed);
        return Err(format!(
            "[{}] {} fails: from the last state below, no allowed continuation reaches the goal\n{}  best reachable from there: {}\n",
            R::NAME,
            l.name,
            render(model, steps),
            Summary(&best)
        ));
    }
    println!(
        "[{}] {}: {} states ({} goal states), all {} start states reach the goal, {:.2?}",
        R::NAME,
        l.name,
        states.len(),
        goals,
        starts,
        started.elapsed()
    );
    Ok(states.len())
}

/// The most progressed state (events delivered, then slot) reachable from
/// `from` by allowed transitions.
fn best_reachable<R: Rule>(
    model: &AckModel<R>,
    from: &State<R>,
    allowed: fn(&Action) -> bool,
) -> State<R> {
    let mut g = Graph::default();
    g.add(from.clone(), None);
    let mut actions = Vec::new();
    while let Some(id) = g.queue.pop_front() {
        let s = g.states[id as usize].clone();
        actions.clear();
        model.actions(&s, &mut actions);
        for &a in &actions {
            if !allowed(&a) {
                continue;
            }
            if let Some(n) = model.next_state(&s, a) {
                g.add(n, Some((id, a)));
            }
        }
    }
    g.states
        .into_iter()
        .max_by_key(|s| {
            (
                s.delivered[0].count_ones() + s.delivered[1].count_ones(),
                s.slot,
            )
        })
        .expect("at least the start")
}

const SAFETY: &str = "slot never passes an undelivered committed event";

/// The real rule: no counterexample to any safety property, every
/// non-vacuity example found, and recovery from every reachable state.
#[test]
fn real_ack_tracker_is_safe_and_recovers() {
    check_real(|| AckModel::new(wals(), MAX_CRASHES));
}

/// Two transactions of 0–2 events, with and without unpublished WAL after
/// each: 18 initial states (the two-endpoint model's space is larger).
fn wals_two_endpoints() -> Vec<Vec<Item>> {
    let mut out = Vec::new();
    for gaps in [false, true] {
        for a in 0..=2 {
            for b in 0..=2 {
                let mut wal = Vec::new();
                for events in [a, b] {
                    wal.push(Item::Tx(events));
                    if gaps {
                        wal.push(Item::Gap);
                    }
                }
                out.push(wal);
            }
        }
    }
    out
}

/// The real rule with two endpoints (one tracker event per endpoint an
/// event is routed to), each sink failing and recovering on its own.
#[test]
fn real_ack_tracker_is_safe_and_recovers_with_two_endpoints() {
    check_real(|| AckModel::new(wals_two_endpoints(), 1).two_endpoints());
}

fn check_real(model: fn() -> AckModel<AckTracker>) {
    // Both explorations at once: 2 cores.
    let (outcome, explored) = std::thread::scope(|scope| {
        let recovery = scope.spawn(|| check_recovery(&model()).unwrap_or_else(|e| panic!("{e}")));
        let outcome = run_stateright::<AckTracker>(model(), HasDiscoveries::All);
        (
            outcome,
            recovery
                .join()
                .unwrap_or_else(|e| std::panic::resume_unwind(e)),
        )
    });
    let model = model();
    for p in model.properties() {
        let found = outcome.discoveries.get(p.name);
        match p.expectation {
            Expectation::Always => {
                if let Some(path) = found {
                    panic!(
                        "counterexample to {:?} with the real AckTracker:\n{}",
                        p.name,
                        render(&model, truncate(&model, path.clone(), p.condition))
                    );
                }
                println!("[{}] holds on every state: {:?}", AckTracker::NAME, p.name);
            }
            Expectation::Sometimes => {
                let path = found.unwrap_or_else(|| panic!("never reached: {:?}", p.name));
                println!(
                    "[{}] reachable (non-vacuity): {:?}, e.g. after {} steps",
                    AckTracker::NAME,
                    p.name,
                    path.clone().into_actions().len()
                );
            }
            Expectation::Eventually => unreachable!("none declared"),
        }
    }
    assert_eq!(
        explored, outcome.unique_states,
        "stateright and the recovery check see the same state space"
    );
}

/// Cuts a path after its first state violating `condition` (stateright
/// reports the state where it noticed, which may come later).
fn truncate<R: Rule>(
    model: &AckModel<R>,
    path: Path<State<R>, Action>,
    condition: fn(&AckModel<R>, &State<R>) -> bool,
) -> Vec<(State<R>, Option<Action>)> {
    let mut steps = path.into_vec();
    if let Some(first) = steps.iter().position(|(s, _)| !condition(model, s)) {
        steps.truncate(first + 1);
        steps[first].1 = None;
    }
    steps
}

fn assert_caught<R: Rule>() {
    assert_caught_in(|| AckModel::<R>::new(wals(), MAX_CRASHES));
}

fn assert_caught_in<R: Rule>(model: impl Fn() -> AckModel<R>) {
    let outcome = run_stateright::<R>(model(), HasDiscoveries::AnyFailures);
    let model = model();
    let path = outcome
        .discoveries
        .get(SAFETY)
        .unwrap_or_else(|| panic!("[{}] the check did not catch the broken rule", R::NAME))
        .clone();
    assert!(!model.safe(path.last_state()));
    let steps = truncate(&model, path, |m, s| m.safe(s));
    println!(
        "[{}] counterexample to {SAFETY:?} ({} steps):\n{}",
        R::NAME,
        steps.len() - 1,
        render(&model, steps)
    );
}

#[test]
fn broken_rule_highest_completed_commit_is_caught() {
    assert_caught::<HighestDone>();
}

#[test]
fn broken_rule_keepalive_while_pending_is_caught() {
    assert_caught::<EagerKeepalive>();
}

/// The recovery check can fail too: with keepalives ignored, a WAL ending in
/// unpublished WAL is never confirmed to its end.
#[test]
fn broken_rule_ignoring_keepalives_is_caught_by_recovery() {
    use Item::{Gap, Tx};
    let wal = vec![Tx(1), Gap, Tx(2), Gap, Tx(0), Gap];
    let model = AckModel::<NoKeepalive>::new(vec![wal], MAX_CRASHES);
    let report = check_recovery(&model).expect_err("the recovery check must fail");
    println!("{report}");
}

/// With two endpoints, counting an event done at its first endpoint's 2xx
/// confirms past a fan-out event the other endpoint never took.
#[test]
fn broken_rule_first_endpoint_done_is_caught() {
    assert_caught_in(|| {
        AckModel::<FirstEndpointDone>::new(wals_two_endpoints(), 1).two_endpoints()
    });
}

/// The real tracker passes with two endpoints where the rule above fails,
/// and the broken rule is harmless with one endpoint: the check is about
/// the fan-out, not something else.
#[test]
fn first_endpoint_done_is_harmless_with_one_endpoint() {
    let outcome = run_stateright::<FirstEndpointDone>(
        AckModel::new(wals(), MAX_CRASHES),
        HasDiscoveries::AnyFailures,
    );
    assert!(!outcome.discoveries.contains_key(SAFETY));
}

/// The real rule with parking: safe (a parked row counts as done at its
/// endpoint), recovers (every parked row replayed), and the slot moves on
/// while an endpoint is down.
#[test]
fn real_ack_tracker_is_safe_recovers_and_moves_on_with_parking() {
    check_real(|| AckModel::new(wals_parking(), 1).parking());
    let explored = check_liveness(
        &AckModel::<AckTracker>::new(wals_parking(), 1).parking(),
        &moves_on_while_down(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(explored > 0);
}

/// Without parking the slot cannot move on while an endpoint is down: the
/// property is about parking, not something else.
#[test]
fn without_parking_the_slot_waits_for_a_down_endpoint() {
    let model = AckModel::<AckTracker>::new(wals_parking(), 1).two_endpoints();
    let report = check_liveness(&model, &moves_on_while_down()).expect_err("it must wait");
    println!("{report}");
}

#[test]
fn broken_rule_parked_stays_pending_is_caught() {
    let model = AckModel::<ParkedStaysPending>::new(wals_parking(), 1).parking();
    let report = check_liveness(&model, &moves_on_while_down())
        .expect_err("the check must catch a parked event left pending");
    println!("{report}");
}

#[test]
fn broken_rule_parked_before_row_is_caught() {
    assert_caught_in(|| AckModel::<ParkedBeforeRow>::new(wals_parking(), 1).parking());
}

/// The real rule with asynchronously committed parked rows behind the real
/// flush gate: safe across server crashes (a lost row's event is resent),
/// recovers, and the slot still moves on while an endpoint is down.
#[test]
fn real_ack_tracker_is_safe_recovers_and_moves_on_with_asynchronous_parking() {
    check_real(|| AckModel::new(wals_asynchronous(), 1).asynchronous());
    let explored = check_liveness(
        &AckModel::<AckTracker>::new(wals_asynchronous(), 1).asynchronous(),
        &moves_on_while_down(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(explored > 0);
}

#[test]
fn broken_rule_confirming_before_the_flush_is_caught() {
    assert_caught_in(|| AckModel::<Ungated>::new(wals_asynchronous(), 1).asynchronous());
}

#[test]
fn broken_rule_gate_counting_committed_rows_is_caught() {
    assert_caught_in(|| AckModel::<CountsCommitted>::new(wals_asynchronous(), 1).asynchronous());
}

/// Two WALs for the asynchronous parking model (the parking model's space
/// times the unflushed rows' order and the gate's held positions): two
/// events, one to both endpoints and one to the second, in two
/// transactions, or in one followed by unpublished WAL.
fn wals_asynchronous() -> Vec<Vec<Item>> {
    use Item::{Gap, Tx};
    vec![vec![Tx(1), Tx(1)], vec![Tx(2), Gap]]
}

/// Three WALs for the parking model, whose space is the largest: events
/// to both endpoints and to one, with and without unpublished WAL.
fn wals_parking() -> Vec<Vec<Item>> {
    use Item::{Gap, Tx};
    vec![
        vec![Tx(2), Tx(1)],
        vec![Tx(1), Gap, Tx(1), Gap],
        vec![Tx(0), Tx(2), Gap],
    ]
}
