//! The operator surface of `cdc-relay`: setup, status, start-up errors.

use std::process::Output;
use std::time::Duration;

use harness::app::{self, TEST_SECRET};
use harness::sink::ScriptedSink;
use harness::{PgCluster, Stack, bins};

async fn relay_cmd(
    stack: &Stack,
    url: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<Output> {
    let mut cmd = tokio::process::Command::new(bins::path("cdc-relay"));
    cmd.args(app::relay_globals(stack))
        .args(args)
        .env("CDC_RELAY_DATABASE_URL", url)
        .env_remove("EVENT_SECRET")
        .envs(env.iter().copied());
    Ok(tokio::time::timeout(Duration::from_secs(60), cmd.output()).await??)
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_is_idempotent_and_status_reports_the_slot() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    // The harness created the publication already; setup keeps it and makes the slot.
    let first = relay_cmd(&stack, &stack.orders_admin_url, &["setup"], &[]).await?;
    assert!(first.status.success(), "{}", text(&first));
    let out = text(&first);
    assert!(out.contains("ok: wal_level = logical"), "{out}");
    assert!(out.contains("exists: publication"), "{out}");
    assert!(out.contains("created: slot"), "{out}");

    let again = relay_cmd(&stack, &stack.orders_admin_url, &["setup"], &[]).await?;
    assert!(again.status.success(), "{}", text(&again));
    assert!(text(&again).contains("exists: slot"), "{}", text(&again));
    assert!(!text(&again).contains("created:"), "{}", text(&again));

    let status = relay_cmd(&stack, &stack.relay_url, &["status", "--json"], &[]).await?;
    assert!(status.status.success(), "{}", text(&status));
    let v: serde_json::Value = serde_json::from_slice(&status.stdout)?;
    assert_eq!(v["slot"], stack.slot.as_str());
    assert_eq!(v["exists"], true);
    assert_eq!(v["active"], false);
    assert_eq!(v["wal_status"], "reserved");
    assert_eq!(
        v["publication_tables"],
        serde_json::json!(["public.outbox"])
    );
    assert!(v["lag_bytes"].as_i64().is_some());

    let human = relay_cmd(&stack, &stack.relay_url, &["status"], &[]).await?;
    assert!(
        text(&human).contains("confirmed_flush_lsn"),
        "{}",
        text(&human)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_creates_a_missing_publication_and_checks_columns() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let db = stack.orders_admin().await?;
    db.batch_execute(&format!("DROP PUBLICATION \"{}\"", stack.publication))
        .await?;
    let out = relay_cmd(&stack, &stack.orders_admin_url, &["setup"], &[]).await?;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("created: publication"),
        "{}",
        text(&out)
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

    let bad = relay_cmd(
        &stack,
        &stack.orders_admin_url,
        &["--payload-column", "body", "setup"],
        &[],
    )
    .await?;
    assert!(!bad.status.success());
    assert!(
        text(&bad).contains("\"body\"") && text(&bad).contains("--payload-column"),
        "{}",
        text(&bad)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_without_a_slot_exits_naming_setup() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let sink = ScriptedSink::start().await?;
    let out = relay_cmd(
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
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(text(&out).contains("cdc-relay setup"), "{}", text(&out));
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
            relay_cmd(&stack, &stack.relay_url, &args, env).await
        }
    };
    let no_secret = run(&[], &[]).await?;
    assert!(!no_secret.status.success());
    assert!(
        text(&no_secret).contains("EVENT_SECRET"),
        "{}",
        text(&no_secret)
    );

    let timeouts = run(&["--request-timeout", "30s"], &[("EVENT_SECRET", "x")]).await?;
    assert!(!timeouts.status.success());
    assert!(
        text(&timeouts).contains("--shutdown-timeout"),
        "{}",
        text(&timeouts)
    );

    let bad_size = run(&["--max-pending-bytes", "lots"], &[("EVENT_SECRET", "x")]).await?;
    assert_eq!(bad_size.status.code(), Some(2));
    assert!(
        text(&bad_size).contains("--max-pending-bytes"),
        "{}",
        text(&bad_size)
    );

    let wrong_password = relay_cmd(
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
    assert_eq!(
        wrong_password.status.code(),
        Some(1),
        "{}",
        text(&wrong_password)
    );
    assert!(
        text(&wrong_password).contains("password authentication failed"),
        "{}",
        text(&wrong_password)
    );
    assert!(
        !text(&wrong_password).contains("wrong"),
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
    let out = relay_cmd(&stack, &stack.relay_url, &wrong_table, &env).await?;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("--table"), "{}", text(&out));

    // A real table the publication does not carry.
    let db = stack.orders_admin().await?;
    db.batch_execute("CREATE TABLE other_outbox (LIKE outbox)")
        .await?;
    let mut unpublished = base.to_vec();
    unpublished.extend(["--table", "public.other_outbox"]);
    let out = relay_cmd(&stack, &stack.relay_url, &unpublished, &env).await?;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("publishes inserts into public.other_outbox"),
        "{}",
        text(&out)
    );

    let mut wrong_publication = base.to_vec();
    wrong_publication.extend(["--publication", "nope"]);
    let out = relay_cmd(&stack, &stack.relay_url, &wrong_publication, &env).await?;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("\"nope\" does not exist (--publication)"),
        "{}",
        text(&out)
    );
    Ok(())
}
