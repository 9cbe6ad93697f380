//! Exponential backoff with full jitter.
//!
//! The delay before retry `n` (from 0) is uniform in `[0, min(cap, base·2ⁿ)]`
//! ("full jitter"). The cap stays near one second by default: a long cap
//! oversleeps the downstream's recovery. A server's `Retry-After` raises the
//! delay, but never past `retry_after_max`.

use std::time::Duration;

use rand::Rng;

/// Backoff state for one event's retries.
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    retry_after_max: Duration,
    attempt: u32,
}

impl Backoff {
    /// Delays start at `base` (ms scale), double per retry up to `cap`; a
    /// `Retry-After` is honoured up to `retry_after_max`.
    pub fn new(base: Duration, cap: Duration, retry_after_max: Duration) -> Self {
        Backoff {
            base,
            cap,
            retry_after_max,
            attempt: 0,
        }
    }

    /// The upper bound of the next delay, before jitter.
    pub fn ceiling(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The delay before the next attempt, given the server's `Retry-After`.
    pub fn next_delay(&mut self, retry_after: Option<Duration>, rng: &mut impl Rng) -> Duration {
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        let jittered = Duration::from_nanos(
            rng.random_range(0..=ceiling.as_nanos().min(u128::from(u64::MAX)) as u64),
        );
        match retry_after {
            Some(ra) => jittered.max(ra.min(self.retry_after_max)),
            None => jittered,
        }
    }

    /// Start over (after a success).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn grows_to_the_cap_with_full_jitter() {
        let mut b = Backoff::new(
            Duration::from_millis(50),
            Duration::from_secs(1),
            Duration::from_secs(5),
        );
        let mut rng = StdRng::seed_from_u64(1);
        let ceilings: Vec<u128> = (0..8)
            .map(|_| {
                let c = b.ceiling();
                let d = b.next_delay(None, &mut rng);
                assert!(d <= c, "{d:?} above ceiling {c:?}");
                c.as_millis()
            })
            .collect();
        assert_eq!(ceilings, [50, 100, 200, 400, 800, 1000, 1000, 1000]);
        b.reset();
        assert_eq!(b.ceiling(), Duration::from_millis(50));
        for _ in 0..100 {
            b.next_delay(None, &mut rng); // no overflow however long it retries
        }
        assert_eq!(b.ceiling(), Duration::from_secs(1));
    }

    #[test]
    fn retry_after_is_honoured_within_a_bound() {
        let mut rng = StdRng::seed_from_u64(2);
        let mut b = Backoff::new(
            Duration::from_millis(10),
            Duration::from_millis(10),
            Duration::from_secs(5),
        );
        assert!(b.next_delay(Some(Duration::from_secs(2)), &mut rng) >= Duration::from_secs(2));
        assert_eq!(
            b.next_delay(Some(Duration::from_secs(3600)), &mut rng),
            Duration::from_secs(5)
        );
    }
}
