//! A rate cap shared by concurrent senders: at most `rate` starts per
//! second, evenly spaced (no bursts), in tokio's clock (so it runs in
//! paused time in unit tests).

use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::{Interval, MissedTickBehavior};

/// Paces request starts to at most a rate. Waiters queue in turn (the
/// lock is fair), each taking the next tick.
#[derive(Debug)]
pub struct Pacer(Mutex<Interval>);

impl Pacer {
    /// At most `per_second` starts per second (above 0). The first start
    /// goes at once; after a quiet spell the pace restarts from then, with
    /// no burst to catch up.
    pub fn new(per_second: f64) -> Self {
        let mut i = tokio::time::interval(Duration::from_secs_f64(1.0 / per_second));
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
