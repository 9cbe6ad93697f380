//! The liveness checks (AG EF), over the explicit state graph: stateright's
//! `eventually` only sees acyclic paths, so the graph is explored with the
//! model's own transitions and a backward fixpoint from the goal states
//! finds any reachable state from which the goal cannot be reached.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use stateright::Model;

use crate::model::{AckModel, Action, State};
use crate::render::{Summary, render};
use crate::rules::Rule;

/// The explicit state graph of the recovery check.
pub(crate) struct Graph<R: Rule> {
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
pub(crate) struct Liveness<R: Rule> {
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
pub(crate) fn recovery<R: Rule>() -> Liveness<R> {
    Liveness {
        name: "recovery",
        allowed: |a| !matches!(a, Action::Crash | Action::SinkFails(_)),
        from: |_| true,
        goal: |m, s| m.goal(s),
    }
}

/// Parking's purpose (AG EF): from every reachable state where the second
/// endpoint is down, with no crash and that endpoint never back, some path
/// confirms the whole WAL.
pub(crate) fn moves_on_while_down<R: Rule>() -> Liveness<R> {
    Liveness {
        name: "the slot moves on while an endpoint is down",
        allowed: |a| !matches!(a, Action::Crash | Action::SinkRecovers(1)),
        from: |s| !s.sink_up[1],
        goal: |m, s| s.slot == m.wal_end(s),
    }
}

pub(crate) fn check_recovery<R: Rule>(model: &AckModel<R>) -> Result<usize, String> {
    check_liveness(model, &recovery())
}

/// Explores the whole graph breadth-first with the model's own transition
/// function, then runs a backward fixpoint from the goal states over the
/// allowed transitions. Returns the number of states, or a path to a start
/// state that cannot reach the goal and the best it can still reach.
pub(crate) fn check_liveness<R: Rule>(
    model: &AckModel<R>,
    l: &Liveness<R>,
) -> Result<usize, String> {
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
pub(crate) fn best_reachable<R: Rule>(
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
