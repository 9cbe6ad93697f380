//! Scenario j's readings, once a second while a run goes on: the slot's
//! retained WAL and the server's WAL position and fsync count (from the
//! bench's own superuser connection), and how many events billing holds in
//! the relay (its `/metrics`).

use std::time::{Duration, Instant};

use harness::prom;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use super::ENDPOINTS;
use crate::Ctx;

/// One reading.
pub(super) struct Reading {
    /// Seconds from the sampler's start (the window's).
    pub(super) at_s: f64,
    /// `pg_current_wal_lsn() − restart_lsn`, bytes.
    pub(super) retained: i64,
    /// `pg_current_wal_lsn()`, bytes from 0/0.
    pub(super) wal: i64,
    /// `pg_stat_wal.wal_sync`: WAL fsyncs since the cluster started (or
    /// its statistics were reset).
    pub(super) wal_syncs: i64,
    /// `cdc_relay_endpoint_pending_events{endpoint="billing"}`: every event
    /// goes to billing, so this is how full the shared window is.
    pub(super) billing_pending: Option<f64>,
}

/// The sampling task.
pub(super) struct Sampler {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Vec<Reading>>,
}

impl Sampler {
    /// Stops sampling; the readings so far.
    pub(super) async fn stop(self) -> anyhow::Result<Vec<Reading>> {
        let _ = self.stop.send(());
        Ok(self.task.await?)
    }
}

/// Starts reading `slot` and the relay's metrics at `admin` every second.
pub(super) async fn start(ctx: &Ctx, slot: &str, admin: &str) -> anyhow::Result<Sampler> {
    let db = ctx.cluster.connect_superuser("postgres").await?;
    let stmt = db
        .prepare(
            "SELECT (pg_current_wal_lsn() - restart_lsn)::int8,
                    (pg_current_wal_lsn() - '0/0')::int8,
                    (SELECT wal_sync FROM pg_stat_wal)
             FROM pg_replication_slots WHERE slot_name = $1",
        )
        .await?;
    let slot = slot.to_owned();
    let (http, admin) = (ctx.http.clone(), admin.to_owned());
    let (stop, mut stopped) = oneshot::channel::<()>();
    let t0 = Instant::now();
    let task = tokio::spawn(async move {
        let mut readings = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = &mut stopped => return readings,
                _ = tick.tick() => {}
            }
            let billing_pending = prom::scrape(&http, &admin).await.ok().and_then(|m| {
                m.value(
                    "cdc_relay_endpoint_pending_events",
                    &[("endpoint", ENDPOINTS[0])],
                )
            });
            if let Ok(row) = db.query_one(&stmt, &[&slot]).await {
                readings.push(Reading {
                    at_s: t0.elapsed().as_secs_f64(),
                    retained: row.get(0),
                    wal: row.get(1),
                    wal_syncs: row.get(2),
                    billing_pending,
                });
            }
        }
    });
    Ok(Sampler { stop, task })
}
