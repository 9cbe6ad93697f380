//! The Orders and Billing services as their clients see them: the real
//! binaries over real HTTP against a fresh database pair from the harness.
//!
//! Each test names one behaviour and asserts it, including what is in the
//! database afterwards: an error path must leave no row behind.

use std::collections::HashSet;
use std::str::FromStr;
use std::time::{Duration, Instant};

use ::harness::{PgCluster, ServiceProcess, Stack, bins, wait_until};
use hmac::{Hmac, Mac};
use reqwest::header::{ALLOW, CONTENT_TYPE, LOCATION, RETRY_AFTER};
use reqwest::{Client, Response, StatusCode};
use serde_json::{Value, json};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use uuid::Uuid;

/// Longest a service may take to print its listening line.
const START: Duration = Duration::from_secs(30);

/// The secret Billing is started with unless a test says otherwise.
const SECRET: &str = "current-event-secret";

/// The body limit both services default to.
const BODY_LIMIT: usize = 64 * 1024;

// ---------------------------------------------------------------- support

/// A running service binary and its base URL.
struct Service {
    process: ServiceProcess,
    url: String,
}

impl Service {
    async fn start(bin: &str, args: &[&str], envs: &[(&str, &str)]) -> Service {
        let mut all = vec!["--listen", "127.0.0.1:0"];
        all.extend_from_slice(args);
        let process = ServiceProcess::spawn(bins::path(bin), &all, envs).expect("spawn");
        let url = process.listen_addr(START).await.expect("listening line");
        Service { process, url }
    }

    async fn orders(stack: &Stack, args: &[&str], envs: &[(&str, &str)]) -> Service {
        let mut all = vec!["--database-url", stack.orders_app_url.as_str()];
        all.extend_from_slice(args);
        Service::start("orders", &all, envs).await
    }

    async fn billing(stack: &Stack, args: &[&str], envs: &[(&str, &str)]) -> Service {
        let mut all = vec!["--database-url", stack.billing_app_url.as_str()];
        all.extend_from_slice(args);
        let mut with_secret = vec![("EVENT_SECRET", SECRET)];
        with_secret.extend_from_slice(envs);
        Service::start("billing", &all, &with_secret).await
    }

    fn at(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    async fn metrics(&self, client: &Client) -> String {
        let response = client
            .get(self.at("/metrics"))
            .send()
            .await
            .expect("GET /metrics");
        assert_eq!(response.status(), StatusCode::OK);
        response.text().await.expect("metrics text")
    }
}

async fn stack() -> Stack {
    PgCluster::shared()
        .create_stack()
        .await
        .expect("create_stack")
}

fn http() -> Client {
    Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("reqwest client")
}

async fn count(db: &tokio_postgres::Client, table: &str) -> i64 {
    db.query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .expect("count")
        .get(0)
}

/// Asserts status and `"error"` code of a JSON error; returns the body.
async fn expect_error(response: Response, status: StatusCode, code: &str) -> Value {
    let got = response.status();
    let text = response.text().await.expect("error body");
    assert_eq!(got, status, "body: {text}");
    let body: Value = serde_json::from_str(&text).expect("error body is JSON");
    assert_eq!(body["error"], code, "body: {text}");
    body
}

async fn post_order(client: &Client, orders: &Service, body: impl Into<reqwest::Body>) -> Response {
    client
        .post(orders.at("/orders"))
        .header(CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await
        .expect("POST /orders")
}

fn sign(secret: &str, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("hmac key");
    mac.update(body);
    hex::encode(mac.finalize().into_bytes())
}

fn event(id: Uuid, order_id: Uuid, amount_cents: i64) -> Value {
    json!({
        "id": id,
        "type": "OrderCreated",
        "data": {"order_id": order_id, "amount_cents": amount_cents, "currency": "EUR"},
    })
}

/// POSTs `body` to `/inbox` with `signature` (none: header omitted).
async fn deliver(
    client: &Client,
    billing: &Service,
    body: &str,
    signature: Option<&str>,
) -> Response {
    let mut request = client
        .post(billing.at("/inbox"))
        .header(CONTENT_TYPE, "application/json")
        .body(body.to_owned());
    if let Some(signature) = signature {
        request = request.header("X-Event-Signature", signature);
    }
    request.send().await.expect("POST /inbox")
}

async fn deliver_signed(client: &Client, billing: &Service, body: &str) -> Response {
    deliver(client, billing, body, Some(&sign(SECRET, body.as_bytes()))).await
}

fn nested_arrays(depth: usize) -> String {
    format!("{}{}", "[".repeat(depth), "]".repeat(depth))
}

/// A valid order body padded to exactly `len` bytes.
fn order_of_len(len: usize) -> String {
    let empty = r#"{"amount_cents":1,"currency":"EUR","pad":""}"#;
    let pad = "x".repeat(len - empty.len());
    format!(r#"{{"amount_cents":1,"currency":"EUR","pad":"{pad}"}}"#)
}

// ---------------------------------------------------------------- orders

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
    let client = http();

    let response = client.put(orders.at("/orders")).send().await.unwrap();
    assert_eq!(response.headers()[ALLOW], "POST");
    expect_error(
        response,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    )
    .await;

    let response = client.get(orders.at("/orders")).send().await.unwrap();
    assert_eq!(response.headers()[ALLOW], "POST");
    expect_error(
        response,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    )
    .await;

    let response = client
        .delete(orders.at(&format!("/orders/{}", Uuid::new_v4())))
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()[ALLOW], "GET,HEAD");
    expect_error(
        response,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    )
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

// ---------------------------------------------------------------- billing

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
        .get(billing.at(&format!("/invoices?order_id={order_id}")))
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
        .get(billing.at(&format!("/invoices?order_id={}", Uuid::new_v4())))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(none, json!([]));
    let response = client
        .get(billing.at("/invoices?order_id=nope"))
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
        ("[]".to_owned(), "event"),
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
    let client = http();
    let response = client.get(billing.at("/inbox")).send().await.unwrap();
    assert_eq!(response.headers()[ALLOW], "POST");
    expect_error(
        response,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    )
    .await;
    let response = client.post(billing.at("/invoices")).send().await.unwrap();
    assert_eq!(response.headers()[ALLOW], "GET,HEAD");
    expect_error(
        response,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    )
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

#[tokio::test]
async fn billing_accepts_old_and_new_secrets_during_rotation_and_rejects_a_third() {
    let stack = stack().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("secrets");
    std::fs::write(&file, "\nfrom-file-secret\n").unwrap();
    let file_arg = file.to_str().unwrap();
    let billing = Service::billing(
        &stack,
        &["--event-secret-file", file_arg],
        &[("EVENT_SECRET", "new-secret, old-secret")],
    )
    .await;
    let client = http();

    for secret in ["new-secret", "old-secret", "from-file-secret"] {
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
        Some(&sign("retired-secret", body.as_bytes())),
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
        3
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

#[tokio::test]
async fn billing_refuses_to_start_without_a_secret_naming_the_setting() {
    let stack = stack().await;
    let mut process = ServiceProcess::spawn(
        bins::path("billing"),
        &[
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            &stack.billing_app_url,
        ],
        &[("EVENT_SECRET", " , ")],
    )
    .unwrap();
    let status = process.wait_exit(Duration::from_secs(20)).await.unwrap();
    assert!(!status.success(), "{status:?}");
    let line = process
        .wait_for_line("no event secret configured", Duration::from_secs(5))
        .await
        .unwrap();
    assert!(line.contains("EVENT_SECRET"), "{line}");
    let logs = process.logs();
    assert!(!logs.contains(::harness::process::LISTENING), "{logs}");
}

// ---------------------------------------------------------------- both

#[tokio::test]
async fn services_never_log_credentials_and_exit_0_on_sigterm() {
    let stack = stack().await;
    let debug = [("RUST_LOG", "debug")];
    let mut orders = Service::orders(&stack, &["--log-format", "json"], &debug).await;
    let mut billing = Service::billing(&stack, &[], &debug).await;
    let client = http();

    post_order(&client, &orders, r#"{"amount_cents":1,"currency":"EUR"}"#).await;
    post_order(&client, &orders, "{").await;
    let body = event(Uuid::new_v4(), Uuid::new_v4(), 100).to_string();
    deliver_signed(&client, &billing, &body).await;
    deliver(&client, &billing, &body, Some("00")).await;

    for (service, url) in [
        (&mut orders, &stack.orders_app_url),
        (&mut billing, &stack.billing_app_url),
    ] {
        service.process.sigterm();
        let status = service
            .process
            .wait_exit(Duration::from_secs(10))
            .await
            .unwrap();
        assert!(status.success(), "{status:?}\n{}", service.process.logs());
        // The last line a service logs; after it, the captured logs are complete.
        service
            .process
            .wait_for_line("stopped", Duration::from_secs(5))
            .await
            .unwrap();
        let logs = service.process.logs();
        let config = tokio_postgres::Config::from_str(url).unwrap();
        let password = String::from_utf8(config.get_password().unwrap().to_vec()).unwrap();
        assert!(
            !logs.contains(&password),
            "the database password leaked:\n{logs}"
        );
        assert!(!logs.contains(SECRET), "the event secret leaked:\n{logs}");
        let db = config.get_dbname().unwrap();
        assert!(
            logs.contains(&format!("dbname={db}")),
            "host/db are logged:\n{logs}"
        );
    }
    // JSON logs are one object per line (stdout's listening line aside).
    let json_lines = orders.process.logs();
    assert!(
        json_lines
            .lines()
            .filter(|l| !l.starts_with(::harness::process::LISTENING))
            .all(|l| serde_json::from_str::<Value>(l).is_ok()),
        "{json_lines}"
    );
}
