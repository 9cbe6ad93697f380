//! The sink's own connections against misbehaving local servers: a full
//! listen queue, a connection closed under a request, an early answer, a
//! body past the excerpt, an idle close, a handshake that never ends.

use super::*;

/// A sink slow to take new connections (its listen queue is full, so the
/// kernel drops the SYNs of new ones): requests take the connection another
/// request gives back instead of each waiting for its own. A Python
/// `ThreadingHTTPServer` (a listen queue of 5) met by a burst of 64 is such
/// a sink.
///
/// Fails without it: seven of the eight requests waited for a connection
/// that never completed and timed out (sent again later: duplicates at
/// the sink when a slow connect did complete). And the attempts of those
/// that took a connection given back must end: left running, they
/// completed once the queue drained and joined the idle stack (8 where 1
/// was needed; with syncookies, connections the sink never accepted,
/// which then took requests into silence).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_takes_a_connection_given_back_while_new_ones_cannot_connect() {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1).unwrap();
    let addr = listener.local_addr().unwrap();
    // A connect timeout past the kernel's SYN retries (1 s, 3 s).
    let s = HttpSink::new(SinkConfig {
        url: format!("http://{addr}/inbox").parse().unwrap(),
        signing: Signing::new(signer(SignatureScheme::Both, KEY, None)),
        connect_timeout: Duration::from_secs(10),
        request_timeout: Duration::from_secs(2),
        connection_max_age: Duration::from_secs(60),
        idle_timeout: Duration::from_secs(30),
        tls: Default::default(),
    })
    .unwrap();
    let first = tokio::spawn({
        let s = s.clone();
        async move { s.post("e", &prepared(&s), None).await }
    });
    // The one connection the server ever takes, served keep-alive.
    let (sock, _) = listener.accept().await.unwrap();
    tokio::spawn(serve_keep_alive(sock));
    let got = first.await.unwrap();
    assert!(
        matches!(got, Attempt::Response { status: 204, .. }),
        "{got:?}"
    );
    // Fill the listen queue: no further connection completes.
    let mut held = Vec::new();
    for _ in 0..4 {
        let connect = tokio::net::TcpStream::connect(addr);
        if let Ok(Ok(c)) = tokio::time::timeout(Duration::from_millis(200), connect).await {
            held.push(c);
        }
    }
    let posts: Vec<_> = (0..8)
        .map(|_| {
            let s = s.clone();
            tokio::spawn(async move { s.post("e", &prepared(&s), None).await })
        })
        .collect();
    for post in posts {
        let got = post.await.unwrap();
        assert!(
            matches!(got, Attempt::Response { status: 204, .. }),
            "{got:?}"
        );
    }
    // The queue drains: a connection attempt still running would now
    // complete (at the kernel's next SYN retry) and join the idle stack, a
    // connection nobody asked for. None is left running.
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            tokio::spawn(serve_keep_alive(sock));
        }
    });
    drop(held);
    tokio::time::sleep(Duration::from_millis(3500)).await; // the SYN retries' window is the subject
    assert_eq!(s.connections.idle_count(), 1);
}

const NO_CONTENT: &[u8] = b"HTTP/1.1 204 No Content\r\n\r\n";

/// Answers every request on `sock` with a 204, keeping the connection.
async fn serve_keep_alive(sock: tokio::net::TcpStream) {
    serve_answering(sock, NO_CONTENT).await;
}

/// Answers every request on `sock` with `answer`, keeping the connection.
async fn serve_answering(mut sock: tokio::net::TcpStream, answer: &'static [u8]) {
    use tokio::io::AsyncWriteExt;
    let mut buf = Vec::new();
    while read_request(&mut sock, &mut buf, true).await {
        if sock.write_all(answer).await.is_err() {
            return;
        }
    }
}

/// Reads one request off `sock` (its head, and its body when `body`);
/// `false` when the connection ended first.
async fn read_request(sock: &mut tokio::net::TcpStream, buf: &mut Vec<u8>, body: bool) -> bool {
    use tokio::io::AsyncReadExt;
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    if !body {
        return true;
    }
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap());
    let total = head_end + 4 + length;
    while buf.len() < total {
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    buf.drain(..total);
    true
}

fn is_204(got: &Attempt) -> bool {
    matches!(got, Attempt::Response { status: 204, .. })
}

/// A kept-alive connection that the sink closes under the next request
/// (it answered once, then reads the next request and closes without an
/// answer, as a server does that closes after each answer without saying
/// `Connection: close`): the request is sent again at once on another
/// connection, a connection event, not a failure for the breaker.
///
/// Fails without it: the second attempt was a transport failure
/// ("connection closed before message completed"); a tester's sink of
/// that kind opened the circuit 57 times in a backlog of 2,000.
#[tokio::test]
async fn a_request_meeting_the_close_of_a_kept_alive_connection_is_sent_again() {
    let (addr, accepted) = listener(|n, mut sock| async move {
        if n > 1 {
            return serve_keep_alive(sock).await;
        }
        use tokio::io::AsyncWriteExt;
        let mut buf = Vec::new();
        if read_request(&mut sock, &mut buf, true).await {
            let _ = sock.write_all(NO_CONTENT).await;
            // The next request is read and the connection closed.
            read_request(&mut sock, &mut buf, false).await;
        }
    })
    .await;
    let s = sink(&format!("http://{addr}/inbox"), Duration::from_secs(5));
    for _ in 0..2 {
        let got = s.post("e", &prepared(&s), None).await;
        assert!(is_204(&got), "{got:?}");
    }
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// A sink that answers before it has read the request's body (and then
/// reads no more): the connection is still busy writing that body, so the
/// next request takes a new connection instead of waiting for it.
///
/// Fails without it: the next attempt waited on the busy connection until
/// its request timeout ("request timed out", though nothing was sent).
#[tokio::test]
async fn a_connection_still_writing_a_body_answered_early_takes_no_request() {
    let (addr, accepted) = listener(|n, mut sock| async move {
        if n > 1 {
            return serve_keep_alive(sock).await;
        }
        use tokio::io::AsyncWriteExt;
        let mut buf = Vec::new();
        if read_request(&mut sock, &mut buf, false).await {
            let _ = sock.write_all(NO_CONTENT).await;
            // Holds the connection, reading nothing more.
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
    })
    .await;
    let s = sink(&format!("http://{addr}/inbox"), Duration::from_secs(2));
    let big = Prepared::signed(Bytes::from(vec![b' '; 8 << 20]), s.signing().current());
    let got = s.post("big", &big, None).await;
    assert!(is_204(&got), "{got:?}");
    let got = s.post("e", &prepared(&s), None).await;
    assert!(is_204(&got), "{got:?}");
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// An answer with a body longer than the excerpt (a JSON acknowledgement)
/// keeps its connection when the body has arrived: read, not kept.
///
/// Fails without it: every such answer cost a new connection (5 for 5).
#[tokio::test]
async fn an_answer_with_a_body_past_the_excerpt_keeps_its_connection() {
    let answer = format!(
        "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{}",
        "x".repeat(1000)
    );
    let answer: &'static [u8] = Box::leak(answer.into_bytes().into_boxed_slice());
    let (addr, accepted) = listener(move |_, sock| serve_answering(sock, answer)).await;
    let s = sink(&format!("http://{addr}/inbox"), Duration::from_secs(5));
    for _ in 0..5 {
        let got = s.post("e", &prepared(&s), None).await;
        match got {
            Attempt::Response {
                status: 200,
                excerpt,
                ..
            } => assert_eq!(excerpt.len(), EXCERPT_BYTES),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// An idle connection the sink closes is closed on the relay's side too
/// within about a second (not left half-closed until the idle timeout).
///
/// Fails without it: it stayed in the idle stack for the reaper's period
/// of 15 s (half the 30 s idle timeout).
#[tokio::test]
async fn an_idle_connection_the_sink_closes_is_dropped_within_a_second() {
    let (addr, _) = listener(|_, mut sock| async move {
        use tokio::io::AsyncWriteExt;
        let mut buf = Vec::new();
        if read_request(&mut sock, &mut buf, true).await {
            let _ = sock.write_all(NO_CONTENT).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let s = sink(&format!("http://{addr}/inbox"), Duration::from_secs(5));
    let got = s.post("e", &prepared(&s), None).await;
    assert!(is_204(&got), "{got:?}");
    assert_eq!(s.connections.idle_count(), 1);
    let started = std::time::Instant::now();
    while s.connections.idle_count() > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the closed connection is still idle after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The connection a request was sent again on after a kept-alive
/// connection closed under it is a new one, not another idle one that
/// may have been closed the same way (two connections that each answered
/// once and close at the next request).
///
/// Fails without it: the second try took the other stale connection and
/// the attempt was a transport failure.
#[tokio::test]
async fn a_request_sent_again_goes_to_a_new_connection_not_another_idle_one() {
    let (addr, accepted) = listener(|n, mut sock| async move {
        if n > 2 {
            return serve_keep_alive(sock).await;
        }
        use tokio::io::AsyncWriteExt;
        let mut buf = Vec::new();
        if read_request(&mut sock, &mut buf, true).await {
            // Slow enough that both first requests are in flight at once,
            // each on its own connection.
            tokio::time::sleep(Duration::from_millis(200)).await;
            let _ = sock.write_all(NO_CONTENT).await;
            read_request(&mut sock, &mut buf, false).await;
        }
    })
    .await;
    let s = sink(&format!("http://{addr}/inbox"), Duration::from_secs(5));
    let request = prepared(&s);
    let (a, b) = tokio::join!(s.post("a", &request, None), s.post("b", &request, None));
    assert!(is_204(&a) && is_204(&b), "{a:?} {b:?}");
    assert_eq!(s.connections.idle_count(), 2);
    let got = s.post("c", &prepared(&s), None).await;
    assert!(is_204(&got), "{got:?}");
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 3);
}

/// An attempt that times out ends its connection attempt with it: an
/// `https` sink behind a front that accepts TCP and never speaks TLS keeps
/// no socket of the relay's once the attempt is over. Such an attempt is a
/// timeout connecting, not a request that timed out.
///
/// Fails without it: each timed-out attempt left its TLS handshake waiting
/// in a task of its own, one held socket per attempt (and, for a sink that
/// speaks HTTP/2, every later request waited for that one handshake).
#[tokio::test]
async fn an_attempt_that_times_out_ends_its_connection_attempt() {
    let ended = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = Arc::clone(&ended);
    let (addr, _) = listener(move |_, mut sock| {
        let count = Arc::clone(&count);
        async move {
            use tokio::io::AsyncReadExt;
            let mut buf = [0u8; 4096];
            // The ClientHello is read and never answered; the read that
            // returns 0 is the relay closing the socket.
            while let Ok(n) = sock.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    })
    .await;
    let s = sink(
        &format!("https://localhost:{}/inbox", addr.port()),
        Duration::from_millis(300),
    );
    for _ in 0..3 {
        let got = s.post("e", &prepared(&s), None).await;
        // No slow answer: no request went (the detail says so).
        assert_eq!(got, Attempt::ConnectTimeout);
        assert!(got.detail().contains("TLS"), "{}", got.detail());
    }
    let started = std::time::Instant::now();
    while ended.load(std::sync::atomic::Ordering::SeqCst) < 3 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the relay still holds {} of its 3 handshakes after 5 s",
            3 - ended.load(std::sync::atomic::Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A 2xx whose body stalls after its first bytes is the sink's answer:
/// the event is delivered when the request timeout runs out (as when such
/// a body is cut), not sent again. A 207's body is its per-event answer,
/// so a stalled one is a timeout. Either way the connection is not reused.
///
/// Fails without it: the 200 came back as `Attempt::Timeout` (retried,
/// while the same 200 with its body cut counted as delivered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2xx_whose_body_stalls_is_delivered_and_a_207_is_a_timeout() {
    for (status, want) in [("200 OK", Some(200)), ("207 Multi-Status", None)] {
        let (addr, accepted) = listener(move |_, mut sock| async move {
            use tokio::io::AsyncWriteExt;
            let mut buf = Vec::new();
            if read_request(&mut sock, &mut buf, true).await {
                let head = format!("HTTP/1.1 {status}\r\ncontent-length: 100\r\n\r\n0123456789");
                let _ = sock.write_all(head.as_bytes()).await;
                // Holds the connection, the rest of the body never sent.
                tokio::time::sleep(Duration::from_secs(60)).await;
            }
        })
        .await;
        let s = sink(&format!("http://{addr}/inbox"), Duration::from_millis(300));
        for _ in 0..2 {
            let got = s.post("e", &prepared(&s), None).await;
            match want {
                Some(code) => assert!(
                    matches!(got, Attempt::Response { status, .. } if status == code),
                    "{status}: {got:?}"
                ),
                None => assert_eq!(got, Attempt::Timeout, "{status}"),
            }
        }
        assert_eq!(
            accepted.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "{status}: a connection whose body never ended is not reused"
        );
    }
}
