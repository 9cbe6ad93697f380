//! What the relay reads from (and creates in) the source database's catalog
//! on a normal SQL connection: the slot's row, `wal_sender_timeout`, slot
//! creation, and the checks that the outbox table and the publications are
//! what the relay needs before it streams.
//!
//! Every function returns [`SourceError`]: a precondition the operator must
//! fix is [`SourceError::Definite`] with a message that names the setting;
//! a failed statement is classified by [`SourceError::sql`].

use std::time::Duration;

use tokio_postgres::Client;

use super::error::SourceError;
use crate::lsn::Lsn;
use crate::outbox::{OutboxColumns, TableName};

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
    /// Seconds since the walsender holding the slot last read a status
    /// update from its client (`pg_stat_replication.reply_time`, or its
    /// start before the first one). `None` when no walsender holds it, or
    /// its row is not visible to this role.
    pub reply_age_secs: Option<f64>,
    /// The walsender's `pg_stat_activity.wait_event_type` (`Activity` or
    /// `Client` while it waits for WAL or its client; other values or none
    /// while it works).
    pub wait_event_type: Option<String>,
}

/// Reads the slot's row; `None` when it does not exist. One statement.
pub async fn slot_info(client: &Client, slot: &str) -> Result<Option<SlotInfo>, SourceError> {
    let row = client
        .query_opt(
            "SELECT s.plugin::text, s.database::text, s.active, s.active_pid, \
                    s.confirmed_flush_lsn::text, s.wal_status, s.safe_wal_size, \
                    (pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint, \
                    EXTRACT(EPOCH FROM (clock_timestamp() - coalesce(r.reply_time, r.backend_start)))::float8, \
                    a.wait_event_type::text \
             FROM pg_replication_slots s \
             LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid \
             LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid \
             WHERE s.slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| SourceError::sql("reading the slot", &e))?;
    Ok(row.map(|r| SlotInfo {
        plugin: r.get(0),
        database: r.get(1),
        active: r.get(2),
        active_pid: r.get(3),
        confirmed_flush_lsn: r.get::<_, Option<String>>(4).and_then(|s| s.parse().ok()),
        wal_status: r.get(5),
        safe_wal_size: r.get(6),
        lag_bytes: r.get(7),
        reply_age_secs: r.get(8),
        wait_event_type: r.get(9),
    }))
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

/// Creates a pgoutput slot and returns its starting LSN. The role needs
/// REPLICATION.
pub async fn create_slot(client: &Client, slot: &str) -> Result<Lsn, SourceError> {
    check_slot_name(slot)?;
    let row = client
        .query_one(
            "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .map_err(|e| SourceError::sql("creating the slot (the role needs REPLICATION)", &e))?;
    let lsn: String = row.get(0);
    lsn.parse()
        .map_err(|e| SourceError::Definite(format!("creating the slot: {e}")))
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

/// Checks that `table` exists and has every configured column; returns its
/// `relkind` (`r` table, `p` partitioned). The error names the flag to fix.
pub async fn check_outbox_table(
    client: &Client,
    t: &TableName,
    c: &OutboxColumns,
) -> Result<String, SourceError> {
    let row = client
        .query_opt(
            "SELECT c.relkind::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2",
            &[&t.schema, &t.name],
        )
        .await
        .map_err(|e| SourceError::sql("looking up the outbox table", &e))?;
    let Some(row) = row else {
        return Err(SourceError::Definite(format!(
            "table {t} does not exist (--table); create it first, e.g. with sql/orders.sql"
        )));
    };
    let cols: Vec<String> = client
        .query(
            "SELECT a.attname::text FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped",
            &[&t.schema, &t.name],
        )
        .await
        .map_err(|e| SourceError::sql("reading the outbox columns", &e))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut wanted = vec![
        (c.id.as_str(), "--id-column"),
        (c.event_type.as_str(), "--type-column"),
        (c.payload.as_str(), "--payload-column"),
    ];
    if let Some(a) = &c.aggregate_key {
        wanted.push((a.as_str(), "--aggregate-column"));
    }
    for (col, flag) in wanted {
        if !cols.iter().any(|have| have == col) {
            return Err(SourceError::Definite(format!(
                "table {t} has no column {col:?} ({flag}); its columns: {}",
                cols.join(", ")
            )));
        }
    }
    Ok(row.get(0))
}

/// Before streaming: the table and columns exist and one of `publications`
/// publishes inserts into it. Streaming a publication that does not carry
/// the table would confirm the slot past every event: never start like that.
pub async fn check_stream_config(
    client: &Client,
    t: &TableName,
    c: &OutboxColumns,
    publications: &[String],
) -> Result<(), SourceError> {
    check_outbox_table(client, t, c).await?;
    let existing: Vec<String> = client
        .query(
            "SELECT pubname::text FROM pg_publication WHERE pubname = ANY($1)",
            &[&publications],
        )
        .await
        .map_err(|e| SourceError::sql("looking up the publications", &e))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if let Some(missing) = publications.iter().find(|p| !existing.contains(p)) {
        return Err(SourceError::Definite(format!(
            "publication {missing:?} does not exist (--publication); run `cdc-relay setup`"
        )));
    }
    let published = client
        .query_opt(
            "SELECT 1 FROM pg_publication_tables pt JOIN pg_publication p ON p.pubname = pt.pubname \
             WHERE pt.pubname = ANY($1) AND pt.schemaname = $2 AND pt.tablename = $3 AND p.pubinsert",
            &[&publications, &t.schema, &t.name],
        )
        .await
        .map_err(|e| SourceError::sql("reading the publications' tables", &e))?
        .is_some();
    if !published {
        return Err(SourceError::Definite(format!(
            "no publication in --publication ({}) publishes inserts into {t} (--table); fix the flags or run `cdc-relay setup`",
            publications.join(", ")
        )));
    }
    Ok(())
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
