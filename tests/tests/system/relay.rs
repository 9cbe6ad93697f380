//! The relay end to end: real PostgreSQL, real binaries, real HTTP.
//! Every test ends with the ledger (lost, duplicated, phantom effects).

use std::time::Duration;

use harness::PgCluster;
use harness::app::{self, Ledger, TEST_SECRET};
use harness::sink::ScriptedSink;

const DRAIN: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_orders_are_invoiced_exactly_once() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let setup = app::relay_setup(&stack).await?;
    assert!(setup.contains("created: slot"), "{setup}");
    let billing = app::start_billing(&stack, TEST_SECRET).await?;
    let orders = app::start_orders(&stack).await?;
    let relay = app::start_relay(&stack, &format!("{}/inbox", billing.url), &[]).await?;
    app::wait_streaming(&relay).await?;

    let http = reqwest::Client::new();
    let posts = (0..1000).map(|i| {
        let http = http.clone();
        let url = orders.url.clone();
        async move { app::post_order(&http, &url, 100 + i).await }
    });
    let results = futures::future::join_all(posts).await;
    let accepted = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(
        accepted,
        1000,
        "first error: {:?}",
        results.iter().find(|r| r.is_err())
    );

    let ledger = app::wait_ledger_clean(&stack, 1000, DRAIN).await?;
    assert_eq!(
        ledger,
        Ledger {
            committed: 1000,
            invoices: 1000,
            ..Ledger::default()
        }
    );
    // The slot is confirmed past the last commit once the relay catches up.
    let (_, last_commit) = app::slot_position(&stack).await?;
    harness::wait_until(
        "slot confirmed past the last commit",
        Duration::from_secs(10),
        || async {
            app::slot_position(&stack)
                .await
                .map(|(confirmed, _)| confirmed >= last_commit)
        },
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_signature_and_headers_follow_the_wire_format() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay(&stack, &sink.url, &[]).await?;
    app::wait_streaming(&relay).await?;

    let db = stack.orders_admin().await?;
    let order = uuid::Uuid::new_v4();
    let event = uuid::Uuid::new_v4();
    db.execute(
        "INSERT INTO orders (id, amount_cents, currency) VALUES ($1, 1, 'EUR')",
        &[&order],
    )
    .await?;
    db.execute(
        "INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES ($1, $2, 'OrderCreated', \
         '{\"big\": 123456789012345678901234567890, \"dec\": 1.10000000000000000001, \"s\": \"\\u2028 e\u{301} 😀\"}')",
        &[&event, &order],
    )
    .await?;
    let text: String = db
        .query_one("SELECT payload::text FROM outbox WHERE id = $1", &[&event])
        .await?
        .get(0);
    harness::wait_until("one delivery", Duration::from_secs(20), || async {
        sink.count() >= 1
    })
    .await?;
    let got = &sink.received()[0];
    let expected = format!(r#"{{"id":"{event}","type":"OrderCreated","data":{text}}}"#);
    assert_eq!(std::str::from_utf8(&got.body)?, expected);
    assert!(
        got.signature_valid(TEST_SECRET),
        "signature {:?}",
        got.signature
    );
    assert_eq!(
        got.idempotency_key.as_deref(),
        Some(event.to_string().as_str())
    );
    assert_eq!(got.content_type.as_deref(), Some("application/json"));
    Ok(())
}
