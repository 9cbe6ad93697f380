//! `cdc-relay run`'s engine: supervises replication sessions.
//!
//! ```text
//! loop:  side connection ─▶ catalog checks ─▶ stream::open (START_REPLICATION 0/0)
//!        Stream (read ─▶ decode ─▶ map ─▶ admit) ─Item─▶ dispatch ─▶ sink
//!          ▲                                                │
//!          └────────── confirmed LSN (watch) ◀──────────────┘  → standby status updates
//!        on a transient error: reconnect with capped, jittered backoff
//!        on "slot active": wait as hot standby
//!        on a definite error: stop with a message that says what to do
//! ```
//!
//! Each session starts from the slot's `confirmed_flush_lsn` with an empty
//! pipeline; whatever was in flight when a session died is delivered again
//! (at-least-once; the receiver's inbox makes it harmless). See
//! `docs/architecture.md#replication-session` and `#shutdown`.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::backoff::Backoff;
use crate::breaker::Breaker;
use crate::deadletter::{self, GroupedStore};
use crate::dispatch::park::Park;
use crate::dispatch::{
    self, Confirmed, DispatchConfig, Endpoint, RetainedWal, Router, Shared, Window,
};
use crate::health::Health;
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::outbox::{OutboxColumns, OutboxMapper, TableName};
use crate::sink::HttpSink;
use crate::source::catalog::{self, OutboxTable, SlotInfo};
use crate::source::shards::{self, Shard};
use crate::source::stream::{Stream, StreamParts};
use crate::source::transport::{self, StreamSettings, Transport};
use crate::source::watchdog::{self, MonitorOutputs, MonitorSettings, SlotReading, Watchdog};
use crate::source::{self, ConnParams, SourceError, failover, progress};

mod recovery;
mod standby;

pub use recovery::{LeftAt, OnSlotLoss};
use standby::{blocked, stop_when_confirmed, wait_while_blocked};

pub use crate::source::stream::StreamError as RelayError;

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
    /// Stream from a server whose encoding is not UTF8.
    pub allow_non_utf8: bool,
    /// What to do when the slot is missing.
    pub on_slot_loss: OnSlotLoss,
    /// How far before the progress record's last delivered commit a
    /// recovery backfill starts (long transactions commit after their rows'
    /// insert time).
    pub backfill_margin: Duration,
    /// The outbox column a recovery backfill orders and filters by.
    pub time_column: String,
    /// Require (and create) a failover slot.
    pub failover: bool,
    /// Standbys whose copy of the slot is watched.
    pub standbys: Vec<ConnParams>,
    /// Largest lag of a ready copy, bytes.
    pub failover_max_lag: u64,
    /// `--max-retained-wal`: above this many bytes of retained WAL the
    /// endpoint holding the oldest pending event is parked; `None`: no
    /// budget.
    pub max_retained_wal: Option<u64>,
    /// The shard this relay streams (`run --shards`): `slot` and
    /// `publications` are then the shard's, and each session first proves
    /// that the shard filters cover every row once.
    pub shard: Option<ShardOf>,
    /// `--stop-at-lsn`: stop (cleanly, `Ok`) once the slot is confirmed at
    /// or past this LSN, and do not start streaming a slot already past it.
    pub stop_at: Option<Lsn>,
    /// Shared by the shard relays of one process (`--max-shards` permits):
    /// a session holds a permit from before it claims its slot until it
    /// ends, so the process streams at most that many shards.
    pub claims: Option<Arc<tokio::sync::Semaphore>>,
}

/// A relay's shard, with the base name its siblings' publications derive
/// from (for the coverage proof).
#[derive(Clone, Debug)]
pub struct ShardOf {
    /// Which shard.
    pub shard: Shard,
    /// `--publication`: the shards' publications are `<base>_<k>of<N>`.
    pub publication_base: String,
    /// `--slot`: the shards' slots are `<base>_<k>of<N>`.
    pub slot_base: String,
}

impl ShardOf {
    /// The slots of every shard of this split.
    pub fn slots(&self) -> Vec<String> {
        Shard::all(self.shard.count)
            .map(|s| s.name(&self.slot_base))
            .collect()
    }
}

/// One endpoint `run` delivers to.
#[derive(Clone, Debug)]
pub struct Target {
    /// Its name: `default` for `--sink-url`, else the routes file's.
    pub name: String,
    /// Its delivery settings.
    pub dispatch: DispatchConfig,
    /// Its HTTP sink.
    pub sink: HttpSink,
}

/// Where `run` delivers: the one endpoint of `--sink-url`, or the
/// endpoints of a routes file and its router (lane `i` is `endpoints[i]`).
#[derive(Clone, Debug)]
pub struct Targets {
    /// The endpoints, in lane order.
    pub endpoints: Vec<Target>,
    /// Which endpoints each event goes to.
    pub router: Router,
}

impl Targets {
    /// The one endpoint of `--sink-url`.
    pub fn single(dispatch: DispatchConfig, sink: HttpSink) -> Self {
        Targets {
            endpoints: vec![Target {
                name: crate::endpoint_metrics::DEFAULT_ENDPOINT.to_owned(),
                dispatch,
                sink,
            }],
            router: Router::single(),
        }
    }
}

/// First reconnect delay ceiling; doubles per failed session up to
/// `--reconnect-max`.
const RECONNECT_BASE: Duration = Duration::from_millis(100);

/// Runs sessions until `shutdown` is cancelled (returns `Ok`) or a definite
/// error occurs.
pub async fn run(
    cfg: RelayConfig,
    targets: Targets,
    metrics: Metrics,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> Result<(), RelayError> {
    let mut reconnect = Backoff::new(RECONNECT_BASE, cfg.reconnect_max, Duration::ZERO);
    let mut standby_logged = false;
    // Each watchdog reconnect doubles the silence it tolerates (up to 16x):
    // a walsender replaying a huge transaction reads no replies for a long
    // time, and reconnecting restarts that replay from the beginning.
    let mut watchdog_scale: u32 = 1;
    let holder = progress::holder(&cfg.application_name);
    // One breaker per endpoint for the process: a reconnect keeps an open
    // circuit open and a poison storm a storm.
    let breakers: Vec<Breaker> = targets
        .endpoints
        .iter()
        .map(|t| {
            let cfg = t.dispatch.breaker.clone();
            if targets.router.is_single() {
                Breaker::new(cfg, metrics.clone())
            } else {
                Breaker::for_endpoint(cfg, metrics.clone(), &t.name)
            }
        })
        .collect();
    // Where this process left the slot when its last session ended.
    let mut left: Option<LeftAt> = None;
    // A hot standby's connection for its polls.
    let mut poller: Option<tokio_postgres::Client> = None;
    loop {
        if shutdown.is_cancelled() {
            return Ok(());
        }
        let mut streamed = false;
        // A shard relay may claim its slot only while the process streams
        // fewer than --max-shards.
        let permit = match &cfg.claims {
            Some(claims) => match Arc::clone(claims).try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    // At --max-shards: this shard waits like a hot standby
                    // (its slot figures are stale, so alerts skip them).
                    metrics.standby.set(1);
                    tokio::select! {
                        permit = Arc::clone(claims).acquire_owned() => permit.ok(),
                        _ = shutdown.cancelled() => return Ok(()),
                    }
                }
            },
            None => None,
        };
        let session = Session {
            cfg: &cfg,
            metrics: &metrics,
            health: &health,
            watchdog_scale,
            holder: &holder,
            breakers: &breakers,
        };
        let outcome = session
            .run(&targets, &shutdown, &mut streamed, &mut left)
            .await;
        drop(permit);
        if let Err(RelayError::Source(SourceError::SlotJumped { .. })) = &outcome {
            metrics.slot_jumps.inc();
        }
        health.set_streaming(false, Duration::ZERO);
        metrics.pending_events.set(0); // the session's pipeline is gone
        for t in &targets.endpoints {
            let e = metrics.endpoints.endpoint(&t.name);
            e.pending.set(0);
            e.oldest_pending_age.set(0.0);
        }
        watchdog_scale = match &outcome {
            Err(RelayError::Source(SourceError::Stalled(_))) => (watchdog_scale * 2).min(16),
            _ if streamed => 1,
            _ => watchdog_scale,
        };
        if streamed {
            // A session that streamed was healthy: the next reconnect starts
            // the backoff over instead of sleeping near the cap.
            reconnect.reset();
        }
        let source_err = match outcome {
            Ok(()) => return Ok(()),
            Err(RelayError::Source(e)) if !e.is_definite() => e,
            Err(other) => return Err(other),
        };
        let delay = if let SourceError::SlotActive { pid, .. }
        | SourceError::OtherSplitActive { pid, .. } = &source_err
        {
            // Another relay streams the slot: from now on its progress is
            // its own, not something this process left undone.
            left = None;
            metrics.standby.set(1);
            if !standby_logged {
                match &source_err {
                    SourceError::OtherSplitActive { other, .. } => {
                        tracing::info!(slot = %cfg.slot, other_slot = %other, active_pid = %crate::shown(pid), "a slot of another split streams (a reshard: the old split must stop first); waiting as hot standby");
                    }
                    _ => {
                        tracing::info!(slot = %cfg.slot, active_pid = %crate::shown(pid), "slot is held by another process; waiting as hot standby");
                    }
                }
                standby_logged = true;
            }
            if !wait_while_blocked(&cfg, &mut poller, &shutdown).await {
                return Ok(());
            }
            continue;
        } else {
            standby_logged = false;
            metrics
                .reconnects
                .with_label_values(&[source_err.cause()])
                .inc();
            let d = reconnect.next_delay(None, &mut rand::rng());
            tracing::warn!(error = %source_err, retry_in_ms = d.as_millis() as u64, "replication session failed; reconnecting");
            d
        };
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.cancelled() => return Ok(()),
        }
    }
}

/// One replication session.
struct Session<'a> {
    cfg: &'a RelayConfig,
    metrics: &'a Metrics,
    health: &'a Arc<Health>,
    watchdog_scale: u32,
    /// Who this relay is, in the progress record.
    holder: &'a str,
    /// One per endpoint, kept across sessions.
    breakers: &'a [Breaker],
}

/// What start-up learned on the side connection.
struct Prepared {
    side: Arc<tokio_postgres::Client>,
    /// The primary chosen among the URL's hosts; the replication
    /// connection goes to the same server.
    server: ConnParams,
    side_closed: tokio::sync::oneshot::Receiver<()>,
    wal_sender_timeout: Duration,
    slot: SlotInfo,
    table: OutboxTable,
    /// The server's encoding is SQL_ASCII (bytes without a defined encoding).
    sql_ascii: bool,
    /// The row filter the shard's publication must keep (as the server
    /// printed it when the session started); `None` unsharded.
    row_filter: Option<String>,
    /// Endpoints whose parked dead letters wait: they start parked.
    parked: Vec<String>,
    /// The server's `synchronous_standby_names` is set (synchronous
    /// replication): dead letters then commit synchronously, so each waits
    /// for the synchronous standbys as before (`crate::durable`).
    synchronous_replication: bool,
}

impl Session<'_> {
    /// Streams until shutdown (`Ok`) or an error; sets `streamed` once the
    /// server accepted `START_REPLICATION`.
    async fn run(
        &self,
        targets: &Targets,
        shutdown: &CancellationToken,
        streamed: &mut bool,
        left: &mut Option<LeftAt>,
    ) -> Result<(), RelayError> {
        let cfg = self.cfg;
        // A recovery backfill (`--on-slot-loss recover`) is refused with a
        // routes file at start, so it always has the one endpoint here.
        let sink = &targets.endpoints[0].sink;
        let Some(p) = self.prepare(left.as_ref(), sink, shutdown).await? else {
            return Ok(()); // shutdown during the recovery backfill
        };
        let start = p.slot.confirmed_flush_lsn.unwrap_or(Lsn::ZERO);
        let settings = StreamSettings {
            slot: cfg.slot.clone(),
            publications: cfg.publications.clone(),
            application_name: cfg.application_name.clone(),
            status_interval: transport::status_interval_for(p.wal_sender_timeout),
            raw_encoding: p.sql_ascii,
        };
        let client = transport::open(&p.server, &settings).await?;
        let silence = watchdog::silence_bound(p.wal_sender_timeout, settings.status_interval)
            * self.watchdog_scale;
        self.metrics.standby.set(0);
        self.health.set_streaming(true, silence);
        *streamed = true;
        tracing::info!(slot = %cfg.slot, start = %start, status_interval_ms = settings.status_interval.as_millis() as u64, "streaming");

        let (readings_tx, readings) = watch::channel(None);
        let (ceiling_tx, ceiling) = watch::channel(None);
        let monitor = AbortOnDropHandle::new(tokio::spawn(watchdog::monitor_slot(
            Arc::clone(&p.side),
            MonitorSettings {
                slot: cfg.slot.clone(),
                publications: cfg.publications.clone(),
                table: cfg.table.clone(),
                columns: cfg.columns.names(),
                row_filter: p.row_filter.clone(),
                siblings: cfg.shard.as_ref().map(ShardOf::slots).unwrap_or_default(),
                interval: cfg.slot_stats_interval,
                holder: self.holder.to_owned(),
            },
            MonitorOutputs {
                metrics: self.metrics.clone(),
                health: Arc::clone(self.health),
                readings: readings_tx,
                ceiling: ceiling_tx,
            },
            start,
        )));
        self.metrics
            .failover_standbys
            .set(i64::try_from(cfg.standbys.len()).unwrap_or(i64::MAX));
        let _failover = (!cfg.standbys.is_empty()).then(|| {
            AbortOnDropHandle::new(tokio::spawn(failover::watch_copies(
                Arc::clone(&p.side),
                failover::FailoverSettings {
                    slot: cfg.slot.clone(),
                    standbys: cfg.standbys.clone(),
                    max_lag: cfg.failover_max_lag,
                    interval: cfg.slot_stats_interval,
                },
                self.metrics.clone(),
                readings.clone(),
            )))
        });
        let (items_tx, items_rx) = mpsc::channel(1024);
        let (confirmed_tx, confirmed_rx) = watch::channel(Confirmed {
            position: start,
            last_done: None,
        });
        // A graceful stop of this session: the process's shutdown, or
        // --stop-at-lsn reached.
        let stop = shutdown.child_token();
        let _stop_at = cfg.stop_at.map(|at| {
            AbortOnDropHandle::new(tokio::spawn(stop_when_confirmed(
                confirmed_rx.clone(),
                at,
                stop.clone(),
                cfg.slot.clone(),
            )))
        });
        self.metrics.retained_wal_budget_bytes.set(
            cfg.max_retained_wal
                .map_or(0, |b| i64::try_from(b).unwrap_or(i64::MAX)),
        );
        let wal_budget = cfg.max_retained_wal.map(|budget| RetainedWal {
            budget,
            retained: retained_wal(readings.clone()),
        });
        let window = Window::new(cfg.window_events, cfg.window_bytes);
        // Parked rows come as fast as the endpoint's events: concurrent
        // ones share a statement and a commit, and nobody waits for its
        // flush but the confirmed position (`crate::durable`) — unless the
        // server replicates synchronously: then each commit waits for the
        // synchronous standbys, as a flush check on the primary cannot.
        let (store, durability) = if p.synchronous_replication {
            tracing::info!(
                "synchronous_standby_names is set: dead letters commit synchronously (each waits for the synchronous standbys)"
            );
            (GroupedStore::new(Arc::clone(&p.side)), None)
        } else {
            let (store, durability) = GroupedStore::asynchronous(Arc::clone(&p.side));
            (store, Some(durability))
        };
        let shared = Shared {
            store: Arc::new(store),
            metrics: self.metrics.clone(),
            health: Arc::clone(self.health),
            stopping: stop.clone(),
            wal_budget,
            window: Some(window.clone()),
            durability,
        };
        let endpoints = targets
            .endpoints
            .iter()
            .zip(self.breakers)
            .map(|(t, b)| Endpoint {
                name: t.name.clone(),
                cfg: t.dispatch.clone(),
                sink: t.sink.clone(),
                breaker: b.clone(),
                park: parked_at_start(&t.name, t.dispatch.auto_resume, &p.parked),
            })
            .collect();
        let dispatcher = AbortOnDropHandle::new(tokio::spawn(dispatch::run_routed(
            endpoints,
            targets.router.clone(),
            shared,
            start,
            items_rx,
            confirmed_tx,
        )));
        let _progress = AbortOnDropHandle::new(tokio::spawn(progress::keep_recording(
            Arc::clone(&p.side),
            cfg.slot.clone(),
            self.holder.to_owned(),
            confirmed_rx.clone(),
        )));
        let parts = StreamParts {
            confirmed: confirmed_rx,
            ceiling,
            items: items_tx,
            window,
            mapper: {
                let mut m =
                    OutboxMapper::new(cfg.table.clone(), cfg.columns.clone(), Some(p.table.oid));
                m.seed_layout(&p.table.columns);
                m
            },
            side: Arc::clone(&p.side),
            side_closed: p.side_closed,
            slot: cfg.slot.clone(),
            watchdog: Watchdog::new(
                Arc::clone(&p.side),
                cfg.slot.clone(),
                silence,
                readings,
                Arc::clone(self.health),
            ),
            metrics: self.metrics.clone(),
        };
        let mut stream = Stream::new(
            Transport::new(client, settings.status_interval, start),
            parts,
        );
        let read = stream.read_until_stopped(&stop, cfg.shutdown_timeout).await;
        drop(monitor);
        match read {
            Ok(deadline) => {
                stream.drain_and_close(dispatcher, deadline).await;
                Ok(())
            }
            Err(e) => {
                // Deliveries in flight are abandoned with the session; the
                // confirmed LSN covers only what was done.
                stream.abort();
                *left = Some(LeftAt {
                    sent: stream.sent(),
                    pending: self.metrics.pending_events.get() > 0,
                    at_unix: recovery::now_unix(),
                    last_done_commit: stream.last_done_commit(),
                });
                Err(self.diagnose(e, &p.side, p.row_filter.as_deref()).await)
            }
        }
    }

    /// The walsender not finding a publication means either that the slot
    /// predates it (the error says so) or that it was dropped while the
    /// relay streamed: the catalog tells which.
    async fn diagnose(
        &self,
        e: RelayError,
        side: &tokio_postgres::Client,
        row_filter: Option<&str>,
    ) -> RelayError {
        let RelayError::Source(SourceError::SlotPredatesPublication { publication, .. }) = &e
        else {
            return e;
        };
        match catalog::check_stream_config(
            side,
            &self.cfg.table,
            &self.cfg.columns,
            &self.cfg.publications,
            row_filter,
        )
        .await
        {
            Err(now) if now.is_definite() => {
                tracing::debug!(publication = %publication, "the publication is gone from the catalog too");
                now.into()
            }
            _ => e,
        }
    }

    /// Connects the side connection and checks the slot, the table and the
    /// publications. tokio-postgres bounds only the TCP connect; a server
    /// that accepts and then never answers must not hang the relay, so the
    /// whole exchange is bounded too.
    async fn prepare(
        &self,
        left: Option<&LeftAt>,
        sink: &HttpSink,
        shutdown: &CancellationToken,
    ) -> Result<Option<Prepared>, SourceError> {
        let cfg = self.cfg;
        let startup = async {
            let (side, side_closed, server) =
                source::connect_primary(&cfg.conn, &cfg.application_name).await?;
            let wal_sender_timeout = catalog::wal_sender_timeout(&side).await?;
            let slot = catalog::slot_info(&side, &cfg.slot).await?;
            let parked = deadletter::parked_endpoints(&side)
                .await
                .map_err(|e| SourceError::sql("looking for parked dead letters", &e))?;
            let standbys = catalog::setting(&side, "synchronous_standby_names").await?;
            Ok::<_, SourceError>((
                side,
                side_closed,
                server,
                wal_sender_timeout,
                slot,
                (parked, !standbys.trim().is_empty()),
            ))
        };
        let tries = u32::try_from(cfg.conn.hosts.len()).unwrap_or(u32::MAX);
        let bound = cfg.conn.connect_timeout * tries.saturating_add(1);
        let (
            side,
            side_closed,
            server,
            wal_sender_timeout,
            slot,
            (parked, synchronous_replication),
        ) = tokio::time::timeout(bound, startup).await.map_err(|_| {
            SourceError::Transient(format!(
                "{}: no answer within {bound:?} while connecting",
                cfg.conn.display()
            ))
        })??;
        let side = Arc::new(side);
        // The slot was recreated and the gap since the progress record
        // re-sent: the new slot is ahead of where this process left the old
        // one by design, and nothing in between is skipped.
        let mut recovered = false;
        let slot = match slot {
            Some(slot) => slot,
            None if cfg.on_slot_loss == OnSlotLoss::RecreateAndBackfill => {
                match recovery::recreate_and_backfill(&side, &server, cfg, sink, shutdown).await? {
                    Some(slot) => {
                        recovered = true;
                        slot
                    }
                    None => return Ok(None),
                }
            }
            None if cfg.create_slot => {
                catalog::create_slot(&side, &cfg.slot, cfg.failover).await?;
                tracing::warn!(slot = %cfg.slot, "created the missing slot (--create-slot): events committed before now are not delivered");
                catalog::slot_info(&side, &cfg.slot).await?.ok_or_else(|| {
                    SourceError::SlotMissing {
                        slot: cfg.slot.clone(),
                    }
                })?
            }
            None => {
                return Err(SourceError::SlotMissing {
                    slot: cfg.slot.clone(),
                });
            }
        };
        if !slot.local {
            return Err(catalog::slot_elsewhere(&cfg.slot, &slot));
        }
        if slot.invalidated() {
            return Err(SourceError::SlotInvalidated {
                slot: cfg.slot.clone(),
                reason: slot.invalidation_reason.clone(),
                since: progress::backfill_since(&side, &cfg.slot).await,
            });
        }
        if let (Some(at), Some(confirmed)) = (cfg.stop_at, slot.confirmed_flush_lsn)
            && confirmed >= at
        {
            tracing::info!(slot = %cfg.slot, confirmed_flush_lsn = %confirmed, stop_at_lsn = %at, "the slot is confirmed at or past --stop-at-lsn: nothing to stream");
            return Ok(None);
        }
        // Held by another process (START_REPLICATION would refuse it, and
        // stays the lock), or another split streams: wait as a hot standby
        // without the checks below.
        if let Some(blocked) = blocked(&side, cfg).await? {
            return Err(blocked);
        }
        if !recovered {
            recovery::check_not_jumped(&side, cfg, self.holder, &slot, left).await?;
        }
        if cfg.failover && failover::slot_failover(&side, &cfg.slot).await? != Some(true) {
            return Err(SourceError::Definite(format!(
                "--failover: slot {:?} is not a failover slot (or the server predates PostgreSQL 17): run `cdc-relay setup --failover`",
                cfg.slot
            )));
        }
        // A publication that does not carry the table would let the slot be
        // confirmed past every event: refuse to stream (the standby too).
        // A shard streams only rows its filter keeps: first prove that the
        // filters of all the shards keep every row exactly once, then hold
        // the publication to the filter proven.
        let row_filter = match &cfg.shard {
            Some(s) => {
                let coverage = shards::check_coverage(
                    &side,
                    &cfg.table,
                    &cfg.columns,
                    &s.publication_base,
                    s.shard.count,
                )
                .await?;
                coverage.filters.get(s.shard.index as usize).cloned()
            }
            None => None,
        };
        let table = catalog::check_stream_config(
            &side,
            &cfg.table,
            &cfg.columns,
            &cfg.publications,
            row_filter.as_deref(),
        )
        .await?;
        for warning in
            catalog::publication_warnings(&side, &cfg.table, &table, &cfg.publications).await?
        {
            tracing::warn!("{warning}");
        }
        // PostgreSQL 18 decodes past a publication that does not exist at a
        // point of the WAL with only a WARNING, which the replication stream
        // does not show: its events would be skipped unseen. Ask first
        // (15-17 fail on the stream instead, and `diagnose` says why).
        if !slot.active
            && failover::server_version(&side).await? >= 180_000
            && catalog::slot_predates_publication(&server, &cfg.slot, &cfg.publications).await?
                == Some(true)
        {
            return Err(SourceError::SlotPredatesPublication {
                slot: cfg.slot.clone(),
                publication: cfg.publications.join(", "),
            });
        }
        let sql_ascii = self.check_encoding(&side).await?;
        if cfg.conn.hosts.len() > 1 {
            tracing::info!(server = %server.display(), "connected to the primary");
        }
        Ok(Some(Prepared {
            side,
            side_closed,
            server,
            wal_sender_timeout,
            slot,
            table,
            sql_ascii,
            row_filter,
            parked,
            synchronous_replication,
        }))
    }

    /// Text the relay sends must be UTF-8. A server in another encoding
    /// needs the operator's consent. The server converts a real encoding
    /// (LATIN1, …) to UTF-8 itself; SQL_ASCII stores any bytes and has no
    /// conversion, so the stream then asks for them as they are and rows
    /// that are not UTF-8 become dead letters. Returns whether the server
    /// is SQL_ASCII.
    async fn check_encoding(&self, side: &tokio_postgres::Client) -> Result<bool, SourceError> {
        let encoding = catalog::server_encoding(side).await?;
        if encoding == "UTF8" {
            return Ok(false);
        }
        if !self.cfg.allow_non_utf8 {
            return Err(SourceError::Definite(format!(
                "the source database's server_encoding is {encoding}, not UTF8: its text may hold bytes \
                 that are not UTF-8, which a JSON body cannot carry. Pass --allow-non-utf8 \
                 (CDC_RELAY_ALLOW_NON_UTF8=true) to stream anyway: rows that are not UTF-8 \
                 then go to the dead-letter table, their payload bytes kept exactly"
            )));
        }
        tracing::warn!(server_encoding = %encoding, "streaming from a database that is not UTF8 (--allow-non-utf8): rows that are not UTF-8 are dead-lettered, payload bytes kept");
        Ok(encoding == "SQL_ASCII")
    }
}

/// Endpoint `name`'s parking switch for a session: thrown when the
/// dead-letter table still holds parked events of it, so its new events
/// queue behind them (parked too) and never overtake them.
fn parked_at_start(name: &str, auto_resume: bool, parked: &[String]) -> Park {
    let park = Park::default();
    if parked.iter().any(|p| p == name) {
        park.throw("its earlier parked events wait in the dead-letter table".into());
        let until = if auto_resume {
            "the relay replays those first, then returns it to live delivery"
        } else {
            "until those are replayed with the relay stopped (resume = \"manual\")"
        };
        tracing::warn!(
            endpoint = %name,
            "endpoint starts parked: the dead-letter table holds parked events of it; its events are parked too, {until} (docs/operations.md#a-parked-endpoint)"
        );
    }
    park
}

/// The slot's retained WAL from the monitor's readings, bytes, for the
/// dispatcher's WAL budget (the task ends with the readings' sender).
fn retained_wal(mut readings: watch::Receiver<SlotReading>) -> watch::Receiver<Option<u64>> {
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        while readings.changed().await.is_ok() {
            let bytes = readings
                .borrow_and_update()
                .as_ref()
                .and_then(|(_, info)| info.retained_wal_bytes)
                .and_then(|b| u64::try_from(b).ok());
            if tx.send(bytes).is_err() {
                return;
            }
        }
    });
    rx
}
