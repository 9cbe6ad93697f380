//! The replication source: connection settings, the side SQL connection, and
//! opening a pgoutput stream on the slot.
//!
//! The transport is `pgwire-replication` (pinned exactly): it speaks the
//! streaming replication protocol, answers keepalives and sends standby
//! status updates on its own timer, even while the relay applies
//! backpressure. Decoding pgoutput and deciding what to confirm are ours.
//!
//! Facts this module relies on (PostgreSQL docs, "Streaming Replication
//! Protocol" → `START_REPLICATION SLOT … LOGICAL`):
//! - Starting at `0/0` resumes at the slot's `confirmed_flush_lsn`; a start
//!   position ahead of the slot would silently skip committed transactions.
//! - A logical replication connection matches `pg_hba.conf` by database name.
//! - Errors carry a SQLSTATE; its class decides whether retrying can help.

use std::str::FromStr;
use std::time::Duration;

use pgwire_replication::{PgWireError, ReplicationClient, ReplicationConfig, TlsConfig};

use crate::lsn::Lsn;

/// Where and as whom to connect, parsed from a libpq-style URL or
/// key/value string (`postgres://user:pw@host:port/db?sslmode=require`).
#[derive(Clone)]
pub struct ConnParams {
    /// Host name, IP, or a Unix socket directory (starts with `/`).
    pub host: String,
    /// TCP port (also names the Unix socket file).
    pub port: u16,
    /// Role name.
    pub user: String,
    /// Password ("" for none).
    pub password: String,
    /// Database name.
    pub dbname: String,
    /// `sslmode` as libpq spells it: disable, prefer, require, verify-ca, verify-full.
    pub sslmode: String,
    /// CA certificate file for verify-ca / verify-full.
    pub ssl_root_cert: Option<std::path::PathBuf>,
    /// Connect timeout.
    pub connect_timeout: Duration,
}

impl std::fmt::Debug for ConnParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the password.
        write!(f, "{}", self.display())
    }
}

/// The database URL could not be understood.
#[derive(Debug, thiserror::Error)]
#[error("invalid --database-url (CDC_RELAY_DATABASE_URL): {0}")]
pub struct BadUrl(String);

impl ConnParams {
    /// Parses a libpq connection string or URL. The password may also come
    /// from `password_override` (a file or environment variable).
    pub fn parse(url: &str, connect_timeout: Duration) -> Result<Self, BadUrl> {
        // tokio-postgres knows neither verify-ca/verify-full nor sslrootcert:
        // take them out before it parses the rest.
        let cfg = tokio_postgres::Config::from_str(&strip_tls_params(url))
            .map_err(|e| BadUrl(e.to_string()))?;
        let host = match cfg.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            Some(tokio_postgres::config::Host::Unix(p)) => p.to_string_lossy().into_owned(),
            None => return Err(BadUrl("no host given".into())),
        };
        let user = cfg
            .get_user()
            .ok_or_else(|| BadUrl("no user given".into()))?
            .to_owned();
        let password = cfg
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default();
        let dbname = cfg.get_dbname().unwrap_or(&user).to_owned();
        let sslmode = match cfg.get_ssl_mode() {
            tokio_postgres::config::SslMode::Disable => "disable",
            tokio_postgres::config::SslMode::Require => "require",
            _ => "prefer",
        }
        .to_owned();
        // tokio-postgres does not know verify-ca/verify-full or sslrootcert;
        // read them from the raw string.
        let raw_mode = query_param(url, "sslmode");
        Ok(ConnParams {
            host,
            port: cfg.get_ports().first().copied().unwrap_or(5432),
            user,
            password,
            dbname,
            sslmode: match raw_mode.as_deref() {
                None => sslmode,
                Some("allow" | "prefer") => "prefer".to_owned(),
                Some(m @ ("disable" | "require" | "verify-ca" | "verify-full")) => m.to_owned(),
                Some(other) => {
                    return Err(BadUrl(format!(
                        "sslmode={other}: expected disable, allow, prefer, require, verify-ca or verify-full"
                    )));
                }
            },
            ssl_root_cert: query_param(url, "sslrootcert").map(Into::into),
            connect_timeout: cfg
                .get_connect_timeout()
                .copied()
                .unwrap_or(connect_timeout),
        })
    }

    /// `user@host:port/db`, safe to log.
    pub fn display(&self) -> String {
        format!("{}@{}:{}/{}", self.user, self.host, self.port, self.dbname)
    }

    /// A tokio-postgres config for the side (normal SQL) connection.
    pub fn sql_config(&self, application_name: &str) -> tokio_postgres::Config {
        let mut c = tokio_postgres::Config::new();
        c.host(&self.host)
            .port(self.port)
            .user(&self.user)
            .dbname(&self.dbname)
            .application_name(application_name)
            .connect_timeout(self.connect_timeout);
        if !self.password.is_empty() {
            c.password(&self.password);
        }
        c
    }

    fn tls(&self) -> TlsConfig {
        match self.sslmode.as_str() {
            "require" => TlsConfig::require(),
            "verify-ca" => TlsConfig::verify_ca(self.ssl_root_cert.clone()),
            "verify-full" => TlsConfig::verify_full(self.ssl_root_cert.clone()),
            "disable" => TlsConfig::disabled(),
            // libpq's default: TLS when the server offers it.
            _ => TlsConfig {
                mode: pgwire_replication::SslMode::Prefer,
                ..TlsConfig::require()
            },
        }
    }
}

const TLS_PARAMS: [&str; 2] = ["sslmode", "sslrootcert"];

fn strip_tls_params(url: &str) -> String {
    let keep = |kv: &&str| !TLS_PARAMS.iter().any(|k| kv.starts_with(&format!("{k}=")));
    match url.split_once('?') {
        Some((base, q)) => {
            let rest: Vec<&str> = q.split('&').filter(keep).collect();
            if rest.is_empty() {
                base.to_owned()
            } else {
                format!("{base}?{}", rest.join("&"))
            }
        }
        None if url.contains("://") => url.to_owned(),
        None => url.split(' ').filter(keep).collect::<Vec<_>>().join(" "),
    }
}

fn query_param(url: &str, key: &str) -> Option<String> {
    // URL form: ...?a=b&c=d ; key/value form: a=b c=d
    let tail = url.split_once('?').map_or(url, |(_, q)| q);
    tail.split(['&', ' '])
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.to_owned())
}

/// Why a replication session could not start or ended.
///
/// *Definite* errors will not fix themselves (the operator must act);
/// everything else is *transient* and the relay reconnects with backoff.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The slot does not exist.
    #[error(
        "replication slot {slot:?} does not exist; create it with `cdc-relay setup` (or pass --create-slot, only on a fresh install: a new slot starts at the current WAL position and skips older events)"
    )]
    SlotMissing {
        /// Slot name.
        slot: String,
    },
    /// Another process streams from the slot (SQLSTATE 55006).
    #[error("replication slot {slot:?} is active for another process (pid {pid:?})")]
    SlotActive {
        /// Slot name.
        slot: String,
        /// The active walsender's pid, when known.
        pid: Option<i32>,
    },
    /// The slot lost required WAL (`wal_status = lost`).
    #[error(
        "replication slot {slot:?} is invalidated: the server removed WAL it still needed (max_slot_wal_keep_size exceeded). Events committed since its confirmed_flush_lsn may not have been delivered. Recover: `cdc-relay setup --recreate-slot`, then `cdc-relay backfill --since <time of the last delivered event>`"
    )]
    SlotInvalidated {
        /// Slot name.
        slot: String,
    },
    /// The server refused us for a reason retrying will not fix (auth,
    /// missing publication or database, privileges, protocol).
    #[error("{0}")]
    Definite(String),
    /// Connection lost, server restarting, resources exhausted: retry.
    #[error("{0}")]
    Transient(String),
    /// The stream is open but the server stopped serving it (watchdog).
    #[error("replication stream stalled: {0}")]
    Stalled(String),
}

impl SourceError {
    /// Whether retrying cannot help.
    pub fn is_definite(&self) -> bool {
        matches!(
            self,
            SourceError::SlotMissing { .. }
                | SourceError::SlotInvalidated { .. }
                | SourceError::Definite(_)
        )
    }

    /// Short metric label for the cause.
    pub fn cause(&self) -> &'static str {
        match self {
            SourceError::SlotMissing { .. } => "slot_missing",
            SourceError::SlotActive { .. } => "slot_active",
            SourceError::SlotInvalidated { .. } => "slot_invalidated",
            SourceError::Definite(_) => "definite",
            SourceError::Transient(_) => "transient",
            SourceError::Stalled(_) => "watchdog",
        }
    }
}

/// Extracts the SQLSTATE from an error text ending in `(SQLSTATE XXXXX)`.
pub fn sqlstate(text: &str) -> Option<&str> {
    let start = text.rfind("(SQLSTATE ")? + "(SQLSTATE ".len();
    text.get(start..start + 5)
}

/// Classifies a SQLSTATE: `true` when retrying can help.
///
/// Transient: class 08 (connection), 40 (rollback), 53 (resources), 57
/// (operator intervention: admin shutdown 57P01, crash shutdown 57P02,
/// cannot connect now 57P03), 55006 (object in use), 58 (system I/O).
pub fn sqlstate_is_transient(code: &str) -> bool {
    matches!(code.get(..2), Some("08" | "40" | "53" | "57" | "58")) || code == "55006"
}

/// Maps a transport error for `slot` to a [`SourceError`].
pub fn classify(err: &PgWireError, slot: &str) -> SourceError {
    let text = err.to_string();
    match err {
        PgWireError::Io(_) | PgWireError::Task(_) => SourceError::Transient(text),
        PgWireError::Auth(_) => SourceError::Definite(format!("authentication failed: {text}")),
        PgWireError::Tls(_) => SourceError::Definite(format!("TLS failed: {text}")),
        PgWireError::Server(msg) => classify_server(msg, slot),
        _ => SourceError::Transient(text),
    }
}

fn classify_server(msg: &str, slot: &str) -> SourceError {
    let code = sqlstate(msg).unwrap_or("");
    let lower = msg.to_ascii_lowercase();
    if code == "55006" {
        return SourceError::SlotActive {
            slot: slot.to_owned(),
            pid: msg
                .rsplit("PID ")
                .next()
                .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|d| d.parse().ok()),
        };
    }
    if code == "42704" && lower.contains("replication slot") {
        return SourceError::SlotMissing {
            slot: slot.to_owned(),
        };
    }
    if lower.contains("invalidated")
        || (code == "55000" && lower.contains("can no longer get changes"))
    {
        return SourceError::SlotInvalidated {
            slot: slot.to_owned(),
        };
    }
    if code.is_empty() || sqlstate_is_transient(code) {
        SourceError::Transient(msg.to_owned())
    } else {
        SourceError::Definite(msg.to_owned())
    }
}

/// Settings for one replication session.
#[derive(Clone, Debug)]
pub struct StreamSettings {
    /// Slot name.
    pub slot: String,
    /// Publication names.
    pub publications: Vec<String>,
    /// `application_name` shown in `pg_stat_replication`.
    pub application_name: String,
    /// Standby status update interval (and idle wake-up).
    pub status_interval: Duration,
    /// Transport buffer between the socket task and the relay, in messages.
    /// Small: the relay's own window bounds memory in bytes.
    pub buffer_events: usize,
}

/// Opens a pgoutput stream at the slot's own position (`0/0`) and waits
/// until the server accepted `START_REPLICATION` (the slot is then held).
pub async fn open_stream(
    conn: &ConnParams,
    s: &StreamSettings,
) -> Result<ReplicationClient, SourceError> {
    let mut cfg = ReplicationConfig::new(
        conn.host.clone(),
        conn.user.clone(),
        conn.password.clone(),
        conn.dbname.clone(),
        s.slot.clone(),
        s.publications.clone(),
    )
    .with_port(conn.port)
    .with_tls(conn.tls())
    .with_start_lsn(pgwire_replication::Lsn::from_u64(0))
    .with_status_interval(s.status_interval)
    .with_wakeup_interval(s.status_interval)
    .with_buffer_size(s.buffer_events)
    .with_application_name(s.application_name.clone())
    // Text output must not depend on the role's settings.
    .with_options(
        "-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=postgres -c extra_float_digits=3",
    );
    cfg.max_message_size = 1 << 30;
    let connect = async {
        let mut client = ReplicationClient::connect(cfg).await?;
        client.wait_started().await?;
        Ok::<_, PgWireError>(client)
    };
    match tokio::time::timeout(conn.connect_timeout * 2, connect).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(classify(&e, &s.slot)),
        Err(_) => Err(SourceError::Transient(format!(
            "starting replication on {} timed out after {:?}",
            conn.display(),
            conn.connect_timeout * 2
        ))),
    }
}

/// The slot as `pg_replication_slots` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotInfo {
    /// Output plugin, e.g. `pgoutput`.
    pub plugin: Option<String>,
    /// Database the slot decodes.
    pub database: Option<String>,
    /// Whether a walsender holds it.
    pub active: bool,
    /// The walsender's pid.
    pub active_pid: Option<i32>,
    /// Where a restart resumes.
    pub confirmed_flush_lsn: Option<Lsn>,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// Bytes of WAL that may still be written before the slot is lost.
    pub safe_wal_size: Option<i64>,
    /// `pg_current_wal_lsn() - confirmed_flush_lsn`, bytes.
    pub lag_bytes: Option<i64>,
    /// Seconds since the walsender holding the slot last read a status
    /// update from its client (`pg_stat_replication.reply_time`, or its
    /// start before the first one). `None` when no walsender holds it, or
    /// its row is not visible to this role.
    pub reply_age_secs: Option<f64>,
    /// The walsender's `pg_stat_activity.wait_event_type` (`Activity` or
    /// `Client` while it waits for WAL or its client; other values or none
    /// while it works).
    pub wait_event_type: Option<String>,
}

/// Reads the slot's row; `None` when it does not exist.
pub async fn slot_info(
    client: &tokio_postgres::Client,
    slot: &str,
) -> Result<Option<SlotInfo>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT s.plugin::text, s.database::text, s.active, s.active_pid, \
                    s.confirmed_flush_lsn::text, s.wal_status, s.safe_wal_size, \
                    (pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint, \
                    EXTRACT(EPOCH FROM (clock_timestamp() - coalesce(r.reply_time, r.backend_start)))::float8, \
                    a.wait_event_type::text \
             FROM pg_replication_slots s \
             LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid \
             LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid \
             WHERE s.slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| SlotInfo {
        plugin: r.get(0),
        database: r.get(1),
        active: r.get(2),
        active_pid: r.get(3),
        confirmed_flush_lsn: r.get::<_, Option<String>>(4).and_then(|s| s.parse().ok()),
        wal_status: r.get(5),
        safe_wal_size: r.get(6),
        lag_bytes: r.get(7),
        reply_age_secs: r.get(8),
        wait_event_type: r.get(9),
    }))
}

/// The standby status interval for a server whose `wal_sender_timeout` is
/// `timeout` (zero = disabled): min(1 s, timeout / 3), at least 100 ms.
pub fn status_interval_for(timeout: Duration) -> Duration {
    if timeout.is_zero() {
        return Duration::from_secs(1);
    }
    (timeout / 3).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// Parses a PostgreSQL duration setting as `SHOW` prints it (`60s`, `1min`,
/// `500ms`, `0`).
pub fn parse_pg_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let ms = match unit.trim() {
        "" | "ms" => n,
        "s" => n * 1_000,
        "min" => n * 60_000,
        "h" => n * 3_600_000,
        "d" => n * 86_400_000,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

/// The side SQL connection could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum SqlConnectError {
    /// TLS could not be set up from the settings.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsSetupError),
    /// Connecting or authenticating failed.
    #[error(transparent)]
    Sql(#[from] tokio_postgres::Error),
}

/// Connects the side SQL connection (for settings, slot figures, the
/// dead-letter table) with the URL's `sslmode`. The connection task runs in
/// the background.
pub async fn connect_sql(
    conn: &ConnParams,
    application_name: &str,
) -> Result<tokio_postgres::Client, SqlConnectError> {
    Ok(connect_sql_watched(conn, application_name).await?.0)
}

/// [`connect_sql`], plus a receiver that completes when the connection
/// closes (the server shut down or restarted, the network broke).
pub async fn connect_sql_watched(
    conn: &ConnParams,
    application_name: &str,
) -> Result<(tokio_postgres::Client, tokio::sync::oneshot::Receiver<()>), SqlConnectError> {
    let mut config = conn.sql_config(application_name);
    let tls = crate::tls::client_config(&conn.sslmode, conn.ssl_root_cert.as_deref())?;
    let Some(tls) = tls else {
        let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
        return Ok((client, spawn_connection(connection)));
    };
    config.ssl_mode(match conn.sslmode.as_str() {
        "prefer" => tokio_postgres::config::SslMode::Prefer,
        _ => tokio_postgres::config::SslMode::Require,
    });
    let (client, connection) = config
        .connect(tokio_postgres_rustls::MakeRustlsConnect::new(tls))
        .await?;
    Ok((client, spawn_connection(connection)))
}

fn spawn_connection<F>(connection: F) -> tokio::sync::oneshot::Receiver<()>
where
    F: std::future::Future<Output = Result<(), tokio_postgres::Error>> + Send + 'static,
{
    let (closed_tx, closed) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "side connection closed");
        }
        let _ = closed_tx.send(());
    });
    closed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_classified() {
        assert_eq!(
            sqlstate("terminating connection (SQLSTATE 57P01)"),
            Some("57P01")
        );
        assert_eq!(sqlstate("no code"), None);
        for c in [
            "57P01", "57P02", "57P03", "55006", "08006", "53300", "40001",
        ] {
            assert!(sqlstate_is_transient(c), "{c}");
        }
        for c in ["28P01", "42704", "3D000", "42501", "55000"] {
            assert!(!sqlstate_is_transient(c), "{c}");
        }
    }

    #[test]
    fn server_errors_map_to_slot_states() {
        let e = classify_server(
            r#"replication slot "s" does not exist (SQLSTATE 42704)"#,
            "s",
        );
        assert!(matches!(e, SourceError::SlotMissing { .. }));
        assert!(e.to_string().contains("cdc-relay setup"));
        let e = classify_server(
            r#"replication slot "s" is active for PID 4242 (SQLSTATE 55006)"#,
            "s",
        );
        assert!(
            matches!(
                e,
                SourceError::SlotActive {
                    pid: Some(4242),
                    ..
                }
            ),
            "{e:?}"
        );
        let e = classify_server(
            r#"can no longer get changes from replication slot "s" (SQLSTATE 55000)"#,
            "s",
        );
        assert!(matches!(e, SourceError::SlotInvalidated { .. }));
        assert!(
            classify_server("publication \"p\" does not exist (SQLSTATE 42704)", "s").is_definite()
        );
        assert!(
            !classify_server("the database system is starting up (SQLSTATE 57P03)", "s")
                .is_definite()
        );
    }

    #[test]
    fn status_interval_follows_wal_sender_timeout() {
        assert_eq!(status_interval_for(Duration::ZERO), Duration::from_secs(1));
        assert_eq!(
            status_interval_for(Duration::from_secs(60)),
            Duration::from_secs(1)
        );
        assert_eq!(
            status_interval_for(Duration::from_secs(2)),
            Duration::from_secs(2) / 3
        );
        assert_eq!(
            status_interval_for(Duration::from_millis(100)),
            Duration::from_millis(100)
        );
        assert_eq!(parse_pg_duration("60s"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("1min"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_pg_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_pg_duration("x"), None);
    }

    #[test]
    fn urls_parse_without_leaking_passwords() {
        let c = ConnParams::parse(
            "postgres://relay:s3cret@127.0.0.1:5433/orders?sslmode=verify-full&sslrootcert=/ca.pem",
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(
            (c.host.as_str(), c.port, c.dbname.as_str()),
            ("127.0.0.1", 5433, "orders")
        );
        assert_eq!(c.sslmode, "verify-full");
        assert_eq!(
            c.ssl_root_cert.as_deref(),
            Some(std::path::Path::new("/ca.pem"))
        );
        assert!(!format!("{c:?}").contains("s3cret"));
        assert!(ConnParams::parse("not a url at all=", Duration::from_secs(1)).is_err());
        let err = ConnParams::parse("postgres://u@h/d?sslmode=maybe", Duration::from_secs(1));
        assert!(err.unwrap_err().to_string().contains("sslmode=maybe"));
        let kv = ConnParams::parse(
            "host=h user=u dbname=d sslmode=require",
            Duration::from_secs(1),
        )
        .unwrap();
        assert_eq!((kv.sslmode.as_str(), kv.dbname.as_str()), ("require", "d"));
    }
}
