//! The replication transport of one session: opening the stream, and the
//! one place that hands the server a flush position.
//!
//! The transport is `pgwire-replication` (pinned exactly): it speaks the
//! streaming replication protocol, answers keepalives and sends standby
//! status updates on its own timer, even while the reader waits for room in
//! the window. Facts relied on (PostgreSQL docs, "Streaming Replication
//! Protocol" → `START_REPLICATION SLOT … LOGICAL`): starting at `0/0`
//! resumes at the slot's `confirmed_flush_lsn` (a start ahead of it would
//! silently skip committed transactions); the status update's flush position
//! becomes the slot's `confirmed_flush_lsn`.

use std::time::Duration;

use pgwire_replication::{PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent};
use tokio::time::Instant;

use super::conn::ConnParams;
use super::error::SourceError;
use super::tls;
use crate::lsn::Lsn;

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
    /// The client encoding to ask the walsender for instead of UTF8:
    /// `SQL_ASCII` on a server that is not UTF8, so it sends the stored
    /// bytes as they are rather than failing to convert them (the mapper
    /// then dead-letters what is not UTF-8).
    pub raw_encoding: bool,
}

/// The standby status interval for a server whose `wal_sender_timeout` is
/// `timeout` (zero = disabled): min(1 s, timeout / 3), at least 100 ms.
pub fn status_interval_for(timeout: Duration) -> Duration {
    if timeout.is_zero() {
        return Duration::from_secs(1);
    }
    (timeout / 3).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// Transport buffer between its socket task and the reader, in messages.
/// Small: the relay's own window bounds memory in bytes.
const TRANSPORT_BUFFER: usize = 64;

/// Opens a pgoutput stream at the slot's own position (`0/0`) and waits
/// until the server accepted `START_REPLICATION` (the slot is then held).
/// Bounded by twice the connect timeout (per TLS attempt).
pub async fn open(conn: &ConnParams, s: &StreamSettings) -> Result<ReplicationClient, SourceError> {
    with_tls(conn, |tls| async move {
        let mut cfg = ReplicationConfig::new(
            conn.host.clone(),
            conn.user.clone(),
            conn.password(),
            conn.dbname.clone(),
            s.slot.clone(),
            s.publications.clone(),
        )
        .with_port(conn.port)
        .with_tls(tls)
        .with_start_lsn(Lsn::ZERO.into())
        .with_status_interval(s.status_interval)
        .with_wakeup_interval(s.status_interval)
        .with_buffer_size(TRANSPORT_BUFFER)
        .with_application_name(s.application_name.clone())
        // Text output must not depend on the role's settings.
        .with_options(
            "-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=postgres -c extra_float_digits=3",
        );
        cfg.max_message_size = 1 << 30;
        let raw = s.raw_encoding;
        let connect = async {
            let mut client = if raw {
                let mut c = ReplicationClient::connect_gated(cfg).await?;
                c.simple_query("SET client_encoding = 'SQL_ASCII'").await?;
                c.start().await?;
                c
            } else {
                ReplicationClient::connect(cfg).await?
            };
            client.wait_started().await?;
            Ok::<_, PgWireError>(client)
        };
        let bound = conn.connect_timeout * 2;
        match tokio::time::timeout(bound, connect).await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(SourceError::transport(&e, &s.slot)
                .in_context(&format!("replication connection to {}", conn.display()))
                .noting_env(&conn.tls_from_env)),
            Err(_) => Err(SourceError::Transient(format!(
                "starting replication on {} timed out after {bound:?}",
                conn.display()
            ))),
        }
    })
    .await
}

/// Runs `attempt` with the replication TLS settings of `conn`: once, or,
/// as libpq does, a second time for `sslmode=allow` with TLS when the
/// server refused plain text, and for `sslmode=prefer` in plain text when
/// the TLS handshake failed.
async fn with_tls<T, F, Fut>(conn: &ConnParams, attempt: F) -> Result<T, SourceError>
where
    F: Fn(pgwire_replication::TlsConfig) -> Fut,
    Fut: std::future::Future<Output = Result<T, SourceError>>,
{
    let once = |fallback: bool| {
        let attempt = &attempt;
        async move {
            // A file that does not load is not a failed handshake: no
            // fallback to plain text for prefer.
            let tls = tls::replication_tls(conn, fallback).map_err(|e| {
                SourceError::Definite(format!("replication connection to {}: {e}", conn.display()))
            })?;
            attempt(tls).await
        }
    };
    match once(false).await {
        Err(e) if conn.sslmode == super::SslMode::Allow && e.refuses_plain() => once(true).await,
        Err(e) if conn.sslmode == super::SslMode::Prefer && e.tls_failed() => {
            tracing::warn!(
                error = %e,
                "sslmode=prefer: the TLS handshake failed; going on in plain text, as libpq does"
            );
            once(true)
                .await
                .map_err(|plain| plain.after_tls_failure(&e))
        }
        other => other,
    }
    .map_err(|e| e.naming_role(&conn.user))
}

/// Runs one replication command (e.g. `ALTER_REPLICATION_SLOT`) on a
/// replication connection to `conn`, without starting replication, and
/// returns its rows (text columns). Bounded by twice the connect timeout.
pub async fn replication_command(
    conn: &ConnParams,
    slot: &str,
    sql: &str,
) -> Result<Vec<pgwire_replication::QueryRow>, SourceError> {
    with_tls(conn, |tls| async move {
        let cfg = ReplicationConfig::new(
            conn.host.clone(),
            conn.user.clone(),
            conn.password(),
            conn.dbname.clone(),
            slot.to_owned(),
            Vec::<String>::new(),
        )
        .with_port(conn.port)
        .with_tls(tls)
        .with_application_name("cdc-relay-setup".to_owned());
        let run = async {
            let mut client = ReplicationClient::connect_gated(cfg).await?;
            let rows = client.simple_query(sql).await?;
            client.abort();
            Ok::<_, PgWireError>(rows)
        };
        let bound = conn.connect_timeout * 2;
        match tokio::time::timeout(bound, run).await {
            Ok(Ok(rows)) => Ok(rows),
            Ok(Err(e)) => Err(SourceError::transport(&e, slot)
                .in_context(&format!("replication connection to {}", conn.display()))
                .noting_env(&conn.tls_from_env)),
            Err(_) => Err(SourceError::Transient(format!(
                "{sql} on {} got no answer within {bound:?}",
                conn.display()
            ))),
        }
    })
    .await
}

/// Whether `conn` can carry a replication connection: `IDENTIFY_SYSTEM`
/// on one. Only a refusal that names a pooler or proxy in between
/// ([`SourceError::ThroughPooler`]) is an error; any other failure is left
/// to the command's own checks, which say it better.
pub async fn check_not_pooled(conn: &ConnParams) -> Result<(), SourceError> {
    match replication_command(conn, "", "IDENTIFY_SYSTEM").await {
        Err(e @ SourceError::ThroughPooler { .. }) => Err(e),
        _ => Ok(()),
    }
}

/// What `IDENTIFY_SYSTEM` on a replication connection says (PostgreSQL
/// docs, "Streaming Replication Protocol" → `IDENTIFY_SYSTEM`: columns
/// systemid, timeline, xlogpos, dbname).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The cluster's system identifier, decimal text.
    pub system_id: String,
    /// The server's current timeline ID (a promoted copy of the cluster
    /// has the same system identifier on a later timeline).
    pub timeline: Option<u32>,
    /// The session's database (`None` on a physical connection).
    pub dbname: Option<String>,
}

/// [`Identity`] of the server and database `conn` reaches.
///
/// # Errors
/// The connection's or the command's error, classified as for the stream.
pub async fn identify(conn: &ConnParams) -> Result<Identity, SourceError> {
    let rows = replication_command(conn, "", "IDENTIFY_SYSTEM").await?;
    let text = |i: usize| {
        rows.first()
            .and_then(|r| r.get(i))
            .and_then(Option::as_ref)
            .map(|b| String::from_utf8_lossy(b).into_owned())
    };
    let system_id = text(0).ok_or_else(|| {
        SourceError::Transient(format!(
            "IDENTIFY_SYSTEM on {} returned no system identifier",
            conn.display()
        ))
    })?;
    Ok(Identity {
        system_id,
        timeline: text(1).and_then(|t| t.parse().ok()),
        dbname: text(3),
    })
}

/// The transport of one session. [`Transport::confirm`] and
/// [`Transport::hold_at`] are the one place that hands the server a flush
/// position.
pub struct Transport {
    client: ReplicationClient,
    status_interval: Duration,
    flush: FlushPosition,
    /// Where the stream started: the slot's `confirmed_flush_lsn` then.
    start: Lsn,
}

/// The flush position: what the pipeline confirmed, under the slot
/// monitor's ceiling, never moving back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FlushPosition {
    /// The position the pipeline confirmed.
    wanted: Lsn,
    /// A limit the flush position must not pass (the outbox is out of its
    /// publication), if any.
    ceiling: Option<Lsn>,
    /// What was handed to the transport last.
    sent: Lsn,
}

impl FlushPosition {
    /// The position to send now, if it changed.
    fn next(&mut self) -> Option<Lsn> {
        let target = self
            .ceiling
            .map_or(self.wanted, |c| self.wanted.min(c))
            .max(self.sent);
        (target != self.sent).then(|| {
            self.sent = target;
            target
        })
    }
}

impl Transport {
    /// Wraps an opened stream that started at `start`.
    pub fn new(client: ReplicationClient, status_interval: Duration, start: Lsn) -> Self {
        Transport {
            client,
            status_interval,
            flush: FlushPosition {
                wanted: start,
                ceiling: None,
                sent: start,
            },
            start,
        }
    }

    /// The next message from the server.
    pub async fn recv(&mut self) -> Result<Option<ReplicationEvent>, PgWireError> {
        self.client.recv().await
    }

    /// The transport's counters (status updates sent).
    pub fn counters(&self) -> std::sync::Arc<pgwire_replication::client::ReplicationMetrics> {
        self.client.metrics()
    }

    /// The pipeline confirmed `lsn`: it becomes the flush (and apply)
    /// position of the next standby status update, unless a ceiling holds
    /// it back. The server stores it as the slot's `confirmed_flush_lsn`.
    pub fn confirm(&mut self, lsn: Lsn) {
        self.flush.wanted = self.flush.wanted.max(lsn);
        self.push();
    }

    /// Holds the flush position at `ceiling` (or releases it: `None`).
    pub fn hold_at(&mut self, ceiling: Option<Lsn>) {
        self.flush.ceiling = ceiling;
        self.push();
    }

    fn push(&mut self) {
        if let Some(lsn) = self.flush.next() {
            self.client.update_applied_lsn(lsn.into());
        }
    }

    /// The flush position last handed to the server.
    pub fn sent(&self) -> Lsn {
        self.flush.sent
    }

    /// Ends the stream without a final update.
    pub fn abort(&mut self) {
        self.client.abort();
    }

    /// Sends the final position (`lsn` under the ceiling) in a standby
    /// status update and waits (bounded) until the transport reports it
    /// sent, then ends the stream cleanly. The transport sends no final
    /// update of its own on stop.
    pub async fn flush_and_close(mut self, lsn: Lsn) {
        self.confirm(lsn);
        let lsn = self.flush.sent;
        // Nothing confirmed past where the slot stood at the start (an
        // idle session): the server has that position already.
        if lsn > self.start {
            let counters = self.client.metrics();
            let bound = Instant::now() + self.status_interval + Duration::from_millis(500);
            while Lsn::from(counters.last_applied_lsn()) < lsn && Instant::now() < bound {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let sent = Lsn::from(counters.last_applied_lsn());
            if sent < lsn {
                tracing::warn!(confirmed = %lsn, sent = %sent, "final status update not confirmed as sent");
            }
        }
        match tokio::time::timeout(Duration::from_secs(2), self.client.shutdown()).await {
            Ok(Ok(())) => tracing::info!(confirmed = %lsn, "stream closed cleanly"),
            Ok(Err(e)) => tracing::warn!(error = %e, "stream closed with an error"),
            Err(_) => {
                self.client.abort();
                tracing::warn!("stream did not close within 2 s; aborted");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flush_position_stays_under_the_ceiling_and_never_moves_back() {
        let mut f = FlushPosition {
            wanted: Lsn::new(100),
            ceiling: None,
            sent: Lsn::new(100),
        };
        f.wanted = Lsn::new(200);
        assert_eq!(f.next(), Some(Lsn::new(200)));
        assert_eq!(f.next(), None, "unchanged: nothing to send");
        f.ceiling = Some(Lsn::new(150)); // held below what was already sent
        f.wanted = Lsn::new(300);
        assert_eq!(f.next(), None, "never backwards, never past the ceiling");
        f.ceiling = Some(Lsn::new(250));
        assert_eq!(f.next(), Some(Lsn::new(250)));
        f.ceiling = None;
        assert_eq!(f.next(), Some(Lsn::new(300)), "released");
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
    }
}
