//! What the relay reads from (and creates in) the source database's catalog
//! on a normal SQL connection: the slot's row and the monitor's reading,
//! settings, slot creation, and (in `outbox`) the checks that the outbox
//! table and the publications are what the relay needs before it streams.
//!
//! Every function returns [`SourceError`]: a precondition the operator must
//! fix is [`SourceError::Definite`] with a message that names the setting;
//! a failed statement is classified by [`SourceError::sql`].

use std::time::Duration;

use tokio_postgres::Client;

use super::conn::ConnParams;
use super::error::SourceError;
use crate::lsn::Lsn;
use crate::outbox::TableName;

mod outbox;

pub use outbox::{
    OutboxTable, check_outbox_table, check_stream_config, payload_type_message,
    publication_warnings, relation_name, table_oid,
};

/// The slot as `pg_replication_slots` shows it, joined with the walsender
/// that holds it.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotInfo {
    /// Output plugin, e.g. `pgoutput`.
    pub plugin: Option<String>,
    /// Database the slot decodes.
    pub database: Option<String>,
    /// Whether a walsender holds it.
    pub active: bool,
    /// The walsender's pid.
    pub active_pid: Option<i32>,
    /// Where a restart resumes.
    pub confirmed_flush_lsn: Option<Lsn>,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// Bytes of WAL that may still be written before the slot is lost
    /// (`None` when `max_slot_wal_keep_size` is unlimited).
    pub safe_wal_size: Option<i64>,
    /// `pg_current_wal_lsn() - confirmed_flush_lsn`, bytes.
    pub lag_bytes: Option<i64>,
    /// `pg_current_wal_lsn() - restart_lsn`, bytes: the WAL the slot keeps
    /// on the server (what `--max-retained-wal` bounds).
    pub retained_wal_bytes: Option<i64>,
    /// Seconds since the walsender holding the slot last read a status
    /// update from its client (`pg_stat_replication.reply_time`, or its
    /// start before the first one). `None` when no walsender holds it, or
    /// its row is not visible to this role.
    pub reply_age_secs: Option<f64>,
    /// The walsender's `pg_stat_activity.wait_event_type` (`Activity` or
    /// `Client` while it waits for WAL or its client; other values or none
    /// while it works).
    pub wait_event_type: Option<String>,
    /// The slot decodes this connection's database (a slot of the same name
    /// may belong to another database of the cluster).
    pub local: bool,
    /// Why the server invalidated the slot (see [`INVALIDATION_REASON`]);
    /// `None` while it is valid or when the server does not say.
    pub invalidation_reason: Option<String>,
}

impl SlotInfo {
    /// The server invalidated the slot: it can never stream again.
    pub fn invalidated(&self) -> bool {
        self.wal_status.as_deref() == Some("lost") || self.invalidation_reason.is_some()
    }
}

/// A logical slot in the relay's database that is not the relay's.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct OtherSlot {
    /// `slot_name`.
    pub name: String,
    /// Output plugin (`test_decoding`, `pgoutput`, `wal2json`, ...).
    pub plugin: String,
    /// Whether a walsender holds it now.
    pub active: bool,
}

/// Logical slots of the current database other than `slot`: each can
/// decode every row change of this database (with `test_decoding`, every
/// table's, whatever the publications say), and each holds WAL back. A
/// role with REPLICATION can create one; `status` reports them (and the
/// running relay counts them from [`monitor_reading`], in the same statement
/// as the slot's figures).
pub async fn other_logical_slots(
    client: &Client,
    slot: &str,
) -> Result<Vec<OtherSlot>, SourceError> {
    Ok(client
        .query(
            "SELECT slot_name::text, plugin::text, active FROM pg_replication_slots \
             WHERE slot_type = 'logical' AND database = current_database() AND slot_name <> $1 \
             ORDER BY 1",
            &[&slot],
        )
        .await
        .map_err(|e| SourceError::sql("listing the other logical slots", &e))?
        .iter()
        .map(|r| OtherSlot {
            name: r.get(0),
            plugin: r.get(1),
            active: r.get(2),
        })
        .collect())
}

/// Reads the slot's row; `None` when it does not exist. One statement.
pub async fn slot_info(client: &Client, slot: &str) -> Result<Option<SlotInfo>, SourceError> {
    let sql = format!(
        "SELECT s.plugin::text, s.database::text, s.active, s.active_pid, \
                s.confirmed_flush_lsn::text, s.wal_status, s.safe_wal_size, \
                (pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint, {REPLY_AGE}, \
                a.wait_event_type::text, s.database = current_database(), {INVALIDATION_REASON}, \
                (pg_current_wal_lsn() - s.restart_lsn)::bigint \
         FROM pg_replication_slots s \
         LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid \
         LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid \
         WHERE s.slot_name = $1"
    );
    let row = client
        .query_opt(&sql, &[&slot])
        .await
        .map_err(|e| SourceError::sql("reading the slot", &e))?;
    Ok(row.map(|r| slot_from_row(&r, 0)))
}

/// The thirteen slot columns of [`slot_info`]'s query, starting at column `at`.
fn slot_from_row(r: &tokio_postgres::Row, at: usize) -> SlotInfo {
    SlotInfo {
        plugin: r.get(at),
        database: r.get(at + 1),
        active: r.get(at + 2),
        active_pid: r.get(at + 3),
        confirmed_flush_lsn: r
            .get::<_, Option<String>>(at + 4)
            .and_then(|s| s.parse().ok()),
        wal_status: r.get(at + 5),
        safe_wal_size: r.get(at + 6),
        lag_bytes: r.get(at + 7),
        reply_age_secs: r.get(at + 8),
        wait_event_type: r.get(at + 9),
        local: r.get::<_, Option<bool>>(at + 10).unwrap_or(false),
        invalidation_reason: r.get(at + 11),
        retained_wal_bytes: r.get(at + 12),
    }
}

/// Why the slot was invalidated, on any server: `invalidation_reason`
/// (PostgreSQL 17+: `wal_removed`, `rows_removed`, `wal_level_insufficient`,
/// `idle_timeout` on 18), `conflict` when 16 says only `conflicting`, NULL
/// otherwise. Read through `to_jsonb` so one statement fits every version.
const INVALIDATION_REASON: &str = "coalesce(to_jsonb(s) ->> 'invalidation_reason', \
     CASE WHEN (to_jsonb(s) ->> 'conflicting')::bool THEN 'conflict' END)";

/// Whether the outbox is in the publications, as one monitor reading saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Membership {
    /// The publications that carry the outbox's inserts completely
    /// (inserts published, no row filter, no column list leaving out a
    /// configured column), each as a token of its identity: name, OID,
    /// `publish_via_partition_root`, `FOR ALL TABLES`, and the OIDs of its
    /// `pg_publication_rel` / `pg_publication_namespace` rows for the table.
    /// Empty: the outbox's inserts are not (all) streamed.
    pub carriers: Vec<String>,
    /// The relation OID `--table` names now.
    pub table_oid: Option<u32>,
    /// When no publication carries it: why, per publication that lists it.
    pub problem: Option<String>,
    /// `pg_current_wal_lsn()` when read.
    pub wal_lsn: Lsn,
    /// The server's clock when read, `YYYY-MM-DD HH:MM:SS+00` (UTC), a
    /// `--since` value for `backfill`.
    pub at: String,
}

impl Membership {
    /// Some publication carries the outbox's inserts completely.
    pub fn included(&self) -> bool {
        !self.carriers.is_empty()
    }

    /// Whether, between `earlier` and this reading, no publication can
    /// have carried the outbox all along: no carrier is the same at both
    /// readings, or the table is another relation now. (A change in one of
    /// several publications while another carries it throughout is no gap.)
    pub fn gap_since(&self, earlier: &Membership) -> bool {
        self.table_oid != earlier.table_oid
            || !self.carriers.iter().any(|c| earlier.carriers.contains(c))
    }
}

/// The membership part of the monitor's statement: `$2` publications, `$3`
/// schema, `$4` table, `$5` the configured columns, `$6` the row filter a
/// carrier must have (NULL: none; a shard's filter when sharded, see
/// [`super::shards`]). Five columns: WAL
/// position, time, table OID, carriers, problem. Published tables are
/// matched by joining their names to pg_class, never with `to_regclass` on
/// the view's rows: the planner may evaluate that over every pg_class row,
/// and `pg_toast` then fails with a permission error for a plain role.
const MEMBERSHIP_SQL: &str = "\
    WITH t AS (SELECT to_regclass(format('%I.%I', $3::text, $4::text))::oid AS oid), \
         p AS (SELECT oid, pubname, puballtables, pubinsert, pubviaroot FROM pg_publication \
               WHERE pubname = ANY($2)), \
         listed AS (SELECT p.oid, p.pubname, p.pubinsert, p.pubviaroot, p.puballtables, \
                           pt.rowfilter, pt.attnames \
                    FROM p JOIN pg_publication_tables pt ON pt.pubname = p.pubname \
                    JOIN pg_namespace pn ON pn.nspname = pt.schemaname \
                    JOIN pg_class pc ON pc.relnamespace = pn.oid AND pc.relname = pt.tablename, t \
                    WHERE coalesce(pg_partition_root(pc.oid), pc.oid)::oid = t.oid), \
         carriers AS (SELECT DISTINCT oid, pubname, pubviaroot, puballtables FROM listed \
                      WHERE pubinsert AND rowfilter IS NOT DISTINCT FROM $6::text \
                        AND (attnames IS NULL OR $5::text[]::name[] <@ attnames)) \
    SELECT pg_current_wal_lsn()::text, \
           to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS+00'), \
           (SELECT oid FROM t), \
           ARRAY(SELECT c.pubname || ':' || c.oid || ':' || c.pubviaroot || ':' || c.puballtables || ':' || \
                   coalesce((SELECT string_agg(pr.oid::text, ',' ORDER BY pr.oid) FROM pg_publication_rel pr, t \
                             WHERE pr.prpubid = c.oid \
                               AND coalesce(pg_partition_root(pr.prrelid), pr.prrelid)::oid = t.oid), '') || ':' || \
                   coalesce((SELECT string_agg(pn.oid::text, ',' ORDER BY pn.oid) FROM pg_publication_namespace pn \
                             WHERE pn.pnpubid = c.oid), '') \
                 FROM carriers c ORDER BY 1), \
           (SELECT string_agg(DISTINCT l.pubname || ' ' || CASE \
                     WHEN NOT l.pubinsert THEN 'does not publish inserts: ALTER PUBLICATION ' || quote_ident(l.pubname) || ' SET (publish = ''insert'')' \
                     WHEN $6::text IS NULL AND l.rowfilter IS NOT NULL THEN 'has a row filter (WHERE ' || l.rowfilter || '): drop it, the relay needs every row' \
                     WHEN l.rowfilter IS DISTINCT FROM $6::text THEN 'has ' || coalesce('the row filter (WHERE ' || l.rowfilter || ')', 'no row filter') || ', not this shard''s (WHERE ' || $6::text || '): run `cdc-relay setup --shards`' \
                     ELSE 'has a column list leaving out a column the relay reads: drop the list' END, '; ') \
            FROM listed l WHERE l.oid NOT IN (SELECT oid FROM carriers))";

/// Why the outbox is not carried, for messages: the reading's problem, or
/// "not in any of them" with the command that adds it.
pub fn membership_problem(m: &Membership, publications: &[String], table: &TableName) -> String {
    if m.table_oid.is_none() {
        return format!(
            "{table} does not exist (renamed or dropped?): if it was renamed, set --table (CDC_RELAY_TABLE) to the new name"
        );
    }
    m.problem.clone().unwrap_or_else(|| {
        format!(
            "{table} is in none of the publications ({}): ALTER PUBLICATION {} ADD TABLE {table} (or run `cdc-relay setup`)",
            publications.join(", "),
            publications.first().map_or("<publication>", String::as_str)
        )
    })
}

/// Reads the outbox's publication membership alone (one statement);
/// `row_filter` is the filter a carrier must have (`None`: no filter).
pub async fn membership(
    client: &Client,
    publications: &[String],
    table: &TableName,
    columns: &[String],
    row_filter: Option<&str>,
) -> Result<Membership, SourceError> {
    // $1 (the slot, in the monitor's statement) is unused here.
    let sql = format!("SELECT m.* FROM ({MEMBERSHIP_SQL}) m, (SELECT $1::text) unused");
    let row = client
        .query_one(
            &sql,
            &[
                &"",
                &publications,
                &table.schema,
                &table.name,
                &columns,
                &row_filter,
            ],
        )
        .await
        .map_err(|e| SourceError::sql("reading the publications", &e))?;
    Ok(membership_from_row(&row))
}

fn membership_from_row(row: &tokio_postgres::Row) -> Membership {
    Membership {
        wal_lsn: row.get::<_, String>(0).parse().unwrap_or_default(),
        at: row.get(1),
        table_oid: row.get(2),
        carriers: row.get(3),
        problem: row.get(4),
    }
}

/// The slot and the outbox's publication membership in ONE statement (the
/// slot monitor's reading: its cost is the relay's whole cost to an idle
/// database). The slot is `None` when it does not exist.
///
/// The same statement lists the other logical slots of this database (the
/// third value) and, with `count_dead_letters`, counts the rows of
/// `cdc_relay_dead_letter` (the fourth; `None` without). `row_filter` as
/// for [`membership`].
pub async fn monitor_reading(
    client: &Client,
    slot: &str,
    publications: &[String],
    table: &TableName,
    columns: &[String],
    row_filter: Option<&str>,
    count_dead_letters: bool,
) -> Result<(Option<SlotInfo>, Membership, Vec<String>, Option<i64>), SourceError> {
    let dead_letters = if count_dead_letters {
        "(SELECT count(*) FROM cdc_relay_dead_letter)"
    } else {
        "NULL::bigint"
    };
    let sql = format!(
        "WITH m AS ({MEMBERSHIP_SQL}) \
         SELECT m.*, s.plugin::text, s.database::text, s.active, s.active_pid, \
                s.confirmed_flush_lsn::text, s.wal_status, s.safe_wal_size, \
                (pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint, {REPLY_AGE}, \
                a.wait_event_type::text, s.database = current_database(), {INVALIDATION_REASON}, \
                (pg_current_wal_lsn() - s.restart_lsn)::bigint, \
                s.slot_name IS NOT NULL, \
                ARRAY(SELECT o.slot_name::text FROM pg_replication_slots o \
                      WHERE o.slot_type = 'logical' AND o.database = current_database() \
                        AND o.slot_name <> $1 ORDER BY 1), \
                {dead_letters} \
         FROM m \
         LEFT JOIN pg_replication_slots s ON s.slot_name = $1 \
         LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid \
         LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid"
    );
    let row = client
        .query_one(
            &sql,
            &[
                &slot,
                &publications,
                &table.schema,
                &table.name,
                &columns,
                &row_filter,
            ],
        )
        .await
        .map_err(|e| SourceError::sql("reading the slot and the publications", &e))?;
    let slot = row.get::<_, bool>(18).then(|| slot_from_row(&row, 5));
    let others: Vec<String> = row.get(19);
    Ok((slot, membership_from_row(&row), others, row.get(20)))
}

/// Seconds since the walsender read a status update from its client
/// (`reply_time`, or its start before the first); NULL when the role
/// cannot see `pg_stat_replication`'s details (it needs
/// `pg_read_all_stats`), so no verdict is drawn from a made-up age.
const REPLY_AGE: &str = "CASE WHEN r.state IS NULL THEN NULL ELSE \
     EXTRACT(EPOCH FROM (clock_timestamp() - coalesce(r.reply_time, r.backend_start)))::float8 END";

/// Whether `cdc_relay_dead_letter` exists (as the relay's role resolves
/// the name), so the monitor can count its rows.
pub async fn dead_letter_table_exists(client: &Client) -> Result<bool, SourceError> {
    let row = client
        .query_one(
            "SELECT to_regclass('cdc_relay_dead_letter') IS NOT NULL",
            &[],
        )
        .await
        .map_err(|e| SourceError::sql("looking up cdc_relay_dead_letter", &e))?;
    Ok(row.get(0))
}

/// The top of the partition tree `oid` belongs to (itself when it is not
/// a partition; `None` when it no longer exists).
pub async fn partition_root(client: &Client, oid: u32) -> Result<Option<u32>, SourceError> {
    let row = client
        .query_opt(
            "SELECT coalesce(pg_partition_root(c.oid::regclass), c.oid::regclass)::oid \
             FROM pg_class c WHERE c.oid = $1",
            &[&oid],
        )
        .await
        .map_err(|e| SourceError::sql("looking up a partition", &e))?;
    Ok(row.map(|r| r.get(0)))
}

/// The error for a slot named like ours that decodes another database.
pub fn slot_elsewhere(slot: &str, info: &SlotInfo) -> SourceError {
    SourceError::NeedsSetup(format!(
        "replication slot {slot:?} belongs to database {:?}, not this one: slots are per database; choose another --slot (CDC_RELAY_SLOT) and run `cdc-relay setup`",
        info.database.as_deref().unwrap_or("?")
    ))
}

/// A server setting as text (`current_setting`).
pub async fn setting(client: &Client, name: &str) -> Result<String, SourceError> {
    let row = client
        .query_one("SELECT current_setting($1)", &[&name])
        .await
        .map_err(|e| SourceError::sql("reading server settings", &e))?;
    Ok(row.get(0))
}

/// The server's `wal_sender_timeout` (zero: disabled). 60 s when the value
/// cannot be read as a duration.
pub async fn wal_sender_timeout(client: &Client) -> Result<Duration, SourceError> {
    let text = setting(client, "wal_sender_timeout").await?;
    Ok(parse_pg_duration(&text).unwrap_or(Duration::from_secs(60)))
}

/// Parses a PostgreSQL duration setting as `SHOW` prints it (`60s`, `1min`,
/// `500ms`, `0`); `current_setting` prints the same form.
pub fn parse_pg_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let ms = match unit.trim() {
        "" | "ms" => n,
        "s" => n * 1_000,
        "min" => n * 60_000,
        "h" => n * 3_600_000,
        "d" => n * 86_400_000,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

/// Creates a pgoutput slot and returns its starting LSN; with `failover`
/// (PostgreSQL 17+) standbys with `sync_replication_slots` keep a copy. The
/// role needs REPLICATION.
pub async fn create_slot(client: &Client, slot: &str, failover: bool) -> Result<Lsn, SourceError> {
    check_slot_name(slot)?;
    let sql = if failover {
        let version = super::failover::server_version(client).await?;
        if !super::failover::supports_failover_slots(version) {
            return Err(SourceError::Definite(format!(
                "failover slots need PostgreSQL 17 or later (this server is {version}); without them, run the relay with --on-slot-loss=recreate-and-backfill"
            )));
        }
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
    } else {
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')"
    };
    let row = client
        .query_one(sql, &[&slot])
        .await
        .map_err(|e| SourceError::sql("creating the slot (the role needs REPLICATION)", &e))?;
    let lsn: String = row.get(0);
    let lsn: Lsn = lsn
        .parse()
        .map_err(|e| SourceError::Definite(format!("creating the slot: {e}")))?;
    record_slot_birth(client, slot, lsn).await?;
    Ok(lsn)
}

/// Replaces `slot`'s prune marks (`cdc_relay_prune_mark`, see
/// `sql/orders.sql` and [`crate::prune`]) with its birth: marks of an
/// earlier slot of that name prove nothing about this one, and rows of
/// transactions before the next transaction id now were never streamed by
/// it. Nothing to do when the schema predates the table.
async fn record_slot_birth(client: &Client, slot: &str, lsn: Lsn) -> Result<(), SourceError> {
    let context = "recording the slot's birth in cdc_relay_prune_mark (the role needs INSERT and DELETE on it: apply sql/roles.sql)";
    let exists: bool = client
        .query_one(
            "SELECT to_regclass('cdc_relay_prune_mark') IS NOT NULL",
            &[],
        )
        .await
        .map_err(|e| SourceError::sql(context, &e))?
        .get(0);
    if !exists {
        return Ok(());
    }
    // `slot` passed check_slot_name (lower-case letters, digits, `_`) and
    // `lsn` is a parsed Lsn: both are safe to inline, which lets the two
    // statements run as one transaction on a shared client.
    let written = client
        .batch_execute(&format!(
            "BEGIN; \
             DELETE FROM cdc_relay_prune_mark WHERE slot_name = '{slot}'; \
             INSERT INTO cdc_relay_prune_mark (slot_name, kind, wal_lsn, xid_horizon) \
               VALUES ('{slot}', 'birth', '{lsn}', pg_snapshot_xmax(pg_current_snapshot())); \
             COMMIT"
        ))
        .await;
    if let Err(e) = written {
        // Leave the shared connection out of the failed transaction.
        let _ = client.batch_execute("ROLLBACK").await;
        return Err(SourceError::sql(context, &e));
    }
    Ok(())
}

/// PostgreSQL's rule for slot names: lower-case letters, digits and
/// underscores, at most 63 bytes. Checked before anything is created.
pub fn check_slot_name(slot: &str) -> Result<(), SourceError> {
    let valid = !slot.is_empty()
        && slot.len() <= 63
        && slot
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if valid {
        Ok(())
    } else {
        Err(SourceError::Definite(format!(
            "invalid --slot {slot:?}: use lower-case letters, digits and underscores (at most 63)"
        )))
    }
}

/// Quotes an SQL identifier (`outbox` → `"outbox"`, `a"b` → `"a""b"`).
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// `"schema"."table"`.
pub fn quote_table(t: &TableName) -> String {
    format!("{}.{}", quote_ident(&t.schema), quote_ident(&t.name))
}

/// Whether the slot's pending WAL predates one of `publications`: peeks at
/// the slot's first pending change with the relay's options, on a
/// connection of its own to `conn`. The server looks each publication up
/// in the catalog as of that change: PostgreSQL 15-17 fail with
/// "publication … does not exist" (42704) exactly then, 18 sends a WARNING
/// "skipped loading publication" (55000) and decodes on without it; both
/// mean yes. `None` when it cannot tell: the slot is in use (only one
/// process may read it), invalidated, holds no change, holds a change not
/// valid in UTF-8, or the peek did not finish within 5 s. Needs the
/// REPLICATION attribute.
pub async fn slot_predates_publication(
    conn: &ConnParams,
    slot: &str,
    publications: &[String],
) -> Result<Option<bool>, SourceError> {
    let (client, notices) = super::connect_sql_noticing(conn, "cdc-relay").await?;
    let names = publications
        .iter()
        .map(|p| quote_ident(p))
        .collect::<Vec<_>>()
        .join(",");
    client
        .batch_execute("SET statement_timeout = '5s'")
        .await
        .map_err(|e| SourceError::sql("setting a statement timeout", &e))?;
    let peek = client
        .query(
            "SELECT 1 FROM pg_logical_slot_peek_binary_changes($1, NULL, 1, \
               'proto_version', '1', 'publication_names', $2)",
            &[&slot, &names],
        )
        .await;
    // A failed peek reports its error before its backend releases the slot
    // (that happens in the abort that follows): one more statement on the
    // same connection returns only after it, so a caller may drop or use
    // the slot at once (`setup --recreate-slot` drops it next).
    if peek.is_err() {
        let _ = client.batch_execute("SELECT 1").await;
    }
    let skipped = notices
        .lock()
        .expect("notice log lock is never poisoned")
        .iter()
        .any(is_skipped_publication);
    match peek {
        Ok(_) => Ok(Some(skipped)),
        Err(e) => match e.as_db_error() {
            Some(db) if db.code().code() == "42704" && db.message().contains("publication") => {
                Ok(Some(true))
            }
            // In use, invalidated, timed out, not allowed, or a change this
            // connection's encoding cannot carry (a SQL_ASCII database,
            // which the relay's own encoding check reports): no verdict.
            Some(db)
                if matches!(
                    db.code().code(),
                    "55006" | "55000" | "57014" | "42501" | "22021" | "22P05"
                ) =>
            {
                Ok(skipped.then_some(true))
            }
            _ => Err(SourceError::sql("peeking at the slot", &e)),
        },
    }
}

/// PostgreSQL 18's notice for a publication that does not exist at the
/// decoded point of the WAL: `WARNING: skipped loading publication "p"`.
fn is_skipped_publication(notice: &tokio_postgres::error::DbError) -> bool {
    notice.code().code() == "55000" && notice.message().contains("skipped loading publication")
}

/// The server's encoding (`server_encoding`), e.g. `UTF8`.
pub async fn server_encoding(client: &Client) -> Result<String, SourceError> {
    setting(client, "server_encoding").await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pg_durations_parse() {
        assert_eq!(parse_pg_duration("60s"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("1min"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_pg_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_pg_duration("x"), None);
    }

    #[test]
    fn slot_names_follow_postgres_rules() {
        assert!(check_slot_name("cdc_relay_1").is_ok());
        for bad in ["", "Bad", "a-b", "a;drop", &"x".repeat(64)] {
            assert!(check_slot_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("outbox"), "\"outbox\"");
        assert_eq!(quote_ident("we\"ird"), "\"we\"\"ird\"");
    }
}
