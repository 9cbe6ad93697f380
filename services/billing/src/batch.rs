//! Batches: one request carrying several events
//! (`docs/architecture.md#batches`).
//!
//! The body is a JSON array of the same event objects a single request
//! carries, `[{"id",…},{"id",…}]`, signed as one body. `X-Event-Batch`,
//! when sent, must be the number of events. The request's id
//! (`webhook-id`, and `Idempotency-Key` when sent) is [`batch_id`] of the
//! events' ids, so a retried batch carries the same id; Billing checks it
//! when the header is there. The events are recorded in ONE transaction
//! ([`crate::store::InboxStore::record_batch`]): an event seen before
//! changes nothing, so a replayed batch, or one overlapping an earlier
//! batch, makes invoices only for the ids that are new.

use axum::http::HeaderMap;
use serde_json::Value;
use service_common::ServiceError;
use sha2::{Digest, Sha256};

use crate::event::OrderCreated;
use crate::routes::EVENT_ID_HEADERS;

/// The batch marker header: the number of events in the body.
pub const BATCH_HEADER: &str = "x-event-batch";

const INVALID: &str = "invalid_batch";

/// The request id of a batch: `batch_` and the lowercase hex of the first
/// 16 bytes of SHA-256 over each event's `id` (the JSON string's value,
/// UTF-8) followed by a line feed, in body order. The same events in the
/// same order give the same id, whatever the attempt.
pub fn batch_id<'a>(ids: impl IntoIterator<Item = &'a str>) -> String {
    let mut hash = Sha256::new();
    for id in ids {
        hash.update(id.as_bytes());
        hash.update(b"\n");
    }
    format!("batch_{}", hex::encode(&hash.finalize()[..16]))
}

/// Validates a batch body's elements (422 `invalid_event` naming
/// `[i].<field>` for a bad element; 422 `invalid_batch` for an empty
/// batch, an id repeated within it, or a marker or request id that does
/// not match the body).
pub fn parse(items: &[Value], headers: &HeaderMap) -> Result<Vec<OrderCreated>, ServiceError> {
    if items.is_empty() {
        return Err(ServiceError::invalid_field(
            INVALID,
            "batch",
            "a batch holds at least one event",
        ));
    }
    let events = items
        .iter()
        .enumerate()
        .map(|(i, item)| OrderCreated::from_json(item).map_err(|e| e.at_index(i)))
        .collect::<Result<Vec<_>, _>>()?;
    for (i, event) in events.iter().enumerate() {
        if let Some(first) = events[..i].iter().position(|e| e.id == event.id) {
            return Err(ServiceError::invalid_field(
                INVALID,
                format!("[{i}].id"),
                format!("repeats the id of [{first}]: an event appears once in a batch"),
            ));
        }
    }
    if let Some(marker) = headers.get(BATCH_HEADER) {
        let count = marker.to_str().ok().and_then(|v| v.parse::<usize>().ok());
        if count != Some(events.len()) {
            return Err(ServiceError::invalid_field(
                INVALID,
                "X-Event-Batch",
                format!(
                    "must be the number of events in the body ({})",
                    events.len()
                ),
            ));
        }
    }
    // The ids as written (a UUID may be sent in upper case).
    let id = batch_id(
        items
            .iter()
            .map(|item| item.get("id").and_then(Value::as_str).unwrap_or_default()),
    );
    for (name, field) in EVENT_ID_HEADERS
        .into_iter()
        .zip(["Idempotency-Key", "webhook-id"])
    {
        if let Some(value) = headers.get(name)
            && value.as_bytes() != id.as_bytes()
        {
            return Err(ServiceError::invalid_field(
                INVALID,
                field,
                format!("must be the batch's id, {id}"),
            ));
        }
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;
    use serde_json::json;

    use super::*;

    fn event(id: &str, order: &str) -> Value {
        json!({"id": id, "type": "OrderCreated",
               "data": {"order_id": order, "amount_cents": 100, "currency": "EUR"}})
    }

    const A: &str = "8f0e6c1a-52c5-4b7e-9d52-3f0d2d7b9e11";
    const B: &str = "0b6a7e4c-1f2d-4c3b-8a9e-5d6f7a8b9c0d";

    #[test]
    fn the_batch_id_is_the_documented_hash_of_the_ids_in_order() {
        // The vector of docs/architecture.md#batches; the relay's test
        // uses the same one.
        assert_eq!(batch_id([A, B]), "batch_770f11200c20a99b3ab5a8997012c64e");
        assert_ne!(batch_id([A, B]), batch_id([B, A]), "order counts");
        assert_ne!(batch_id([A]), batch_id([A, B]));
        // Each id ends with a line feed: ids cannot run into each other.
        assert_ne!(batch_id(["ab", "c"]), batch_id(["a", "bc"]));
    }

    #[test]
    fn each_refusal_names_the_element_or_header_to_fix() {
        let none = HeaderMap::new();
        let bad = event(A, "not-a-uuid");
        let e = parse(&[event(B, A), bad], &none).unwrap_err();
        assert_eq!(e.field(), Some("[1].data.order_id"));
        assert_eq!(e.code(), "invalid_event");

        let e = parse(&[json!("x")], &none).unwrap_err();
        assert_eq!(e.field(), Some("[0].event"));

        let e = parse(&[], &none).unwrap_err();
        assert_eq!((e.code(), e.field()), ("invalid_batch", Some("batch")));

        let e = parse(&[event(A, B), event(B, B), event(A, A)], &none).unwrap_err();
        assert_eq!(e.field(), Some("[2].id"));

        let two = [event(A, B), event(B, A)];
        let mut headers = HeaderMap::new();
        headers.insert(BATCH_HEADER, HeaderValue::from_static("3"));
        let e = parse(&two, &headers).unwrap_err();
        assert_eq!(e.field(), Some("X-Event-Batch"));
        headers.insert(BATCH_HEADER, HeaderValue::from_static("2"));
        assert_eq!(parse(&two, &headers).unwrap().len(), 2);

        headers.insert("webhook-id", HeaderValue::from_str(A).unwrap());
        let e = parse(&two, &headers).unwrap_err();
        assert_eq!(e.field(), Some("webhook-id"));
        let id = batch_id([A, B]);
        headers.insert("webhook-id", HeaderValue::from_str(&id).unwrap());
        headers.insert("idempotency-key", HeaderValue::from_str(&id).unwrap());
        let events = parse(&two, &headers).unwrap();
        assert_eq!(events[0].id.to_string(), A);
        assert_eq!(events[1].id.to_string(), B);
    }
}
