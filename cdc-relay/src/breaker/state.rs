//! The breaker's state behind its lock, and the admissions it numbers.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use tokio::time::Instant;

use super::CircuitState;

#[derive(Debug)]
pub(super) struct State {
    pub(super) circuit: CircuitState,
    pub(super) consecutive_failures: u32,
    pub(super) next_probe_at: Instant,
    pub(super) probe_in_flight: bool,
    /// Deliveries waiting to be admitted: their place in the queue (the
    /// order they began waiting in) and their sequence number.
    pub(super) waiting: BTreeMap<u64, u64>,
    /// The next place in the queue of `waiting`.
    pub(super) next_place: u64,
    /// Distinct events with a poison verdict since the last 2xx.
    pub(super) poison_run: HashSet<String>,
    /// Admissions given so far ([`Admission`]'s number).
    pub(super) admitted: u64,
    /// The last admission number given before the run's first poison
    /// verdict: a 2xx to a request admitted up to then is stale.
    pub(super) run_after: u64,
    pub(super) storm: bool,
    /// No attempt may start before this instant (a sink's `Retry-After`).
    pub(super) paused_until: Option<Instant>,
    /// The sink has answered (2xx or a poison verdict) since the last
    /// failure, or since this breaker was made. Until then one attempt at a
    /// time goes out: a relay that starts while the sink is down must not
    /// send its whole window to it.
    pub(super) proven: bool,
    /// The sink has answered at least once in this session. Until then
    /// attempts are paced like an open circuit's probes.
    pub(super) answered: bool,
    /// When the oldest attempt admitted since the sink's last answer (of
    /// any kind) was admitted; `None` when every admitted attempt since has
    /// been answered. Older than [`Breaker::silence`](super::Breaker::silence): the sink has gone
    /// silent (a black hole, a hung server), and the attempts it holds have
    /// not failed yet (they wait for their request timeout), so no more
    /// are admitted than in slow start.
    pub(super) unanswered_since: Option<Instant>,
    /// While open: when it opened, the probes failed since, and when the
    /// last "still open" line was logged (or it opened).
    pub(super) open: Option<OpenSpell>,
    /// The last answer was 410 Gone (until a 2xx).
    pub(super) retired: bool,
}

impl State {
    /// A closed circuit that knows nothing of its sink yet.
    pub(super) fn closed() -> Self {
        State {
            circuit: CircuitState::Closed,
            consecutive_failures: 0,
            next_probe_at: Instant::now(),
            probe_in_flight: false,
            waiting: BTreeMap::new(),
            next_place: 0,
            poison_run: HashSet::new(),
            admitted: 0,
            run_after: 0,
            storm: false,
            paused_until: None,
            proven: false,
            answered: false,
            unanswered_since: None,
            open: None,
            retired: false,
        }
    }

    /// The next admission, numbered.
    pub(super) fn admission(&mut self, probe: bool) -> Admission {
        self.admitted += 1;
        Admission {
            probe,
            number: self.admitted,
        }
    }

    /// Puts delivery `seq` in the queue of waiting deliveries, at `place`
    /// when it has one, else at the end (and records that place in
    /// `place`); returns its place.
    pub(super) fn queue(&mut self, place: &mut Option<u64>, seq: u64) -> u64 {
        let mine = *place.get_or_insert_with(|| {
            self.next_place += 1;
            self.next_place
        });
        self.waiting.insert(mine, seq);
        mine
    }
}

/// How long the circuit has been open, for the periodic "still open" log.
#[derive(Clone, Copy, Debug)]
pub(super) struct OpenSpell {
    pub(super) since: Instant,
    pub(super) failed_probes: u32,
    pub(super) logged: Instant,
}

/// While the circuit stays open, a warning says so this often (the
/// "opened" line alone scrolls away in a long outage).
pub const STILL_OPEN_LOG_EVERY: Duration = Duration::from_secs(60);

impl OpenSpell {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            since: now,
            failed_probes: 0,
            logged: now,
        }
    }

    /// Counts a failed probe; returns how long the circuit has been open
    /// and the probes failed when a "still open" line is due.
    pub(super) fn probe_failed(&mut self, now: Instant) -> Option<(Duration, u32)> {
        self.failed_probes = self.failed_probes.saturating_add(1);
        (now.duration_since(self.logged) >= STILL_OPEN_LOG_EVERY).then(|| {
            self.logged = now;
            (now.duration_since(self.since), self.failed_probes)
        })
    }
}

/// How a delivery was admitted, and when: admissions are numbered in the
/// order [`Breaker::admit`](super::Breaker::admit) gave them (the storm guard tells a 2xx to a
/// request sent before a run of refusals began from one sent after).
/// Two admissions are equal when of the same kind.
#[derive(Copy, Clone, Debug)]
pub struct Admission {
    pub(super) probe: bool,
    pub(super) number: u64,
}

impl PartialEq for Admission {
    fn eq(&self, other: &Self) -> bool {
        self.probe == other.probe
    }
}

impl Eq for Admission {}

impl Admission {
    /// The only attempt allowed now: the circuit is open, or the sink has
    /// not answered since the last failure or since start (slow start).
    /// `false`: the circuit is closed.
    pub fn is_probe(self) -> bool {
        self.probe
    }
}

#[cfg(test)]
impl Admission {
    /// Admitted with the circuit closed, after every other admission.
    pub const NORMAL: Admission = Admission {
        probe: false,
        number: u64::MAX,
    };
    /// A probe, admitted after every other admission.
    pub const PROBE: Admission = Admission {
        probe: true,
        number: u64::MAX,
    };
}
