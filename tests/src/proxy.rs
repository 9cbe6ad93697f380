//! A fault-injecting TCP proxy: listens on `127.0.0.1:0`, forwards every
//! connection to one upstream address, and misbehaves on request.
//!
//! ```text
//!  client ──▶ FaultProxy (127.0.0.1:port) ──▶ upstream
//!                   ▲
//!                   └── set_mode(Pass | Latency(d) | Blackhole | Reset), at any time
//! ```
//!
//! One [`Mode`] applies to every connection, old and new, from the moment it
//! is set:
//!
//! - [`Mode::Pass`]: bytes flow both ways as they arrive.
//! - [`Mode::Latency`]: each chunk is delivered `d` after the proxy read it
//!   (one way), in order; throughput is not otherwise limited.
//! - [`Mode::Blackhole`]: a network partition. Nothing is read or written in
//!   either direction, so senders see their buffers fill and no error; new
//!   connections are accepted (the kernel completes the TCP handshake) and
//!   held without reaching the upstream. When the partition heals (another
//!   mode), held bytes and held connections go through, as TCP
//!   retransmission would deliver them.
//! - [`Mode::Reset`]: every open connection is closed with a TCP RST on both
//!   sides (`SO_LINGER` 0), and new connections are reset as soon as they are
//!   accepted.
//!
//! [`FaultProxy::strand_existing`] models a stateful middlebox that lost its
//! state (a NAT or firewall failover): the connections open at that moment
//! stay silent forever (unless reset), while new ones follow the mode.
//!
//! An error on either side (a reset, a broken pipe) is passed on as a reset
//! of the other side. Dropping the proxy stops it and closes its connections.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::tcp::{Acceptor, reset};

/// What the proxy does to traffic; see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward everything at once.
    Pass,
    /// Deliver each chunk this long after it was read, in each direction.
    Latency(Duration),
    /// Forward nothing and hold new connections, without an error to anyone.
    Blackhole,
    /// Reset every connection, open or new.
    Reset,
}

/// Chunks read ahead per direction before the proxy stops reading.
const MAX_QUEUED_CHUNKS: usize = 64;

/// Bytes read at once.
const CHUNK_BYTES: usize = 16 * 1024;

/// A running proxy; stops, closing its connections, when dropped.
pub struct FaultProxy {
    upstream: SocketAddr,
    shared: Arc<Shared>,
    accept: Acceptor,
}

struct Shared {
    mode: watch::Sender<Mode>,
    /// Connections accepted so far; also the next connection's number.
    accepted: AtomicUsize,
    /// Connections numbered below this are stranded.
    stranded_below: AtomicUsize,
    /// Connections open now (held, forwarding or being closed).
    open: AtomicUsize,
}

impl Shared {
    /// The mode connection `id` obeys now.
    fn mode_for(&self, id: usize) -> Mode {
        let mode = *self.mode.borrow();
        let stranded = id < self.stranded_below.load(Ordering::SeqCst);
        match mode {
            Mode::Reset => Mode::Reset,
            _ if stranded => Mode::Blackhole,
            other => other,
        }
    }
}

impl FaultProxy {
    /// Starts a proxy in [`Mode::Pass`] on a free loopback port in front of
    /// `upstream`.
    pub async fn start(upstream: SocketAddr) -> io::Result<FaultProxy> {
        let shared = Arc::new(Shared {
            mode: watch::Sender::new(Mode::Pass),
            accepted: AtomicUsize::new(0),
            stranded_below: AtomicUsize::new(0),
            open: AtomicUsize::new(0),
        });
        let accept = Acceptor::start({
            let shared = Arc::clone(&shared);
            move |client| {
                // Numbered, and judged against the mode, as accepted.
                let id = shared.accepted.fetch_add(1, Ordering::SeqCst);
                let reset_now = shared.mode_for(id) == Mode::Reset;
                let shared = Arc::clone(&shared);
                async move {
                    if reset_now {
                        reset(client);
                    } else {
                        connection(id, client, upstream, shared).await;
                    }
                }
            }
        })
        .await?;
        Ok(FaultProxy {
            upstream,
            shared,
            accept,
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.accept.addr()
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.addr().port()
    }

    /// Where connections are forwarded.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Switches every connection, open or new, to `mode`.
    pub fn set_mode(&self, mode: Mode) {
        self.shared.mode.send_replace(mode);
    }

    /// The current mode.
    pub fn mode(&self) -> Mode {
        *self.shared.mode.borrow()
    }

    /// Makes every connection open now silent for good (as if a stateful
    /// middlebox forgot it): it forwards nothing in any mode but
    /// [`Mode::Reset`], which still resets it. New connections are unaffected.
    pub fn strand_existing(&self) {
        let next = self.shared.accepted.load(Ordering::SeqCst);
        self.shared.stranded_below.store(next, Ordering::SeqCst);
        // Wake the connection tasks so they re-read their mode.
        self.shared.mode.send_modify(|_| {});
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.shared.open.load(Ordering::SeqCst)
    }
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr())
            .field("upstream", &self.upstream)
            .field("mode", &self.mode())
            .field("open", &self.open())
            .finish_non_exhaustive()
    }
}

/// Counts a connection as open for as long as it lives.
struct OpenGuard(Arc<Shared>);

impl OpenGuard {
    fn new(shared: &Arc<Shared>) -> OpenGuard {
        shared.open.fetch_add(1, Ordering::SeqCst);
        OpenGuard(Arc::clone(shared))
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serves one client connection from accept to close.
async fn connection(id: usize, client: TcpStream, upstream: SocketAddr, shared: Arc<Shared>) {
    let _open = OpenGuard::new(&shared);
    let mut modes = shared.mode.subscribe();
    // Hold the connection while partitioned.
    loop {
        match shared.mode_for(id) {
            Mode::Reset => return reset(client),
            Mode::Blackhole => {
                if modes.changed().await.is_err() {
                    return;
                }
            }
            Mode::Pass | Mode::Latency(_) => break,
        }
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return reset(client);
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client, mut server) = (client, server);
    match forward(id, &mut client, &mut server, &shared, &mut modes).await {
        End::Closed => {}
        End::Reset => {
            reset(client);
            reset(server);
        }
    }
}

/// How forwarding ended.
enum End {
    /// Both directions finished with a clean shutdown.
    Closed,
    /// Reset mode, or an error on either side.
    Reset,
}

/// Bytes read at once, due for writing at an instant.
struct Chunk {
    due: Instant,
    data: Vec<u8>,
    /// Bytes of `data` already written.
    written: usize,
}

/// Bytes read from one side, waiting to be written to the other.
#[derive(Default)]
struct Pipe {
    /// Chunks in arrival order.
    queue: VecDeque<Chunk>,
    /// The reading side reached end of stream.
    eof: bool,
    /// End of stream was passed on (write side shut down).
    shut: bool,
}

impl Pipe {
    fn can_read(&self) -> bool {
        !self.eof && self.queue.len() < MAX_QUEUED_CHUNKS
    }

    fn has_output(&self) -> bool {
        !self.queue.is_empty() || (self.eof && !self.shut)
    }

    fn finished(&self) -> bool {
        self.eof && self.shut
    }

    fn push(&mut self, read: io::Result<usize>, buf: &[u8], latency: Duration) -> io::Result<()> {
        match read? {
            0 => self.eof = true,
            n => self.queue.push_back(Chunk {
                due: Instant::now() + latency,
                data: buf[..n].to_vec(),
                written: 0,
            }),
        }
        Ok(())
    }

    /// Writes (part of) the first chunk once it is due, or passes on the
    /// end of stream. Cancel-safe: a cancelled call writes nothing.
    async fn write_to<W: AsyncWrite + Unpin>(&mut self, w: &mut W) -> io::Result<()> {
        let Some(chunk) = self.queue.front_mut() else {
            w.shutdown().await?;
            self.shut = true;
            return Ok(());
        };
        tokio::time::sleep_until(chunk.due).await;
        let n = w.write(&chunk.data[chunk.written..]).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        chunk.written += n;
        if chunk.written == chunk.data.len() {
            self.queue.pop_front();
        }
        Ok(())
    }
}

async fn read_some<R: AsyncRead + Unpin>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    r.read(buf).await
}

/// Moves bytes both ways, obeying the mode, until both directions are shut
/// down or the connection must be reset.
async fn forward(
    id: usize,
    client: &mut TcpStream,
    server: &mut TcpStream,
    shared: &Shared,
    modes: &mut watch::Receiver<Mode>,
) -> End {
    let (mut client_r, mut client_w) = client.split();
    let (mut server_r, mut server_w) = server.split();
    let mut up = Pipe::default(); // client → server
    let mut down = Pipe::default(); // server → client
    let mut up_buf = vec![0u8; CHUNK_BYTES];
    let mut down_buf = vec![0u8; CHUNK_BYTES];
    loop {
        if up.finished() && down.finished() {
            return End::Closed;
        }
        modes.borrow_and_update();
        let (flowing, latency) = match shared.mode_for(id) {
            Mode::Reset => return End::Reset,
            Mode::Blackhole => (false, Duration::ZERO),
            Mode::Pass => (true, Duration::ZERO),
            Mode::Latency(d) => (true, d),
        };
        let step = tokio::select! {
            changed = modes.changed() => match changed {
                Ok(()) => Ok(()),
                Err(_) => return End::Reset, // the proxy is gone
            },
            r = read_some(&mut client_r, &mut up_buf), if flowing && up.can_read() => {
                up.push(r, &up_buf, latency)
            }
            r = read_some(&mut server_r, &mut down_buf), if flowing && down.can_read() => {
                down.push(r, &down_buf, latency)
            }
            r = up.write_to(&mut server_w), if flowing && up.has_output() => r,
            r = down.write_to(&mut client_w), if flowing && down.has_output() => r,
        };
        if step.is_err() {
            return End::Reset;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// An echo server on a free loopback port; returns its address.
    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn round_trip(s: &mut TcpStream, msg: &[u8]) -> io::Result<Vec<u8>> {
        s.write_all(msg).await?;
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got).await?;
        Ok(got)
    }

    const SHORT: Duration = Duration::from_millis(300);
    const BOUND: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn pass_forwards_both_ways_and_closes_cleanly() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut s, b"hello").await.unwrap(), b"hello");
        // A large transfer, both ways at once.
        let big: Vec<u8> = (0..2_000_000u32).map(|i| (i % 251) as u8).collect();
        let (mut r, mut w) = s.into_split();
        let sent = big.clone();
        let writer = tokio::spawn(async move {
            w.write_all(&sent).await.unwrap();
            w.shutdown().await.unwrap();
        });
        let mut got = Vec::new();
        tokio::time::timeout(BOUND, r.read_to_end(&mut got))
            .await
            .unwrap()
            .unwrap();
        writer.await.unwrap();
        assert!(got == big, "echoed bytes differ ({} bytes)", got.len());
        tokio::time::timeout(BOUND, async {
            while proxy.open() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the connection is closed after both sides shut down");
        assert_eq!(proxy.accepted(), 1);
    }

    #[tokio::test]
    async fn latency_delays_each_direction() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        proxy.set_mode(Mode::Latency(Duration::from_millis(150)));
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        let started = Instant::now();
        assert_eq!(round_trip(&mut s, b"ping").await.unwrap(), b"ping");
        let rtt = started.elapsed();
        assert!(rtt >= Duration::from_millis(300), "round trip {rtt:?}");
        assert!(rtt < Duration::from_secs(2), "round trip {rtt:?}");
        proxy.set_mode(Mode::Pass);
        let started = Instant::now();
        round_trip(&mut s, b"pong").await.unwrap();
        assert!(started.elapsed() < Duration::from_millis(150));
    }

    #[tokio::test]
    async fn blackhole_holds_old_and_new_connections_until_healed() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut old, b"before").await.unwrap();
        proxy.set_mode(Mode::Blackhole);
        old.write_all(b"during").await.unwrap();
        let mut buf = [0u8; 6];
        assert!(
            tokio::time::timeout(SHORT, old.read_exact(&mut buf))
                .await
                .is_err(),
            "nothing comes back through a blackhole"
        );
        // A new connection is accepted but goes nowhere.
        let mut new = TcpStream::connect(proxy.addr()).await.unwrap();
        new.write_all(b"held").await.unwrap();
        let mut held = [0u8; 4];
        assert!(
            tokio::time::timeout(SHORT, new.read_exact(&mut held))
                .await
                .is_err()
        );
        proxy.set_mode(Mode::Pass);
        tokio::time::timeout(BOUND, old.read_exact(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&buf, b"during");
        tokio::time::timeout(BOUND, new.read_exact(&mut held))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&held, b"held");
    }

    /// Reads until the peer closes; `Err` for a reset, `Ok(bytes)` for a FIN.
    async fn read_to_close(s: &mut TcpStream) -> io::Result<usize> {
        let mut sink = Vec::new();
        tokio::time::timeout(BOUND, s.read_to_end(&mut sink))
            .await
            .expect("closed within the bound")
    }

    #[tokio::test]
    async fn reset_resets_open_and_new_connections_then_heals() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut old, b"x").await.unwrap();
        proxy.set_mode(Mode::Reset);
        let err = read_to_close(&mut old).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "{err}");
        // New connections: the kernel accepts, the proxy resets at once.
        let mut new = TcpStream::connect(proxy.addr()).await.unwrap();
        let err = read_to_close(&mut new).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "{err}");
        proxy.set_mode(Mode::Pass);
        let mut healed = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut healed, b"ok").await.unwrap(), b"ok");
    }

    #[tokio::test]
    async fn upstream_reset_is_passed_on_and_refused_upstream_resets_the_client() {
        // An upstream that resets every connection it accepts.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                reset(s);
            }
        });
        let proxy = FaultProxy::start(upstream).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        let _ = s.write_all(b"x").await;
        let err = read_to_close(&mut s).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "{err}");

        // Nobody listens upstream.
        let gone = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gone_addr = gone.local_addr().unwrap();
        drop(gone);
        let proxy = FaultProxy::start(gone_addr).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        let err = read_to_close(&mut s).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "{err}");
    }

    #[tokio::test]
    async fn stranded_connections_stay_silent_while_new_ones_pass() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut old, b"a").await.unwrap();
        proxy.strand_existing();
        old.write_all(b"b").await.unwrap();
        let mut buf = [0u8; 1];
        assert!(
            tokio::time::timeout(SHORT, old.read_exact(&mut buf))
                .await
                .is_err()
        );
        let mut new = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut new, b"c").await.unwrap(), b"c");
        // Reset still reaches a stranded connection.
        proxy.set_mode(Mode::Reset);
        let err = read_to_close(&mut old).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "{err}");
    }

    #[tokio::test]
    async fn dropping_the_proxy_closes_its_connections() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut s, b"a").await.unwrap();
        drop(proxy);
        assert_eq!(read_to_close(&mut s).await.unwrap(), 0);
    }
}
