//! Request bodies, built once per event: the wire format
//! (`docs/architecture.md#wire-format`).
//!
//! ```text
//! {"id":"<outbox.id>","type":"<outbox.event_type>","data":<outbox.payload>}
//! ```
//!
//! `data` is the payload's JSON text exactly as PostgreSQL's `jsonb` output
//! function printed it, spliced in raw: numbers never pass through `f64`,
//! strings are never re-escaped, depth is unlimited (jsonb validated it). SQL
//! NULL becomes JSON `null`. `id` and `type` are escaped as JSON strings.

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderValue;

use crate::outbox::OutboxEvent;
use crate::sink::signature::Signer;

/// A request built once per event: the exact body bytes and, under the
/// legacy scheme, their `X-Event-Signature` with the signer that made it.
/// The Standard Webhooks signature covers the attempt's timestamp, so it is
/// made per attempt. Cheap to clone (the body is shared).
#[derive(Clone, Debug)]
pub struct Prepared {
    /// The JSON body.
    pub body: Bytes,
    /// A batch's number of events (`X-Event-Batch`); `None` for one event.
    pub batch: Option<usize>,
    legacy: Option<(Arc<Signer>, HeaderValue)>,
}

impl Prepared {
    /// `body`, with its legacy signature under `signer` when its scheme has one.
    pub fn signed(body: Bytes, signer: Arc<Signer>) -> Prepared {
        let legacy = signer.legacy(&body).map(|value| (signer, value));
        Prepared {
            body,
            batch: None,
            legacy,
        }
    }

    /// `body` without a signature made in advance (scripted sinks in tests).
    pub fn unsigned(body: Bytes) -> Prepared {
        Prepared {
            body,
            batch: None,
            legacy: None,
        }
    }

    /// The same request marked as a batch of `events` events.
    pub fn batch_of(mut self, events: usize) -> Prepared {
        self.batch = Some(events);
        self
    }

    /// `X-Event-Signature` for an attempt made with `signer`: the one made
    /// in advance while the keys are unchanged, else a new one (the keys
    /// were reloaded since: a retry must carry the key in use now).
    pub fn legacy_signature(&self, signer: &Arc<Signer>) -> Option<HeaderValue> {
        match &self.legacy {
            Some((by, value)) if Arc::ptr_eq(by, signer) => Some(value.clone()),
            _ => signer.legacy(&self.body),
        }
    }
}

/// Builds the JSON body for `event` (bytes, ready to send and sign).
pub fn body(event: &OutboxEvent) -> Bytes {
    let payload: &[u8] = event.payload.as_deref().unwrap_or(b"null");
    let mut out = Vec::with_capacity(payload.len() + event.id.len() + event.event_type.len() + 32);
    out.extend_from_slice(b"{\"id\":");
    push_json_string(&mut out, &event.id);
    out.extend_from_slice(b",\"type\":");
    push_json_string(&mut out, &event.event_type);
    out.extend_from_slice(b",\"data\":");
    out.extend_from_slice(payload);
    out.push(b'}');
    Bytes::from(out)
}

/// The body of a batch (`docs/architecture.md#batches`): the events'
/// single bodies, byte for byte, as a JSON array (`[b1,b2,…]`, no
/// whitespace).
pub fn batch_body<'a>(events: impl IntoIterator<Item = &'a OutboxEvent>) -> Bytes {
    let mut out = Vec::new();
    out.push(b'[');
    for (i, event) in events.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(&body(event));
    }
    out.push(b']');
    Bytes::from(out)
}

/// A batch's request id (`webhook-id`, `Idempotency-Key`): `batch_` and
/// the lowercase hex of the first 16 bytes of SHA-256 over each event id
/// followed by a line feed, in body order
/// (`docs/architecture.md#batches`). The same events in the same order
/// give the same id on every attempt.
pub fn batch_id<'a>(ids: impl IntoIterator<Item = &'a str>) -> String {
    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    for id in ids {
        hash.update(id.as_bytes());
        hash.update(b"\n");
    }
    format!("batch_{}", hex::encode(&hash.finalize()[..16]))
}

/// What a batch's body costs at most for `event`, estimated before
/// encoding: its single body's size when nothing needs escaping, and the
/// comma (a receiver's 413 splits a batch an escape made too large).
pub fn estimated_size(event: &OutboxEvent) -> usize {
    event.payload.as_ref().map_or(4, |p| p.len()) + event.id.len() + event.event_type.len() + 28
}

fn push_json_string(out: &mut Vec<u8>, s: &str) {
    // serde_json escapes quotes, backslashes and every control character; the
    // write into a Vec cannot fail.
    serde_json::to_writer(&mut *out, s).expect("writing JSON into a Vec cannot fail");
}

/// Makes a row value safe as an HTTP header value: visible ASCII is kept,
/// `%` and every other byte (CR, LF, controls, non-ASCII) are percent-encoded,
/// so nothing from a row can inject a header.
pub fn header_safe(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for &b in value.as_bytes() {
        if (0x21..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lsn::Lsn;

    fn event(id: &str, ty: &str, payload: Option<&str>) -> OutboxEvent {
        OutboxEvent {
            id: id.into(),
            event_type: ty.into(),
            payload: payload.map(|p| Bytes::copy_from_slice(p.as_bytes())),
            aggregate_key: None,
            commit_lsn: Some(Lsn::new(1)),
            commit_time_micros: 0,
            dead_letter_id: None,
            trace: None,
        }
    }

    #[test]
    fn payload_is_spliced_raw() {
        let p =
            r#"{"n": 123456789012345678901234567890, "d": 1.50000000000000000001, "s": "\u2028é"}"#;
        let b = body(&event("e1", "OrderCreated", Some(p)));
        assert_eq!(
            std::str::from_utf8(&b).unwrap(),
            format!(r#"{{"id":"e1","type":"OrderCreated","data":{p}}}"#)
        );
    }

    #[test]
    fn sql_null_is_json_null() {
        let b = body(&event("e1", "T", None));
        assert_eq!(&b[..], br#"{"id":"e1","type":"T","data":null}"#);
    }

    #[test]
    fn id_and_type_cannot_inject_keys() {
        let b = body(&event(
            "a\"b",
            "x\",\"admin\":true,\"y\":\"\n\u{1}",
            Some("1"),
        ));
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        let obj = v.as_object().unwrap();
        assert_eq!(obj.len(), 3, "no injected keys: {v}");
        assert_eq!(obj["id"], "a\"b");
        assert_eq!(obj["type"], "x\",\"admin\":true,\"y\":\"\n\u{1}");
    }

    #[test]
    fn a_batch_is_the_single_bodies_as_an_array_with_the_documented_id() {
        let (a, b) = (event("e1", "T", Some("{\"n\":1}")), event("e2", "T", None));
        let batch = batch_body([&a, &b]);
        assert_eq!(
            &batch[..],
            [&b"["[..], &body(&a), b",", &body(&b), b"]"]
                .concat()
                .as_slice()
        );
        let v: serde_json::Value = serde_json::from_slice(&batch).unwrap();
        assert_eq!(v.as_array().map(Vec::len), Some(2));
        assert!(estimated_size(&a) > body(&a).len());
        // The vector of docs/architecture.md#batches (Billing checks it too).
        assert_eq!(
            batch_id([
                "8f0e6c1a-52c5-4b7e-9d52-3f0d2d7b9e11",
                "0b6a7e4c-1f2d-4c3b-8a9e-5d6f7a8b9c0d"
            ]),
            "batch_770f11200c20a99b3ab5a8997012c64e"
        );
    }

    #[test]
    fn header_values_are_encoded() {
        assert_eq!(header_safe("abc-123"), "abc-123");
        assert_eq!(header_safe("a\r\nX-Evil: 1"), "a%0D%0AX-Evil:%201");
        assert_eq!(header_safe("é%"), "%C3%A9%25");
        assert!(http::HeaderValue::from_str(&header_safe("\u{0}\u{7f}\n")).is_ok());
    }
}
