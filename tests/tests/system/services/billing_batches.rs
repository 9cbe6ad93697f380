//! Billing's batch inbox (`docs/architecture.md#batches`): a JSON array of
//! events, signed as one body, recorded in ONE transaction; an id seen
//! before changes nothing; a bad event is answered per event (207) and the
//! others recorded; a bad batch is refused whole, naming what to fix.

use std::time::{SystemTime, UNIX_EPOCH};

use ::harness::sink::{batch_id, sign, sign_standard};
use reqwest::StatusCode;
use reqwest::header::CONTENT_TYPE;
use serde_json::Value;
use uuid::Uuid;

use super::{SECRET, Service, count, deliver_signed, event, expect_error, http, stack};

/// The body of a batch of `events`, as the relay writes it.
fn batch(events: &[Value]) -> String {
    Value::Array(events.to_vec()).to_string()
}

fn ids(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_owned())
        .collect()
}

/// POSTs `events` as a batch with the relay's headers: the marker, the
/// batch's id as `Idempotency-Key` and `webhook-id`, both signatures.
/// Returns the status and the body.
async fn send_batch(
    client: &reqwest::Client,
    billing: &Service,
    events: &[Value],
) -> (StatusCode, String) {
    let body = batch(events);
    let ids = ids(events);
    let id = batch_id(ids.iter().map(String::as_str));
    let timestamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        .to_string();
    let response = client
        .post(billing.at("/inbox"))
        .header(CONTENT_TYPE, "application/json")
        .header("X-Event-Batch", events.len().to_string())
        .header("Idempotency-Key", &id)
        .header("webhook-id", &id)
        .header("webhook-timestamp", &timestamp)
        .header(
            "webhook-signature",
            sign_standard(SECRET.as_bytes(), &id, &timestamp, body.as_bytes()),
        )
        .header("X-Event-Signature", sign(SECRET, body.as_bytes()))
        .body(body)
        .send()
        .await
        .unwrap();
    (response.status(), response.text().await.unwrap())
}

/// [`send_batch`], answered 204.
async fn post_batch(client: &reqwest::Client, billing: &Service, events: &[Value]) -> StatusCode {
    let (status, text) = send_batch(client, billing, events).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{text}");
    status
}

async fn invoiced_orders(db: &tokio_postgres::Client) -> Vec<Uuid> {
    // The heap's order is the insert order of a table only ever appended to.
    db.query("SELECT order_id FROM invoices ORDER BY ctid", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

fn order_of(event: &Value) -> Uuid {
    event["data"]["order_id"].as_str().unwrap().parse().unwrap()
}

#[tokio::test]
async fn billing_records_a_batch_once_in_array_order_and_only_the_new_ids_of_an_overlap() {
    let stack = stack().await;
    let billing = Service::billing(&stack, &[], &[]).await;
    let client = http();
    let events: Vec<Value> = (0..4)
        .map(|i| event(Uuid::new_v4(), Uuid::new_v4(), 100 + i))
        .collect();
    let db = stack.billing_admin().await.unwrap();

    // A batch, then the same batch again (a retry after a lost answer).
    for _ in 0..2 {
        post_batch(&client, &billing, &events[..3]).await;
        assert_eq!(count(&db, "processed_events").await, 3);
        assert_eq!(
            invoiced_orders(&db).await,
            events[..3].iter().map(order_of).collect::<Vec<_>>(),
            "one invoice per event, in the batch's order"
        );
    }
    // A batch overlapping the first: only its new id makes an invoice.
    post_batch(&client, &billing, &events[2..]).await;
    assert_eq!(count(&db, "processed_events").await, 4);
    assert_eq!(
        invoiced_orders(&db).await,
        events.iter().map(order_of).collect::<Vec<_>>()
    );

    let text = billing.metrics(&client).await;
    for line in [
        "billing_invoices_created_total 4",
        "billing_duplicates_absorbed_total 4",
        r#"billing_signatures_verified_total{scheme="standard"} 3"#,
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
}

#[tokio::test]
async fn billing_answers_a_batch_with_bad_events_per_event_and_refuses_a_bad_batch_whole() {
    let stack = stack().await;
    let billing = Service::billing(&stack, &[], &[]).await;
    let client = http();
    let db = stack.billing_admin().await.unwrap();
    let invoiced = event(Uuid::new_v4(), Uuid::new_v4(), 100);
    assert_eq!(
        deliver_signed(&client, &billing, &invoiced.to_string())
            .await
            .status(),
        StatusCode::NO_CONTENT
    );
    let fresh = || event(Uuid::new_v4(), Uuid::new_v4(), 250);
    let (a, b) = (fresh(), fresh());
    let mut bad_amount = fresh();
    bad_amount["data"]["amount_cents"] = Value::from(0);
    // Another event for the order already invoiced.
    let same_order = event(Uuid::new_v4(), order_of(&invoiced), 100);
    // Two events of one order in the batch: the second cannot invoice it.
    let twin = event(Uuid::new_v4(), order_of(&a), 100);

    // Refused whole, naming what to fix: nothing is written.
    let mut no_id = fresh();
    no_id.as_object_mut().unwrap().remove("id");
    let cases: Vec<(String, &str, &str)> = vec![
        (batch(&[]), "invalid_batch", "batch"),
        (
            batch(&[a.clone(), b.clone(), a.clone()]),
            "invalid_batch",
            "[2].id",
        ),
        (batch(&[a.clone(), no_id]), "invalid_event", "[1].id"),
    ];
    for (body, code, field) in cases {
        let error = expect_error(
            deliver_signed(&client, &billing, &body).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            code,
        )
        .await;
        assert_eq!(error["field"], field, "{body}");
    }
    assert_eq!(count(&db, "processed_events").await, 1, "nothing written");

    // Answered per event (207): the good events recorded, each bad one
    // refused with the error a single request would get.
    let body = batch(&[
        a.clone(),
        bad_amount.clone(),
        same_order.clone(),
        b.clone(),
        twin.clone(),
    ]);
    let response = deliver_signed(&client, &billing, &body).await;
    assert_eq!(response.status(), StatusCode::MULTI_STATUS);
    let answer: Value = response.json().await.unwrap();
    let results = answer["results"].as_array().unwrap();
    let expected = [
        (&a, 204, None),
        (
            &bad_amount,
            422,
            Some(("invalid_event", "data.amount_cents")),
        ),
        (
            &same_order,
            422,
            Some(("order_already_invoiced", "data.order_id")),
        ),
        (&b, 204, None),
        (
            &twin,
            422,
            Some(("order_already_invoiced", "data.order_id")),
        ),
    ];
    assert_eq!(results.len(), expected.len(), "{answer}");
    for (result, (event, status, error)) in results.iter().zip(expected) {
        assert_eq!(result["id"], event["id"], "{answer}");
        assert_eq!(result["status"], status, "{answer}");
        if let Some((code, field)) = error {
            assert_eq!(result["error"]["error"], code, "{answer}");
            assert_eq!(result["error"]["field"], field, "{answer}");
        }
    }
    assert_eq!(count(&db, "processed_events").await, 3);
    assert_eq!(
        invoiced_orders(&db).await,
        vec![order_of(&invoiced), order_of(&a), order_of(&b)]
    );
    // The same batch again: the recorded events change nothing, the bad
    // ones are refused the same way.
    let again = deliver_signed(&client, &billing, &body).await;
    assert_eq!(again.status(), StatusCode::MULTI_STATUS);
    assert_eq!(again.json::<Value>().await.unwrap(), answer);
    assert_eq!(count(&db, "processed_events").await, 3);
    assert_eq!(count(&db, "invoices").await, 3);

    // An event new to Billing for a's order, sent with a itself (seen
    // before): the new one is refused, not a.
    let late = event(Uuid::new_v4(), order_of(&a), 100);
    let response = deliver_signed(&client, &billing, &batch(&[late.clone(), a.clone()])).await;
    assert_eq!(response.status(), StatusCode::MULTI_STATUS);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["results"][0]["id"], late["id"], "{answer}");
    assert_eq!(answer["results"][0]["status"], 422, "{answer}");
    assert_eq!(answer["results"][1]["status"], 204, "{answer}");
    assert_eq!(count(&db, "processed_events").await, 3);

    // A marker on a single event's body is refused.
    let single = fresh().to_string();
    let response = client
        .post(billing.at("/inbox"))
        .header(CONTENT_TYPE, "application/json")
        .header("X-Event-Signature", sign(SECRET, single.as_bytes()))
        .header("X-Event-Batch", "5")
        .body(single)
        .send()
        .await
        .unwrap();
    let error = expect_error(response, StatusCode::UNPROCESSABLE_ENTITY, "invalid_batch").await;
    assert_eq!(error["field"], "X-Event-Batch");

    // The marker and the request id must match the body.
    let body = batch(&[a.clone(), b.clone()]);
    let right_id = batch_id(ids(&[a.clone(), b.clone()]).iter().map(String::as_str));
    let wrong_id = batch_id(ids(&[b.clone(), a.clone()]).iter().map(String::as_str));
    for (header, value, field) in [
        ("X-Event-Batch", "3".to_owned(), "X-Event-Batch"),
        ("webhook-id", wrong_id, "webhook-id"),
        (
            "Idempotency-Key",
            a["id"].as_str().unwrap().to_owned(),
            "Idempotency-Key",
        ),
    ] {
        let response = client
            .post(billing.at("/inbox"))
            .header(CONTENT_TYPE, "application/json")
            .header("X-Event-Signature", sign(SECRET, body.as_bytes()))
            .header(header, value)
            .body(body.clone())
            .send()
            .await
            .unwrap();
        let error = expect_error(response, StatusCode::UNPROCESSABLE_ENTITY, "invalid_batch").await;
        assert_eq!(error["field"], field);
    }
    // Unsigned: 401 before anything is parsed.
    let response = client
        .post(billing.at("/inbox"))
        .header(CONTENT_TYPE, "application/json")
        .header("Idempotency-Key", right_id)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);

    assert_eq!(count(&db, "processed_events").await, 3);
    assert_eq!(count(&db, "invoices").await, 3);
}

#[tokio::test]
async fn billing_batches_sharing_ids_in_opposite_orders_never_deadlock() {
    let stack = stack().await;
    let billing = Service::billing(&stack, &[], &[]).await;
    let client = http();
    const ROUNDS: usize = 20;
    const EVENTS: usize = 6;
    for _ in 0..ROUNDS {
        let events: Vec<Value> = (0..EVENTS)
            .map(|_| event(Uuid::new_v4(), Uuid::new_v4(), 100))
            .collect();
        let reversed: Vec<Value> = events.iter().rev().cloned().collect();
        // Both 204: a deadlock (40P01) would fail one of them with a 5xx.
        tokio::join!(
            post_batch(&client, &billing, &events),
            post_batch(&client, &billing, &reversed)
        );
    }
    let db = stack.billing_admin().await.unwrap();
    let n = i64::try_from(ROUNDS * EVENTS).unwrap();
    assert_eq!(count(&db, "processed_events").await, n);
    assert_eq!(count(&db, "invoices").await, n, "one invoice per event");
}

/// Two batches of different events naming the same 100 orders, one in the
/// reverse order of the other, sent at once (a producer that emitted two
/// events per order, batched apart), five times: both are answered (204
/// or 207, never a 5xx), each order is invoiced once, and every event is
/// either recorded or refused `order_already_invoiced`, never both.
///
/// Broken before: the two statements inserted invoices in opposite orders
/// and waited on each other's keys until `lock_timeout`: one answered 500
/// (55P03). And a batch whose 100 events were all taken by the other
/// needed 100 statements, one refusal each.
#[tokio::test]
async fn billing_batches_naming_the_same_orders_in_opposite_orders_both_answer() {
    const ORDERS: usize = 100;
    let stack = stack().await;
    let billing = Service::billing(&stack, &[], &[]).await;
    let client = http();
    let db = stack.billing_admin().await.unwrap();
    for round in 1..=5_i64 {
        let orders: Vec<Uuid> = (0..ORDERS).map(|_| Uuid::new_v4()).collect();
        let first: Vec<Value> = orders
            .iter()
            .map(|o| event(Uuid::new_v4(), *o, 100))
            .collect();
        let second: Vec<Value> = orders
            .iter()
            .rev()
            .map(|o| event(Uuid::new_v4(), *o, 100))
            .collect();
        let (a, b) = tokio::join!(
            send_batch(&client, &billing, &first),
            send_batch(&client, &billing, &second)
        );
        let mut refused = Vec::new();
        for (status, text) in [&a, &b] {
            assert!(
                *status == StatusCode::NO_CONTENT || *status == StatusCode::MULTI_STATUS,
                "round {round}: {status} {text}"
            );
            if *status == StatusCode::MULTI_STATUS {
                let body: Value = serde_json::from_str(text).unwrap();
                for r in body["results"].as_array().unwrap() {
                    if r["status"] != 204 {
                        assert_eq!(r["status"], 422, "{r}");
                        assert_eq!(r["error"]["error"], "order_already_invoiced", "{r}");
                        refused.push(r["id"].as_str().unwrap().to_owned());
                    }
                }
            }
        }
        assert_eq!(
            refused.len(),
            ORDERS,
            "round {round}: one event of each order refused"
        );
        let n = round * ORDERS as i64;
        assert_eq!(count(&db, "invoices").await, n, "each order invoiced once");
        assert_eq!(
            count(&db, "processed_events").await,
            n,
            "the refused events are not in the inbox"
        );
        let recorded: i64 = db
            .query_one(
                "SELECT count(*) FROM processed_events WHERE event_id::text = ANY($1)",
                &[&refused],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(recorded, 0, "a refused event is never recorded");
    }
}
