//! A real OTLP/HTTP receiver for tests and the demo: `POST /v1/traces`
//! with a protobuf `ExportTraceServiceRequest` body (decoded with the
//! OpenTelemetry project's own message types), every span kept in memory.
//!
//! A request that does not decode gets 400, as a collector answers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;

/// One span as received.
#[derive(Clone, Debug, PartialEq)]
pub struct ReceivedSpan {
    /// The resource's `service.name`.
    pub service: String,
    /// Its name, e.g. `outbox.deliver`.
    pub name: String,
    /// Trace id, 32 lowercase hex digits.
    pub trace_id: String,
    /// Span id, 16 lowercase hex digits.
    pub span_id: String,
    /// The parent's span id; empty for a root span.
    pub parent_span_id: String,
    /// Start and end, nanoseconds since the Unix epoch.
    pub start_unix_nanos: u64,
    /// End, nanoseconds since the Unix epoch.
    pub end_unix_nanos: u64,
    /// Status code: 0 unset, 1 ok, 2 error.
    pub status_code: i32,
    /// Attributes, values as text (ints and bools printed).
    pub attributes: HashMap<String, String>,
    /// Its links, as `(trace id, span id)` in lowercase hex.
    pub links: Vec<(String, String)>,
}

impl ReceivedSpan {
    /// Attribute `key`, if set.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

/// A running receiver.
#[derive(Clone)]
pub struct Collector {
    addr: std::net::SocketAddr,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    requests: Arc<Mutex<u64>>,
}

impl Collector {
    /// Starts a receiver on a free loopback port; it serves until the
    /// process ends.
    pub async fn start() -> anyhow::Result<Collector> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let collector = Collector {
            addr: listener.local_addr()?,
            spans: Arc::default(),
            requests: Arc::default(),
        };
        let app = collector.router();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(collector)
    }

    /// The receiver's routes, to serve elsewhere too (e.g. over TLS with
    /// [`crate::tls_sink::serve_tls`]); spans land in this collector.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/traces", post(receive))
            .with_state(self.clone())
    }

    /// The base URL (`--otlp-endpoint`).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far, in arrival order.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().unwrap().clone()
    }

    /// Export requests received so far.
    pub fn requests(&self) -> u64 {
        *self.requests.lock().unwrap()
    }

    /// The spans of trace `trace_id`.
    pub fn trace(&self, trace_id: &str) -> Vec<ReceivedSpan> {
        self.spans()
            .into_iter()
            .filter(|s| s.trace_id == trace_id)
            .collect()
    }

    /// Waits (up to `timeout`) until `done` holds for the spans received.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> anyhow::Result<Vec<ReceivedSpan>> {
        crate::wait::wait_until(what, timeout, || {
            let held = done(&self.spans());
            async move { held }
        })
        .await?;
        Ok(self.spans())
    }
}

async fn receive(
    State(collector): State<Collector>,
    body: Bytes,
) -> Result<Vec<u8>, (StatusCode, String)> {
    let request = ExportTraceServiceRequest::decode(body).map_err(|e| {
        (
            StatusCode::BAD_REQUEST,
            format!("not an OTLP trace request: {e}"),
        )
    })?;
    let mut received = Vec::new();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|r| r.attributes.iter())
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| kv.value.as_ref())
            .map(text)
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                received.push(ReceivedSpan {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex::encode(&span.trace_id),
                    span_id: hex::encode(&span.span_id),
                    parent_span_id: hex::encode(&span.parent_span_id),
                    start_unix_nanos: span.start_time_unix_nano,
                    end_unix_nanos: span.end_time_unix_nano,
                    status_code: span.status.map_or(0, |s| s.code),
                    attributes: span
                        .attributes
                        .iter()
                        .map(|kv| {
                            (
                                kv.key.clone(),
                                kv.value.as_ref().map(text).unwrap_or_default(),
                            )
                        })
                        .collect(),
                    links: span
                        .links
                        .iter()
                        .map(|l| (hex::encode(&l.trace_id), hex::encode(&l.span_id)))
                        .collect(),
                });
            }
        }
    }
    *collector.requests.lock().unwrap() += 1;
    collector.spans.lock().unwrap().extend(received);
    Ok(ExportTraceServiceResponse::default().encode_to_vec())
}

fn text(value: &opentelemetry_proto::tonic::common::v1::AnyValue) -> String {
    match &value.value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}
