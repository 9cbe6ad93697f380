//! The routes file (`run --routes FILE`, `routes check FILE`): several
//! endpoints fed from one slot, each taking the event types it names.
//!
//! ```toml
//! unrouted = "dead-letter"            # or "skip"; default "dead-letter"
//!
//! [[endpoint]]
//! name = "billing"                    # [a-z0-9_-]{1,64}: the metric label
//! url = "https://billing.internal/inbox"
//! event_types = ["OrderCreated", "Invoice*"]
//! secret_env = "BILLING_EVENT_SECRET" # or secret_file = "/etc/…"; never the secret itself
//! max_in_flight = 32                  # optional; the others default to run's flags
//! batch_max_events = 64               # optional: events per request (the endpoint takes batches)
//! batch_max_bytes = 49152             # optional: a batch's body size at most, bytes
//! request_timeout = "4s"
//! max_lag = "10m"                     # optional: park it once an event waited this long
//! rate = 200                          # optional: requests/s at most (live and replayed)
//! resume = "auto"                     # or "manual": how a parked endpoint comes back
//! ```
//!
//! Every mistake is a [`RoutesError`] naming the file, the endpoint and the
//! key (`run` exits 2 with it). The reference is `docs/operations.md#routes-file`.

pub mod args;

use std::path::{Path, PathBuf};
use std::time::Duration;

use event_secret::{EventKeys, Source};
use toml::{Table, Value};

use crate::dispatch::{Unrouted, route::Pattern};

/// A routes file that cannot be used: which file, endpoint and key, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("routes file {}: {}{}{problem}", file.display(), endpoint.as_ref().map(|e| format!("{e}: ")).unwrap_or_default(), key.as_ref().map(|k| format!("key `{k}`: ")).unwrap_or_default())]
pub struct RoutesError {
    /// The file.
    pub file: PathBuf,
    /// The endpoint (`endpoint "billing"`, or `endpoint #2` before its name
    /// is known), if the problem is in one.
    pub endpoint: Option<String>,
    /// The key, if the problem is one key's.
    pub key: Option<String>,
    /// What is wrong and what to write instead.
    pub problem: String,
}

/// Where an endpoint's secret is read from: never the file itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SecretRef {
    /// An environment variable of the relay (`secret_env`).
    Env(String),
    /// A file (`secret_file`): one secret, as `EVENT_SECRET_FILE`.
    File(PathBuf),
}

/// One `[[endpoint]]`, validated. Settings left out take `run`'s flags.
#[derive(Clone, Debug, PartialEq)]
pub struct EndpointSpec {
    /// `[a-z0-9_-]`, 1 to 64 characters, unique in the file.
    pub name: String,
    /// The inbox URL (http or https).
    pub url: url::Url,
    /// Exact names and `*` globs; at least one.
    pub event_types: Vec<Pattern>,
    /// The signing secret.
    pub secret: SecretRef,
    /// During a rotation, the secret being retired.
    pub previous_secret: Option<SecretRef>,
    /// Deliveries to this endpoint at once (1..=4096).
    pub max_in_flight: Option<usize>,
    /// Events per request at most (1..=1000; `docs/architecture.md#batches`).
    pub batch_max_events: Option<usize>,
    /// A batch's body size at most, bytes (1 KiB..=16 MiB).
    pub batch_max_bytes: Option<usize>,
    /// Whole-attempt timeout (above 0, below `--shutdown-timeout`).
    pub request_timeout: Option<Duration>,
    /// First retry delay ceiling.
    pub backoff_base: Option<Duration>,
    /// Retry delay cap.
    pub backoff_cap: Option<Duration>,
    /// Consecutive transient failures that open this endpoint's circuit.
    pub failure_threshold: Option<u32>,
    /// Time between probes while its circuit is open (at least 50 ms).
    pub probe_interval: Option<Duration>,
    /// Statuses that mark an event as poison at this endpoint.
    pub poison_statuses: Option<Vec<u16>>,
    /// Park the endpoint once its oldest pending event has waited this
    /// long (at least 1 s); `None`: never parked for lag
    /// (`docs/architecture.md#parking`).
    pub max_lag: Option<Duration>,
    /// Requests per second at most (0.001 to 1,000,000), live and
    /// replayed together; `None`: no cap.
    pub rate: Option<f64>,
    /// `resume = "auto"` (the default): a parked endpoint's rows are
    /// replayed by the relay and it returns to live delivery; `"manual"`:
    /// it stays parked until an operator replays them with the relay
    /// stopped.
    pub auto_resume: bool,
}

/// A validated routes file.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutesFile {
    /// Where it was read from (for messages).
    pub path: PathBuf,
    /// What happens to an event no endpoint takes.
    pub unrouted: Unrouted,
    /// The endpoints, in file order (lane order).
    pub endpoints: Vec<EndpointSpec>,
}

const TOP_KEYS: [&str; 2] = ["unrouted", "endpoint"];
const ENDPOINT_KEYS: [&str; 19] = [
    "name",
    "url",
    "event_types",
    "secret_env",
    "secret_file",
    "previous_secret_env",
    "previous_secret_file",
    "max_in_flight",
    "batch_max_events",
    "batch_max_bytes",
    "request_timeout",
    "backoff_base",
    "backoff_cap",
    "failure_threshold",
    "probe_interval",
    "poison_statuses",
    "max_lag",
    "rate",
    "resume",
];

/// Longest endpoint name (a metric label value).
const NAME_MAX: usize = 64;

impl RoutesFile {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Self, RoutesError> {
        let text = std::fs::read_to_string(path).map_err(|e| RoutesError {
            file: path.to_owned(),
            endpoint: None,
            key: None,
            problem: format!("cannot read it: {e}"),
        })?;
        Self::parse(path, &text)
    }

    /// Validates `text`, the content of `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Self, RoutesError> {
        let err = |endpoint: Option<String>, key: Option<&str>, problem: String| RoutesError {
            file: path.to_owned(),
            endpoint,
            key: key.map(str::to_owned),
            problem,
        };
        // The position and the parser's message, never its quote of the
        // line: the line may hold a URL's password or token.
        let top: Table = text.parse().map_err(|e: toml::de::Error| {
            let at = e.span().map_or_else(String::new, |span| {
                let before = text.get(..span.start).unwrap_or(text);
                let line = before.matches('\n').count() + 1;
                let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
                format!(" at line {line}, column {column}")
            });
            err(
                None,
                None,
                format!("not valid TOML{at}: {}", e.message().trim_end()),
            )
        })?;
        if let Some(k) = top.keys().find(|k| !TOP_KEYS.contains(&k.as_str())) {
            return Err(err(
                None,
                Some(k),
                format!("unknown key; the top level takes {}", TOP_KEYS.join(", ")),
            ));
        }
        let unrouted = match top.get("unrouted") {
            None => Unrouted::DeadLetter,
            Some(Value::String(s)) if s == "dead-letter" => Unrouted::DeadLetter,
            Some(Value::String(s)) if s == "skip" => Unrouted::Skip,
            Some(other) => {
                return Err(err(
                    None,
                    Some("unrouted"),
                    format!("{other} is not \"dead-letter\" or \"skip\""),
                ));
            }
        };
        let tables = match top.get("endpoint") {
            Some(Value::Array(a)) if !a.is_empty() => a,
            _ => {
                return Err(err(None, Some("endpoint"), "no [[endpoint]]: add at least one (name, url, event_types, secret_env or secret_file)".into()));
            }
        };
        let mut endpoints: Vec<EndpointSpec> = Vec::new();
        for (i, t) in tables.iter().enumerate() {
            let Value::Table(t) = t else {
                return Err(err(
                    None,
                    Some("endpoint"),
                    "must be an array of tables ([[endpoint]])".into(),
                ));
            };
            let spec =
                endpoint(t, i + 1).map_err(|(who, key, problem)| err(Some(who), key, problem))?;
            if endpoints.iter().any(|e| e.name == spec.name) {
                return Err(err(
                    Some(format!("endpoint {:?}", spec.name)),
                    Some("name"),
                    "used by an earlier endpoint: names must be unique".into(),
                ));
            }
            endpoints.push(spec);
        }
        Ok(RoutesFile {
            path: path.to_owned(),
            unrouted,
            endpoints,
        })
    }

    /// The endpoint named `name`.
    pub fn endpoint(&self, name: &str) -> Option<&EndpointSpec> {
        self.endpoints.iter().find(|e| e.name == name)
    }

    /// The message for a problem with `key` of endpoint `e`, found outside
    /// this module (e.g. a request timeout above the shutdown budget).
    pub fn key_error(&self, e: &EndpointSpec, key: &str, problem: String) -> String {
        self.error(e, key, problem).to_string()
    }

    /// The error for a problem with `key` of endpoint `e`.
    pub fn error(&self, e: &EndpointSpec, key: &str, problem: String) -> RoutesError {
        RoutesError {
            file: self.path.clone(),
            endpoint: Some(format!("endpoint {:?}", e.name)),
            key: Some(key.to_owned()),
            problem,
        }
    }

    /// The keys of endpoint `e`, read now (environment and files).
    pub fn keys(&self, e: &EndpointSpec) -> Result<EventKeys, RoutesError> {
        let read = |r: &SecretRef,
                    key: &str|
         -> Result<(Option<String>, Option<PathBuf>), RoutesError> {
            match r {
                SecretRef::Env(var) => match std::env::var(var) {
                    Ok(v) => Ok((Some(v), None)),
                    Err(_) => Err(self.error(e, key, format!("the environment variable {var} is not set (or not UTF-8): set it to the endpoint's secret"))),
                },
                SecretRef::File(p) => Ok((None, Some(p.clone()))),
            }
        };
        let (cur_v, cur_f) = read(&e.secret, secret_key(&e.secret, ""))?;
        let (prev_v, prev_f) = match &e.previous_secret {
            Some(r) => read(r, secret_key(r, "previous_"))?,
            None => (None, None),
        };
        EventKeys::load(
            Source {
                value: cur_v.as_deref(),
                file: cur_f.as_deref(),
            },
            Source {
                value: prev_v.as_deref(),
                file: prev_f.as_deref(),
            },
        )
        .map_err(|err| self.error(e, secret_key(&e.secret, ""), err.to_string()))
    }
}

fn secret_key(r: &SecretRef, prefix: &str) -> &'static str {
    match (r, prefix.is_empty()) {
        (SecretRef::Env(_), true) => "secret_env",
        (SecretRef::File(_), true) => "secret_file",
        (SecretRef::Env(_), false) => "previous_secret_env",
        (SecretRef::File(_), false) => "previous_secret_file",
    }
}

/// (who, key, problem): who is `endpoint "name"` or `endpoint #n`.
type EndpointError = (String, Option<&'static str>, String);

fn endpoint(t: &Table, n: usize) -> Result<EndpointSpec, EndpointError> {
    let mut who = format!("endpoint #{n}");
    let name = match t.get("name") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err((who, Some("name"), "must be a string".into())),
        None => {
            return Err((
                who,
                Some("name"),
                "missing: every endpoint needs a name ([a-z0-9_-], the metric label)".into(),
            ));
        }
    };
    if name.is_empty()
        || name.len() > NAME_MAX
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
    {
        return Err((
            who,
            Some("name"),
            format!("{name:?} is not 1 to {NAME_MAX} characters of a-z, 0-9, _ and -"),
        ));
    }
    who = format!("endpoint {name:?}");
    let e = |key: &'static str, problem: String| (who.clone(), Some(key), problem);
    for key in t.keys() {
        if key == "secret" || key == "event_secret" || key == "previous_secret" {
            return Err((
                who.clone(),
                None,
                format!(
                    "key `{key}`: a secret is never written in the routes file: name an environment variable (secret_env = \"VAR\") or a file (secret_file = \"/path\")"
                ),
            ));
        }
        if !ENDPOINT_KEYS.contains(&key.as_str()) {
            return Err((
                who.clone(),
                None,
                format!(
                    "key `{key}`: unknown; an endpoint takes {}",
                    ENDPOINT_KEYS.join(", ")
                ),
            ));
        }
    }
    let url = match t.get("url") {
        Some(Value::String(s)) => url::Url::parse(s).map_err(|err| {
            e(
                "url",
                format!("{:?} is not a URL: {err}", crate::redact::url(s)),
            )
        })?,
        Some(_) => return Err(e("url", "must be a string".into())),
        None => {
            return Err(e(
                "url",
                "missing: the inbox URL events are POSTed to".into(),
            ));
        }
    };
    crate::sink::service::check_url(&url).map_err(|why| e("url", why))?;
    let event_types = match t.get("event_types") {
        Some(Value::Array(a)) if !a.is_empty() => a
            .iter()
            .map(|v| match v {
                Value::String(s) if !s.is_empty() => Ok(Pattern::new(s)),
                _ => Err(e(
                    "event_types",
                    "every entry must be a non-empty string (an exact name or a glob with *)"
                        .into(),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => {
            return Err(e(
                "event_types",
                "must be a non-empty array of strings, e.g. [\"OrderCreated\", \"Invoice*\"]"
                    .into(),
            ));
        }
        None => {
            return Err(e(
                "event_types",
                "missing: the event types this endpoint takes (exact names, * globs)".into(),
            ));
        }
    };
    let secret = secret_ref(t, "secret_env", "secret_file").map_err(|(k, p)| e(k, p))?.ok_or_else(|| {
        e("secret_env", "missing: name the environment variable (secret_env = \"VAR\") or the file (secret_file = \"/path\") holding the endpoint's secret".into())
    })?;
    let previous_secret =
        secret_ref(t, "previous_secret_env", "previous_secret_file").map_err(|(k, p)| e(k, p))?;
    let max_in_flight = int(t, "max_in_flight", 1, 4096)
        .map_err(|(k, p)| e(k, p))?
        .map(|v| v as usize);
    let batch_max_events = int(t, "batch_max_events", 1, 1000)
        .map_err(|(k, p)| e(k, p))?
        .map(|v| v as usize);
    let batch_max_bytes = int(t, "batch_max_bytes", 1024, 16 << 20)
        .map_err(|(k, p)| e(k, p))?
        .map(|v| v as usize);
    let failure_threshold = int(t, "failure_threshold", 1, 1000)
        .map_err(|(k, p)| e(k, p))?
        .map(|v| v as u32);
    let request_timeout =
        duration(t, "request_timeout", Duration::from_millis(1)).map_err(|(k, p)| e(k, p))?;
    let backoff_base =
        duration(t, "backoff_base", Duration::from_millis(1)).map_err(|(k, p)| e(k, p))?;
    let backoff_cap =
        duration(t, "backoff_cap", Duration::from_millis(1)).map_err(|(k, p)| e(k, p))?;
    let probe_interval =
        duration(t, "probe_interval", Duration::from_millis(50)).map_err(|(k, p)| e(k, p))?;
    let max_lag = duration(t, "max_lag", Duration::from_secs(1)).map_err(|(k, p)| e(k, p))?;
    let rate = match t.get("rate") {
        None => None,
        Some(v) => match v.as_float().or_else(|| v.as_integer().map(|i| i as f64)) {
            Some(r) if crate::pace::valid_rate(r) => Some(r),
            _ => {
                return Err(e(
                    "rate",
                    format!(
                        "{v} is not a number of requests per second from {} to {}, e.g. 200 or 2.5",
                        crate::pace::MIN_RATE,
                        crate::pace::MAX_RATE
                    ),
                ));
            }
        },
    };
    let auto_resume = match t.get("resume") {
        None => true,
        Some(Value::String(s)) if s == "auto" => true,
        Some(Value::String(s)) if s == "manual" => false,
        Some(v) => {
            return Err(e(
                "resume",
                format!(
                    "{v} is not \"auto\" (the relay replays a parked endpoint's rows and returns it to live) or \"manual\" (it stays parked until they are replayed with the relay stopped)"
                ),
            ));
        }
    };
    let poison_statuses = match t.get("poison_statuses") {
        None => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|v| {
                    v.as_integer()
                        .and_then(|i| u16::try_from(i).ok())
                        .ok_or_else(|| {
                            e(
                                "poison_statuses",
                                "must be an array of HTTP statuses, e.g. [400, 422]".into(),
                            )
                        })
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(_) => {
            return Err(e(
                "poison_statuses",
                "must be an array of HTTP statuses, e.g. [400, 422]".into(),
            ));
        }
    };
    Ok(EndpointSpec {
        name,
        url,
        event_types,
        secret,
        previous_secret,
        max_in_flight,
        batch_max_events,
        batch_max_bytes,
        request_timeout,
        backoff_base,
        backoff_cap,
        failure_threshold,
        probe_interval,
        poison_statuses,
        max_lag,
        rate,
        auto_resume,
    })
}

type KeyError = (&'static str, String);

fn secret_ref(
    t: &Table,
    env: &'static str,
    file: &'static str,
) -> Result<Option<SecretRef>, KeyError> {
    match (t.get(env), t.get(file)) {
        (Some(_), Some(_)) => Err((file, format!("give {env} or {file}, not both"))),
        (Some(Value::String(v)), None) if !v.is_empty() => Ok(Some(SecretRef::Env(v.clone()))),
        (Some(_), None) => Err((env, "must be the name of an environment variable".into())),
        (None, Some(Value::String(p))) if !p.is_empty() => {
            Ok(Some(SecretRef::File(PathBuf::from(p))))
        }
        (None, Some(_)) => Err((file, "must be a file path".into())),
        (None, None) => Ok(None),
    }
}

fn int(t: &Table, key: &'static str, min: i64, max: i64) -> Result<Option<i64>, KeyError> {
    match t.get(key) {
        None => Ok(None),
        Some(Value::Integer(i)) if (min..=max).contains(i) => Ok(Some(*i)),
        Some(v) => Err((key, format!("{v} is not an integer from {min} to {max}"))),
    }
}

fn duration(t: &Table, key: &'static str, min: Duration) -> Result<Option<Duration>, KeyError> {
    match t.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => match crate::clock::parse_setting(s) {
            Ok(d) if d >= min => Ok(Some(d)),
            Ok(_) => Err((key, format!("{s:?} is below the minimum {min:?}"))),
            Err(err) => Err((key, err)),
        },
        Some(v) => Err((
            key,
            format!("{v} is not a duration: write a string such as \"4s\" or \"500ms\""),
        )),
    }
}

#[cfg(test)]
pub(crate) mod tests;
