//! The HTTP sink: one file per stage of a delivery.
//!
//! ```text
//! OutboxEvent ─encoder─▶ Prepared (body, legacy signature) ─service─▶ POST ─▶ Attempt ─classify─▶ Disposition
//!                                          signature (per attempt: webhook-timestamp, webhook-signature) ─┘
//! ```
//!
//! The pipeline sees the sink only through the [`Sink`] trait, so its unit
//! tests run against a scripted in-memory sink.

pub mod answers;
mod attempt;
pub mod classify;
pub mod connection;
pub mod encoder;
pub mod service;
pub mod signature;
pub mod tls;

use std::future::Future;

pub use classify::{
    Disposition, REASONS, Reason, ReasonLabel, STATUS_CLASSES, StatusPolicy, classify,
    config_fault_hint, status_class,
};
pub use encoder::Prepared;
pub use service::{Attempt, HttpSink, SinkConfig, SinkError};
pub use signature::{SignatureScheme, Signer, Signing};
pub use tls::SinkTls;

use crate::outbox::OutboxEvent;

/// Where events are delivered.
pub trait Sink: Clone + Send + Sync + 'static {
    /// Builds the request for `event` once (body, legacy signature); every
    /// attempt sends the same bytes.
    fn prepare(&self, event: &OutboxEvent) -> Prepared;

    /// Builds the request of a batch of `events` (two or more, in body
    /// order) once: the body, its legacy signature, and the batch's id
    /// ([`encoder::batch_id`]), which [`Sink::post`] takes as the
    /// request's idempotency key (`docs/architecture.md#batches`).
    fn prepare_batch(&self, events: &[&OutboxEvent]) -> (String, Prepared);

    /// Makes one attempt to deliver `request` for event `event_id` (the
    /// idempotency key), carrying `trace` (the attempt's W3C trace
    /// context) when given, and reports what happened, within the sink's
    /// request timeout. Never fails: every failure is an [`Attempt`] for
    /// [`classify`](mod@classify) to judge.
    fn post(
        &self,
        event_id: &str,
        request: &Prepared,
        trace: Option<&TraceHeaders>,
    ) -> impl Future<Output = Attempt> + Send;
}

/// An attempt's W3C trace context headers
/// (`docs/architecture.md#trace-context`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceHeaders {
    /// `traceparent`: version, trace id, the attempt's span id, flags.
    pub traceparent: http::HeaderValue,
    /// `tracestate`, when the trace carries vendor state.
    pub tracestate: Option<http::HeaderValue>,
}
