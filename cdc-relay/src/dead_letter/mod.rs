//! The dead-letter table: where poison events go instead of being dropped.
//!
//! A poison event (the sink refused the event itself: 400, 413, 422 by
//! default), an unreadable outbox row (NULL id or type, bad text), an
//! unrouted event or an event of a parked endpoint becomes a row in
//! `cdc_relay_dead_letter` (see `sql/orders.sql`) in the source database.
//! The event counts as done only after that row is committed; if the write
//! fails, the event stays pending and the write is retried.
//!
//! This module is the only place a dead-letter row is built
//! ([`NewDeadLetter::rejected`], [`NewDeadLetter::unreadable`],
//! [`NewDeadLetter::unrouted`], [`NewDeadLetter::parked`]); the pipeline
//! writes it through the [`DeadLetterStore`] trait: a [`GroupedStore`] over
//! the side connection, so rows written concurrently share one statement
//! and one commit.
//!
//! Operators list, show, replay and discard rows with `cdc-relay dead-letter`
//! (whose reads are in `commands::dead_letter::rows`); replays and discards
//! leave a row in `cdc_relay_dead_letter_audit`.

use std::future::Future;

use bytes::Bytes;
use tokio_postgres::{Client, GenericClient};

mod grouped;
mod store;

pub use grouped::{GATHER, GroupedStore, MAX_BYTES, MAX_ROWS, Urgency};
pub use store::{Written, manual_replay_lock, replay_holding, restreamable, resume_lock};

use crate::lsn::Lsn;
use crate::outbox::{OutboxEvent, UnreadableRow};
use crate::sink::{Attempt, Reason};

/// Where the pipeline writes dead letters, and where a parked endpoint's
/// rows are read back to resume it (the side SQL connection through a
/// [`GroupedStore`] in production, memory in unit tests).
pub trait DeadLetterStore: Send + Sync + 'static {
    /// Queues `row` when called (before the future is polled: rows written
    /// one after another are stored in that order, with increasing ids)
    /// and gives its id once it is committed, and whether the write made
    /// the row (an event that already has a dead letter for the same
    /// endpoint reuses it: [`Written::new`] is `false`). A write that fails is
    /// retried by the store; the future fails only with
    /// [`StoreError::Lost`]. `urgency` says whether the row may wait a
    /// little for company ([`Urgency`]).
    fn write(
        &self,
        row: &NewDeadLetter,
        urgency: Urgency,
    ) -> impl Future<Output = Result<Written, StoreError>> + Send + 'static;

    /// Endpoint `endpoint`'s parked rows (error starting [`PARKED`]) after
    /// row id `after`, oldest first, at most `limit`; each event carries
    /// its row id ([`OutboxEvent::dead_letter_id`]).
    fn parked(
        &self,
        endpoint: &str,
        after: i64,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<ParkedRow>, StoreError>> + Send;

    /// Removes rows whose events the endpoint took with a 2xx, each with
    /// its audit row (action `replay`, by `cdc-relay`, `why` its reason):
    /// rows the relay replayed ([`REPLAYED_ON_RESUME`]), or rows an
    /// earlier session wrote for an event delivered when re-streamed
    /// ([`DELIVERED_WHEN_RESTREAMED`]).
    fn replayed(
        &self,
        ids: &[i64],
        why: &'static str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Row `id` was refused as poison when replayed (a parked row on
    /// resume, any row by `dead-letter replay`): it stays, as `row` says
    /// (its error, status and response; no longer parked), with `row`'s
    /// attempts added to its own.
    fn refused(
        &self,
        id: i64,
        row: &NewDeadLetter,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Takes (`take`) or releases the lock on replaying `endpoint`'s parked
    /// rows, held by this session; `Ok(false)`: another session (another
    /// shard's relay) holds it.
    fn resume_lock(
        &self,
        endpoint: &str,
        take: bool,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

/// The audit reason of a parked row the relay replayed on resume.
pub const REPLAYED_ON_RESUME: &str = "parked endpoint resumed by the relay";

/// The audit reason of a row an earlier session wrote for an event it did
/// not confirm, which this session then delivered when the slot streamed
/// it again.
pub const DELIVERED_WHEN_RESTREAMED: &str = "delivered when the slot streamed it again (the relay that wrote this row stopped before confirming the event)";

/// A parked row, as the relay replays it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParkedRow {
    /// Row id.
    pub id: i64,
    /// The event as it was parked (no commit time: the table has none).
    pub event: OutboxEvent,
}

/// A dead-letter write failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// The store is gone (the connection closed): the session must end.
    #[error("dead-letter store lost: {0}")]
    Lost(String),
    /// This write failed; retrying may help.
    #[error("dead-letter write failed: {0}")]
    Failed(String),
}

impl StoreError {
    /// `e` on `client`: lost when the connection closed; a lock wait past
    /// `lock_timeout` names who holds the lock (read on `client`); a
    /// missing privilege names the grants.
    pub async fn of(client: &Client, e: &tokio_postgres::Error) -> Self {
        let text = crate::db_message(e);
        if client.is_closed() {
            StoreError::Lost(text)
        } else if crate::locks::is_lock_wait(e) {
            StoreError::Failed(format!("{text}: {}", crate::locks::holders(client).await))
        } else if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) {
            StoreError::Failed(format!(
                "{text}. Grant the relay's role what sql/roles.sql grants cdc_relay on the \
                 dead-letter tables (SELECT, INSERT, UPDATE, DELETE on cdc_relay_dead_letter, \
                 INSERT on cdc_relay_dead_letter_audit): apply it again, or the same grants to the role in \
                 --database-url"
            ))
        } else {
            StoreError::Failed(text)
        }
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
    /// The payload column's bytes as read, if any: stored as text when they
    /// are UTF-8 (JSON text), else in `payload_bytes`.
    pub payload: Option<Bytes>,
    /// Commit LSN of the event's transaction; `None` for a row a backfill
    /// read from the table.
    pub commit_lsn: Option<Lsn>,
    /// HTTP status of the last response, if one arrived.
    pub http_status: Option<u16>,
    /// Why it was dead-lettered (reason label and detail). Stored without
    /// NUL characters and cut at [`ERROR_BYTES`].
    pub error: String,
    /// First bytes of the last response body. Stored without NUL
    /// characters and cut at [`EXCERPT_BYTES`].
    pub response_excerpt: Option<String>,
    /// Delivery attempts made.
    pub attempts: u32,
    /// When the first attempt was made, microseconds since the Unix epoch.
    pub first_attempt_unix_micros: Option<i64>,
    /// The routes file's endpoint that refused it; `None` in one-endpoint
    /// mode (`--sink-url`), for an unrouted event and for an unreadable row.
    pub endpoint: Option<String>,
    /// The event's stored trace context, kept so that its replay continues
    /// the same trace.
    pub trace: Option<trace_context::SpanContext>,
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
            http_status: status,
            response_excerpt: excerpt,
            attempts,
            first_attempt_unix_micros: Some(first_attempt_unix_micros),
            ..Self::unsent(event, format!("{reason}: {}", attempt.detail()), None)
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
            endpoint: None,
            trace: None,
        }
    }

    /// The row for an event no endpoint's `event_types` match (routes
    /// file, `unrouted = "dead-letter"`); never sent. Its error starts with
    /// [`UNROUTED`], what `--reason unrouted` selects.
    pub fn unrouted(event: &OutboxEvent) -> Self {
        Self::unsent(
            event,
            format!(
                "{UNROUTED}: no endpoint of the routes file takes event type {:?}",
                event.event_type
            ),
            None,
        )
    }

    /// The row for `event` set aside without an attempt: `error` says why,
    /// `endpoint` whose it is (`None`: no endpoint's).
    fn unsent(event: &OutboxEvent, error: String, endpoint: Option<String>) -> Self {
        NewDeadLetter {
            event_id: Some(event.id.clone()),
            aggregate_key: event.aggregate_key.clone(),
            event_type: Some(event.event_type.clone()),
            payload: event.payload.clone(),
            commit_lsn: event.commit_lsn,
            http_status: None,
            error,
            response_excerpt: None,
            attempts: 0,
            first_attempt_unix_micros: None,
            endpoint,
            trace: event.trace.clone(),
        }
    }
}

/// The reason of an unrouted event's dead letter (its error's first word).
pub const UNROUTED: &str = "unrouted";

/// The reason of a parked endpoint's dead letters (their error's first
/// word; `--reason parked` selects them).
pub const PARKED: &str = "parked";

impl NewDeadLetter {
    /// The row for an event of endpoint `endpoint` while that endpoint is
    /// parked (`docs/architecture.md#parking`); `why` says what parked it.
    /// It names the endpoint even in one-endpoint mode (`default`), so the
    /// relay finds an endpoint's parked backlog at start.
    pub fn parked(event: &OutboxEvent, endpoint: &str, why: &str) -> Self {
        Self::unsent(
            event,
            format!("{PARKED}: endpoint {endpoint:?} is parked ({why})"),
            Some(endpoint.to_owned()),
        )
    }
}

/// The endpoints with parked dead letters waiting (rows whose error
/// starts with [`PARKED`]): the relay starts them parked, so their new
/// events never overtake the parked ones. Empty when the table does not
/// exist.
pub async fn parked_endpoints(client: &Client) -> Result<Vec<String>, tokio_postgres::Error> {
    let exists: bool = client
        .query_one(
            "SELECT to_regclass('cdc_relay_dead_letter') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    if !exists {
        return Ok(Vec::new());
    }
    let rows = client
        .query(
            "SELECT DISTINCT endpoint FROM cdc_relay_dead_letter \
             WHERE endpoint IS NOT NULL AND error LIKE 'parked:%'",
            &[],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// The token a dead-letter read puts in its select list where the row's
/// `trace_context` goes; [`query_traced`] replaces it.
pub const TRACE_COLUMN: &str = "trace_context_or_null";

/// Runs `sql` (a read of `cdc_relay_dead_letter` whose select list holds
/// [`TRACE_COLUMN`]) with the table's `trace_context` column, or with
/// `NULL::text` in its place when the table predates the column
/// (SQLSTATE 42703 until `sql/orders.sql` is applied again): a read never
/// needs the upgrade, and never pays for the fallback once upgraded.
///
/// # Errors
/// The server's error, including 42703 when another column is missing.
pub async fn query_traced(
    client: &Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
    match client
        .query(&sql.replace(TRACE_COLUMN, "trace_context"), params)
        .await
    {
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_COLUMN) => {
            client
                .query(&sql.replace(TRACE_COLUMN, "NULL::text"), params)
                .await
        }
        result => result,
    }
}

/// Longest `error` stored, in bytes.
pub const ERROR_BYTES: usize = 4096;

/// Longest `response_excerpt` stored, in bytes.
pub const EXCERPT_BYTES: usize = 2048;

/// Longest id, type or key stored, in bytes.
const NAME_BYTES: usize = 1024;

/// Text safe for a PostgreSQL `text` column: no NUL (which no server
/// encoding accepts), at most `max` bytes (cut at a character boundary).
/// Whatever a sink answers, writing its dead letter cannot fail on content.
pub fn storable(s: &str, max: usize) -> String {
    let mut out: String = s.chars().filter(|c| *c != '\0').collect();
    if out.len() > max {
        let mut cut = max;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
    }
    out
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
/// statement. Returns `false` when the row did not exist.
///
/// `actor` (the operator's name) goes into `performed_by`; the database
/// role when `None`.
pub async fn remove(
    client: &Client,
    id: i64,
    why: Removal,
    reason: Option<&str>,
    actor: Option<&str>,
) -> Result<bool, tokio_postgres::Error> {
    Ok(remove_many(client, &[id], why, reason, actor).await? == [id])
}

/// Deletes the rows of `ids` and writes one audit row for each, in one
/// statement: a row is never gone without its audit row, nor audited while
/// still there. Returns the ids removed, ascending (ids that did not exist,
/// or were removed meanwhile, are missing). Run it on a transaction to undo
/// it when not every row was there.
///
/// `actor` (the operator's name) goes into `performed_by`; the database
/// role when `None`.
pub async fn remove_many(
    client: &impl GenericClient,
    ids: &[i64],
    why: Removal,
    reason: Option<&str>,
    actor: Option<&str>,
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let action = match why {
        Removal::Replay => "replay",
        Removal::Discard => "discard",
    };
    let rows = client
        .query(
            // The ids come from the DELETE, not the audit INSERT: the relay
            // role may insert into the audit table but not read it.
            "WITH gone AS (DELETE FROM cdc_relay_dead_letter WHERE id = ANY($1) RETURNING *), \
             audited AS (INSERT INTO cdc_relay_dead_letter_audit \
               (action, dead_letter_id, event_id, entry, reason, performed_by) \
               SELECT $2, id, event_id, to_jsonb(gone), $3, coalesce($4, session_user) FROM gone) \
             SELECT id FROM gone",
            &[&ids, &action, &reason, &actor],
        )
        .await?;
    let mut removed: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
    removed.sort_unstable();
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any text becomes storable: no NUL, within the cap, a prefix of
        /// the text without its NULs.
        #[test]
        fn any_text_is_storable(s in ".{0,300}", max in 1usize..200) {
            let out = storable(&s, max);
            prop_assert!(!out.contains('\0'));
            prop_assert!(out.len() <= max);
            let without_nul: String = s.chars().filter(|c| *c != '\0').collect();
            prop_assert!(without_nul.starts_with(&out));
        }
    }

    #[test]
    fn nul_and_long_text_are_made_storable() {
        assert_eq!(storable("\0", 10), "");
        assert_eq!(storable("a\0b", 10), "ab");
        assert_eq!(storable("ééé", 5), "éé");
    }
}
