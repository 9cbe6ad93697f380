//! The dead-letter table: where poison events go instead of being dropped.
//!
//! A poison event (the sink refused the event itself: 400, 413, 415, 422 by
//! default) or an unreadable outbox row (NULL id or type, bad text) becomes a
//! row in `cdc_relay_dead_letter` (see `sql/orders.sql`) in the source
//! database. The event counts as done only after that row is committed; if
//! the write fails, the event stays pending and the write is retried.
//!
//! This module is the only place a dead-letter row is built
//! ([`NewDeadLetter::rejected`], [`NewDeadLetter::unreadable`]); the
//! pipeline writes it through the [`DeadLetterStore`] trait.
//!
//! Operators list, show, replay and discard rows with `cdc-relay dead-letter`;
//! replays and discards leave a row in `cdc_relay_dead_letter_audit`.

use std::future::Future;

use serde::Serialize;
use tokio_postgres::Client;

use crate::lsn::Lsn;
use crate::outbox::{OutboxEvent, UnreadableRow};
use crate::sink::{Attempt, Reason};

/// Where the pipeline writes dead letters (the side SQL connection in
/// production, memory in unit tests).
pub trait DeadLetterStore: Send + Sync + 'static {
    /// Inserts `row` and returns its id once it is committed.
    fn insert(&self, row: &NewDeadLetter) -> impl Future<Output = Result<i64, StoreError>> + Send;
}

/// A dead-letter write failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store is gone (the connection closed): the session must end.
    #[error("dead-letter store lost: {0}")]
    Lost(String),
    /// This write failed; retrying may help.
    #[error("dead-letter write failed: {0}")]
    Failed(String),
}

impl DeadLetterStore for Client {
    async fn insert(&self, row: &NewDeadLetter) -> Result<i64, StoreError> {
        insert(self, row).await.map_err(|e| {
            let text = crate::db_message(&e);
            if self.is_closed() {
                StoreError::Lost(text)
            } else {
                StoreError::Failed(text)
            }
        })
    }
}

/// One dead-lettered event, as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewDeadLetter {
    /// Event id (`None` when the row had no readable id).
    pub event_id: Option<String>,
    /// Aggregate key, if any.
    pub aggregate_key: Option<String>,
    /// Event type, if readable.
    pub event_type: Option<String>,
    /// Payload JSON text, if any.
    pub payload: Option<String>,
    /// Commit LSN of the event's transaction; `None` for a row a backfill
    /// read from the table.
    pub commit_lsn: Option<Lsn>,
    /// HTTP status of the last response, if one arrived.
    pub http_status: Option<u16>,
    /// Why it was dead-lettered (reason label and detail).
    pub error: String,
    /// First bytes of the last response body.
    pub response_excerpt: Option<String>,
    /// Delivery attempts made.
    pub attempts: u32,
    /// When the first attempt was made, microseconds since the Unix epoch.
    pub first_attempt_unix_micros: Option<i64>,
}

impl NewDeadLetter {
    /// The row for an event the sink refused (`attempt` classified as
    /// poison for `reason`) after `attempts` attempts, the first at
    /// `first_attempt_unix_micros`.
    pub fn rejected(
        event: &OutboxEvent,
        attempt: &Attempt,
        reason: &Reason,
        attempts: u32,
        first_attempt_unix_micros: i64,
    ) -> Self {
        let (status, excerpt) = match attempt {
            Attempt::Response {
                status, excerpt, ..
            } => (Some(*status), Some(excerpt.clone())),
            _ => (None, None),
        };
        NewDeadLetter {
            event_id: Some(event.id.clone()),
            aggregate_key: event.aggregate_key.clone(),
            event_type: Some(event.event_type.clone()),
            payload: event
                .payload
                .as_ref()
                .map(|p| String::from_utf8_lossy(p).into_owned()),
            commit_lsn: event.commit_lsn,
            http_status: status,
            error: format!("{}: {}", reason.label, attempt.detail()),
            response_excerpt: excerpt,
            attempts,
            first_attempt_unix_micros: Some(first_attempt_unix_micros),
        }
    }

    /// The row for an outbox row that cannot become an event; never sent.
    pub fn unreadable(row: &UnreadableRow) -> Self {
        NewDeadLetter {
            event_id: row.event_id.clone(),
            aggregate_key: row.aggregate_key.clone(),
            event_type: row.event_type.clone(),
            payload: row.payload.clone(),
            commit_lsn: row.commit_lsn,
            http_status: None,
            error: format!("unreadable outbox row: {}", row.problem),
            response_excerpt: None,
            attempts: 0,
            first_attempt_unix_micros: None,
        }
    }
}

/// A row of the dead-letter table, as listed.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct DeadLetter {
    /// Row id (what `show`, `replay` and `discard` take).
    pub id: i64,
    /// Event id.
    pub event_id: Option<String>,
    /// Aggregate key.
    pub aggregate_key: Option<String>,
    /// Event type.
    pub event_type: Option<String>,
    /// Payload JSON text (only in `show`; `list` leaves it out).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<String>,
    /// Commit LSN (PostgreSQL text form); none for a backfilled row.
    pub commit_lsn: Option<String>,
    /// HTTP status of the last response.
    pub http_status: Option<i32>,
    /// Why it was dead-lettered.
    pub error: String,
    /// First bytes of the last response body.
    pub response_excerpt: Option<String>,
    /// Delivery attempts.
    pub attempts: i32,
    /// When it was written (RFC 3339, UTC; the table's `quarantined_at`).
    #[serde(rename = "quarantined_at")]
    pub dead_lettered_at: String,
}

/// Inserts a dead-letter row; returns its id. One statement, so the row is
/// committed when this returns `Ok`.
async fn insert(client: &Client, d: &NewDeadLetter) -> Result<i64, tokio_postgres::Error> {
    let status = d.http_status.map(i32::from);
    let attempts = i32::try_from(d.attempts).unwrap_or(i32::MAX);
    let first = d.first_attempt_unix_micros.map(|m| m as f64 / 1e6);
    let row = client
        .query_one(
            "INSERT INTO cdc_relay_dead_letter \
               (event_id, aggregate_key, event_type, payload, commit_lsn, http_status, error, \
                response_excerpt, attempts, first_attempt_at, last_attempt_at) \
             VALUES ($1, $2, $3, $4, $5::text::pg_lsn, $6, $7, $8, $9, to_timestamp($10), now()) \
             RETURNING id",
            &[
                &d.event_id,
                &d.aggregate_key,
                &d.event_type,
                &d.payload,
                &d.commit_lsn.map(|l| l.to_string()),
                &status,
                &d.error,
                &d.response_excerpt,
                &attempts,
                &first,
            ],
        )
        .await?;
    Ok(row.get(0))
}

const COLUMNS: &str = "id, event_id, aggregate_key, event_type, commit_lsn::text, http_status, error, \
     response_excerpt, attempts, to_char(quarantined_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')";

fn from_row(r: &tokio_postgres::Row, payload: Option<String>) -> DeadLetter {
    DeadLetter {
        id: r.get(0),
        event_id: r.get(1),
        aggregate_key: r.get(2),
        event_type: r.get(3),
        payload,
        commit_lsn: r.get(4),
        http_status: r.get(5),
        error: r.get(6),
        response_excerpt: r.get(7),
        attempts: r.get(8),
        dead_lettered_at: r.get(9),
    }
}

/// All rows, oldest first, without payloads.
pub async fn list(client: &Client) -> Result<Vec<DeadLetter>, tokio_postgres::Error> {
    let rows = client
        .query(
            &format!("SELECT {COLUMNS} FROM cdc_relay_dead_letter ORDER BY id"),
            &[],
        )
        .await?;
    Ok(rows.iter().map(|r| from_row(r, None)).collect())
}

/// One row with its payload.
pub async fn get(client: &Client, id: i64) -> Result<Option<DeadLetter>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            &format!("SELECT {COLUMNS}, payload FROM cdc_relay_dead_letter WHERE id = $1"),
            &[&id],
        )
        .await?;
    Ok(row.map(|r| {
        let payload = r.get(10);
        from_row(&r, payload)
    }))
}

/// Why a row was removed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Removal {
    /// Re-sent and accepted with a 2xx.
    Replay,
    /// Dropped by an operator.
    Discard,
}

/// Deletes row `id` and records the removal in the audit table, in one
/// transaction. Returns `false` when the row did not exist.
pub async fn remove(
    client: &mut Client,
    id: i64,
    why: Removal,
    reason: Option<&str>,
) -> Result<bool, tokio_postgres::Error> {
    let action = match why {
        Removal::Replay => "replay",
        Removal::Discard => "discard",
    };
    let tx = client.transaction().await?;
    let n = tx
        .execute(
            "WITH gone AS (DELETE FROM cdc_relay_dead_letter WHERE id = $1 RETURNING *) \
             INSERT INTO cdc_relay_dead_letter_audit (action, dead_letter_id, event_id, entry, reason) \
             SELECT $2, id, event_id, to_jsonb(gone), $3 FROM gone",
            &[&id, &action, &reason],
        )
        .await?;
    tx.commit().await?;
    Ok(n == 1)
}
