//! `cdc-relay backfill`: re-send outbox rows from the table itself.
//!
//! For when the slot cannot tell what was missed (it was invalidated, or
//! recreated): rows still in the outbox whose time column falls in
//! `[since, until)` are read in one REPEATABLE READ snapshot, oldest first,
//! and pushed through the same pipeline as the stream — window, per-aggregate
//! ordering, retries, circuit breaker, dead letters. Each row is its own
//! "transaction" to the pipeline, positioned by its place in the snapshot
//! ([`BackfillRow`]), not by an LSN: the rows' LSNs are unknown, and the
//! dead letters a backfill writes carry no commit LSN. The inbox
//! deduplicates by event id, so rows that were delivered before are
//! absorbed.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::ack::Position;
use crate::dead_letter::GroupedStore;
use crate::dispatch::{
    self, Confirmed, DispatchConfig, DispatchError, Item, Lane, Pipeline, Window,
};
use crate::health::Health;
use crate::metrics::Metrics;
use crate::outbox::{OutboxColumns, OutboxEvent, TableName, UnreadableRow};
use crate::sink::HttpSink;
use crate::source::catalog::{quote_ident, quote_table};

/// A backfill's position: rows of its snapshot handed to the pipeline, in
/// order (row `n` ends at position `n + 1`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackfillRow(pub u64);

impl fmt::Display for BackfillRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "row {}", self.0)
    }
}

impl Position for BackfillRow {
    fn gauge(self) -> i64 {
        i64::try_from(self.0).unwrap_or(i64::MAX)
    }
}

/// What to re-send.
#[derive(Clone, Debug)]
pub struct BackfillPlan {
    /// The outbox table.
    pub table: TableName,
    /// Its columns.
    pub columns: OutboxColumns,
    /// Column ordering the rows (insert time).
    pub time_column: String,
    /// Lower bound, inclusive (timestamptz input text).
    pub since: String,
    /// Upper bound, exclusive.
    pub until: Option<String>,
    /// Window: events held at once.
    pub window_events: usize,
    /// Window: bytes held at once.
    pub window_bytes: u32,
}

/// What a backfill did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackfillReport {
    /// Rows read from the table.
    pub rows: u64,
    /// Rows delivered with a 2xx.
    pub delivered: u64,
    /// Rows dead-lettered.
    pub dead_lettered: u64,
    /// Every row of the range is done (delivered or dead-lettered).
    pub complete: bool,
    /// Rows done from the first one on without a gap: those a resumed
    /// backfill need not send again.
    pub done_prefix: u64,
    /// When not complete: the `--since` that resumes where this one
    /// stopped (UTC text, e.g. `2026-11-30 10:00:00.123456+00`): the time
    /// of the first row not done. Rows of that instant done before are sent
    /// again, which the inbox absorbs.
    pub resume_since: Option<String>,
}

/// How a running backfill is watched and stopped from outside: the
/// pipeline's metrics (delivered, dead-lettered, retries) for a progress
/// line, and a token that stops it. Once `stopping` is cancelled no row is
/// handed to delivery and no new attempt starts; attempts on the wire finish
/// (each within `--request-timeout`), and [`run`] returns a report with the
/// `--since` to resume from.
#[derive(Clone)]
pub struct BackfillControl {
    /// The pipeline's metrics.
    pub metrics: Metrics,
    /// Cancel to stop.
    pub stopping: CancellationToken,
    /// Where the attempts' spans are made (`--otlp-endpoint`); `None`: none.
    pub tracer: Option<opentelemetry_sdk::trace::SdkTracer>,
}

impl Default for BackfillControl {
    fn default() -> Self {
        Self {
            metrics: Metrics::new(),
            stopping: CancellationToken::new(),
            tracer: None,
        }
    }
}

/// Backfill failed part-way; rows sent so far stay sent (harmless to repeat).
#[derive(Debug, thiserror::Error)]
pub enum BackfillError {
    /// Reading the table failed.
    #[error("reading {table}: {}", crate::db_message(.source))]
    Read {
        /// The table.
        table: String,
        /// The error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The pipeline stopped.
    #[error(transparent)]
    Dispatch(#[from] DispatchError),
    /// A setting is wrong: a bound would be read in the server's time zone
    /// (or is not a time, or the range is empty), a column flag names no
    /// column.
    #[error("{0}")]
    Bound(String),
}

/// Rows fetched per round trip.
const FETCH_ROWS: i32 = 500;

/// A time bound an operator gave is unusable.
#[derive(Debug, thiserror::Error)]
pub enum BoundError {
    /// Not an instant: the message says why and gives an example.
    #[error("{0}")]
    Bad(String),
    /// The check itself failed.
    #[error("checking a time bound: {0}")]
    Sql(#[from] tokio_postgres::Error),
}

/// Checks that `value` (given as `flag`) names an instant: a time without
/// a UTC offset (`2026-11-30 10:00`) would be read in the server's
/// `TimeZone`, hours away from what the operator meant. It is read under
/// two time zones 26 hours apart; a bound that reads differently names no
/// offset. `infinity`, `-infinity` and `now` are instants.
pub async fn check_instant(reader: &Client, flag: &str, value: &str) -> Result<(), BoundError> {
    // One transaction: `now` (the transaction's start) is the same instant
    // for both reads; SET LOCAL ends with it.
    reader.batch_execute("BEGIN READ ONLY").await?;
    let mut read = Vec::new();
    for zone in ["Etc/GMT+12", "Etc/GMT-14"] {
        reader
            .batch_execute(&format!("SET LOCAL TimeZone = '{zone}'"))
            .await?;
        let row = reader
            .query_one("SELECT $1::text::timestamptz::text", &[&value])
            .await;
        match row {
            Ok(r) => read.push(r.get::<_, String>(0)),
            Err(e) => {
                let _ = reader.batch_execute("ROLLBACK").await;
                return Err(BoundError::Bad(format!(
                    "{flag} {value:?} is not a time PostgreSQL reads ({}); give one with a UTC offset, e.g. {flag} '2026-11-30 10:00:00+00'",
                    crate::db_message(&e)
                )));
            }
        }
    }
    reader.batch_execute("COMMIT").await?;
    // The same instant prints with a different offset per zone; compare
    // instants, not text.
    let instant = reader
        .query_one(
            "SELECT $1::text::timestamptz = $2::text::timestamptz",
            &[&read[0], &read[1]],
        )
        .await?
        .get::<_, bool>(0);
    if !instant {
        // Suggest the value with an offset only when it reads as a date
        // and time; a word (`yesterday`) gets a plain example.
        let v = value.trim();
        let example = if v.starts_with(|c: char| c.is_ascii_digit()) {
            format!("{flag} '{v}+00' (UTC) or {flag} '{v}-05'")
        } else {
            format!("{flag} '2026-11-30 10:00:00+00'")
        };
        return Err(BoundError::Bad(format!(
            "{flag} {value:?} has no UTC offset: it would be read in the server's TimeZone. Give the offset, e.g. {example}"
        )));
    }
    Ok(())
}

/// Checks that `--since` and `--until` name instants ([`check_instant`])
/// and that the range is not empty.
pub async fn check_bounds(reader: &Client, plan: &BackfillPlan) -> Result<(), BackfillError> {
    let bounds = [
        ("--since", Some(&plan.since)),
        ("--until", plan.until.as_ref()),
    ];
    for (flag, value) in bounds {
        let Some(value) = value else { continue };
        check_instant(reader, flag, value)
            .await
            .map_err(|e| match e {
                BoundError::Bad(m) => BackfillError::Bound(m),
                BoundError::Sql(e) => read_error(plan, e),
            })?;
    }
    if let Some(until) = &plan.until {
        let ordered: bool = reader
            .query_one(
                "SELECT $1::text::timestamptz < $2::text::timestamptz",
                &[&plan.since, until],
            )
            .await
            .map_err(|e| read_error(plan, e))?
            .get(0);
        if !ordered {
            return Err(BackfillError::Bound(format!(
                "--since {:?} is not before --until {until:?}: the range is empty",
                plan.since
            )));
        }
    }
    Ok(())
}

/// What a `--dry-run` reports: the rows `plan` covers, their time range and
/// the first and last event ids in sending order.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BackfillPreview {
    /// Rows covered.
    pub rows: u64,
    /// Time column of the first row (UTC text), `None` without rows.
    pub first_time: Option<String>,
    /// Time column of the last row (UTC text).
    pub last_time: Option<String>,
    /// Id of the first row sent.
    pub first_id: Option<String>,
    /// Id of the last row sent.
    pub last_id: Option<String>,
}

/// The rows `plan` covers, without sending anything.
pub async fn preview(
    reader: &Client,
    plan: &BackfillPlan,
) -> Result<BackfillPreview, BackfillError> {
    let (table, t, id) = (
        quote_table(&plan.table),
        quote_ident(&plan.time_column),
        quote_ident(&plan.columns.id),
    );
    let range = format!(
        "{t} >= $1::text::timestamptz AND ($2::text IS NULL OR {t} < $2::text::timestamptz)"
    );
    let utc =
        |col: &str| format!("to_char({col} AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US+00')");
    let sql = format!(
        "SELECT (SELECT count(*) FROM {table} WHERE {range}), \
                first.t, first.id, last.t, last.id \
         FROM (SELECT 1) one \
         LEFT JOIN LATERAL (SELECT {} AS t, {id}::text AS id FROM {table} WHERE {range} ORDER BY {t}, {id} LIMIT 1) first ON true \
         LEFT JOIN LATERAL (SELECT {} AS t, {id}::text AS id FROM {table} WHERE {range} ORDER BY {t} DESC, {id} DESC LIMIT 1) last ON true",
        utc(&t),
        utc(&t),
    );
    let row = reader
        .query_one(&sql, &[&plan.since, &plan.until])
        .await
        .map_err(|e| read_error(plan, e))?;
    Ok(BackfillPreview {
        rows: u64::try_from(row.get::<_, i64>(0)).unwrap_or(0),
        first_time: row.get(1),
        first_id: row.get(2),
        last_time: row.get(3),
        last_id: row.get(4),
    })
}

/// Counts the rows `plan` covers.
pub async fn count(reader: &Client, plan: &BackfillPlan) -> Result<u64, BackfillError> {
    let sql = format!(
        "SELECT count(*) FROM {} WHERE {t} >= $1::text::timestamptz AND ($2::text IS NULL OR {t} < $2::text::timestamptz)",
        quote_table(&plan.table),
        t = quote_ident(&plan.time_column),
    );
    let row = reader
        .query_one(&sql, &[&plan.since, &plan.until])
        .await
        .map_err(|e| read_error(plan, e))?;
    Ok(u64::try_from(row.get::<_, i64>(0)).unwrap_or(0))
}

/// Re-sends the rows, oldest first, until every row is done or
/// `control.stopping` is cancelled (see [`BackfillControl`]). Dead letters
/// go to `store` through a [`GroupedStore`] (concurrent ones share a
/// commit).
///
/// Errors: [`BackfillError::Read`] when the table cannot be read,
/// [`BackfillError::Dispatch`] when dead letters cannot be written.
pub async fn run(
    reader: &mut Client,
    store: Arc<Client>,
    sink: HttpSink,
    cfg: DispatchConfig,
    plan: &BackfillPlan,
    control: BackfillControl,
) -> Result<BackfillReport, BackfillError> {
    let BackfillControl {
        metrics,
        stopping,
        tracer,
    } = control;
    let pipeline = Pipeline::new(
        Arc::new(GroupedStore::new(store)),
        metrics.clone(),
        Health::new(Duration::from_secs(3600)),
        stopping.clone(),
    );
    let lane = Lane::single(cfg, sink, &metrics).traced(tracer);
    let (items, items_rx) = mpsc::channel(1024);
    let (confirmed, confirmed_rx) = watch::channel(Confirmed::default());
    let dispatcher = tokio::spawn(dispatch::run(
        vec![lane],
        pipeline,
        BackfillRow::default(),
        items_rx,
        confirmed,
    ));
    let window = Window::new(plan.window_events, plan.window_bytes);

    let c = &plan.columns;
    let agg = c.aggregate_key.as_deref().map_or_else(
        || "NULL".to_owned(),
        |a| format!("{}::text", quote_ident(a)),
    );
    let trace = match &c.trace {
        Some(col) if col.required || has_column(&*reader, &plan.table, &col.name).await? => {
            format!("{}::text", quote_ident(&col.name))
        }
        _ => "NULL".to_owned(),
    };
    let t = quote_ident(&plan.time_column);
    let sql = format!(
        "SELECT {}::text, {}::text, {}::text, {agg}, \
                (EXTRACT(EPOCH FROM {t} - '2000-01-01 00:00:00+00'::timestamptz) * 1000000)::int8, \
                to_char({t} AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US+00'), {trace} \
         FROM {} WHERE {t} >= $1::text::timestamptz AND ($2::text IS NULL OR {t} < $2::text::timestamptz) \
         ORDER BY {t}, {}",
        quote_ident(&c.id),
        quote_ident(&c.event_type),
        quote_ident(&c.payload),
        quote_table(&plan.table),
        quote_ident(&c.id),
    );
    let tx = reader
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .map_err(|e| read_error(plan, e))?;
    let stmt = tx.prepare(&sql).await.map_err(|e| read_error(plan, e))?;
    let portal = tx
        .bind(&stmt, &[&plan.since, &plan.until])
        .await
        .map_err(|e| read_error(plan, e))?;
    let mut rows_read: u64 = 0;
    let mut exhausted = false;
    let mut resume = ResumePoint::new(&plan.since);
    'fetch: loop {
        let rows = tokio::select! {
            rows = tx.query_portal(&portal, FETCH_ROWS) => rows.map_err(|e| read_error(plan, e))?,
            () = stopping.cancelled() => break,
        };
        if rows.is_empty() {
            exhausted = true;
            break;
        }
        for row in rows {
            resume.advance(confirmed_rx.borrow().position);
            let commit_time_micros = row.get::<_, Option<i64>>(4).unwrap_or(0);
            let time: Option<String> = row.get(5);
            let item = tokio::select! {
                item = to_item(&row, &window) => item,
                () = stopping.cancelled() => break 'fetch,
            };
            let sent = items.send(Item::Begin).await.is_ok()
                && items.send(item).await.is_ok()
                && items
                    .send(Item::Commit {
                        end: BackfillRow(rows_read + 1),
                        commit_time_micros,
                    })
                    .await
                    .is_ok();
            if !sent {
                break 'fetch; // the pipeline stopped; its error comes below
            }
            rows_read += 1;
            resume.handed(BackfillRow(rows_read), time);
        }
    }
    drop(items);
    // Ending the snapshot can wait for the pipeline: the rows are read.
    let _ = tx.commit().await;
    let done = dispatcher.await.expect("the dispatcher does not panic")?;
    resume.advance(done);
    let complete = exhausted && done.0 == rows_read;
    Ok(BackfillReport {
        rows: rows_read,
        delivered: metrics.events_delivered.get(),
        dead_lettered: metrics.events_dead_lettered.get(),
        complete,
        done_prefix: done.0,
        resume_since: (!complete).then(|| resume.since()),
    })
}

/// Where a stopped backfill resumes: the times of the rows handed to
/// delivery and not yet done (at most a window's worth), oldest first.
struct ResumePoint {
    pending: VecDeque<(BackfillRow, Option<String>)>,
    /// Time of the last row done without a gap before it (or `--since`).
    last_done: String,
}

impl ResumePoint {
    fn new(since: &str) -> Self {
        Self {
            pending: VecDeque::new(),
            last_done: since.to_owned(),
        }
    }

    fn handed(&mut self, row: BackfillRow, time: Option<String>) {
        self.pending.push_back((row, time));
    }

    /// Forgets the rows up to `done` (the pipeline's confirmed position).
    fn advance(&mut self, done: BackfillRow) {
        while self.pending.front().is_some_and(|(row, _)| *row <= done) {
            if let Some((_, Some(time))) = self.pending.pop_front() {
                self.last_done = time;
            }
        }
    }

    /// The first row not done, or, when every row handed is done (the stop
    /// came while reading), the last done: rows are read in time order, so
    /// nothing unsent is earlier. (Every row read has a time: a NULL one is
    /// outside any range.)
    fn since(&self) -> String {
        self.pending
            .iter()
            .find_map(|(_, t)| t.clone())
            .unwrap_or_else(|| self.last_done.clone())
    }
}

async fn to_item(row: &tokio_postgres::Row, window: &Window) -> Item<BackfillRow> {
    let id: Option<String> = row.get(0);
    let event_type: Option<String> = row.get(1);
    let payload: Option<String> = row.get(2);
    let aggregate_key: Option<String> = row.get(3);
    let commit_time_micros = row.get::<_, Option<i64>>(4).unwrap_or(0);
    match (id, event_type) {
        (Some(id), Some(event_type)) => {
            let event = OutboxEvent {
                id,
                event_type,
                payload: payload.map(bytes::Bytes::from),
                aggregate_key,
                commit_lsn: None,
                commit_time_micros,
                dead_letter_id: None,
                trace: row
                    .get::<_, Option<String>>(6)
                    .as_deref()
                    .and_then(trace_context::stored::parse),
            };
            let permit = window.admit(event.size_bytes()).await;
            Item::Event(event, permit)
        }
        (id, event_type) => {
            let missing = if id.is_none() { "id" } else { "event type" };
            let row = UnreadableRow {
                event_id: id,
                aggregate_key,
                event_type,
                payload: payload.map(bytes::Bytes::from),
                commit_lsn: None,
                problem: format!("NULL {missing} (read by backfill)"),
            };
            let permit = window.admit(row.size_bytes()).await;
            Item::Unreadable(Box::new(row), permit)
        }
    }
}

/// Whether `table` has a column `name` (the default trace column is read
/// only where it exists).
async fn has_column(
    client: &tokio_postgres::Client,
    table: &TableName,
    name: &str,
) -> Result<bool, BackfillError> {
    client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid \
               JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2 AND a.attname = $3 AND a.attnum > 0 AND NOT a.attisdropped)",
            &[&table.schema, &table.name, &name],
        )
        .await
        .map(|r| r.get(0))
        .map_err(|source| BackfillError::Read {
            table: table.to_string(),
            source,
        })
}

fn read_error(plan: &BackfillPlan, source: tokio_postgres::Error) -> BackfillError {
    // 42703 undefined_column: a column flag names no column of the table.
    if let Some(db) = source.as_db_error().filter(|d| d.code().code() == "42703") {
        return BackfillError::Bound(format!(
            "{} in {} (check --time-column, CDC_RELAY_TIME_COLUMN, now {:?}, and the column flags --id-column, --type-column, --payload-column, --aggregate-column, --trace-column)",
            db.message(),
            plan.table,
            plan.time_column
        ));
    }
    BackfillError::Read {
        table: plan.table.to_string(),
        source,
    }
}
