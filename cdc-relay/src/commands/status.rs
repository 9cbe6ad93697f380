//! `cdc-relay status`: the slot and the publication as the database shows
//! them.

use serde::Serialize;
use tokio_postgres::Client;

use super::{connect, outln};
use crate::cli::{GlobalArgs, StatusArgs};
use crate::source::SourceError;
use crate::source::catalog::{self, SlotInfo};

/// `cdc-relay status`: prints [`status`] as text or JSON.
pub async fn command(g: &GlobalArgs, a: StatusArgs) -> anyhow::Result<()> {
    let client = connect(g).await?;
    let publication = g.publication.first().cloned().unwrap_or_default();
    let s = status(&client, &g.slot, &publication).await?;
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        outln!("{}", s.to_string().trim_end());
    }
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
pub async fn status(client: &Client, slot: &str, publication: &str) -> Result<Status, SourceError> {
    let info: Option<SlotInfo> = catalog::slot_info(client, slot).await?;
    let tables = client
        .query(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1 ORDER BY 1",
            &[&publication],
        )
        .await
        .map_err(|e| SourceError::sql("reading the publication's tables", &e))?
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
