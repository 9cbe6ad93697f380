//! Transactions as the stream delivers them: 20,000 inserts in one, rolled
//! back and aborted ones, savepoints, prepared transactions, and a
//! million-row delete that gives the relay nothing to send for a while.

use std::collections::HashMap;

use harness::oracle::expected::insert_order;
use harness::oracle::{Expected, arrival_ids, walsender_pid};
use harness::{ClusterOptions, Inbox, PgCluster, Scenario};
use uuid::Uuid;

/// Starts a cluster of this test's own (initdb is blocking).
async fn dedicated_cluster(opts: ClusterOptions) -> anyhow::Result<PgCluster> {
    tokio::task::spawn_blocking(move || PgCluster::start(opts)).await?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_inserts_in_one_transaction_keep_per_aggregate_order() -> anyhow::Result<()>
{
    let s = Scenario::start(Inbox::Scripted).await?;
    let mut aggregates = Vec::new();
    for _ in 0..50 {
        aggregates.push(s.insert_order().await?);
    }
    s.db.execute(
        "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), ($1::uuid[])[1 + g % 50], 'Seq', \
                jsonb_build_object('seq', g, 'pad', repeat('x', g % 13)) \
         FROM generate_series(1, 20000) g ORDER BY g",
        &[&aggregates],
    )
    .await?;
    // The heap of a fresh table fills in insertion order: check that the
    // rows went in by seq, so seq order is the stream's (commit) order.
    let rows = s
        .db
        .query(
            "SELECT id::text, event_type, payload::text, aggregate_id::text, (payload->>'seq')::int \
             FROM outbox ORDER BY ctid",
            &[],
        )
        .await?;
    let seqs: Vec<i32> = rows.iter().map(|r| r.get(4)).collect();
    assert_eq!(seqs, (1..=20000).collect::<Vec<i32>>(), "insertion order");
    let expected: Vec<Expected> = rows.iter().map(Expected::from_row).collect();

    s.expect_exactly(&expected).await?;

    // Per aggregate, arrival order is commit order.
    let position: HashMap<&str, usize> = expected
        .iter()
        .enumerate()
        .map(|(i, e)| (e.id.as_str(), i))
        .collect();
    let mut per_aggregate: HashMap<&str, Vec<usize>> = HashMap::new();
    for id in arrival_ids(&s.sink().received()) {
        let i = position[id.as_str()];
        per_aggregate
            .entry(expected[i].aggregate.as_str())
            .or_default()
            .push(i);
    }
    assert_eq!(per_aggregate.len(), 50);
    for (aggregate, order) in &per_aggregate {
        assert_eq!(order.len(), 400, "aggregate {aggregate}");
        if let Some(w) = order.windows(2).find(|w| w[0] > w[1]) {
            panic!(
                "aggregate {aggregate}: seq {} arrived before seq {}",
                w[0] + 1,
                w[1] + 1
            );
        }
    }
    s.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolled_back_transactions_and_savepoints_deliver_only_survivors() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let agg = s.insert_order().await?;

    // A rolled-back transaction: nothing.
    s.db.batch_execute("BEGIN").await?;
    for i in 0..3 {
        s.insert_event(agg, "RolledBack", Some(&format!(r#"{{"i":{i}}}"#)))
            .await?;
    }
    s.db.batch_execute("ROLLBACK").await?;
    s.settle().await?;
    assert_eq!(s.sink().count(), 0, "a rolled-back transaction delivered");

    // A transaction that errors out (aborted, then rolled back): nothing.
    s.db.batch_execute("BEGIN").await?;
    s.insert_event(agg, "Aborted", Some("{}")).await?;
    assert!(s.db.batch_execute("SELECT 1/0").await.is_err());
    s.db.batch_execute("ROLLBACK").await?;

    // Savepoints inside a committed transaction: only the survivors, in order.
    let mut expected = Vec::new();
    s.db.batch_execute("BEGIN").await?;
    expected.push(s.insert_event(agg, "Kept", Some(r#"{"n":1}"#)).await?);
    s.db.batch_execute("SAVEPOINT a").await?;
    s.insert_event(agg, "Discarded", Some(r#"{"n":2}"#)).await?;
    s.db.batch_execute("SAVEPOINT nested").await?;
    s.insert_event(agg, "Discarded", Some(r#"{"n":3}"#)).await?;
    s.db.batch_execute("ROLLBACK TO SAVEPOINT a").await?;
    expected.push(s.insert_event(agg, "Kept", Some(r#"{"n":4}"#)).await?);
    s.db.batch_execute("SAVEPOINT b").await?;
    expected.push(s.insert_event(agg, "Kept", Some(r#"{"n":5}"#)).await?);
    s.db.batch_execute("RELEASE SAVEPOINT b").await?;
    s.db.batch_execute("SAVEPOINT c").await?;
    s.insert_event(agg, "Discarded", Some(r#"{"n":6}"#)).await?;
    s.db.batch_execute("ROLLBACK TO SAVEPOINT c").await?;
    s.db.batch_execute("COMMIT").await?;

    // A rolled-back transaction whose subtransaction was released: nothing.
    s.db.batch_execute("BEGIN").await?;
    s.db.batch_execute("SAVEPOINT s").await?;
    s.insert_event(agg, "RolledBack", Some("{}")).await?;
    s.db.batch_execute("RELEASE SAVEPOINT s").await?;
    s.db.batch_execute("ROLLBACK").await?;

    let last = s.insert_event(agg, "Last", Some("[]")).await?;
    expected.push(last);
    s.expect_exactly(&expected).await?;
    // One aggregate: arrival order is commit order.
    let ids: Vec<String> = expected.iter().map(|e| e.id.clone()).collect();
    assert_eq!(arrival_ids(&s.sink().received()), ids);
    s.finish().await
}

/// On a cluster of its own: a prepared transaction left behind by a failing
/// test would block every later slot creation on a shared cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_transactions_deliver_only_after_commit_prepared() -> anyhow::Result<()> {
    let cluster = dedicated_cluster(ClusterOptions::default()).await?;
    let stack = cluster.create_stack().await?;
    let s = Scenario::plan(Inbox::Scripted).on(stack).start().await?;
    let agg = s.insert_order().await?;
    let gid_commit = format!("stream-commit-{}", Uuid::new_v4());
    let gid_rollback = format!("stream-rollback-{}", Uuid::new_v4());

    s.db.batch_execute("BEGIN").await?;
    let p1 = s.insert_event(agg, "Prepared", Some(r#"{"p":1}"#)).await?;
    let p2 = s.insert_event(agg, "Prepared", Some(r#"{"p":2}"#)).await?;
    s.db.batch_execute(&format!("PREPARE TRANSACTION '{gid_commit}'"))
        .await?;

    s.db.batch_execute("BEGIN").await?;
    s.insert_event(agg, "PreparedThenRolledBack", Some(r#"{"p":3}"#))
        .await?;
    s.db.batch_execute(&format!("PREPARE TRANSACTION '{gid_rollback}'"))
        .await?;

    // Other work commits meanwhile and is delivered; the prepared ones are not.
    let other_agg = s.insert_order().await?;
    let before = s
        .insert_event(other_agg, "Committed", Some(r#"{"c":1}"#))
        .await?;
    s.expect_exactly(std::slice::from_ref(&before)).await?;

    s.db.batch_execute(&format!("COMMIT PREPARED '{gid_commit}'"))
        .await?;
    s.db.batch_execute(&format!("ROLLBACK PREPARED '{gid_rollback}'"))
        .await?;
    let after = s
        .insert_event(other_agg, "Committed", Some(r#"{"c":2}"#))
        .await?;
    s.expect_exactly(&[before, p1.clone(), p2.clone(), after])
        .await?;
    let ids = arrival_ids(&s.sink().received());
    let pos = |id: &str| ids.iter().position(|x| x == id);
    assert!(pos(&p1.id) < pos(&p2.id), "p1 before p2: {ids:?}");
    s.finish().await?;
    drop(cluster);
    Ok(())
}

/// A 1,000,000-row DELETE is decoded (and skipped: the publication publishes
/// inserts only) for a while with no data for the relay. With
/// `wal_sender_timeout = 2s` the session must survive it, and the insert
/// after it must arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn million_row_delete_does_not_time_out_the_walsender() -> anyhow::Result<()> {
    let cluster = dedicated_cluster(ClusterOptions {
        wal_sender_timeout: "2s".into(),
        ..ClusterOptions::default()
    })
    .await?;
    let stack = cluster.create_stack().await?;
    let db = stack.orders_admin().await?;
    let agg = insert_order(&db).await?;
    // Loaded before the slot exists, so none of these rows is an event. The
    // rows all reference one existing order: skipping the FK triggers for
    // the load only saves time.
    let started = std::time::Instant::now();
    db.batch_execute("SET session_replication_role = replica")
        .await?;
    db.execute(
        "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), $1, 'Bulk', '{}' FROM generate_series(1, 1000000)",
        &[&agg],
    )
    .await?;
    db.batch_execute("RESET session_replication_role").await?;
    eprintln!("loaded 1,000,000 rows in {:?}", started.elapsed());

    let mut s = Scenario::plan(Inbox::Scripted).on(stack).start().await?;
    let pid_before = walsender_pid(&s.db, &s.stack.slot).await?;

    let started = std::time::Instant::now();
    let deleted = s.db.execute("DELETE FROM outbox", &[]).await?;
    assert_eq!(deleted, 1_000_000);
    let last = s
        .insert_event(agg, "AfterDelete", Some(r#"{"after":"delete"}"#))
        .await?;
    if let Err(e) = s.expect_exactly(std::slice::from_ref(&last)).await {
        let relay_log = s.relay.process.logs();
        let tail: Vec<&str> = relay_log.lines().rev().take(40).collect();
        anyhow::bail!(
            "{e:#}\n{}\n--- relay (last 40 lines, newest first) ---\n{}",
            cluster.log_tail(40),
            tail.join("\n")
        );
    }
    eprintln!(
        "delete decoded and the next insert delivered in {:?}",
        started.elapsed()
    );

    let log = cluster.log_contents();
    assert!(
        !log.contains("terminating walsender process due to replication timeout"),
        "walsender timed out:\n{}",
        cluster.log_tail(40)
    );
    assert_eq!(
        walsender_pid(&s.db, &s.stack.slot).await?,
        pid_before,
        "the walsender changed"
    );
    let relay_log = s.relay.process.logs();
    assert!(
        !relay_log.contains("reconnecting"),
        "the relay reconnected:\n{relay_log}"
    );
    s.stop_relay().await?;
    drop(s);
    drop(cluster);
    Ok(())
}
