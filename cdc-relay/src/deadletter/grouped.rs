//! Group commit for dead-letter inserts: rows written concurrently share
//! one statement and one commit.
//!
//! Every event of a parked endpoint becomes a dead-letter row, and up to
//! the endpoint's `max_in_flight` deliveries write theirs at once. One
//! autocommit statement each was one commit (one WAL flush) per event. So
//! [`GroupedStore`] queues the rows, and one writer task takes the first
//! queued row and whatever else is queued at that moment (at most
//! [`MAX_ROWS`] rows, [`MAX_BYTES`] of text and payload), inserts them in
//! one statement and answers each waiter with its row's id. A lone row is
//! sent at once: nothing waits for company (no timer), rows group only
//! while a statement is on its way, so batches grow with the load.
//!
//! **Order.** Rows get ids in queue order. Within a statement the rows are
//! inserted `ORDER BY` their position in the batch, and PostgreSQL
//! evaluates the `id` default (`nextval`) in the insert's projection, once
//! per row as the sorted rows arrive, so ids increase with the position.
//! Statements go one after another on one connection, so a later batch's
//! ids are greater. A writer that awaits each insert before queueing the
//! next (a delivery does: an aggregate's next event starts only when this
//! one's row is committed) therefore sees its ids increase — the order
//! `docs/architecture.md#parking` relies on, and what the system test
//! `dead_letters::concurrent_inserts_share_commits_and_keep_each_writers_order`
//! checks against a real server.
//!
//! **Asynchronous commit.** The relay's store ([`GroupedStore::asynchronous`])
//! commits each statement with `synchronous_commit = off` and counts the
//! commit before answering; the relay then confirms past a row only once
//! the server has flushed it (`crate::durable`). `backfill`'s store
//! ([`GroupedStore::new`]) commits synchronously: it confirms nothing to a
//! slot, and prints a resume point that must not pass a row a server crash
//! could still lose.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tokio_postgres::{Client, Statement};

use super::store::{Commit, Stored, insert_rows, insert_statement};
use super::{DeadLetterStore, NewDeadLetter, ParkedRow, StoreError};
use crate::durable::{self, Durability, Flushes};

/// Most rows one statement inserts.
pub const MAX_ROWS: usize = 256;

/// Most bytes of text and payload one statement inserts (a single larger
/// row goes alone).
pub const MAX_BYTES: usize = 4 << 20;

/// A [`DeadLetterStore`] over the side connection whose concurrent
/// inserts share one statement and one commit (see the module doc). Every
/// other method is the connection's own.
pub struct GroupedStore {
    client: Arc<Client>,
    queue: mpsc::UnboundedSender<Queued>,
}

/// A row waiting for the writer, and where its id goes.
struct Queued {
    row: Stored,
    answer: oneshot::Sender<Result<i64, StoreError>>,
}

impl GroupedStore {
    /// The store over `client`, committing synchronously: a row is durable
    /// when its insert returns. Spawns the writer task, so it must be
    /// called within a Tokio runtime; the task ends when the store is
    /// dropped (after the statement it has on its way, if any).
    pub fn new(client: Arc<Client>) -> Self {
        let (queue, rows) = mpsc::unbounded_channel();
        tokio::spawn(write(Arc::clone(&client), rows, None));
        GroupedStore { client, queue }
    }

    /// The store over `client`, committing asynchronously (see the module
    /// doc): a row's insert returns before its commit is flushed, and the
    /// returned [`Durability`] says which commits are. Whoever confirms
    /// past a row must wait for its flush (`crate::durable::FlushGate`).
    /// Spawns the writer and the flush poller; the poller ends when
    /// `client` closes or the [`Durability`] handles are dropped.
    pub fn asynchronous(client: Arc<Client>) -> (Self, Durability) {
        let (queue, rows) = mpsc::unbounded_channel();
        let (flushes, durability, poller) = durable::follow(Arc::clone(&client));
        tokio::spawn(poller);
        tokio::spawn(write(Arc::clone(&client), rows, Some(flushes)));
        (GroupedStore { client, queue }, durability)
    }
}

impl DeadLetterStore for GroupedStore {
    /// Queues `row` and returns its id once the statement holding it has
    /// committed. Errors are the statement's, for every row in it
    /// ([`StoreError::Lost`] when the connection is closed). Dropping the
    /// future does not take the row back once the writer has taken it:
    /// it may be committed all the same.
    async fn insert(&self, row: &NewDeadLetter) -> Result<i64, StoreError> {
        let (answer, id) = oneshot::channel();
        let queued = Queued {
            row: Stored::of(row),
            answer,
        };
        let stopped = || StoreError::Lost("the dead-letter writer has stopped".into());
        self.queue.send(queued).map_err(|_| stopped())?;
        id.await.map_err(|_| stopped())?
    }

    async fn parked(
        &self,
        endpoint: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<ParkedRow>, StoreError> {
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

/// The writer: one batch at a time, until every sender (the store) is gone.
/// With `flushes`, each statement commits asynchronously and is counted
/// there before its waiters are answered. The statement is prepared once
/// (again after a failed preparation), so a batch is one round trip.
async fn write(
    client: Arc<Client>,
    mut rows: mpsc::UnboundedReceiver<Queued>,
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
            None => match rows.recv().await {
                Some(q) => q,
                None => return,
            },
        };
        let (mut batch, over) = gather(first, &mut rows);
        next = over;
        // A waiter that went away before its row was taken wants nothing
        // written; the others' statement goes on without it.
        batch.retain(|q| !q.answer.is_closed());
        if batch.is_empty() {
            continue;
        }
        let rows: Vec<&Stored> = batch.iter().map(|q| &q.row).collect();
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
        if let (Ok(_), Some(f)) = (&ids, &flushes) {
            f.committed();
        }
        answer(batch, ids);
    }
}

/// `first` and the rows queued behind it now, within [`MAX_ROWS`] and
/// [`MAX_BYTES`]; the row that would pass the byte bound starts the next
/// batch.
fn gather(
    first: Queued,
    rows: &mut mpsc::UnboundedReceiver<Queued>,
) -> (Vec<Queued>, Option<Queued>) {
    let mut bytes = size(&first.row);
    let mut batch = vec![first];
    while batch.len() < MAX_ROWS {
        let Ok(q) = rows.try_recv() else {
            break;
        };
        bytes += size(&q.row);
        if bytes > MAX_BYTES {
            return (batch, Some(q));
        }
        batch.push(q);
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
fn answer(batch: Vec<Queued>, ids: Result<Vec<i64>, StoreError>) {
    // A send fails only when the waiter went away meanwhile: its row is
    // committed (or not) all the same, and nobody is left to tell.
    match ids {
        Ok(ids) => {
            for (q, id) in batch.into_iter().zip(ids) {
                let _ = q.answer.send(Ok(id));
            }
        }
        Err(e) => {
            for q in batch {
                let _ = q.answer.send(Err(e.clone()));
            }
        }
    }
}
