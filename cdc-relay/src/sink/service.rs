//! The HTTP client that performs one delivery attempt.
//!
//! One pooled `reqwest` client (rustls, keep-alive) per relay. Each attempt
//! POSTs the exact signed body with:
//!
//! ```text
//! Content-Type: application/json
//! X-Event-Signature: <lowercase hex HMAC-SHA256(secret, body)>
//! Idempotency-Key: <event id, header-safe>
//! ```
//!
//! and reports an [`Attempt`]; deciding what it means is
//! [`classify`](crate::sink::classify())'s job.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::HeaderValue;
use http::header::{CONTENT_TYPE, RETRY_AFTER};

use crate::outbox::OutboxEvent;
use crate::sink::encoder::{self, Signer};

/// How to reach the sink.
#[derive(Clone, Debug)]
pub struct SinkConfig {
    /// The inbox URL events are POSTed to.
    pub url: reqwest::Url,
    /// HMAC key for `X-Event-Signature`.
    pub signer: Signer,
    /// TCP (and TLS) connect timeout.
    pub connect_timeout: Duration,
    /// Whole-request timeout, from send to the end of the response body.
    pub request_timeout: Duration,
    /// Extra PEM CA certificate to trust for an `https` sink.
    pub ca_cert_pem: Option<Vec<u8>>,
}

/// The sink client could not be built (bad CA file, TLS setup).
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The configured CA certificate is not valid PEM.
    #[error("sink CA certificate (--sink-ca-file) is not a valid PEM certificate: {0}")]
    BadCaCert(String),
    /// reqwest could not build a client.
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
}

/// The result of one POST.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Attempt {
    /// A response arrived.
    Response {
        /// HTTP status code.
        status: u16,
        /// `Retry-After`, parsed from seconds or an HTTP-date.
        retry_after: Option<Duration>,
        /// The first bytes of the response body (lossy UTF-8), for logs and
        /// the dead-letter row. At most [`EXCERPT_BYTES`] bytes.
        excerpt: String,
    },
    /// No complete response within the request timeout.
    Timeout,
    /// Could not connect (refused, DNS, TLS handshake).
    Connect(String),
    /// The connection broke mid-request, or another transport error.
    Transport(String),
}

/// Maximum response-body bytes kept in [`Attempt::Response::excerpt`].
pub const EXCERPT_BYTES: usize = 512;

/// The HTTP sink: shared by all deliveries; cheap to clone.
#[derive(Clone, Debug)]
pub struct HttpSink {
    client: reqwest::Client,
    url: reqwest::Url,
    signer: Signer,
}

impl HttpSink {
    /// Builds the pooled client.
    pub fn new(cfg: SinkConfig) -> Result<Self, SinkError> {
        let mut builder = reqwest::Client::builder()
            .connect_timeout(cfg.connect_timeout)
            .timeout(cfg.request_timeout)
            .pool_idle_timeout(Duration::from_secs(60))
            .tcp_nodelay(true)
            // A redirect is a configuration fault (DESIGN §4), never followed.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("cdc-relay/", env!("CARGO_PKG_VERSION")));
        if let Some(pem) = &cfg.ca_cert_pem {
            let cert = reqwest::Certificate::from_pem(pem)
                .map_err(|e| SinkError::BadCaCert(e.to_string()))?;
            builder = builder.add_root_certificate(cert);
        }
        let client = builder
            .build()
            .map_err(|e| SinkError::Client(e.to_string()))?;
        Ok(HttpSink {
            client,
            url: cfg.url,
            signer: cfg.signer,
        })
    }

    /// The configured URL.
    pub fn url(&self) -> &reqwest::Url {
        &self.url
    }

    /// The URL without any user or password, safe to log.
    pub fn display_url(&self) -> String {
        let mut u = self.url.clone();
        // Cannot fail for http(s) URLs, which are the only ones accepted.
        let _ = u.set_username("");
        let _ = u.set_password(None);
        u.to_string()
    }

    /// Builds the body for `event` and signs it: `(body, signature)`.
    pub fn prepare(&self, event: &OutboxEvent) -> (Bytes, String) {
        let body = encoder::body(event);
        let signature = self.signer.sign(&body);
        (body, signature)
    }

    /// POSTs a prepared body once.
    pub async fn post(&self, event_id: &str, body: Bytes, signature: &str) -> Attempt {
        let key = HeaderValue::from_str(&encoder::header_safe(event_id))
            .expect("header_safe output is a valid header value");
        let sent = self
            .client
            .post(self.url.clone())
            .header(CONTENT_TYPE, "application/json")
            .header("X-Event-Signature", signature)
            .header("Idempotency-Key", key)
            .body(body)
            .send()
            .await;
        let mut resp = match sent {
            Ok(r) => r,
            Err(e) => return transport_error(&e),
        };
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()));
        let mut excerpt = Vec::new();
        // Read at most EXCERPT_BYTES; the rest is discarded with the connection
        // only if it is large (reqwest drains small bodies for reuse).
        loop {
            match resp.chunk().await {
                Ok(Some(chunk)) => {
                    let room = EXCERPT_BYTES.saturating_sub(excerpt.len());
                    excerpt.extend_from_slice(&chunk[..chunk.len().min(room)]);
                    if excerpt.len() >= EXCERPT_BYTES {
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) if e.is_timeout() => return Attempt::Timeout,
                // The status arrived; a broken body does not change it.
                Err(_) => break,
            }
        }
        Attempt::Response {
            status,
            retry_after,
            excerpt: String::from_utf8_lossy(&excerpt).into_owned(),
        }
    }
}

fn transport_error(e: &reqwest::Error) -> Attempt {
    if e.is_timeout() {
        Attempt::Timeout
    } else if e.is_connect() {
        Attempt::Connect(error_chain(e))
    } else {
        Attempt::Transport(error_chain(e))
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
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
mod tests {
    use super::*;

    #[test]
    fn retry_after_forms() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:40 GMT", now),
            Some(Duration::from_secs(3))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("-1", now), None);
        assert_eq!(parse_retry_after("soon", now), None);
    }
}
