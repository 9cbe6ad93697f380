//! The world of the model: a fixed WAL, the walsender, the slot, the
//! relay's session (the rule under test drives its acknowledgement) and
//! one or two HTTP sinks; its actions and properties (`render` shows a
//! path).

use std::marker::PhantomData;

use cdc_relay::lsn::Lsn;
use stateright::{Model, Property};

use crate::rules::Rule;

/// One stretch of WAL, in commit order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Item {
    /// A committed transaction decoded and sent as Begin, this many outbox
    /// inserts, Commit (0: it touched only other published tables).
    Tx(u8),
    /// WAL the walsender reads without sending anything (unpublished tables,
    /// empty transactions skipped by pgoutput); only a keepalive reports it.
    Gap,
}

/// Where the slot was created.
pub(crate) const BASE: u64 = 100;
/// WAL bytes per item.
pub(crate) const STEP: u64 = 10;

/// End LSN of item `i` (for a transaction: the position after its commit
/// record, what `Commit.end_lsn` reports).
pub(crate) fn end_of(i: usize) -> Lsn {
    Lsn::new(BASE + STEP * (i as u64 + 1))
}

/// Start of item `i`'s commit record. The walsender's sent position while it
/// streams transaction `i`: it has read every record before the commit record
/// and is decoding that one. A restarted slot resends a transaction iff its
/// commit record starts at or after `confirmed_flush_lsn` (PostgreSQL skips
/// `commit origptr < start_decoding_at`), i.e. iff `end_of(i) > slot` here.
pub(crate) fn commit_start_of(i: usize) -> Lsn {
    Lsn::new(end_of(i).as_u64() - 1)
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct State<R: Rule> {
    /// Which WAL of [`AckModel::wals`].
    pub(crate) wal: u8,
    /// The slot's `confirmed_flush_lsn`: survives crashes.
    pub(crate) slot: Lsn,
    pub(crate) crashes: u8,
    /// Per endpoint (the second unused with one endpoint).
    pub(crate) sink_up: [bool; 2],
    /// Per endpoint, events (global ids) it answered with a 2xx at least
    /// once, ever.
    pub(crate) delivered: [u8; 2],
    /// Per endpoint, events with a parked dead-letter row (durable; gone
    /// once replayed).
    pub(crate) parked: [u8; 2],
    /// Parked jobs completed whose row is not written yet (only with a rule
    /// that is not `ROW_FIRST`): lost on a crash.
    pub(crate) unwritten: Vec<(u8, u8)>,
    // --- the current session: lost on a crash ---
    /// Next WAL item the walsender will decode.
    pub(crate) next: u8,
    /// Transaction being sent: (item, outbox inserts sent so far).
    pub(crate) streaming: Option<(u8, u8)>,
    /// The walsender's sent position (what a keepalive reports as wal_end).
    pub(crate) sent: Lsn,
    /// The dispatcher's open transaction (`Dispatcher::tx`).
    pub(crate) open: Option<R::Seq>,
    /// Deliveries handed to dispatch and not yet done: (event id,
    /// endpoint, transaction).
    pub(crate) pending: Vec<(u8, u8, R::Seq)>,
    /// The acknowledgement state under test.
    pub(crate) tracker: R,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Action {
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
    /// Endpoint 0 answers one request carrying the events of mask `.0` (a
    /// batch, `docs/architecture.md#batches`): it recorded those of mask
    /// `.1` (all of them on a 2xx; fewer when it refused the batch and a
    /// half was delivered after a split, or answered per event). The relay
    /// completes the jobs the rule says are done ([`Rule::batch_done`]);
    /// the others stay pending and are sent again.
    Batch(u8, u8),
    /// Endpoint 0 answers a batch (mask `.0`) per event, a 207
    /// (`docs/architecture.md#batches`): it took those of mask `.1`, and
    /// refused those of mask `.2` as poison, which are dead-lettered (row
    /// committed, then the job completed, as [`Action::Park`] does); the
    /// rest are sent again later. A refused event's row is replayed like a
    /// parked one ([`Action::Replay`]).
    PerEvent(u8, u8, u8),
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
}

pub(crate) struct AckModel<R> {
    pub(crate) wals: Vec<Vec<Item>>,
    pub(crate) max_crashes: u8,
    /// 1, or 2 (`run --routes`: see [`AckModel::routes`]).
    pub(crate) endpoints: u8,
    /// Whether pending deliveries may be parked.
    pub(crate) parking: bool,
    /// Whether endpoint 0 takes batches.
    pub(crate) batches: bool,
    pub(crate) _rule: PhantomData<fn() -> R>,
}

impl<R: Rule> AckModel<R> {
    pub(crate) fn new(wals: Vec<Vec<Item>>, max_crashes: u8) -> Self {
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
            batches: false,
            _rule: PhantomData,
        }
    }

    /// The same model with two endpoints.
    pub(crate) fn two_endpoints(mut self) -> Self {
        self.endpoints = 2;
        self
    }

    /// The two-endpoint model with parking.
    pub(crate) fn parking(mut self) -> Self {
        self.endpoints = 2;
        self.parking = true;
        self
    }

    /// The one-endpoint model where any two or more pending events may go
    /// as one request, recorded whole or in part.
    pub(crate) fn batches(mut self) -> Self {
        self.batches = true;
        self
    }

    /// The endpoints event `e` goes to, as a bitmask: with two endpoints,
    /// even events to both (fan-out), odd ones to the second only.
    pub(crate) fn routes(&self, e: u8) -> u8 {
        match (self.endpoints, e % 2) {
            (1, _) => 0b01,
            (_, 0) => 0b11,
            _ => 0b10,
        }
    }

    /// Whether every endpoint event `e` goes to answered it with a 2xx or
    /// holds a parked row of it.
    pub(crate) fn done_everywhere(&self, s: &State<R>, e: u8) -> bool {
        (0..2).all(|ep| {
            self.routes(e) & (1 << ep) == 0 || (s.delivered[ep] | s.parked[ep]) & (1 << e) != 0
        })
    }

    /// Whether every endpoint event `e` goes to answered it with a 2xx.
    pub(crate) fn delivered_everywhere(&self, s: &State<R>, e: u8) -> bool {
        (0..2).all(|ep| self.routes(e) & (1 << ep) == 0 || s.delivered[ep] & (1 << e) != 0)
    }

    pub(crate) fn items(&self, s: &State<R>) -> &[Item] {
        &self.wals[usize::from(s.wal)]
    }

    pub(crate) fn events_in(&self, s: &State<R>, i: usize) -> u8 {
        match self.items(s)[i] {
            Item::Tx(n) => n,
            Item::Gap => 0,
        }
    }

    /// Global id of the first event of item `i`.
    pub(crate) fn first_event(&self, s: &State<R>, i: usize) -> u8 {
        (0..i).map(|j| self.events_in(s, j)).sum()
    }

    pub(crate) fn all_events(&self, s: &State<R>) -> u8 {
        let n = self.first_event(s, self.items(s).len());
        ((1u16 << n) - 1) as u8
    }

    pub(crate) fn wal_end(&self, s: &State<R>) -> Lsn {
        end_of(self.items(s).len() - 1)
    }

    /// Event `e`'s job at endpoint `ep` is parked or dead-lettered: its
    /// row committed (unless the rule completes first, `ROW_FIRST` false:
    /// the row is then written by a later [`Action::WriteRow`]), then the
    /// job completed. `None` when the job is not pending.
    fn park(&self, n: &mut State<R>, e: u8, ep: u8) -> Option<()> {
        let at = n
            .pending
            .iter()
            .position(|&(p, pe, _)| p == e && pe == ep)?;
        let (_, _, tx) = n.pending.remove(at);
        if R::ROW_FIRST {
            n.parked[usize::from(ep)] |= 1 << e;
        } else {
            n.unwritten.push((e, ep));
            n.unwritten.sort();
        }
        n.tracker.park_at(tx, e);
        Some(())
    }

    /// A new session: everything the relay held is gone; the walsender
    /// starts at the slot (`sentPtr = confirmed_flush`) and resends every
    /// item ending after it.
    pub(crate) fn session(&self, s: &mut State<R>) {
        let next = (0..self.items(s).len())
            .find(|&i| end_of(i) > s.slot)
            .unwrap_or(self.items(s).len());
        s.next = next as u8;
        s.streaming = None;
        s.sent = s.slot;
        s.open = None;
        s.pending.clear();
        s.unwritten.clear();
        s.tracker = R::new(s.slot);
    }

    /// The safety property, as a function so the broken rules can be tested
    /// against the same definition.
    pub(crate) fn safe(&self, s: &State<R>) -> bool {
        (0..self.items(s).len()).all(|i| {
            let first = self.first_event(s, i);
            let all_delivered =
                (first..first + self.events_in(s, i)).all(|e| self.done_everywhere(s, e));
            all_delivered || s.slot < end_of(i)
        })
    }

    pub(crate) fn goal(&self, s: &State<R>) -> bool {
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
                    next: 0,
                    streaming: None,
                    sent: Lsn::new(BASE),
                    open: None,
                    pending: Vec::new(),
                    tracker: R::new(Lsn::new(BASE)),
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
            if self.parking || self.batches {
                actions.extend(
                    s.unwritten
                        .iter()
                        .filter(|&&(_, p)| p == ep)
                        .map(|&(e, _)| Action::WriteRow(e, ep)),
                );
                if self.parking {
                    actions.extend(
                        s.pending
                            .iter()
                            .filter(|&&(_, p, _)| p == ep)
                            .map(|&(e, _, _)| Action::Park(e, ep)),
                    );
                }
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
        if self.batches && s.sink_up[0] {
            let pending: u8 = s
                .pending
                .iter()
                .filter(|&&(_, ep, _)| ep == 0)
                .fold(0, |m, &(e, _, _)| m | (1 << e));
            // Every batch of two or more pending events, and every
            // non-empty part of it the sink recorded.
            let mut batch = pending;
            while batch != 0 {
                if batch.count_ones() >= 2 {
                    let mut part = batch;
                    while part != 0 {
                        actions.push(Action::Batch(batch, part));
                        // Answered per event: `part` refused, any of the
                        // rest taken (none: all sent again).
                        let rest = batch & !part;
                        let mut taken = rest;
                        loop {
                            actions.push(Action::PerEvent(batch, taken, part));
                            if taken == 0 {
                                break;
                            }
                            taken = (taken - 1) & rest;
                        }
                        part = (part - 1) & batch;
                    }
                }
                batch = (batch - 1) & pending;
            }
        }
        if s.tracker.confirmed() != s.slot {
            actions.push(Action::StatusUpdate(s.tracker.confirmed()));
        }
        if s.crashes < self.max_crashes {
            actions.push(Action::Crash);
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
            Action::Batch(batch, recorded) => {
                n.delivered[0] |= recorded;
                let done = R::batch_done(batch, recorded);
                let mut i = 0;
                while i < n.pending.len() {
                    let (e, ep, tx) = n.pending[i];
                    if ep == 0 && done & (1 << e) != 0 {
                        n.pending.remove(i);
                        n.tracker.complete_at(tx, e);
                    } else {
                        i += 1;
                    }
                }
            }
            Action::Park(e, ep) => self.park(&mut n, e, ep)?,
            Action::PerEvent(batch, taken, refused) => {
                n.delivered[0] |= taken;
                let done = R::batch_done(batch, taken);
                let mut i = 0;
                while i < n.pending.len() {
                    let (e, ep, tx) = n.pending[i];
                    if ep == 0 && done & (1 << e) != 0 && refused & (1 << e) == 0 {
                        n.pending.remove(i);
                        n.tracker.complete_at(tx, e);
                    } else {
                        i += 1;
                    }
                }
                for e in (0..8).filter(|e| refused & (1 << e) != 0) {
                    self.park(&mut n, e, 0)?;
                }
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
                self.session(&mut n);
            }
        }
        (n != *s).then_some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(crate::SAFETY, |m: &Self, s: &State<R>| m.safe(s)),
            Property::always(
                "status updates never move the slot back",
                |_: &Self, s: &State<R>| s.tracker.confirmed() >= s.slot,
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
