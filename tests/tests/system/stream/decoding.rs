//! What else the replication stream carries around the outbox inserts, and
//! the relay must decode or skip without sending anything extra: Type and
//! Truncate messages, logical decoding messages, other published tables,
//! Origin messages, schema changes mid-stream, while stopped and inside a
//! transaction, and updates and deletes on the outbox.

use harness::oracle::{Expected, arrival_ids};
use harness::{Inbox, Scenario};
use uuid::Uuid;

/// An enum column makes pgoutput send a Type message before the Relation;
/// TRUNCATE (not published; then published) between inserts changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enum_column_and_truncate_between_inserts() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let agg = s.insert_order().await?;
    let mut expected = vec![
        s.insert_event(agg, "BeforeEnum", Some(r#"{"k":0}"#))
            .await?,
    ];

    s.db.batch_execute(
        "CREATE TYPE stream_mood AS ENUM ('calm', 'stormy'); \
         ALTER TABLE outbox ADD COLUMN mood stream_mood",
    )
    .await?;
    expected.push(s.insert_event(agg, "WithEnum", Some(r#"{"k":1}"#)).await?);
    s.db.execute(
        "UPDATE outbox SET mood = 'stormy' WHERE id = $1::text::uuid",
        &[&expected[1].id],
    )
    .await?;
    let row =
        s.db.query_one(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload, mood) \
             VALUES (gen_random_uuid(), $1, 'EnumSet', '{\"k\":2}', 'calm') \
             RETURNING id::text, event_type, payload::text, aggregate_id::text",
            &[&agg],
        )
        .await?;
    expected.push(Expected::from_row(&row));
    // The enum grows while streaming (the Type message is sent again).
    s.db.batch_execute("ALTER TYPE stream_mood ADD VALUE 'sunny'")
        .await?;
    let row =
        s.db.query_one(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload, mood) \
             VALUES (gen_random_uuid(), $1, 'EnumGrown', '{\"k\":3}', 'sunny') \
             RETURNING id::text, event_type, payload::text, aggregate_id::text",
            &[&agg],
        )
        .await?;
    expected.push(Expected::from_row(&row));
    s.expect_exactly(&expected).await?;

    // TRUNCATE between two inserts, as its own transaction and inside one.
    s.db.batch_execute("TRUNCATE outbox").await?;
    expected.push(
        s.insert_event(agg, "AfterTruncate", Some(r#"{"k":4}"#))
            .await?,
    );
    s.db.batch_execute("BEGIN").await?;
    expected.push(
        s.insert_event(agg, "TruncatedLater", Some(r#"{"k":5}"#))
            .await?,
    );
    s.db.batch_execute("TRUNCATE outbox").await?;
    expected.push(
        s.insert_event(agg, "AfterTruncateInTx", Some(r#"{"k":6}"#))
            .await?,
    );
    s.db.batch_execute("COMMIT").await?;
    s.expect_exactly(&expected).await?;

    // Now with truncates published: Truncate messages reach the relay.
    s.db.batch_execute(&format!(
        "ALTER PUBLICATION {} SET (publish = 'insert, truncate')",
        s.stack.publication
    ))
    .await?;
    expected.push(
        s.insert_event(agg, "BeforePublishedTruncate", Some("{}"))
            .await?,
    );
    s.db.batch_execute("TRUNCATE outbox").await?;
    s.db.batch_execute("BEGIN").await?;
    expected.push(s.insert_event(agg, "InTruncatingTx", Some("[1]")).await?);
    s.db.batch_execute("TRUNCATE outbox, orders CASCADE")
        .await?;
    s.db.batch_execute("ROLLBACK").await?;
    s.db.batch_execute("BEGIN").await?;
    expected.push(s.insert_event(agg, "InTruncatingTx", Some("[2]")).await?);
    s.db.batch_execute("TRUNCATE outbox").await?;
    s.db.batch_execute("COMMIT").await?;
    expected.retain(|e| e.payload.as_deref() != Some("[1]"));
    expected.push(
        s.insert_event(agg, "AfterPublishedTruncate", Some("{}"))
            .await?,
    );
    s.expect_exactly(&expected).await?;
    s.finish().await
}

/// Transactional and non-transactional logical decoding messages (the
/// transport asks for them with `messages 'true'`) are never posted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logical_messages_around_inserts_are_not_posted() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let agg = s.insert_order().await?;
    let emit = |transactional: bool, content: &'static str| {
        let db = &s.db;
        async move {
            db.execute(
                &format!(
                    "SELECT pg_logical_emit_message({transactional}, 'stream-test', {content})"
                ),
                &[],
            )
            .await
        }
    };
    let big = "repeat('m', 100000)";
    let mut expected = Vec::new();

    // Before any insert.
    emit(false, "''").await?;
    emit(true, "''").await?;
    emit(false, big).await?;
    emit(true, big).await?;
    emit(false, "'\\xff00fe'::bytea").await?;
    // Around inserts, in one transaction.
    s.db.batch_execute("BEGIN").await?;
    emit(true, "''").await?;
    expected.push(s.insert_event(agg, "Between", Some(r#"{"m":1}"#)).await?);
    emit(true, big).await?;
    emit(false, big).await?;
    emit(false, "''").await?;
    expected.push(s.insert_event(agg, "Between", Some(r#"{"m":2}"#)).await?);
    emit(true, "'\\x00'::bytea").await?;
    s.db.batch_execute("COMMIT").await?;
    // Non-transactional messages from a transaction that rolls back are
    // still sent; the insert is not.
    s.db.batch_execute("BEGIN").await?;
    s.insert_event(agg, "RolledBack", Some("{}")).await?;
    emit(false, big).await?;
    emit(true, big).await?;
    s.db.batch_execute("ROLLBACK").await?;
    // Between and after.
    emit(false, "''").await?;
    expected.push(s.insert_event(agg, "After", Some(r#"{"m":3}"#)).await?);
    emit(true, big).await?;
    emit(false, big).await?;
    s.expect_exactly(&expected).await?;
    let ids: Vec<String> = expected.iter().map(|e| e.id.clone()).collect();
    assert_eq!(arrival_ids(&s.sink().received()), ids);
    s.finish().await
}

/// Inserts into another published table, and transactions carrying a
/// replication origin (pgoutput sends an Origin message), are not events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_published_tables_and_origin_messages_are_not_posted() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    s.db.batch_execute(&format!(
        "ALTER PUBLICATION {} ADD TABLE orders",
        s.stack.publication
    ))
    .await?;
    let mut expected = Vec::new();
    // Orders rows (published now) before, with and after outbox rows.
    let lone = s.insert_order().await?;
    s.db.batch_execute("BEGIN").await?;
    let agg = s.insert_order().await?;
    expected.push(s.insert_event(agg, "WithOrder", Some(r#"{"o":1}"#)).await?);
    s.insert_order().await?;
    s.db.batch_execute("COMMIT").await?;

    // A session with a replication origin: its transactions carry Origin.
    let origin = format!("stream_origin_{}", Uuid::new_v4().simple());
    s.db.execute("SELECT pg_replication_origin_create($1)", &[&origin])
        .await?;
    s.db.execute("SELECT pg_replication_origin_session_setup($1)", &[&origin])
        .await?;
    s.db.batch_execute("BEGIN").await?;
    s.db.batch_execute("SELECT pg_replication_origin_xact_setup('0/1', now())")
        .await?;
    expected.push(
        s.insert_event(agg, "FromOrigin", Some(r#"{"o":2}"#))
            .await?,
    );
    s.db.batch_execute("COMMIT").await?;
    expected.push(
        s.insert_event(lone, "FromOriginAutocommit", Some(r#"{"o":3}"#))
            .await?,
    );
    s.db.batch_execute("SELECT pg_replication_origin_session_reset()")
        .await?;
    s.db.execute("SELECT pg_replication_origin_drop($1)", &[&origin])
        .await?;

    expected.push(s.insert_event(lone, "After", Some(r#"{"o":4}"#)).await?);
    s.db.batch_execute("UPDATE orders SET amount_cents = amount_cents + 1")
        .await?;
    s.expect_exactly(&expected).await?;
    s.finish().await
}

/// Columns are resolved by name from the latest Relation message: added,
/// dropped and re-added (which moves them to the end) while streaming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_added_dropped_and_readded_while_streaming() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let agg = s.insert_order().await?;
    let mut expected = vec![s.insert_event(agg, "Original", Some(r#"{"v":0}"#)).await?];
    s.expect_exactly(&expected).await?;

    s.db.batch_execute("ALTER TABLE outbox ADD COLUMN note text DEFAULT 'n'")
        .await?;
    expected.push(s.insert_event(agg, "Added", Some(r#"{"v":1}"#)).await?);
    s.db.batch_execute("ALTER TABLE outbox DROP COLUMN attempts, DROP COLUMN claimed_by")
        .await?;
    expected.push(s.insert_event(agg, "Dropped", Some(r#"{"v":2}"#)).await?);
    // Re-added columns move to the end of the row.
    s.db.batch_execute(
        "ALTER TABLE outbox DROP COLUMN event_type, ADD COLUMN event_type text NOT NULL DEFAULT 'x'",
    )
    .await?;
    expected.push(s.insert_event(agg, "TypeMoved", Some(r#"{"v":3}"#)).await?);
    s.db.batch_execute("ALTER TABLE outbox DROP COLUMN payload, ADD COLUMN payload jsonb")
        .await?;
    expected.push(
        s.insert_event(agg, "PayloadMoved", Some(r#"{"v":4}"#))
            .await?,
    );
    s.db.batch_execute("ALTER TABLE outbox DROP COLUMN id, ADD COLUMN id uuid PRIMARY KEY DEFAULT gen_random_uuid()")
        .await?;
    expected.push(s.insert_event(agg, "IdMoved", Some(r#"{"v":5}"#)).await?);
    s.db.batch_execute("ALTER TABLE outbox DROP COLUMN note")
        .await?;
    expected.push(
        s.insert_event(agg, "NoteDropped", Some(r#"{"v":6}"#))
            .await?,
    );
    let columns: Vec<String> =
        s.db.query(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = 'outbox'::regclass \
             AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        columns[columns.len() - 3..],
        ["event_type", "payload", "id"],
        "{columns:?}"
    );
    s.expect_exactly(&expected).await?;
    s.finish().await
}

/// Schema changes while the relay is stopped: the restarted session decodes
/// each insert with the schema of its time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_changed_while_the_relay_is_stopped() -> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Scripted).await?;
    let agg = s.insert_order().await?;
    let mut expected = vec![
        s.insert_event(agg, "BeforeStop", Some(r#"{"s":0}"#))
            .await?,
    ];
    s.expect_exactly(&expected).await?;
    s.stop_relay().await?;

    s.db.batch_execute("ALTER TABLE outbox ADD COLUMN extra int DEFAULT 7")
        .await?;
    expected.push(s.insert_event(agg, "Added", Some(r#"{"s":1}"#)).await?);
    s.db.batch_execute(
        "ALTER TABLE outbox DROP COLUMN event_type, ADD COLUMN event_type text NOT NULL DEFAULT 'd'",
    )
    .await?;
    expected.push(s.insert_event(agg, "TypeMoved", Some(r#"{"s":2}"#)).await?);
    s.db.batch_execute("ALTER TABLE outbox DROP COLUMN extra, DROP COLUMN payload")
        .await?;
    s.db.batch_execute("ALTER TABLE outbox ADD COLUMN payload jsonb")
        .await?;
    expected.push(
        s.insert_event(agg, "PayloadMoved", Some(r#"{"s":3}"#))
            .await?,
    );
    s.db.batch_execute("ALTER TABLE outbox ADD COLUMN later text")
        .await?;
    expected.push(
        s.insert_event(agg, "AddedAgain", Some(r#"{"s":4}"#))
            .await?,
    );
    assert_eq!(s.sink().count(), 1);

    s.restart_relay(&[]).await?;
    s.expect_exactly(&expected).await?;
    let ids: Vec<String> = expected.iter().map(|e| e.id.clone()).collect();
    assert_eq!(arrival_ids(&s.sink().received()), ids);

    // And while streaming again after the restart.
    s.db.batch_execute("ALTER TABLE outbox DROP COLUMN later")
        .await?;
    expected.push(
        s.insert_event(agg, "AfterRestart", Some(r#"{"s":5}"#))
            .await?,
    );
    s.expect_exactly(&expected).await?;
    s.finish().await
}

/// DDL and inserts in one transaction: each insert is decoded with the
/// schema at its command, even when a later command of the same
/// transaction drops the column it was written in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ddl_and_inserts_in_one_transaction() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let agg = s.insert_order().await?;
    let mut expected = Vec::new();
    s.db.batch_execute("BEGIN").await?;
    expected.push(s.insert_event(agg, "First", Some(r#"{"t":1}"#)).await?);
    s.db.batch_execute("ALTER TABLE outbox ADD COLUMN tag text DEFAULT 'tagged'")
        .await?;
    expected.push(s.insert_event(agg, "AfterAdd", Some(r#"{"t":2}"#)).await?);
    s.db.batch_execute("ALTER TABLE outbox DROP COLUMN payload, ADD COLUMN payload jsonb")
        .await?;
    expected.push(s.insert_event(agg, "AfterMove", Some(r#"{"t":3}"#)).await?);
    s.db.batch_execute("ALTER TABLE outbox DROP COLUMN tag, DROP COLUMN event_type")
        .await?;
    s.db.batch_execute("ALTER TABLE outbox ADD COLUMN event_type text")
        .await?;
    expected.push(
        s.insert_event(agg, "AfterTypeMove", Some(r#"{"t":4}"#))
            .await?,
    );
    s.db.batch_execute("COMMIT").await?;

    // A transaction whose DDL rolls back, with inserts before the rollback point.
    s.db.batch_execute("BEGIN").await?;
    expected.push(
        s.insert_event(agg, "BeforeSavepoint", Some(r#"{"t":5}"#))
            .await?,
    );
    s.db.batch_execute("SAVEPOINT ddl; ALTER TABLE outbox ADD COLUMN gone int DEFAULT 1")
        .await?;
    s.insert_event(agg, "RolledBackWithDdl", Some(r#"{"t":6}"#))
        .await?;
    s.db.batch_execute("ROLLBACK TO SAVEPOINT ddl").await?;
    expected.push(
        s.insert_event(agg, "AfterDdlRollback", Some(r#"{"t":7}"#))
            .await?,
    );
    s.db.batch_execute("COMMIT").await?;

    expected.push(s.insert_event(agg, "Outside", Some(r#"{"t":8}"#)).await?);
    s.expect_exactly(&expected).await?;
    let ids: Vec<String> = expected.iter().map(|e| e.id.clone()).collect();
    assert_eq!(arrival_ids(&s.sink().received()), ids);
    s.finish().await
}

/// Cleanup jobs update and delete outbox rows: nothing extra is posted,
/// first with the insert-only publication, then with one that publishes
/// updates and deletes too (Update/Delete messages with key and full old
/// tuples reach the relay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_and_deletes_on_the_outbox_deliver_nothing() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let agg = s.insert_order().await?;
    let mut expected = Vec::new();
    for i in 0..3 {
        expected.push(
            s.insert_event(agg, "Row", Some(&format!(r#"{{"r":{i}}}"#)))
                .await?,
        );
    }
    s.db.batch_execute(
        "UPDATE outbox SET published_at = now(), attempts = attempts + 1, claimed_by = 'cleanup'; \
         UPDATE outbox SET payload = '{\"rewritten\": true}', event_type = 'Rewritten'",
    )
    .await?;
    s.db.execute(
        "DELETE FROM outbox WHERE id = $1::text::uuid",
        &[&expected[0].id],
    )
    .await?;
    expected.push(
        s.insert_event(agg, "AfterCleanup", Some(r#"{"r":3}"#))
            .await?,
    );
    s.expect_exactly(&expected).await?;

    s.db.batch_execute(&format!(
        "ALTER PUBLICATION {} SET (publish = 'insert, update, delete')",
        s.stack.publication
    ))
    .await?;
    expected.push(s.insert_event(agg, "Published", Some(r#"{"r":4}"#)).await?);
    s.db.batch_execute(
        "UPDATE outbox SET published_at = now(); \
         UPDATE outbox SET id = gen_random_uuid() WHERE event_type = 'Rewritten'; \
         DELETE FROM outbox WHERE event_type = 'AfterCleanup'",
    )
    .await?;
    s.db.batch_execute("ALTER TABLE outbox REPLICA IDENTITY FULL")
        .await?;
    s.db.batch_execute(
        "UPDATE outbox SET attempts = 9; \
         UPDATE outbox SET payload = jsonb_build_object('big', repeat('z', 100000)); \
         DELETE FROM outbox WHERE event_type = 'Rewritten'",
    )
    .await?;
    s.db.batch_execute("BEGIN").await?;
    expected.push(
        s.insert_event(agg, "InsertedThenDeleted", Some(r#"{"r":5}"#))
            .await?,
    );
    s.db.batch_execute("UPDATE outbox SET event_type = 'Changed'; DELETE FROM outbox")
        .await?;
    s.db.batch_execute("COMMIT").await?;
    expected.push(s.insert_event(agg, "Last", Some(r#"{"r":6}"#)).await?);
    s.expect_exactly(&expected).await?;
    s.finish().await
}
