//! Classifying one delivery attempt: the single place that decides what a
//! response or transport error means for the event
//! (`docs/architecture.md#response-classes`).
//!
//! | outcome | disposition |
//! |---|---|
//! | 2xx | [`Disposition::Delivered`] |
//! | timeout, connection error, 408, 425, 429, 5xx | [`Disposition::Retry`] |
//! | 400, 413, 422 (configurable) | [`Disposition::DeadLetter`] |
//! | 410 | [`Disposition::Retired`]: kept, probed rarely |
//! | 401, 403, 404, 405, 415, 3xx, anything else | [`Disposition::ConfigFault`]: retried, loudly |
//!
//! Unknown cases retry: an infrastructure error is transient until proven
//! permanent. Every disposition carries a reason: its label, one of the
//! fixed list [`REASONS`], is the metric label (a sink answering a hundred
//! different statuses must not make a hundred series); the exact status goes
//! to the logs and the dead-letter row.

use std::fmt;

use crate::clock::SKEW_WARN;
use crate::sink::service::Attempt;

/// A [`Reason`]'s metric label (`cdc_relay_retries_total{reason}`): a
/// fixed list, documented in `docs/architecture.md#response-classes`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReasonLabel {
    /// The whole attempt timed out.
    Timeout,
    /// The connection could not be made.
    Connect,
    /// The TLS handshake failed.
    Tls,
    /// The connection broke mid-request.
    Transport,
    /// A redirect.
    Http3xx,
    /// 401: the secret or credentials.
    Http401,
    /// 403: the secret or credentials.
    Http403,
    /// 404: the URL.
    Http404,
    /// 410: the endpoint is retired.
    Http410,
    /// 429: rate limited.
    Http429,
    /// Any other 4xx.
    Http4xx,
    /// A 5xx.
    Http5xx,
    /// A status outside 1xx-5xx classes above.
    HttpOther,
}

impl ReasonLabel {
    /// Every label, in documentation order.
    pub const ALL: [ReasonLabel; 13] = [
        ReasonLabel::Timeout,
        ReasonLabel::Connect,
        ReasonLabel::Tls,
        ReasonLabel::Transport,
        ReasonLabel::Http3xx,
        ReasonLabel::Http401,
        ReasonLabel::Http403,
        ReasonLabel::Http404,
        ReasonLabel::Http410,
        ReasonLabel::Http429,
        ReasonLabel::Http4xx,
        ReasonLabel::Http5xx,
        ReasonLabel::HttpOther,
    ];

    /// The metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            ReasonLabel::Timeout => "timeout",
            ReasonLabel::Connect => "connect",
            ReasonLabel::Tls => "tls",
            ReasonLabel::Transport => "transport",
            ReasonLabel::Http3xx => "http_3xx",
            ReasonLabel::Http401 => "http_401",
            ReasonLabel::Http403 => "http_403",
            ReasonLabel::Http404 => "http_404",
            ReasonLabel::Http410 => "http_410",
            ReasonLabel::Http429 => "http_429",
            ReasonLabel::Http4xx => "http_4xx",
            ReasonLabel::Http5xx => "http_5xx",
            ReasonLabel::HttpOther => "http_other",
        }
    }
}

/// Every label a [`Reason`] can have, as text ([`ReasonLabel::as_str`]).
pub const REASONS: [&str; 13] = {
    let mut out = [""; 13];
    let mut i = 0;
    while i < ReasonLabel::ALL.len() {
        out[i] = ReasonLabel::ALL[i].as_str();
        i += 1;
    }
    out
};

/// Every label [`status_class`] returns (`status_class` of
/// `cdc_relay_delivery_attempts_total`).
pub const STATUS_CLASSES: [&str; 7] = ["1xx", "2xx", "3xx", "4xx", "5xx", "other", "none"];

/// Why an attempt was classified as it was: a label from [`REASONS`]
/// (metric-safe) plus the HTTP status when there was one. Displays as the
/// exact status (`http_503`) for logs, or the label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reason {
    /// Its metric label.
    pub label: ReasonLabel,
    /// HTTP status, if a response arrived.
    pub status: Option<u16>,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.status {
            Some(status) => write!(f, "http_{status}"),
            None => f.write_str(self.label.as_str()),
        }
    }
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
    /// 410 Gone: the endpoint is retired (the Standard Webhooks
    /// convention: a receiver answers 410 to say "stop sending"). Not the
    /// event's fault either: kept, never dead-lettered, and the endpoint is
    /// probed only rarely until it answers 2xx again.
    Retired(Reason),
}

/// Which HTTP statuses are poison. Defaults: 400, 413, 422.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusPolicy {
    poison: Vec<u16>,
}

/// Statuses that are never the event's fault: configuration faults (the
/// URL, the secret, the method, the body's media type or encoding: a proxy
/// compressing requests), a retired endpoint (410) and "try again later".
const NEVER_POISON: [u16; 9] = [401, 403, 404, 405, 410, 415, 408, 425, 429];

impl Default for StatusPolicy {
    fn default() -> Self {
        StatusPolicy {
            poison: vec![400, 413, 422],
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
                "--poison-statuses cannot list {bad}: 401, 403, 404, 405 and 415 say the relay's own \
                 configuration is wrong (events are kept and the circuit opens; a wrong \
                 --sink-url, or a proxy compressing requests, must not dead-letter every event), \
                 410 says the endpoint is retired (events are kept and it is probed rarely), \
                 408, 425 and 429 are retried"
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
        Attempt::Timeout | Attempt::ConnectTimeout => {
            return Disposition::Retry(reason(ReasonLabel::Timeout, None));
        }
        Attempt::Connect(_) => return Disposition::Retry(reason(ReasonLabel::Connect, None)),
        Attempt::Tls(_) => return Disposition::Retry(reason(ReasonLabel::Tls, None)),
        Attempt::Transport(_) => return Disposition::Retry(reason(ReasonLabel::Transport, None)),
    };
    let why = reason(status_label(status), Some(status));
    match status {
        200..=299 => Disposition::Delivered,
        408 | 425 | 429 | 500..=599 => Disposition::Retry(why),
        410 => Disposition::Retired(why),
        s if policy.poison.contains(&s) => Disposition::DeadLetter(why),
        _ => Disposition::ConfigFault(why),
    }
}

/// The label of a status: the ones that name a distinct fault keep their
/// number (401/403: the secret or credentials; 404: the URL; 410: the
/// endpoint retired; 429: rate limited), the rest fall into their class.
fn status_label(status: u16) -> ReasonLabel {
    match status {
        401 => ReasonLabel::Http401,
        403 => ReasonLabel::Http403,
        404 => ReasonLabel::Http404,
        410 => ReasonLabel::Http410,
        429 => ReasonLabel::Http429,
        300..=399 => ReasonLabel::Http3xx,
        400..=499 => ReasonLabel::Http4xx,
        500..=599 => ReasonLabel::Http5xx,
        _ => ReasonLabel::HttpOther,
    }
}

fn reason(label: ReasonLabel, status: Option<u16>) -> Reason {
    Reason { label, status }
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

/// What an operator should check for the configuration fault `reason`,
/// answered by `attempt`, while this machine's clock is `clock_skew`
/// seconds off the database server's (`cdc_relay_clock_skew_seconds`). A
/// 401 or 403 whose body refuses a timestamp (outside a tolerance, too
/// old, too new, expired: Standard Webhooks', Svix's and Stripe's words,
/// and Billing's), or that comes while the
/// clocks are [`SKEW_WARN`] or more apart, is the clock: receivers check the
/// signature's `webhook-timestamp` against theirs, and a stepped clock
/// fails every signature however right the secret is.
pub fn config_fault_hint(reason: &Reason, attempt: &Attempt, clock_skew: f64) -> &'static str {
    // The body must refuse the timestamp, not only name it: a wrong-secret
    // answer may spell out what was signed ("webhook-id.webhook-timestamp.
    // body"), and Billing's does.
    const REFUSED: [&str; 8] = [
        "tolerance",
        "too old",
        "too new",
        "in the future",
        "expired",
        "stale",
        "skew",
        "outside",
    ];
    let timestamp = match attempt {
        Attempt::Response { excerpt, .. } => {
            let lower = excerpt.to_ascii_lowercase();
            lower.contains("timestamp") && REFUSED.iter().any(|w| lower.contains(w))
        }
        _ => false,
    };
    match reason.status {
        Some(401 | 403) if timestamp || clock_skew.abs() >= SKEW_WARN.as_secs_f64() => {
            "the receiver refuses the signature's timestamp: check this machine's clock against the database server's and the receiver's (cdc_relay_clock_skew_seconds; fix time sync: NTP, chrony), not the event secret"
        }
        Some(401 | 403) => "check the event secret (EVENT_SECRET) and the sink's auth",
        Some(404 | 405) => "check --sink-url (path and method POST)",
        Some(415) => {
            "the sink refuses the body's Content-Type or Content-Encoding: is a proxy in front of it compressing requests?"
        }
        Some(300..=399) => "the sink redirects; point --sink-url at the final URL",
        _ => {
            "an unexpected status; if it means the event itself is refused, add it to --poison-statuses"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(status: u16, excerpt: &str) -> Attempt {
        Attempt::Response {
            status,
            retry_after: None,
            excerpt: excerpt.to_owned(),
        }
    }

    #[test]
    fn a_401_is_the_clock_when_the_body_or_the_skew_says_so_else_the_secret() {
        let r401 = Reason {
            label: ReasonLabel::Http401,
            status: Some(401),
        };
        let clock = config_fault_hint(
            &r401,
            &answered(401, r#"{"error":"timestamp_outside_tolerance"}"#),
            0.0,
        );
        assert!(clock.contains("clock"), "{clock}");
        let skewed = config_fault_hint(&r401, &answered(401, "unauthorized"), -600.0);
        assert!(skewed.contains("clock"), "{skewed}");
        let secret = config_fault_hint(&r401, &answered(401, "invalid_signature"), 0.5);
        assert!(
            secret.contains("EVENT_SECRET") && !secret.contains("clock"),
            "{secret}"
        );
        // Billing's wrong-secret answer names the timestamp it signed over;
        // that is not a refused timestamp.
        let named = config_fault_hint(
            &r401,
            &answered(
                401,
                r#"{"error":"invalid_signature","detail":"webhook-signature holds no v1 signature of webhook-id.webhook-timestamp.body made with an accepted secret"}"#,
            ),
            0.0,
        );
        assert!(
            named.contains("EVENT_SECRET") && !named.contains("clock"),
            "{named}"
        );
        for refused in [
            "Message timestamp too old",
            "Timestamp outside the tolerance zone",
        ] {
            assert!(
                config_fault_hint(&r401, &answered(401, refused), 0.0).contains("clock"),
                "{refused}"
            );
        }
        let url = Reason {
            label: ReasonLabel::Http404,
            status: Some(404),
        };
        assert!(config_fault_hint(&url, &answered(404, "timestamp"), 900.0).contains("--sink-url"));
    }

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
        for s in [400, 413, 422] {
            assert!(
                matches!(classify(&resp(s), &p), Disposition::DeadLetter(_)),
                "{s}"
            );
        }
        assert!(matches!(
            classify(&resp(410), &p),
            Disposition::Retired(Reason {
                label: ReasonLabel::Http410,
                status: Some(410)
            })
        ));
        for s in [301, 302, 307, 401, 403, 404, 405, 409, 415, 100] {
            assert!(
                matches!(classify(&resp(s), &p), Disposition::ConfigFault(_)),
                "{s}"
            );
        }
        for a in [
            Attempt::Timeout,
            Attempt::ConnectTimeout,
            Attempt::Connect("refused".into()),
            Attempt::Tls("unknown issuer".into()),
            Attempt::Transport("reset".into()),
        ] {
            assert!(matches!(classify(&a, &p), Disposition::Retry(_)), "{a:?}");
        }
    }

    #[test]
    fn config_faults_and_retried_statuses_cannot_be_poison() {
        for bad in [
            vec![404],
            vec![400, 401],
            vec![410],
            vec![429],
            vec![500],
            vec![200],
        ] {
            let err = StatusPolicy::new(bad.clone()).unwrap_err();
            assert!(err.contains("--poison-statuses"), "{bad:?}: {err}");
        }
        assert!(StatusPolicy::new(vec![400, 409, 422]).is_ok());
    }

    #[test]
    fn poison_list_is_configurable_and_reasons_are_labels() {
        let p = StatusPolicy::new(vec![409]).unwrap();
        let verdict = classify(&resp(409), &p);
        assert_eq!(
            verdict,
            Disposition::DeadLetter(Reason {
                label: ReasonLabel::Http4xx,
                status: Some(409)
            })
        );
        let Disposition::DeadLetter(why) = verdict else {
            unreachable!()
        };
        assert_eq!(why.to_string(), "http_409", "logs keep the exact status");
        assert!(matches!(
            classify(&resp(422), &p),
            Disposition::ConfigFault(_)
        ));
        assert_eq!(status_class(&resp(503)), "5xx");
        assert_eq!(status_class(&Attempt::Timeout), "none");
    }

    /// Every status from 100 to 999 and every transport outcome maps into
    /// the fixed list, and the list has no label nothing maps to.
    #[test]
    fn labels_come_from_the_fixed_list_whatever_the_status() {
        let p = StatusPolicy::default();
        let mut seen = std::collections::BTreeSet::new();
        let attempts = (100..=999).map(resp).chain([
            Attempt::Timeout,
            Attempt::ConnectTimeout,
            Attempt::Connect(String::new()),
            Attempt::Tls(String::new()),
            Attempt::Transport(String::new()),
        ]);
        for a in attempts {
            match classify(&a, &p) {
                Disposition::Delivered => {}
                Disposition::Retry(r)
                | Disposition::DeadLetter(r)
                | Disposition::ConfigFault(r)
                | Disposition::Retired(r) => {
                    assert!(REASONS.contains(&r.label.as_str()), "{a:?}: {:?}", r.label);
                    seen.insert(r.label.as_str());
                }
            }
        }
        assert_eq!(seen, REASONS.into_iter().collect());
        let classes: std::collections::BTreeSet<&str> = (0..=999)
            .map(resp)
            .chain([Attempt::Timeout])
            .map(|a| status_class(&a))
            .collect();
        assert_eq!(classes, STATUS_CLASSES.into_iter().collect());
        assert_eq!(status_label(503).as_str(), "http_5xx");
        assert_eq!(status_label(599).as_str(), "http_5xx");
        assert_eq!(status_label(401).as_str(), "http_401");
        assert_eq!(status_label(418).as_str(), "http_4xx");
        assert_eq!(status_label(302).as_str(), "http_3xx");
        assert_eq!(status_label(600).as_str(), "http_other");
        assert_eq!(status_label(101).as_str(), "http_other");
    }
}
