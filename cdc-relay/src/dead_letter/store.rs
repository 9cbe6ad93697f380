//! The dead-letter table's statements on the side connection: the batch
//! insert [`super::GroupedStore`]'s writer runs, and the one-statement reads
//! and updates of a parked endpoint's resume.

use bytes::Bytes;
use tokio_postgres::{Client, ToStatement};

use super::{
    ERROR_BYTES, EXCERPT_BYTES, NAME_BYTES, NewDeadLetter, ParkedRow, Removal, StoreError,
    TRACE_COLUMN, query_traced, remove_many, storable,
};
use crate::outbox::OutboxEvent;

/// The advisory-lock key of replaying an endpoint's parked rows.
const RESUME_LOCK: &str = "hashtextextended('cdc_relay_resume:' || $1, 0)";

/// Endpoint `endpoint`'s parked rows (error starting [`super::PARKED`])
/// after row id `after`, oldest first, at most `limit`.
pub(super) async fn parked(
    client: &Client,
    endpoint: &str,
    after: i64,
    limit: i64,
) -> Result<Vec<ParkedRow>, StoreError> {
    let sql = format!(
        "SELECT id, event_id, event_type, aggregate_key, payload, payload_bytes, commit_lsn::text, \
                {TRACE_COLUMN} \
         FROM cdc_relay_dead_letter \
         WHERE endpoint = $1 AND error LIKE 'parked:%' AND id > $2 ORDER BY id LIMIT $3"
    );
    let rows = match query_traced(client, &sql, &[&endpoint, &after, &limit]).await {
        Ok(rows) => rows,
        Err(e) => return Err(StoreError::of(client, &e).await),
    };
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
                    dead_letter_id: Some(r.get(0)),
                    trace: r
                        .get::<_, Option<String>>(7)
                        .as_deref()
                        .and_then(trace_context::stored::parse),
                },
            }
        })
        .collect())
}

/// Removes parked rows the endpoint took with a 2xx when the relay
/// replayed them, each with its audit row.
pub(super) async fn replayed(client: &Client, ids: &[i64]) -> Result<(), StoreError> {
    match remove_many(
        client,
        ids,
        Removal::Replay,
        Some("parked endpoint resumed by the relay"),
        Some("cdc-relay"),
    )
    .await
    {
        Ok(_) => Ok(()),
        Err(e) => Err(StoreError::of(client, &e).await),
    }
}

/// Parked row `id` was refused as poison when replayed: it stays, as `d`
/// says (its error, status and response), no longer parked.
pub(super) async fn refused(client: &Client, id: i64, d: &NewDeadLetter) -> Result<(), StoreError> {
    let updated = client
        .execute(
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
        .await;
    match updated {
        Ok(_) => Ok(()),
        Err(e) => Err(StoreError::of(client, &e).await),
    }
}

/// Takes (`take`) or releases the lock on replaying `endpoint`'s parked
/// rows, held by `client`'s session until it closes; `Ok(false)`: another
/// session (another shard's relay, or `dead-letter replay`) holds it.
pub async fn resume_lock(client: &Client, endpoint: &str, take: bool) -> Result<bool, StoreError> {
    let sql = if take {
        format!("SELECT pg_try_advisory_lock({RESUME_LOCK})")
    } else {
        format!("SELECT pg_advisory_unlock({RESUME_LOCK})")
    };
    match client.query_one(&sql, &[&endpoint]).await {
        Ok(r) => Ok(r.get(0)),
        Err(e) => Err(StoreError::of(client, &e).await),
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
    pub(super) trace_context: Option<String>,
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
            trace_context: d.trace.as_ref().and_then(trace_context::stored::format),
        }
    }
}

/// One column of `rows`, as a statement parameter (an array).
fn column<'a, T>(rows: &[&'a Stored], value: impl Fn(&'a Stored) -> T) -> Vec<T> {
    rows.iter().map(|r| value(r)).collect()
}

/// The statement [`insert_rows`] runs: every row of a batch in one
/// `INSERT … SELECT FROM unnest(…) WITH ORDINALITY ORDER BY` position,
/// except a row whose event already has a dead letter for the same
/// endpoint (the same event refused again after a restart re-streamed it,
/// or a backfill over it): that row is not inserted again, and the
/// existing row's id stands for it, so a replay sends the event once.
/// Returns `(position, id)` per row, by position. `trace`: with the
/// `trace_context` column (added after 0.2.0), or without it for a table
/// `sql/orders.sql` has not upgraded yet (the writer falls back to that,
/// [`super::grouped`]).
pub(super) fn insert_statement(trace: bool) -> String {
    let (column, param) = if trace {
        (", trace_context", ", $13::text[]")
    } else {
        ("", "")
    };
    format!(
        "WITH r AS ( \
           SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::text[], \
                     $7::int4[], $8::text[], $9::text[], $10::int4[], $11::float8[], $12::text[]{param}) \
              WITH ORDINALITY AS r(event_id, aggregate_key, event_type, payload, payload_bytes, \
                commit_lsn, http_status, error, response_excerpt, attempts, first_attempt_at, endpoint{column}, n)), \
         old AS ( \
           SELECT DISTINCT ON (r.n) r.n, d.id FROM r JOIN cdc_relay_dead_letter d \
             ON d.event_id = r.event_id AND d.endpoint IS NOT DISTINCT FROM r.endpoint \
           ORDER BY r.n, d.id), \
         fresh AS (SELECT * FROM r WHERE r.n NOT IN (SELECT n FROM old)), \
         ins AS ( \
           INSERT INTO cdc_relay_dead_letter \
             (event_id, aggregate_key, event_type, payload, payload_bytes, commit_lsn, http_status, \
              error, response_excerpt, attempts, first_attempt_at, last_attempt_at, endpoint{column}) \
           SELECT event_id, aggregate_key, event_type, payload, payload_bytes, commit_lsn::pg_lsn, \
                  http_status, error, response_excerpt, attempts, to_timestamp(first_attempt_at), now(), endpoint{column} \
           FROM fresh ORDER BY n \
           RETURNING id) \
         SELECT n, id FROM old \
         UNION ALL \
         SELECT f.n, i.id \
           FROM (SELECT id, row_number() OVER (ORDER BY id) AS k FROM ins) i \
           JOIN (SELECT n, row_number() OVER (ORDER BY n) AS k FROM fresh) f USING (k) \
         ORDER BY 1"
    )
}

/// Inserts `rows` in one statement (`statement`: [`insert_statement`]'s
/// text for `trace`, or that text prepared), in their order; returns their ids in that
/// order. Ids are taken in that order: the rows are inserted `ORDER BY`
/// their position, and the `id` default (`nextval`) is evaluated once per
/// row as they arrive (`dead_letter::grouped`'s module doc).
pub(super) async fn insert_rows<T: ToStatement + ?Sized>(
    client: &Client,
    statement: &T,
    trace: bool,
    rows: &[&Stored],
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let (event_id, aggregate_key, event_type) = (
        column(rows, |r| r.event_id.as_deref()),
        column(rows, |r| r.aggregate_key.as_deref()),
        column(rows, |r| r.event_type.as_deref()),
    );
    let (payload, payload_bytes, commit_lsn) = (
        column(rows, |r| r.payload.as_deref()),
        column(rows, |r| r.payload_bytes.as_deref()),
        column(rows, |r| r.commit_lsn.as_deref()),
    );
    let (http_status, error, response_excerpt) = (
        column(rows, |r| r.http_status),
        column(rows, |r| r.error.as_str()),
        column(rows, |r| r.response_excerpt.as_deref()),
    );
    let (attempts, first_attempt_at, endpoint) = (
        column(rows, |r| r.attempts),
        column(rows, |r| r.first_attempt_at),
        column(rows, |r| r.endpoint.as_deref()),
    );
    let trace_context = column(rows, |r| r.trace_context.as_deref());
    let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![
        &event_id,
        &aggregate_key,
        &event_type,
        &payload,
        &payload_bytes,
        &commit_lsn,
        &http_status,
        &error,
        &response_excerpt,
        &attempts,
        &first_attempt_at,
        &endpoint,
    ];
    if trace {
        params.push(&trace_context);
    }
    // Ids of inserted rows were taken in row order, so the k-th ascending
    // id is the k-th inserted row; the statement pairs them back with
    // their positions and lists every row by position.
    let ids: Vec<i64> = client
        .query(statement, &params)
        .await?
        .iter()
        .map(|r| r.get(1))
        .collect();
    debug_assert_eq!(ids.len(), rows.len(), "one id per row");
    Ok(ids)
}
