//! What one POST gave: a response (its status, `Retry-After` and the
//! start of its body) or the transport failure that prevented one.

use std::time::Duration;

/// The result of one POST.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Attempt {
    /// A response arrived.
    Response {
        /// HTTP status code.
        status: u16,
        /// `Retry-After`, parsed from seconds or an HTTP-date.
        retry_after: Option<Duration>,
        /// The first bytes of the response body (lossy UTF-8), for logs and
        /// the dead-letter row. At most [`EXCERPT_BYTES`] bytes, or for a
        /// 207 (per-event answers, [`super::answers`]) [`ANSWERS_BYTES`](super::answers::ANSWERS_BYTES).
        excerpt: String,
    },
    /// No complete response within `--request-timeout`, on a connection
    /// that was made.
    Timeout,
    /// No connection: the TCP connect did not complete within
    /// `--sink-connect-timeout`, or (for `https`) the TLS handshake after it
    /// not within `--request-timeout`. Counted as a timeout
    /// (`reason="timeout"`); its detail says no request was sent.
    ConnectTimeout,
    /// Could not connect (refused, DNS).
    Connect(String),
    /// The TLS handshake failed (certificate, protocol).
    Tls(String),
    /// The connection broke mid-request, or another transport error.
    Transport(String),
}

impl Attempt {
    /// One line for logs and the dead-letter row: the status, its
    /// `Retry-After` when given (whole seconds), and up to 120 characters
    /// of the body (control characters removed), or the transport error.
    pub fn detail(&self) -> String {
        match self {
            Attempt::Response {
                status,
                excerpt,
                retry_after,
            } => {
                let mut e: String = excerpt.chars().take(120).collect();
                e.retain(|c| !c.is_control());
                let status = match retry_after {
                    Some(after) => format!(
                        "status {status} (Retry-After {} s)",
                        after.as_secs_f64().ceil()
                    ),
                    None => format!("status {status}"),
                };
                if e.trim().is_empty() {
                    format!("{status} (empty body)")
                } else {
                    format!("{status}: {e}")
                }
            }
            Attempt::Timeout => "request timed out".into(),
            Attempt::ConnectTimeout => {
                "timed out connecting: the TCP connect (or, for https, the TLS \
                 handshake after it) did not complete in time; no request was sent"
                    .into()
            }
            Attempt::Connect(e) | Attempt::Tls(e) | Attempt::Transport(e) => e.clone(),
        }
    }
}

/// Maximum response-body bytes kept in [`Attempt::Response::excerpt`].
pub const EXCERPT_BYTES: usize = 512;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_detail_gives_the_status_retry_after_and_body() {
        let answer = |retry_after, excerpt: &str| Attempt::Response {
            status: 429,
            retry_after,
            excerpt: excerpt.into(),
        };
        assert_eq!(
            answer(Some(Duration::from_secs(30)), "slow down\n").detail(),
            "status 429 (Retry-After 30 s): slow down"
        );
        assert_eq!(
            answer(Some(Duration::from_millis(1500)), "").detail(),
            "status 429 (Retry-After 2 s) (empty body)"
        );
        assert_eq!(answer(None, " ").detail(), "status 429 (empty body)");
    }
}
