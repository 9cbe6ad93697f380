//! Model check of the acknowledgement rule
//! (`docs/architecture.md#acknowledgement`), with the `stateright` crate.
//!
//! The model is a PostgreSQL server with a fixed WAL, a logical slot, one
//! relay and an HTTP sink. The relay's acknowledgement state is the **real**
//! [`cdc_relay::ack::AckTracker`], driven exactly as `dispatch::run` drives it
//! (Begin → `begin`, outbox insert → `add_event`, Commit → `commit`, a 2xx →
//! `complete`, a keepalive → `keepalive` only while no transaction is open);
//! status updates copy its `confirmed()` to the slot. Everything else is
//! nondeterministic: when the walsender sends the next message, when a
//! keepalive arrives, which pending delivery gets its 2xx next, when the sink
//! fails or recovers, when a status update goes out, and when the relay
//! crashes (its state is lost; the next session restarts from the slot's
//! `confirmed_flush_lsn`, as `relay::session` does).
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
//! completed, as the dispatcher's hand-off to the dead-letter writer does
//! (the job completes when the commit of the batch holding its row
//! returns, with the server's `synchronous_commit`) — and a parked event may later
//! be *replayed* to its endpoint while that endpoint is up. Safety counts
//! a parked row as done there; recovery asks for every parked row
//! replayed too. A further liveness property is parking's purpose: from
//! every reachable state where the second endpoint is down, with no crash
//! and that endpoint never back, the slot can still reach the end of the
//! WAL. Broken rules: "a parked event stays pending" must fail that
//! property, and "a parked job completes before its row is written" (a
//! crash in between loses the event) must fail safety.
//!
//! **Batches** (`docs/architecture.md#batches`): the one-endpoint model
//! where any two or more pending events may go as one request, which the
//! sink records whole (a 2xx) or in part (a refused batch split, its
//! halves answered on their own); the relay completes exactly the
//! recorded events' jobs, and the rest stay pending and are sent again.
//! A batch may instead be answered per event (a 207): some events taken,
//! some refused and dead-lettered (row committed, then the job completed),
//! the rest sent again later, so a batch's events complete at different
//! times. The broken rules "a batch is done when its first part is" and
//! "a refused event's job completes before its row is written" must fail
//! safety.
//!
//! Run: `cargo test -p cdc-relay --test ack_model -- --nocapture`.

mod liveness;
mod model;
mod render;
mod rules;

use std::collections::HashMap;
use std::time::Instant;

use cdc_relay::ack::AckTracker;
use stateright::{Checker, Expectation, HasDiscoveries, Model, Path};

use liveness::{check_liveness, check_recovery, moves_on_while_down};
use model::{AckModel, Action, Item, State};
use render::render;
use rules::{
    BatchDoneWithFirst, EagerKeepalive, FirstEndpointDone, HighestDone, NoKeepalive,
    ParkedBeforeRow, ParkedStaysPending, Rule,
};

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

/// The real rule with batches recorded whole or in part: safe, and
/// recovers.
#[test]
fn real_ack_tracker_is_safe_and_recovers_with_batches() {
    check_real(|| AckModel::new(wals_two_endpoints(), 1).batches());
}

#[test]
fn broken_rule_batch_done_with_its_first_part_is_caught() {
    assert_caught_in(|| AckModel::<BatchDoneWithFirst>::new(wals_two_endpoints(), 1).batches());
}

/// A 207 that refuses some events: a rule that completes their jobs
/// before their dead-letter rows are written loses them at a crash in
/// between.
#[test]
fn broken_rule_refused_in_a_207_before_its_row_is_caught() {
    assert_caught_in(|| AckModel::<ParkedBeforeRow>::new(wals_two_endpoints(), 1).batches());
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
