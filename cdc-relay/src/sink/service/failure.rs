//! What a failed attempt's error means: a connection never made (the
//! connect timeout, TLS), a request the sink cannot have processed (sent
//! again at once on another connection), a reset that ends one HTTP/2
//! stream and not its connection, and a transport failure's detail.

use crate::sink::Attempt;
use crate::sink::connection::Conn;

/// An attempt that got no connection: the connect timeout, a TLS failure
/// (with a word for a plain-HTTP endpoint behind an `https` URL), or the
/// connect error itself.
pub(super) fn connect_error(e: &(dyn std::error::Error + Send + Sync + 'static)) -> Attempt {
    if source_is_timeout(e) {
        Attempt::ConnectTimeout
    } else if source_is_tls(e) {
        let chain = crate::error_chain(e);
        // rustls's words for a first record that is no TLS record: an
        // https:// URL reaching a plain-HTTP listener.
        if chain.contains("InvalidContentType") {
            Attempt::Tls(format!(
                "{chain} (the endpoint answered in plain text: it does not speak TLS on \
                     that port; use http:// in the URL, or enable TLS on the endpoint)"
            ))
        } else {
            Attempt::Tls(chain)
        }
    } else {
        Attempt::Connect(crate::error_chain(e))
    }
}

/// A transport failure's detail: hyper's error chain, and for a response
/// head too large to read what it means (the answer may be a 2xx: the
/// event is sent again, and the receiver's inbox deduplicates it).
pub(super) fn transport_detail(e: &hyper::Error) -> String {
    let chain = crate::error_chain(e);
    if e.is_parse_too_large() {
        format!(
            "{chain}: the sink's response head is larger than the relay reads (HTTP/1.1: 100 header fields or about 400 KiB), \
             so its status is unknown; check what adds headers in front of the sink"
        )
    } else if h2_error(e).is_some_and(|h| {
        h.is_library() && h.is_reset() && h.reason() == Some(h2::Reason::PROTOCOL_ERROR)
    }) {
        // What the h2 library reports for an answer it cannot take: most
        // often a header list over its limit.
        format!(
            "{chain}: the relay reset the HTTP/2 stream because the sink's answer broke the protocol as it reads it, \
             most often a response head larger than it reads (about 400 KiB of header fields), so its status is unknown; \
             check what adds headers in front of the sink"
        )
    } else if e.is_parse() && chain.contains("invalid HTTP version") {
        // What hyper's HTTP/1.1 reader says of an answer that is not
        // HTTP/1.x: most often an HTTP/2 server's first frame.
        format!(
            "{chain}: the sink did not answer in HTTP/1.1 (an HTTP/2-only, h2c, server?). Over http:// the relay \
             speaks HTTP/1.1; it speaks HTTP/2 over https:// with a sink that offers it (ALPN): enable HTTP/1.1 on \
             the sink, or serve it over TLS"
        )
    } else {
        chain
    }
}

/// The h2 error in `e`'s chain, if any.
fn h2_error(e: &hyper::Error) -> Option<&h2::Error> {
    std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |e| {
        e.source()
    })
    .find_map(|err| err.downcast_ref::<h2::Error>())
}

/// Whether the sink cannot have processed the request: it was canceled
/// before it was written (a pooled connection found closed), or its HTTP/2
/// stream was refused (`REFUSED_STREAM`, RFC 9113 §8.7) or reset by the
/// peer's GOAWAY (§6.8: streams above its last stream id were not
/// processed). A stream at or below that id cut by the connection closing
/// may have been processed: h2 reports it as a broken pipe, a transport
/// failure like any other.
pub(super) fn never_processed(e: &hyper::Error) -> bool {
    std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |e| {
        e.source()
    })
    .any(|err| {
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            return h.is_canceled();
        }
        err.downcast_ref::<h2::Error>().is_some_and(|h| {
            h.is_remote() && (h.reason() == Some(h2::Reason::REFUSED_STREAM) || h.is_go_away())
        })
    })
}

/// Whether `e` ended only its own HTTP/2 stream: a `RST_STREAM` (RFC 9113
/// §6.4) from the sink, or from the relay's h2 library for an answer it
/// cannot read, other than `REFUSED_STREAM`. The connection is sound and
/// goes on carrying the other requests (retiring it would cost the sink a
/// TLS handshake per reset). A refused stream still retires it: the sink
/// is shutting it down or shedding load on it, and the request goes again
/// at once on another ([`never_processed`]); so do a GOAWAY and an I/O
/// error.
pub(super) fn stream_reset(e: &hyper::Error) -> bool {
    h2_error(e).is_some_and(|h| h.is_reset() && h.reason() != Some(h2::Reason::REFUSED_STREAM))
}

/// Whether an HTTP/1.1 connection that had answered before closed (or
/// was reset) under the next request before any of its answer: the sink
/// closed it while idle and the request met the close (a server that
/// closes after each answer without `Connection: close`, or one whose
/// idle timeout ran out as the request left). The request most likely
/// never reached the application; if it did, sending it again is what
/// at-least-once allows (the `Idempotency-Key` is the same).
pub(super) fn closed_under(e: &hyper::Error, conn: &Conn) -> bool {
    conn.is_http1()
        && (e.is_incomplete_message()
            || std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |e| {
                e.source()
            })
            .any(|err| {
                err.downcast_ref::<std::io::Error>().is_some_and(|io| {
                    matches!(
                        io.kind(),
                        std::io::ErrorKind::ConnectionReset
                            | std::io::ErrorKind::ConnectionAborted
                            | std::io::ErrorKind::BrokenPipe
                    )
                })
            }))
}

/// A connect error whose cause is the TCP connect timeout.
fn source_is_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(e), |e| e.source()).any(|err| {
        err.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
    })
}

/// A connect error whose cause is the TLS handshake: a rustls error, on
/// its own or wrapped in `io::Error`s (the TLS stream reports it in one and
/// the connector wraps that in another; `io::Error::source` skips both, so
/// their payloads are followed with `get_ref`).
pub(super) fn source_is_tls(e: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(e), |e| e.source()).any(|err| {
        std::iter::successors(Some(err), |e| {
            e.downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::get_ref)
                .map(|inner| inner as &(dyn std::error::Error + 'static))
        })
        .any(|e| e.is::<rustls::Error>())
    })
}
