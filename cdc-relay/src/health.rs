//! Liveness and progress of the relay, shared between the pipeline (which
//! reports) and the admin endpoint (which answers `/readyz`).
//!
//! Ready means: streaming from the slot AND making progress — the confirmed
//! LSN advanced, or nothing was pending, within the ready window. A relay
//! stuck while events wait is alive but not ready.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Liveness and progress, shared between the relay and the admin endpoint.
#[derive(Debug)]
pub struct Health {
    started: Instant,
    streaming: AtomicBool,
    /// Milliseconds since `started` of the last progress (ack advanced or
    /// nothing pending).
    last_progress_ms: AtomicU64,
    ready_window: Duration,
}

impl Health {
    /// `ready_window`: how long events may wait without progress before
    /// `/readyz` fails.
    pub fn new(ready_window: Duration) -> Arc<Self> {
        Arc::new(Health {
            started: Instant::now(),
            streaming: AtomicBool::new(false),
            last_progress_ms: AtomicU64::new(0),
            ready_window,
        })
    }

    /// The replication stream started (`true`) or ended (`false`).
    pub fn set_streaming(&self, on: bool) {
        self.streaming.store(on, Ordering::Relaxed);
        if on {
            self.progress();
        }
    }

    /// The confirmed LSN advanced, or nothing is pending.
    pub fn progress(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_progress_ms.store(ms, Ordering::Relaxed);
    }

    /// Whether `/readyz` should answer 200, and why not.
    pub fn ready(&self) -> Result<(), &'static str> {
        if !self.streaming.load(Ordering::Relaxed) {
            return Err("not streaming from the slot");
        }
        let last = Duration::from_millis(self.last_progress_ms.load(Ordering::Relaxed));
        if self.started.elapsed().saturating_sub(last) > self.ready_window {
            return Err(
                "events are pending and the confirmed LSN has not advanced within the ready window",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_needs_streaming_and_progress() {
        let h = Health::new(Duration::from_secs(30));
        assert!(h.ready().is_err(), "not streaming yet");
        h.set_streaming(true);
        assert!(h.ready().is_ok());
        h.set_streaming(false);
        assert!(h.ready().is_err());

        let stale = Health::new(Duration::from_millis(1));
        stale.set_streaming(true);
        std::thread::sleep(Duration::from_millis(20));
        assert!(stale.ready().is_err(), "no progress within the window");
        stale.progress();
        assert!(stale.ready().is_ok());
    }
}
