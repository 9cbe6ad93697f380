//! Waiting without streaming: a hot standby's poll of what blocks its slot
//! (the slot held elsewhere, or another split streaming), and the
//! `--stop-at-lsn` watcher that ends a session once it is confirmed there.

use std::time::Duration;

use rand::Rng;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::RelayConfig;
use crate::dispatch::Confirmed;
use crate::lsn::Lsn;
use crate::source::{self, SourceError, shards};

/// The hot-standby error for what keeps `cfg`'s relay from streaming now
/// ([`shards::blocker`]), `None` when nothing does.
pub(super) async fn blocked(
    client: &tokio_postgres::Client,
    cfg: &RelayConfig,
) -> Result<Option<SourceError>, SourceError> {
    let (base, split) = match &cfg.shard {
        Some(s) => (s.slot_base.as_str(), Some(s.shard)),
        None => (cfg.slot.as_str(), None),
    };
    Ok(shards::blocker(client, &cfg.slot, base, split)
        .await?
        .map(|(holder, pid)| {
            if holder == cfg.slot {
                SourceError::SlotActive { slot: holder, pid }
            } else {
                SourceError::OtherSplitActive {
                    slot: cfg.slot.clone(),
                    other: holder,
                    pid,
                }
            }
        }))
}

/// The `application_name` of the walsender `pid` (the slot's holder), read
/// on the hot standby's poll connection (made if there is none); `None`
/// when it cannot be read (the walsender ended, the connection failed).
pub(super) async fn holder_name(
    cfg: &RelayConfig,
    poller: &mut Option<tokio_postgres::Client>,
    pid: i32,
) -> Option<String> {
    let client = poll_client(cfg, poller).await?;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&pid];
    let read = client.query_opt(
        "SELECT application_name FROM pg_stat_replication WHERE pid = $1",
        &params,
    );
    let row = tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .ok()?
        .ok()??;
    row.get(0)
}

/// The hot standby's poll connection, made when there is none (or it
/// closed); `None` when it cannot be made within twice the connect timeout.
async fn poll_client<'a>(
    cfg: &RelayConfig,
    poller: &'a mut Option<tokio_postgres::Client>,
) -> Option<&'a tokio_postgres::Client> {
    if poller.as_ref().is_none_or(|c| c.is_closed()) {
        let connect = source::connect_primary(&cfg.conn, &cfg.application_name);
        let (client, _closed, _server) =
            tokio::time::timeout(cfg.conn.connect_timeout * 2, connect)
                .await
                .ok()?
                .ok()?;
        *poller = Some(client);
    }
    poller.as_ref()
}

/// A hot standby's wait: polls [`blocked`] every 250-750 ms on one kept
/// connection (not a new one per poll) and returns once nothing blocks,
/// at shutdown, or when the poll fails (the next session attempt then
/// reconnects and reports). Returns `false` at shutdown.
pub(super) async fn wait_while_blocked(
    cfg: &RelayConfig,
    poller: &mut Option<tokio_postgres::Client>,
    shutdown: &CancellationToken,
) -> bool {
    loop {
        // Take over within ~1 s of the active relay dying.
        let pause = Duration::from_millis(rand::rng().random_range(250..750));
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = shutdown.cancelled() => return false,
        }
        let Some(client) = poll_client(cfg, poller).await else {
            return true;
        };
        match tokio::time::timeout(Duration::from_secs(5), blocked(client, cfg)).await {
            Ok(Ok(Some(_))) => {}
            Ok(Ok(None)) => {
                *poller = None;
                return true;
            }
            _ => {
                *poller = None;
                return true;
            }
        }
    }
}

/// Cancels `stop` once the confirmed position reaches `at`
/// (`--stop-at-lsn`): the session then drains and ends like on SIGTERM,
/// its last standby status update carrying that position.
pub(super) async fn stop_when_confirmed(
    mut confirmed: watch::Receiver<Confirmed<Lsn>>,
    at: Lsn,
    stop: CancellationToken,
    slot: String,
) {
    while confirmed.borrow_and_update().position < at {
        if confirmed.changed().await.is_err() {
            return;
        }
    }
    tracing::info!(slot = %slot, stop_at_lsn = %at, "confirmed at --stop-at-lsn: stopping");
    stop.cancel();
}
