//! Issue 30, item 6: a server that withholds what the relay should be
//! getting is named. On PostgreSQL 17 a failover slot's walsender waits
//! until every physical slot in `synchronized_standby_slots` has confirmed
//! the WAL; with that standby gone, committed outbox rows are never
//! decoded while keepalives flow. The relay must fail `/readyz`, set
//! `cdc_relay_stream_withheld`, log why (the setting, the slot that is
//! down, the command that ends it), and `status` must say the same; once
//! the setting no longer names the slot, everything is delivered.
//!
//! Failed on `cb3ea2e`: five committed orders waited with no delivery
//! while `/readyz` answered 200, `status` said "healthy: nothing stops
//! delivery", and nothing was logged.

use std::time::Duration;

use harness::app;
use harness::sink::ScriptedSink;
use harness::{ClusterOptions, PgCluster, wait_until};
use tokio_postgres::error::SqlState;

const WAIT: Duration = Duration::from_secs(45);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_withholding_the_stream_fails_readiness_and_says_why() -> anyhow::Result<()> {
    // Its own server: the setting holds back every failover slot on it.
    let cluster = PgCluster::start(ClusterOptions::default())?;
    let admin = cluster.connect_superuser("postgres").await?;
    let set = |value: &str| format!("ALTER SYSTEM SET synchronized_standby_slots = '{value}'");
    if cluster.major_version() < 17 {
        // 15 and 16 have no failover slots and no such setting: nothing
        // can withhold a stream this way there.
        let err = admin
            .batch_execute(&set("gone_standby"))
            .await
            .expect_err("synchronized_standby_slots exists only from 17 on");
        assert_eq!(err.code(), Some(&SqlState::UNDEFINED_OBJECT), "{err}");
        return Ok(());
    }
    let stack = cluster.create_stack().await?;
    let setup = app::relay_command(
        &stack,
        &stack.orders_admin_url,
        &["setup", "--failover"],
        &[],
    )
    .await?;
    anyhow::ensure!(setup.success(), "setup --failover: {}", setup.text());
    // A standby slot whose standby never connects (as one that is down).
    admin
        .batch_execute("SELECT pg_create_physical_replication_slot('gone_standby', true)")
        .await?;
    admin.batch_execute(&set("gone_standby")).await?;
    admin.batch_execute("SELECT pg_reload_conf()").await?;

    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay_with_url(&stack, &stack.relay_url, &sink.url, &[]).await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    let mut events = Vec::new();
    for _ in 0..5 {
        events.push(app::insert_order_event(&db).await?);
    }

    wait_until(
        "/readyz to fail naming the withheld stream",
        WAIT,
        || async {
            let (code, body) = relay.get("/readyz").await?;
            Ok::<_, anyhow::Error>(code == 503 && body.contains("withholds"))
        },
    )
    .await?;
    assert!(sink.received().is_empty(), "delivered while withheld");
    let m = relay.metrics().await?;
    assert_eq!(m.value("cdc_relay_stream_withheld", &[]), Some(1.0));
    let log = relay.process.logs();
    assert!(
        log.contains("withholds changes")
            && log.contains("synchronized_standby_slots = 'gone_standby'")
            && log.contains("gone_standby (inactive")
            && log.contains("pg_reload_conf"),
        "{log}"
    );
    let status = app::relay_command(&stack, &stack.relay_url, &["status"], &[]).await?;
    assert_eq!(status.code(), Some(1), "{}", status.text());
    assert!(
        status.stdout.contains("withholds changes")
            && status.stdout.contains("synchronized_standby_slots")
            && !status.stdout.contains("healthy: nothing stops delivery"),
        "{}",
        status.text()
    );

    // The standby is given up: everything committed meanwhile arrives.
    admin.batch_execute(&set("")).await?;
    admin.batch_execute("SELECT pg_reload_conf()").await?;
    wait_until("the five withheld events delivered", WAIT, || async {
        let got: Vec<String> = sink
            .delivered()
            .iter()
            .map(|r| String::from_utf8_lossy(&r.body).into_owned())
            .collect();
        events
            .iter()
            .all(|e| got.iter().any(|b| b.contains(&e.to_string())))
    })
    .await?;
    wait_until("/readyz 200 again", WAIT, || async {
        Ok::<_, anyhow::Error>(relay.get("/readyz").await?.0 == 200)
    })
    .await?;
    let m = relay.metrics().await?;
    assert_eq!(m.value("cdc_relay_stream_withheld", &[]), Some(0.0));
    assert!(relay.process.logs().contains("streams again"));
    Ok(())
}
