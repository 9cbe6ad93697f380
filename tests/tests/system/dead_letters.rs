//! The dead-letter write can never fail on content: whatever a sink answers
//! (any bytes, any length) and whatever the row holds, the relay's own row
//! builder and store commit it to the real `cdc_relay_dead_letter` table,
//! as the relay's least-privilege role. And `dead-letter replay` runs
//! aggregates concurrently while keeping each one's order (the filters,
//! `--rate` and the stop at a failing sink are in `sink_failures`). The
//! relay's grouped store shares commits among concurrent writers, keeps
//! the order rows were written in, gathers parked rows, and retries a
//! failed statement before anything behind it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cdc_relay::dead_letter::{
    DeadLetterStore, ERROR_BYTES, GroupedStore, NewDeadLetter, Urgency, storable,
};
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
    // The relay's store and its statement.
    let (store, admin) = rt.block_on(async {
        let stack = PgCluster::shared().create_stack().await.unwrap();
        let relay = connect(&stack.relay_url).await.unwrap();
        let store = GroupedStore::new(Arc::new(relay));
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
            // Each case's events are new (a repeated event id at the same
            // endpoint keeps its one row, tested below).
            let id = format!("{id}#{}", written.get());
            let event = OutboxEvent {
                id: id.clone(),
                event_type: "OrderCreated".into(),
                payload: payload.clone().map(Bytes::from),
                aggregate_key: Some(id.clone()),
                commit_lsn: None,
                commit_time_micros: 0,
                dead_letter_id: None,
                trace: None,
            };
            let attempt = Attempt::Response {
                status,
                retry_after: None,
                excerpt,
            };
            let reason = Reason {
                label: cdc_relay::sink::ReasonLabel::Http4xx,
                status: Some(status),
            };
            let rejected = NewDeadLetter::rejected(&event, &attempt, &reason, 1, 0);
            let unreadable = NewDeadLetter::unreadable(&UnreadableRow {
                event_id: Some(format!("{id}u")),
                aggregate_key: None,
                event_type: None,
                payload: payload.map(Bytes::from),
                commit_lsn: None,
                problem: error,
            });
            for row in [rejected, unreadable] {
                let result = rt.block_on(store.write(&row, Urgency::Now));
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

/// What `dead-letter replay --json` (`stdout`) said of the refused
/// aggregate's rows: the first delivered, the second refused again, the
/// rest not attempted; 21 of the 24 rows delivered in all.
fn said_refused_first_second(stdout: &str, refused: &[String]) -> anyhow::Result<()> {
    let v: serde_json::Value = serde_json::from_str(stdout)?;
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
    Ok(())
}

/// The dead-letter table holds the refused aggregate's rows from the
/// refused one on, and nothing else.
async fn only_the_refused_rest_stays(
    admin: &tokio_postgres::Client,
    refused: &[String],
) -> anyhow::Result<()> {
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
    Ok(())
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
    said_refused_first_second(&out.stdout, refused)?;

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

    only_the_refused_rest_stays(&admin, refused).await?;
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

/// `replay --batch-max-events` sends rows in batches (one row per
/// aggregate in a request, as the live pipeline does); a batch the sink
/// refuses whole is split down to the refused row, which is kept with the
/// rest of its aggregate, while every other row is delivered, in each
/// aggregate's order, and removed with its audit row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_in_batches_splits_a_refused_batch_down_to_the_refused_row() -> anyhow::Result<()>
{
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let admin = stack.orders_admin().await?;
    let rows = dead_letter_rows(&admin, 6, 4).await?;
    let (refused_key, refused) = &rows[0];
    sink.reject(&refused[1], 422);
    let before = sink.received().len();
    let args = [
        "dead-letter",
        "replay",
        "--all",
        "--json",
        "--max-in-flight",
        "2",
        "--batch-max-events",
        "8",
    ];
    let out = crate::sink_failures::cli(stack, &args, &sink.url).await?;
    assert!(!out.success(), "three rows were kept: {}", out.text());
    said_refused_first_second(&out.stdout, refused)?;

    let requests = sink.received_from(before);
    let largest = requests.iter().map(|r| r.ids().len()).max().unwrap_or(0);
    assert!(
        largest > 1,
        "rows went in batches: {:?}",
        requests.iter().map(|r| r.ids()).collect::<Vec<_>>()
    );
    for r in &requests {
        let ids = r.ids();
        let keys: HashSet<&str> = ids
            .iter()
            .filter_map(|id| rows.iter().find(|(_, ids)| ids.contains(id)))
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(
            keys.len(),
            ids.len(),
            "one row per aggregate in a request: {ids:?}"
        );
        assert!(
            !ids.iter().any(|id| refused[2..].contains(id)),
            "the rows behind the refused one were not sent: {ids:?}"
        );
    }
    // Each aggregate's delivered rows, in the order the sink took them.
    let accepted: Vec<String> = requests
        .iter()
        .filter(|r| (200..300).contains(&r.status))
        .flat_map(|r| r.ids())
        .collect();
    for (key, ids) in &rows {
        let got: Vec<&String> = accepted.iter().filter(|id| ids.contains(id)).collect();
        let expected: Vec<&String> = if key == refused_key {
            ids[..1].iter().collect()
        } else {
            ids.iter().collect()
        };
        assert_eq!(got, expected, "aggregate {key}: {accepted:?}");
    }
    only_the_refused_rest_stays(&admin, refused).await?;
    let audit = admin
        .query_one(
            "SELECT count(*), count(DISTINCT event_id) FROM cdc_relay_dead_letter_audit \
             WHERE action = 'replay'",
            &[],
        )
        .await?;
    let (audited, unique): (i64, i64) = (audit.get(0), audit.get(1));
    assert_eq!(
        (audited, unique),
        (21, 21),
        "one audit row per delivered row"
    );
    Ok(())
}

/// A dead letter whose payload cannot be sent is not replayed; it stays,
/// nothing is sent, and the replay says why (exit 1):
/// - not UTF-8 (kept in `payload_bytes`): sent, its data would be null,
///   and a 2xx would remove the event's only copy. Broken on purpose once:
///   without the check, the sink got `"data":null` and the row was removed.
/// - text that is not JSON (an unreadable row kept as read): it would go
///   into the body as the event's `data` and make the body invalid. (It
///   was POSTed, and the receiver answered 400 invalid_json.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_cannot_be_sent_is_never_replayed() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let admin = stack.orders_admin().await?;
    for (id, values, said) in [
        (
            "e-bytes",
            "NULL, '\\xff7b7d'::bytea, 'unreadable: not UTF-8'",
            "not UTF-8",
        ),
        (
            "e-text",
            "'{not json at all', NULL, 'unreadable: holds text that is not JSON'",
            "not JSON",
        ),
    ] {
        admin
            .batch_execute(&format!(
                "INSERT INTO cdc_relay_dead_letter \
                   (event_id, event_type, payload, payload_bytes, error, attempts) \
                 VALUES ('{id}', 'OrderPaid', {values}, 0)"
            ))
            .await?;
        let before = sink.received().len();
        let out = crate::sink_failures::cli(stack, &["dead-letter", "replay", "--all"], &sink.url)
            .await?;
        assert!(!out.success(), "{id}: {}", out.text());
        assert!(out.text().contains(said), "{id}: {}", out.text());
        assert_eq!(sink.received().len(), before, "{id}: nothing sent");
        assert_eq!(rows_of(&admin, id).await?, 1, "{id}: the row stays");
        admin
            .execute(
                "DELETE FROM cdc_relay_dead_letter WHERE event_id = $1",
                &[&id],
            )
            .await?;
    }
    Ok(())
}

/// The dead-letter rows of `event_id`.
async fn rows_of(admin: &tokio_postgres::Client, event_id: &str) -> anyhow::Result<i64> {
    Ok(admin
        .query_one(
            "SELECT count(*) FROM cdc_relay_dead_letter WHERE event_id = $1",
            &[&event_id],
        )
        .await?
        .get(0))
}

/// A replay whose removal cannot commit (a lock held on the dead-letter
/// table) says so: the row's line says "delivered", never "removed", the
/// command fails naming the lock's holder and the rows that stay, and
/// they do stay; a later replay removes them. (The row line said
/// "delivered (204); removed" before the DELETE had committed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_says_removed_only_once_the_removal_committed() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let admin = stack.orders_admin().await?;
    admin
        .execute(
            "INSERT INTO cdc_relay_dead_letter (event_id, event_type, payload, error, attempts) \
             VALUES ('e-locked', 'OrderPaid', '{\"n\":1}', 'refused', 1)",
            &[],
        )
        .await?;
    let mut locker = stack.orders_admin().await?;
    let tx = locker.transaction().await?;
    tx.batch_execute(
        "SET application_name = 'removal-blocker'; LOCK TABLE cdc_relay_dead_letter IN SHARE MODE",
    )
    .await?;
    let out =
        crate::sink_failures::cli(stack, &["dead-letter", "replay", "--all"], &sink.url).await?;
    let text = out.text();
    assert!(!out.success(), "{text}");
    assert!(out.stdout.contains(": delivered (204)"), "{text}");
    assert!(!out.stdout.contains("removed"), "{text}");
    assert!(
        text.contains("removal-blocker") && text.contains("stay in the table"),
        "{text}"
    );
    tx.rollback().await?;
    assert_eq!(rows_of(&admin, "e-locked").await?, 1, "the row stays");
    let out =
        crate::sink_failures::cli(stack, &["dead-letter", "replay", "--all"], &sink.url).await?;
    assert!(out.success(), "{}", out.text());
    assert!(
        out.stdout.contains("1 delivered and removed"),
        "{}",
        out.text()
    );
    assert_eq!(
        rows_of(&admin, "e-locked").await?,
        0,
        "removed once the lock is gone"
    );
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
        trace: None,
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

/// An event refused again at an endpoint where it already has a dead
/// letter (re-streamed after a restart, or backfilled) keeps its one row:
/// the write returns the existing row's id, also inside a group of writes
/// committed together, whose other rows get ids of their own in order. The
/// same event at another endpoint, and rows without an event id
/// (unreadable rows), get rows of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_refused_again_at_the_same_endpoint_keeps_its_one_dead_letter()
-> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let admin = stack.orders_admin().await?;
    let relay = Arc::new(connect(&stack.relay_url).await?);
    let store = GroupedStore::new(Arc::clone(&relay));
    let row = |event: Option<&str>, endpoint: Option<&str>| NewDeadLetter {
        event_id: event.map(str::to_owned),
        endpoint: endpoint.map(str::to_owned),
        ..grouped_row(1, 3)
    };
    let first = store
        .write(&row(Some("x"), Some("e")), Urgency::Now)
        .await?;
    let again = store
        .write(&row(Some("x"), Some("e")), Urgency::Now)
        .await?;
    assert_eq!(again, first, "the same dead letter");
    // In one group: before, the repeat, after.
    let (y, x, z) = futures::join!(
        store.write(&row(Some("y"), Some("e")), Urgency::Now),
        store.write(&row(Some("x"), Some("e")), Urgency::Now),
        store.write(&row(Some("z"), Some("e")), Urgency::Now),
    );
    let (y, x, z) = (y?, x?, z?);
    assert_eq!(x, first, "the repeat inside a group");
    assert!(y > first && z > first && y != z, "{first} {y} {x} {z}");
    let elsewhere = store.write(&row(Some("x"), None), Urgency::Now).await?;
    assert_ne!(elsewhere, first, "another endpoint's dead letter");
    let u1 = store.write(&row(None, Some("e")), Urgency::Now).await?;
    let u2 = store.write(&row(None, Some("e")), Urgency::Now).await?;
    assert_ne!(u1, u2, "rows without an event id are each kept");
    let per_event: Vec<(Option<String>, i64)> = admin
        .query(
            "SELECT event_id, count(*) FROM cdc_relay_dead_letter GROUP BY 1 ORDER BY 1 NULLS LAST",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        per_event,
        vec![
            (Some("x".to_owned()), 2),
            (Some("y".to_owned()), 1),
            (Some("z".to_owned()), 1),
            (None, 2)
        ]
    );
    // Each id returned is its own row's.
    for (id, event) in [(y, "y"), (z, "z"), (first, "x")] {
        let got: Option<String> = admin
            .query_one(
                "SELECT event_id FROM cdc_relay_dead_letter WHERE id = $1",
                &[&id],
            )
            .await?
            .get(0);
        assert_eq!(got.as_deref(), Some(event));
    }
    Ok(())
}

/// The relay's dead-letter store (`GroupedStore` over the relay role's
/// connection) under 64 concurrent writers, 1,000 rows in all, each
/// writer awaiting its row before the next, as a delivery does: every row
/// is stored once with its content (non-UTF-8 and NUL-holding payloads in
/// `payload_bytes`, NULs dropped from text), the id each insert returned is
/// its row's, each writer's ids increase in the order it wrote (the order
/// `docs/architecture.md#parking` relies on), and the rows took far fewer
/// commits than rows: counted both as distinct inserting transactions
/// (`xmin`) and as the database's `xact_commit` delta, each at most 500.
/// Writes whose waiter is dropped at once (queued, then dropped)
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
    let store = Arc::new(GroupedStore::new(Arc::clone(&relay)));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let mut ids = Vec::new();
                for n in (w..TOTAL).step_by(WRITERS) {
                    let id = store.write(&grouped_row(w, n), Urgency::Now).await?;
                    ids.push((n, id));
                    if n.is_multiple_of(7) {
                        let mut dropped = grouped_row(w, n);
                        dropped.event_id = Some(format!("dropped-{w}-{n}"));
                        // Queued, polled once, then dropped.
                        let gone = store.write(&dropped, Urgency::Now).now_or_never();
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
    // The session ends: its backend flushes its statistics as it exits.
    drop(store);
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

/// The store commits with the server's `synchronous_commit`: inside an
/// explicit transaction (the store's statement then runs in it) the
/// setting is the session's after the write, and once a write has
/// answered, its commit is flushed (the server's flush position has
/// reached the insert position read right after it): a row is as durable
/// as any commit when its writer hears of it, so the confirmed position
/// may pass its event at once (`docs/architecture.md#dead-letters`).
///
/// Broken on purpose once: with the statement setting
/// `synchronous_commit = off` for its transaction (as the relay's store
/// did before), the test failed on `synchronous_commit inside the store's
/// statement`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_commits_with_the_servers_synchronous_commit() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let admin = stack.orders_admin().await?;
    // The last check needs the end of the write's own transaction: a
    // pgoutput peek at a slot made for this test gives it (other sessions
    // keep writing WAL, so the server's insert position would not do).
    let slot = format!("{}_flush", stack.slot);
    let publication = format!("{}_dl", stack.publication);
    admin
        .batch_execute(&format!(
            "CREATE PUBLICATION {publication} FOR TABLE cdc_relay_dead_letter"
        ))
        .await?;
    admin
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await?;
    let client = Arc::new(connect(&stack.relay_url).await?);
    let setting = || async {
        let row = client.query_one("SHOW synchronous_commit", &[]).await?;
        anyhow::Ok(row.get::<_, String>(0))
    };
    let store = GroupedStore::new(Arc::clone(&client));
    assert_eq!(setting().await?, "on", "the server's default");
    client.batch_execute("BEGIN").await?;
    store.write(&grouped_row(0, 1), Urgency::Gather).await?;
    assert_eq!(
        setting().await?,
        "on",
        "synchronous_commit inside the store's statement"
    );
    client.batch_execute("ROLLBACK").await?;
    store.write(&grouped_row(0, 3), Urgency::Gather).await?;
    let flushed: Lsn = client
        .query_one("SELECT pg_current_wal_flush_lsn()::text", &[])
        .await?
        .get::<_, String>(0)
        .parse()?;
    // Commit (PostgreSQL docs, "Logical Replication Message Formats"):
    // Byte1('C'), Int8 flags, Int64 commit LSN, Int64 end LSN, Int64 time.
    let commits: Vec<Vec<u8>> = admin
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
             'proto_version', '1', 'publication_names', $2)",
            &[&slot, &publication],
        )
        .await?
        .iter()
        .map(|r| r.get::<_, Vec<u8>>(0))
        .filter(|data| data.first() == Some(&b'C'))
        .collect();
    let end = commits
        .last()
        .and_then(|c| c.get(10..18))
        .map(|b| Lsn::new(u64::from_be_bytes(b.try_into().expect("8 bytes"))))
        .expect("the write's commit decoded");
    admin
        .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await?;
    assert!(
        flushed >= end,
        "the answered write's commit is flushed: flushed to {flushed}, the commit ends at {end}"
    );
    Ok(())
}

/// Parked rows (`Urgency::Gather`) are gathered: 4 writers queue 50 rows
/// each, one every 4 ms, without waiting for a commit in between (as the
/// dispatcher hands a parked endpoint's events to the writer as they
/// come), and the writer stores them in a few statements, not one per
/// row. Every write then answers, and the rows read back hold each
/// writer's rows with ids increasing in the order it queued them.
///
/// Broken on purpose once: with the writer not gathering (`GATHER` 0),
/// the test failed on `200 parked rows took 83 inserting transactions` (10 with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_rows_are_gathered_and_stored_in_the_order_they_were_queued() -> anyhow::Result<()> {
    const WRITERS: usize = 4;
    const EACH: usize = 50;
    let stack = PgCluster::shared().create_stack().await?;
    let admin = stack.orders_admin().await?;
    let relay = Arc::new(connect(&stack.relay_url).await?);
    let store = Arc::new(GroupedStore::new(Arc::clone(&relay)));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let mut written = Vec::new();
                for n in 0..EACH {
                    let mut row = grouped_row(w, n);
                    row.endpoint = Some("parked-e".into());
                    written.push(store.write(&row, Urgency::Gather));
                    tokio::time::sleep(Duration::from_millis(4)).await;
                }
                let mut ids = Vec::new();
                for w in written {
                    ids.push(w.await?);
                }
                anyhow::Ok(ids)
            })
        })
        .collect();
    for writer in writers {
        let ids = writer.await??;
        assert!(
            ids.windows(2).all(|p| p[0] < p[1]),
            "ids increase in the order the rows were queued: {ids:?}"
        );
    }
    let total = WRITERS * EACH;
    let read = store.parked("parked-e", 0, 10_000).await?;
    assert_eq!(read.len(), total, "every parked row read back");
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
            "writer {w}'s ids increase in the order it queued: {ids:?}"
        );
        assert!(
            read.iter().all(|r| r.event.dead_letter_id == Some(r.id)),
            "each event read back carries its row id"
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
        inserting <= 40,
        "{total} parked rows took {inserting} inserting transactions"
    );
    Ok(())
}

/// A statement that fails (here: a CHECK constraint the operator added
/// refuses one row) is tried again by the writer, before any row queued
/// behind it, until it commits: no write answers meanwhile (their events
/// stay pending), and no row behind the failed statement overtakes it.
/// Once the constraint is dropped every row is written, in queue order.
///
/// Broken on purpose once: with the writer answering a failed statement's
/// rows with the error and going on (as it did for rows a delivery
/// waited for), the test failed on `no write answered while the
/// statement failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_statement_is_retried_before_anything_behind_it() -> anyhow::Result<()> {
    let (_stack, admin, store) = refusing("event_id NOT LIKE 'refused%'").await?;
    let rollbacks = || async {
        let row = admin
            .query_one(
                "SELECT pg_stat_clear_snapshot(), xact_rollback FROM pg_stat_database \
                 WHERE datname = current_database()",
                &[],
            )
            .await?;
        anyhow::Ok(row.get::<_, i64>(1))
    };
    let before = rollbacks().await?;
    let row = |id: String| parked_row(id, "retried");
    let mut writes = Vec::new();
    for n in 0..6 {
        writes.push(store.write(&row(format!("ok-{n}")), Urgency::Gather));
    }
    writes.push(store.write(&row("refused-6".into()), Urgency::Gather));
    let mut first: Vec<_> = writes.into_iter().map(tokio::spawn).collect();
    // Queued behind the failing statement, once the writer has taken it
    // and failed at least once (it logs and pauses before the next try).
    wait_until(
        "the writer's statement to fail (a rolled-back transaction)",
        Duration::from_secs(30),
        || async { anyhow::Ok(rollbacks().await? > before) },
    )
    .await?;
    let mut behind = Vec::new();
    for n in 7..12 {
        behind.push(tokio::spawn(
            store.write(&row(format!("ok-{n}")), Urgency::Now),
        ));
    }
    // Three more tries of the statement (the writer pauses 100 ms,
    // doubling, between them), and still nothing may have answered.
    let tried = rollbacks().await?;
    wait_until(
        "three more failed tries of the statement",
        Duration::from_secs(30),
        || async { anyhow::Ok(rollbacks().await? >= tried + 3) },
    )
    .await?;
    assert!(
        first.iter().chain(&behind).all(|w| !w.is_finished()),
        "no write answered while the statement failed"
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
    let mut ids = Vec::new();
    for w in first.drain(..).chain(behind) {
        ids.push(tokio::time::timeout(Duration::from_secs(30), w).await???);
    }
    assert!(
        ids.windows(2).all(|p| p[0] < p[1]),
        "every row written after the constraint went, in queue order: {ids:?}"
    );
    let read = store.parked("retried", 0, 100).await?;
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
    assert_eq!(order, want, "stored in queue order");
    Ok(())
}

/// Drops [`refusing`]'s constraint.
const REFUSE_NO_MORE: &str = "ALTER TABLE cdc_relay_dead_letter DROP CONSTRAINT test_refuses";

/// A fresh stack whose dead-letter table refuses rows failing `check` (a
/// CHECK constraint the operator might add), its admin connection, and
/// the relay's store over the relay role's connection (the stack is
/// returned to keep its databases while the test runs).
async fn refusing(
    check: &str,
) -> anyhow::Result<(harness::Stack, tokio_postgres::Client, Arc<GroupedStore>)> {
    let stack = PgCluster::shared().create_stack().await?;
    let admin = stack.orders_admin().await?;
    admin
        .batch_execute(&format!(
            "ALTER TABLE cdc_relay_dead_letter ADD CONSTRAINT test_refuses CHECK ({check})"
        ))
        .await?;
    let relay = Arc::new(connect(&stack.relay_url).await?);
    Ok((stack, admin, Arc::new(GroupedStore::new(relay))))
}

/// A small parked row of `endpoint` with event id `id`.
fn parked_row(id: String, endpoint: &str) -> NewDeadLetter {
    let mut r = grouped_row(0, 1);
    r.event_id = Some(id);
    r.endpoint = Some(endpoint.into());
    r
}

/// A dead-letter write refused for a missing privilege says which grants
/// the relay's role needs and where they come from (it gave the server's
/// bare "permission denied", retried at ERROR).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_dead_letter_write_names_the_grants() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let admin = stack.orders_admin().await?;
    admin
        .batch_execute("REVOKE INSERT ON cdc_relay_dead_letter FROM cdc_relay")
        .await?;
    let relay = connect(&stack.relay_url).await?;
    let e = relay
        .execute(
            "INSERT INTO cdc_relay_dead_letter (event_id, error, attempts) VALUES ('x', 'x', 0)",
            &[],
        )
        .await
        .expect_err("the role may not insert");
    let said = cdc_relay::dead_letter::StoreError::of(&relay, &e)
        .await
        .to_string();
    assert!(
        said.contains("permission denied")
            && said.contains("sql/roles.sql")
            && said.contains("INSERT on cdc_relay_dead_letter")
            && said.contains("--database-url"),
        "{said}"
    );
    Ok(())
}

/// Without `--routes`, `dead-letter replay` sends to `--sink-url` only the
/// rows a `--sink-url` relay dead-lettered: a row a routes file's endpoint
/// dead-lettered is kept and named (its receiver is another), unless the
/// operator names that endpoint on purpose. (`replay --all --sink-url`
/// sent shipping's row to Billing and removed it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_to_the_sink_url_leaves_a_routed_endpoints_rows_alone() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let admin = stack.orders_admin().await?;
    admin
        .batch_execute(
            "INSERT INTO cdc_relay_dead_letter (event_id, event_type, payload, error, attempts, endpoint) \
             VALUES ('e-shipping', 'OrderPaid', '{\"n\":1}', 'refused', 1, 'shipping'), \
                    ('e-default', 'OrderPaid', '{\"n\":2}', 'refused', 1, NULL)",
        )
        .await?;
    let before = sink.received().len();
    let out =
        crate::sink_failures::cli(stack, &["dead-letter", "replay", "--all"], &sink.url).await?;
    let text = out.text();
    let sent: Vec<String> = sink.received_from(before).iter().map(|r| r.id()).collect();
    assert_eq!(sent, vec!["e-default".to_owned()], "{text}");
    assert!(
        !out.success() && text.contains("dead-lettered by endpoint shipping"),
        "{text}"
    );
    assert_eq!(
        rows_of(&admin, "e-shipping").await?,
        1,
        "shipping's row stays"
    );
    // Named on purpose, it goes to --sink-url.
    let named = crate::sink_failures::cli(
        stack,
        &["dead-letter", "replay", "--all", "--endpoint", "shipping"],
        &sink.url,
    )
    .await?;
    assert!(named.success(), "{}", named.text());
    assert_eq!(
        rows_of(&admin, "e-shipping").await?,
        0,
        "replayed when named"
    );
    Ok(())
}
