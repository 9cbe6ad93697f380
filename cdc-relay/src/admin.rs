//! The admin HTTP endpoint: `/metrics`, `/healthz`, `/readyz`.
//!
//! `/healthz` answers 200 while the process runs. `/readyz` answers 200 only
//! when the relay streams from the slot AND makes progress: the confirmed
//! LSN advanced — or nothing was pending — within the ready window. A relay
//! stuck while events wait is alive but not ready.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::health::Health;
use crate::metrics::Metrics;

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
    s.metrics
        .seconds_since_server_message
        .set(s.health.since_heard().as_secs_f64());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(),
    )
}

async fn ready_handler(State(s): State<AdminState>) -> impl IntoResponse {
    if let Some(why) = s.health.halted() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        );
    }
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

/// Serves the admin endpoint on an already-bound listener until
/// `shutdown`, with at most `max_connections` at once and a 5 s
/// header-read/idle timeout: a flood of idle sockets on the admin port can
/// never take the descriptors the delivery path needs.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Metrics,
    health: Arc<Health>,
    max_connections: usize,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let limits = service_listener::Limits {
        header_read_timeout: std::time::Duration::from_secs(5),
        max_connections: max_connections.max(1),
        drain_timeout: std::time::Duration::from_secs(1),
    };
    service_listener::serve(listener, router(metrics, health), limits, shutdown).await;
}
