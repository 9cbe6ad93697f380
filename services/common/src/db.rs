//! The connection pool: every wait on the database is bounded.
//!
//! | bound | where | on expiry |
//! |---|---|---|
//! | connect (TCP + auth) | `connect_timeout`, pool create timeout | 503 `database_unavailable` |
//! | free pooled connection | pool wait timeout | 503 `pool_exhausted` |
//! | one statement | `statement_timeout` (server) | 500, transaction rolled back |
//! | one lock | `lock_timeout` (server) | 500, transaction rolled back |
//! | idle open transaction | `idle_in_transaction_session_timeout` | server ends the session |
//!
//! The server-side settings travel in the startup packet (`options=-c ...`),
//! so they hold from the first statement of every connection, with no extra
//! round trip.
//!
//! Plan caching: every session runs with `plan_cache_mode=force_custom_plan`.
//! PostgreSQL switches a cached statement to a *generic* plan after five
//! executions when it looks no worse; a pooled connection that warmed up while
//! `orders` was empty then keeps a generic plan for the outbox foreign-key
//! check that sequentially scans `orders`, for its whole life (throughput fell
//! 5x in one measured run). Custom plans are re-planned against the table as it
//! is now; our statements are single-row inserts and lookups whose planning
//! costs microseconds, far below one round trip. We chose this over recycling
//! connections after N uses because it fixes the cause (and covers the
//! foreign-key queries PostgreSQL caches internally) instead of limiting how
//! long a bad plan can live.

use std::str::FromStr;
use std::time::Duration;

use deadpool_postgres::tokio_postgres::config::Host;
use deadpool_postgres::tokio_postgres::{Config, NoTls};
use deadpool_postgres::{Manager, ManagerConfig, RecyclingMethod, Runtime};

use crate::pool::Pool;

/// Database flags. The URL is never printed (`--help` hides its env value,
/// `Debug` redacts it).
#[derive(Clone, clap::Args)]
pub struct DbArgs {
    /// PostgreSQL URL, e.g. `postgresql://user:password@127.0.0.1:5432/orders`
    /// (key=value form also accepted). Connections are plain TCP or a unix
    /// socket: keep the database on a trusted network.
    #[arg(long, hide_env_values = true)]
    pub database_url: String,
    /// Maximum pooled connections.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..))]
    pub pool_size: u16,
    /// Connections opened at start, before the service says it is
    /// listening [default: 4, at most `--pool-size`]. A pool that grows
    /// during a burst delays each request that waits for a new connection (a
    /// server process started and authenticated: milliseconds); the prefilled
    /// ones carry the first requests of a burst at once. Past those the
    /// pool grows one connection at a time toward `--pool-size` (room for
    /// one more whenever fewer than two are idle and no login is under
    /// way), so a burst never sets off a dozen logins at once. 0: only the
    /// one connection that checks the database. Each
    /// prefilled connection is held for the service's life: count them
    /// against the server's `max_connections` (every instance of every
    /// service). Above `--pool-size`: exit 2.
    #[arg(long)]
    pub pool_prefill: Option<u16>,
    /// How long a request waits for a free pooled connection before 503, in ms.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    pub pool_wait_timeout_ms: u64,
    /// Timeout to open and authenticate a new connection, in ms.
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(1..))]
    pub connect_timeout_ms: u64,
    /// Server-side `statement_timeout`, in ms; 0: none (PostgreSQL's meaning).
    #[arg(long, default_value_t = 3000)]
    pub statement_timeout_ms: u64,
    /// Server-side `lock_timeout`, in ms; 0: none (PostgreSQL's meaning).
    #[arg(long, default_value_t = 1000)]
    pub lock_timeout_ms: u64,
    /// Server-side `idle_in_transaction_session_timeout`, in ms; 0: none
    /// (PostgreSQL's meaning).
    #[arg(long, default_value_t = 10_000)]
    pub idle_in_transaction_timeout_ms: u64,
}

impl std::fmt::Debug for DbArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DbArgs")
            .field("database_url", &"<redacted>")
            .field("pool_size", &self.pool_size)
            .field("pool_prefill", &self.pool_prefill)
            .field("pool_wait_timeout_ms", &self.pool_wait_timeout_ms)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("statement_timeout_ms", &self.statement_timeout_ms)
            .field("lock_timeout_ms", &self.lock_timeout_ms)
            .field(
                "idle_in_transaction_timeout_ms",
                &self.idle_in_transaction_timeout_ms,
            )
            .finish()
    }
}

/// The pool could not be built from the flags.
#[derive(Debug, thiserror::Error)]
pub enum DbSetupError {
    /// `--pool-prefill` above `--pool-size`.
    #[error(
        "--pool-prefill {prefill} is above --pool-size {size}: at most --pool-size connections are open"
    )]
    Prefill {
        /// The `--pool-prefill` given.
        prefill: u16,
        /// The `--pool-size` given.
        size: u16,
    },
    /// `--database-url` did not parse. The URL itself is not echoed.
    #[error("invalid --database-url: {0}")]
    InvalidUrl(String),
    /// deadpool rejected the pool settings.
    #[error("cannot build the connection pool: {0}")]
    Build(#[from] deadpool_postgres::BuildError),
}

impl DbArgs {
    /// The connection settings: the URL plus this module's timeouts and
    /// session options, with `application_name` defaulting to `app_name`.
    ///
    /// Several hosts (`postgres://h1,h2/db?target_session_attrs=primary`)
    /// follow a failover: each new connection tries them in order and, with
    /// `primary` or `read-write`, keeps only a server that accepts writes.
    /// (`primary` is libpq's name; tokio-postgres calls it `read-write`.)
    pub fn pg_config(&self, app_name: &str) -> Result<Config, DbSetupError> {
        let url = self.database_url.replace(
            "target_session_attrs=primary",
            "target_session_attrs=read-write",
        );
        let mut config =
            Config::from_str(&url).map_err(|e| DbSetupError::InvalidUrl(e.to_string()))?;
        if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
            // An empty URL parses, and would then look like an outage.
            return Err(DbSetupError::InvalidUrl(
                "no host given (e.g. postgresql://user@127.0.0.1:5432/db, or host=/run/postgresql for a unix socket)".into(),
            ));
        }
        config.connect_timeout(Duration::from_millis(self.connect_timeout_ms));
        if config.get_application_name().is_none() {
            config.application_name(app_name);
        }
        let session = format!(
            "-c statement_timeout={} -c lock_timeout={} -c idle_in_transaction_session_timeout={} \
             -c plan_cache_mode=force_custom_plan",
            self.statement_timeout_ms, self.lock_timeout_ms, self.idle_in_transaction_timeout_ms
        );
        let options = match config.get_options() {
            Some(existing) if !existing.trim().is_empty() => format!("{existing} {session}"),
            _ => session,
        };
        config.options(options);
        Ok(config)
    }

    /// How many connections [`crate::db::prefill`] opens at start:
    /// `--pool-prefill`, or [`DEFAULT_PREFILL`] within the pool.
    pub fn prefill(&self) -> u16 {
        self.pool_prefill
            .unwrap_or(DEFAULT_PREFILL.min(self.pool_size))
    }

    /// Builds the pool; no connection is opened until first use (see
    /// [`crate::db::prefill`]). Errors: a bad URL, `--pool-prefill` above
    /// `--pool-size`.
    pub fn build_pool(&self, app_name: &str) -> Result<Pool, DbSetupError> {
        if let Some(prefill) = self.pool_prefill.filter(|p| *p > self.pool_size) {
            return Err(DbSetupError::Prefill {
                prefill,
                size: self.pool_size,
            });
        }
        let config = self.pg_config(app_name)?;
        let manager = Manager::from_config(
            config,
            NoTls,
            // Fast: a pooled connection is reused as is (a closed one is
            // dropped). Open transactions cannot leak: tokio-postgres rolls
            // back a dropped `Transaction`.
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let connect = Duration::from_millis(self.connect_timeout_ms);
        // Deadpool's limit starts at what the prefill opens; `Pool` raises
        // it one connection at a time (see `crate::pool`).
        let pool = deadpool_postgres::Pool::builder(manager)
            .max_size(usize::from(self.prefill().max(1)))
            .wait_timeout(Some(Duration::from_millis(self.pool_wait_timeout_ms)))
            .create_timeout(Some(connect))
            .recycle_timeout(Some(connect))
            .runtime(Runtime::Tokio1)
            .build()?;
        Ok(Pool::new(pool, usize::from(self.pool_size)))
    }
}

/// Connections opened at start by default: enough for a burst's first
/// requests at a few thousand per second (each holds one for about a
/// millisecond), few enough that several instances of each service fit in
/// PostgreSQL's default `max_connections` (100) beside the relay.
pub const DEFAULT_PREFILL: u16 = 4;

/// What [`prefill`] opened.
#[derive(Debug)]
pub struct Prefilled {
    /// Connections opened (they are back in the pool, idle).
    pub opened: usize,
    /// Connections asked for.
    pub wanted: usize,
    /// Why the others were not opened (the first failure), if any.
    pub failed: Option<deadpool_postgres::PoolError>,
}

/// Opens one connection, then, if it opened, up to `n - 1` more at once,
/// and returns them to the pool. The first one alone: a database that is
/// down, or refuses the password, is tried once, not `n` times. Those that
/// fail to open are opened on demand later, as without a prefill.
pub async fn prefill(pool: &Pool, n: u16) -> Prefilled {
    let pool = pool.inner();
    let wanted = usize::from(n.max(1));
    let first = match pool.get().await {
        Ok(first) => first,
        Err(e) => {
            return Prefilled {
                opened: 0,
                wanted,
                failed: Some(e),
            };
        }
    };
    // All held at once, so each `get` opens a connection of its own; they
    // go back to the pool when dropped here.
    let rest = futures::future::join_all((1..wanted).map(|_| pool.get())).await;
    drop(first);
    let mut opened = 1;
    let mut failed = None;
    for got in rest {
        match got {
            Ok(_) => opened += 1,
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
    }
    Prefilled {
        opened,
        wanted,
        failed,
    }
}

/// `host=... port=... dbname=...` for logs: never the user's password (nor
/// the user name).
pub fn describe_target(config: &Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|h| match h {
            Host::Tcp(name) => name.clone(),
            Host::Unix(path) => path.display().to_string(),
        })
        .collect();
    let ports: Vec<String> = config.get_ports().iter().map(u16::to_string).collect();
    format!(
        "host={} port={} dbname={}",
        if hosts.is_empty() {
            "localhost".to_owned()
        } else {
            hosts.join(",")
        },
        if ports.is_empty() {
            "5432".to_owned()
        } else {
            ports.join(",")
        },
        config.get_dbname().unwrap_or("<default>")
    )
}

/// A database error as the logs show it. `tokio_postgres::Error`'s own
/// `Display` says only `db error` for everything the server reports (a
/// wrong password, a missing table, a timeout); this shows the server's
/// severity, message and SQLSTATE (and its detail and hint when sent), or,
/// for a client-side failure, the error and its causes (`error connecting
/// to server: Connection refused`). The server never echoes a password,
/// and no connection setting is printed.
pub struct PgErrorReport<'a>(pub &'a deadpool_postgres::tokio_postgres::Error);

impl std::fmt::Display for PgErrorReport<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(db) = self.0.as_db_error() {
            write!(
                f,
                "{}: {} (SQLSTATE {})",
                db.severity(),
                db.message(),
                db.code().code()
            )?;
            if let Some(detail) = db.detail() {
                write!(f, "; detail: {detail}")?;
            }
            if let Some(hint) = db.hint() {
                write!(f, "; hint: {hint}")?;
            }
            return Ok(());
        }
        write!(f, "{}", self.0)?;
        let mut cause = std::error::Error::source(self.0);
        while let Some(err) = cause {
            write!(f, ": {err}")?;
            cause = err.source();
        }
        Ok(())
    }
}

/// The SQLSTATE of `err`, or `-` when the server sent none.
pub fn sqlstate(err: &deadpool_postgres::tokio_postgres::Error) -> &str {
    err.code().map_or("-", |c| c.code())
}

/// A pool error as the logs show it: the database error inside, reported
/// by [`PgErrorReport`], else the pool's own words.
pub struct PoolErrorReport<'a>(pub &'a deadpool_postgres::PoolError);

impl std::fmt::Display for PoolErrorReport<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use deadpool_postgres::{HookError, PoolError};
        match self.0 {
            PoolError::Backend(e) | PoolError::PostCreateHook(HookError::Backend(e)) => {
                write!(f, "{}", PgErrorReport(e))
            }
            PoolError::Timeout(kind) => write!(
                f,
                "timed out {}",
                match kind {
                    deadpool_postgres::TimeoutType::Wait => "waiting for a free connection",
                    deadpool_postgres::TimeoutType::Create => "opening a connection",
                    deadpool_postgres::TimeoutType::Recycle => "checking a pooled connection",
                }
            ),
            other => write!(f, "{other}"),
        }
    }
}

/// The SQLSTATE inside a pool error, or `-`.
pub fn pool_sqlstate(err: &deadpool_postgres::PoolError) -> &str {
    use deadpool_postgres::{HookError, PoolError};
    match err {
        PoolError::Backend(e) | PoolError::PostCreateHook(HookError::Backend(e)) => sqlstate(e),
        _ => "-",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(url: &str) -> DbArgs {
        DbArgs {
            database_url: url.to_owned(),
            pool_size: 4,
            pool_prefill: None,
            pool_wait_timeout_ms: 100,
            connect_timeout_ms: 3000,
            statement_timeout_ms: 3000,
            lock_timeout_ms: 1000,
            idle_in_transaction_timeout_ms: 10_000,
        }
    }

    #[test]
    fn a_prefill_above_the_pool_size_is_refused_naming_both_flags() {
        let mut a = args("postgresql://u@127.0.0.1:1/db");
        a.pool_size = 2;
        assert_eq!(a.prefill(), 2, "the default, within the pool");
        a.pool_size = 4;
        assert_eq!(a.prefill(), DEFAULT_PREFILL);
        a.pool_prefill = Some(4);
        assert!(a.build_pool("svc").is_ok());
        a.pool_prefill = Some(0);
        assert_eq!(a.prefill(), 0);
        a.pool_prefill = Some(5);
        let e = a.build_pool("svc").expect_err("5 > 4").to_string();
        assert!(
            e.contains("--pool-prefill 5") && e.contains("--pool-size 4"),
            "{e}"
        );
    }

    #[test]
    fn a_url_without_a_host_is_refused() {
        for url in ["", "dbname=orders user=app", "postgresql:///orders"] {
            let e = args(url).build_pool("svc").expect_err(url).to_string();
            assert!(
                e.contains("--database-url") && e.contains("no host"),
                "{url:?}: {e}"
            );
        }
        assert!(
            args("host=/run/postgresql dbname=orders")
                .build_pool("svc")
                .is_ok()
        );
    }

    #[test]
    fn session_options_carry_every_bound_and_plan_mode() {
        let config = args("postgresql://app:s3cret@db.example:6543/orders")
            .pg_config("orders")
            .expect("config");
        let options = config.get_options().expect("options");
        for expected in [
            "statement_timeout=3000",
            "lock_timeout=1000",
            "idle_in_transaction_session_timeout=10000",
            "plan_cache_mode=force_custom_plan",
        ] {
            assert!(options.contains(expected), "{options} lacks {expected}");
        }
        assert_eq!(config.get_connect_timeout(), Some(&Duration::from_secs(3)));
        assert_eq!(config.get_application_name(), Some("orders"));
    }

    #[test]
    fn existing_url_options_are_kept() {
        let config = args("postgresql://app@h/db?options=-c%20search_path%3Dapp")
            .pg_config("orders")
            .expect("config");
        assert!(
            config
                .get_options()
                .unwrap()
                .starts_with("-c search_path=app -c statement_timeout")
        );
    }

    #[test]
    fn described_target_never_contains_the_password() {
        let config = args("postgresql://app:s3cret@db.example:6543/orders")
            .pg_config("orders")
            .expect("config");
        let described = describe_target(&config);
        assert_eq!(described, "host=db.example port=6543 dbname=orders");
        assert!(!format!("{:?}", args("postgresql://app:s3cret@h/db")).contains("s3cret"));
    }

    #[test]
    fn several_hosts_follow_the_primary() {
        use deadpool_postgres::tokio_postgres::config::TargetSessionAttrs;
        let config = args("postgresql://app@h1:5432,h2:5433/orders?target_session_attrs=primary")
            .pg_config("orders")
            .expect("config");
        assert_eq!(config.get_hosts().len(), 2);
        assert_eq!(config.get_ports(), [5432, 5433]);
        assert_eq!(
            config.get_target_session_attrs(),
            TargetSessionAttrs::ReadWrite
        );
        assert_eq!(
            describe_target(&config),
            "host=h1,h2 port=5432,5433 dbname=orders"
        );
    }

    #[test]
    fn invalid_url_is_not_echoed() {
        let err = args("postgresql://app:s3cret@h:notaport/db")
            .pg_config("x")
            .unwrap_err();
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }
}
