//! Request bodies: content type, size limit, nesting depth, JSON syntax.
//!
//! The checks run cheapest first so hostile input costs little:
//! 415 (headers only: a media type other than JSON, or a `Content-Encoding`
//! other than `identity`) → 413 (`Content-Length` or streamed count, never more
//! than the limit buffered) → 400 depth (one linear byte scan, before any
//! recursive parser sees the input) → 400 syntax, including a key repeated in
//! one object (`{"id":"E1","id":"E2"}`: which one counts would depend on the
//! parser, so neither does). A rejected body is read
//! and discarded (bounded, see [`DRAIN_LIMIT_BYTES`]) so the client reliably
//! receives the status.

use axum::extract::{FromRequest, Request};
use axum::http::{StatusCode, header};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::Value;

use crate::ServiceError;

/// Default request body limit: 64 KiB.
pub const DEFAULT_BODY_LIMIT_BYTES: usize = 64 * 1024;

/// Deepest accepted nesting of JSON arrays/objects (the tutorial's
/// `json_decode(..., 32)`). A top-level object is depth 1.
pub const MAX_JSON_DEPTH: usize = 32;

/// The body size limit in bytes, carried as a request extension.
///
/// [`crate::server::service_router`] inserts it; extractors fall back to
/// [`DEFAULT_BODY_LIMIT_BYTES`] when it is absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyLimit(pub usize);

/// A body that had `Content-Type: application/json` and fit the limit, still
/// unparsed: Billing must authenticate these exact bytes before parsing.
#[derive(Debug, Clone)]
pub struct RawJsonBody(pub Bytes);

/// A body that passed every check of [`RawJsonBody`] and parsed as JSON no
/// deeper than [`MAX_JSON_DEPTH`].
#[derive(Debug, Clone)]
pub struct JsonBody(pub Value);

impl<S: Send + Sync> FromRequest<S> for RawJsonBody {
    type Rejection = ServiceError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .map_or(DEFAULT_BODY_LIMIT_BYTES, |l| l.0);
        let declared = declared_length(req.headers());
        let content_type = require_identity_encoding(req.headers())
            .and_then(|()| require_json_content_type(req.headers()));
        let body = req.into_body();
        if let Err(unsupported) = content_type {
            drain(body, declared).await;
            return Err(unsupported);
        }
        if declared.is_some_and(|len| len > limit) {
            drain(body, declared).await;
            return Err(too_large(limit));
        }
        read_limited(body, limit).await.map(Self)
    }
}

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = ServiceError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let RawJsonBody(bytes) = RawJsonBody::from_request(req, state).await?;
        parse_json(&bytes).map(Self)
    }
}

/// Parses `bytes` as JSON after rejecting nesting deeper than
/// [`MAX_JSON_DEPTH`]; both failures, and a key repeated within one object,
/// are 400 `invalid_json` with the reason.
pub fn parse_json(bytes: &[u8]) -> Result<Value, ServiceError> {
    check_depth(bytes, MAX_JSON_DEPTH)
        .map_err(|e| ServiceError::bad_request("invalid_json", e.to_string()))?;
    serde_json::from_slice::<StrictValue>(bytes)
        .map(|v| v.0)
        .map_err(|e| ServiceError::bad_request("invalid_json", format!("invalid JSON: {e}")))
}

/// A JSON value whose objects have no repeated key (serde_json's `Value`
/// keeps the last one silently).
struct StrictValue(Value);

impl<'de> serde::Deserialize<'de> for StrictValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(StrictValue)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        serde::Deserialize::deserialize(d).map(|v: StrictValue| v.0)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(StrictValue(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(serde::de::Error::custom(format_args!(
                    "duplicate key {key:?} in one object"
                )));
            }
            let StrictValue(v) = map.next_value()?;
            object.insert(key, v);
        }
        Ok(Value::Object(object))
    }
}

/// 415 unless the body is sent as is: a `Content-Encoding` other than
/// `identity` (a proxy compressing requests) is refused before the body is
/// read, so the sender sees a configuration fault, not a malformed event.
fn require_identity_encoding(headers: &http::HeaderMap) -> Result<(), ServiceError> {
    for value in headers.get_all(header::CONTENT_ENCODING) {
        let text = value.to_str().unwrap_or("?");
        for coding in text.split(',').map(str::trim).filter(|c| !c.is_empty()) {
            if !coding.eq_ignore_ascii_case("identity") {
                return Err(ServiceError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_content_encoding",
                    format!(
                        "Content-Encoding {coding:?} is not accepted: send the body uncompressed (identity); a proxy in front of this service must not compress requests"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Nesting deeper than allowed, found at `offset` (bytes into the body).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("JSON nested deeper than {max} levels (at byte {offset})")]
pub struct DepthExceeded {
    /// The limit that was exceeded (levels).
    pub max: usize,
    /// Byte offset of the bracket that went one level too deep.
    pub offset: usize,
}

/// Scans `bytes` once, counting `[`/`{` outside strings, and stops at the
/// first one that would exceed `max` levels. Syntax is not checked here: it
/// only guarantees the recursive parser that runs next is never fed deep input.
pub fn check_depth(bytes: &[u8], max: usize) -> Result<(), DepthExceeded> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (offset, &b) in bytes.iter().enumerate() {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return Err(DepthExceeded { max, offset });
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

/// 415 unless the media type is `application/json` (parameters such as
/// `charset=utf-8` allowed, case-insensitive).
fn require_json_content_type(headers: &http::HeaderMap) -> Result<(), ServiceError> {
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"));
    if is_json {
        Ok(())
    } else {
        Err(ServiceError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "Content-Type must be application/json",
        ))
    }
}

fn declared_length(headers: &http::HeaderMap) -> Option<usize> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

fn too_large(limit: usize) -> ServiceError {
    ServiceError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        format!("request body exceeds {limit} bytes"),
    )
}

/// Reads at most `limit` bytes into memory; a body that grows past it is
/// answered 413 (after [`drain`]ing the rest, never buffering it).
async fn read_limited(body: axum::body::Body, limit: usize) -> Result<Bytes, ServiceError> {
    let mut stream = body.into_data_stream();
    let mut buf = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            ServiceError::bad_request("body_read_failed", format!("could not read the body: {e}"))
        })?;
        if buf.len() + chunk.len() > limit {
            drain_stream(stream, buf.len() + chunk.len()).await;
            return Err(too_large(limit));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(buf))
}

/// Most bytes of a rejected body read and discarded before answering.
///
/// Why read a body we refuse: closing a socket whose receive queue still
/// holds data makes the kernel send RST, and the client may then lose our
/// 413/415 and see "connection reset" instead. A relay retries a reset
/// forever but dead-letters a 413, so the status must arrive. Bodies
/// declared larger than this are refused without reading (and may see the
/// reset); the request timeout bounds a slow sender.
pub const DRAIN_LIMIT_BYTES: usize = 1024 * 1024;

/// Discards a rejected body, unless it is declared larger than
/// [`DRAIN_LIMIT_BYTES`].
async fn drain(body: axum::body::Body, declared: Option<usize>) {
    if declared.is_none_or(|len| len <= DRAIN_LIMIT_BYTES) {
        drain_stream(body.into_data_stream(), 0).await;
    }
}

async fn drain_stream(mut stream: axum::body::BodyDataStream, mut seen: usize) {
    while seen <= DRAIN_LIMIT_BYTES {
        match stream.next().await {
            Some(Ok(chunk)) => seen += chunk.len(),
            Some(Err(_)) | None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(depth: usize) -> String {
        format!("{}{}", "[".repeat(depth), "]".repeat(depth))
    }

    #[test]
    fn depth_limit_is_inclusive() {
        assert!(check_depth(nested(32).as_bytes(), 32).is_ok());
        let err = check_depth(nested(33).as_bytes(), 32).unwrap_err();
        assert_eq!(err.offset, 32);
    }

    #[test]
    fn brackets_inside_strings_do_not_count() {
        let body = format!(r#"{{"a":"{}\"{}"}}"#, "[".repeat(100), "{".repeat(100));
        assert!(check_depth(body.as_bytes(), 2).is_ok());
        assert!(parse_json(body.as_bytes()).is_ok());
    }

    #[test]
    fn escaped_backslash_closes_string() {
        // `"\\"` ends the string, so the bracket after it counts.
        assert!(check_depth(br#"["\\", [[1]]]"#, 2).is_err());
        assert!(check_depth(br#"["\\", [[1]]]"#, 3).is_ok());
    }

    #[test]
    fn parse_json_rejects_deep_and_malformed_with_400() {
        let deep = parse_json(nested(100).as_bytes()).unwrap_err();
        assert_eq!(deep.status(), StatusCode::BAD_REQUEST);
        let malformed = parse_json(b"{\"a\":").unwrap_err();
        assert_eq!(malformed.code(), "invalid_json");
    }

    #[test]
    fn parse_json_refuses_a_key_repeated_in_one_object_only() {
        for twice in [
            r#"{"id":"E1","id":"E2"}"#,
            r#"{"a":{"b":1,"b":1}}"#,
            r#"[{"k":1},{"k":2,"k":3}]"#,
        ] {
            let e = parse_json(twice.as_bytes()).unwrap_err();
            assert_eq!(e.status(), StatusCode::BAD_REQUEST, "{twice}");
        }
        let v =
            parse_json(br#"{"k":1,"o":{"k":2},"a":[{"k":3},{"k":4}],"n":null,"f":1.5,"t":true}"#)
                .unwrap();
        assert_eq!(
            v,
            serde_json::json!({"k":1,"o":{"k":2},"a":[{"k":3},{"k":4}],"n":null,"f":1.5,"t":true})
        );
        assert_eq!(parse_json(b"-7").unwrap(), serde_json::json!(-7));
        assert_eq!(
            parse_json(b"18446744073709551615").unwrap(),
            serde_json::json!(u64::MAX)
        );
    }

    #[test]
    fn only_identity_content_encoding_is_accepted() {
        let with = |v: &str| {
            let mut h = http::HeaderMap::new();
            h.insert(header::CONTENT_ENCODING, v.parse().unwrap());
            require_identity_encoding(&h)
        };
        assert!(require_identity_encoding(&http::HeaderMap::new()).is_ok());
        assert!(with("identity").is_ok() && with("IDENTITY").is_ok());
        for refused in ["gzip", "br", "deflate", "identity, gzip", "x-custom"] {
            let e = with(refused).unwrap_err();
            assert_eq!(e.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE, "{refused}");
        }
    }

    #[test]
    fn content_type_accepts_parameters_and_case() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            "Application/JSON; charset=utf-8".parse().unwrap(),
        );
        assert!(require_json_content_type(&headers).is_ok());
        headers.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        assert!(require_json_content_type(&headers).is_err());
        assert!(require_json_content_type(&http::HeaderMap::new()).is_err());
    }
}
