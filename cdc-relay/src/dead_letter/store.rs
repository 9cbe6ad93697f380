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

/// The advisory-lock key of `cdc-relay dead-letter replay` itself.
const MANUAL_REPLAY_LOCK: &str = "hashtextextended('cdc_relay_dead_letter_replay', 0)";

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
/// The dead-letter rows the slot may stream again from `confirmed` (its
/// `confirmed_flush_lsn`): rows of events whose transaction commits at or
/// after it, which an earlier session wrote and never confirmed. By
/// (event id, endpoint: `""` for `--sink-url`), their row ids. Empty when
/// the table does not exist.
pub async fn restreamable(
    client: &Client,
    confirmed: crate::lsn::Lsn,
) -> Result<std::collections::HashMap<(String, String), i64>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT event_id, coalesce(endpoint, ''), min(id) FROM cdc_relay_dead_letter \
             WHERE event_id IS NOT NULL AND commit_lsn >= $1::text::pg_lsn \
             GROUP BY 1, 2",
            &[&confirmed.to_string()],
        )
        .await;
    let rows = match rows {
        Ok(rows) => rows,
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => {
            return Ok(Default::default());
        }
        Err(e) => return Err(e),
    };
    Ok(rows
        .iter()
        .map(|r| ((r.get(0), r.get(1)), r.get(2)))
        .collect())
}

pub(super) async fn replayed(client: &Client, ids: &[i64], why: &str) -> Result<(), StoreError> {
    match remove_many(client, ids, Removal::Replay, Some(why), Some("cdc-relay")).await {
        Ok(_) => Ok(()),
        Err(e) => Err(StoreError::of(client, &e).await),
    }
}

/// Row `id` was refused as poison when replayed (a parked row on resume,
/// any row by `dead-letter replay`): it stays, as `d` says (its error,
/// status and response; no longer parked), with `d`'s attempts added to
/// its own and its first attempt kept.
pub(super) async fn refused(client: &Client, id: i64, d: &NewDeadLetter) -> Result<(), StoreError> {
    let updated = client
        .execute(
            "UPDATE cdc_relay_dead_letter SET http_status = $2, error = $3, response_excerpt = $4, \
               attempts = attempts + $5, first_attempt_at = coalesce(first_attempt_at, to_timestamp($6)), \
               last_attempt_at = now() WHERE id = $1",
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

/// Takes the lock of `cdc-relay dead-letter replay` itself, held by
/// `client`'s session until it closes; `Ok(false)`: another replay holds
/// it. Two replays at once would each send (and remove) the same rows.
pub async fn manual_replay_lock(client: &Client) -> Result<bool, StoreError> {
    match client
        .query_one(
            &format!("SELECT pg_try_advisory_lock({MANUAL_REPLAY_LOCK})"),
            &[],
        )
        .await
    {
        Ok(r) => Ok(r.get(0)),
        Err(e) => Err(StoreError::of(client, &e).await),
    }
}

/// What stops a discard of rows `ids` now, on `tx` (a transaction whose
/// commit removes them): `Some(holder)` when a replay holds a lock on any
/// of them — `dead-letter replay`'s own, or a relay's (or a replay's)
/// lock on replaying the parked rows of an endpoint among them. A replay
/// sends the rows it has read; discarding them meanwhile would record as
/// never sent an event the sink may receive. Otherwise the locks are taken
/// until `tx` ends (`pg_try_advisory_xact_lock`, the same keys as
/// [`manual_replay_lock`] and [`resume_lock`]), so no replay starts
/// reading these rows before the discard commits. `None`: go ahead.
pub async fn replay_holding(
    tx: &tokio_postgres::Transaction<'_>,
    ids: &[i64],
) -> Result<Option<String>, tokio_postgres::Error> {
    let manual: bool = tx
        .query_one(
            &format!("SELECT pg_try_advisory_xact_lock({MANUAL_REPLAY_LOCK})"),
            &[],
        )
        .await?
        .get(0);
    if !manual {
        return Ok(Some("a `cdc-relay dead-letter replay`".to_owned()));
    }
    let busy = tx
        .query(
            &format!(
                "SELECT e FROM (SELECT DISTINCT endpoint AS e FROM cdc_relay_dead_letter \
                                WHERE id = ANY($1) AND endpoint IS NOT NULL) d \
                 WHERE NOT pg_try_advisory_xact_lock({}) ORDER BY 1",
                RESUME_LOCK.replace("$1", "d.e")
            ),
            &[&ids],
        )
        .await?;
    Ok(busy.first().map(|r| {
        format!(
            "a replay of endpoint {}'s parked rows (a relay resuming it, or `dead-letter replay`)",
            r.get::<_, String>(0)
        )
    }))
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

/// Which statement [`insert_rows`] runs, by what the table has.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct Shape {
    /// The `trace_context` column (added after 0.2.0).
    pub(super) trace: bool,
    /// The unique index `cdc_relay_dead_letter_event_endpoint_key` on
    /// `(event_id, coalesce(endpoint, ''))` (added after 0.2.0): the insert
    /// is `ON CONFLICT DO NOTHING`, so two writers at once (a backfill
    /// beside `run`) still make one row per event and endpoint. Without
    /// it, a lookup in the same statement dedupes against committed rows
    /// only.
    pub(super) unique: bool,
}

impl Shape {
    /// The shape of a table `sql/orders.sql` made: everything.
    pub(super) const CURRENT: Shape = Shape {
        trace: true,
        unique: true,
    };
}

/// One row's outcome: the id of its dead letter, and whether this write
/// made it (`false`: the event already had a dead letter for the same
/// endpoint, which stands for it).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Written {
    /// `cdc_relay_dead_letter.id`.
    pub id: i64,
    /// Inserted by this write, not reused.
    pub new: bool,
}

/// The statement [`insert_rows`] runs: every row of a batch in one
/// `INSERT … SELECT FROM unnest(…) WITH ORDINALITY ORDER BY` position,
/// except a row whose event already has a dead letter for the same
/// endpoint (the same event refused again after a restart re-streamed it,
/// or a backfill over it): that row is not inserted again, and the
/// existing row's id stands for it, so a replay sends the event once.
/// A second row of the same event and endpoint in one batch reuses the
/// first's. Returns `(position, id, new)` per row, by position; with
/// [`Shape::unique`], `id` is NULL for a row whose conflicting row was
/// committed by another writer after the statement's snapshot (the caller
/// runs the statement again for it, [`insert_rows`]).
pub(super) fn insert_statement(shape: Shape) -> String {
    let (column, param) = if shape.trace {
        (", trace_context", ", $13::text[]")
    } else {
        ("", "")
    };
    let same = |a: &str, b: &str| {
        format!(
            "{a}.event_id = {b}.event_id AND coalesce({a}.endpoint, '') = coalesce({b}.endpoint, '')"
        )
    };
    let rows = format!(
        "r AS ( \
           SELECT u.*, min(u.n) OVER (PARTITION BY u.event_id, coalesce(u.endpoint, '')) AS first \
             FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::text[], \
                     $7::int4[], $8::text[], $9::text[], $10::int4[], $11::float8[], $12::text[]{param}) \
              WITH ORDINALITY AS u(event_id, aggregate_key, event_type, payload, payload_bytes, \
                commit_lsn, http_status, error, response_excerpt, attempts, first_attempt_at, endpoint{column}, n))"
    );
    let insert = |from: &str, conflict: &str| {
        format!(
            "INSERT INTO cdc_relay_dead_letter \
               (event_id, aggregate_key, event_type, payload, payload_bytes, commit_lsn, http_status, \
                error, response_excerpt, attempts, first_attempt_at, last_attempt_at, endpoint{column}) \
             SELECT event_id, aggregate_key, event_type, payload, payload_bytes, commit_lsn::pg_lsn, \
                    http_status, error, response_excerpt, attempts, to_timestamp(first_attempt_at), now(), endpoint{column} \
             FROM {from} ORDER BY n {conflict} \
             RETURNING id, event_id, endpoint"
        )
    };
    // Rows without an event id (unreadable rows) are never deduped: the
    // k-th of them in position order took the k-th ascending id.
    let unnamed = "SELECT f.n, i.id, true \
           FROM (SELECT id, row_number() OVER (ORDER BY id) AS k FROM ins WHERE event_id IS NULL) i \
           JOIN (SELECT n, row_number() OVER (ORDER BY n) AS k FROM r WHERE event_id IS NULL) f USING (k)";
    // The first position of an event and endpoint in the batch.
    let first = "r.n = r.first";
    if shape.unique {
        format!(
            "WITH {rows}, \
             ins AS ({insert}) \
             SELECT r.n, coalesce(i.id, d.id), i.id IS NOT NULL AND {first} \
               FROM r LEFT JOIN ins i ON {same_i} LEFT JOIN cdc_relay_dead_letter d ON {same_d} \
              WHERE r.event_id IS NOT NULL \
             UNION ALL {unnamed} \
             ORDER BY 1",
            insert = insert(
                "r",
                "ON CONFLICT (event_id, (coalesce(endpoint, ''))) WHERE event_id IS NOT NULL DO NOTHING"
            ),
            same_i = same("i", "r"),
            same_d = same("d", "r"),
        )
    } else {
        format!(
            "WITH {rows}, \
             old AS ( \
               SELECT DISTINCT ON (r.n) r.n, d.id FROM r JOIN cdc_relay_dead_letter d ON {same_d} \
               ORDER BY r.n, d.id), \
             fresh AS (SELECT * FROM r WHERE r.n NOT IN (SELECT n FROM old) \
               AND (r.event_id IS NULL OR {first})), \
             ins AS ({insert}) \
             SELECT n, id, false FROM old \
             UNION ALL \
             SELECT r.n, i.id, {first} FROM r JOIN ins i ON {same_i} \
              WHERE r.event_id IS NOT NULL AND r.n NOT IN (SELECT n FROM old) \
             UNION ALL {unnamed} \
             ORDER BY 1",
            insert = insert("fresh", ""),
            same_i = same("i", "r"),
            same_d = same("d", "r"),
        )
    }
}

/// Inserts `rows` in one statement (`statement`: [`insert_statement`]'s
/// text for `shape`, or that text prepared), in their order; returns each
/// row's [`Written`] in that order. Ids are taken in that order: the rows
/// are inserted `ORDER BY` their position, and the `id` default
/// (`nextval`) is evaluated once per row as they arrive
/// (`dead_letter::grouped`'s module doc). A row whose event and endpoint
/// another writer inserted and committed after the statement's snapshot
/// (the insert waited for that writer and skipped the row) goes again in
/// a second statement, which finds that row (or, should it be gone
/// meanwhile, inserts its own).
pub(super) async fn insert_rows<T: ToStatement + ?Sized>(
    client: &Client,
    statement: &T,
    shape: Shape,
    rows: &[&Stored],
) -> Result<Vec<Written>, tokio_postgres::Error> {
    let mut out: Vec<Option<Written>> = vec![None; rows.len()];
    let mut todo: Vec<usize> = (0..rows.len()).collect();
    // A row another writer committed after this statement's snapshot is
    // visible to the next statement's, which then reuses it. Each further
    // round needs yet another writer to have inserted a row of one of
    // these events and removed it again meanwhile.
    while !todo.is_empty() {
        let part: Vec<&Stored> = todo.iter().map(|&i| rows[i]).collect();
        let answers = insert_once(client, statement, shape.trace, &part).await?;
        let mut missing = Vec::new();
        for (i, written) in todo.into_iter().zip(answers) {
            match written {
                Some(w) => out[i] = Some(w),
                None => missing.push(i),
            }
        }
        todo = missing;
    }
    Ok(out
        .into_iter()
        .map(|w| w.expect("every row answered"))
        .collect())
}

/// One run of the insert statement over `rows`: per row, its
/// [`Written`], or `None` when another writer's row, committed after the
/// statement's snapshot, took its place.
async fn insert_once<T: ToStatement + ?Sized>(
    client: &Client,
    statement: &T,
    trace: bool,
    rows: &[&Stored],
) -> Result<Vec<Option<Written>>, tokio_postgres::Error> {
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
    // The statement lists every row by position.
    let written: Vec<Option<Written>> = client
        .query(statement, &params)
        .await?
        .iter()
        .map(|r| {
            r.get::<_, Option<i64>>(1)
                .map(|id| Written { id, new: r.get(2) })
        })
        .collect();
    debug_assert_eq!(written.len(), rows.len(), "one answer per row");
    Ok(written)
}
