//! The operator surface of `cdc-relay`: setup, status, start-up errors.

use std::time::Duration;

use harness::PgCluster;
use harness::app::{self, TEST_SECRET};
use harness::sink::ScriptedSink;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_is_idempotent_and_status_reports_the_slot() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    // The harness created the publication already; setup keeps it and makes the slot.
    let first = app::relay_command(&stack, &stack.orders_admin_url, &["setup"], &[]).await?;
    assert!(first.success(), "{}", first.text());
    let out = first.text();
    assert!(out.contains("ok: wal_level = logical"), "{out}");
    assert!(out.contains("exists: publication"), "{out}");
    assert!(out.contains("created: slot"), "{out}");

    let again = app::relay_command(&stack, &stack.orders_admin_url, &["setup"], &[]).await?;
    assert!(again.success(), "{}", again.text());
    assert!(again.text().contains("exists: slot"), "{}", again.text());
    assert!(!again.text().contains("created:"), "{}", again.text());

    let status = app::relay_command(&stack, &stack.relay_url, &["status", "--json"], &[]).await?;
    assert!(status.success(), "{}", status.text());
    let v: serde_json::Value = serde_json::from_str(&status.stdout)?;
    assert_eq!(v["slot"], stack.slot.as_str());
    assert_eq!(v["exists"], true);
    assert_eq!(v["active"], false);
    assert_eq!(v["wal_status"], "reserved");
    assert_eq!(
        v["publication_tables"],
        serde_json::json!(["public.outbox"])
    );
    assert!(v["lag_bytes"].as_i64().is_some());

    let human = app::relay_command(&stack, &stack.relay_url, &["status"], &[]).await?;
    assert!(
        human.text().contains("confirmed_flush_lsn"),
        "{}",
        human.text()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_creates_a_missing_publication_and_checks_columns() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let db = stack.orders_admin().await?;
    db.batch_execute(&format!("DROP PUBLICATION \"{}\"", stack.publication))
        .await?;
    let out = app::relay_command(&stack, &stack.orders_admin_url, &["setup"], &[]).await?;
    assert!(out.success(), "{}", out.text());
    assert!(
        out.text().contains("created: publication"),
        "{}",
        out.text()
    );
    let row = db
        .query_one(
            "SELECT pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication WHERE pubname = $1",
            &[&stack.publication],
        )
        .await?;
    let flags: (bool, bool, bool, bool) = (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(
        flags,
        (true, false, false, false),
        "insert-only publication"
    );

    let bad = app::relay_command(
        &stack,
        &stack.orders_admin_url,
        &["--payload-column", "body", "setup"],
        &[],
    )
    .await?;
    assert!(!bad.success());
    assert!(
        bad.text().contains("\"body\"") && bad.text().contains("--payload-column"),
        "{}",
        bad.text()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_without_a_slot_exits_naming_setup() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let sink = ScriptedSink::start().await?;
    let out = app::relay_command(
        &stack,
        &stack.relay_url,
        &[
            "run",
            "--sink-url",
            &sink.url,
            "--admin-listen",
            "127.0.0.1:0",
        ],
        &[("EVENT_SECRET", TEST_SECRET)],
    )
    .await?;
    assert_eq!(out.code(), Some(3), "{}", out.text());
    assert!(out.text().contains("cdc-relay setup"), "{}", out.text());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configuration_exits_non_zero_naming_the_setting() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let run = |extra: &'static [&'static str], env: &'static [(&'static str, &'static str)]| {
        let stack = stack.clone();
        async move {
            let mut args = vec![
                "run",
                "--sink-url",
                "http://127.0.0.1:9/inbox",
                "--admin-listen",
                "127.0.0.1:0",
            ];
            args.extend_from_slice(extra);
            app::relay_command(&stack, &stack.relay_url, &args, env).await
        }
    };
    let no_secret = run(&[], &[]).await?;
    assert!(!no_secret.success());
    assert!(
        no_secret.text().contains("EVENT_SECRET"),
        "{}",
        no_secret.text()
    );

    let timeouts = run(&["--request-timeout", "30s"], &[("EVENT_SECRET", "x")]).await?;
    assert!(!timeouts.success());
    assert!(
        timeouts.text().contains("--shutdown-timeout"),
        "{}",
        timeouts.text()
    );

    let bad_size = run(&["--max-pending-bytes", "lots"], &[("EVENT_SECRET", "x")]).await?;
    assert_eq!(bad_size.code(), Some(2));
    assert!(
        bad_size.text().contains("--max-pending-bytes"),
        "{}",
        bad_size.text()
    );

    let wrong_password = app::relay_command(
        &stack,
        &stack.relay_url,
        &[
            "run",
            "--sink-url",
            "http://127.0.0.1:9/inbox",
            "--admin-listen",
            "127.0.0.1:0",
        ],
        &[
            ("EVENT_SECRET", "x"),
            ("CDC_RELAY_DATABASE_PASSWORD", "wrong"),
        ],
    )
    .await?;
    assert_eq!(wrong_password.code(), Some(1), "{}", wrong_password.text());
    assert!(
        wrong_password
            .text()
            .contains("password authentication failed"),
        "{}",
        wrong_password.text()
    );
    assert!(
        !wrong_password.text().contains("wrong"),
        "the password is never printed"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_slot_flag_creates_a_missing_slot_and_streams() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay(&stack, &sink.url, &["--create-slot"]).await?;
    app::wait_streaming(&relay).await?;
    assert!(relay.process.logs().contains("created the missing slot"));
    let db = stack.orders_admin().await?;
    let order = uuid::Uuid::new_v4();
    db.execute(
        "INSERT INTO orders (id, amount_cents, currency) VALUES ($1, 1, 'EUR')",
        &[&order],
    )
    .await?;
    db.execute(
        "INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES (gen_random_uuid(), $1, 'T', '{}')",
        &[&order],
    )
    .await?;
    harness::wait_until("the event delivered", Duration::from_secs(20), || async {
        sink.delivered().len() == 1
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
/// Each needs `setup` or a flag fixed, not a restart: exit 3, which the
/// shipped unit does not restart.
async fn run_refuses_a_table_or_publication_that_would_skip_events() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let base = [
        "run",
        "--sink-url",
        &sink.url,
        "--admin-listen",
        "127.0.0.1:0",
    ];
    let env = [("EVENT_SECRET", TEST_SECRET)];
    let mut wrong_table = base.to_vec();
    wrong_table.extend(["--table", "public.nope"]);
    let out = app::relay_command(&stack, &stack.relay_url, &wrong_table, &env).await?;
    assert_eq!(out.code(), Some(3), "{}", out.text());
    assert!(out.text().contains("--table"), "{}", out.text());

    // A real table the publication does not carry.
    let db = stack.orders_admin().await?;
    db.batch_execute("CREATE TABLE other_outbox (LIKE outbox)")
        .await?;
    let mut unpublished = base.to_vec();
    unpublished.extend(["--table", "public.other_outbox"]);
    let out = app::relay_command(&stack, &stack.relay_url, &unpublished, &env).await?;
    assert_eq!(out.code(), Some(3), "{}", out.text());
    assert!(
        out.text()
            .contains("publishes inserts into public.other_outbox"),
        "{}",
        out.text()
    );

    let mut wrong_publication = base.to_vec();
    wrong_publication.extend(["--publication", "nope"]);
    let out = app::relay_command(&stack, &stack.relay_url, &wrong_publication, &env).await?;
    assert_eq!(out.code(), Some(3), "{}", out.text());
    assert!(
        out.text()
            .contains("\"nope\" does not exist (--publication / CDC_RELAY_PUBLICATION)"),
        "{}",
        out.text()
    );
    Ok(())
}
