//! What an outbox row may hold and how the table may be declared (issue
//! 12, "Row shape and content"): the payload column's type (json or jsonb,
//! checked at setup, at start and from every Relation message), a
//! `SQL_ASCII` database with a payload that is not UTF-8, and a publication
//! that publishes deletes on an outbox without a replica identity.
//!
//! The rule under test: the request body is always valid JSON whose `data`
//! is exactly the stored value; a row that cannot be sent as such is
//! dead-lettered with its raw bytes, or stops the relay before its
//! transaction is acknowledged ([`Scenario::wait_refusal`], then the slot
//! is peeked to show it still holds the row).

use std::time::Duration;

use harness::app::{self, CommandOutput, TEST_SECRET};
use harness::oracle::{self, Accounting};
use harness::sink::ScriptedSink;
use harness::{Inbox, PgCluster, Scenario, Stack, StackOptions, wait_until};

/// Bound for deliveries and dead letters.
const DRAIN: Duration = Duration::from_secs(45);

/// The words every refusal of a non-JSON payload column carries.
const PAYLOAD_TYPE_WORDS: [&str; 3] = ["--payload-column", "text", "json or jsonb"];

/// `cdc-relay run` as a command (as the relay role) until it exits.
async fn run_once(
    stack: &Stack,
    sink: &ScriptedSink,
    extra: &[&str],
) -> anyhow::Result<CommandOutput> {
    let mut args = vec![
        "run",
        "--sink-url",
        &sink.url,
        "--admin-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    app::relay_command(
        stack,
        &stack.relay_url,
        &args,
        &[("EVENT_SECRET", TEST_SECRET)],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payload_column_of_type_text_is_refused_by_setup_and_run() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let db = stack.orders_admin().await?;
    db.batch_execute("ALTER TABLE outbox ALTER COLUMN payload TYPE text")
        .await?;

    let setup = app::relay_command(&stack, &stack.orders_admin_url, &["setup"], &[]).await?;
    assert!(
        !setup.success(),
        "setup accepted a text payload:\n{}",
        setup.text()
    );
    let sink = ScriptedSink::start().await?;
    let run = run_once(&stack, &sink, &[]).await?;
    assert_eq!(run.code(), Some(5), "run exits 5:\n{}", run.text());
    let status = app::relay_command(&stack, &stack.relay_url, &["status"], &[]).await?;
    assert_eq!(
        status.code(),
        Some(5),
        "status exits with run's code:\n{}",
        status.text()
    );
    for (command, out) in [("setup", &setup), ("run", &run), ("status", &status)] {
        for words in PAYLOAD_TYPE_WORDS {
            assert!(
                out.text().contains(words),
                "{command} names {words:?}:\n{}",
                out.text()
            );
        }
    }
    assert_eq!(sink.arrivals(), 0);

    // Back to jsonb, the same slot streams again.
    db.batch_execute("ALTER TABLE outbox ALTER COLUMN payload TYPE jsonb USING payload::jsonb")
        .await?;
    let s = Scenario::plan(Inbox::Scripted).on(stack).start().await?;
    let agg = s.insert_order().await?;
    let event = s
        .insert_event(agg, "JsonbAgain", Some(r#"{"j":1}"#))
        .await?;
    s.expect_exactly(&[event]).await?;
    s.assert_balanced().await?;
    s.finish().await
}

/// A payload column whose type is a domain over jsonb (e.g. one with a
/// CHECK constraint) has jsonb's text: setup, status and run accept it and
/// the payload arrives verbatim. A domain over text is refused like text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payload_of_a_domain_over_jsonb_is_accepted_and_over_text_refused() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let db = stack.orders_admin().await?;
    db.batch_execute(
        "CREATE DOMAIN payload_text AS text; \
         ALTER TABLE outbox ALTER COLUMN payload TYPE payload_text USING payload::text",
    )
    .await?;
    let setup = app::relay_command(&stack, &stack.orders_admin_url, &["setup"], &[]).await?;
    assert!(
        !setup.success(),
        "setup accepted a domain over text:\n{}",
        setup.text()
    );
    assert!(setup.text().contains("payload_text"), "{}", setup.text());

    db.batch_execute(
        "CREATE DOMAIN payload_object AS jsonb CHECK (jsonb_typeof(VALUE) = 'object'); \
         CREATE DOMAIN event_payload AS payload_object; \
         ALTER TABLE outbox ALTER COLUMN payload TYPE event_payload USING payload::text::jsonb",
    )
    .await?;
    app::relay_setup(&stack).await?;
    // The table is fine (not 5); no relay runs yet (8).
    let status = app::relay_command(&stack, &stack.relay_url, &["status"], &[]).await?;
    assert_eq!(status.code(), Some(8), "status:\n{}", status.text());
    let s = Scenario::plan(Inbox::Scripted).on(stack).start().await?;
    let agg = s.insert_order().await?;
    let event = s
        .insert_event(agg, "InDomain", Some(r#"{"d":[1,2]}"#))
        .await?;
    s.expect_exactly(&[event]).await?;
    s.assert_balanced().await?;
    s.finish().await
}

/// The column turned `text` while the relay streams: every row's text is
/// then checked — JSON is sent, anything else dead-lettered — and the slot
/// never wedges, not even when those rows are replayed after the column is
/// changed back (the WAL keeps the rows' old type) and the relay restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payload_turned_text_while_streaming_is_checked_row_by_row_and_never_wedges()
-> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Scripted).await?;
    let agg = s.insert_order().await?;
    let first = s.insert_event(agg, "Json", Some(r#"{"ok":true}"#)).await?;
    s.expect_exactly(std::slice::from_ref(&first)).await?;

    // The sink is down while the text-typed rows are committed: they stay
    // pending, and the next session replays them.
    s.sink().set_status(503);
    s.db.batch_execute("ALTER TABLE outbox ALTER COLUMN payload TYPE text")
        .await?;
    // One transaction: the JSON row stays pending at the 503 sink, so the
    // dead-lettered row before it is replayed too.
    let rows =
        s.db.query(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), $1, 'NotJson', 'not json'), \
                    (gen_random_uuid(), $1, 'JsonAsText', '{\"n\":1}') \
             RETURNING id::text, event_type",
            &[&agg],
        )
        .await?;
    let id_of = |t: &str| -> String {
        rows.iter()
            .find(|r| r.get::<_, String>(1) == t)
            .map(|r| r.get(0))
            .expect("row inserted")
    };
    let (bad, as_text) = (id_of("NotJson"), id_of("JsonAsText"));
    wait_until("the JSON text attempted", DRAIN, || async {
        s.sink().received().iter().any(|r| r.id() == as_text)
    })
    .await?;
    s.stop_relay().await?;
    s.db.batch_execute(
        "DELETE FROM cdc_relay_dead_letter; DELETE FROM outbox WHERE payload = 'not json'; \
         ALTER TABLE outbox ALTER COLUMN payload TYPE jsonb USING payload::jsonb",
    )
    .await?;
    s.sink().set_status(204);
    s.restart_relay(&[]).await?;
    let after = s
        .insert_event(agg, "AfterRestart", Some(r#"{"n":2}"#))
        .await?;
    wait_until("the event after the restart delivered", DRAIN, || async {
        s.sink().delivered().iter().any(|r| r.id() == after.id)
    })
    .await?;
    s.settle().await?;
    assert_bodies_are_json(&s.sink().received());
    let delivered: Vec<String> = s.sink().delivered().iter().map(|r| r.id()).collect();
    assert!(
        delivered.contains(&as_text),
        "JSON text of a text column is sent"
    );
    assert!(
        !s.sink().received().iter().any(|r| r.id() == bad),
        "never sent"
    );
    let dead: Vec<String> =
        s.db.query("SELECT event_id FROM cdc_relay_dead_letter", &[])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
    assert_eq!(dead, [bad], "the non-JSON row is dead-lettered on replay");
    assert_eq!(app::sessions(&s.relay), 1, "no stop, no restart loop");
    Ok(())
}

fn assert_bodies_are_json(received: &[harness::sink::Received]) {
    for r in received {
        assert!(
            serde_json::from_slice::<serde_json::Value>(&r.body).is_ok(),
            "the sink received a body that is not JSON (signature valid: {}): {}",
            r.signature_valid(TEST_SECRET),
            String::from_utf8_lossy(&r.body)
        );
    }
}

/// A stack whose orders database is `SQL_ASCII`, with the slot created by
/// hand (after the publication), so `setup`'s own view of the encoding
/// does not matter here.
async fn sql_ascii_stack() -> anyhow::Result<(Stack, tokio_postgres::Client)> {
    let stack = PgCluster::shared()
        .create_stack_with(&StackOptions {
            orders_encoding: Some("SQL_ASCII".into()),
        })
        .await?;
    let db = stack.orders_admin().await?;
    let encoding: String = db
        .query_one("SELECT current_setting('server_encoding')", &[])
        .await?
        .get(0);
    assert_eq!(encoding, "SQL_ASCII");
    db.execute(
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&stack.slot],
    )
    .await?;
    Ok((stack, db))
}

/// Commits an outbox row whose payload string holds byte 0xff (legal in a
/// `SQL_ASCII` database, never UTF-8); returns its id and the payload's
/// text bytes as stored (what pgoutput sends).
async fn insert_non_utf8(db: &tokio_postgres::Client) -> anyhow::Result<(String, Vec<u8>)> {
    let id = uuid::Uuid::new_v4().to_string();
    let order = uuid::Uuid::new_v4();
    db.batch_execute(&format!(
        "BEGIN; INSERT INTO orders (id, amount_cents, currency) VALUES ('{order}', 1, 'EUR'); \
         INSERT INTO outbox (id, aggregate_id, event_type, payload) \
         VALUES ('{id}', '{order}', 'NotUtf8', E'{{\"note\": \"caf\\xff\"}}'::jsonb); COMMIT"
    ))
    .await?;
    let stored: Vec<u8> = db
        .query_one(
            "SELECT convert_to(payload::text, 'SQL_ASCII') FROM outbox WHERE id = $1::text::uuid",
            &[&id],
        )
        .await?
        .get(0);
    assert!(
        stored.contains(&0xff),
        "the payload holds byte 0xff: {stored:?}"
    );
    Ok((id, stored))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_ascii_database_is_refused_without_the_opt_in() -> anyhow::Result<()> {
    let (stack, db) = sql_ascii_stack().await?;
    let created = oracle::slot_position(&db, &stack.slot).await?.confirmed;
    insert_non_utf8(&db).await?;
    let sink = ScriptedSink::start().await?;
    let run = run_once(&stack, &sink, &[]).await?;
    eprintln!("run on SQL_ASCII without --allow-non-utf8:\n{}", run.text());
    assert_eq!(run.code(), Some(1), "exit code 1:\n{}", run.text());
    for words in ["server_encoding", "SQL_ASCII", "--allow-non-utf8"] {
        assert!(
            run.text().contains(words),
            "names {words:?}:\n{}",
            run.text()
        );
    }
    assert_eq!(sink.arrivals(), 0, "nothing was sent");
    assert_eq!(
        oracle::slot_position(&db, &stack.slot).await?.confirmed,
        created,
        "the slot did not move"
    );
    // The peek decodes like the walsender, in this session's client
    // encoding; SQL_ASCII is the one that passes the stored bytes as they are.
    db.batch_execute("SET client_encoding = 'SQL_ASCII'")
        .await?;
    let accounting = Accounting::read(&db, &["outbox"], []).await?;
    accounting
        .assert_held(&db, &stack.slot, &stack.publications())
        .await
}

/// With the opt-in, the stream carries the stored bytes as they are
/// (client_encoding SQL_ASCII on the replication session): the row that is
/// not UTF-8 becomes a dead letter with its exact bytes, the rest flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_utf8_payload_is_dead_lettered_with_its_raw_bytes() -> anyhow::Result<()> {
    let (stack, db) = sql_ascii_stack().await?;
    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay(&stack, &sink.url, &["--allow-non-utf8"]).await?;
    app::wait_streaming(&relay).await?;
    let before = app::insert_order_event(&db).await?.to_string();
    let (bad, stored) = insert_non_utf8(&db).await?;
    let later = app::insert_order_event(&db).await?.to_string();

    wait_until("the non-UTF-8 row dead-lettered", DRAIN, || async {
        let n: i64 = db
            .query_one(
                "SELECT count(*) FROM cdc_relay_dead_letter WHERE event_id = $1",
                &[&bad],
            )
            .await?
            .get(0);
        anyhow::Ok(n >= 1)
    })
    .await?;
    let rows = db
        .query(
            "SELECT error, payload_bytes FROM cdc_relay_dead_letter WHERE event_id = $1",
            &[&bad],
        )
        .await?;
    assert_eq!(rows.len(), 1, "one dead letter");
    let (error, bytes): (String, Option<Vec<u8>>) = (rows[0].get(0), rows[0].get(1));
    assert!(error.to_lowercase().contains("utf-8"), "{error}");
    assert_eq!(
        bytes.as_deref(),
        Some(&stored[..]),
        "payload_bytes as stored"
    );

    wait_until("the later event delivered", DRAIN, || async {
        oracle::arrival_ids(&sink.delivered()).contains(&later)
    })
    .await?;
    oracle::settle(&db, &stack.slot).await?;
    let delivered = oracle::arrival_ids(&sink.delivered());
    assert!(delivered.contains(&before) && !delivered.contains(&bad));
    assert_eq!(app::sessions(&relay), 1, "no restart loop");
    assert_eq!(
        relay.metrics().await?.sum("cdc_relay_reconnects_total"),
        0.0
    );
    Accounting::read(&db, &["outbox"], delivered)
        .await?
        .assert_balanced();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_published_without_replica_identity_are_warned_about() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let db = stack.orders_admin().await?;
    db.batch_execute(&format!(
        "ALTER PUBLICATION {} SET (publish = 'insert, update, delete'); \
         ALTER TABLE outbox REPLICA IDENTITY NOTHING",
        stack.publication
    ))
    .await?;
    // What the warning is about: a cleanup DELETE now fails.
    let err = db
        .batch_execute("DELETE FROM outbox WHERE false")
        .await
        .expect_err("DELETE on a table that publishes deletes without a replica identity");
    assert_eq!(err.code().map(|c| c.code()), Some("55000"), "{err}");

    let setup = app::relay_command(&stack, &stack.orders_admin_url, &["setup"], &[]).await?;
    assert!(setup.success(), "{}", setup.text());
    assert!(
        mentions_replica_identity(&setup.text()),
        "setup warns:\n{}",
        setup.text()
    );
    // `status` names it too (a warning: delivery is not stopped by it),
    // in both formats.
    for json in [false, true] {
        let args: &[&str] = if json {
            &["status", "--json"]
        } else {
            &["status"]
        };
        let status = app::relay_command(&stack, &stack.orders_admin_url, args, &[]).await?;
        let text = status.text();
        if json {
            let v: serde_json::Value = serde_json::from_str(&status.stdout)?;
            let warnings = v["warnings"].as_array().cloned().unwrap_or_default();
            assert!(
                warnings
                    .iter()
                    .any(|w| w.as_str().is_some_and(mentions_replica_identity)),
                "status --json warns:\n{text}"
            );
        } else {
            assert!(
                text.lines()
                    .any(|l| l.starts_with("warning:") && mentions_replica_identity(l)),
                "status warns:\n{text}"
            );
        }
    }
    let s = Scenario::plan(Inbox::Scripted).on(stack).start().await?;
    let warning = s
        .relay
        .process
        .wait_for_line_where(
            "a WARN about the replica identity recommending insert-only",
            |l| l.contains("WARN") && mentions_replica_identity(l),
            Duration::from_secs(10),
        )
        .await?;
    eprintln!("{warning}");
    let agg = s.insert_order().await?;
    let event = s.insert_event(agg, "Warned", Some("{}")).await?;
    s.expect_exactly(&[event]).await?;
    s.assert_balanced().await?;
    s.finish().await
}

/// Names the replica identity and recommends the insert-only publication
/// with the statement that makes the publication so (case aside: a
/// sentence may start with either). (It said CREATE PUBLICATION for a
/// publication that exists.)
fn mentions_replica_identity(text: &str) -> bool {
    let text = text.to_lowercase();
    text.contains("replica identity")
        && text.contains("insert-only")
        && text.contains("set (publish = 'insert')")
}

/// A configured column renamed and renamed back, with events committed in
/// between, while the relay streams and while it is stopped: the rows the
/// WAL describes under the other name keep their column's position and
/// type, so the relay follows the column (and logs it) instead of stopping
/// with exit 5 on every start (the WAL keeps the old name forever); also
/// when a column was added after (a tester's case: exit 5 on every start,
/// the WAL's shape no longer the catalog's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_renamed_and_back_is_followed_and_never_wedges() -> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Scripted).await?;
    let agg = s.insert_order().await?;
    let first = s.insert_event(agg, "Before", Some(r#"{"n":0}"#)).await?;
    let renamed_insert = |t: &'static str| {
        format!(
            "INSERT INTO outbox (id, aggregate_id, etype, payload) \
             VALUES (gen_random_uuid(), '{agg}', '{t}', '{{\"n\":1}}') \
             RETURNING id::text, etype, payload::text, aggregate_id::text"
        )
    };
    let mut expected = vec![first];
    // While streaming.
    s.db.batch_execute("ALTER TABLE outbox RENAME COLUMN event_type TO etype")
        .await?;
    let row = s.db.query_one(&renamed_insert("WhileRenamed"), &[]).await?;
    expected.push(oracle::Expected::from_row(&row));
    s.db.batch_execute("ALTER TABLE outbox RENAME COLUMN etype TO event_type")
        .await?;
    expected.push(s.insert_event(agg, "RenamedBack", Some("{}")).await?);
    s.expect_exactly(&expected).await?;
    assert!(
        s.relay
            .process
            .logs()
            .contains("renamed; same position and type"),
        "the rename is logged:\n{}",
        s.relay.process.logs()
    );

    // While stopped: the next session's first description of the table
    // carries the other name.
    s.stop_relay().await?;
    s.db.batch_execute("ALTER TABLE outbox RENAME COLUMN event_type TO etype")
        .await?;
    let row = s.db.query_one(&renamed_insert("WhileStopped"), &[]).await?;
    expected.push(oracle::Expected::from_row(&row));
    s.db.batch_execute("ALTER TABLE outbox RENAME COLUMN etype TO event_type")
        .await?;
    expected.push(
        s.insert_event(agg, "RenamedBackWhileStopped", Some("{}"))
            .await?,
    );
    // A column added since (the catalog's layout is no longer the WAL's
    // shape): the older description is its first columns.
    s.db.batch_execute("ALTER TABLE outbox ADD COLUMN note text")
        .await?;
    expected.push(s.insert_event(agg, "AfterRestart", Some("{}")).await?);
    s.restart_relay(&[]).await?;
    s.expect_exactly(&expected).await?;
    s.assert_balanced().await?;
    s.finish().await
}
