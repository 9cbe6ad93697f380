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
