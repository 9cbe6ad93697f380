//! The admin HTTP endpoint: `/metrics`, `/healthz`, `/readyz`.
//!
//! `/healthz` answers 200 while the process runs. `/readyz` answers 200 only
//! when the relay streams from the slot AND makes progress: the confirmed
//! LSN advanced — or nothing was pending — within the ready window. A relay
//! stuck while events wait is alive but not ready.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::Metrics;

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

#[derive(Clone)]
struct AdminState {
    metrics: Metrics,
    health: Arc<Health>,
}

/// The admin router.
pub fn router(metrics: Metrics, health: Arc<Health>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_handler))
        .with_state(AdminState { metrics, health })
}

async fn metrics_handler(State(s): State<AdminState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(),
    )
}

async fn ready_handler(State(s): State<AdminState>) -> impl IntoResponse {
    let circuit_open = s.metrics.circuit_state.get() != 0;
    let verdict = match s.health.ready() {
        Ok(()) if circuit_open => Err("the circuit breaker is open: the sink is failing"),
        other => other,
    };
    match verdict {
        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}

/// Serves the admin endpoint on an already-bound listener until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Metrics,
    health: Arc<Health>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(metrics, health))
        .with_graceful_shutdown(shutdown)
        .await
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
