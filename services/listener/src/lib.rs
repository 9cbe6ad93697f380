//! An HTTP listener that survives connection floods.
//!
//! `axum::serve` keeps every accepted socket for as long as its peer
//! likes: a client that connects and sends nothing (or half a request
//! head) holds a file descriptor forever, and about a thousand of them make
//! `accept` fail with "Too many open files" for everyone. [`serve`] bounds
//! all three ways that happens:
//!
//! - **header-read timeout**: a request head must arrive within it, the
//!   first one and every later one on a kept-alive connection — so it is
//!   also the idle keep-alive timeout (hyper starts the timer whenever the
//!   connection waits for a head);
//! - **connection cap**: at most `max_connections` are served at once;
//!   beyond it the listener stops accepting and new connections wait in the
//!   kernel's backlog until one closes, rather than failing;
//! - **accept errors** (`EMFILE`, `ENFILE`) are logged and retried after a
//!   short pause instead of spinning or ending the server.
//!
//! Keep the cap well below the process's descriptor limit (`LimitNOFILE=`
//! in the systemd units) so the rest of the process — database pools, the
//! relay's sink connections — always has descriptors left.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Bounds of one listener.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// A request head (the first, or the next on a kept-alive connection)
    /// must arrive within this, else the connection is closed.
    pub header_read_timeout: Duration,
    /// Connections served at once; more wait in the accept backlog.
    pub max_connections: usize,
    /// After shutdown began, how long in-flight requests may finish.
    pub drain_timeout: Duration,
}

/// The command-line form of [`Limits`] (flags under a listener-specific
/// prefix are the caller's business; these are the defaults of a public
/// service).
#[derive(Clone, Debug, clap::Args)]
pub struct LimitArgs {
    /// A request head must arrive within this (the first one and every
    /// later one on a kept-alive connection: also the idle keep-alive
    /// timeout).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub header_read_timeout: Duration,
    /// Connections served at once; further ones wait in the backlog. Keep
    /// it well below the descriptor limit (LimitNOFILE).
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
}

impl LimitArgs {
    /// The limits, with `drain_timeout` for shutdown.
    pub fn limits(&self, drain_timeout: Duration) -> Limits {
        Limits {
            header_read_timeout: self.header_read_timeout,
            max_connections: self.max_connections.max(1),
            drain_timeout,
        }
    }
}

/// How long to wait after a failed `accept` (descriptors exhausted).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves `router` on `listener` within `limits` until `shutdown`
/// resolves, then lets in-flight requests finish (at most
/// `limits.drain_timeout`).
pub async fn serve<F>(listener: TcpListener, router: Router, limits: Limits, shutdown: F)
where
    F: Future<Output = ()> + Send,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    // HTTP/1.1 only: detecting HTTP/2 would first wait for the client's
    // preface, without a timeout, and a silent client would hold its slot.
    let mut builder = auto::Builder::new(TokioExecutor::new()).http1_only();
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = Arc::clone(&slots).acquire_owned() => slot.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed; retrying shortly");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let first_byte = limits.header_read_timeout;
        tokio::spawn(async move {
            // hyper times out a head that started, or the next one on a
            // kept-alive connection, but not a connection that never sends
            // a byte: bound that wait here.
            let mut peek = [0u8; 1];
            if tokio::time::timeout(first_byte, stream.peek(&mut peek))
                .await
                .is_err()
            {
                return;
            }
            let conn = builder
                .serve_connection_with_upgrades(TokioIo::new(stream), service)
                .into_owned();
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(slot);
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.drain_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "requests still running after {:?} of shutdown; closing",
            limits.drain_timeout
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn start(limits: Limits) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new().route("/", axum::routing::get(|| async { "ok" }));
        tokio::spawn(serve(listener, router, limits, std::future::pending()));
        addr
    }

    fn limits(timeout_ms: u64, max: usize) -> Limits {
        Limits {
            header_read_timeout: Duration::from_millis(timeout_ms),
            max_connections: max,
            drain_timeout: Duration::from_secs(1),
        }
    }

    /// Reads until the server closes the socket; how long that took.
    async fn closed_after(mut s: TcpStream) -> Duration {
        let started = Instant::now();
        let mut buf = [0u8; 4096];
        loop {
            match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
                Ok(Ok(0) | Err(_)) => return started.elapsed(),
                Ok(Ok(_)) => {}
                Err(_) => panic!("the server kept an idle connection for 10 s"),
            }
        }
    }

    const GET: &[u8] = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";

    #[tokio::test]
    async fn silent_half_sent_and_idle_kept_alive_connections_are_closed() {
        let addr = start(limits(300, 16)).await;
        let silent = TcpStream::connect(addr).await.unwrap();
        let mut half = TcpStream::connect(addr).await.unwrap();
        half.write_all(b"POST /inbox HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let mut idle = TcpStream::connect(addr).await.unwrap();
        idle.write_all(GET).await.unwrap();
        let mut response = [0u8; 64];
        let n = idle.read(&mut response).await.unwrap();
        assert!(response[..n].starts_with(b"HTTP/1.1 200"), "served first");
        for s in [silent, half, idle] {
            assert!(closed_after(s).await < Duration::from_secs(5));
        }
    }

    #[tokio::test]
    async fn beyond_the_cap_connections_wait_and_are_served_once_a_slot_frees() {
        let addr = start(limits(500, 2)).await;
        let _a = TcpStream::connect(addr).await.unwrap();
        let _b = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut real = TcpStream::connect(addr).await.unwrap(); // in the backlog
        real.write_all(GET).await.unwrap();
        let started = Instant::now();
        let mut response = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), real.read(&mut response))
            .await
            .expect("served once an idle slot was reaped")
            .unwrap();
        assert!(response[..n].starts_with(b"HTTP/1.1 200"));
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "it waited for a slot: {:?}",
            started.elapsed()
        );
    }
}
