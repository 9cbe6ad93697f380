//! Group commit for dead-letter inserts: rows written concurrently share
//! one statement and one commit.
//!
//! Every event of a parked endpoint becomes a dead-letter row, and up to
//! the endpoint's `max_in_flight` deliveries write theirs at once. One
//! autocommit statement each was one commit (one WAL flush) per event. So
//! [`GroupedStore`] queues the rows, and one writer task takes the first
//! queued row and whatever else is queued at that moment (at most
//! [`MAX_ROWS`] rows, [`MAX_BYTES`] of text and payload), inserts them in
//! one statement and answers each waiter with its row's id. A row somebody
//! waits for ([`DeadLetterStore::insert`]) is sent at once: nothing waits
//! for company, rows group only while a statement is on its way. A row
//! nobody waits for ([`GroupedStore::park`], the relay's parked rows) lets
//! the writer gather what comes within [`GATHER`] first: a parked endpoint
//! at 500 events/s is then tens of statements a second, not 500.
//!
//! **Order.** Rows get ids in queue order. Within a statement the rows are
//! inserted `ORDER BY` their position in the batch, and PostgreSQL
//! evaluates the `id` default (`nextval`) in the insert's projection, once
//! per row as the sorted rows arrive, so ids increase with the position.
//! Statements go one after another on one connection, so a later batch's
//! ids are greater. A writer that queues a row only after its previous one
//! was queued (a delivery does: an aggregate's next event starts only when
//! this one's row is queued, or committed when it waits) therefore sees its
//! ids increase — the order `docs/architecture.md#parking` relies on, and
//! what the system test
//! `dead_letters::concurrent_inserts_share_commits_and_keep_each_writers_order`
//! checks against a real server. A failed statement is retried by the
//! writer before anything queued behind it (its waiters are told, and
//! queue their rows again themselves). Reading the parked rows
//! ([`DeadLetterStore::parked`]) first waits until every row queued before
//! the read is committed, so a replay never misses a parked row.
//!
//! **Bounded.** Parked rows queued and not yet committed hold at most
//! [`PARKED_QUEUE_KIB`] of memory; a park beyond it waits, so a writer
//! that cannot write leaves the parked endpoint's events pending in the
//! memory window, which bounds them, as before parking was asynchronous.
//!
//! **Asynchronous commit.** The relay's store ([`GroupedStore::asynchronous`])
//! commits each statement with `synchronous_commit = off`, counts every row
//! before queueing it and counts a statement's rows once it committed; the
//! relay then confirms past a row only once the server has committed and
//! flushed it (`crate::durable`). `backfill`'s store ([`GroupedStore::new`])
//! commits synchronously and every row is waited for: it confirms nothing
//! to a slot, and prints a resume point that must not pass a row a server
//! crash could still lose.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio_postgres::{Client, Statement};

use super::store::{Commit, Stored, insert_rows, insert_statement};
use super::{DeadLetterStore, NewDeadLetter, ParkedRow, StoreError};
use crate::durable::{self, Durability, Flushes};

/// Most rows one statement inserts.
pub const MAX_ROWS: usize = 256;

/// Most bytes of text and payload one statement inserts (a single larger
/// row goes alone).
pub const MAX_BYTES: usize = 4 << 20;

/// How long the writer gathers rows nobody waits for before it inserts
/// them (from the first such row taken).
pub const GATHER: Duration = Duration::from_millis(10);

/// Most parked rows queued and not yet committed, in KiB of text and
/// payload (each row at least 1): a park beyond it waits for room. Parked
/// jobs no longer hold the memory window once queued, so a writer that
/// cannot write (a statement failing again and again) would otherwise
/// queue the parked endpoint's events in memory without bound; with it,
/// they wait in the window again, which then bounds them.
pub const PARKED_QUEUE_KIB: u32 = 16 * 1024;

/// The writer's first pause after a failed statement whose rows nobody
/// waits for; it doubles up to [`RETRY_CAP`].
const RETRY_FIRST: Duration = Duration::from_millis(100);

/// The writer's longest pause between two tries of a failed statement.
const RETRY_CAP: Duration = Duration::from_secs(10);

/// A [`DeadLetterStore`] over the side connection whose concurrent
/// inserts share one statement and one commit (see the module doc). Every
/// other method is the connection's own, except that reading the parked
/// rows first waits for the rows queued before.
pub struct GroupedStore {
    client: Arc<Client>,
    queue: mpsc::UnboundedSender<Queued>,
    /// With asynchronous commits: counts each row before it is queued.
    flushes: Option<Flushes>,
    /// Room for parked rows queued and not yet committed
    /// ([`PARKED_QUEUE_KIB`]).
    room: Arc<Semaphore>,
}

/// What the writer takes from the queue.
#[expect(
    clippy::large_enum_variant,
    reason = "rows are nearly every item; a barrier is one per read of the parked rows"
)]
enum Queued {
    /// A row, and where its id goes (`None`: nobody waits for it).
    Row(Row),
    /// Answered once every row queued before it is committed (or the
    /// writer has stopped: then dropped).
    Barrier(oneshot::Sender<()>),
}

/// A row for the writer.
struct Row {
    row: Stored,
    answer: Option<oneshot::Sender<Result<i64, StoreError>>>,
    /// A parked row's room in the queue, given back when the row is dropped
    /// (written, or abandoned with the store).
    _room: Option<OwnedSemaphorePermit>,
}

impl Row {
    /// Whoever waited for this row went away before it was written: it
    /// wants nothing written.
    fn abandoned(&self) -> bool {
        self.answer.as_ref().is_some_and(oneshot::Sender::is_closed)
    }
}

impl GroupedStore {
    /// The store over `client`, committing synchronously: a row is durable
    /// when its insert returns. Spawns the writer task, so it must be
    /// called within a Tokio runtime; the task ends when the store is
    /// dropped (after the statement it has on its way, if any).
    pub fn new(client: Arc<Client>) -> Self {
        let (queue, rows) = mpsc::unbounded_channel();
        tokio::spawn(write(Arc::clone(&client), rows, None));
        GroupedStore {
            client,
            queue,
            flushes: None,
            room: Arc::new(Semaphore::new(PARKED_QUEUE_KIB as usize)),
        }
    }

    /// The store over `client`, committing asynchronously (see the module
    /// doc): a row's insert returns before its commit is flushed, a parked
    /// row's [`GroupedStore::park`] before it is even written, and the
    /// returned [`Durability`] says which rows are committed and flushed.
    /// Whoever confirms past a row must wait for that
    /// (`crate::durable::FlushGate`). Spawns the writer and the flush
    /// poller; the writer ends with the store (rows still queued are then
    /// not written: nobody may count on them, the gate held them), the
    /// poller when `client` closes or the [`Durability`] handles are
    /// dropped.
    pub fn asynchronous(client: Arc<Client>) -> (Self, Durability) {
        let (queue, rows) = mpsc::unbounded_channel();
        let (flushes, durability, poller) = durable::follow(Arc::clone(&client));
        tokio::spawn(poller);
        tokio::spawn(write(Arc::clone(&client), rows, Some(flushes.clone())));
        (
            GroupedStore {
                client,
                queue,
                flushes: Some(flushes),
                room: Arc::new(Semaphore::new(PARKED_QUEUE_KIB as usize)),
            },
            durability,
        )
    }

    /// Queues `row` (counted first, with asynchronous commits).
    fn queue(&self, row: Row) -> Result<(), StoreError> {
        if let Some(f) = &self.flushes {
            f.promised();
        }
        self.queue.send(Queued::Row(row)).map_err(|_| stopped())
    }
}

fn stopped() -> StoreError {
    StoreError::Lost("the dead-letter writer has stopped".into())
}

impl DeadLetterStore for GroupedStore {
    /// Queues `row` and returns its id once the statement holding it has
    /// committed. Errors are the statement's, for every row in it
    /// ([`StoreError::Lost`] when the connection is closed). Dropping the
    /// future does not take the row back once the writer has taken it:
    /// it may be committed all the same.
    async fn insert(&self, row: &NewDeadLetter) -> Result<i64, StoreError> {
        let (answer, id) = oneshot::channel();
        self.queue(Row {
            row: Stored::of(row),
            answer: Some(answer),
            _room: None,
        })?;
        id.await.map_err(|_| stopped())?
    }

    /// With asynchronous commits, queues `row` and returns (`None`): the
    /// writer inserts it after every row queued before, retrying until it
    /// is committed or the store is gone, and the flush gate holds the
    /// confirmed position until it is committed and flushed. It waits
    /// first while [`PARKED_QUEUE_KIB`] of parked rows are queued and not
    /// committed. Otherwise [`DeadLetterStore::insert`].
    async fn park(&self, row: &NewDeadLetter) -> Result<Option<i64>, StoreError> {
        if self.flushes.is_some() {
            let row = Stored::of(row);
            let kib = u32::try_from(size(&row) / 1024)
                .unwrap_or(u32::MAX)
                .clamp(1, PARKED_QUEUE_KIB);
            let room = Arc::clone(&self.room)
                .acquire_many_owned(kib)
                .await
                .map_err(|_| stopped())?;
            self.queue(Row {
                row,
                answer: None,
                _room: Some(room),
            })?;
            Ok(None)
        } else {
            self.insert(row).await.map(Some)
        }
    }

    /// Waits until every row queued before the call is committed, then
    /// reads: a parked row queued earlier is among the rows read.
    async fn parked(
        &self,
        endpoint: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<ParkedRow>, StoreError> {
        let (done, written) = oneshot::channel();
        self.queue
            .send(Queued::Barrier(done))
            .map_err(|_| stopped())?;
        written.await.map_err(|_| stopped())?;
        self.client.parked(endpoint, after, limit).await
    }

    async fn replayed(&self, ids: &[i64]) -> Result<(), StoreError> {
        self.client.replayed(ids).await
    }

    async fn refused(&self, id: i64, row: &NewDeadLetter) -> Result<(), StoreError> {
        self.client.refused(id, row).await
    }

    async fn resume_lock(&self, endpoint: &str, take: bool) -> Result<bool, StoreError> {
        self.client.resume_lock(endpoint, take).await
    }
}

/// The writer: one batch at a time, in queue order, until the store is
/// gone. With `flushes`, each statement commits asynchronously and its rows
/// are counted there before its waiters are answered. The statement is
/// prepared once (again after a failed preparation), so a batch is one
/// round trip. A failed statement's waiters get its error (and queue their
/// rows again); its other rows are tried again, after a pause, before
/// anything behind them.
async fn write(
    client: Arc<Client>,
    mut queue: mpsc::UnboundedReceiver<Queued>,
    flushes: Option<Flushes>,
) {
    let commit = if flushes.is_some() {
        Commit::Asynchronous
    } else {
        Commit::Synchronous
    };
    let sql = insert_statement(commit);
    let mut prepared: Option<Statement> = None;
    let mut next = None;
    loop {
        let first = match next.take() {
            Some(q) => q,
            None => match queue.recv().await {
                Some(q) => q,
                None => return,
            },
        };
        // The store is gone: the session has ended, nobody waits for a row
        // (a waiter holds the store), and nothing counts on the rest.
        if queue.is_closed() {
            return;
        }
        let first = match first {
            Queued::Row(r) => r,
            // Every row queued before it is committed: batches go in order.
            Queued::Barrier(done) => {
                let _ = done.send(());
                continue;
            }
        };
        let (mut batch, over) = gather(first, &mut queue).await;
        next = over;
        let taken = batch.len() as u64;
        // A waiter that went away before its row was taken wants nothing
        // written; the others' statement goes on without it.
        batch.retain(|r| !r.abandoned());
        let mut retry = RETRY_FIRST;
        loop {
            if batch.is_empty() {
                if let Some(f) = &flushes {
                    f.committed(taken);
                }
                break;
            }
            let rows: Vec<&Stored> = batch.iter().map(|r| &r.row).collect();
            let ids = match &prepared {
                Some(statement) => insert_rows(&client, statement, &rows).await,
                None => match client.prepare(&sql).await {
                    Ok(statement) => {
                        let ids = insert_rows(&client, &statement, &rows).await;
                        prepared = Some(statement);
                        ids
                    }
                    Err(e) => Err(e),
                },
            }
            .map_err(|e| StoreError::of(&client, &e));
            match ids {
                Ok(ids) => {
                    if let Some(f) = &flushes {
                        f.committed(taken);
                    }
                    answer(batch, Ok(ids));
                    break;
                }
                // The session ends with its connection; rows nobody waited
                // for were never confirmed past.
                Err(e @ StoreError::Lost(_)) => {
                    answer(batch, Err(e));
                    return;
                }
                Err(e) => {
                    // The waiters retry themselves; the writer retries the
                    // rest, before anything queued behind them.
                    let (waited, rest): (Vec<Row>, Vec<Row>) =
                        batch.into_iter().partition(|r| r.answer.is_some());
                    answer(waited, Err(e.clone()));
                    batch = rest;
                    if batch.is_empty() {
                        continue;
                    }
                    tracing::error!(error = %e, rows = batch.len(), retry_in_ms = retry.as_millis() as u64,
                        "cannot write parked dead-letter rows; trying again before any row behind them (the confirmed position waits)");
                    tokio::time::sleep(retry).await;
                    retry = (retry * 2).min(RETRY_CAP);
                    // The store is gone: the session has ended, and
                    // nothing counts on these rows.
                    if queue.is_closed() {
                        return;
                    }
                }
            }
        }
    }
}

/// `first` and the rows queued behind it, within [`MAX_ROWS`] and
/// [`MAX_BYTES`]: those queued now, and, when nobody waits for `first`,
/// those queued within [`GATHER`] too. A barrier, or the row that would
/// pass the byte bound, comes back to start the next batch.
async fn gather(
    first: Row,
    queue: &mut mpsc::UnboundedReceiver<Queued>,
) -> (Vec<Row>, Option<Queued>) {
    let until = first
        .answer
        .is_none()
        .then(|| tokio::time::Instant::now() + GATHER);
    let mut bytes = size(&first.row);
    let mut batch = vec![first];
    while batch.len() < MAX_ROWS {
        let q = match queue.try_recv() {
            Ok(q) => q,
            Err(_) => match until {
                Some(until) => match tokio::time::timeout_at(until, queue.recv()).await {
                    Ok(Some(q)) => q,
                    Ok(None) | Err(_) => break,
                },
                None => break,
            },
        };
        let Queued::Row(r) = q else {
            return (batch, Some(q));
        };
        bytes += size(&r.row);
        if bytes > MAX_BYTES {
            return (batch, Some(Queued::Row(r)));
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

/// Answers each waiter of `batch`: its id, or the statement's error.
fn answer(batch: Vec<Row>, ids: Result<Vec<i64>, StoreError>) {
    // A send fails only when the waiter went away meanwhile: its row is
    // committed (or not) all the same, and nobody is left to tell.
    match ids {
        Ok(ids) => {
            for (r, id) in batch.into_iter().zip(ids) {
                if let Some(a) = r.answer {
                    let _ = a.send(Ok(id));
                }
            }
        }
        Err(e) => {
            for a in batch.into_iter().filter_map(|r| r.answer) {
                let _ = a.send(Err(e.clone()));
            }
        }
    }
}
