//! The expected-events checker: each committed outbox row, read back as
//! PostgreSQL returned it, against the requests a sink received.
//!
//! A request matches its row when its body is exactly
//! `{"id":"<id>","type":<T>,"data":<payload::text>}` where `T` is one JSON
//! string whose value is the event type, the signature is valid and the
//! `Idempotency-Key` is the id. That makes the body valid JSON with exactly
//! three keys and `data` byte-identical to the payload's text as stored.
//! [`assert_exact`] asks each expected event exactly once and nothing else;
//! call it after [`settle`](super::settle), which proves nothing else is
//! still coming.

use std::collections::HashMap;

use tokio_postgres::{Client, Row};
use uuid::Uuid;

use crate::app::TEST_SECRET;
use crate::sink::Received;

/// What to select after `INSERT INTO outbox ... RETURNING` for
/// [`Expected::from_row`].
pub const RETURNING: &str = "RETURNING id::text, event_type, payload::text, aggregate_id::text";

/// One committed outbox row as PostgreSQL returned it: what the relay must send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// `id::text`.
    pub id: String,
    /// `event_type`.
    pub event_type: String,
    /// `payload::text`; `None` for SQL NULL.
    pub payload: Option<String>,
    /// `aggregate_id::text`; empty when NULL.
    pub aggregate: String,
}

impl Expected {
    /// From a row whose first four columns are those of [`RETURNING`].
    pub fn from_row(row: &Row) -> Expected {
        Expected {
            id: row.get(0),
            event_type: row.get(1),
            payload: row.get(2),
            aggregate: row.get::<_, Option<String>>(3).unwrap_or_default(),
        }
    }
}

/// Inserts an order row (100 EUR cents) to reference from outbox rows.
pub async fn insert_order(db: &Client) -> anyhow::Result<Uuid> {
    let id = Uuid::new_v4();
    db.execute(
        "INSERT INTO orders (id, amount_cents, currency) VALUES ($1, 100, 'EUR')",
        &[&id],
    )
    .await?;
    Ok(id)
}

/// Inserts one outbox row, in whatever transaction `db` is in; the payload
/// is JSON text (`None` = SQL NULL), read back with `payload::text`.
pub async fn insert_event(
    db: &Client,
    aggregate: Uuid,
    event_type: &str,
    payload: Option<&str>,
) -> anyhow::Result<Expected> {
    insert_event_into(db, "outbox", aggregate, event_type, payload).await
}

/// [`insert_event`] into `table` (an SQL name the test chose, e.g. a
/// renamed outbox) with the outbox's columns.
pub async fn insert_event_into(
    db: &Client,
    table: &str,
    aggregate: Uuid,
    event_type: &str,
    payload: Option<&str>,
) -> anyhow::Result<Expected> {
    let row = db
        .query_one(
            &format!(
                "INSERT INTO {table} (id, aggregate_id, event_type, payload) \
                 VALUES (gen_random_uuid(), $1, $2, $3::text::jsonb) {RETURNING}"
            ),
            &[&aggregate, &event_type, &payload],
        )
        .await?;
    Ok(Expected::from_row(&row))
}

/// The `id` of a body that starts `{"id":"<id>"` (without parsing the rest,
/// which may nest deeper than serde_json's recursion limit).
pub fn body_id(body: &[u8]) -> Option<String> {
    let rest = body.strip_prefix(br#"{"id":""#)?;
    let end = rest.iter().position(|&b| b == b'"')?;
    String::from_utf8(rest[..end].to_vec()).ok()
}

/// Event ids in arrival order.
pub fn arrival_ids(received: &[Received]) -> Vec<String> {
    received.iter().filter_map(|r| body_id(&r.body)).collect()
}

/// Checks one request against the row it claims to be (see the module doc).
pub fn check_body(got: &Received, exp: &Expected) -> Result<(), String> {
    let body = &got.body[..];
    let prefix = format!(r#"{{"id":"{}","type":"#, exp.id);
    let data = exp.payload.as_deref().unwrap_or("null");
    let suffix = format!(r#","data":{data}}}"#);
    if !body.starts_with(prefix.as_bytes()) {
        return Err(format!(
            "body does not start with {prefix}: {}",
            shorten(body)
        ));
    }
    if body.len() < prefix.len() + suffix.len() || !body.ends_with(suffix.as_bytes()) {
        let shown_exp: String = data.chars().take(300).collect();
        return Err(format!(
            "data is not byte-identical to payload::text ({} bytes, starts {shown_exp}): {}",
            data.len(),
            shorten(body)
        ));
    }
    let middle = &body[prefix.len()..body.len() - suffix.len()];
    match serde_json::from_slice::<String>(middle) {
        Ok(t) if t == exp.event_type => {}
        Ok(t) => return Err(format!("type {t:?}, expected {:?}", exp.event_type)),
        Err(e) => {
            return Err(format!(
                "type is not a single JSON string ({e}): {}",
                String::from_utf8_lossy(middle)
            ));
        }
    }
    if !got.signature_valid(TEST_SECRET) {
        return Err(format!("bad signature {:?}", got.signature));
    }
    if got.idempotency_key.as_deref() != Some(exp.id.as_str()) {
        return Err(format!("Idempotency-Key {:?}", got.idempotency_key));
    }
    // The default scheme also signs the Standard Webhooks way.
    match &got.webhook {
        Some(w) if w.id != exp.id => return Err(format!("webhook-id {:?}", w.id)),
        Some(_) if got.standard_matches(TEST_SECRET.as_bytes()) != [0] => {
            return Err(format!("bad webhook-signature {:?}", got.webhook));
        }
        Some(_) => {}
        None => return Err("no webhook-id, webhook-timestamp, webhook-signature".into()),
    }
    Ok(())
}

/// A body for an error message: at most 300 characters and its length.
fn shorten(body: &[u8]) -> String {
    let s = String::from_utf8_lossy(body);
    if s.len() > 300 {
        format!(
            "{}… ({} bytes)",
            s.chars().take(300).collect::<String>(),
            s.len()
        )
    } else {
        s.into_owned()
    }
}

/// Asserts `received` holds each expected event exactly once, with the
/// right body, every one answered 2xx, and nothing else.
pub fn assert_exact(received: &[Received], expected: &[Expected]) {
    let by_id: HashMap<&str, &Expected> = expected.iter().map(|e| (e.id.as_str(), e)).collect();
    assert_eq!(by_id.len(), expected.len(), "expected ids are unique");
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut problems = Vec::new();
    for got in received {
        let Some(id) = body_id(&got.body) else {
            problems.push(format!(
                "body without a leading id: {}",
                String::from_utf8_lossy(&got.body[..got.body.len().min(200)])
            ));
            continue;
        };
        *seen.entry(id.clone()).or_default() += 1;
        match by_id.get(id.as_str()) {
            None => problems.push(format!("unexpected event {id}")),
            Some(exp) => {
                if let Err(e) = check_body(got, exp) {
                    problems.push(format!("event {id}: {e}"));
                }
            }
        }
    }
    for (id, n) in &seen {
        if *n > 1 {
            problems.push(format!("event {id} received {n} times"));
        }
    }
    for e in expected {
        if !seen.contains_key(&e.id) {
            problems.push(format!("event {} ({}) never received", e.id, e.event_type));
        }
    }
    assert!(
        problems.is_empty(),
        "{} requests, {} expected; problems (first 20):\n{}",
        received.len(),
        expected.len(),
        problems
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    for got in received {
        assert!(
            (200..300).contains(&got.status),
            "the sink answered {}",
            got.status
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::{Webhook, sign, sign_standard};

    fn signed(body: &str, id: &str) -> Received {
        Received {
            body: axum::body::Bytes::copy_from_slice(body.as_bytes()),
            signature: Some(sign(TEST_SECRET, body.as_bytes())),
            idempotency_key: Some(id.to_owned()),
            webhook: Some(Webhook {
                id: id.to_owned(),
                timestamp: "1700000000".into(),
                signature: sign_standard(TEST_SECRET.as_bytes(), id, "1700000000", body.as_bytes()),
            }),
            content_type: Some("application/json".into()),
            authorization: None,
            traceparent: None,
            tracestate: None,
            target: "/inbox".into(),
            status: 204,
            at: std::time::Instant::now(),
            arrived: std::time::Instant::now(),
            peer: ([127, 0, 0, 1], 1).into(),
        }
    }

    fn exp(payload: Option<&str>) -> Expected {
        Expected {
            id: "e1".into(),
            event_type: "T\"x".into(),
            payload: payload.map(str::to_owned),
            aggregate: "a".into(),
        }
    }

    const GOOD: &str = r#"{"id":"e1","type":"T\"x","data":{"a": 1}}"#;

    #[test]
    fn check_body_accepts_the_exact_body_and_an_equivalent_type_escape() {
        assert_eq!(
            check_body(&signed(GOOD, "e1"), &exp(Some(r#"{"a": 1}"#))),
            Ok(())
        );
        // Escaping the type differently is still the same JSON string.
        let alt = r#"{"id":"e1","type":"T\u0022x","data":{"a": 1}}"#;
        assert_eq!(
            check_body(&signed(alt, "e1"), &exp(Some(r#"{"a": 1}"#))),
            Ok(())
        );
    }

    #[test]
    fn check_body_rejects_near_misses() {
        for (bad, payload) in [
            (
                r#"{"id":"e1","type":"T\"x","data":{"a":1}}"#,
                Some(r#"{"a": 1}"#),
            ),
            (r#"{"id":"e1","type":"T\"x","data":""}"#, None),
            (r#"{"id":"e1","type":"T\"x","data":null}"#, Some(r#""""#)),
            (r#"{"id":"e1","type":"T","x":"x","data":null}"#, None),
            (r#"{"id":"e1","type":"T\"y","data":null}"#, None),
            (r#"{"id":"e1","type":"T\"x","data":null} "#, None),
            (r#"{"id":"e2","type":"T\"x","data":null}"#, None),
        ] {
            assert!(
                check_body(&signed(bad, "e1"), &exp(payload)).is_err(),
                "{bad}"
            );
        }
        let mut unsigned = signed(GOOD, "e1");
        unsigned.signature = Some("0".repeat(64));
        assert!(check_body(&unsigned, &exp(Some(r#"{"a": 1}"#))).is_err());
        let wrong_key = signed(GOOD, "e2");
        assert!(check_body(&wrong_key, &exp(Some(r#"{"a": 1}"#))).is_err());
        let mut stale = signed(GOOD, "e1");
        if let Some(w) = stale.webhook.as_mut() {
            w.timestamp = "1700000001".into();
        }
        assert!(check_body(&stale, &exp(Some(r#"{"a": 1}"#))).is_err());
        let mut legacy_only = signed(GOOD, "e1");
        legacy_only.webhook = None;
        assert!(check_body(&legacy_only, &exp(Some(r#"{"a": 1}"#))).is_err());
    }

    #[test]
    fn assert_exact_wants_each_event_exactly_once() {
        assert_exact(&[signed(GOOD, "e1")], &[exp(Some(r#"{"a": 1}"#))]);
        for received in [vec![], vec![signed(GOOD, "e1"), signed(GOOD, "e1")]] {
            let r =
                std::panic::catch_unwind(|| assert_exact(&received, &[exp(Some(r#"{"a": 1}"#))]));
            assert!(r.is_err(), "{} requests accepted", received.len());
        }
        let mut refused = signed(GOOD, "e1");
        refused.status = 500;
        let r = std::panic::catch_unwind(|| assert_exact(&[refused], &[exp(Some(r#"{"a": 1}"#))]));
        assert!(r.is_err(), "a request answered 500 counts as delivered");
    }

    #[test]
    fn body_id_reads_only_the_leading_id() {
        assert_eq!(body_id(GOOD.as_bytes()).as_deref(), Some("e1"));
        assert_eq!(body_id(br#"{"type":"x","id":"e1"}"#), None);
    }
}
