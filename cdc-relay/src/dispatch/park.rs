//! Parking (`docs/architecture.md#parking`): an endpoint that holds the
//! slot back too long stops being delivered to; its pending and new events
//! are written to the dead-letter table with reason `parked`, so they count
//! as done and the slot moves on.
//!
//! An endpoint is parked when its oldest pending event has waited longer
//! than its `max_lag`; when the slot's retained WAL exceeds
//! `--max-retained-wal` (then the endpoint holding the oldest pending
//! event, the one pinning the slot); or when the source spent at least
//! half of the last [`WINDOW_STALL_SPAN`] waiting for room in the window
//! and one endpoint alone holds more than its share of it (the one holding
//! the most), which is what gives each endpoint its own window share.
//! [`verdict`] decides, free of I/O; [`Park`] is the switch the dispatcher
//! throws and the endpoint's deliveries watch; `Parking` is the
//! dispatcher's side, which gathers each endpoint's state once a second and
//! throws the switches.
//!
//! The way back is [`crate::dispatch::resume`]: while parked, the
//! endpoint's parked rows are replayed oldest first, and the dispatcher
//! switches it back to live at a moment it has proven safe. With `resume =
//! "manual"` it stays parked for the life of the process; a relay starts an
//! endpoint parked while the dead-letter table holds parked rows of it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::lane::Lane;
pub use super::lane::Park;
use super::scheduler::Scheduler;
use super::{RetainedWal, Window};
use crate::ack::Position;

/// What one endpoint looks like to [`verdict`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaneState {
    /// How long its oldest pending event has waited (`None`: none pending).
    pub oldest_pending: Option<Duration>,
    /// Its `max_lag` (`None`: never parked for lag).
    pub max_lag: Option<Duration>,
    /// Already parked.
    pub parked: bool,
    /// Events of the window only this endpoint still has to finish (its
    /// jobs, queued, running or with the writer, whose event is done at
    /// every other endpoint: [`Scheduler::lane_exclusive`]).
    pub exclusive: usize,
}

/// The window as [`verdict`] sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowFull {
    /// The time the source spent waiting for room during the last `span`.
    pub stalled: Duration,
    /// How far back `stalled` was measured (about [`WINDOW_STALL_SPAN`]).
    pub span: Duration,
    /// Events the window holds.
    pub held: usize,
}

impl WindowFull {
    /// Whether the source was held up: it waited at least half of a span
    /// of at least [`WINDOW_STALL_MIN_SPAN`].
    pub fn held_up(&self) -> bool {
        self.span >= WINDOW_STALL_MIN_SPAN && self.stalled * 2 >= self.span
    }
}

/// An endpoint holding more than its share of the window is parked once
/// the source has spent at least half of this long waiting for room: a
/// burst the endpoints clear sooner parks nobody, and the others wait
/// about this long (plus a tick) for a stuck endpoint. Half, not all: an
/// endpoint that is slow rather than stopped lets the source in now and
/// then, one event per event it finishes.
pub const WINDOW_STALL_SPAN: Duration = Duration::from_secs(2);

/// The shortest span a [`WindowFull`] reading may cover: the dispatcher
/// samples once a second, so a span meant to be [`WINDOW_STALL_SPAN`] is
/// 1.5 s to 2.5 s.
pub const WINDOW_STALL_MIN_SPAN: Duration = Duration::from_millis(1500);

/// The slot's retained WAL and the budget, bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WalBudget {
    /// `pg_current_wal_lsn() - restart_lsn` at the monitor's last reading.
    pub retained: u64,
    /// `--max-retained-wal`.
    pub budget: u64,
}

/// Over the WAL budget, an endpoint is parked only if its oldest pending
/// event has waited at least this long: `restart_lsn` moves some time after
/// the confirmed position does (at the server's next running-transactions
/// record, every 15 s or at a checkpoint), so a reading just after a
/// parking may still be over the budget, and the next endpoint in line
/// must not pay for that if it is merely busy.
pub const BUDGET_MIN_AGE: Duration = Duration::from_secs(30);

/// The endpoints to park now, by index, each with why. An endpoint past
/// its `max_lag` is parked; over the WAL budget (`wal`: a fresh reading),
/// the unparked endpoint with the oldest pending event is, if that event
/// has waited at least [`BUDGET_MIN_AGE`] (one per reading: parking it
/// lets the slot move, and later readings show whether that was enough);
/// with the source held up by a full window (`window`: it waited at least
/// half of the span, the span at least [`WINDOW_STALL_MIN_SPAN`]), the
/// unparked endpoint with the most [`LaneState::exclusive`] events is, if
/// that is more than its share — the window divided among the endpoints
/// not parked — and it is not the last of them (one per call: its events
/// leave the window as they are parked, and the caller measures a fresh
/// span before the next).
///
/// Endpoints that are equally slow on the same events hold a full window
/// together (an event routed to several is held by none of them alone), so
/// none is parked: the relay is at its capacity, not held back by one
/// endpoint.
pub fn verdict(
    lanes: &[LaneState],
    wal: Option<WalBudget>,
    window: Option<WindowFull>,
) -> Vec<(usize, String)> {
    let mut park: Vec<(usize, String)> = lanes
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.parked)
        .filter_map(|(i, l)| match (l.oldest_pending, l.max_lag) {
            (Some(age), Some(max)) if age > max => Some((
                i,
                format!(
                    "its oldest pending event waited {:.1}s, more than its max_lag {}",
                    age.as_secs_f64(),
                    humantime::format_duration(max)
                ),
            )),
            _ => None,
        })
        .collect();
    if let Some(w) = wal.filter(|w| w.retained > w.budget) {
        let oldest = lanes
            .iter()
            .enumerate()
            .filter(|(i, l)| !l.parked && !park.iter().any(|(p, _)| p == i))
            .filter_map(|(i, l)| l.oldest_pending.map(|age| (age, i)))
            .max()
            .filter(|(age, _)| *age >= BUDGET_MIN_AGE);
        if let Some((_, i)) = oldest {
            park.push((
                i,
                format!(
                    "the slot retains {} bytes of WAL, more than --max-retained-wal {} bytes, and this endpoint holds the oldest pending event",
                    w.retained, w.budget
                ),
            ));
        }
    }
    let live: Vec<(usize, &LaneState)> = lanes
        .iter()
        .enumerate()
        .filter(|(i, l)| !l.parked && !park.iter().any(|(p, _)| p == i))
        .collect();
    if let Some(w) = window.filter(WindowFull::held_up)
        && live.len() > 1
    {
        let most = live
            .iter()
            .map(|(i, l)| (l.exclusive, *i))
            .max()
            .filter(|(held, _)| held * live.len() > w.held);
        if let Some((held, i)) = most {
            park.push((
                i,
                format!(
                    "the source waited {:.1}s of the last {:.1}s for room in the window (--max-pending-events, --max-pending-bytes) and this endpoint alone held {held} of the window's {} events, more than its share (1/{}, the endpoints not parked)",
                    w.stalled.as_secs_f64(),
                    w.span.as_secs_f64(),
                    w.held,
                    live.len()
                ),
            ));
        }
    }
    park
}

/// The dispatcher's side of parking: what it watches (the WAL budget, the
/// window) and the switches it throws.
pub(super) struct Parking {
    wal_budget: Option<RetainedWal>,
    window: Option<Window>,
    /// [`Window::waited`] at past checks, oldest first, back to the newest
    /// about [`WINDOW_STALL_SPAN`] old; cleared by a parking.
    waited: VecDeque<(Instant, Duration)>,
}

impl Parking {
    pub(super) fn new(wal_budget: Option<RetainedWal>, window: Option<Window>) -> Self {
        Parking {
            wal_budget,
            window,
            waited: VecDeque::new(),
        }
    }

    /// How much the source waited for room in the window over about the
    /// last [`WINDOW_STALL_SPAN`]; `None`: the window is not watched,
    /// or not watched for that long since the start or the last parking.
    fn window_full(&mut self) -> Option<WindowFull> {
        let w = self.window.as_ref()?;
        let now = Instant::now();
        let waited = w.waited();
        self.waited.push_back((now, waited));
        while self
            .waited
            .get(1)
            .is_some_and(|(at, _)| now - *at >= WINDOW_STALL_MIN_SPAN)
        {
            self.waited.pop_front();
        }
        let (at, then) = *self.waited.front()?;
        let span = now - at;
        (span >= WINDOW_STALL_MIN_SPAN).then(|| WindowFull {
            stalled: waited.saturating_sub(then),
            span,
            held: w.held(),
        })
    }

    /// Parks the lanes [`verdict`] names, logging each, and returns them.
    /// The WAL budget is checked once per new reading of the slot monitor.
    pub(super) fn check<P: Position, W, S>(
        &mut self,
        scheduler: &Scheduler<P, W>,
        lanes: &[Arc<Lane<S>>],
    ) -> Vec<usize> {
        let window = self.window_full();
        // What each lane holds alone is counted (over its jobs) only when
        // it can matter.
        let counted = window.as_ref().is_some_and(WindowFull::held_up);
        let states: Vec<LaneState> = lanes
            .iter()
            .enumerate()
            .map(|(i, l)| LaneState {
                oldest_pending: scheduler.lane_oldest_pending_since(i).map(|t| t.elapsed()),
                max_lag: l.cfg.max_lag,
                parked: l.park.is_parked(),
                exclusive: if counted {
                    scheduler.lane_exclusive(i)
                } else {
                    0
                },
            })
            .collect();
        let wal = self.wal_budget.as_mut().and_then(|w| {
            if !w.retained.has_changed().unwrap_or(false) {
                return None;
            }
            let retained = (*w.retained.borrow_and_update())?;
            Some(WalBudget {
                retained,
                budget: w.budget,
            })
        });
        let mut thrown = Vec::new();
        for (i, why) in verdict(&states, wal, window) {
            let lane = &lanes[i];
            if lane.park.throw(why) {
                lane.metrics.parked.set(1);
                let back = if lane.cfg.auto_resume {
                    "the relay replays them and returns it to live delivery once the endpoint answers again"
                } else {
                    "it stays parked (resume = \"manual\") until they are replayed with the relay stopped"
                };
                tracing::error!(
                    endpoint = %lane.name, why = %lane.park.why(), pending = scheduler.lane_pending(i),
                    "endpoint parked: its pending and new events go to the dead-letter table with reason \"parked\" so the slot moves on; \
                     {back} (docs/operations.md#a-parked-endpoint)"
                );
                thrown.push(i);
            }
        }
        if !thrown.is_empty() {
            // The parked endpoint's events now leave the window: whether
            // another endpoint holds more than its share is for a fresh
            // span to show (a healthy one must not be parked a second
            // after the culprit, on the stale one).
            self.waited.clear();
        }
        thrown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(age: Option<u64>, max: Option<u64>, parked: bool) -> LaneState {
        LaneState {
            oldest_pending: age.map(Duration::from_secs),
            max_lag: max.map(Duration::from_secs),
            parked,
            exclusive: 0,
        }
    }

    #[test]
    fn lag_parks_only_the_endpoint_past_its_max_lag() {
        let lanes = [
            lane(Some(61), Some(60), false),
            lane(Some(600), None, false),
            lane(Some(60), Some(60), false),
            lane(Some(900), Some(60), true),
        ];
        let v: Vec<usize> = verdict(&lanes, None, None)
            .into_iter()
            .map(|(i, _)| i)
            .collect();
        assert_eq!(
            v,
            [0],
            "no max_lag, at the limit, or already parked: not parked"
        );
    }

    #[test]
    fn over_the_wal_budget_the_oldest_pending_endpoint_is_parked() {
        let lanes = [
            lane(Some(5), None, false),
            lane(Some(50), None, false),
            lane(None, None, false),
            lane(Some(500), None, true),
        ];
        let under = WalBudget {
            retained: 100,
            budget: 100,
        };
        assert!(
            verdict(&lanes, Some(under), None).is_empty(),
            "at the budget"
        );
        let over = WalBudget {
            retained: 101,
            budget: 100,
        };
        let v = verdict(&lanes, Some(over), None);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].0, 1, "the oldest pending among the unparked: {v:?}");
        assert!(v[0].1.contains("--max-retained-wal"), "{}", v[0].1);
        let young = [lane(Some(29), None, false), lane(Some(3), None, false)];
        assert!(
            verdict(&young, Some(over), None).is_empty(),
            "no endpoint stuck long enough to be the cause"
        );
    }

    #[test]
    fn with_the_window_full_the_endpoint_holding_more_than_its_share_is_parked() {
        let holding = |exclusive, parked| LaneState {
            exclusive,
            ..lane(Some(5), None, parked)
        };
        let full = |secs, held| WindowFull {
            stalled: Duration::from_secs(secs),
            span: Duration::from_secs(2),
            held,
        };
        let lanes = [
            holding(10, false),
            holding(700, true),
            holding(340, false),
            holding(20, false),
        ];
        let v = verdict(&lanes, None, Some(full(2, 1000)));
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].0, 2, "the most held alone, among the unparked");
        assert!(
            v[0].1.contains("340 of the window's 1000") && v[0].1.contains("(1/3,"),
            "shared by the three not parked: {}",
            v[0].1
        );
        assert!(
            verdict(&lanes, None, Some(full(1, 1000))).len() == 1,
            "held up half the span: a slow endpoint"
        );
        let burst = WindowFull {
            stalled: Duration::from_millis(999),
            ..full(0, 1000)
        };
        assert!(verdict(&lanes, None, Some(burst)).is_empty(), "a burst");
        let early = WindowFull {
            span: Duration::from_millis(1400),
            ..full(1, 1000)
        };
        assert!(
            verdict(&lanes, None, Some(early)).is_empty(),
            "too soon to tell"
        );
        let even = [holding(250, false), holding(250, false)];
        assert!(
            verdict(&even, None, Some(full(2, 500))).is_empty(),
            "at its share, not above"
        );
        let fanned = [holding(0, false), holding(0, false), holding(3, false)];
        assert!(
            verdict(&fanned, None, Some(full(2, 1000))).is_empty(),
            "equally slow on the same events: at capacity, nobody to blame"
        );
        let alone = [holding(1000, false)];
        assert!(
            verdict(&alone, None, Some(full(2, 1000))).is_empty(),
            "one endpoint has nobody to be isolated from"
        );
        let last = [holding(10, true), holding(990, false)];
        assert!(
            verdict(&last, None, Some(full(2, 1000))).is_empty(),
            "nor has the last one not parked"
        );
        let lagging = [
            LaneState {
                exclusive: 900,
                ..lane(Some(61), Some(60), false)
            },
            holding(800, false),
            holding(0, false),
        ];
        let v = verdict(&lagging, None, Some(full(2, 1000)));
        let parked: Vec<usize> = v.iter().map(|(i, _)| *i).collect();
        assert_eq!(
            parked,
            [0, 1],
            "one for lag, then the most of the two left: {v:?}"
        );
        let v = verdict(&lagging[..2], None, Some(full(2, 1000)));
        assert_eq!(v.len(), 1, "one for lag; the other is the last: {v:?}");
    }

    #[test]
    fn a_switch_is_thrown_once_until_it_is_turned_back() {
        let p = Park::default();
        assert!(!p.is_parked());
        assert!(!p.resume(), "not parked");
        assert!(p.throw("first".into()));
        assert!(!p.throw("second".into()));
        assert!(p.is_parked());
        assert_eq!(p.why(), "first");
        assert!(p.resume());
        assert!(!p.is_parked());
        assert_eq!(p.why(), "");
        assert!(p.throw("third".into()));
        assert_eq!(p.why(), "third");
    }

    #[tokio::test]
    async fn a_wait_for_the_switch_ends_when_it_is_thrown() {
        let p = Park::default();
        let waiting = tokio::spawn({
            let p = p.clone();
            async move { p.parked().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        p.throw("now".into());
        waiting.await.unwrap();
        p.parked().await; // at once while parked
    }
}
