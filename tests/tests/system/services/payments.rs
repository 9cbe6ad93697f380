//! The Payments service as a client (Billing) sees it: one charge per
//! `Idempotency-Key`, the first answer to every retry, a clear 422 for a
//! key reused with another body, keys that expire; and its test hooks,
//! each checked against the charges table.

use std::time::Duration;

use ::harness::PgCluster;
use ::harness::stack::PaymentsDb;
use reqwest::header::CONTENT_TYPE;
use reqwest::{Client, Response, StatusCode};
use serde_json::{Value, json};

use super::{Service, count, expect_error, http, stack};

impl Service {
    async fn payments(db: &PaymentsDb, args: &[&str]) -> Service {
        let mut all = vec!["--database-url", db.app_url.as_str()];
        all.extend_from_slice(args);
        Service::start("payments", &all, &[]).await
    }
}

async fn payments_db() -> PaymentsDb {
    let stack = stack().await;
    PgCluster::shared()
        .create_payments(&stack)
        .await
        .expect("create_payments")
}

fn charge(reference: &str, amount_cents: i64) -> Value {
    json!({"amount_cents": amount_cents, "currency": "EUR", "reference": reference})
}

async fn post_charge(
    client: &Client,
    payments: &Service,
    body: &Value,
    key: Option<&str>,
) -> reqwest::Result<Response> {
    let mut request = client
        .post(payments.at("/charges"))
        .header(CONTENT_TYPE, "application/json")
        .body(body.to_string());
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    request.send().await
}

/// Charges made for `reference`, read from the table.
async fn charges_for(db: &PaymentsDb, reference: &str) -> i64 {
    db.admin()
        .await
        .unwrap()
        .query_one(
            "SELECT count(*) FROM charges WHERE reference = $1",
            &[&reference],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn the_same_key_and_body_answer_the_first_charge_and_charge_once() {
    let db = payments_db().await;
    let payments = Service::payments(&db, &[]).await;
    let client = http();
    let body = charge("inv-1", 2599);
    let first = post_charge(&client, &payments, &body, Some("key-1"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first: Value = first.json().await.unwrap();
    assert_eq!(first["status"], "succeeded");
    // Key order and whitespace do not make another request.
    let reordered = r#"{ "reference": "inv-1", "currency": "EUR", "amount_cents": 2599 }"#;
    for _ in 0..3 {
        let again = client
            .post(payments.at("/charges"))
            .header(CONTENT_TYPE, "application/json")
            .header("Idempotency-Key", "key-1")
            .body(reordered)
            .send()
            .await
            .unwrap();
        assert_eq!(again.status(), StatusCode::CREATED);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.json::<Value>().await.unwrap(), first);
    }
    assert_eq!(charges_for(&db, "inv-1").await, 1);
    let listed: Value = client
        .get(payments.at("/charges?reference=inv-1"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed[0]["charge_id"], first["charge_id"]);

    // Without a key every request charges: the key, not the reference,
    // makes a retry safe.
    for _ in 0..2 {
        let response = post_charge(&client, &payments, &charge("inv-2", 100), None)
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
    }
    assert_eq!(charges_for(&db, "inv-2").await, 2);
}

#[tokio::test]
async fn the_same_key_with_another_body_is_422_and_charges_nothing() {
    let db = payments_db().await;
    let payments = Service::payments(&db, &[]).await;
    let client = http();
    let response = post_charge(&client, &payments, &charge("inv-1", 2599), Some("key-1"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let other = post_charge(&client, &payments, &charge("inv-1", 2600), Some("key-1"))
        .await
        .unwrap();
    let body = expect_error(
        other,
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency_key_reused",
    )
    .await;
    assert_eq!(body["field"], "Idempotency-Key");
    let admin = db.admin().await.unwrap();
    assert_eq!(count(&admin, "charges").await, 1);
    // A bad key is refused before anything is charged.
    let bad = post_charge(&client, &payments, &charge("inv-3", 1), Some("a b"))
        .await
        .unwrap();
    expect_error(bad, StatusCode::BAD_REQUEST, "invalid_idempotency_key").await;
    assert_eq!(count(&admin, "charges").await, 1);
}

#[tokio::test]
async fn a_decline_is_402_stored_under_its_key_and_a_key_expires_after_its_ttl() {
    let db = payments_db().await;
    let payments = Service::payments(
        &db,
        &[
            "--decline-above-cents",
            "1000",
            "--idempotency-key-ttl",
            "1s",
        ],
    )
    .await;
    let client = http();
    for _ in 0..2 {
        let declined = post_charge(&client, &payments, &charge("big", 1001), Some("k-big"))
            .await
            .unwrap();
        expect_error(declined, StatusCode::PAYMENT_REQUIRED, "charge_declined").await;
    }
    assert_eq!(charges_for(&db, "big").await, 0);

    let body = charge("inv-ttl", 500);
    let first: Value = post_charge(&client, &payments, &body, Some("k-ttl"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let admin = db.admin().await.unwrap();
    ::harness::wait_until(
        "the key k-ttl to pass its expires_at",
        Duration::from_secs(30),
        || async {
            let row = admin
                .query_one(
                    "SELECT expires_at <= now() FROM charge_idempotency_keys WHERE key = 'k-ttl'",
                    &[],
                )
                .await?;
            anyhow::Ok(row.get::<_, bool>(0))
        },
    )
    .await
    .unwrap();
    let after = post_charge(&client, &payments, &body, Some("k-ttl"))
        .await
        .unwrap();
    assert_eq!(after.status(), StatusCode::CREATED);
    assert!(after.headers().get("idempotent-replayed").is_none());
    let after: Value = after.json().await.unwrap();
    assert_ne!(
        after["charge_id"], first["charge_id"],
        "an expired key charges again"
    );
    assert_eq!(charges_for(&db, "inv-ttl").await, 2);
}

#[tokio::test]
async fn a_dropped_answer_after_the_commit_is_found_again_by_its_key() {
    let db = payments_db().await;
    let dropping = Service::payments(&db, &["--fault-drop-after-commit-ratio", "1"]).await;
    let client = http();
    let body = charge("inv-drop", 700);
    let lost = post_charge(&client, &dropping, &body, Some("k-drop")).await;
    let error = lost.expect_err("the answer is dropped: no status line");
    assert!(!error.is_timeout(), "{error:?}");
    assert_eq!(charges_for(&db, "inv-drop").await, 1, "charged nonetheless");
    // The retry (to a healthy instance over the same database) replays it.
    let healthy = Service::payments(&db, &[]).await;
    let replay = post_charge(&client, &healthy, &body, Some("k-drop"))
        .await
        .unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let replay: Value = replay.json().await.unwrap();
    let stored: uuid::Uuid = db
        .admin()
        .await
        .unwrap()
        .query_one("SELECT id FROM charges WHERE reference = 'inv-drop'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(replay["charge_id"], stored.to_string());
    assert_eq!(charges_for(&db, "inv-drop").await, 1);
}

#[tokio::test]
async fn the_fail_hook_charges_nothing_and_the_slow_and_exit_hooks_charge_before_answering() {
    let db = payments_db().await;
    let client = http();
    let failing = Service::payments(&db, &["--fault-fail-ratio", "1"]).await;
    let response = post_charge(&client, &failing, &charge("inv-fail", 1), Some("k-fail"))
        .await
        .unwrap();
    expect_error(response, StatusCode::SERVICE_UNAVAILABLE, "fault_injected").await;
    assert_eq!(charges_for(&db, "inv-fail").await, 0);

    // Slower than the client waits: the charge is made all the same.
    let slow = Service::payments(&db, &["--fault-delay", "5s"]).await;
    let impatient = Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let error = post_charge(&impatient, &slow, &charge("inv-slow", 1), Some("k-slow"))
        .await
        .expect_err("the client gives up first");
    assert!(error.is_timeout(), "{error:?}");
    ::harness::wait_until(
        "the slow charge committed",
        Duration::from_secs(10),
        || async { anyhow::Ok(charges_for(&db, "inv-slow").await == 1) },
    )
    .await
    .unwrap();

    let mut exiting = Service::payments(&db, &["--fault-exit-after-commit"]).await;
    let error = post_charge(&client, &exiting, &charge("inv-exit", 1), Some("k-exit"))
        .await
        .expect_err("the provider exits before answering");
    assert!(!error.is_timeout(), "{error:?}");
    let status = exiting
        .process
        .wait_exit(Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(status.code(), Some(86), "{status}");
    assert_eq!(charges_for(&db, "inv-exit").await, 1);
}
