//! The dead-letter write can never fail on content: whatever a sink answers
//! (any bytes, any length) and whatever the row holds, the relay's own row
//! builder and store commit it to the real `cdc_relay_dead_letter` table,
//! as the relay's least-privilege role. And `dead-letter replay` runs
//! aggregates concurrently while keeping each one's order (the filters,
//! `--rate` and the stop at a failing sink are in `sink_failures`). The
//! relay's grouped store shares commits among concurrent writers, keeps
//! each writer's order, and commits asynchronously (`cdc_relay::durable`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cdc_relay::deadletter::{
    DeadLetterStore, ERROR_BYTES, GroupedStore, NewDeadLetter, PARKED_QUEUE_KIB, storable,
};
use cdc_relay::durable::Durability;
use cdc_relay::lsn::Lsn;
use cdc_relay::outbox::{OutboxEvent, UnreadableRow};
use cdc_relay::sink::{Attempt, Reason};
use futures::FutureExt;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use ::harness::{Inbox, PgCluster, Scenario, connect, wait_until};

/// Arbitrary response bytes, lossily decoded the way the sink client does
/// (NUL and control characters included), up to 4 KiB.
fn body() -> impl Strategy<Value = String> {
    proptest::collection::vec(any::<u8>(), 0..4096)
        .prop_map(|b| String::from_utf8_lossy(&b).into_owned())
}

/// Arbitrary payload bytes (UTF-8 or not).
fn payload() -> impl Strategy<Value = Option<Vec<u8>>> {
    proptest::option::of(proptest::collection::vec(any::<u8>(), 0..2048))
}

#[test]
fn any_response_body_error_text_and_payload_is_written() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The relay's store: its statement, committed asynchronously.
    let (store, admin) = rt.block_on(async {
        let stack = PgCluster::shared().create_stack().await.unwrap();
        let relay = connect(&stack.relay_url).await.unwrap();
        let (store, _) = GroupedStore::asynchronous(Arc::new(relay));
        (store, stack.orders_admin().await.unwrap())
    });
    let mut runner = TestRunner::new(Config {
        cases: 200,
        ..Config::default()
    });
    let strategy = (body(), body(), payload(), 100u16..600, "\\PC{0,40}");
    let written = std::cell::Cell::new(0i64);
    runner
        .run(&strategy, |(excerpt, error, payload, status, id)| {
            let event = OutboxEvent {
                id: id.clone(),
                event_type: "OrderCreated".into(),
                payload: payload.clone().map(Bytes::from),
                aggregate_key: Some(id.clone()),
                commit_lsn: None,
                commit_time_micros: 0,
            };
            let attempt = Attempt::Response {
                status,
                retry_after: None,
                excerpt,
            };
            let reason = Reason {
                label: "http_4xx",
                status: Some(status),
            };
            let rejected = NewDeadLetter::rejected(&event, &attempt, &reason, 1, 0);
            let unreadable = NewDeadLetter::unreadable(&UnreadableRow {
                event_id: Some(id),
                aggregate_key: None,
                event_type: None,
                payload: payload.map(Bytes::from),
                commit_lsn: None,
                problem: error,
            });
            for row in [rejected, unreadable] {
                let result = rt.block_on(store.insert(&row));
                prop_assert!(result.is_ok(), "{result:?} for {row:?}");
                written.set(written.get() + 1);
            }
            Ok(())
        })
        .unwrap();
    let rows: i64 = rt
        .block_on(admin.query_one("SELECT count(*) FROM cdc_relay_dead_letter", &[]))
        .unwrap()
        .get(0);
    assert_eq!(rows, written.get(), "every row committed");
    // Payload bytes that are not UTF-8 were kept exactly, in payload_bytes.
    let kept: i64 = rt
        .block_on(admin.query_one(
            "SELECT count(*) FROM cdc_relay_dead_letter WHERE payload IS NULL AND payload_bytes IS NOT NULL",
            &[],
        ))
        .unwrap()
        .get(0);
    assert!(kept > 0, "some generated payloads were not UTF-8");
}

/// Writes dead letters straight into the table (as a relay would after a
/// 4xx): `per` events for each of `aggregates` aggregates, one aggregate
/// after the other (a1 a2 a3 ... b1 b2 b3 ...), so a replay that ignored
/// the aggregates would send an aggregate's events at once. Returns each
/// aggregate's event ids, oldest first.
async fn dead_letter_rows(
    db: &tokio_postgres::Client,
    aggregates: usize,
    per: usize,
) -> anyhow::Result<Vec<(String, Vec<String>)>> {
    let keys: Vec<String> = (0..aggregates)
        .map(|_| uuid::Uuid::new_v4().to_string())
        .collect();
    let mut ids = vec![Vec::new(); aggregates];
    for (k, key) in keys.iter().enumerate() {
        for n in 0..per {
            let id = uuid::Uuid::new_v4().to_string();
            db.execute(
                "INSERT INTO cdc_relay_dead_letter \
                   (event_id, aggregate_key, event_type, payload, http_status, error, attempts) \
                 VALUES ($1, $2, 'OrderPaid', $3, 400, 'http_400: test', 1)",
                &[&id, key, &format!("{{\"n\":{n}}}")],
            )
            .await?;
            ids[k].push(id);
        }
    }
    Ok(keys.into_iter().zip(ids).collect())
}

/// `replay` sends several aggregates at once but each aggregate's events
/// one at a time, oldest first; an aggregate whose earlier event is
/// refused again is skipped from there (its later events are not attempted
/// and stay), while the other aggregates go on to the end. Every row
/// delivered leaves exactly one audit row, and no more requests are in
/// flight than `--max-in-flight`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_replay_keeps_each_aggregates_order_and_skips_one_refused_again()
-> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let admin = stack.orders_admin().await?;
    let rows = dead_letter_rows(&admin, 6, 4).await?;
    let (refused_key, refused) = &rows[0];
    // The first aggregate's second event is refused again.
    sink.reject(&refused[1], 422);
    sink.set_delay(Duration::from_millis(40));
    let before = sink.received().len();

    // How many requests the sink holds at once, sampled while replaying.
    let replay = crate::sink_failures::cli(
        stack,
        &[
            "dead-letter",
            "replay",
            "--all",
            "--json",
            "--max-in-flight",
            "4",
        ],
        &sink.url,
    );
    tokio::pin!(replay);
    let mut most = 0;
    let out = loop {
        tokio::select! {
            out = &mut replay => break out?,
            () = tokio::time::sleep(Duration::from_millis(2)) => most = most.max(sink.in_progress()),
        }
    };
    assert!(!out.success(), "three rows were kept: {}", out.text());
    let v: serde_json::Value = serde_json::from_str(&out.stdout)?;
    let outcome = |id: &str| {
        v["rows"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["event_id"] == id))
            .map(|r| r["outcome"].as_str().unwrap_or_default().to_owned())
    };
    assert_eq!(outcome(&refused[0]).as_deref(), Some("delivered"), "{v}");
    assert_eq!(outcome(&refused[1]).as_deref(), Some("rejected"), "{v}");
    for later in &refused[2..] {
        assert_eq!(outcome(later).as_deref(), Some("not_attempted"), "{v}");
    }
    assert_eq!(v["delivered"], 21, "{v}");

    // Each aggregate's events arrived oldest first, each only after the
    // one before it was answered; the skipped ones never arrived.
    let sent: Vec<String> = sink.received_from(before).iter().map(|r| r.id()).collect();
    for (key, ids) in &rows {
        let got: Vec<&String> = sent.iter().filter(|id| ids.contains(id)).collect();
        let expected: Vec<&String> = if key == refused_key {
            ids[..2].iter().collect()
        } else {
            ids.iter().collect()
        };
        assert_eq!(got, expected, "aggregate {key}: {sent:?}");
    }
    assert!(
        (2..=4).contains(&most),
        "aggregates in parallel, at most --max-in-flight: {most} at once"
    );

    let left: Vec<String> = admin
        .query(
            "SELECT event_id FROM cdc_relay_dead_letter ORDER BY id",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        left,
        refused[1..].to_vec(),
        "only the refused aggregate's rest stays"
    );
    let audited: Vec<String> = admin
        .query(
            "SELECT event_id FROM cdc_relay_dead_letter_audit WHERE action = 'replay'",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let unique: HashSet<&String> = audited.iter().collect();
    assert!(
        audited.len() == 21 && unique.len() == 21 && !unique.contains(&refused[1]),
        "one audit row per delivered row: {audited:?}"
    );

    // Once accepted, the skipped aggregate's events follow in order.
    sink.clear_rejections();
    let from = sink.received().len();
    let out =
        crate::sink_failures::cli(stack, &["dead-letter", "replay", "--all"], &sink.url).await?;
    assert!(out.success(), "{}", out.text());
    let sent: Vec<String> = sink.received_from(from).iter().map(|r| r.id()).collect();
    assert_eq!(sent, refused[1..].to_vec());
    Ok(())
}

/// A dead letter whose payload is not UTF-8 (kept in `payload_bytes`) is
/// not replayed: sent, its data would be null, and a 2xx would remove the
/// event's only copy. It stays, and the replay says why (exit 1). Broken
/// on purpose once: without the check, the sink got `"data":null` and the
/// row was removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_is_not_utf8_is_never_replayed_as_null() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let admin = stack.orders_admin().await?;
    admin
        .execute(
            "INSERT INTO cdc_relay_dead_letter \
               (event_id, event_type, payload, payload_bytes, error, attempts) \
             VALUES ('e-bytes', 'OrderPaid', NULL, '\\xff7b7d'::bytea, 'unreadable: not UTF-8', 0)",
            &[],
        )
        .await?;
    let before = sink.received().len();
    let out =
        crate::sink_failures::cli(stack, &["dead-letter", "replay", "--all"], &sink.url).await?;
    assert!(!out.success(), "{}", out.text());
    assert!(out.text().contains("not UTF-8"), "{}", out.text());
    assert_eq!(sink.received().len(), before, "nothing sent");
    let left: i64 = admin
        .query_one(
            "SELECT count(*) FROM cdc_relay_dead_letter WHERE event_id = 'e-bytes'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(left, 1, "the row stays");
    Ok(())
}

/// Row `n` of writer `w` for the grouped-store test: every fourth payload
/// is not UTF-8, every fourth holds a NUL (both go to `payload_bytes`),
/// some have none; the error, excerpt and type hold NULs.
fn grouped_row(w: usize, n: usize) -> NewDeadLetter {
    let payload = match n % 4 {
        0 => Some(Bytes::from(vec![0xff, 0xfe, w as u8, n as u8])),
        1 => Some(Bytes::from(format!("{{\"w\":{w},\"nul\":\"a\0b\"}}"))),
        2 => None,
        _ => Some(Bytes::from(format!("{{\"w\":{w},\"n\":{n},\"é\":true}}"))),
    };
    NewDeadLetter {
        event_id: Some(format!("w{w}-{n}")),
        aggregate_key: Some(format!("agg-{w}")),
        event_type: Some("Order\0Paid".into()),
        payload,
        commit_lsn: (!n.is_multiple_of(3)).then(|| Lsn::new(0x1_0000_0000 + (w * 1000 + n) as u64)),
        http_status: n.is_multiple_of(2).then_some(422),
        error: format!("parked: endpoint \"e\" is parked (test)\0 {n}"),
        response_excerpt: n.is_multiple_of(2).then(|| "no\0pe".to_owned()),
        attempts: n as u32,
        first_attempt_unix_micros: (!n.is_multiple_of(5))
            .then_some(1_700_000_000_000_000 + n as i64),
        endpoint: w.is_multiple_of(2).then(|| "e".to_owned()),
    }
}

/// Whether the table's row (as read by the test's query) holds what
/// `want` should have been stored as.
fn stored_as(row: &tokio_postgres::Row, want: &NewDeadLetter) -> Result<(), String> {
    let (payload, payload_bytes) = match want.payload.as_deref() {
        Some(p) => match std::str::from_utf8(p) {
            Ok(t) if !t.contains('\0') => (Some(t.to_owned()), None),
            _ => (None, Some(p.to_vec())),
        },
        None => (None, None),
    };
    let got = (
        row.get::<_, Option<String>>("event_type"),
        row.get::<_, Option<String>>("aggregate_key"),
        row.get::<_, Option<String>>("payload"),
        row.get::<_, Option<Vec<u8>>>("payload_bytes"),
        row.get::<_, Option<String>>("lsn"),
        row.get::<_, Option<i32>>("http_status"),
        row.get::<_, String>("error"),
        row.get::<_, Option<String>>("response_excerpt"),
        row.get::<_, i32>("attempts"),
        row.get::<_, Option<i64>>("first_micros"),
        row.get::<_, Option<String>>("endpoint"),
        row.get::<_, bool>("last_attempt_set"),
    );
    let expected = (
        want.event_type.as_deref().map(|t| storable(t, 1024)),
        want.aggregate_key.clone(),
        payload,
        payload_bytes,
        want.commit_lsn.map(|l| l.to_string()),
        want.http_status.map(i32::from),
        storable(&want.error, ERROR_BYTES),
        want.response_excerpt.as_deref().map(|e| storable(e, 2048)),
        want.attempts as i32,
        want.first_attempt_unix_micros,
        want.endpoint.clone(),
        true,
    );
    if got == expected {
        Ok(())
    } else {
        Err(format!("stored {got:?}, expected {expected:?}"))
    }
}

/// The relay's dead-letter store (`GroupedStore::asynchronous` over the
/// relay role's connection) under 64 concurrent writers, 1,000 rows in all, each
/// writer awaiting its row before the next, as a delivery does: every row
/// is stored once with its content (non-UTF-8 and NUL-holding payloads in
/// `payload_bytes`, NULs dropped from text), the id each insert returned is
/// its row's, each writer's ids increase in the order it wrote (the order
/// `docs/architecture.md#parking` relies on), and the rows took far fewer
/// commits than rows: counted both as distinct inserting transactions
/// (`xmin`) and as the database's `xact_commit` delta, each at most 500.
/// Inserts whose waiter is dropped at once (polled once, then dropped)
/// are mixed in:
/// their rows may or may not be written, at most once, and they break no
/// one else's batch.
///
/// Broken on purpose once: with `MAX_ROWS` set to 1 (one statement per
/// row), the test failed on `1000 rows took 1000 inserting transactions`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_inserts_share_commits_and_keep_each_writers_order() -> anyhow::Result<()> {
    const WRITERS: usize = 64;
    const TOTAL: usize = 1000;
    let stack = PgCluster::shared().create_stack().await?;
    let admin = stack.orders_admin().await?;
    let commits = || async {
        let row = admin
            .query_one(
                "SELECT pg_stat_clear_snapshot(), xact_commit FROM pg_stat_database \
                 WHERE datname = current_database()",
                &[],
            )
            .await?;
        anyhow::Ok(row.get::<_, i64>(1))
    };
    let relay = Arc::new(connect(&stack.relay_url).await?);
    let relay_pid: i32 = relay
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    let before = commits().await?;
    let (store, durability) = GroupedStore::asynchronous(Arc::clone(&relay));
    let store = Arc::new(store);
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let mut ids = Vec::new();
                for n in (w..TOTAL).step_by(WRITERS) {
                    let id = store.insert(&grouped_row(w, n)).await?;
                    ids.push((n, id));
                    if n.is_multiple_of(7) {
                        let mut dropped = grouped_row(w, n);
                        dropped.event_id = Some(format!("dropped-{w}-{n}"));
                        // Polled once (the row is queued), then dropped.
                        let gone = store.insert(&dropped).now_or_never();
                        assert!(gone.is_none(), "no id before the writer ran");
                    }
                }
                anyhow::Ok((w, ids))
            })
        })
        .collect();
    let mut returned = Vec::new();
    for writer in writers {
        returned.push(writer.await??);
    }
    // Every row queued was promised first, dropped ones too.
    let queued = TOTAL + (0..TOTAL).filter(|n| n.is_multiple_of(7)).count();
    assert_eq!(
        durability.promised(),
        queued as u64,
        "every queued row counted"
    );
    // The session ends: its backend flushes its statistics as it exits.
    drop(store);
    drop(durability);
    drop(relay);
    wait_until(
        "the relay role's backend to exit",
        Duration::from_secs(30),
        || async {
            let n: i64 = admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                    &[&relay_pid],
                )
                .await?
                .get(0);
            anyhow::Ok(n == 0)
        },
    )
    .await?;
    let xact_commits = commits().await? - before;

    let rows = admin
        .query(
            "SELECT id, event_id, event_type, aggregate_key, payload, payload_bytes, \
               commit_lsn::text AS lsn, http_status, error, response_excerpt, attempts, \
               (EXTRACT(EPOCH FROM first_attempt_at) * 1000000)::bigint AS first_micros, endpoint, \
               last_attempt_at IS NOT NULL AS last_attempt_set \
             FROM cdc_relay_dead_letter WHERE event_id LIKE 'w%'",
            &[],
        )
        .await?;
    assert_eq!(rows.len(), TOTAL, "every row stored, once");
    let by_event: HashMap<String, &tokio_postgres::Row> = rows
        .iter()
        .map(|r| (r.get::<_, String>("event_id"), r))
        .collect();
    assert_eq!(by_event.len(), TOTAL, "no event id stored twice");
    for (w, ids) in &returned {
        for (n, id) in ids {
            let row = by_event[&format!("w{w}-{n}")];
            assert_eq!(
                row.get::<_, i64>("id"),
                *id,
                "insert returned w{w}-{n}'s own id"
            );
            if let Err(e) = stored_as(row, &grouped_row(*w, *n)) {
                panic!("w{w}-{n}: {e}");
            }
        }
        assert!(
            ids.windows(2).all(|p| p[0].1 < p[1].1),
            "writer {w}'s ids increase in the order it wrote: {ids:?}"
        );
    }
    let dropped: i64 = admin
        .query_one(
            "SELECT count(*) - count(DISTINCT event_id) FROM cdc_relay_dead_letter \
             WHERE event_id LIKE 'dropped-%'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(dropped, 0, "a dropped insert's row is written at most once");
    let inserting: i64 = admin
        .query_one(
            "SELECT count(DISTINCT xmin::text) FROM cdc_relay_dead_letter WHERE event_id LIKE 'w%'",
            &[],
        )
        .await?
        .get(0);
    println!(
        "{TOTAL} rows from {WRITERS} writers: {inserting} inserting transactions, \
         xact_commit +{xact_commits}"
    );
    assert!(
        inserting <= 500,
        "{TOTAL} rows took {inserting} inserting transactions"
    );
    assert!(
        xact_commits <= 500,
        "{TOTAL} rows took {xact_commits} commits (pg_stat_database)"
    );
    Ok(())
}

/// The relay's store commits each statement with `synchronous_commit =
/// off` for that statement only, and counts the commit; `backfill`'s
/// commits synchronously. Read inside an explicit transaction (the store's
/// statement then runs in it): `off` after the relay store's insert, `on`
/// after backfill's; in autocommit the session's setting is `on` again
/// after the statement. The poller then reports the counted commit
/// flushed, and the server's flush position has reached the insert
/// position read after it.
///
/// Broken on purpose once: with the setting in a CTE the insert does not
/// read (not joined), PostgreSQL skipped it and the test
/// failed on `synchronous_commit inside the relay store's statement`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_store_commits_asynchronously_and_follows_the_flush() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let client = Arc::new(connect(&stack.relay_url).await?);
    let setting = || async {
        let row = client.query_one("SHOW synchronous_commit", &[]).await?;
        anyhow::Ok(row.get::<_, String>(0))
    };
    let (relays, durability) = GroupedStore::asynchronous(Arc::clone(&client));
    let backfills = GroupedStore::new(Arc::clone(&client));
    assert_eq!(setting().await?, "on", "the server's default");

    client.batch_execute("BEGIN").await?;
    relays.insert(&grouped_row(0, 1)).await?;
    assert_eq!(
        setting().await?,
        "off",
        "synchronous_commit inside the relay store's statement"
    );
    client.batch_execute("ROLLBACK").await?;
    client.batch_execute("BEGIN").await?;
    backfills.insert(&grouped_row(0, 2)).await?;
    assert_eq!(setting().await?, "on", "inside backfill's statement");
    client.batch_execute("ROLLBACK").await?;

    let before = durability.promised();
    relays.insert(&grouped_row(0, 3)).await?;
    assert_eq!(
        setting().await?,
        "on",
        "the setting ended with the statement"
    );
    assert_eq!(durability.promised(), before + 1, "the row is counted");
    let insert: String = client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await?
        .get(0);
    wait_until(
        "the poller to report the commit flushed",
        Duration::from_secs(10),
        || {
            let covered = durability.covered();
            async move { anyhow::Ok(covered > before) }
        },
    )
    .await?;
    let flushed: bool = client
        .query_one(
            "SELECT pg_current_wal_flush_lsn() >= $1::text::pg_lsn",
            &[&insert],
        )
        .await?
        .get(0);
    assert!(
        flushed,
        "reported flushed, and the server's flush position says so"
    );
    Ok(())
}

/// A parked row (`GroupedStore::park`, the relay's store) is done once it
/// is queued, not committed: 8 writers park 50 rows each, one after the
/// other, without a commit in between, and the writer gathers them into a
/// handful of statements. A read of the parked rows right after the last
/// park sees every row (it waits for the rows queued before it), each
/// writer's ids increasing in the order it parked; the poller then
/// reports every promised row committed and flushed.
///
/// Broken on purpose once: with `park` waiting for the commit (as
/// `insert` does), the test failed on `400 parked rows took 99 inserting
/// transactions`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_rows_are_done_when_queued_and_a_read_waits_for_them() -> anyhow::Result<()> {
    const WRITERS: usize = 8;
    const EACH: usize = 50;
    let stack = PgCluster::shared().create_stack().await?;
    let admin = stack.orders_admin().await?;
    let relay = Arc::new(connect(&stack.relay_url).await?);
    let (store, durability) = GroupedStore::asynchronous(Arc::clone(&relay));
    let store = Arc::new(store);
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                for n in 0..EACH {
                    let mut row = grouped_row(w, n);
                    row.endpoint = Some("parked-e".into());
                    let id = store.park(&row).await?;
                    assert_eq!(id, None, "queued, not waited for");
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for writer in writers {
        writer.await??;
    }
    let total = WRITERS * EACH;
    let read = store.parked("parked-e", 0, 10_000).await?;
    assert_eq!(read.len(), total, "the read saw every row parked before it");
    for w in 0..WRITERS {
        let ids: Vec<(usize, i64)> = read
            .iter()
            .filter_map(|r| {
                let (writer, n) = r.event.id.strip_prefix('w')?.split_once('-')?;
                (writer.parse::<usize>().ok()? == w).then(|| (n.parse().unwrap(), r.id))
            })
            .collect();
        assert_eq!(ids.len(), EACH, "writer {w}'s rows");
        assert!(
            ids.windows(2).all(|p| p[0].0 < p[1].0 && p[0].1 < p[1].1),
            "writer {w}'s ids increase in the order it parked: {ids:?}"
        );
    }
    let inserting: i64 = admin
        .query_one(
            "SELECT count(DISTINCT xmin::text) FROM cdc_relay_dead_letter WHERE endpoint = 'parked-e'",
            &[],
        )
        .await?
        .get(0);
    println!("{total} parked rows: {inserting} inserting transactions");
    assert!(
        inserting <= 20,
        "{total} parked rows took {inserting} inserting transactions"
    );
    assert_eq!(durability.promised(), total as u64);
    covered(&durability, total as u64).await
}

/// A statement of parked rows that fails (here: a CHECK constraint the
/// operator added refuses one row) is tried again by the writer, before
/// any row queued behind it, until it commits: nobody waits for those
/// rows, so nobody else would. Meanwhile the poller reports nothing
/// committed past them (the confirmed position waits) and a read of the
/// parked rows waits too. Once the constraint is dropped every row is
/// written, in queue order, and covered.
///
/// Broken on purpose once: with the writer dropping a failed batch of
/// rows nobody waits for, the test failed on `nothing covered past a
/// failed row` (12 covered: the dropped rows counted as done).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_statement_of_parked_rows_is_retried_in_order() -> anyhow::Result<()> {
    let (admin, store, durability) = refusing("event_id NOT LIKE 'refused%'").await?;
    let row = |id: String| parked_row(id, "retried");
    for n in 0..6 {
        store.park(&row(format!("ok-{n}"))).await?;
    }
    store.park(&row("refused-6".into())).await?;
    // Behind the failing statement (after the writer has taken it).
    tokio::time::sleep(Duration::from_millis(200)).await;
    for n in 7..12 {
        store.park(&row(format!("ok-{n}"))).await?;
    }
    let reader = {
        let store = Arc::clone(&store);
        tokio::spawn(async move { store.parked("retried", 0, 100).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(durability.covered(), 0, "nothing covered past a failed row");
    assert!(
        !reader.is_finished(),
        "the read waits for the rows queued before it"
    );
    let written: i64 = admin
        .query_one(
            "SELECT count(*) FROM cdc_relay_dead_letter WHERE event_id = ANY($1)",
            &[&(7..12).map(|n| format!("ok-{n}")).collect::<Vec<_>>()],
        )
        .await?
        .get(0);
    assert_eq!(written, 0, "no row behind the failed statement overtook it");

    admin.batch_execute(REFUSE_NO_MORE).await?;
    let read = tokio::time::timeout(Duration::from_secs(30), reader).await???;
    let order: Vec<&str> = read.iter().map(|r| r.event.id.as_str()).collect();
    let want: Vec<String> = (0..12)
        .map(|n| {
            if n == 6 {
                "refused-6".into()
            } else {
                format!("ok-{n}")
            }
        })
        .collect();
    assert_eq!(
        order, want,
        "every row written after the constraint went, in queue order"
    );
    covered(&durability, 12).await
}

/// Parked rows the writer cannot write do not pile up in memory: with
/// every statement refused (a CHECK constraint), parks complete until
/// `PARKED_QUEUE_KIB` of rows (small rows: 1 KiB each) are queued, and the
/// next one waits; once the constraint is dropped it completes and every
/// row is written.
///
/// Broken on purpose once: with the room taken and not held by the row
/// (given back as soon as it was queued), the test failed on `a park
/// beyond the queue's room waits`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parking_waits_when_the_writer_cannot_keep_up() -> anyhow::Result<()> {
    let (admin, store, durability) = refusing("endpoint <> 'bounded'").await?;
    let row = |n: usize| {
        let mut r = parked_row(format!("b-{n}"), "bounded");
        r.payload = Some(Bytes::from_static(b"{}"));
        r
    };
    let room = PARKED_QUEUE_KIB as usize;
    for n in 0..room {
        tokio::time::timeout(Duration::from_secs(5), store.park(&row(n)))
            .await
            .map_err(|_| anyhow::anyhow!("park {n} of {room} waited"))??;
    }
    let beyond = {
        let store = Arc::clone(&store);
        tokio::spawn(async move { store.park(&row(room)).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !beyond.is_finished(),
        "a park beyond the queue's room waits"
    );
    admin.batch_execute(REFUSE_NO_MORE).await?;
    tokio::time::timeout(Duration::from_secs(30), beyond).await???;
    covered(&durability, room as u64 + 1).await?;
    let written: i64 = admin
        .query_one(
            "SELECT count(*) FROM cdc_relay_dead_letter WHERE endpoint = 'bounded'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(written, room as i64 + 1, "every row written once");
    Ok(())
}

/// Drops [`refusing`]'s constraint.
const REFUSE_NO_MORE: &str = "ALTER TABLE cdc_relay_dead_letter DROP CONSTRAINT test_refuses";

/// A fresh stack whose dead-letter table refuses rows failing `check` (a
/// CHECK constraint the operator might add), its admin connection, and
/// the relay's store over the relay role's connection.
async fn refusing(
    check: &str,
) -> anyhow::Result<(tokio_postgres::Client, Arc<GroupedStore>, Durability)> {
    let stack = PgCluster::shared().create_stack().await?;
    let admin = stack.orders_admin().await?;
    admin
        .batch_execute(&format!(
            "ALTER TABLE cdc_relay_dead_letter ADD CONSTRAINT test_refuses CHECK ({check})"
        ))
        .await?;
    let relay = Arc::new(connect(&stack.relay_url).await?);
    let (store, durability) = GroupedStore::asynchronous(relay);
    Ok((admin, Arc::new(store), durability))
}

/// A small parked row of `endpoint` with event id `id`.
fn parked_row(id: String, endpoint: &str) -> NewDeadLetter {
    let mut r = grouped_row(0, 1);
    r.event_id = Some(id);
    r.endpoint = Some(endpoint.into());
    r
}

/// Waits until the poller reports the first `rows` promised rows committed
/// and flushed.
async fn covered(durability: &Durability, rows: u64) -> anyhow::Result<()> {
    wait_until("the promised rows covered", Duration::from_secs(30), || {
        let covered = durability.covered();
        async move { anyhow::Ok(covered == rows) }
    })
    .await
}
