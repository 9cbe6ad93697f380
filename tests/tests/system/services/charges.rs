//! Billing charging each invoice at the payment provider exactly once
//! (`services/README.md#effects-outside-the-database`): the real Billing and
//! Payments binaries, the provider's faults from its test hooks, Billing's
//! crash between the provider's charge and its own record, and the count of
//! charges per invoice in the provider's table as the oracle.

use std::time::Duration;

use ::harness::chaos::front::{Front, socket_addr};
use ::harness::stack::PaymentsDb;
use ::harness::{PgCluster, Stack, wait_until};
use reqwest::StatusCode;
use serde_json::Value;
use uuid::Uuid;

use super::{Service, deliver_signed, event, http, stack};

/// Bound on an invoice reaching its final charge state.
const SETTLED: Duration = Duration::from_secs(60);

async fn stack_with_payments() -> (Stack, PaymentsDb) {
    let stack = stack().await;
    let payments = PgCluster::shared()
        .create_payments(&stack)
        .await
        .expect("create_payments");
    (stack, payments)
}

async fn payments(db: &PaymentsDb, args: &[&str]) -> Service {
    let mut all = vec!["--database-url", db.app_url.as_str()];
    all.extend_from_slice(args);
    Service::start("payments", &all, &[]).await
}

/// Billing charging at `payments_url`, with the harness's fast retry flags.
async fn charging_billing(stack: &Stack, payments_url: &str, args: &[&str]) -> Service {
    Service::billing(
        stack,
        &::harness::app::charging_args(payments_url, args),
        &[],
    )
    .await
}

/// Delivers one new event; returns its order id.
async fn deliver_one(billing: &Service, amount_cents: i64) -> Uuid {
    let order_id = Uuid::new_v4();
    let body = event(Uuid::new_v4(), order_id, amount_cents).to_string();
    let response = deliver_signed(&http(), billing, &body).await;
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    order_id
}

/// The invoice of `order_id`: (id, charge_status, charge_id, charge_error, attempts).
async fn invoice(
    stack: &Stack,
    order_id: Uuid,
) -> (Uuid, String, Option<String>, Option<String>, i32) {
    let row = stack
        .billing_admin()
        .await
        .unwrap()
        .query_one(
            "SELECT id, charge_status, charge_id, charge_error, charge_attempts \
             FROM invoices WHERE order_id = $1",
            &[&order_id],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4))
}

/// The provider's charges for `invoice_id` (its reference).
async fn charges_of(payments: &PaymentsDb, invoice_id: Uuid) -> Vec<Uuid> {
    payments
        .admin()
        .await
        .unwrap()
        .query(
            "SELECT id FROM charges WHERE reference = $1 ORDER BY created_at",
            &[&invoice_id.to_string()],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn wait_status(stack: &Stack, order_id: Uuid, status: &str) {
    wait_until(
        &format!("the invoice of order {order_id} {status}"),
        SETTLED,
        || async { anyhow::Ok(invoice(stack, order_id).await.1 == status) },
    )
    .await
    .unwrap();
}

/// The invoice charged exactly once: one charge at the provider, and its
/// id recorded on the invoice.
async fn assert_charged_once(stack: &Stack, payments: &PaymentsDb, order_id: Uuid) {
    let (invoice_id, status, charge_id, _, attempts) = invoice(stack, order_id).await;
    assert_eq!(status, "charged");
    let charges = charges_of(payments, invoice_id).await;
    assert_eq!(
        charges.len(),
        1,
        "charges of invoice {invoice_id} after {attempts} attempts: {charges:?}"
    );
    assert_eq!(charge_id, Some(charges[0].to_string()));
}

#[tokio::test]
async fn billing_charges_each_invoice_once_and_records_the_providers_charge_id() {
    let (stack, db) = stack_with_payments().await;
    let provider = payments(&db, &[]).await;
    let billing = charging_billing(&stack, &provider.url, &[]).await;
    let client = http();
    let mut orders = Vec::new();
    for amount in [100, 250, 999] {
        orders.push(deliver_one(&billing, amount).await);
    }
    for &order in &orders {
        wait_status(&stack, order, "charged").await;
        assert_charged_once(&stack, &db, order).await;
    }
    let listed: Value = client
        .get(billing.admin_at(&format!("/invoices?order_id={}", orders[0])))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed[0]["charge_status"], "charged");
    assert_eq!(listed[0]["charge_attempts"], 1);
    let metrics = billing.metrics(&client).await;
    assert!(
        metrics.contains("billing_charge_attempts_total{verdict=\"charged\"} 3"),
        "{metrics}"
    );

    // Without --payments-url nothing is charged, and the invoice says so.
    let plain = Service::billing(&stack, &[], &[]).await;
    let order = deliver_one(&plain, 100).await;
    let (invoice_id, status, charge_id, _, attempts) = invoice(&stack, order).await;
    assert_eq!((status.as_str(), charge_id, attempts), ("none", None, 0));
    assert!(charges_of(&db, invoice_id).await.is_empty());
}

#[tokio::test]
async fn a_lost_answer_and_a_5xx_are_retried_with_the_same_key_and_charge_once() {
    let (stack, db) = stack_with_payments().await;
    let dropping = payments(&db, &["--fault-drop-after-commit-ratio", "1"]).await;
    let mut failing = payments(&db, &["--fault-fail-ratio", "1"]).await;
    let healthy = payments(&db, &[]).await;
    let front = Front::start(socket_addr(&dropping.url).unwrap())
        .await
        .unwrap();
    let billing = charging_billing(&stack, &front.url(), &[]).await;
    let order = deliver_one(&billing, 4200).await;

    // Every answer lost: charged once, then each retry replayed (and lost).
    wait_until("two attempts with the answer lost", SETTLED, || async {
        let (_, status, _, _, attempts) = invoice(&stack, order).await;
        anyhow::Ok(status == "charging" && attempts >= 2)
    })
    .await
    .unwrap();
    let invoice_id = invoice(&stack, order).await.0;
    assert_eq!(charges_of(&db, invoice_id).await.len(), 1);

    // Then 503s, which charge nothing; then a healthy provider.
    front.set_upstream(socket_addr(&failing.url).unwrap());
    let before = invoice(&stack, order).await.4;
    wait_until("two attempts answered 503", SETTLED, || async {
        let (_, _, _, error, attempts) = invoice(&stack, order).await;
        anyhow::Ok(attempts >= before + 2 && error.is_some_and(|e| e.starts_with("503")))
    })
    .await
    .unwrap();
    // Billing's kept-alive connection stays with the failing instance
    // until that one goes.
    front.set_upstream(socket_addr(&healthy.url).unwrap());
    failing.process.sigkill();
    wait_status(&stack, order, "charged").await;
    assert_charged_once(&stack, &db, order).await;
}

#[tokio::test]
async fn billing_killed_between_the_charge_and_its_record_resumes_with_the_same_key() {
    let (stack, db) = stack_with_payments().await;
    let provider = payments(&db, &[]).await;
    let mut crashing =
        charging_billing(&stack, &provider.url, &["--fault-exit-after-charge"]).await;
    let order = deliver_one(&crashing, 1234).await;
    let status = crashing
        .process
        .wait_exit(SETTLED)
        .await
        .expect("Billing exits after the charge");
    assert_eq!(status.code(), Some(87), "{status}");
    let (invoice_id, state, ..) = invoice(&stack, order).await;
    assert_eq!(state, "charging", "the charge was made, not recorded");
    assert_eq!(charges_of(&db, invoice_id).await.len(), 1);

    let _restarted = charging_billing(&stack, &provider.url, &[]).await;
    wait_status(&stack, order, "charged").await;
    assert_charged_once(&stack, &db, order).await;
}

/// The comparison the key is for: the same crash without it charges twice.
#[tokio::test]
async fn without_the_idempotency_key_the_same_crash_charges_twice() {
    let (stack, db) = stack_with_payments().await;
    let provider = payments(&db, &[]).await;
    let no_key = "--charge-without-idempotency-key";
    let mut crashing = charging_billing(
        &stack,
        &provider.url,
        &["--fault-exit-after-charge", no_key],
    )
    .await;
    let order = deliver_one(&crashing, 1234).await;
    crashing.process.wait_exit(SETTLED).await.unwrap();
    let _restarted = charging_billing(&stack, &provider.url, &[no_key]).await;
    wait_status(&stack, order, "charged").await;
    let invoice_id = invoice(&stack, order).await.0;
    assert_eq!(charges_of(&db, invoice_id).await.len(), 2, "charged twice");
}

#[tokio::test]
async fn a_declined_charge_fails_the_invoice_with_the_providers_reason() {
    let (stack, db) = stack_with_payments().await;
    let provider = payments(&db, &["--decline-above-cents", "1000"]).await;
    let billing = charging_billing(&stack, &provider.url, &[]).await;
    let order = deliver_one(&billing, 5000).await;
    wait_status(&stack, order, "failed").await;
    let (invoice_id, _, charge_id, error, attempts) = invoice(&stack, order).await;
    assert_eq!((charge_id, attempts), (None, 1));
    let error = error.unwrap_or_default();
    assert!(error.starts_with("402 charge_declined"), "{error}");
    assert!(charges_of(&db, invoice_id).await.is_empty());
}
