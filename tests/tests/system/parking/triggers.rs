//! What parks an endpoint besides its `max_lag`: the WAL budget
//! (`--max-retained-wal`), and its share of a full memory window.

use super::*;

/// The WAL budget: billing (no `max_lag`) is down, WAL piles up in a side
/// table past `--max-retained-wal`, and billing — holding the oldest
/// pending event — is parked once that event has waited 30 s; the slot
/// then moves and shipping never notices.
#[tokio::test]
async fn over_the_wal_budget_the_endpoint_pinning_the_slot_is_parked() {
    let (stack, sinks, dir) = two_sinks().await;
    let relay = start_variant(
        &stack,
        dir.path(),
        &sinks,
        ("auto", ""),
        &["--slot-stats-interval", "1s", "--max-retained-wal", "4MiB"],
    )
    .await;
    let db = stack.orders_admin().await.unwrap();
    let aggregates = [oracle::expected::insert_order(&db).await.unwrap()];
    sinks[0].set_status(503);
    let events = commit(&db, &aggregates, 3, 0).await;
    db.batch_execute(
        "CREATE TABLE wal_filler (x text); \
         INSERT INTO wal_filler SELECT repeat('x', 1000) FROM generate_series(1, 20000)",
    )
    .await
    .unwrap();
    // Its oldest event must wait 30 s (BUDGET_MIN_AGE) first: longer than
    // settle's bound.
    wait_until("billing parked for the WAL budget", PARK_BY, || async {
        parked_rows(&db).await.len() == events.len()
    })
    .await
    .unwrap();
    oracle::settle(&db, &stack.slot).await.unwrap();
    let want: BTreeSet<String> = events.iter().map(|e| e.id.clone()).collect();
    let parked: BTreeSet<String> = parked_rows(&db).await.into_iter().collect();
    assert_eq!(parked, want, "billing's events parked, once each");
    let why: String = db
        .query_one(
            "SELECT error FROM cdc_relay_dead_letter WHERE endpoint = 'billing' LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(why.contains("--max-retained-wal"), "{why}");
    let m = relay.metrics().await.unwrap();
    assert_eq!(
        m.value("cdc_relay_endpoint_parked", &[("endpoint", "shipping")]),
        Some(0.0)
    );
    assert_eq!(
        m.value("cdc_relay_retained_wal_budget_bytes", &[]),
        Some(4.0 * 1024.0 * 1024.0)
    );
    let shipping: BTreeSet<String> = in_order("shipping", &sinks[1], &events)
        .into_iter()
        .collect();
    assert_eq!(shipping, want);
    drop(relay);
}

/// Each endpoint's share of the window: billing (no `max_lag`, no budget)
/// hangs past its request timeout while shipping is healthy, in a window
/// of 20 events. Once the relay has waited on the full window, billing,
/// holding nearly all of it alone, is parked, and shipping gets every
/// event. Broken on purpose once: with the dispatcher given no window to
/// watch (`Shared::window: None`), it failed (the slot never caught up:
/// settle timed out with shipping stalled behind billing).
#[tokio::test]
async fn an_endpoint_holding_the_window_alone_is_parked_and_the_others_go_on() {
    let (stack, sinks, dir) = two_sinks().await;
    let relay = start_variant(
        &stack,
        dir.path(),
        &sinks,
        ("manual", "request_timeout = \"1s\"\n"),
        &["--max-pending-events", "20"],
    )
    .await;
    let db = stack.orders_admin().await.unwrap();
    let aggregates = orders(&db, 4).await;
    sinks[0].set_delay(std::time::Duration::from_secs(5));
    let events = commit(&db, &aggregates, 30, 0).await;
    oracle::settle(&db, &stack.slot).await.unwrap();
    let all: BTreeSet<String> = events.iter().map(|e| e.id.clone()).collect();
    let shipping: BTreeSet<String> = in_order("shipping", &sinks[1], &events)
        .into_iter()
        .collect();
    assert_eq!(shipping, all, "shipping got everything");
    let parked = parked_rows(&db).await;
    assert!(
        parked.len() > 30,
        "most of billing's events: {}",
        parked.len()
    );
    let delivered = in_order("billing", &sinks[0], &events);
    let at_billing: BTreeSet<String> = parked.iter().chain(&delivered).cloned().collect();
    assert_eq!(at_billing, all, "billing's events delivered or parked");
    assert_eq!(parked.len() + delivered.len(), all.len(), "each once");
    let why: String = db
        .query_one(
            "SELECT error FROM cdc_relay_dead_letter WHERE endpoint = 'billing' LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(why.contains("more than its share (1/2,"), "{why}");
    let m = relay.metrics().await.unwrap();
    assert_eq!(
        m.value("cdc_relay_endpoint_parked", &[("endpoint", "shipping")]),
        Some(0.0)
    );
    let waited = m.value("cdc_relay_window_wait_seconds_total", &[]).unwrap();
    assert!(waited >= 1.0, "the stream waited for room: {waited}s");
    drop(relay);
}
