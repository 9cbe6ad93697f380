//! W3C trace context across the transactional outbox, and its export over
//! OTLP: one copy shared by `cdc-relay` and the example services.
//!
//! ```text
//!  Orders request ──traceparent──▶ orders.create span ──stored──▶ outbox.trace_context
//!                                                                      │ (the WAL, any time later)
//!  Billing inbox span ◀──traceparent── outbox.deliver span (one per attempt) ◀──┘
//! ```
//!
//! - [`stored`]: the column's text form (`traceparent`, then one space and
//!   `tracestate` when there is one) and the HTTP headers
//!   ([W3C Trace Context](https://www.w3.org/TR/trace-context/)).
//! - [`export`]: the tracer provider and its bounded span queue, exported in
//!   batches over OTLP/HTTP with protobuf bodies; spans that do not fit or
//!   whose export fails are counted and dropped, never waited for.
//! - [`args`]: the command-line flags, each with the standard
//!   `OTEL_*` environment variable.
//!
//! With no endpoint configured nothing is started: no provider, no task, no
//! span. A stored context is then still forwarded as it is.

pub mod args;
pub mod export;
pub mod redact;
pub mod stored;

pub use args::{TraceArgs, TracesSampler};
pub use export::{Counters, Export, ExportError};
pub use opentelemetry::trace::SpanContext;
