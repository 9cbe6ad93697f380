//! A rate cap shared by concurrent senders: at most `rate` starts per
//! second, evenly spaced (no bursts), in tokio's clock (so it runs in
//! paused time in unit tests).

use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::{Interval, MissedTickBehavior};

/// The lowest rate accepted anywhere (`rate`, `--rate`): one request per
/// 1,000 s. Below it a period no longer fits a timer.
pub const MIN_RATE: f64 = 0.001;

/// The highest rate accepted: above it, a cap caps nothing.
pub const MAX_RATE: f64 = 1_000_000.0;

/// Whether `r` requests per second is a rate [`Pacer`] takes.
pub fn valid_rate(r: f64) -> bool {
    (MIN_RATE..=MAX_RATE).contains(&r)
}

/// Paces request starts to at most a rate. Waiters queue in turn (the
/// lock is fair), each taking the next tick.
#[derive(Debug)]
pub struct Pacer(Mutex<Interval>);

impl Pacer {
    /// At most `per_second` starts per second (clamped to [`MIN_RATE`]..=
    /// [`MAX_RATE`]; a NaN is the minimum). The first start goes at once;
    /// after a quiet spell the pace restarts from then, with no burst to
    /// catch up.
    ///
    /// # Panics
    /// Outside a tokio runtime (it makes a tokio timer).
    pub fn new(per_second: f64) -> Self {
        let r = if per_second.is_nan() {
            MIN_RATE
        } else {
            per_second.clamp(MIN_RATE, MAX_RATE)
        };
        let mut i = tokio::time::interval(Duration::from_secs_f64(1.0 / r));
        i.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Pacer(Mutex::new(i))
    }

    /// Waits for this caller's turn.
    pub async fn wait(&self) {
        self.0.lock().await.tick().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tokio::time::Instant;

    #[tokio::test]
    async fn rates_outside_the_range_are_refused_and_clamped() {
        for bad in [0.0, 1e-20, -1.0, f64::NAN, f64::INFINITY, 2e6] {
            assert!(!valid_rate(bad), "{bad}");
            let _ = Pacer::new(bad); // no panic
        }
        assert!(valid_rate(MIN_RATE) && valid_rate(2.5) && valid_rate(MAX_RATE));
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_waiters_share_one_rate() {
        let pace = Arc::new(Pacer::new(10.0));
        let t0 = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let pace = Arc::clone(&pace);
            tasks.spawn(async move {
                for _ in 0..5 {
                    pace.wait().await;
                }
            });
        }
        while tasks.join_next().await.is_some() {}
        // 40 starts at 10/s: the first at once, the last 3.9 s later.
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(3900) && took < Duration::from_millis(4000),
            "{took:?}"
        );
    }
}
