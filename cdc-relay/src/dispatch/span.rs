//! A delivery attempt in the event's own trace
//! (`docs/architecture.md#trace-context`).
//!
//! An event whose row stored a trace context is delivered with a
//! `traceparent`. With an exporter (`--otlp-endpoint`), each attempt is a
//! span `outbox.deliver`, a child of the stored context, and the header
//! names that span, so the receiver's span is the attempt's child. Without
//! one, the stored context is forwarded as it is: the receiver's span is
//! then a child of the producer's. An event without a stored context is
//! delivered as before: no span, no header.

use std::borrow::Cow;

use opentelemetry::trace::{
    Span as _, SpanContext, SpanKind, Status, TraceContextExt, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SdkTracer, Span};

use crate::outbox::OutboxEvent;
use crate::sink::{Attempt, TraceHeaders};

/// The span name of one delivery attempt.
pub const SPAN_NAME: &str = "outbox.deliver";

/// One attempt's place in its event's trace.
pub(super) struct AttemptSpan {
    /// The recording span (an exporter is configured).
    span: Option<Span>,
    /// What the request carries.
    headers: Option<TraceHeaders>,
}

impl AttemptSpan {
    /// Starts attempt number `attempt` of `event` at endpoint `endpoint`:
    /// `None` when the event has no stored context.
    pub(super) fn start(
        tracer: Option<&SdkTracer>,
        endpoint: &str,
        event: &OutboxEvent,
        attempt: u32,
        skew_seconds: f64,
    ) -> Option<AttemptSpan> {
        let stored = event.trace.as_ref()?;
        let Some(tracer) = tracer else {
            return Some(AttemptSpan {
                span: None,
                headers: headers(stored),
            });
        };
        let since_commit =
            crate::clock::seconds_since(event.commit_time_micros, skew_seconds) * 1000.0;
        let mut attributes = vec![
            KeyValue::new("outbox.event_id", event.id.clone()),
            KeyValue::new("outbox.event_type", event.event_type.clone()),
            KeyValue::new("outbox.endpoint", endpoint.to_owned()),
            KeyValue::new("outbox.attempt", i64::from(attempt)),
            KeyValue::new("outbox.commit_to_attempt_ms", since_commit),
            KeyValue::new("http.request.method", "POST"),
        ];
        if let Some(lsn) = event.commit_lsn {
            attributes.push(KeyValue::new("outbox.commit_lsn", lsn.to_string()));
        }
        if let Some(id) = event.dead_letter_id {
            attributes.push(KeyValue::new("outbox.dead_letter_id", id));
        }
        let parent = Context::new().with_remote_span_context(stored.clone());
        let span = tracer
            .span_builder(SPAN_NAME)
            .with_kind(SpanKind::Client)
            .with_attributes(attributes)
            .start_with_context(tracer, &parent);
        let headers = headers(span.span_context());
        Some(AttemptSpan {
            span: Some(span),
            headers,
        })
    }

    /// The headers the attempt's request carries.
    pub(super) fn headers(&self) -> Option<&TraceHeaders> {
        self.headers.as_ref()
    }

    /// Ends the span with what the attempt gave: its status code, and
    /// `error.type` (the reason label) when it was not delivered.
    pub(super) fn end(mut self, attempt: &Attempt, failure: Option<&str>) {
        let Some(span) = self.span.as_mut() else {
            return;
        };
        if let Attempt::Response { status, .. } = attempt {
            span.set_attribute(KeyValue::new(
                "http.response.status_code",
                i64::from(*status),
            ));
        }
        if let Some(reason) = failure {
            span.set_attribute(KeyValue::new("error.type", reason.to_owned()));
            span.set_status(Status::Error {
                description: Cow::Owned(attempt.detail()),
            });
        }
        span.end();
    }
}

/// The `traceparent` (and `tracestate`) naming span `cx`.
fn headers(cx: &SpanContext) -> Option<TraceHeaders> {
    let (parent, state) = trace_context::stored::headers(cx)?;
    Some(TraceHeaders {
        traceparent: parent.parse().ok()?,
        tracestate: state.and_then(|s| s.parse().ok()),
    })
}
