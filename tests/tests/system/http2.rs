//! Issue 29, a lever for the CPU per event: `--sink-http-version 2`. The
//! relay speaks HTTP/2 with prior knowledge (h2c) to an `http` sink, and
//! its requests in flight share one connection: every request arrives as
//! HTTP/2, signed as over HTTP/1.1, on a single TCP connection.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{StatusCode, Version};
use harness::app::{self, TEST_SECRET};
use harness::sink::sign;
use harness::{PgCluster, wait_until};

/// One request: its HTTP version, body and `X-Event-Signature`.
type Seen1 = (Version, String, Option<String>);

#[derive(Clone, Default)]
struct Seen {
    requests: Arc<Mutex<Vec<Seen1>>>,
    connections: Arc<AtomicUsize>,
}

async fn record(State(seen): State<Seen>, req: Request) -> StatusCode {
    let version = req.version();
    let signature = req
        .headers()
        .get("x-event-signature")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let Ok(body) = axum::body::to_bytes(req.into_body(), 1 << 20).await else {
        return StatusCode::BAD_REQUEST;
    };
    let body = String::from_utf8_lossy(&body).into_owned();
    seen.requests
        .lock()
        .expect("lock")
        .push((version, body, signature));
    StatusCode::NO_CONTENT
}

/// A TCP listener that counts the connections it accepts.
struct Counting {
    tcp: tokio::net::TcpListener,
    accepted: Arc<AtomicUsize>,
}

impl axum::serve::Listener for Counting {
    type Io = tokio::net::TcpStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            if let Ok(accepted) = self.tcp.accept().await {
                self.accepted.fetch_add(1, Ordering::Relaxed);
                return accepted;
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_prior_knowledge_multiplexes_the_deliveries_on_one_connection() -> anyhow::Result<()>
{
    let seen = Seen::default();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/inbox", tcp.local_addr()?);
    let app = axum::Router::new()
        .route("/inbox", axum::routing::post(record))
        .with_state(seen.clone());
    let _stop = harness::sink::serve(
        Counting {
            tcp,
            accepted: Arc::clone(&seen.connections),
        },
        app,
    );
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let relay = app::start_relay_with_url(
        &stack,
        &stack.relay_url,
        &url,
        &["--sink-http-version", "2"],
    )
    .await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    // Fifty orders, each its own aggregate: they may fly together.
    let mut events = Vec::new();
    for _ in 0..50 {
        events.push(app::insert_order_event(&db).await?);
    }
    wait_until("fifty deliveries", Duration::from_secs(30), || async {
        seen.requests.lock().expect("lock").len() >= 50
    })
    .await?;
    let requests = seen.requests.lock().expect("lock").clone();
    for event in &events {
        let (version, body, signature) = requests
            .iter()
            .find(|(_, b, _)| b.contains(&event.to_string()))
            .ok_or_else(|| anyhow::anyhow!("event {event} not delivered"))?;
        assert_eq!(*version, Version::HTTP_2);
        assert_eq!(
            signature.as_deref(),
            Some(sign(TEST_SECRET, body.as_bytes()).as_str())
        );
    }
    assert_eq!(
        seen.connections.load(Ordering::Relaxed),
        1,
        "one connection for all"
    );
    Ok(())
}
