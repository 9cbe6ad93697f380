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

/// A batch body read: the events to record, in body order, and the
/// elements refused on their own (each with its index and its `id` as
/// written), answered per event (`207`, [`answers`]).
#[derive(Debug)]
pub struct Parsed {
    /// The valid events with their index in the body, in body order.
    pub events: Vec<(usize, OrderCreated)>,
    /// The invalid elements that carry a string `id`: index and why (422
    /// `invalid_event` naming the element's field).
    pub refused: Vec<(usize, ServiceError)>,
}

/// Validates a batch body. A bad element with a string `id` is refused on
/// its own ([`Parsed::refused`]); the batch is refused whole with 422
/// `invalid_event` naming `[i].<field>` for a bad element without one, and
/// 422 `invalid_batch` for an empty batch, an id repeated within it, or a
/// marker or request id that does not match the body.
pub fn parse(items: &[Value], headers: &HeaderMap) -> Result<Parsed, ServiceError> {
    if items.is_empty() {
        return Err(ServiceError::invalid_field(
            INVALID,
            "batch",
            "a batch holds at least one event",
        ));
    }
    let mut events = Vec::with_capacity(items.len());
    let mut refused = Vec::new();
    for (i, item) in items.iter().enumerate() {
        match OrderCreated::from_json(item) {
            Ok(event) => events.push((i, event)),
            Err(e) if item.get("id").is_some_and(Value::is_string) => refused.push((i, e)),
            Err(e) => return Err(e.at_index(i)),
        }
    }
    // The ids as written (a UUID may be sent in upper case).
    let written: Vec<&str> = items
        .iter()
        .map(|item| item.get("id").and_then(Value::as_str).unwrap_or_default())
        .collect();
    // An id repeated, however written (a UUID in upper case, say).
    let mut first_of = std::collections::HashMap::with_capacity(items.len());
    for (i, id) in written.iter().enumerate() {
        let key =
            crate::event::parse_uuid(id).map_or_else(|| id.to_ascii_lowercase(), |u| u.to_string());
        if let Some(first) = first_of.insert(key, i) {
            return Err(ServiceError::invalid_field(
                INVALID,
                format!("[{i}].id"),
                format!("repeats the id of [{first}]: an event appears once in a batch"),
            ));
        }
    }
    check_marker(headers, items.len())?;
    let id = batch_id(written.iter().copied());
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
    Ok(Parsed { events, refused })
}

/// `X-Event-Batch`, when sent, must be `events` written in decimal as the
/// relay writes it (no sign, no leading zero): 422 `invalid_batch` naming
/// the header otherwise.
pub fn check_marker(headers: &HeaderMap, events: usize) -> Result<(), ServiceError> {
    // Two markers that could disagree: which one the sender meant is
    // unknown, so neither is taken.
    if headers.get_all(BATCH_HEADER).iter().nth(1).is_some() {
        return Err(ServiceError::invalid_field(
            INVALID,
            "X-Event-Batch",
            "is given more than once; send it once, with the number of events in the body",
        ));
    }
    match headers.get(BATCH_HEADER) {
        Some(marker) if marker.as_bytes() != events.to_string().as_bytes() => {
            Err(ServiceError::invalid_field(
                INVALID,
                "X-Event-Batch",
                format!("must be the number of events in the body ({events})"),
            ))
        }
        _ => Ok(()),
    }
}

/// The body of a `207` answering a batch per event
/// (`docs/architecture.md#batches`): `{"results":[…]}` with one element
/// per event in body order, `{"id","status":204}` for a recorded one and
/// `{"id","status":422,"error":{…}}` for a refused one (`error`: the
/// error body a single request would get). `refused` is in body order.
pub fn answers(items: &[Value], refused: &[(usize, ServiceError)]) -> Value {
    let mut refused = refused.iter().peekable();
    let results: Vec<Value> = items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let id = item.get("id").cloned().unwrap_or_default();
            match refused.next_if(|(at, ..)| *at == i) {
                Some((_, e)) => {
                    serde_json::json!({"id": id, "status": e.status().as_u16(), "error": e.to_json()})
                }
                None => serde_json::json!({"id": id, "status": 204}),
            }
        })
        .collect();
    serde_json::json!({ "results": results })
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
        // A bad element with an id is refused on its own.
        let bad = event(A, "not-a-uuid");
        let parsed = parse(&[event(B, A), bad.clone()], &none).unwrap();
        assert_eq!(parsed.events.len(), 1);
        assert_eq!(parsed.events[0].0, 0);
        let (at, e) = &parsed.refused[0];
        assert_eq!(
            (*at, e.code(), e.field()),
            (1, "invalid_event", Some("data.order_id"))
        );
        let answer = answers(&[event(B, A), bad], &parsed.refused);
        assert_eq!(
            answer,
            json!({"results": [
                {"id": B, "status": 204},
                {"id": A, "status": 422, "error": {"error": "invalid_event", "field": "data.order_id",
                 "detail": e.to_json()["detail"]}},
            ]})
        );

        // One without an id refuses the batch, naming the element.
        let e = parse(&[event(B, A), json!("x")], &none).unwrap_err();
        assert_eq!(e.field(), Some("[1].event"));
        let e = parse(&[json!({"id": 7})], &none).unwrap_err();
        assert_eq!(e.field(), Some("[0].id"));

        let e = parse(&[], &none).unwrap_err();
        assert_eq!((e.code(), e.field()), ("invalid_batch", Some("batch")));

        let e = parse(&[event(A, B), event(B, B), event(A, A)], &none).unwrap_err();
        assert_eq!(e.field(), Some("[2].id"));
        // However written; a refused element's id counts too.
        let upper = event(&A.to_uppercase(), A);
        let e = parse(&[event(A, B), upper], &none).unwrap_err();
        assert_eq!(e.field(), Some("[1].id"));
        let e = parse(&[event(A, "bad"), event(A, B)], &none).unwrap_err();
        assert_eq!(e.field(), Some("[1].id"));

        let two = [event(A, B), event(B, A)];
        let mut headers = HeaderMap::new();
        headers.insert(BATCH_HEADER, HeaderValue::from_static("3"));
        let e = parse(&two, &headers).unwrap_err();
        assert_eq!(e.field(), Some("X-Event-Batch"));
        for marker in ["+2", "02", " 2", "2.0"] {
            headers.insert(BATCH_HEADER, HeaderValue::from_static(marker));
            let e = parse(&two, &headers).unwrap_err();
            assert_eq!(e.field(), Some("X-Event-Batch"), "{marker}");
        }
        headers.insert(BATCH_HEADER, HeaderValue::from_static("2"));
        assert_eq!(parse(&two, &headers).unwrap().events.len(), 2);
        // Twice, even the same: which one the sender meant is unknown (it
        // read the first only).
        for second in ["3", "2"] {
            let mut twice = headers.clone();
            twice.append(BATCH_HEADER, HeaderValue::from_static(second));
            let e = parse(&two, &twice).unwrap_err();
            assert_eq!(e.field(), Some("X-Event-Batch"), "{second}");
            assert!(
                e.to_json()["detail"]
                    .as_str()
                    .unwrap()
                    .contains("more than once")
            );
        }

        headers.insert("webhook-id", HeaderValue::from_str(A).unwrap());
        let e = parse(&two, &headers).unwrap_err();
        assert_eq!(e.field(), Some("webhook-id"));
        let id = batch_id([A, B]);
        headers.insert("webhook-id", HeaderValue::from_str(&id).unwrap());
        headers.insert("idempotency-key", HeaderValue::from_str(&id).unwrap());
        let events = parse(&two, &headers).unwrap().events;
        assert_eq!(events[0].1.id.to_string(), A);
        assert_eq!(events[1].1.id.to_string(), B);
    }
}
