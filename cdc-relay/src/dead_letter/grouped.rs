//! Group commit for dead-letter inserts: rows written concurrently share
//! one statement and one commit.
//!
//! A parked endpoint turns every one of its events into a dead-letter row,
//! and poison events of several endpoints may be refused at once. One
//! autocommit statement each would be one commit (one WAL flush) per row.
//! So [`GroupedStore`] queues the rows, and one writer task takes the first
//! queued row and whatever else is queued at that moment (at most
//! [`MAX_ROWS`] rows, [`MAX_BYTES`] of text and payload), inserts them in
//! one statement, and answers each writer with its row's id once the
//! statement has committed (with the server's `synchronous_commit`: the row
//! is as durable as any commit of the database when its writer hears of
//! it). A row written [`Urgency::Now`] (a poison event its delivery waits
//! for) goes at once with whatever is queued; a row written
//! [`Urgency::Gather`] (a parked event) lets the writer gather what comes
//! within [`GATHER`] first: a parked endpoint at 500 events/s is then tens
//! of statements a second, not 500.
//!
//! **Order.** Rows get ids in queue order, and a row is queued when
//! [`DeadLetterStore::write`] returns, before its future is polled. Within
//! a statement the rows are inserted `ORDER BY` their position in the
//! batch, and PostgreSQL evaluates the `id` default (`nextval`) in the
//! insert's projection, once per row as the sorted rows arrive, so ids
//! increase with the position. Statements go one after another on one
//! connection, so a later batch's ids are greater. A failed statement is
//! tried again, after a pause, before anything queued behind it, until it
//! commits or the connection is gone: no row overtakes one queued before
//! it. So rows written in one order are stored in that order — what the
//! dispatcher relies on when it hands a parked endpoint's events to the
//! writer in each aggregate's commit order
//! (`docs/architecture.md#parking`), and what the system test
//! `dead_letters::concurrent_inserts_share_commits_and_keep_each_writers_order`
//! checks against a real server.
//!
//! **Bounded.** Every queued row belongs to an event that holds its room in
//! the relay's memory window until the row is committed, so the window
//! bounds the queue: a writer that cannot write leaves events pending.

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_postgres::{Client, Statement};

use super::store::{self, Shape, Stored, Written, insert_rows, insert_statement};
use super::{DeadLetterStore, NewDeadLetter, ParkedRow, StoreError};

/// Most rows one statement inserts.
pub const MAX_ROWS: usize = 256;

/// Most bytes of text and payload one statement inserts (a single larger
/// row goes alone).
pub const MAX_BYTES: usize = 4 << 20;

/// How long the writer gathers rows after taking a row written
/// [`Urgency::Gather`], before it inserts them.
pub const GATHER: Duration = Duration::from_millis(25);

/// The writer's first pause after a failed statement; it doubles up to
/// [`RETRY_CAP`].
const RETRY_FIRST: Duration = Duration::from_millis(100);

/// The writer's longest pause between two tries of a failed statement.
const RETRY_CAP: Duration = Duration::from_secs(10);

/// How soon the writer takes a row ([`DeadLetterStore::write`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Urgency {
    /// With whatever is queued at that moment (a delivery waits for it).
    Now,
    /// After gathering what comes within [`GATHER`] (a parked event:
    /// company saves commits, and only the confirmed position waits).
    Gather,
}

/// A [`DeadLetterStore`] over the side connection whose concurrent
/// inserts share one statement and one commit (see the module doc).
pub struct GroupedStore {
    client: Arc<Client>,
    queue: mpsc::UnboundedSender<Row>,
    /// Why the writer ended (its connection's error), once it has.
    ended: Arc<OnceLock<String>>,
}

/// A row for the writer.
struct Row {
    row: Stored,
    urgency: Urgency,
    answer: oneshot::Sender<Result<Written, StoreError>>,
}

impl Row {
    /// Whoever wrote this row went away (its pipeline ended): it wants
    /// nothing written.
    fn abandoned(&self) -> bool {
        self.answer.is_closed()
    }
}

impl GroupedStore {
    /// The store over `client`. Spawns the writer task, so it must be
    /// called within a Tokio runtime; the task ends when the store is
    /// dropped (after the statement it has on its way, if any) or the
    /// connection closes.
    pub fn new(client: Arc<Client>) -> Self {
        Self::spawn(client, None)
    }

    /// [`GroupedStore::new`], its failing statements reported to `health`
    /// (readiness fails while they are retried).
    pub fn reporting_to(client: Arc<Client>, health: Arc<crate::health::Health>) -> Self {
        Self::spawn(client, Some(health))
    }

    fn spawn(client: Arc<Client>, health: Option<Arc<crate::health::Health>>) -> Self {
        // A new writer (a new session) has failed nothing yet.
        if let Some(h) = &health {
            h.set_dead_letters_failing(false);
        }
        let (queue, rows) = mpsc::unbounded_channel();
        let ended = Arc::new(OnceLock::new());
        tokio::spawn(write(Arc::clone(&client), rows, health, Arc::clone(&ended)));
        GroupedStore {
            client,
            queue,
            ended,
        }
    }
}

/// The error of a row the writer cannot take: it ended, for `why` (its
/// connection's error) when known (else it panicked: the log says why).
fn stopped(why: &OnceLock<String>) -> StoreError {
    StoreError::Lost(match why.get() {
        Some(why) => format!("the dead-letter writer has stopped: {why}"),
        None => "the dead-letter writer has stopped".into(),
    })
}

impl DeadLetterStore for GroupedStore {
    /// Queues `row` now; the future gives its [`Written`] once the statement holding
    /// it has committed, or [`StoreError::Lost`] when the connection is
    /// gone. A statement that fails otherwise is retried by the writer
    /// (logged at ERROR), so the future waits meanwhile. Dropping the future
    /// takes the row back only until the writer has taken it.
    fn write(
        &self,
        row: &NewDeadLetter,
        urgency: Urgency,
    ) -> impl Future<Output = Result<Written, StoreError>> + Send + 'static {
        let (answer, id) = oneshot::channel();
        let queued = self.queue.send(Row {
            row: Stored::of(row),
            urgency,
            answer,
        });
        let ended = Arc::clone(&self.ended);
        async move {
            queued.map_err(|_| stopped(&ended))?;
            id.await.map_err(|_| stopped(&ended))?
        }
    }

    async fn parked(
        &self,
        endpoint: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<ParkedRow>, StoreError> {
        store::parked(&self.client, endpoint, after, limit).await
    }

    async fn replayed(&self, ids: &[i64], why: &'static str) -> Result<(), StoreError> {
        store::replayed(&self.client, ids, why).await
    }

    async fn refused(&self, id: i64, row: &NewDeadLetter) -> Result<(), StoreError> {
        store::refused(&self.client, id, row).await
    }

    async fn resume_lock(&self, endpoint: &str, take: bool) -> Result<bool, StoreError> {
        store::resume_lock(&self.client, endpoint, take).await
    }
}

/// The writer: one batch at a time, in queue order, until the store is
/// gone. The statement is prepared once (again after a failed
/// preparation), so a batch is one round trip. A failed statement is tried
/// again, after a pause, before anything behind it. When the connection
/// is lost, the writer ends and leaves its error in `ended`.
async fn write(
    client: Arc<Client>,
    mut queue: mpsc::UnboundedReceiver<Row>,
    health: Option<Arc<crate::health::Health>>,
    ended: Arc<OnceLock<String>>,
) {
    let failing = |on: bool| {
        if let Some(h) = &health {
            h.set_dead_letters_failing(on);
        }
    };
    // With the trace_context column and the unique index until the table
    // turns out not to have them (sql/orders.sql not applied since the
    // upgrade): then without, and the dead letters keep no trace context,
    // or are deduped against committed rows only.
    let mut shape = Shape::CURRENT;
    let mut sql = insert_statement(shape);
    let mut prepared: Option<Statement> = None;
    let mut next = None;
    loop {
        let first = match next.take() {
            Some(r) => r,
            None => match queue.recv().await {
                Some(r) => r,
                None => return,
            },
        };
        let (mut batch, over) = gather(first, &mut queue).await;
        next = over;
        let mut retry = RETRY_FIRST;
        loop {
            // A writer that went away wants nothing written; the others'
            // statement goes on without its row.
            batch.retain(|r| !r.abandoned());
            if batch.is_empty() {
                // Nothing waits on the failing statement any more.
                failing(false);
                break;
            }
            let rows: Vec<&Stored> = batch.iter().map(|r| &r.row).collect();
            let ids = match &prepared {
                Some(statement) => insert_rows(&client, statement, shape, &rows).await,
                None => match client.prepare(&sql).await {
                    Ok(statement) => {
                        let ids = insert_rows(&client, &statement, shape, &rows).await;
                        prepared = Some(statement);
                        ids
                    }
                    Err(e)
                        if shape.trace
                            && e.code()
                                == Some(&tokio_postgres::error::SqlState::UNDEFINED_COLUMN) =>
                    {
                        tracing::warn!(
                            "cdc_relay_dead_letter has no trace_context column: dead letters are written without their trace context until sql/orders.sql is applied (it adds the column) and the relay restarts"
                        );
                        shape.trace = false;
                        sql = insert_statement(shape);
                        continue;
                    }
                    Err(e) => Err(e),
                },
            };
            let ids = match ids {
                Ok(ids) => Ok(ids),
                // The planner finds the ON CONFLICT index, so its absence
                // shows when the statement runs, not when it is prepared.
                Err(e)
                    if shape.unique
                        && e.code()
                            == Some(&tokio_postgres::error::SqlState::INVALID_COLUMN_REFERENCE) =>
                {
                    tracing::warn!(
                        "cdc_relay_dead_letter has no unique index on (event_id, endpoint): two writers at once (a backfill beside run) may each write a dead letter for the same event until sql/orders.sql is applied (it builds the index) and the relay restarts"
                    );
                    shape.unique = false;
                    sql = insert_statement(shape);
                    prepared = None;
                    continue;
                }
                Err(e) => Err(StoreError::of(&client, &e).await),
            };
            match ids {
                Ok(ids) => {
                    failing(false);
                    answer(batch, Ok(ids));
                    break;
                }
                // The session ends with its connection.
                Err(StoreError::Lost(why)) => {
                    let _ = ended.set(why.clone());
                    answer(batch, Err(StoreError::Lost(why)));
                    return;
                }
                Err(e) => {
                    failing(true);
                    tracing::error!(error = %e, rows = batch.len(), retry_in_ms = retry.as_millis() as u64,
                        "cannot write dead-letter rows; trying again before any row behind them (their events stay pending)");
                    tokio::time::sleep(retry).await;
                    retry = (retry * 2).min(RETRY_CAP);
                }
            }
        }
    }
}

/// `first` and the rows queued behind it, within [`MAX_ROWS`] and
/// [`MAX_BYTES`]: those queued now, and, when `first` may wait
/// ([`Urgency::Gather`]), those queued within [`GATHER`] too. The row that
/// would pass the byte bound comes back to start the next batch.
async fn gather(first: Row, queue: &mut mpsc::UnboundedReceiver<Row>) -> (Vec<Row>, Option<Row>) {
    let until = (first.urgency == Urgency::Gather).then(|| tokio::time::Instant::now() + GATHER);
    let mut bytes = size(&first.row);
    let mut batch = vec![first];
    while batch.len() < MAX_ROWS {
        let r = match queue.try_recv() {
            Ok(r) => r,
            Err(_) => match until {
                Some(until) => match tokio::time::timeout_at(until, queue.recv()).await {
                    Ok(Some(r)) => r,
                    Ok(None) | Err(_) => break,
                },
                None => break,
            },
        };
        bytes += size(&r.row);
        if bytes > MAX_BYTES {
            return (batch, Some(r));
        }
        batch.push(r);
    }
    (batch, None)
}

/// Bytes of text and payload `row` carries.
fn size(row: &Stored) -> usize {
    let len = |v: &Option<String>| v.as_ref().map_or(0, String::len);
    len(&row.event_id)
        + len(&row.aggregate_key)
        + len(&row.event_type)
        + len(&row.payload)
        + row.payload_bytes.as_ref().map_or(0, Vec::len)
        + row.error.len()
        + len(&row.response_excerpt)
        + len(&row.endpoint)
}

/// Answers each writer of `batch`: its row, or the statement's error.
fn answer(batch: Vec<Row>, ids: Result<Vec<Written>, StoreError>) {
    // A send fails only when the writer went away meanwhile: its row is
    // committed (or not) all the same, and nobody is left to tell.
    match ids {
        Ok(ids) => {
            for (r, id) in batch.into_iter().zip(ids) {
                let _ = r.answer.send(Ok(id));
            }
        }
        Err(e) => {
            for r in batch {
                let _ = r.answer.send(Err(e.clone()));
            }
        }
    }
}
