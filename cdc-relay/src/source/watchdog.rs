//! The stream watchdog, on the side connection: it notices a stream that
//! is open but dead (a frozen walsender, a silent network path). After a
//! silence bound without any message from the server it asks whether the
//! walsender still reads our status updates. It reuses the
//! [`super::monitor`]'s reading when it is recent, so a healthy idle relay
//! costs no extra statements.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::catalog::{self, SlotReading};
use super::error::SourceError;
use crate::health::Health;

/// Silence worth a liveness check: the server's own timeout (it would
/// have dropped us by then), at least 3 status intervals, at least 5 s
/// when the server's timeout is disabled.
pub fn silence_bound(wal_sender_timeout: Duration, status_interval: Duration) -> Duration {
    let floor = (status_interval * 3).max(Duration::from_secs(1));
    if wal_sender_timeout.is_zero() {
        floor.max(Duration::from_secs(5))
    } else {
        wal_sender_timeout.max(floor)
    }
}

/// Watches one session's stream for silence.
///
/// It keeps the latest evidence that the stream is alive: a message from
/// the server, or a reading (the monitor's, or its own query) showing the
/// walsender read one of our status updates recently. An idle server sends
/// nothing while our replies reach it, so on an idle stream the readings
/// are the evidence. It checks half the silence bound before the evidence
/// would be too old (then every quarter bound), so `/readyz` — which fails
/// once the evidence is older than the bound — stays green on a healthy idle
/// stream even when the check itself is slow (a loaded host: a quarter bound
/// of margin was seen to run out), and fails on a dead one before the
/// session ends.
pub struct Watchdog {
    side: Arc<tokio_postgres::Client>,
    slot: String,
    silence: Duration,
    /// The latest evidence that the stream is alive.
    last_alive: Instant,
    last_check: Instant,
    readings: watch::Receiver<SlotReading>,
    health: Arc<Health>,
    /// The role-cannot-see warning was logged.
    blind_logged: bool,
}

impl Watchdog {
    /// A watchdog that tolerates `silence` without evidence of life.
    pub fn new(
        side: Arc<tokio_postgres::Client>,
        slot: String,
        silence: Duration,
        readings: watch::Receiver<SlotReading>,
        health: Arc<Health>,
    ) -> Self {
        let now = Instant::now();
        Watchdog {
            side,
            slot,
            silence,
            last_alive: now,
            last_check: now,
            readings,
            health,
            blind_logged: false,
        }
    }

    /// The server sent something: the stream is alive.
    pub fn heard(&mut self) {
        self.last_alive = Instant::now();
        self.health.heard();
    }

    /// When the next liveness check is due.
    pub fn deadline(&self) -> Instant {
        (self.last_alive + self.silence / 2).max(self.last_check + self.silence / 4)
    }

    /// `Ok` when the walsender serving our slot read a status update from
    /// us within the silence bound, or is visibly busy (decoding a large
    /// transaction, reading spilled changes: it reads replies only between
    /// steps). [`SourceError::Stalled`] when it is idle-waiting yet ignores
    /// us (a frozen process, a dead network path), or ignores us for 10
    /// silence bounds, or the side connection does not answer within 5 s.
    pub async fn check(&mut self) -> Result<(), SourceError> {
        let stalled = |why: String| Err(SourceError::Stalled(why));
        let cached = self
            .readings
            .borrow()
            .as_ref()
            .filter(|(at, _)| *at > self.last_check)
            .cloned();
        let (at, info) = match cached {
            Some((at, info)) => (at, Some(info)),
            None => match tokio::time::timeout(
                Duration::from_secs(5),
                catalog::slot_info(&self.side, &self.slot),
            )
            .await
            {
                Err(_) => return stalled("liveness query on the side connection timed out".into()),
                Ok(Err(e)) => return stalled(format!("liveness query failed: {e}")),
                Ok(Ok(info)) => (Instant::now(), info),
            },
        };
        self.last_check = Instant::now();
        let Some(info) = info.filter(|i| i.active_pid.is_some()) else {
            return stalled("no walsender holds the slot for this session".into());
        };
        let Some(age) = info.reply_age_secs else {
            // The role cannot see pg_stat_replication's details: no age to
            // judge by, and a made-up one would report false stalls. Count
            // the held slot as life, and say once what would do better.
            if !self.blind_logged {
                self.blind_logged = true;
                tracing::warn!(
                    "the relay's role cannot read pg_stat_replication.reply_time (it needs pg_read_all_stats, granted by sql/roles.sql): the stream watchdog can only check that a walsender holds the slot"
                );
            }
            self.last_alive = Instant::now();
            self.health.heard();
            return Ok(());
        };
        let replied = at
            .checked_sub(Duration::from_secs_f64(age.max(0.0)))
            .unwrap_or(at);
        if replied > self.last_alive {
            self.last_alive = replied;
            self.health.heard_ago(self.last_alive.elapsed());
        }
        let waiting = matches!(info.wait_event_type.as_deref(), Some("Activity" | "Client"));
        let bound = self.silence.as_secs_f64();
        if age > bound * 10.0 || (age > bound && waiting) {
            return stalled(format!(
                "the walsender has not read a status update for {age:.1} s"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_bound_follows_the_server_timeout() {
        let s = Duration::from_secs;
        assert_eq!(silence_bound(s(60), s(1)), s(60));
        assert_eq!(silence_bound(s(2), Duration::from_millis(666)), s(2));
        assert_eq!(silence_bound(Duration::ZERO, s(1)), s(5));
        assert_eq!(
            silence_bound(Duration::from_millis(500), Duration::from_millis(100)),
            s(1)
        );
    }
}
