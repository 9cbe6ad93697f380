//! The reader of one session's replication stream.
//!
//! ```text
//!  Transport::recv ─▶ Begin/Commit/Keepalive ──────────────────────────────▶ Item
//!                 └▶ XLogData ─decode─▶ Relation ─▶ OutboxMapper (identity by OID)
//!                                    └▶ Insert ─map─▶ admit (window) ─▶ Item::Event
//!                                    └▶ other changes ─▶ cdc_relay_ignored_changes_total
//!  confirmed LSN (watch, from dispatch) ─▶ Transport::confirm ─▶ standby status update
//!  ceiling (watch, from the slot monitor) ─▶ Transport::hold_at
//! ```
//!
//! Every change the server streams for a relation that is (or was, in this
//! session) the outbox is delivered, dead-lettered, or stops the session
//! before its transaction is acknowledged; changes to other relations are
//! counted and logged once per relation.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pgwire_replication::ReplicationEvent;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::catalog;
use super::error::SourceError;
use super::ignored::IgnoredChanges;
use super::skew::SkewWatch;
use super::status_updates::{self, StatusUpdateCounter};
use super::transport::Transport;
use super::watchdog::Watchdog;
use crate::clock;
use crate::dispatch::{Confirmed, DispatchError, Item, Window, WindowPermit};
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::outbox::{Mapped, OutboxError, OutboxMapper, RelationKind, TxContext};
use crate::pgoutput::{self, DecodeError, LogicalMessage, Relation, RelationId};

/// Why a session's stream ended with an error.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The source failed (see [`SourceError`] for definite vs transient).
    #[error(transparent)]
    Source(#[from] SourceError),
    /// The stream held a message the relay cannot decode; nothing after it
    /// was acknowledged.
    #[error("cannot decode the replication stream: {0}")]
    Decode(#[from] DecodeError),
    /// An outbox change cannot be mapped (the table lost a configured
    /// column, its payload is no longer JSON, it was renamed away from
    /// `--table`); nothing from it on was acknowledged.
    #[error("cannot map an outbox change: {0}")]
    Outbox(#[from] OutboxError),
}

/// One session's stream, from `START_REPLICATION` to CopyDone.
pub struct Stream {
    transport: Transport,
    slot: String,
    /// The dispatcher's confirmed LSN.
    confirmed: watch::Receiver<Confirmed<Lsn>>,
    /// The slot monitor's limit on the confirmed LSN.
    ceiling: Ceiling,
    items: mpsc::Sender<Item<Lsn>>,
    window: Window,
    mapper: OutboxMapper,
    /// The open transaction, between Begin and Commit.
    tx: Option<TxContext>,
    /// Asked which table a name means when the outbox shows up under
    /// another name.
    side: Arc<tokio_postgres::Client>,
    /// Completes when the side connection closes. A fast shutdown of
    /// PostgreSQL closes it first and then waits for every walsender to have
    /// its WAL confirmed: a relay that cannot deliver (its sink may live on
    /// the same server) must let go of the stream instead of holding the
    /// server's shutdown hostage. Also, dead letters need this connection.
    side_closed: oneshot::Receiver<()>,
    watchdog: Watchdog,
    /// The server's clock against ours, from every message's send time.
    skew: SkewWatch,
    ignored: IgnoredChanges,
    /// Copies the transport's status-update counters into metrics until
    /// the session ends.
    _status_updates: AbortOnDropHandle<()>,
}

/// The slot monitor's limit on the confirmed LSN, followed.
///
/// The monitor ends with the side connection, whose own branch ends the
/// session. Until that branch runs, a closed channel must not be ready:
/// the reader's `select!`s are `biased`, and a `changed()` that fails at
/// once on every turn would spin ahead of that branch for good (a
/// session that never ended after the side connection closed).
struct Ceiling {
    rx: watch::Receiver<Option<Lsn>>,
    open: bool,
}

impl Ceiling {
    fn new(rx: watch::Receiver<Option<Lsn>>) -> Self {
        Ceiling { rx, open: true }
    }

    /// The next ceiling the monitor sets; never completes once the
    /// monitor has ended.
    async fn changed(&mut self) -> Option<Lsn> {
        if self.open {
            if self.rx.changed().await.is_ok() {
                return *self.rx.borrow_and_update();
            }
            self.open = false;
        }
        std::future::pending().await
    }
}

/// What the reader needs besides the transport.
pub struct StreamParts {
    /// The dispatcher's confirmed LSN.
    pub confirmed: watch::Receiver<Confirmed<Lsn>>,
    /// The slot monitor's limit on the confirmed LSN.
    pub ceiling: watch::Receiver<Option<Lsn>>,
    /// Where items go, in stream order.
    pub items: mpsc::Sender<Item<Lsn>>,
    /// The memory window events are admitted to.
    pub window: Window,
    /// Maps inserts to outbox events.
    pub mapper: OutboxMapper,
    /// The side connection.
    pub side: Arc<tokio_postgres::Client>,
    /// Completes when the side connection closes.
    pub side_closed: oneshot::Receiver<()>,
    /// The slot streamed (for error messages).
    pub slot: String,
    /// Watches for a silent stream (and tells `/readyz`).
    pub watchdog: Watchdog,
    /// Metrics.
    pub metrics: Metrics,
}

impl Stream {
    /// Wraps an opened transport.
    pub fn new(transport: Transport, parts: StreamParts) -> Self {
        let counter = StatusUpdateCounter::new(transport.counters(), parts.metrics.clone());
        let counting = tokio::spawn(status_updates::count(counter));
        Stream {
            transport,
            slot: parts.slot,
            confirmed: parts.confirmed,
            ceiling: Ceiling::new(parts.ceiling),
            items: parts.items,
            window: parts.window,
            mapper: parts.mapper,
            tx: None,
            side: parts.side,
            side_closed: parts.side_closed,
            watchdog: parts.watchdog,
            skew: SkewWatch::new(parts.metrics.clock_skew.clone()),
            ignored: IgnoredChanges::new(parts.metrics),
            _status_updates: AbortOnDropHandle::new(counting),
        }
    }

    /// Reads until a shutdown request at a transaction boundary (or the
    /// shutdown deadline, `budget` after the request) and returns the
    /// deadline for draining.
    pub async fn read_until_stopped(
        &mut self,
        shutdown: &CancellationToken,
        budget: Duration,
    ) -> Result<Instant, StreamError> {
        let mut deadline: Option<Instant> = None;
        // One timer for the watchdog's check, moved as its due time moves
        // (later: an atomic store, not a timer registered and dropped per
        // message).
        let check = tokio::time::sleep_until(self.watchdog.deadline());
        tokio::pin!(check);
        loop {
            if let Some(d) = deadline
                && (self.tx.is_none() || Instant::now() >= d)
            {
                return Ok(d);
            }
            let due = self.watchdog.deadline();
            if check.deadline() != due {
                check.as_mut().reset(due);
            }
            tokio::select! {
                biased;
                r = self.confirmed.changed() => self.forward_ack(r)?,
                c = self.ceiling.changed() => self.transport.hold_at(c),
                _ = shutdown.cancelled(), if deadline.is_none() => {
                    tracing::info!(in_transaction = self.tx.is_some(), "shutdown requested: stop reading at the next transaction boundary");
                    deadline = Some(Instant::now() + budget);
                }
                () = until(deadline) => {}
                () = &mut check => self.watchdog.check().await?,
                _ = &mut self.side_closed => return Err(side_lost().into()),
                ev = self.transport.recv() => {
                    self.watchdog.heard();
                    let ev = ev.map_err(|e| self.explain(SourceError::transport(&e, &self.slot)))?;
                    let ev = ev.ok_or_else(|| SourceError::Transient("the server ended the replication stream".into()))?;
                    self.handle(ev, deadline).await?;
                }
            }
        }
    }

    /// Adds where the stream stood to an error that stops it for good on a
    /// row the server cannot send.
    fn explain(&self, e: SourceError) -> SourceError {
        let SourceError::Unconvertible(msg) = e else {
            return e;
        };
        let confirmed = self.confirmed.borrow().position;
        let at = self.tx.and_then(|t| t.commit_lsn).map_or_else(
            || format!("the first transaction after {confirmed}"),
            |l| format!("the transaction committed at {l}"),
        );
        SourceError::Unconvertible(format!(
            "the server cannot send a row of {at} as UTF-8: {msg}. The database's server_encoding is not UTF8 \
             and the row holds bytes that are not valid UTF-8; the stream cannot pass that transaction and \
             nothing from it on was acknowledged. To go on: fix the row in {table} (e.g. find it with \
             `SELECT id FROM {table} WHERE payload::text !~ '^[[:ascii:]]*$'`), then, with \
             the relay stopped, move the slot past that transaction (`SELECT pg_replication_slot_advance('{slot}', \
             '<its end LSN>')`) and re-send it with `cdc-relay backfill --since <its commit time>`",
            table = self.mapper.table(),
            slot = self.slot,
        ))
    }

    fn forward_ack(
        &mut self,
        changed: Result<(), watch::error::RecvError>,
    ) -> Result<(), SourceError> {
        changed.map_err(|_| pipeline_stopped())?;
        let lsn = self.confirmed.borrow_and_update().position;
        self.transport.confirm(lsn);
        Ok(())
    }

    async fn handle(
        &mut self,
        ev: ReplicationEvent,
        deadline: Option<Instant>,
    ) -> Result<(), StreamError> {
        match ev {
            ReplicationEvent::KeepAlive {
                wal_end,
                server_time_micros,
                ..
            } => {
                self.skew.observe(server_time_micros);
                self.send(Item::Keepalive {
                    wal_end: wal_end.into(),
                })
                .await?;
            }
            ReplicationEvent::Begin {
                final_lsn,
                commit_time_micros,
                ..
            } => {
                self.tx = Some(TxContext {
                    commit_lsn: Some(final_lsn.into()),
                    commit_time_micros,
                });
                self.send(Item::Begin).await?;
            }
            ReplicationEvent::Commit {
                end_lsn,
                commit_time_micros,
                ..
            } => {
                self.tx = None;
                self.send(Item::Commit {
                    end: end_lsn.into(),
                    commit_time_micros,
                })
                .await?;
            }
            ReplicationEvent::XLogData {
                data,
                server_time_micros,
                ..
            } => {
                self.skew.observe(server_time_micros);
                self.change(data, deadline).await?
            }
            // Logical decoding messages are never posted; their transaction
            // still advances the watermark through its Commit.
            ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }

    async fn change(&mut self, data: Bytes, deadline: Option<Instant>) -> Result<(), StreamError> {
        match pgoutput::decode(data)? {
            LogicalMessage::Relation(rel) => {
                let kind = self.mapper.on_relation(&rel);
                for (configured, now) in self.mapper.followed_renames(rel.oid) {
                    tracing::warn!(
                        relation = %format!("{}.{}", rel.namespace, rel.name),
                        column = %configured, named = %now,
                        "the outbox's column {configured:?} is named {now:?} here (renamed; same position and type): following it"
                    );
                }
                self.relation(kind, &rel).await?;
                if !self.mapper.lacking(rel.oid).is_empty() {
                    self.past_shape(&rel).await?;
                }
            }
            LogicalMessage::Insert(ins) => {
                let tx = self.tx.ok_or_else(|| {
                    SourceError::Definite("insert outside a transaction in the stream".into())
                })?;
                match self.mapper.on_insert(&ins, tx)? {
                    Mapped::Event(event) => {
                        let permit = self.admit(event.size_bytes(), deadline).await?;
                        self.send(Item::Event(event, permit)).await?;
                    }
                    Mapped::Unreadable(row) => {
                        tracing::warn!(commit_lsn = %crate::shown(&tx.commit_lsn), problem = %row.problem, "unreadable outbox row: dead-lettering it");
                        let permit = self.admit(row.size_bytes(), deadline).await?;
                        self.send(Item::Unreadable(Box::new(row), permit)).await?;
                    }
                    Mapped::OtherTable => self.ignore(ins.relation, "insert"),
                }
            }
            LogicalMessage::Update(u) => self.ignore(u.relation, "update"),
            LogicalMessage::Delete(d) => self.ignore(d.relation, "delete"),
            LogicalMessage::Truncate(t) => {
                for r in &t.relations {
                    self.ignore(*r, "truncate");
                }
            }
            // Types and origins describe, they change nothing.
            _ => {}
        }
        Ok(())
    }

    /// What a Relation message means for the outbox. A name change of a
    /// relation that is (or was) the outbox is checked against the catalog:
    /// an older name in the WAL is fine; a rename away from `--table` stops
    /// the session before anything of it is acknowledged.
    async fn relation(&mut self, kind: RelationKind, rel: &Relation) -> Result<(), StreamError> {
        let table = self.mapper.table().to_string();
        match kind {
            RelationKind::Outbox => Ok(()),
            // Another table, or a partition of the outbox streamed under
            // its own name. The relay reads a partitioned outbox only
            // through its root (`publish_via_partition_root`), where the
            // server decides with the catalog of each change's time which
            // rows were the outbox's; a publication without it does not
            // carry the outbox (the membership check says so and holds the
            // slot). Rows streamed that way (written while it was off, or
            // before an upgrade) may be events: a relation that is a
            // partition of the outbox now is set aside, its rows
            // dead-lettered, never sent and never dropped.
            RelationKind::Other => {
                let root = catalog::partition_root(&self.side, rel.oid.0).await?;
                if root.is_some_and(|r| r != rel.oid.0 && self.mapper.is_outbox(RelationId(r))) {
                    let partition = format!("{}.{}", rel.namespace, rel.name);
                    if !self.mapper.is_aside(rel.oid) {
                        tracing::warn!(table = %table, partition = %partition, "{partition}, a partition of {table}, streams under its own name: these rows were written while the publication did not publish via the partition root. Whether each was an outbox row then cannot be told, so each is dead-lettered, not sent: check them (cdc-relay dead-letter list --reason 'partition root') and replay or discard them");
                    }
                    self.mapper.set_aside(
                        rel,
                        format!("streamed under the name of {partition} (a partition of {table} now), not through the root: written while the publication did not publish via the partition root; replay it if it is an event"),
                    );
                }
                Ok(())
            }
            RelationKind::NewOutbox { oid } => {
                tracing::warn!(table = %table, oid, "{table} is a new relation (OID {oid}): dropped and recreated, or swapped; its inserts are delivered");
                Ok(())
            }
            RelationKind::OutboxUnderOtherName { oid, name } => {
                match catalog::table_oid(&self.side, self.mapper.table()).await? {
                    Some(now) if now == oid => {
                        tracing::info!(table = %table, oid, older_name = %name, "the WAL names the outbox by an older name");
                        Ok(())
                    }
                    // Another table took the configured name (a swap): both
                    // are followed, so nothing written to either is lost.
                    Some(now) => {
                        tracing::warn!(table = %table, oid, now_named = %name, new_oid = now, "the outbox was swapped: {table} is another relation now (OID {now}); the former one, now {name} (OID {oid}), stays followed and its inserts are delivered too. Stop writing to it (or drop it) when the migration is done");
                        Ok(())
                    }
                    None => {
                        let now = catalog::relation_name(&self.side, oid)
                            .await?
                            .map_or(name, |(now, _)| now);
                        tracing::error!(table = %table, oid, renamed_to = %now, "the outbox was renamed; stopping before acknowledging its changes");
                        Err(OutboxError::Renamed { table, oid, now }.into())
                    }
                }
            }
        }
    }

    /// A description of the outbox that lacks configured columns: the past
    /// when the table has them all now (`docs/architecture.md`, "lacks a
    /// configured column"; [`OutboxMapper::accept_past_shape`]).
    async fn past_shape(&mut self, rel: &Relation) -> Result<(), StreamError> {
        let table = self.mapper.table().clone();
        let now = match catalog::check_outbox_table(&self.side, &table, self.mapper.columns()).await
        {
            Ok(now) => now,
            // The table lacks them now: an insert of this description
            // stops the stream.
            Err(SourceError::NeedsSetup(_) | SourceError::PayloadType(_)) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        // The outbox, or a former outbox dropped since; never a relation
        // that still exists under another name.
        let ours = now.oid == rel.oid.0
            || catalog::relation_name(&self.side, rel.oid.0)
                .await?
                .is_none();
        if ours {
            let missing = self.mapper.lacking(rel.oid).join(", ");
            tracing::warn!(table = %table, missing = %missing, "the WAL describes {table} without column(s) {missing}, which it has now (dropped, then added back): rows committed in between cannot become events and are dead-lettered with the columns they have");
            self.mapper.accept_past_shape(rel.oid);
        }
        Ok(())
    }

    fn ignore(&mut self, relation: RelationId, kind: &'static str) {
        let name = self
            .mapper
            .relation_name(relation)
            .unwrap_or("unknown")
            .to_owned();
        let outbox = self.mapper.is_outbox(relation);
        self.ignored.count(relation, &name, kind, outbox);
    }

    /// Waits for room in the window, forwarding acks meanwhile.
    async fn admit(
        &mut self,
        size: usize,
        deadline: Option<Instant>,
    ) -> Result<WindowPermit, SourceError> {
        let window = self.window.clone();
        let admitted = window.admit(size);
        tokio::pin!(admitted);
        loop {
            tokio::select! {
                biased;
                r = self.confirmed.changed() => self.forward_ack(r)?,
                c = self.ceiling.changed() => self.transport.hold_at(c),
                p = &mut admitted => return Ok(p),
                _ = &mut self.side_closed => return Err(side_lost()),
                () = until(deadline) => {
                    return Err(SourceError::Transient("shutdown budget spent inside a transaction".into()));
                }
            }
        }
    }

    async fn send(&mut self, item: Item<Lsn>) -> Result<(), SourceError> {
        self.items.send(item).await.map_err(|_| pipeline_stopped())
    }

    /// The flush position last handed to the server.
    pub fn sent(&self) -> Lsn {
        self.transport.sent()
    }

    /// The commit time (UTC, RFC 3339) of the last transaction with events
    /// the pipeline fully delivered in this session, if any.
    pub fn last_done_commit(&self) -> Option<String> {
        let done = self.confirmed.borrow().last_done.clone()?;
        let unix_micros = done
            .commit_time_micros
            .checked_add(clock::PG_EPOCH_UNIX_MICROS)?;
        let at = std::time::UNIX_EPOCH + Duration::from_micros(u64::try_from(unix_micros).ok()?);
        Some(humantime::format_rfc3339_micros(at).to_string())
    }

    /// Ends the stream without a final update (the session failed; the
    /// confirmed LSN covers only what was done).
    pub fn abort(&mut self) {
        self.transport.abort();
    }

    /// After reading stopped: tells the dispatcher no more items come,
    /// waits (until `deadline`) for it to finish what it holds while
    /// forwarding its acks, then sends the final confirmed LSN and closes
    /// the stream with CopyDone.
    pub async fn drain_and_close(
        self,
        mut dispatcher: AbortOnDropHandle<Result<Lsn, DispatchError>>,
        deadline: Instant,
    ) {
        let Stream {
            mut transport,
            mut confirmed,
            items,
            _status_updates,
            ..
        } = self;
        drop(items); // the dispatcher finishes once it has done what it holds
        let drained = loop {
            tokio::select! {
                r = &mut dispatcher => break r.ok().and_then(Result::ok),
                r = confirmed.changed() => match r {
                    Ok(()) => transport.confirm(confirmed.borrow_and_update().position),
                    // The dispatcher ended (it drops its sender): its result comes next.
                    Err(_) => {
                        break tokio::time::timeout_at(deadline, &mut dispatcher)
                            .await
                            .ok()
                            .and_then(Result::ok)
                            .and_then(Result::ok);
                    }
                },
                _ = tokio::time::sleep_until(deadline) => break None,
            }
        };
        let last = confirmed.borrow().position;
        let final_lsn = drained.unwrap_or(last).max(last);
        if drained.is_none() {
            tracing::warn!(confirmed = %final_lsn, "shutdown budget spent with deliveries pending; they will be redelivered after restart");
        }
        transport.flush_and_close(final_lsn).await;
    }
}

/// Sleeps until `deadline`, or forever without one. Nothing is made
/// until it is first polled: a `select!` branch that makes it every round
/// costs nothing when there is no deadline.
async fn until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn side_lost() -> SourceError {
    SourceError::Transient(
        "the side connection closed (server shutting down or restarting?)".into(),
    )
}

fn pipeline_stopped() -> SourceError {
    SourceError::Transient("delivery pipeline stopped".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_ceiling_whose_monitor_ended_waits_instead_of_failing_on_every_turn() {
        let (tx, rx) = watch::channel(None);
        let mut ceiling = Ceiling::new(rx);
        tx.send(Some(Lsn::new(0x10))).unwrap();
        assert_eq!(ceiling.changed().await, Some(Lsn::new(0x10)));
        drop(tx);
        for _ in 0..2 {
            assert!(
                tokio::time::timeout(Duration::from_millis(20), ceiling.changed())
                    .await
                    .is_err(),
                "a closed ceiling must stay pending"
            );
        }
    }
}
