//! `cdc-relay dead-letter list|show|replay|discard`: inspect and resolve
//! dead-lettered events.

use std::collections::HashSet;
use std::io::{BufRead, IsTerminal, Write};
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tokio_postgres::Client;

use super::{ConfigError, connect, outln};
use crate::cli::{DeadLetterCommand, GlobalArgs, ReplayArgs};
use crate::deadletter::{self, DeadLetter, Removal};
use crate::outbox::OutboxEvent;
use crate::sink::{Attempt, Sink};

/// Runs one `dead-letter` subcommand.
pub async fn command(g: &GlobalArgs, c: DeadLetterCommand) -> anyhow::Result<()> {
    let mut client = connect(g).await?;
    match c {
        DeadLetterCommand::List {
            json,
            filter,
            limit,
        } => list(&client, json, &checked(&client, &filter).await?, limit).await?,
        DeadLetterCommand::Show { id } => {
            let row = deadletter::get(&client, id)
                .await?
                .with_context(|| format!("no dead-letter row {id}"))?;
            outln!("{}", serde_json::to_string_pretty(&shown(row))?);
        }
        DeadLetterCommand::Replay(a) => replay(&mut client, *a).await?,
        DeadLetterCommand::Discard {
            ids,
            all,
            filter,
            dry_run,
            reason,
            actor,
            yes,
        } => {
            let selection = Selection::new(ids, all, checked(&client, &filter).await?)?;
            let rows = selection.rows(&client).await?;
            let how = Discard {
                reason: &reason,
                actor: actor.as_deref(),
                yes,
                dry_run,
            };
            discard(&mut client, rows, &how).await?
        }
    }
    Ok(())
}

/// The filter of `args`, its `--since`/`--until` checked to be instants
/// (exit 2 otherwise, as for `backfill`).
async fn checked(
    client: &Client,
    args: &crate::cli::DeadLetterFilterArgs,
) -> anyhow::Result<deadletter::Filter> {
    let filter = args.filter();
    for (flag, value) in [("--since", &filter.since), ("--until", &filter.until)] {
        if let Some(v) = value {
            crate::backfill::check_instant(client, flag, v)
                .await
                .map_err(|e| match e {
                    crate::backfill::BoundError::Bad(m) => anyhow::Error::new(ConfigError(m)),
                    other => other.into(),
                })?;
        }
    }
    Ok(filter)
}

/// The rows a `replay` or `discard` works on: ids given, or a filter with
/// `--all`, or a filter alone.
enum Selection {
    Ids(Vec<i64>),
    Filtered(deadletter::Filter),
}

impl Selection {
    fn new(ids: Vec<i64>, all: bool, filter: deadletter::Filter) -> anyhow::Result<Self> {
        match (ids.is_empty(), all || !filter.is_empty()) {
            (false, false) => Ok(Self::Ids(ids)),
            (true, true) => Ok(Self::Filtered(filter)),
            (false, true) => Err(ConfigError(
                "give row ids or filters (--all, --type, ...), not both".into(),
            )
            .into()),
            (true, false) => Err(ConfigError(
                "which rows? give row ids, a filter (--type, --error-contains, --since, --until, --aggregate, --endpoint), or --all for every row"
                    .into(),
            )
            .into()),
        }
    }

    /// The rows, oldest first, with their payloads.
    async fn rows(&self, client: &Client) -> anyhow::Result<Vec<DeadLetter>> {
        let ids: Vec<i64> = match self {
            Self::Ids(ids) => ids.clone(),
            Self::Filtered(f) => deadletter::list(client, f, None)
                .await?
                .iter()
                .map(|r| r.id)
                .collect(),
        };
        let mut rows = Vec::with_capacity(ids.len());
        for id in ids {
            rows.push(
                deadletter::get(client, id)
                    .await?
                    .with_context(|| format!("no dead-letter row {id}; nothing was changed"))?,
            );
        }
        Ok(rows)
    }
}

/// `show`'s JSON: the row, its payload as a JSON value when it is JSON
/// (else as the stored text).
fn shown(row: DeadLetter) -> serde_json::Value {
    let payload = row.payload.as_deref().map(|p| {
        serde_json::from_str::<serde_json::Value>(p)
            .unwrap_or_else(|_| serde_json::Value::String(p.to_owned()))
    });
    let mut v = serde_json::to_value(&row).unwrap_or_default();
    if let (Some(obj), Some(p)) = (v.as_object_mut(), payload) {
        obj.insert("payload".into(), p);
    }
    v
}

/// `3 s`, `4 min`, `2 h 5 min`, `3 d 4 h`: an age at a glance.
fn age(secs: i64) -> String {
    let s = secs.max(0);
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min", s / 60),
        3600..86_400 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {} h", s / 86_400, s % 86_400 / 3600),
    }
}

async fn list(
    client: &Client,
    json: bool,
    filter: &deadletter::Filter,
    limit: Option<i64>,
) -> anyhow::Result<()> {
    let rows = deadletter::list(client, filter, limit).await?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    outln!(
        "{:>6}  {:<36}  {:<16}  {:>6}  {:>8}  {:>10}  error",
        "id",
        "event_id",
        "type",
        "status",
        "attempts",
        "age"
    );
    for r in &rows {
        outln!(
            "{:>6}  {:<36}  {:<16}  {:>6}  {:>8}  {:>10}  {}",
            r.id,
            r.event_id.as_deref().unwrap_or("(none)"),
            r.event_type.as_deref().unwrap_or("(none)"),
            r.http_status.map_or("-".into(), |s| s.to_string()),
            r.attempts,
            age(r.age_secs),
            r.error.chars().take(80).collect::<String>()
        );
    }
    outln!("{} dead-lettered event(s)", rows.len());
    Ok(())
}

/// How `discard` goes about it.
struct Discard<'a> {
    /// Why (kept in the audit table).
    reason: &'a str,
    /// Who; the database role when `None`.
    actor: Option<&'a str>,
    /// No confirmation question.
    yes: bool,
    /// List the rows and remove nothing.
    dry_run: bool,
}

/// Removes `rows` without sending them, after a confirmation (unless
/// `yes`), recording the reason and actor in the audit table.
async fn discard(
    client: &mut Client,
    rows: Vec<DeadLetter>,
    how: &Discard<'_>,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        !how.reason.trim().is_empty(),
        "--reason is empty: say why the events are dropped (it is kept in the audit table)"
    );
    let describe = |r: &DeadLetter| {
        format!(
            "row {}: {} {} ({})",
            r.id,
            r.event_type.as_deref().unwrap_or("(no type)"),
            r.event_id.as_deref().unwrap_or("(no id)"),
            r.error.chars().take(80).collect::<String>()
        )
    };
    if how.dry_run {
        for r in &rows {
            outln!("would discard {}", describe(r));
        }
        outln!("discard (dry run): {} row(s); nothing removed", rows.len());
        return Ok(());
    }
    if rows.is_empty() {
        outln!("no dead-letter row matches; nothing discarded");
        return Ok(());
    }
    if !how.yes {
        anyhow::ensure!(
            std::io::stdin().is_terminal(),
            "discarding drops {} event(s) for good: confirm with --yes (stdin is not a terminal to ask on)",
            rows.len()
        );
        for r in &rows {
            eprintln!("  {}", describe(r));
        }
        eprint!(
            "discard these {} event(s) without sending them? [y/N] ",
            rows.len()
        );
        std::io::stderr().flush()?;
        let mut answer = String::new();
        std::io::stdin().lock().read_line(&mut answer)?;
        anyhow::ensure!(
            matches!(answer.trim(), "y" | "Y" | "yes"),
            "not confirmed; nothing was discarded"
        );
    }
    for r in &rows {
        anyhow::ensure!(
            deadletter::remove(client, r.id, Removal::Discard, Some(how.reason), how.actor).await?,
            "dead-letter row {} was removed meanwhile",
            r.id
        );
        outln!(
            "discarded dead-letter row {} (kept in cdc_relay_dead_letter_audit)",
            r.id
        );
    }
    Ok(())
}

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
fn replay_sink(a: &ReplayArgs) -> Result<crate::sink::HttpSink, String> {
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

/// Re-sends rows once each; a row is removed (with an audit entry) only
/// after a 2xx. Stops at the first answer that says the sink is failing.
async fn replay(client: &mut Client, a: ReplayArgs) -> anyhow::Result<()> {
    // A dry run sends nothing: it needs neither sink URL nor secret.
    let sink = if a.dry_run {
        None
    } else {
        Some(replay_sink(&a).map_err(super::ConfigError)?)
    };
    let endpoint = a.filter.endpoint.clone();
    let mut filter = checked(client, &a.filter).await?;
    if a.id.is_some() {
        // A row named by id is checked against --endpoint below instead.
        filter.endpoint = None;
    }
    let selection = Selection::new(a.id.into_iter().collect(), a.all, filter)?;
    let rows = selection.rows(client).await?;
    let mut pace = a.rate.map(|per_s| {
        let mut i = tokio::time::interval(Duration::from_secs_f64(1.0 / per_s));
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        i
    });
    let mut done: Vec<Replayed> = Vec::new();
    let mut stopped: Option<String> = None;
    // Aggregates with an event that was not delivered: their later events
    // wait, so an aggregate's events still arrive in order.
    let mut held: HashSet<String> = HashSet::new();
    for row in rows {
        let id = row.id;
        let mut record = |outcome, detail: String| {
            if !a.json {
                outln!("row {id}: {}", detail);
            }
            done.push(Replayed {
                id,
                event_id: row.event_id.clone(),
                outcome,
                detail,
            });
        };
        if let Some(why) = &stopped {
            record("not_attempted", format!("not attempted ({why})"));
            continue;
        }
        if let Some(name) = endpoint
            .as_ref()
            .filter(|n| row.endpoint.as_ref() != Some(*n))
        {
            record(
                "not_attempted",
                format!(
                    "not attempted: dead-lettered by endpoint {}, not {name}",
                    crate::shown(&row.endpoint)
                ),
            );
            continue;
        }
        if let Some(key) = row.aggregate_key.as_ref().filter(|k| held.contains(*k)) {
            record(
                "not_attempted",
                format!(
                    "not attempted: an earlier event of aggregate {key} was not delivered, and this one must not overtake it"
                ),
            );
            continue;
        }
        let (Some(event_id), Some(event_type)) = (row.event_id.clone(), row.event_type.clone())
        else {
            record(
                "unsendable",
                "no event id or type: cannot be sent (discard it after fixing the source row)"
                    .into(),
            );
            continue;
        };
        let Some(sink) = &sink else {
            record(
                "would_send",
                format!("would send {event_type} {event_id} (dry run)"),
            );
            continue;
        };
        let event = OutboxEvent {
            id: event_id,
            event_type,
            payload: row.payload.clone().map(bytes::Bytes::from),
            aggregate_key: row.aggregate_key.clone(),
            commit_lsn: row.commit_lsn.as_deref().and_then(|l| l.parse().ok()),
            commit_time_micros: 0,
        };
        if let Some(pace) = pace.as_mut() {
            pace.tick().await;
        }
        let request = sink.prepare(&event);
        let attempt = sink.post(&event.id, &request).await;
        match &attempt {
            Attempt::Response { status, .. } if (200..300).contains(status) => {
                deadletter::remove(client, id, Removal::Replay, None, a.actor.as_deref()).await?;
                record("delivered", format!("delivered ({status}); removed"));
            }
            other => {
                let detail = other.detail();
                let failing = sink_failing(other);
                if failing {
                    stopped = Some(format!("the sink is failing: {detail}"));
                }
                if let Some(key) = &row.aggregate_key {
                    held.insert(key.clone());
                }
                // The sink failing is no verdict on this event; a 4xx about
                // it is.
                let outcome = if failing { "sink_failing" } else { "rejected" };
                record(outcome, format!("not delivered ({detail}); kept"));
            }
        }
    }
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
    fn ages_read_at_a_glance() {
        assert_eq!(age(-1), "0 s");
        assert_eq!(age(59), "59 s");
        assert_eq!(age(61), "1 min");
        assert_eq!(age(7_500), "2 h 5 min");
        assert_eq!(age(3 * 86_400 + 4 * 3600 + 5), "3 d 4 h");
    }

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
