//! Outbox retention (issue 17): `cdc-relay prune` and `run
//! --prune-older-than` delete only rows that are older than the window AND
//! proven delivered (the slot confirmed past a prune mark taken after their
//! insert), keep rows with a dead letter waiting, refuse when nothing can be
//! proven, drop whole time-range partitions, and keep the relay's idle cost.
//! Every test ends with the rows that must stay counted, and the events
//! delivered.

use std::time::Duration;

use harness::app::{self, CommandOutput};
use harness::oracle::expected::Expected;
use harness::{Inbox, PgCluster, Scenario, Stack, wait_until};
use tokio_postgres::Client;

mod periodic;

/// Bound for deliveries and for the relay's own pruning.
const DRAIN: Duration = Duration::from_secs(45);

/// The window these tests prune with: the smallest whole one (a window of
/// 0 is refused). Each waits for its rows to pass it ([`wait_past_window`])
/// so that the proof alone decides which rows go.
const WINDOW: &str = "1s";

/// Waits until every outbox row is older than [`WINDOW`] by the server's
/// clock (prune's cutoff is the server's `now()` minus the window).
async fn wait_past_window(db: &Client) -> anyhow::Result<()> {
    wait_until(
        "every outbox row older than the prune window",
        DRAIN,
        || async {
            db.query_one(
                "SELECT coalesce(max(occurred_at) < now() - interval '1 second', true) FROM outbox",
                &[],
            )
            .await
            .map(|r| r.get::<_, bool>(0))
            .map_err(anyhow::Error::from)
        },
    )
    .await
}

/// `cdc-relay prune <args>` as the superuser (the table's owner).
async fn prune(stack: &Stack, args: &[&str]) -> anyhow::Result<CommandOutput> {
    let mut argv = vec!["prune"];
    argv.extend_from_slice(args);
    app::relay_command(stack, &stack.orders_admin_url, &argv, &[]).await
}

/// Outbox rows in the table now.
async fn outbox_rows(db: &Client) -> anyhow::Result<i64> {
    Ok(db
        .query_one("SELECT count(*) FROM outbox", &[])
        .await?
        .get(0))
}

/// How many of `events` are still in the outbox.
async fn still_there(db: &Client, events: &[Expected]) -> anyhow::Result<usize> {
    let ids: Vec<String> = events.iter().map(|e| e.id.clone()).collect();
    let n: i64 = db
        .query_one(
            "SELECT count(*) FROM outbox WHERE id::text = ANY($1)",
            &[&ids],
        )
        .await?
        .get(0);
    Ok(usize::try_from(n)?)
}

async fn insert_events(s: &Scenario, n: usize, kind: &str) -> anyhow::Result<Vec<Expected>> {
    let agg = s.insert_order().await?;
    let mut out = Vec::new();
    for i in 0..n {
        out.push(
            s.insert_event(agg, kind, Some(&format!(r#"{{"i":{i}}}"#)))
                .await?,
        );
    }
    Ok(out)
}

/// Waits until the sink got a 2xx for every one of `events`.
async fn wait_delivered(s: &Scenario, events: &[Expected]) -> anyhow::Result<()> {
    let what = format!("{} events delivered", events.len());
    wait_until(&what, DRAIN, || async {
        let got: std::collections::BTreeSet<String> =
            s.sink().delivered().iter().map(|r| r.id()).collect();
        events.iter().all(|e| got.contains(&e.id))
    })
    .await
}

fn json(out: &CommandOutput) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(out.success(), "prune failed: {}", out.text());
    Ok(serde_json::from_str(&out.stdout)?)
}

/// The sink goes down with events pending: prune deletes the delivered rows
/// a mark proves and not one row of the pending events; a dry run before
/// deletes nothing. Once the sink is back the pending events are delivered,
/// and only then pruned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_never_deletes_an_undelivered_row_while_the_sink_is_down() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let delivered = insert_events(&s, 20, "Delivered").await?;
    wait_delivered(&s, &delivered).await?;
    s.settle().await?;
    wait_past_window(&s.db).await?;

    let out = prune(&s.stack, &["--older-than", WINDOW, "--dry-run", "--json"]).await?;
    assert!(!out.stderr.contains("no birth record"), "{}", out.stderr);
    let dry = json(&out)?;
    assert_eq!(dry["rows_deleted"], 20, "{dry}");
    assert_eq!(dry["dry_run"], true);
    assert_eq!(outbox_rows(&s.db).await?, 20, "a dry run deletes nothing");

    s.sink().set_status(503);
    let pending = insert_events(&s, 10, "Pending").await?;
    wait_until("the relay to try the pending events", DRAIN, || async {
        s.sink().count() > 20
    })
    .await?;
    // The pending rows too are past the window: only the proof keeps them.
    wait_past_window(&s.db).await?;
    let out = prune(
        &s.stack,
        &[
            "--older-than",
            WINDOW,
            "--wait",
            "2s",
            "--batch",
            "3",
            "--json",
        ],
    )
    .await?;
    let done = json(&out)?;
    assert_eq!(done["rows_deleted"], 20, "{done}\n{}", out.stderr);
    assert!(
        out.stderr.contains("rows deleted"),
        "progress: {}",
        out.stderr
    );
    assert_eq!(still_there(&s.db, &delivered).await?, 0);
    assert_eq!(
        still_there(&s.db, &pending).await?,
        10,
        "no row of a pending event is deleted"
    );

    s.sink().set_status(204);
    wait_delivered(&s, &pending).await?;
    s.settle().await?;
    wait_past_window(&s.db).await?;
    let out = prune(&s.stack, &["--older-than", WINDOW]).await?;
    assert!(out.success(), "{}", out.text());
    assert!(out.stdout.contains("deleted 10 row(s)"), "{}", out.text());
    assert_eq!(outbox_rows(&s.db).await?, 0);
    s.finish().await
}

/// A poison event's row stays while its dead letter waits, and goes once
/// the dead letter is discarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_lettered_row_is_kept_until_its_dead_letter_is_resolved() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let poison = uuid::Uuid::new_v4().to_string();
    s.sink().reject(&poison, 422);
    let order = s.insert_order().await?;
    s.db.execute(
        "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
         VALUES ($1::text::uuid, $2, 'Poison', '{}')",
        &[&poison, &order],
    )
    .await?;
    let fine = insert_events(&s, 3, "Fine").await?;
    wait_delivered(&s, &fine).await?;
    wait_until("the poison event dead-lettered", DRAIN, || async {
        s.db.query_one("SELECT count(*) FROM cdc_relay_dead_letter", &[])
            .await
            .map(|r| r.get::<_, i64>(0) == 1)
            .map_err(anyhow::Error::from)
    })
    .await?;
    s.settle().await?;
    wait_past_window(&s.db).await?;

    let out = prune(&s.stack, &["--older-than", WINDOW, "--json"]).await?;
    let done = json(&out)?;
    assert_eq!(done["rows_deleted"], 3, "{done}");
    assert_eq!(done["rows_kept_dead_lettered"], 1, "{done}");
    assert_eq!(outbox_rows(&s.db).await?, 1, "the poison row stays");

    let id: i64 =
        s.db.query_one("SELECT id FROM cdc_relay_dead_letter", &[])
            .await?
            .get(0);
    let discard = app::relay_command(
        &s.stack,
        &s.stack.relay_url,
        &[
            "dead-letter",
            "discard",
            &id.to_string(),
            "--note",
            "test",
            "--yes",
        ],
        &[],
    )
    .await?;
    assert!(discard.success(), "{}", discard.text());
    let out = prune(&s.stack, &["--older-than", WINDOW]).await?;
    assert!(out.stdout.contains("deleted 1 row(s)"), "{}", out.text());
    assert_eq!(outbox_rows(&s.db).await?, 0);
    s.finish().await
}

/// Nothing can be proven while the relay has never confirmed past a mark
/// (its sink down from the start): prune refuses (exit 1) with what to do,
/// deleting nothing; a missing column is a setup problem (exit 3). Once the
/// events are delivered, the mark taken by the refused run proves them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_refuses_when_delivery_cannot_be_proven() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    s.sink().set_status(503);
    let events = insert_events(&s, 3, "Undelivered").await?;
    wait_past_window(&s.db).await?;

    let out = prune(&s.stack, &["--older-than", WINDOW, "--wait", "1s"]).await?;
    assert_eq!(out.code(), Some(1), "{}", out.text());
    assert!(
        out.stderr.contains("cannot prove any outbox row delivered")
            && out.stderr.contains("Nothing was deleted")
            && out.stderr.contains("cdc-relay status"),
        "{}",
        out.text()
    );
    assert_eq!(still_there(&s.db, &events).await?, 3);

    let out = prune(&s.stack, &["--older-than", WINDOW, "--time-column", "nope"]).await?;
    assert_eq!(out.code(), Some(3), "{}", out.text());
    assert!(out.stderr.contains("--time-column"), "{}", out.text());

    s.sink().set_status(204);
    wait_delivered(&s, &events).await?;
    s.settle().await?;
    let out = prune(&s.stack, &["--older-than", WINDOW, "--wait", "0s"]).await?;
    assert!(out.stdout.contains("deleted 3 row(s)"), "{}", out.text());
    s.finish().await
}

/// An outbox without a replica identity that a publication publishes
/// deletes of (here another one than the relay's insert-only one, made
/// `FOR TABLE outbox` with every action): the server refuses prune's
/// DELETE, and prune names the cause in words with the commands that fix
/// it (it showed the server's bare SQLSTATE 55000). Nothing is deleted
/// (exit 1); once the publication publishes only inserts, as the message
/// offers, the rows go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_names_a_missing_replica_identity_with_its_fixes() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let events = insert_events(&s, 3, "Delivered").await?;
    wait_delivered(&s, &events).await?;
    s.settle().await?;
    let admin = s.stack.orders_admin().await?;
    admin
        .batch_execute(
            "ALTER TABLE outbox REPLICA IDENTITY NOTHING; \
             CREATE PUBLICATION audit_everything FOR TABLE outbox",
        )
        .await?;
    wait_past_window(&s.db).await?;

    let out = prune(&s.stack, &["--older-than", WINDOW]).await?;
    assert_eq!(out.code(), Some(1), "{}", out.text());
    for words in [
        "has no replica identity",
        "publishes deletes",
        "ALTER TABLE outbox REPLICA IDENTITY DEFAULT",
        "SET (publish = 'insert')",
        "tablename = 'outbox' AND pubdelete",
    ] {
        assert!(out.stderr.contains(words), "{words}: {}", out.text());
    }
    assert_eq!(still_there(&s.db, &events).await?, 3);

    admin
        .batch_execute("ALTER PUBLICATION audit_everything SET (publish = 'insert')")
        .await?;
    let out = prune(&s.stack, &["--older-than", WINDOW]).await?;
    assert!(out.stdout.contains("deleted 3 row(s)"), "{}", out.text());
    assert_eq!(outbox_rows(&s.db).await?, 0);
    s.finish().await
}

/// A slot lost and created again (`setup`) starts at the current WAL
/// position: rows committed while it was gone were never delivered, and
/// only `backfill` can send them. The new slot's birth bounds the proof:
/// prune deletes only rows committed after it, never those. Without its
/// birth row (a slot as an earlier version left it) prune warns that rows
/// older than the slot cannot be told apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_slot_proves_nothing_about_rows_before_it() -> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Scripted).await?;
    let before = insert_events(&s, 4, "BeforeLoss").await?;
    wait_delivered(&s, &before).await?;
    s.settle().await?;
    s.stop_relay().await?;
    let slot = s.stack.slot.clone();
    wait_until("the old slot dropped", DRAIN, || async {
        s.db.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
            .await
            .map(|_| true)
            .map_err(anyhow::Error::from)
    })
    .await?;
    let lost = insert_events(&s, 3, "WhileLost").await?;
    app::relay_setup(&s.stack).await?;
    s.restart_relay(&[]).await?;
    let after = insert_events(&s, 2, "AfterSetup").await?;
    wait_delivered(&s, &after).await?;
    s.settle().await?;
    wait_past_window(&s.db).await?;

    let done = json(&prune(&s.stack, &["--older-than", WINDOW, "--json"]).await?)?;
    assert_eq!(done["rows_deleted"], 2, "{done}");
    assert_eq!(
        still_there(&s.db, &lost).await?,
        3,
        "rows committed while the slot was gone stay for backfill"
    );
    assert_eq!(
        still_there(&s.db, &before).await?,
        4,
        "older than the slot: kept"
    );
    assert_eq!(still_there(&s.db, &after).await?, 0);
    // A slot as an earlier version left it, without its birth row: prune
    // cannot tell rows older than the slot, and says so.
    s.db.execute(
        "DELETE FROM cdc_relay_prune_mark WHERE kind = 'birth' AND slot_name = $1",
        &[&s.stack.slot],
    )
    .await?;
    let out = prune(&s.stack, &["--older-than", WINDOW, "--dry-run"]).await?;
    assert!(out.success(), "{}", out.text());
    assert!(
        out.stderr.contains(&format!(
            "warning: slot {} has no birth record",
            s.stack.slot
        )),
        "{}",
        out.stderr
    );
    s.finish().await
}

/// A range-partitioned outbox: a partition entirely older than the cutoff,
/// every row delivered, is detached and dropped (a dry run only names it);
/// the current partition's recent rows stay, and delivery goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_delivered_partition_is_detached_and_dropped() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    stack
        .orders_admin()
        .await?
        .batch_execute(&format!(
            "ALTER PUBLICATION {p} DROP TABLE outbox; \
             ALTER TABLE outbox RENAME TO outbox_plain; \
             CREATE TABLE outbox (LIKE outbox_plain INCLUDING DEFAULTS) \
               PARTITION BY RANGE (occurred_at); \
             CREATE TABLE outbox_2020 PARTITION OF outbox \
               FOR VALUES FROM ('2020-01-01 00:00+00') TO ('2021-01-01 00:00+00'); \
             CREATE TABLE outbox_current PARTITION OF outbox \
               FOR VALUES FROM ('2021-01-01 00:00+00') TO ('2200-01-01 00:00+00'); \
             GRANT SELECT, INSERT ON outbox TO orders_app; GRANT SELECT ON outbox TO cdc_relay; \
             ALTER PUBLICATION {p} ADD TABLE outbox; \
             ALTER PUBLICATION {p} SET (publish_via_partition_root = true)",
            p = stack.publication
        ))
        .await?;
    let s = Scenario::plan(Inbox::Scripted).on(stack).start().await?;
    let order = s.insert_order().await?;
    let mut old = Vec::new();
    for i in 0..5 {
        let row = s
            .db
            .query_one(
                &format!(
                    "INSERT INTO outbox (id, aggregate_id, event_type, payload, occurred_at) \
                     VALUES (gen_random_uuid(), $1, 'Old', jsonb_build_object('i', {i}), '2020-06-01 00:00+00') \
                     {}",
                    harness::oracle::expected::RETURNING
                ),
                &[&order],
            )
            .await?;
        old.push(Expected::from_row(&row));
    }
    let recent = insert_events(&s, 5, "Recent").await?;
    wait_delivered(&s, &old).await?;
    wait_delivered(&s, &recent).await?;
    s.settle().await?;

    let dry = json(&prune(&s.stack, &["--older-than", "1d", "--dry-run", "--json"]).await?)?;
    assert_eq!(
        dry["partitions_dropped"][0]["name"], "public.outbox_2020",
        "{dry}"
    );
    assert_eq!(dry["partitions_dropped"][0]["rows"], 5, "{dry}");
    assert_eq!(dry["rows_deleted"], 0, "recent rows stay: {dry}");
    assert_eq!(outbox_rows(&s.db).await?, 10, "a dry run deletes nothing");

    let out = prune(&s.stack, &["--older-than", "1d"]).await?;
    assert!(out.success(), "{}", out.text());
    assert!(
        out.stderr
            .contains("detached and dropped partition public.outbox_2020 (5 rows)"),
        "{}",
        out.text()
    );
    let gone: bool =
        s.db.query_one("SELECT to_regclass('outbox_2020') IS NULL", &[])
            .await?
            .get(0);
    assert!(gone, "the old partition is dropped");
    assert_eq!(still_there(&s.db, &recent).await?, 5);

    let after = insert_events(&s, 2, "After").await?;
    wait_delivered(&s, &after).await?;
    s.finish().await
}
