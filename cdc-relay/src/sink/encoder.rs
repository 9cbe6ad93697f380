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
    legacy: Option<(Arc<Signer>, HeaderValue)>,
}

impl Prepared {
    /// `body`, with its legacy signature under `signer` when its scheme has one.
    pub fn signed(body: Bytes, signer: Arc<Signer>) -> Prepared {
        let legacy = signer.legacy(&body).map(|value| (signer, value));
        Prepared { body, legacy }
    }

    /// `body` without a signature made in advance (scripted sinks in tests).
    pub fn unsigned(body: Bytes) -> Prepared {
        Prepared { body, legacy: None }
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
    fn header_values_are_encoded() {
        assert_eq!(header_safe("abc-123"), "abc-123");
        assert_eq!(header_safe("a\r\nX-Evil: 1"), "a%0D%0AX-Evil:%201");
        assert_eq!(header_safe("é%"), "%C3%A9%25");
        assert!(http::HeaderValue::from_str(&header_safe("\u{0}\u{7f}\n")).is_ok());
    }
}
