//! Logging: `tracing` to stderr (stdout carries only the startup line),
//! filtered by `RUST_LOG` (default `info`), as text or JSON lines.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Logging flags.
#[derive(Debug, Clone, clap::Args)]
pub struct LogArgs {
    /// Log format; the level comes from `RUST_LOG` (default `info`).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// The format [`init_tracing`] set up, for [`startup_line`].
static FORMAT: std::sync::OnceLock<LogFormat> = std::sync::OnceLock::new();

/// A line for stdout announcing a bound address (`listening on
/// http://ADDR`): plain text, or, when the logs are JSON, a JSON object
/// shaped like a log line (`timestamp`, `level`, `message`, `addr`,
/// `target`), so every line a log shipper reads parses.
pub fn startup_line(message: &str, addr: &str) -> String {
    match FORMAT.get() {
        Some(LogFormat::Json) => serde_json::json!({
            "timestamp": humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
            "level": "INFO",
            "message": message,
            "addr": addr,
            "target": "service_common::server",
        })
        .to_string(),
        _ => message.to_owned(),
    }
}

/// Installs the global subscriber. Fails if one is already installed.
pub fn init_tracing(format: LogFormat) -> anyhow::Result<()> {
    let _ = FORMAT.set(format);
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info"))
        // tokio-postgres logs every statement's parameters at debug: order
        // and event payloads must never reach the logs, whatever the filter.
        .add_directive(
            "tokio_postgres::query=info"
                .parse()
                .expect("a valid directive"),
        );
    // Colour codes only for a terminal: captured logs stay greppable.
    // A line that cannot be written (stderr closed) is dropped rather than
    // reported with `eprintln!`, which would panic the logging task.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .log_internal_errors(false)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    }
    .map_err(|e| anyhow::anyhow!("cannot install the log subscriber: {e}"))
}

/// The spans a service makes: a tracer when an OTLP endpoint is configured
/// (`--otlp-endpoint`), else nothing. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Spans(Option<opentelemetry_sdk::trace::SdkTracer>);

impl Spans {
    /// Spans of `tracer` (`None`: none are made).
    pub fn new(tracer: Option<opentelemetry_sdk::trace::SdkTracer>) -> Self {
        Spans(tracer)
    }

    /// Starts the server span `name` of a request: a child of its
    /// `traceparent` header when it has a valid one, else a new trace.
    /// Without a tracer it records nothing, and its
    /// [`context`](RequestSpan::context) is the incoming one.
    pub fn server(&self, name: &'static str, headers: &http::HeaderMap) -> RequestSpan {
        use opentelemetry::trace::{SpanKind, TraceContextExt, Tracer};
        let incoming = trace_context::stored::from_headers(headers);
        let Some(tracer) = &self.0 else {
            return RequestSpan {
                span: None,
                incoming,
            };
        };
        let parent = match &incoming {
            Some(cx) => opentelemetry::Context::new().with_remote_span_context(cx.clone()),
            None => opentelemetry::Context::new(),
        };
        let span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .start_with_context(tracer, &parent);
        RequestSpan {
            span: Some(span),
            incoming,
        }
    }
}

/// A request's span ([`Spans::server`]); ends with [`RequestSpan::end`]
/// (or when dropped).
#[derive(Debug)]
pub struct RequestSpan {
    span: Option<opentelemetry_sdk::trace::Span>,
    incoming: Option<opentelemetry::trace::SpanContext>,
}

impl RequestSpan {
    /// The context work done for this request continues: this span's, or,
    /// when no span is recorded, the incoming `traceparent`'s. `None`
    /// without either.
    pub fn context(&self) -> Option<opentelemetry::trace::SpanContext> {
        use opentelemetry::trace::Span;
        match &self.span {
            Some(span) => Some(span.span_context().clone()),
            None => self.incoming.clone(),
        }
    }

    /// Sets attribute `key` (a no-op without a span).
    pub fn set(&mut self, key: &'static str, value: impl Into<opentelemetry::Value>) {
        use opentelemetry::trace::Span;
        if let Some(span) = &mut self.span {
            span.set_attribute(opentelemetry::KeyValue::new(key, value));
        }
    }

    /// Ends the span with the request's `result`: status error with the
    /// error's text when it failed. Returns `result`.
    pub fn end<T, E: std::fmt::Display>(mut self, result: Result<T, E>) -> Result<T, E> {
        use opentelemetry::trace::Span;
        if let (Some(span), Err(e)) = (&mut self.span, &result) {
            span.set_status(opentelemetry::trace::Status::error(e.to_string()));
        }
        result
    }
}
