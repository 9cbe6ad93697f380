//! The proof that an outbox row was delivered
//! (docs/architecture.md#retention).
//!
//! A *prune mark* is taken in one statement: the oldest transaction of
//! this database still running in that statement's snapshot (`HORIZON`,
//! `xid_horizon`: every older transaction of the database had finished, its
//! commit record already in the WAL) and, after it, the WAL insert position
//! (`wal_lsn`). The relay confirms a position only when every transaction
//! committed before it is done (delivered or dead-lettered), so once the
//! slot's `confirmed_flush_lsn` reaches a mark's `wal_lsn`, every outbox
//! row inserted by a transaction older than its `xid_horizon` is done.
//! Rows are compared by `xmin` with `age()`, which counts back from the
//! current transaction modulo 2^32: a row too old for that (over two
//! billion transactions) looks *newer* and is kept, never the other way
//! round. The slot's *birth* row (written when the relay or `setup`
//! creates the slot) bounds the proof from below: rows of transactions
//! before the slot existed were never streamed by it.
//!
//! On top of the proof a row must be older than the cutoff (its time
//! column) and have no dead letter waiting (`cdc_relay_dead_letter`, by
//! event id): a dead-lettered event keeps its outbox row until it is
//! replayed or discarded.

use std::time::Duration;

use tokio_postgres::Client;

use super::{PruneError, PrunePlan};
use crate::lsn::Lsn;
use crate::source::SourceError;
use crate::source::catalog::{quote_ident, quote_table};

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

/// What a proof without the slot's birth record ([`Proof::birth_horizon`]
/// `None`) cannot tell, and what to do: one sentence for the `prune`
/// command's warning and the relay's periodic pruning alike.
pub fn birthless_warning(slot: &str) -> String {
    format!(
        "slot {slot} has no birth record (made before cdc-relay recorded one, or the record was removed): rows \
         inserted before the slot existed cannot be told from delivered ones and go with them once \
         past the window; keep the retention window (--older-than, run's --prune-older-than) longer \
         than the slot's age (docs/operations.md, \"Outbox retention\")"
    )
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
pub(super) fn deletable(plan: &PrunePlan, cutoff: &str, horizon: &str, birth: &str) -> String {
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
