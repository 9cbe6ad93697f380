//! Creating a logical slot, which can wait: the server builds the slot's
//! first snapshot only once every transaction that holds a transaction id
//! when it starts has ended (PostgreSQL docs, "Logical Decoding Concepts"
//! → "Exported Snapshots"; the backend waits on each one's transaction id
//! lock). One transaction left open in another session holds the creation
//! for as long as it stays open.
//!
//! So the creation runs on a connection of its own, bounded on the server
//! side: `statement_timeout` ends the wait after `--slot-create-timeout`,
//! and `client_connection_check_interval` makes the backend notice a
//! client that went away (a killed `setup`) within a second, so no backend
//! is left creating the slot. Meanwhile the side connection says, within a
//! few seconds and then periodically, which transactions it waits for.
//!
//! While another backend creates it, the slot is listed active with no
//! `confirmed_flush_lsn`: [`being_created_by`] names that state, which is
//! never "exists".

use std::time::Duration;

use tokio_postgres::Client;

use super::catalog::{self, SlotInfo};
use super::conn::ConnParams;
use super::error::SourceError;
use crate::lsn::Lsn;

/// The first "still waiting" report comes this soon.
pub const FIRST_REPORT: Duration = Duration::from_secs(3);

/// Then one every this long.
pub const REPORT_EVERY: Duration = Duration::from_secs(15);

/// The pid of the backend still creating `slot`: a slot listed active
/// without a `confirmed_flush_lsn` has not finished its first snapshot.
pub fn being_created_by(slot: &SlotInfo) -> Option<i32> {
    (slot.active && slot.confirmed_flush_lsn.is_none())
        .then_some(slot.active_pid)
        .flatten()
}

/// What a slot being created by `pid` waits for, and what to do, for a
/// message: the slot is not usable until it is done.
pub fn being_created_message(slot: &str, pid: i32, blockers: &[Blocker]) -> String {
    format!(
        "slot {slot:?} is being created by pid {pid}, not yet usable: the server waits for {}. Let it finish (end those transactions), or cancel it with SELECT pg_cancel_backend({pid}); then run this again",
        describe(blockers)
    )
}

/// A transaction the creation waits for (from `pg_stat_activity`, or a
/// prepared transaction from `pg_prepared_xacts`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocker {
    /// Its backend; `None` for a prepared transaction (no backend holds it).
    pub pid: Option<i32>,
    /// A prepared transaction's `gid` and database (two-phase commit left
    /// it prepared: it holds its transaction id until `COMMIT PREPARED` or
    /// `ROLLBACK PREPARED`).
    pub prepared: Option<(String, String)>,
    /// `backend_xid`, when it has one.
    pub xid: Option<String>,
    /// `state`, e.g. `idle in transaction`.
    pub state: Option<String>,
    /// `xact_start`, as text.
    pub xact_start: Option<String>,
    /// `application_name`.
    pub application_name: Option<String>,
    /// The first 60 characters of its last query.
    pub query: Option<String>,
}

/// The transactions backend `pid` waits for (`pg_blocking_pids`), else the
/// oldest transactions holding a transaction id (the snapshot waits for
/// them one by one), with every prepared transaction (`pg_blocking_pids`
/// shows one as pid 0, and no backend holds it), at most five, oldest
/// first.
pub async fn blockers(client: &Client, pid: i32) -> Result<Vec<Blocker>, SourceError> {
    let rows = client
        .query(
            "SELECT pid, backend_xid::text, state, xact_start::text, application_name, \
                    left(query, 60), NULL::text, NULL::text \
             FROM pg_stat_activity \
             WHERE pid <> $1 AND (pid = ANY (pg_blocking_pids($1)) \
                OR (backend_xid IS NOT NULL \
                    AND cardinality(array_remove(pg_blocking_pids($1), 0)) = 0)) \
             UNION ALL \
             SELECT NULL, transaction::text, 'prepared', prepared::text, owner::text, NULL, \
                    gid, database::text \
             FROM pg_prepared_xacts \
             ORDER BY 4 NULLS LAST LIMIT 5",
            &[&pid],
        )
        .await
        .map_err(|e| SourceError::sql("reading what the slot creation waits for", &e))?;
    Ok(rows
        .iter()
        .map(|r| Blocker {
            pid: r.get(0),
            prepared: r
                .get::<_, Option<String>>(6)
                .zip(r.get::<_, Option<String>>(7)),
            xid: r.get(1),
            state: r.get(2),
            xact_start: r.get(3),
            application_name: r.get(4),
            query: r.get(5),
        })
        .collect())
}

/// `blockers` in words, for logs and errors.
pub fn describe(blockers: &[Blocker]) -> String {
    if blockers.is_empty() {
        return "transactions older than the slot to end (none visible to this role)".into();
    }
    let each: Vec<String> = blockers
        .iter()
        .map(|b| {
            if let Some((gid, database)) = &b.prepared {
                return format!(
                    "prepared transaction {gid:?} (xid {}, owner {}, database {database}, prepared since {}: ROLLBACK PREPARED '{}' or COMMIT PREPARED in that database)",
                    b.xid.as_deref().unwrap_or("-"),
                    b.application_name.as_deref().unwrap_or("-"),
                    b.xact_start.as_deref().unwrap_or("-"),
                    gid.replace('\'', "''"),
                );
            }
            format!(
                "pid {} (xid {}, {}, since {}, application_name {:?}, query {:?})",
                crate::shown(&b.pid),
                b.xid.as_deref().unwrap_or("-"),
                b.state.as_deref().unwrap_or("-"),
                b.xact_start.as_deref().unwrap_or("-"),
                b.application_name.as_deref().unwrap_or(""),
                b.query.as_deref().unwrap_or("")
            )
        })
        .collect();
    format!("these transactions to end: {}", each.join("; "))
}

/// Runs `sql` (a `pg_create_logical_replication_slot` call returning the
/// LSN as text, `$1` the slot name) on a connection of its own to `conn`,
/// with the server bounding it to `timeout`; `watch` (another connection)
/// reports what it waits for at [`FIRST_REPORT`] and every
/// [`REPORT_EVERY`]. A timeout is a definite error naming the
/// transactions waited for and `--slot-create-timeout`.
pub async fn create(
    watch: &Client,
    conn: &ConnParams,
    sql: &str,
    slot: &str,
    timeout: Duration,
) -> Result<String, SourceError> {
    let creator = super::connect_sql(conn, "cdc-relay-create-slot").await?;
    let ms = timeout.as_millis().max(1);
    creator
        .batch_execute(&format!(
            "SET statement_timeout = {ms}; SET client_connection_check_interval = 1000"
        ))
        .await
        .map_err(|e| SourceError::sql("bounding the slot creation", &e))?;
    let pid: i32 = creator
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .map_err(|e| SourceError::sql("bounding the slot creation", &e))?
        .get(0);
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&slot];
    let query = creator.query_one(sql, &params);
    tokio::pin!(query);
    let mut next = tokio::time::Instant::now() + FIRST_REPORT;
    let mut last_seen = Vec::new();
    let row = loop {
        tokio::select! {
            r = &mut query => break r,
            _ = tokio::time::sleep_until(next) => {
                next += REPORT_EVERY;
                last_seen = blockers(watch, pid).await.unwrap_or_default();
                tracing::warn!(
                    slot, creator_pid = pid, timeout_s = timeout.as_secs(),
                    "creating the slot waits for {}; it gives up after --slot-create-timeout",
                    describe(&last_seen)
                );
            }
        }
    };
    match row {
        Ok(row) => Ok(row.get(0)),
        // Cancelled otherwise than by statement_timeout (pg_cancel_backend,
        // a signal to its backend): not the timeout's doing.
        Err(e)
            if e.code() == Some(&tokio_postgres::error::SqlState::QUERY_CANCELED)
                && !crate::db_message(&e).contains("statement timeout") =>
        {
            Err(SourceError::Definite(format!(
                "creating slot {slot:?} was cancelled on the server ({}), while it waited for \
                 {}. No slot was left behind; run this again",
                crate::db_message(&e),
                describe(&last_seen)
            )))
        }
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::QUERY_CANCELED) => {
            Err(SourceError::Definite(format!(
                "creating slot {slot:?} gave up after {} (--slot-create-timeout): the server was still waiting for {}. No slot was left behind. End those transactions (or wait for them), then run this again, or raise --slot-create-timeout",
                humantime::format_duration(timeout),
                describe(&last_seen)
            )))
        }
        Err(e) => Err(SourceError::sql(
            "creating the slot (the role needs REPLICATION)",
            &e,
        )),
    }
}

/// Creates a pgoutput slot and returns its starting LSN; with `failover`
/// (PostgreSQL 17+) standbys with `sync_replication_slots` keep a copy. The
/// role needs REPLICATION. The creation runs on its own connection to
/// `conn`, bounded by `timeout` on the server, while `client` reports what
/// it waits for (this module).
pub async fn create_slot(
    client: &Client,
    conn: &ConnParams,
    slot: &str,
    failover: bool,
    timeout: std::time::Duration,
) -> Result<Lsn, SourceError> {
    catalog::check_slot_name(slot)?;
    let sql = if failover {
        let version = catalog::server_version(client).await?;
        if !catalog::supports_failover_slots(version) {
            return Err(SourceError::Definite(format!(
                "failover slots need PostgreSQL 17 or later (this server is {version}); without them, run the relay with --on-slot-loss=recreate-and-backfill"
            )));
        }
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
    } else {
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')"
    };
    let lsn = create(client, conn, sql, slot, timeout).await?;
    let lsn: Lsn = lsn
        .parse()
        .map_err(|e| SourceError::Definite(format!("creating the slot: {e}")))?;
    catalog::record_slot_birth(client, slot, lsn).await?;
    Ok(lsn)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(active: bool, pid: Option<i32>, confirmed: Option<crate::lsn::Lsn>) -> SlotInfo {
        SlotInfo {
            plugin: Some("pgoutput".into()),
            database: None,
            active,
            active_pid: pid,
            confirmed_flush_lsn: confirmed,
            wal_status: None,
            safe_wal_size: None,
            lag_bytes: None,
            retained_wal_bytes: None,
            reply_age_secs: None,
            wait_event_type: None,
            local: true,
            invalidation_reason: None,
            wait_event: None,
            sent_lsn: None,
            flushed_lsn: None,
        }
    }

    #[test]
    fn a_slot_without_a_confirmed_position_held_by_a_backend_is_being_created() {
        let lsn = Some("0/16B3748".parse().expect("an LSN"));
        assert_eq!(being_created_by(&slot(true, Some(42), None)), Some(42));
        assert_eq!(
            being_created_by(&slot(true, Some(42), lsn)),
            None,
            "streaming"
        );
        assert_eq!(being_created_by(&slot(false, None, lsn)), None, "idle");
        let b = Blocker {
            pid: Some(7),
            prepared: None,
            xid: Some("740".into()),
            state: Some("idle in transaction".into()),
            xact_start: Some("2026-12-01 10:00:00+00".into()),
            application_name: Some("psql".into()),
            query: Some("INSERT INTO orders".into()),
        };
        let m = being_created_message("s", 42, &[b]);
        for part in [
            "being created by pid 42",
            "pid 7",
            "xid 740",
            "idle in transaction",
            "\"psql\"",
            "pg_cancel_backend(42)",
        ] {
            assert!(m.contains(part), "{part}: {m}");
        }
        let forgotten = Blocker {
            pid: None,
            prepared: Some(("forgotten_2pc".into(), "orders".into())),
            xid: Some("741".into()),
            state: Some("prepared".into()),
            xact_start: Some("2026-12-01 09:00:00+00".into()),
            application_name: Some("app".into()),
            query: None,
        };
        let m = describe(&[forgotten]);
        assert!(
            m.contains("prepared transaction \"forgotten_2pc\"")
                && m.contains("ROLLBACK PREPARED 'forgotten_2pc'")
                && m.contains("database orders"),
            "{m}"
        );
    }
}
