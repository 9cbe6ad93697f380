//! The dead-letter write can never fail on content: whatever a sink answers
//! (any bytes, any length) and whatever the row holds, the relay's own row
//! builder and store commit it to the real `cdc_relay_dead_letter` table,
//! as the relay's least-privilege role. And `dead-letter replay` runs
//! aggregates concurrently while keeping each one's order (the filters,
//! `--rate` and the stop at a failing sink are in `sink_failures`).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cdc_relay::deadletter::{DeadLetterStore, NewDeadLetter};
use cdc_relay::outbox::{OutboxEvent, UnreadableRow};
use cdc_relay::sink::{Attempt, Reason};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use ::harness::{Inbox, PgCluster, Scenario, connect};

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
    let (store, admin) = rt.block_on(async {
        let stack = PgCluster::shared().create_stack().await.unwrap();
        let relay = connect(&stack.relay_url).await.unwrap();
        (Arc::new(relay), stack.orders_admin().await.unwrap())
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
