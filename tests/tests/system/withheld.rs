//! Issue 30, item 6: a server that withholds what the relay should be
//! getting is named. On PostgreSQL 17 a failover slot's walsender waits
//! until every physical slot in `synchronized_standby_slots` has confirmed
//! the WAL; with that standby gone, committed outbox rows are never
//! decoded while keepalives flow. The relay must fail `/readyz`, set
//! `cdc_relay_stream_withheld`, log why (the setting, the slot that is
//! down, the command that ends it), and `status` must say the same; once
//! the setting no longer names the slot, everything is delivered.
//!
//! A walsender can also wait on a lock; the relay's own reads of the
//! catalog take the same locks, so they are bounded and name the holder
//! (the second test).
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
    // Readiness fails first; the ERROR follows once the monitor has read
    // the cause (one more query).
    let named = || {
        let log = relay.process.logs();
        log.contains("withholds changes")
            && log.contains("synchronized_standby_slots = 'gone_standby'")
            && log.contains("gone_standby (inactive")
            && log.contains("pg_reload_conf")
    };
    if wait_until("the log naming the cause", WAIT, || async { named() })
        .await
        .is_err()
    {
        panic!("{}", relay.process.logs());
    }
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

/// Issue 30, item 6, a lock: an open transaction holds `ACCESS EXCLUSIVE`
/// on `pg_publication_namespace`, a catalog both the walsender (building
/// its publication cache) and the relay's checks read. The relay's session
/// restarts (its walsender ended) and cannot pass its checks: within
/// seconds it logs the lock's holder by pid with its query and the command
/// that ends it, and tries again; `status` answers within seconds, naming
/// the same, instead of hanging; `/readyz` answers 503 meanwhile; once
/// the transaction ends, everything committed meanwhile is delivered and
/// `/readyz` answers 200 again.
///
/// Fails without the bound: the relay logged nothing for 25 s (`/readyz`
/// "not streaming from the slot"), its check waited on the server with no
/// end, and `status` hung (more than 20 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_on_a_catalog_the_relay_reads_is_named_with_its_holder() -> anyhow::Result<()> {
    let (_cluster, stack) = own_server().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay(&stack, &sink.url, &[]).await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    let first = app::insert_order_event(&db).await?.to_string();
    wait_until("the first event delivered", WAIT, || async {
        sink.delivered().iter().any(|r| r.id() == first)
    })
    .await?;
    // Connected before the lock: it watches what sessions wait on.
    let watcher = stack.orders_admin().await?;

    let (locker, holder) = hold_lock(
        &stack,
        "pg_catalog.pg_publication_namespace",
        "ACCESS EXCLUSIVE",
    )
    .await?;
    db.execute(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1",
        &[&stack.slot],
    )
    .await?;
    let mut events = Vec::new();
    for _ in 0..3 {
        events.push(app::insert_order_event(&db).await?.to_string());
    }
    let named = format!("pid {holder} (");
    wait_until("the relay's log naming the lock's holder", WAIT, || async {
        let log = relay.process.logs();
        log.contains(&named)
            && log.contains("holds AccessExclusiveLock on pg_publication_namespace")
            && log.contains("LOCK TABLE pg_catalog.pg_publication_namespace")
            && log.contains("pg_terminate_backend")
    })
    .await?;
    // The relay cannot stream meanwhile: it is not ready. (Checked on a
    // condition: the session ends, then each new one fails its checks.)
    wait_until("/readyz 503 while the lock holds", WAIT, || async {
        let (code, body) = relay.get("/readyz").await?;
        Ok::<_, anyhow::Error>(code == 503 && body.contains("not streaming"))
    })
    .await?;
    // What every session of the cluster waits on while status runs, for
    // the failure message (a status that hangs names the wait).
    let status_run = app::relay_command(&stack, &stack.relay_url, &["status"], &[]);
    tokio::pin!(status_run);
    let mut waits = Vec::new();
    let started = std::time::Instant::now();
    let status = loop {
        tokio::select! {
            out = &mut status_run => break out?,
            () = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
        let rows = watcher
            .query(
                "SELECT format('%s %s %s db=%s app=%s state=%s wait=%s/%s: %s', \
                        round(extract(epoch FROM clock_timestamp() - query_start)::numeric, 1), \
                        pid, backend_type, datname, application_name, state, \
                        wait_event_type, wait_event, left(query, 70)) \
                 FROM pg_stat_activity WHERE pid <> pg_backend_pid()",
                &[],
            )
            .await?;
        waits.push(format!(
            "after {:?}:\n  {}",
            started.elapsed(),
            rows.iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>()
                .join("\n  ")
        ));
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(60),
            "status hung behind the lock for 60 s (it should answer in seconds); the sessions:\n{}\nthe relay's log:\n{}",
            waits.join("\n"),
            relay.process.logs()
        );
    };
    eprintln!("status answered after {:?}", started.elapsed());
    assert_ne!(status.code(), Some(0), "{}", status.text());
    assert!(
        status.text().contains(&named)
            && status
                .text()
                .contains("holds AccessExclusiveLock on pg_publication_namespace"),
        "{}",
        status.text()
    );
    assert!(
        !relay.process.logs().contains("stopping"),
        "the relay stopped instead of trying again:\n{}",
        relay.process.logs()
    );

    locker.batch_execute("ROLLBACK").await?;
    wait_until(
        "the events committed during the lock delivered",
        WAIT,
        || async {
            let got: Vec<String> = sink.delivered().iter().map(|r| r.id()).collect();
            events.iter().all(|e| got.contains(e))
        },
    )
    .await?;
    wait_until("/readyz 200 once the lock is gone", WAIT, || async {
        Ok::<_, anyhow::Error>(relay.get("/readyz").await?.0 == 200)
    })
    .await?;
    Ok(())
}

/// A lock that blocks writes to `cdc_relay_progress` (an open transaction
/// holding `EXCLUSIVE` on it; reads still pass): the relay streams and
/// delivers (the record is advice, not a gate), and each write it cannot
/// make names the holder, without the "apply sql/orders.sql" hint meant
/// for a missing column.
///
/// Failed before: the membership write logged the server's bare
/// "canceling statement due to lock timeout" with "(apply
/// sql/orders.sql)", sending the operator to a schema that was fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_on_the_progress_record_is_named_and_delivery_goes_on() -> anyhow::Result<()> {
    let stack = harness::PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let (locker, holder) = hold_lock(&stack, "cdc_relay_progress", "EXCLUSIVE").await?;
    let relay = app::start_relay(&stack, &sink.url, &[]).await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    let event = app::insert_order_event(&db).await?.to_string();
    wait_until("the event delivered under the lock", WAIT, || async {
        sink.delivered().iter().any(|r| r.id() == event)
    })
    .await?;
    let named = format!("pid {holder} (");
    wait_until(
        "both progress writes warned naming the holder",
        WAIT,
        || async {
            let log = relay.process.logs();
            let warned = |what: &str| {
                log.lines().any(|l| {
                    l.contains(what)
                        && l.contains(&named)
                        && l.contains("holds ExclusiveLock on cdc_relay_progress")
                })
            };
            warned("cannot record the publication membership")
                && warned("cannot write the progress record")
        },
    )
    .await?;
    let log = relay.process.logs();
    assert!(!log.contains("apply sql/orders.sql"), "{log}");
    locker.batch_execute("ROLLBACK").await?;
    Ok(())
}

/// A lock that blocks writes to `cdc_relay_dead_letter`: a poison event
/// waits (its dead letter not written, nothing behind it acknowledged),
/// the writer's error names the lock's holder, and once the transaction
/// ends the dead letter is written; meanwhile `/readyz` fails saying so.
/// A relay starting under a lock that blocks reads of it names the holder
/// from its start-up read too.
///
/// Failed before: the writer logged only "canceling statement due to lock
/// timeout", every few seconds, with nobody named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_on_the_dead_letter_table_is_named_and_the_row_written_after() -> anyhow::Result<()>
{
    let (_cluster, stack) = own_server().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay(&stack, &sink.url, &[]).await?;
    app::wait_streaming(&relay).await?;
    let (locker, holder) = hold_lock(&stack, "cdc_relay_dead_letter", "EXCLUSIVE").await?;
    sink.set_status(422);
    let db = stack.orders_admin().await?;
    let poison = app::insert_order_event(&db).await?.to_string();
    let named = format!("pid {holder} (");
    wait_until("the dead-letter writer naming the holder", WAIT, || async {
        relay.process.logs().lines().any(|l| {
            l.contains("cannot write dead-letter rows")
                && l.contains(&named)
                && l.contains("holds ExclusiveLock on cdc_relay_dead_letter")
        })
    })
    .await?;
    // While the writer retries, the relay is not ready, and says why. (It
    // answered ready until the no-progress window ran out.)
    let (status, why) = relay.get("/readyz").await?;
    assert!(
        status == 503 && why.contains("dead-letter rows cannot be written"),
        "{status} {why}"
    );
    locker.batch_execute("ROLLBACK").await?;
    wait_until("the dead letter written after the lock", WAIT, || async {
        db.query_one(
            "SELECT count(*) FROM cdc_relay_dead_letter WHERE event_id = $1",
            &[&poison],
        )
        .await
        .is_ok_and(|r| r.get::<_, i64>(0) == 1)
    })
    .await?;
    wait_until(
        "/readyz 200 once the dead letter is written",
        WAIT,
        || async {
            relay
                .get("/readyz")
                .await
                .is_ok_and(|(status, _)| status == 200)
        },
    )
    .await?;

    // A relay starting under the same lock: its start-up read of the
    // parked dead letters waits, is cancelled, and names the holder too.
    drop(relay);
    let (locker, holder) = hold_lock(&stack, "cdc_relay_dead_letter", "ACCESS EXCLUSIVE").await?;
    let relay = app::start_relay(&stack, &sink.url, &[]).await?;
    let named = format!("pid {holder} (");
    wait_until("the start-up naming the holder", WAIT, || async {
        relay.process.logs().lines().any(|l| {
            l.contains("looking for parked dead letters")
                && l.contains(&named)
                && l.contains("holds AccessExclusiveLock on cdc_relay_dead_letter")
        })
    })
    .await?;
    locker.batch_execute("ROLLBACK").await?;
    app::wait_streaming(&relay).await?;
    Ok(())
}

/// An open transaction on the stack's orders database that took `mode` on
/// `table`; returns its session (ROLLBACK ends it) and backend pid.
async fn hold_lock(
    stack: &harness::Stack,
    table: &str,
    mode: &str,
) -> anyhow::Result<(tokio_postgres::Client, i32)> {
    let locker = stack.orders_admin().await?;
    let pid: i32 = locker
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    locker
        .batch_execute(&format!("BEGIN; LOCK TABLE {table} IN {mode} MODE"))
        .await?;
    Ok((locker, pid))
}

/// The operator's commands under a lock another session holds: each ends
/// within seconds naming the holder, instead of hanging with nothing
/// printed (`dead-letter list` on `cdc_relay_dead_letter`, `prune` on the
/// outbox, `setup` on a publication catalog).
///
/// Failed before: each waited with no output until killed (their
/// connection had no `lock_timeout`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_commands_name_a_lock_instead_of_hanging() -> anyhow::Result<()> {
    let (_cluster, stack) = own_server().await?;
    app::relay_setup(&stack).await?;
    for (table, url, args) in [
        (
            "cdc_relay_dead_letter",
            &stack.relay_url,
            &["dead-letter", "list"][..],
        ),
        (
            "outbox",
            &stack.orders_admin_url,
            &["prune", "--older-than", "1s", "--dry-run"][..],
        ),
        (
            "pg_catalog.pg_publication_rel",
            &stack.orders_admin_url,
            &["setup"][..],
        ),
    ] {
        let (locker, holder) = hold_lock(&stack, table, "ACCESS EXCLUSIVE").await?;
        let out = tokio::time::timeout(
            Duration::from_secs(60),
            app::relay_command(&stack, url, args, &[]),
        )
        .await
        .map_err(|_| anyhow::anyhow!("{args:?} hung behind a lock on {table} for 60 s"))??;
        let text = out.text();
        let short = table.rsplit('.').next().unwrap_or(table);
        assert!(
            out.code() == Some(1)
                && text.contains(&format!("pid {holder} ("))
                && text.contains(&format!("holds AccessExclusiveLock on {short}")),
            "{args:?} under a lock on {table}: {text}"
        );
        locker.batch_execute("ROLLBACK").await?;
    }
    Ok(())
}

/// A server of the test's own and a stack on it, for the tests that take
/// ACCESS EXCLUSIVE locks: such a lock's transaction holds an xid (the lock
/// is WAL-logged), which every slot creation on the server waits for, so
/// on the shared server it would hold up other tests' setup. Autovacuum
/// off: its catalog updates make new sessions of the database rebuild
/// their catalog cache, which waits for a catalog lock before any
/// statement (a login that never completes, said as such; see the
/// operations doc), not the path these tests try.
async fn own_server() -> anyhow::Result<(PgCluster, harness::Stack)> {
    let cluster = PgCluster::start(ClusterOptions {
        extra_settings: vec![("autovacuum".into(), "off".into())],
        ..ClusterOptions::default()
    })?;
    let stack = cluster.create_stack().await?;
    Ok((cluster, stack))
}
