//! HTTP/2 sinks (TLS with ALPN `h2`, the `h2` crate's server): a sink that
//! drains with streams in flight (GOAWAY, `REFUSED_STREAM`; issue 14, HTTP
//! manners 3), an answer head over the h2 library's default limit, a stream
//! reset that leaves the connection in service, a connection gone silent,
//! and one connection per burst, closed when idle.

use std::time::Duration;

use harness::app;
use harness::pki::path_str;
use harness::wait_until;

use crate::tls::Pki;

const WAIT: Duration = Duration::from_secs(30);

/// Issue 14, HTTP manners 3: an HTTP/2 sink (h2 over TLS, the `h2`
/// crate's server) takes the relay's first event; then, with the next
/// batch's ten streams in flight on that connection, it takes one, refuses
/// the others (`REFUSED_STREAM`) and drains (GOAWAY) like a server shutting
/// down. The refused streams were never processed: the relay sends each
/// again at once on a new connection; together they count as one
/// connection event (`cdc_relay_sink_connection_events_total` 1), none as a
/// sink failure (no retry counted, the circuit never opens), and every
/// event is delivered.
///
/// Fails without the fix: the refused streams counted as transient failures
/// (`cdc_relay_retries_total{reason="transport"}`) and went out again only
/// after their backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_goaway_with_streams_in_flight_is_a_connection_event() -> anyhow::Result<()> {
    let run = H2Run::first_delivered(First::Draining, &[]).await?;
    let (sink, relay, db) = (&run.sink, &run.relay, &run.db);
    // Ten events of ten orders in one transaction: all in flight at once,
    // multiplexed on the one h2 connection.
    db.batch_execute(&app::order_events_sql(10)).await?;
    wait_until("the ten events delivered", WAIT, || async {
        sink.state().delivered.len() == 11
    })
    .await?;
    let state = sink.state();
    let took = state.goaway_at.map(|t| state.last_delivery - t);
    eprintln!(
        "h2 sink: {} connections, {} streams refused; the batch delivered {took:?} after the GOAWAY",
        state.connections, state.refused
    );
    assert!(
        state.refused >= 3 && took.is_some(),
        "the scenario happened: {state:?}"
    );
    assert!(state.connections >= 2, "{state:?}");
    let m = relay.metrics().await?;
    assert_eq!(
        m.sum("cdc_relay_retries_total"),
        0.0,
        "streams the sink never processed are not sink failures: {:?}\n{}",
        m.label_values("cdc_relay_retries_total", "reason"),
        relay
            .process
            .logs()
            .lines()
            .filter(|l| l.contains("will retry"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        m.value("cdc_relay_sink_fresh_connection_retries_total", &[]) >= Some(3.0),
        "{:?}",
        m.value("cdc_relay_sink_fresh_connection_retries_total", &[])
    );
    assert_eq!(
        m.value("cdc_relay_sink_connection_events_total", &[]),
        Some(1.0),
        "one draining connection is one connection event"
    );
    assert_eq!(m.value("cdc_relay_circuit_state", &[]), Some(0.0));
    assert!(!relay.process.logs().contains("circuit opened"));
    // At once: no backoff, and well within one probe interval.
    assert!(
        took.is_some_and(|t| t < Duration::from_millis(500)),
        "{took:?}"
    );
    Ok(())
}

/// An HTTP/2 sink whose answer head is 40 KiB of header fields (over the
/// h2 library's default limit of 16 KiB, under the 400 KiB the relay reads
/// over HTTP/1.1) is read like any other: the event is delivered at once,
/// no retry. Before, the relay's h2 library reset each such stream
/// ("unspecific protocol error") and the event was sent again for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_answer_head_over_16_kib_is_read() -> anyhow::Result<()> {
    let run = H2Run::first_delivered(First::LargeHead, &[]).await?;
    run.second_delivered().await?;
    let m = run.relay.metrics().await?;
    assert_eq!(
        m.sum("cdc_relay_retries_total"),
        0.0,
        "{:?}",
        m.label_values("cdc_relay_retries_total", "reason")
    );
    assert_eq!(run.sink.state().delivered.len(), 2);
    Ok(())
}

/// An HTTP/2 stream the sink resets (`INTERNAL_ERROR`: one request's
/// handler failed) is a failed attempt, retried after its backoff on the
/// same connection: the reset ended one stream, not the connection. Fails
/// without it: every reset retired the shared connection (a tester's run:
/// 157 TLS connections for 178 resets in 8 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_stream_reset_keeps_the_connection() -> anyhow::Result<()> {
    let run = H2Run::first_delivered(First::ResetOnce, &[]).await?;
    run.second_delivered().await?;
    let state = run.sink.state();
    assert_eq!(state.reset, 1, "the scenario happened: {state:?}");
    assert_eq!(state.connections, 1, "{state:?}");
    let m = run.relay.metrics().await?;
    let reasons = m.label_values("cdc_relay_retries_total", "reason");
    assert!(
        m.sum("cdc_relay_retries_total") == 1.0 && reasons.contains("transport"),
        "one failed attempt: {reasons:?}"
    );
    Ok(())
}

/// An HTTP/2 sink's connection that goes silent (open, never read or
/// answered again: a hung worker, a half-open path after a failover)
/// costs one request timeout: the requests that timed out on it go again
/// on a new connection, which the sink serves, long before the silent one
/// reaches its maximum age. Fails without it: the relay kept sending every
/// request and probe down the silent connection until
/// `--sink-connection-max-age` (a tester's run: 64 s for 200 events at the
/// defaults; here the age is 10 minutes and the wait 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_http2_connection_costs_one_timeout_not_its_whole_age() -> anyhow::Result<()> {
    let run = H2Run::first_delivered(
        First::Silent,
        &[
            "--request-timeout",
            "1s",
            "--sink-connection-max-age",
            "10m",
        ],
    )
    .await?;
    let (sink, relay, db) = (&run.sink, &run.relay, &run.db);
    db.batch_execute(&app::order_events_sql(10)).await?;
    wait_until(
        "the ten events delivered on another connection",
        WAIT,
        || async { sink.state().delivered.len() == 11 },
    )
    .await?;
    let state = sink.state();
    assert!(state.connections >= 2, "{state:?}");
    let m = relay.metrics().await?;
    let reasons = m.label_values("cdc_relay_retries_total", "reason");
    assert!(
        reasons.contains("timeout"),
        "the silent connection was met: {reasons:?}"
    );
    Ok(())
}

/// An HTTP/2 sink's one connection is closed by the relay once idle for
/// `--sink-idle-timeout`, and once the relay knows the sink speaks h2 a
/// burst waits for one new connection instead of each request opening its
/// own. Fails without it: the idle connection stayed open (no reaper ran
/// for HTTP/2), and bursts after an idle close opened one TLS connection
/// per request in flight (193 for three bursts of 500 in a tester's run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_sink_gets_one_connection_per_burst_closed_when_idle() -> anyhow::Result<()> {
    let run = H2Run::first_delivered(First::Plain, &["--sink-idle-timeout", "1s"]).await?;
    let (sink, db) = (&run.sink, &run.db);
    wait_until(
        "the idle h2 connection closed by the relay",
        WAIT,
        || async { sink.state().closed == 1 },
    )
    .await?;
    db.batch_execute(&app::order_events_sql(40)).await?;
    wait_until("the burst delivered", WAIT, || async {
        sink.state().delivered.len() == 41
    })
    .await?;
    let state = sink.state();
    assert_eq!(
        state.connections, 2,
        "one connection for the first event, one for the burst: {state:?}"
    );
    Ok(())
}

/// A relay delivering to an [`H2Sink`] whose first connection behaves as
/// `first` says, with its first event delivered on that connection.
struct H2Run {
    sink: H2Sink,
    relay: app::Running,
    db: tokio_postgres::Client,
    _stack: harness::Stack,
    _pki: Pki,
}

impl H2Run {
    /// Starts the sink and a relay trusting its CA (plus `args`), and
    /// delivers one event.
    async fn first_delivered(first: First, args: &[&str]) -> anyhow::Result<H2Run> {
        let pki = Pki::generate()?;
        let stack = harness::PgCluster::shared().create_stack().await?;
        app::relay_setup(&stack).await?;
        let sink = H2Sink::start_with(&pki, first).await?;
        let mut relay_args = vec!["--sink-ca-file", path_str(&pki.ca)?];
        relay_args.extend_from_slice(args);
        let relay = app::start_relay(&stack, &sink.url, &relay_args).await?;
        app::wait_streaming(&relay).await?;
        let db = stack.orders_admin().await?;
        app::insert_order_event(&db).await?;
        wait_until("the first event over h2", WAIT, || async {
            sink.state().delivered.len() == 1
        })
        .await?;
        Ok(H2Run {
            sink,
            relay,
            db,
            _stack: stack,
            _pki: pki,
        })
    }

    /// Commits one more event and waits until the sink has taken it (its
    /// second).
    async fn second_delivered(&self) -> anyhow::Result<()> {
        app::insert_order_event(&self.db).await?;
        wait_until("the second event delivered", WAIT, || async {
            self.sink.state().delivered.len() == 2
        })
        .await
    }
}

/// What the [`H2Sink`] saw.
#[derive(Debug, Clone)]
struct H2State {
    /// TLS connections accepted.
    connections: usize,
    /// Event ids answered 204, in order.
    delivered: Vec<String>,
    /// Streams reset with `REFUSED_STREAM`.
    refused: usize,
    /// Streams reset with `INTERNAL_ERROR`.
    reset: usize,
    /// When the GOAWAY went out.
    goaway_at: Option<std::time::Instant>,
    /// When the last 204 went out.
    last_delivery: std::time::Instant,
    /// Connections the relay closed (or that ended).
    closed: usize,
}

/// An HTTP/2 inbox (h2 over tokio-rustls, ALPN `h2`). Its first connection
/// answers the first request, then behaves as its [`First`] says; every
/// other connection answers 204.
struct H2Sink {
    url: String,
    state: std::sync::Arc<std::sync::Mutex<H2State>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for H2Sink {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl H2Sink {
    async fn start_with(pki: &Pki, first_mode: First) -> anyhow::Result<H2Sink> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs = CertificateDer::pem_file_iter(&pki.cert)?.collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_file(&pki.key)?;
        let mut config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = tcp.local_addr()?.port();
        let state = std::sync::Arc::new(std::sync::Mutex::new(H2State {
            connections: 0,
            delivered: Vec::new(),
            refused: 0,
            reset: 0,
            goaway_at: None,
            last_delivery: std::time::Instant::now(),
            closed: 0,
        }));
        let shared = std::sync::Arc::clone(&state);
        let accept = tokio::spawn(async move {
            while let Ok((tcp, _)) = tcp.accept().await {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    continue;
                };
                let first = {
                    let mut s = shared.lock().expect("h2 sink lock");
                    s.connections += 1;
                    if s.connections == 1 {
                        first_mode
                    } else {
                        First::Plain
                    }
                };
                let state = std::sync::Arc::clone(&shared);
                tokio::spawn(async move {
                    serve_h2(tls, first, std::sync::Arc::clone(&state)).await;
                    state.lock().expect("h2 sink lock").closed += 1;
                });
            }
        });
        Ok(H2Sink {
            url: format!("https://localhost:{port}/inbox"),
            state,
            accept,
        })
    }

    fn state(&self) -> H2State {
        self.state.lock().expect("h2 sink lock").clone()
    }
}

/// What an [`H2Sink`]'s first connection does after its first request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum First {
    /// Answers 204, as every other connection.
    Plain,
    /// Of the next requests it takes the first (and answers it 100 ms
    /// later) and refuses the others (`REFUSED_STREAM`); with three
    /// refused it drains like a server shutting down (GOAWAY, the taken
    /// stream finished, the connection closed).
    Draining,
    /// Goes silent at the next request: the connection stays open and is
    /// never read or answered again (a hung worker, a half-open path).
    Silent,
    /// Answers 204 with a head of 40 KiB of header fields (cookies and
    /// policies a proxy adds), over the h2 library's default 16 KiB.
    LargeHead,
    /// Resets the next stream (`INTERNAL_ERROR`: the handler failed), then
    /// answers 204 as every other connection.
    ResetOnce,
}

async fn serve_h2(
    tls: tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
    first: First,
    state: std::sync::Arc<std::sync::Mutex<H2State>>,
) {
    let Ok(mut conn) = h2::server::handshake(tls).await else {
        return;
    };
    let mut held = None;
    // Streams of the batch kept until three are in hand: refusing the first
    // at once would let the relay's retry open a second connection before
    // the rest of the batch was sent, and the batch would go there instead.
    let mut waiting = Vec::new();
    let mut draining = false;
    while let Some(Ok((request, mut respond))) = conn.accept().await {
        let mode = {
            let mut s = state.lock().expect("h2 sink lock");
            match first {
                _ if s.delivered.is_empty() => First::Plain,
                First::ResetOnce if s.reset == 0 => {
                    s.reset += 1;
                    First::ResetOnce
                }
                First::ResetOnce => First::Plain,
                other => other,
            }
        };
        // Answered at once, with this many KiB of header fields; `None`:
        // the draining batch, below.
        let answered = match mode {
            First::Plain => Some(0),
            First::LargeHead => Some(40),
            First::ResetOnce => {
                respond.send_reset(h2::Reason::INTERNAL_ERROR);
                continue;
            }
            First::Silent => {
                // Nothing on this connection is read or answered again; it
                // stays open until the relay closes it.
                let _held = (request, respond);
                std::future::pending::<()>().await;
                continue;
            }
            First::Draining => None,
        };
        if let Some(padding_kib) = answered {
            tokio::spawn(answer(
                request,
                respond,
                std::sync::Arc::clone(&state),
                Duration::ZERO,
                padding_kib,
            ));
            continue;
        }
        // The batch on the first connection: the first stream is taken and
        // answered a little later; three more are refused together, and the
        // connection drains (GOAWAY) like a server shutting down, refusing
        // whatever else arrives before the relay sees the GOAWAY.
        if draining {
            respond.send_reset(h2::Reason::REFUSED_STREAM);
            state.lock().expect("h2 sink lock").refused += 1;
            continue;
        }
        if held.is_none() {
            held = Some((request, respond));
            continue;
        }
        waiting.push((request, respond));
        if waiting.len() < 3 {
            continue;
        }
        draining = true;
        for (_request, mut respond) in waiting.drain(..) {
            respond.send_reset(h2::Reason::REFUSED_STREAM);
        }
        {
            let mut s = state.lock().expect("h2 sink lock");
            s.refused += 3;
            s.goaway_at = Some(std::time::Instant::now());
        }
        conn.graceful_shutdown();
        if let Some((request, respond)) = held.take() {
            tokio::spawn(answer(
                request,
                respond,
                std::sync::Arc::clone(&state),
                Duration::from_millis(100),
                0,
            ));
        }
    }
}

/// Reads the request's body and answers 204 after `delay`, with
/// `padding_kib` header fields of 1 KiB each, recording the event id.
async fn answer(
    request: axum::http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<bytes::Bytes>,
    state: std::sync::Arc<std::sync::Mutex<H2State>>,
    delay: Duration,
    padding_kib: usize,
) {
    let mut body = request.into_body();
    let mut bytes = Vec::new();
    while let Some(Ok(chunk)) = body.data().await {
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    tokio::time::sleep(delay).await;
    let id = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v["id"].as_str().map(str::to_owned))
        .unwrap_or_default();
    let mut response = axum::http::Response::builder().status(204);
    for n in 0..padding_kib {
        response = response.header(format!("x-padding-{n}"), "a".repeat(1024));
    }
    let response = response.body(()).expect("a valid response");
    if respond.send_response(response, true).is_ok() {
        let mut s = state.lock().expect("h2 sink lock");
        s.delivered.push(id);
        s.last_delivery = std::time::Instant::now();
    }
}
