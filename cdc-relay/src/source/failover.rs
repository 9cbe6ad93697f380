//! Failover slots (PostgreSQL 17+): is the slot safe to lose the primary?
//!
//! A logical slot created with `FAILOVER` is copied to standbys that run
//! with `sync_replication_slots = on`. A fresh copy is *temporary* until the
//! primary's slot has advanced past the standby's catalog xmin — which needs
//! a consumer making progress and a running-xacts record
//! (`pg_log_standby_snapshot()`), so on an idle primary it may never happen —
//! and a temporary copy is dropped at promotion. The relay therefore reads
//! each standby's copy (`--standby-url`), exports
//! `cdc_relay_failover_ready` (1 only while every listed standby holds a
//! persistent, synced copy within `--failover-max-lag`), and while a copy is
//! temporary calls `pg_log_standby_snapshot()` on the primary at most every
//! [`NUDGE_INTERVAL`].
//!
//! Without `synchronized_standby_slots` naming the standbys' physical slots,
//! the primary may confirm (and the relay deliver) WAL a standby has not
//! received yet: after its promotion those events are phantoms. `setup
//! --failover` warns when the setting is empty.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::Client;

use super::catalog::{self, SlotReading, supports_failover_slots};
use super::conn::ConnParams;
use super::error::SourceError;
use crate::lsn::Lsn;
use crate::metrics::Metrics;

// `relay` reads the version through this module.

/// Least time between two `pg_log_standby_snapshot()` calls.
pub const NUDGE_INTERVAL: Duration = Duration::from_secs(5);

/// The slot's `failover` flag; `None` before 17 or when the slot is missing.
pub async fn slot_failover(client: &Client, slot: &str) -> Result<Option<bool>, SourceError> {
    if !supports_failover_slots(catalog::server_version(client).await?) {
        return Ok(None);
    }
    let row = client
        .query_opt(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| SourceError::sql("reading the slot's failover flag", &e))?;
    Ok(row.map(|r| r.get(0)))
}

/// The primary's `synchronized_standby_slots` (17+; `None` before).
pub async fn synchronized_standby_slots(client: &Client) -> Result<Option<String>, SourceError> {
    if !supports_failover_slots(catalog::server_version(client).await?) {
        return Ok(None);
    }
    catalog::setting(client, "synchronized_standby_slots")
        .await
        .map(Some)
}

/// A standby's copy of the slot.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct StandbyCopy {
    /// The standby (`user@host:port/db`).
    pub standby: String,
    /// Why it could not be read, if it could not.
    pub error: Option<String>,
    /// The server is not in recovery: a primary, not a standby (after a
    /// failover a listed standby is the new primary). It holds no copy to
    /// count and is left out of `cdc_relay_failover_ready`.
    pub primary: bool,
    /// Whether the standby has a copy of the slot.
    pub exists: bool,
    /// `pg_replication_slots.synced`: maintained by slot sync.
    pub synced: bool,
    /// `pg_replication_slots.temporary`: a temporary copy is dropped at
    /// promotion.
    pub temporary: bool,
    /// The copy's `confirmed_flush_lsn`.
    pub confirmed_flush_lsn: Option<Lsn>,
    /// Bytes the copy is behind the primary's slot, when both are known.
    pub lag_bytes: Option<u64>,
}

impl StandbyCopy {
    /// A copy not read (yet): `error` says why, if known.
    pub fn unread(standby: &str, error: Option<String>) -> StandbyCopy {
        StandbyCopy {
            standby: standby.to_owned(),
            error,
            primary: false,
            exists: false,
            synced: false,
            temporary: false,
            confirmed_flush_lsn: None,
            lag_bytes: None,
        }
    }

    /// Whether a promotion of this standby would keep the slot, within
    /// `max_lag` bytes of the primary's.
    pub fn ready(&self, max_lag: u64) -> bool {
        self.exists
            && self.synced
            && !self.temporary
            && self.lag_bytes.is_some_and(|l| l <= max_lag)
    }
}

/// Reads `slot`'s copy on the standby behind `client`; `primary` is the
/// primary slot's `confirmed_flush_lsn` (for the lag).
pub async fn read_copy(
    client: &Client,
    standby: &str,
    slot: &str,
    primary: Option<Lsn>,
) -> StandbyCopy {
    let mut copy = StandbyCopy::unread(standby, None);
    match client.query_one("SELECT pg_is_in_recovery()", &[]).await {
        Err(e) => {
            copy.error = Some(crate::db_message(&e));
            return copy;
        }
        Ok(r) if !r.get::<_, bool>(0) => {
            copy.primary = true;
            return copy;
        }
        Ok(_) => {}
    }
    let row = client
        .query_opt(
            "SELECT synced, temporary, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await;
    match row {
        Err(e) => copy.error = Some(crate::db_message(&e)),
        Ok(None) => {}
        Ok(Some(r)) => {
            copy.exists = true;
            copy.synced = r.get(0);
            copy.temporary = r.get(1);
            copy.confirmed_flush_lsn = r.get::<_, Option<String>>(2).and_then(|s| s.parse().ok());
            copy.lag_bytes = match (primary, copy.confirmed_flush_lsn) {
                (Some(p), Some(c)) => Some(p.bytes_since(c)),
                _ => None,
            };
        }
    }
    copy
}

/// Settings of the failover watch.
#[derive(Clone, Debug)]
pub struct FailoverSettings {
    /// The slot.
    pub slot: String,
    /// The standbys to read (`--standby-url`).
    pub standbys: Vec<ConnParams>,
    /// Largest lag a ready copy may have, bytes.
    pub max_lag: u64,
    /// Time between readings while every copy is ready.
    pub interval: Duration,
}

/// Reads every standby's copy until the session ends: exports
/// `cdc_relay_failover_ready`, and nudges the primary with
/// `pg_log_standby_snapshot()` while a copy is missing or temporary.
/// Standby connections are kept and reopened when they fail.
pub async fn watch_copies(
    primary: Arc<Client>,
    settings: FailoverSettings,
    metrics: Metrics,
    mut readings: watch::Receiver<SlotReading>,
) {
    let mut clients: Vec<Option<Client>> = settings.standbys.iter().map(|_| None).collect();
    // Each standby's last connection error: said at WARN when it changes,
    // not at every pass (every 5 s while the copy is not ready).
    let mut failing: Vec<Option<String>> = settings.standbys.iter().map(|_| None).collect();
    let mut last_nudge: Option<tokio::time::Instant> = None;
    loop {
        let confirmed = readings
            .borrow_and_update()
            .as_ref()
            .and_then(|(_, info)| info.confirmed_flush_lsn);
        let mut copies = Vec::new();
        for ((conn, client), failed) in settings
            .standbys
            .iter()
            .zip(clients.iter_mut())
            .zip(failing.iter_mut())
        {
            if client.as_ref().is_none_or(Client::is_closed) {
                *client = connect_standby(conn, failed).await;
            }
            let copy = match client {
                Some(c) => read_copy(c, &conn.display(), &settings.slot, confirmed).await,
                None => StandbyCopy::unread(&conn.display(), failed.clone()),
            };
            // A listed server out of recovery is a primary (the one the
            // relay streams from, after a failover): no standby to count.
            if !copy.primary {
                copies.push(copy);
            }
        }
        let ready = !copies.is_empty() && copies.iter().all(|c| c.ready(settings.max_lag));
        metrics.failover_ready.set(i64::from(ready));
        let needs_snapshot = copies
            .iter()
            .any(|c| c.error.is_none() && (!c.exists || c.temporary));
        if needs_snapshot && last_nudge.is_none_or(|t| t.elapsed() >= NUDGE_INTERVAL) {
            last_nudge = Some(tokio::time::Instant::now());
            if let Err(e) = primary
                .execute("SELECT pg_log_standby_snapshot()", &[])
                .await
            {
                tracing::warn!(error = %crate::db_message(&e), "cannot call pg_log_standby_snapshot() (grant EXECUTE to the relay role: sql/roles.sql)");
            }
        }
        if !ready {
            tracing::debug!(?copies, "failover not ready");
        }
        let next = if ready {
            settings.interval
        } else {
            NUDGE_INTERVAL
        };
        tokio::time::sleep(next).await;
    }
}

/// Connects to one `--standby-url` server. A failure is logged at WARN
/// with its cause when it differs from this standby's last one (`failed`
/// keeps it), and a recovery at INFO: an operator who listed a standby
/// learns at the default log level why its copy stays unread.
async fn connect_standby(conn: &ConnParams, failed: &mut Option<String>) -> Option<Client> {
    match super::connect_sql(conn, "cdc-relay-failover-check").await {
        Ok(client) => {
            if failed.take().is_some() {
                tracing::info!(standby = %conn.display(), "connected to the standby again");
            }
            Some(client)
        }
        Err(e) => {
            let cause = format!("cannot connect: {e}");
            if failed.as_deref() != Some(cause.as_str()) {
                tracing::warn!(
                    standby = %conn.display(),
                    error = %e,
                    "cannot connect to a --standby-url server: its copy of the slot is unread \
                     and cdc_relay_failover_ready stays 0 (retried every 5s)"
                );
            }
            *failed = Some(cause);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_ready_only_synced_persistent_and_close() {
        let copy = StandbyCopy {
            standby: "s".into(),
            error: None,
            primary: false,
            exists: true,
            synced: true,
            temporary: false,
            confirmed_flush_lsn: Some(Lsn::new(90)),
            lag_bytes: Some(10),
        };
        assert!(copy.ready(16));
        assert!(!copy.ready(5), "too far behind");
        assert!(
            !StandbyCopy {
                temporary: true,
                ..copy.clone()
            }
            .ready(16)
        );
        assert!(
            !StandbyCopy {
                synced: false,
                ..copy.clone()
            }
            .ready(16)
        );
        assert!(
            !StandbyCopy {
                lag_bytes: None,
                ..copy
            }
            .ready(16)
        );
    }
}
