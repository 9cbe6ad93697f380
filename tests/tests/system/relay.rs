//! The relay end to end: real PostgreSQL, real binaries, real HTTP.
//! Every test ends with the ledger (lost, duplicated, phantom effects).

use std::time::Duration;

use harness::app::{self, TEST_SECRET};
use harness::oracle::{self, Ledger, settle, slot_position, walsender_pid};
use harness::sink::ScriptedSink;
use harness::{Inbox, PgCluster, Scenario};

const DRAIN: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_orders_are_invoiced_exactly_once() -> anyhow::Result<()> {
    // One runtime thread, as an operator beside PostgreSQL on a small box
    // would run it: the whole pipeline must make progress on one core.
    let s = Scenario::plan(Inbox::Billing)
        .orders()
        .relay_args(&["--worker-threads", "1"])
        .start()
        .await?;
    assert!(s.setup.contains("created: slot"), "{}", s.setup);

    let http = reqwest::Client::new();
    let posts = (0..1000).map(|i| {
        let http = http.clone();
        let url = s.orders().url.clone();
        // A thousand at once can keep Orders' 16 database connections busy
        // past its pool wait on a loaded box: its 503 says retry, and the
        // key makes the retry safe.
        async move { app::post_order_retrying(&http, &url, 100 + i, 10).await }
    });
    let results = futures::future::join_all(posts).await;
    let accepted = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(
        accepted,
        1000,
        "first error: {:?}",
        results.iter().find(|r| r.is_err())
    );

    let ledger = oracle::wait_ledger_clean(&s.stack, 1000, DRAIN).await?;
    assert_eq!(
        ledger,
        Ledger {
            committed: 1000,
            invoices: 1000,
            ..Ledger::default()
        }
    );
    // The slot is confirmed past the last commit once the relay catches up.
    s.settle().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_signature_and_headers_follow_the_wire_format() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (db, sink) = (&s.db, s.sink());
    let order = uuid::Uuid::new_v4();
    let event = uuid::Uuid::new_v4();
    db.execute(
        "INSERT INTO orders (id, amount_cents, currency) VALUES ($1, 1, 'EUR')",
        &[&order],
    )
    .await?;
    db.execute(
        "INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES ($1, $2, 'OrderCreated', \
         '{\"big\": 123456789012345678901234567890, \"dec\": 1.10000000000000000001, \"s\": \"\\u2028 e\u{301} 😀\"}')",
        &[&event, &order],
    )
    .await?;
    let text: String = db
        .query_one("SELECT payload::text FROM outbox WHERE id = $1", &[&event])
        .await?
        .get(0);
    harness::wait_until("one delivery", Duration::from_secs(20), || async {
        sink.count() >= 1
    })
    .await?;
    s.settle().await?;
    assert_eq!(sink.count(), 1, "one event, one request");
    let got = &sink.received()[0];
    let expected = format!(r#"{{"id":"{event}","type":"OrderCreated","data":{text}}}"#);
    assert_eq!(std::str::from_utf8(&got.body)?, expected);
    assert!(
        got.signature_valid(TEST_SECRET),
        "signature {:?}",
        got.signature
    );
    assert_eq!(
        got.idempotency_key.as_deref(),
        Some(event.to_string().as_str())
    );
    assert_eq!(got.content_type.as_deref(), Some("application/json"));
    Ok(())
}

/// Where this session's next WAL record goes (`pg_current_wal_insert_lsn()`):
/// read before a transaction, it is at or below each of its records. Not
/// `pg_current_wal_lsn()`, the *write* position: while other sessions run big
/// uncommitted transactions (parallel tests) it lags the insert position by
/// megabytes, and WAL committed in that gap may rightly be confirmed first.
async fn insert_position(db: &tokio_postgres::Client) -> anyhow::Result<u64> {
    let v: i64 = db
        .query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint", &[])
        .await?
        .get(0);
    Ok(u64::try_from(v)?)
}

/// Where the commit record of transaction `xid` (32-bit) starts, searched
/// from `from` to the flushed end of WAL with pg_walinspect.
async fn commit_record_start(
    db: &tokio_postgres::Client,
    from: u64,
    xid: i64,
) -> anyhow::Result<u64> {
    let row = db
        .query_one(
            "SELECT (start_lsn - '0/0')::bigint FROM pg_get_wal_records_info( \
               ('0/0'::pg_lsn + $1::bigint), pg_current_wal_flush_lsn()) \
             WHERE resource_manager = 'Transaction' AND record_type = 'COMMIT' \
               AND xid::text::bigint = $2",
            &[&i64::try_from(from)?, &xid],
        )
        .await?;
    Ok(u64::try_from(row.get::<_, i64>(0))?)
}

async fn current_wal(db: &tokio_postgres::Client) -> anyhow::Result<u64> {
    let v: i64 = db
        .query_one("SELECT (pg_current_wal_lsn() - '0/0')::bigint", &[])
        .await?
        .get(0);
    Ok(u64::try_from(v)?)
}

/// Writes about `mb` MB of WAL into a table no publication covers.
async fn unrelated_wal(db: &tokio_postgres::Client, mb: usize) -> anyhow::Result<()> {
    db.batch_execute("CREATE TABLE IF NOT EXISTS noise (id bigserial PRIMARY KEY, filler text)")
        .await?;
    db.execute(
        "INSERT INTO noise (filler) SELECT repeat(md5(g::text), 30) FROM generate_series(1, $1::int * 1000) g",
        &[&i32::try_from(mb)?],
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_lsn_never_passes_an_undelivered_commit() -> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::ScriptedBilling).await?;
    s.sink().set_status(503);
    let db = &s.db;

    // The bound is where the event's commit record starts: PostgreSQL
    // resends every transaction whose commit record starts at or after the
    // slot's confirmed position, so the relay may confirm up to there (a
    // keepalive's position can rightly fall between the event's INSERT and
    // its COMMIT, before the walsender has decoded the transaction), never
    // past it. The record is found with pg_walinspect by the transaction's
    // id: the insert position read just before COMMIT is not the bound,
    // since other databases of the shared cluster write WAL between the
    // two (a run on PG 17 once saw the slot confirmed 496 bytes past it,
    // at a keepalive inside that gap: rightly, and the test failed).
    db.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        .await?;
    let event = uuid::Uuid::new_v4();
    let order = uuid::Uuid::new_v4();
    db.batch_execute("BEGIN").await?;
    db.batch_execute(&format!(
        "INSERT INTO orders (id, amount_cents, currency) VALUES ('{order}', 250, 'EUR'); \
         INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES ('{event}', '{order}', \
           'OrderCreated', jsonb_build_object('order_id', '{order}'::uuid, 'amount_cents', 250, 'currency', 'EUR'))"
    ))
    .await?;
    let inserted = insert_position(db).await?;
    let xid: i64 = db
        .query_one("SELECT txid_current() % 4294967296", &[])
        .await?
        .get(0);
    db.batch_execute("COMMIT").await?;
    let before = commit_record_start(db, inserted, xid).await?;
    assert!(before >= inserted);
    let outage = std::time::Instant::now();
    let mut killed = false;
    while outage.elapsed() < Duration::from_secs(20) {
        // Busy unrelated writes must not move the ack past the stuck event.
        unrelated_wal(db, 1).await?;
        let confirmed = slot_position(db, &s.stack.slot).await?.confirmed;
        assert!(
            confirmed <= before,
            "confirmed_flush_lsn {confirmed} passed the undelivered commit (its record starts at {before})"
        );
        if !killed && outage.elapsed() > Duration::from_secs(10) {
            assert!(
                s.sink().count() >= 2,
                "the relay keeps retrying during the outage"
            );
            s.relay.process.sigkill();
            s.relay.process.wait_exit(Duration::from_secs(10)).await?;
            s.relay = app::start_relay(&s.stack, s.inbox_url(), &[]).await?;
            killed = true;
        }
        // Time is the subject here: the outage must last (20 s, a kill at
        // 10 s) while unrelated WAL is written, a batch every 250 ms.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let attempts_before_recovery = s.sink().count();
    s.sink().set_status(204);
    oracle::wait_ledger_clean(&s.stack, 1, DRAIN).await?;
    let after = current_wal(db).await?;
    harness::wait_until(
        "confirmed past the delivered commit and the WAL written after it",
        Duration::from_secs(10),
        || async {
            slot_position(db, &s.stack.slot)
                .await
                .map(|p| p.confirmed > before && p.confirmed >= after)
        },
    )
    .await?;
    let ids: Vec<String> = s.sink().received().iter().map(|r| r.id()).collect();
    assert!(
        ids.iter().all(|id| *id == event.to_string()),
        "only the stuck event was sent"
    );
    assert!(
        attempts_before_recovery >= 4,
        "retries from both relay processes"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_with_requests_in_flight_redelivers_and_clean_restarts_send_nothing()
-> anyhow::Result<()> {
    let mut s = Scenario::plan(Inbox::ScriptedBilling)
        .orders()
        .relay_args(&["--max-in-flight", "64"])
        .start()
        .await?;
    s.sink().set_delay(Duration::from_secs(2));

    let http = reqwest::Client::new();
    for i in 0..300 {
        app::post_order(&http, &s.orders().url, 1 + i).await?;
    }
    harness::wait_until("64 requests in flight", Duration::from_secs(30), || async {
        s.sink().in_progress() == 64
    })
    .await?;
    s.relay.process.sigkill();
    s.relay.process.wait_exit(Duration::from_secs(10)).await?;
    s.sink().set_delay(Duration::ZERO);
    s.relay = app::start_relay(&s.stack, s.inbox_url(), &["--max-in-flight", "64"]).await?;
    let ledger = oracle::wait_ledger_clean(&s.stack, 300, DRAIN).await?;
    assert!(ledger.is_clean(), "{ledger:?}");
    let redelivered = s.sink().arrivals() - 300;
    eprintln!(
        "SIGKILL with 64 in flight: {redelivered} redelivered requests (absorbed by the inbox)"
    );
    assert!(redelivered >= 64, "the 64 killed requests were sent again");

    // Let the slot catch up, then restart cleanly three times: nothing is
    // re-sent. After each restart, settling proves the new session is done
    // with everything ever committed, so any redelivery would have arrived.
    s.settle().await?;
    let sent = s.sink().arrivals();
    for round in 0..3 {
        s.stop_relay().await?;
        s.restart_relay(&[]).await?;
        s.settle().await?;
        assert_eq!(
            s.sink().arrivals(),
            sent,
            "clean restart {round} must not redeliver"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_point_comes_from_the_slot_alone() -> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Billing).await?;
    s.stop_relay().await?;
    // The relay keeps no local state: a new process in a new working
    // directory is all a restart needs.
    for _ in 0..3 {
        app::insert_order_event(&s.db).await?;
    }
    unrelated_wal(&s.db, 50).await?;
    s.relay = app::start_relay(&s.stack, s.inbox_url(), &[]).await?;
    let ledger = oracle::wait_ledger_clean(&s.stack, 3, DRAIN).await?;
    assert_eq!(ledger.invoices, 3);
    Ok(())
}

async fn idle_outbox_releases_wal(stack: harness::Stack) -> anyhow::Result<()> {
    let s = Scenario::plan(Inbox::Scripted).on(stack).start().await?;
    let db = &s.db;
    db.batch_execute(
        "CREATE TABLE busy (id bigserial PRIMARY KEY, v int); \
         INSERT INTO busy (v) SELECT g FROM generate_series(1, 200000) g",
    )
    .await?;
    harness::wait_until("slot lag under 1 MB", Duration::from_secs(15), || async {
        slot_position(db, &s.stack.slot)
            .await
            .map(|p| p.lag() < 1 << 20)
    })
    .await?;
    s.settle().await?;
    assert_eq!(s.sink().count(), 0, "no events were posted");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_outbox_in_a_busy_database_does_not_pin_wal() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    idle_outbox_releases_wal(stack).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_outbox_releases_wal_with_wal_sender_timeout_disabled() -> anyhow::Result<()> {
    let cluster = PgCluster::start(harness::ClusterOptions {
        wal_sender_timeout: "0".into(),
        ..Default::default()
    })?;
    let stack = cluster.create_stack().await?;
    idle_outbox_releases_wal(stack).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_sink_does_not_trip_wal_sender_timeout() -> anyhow::Result<()> {
    let cluster = PgCluster::start(harness::ClusterOptions {
        wal_sender_timeout: "2s".into(),
        ..Default::default()
    })?;
    let s = Scenario::plan(Inbox::Scripted)
        .relay_args(&["--max-in-flight", "1"])
        .on(cluster.create_stack().await?)
        .start()
        .await?;
    let (db, sink) = (&s.db, s.sink());
    sink.set_delay(Duration::from_secs(3));
    let first = walsender_pid(db, &s.stack.slot).await?;
    assert!(first.is_some(), "slot active");
    let mut events = Vec::new();
    for _ in 0..3 {
        events.push(app::insert_order_event(db).await?);
    }
    harness::wait_until("3 slow deliveries", Duration::from_secs(30), || async {
        sink.delivered().len() >= 3
    })
    .await?;
    s.settle().await?;
    assert_eq!(
        walsender_pid(db, &s.stack.slot).await?,
        first,
        "same walsender throughout"
    );
    let log = cluster.log_contents();
    assert!(
        !log.contains("replication timeout"),
        "walsender was terminated:\n{}",
        cluster.log_tail(30)
    );
    let ids: Vec<String> = sink.delivered().iter().map(|r| r.id()).collect();
    let expected: Vec<String> = events.iter().map(ToString::to_string).collect();
    assert_eq!(ids, expected);
    Ok(())
}

fn peak_rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .ok_or_else(|| anyhow::anyhow!("no VmHWM"))?;
    Ok(line.split_whitespace().nth(1).unwrap_or("0").parse()?)
}

/// Peak RSS bound for draining a 500 MB backlog with `--max-pending-bytes 16MiB`.
const PEAK_RSS_BOUND_MIB: u64 = 96;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backlog_of_large_events_drains_in_bounded_memory() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let db = stack.orders_admin().await?;
    let order = uuid::Uuid::new_v4();
    db.execute(
        "INSERT INTO orders (id, amount_cents, currency) VALUES ($1, 1, 'EUR')",
        &[&order],
    )
    .await?;
    // 5,000 events of ~100 KB of incompressible text, in batches.
    for _ in 0..10 {
        db.execute(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), $1, 'Big', jsonb_build_object('blob', \
               (SELECT string_agg(md5(random()::text || g::text || i::text), '') FROM generate_series(1, 3200) i)) \
             FROM generate_series(1, 500) g",
            &[&order],
        )
        .await?;
    }
    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay(&stack, &sink.url, &["--max-pending-bytes", "16MiB"]).await?;
    harness::wait_until(
        "5,000 large events delivered",
        Duration::from_secs(180),
        || async { sink.delivered().len() >= 5000 },
    )
    .await?;
    let peak = peak_rss_kib(relay.process.pid())? / 1024;
    eprintln!("peak RSS draining 5,000 x 100 KB: {peak} MiB (bound {PEAK_RSS_BOUND_MIB} MiB)");
    assert!(peak < PEAK_RSS_BOUND_MIB, "peak RSS {peak} MiB");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_walsender_is_detected_by_the_watchdog() -> anyhow::Result<()> {
    let cluster = PgCluster::start(harness::ClusterOptions {
        wal_sender_timeout: "2s".into(),
        ..Default::default()
    })?;
    let s = Scenario::plan(Inbox::Scripted)
        .on(cluster.create_stack().await?)
        .start()
        .await?;
    let (db, sink, relay) = (&s.db, s.sink(), &s.relay);
    let frozen = walsender_pid(db, &s.stack.slot)
        .await?
        .expect("slot active");
    let pid = nix::unistd::Pid::from_raw(frozen);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP)?;
    let event = app::insert_order_event(db).await?;
    // The walsender stays frozen until the watchdog has ended the session:
    // after one silence bound (wal_sender_timeout, 2 s) when it was caught
    // waiting, after ten when it was caught busy (its wait_event empty), as
    // happens on a loaded host. A fixed freeze of 6 s failed that way once.
    let watchdog_fired = || async {
        let n = relay
            .metrics()
            .await?
            .value("cdc_relay_reconnects_total", &[("cause", "watchdog")]);
        anyhow::Ok(n.is_some_and(|n| n >= 1.0))
    };
    let fired = harness::wait_until(
        "the watchdog ends the session on the frozen walsender",
        Duration::from_secs(40),
        watchdog_fired,
    )
    .await;
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT)?;
    fired.map_err(|e| anyhow::anyhow!("{e}\n{}", relay.process.logs()))?;
    harness::wait_until(
        "the event delivered by a new session",
        Duration::from_secs(30),
        || async { sink.delivered().iter().any(|r| r.id() == event.to_string()) },
    )
    .await?;
    let now = walsender_pid(db, &s.stack.slot).await?;
    assert_ne!(now, Some(frozen), "a new walsender serves the slot");
    let watchdog = relay
        .metrics()
        .await?
        .value("cdc_relay_reconnects_total", &[("cause", "watchdog")]);
    assert!(
        watchdog.is_some_and(|n| n >= 1.0),
        "watchdog reconnect counted ({watchdog:?}):\n{}",
        relay.process.logs()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_outbox_leaves_map_to_the_root() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let db = stack.orders_admin().await?;
    db.batch_execute(
        "CREATE TABLE events (id uuid NOT NULL, aggregate_id uuid, event_type text NOT NULL, \
           payload jsonb, occurred_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (id, occurred_at)) \
           PARTITION BY RANGE (occurred_at); \
         CREATE TABLE events_old PARTITION OF events FOR VALUES FROM ('2000-01-01') TO ('2026-01-01'); \
         CREATE TABLE events_new PARTITION OF events FOR VALUES FROM ('2026-01-01') TO ('2200-01-01');",
    )
    .await?;
    let publication = format!("{}_events", stack.publication);
    // After `setup`, as after `run` in start_relay: the subcommand's values
    // replace the stack's global --publication.
    let out = app::relay_command(
        &stack,
        &stack.orders_admin_url,
        &[
            "setup",
            "--publication",
            &publication,
            "--table",
            "public.events",
        ],
        &[],
    )
    .await?;
    let text = out.text();
    assert!(out.success(), "{text}");
    assert!(out.stdout.contains("via partition root"), "{text}");
    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay(
        &stack,
        &sink.url,
        &["--table", "public.events", "--publication", &publication],
    )
    .await?;
    app::wait_streaming(&relay).await?;
    let (old, new) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    db.execute(
        "INSERT INTO events (id, event_type, payload, occurred_at) VALUES \
         ($1, 'Old', '{\"p\":1}', '2020-05-05'), ($2, 'New', '{\"p\":2}', now())",
        &[&old, &new],
    )
    .await?;
    harness::wait_until(
        "both partitions' rows delivered",
        Duration::from_secs(20),
        || async { sink.delivered().len() >= 2 },
    )
    .await?;
    settle(&db, &stack.slot).await?;
    assert_eq!(sink.delivered().len(), 2, "each row exactly once");
    // No aggregate key: the two events carry no ordering promise.
    let got: std::collections::BTreeSet<(String, String)> = sink
        .delivered()
        .iter()
        .map(|r| {
            (
                r.id(),
                r.json()["type"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        got,
        std::collections::BTreeSet::from([
            (old.to_string(), "Old".into()),
            (new.to_string(), "New".into())
        ])
    );
    Ok(())
}
