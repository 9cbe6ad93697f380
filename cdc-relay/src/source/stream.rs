//! The replication stream of one session and its reader.
//!
//! ```text
//!  START_REPLICATION (0/0) ─▶ recv ─▶ Begin/Commit/Keepalive ───────────────▶ Item
//!                                 └▶ XLogData ─decode─▶ Relation ─▶ OutboxMapper
//!                                                    └▶ Insert ─map─▶ admit (window) ─▶ Item::Event
//!  confirmed LSN (watch, from dispatch) ─▶ Stream::confirm ─▶ standby status update
//! ```
//!
//! The transport is `pgwire-replication` (pinned exactly): it speaks the
//! streaming replication protocol, answers keepalives and sends standby
//! status updates on its own timer, even while the reader waits for room in
//! the window. Decoding pgoutput and deciding what to confirm are ours, and
//! [`Stream::confirm`] is the only place that hands the transport a flush
//! position.
//!
//! Facts relied on (PostgreSQL docs, "Streaming Replication Protocol" →
//! `START_REPLICATION SLOT … LOGICAL`): starting at `0/0` resumes at the
//! slot's `confirmed_flush_lsn` (a start ahead of it would silently skip
//! committed transactions); the status update's flush position becomes the
//! slot's `confirmed_flush_lsn`.

use std::time::Duration;

use bytes::Bytes;
use pgwire_replication::{PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::conn::ConnParams;
use super::error::SourceError;
use super::status_updates::{self, StatusUpdateCounter};
use super::tls;
use super::watchdog::Watchdog;
use crate::dispatch::{DispatchError, Item, Window, WindowPermit};
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::outbox::{Mapped, OutboxError, OutboxMapper, TxContext};
use crate::pgoutput::{self, DecodeError, LogicalMessage};

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
    /// An outbox insert cannot be mapped (the table lost a configured
    /// column); nothing from it on was acknowledged.
    #[error("cannot map an outbox insert: {0}")]
    Outbox(#[from] OutboxError),
}

/// Settings for one replication session.
#[derive(Clone, Debug)]
pub struct StreamSettings {
    /// Slot name.
    pub slot: String,
    /// Publication names.
    pub publications: Vec<String>,
    /// `application_name` shown in `pg_stat_replication`.
    pub application_name: String,
    /// Standby status update interval (and idle wake-up).
    pub status_interval: Duration,
}

/// The standby status interval for a server whose `wal_sender_timeout` is
/// `timeout` (zero = disabled): min(1 s, timeout / 3), at least 100 ms.
pub fn status_interval_for(timeout: Duration) -> Duration {
    if timeout.is_zero() {
        return Duration::from_secs(1);
    }
    (timeout / 3).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// Transport buffer between its socket task and the reader, in messages.
/// Small: the relay's own window bounds memory in bytes.
const TRANSPORT_BUFFER: usize = 64;

/// Opens a pgoutput stream at the slot's own position (`0/0`) and waits
/// until the server accepted `START_REPLICATION` (the slot is then held).
/// Bounded by twice the connect timeout.
pub async fn open(conn: &ConnParams, s: &StreamSettings) -> Result<ReplicationClient, SourceError> {
    let mut cfg = ReplicationConfig::new(
        conn.host.clone(),
        conn.user.clone(),
        conn.password.clone(),
        conn.dbname.clone(),
        s.slot.clone(),
        s.publications.clone(),
    )
    .with_port(conn.port)
    .with_tls(tls::replication_tls(conn))
    .with_start_lsn(Lsn::ZERO.into())
    .with_status_interval(s.status_interval)
    .with_wakeup_interval(s.status_interval)
    .with_buffer_size(TRANSPORT_BUFFER)
    .with_application_name(s.application_name.clone())
    // Text output must not depend on the role's settings.
    .with_options(
        "-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=postgres -c extra_float_digits=3",
    );
    cfg.max_message_size = 1 << 30;
    let connect = async {
        let mut client = ReplicationClient::connect(cfg).await?;
        client.wait_started().await?;
        Ok::<_, PgWireError>(client)
    };
    let bound = conn.connect_timeout * 2;
    match tokio::time::timeout(bound, connect).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(SourceError::transport(&e, &s.slot)),
        Err(_) => Err(SourceError::Transient(format!(
            "starting replication on {} timed out after {bound:?}",
            conn.display()
        ))),
    }
}

/// The transport of one session. [`Transport::confirm`] is the one place
/// that hands the server a flush position.
struct Transport {
    client: ReplicationClient,
    status_interval: Duration,
}

impl Transport {
    /// Makes `lsn` the flush (and apply) position of the next standby
    /// status update; the server stores it as the slot's
    /// `confirmed_flush_lsn`.
    fn confirm(&mut self, lsn: Lsn) {
        self.client.update_applied_lsn(lsn.into());
    }

    /// Sends `lsn` in a standby status update and waits (bounded) until the
    /// transport reports it sent, then ends the stream cleanly. The
    /// transport sends no final update of its own on stop.
    async fn flush_and_close(mut self, lsn: Lsn) {
        self.confirm(lsn);
        let counters = self.client.metrics();
        let bound = Instant::now() + self.status_interval + Duration::from_millis(500);
        while Lsn::from(counters.last_applied_lsn()) < lsn && Instant::now() < bound {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let sent = Lsn::from(counters.last_applied_lsn());
        if sent < lsn {
            tracing::warn!(confirmed = %lsn, sent = %sent, "final status update not confirmed as sent");
        }
        match tokio::time::timeout(Duration::from_secs(2), self.client.shutdown()).await {
            Ok(Ok(())) => tracing::info!(confirmed = %lsn, "stream closed cleanly"),
            Ok(Err(e)) => tracing::warn!(error = %e, "stream closed with an error"),
            Err(_) => {
                self.client.abort();
                tracing::warn!("stream did not close within 2 s; aborted");
            }
        }
    }
}

/// One session's stream, from `START_REPLICATION` to CopyDone.
pub struct Stream {
    transport: Transport,
    slot: String,
    /// The dispatcher's confirmed LSN.
    confirmed: watch::Receiver<Lsn>,
    items: mpsc::Sender<Item<Lsn>>,
    window: Window,
    mapper: OutboxMapper,
    /// The open transaction, between Begin and Commit.
    tx: Option<TxContext>,
    /// Completes when the side connection closes. A fast shutdown of
    /// PostgreSQL closes it first and then waits for every walsender to have
    /// its WAL confirmed: a relay that cannot deliver (its sink may live on
    /// the same server) must let go of the stream instead of holding the
    /// server's shutdown hostage. Also, dead letters need this connection.
    side_closed: oneshot::Receiver<()>,
    watchdog: Watchdog,
    /// Copies the transport's status-update counters into metrics until
    /// the session ends.
    _status_updates: AbortOnDropHandle<()>,
}

/// What the reader needs besides the transport.
pub struct StreamParts {
    /// The dispatcher's confirmed LSN.
    pub confirmed: watch::Receiver<Lsn>,
    /// Where items go, in stream order.
    pub items: mpsc::Sender<Item<Lsn>>,
    /// The memory window events are admitted to.
    pub window: Window,
    /// Maps inserts to outbox events.
    pub mapper: OutboxMapper,
    /// Completes when the side connection closes.
    pub side_closed: oneshot::Receiver<()>,
    /// The slot streamed (for error messages).
    pub slot: String,
    /// Watches for a silent stream.
    pub watchdog: Watchdog,
}

impl Stream {
    /// Wraps an opened transport.
    pub fn new(
        client: ReplicationClient,
        status_interval: Duration,
        parts: StreamParts,
        metrics: &Metrics,
    ) -> Self {
        let counter = StatusUpdateCounter::new(client.metrics(), metrics.clone());
        let counting = tokio::spawn(status_updates::count(counter));
        Stream {
            transport: Transport {
                client,
                status_interval,
            },
            slot: parts.slot,
            confirmed: parts.confirmed,
            items: parts.items,
            window: parts.window,
            mapper: parts.mapper,
            tx: None,
            side_closed: parts.side_closed,
            watchdog: parts.watchdog,
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
        loop {
            if let Some(d) = deadline
                && (self.tx.is_none() || Instant::now() >= d)
            {
                return Ok(d);
            }
            let far = Instant::now() + Duration::from_secs(3600);
            tokio::select! {
                biased;
                r = self.confirmed.changed() => self.forward_ack(r)?,
                _ = shutdown.cancelled(), if deadline.is_none() => {
                    tracing::info!(in_transaction = self.tx.is_some(), "shutdown requested: stop reading at the next transaction boundary");
                    deadline = Some(Instant::now() + budget);
                }
                _ = tokio::time::sleep_until(deadline.unwrap_or(far)), if deadline.is_some() => {}
                _ = tokio::time::sleep_until(self.watchdog.deadline()) => self.watchdog.check().await?,
                _ = &mut self.side_closed => return Err(side_lost().into()),
                ev = self.transport.client.recv() => {
                    self.watchdog.heard();
                    let ev = ev.map_err(|e| SourceError::transport(&e, &self.slot))?;
                    let ev = ev.ok_or_else(|| SourceError::Transient("the server ended the replication stream".into()))?;
                    self.handle(ev, deadline).await?;
                }
            }
        }
    }

    fn forward_ack(
        &mut self,
        changed: Result<(), watch::error::RecvError>,
    ) -> Result<(), SourceError> {
        changed.map_err(|_| pipeline_stopped())?;
        let lsn = *self.confirmed.borrow_and_update();
        self.transport.confirm(lsn);
        Ok(())
    }

    async fn handle(
        &mut self,
        ev: ReplicationEvent,
        deadline: Option<Instant>,
    ) -> Result<(), StreamError> {
        match ev {
            ReplicationEvent::KeepAlive { wal_end, .. } => {
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
            ReplicationEvent::Commit { end_lsn, .. } => {
                self.tx = None;
                self.send(Item::Commit {
                    end: end_lsn.into(),
                })
                .await?;
            }
            ReplicationEvent::XLogData { data, .. } => self.change(data, deadline).await?,
            // Logical decoding messages are never posted; their transaction
            // still advances the watermark through its Commit.
            ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }

    async fn change(&mut self, data: Bytes, deadline: Option<Instant>) -> Result<(), StreamError> {
        match pgoutput::decode(data)? {
            LogicalMessage::Relation(rel) => self.mapper.on_relation(&rel),
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
                        tracing::warn!(commit_lsn = ?tx.commit_lsn, problem = %row.problem, "unreadable outbox row: dead-lettering it");
                        let permit = self.admit(row.size_bytes(), deadline).await?;
                        self.send(Item::Unreadable(Box::new(row), permit)).await?;
                    }
                    Mapped::OtherTable => {}
                }
            }
            // Updates, deletes, truncates, types and origins are not events.
            _ => {}
        }
        Ok(())
    }

    /// Waits for room in the window, forwarding acks meanwhile.
    async fn admit(
        &mut self,
        size: usize,
        deadline: Option<Instant>,
    ) -> Result<WindowPermit, SourceError> {
        let far = Instant::now() + Duration::from_secs(3600);
        let window = self.window.clone();
        let admitted = window.admit(size);
        tokio::pin!(admitted);
        loop {
            tokio::select! {
                biased;
                r = self.confirmed.changed() => self.forward_ack(r)?,
                p = &mut admitted => return Ok(p),
                _ = &mut self.side_closed => return Err(side_lost()),
                _ = tokio::time::sleep_until(deadline.unwrap_or(far)), if deadline.is_some() => {
                    return Err(SourceError::Transient("shutdown budget spent inside a transaction".into()));
                }
            }
        }
    }

    async fn send(&mut self, item: Item<Lsn>) -> Result<(), SourceError> {
        self.items.send(item).await.map_err(|_| pipeline_stopped())
    }

    /// Ends the stream without a final update (the session failed; the
    /// confirmed LSN covers only what was done).
    pub fn abort(&mut self) {
        self.transport.client.abort();
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
                    Ok(()) => transport.confirm(*confirmed.borrow_and_update()),
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
        let last = *confirmed.borrow();
        let final_lsn = drained.unwrap_or(last).max(last);
        if drained.is_none() {
            tracing::warn!(confirmed = %final_lsn, "shutdown budget spent with deliveries pending; they will be redelivered after restart");
        }
        transport.flush_and_close(final_lsn).await;
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

    #[test]
    fn status_interval_follows_wal_sender_timeout() {
        assert_eq!(status_interval_for(Duration::ZERO), Duration::from_secs(1));
        assert_eq!(
            status_interval_for(Duration::from_secs(60)),
            Duration::from_secs(1)
        );
        assert_eq!(
            status_interval_for(Duration::from_secs(2)),
            Duration::from_secs(2) / 3
        );
        assert_eq!(
            status_interval_for(Duration::from_millis(100)),
            Duration::from_millis(100)
        );
    }
}
