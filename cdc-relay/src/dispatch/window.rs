//! The window: what the relay holds in memory, bounded in events and bytes.
//!
//! The source admits an event only with a [`WindowPermit`]; the permit
//! travels with the event and is released when the event is done (or its
//! session is abandoned). When deliveries stall the window fills, the
//! source stops reading, and WAL waits on the server, not in relay memory.
//!
//! The window is one for all endpoints; what keeps one stuck endpoint from
//! filling it for the others is parking
//! ([`crate::dispatch::park`]), which reads [`Window::waited`] and
//! [`Window::held`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Bounds events received and not yet done. Cheap to clone (shared).
#[derive(Clone, Debug)]
pub struct Window {
    events: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
    max_events: usize,
    max_bytes: u32,
    waits: Arc<Mutex<Waits>>,
}

/// Time admissions have spent waiting for room.
#[derive(Debug, Default)]
struct Waits {
    /// Since when the current admission waits (`None`: none does). The
    /// source admits one event at a time.
    since: Option<Instant>,
    /// Waits ended so far, summed.
    ended: Duration,
}

/// Counts an admission's wait; added to the sum when dropped (admitted, or
/// the wait abandoned).
struct Waiting<'a>(&'a Mutex<Waits>);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut w = self.0.lock().expect("window waits are never poisoned");
        if let Some(since) = w.since.take() {
            w.ended += since.elapsed();
        }
    }
}

/// Room for one event in the [`Window`]; released when dropped.
#[derive(Debug)]
pub struct WindowPermit {
    _events: OwnedSemaphorePermit,
    _bytes: OwnedSemaphorePermit,
}

impl Window {
    /// At most `max_events` events and `max_bytes` bytes (payload plus
    /// overhead). An event larger than `max_bytes` is admitted alone.
    pub fn new(max_events: usize, max_bytes: u32) -> Self {
        Window {
            events: Arc::new(Semaphore::new(max_events.max(1))),
            bytes: Arc::new(Semaphore::new(max_bytes.max(1) as usize)),
            max_events: max_events.max(1),
            max_bytes: max_bytes.max(1),
            waits: Arc::default(),
        }
    }

    /// Events admitted and not yet released.
    pub fn held(&self) -> usize {
        self.max_events
            .saturating_sub(self.events.available_permits())
    }

    /// Time admissions have spent waiting for room since the window was
    /// made, the current wait included: time the window was full (in
    /// events or in bytes) and the source did not read. Its growth over an
    /// interval, divided by the interval, is the share of it the source
    /// was held up.
    pub fn waited(&self) -> Duration {
        let w = self.waits.lock().expect("window waits are never poisoned");
        w.ended + w.since.map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// Waits until an event of `size` bytes fits; first come, first served.
    pub async fn admit(&self, size: usize) -> WindowPermit {
        let cost = u32::try_from(size)
            .unwrap_or(u32::MAX)
            .clamp(1, self.max_bytes);
        if let (Ok(events), Ok(bytes)) = (
            Arc::clone(&self.events).try_acquire_owned(),
            Arc::clone(&self.bytes).try_acquire_many_owned(cost),
        ) {
            return WindowPermit {
                _events: events,
                _bytes: bytes,
            };
        }
        self.waits
            .lock()
            .expect("window waits are never poisoned")
            .since = Some(Instant::now());
        let _waiting = Waiting(&self.waits);
        let events = Arc::clone(&self.events)
            .acquire_owned()
            .await
            .expect("window semaphore is never closed");
        let bytes = Arc::clone(&self.bytes)
            .acquire_many_owned(cost)
            .await
            .expect("window semaphore is never closed");
        WindowPermit {
            _events: events,
            _bytes: bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn bounds_events_and_bytes_and_admits_an_oversized_event_alone() {
        let w = Window::new(2, 100);
        let a = w.admit(10).await;
        let _b = w.admit(10).await;
        let third = tokio::time::timeout(Duration::from_secs(1), w.admit(10)).await;
        assert!(third.is_err(), "two events fill a window of two");
        drop(a);
        let _c = w.admit(10).await;

        let w = Window::new(10, 100);
        let big = w.admit(1_000).await; // larger than the window: admitted alone
        let next = tokio::time::timeout(Duration::from_secs(1), w.admit(1)).await;
        assert!(next.is_err(), "nothing fits beside an oversized event");
        drop(big);
        let _d = w.admit(60).await;
        let over = tokio::time::timeout(Duration::from_secs(1), w.admit(60)).await;
        assert!(over.is_err(), "60 + 60 bytes exceed 100");
    }

    #[tokio::test(start_paused = true)]
    async fn sums_the_time_admissions_waited_and_counts_what_it_holds() {
        let secs = Duration::from_secs;
        let w = Window::new(2, 100);
        let a = w.admit(10).await;
        assert_eq!((w.held(), w.waited()), (1, secs(0)));
        let _b = w.admit(10).await;
        tokio::time::sleep(secs(5)).await;
        assert_eq!((w.held(), w.waited()), (2, secs(0)), "full, nobody waits");
        let waiting = tokio::spawn({
            let w = w.clone();
            async move { w.admit(10).await }
        });
        tokio::time::sleep(secs(3)).await;
        assert_eq!(w.waited(), secs(3), "the current wait counts");
        drop(a);
        let _c = waiting.await.unwrap();
        tokio::time::sleep(secs(5)).await;
        assert_eq!(
            (w.held(), w.waited()),
            (2, secs(3)),
            "admitted: the wait ended"
        );

        let w = Window::new(10, 100);
        let _big = w.admit(90).await;
        let abandoned = tokio::time::timeout(secs(1), w.admit(20)).await;
        assert!(abandoned.is_err(), "the bytes are full");
        tokio::time::sleep(secs(5)).await;
        assert_eq!(w.waited(), secs(1), "an abandoned wait ends too");
    }
}
