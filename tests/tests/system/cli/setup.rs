//! `cdc-relay setup`: idempotence, the publication and its columns, the
//! server settings it warns about, and the grant a missing privilege needs.

use harness::PgCluster;
use harness::app::{self, TEST_SECRET};
use harness::sink::ScriptedSink;

use super::slots::set_idle_slot_timeout;

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
