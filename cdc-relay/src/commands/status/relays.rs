//! What the relays' admin endpoints say (`/readyz`, `/metrics`), asked by
//! `status`.

use serde::Serialize;

use super::{NOT_DELIVERING, Problem};
use crate::cli::StatusArgs;

/// What one relay's admin endpoint said.
#[derive(Debug, Serialize)]
pub struct RelayEndpoint {
    /// Base URL asked (`http://host:port`), as [`crate::redact::url`]
    /// shows it.
    pub url: String,
    /// `/readyz` answered 200.
    pub ready: bool,
    /// `/readyz`'s answer, or why it could not be read.
    pub detail: String,
    /// `cdc_relay_circuit_state` (0 closed, 1 open, 2 probing), when read.
    pub circuit_state: Option<f64>,
    /// Each endpoint's `cdc_relay_endpoint_circuit_state`, by endpoint name
    /// (the worst over a sharded relay's shards: open, then probing), when
    /// read. With a routes file these are the circuits; the relay-wide
    /// gauge belongs to the single `--sink-url` endpoint (`default`).
    pub endpoint_circuits: std::collections::BTreeMap<String, f64>,
    /// The endpoints whose `cdc_relay_endpoint_parked` is 1 (on any
    /// shard), by name: their events go to the dead-letter table.
    pub parked: Vec<String>,
    /// `cdc_relay_oldest_unconfirmed_event_age_seconds`, when read.
    pub oldest_unconfirmed_event_age_secs: Option<f64>,
    /// `cdc_relay_standby` is 1: a hot standby waiting for the slot another
    /// relay holds (not ready by design, not a problem while one streams).
    pub standby: bool,
}

/// Asks each admin endpoint (`--admin-url`, else the local one) into
/// `relays`, and adds what stops delivery to `problems`. `all_held`: every
/// slot is streamed by some relay, so one waiting as a standby is fine.
pub(super) async fn ask_relays(
    a: &StatusArgs,
    all_held: bool,
    relays: &mut Vec<RelayEndpoint>,
    problems: &mut Vec<Problem>,
) {
    let (urls, given) = if a.admin_url.is_empty() {
        let listen = std::env::var("CDC_RELAY_ADMIN_LISTEN")
            .ok()
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| "127.0.0.1:9187".into());
        (vec![format!("http://{listen}")], false)
    } else {
        (a.admin_url.clone(), true)
    };
    for url in urls {
        let url = url.trim_end_matches('/').to_owned();
        let e = ask_relay(&url).await;
        let answered = !e.detail.starts_with("no answer");
        // A hot standby is not ready by design; while another relay
        // streams from the slot it is what an HA pair should look like.
        let standing_by = e.standby && all_held;
        // The default (local) endpoint not answering is no problem of its
        // own: whether any relay streams is judged from the slot above.
        if !e.ready && !standing_by && (given || answered) {
            problems.push(Problem {
                code: NOT_DELIVERING,
                message: format!("relay at {}: {}", e.url, e.detail),
            });
        }
        relays.push(e);
    }
}

/// `GET {url}/readyz` and `/metrics`, 3 s each.
async fn ask_relay(url: &str) -> RelayEndpoint {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let get = |path: &str| {
        let uri = format!("{url}{path}");
        let client = client.clone();
        async move {
            let uri: http::Uri = uri.parse().map_err(|e| format!("bad URL: {e}"))?;
            let fetch = async {
                let resp = client.get(uri).await.map_err(|e| crate::error_chain(&e))?;
                let status = resp.status().as_u16();
                let body = http_body_util::BodyExt::collect(resp.into_body())
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                Ok::<_, String>((status, String::from_utf8_lossy(&body).into_owned()))
            };
            tokio::time::timeout(std::time::Duration::from_secs(3), fetch)
                .await
                .map_err(|_| "timed out after 3 s".to_owned())?
        }
    };
    let mut e = RelayEndpoint {
        url: crate::redact::url(url),
        ready: false,
        detail: String::new(),
        circuit_state: None,
        endpoint_circuits: std::collections::BTreeMap::new(),
        parked: Vec::new(),
        oldest_unconfirmed_event_age_secs: None,
        standby: false,
    };
    match get("/readyz").await {
        Ok((status, body)) => {
            e.ready = status == 200;
            e.detail = match body.trim() {
                "" if status != 200 => format!("/readyz answered {status} with no body"),
                text => text.to_owned(),
            };
        }
        Err(why) => {
            e.detail = format!("no answer ({why})");
            return e;
        }
    }
    if let Ok((200, text)) = get("/metrics").await {
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        };
        e.circuit_state = value("cdc_relay_circuit_state");
        e.endpoint_circuits = endpoint_circuits(&text);
        e.parked = endpoint_series(&text, "cdc_relay_endpoint_parked")
            .into_iter()
            .filter(|(_, parked)| *parked == 1.0)
            .map(|(name, _)| name)
            .collect();
        e.oldest_unconfirmed_event_age_secs =
            value("cdc_relay_oldest_unconfirmed_event_age_seconds");
        // A sharded relay labels each shard's series: a standby for every
        // shard it does not stream, and not ready when it streams none.
        e.standby = value("cdc_relay_standby") == Some(1.0)
            || (!e.ready && e.detail.contains("waiting for a free one"));
    }
    e
}

/// Each endpoint's circuit from `/metrics` text: the
/// `cdc_relay_endpoint_circuit_state{…endpoint="NAME"…} STATE` series, the
/// worst state per name (open 1, then probing 2, then closed 0).
pub(super) fn endpoint_circuits(metrics: &str) -> std::collections::BTreeMap<String, f64> {
    endpoint_series(metrics, "cdc_relay_endpoint_circuit_state")
}

/// The `metric{…endpoint="NAME"…} VALUE` series of `metrics` text, the
/// worst value per name (1, then 2, then any other: open, probing,
/// closed for a circuit; parked, then not for the parked gauge).
fn endpoint_series(metrics: &str, metric: &str) -> std::collections::BTreeMap<String, f64> {
    let rank = |state: f64| match state {
        1.0 => 2,
        2.0 => 1,
        _ => 0,
    };
    let mut out = std::collections::BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix(metric).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let Some(name) = labels
            .split_once("endpoint=\"")
            .and_then(|(_, r)| r.split_once('"'))
            .map(|(name, _)| name)
        else {
            continue;
        };
        let Ok(state) = value.trim().parse::<f64>() else {
            continue;
        };
        out.entry(name.to_owned())
            .and_modify(|s: &mut f64| {
                if rank(state) > rank(*s) {
                    *s = state;
                }
            })
            .or_insert(state);
    }
    out
}
