//! The HTTP client that performs one delivery attempt.
//!
//! One pooled client per relay: hyper-util's legacy client (keep-alive
//! pool, HTTP/1.1, HTTP/2 when a TLS sink offers it through ALPN) over
//! rustls. The URI, the `Authorization` header from URL credentials and the
//! fixed headers are built once; each attempt POSTs the exact signed body
//! with:
//!
//! ```text
//! Content-Type: application/json
//! X-Event-Signature: <lowercase hex HMAC-SHA256(secret, body)>
//! Idempotency-Key: <event id, header-safe>
//! ```
//!
//! and reports an [`Attempt`]; deciding what it means is
//! [`classify`](crate::sink::classify())'s job. Redirects are never followed
//! (a redirect is a configuration fault, DESIGN §4); proxy environment
//! variables are not read.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER, USER_AGENT};
use http::{HeaderValue, Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use crate::outbox::OutboxEvent;
use crate::sink::encoder::{self, Signer};

/// How to reach the sink.
#[derive(Clone, Debug)]
pub struct SinkConfig {
    /// The inbox URL events are POSTed to (`http` or `https`; a user and
    /// password in it become an `Authorization: Basic` header).
    pub url: url::Url,
    /// HMAC key for `X-Event-Signature`.
    pub signer: Signer,
    /// TCP connect timeout.
    pub connect_timeout: Duration,
    /// Whole-attempt timeout: connect, TLS, send, and the response up to the
    /// end of its body (or [`EXCERPT_BYTES`] of it).
    pub request_timeout: Duration,
    /// Extra PEM CA certificate(s) to trust for an `https` sink, besides
    /// the webpki roots.
    pub ca_cert_pem: Option<Vec<u8>>,
}

/// The sink client could not be built (bad CA file, bad URL).
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The configured CA certificate is not valid PEM.
    #[error("sink CA certificate (--sink-ca-file) is not a valid PEM certificate: {0}")]
    BadCaCert(String),
    /// The client cannot be built for this URL.
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
    /// No complete response within the request timeout (or the TCP connect
    /// timeout).
    Timeout,
    /// Could not connect (refused, DNS, TLS handshake).
    Connect(String),
    /// The connection broke mid-request, or another transport error.
    Transport(String),
}

/// Maximum response-body bytes kept in [`Attempt::Response::excerpt`].
pub const EXCERPT_BYTES: usize = 512;

type Pool = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// What every request reuses, built once.
#[derive(Debug)]
struct Target {
    url: url::Url,
    uri: Uri,
    authorization: Option<HeaderValue>,
    request_timeout: Duration,
}

/// The HTTP sink: shared by all deliveries; cheap to clone.
#[derive(Clone, Debug)]
pub struct HttpSink {
    client: Pool,
    target: Arc<Target>,
    signer: Signer,
}

impl HttpSink {
    /// Builds the pooled client. Errors: a CA file without a usable
    /// certificate, a URL that is not a valid request target.
    pub fn new(cfg: SinkConfig) -> Result<Self, SinkError> {
        let mut roots = RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        if let Some(pem) = &cfg.ca_cert_pem {
            let certs = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| SinkError::BadCaCert(e.to_string()))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(SinkError::BadCaCert(
                    "no usable certificate in the file".into(),
                ));
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| SinkError::Client(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut tcp = HttpConnector::new();
        tcp.set_connect_timeout(Some(cfg.connect_timeout));
        tcp.set_nodelay(true);
        tcp.enforce_http(false);
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(tcp);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .build(connector);

        let mut bare = cfg.url.clone();
        let authorization = if cfg.url.username().is_empty() && cfg.url.password().is_none() {
            None
        } else {
            let user = percent_decode(cfg.url.username());
            let password = cfg.url.password().map(percent_decode).unwrap_or_default();
            let token =
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
            let mut value = HeaderValue::from_str(&format!("Basic {token}"))
                .map_err(|e| SinkError::Client(e.to_string()))?;
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
        Ok(HttpSink {
            client,
            target: Arc::new(Target {
                url: cfg.url,
                uri,
                authorization,
                request_timeout: cfg.request_timeout,
            }),
            signer: cfg.signer,
        })
    }

    /// The configured URL.
    pub fn url(&self) -> &url::Url {
        &self.target.url
    }

    /// The URL without any user or password, safe to log.
    pub fn display_url(&self) -> String {
        let mut u = self.target.url.clone();
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

    /// POSTs a prepared body once, within the request timeout.
    pub async fn post(&self, event_id: &str, body: Bytes, signature: &str) -> Attempt {
        let timeout = self.target.request_timeout;
        match tokio::time::timeout(timeout, self.attempt(event_id, body, signature)).await {
            Ok(attempt) => attempt,
            Err(_) => Attempt::Timeout,
        }
    }

    async fn attempt(&self, event_id: &str, body: Bytes, signature: &str) -> Attempt {
        let key = HeaderValue::from_str(&encoder::header_safe(event_id))
            .expect("header_safe output is a valid header value");
        let signature =
            HeaderValue::from_str(signature).expect("a hex signature is a valid header value");
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = self.target.uri.clone();
        let headers = req.headers_mut();
        headers.reserve(5);
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert("x-event-signature", signature);
        headers.insert("idempotency-key", key);
        headers.insert(USER_AGENT, HeaderValue::from_static(USER_AGENT_VALUE));
        if let Some(auth) = &self.target.authorization {
            headers.insert(AUTHORIZATION, auth.clone());
        }
        let resp = match self.client.request(req).await {
            Ok(r) => r,
            Err(e) => return request_error(&e),
        };
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()));
        let mut body = resp.into_body();
        let mut excerpt = Vec::new();
        // Read to the end (the connection goes back to the pool) unless the
        // body is longer than the excerpt: then the connection is dropped.
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => {
                    if let Some(chunk) = frame.data_ref() {
                        let room = EXCERPT_BYTES.saturating_sub(excerpt.len());
                        excerpt.extend_from_slice(&chunk[..chunk.len().min(room)]);
                        if excerpt.len() >= EXCERPT_BYTES {
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
            excerpt: String::from_utf8_lossy(&excerpt).into_owned(),
        }
    }
}

const USER_AGENT_VALUE: &str = concat!("cdc-relay/", env!("CARGO_PKG_VERSION"));

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

fn request_error(e: &hyper_util::client::legacy::Error) -> Attempt {
    if e.is_connect() {
        if source_is_timeout(e) {
            Attempt::Timeout
        } else {
            Attempt::Connect(crate::error_chain(e))
        }
    } else {
        Attempt::Transport(crate::error_chain(e))
    }
}

/// A connect error whose cause is the TCP connect timeout.
fn source_is_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(e), |e| e.source()).any(|err| {
        err.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
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
mod tests {
    use super::*;

    fn sink(url: &str, request_timeout: Duration) -> HttpSink {
        HttpSink::new(SinkConfig {
            url: url.parse().unwrap(),
            signer: Signer::new(b"k"),
            connect_timeout: Duration::from_secs(1),
            request_timeout,
            ca_cert_pem: None,
        })
        .unwrap()
    }

    /// A real HTTP server that answers `status` with a body and records the
    /// request line and headers of every request.
    async fn recording_server(
        status: u16,
        body: &'static str,
    ) -> (String, Arc<std::sync::Mutex<Vec<http::request::Parts>>>) {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = Arc::clone(&seen);
        let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
            let record = Arc::clone(&record);
            async move {
                let (parts, _) = req.into_parts();
                record.lock().unwrap().push(parts);
                (http::StatusCode::from_u16(status).unwrap(), body)
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (format!("http://{addr}"), seen)
    }

    #[tokio::test]
    async fn posts_the_wire_headers_and_url_credentials_as_basic_auth() {
        let (base, seen) = recording_server(204, "").await;
        let url = base.replace("http://", "http://relay:p%40ss@") + "/inbox?x=1#frag";
        let s = sink(&url, Duration::from_secs(5));
        for _ in 0..3 {
            let got = s.post("e 1", Bytes::from_static(b"{}"), "abc").await;
            assert!(
                matches!(got, Attempt::Response { status: 204, .. }),
                "{got:?}"
            );
        }
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 3);
        let p = &seen[0];
        assert_eq!(p.method, http::Method::POST);
        assert_eq!(p.uri.path_and_query().unwrap().as_str(), "/inbox?x=1");
        let h = |n: &str| p.headers.get(n).unwrap().to_str().unwrap().to_owned();
        assert_eq!(h("content-type"), "application/json");
        assert_eq!(h("x-event-signature"), "abc");
        assert_eq!(h("idempotency-key"), "e%201");
        assert!(h("user-agent").starts_with("cdc-relay/"));
        // base64("relay:p@ss")
        assert_eq!(h("authorization"), "Basic cmVsYXk6cEBzcw==");
        assert!(!s.display_url().contains("p%40ss"), "{}", s.display_url());
    }

    #[tokio::test]
    async fn status_retry_after_and_excerpt_are_reported() {
        let long: &'static str = Box::leak("x".repeat(2 * EXCERPT_BYTES).into_boxed_str());
        let (base, _) = recording_server(503, long).await;
        let got = sink(&format!("{base}/inbox"), Duration::from_secs(5))
            .post("e", Bytes::from_static(b"{}"), "abc")
            .await;
        match got {
            Attempt::Response {
                status, excerpt, ..
            } => {
                assert_eq!(status, 503);
                assert_eq!(excerpt.len(), EXCERPT_BYTES);
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn refused_is_connect_and_silence_is_timeout() {
        // A port nobody listens on: bind, learn the port, close.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let got = sink(
            &format!("http://127.0.0.1:{port}/inbox"),
            Duration::from_secs(5),
        )
        .post("e", Bytes::from_static(b"{}"), "abc")
        .await;
        assert!(matches!(got, Attempt::Connect(_)), "{got:?}");

        // A server that accepts and never answers.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((sock, _)) = silent.accept().await {
                held.push(sock);
            }
        });
        let started = std::time::Instant::now();
        let got = sink(&format!("http://{addr}/inbox"), Duration::from_millis(300))
            .post("e", Bytes::from_static(b"{}"), "abc")
            .await;
        assert_eq!(got, Attempt::Timeout);
        assert!(started.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused() {
        let err = HttpSink::new(SinkConfig {
            url: "https://localhost/inbox".parse().unwrap(),
            signer: Signer::new(b"k"),
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(1),
            ca_cert_pem: Some(b"not a certificate".to_vec()),
        })
        .unwrap_err();
        assert!(matches!(err, SinkError::BadCaCert(_)), "{err}");
    }

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
