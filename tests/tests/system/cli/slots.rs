//! Slots as `status` and a running relay see them: invalidated for
//! idleness, other logical slots on the server, the relay holding the slot
//! and readable sizes.

use std::time::Duration;

use harness::PgCluster;
use harness::app::{self, TEST_SECRET};
use harness::sink::ScriptedSink;
use tokio_postgres::error::SqlState;

/// PostgreSQL 18 added `idle_replication_slot_timeout`; before, the setting
/// does not exist. Sets it on `cluster` (18+) and says whether it did.
pub(super) async fn set_idle_slot_timeout(
    cluster: &PgCluster,
    value: &str,
) -> anyhow::Result<bool> {
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

    let human = relay.status(&stack).await?;
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
