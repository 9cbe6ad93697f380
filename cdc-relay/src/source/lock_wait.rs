//! Lock waits on the relay's own SQL connections, bounded and named.
//!
//! The relay's reads of the catalog (the slot, the publication membership,
//! the outbox checks) take ordinary locks on catalog tables. A session that
//! holds a strong lock on one of them (an open transaction that ran `LOCK
//! TABLE pg_publication_namespace`, a `VACUUM FULL` of a catalog, DDL left
//! uncommitted) blocks those reads, and the walsender's reads too. Unbounded,
//! the relay hangs in its start-up or its slot monitor without a word, and a
//! reconnect leaves the abandoned backend waiting on the server. So the
//! relay's side connection and `status` wait for a lock at most
//! [`LOCK_TIMEOUT`] (`lock_timeout`, PostgreSQL docs "Client Connection
//! Defaults"); the server then cancels the statement with SQLSTATE 55P03
//! ([`SourceError::LockWait`], transient), and [`named`] adds who holds
//! strong locks at that moment, with the command that ends them.

use std::time::Duration;

use tokio_postgres::Client;

use super::error::SourceError;

/// How long a statement on the side connection waits for a lock before the
/// server cancels it (SQLSTATE 55P03). Below the slot monitor's 5 s bound
/// for a reading, so the reading fails with the cause instead of timing out.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(4);

/// Sets [`LOCK_TIMEOUT`] as `client`'s session `lock_timeout`.
///
/// # Errors
/// The statement's error, classified.
pub async fn bound(client: &Client) -> Result<(), SourceError> {
    client
        .batch_execute(&format!("SET lock_timeout = {}", LOCK_TIMEOUT.as_millis()))
        .await
        .map_err(|e| SourceError::sql("bounding lock waits (lock_timeout)", &e))
}

/// `e` with the sessions that hold strong table locks now (read on
/// `client`, whose statement the lock timeout ended) when it is a
/// [`SourceError::LockWait`]; any other error unchanged.
pub async fn named(client: &Client, e: SourceError) -> SourceError {
    let SourceError::LockWait { context, .. } = e else {
        return e;
    };
    let holders = crate::locks::holders(client).await;
    SourceError::LockWait { context, holders }
}
