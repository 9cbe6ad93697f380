//! Issue 30, item 6: a strong lock on a system catalog of the outbox's
//! database stalls every new login there (a backend whose catalog cache
//! must be rebuilt waits for it before the login completes). The relay's
//! own session cannot read who holds it, so it reads that over a
//! connection to the `postgres` database and names the holder by pid,
//! with the command that ends it: in `status` and in the running relay's
//! log, instead of only "a pooler or a catalog lock".
//!
//! Failed before: `status` said the login did not complete, naming both
//! possible causes and no session; `run`'s start-up bound (as long as the
//! login's) fired first with a bare "no answer within 4s while connecting".

use std::time::Duration;

use harness::app;
use harness::sink::ScriptedSink;
use harness::{ClusterOptions, PgCluster, wait_until};

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_stalled_by_a_lock_on_pg_class_names_the_holder() -> anyhow::Result<()> {
    // A server of its own: the lock stalls every login to the database.
    let cluster = PgCluster::start(ClusterOptions {
        extra_settings: vec![("autovacuum".into(), "off".into())],
        ..ClusterOptions::default()
    })?;
    let stack = cluster.create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let url = format!("{}?connect_timeout=2", stack.relay_url);

    // ANALYZE updates pg_class's own row, which invalidates the database's
    // catalog cache file: each new session then rebuilds it, reading
    // pg_class, and waits for the lock.
    let locker = stack.orders_admin().await?;
    let holder: i32 = locker
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    locker
        .batch_execute(
            "SET application_name = 'catalog-locker'; ANALYZE pg_catalog.pg_class; \
             BEGIN; LOCK TABLE pg_catalog.pg_class IN ACCESS EXCLUSIVE MODE",
        )
        .await?;
    let named = format!("pid {holder} (catalog-locker");

    let status =
        tokio::time::timeout(WAIT, app::relay_command(&stack, &url, &["status"], &[])).await??;
    let text = status.text();
    assert_ne!(status.code(), Some(0), "{text}");
    assert!(
        text.contains("did not complete within")
            && text.contains(&named)
            && text.contains("holds AccessExclusiveLock on pg_class")
            && text.contains("pg_terminate_backend"),
        "status names the login's wait and the lock's holder:\n{text}"
    );

    let relay = app::start_relay_with_url(&stack, &url, &sink.url, &[]).await?;
    wait_until("the relay's log naming the lock's holder", WAIT, || async {
        let log = relay.process.logs();
        log.contains(&named) && log.contains("holds AccessExclusiveLock on pg_class")
    })
    .await?;
    assert!(
        !relay.process.logs().contains("while connecting"),
        "the start-up bound fired before the login's own, with nobody named:\n{}",
        relay.process.logs()
    );

    // Once the lock is gone the relay starts and delivers.
    locker.batch_execute("ROLLBACK").await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    let event = app::insert_order_event(&db).await?.to_string();
    wait_until(
        "the event delivered once the lock is gone",
        WAIT,
        || async { sink.delivered().iter().any(|r| r.id() == event) },
    )
    .await?;
    drop(cluster);
    Ok(())
}
