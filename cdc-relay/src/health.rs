//! Liveness and progress of the relay, shared between the pipeline (which
//! reports) and the admin endpoint (which answers `/readyz`).
//!
//! Ready means: streaming from the slot AND making progress — the confirmed
//! LSN advanced, or nothing was pending, within the ready window. A relay
//! stuck while events wait is alive but not ready.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Not ready: no word from the server within the silence bound.
const SILENT: &str = "no message from the server within the silence bound (wal_sender_timeout): the stream may be dead";

/// Not ready: events wait and the confirmed LSN does not move.
const NO_PROGRESS: &str =
    "events are pending and the confirmed LSN has not advanced within the ready window";

/// Liveness and progress, shared between the relay and the admin endpoint.
#[derive(Debug)]
pub struct Health {
    started: Instant,
    streaming: AtomicBool,
    /// The outbox is in a streamed publication (as last read).
    publication_ok: AtomicBool,
    /// The server withholds the stream (as last read).
    withheld: AtomicBool,
    /// A publication gap is owed a backfill (`--on-gap tell`, as last read).
    gap_owed: AtomicBool,
    /// The dead-letter writer's statement fails (and is retried): the
    /// event it holds, and every event behind it, wait.
    dead_letters_failing: AtomicBool,
    /// Milliseconds since `started` when the server last sent anything (or
    /// the watchdog found the walsender reading our replies).
    last_heard_ms: AtomicU64,
    /// Silence after which `/readyz` fails, milliseconds (the watchdog's
    /// bound for the current session; 0 before the first).
    silence_bound_ms: AtomicU64,
    /// Milliseconds since `started` of the last progress (ack advanced or
    /// nothing pending).
    last_progress_ms: AtomicU64,
    ready_window: Duration,
    /// Set when the relay stopped for good and lingers (`--on-fatal
    /// linger`): why, for `/readyz`.
    halted: OnceLock<String>,
}

impl Health {
    /// `ready_window`: how long events may wait without progress before
    /// `/readyz` fails.
    pub fn new(ready_window: Duration) -> Arc<Self> {
        Arc::new(Health {
            started: Instant::now(),
            streaming: AtomicBool::new(false),
            publication_ok: AtomicBool::new(true),
            withheld: AtomicBool::new(false),
            gap_owed: AtomicBool::new(false),
            dead_letters_failing: AtomicBool::new(false),
            last_heard_ms: AtomicU64::new(0),
            silence_bound_ms: AtomicU64::new(0),
            last_progress_ms: AtomicU64::new(0),
            ready_window,
            halted: OnceLock::new(),
        })
    }

    /// The relay stopped for good (exit code `code`, `why` its error) and
    /// the process lingers: `/readyz` fails with this until it exits.
    pub fn halt(&self, code: u8, why: &str) {
        let _ = self
            .halted
            .set(format!("halted with exit code {code}: {why}"));
    }

    /// Why the relay halted, when it did.
    pub fn halted(&self) -> Option<&str> {
        self.halted.get().map(String::as_str)
    }

    /// The replication stream started (`true`) or ended (`false`); while
    /// it runs, more than `silence_bound` without a word from the server
    /// makes the relay not ready.
    pub fn set_streaming(&self, on: bool, silence_bound: Duration) {
        self.streaming.store(on, Ordering::Relaxed);
        if on {
            let bound = u64::try_from(silence_bound.as_millis()).unwrap_or(u64::MAX);
            self.silence_bound_ms.store(bound, Ordering::Relaxed);
            self.progress();
            self.heard();
        }
    }

    /// Whether a replication stream runs now.
    pub fn is_streaming(&self) -> bool {
        self.streaming.load(Ordering::Relaxed)
    }

    /// The server sent something (or proved alive): resets the silence.
    pub fn heard(&self) {
        self.last_heard_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// The stream was last known alive `ago` (a reading showed the
    /// walsender reading our replies); never moves the evidence back.
    pub fn heard_ago(&self, ago: Duration) {
        let at = self
            .now_ms()
            .saturating_sub(u64::try_from(ago.as_millis()).unwrap_or(u64::MAX));
        self.last_heard_ms.fetch_max(at, Ordering::Relaxed);
    }

    /// Time since the stream was last known alive.
    pub fn since_heard(&self) -> Duration {
        let last = self.last_heard_ms.load(Ordering::Relaxed);
        Duration::from_millis(self.now_ms().saturating_sub(last))
    }

    /// The slot monitor read whether the outbox is in its publication.
    pub fn set_publication_ok(&self, ok: bool) {
        self.publication_ok.store(ok, Ordering::Relaxed);
    }

    /// The slot monitor found the server withholding the stream (or no
    /// longer).
    pub fn set_withheld(&self, withheld: bool) {
        self.withheld.store(withheld, Ordering::Relaxed);
    }

    /// The slot monitor found a publication gap no backfill has covered
    /// yet (`true`), or a backfill covered it (`false`).
    pub fn set_gap_owed(&self, owed: bool) {
        self.gap_owed.store(owed, Ordering::Relaxed);
    }

    /// The dead-letter writer's statement failed (`true`, retried) or
    /// committed (`false`).
    pub fn set_dead_letters_failing(&self, failing: bool) {
        self.dead_letters_failing.store(failing, Ordering::Relaxed);
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The confirmed LSN advanced, or nothing is pending.
    pub fn progress(&self) {
        self.last_progress_ms
            .store(self.now_ms(), Ordering::Relaxed);
    }

    /// Whether a reason of [`Health::ready`] is a stall (the server's
    /// silence, no progress) that a failing sink also explains.
    pub fn is_stall(why: &str) -> bool {
        why == SILENT || why == NO_PROGRESS
    }

    /// Whether `/readyz` should answer 200, and why not.
    pub fn ready(&self) -> Result<(), &'static str> {
        if !self.streaming.load(Ordering::Relaxed) {
            return Err("not streaming from the slot");
        }
        if !self.publication_ok.load(Ordering::Relaxed) {
            return Err(
                "the publication does not carry all of the outbox's inserts (the table left it, is UNLOGGED, or the publication skips inserts or filters rows): they are not streamed (the log says which and the fix)",
            );
        }
        if self.gap_owed.load(Ordering::Relaxed) {
            return Err(
                "outbox rows inserted during a publication gap were not streamed, or may not have been, and no backfill has re-sent them: run the `cdc-relay backfill` the log and `cdc-relay status` give (ready again once a backfill covering the gap completes)",
            );
        }
        if self.dead_letters_failing.load(Ordering::Relaxed) {
            return Err(
                "dead-letter rows cannot be written (retried): the events they hold, and every event behind them, wait (see the log)",
            );
        }
        if self.withheld.load(Ordering::Relaxed) {
            return Err(
                "the server withholds the stream: its walsender sends nothing new while the WAL goes on (see the log and `cdc-relay status`)",
            );
        }
        let bound = self.silence_bound_ms.load(Ordering::Relaxed);
        if bound > 0 && self.since_heard() > Duration::from_millis(bound) {
            return Err(SILENT);
        }
        let last = Duration::from_millis(self.last_progress_ms.load(Ordering::Relaxed));
        if self.started.elapsed().saturating_sub(last) > self.ready_window {
            return Err(NO_PROGRESS);
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
        h.set_streaming(true, Duration::from_secs(60));
        assert!(h.ready().is_ok());
        h.set_publication_ok(false);
        assert!(h.ready().unwrap_err().contains("publication"));
        h.set_publication_ok(true);
        h.set_dead_letters_failing(true);
        assert!(h.ready().unwrap_err().contains("dead-letter rows"));
        h.set_dead_letters_failing(false);
        assert!(h.ready().is_ok());
        h.set_streaming(false, Duration::ZERO);
        assert!(h.ready().is_err());

        let silent = Health::new(Duration::from_secs(30));
        silent.set_streaming(true, Duration::from_millis(10));
        std::thread::sleep(Duration::from_millis(30));
        assert!(silent.ready().unwrap_err().contains("silence"));
        silent.heard();
        assert!(silent.ready().is_ok());

        let stale = Health::new(Duration::from_millis(1));
        stale.set_streaming(true, Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(20));
        assert!(stale.ready().is_err(), "no progress within the window");
        stale.progress();
        assert!(stale.ready().is_ok());
    }
}
