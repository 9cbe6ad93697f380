//! How the relay behaves toward real HTTP infrastructure (issue 14, "HTTP
//! manners"), each against a real HTTP peer: a `Retry-After` pauses every
//! request to the sink, probes included (1); pooled connections have a
//! maximum age and an idle timeout (2); SIGTERM while an event is in
//! backoff starts no new attempt and exits within 5 s (4); a relay that
//! starts or takes over while the sink is dead sends it at most 2 requests
//! per second from its first one (6). Item 3 (HTTP/2 GOAWAY) is in
//! `tls.rs`, which has the https peer; item 6 per fault kind, across relay
//! kills, in `chaos.rs`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use harness::app;
use harness::proxy::{FaultProxy, Mode};
use harness::sink::ScriptedSink;
use harness::{Inbox, PgCluster, Scenario, wait_until};

const WAIT: Duration = Duration::from_secs(30);

/// Requests that reached the sink at or after `from`.
fn arrivals_since(times: &[Instant], from: Instant) -> Vec<Duration> {
    times
        .iter()
        .filter(|&&t| t >= from)
        .map(|&t| t - from)
        .collect()
}

/// Issue 14, HTTP manners 1: a `Retry-After` from the sink pauses every
/// request to it, circuit-breaker probes included, until then: after the
/// answer that carried it, nothing reaches the sink for that long, in both
/// forms (delay-seconds, HTTP-date), with the circuit open and with
/// several deliveries in flight; `--retry-after-max` caps it.
///
/// Fails without the fix: the probe after a `Retry-After: 4` came 0.5 s
/// later (the per-event pause did not hold the breaker's probes), and the
/// other events kept going during the pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_pauses_every_request_to_the_sink_probes_included() -> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Scripted).await?;
    let sink = s.sink();

    // The circuit opens on plain 503s (5 in a row), then probes.
    sink.set_status(503);
    for _ in 0..5 {
        app::insert_order_event(&s.db).await?;
    }
    s.relay
        .process
        .wait_for_line("circuit opened", WAIT)
        .await?;

    // A probe is answered 503 with `Retry-After: 4`: the next request of
    // any kind comes 4 s after that answer, not one probe interval.
    sink.set_retry_after(Some("4"));
    let asked = sink.count();
    wait_until("a probe answered with Retry-After", WAIT, || async {
        sink.count() > asked
    })
    .await?;
    let answered = sink.received()[asked].at;
    // The sink would take requests again at once; the relay must still wait.
    sink.set_status(204);
    sink.set_retry_after(None);
    wait_until("the delivery after the pause", WAIT, || async {
        !sink.delivered().is_empty()
    })
    .await?;
    let after = arrivals_since(&sink.arrival_times(), answered);
    eprintln!("requests after Retry-After: 4 on a probe: {after:?}");
    assert!(
        after[0] >= Duration::from_secs(4),
        "a request {:?} after the sink asked for 4 s of quiet",
        after[0]
    );

    // HTTP-date form, with a closed circuit and several deliveries in
    // flight: a date 3 s ahead (whole seconds: 2 to 3 s of quiet).
    s.settle().await?;
    let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(3));
    sink.set_status(503);
    sink.set_retry_after(Some(&date));
    let asked = sink.count();
    s.db.batch_execute(&many_events(5)).await?;
    wait_until("the batch answered with Retry-After", WAIT, || async {
        sink.count() > asked
    })
    .await?;
    let answered = sink.received()[asked].at;
    tokio::time::sleep(Duration::from_millis(300)).await; // the rest of the batch's first answers
    let first_round = sink.count() - asked;
    sink.set_status(204);
    sink.set_retry_after(None);
    s.settle().await?;
    let resumed = sink.received()[asked + first_round].arrived;
    eprintln!(
        "Retry-After {date}: {first_round} requests answered at once, the next {:?} later",
        resumed - answered
    );
    assert!(
        resumed - answered >= Duration::from_secs(2),
        "a request {:?} after an HTTP-date 2-3 s ahead",
        resumed - answered
    );

    // `--retry-after-max` caps the pause: 30 s asked, 2 s granted.
    s.stop_relay().await?;
    s.restart_relay(&["--retry-after-max", "2s"]).await?;
    let sink = s.sink();
    sink.set_status(503);
    sink.set_retry_after(Some("30"));
    let asked = sink.count();
    app::insert_order_event(&s.db).await?;
    wait_until("the answer with Retry-After: 30", WAIT, || async {
        sink.count() > asked
    })
    .await?;
    let answered = sink.received()[asked].at;
    sink.set_status(204);
    sink.set_retry_after(None);
    s.settle().await?;
    let next = sink.received()[asked + 1].arrived - answered;
    eprintln!("Retry-After: 30 with --retry-after-max 2s: next request after {next:?}");
    assert!(
        next >= Duration::from_secs(2) && next < Duration::from_secs(5),
        "{next:?}"
    );
    let m = s.relay.metrics().await?;
    assert!(m.value("cdc_relay_sink_pauses_total", &[]) >= Some(1.0));
    s.assert_balanced().await
}

/// Issue 14, HTTP manners 2: no pooled connection is reused past
/// `--sink-connection-max-age` (so a name whose address changed is looked
/// up again), and one idle for `--sink-idle-timeout` is not reused (closed
/// before a load balancer's 60 s idle timeout could close it under a
/// request). Connections are told apart by the client port the sink sees.
/// The defaults (at most 5 min, under 60 s) are asserted in
/// `settings::tests::defaults_keep_http_manners`.
///
/// Fails without the fix: one connection carried every request of the
/// 6 s stream, and the request after 2 s idle reused the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_connections_have_a_maximum_age_and_an_idle_timeout() -> anyhow::Result<()> {
    let mut s = Scenario::plan(Inbox::Scripted)
        .relay_args(&["--sink-connection-max-age", "2s"])
        .start()
        .await?;
    // A steady stream for 6 s (time is the subject): one event every 100 ms.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(6) {
        app::insert_order_event(&s.db).await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.settle().await?;
    let mut spans: BTreeMap<SocketAddr, (Instant, Instant, usize)> = BTreeMap::new();
    for r in s.sink().received() {
        let e = spans.entry(r.peer).or_insert((r.arrived, r.arrived, 0));
        e.0 = e.0.min(r.arrived);
        e.1 = e.1.max(r.arrived);
        e.2 += 1;
    }
    let report: Vec<String> = spans
        .iter()
        .map(|(peer, (a, b, n))| format!("{peer}: {n} requests over {:?}", *b - *a))
        .collect();
    eprintln!(
        "connections with --sink-connection-max-age 2s:\n{}",
        report.join("\n")
    );
    assert!(spans.len() >= 3, "{report:?}");
    for (peer, (first, last, _)) in &spans {
        // The last request may start just before the age is reached.
        assert!(
            *last - *first <= Duration::from_millis(2500),
            "{peer} took requests for {:?}: {report:?}",
            *last - *first
        );
    }

    // Idle timeout: a connection idle for 2 s with --sink-idle-timeout 1s
    // takes no further request.
    s.stop_relay().await?;
    s.restart_relay(&["--sink-idle-timeout", "1s"]).await?;
    let before = s.sink().count();
    app::insert_order_event(&s.db).await?;
    s.settle().await?;
    tokio::time::sleep(Duration::from_secs(2)).await; // idle time is the subject
    app::insert_order_event(&s.db).await?;
    s.settle().await?;
    let received = s.sink().received();
    let (first, second) = (&received[before], &received[before + 1]);
    assert_ne!(
        first.peer, second.peer,
        "the request after 2 s idle reused a connection idle past --sink-idle-timeout 1s"
    );
    s.assert_balanced().await
}

/// Issue 14, HTTP manners 4: SIGTERM while an event is in backoff (the
/// sink answers 503): from the shutdown on no new attempt starts, the
/// process exits 0 within 5 s with the default flags (below the usual 10 s
/// container grace), and nothing undelivered was acknowledged (the slot
/// still holds the event, delivered once after a restart).
///
/// Fails without the fix: the stop took the whole shutdown budget (15 s)
/// and the relay kept retrying after the shutdown line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_backoff_starts_no_attempt_and_exits_within_5s() -> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Scripted).await?;
    s.sink().set_status(503);
    app::insert_order_event(&s.db).await?;
    wait_until("three failed attempts", WAIT, || async {
        s.sink().arrivals() >= 3
    })
    .await?;
    let signalled = Instant::now();
    s.relay.process.sigterm();
    let status = s.relay.process.wait_exit(Duration::from_secs(30)).await?;
    let took = signalled.elapsed();
    let late = arrivals_since(
        &s.sink().arrival_times(),
        signalled + Duration::from_millis(200),
    );
    eprintln!("exit {status} {took:?} after SIGTERM; requests after it: {late:?}");
    assert!(status.success(), "{status}\n{}", s.relay.process.logs());
    assert!(
        took <= Duration::from_secs(5),
        "exited {took:?} after SIGTERM"
    );
    assert!(
        late.is_empty(),
        "attempts started after the shutdown began: {late:?}"
    );
    // Nothing undelivered was acknowledged: the slot still holds the event.
    s.assert_held(&["outbox"]).await?;
    s.sink().set_status(204);
    s.restart_relay(&[]).await?;
    s.assert_balanced().await
}

/// How long each relay's requests are counted from its first one.
const COUNTED: Duration = Duration::from_secs(3);

/// How often [`first_connection_after`] looks at the proxy.
const LOOK: Duration = Duration::from_millis(5);

/// Waits until `front` accepted more than `before` connections; returns
/// when it saw that (at most [`LOOK`] after the connection came).
async fn first_connection_after(front: &FaultProxy, before: usize) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + WAIT;
    while front.accepted() <= before {
        anyhow::ensure!(
            Instant::now() < deadline,
            "no request reached the sink's front within {WAIT:?}"
        );
        tokio::time::sleep(LOOK).await;
    }
    Ok(Instant::now())
}

/// Requests a relay sent from its first one after `before`.
struct Counted {
    /// When the first one was seen.
    first: Instant,
    /// Requests (new connections: the front resets each one, so every
    /// attempt needs one) from the first through [`COUNTED`].
    requests: usize,
    /// The most 2 per second allow over that span: probes are at least
    /// 500 ms apart, so a span of `secs` holds at most `2·secs + 1`.
    bound: usize,
}

async fn requests_from_first(front: &FaultProxy, before: usize) -> anyhow::Result<Counted> {
    let first = first_connection_after(front, before).await?;
    tokio::time::sleep_until((first + COUNTED).into()).await;
    let requests = front.accepted() - before;
    // The first connection came up to LOOK before it was seen.
    let secs = (first.elapsed() + LOOK).as_secs_f64();
    Ok(Counted {
        first,
        requests,
        bound: (2.0 * secs + 1.0).floor() as usize,
    })
}

/// Issue 14, HTTP manners 6, across relay starts and takeovers: with a
/// backlog waiting and the sink's front resetting every connection, a relay
/// that starts sends at most 2 requests per second from its first one, and
/// so does a hot standby taking over after it is SIGKILLed: its first
/// request goes at once, each later one a probe interval after the last
/// failure, with or without its circuit open. When the front passes again,
/// the whole backlog is delivered.
///
/// Measured: 6 requests in each relay's first 3 s (the standby's first
/// 0.32 s after the kill). Fails without the fix: "10 requests in a started
/// relay's first 3s" (the 5 failures that open a fresh relay's circuit went
/// back to back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_starting_or_taking_over_during_an_outage_sends_at_most_two_requests_per_second()
-> anyhow::Result<()> {
    const BACKLOG: usize = 20;
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let (front, sink_url) = app::proxied(&sink.url).await?;
    front.set_mode(Mode::Reset);
    let db = stack.orders_admin().await?;
    db.batch_execute(&many_events(BACKLOG)).await?;

    let mut first = app::start_relay(&stack, &sink_url, &[]).await?;
    let started = requests_from_first(&front, 0).await?;
    eprintln!(
        "a relay started during the outage: {} requests in its first {COUNTED:?} (at most {})",
        started.requests, started.bound
    );
    assert!(
        started.requests <= started.bound,
        "{} requests in a started relay's first {COUNTED:?}, more than 2/s",
        started.requests
    );

    let standby = app::start_relay(&stack, &sink_url, &[]).await?;
    standby
        .process
        .wait_for_line("waiting as hot standby", WAIT)
        .await?;
    // Kill right after a probe, so no request of the killed relay can be
    // counted as the standby's.
    let probed = front.accepted();
    first_connection_after(&front, probed).await?;
    let before = front.accepted();
    let killed = Instant::now();
    first.process.sigkill();
    let taking_over = requests_from_first(&front, before).await?;
    eprintln!(
        "a standby taking over during the outage, first request {:?} after the kill: \
         {} requests in its first {COUNTED:?} (at most {})",
        taking_over.first - killed,
        taking_over.requests,
        taking_over.bound
    );
    assert!(
        taking_over.requests <= taking_over.bound,
        "{} requests in the first {COUNTED:?} of a relay that took over, more than 2/s",
        taking_over.requests
    );

    front.set_mode(Mode::Pass);
    wait_until("the backlog delivered", WAIT, || async {
        sink.delivered().len() >= BACKLOG
    })
    .await?;
    let delivered: std::collections::BTreeSet<String> =
        sink.delivered().iter().map(|r| r.id()).collect();
    assert_eq!(delivered.len(), BACKLOG, "every event of the backlog");
    let m = standby.metrics().await?;
    assert_eq!(m.value("cdc_relay_circuit_state", &[]), Some(0.0));
    Ok(())
}

/// `n` events in one transaction, each of its own order (aggregate), so
/// they may all be in flight at once.
fn many_events(n: usize) -> String {
    let mut sql = String::from("BEGIN;");
    for _ in 0..n {
        let (order, event) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        sql.push_str(&format!(
            "INSERT INTO orders (id, amount_cents, currency) VALUES ('{order}', 1, 'EUR'); \
             INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES ('{event}', '{order}', \
             'OrderCreated', jsonb_build_object('order_id', '{order}'::uuid, 'amount_cents', 1, 'currency', 'EUR'));"
        ));
    }
    sql.push_str("COMMIT;");
    sql
}
