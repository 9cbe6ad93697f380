//! Outbox retention: delete rows that are older than a cutoff AND proven
//! delivered, in small batches; drop whole time-range partitions instead
//! when a partition is entirely old and delivered.
//!
//! **The proof** (docs/architecture.md#retention). A *prune mark* is taken
//! in one statement: the oldest transaction of this database still running
//! in that statement's snapshot (`HORIZON`, `xid_horizon`: every older
//! transaction of the database had finished, its commit record already in
//! the WAL) and, after it, the WAL insert position (`wal_lsn`). The relay confirms a position only when
//! every transaction committed before it is done (delivered or
//! dead-lettered), so once the slot's `confirmed_flush_lsn` reaches a
//! mark's `wal_lsn`, every outbox row inserted by a transaction older than
//! its `xid_horizon` is done. Rows are compared by `xmin` with `age()`,
//! which counts back from the current transaction modulo 2^32: a row too
//! old for that (over two billion transactions) looks *newer* and is kept,
//! never the other way round. The slot's *birth* row (written when the
//! relay or `setup` creates the slot) bounds the proof from below: rows of
//! transactions before the slot existed were never streamed by it.
//!
//! On top of the proof a row must be older than the cutoff (its time
//! column) and have no dead letter waiting (`cdc_relay_dead_letter`, by
//! event id): a quarantined event keeps its outbox row until it is
//! replayed or discarded.
//!
//! **Batches.** Each relation (the table, or each leaf partition) is walked
//! by physical block ranges (`ctid` ranges: a TID range scan, PostgreSQL
//! 14+), sized from the planner's rows-per-page estimate so that a batch
//! deletes about `batch_rows` rows; each batch is its own short
//! transaction, with a pause between batches. The walk is linear however
//! many rows were deleted before (no rescans of dead tuples).
//!
//! Deletes are not streamed: the publication is insert-only.

use std::time::Duration;

use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::outbox::TableName;
use crate::source::catalog::{quote_ident, quote_table};
use crate::source::{self, ConnParams, SourceError};

/// Rows per heap page assumed when the planner has no estimate yet (a table
/// never analyzed): the outbox's rows are a few hundred bytes.
const DEFAULT_ROWS_PER_BLOCK: f64 = 40.0;

/// The largest valid heap block number (`InvalidBlockNumber` - 1).
const MAX_BLOCK: i64 = 0xFFFF_FFFE;

/// Delay before the relay's first prune tick (or the interval, if shorter):
/// the session starts streaming first.
const FIRST_TICK: Duration = Duration::from_secs(10);

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

/// A mark the slot has passed: rows of transactions older than
/// `xid_horizon` (and not older than the slot's birth) are done.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Proof {
    /// Oldest transaction running when the mark was taken (`xid8`, text).
    pub xid_horizon: String,
    /// WAL insert position read after the snapshot.
    pub wal_lsn: Lsn,
    /// When the mark was taken (UTC text).
    pub taken_at: String,
    /// The slot's birth horizon (`xid8`, text): rows of older transactions
    /// were never streamed by this slot. `None` for a slot created before
    /// prune marks existed.
    pub birth_horizon: Option<String>,
}

/// One look at the slot and the marks ([`probe`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Probe {
    /// The slot's `confirmed_flush_lsn`.
    pub confirmed: Lsn,
    /// The newest mark the slot has passed.
    pub proof: Option<Proof>,
    /// The mark the slot has not passed yet (taken now, or earlier and
    /// still waiting), if any.
    pub waiting_mark: Option<Lsn>,
    /// The cutoff, `now() - older_than` (UTC text).
    pub cutoff: String,
    /// `pg_total_relation_size` of the outbox (partitions included), bytes.
    pub table_bytes: i64,
    /// Whether any row can be deleted now (only when asked for).
    pub prunable: Option<bool>,
}

/// A mark's horizon (`xid8`): the oldest transaction of THIS database
/// still running in the statement's snapshot (`pg_snapshot_xip`, matched
/// with `pg_stat_activity` and `pg_prepared_xacts`: a transaction of
/// another database cannot write the outbox, so a long one there does not
/// hold pruning back), else the snapshot's `xmax`. A transaction of the list
/// that ended between the snapshot and the look at the activity ended
/// before the WAL position the mark reads next. Without
/// `pg_read_all_stats` other sessions' `backend_xid` is hidden, so the
/// cluster-wide `pg_snapshot_xmin` is used. The WAL position must be read
/// after this is computed (the mark's INSERT reads it from a row of it).
const HORIZON: &str = "CASE WHEN pg_has_role('pg_read_all_stats', 'MEMBER') THEN \
       coalesce((SELECT min(r.x) FROM pg_snapshot_xip(pg_current_snapshot()) r (x) \
                 WHERE r.x::xid IN ( \
                   SELECT backend_xid FROM pg_stat_activity \
                    WHERE datname = current_database() AND backend_xid IS NOT NULL \
                   UNION ALL \
                   SELECT transaction FROM pg_prepared_xacts WHERE database = current_database())), \
                pg_snapshot_xmax(pg_current_snapshot())) \
     ELSE pg_snapshot_xmin(pg_current_snapshot()) END";

/// The predicate a row of alias `o` must meet to be deleted: older than
/// `cutoff`, inserted by a transaction older than `horizon` and not older
/// than `birth` (both `xid8` SQL expressions; `birth` may be NULL), and no
/// dead letter waiting for its id.
fn deletable(plan: &PrunePlan, cutoff: &str, horizon: &str, birth: &str) -> String {
    format!(
        "o.{time} < {cutoff} \
         AND age(o.xmin) > age(({horizon})::xid) \
         AND ({birth} IS NULL OR age(o.xmin) <= age(({birth})::xid)) \
         AND NOT EXISTS (SELECT 1 FROM cdc_relay_dead_letter d WHERE d.event_id = o.{id}::text)",
        time = quote_ident(&plan.time_column),
        id = quote_ident(&plan.id_column),
    )
}

/// Checks what prune relies on: the outbox, its time and id columns, the
/// dead-letter and prune-mark tables, and a valid slot of this database.
pub async fn check(client: &Client, plan: &PrunePlan) -> Result<(), PruneError> {
    let row = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL, \
                    to_regclass('cdc_relay_dead_letter') IS NOT NULL, \
                    to_regclass('cdc_relay_prune_mark') IS NOT NULL, \
                    (SELECT array_agg(attname::text) FROM pg_attribute \
                      WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped)",
            &[&quote_table(&plan.table)],
        )
        .await
        .map_err(|e| PruneError::sql("checking the tables prune uses", &e))?;
    if !row.get::<_, bool>(0) {
        return Err(PruneError::NeedsSetup(format!(
            "table {} does not exist (--table)",
            plan.table
        )));
    }
    if !row.get::<_, bool>(1) || !row.get::<_, bool>(2) {
        return Err(PruneError::NeedsSetup(
            "cdc_relay_dead_letter or cdc_relay_prune_mark is missing: apply this version's sql/orders.sql and sql/roles.sql (both are re-runnable)".into(),
        ));
    }
    let columns: Vec<String> = row.get::<_, Option<Vec<String>>>(3).unwrap_or_default();
    for (flag, column) in [
        ("--time-column", &plan.time_column),
        ("--id-column", &plan.id_column),
    ] {
        if !columns.contains(column) {
            return Err(PruneError::NeedsSetup(format!(
                "{} has no column {column:?} ({flag})",
                plan.table
            )));
        }
    }
    let slot = client
        .query_opt(
            "SELECT wal_status = 'lost', database = current_database() \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&plan.slot],
        )
        .await
        .map_err(|e| PruneError::sql("reading the slot", &e))?;
    match slot {
        None => Err(PruneError::Source(SourceError::SlotMissing {
            slot: plan.slot.clone(),
        })),
        Some(r) if !r.get::<_, bool>(1) => Err(PruneError::NeedsSetup(format!(
            "replication slot {:?} decodes another database: pass the --slot of this database's relay",
            plan.slot
        ))),
        Some(r) if r.get::<_, Option<bool>>(0) == Some(true) => {
            Err(PruneError::SlotInvalidated(plan.slot.clone()))
        }
        Some(_) => Ok(()),
    }
}

/// In ONE statement (the relay's idle cost per prune tick): reads the slot,
/// takes a new mark unless one is still waiting for the slot, finds the
/// newest mark the slot has passed and forgets older ones, computes the
/// cutoff and the table's size, and with `ask_prunable` whether any row can
/// be deleted now.
pub async fn probe(
    client: &Client,
    plan: &PrunePlan,
    ask_prunable: bool,
) -> Result<Probe, PruneError> {
    let prunable = if ask_prunable {
        format!(
            "EXISTS (SELECT 1 FROM {table} o WHERE {pred})",
            table = quote_table(&plan.table),
            pred = deletable(plan, "c.cutoff", "p.xid_horizon", "b.xid_horizon")
        )
    } else {
        "NULL::bool".into()
    };
    let sql = format!(
        "WITH s AS ( \
           SELECT confirmed_flush_lsn AS c FROM pg_replication_slots \
           WHERE slot_name = $1 AND database = current_database() AND wal_status IS DISTINCT FROM 'lost'), \
         waiting AS ( \
           SELECT max(m.wal_lsn) AS l FROM cdc_relay_prune_mark m, s \
           WHERE m.slot_name = $1 AND m.kind = 'mark' AND m.wal_lsn > s.c), \
         h AS MATERIALIZED (SELECT {HORIZON} AS horizon), \
         mark AS ( \
           INSERT INTO cdc_relay_prune_mark (slot_name, kind, wal_lsn, xid_horizon) \
           SELECT $1, 'mark', pg_current_wal_insert_lsn(), h.horizon \
           FROM h, s, waiting WHERE waiting.l IS NULL AND s.c IS NOT NULL \
           ON CONFLICT DO NOTHING RETURNING wal_lsn), \
         proven AS ( \
           SELECT m.wal_lsn, m.xid_horizon, m.taken_at FROM cdc_relay_prune_mark m, s \
           WHERE m.slot_name = $1 AND m.kind = 'mark' AND m.wal_lsn <= s.c \
           ORDER BY m.wal_lsn DESC LIMIT 1), \
         forgotten AS ( \
           DELETE FROM cdc_relay_prune_mark m USING proven p \
           WHERE m.slot_name = $1 AND m.kind = 'mark' AND m.wal_lsn < p.wal_lsn) \
         SELECT (SELECT c::text FROM s), \
                coalesce((SELECT wal_lsn::text FROM mark), (SELECT l::text FROM waiting)), \
                p.wal_lsn::text, p.xid_horizon::text, \
                to_char(p.taken_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US+00'), \
                b.xid_horizon::text, \
                to_char(c.cutoff AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US+00'), \
                coalesce((SELECT sum(pg_total_relation_size(relid)) \
                            FROM pg_partition_tree($2::text::regclass)), \
                         pg_total_relation_size($2::text::regclass))::int8, \
                {prunable} \
         FROM (SELECT now() - make_interval(secs => $3) AS cutoff) c \
         LEFT JOIN proven p ON true \
         LEFT JOIN LATERAL (SELECT xid_horizon FROM cdc_relay_prune_mark \
                            WHERE slot_name = $1 AND kind = 'birth' \
                            ORDER BY wal_lsn DESC LIMIT 1) b ON true"
    );
    let row = client
        .query_one(
            &sql,
            &[
                &plan.slot,
                &quote_table(&plan.table),
                &plan.older_than.as_secs_f64(),
            ],
        )
        .await
        .map_err(|e| PruneError::sql("taking a prune mark", &e))?;
    let lsn = |i: usize| {
        row.get::<_, Option<String>>(i)
            .and_then(|s| s.parse::<Lsn>().ok())
    };
    let Some(confirmed) = lsn(0) else {
        return Err(PruneError::Source(SourceError::SlotMissing {
            slot: plan.slot.clone(),
        }));
    };
    let proof = match (lsn(2), row.get::<_, Option<String>>(3)) {
        (Some(wal_lsn), Some(xid_horizon)) => Some(Proof {
            xid_horizon,
            wal_lsn,
            taken_at: row.get::<_, Option<String>>(4).unwrap_or_default(),
            birth_horizon: row.get(5),
        }),
        _ => None,
    };
    Ok(Probe {
        confirmed,
        proof,
        waiting_mark: lsn(1),
        cutoff: row.get(6),
        table_bytes: row.get(7),
        prunable: row.get(8),
    })
}

/// The message for a slot that has not passed any mark: nothing can be
/// proven delivered yet.
pub fn unproven_message(plan: &PrunePlan, probe: &Probe, waited: Duration) -> String {
    let mark = probe
        .waiting_mark
        .map_or_else(|| "the mark".to_owned(), |l| format!("the mark at {l}"));
    format!(
        "cannot prove any outbox row delivered: replication slot {:?} is confirmed at {} and has not reached {mark} prune took (waited {:.0} s). \
         The relay is stopped, behind, or its sink is failing (`cdc-relay status`). Nothing was deleted. \
         Start the relay or fix the sink, then run prune again: the mark stays, and proves every row inserted before it once the slot passes it",
        plan.slot,
        probe.confirmed,
        waited.as_secs_f64()
    )
}

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

/// Blocks per batch so that a batch holds about `batch_rows` rows.
pub fn blocks_per_batch(batch_rows: u32, rows_per_block: f64) -> i64 {
    let per_block = if rows_per_block.is_finite() && rows_per_block >= 1.0 {
        rows_per_block
    } else {
        1.0
    };
    ((f64::from(batch_rows) / per_block).floor() as i64).max(1)
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

/// Rows older than `cutoff` that stay because a dead letter waits for
/// their event id.
pub async fn count_dead_lettered(
    client: &Client,
    plan: &PrunePlan,
    cutoff: &str,
) -> Result<i64, PruneError> {
    let sql = format!(
        "SELECT count(*) FROM {table} o WHERE o.{time} < $1::text::timestamptz \
           AND EXISTS (SELECT 1 FROM cdc_relay_dead_letter d WHERE d.event_id = o.{id}::text)",
        table = quote_table(&plan.table),
        time = quote_ident(&plan.time_column),
        id = quote_ident(&plan.id_column),
    );
    Ok(client
        .query_one(&sql, &[&cutoff])
        .await
        .map_err(|e| PruneError::sql("counting dead-lettered rows", &e))?
        .get(0))
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

/// The relay's opt-in pruning (`run --prune-older-than`).
#[derive(Clone, Debug)]
pub struct Schedule {
    /// What to prune.
    pub plan: PrunePlan,
    /// Time between two ticks. A tick with nothing to prune costs one
    /// statement ([`probe`]).
    pub interval: Duration,
}

/// Prunes every `schedule.interval` on a connection of its own (reopened
/// after a failure) until `shutdown`. A tick takes a mark and, when a row
/// may go, deletes in batches (`debug` log per batch,
/// `cdc_relay_pruned_rows_total`); it also refreshes
/// `cdc_relay_outbox_table_size_bytes`. A failure is logged and tried again
/// at the next tick: pruning never stops delivery.
pub async fn keep_pruning(
    conn: ConnParams,
    schedule: Schedule,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let first = tokio::time::Instant::now() + schedule.interval.min(FIRST_TICK);
    let mut tick = tokio::time::interval_at(first, schedule.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut client: Option<Client> = None;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        if client.as_ref().is_none_or(Client::is_closed) {
            match source::connect_sql(&conn, "cdc-relay-prune").await {
                Ok(c) => client = Some(c),
                Err(error) => {
                    tracing::warn!(%error, "prune: cannot connect; trying again at the next tick");
                    continue;
                }
            }
        }
        let Some(c) = &client else { continue };
        match tick_once(c, &schedule.plan, &metrics, &shutdown).await {
            Ok(0) => {}
            Ok(rows) => {
                tracing::info!(rows, table = %schedule.plan.table, "prune: deleted delivered outbox rows older than the window")
            }
            Err(error) => {
                tracing::warn!(%error, "prune: tick failed; trying again at the next tick")
            }
        }
    }
}

/// One tick of [`keep_pruning`]; returns the rows deleted.
async fn tick_once(
    c: &Client,
    plan: &PrunePlan,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Result<u64, PruneError> {
    let probe = probe(c, plan, true).await?;
    metrics.outbox_table_bytes.set(probe.table_bytes);
    let (Some(proof), Some(true)) = (&probe.proof, probe.prunable) else {
        tracing::debug!(confirmed = %probe.confirmed, proven = probe.proof.is_some(), "prune: nothing to delete");
        return Ok(0);
    };
    let mut total = 0;
    for t in targets(c, plan).await? {
        total += delete_rows(
            c,
            plan,
            proof,
            &probe.cutoff,
            &t,
            |b| {
                metrics.pruned_rows.inc_by(b.rows);
                tracing::debug!(
                    relation = %b.relation, first_block = b.first_block, end_block = b.end_block,
                    rows = b.rows, "prune: batch"
                );
            },
            || shutdown.is_cancelled(),
        )
        .await?;
    }
    Ok(total)
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

    #[test]
    fn batches_hold_about_the_asked_rows() {
        assert_eq!(blocks_per_batch(5000, 50.0), 100);
        assert_eq!(blocks_per_batch(10, 50.0), 1);
        assert_eq!(blocks_per_batch(100, 0.0), 100);
        assert_eq!(blocks_per_batch(100, f64::NAN), 100);
    }
}
