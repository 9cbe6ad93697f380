//! What the harness's TCP forwarders share (the fault [`proxy`](crate::proxy)
//! and the chaos run's fronts): one accept loop on a free loopback port
//! that owns its connections' tasks, and closing a stream with a reset.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// An accept loop on `127.0.0.1`; dropping it stops accepting and drops
/// (aborts) every connection task it started.
pub struct Acceptor {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Acceptor {
    /// Binds a free loopback port and accepts on it until dropped. `serve`
    /// is called once per accepted connection, in accept order (anything it
    /// must decide at accept time, it decides before returning), and the
    /// future it returns runs as a task of the loop.
    pub async fn start<S, F>(mut serve: S) -> io::Result<Acceptor>
    where
        S: FnMut(TcpStream) -> F + Send + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else {
                            // Out of descriptors and the like: back off briefly.
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        };
                        connections.spawn(serve(client));
                    }
                    Some(_) = connections.join_next() => {}
                }
            }
        });
        Ok(Acceptor { addr, task })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        // The loop owns the connection tasks: aborting it drops them.
        self.task.abort();
    }
}

/// Closes `stream` with a TCP RST instead of a FIN.
pub fn reset(stream: TcpStream) {
    // A zero linger makes close() send RST and never blocks, which is what
    // the deprecation of `set_linger` warns about (a non-zero linger).
    #[allow(deprecated)]
    let _ = stream.set_linger(Some(Duration::ZERO));
    drop(stream);
}
