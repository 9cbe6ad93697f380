//! Who holds the locks a statement of the relay waited for, in words.
//!
//! The side connection and `status` bound lock waits with `lock_timeout`
//! (`source::lock_wait`); the server then cancels the statement with
//! SQLSTATE 55P03. [`holders`] reads, on the same connection, the sessions
//! that hold strong table locks at that moment, for the message. Shared by
//! the source's checks and the dead-letter writer.

use tokio_postgres::Client;

/// Whether `e` is the server ending a lock wait (`lock_timeout`, SQLSTATE
/// 55P03 lock_not_available).
pub fn is_lock_wait(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE)
}

/// The sessions holding strong table locks (ShareLock and stronger) in
/// this database now, at most five, oldest transaction first, each as
/// `pid N (application, state since YYYY-MM-DD HH:MM:SS+00: last
/// statement) holds MODE on TABLE`, followed by the command that ends
/// them; or why none could be named.
pub async fn holders(client: &Client) -> String {
    let this = "(SELECT oid FROM pg_database WHERE datname = current_database())";
    match held(client, &format!("l.database IN (0, {this})"), &[]).await {
        Ok(None) => "no session holds a strong table lock now (it ended)".into(),
        Ok(Some(named)) => named,
        Err(e) => format!("who holds it could not be read: {}", crate::db_message(&e)),
    }
}

/// The sessions holding a strong lock on a system catalog of database
/// `dbname` (a relation OID below 16384, PostgreSQL's first user OID),
/// read on `client`, a session of **another** database: a new session of
/// `dbname` that must rebuild its catalog cache waits for such a lock
/// before its login completes, so it cannot be read from there. System
/// catalogs have the same OIDs in every database, so their names resolve
/// here. As [`holders`]; `Ok(None)` when none is held.
pub async fn catalog_holders(
    client: &Client,
    dbname: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    let db = "l.database = (SELECT oid FROM pg_database WHERE datname = $1) AND l.relation < 16384";
    held(client, db, &[&dbname]).await
}

/// The strong relation locks granted where `scope` (SQL over `pg_locks l`)
/// holds, in words with the command that ends them; `None` when none.
async fn held(
    client: &Client,
    scope: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Option<String>, tokio_postgres::Error> {
    let rows = client
        .query(
            &format!(
                "SELECT format('pid %s (%s, %s since %s: %s) holds %s on %s', l.pid, \
                    coalesce(nullif(a.application_name, ''), 'no application_name'), \
                    coalesce(a.state, '?'), \
                    coalesce(to_char(a.xact_start AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS+00'), '?'), \
                    left(regexp_replace(coalesce(a.query, '?'), '\\s+', ' ', 'g'), 80), \
                    l.mode, l.relation::regclass) \
             FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.granted AND l.locktype = 'relation' AND l.pid <> pg_backend_pid() \
               AND l.mode IN ('AccessExclusiveLock', 'ExclusiveLock', 'ShareRowExclusiveLock', 'ShareLock') \
               AND {scope} \
             ORDER BY a.xact_start NULLS LAST, l.pid LIMIT 5"
            ),
            params,
        )
        .await?;
    if rows.is_empty() {
        return Ok(None);
    }
    let named: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    Ok(Some(format!(
        "{}; end that transaction (SELECT pg_terminate_backend(pid)) or let it finish",
        named.join("; ")
    )))
}
