//! The relay's configuration: what `run` needs, built by `settings`.

use std::sync::Arc;
use std::time::Duration;

use super::OnSlotLoss;
use crate::dispatch::{DispatchConfig, Unrouted};
use crate::lsn::Lsn;
use crate::outbox::{OutboxColumns, TableName};
use crate::source::ConnParams;
use crate::source::shards::Shard;

/// Everything `run` needs.
#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// Connection to the source database (the relay role).
    pub conn: ConnParams,
    /// The replication connection's own server (`--replication-url`);
    /// `None`: the server `conn` chose.
    pub replication: Option<ConnParams>,
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
    /// Delivery settings (of `--sink-url`'s endpoint; a recovery backfill's).
    pub dispatch: DispatchConfig,
    /// What happens to an event no endpoint takes (routes file
    /// `unrouted`).
    pub unrouted: Unrouted,
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
    /// How long creating a slot may wait (`--slot-create-timeout`).
    pub slot_create_timeout: Duration,
    /// Stream from a server whose encoding is not UTF8.
    pub allow_non_utf8: bool,
    /// What to do when the slot is missing.
    pub on_slot_loss: OnSlotLoss,
    /// What to do about a publication gap.
    pub on_gap: super::OnGap,
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
