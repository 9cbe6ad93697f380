//! Outbox retention done by the relay itself (`run --prune-older-than`):
//! delivered rows deleted in batches at a low rate, a pending event's row
//! kept while the sink is down, a slot without its birth record warned
//! of once, and the idle statement budget kept.

use std::time::Duration;

use harness::{Inbox, PgCluster, Scenario, wait_until};

use super::{DRAIN, WINDOW, insert_events, outbox_rows, still_there, wait_delivered};

/// A relay started with `args` on `stack`, its role allowed to delete
/// outbox rows (`run --prune-older-than` needs it), delivering to a
/// scripted sink.
async fn relay_pruning(stack: harness::Stack, args: &[&str]) -> anyhow::Result<Scenario> {
    stack
        .orders_admin()
        .await?
        .batch_execute("GRANT DELETE ON outbox TO cdc_relay")
        .await?;
    Scenario::plan(Inbox::Scripted)
        .relay_args(args)
        .on(stack)
        .start()
        .await
}

/// `run --prune-older-than`: the relay deletes delivered rows itself, in
/// batches (debug log per batch), counts them, exports the table's size,
/// and leaves a pending event's row alone while the sink is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_prunes_delivered_rows_at_a_low_rate_when_asked() -> anyhow::Result<()> {
    let s = relay_pruning(
        PgCluster::shared().create_stack().await?,
        &[
            "--prune-older-than",
            WINDOW,
            "--prune-interval",
            "1s",
            "--prune-batch",
            "5",
            "--prune-pause",
            "10ms",
        ],
    )
    .await?;
    let delivered = insert_events(&s, 30, "Delivered").await?;
    wait_delivered(&s, &delivered).await?;
    wait_until("the relay to prune the delivered rows", DRAIN, || async {
        outbox_rows(&s.db).await.map(|n| n == 0)
    })
    .await?;
    let m = s.relay.metrics().await?;
    assert_eq!(m.value("cdc_relay_pruned_rows_total", &[]), Some(30.0));
    assert!(
        m.value("cdc_relay_outbox_table_size_bytes", &[])
            .is_some_and(|v| v > 0.0),
        "table size gauge"
    );
    assert!(s.relay.process.logs().contains("prune: batch"));

    s.sink().set_status(503);
    let pending = insert_events(&s, 5, "Pending").await?;
    wait_until("the relay to try the pending events", DRAIN, || async {
        s.sink().count() > 30
    })
    .await?;
    // Time is the subject: several prune ticks pass with the events pending.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(still_there(&s.db, &pending).await?, 5);

    s.sink().set_status(204);
    wait_delivered(&s, &pending).await?;
    wait_until("the relay to prune them once delivered", DRAIN, || async {
        outbox_rows(&s.db).await.map(|n| n == 0)
    })
    .await?;

    // A lock held on the outbox ends a tick after lock_timeout, named with
    // its holder, and pruning goes on after it. (It waited without a
    // bound and without a line.)
    let mut locker = s.stack.orders_admin().await?;
    let tx = locker.transaction().await?;
    tx.batch_execute(
        "SET application_name = 'prune-blocker'; LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE",
    )
    .await?;
    s.relay
        .process
        .wait_for_line_where(
            "the prune tick's WARN naming the lock's holder",
            |l| {
                l.contains("prune: tick failed")
                    && l.contains("prune-blocker")
                    && l.contains("AccessExclusiveLock on outbox")
            },
            Duration::from_secs(30),
        )
        .await?;
    // Counted for an alert, not only logged.
    let failures = s
        .relay
        .metrics()
        .await?
        .sum("cdc_relay_prune_failures_total");
    assert!(failures >= 1.0, "cdc_relay_prune_failures_total {failures}");
    tx.rollback().await?;
    let after = insert_events(&s, 3, "AfterLock").await?;
    wait_delivered(&s, &after).await?;
    wait_until("the relay to prune again after the lock", DRAIN, || async {
        outbox_rows(&s.db).await.map(|n| n == 0)
    })
    .await?;

    // A slot this version made has its birth record: no warning. Without
    // it (a slot made before cdc-relay recorded one), the relay's pruning
    // says what it cannot tell, once, and goes on.
    const BIRTHLESS: &str = "has no birth record";
    assert!(
        !s.relay.process.logs().contains(BIRTHLESS),
        "{}",
        s.relay.process.logs()
    );
    s.db.execute(
        "DELETE FROM cdc_relay_prune_mark WHERE kind = 'birth' AND slot_name = $1",
        &[&s.stack.slot],
    )
    .await?;
    s.relay
        .process
        .wait_for_line_where(
            "the relay's pruning to warn of the missing birth record",
            |l| l.contains(BIRTHLESS) && l.contains(&s.stack.slot) && l.contains("WARN"),
            Duration::from_secs(30),
        )
        .await?;
    let later = insert_events(&s, 3, "Birthless").await?;
    wait_delivered(&s, &later).await?;
    wait_until(
        "the relay to prune without the birth record",
        DRAIN,
        || async { outbox_rows(&s.db).await.map(|n| n == 0) },
    )
    .await?;
    assert_eq!(
        s.relay.process.logs().matches(BIRTHLESS).count(),
        1,
        "said once, not at every tick"
    );
    s.finish().await
}

/// The cdc_relay role's statements in one database, by kind (counts of
/// calls, from pg_stat_statements).
#[derive(Debug, Default, Clone, Copy)]
struct Statements {
    /// Every statement.
    all: i64,
    /// The slot monitor's reading (the slot and the publications).
    monitor: i64,
    /// Pruning's: the tick's probe and anything else about prune marks,
    /// partitions or deletes.
    prune: i64,
}

/// The idle statement budget (0.1 statements/s on the orders database,
/// benchmark scenario c) holds with pruning on and nothing prunable: a tick
/// is one statement, and while idle the relay's only statements are the
/// monitor's reading (every `--slot-stats-interval`, 15 s) and the prune
/// tick (every `--prune-interval`), so at a one-minute interval the rate is
/// 1/15 + 1/60 = 0.083 statements/s. Counted with pg_stat_statements (the
/// cdc_relay role's statements in this stack's orders database, by
/// statement); without the module only the tick itself is checked. The
/// test-only `--prune-first-tick` brings the first tick to 20 s, and
/// `--prune-interval 1h` makes it the only one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pruning_keeps_the_idle_statement_budget() -> anyhow::Result<()> {
    let cluster = PgCluster::shared();
    let s = relay_pruning(
        cluster.create_stack().await?,
        &[
            "--prune-older-than",
            "7d",
            "--prune-interval",
            "1h",
            "--prune-first-tick",
            "20s",
        ],
    )
    .await?;
    let events = insert_events(&s, 3, "Recent").await?;
    wait_delivered(&s, &events).await?;
    s.settle().await?;
    // Let the progress record's one write after delivery (within 5 s) pass.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let admin = cluster.connect_superuser("postgres").await?;
    let counted = cluster.bin().has_pg_stat_statements();
    if counted {
        // Concurrent creators may race: one wins, the others find it.
        let _ = admin
            .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .await;
    } else {
        eprintln!("pg_stat_statements is not available: the statements are not counted");
    }
    let statements = || async {
        if !counted {
            return anyhow::Ok(Statements::default());
        }
        let row = admin
            .query_one(
                "SELECT coalesce(sum(calls), 0)::int8, \
                        coalesce(sum(calls) FILTER (WHERE query LIKE '%pg_replication_slots%' \
                          AND query LIKE '%pg_publication_tables%' \
                          AND query NOT LIKE '%cdc_relay_prune_mark%'), 0)::int8, \
                        coalesce(sum(calls) FILTER (WHERE query LIKE '%cdc_relay_prune_mark%' \
                          OR (query LIKE '%pg_partition_tree%' /* the monitor's reads it too */ \
                              AND query NOT LIKE '%pg_publication_tables%') \
                          OR query LIKE '%DELETE%'), 0)::int8 \
                 FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
                 WHERE d.datname = $1 AND s.userid = 'cdc_relay'::regrole",
                &[&s.stack.orders_db],
            )
            .await?;
        Ok(Statements {
            all: row.get(0),
            monitor: row.get(1),
            prune: row.get(2),
        })
    };
    let before = statements().await?;
    wait_until(
        "the prune tick and a monitor reading after the idle window began",
        DRAIN,
        || async {
            let ticked = s
                .relay
                .metrics()
                .await?
                .value("cdc_relay_outbox_table_size_bytes", &[])
                .is_some_and(|v| v > 0.0);
            anyhow::Ok(ticked && (!counted || statements().await?.monitor > before.monitor))
        },
    )
    .await?;
    let after = statements().await?;
    eprintln!("idle window: {before:?} -> {after:?}");
    assert_eq!(
        after.all - before.all,
        (after.monitor - before.monitor) + (after.prune - before.prune),
        "while idle, every statement is the monitor's reading or the prune tick"
    );
    if counted {
        assert_eq!(after.prune, 1, "the one prune tick is one statement");
    }
    let m = s.relay.metrics().await?;
    assert!(
        m.value("cdc_relay_outbox_table_size_bytes", &[])
            .is_some_and(|v| v > 0.0),
        "the prune ticks ran"
    );
    assert_eq!(m.value("cdc_relay_pruned_rows_total", &[]), Some(0.0));
    assert_eq!(
        still_there(&s.db, &events).await?,
        3,
        "nothing is old enough"
    );
    s.finish().await
}
