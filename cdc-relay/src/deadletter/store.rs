//! The side connection as the dead-letter store: one autocommit statement
//! per call. [`super::GroupedStore`] shares its inserts among concurrent
//! writers and passes everything else through to it.

use bytes::Bytes;
use tokio_postgres::{Client, ToStatement};

use super::{
    DeadLetterStore, ERROR_BYTES, EXCERPT_BYTES, NAME_BYTES, NewDeadLetter, ParkedRow, Removal,
    StoreError, remove_many, storable,
};
use crate::outbox::OutboxEvent;

/// The advisory-lock key of replaying an endpoint's parked rows.
const RESUME_LOCK: &str = "hashtextextended('cdc_relay_resume:' || $1, 0)";

impl DeadLetterStore for Client {
    async fn insert(&self, row: &NewDeadLetter) -> Result<i64, StoreError> {
        insert(self, row)
            .await
            .map_err(|e| StoreError::of(self, &e))
    }

    async fn parked(
        &self,
        endpoint: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<ParkedRow>, StoreError> {
        let rows = self
            .query(
                "SELECT id, event_id, event_type, aggregate_key, payload, payload_bytes, commit_lsn::text \
                 FROM cdc_relay_dead_letter \
                 WHERE endpoint = $1 AND error LIKE 'parked:%' AND id > $2 ORDER BY id LIMIT $3",
                &[&endpoint, &after, &limit],
            )
            .await
            .map_err(|e| StoreError::of(self, &e))?;
        Ok(rows
            .iter()
            .map(|r| {
                let text: Option<String> = r.get(4);
                let bytes: Option<Vec<u8>> = r.get(5);
                let lsn: Option<String> = r.get(6);
                ParkedRow {
                    id: r.get(0),
                    event: OutboxEvent {
                        id: r.get::<_, Option<String>>(1).unwrap_or_default(),
                        event_type: r.get::<_, Option<String>>(2).unwrap_or_default(),
                        aggregate_key: r.get(3),
                        payload: text.map(Bytes::from).or(bytes.map(Bytes::from)),
                        commit_lsn: lsn.and_then(|l| l.parse().ok()),
                        commit_time_micros: 0,
                    },
                }
            })
            .collect())
    }

    async fn replayed(&self, ids: &[i64]) -> Result<(), StoreError> {
        remove_many(
            self,
            ids,
            Removal::Replay,
            Some("parked endpoint resumed by the relay"),
            Some("cdc-relay"),
        )
        .await
        .map(drop)
        .map_err(|e| StoreError::of(self, &e))
    }

    async fn refused(&self, id: i64, d: &NewDeadLetter) -> Result<(), StoreError> {
        self.execute(
            "UPDATE cdc_relay_dead_letter SET http_status = $2, error = $3, response_excerpt = $4, \
               attempts = $5, first_attempt_at = to_timestamp($6), last_attempt_at = now() WHERE id = $1",
            &[
                &id,
                &d.http_status.map(i32::from),
                &storable(&d.error, ERROR_BYTES),
                &d.response_excerpt.as_deref().map(|e| storable(e, EXCERPT_BYTES)),
                &i32::try_from(d.attempts).unwrap_or(i32::MAX),
                &d.first_attempt_unix_micros.map(|m| m as f64 / 1e6),
            ],
        )
        .await
        .map(drop)
        .map_err(|e| StoreError::of(self, &e))
    }

    async fn resume_lock(&self, endpoint: &str, take: bool) -> Result<bool, StoreError> {
        let sql = if take {
            format!("SELECT pg_try_advisory_lock({RESUME_LOCK})")
        } else {
            format!("SELECT pg_advisory_unlock({RESUME_LOCK})")
        };
        self.query_one(&sql, &[&endpoint])
            .await
            .map(|r| r.get(0))
            .map_err(|e| StoreError::of(self, &e))
    }
}

/// A dead-letter row's column values as stored: text made [`storable`], a
/// payload that is not UTF-8 or holds a NUL in `payload_bytes` as it is,
/// the commit LSN as text (the statement casts it to `pg_lsn`), the first
/// attempt in seconds since the Unix epoch (for `to_timestamp`). What
/// [`insert_rows`] writes, for one row or a batch.
#[derive(Clone, Debug)]
pub(super) struct Stored {
    pub(super) event_id: Option<String>,
    pub(super) aggregate_key: Option<String>,
    pub(super) event_type: Option<String>,
    pub(super) payload: Option<String>,
    pub(super) payload_bytes: Option<Vec<u8>>,
    pub(super) commit_lsn: Option<String>,
    pub(super) http_status: Option<i32>,
    pub(super) error: String,
    pub(super) response_excerpt: Option<String>,
    pub(super) attempts: i32,
    pub(super) first_attempt_at: Option<f64>,
    pub(super) endpoint: Option<String>,
}

impl Stored {
    pub(super) fn of(d: &NewDeadLetter) -> Self {
        let name = |v: &Option<String>| v.as_deref().map(|s| storable(s, NAME_BYTES));
        let (payload, payload_bytes) = match &d.payload {
            Some(p) => match std::str::from_utf8(p) {
                Ok(text) if !text.contains('\0') => (Some(text.to_owned()), None),
                _ => (None, Some(p.to_vec())),
            },
            None => (None, None),
        };
        Stored {
            event_id: name(&d.event_id),
            aggregate_key: name(&d.aggregate_key),
            event_type: name(&d.event_type),
            payload,
            payload_bytes,
            commit_lsn: d.commit_lsn.map(|l| l.to_string()),
            http_status: d.http_status.map(i32::from),
            error: storable(&d.error, ERROR_BYTES),
            response_excerpt: d
                .response_excerpt
                .as_deref()
                .map(|e| storable(e, EXCERPT_BYTES)),
            attempts: i32::try_from(d.attempts).unwrap_or(i32::MAX),
            first_attempt_at: d.first_attempt_unix_micros.map(|m| m as f64 / 1e6),
            endpoint: name(&d.endpoint),
        }
    }
}

/// Inserts a dead-letter row; returns its id. One statement, so the row is
/// committed when this returns `Ok`: the statement of
/// [`super::GroupedStore`]'s batches, with one row.
async fn insert(client: &Client, d: &NewDeadLetter) -> Result<i64, tokio_postgres::Error> {
    let sql = insert_statement(Commit::Synchronous);
    let ids = insert_rows(client, sql.as_str(), &[&Stored::of(d)]).await?;
    Ok(ids[0])
}

/// One column of `rows`, as a statement parameter (an array).
fn column<'a, T>(rows: &[&'a Stored], value: impl Fn(&'a Stored) -> T) -> Vec<T> {
    rows.iter().map(|r| value(r)).collect()
}

/// How an [`insert_rows`] statement commits.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Commit {
    /// With the session's `synchronous_commit` (the server's default: the
    /// rows are durable when the statement returns).
    Synchronous,
    /// With `synchronous_commit = off` for the statement's own transaction
    /// (`set_config(.., true)`): it returns before its WAL is flushed
    /// (`crate::durable`). Inside an explicit transaction the setting stays
    /// until that transaction ends.
    Asynchronous,
}

/// The statement [`insert_rows`] runs, committing as `commit` says.
pub(super) fn insert_statement(commit: Commit) -> String {
    // The setting is a materialized CTE the insert reads (one row, joined
    // to every inserted row), so it is evaluated once, before the first row.
    let (setting, joined) = match commit {
        Commit::Synchronous => ("", ""),
        Commit::Asynchronous => (
            "WITH local_setting AS MATERIALIZED \
               (SELECT set_config('synchronous_commit', 'off', true) AS value) ",
            ", local_setting",
        ),
    };
    format!(
        "{setting}INSERT INTO cdc_relay_dead_letter \
               (event_id, aggregate_key, event_type, payload, payload_bytes, commit_lsn, http_status, \
                error, response_excerpt, attempts, first_attempt_at, last_attempt_at, endpoint) \
             SELECT event_id, aggregate_key, event_type, payload, payload_bytes, commit_lsn::pg_lsn, \
                    http_status, error, response_excerpt, attempts, to_timestamp(first_attempt_at), now(), endpoint \
             FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::text[], \
                         $7::int4[], $8::text[], $9::text[], $10::int4[], $11::float8[], $12::text[]) \
                  WITH ORDINALITY AS r(event_id, aggregate_key, event_type, payload, payload_bytes, \
                    commit_lsn, http_status, error, response_excerpt, attempts, first_attempt_at, endpoint, n){joined} \
             ORDER BY n \
             RETURNING id"
    )
}

/// Inserts `rows` in one statement (`statement`: [`insert_statement`]'s
/// text, or that text prepared), in their order; returns their ids in that
/// order. Ids are taken in that order: the rows are inserted `ORDER BY`
/// their position, and the `id` default (`nextval`) is evaluated once per
/// row as they arrive (`deadletter::grouped`'s module doc).
pub(super) async fn insert_rows<T: ToStatement + ?Sized>(
    client: &Client,
    statement: &T,
    rows: &[&Stored],
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let inserted = client
        .query(
            statement,
            &[
                &column(rows, |r| r.event_id.as_deref()),
                &column(rows, |r| r.aggregate_key.as_deref()),
                &column(rows, |r| r.event_type.as_deref()),
                &column(rows, |r| r.payload.as_deref()),
                &column(rows, |r| r.payload_bytes.as_deref()),
                &column(rows, |r| r.commit_lsn.as_deref()),
                &column(rows, |r| r.http_status),
                &column(rows, |r| r.error.as_str()),
                &column(rows, |r| r.response_excerpt.as_deref()),
                &column(rows, |r| r.attempts),
                &column(rows, |r| r.first_attempt_at),
                &column(rows, |r| r.endpoint.as_deref()),
            ],
        )
        .await?;
    // Ids were taken in row order, so ascending ids are the rows in order,
    // whatever order RETURNING lists them in.
    let mut ids: Vec<i64> = inserted.iter().map(|r| r.get(0)).collect();
    ids.sort_unstable();
    debug_assert_eq!(ids.len(), rows.len(), "one id per row inserted");
    Ok(ids)
}
