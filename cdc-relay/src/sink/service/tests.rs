//! The HTTP sink against real local servers: headers, credentials,
//! statuses, excerpts, refused connections, timeouts, bad CA files.

use super::*;

fn prepared() -> Prepared {
    Prepared {
        body: Bytes::from_static(b"{}"),
        signature: "abc".into(),
    }
}

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
        let got = s.post("e 1", &prepared()).await;
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
        .post("e", &prepared())
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
    .post("e", &prepared())
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
        .post("e", &prepared())
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
