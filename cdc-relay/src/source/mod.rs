//! The replication source: everything that talks to the source database.
//!
//! ```text
//!  conn (URL, SslMode) ──▶ tls ──▶ connect_sql ──▶ side connection ──▶ catalog (slot, settings, checks)
//!                                                        │                 monitor (slot), watchdog (liveness)
//!                         transport::open ──▶ replication connection ──▶ stream::Stream (read, decode, map)
//!  every failure ──▶ error::SourceError (definite: stop and say why; transient: reconnect)
//! ```
//!
//! - [`conn`]: connection parameters parsed from a libpq URL or key/value
//!   string, with an [`SslMode`].
//! - [`tls`]: libpq's `sslmode` for both connections.
//! - [`error`]: [`SourceError`] and the one SQLSTATE/transport classifier.
//! - [`catalog`]: slot info, settings, outbox and publication checks,
//!   identifier quoting.
//! - [`transport`]: opening the replication stream; the one place that
//!   sets the flush position.
//! - [`stream`]: the stream's reader: decode, map, admit, hand on.
//! - [`membership`]: whether the outbox is still in its publication.
//! - [`progress`]: the progress record in `cdc_relay_progress`.
//! - [`slot_creation`]: creating a slot, bounded, saying what it waits
//!   for; a slot still being created.
//! - [`failover`]: failover slots and the standbys' copies (17+).
//! - [`status_updates`]: counts the standby status updates sent.
//! - [`monitor`]: the slot monitor; [`watchdog`]: the stream watchdog.
//! - [`shards`]: the bucket expression, row filters, the coverage proof.
//! - [`skew`]: the server's clock against ours, from every message.
//! - [`withheld`]: a walsender that sends nothing new while the WAL goes on.
//! - [`lock_wait`]: the side connection's lock waits, bounded and named.
//!
//! A logical replication connection matches `pg_hba.conf` by database name,
//! not by the keyword `replication` (PostgreSQL docs, "The pg_hba.conf
//! File").

pub mod catalog;
pub mod conn;
pub mod error;
pub mod failover;
mod ignored;
pub mod lock_wait;
pub mod membership;
pub mod monitor;
pub mod pairing;
pub mod progress;
pub mod shards;
pub mod skew;
pub mod slot_creation;
pub mod status_updates;
pub mod stream;
pub mod tls;
pub mod transport;
pub mod watchdog;
pub mod withheld;

pub use conn::{BadUrl, ConnParams, SslMode};
pub use error::SourceError;

use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// Connects a SQL connection for a command with the URL's `sslmode`; its
/// connection task runs in the background. With several hosts in the URL,
/// the first primary among them ([`connect_primary`]). Errors name the
/// server (`user@host:port/db`).
pub async fn connect_sql(
    conn: &ConnParams,
    application_name: &str,
) -> Result<tokio_postgres::Client, SourceError> {
    if conn.hosts.len() > 1 {
        return Ok(connect_primary(conn, application_name).await?.0);
    }
    Ok(connect_sql_watched(conn, application_name).await?.0)
}

/// A connection to the first candidate host (in the URL's order) that
/// answers and is not in recovery, the receiver that completes when it
/// closes, and the parameters of that host alone (for the replication
/// connection, which must go to the same server). A host that refuses
/// definitely (authentication, its certificate) ends the search with that
/// error, as in libpq ("if authentication fails, the remaining hosts are
/// not tried"); one that does not answer, or is in recovery (a standby
/// waiting for promotion), is logged at WARN and the next is tried: all
/// failing so is transient.
pub async fn connect_primary(
    conn: &ConnParams,
    application_name: &str,
) -> Result<(tokio_postgres::Client, oneshot::Receiver<()>, ConnParams), SourceError> {
    let mut failures = Vec::new();
    let last = conn.hosts.len() - 1;
    for i in 0..conn.hosts.len() {
        let one = conn.at(i);
        let (client, closed) = match connect_sql_watched(&one, application_name).await {
            Ok(c) => c,
            Err(e) if e.is_definite() => return Err(e),
            Err(e) => {
                if i < last {
                    tracing::warn!(error = %e, "host {} of {} failed; trying the next", i + 1, last + 1);
                }
                failures.push(e.to_string());
                continue;
            }
        };
        let in_recovery: bool = client
            .query_one("SELECT pg_is_in_recovery()", &[])
            .await
            .map_err(|e| SourceError::sql("asking whether the server is a primary", &e))?
            .get(0);
        if !in_recovery {
            return Ok((client, closed, one));
        }
        failures.push(format!(
            "{}: in recovery (a standby; the relay streams only from a primary)",
            one.display()
        ));
    }
    // One host: its own error says it all ("no primary among" would send
    // the operator looking for a failover that is not there).
    let msg = if conn.hosts.len() == 1 {
        failures.join("; ")
    } else {
        format!(
            "no primary among {}: {}",
            conn.display(),
            failures.join("; ")
        )
    };
    Err(SourceError::Transient(msg))
}

/// The notices (warnings, infos) a connection received, oldest first, at
/// most [`NOTICES_KEPT`].
pub type NoticeLog = Arc<Mutex<Vec<tokio_postgres::error::DbError>>>;

/// How many notices a [`NoticeLog`] keeps (the newest are dropped past it).
pub const NOTICES_KEPT: usize = 64;

/// [`connect_sql`] (to the same server [`connect_primary`] would choose),
/// plus the log of the notices the server sends it: some server behaviour
/// is said only in a WARNING (PostgreSQL 18 skipping a publication that
/// does not exist at a point of the WAL, for one).
pub async fn connect_sql_noticing(
    conn: &ConnParams,
    application_name: &str,
) -> Result<(tokio_postgres::Client, NoticeLog), SourceError> {
    let server = if conn.hosts.len() > 1 {
        connect_primary(conn, application_name).await?.2
    } else {
        conn.clone()
    };
    let notices = NoticeLog::default();
    let (client, _closed) = connect(&server, application_name, Some(Arc::clone(&notices))).await?;
    Ok((client, notices))
}

/// [`connect_sql`], plus a receiver that completes when the connection
/// closes (the server shut down or restarted, the network broke).
pub async fn connect_sql_watched(
    conn: &ConnParams,
    application_name: &str,
) -> Result<(tokio_postgres::Client, oneshot::Receiver<()>), SourceError> {
    connect(conn, application_name, None).await
}

async fn connect(
    conn: &ConnParams,
    application_name: &str,
    notices: Option<NoticeLog>,
) -> Result<(tokio_postgres::Client, oneshot::Receiver<()>), SourceError> {
    let attempt = |fallback: bool| {
        let notices = notices.clone();
        async move {
            // tokio-postgres bounds the TCP connect only; the login after it
            // can wait without end on the server ([`login_stalled`]).
            let bound = conn.connect_timeout * 2;
            match tokio::time::timeout(
                bound,
                connect_once(conn, application_name, notices, fallback),
            )
            .await
            {
                Ok(connected) => connected,
                Err(_) => Err(stalled_login_named(conn, bound).await),
            }
        }
    };
    match attempt(false).await {
        // sslmode=allow: plain first, TLS when the server refuses plain.
        Err(e) if conn.sslmode == SslMode::Allow && e.refuses_plain() => attempt(true).await,
        Err(e) if conn.sslmode == SslMode::Prefer && e.tls_failed() => {
            tracing::warn!(
                error = %e,
                "sslmode=prefer: the TLS handshake failed; going on in plain text, as libpq does"
            );
            attempt(true)
                .await
                .map_err(|plain| plain.after_tls_failure(&e))
        }
        other => other,
    }
}

/// A connection whose login (or first statement) did not complete within
/// `bound`: the server (or a pooler) accepted it and then kept it waiting.
/// Transient. Two
/// causes seen, named in the message: a pooler with no free server
/// connection queues the client, and a new backend that must rebuild its
/// catalog cache (after a catalog change in that database) waits, before
/// any setting of the session applies, for a session that holds a strong
/// lock on a system catalog.
pub fn login_stalled(conn: &ConnParams, bound: std::time::Duration) -> SourceError {
    SourceError::Transient(format!(
        "connecting to {} ({}): the server accepted the connection but the login (or the first \
         statement) did not complete within {bound:?}. A pooler with no free server connection queues a client this way; so \
         does PostgreSQL while a session holds a strong lock on a system catalog of that database \
         (a new session waits for it while it loads the catalog): look for a long open \
         transaction (pg_stat_activity, state 'idle in transaction') and for sessions in \
         'startup waiting'",
        conn.display(),
        conn.flag
    ))
}

/// [`login_stalled`], with the sessions that hold a strong lock on a
/// system catalog of the database named when there are any: read over a
/// connection to the `postgres` (or `template1`) database (a login to the locked database
/// waits behind the same lock), within `connect_timeout`; or that none is
/// held, or why it could not be read (a pooler that queues logins queues
/// that one too). Nothing is added when the database is one of those.
pub async fn stalled_login_named(conn: &ConnParams, bound: std::time::Duration) -> SourceError {
    let stalled = login_stalled(conn, bound);
    if MAINTENANCE_DBS.contains(&conn.dbname.as_str()) {
        return stalled;
    }
    let read = async {
        // The first refusal is the one to report: `postgres`, where
        // sql/roles.sql grants cdc_relay CONNECT (its hint says so).
        let mut refused = None;
        for db in MAINTENANCE_DBS {
            let mut other = conn.clone();
            other.dbname = db.to_owned();
            match connect_once(&other, "cdc-relay", None, false).await {
                Ok((client, _closed)) => {
                    return crate::locks::catalog_holders(&client, &conn.dbname)
                        .await
                        .map_err(|e| crate::db_message(&e));
                }
                Err(e) => {
                    refused.get_or_insert(e.to_string());
                }
            }
        }
        Err(refused.unwrap_or_default())
    };
    let SourceError::Transient(stalled) = stalled else {
        return stalled;
    };
    SourceError::Transient(
        match tokio::time::timeout(conn.connect_timeout, read).await {
            Ok(Ok(Some(holders))) => format!(
                "{stalled}. A strong lock on a system catalog of {} is held now: {holders}",
                conn.dbname
            ),
            Ok(Ok(None)) => format!(
                "{stalled}. No session holds a strong lock on a system catalog of {} now",
                conn.dbname
            ),
            Ok(Err(e)) => format!(
                "{stalled}. (Who holds a catalog lock could not be read from the postgres or template1 database: {e})"
            ),
            Err(_) => format!(
                "{stalled}. (Who holds a catalog lock could not be read from the postgres or template1 database: no answer within {:?} either)",
                conn.connect_timeout
            ),
        },
    )
}

/// The databases a login's lock holders are read from, in turn, when the
/// login to the relay's own database waits: libpq's maintenance database,
/// then the template every server has (CONNECT on `postgres` is often
/// revoked from PUBLIC).
const MAINTENANCE_DBS: [&str; 2] = ["postgres", "template1"];

async fn connect_once(
    conn: &ConnParams,
    application_name: &str,
    notices: Option<NoticeLog>,
    fallback: bool,
) -> Result<(tokio_postgres::Client, oneshot::Receiver<()>), SourceError> {
    let context = format!("connecting to {} ({})", conn.display(), conn.flag);
    let sql_error =
        |e: tokio_postgres::Error| SourceError::sql(&context, &e).noting_env(&conn.tls_from_env);
    let mut config = conn.sql_config(application_name);
    let tls = tls::client_config(conn, fallback)
        .map_err(|e| SourceError::Definite(format!("{context}: {e}")))?;
    let Some(tls) = tls else {
        let (client, connection) = config
            .connect(tokio_postgres::NoTls)
            .await
            .map_err(sql_error)?;
        return Ok((client, spawn_connection(connection, notices)));
    };
    config.ssl_mode(match conn.sslmode {
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        _ => tokio_postgres::config::SslMode::Require,
    });
    config.channel_binding(match conn.channel_binding {
        conn::ChannelBinding::Disable => tokio_postgres::config::ChannelBinding::Disable,
        conn::ChannelBinding::Prefer => tokio_postgres::config::ChannelBinding::Prefer,
    });
    let (client, connection) = config
        .connect(tokio_postgres_rustls::MakeRustlsConnect::new(tls))
        .await
        .map_err(sql_error)?;
    Ok((client, spawn_connection(connection, notices)))
}

/// Drives the connection in the background; its notices go to the log at
/// debug level and, when given, into `notices`.
fn spawn_connection<S, T>(
    mut connection: tokio_postgres::Connection<S, T>,
    notices: Option<NoticeLog>,
) -> oneshot::Receiver<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (closed_tx, closed) = oneshot::channel();
    tokio::spawn(async move {
        loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(tokio_postgres::AsyncMessage::Notice(notice))) => {
                    tracing::debug!(
                        severity = notice.severity(),
                        code = notice.code().code(),
                        "server notice: {}",
                        notice.message()
                    );
                    if let Some(log) = &notices {
                        let mut log = log.lock().expect("notice log lock is never poisoned");
                        if log.len() < NOTICES_KEPT {
                            log.push(notice);
                        }
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "side connection closed");
                    break;
                }
                None => break,
            }
        }
        let _ = closed_tx.send(());
    });
    closed
}
