//! Deleting in batches. Each relation (the table, or each leaf partition)
//! is walked by physical block ranges (`ctid` ranges: a TID range scan,
//! PostgreSQL 14+), sized from the planner's rows-per-page estimate so that a batch
//! deletes about `batch_rows` rows; each batch is its own short
//! transaction, with a pause between batches. The walk is linear however
//! many rows were deleted before (no rescans of dead tuples).

use tokio_postgres::Client;

use super::partitions::Target;
use super::proof::{Proof, deletable};
use super::{PruneError, PrunePlan};
use crate::source::catalog::quote_table;

/// The largest valid heap block number (`InvalidBlockNumber` - 1).
const MAX_BLOCK: i64 = 0xFFFF_FFFE;

/// Blocks per batch so that a batch holds about `batch_rows` rows.
pub fn blocks_per_batch(batch_rows: u32, rows_per_block: f64) -> i64 {
    let per_block = if rows_per_block.is_finite() && rows_per_block >= 1.0 {
        rows_per_block
    } else {
        1.0
    };
    ((f64::from(batch_rows) / per_block).floor() as i64).max(1)
}

/// One delete batch, reported to the caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// The relation it walked.
    pub relation: String,
    /// Blocks `[first, end)` it covered.
    pub first_block: i64,
    /// End of the range (exclusive).
    pub end_block: i64,
    /// Rows it deleted.
    pub rows: u64,
}

/// Deletes the rows of `t` that may go, walking its blocks in batches
/// with `plan.pause` between them; `on_batch` sees each batch. Returns the
/// rows deleted. Stops early (between batches) when `stop` says so.
pub async fn delete_rows(
    client: &Client,
    plan: &PrunePlan,
    proof: &Proof,
    cutoff: &str,
    t: &Target,
    mut on_batch: impl FnMut(&Batch),
    stop: impl Fn() -> bool,
) -> Result<u64, PruneError> {
    // Through the root, so the relay needs DELETE on the outbox only (not
    // on each partition); `tableoid` picks the partition, the TID range
    // scan the blocks.
    let sql = format!(
        "DELETE FROM {table} o WHERE o.tableoid = $1 \
           AND o.ctid >= format('(%s,0)', $2::int8)::tid AND o.ctid < format('(%s,0)', $3::int8)::tid \
           AND {pred}",
        table = quote_table(&plan.table),
        pred = deletable(
            plan,
            "$4::text::timestamptz",
            "$5::text::xid8",
            "$6::text::xid8"
        )
    );
    let statement = client
        .prepare(&sql)
        .await
        .map_err(|e| PruneError::sql("preparing the delete batch", &e))?;
    let step = blocks_per_batch(plan.batch_rows, t.rows_per_block);
    let mut total = 0;
    let mut first = 0;
    while first < t.blocks {
        if stop() {
            break;
        }
        let end = (first + step).min(t.blocks);
        // The last batch reaches past the end (the largest block number):
        // rows appended meanwhile are newer, but may be deletable too.
        let bound = if end == t.blocks { MAX_BLOCK } else { end };
        let rows = client
            .execute(
                &statement,
                &[
                    &t.oid,
                    &first,
                    &bound,
                    &cutoff,
                    &proof.xid_horizon,
                    &proof.birth_horizon,
                ],
            )
            .await
            .map_err(|e| PruneError::sql("deleting a batch of outbox rows", &e))?;
        total += rows;
        on_batch(&Batch {
            relation: t.name.clone(),
            first_block: first,
            end_block: end,
            rows,
        });
        first = end;
        if first < t.blocks && rows > 0 {
            tokio::time::sleep(plan.pause).await;
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_hold_about_the_asked_rows() {
        assert_eq!(blocks_per_batch(5000, 50.0), 100);
        assert_eq!(blocks_per_batch(10, 50.0), 1);
        assert_eq!(blocks_per_batch(100, 0.0), 100);
        assert_eq!(blocks_per_batch(100, f64::NAN), 100);
    }
}
