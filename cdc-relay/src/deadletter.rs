//! The dead-letter table: where poison events are quarantined, never dropped.
//!
//! A poison event (the sink refused the event itself: 400, 413, 415, 422 by
//! default) or an unreadable outbox row (NULL id or type, bad text) becomes a
//! row in `cdc_relay_dead_letter` (see `sql/orders.sql`) in the source
//! database. The event counts as done only after that row is committed; if
//! the write fails, the event stays pending and the write is retried.
//!
//! Operators list, show, replay and discard rows with `cdc-relay dead-letter`;
//! replays and discards leave a row in `cdc_relay_dead_letter_audit`.

use serde::Serialize;
use tokio_postgres::Client;

use crate::lsn::Lsn;

/// One quarantined event, as written.
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
    /// Commit LSN of the event's transaction.
    pub commit_lsn: Lsn,
    /// HTTP status of the last response, if one arrived.
    pub http_status: Option<u16>,
    /// Why it was quarantined (reason label and detail).
    pub error: String,
    /// First bytes of the last response body.
    pub response_excerpt: Option<String>,
    /// Delivery attempts made.
    pub attempts: u32,
    /// When the first attempt was made, microseconds since the Unix epoch.
    pub first_attempt_unix_micros: Option<i64>,
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
    /// Commit LSN (PostgreSQL text form).
    pub commit_lsn: String,
    /// HTTP status of the last response.
    pub http_status: Option<i32>,
    /// Why it was quarantined.
    pub error: String,
    /// First bytes of the last response body.
    pub response_excerpt: Option<String>,
    /// Delivery attempts.
    pub attempts: i32,
    /// When it was quarantined (RFC 3339, UTC).
    pub quarantined_at: String,
}

/// Inserts a dead-letter row; returns its id. One statement, so the row is
/// committed when this returns `Ok`.
pub async fn insert(client: &Client, d: &NewDeadLetter) -> Result<i64, tokio_postgres::Error> {
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
                &d.commit_lsn.to_string(),
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
        quarantined_at: r.get(9),
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
