//! The replication slot in the catalog: its row as `pg_replication_slots`
//! and the walsender holding it show it, the other logical slots of the
//! database, and a new slot's birth in the prune marks (the slot itself
//! is created by `source::slot_creation`).

use tokio::time::Instant;
use tokio_postgres::Client;

use super::super::conn::ConnParams;
use super::super::error::SourceError;
use super::quote_ident;
use crate::lsn::Lsn;

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
    /// Why the server invalidated the slot (see `INVALIDATION_REASON`);
    /// `None` while it is valid or when the server does not say.
    pub invalidation_reason: Option<String>,
    /// The walsender's `pg_stat_activity.wait_event` (e.g.
    /// `WalSenderWaitForWAL`, `WaitForStandbyConfirmation`).
    pub wait_event: Option<String>,
    /// How far the walsender has read and sent the WAL
    /// (`pg_stat_replication.sent_lsn`).
    pub sent_lsn: Option<Lsn>,
    /// The server's flushed WAL end (`pg_current_wal_flush_lsn()`) when
    /// the row was read.
    pub flushed_lsn: Option<Lsn>,
}

impl SlotInfo {
    /// The server invalidated the slot: it can never stream again.
    pub fn invalidated(&self) -> bool {
        self.wal_status.as_deref() == Some("lost") || self.invalidation_reason.is_some()
    }
}

/// The slot monitor's latest reading of the slot and when it was taken
/// (see `source::watchdog`); `None` before the first one.
pub type SlotReading = Option<(Instant, SlotInfo)>;

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
/// running relay counts them from [`super::monitor_reading`], in the same statement
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

/// Whether `slot`, on the server `client` reaches, is held by a walsender
/// whose `application_name` is `application_name`: with
/// `--replication-url`, the proof that the side connection and the stream
/// reach the same server. One statement.
pub async fn slot_held_by(
    client: &Client,
    slot: &str,
    application_name: &str,
) -> Result<bool, SourceError> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_replication_slots s \
                            JOIN pg_stat_replication r ON r.pid = s.active_pid \
                            WHERE s.slot_name = $1 AND r.application_name = $2)",
            &[&slot, &application_name],
        )
        .await
        .map_err(|e| SourceError::sql("checking that the slot's walsender is this relay's", &e))?;
    Ok(row.get(0))
}

/// Reads the slot's row; `None` when it does not exist. One statement.
/// Errors: [`SourceError::NeedsSetup`] for a slot of that name that is not
/// a pgoutput one (another output plugin, or a physical slot): nothing the
/// relay does with it could work, and asking it for pgoutput's options
/// fails with only "option \"proto_version\" is unknown".
pub async fn slot_info(client: &Client, slot: &str) -> Result<Option<SlotInfo>, SourceError> {
    let sql = format!(
        "SELECT s.plugin::text, s.database::text, s.active, s.active_pid, \
                s.confirmed_flush_lsn::text, s.wal_status, s.safe_wal_size, \
                (pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint, {REPLY_AGE}, \
                a.wait_event_type::text, s.database = current_database(), {INVALIDATION_REASON}, \
                (pg_current_wal_lsn() - s.restart_lsn)::bigint, {WALSENDER} \
         FROM pg_replication_slots s \
         LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid \
         LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid \
         WHERE s.slot_name = $1"
    );
    let row = client
        .query_opt(&sql, &[&slot])
        .await
        .map_err(|e| SourceError::sql("reading the slot", &e))?;
    let info = row.map(|r| slot_from_row(&r, 0));
    if let Some(i) = &info
        && i.plugin.as_deref() != Some("pgoutput")
    {
        let what = match &i.plugin {
            Some(plugin) => format!("a logical slot of the output plugin {plugin:?}"),
            None => "a physical slot".to_owned(),
        };
        return Err(SourceError::NeedsSetup(format!(
            "slot {slot:?} (--slot) is {what}, not pgoutput: the relay cannot read it. Choose another --slot, \
             or, if nothing else uses it, drop it (SELECT pg_drop_replication_slot('{slot}')) and run `cdc-relay setup`"
        )));
    }
    Ok(info)
}

/// The walsender's wait event, how far it sent, and the server's flushed
/// WAL end: the three last slot columns.
pub(super) const WALSENDER: &str =
    "a.wait_event::text, r.sent_lsn::text, pg_current_wal_flush_lsn()::text";

/// The sixteen slot columns of [`slot_info`]'s query (and of
/// [`super::monitor_reading`]'s), starting at column `at`.
pub(super) fn slot_from_row(r: &tokio_postgres::Row, at: usize) -> SlotInfo {
    SlotInfo {
        plugin: r.get(at),
        database: r.get(at + 1),
        active: r.get(at + 2),
        active_pid: r.get(at + 3),
        confirmed_flush_lsn: lsn(r, at + 4),
        wal_status: r.get(at + 5),
        safe_wal_size: r.get(at + 6),
        lag_bytes: r.get(at + 7),
        reply_age_secs: r.get(at + 8),
        wait_event_type: r.get(at + 9),
        local: r.get::<_, Option<bool>>(at + 10).unwrap_or(false),
        invalidation_reason: r.get(at + 11),
        retained_wal_bytes: r.get(at + 12),
        wait_event: r.get(at + 13),
        sent_lsn: lsn(r, at + 14),
        flushed_lsn: lsn(r, at + 15),
    }
}

fn lsn(r: &tokio_postgres::Row, at: usize) -> Option<Lsn> {
    r.get::<_, Option<String>>(at).and_then(|s| s.parse().ok())
}

/// Why the slot was invalidated, on any server: `invalidation_reason`
/// (PostgreSQL 17+: `wal_removed`, `rows_removed`, `wal_level_insufficient`,
/// `idle_timeout` on 18), `conflict` when 16 says only `conflicting`, NULL
/// otherwise. Read through `to_jsonb` so one statement fits every version.
pub(super) const INVALIDATION_REASON: &str = "coalesce(to_jsonb(s) ->> 'invalidation_reason', \
     CASE WHEN (to_jsonb(s) ->> 'conflicting')::bool THEN 'conflict' END)";

/// Seconds since the walsender read a status update from its client
/// (`reply_time`, or its start before the first); NULL when the role
/// cannot see `pg_stat_replication`'s details (it needs
/// `pg_read_all_stats`), so no verdict is drawn from a made-up age.
pub(super) const REPLY_AGE: &str = "CASE WHEN r.state IS NULL THEN NULL ELSE \
     EXTRACT(EPOCH FROM (clock_timestamp() - coalesce(r.reply_time, r.backend_start)))::float8 END";

/// The error for a slot named like ours that decodes another database.
pub fn slot_elsewhere(slot: &str, info: &SlotInfo) -> SourceError {
    SourceError::NeedsSetup(format!(
        "replication slot {slot:?} belongs to database {:?}, not this one: slots are per database; choose another --slot (CDC_RELAY_SLOT) and run `cdc-relay setup`",
        info.database.as_deref().unwrap_or("?")
    ))
}

/// Replaces `slot`'s prune marks (`cdc_relay_prune_mark`, see
/// `sql/orders.sql` and [`crate::prune`]) with its birth: marks of an
/// earlier slot of that name prove nothing about this one, and rows of
/// transactions before the next transaction id now were never streamed by
/// it. Nothing to do when the schema predates the table.
pub async fn record_slot_birth(client: &Client, slot: &str, lsn: Lsn) -> Result<(), SourceError> {
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
    let (client, notices) = super::super::connect_sql_noticing(conn, "cdc-relay").await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_names_follow_postgres_rules() {
        assert!(check_slot_name("cdc_relay_1").is_ok());
        for bad in ["", "Bad", "a-b", "a;drop", &"x".repeat(64)] {
            assert!(check_slot_name(bad).is_err(), "{bad:?}");
        }
    }
}
