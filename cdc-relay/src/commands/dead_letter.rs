//! `cdc-relay dead-letter list|show|replay|discard`: inspect and resolve
//! dead-lettered events.

use anyhow::Context;
use tokio_postgres::Client;

use super::{connect, outln};
use crate::cli::{DeadLetterCommand, GlobalArgs, ReplayArgs};
use crate::deadletter::{self, Removal};
use crate::outbox::OutboxEvent;
use crate::sink::{Attempt, Sink};

/// Runs one `dead-letter` subcommand.
pub async fn command(g: &GlobalArgs, c: DeadLetterCommand) -> anyhow::Result<()> {
    let mut client = connect(g).await?;
    match c {
        DeadLetterCommand::List { json } => list(&client, json).await?,
        DeadLetterCommand::Show { id } => {
            let row = deadletter::get(&client, id)
                .await?
                .with_context(|| format!("no dead-letter row {id}"))?;
            outln!("{}", serde_json::to_string_pretty(&row)?);
        }
        DeadLetterCommand::Replay(a) => replay(&mut client, *a).await?,
        DeadLetterCommand::Discard { id, reason } => {
            anyhow::ensure!(
                deadletter::remove(&mut client, id, Removal::Discard, reason.as_deref()).await?,
                "no dead-letter row {id}"
            );
            outln!("discarded dead-letter row {id} (kept in cdc_relay_dead_letter_audit)");
        }
    }
    Ok(())
}

async fn list(client: &Client, json: bool) -> anyhow::Result<()> {
    let rows = deadletter::list(client).await?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    outln!(
        "{:>6}  {:<36}  {:<16}  {:>6}  {:>8}  error",
        "id",
        "event_id",
        "type",
        "status",
        "attempts"
    );
    for r in &rows {
        outln!(
            "{:>6}  {:<36}  {:<16}  {:>6}  {:>8}  {}",
            r.id,
            r.event_id.as_deref().unwrap_or("(none)"),
            r.event_type.as_deref().unwrap_or("(none)"),
            r.http_status.map_or("-".into(), |s| s.to_string()),
            r.attempts,
            r.error.chars().take(80).collect::<String>()
        );
    }
    outln!("{} dead-lettered event(s)", rows.len());
    Ok(())
}

/// Re-sends rows once each; a row is removed (with an audit entry) only
/// after a 2xx.
async fn replay(client: &mut Client, a: ReplayArgs) -> anyhow::Result<()> {
    let sink = a.sink.build().map_err(anyhow::Error::msg)?;
    let ids: Vec<i64> = match a.id {
        Some(id) => vec![id],
        None => deadletter::list(client)
            .await?
            .iter()
            .map(|r| r.id)
            .collect(),
    };
    let mut failed = 0;
    for id in ids {
        let row = deadletter::get(client, id)
            .await?
            .with_context(|| format!("no dead-letter row {id}"))?;
        let (Some(event_id), Some(event_type)) = (row.event_id.clone(), row.event_type.clone())
        else {
            outln!(
                "row {id}: no event id or type; cannot be sent (discard it after fixing the source row)"
            );
            failed += 1;
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
        let request = sink.prepare(&event);
        match sink.post(&event.id, &request).await {
            Attempt::Response { status, .. } if (200..300).contains(&status) => {
                deadletter::remove(client, id, Removal::Replay, None).await?;
                outln!("row {id}: delivered ({status}); removed");
            }
            other => {
                outln!("row {id}: not delivered ({}); kept", other.detail());
                failed += 1;
            }
        }
    }
    anyhow::ensure!(failed == 0, "{failed} row(s) not replayed");
    Ok(())
}
