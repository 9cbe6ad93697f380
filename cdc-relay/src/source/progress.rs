//! The progress record: one row per slot in `cdc_relay_progress` (see
//! `sql/orders.sql`), written by the relay that streams the slot.
//!
//! It holds the end LSN the relay confirmed and the commit time and last
//! event id of the last fully delivered transaction. Physical replication
//! carries it to standbys, so after a failover it says where a backfill
//! must start, and it witnesses which relay progressed (a slot ahead of
//! this process's own position is legitimate when another relay moved it).
//!
//! Written at most every [`PROGRESS_INTERVAL`] while the relay delivers
//! events, never while idle: the idle statement budget is unchanged.

use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::Client;

use super::catalog::Membership;
use super::error::SourceError;
use crate::dispatch::Confirmed;
use crate::lsn::Lsn;

/// Time between two writes of the progress record while events flow.
pub const PROGRESS_INTERVAL: Duration = Duration::from_secs(5);

/// `YYYY-MM-DD HH:MM:SS.ffffff+00` of a `timestamptz` SQL expression.
macro_rules! utc_text {
    ($e:literal) => {
        concat!(
            "to_char((",
            $e,
            ") AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US+00')"
        )
    };
}

/// Reads `slot`'s progress row through `select` (a select list over `j`,
/// the row as JSON: a column the schema predates reads as NULL, so one
/// statement serves every schema). `None` when there is no row, or no
/// table (a schema before 0.2.0).
async fn progress_row(
    client: &Client,
    select: &str,
    slot: &str,
) -> Result<Option<tokio_postgres::Row>, SourceError> {
    let sql = format!(
        "{select} FROM (SELECT to_jsonb(p) AS j FROM cdc_relay_progress p WHERE slot_name = $1) r"
    );
    match client.query_opt(&sql, &[&slot]).await {
        Ok(row) => Ok(row),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => Ok(None),
        Err(e) => Err(SourceError::sql("reading cdc_relay_progress", &e)),
    }
}

/// A slot's progress row.
#[derive(Clone, Debug, PartialEq)]
pub struct ProgressRecord {
    /// The end LSN the relay confirmed when it wrote the row.
    pub confirmed_lsn: Lsn,
    /// Commit time of the last fully delivered transaction with events,
    /// `YYYY-MM-DD HH:MM:SS.ffffff+00` (a `backfill --since` value).
    pub commit_time: Option<String>,
    /// Id of that transaction's last event.
    pub last_event_id: Option<String>,
    /// Who wrote it (`application_name@host:pid`).
    pub holder: Option<String>,
    /// When it was written, seconds since the Unix epoch (server clock).
    pub updated_unix: f64,
}

/// The `backfill --since` the progress record gives for `slot` (the commit
/// time of the last delivered transaction), for recovery messages; `None`
/// when there is no record, no such time, or it cannot be read.
pub async fn backfill_since(client: &Client, slot: &str) -> Option<String> {
    read(client, slot).await.ok().flatten()?.commit_time
}

/// Reads `slot`'s progress row; `None` when there is none (or the table
/// does not exist yet: the schema predates it).
pub async fn read(client: &Client, slot: &str) -> Result<Option<ProgressRecord>, SourceError> {
    let exists: bool = client
        .query_one("SELECT to_regclass('cdc_relay_progress') IS NOT NULL", &[])
        .await
        .map_err(|e| SourceError::sql("looking up cdc_relay_progress", &e))?
        .get(0);
    if !exists {
        return Ok(None);
    }
    let row = client
        .query_opt(
            "SELECT confirmed_lsn::text, \
                    to_char(commit_time AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US+00'), \
                    last_event_id, holder, EXTRACT(EPOCH FROM updated_at)::float8 \
             FROM cdc_relay_progress WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| SourceError::sql("reading cdc_relay_progress", &e))?;
    Ok(row.map(|r| ProgressRecord {
        confirmed_lsn: r.get::<_, String>(0).parse().unwrap_or_default(),
        commit_time: r.get(1),
        last_event_id: r.get(2),
        holder: r.get(3),
        updated_unix: r.get(4),
    }))
}

/// Writes `slot`'s progress row.
async fn write(
    client: &Client,
    slot: &str,
    holder: &str,
    c: &Confirmed<Lsn>,
) -> Result<(), tokio_postgres::Error> {
    let done = c.last_done.as_ref();
    let commit_unix = done
        .map(|d| (d.commit_time_micros as f64 + crate::clock::PG_EPOCH_UNIX_MICROS as f64) / 1e6);
    client
        .execute(
            "INSERT INTO cdc_relay_progress AS p \
               (slot_name, confirmed_lsn, commit_time, last_event_id, holder, updated_at) \
             VALUES ($1, $2::text::pg_lsn, to_timestamp($3), $4, $5, now()) \
             ON CONFLICT (slot_name) DO UPDATE SET confirmed_lsn = EXCLUDED.confirmed_lsn, \
               commit_time = coalesce(EXCLUDED.commit_time, p.commit_time), \
               last_event_id = coalesce(EXCLUDED.last_event_id, p.last_event_id), \
               holder = EXCLUDED.holder, updated_at = now()",
            &[
                &slot,
                &c.position.to_string(),
                &commit_unix,
                &done.map(|d| d.last_event_id.as_str()),
                &holder,
            ],
        )
        .await?;
    Ok(())
}

/// Writes the progress record every [`PROGRESS_INTERVAL`] when a new
/// transaction with events was done since the last write; returns when the
/// dispatcher goes away. A failed write is logged and retried at the next
/// tick (the record is advice for recovery, never a gate on delivery).
pub async fn keep_recording(
    side: std::sync::Arc<Client>,
    slot: String,
    holder: String,
    mut confirmed: watch::Receiver<Confirmed<Lsn>>,
) {
    let mut written: Option<Confirmed<Lsn>> = None;
    let mut tick = tokio::time::interval(PROGRESS_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if confirmed.has_changed().is_err() {
            return;
        }
        let now = confirmed.borrow_and_update().clone();
        let progressed = now.last_done.is_some()
            && written
                .as_ref()
                .is_none_or(|w| w.last_done != now.last_done);
        if !progressed {
            continue;
        }
        match write(&side, &slot, &holder, &now).await {
            Ok(()) => written = Some(now),
            Err(e) => {
                let e = super::lock_wait::named(
                    &side,
                    SourceError::sql("writing cdc_relay_progress", &e),
                )
                .await;
                tracing::warn!(error = %e, "cannot write the progress record (cdc_relay_progress); delivery goes on");
            }
        }
    }
}

/// The outbox's publication membership as last recorded for `slot`, with
/// `at` set to the latest time it is known to have held: the later of when
/// it was recorded and half a minute before the last progress write (a
/// delivering relay verifies membership at least every 30 s, and records a
/// change when it sees one). `wal_lsn` is zero. `None` when nothing is
/// recorded (or the schema predates the columns).
pub async fn read_membership(
    client: &Client,
    slot: &str,
) -> Result<Option<Membership>, SourceError> {
    let row = progress_row(
        client,
        concat!(
            "SELECT (j -> 'membership_carriers')::text, (j ->> 'membership_table_oid')::oid, ",
            utc_text!(
                "greatest((j ->> 'membership_at')::timestamptz, \
                          (j ->> 'updated_at')::timestamptz - interval '30 s')"
            ),
        ),
        slot,
    )
    .await?;
    let Some(row) = row else { return Ok(None) };
    let carriers: Option<Vec<String>> = row
        .get::<_, Option<String>>(0)
        .and_then(|j| serde_json::from_str(&j).ok());
    let (Some(carriers), Some(at)) = (carriers, row.get::<_, Option<String>>(2)) else {
        return Ok(None);
    };
    Ok(Some(Membership {
        carriers,
        table_oid: row.get(1),
        problem: None,
        wal_lsn: Lsn::ZERO,
        at,
    }))
}

/// Records `m` (a reading that found the outbox carried) as `slot`'s
/// membership; creates the row (at `start`, by `holder`) when there is
/// none. Touches nothing else of an existing row.
pub async fn record_membership(
    client: &Client,
    slot: &str,
    holder: &str,
    start: Lsn,
    m: &Membership,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO cdc_relay_progress AS p \
               (slot_name, confirmed_lsn, holder, membership_carriers, membership_table_oid, membership_at) \
             VALUES ($1, $2::text::pg_lsn, $3, $4, $5, $6::text::timestamptz) \
             ON CONFLICT (slot_name) DO UPDATE SET \
               membership_carriers = EXCLUDED.membership_carriers, \
               membership_table_oid = EXCLUDED.membership_table_oid, \
               membership_at = EXCLUDED.membership_at",
            &[&slot, &start.to_string(), &holder, &m.carriers, &m.table_oid, &m.at],
        )
        .await?;
    Ok(())
}

/// A publication gap owed by a backfill (`--on-gap tell`): rows of the
/// outbox inserted between `since` and `until` were never streamed. Both
/// times are server times, `YYYY-MM-DD HH:MM:SS+00` (backfill bounds).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwedGap {
    /// The last time the outbox was seen in its publication before the gap.
    pub since: String,
    /// The first time it was seen in again.
    pub until: String,
}

impl OwedGap {
    /// The command that re-sends the gap's rows.
    pub fn backfill_command(&self) -> String {
        format!(
            "cdc-relay backfill --since '{}' --until '{}'",
            self.since, self.until
        )
    }
}

impl std::fmt::Display for OwedGap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "outbox rows inserted between {} and {} (a publication gap; the start is --backfill-margin early) were not streamed, or may not have been, and no backfill has re-sent them: run `{}` with the relay's database and sink settings (its flags, or the same CDC_RELAY_* environment); this clears once a backfill covering that window completes",
            self.since,
            self.until,
            self.backfill_command()
        )
    }
}

/// The gap `slot` owes ([`OwedGap`]); `None` when none is recorded, or
/// the schema predates the columns (nothing can be owed then).
pub async fn read_owed(client: &Client, slot: &str) -> Result<Option<OwedGap>, SourceError> {
    let row = progress_row(
        client,
        concat!(
            "SELECT ",
            utc_text!("(j ->> 'gap_owed_since')::timestamptz"),
            ", ",
            utc_text!("(j ->> 'gap_owed_until')::timestamptz"),
        ),
        slot,
    )
    .await?;
    Ok(row.and_then(|r| {
        Some(OwedGap {
            since: r.get::<_, Option<String>>(0)?,
            until: r.get::<_, Option<String>>(1)?,
        })
    }))
}

/// Records that `slot` owes `gap`, its start moved `margin` earlier (the
/// time column is the inserting transaction's start, which may precede
/// the gap by as long as that transaction ran: `--backfill-margin`),
/// widening a gap already owed to cover both; creates the row (at
/// `start`, by `holder`) when there is none.
pub async fn record_owed(
    client: &Client,
    slot: &str,
    holder: &str,
    start: Lsn,
    gap: &OwedGap,
    margin: Duration,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO cdc_relay_progress AS p \
               (slot_name, confirmed_lsn, holder, gap_owed_since, gap_owed_until) \
             VALUES ($1, $2::text::pg_lsn, $3, \
                     $4::text::timestamptz - make_interval(secs => $6), $5::text::timestamptz) \
             ON CONFLICT (slot_name) DO UPDATE SET \
               gap_owed_since = least(p.gap_owed_since, EXCLUDED.gap_owed_since), \
               gap_owed_until = greatest(p.gap_owed_until, EXCLUDED.gap_owed_until)",
            &[
                &slot,
                &start.to_string(),
                &holder,
                &gap.since,
                &gap.until,
                &margin.as_secs_f64(),
            ],
        )
        .await?;
    Ok(())
}

/// Clears every owed gap a complete backfill of `table` from `since` to
/// `until` (`None`: its start) covers, and returns each (its slot and
/// window). A gap is covered when it is a gap of that table (the slot's
/// recorded membership names it) inside the window, and it had ended
/// when the backfill started (`started`, the server's time before it
/// read a row: rows of a gap found later may not be in what it read).
/// Nothing when the schema predates the columns.
pub async fn clear_owed_covered(
    client: &Client,
    table: &crate::outbox::TableName,
    (since, until): (&str, Option<&str>),
    started: &str,
) -> Result<Vec<(String, OwedGap)>, tokio_postgres::Error> {
    let rows = client
        .query(
            concat!(
                "WITH covered AS (SELECT slot_name, ",
                utc_text!("gap_owed_since"),
                " AS since, ",
                utc_text!("gap_owed_until"),
                " AS until FROM cdc_relay_progress \
                   WHERE gap_owed_since >= $1::text::timestamptz \
                     AND ($2::text IS NULL OR gap_owed_until <= $2::text::timestamptz) \
                     AND gap_owed_until <= $3::text::timestamptz \
                     AND (membership_table_oid IS NULL \
                          OR membership_table_oid = to_regclass(format('%I.%I', $4::text, $5::text))) \
                   FOR UPDATE) \
                 UPDATE cdc_relay_progress p SET gap_owed_since = NULL, gap_owed_until = NULL \
                 FROM covered WHERE p.slot_name = covered.slot_name \
                 RETURNING covered.slot_name, covered.since, covered.until"
            ),
            &[&since, &until, &started, &table.schema, &table.name],
        )
        .await;
    let rows = match rows {
        Ok(rows) => rows,
        Err(e)
            if matches!(
                e.code(),
                Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE)
                    | Some(&tokio_postgres::error::SqlState::UNDEFINED_COLUMN)
            ) =>
        {
            return Ok(Vec::new());
        }
        Err(e) => return Err(e),
    };
    Ok(rows
        .iter()
        .map(|r| {
            (
                r.get(0),
                OwedGap {
                    since: r.get(1),
                    until: r.get(2),
                },
            )
        })
        .collect())
}

/// `application_name@host:pid`: who holds the slot, for the progress record
/// and logs.
pub fn holder(application_name: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "unknown-host".into());
    format!("{application_name}@{host}:{}", std::process::id())
}
