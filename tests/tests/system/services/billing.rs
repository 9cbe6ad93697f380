//! The Billing service's inbox: a signed event is recorded once and makes
//! exactly one invoice, in one transaction; anything else is refused before
//! it touches the database.

use std::time::{Duration, Instant};

use ::harness::sink::sign;
use reqwest::header::CONTENT_TYPE;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use uuid::Uuid;

use super::{
    BODY_LIMIT, SECRET, Service, count, deliver, deliver_signed, event, expect_error,
    expect_wrong_methods, http, nested_arrays, post_order, stack,
};

#[tokio::test]
async fn billing_records_an_event_once_and_answers_its_replay_204_without_change() {
    let stack = stack().await;
    let billing = Service::billing(&stack, &[], &[]).await;
    let client = http();
    let (id, order_id) = (Uuid::new_v4(), Uuid::new_v4());
    let body = event(id, order_id, 2599).to_string();

    for _ in 0..2 {
        // Our relay's shape: with Idempotency-Key.
        let response = client
            .post(billing.at("/inbox"))
            .header(CONTENT_TYPE, "application/json")
            .header("X-Event-Signature", sign(SECRET, body.as_bytes()))
            .header("Idempotency-Key", id.to_string())
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::NO_CONTENT);
    }
    let db = stack.billing_admin().await.unwrap();
    assert_eq!(count(&db, "processed_events").await, 1);
    assert_eq!(count(&db, "invoices").await, 1);

    let invoices: Value = client
        .get(billing.admin_at(&format!("/invoices?order_id={order_id}")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let invoices = invoices.as_array().expect("a list");
    assert_eq!(invoices.len(), 1);
    assert_eq!(invoices[0]["order_id"], order_id.to_string());
    assert_eq!(invoices[0]["amount_cents"], 2599);
    assert_eq!(invoices[0]["currency"], "EUR");

    let none: Value = client
        .get(billing.admin_at(&format!("/invoices?order_id={}", Uuid::new_v4())))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(none, json!([]));
    let response = client
        .get(billing.admin_at("/invoices?order_id=nope"))
        .send()
        .await
        .unwrap();
    expect_error(response, StatusCode::BAD_REQUEST, "invalid_query").await;

    let text = billing.metrics(&client).await;
    for line in [
        "billing_duplicates_absorbed_total 1",
        "billing_invoices_created_total 1",
        r#"billing_http_requests_total{method="POST",route="/inbox",status="204"} 2"#,
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
}

#[tokio::test]
async fn billing_bad_signatures_are_401_before_parsing_and_write_nothing() {
    let stack = stack().await;
    let billing = Service::billing(&stack, &[], &[]).await;
    let client = http();
    let body = event(Uuid::new_v4(), Uuid::new_v4(), 100).to_string();
    let good = sign(SECRET, body.as_bytes());

    let forged = "ab".repeat(32);
    let variants: [(&str, Option<&str>); 6] = [
        ("forged", Some(&forged)),
        ("missing", None),
        ("truncated", Some(&good[..63])),
        ("upper-case hex", Some(&good.to_ascii_uppercase())),
        (
            "other secret",
            Some(&sign("some-other-secret", body.as_bytes())),
        ),
        ("signature of another body", Some(&sign(SECRET, b"{}"))),
    ];
    for (what, signature) in variants {
        let response = deliver(&client, &billing, &body, signature).await;
        let status = response.status();
        let error = response.text().await.unwrap();
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{what}: {error}");
        assert!(
            error.contains(r#""error":"invalid_signature""#),
            "{what}: {error}"
        );
    }
    // Invalid JSON with a bad signature is 401, not 400: nothing was parsed.
    let response = deliver(&client, &billing, "{not json", Some(&forged)).await;
    expect_error(response, StatusCode::UNAUTHORIZED, "invalid_signature").await;

    let db = stack.billing_admin().await.unwrap();
    assert_eq!(count(&db, "processed_events").await, 0);
    assert_eq!(count(&db, "invoices").await, 0);
    let response = deliver(&client, &billing, &body, Some(&good)).await;
    assert_eq!(
        response.status(),
        StatusCode::NO_CONTENT,
        "the same body, correctly signed"
    );
}

#[tokio::test]
async fn billing_invalid_and_100_deep_json_are_400_after_a_valid_signature() {
    let stack = stack().await;
    let billing = Service::billing(&stack, &[], &[]).await;
    let client = http();

    let body = expect_error(
        deliver_signed(&client, &billing, "{\"id\":").await,
        StatusCode::BAD_REQUEST,
        "invalid_json",
    )
    .await;
    assert!(
        body["detail"].as_str().unwrap().contains("invalid JSON"),
        "{body}"
    );

    let started = Instant::now();
    let body = expect_error(
        deliver_signed(&client, &billing, &nested_arrays(100)).await,
        StatusCode::BAD_REQUEST,
        "invalid_json",
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        body["detail"].as_str().unwrap().contains("deeper than 32"),
        "{body}"
    );

    let db = stack.billing_admin().await.unwrap();
    assert_eq!(count(&db, "processed_events").await, 0);
}

#[tokio::test]
async fn billing_oversized_body_is_413_and_non_json_content_type_is_415() {
    let stack = stack().await;
    let billing = Service::billing(&stack, &[], &[]).await;
    let client = http();

    let big = "x".repeat(BODY_LIMIT + 1);
    let response = deliver(&client, &billing, &big, Some(&sign(SECRET, big.as_bytes()))).await;
    expect_error(response, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large").await;

    let body = event(Uuid::new_v4(), Uuid::new_v4(), 100).to_string();
    let response = client
        .post(billing.at("/inbox"))
        .header(CONTENT_TYPE, "text/plain")
        .header("X-Event-Signature", sign(SECRET, body.as_bytes()))
        .body(body)
        .send()
        .await
        .unwrap();
    expect_error(
        response,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
    )
    .await;

    let db = stack.billing_admin().await.unwrap();
    assert_eq!(count(&db, "processed_events").await, 0);
}

#[tokio::test]
async fn billing_invalid_fields_are_422_naming_the_field_and_write_nothing() {
    let stack = stack().await;
    let billing = Service::billing(&stack, &[], &[]).await;
    let client = http();
    let valid = event(Uuid::new_v4(), Uuid::new_v4(), 100);
    let with = |pointer: &str, value: Value| {
        let mut event = valid.clone();
        *event.pointer_mut(pointer).unwrap() = value;
        event.to_string()
    };
    let cases = [
        (with("/type", json!("OrderShipped")), "type"),
        (with("/id", json!("not-a-uuid")), "id"),
        (with("/id", json!(42)), "id"),
        (with("/data", json!("x")), "data"),
        (with("/data/order_id", json!("1234")), "data.order_id"),
        (with("/data/amount_cents", json!(1.5)), "data.amount_cents"),
        (
            with("/data/amount_cents", json!("2599")),
            "data.amount_cents",
        ),
        (with("/data/amount_cents", json!(0)), "data.amount_cents"),
        (
            with("/data/amount_cents", json!(u64::MAX)),
            "data.amount_cents",
        ),
        (with("/data/currency", json!("eur")), "data.currency"),
        (with("/data/currency", json!("EURO")), "data.currency"),
        (with("/data/currency", json!(null)), "data.currency"),
    ];
    for (body, field) in cases {
        let error = expect_error(
            deliver_signed(&client, &billing, &body).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_event",
        )
        .await;
        assert_eq!(error["field"], field, "{body}");
    }

    // Idempotency-Key, when present, must be the body's id.
    let body = valid.to_string();
    let response = client
        .post(billing.at("/inbox"))
        .header(CONTENT_TYPE, "application/json")
        .header("X-Event-Signature", sign(SECRET, body.as_bytes()))
        .header("Idempotency-Key", Uuid::new_v4().to_string())
        .body(body)
        .send()
        .await
        .unwrap();
    let error = expect_error(response, StatusCode::UNPROCESSABLE_ENTITY, "invalid_event").await;
    assert_eq!(error["field"], "Idempotency-Key");

    let db = stack.billing_admin().await.unwrap();
    assert_eq!(count(&db, "processed_events").await, 0);
    assert_eq!(count(&db, "invoices").await, 0);
}

#[tokio::test]
async fn billing_wrong_method_is_405_with_allow() {
    let stack = stack().await;
    let billing = Service::billing(&stack, &[], &[]).await;
    expect_wrong_methods(&[
        (Method::GET, billing.at("/inbox"), "POST"),
        (Method::POST, billing.admin_at("/invoices"), "GET,HEAD"),
    ])
    .await;
}

#[tokio::test]
async fn billing_database_error_after_the_inbox_insert_is_500_and_rolls_it_back() {
    let stack = stack().await;
    let billing = Service::billing(&stack, &[], &[]).await;
    let client = http();
    let db = stack.billing_admin().await.unwrap();
    // The inbox row goes in, then the invoice insert fails in PostgreSQL.
    db.batch_execute(
        "ALTER TABLE invoices ADD CONSTRAINT test_refuses_xts CHECK (currency <> 'XTS')",
    )
    .await
    .unwrap();
    let mut payload = event(Uuid::new_v4(), Uuid::new_v4(), 100);
    payload["data"]["currency"] = json!("XTS");
    let body = payload.to_string();

    let response = deliver_signed(&client, &billing, &body).await;
    expect_error(
        response,
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal_error",
    )
    .await;
    assert_eq!(
        count(&db, "processed_events").await,
        0,
        "the inbox row was rolled back"
    );
    assert_eq!(count(&db, "invoices").await, 0);

    // Redelivery after the fault is a first delivery, not an absorbed duplicate.
    db.batch_execute("ALTER TABLE invoices DROP CONSTRAINT test_refuses_xts")
        .await
        .unwrap();
    let response = deliver_signed(&client, &billing, &body).await;
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    assert_eq!(count(&db, "processed_events").await, 1);
    assert_eq!(count(&db, "invoices").await, 1);
}

#[tokio::test]
async fn billing_lock_held_past_lock_timeout_is_500_within_the_bound() {
    let stack = stack().await;
    let billing = Service::billing(&stack, &["--lock-timeout-ms", "500"], &[]).await;
    let client = http();
    let locker = stack.billing_admin().await.unwrap();
    locker
        .batch_execute("BEGIN; LOCK TABLE processed_events IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let body = event(Uuid::new_v4(), Uuid::new_v4(), 100).to_string();

    let started = Instant::now();
    let response = deliver_signed(&client, &billing, &body).await;
    let waited = started.elapsed();
    expect_error(
        response,
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal_error",
    )
    .await;
    assert!(waited >= Duration::from_millis(500), "{waited:?}");
    assert!(
        waited < Duration::from_secs(3),
        "lock_timeout bounds the wait: {waited:?}"
    );

    locker.batch_execute("ROLLBACK").await.unwrap();
    let response = deliver_signed(&client, &billing, &body).await;
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    assert_eq!(count(&locker, "invoices").await, 1);
}

#[tokio::test]
async fn billing_50_identical_deliveries_in_parallel_make_exactly_one_invoice() {
    let stack = stack().await;
    // A generous pool wait: this test is about the inbox, not about 503s.
    let billing = Service::billing(&stack, &["--pool-wait-timeout-ms", "10000"], &[]).await;
    let client = http();
    let body = event(Uuid::new_v4(), Uuid::new_v4(), 4200).to_string();
    let signature = sign(SECRET, body.as_bytes());

    let deliveries = (0..50).map(|_| {
        let request = client
            .post(billing.at("/inbox"))
            .header(CONTENT_TYPE, "application/json")
            .header("X-Event-Signature", signature.clone())
            .body(body.clone());
        tokio::spawn(async move { request.send().await.map(|r| r.status()) })
    });
    let statuses: Vec<StatusCode> = futures::future::join_all(deliveries)
        .await
        .into_iter()
        .map(|joined| joined.unwrap().unwrap())
        .collect();
    assert!(
        statuses.iter().all(|s| *s == StatusCode::NO_CONTENT),
        "{statuses:?}"
    );

    let db = stack.billing_admin().await.unwrap();
    assert_eq!(count(&db, "invoices").await, 1);
    assert_eq!(count(&db, "processed_events").await, 1);
    let text = billing.metrics(&client).await;
    assert!(
        text.lines()
            .any(|l| l == "billing_duplicates_absorbed_total 49"),
        "{text}"
    );
}

/// During a rotation Billing accepts the current secret and the previous
/// one (EVENT_SECRET_PREVIOUS, here from its file), and nothing else: not a
/// retired secret, not the one it was started with before.
#[tokio::test]
async fn billing_accepts_old_and_new_secrets_during_rotation_and_rejects_a_third() {
    const NEW: &str = "new-event-secret-0a1b2c3d4e5f6a7b8c9d";
    const OLD: &str = "old-event-secret-9d8c7b6a5f4e3d2c1b0a";
    let stack = stack().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("previous");
    std::fs::write(&file, format!("\n{OLD}\n")).unwrap();
    let file_arg = file.to_str().unwrap();
    let billing = Service::billing(
        &stack,
        &["--event-secret-previous-file", file_arg],
        &[("EVENT_SECRET", NEW)],
    )
    .await;
    let client = http();

    for secret in [NEW, OLD] {
        let body = event(Uuid::new_v4(), Uuid::new_v4(), 100).to_string();
        let response = deliver(
            &client,
            &billing,
            &body,
            Some(&sign(secret, body.as_bytes())),
        )
        .await;
        assert_eq!(
            response.status(),
            StatusCode::NO_CONTENT,
            "signed with {secret}"
        );
    }
    let body = event(Uuid::new_v4(), Uuid::new_v4(), 100).to_string();
    let response = deliver(
        &client,
        &billing,
        &body,
        Some(&sign(
            "retired-event-secret-aaaaaaaaaaaaaaaaaaaa",
            body.as_bytes(),
        )),
    )
    .await;
    expect_error(response, StatusCode::UNAUTHORIZED, "invalid_signature").await;
    let response = deliver(
        &client,
        &billing,
        &body,
        Some(&sign(SECRET, body.as_bytes())),
    )
    .await;
    expect_error(response, StatusCode::UNAUTHORIZED, "invalid_signature").await;
    assert_eq!(
        count(&stack.billing_admin().await.unwrap(), "invoices").await,
        2
    );
}

/// The tutorial's PHP relay (`relay.php`) sends, via curl:
/// `json_encode(['id' => ..., 'type' => ..., 'data' => json_decode(payload::text, true)])`
/// with `Content-Type: application/json`, `X-Event-Signature` and no
/// `Idempotency-Key`. `json_encode` escapes `/` as `\/` and non-ASCII as
/// `\uXXXX`, and `data` keeps jsonb's key order (shorter keys first). Built by
/// hand, byte for byte, and sent over a raw socket.
#[tokio::test]
async fn billing_accepts_the_tutorial_relay_request_byte_for_byte_and_absorbs_its_replay() {
    let stack = stack().await;
    let billing = Service::billing(&stack, &[], &[]).await;
    let (id, order_id) = (Uuid::new_v4(), Uuid::new_v4());
    // `note` stands for any payload text PHP escapes: "café / ✓".
    let body = format!(
        r#"{{"id":"{id}","type":"OrderCreated","data":{{"note":"caf\u00e9 \/ \u2713","currency":"EUR","order_id":"{order_id}","amount_cents":2599}}}}"#
    );
    let host = billing.url.trim_start_matches("http://").to_owned();
    let request = format!(
        "POST /inbox HTTP/1.1\r\nHost: {host}\r\nAccept: */*\r\nContent-Type: application/json\r\n\
         X-Event-Signature: {}\r\nContent-Length: {}\r\n\r\n{body}",
        sign(SECRET, body.as_bytes()),
        body.len()
    );

    for attempt in ["first delivery", "replay"] {
        let mut stream = tokio::net::TcpStream::connect(&host).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
                .await
                .expect("response in time")
                .unwrap();
            assert!(
                n > 0,
                "connection closed early: {}",
                String::from_utf8_lossy(&head)
            );
            head.extend_from_slice(&buf[..n]);
        }
        let head = String::from_utf8_lossy(&head);
        assert!(head.starts_with("HTTP/1.1 204"), "{attempt}: {head}");
    }

    let db = stack.billing_admin().await.unwrap();
    assert_eq!(count(&db, "processed_events").await, 1);
    let row = db
        .query_one(
            "SELECT order_id, amount_cents, currency::text FROM invoices",
            &[],
        )
        .await
        .expect("exactly one invoice");
    assert_eq!(row.get::<_, Uuid>(0), order_id);
    assert_eq!(row.get::<_, i64>(1), 2599);
    assert_eq!(row.get::<_, String>(2), "EUR");
}

/// Issue 18, items 3 and 4: a compressed body, correctly signed, is 415
/// (a compressing proxy is a configuration fault, not a bad event), and a
/// key repeated in one object is 400 in Billing's event parser and in
/// Orders' request parser (which value would count depends on the parser,
/// so neither does). Nothing is written.
#[tokio::test]
async fn compressed_bodies_are_415_and_repeated_keys_400_in_both_services() {
    let stack = stack().await;
    let billing = Service::billing(&stack, &[], &[]).await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let client = http();

    let body = event(Uuid::new_v4(), Uuid::new_v4(), 100).to_string();
    for encoding in ["gzip", "br", "identity, gzip"] {
        let response = client
            .post(billing.at("/inbox"))
            .header(CONTENT_TYPE, "application/json")
            .header("Content-Encoding", encoding)
            .header("X-Event-Signature", sign(SECRET, body.as_bytes()))
            .body(body.clone())
            .send()
            .await
            .unwrap();
        let error = expect_error(
            response,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_content_encoding",
        )
        .await;
        assert!(
            error["detail"].as_str().unwrap().contains("uncompressed"),
            "{error}"
        );
    }
    // identity is the body as is.
    let response = client
        .post(billing.at("/inbox"))
        .header(CONTENT_TYPE, "application/json")
        .header("Content-Encoding", "identity")
        .header("X-Event-Signature", sign(SECRET, body.as_bytes()))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::NO_CONTENT);

    let (first, second) = (Uuid::new_v4(), Uuid::new_v4());
    let twice = format!(
        r#"{{"id":"{first}","id":"{second}","type":"OrderCreated","data":{{"order_id":"{}","amount_cents":100,"currency":"EUR"}}}}"#,
        Uuid::new_v4()
    );
    let error = expect_error(
        deliver_signed(&client, &billing, &twice).await,
        StatusCode::BAD_REQUEST,
        "invalid_json",
    )
    .await;
    assert!(
        error["detail"]
            .as_str()
            .unwrap()
            .contains("duplicate key \"id\""),
        "{error}"
    );
    let nested = format!(
        r#"{{"id":"{first}","type":"OrderCreated","data":{{"order_id":"{}","amount_cents":100,"amount_cents":1,"currency":"EUR"}}}}"#,
        Uuid::new_v4()
    );
    expect_error(
        deliver_signed(&client, &billing, &nested).await,
        StatusCode::BAD_REQUEST,
        "invalid_json",
    )
    .await;
    let db = stack.billing_admin().await.unwrap();
    assert_eq!(
        count(&db, "processed_events").await,
        1,
        "only the identity one"
    );

    let error = expect_error(
        post_order(
            &client,
            &orders,
            r#"{"amount_cents":1,"amount_cents":100000,"currency":"EUR"}"#,
        )
        .await,
        StatusCode::BAD_REQUEST,
        "invalid_json",
    )
    .await;
    assert!(
        error["detail"].as_str().unwrap().contains("duplicate key"),
        "{error}"
    );
    let orders_db = stack.orders_admin().await.unwrap();
    assert_eq!(count(&orders_db, "orders").await, 0);
}
