//! Prometheus metrics: requests by route, method and status, and a latency
//! histogram by route, under the service's namespace (`orders_`, `billing_`).
//! Services register their own counters in [`HttpMetrics::registry`].

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder,
};

/// Latency buckets in seconds: sub-millisecond inserts up to the 10 s
/// request timeout.
const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0,
];

/// The HTTP metrics of one service and the registry `/metrics` renders.
#[derive(Debug, Clone)]
pub struct HttpMetrics {
    registry: Registry,
    requests: IntCounterVec,
    duration: HistogramVec,
}

impl HttpMetrics {
    /// Registers `<namespace>_http_requests_total{route,method,status}` and
    /// `<namespace>_http_request_duration_seconds{route,method}`.
    pub fn new(namespace: &str) -> prometheus::Result<Self> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "http_requests_total",
                "HTTP requests answered, by route, method and status.",
            )
            .namespace(namespace),
            &["route", "method", "status"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "http_request_duration_seconds",
                "Time from request received to response produced, in seconds.",
            )
            .namespace(namespace)
            .buckets(LATENCY_BUCKETS_SECONDS.to_vec()),
            &["route", "method"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        Ok(Self {
            registry,
            requests,
            duration,
        })
    }

    /// The registry for service-specific metrics.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Every registered metric in the Prometheus text exposition format.
    pub fn encode(&self) -> String {
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail on I/O; a metric family that fails
        // to encode is a programming error we would rather see as an empty page
        // than a crashed request.
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!(error = %e, "cannot encode metrics");
        }
        String::from_utf8(out).unwrap_or_default()
    }

    fn observe(&self, route: &str, method: &str, status: u16, seconds: f64) {
        self.requests
            .with_label_values(&[route, method, &status.to_string()])
            .inc();
        self.duration
            .with_label_values(&[route, method])
            .observe(seconds);
    }
}

/// Middleware: counts and times every request. The route label is the
/// matched pattern (`/orders/{id}`), or `unmatched`, so it stays bounded.
pub async fn track_requests(
    State(metrics): State<Arc<HttpMetrics>>,
    request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_owned();
    let method = method_label(request.method());
    let response = next.run(request).await;
    metrics.observe(
        &route,
        method,
        response.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    response
}

/// The method as a label; extension methods (any token is a valid method)
/// collapse into `other` so clients cannot mint label values.
fn method_label(method: &Method) -> &'static str {
    const KNOWN: [Method; 9] = [
        Method::GET,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::HEAD,
        Method::OPTIONS,
        Method::PATCH,
        Method::TRACE,
        Method::CONNECT,
    ];
    KNOWN
        .iter()
        .find(|known| *known == method)
        .map_or("other", |known| known.as_str())
}

/// `GET /metrics`.
pub async fn metrics_endpoint(State(metrics): State<Arc<HttpMetrics>>) -> Response {
    (
        [(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)],
        metrics.encode(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extension_methods_share_one_label() {
        assert_eq!(method_label(&Method::POST), "POST");
        assert_eq!(method_label(&Method::from_bytes(b"BREW").unwrap()), "other");
    }

    #[test]
    fn encodes_requests_and_histogram() {
        let metrics = HttpMetrics::new("svc").expect("metrics");
        metrics.observe("/orders", "POST", 201, 0.002);
        let text = metrics.encode();
        assert!(
            text.contains(
                r#"svc_http_requests_total{method="POST",route="/orders",status="201"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains("svc_http_request_duration_seconds_bucket"),
            "{text}"
        );
    }
}
