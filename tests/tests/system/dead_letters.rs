//! The dead-letter write can never fail on content: whatever a sink answers
//! (any bytes, any length) and whatever the row holds, the relay's own row
//! builder and store commit it to the real `cdc_relay_dead_letter` table,
//! as the relay's least-privilege role.

use std::sync::Arc;

use bytes::Bytes;
use cdc_relay::deadletter::{DeadLetterStore, NewDeadLetter};
use cdc_relay::outbox::{OutboxEvent, UnreadableRow};
use cdc_relay::sink::{Attempt, Reason};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use ::harness::{PgCluster, connect};

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
