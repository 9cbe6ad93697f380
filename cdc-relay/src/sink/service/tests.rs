//! The HTTP sink against real local servers: headers, signatures,
//! credentials, statuses, excerpts, refused connections, timeouts, bad CA
//! files.

use bytes::Bytes;
use event_secret::{CURRENT, EventKeys, Key};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::failure::source_is_tls;
use super::*;
use crate::sink::signature::{SignatureScheme, Signer};

/// Plain secrets of 32 bytes and more.
const KEY: &str = "unit-test-event-secret-0123456789";
const NEW_KEY: &str = "unit-test-event-secret-abcdefghij";

fn signer(scheme: SignatureScheme, current: &str, previous: Option<&str>) -> Signer {
    let key = |k: &str| Key::parse(k, "EVENT_SECRET", &CURRENT).unwrap();
    Signer::new(scheme, &EventKeys::new(key(current), previous.map(key)))
}

fn prepared(s: &HttpSink) -> Prepared {
    Prepared::signed(Bytes::from_static(b"{}"), s.signing().current())
}

fn sink(url: &str, request_timeout: Duration) -> HttpSink {
    sink_signing(
        url,
        request_timeout,
        signer(SignatureScheme::Both, KEY, None),
    )
}

fn sink_signing(url: &str, request_timeout: Duration, signer: Signer) -> HttpSink {
    HttpSink::new(SinkConfig {
        url: url.parse().unwrap(),
        signing: Signing::new(signer),
        connect_timeout: Duration::from_secs(1),
        request_timeout,
        connection_max_age: Duration::from_secs(60),
        idle_timeout: Duration::from_secs(30),
        tls: Default::default(),
    })
    .unwrap()
}

fn hmac(key: &str, parts: &[&[u8]]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key.as_bytes()).unwrap();
    for p in parts {
        mac.update(p);
    }
    mac.finalize().into_bytes().to_vec()
}

/// `v1,<base64 HMAC(key, id.ts.body)>`, computed here independently.
fn v1(key: &str, id: &str, ts: &str, body: &[u8]) -> String {
    let tag = hmac(key, &[id.as_bytes(), b".", ts.as_bytes(), b".", body]);
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(tag)
    )
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
    let before = unix_seconds();
    for _ in 0..3 {
        let got = s.post("e 1", &prepared(&s), None).await;
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
    assert_eq!(h("x-event-signature"), hex::encode(hmac(KEY, &[b"{}"])));
    assert_eq!(h("idempotency-key"), "e%201");
    assert_eq!(h("webhook-id"), "e%201");
    let ts = h("webhook-timestamp");
    let secs: u64 = ts.parse().unwrap();
    assert!((before..=unix_seconds()).contains(&secs), "{ts}");
    assert_eq!(h("webhook-signature"), v1(KEY, "e%201", &ts, b"{}"));
    assert!(h("user-agent").starts_with("cdc-relay/"));
    // The URL's host and port, without the credentials.
    assert_eq!(h("host"), base.trim_start_matches("http://"));
    assert_eq!(p.headers.get_all("host").iter().count(), 1);
    // base64("relay:p@ss")
    assert_eq!(h("authorization"), "Basic cmVsYXk6cEBzcw==");
    assert!(!s.display_url().contains("p%40ss"), "{}", s.display_url());
}

/// One check of a sink URL for `--sink-url` and a routes file's `url`.
#[test]
fn a_sink_url_needs_http_a_host_and_a_port_other_than_0() {
    for good in [
        "http://billing:8080/inbox",
        "https://b.example/x",
        "http://[::1]:9/in",
    ] {
        let url = url::Url::parse(good).unwrap();
        assert_eq!(super::check_url(&url), Ok(()), "{good}");
    }
    for (bad, says) in [
        ("ftp://billing/inbox", "must be http or https, got ftp"),
        ("http://billing:0/inbox", "port 0"),
        ("https://10.0.0.7:0/", "port 0"),
        ("file:///inbox", "must be http or https"),
    ] {
        let url = url::Url::parse(bad).unwrap();
        let why = super::check_url(&url).unwrap_err();
        assert!(why.contains(says), "{bad}: {why}");
    }
}

#[test]
fn the_host_header_names_a_port_that_is_not_the_schemes_default() {
    let value = |url: &str| host_header(&url.parse().unwrap()).unwrap();
    assert_eq!(value("http://billing/inbox"), "billing");
    assert_eq!(value("http://billing:80/inbox"), "billing");
    assert_eq!(value("http://127.0.0.1:8080/inbox"), "127.0.0.1:8080");
    assert_eq!(value("http://[::1]:9000/inbox"), "[::1]:9000");
    assert_eq!(value("https://billing/inbox"), "billing");
    assert_eq!(value("https://billing:443/inbox"), "billing");
    assert_eq!(value("https://billing:8443/inbox"), "billing:8443");
    assert_eq!(value("https://billing:80/inbox"), "billing:80");
}

#[tokio::test]
async fn status_retry_after_and_excerpt_are_reported() {
    let long: &'static str = Box::leak("x".repeat(2 * EXCERPT_BYTES).into_boxed_str());
    let (base, _) = recording_server(503, long).await;
    let got = sink(&format!("{base}/inbox"), Duration::from_secs(5))
        .post(
            "e",
            &prepared(&sink(&format!("{base}/inbox"), Duration::from_secs(5))),
            None,
        )
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
    let refused = sink(
        &format!("http://127.0.0.1:{port}/inbox"),
        Duration::from_secs(5),
    );
    let got = refused.post("e", &prepared(&refused), None).await;
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
    let silent = sink(&format!("http://{addr}/inbox"), Duration::from_millis(300));
    let got = silent.post("e", &prepared(&silent), None).await;
    assert_eq!(got, Attempt::Timeout);
    assert!(started.elapsed() < Duration::from_secs(3));
}

/// Issue 14, HTTP manners 6: a front that resets every new connection
/// (Billing killed behind it) is a dead sink, and each attempt there is one
/// request, never two: the immediate retry on a new connection is for a
/// connection that answered before (or speaks HTTP/2), not for a new one
/// closed before it could take the request.
#[tokio::test]
async fn a_front_resetting_every_new_connection_gets_one_per_attempt() {
    let (addr, accepted) = listener(|_, sock| async move {
        #[allow(deprecated)] // SO_LINGER 0: close with a reset
        let _ = sock.set_linger(Some(Duration::ZERO));
        drop(sock);
    })
    .await;
    let s = sink(&format!("http://{addr}/inbox"), Duration::from_secs(5));
    for n in 1..=40 {
        let got = s.post("e", &prepared(&s), None).await;
        assert!(
            matches!(got, Attempt::Transport(_) | Attempt::Connect(_)),
            "{got:?}"
        );
        // The client saw the reset, so the server had accepted (and
        // counted) every connection this attempt made.
        assert_eq!(
            accepted.load(std::sync::atomic::Ordering::SeqCst),
            n,
            "connections after {n} attempts"
        );
    }
}

#[tokio::test]
async fn each_scheme_sends_its_headers_and_a_rotation_signs_with_both_keys() {
    let (base, seen) = recording_server(204, "").await;
    let url = format!("{base}/inbox");
    let legacy = sink_signing(
        &url,
        Duration::from_secs(5),
        signer(SignatureScheme::Legacy, KEY, None),
    );
    legacy.post("e1", &prepared(&legacy), None).await;
    let standard = sink_signing(
        &url,
        Duration::from_secs(5),
        signer(SignatureScheme::Standard, NEW_KEY, Some(KEY)),
    );
    standard.post("e2", &prepared(&standard), None).await;
    let seen = seen.lock().unwrap();
    let names = |i: usize| -> Vec<&str> {
        let mut n: Vec<&str> = seen[i].headers.keys().map(|k| k.as_str()).collect();
        n.sort_unstable();
        n
    };
    assert_eq!(
        names(0),
        [
            "content-length",
            "content-type",
            "host",
            "idempotency-key",
            "user-agent",
            "x-event-signature"
        ]
    );
    assert_eq!(
        names(1),
        [
            "content-length",
            "content-type",
            "host",
            "idempotency-key",
            "user-agent",
            "webhook-id",
            "webhook-signature",
            "webhook-timestamp"
        ]
    );
    let h = |n: &str| seen[1].headers.get(n).unwrap().to_str().unwrap().to_owned();
    let ts = h("webhook-timestamp");
    assert_eq!(
        h("webhook-signature"),
        format!(
            "{} {}",
            v1(NEW_KEY, "e2", &ts, b"{}"),
            v1(KEY, "e2", &ts, b"{}")
        )
    );
}

/// A retry after a reload carries the new key's signatures, the legacy one
/// included, though the request was prepared under the old key.
#[tokio::test]
async fn an_attempt_after_a_reload_signs_with_the_new_keys() {
    let (base, seen) = recording_server(204, "").await;
    let s = sink(&format!("{base}/inbox"), Duration::from_secs(5));
    let request = prepared(&s);
    s.post("e", &request, None).await;
    s.signing()
        .replace(signer(SignatureScheme::Both, NEW_KEY, Some(KEY)));
    s.post("e", &request, None).await;
    let seen = seen.lock().unwrap();
    let h = |i: usize, n: &str| seen[i].headers.get(n).unwrap().to_str().unwrap().to_owned();
    assert_eq!(h(0, "x-event-signature"), hex::encode(hmac(KEY, &[b"{}"])));
    assert_eq!(
        h(1, "x-event-signature"),
        hex::encode(hmac(NEW_KEY, &[b"{}"]))
    );
    let ts = h(1, "webhook-timestamp");
    assert_eq!(
        h(1, "webhook-signature"),
        format!(
            "{} {}",
            v1(NEW_KEY, "e", &ts, b"{}"),
            v1(KEY, "e", &ts, b"{}")
        )
    );
}

/// A file that holds no certificate, removed when dropped.
fn not_a_certificate() -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), b"not a certificate").unwrap();
    f
}

#[test]
fn a_ca_file_without_certificates_is_refused() {
    let file = not_a_certificate();
    let err = HttpSink::new(SinkConfig {
        url: "https://localhost/inbox".parse().unwrap(),
        signing: Signing::new(signer(SignatureScheme::Both, KEY, None)),
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(1),
        connection_max_age: Duration::from_secs(60),
        idle_timeout: Duration::from_secs(30),
        tls: crate::sink::SinkTls {
            ca_file: Some(file.path().to_owned()),
            client_cert: None,
        },
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
    assert_eq!(
        parse_retry_after("99999999999999999999999", now),
        Some(super::RETRY_AFTER_LONGEST),
        "overflowing delay-seconds: a very long time (a year), not none"
    );
    assert_eq!(
        parse_retry_after("Fri, 31 Dec 9999 23:59:59 GMT", now),
        Some(super::RETRY_AFTER_LONGEST)
    );
    assert_eq!(parse_retry_after("+5", now), None);
    assert_eq!(parse_retry_after("soon", now), None);
}

/// How the connector reports a refused certificate: a rustls error in an
/// `io::Error` in another `io::Error`.
#[test]
fn a_rustls_error_however_wrapped_is_tls_and_a_refusal_is_not() {
    let handshake = std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
    );
    let wrapped = std::io::Error::other(handshake);
    assert!(source_is_tls(&wrapped));
    assert!(source_is_tls(&rustls::Error::General("x".into())));
    let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
    assert!(!source_is_tls(&std::io::Error::other(refused)));
}

/// An HTTP/2-only (h2c) sink answers a request with its SETTINGS frame:
/// a transport failure that says what the sink speaks and what to change.
#[tokio::test]
async fn an_answer_that_is_not_http1_names_an_http2_only_sink() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (addr, _) = listener(|_, mut sock| async move {
        let mut buf = [0u8; 4096];
        let _ = sock.read(&mut buf).await;
        // An empty SETTINGS frame (RFC 9113 §6.5), then nothing.
        let _ = sock.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await;
        let _ = sock.read(&mut buf).await;
    })
    .await;
    let s = sink(&format!("http://{addr}/inbox"), Duration::from_secs(5));
    let got = s.post("e", &prepared(&s), None).await;
    let Attempt::Transport(detail) = &got else {
        panic!("a transport failure: {got:?}")
    };
    assert!(detail.contains("HTTP/2-only, h2c"), "{detail}");
}

/// A listener whose `n`th connection (from 1) `serve` is given; it counts
/// the connections it accepted (each counted before it is served).
async fn listener<F, Fut>(serve: F) -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicUsize>)
where
    F: Fn(usize, tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let n = count.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            tokio::spawn(serve(n, sock));
        }
    });
    (addr, accepted)
}

mod connections;
