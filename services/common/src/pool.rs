//! The services' connection pool: deadpool's, grown one connection at a
//! time ahead of need.
//!
//! A deadpool request that finds no idle connection, in a pool below its
//! size, opens one itself and waits for it: a server process forked,
//! authenticated (SCRAM) and its caches filled. After a hiccup in a burst
//! (a WAL segment created, a scheduler delay) every request queued behind
//! it does that at once: a dozen logins on a small server, and the stall
//! they were queued behind grows to tens of milliseconds
//! (`docs/benchmarks.md`, "Bursts and the services' pools": 13 backends
//! started within 50 ms, the burst's five slowest orders among them).
//!
//! So deadpool's own limit starts at what was opened at start
//! (`--pool-prefill`, at least 1) and only this module raises it, one
//! connection at a time, toward `--pool-size`: [`Pool::get`] keeps
//! [`SPARE`] connections idle by opening the next one in one background
//! task. A request that finds none idle waits for the first one freed or
//! opened, instead of logging in itself beside a dozen others. The server
//! sees at most one login at a time from each service instance, and never
//! more than `--pool-size` connections, so its `max_connections` budget is
//! the same as before. A connection that fails to open is not retried by
//! the task; the next request that wants growth tries again, and a request
//! meanwhile waits at most `--pool-wait-timeout-ms` for a free one (503
//! `pool_exhausted`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use deadpool_postgres::{Object, PoolError, Status};

/// Idle connections [`Pool::get`] keeps ready while the pool is below
/// `--pool-size`: two, so that the request which takes the last-but-one
/// and the one right after it both find a connection open.
pub const SPARE: usize = 2;

/// A deadpool-postgres pool that opens its next connection before a
/// request has to wait for it, one at a time (module docs). Cheap to
/// clone: clones share the pool.
#[derive(Clone, Debug)]
pub struct Pool {
    inner: deadpool_postgres::Pool,
    /// `--pool-size`: deadpool's limit is raised up to this.
    limit: usize,
    growing: Arc<AtomicBool>,
}

impl Pool {
    /// Wraps `inner`, whose `max_size` is the connections to allow at
    /// first (those opened at start), growing up to `limit`
    /// (`--pool-size`).
    pub fn new(inner: deadpool_postgres::Pool, limit: usize) -> Pool {
        Pool {
            inner,
            limit,
            growing: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A connection, as deadpool's `get`: an idle one, or the first freed
    /// or opened within `--pool-wait-timeout-ms`. Then, if fewer than
    /// [`SPARE`] are left idle and the pool is below `--pool-size`, opens
    /// one more in the background. Errors: deadpool's (`Timeout` when none
    /// came in time, `Backend` when one could not be opened).
    pub async fn get(&self) -> Result<Object, PoolError> {
        let client = self.inner.get().await?;
        self.grow_ahead();
        Ok(client)
    }

    /// The pool's size, its current limit, idle connections and waiting
    /// requests.
    pub fn status(&self) -> Status {
        self.inner.status()
    }

    /// The wrapped pool, for what must not start growth (the prefill).
    pub fn inner(&self) -> &deadpool_postgres::Pool {
        &self.inner
    }

    fn grow_ahead(&self) {
        if !wants_growth(self.inner.status(), self.limit)
            || self.growing.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let pool = self.inner.clone();
        let limit = self.limit;
        let growing = Arc::clone(&self.growing);
        tokio::spawn(async move {
            // Raised only when every allowed connection is open: a limit
            // raised ahead of the connections would let each request that
            // finds none idle open its own again.
            let status = pool.status();
            if status.size >= status.max_size && status.max_size < limit {
                pool.resize(status.max_size + 1);
            }
            // With none idle this `get` opens the new connection (or a
            // waiting request takes the permit and opens it: one login
            // either way); dropped, it stays in the pool, idle.
            drop(pool.get().await);
            growing.store(false, Ordering::Release);
        });
    }
}

/// Whether a pool in `status` should open one more connection: fewer than
/// [`SPARE`] idle and its limit below `limit` (`--pool-size`).
fn wants_growth(status: Status, limit: usize) -> bool {
    status.available < SPARE && status.max_size < limit
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
