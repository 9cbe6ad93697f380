//! `cdc-relay dead-letter replay`: re-sends dead letters once each through
//! the relay's pipeline (`dispatch::replay`), and reports what became of
//! every row.
//!
//! The rules are the pipeline's, with [`Persist::OneAttempt`]:
//! - rows are taken oldest first (by id), several aggregates at once (up to
//!   `--max-in-flight`), one at a time within an aggregate, paced by
//!   `--rate`, through a circuit breaker whose slow start sends the first
//!   request alone until the sink answers;
//! - each row gets one attempt, judged by `sink::classify`: a 2xx removes
//!   it (with its audit row); poison keeps it, and its aggregate's later
//!   rows are not attempted (they must not overtake it); any other answer
//!   says the sink itself is failing and stops the replay: no further
//!   request starts (those in flight finish and are recorded).
//!
//! What this module adds is the command line: which rows (ids or a
//! filter), where to (`--sink-url`, or an endpoint of `--routes`), the rows
//! that cannot be sent (another endpoint's, no id or type, a payload that is
//! not UTF-8), the dry run, and the report.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use super::rows::{self, DeadLetter};
use super::{ConfigError, Selection, checked};
use crate::breaker::BreakerConfig;
use crate::cli::{GlobalArgs, ReplayArgs};
use crate::commands::outln;
use crate::dead_letter::{self, GroupedStore, Removal, StoreError};
use crate::dispatch::replay::{self, Rows};
use crate::dispatch::{DispatchConfig, Ended, Lane, Outcome, Persist, Pipeline};
use crate::health::Health;
use crate::metrics::Metrics;
use crate::outbox::OutboxEvent;
use crate::sink::{HttpSink, StatusPolicy};

/// What became of a row (the `outcome` of `--json`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum RowOutcome {
    /// A 2xx: removed.
    Delivered,
    /// Poison (the event itself refused): kept.
    Rejected,
    /// The sink itself failed (a retry or configuration class of
    /// `sink::classify`): kept, and the replay stopped.
    Failing,
    /// No id or type, or a payload that is not UTF-8: never sent.
    Unsendable,
    /// A dry run's row.
    WouldSend,
    /// Not sent: another endpoint's, behind a kept row of its aggregate,
    /// or after the replay stopped.
    NotAttempted,
}

/// What `replay` did with one row.
#[derive(Debug, Serialize)]
struct Replayed {
    id: i64,
    event_id: Option<String>,
    outcome: RowOutcome,
    /// The sink's answer or why it was not sent.
    detail: String,
}

/// Where a replay sends: `--sink-url`, or with `--routes FILE` the
/// endpoint `--endpoint` names in it (its URL, secret, request timeout,
/// poison statuses and breaker settings).
fn replay_lane(a: &ReplayArgs) -> Result<Lane<HttpSink>, String> {
    let base = DispatchConfig {
        max_in_flight: a.max_in_flight as usize,
        batch_max_events: a.batch_max_events.unwrap_or(1) as usize,
        batch_max_bytes: a.batch_max_bytes.unwrap_or(48 << 10) as usize,
        backoff_base: Duration::from_millis(50),
        backoff_cap: Duration::from_secs(1),
        retry_after_max: Duration::from_secs(60),
        policy: StatusPolicy::default(),
        breaker: BreakerConfig {
            failure_threshold: 5,
            probe_interval: Duration::from_millis(500),
            // Every row gets one attempt and a refused one is only kept:
            // rows refused in a row are each the operator's to see, not a
            // storm to hold back.
            storm_threshold: u32::MAX,
            retired_probe_interval: Duration::from_secs(60),
        },
        max_lag: None,
        rate: a.rate,
        auto_resume: false,
    };
    let metrics = Metrics::new();
    let Some(path) = &a.routes.routes else {
        return Ok(Lane::single(base, a.sink.build()?, &metrics));
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
    let endpoint =
        crate::settings::endpoint_config(&file, e, &base).map_err(|err| err.to_string())?;
    let cfg = DispatchConfig {
        max_in_flight: a.max_in_flight as usize,
        batch_max_events: a
            .batch_max_events
            .map_or(endpoint.batch_max_events, |n| n as usize),
        batch_max_bytes: a
            .batch_max_bytes
            .map_or(endpoint.batch_max_bytes, |n| n as usize),
        rate: a.rate,
        max_lag: None,
        auto_resume: false,
        ..endpoint
    };
    // Every row goes back, whatever the file routes its type to now.
    Ok(Lane::single(
        cfg,
        a.sink.endpoint_sink(&file, e, None)?,
        &metrics,
    ))
}

/// The rows a replay works on, read as it goes: a filter's a page at a
/// time, or the rows named by id. Rows that cannot be sent are recorded
/// here and never handed to the pipeline.
struct Source<'a> {
    client: &'a Client,
    args: &'a ReplayArgs,
    /// Rows already read (named by id); empty once taken.
    read: Vec<DeadLetter>,
    /// A filter's rows, a page at a time.
    pages: Option<rows::Pages<'a>>,
    /// `--endpoint`: rows dead-lettered by another endpoint are not sent.
    endpoint: Option<String>,
    /// Rows settled without sending.
    settled: Vec<Replayed>,
    /// Rows delivered that were gone when their removal ran (a discard,
    /// or another command, removed them meanwhile).
    gone: Vec<i64>,
}

impl Source<'_> {
    /// The next rows, oldest first; empty when there are no more.
    async fn next_rows(&mut self) -> Result<Vec<DeadLetter>, tokio_postgres::Error> {
        match &mut self.pages {
            Some(pages) => pages.next().await,
            None => Ok(std::mem::take(&mut self.read)),
        }
    }

    /// The event to send for `row`, or why it is not sent (recorded).
    fn verdict(&mut self, row: DeadLetter) -> Option<OutboxEvent> {
        let settled = |outcome, detail: String| Replayed {
            id: row.id,
            event_id: row.event_id.clone(),
            outcome,
            detail,
        };
        if let Some(name) = self
            .endpoint
            .as_ref()
            .filter(|n| row.endpoint.as_ref() != Some(*n))
        {
            let detail = format!(
                "not attempted: dead-lettered by endpoint {}, not {name}",
                crate::shown(&row.endpoint)
            );
            self.settle(settled(RowOutcome::NotAttempted, detail));
            return None;
        }
        // Without --routes the rows go to --sink-url: a row a routes
        // file's endpoint dead-lettered belongs to that endpoint's
        // receiver, unless the operator names the endpoint on purpose.
        if let (None, None, Some(owner)) = (&self.args.routes.routes, &self.endpoint, &row.endpoint)
        {
            let detail = format!(
                "not attempted: dead-lettered by endpoint {owner} of a routes file, whose receiver is not --sink-url's: replay it there (--routes FILE --endpoint {owner}), or name it (--endpoint {owner}) to send it to --sink-url"
            );
            self.settle(settled(RowOutcome::NotAttempted, detail));
            return None;
        }
        let (Some(event_id), Some(event_type)) = (row.event_id.clone(), row.event_type.clone())
        else {
            let detail =
                "no event id or type: cannot be sent (discard it after fixing the source row)";
            self.settle(settled(RowOutcome::Unsendable, detail.into()));
            return None;
        };
        if row.payload.is_none() && row.payload_bytes_hex.is_some() {
            // Sent, its data would be null: a 2xx would then remove the
            // event's only copy.
            let detail = "its payload is not UTF-8 (kept in payload_bytes): it cannot be sent as JSON; fix the source row and backfill it, then discard this row";
            self.settle(settled(RowOutcome::Unsendable, detail.into()));
            return None;
        }
        // The payload goes into the body as the event's JSON `data`, byte
        // for byte: text that is not JSON (a dead letter of an unreadable
        // row, kept as read) would make the whole body invalid.
        if let Some(Err(e)) = row
            .payload
            .as_deref()
            .map(serde_json::from_str::<serde::de::IgnoredAny>)
        {
            let detail = format!(
                "its payload is not JSON ({e}): it cannot be sent as the event's data; fix the source row and backfill it, then discard this row"
            );
            self.settle(settled(RowOutcome::Unsendable, detail));
            return None;
        }
        if self.args.dry_run {
            let detail = format!("would send {event_type} {event_id} (dry run)");
            self.settle(settled(RowOutcome::WouldSend, detail));
            return None;
        }
        Some(OutboxEvent {
            id: event_id,
            event_type,
            payload: row.payload.map(bytes::Bytes::from),
            aggregate_key: row.aggregate_key,
            commit_lsn: row.commit_lsn.as_deref().and_then(|l| l.parse().ok()),
            commit_time_micros: 0,
            dead_letter_id: Some(row.id),
            trace: row
                .trace_context
                .as_deref()
                .and_then(trace_context::stored::parse),
        })
    }

    fn settle(&mut self, r: Replayed) {
        print_row(self.args, &r);
        self.settled.push(r);
    }
}

impl Rows for Source<'_> {
    async fn next_page(&mut self) -> Result<Vec<OutboxEvent>, StoreError> {
        loop {
            let rows = match self.next_rows().await {
                Ok(rows) => rows,
                Err(e) => return Err(StoreError::of(self.client, &e).await),
            };
            if rows.is_empty() {
                return Ok(Vec::new());
            }
            let events: Vec<OutboxEvent> =
                rows.into_iter().filter_map(|r| self.verdict(r)).collect();
            if !events.is_empty() {
                return Ok(events);
            }
        }
    }

    async fn remove(&mut self, ids: &[i64]) -> Result<(), StoreError> {
        match dead_letter::remove_many(
            self.client,
            ids,
            Removal::Replay,
            None,
            self.args.actor.as_deref(),
        )
        .await
        {
            Ok(removed) => {
                self.gone
                    .extend(ids.iter().filter(|id| removed.binary_search(id).is_err()));
                Ok(())
            }
            Err(e) => Err(StoreError::of(self.client, &e).await),
        }
    }
}

fn print_row(a: &ReplayArgs, r: &Replayed) {
    if !a.json {
        outln!("row {}: {}", r.id, super::printable(&r.detail));
    }
}

/// The report line of one job's end.
fn ended(e: &Ended) -> Replayed {
    let (outcome, detail) = match &e.outcome {
        Outcome::Delivered(status) => (
            RowOutcome::Delivered,
            // Removed in batches after this line: the summary says so
            // once every removal has committed.
            format!("delivered ({status})"),
        ),
        Outcome::DeadLettered => (RowOutcome::Rejected, "refused again; kept".to_owned()),
        Outcome::Kept(detail) => (
            RowOutcome::Rejected,
            format!("refused ({detail}); kept, with this refusal recorded"),
        ),
        Outcome::Failing(detail) => (
            RowOutcome::Failing,
            format!("not delivered: the sink is failing ({detail}); kept, and the replay stops"),
        ),
        Outcome::NotAttempted => (
            RowOutcome::NotAttempted,
            format!(
                "not attempted: an earlier event of aggregate {} was not delivered, and this one must not overtake it",
                crate::shown(&e.event.aggregate_key)
            ),
        ),
    };
    Replayed {
        id: e.event.dead_letter_id.unwrap_or_default(),
        event_id: Some(e.event.id.clone()),
        outcome,
        detail,
    }
}

/// Takes the replay lock of `endpoint`, or with none of every endpoint
/// with parked rows, as a relay resuming an endpoint holds it (on this
/// connection, until it closes): the two never send one aggregate's rows
/// at once. An error naming the endpoint when a relay holds one.
async fn lock_parked(client: &Client, endpoint: Option<&str>) -> anyhow::Result<()> {
    let names = match endpoint {
        Some(name) => vec![name.to_owned()],
        None => dead_letter::parked_endpoints(client).await?,
    };
    for name in names {
        let free = dead_letter::resume_lock(client, &name, true)
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
pub(super) async fn replay(g: &GlobalArgs, a: ReplayArgs) -> anyhow::Result<()> {
    // A dry run sends nothing: it needs neither sink URL nor secret.
    let lane = if a.dry_run {
        None
    } else {
        Some(replay_lane(&a).map_err(ConfigError)?)
    };
    let client = Arc::new(super::super::connect(g).await?);
    let export = match &lane {
        Some(_) => crate::commands::start_export(&a.trace, &Metrics::new())?,
        None => None,
    };
    let lane = lane.map(|l| l.traced(export.as_ref().map(|e| e.tracer().clone())));
    let endpoint = a.filter.endpoint.clone();
    if lane.is_some() {
        let free = dead_letter::manual_replay_lock(&client)
            .await
            .map_err(|e| anyhow::anyhow!("cannot take the replay lock: {e}"))?;
        anyhow::ensure!(
            free,
            "another `cdc-relay dead-letter replay` runs against this database (or a `dead-letter discard` is committing); two replays at once would send the same rows twice and out of order: wait for it to finish, then run this one again"
        );
        lock_parked(&client, endpoint.as_deref()).await?;
    }
    let mut filter = checked(&client, &a.filter).await?;
    if !a.ids.is_empty() {
        // A row named by id is checked against --endpoint instead.
        filter.endpoint = None;
    }
    // Oldest first: an aggregate's rows in the order they were written.
    let mut ids = a.ids.clone();
    ids.sort_unstable();
    let selection = Selection::new(ids, a.all, filter)?;
    let mut source = Source {
        client: &client,
        args: &a,
        read: Vec::new(),
        pages: None,
        endpoint,
        settled: Vec::new(),
        gone: Vec::new(),
    };
    match selection {
        Selection::Filtered(f) => {
            source.pages = Some(rows::Pages::new(&client, f, rows::Payloads::With, None));
        }
        ids @ Selection::Ids(_) => source.read = ids.rows(&client).await?,
    }
    let mut done: Vec<Replayed> = Vec::new();
    let mut stopped = None;
    if let Some(lane) = lane {
        // One attempt writes no dead letter (a refused row is kept as it
        // is); the store is the pipeline's all the same.
        let pipeline = Pipeline {
            persist: Persist::OneAttempt,
            ..Pipeline::new(
                Arc::new(GroupedStore::new(Arc::clone(&client))),
                Metrics::new(),
                Health::new(Duration::from_secs(60)),
                CancellationToken::new(),
            )
        };
        let out = replay::replay(lane, pipeline, &mut source, usize::MAX, |e| {
            let r = ended(e);
            if let Outcome::Failing(detail) = &e.outcome {
                stopped.get_or_insert_with(|| format!("the sink is failing: {detail}"));
            }
            print_row(&a, &r);
            done.push(r);
        })
        .await?;
        if let Some(export) = export {
            export.shutdown(crate::commands::EXPORT_FLUSH).await;
        }
        let why = stopped
            .clone()
            .unwrap_or_else(|| "the replay stopped".into());
        let not_sent = |(id, event_id): (i64, String)| Replayed {
            id,
            event_id: Some(event_id),
            outcome: RowOutcome::NotAttempted,
            detail: format!("not attempted ({why})"),
        };
        done.extend(out.unended.into_iter().map(not_sent));
        // Rows not read yet are not attempted either.
        while stopped.is_some() {
            let rows = source.next_rows().await?;
            if rows.is_empty() {
                break;
            }
            done.extend(
                rows.into_iter()
                    .map(|r| not_sent((r.id, r.event_id.unwrap_or_default()))),
            );
        }
    } else {
        while !source.next_page().await?.is_empty() {}
    }
    done.append(&mut source.settled);
    report(&a, done, &source.gone, stopped)
}

/// Prints the outcome; an error when a row was kept (not a dry run).
/// `gone`: rows delivered that another command had removed meanwhile.
fn report(
    a: &ReplayArgs,
    mut done: Vec<Replayed>,
    gone: &[i64],
    stopped: Option<String>,
) -> anyhow::Result<()> {
    done.sort_by_key(|r| r.id);
    let count = |o: RowOutcome| done.iter().filter(|r| r.outcome == o).count();
    let (delivered, kept) = (
        count(RowOutcome::Delivered),
        done.len() - count(RowOutcome::Delivered),
    );
    if a.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "dry_run": a.dry_run,
                "delivered": delivered,
                "already_removed": gone,
                "kept": kept,
                "stopped": stopped,
                "rows": done,
            }))?
        );
    } else {
        let removed = if gone.is_empty() {
            "and removed".to_owned()
        } else {
            let shown: Vec<String> = gone.iter().take(10).map(i64::to_string).collect();
            format!(
                "and removed ({} of them already removed meanwhile, by another command or statement: {}{})",
                gone.len(),
                shown.join(", "),
                if gone.len() > shown.len() {
                    ", …"
                } else {
                    ""
                }
            )
        };
        outln!(
            "replay{}: {} row(s): {delivered} delivered {removed}, {} rejected, {} not sent (sink failing), {} unsendable, {} not attempted{}",
            if a.dry_run { " (dry run)" } else { "" },
            done.len(),
            count(RowOutcome::Rejected),
            count(RowOutcome::Failing),
            count(RowOutcome::Unsendable),
            count(RowOutcome::NotAttempted),
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
