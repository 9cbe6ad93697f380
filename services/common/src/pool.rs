//! The services' connection pool: deadpool's, grown one connection at a
//! time.
//!
//! A deadpool request that finds no idle connection, in a pool below its
//! size, opens one itself and waits for it: a server process forked,
//! authenticated (SCRAM) and its caches filled. After a hiccup in a burst
//! (a WAL segment created, a scheduler delay) every request queued behind
//! it did that at once: a dozen logins on a small server, and the stall
//! they were queued behind grew to tens of milliseconds
//! (`docs/benchmarks.md`, "Bursts: the services' pools grown one
//! connection at a time": 13 backends started within 50 ms, the burst's
//! five slowest orders among them).
//!
//! So deadpool's own limit starts at what was opened at start
//! (`--pool-prefill`, at least 1), and [`Pool::get`] raises it by one, up
//! to `--pool-size`, when fewer than [`SPARE`] connections are idle and
//! every connection the limit allows is open. With no request queued, a
//! task opens the new connection at once, ahead of need; with requests
//! queued, the first of them takes the room and opens it (a task would
//! queue behind them). The limit rises again only once that login has
//! completed.
//! Raised before a request waits and after it got its connection, so
//! growth goes on while requests queue, one login after another, never a
//! dozen at once, and never past `--pool-size` (the server's
//! `max_connections` budget is the same as before). Connections the
//! server closes (a restart, `pg_terminate_backend`) leave room that
//! requests fill as deadpool always did, each opening its own: the limit
//! cannot be lowered without losing deadpool's count of them. The same
//! holds for a prefill the server cut short (it says so at WARN): the
//! limit is what was asked, and requests open the missing connections.

use std::sync::{Arc, Mutex};

use deadpool_postgres::{Object, PoolError, Status};

/// Idle connections [`Pool::get`] keeps ready while the pool is below
/// `--pool-size`: two, so that the request which takes the last-but-one
/// and the one right after it both find a connection open.
pub const SPARE: usize = 2;

/// A deadpool-postgres pool grown one connection at a time (module docs).
/// Cheap to clone: clones share the pool.
#[derive(Clone, Debug)]
pub struct Pool {
    inner: deadpool_postgres::Pool,
    /// `--pool-size`: deadpool's limit is raised up to this.
    limit: usize,
    /// Held while the status is read and the limit raised, so that two
    /// requests never both raise it for the same open connections.
    raising: Arc<Mutex<()>>,
}

impl Pool {
    /// Wraps `inner`, whose `max_size` is the connections to allow at
    /// first (those opened at start), growing up to `limit`
    /// (`--pool-size`).
    pub fn new(inner: deadpool_postgres::Pool, limit: usize) -> Pool {
        Pool {
            inner,
            limit,
            raising: Arc::new(Mutex::new(())),
        }
    }

    /// A connection, as deadpool's `get`: an idle one, else a new one
    /// where the limit leaves room, else the first one freed, within
    /// `--pool-wait-timeout-ms`. The limit is raised (module docs) before
    /// and after. Errors: deadpool's (`Timeout` when none came in time,
    /// `Backend` when one could not be opened).
    pub async fn get(&self) -> Result<Object, PoolError> {
        self.raise_if_wanted(true);
        let client = self.inner.get().await?;
        self.raise_if_wanted(false);
        Ok(client)
    }

    /// The wrapped pool, for what must not raise the limit (the prefill).
    pub fn inner(&self) -> &deadpool_postgres::Pool {
        &self.inner
    }

    /// `before`: called by a request that has not asked deadpool yet (it
    /// is not counted among the waiting).
    fn raise_if_wanted(&self, before: bool) {
        // A poisoned lock only means a panic elsewhere while it was held;
        // the status is read afresh under it.
        let _raising = self
            .raising
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let status = self.inner.status();
        if !wants_growth(status, self.limit) {
            return;
        }
        self.inner.resize(status.max_size + 1);
        // A request about to ask with none idle takes the room itself.
        let caller_takes_it = before && status.available == 0;
        if status.waiting == 0 && !caller_takes_it {
            // Nobody queued: open it now, ahead of the request that would
            // otherwise log in itself. (With requests queued the first of
            // them takes the room and opens it: a task asking behind them
            // would wait its turn, and the pool would grow by one per
            // queue drain.) A login that fails here is met again, and
            // answered, by the next request that needs the room.
            let pool = self.inner.clone();
            tokio::spawn(async move {
                if let Err(e) = pool.get().await {
                    tracing::debug!(error = %crate::db::PoolErrorReport(&e), "opening a connection ahead of need failed");
                }
            });
        }
    }
}

/// Whether a pool in `status` should allow one more connection: fewer than
/// [`SPARE`] idle, every connection its limit allows open (no login under
/// way), and its limit below `limit` (`--pool-size`).
fn wants_growth(status: Status, limit: usize) -> bool {
    status.available < SPARE && status.size >= status.max_size && status.max_size < limit
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(max_size: usize, available: usize, waiting: usize) -> Status {
        Status {
            max_size,
            size: max_size,
            available,
            waiting,
        }
    }

    #[test]
    fn grows_while_below_the_pool_size_with_fewer_than_two_idle() {
        assert!(wants_growth(status(4, 1, 0), 16));
        assert!(wants_growth(status(4, 0, 3), 16), "requests waiting");
        assert!(!wants_growth(status(4, 2, 0), 16), "two idle are enough");
        assert!(
            !wants_growth(status(16, 0, 3), 16),
            "never past --pool-size"
        );
    }
}
