//! The relations prune walks: the outbox itself, or each of its leaf
//! partitions; and a range partition on the time column that lies entirely
//! before the cutoff, with every row in it proven done, is detached and
//! dropped whole instead of deleted row by row.

use tokio_postgres::Client;

use super::proof::{Proof, deletable};
use super::{PruneError, PrunePlan};
use crate::source::catalog::{quote_ident, quote_table};

/// Rows per heap page assumed when the planner has no estimate yet (a table
/// never analyzed): the outbox's rows are a few hundred bytes.
const DEFAULT_ROWS_PER_BLOCK: f64 = 40.0;

/// A relation prune walks: the table itself, or one of its leaf partitions.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// Its OID.
    pub oid: u32,
    /// `"schema"."name"`, quoted.
    pub name: String,
    /// Heap blocks now.
    pub blocks: i64,
    /// The planner's rows per block (`reltuples / relpages`), or a default.
    pub rows_per_block: f64,
    /// For a range partition of the outbox on the time column: its upper
    /// bound (`TO (...)`, exclusive), as timestamptz input text.
    pub upper_bound: Option<String>,
}

/// The relations to walk: the outbox's leaf partitions, or the table.
pub async fn targets(client: &Client, plan: &PrunePlan) -> Result<Vec<Target>, PruneError> {
    let rows = client
        .query(
            "WITH root AS (SELECT $1::text::regclass AS r), \
             leaves AS ( \
               SELECT t.relid FROM root, pg_partition_tree(root.r) t WHERE t.isleaf \
               UNION ALL \
               SELECT r FROM root WHERE NOT EXISTS (SELECT 1 FROM pg_partition_tree(root.r))) \
             SELECT c.oid, format('%I.%I', n.nspname, c.relname), \
                    (pg_relation_size(c.oid) / current_setting('block_size')::int)::int8, \
                    c.reltuples::float8, c.relpages::int8, \
                    pg_get_expr(c.relpartbound, c.oid), \
                    (SELECT pg_get_partkeydef(i.inhparent) FROM pg_inherits i, root \
                      WHERE i.inhrelid = c.oid AND i.inhparent = root.r) \
             FROM leaves l JOIN pg_class c ON c.oid = l.relid \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             ORDER BY 2",
            &[&quote_table(&plan.table)],
        )
        .await
        .map_err(|e| PruneError::sql("listing the outbox's partitions", &e))?;
    Ok(rows
        .iter()
        .map(|r| {
            let (tuples, pages): (f64, i64) = (r.get(3), r.get(4));
            let rows_per_block = if tuples > 0.0 && pages > 0 {
                tuples / pages as f64
            } else {
                DEFAULT_ROWS_PER_BLOCK
            };
            let bound: Option<String> = r.get(5);
            let key: Option<String> = r.get(6);
            Target {
                oid: r.get(0),
                name: r.get(1),
                blocks: r.get(2),
                rows_per_block,
                upper_bound: match (bound, key) {
                    (Some(b), Some(k)) => range_upper_bound(&b, &k, &plan.time_column),
                    _ => None,
                },
            }
        })
        .collect())
}

/// The exclusive upper bound of a range partition whose key is exactly
/// `time_column`, from `pg_get_expr(relpartbound)` (`FOR VALUES FROM
/// ('…') TO ('…')`) and `pg_get_partkeydef` (`RANGE (occurred_at)`).
/// `None` for any other partitioning, `DEFAULT` or `MAXVALUE`.
pub fn range_upper_bound(bound: &str, partkey: &str, time_column: &str) -> Option<String> {
    let key = partkey.strip_prefix("RANGE (")?.strip_suffix(')')?;
    if key != time_column && key != quote_ident(time_column) {
        return None;
    }
    let (_, to) = bound
        .strip_prefix("FOR VALUES FROM (")?
        .split_once(") TO (")?;
    let value = to.strip_suffix(')')?;
    let inner = value.strip_prefix('\'')?.strip_suffix('\'')?;
    Some(inner.replace("''", "'"))
}

/// What a partition holds against the proof.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PartitionVerdict {
    /// Rows in it.
    pub rows: i64,
    /// Rows that may not go (too recent, not proven, or dead-lettered).
    pub kept: i64,
}

/// Whether partition `t` lies entirely before `cutoff` (its upper bound at
/// or before it), and what its rows say against the proof.
pub async fn partition_verdict(
    client: &Client,
    plan: &PrunePlan,
    proof: &Proof,
    cutoff: &str,
    t: &Target,
) -> Result<Option<PartitionVerdict>, PruneError> {
    let Some(upper) = &t.upper_bound else {
        return Ok(None);
    };
    let old: bool = client
        .query_one(
            "SELECT $1::text::timestamptz <= $2::text::timestamptz",
            &[upper, &cutoff],
        )
        .await
        .map_err(|e| PruneError::sql("comparing a partition's bound with the cutoff", &e))?
        .get(0);
    if !old {
        return Ok(None);
    }
    Ok(Some(verdict(client, plan, proof, cutoff, &t.name).await?))
}

async fn verdict(
    client: &Client,
    plan: &PrunePlan,
    proof: &Proof,
    cutoff: &str,
    relation: &str,
) -> Result<PartitionVerdict, PruneError> {
    let row = client
        .query_one(
            &verdict_sql(plan, relation),
            &[&cutoff, &proof.xid_horizon, &proof.birth_horizon],
        )
        .await
        .map_err(|e| PruneError::sql("reading a partition's rows", &e))?;
    Ok(PartitionVerdict {
        rows: row.get(0),
        kept: row.get(1),
    })
}

/// A partition's rows and how many of them must stay: `$1` the cutoff,
/// `$2` the proof's horizon, `$3` the slot's birth horizon.
fn verdict_sql(plan: &PrunePlan, relation: &str) -> String {
    format!(
        "SELECT count(*), count(*) FILTER (WHERE NOT coalesce({pred}, false)) FROM {relation} o",
        pred = deletable(
            plan,
            "$1::text::timestamptz",
            "$2::text::xid8",
            "$3::text::xid8"
        )
    )
}

/// Detaches and drops partition `t` when, with it locked, every row in it
/// may go; returns the rows dropped, or `None` when a row must stay (the
/// partition is then left attached, untouched). Needs the table's owner.
pub async fn drop_partition(
    client: &mut Client,
    plan: &PrunePlan,
    proof: &Proof,
    cutoff: &str,
    t: &Target,
) -> Result<Option<i64>, PruneError> {
    let tx = client
        .transaction()
        .await
        .map_err(|e| PruneError::sql("starting a transaction", &e))?;
    let ctx = "detaching a partition (needs the table's owner; lock_timeout 5 s)";
    tx.batch_execute(&format!(
        "SET LOCAL lock_timeout = '5s'; ALTER TABLE {} DETACH PARTITION {}",
        quote_table(&plan.table),
        t.name
    ))
    .await
    .map_err(|e| PruneError::sql(ctx, &e))?;
    // Detached and locked: no insert can land in it any more, and this
    // statement's snapshot sees every row committed into it.
    let row = tx
        .query_one(
            &verdict_sql(plan, &t.name),
            &[&cutoff, &proof.xid_horizon, &proof.birth_horizon],
        )
        .await
        .map_err(|e| PruneError::sql("re-reading a detached partition", &e))?;
    let (rows, kept): (i64, i64) = (row.get(0), row.get(1));
    if kept > 0 {
        tx.rollback()
            .await
            .map_err(|e| PruneError::sql("rolling back a detach", &e))?;
        return Ok(None);
    }
    tx.batch_execute(&format!("DROP TABLE {}", t.name))
        .await
        .map_err(|e| PruneError::sql("dropping a detached partition", &e))?;
    tx.commit()
        .await
        .map_err(|e| PruneError::sql("committing a partition drop", &e))?;
    Ok(Some(rows))
}

/// Rows of `t` that may go now (a dry run's count).
pub async fn count_deletable(
    client: &Client,
    plan: &PrunePlan,
    proof: &Proof,
    cutoff: &str,
    t: &Target,
) -> Result<i64, PruneError> {
    let v = verdict(client, plan, proof, cutoff, &t.name).await?;
    Ok(v.rows - v.kept)
}

/// `pg_total_relation_size` of the outbox (every partition), bytes.
pub async fn table_bytes(client: &Client, plan: &PrunePlan) -> Result<i64, PruneError> {
    Ok(client
        .query_one(
            "SELECT coalesce((SELECT sum(pg_total_relation_size(relid)) \
                              FROM pg_partition_tree($1::text::regclass)), \
                             pg_total_relation_size($1::text::regclass))::int8",
            &[&quote_table(&plan.table)],
        )
        .await
        .map_err(|e| PruneError::sql("reading the outbox's size", &e))?
        .get(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upper_bound_of_a_range_partition_on_the_time_column() {
        let b = "FOR VALUES FROM ('2000-01-01 00:00:00+00') TO ('2020-01-01 00:00:00+00')";
        assert_eq!(
            range_upper_bound(b, "RANGE (occurred_at)", "occurred_at").as_deref(),
            Some("2020-01-01 00:00:00+00")
        );
        assert_eq!(
            range_upper_bound(b, "RANGE (\"Occurred\")", "Occurred").as_deref(),
            Some("2020-01-01 00:00:00+00")
        );
        // Another key, another strategy, DEFAULT, MAXVALUE: not by time.
        assert_eq!(
            range_upper_bound(b, "RANGE (created_at)", "occurred_at"),
            None
        );
        assert_eq!(range_upper_bound(b, "HASH (id)", "occurred_at"), None);
        assert_eq!(
            range_upper_bound("DEFAULT", "RANGE (occurred_at)", "occurred_at"),
            None
        );
        let open = "FOR VALUES FROM ('2020-01-01 00:00:00+00') TO (MAXVALUE)";
        assert_eq!(
            range_upper_bound(open, "RANGE (occurred_at)", "occurred_at"),
            None
        );
    }
}
