//! One replication session: streams from the slot through the pipeline
//! until shutdown or an error, then says why it ended.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::recovery::{self, LeftAt};
use super::standby::stop_when_confirmed;
use super::{RelayConfig, ShardOf};
use crate::dead_letter::GroupedStore;
use crate::dispatch::{self, Confirmed, Lane, Pipeline, RetainedWal, Window};
use crate::health::Health;
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::outbox::OutboxMapper;
use crate::sink::HttpSink;
use crate::source::catalog::SlotReading;
use crate::source::catalog::{self, OutboxTable, SlotInfo};
use crate::source::monitor::{self, MonitorOutputs, MonitorSettings};
use crate::source::stream::{Stream, StreamError, StreamParts};
use crate::source::transport::{self, StreamSettings, Transport};
use crate::source::watchdog::{self, Watchdog};
use crate::source::{ConnParams, SourceError, failover, progress};

/// One replication session.
pub(super) struct Session<'a> {
    pub(super) cfg: &'a RelayConfig,
    pub(super) metrics: &'a Metrics,
    pub(super) health: &'a Arc<Health>,
    pub(super) watchdog_scale: u32,
    /// Who this relay is, in the progress record.
    pub(super) holder: &'a str,
    /// Where the monitor leaves a publication gap to heal
    /// (`--on-gap backfill`; `None`: tell only).
    pub(super) gap: Option<super::GapWindow>,
}

/// What start-up learned on the side connection.
pub(super) struct Prepared {
    pub(super) side: Arc<tokio_postgres::Client>,
    /// The primary chosen among the URL's hosts; the replication
    /// connection goes to the same server.
    pub(super) server: ConnParams,
    pub(super) side_closed: tokio::sync::oneshot::Receiver<()>,
    pub(super) wal_sender_timeout: Duration,
    pub(super) slot: SlotInfo,
    pub(super) table: OutboxTable,
    /// The server's encoding is SQL_ASCII (bytes without a defined encoding).
    pub(super) sql_ascii: bool,
    /// The row filter the shard's publication must keep (as the server
    /// printed it when the session started); `None` unsharded.
    pub(super) row_filter: Option<String>,
    /// The outbox's publication membership read just before the stream
    /// starts: the monitor's first reading is compared with it when the
    /// progress record holds none, so a flap in between is a gap.
    pub(super) membership: catalog::Membership,
    /// Endpoints whose parked dead letters wait: they start parked.
    pub(super) parked: Vec<String>,
    /// Dead-letter rows of events the slot streams again
    /// ([`crate::dead_letter::restreamable`]).
    pub(super) restreamed: std::collections::HashMap<(String, String), i64>,
}

impl Session<'_> {
    /// Streams until shutdown (`Ok`) or an error; sets `streamed` once the
    /// server accepted `START_REPLICATION`.
    pub(super) async fn run(
        &self,
        lanes: &[Lane<HttpSink>],
        shutdown: &CancellationToken,
        streamed: &mut bool,
        left: &mut Option<LeftAt>,
    ) -> Result<(), StreamError> {
        let cfg = self.cfg;
        // A recovery backfill (`--on-slot-loss recreate-and-backfill`) is refused with a
        // routes file at start, so it always has the one endpoint here.
        let sink = &lanes[0].sink;
        let Some(mut p) = self.prepare(left.as_ref(), sink, shutdown).await? else {
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
        let client =
            transport::open(cfg.replication.as_ref().unwrap_or(&p.server), &settings).await?;
        if cfg.replication.is_some()
            && !catalog::slot_held_by(&p.side, &cfg.slot, &cfg.application_name).await?
        {
            return Err(SourceError::ServersDiffer {
                detail: format!(
                    "the stream started on slot {}, but on the server behind --database-url no \
                     walsender of application_name {} holds it",
                    cfg.slot, cfg.application_name
                ),
            }
            .into());
        }
        let silence = watchdog::silence_bound(p.wal_sender_timeout, settings.status_interval)
            * self.watchdog_scale;
        self.metrics.standby.set(0);
        self.health.set_streaming(true, silence);
        *streamed = true;
        tracing::info!(slot = %cfg.slot, start = %start, status_interval_ms = settings.status_interval.as_millis() as u64, "streaming");

        let (readings_tx, readings) = watch::channel(None);
        let (ceiling_tx, ceiling) = watch::channel(None);
        // A graceful stop of this session: the process's shutdown,
        // --stop-at-lsn reached, or a publication gap to heal.
        let stop = shutdown.child_token();
        let monitor = AbortOnDropHandle::new(tokio::spawn(monitor::monitor_slot(
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
                backfill_margin: cfg.backfill_margin,
                at_start: Some(p.membership.clone()),
            },
            MonitorOutputs {
                metrics: self.metrics.clone(),
                health: Arc::clone(self.health),
                readings: readings_tx,
                ceiling: ceiling_tx,
                heal: self.gap.clone().map(|window| monitor::GapHeal {
                    window,
                    stop: stop.clone(),
                }),
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
        let pipeline = Pipeline {
            unrouted: cfg.unrouted,
            // Read in the preflight: once streaming, nothing may wait on
            // the side connection outside the watchdog's bound.
            restreamed: std::mem::take(&mut p.restreamed),
            wal_budget,
            window: Some(window.clone()),
            ..Pipeline::new(
                Arc::new(GroupedStore::reporting_to(
                    Arc::clone(&p.side),
                    Arc::clone(self.health),
                )),
                self.metrics.clone(),
                Arc::clone(self.health),
                stop.clone(),
            )
        };
        // Parked rows of an endpoint no lane has would wait for ever, and
        // a lane that is that endpoint renamed would overtake them.
        let unrouted: Vec<String> = p
            .parked
            .iter()
            .filter(|name| !lanes.iter().any(|l| &l.name == *name))
            .cloned()
            .collect();
        if !unrouted.is_empty() {
            return Err(SourceError::ParkedUnrouted(unrouted).into());
        }
        for lane in lanes {
            // The session's deliveries start afresh; the breaker's circuit
            // and storm carry over.
            lane.breaker.new_session();
            park_at_start(lane, &p.parked);
        }
        let dispatcher = AbortOnDropHandle::new(tokio::spawn(dispatch::run(
            lanes.to_vec(),
            pipeline,
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
                m.seed_layout(&p.table.columns, p.table.never_dropped);
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
        let mut monitor = monitor;
        // The monitor ends the session only when the side connection turned
        // out pooled (exit 2); its other ends leave the stream to notice.
        let read = tokio::select! {
            read = stream.read_until_stopped(&stop, cfg.shutdown_timeout) => read,
            Ok(Some(e)) = &mut monitor => Err(e),
        };
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
        e: StreamError,
        side: &tokio_postgres::Client,
        row_filter: Option<&str>,
    ) -> StreamError {
        let StreamError::Source(SourceError::SlotPredatesPublication { publication, .. }) = &e
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
}

/// Sets `lane`'s parking switch for a session: thrown when the
/// dead-letter table still holds parked events of it (`parked`), so its
/// new events queue behind them (parked too) and never overtake them;
/// otherwise live.
fn park_at_start<S>(lane: &Lane<S>, parked: &[String]) {
    lane.park.resume();
    if parked.contains(&lane.name) {
        lane.park
            .throw("its earlier parked events wait in the dead-letter table".into());
        let until = if lane.cfg.auto_resume {
            "the relay replays those first, then returns it to live delivery"
        } else {
            "until those are replayed with the relay stopped (resume = \"manual\")"
        };
        tracing::warn!(
            endpoint = %lane.name,
            "endpoint starts parked: the dead-letter table holds parked events of it; its events are parked too, {until} (docs/operations.md#a-parked-endpoint)"
        );
    }
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
