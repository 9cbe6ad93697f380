//! The operator surface of `cdc-relay`: setup, status, start-up errors.

use std::time::Duration;

use anyhow::Context;

use harness::PgCluster;
use harness::app::{self, TEST_SECRET};
use harness::sink::ScriptedSink;
use tokio_postgres::error::SqlState;

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

    // The database is ready, but no relay runs: nothing is delivered.
    let status = app::relay_command(&stack, &stack.relay_url, &["status", "--json"], &[]).await?;
    assert_eq!(status.code(), Some(8), "{}", status.text());
    let v: serde_json::Value = serde_json::from_str(&status.stdout)?;
    assert_eq!(v["healthy"], false);
    assert_eq!(v["problems"][0]["code"], 8);
    assert!(
        v["problems"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no relay streams from slot")),
        "{v}"
    );
    assert_eq!(v["dead_letters_waiting"], 0);
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

    // The outbox taken out of the publication: setup puts it back (as the
    // relay's and status's messages say) and says what to re-send.
    db.batch_execute(&format!(
        "ALTER PUBLICATION \"{}\" DROP TABLE outbox",
        stack.publication
    ))
    .await?;
    let readd = app::relay_command(&stack, &stack.orders_admin_url, &["setup"], &[]).await?;
    assert!(readd.success(), "{}", readd.text());
    assert!(
        readd.text().contains("added: public.outbox to publication")
            && readd.text().contains("backfill"),
        "{}",
        readd.text()
    );
    let listed: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_publication_tables WHERE pubname = $1 AND tablename = 'outbox'",
            &[&stack.publication],
        )
        .await?
        .get(0);
    assert_eq!(listed, 1, "the outbox is back in the publication");

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
    // Every configuration error exits 2, as a command line clap refuses.
    let no_secret = run(&[], &[]).await?;
    assert_eq!(no_secret.code(), Some(2), "{}", no_secret.text());
    assert!(
        no_secret.text().contains("EVENT_SECRET"),
        "{}",
        no_secret.text()
    );

    let timeouts = run(
        &["--request-timeout", "30s"],
        &[("EVENT_SECRET", TEST_SECRET)],
    )
    .await?;
    assert_eq!(timeouts.code(), Some(2), "{}", timeouts.text());
    assert!(
        timeouts.text().contains("--shutdown-timeout"),
        "{}",
        timeouts.text()
    );

    // An empty file setting from the environment (an env file's `X=`) is
    // named by its variable (clap named only the flag, never given).
    let empty_file = run(
        &[],
        &[
            ("EVENT_SECRET", TEST_SECRET),
            ("CDC_RELAY_DATABASE_PASSWORD_FILE", ""),
        ],
    )
    .await?;
    assert_eq!(empty_file.code(), Some(2), "{}", empty_file.text());
    assert!(
        empty_file
            .text()
            .contains("CDC_RELAY_DATABASE_PASSWORD_FILE is set but empty"),
        "{}",
        empty_file.text()
    );

    // A bad value from the environment is named by its variable too.
    let from_env = run(
        &[],
        &[
            ("EVENT_SECRET", TEST_SECRET),
            ("CDC_RELAY_MAX_IN_FLIGHT", "lots"),
        ],
    )
    .await?;
    assert_eq!(from_env.code(), Some(2), "{}", from_env.text());
    assert!(
        from_env.text().contains(
            "the environment variable CDC_RELAY_MAX_IN_FLIGHT (--max-in-flight was not given)"
        ),
        "{}",
        from_env.text()
    );

    let bad_size = run(
        &["--max-pending-bytes", "lots"],
        &[("EVENT_SECRET", TEST_SECRET)],
    )
    .await?;
    assert_eq!(bad_size.code(), Some(2));
    assert!(
        bad_size.text().contains("--max-pending-bytes"),
        "{}",
        bad_size.text()
    );

    // `status --json` that cannot answer still prints an object for a
    // script: the error and the exit code. (It printed nothing on stdout.)
    let mut closed = reqwest::Url::parse(&stack.relay_url)?;
    closed
        .set_port(Some(1))
        .map_err(|()| anyhow::anyhow!("a port"))?;
    let unreachable = app::relay_command(
        &stack,
        closed.as_str(),
        &["status", "--json", "--connect-timeout", "1s"],
        &[],
    )
    .await?;
    let object: serde_json::Value = serde_json::from_str(&unreachable.stdout)
        .map_err(|e| anyhow::anyhow!("{e}: {}", unreachable.text()))?;
    assert_eq!(object["healthy"], false, "{}", unreachable.text());
    assert_eq!(
        object["exit_code"].as_i64(),
        unreachable.code().map(i64::from),
        "{}",
        unreachable.text()
    );
    assert!(
        object["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{}",
        unreachable.text()
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
            ("EVENT_SECRET", TEST_SECRET),
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
    assert!(
        wrong_password.text().contains("pg_hba.conf")
            && wrong_password
                .text()
                .contains("CDC_RELAY_DATABASE_PASSWORD"),
        "an authentication failure names the settings to check: {}",
        wrong_password.text()
    );

    // Connect errors found on the client's side are as definite as a
    // refused password: each exits 1 at once (a retry loop would hide
    // them) and names what to change.
    let (scheme, rest) = stack.relay_url.split_once("://").expect("a URL");
    let (userinfo, host) = rest.split_once('@').expect("a URL with a user");
    let user = userinfo.split(':').next().unwrap_or_default();
    let no_password = format!("{scheme}://{user}@{host}");
    let tls_required = format!("{}?sslmode=require", stack.relay_url);
    let password_file = tempfile::NamedTempFile::new()?;
    std::fs::write(password_file.path(), "secret\n")?;
    let password_file = password_file.path().to_string_lossy().into_owned();
    for (db_url, env, names, code) in [
        (
            no_password.as_str(),
            vec![],
            "CDC_RELAY_DATABASE_PASSWORD_FILE",
            1,
        ),
        (tls_required.as_str(), vec![], "sslmode=disable", 1),
        (
            stack.relay_url.as_str(),
            vec![
                ("CDC_RELAY_DATABASE_PASSWORD", "secret"),
                ("CDC_RELAY_DATABASE_PASSWORD_FILE", password_file.as_str()),
            ],
            "are both set",
            2,
        ),
    ] {
        let mut env = env;
        env.push(("EVENT_SECRET", TEST_SECRET));
        let started = std::time::Instant::now();
        let out = app::relay_command(
            &stack,
            db_url,
            &[
                "run",
                "--sink-url",
                "http://127.0.0.1:9/inbox",
                "--admin-listen",
                "127.0.0.1:0",
            ],
            &env,
        )
        .await?;
        assert_eq!(out.code(), Some(code), "{db_url}: {}", out.text());
        assert!(out.text().contains(names), "{db_url}: {}", out.text());
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{db_url}: a definite error is not retried ({:?}): {}",
            started.elapsed(),
            out.text()
        );
    }
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

    // The same mistakes in a hot standby beside a streaming relay are
    // refused at its start, not first at the takeover it stands by for.
    // (It logged "waiting as hot standby", stayed healthy, and exited 3
    // only when the active relay died.)
    let active = app::start_relay(&stack, &sink.url, &[]).await?;
    app::wait_streaming(&active).await?;
    let mut wrong_column = base.to_vec();
    wrong_column.extend(["--id-column", "nosuchcol"]);
    for (args, named) in [
        (&wrong_table, "--table"),
        (&wrong_publication, "--publication"),
        (&wrong_column, "nosuchcol"),
    ] {
        let out = app::relay_command(&stack, &stack.relay_url, args, &env).await?;
        assert_eq!(out.code(), Some(3), "{args:?}: {}", out.text());
        assert!(
            out.text().contains(named) && !out.text().contains("waiting as hot standby"),
            "{args:?}: {}",
            out.text()
        );
    }
    // A standby set up for another valid table, with its own publication:
    // the slot's progress record names the table the active relay
    // streams. (Broken before: it stood by as healthy, and at the takeover
    // confirmed the slot past every event of the real outbox.)
    db.batch_execute(
        "CREATE PUBLICATION other_pub FOR TABLE other_outbox; \
         GRANT SELECT ON other_outbox TO cdc_relay",
    )
    .await?;
    harness::wait_until(
        "the active relay's membership recorded",
        Duration::from_secs(40),
        || async {
            let oid: Option<u32> = db
                .query_opt(
                    "SELECT membership_table_oid FROM cdc_relay_progress WHERE slot_name = $1",
                    &[&stack.slot],
                )
                .await?
                .and_then(|r| r.get(0));
            anyhow::Ok(oid.is_some())
        },
    )
    .await?;
    let mut other = base.to_vec();
    other.extend([
        "--table",
        "public.other_outbox",
        "--publication",
        "other_pub",
    ]);
    let out = app::relay_command(&stack, &stack.relay_url, &other, &env).await?;
    assert_eq!(out.code(), Some(3), "{}", out.text());
    assert!(
        out.text().contains("streams the outbox public.outbox"),
        "{}",
        out.text()
    );
    drop(active);
    Ok(())
}

/// PostgreSQL 18 added `idle_replication_slot_timeout`; before, the setting
/// does not exist. Sets it on `cluster` (18+) and says whether it did.
async fn set_idle_slot_timeout(cluster: &PgCluster, value: &str) -> anyhow::Result<bool> {
    let admin = cluster.connect_superuser("postgres").await?;
    let set = admin
        .batch_execute(&format!(
            "ALTER SYSTEM SET idle_replication_slot_timeout = '{value}'"
        ))
        .await;
    if cluster.major_version() < 18 {
        let err = set.expect_err("idle_replication_slot_timeout exists only from 18 on");
        assert_eq!(err.code(), Some(&SqlState::UNDEFINED_OBJECT), "{err}");
        return Ok(false);
    }
    set?;
    admin.batch_execute("SELECT pg_reload_conf()").await?;
    let shown = value.to_owned();
    harness::wait_until(
        "idle_replication_slot_timeout to take effect",
        Duration::from_secs(10),
        || async {
            let client = cluster.connect_superuser("postgres").await?;
            let now: String = client
                .query_one("SHOW idle_replication_slot_timeout", &[])
                .await?
                .get(0);
            anyhow::Ok(now == shown)
        },
    )
    .await?;
    Ok(true)
}

/// On 18 a slot nobody reads for `idle_replication_slot_timeout` is
/// invalidated at the next checkpoint (`wal_status = lost`,
/// `invalidation_reason = idle_timeout`): the WAL is still there, so
/// "max_slot_wal_keep_size exceeded" would send the operator the wrong way.
/// `status` and `run` (exit 4) name the real cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_invalidated_for_idleness_is_named_by_status_and_run() -> anyhow::Result<()> {
    let cluster = PgCluster::start(harness::ClusterOptions::default())?;
    let stack = cluster.create_stack().await?;
    app::relay_setup(&stack).await?;
    if !set_idle_slot_timeout(&cluster, "1s").await? {
        return Ok(());
    }
    let db = stack.orders_admin().await?;
    harness::wait_until(
        "the idle slot invalidated (idle_timeout)",
        Duration::from_secs(30),
        || async {
            db.batch_execute("CHECKPOINT").await?;
            let reason: Option<String> = db
                .query_one(
                    "SELECT invalidation_reason FROM pg_replication_slots WHERE slot_name = $1",
                    &[&stack.slot],
                )
                .await?
                .get(0);
            anyhow::Ok(reason.as_deref() == Some("idle_timeout"))
        },
    )
    .await?;

    let status = app::relay_command(&stack, &stack.relay_url, &["status"], &[]).await?;
    let sink = ScriptedSink::start().await?;
    let run = app::relay_command(
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
    for (command, out) in [("run", &run), ("status", &status)] {
        let text = out.text();
        assert_eq!(out.code(), Some(4), "{command}:\n{text}");
        assert!(
            text.contains("idle_replication_slot_timeout"),
            "{command} names the cause:\n{text}"
        );
        assert!(
            !text.contains("max_slot_wal_keep_size exceeded"),
            "{command} blames the wrong setting:\n{text}"
        );
        assert!(
            text.contains("--recreate-slot") && text.contains("backfill"),
            "{command} gives the recovery steps:\n{text}"
        );
    }
    assert_eq!(sink.arrivals(), 0, "nothing was sent");
    Ok(())
}

/// On 18, `setup` warns about an `idle_replication_slot_timeout` that would
/// invalidate the slot while the relay is down (issue 13, section 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_warns_about_idle_replication_slot_timeout() -> anyhow::Result<()> {
    let cluster = PgCluster::start(harness::ClusterOptions::default())?;
    let stack = cluster.create_stack().await?;
    if !set_idle_slot_timeout(&cluster, "1min").await? {
        return Ok(());
    }
    let out = app::relay_command(&stack, &stack.orders_admin_url, &["setup"], &[]).await?;
    assert!(out.success(), "{}", out.text());
    assert!(
        out.text().contains("idle_replication_slot_timeout"),
        "setup warns about the 1min idle_replication_slot_timeout:\n{}",
        out.text()
    );
    Ok(())
}

/// Issue 18, item 8: the relay's role (REPLICATION) can create a
/// `test_decoding` slot and read every row change of the orders database
/// without any table grant; `status` lists such a slot (without changing
/// its exit code) and the running relay counts it in
/// `cdc_relay_other_logical_slots`. Slots of other databases (the other
/// tests' stacks) are not reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_logical_slots_are_reported_by_status_and_counted_by_the_relay() -> anyhow::Result<()>
{
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let status = |args: &'static [&'static str]| {
        let stack = stack.clone();
        async move { app::relay_command(&stack, &stack.relay_url, args, &[]).await }
    };
    let before_out = status(&["status", "--json"]).await?;
    let before: serde_json::Value = serde_json::from_str(&before_out.stdout)?;

    let intruder = format!("intruder_{}", stack.slot);
    let relay_db = harness::connect(&stack.relay_url).await?;
    relay_db
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'test_decoding')",
            &[&intruder],
        )
        .await?;
    let admin = stack.orders_admin().await?;
    admin
        .batch_execute(
            "INSERT INTO orders (id, amount_cents, currency) VALUES (gen_random_uuid(), 4242, 'EUR')",
        )
        .await?;
    let read_orders = relay_db
        .query(
            "SELECT data FROM pg_logical_slot_peek_changes($1, NULL, NULL)",
            &[&intruder],
        )
        .await
        .map(|rows| {
            rows.iter().any(|r| {
                r.get::<_, String>(0)
                    .contains("table public.orders: INSERT")
            })
        });
    let denied_select = relay_db.query("SELECT * FROM orders", &[]).await.is_err();

    let json = status(&["status", "--json"]).await?;
    let human = status(&["status"]).await?;
    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay(&stack, &sink.url, &["--slot-stats-interval", "1s"]).await?;
    app::wait_streaming(&relay).await?;
    let counted = harness::wait_until(
        "cdc_relay_other_logical_slots 1",
        Duration::from_secs(30),
        || async {
            relay
                .gauge("cdc_relay_other_logical_slots")
                .await
                .ok()
                .flatten()
                == Some(1.0)
        },
    )
    .await;

    admin
        .execute("SELECT pg_drop_replication_slot($1)", &[&intruder])
        .await?;
    let uncounted = harness::wait_until(
        "cdc_relay_other_logical_slots 0",
        Duration::from_secs(30),
        || async {
            relay
                .gauge("cdc_relay_other_logical_slots")
                .await
                .ok()
                .flatten()
                == Some(0.0)
        },
    )
    .await;

    assert_eq!(
        before["other_logical_slots"],
        serde_json::json!([]),
        "{before}"
    );
    assert!(
        read_orders.as_ref().is_ok_and(|read| *read),
        "the REPLICATION role reads the orders table's changes: {read_orders:?}"
    );
    assert!(denied_select, "while it may not SELECT from orders");
    // No relay runs yet (exit 8 either way): the other slot changes nothing.
    assert_eq!(
        json.code(),
        before_out.code(),
        "another slot does not change the verdict: {}",
        json.text()
    );
    let v: serde_json::Value = serde_json::from_str(&json.stdout)?;
    assert_eq!(
        v["other_logical_slots"],
        serde_json::json!([{"name": intruder, "plugin": "test_decoding", "active": false}]),
        "{v}"
    );
    assert!(
        human.text().contains(&format!(
            "other logical slot {intruder} (plugin test_decoding, inactive)"
        )),
        "{}",
        human.text()
    );
    counted?;
    uncounted?;
    let logs = relay.process.logs();
    assert!(
        logs.contains("logical slots other than") && logs.contains(&intruder),
        "{logs}"
    );
    Ok(())
}

/// `--version` names the commit the binary was built from (the one checked
/// out: cargo rebuilds when HEAD moves), and `completions` prints a script
/// the shell accepts that knows the subcommands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_names_the_commit_and_completions_are_valid_shell() -> anyhow::Result<()> {
    let relay = harness::bins::path("cdc-relay");
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(&repo)
        .output()?;
    anyhow::ensure!(head.status.success(), "git rev-parse HEAD in {repo:?}");
    let head = String::from_utf8(head.stdout)?.trim().to_owned();
    let version = std::process::Command::new(&relay)
        .arg("--version")
        .output()?;
    let version = String::from_utf8(version.stdout)?;
    assert!(
        version.starts_with("cdc-relay ") && version.trim_end().ends_with(&format!(" ({head})")),
        "--version names HEAD {head}: {version}"
    );

    let script = std::process::Command::new(&relay)
        .args(["completions", "bash"])
        .output()?;
    assert!(script.status.success());
    let script = String::from_utf8(script.stdout)?;
    for word in ["setup", "status", "backfill", "dead-letter", "--sink-url"] {
        assert!(script.contains(word), "the bash completion knows {word}");
    }
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), &script)?;
    let check = std::process::Command::new("bash")
        .arg("-n")
        .arg(file.path())
        .output()?;
    assert!(
        check.status.success(),
        "bash -n: {}",
        String::from_utf8_lossy(&check.stderr)
    );
    Ok(())
}

/// `status` says who holds the slot (the walsender's client and the relay
/// that last recorded progress, host and process) and shows sizes in
/// binary units; `--json` keeps exact bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_the_relay_holding_the_slot_and_shows_readable_sizes() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay(&stack, &sink.url, &[]).await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    app::insert_order_event(&db).await?;
    // The progress record is written at most every 5 s while events flow.
    harness::wait_until("the progress record", Duration::from_secs(30), || async {
        let row = db
            .query_opt(
                "SELECT holder FROM cdc_relay_progress WHERE slot_name = $1",
                &[&stack.slot],
            )
            .await?;
        anyhow::Ok(row.is_some())
    })
    .await?;

    let human = app::relay_command(
        &stack,
        &stack.relay_url,
        &["status", "--admin-url", &relay.url],
        &[],
    )
    .await?;
    let text = human.text();
    assert_eq!(human.code(), Some(0), "{text}");
    assert!(
        text.contains(&format!("relay {}: ready, circuit closed", relay.url)),
        "status asks the relay: {text}"
    );
    assert!(text.contains("healthy: nothing stops delivery"), "{text}");
    // Asked at an address where no admin endpoint answers, the verdict
    // says how far it goes (it said "healthy: nothing stops delivery").
    let unread = app::relay_command(
        &stack,
        &stack.relay_url,
        &["status"],
        &[("CDC_RELAY_ADMIN_LISTEN", "127.0.0.1:9")],
    )
    .await?;
    assert!(
        unread.code() == Some(0)
            && unread
                .stdout
                .contains("healthy as far as the database shows")
            && unread.stdout.contains("--admin-url"),
        "{}",
        unread.text()
    );
    let pid = relay.process.pid();
    for words in [
        "held by cdc-relay from 127.0.0.1 (walsender pid ".to_owned(),
        "last progress by:    cdc-relay@".to_owned(),
        format!(":{pid}\n"),
    ] {
        assert!(text.contains(&words), "status says {words:?}:\n{text}");
    }
    let lag = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("lag:"))
        .expect("a lag line")
        .trim();
    assert!(
        lag.ends_with(" bytes") || lag.ends_with(" KiB") || lag.ends_with(" MiB"),
        "lag in readable units: {lag}"
    );

    let json = app::relay_command(&stack, &stack.relay_url, &["status", "--json"], &[]).await?;
    let v: serde_json::Value = serde_json::from_str(&json.stdout)?;
    assert!(v["lag_bytes"].as_i64().is_some(), "{v}");
    assert!(
        v["held_by"]
            .as_str()
            .is_some_and(|h| h.starts_with("cdc-relay from ")),
        "{v}"
    );
    assert!(
        v["last_progress_by"]
            .as_str()
            .is_some_and(|h| h.ends_with(&format!(":{pid}"))),
        "{v}"
    );

    // A hot standby beside it (not ready by design) is what an HA pair
    // looks like: still healthy, asked on either relay.
    let standby = app::start_relay(&stack, &sink.url, &[]).await?;
    harness::wait_until(
        "the second relay waits as standby",
        Duration::from_secs(30),
        || async {
            standby
                .gauge("cdc_relay_standby")
                .await
                .map(|v| v == Some(1.0))
        },
    )
    .await?;
    let pair = app::relay_command(
        &stack,
        &stack.relay_url,
        &[
            "status",
            "--admin-url",
            &relay.url,
            "--admin-url",
            &standby.url,
        ],
        &[],
    )
    .await?;
    assert_eq!(pair.code(), Some(0), "{}", pair.text());
    assert!(
        pair.text().contains(&format!(
            "relay {}: hot standby, waiting for the slot",
            standby.url
        )),
        "{}",
        pair.text()
    );
    drop(standby);

    // The sink fails: the relay holds the slot but delivers nothing, and
    // status says so from the relay's own readiness (exit 8).
    sink.set_status(503);
    for _ in 0..6 {
        app::insert_order_event(&db).await?;
    }
    harness::wait_until("the circuit open", Duration::from_secs(60), || async {
        relay
            .get("/readyz")
            .await
            .map(|(code, body)| code == 503 && body.contains("circuit"))
    })
    .await?;
    let failing = app::relay_command(
        &stack,
        &stack.relay_url,
        &["status", "--admin-url", &relay.url, "--json"],
        &[],
    )
    .await?;
    assert_eq!(failing.code(), Some(8), "{}", failing.text());
    let v: serde_json::Value = serde_json::from_str(&failing.stdout)?;
    assert!(
        v["problems"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains(&relay.url) && m.contains("circuit")),
        "{v}"
    );
    assert_eq!(v["relays"][0]["circuit_state"], 1.0, "{v}");

    // A relay that does not answer at a given URL is a problem too.
    let nobody = app::relay_command(
        &stack,
        &stack.relay_url,
        &["status", "--admin-url", "http://127.0.0.1:9"],
        &[],
    )
    .await?;
    assert_eq!(nobody.code(), Some(8), "{}", nobody.text());
    assert!(nobody.text().contains("no answer"), "{}", nobody.text());

    // The readiness endpoint pasted in full is refused for what it is
    // (status asked /readyz/readyz and reported the relay broken, with no
    // reason).
    let endpoint = format!("{}/readyz", relay.url.trim_end_matches('/'));
    let pasted = app::relay_command(
        &stack,
        &stack.relay_url,
        &["status", "--admin-url", &endpoint],
        &[],
    )
    .await?;
    assert!(
        pasted.code() == Some(2) && pasted.text().contains("base URL"),
        "{}",
        pasted.text()
    );
    Ok(())
}

/// A relay whose stderr lost its reader (a pipe closed after a journald
/// restart, `… 2>&1 | head`) still stops on SIGTERM: a log line it cannot
/// write is dropped, not reported by a panic that would take the signal
/// watcher down with it (the process then ignored every signal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_with_a_closed_stderr_still_stops_on_sigterm() -> anyhow::Result<()> {
    use std::io::BufRead;
    use std::process::{Command, Stdio};

    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let mut child = Command::new(harness::bins::path("cdc-relay"))
        .args(app::relay_globals(&stack))
        .args([
            "run",
            "--sink-url",
            &sink.url,
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .env("CDC_RELAY_DATABASE_URL", &stack.relay_url)
        .env("CDC_RELAY_LOG", "info,cdc_relay=debug")
        .env("EVENT_SECRET", TEST_SECRET)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    drop(child.stderr.take()); // the reader goes away
    let stdout = child.stdout.take().expect("piped");
    let first = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .map(|_| line)
    })
    .await??;
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id())?);
    let outcome = async {
        let admin = first
            .split_whitespace()
            .last()
            .filter(|u| u.starts_with("http://"))
            .with_context(|| format!("a listening line, got {first:?}"))?
            .to_owned();
        let http = reqwest::Client::new();
        harness::wait_until("/readyz 200", Duration::from_secs(30), || async {
            let r = http.get(format!("{admin}/readyz")).send().await?;
            anyhow::Ok(r.status() == 200)
        })
        .await?;
        // Something to log (debug lines per delivery), then the signal.
        let db = stack.orders_admin().await?;
        app::insert_order_event(&db).await?;
        harness::wait_until("the event delivered", Duration::from_secs(30), || async {
            anyhow::Ok(sink.arrivals() >= 1)
        })
        .await?;
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = child.try_wait()? {
                return anyhow::Ok(status);
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "still running 15 s after SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    .await;
    if outcome.is_err() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let status = outcome?;
    assert_eq!(status.code(), Some(0), "a clean stop");
    Ok(())
}

/// A role without the REPLICATION attribute (cdc_relay, then another
/// role), then without a grant: `run` and `status` name the missing
/// privilege with the command that fixes it, for the URL's role, rather
/// than the server's bare error. On a cluster of its own: the
/// roles are cluster-wide.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_privilege_is_named_with_the_command_that_fixes_it() -> anyhow::Result<()> {
    let cluster = PgCluster::start(harness::ClusterOptions::default())?;
    let stack = cluster.create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let admin = stack.orders_admin().await?;
    let args = [
        "run",
        "--sink-url",
        &sink.url,
        "--admin-listen",
        "127.0.0.1:0",
    ];
    let env = [("EVENT_SECRET", TEST_SECRET)];
    let run = || app::relay_command(&stack, &stack.relay_url, &args, &env);
    let status = || app::relay_command(&stack, &stack.relay_url, &["status"], &[]);

    admin
        .batch_execute("ALTER ROLE cdc_relay NOREPLICATION")
        .await?;
    for out in [run().await?, status().await?] {
        assert!(!out.success(), "{}", out.text());
        assert!(
            out.text().contains("ALTER ROLE cdc_relay REPLICATION"),
            "{}",
            out.text()
        );
    }
    admin
        .batch_execute("ALTER ROLE cdc_relay REPLICATION")
        .await?;

    // Another role (with cdc_relay's grants, not its attribute): the
    // command names that role. (It named cdc_relay whatever the URL's.)
    admin
        .batch_execute("CREATE ROLE orders_reader LOGIN PASSWORD 'reader-pw' IN ROLE cdc_relay")
        .await?;
    let mut reader = reqwest::Url::parse(&stack.relay_url)?;
    reader
        .set_username("orders_reader")
        .and_then(|()| reader.set_password(Some("reader-pw")))
        .map_err(|()| anyhow::anyhow!("a user in {reader}"))?;
    for out in [
        app::relay_command(&stack, reader.as_str(), &args, &env).await?,
        app::relay_command(&stack, reader.as_str(), &["status"], &[]).await?,
    ] {
        assert!(!out.success(), "{}", out.text());
        assert!(
            out.text().contains("ALTER ROLE orders_reader REPLICATION"),
            "{}",
            out.text()
        );
    }
    // The same role as a hot standby beside a streaming relay says so at
    // start, not first at the takeover it stands by for. (It logged
    // "waiting as hot standby" and failed only when the active one died.)
    let active = app::start_relay(&stack, &sink.url, &[]).await?;
    app::wait_streaming(&active).await?;
    let standby = app::relay_command(&stack, reader.as_str(), &args, &env).await?;
    assert!(
        !standby.success()
            && standby
                .text()
                .contains("ALTER ROLE orders_reader REPLICATION")
            && !standby.text().contains("waiting as hot standby"),
        "{}",
        standby.text()
    );
    drop(active);

    admin
        .batch_execute("REVOKE SELECT ON outbox FROM cdc_relay")
        .await?;
    let out = status().await?;
    assert!(!out.success(), "{}", out.text());
    assert!(
        out.text().contains("role cdc_relay lacks")
            && out.text().contains("SELECT on public.outbox")
            && out.text().contains("Apply sql/roles.sql again"),
        "{}",
        out.text()
    );
    Ok(())
}
