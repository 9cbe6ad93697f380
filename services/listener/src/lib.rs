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
//! - **connection cap**: at most `max_connections` connections are
//!   served at once, and a connection takes a slot only once its first
//!   byte has arrived. Before that it waits in a *lobby* of at most
//!   [`LOBBY_PER_SLOT`] × `max_connections` more: when the lobby is full, the connection silent
//!   longest gives way to the new one once it has been silent
//!   [`EVICTION_GRACE`]. When every slot is taken, a connection with a
//!   request takes the place of the served one that has waited longest
//!   for a complete head (half-sent, or idle between requests on a
//!   kept-alive connection), once that one has waited the grace with
//!   nothing unread in its socket; never one whose request is being
//!   served or has arrived unread. So a flood of silent or half-sent
//!   sockets only churns, a real request behind it is served within about
//!   twice the grace instead of after the flood's timeouts, and a burst of
//!   real clients larger than the cap is queued, not dropped. When nothing
//!   can give way, the new connection (one descriptor beyond the bound)
//!   and those behind it in the kernel's backlog wait rather than fail;
//! - **accept errors** (`EMFILE`, `ENFILE`) are logged and retried after a
//!   short pause instead of spinning or ending the server.
//!
//! A listener holds at most `3 × max_connections + 1` sockets: keep that
//! well below the process's descriptor limit (`LimitNOFILE=` in the
//! systemd units) so the rest of the process — database pools, the relay's
//! sink connections — always has descriptors left.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

mod args;
pub use args::{LimitArgs, positive_count, positive_duration};

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// How long a connection must have waited for a complete request head
/// before it may give way at the cap. A client that means to send a
/// request sends its whole head right after connecting (or, kept alive,
/// when it has one), so a connection without one after this long, and
/// with nothing unread in its socket, is silent, idle or sending its head
/// a byte at a time. A connection whose bytes have arrived but that a busy
/// server has not read yet never gives way, whatever its age: it holds a
/// real request.
pub const EVICTION_GRACE: Duration = Duration::from_millis(250);

/// How many connections may wait for their first byte per slot: room for
/// a burst of clients that connect at once but are slow to send (seen: a
/// thousand clients of one process on a busy 2-core box, some silent for
/// 0.9 s), so that only a flood fills the lobby.
pub const LOBBY_PER_SLOT: usize = 2;

/// The connections being served, oldest first: which one gives way to a
/// new connection at the cap.
struct Connections {
    /// When the listener started: [`Connection::waiting_since`] counts from it.
    epoch: Instant,
    next_id: Mutex<u64>,
    open: Mutex<VecDeque<Connection>>,
}

/// One served connection, as [`Connections`] sees it.
struct Connection {
    id: u64,
    /// [`BUSY`] while a request of it is being served; otherwise 1 + the
    /// milliseconds since [`Connections::epoch`] at which it began to wait
    /// for a complete head: when it connected, or when its last response
    /// was handed over (kept alive).
    waiting_since: Arc<AtomicU64>,
    /// Notified to close it.
    evict: Arc<Notify>,
    /// Its socket, shared with the connection's task (see [`Shared`]), to
    /// see whether bytes wait unread in it.
    stream: Arc<TcpStream>,
}

/// [`Connection::waiting_since`] of a connection inside a request.
const BUSY: u64 = 0;

/// What [`Connections::evict_oldest_waiting`] did.
enum Eviction {
    /// A connection was told to close: its slot frees shortly.
    Evicted,
    /// None waited long enough; the oldest waiting one may give way after
    /// this.
    NotBefore(Duration),
    /// Every connection is inside a request.
    NoneWaiting,
}

impl Connections {
    fn new() -> Self {
        Connections {
            epoch: Instant::now(),
            next_id: Mutex::new(0),
            open: Mutex::new(VecDeque::new()),
        }
    }

    /// The [`Connection::waiting_since`] value for now.
    fn now(&self) -> u64 {
        1 + u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }

    /// Registers a new connection (waiting for its first head); returns
    /// its id, its waiting state and the notice that closes it.
    fn open(&self, stream: &Arc<TcpStream>) -> (u64, Arc<AtomicU64>, Arc<Notify>) {
        let id = {
            let mut next = self.next_id.lock().expect("never poisoned");
            *next += 1;
            *next
        };
        let waiting_since = Arc::new(AtomicU64::new(self.now()));
        let evict = Arc::new(Notify::new());
        self.open
            .lock()
            .expect("never poisoned")
            .push_back(Connection {
                id,
                waiting_since: Arc::clone(&waiting_since),
                evict: Arc::clone(&evict),
                stream: Arc::clone(stream),
            });
        (id, waiting_since, evict)
    }

    fn close(&self, id: u64) {
        self.open
            .lock()
            .expect("never poisoned")
            .retain(|c| c.id != id);
    }

    /// Closes the connection that has waited longest for a complete head,
    /// if it has waited at least `grace` and nothing waits unread in its
    /// socket; never one inside a request.
    fn evict_oldest_waiting(&self, grace: Duration) -> Eviction {
        let now = self.now();
        let grace = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        let mut open = self.open.lock().expect("never poisoned");
        let mut waiting: Vec<(u64, usize)> = open
            .iter()
            .enumerate()
            .filter_map(|(i, c)| match c.waiting_since.load(Ordering::Relaxed) {
                BUSY => None,
                since => Some((since, i)),
            })
            .collect();
        if waiting.is_empty() {
            return Eviction::NoneWaiting;
        }
        waiting.sort_unstable();
        let mut youngest_left = None;
        for (since, i) in waiting {
            let waited = now.saturating_sub(since);
            if waited < grace {
                youngest_left = Some(grace - waited);
                break;
            }
            if has_unread_bytes(&open[i].stream) {
                continue;
            }
            let c = open.remove(i).expect("an index just found");
            c.evict.notify_one();
            return Eviction::Evicted;
        }
        // Everything old enough holds a request not read yet: ask again
        // after a grace (or when the youngest waiting one is old enough).
        Eviction::NotBefore(
            youngest_left.map_or(Duration::from_millis(grace), Duration::from_millis),
        )
    }
}

/// Connections that have not sent a byte yet (at most [`LOBBY_PER_SLOT`]
/// × `max_connections` of them), oldest first: they hold a descriptor but no slot, and when
/// the lobby is full the one silent longest gives way to a new one, once
/// it has been silent [`EVICTION_GRACE`]. A member that has spoken stays
/// until it has a slot (so the descriptors stay bounded) but never gives
/// way: it holds a real request.
struct Lobby {
    room: Arc<Semaphore>,
    next_id: Mutex<u64>,
    members: Mutex<VecDeque<Member>>,
}

/// One connection in the [`Lobby`].
struct Member {
    id: u64,
    /// When it entered.
    since: Instant,
    /// True until its first byte arrives.
    silent: Arc<AtomicBool>,
    /// Notified to close it.
    evict: Arc<Notify>,
}

impl Lobby {
    fn new(room: usize) -> Self {
        Lobby {
            room: Arc::new(Semaphore::new(room)),
            next_id: Mutex::new(0),
            members: Mutex::new(VecDeque::new()),
        }
    }

    /// Registers a member (silent); returns its id, its silent flag and
    /// the notice that closes it.
    fn enter(&self) -> (u64, Arc<AtomicBool>, Arc<Notify>) {
        let id = {
            let mut next = self.next_id.lock().expect("never poisoned");
            *next += 1;
            *next
        };
        let silent = Arc::new(AtomicBool::new(true));
        let evict = Arc::new(Notify::new());
        self.members
            .lock()
            .expect("never poisoned")
            .push_back(Member {
                id,
                since: Instant::now(),
                silent: Arc::clone(&silent),
                evict: Arc::clone(&evict),
            });
        (id, silent, evict)
    }

    fn leave(&self, id: u64) {
        self.members
            .lock()
            .expect("never poisoned")
            .retain(|m| m.id != id);
    }

    /// Closes the member silent longest, if it has been silent at least
    /// `grace`.
    fn evict_oldest_silent(&self, grace: Duration) -> Eviction {
        let mut members = self.members.lock().expect("never poisoned");
        let Some(i) = members
            .iter()
            .position(|m| m.silent.load(Ordering::Relaxed))
        else {
            return Eviction::NoneWaiting;
        };
        let waited = members[i].since.elapsed();
        if waited < grace {
            return Eviction::NotBefore(grace - waited);
        }
        let m = members.remove(i).expect("an index just found");
        m.evict.notify_one();
        Eviction::Evicted
    }
}

/// Whether bytes the server has not read yet wait in `stream` (a peek,
/// which takes nothing; an end of stream or an error counts as none).
fn has_unread_bytes(stream: &TcpStream) -> bool {
    let mut byte = [std::mem::MaybeUninit::uninit()];
    matches!(socket2::SockRef::from(stream).peek(&mut byte), Ok(n) if n > 0)
}

/// A connection's socket shared between hyper (through this) and the
/// listener's [`Connections`] (which peeks it): reads and writes go
/// through the socket's readiness, as `TcpStream`'s own do.
struct Shared(Arc<TcpStream>);

impl AsyncRead for Shared {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            ready!(self.0.poll_read_ready(cx))?;
            match self.0.try_read_buf(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                other => return Poll::Ready(other.map(|_| ())),
            }
        }
    }
}

impl AsyncWrite for Shared {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.0.poll_write_ready(cx))?;
            match self.0.try_write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                other => return Poll::Ready(other),
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.0.poll_write_ready(cx))?;
            match self.0.try_write_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                other => return Poll::Ready(other),
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(socket2::SockRef::from(&*self.0).shutdown(std::net::Shutdown::Write))
    }
}

/// Bounds of one listener.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// A request head (the first, or the next on a kept-alive connection)
    /// must arrive within this, else the connection is closed.
    pub header_read_timeout: Duration,
    /// Connections served at once (twice as many more may wait for their
    /// first byte); more wait in the accept backlog.
    pub max_connections: usize,
    /// After shutdown began, how long in-flight requests may finish.
    pub drain_timeout: Duration,
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
    let lobby = Arc::new(Lobby::new(LOBBY_PER_SLOT * limits.max_connections));
    let connections = Arc::new(Connections::new());
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
        // Room in the lobby: when it is full, the member silent longest
        // gives way once silent for the grace; until then, or while every
        // member has spoken, the new connection (and those behind it in
        // the kernel's backlog) waits rather than fails.
        let room = loop {
            if let Ok(room) = Arc::clone(&lobby.room).try_acquire_owned() {
                break Some(room);
            }
            let retry = match lobby.evict_oldest_silent(EVICTION_GRACE) {
                Eviction::Evicted | Eviction::NoneWaiting => EVICTION_GRACE,
                Eviction::NotBefore(after) => after,
            };
            tokio::select! {
                room = Arc::clone(&lobby.room).acquire_owned() => break Some(room.expect("the semaphore is never closed")),
                () = tokio::time::sleep(retry) => {}
                () = &mut shutdown => break None,
            }
        };
        let Some(room) = room else { break };
        let _ = stream.set_nodelay(true);
        let stream = Arc::new(stream);
        let (member, silent, evicted_from_lobby) = lobby.enter();
        let first_byte = limits.header_read_timeout;
        let lobby = Arc::clone(&lobby);
        let slots = Arc::clone(&slots);
        let connections = Arc::clone(&connections);
        let router = router.clone();
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            // hyper times out a head that started, or the next one on a
            // kept-alive connection, but not a connection that never sends
            // a byte: bound that wait here, in the lobby.
            let mut peek = [0u8; 1];
            let spoke = tokio::select! {
                read = tokio::time::timeout(first_byte, stream.peek(&mut peek)) => matches!(read, Ok(Ok(n)) if n > 0),
                () = evicted_from_lobby.notified() => false,
            };
            silent.store(false, Ordering::Relaxed);
            if !spoke {
                lobby.leave(member);
                return;
            }
            let slot = take_slot(&slots, &connections).await;
            lobby.leave(member);
            drop(room);
            serve_connection(stream, slot, &connections, router, builder, watcher).await;
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

/// A slot for a connection that has spoken: at the cap, the served
/// connection that has waited longest for a complete head gives way once
/// it has waited [`EVICTION_GRACE`] with nothing unread in its socket.
async fn take_slot(slots: &Arc<Semaphore>, connections: &Connections) -> OwnedSemaphorePermit {
    loop {
        if let Ok(slot) = Arc::clone(slots).try_acquire_owned() {
            return slot;
        }
        let retry = match connections.evict_oldest_waiting(EVICTION_GRACE) {
            Eviction::Evicted | Eviction::NoneWaiting => EVICTION_GRACE,
            Eviction::NotBefore(after) => after,
        };
        tokio::select! {
            slot = Arc::clone(slots).acquire_owned() => return slot.expect("the semaphore is never closed"),
            () = tokio::time::sleep(retry) => {}
        }
    }
}

/// Serves one connection in `slot` until it ends or gives way.
async fn serve_connection(
    stream: Arc<TcpStream>,
    slot: OwnedSemaphorePermit,
    connections: &Arc<Connections>,
    router: Router,
    builder: auto::Builder<TokioExecutor>,
    watcher: hyper_util::server::graceful::Watcher,
) {
    let (id, waiting_since, evict) = connections.open(&stream);
    let clock = Arc::clone(connections);
    let service = TowerToHyperService::new(router.layer(axum::middleware::from_fn(
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let served = Arc::clone(&waiting_since);
            let clock = Arc::clone(&clock);
            async move {
                served.store(BUSY, Ordering::Relaxed);
                let response = next.run(req).await;
                served.store(clock.now(), Ordering::Relaxed);
                response
            }
        },
    )));
    let conn = builder
        .serve_connection_with_upgrades(TokioIo::new(Shared(stream)), service)
        .into_owned();
    // Evicted: dropping the connection closes its socket.
    tokio::select! {
        ended = watcher.watch(conn) => if let Err(e) = ended {
            tracing::debug!(error = %e, "connection ended with an error");
        },
        () = evict.notified() => {}
    }
    connections.close(id);
    drop(slot);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn start(limits: Limits) -> std::net::SocketAddr {
        let router = Router::new().route("/", axum::routing::get(|| async { "ok" }));
        start_with(router, limits).await
    }

    async fn start_with(router: Router, limits: Limits) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, router, limits, std::future::pending()));
        addr
    }

    /// Reads `stream`'s answer (within 5 s); whether it is a 200.
    async fn answered_200(stream: &mut TcpStream) -> bool {
        let mut response = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut response))
            .await
            .expect("an answer within 5 s")
            .unwrap();
        response[..n].starts_with(b"HTTP/1.1 200")
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

    /// Issue 30, item 10, with the defaults (cap 512, 10 s header-read
    /// timeout): behind a flood of twice the cap of silent sockets, a real
    /// request is answered long before the flood's first sockets time out
    /// (within a second; before, it waited for them).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_behind_a_flood_of_twice_the_cap_is_served_at_once_with_the_defaults() {
        let defaults = LimitArgs {
            header_read_timeout: Duration::from_secs(10),
            max_connections: 512,
        };
        let limits = defaults.limits(Duration::from_secs(1));
        let cap = limits.max_connections;
        let addr = start(limits).await;
        let mut flood = Vec::new();
        for _ in 0..2 * cap {
            flood.push(TcpStream::connect(addr).await.unwrap());
        }
        let mut real = TcpStream::connect(addr).await.unwrap();
        real.write_all(GET).await.unwrap();
        let mut response = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(1), real.read(&mut response))
            .await
            .expect("the real request answered within 1 s, not after the flood's 10 s timeouts")
            .unwrap();
        assert!(response[..n].starts_with(b"HTTP/1.1 200"));
        drop(flood);
    }

    /// A burst of real clients several times the cap, each sending its
    /// request as soon as it connects, is queued, not dropped: none of
    /// them is silent for the grace, so none gives way (closing one whose
    /// request had arrived but was not read yet lost the request).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_burst_of_real_clients_beyond_the_cap_is_served_not_dropped() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new().route(
            "/",
            axum::routing::get(|| async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                "ok"
            }),
        );
        tokio::spawn(serve(
            listener,
            router,
            limits(10_000, 2),
            std::future::pending(),
        ));
        let mut clients = tokio::task::JoinSet::new();
        for _ in 0..40 {
            clients.spawn(async move {
                let mut c = TcpStream::connect(addr).await?;
                c.write_all(GET).await?;
                let mut response = [0u8; 64];
                let n = c.read(&mut response).await?;
                Ok::<bool, std::io::Error>(response[..n].starts_with(b"HTTP/1.1 200"))
            });
        }
        let answers = clients.join_all().await;
        let served = answers.iter().filter(|a| matches!(a, Ok(true))).count();
        assert_eq!(served, 40, "{answers:?}");
    }

    /// A router with `/` answering at once and `/slow` answering once
    /// `release` is notified.
    fn router_with_slow(release: &Arc<Notify>) -> Router {
        let gate = Arc::clone(release);
        Router::new()
            .route("/", axum::routing::get(|| async { "ok" }))
            .route(
                "/slow",
                axum::routing::get(move || {
                    let gate = Arc::clone(&gate);
                    async move {
                        gate.notified().await;
                        "slow"
                    }
                }),
            )
    }

    /// With every slot taken, a connection with a request takes the place
    /// of the served one waiting longest for its next head, once it has
    /// waited the grace; one whose request is being served never gives way.
    #[tokio::test]
    async fn at_the_cap_an_idle_connection_gives_way_to_a_request_never_a_served_one() {
        let release = Arc::new(Notify::new());
        let addr = start_with(router_with_slow(&release), limits(10_000, 2)).await;
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut idle = TcpStream::connect(addr).await.unwrap();
        idle.write_all(GET).await.unwrap();
        assert!(answered_200(&mut idle).await);
        // Both slots taken: one inside a request, one kept alive, idle.
        let mut real = TcpStream::connect(addr).await.unwrap();
        real.write_all(GET).await.unwrap();
        assert!(
            answered_200(&mut real).await,
            "served in the idle one's place"
        );
        assert!(closed_after(idle).await < Duration::from_secs(5));
        release.notify_one();
        assert!(answered_200(&mut slow).await, "the served request finished");
    }

    /// Connections that have sent nothing wait without a slot, twice as
    /// many as the cap: then the one silent longest gives way to a new one (after
    /// the grace), and a request on a new connection is served.
    #[tokio::test]
    async fn silent_connections_take_no_slot_and_the_oldest_gives_way_when_they_fill_the_lobby() {
        let addr = start(limits(10_000, 2)).await;
        let first = TcpStream::connect(addr).await.unwrap();
        let second = TcpStream::connect(addr).await.unwrap();
        let _third = TcpStream::connect(addr).await.unwrap();
        let _fourth = TcpStream::connect(addr).await.unwrap();
        // Four silent connections fill the lobby, the slots are still free:
        // a request on a new connection waits for room in the lobby (the
        // first gives way after the grace), then is served at once.
        let mut real = TcpStream::connect(addr).await.unwrap();
        real.write_all(GET).await.unwrap();
        assert!(
            answered_200(&mut real).await,
            "served once the oldest silent one gave way"
        );
        assert!(closed_after(first).await < Duration::from_secs(5));
        let still_open =
            tokio::time::timeout(Duration::from_millis(300), closed_after(second)).await;
        assert!(still_open.is_err(), "only the oldest gave way");
    }
}
