//! `cdc-relay dead-letter replay`: re-sends dead letters, concurrently
//! across aggregates and one at a time within an aggregate.
//!
//! ```text
//!  pages of rows ──▶ queue ──▶ (aggregate free?) ──▶ up to --max-in-flight
//!  (id order,         │            │ no: waits behind     requests, paced by
//!   with payloads)    │            ▼ its aggregate's      --rate
//!                     │       waiting[aggregate]                │
//!                     │            ▲                            ▼
//!                     └── ready ◀──┴── 2xx: the next row   answer ──▶ batch of
//!                                      of that aggregate           removals
//!                                      other: aggregate held       (+ audit)
//! ```
//!
//! The rules, the same the serial replay kept:
//! - rows are taken oldest first (by id);
//! - an aggregate has at most one request in flight, and its next row is
//!   sent only after the previous one was delivered;
//! - a row not delivered holds its aggregate: the aggregate's later rows are
//!   not attempted (they must not overtake it), other aggregates go on;
//! - an answer that says the sink itself is failing stops the replay: no
//!   further request is started (those in flight finish and are recorded);
//! - a row is removed, with its audit row, only after a 2xx.
//!
//! What is new is how much runs at once. The first request goes alone; once
//! the sink has answered with anything but a failure of its own, up to
//! `--max-in-flight` requests are in flight, so a sink that is down still
//! gets one request. Rows are read a page per round trip
//! ([`deadletter::page`]) and delivered rows are removed a batch per
//! statement ([`deadletter::remove_many`]: the deletes and their audit rows
//! together), written when [`BATCH`] rows wait, at the first 2xx
//! [`FLUSH_EVERY`] or more after the previous write, and at the end (also
//! after an error). A replay killed between a 2xx and its batch's statement
//! leaves those rows in the table, and a later replay sends them again: the
//! receiver sees the event id twice, which it must absorb anyway (the relay
//! delivers at least once).

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::task::JoinSet;
use tokio_postgres::Client;

use super::{ConfigError, Selection, checked};
use crate::cli::ReplayArgs;
use crate::commands::outln;
use crate::deadletter::{self, DeadLetter, Removal};
use crate::outbox::OutboxEvent;
use crate::sink::{Attempt, HttpSink, Sink};

/// Rows read per round trip.
const PAGE: i64 = 2000;

/// Delivered rows removed per statement, at most.
const BATCH: usize = 1000;

/// A 2xx this long after the previous removal write writes the batch,
/// however small (so a slow, `--rate`-capped replay removes as it goes).
const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// What `replay` did with one row.
#[derive(Debug, Serialize)]
struct Replayed {
    id: i64,
    event_id: Option<String>,
    /// delivered, rejected (a 4xx about the event), sink_failing (the
    /// sink itself failed: 5xx, 408, 429, 401/403/404/405, transport),
    /// unsendable, would_send (dry run), not_attempted.
    outcome: &'static str,
    /// The sink's answer or why it was not sent.
    detail: String,
}

/// A failure that says the sink (or how it is reached: the secret, the
/// URL) is failing, not this event: the next rows would get the same answer,
/// and sending them now only adds load. The same classes the relay retries
/// and its breaker counts; a 4xx about the event (400, 409, 422, ...) is
/// that row's alone.
fn sink_failing(a: &Attempt) -> bool {
    match a {
        Attempt::Response { status, .. } => {
            *status >= 500 || matches!(status, 401 | 403 | 404 | 405 | 408 | 415 | 429)
        }
        Attempt::Timeout | Attempt::Connect(_) | Attempt::Tls(_) | Attempt::Transport(_) => true,
    }
}

/// Where a replay sends: `--sink-url`, or with `--routes FILE` the
/// endpoint `--endpoint` names in it (its URL, secret and request timeout).
fn replay_sink(a: &ReplayArgs) -> Result<HttpSink, String> {
    let Some(path) = &a.routes.routes else {
        return a.sink.build();
    };
    let Some(name) = &a.filter.endpoint else {
        return Err(
            "--routes needs --endpoint NAME: the endpoint whose dead letters go back to it".into(),
        );
    };
    let file = crate::routes::RoutesFile::load(path).map_err(|e| e.to_string())?;
    let Some(e) = file.endpoint(name) else {
        return Err(format!(
            "routes file {}: no endpoint named {name:?} (--endpoint); it has {}",
            path.display(),
            file.endpoints
                .iter()
                .map(|e| e.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    };
    a.sink.endpoint_sink(&file, e, None)
}

/// The rows a replay works on, read as it goes.
enum Source {
    /// Rows already read (a row named by id); empty once taken.
    Read(Vec<DeadLetter>),
    /// A filter's rows after id `after`, a page at a time.
    Pages {
        filter: deadletter::Filter,
        after: i64,
        done: bool,
    },
}

impl Source {
    async fn new(client: &Client, selection: Selection) -> anyhow::Result<Self> {
        Ok(match selection {
            Selection::Filtered(filter) => Self::Pages {
                filter,
                after: 0,
                done: false,
            },
            ids @ Selection::Ids(_) => Self::Read(ids.rows(client).await?),
        })
    }

    /// The next rows, oldest first; empty when there are no more.
    async fn next(&mut self, client: &Client) -> anyhow::Result<Vec<DeadLetter>> {
        match self {
            Self::Read(rows) => Ok(std::mem::take(rows)),
            Self::Pages { done: true, .. } => Ok(Vec::new()),
            Self::Pages {
                filter,
                after,
                done,
            } => {
                let rows = deadletter::page(client, filter, *after, PAGE).await?;
                *done = rows.len() < usize::try_from(PAGE).unwrap_or(usize::MAX);
                if let Some(last) = rows.last() {
                    *after = last.id;
                }
                Ok(rows)
            }
        }
    }
}

/// What the replay decided for a row before sending anything.
enum Verdict {
    /// Recorded now (not sent): outcome and detail.
    Settled(&'static str, String),
    /// To be sent.
    Send(OutboxEvent),
}

/// One replay's state.
struct Replay<'a> {
    args: &'a ReplayArgs,
    client: &'a Client,
    sink: Option<HttpSink>,
    /// `--endpoint`: rows dead-lettered by another endpoint are not sent.
    endpoint: Option<String>,
    /// Rows read and not yet decided, oldest first.
    queue: VecDeque<DeadLetter>,
    /// Rows whose aggregate's previous row was just delivered.
    ready: VecDeque<DeadLetter>,
    /// Aggregates with a request in flight, and their rows read since,
    /// oldest first.
    busy: HashMap<String, VecDeque<DeadLetter>>,
    /// Aggregates with a row that was not delivered.
    held: HashSet<String>,
    flight: JoinSet<(DeadLetter, Attempt)>,
    /// Requests allowed in flight: 1 until the sink has answered.
    window: usize,
    pace: Option<crate::pace::Pacer>,
    /// Why nothing more is sent.
    stopped: Option<String>,
    /// Delivered rows not removed yet.
    removals: Vec<i64>,
    last_flush: Instant,
    done: Vec<Replayed>,
}

impl Replay<'_> {
    fn record(&mut self, row: &DeadLetter, outcome: &'static str, detail: String) {
        if !self.args.json {
            outln!("row {}: {}", row.id, detail);
        }
        self.done.push(Replayed {
            id: row.id,
            event_id: row.event_id.clone(),
            outcome,
            detail,
        });
    }

    /// The next row to consider: one released by its aggregate first, then
    /// the next one read. `None` when every row has been read.
    async fn next_row(&mut self, source: &mut Source) -> anyhow::Result<Option<DeadLetter>> {
        if let Some(row) = self.ready.pop_front() {
            return Ok(Some(row));
        }
        if self.queue.is_empty() {
            self.queue.extend(source.next(self.client).await?);
        }
        Ok(self.queue.pop_front())
    }

    fn verdict(&self, row: &DeadLetter) -> Verdict {
        if let Some(name) = self
            .endpoint
            .as_ref()
            .filter(|n| row.endpoint.as_ref() != Some(*n))
        {
            return Verdict::Settled(
                "not_attempted",
                format!(
                    "not attempted: dead-lettered by endpoint {}, not {name}",
                    crate::shown(&row.endpoint)
                ),
            );
        }
        let (Some(event_id), Some(event_type)) = (row.event_id.clone(), row.event_type.clone())
        else {
            return Verdict::Settled(
                "unsendable",
                "no event id or type: cannot be sent (discard it after fixing the source row)"
                    .into(),
            );
        };
        if row.payload.is_none() && row.payload_bytes_hex.is_some() {
            // Sent, its data would be null: a 2xx would then remove the
            // event's only copy.
            return Verdict::Settled(
                "unsendable",
                "its payload is not UTF-8 (kept in payload_bytes): it cannot be sent as JSON; fix the source row and backfill it, then discard this row"
                    .into(),
            );
        }
        if self.sink.is_none() {
            return Verdict::Settled(
                "would_send",
                format!("would send {event_type} {event_id} (dry run)"),
            );
        }
        Verdict::Send(OutboxEvent {
            id: event_id,
            event_type,
            payload: row.payload.clone().map(bytes::Bytes::from),
            aggregate_key: row.aggregate_key.clone(),
            commit_lsn: row.commit_lsn.as_deref().and_then(|l| l.parse().ok()),
            commit_time_micros: 0,
        })
    }

    /// Starts requests until the window is full, the rows run out or the
    /// replay stopped. Returns `false` when no row is left to consider.
    async fn start(&mut self, source: &mut Source) -> anyhow::Result<bool> {
        while self.flight.len() < self.window && self.stopped.is_none() {
            let Some(row) = self.next_row(source).await? else {
                return Ok(false);
            };
            if let Some(key) = &row.aggregate_key {
                if self.held.contains(key) {
                    let detail = format!(
                        "not attempted: an earlier event of aggregate {key} was not delivered, and this one must not overtake it"
                    );
                    self.record(&row, "not_attempted", detail);
                    continue;
                }
                if let Some(waiting) = self.busy.get_mut(key) {
                    waiting.push_back(row);
                    continue;
                }
            }
            let event = match self.verdict(&row) {
                Verdict::Settled(outcome, detail) => {
                    self.record(&row, outcome, detail);
                    continue;
                }
                Verdict::Send(event) => event,
            };
            if let Some(pace) = &self.pace {
                pace.wait().await;
            }
            if let Some(key) = &row.aggregate_key {
                self.busy.insert(key.clone(), VecDeque::new());
            }
            let sink = self.sink.clone().expect("a sink when not a dry run");
            self.flight.spawn(async move {
                let request = sink.prepare(&event);
                let attempt = sink.post(&event.id, &request).await;
                (row, attempt)
            });
        }
        Ok(true)
    }

    /// Records an answer and releases (or holds) the row's aggregate.
    async fn answered(&mut self, row: DeadLetter, attempt: Attempt) -> anyhow::Result<()> {
        let delivered =
            matches!(&attempt, Attempt::Response { status, .. } if (200..300).contains(status));
        let waiting = row
            .aggregate_key
            .as_ref()
            .and_then(|k| self.busy.remove(k))
            .unwrap_or_default();
        if delivered {
            let status = match &attempt {
                Attempt::Response { status, .. } => *status,
                _ => unreachable!("delivered is a response"),
            };
            self.window = self.args.max_in_flight as usize;
            self.ready.extend(waiting);
            self.removals.push(row.id);
            self.record(&row, "delivered", format!("delivered ({status}); removed"));
            if self.removals.len() >= BATCH || self.last_flush.elapsed() >= FLUSH_EVERY {
                self.flush().await?;
            }
            return Ok(());
        }
        let detail = attempt.detail();
        let failing = sink_failing(&attempt);
        if failing {
            self.stopped
                .get_or_insert_with(|| format!("the sink is failing: {detail}"));
        } else {
            self.window = self.args.max_in_flight as usize;
        }
        if let Some(key) = &row.aggregate_key {
            self.held.insert(key.clone());
        }
        // The sink failing is no verdict on this event; a 4xx about it is.
        let outcome = if failing { "sink_failing" } else { "rejected" };
        self.record(&row, outcome, format!("not delivered ({detail}); kept"));
        // Back in line: they are recorded as held (or stopped) in turn.
        self.ready.extend(waiting);
        Ok(())
    }

    /// Removes the delivered rows not removed yet, with their audit rows.
    async fn flush(&mut self) -> anyhow::Result<()> {
        if !self.removals.is_empty() {
            deadletter::remove_many(
                self.client,
                &self.removals,
                Removal::Replay,
                None,
                self.args.actor.as_deref(),
            )
            .await?;
            self.removals.clear();
        }
        self.last_flush = Instant::now();
        Ok(())
    }

    /// Records every row not sent once the replay stopped.
    async fn not_attempted(&mut self, source: &mut Source, why: &str) -> anyhow::Result<()> {
        let waiting: Vec<DeadLetter> = self.busy.drain().flat_map(|(_, w)| w).collect();
        self.ready.extend(waiting);
        while let Some(row) = self.next_row(source).await? {
            self.record(&row, "not_attempted", format!("not attempted ({why})"));
        }
        Ok(())
    }
}

/// Takes the replay lock of `endpoint`, or with none of every endpoint
/// with parked rows, as a relay resuming an endpoint holds it (on this
/// connection, until it closes): the two never send one aggregate's rows
/// at once. An error naming the endpoint when a relay holds one.
async fn lock_parked(client: &Client, endpoint: Option<&str>) -> anyhow::Result<()> {
    let names = match endpoint {
        Some(name) => vec![name.to_owned()],
        None => deadletter::parked_endpoints(client).await?,
    };
    for name in names {
        let free = crate::deadletter::DeadLetterStore::resume_lock(client, &name, true)
            .await
            .map_err(|e| anyhow::anyhow!("cannot take the replay lock of endpoint {name}: {e}"))?;
        anyhow::ensure!(
            free,
            "a relay is replaying endpoint {name}'s parked rows (resume = \"auto\"); replaying them here too would send an aggregate's rows in parallel: wait until `dead-letter list --endpoint {name} --reason parked` shows none, or stop the relay"
        );
    }
    Ok(())
}

/// Re-sends rows once each; a row is removed (with an audit entry) only
/// after a 2xx. See the module doc for the order and stop rules.
pub(super) async fn replay(client: &Client, a: ReplayArgs) -> anyhow::Result<()> {
    // A dry run sends nothing: it needs neither sink URL nor secret.
    let sink = if a.dry_run {
        None
    } else {
        Some(replay_sink(&a).map_err(ConfigError)?)
    };
    let endpoint = a.filter.endpoint.clone();
    if sink.is_some() {
        lock_parked(client, endpoint.as_deref()).await?;
    }
    let mut filter = checked(client, &a.filter).await?;
    if a.id.is_some() {
        // A row named by id is checked against --endpoint instead.
        filter.endpoint = None;
    }
    let selection = Selection::new(a.id.into_iter().collect(), a.all, filter)?;
    let mut source = Source::new(client, selection).await?;
    let pace = a.rate.map(crate::pace::Pacer::new);
    let mut r = Replay {
        args: &a,
        client,
        window: if sink.is_none() { usize::MAX } else { 1 },
        sink,
        endpoint,
        queue: VecDeque::new(),
        ready: VecDeque::new(),
        busy: HashMap::new(),
        held: HashSet::new(),
        flight: JoinSet::new(),
        pace,
        stopped: None,
        removals: Vec::new(),
        last_flush: Instant::now(),
        done: Vec::new(),
    };
    let outcome = run(&mut r, &mut source).await;
    // Whatever happened, rows already delivered are removed.
    let flushed = r.flush().await;
    outcome?;
    flushed?;
    report(&a, r.done, r.stopped)
}

async fn run(r: &mut Replay<'_>, source: &mut Source) -> anyhow::Result<()> {
    loop {
        let more = r.start(source).await?;
        let Some(joined) = r.flight.join_next().await else {
            if !more || r.stopped.is_some() {
                break;
            }
            continue;
        };
        let (row, attempt) = joined.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        r.answered(row, attempt).await?;
    }
    if let Some(why) = r.stopped.clone() {
        r.not_attempted(source, &why).await?;
    }
    Ok(())
}

/// Prints the outcome; an error when a row was kept (not a dry run).
fn report(a: &ReplayArgs, mut done: Vec<Replayed>, stopped: Option<String>) -> anyhow::Result<()> {
    done.sort_by_key(|r| r.id);
    let count = |o: &str| done.iter().filter(|r| r.outcome == o).count();
    let (delivered, kept) = (count("delivered"), done.len() - count("delivered"));
    if a.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "dry_run": a.dry_run,
                "delivered": delivered,
                "kept": kept,
                "stopped": stopped,
                "rows": done,
            }))?
        );
    } else {
        outln!(
            "replay{}: {} row(s): {delivered} delivered, {} rejected, {} not sent (sink failing), {} unsendable, {} not attempted{}",
            if a.dry_run { " (dry run)" } else { "" },
            done.len(),
            count("rejected"),
            count("sink_failing"),
            count("unsendable"),
            count("not_attempted"),
            stopped
                .as_deref()
                .map_or(String::new(), |w| format!("; stopped: {w}"))
        );
    }
    anyhow::ensure!(
        a.dry_run || kept == 0,
        "{kept} row(s) not replayed{}",
        stopped
            .as_deref()
            .map_or(String::new(), |w| format!(" (stopped: {w})"))
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_answers_about_the_sink_stop_a_replay() {
        let answer = |status| Attempt::Response {
            status,
            retry_after: None,
            excerpt: String::new(),
        };
        for failing in [500, 503, 599, 408, 429] {
            assert!(sink_failing(&answer(failing)), "{failing}");
        }
        for failing in [401, 403, 404, 405, 415] {
            assert!(
                sink_failing(&answer(failing)),
                "a configuration fault: {failing}"
            );
        }
        for event in [400, 409, 410, 413, 422] {
            assert!(!sink_failing(&answer(event)), "{event}");
        }
        assert!(sink_failing(&Attempt::Timeout));
        assert!(sink_failing(&Attempt::Connect("refused".into())));
    }
}
