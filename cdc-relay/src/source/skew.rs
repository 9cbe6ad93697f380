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
    warned: Option<Instant>,
    /// Recent samples (when received, local minus server seconds), at most
    /// [`SAMPLE_WINDOW`] old.
    samples: std::collections::VecDeque<(Instant, f64)>,
}

/// How far back the skew estimate looks. A message that waited (in the
/// server's socket, or in the transport while the relay's window was full)
/// reads as skew; the smallest sample of the window is the one that waited
/// least, so the estimate is their minimum.
const SAMPLE_WINDOW: Duration = Duration::from_secs(60);

/// The samples behind a WARN must span at least this long: a burst of
/// messages that waited during backpressure all arrive at once.
const WARN_SPAN: Duration = Duration::from_secs(5);

impl SkewWatch {
    /// A watch that reports to `gauge` (seconds, this machine minus the
    /// server).
    pub fn new(gauge: prometheus::Gauge) -> Self {
        SkewWatch {
            gauge,
            warned: None,
            samples: Default::default(),
        }
    }

    /// Takes a message's server send time (microseconds since the
    /// PostgreSQL epoch) into account; 0 or less is ignored.
    pub fn observe(&mut self, server_micros: i64) {
        if server_micros <= 0 {
            return;
        }
        let now = Instant::now();
        self.samples
            .push_back((now, clock::skew_seconds(server_micros)));
        while self
            .samples
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > SAMPLE_WINDOW)
        {
            self.samples.pop_front();
        }
        let skew = self
            .samples
            .iter()
            .map(|(_, s)| *s)
            .fold(f64::INFINITY, f64::min);
        let span = self
            .samples
            .front()
            .map_or(Duration::ZERO, |(t, _)| now.duration_since(*t));
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
        if span < WARN_SPAN || self.warned.is_some_and(|t| t.elapsed() < WARN_EVERY) {
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
