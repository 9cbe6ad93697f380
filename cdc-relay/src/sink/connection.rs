//! The sink's connections, kept by the relay itself.
//!
//! An HTTP/1.1 connection carries one request at a time, so the attempt
//! that holds it also drives it: the request is written, the response read
//! and the connection's state advanced in the attempt's own task, with no
//! connection task to wake and no pool lookup per request (issue 29's
//! lever, `docs/benchmarks.md`). Idle HTTP/1.1 connections wait in a stack
//! (the most recently used is taken first, so a lull lets the others age
//! out). An HTTP/2 connection (a TLS sink that chose `h2` by ALPN) carries
//! every request at once: one is shared, driven by its own task.
//!
//! A connection takes no request once it is `--sink-connection-max-age`
//! old (the next one looks the name up again), after
//! `--sink-idle-timeout` without one, or once a request on it timed out
//! (an HTTP/1.1 attempt drops its own; the shared HTTP/2 one is
//! discarded, [`Connections::discard_h2`]); a reaper, started with the first
//! idle connection, closes those that wait past either limit.
//!
//! Each connection knows whether it has answered (an HTTP/1.1 connection
//! that answered and was then found closed met the server closing an idle
//! connection, not refusing a new one) and whether it has refused a
//! request before (one refusing HTTP/2 connection is one connection event
//! however many streams it sends back), `docs/architecture.md#response-classes`.

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::Full;
use hyper::body::{Body as _, Incoming};
use hyper::client::conn::{http1, http2};
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::{Connection as _, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tower_service::Service as _;

mod reaper;

/// Makes a TCP (and, for `https`, TLS) connection to the sink.
pub type Connector = HttpsConnector<HttpConnector>;

/// An error from the connector or a connection.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The largest answer head (status line and header fields) the relay
/// reads over HTTP/2, in bytes of the decoded header list (RFC 9113
/// §6.5.2, `SETTINGS_MAX_HEADER_LIST_SIZE`): what HTTP/1.1 reads too
/// (hyper's read buffer, 8 KiB plus 100 fields of 4 KiB). The h2
/// library's default, 16 KiB, is exceeded by answers that pass behind
/// proxies adding cookies or long policy headers; over it the stream is
/// reset and its status never read.
pub const MAX_RESPONSE_HEAD: u32 = 8 * 1024 + 100 * 4 * 1024;

type Stream = MaybeHttpsStream<TokioIo<tokio::net::TcpStream>>;
type Body = Full<Bytes>;

/// Every connection to one sink.
pub struct Connections {
    connector: Connector,
    /// Where the connector connects (scheme, host, port).
    uri: Uri,
    idle_timeout: Duration,
    max_age: Duration,
    /// Idle HTTP/1.1 connections, the most recently used last.
    idle: Mutex<Vec<Http1>>,
    /// The shared HTTP/2 connection, once the sink chose `h2`.
    shared: Mutex<Option<Http2>>,
    /// Told when a connection goes idle, if anyone waits for one.
    returned: tokio::sync::Notify,
    /// How many checkouts wait for a new connection or a returned one.
    waiting: AtomicUsize,
    /// The sink chose `h2` on a connection: it speaks HTTP/2, and one
    /// connection carries every request.
    speaks_h2: AtomicBool,
    /// An HTTP/2 connection is being made: others wait for it.
    h2_connecting: AtomicBool,
    reaping: AtomicBool,
}

impl std::fmt::Debug for Connections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connections")
            .field("uri", &self.uri)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_age", &self.max_age)
            .finish_non_exhaustive()
    }
}

/// One HTTP/1.1 connection, driven by the attempt that holds it.
pub struct Http1 {
    sender: http1::SendRequest<Body>,
    driver: Pin<Box<http1::Connection<Stream, Body>>>,
    born: Instant,
    idle_since: Instant,
    answered: bool,
    refused: bool,
}

/// The shared HTTP/2 connection: a handle to it (its task drives it).
#[derive(Clone)]
pub struct Http2 {
    sender: http2::SendRequest<Body>,
    born: Instant,
    /// When a request last took it: milliseconds after `born`.
    used_ms: Arc<AtomicU64>,
    refused: Arc<AtomicBool>,
}

impl Http2 {
    fn touch(&self) {
        let ms = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.used_ms.store(ms, Ordering::Relaxed);
    }

    fn idle_for(&self) -> Duration {
        self.born
            .elapsed()
            .saturating_sub(Duration::from_millis(self.used_ms.load(Ordering::Relaxed)))
    }
}

/// A connection an attempt holds.
pub enum Conn {
    /// Its own HTTP/1.1 connection.
    Http1(Http1),
    /// A handle to the shared HTTP/2 connection.
    Http2(Http2),
}

/// The answer read off a connection: the response head and up to the
/// limit of its body.
pub struct Exchange {
    /// The response head (its body taken).
    pub head: Response<()>,
    /// The body's first bytes, up to the limit.
    pub body: Vec<u8>,
}

impl Connections {
    /// No connection yet: the first attempt opens one.
    pub fn new(connector: Connector, uri: Uri, idle_timeout: Duration, max_age: Duration) -> Self {
        Connections {
            connector,
            uri,
            idle_timeout,
            max_age,
            idle: Mutex::new(Vec::new()),
            shared: Mutex::new(None),
            returned: tokio::sync::Notify::new(),
            waiting: AtomicUsize::new(0),
            speaks_h2: AtomicBool::new(false),
            h2_connecting: AtomicBool::new(false),
            reaping: AtomicBool::new(false),
        }
    }

    /// A connection for the next request: the shared HTTP/2 one, an idle
    /// HTTP/1.1 one that is open, ready, young enough and not idle too
    /// long, or a new one. While a new one is being made, a connection
    /// another request gives back first is taken instead (a sink slow to
    /// accept, with a short listen queue, must not make each request wait
    /// for its own connection), and the new one is abandoned. To a sink
    /// that speaks HTTP/2 one connection is made at a time, and every
    /// request waits for it. Errors: the connector's (TCP connect, its
    /// timeout, TLS) or the HTTP/2 handshake's.
    pub async fn checkout(self: &Arc<Self>) -> Result<Conn, BoxError> {
        if let Some(conn) = self.reuse() {
            return Ok(conn);
        }
        let _waiting = Waiting::enter(&self.waiting);
        let mut made = None;
        loop {
            let returned = self.returned.notified();
            // Taking a given-back connection ends our own attempt (the
            // guard aborts it): a connection made for nobody would join
            // the idle stack, and one the sink never accepted (its listen
            // queue full) would take the next request into silence.
            if let Some(conn) = self.reuse() {
                return Ok(conn);
            }
            if made.is_none() {
                let h2 = self.speaks_h2.load(Ordering::SeqCst);
                if !h2 || !self.h2_connecting.swap(true, Ordering::SeqCst) {
                    made = Some(self.spawn_connect(h2));
                }
            }
            match made.as_mut() {
                Some(made) => tokio::select! {
                    result = &mut made.result => {
                        return result.unwrap_or_else(|_| Err("the connection task ended".into()));
                    }
                    () = returned => {}
                },
                None => returned.await,
            }
        }
    }

    /// A new connection for a request sent again because the connection
    /// it met was closed under it: not an idle one, which may have been
    /// closed the same way. To a sink that speaks HTTP/2, the one shared
    /// connection (the refusing one was discarded).
    pub async fn checkout_new(self: &Arc<Self>) -> Result<Conn, BoxError> {
        if self.speaks_h2.load(Ordering::SeqCst) {
            return self.checkout().await;
        }
        self.connect().await
    }

    /// Makes a connection in a task of its own, so that the checkout that
    /// asked may take one given back meanwhile; dropping the handle (the
    /// checkout took another, or was cancelled by its timeout) aborts it.
    /// `owns_h2_flag`: this is the one HTTP/2 connection being made.
    fn spawn_connect(self: &Arc<Self>, owns_h2_flag: bool) -> Connecting {
        let (made_tx, result) = tokio::sync::oneshot::channel();
        let connections = Arc::clone(self);
        let task = tokio::spawn(async move {
            // Runs when the attempt ends, made, failed or aborted: those
            // waiting for the HTTP/2 connection try again if there is none.
            let _done = Connected {
                connections: Arc::clone(&connections),
                owns_h2_flag,
            };
            let _ = made_tx.send(connections.connect().await);
        });
        Connecting {
            result,
            task: task.abort_handle(),
        }
    }

    /// The shared HTTP/2 connection or an idle HTTP/1.1 one that takes a
    /// request now, if there is one. An idle one that is closed, not
    /// ready at once (still busy with an earlier exchange, e.g. a body
    /// the sink answered before reading), too old or idle too long is
    /// dropped.
    fn reuse(&self) -> Option<Conn> {
        {
            let mut shared = self
                .shared
                .lock()
                .expect("connections lock is never poisoned");
            if let Some(h2) = shared.as_ref() {
                if self.takes_requests(h2) {
                    h2.touch();
                    return Some(Conn::Http2(h2.clone()));
                }
                *shared = None;
            }
        }
        loop {
            let popped = self
                .idle
                .lock()
                .expect("connections lock is never poisoned")
                .pop();
            let mut h1 = popped?;
            if self.usable(&h1) && h1.ready_now() {
                return Some(Conn::Http1(h1));
            }
        }
    }

    async fn connect(self: &Arc<Self>) -> Result<Conn, BoxError> {
        let mut connector = self.connector.clone();
        poll_fn(|cx| connector.poll_ready(cx)).await?;
        let stream = connector.call(self.uri.clone()).await?;
        if stream.connected().is_negotiated_h2() {
            self.speaks_h2.store(true, Ordering::SeqCst);
            let (sender, driver) = http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .max_header_list_size(MAX_RESPONSE_HEAD)
                .handshake(stream)
                .await?;
            tokio::spawn(async move {
                let _ = driver.await;
            });
            let h2 = Http2 {
                sender,
                born: Instant::now(),
                used_ms: Arc::default(),
                refused: Arc::default(),
            };
            *self
                .shared
                .lock()
                .expect("connections lock is never poisoned") = Some(h2.clone());
            self.start_reaper();
            Ok(Conn::Http2(h2))
        } else {
            let (sender, driver) = http1::handshake(stream).await?;
            let now = Instant::now();
            Ok(Conn::Http1(Http1 {
                sender,
                driver: Box::pin(driver),
                born: now,
                idle_since: now,
                answered: false,
                refused: false,
            }))
        }
    }

    /// Gives back an HTTP/1.1 connection whose response was read to its
    /// end; it waits for the next request.
    pub fn checkin(self: &Arc<Self>, conn: Conn) {
        let Conn::Http1(mut h1) = conn else { return };
        h1.idle_since = Instant::now();
        self.idle
            .lock()
            .expect("connections lock is never poisoned")
            .push(h1);
        self.wake_waiting();
        self.start_reaper();
    }

    fn start_reaper(self: &Arc<Self>) {
        if !self.reaping.swap(true, Ordering::Relaxed) {
            tokio::spawn(reaper::reap(Arc::downgrade(self)));
        }
    }

    /// The HTTP/2 connection `conn` refused, drained or failed (not a
    /// stream reset that ends one request): later requests go to a new
    /// one. (An HTTP/1.1 connection that failed is dropped by its holder.)
    pub fn discard(&self, conn: &Conn) {
        if let Conn::Http2(h2) = conn {
            self.discard_h2(h2);
        }
    }

    /// The shared HTTP/2 connection `h2` takes no new request (if it is
    /// still the shared one): the next checkout makes another. Streams in
    /// flight on it finish there.
    pub fn discard_h2(&self, h2: &Http2) {
        let mut shared = self
            .shared
            .lock()
            .expect("connections lock is never poisoned");
        if shared
            .as_ref()
            .is_some_and(|s| Arc::ptr_eq(&s.refused, &h2.refused))
        {
            *shared = None;
        }
    }

    /// Tells the checkouts waiting for a connection that one is there.
    fn wake_waiting(&self) {
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.returned.notify_waiters();
        }
    }

    /// How many HTTP/1.1 connections wait idle.
    #[cfg(test)]
    pub fn idle_count(&self) -> usize {
        self.idle
            .lock()
            .expect("connections lock is never poisoned")
            .len()
    }

    fn usable(&self, h1: &Http1) -> bool {
        h1.born.elapsed() < self.max_age && h1.idle_since.elapsed() < self.idle_timeout
    }

    fn takes_requests(&self, h2: &Http2) -> bool {
        !h2.sender.is_closed()
            && h2.born.elapsed() < self.max_age
            && h2.idle_for() < self.idle_timeout
    }
}

/// A connection being made for a checkout: its result, and the task that
/// makes it, aborted when this is dropped.
struct Connecting {
    result: tokio::sync::oneshot::Receiver<Result<Conn, BoxError>>,
    task: tokio::task::AbortHandle,
}

impl Drop for Connecting {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The end of a connection attempt, however it ended: the HTTP/2 flag it
/// held is released and the waiting checkouts are told.
struct Connected {
    connections: Arc<Connections>,
    owns_h2_flag: bool,
}

impl Drop for Connected {
    fn drop(&mut self) {
        if self.owns_h2_flag {
            self.connections
                .h2_connecting
                .store(false, Ordering::SeqCst);
        }
        self.connections.wake_waiting();
    }
}

/// A checkout waiting for a connection, counted while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn enter(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Waiting(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Http1 {
    /// Whether the connection takes a request now: driven once (it reads
    /// a close the sink sent meanwhile), it is open and ready for the next
    /// request. Not waited for: one that is not ready at once is busy.
    fn ready_now(&mut self) -> bool {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if self.driver.as_mut().poll(&mut cx).is_ready() {
            return false;
        }
        matches!(self.sender.poll_ready(&mut cx), Poll::Ready(Ok(())))
    }

    /// Whether the idle connection is still open (the sink has not closed
    /// it): driven once, without waiting.
    fn open(&mut self) -> bool {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        self.driver.as_mut().poll(&mut cx).is_pending()
    }
}

impl Conn {
    /// Whether this is an HTTP/1.1 connection (the request then carries
    /// `Host` and an origin-form target).
    pub fn is_http1(&self) -> bool {
        matches!(self, Conn::Http1(_))
    }

    /// Whether the connection was known to be live when a request met it
    /// closed or refused: an HTTP/1.1 connection that had answered before,
    /// or an HTTP/2 one (TLS and ALPN completed).
    pub fn was_live(&self) -> bool {
        match self {
            Conn::Http1(h1) => h1.answered,
            Conn::Http2(_) => true,
        }
    }

    /// Marks the connection as having refused a request: `true` the first
    /// time only, so one connection is one event.
    pub fn first_refusal(&mut self) -> bool {
        match self {
            Conn::Http1(h1) => !std::mem::replace(&mut h1.refused, true),
            Conn::Http2(h2) => !h2.refused.swap(true, Ordering::Relaxed),
        }
    }

    /// Sends `request` and reads the response, its body up to
    /// `limit(status)` bytes. `Ok((exchange, reusable))`: reusable when the body was read
    /// to its end (an HTTP/1.1 connection may then take the next request).
    /// `answered` is set to the status as soon as the head arrives (the
    /// caller's timeout may end the body's read). Errors: hyper's for the
    /// request or the response head; a body that breaks after the head ends
    /// the read (the status stands).
    pub async fn exchange(
        &mut self,
        request: Request<Body>,
        limit: fn(u16) -> usize,
        answered: &mut Option<StatusCode>,
    ) -> Result<(Exchange, bool), hyper::Error> {
        match self {
            Conn::Http2(h2) => {
                let response = h2.sender.send_request(request).await?;
                *answered = Some(response.status());
                Ok(read(response, limit, &mut None).await)
            }
            Conn::Http1(h1) => {
                let Http1 { sender, driver, .. } = h1;
                let mut sending = std::pin::pin!(sender.send_request(request));
                let mut open = true;
                let response = poll_fn(|cx| {
                    if open && driver.as_mut().poll(cx).is_ready() {
                        open = false;
                    }
                    sending.as_mut().poll(cx)
                })
                .await?;
                h1.answered = true;
                *answered = Some(response.status());
                let mut driving = open.then_some(h1.driver.as_mut());
                let (exchange, to_end) = read(response, limit, &mut driving).await;
                Ok((exchange, to_end && driving.is_some()))
            }
        }
    }
}

/// How much of a response body past its excerpt is read, when it has
/// arrived, to keep the connection: a longer one is cut and its connection
/// dropped.
const DRAIN_BYTES: usize = 64 * 1024;

/// Reads `response`'s body, keeping `limit(status)` bytes of it, driving the HTTP/1.1
/// connection (when given) meanwhile; `true` when it was read to its end.
/// The driver is set to `None` if the connection closed.
async fn read(
    response: Response<Incoming>,
    limit: fn(u16) -> usize,
    driver: &mut Option<Pin<&mut http1::Connection<Stream, Body>>>,
) -> (Exchange, bool) {
    let (head, mut body) = response.into_parts();
    let limit = limit(head.status.as_u16());
    let mut bytes = Vec::new();
    let mut read = 0;
    let mut to_end = false;
    loop {
        let full = bytes.len() >= limit;
        let frame = poll_fn(|cx| {
            if let Some(d) = driver.as_mut()
                && d.as_mut().poll(cx).is_ready()
            {
                *driver = None;
            }
            match Pin::new(&mut body).poll_frame(cx) {
                // Past the limit, only what has arrived is read (to keep
                // the connection): the answer is not waited for longer.
                Poll::Pending if full => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
                Poll::Ready(frame) => Poll::Ready(Some(frame)),
            }
        })
        .await;
        match frame {
            Some(Some(Ok(frame))) => {
                if let Some(chunk) = frame.data_ref() {
                    read += chunk.len();
                    let room = limit.saturating_sub(bytes.len());
                    bytes.extend_from_slice(&chunk[..chunk.len().min(room)]);
                    if read > limit.max(DRAIN_BYTES) {
                        break;
                    }
                }
            }
            Some(None) => {
                to_end = true;
                break;
            }
            // The status arrived; a broken body, or one that has not all
            // arrived past the limit, does not change it.
            Some(Some(Err(_))) | None => break,
        }
    }
    (
        Exchange {
            head: Response::from_parts(head, ()),
            body: bytes,
        },
        to_end,
    )
}
