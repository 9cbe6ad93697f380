//! A partitioned outbox: read through its root (`publish_via_partition_root`),
//! where the server decides with the catalog of each change's time which
//! rows were the outbox's. A publication that streams the partitions under
//! their own names, or lists only some of them, carries nothing; a
//! partition detached later keeps the rows it had, and is not the outbox
//! after.

use harness::app;
use harness::sink::ScriptedSink;
use harness::{Inbox, PgCluster, Scenario, Stack};

use super::identity::{
    NOTICE, assert_balanced_at_sink, backfill, log_lines_naming, owed_gap_since, run_once,
};

/// A partitioned outbox published without `publish_via_partition_root`:
/// the server streams each insert under its partition's name and OID, and
/// whether a relation is a partition of the outbox then depends on when one
/// asks (a partition detached later is not; one attached later was not).
/// The relay reads a partitioned outbox only through its root, where the
/// server answers with the catalog of each change's time: `run` refuses
/// such a publication (exit 3) naming the option, `setup` sets it, and
/// every partition's event is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_outbox_published_by_leaf_is_refused_until_setup_publishes_it_through_its_root()
-> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    stack.partition_outbox().await?;
    let p = &stack.publication;
    refused_until_setup(
        &stack,
        &format!("ALTER PUBLICATION {p} SET (publish_via_partition_root = false)"),
        &[
            "carries partitions of public.outbox under their own names",
            &format!("ALTER PUBLICATION {p} SET (publish_via_partition_root = true)"),
        ],
        "set: publish_via_partition_root = true",
    )
    .await
}

/// `publish_via_partition_root` turned off while a partitioned outbox
/// streams: the partitions' inserts then stream under their own names,
/// which the relay does not read. That is the outbox leaving its
/// publication: the relay says so and what to set (never "swapped"),
/// confirms nothing further, and once the option is back the backfill it
/// names re-sends what was inserted meanwhile: every event arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_via_partition_root_turned_off_is_the_outbox_leaving_its_publication()
-> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    stack.partition_outbox().await?;
    let s = Scenario::plan(Inbox::Scripted).on(stack).start().await?;
    let p = s.stack.publication.clone();
    let agg = s.insert_order().await?;
    let mut events = Vec::new();
    for i in 0..8 {
        events.push(
            s.insert_event(agg, "Before", Some(&format!(r#"{{"i":{i}}}"#)))
                .await?,
        );
    }
    s.expect_exactly(&events).await?;

    s.db.batch_execute(&format!(
        "ALTER PUBLICATION {p} SET (publish_via_partition_root = false)"
    ))
    .await?;
    let left = s
        .relay
        .process
        .wait_for_line_where(
            "an ERROR naming the option to set",
            |l| {
                l.contains("ERROR")
                    && l.contains(&format!(
                        "ALTER PUBLICATION {p} SET (publish_via_partition_root = true)"
                    ))
            },
            NOTICE,
        )
        .await?;
    eprintln!("{left}");
    // Random ids: 8 rows land in both hash partitions but for a chance of
    // 2^-7.
    for i in 0..8 {
        s.insert_event(agg, "While", Some(&format!(r#"{{"i":{i}}}"#)))
            .await?;
    }
    s.db.batch_execute(&format!(
        "ALTER PUBLICATION {p} SET (publish_via_partition_root = true)"
    ))
    .await?;
    let since = owed_gap_since(&s.relay).await?;
    for i in 0..8 {
        s.insert_event(agg, "After", Some(&format!(r#"{{"i":{i}}}"#)))
            .await?;
    }
    backfill(&s.stack, &since, &s.sink().url).await?;
    // Every row of the outbox delivered (the backfill repeats some: the
    // inbox drops repeats).
    s.assert_balanced().await?;
    let swaps = log_lines_naming(&s.relay, "swapped");
    assert!(swaps.is_empty(), "no swap: {swaps:?}");
    s.finish().await
}

/// Applies `change` to a stack whose outbox is published, then: `run`
/// refuses the publication (exit 3) saying each of `says`; `setup`
/// succeeds saying `setup_says`; a relay started then delivers an event
/// of every partition.
async fn refused_until_setup(
    stack: &Stack,
    change: &str,
    says: &[&str],
    setup_says: &str,
) -> anyhow::Result<()> {
    let admin = stack.orders_admin().await?;
    admin.batch_execute(change).await?;
    stack.create_slot().await?;
    let sink = ScriptedSink::start().await?;
    let run = run_once(stack, &sink).await?;
    assert_eq!(run.code(), Some(3), "{}", run.text());
    for words in says {
        assert!(
            run.text().contains(words),
            "says {words:?}:\n{}",
            run.text()
        );
    }
    let setup = app::relay_command(stack, &stack.orders_admin_url, &["setup"], &[]).await?;
    assert!(setup.success(), "{}", setup.text());
    assert!(setup.text().contains(setup_says), "{}", setup.text());
    let relay = app::start_relay(stack, &sink.url, &[]).await?;
    app::wait_streaming(&relay).await?;
    // Ids are random: insert until both partitions hold an event.
    for _ in 0..64 {
        app::insert_order_event(&admin).await?;
        if both_partitions_hold_rows(&admin).await? {
            break;
        }
    }
    let n: i64 = admin
        .query_one("SELECT count(*) FROM outbox", &[])
        .await?
        .get(0);
    assert_balanced_at_sink(stack, &admin, &sink, usize::try_from(n)?).await
}

/// A publication that lists some partitions of a partitioned outbox, not
/// the table itself nor every leaf: the others' inserts would never be
/// streamed, so it carries nothing. `run` refuses it (exit 3) naming a
/// partition left out and the statement that fixes it; `setup` adds the
/// partitioned table, after which every partition's event is delivered.
/// (It counted as carrying the outbox: a tester's inserts into the other
/// partitions were never sent while status said healthy.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_of_some_partitions_carries_nothing_until_setup_adds_the_table()
-> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    stack.partition_outbox().await?;
    let p = &stack.publication;
    refused_until_setup(
        &stack,
        &format!("ALTER PUBLICATION {p} SET TABLE outbox_p0"),
        &[
            "carries partitions of public.outbox under their own names (outbox_p0)",
            &format!("ALTER PUBLICATION {p} ADD TABLE public.outbox"),
        ],
        "added: public.outbox",
    )
    .await
}

/// Four partitions listed under their own names: the refusal names three
/// and says there are more ("…"), in name order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_of_many_partitions_names_three_and_says_there_are_more() -> anyhow::Result<()>
{
    let stack = PgCluster::shared().create_stack().await?;
    stack.partition_outbox().await?;
    let p = &stack.publication;
    let admin = stack.orders_admin().await?;
    admin
        .batch_execute(&format!(
            "DROP TABLE outbox_p0, outbox_p1; \
             CREATE TABLE outbox_q3 PARTITION OF outbox FOR VALUES WITH (MODULUS 4, REMAINDER 3); \
             CREATE TABLE outbox_q1 PARTITION OF outbox FOR VALUES WITH (MODULUS 4, REMAINDER 1); \
             CREATE TABLE outbox_q0 PARTITION OF outbox FOR VALUES WITH (MODULUS 4, REMAINDER 0); \
             CREATE TABLE outbox_q2 PARTITION OF outbox FOR VALUES WITH (MODULUS 4, REMAINDER 2); \
             ALTER PUBLICATION {p} SET TABLE outbox_q3, outbox_q1, outbox_q0, outbox_q2"
        ))
        .await?;
    stack.create_slot().await?;
    let sink = ScriptedSink::start().await?;
    let run = run_once(&stack, &sink).await?;
    assert_eq!(run.code(), Some(3), "{}", run.text());
    assert!(
        run.text()
            .contains("under their own names (outbox_q0, outbox_q1, outbox_q2, …)"),
        "{}",
        run.text()
    );
    Ok(())
}

/// A partition detached while the relay is stopped, with events of it not
/// yet delivered, then published in its own right (a `TABLES IN SCHEMA`
/// publication would do the same) and written to directly: the events it
/// had as a partition are delivered, its later row is not the outbox's and
/// is not sent, and nothing says "swapped". (Streamed under the partitions'
/// names, the relay asked the catalog of the moment whether a relation was
/// a partition of the outbox: after the detach the events were skipped,
/// and while a session ran the later row was sent.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_detached_keeps_its_events_and_is_not_the_outbox_after() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    stack.partition_outbox().await?;
    let mut s = Scenario::plan(Inbox::Scripted).on(stack).start().await?;
    let agg = s.insert_order().await?;
    let first = s.insert_event(agg, "Streamed", Some(r#"{"i":0}"#)).await?;
    s.expect_exactly(std::slice::from_ref(&first)).await?;
    s.stop_relay().await?;
    // Random ids: insert until the partition to detach holds an event.
    let mut held = 0;
    for i in 1..64 {
        s.insert_event(agg, "BeforeDetach", Some(&format!(r#"{{"i":{i}}}"#)))
            .await?;
        held =
            s.db.query_one("SELECT count(*) FROM outbox_p1", &[])
                .await?
                .get::<_, i64>(0);
        if held > 0 && i >= 4 {
            break;
        }
    }
    assert!(held > 0, "outbox_p1 holds an event");
    let p = &s.stack.publication;
    s.db.batch_execute(&format!(
        "ALTER TABLE outbox DETACH PARTITION outbox_p1; \
         ALTER PUBLICATION {p} ADD TABLE outbox_p1; \
         INSERT INTO outbox_p1 (id, aggregate_id, event_type, payload) \
           VALUES ('00000000-0000-0000-0000-0000000000b2', gen_random_uuid(), 'NotOutbox', '{{}}')"
    ))
    .await?;
    s.restart_relay(&[]).await?;
    // Every row still in the outbox and every row outbox_p1 had before the
    // detach (all of the events), and not the row written after it.
    let n: i64 =
        s.db.query_one(
            "SELECT (SELECT count(*) FROM outbox) + (SELECT count(*) FROM outbox_p1) - 1",
            &[],
        )
        .await?
        .get(0);
    let n = usize::try_from(n)?;
    harness::wait_until(&format!("{n} events delivered"), NOTICE, || async {
        s.sink().delivered().len() >= n
    })
    .await?;
    s.settle().await?;
    let ids: Vec<String> = s
        .sink()
        .delivered()
        .iter()
        .map(|r| r.id().to_string())
        .collect();
    assert!(
        !ids.iter()
            .any(|i| i == "00000000-0000-0000-0000-0000000000b2"),
        "the detached table's own row is not sent: {ids:?}"
    );
    let mut unique = ids.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), n, "every event once or more: {ids:?}");
    let swaps = log_lines_naming(&s.relay, "swapped");
    assert!(swaps.is_empty(), "no swap: {swaps:?}");
    s.finish().await
}

/// Rows of a partitioned outbox written while its publication did not
/// publish via the partition root, before any relay ran (the previous
/// `sql/publication.sql` made it so): the stream carries them under the
/// partitions' names. Once the option is set and the relay runs, each is
/// dead-lettered with the cause (never sent as an event, never dropped),
/// and `dead-letter replay --reason 'partition root'` delivers them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_streamed_under_partition_names_are_dead_lettered_not_dropped() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    stack.partition_outbox().await?;
    let admin = stack.orders_admin().await?;
    let p = &stack.publication;
    admin
        .batch_execute(&format!(
            "ALTER PUBLICATION {p} SET (publish_via_partition_root = false)"
        ))
        .await?;
    stack.create_slot().await?;
    // Random ids: insert until both partitions hold a row.
    for _ in 0..64 {
        app::insert_order_event(&admin).await?;
        if both_partitions_hold_rows(&admin).await? {
            break;
        }
    }
    let written: i64 = admin
        .query_one("SELECT count(*) FROM outbox", &[])
        .await?
        .get(0);
    admin
        .batch_execute(&format!(
            "ALTER PUBLICATION {p} SET (publish_via_partition_root = true)"
        ))
        .await?;
    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay(&stack, &sink.url, &[]).await?;
    app::wait_streaming(&relay).await?;
    harness::wait_until(&format!("{written} rows dead-lettered"), NOTICE, || async {
        let n: i64 = admin
            .query_one(
                "SELECT count(*) FROM cdc_relay_dead_letter WHERE error LIKE '%partition root%'",
                &[],
            )
            .await?
            .get(0);
        anyhow::Ok(n == written)
    })
    .await?;
    assert!(sink.received().is_empty(), "none sent as an event");
    relay
        .process
        .wait_for_line_where(
            "a WARN naming the partition set aside",
            |l| l.contains("WARN") && l.contains("streams under its own name"),
            NOTICE,
        )
        .await?;
    let out = crate::sink_failures::cli(
        &stack,
        &["dead-letter", "replay", "--reason", "partition root"],
        &sink.url,
    )
    .await?;
    assert!(out.success(), "{}", out.text());
    let ids: std::collections::BTreeSet<String> = sink.received().iter().map(|r| r.id()).collect();
    assert_eq!(ids.len(), usize::try_from(written)?, "every row replayed");
    Ok(())
}

/// A partitioned outbox renamed while the relay streams it: the server
/// streams its partitions' inserts through the root's OID and never
/// describes the root again under its new name, so the stream cannot see
/// the rename. The slot monitor does: `--table` names nothing, the
/// outbox's OID has another name. The relay stops (exit 5) naming it (what
/// it delivered meanwhile was the renamed table's), and with `--table` set
/// to the new name every event arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_outbox_renamed_while_streaming_stops_the_relay_naming_it()
-> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    stack.partition_outbox().await?;
    let mut s = Scenario::plan(Inbox::Scripted)
        .relay_args(&["--slot-stats-interval", "1s"])
        .on(stack)
        .start()
        .await?;
    let agg = s.insert_order().await?;
    // Both partitions described to the stream before the rename (random
    // ids: insert until both hold an event), so that no insert after it
    // is the first of its partition, whose description would carry the
    // new name.
    let mut before = Vec::new();
    for i in 0..64 {
        before.push(
            s.insert_event(agg, "BeforeRename", Some(&format!(r#"{{"i":{i}}}"#)))
                .await?,
        );
        if both_partitions_hold_rows(&s.db).await? {
            break;
        }
    }
    s.expect_exactly(&before).await?;
    s.db.batch_execute("ALTER TABLE outbox RENAME TO outbox_v2")
        .await?;
    let renamed = s
        .insert_event_into("outbox_v2", agg, "AfterRename", Some(r#"{"r":1}"#))
        .await?;
    let status = s.relay.process.wait_exit(NOTICE).await?;
    let stderr = s.relay.process.stderr();
    assert_eq!(status.code(), Some(5), "exit code 5:\n{stderr}");
    for words in ["renamed", "public.outbox_v2", "--table public.outbox_v2"] {
        assert!(stderr.contains(words), "stderr names {words:?}:\n{stderr}");
    }
    s.restart_relay(&["--table", "public.outbox_v2", "--slot-stats-interval", "1s"])
        .await?;
    harness::wait_until("the event after the rename delivered", NOTICE, || async {
        s.sink().delivered().iter().any(|r| r.id() == renamed.id)
    })
    .await?;
    s.accounting(&["outbox_v2"]).await?.assert_balanced();
    s.finish().await
}

/// `--table` naming a partition: no outbox of its own (its rows stream as
/// the root's), so `setup` (exit 1) and `run` (exit 3) refuse it naming the root to
/// set instead. (`setup` made a slot and a publication for it, and `run`
/// then asked for an `ALTER PUBLICATION … ADD TABLE` that fails.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_named_as_the_outbox_is_refused_naming_the_root() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    stack.partition_outbox().await?;
    stack.create_slot().await?;
    let sink = ScriptedSink::start().await?;
    for (url, args) in [
        (
            &stack.orders_admin_url,
            vec!["setup", "--table", "public.outbox_p0"],
        ),
        (
            &stack.relay_url,
            vec![
                "run",
                "--table",
                "public.outbox_p0",
                "--sink-url",
                &sink.url,
            ],
        ),
    ] {
        let out = app::relay_command(
            &stack,
            url,
            &args,
            &[("EVENT_SECRET", harness::app::TEST_SECRET)],
        )
        .await?;
        // setup's failures exit 1, run's "needs setup" 3.
        let code = if args[0] == "run" { 3 } else { 1 };
        assert_eq!(out.code(), Some(code), "{args:?}: {}", out.text());
        assert!(
            out.text()
                .contains("public.outbox_p0 is a partition of public.outbox")
                && out
                    .text()
                    .contains("set --table (CDC_RELAY_TABLE) to public.outbox"),
            "{args:?}: {}",
            out.text()
        );
    }
    Ok(())
}

/// Whether both partitions of the stack's hash-partitioned outbox
/// (`Stack::partition_outbox`) hold a row.
async fn both_partitions_hold_rows(db: &tokio_postgres::Client) -> anyhow::Result<bool> {
    let partitions: i64 = db
        .query_one("SELECT count(DISTINCT tableoid) FROM outbox", &[])
        .await?
        .get(0);
    Ok(partitions == 2)
}
