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

/// What the admin endpoint reports on: the process, and the relay of each
/// slot it may stream (one, or one per shard with `run --shards`).
#[derive(Clone)]
pub struct Relays {
    /// The process's metrics; without shards also the one relay's.
    process: Metrics,
    /// Set when the process stopped for good and lingers.
    process_health: Arc<Health>,
    /// Each shard's metrics and health; empty without shards.
    shards: Vec<(Metrics, Arc<Health>)>,
}

impl Relays {
    /// One relay, one slot: its metrics are the process's.
    pub fn one(metrics: Metrics, health: Arc<Health>) -> Self {
        Relays {
            process: metrics,
            process_health: health,
            shards: Vec::new(),
        }
    }

    /// A sharded process: `process` for the process-wide families and a
    /// halt, and one relay per shard.
    pub fn sharded(
        process: Metrics,
        process_health: Arc<Health>,
        shards: Vec<(Metrics, Arc<Health>)>,
    ) -> Self {
        Relays {
            process,
            process_health,
            shards,
        }
    }

    /// Each relay's metrics and health.
    fn relays(&self) -> Vec<(&Metrics, &Arc<Health>)> {
        if self.shards.is_empty() {
            vec![(&self.process, &self.process_health)]
        } else {
            self.shards.iter().map(|(m, h)| (m, h)).collect()
        }
    }

    fn render(&self) -> String {
        for (metrics, health) in self.relays() {
            metrics
                .seconds_since_server_message
                .set(health.since_heard().as_secs_f64());
        }
        if self.shards.is_empty() {
            return self.process.render();
        }
        let shards: Vec<Metrics> = self.shards.iter().map(|(m, _)| m.clone()).collect();
        crate::metrics::render_merged(&self.process, &shards)
    }

    /// Ready: not halted, streaming at least one slot, and every slot it
    /// streams ready with its circuit closed. A sharded process waiting for
    /// a free shard is alive but not ready, like a hot standby.
    fn ready(&self) -> Result<(), String> {
        if let Some(why) = self.process_health.halted() {
            return Err(why.to_owned());
        }
        let relays = self.relays();
        let mut streaming = 0;
        for (metrics, health) in &relays {
            if let Some(why) = health.halted() {
                return Err(why.to_owned());
            }
            if !health.is_streaming() {
                continue;
            }
            streaming += 1;
            let circuit_open = metrics.circuit_state.get() != 0;
            let retired = metrics.endpoints.retired();
            let sink = if !retired.is_empty() {
                Some(format!(
                    "endpoint {} retired: the sink answered 410 Gone (events kept; point the endpoint's URL at its replacement)",
                    retired.join(", ")
                ))
            } else {
                circuit_open.then(|| "the circuit breaker is open: the sink is failing".to_owned())
            };
            // A failing sink explains a stalled stream too: with the window
            // full the relay stops reading, so the server's silence and the
            // lack of progress are its consequences, not the stream's fault.
            let verdict = match health.ready() {
                Ok(()) => sink.map_or(Ok(()), Err),
                Err(why) if Health::is_stall(why) => Err(sink.unwrap_or_else(|| why.to_owned())),
                Err(why) => Err(why.to_owned()),
            };
            verdict.map_err(|why| match relays.len() {
                1 => why,
                _ => format!("{}: {why}", shard_label(metrics)),
            })?;
        }
        match (streaming, self.shards.is_empty()) {
            (0, true) => self.process_health.ready().map_err(str::to_owned),
            (0, false) => {
                Err("not streaming from any shard's slot (waiting for a free one)".into())
            }
            _ => Ok(()),
        }
    }
}

/// The `shard` label of a shard's metrics, for messages.
fn shard_label(metrics: &Metrics) -> String {
    metrics
        .registry()
        .gather()
        .first()
        .and_then(|f| f.get_metric().first())
        .and_then(|m| {
            m.get_label()
                .iter()
                .find(|l| l.name() == "shard")
                .map(|l| format!("shard {}", l.value()))
        })
        .unwrap_or_else(|| "a shard".into())
}

/// The admin router.
pub fn router(relays: Relays) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_handler))
        .with_state(relays)
}

async fn metrics_handler(State(relays): State<Relays>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        relays.render(),
    )
}

async fn ready_handler(State(relays): State<Relays>) -> impl IntoResponse {
    match relays.ready() {
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
    relays: Relays,
    max_connections: usize,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let limits = service_listener::Limits {
        header_read_timeout: std::time::Duration::from_secs(5),
        max_connections: max_connections.max(1),
        drain_timeout: std::time::Duration::from_secs(1),
    };
    service_listener::serve(listener, router(relays), limits, shutdown).await;
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn shard(tag: &str) -> (Metrics, Arc<Health>) {
        (
            Metrics::for_shard(tag),
            Health::new(Duration::from_secs(60)),
        )
    }

    #[test]
    fn a_sharded_process_is_ready_when_every_shard_it_streams_is() {
        let (a, b) = (shard("0of2"), shard("1of2"));
        let relays = Relays::sharded(
            Metrics::new(),
            Health::new(Duration::from_secs(60)),
            vec![a.clone(), b.clone()],
        );
        let waiting = relays.ready().unwrap_err();
        assert!(waiting.contains("waiting for a free one"), "{waiting}");

        a.1.set_streaming(true, Duration::from_secs(30));
        assert_eq!(
            relays.ready(),
            Ok(()),
            "one shard streamed, the other held elsewhere"
        );

        b.1.set_streaming(true, Duration::from_secs(30));
        b.0.circuit_state.set(1);
        let open = relays.ready().unwrap_err();
        assert!(
            open.contains("shard 1of2") && open.contains("circuit"),
            "{open}"
        );

        b.0.circuit_state.set(0);
        a.1.halt(4, "slot lost");
        let halted = relays.ready().unwrap_err();
        assert!(halted.contains("exit code 4"), "{halted}");
    }

    #[test]
    fn one_relay_reports_as_before() {
        let health = Health::new(Duration::from_secs(60));
        let relays = Relays::one(Metrics::new(), health.clone());
        assert_eq!(relays.ready().unwrap_err(), "not streaming from the slot");
        health.set_streaming(true, Duration::from_secs(30));
        assert_eq!(relays.ready(), Ok(()));
        assert!(!relays.render().contains("shard="));
    }
}
