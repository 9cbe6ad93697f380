//! Trusting the slot's position across reconnects: several hosts in the
//! URL, a slot that jumped ahead of where the relay left it, the opt-in
//! recreate-and-backfill after a slot loss, and the progress record. (The
//! primary + standby failover runs build on these.)

use std::time::Duration;

use ::harness::app::{self, TEST_SECRET};
use ::harness::oracle;
use ::harness::proxy::Mode;
use ::harness::sink::ScriptedSink;
use ::harness::stack::Stack;
use ::harness::{PgCluster, wait_until};
use tokio_postgres::Client;

const DRAIN: Duration = Duration::from_secs(45);

/// Disconnects the relay's walsender and waits until the slot is free.
async fn free_slot(db: &Client, stack: &Stack) -> anyhow::Result<()> {
    wait_until("the slot released", Duration::from_secs(20), || async {
        db.execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
             WHERE slot_name = $1 AND active_pid IS NOT NULL",
            &[&stack.slot],
        )
        .await?;
        let active: bool = db
            .query_one(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&stack.slot],
            )
            .await?
            .get(0);
        anyhow::Ok(!active)
    })
    .await
}

async fn progress_written_at(db: &Client, stack: &Stack) -> anyhow::Result<String> {
    Ok(db
        .query_one(
            "SELECT updated_at::text FROM cdc_relay_progress WHERE slot_name = $1",
            &[&stack.slot],
        )
        .await?
        .get(0))
}

async fn drop_slot(db: &Client, stack: &Stack) -> anyhow::Result<()> {
    free_slot(db, stack).await?;
    db.execute("SELECT pg_drop_replication_slot($1)", &[&stack.slot])
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_hosts_in_the_url_skip_a_dead_one_and_stream_from_the_primary() -> anyhow::Result<()>
{
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    // A port nobody listens on, before the real server.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port()
    };
    let (head, tail) = stack
        .relay_url
        .split_once("@127.0.0.1:")
        .expect("the stack's URL names 127.0.0.1");
    let url = format!("{head}@127.0.0.1:{dead},127.0.0.1:{tail}?target_session_attrs=primary");
    let relay = app::start_relay_with_url(&stack, &url, &sink.url, &[]).await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    let id = app::insert_order_event(&db).await?.to_string();
    wait_until("the event delivered", DRAIN, || async {
        oracle::arrival_ids(&sink.delivered()).contains(&id)
    })
    .await?;
    assert!(
        relay.process.logs().contains("connected to the primary"),
        "{}",
        relay.process.logs()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_recreated_while_events_are_pending_stops_the_relay_with_exit_7()
-> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    sink.set_status(503); // the event stays pending
    let (proxy, db_url) = app::proxied(&stack.relay_url).await?;
    let mut relay = app::start_relay_with_url(&stack, &db_url, &sink.url, &[]).await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    app::insert_order_event(&db).await?;
    wait_until("the event attempted", DRAIN, || async {
        sink.arrivals() >= 1
    })
    .await?;

    // The relay loses the server; meanwhile the slot is dropped and
    // recreated, now ahead of the undelivered event.
    proxy.set_mode(Mode::Reset);
    drop_slot(&db, &stack).await?;
    db.execute(
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&stack.slot],
    )
    .await?;
    proxy.set_mode(Mode::Pass);

    let status = relay.process.wait_exit(Duration::from_secs(60)).await?;
    let logs = relay.process.logs();
    assert_eq!(status.code(), Some(7), "{logs}");
    for words in ["ahead of", "cdc-relay backfill --since", "skipped upstream"] {
        assert!(logs.contains(words), "says {words:?}:\n{logs}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_is_recreated_and_backfilled_and_nothing_is_lost() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let billing = app::start_billing(&stack, TEST_SECRET).await?;
    let (proxy, db_url) = app::proxied(&stack.relay_url).await?;
    let relay = app::start_relay_with_url(
        &stack,
        &db_url,
        &billing.inbox(),
        &[
            "--on-slot-loss",
            "recreate-and-backfill",
            "--backfill-margin",
            "1m",
        ],
    )
    .await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    for _ in 0..5 {
        app::insert_order_event(&db).await?;
    }
    oracle::wait_ledger_clean(&stack, 5, DRAIN).await?;
    // The progress record is written within its interval (5 s) of progress.
    wait_until("the progress record", Duration::from_secs(20), || async {
        let row = db
            .query_opt(
                "SELECT holder, commit_time IS NOT NULL FROM cdc_relay_progress WHERE slot_name = $1",
                &[&stack.slot],
            )
            .await?;
        anyhow::Ok(row.is_some_and(|r| {
            r.get::<_, Option<String>>(0).is_some_and(|h| h.contains('@')) && r.get::<_, bool>(1)
        }))
    })
    .await?;

    // The slot is lost (a failover to a server without it, say) while
    // events keep being committed: the slot can never bring these back.
    proxy.set_mode(Mode::Reset);
    drop_slot(&db, &stack).await?;
    for _ in 0..3 {
        app::insert_order_event(&db).await?;
    }
    proxy.set_mode(Mode::Pass);
    oracle::wait_ledger_clean(&stack, 8, DRAIN).await?;
    app::insert_order_event(&db).await?;
    oracle::wait_ledger_clean(&stack, 9, DRAIN).await?;
    let logs = relay.process.logs();
    assert!(logs.contains("recreated it"), "{logs}");
    assert!(logs.contains("backfill after slot loss done"), "{logs}");

    // Idle: the record is not written again (the idle statement budget).
    oracle::settle(&db, &stack.slot).await?;
    // Wait out one write interval so a pending write has happened...
    tokio::time::sleep(Duration::from_secs(6)).await;
    let before = progress_written_at(&db, &stack).await?;
    // ...then time is the subject: another interval, nothing to record.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        progress_written_at(&db, &stack).await?,
        before,
        "no write while idle"
    );
    Ok(())
}

/// After a failover a listed standby is the primary: `--standby-url`
/// names every server of the cluster, and the one out of recovery holds no
/// copy to count. `status` says so (on every version: before 17 the copy's
/// columns do not even exist), and the relay, with only a primary listed,
/// never reports the slot safe to fail over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_url_naming_a_primary_is_skipped_not_counted_as_a_copy() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let listed = ["--standby-url", stack.relay_url.as_str()];
    let json = app::relay_command(
        &stack,
        &stack.relay_url,
        &[&["status", "--json"][..], &listed[..]].concat(),
        &[],
    )
    .await?;
    // No relay runs here (exit 8, its only problem): the listed primary
    // is no problem of its own.
    assert_eq!(json.code(), Some(8), "{}", json.text());
    let report: serde_json::Value = serde_json::from_str(&json.stdout)?;
    assert_eq!(
        report["problems"].as_array().map(Vec::len),
        Some(1),
        "{report:#}"
    );
    assert!(
        report["problems"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no relay streams")),
        "{report:#}"
    );
    let copy = &report["standbys"][0];
    assert_eq!(copy["primary"], true, "{report:#}");
    assert_eq!(copy["error"], serde_json::Value::Null, "{report:#}");
    let human = app::relay_command(
        &stack,
        &stack.relay_url,
        &[&["status"][..], &listed[..]].concat(),
        &[],
    )
    .await?;
    assert!(
        human
            .stdout
            .contains("not in recovery (a primary): no copy to check"),
        "{}",
        human.text()
    );

    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay(&stack, &sink.url, &listed).await?;
    app::wait_streaming(&relay).await?;
    wait_until("the failover watch to run", DRAIN, || async {
        anyhow::Ok(relay.gauge("cdc_relay_failover_standbys").await? == Some(1.0))
    })
    .await?;
    let db = stack.orders_admin().await?;
    let id = app::insert_order_event(&db).await?.to_string();
    wait_until("the event delivered", DRAIN, || async {
        oracle::arrival_ids(&sink.delivered()).contains(&id)
    })
    .await?;
    assert_eq!(relay.gauge("cdc_relay_failover_ready").await?, Some(0.0));
    Ok(())
}

/// A `--standby-url` the relay cannot reach is said at WARN with its
/// cause (it was logged only at debug: the operator saw
/// `cdc_relay_failover_ready 0` and no reason), and a multi-host URL is
/// one standby (it was split at its comma into two broken URLs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_standby_is_warned_about_with_its_cause() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let dead = || -> anyhow::Result<u16> {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        Ok(l.local_addr()?.port())
    };
    let (head, tail) = stack
        .relay_url
        .split_once("@127.0.0.1:")
        .expect("the stack's URL names 127.0.0.1");
    let (_, database) = tail
        .split_once('/')
        .expect("the stack's URL names a database");
    let standby = format!(
        "{head}@127.0.0.1:{},127.0.0.1:{}/{database}",
        dead()?,
        dead()?
    );
    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay(&stack, &sink.url, &["--standby-url", &standby]).await?;
    app::wait_streaming(&relay).await?;
    wait_until("the unreachable standby said at WARN", DRAIN, || async {
        let logs = relay.process.logs();
        logs.contains("cannot connect to a --standby-url server") && logs.contains("WARN")
    })
    .await?;
    let logs = relay.process.logs();
    assert!(
        logs.contains("Connection refused") || logs.contains("connection refused"),
        "the cause is named: {logs}"
    );
    assert_eq!(relay.gauge("cdc_relay_failover_standbys").await?, Some(1.0));
    assert_eq!(relay.gauge("cdc_relay_failover_ready").await?, Some(0.0));
    Ok(())
}

mod drill;
