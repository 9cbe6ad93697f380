//! `cdc-relay run`: supervise replication sessions and drive the pipeline.
//!
//! ```text
//! loop:  side connection ─▶ slot checks ─▶ START_REPLICATION (0/0 = the slot's position)
//!        read ─▶ decode ─▶ map ─▶ admit (window) ─▶ dispatcher ─▶ sink
//!          ▲                                            │
//!          └────── confirmed LSN (watch) ◀──────────────┘  → standby status updates
//!        on a transient error: reconnect with capped, jittered backoff
//!        on "slot active": wait as hot standby
//!        on a definite error: stop with a message that says what to do
//! ```
//!
//! Each session starts from the slot's `confirmed_flush_lsn` with an empty
//! pipeline; whatever was in flight when a session died is delivered again
//! (at-least-once; Billing's inbox makes it harmless).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pgwire_replication::{ReplicationClient, ReplicationEvent};
use rand::Rng;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::admin::Health;
use crate::dispatch::{self, DispatchConfig, Item, Window};
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::outbox::{OutboxColumns, OutboxError, OutboxMapper, TableName, TxContext};
use crate::pgoutput::{self, DecodeError, LogicalMessage};
use crate::sink::HttpSink;
use crate::source::{self, ConnParams, SourceError, StreamSettings};

/// Everything `run` needs.
#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// Connection to the source database (the relay role).
    pub conn: ConnParams,
    /// Logical replication slot name.
    pub slot: String,
    /// Publication names.
    pub publications: Vec<String>,
    /// The outbox table.
    pub table: TableName,
    /// Outbox column names.
    pub columns: OutboxColumns,
    /// `application_name` for both connections.
    pub application_name: String,
    /// Delivery settings.
    pub dispatch: DispatchConfig,
    /// Window bound: events received and not yet done.
    pub window_events: usize,
    /// Window bound: bytes of those events.
    pub window_bytes: u32,
    /// Budget to finish in-flight work after SIGTERM.
    pub shutdown_timeout: Duration,
    /// Cap of the reconnect backoff.
    pub reconnect_max: Duration,
    /// How often the side connection reads the slot's figures.
    pub slot_stats_interval: Duration,
    /// Create the slot when it is missing (fresh installs only: a new slot
    /// starts at the current WAL position and skips anything older).
    pub create_slot: bool,
}

/// Why the relay stopped for good.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The source will not work without an operator (slot missing or lost,
    /// authentication, privileges, missing publication).
    #[error(transparent)]
    Source(#[from] SourceError),
    /// The stream held a message the relay cannot decode; nothing after it
    /// was acknowledged.
    #[error("cannot decode the replication stream: {0}")]
    Decode(#[from] DecodeError),
    /// An outbox row cannot become an event; nothing from it on was acknowledged.
    #[error("cannot map an outbox insert: {0}")]
    Outbox(#[from] OutboxError),
}

impl RelayError {
    /// The process exit code for this error (documented in `--help`).
    pub fn exit_code(&self) -> i32 {
        match self {
            RelayError::Source(SourceError::SlotMissing { .. }) => 3,
            RelayError::Source(SourceError::SlotInvalidated { .. }) => 4,
            RelayError::Decode(_) | RelayError::Outbox(_) => 5,
            RelayError::Source(_) => 1,
        }
    }
}

/// How one session ended, when it did not fail.
enum SessionEnd {
    /// Shutdown requested and done.
    Shutdown,
}

/// Runs sessions until `shutdown` is cancelled (returns `Ok`) or a definite
/// error occurs.
pub async fn run(
    cfg: RelayConfig,
    sink: HttpSink,
    metrics: Metrics,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> Result<(), RelayError> {
    let mut failures: u32 = 0;
    let mut standby_logged = false;
    // Each watchdog reconnect doubles the silence it tolerates (up to 16x):
    // a walsender replaying a huge transaction reads no replies for a long
    // time, and reconnecting restarts that replay from the beginning.
    let mut watchdog_scale: u32 = 1;
    loop {
        if shutdown.is_cancelled() {
            return Ok(());
        }
        let mut streamed = false;
        let outcome = session(
            &cfg,
            &sink,
            &metrics,
            &health,
            &shutdown,
            &mut streamed,
            watchdog_scale,
        )
        .await;
        watchdog_scale = match &outcome {
            Err(RelayError::Source(SourceError::Stalled(_))) => (watchdog_scale * 2).min(16),
            _ if streamed => 1,
            _ => watchdog_scale,
        };
        if streamed {
            // A session that streamed was healthy: the next reconnect starts
            // the backoff over instead of sleeping near the cap.
            failures = 0;
        }
        health.set_streaming(false);
        let err = match outcome {
            Ok(SessionEnd::Shutdown) => return Ok(()),
            Err(e) => e,
        };
        let source_err = match err {
            RelayError::Source(e) if !e.is_definite() => e,
            other => return Err(other),
        };
        let delay = match &source_err {
            SourceError::SlotActive { pid, .. } => {
                metrics.standby.set(1);
                if !standby_logged {
                    tracing::info!(slot = %cfg.slot, active_pid = ?pid, "slot is held by another process; waiting as hot standby");
                    standby_logged = true;
                }
                // Poll often enough to take over within ~1 s of the active relay dying.
                Duration::from_millis(rand::rng().random_range(250..750))
            }
            e => {
                failures = failures.saturating_add(1);
                metrics.reconnects.with_label_values(&[e.cause()]).inc();
                let ceiling = Duration::from_millis(100)
                    .saturating_mul(1u32 << failures.min(10))
                    .min(cfg.reconnect_max);
                let d =
                    Duration::from_millis(rand::rng().random_range(0..=ceiling.as_millis() as u64));
                tracing::warn!(error = %e, retry_in_ms = d.as_millis() as u64, "replication session failed; reconnecting");
                d
            }
        };
        if !matches!(source_err, SourceError::SlotActive { .. }) {
            standby_logged = false;
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.cancelled() => return Ok(()),
        }
    }
}

async fn session(
    cfg: &RelayConfig,
    sink: &HttpSink,
    metrics: &Metrics,
    health: &Arc<Health>,
    shutdown: &CancellationToken,
    streamed: &mut bool,
    watchdog_scale: u32,
) -> Result<SessionEnd, RelayError> {
    // tokio-postgres bounds only the TCP connect; a server that accepts and
    // then never answers must not hang the relay, so the whole start-up
    // exchange is bounded too.
    let startup = async {
        let (side, side_closed) = source::connect_sql_watched(&cfg.conn, &cfg.application_name)
            .await
            .map_err(|e| connect_error(e, &cfg.conn))?;
        let wst = side
            .query_one("SHOW wal_sender_timeout", &[])
            .await
            .map_err(|e| sql_error(&e, &cfg.conn))?;
        let wst =
            source::parse_pg_duration(wst.get::<_, &str>(0)).unwrap_or(Duration::from_secs(60));
        let slot = source::slot_info(&side, &cfg.slot)
            .await
            .map_err(|e| sql_error(&e, &cfg.conn))?;
        Ok::<_, RelayError>((side, side_closed, wst, slot))
    };
    let bound = cfg.conn.connect_timeout * 2;
    let (side, side_closed, wst, slot) =
        tokio::time::timeout(bound, startup).await.map_err(|_| {
            SourceError::Transient(format!(
                "{}: no answer within {bound:?} while connecting",
                cfg.conn.display()
            ))
        })??;
    let side = Arc::new(side);
    let slot = match slot {
        Some(slot) => slot,
        None if cfg.create_slot => create_slot(&side, cfg).await?,
        None => {
            return Err(SourceError::SlotMissing {
                slot: cfg.slot.clone(),
            }
            .into());
        }
    };
    if slot.wal_status.as_deref() == Some("lost") {
        return Err(SourceError::SlotInvalidated {
            slot: cfg.slot.clone(),
        }
        .into());
    }
    // A publication that does not carry the table would let the slot be
    // confirmed past every event: refuse to stream (the standby too).
    crate::setup::check_stream_config(&side, &cfg.table, &cfg.columns, &cfg.publications)
        .await
        .map_err(|e| match e {
            crate::setup::SetupError::Precondition(msg) => SourceError::Definite(msg),
            other => SourceError::Transient(other.to_string()),
        })?;
    let start = slot.confirmed_flush_lsn.unwrap_or(Lsn::ZERO);
    let settings = StreamSettings {
        slot: cfg.slot.clone(),
        publications: cfg.publications.clone(),
        application_name: cfg.application_name.clone(),
        status_interval: source::status_interval_for(wst),
        buffer_events: 64,
    };
    let client = source::open_stream(&cfg.conn, &settings).await?;
    // Lives until the session ends, after the final status update.
    let _status_updates = AbortOnDrop(tokio::spawn(count_status_updates(
        StatusUpdateCounter::new(client.metrics(), metrics.clone()),
    )));
    metrics.standby.set(0);
    health.set_streaming(true);
    *streamed = true;
    tracing::info!(slot = %cfg.slot, start = %start, status_interval_ms = settings.status_interval.as_millis() as u64, "streaming");

    let sample = Arc::new(std::sync::Mutex::new(None));
    let monitor = AbortOnDrop(tokio::spawn(monitor_slot(
        Arc::clone(&side),
        cfg.slot.clone(),
        cfg.slot_stats_interval,
        metrics.clone(),
        Arc::clone(&sample),
    )));
    let (items_tx, items_rx) = mpsc::channel(1024);
    let (confirmed_tx, confirmed_rx) = watch::channel(start);
    let services = dispatch::Services {
        sink: sink.clone(),
        store: Arc::clone(&side),
        metrics: metrics.clone(),
        health: Arc::clone(health),
    };
    let dispatcher = AbortOnDrop(tokio::spawn(dispatch::run(
        cfg.dispatch.clone(),
        services,
        start,
        items_rx,
        confirmed_tx,
    )));
    let mut stream = Stream {
        client,
        confirmed: confirmed_rx,
        items: items_tx,
        window: Window::new(cfg.window_events, cfg.window_bytes),
        mapper: OutboxMapper::new(cfg.table.clone(), cfg.columns.clone()),
        tx: None,
        slot: cfg.slot.clone(),
        side_closed,
        watchdog: Watchdog {
            side,
            silence: silence_bound(wst, settings.status_interval) * watchdog_scale,
            last_message: tokio::time::Instant::now(),
            sample,
        },
    };
    let read = stream
        .read_until_stopped(shutdown, cfg.shutdown_timeout)
        .await;
    drop(monitor);
    let deadline = match read {
        Ok(deadline) => deadline,
        Err(e) => {
            // Deliveries in flight are abandoned with the session; the
            // confirmed LSN covers only what was done.
            stream.abort();
            return Err(e);
        }
    };
    let Stream {
        client,
        confirmed,
        items,
        ..
    } = stream;
    drop(items); // tells the dispatcher no more items come
    finish(
        client,
        confirmed,
        dispatcher,
        deadline,
        settings.status_interval,
    )
    .await;
    Ok(SessionEnd::Shutdown)
}

/// Drains the dispatcher until `deadline`, flushes the final confirmed LSN
/// to the server and closes the stream with CopyDone.
async fn finish(
    client: ReplicationClient,
    mut confirmed: watch::Receiver<Lsn>,
    mut dispatcher: AbortOnDrop<Result<Lsn, dispatch::DispatchError>>,
    deadline: tokio::time::Instant,
    status_interval: Duration,
) {
    let drained = loop {
        tokio::select! {
            r = &mut dispatcher.0 => break r.ok().and_then(Result::ok),
            r = confirmed.changed() => if r.is_ok() { client.update_applied_lsn((*confirmed.borrow_and_update()).into()) },
            _ = tokio::time::sleep_until(deadline) => break None,
        }
    };
    let last = *confirmed.borrow();
    let final_lsn = drained.unwrap_or(last).max(last);
    if drained.is_none() {
        tracing::warn!(confirmed = %final_lsn, "shutdown budget spent with deliveries pending; they will be redelivered after restart");
    }
    flush_and_close(client, final_lsn, status_interval).await;
}

/// Sends `lsn` in a standby status update and waits (bounded) until the
/// transport reports it sent, then ends the stream cleanly. The transport
/// sends no final update of its own on stop.
async fn flush_and_close(mut client: ReplicationClient, lsn: Lsn, status_interval: Duration) {
    client.update_applied_lsn(lsn.into());
    let metrics = client.metrics();
    let bound = Instant::now() + status_interval + Duration::from_millis(500);
    while Lsn::from(metrics.last_applied_lsn()) < lsn && Instant::now() < bound {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let sent = Lsn::from(metrics.last_applied_lsn());
    if sent < lsn {
        tracing::warn!(confirmed = %lsn, sent = %sent, "final status update not confirmed as sent");
    }
    match tokio::time::timeout(Duration::from_secs(2), client.shutdown()).await {
        Ok(Ok(())) => tracing::info!(confirmed = %lsn, "stream closed cleanly"),
        Ok(Err(e)) => tracing::warn!(error = %e, "stream closed with an error"),
        Err(_) => {
            client.abort();
            tracing::warn!("stream did not close within 2 s; aborted");
        }
    }
}

struct Stream {
    client: ReplicationClient,
    confirmed: watch::Receiver<Lsn>,
    items: mpsc::Sender<Item>,
    window: Window,
    mapper: OutboxMapper,
    /// The open transaction, between Begin and Commit.
    tx: Option<TxContext>,
    slot: String,
    /// Completes when the side connection closes. A fast shutdown of
    /// PostgreSQL closes it first and then waits for every walsender to have
    /// its WAL confirmed: a relay that cannot deliver (its sink may live on
    /// the same server) must let go of the stream instead of holding the
    /// server's shutdown hostage. Also, dead letters need this connection.
    side_closed: tokio::sync::oneshot::Receiver<()>,
    watchdog: Watchdog,
}

/// Notices a stream that is open but dead (a frozen walsender, a silent
/// network): after `silence` without a message it asks the server, on the
/// side connection, whether the walsender still reads our status updates.
struct Watchdog {
    side: Arc<tokio_postgres::Client>,
    silence: Duration,
    last_message: tokio::time::Instant,
    /// The slot monitor's latest reading: reused when recent, so a healthy
    /// idle relay costs no extra statements.
    sample: SlotSample,
}

/// Silence worth a liveness check: the server's own timeout (it would
/// have dropped us by then), at least 3 status intervals, at least 5 s
/// when the server's timeout is disabled.
fn silence_bound(wal_sender_timeout: Duration, status_interval: Duration) -> Duration {
    let floor = (status_interval * 3).max(Duration::from_secs(1));
    if wal_sender_timeout.is_zero() {
        floor.max(Duration::from_secs(5))
    } else {
        wal_sender_timeout.max(floor)
    }
}

impl Watchdog {
    fn deadline(&self) -> tokio::time::Instant {
        self.last_message + self.silence
    }

    /// `Ok` when the walsender serving our slot read a status update from
    /// us within the silence bound, or is visibly busy (decoding a large
    /// transaction, reading spilled changes: it reads replies only between
    /// steps). Stalled when it is idle-waiting yet ignores us (a frozen
    /// process, a dead network path), or ignores us for 10 silence bounds.
    async fn check(&mut self, slot: &str) -> Result<(), RelayError> {
        let stalled = |why: String| Err(SourceError::Stalled(why).into());
        let recent = self.last_message + self.silence / 2;
        let cached = self
            .sample
            .lock()
            .expect("sample lock")
            .as_ref()
            .filter(|(at, _)| *at >= recent)
            .map(|(_, info)| info.clone());
        let info = match cached {
            Some(info) => Some(info),
            None => match tokio::time::timeout(
                Duration::from_secs(5),
                source::slot_info(&self.side, slot),
            )
            .await
            {
                Err(_) => return stalled("liveness query on the side connection timed out".into()),
                Ok(Err(e)) => return stalled(format!("liveness query failed: {e}")),
                Ok(Ok(info)) => info,
            },
        };
        let Some(age) = info.as_ref().and_then(|i| i.reply_age_secs) else {
            return stalled("no walsender holds the slot for this session".into());
        };
        let waiting = info
            .as_ref()
            .is_some_and(|i| matches!(i.wait_event_type.as_deref(), Some("Activity" | "Client")));
        let bound = self.silence.as_secs_f64();
        if age > bound * 10.0 || (age > bound && waiting) {
            return stalled(format!(
                "the walsender has not read a status update for {age:.1} s"
            ));
        }
        self.last_message = tokio::time::Instant::now();
        Ok(())
    }
}

impl Stream {
    /// Reads until a shutdown request at a transaction boundary (or the
    /// shutdown deadline) and returns the deadline for draining.
    async fn read_until_stopped(
        &mut self,
        shutdown: &CancellationToken,
        budget: Duration,
    ) -> Result<tokio::time::Instant, RelayError> {
        let mut deadline: Option<tokio::time::Instant> = None;
        loop {
            if let Some(d) = deadline
                && (self.tx.is_none() || tokio::time::Instant::now() >= d)
            {
                return Ok(d);
            }
            let far = tokio::time::Instant::now() + Duration::from_secs(3600);
            tokio::select! {
                biased;
                r = self.confirmed.changed() => self.forward_ack(r)?,
                _ = shutdown.cancelled(), if deadline.is_none() => {
                    tracing::info!(in_transaction = self.tx.is_some(), "shutdown requested: stop reading at the next transaction boundary");
                    deadline = Some(tokio::time::Instant::now() + budget);
                }
                _ = tokio::time::sleep_until(deadline.unwrap_or(far)), if deadline.is_some() => {}
                _ = tokio::time::sleep_until(self.watchdog.deadline()) => self.watchdog.check(&self.slot).await?,
                _ = &mut self.side_closed => return Err(side_lost()),
                ev = self.client.recv() => {
                    self.watchdog.last_message = tokio::time::Instant::now();
                    let ev = ev.map_err(|e| source::classify(&e, &self.slot))?;
                    let ev = ev.ok_or_else(|| SourceError::Transient("the server ended the replication stream".into()))?;
                    self.handle(ev, deadline).await?;
                }
            }
        }
    }

    fn forward_ack(
        &mut self,
        changed: Result<(), watch::error::RecvError>,
    ) -> Result<(), RelayError> {
        match changed {
            Ok(()) => {
                let lsn = *self.confirmed.borrow_and_update();
                self.client.update_applied_lsn(lsn.into());
                Ok(())
            }
            Err(_) => Err(SourceError::Transient("delivery pipeline stopped".into()).into()),
        }
    }

    async fn handle(
        &mut self,
        ev: ReplicationEvent,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<(), RelayError> {
        match ev {
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                self.send(Item::Keepalive {
                    wal_end: wal_end.into(),
                })
                .await
            }
            ReplicationEvent::Begin {
                final_lsn,
                commit_time_micros,
                ..
            } => {
                let ctx = TxContext {
                    commit_lsn: final_lsn.into(),
                    commit_time_micros,
                };
                self.tx = Some(ctx);
                self.send(Item::Begin(ctx)).await
            }
            ReplicationEvent::Commit { end_lsn, .. } => {
                self.tx = None;
                self.send(Item::Commit {
                    end_lsn: end_lsn.into(),
                })
                .await
            }
            ReplicationEvent::XLogData { data, .. } => self.change(data, deadline).await,
            // Logical decoding messages are never posted; their transaction
            // still advances the watermark through its Commit.
            ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => Ok(()),
        }
    }

    async fn change(
        &mut self,
        data: Bytes,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<(), RelayError> {
        match pgoutput::decode(data)? {
            LogicalMessage::Relation(rel) => self.mapper.on_relation(&rel),
            LogicalMessage::Insert(ins) => {
                let tx = self.tx.ok_or_else(|| {
                    SourceError::Definite("insert outside a transaction in the stream".into())
                })?;
                match self.mapper.on_insert(&ins, tx) {
                    Ok(Some(event)) => {
                        let permit = self.admit(event.size_bytes(), deadline).await?;
                        self.send(Item::Event(event, permit)).await?;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        let row = self.mapper.quarantine_record(&ins, tx, &e).ok_or(e)?;
                        tracing::warn!(commit_lsn = %tx.commit_lsn, error = %row.error, "unreadable outbox row: quarantining");
                        let size = row.payload.as_ref().map_or(0, String::len) + 256;
                        let permit = self.admit(size, deadline).await?;
                        self.send(Item::Unreadable(Box::new(row), permit)).await?;
                    }
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
        deadline: Option<tokio::time::Instant>,
    ) -> Result<dispatch::WindowPermit, RelayError> {
        let far = tokio::time::Instant::now() + Duration::from_secs(3600);
        loop {
            tokio::select! {
                biased;
                r = self.confirmed.changed() => self.forward_ack(r)?,
                p = self.window.admit(size) => return Ok(p),
                _ = &mut self.side_closed => return Err(side_lost()),
                _ = tokio::time::sleep_until(deadline.unwrap_or(far)), if deadline.is_some() => {
                    return Err(SourceError::Transient("shutdown budget spent inside a transaction".into()).into());
                }
            }
        }
    }

    async fn send(&mut self, item: Item) -> Result<(), RelayError> {
        self.items
            .send(item)
            .await
            .map_err(|_| SourceError::Transient("delivery pipeline stopped".into()).into())
    }

    /// Ends the stream without a final update (the session failed).
    fn abort(&mut self) {
        self.client.abort();
    }
}

/// The slot monitor's latest reading and when it was taken, shared with
/// the watchdog.
type SlotSample = Arc<std::sync::Mutex<Option<(tokio::time::Instant, source::SlotInfo)>>>;

/// Reads the slot's figures into metrics every `interval` (one query).
async fn monitor_slot(
    side: Arc<tokio_postgres::Client>,
    slot: String,
    interval: Duration,
    metrics: Metrics,
    sample: SlotSample,
) {
    let mut tick = tokio::time::interval(interval);
    loop {
        tick.tick().await;
        match source::slot_info(&side, &slot).await {
            Ok(Some(info)) => {
                *sample.lock().expect("sample lock") =
                    Some((tokio::time::Instant::now(), info.clone()));
                metrics.slot_lag_bytes.set(info.lag_bytes.unwrap_or(0));
                metrics
                    .slot_safe_wal_size_bytes
                    .set(info.safe_wal_size.unwrap_or(-1));
                for s in ["reserved", "extended", "unreserved", "lost"] {
                    let v = i64::from(info.wal_status.as_deref() == Some(s));
                    metrics.slot_wal_status.with_label_values(&[s]).set(v);
                }
            }
            Ok(None) => tracing::warn!(slot = %slot, "slot disappeared"),
            Err(e) => {
                tracing::debug!(error = %e, "slot figures unavailable; side connection lost");
                return;
            }
        }
    }
}

/// Copies the transport's per-connection standby status counters into
/// `cdc_relay_status_updates_total{cause}` as deltas, so the relay's
/// counter keeps counting across sessions.
struct StatusUpdateCounter {
    transport: Arc<pgwire_replication::client::ReplicationMetrics>,
    metrics: Metrics,
    /// Counts already added, per cause.
    interval: u64,
    keepalive_reply: u64,
}

impl StatusUpdateCounter {
    fn new(
        transport: Arc<pgwire_replication::client::ReplicationMetrics>,
        metrics: Metrics,
    ) -> Self {
        StatusUpdateCounter {
            transport,
            metrics,
            interval: 0,
            keepalive_reply: 0,
        }
    }

    /// Adds what was sent since the last sample. The transport counts every
    /// update in `feedback_sent` and the replies to a keepalive also in
    /// `keepalive_replies`; the rest went out on the status interval.
    fn sample(&mut self) {
        let replies = self.transport.keepalive_replies();
        let interval = self.transport.feedback_sent().saturating_sub(replies);
        for (cause, seen, now) in [
            ("keepalive_reply", &mut self.keepalive_reply, replies),
            ("interval", &mut self.interval, interval),
        ] {
            if now > *seen {
                self.metrics
                    .status_updates
                    .with_label_values(&[cause])
                    .inc_by(now - *seen);
                *seen = now;
            }
        }
    }
}

impl Drop for StatusUpdateCounter {
    /// Counts the session's last updates, the final one on shutdown included.
    fn drop(&mut self) {
        self.sample();
    }
}

/// Samples `counter` every second until the session aborts the task.
async fn count_status_updates(mut counter: StatusUpdateCounter) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        counter.sample();
    }
}

/// `--create-slot`: creates the missing slot and reads it back.
async fn create_slot(
    side: &tokio_postgres::Client,
    cfg: &RelayConfig,
) -> Result<source::SlotInfo, RelayError> {
    side.execute(
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&cfg.slot],
    )
    .await
    .map_err(|e| sql_error(&e, &cfg.conn))?;
    tracing::warn!(slot = %cfg.slot, "created the missing slot (--create-slot): events committed before now are not delivered");
    source::slot_info(side, &cfg.slot)
        .await
        .map_err(|e| sql_error(&e, &cfg.conn))?
        .ok_or_else(|| {
            SourceError::SlotMissing {
                slot: cfg.slot.clone(),
            }
            .into()
        })
}

fn connect_error(e: source::SqlConnectError, conn: &ConnParams) -> RelayError {
    match e {
        source::SqlConnectError::Tls(e) => SourceError::Definite(e.to_string()).into(),
        source::SqlConnectError::Sql(e) => sql_error(&e, conn),
    }
}

fn sql_error(e: &tokio_postgres::Error, conn: &ConnParams) -> RelayError {
    let code = e.code().map(|c| c.code().to_owned());
    let text = crate::setup::db_message(e);
    let msg = format!("{}: {text}", conn.display());
    match code {
        Some(c) if !source::sqlstate_is_transient(&c) => SourceError::Definite(msg).into(),
        _ => SourceError::Transient(msg).into(),
    }
}

fn side_lost() -> RelayError {
    SourceError::Transient(
        "the side connection closed (server shutting down or restarting?)".into(),
    )
    .into()
}

/// A spawned task that is aborted when this handle is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_bound_follows_the_server_timeout() {
        let s = Duration::from_secs;
        assert_eq!(silence_bound(s(60), s(1)), s(60));
        assert_eq!(silence_bound(s(2), Duration::from_millis(666)), s(2));
        assert_eq!(silence_bound(Duration::ZERO, s(1)), s(5));
        assert_eq!(
            silence_bound(Duration::from_millis(500), Duration::from_millis(100)),
            s(1)
        );
    }

    #[test]
    fn exit_codes_are_distinct() {
        let slot = || "s".to_owned();
        let missing: RelayError = SourceError::SlotMissing { slot: slot() }.into();
        let lost: RelayError = SourceError::SlotInvalidated { slot: slot() }.into();
        let auth: RelayError = SourceError::Definite("auth".into()).into();
        assert_eq!(
            (missing.exit_code(), lost.exit_code(), auth.exit_code()),
            (3, 4, 1)
        );
    }
}
