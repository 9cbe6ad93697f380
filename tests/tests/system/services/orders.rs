//! The Orders service's API: an order and its `OrderCreated` outbox row
//! commit together or not at all, whatever the client sends and whatever
//! PostgreSQL does meanwhile.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use ::harness::wait_until;
use reqwest::header::{CONTENT_TYPE, LOCATION, RETRY_AFTER};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use uuid::Uuid;

use super::{
    BODY_LIMIT, Service, count, expect_error, expect_wrong_methods, http, nested_arrays,
    order_of_len, post_order, stack,
};

#[tokio::test]
async fn orders_post_commits_order_and_outbox_row_then_get_returns_it() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let client = http();

    let response = post_order(
        &client,
        &orders,
        r#"{"amount_cents":2599,"currency":"eur"}"#,
    )
    .await;
    assert_eq!(response.status(), StatusCode::CREATED);
    let location = response.headers()[LOCATION].to_str().unwrap().to_owned();
    let created: Value = response.json().await.unwrap();
    let order_id = Uuid::parse_str(created["order_id"].as_str().unwrap()).unwrap();
    let event_id = Uuid::parse_str(created["event_id"].as_str().unwrap()).unwrap();
    assert_eq!(location, format!("/orders/{order_id}"));

    let fetched: Value = client
        .get(orders.at(&location))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(fetched["order_id"], order_id.to_string());
    assert_eq!(fetched["amount_cents"], 2599);
    assert_eq!(fetched["currency"], "EUR", "currency is upper-cased");

    let db = stack.orders_admin().await.unwrap();
    let row = db
        .query_one(
            "SELECT event_type, aggregate_id, payload, jsonb_typeof(payload->'amount_cents') \
             FROM outbox WHERE id = $1",
            &[&event_id],
        )
        .await
        .expect("the outbox row exists");
    assert_eq!(row.get::<_, String>(0), "OrderCreated");
    assert_eq!(row.get::<_, Uuid>(1), order_id);
    assert_eq!(
        row.get::<_, Value>(2),
        json!({"order_id": order_id, "amount_cents": 2599, "currency": "EUR"})
    );
    assert_eq!(
        row.get::<_, String>(3),
        "number",
        "amount stays a JSON integer"
    );

    // i64::MAX survives exactly: no f64 on the way.
    let response = post_order(
        &client,
        &orders,
        r#"{"amount_cents":9223372036854775807,"currency":"USD"}"#,
    )
    .await;
    assert_eq!(response.status(), StatusCode::CREATED);
    let created: Value = response.json().await.unwrap();
    let event_id = Uuid::parse_str(created["event_id"].as_str().unwrap()).unwrap();
    let text: String = db
        .query_one(
            "SELECT payload->>'amount_cents' FROM outbox WHERE id = $1",
            &[&event_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(text, "9223372036854775807");
}

#[tokio::test]
async fn orders_invalid_json_is_400_with_a_reason_and_writes_nothing() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let client = http();
    for bad in [
        r#"{"amount_cents":"#,
        "not json",
        r#"{"amount_cents":1,"currency":"EUR"} trailing"#,
        "",
    ] {
        let body = expect_error(
            post_order(&client, &orders, bad).await,
            StatusCode::BAD_REQUEST,
            "invalid_json",
        )
        .await;
        assert!(
            body["detail"].as_str().unwrap().contains("invalid JSON"),
            "{body} for {bad:?}"
        );
    }
    assert_eq!(
        count(&stack.orders_admin().await.unwrap(), "orders").await,
        0
    );
}

#[tokio::test]
async fn orders_json_deeper_than_32_is_400_quickly_and_32_deep_parses() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let client = http();

    let started = Instant::now();
    let body = expect_error(
        post_order(&client, &orders, nested_arrays(100)).await,
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

    expect_error(
        post_order(&client, &orders, nested_arrays(33)).await,
        StatusCode::BAD_REQUEST,
        "invalid_json",
    )
    .await;
    // 32 levels is within the limit: it parses, and is then no order (422).
    let body = expect_error(
        post_order(&client, &orders, nested_arrays(32)).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_order",
    )
    .await;
    assert_eq!(body["field"], "body");
    assert_eq!(
        count(&stack.orders_admin().await.unwrap(), "orders").await,
        0
    );
}

#[tokio::test]
async fn orders_body_over_64_kib_is_413_and_64_kib_is_accepted() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let client = http();

    let response = post_order(&client, &orders, order_of_len(BODY_LIMIT + 1)).await;
    expect_error(response, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large").await;
    let response = post_order(&client, &orders, "x".repeat(1024 * 1024)).await;
    expect_error(response, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large").await;
    assert_eq!(
        count(&stack.orders_admin().await.unwrap(), "orders").await,
        0
    );

    let response = post_order(&client, &orders, order_of_len(BODY_LIMIT)).await;
    assert_eq!(response.status(), StatusCode::CREATED);
}

#[tokio::test]
async fn orders_non_json_content_type_is_415() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let client = http();
    let body = r#"{"amount_cents":100,"currency":"EUR"}"#;

    for content_type in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "application/jsonp",
    ] {
        let response = client
            .post(orders.at("/orders"))
            .header(CONTENT_TYPE, content_type)
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
    }
    let response = client
        .post(orders.at("/orders"))
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
    assert_eq!(
        count(&stack.orders_admin().await.unwrap(), "orders").await,
        0
    );

    let response = client
        .post(orders.at("/orders"))
        .header(CONTENT_TYPE, "application/json; charset=utf-8")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status(),
        StatusCode::CREATED,
        "parameters are allowed"
    );
}

#[tokio::test]
async fn orders_invalid_fields_are_422_naming_the_field_and_write_nothing() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let client = http();
    let cases = [
        (r#"{"amount_cents":1.5,"currency":"EUR"}"#, "amount_cents"),
        (r#"{"amount_cents":1.0,"currency":"EUR"}"#, "amount_cents"),
        (r#"{"amount_cents":1e3,"currency":"EUR"}"#, "amount_cents"),
        (r#"{"amount_cents":"12","currency":"EUR"}"#, "amount_cents"),
        (r#"{"amount_cents":0,"currency":"EUR"}"#, "amount_cents"),
        (r#"{"amount_cents":-5,"currency":"EUR"}"#, "amount_cents"),
        (
            r#"{"amount_cents":9223372036854775808,"currency":"EUR"}"#,
            "amount_cents",
        ),
        (
            r#"{"amount_cents":123456789012345678901234567890,"currency":"EUR"}"#,
            "amount_cents",
        ),
        (r#"{"amount_cents":null,"currency":"EUR"}"#, "amount_cents"),
        (r#"{"currency":"EUR"}"#, "amount_cents"),
        (r#"{"amount_cents":100,"currency":"EURO"}"#, "currency"),
        (r#"{"amount_cents":100,"currency":"E1R"}"#, "currency"),
        (r#"{"amount_cents":100,"currency":"éur"}"#, "currency"),
        (r#"{"amount_cents":100,"currency":978}"#, "currency"),
        (r#"{"amount_cents":100}"#, "currency"),
        (r#"[{"amount_cents":100,"currency":"EUR"}]"#, "body"),
    ];
    for (bad, field) in cases {
        let body = expect_error(
            post_order(&client, &orders, bad).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_order",
        )
        .await;
        assert_eq!(body["field"], field, "{bad}");
    }
    let db = stack.orders_admin().await.unwrap();
    assert_eq!(count(&db, "orders").await, 0);
    assert_eq!(count(&db, "outbox").await, 0);
}

#[tokio::test]
async fn orders_wrong_method_is_405_with_allow() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let one = orders.at(&format!("/orders/{}", Uuid::new_v4()));
    expect_wrong_methods(&[
        (Method::PUT, orders.at("/orders"), "POST"),
        (Method::GET, orders.at("/orders"), "POST"),
        (Method::DELETE, one, "GET,HEAD"),
    ])
    .await;
}

#[tokio::test]
async fn orders_unknown_order_is_404() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let client = http();
    for id in [Uuid::new_v4().to_string(), "not-a-uuid".to_owned()] {
        let response = client
            .get(orders.at(&format!("/orders/{id}")))
            .send()
            .await
            .unwrap();
        expect_error(response, StatusCode::NOT_FOUND, "order_not_found").await;
    }
    let response = client.get(orders.at("/nowhere")).send().await.unwrap();
    expect_error(response, StatusCode::NOT_FOUND, "not_found").await;
}

#[tokio::test]
async fn orders_failure_between_the_two_inserts_is_500_and_leaves_neither_row() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[("ORDERS_FAULT_AFTER_ORDER_INSERT", "1")]).await;
    let client = http();

    let response = post_order(
        &client,
        &orders,
        r#"{"amount_cents":2599,"currency":"EUR"}"#,
    )
    .await;
    expect_error(
        response,
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal_error",
    )
    .await;
    // The hook logs after the order insert succeeded, inside the transaction.
    orders
        .process
        .wait_for_line(
            "failing between the order and outbox inserts",
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let db = stack.orders_admin().await.unwrap();
    assert_eq!(
        count(&db, "orders").await,
        0,
        "the order insert was rolled back"
    );
    assert_eq!(count(&db, "outbox").await, 0);
}

#[tokio::test]
async fn orders_database_error_after_the_order_insert_is_500_and_commits_nothing() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let client = http();
    let db = stack.orders_admin().await.unwrap();
    // The order insert succeeds; the outbox insert then fails in PostgreSQL.
    db.batch_execute("REVOKE INSERT ON outbox FROM orders_app")
        .await
        .unwrap();

    let response = post_order(
        &client,
        &orders,
        r#"{"amount_cents":2599,"currency":"EUR"}"#,
    )
    .await;
    let body = expect_error(
        response,
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal_error",
    )
    .await;
    assert!(
        !body.to_string().contains("outbox"),
        "no database detail leaks: {body}"
    );
    assert_eq!(count(&db, "orders").await, 0, "the order was rolled back");
    assert_eq!(count(&db, "outbox").await, 0);

    db.batch_execute("GRANT INSERT ON outbox TO orders_app")
        .await
        .unwrap();
    let response = post_order(
        &client,
        &orders,
        r#"{"amount_cents":2599,"currency":"EUR"}"#,
    )
    .await;
    assert_eq!(
        response.status(),
        StatusCode::CREATED,
        "the pooled connection recovered"
    );
    assert_eq!(count(&db, "orders").await, 1);
    assert_eq!(count(&db, "outbox").await, 1);
}

#[tokio::test]
async fn orders_pool_exhausted_past_its_wait_is_503_with_retry_after() {
    let stack = stack().await;
    let orders = Service::orders(
        &stack,
        &[
            "--pool-size",
            "1",
            "--pool-wait-timeout-ms",
            "200",
            "--lock-timeout-ms",
            "10000",
        ],
        &[],
    )
    .await;
    let client = http();
    let locker = stack.orders_admin().await.unwrap();
    let observer = stack.orders_admin().await.unwrap();
    locker
        .batch_execute("BEGIN; LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();

    // The first request takes the only connection and waits on the lock.
    let first = tokio::spawn({
        let client = client.clone();
        let url = orders.at("/orders");
        async move {
            client
                .post(url)
                .header(CONTENT_TYPE, "application/json")
                .body(r#"{"amount_cents":1,"currency":"EUR"}"#)
                .send()
                .await
                .map(|r| r.status())
        }
    });
    wait_until(
        "the first request to wait on the lock",
        Duration::from_secs(10),
        || async {
            let waiting: i64 = observer
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                 WHERE application_name = 'orders' AND wait_event_type = 'Lock'",
                    &[],
                )
                .await?
                .get(0);
            Ok::<bool, anyhow::Error>(waiting == 1)
        },
    )
    .await
    .unwrap();

    let started = Instant::now();
    let response = post_order(&client, &orders, r#"{"amount_cents":2,"currency":"EUR"}"#).await;
    let waited = started.elapsed();
    assert_eq!(response.headers()[RETRY_AFTER], "1");
    expect_error(response, StatusCode::SERVICE_UNAVAILABLE, "pool_exhausted").await;
    assert!(
        waited >= Duration::from_millis(200),
        "answered before the pool wait: {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(3),
        "the pool wait is bounded: {waited:?}"
    );

    locker.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(first.await.unwrap().unwrap(), StatusCode::CREATED);
    assert_eq!(
        count(&observer, "orders").await,
        1,
        "only the first request committed"
    );
}

/// Makes every insert into `orders` sleep `seconds` in PostgreSQL.
async fn slow_down_order_inserts(db: &tokio_postgres::Client, seconds: f64) {
    db.batch_execute(&format!(
        "CREATE FUNCTION test_slow_insert() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep({seconds}); RETURN NEW; END $$; \
         CREATE TRIGGER test_slow_insert BEFORE INSERT ON orders \
         FOR EACH ROW EXECUTE FUNCTION test_slow_insert()"
    ))
    .await
    .unwrap();
}

#[tokio::test]
async fn orders_statement_over_statement_timeout_is_500_within_the_bound() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &["--statement-timeout-ms", "300"], &[]).await;
    let client = http();
    let db = stack.orders_admin().await.unwrap();
    slow_down_order_inserts(&db, 5.0).await;

    let started = Instant::now();
    let response = post_order(&client, &orders, r#"{"amount_cents":1,"currency":"EUR"}"#).await;
    let waited = started.elapsed();
    expect_error(
        response,
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal_error",
    )
    .await;
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    assert!(
        waited < Duration::from_secs(3),
        "statement_timeout bounds it: {waited:?}"
    );
    assert_eq!(count(&db, "orders").await, 0);
}

#[tokio::test]
async fn orders_request_over_request_timeout_is_503_and_its_transaction_rolls_back() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &["--request-timeout-ms", "300"], &[]).await;
    let client = http();
    let db = stack.orders_admin().await.unwrap();
    slow_down_order_inserts(&db, 1.0).await;

    let started = Instant::now();
    let response = post_order(&client, &orders, r#"{"amount_cents":1,"currency":"EUR"}"#).await;
    let waited = started.elapsed();
    expect_error(response, StatusCode::SERVICE_UNAVAILABLE, "request_timeout").await;
    assert!(
        waited < Duration::from_millis(900),
        "answered before the insert ended: {waited:?}"
    );

    // The abandoned insert finishes in PostgreSQL and is rolled back.
    wait_until(
        "the abandoned transaction to end",
        Duration::from_secs(10),
        || async {
            let busy: i64 = db
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                 WHERE application_name = 'orders' AND state <> 'idle'",
                    &[],
                )
                .await?
                .get(0);
            Ok::<bool, anyhow::Error>(busy == 0)
        },
    )
    .await
    .unwrap();
    assert_eq!(count(&db, "orders").await, 0);
    assert_eq!(count(&db, "outbox").await, 0);

    db.batch_execute("DROP TRIGGER test_slow_insert ON orders")
        .await
        .unwrap();
    let response = post_order(&client, &orders, r#"{"amount_cents":1,"currency":"EUR"}"#).await;
    assert_eq!(
        response.status(),
        StatusCode::CREATED,
        "the pool is healthy again"
    );
    assert_eq!(count(&db, "orders").await, 1);
}

#[tokio::test]
async fn orders_sessions_run_with_bounded_timeouts_and_custom_plans() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let client = http();
    let db = stack.orders_admin().await.unwrap();
    // A trigger reads the settings inside the service's own session.
    db.batch_execute(
        "CREATE TABLE test_seen (name text, setting text); \
         CREATE FUNCTION test_record_settings() RETURNS trigger LANGUAGE plpgsql \
         SECURITY DEFINER AS $$ BEGIN \
           INSERT INTO test_seen SELECT s, current_setting(s) FROM unnest(ARRAY[ \
             'statement_timeout', 'lock_timeout', 'idle_in_transaction_session_timeout', \
             'plan_cache_mode', 'application_name']) AS s; \
           RETURN NEW; END $$; \
         CREATE TRIGGER test_record_settings AFTER INSERT ON orders \
         FOR EACH ROW EXECUTE FUNCTION test_record_settings()",
    )
    .await
    .unwrap();

    let response = post_order(&client, &orders, r#"{"amount_cents":1,"currency":"EUR"}"#).await;
    assert_eq!(response.status(), StatusCode::CREATED);
    let seen: Vec<(String, String)> = db
        .query("SELECT name, setting FROM test_seen ORDER BY name", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let expected = [
        ("application_name", "orders"),
        ("idle_in_transaction_session_timeout", "10s"),
        ("lock_timeout", "1s"),
        ("plan_cache_mode", "force_custom_plan"),
        ("statement_timeout", "3s"),
    ];
    let expected: Vec<(String, String)> = expected
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    assert_eq!(seen, expected);
}

#[tokio::test]
async fn orders_2000_posts_from_16_clients_commit_2000_orders_and_events_with_unique_ids() {
    const CLIENTS: usize = 16;
    const PER_CLIENT: usize = 125;
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let client = http();

    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let client = client.clone();
        let url = orders.at("/orders");
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::with_capacity(PER_CLIENT);
            for i in 0..PER_CLIENT {
                let amount = c * PER_CLIENT + i + 1;
                let response = client
                    .post(&url)
                    .header(CONTENT_TYPE, "application/json")
                    .body(format!(r#"{{"amount_cents":{amount},"currency":"EUR"}}"#))
                    .send()
                    .await
                    .expect("POST /orders");
                assert_eq!(response.status(), StatusCode::CREATED);
                let created: Value = response.json().await.expect("json");
                ids.push((
                    created["order_id"].as_str().unwrap().to_owned(),
                    created["event_id"].as_str().unwrap().to_owned(),
                ));
            }
            ids
        }));
    }
    let mut order_ids = HashSet::new();
    let mut event_ids = HashSet::new();
    for task in tasks {
        for (order_id, event_id) in task.await.unwrap() {
            order_ids.insert(order_id);
            event_ids.insert(event_id);
        }
    }
    eprintln!(
        "2000 orders from {CLIENTS} clients in {:?}",
        started.elapsed()
    );
    assert_eq!(order_ids.len(), 2000);
    assert_eq!(event_ids.len(), 2000);

    let db = stack.orders_admin().await.unwrap();
    assert_eq!(count(&db, "orders").await, 2000);
    assert_eq!(count(&db, "outbox").await, 2000);
    let row = db
        .query_one(
            "SELECT count(DISTINCT o.aggregate_id), count(DISTINCT o.id), \
                    count(*) FILTER (WHERE (o.payload->>'amount_cents')::bigint = r.amount_cents \
                                       AND o.payload->>'order_id' = r.id::text) \
             FROM outbox o JOIN orders r ON r.id = o.aggregate_id",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 2000, "one event per order");
    assert_eq!(row.get::<_, i64>(1), 2000);
    assert_eq!(
        row.get::<_, i64>(2),
        2000,
        "every payload matches its order"
    );
}

#[tokio::test]
async fn orders_healthz_is_up_and_metrics_count_requests_by_route_and_status() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let client = http();

    let response = client.get(orders.at("/healthz")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    post_order(&client, &orders, r#"{"amount_cents":1,"currency":"EUR"}"#).await;
    post_order(&client, &orders, r#"{"amount_cents":0,"currency":"EUR"}"#).await;

    let text = orders.metrics(&client).await;
    for line in [
        r#"orders_http_requests_total{method="POST",route="/orders",status="201"} 1"#,
        r#"orders_http_requests_total{method="POST",route="/orders",status="422"} 1"#,
        r#"orders_http_request_duration_seconds_count{method="POST",route="/orders"} 2"#,
        "orders_created_total 1",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
}

/// `POST /orders` with an `Idempotency-Key`; the response.
async fn post_order_with_key(
    client: &reqwest::Client,
    orders: &Service,
    key: &str,
    body: &str,
) -> reqwest::Response {
    client
        .post(orders.at("/orders"))
        .header(CONTENT_TYPE, "application/json")
        .header("Idempotency-Key", key)
        .body(body.to_owned())
        .send()
        .await
        .expect("POST /orders")
}

/// A 201's ids, its `Location`, and whether it says it was replayed.
async fn created(response: reqwest::Response) -> (Uuid, Uuid, String, bool) {
    let status = response.status();
    let location = response
        .headers()
        .get(LOCATION)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let replayed = match response.headers().get("idempotent-replayed") {
        None => false,
        Some(v) if v == "true" => true,
        Some(v) => panic!("Idempotent-Replayed: {v:?}"),
    };
    let text = response.text().await.unwrap();
    assert_eq!(status, StatusCode::CREATED, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    let id = |k: &str| Uuid::parse_str(body[k].as_str().unwrap()).unwrap();
    (id("order_id"), id("event_id"), location, replayed)
}

#[tokio::test]
async fn orders_idempotency_key_repeat_gets_the_original_answer_and_another_body_422() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let client = http();
    let db = stack.orders_admin().await.unwrap();
    let body = r#"{"amount_cents":2599,"currency":"EUR"}"#;

    let (order_id, event_id, location, replayed) =
        created(post_order_with_key(&client, &orders, "abc-123", body).await).await;
    assert!(!replayed, "the first answer is not a replay");
    assert_eq!(location, format!("/orders/{order_id}"));

    // The same request again, formatted differently, and with the key in
    // its structured-field (quoted) form: the original status and ids.
    for (key, again) in [
        ("abc-123", body),
        ("abc-123", r#"{ "currency": "EUR", "amount_cents": 2599 }"#),
        ("\"abc-123\"", body),
    ] {
        let repeat = created(post_order_with_key(&client, &orders, key, again).await).await;
        assert_eq!(
            repeat,
            (order_id, event_id, location.clone(), true),
            "{key} {again}"
        );
    }

    // The same key with another body: 422, nothing written.
    for other in [
        r#"{"amount_cents":2600,"currency":"EUR"}"#,
        r#"{"amount_cents":2599,"currency":"EUR","note":"x"}"#,
    ] {
        let body = expect_error(
            post_order_with_key(&client, &orders, "abc-123", other).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_key_reused",
        )
        .await;
        assert_eq!(body["field"], "Idempotency-Key");
    }
    // A malformed key: 400, nothing written.
    for bad in ["a b", "\"open", &"k".repeat(256)] {
        expect_error(
            post_order_with_key(&client, &orders, bad, body).await,
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
        )
        .await;
    }
    assert_eq!(count(&db, "orders").await, 1);
    assert_eq!(count(&db, "outbox").await, 1);

    // Another key, or no key, is another order.
    let (other, _, _, replayed) =
        created(post_order_with_key(&client, &orders, "abc-124", body).await).await;
    assert!(!replayed);
    assert_ne!(other, order_id);
    for _ in 0..2 {
        assert_eq!(post_order(&client, &orders, body).await.status(), 201);
    }
    assert_eq!(count(&db, "orders").await, 4);
    assert_eq!(count(&db, "outbox").await, 4);

    // Stored under the endpoint's scope with the order, for 24 h by default.
    let row = db
        .query_one(
            "SELECT scope, order_id, event_id, status, \
                    extract(epoch FROM expires_at - created_at)::float8 \
             FROM order_idempotency_keys WHERE key = 'abc-123'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "POST /orders");
    assert_eq!(row.get::<_, Uuid>(1), order_id);
    assert_eq!(row.get::<_, Uuid>(2), event_id);
    assert_eq!(row.get::<_, i16>(3), 201);
    let ttl = row.get::<_, f64>(4);
    assert!((ttl - 86_400.0).abs() < 60.0, "expires after 24 h: {ttl} s");
    let metrics = orders.metrics(&client).await;
    assert!(
        metrics.contains("orders_idempotent_replays_total 3"),
        "{metrics}"
    );

    // Once expired, the key makes a new order and the row follows it.
    db.batch_execute(
        "UPDATE order_idempotency_keys SET expires_at = now() - interval '1 second' \
         WHERE key = 'abc-123'",
    )
    .await
    .unwrap();
    let (renewed, renewed_event, _, replayed) = created(
        post_order_with_key(
            &client,
            &orders,
            "abc-123",
            r#"{"amount_cents":1,"currency":"EUR"}"#,
        )
        .await,
    )
    .await;
    assert!(!replayed);
    assert_ne!(renewed, order_id);
    let row = db
        .query_one(
            "SELECT order_id, event_id, expires_at > now() FROM order_idempotency_keys \
             WHERE key = 'abc-123'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, Uuid>(0),
            row.get::<_, Uuid>(1),
            row.get::<_, bool>(2)
        ),
        (renewed, renewed_event, true)
    );
    assert_eq!(count(&db, "orders").await, 5);
}

#[tokio::test]
async fn orders_identical_requests_with_one_key_at_once_create_one_order() {
    const AT_ONCE: usize = 4;
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let client = http();
    let db = stack.orders_admin().await.unwrap();
    // Every order insert counts itself (a sequence survives a rollback) and
    // sleeps, so the requests' transactions overlap for a second. (SECURITY
    // DEFINER: orders_app has no privilege on the test's sequence.)
    db.batch_execute(
        "CREATE SEQUENCE test_order_attempts; \
         CREATE FUNCTION test_slow_insert() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS \
         $$ BEGIN PERFORM nextval('test_order_attempts'); PERFORM pg_sleep(1); RETURN NEW; END $$; \
         CREATE TRIGGER test_slow_insert BEFORE INSERT ON orders \
         FOR EACH ROW EXECUTE FUNCTION test_slow_insert()",
    )
    .await
    .unwrap();

    let body = r#"{"amount_cents":700,"currency":"EUR"}"#;
    let requests = futures::future::join_all(
        (0..AT_ONCE).map(|_| post_order_with_key(&client, &orders, "same-key-1", body)),
    );
    // While they run: every one of them is inside its order insert at the
    // same moment (the proof that they were concurrent).
    let overlap = async {
        wait_until(
            "all requests inside their transactions at once",
            Duration::from_secs(20),
            || async {
                let sleeping: i64 = db
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity \
                         WHERE usename = 'orders_app' AND datname = current_database() \
                           AND wait_event = 'PgSleep'",
                        &[],
                    )
                    .await
                    .unwrap()
                    .get(0);
                sleeping == AT_ONCE as i64
            },
        )
        .await
    };
    let (responses, overlap) = tokio::join!(requests, overlap);
    overlap.unwrap();
    let mut answers = Vec::new();
    for response in responses {
        answers.push(created(response).await);
    }
    let first = answers.iter().find(|a| !a.3).expect("one original answer");
    assert_eq!(
        answers.iter().filter(|a| !a.3).count(),
        1,
        "exactly one request created the order: {answers:?}"
    );
    for a in &answers {
        assert_eq!(
            (a.0, a.1),
            (first.0, first.1),
            "same ids for all: {answers:?}"
        );
    }
    let attempts: i64 = db
        .query_one("SELECT last_value FROM test_order_attempts", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        attempts, AT_ONCE as i64,
        "each request inserted, all but one rolled back"
    );
    assert_eq!(count(&db, "orders").await, 1);
    assert_eq!(count(&db, "outbox").await, 1);
    assert_eq!(count(&db, "order_idempotency_keys").await, 1);
}

#[tokio::test]
async fn orders_idempotency_key_held_past_lock_timeout_is_409_and_free_once_released() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &["--lock-timeout-ms", "300"], &[]).await;
    let client = http();
    let body = r#"{"amount_cents":5,"currency":"EUR"}"#;
    // Another transaction holds the key, uncommitted: the original request
    // still running.
    let (mut holder, connection) =
        tokio_postgres::connect(&stack.orders_admin_url, tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    let tx = holder.transaction().await.unwrap();
    tx.batch_execute(
        "INSERT INTO orders (id, amount_cents, currency) \
           VALUES ('44444444-4444-4444-8444-444444444444', 5, 'EUR'); \
         INSERT INTO order_idempotency_keys (scope, key, fingerprint, order_id, event_id, status, expires_at) \
           VALUES ('POST /orders', 'held-key', '\\x00', '44444444-4444-4444-8444-444444444444', \
                   gen_random_uuid(), 201, now() + interval '1 hour')",
    )
    .await
    .unwrap();

    let started = Instant::now();
    expect_error(
        post_order_with_key(&client, &orders, "held-key", body).await,
        StatusCode::CONFLICT,
        "idempotency_key_in_progress",
    )
    .await;
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "it waited for the lock"
    );
    tx.rollback().await.unwrap();

    // Released (the holder rolled back): the key is free, a new order.
    let (order_id, _, _, replayed) =
        created(post_order_with_key(&client, &orders, "held-key", body).await).await;
    assert!(!replayed);
    let db = stack.orders_admin().await.unwrap();
    assert_eq!(count(&db, "orders").await, 1);
    let stored: Uuid = db
        .query_one(
            "SELECT order_id FROM order_idempotency_keys WHERE key = 'held-key'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, order_id);
}
