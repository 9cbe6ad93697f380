//! `cdc-relay setup` and `cdc-relay status`: prepare and inspect the
//! database side (publication, slot, settings).
//!
//! Setup is idempotent and creates the publication BEFORE the slot: the slot
//! decodes with the catalog as of each change, so a publication created after
//! the slot's starting point would make older changes undecodable.

use serde::Serialize;
use tokio_postgres::Client;

use crate::outbox::{OutboxColumns, TableName};
use crate::source::{self, SlotInfo};

/// Setup could not finish; the message says what to change.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A server setting must change first.
    #[error("{0}")]
    Precondition(String),
    /// A SQL statement failed.
    #[error("{what}: {}", db_message(error))]
    Sql {
        /// What setup was doing.
        what: &'static str,
        /// The error (rendered in the message, not chained, so it is said once).
        error: tokio_postgres::Error,
    },
}

/// The server's own message when there is one (tokio-postgres' Display says
/// only "db error").
pub fn db_message(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => crate::error_chain(e),
    }
}

fn sql(what: &'static str) -> impl FnOnce(tokio_postgres::Error) -> SetupError {
    move |error| SetupError::Sql { what, error }
}

/// PostgreSQL's rule for slot names: lower-case letters, digits and
/// underscores, at most 63 bytes. Checked before anything is created.
pub fn check_slot_name(slot: &str) -> Result<(), SetupError> {
    let ok = !slot.is_empty()
        && slot.len() <= 63
        && slot
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(SetupError::Precondition(format!(
            "invalid --slot {slot:?}: use lower-case letters, digits and underscores (at most 63)"
        )))
    }
}

/// Quotes an SQL identifier (`"` doubled).
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// What setup needs to know.
#[derive(Debug, Clone)]
pub struct SetupPlan {
    /// Outbox table.
    pub table: TableName,
    /// Columns the relay reads.
    pub columns: OutboxColumns,
    /// Publication name (the first one given).
    pub publication: String,
    /// Slot name.
    pub slot: String,
    /// Recreate the slot when it is invalidated.
    pub recreate_slot: bool,
}

/// Runs setup and returns one line per check or action, for the operator.
pub async fn setup(client: &Client, plan: &SetupPlan) -> Result<Vec<String>, SetupError> {
    check_slot_name(&plan.slot)?;
    let mut report = Vec::new();
    check_settings(client, &mut report).await?;
    let partitioned = check_table(client, plan, &mut report).await?;
    ensure_publication(client, plan, partitioned, &mut report).await?;
    ensure_slot(client, plan, &mut report).await?;
    Ok(report)
}

async fn setting(client: &Client, name: &str) -> Result<String, SetupError> {
    let row = client
        .query_one("SELECT current_setting($1)", &[&name])
        .await
        .map_err(sql("reading server settings"))?;
    Ok(row.get(0))
}

async fn check_settings(client: &Client, report: &mut Vec<String>) -> Result<(), SetupError> {
    let wal_level = setting(client, "wal_level").await?;
    if wal_level != "logical" {
        return Err(SetupError::Precondition(format!(
            "wal_level is {wal_level:?}; set wal_level = logical in postgresql.conf and restart PostgreSQL (see deploy/postgresql.conf)"
        )));
    }
    report.push("ok: wal_level = logical".into());
    let row = client
        .query_one(
            "SELECT current_setting('max_replication_slots')::int, (SELECT count(*)::int FROM pg_replication_slots), \
                    current_setting('max_wal_senders')::int, (SELECT count(*)::int FROM pg_stat_replication)",
            &[],
        )
        .await
        .map_err(sql("reading replication limits"))?;
    let (max_slots, slots, max_senders, senders): (i32, i32, i32, i32) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    if slots >= max_slots {
        report.push(format!(
            "warning: {slots} of max_replication_slots = {max_slots} in use; a new slot cannot be created"
        ));
    } else {
        report.push(format!("ok: replication slots {slots}/{max_slots} in use"));
    }
    if senders + 2 > max_senders {
        report.push(format!(
            "warning: {senders} of max_wal_senders = {max_senders} in use; the relay and a standby need 2"
        ));
    } else {
        report.push(format!("ok: wal senders {senders}/{max_senders} in use"));
    }
    let keep = setting(client, "max_slot_wal_keep_size").await?;
    if keep == "-1" {
        report.push(
            "warning: max_slot_wal_keep_size = -1: a stopped relay makes the server keep WAL without limit (disk full risk); set a bound, e.g. 10GB"
                .into(),
        );
    } else {
        report.push(format!("ok: max_slot_wal_keep_size = {keep}"));
    }
    Ok(())
}

/// Checks the table and its columns; returns whether it is partitioned.
async fn check_table(
    client: &Client,
    plan: &SetupPlan,
    report: &mut Vec<String>,
) -> Result<bool, SetupError> {
    let relkind = check_outbox_table(client, &plan.table, &plan.columns).await?;
    report.push(format!(
        "ok: table {} has the columns the relay reads",
        plan.table
    ));
    Ok(relkind == "p")
}

/// Checks that `table` exists and has every configured column; returns its
/// `relkind` (`r` table, `p` partitioned). The error names the flag to fix.
pub async fn check_outbox_table(
    client: &Client,
    t: &TableName,
    c: &OutboxColumns,
) -> Result<String, SetupError> {
    let row = client
        .query_opt(
            "SELECT c.relkind::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2",
            &[&t.schema, &t.name],
        )
        .await
        .map_err(sql("looking up the outbox table"))?;
    let Some(row) = row else {
        return Err(SetupError::Precondition(format!(
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
        .map_err(sql("reading the outbox columns"))?
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
            return Err(SetupError::Precondition(format!(
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
) -> Result<(), SetupError> {
    check_outbox_table(client, t, c).await?;
    let existing: Vec<String> = client
        .query(
            "SELECT pubname::text FROM pg_publication WHERE pubname = ANY($1)",
            &[&publications],
        )
        .await
        .map_err(sql("looking up the publications"))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if let Some(missing) = publications.iter().find(|p| !existing.contains(p)) {
        return Err(SetupError::Precondition(format!(
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
        .map_err(sql("reading the publications' tables"))?
        .is_some();
    if !published {
        return Err(SetupError::Precondition(format!(
            "no publication in --publication ({}) publishes inserts into {t} (--table); fix the flags or run `cdc-relay setup`",
            publications.join(", ")
        )));
    }
    Ok(())
}

async fn ensure_publication(
    client: &Client,
    plan: &SetupPlan,
    partitioned: bool,
    report: &mut Vec<String>,
) -> Result<(), SetupError> {
    let exists = client
        .query_opt("SELECT pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication WHERE pubname = $1", &[&plan.publication])
        .await
        .map_err(sql("looking up the publication"))?;
    let t = &plan.table;
    if let Some(row) = exists {
        let (ins, upd, del, tru): (bool, bool, bool, bool) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        let has_table = client
            .query_opt(
                "SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
                &[&plan.publication, &t.schema, &t.name],
            )
            .await
            .map_err(sql("reading the publication's tables"))?
            .is_some();
        if !ins || !has_table {
            return Err(SetupError::Precondition(format!(
                "publication {:?} exists but does not publish inserts into {t}; fix it (ALTER PUBLICATION) or choose another --publication",
                plan.publication
            )));
        }
        report.push(format!(
            "exists: publication {:?} publishes inserts into {t}",
            plan.publication
        ));
        if upd || del || tru {
            report.push(format!(
                "warning: publication {:?} also publishes updates/deletes/truncates; the relay ignores them but the slot still decodes them",
                plan.publication
            ));
        }
        return Ok(());
    }
    let via_root = if partitioned {
        ", publish_via_partition_root = true"
    } else {
        ""
    };
    let stmt = format!(
        "CREATE PUBLICATION {} FOR TABLE {}.{} WITH (publish = 'insert'{via_root})",
        quote_ident(&plan.publication),
        quote_ident(&t.schema),
        quote_ident(&t.name)
    );
    client
        .batch_execute(&stmt)
        .await
        .map_err(sql("creating the publication"))?;
    report.push(format!(
        "created: publication {:?} (inserts into {t} only{})",
        plan.publication,
        if partitioned {
            ", via partition root"
        } else {
            ""
        }
    ));
    Ok(())
}

async fn ensure_slot(
    client: &Client,
    plan: &SetupPlan,
    report: &mut Vec<String>,
) -> Result<(), SetupError> {
    let info = source::slot_info(client, &plan.slot)
        .await
        .map_err(sql("looking up the slot"))?;
    match info {
        Some(s) if s.wal_status.as_deref() == Some("lost") => {
            if !plan.recreate_slot {
                return Err(SetupError::Precondition(format!(
                    "slot {:?} is invalidated (wal_status = lost). Run `cdc-relay setup --recreate-slot`, then `cdc-relay backfill --since <time of the last delivered event>` to re-send what it missed",
                    plan.slot
                )));
            }
            client
                .execute("SELECT pg_drop_replication_slot($1)", &[&plan.slot])
                .await
                .map_err(sql("dropping the invalidated slot"))?;
            report.push(format!("dropped: invalidated slot {:?}", plan.slot));
            create_slot(client, plan, report).await
        }
        Some(s) => {
            if s.plugin.as_deref() != Some("pgoutput") {
                return Err(SetupError::Precondition(format!(
                    "slot {:?} exists with plugin {:?}, not pgoutput; drop it or choose another --slot",
                    plan.slot, s.plugin
                )));
            }
            report.push(format!(
                "exists: slot {:?} (pgoutput, confirmed_flush_lsn {})",
                plan.slot,
                s.confirmed_flush_lsn
                    .map(|l| l.to_string())
                    .unwrap_or_else(|| "-".into())
            ));
            Ok(())
        }
        None => create_slot(client, plan, report).await,
    }
}

async fn create_slot(
    client: &Client,
    plan: &SetupPlan,
    report: &mut Vec<String>,
) -> Result<(), SetupError> {
    let row = client
        .query_one(
            "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&plan.slot],
        )
        .await
        .map_err(sql("creating the slot (the role needs REPLICATION)"))?;
    let lsn: String = row.get(0);
    report.push(format!(
        "created: slot {:?} (pgoutput) at {lsn}; events committed from now on will be delivered",
        plan.slot
    ));
    Ok(())
}

/// What `status` reports.
#[derive(Debug, Serialize)]
pub struct Status {
    /// Slot name.
    pub slot: String,
    /// Whether it exists.
    pub exists: bool,
    /// Whether a walsender holds it.
    pub active: bool,
    /// That walsender's pid.
    pub active_pid: Option<i32>,
    /// Where a restart resumes (PostgreSQL text form).
    pub confirmed_flush_lsn: Option<String>,
    /// `pg_current_wal_lsn() - confirmed_flush_lsn`, bytes.
    pub lag_bytes: Option<i64>,
    /// reserved / extended / unreserved / lost.
    pub wal_status: Option<String>,
    /// Bytes of WAL that may still be written before the slot is lost.
    pub safe_wal_size: Option<i64>,
    /// Publication name.
    pub publication: String,
    /// Tables it publishes (schema.table).
    pub publication_tables: Vec<String>,
}

/// Reads the slot and publication.
pub async fn status(
    client: &Client,
    slot: &str,
    publication: &str,
) -> Result<Status, tokio_postgres::Error> {
    let info: Option<SlotInfo> = source::slot_info(client, slot).await?;
    let tables = client
        .query(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1 ORDER BY 1",
            &[&publication],
        )
        .await?
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    Ok(Status {
        slot: slot.to_owned(),
        exists: info.is_some(),
        active: info.as_ref().is_some_and(|i| i.active),
        active_pid: info.as_ref().and_then(|i| i.active_pid),
        confirmed_flush_lsn: info
            .as_ref()
            .and_then(|i| i.confirmed_flush_lsn)
            .map(|l| l.to_string()),
        lag_bytes: info.as_ref().and_then(|i| i.lag_bytes),
        wal_status: info.as_ref().and_then(|i| i.wal_status.clone()),
        safe_wal_size: info.as_ref().and_then(|i| i.safe_wal_size),
        publication: publication.to_owned(),
        publication_tables: tables,
    })
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        if !self.exists {
            writeln!(
                f,
                "slot {}: does not exist (run `cdc-relay setup`)",
                self.slot
            )?;
        } else {
            writeln!(f, "slot {}", self.slot)?;
            writeln!(
                f,
                "  active:              {} (pid {})",
                self.active,
                self.active_pid.map_or("-".into(), |p| p.to_string())
            )?;
            writeln!(
                f,
                "  confirmed_flush_lsn: {}",
                opt(&self.confirmed_flush_lsn)
            )?;
            writeln!(
                f,
                "  lag:                 {} bytes",
                self.lag_bytes.map_or("-".into(), |b| b.to_string())
            )?;
            writeln!(f, "  wal_status:          {}", opt(&self.wal_status))?;
            writeln!(
                f,
                "  safe_wal_size:       {}",
                self.safe_wal_size
                    .map_or("unlimited".into(), |b| format!("{b} bytes"))
            )?;
        }
        writeln!(
            f,
            "publication {}: {}",
            self.publication,
            if self.publication_tables.is_empty() {
                "no tables (or missing)".into()
            } else {
                self.publication_tables.join(", ")
            }
        )
    }
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

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("outbox"), "\"outbox\"");
        assert_eq!(quote_ident("we\"ird"), "\"we\"\"ird\"");
    }
}
