//! How the relay behaves toward real HTTP infrastructure (issue 14, "HTTP
//! manners"), each against a real HTTP peer: a `Retry-After` pauses every
//! request to the sink, probes included (1); pooled connections have a
//! maximum age and an idle timeout (2); SIGTERM while an event is in
//! backoff starts no new attempt and exits within 5 s (4); a relay that
//! starts or takes over while the sink is dead sends it at most 2 requests
//! per second from its first one (6). Item 3 (HTTP/2 GOAWAY) is in
//! `http2.rs`, which has the h2 peer; item 6 per fault kind, across relay
//! kills, in `chaos.rs`. A 410 Gone retires the endpoint: events kept,
//! probed at most once a minute, `/readyz` and a metric say so (issue 30).

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
    s.db.batch_execute(&app::order_events_sql(5)).await?;
    wait_until("the batch answered with Retry-After", WAIT, || async {
        sink.count() > asked
    })
    .await?;
    let answered = sink.received()[asked].at;
    // The rest of the batch's first answers: one request per event, all
    // sent before the relay read the Retry-After.
    wait_until("every event of the batch asked once", WAIT, || async {
        asked_once_each(&sink.received_from(asked), 5).is_some()
    })
    .await?;
    let first_round = asked_once_each(&sink.received_from(asked), 5).expect("waited for above");
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

/// The application_name of the relay whose walsender holds `slot`.
async fn slot_holder(db: &tokio_postgres::Client, slot: &str) -> anyhow::Result<Option<String>> {
    let row = db
        .query_opt(
            "SELECT r.application_name FROM pg_replication_slots s \
             JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| r.get(0)))
}

/// Starts relay `name` delivering through `sink_url`.
async fn relay_named(
    stack: &harness::Stack,
    sink_url: &str,
    name: &str,
) -> anyhow::Result<app::Running> {
    app::start_relay(stack, sink_url, &["--application-name", name]).await
}

/// SIGKILLs `relay` right after one of its requests reached `front`, so
/// none of its requests can be counted as the next relay's; returns the
/// connection count then and the instant of the kill.
async fn kill_after_a_request(
    front: &FaultProxy,
    relay: &mut app::Running,
) -> anyhow::Result<(usize, Instant)> {
    first_connection_after(front, front.accepted()).await?;
    let before = front.accepted();
    let killed = Instant::now();
    relay.process.sigkill();
    Ok((before, killed))
}

/// Asserts that `relay` sent at most 2 requests per second from its first
/// one; says how many immediate retries on a new connection (allowed once
/// per failure) it made so far.
async fn assert_two_per_second(
    what: &str,
    c: &Counted,
    since: Option<Instant>,
    relay: &app::Running,
) -> anyhow::Result<()> {
    let m = relay.metrics().await?;
    let retries = m.sum("cdc_relay_sink_fresh_connection_retries_total");
    let first = since.map_or(String::new(), |t| {
        format!(", the first {:?} after the kill", c.first - t)
    });
    eprintln!(
        "{what}: {} requests in its first {COUNTED:?} (at most {}){first}; \
         retries on a new connection so far {retries}",
        c.requests, c.bound
    );
    anyhow::ensure!(
        c.requests <= c.bound,
        "{what}: {} requests in its first {COUNTED:?}, more than 2/s\n{}",
        c.requests,
        relay.process.logs()
    );
    Ok(())
}

/// Issue 14, HTTP manners 6, across relay starts and takeovers: with a
/// backlog waiting and the sink's front resetting every connection, a relay
/// sends at most 2 requests per second from its first one — when it
/// starts, when it is a fresh hot standby taking over after the active
/// relay is SIGKILLed, and when it is a standby that held the slot before
/// (the sink answered it then) and takes it over again: its first request
/// goes at once, each later one a probe interval after the last failure,
/// with or without its circuit open. Each time the front passes again, the
/// whole backlog is delivered.
///
/// Measured (PG 15): 6 requests in each relay's first 3 s (at most 7), the
/// standby's first 0.02-0.55 s after the kill. Fails without the fix: "10
/// requests in a started relay's first 3s" (the 5 failures that open a
/// fresh relay's circuit went back to back); without the breaker's
/// session reset, "a standby that held the slot before taking over again:
/// 25 requests in its first 3s" (its whole window at once); without the
/// sink client's rule for brand-new connections, 7 to 9 in a started
/// relay's first 3 s now and then (immediate retries on a new connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_starting_or_taking_over_during_an_outage_sends_at_most_two_requests_per_second()
-> anyhow::Result<()> {
    const BACKLOG: usize = 20;
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let (front, sink_url) = app::proxied(&sink.url).await?;
    let db = stack.orders_admin().await?;
    let outage = |n: usize| {
        front.set_mode(Mode::Reset);
        app::order_events_sql(n)
    };
    let heal = |total: usize| {
        front.set_mode(Mode::Pass);
        let sink = &sink;
        async move {
            wait_until("the backlog delivered", WAIT, || async {
                sink.delivered()
                    .iter()
                    .map(|r| r.id())
                    .collect::<std::collections::BTreeSet<_>>()
                    .len()
                    >= total
            })
            .await
        }
    };

    // A relay starts during the outage.
    db.batch_execute(&outage(BACKLOG)).await?;
    let mut a = relay_named(&stack, &sink_url, "relay-a").await?;
    assert_two_per_second(
        "a relay started during the outage",
        &requests_from_first(&front, 0).await?,
        None,
        &a,
    )
    .await?;

    // A fresh hot standby takes over from it.
    let b = relay_named(&stack, &sink_url, "relay-b").await?;
    b.process
        .wait_for_line("waiting as hot standby", WAIT)
        .await?;
    let (before, killed) = kill_after_a_request(&front, &mut a).await?;
    assert_two_per_second(
        "a fresh standby taking over",
        &requests_from_first(&front, before).await?,
        Some(killed),
        &b,
    )
    .await?;
    heal(BACKLOG).await?;

    // relay-b, which the sink answered, loses the slot to a new standby
    // and waits as a standby itself. It is paused while its walsender is
    // ended and until relay-c holds the slot: running, it reconnects within
    // about 100 ms and won most races against a standby's 250-750 ms polls
    // (up to 25 terminations, 12.6 s, were measured; past 30 s the test
    // failed now and then).
    let mut c = relay_named(&stack, &sink_url, "relay-c").await?;
    c.process
        .wait_for_line("waiting as hot standby", WAIT)
        .await?;
    b.process.pause();
    let took_over = async {
        wait_until("relay-c holding the slot", WAIT, || async {
            if slot_holder(&db, &stack.slot).await?.as_deref() == Some("relay-c") {
                return Ok::<_, anyhow::Error>(true);
            }
            db.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                 WHERE slot_name = $1 AND active_pid IS NOT NULL \
                   AND active_pid NOT IN (SELECT pid FROM pg_stat_replication \
                                          WHERE application_name = 'relay-c')",
                &[&stack.slot],
            )
            .await?;
            tokio::time::sleep(Duration::from_millis(250)).await;
            Ok(false)
        })
        .await
    }
    .await;
    b.process.resume();
    took_over?;
    wait_until("relay-b waiting as hot standby again", WAIT, || async {
        Ok::<_, anyhow::Error>(b.metrics().await?.value("cdc_relay_standby", &[]) == Some(1.0))
    })
    .await?;
    db.batch_execute(&outage(BACKLOG)).await?;
    let (before, killed) = kill_after_a_request(&front, &mut c).await?;
    assert_two_per_second(
        "a standby that held the slot before taking over again",
        &requests_from_first(&front, before).await?,
        Some(killed),
        &b,
    )
    .await?;
    heal(2 * BACKLOG).await?;
    let m = b.metrics().await?;
    assert_eq!(m.value("cdc_relay_circuit_state", &[]), Some(0.0));
    Ok(())
}

/// Issue 30, item 7: a 410 Gone means the endpoint is retired (the
/// Standard Webhooks convention). With the defaults the relay marks it
/// retired (`cdc_relay_endpoint_retired`, `/readyz`), logs a message that
/// names 410 and what to do, keeps the event (never dead-lettered), and
/// sends nothing more for the next 10 s (its probes come at most once a
/// minute); `--poison-statuses 410` is refused. With
/// `--retired-probe-interval 2s` a restarted relay finds the endpoint back
/// and delivers.
///
/// Fails without the fix: 17 POSTs in 10 s (a probe every 500 ms), no
/// metric, `/readyz` 200 on "circuit open" only, and the hint said to add
/// 410 to `--poison-statuses`, which accepted it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_retires_the_endpoint_keeps_its_events_and_probes_rarely() -> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Scripted).await?;
    s.sink().set_status(410);
    let event = app::insert_order_event(&s.db).await?.to_string();
    let retired = |m: &harness::prom::Exposition| {
        m.value("cdc_relay_endpoint_retired", &[("endpoint", "default")])
    };
    wait_until("the endpoint marked retired", WAIT, || async {
        Ok::<_, anyhow::Error>(retired(&s.relay.metrics().await?) == Some(1.0))
    })
    .await?;
    let (status, body) = s.relay.get("/readyz").await?;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("retired") && body.contains("410 Gone"),
        "{body}"
    );
    let line = s
        .relay
        .process
        .wait_for_line("the endpoint is retired", WAIT)
        .await?;
    assert!(
        line.contains("410 Gone")
            && line.contains("replacement")
            && !line.contains("--poison-statuses"),
        "{line}"
    );

    // Time passing is the subject: 10 s at the default pace (a probe a
    // minute) bring no request after the first answer.
    let answered = s.sink().count();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let more = s.sink().count() - answered;
    assert_eq!(more, 0, "{more} requests to a retired endpoint in 10 s");
    let m = s.relay.metrics().await?;
    assert_eq!(m.sum("cdc_relay_events_dead_lettered_total"), 0.0);
    assert_eq!(
        m.sum_by(
            "cdc_relay_delivery_attempts_total",
            ("outcome", "retired"),
            "outcome"
        )
        .get("retired")
        .copied(),
        Some(answered as f64)
    );

    // 410 cannot be made poison.
    let refused = app::relay_command(
        &s.stack,
        &s.stack.relay_url,
        &[
            "run",
            "--sink-url",
            s.inbox_url(),
            "--poison-statuses",
            "400,410",
        ],
        &[("EVENT_SECRET", app::TEST_SECRET)],
    )
    .await?;
    assert_eq!(refused.code(), Some(2), "{}", refused.text());
    assert!(
        refused.stderr.contains("--poison-statuses cannot list 410"),
        "{}",
        refused.text()
    );

    // Stopped, the event is still held by the slot; a relay probing every
    // 2 s finds the endpoint back, delivers, and is ready again.
    s.stop_relay().await?;
    s.assert_held(&["outbox"]).await?;
    s.restart_relay(&["--retired-probe-interval", "2s"]).await?;
    let (relay, sink) = (&s.relay, s.sink());
    wait_until("retired again after the restart", WAIT, || async {
        Ok::<_, anyhow::Error>(retired(&relay.metrics().await?) == Some(1.0))
    })
    .await?;
    sink.set_status(204);
    wait_until(
        "delivered once the endpoint answers again",
        WAIT,
        || async { sink.delivered().iter().any(|r| r.id() == event) },
    )
    .await?;
    wait_until("no longer retired, ready", WAIT, || async {
        let ready = relay.get("/readyz").await?.0 == 200;
        Ok::<_, anyhow::Error>(ready && retired(&relay.metrics().await?) == Some(0.0))
    })
    .await?;
    s.assert_balanced().await?;
    s.finish().await
}

/// `n` events in one transaction, each of its own order (aggregate), so
/// they may all be in flight at once.
/// How many of `received` it took until `events` distinct events had each
/// been asked once; `None` while fewer have.
fn asked_once_each(received: &[harness::sink::Received], events: usize) -> Option<usize> {
    let mut seen = std::collections::HashSet::new();
    received
        .iter()
        .position(|r| seen.insert(r.id()) && seen.len() == events)
        .map(|i| i + 1)
}
