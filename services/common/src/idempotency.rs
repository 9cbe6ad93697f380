//! The `Idempotency-Key` request header, after the IETF HTTPAPI draft "The
//! Idempotency-Key HTTP Header Field": parsing the key and fingerprinting
//! the request it came with, and the errors a service answers with. Each
//! service stores keys in its own table, in the same transaction as the
//! effect the key protects (Orders: the order; Payments: the charge).
//!
//! The body is compared by a SHA-256 fingerprint of its canonical JSON
//! (keys sorted, no whitespace), so formatting does not matter but every
//! value does.

use crate::ServiceError;
use axum::http::HeaderMap;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// The request header.
pub const HEADER: &str = "idempotency-key";

/// The response header on a replayed answer (`true`).
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// A client's idempotency key and the fingerprint of the request it came with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey {
    /// The key, without the quotes of the structured-field form.
    pub key: String,
    /// SHA-256 of the body's canonical JSON.
    pub fingerprint: Vec<u8>,
}

impl IdempotencyKey {
    /// The key of a request, if it sent one. The value may be a structured
    /// field string (`"abc-123"`, as the draft writes it) or bare
    /// (`abc-123`); either way 1 to [`MAX_KEY_LEN`] visible ASCII
    /// characters. More than one header, or a bad value, is 400
    /// `invalid_idempotency_key`.
    pub fn from_request(headers: &HeaderMap, body: &Value) -> Result<Option<Self>, ServiceError> {
        let mut values = headers.get_all(HEADER).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        let invalid =
            |why: &str| ServiceError::bad_request("invalid_idempotency_key", why.to_owned());
        if values.next().is_some() {
            return Err(invalid("send one Idempotency-Key header, not several"));
        }
        let raw = value
            .to_str()
            .map_err(|_| invalid("Idempotency-Key must be visible ASCII"))?;
        let key = match raw.strip_prefix('"') {
            Some(rest) => rest
                .strip_suffix('"')
                .filter(|inner| !inner.contains(['"', '\\']))
                .ok_or_else(|| invalid("a quoted Idempotency-Key must end with its quote"))?,
            None => raw,
        };
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(invalid("Idempotency-Key must be 1 to 255 characters"));
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(invalid(
                "Idempotency-Key must be visible ASCII without spaces",
            ));
        }
        Ok(Some(Self {
            key: key.to_owned(),
            fingerprint: fingerprint(body),
        }))
    }
}

/// SHA-256 of `body` serialized canonically (serde_json's maps are sorted).
pub fn fingerprint(body: &Value) -> Vec<u8> {
    let canonical = serde_json::to_vec(body).expect("a Value always serializes");
    Sha256::digest(&canonical).to_vec()
}

/// 422 `idempotency_key_reused`: the key was used with another body;
/// `what` names what a new key would make (`order`, `charge`).
pub fn reused(what: &str) -> ServiceError {
    ServiceError::invalid_field(
        "idempotency_key_reused",
        "Idempotency-Key",
        format!("this key was used with a different request body; use a new key for a new {what}"),
    )
}

/// 409: a request with this key is still in progress (its transaction held
/// the key past `lock_timeout`), or its row vanished meanwhile; retry.
pub fn in_progress() -> ServiceError {
    ServiceError::new(
        axum::http::StatusCode::CONFLICT,
        "idempotency_key_in_progress",
        "a request with this Idempotency-Key is still in progress; retry shortly",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use serde_json::json;

    fn key(values: &[&str]) -> Result<Option<IdempotencyKey>, ServiceError> {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(HEADER, HeaderValue::from_str(v).unwrap());
        }
        IdempotencyKey::from_request(&headers, &json!({"a": 1}))
    }

    #[test]
    fn bare_and_quoted_keys_are_the_same_key() {
        let bare = key(&["abc-123"]).unwrap().unwrap();
        let quoted = key(&["\"abc-123\""]).unwrap().unwrap();
        assert_eq!(bare, quoted);
        assert_eq!(bare.key, "abc-123");
        assert_eq!(key(&[]).unwrap(), None);
    }

    #[test]
    fn bad_keys_are_400() {
        let long = "k".repeat(MAX_KEY_LEN + 1);
        for bad in [
            vec![""],
            vec!["\"\""],
            vec!["a b"],
            vec!["\"abc"],
            vec!["\"a\"b\""],
            vec![long.as_str()],
            vec!["a", "b"],
        ] {
            let err = key(&bad).unwrap_err();
            assert_eq!(err.code(), "invalid_idempotency_key", "{bad:?}");
            assert_eq!(err.status(), 400);
        }
        assert!(key(&["k".repeat(MAX_KEY_LEN).as_str()]).is_ok());
    }

    #[test]
    fn the_fingerprint_ignores_formatting_and_key_order_but_not_values() {
        let parse = |s: &str| fingerprint(&serde_json::from_str(s).unwrap());
        assert_eq!(
            parse(r#"{"amount_cents":1,"currency":"EUR"}"#),
            parse(r#"{ "currency" : "EUR", "amount_cents" : 1 }"#)
        );
        assert_ne!(
            parse(r#"{"amount_cents":1,"currency":"EUR"}"#),
            parse(r#"{"amount_cents":2,"currency":"EUR"}"#)
        );
        assert_ne!(
            parse(r#"{"amount_cents":1,"currency":"EUR"}"#),
            parse(r#"{"amount_cents":1,"currency":"EUR","note":"x"}"#)
        );
    }
}
