//! Parking (`docs/architecture.md#parking`): an endpoint that holds the
//! slot back too long stops being delivered to; its pending and new events
//! are written to the dead-letter table with reason `parked`, so they count
//! as done and the slot moves on.
//!
//! An endpoint is parked when its oldest pending event has waited longer
//! than its `max_lag`, or when the slot's retained WAL exceeds
//! `--max-retained-wal` (then the endpoint holding the oldest pending
//! event, the one pinning the slot). [`verdict`] decides, free of I/O;
//! [`Park`] is the switch the dispatcher throws and the endpoint's
//! deliveries watch.
//!
//! The way back is [`crate::dispatch::resume`]: while parked, the
//! endpoint's parked rows are replayed oldest first, and the dispatcher
//! switches it back to live at a moment it has proven safe. With `resume =
//! "manual"` it stays parked for the life of the process; a relay starts an
//! endpoint parked while the dead-letter table holds parked rows of it.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

/// One endpoint's parking switch, shared by the dispatcher (which throws
/// it and turns it back) and the endpoint's deliveries (which watch it).
/// Cheap to clone.
#[derive(Clone, Debug)]
pub struct Park {
    /// Why the endpoint is parked; `None` while it is live.
    state: Arc<watch::Sender<Option<String>>>,
}

impl Default for Park {
    fn default() -> Self {
        Park {
            state: Arc::new(watch::Sender::new(None)),
        }
    }
}

impl Park {
    /// Parks the endpoint for reason `why` (kept in its dead letters);
    /// returns false when it already was.
    pub fn throw(&self, why: String) -> bool {
        self.state.send_if_modified(|s| {
            if s.is_some() {
                return false;
            }
            *s = Some(why);
            true
        })
    }

    /// Turns the endpoint back to live; returns false when it was not
    /// parked. Only the dispatcher calls it, at a moment the endpoint has
    /// no job running and no parked row left ([`crate::dispatch::resume`]).
    pub fn resume(&self) -> bool {
        self.state.send_if_modified(|s| s.take().is_some())
    }

    /// Whether the endpoint is parked.
    pub fn is_parked(&self) -> bool {
        self.state.borrow().is_some()
    }

    /// Completes once the endpoint is parked (at once if it is).
    pub async fn parked(&self) {
        let mut rx = self.state.subscribe();
        // The sender lives in `self`: the wait cannot fail.
        let _ = rx.wait_for(Option::is_some).await;
    }

    /// Why it is parked (empty while live).
    pub fn why(&self) -> String {
        self.state.borrow().clone().unwrap_or_default()
    }
}

/// What one endpoint looks like to [`verdict`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaneState {
    /// How long its oldest pending event has waited (`None`: none pending).
    pub oldest_pending: Option<Duration>,
    /// Its `max_lag` (`None`: never parked for lag).
    pub max_lag: Option<Duration>,
    /// Already parked.
    pub parked: bool,
}

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
/// lets the slot move, and later readings show whether that was enough).
pub fn verdict(lanes: &[LaneState], wal: Option<WalBudget>) -> Vec<(usize, String)> {
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
    let Some(w) = wal.filter(|w| w.retained > w.budget) else {
        return park;
    };
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
    park
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(age: Option<u64>, max: Option<u64>, parked: bool) -> LaneState {
        LaneState {
            oldest_pending: age.map(Duration::from_secs),
            max_lag: max.map(Duration::from_secs),
            parked,
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
        let v: Vec<usize> = verdict(&lanes, None).into_iter().map(|(i, _)| i).collect();
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
        assert!(verdict(&lanes, Some(under)).is_empty(), "at the budget");
        let over = WalBudget {
            retained: 101,
            budget: 100,
        };
        let v = verdict(&lanes, Some(over));
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].0, 1, "the oldest pending among the unparked: {v:?}");
        assert!(v[0].1.contains("--max-retained-wal"), "{}", v[0].1);
        let young = [lane(Some(29), None, false), lane(Some(3), None, false)];
        assert!(
            verdict(&young, Some(over)).is_empty(),
            "no endpoint stuck long enough to be the cause"
        );
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
