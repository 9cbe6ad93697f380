//! Serving: the common routes and layers, the startup line, and graceful
//! shutdown.
//!
//! [`serve`] takes an already-bound listener and a shutdown future, so tests
//! bind `127.0.0.1:0` and decide when to stop. What the binaries call is
//! [`crate::service::run`].

use std::future::Future;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use tokio::net::TcpListener;
use tower_http::trace::TraceLayer;

use crate::ServiceError;
use crate::body::{BodyLimit, DEFAULT_BODY_LIMIT_BYTES};
use crate::metrics::{HttpMetrics, metrics_endpoint, track_requests};

/// HTTP limits.
#[derive(Debug, Clone, clap::Args)]
pub struct HttpArgs {
    /// Largest accepted request body, in bytes; larger gets 413.
    #[arg(long, default_value_t = DEFAULT_BODY_LIMIT_BYTES, value_parser = service_listener::positive_count)]
    pub body_limit_bytes: usize,
    /// Longest a request may take end to end, in ms; longer gets 503
    /// `request_timeout` (an open transaction is rolled back).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub request_timeout_ms: u64,
    /// Connection limits of the listener (header-read/idle timeout,
    /// connection cap).
    #[command(flatten)]
    pub listen: service_listener::LimitArgs,
}

/// A service's routes, by listener.
pub struct Routes {
    /// What clients call, served on `--listen`.
    pub public: Router,
    /// Reads only operators need, served on `--admin-listen` next to
    /// `/metrics` and `/healthz`.
    pub admin: Router,
}

/// Adds `/healthz`, a JSON 404, JSON bodies on 405 (axum's method router
/// already sets `Allow`), the request timeout, the body limit, request
/// metrics and tracing to a service's public `app` routes. `/metrics` is
/// not among them: see [`admin_router`].
pub fn service_router(app: Router, metrics: Arc<HttpMetrics>, http: &HttpArgs) -> Router {
    let timeout = Duration::from_millis(http.request_timeout_ms);
    app.route("/healthz", get(healthz))
        .fallback(not_found)
        .layer(middleware::from_fn(json_method_not_allowed))
        .layer(middleware::from_fn_with_state(timeout, request_timeout))
        .layer(Extension(BodyLimit(http.body_limit_bytes)))
        .layer(middleware::from_fn_with_state(metrics, track_requests))
        .layer(TraceLayer::new_for_http())
}

/// The admin listener's routes: `admin` plus `/metrics` and `/healthz`, a
/// JSON 404 and 405, the request timeout and tracing (not counted in the
/// request metrics, which are the clients').
pub fn admin_router(admin: Router, metrics: Arc<HttpMetrics>, http: &HttpArgs) -> Router {
    let timeout = Duration::from_millis(http.request_timeout_ms);
    admin
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics_endpoint).with_state(metrics))
        .fallback(not_found)
        .layer(middleware::from_fn(json_method_not_allowed))
        .layer(middleware::from_fn_with_state(timeout, request_timeout))
        .layer(TraceLayer::new_for_http())
}

/// Prints `listening on http://ADDR` to stdout (the line harnesses wait
/// for), then serves within `limits` (see `service_listener`) until
/// `shutdown` resolves and in-flight requests finish.
pub async fn serve<F>(
    listener: TcpListener,
    router: Router,
    limits: service_listener::Limits,
    shutdown: F,
) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let addr = listener.local_addr()?;
    {
        let mut stdout = std::io::stdout().lock();
        let line = crate::telemetry::startup_line(
            &format!("listening on http://{addr}"),
            &addr.to_string(),
        );
        writeln!(stdout, "{line}")?;
        stdout.flush()?;
    }
    tracing::info!(%addr, max_connections = limits.max_connections, "listening");
    service_listener::serve(listener, router, limits, shutdown).await;
    Ok(())
}

/// Resolves on the first SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM; stopping on SIGINT only");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: finishing in-flight requests"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: finishing in-flight requests"),
    }
}

async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

async fn not_found() -> ServiceError {
    ServiceError::not_found("not_found", "no such route")
}

/// axum answers a wrong method with 405, `Allow` and an empty body; give it
/// our JSON body. `Allow` is added after this layer and survives.
async fn json_method_not_allowed(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    if response.status() != StatusCode::METHOD_NOT_ALLOWED {
        return response;
    }
    let (parts, _) = response.into_parts();
    let mut json = ServiceError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "see the Allow header",
    )
    .into_response();
    for (name, value) in &parts.headers {
        json.headers_mut()
            .entry(name)
            .or_insert_with(|| value.clone());
    }
    json
}

async fn request_timeout(
    State(timeout): State<Duration>,
    request: Request,
    next: Next,
) -> Response {
    match tokio::time::timeout(timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            tracing::warn!(timeout_ms = timeout.as_millis(), "request timed out");
            ServiceError::unavailable(
                "request_timeout",
                format!("request took longer than {} ms", timeout.as_millis()),
                1,
            )
            .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::post;

    async fn spawn(app: Router, http: HttpArgs) -> (String, tokio::sync::oneshot::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let metrics = Arc::new(HttpMetrics::new("test").expect("metrics"));
        let router = service_router(app, metrics, &http);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let limits = http.listen.limits(Duration::from_secs(1));
        tokio::spawn(serve(listener, router, limits, async {
            let _ = rx.await;
        }));
        (format!("http://{addr}"), tx)
    }

    /// One raw HTTP/1.1 exchange; returns the response head and body.
    async fn raw(base: &str, request: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = base.trim_start_matches("http://");
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut out = String::new();
        stream.read_to_string(&mut out).await.expect("read");
        out
    }

    fn http(timeout_ms: u64) -> HttpArgs {
        HttpArgs {
            body_limit_bytes: 16,
            request_timeout_ms: timeout_ms,
            listen: service_listener::LimitArgs {
                header_read_timeout: Duration::from_secs(10),
                max_connections: 64,
            },
        }
    }

    #[tokio::test]
    async fn wrong_method_is_json_405_with_allow() {
        let (base, _stop) = spawn(
            Router::new().route("/x", post(|| async { "ok" })),
            http(1000),
        )
        .await;
        let response = raw(
            &base,
            "GET /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(response.starts_with("HTTP/1.1 405"), "{response}");
        assert!(
            response
                .to_ascii_lowercase()
                .contains("\r\nallow: post\r\n"),
            "{response}"
        );
        assert!(
            response.contains(r#""error":"method_not_allowed""#),
            "{response}"
        );
    }

    #[tokio::test]
    async fn unknown_route_is_json_404_and_healthz_is_up() {
        let (base, _stop) = spawn(Router::new(), http(1000)).await;
        let response = raw(
            &base,
            "GET /nope HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(response.starts_with("HTTP/1.1 404"), "{response}");
        assert!(response.contains(r#""error":"not_found""#), "{response}");
        let response = raw(
            &base,
            "GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    }

    #[tokio::test]
    async fn slow_handler_gets_503_request_timeout() {
        let slow = || async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            "late"
        };
        let (base, _stop) = spawn(Router::new().route("/slow", get(slow)), http(50)).await;
        let response = raw(
            &base,
            "GET /slow HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(response.starts_with("HTTP/1.1 503"), "{response}");
        assert!(
            response.contains(r#""error":"request_timeout""#),
            "{response}"
        );
    }

    #[tokio::test]
    async fn body_limit_extension_reaches_extractors() {
        use crate::body::JsonBody;
        let echo = |JsonBody(v): JsonBody| async move { Json(v) };
        let (base, _stop) = spawn(Router::new().route("/echo", post(echo)), http(1000)).await;
        let big = format!("{{\"a\":\"{}\"}}", "x".repeat(32));
        let request = format!(
            "POST /echo HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{big}",
            big.len()
        );
        let response = raw(&base, &request).await;
        assert!(response.starts_with("HTTP/1.1 413"), "{response}");
        let chunked = format!(
            "POST /echo HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{big}\r\n0\r\n\r\n",
            big.len()
        );
        let response = raw(&base, &chunked).await;
        assert!(response.starts_with("HTTP/1.1 413"), "{response}");
    }
}
