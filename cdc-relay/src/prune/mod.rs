//! Outbox retention: delete rows that are older than a cutoff AND proven
//! delivered, in small batches; drop whole time-range partitions instead
//! when a partition is entirely old and delivered. By subject:
//!
//! - `proof`: prune marks, and which rows they prove done (the predicate
//!   every delete and every drop applies);
//! - `partitions`: the relations prune walks (the table, or its leaf
//!   partitions) and dropping a partition that is entirely old and done;
//! - `batches`: deleting a relation's rows in block-range batches;
//! - `schedule`: the relay's opt-in pruning (`run --prune-older-than`).
//!
//! The `prune` command (`commands/prune.rs`) drives the first three itself.
//! Deletes are not streamed: the publication is insert-only.

use std::time::Duration;

use crate::outbox::TableName;
use crate::source::SourceError;

mod batches;
mod partitions;
mod proof;
mod schedule;

pub use batches::{Batch, blocks_per_batch, delete_rows};
pub use partitions::{
    PartitionVerdict, Target, count_deletable, drop_partition, partition_verdict,
    range_upper_bound, table_bytes, targets,
};
pub use proof::{
    Probe, Proof, birthless_warning, check, count_dead_lettered, probe, unproven_message,
};
pub use schedule::{FIRST_TICK, Schedule, keep_pruning};

/// What to prune.
#[derive(Clone, Debug)]
pub struct PrunePlan {
    /// The outbox table.
    pub table: TableName,
    /// Column with the event id (matched against dead letters' `event_id`).
    pub id_column: String,
    /// Column with the row's insert time (the retention window applies to it).
    pub time_column: String,
    /// The slot whose confirmed position proves delivery.
    pub slot: String,
    /// Retention window: rows whose time column is older than now minus this
    /// may go.
    pub older_than: Duration,
    /// Rows per delete batch (approximate: batches are block ranges).
    pub batch_rows: u32,
    /// Pause between two batches.
    pub pause: Duration,
}

/// Why prune cannot go on. The command turns each into an exit code.
#[derive(Debug, thiserror::Error)]
pub enum PruneError {
    /// Something `setup` or the schema files create is missing (exit 3).
    #[error("{0}")]
    NeedsSetup(String),
    /// The slot was invalidated: rows since its last confirmed position may
    /// be needed by a backfill (exit 4).
    #[error(
        "replication slot {0:?} is invalidated: nothing is pruned, because the rows since its last confirmed position may be needed by `cdc-relay backfill`. Recover first (docs/operations.md, \"An invalidated slot\")"
    )]
    SlotInvalidated(String),
    /// No row can be proven delivered yet (exit 1): the message says why and
    /// what to do.
    #[error("{0}")]
    Unproven(String),
    /// A statement failed.
    #[error(transparent)]
    Source(#[from] SourceError),
}

impl PruneError {
    fn sql(context: &str, e: &tokio_postgres::Error) -> PruneError {
        PruneError::Source(SourceError::sql(context, e))
    }
}
