//! The window: what the relay holds in memory, bounded in events and bytes.
//!
//! The source admits an event only with a [`WindowPermit`]; the permit
//! travels with the event and is released when the event is done (or its
//! session is abandoned). When deliveries stall the window fills, the
//! source stops reading, and WAL waits on the server, not in relay memory.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bounds events received and not yet done. Cheap to clone (shared).
#[derive(Clone, Debug)]
pub struct Window {
    events: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
    max_bytes: u32,
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
            max_bytes: max_bytes.max(1),
        }
    }

    /// Waits until an event of `size` bytes fits; first come, first served.
    pub async fn admit(&self, size: usize) -> WindowPermit {
        let cost = u32::try_from(size)
            .unwrap_or(u32::MAX)
            .clamp(1, self.max_bytes);
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
}
