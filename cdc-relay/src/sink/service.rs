//! The HTTP client that performs one delivery attempt.
//!
//! One set of connections per sink ([`crate::sink::connection`]): the
//! relay's own keep-alive HTTP/1.1 connections, each driven by the attempt
//! that holds it, or one shared HTTP/2 connection when a TLS sink chooses
//! `h2` by ALPN, over rustls. A connection idle for `--sink-idle-timeout`
//! is closed, and none takes a request past `--sink-connection-max-age`,
//! so the next connection looks the name up again and follows a DNS change.
//!
//! A request the sink never processed — canceled on an idle connection
//! that had closed, an HTTP/2 stream refused (`REFUSED_STREAM`) or above a
//! GOAWAY's last stream id — is sent again at once on another connection, once: it is a
//! connection event, not a sink failure. Whatever the second try gives is
//! the attempt's result (the breaker judges the second). A request canceled
//! on a brand-new HTTP/1.1 connection is not sent again: a front that
//! closes or resets every new connection is a dead sink, and each attempt
//! must stay one request there (`docs/architecture.md#circuit-breaker`).
//! An HTTP/2 stream reset for another reason (`INTERNAL_ERROR`, `CANCEL`,
//! …) is a failed attempt that leaves the shared connection in service. The URI, the `Authorization` header from URL credentials and the
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

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use http::header::{AUTHORIZATION, CONTENT_TYPE, HOST, LOCATION, RETRY_AFTER, USER_AGENT};
use http::{HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::Full;
use hyper_rustls::HttpsConnectorBuilder;
use hyper_util::client::legacy::connect::HttpConnector;

use crate::outbox::OutboxEvent;
use crate::sink::answers::ANSWERS_BYTES;
use crate::sink::connection::{Conn, Connections, Http2};
use crate::sink::encoder::{self, Prepared};
use crate::sink::signature::Signing;
use crate::sink::{Sink, TraceHeaders};
use failure::{closed_under, connect_error, never_processed, stream_reset, transport_detail};

/// Whether `url` can be a sink's inbox: `http` or `https`, with a host
/// and a port other than 0 (which nothing listens on: a typo, or a
/// template's placeholder). `Err` says what is wrong, for the caller to
/// prefix with the setting's name (`--sink-url`, a routes file's `url`).
pub fn check_url(url: &url::Url) -> Result<(), String> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("must be http or https, got {}", url.scheme()));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err("has no host, e.g. http://billing:8080/inbox".into());
    }
    if url.port() == Some(0) {
        return Err("has port 0, which nothing listens on: give the inbox's port, e.g. http://billing:8080/inbox".into());
    }
    Ok(())
}

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
    /// end of its body (or [`EXCERPT_BYTES`] of it). A 2xx other than 207
    /// whose body has not all arrived when it runs out is the sink's answer
    /// all the same: only a 207's body carries the outcome.
    pub request_timeout: Duration,
    /// Age after which a connection takes no new request: it is closed
    /// when its request ends (and an idle one when the reaper finds it).
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

/// What every request reuses, built once.
#[derive(Debug)]
struct Target {
    url: url::Url,
    /// The absolute URL without credentials or fragment: the target of
    /// an HTTP/2 request (`:scheme`, `:authority`, `:path`).
    uri: Uri,
    /// Its path and query: the target of an HTTP/1.1 request (RFC 9112
    /// §3.2.1, origin-form).
    origin_form: Uri,
    /// `Host` of an HTTP/1.1 request, made once. An HTTP/2 request carries
    /// `:authority` instead (some front ends reset a stream that has both).
    host: HeaderValue,
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

/// The HTTP sink: shared by all deliveries; cheap to clone.
#[derive(Clone, Debug)]
pub struct HttpSink {
    connections: Arc<Connections>,
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
        let origin_form = uri
            .path_and_query()
            .map_or_else(|| Uri::from_static("/"), |p| Uri::from(p.clone()));
        let connections = Connections::new(
            connector,
            uri.clone(),
            cfg.idle_timeout,
            cfg.connection_max_age,
        );
        Ok(HttpSink {
            connections: Arc::new(connections),
            metrics: None,
            target: Arc::new(Target {
                secrets: url_secrets(&cfg.url, basic_token.as_deref()),
                url: cfg.url,
                uri,
                origin_form,
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
        reached: &mut Reached,
    ) -> Attempt {
        let id = encoder::header_safe(event_id);
        // One read per attempt: a reload during it changes the next one.
        let signer = self.signing.current();
        let legacy = request.legacy_signature(&signer);
        let timestamp = unix_seconds();
        let standard = signer.standard(&id, timestamp, &request.body);
        let key = HeaderValue::from_str(&id).expect("header_safe output is a valid header value");
        let build = |http1: bool| {
            let mut req = Request::new(Full::new(request.body.clone()));
            *req.method_mut() = Method::POST;
            *req.uri_mut() = if http1 {
                self.target.origin_form.clone()
            } else {
                self.target.uri.clone()
            };
            let headers = req.headers_mut();
            headers.reserve(8);
            if http1 {
                headers.insert(HOST, self.target.host.clone());
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
        let mut retried = false;
        let exchange = loop {
            let conn = if retried {
                self.connections.checkout_new().await
            } else {
                self.connections.checkout().await
            };
            let mut conn = match conn {
                Ok(conn) => conn,
                Err(e) => return connect_error(&*e),
            };
            reached.connected = true;
            if let Conn::Http2(h2) = &conn {
                reached.on_h2 = Some(h2.clone());
            }
            match conn
                .exchange(build(conn.is_http1()), excerpt_limit, &mut reached.answered)
                .await
            {
                Ok((exchange, to_end)) => {
                    // Read to the end: the connection takes the next
                    // request. Longer than the limit: it is dropped.
                    if to_end {
                        self.connections.checkin(conn);
                    }
                    break exchange;
                }
                Err(e)
                    if !retried
                        && conn.was_live()
                        && (never_processed(&e) || closed_under(&e, &conn)) =>
                {
                    // Not a sink failure: the same request once more, at
                    // once, on another connection (this one is not reused).
                    self.connections.discard(&conn);
                    if let Some(m) = &self.metrics {
                        m.sink_fresh_connection_retries.inc();
                        // One refusing connection is one event, however
                        // many of its requests come back.
                        if conn.first_refusal() {
                            m.sink_connection_events.inc();
                        }
                    }
                    tracing::debug!(event_id = %id, error = %crate::error_chain(&e), "the sink did not process the request; sending it again on another connection");
                    retried = true;
                }
                Err(e) => {
                    if !stream_reset(&e) {
                        self.connections.discard(&conn);
                    }
                    return Attempt::Transport(transport_detail(&e));
                }
            }
        };
        let status = exchange.head.status().as_u16();
        let retry_after = exchange.head.headers().get(RETRY_AFTER).and_then(|v| {
            let parsed = v
                .to_str()
                .ok()
                .and_then(|v| parse_retry_after(v, SystemTime::now()));
            if parsed.is_none() {
                tracing::debug!(event_id = %id, status, value = ?v,
                    "the sink's Retry-After is neither delay-seconds nor an HTTP-date: ignored");
            }
            parsed
        });
        let mut excerpt = String::from_utf8_lossy(&exchange.body).into_owned();
        // A redirect's target is what the operator must put in --sink-url:
        // shown first (without userinfo or query values).
        if (300..400).contains(&status)
            && let Some(location) = exchange.head.headers().get(LOCATION)
        {
            let location = crate::redact::url(&String::from_utf8_lossy(location.as_bytes()));
            excerpt = format!("Location: {location} {excerpt}");
        }
        Attempt::Response {
            status,
            retry_after,
            excerpt: masked(excerpt, &self.target.secrets),
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
        let mut reached = Reached::default();
        let attempt = self.attempt(event_id, request, trace, &mut reached);
        match tokio::time::timeout(timeout, attempt).await {
            Ok(attempt) => attempt,
            Err(_) => timed_out(&self.connections, reached),
        }
    }
}

/// The attempt's result when its timeout ran out. A timed-out request
/// leaves its connection, as an HTTP/1.1 attempt drops its own: the
/// shared HTTP/2 connection it went on takes no new request, so one
/// connection gone silent (a hung worker, a half-open path after a
/// failover) costs one timeout, not every request until its
/// `--sink-connection-max-age`.
fn timed_out(connections: &Connections, reached: Reached) -> Attempt {
    if let Some(h2) = reached.on_h2 {
        connections.discard_h2(&h2);
        tracing::debug!(
            "a request timed out on the sink's HTTP/2 connection: the next requests go on a new connection"
        );
    }
    match reached.answered {
        // The status line said 2xx and the body is late: the sink took
        // the event, as when a 2xx's body is cut. A 207's body is its
        // answer (per event), so a late one is no answer.
        Some(status) if status.is_success() && status != StatusCode::MULTI_STATUS => {
            Attempt::Response {
                status: status.as_u16(),
                retry_after: None,
                excerpt: String::new(),
            }
        }
        // A TLS handshake that never completes (a listener that accepts
        // and then says nothing) is no slow answer: the detail says so.
        _ if !reached.connected => Attempt::ConnectTimeout,
        _ => Attempt::Timeout,
    }
}

/// How far an attempt got, read when its timeout ends it.
#[derive(Default)]
struct Reached {
    /// A connection was made (or taken from the idle ones).
    connected: bool,
    /// The shared HTTP/2 connection it went on.
    on_h2: Option<Http2>,
    /// The status line that arrived, if any.
    answered: Option<StatusCode>,
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

/// The `Host` header of HTTP/1.1 requests to `uri`: its host, and its
/// port when that is not the scheme's default (80 for `http`, 443 for
/// `https`; RFC 9110 §7.2).
fn host_header(uri: &Uri) -> Result<HeaderValue, SinkError> {
    let host = uri
        .host()
        .ok_or_else(|| SinkError::Client("sink URL: no host".into()))?;
    let default = if uri.scheme_str() == Some("https") {
        443
    } else {
        80
    };
    let value = match uri.port_u16() {
        Some(port) if port != default => format!("{host}:{port}"),
        _ => host.to_owned(),
    };
    HeaderValue::from_str(&value).map_err(|e| SinkError::Client(format!("sink URL's host: {e}")))
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

/// How much of a response body is read: all of a 207's (it may carry each
/// event's answer) up to [`ANSWERS_BYTES`], else an excerpt. A longer body
/// is cut there and its connection dropped.
fn excerpt_limit(status: u16) -> usize {
    if status == 207 {
        ANSWERS_BYTES
    } else {
        EXCERPT_BYTES
    }
}

/// Parses `Retry-After` (RFC 9110 §10.2.3): delay-seconds or an HTTP-date
/// (a date in the past means zero). Anything longer than
/// [`RETRY_AFTER_LONGEST`] (delay-seconds too large for a `u64` included:
/// "a very long time", as RFC 9111 §1.2.2 reads an overflowing
/// delta-seconds) is that, for the caller's cap; logs show a figure, not
/// 1.8e19. `None`: not a `Retry-After` value (a sign, a fraction, words).
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    let after = if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        Duration::from_secs(value.parse::<u64>().unwrap_or(u64::MAX))
    } else {
        let at = httpdate::parse_http_date(value).ok()?;
        at.duration_since(now).unwrap_or(Duration::ZERO)
    };
    Some(after.min(RETRY_AFTER_LONGEST))
}

/// The longest `Retry-After` read: one year (the relay's pause is capped
/// far below it, by `--retry-after-max`).
pub const RETRY_AFTER_LONGEST: Duration = Duration::from_secs(365 * 24 * 3600);

mod failure;
#[cfg(test)]
mod tests;
