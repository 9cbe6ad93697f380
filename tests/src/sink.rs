//! A scripted HTTP sink: a real in-process HTTP server that records every
//! request the relay sends and answers as the test tells it (status, delay,
//! and per event any response body bytes).
//! Used where Billing's own rules would get in the way (raw payload checks,
//! outages, slow responses) and as the benchmarks' null sink.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, State};
use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::routing::post;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::sync::oneshot;

/// One request as the sink saw it.
#[derive(Debug, Clone)]
pub struct Received {
    /// Exact body bytes.
    pub body: Bytes,
    /// `X-Event-Signature`.
    pub signature: Option<String>,
    /// `Idempotency-Key`.
    pub idempotency_key: Option<String>,
    /// `webhook-id`, `webhook-timestamp` and `webhook-signature`.
    pub webhook: Option<Webhook>,
    /// `Content-Type`.
    pub content_type: Option<String>,
    /// `Authorization` (a sink URL's userinfo arrives as `Basic`).
    pub authorization: Option<String>,
    /// `traceparent` (the attempt's W3C trace context).
    pub traceparent: Option<String>,
    /// `tracestate`.
    pub tracestate: Option<String>,
    /// The request target's path and query, e.g. `/inbox?token=t`.
    pub target: String,
    /// The status the sink answered.
    pub status: u16,
    /// When it was answered.
    pub at: Instant,
    /// When it arrived (before any scripted delay).
    pub arrived: Instant,
    /// The client's address: one port per TCP connection.
    pub peer: SocketAddr,
}

impl Received {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("the relay sends JSON")
    }

    /// The `id` field of the body.
    pub fn id(&self) -> String {
        self.json()["id"].as_str().unwrap_or_default().to_owned()
    }

    /// The event ids the request carried, in body order: each element's
    /// `id` for a batch (a JSON array body), else the body's `id`.
    pub fn ids(&self) -> Vec<String> {
        match self.json() {
            serde_json::Value::Array(events) => events
                .iter()
                .map(|e| e["id"].as_str().unwrap_or_default().to_owned())
                .collect(),
            one => vec![one["id"].as_str().unwrap_or_default().to_owned()],
        }
    }

    /// Whether the signature is the lowercase hex HMAC-SHA256 of the body under `secret`.
    pub fn signature_valid(&self, secret: &str) -> bool {
        self.signature.as_deref() == Some(sign(secret, &self.body).as_str())
    }

    /// Which entries of `webhook-signature` (0-based) are the Standard
    /// Webhooks signature of this request under `key`; empty without the
    /// headers.
    pub fn standard_matches(&self, key: &[u8]) -> Vec<usize> {
        let Some(w) = &self.webhook else {
            return Vec::new();
        };
        let expected = sign_standard(key, &w.id, &w.timestamp, &self.body);
        w.entries()
            .enumerate()
            .filter(|(_, e)| *e == expected)
            .map(|(i, _)| i)
            .collect()
    }
}

/// The Standard Webhooks headers of one request, as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Webhook {
    /// `webhook-id`.
    pub id: String,
    /// `webhook-timestamp`.
    pub timestamp: String,
    /// `webhook-signature`.
    pub signature: String,
}

impl Webhook {
    /// The space-separated entries of `webhook-signature`.
    pub fn entries(&self) -> impl Iterator<Item = &str> {
        self.signature.split(' ')
    }

    /// `webhook-timestamp` as unix seconds.
    pub fn unix_seconds(&self) -> Option<u64> {
        self.timestamp.parse().ok()
    }
}

/// A `webhook-signature` entry: `v1,` and the base64 HMAC-SHA256 under
/// `key` of `id.timestamp.body`, computed here from the specification.
pub fn sign_standard(key: &[u8], id: &str, timestamp: &str, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("any key length");
    for part in [id.as_bytes(), b".", timestamp.as_bytes(), b".", body] {
        mac.update(part);
    }
    let tag = mac.finalize().into_bytes();
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(tag)
    )
}

/// The request id of a batch, computed here from the specification
/// (`docs/architecture.md#batches`): `batch_` and the lowercase hex of the
/// first 16 bytes of SHA-256 over each event id followed by a line feed.
pub fn batch_id<'a>(ids: impl IntoIterator<Item = &'a str>) -> String {
    use sha2::Digest;
    let mut hash = Sha256::new();
    for id in ids {
        hash.update(id.as_bytes());
        hash.update(b"\n");
    }
    format!("batch_{}", hex::encode(&hash.finalize()[..16]))
}

/// The key of a `whsec_` secret (its base64 part decoded).
pub fn whsec_key(secret: &str) -> Vec<u8> {
    let encoded = secret.strip_prefix("whsec_").expect("a whsec_ secret");
    base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .expect("base64 after whsec_")
}

/// A new random `whsec_` secret with a 32-byte key.
pub fn new_whsec() -> String {
    let key: [u8; 32] = rand::random();
    format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(key)
    )
}

/// The `X-Event-Signature` of `body` under `secret`: the lowercase hex
/// HMAC-SHA256 of the exact body bytes.
pub fn sign(secret: &str, body: &[u8]) -> String {
    sign_key(secret.as_bytes(), body)
}

/// The `X-Event-Signature` of `body` under the key bytes `key` (a `whsec_`
/// secret's decoded bytes, see [`whsec_key`]).
pub fn sign_key(key: &[u8], body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("any key length");
    mac.update(body);
    hex::encode(mac.finalize().into_bytes())
}

/// A scripted answer for one event id.
#[derive(Clone)]
struct Rejection {
    status: u16,
    body: Bytes,
    remaining: Option<u32>,
}

#[derive(Default)]
struct Script {
    status: AtomicU16,
    /// Status for a request carrying several events (an array body of two
    /// or more); 0: as for any other request.
    batch_status: AtomicU16,
    delay_ms: AtomicU64,
    received: Mutex<Vec<Received>>,
    /// Requests being handled now.
    in_progress: AtomicUsize,
    /// Requests that arrived, answered or not (a client may disconnect first).
    arrivals: AtomicUsize,
    /// `Retry-After` value sent with every answer that is not a 2xx.
    retry_after: Mutex<Option<String>>,
    /// Arrival time of every request, answered or not.
    arrival_times: Mutex<Vec<Instant>>,
    /// Forward to this URL (after the delay) and answer with its status.
    upstream: Option<(reqwest::Client, String)>,
    /// Per event id (the body's `id`): answer this status and body instead,
    /// for this many more requests (`None`: until cleared).
    rejections: Mutex<std::collections::HashMap<String, Rejection>>,
}

/// The running sink; stops when dropped.
pub struct ScriptedSink {
    /// `http://127.0.0.1:PORT/inbox`.
    pub url: String,
    /// The bound address.
    pub addr: SocketAddr,
    script: Arc<Script>,
    _stop: oneshot::Sender<()>,
}

impl ScriptedSink {
    /// Starts on a free loopback port answering 204 at once.
    pub async fn start() -> anyhow::Result<ScriptedSink> {
        Self::serve(Script::default()).await
    }

    /// Starts a delaying proxy in front of `upstream` (e.g. Billing's inbox):
    /// each request waits the scripted delay, is forwarded with its body,
    /// signature and trace headers, and gets the upstream's status.
    pub async fn proxy(upstream: &str) -> anyhow::Result<ScriptedSink> {
        Self::serve(Script {
            upstream: Some((reqwest::Client::new(), upstream.to_owned())),
            ..Script::default()
        })
        .await
    }

    async fn serve(script: Script) -> anyhow::Result<ScriptedSink> {
        let script = Arc::new(script);
        script.status.store(204, Ordering::SeqCst);
        let app = Router::new()
            .route("/inbox", post(handle))
            .layer(DefaultBodyLimit::disable())
            .with_state(Arc::clone(&script));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let stop = serve_with_peers(listener, app);
        Ok(ScriptedSink {
            url: format!("http://{addr}/inbox"),
            addr,
            script,
            _stop: stop,
        })
    }

    /// Answer every following request with `status`.
    pub fn set_status(&self, status: u16) {
        self.script.status.store(status, Ordering::SeqCst);
    }

    /// Answer `status` to every following request that carries several
    /// events (a batch of two or more) and has no per-event rejection;
    /// `None`: batches are answered as any other request.
    pub fn set_batch_status(&self, status: Option<u16>) {
        self.script
            .batch_status
            .store(status.unwrap_or(0), Ordering::SeqCst);
    }

    /// Wait `delay` before answering each following request.
    pub fn set_delay(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.script.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Send `Retry-After: value` (delay-seconds or an HTTP-date) with every
    /// following answer that is not a 2xx; `None` stops.
    pub fn set_retry_after(&self, value: Option<&str>) {
        *self.script.retry_after.lock().expect("sink lock") = value.map(str::to_owned);
    }

    /// When each request arrived, answered or not, in arrival order.
    pub fn arrival_times(&self) -> Vec<Instant> {
        self.script.arrival_times.lock().expect("sink lock").clone()
    }

    /// Answer `status` to every request for event `id` until cleared.
    pub fn reject(&self, id: &str, status: u16) {
        self.reject_with_body(id, status, Bytes::new());
    }

    /// Answer `status` with exactly `body` (any bytes: NUL, invalid UTF-8,
    /// any length) to every request for event `id` until cleared.
    pub fn reject_with_body(&self, id: &str, status: u16, body: impl Into<Bytes>) {
        self.script.rejections.lock().expect("sink lock").insert(
            id.to_owned(),
            Rejection {
                status,
                body: body.into(),
                remaining: None,
            },
        );
    }

    /// Answer `status` to the next `times` requests for event `id`, then as
    /// for any other event.
    pub fn reject_times(&self, id: &str, status: u16, times: u32) {
        self.script.rejections.lock().expect("sink lock").insert(
            id.to_owned(),
            Rejection {
                status,
                body: Bytes::new(),
                remaining: Some(times),
            },
        );
    }

    /// Stop rejecting any event by id.
    pub fn clear_rejections(&self) {
        self.script.rejections.lock().expect("sink lock").clear();
    }

    /// Requests received and not yet answered.
    pub fn in_progress(&self) -> usize {
        self.script.in_progress.load(Ordering::SeqCst)
    }

    /// Requests that arrived so far, including ones whose client went away
    /// before the answer (those are missing from [`received`](Self::received)).
    pub fn arrivals(&self) -> usize {
        self.script.arrivals.load(Ordering::SeqCst)
    }

    /// Every answered request so far, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.script.received.lock().expect("sink lock").clone()
    }

    /// The answered requests from the `start`-th on (0-based, arrival
    /// order): for a long run that reads what is new since its last look.
    pub fn received_from(&self, start: usize) -> Vec<Received> {
        let received = self.script.received.lock().expect("sink lock");
        received
            .get(start..)
            .map(<[Received]>::to_vec)
            .unwrap_or_default()
    }

    /// Number of requests so far.
    pub fn count(&self) -> usize {
        self.script.received.lock().expect("sink lock").len()
    }

    /// Requests answered with a 2xx.
    pub fn delivered(&self) -> Vec<Received> {
        self.received()
            .into_iter()
            .filter(|r| (200..300).contains(&r.status))
            .collect()
    }
}

async fn handle(
    State(script): State<Arc<Script>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, [(HeaderName, String); 1], Bytes) {
    let arrived = Instant::now();
    script
        .arrival_times
        .lock()
        .expect("sink lock")
        .push(arrived);
    script.arrivals.fetch_add(1, Ordering::SeqCst);
    script.in_progress.fetch_add(1, Ordering::SeqCst);
    let (status, response) = answer(&script, &headers, &body).await;
    script.in_progress.fetch_sub(1, Ordering::SeqCst);
    let header = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let webhook = match (
        header("webhook-id"),
        header("webhook-timestamp"),
        header("webhook-signature"),
    ) {
        (Some(id), Some(timestamp), Some(signature)) => Some(Webhook {
            id,
            timestamp,
            signature,
        }),
        _ => None,
    };
    script.received.lock().expect("sink lock").push(Received {
        body,
        signature: header("x-event-signature"),
        idempotency_key: header("idempotency-key"),
        webhook,
        content_type: header("content-type"),
        authorization: header("authorization"),
        traceparent: header("traceparent"),
        tracestate: header("tracestate"),
        target: uri
            .path_and_query()
            .map_or_else(String::new, |p| p.to_string()),
        status,
        at: Instant::now(),
        arrived,
        peer,
    });
    // An empty header name would be refused: a harmless one stands in.
    let retry_after = match script.retry_after.lock().expect("sink lock").clone() {
        Some(v) if !(200..300).contains(&status) => (RETRY_AFTER, v),
        _ => (HeaderName::from_static("x-scripted-sink"), "1".to_owned()),
    };
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, [retry_after], response)
}

/// The status to answer, and the response body (empty unless scripted).
async fn answer(script: &Script, headers: &HeaderMap, body: &Bytes) -> (u16, Bytes) {
    let delay = script.delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    // A batch (an array body) is refused whole, with the scripted answer
    // of its first event that has one: a receiver that does not answer
    // per event.
    let ids: Vec<String> = match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Array(events)) => events
            .iter()
            .filter_map(|e| e["id"].as_str().map(str::to_owned))
            .collect(),
        Ok(one) => one["id"].as_str().map(str::to_owned).into_iter().collect(),
        Err(_) => Vec::new(),
    };
    let batch_status = match script.batch_status.load(Ordering::SeqCst) {
        0 => None,
        status => (ids.len() > 1).then_some(status),
    };
    let rejected = ids.into_iter().find_map(|id| {
        let mut rejections = script.rejections.lock().expect("sink lock");
        let r = rejections.get_mut(&id)?;
        let answer = (r.status, r.body.clone());
        match &mut r.remaining {
            Some(n) if *n <= 1 => {
                rejections.remove(&id);
            }
            Some(n) => *n -= 1,
            None => {}
        }
        Some(answer)
    });
    let (scripted, response) = rejected.unwrap_or_else(|| {
        let status = batch_status.unwrap_or_else(|| script.status.load(Ordering::SeqCst));
        (status, Bytes::new())
    });
    let Some((client, url)) = &script.upstream else {
        return (scripted, response);
    };
    if !(200..300).contains(&scripted) {
        return (scripted, response);
    }
    let mut req = client.post(url).body(body.clone());
    for name in [
        "content-type",
        "x-event-signature",
        "idempotency-key",
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
        "traceparent",
        "tracestate",
    ] {
        if let Some(v) = headers.get(name) {
            req = req.header(name, v.clone());
        }
    }
    match req.send().await {
        Ok(r) => (r.status().as_u16(), Bytes::new()),
        Err(_) => (502, Bytes::new()),
    }
}

/// [`serve`] on a TCP listener, with each request's client address
/// ([`Received::peer`]).
fn serve_with_peers(listener: tokio::net::TcpListener, app: Router) -> oneshot::Sender<()> {
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(async {
            let _ = stopped.await;
        })
        .await;
    });
    stop
}

/// Serves `app` on `listener` in a task, until the returned sender is
/// dropped (then it shuts down gracefully). For the in-process sinks of the
/// tests and the benchmark.
pub fn serve<L>(listener: L, app: Router) -> oneshot::Sender<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await;
    });
    stop
}
