//! `cdc-relay run`'s engine: supervises replication sessions.
//!
//! ```text
//! loop:  side connection ─▶ preflight checks ─▶ transport::open (START_REPLICATION)
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

use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::dispatch::Lane;
use crate::health::Health;
use crate::metrics::Metrics;
use crate::sink::HttpSink;
use crate::source::monitor::GapToHeal;
use crate::source::stream::StreamError;
use crate::source::{SourceError, progress};

mod config;
mod preflight;
mod recovery;
mod session;
mod standby;

pub use config::{RelayConfig, ShardOf};
pub use recovery::{GapWindow, LeftAt, OnGap, OnSlotLoss};
use session::Session;
use standby::wait_while_blocked;

/// First reconnect delay ceiling; doubles per failed session up to
/// `--reconnect-max`.
pub const RECONNECT_BASE: Duration = Duration::from_millis(100);

/// Runs sessions until `shutdown` is cancelled (returns `Ok`) or a definite
/// error occurs, delivering to `lanes` (whose breakers live as long as the
/// process: a reconnect keeps an open circuit open and a poison storm a
/// storm).
pub async fn run(
    cfg: RelayConfig,
    lanes: Vec<Lane<HttpSink>>,
    metrics: Metrics,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> Result<(), StreamError> {
    let mut reconnect = Backoff::new(RECONNECT_BASE, cfg.reconnect_max, Duration::ZERO);
    let mut standby_logged = false;
    // Each watchdog reconnect doubles the silence it tolerates (up to 16x):
    // a walsender replaying a huge transaction reads no replies for a long
    // time, and reconnecting restarts that replay from the beginning.
    let mut watchdog_scale: u32 = 1;
    let holder = progress::holder(&cfg.application_name);
    // Where this process left the slot when its last session ended.
    let mut left: Option<LeftAt> = None;
    // A hot standby's connection for its polls.
    let mut poller: Option<tokio_postgres::Client> = None;
    // A publication gap to heal before the next session (--on-gap backfill).
    let gap: GapWindow = GapWindow::default();
    loop {
        if shutdown.is_cancelled() {
            return Ok(());
        }
        let window = gap.lock().expect("never poisoned").clone();
        if let Some(window) = window {
            match heal(&cfg, &lanes[0].sink, &window, &holder, &metrics, &shutdown).await {
                Some(Ok(())) => *gap.lock().expect("never poisoned") = None,
                None => return Ok(()),
                Some(Err(e)) => {
                    let d = reconnect.next_delay(None, &mut rand::rng());
                    tracing::error!(error = %e, retry_in_ms = d.as_millis() as u64, "healing the publication gap failed; trying again before streaming");
                    tokio::select! {
                        _ = tokio::time::sleep(d) => {}
                        _ = shutdown.cancelled() => return Ok(()),
                    }
                    continue;
                }
            }
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
            gap: (cfg.on_gap == OnGap::Backfill).then(|| Arc::clone(&gap)),
        };
        let outcome = session
            .run(&lanes, &shutdown, &mut streamed, &mut left)
            .await;
        drop(permit);
        if let Err(StreamError::Source(SourceError::SlotJumped { .. })) = &outcome {
            metrics.slot_jumps.inc();
        }
        health.set_streaming(false, Duration::ZERO);
        metrics.pending_events.set(0); // the session's pipeline is gone
        for l in &lanes {
            l.metrics.pending.set(0);
            l.metrics.oldest_pending_age.set(0.0);
        }
        watchdog_scale = match &outcome {
            Err(StreamError::Source(SourceError::Stalled(_))) => (watchdog_scale * 2).min(16),
            _ if streamed => 1,
            _ => watchdog_scale,
        };
        if streamed {
            // A session that streamed was healthy: the next reconnect starts
            // the backoff over instead of sleeping near the cap.
            reconnect.reset();
        }
        let source_err = match outcome {
            // The monitor ended the session to heal a gap: at once.
            Ok(()) if gap.lock().expect("never poisoned").is_some() => continue,
            Ok(()) => return Ok(()),
            Err(StreamError::Source(e)) if !e.is_definite() => e,
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
                        let name = match pid {
                            Some(pid) => standby::holder_name(&cfg, &mut poller, *pid).await,
                            None => None,
                        };
                        match name {
                            Some(name) if name != cfg.application_name => {
                                // Not this deployment's relays (they share
                                // the application_name): a consumer that
                                // confirms what it reads takes the events
                                // from every relay for good.
                                tracing::warn!(slot = %cfg.slot, active_pid = %crate::shown(pid), holder_application_name = %name, application_name = %cfg.application_name,
                                    "slot is held by a process whose application_name is not this relay's: if it is not a cdc-relay of this deployment \
                                     (pg_recvlogical, another tool given this slot), every event it reads and confirms is never delivered; stop it \
                                     (SELECT pg_terminate_backend(active_pid)) and backfill from when it started (docs/operations.md#ha-standby); waiting as hot standby");
                            }
                            _ => {
                                tracing::info!(slot = %cfg.slot, active_pid = %crate::shown(pid), "slot is held by another process; waiting as hot standby");
                            }
                        }
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

/// Heals one publication gap (`--on-gap backfill`); `None` when shutdown
/// interrupted it (the progress record still holds the old membership, so
/// the next start finds and heals the gap again).
async fn heal(
    cfg: &RelayConfig,
    sink: &HttpSink,
    gap: &GapToHeal,
    holder: &str,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Option<Result<(), SourceError>> {
    let (since, until) = (&gap.since, &gap.until);
    tracing::warn!(slot = %cfg.slot, since = %since, until = %until, "healing a publication gap (--on-gap backfill): re-sending the outbox rows of its window from the table before streaming on");
    let healed = tokio::select! {
        r = recovery::heal_gap(cfg, sink, gap, holder) => r,
        _ = shutdown.cancelled() => {
            tracing::warn!(since = %since, until = %until, "stopping before the publication gap was healed: the next start with --on-gap backfill heals it (without it: cdc-relay backfill --since the time {since} minus --backfill-margin, --until '{until}')");
            return None;
        }
    };
    Some(healed.map(|rows| {
        metrics.gaps_healed.inc();
        tracing::info!(slot = %cfg.slot, rows, since = %since, until = %until, "publication gap healed: its window's rows were re-sent (the receiver deduplicates); streaming on");
    }))
}
