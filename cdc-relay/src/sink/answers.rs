//! A receiver's per-event answer to a batch: `207 Multi-Status` with the
//! outcome of each event (`docs/architecture.md#batches`).
//!
//! ```text
//! HTTP/1.1 207 Multi-Status
//! Content-Type: application/json
//!
//! {"results":[{"id":"<event id>","status":201},
//!             {"id":"<event id>","status":422,"error":<any JSON>}]}
//! ```
//!
//! Each event is judged by its own `status` as a response to it alone
//! would be ([`classify`](fn@super::classify)); `error` (optional) becomes the
//! dead-letter row's detail. An event the answer does not name is not
//! done. A 207 that does not read as this shape is no answer per event:
//! the relay splits the batch ([`crate::dispatch`]). A 207 to one event's
//! request is read the same way (its own answer judges it); one of
//! another shape leaves the event not done.

use std::collections::HashMap;

use serde_json::Value;

/// The most body bytes read for a batch's 207 (the answer to a batch of
/// the largest allowed size, 1000 events, with room for errors).
pub const ANSWERS_BYTES: usize = 1 << 20;

/// The most characters of an event's `error` kept for logs and its
/// dead-letter row.
const ERROR_CHARS: usize = 500;

/// One event's answer in a 207.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventAnswer {
    /// The HTTP status the receiver gives this event: a 2xx other than
    /// 207, a 4xx or a 5xx.
    pub status: u16,
    /// Its `error` as text (a JSON string's value, any other JSON as
    /// written), at most 500 characters; empty when absent.
    pub error: String,
}

/// Reads a 207 body: each named event id with its answer. An error says
/// what does not match the shape (not JSON, no `results` array, an element
/// without a string `id` or without a `status` that is an event's outcome
/// (`is_outcome`), an id named twice).
pub fn parse(body: &str) -> Result<HashMap<String, EventAnswer>, String> {
    let value: Value =
        serde_json::from_str(body).map_err(|e| format!("the body is not JSON ({e})"))?;
    let Some(results) = value.get("results").and_then(Value::as_array) else {
        return Err("the body has no \"results\" array".into());
    };
    let mut answers = HashMap::with_capacity(results.len());
    for (i, result) in results.iter().enumerate() {
        let Some(id) = result.get("id").and_then(Value::as_str) else {
            return Err(format!("results[{i}] has no string \"id\""));
        };
        let status = result
            .get("status")
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("results[{i}] has no \"status\" number"))?;
        // 207 would say "taken" of nothing, 1xx and 3xx are no event's
        // outcome: read as one, a per-event 207 was taken as a 2xx.
        if !is_outcome(status) {
            return Err(format!(
                "results[{i}] has status {status}, which is no event's outcome (a 2xx other than 207, a 4xx or a 5xx)"
            ));
        }
        let error = match result.get("error") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.chars().take(ERROR_CHARS).collect(),
            Some(other) => other.to_string().chars().take(ERROR_CHARS).collect(),
        };
        let answer = EventAnswer {
            status: status as u16,
            error,
        };
        if answers.insert(id.to_owned(), answer).is_some() {
            return Err(format!("results[{i}] names event {id} a second time"));
        }
    }
    Ok(answers)
}

/// Whether `status` can be one event's outcome: a 2xx other than 207
/// (taken), a 4xx or a 5xx (refused, judged as a response to the event
/// alone would be). A 207 inside a 207 says nothing was taken, and 1xx
/// and 3xx are about a response, not an event.
fn is_outcome(status: u64) -> bool {
    matches!(status, 200..=299 | 400..=599) && status != 207
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_each_events_status_and_error() {
        let answers = parse(
            r#"{"results":[{"id":"a","status":201},
                {"id":"b","status":422,"error":{"error":"invalid_event","field":"data.amount_cents"}},
                {"id":"c","status":503,"error":"busy"},{"id":"d","status":200,"error":null}]}"#,
        )
        .unwrap();
        assert_eq!(answers.len(), 4);
        assert_eq!(answers["a"].status, 201);
        assert_eq!(answers["a"].error, "");
        assert_eq!(answers["b"].status, 422);
        assert_eq!(
            answers["b"].error,
            r#"{"error":"invalid_event","field":"data.amount_cents"}"#
        );
        assert_eq!(answers["c"].error, "busy");
        assert_eq!(answers["d"].error, "");
    }

    #[test]
    fn a_body_of_another_shape_is_no_answer_and_says_why() {
        for (body, why) in [
            ("", "not JSON"),
            ("ok", "not JSON"),
            (r#"{"refused":[]}"#, "no \"results\" array"),
            (r#"{"results":{}}"#, "no \"results\" array"),
            (
                r#"{"results":[{"status":200}]}"#,
                "results[0] has no string \"id\"",
            ),
            (r#"{"results":[{"id":7,"status":200}]}"#, "no string \"id\""),
            (
                r#"{"results":[{"id":"a"}]}"#,
                "results[0] has no \"status\"",
            ),
            (
                r#"{"results":[{"id":"a","status":"200"}]}"#,
                "no \"status\"",
            ),
            (
                r#"{"results":[{"id":"a","status":99}]}"#,
                "status 99, which is no event's outcome",
            ),
            (
                r#"{"results":[{"id":"a","status":600}]}"#,
                "status 600, which is no event's outcome",
            ),
            // A 207 per event would have been taken as a 2xx: the event
            // confirmed though nothing said it was taken.
            (
                r#"{"results":[{"id":"a","status":201},{"id":"b","status":207}]}"#,
                "results[1] has status 207, which is no event's outcome",
            ),
            (
                r#"{"results":[{"id":"a","status":102}]}"#,
                "status 102, which",
            ),
            (
                r#"{"results":[{"id":"a","status":302}]}"#,
                "status 302, which",
            ),
            (
                r#"{"results":[{"id":"a","status":200},{"id":"a","status":422}]}"#,
                "results[1] names event a a second time",
            ),
        ] {
            let e = parse(body).unwrap_err();
            assert!(e.contains(why), "{body}: {e}");
        }
    }

    #[test]
    fn a_long_error_is_cut_to_500_characters() {
        let long = "é".repeat(2000);
        let body = format!(r#"{{"results":[{{"id":"a","status":422,"error":"{long}"}}]}}"#);
        assert_eq!(parse(&body).unwrap()["a"].error.chars().count(), 500);
        // An empty answer names no event: every event is not done.
        assert!(parse(r#"{"results":[]}"#).unwrap().is_empty());
    }
}
