//! What an attempt's reply means for the invoice: one pure function, the
//! only place that decides, as `sink::classify` is for the relay.
//!
//! The default is to retry: only an answer that proves the charge will
//! never happen with this request (a decline, a refused body) fails the
//! invoice. No answer, a 5xx, a timeout, a 409 (the key is still held by
//! an earlier attempt) or 429 retry with the same key, which is safe
//! because the provider charges a key once. 401/403/404/405/415 and 3xx are
//! configuration faults (a wrong URL or credentials): retried, loudly,
//! since fixing the configuration makes them succeed.

use serde_json::Value;

/// A reply from the provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// The body's bytes.
    pub body: Vec<u8>,
}

/// What to do with the invoice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Charged: the provider's charge id.
    Charged(String),
    /// Never to be charged by retrying: why.
    Failed(String),
    /// Unknown or not yet: try again with the same key, after the backoff.
    Retry(Retry),
}

/// Why an attempt is retried, and whether an operator must act.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retry {
    /// For the invoice's `charge_error` and the log.
    pub reason: String,
    /// A configuration fault (wrong URL, credentials): logged as an error.
    pub misconfigured: bool,
}

/// Longest excerpt of the provider's words kept in a reason, in characters.
const EXCERPT_CHARS: usize = 200;

/// The verdict on `reply` (`Err`: no answer, with the transport's words).
pub fn verdict(reply: Result<&Reply, &str>) -> Verdict {
    let reply = match reply {
        Ok(reply) => reply,
        Err(error) => return retry(format!("no answer: {error}"), false),
    };
    let said = said(&reply.body);
    match reply.status {
        200..=299 => match charge_id(&reply.body) {
            Some(id) => Verdict::Charged(id),
            None => retry(
                format!("{} without a charge_id: {said}", reply.status),
                false,
            ),
        },
        408 | 409 | 425 | 429 | 500..=599 => retry(format!("{} {said}", reply.status), false),
        300..=399 | 401 | 403 | 404 | 405 | 415 => retry(
            format!(
                "{} {said} (check --payments-url and the provider's credentials)",
                reply.status
            ),
            true,
        ),
        status => Verdict::Failed(format!("{status} {said}")),
    }
}

fn retry(reason: String, misconfigured: bool) -> Verdict {
    Verdict::Retry(Retry {
        reason,
        misconfigured,
    })
}

fn charge_id(body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    value
        .get("charge_id")?
        .as_str()
        .filter(|id| !id.is_empty())
        .map(str::to_owned)
}

/// `error: detail` of a JSON error body, else the body's first characters.
fn said(body: &[u8]) -> String {
    let text = match serde_json::from_slice::<Value>(body) {
        Ok(value) if value.get("error").is_some() => format!(
            "{}: {}",
            value["error"].as_str().unwrap_or("?"),
            value["detail"].as_str().unwrap_or("")
        ),
        _ => String::from_utf8_lossy(body).into_owned(),
    };
    text.chars().take(EXCERPT_CHARS).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(status: u16, body: &str) -> Verdict {
        verdict(Ok(&Reply {
            status,
            body: body.as_bytes().to_vec(),
        }))
    }

    #[test]
    fn a_2xx_with_a_charge_id_is_charged_and_anything_unproven_retries() {
        assert_eq!(
            reply(201, r#"{"charge_id":"ch-1","status":"succeeded"}"#),
            Verdict::Charged("ch-1".into())
        );
        assert!(matches!(reply(201, "{}"), Verdict::Retry(_)));
        assert!(matches!(reply(200, "not json"), Verdict::Retry(_)));
        assert!(matches!(
            verdict(Err("connection closed before message completed")),
            Verdict::Retry(Retry {
                misconfigured: false,
                ..
            })
        ));
        for status in [408, 409, 425, 429, 500, 502, 503, 504] {
            assert!(
                matches!(
                    reply(status, "{}"),
                    Verdict::Retry(Retry {
                        misconfigured: false,
                        ..
                    })
                ),
                "{status}"
            );
        }
    }

    #[test]
    fn configuration_faults_retry_loudly_and_refusals_fail_with_the_providers_words() {
        for status in [301, 401, 403, 404, 405, 415] {
            assert!(
                matches!(
                    reply(status, ""),
                    Verdict::Retry(Retry {
                        misconfigured: true,
                        ..
                    })
                ),
                "{status}"
            );
        }
        assert_eq!(
            reply(
                402,
                r#"{"error":"charge_declined","detail":"over the limit"}"#
            ),
            Verdict::Failed("402 charge_declined: over the limit".into())
        );
        assert!(matches!(reply(422, "{}"), Verdict::Failed(_)));
        assert!(matches!(reply(400, "{}"), Verdict::Failed(_)));
        let Verdict::Failed(long) = reply(400, &"x".repeat(1000)) else {
            panic!("400 fails");
        };
        assert!(long.chars().count() <= EXCERPT_CHARS + 4, "{long}");
    }
}
