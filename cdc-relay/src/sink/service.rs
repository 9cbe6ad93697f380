//! The HTTP client that performs one delivery attempt.
//!
//! One pooled client per relay: hyper-util's legacy client (keep-alive
//! pool, HTTP/1.1, HTTP/2 when a TLS sink offers it through ALPN) over
//! rustls. A pooled connection idle for `--sink-idle-timeout` is closed,
//! and none is reused past `--sink-connection-max-age`: the client (with
//! its pool) is replaced by a new one once it is that old, so the next
//! requests look the name up again and follow a DNS change; requests on the
//! old connections finish there.
//!
//! A request the sink never processed — canceled on a pooled connection
//! that had closed, an HTTP/2 stream refused (`REFUSED_STREAM`) or above a
//! GOAWAY's last stream id — is sent again at once on a new connection, once: it is a
//! connection event, not a sink failure. Whatever the second try gives is
//! the attempt's result (the breaker judges the second). A request canceled
//! on a brand-new HTTP/1.1 connection is not sent again: a front that
//! closes or resets every new connection is a dead sink, and each attempt
//! must stay one request there (`docs/architecture.md#circuit-breaker`). The URI, the `Authorization` header from URL credentials and the
//! fixed headers are built once; each attempt POSTs the exact body with
//! (`--signature-scheme both`, the default):
//!
//! ```text
//! Content-Type: application/json
//! Idempotency-Key: <event id, header-safe>
//! X-Event-Signature: <lowercase hex HMAC-SHA256(current key, body)>
//! webhook-id: <the same as Idempotency-Key>
//! webhook-timestamp: <unix seconds of this attempt>
//! webhook-signature: v1,<base64 HMAC-SHA256(key, "id.timestamp.body")> [one per key]
//! traceparent: <the attempt's W3C trace context>  [when the row stored one]
//! tracestate: <the trace's vendor state>           [when it has one]
//! ```
//!
//! and reports an [`Attempt`]; deciding what it means is
//! [`classify`](crate::sink::classify())'s job. Redirects are never followed
//! (a redirect is a configuration fault,
//! `docs/architecture.md#response-classes`); proxy environment
//! variables are not read.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, HOST, RETRY_AFTER, USER_AGENT};
use http::{HeaderName, HeaderValue, Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::outbox::OutboxEvent;
use crate::sink::answers::ANSWERS_BYTES;
use crate::sink::connection::{ConnectionTag, Tagging};
use crate::sink::encoder::{self, Prepared};
use crate::sink::signature::Signing;
use crate::sink::{Sink, TraceHeaders};

/// How to reach the sink.
#[derive(Clone, Debug)]
pub struct SinkConfig {
    /// The inbox URL events are POSTed to (`http` or `https`; a user and
    /// password in it become an `Authorization: Basic` header).
    pub url: url::Url,
    /// The signer, replaceable while deliveries run (a reload).
    pub signing: Signing,
    /// TCP connect timeout.
    pub connect_timeout: Duration,
    /// Whole-attempt timeout: connect, TLS, send, and the response up to the
    /// end of its body (or [`EXCERPT_BYTES`] of it).
    pub request_timeout: Duration,
    /// Age after which a pooled connection takes no new request (the
    /// client and its pool are replaced).
    pub connection_max_age: Duration,
    /// Idle time after which a pooled connection is closed.
    pub idle_timeout: Duration,
    /// The TLS files for an `https` sink (extra CA, client certificate),
    /// read again for each new connection.
    pub tls: super::tls::SinkTls,
}

/// The sink client could not be built (bad CA file, bad URL).
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The configured CA certificate is not valid PEM.
    #[error("sink CA certificate (--sink-ca-file) is not a valid PEM certificate: {0}")]
    BadCaCert(String),
    /// The client certificate or its key does not load.
    #[error("sink client certificate: {0}")]
    BadClientCert(String),
    /// The client cannot be built for this URL.
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
}

pub use super::attempt::{Attempt, EXCERPT_BYTES};

type Connector = Tagging<HttpsConnector<HttpConnector>>;

type Pool = Client<Connector, Full<Bytes>>;

/// What every request reuses, built once.
#[derive(Debug)]
struct Target {
    url: url::Url,
    uri: Uri,
    /// `Host` for a plain-HTTP sink, made once (the client would format it
    /// for every request). `None` for HTTPS: a connection may speak HTTP/2
    /// there (ALPN), which carries `:authority` instead, and some front
    /// ends reset a stream that has both; the client adds it for HTTP/1.1.
    host: Option<HeaderValue>,
    authorization: Option<HeaderValue>,
    request_timeout: Duration,
    /// What the URL carries that must not be shown ([`url_secrets`]):
    /// masked in every response excerpt, which goes to logs, dead-letter
    /// rows and the replay command's output (a sink's error page may echo
    /// the request's URL or `Authorization` header).
    secrets: Vec<String>,
}

/// The sink URL's secrets as a response body could echo them: the
/// password (as written and decoded), the `Authorization: Basic` token,
/// and each query value (as written and decoded) of 4 characters or more
/// (a shorter one would mask ordinary text).
fn url_secrets(url: &url::Url, basic_token: Option<&str>) -> Vec<String> {
    let mut secrets: Vec<String> = Vec::new();
    if let Some(p) = url.password() {
        secrets.extend([p.to_owned(), percent_decode(p)]);
    }
    secrets.extend(basic_token.map(str::to_owned));
    if let Some(q) = url.query() {
        for pair in q.split('&') {
            if let Some((_, v)) = pair.split_once('=') {
                secrets.extend([v.to_owned(), percent_decode(v)]);
            }
        }
    }
    secrets.retain(|s| s.chars().count() >= 4);
    // Longest first: a secret that contains another is masked whole.
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    secrets.dedup();
    secrets
}

/// `text` with each of `secrets` replaced by `***`.
fn masked(text: String, secrets: &[String]) -> String {
    if !secrets.iter().any(|s| text.contains(s.as_str())) {
        return text;
    }
    secrets
        .iter()
        .fold(text, |t, s| t.replace(s.as_str(), "***"))
}

/// The pooled client and what it takes to make a new one.
struct Clients {
    connector: Connector,
    idle_timeout: Duration,
    max_age: Duration,
    /// The client in use and when it was made.
    current: RwLock<(Pool, Instant)>,
}

impl std::fmt::Debug for Clients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Clients")
            .field("idle_timeout", &self.idle_timeout)
            .field("max_age", &self.max_age)
            .finish_non_exhaustive()
    }
}

impl Clients {
    fn new(connector: Connector, idle_timeout: Duration, max_age: Duration) -> Self {
        let client = build_client(connector.clone(), idle_timeout);
        Clients {
            connector,
            idle_timeout,
            max_age,
            current: RwLock::new((client, Instant::now())),
        }
    }

    /// The client for the next request: a new one (an empty pool) once the
    /// current one is `max_age` old. The old one lives on in the requests
    /// that hold it, and its connections close when the last one ends.
    fn get(&self) -> Pool {
        {
            let current = self.current.read().expect("client lock is never poisoned");
            if current.1.elapsed() < self.max_age {
                return current.0.clone();
            }
        }
        let mut current = self.current.write().expect("client lock is never poisoned");
        if current.1.elapsed() >= self.max_age {
            *current = (
                build_client(self.connector.clone(), self.idle_timeout),
                Instant::now(),
            );
        }
        current.0.clone()
    }
}

fn build_client(connector: Connector, idle_timeout: Duration) -> Pool {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(idle_timeout)
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        // Our own single retry on a new connection replaces hyper-util's,
        // which loops for as long as it finds closed pooled connections.
        .retry_canceled_requests(false)
        .build(connector)
}

/// The HTTP sink: shared by all deliveries; cheap to clone.
#[derive(Clone, Debug)]
pub struct HttpSink {
    clients: Arc<Clients>,
    target: Arc<Target>,
    signing: Signing,
    metrics: Option<crate::metrics::Metrics>,
}

impl HttpSink {
    /// Builds the pooled client. Errors: a CA file without a usable
    /// certificate, a URL that is not a valid request target.
    pub fn new(cfg: SinkConfig) -> Result<Self, SinkError> {
        let tls = cfg.tls.client_config()?;
        let mut tcp = HttpConnector::new();
        tcp.set_connect_timeout(Some(cfg.connect_timeout));
        tcp.set_nodelay(true);
        tcp.enforce_http(false);
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(tcp);
        let clients = Clients::new(Tagging(connector), cfg.idle_timeout, cfg.connection_max_age);

        let mut bare = cfg.url.clone();
        let mut basic_token = None;
        let authorization = if cfg.url.username().is_empty() && cfg.url.password().is_none() {
            None
        } else {
            let user = percent_decode(cfg.url.username());
            let password = cfg.url.password().map(percent_decode).unwrap_or_default();
            let token =
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
            let mut value = HeaderValue::from_str(&format!("Basic {token}"))
                .map_err(|e| SinkError::Client(e.to_string()))?;
            basic_token = Some(token);
            value.set_sensitive(true);
            let _ = bare.set_username("");
            let _ = bare.set_password(None);
            Some(value)
        };
        // No fragment goes on the wire.
        bare.set_fragment(None);
        let uri: Uri = bare
            .as_str()
            .parse()
            .map_err(|e: http::uri::InvalidUri| SinkError::Client(format!("sink URL: {e}")))?;
        let host = host_header(&uri)?;
        Ok(HttpSink {
            clients: Arc::new(clients),
            metrics: None,
            target: Arc::new(Target {
                secrets: url_secrets(&cfg.url, basic_token.as_deref()),
                url: cfg.url,
                uri,
                host,
                authorization,
                request_timeout: cfg.request_timeout,
            }),
            signing: cfg.signing,
        })
    }

    /// Counts the sink's own events (immediate retries on a new
    /// connection) in `metrics`.
    pub fn with_metrics(mut self, metrics: crate::metrics::Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The configured URL.
    pub fn url(&self) -> &url::Url {
        &self.target.url
    }

    /// The signer slot: a reload replaces the signer in it.
    pub fn signing(&self) -> &Signing {
        &self.signing
    }

    /// The URL as [`crate::redact::url`] shows it (no userinfo, no query
    /// value), safe to log.
    pub fn display_url(&self) -> String {
        crate::redact::url(self.target.url.as_str())
    }

    async fn attempt(
        &self,
        event_id: &str,
        request: &Prepared,
        trace: Option<&TraceHeaders>,
    ) -> Attempt {
        let id = encoder::header_safe(event_id);
        // One read per attempt: a reload during it changes the next one.
        let signer = self.signing.current();
        let legacy = request.legacy_signature(&signer);
        let timestamp = unix_seconds();
        let standard = signer.standard(&id, timestamp, &request.body);
        let key = HeaderValue::from_str(&id).expect("header_safe output is a valid header value");
        let build = || {
            let mut req = Request::new(Full::new(request.body.clone()));
            *req.method_mut() = Method::POST;
            *req.uri_mut() = self.target.uri.clone();
            let headers = req.headers_mut();
            headers.reserve(8);
            if let Some(host) = &self.target.host {
                headers.insert(HOST, host.clone());
            }
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            if let Some(signature) = &legacy {
                headers.insert(X_EVENT_SIGNATURE, signature.clone());
            }
            if let Some(signature) = &standard {
                headers.insert(WEBHOOK_ID, key.clone());
                headers.insert(WEBHOOK_TIMESTAMP, HeaderValue::from(timestamp));
                headers.insert(WEBHOOK_SIGNATURE, signature.clone());
            }
            headers.insert(IDEMPOTENCY_KEY, key.clone());
            if let Some(n) = request.batch {
                headers.insert(X_EVENT_BATCH, HeaderValue::from(n));
            }
            headers.insert(USER_AGENT, HeaderValue::from_static(USER_AGENT_VALUE));
            if let Some(auth) = &self.target.authorization {
                headers.insert(AUTHORIZATION, auth.clone());
            }
            if let Some(trace) = trace {
                headers.insert(TRACEPARENT, trace.traceparent.clone());
                if let Some(state) = &trace.tracestate {
                    headers.insert(TRACESTATE, state.clone());
                }
            }
            req
        };
        let resp = match self.clients.get().request(build()).await {
            Ok(r) => r,
            Err(e) if never_processed(&e) && met_a_live_connection(&e) => {
                // Not a sink failure: the same request once more, at once,
                // on a new connection (the one it met is not reused).
                let connection = e.connect_info();
                if let Some(connected) = connection {
                    connected.poison();
                }
                if let Some(m) = &self.metrics {
                    m.sink_fresh_connection_retries.inc();
                    // One refusing connection is one event, however many
                    // of its requests come back.
                    let tag = connection.and_then(ConnectionTag::of);
                    if tag.is_none_or(|t| t.first_refusal()) {
                        m.sink_connection_events.inc();
                    }
                }
                tracing::debug!(event_id = %id, error = %crate::error_chain(&e), "the sink did not process the request; sending it again on a new connection");
                match self.clients.get().request(build()).await {
                    Ok(r) => r,
                    Err(e) => return request_error(&e),
                }
            }
            Err(e) => return request_error(&e),
        };
        if let Some(tag) = resp.extensions().get::<ConnectionTag>() {
            tag.mark_answered();
        }
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()));
        let mut body = resp.into_body();
        let mut excerpt = Vec::new();
        // A 207 may carry each event's answer: read all of it.
        let limit = if status == 207 {
            ANSWERS_BYTES
        } else {
            EXCERPT_BYTES
        };
        // Read to the end (the connection goes back to the pool) unless the
        // body is longer than the limit: then the connection is dropped.
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => {
                    if let Some(chunk) = frame.data_ref() {
                        let room = limit.saturating_sub(excerpt.len());
                        excerpt.extend_from_slice(&chunk[..chunk.len().min(room)]);
                        if excerpt.len() >= limit {
                            break;
                        }
                    }
                }
                // The status arrived; a broken body does not change it.
                Err(_) => break,
            }
        }
        Attempt::Response {
            status,
            retry_after,
            excerpt: masked(
                String::from_utf8_lossy(&excerpt).into_owned(),
                &self.target.secrets,
            ),
        }
    }
}

impl Sink for HttpSink {
    fn prepare(&self, event: &OutboxEvent) -> Prepared {
        Prepared::signed(encoder::body(event), self.signing.current())
    }

    fn prepare_batch(&self, events: &[&OutboxEvent]) -> (String, Prepared) {
        let id = encoder::batch_id(events.iter().map(|e| e.id.as_str()));
        let body = encoder::batch_body(events.iter().copied());
        let request = Prepared::signed(body, self.signing.current()).batch_of(events.len());
        (id, request)
    }

    /// POSTs the prepared body once, within the request timeout.
    async fn post(
        &self,
        event_id: &str,
        request: &Prepared,
        trace: Option<&TraceHeaders>,
    ) -> Attempt {
        let timeout = self.target.request_timeout;
        let attempt = self.attempt(event_id, request, trace);
        match tokio::time::timeout(timeout, attempt).await {
            Ok(attempt) => attempt,
            Err(_) => Attempt::Timeout,
        }
    }
}

// The wire format's own headers, made once: a name given as `&str` is
// parsed and copied into a new allocation on every insert.
const X_EVENT_SIGNATURE: HeaderName = HeaderName::from_static("x-event-signature");
const WEBHOOK_ID: HeaderName = HeaderName::from_static("webhook-id");
const WEBHOOK_TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
const WEBHOOK_SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");
const X_EVENT_BATCH: HeaderName = HeaderName::from_static("x-event-batch");
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

const USER_AGENT_VALUE: &str = concat!("cdc-relay/", env!("CARGO_PKG_VERSION"));

/// The `Host` header of requests to a plain-HTTP `uri` (always HTTP/1.1:
/// the client is not made HTTP/2-only): its host, and its port when that
/// is not 80 (RFC 9110 §7.2), as the client would write it. `None` for any
/// other scheme (see `Target::host`).
fn host_header(uri: &Uri) -> Result<Option<HeaderValue>, SinkError> {
    if uri.scheme_str() != Some("http") {
        return Ok(None);
    }
    let host = uri
        .host()
        .ok_or_else(|| SinkError::Client("sink URL: no host".into()))?;
    let value = match uri.port_u16() {
        Some(port) if port != 80 => format!("{host}:{port}"),
        _ => host.to_owned(),
    };
    HeaderValue::from_str(&value)
        .map(Some)
        .map_err(|e| SinkError::Client(format!("sink URL's host: {e}")))
}

/// `webhook-timestamp`: seconds since the Unix epoch, now.
fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

fn request_error(e: &hyper_util::client::legacy::Error) -> Attempt {
    if e.is_connect() {
        if source_is_timeout(e) {
            Attempt::Timeout
        } else if source_is_tls(e) {
            let chain = crate::error_chain(e);
            // rustls's words for a first record that is no TLS record: an
            // https:// URL reaching a plain-HTTP listener.
            if chain.contains("InvalidContentType") {
                Attempt::Tls(format!(
                    "{chain} (the endpoint answered in plain text: it does not speak TLS on \
                     that port; use http:// in the URL, or enable TLS on the endpoint)"
                ))
            } else {
                Attempt::Tls(chain)
            }
        } else {
            Attempt::Connect(crate::error_chain(e))
        }
    } else {
        Attempt::Transport(crate::error_chain(e))
    }
}

/// Whether the sink cannot have processed the request: it was canceled
/// before it was written (a pooled connection found closed), or its HTTP/2
/// stream was refused (`REFUSED_STREAM`, RFC 9113 §8.7) or reset by the
/// peer's GOAWAY (§6.8: streams above its last stream id were not
/// processed). A stream at or below that id cut by the connection closing
/// may have been processed: h2 reports it as a broken pipe, a transport
/// failure like any other.
fn never_processed(e: &hyper_util::client::legacy::Error) -> bool {
    std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |e| {
        e.source()
    })
    .any(|err| {
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            return h.is_canceled();
        }
        err.downcast_ref::<h2::Error>().is_some_and(|h| {
            h.reason() == Some(h2::Reason::REFUSED_STREAM) || (h.is_go_away() && h.is_remote())
        })
    })
}

/// Whether the connection a never-processed request met was a live one:
/// it had answered before (an HTTP/1.1 connection back from the pool that
/// the server closed while idle), or speaks HTTP/2 (the server completed
/// TLS and ALPN, then refused streams or drained). A request canceled on a
/// brand-new HTTP/1.1 connection met a front that closes or resets new
/// connections, which is a dead sink: a failure for the breaker, not a
/// reason to send the request again at once.
fn met_a_live_connection(e: &hyper_util::client::legacy::Error) -> bool {
    e.connect_info().is_some_and(|c| {
        c.is_negotiated_h2() || ConnectionTag::of(c).is_some_and(|t| t.has_answered())
    })
}

/// A connect error whose cause is the TCP connect timeout.
fn source_is_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(e), |e| e.source()).any(|err| {
        err.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
    })
}

/// A connect error whose cause is the TLS handshake: a rustls error, on
/// its own or wrapped in `io::Error`s (the TLS stream reports it in one and
/// the connector wraps that in another; `io::Error::source` skips both, so
/// their payloads are followed with `get_ref`).
fn source_is_tls(e: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(e), |e| e.source()).any(|err| {
        std::iter::successors(Some(err), |e| {
            e.downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::get_ref)
                .map(|inner| inner as &(dyn std::error::Error + 'static))
        })
        .any(|e| e.is::<rustls::Error>())
    })
}

/// Parses `Retry-After` (RFC 9110 §10.2.3): delay-seconds or an HTTP-date
/// (a date in the past means zero).
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests;
