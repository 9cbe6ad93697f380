//! Sink connections with an identity: the connector wraps each new
//! connection so that every request on it can tell which connection it
//! met. An HTTP/2 connection that refuses several streams, or drains with a
//! GOAWAY while several are in flight, is then counted once
//! (`cdc_relay_sink_connection_events_total`), however many requests it
//! sent back (`docs/architecture.md#response-classes`).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection};

/// One connection's identity, found in [`Connected::get_extras`] (and in
/// the extensions of every response that came back on it).
#[derive(Clone, Debug, Default)]
pub struct ConnectionTag {
    /// Set once a request met this connection refusing it.
    refused: Arc<AtomicBool>,
    /// Set once a response came back on this connection.
    answered: Arc<AtomicBool>,
}

impl ConnectionTag {
    /// The tag of the connection `connected` describes, if it has one.
    pub fn of(connected: &Connected) -> Option<ConnectionTag> {
        let mut extensions = http::Extensions::new();
        connected.get_extras(&mut extensions);
        extensions.get::<ConnectionTag>().cloned()
    }

    /// Marks the connection as having refused a request: `true` the first
    /// time only, so one connection is one event.
    pub fn first_refusal(&self) -> bool {
        !self.refused.swap(true, Ordering::Relaxed)
    }

    /// A response came back on this connection.
    pub fn mark_answered(&self) {
        self.answered.store(true, Ordering::Relaxed);
    }

    /// Whether a response came back on this connection: an HTTP/1.1
    /// connection then went back to the pool, and a request that finds it
    /// closed met the server closing an idle connection, not refusing one.
    pub fn has_answered(&self) -> bool {
        self.answered.load(Ordering::Relaxed)
    }
}

/// A connector that tags every connection `C` makes.
#[derive(Clone, Debug)]
pub struct Tagging<C>(pub C);

/// A connection with its tag; reads and writes go straight through.
#[derive(Debug)]
pub struct Tagged<T> {
    inner: T,
    tag: ConnectionTag,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<C> tower_service::Service<Uri> for Tagging<C>
where
    C: tower_service::Service<Uri> + Send + 'static,
    C::Error: Into<BoxError>,
    C::Future: Send + 'static,
{
    type Response = Tagged<C::Response>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let connecting = self.0.call(dst);
        Box::pin(async move {
            let inner = connecting.await.map_err(Into::into)?;
            Ok(Tagged {
                inner,
                tag: ConnectionTag::default(),
            })
        })
    }
}

impl<T: Connection> Connection for Tagged<T> {
    fn connected(&self) -> Connected {
        self.inner.connected().extra(self.tag.clone())
    }
}

impl<T: Read + Unpin> Read for Tagged<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for Tagged<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
}
