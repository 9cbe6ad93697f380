//! The Orders and Billing services as their clients see them, without the
//! relay: the real binaries over real HTTP against a fresh database pair
//! from the harness.
//!
//! - [`orders`]: `POST /orders`, `GET /orders/{id}`, the transaction that
//!   writes the order and its outbox row, timeouts and the pool.
//! - [`billing`]: `POST /inbox` (signature, validation, the inbox row and the
//!   invoice in one transaction, replays), `GET /invoices`, secret rotation.
//! - [`billing_batches`]: `POST /inbox` with a batch: every event in one
//!   transaction, replays and overlaps, a bad batch refused whole.
//! - [`payments`]: the payment provider's `POST /charges`: one charge per
//!   `Idempotency-Key`, and its test hooks.
//! - [`charges`]: Billing charging each invoice at the provider once,
//!   whatever crashes or fails on either side.
//! - here: the client helpers both use, and what holds for both services.
//!
//! Each test names one behaviour and asserts it, including what is in the
//! database afterwards: an error path must leave no row behind.

mod billing;
mod billing_batches;
mod charges;
mod config;
mod orders;
mod payments;
mod pool;

use std::str::FromStr;
use std::time::Duration;

use ::harness::sink::sign;
use ::harness::{PgCluster, ServiceProcess, Stack, bins};
use reqwest::header::{ALLOW, CONTENT_TYPE};
use reqwest::{Client, Method, Response, StatusCode};
use serde_json::{Value, json};
use uuid::Uuid;

/// Longest a service may take to print its listening line.
const START: Duration = Duration::from_secs(30);

/// The secret Billing is started with unless a test says otherwise (a
/// plain secret of at least 32 bytes).
const SECRET: &str = "current-event-secret-7c2e91d04b5a";

/// The body limit both services default to.
const BODY_LIMIT: usize = 64 * 1024;

/// A running service binary, its base URL and its admin listener's.
struct Service {
    process: ServiceProcess,
    url: String,
    admin: String,
}

impl Service {
    async fn start(bin: &str, args: &[&str], envs: &[(&str, &str)]) -> Service {
        let mut all = vec!["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"];
        all.extend_from_slice(args);
        let process = ServiceProcess::spawn(bins::path(bin), &all, envs).expect("spawn");
        let url = process.listen_addr(START).await.expect("listening line");
        let admin = process.admin_addr(START).await.expect("admin line");
        Service {
            process,
            url,
            admin,
        }
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

    /// `path` on the admin listener.
    fn admin_at(&self, path: &str) -> String {
        format!("{}{path}", self.admin)
    }

    async fn metrics(&self, client: &Client) -> String {
        let response = client
            .get(self.admin_at("/metrics"))
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

/// Each `(method, url, allow)`: the wrong `method` on `url` is a JSON 405
/// `method_not_allowed` with `Allow: allow`.
async fn expect_wrong_methods(table: &[(Method, String, &str)]) {
    let client = http();
    for (method, url, allow) in table {
        let response = client.request(method.clone(), url).send().await.unwrap();
        let status = response.status();
        let got_allow = response.headers().get(ALLOW).cloned();
        let text = response.text().await.expect("error body");
        let body: Value = serde_json::from_str(&text).unwrap_or_default();
        let answer = format!("{method} {url}: {status} Allow {got_allow:?} {text}");
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{answer}");
        assert_eq!(
            got_allow.as_ref().map(|a| a.as_bytes()),
            Some(allow.as_bytes()),
            "{answer}"
        );
        assert_eq!(body["error"], "method_not_allowed", "{answer}");
    }
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
    // JSON logs are one object per line (stdout's two listening lines aside).
    let json_lines = orders.process.logs();
    assert!(
        json_lines
            .lines()
            .filter(|l| !l.starts_with(::harness::process::LISTENING))
            .filter(|l| !l.starts_with(::harness::process::ADMIN_ENDPOINT))
            .all(|l| serde_json::from_str::<Value>(l).is_ok()),
        "{json_lines}"
    );
}

/// `url` with its password replaced by `password`.
fn with_password(url: &str, password: &str) -> String {
    let mut parsed = reqwest::Url::parse(url).expect("database URL");
    parsed.set_password(Some(password)).expect("set password");
    parsed.to_string()
}

/// Issue 18, item 10: a database error is logged with the server's message
/// and SQLSTATE (was: `db error`), never the password.
#[tokio::test]
async fn services_log_the_servers_message_and_sqlstate_on_database_errors_never_the_password() {
    let stack = stack().await;
    let client = http();
    let wrong = "wrong-password-5d1f0c";
    let orders_url = with_password(&stack.orders_app_url, wrong);
    let billing_url = with_password(&stack.billing_app_url, wrong);
    let mut orders = Service::start("orders", &["--database-url", &orders_url], &[]).await;
    let mut billing = Service::start(
        "billing",
        &["--database-url", &billing_url],
        &[("EVENT_SECRET", SECRET)],
    )
    .await;

    expect_error(
        post_order(&client, &orders, r#"{"amount_cents":1,"currency":"EUR"}"#).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "database_unavailable",
    )
    .await;
    let body = event(Uuid::new_v4(), Uuid::new_v4(), 100).to_string();
    expect_error(
        deliver_signed(&client, &billing, &body).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "database_unavailable",
    )
    .await;

    for (name, service, user) in [
        ("orders", &mut orders, "orders_app"),
        ("billing", &mut billing, "billing_app"),
    ] {
        let expected = format!("password authentication failed for user \"{user}\"");
        let line = service
            .process
            .wait_for_line("database unreachable", Duration::from_secs(10))
            .await
            .unwrap();
        assert!(
            line.contains(&expected) && line.contains("28P01"),
            "{name}: the request's log line names the server's reason: {line}"
        );
        let logs = service.process.logs();
        let startup = logs
            .lines()
            .find(|l| l.contains("database not reachable yet"))
            .unwrap_or_else(|| panic!("{name}: no startup warning:\n{logs}"));
        assert!(
            startup.contains(&expected) && startup.contains("28P01"),
            "{name}: {startup}"
        );
        assert!(!logs.contains(wrong), "{name} logged the password:\n{logs}");
        assert!(
            !logs.contains("db error"),
            "{name}: a bare `db error` is left:\n{logs}"
        );
    }

    // A failed statement, too: its message and SQLSTATE.
    let admin = stack.orders_admin().await.unwrap();
    admin
        .batch_execute("REVOKE INSERT ON orders FROM orders_app")
        .await
        .unwrap();
    let orders = Service::orders(&stack, &[], &[]).await;
    expect_error(
        post_order(&client, &orders, r#"{"amount_cents":1,"currency":"EUR"}"#).await,
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal_error",
    )
    .await;
    let line = orders
        .process
        .wait_for_line("database statement failed", Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        line.contains("permission denied for table orders") && line.contains("42501"),
        "{line}"
    );
}

/// Issue 18, item 2: `/metrics` and Billing's `GET /invoices` are served on
/// the admin listener only (loopback by default; its own small connection
/// budget), never on the public port, which keeps `/healthz` and the
/// clients' routes.
#[tokio::test]
async fn metrics_and_operator_reads_are_on_the_admin_listener_only() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &[], &[]).await;
    let billing = Service::billing(&stack, &[], &[]).await;
    let client = http();
    let invoices = format!("/invoices?order_id={}", Uuid::new_v4());

    for (name, service, admin_only) in [
        ("orders", &orders, vec!["/metrics"]),
        ("billing", &billing, vec!["/metrics", invoices.as_str()]),
    ] {
        for path in admin_only {
            let public = client.get(service.at(path)).send().await.unwrap();
            expect_error(public, StatusCode::NOT_FOUND, "not_found").await;
            let admin = client.get(service.admin_at(path)).send().await.unwrap();
            assert_eq!(admin.status(), StatusCode::OK, "{name} admin {path}");
        }
        for base in [&service.url, &service.admin] {
            let health = client.get(format!("{base}/healthz")).send().await.unwrap();
            assert_eq!(health.status(), StatusCode::OK, "{name} {base}/healthz");
        }
        // The clients' routes are not on the admin listener.
        let route = if name == "orders" {
            "/orders"
        } else {
            "/inbox"
        };
        let response = client
            .post(service.admin_at(route))
            .header(CONTENT_TYPE, "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        expect_error(response, StatusCode::NOT_FOUND, "not_found").await;
        assert!(
            service.admin.starts_with("http://127.0.0.1:"),
            "{}",
            service.admin
        );
    }
    // Requests to the admin listener are not the clients' traffic.
    let text = orders.metrics(&client).await;
    assert!(!text.contains("route=\"/metrics\""), "{text}");
}
