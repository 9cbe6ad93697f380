//! The server's clock against this machine's, watched on every stream
//! message (`crate::clock`): the `cdc_relay_clock_skew_seconds` gauge, and a
//! WARN while they are [`clock::SKEW_WARN`] or more apart.

use std::time::Duration;

use tokio::time::Instant;

use crate::clock;

/// How often the WARN repeats while the clocks stay apart.
const WARN_EVERY: Duration = Duration::from_secs(600);

/// Watches the skew of one session's stream.
pub struct SkewWatch {
    gauge: prometheus::Gauge,
    warned: Option<Instant>,
    /// The least sample of each [`BUCKET`] of the last [`SAMPLE_WINDOW`]
    /// (the bucket's start, local minus server seconds), oldest first: at
    /// most 61 entries, whatever the message rate.
    buckets: std::collections::VecDeque<(Instant, f64)>,
    /// The least sample of `buckets`: the estimate.
    least: f64,
}

/// How far back the skew estimate looks. A message that waited (in the
/// server's socket, or in the transport while the relay's window was full)
/// reads as skew; the smallest sample of the window is the one that waited
/// least, so the estimate is their minimum.
const SAMPLE_WINDOW: Duration = Duration::from_secs(60);

/// Samples are kept as the least of each bucket this long: the window's
/// minimum then costs a comparison per message (and a pass over at most 61
/// buckets once per bucket), not a pass over every message of the window.
const BUCKET: Duration = Duration::from_secs(1);

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
            buckets: Default::default(),
            least: f64::INFINITY,
        }
    }

    /// Takes `sample` (seconds) received at `now`; returns the estimate
    /// (the least sample of the window, to a bucket's precision) and how
    /// long a span of samples it rests on.
    fn take(&mut self, now: Instant, sample: f64) -> (f64, Duration) {
        match self.buckets.back_mut() {
            Some((start, least)) if now.duration_since(*start) < BUCKET => {
                *least = least.min(sample);
                self.least = self.least.min(sample);
            }
            _ => {
                self.buckets.push_back((now, sample));
                while self
                    .buckets
                    .front()
                    .is_some_and(|(t, _)| now.duration_since(*t) > SAMPLE_WINDOW)
                {
                    self.buckets.pop_front();
                }
                self.least = self
                    .buckets
                    .iter()
                    .map(|b| b.1)
                    .fold(f64::INFINITY, f64::min);
            }
        }
        let span = self
            .buckets
            .front()
            .map_or(Duration::ZERO, |(t, _)| now.duration_since(*t));
        (self.least, span)
    }

    /// Takes a message's server send time (microseconds since the
    /// PostgreSQL epoch) into account; 0 or less is ignored.
    pub fn observe(&mut self, server_micros: i64) {
        if server_micros <= 0 {
            return;
        }
        // The estimate is on the steady timeline; the wall clock's skew
        // adds how far it was stepped, read now.
        let (sample, stepped) = clock::skew_seconds(server_micros);
        let (steady, span) = self.take(Instant::now(), sample);
        let skew = steady + stepped;
        self.gauge.set(skew);
        let Some(warning) = clock::skew_warning(skew) else {
            if self.warned.take().is_some() {
                tracing::info!(
                    clock_skew_s = skew,
                    "this machine's clock agrees with the database server's again"
                );
            }
            return;
        };
        if span < WARN_SPAN || self.warned.is_some_and(|t| t.elapsed() < WARN_EVERY) {
            return;
        }
        self.warned = Some(Instant::now());
        tracing::warn!(
            clock_skew_s = skew,
            "{warning}; delivery latency is measured on the server's clock meanwhile"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch() -> SkewWatch {
        SkewWatch::new(prometheus::Gauge::new("skew", "test").expect("gauge"))
    }

    #[tokio::test(start_paused = true)]
    async fn the_estimate_is_the_least_sample_of_the_last_minute() {
        let mut w = watch();
        let t0 = Instant::now();
        assert_eq!(w.take(t0, 5.0), (5.0, Duration::ZERO));
        // Within the same bucket and in a later one: the least wins.
        assert_eq!(w.take(t0 + Duration::from_millis(500), 3.0).0, 3.0);
        assert_eq!(w.take(t0 + Duration::from_secs(10), 2.0).0, 2.0);
        assert_eq!(
            w.take(t0 + Duration::from_secs(65), 7.0),
            (2.0, Duration::from_secs(55))
        );
        // 2.0 is 61 s old at 71 s: out of the window; 7.0 is the least left.
        assert_eq!(w.take(t0 + Duration::from_secs(71), 9.0).0, 7.0);
        // A larger sample never raises the estimate within its bucket.
        assert_eq!(w.take(t0 + Duration::from_millis(71_500), 1.0).0, 1.0);
        assert_eq!(w.take(t0 + Duration::from_millis(71_900), 4.0).0, 1.0);
    }

    /// The cost per message does not grow with the message rate: a million
    /// samples over two minutes keep at most 61 buckets (the window of
    /// every message cost a pass over up to 60 s of messages, 2.3x the
    /// relay's CPU per event at 40,000 events/s).
    #[tokio::test(start_paused = true)]
    async fn a_million_samples_keep_at_most_sixty_one_buckets() {
        let mut w = watch();
        let t0 = Instant::now();
        let mut most = 0;
        for i in 0..1_000_000u64 {
            let now = t0 + Duration::from_micros(i * 120);
            let (least, _) = w.take(now, (i % 1000) as f64);
            assert_eq!(least, 0.0);
            most = most.max(w.buckets.len());
        }
        // The window fills (60 one-second buckets) and goes no further.
        assert!((60..=61).contains(&most), "{most} buckets");
    }
}
