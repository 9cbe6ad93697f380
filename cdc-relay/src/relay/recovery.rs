//! What a session checks about the slot's position before it streams, and
//! the opt-in recovery of a slot lost in a failover.
//!
//! - **A slot that jumped ahead.** This process remembers where it left the
//!   slot ([`LeftAt`]). If it left events undelivered and the slot is now
//!   further on, and no other relay recorded progress since (the progress
//!   record, [`progress`]), the slot was dropped and recreated, or this is
//!   another server whose copy is not the slot it read: events in between
//!   were skipped upstream. The relay stops (exit 7) with the backfill
//!   command.
//! - **`--on-slot-loss=recreate-and-backfill`.** A missing slot (a failover
//!   to a server without a copy of it) is recreated, then the outbox rows
//!   committed since the progress record's last delivered transaction, minus
//!   a margin, are re-sent from the table before streaming starts. The
//!   receiver deduplicates by event id.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use super::RelayConfig;
use crate::backfill::{self, BackfillPlan};
use crate::lsn::Lsn;
use crate::sink::HttpSink;
use crate::source::catalog::{self, SlotInfo};
use crate::source::monitor::GapToHeal;
use crate::source::{self, ConnParams, SourceError, progress, slot_creation};

/// Where this process left the slot when a session ended.
#[derive(Clone, Debug, PartialEq)]
pub struct LeftAt {
    /// The last position this process sent as confirmed.
    pub sent: Lsn,
    /// Events were received and not done.
    pub pending: bool,
    /// When, seconds since the Unix epoch.
    pub at_unix: f64,
    /// Commit time of the last transaction it fully delivered (UTC text),
    /// the backfill start to suggest.
    pub last_done_commit: Option<String>,
}

/// What to do when the slot is missing.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OnSlotLoss {
    /// Stop (exit 3) with the steps: `setup`, then `backfill`.
    #[default]
    Stop,
    /// Recreate the slot, backfill from the progress record, then stream.
    RecreateAndBackfill,
}

/// What to do when the outbox was out of its publication for a while.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OnGap {
    /// Fail `/readyz` and log the exact `cdc-relay backfill` command.
    #[default]
    Tell,
    /// Once the table is back, re-send the gap's rows from the table, then
    /// stream on.
    Backfill,
}

/// A publication gap the slot monitor found, to heal before the next
/// session (`--on-gap backfill`), shared between the monitor and the
/// supervisor.
pub type GapWindow = Arc<std::sync::Mutex<Option<GapToHeal>>>;

/// `--on-gap backfill`: re-sends the outbox rows whose time column falls in
/// `[since - --backfill-margin, until)` through the pipeline, on
/// connections of its own, then records the membership that ended the gap
/// (until then the progress record keeps the old one, so a relay stopped
/// meanwhile finds the gap again at its next start). Returns the rows sent.
pub async fn heal_gap(
    cfg: &RelayConfig,
    sink: &HttpSink,
    gap: &GapToHeal,
    holder: &str,
) -> Result<u64, SourceError> {
    let side = Arc::new(source::connect_sql(&cfg.conn, &cfg.application_name).await?);
    let rows = backfill_since(&side, &cfg.conn, cfg, sink, &gap.since, Some(&gap.until)).await?;
    if let Err(e) =
        progress::record_membership(&side, &cfg.slot, holder, gap.start, &gap.membership).await
    {
        tracing::warn!(error = %crate::db_message(&e), "cannot record the publication membership after healing: the next start heals the same window again (harmless)");
    }
    Ok(rows)
}

/// Seconds since the Unix epoch, now.
pub fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Whether `slot` is where this process left it, or legitimately further:
/// `Err(SlotJumped)` when it left events undelivered, the slot is ahead of
/// what it confirmed, and no other relay recorded progress since.
pub async fn check_not_jumped(
    side: &Client,
    cfg: &RelayConfig,
    holder: &str,
    slot: &SlotInfo,
    left: Option<&LeftAt>,
) -> Result<(), SourceError> {
    let Some(left) = left.filter(|l| l.pending) else {
        return Ok(());
    };
    let Some(now) = slot.confirmed_flush_lsn.filter(|now| *now > left.sent) else {
        return Ok(());
    };
    let record = progress::read(side, &cfg.slot).await?;
    if let Some(r) = &record
        && r.holder.as_deref() != Some(holder)
        && r.updated_unix > left.at_unix
    {
        tracing::info!(slot = %cfg.slot, holder = %crate::shown(&r.holder), "the slot moved on under another relay (its progress record says so)");
        return Ok(());
    }
    let since = left
        .last_done_commit
        .clone()
        .or_else(|| record.and_then(|r| r.commit_time))
        .unwrap_or_else(|| "<the time of the last event Billing received>".into());
    Err(SourceError::SlotJumped {
        slot: cfg.slot.clone(),
        now,
        left: left.sent,
        since,
    })
}

/// `--on-slot-loss=recreate-and-backfill`: creates the missing slot, then
/// re-sends the outbox rows committed since the progress record's last
/// delivered transaction minus `cfg.backfill_margin`. If the backfill does
/// not finish (shutdown, an error), the new slot is dropped again so the
/// next start repeats the whole recovery. Returns the new slot, or `None`
/// when shutdown interrupted it.
pub async fn recreate_and_backfill(
    side: &Arc<Client>,
    server: &ConnParams,
    cfg: &RelayConfig,
    sink: &HttpSink,
    shutdown: &CancellationToken,
) -> Result<Option<SlotInfo>, SourceError> {
    let record = progress::read(side, &cfg.slot).await?;
    let Some(since) = record.as_ref().and_then(|r| r.commit_time.clone()) else {
        return Err(SourceError::SlotMissing {
            slot: cfg.slot.clone(),
        });
    };
    let lsn = slot_creation::create_slot(
        side,
        server,
        &cfg.slot,
        cfg.failover,
        cfg.slot_create_timeout,
    )
    .await?;
    let margin = humantime::format_duration(cfg.backfill_margin).to_string();
    tracing::warn!(
        slot = %cfg.slot, created_at = %lsn, since = %since, margin = %margin,
        "the slot was missing (--on-slot-loss=recreate-and-backfill): recreated it; re-sending outbox rows committed since the last delivered transaction minus the margin before streaming"
    );
    let backfilled = tokio::select! {
        r = backfill_since(side, server, cfg, sink, &since, None) => Some(r),
        _ = shutdown.cancelled() => None,
    };
    match backfilled {
        Some(Ok(rows)) => {
            tracing::info!(slot = %cfg.slot, rows, "backfill after slot loss done; streaming from the new slot");
            catalog::slot_info(side, &cfg.slot).await
        }
        failed => {
            // Without the backfill the new slot would skip the gap for good:
            // drop it so the next start recovers again.
            let _ = side
                .execute("SELECT pg_drop_replication_slot($1)", &[&cfg.slot])
                .await;
            match failed {
                Some(Err(e)) => Err(e),
                _ => Ok(None),
            }
        }
    }
}

async fn backfill_since(
    side: &Arc<Client>,
    server: &ConnParams,
    cfg: &RelayConfig,
    sink: &HttpSink,
    since: &str,
    until: Option<&str>,
) -> Result<u64, SourceError> {
    let margin = Duration::from_secs(cfg.backfill_margin.as_secs());
    let since: String = side
        .query_one(
            "SELECT ($1::text::timestamptz - make_interval(secs => $2))::text",
            &[&since, &(margin.as_secs_f64())],
        )
        .await
        .map_err(|e| SourceError::sql("computing the backfill start", &e))?
        .get(0);
    let mut reader = source::connect_sql(server, &cfg.application_name).await?;
    let plan = BackfillPlan {
        table: cfg.table.clone(),
        columns: cfg.columns.clone(),
        time_column: cfg.time_column.clone(),
        since,
        until: until.map(str::to_owned),
        window_events: cfg.window_events,
        window_bytes: cfg.window_bytes,
    };
    let report = backfill::run(
        &mut reader,
        Arc::clone(side),
        sink.clone(),
        cfg.dispatch.clone(),
        &plan,
        backfill::BackfillControl::default(),
    )
    .await
    .map_err(|e| SourceError::Transient(format!("backfill from the outbox table: {e}")))?;
    Ok(report.rows)
}
