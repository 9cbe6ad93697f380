//! Classifying one delivery attempt: the single place that decides what a
//! response or transport error means for the event
//! (`docs/architecture.md#response-classes`).
//!
//! | outcome | disposition |
//! |---|---|
//! | 2xx | [`Disposition::Delivered`] |
//! | timeout, connection error, 408, 425, 429, 5xx | [`Disposition::Retry`] |
//! | 400, 413, 415, 422 (configurable) | [`Disposition::DeadLetter`] |
//! | 401, 403, 404, 405, 3xx, anything else | [`Disposition::ConfigFault`]: retried, loudly |
//!
//! Unknown cases retry: an infrastructure error is transient until proven
//! permanent. Every disposition carries a reason that is logged once and
//! used as a metric label.

use crate::sink::service::Attempt;

/// Why an attempt was classified as it was: a short, stable label
/// (metric-safe) plus the HTTP status when there was one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reason {
    /// Stable label, e.g. `http_503`, `timeout`, `connect`.
    pub label: String,
    /// HTTP status, if a response arrived.
    pub status: Option<u16>,
}

/// What to do with the event after an attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// 2xx: the event is done.
    Delivered,
    /// Transient: retry with backoff.
    Retry(Reason),
    /// Poison: the event itself is refused; dead-letter it.
    DeadLetter(Reason),
    /// The sink is misconfigured (auth, URL, method): not the event's fault.
    /// Retry with backoff and alert; never dead-letter.
    ConfigFault(Reason),
}

/// Which HTTP statuses are poison. Defaults: 400, 413, 415, 422.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusPolicy {
    poison: Vec<u16>,
}

/// Statuses that are never the event's fault: configuration faults (the
/// URL, the secret, the method) and "try again later".
const NEVER_POISON: [u16; 7] = [401, 403, 404, 405, 408, 425, 429];

impl Default for StatusPolicy {
    fn default() -> Self {
        StatusPolicy {
            poison: vec![400, 413, 415, 422],
        }
    }
}

impl StatusPolicy {
    /// A policy with these poison statuses. Errors (naming the flag
    /// `--poison-statuses`) for anything but a 4xx, and for a 4xx that is
    /// a configuration fault or "try again later": a wrong `--sink-url`
    /// must not dead-letter every event.
    pub fn new(poison: Vec<u16>) -> Result<Self, String> {
        if let Some(bad) = poison.iter().find(|s| !(400..500).contains(*s)) {
            return Err(format!(
                "--poison-statuses may list only 4xx statuses, got {bad}"
            ));
        }
        if let Some(bad) = poison.iter().find(|s| NEVER_POISON.contains(*s)) {
            return Err(format!(
                "--poison-statuses cannot list {bad}: 401, 403, 404 and 405 say the relay's own \
                 configuration is wrong (events are kept and the circuit opens; a wrong \
                 --sink-url must not dead-letter every event), 408, 425 and 429 are retried"
            ));
        }
        Ok(StatusPolicy { poison })
    }

    /// The poison statuses.
    pub fn poison(&self) -> &[u16] {
        &self.poison
    }
}

/// Classifies one attempt. Pure: same input, same answer.
pub fn classify(attempt: &Attempt, policy: &StatusPolicy) -> Disposition {
    let status = match attempt {
        Attempt::Response { status, .. } => *status,
        Attempt::Timeout => return Disposition::Retry(reason("timeout", None)),
        Attempt::Connect(_) => return Disposition::Retry(reason("connect", None)),
        Attempt::Transport(_) => return Disposition::Retry(reason("transport", None)),
    };
    let label = format!("http_{status}");
    match status {
        200..=299 => Disposition::Delivered,
        408 | 425 | 429 | 500..=599 => Disposition::Retry(reason(&label, Some(status))),
        s if policy.poison.contains(&s) => Disposition::DeadLetter(reason(&label, Some(status))),
        _ => Disposition::ConfigFault(reason(&label, Some(status))),
    }
}

fn reason(label: &str, status: Option<u16>) -> Reason {
    Reason {
        label: label.to_owned(),
        status,
    }
}

/// The status class label for metrics: `2xx`, `4xx`, `5xx`, ... or `none`.
pub fn status_class(attempt: &Attempt) -> &'static str {
    match attempt {
        Attempt::Response { status, .. } => match status / 100 {
            1 => "1xx",
            2 => "2xx",
            3 => "3xx",
            4 => "4xx",
            5 => "5xx",
            _ => "other",
        },
        _ => "none",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resp(status: u16) -> Attempt {
        Attempt::Response {
            status,
            retry_after: None,
            excerpt: String::new(),
        }
    }

    #[test]
    fn every_status_class_has_its_disposition() {
        let p = StatusPolicy::default();
        for s in [200, 201, 204, 299] {
            assert_eq!(classify(&resp(s), &p), Disposition::Delivered, "{s}");
        }
        for s in [408, 425, 429, 500, 502, 503, 504, 599] {
            assert!(
                matches!(classify(&resp(s), &p), Disposition::Retry(_)),
                "{s}"
            );
        }
        for s in [400, 413, 415, 422] {
            assert!(
                matches!(classify(&resp(s), &p), Disposition::DeadLetter(_)),
                "{s}"
            );
        }
        for s in [301, 302, 307, 401, 403, 404, 405, 409, 410, 100] {
            assert!(
                matches!(classify(&resp(s), &p), Disposition::ConfigFault(_)),
                "{s}"
            );
        }
        for a in [
            Attempt::Timeout,
            Attempt::Connect("refused".into()),
            Attempt::Transport("reset".into()),
        ] {
            assert!(matches!(classify(&a, &p), Disposition::Retry(_)), "{a:?}");
        }
    }

    #[test]
    fn config_faults_and_retried_statuses_cannot_be_poison() {
        for bad in [vec![404], vec![400, 401], vec![429], vec![500], vec![200]] {
            let err = StatusPolicy::new(bad.clone()).unwrap_err();
            assert!(err.contains("--poison-statuses"), "{bad:?}: {err}");
        }
        assert!(StatusPolicy::new(vec![400, 409, 422]).is_ok());
    }

    #[test]
    fn poison_list_is_configurable_and_reasons_are_labels() {
        let p = StatusPolicy::new(vec![409]).unwrap();
        assert_eq!(
            classify(&resp(409), &p),
            Disposition::DeadLetter(Reason {
                label: "http_409".into(),
                status: Some(409)
            })
        );
        assert!(matches!(
            classify(&resp(422), &p),
            Disposition::ConfigFault(_)
        ));
        assert_eq!(status_class(&resp(503)), "5xx");
        assert_eq!(status_class(&Attempt::Timeout), "none");
    }
}
