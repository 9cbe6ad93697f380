//! The server's clock against this machine's, watched on every stream
//! message (`crate::clock`): the `cdc_relay_clock_skew_seconds` gauge, and a
//! WARN while they are [`SKEW_WARN`] or more apart.

use std::time::Duration;

use tokio::time::Instant;

use crate::clock::{self, SKEW_WARN};

/// How often the WARN repeats while the clocks stay apart.
const WARN_EVERY: Duration = Duration::from_secs(600);

/// Watches the skew of one session's stream.
pub struct SkewWatch {
    gauge: prometheus::Gauge,
    /// When the WARN was last logged; `None` while the clocks agree.
    warned: Option<Instant>,
}

impl SkewWatch {
    /// A watch that sets `gauge` (seconds).
    pub fn new(gauge: prometheus::Gauge) -> Self {
        SkewWatch {
            gauge,
            warned: None,
        }
    }

    /// A message the server sent at `server_micros` (microseconds since
    /// PostgreSQL's epoch, its clock) arrived now. A zero send time (none
    /// given) is ignored.
    pub fn observe(&mut self, server_micros: i64) {
        if server_micros <= 0 {
            return;
        }
        let skew = clock::skew_seconds(server_micros);
        self.gauge.set(skew);
        if skew.abs() < SKEW_WARN.as_secs_f64() {
            if self.warned.take().is_some() {
                tracing::info!(
                    clock_skew_s = skew,
                    "this machine's clock agrees with the database server's again"
                );
            }
            return;
        }
        if self.warned.is_some_and(|t| t.elapsed() < WARN_EVERY) {
            return;
        }
        self.warned = Some(Instant::now());
        let way = if skew > 0.0 { "ahead of" } else { "behind" };
        tracing::warn!(
            clock_skew_s = skew,
            "this machine's clock is {:.0} s {way} the database server's: receivers refuse signatures whose webhook-timestamp is outside their tolerance (often 5 minutes) with a 401; delivery latency is measured on the server's clock meanwhile. Fix time synchronisation (NTP, chrony) here or on the server",
            skew.abs()
        );
    }
}
