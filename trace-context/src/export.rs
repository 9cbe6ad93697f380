//! The tracer provider and its export: a bounded queue of finished spans,
//! sent in batches over OTLP/HTTP (protobuf) by one task.
//!
//! ```text
//!  Span::end ─▶ on_end ─try_send─▶ queue (--otlp-queue-spans) ─▶ export task ─POST /v1/traces─▶ collector
//!                   └─ full: dropped{reason="queue_full"}            └─ failed: dropped{reason="export_failed"}
//! ```
//!
//! Ending a span never waits: the SDK's batch processor has the same shape
//! but keeps its drop count to itself, and an operator must see a dead
//! collector as a moving counter, so the queue is ours. A batch is sent
//! when it holds [`MAX_BATCH`] spans or its first span is [`LINGER`] old.
//! One export runs at a time, within [`EXPORT_TIMEOUT`];
//! a failed batch is dropped (counted, logged at most once per
//! [`WARN_EVERY`]), never retried, so a dead collector costs one failing
//! request per batch and no memory beyond the queue.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use opentelemetry::Context;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    SdkTracer, SdkTracerProvider, Span, SpanData, SpanExporter, SpanProcessor,
};
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use tokio::sync::{Notify, mpsc};

use crate::args::TraceArgs;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// Spans per export request at most.
pub const MAX_BATCH: usize = 512;
/// How long the first span of a batch waits for others.
pub const LINGER: Duration = Duration::from_secs(1);
/// One export request's deadline.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// Export failures are logged at most this often (each is counted).
pub const WARN_EVERY: Duration = Duration::from_secs(60);

/// The export could not be set up; the message names the setting.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ExportError(String);

/// The export's counters, registered by the caller under its own prefix.
#[derive(Clone, Debug)]
pub struct Counters {
    /// Spans the collector accepted.
    pub exported: IntCounter,
    /// Spans dropped, by reason: `queue_full` (ended while the queue was
    /// full) or `export_failed` (their batch's request failed).
    pub dropped: IntCounterVec,
}

impl Counters {
    /// Registers `<prefix>_trace_spans_exported_total` and
    /// `<prefix>_trace_spans_dropped_total{reason}` in `registry`, both
    /// reasons at 0.
    pub fn register(registry: &Registry, prefix: &str) -> Counters {
        let exported = IntCounter::with_opts(Opts::new(
            format!("{prefix}_trace_spans_exported_total"),
            "Spans the OTLP collector accepted.",
        ))
        .expect("a valid metric");
        let dropped = IntCounterVec::new(
            Opts::new(
                format!("{prefix}_trace_spans_dropped_total"),
                "Spans dropped instead of exported: queue_full (the collector slow or down and the queue full) or export_failed (the collector refused or did not answer).",
            ),
            &["reason"],
        )
        .expect("a valid metric");
        for reason in ["queue_full", "export_failed"] {
            dropped.with_label_values(&[reason]);
        }
        registry
            .register(Box::new(exported.clone()))
            .expect("registered once");
        registry
            .register(Box::new(dropped.clone()))
            .expect("registered once");
        Counters { exported, dropped }
    }
}

/// A running export: the tracer to make spans with, and the task sending
/// them.
#[derive(Debug)]
pub struct Export {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    stop: Arc<Stop>,
    task: tokio::task::JoinHandle<()>,
    /// Where spans go, safe to log.
    shown: String,
}

#[derive(Debug, Default)]
struct Stop {
    requested: AtomicBool,
    notify: Notify,
}

impl Export {
    /// Starts the export `args` describe, on the current tokio runtime:
    /// `None` when tracing is off (no endpoint). `default_service` is the
    /// `service.name` unless `--otel-service-name` says otherwise. Errors:
    /// a bad endpoint or protocol setting (exit 2 at the caller).
    pub fn start(
        args: &TraceArgs,
        default_service: &str,
        counters: Counters,
    ) -> Result<Option<Export>, ExportError> {
        Self::start_with_tls(args, default_service, counters, None)
    }

    /// [`Export::start`] with the caller's TLS config for the collector
    /// (e.g. one that reads `--otlp-certificate` again for each
    /// connection); `None`: the webpki roots plus `--otlp-certificate` as
    /// it reads now.
    pub fn start_with_tls(
        args: &TraceArgs,
        default_service: &str,
        counters: Counters,
        tls: Option<rustls::ClientConfig>,
    ) -> Result<Option<Export>, ExportError> {
        let Some(url) = args.traces_url().map_err(ExportError)? else {
            return Ok(None);
        };
        let tls = match tls {
            Some(tls) => tls,
            None => Self::tls(args)?,
        };
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        let client = opentelemetry_http::hyper::HyperClient::new(connector, EXPORT_TIMEOUT, None);
        let service = args
            .service_name
            .clone()
            .filter(|s| !s.trim().is_empty())
            .unwrap_or_else(|| default_service.to_owned());
        let resource = Resource::builder().with_service_name(service).build();
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_endpoint(url.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| {
                ExportError(format!(
                    "OTLP exporter for {}: {e}",
                    crate::redact::url(&url)
                ))
            })?;
        // The queue owns the exporter, so the provider cannot hand it the
        // resource (`service.name`): it is given here.
        exporter.set_resource(&resource);
        let (tx, rx) = mpsc::channel(args.queue_spans as usize);
        let stop = Arc::new(Stop::default());
        let task = tokio::spawn(send(
            rx,
            exporter,
            counters.clone(),
            stop.clone(),
            crate::redact::url(&url),
        ));
        let provider = SdkTracerProvider::builder()
            .with_span_processor(Queue { tx, counters })
            .with_sampler(args.sampler())
            .with_resource(resource)
            .build();
        let tracer = provider.tracer(default_service.to_owned());
        Ok(Some(Export {
            provider,
            tracer,
            stop,
            task,
            shown: crate::redact::url(&url),
        }))
    }

    /// The webpki roots plus `--otlp-certificate`, read once.
    fn tls(args: &TraceArgs) -> Result<rustls::ClientConfig, ExportError> {
        let mut roots =
            rustls::RootCertStore::from_iter(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        if let Some(file) = &args.certificate {
            let setting = "--otlp-certificate (OTEL_EXPORTER_OTLP_CERTIFICATE)";
            let certs: Vec<_> = CertificateDer::pem_file_iter(file)
                .and_then(Iterator::collect)
                .map_err(|e| ExportError(format!("{setting} {}: {e}", file.display())))?;
            if roots.add_parsable_certificates(certs).0 == 0 {
                return Err(ExportError(format!(
                    "{setting} {}: no CA certificate in the file",
                    file.display()
                )));
            }
        }
        Ok(rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| ExportError(format!("TLS for the OTLP endpoint: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth())
    }

    /// The tracer spans are made with.
    pub fn tracer(&self) -> &SdkTracer {
        &self.tracer
    }

    /// Where spans go (scheme, host, port, path: no credentials), for the
    /// startup line.
    pub fn destination(&self) -> &str {
        &self.shown
    }

    /// Exports what is queued (within `timeout`) and stops. Spans ended
    /// after this are dropped.
    pub async fn shutdown(self, timeout: Duration) {
        self.stop.requested.store(true, Ordering::SeqCst);
        self.stop.notify.notify_one();
        let _ = tokio::time::timeout(timeout, self.task).await;
        let _ = self.provider.shutdown();
    }
}

/// The span processor: finished, sampled spans into the bounded queue.
#[derive(Debug)]
struct Queue {
    tx: mpsc::Sender<SpanData>,
    counters: Counters,
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        if self.tx.try_send(span).is_err() {
            self.counters
                .dropped
                .with_label_values(&["queue_full"])
                .inc();
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// The export task: batches from the queue to the collector until asked
/// to stop, then what is left.
async fn send(
    mut rx: mpsc::Receiver<SpanData>,
    exporter: opentelemetry_otlp::SpanExporter,
    counters: Counters,
    stop: Arc<Stop>,
    url: String,
) {
    let mut last_warning: Option<Instant> = None;
    let mut batch = Vec::with_capacity(MAX_BATCH);
    loop {
        let stopping = stop.requested.load(Ordering::SeqCst);
        if stopping {
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(span) => batch.push(span),
                    Err(_) => break,
                }
            }
            if batch.is_empty() {
                return;
            }
        } else if batch.is_empty() {
            tokio::select! {
                span = rx.recv() => match span {
                    Some(span) => batch.push(span),
                    None => return,
                },
                _ = stop.notify.notified() => continue,
            }
            let deadline = tokio::time::Instant::now() + LINGER;
            while batch.len() < MAX_BATCH {
                tokio::select! {
                    span = rx.recv() => match span {
                        Some(span) => batch.push(span),
                        None => break,
                    },
                    _ = tokio::time::sleep_until(deadline) => break,
                    _ = stop.notify.notified() => {
                        stop.notify.notify_one();
                        break;
                    }
                }
            }
        }
        let n = batch.len() as u64;
        let sent = std::mem::replace(&mut batch, Vec::with_capacity(MAX_BATCH));
        let result = tokio::time::timeout(EXPORT_TIMEOUT, exporter.export(sent)).await;
        match result {
            Ok(Ok(())) => counters.exported.inc_by(n),
            failed => {
                counters
                    .dropped
                    .with_label_values(&["export_failed"])
                    .inc_by(n);
                if last_warning.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
                    last_warning = Some(Instant::now());
                    let error = match failed {
                        Ok(Err(e)) => e.to_string(),
                        _ => format!("no answer within {EXPORT_TIMEOUT:?}"),
                    };
                    tracing::warn!(
                        endpoint = %url, spans = n, error = %error,
                        "cannot export spans to the OTLP collector; they are dropped (counted in *_trace_spans_dropped_total), delivery is not affected"
                    );
                }
            }
        }
    }
}
