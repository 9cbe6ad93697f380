//! The relay's two connections reach what they must: the side connection
//! is a session of its own on the server (not a transaction-mode pool),
//! and a separate `--replication-url` reaches the same database of the
//! same server as `--database-url`.
//!
//! Both are configuration errors that retrying cannot fix, checked where
//! `run` prepares a session and where `setup` and `status` start, so the
//! three say the same thing (exit 2).
//!
//! - **A transaction-mode pool.** The side connection keeps session state:
//!   its `lock_timeout`, the statements tokio-postgres prepares and reuses
//!   by name, the progress record's transaction-scoped lock. Through
//!   PgBouncer in transaction (or statement) mode, each transaction may run
//!   on another server backend, so a prepared statement "does not exist"
//!   or "already exists" at random under load. Seen from the client, a
//!   session is one backend for its whole life and two sessions are never
//!   the same backend; a pool in transaction mode breaks the second as soon
//!   as it hands a released backend to the next client (PgBouncer hands
//!   out the most recently released one by default). So the side
//!   connection and a probe connection each ask `pg_backend_pid()`, twice
//!   in turn: the same pid on both, or a pid that changes within one, is a
//!   transaction-mode pool. A pool that happens to hand out different
//!   backends at start is caught later, by its first symptom
//!   ([`SourceError::sql`] maps 26000 and 42P05 to the same error).
//! - **Different databases or servers.** `IDENTIFY_SYSTEM` on the
//!   replication URL gives the cluster's system identifier and the
//!   database; the side connection gives `pg_control_system()` and
//!   `current_database()` (names through a pooler are aliases, so the
//!   server's own answers are compared, not the URLs), and the timeline
//!   `IDENTIFY_SYSTEM` names against the side's (a promoted standby or a
//!   point-in-time restore keeps the system identifier and the database
//!   names, on a later timeline). A role without `EXECUTE` on
//!   `pg_control_system()` skips the system identifier; each stream start
//!   then still checks that this relay's walsender holds the slot on the
//!   side connection's server, and `setup` that the slot it created shows
//!   there (a file-level copy started on its own keeps even the timeline).

use tokio_postgres::Client;

use super::conn::ConnParams;
use super::error::SourceError;
use super::transport;

/// Checks that `side` (connected with `side_conn`) is a session of its own
/// and, when the stream has its own URL, that `replication` reaches the
/// same database of the same server.
///
/// # Errors
/// [`SourceError::SidePooled`] or [`SourceError::ServersDiffer`] (exit 2);
/// a replication URL that cannot connect (authentication, TLS) gives its
/// own error, prefixed with the flag; a failed probe statement, its error.
pub async fn check(
    side: &Client,
    side_conn: &ConnParams,
    replication: Option<&ConnParams>,
    application_name: &str,
) -> Result<(), SourceError> {
    if let Err(pooled) = own_session(side, side_conn, application_name).await {
        // The stream's URL through a pooler too is said first, as `setup`
        // and `status` say it (fixing it may leave only the side pooled).
        transport::check_not_pooled(replication.unwrap_or(side_conn)).await?;
        return Err(pooled);
    }
    if let Some(replication) = replication {
        same_database(side, replication).await?;
    }
    Ok(())
}

/// The transaction-mode pool check of the module doc.
async fn own_session(
    side: &Client,
    side_conn: &ConnParams,
    application_name: &str,
) -> Result<(), SourceError> {
    let probe = super::connect_sql(side_conn, application_name).await?;
    for _ in 0..2 {
        let first = backend_pid(side).await?;
        let other = backend_pid(&probe).await?;
        let again = backend_pid(side).await?;
        if first == other || first != again {
            return Err(SourceError::SidePooled {
                evidence: if first == other {
                    format!(
                        "two of the relay's connections were served by one server backend (pid {first})"
                    )
                } else {
                    format!(
                        "one connection's statements ran on two server backends (pid {first}, then {again})"
                    )
                },
            });
        }
    }
    Ok(())
}

/// `pg_backend_pid()` over the simple query protocol: no prepared
/// statement is left behind on a pooled backend, where it would break the
/// next client of that backend.
async fn backend_pid(client: &Client) -> Result<i32, SourceError> {
    let context = "asking the server for this session's backend";
    let messages = client
        .simple_query("SELECT pg_backend_pid()")
        .await
        .map_err(|e| SourceError::sql(context, &e))?;
    messages
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0)?.parse().ok(),
            _ => None,
        })
        .ok_or_else(|| SourceError::Transient(format!("{context}: no pid in the answer")))
}

/// The different-databases check of the module doc.
async fn same_database(side: &Client, replication: &ConnParams) -> Result<(), SourceError> {
    const FLAG: &str = "--replication-url (CDC_RELAY_REPLICATION_URL)";
    let transport::Identity {
        system_id,
        timeline,
        dbname,
    } = match transport::identify(replication).await {
        Ok(identity) => identity,
        Err(e @ SourceError::ThroughPooler { .. }) => return Err(e),
        Err(SourceError::Definite(why)) => {
            return Err(SourceError::Definite(format!(
                "{FLAG} {}: {why}",
                replication.display()
            )));
        }
        Err(e) => return Err(e),
    };
    // The side's timeline: the first 8 hex digits of its current WAL
    // file's name (pg_walfile_name uses the timeline WAL is inserted on;
    // it fails on a standby, which the side connection must not be).
    let row = side
        .query_one(
            "SELECT current_database(), \
                    CASE WHEN pg_is_in_recovery() THEN NULL \
                         ELSE left(pg_walfile_name(pg_current_wal_lsn()), 8) END",
            &[],
        )
        .await
        .map_err(|e| SourceError::sql("reading the side connection's database", &e))?;
    let side_db: String = row.get(0);
    let side_timeline = row
        .get::<_, Option<String>>(1)
        .and_then(|t| u32::from_str_radix(&t, 16).ok());
    let side_system = match side
        .query_one(
            "SELECT system_identifier::text FROM pg_control_system()",
            &[],
        )
        .await
    {
        Ok(row) => Some(row.get::<_, String>(0)),
        // EXECUTE revoked from the role: the database name and timeline
        // are compared, and each stream start checks the slot's holder.
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) => {
            None
        }
        Err(e) => {
            return Err(SourceError::sql(
                "reading the server's system identifier",
                &e,
            ));
        }
    };
    let other_server = side_system.as_ref().is_some_and(|s| *s != system_id);
    let other_db = dbname.as_ref().is_some_and(|d| *d != side_db);
    // A promoted copy (or a point-in-time restore) keeps the system
    // identifier and the database names, on a later timeline.
    let other_timeline = matches!((timeline, side_timeline), (Some(a), Some(b)) if a != b);
    if other_server || other_db || other_timeline {
        let system = |s: Option<&String>| s.map_or_else(|| "?".to_owned(), Clone::clone);
        let tli = |t: Option<u32>| t.map_or_else(|| "?".to_owned(), |t| t.to_string());
        return Err(SourceError::ServersDiffer {
            detail: format!(
                "--replication-url reaches database {} of the server with system identifier {system_id} on timeline {}, \
                 --database-url database {side_db} of the server with system identifier {} on timeline {}{}",
                dbname.as_deref().unwrap_or("?"),
                tli(timeline),
                system(side_system.as_ref()),
                tli(side_timeline),
                if other_timeline && !other_server {
                    " (one is a promoted or restored copy of the other)"
                } else {
                    ""
                },
            ),
        });
    }
    Ok(())
}
