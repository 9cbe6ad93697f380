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
//!
//! A batch's attempt (`BatchSpans`), with an exporter: each traced event
//! of it gets its `outbox.deliver` span in its own trace, as a single
//! attempt does, and the request is a span `outbox.deliver_batch` that
//! starts a trace of its own, linked to those spans; the request's
//! `traceparent` names it, so the receiver's span is its child. One request
//! has one parent, and a batch's events come from many traces: links are
//! how OpenTelemetry relates one operation to many. Without an exporter a
//! batch carries no `traceparent` (no stored context is the parent of the
//! others').

use std::borrow::Cow;

use opentelemetry::trace::{
    Link, Span as _, SpanContext, SpanKind, Status, TraceContextExt, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SdkTracer, Span};

use crate::outbox::OutboxEvent;
use crate::sink::{Attempt, TraceHeaders};

/// The span name of one delivery attempt.
pub const SPAN_NAME: &str = "outbox.deliver";

/// The span name of one batch request.
pub const BATCH_SPAN_NAME: &str = "outbox.deliver_batch";

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
        let span = event_span(tracer, endpoint, event, attempt, skew_seconds, None)?;
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
        if let Some(span) = self.span.as_mut() {
            end(span, attempt, failure);
        }
    }
}

/// One attempt of a batch: its traced events' spans and the request's.
pub(super) struct BatchSpans {
    /// `outbox.deliver_batch`, linked to `events`.
    batch: Span,
    /// Each traced event's `outbox.deliver`, a child of its stored context.
    events: Vec<Span>,
    /// What the request carries: the batch span.
    headers: Option<TraceHeaders>,
}

impl BatchSpans {
    /// Starts attempt number `attempt` of batch `batch_id` (its `events`,
    /// in body order) at `endpoint`: `None` without an exporter, or when
    /// no event of it has a stored context.
    pub(super) fn start(
        tracer: Option<&SdkTracer>,
        endpoint: &str,
        (batch_id, events): (&str, &[&OutboxEvent]),
        attempt: u32,
        skew_seconds: f64,
    ) -> Option<BatchSpans> {
        let tracer = tracer?;
        let spans: Vec<Span> = events
            .iter()
            .filter_map(|e| event_span(tracer, endpoint, e, attempt, skew_seconds, Some(batch_id)))
            .collect();
        if spans.is_empty() {
            return None;
        }
        let links = spans
            .iter()
            .map(|s| Link::with_context(s.span_context().clone()))
            .collect();
        let batch = tracer
            .span_builder(BATCH_SPAN_NAME)
            .with_kind(SpanKind::Client)
            .with_links(links)
            .with_attributes([
                KeyValue::new("outbox.batch_id", batch_id.to_owned()),
                KeyValue::new("outbox.batch_size", events.len() as i64),
                KeyValue::new("outbox.endpoint", endpoint.to_owned()),
                KeyValue::new("outbox.attempt", i64::from(attempt)),
                KeyValue::new("http.request.method", "POST"),
            ])
            .start_with_context(tracer, &Context::new());
        let headers = headers(batch.span_context());
        Some(BatchSpans {
            batch,
            events: spans,
            headers,
        })
    }

    /// The headers the batch's request carries.
    pub(super) fn headers(&self) -> Option<&TraceHeaders> {
        self.headers.as_ref()
    }

    /// Ends every span with what the request gave, as
    /// [`AttemptSpan::end`].
    pub(super) fn end(mut self, attempt: &Attempt, failure: Option<&str>) {
        for span in &mut self.events {
            end(span, attempt, failure);
        }
        end(&mut self.batch, attempt, failure);
    }
}

/// Event `event`'s span of attempt number `attempt` at `endpoint`, a
/// child of its stored context (`None` without one); `batch`: the id of
/// the batch that carries it.
fn event_span(
    tracer: &SdkTracer,
    endpoint: &str,
    event: &OutboxEvent,
    attempt: u32,
    skew_seconds: f64,
    batch: Option<&str>,
) -> Option<Span> {
    let stored = event.trace.as_ref()?;
    let since_commit = crate::clock::seconds_since(event.commit_time_micros, skew_seconds) * 1000.0;
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
    if let Some(id) = batch {
        attributes.push(KeyValue::new("outbox.batch_id", id.to_owned()));
    }
    let parent = Context::new().with_remote_span_context(stored.clone());
    Some(
        tracer
            .span_builder(SPAN_NAME)
            .with_kind(SpanKind::Client)
            .with_attributes(attributes)
            .start_with_context(tracer, &parent),
    )
}

/// Ends `span` with what the attempt gave: its status code, and
/// `error.type` (the reason label) when it was not delivered.
fn end(span: &mut Span, attempt: &Attempt, failure: Option<&str>) {
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

/// The `traceparent` (and `tracestate`) naming span `cx`.
fn headers(cx: &SpanContext) -> Option<TraceHeaders> {
    let (parent, state) = trace_context::stored::headers(cx)?;
    Some(TraceHeaders {
        traceparent: parent.parse().ok()?,
        tracestate: state.and_then(|s| s.parse().ok()),
    })
}
