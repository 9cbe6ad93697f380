//! `cdc_relay_status_updates_total{cause}`: the standby status updates the
//! replication transport sent, counted across sessions.

use std::sync::Arc;
use std::time::Duration;

use crate::metrics::Metrics;

/// Copies the transport's per-connection standby status counters into
/// `cdc_relay_status_updates_total{cause}` as deltas, so the relay's
/// counter keeps counting across sessions.
pub struct StatusUpdateCounter {
    transport: Arc<pgwire_replication::client::ReplicationMetrics>,
    metrics: Metrics,
    /// Counts already added, per cause.
    interval: u64,
    keepalive_reply: u64,
}

impl StatusUpdateCounter {
    /// Counts what `transport` reports into `metrics`.
    pub fn new(
        transport: Arc<pgwire_replication::client::ReplicationMetrics>,
        metrics: Metrics,
    ) -> Self {
        StatusUpdateCounter {
            transport,
            metrics,
            interval: 0,
            keepalive_reply: 0,
        }
    }

    /// Adds what was sent since the last sample. The transport counts every
    /// update in `feedback_sent` and the replies to a keepalive also in
    /// `keepalive_replies`; the rest went out on the status interval.
    fn sample(&mut self) {
        let replies = self.transport.keepalive_replies();
        let interval = self.transport.feedback_sent().saturating_sub(replies);
        for (cause, seen, now) in [
            ("keepalive_reply", &mut self.keepalive_reply, replies),
            ("interval", &mut self.interval, interval),
        ] {
            if now > *seen {
                self.metrics
                    .status_updates
                    .with_label_values(&[cause])
                    .inc_by(now - *seen);
                *seen = now;
            }
        }
    }
}

impl Drop for StatusUpdateCounter {
    /// Counts the session's last updates, the final one on shutdown included.
    fn drop(&mut self) {
        self.sample();
    }
}

/// Samples `counter` every second until the session aborts the task.
pub async fn count(mut counter: StatusUpdateCounter) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        counter.sample();
    }
}
