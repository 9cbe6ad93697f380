//! The services' database pool: what is open before the first request
//! (`--pool-prefill`), and what a server that refuses part of it gets.

use std::time::Duration;

use reqwest::StatusCode;
use uuid::Uuid;

use super::{Service, deliver_signed, event, http, stack};

/// Part of the pool is opened at start (`--pool-prefill`, default 4 within
/// `--pool-size`), before the service says it is listening, so the first
/// requests of a burst do not wait for new connections; `--pool-prefill 0`
/// opens only the connection that checks the database. (The services
/// share the pool code: Orders with 0, Billing with the default.)
#[tokio::test]
async fn the_pool_is_open_before_the_first_request() {
    let stack = stack().await;
    let orders = Service::orders(&stack, &["--pool-size", "8", "--pool-prefill", "0"], &[]).await;
    let billing = Service::billing(&stack, &["--pool-size", "8"], &[]).await;
    let open = |app: &'static str, url: String| async move {
        let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(conn);
        db.query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND datname = current_database()",
            &[&app],
        )
        .await
        .expect("pg_stat_activity")
        .get::<_, i64>(0)
    };
    // No request has been sent to either.
    assert_eq!(open("orders", stack.orders_admin_url.clone()).await, 1);
    assert_eq!(open("billing", stack.billing_admin_url.clone()).await, 4);
    drop((orders, billing));
}

/// A prefill the server cannot give whole (its connection limit is
/// reached) opens what it can, says how many at WARN with the server's
/// reason, and the service runs: a request is served on the pool it got.
#[tokio::test]
async fn a_prefill_cut_short_by_the_servers_limit_says_so_and_serves() {
    let stack = stack().await;
    let admin = stack.billing_admin().await.unwrap();
    // Superusers (the test's own connections) are exempt from the limit.
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {} CONNECTION LIMIT 3",
            stack.billing_db
        ))
        .await
        .unwrap();
    let billing = Service::billing(&stack, &["--pool-size", "6", "--pool-prefill", "6"], &[]).await;
    let line = billing
        .process
        .wait_for_line("connections of --pool-prefill", Duration::from_secs(10))
        .await
        .unwrap();
    // At most 3 (the limit; the stack may hold one of them itself).
    let opened = ["1", "2", "3"]
        .iter()
        .find(|n| line.contains(&format!("only {n} of the 6")));
    assert!(
        opened.is_some() && line.contains("53300"),
        "the count and the server's reason (too many connections): {line}"
    );
    let body = event(Uuid::new_v4(), Uuid::new_v4(), 100).to_string();
    let response = deliver_signed(&http(), &billing, &body).await;
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
}

/// Past the prefill the pool grows one connection at a time, and keeps
/// growing while requests queue: a burst of slow requests (each insert
/// sleeps 200 ms in a trigger) from 64 clients at once, against the
/// default pool (16, 4 opened at start), is served whole, and the pool
/// ends at its size. Counts, not time: every answer is 201 and 16
/// connections are open. (The wait for a free connection is 5 s, so that
/// the answer does not hang on how fast this machine opens connections:
/// at 16 connections a request waits about 0.8 s.)
///
/// Failed with the first version of the growth (a background task that
/// opened the next connection through `get`, queued behind every waiting
/// request): the pool grew by one per queue drain, requests waited past
/// `--pool-wait-timeout-ms` and got 503 `pool_exhausted` while most of
/// the allowed connections were never opened.
#[tokio::test]
async fn a_burst_of_slow_requests_grows_the_pool_and_is_served_whole() {
    let stack = stack().await;
    let admin = stack.orders_admin().await.unwrap();
    admin
        .batch_execute(
            "CREATE FUNCTION slow_order() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN PERFORM pg_sleep(0.2); RETURN NEW; END $$; \
             CREATE TRIGGER slow_order BEFORE INSERT ON orders \
               FOR EACH ROW EXECUTE FUNCTION slow_order()",
        )
        .await
        .unwrap();
    let orders = Service::orders(&stack, &["--pool-wait-timeout-ms", "5000"], &[]).await;
    let client = http();
    let body = r#"{"amount_cents":100,"currency":"EUR"}"#;
    let clients = (0..64).map(|_| {
        let client = client.clone();
        let url = orders.at("/orders");
        async move {
            let mut statuses = Vec::new();
            for _ in 0..6 {
                let response = client
                    .post(&url)
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                statuses.push(response.status());
            }
            statuses
        }
    });
    let statuses: Vec<StatusCode> = futures::future::join_all(clients)
        .await
        .into_iter()
        .flatten()
        .collect();
    let refused = statuses
        .iter()
        .filter(|s| **s != StatusCode::CREATED)
        .count();
    assert_eq!(refused, 0, "answers of the burst: {statuses:?}");
    let open: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'orders' AND datname = current_database()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(open, 16, "the pool grew to --pool-size");
}
