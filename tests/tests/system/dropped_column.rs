//! A configured column dropped while rows are committed (issue 12's
//! rule: a row is delivered as stored, dead-lettered, or stops the relay
//! before its transaction is acknowledged): dropped live, the relay stops
//! (exit 5); added back, or the table recreated, the rows committed
//! without it are dead-lettered naming the column and the rest flows, on a
//! plain and on a partitioned outbox.

use std::time::Duration;

use harness::app;
use harness::oracle;
use harness::{Inbox, PgCluster, Scenario, wait_until};

/// Bound for the relay to deliver what a test wrote.
const DRAIN: Duration = Duration::from_secs(45);

/// The payload column dropped, rows committed, the column added back.
/// While the table lacks it, the first such row stops the relay (exit 5)
/// with nothing of it acknowledged; once it is back, the restarted relay
/// dead-letters the row committed without it (naming the column, keeping
/// its id and type) and delivers what follows, instead of stopping on
/// that row at every start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_committed_while_the_payload_column_was_dropped_are_dead_lettered_once_it_is_back()
-> anyhow::Result<()> {
    payload_dropped_and_added_back(Scenario::start(Inbox::Scripted).await?).await
}

/// The same with a partitioned outbox (read through its root): the
/// column is dropped from every partition, and the root's description
/// lacks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_payload_column_added_back_is_the_past_for_a_partition_too() -> anyhow::Result<()>
{
    let stack = PgCluster::shared().create_stack().await?;
    stack.partition_outbox().await?;
    payload_dropped_and_added_back(Scenario::plan(Inbox::Scripted).on(stack).start().await?).await
}

/// The payload column dropped and a row committed, then the table dropped
/// and created again (the schema applied anew) instead of the column added
/// back: the description without the column is of a relation that no
/// longer exists, so it is the past too: its row is dead-lettered and the
/// new table's events flow, where every start stopped on it before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_of_a_dropped_outbox_that_lacked_the_payload_is_dead_lettered_once_it_is_recreated()
-> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Scripted).await?;
    let agg = s.insert_order().await?;
    s.stop_relay().await?;
    s.db.batch_execute("ALTER TABLE outbox DROP COLUMN payload")
        .await?;
    let gap = insert_without_payload(&s, agg).await?;
    s.db.batch_execute("DROP TABLE outbox").await?;
    s.stack.apply_schema().await?;
    let later = s.insert_event(agg, "Recreated", Some(r#"{"r":1}"#)).await?;
    s.restart_relay(&[]).await?;
    wait_until("the event of the new table delivered", DRAIN, || async {
        s.sink().delivered().iter().any(|r| r.id() == later.id)
    })
    .await?;
    wait_until("the row without a payload dead-lettered", DRAIN, || async {
        s.db.query_one(
            "SELECT count(*) FROM cdc_relay_dead_letter WHERE event_id = $1",
            &[&gap],
        )
        .await
        .is_ok_and(|r| r.get::<_, i64>(0) == 1)
    })
    .await?;
    let error: String =
        s.db.query_one(
            "SELECT error FROM cdc_relay_dead_letter WHERE event_id = $1",
            &[&gap],
        )
        .await?
        .get(0);
    assert!(error.contains("no column \"payload\""), "{error}");
    assert_eq!(app::sessions(&s.relay), 1, "no stop, no restart loop");
    Ok(())
}

/// Commits an outbox row without the (dropped) payload column; its id.
async fn insert_without_payload(s: &Scenario, agg: uuid::Uuid) -> anyhow::Result<String> {
    Ok(s.db
        .query_one(
            "INSERT INTO outbox (id, aggregate_id, event_type) \
             VALUES (gen_random_uuid(), $1, 'NoPayload') RETURNING id::text",
            &[&agg],
        )
        .await?
        .get(0))
}

async fn payload_dropped_and_added_back(mut s: Scenario) -> anyhow::Result<()> {
    let agg = s.insert_order().await?;
    let first = s.insert_event(agg, "Before", Some(r#"{"b":1}"#)).await?;
    s.expect_exactly(std::slice::from_ref(&first)).await?;

    s.db.batch_execute("ALTER TABLE outbox DROP COLUMN payload")
        .await?;
    let gap = insert_without_payload(&s, agg).await?;
    let after = oracle::wal_position(&s.db).await?;
    let status = s.wait_refusal(after).await?;
    let logs = s.relay.process.logs();
    assert_eq!(status.code(), Some(5), "{logs}");
    assert!(
        logs.contains("no column \"payload\" (set by --payload-column)"),
        "{logs}"
    );
    s.assert_held(&["outbox"]).await?;

    s.db.batch_execute("ALTER TABLE outbox ADD COLUMN payload jsonb")
        .await?;
    let later = s.insert_event(agg, "After", Some(r#"{"a":1}"#)).await?;
    s.restart_relay(&[]).await?;
    wait_until("the row without a payload dead-lettered", DRAIN, || async {
        s.db.query_one("SELECT count(*) FROM cdc_relay_dead_letter", &[])
            .await
            .is_ok_and(|r| r.get::<_, i64>(0) == 1)
    })
    .await?;
    wait_until("the event after it delivered", DRAIN, || async {
        s.sink().delivered().iter().any(|r| r.id() == later.id)
    })
    .await?;
    let dead =
        s.db.query_one(
            "SELECT event_id, event_type, payload, error FROM cdc_relay_dead_letter",
            &[],
        )
        .await?;
    assert_eq!(dead.get::<_, Option<String>>(0), Some(gap.clone()));
    assert_eq!(
        dead.get::<_, Option<String>>(1).as_deref(),
        Some("NoPayload")
    );
    assert_eq!(dead.get::<_, Option<String>>(2), None);
    let error: String = dead.get(3);
    assert!(error.contains("no column \"payload\""), "{error}");
    assert!(
        !s.sink().received().iter().any(|r| r.id() == gap),
        "never sent"
    );
    let logs = s.relay.process.logs();
    assert!(
        logs.contains("which it has now (dropped, then added back)"),
        "{logs}"
    );
    assert_eq!(app::sessions(&s.relay), 1, "no stop, no restart loop");
    Ok(())
}
