//! `cdc-relay status`: the slot and the publication as the database shows
//! them, and the problems that stop delivery, each with the exit code
//! `run` would stop with (the first one is `status`'s own exit code).

use serde::Serialize;
use tokio_postgres::Client;

use super::{connect, outln};
use crate::cli::{GlobalArgs, StatusArgs};
use crate::outbox::{OutboxColumns, TableName};
use crate::source::catalog::{self, OtherSlot, SlotInfo};
use crate::source::{self, SourceError, failover};

mod clock;
mod relays;
mod render;
pub(crate) use render::human_bytes;
mod shards;

pub use relays::RelayEndpoint;
use relays::ask_relays;

/// `cdc-relay status`: prints [`status`] as text or JSON; returns the exit
/// code (0 when no problem was found).
pub async fn command(g: &GlobalArgs, a: StatusArgs) -> anyhow::Result<u8> {
    // A lock held elsewhere on a catalog it reads ends a read after
    // lock_timeout (set by `connect`), named, instead of hanging.
    let client = connect(g).await?;
    match report(g, a, &client).await {
        Err(e) => Err(match e.downcast::<source::SourceError>() {
            Ok(e) => source::lock_wait::named(&client, e).await.into(),
            Err(e) => e,
        }),
        reported => reported,
    }
}

/// [`command`] on its connection.
async fn report(g: &GlobalArgs, a: StatusArgs, client: &Client) -> anyhow::Result<u8> {
    check_admin_urls(&a)?;
    super::check_connections(g, client).await?;
    if let Some(count) = g.shards {
        return shards::command(g, &a, client, count).await;
    }
    let conn = g.conn().map_err(super::ConfigError)?;
    let mut s = status(
        client,
        &conn,
        &g.slot,
        &g.publication,
        &g.table,
        &g.columns(),
        None,
    )
    .await?;
    s.failover = failover::slot_failover(client, &g.slot).await?;
    let primary = s
        .confirmed_flush_lsn
        .as_deref()
        .and_then(|l| l.parse().ok());
    for standby in g.standbys().map_err(super::ConfigError)? {
        let copy = match source::connect_sql(&standby, "cdc-relay").await {
            Ok(c) => failover::read_copy(&c, &standby.display(), &g.slot, primary).await,
            Err(e) => failover::StandbyCopy::unread(&standby.display(), Some(e.to_string())),
        };
        s.standbys.push(copy);
    }
    s.dead_letters_waiting = dead_letters_waiting(client).await?;
    s.warnings.extend(clock::warning(client).await?);
    if let Some(message) = withheld(client, &g.slot).await? {
        s.problems.push(Problem {
            code: STREAM_WITHHELD,
            message,
        });
        s.healthy = false;
    }
    relay_checks(&mut s, &a).await;
    if let Some(p) = slot_at_risk(&s) {
        s.problems.push(p);
        s.healthy = false;
    }
    let held = endpoints_held(&s.relays);
    if !held.is_empty() {
        s.problems.extend(held);
        s.healthy = false;
    }
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        outln!("{}", s.to_string().trim_end());
    }
    Ok(s.problems.first().map_or(0, |p| p.code))
}

/// Each `--admin-url` must be an http:// URL with a host: the admin
/// listener's base URL, to which `status` adds `/readyz` and `/metrics`
/// (one of those endpoints pasted in full, or a query, is refused).
fn check_admin_urls(a: &StatusArgs) -> anyhow::Result<()> {
    for url in &a.admin_url {
        let parsed = url.parse::<http::Uri>().ok();
        let ok = parsed
            .as_ref()
            .is_some_and(|u| u.scheme_str() == Some("http") && u.host().is_some());
        let base = parsed
            .as_ref()
            .is_some_and(|u| matches!(u.path(), "" | "/") && u.query().is_none());
        if !ok || !base {
            return Err(super::ConfigError(format!(
                "--admin-url {:?} is not {}, e.g. http://10.0.0.7:9187 (status adds /readyz and /metrics)",
                crate::redact::url(url),
                if ok {
                    "the admin listener's base URL (no path, no query)"
                } else {
                    "an http:// URL with a host"
                }
            ))
            .into());
        }
    }
    Ok(())
}

/// The exit-9 problem of a slot whose `wal_status` is unreserved.
/// `status`'s exit code when the server withholds the stream (the relay
/// keeps running: no exit code of `run` says it).
pub const STREAM_WITHHELD: u8 = 1;

/// Whether the server withholds the stream from the slot's walsender, and
/// why: two readings [`source::withheld::RECHECK`] apart when the first
/// finds it behind (one otherwise), judged as the relay's monitor judges.
async fn withheld(client: &Client, slot: &str) -> anyhow::Result<Option<String>> {
    use source::withheld::{self, Verdict};
    let Some(first) = catalog::slot_info(client, slot).await? else {
        return Ok(None);
    };
    let (Some(sent), Some(flushed), Some(pid)) =
        (first.sent_lsn, first.flushed_lsn, first.active_pid)
    else {
        return Ok(None);
    };
    if sent >= flushed {
        return Ok(None);
    }
    tokio::time::sleep(withheld::RECHECK).await;
    let Some(second) = catalog::slot_info(client, slot).await? else {
        return Ok(None);
    };
    let verdict = withheld::judge_pair(&first, &second);
    if !matches!(verdict, Verdict::Withheld { .. }) {
        return Ok(None);
    }
    Ok(Some(withheld::cause(client, slot, pid, &verdict).await?))
}

fn slot_at_risk(s: &Status) -> Option<Problem> {
    (s.wal_status.as_deref() == Some("unreserved")).then(|| Problem {
        code: SLOT_AT_RISK,
        message: format!(
            "slot {} has wal_status unreserved: it needs more WAL than max_slot_wal_keep_size keeps, and the next checkpoint may remove it and invalidate the slot (recovery then needs a backfill). Get the relay delivering now, or raise max_slot_wal_keep_size and reload",
            s.slot
        ),
    })
}

/// Rows in `cdc_relay_dead_letter`, as the slot monitor counts them
/// ([`catalog::dead_letters_waiting`]); `None` when the table does not exist.
async fn dead_letters_waiting(client: &Client) -> Result<Option<i64>, SourceError> {
    let read = |e| SourceError::sql("counting the dead letters (cdc_relay_dead_letter)", &e);
    let exists: bool = client
        .query_one(
            "SELECT to_regclass('cdc_relay_dead_letter') IS NOT NULL",
            &[],
        )
        .await
        .map_err(read)?
        .get(0);
    if !exists {
        return Ok(None);
    }
    Ok(Some(
        client
            .query_one(&format!("SELECT {}", catalog::dead_letters_waiting()), &[])
            .await
            .map_err(read)?
            .get(0),
    ))
}

/// Exit code of `status` when the database is fine but delivery does not
/// run: no relay holds the slot, or a relay's `/readyz` fails (breaker
/// open, events stuck, not streaming) or does not answer.
pub const NOT_DELIVERING: u8 = 8;

/// Exit code of `status` when delivery works but the slot is about to be
/// invalidated (`wal_status` unreserved). A problem found before it (the
/// database's, then "nothing delivers") gives its own code instead.
pub const SLOT_AT_RISK: u8 = 9;

/// Exit code of `status` when the relay delivers but one endpoint of its
/// routes file does not get its events: it is parked (they go to the
/// dead-letter table) or its circuit is open. The problems above come
/// first.
pub const ENDPOINT_HELD: u8 = 10;

/// The exit-10 problems: each parked endpoint, and each other endpoint
/// of a routes file whose circuit is open, of the relays that answered.
fn endpoints_held(relays: &[RelayEndpoint]) -> Vec<Problem> {
    let mut out = Vec::new();
    for r in relays {
        for name in &r.parked {
            out.push(Problem {
                code: ENDPOINT_HELD,
                message: format!(
                    "relay at {}: endpoint {name} is parked: its events are written to cdc_relay_dead_letter (reason parked) instead of being sent, until it answers again (resume = \"auto\") or an operator replays them (docs/operations.md#a-parked-endpoint); the log's `endpoint parked` line says why",
                    r.url
                ),
            });
        }
        let routed = r.endpoint_circuits.keys().any(|name| name != "default");
        for (name, state) in &r.endpoint_circuits {
            if routed && *state == 1.0 && !r.parked.contains(name) {
                out.push(Problem {
                    code: ENDPOINT_HELD,
                    message: format!(
                        "relay at {}: endpoint {name}'s circuit is open: its events wait (the other endpoints deliver); the log's `circuit opened` line and cdc_relay_endpoint_retries_total{{endpoint=\"{name}\"}} say why",
                        r.url
                    ),
                });
            }
        }
    }
    out
}

/// Asks each admin endpoint and adds what stops delivery to `s.problems`
/// (after the database's own, which are more fundamental).
async fn relay_checks(s: &mut Status, a: &StatusArgs) {
    if let Some(p) = unheld(s) {
        s.problems.push(p);
    }
    let active = s.active;
    ask_relays(a, active, &mut s.relays, &mut s.problems).await;
    s.healthy = s.problems.is_empty();
}

/// The connecting role's name when it may not open a replication
/// connection (neither `REPLICATION` nor superuser, `pg_roles`).
async fn lacks_replication(client: &Client) -> Result<Option<String>, SourceError> {
    let row = client
        .query_one(
            "SELECT current_user::text, rolreplication OR rolsuper FROM pg_roles \
             WHERE rolname = current_user",
            &[],
        )
        .await
        .map_err(|e| SourceError::sql("reading the role's attributes", &e))?;
    Ok((!row.get::<_, bool>(1)).then(|| row.get(0)))
}

/// The connecting role and the table privileges `sql/roles.sql` grants the
/// relay's role that it lacks, as `INSERT on cdc_relay_dead_letter`;
/// `None` when it lacks none. Tables that do not exist are left out (their
/// own checks name them).
async fn missing_grants(
    client: &Client,
    table: &TableName,
) -> Result<Option<(String, Vec<String>)>, SourceError> {
    let rows = client
        .query(
            "SELECT v.p || ' on ' || coalesce(v.shown, v.t), current_user::text FROM (VALUES \
               ($1, $2, 'SELECT'), \
               ('cdc_relay_dead_letter', NULL, 'SELECT'), ('cdc_relay_dead_letter', NULL, 'INSERT'), \
               ('cdc_relay_dead_letter', NULL, 'UPDATE'), ('cdc_relay_dead_letter', NULL, 'DELETE'), \
               ('cdc_relay_dead_letter_audit', NULL, 'INSERT'), \
               ('cdc_relay_progress', NULL, 'SELECT'), ('cdc_relay_progress', NULL, 'INSERT'), \
               ('cdc_relay_progress', NULL, 'UPDATE')) v(t, shown, p) \
             WHERE to_regclass(v.t) IS NOT NULL AND NOT has_table_privilege(to_regclass(v.t), v.p)",
            &[&catalog::quote_table(table), &table.to_string()],
        )
        .await
        .map_err(|e| SourceError::sql("reading the role's table privileges", &e))?;
    Ok(rows
        .first()
        .map(|r| (r.get(1), rows.iter().map(|r| r.get(0)).collect())))
}

/// The exit-8 problem of a usable slot no relay streams from.
fn unheld(s: &Status) -> Option<Problem> {
    let slot_usable = s.exists && s.problems.is_empty();
    (slot_usable && !s.active).then(|| Problem {
        code: NOT_DELIVERING,
        message: format!(
            "no relay streams from slot {}: start `cdc-relay run` (or see why it stopped: `systemctl status cdc-relay`, its log)",
            s.slot
        ),
    })
}

/// Something that stops delivery.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct Problem {
    /// The exit code `run` stops with for it (3 needs setup, 4 slot lost,
    /// 6 slot older than the publication).
    pub code: u8,
    /// What is wrong and what to do.
    pub message: String,
}

/// What `status` reports.
#[derive(Debug, Serialize)]
pub struct Status {
    /// Slot name.
    pub slot: String,
    /// Whether it exists.
    pub exists: bool,
    /// Whether a walsender holds it.
    pub active: bool,
    /// That walsender's pid.
    pub active_pid: Option<i32>,
    /// Who streams from that walsender: its `application_name` and client
    /// address (`cdc-relay from 10.0.0.7`).
    pub held_by: Option<String>,
    /// The relay that last recorded delivery progress for this slot
    /// (`application_name@host:pid`, from `cdc_relay_progress`).
    pub last_progress_by: Option<String>,
    /// Where a restart resumes (PostgreSQL text form).
    pub confirmed_flush_lsn: Option<String>,
    /// `pg_current_wal_lsn() - confirmed_flush_lsn`, bytes.
    pub lag_bytes: Option<i64>,
    /// reserved / extended / unreserved / lost.
    pub wal_status: Option<String>,
    /// Bytes of WAL that may still be written before the slot is lost.
    pub safe_wal_size: Option<i64>,
    /// Publication name(s), comma-separated.
    pub publication: String,
    /// Tables they publish (schema.table).
    pub publication_tables: Vec<String>,
    /// The slot's `failover` flag (PostgreSQL 17+).
    pub failover: Option<bool>,
    /// Each `--standby-url`'s copy of the slot.
    pub standbys: Vec<failover::StandbyCopy>,
    /// Logical slots of this database other than the relay's: each can read
    /// every row change here. Reported, not a problem (delivery goes on).
    pub other_logical_slots: Vec<OtherSlot>,
    /// What each relay admin endpoint asked said.
    pub relays: Vec<RelayEndpoint>,
    /// Rows in the dead-letter table (`None`: no such table).
    pub dead_letters_waiting: Option<i64>,
    /// Whether nothing stops delivery.
    pub healthy: bool,
    /// What stops delivery, most fundamental first.
    pub problems: Vec<Problem>,
    /// What does not stop delivery but fails elsewhere, one sentence each
    /// with its fix (the warnings `setup` and `run` log: a publication
    /// publishing UPDATE/DELETE on an outbox without a replica identity;
    /// this machine's clock 30 s or more from the server's).
    pub warnings: Vec<String>,
}

/// Reads the slot and the publications and diagnoses them for `table`;
/// `row_filter` is the filter the publication must carry it with (`None`:
/// none; a shard's when sharded).
pub async fn status(
    client: &Client,
    conn: &source::ConnParams,
    slot: &str,
    publications: &[String],
    table: &TableName,
    columns: &OutboxColumns,
    row_filter: Option<&str>,
) -> Result<Status, SourceError> {
    let info: Option<SlotInfo> = catalog::slot_info(client, slot).await?;
    let other_logical_slots = catalog::other_logical_slots(client, slot).await?;
    let tables: Vec<String> = client
        .query(
            "SELECT DISTINCT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = ANY($1) ORDER BY 1",
            &[&publications],
        )
        .await
        .map_err(|e| SourceError::sql("reading the publication's tables", &e))?
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    // For a lost slot: where the backfill starts, from the progress record.
    let lost_since = match &info {
        Some(i) if i.invalidated() => source::progress::backfill_since(client, slot).await,
        _ => None,
    };
    // Another backend still creating the slot: name it and what it waits for.
    let creating = match info
        .as_ref()
        .and_then(source::slot_creation::being_created_by)
    {
        Some(pid) => Some(source::slot_creation::being_created_message(
            slot,
            pid,
            &source::slot_creation::blockers(client, pid).await?,
        )),
        None => None,
    };
    let mut problems = Vec::new();
    let mut problem = |code, message: String| problems.push(Problem { code, message });
    match &info {
        Some(_) if creating.is_some() => problem(3, creating.clone().unwrap_or_default()),
        None => problem(
            3,
            format!(
                "slot {slot} does not exist: run `cdc-relay setup` (events committed before it exists are not delivered; re-send them with `cdc-relay backfill`)"
            ),
        ),
        Some(i) if !i.local => problem(3, catalog::slot_elsewhere(slot, i).to_string()),
        Some(i) if i.invalidated() => problem(
            4,
            SourceError::SlotInvalidated {
                slot: slot.to_owned(),
                reason: i.invalidation_reason.clone(),
                since: lost_since.clone(),
            }
            .to_string(),
        ),
        Some(_) => {}
    }
    if let Some(role) = lacks_replication(client).await? {
        // What `run` exits 1 for at its replication connection.
        problem(
            1,
            format!(
                "role {role} lacks the REPLICATION attribute, so a relay connecting as it cannot \
                 stream: ALTER ROLE {role} REPLICATION (sql/roles.sql does it)"
            ),
        );
    }
    if let Some((role, missing)) = missing_grants(client, table).await? {
        problem(
            1,
            format!(
                "role {role} lacks privileges the relay uses: {}. Apply sql/roles.sql again (a \
                 recreated table loses its grants), or run status as the relay's role",
                missing.join(", ")
            ),
        );
    }
    let mut warnings = Vec::new();
    let checked =
        catalog::check_stream_config(client, table, columns, publications, row_filter).await;
    if let Ok(outbox) = &checked {
        // What `setup` and the start of `run` warn about: not a stop to
        // delivery, but the application's (and the prune's) UPDATE or
        // DELETE on the outbox fail.
        warnings = catalog::publication_warnings(client, table, outbox, publications).await?;
    }
    if let Err(e) = checked {
        // The code `run` would exit with for the same finding (a payload
        // column of the wrong type is 5 there, a missing table 3).
        let text = e.to_string();
        problem(super::run::exit_code(&e.into()), text);
    } else if info.as_ref().is_some_and(|i| !i.active && !i.invalidated())
        && catalog::slot_predates_publication(conn, slot, publications).await? == Some(true)
    {
        let publication = publications.join(", ");
        problem(
            6,
            SourceError::SlotPredatesPublication {
                slot: slot.to_owned(),
                publication,
            }
            .to_string(),
        );
    }
    let held_by = match info.as_ref().and_then(|i| i.active_pid) {
        Some(pid) => client
            .query_opt(
                "SELECT coalesce(nullif(application_name, ''), '?') || ' from ' || \
                        coalesce(host(client_addr), 'a local socket') \
                 FROM pg_stat_replication WHERE pid = $1",
                &[&pid],
            )
            .await
            .map_err(|e| SourceError::sql("reading pg_stat_replication", &e))?
            .map(|r| r.get::<_, String>(0)),
        None => None,
    };
    if let Some(gap) = source::progress::read_owed(client, slot).await? {
        problem(1, gap.to_string());
    }
    let last_progress_by = source::progress::read(client, slot)
        .await?
        .and_then(|p| p.holder);
    Ok(Status {
        slot: slot.to_owned(),
        exists: info.is_some(),
        active: info.as_ref().is_some_and(|i| i.active),
        active_pid: info.as_ref().and_then(|i| i.active_pid),
        held_by,
        last_progress_by,
        confirmed_flush_lsn: info
            .as_ref()
            .and_then(|i| i.confirmed_flush_lsn)
            .map(|l| l.to_string()),
        lag_bytes: info.as_ref().and_then(|i| i.lag_bytes),
        wal_status: info.as_ref().and_then(|i| i.wal_status.clone()),
        safe_wal_size: info.as_ref().and_then(|i| i.safe_wal_size),
        publication: publications.join(","),
        publication_tables: tables,
        failover: None,
        standbys: Vec::new(),
        other_logical_slots,
        relays: Vec::new(),
        dead_letters_waiting: None,
        healthy: problems.is_empty(),
        problems,
        warnings,
    })
}

use render::write_relay;

#[cfg(test)]
mod tests;
