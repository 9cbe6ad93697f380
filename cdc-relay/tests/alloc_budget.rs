//! The hot path's budget: heap allocations and Tokio tasks spawned per
//! delivered event, counted, not timed (a count does not depend on how
//! busy the machine is).
//!
//! The pipeline is `hot_path`'s: pgoutput bytes decoded, mapped, admitted
//! to the window, dispatched, encoded, signed both ways and POSTed by the
//! real HTTP sink to an in-process server that answers 204, on one thread.
//! After a warm-up (connections opened, buffers grown) the test counts
//! every heap allocation of the process (`dhat`'s testing mode, the
//! global allocator of this test binary alone) while `EVENTS` more events
//! go through.
//! The count includes the in-process server's allocations: it is the
//! sink's side of each request, the same for every build of the relay.
//! Tasks are counted by `hot_path::run` (Tokio's task ids).
//!
//! The budget is the figure measured when it was set, with a little room:
//! a change that allocates more per event fails here, and either earns a
//! new figure (say why in `docs/benchmarks.md`) or is fixed.

mod hot_path;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// Events counted (after the warm-up).
const EVENTS: u64 = 2_000;
/// Events of the warm-up, not counted.
const WARM_UP: u64 = 500;
/// Heap allocations per delivered event at most: the relay's and the
/// in-process server's together. Measured when set (see the module doc
/// and `docs/benchmarks.md`, "allocations per event").
const BUDGET_PER_EVENT: f64 = 50.0;
/// Tokio tasks spawned per delivered event at most, after the warm-up:
/// none. Deliveries run on the lanes' workers, started during the warm-up,
/// and the connections (each driven by the delivery that holds it on the
/// relay's side, a task of the server's) are open by then; a task per event, per request or per answer fails here.
const TASKS_PER_EVENT: f64 = 0.0;

#[test]
fn allocations_per_delivered_event_stay_within_the_budget() {
    let _profiler = dhat::Profiler::builder().testing().build();
    let counted = hot_path::run(WARM_UP, EVENTS, || dhat::HeapStats::get().total_blocks);
    let (allocations, tasks) = (counted.measured, counted.tasks_spawned);
    let events = EVENTS;
    let per_event = allocations as f64 / events as f64;
    println!(
        "{allocations} heap allocations for {events} delivered events: {per_event:.1} per event (budget {BUDGET_PER_EVENT})"
    );
    assert!(
        per_event <= BUDGET_PER_EVENT,
        "{per_event:.1} allocations per delivered event, over the budget of {BUDGET_PER_EVENT}: \
         find the new allocations on the hot path (decode, map, dispatch, encode, sign, send)"
    );
    let tasks_per_event = tasks as f64 / events as f64;
    println!(
        "{tasks} tasks spawned for {events} delivered events (budget {TASKS_PER_EVENT} per event)"
    );
    assert!(
        tasks_per_event <= TASKS_PER_EVENT,
        "{tasks} Tokio tasks spawned for {events} delivered events ({tasks_per_event:.2} per event), \
         over the budget of {TASKS_PER_EVENT}: something on the hot path spawns per event"
    );
}
