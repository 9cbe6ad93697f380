//! Which relation is the outbox, and whether the stream still carries it
//! (issue 12, "Relation identity and publication membership"): a rename
//! and a table swap while streaming, the outbox dropped and recreated or
//! taken out of a `FOR TABLE` publication (and a flap faster than the
//! membership check), a slot created before its publication, two
//! publications both carrying the outbox, and other published tables.
//!
//! The rule under test: every change the server streams for a relation that
//! is (or was) the configured outbox is delivered, dead-lettered, or stops
//! the relay before its transaction is acknowledged. A refusal is proven by
//! [`Scenario::wait_refusal`] (the slot never reaches the refused commit)
//! and by peeking at the inactive slot ([`Scenario::assert_held`]); a
//! membership gap, which no slot position can bring back on PostgreSQL 15
//! (pgoutput judges membership as of each change), by `backfill` and the
//! balanced ledger.
//!
//! What PostgreSQL 15 streams in these cases (peeked with pgoutput,
//! protocol 1): a rename re-sends a Relation message with the same OID and
//! the new name before the next insert; a swap sends the new table's OID
//! under the old name, and the old OID under its new name; an outbox
//! dropped and recreated, or dropped from the publication, is simply
//! absent: its inserts are not streamed at all (not even an empty
//! transaction), and the walsender reports no error.

use std::time::{Duration, Instant};

use harness::app::{self, CommandOutput, Running, TEST_SECRET};
use harness::oracle::{self, Ledger, slot_position};
use harness::sink::ScriptedSink;
use harness::{Inbox, PgCluster, Scenario, Stack, wait_until};

/// Bound for the relay to notice a membership change: the slot monitor
/// runs every 15 s (`--slot-stats-interval`), plus a margin.
pub(super) const NOTICE: Duration = Duration::from_secs(30);

/// Bound for deliveries and the ledger.
pub(super) const DRAIN: Duration = Duration::from_secs(45);

/// The gauge that says whether the configured outbox is in the publication.
const INCLUDES: &str = "cdc_relay_publication_includes_outbox";

/// The counter of membership gaps (the outbox left and rejoined).
const GAPS: &str = "cdc_relay_publication_gaps_total";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renamed_outbox_stops_the_relay_unacknowledged_and_new_table_flag_delivers_it()
-> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Scripted).await?;
    let agg = s.insert_order().await?;
    let first = s
        .insert_event(agg, "BeforeRename", Some(r#"{"r":0}"#))
        .await?;
    s.expect_exactly(std::slice::from_ref(&first)).await?;

    s.db.batch_execute("ALTER TABLE outbox RENAME TO outbox_v2")
        .await?;
    // Before any insert says so, the monitor finds no table by that name:
    // not ready, and the log says why.
    wait_until(
        "/readyz fails after the rename",
        Duration::from_secs(60),
        || async {
            let (code, _) = s.relay.get("/readyz").await?;
            anyhow::Ok(code == 503)
        },
    )
    .await?;
    s.relay
        .process
        .wait_for_line(
            "does not exist (renamed or dropped?)",
            Duration::from_secs(10),
        )
        .await?;
    let renamed = s
        .insert_event_into("outbox_v2", agg, "AfterRename", Some(r#"{"r":1}"#))
        .await?;
    let after = oracle::wal_position(&s.db).await?;
    let status = s.wait_refusal(after).await?;
    let stderr = s.relay.process.stderr();
    assert_eq!(status.code(), Some(5), "exit code 5:\n{stderr}");
    for words in ["renamed", "public.outbox_v2", "--table public.outbox_v2"] {
        assert!(stderr.contains(words), "stderr names {words:?}:\n{stderr}");
    }
    assert_eq!(s.sink().arrivals(), 1, "nothing sent for the renamed table");
    // The refused insert is still in the slot: the next session gets it.
    s.assert_held(&["outbox_v2"]).await?;

    s.restart_relay(&["--table", "public.outbox_v2"]).await?;
    s.expect_exactly(&[first, renamed]).await?;
    s.accounting(&["outbox_v2"]).await?.assert_balanced();
    s.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapped_outbox_is_followed_both_ways_and_a_restart_does_not_wedge() -> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Scripted).await?;
    s.db.batch_execute(&format!(
        "CREATE TABLE outbox_new (LIKE outbox INCLUDING ALL); \
         GRANT SELECT ON outbox_new TO cdc_relay; \
         ALTER PUBLICATION {} ADD TABLE outbox_new",
        s.stack.publication
    ))
    .await?;
    let agg = s.insert_order().await?;
    let mut expected = vec![
        s.insert_event(agg, "BeforeSwap", Some(r#"{"w":0}"#))
            .await?,
    ];
    s.db.batch_execute(
        "BEGIN; ALTER TABLE outbox RENAME TO outbox_old; \
         ALTER TABLE outbox_new RENAME TO outbox; COMMIT",
    )
    .await?;
    expected.push(s.insert_event(agg, "NewTable", Some(r#"{"w":1}"#)).await?);
    // An application still writing to the former outbox is not lost.
    expected.push(
        s.insert_event_into("outbox_old", agg, "OldTable", Some(r#"{"w":2}"#))
            .await?,
    );
    expected.push(s.insert_event(agg, "NewTable", Some(r#"{"w":3}"#)).await?);
    s.expect_exactly(&expected).await?;
    let logs = s.relay.process.logs();
    assert!(logs.contains("was swapped"), "says it was swapped:\n{logs}");

    // A restart replays nothing new and does not stop on the old name.
    s.stop_relay().await?;
    s.restart_relay(&[]).await?;
    let later = s
        .insert_event(agg, "AfterRestart", Some(r#"{"w":4}"#))
        .await?;
    expected.push(later);
    s.expect_exactly(&expected).await?;
    s.settle().await?;
    s.accounting(&["outbox", "outbox_old"])
        .await?
        .assert_balanced();
    Ok(())
}

/// The outbox as `sql/orders.sql` defines it, without the foreign key, and
/// readable by the relay's role (backfill reads it).
const OUTBOX_AGAIN: &str = "CREATE TABLE outbox (
    id uuid PRIMARY KEY, aggregate_id uuid NOT NULL, event_type text NOT NULL,
    payload jsonb NOT NULL, occurred_at timestamptz NOT NULL DEFAULT now(),
    available_at timestamptz NOT NULL DEFAULT now(), attempts integer NOT NULL DEFAULT 0,
    claimed_by text, lease_until timestamptz, published_at timestamptz, trace_context text);
    GRANT SELECT ON outbox TO cdc_relay";

/// How the outbox leaves its `FOR TABLE` publication.
#[derive(Debug, Clone, Copy)]
enum Leave {
    /// `DROP TABLE outbox; CREATE TABLE outbox (…)` in one transaction
    /// (copying the rows over).
    DropAndCreate,
    /// `ALTER PUBLICATION … DROP TABLE outbox`.
    DropFromPublication,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_dropped_and_recreated_outside_the_publication_is_noticed_and_held()
-> anyhow::Result<()> {
    outbox_leaves_the_publication(Leave::DropAndCreate).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_dropped_from_the_publication_is_noticed_and_held() -> anyhow::Result<()> {
    outbox_leaves_the_publication(Leave::DropFromPublication).await
}

/// The outbox leaves the publication, one event is committed while it is
/// out, the operator re-adds it and backfills: the relay must have said so
/// (error, `/readyz`, gauge), held its position meanwhile, and nothing is
/// lost in the end.
async fn outbox_leaves_the_publication(how: Leave) -> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Billing).await?;
    let (stack, db, relay) = (&s.stack, &s.db, &s.relay);
    db.batch_execute("CREATE TABLE scratch_wal (id bigserial PRIMARY KEY, filler text)")
        .await?;
    wait_until(&format!("{INCLUDES} 1 while healthy"), NOTICE, || async {
        relay.gauge(INCLUDES).await.map(|v| v == Some(1.0))
    })
    .await?;
    app::insert_order_event(db).await?;
    oracle::wait_ledger_clean(stack, 1, DRAIN).await?;

    let leave = match how {
        // A rebuild that keeps the rows, as an operator would.
        Leave::DropAndCreate => format!(
            "BEGIN; CREATE TEMP TABLE kept AS SELECT * FROM outbox; DROP TABLE outbox; \
             {OUTBOX_AGAIN}; INSERT INTO outbox SELECT * FROM kept; COMMIT"
        ),
        Leave::DropFromPublication => {
            format!("ALTER PUBLICATION {} DROP TABLE outbox", stack.publication)
        }
    };
    db.batch_execute(&leave).await?;
    let since = now(db).await?;
    let while_out = app::insert_order_event(db).await?;

    // All three within NOTICE of the insert.
    let left = Instant::now();
    let error = relay
        .process
        .wait_for_line_where(
            "an ERROR naming the publication and backfill",
            |l| l.contains("ERROR") && l.contains("publication") && l.contains("backfill"),
            NOTICE,
        )
        .await?;
    eprintln!("{how:?}: {error}");
    wait_until(
        &format!("{INCLUDES} 0"),
        NOTICE.saturating_sub(left.elapsed()),
        || async { relay.gauge(INCLUDES).await.map(|v| v == Some(0.0)) },
    )
    .await?;
    wait_until(
        "/readyz 503 naming the publication",
        NOTICE.saturating_sub(left.elapsed()),
        || async {
            let (status, body) = relay.get("/readyz").await?;
            anyhow::Ok(status == 503 && body.contains("publication"))
        },
    )
    .await?;

    // Time is the subject: for a few status intervals (1 s each) while
    // WAL is written elsewhere, the confirmed position stays where the
    // membership was last verified. The relay holds it the moment it
    // notices; the server learns the held position with the next status
    // update, within one status interval: read it after two.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let held = slot_position(db, &stack.slot).await?.confirmed;
    for _ in 0..8 {
        db.batch_execute(
            "INSERT INTO scratch_wal (filler) SELECT repeat('x', 500) FROM generate_series(1, 200)",
        )
        .await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = slot_position(db, &stack.slot).await?;
        assert_eq!(
            now.confirmed, held,
            "confirmed_flush_lsn advanced while the outbox is out of the publication \
             (WAL is at {})",
            now.current
        );
    }
    assert!(
        slot_position(db, &stack.slot).await?.current > held,
        "WAL was written past the held position"
    );

    // One more row inserted just before the table is back, in the same
    // round trip: the owed window must end after it, to the microsecond.
    // (Broken before: the window's end was cut to whole seconds, and a
    // row of that second fell outside the backfill it printed.)
    let late = uuid::Uuid::new_v4();
    let late_order = uuid::Uuid::new_v4();
    db.batch_execute(&format!(
        "BEGIN; \
         INSERT INTO orders (id, amount_cents, currency) VALUES ('{late_order}', 250, 'EUR'); \
         INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES ('{late}', '{late_order}', \
           'OrderCreated', jsonb_build_object('order_id', '{late_order}'::uuid, 'amount_cents', 250, 'currency', 'EUR')); \
         COMMIT; \
         ALTER PUBLICATION {} ADD TABLE outbox",
        stack.publication
    ))
    .await?;
    wait_until(&format!("{INCLUDES} back to 1"), NOTICE, || async {
        relay.gauge(INCLUDES).await.map(|v| v == Some(1.0))
    })
    .await?;
    // Delivery resumes, but the rows inserted while out are owed a
    // backfill: /readyz keeps failing and `status` names the command,
    // across a restart too. (Broken before: /readyz answered 200 again at
    // once, and a restart forgot the gap.)
    app::insert_order_event(db).await?;
    wait_until("the event after the re-add invoiced", DRAIN, || async {
        Ledger::read(stack).await.map(|l| l.invoices == 2)
    })
    .await?;
    let ledger = Ledger::read(stack).await?;
    assert_eq!(
        ledger.lost, 2,
        "only the events committed while out: {ledger:?}"
    );
    let (status, body) = relay.get("/readyz").await?;
    assert!(
        status == 503 && body.contains("backfill"),
        "{status} {body}"
    );
    s.restart_relay(&[]).await?;
    let (stack, relay) = (&s.stack, &s.relay);
    wait_until(
        "/readyz 503 naming the owed backfill after a restart",
        NOTICE,
        || async {
            let (status, body) = relay.get("/readyz").await?;
            anyhow::Ok(status == 503 && body.contains("backfill"))
        },
    )
    .await?;
    let out = app::relay_command(stack, &stack.relay_url, &["status"], &[]).await?;
    assert!(!out.success(), "{}", out.text());
    // The command `status` gives, run as given.
    let text = out.text();
    let command = text
        .split('`')
        .find(|c| c.starts_with("cdc-relay backfill --since"))
        .unwrap_or_else(|| panic!("status names the backfill: {text}"));
    let quoted: Vec<&str> = command.split('\'').collect();
    let (owed_since, owed_until) = (quoted[1], quoted[3]);
    // It starts --backfill-margin (5 minutes by default) before the
    // outbox was last seen in: a transaction that began before the leave
    // and inserted during it has its row's time there. (Broken before:
    // the printed window started at the last reading, and such a row was
    // outside it.)
    let margin: bool =
        s.db.query_one(
            "SELECT $1::text::timestamptz <= $2::text::timestamptz - interval '4 minutes'",
            &[&owed_since, &since],
        )
        .await?
        .get(0);
    assert!(margin, "owed from {owed_since}, left at {since}");
    // A backfill of another table does not clear it.
    s.db.batch_execute("CREATE TABLE other_outbox (LIKE outbox INCLUDING ALL); GRANT SELECT ON other_outbox TO cdc_relay")
        .await?;
    let out = app::relay_command(
        stack,
        &stack.relay_url,
        &[
            "backfill",
            "--table",
            "public.other_outbox",
            &format!("--since={owed_since}"),
        ],
        &[
            ("CDC_RELAY_SINK_URL", &s.billing().inbox()),
            ("EVENT_SECRET", TEST_SECRET),
        ],
    )
    .await?;
    assert!(
        out.success() && !out.text().contains("cleared"),
        "{}",
        out.text()
    );
    backfill_window(stack, owed_since, Some(owed_until), &s.billing().inbox()).await?;
    oracle::wait_ledger_clean(stack, 4, DRAIN).await?;
    wait_until(
        "/readyz 200 once a backfill covered the gap",
        NOTICE,
        || async { relay.get("/readyz").await.map(|(status, _)| status == 200) },
    )
    .await?;
    let out = app::relay_command(stack, &stack.relay_url, &["status"], &[]).await?;
    assert!(
        out.success(),
        "{}\nthe relay's log:\n{}",
        out.text(),
        relay.process.logs()
    );
    let accounting = s.accounting(&["outbox"]).await?;
    assert!(accounting.delivered.contains(&while_out.to_string()));
    accounting.assert_balanced();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publication_flap_faster_than_the_check_is_reported_as_a_gap() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Billing).await?;
    let (stack, db, relay) = (&s.stack, &s.db, &s.relay);
    app::insert_order_event(db).await?;
    oracle::wait_ledger_clean(stack, 1, DRAIN).await?;

    let since = now(db).await?;
    let flap = Instant::now();
    db.batch_execute(&format!(
        "ALTER PUBLICATION {} DROP TABLE outbox",
        stack.publication
    ))
    .await?;
    app::insert_order_event(db).await?;
    db.batch_execute(&format!(
        "ALTER PUBLICATION {} ADD TABLE outbox",
        stack.publication
    ))
    .await?;
    let took = flap.elapsed();
    assert!(took < Duration::from_secs(1), "the flap took {took:?}");

    let error = relay
        .process
        .wait_for_line_where(
            "an ERROR saying the outbox left the publication and was added back, naming backfill",
            |l| {
                l.contains("ERROR")
                    && l.contains(&format!(
                        "left publication {} and was added back",
                        stack.publication
                    ))
                    && l.contains("backfill")
            },
            NOTICE,
        )
        .await?;
    eprintln!("flap: {error}");
    wait_until(&format!("{GAPS} >= 1"), NOTICE, || async {
        let m = relay.metrics().await?;
        anyhow::Ok(m.sum(GAPS) >= 1.0)
    })
    .await?;

    app::insert_order_event(db).await?;
    wait_until("the event after the flap invoiced", DRAIN, || async {
        Ledger::read(stack).await.map(|l| l.invoices == 2)
    })
    .await?;
    backfill(stack, &since, &s.billing().inbox()).await?;
    oracle::wait_ledger_clean(stack, 3, DRAIN).await?;
    s.accounting(&["outbox"]).await?.assert_balanced();
    Ok(())
}

/// Runs `cdc-relay backfill --since <since>` as the relay role into `inbox`.
pub(super) async fn backfill(stack: &Stack, since: &str, inbox: &str) -> anyhow::Result<()> {
    backfill_window(stack, since, None, inbox).await
}

/// Runs `cdc-relay backfill --since <since> [--until <until>]` as the
/// relay role into `inbox`.
async fn backfill_window(
    stack: &Stack,
    since: &str,
    until: Option<&str>,
    inbox: &str,
) -> anyhow::Result<()> {
    let mut args = vec!["backfill".to_owned(), format!("--since={since}")]; // "-infinity" is a value, not a flag
    args.extend(until.map(|u| format!("--until={u}")));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = app::relay_command(
        stack,
        &stack.relay_url,
        &args,
        &[("CDC_RELAY_SINK_URL", inbox), ("EVENT_SECRET", TEST_SECRET)],
    )
    .await?;
    assert!(out.success(), "backfill: {}", out.text());
    Ok(())
}

/// The database's `now()` as text, for `backfill --since`.
async fn now(db: &tokio_postgres::Client) -> anyhow::Result<String> {
    Ok(db.query_one("SELECT now()::text", &[]).await?.get(0))
}

/// `cdc-relay run` as a command (as the relay role) until it exits.
pub(super) async fn run_once(stack: &Stack, sink: &ScriptedSink) -> anyhow::Result<CommandOutput> {
    app::relay_command(
        stack,
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
    .await
}

/// The stack's slot created by hand while its publication does not exist.
async fn slot_before_publication(stack: &Stack) -> anyhow::Result<tokio_postgres::Client> {
    let db = stack.orders_admin().await?;
    db.batch_execute(&format!("DROP PUBLICATION {}", stack.publication))
        .await?;
    db.execute(
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&stack.slot],
    )
    .await?;
    Ok(db)
}

/// The slot's WAL predates its publication. That breaks the stream only
/// once a change committed between the slot and the publication must be
/// decoded; without such a change it streams normally. So one event is
/// committed in between, as an outbox in use would: it can only come back
/// through `backfill`.
///
/// How the server meets that change differs. PostgreSQL 15–17: the
/// walsender fails with `ERROR: publication "…" does not exist` (42704),
/// although it exists. PostgreSQL 18: it logs `WARNING: skipped loading
/// publication "…"` (55000, "The publication does not exist at this point
/// in the WAL"), decodes the change as unpublished and streams on: the
/// event is skipped without an error. On every version the relay must say
/// so (exit 6) rather than stream past it. `status` runs first: it answers
/// at once where `run` would stream until the command timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_older_than_its_publication_is_diagnosed_by_run_and_status() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let db = slot_before_publication(&stack).await?;
    let created = slot_position(&db, &stack.slot).await?.confirmed;
    app::insert_order_event(&db).await?;
    db.batch_execute(&format!(
        "CREATE PUBLICATION {} FOR TABLE outbox WITH (publish = 'insert')",
        stack.publication
    ))
    .await?;
    app::insert_order_event(&db).await?;
    let sink = ScriptedSink::start().await?;

    let status = app::relay_command(&stack, &stack.relay_url, &["status"], &[]).await?;
    assert_eq!(status.code(), Some(6), "status exits 6:\n{}", status.text());
    let run = run_once(&stack, &sink).await?;
    assert_eq!(run.code(), Some(6), "run exits 6:\n{}", run.text());
    for (command, text) in [("run", run.stderr.clone()), ("status", status.text())] {
        for words in [
            stack.slot.as_str(),
            "did not exist at that point",
            "--recreate-slot",
            "pg_replication_slot_advance",
            "backfill",
        ] {
            assert!(text.contains(words), "{command} says {words:?}:\n{text}");
        }
    }
    assert_eq!(sink.arrivals(), 0, "nothing was sent");
    assert_eq!(
        slot_position(&db, &stack.slot).await?.confirmed,
        created,
        "the slot did not move"
    );

    // The steps the message gives recover every event.
    let recreate = app::relay_command(
        &stack,
        &stack.orders_admin_url,
        &["setup", "--recreate-slot"],
        &[],
    )
    .await?;
    assert!(recreate.success(), "{}", recreate.text());
    let relay = app::start_relay(&stack, &sink.url, &[]).await?;
    app::wait_streaming(&relay).await?;
    backfill(&stack, "-infinity", &sink.url).await?;
    app::insert_order_event(&db).await?;
    assert_balanced_at_sink(&stack, &db, &sink, 3).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_refuses_to_adopt_a_slot_older_than_the_publication_it_creates() -> anyhow::Result<()>
{
    let stack = PgCluster::shared().create_stack().await?;
    let db = slot_before_publication(&stack).await?;
    let out = app::relay_command(&stack, &stack.orders_admin_url, &["setup"], &[]).await?;
    assert!(
        !out.success(),
        "setup adopted the older slot:\n{}",
        out.text()
    );
    for words in ["--recreate-slot", "backfill"] {
        assert!(out.text().contains(words), "{words:?}:\n{}", out.text());
    }
    let published: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_publication_tables WHERE pubname = $1 AND tablename = 'outbox'",
            &[&stack.publication],
        )
        .await?
        .get(0);
    assert_eq!(published, 1, "setup created the publication first");

    let recreate = app::relay_command(
        &stack,
        &stack.orders_admin_url,
        &["setup", "--recreate-slot"],
        &[],
    )
    .await?;
    assert!(recreate.success(), "{}", recreate.text());
    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay(&stack, &sink.url, &[]).await?;
    app::wait_streaming(&relay).await?;
    app::insert_order_event(&db).await?;
    assert_balanced_at_sink(&stack, &db, &sink, 1).await
}

/// Waits for `n` events at `sink`, settles the stack's slot, and asserts
/// the ledger balances against what the sink took.
pub(super) async fn assert_balanced_at_sink(
    stack: &Stack,
    db: &tokio_postgres::Client,
    sink: &ScriptedSink,
    n: usize,
) -> anyhow::Result<()> {
    wait_until(&format!("{n} events delivered"), DRAIN, || async {
        oracle::Accounting::read(db, &["outbox"], oracle::arrival_ids(&sink.delivered()))
            .await
            .map(|a| a.delivered.len() >= n)
    })
    .await?;
    oracle::settle(db, &stack.slot).await?;
    let accounting =
        oracle::Accounting::read(db, &["outbox"], oracle::arrival_ids(&sink.delivered())).await?;
    assert_eq!(accounting.rows.len(), n);
    accounting.assert_balanced();
    Ok(())
}

/// A schema added to the carrying publication beside the outbox's own
/// listing (`ADD TABLES IN SCHEMA` writes no row of `pg_publication`) keeps
/// the outbox carried: the relay records the new listing and reports no
/// gap. Setting an option, even to its value, is a possible gap (the
/// catalog cannot tell it from `publish` off and back), named as such.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_added_beside_the_outbox_is_no_gap_and_an_altered_publication_is_named()
-> anyhow::Result<()> {
    let s = Scenario::plan(Inbox::Scripted)
        .relay_args(&["--slot-stats-interval", "1s"])
        .start()
        .await?;
    let recorded = || async {
        let row =
            s.db.query_opt(
                "SELECT membership_carriers::text FROM cdc_relay_progress WHERE slot_name = $1",
                &[&s.stack.slot],
            )
            .await?;
        anyhow::Ok(row.and_then(|r| r.get::<_, Option<String>>(0)))
    };
    wait_until("the membership recorded", NOTICE, || async {
        Ok(recorded().await?.is_some())
    })
    .await?;
    let before = recorded().await?;
    let p = &s.stack.publication;
    s.db.batch_execute(&format!(
        "ALTER PUBLICATION {p} ADD TABLES IN SCHEMA public"
    ))
    .await?;
    wait_until("the new listing recorded", NOTICE, || async {
        Ok(recorded().await? != before)
    })
    .await?;
    assert_eq!(s.relay.metrics().await?.sum(GAPS), 0.0, "no gap");

    s.db.batch_execute(&format!("ALTER PUBLICATION {p} SET (publish = 'insert')"))
        .await?;
    let gap = s
        .relay
        .process
        .wait_for_line_where(
            "an ERROR naming the altered publication",
            |l| l.contains("ERROR") && l.contains("membership changed"),
            NOTICE,
        )
        .await?;
    assert!(
        gap.contains(&format!("publication {p} was altered")),
        "{gap}"
    );
    assert_eq!(s.relay.metrics().await?.sum(GAPS), 1.0, "one gap");
    s.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_publications_carrying_the_outbox_stream_each_event_once() -> anyhow::Result<()> {
    let mut stack = PgCluster::shared().create_stack().await?;
    let second = format!("{}_b", stack.publication);
    stack
        .orders_admin()
        .await?
        .batch_execute(&format!(
            "CREATE PUBLICATION {second} FOR TABLE outbox WITH (publish = 'insert')"
        ))
        .await?;
    stack.publication = format!("{},{second}", stack.publication);
    let s = Scenario::plan(Inbox::Scripted).on(stack).start().await?;
    let agg = s.insert_order().await?;
    let event = s.insert_event(agg, "TwoPublications", Some("{}")).await?;
    s.expect_exactly(&[event]).await?;
    assert_eq!(
        s.relay.metrics().await?.sum("cdc_relay_reconnects_total"),
        0.0,
        "one session, no reconnect loop:\n{}",
        s.relay.process.logs()
    );
    assert_eq!(app::sessions(&s.relay), 1);
    s.assert_balanced().await?;
    s.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_published_tables_are_counted_and_logged_once() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    s.db.batch_execute(&format!(
        "CREATE TABLE audit_log (id bigserial PRIMARY KEY, note text); \
         ALTER PUBLICATION {} ADD TABLE audit_log",
        s.stack.publication
    ))
    .await?;
    for i in 0..3 {
        s.db.execute(
            "INSERT INTO audit_log (note) VALUES ($1)",
            &[&format!("a{i}")],
        )
        .await?;
    }
    let agg = s.insert_order().await?;
    s.db.batch_execute("BEGIN").await?;
    let event = s.insert_event(agg, "WithAudit", Some("{}")).await?;
    s.db.batch_execute("INSERT INTO audit_log (note) VALUES ('in the same transaction'); COMMIT")
        .await?;
    let event_id = event.id.clone();
    s.expect_exactly(&[event]).await?;

    let ignored = s.relay.metrics().await?.value(
        "cdc_relay_ignored_changes_total",
        &[("relation", "public.audit_log")],
    );
    assert_eq!(ignored, Some(4.0), "every audit_log insert counted");
    let lines = log_lines_naming(&s.relay, "public.audit_log");
    assert_eq!(lines.len(), 1, "logged once, not per change: {lines:#?}");
    assert!(
        s.sink().received().iter().all(|r| r.id() == event_id),
        "nothing but the outbox event was posted"
    );
    s.assert_balanced().await?;
    s.finish().await
}

/// The relay's log lines at INFO or above (what an operator sees by
/// default; the tests run it at debug) that contain `words`.
/// Waits for the owed gap's ERROR and returns its backfill's `--since`.
pub(super) async fn owed_gap_since(relay: &Running) -> anyhow::Result<String> {
    let owed = relay
        .process
        .wait_for_line_where(
            "an ERROR with the owed gap's backfill",
            |l| l.contains("ERROR") && l.contains("cdc-relay backfill --since '"),
            NOTICE,
        )
        .await?;
    Ok(owed
        .split("--since '")
        .nth(1)
        .and_then(|rest| rest.split('\'').next())
        .expect("the message carries --since '<time>'")
        .to_owned())
}

pub(super) fn log_lines_naming(relay: &Running, words: &str) -> Vec<String> {
    relay
        .process
        .logs()
        .lines()
        .filter(|l| l.contains(words) && !l.contains(" DEBUG ") && !l.contains(" TRACE "))
        .map(str::to_owned)
        .collect()
}

/// A row filter added to the only publication while streaming: the
/// publication no longer carries every insert, so it stops counting — the
/// relay says which publication and what to change, `/readyz` fails, and a
/// restart refuses it with the same words (exit 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_filter_on_the_publication_is_not_counted_as_carrying_the_outbox() -> anyhow::Result<()>
{
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, db, relay) = (&s.stack, &s.db, &s.relay);
    wait_until(&format!("{INCLUDES} 1 while healthy"), NOTICE, || async {
        relay.gauge(INCLUDES).await.map(|v| v == Some(1.0))
    })
    .await?;
    db.batch_execute(&format!(
        "ALTER PUBLICATION {} SET TABLE outbox WHERE (event_type <> 'Hidden')",
        stack.publication
    ))
    .await?;
    let error = relay
        .process
        .wait_for_line_where(
            "an ERROR naming the row filter",
            |l| l.contains("ERROR") && l.contains("row filter") && l.contains("backfill"),
            NOTICE,
        )
        .await?;
    eprintln!("{error}");
    wait_until(&format!("{INCLUDES} 0"), NOTICE, || async {
        relay.gauge(INCLUDES).await.map(|v| v == Some(0.0))
    })
    .await?;
    let (status, body) = relay.get("/readyz").await?;
    assert_eq!(status, 503, "{body}");
    // The table is still in the publication: readiness does not say it
    // left (it said "not in the streamed publication").
    assert!(
        body.contains("filters rows") && !body.contains("not in the streamed publication"),
        "{body}"
    );

    let mut s = s;
    s.stop_relay().await?;
    let out = run_once(&s.stack, s.sink()).await?;
    assert_eq!(out.code(), Some(3), "{}", out.text());
    assert!(
        out.text().contains("row filter") && out.text().contains(&s.stack.publication),
        "names the publication and the filter: {}",
        out.text()
    );
    // The message gives the command that drops the filter, and it works:
    // what is left is only that no relay streams (status exit 8).
    let p = &s.stack.publication;
    let fix = format!(
        "BEGIN; ALTER PUBLICATION {p} DROP TABLE public.outbox; ALTER PUBLICATION {p} ADD TABLE public.outbox; COMMIT"
    );
    assert!(out.text().contains(&fix), "{}", out.text());
    s.db.batch_execute(&fix).await?;
    let status = app::relay_command(&s.stack, &s.stack.relay_url, &["status"], &[]).await?;
    assert_eq!(status.code(), Some(8), "{}", status.text());
    Ok(())
}

/// The outbox leaves its publication and rejoins while the relay is
/// stopped: no reading of the running relay can see that, so the
/// membership last verified is recorded (in `cdc_relay_progress`) and the
/// next session's first reading is compared with it. The error names a
/// `--since` whose backfill brings back the event committed while out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_change_while_the_relay_is_stopped_is_reported_at_the_next_start()
-> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Billing).await?;
    app::insert_order_event(&s.db).await?;
    oracle::wait_ledger_clean(&s.stack, 1, DRAIN).await?;
    wait_until("the membership recorded", NOTICE, || async {
        let row =
            s.db.query_opt(
                "SELECT 1 FROM cdc_relay_progress WHERE slot_name = $1 \
                 AND membership_carriers IS NOT NULL AND membership_table_oid = 'outbox'::regclass",
                &[&s.stack.slot],
            )
            .await?;
        anyhow::Ok(row.is_some())
    })
    .await?;
    s.stop_relay().await?;

    let publication = s.stack.publication.clone();
    s.db.batch_execute(&format!(
        "ALTER PUBLICATION {publication} DROP TABLE outbox"
    ))
    .await?;
    let while_out = app::insert_order_event(&s.db).await?;
    s.db.batch_execute(&format!("ALTER PUBLICATION {publication} ADD TABLE outbox"))
        .await?;

    s.restart_relay(&[]).await?;
    let error = s
        .relay
        .process
        .wait_for_line_where(
            "an ERROR saying the membership changed and how, naming backfill",
            |l| {
                l.contains("ERROR")
                    && l.contains("membership changed")
                    && l.contains(&format!(
                        "left publication {publication} and was added back"
                    ))
                    && l.contains("backfill")
            },
            NOTICE,
        )
        .await?;
    eprintln!("{error}");
    assert_eq!(s.relay.metrics().await?.sum(GAPS), 1.0, "one gap counted");
    // The owed gap follows, with the backfill that re-sends it.
    let since = owed_gap_since(&s.relay).await?;
    let ledger = Ledger::read(&s.stack).await?;
    assert_eq!(
        ledger.lost, 1,
        "the event committed while out is not streamed: {ledger:?}"
    );

    backfill(&s.stack, &since, &s.billing().inbox()).await?;
    oracle::wait_ledger_clean(&s.stack, 2, DRAIN).await?;
    let accounting = s.accounting(&["outbox"]).await?;
    assert!(accounting.delivered.contains(&while_out.to_string()));
    accounting.assert_balanced();

    // Steady again: a restart with nothing changed reports nothing.
    s.stop_relay().await?;
    s.restart_relay(&[]).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        s.relay.metrics().await?.sum(GAPS),
        0.0,
        "no gap after a plain restart"
    );
    Ok(())
}

/// The publication dropped and created again (same name) while the relay is
/// stopped with an event pending. Decoding from the slot reaches a point
/// where the publication does not exist: PostgreSQL 15-17 fail there (the
/// relay exits 6 and says how to move past it), 18 skips the publication
/// (the recorded membership no longer matches: a gap is reported). Either
/// way the printed steps bring every event back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publication_dropped_and_recreated_under_a_stopped_relay_is_never_silent()
-> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Billing).await?;
    app::insert_order_event(&s.db).await?;
    oracle::wait_ledger_clean(&s.stack, 1, DRAIN).await?;
    wait_until("the membership recorded", NOTICE, || async {
        let row = s
            .db
            .query_opt(
                "SELECT 1 FROM cdc_relay_progress WHERE slot_name = $1 AND membership_carriers IS NOT NULL",
                &[&s.stack.slot],
            )
            .await?;
        anyhow::Ok(row.is_some())
    })
    .await?;
    s.stop_relay().await?;

    let publication = s.stack.publication.clone();
    let since = now(&s.db).await?;
    app::insert_order_event(&s.db).await?;
    // Separate transactions: an event is committed while no publication
    // exists, another after it is back.
    s.db.batch_execute(&format!("DROP PUBLICATION {publication}"))
        .await?;
    app::insert_order_event(&s.db).await?;
    s.db.batch_execute(&format!(
        "CREATE PUBLICATION {publication} FOR TABLE outbox WITH (publish = 'insert')"
    ))
    .await?;
    app::insert_order_event(&s.db).await?;
    let version: i32 =
        s.db.query_one("SELECT current_setting('server_version_num')::int", &[])
            .await?
            .get(0);

    let inbox = s.billing().inbox();
    if version < 180_000 {
        let run = app::relay_command(
            &s.stack,
            &s.stack.relay_url,
            &["run", "--admin-listen", "127.0.0.1:0"],
            &[
                ("CDC_RELAY_SINK_URL", &inbox),
                ("EVENT_SECRET", TEST_SECRET),
            ],
        )
        .await?;
        assert_eq!(run.code(), Some(6), "run exits 6:\n{}", run.text());
        assert!(
            run.text().contains("dropped and created again")
                && run.text().contains("pg_replication_slot_advance"),
            "names the recreated publication and the advance: {}",
            run.text()
        );
        // The advance the message gives, as the relay's role, once the
        // exited relay's walsender has let the slot go (it ends a moment
        // after the relay).
        wait_until("the slot released", NOTICE, || async {
            let active: bool =
                s.db.query_one(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                    &[&s.stack.slot],
                )
                .await?
                .get(0);
            anyhow::Ok(!active)
        })
        .await?;
        harness::connect(&s.stack.relay_url)
            .await?
            .batch_execute(&format!(
                "SELECT pg_replication_slot_advance('{}', pg_current_wal_lsn())",
                s.stack.slot
            ))
            .await?;
        s.restart_relay(&[]).await?;
    } else {
        s.restart_relay(&[]).await?;
        s.relay
            .process
            .wait_for_line_where(
                "an ERROR saying the membership changed",
                |l| l.contains("ERROR") && l.contains("membership changed"),
                NOTICE,
            )
            .await?;
    }
    backfill(&s.stack, &since, &inbox).await?;
    app::insert_order_event(&s.db).await?;
    oracle::wait_ledger_clean(&s.stack, 5, DRAIN).await?;
    s.accounting(&["outbox"]).await?.assert_balanced();
    Ok(())
}
