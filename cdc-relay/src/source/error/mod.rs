//! One error type for every database path (side connection, catalog
//! queries, the replication stream) and the one classifier that decides
//! whether retrying can help.
//!
//! *Definite* errors will not fix themselves: the slot is missing or lost,
//! authentication or privileges fail, the publication does not carry the
//! outbox. The relay stops and says what to do. Everything else is
//! *transient* and the relay reconnects with backoff. The SQLSTATE's class
//! decides (PostgreSQL docs, Appendix A "PostgreSQL Error Codes"); an error
//! without one (I/O, a closed socket) is transient: infrastructure errors
//! are retried until proven permanent.

mod hints;

pub(crate) use hints::tls_hint;
use hints::{client_cert_hint, privilege_hint, state_hint};
use pgwire_replication::PgWireError;

use crate::db_message;
use crate::lsn::Lsn;

/// Why a replication session could not start or ended.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The slot does not exist.
    #[error(
        "replication slot {slot:?} does not exist; create it with `cdc-relay setup` (or pass --create-slot, only on a fresh install: a new slot starts at the current WAL position and skips older events). If it existed before (a failover to a server without a copy of it, a dropped slot), events committed since its last confirmed position were not delivered: after `setup`, re-send them with `cdc-relay backfill --since <commit_time in cdc_relay_progress, minus a margin>` (or run with --on-slot-loss=recreate-and-backfill)"
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
    /// A slot of another split of the same `--slot` base streams (a reshard
    /// in progress, or a relay of the old split left running): this relay
    /// waits until it stops, so one aggregate is never sent by both.
    #[error(
        "slot {other:?} of another split of {slot:?} is streaming (pid {}): a relay of the old split still runs; this one starts once it stops (docs/operations.md#resharding)",
        crate::shown(.pid)
    )]
    OtherSplitActive {
        /// This relay's slot.
        slot: String,
        /// The other split's active slot.
        other: String,
        /// Its walsender's pid, when known.
        pid: Option<i32>,
    },
    /// The server invalidated the slot (`wal_status = lost`, or an
    /// `invalidation_reason`): it can never stream again.
    #[error(
        "replication slot {slot:?} is invalidated: {}. Events committed since its confirmed_flush_lsn may not have been delivered. Recover: `cdc-relay setup --recreate-slot`, then {}",
        invalidation_cause(.reason.as_deref()),
        backfill_hint(.since.as_deref())
    )]
    SlotInvalidated {
        /// Slot name.
        slot: String,
        /// The server's `invalidation_reason` (17+; `conflict` on 16), when
        /// known.
        reason: Option<String>,
        /// Commit time of the last transaction a relay delivered from this
        /// slot (its progress record), a `backfill --since` value; `None`
        /// when no record says.
        since: Option<String>,
    },
    /// The database lacks what `setup` creates or the flags name: the
    /// publication, the outbox table or one of its columns. The message
    /// names the flag or the command.
    #[error("{0}")]
    NeedsSetup(String),
    /// The dead-letter table holds parked events of endpoints the routes
    /// file (or `--sink-url`'s `default`) no longer has: nothing would
    /// resume them, and a renamed endpoint would get their aggregates'
    /// later events first. The names, in the order read.
    #[error(
        "the dead-letter table holds parked events of endpoint(s) {} that the routes file no longer has (renamed or removed): no relay would resume them, and under a new name the endpoint would get their aggregates' later events before them. Put the endpoint back under its old name (it resumes them first, then goes live), or deliver them yourself (`cdc-relay dead-letter replay --all --endpoint NAME --reason parked --sink-url URL`), or drop them on purpose (`cdc-relay dead-letter discard --all --endpoint NAME --reason parked --note WHY`), then start (docs/operations.md#a-parked-endpoint)",
        .0.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ")
    )]
    ParkedUnrouted(Vec<String>),
    /// The outbox's payload column is not `json`/`jsonb` at start (rows
    /// streamed while it had another type are checked one by one instead).
    #[error("{0}")]
    PayloadType(String),
    /// The slot's WAL predates the publication: decoding from the slot's
    /// position fails (or, on newer servers, skips) because the publication
    /// did not exist yet at that point in the catalog's history — the slot
    /// was created before it, or it was dropped and created again after the
    /// slot's confirmed position.
    #[error(
        "replication slot {slot:?} cannot decode its pending WAL with publication {publication:?}: the publication did not exist at that point of the catalog's history (the slot was created before it, or the publication was dropped and created again since the slot's confirmed position). The slot can never stream those changes; move it past them and re-send them from the table: either `cdc-relay setup --recreate-slot`, or keep the slot and advance it (SELECT pg_replication_slot_advance('{slot}', pg_current_wal_lsn()) as the relay's role); then `cdc-relay backfill --since <when the slot was created, or when the publication was dropped>`"
    )]
    SlotPredatesPublication {
        /// Slot name.
        slot: String,
        /// The publication the server did not find in the slot's history.
        publication: String,
    },
    /// The walsender cannot convert a change to UTF-8 (the relay's client
    /// encoding): the database is not UTF8 and a row holds bytes that are
    /// not valid there. The stream cannot pass that transaction.
    #[error("{0}")]
    Unconvertible(String),
    /// The slot is further on than this process left it with events still
    /// undelivered, and no other relay recorded progress since: it was
    /// dropped and recreated, or this is another server. Events in between
    /// were skipped upstream.
    #[error(
        "replication slot {slot:?} is at {now}, ahead of {left}, where this relay left it with events not yet delivered, and no other relay recorded progress since: the slot was dropped and recreated, or this server (a promoted standby?) holds another copy of it. Events committed in between were skipped upstream. Re-send them: `cdc-relay backfill --since '{since}'` (minus a margin for long transactions), then start the relay"
    )]
    SlotJumped {
        /// Slot name.
        slot: String,
        /// Its `confirmed_flush_lsn` now.
        now: Lsn,
        /// The position this process last confirmed.
        left: Lsn,
        /// Where a backfill should start (UTC text).
        since: String,
    },
    /// The replication connection reached a connection pooler or proxy
    /// that does not carry replication connections (PgBouncer before 1.23
    /// answers "unsupported startup parameter: replication"), or one that
    /// dropped the `replication` parameter and passed on a normal session
    /// (the server then refuses the replication commands as SQL). A
    /// configuration error: the URL must reach PostgreSQL itself.
    #[error(
        "the replication connection's URL (--replication-url (CDC_RELAY_REPLICATION_URL) when set, else --database-url (CDC_RELAY_DATABASE_URL)) reaches a connection pooler or proxy that does not carry replication connections (it answered: {answer}). The stream must go to PostgreSQL itself: point that URL at the server's own host and port (5432 by default), not at PgBouncer or another pooler; --database-url alone may stay on a session-mode pooler when --replication-url names the server itself (docs/operations.md#troubleshooting)"
    )]
    ThroughPooler {
        /// What the pooler (or the server behind it) answered.
        answer: String,
    },
    /// `--replication-url` and `--database-url` reach different servers or
    /// databases ([`super::pairing`] at start; at each stream start, the
    /// side connection's server not showing this relay's walsender holding
    /// the slot). A configuration error: the slot readings, the progress
    /// record and the dead letters would be written beside a stream they
    /// do not describe.
    #[error(
        "--replication-url (CDC_RELAY_REPLICATION_URL) and --database-url (CDC_RELAY_DATABASE_URL) reach different servers or databases: {detail}. Point both at the database the slot is in, on the server the slot is on (the side connection may go through a session-mode pooler in front of that server)"
    )]
    ServersDiffer {
        /// What differs, in words.
        detail: String,
    },
    /// The side connection goes through a pooler in transaction (or
    /// statement) mode ([`super::pairing`]): its statements do not keep one
    /// server session. A configuration error.
    #[error(
        "--database-url (CDC_RELAY_DATABASE_URL) reaches a connection pooler in transaction or statement mode: {evidence}. The relay's side connection keeps session state (lock_timeout, prepared statements), so it needs a session of its own: point --database-url at PostgreSQL itself or at a pool in session mode (PgBouncer pool_mode = session) (docs/operations.md#troubleshooting)"
    )]
    SidePooled {
        /// What showed it.
        evidence: String,
    },
    /// A statement waited past the side connection's `lock_timeout` for a
    /// lock another session holds (SQLSTATE 55P03; see
    /// [`super::lock_wait`]). Transient: the relay tries again.
    #[error(
        "{context}: the server ended a wait for a lock another session holds (lock_timeout){}",
        if holders.is_empty() { String::new() } else { format!(": {holders}") }
    )]
    LockWait {
        /// What the relay was doing.
        context: String,
        /// Who holds strong table locks, in words (empty until
        /// [`super::lock_wait::named`] read it).
        holders: String,
    },
    /// The server refused us for a reason retrying will not fix (auth,
    /// missing publication or database, privileges, protocol), or the
    /// database is not prepared as the relay needs. The message says what
    /// to change.
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
                | SourceError::SlotPredatesPublication { .. }
                | SourceError::SlotJumped { .. }
                | SourceError::NeedsSetup(_)
                | SourceError::ParkedUnrouted(_)
                | SourceError::PayloadType(_)
                | SourceError::Unconvertible(_)
                | SourceError::ThroughPooler { .. }
                | SourceError::ServersDiffer { .. }
                | SourceError::SidePooled { .. }
                | SourceError::Definite(_)
        )
    }

    /// `self` with the hint's role placeholder replaced by `user` (quoted
    /// as an identifier when it must be), for an error of a connection
    /// made as `user`.
    pub fn naming_role(self, user: &str) -> Self {
        match self {
            SourceError::Definite(m) if m.contains(hints::ROLE) => {
                SourceError::Definite(m.replace(hints::ROLE, &hints::ident(user)))
            }
            other => other,
        }
    }

    /// Whether the relay's connections reach the wrong thing: the stream's
    /// URL a pooler ([`Self::ThroughPooler`]), the side connection a
    /// transaction pool ([`Self::SidePooled`]), the two URLs different
    /// servers or databases ([`Self::ServersDiffer`]). A configuration
    /// error: every command exits 2 for it.
    pub fn is_misconnection(&self) -> bool {
        matches!(
            self,
            SourceError::ThroughPooler { .. }
                | SourceError::SidePooled { .. }
                | SourceError::ServersDiffer { .. }
        )
    }

    /// Short metric label for the cause.
    pub fn cause(&self) -> &'static str {
        match self {
            SourceError::SlotMissing { .. } => "slot_missing",
            SourceError::SlotActive { .. } => "slot_active",
            SourceError::OtherSplitActive { .. } => "other_split_active",
            SourceError::SlotInvalidated { .. } => "slot_invalidated",
            SourceError::SlotPredatesPublication { .. } => "slot_predates_publication",
            SourceError::SlotJumped { .. } => "slot_jumped",
            SourceError::NeedsSetup(_) => "needs_setup",
            SourceError::ParkedUnrouted(_) => "parked_unrouted",
            SourceError::PayloadType(_) => "payload_type",
            SourceError::Unconvertible(_) => "unconvertible",
            SourceError::ThroughPooler { .. } => "pooler",
            SourceError::ServersDiffer { .. } => "servers_differ",
            SourceError::SidePooled { .. } => "pooler",
            SourceError::LockWait { .. } => "lock_wait",
            SourceError::Definite(_) => "definite",
            SourceError::Transient(_) => "transient",
            SourceError::Stalled(_) => "watchdog",
        }
    }

    /// A failed SQL statement or connect on a normal connection, `context`
    /// saying what was being done (e.g. `reading the slot`).
    ///
    /// A connect that fails on the client's side before any server answer
    /// is definite when retrying cannot help: a missing password, a server
    /// that refuses TLS under `sslmode=require`, a certificate the trust
    /// store refuses, a client certificate the server refuses. A refused
    /// login (28000, 28P01) is definite too. Each says which setting to
    /// change.
    pub fn sql(context: &str, e: &tokio_postgres::Error) -> Self {
        let code = e.code().map(|c| c.code());
        if code == Some("55P03") {
            return SourceError::LockWait {
                context: context.to_owned(),
                holders: String::new(),
            };
        }
        let msg = format!("{context}: {}", db_message(e));
        // The relay never deallocates a statement it prepared: one missing
        // or prepared twice means its statements ran on other sessions'
        // backends (a transaction-mode pool).
        if matches!(code, Some("26000" | "42P05")) {
            return SourceError::SidePooled { evidence: msg };
        }
        if let Some(hint) = connect_hint(code, &msg) {
            return SourceError::Definite(format!("{msg}. {hint}"));
        }
        classify(code, msg, None)
    }

    /// Whether the server refused the connection for being unencrypted
    /// (its `pg_hba.conf` admits this role from here only with `hostssl`):
    /// `sslmode=allow` then tries again with TLS.
    pub fn refuses_plain(&self) -> bool {
        self.to_string().contains("no encryption")
    }

    /// Whether the TLS handshake failed (the server's certificate refused,
    /// say): `sslmode=prefer` then tries again in plain text, as libpq
    /// does.
    pub fn tls_failed(&self) -> bool {
        let text = self.to_string();
        text.contains("TLS failed: ") || text.contains("error performing TLS handshake")
    }

    /// A plain error (definite or transient) prefixed with `context`
    /// (`replication connection to user@host:port/db`), as the side
    /// connection's errors are; the typed ones name their subject already.
    pub fn in_context(self, context: &str) -> SourceError {
        self.map_message(|msg| format!("{context}: {msg}"))
    }

    /// This error, saying which of the TLS parameters it names came from
    /// libpq's environment (`from_env`: parameter and variable, as
    /// [`crate::source::ConnParams::tls_from_env`] holds them): a hint to
    /// set `sslrootcert` in the URL misleads an operator who set
    /// `PGSSLROOTCERT`.
    pub fn noting_env(self, from_env: &[(&'static str, &'static str)]) -> SourceError {
        self.map_message(|msg| {
            let named: Vec<String> = from_env
                .iter()
                .filter(|(param, _)| msg.contains(param))
                .map(|(param, var)| format!("{param} came from {var} in the environment"))
                .collect();
            if named.is_empty() {
                msg
            } else {
                format!("{msg} ({})", named.join("; "))
            }
        })
    }

    /// A plain error's message rewritten by `f`, its kind kept; the typed
    /// errors unchanged.
    fn map_message(self, f: impl FnOnce(String) -> String) -> SourceError {
        match self {
            SourceError::Definite(msg) => SourceError::Definite(f(msg)),
            SourceError::Transient(msg) => SourceError::Transient(f(msg)),
            other => other,
        }
    }

    /// This error of `prefer`'s plain-text attempt, saying the TLS attempt's
    /// `first` before it (as libpq reports both), so a refused certificate
    /// is not hidden behind `pg_hba.conf`'s "no encryption".
    pub fn after_tls_failure(self, first: &SourceError) -> SourceError {
        self.map_message(|msg| format!("{msg} (the TLS attempt before it: {first})"))
    }

    /// A replication transport error while streaming `slot`. TLS
    /// failures, the server's alert refusing the relay's client
    /// certificate and refused logins are definite.
    pub fn transport(e: &PgWireError, slot: &str) -> Self {
        let text = e.to_string();
        match e {
            PgWireError::Auth(_) => SourceError::Definite(format!("authentication failed: {text}")),
            PgWireError::Tls(_) => SourceError::Definite(match tls_hint(&text) {
                Some(hint) => format!("TLS failed: {text}. {hint}"),
                None => format!("TLS failed: {text}"),
            }),
            PgWireError::Server(msg) if sqlstate(msg) == Some("28000") => match tls_hint(msg) {
                Some(hint) => SourceError::Definite(format!("{msg}. {hint}")),
                None => classify(sqlstate(msg), msg.clone(), Some(slot)),
            },
            PgWireError::Server(msg) => classify(sqlstate(msg), msg.clone(), Some(slot)),
            // Under TLS 1.3 the client's handshake ends before the server
            // has checked the client's certificate: its refusal arrives on
            // the first read, as an I/O error.
            _ => match client_cert_hint(&text) {
                Some(hint) => SourceError::Definite(format!("TLS failed: {text}. {hint}")),
                None => SourceError::Transient(text),
            },
        }
    }
}

/// The classifier: SQLSTATE (when there is one) and message to an error.
/// `slot` is set on the replication path, where 42704 and 55000 name the
/// slot's state.
fn classify(code: Option<&str>, msg: String, slot: Option<&str>) -> SourceError {
    let lower = msg.to_ascii_lowercase();
    if slot.is_some() && refused_as_not_replication(code, &lower) {
        return SourceError::ThroughPooler { answer: msg };
    }
    if let Some(slot) = slot.map(str::to_owned) {
        match code {
            Some("55006") => {
                let pid = msg
                    .rsplit("PID ")
                    .next()
                    .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
                    .and_then(|d| d.parse().ok());
                return SourceError::SlotActive { slot, pid };
            }
            Some("42704") if lower.contains("replication slot") => {
                return SourceError::SlotMissing { slot };
            }
            // The relay checks at start that every publication exists, so
            // the walsender not finding one means it looks it up in the
            // slot's catalog history, from before it was created. (Dropped
            // meanwhile: the session's next start says so instead.)
            // 22021 character_not_in_repertoire, 22P05 untranslatable_character:
            // pgoutput converts text to the client encoding (UTF8).
            Some("22021" | "22P05") => return SourceError::Unconvertible(msg),
            Some("42704") if lower.contains("publication") => {
                let publication = msg.split('"').nth(1).unwrap_or_default().to_owned();
                return SourceError::SlotPredatesPublication { slot, publication };
            }
            // 15-17: "can no longer get changes from replication slot";
            // 18: "can no longer access replication slot" (DETAIL: "This
            // replication slot has been invalidated due to …").
            _ if lower.contains("invalidated")
                || (code == Some("55000")
                    && (lower.contains("can no longer get changes")
                        || lower.contains("can no longer access replication slot"))) =>
            {
                return SourceError::SlotInvalidated {
                    slot,
                    reason: None,
                    since: None,
                };
            }
            _ => {}
        }
    }
    if pooler_refused_login(code, &lower) {
        return SourceError::Definite(format!("{msg}. {AUTH_HINT}"));
    }
    match code {
        Some("42501") => SourceError::Definite(match privilege_hint(&msg, &lower) {
            Some(hint) => format!("{msg}. {hint}"),
            None => msg,
        }),
        Some("55000") => SourceError::Definite(match state_hint(&msg) {
            Some(hint) => format!("{msg}. {hint}"),
            None => msg,
        }),
        Some(c) if !sqlstate_is_transient(c) => SourceError::Definite(msg),
        _ => SourceError::Transient(msg),
    }
}

/// Whether an error on the replication path says the connection is not a
/// replication connection: a pooler refusing a startup parameter
/// (PgBouncer: "unsupported startup parameter: replication", or `options`,
/// SQLSTATE 08P01, which alone would read as a transient connection
/// error; PostgreSQL itself never says "startup parameter"), or the server refusing a replication command as SQL (42601 at
/// `IDENTIFY_SYSTEM`, `START_REPLICATION`, ...: something in between
/// dropped the parameter). `lower` is the message in lower case.
fn refused_as_not_replication(code: Option<&str>, lower: &str) -> bool {
    const REPLICATION_COMMANDS: [&str; 5] = [
        "identify_system",
        "start_replication",
        "create_replication_slot",
        "alter_replication_slot",
        "read_replication_slot",
    ];
    let parameter_refused = ["unsupported startup parameter", "unknown startup parameter"]
        .iter()
        .any(|p| lower.contains(p));
    let command_refused =
        code == Some("42601") && REPLICATION_COMMANDS.iter().any(|c| lower.contains(c));
    parameter_refused || command_refused
}

/// What to change when the server (or a pooler in front of it) refused the
/// login.
const AUTH_HINT: &str = "Check the role and password (CDC_RELAY_DATABASE_PASSWORD or \
     CDC_RELAY_DATABASE_PASSWORD_FILE, or the URL) and that the server's pg_hba.conf (or \
     the pooler's auth_file or auth_query) admits this role from this host";

/// Whether a pooler refused the login: PgBouncer ends a failed password or
/// SCRAM exchange with SQLSTATE 08P01 (protocol_violation, a class the
/// classifier otherwise retries), saying "password authentication failed"
/// or "SASL authentication failed"; retrying cannot fix it.
fn pooler_refused_login(code: Option<&str>, lower: &str) -> bool {
    code == Some("08P01") && lower.contains("authentication failed")
}

/// What to change for a connect error that retrying cannot fix; `None`
/// for every other error. `msg` is the error chain (tokio-postgres says
/// "invalid configuration: password missing", "error performing TLS
/// handshake: server does not support TLS", "...: invalid peer
/// certificate: ...").
fn connect_hint(code: Option<&str>, msg: &str) -> Option<&'static str> {
    const PASSWORD: &str = "Set the password with CDC_RELAY_DATABASE_PASSWORD \
        (--database-password) or CDC_RELAY_DATABASE_PASSWORD_FILE (--database-password-file), \
        or in the URL (the relay does not read PGPASSWORD, PGPASSFILE or ~/.pgpass)";
    if let Some(hint) = tls_hint(msg) {
        return Some(hint);
    }
    match code {
        Some("28P01" | "28000") => Some(AUTH_HINT),
        _ if pooler_refused_login(code, &msg.to_ascii_lowercase()) => Some(AUTH_HINT),
        Some(_) => None,
        None if msg.contains("invalid configuration: password missing") => Some(PASSWORD),
        None if msg.contains("server does not support TLS") => Some(
            "The server has ssl = off: connect with sslmode=disable (or prefer), or enable TLS \
             on the server",
        ),
        None if msg.contains("invalid configuration")
            || msg.contains("invalid connection string") =>
        {
            Some("Fix --database-url (CDC_RELAY_DATABASE_URL)")
        }
        None => None,
    }
}

/// The backfill step of a recovery: with the time the progress record
/// gives, or a placeholder and where to find it.
fn backfill_hint(since: Option<&str>) -> String {
    match since {
        Some(t) => format!(
            "`cdc-relay backfill --since '{t}'` (the commit time of the last transaction delivered from this slot, from cdc_relay_progress)"
        ),
        None => "`cdc-relay backfill --since <time of the last delivered event>` (docs/operations.md: An invalidated slot)".to_owned(),
    }
}

/// What invalidated a slot, for [`SourceError::SlotInvalidated`], from the
/// server's `invalidation_reason` (`None`: the server does not say, as
/// before 17, or the stream only said "invalidated").
pub fn invalidation_cause(reason: Option<&str>) -> String {
    match reason {
        None | Some("wal_removed") => "the server removed WAL it still needed \
            (max_slot_wal_keep_size exceeded; `cdc-relay status` shows the reason on 17+)"
            .into(),
        Some("idle_timeout") => "it was inactive longer than idle_replication_slot_timeout \
            (PostgreSQL 18); set it to 0, or well above the longest time the relay may be down, \
            so a stopped relay keeps its slot"
            .into(),
        Some("rows_removed" | "conflict") => "it conflicted with recovery on this standby \
            (rows it needed were removed on the primary): set hot_standby_feedback = on and \
            use a physical slot for the standby"
            .into(),
        Some("wal_level_insufficient") => "wal_level on the primary is below logical".into(),
        Some(other) => format!("invalidation_reason = {other}"),
    }
}

/// Extracts the SQLSTATE from an error text ending in `(SQLSTATE XXXXX)`
/// (how the replication transport reports server errors).
fn sqlstate(text: &str) -> Option<&str> {
    let start = text.rfind("(SQLSTATE ")? + "(SQLSTATE ".len();
    text.get(start..start + 5)
}

/// Whether retrying can help with this SQLSTATE.
///
/// Transient: class 08 (connection), 40 (rollback), 53 (resources), 57
/// (operator intervention: admin shutdown 57P01, crash shutdown 57P02,
/// cannot connect now 57P03), 55006 (object in use), 58 (system I/O).
pub fn sqlstate_is_transient(code: &str) -> bool {
    matches!(code.get(..2), Some("08" | "40" | "53" | "57" | "58")) || code == "55006"
}

#[cfg(test)]
mod tests;
