//! A stable front for a service that is restarted on a new port: a TCP
//! forwarder on a fixed loopback port whose upstream can be re-pointed.
//!
//! ```text
//!  client ──▶ Front (127.0.0.1:fixed) ──▶ current upstream (set_upstream)
//! ```
//!
//! Each new connection goes to the upstream set at the moment it is
//! accepted; open connections stay with theirs (they die with it). When the
//! upstream refuses, the client's connection is reset, as a load balancer
//! with no healthy backend would. Dropping the front stops it.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpStream;

use crate::tcp::{Acceptor, reset};

/// A running front; stops, closing its connections, when dropped.
pub struct Front {
    upstream: Arc<Mutex<SocketAddr>>,
    accept: Acceptor,
}

impl Front {
    /// Starts a front on a free loopback port forwarding to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Front> {
        let upstream = Arc::new(Mutex::new(upstream));
        let accept = Acceptor::start({
            let upstream = Arc::clone(&upstream);
            move |client| forward(client, *upstream.lock().expect("front lock"))
        })
        .await?;
        Ok(Front { upstream, accept })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.accept.addr())
    }

    /// New connections go to `upstream` from now on.
    pub fn set_upstream(&self, upstream: SocketAddr) {
        *self.upstream.lock().expect("front lock") = upstream;
    }
}

async fn forward(mut client: TcpStream, to: SocketAddr) {
    let connected = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(to)).await;
    let Ok(Ok(mut server)) = connected else {
        reset(client);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    if tokio::io::copy_bidirectional(&mut client, &mut server)
        .await
        .is_err()
    {
        reset(client);
        reset(server);
    }
}

/// The socket address of `http://host:port` (an IP address).
pub fn socket_addr(url: &str) -> anyhow::Result<SocketAddr> {
    let parsed = reqwest::Url::parse(url)?;
    let host = parsed
        .host_str()
        .ok_or_else(|| anyhow::anyhow!("{url} names no host"))?;
    let port = parsed
        .port_or_known_default()
        .ok_or_else(|| anyhow::anyhow!("{url} names no port"))?;
    Ok(format!("{host}:{port}").parse()?)
}
