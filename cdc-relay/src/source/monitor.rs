//! The slot monitor, on the side connection: it reads the slot's row, the
//! outbox's publication membership and the number of dead letters waiting
//! every `--slot-stats-interval` (at most 30 s; one statement: the relay's
//! whole cost to an idle database), exports lag, `wal_status`,
//! `safe_wal_size` and membership, publishes the reading on a `watch`
//! channel (the [`super::watchdog`] reuses it), and holds the confirmed
//! position while the outbox is out of its publication (see
//! [`super::membership`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::catalog::{self, Membership, SlotInfo};
use super::error::SourceError;
use super::membership::{Change, MembershipWatch};
use super::stream::StreamError;
use super::withheld::{self, Verdict, WithheldWatch};
use super::{lock_wait, progress};
use crate::health::Health;
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::outbox::{OutboxError, TableName};

use super::catalog::SlotReading;

/// What the monitor reads, and how often.
#[derive(Clone, Debug)]
pub struct MonitorSettings {
    /// The slot.
    pub slot: String,
    /// The publications streamed.
    pub publications: Vec<String>,
    /// The outbox table.
    pub table: TableName,
    /// The columns the relay reads (a publication's column list must keep them).
    pub columns: Vec<String>,
    /// The row filter a carrying publication must have: `None` for the
    /// whole table, a shard's filter as the server printed it at session
    /// start when sharded (any other filter is a membership gap).
    pub row_filter: Option<String>,
    /// The slots of the other shards of this relay's split: not "other
    /// logical slots" (empty unsharded).
    pub siblings: Vec<String>,
    /// Time between readings (`--slot-stats-interval`, at most 30 s: the
    /// reading also verifies publication membership).
    pub interval: Duration,
    /// Who this relay is, for the progress record (where membership is
    /// recorded when it changes).
    pub holder: String,
    /// `--backfill-margin`: how much earlier than a gap an owed gap's
    /// backfill starts (`--on-gap tell`).
    pub backfill_margin: Duration,
    /// The membership read before the stream started (the table in):
    /// what the first reading is compared with when the progress record
    /// holds none, so a flap before that reading is a gap.
    pub at_start: Option<Membership>,
}

/// Where the monitor reports.
pub struct MonitorOutputs {
    /// Metrics (slot figures, membership).
    pub metrics: Metrics,
    /// Readiness (membership).
    pub health: Arc<Health>,
    /// The latest slot reading, for the watchdog.
    pub readings: watch::Sender<SlotReading>,
    /// The position the confirmed LSN must not pass (`None`: no limit),
    /// for the stream.
    pub ceiling: watch::Sender<Option<Lsn>>,
    /// `--on-gap backfill`: where to leave a gap's window, and the session
    /// to stop so the relay heals it before streaming on.
    pub heal: Option<GapHeal>,
}

/// A gap to heal: the window to fill in, the session to stop.
pub struct GapHeal {
    /// Where the monitor leaves the gap for the supervisor.
    pub window: std::sync::Arc<std::sync::Mutex<Option<GapToHeal>>>,
    /// The session's graceful stop.
    pub stop: tokio_util::sync::CancellationToken,
}

/// A publication gap found by the monitor, to heal before streaming on.
#[derive(Clone, Debug)]
pub struct GapToHeal {
    /// The last time the old membership was verified (server time text).
    pub since: String,
    /// The reading that found the table carried again.
    pub until: String,
    /// That reading's membership: recorded once the gap is healed.
    pub membership: catalog::Membership,
    /// Where the session started (for a first progress record).
    pub start: Lsn,
}

/// Reads the slot's figures and the outbox's publication membership every
/// interval (one statement) until the side connection fails (then returns
/// `None`; the session notices the closed connection itself). `start` is
/// where the session started streaming.
///
/// Returns [`SourceError::SidePooled`] (exit 2) when two readings were
/// answered by different server backends: a pool switched to transaction
/// mode under the running relay (the start's check, `source::pairing`,
/// saw one backend); and [`OutboxError::RenamedPartitioned`] (exit 5) when `--table`
/// names no relation any more while the outbox this session read exists
/// under another name (a partitioned outbox streamed through its root is
/// never described again under its new name, so the stream cannot see
/// it). The session ends with it.
pub async fn monitor_slot(
    side: Arc<tokio_postgres::Client>,
    settings: MonitorSettings,
    out: MonitorOutputs,
    start: Lsn,
) -> Option<StreamError> {
    let MonitorSettings {
        slot,
        publications,
        table,
        columns,
        row_filter,
        siblings,
        interval,
        holder,
        backfill_margin,
        at_start,
    } = settings;
    let recorded = match progress::read_membership(&side, &slot).await {
        Ok(r) => r,
        Err(e) => {
            let e = lock_wait::named(&side, e).await;
            tracing::warn!(error = %e, "cannot read the recorded publication membership; a change made while no relay watched goes unnoticed this session");
            None
        }
    };
    let count_dead_letters = match catalog::dead_letter_table_exists(&side).await {
        Ok(true) => true,
        Ok(false) => {
            tracing::warn!(
                "table cdc_relay_dead_letter does not exist (apply sql/orders.sql): a poison event cannot be dead-lettered, and cdc_relay_dead_letters_waiting stays unset"
            );
            false
        }
        Err(e) => {
            tracing::debug!(error = %e, "cannot look up cdc_relay_dead_letter");
            false
        }
    };
    let started_at = match side
        .query_one(
            "SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US+00')",
            &[],
        )
        .await
    {
        Ok(row) => row.get(0),
        Err(e) => {
            tracing::debug!(error = %e, "slot monitor not started; side connection lost");
            return None;
        }
    };
    let mut persisted = recorded.as_ref().map(|m| (m.carriers.clone(), m.table_oid));
    // A gap owed a backfill (`--on-gap tell`), found by this relay or an
    // earlier one: readiness fails until a backfill covers it.
    let mut owed = read_owed(&side, &slot, None).await;
    // Whether the owed gap is in the table (an older schema cannot hold
    // it: then only this process reports it).
    let mut owed_recorded = true;
    let mut membership = MembershipWatch::new(start, started_at, recorded.or(at_start));
    // Why the outbox is out, as last logged: a later reading that
    // explains it otherwise is logged again.
    let mut told: Option<String> = None;
    let mut withheld = Withheld::default();
    // When a lock wait of the monitor's reading was last logged.
    let mut lock_logged: Option<Instant> = None;
    let mut tick = tokio::time::interval(interval.min(MEMBERSHIP_CHECK_MAX));
    let mut first_backend: Option<i32> = None;
    // The outbox's OID as this session's readings last found it.
    let mut outbox_oid: Option<u32> = None;
    loop {
        tick.tick().await;
        let reading = catalog::monitor_reading(
            &side,
            &slot,
            &publications,
            &table,
            &columns,
            row_filter.as_deref(),
            count_dead_letters,
        );
        let catalog::MonitorReading {
            slot: info,
            membership: member,
            mut others,
            dead_letters,
            backend_pid,
        } = match tokio::time::timeout(Duration::from_secs(5), reading).await {
            Ok(Ok(r)) => r,
            Ok(Err(e @ SourceError::LockWait { .. })) => {
                // The connection is fine: a lock held elsewhere stops
                // this reading (and likely the walsender). Named at
                // once, then every WITHHELD_LOG_EVERY while it lasts.
                if lock_logged.is_none_or(|t: Instant| t.elapsed() >= WITHHELD_LOG_EVERY) {
                    let e = super::lock_wait::named(&side, e).await;
                    tracing::warn!(slot = %slot, error = %e, "the slot monitor cannot read the catalog: a lock held by another session blocks it");
                    lock_logged = Some(Instant::now());
                }
                continue;
            }
            // Its statement prepared on one backend and run on another.
            Ok(Err(e @ SourceError::SidePooled { .. })) => return Some(e.into()),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "slot figures unavailable; side connection lost");
                return None;
            }
            Err(_) => {
                // The side connection is shared: a statement queued ahead
                // of the reading (the progress record's write, say) may
                // have waited out its own lock_timeout first. Who holds
                // strong locks is read on it once it answers again.
                let holders = tokio::time::timeout(
                    Duration::from_secs(10),
                    crate::locks::holders(&side),
                )
                .await
                .unwrap_or_else(|_| {
                    "the side connection has not answered for 15 s: the server or the network is stalled".into()
                });
                tracing::warn!(slot = %slot, "the slot monitor's query got no answer within 5 s; {holders}");
                continue;
            }
        };
        // A session of its own is one backend for its whole life: a
        // pool that moves the side connection between backends breaks its
        // session state, and only more of that follows.
        match first_backend {
            Some(first) if first != backend_pid => {
                return Some(
                    SourceError::SidePooled {
                        evidence: format!(
                            "the side connection's statements ran on two server backends (pid {first}, then {backend_pid}) while the relay ran: the pool was switched to transaction or statement mode"
                        ),
                    }
                    .into(),
                );
            }
            Some(_) => {}
            None => first_backend = Some(backend_pid),
        }
        others.retain(|o| !siblings.contains(o));
        let n = i64::try_from(others.len()).unwrap_or(i64::MAX);
        if n > out.metrics.other_logical_slots.get() {
            tracing::warn!(
                slots = %others.join(", "),
                "logical slots other than {slot} exist in this database: each can read every row change here (`cdc-relay status` lists them)"
            );
        }
        out.metrics.other_logical_slots.set(n);
        if let Some(n) = dead_letters {
            out.metrics.dead_letters_waiting.set(n);
        }
        match info {
            Some(info) => {
                export_slot(&out.metrics, &info);
                if withheld.observe(&side, &slot, &info, &out).await {
                    tick.reset_after(super::withheld::RECHECK);
                }
                out.readings.send_replace(Some((Instant::now(), info)));
            }
            None => tracing::warn!(slot = %slot, "slot disappeared"),
        }
        match (member.table_oid, outbox_oid) {
            (Some(oid), _) => outbox_oid = Some(oid),
            // A plain table's rename reaches the stream (its next insert is
            // described under the new name, and stops there); a partitioned
            // one's does not.
            (None, Some(oid)) => {
                if let Ok(Some((now, true))) = catalog::relation_name(&side, oid).await {
                    tracing::error!(table = %table, oid, renamed_to = %now, "the partitioned outbox was renamed; stopping");
                    return Some(
                        OutboxError::RenamedPartitioned {
                            table: table.to_string(),
                            oid,
                            now,
                        }
                        .into(),
                    );
                }
            }
            (None, None) => {}
        }
        let change = membership.observe(&member);
        report_membership(&change, &member, &table, &publications, &out, &mut told);
        if let (Change::Back { since, until } | Change::Gap { since, until, .. }, None) =
            (&change, &out.heal)
        {
            // Told, and owed: recorded so that a restart does not forget
            // it, and readiness fails until a backfill covers it.
            let gap = progress::OwedGap {
                since: since.clone(),
                until: until.clone(),
            };
            match progress::record_owed(&side, &slot, &holder, start, &gap, backfill_margin).await {
                // As recorded (its start moved by the margin, merged with
                // one owed before); logged with its backfill command.
                Ok(()) => owed = read_owed(&side, &slot, owed).await,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot record the owed publication gap in cdc_relay_progress (apply sql/orders.sql): a restarted relay will not report it");
                    owed_recorded = false;
                    tracing::error!(slot = %slot, "{gap} (start it --backfill-margin earlier for transactions that ran long)");
                    owed = Some(owed.map_or(gap.clone(), |o| progress::OwedGap {
                        since: o.since.min(gap.since),
                        until: o.until.max(gap.until),
                    }));
                }
            }
        } else if owed.is_some() && owed_recorded {
            owed = read_owed(&side, &slot, owed).await;
        }
        out.health.set_gap_owed(owed.is_some());
        if let (Change::Back { since, until } | Change::Gap { since, until, .. }, Some(heal)) =
            (&change, &out.heal)
        {
            // The new membership is recorded only once the gap is healed;
            // until then the record keeps the old one, verified as late as
            // `since`, so a relay stopped or killed before the heal finds
            // the gap again at its next start. With none recorded yet (the
            // first reading found the table out), a membership of no
            // carriers: any later reading that finds it in is a gap.
            let (carriers, table_oid) = persisted.clone().unwrap_or((Vec::new(), member.table_oid));
            let old = catalog::Membership {
                carriers,
                table_oid,
                at: since.clone(),
                problem: None,
                wal_lsn: member.wal_lsn,
            };
            if let Err(e) = progress::record_membership(&side, &slot, &holder, start, &old).await {
                let e = lock_wait::named(&side, SourceError::sql("writing cdc_relay_progress", &e))
                    .await;
                tracing::warn!(error = %e, "cannot record the gap to heal in cdc_relay_progress: a relay stopped before it is healed will not find it again");
            }
            *heal.window.lock().expect("never poisoned") = Some(GapToHeal {
                since: since.clone(),
                until: until.clone(),
                membership: member.clone(),
                start,
            });
            heal.stop.cancel();
            return None;
        }
        let identity = (member.carriers.clone(), member.table_oid);
        if member.included() && persisted.as_ref() != Some(&identity) {
            // Only on a change: an idle relay writes nothing.
            match progress::record_membership(&side, &slot, &holder, start, &member).await {
                Ok(()) => persisted = Some(identity),
                Err(e) => match lock_wait::named(
                    &side,
                    SourceError::sql("writing cdc_relay_progress", &e),
                )
                .await
                {
                    e @ SourceError::LockWait { .. } => {
                        tracing::warn!(error = %e, "cannot record the publication membership in cdc_relay_progress; retried at the next reading")
                    }
                    e => {
                        tracing::warn!(error = %e, "cannot record the publication membership in cdc_relay_progress (apply sql/orders.sql); retried at the next reading")
                    }
                },
            }
        }
        out.health.set_publication_ok(membership.is_in());
        out.metrics
            .publication_includes_outbox
            .set(i64::from(membership.is_in()));
        out.ceiling.send_if_modified(|c| {
            let new = membership.ceiling();
            std::mem::replace(c, new) != new
        });
    }
}

/// The gap `slot` owes a backfill, as recorded; `before`, the one known
/// until now: a gap no longer recorded was covered by a backfill (said at
/// INFO), and one that cannot be read stays as it was.
async fn read_owed(
    side: &tokio_postgres::Client,
    slot: &str,
    before: Option<progress::OwedGap>,
) -> Option<progress::OwedGap> {
    match progress::read_owed(side, slot).await {
        Ok(None) => {
            if let Some(gap) = before {
                tracing::info!(slot = %slot, since = %gap.since, until = %gap.until, "a backfill re-sent the publication gap's rows: nothing is owed any more");
            }
            None
        }
        Ok(Some(gap)) => {
            if before.as_ref() != Some(&gap) {
                tracing::error!(slot = %slot, "{gap}");
            }
            Some(gap)
        }
        Err(e) => {
            tracing::debug!(error = %e, "cannot read the owed publication gap");
            before
        }
    }
}

/// The monitor's side of [`super::withheld`]: the watch, and when the
/// cause was last logged.
#[derive(Default)]
struct Withheld {
    watch: WithheldWatch,
    logged: Option<Instant>,
}

/// A withheld stream is logged again this often while it lasts.
const WITHHELD_LOG_EVERY: Duration = Duration::from_secs(300);

impl Withheld {
    /// Judges one reading, reports a change to readiness, the metric and
    /// the log; returns whether the monitor should read again soon.
    async fn observe(
        &mut self,
        side: &tokio_postgres::Client,
        slot: &str,
        info: &SlotInfo,
        out: &MonitorOutputs,
    ) -> bool {
        let verdict = self.watch.observe(Instant::now(), info);
        let is_withheld = matches!(verdict, Verdict::Withheld { .. });
        out.health.set_withheld(is_withheld);
        out.metrics.stream_withheld.set(i64::from(is_withheld));
        match (&verdict, info.active_pid) {
            (Verdict::Withheld { .. }, Some(pid))
                if self
                    .logged
                    .is_none_or(|t| t.elapsed() >= WITHHELD_LOG_EVERY) =>
            {
                self.logged = Some(Instant::now());
                match withheld::cause(side, slot, pid, &verdict).await {
                    Ok(why) => tracing::error!("{why}"),
                    Err(e) => {
                        tracing::error!(error = %e, "the server withholds the stream (its walsender sends nothing new); its cause could not be read")
                    }
                }
            }
            (Verdict::Flowing, _) if self.logged.take().is_some() => {
                tracing::info!(slot = %slot, "the server streams again: its walsender sends on");
            }
            _ => {}
        }
        verdict != Verdict::Flowing
    }
}

/// Membership is verified at least this often, whatever
/// `--slot-stats-interval` says.
pub const MEMBERSHIP_CHECK_MAX: Duration = Duration::from_secs(30);

fn export_slot(metrics: &Metrics, info: &SlotInfo) {
    metrics.slot_lag_bytes.set(info.lag_bytes.unwrap_or(0));
    metrics
        .retained_wal_bytes
        .set(info.retained_wal_bytes.unwrap_or(0));
    metrics
        .slot_safe_wal_size_bytes
        .set(info.safe_wal_size.unwrap_or(-1));
    for s in ["reserved", "extended", "unreserved", "lost"] {
        let v = i64::from(info.wal_status.as_deref() == Some(s));
        metrics.slot_wal_status.with_label_values(&[s]).set(v);
    }
}

fn report_membership(
    change: &Change,
    member: &catalog::Membership,
    table: &TableName,
    publications: &[String],
    out: &MonitorOutputs,
    told: &mut Option<String>,
) {
    let pubs = publications.join(", ");
    if member.included() {
        *told = None;
    }
    match change {
        Change::Steady => {}
        Change::StillOut => {
            // One reading's explanation may be stale: the publication
            // view reads the catalog as of its own scan, the statement's
            // other columns as of the statement's snapshot, so a change
            // committed in between (an ALTER TABLE … SET UNLOGGED, say)
            // shows as "in none of the publications" once. The reason
            // follows the latest reading.
            let why = catalog::membership_problem(member, publications, table);
            if told.as_ref() != Some(&why) {
                tracing::error!(
                    table = %table, publications = %pubs,
                    "the outbox {table}'s inserts are still not (all) streamed by publication {pubs}: {why}"
                );
                *told = Some(why);
            }
        }
        Change::Left { since } => {
            out.metrics.publication_gaps.inc();
            let why = catalog::membership_problem(member, publications, table);
            *told = Some(why.clone());
            let then = if out.heal.is_some() {
                format!(
                    "The relay re-sends what was inserted since membership was last verified ({since}) from the table by itself once it is back (--on-gap backfill)"
                )
            } else {
                format!(
                    "Then re-send what was inserted since membership was last verified: cdc-relay backfill --since '{since}'"
                )
            };
            tracing::error!(
                table = %table, publications = %pubs,
                "the outbox {table}'s inserts are not (all) streamed by publication {pubs}: {why}. \
                 Rows inserted meanwhile cannot be delivered from the slot; from now on the relay \
                 confirms nothing further until that is fixed. {then}"
            );
        }
        Change::Back { since, until } if out.heal.is_some() => tracing::warn!(
            table = %table, publications = %pubs,
            "the outbox {table} is in publication {pubs} again. Inserts between {since} and \
             {until} were not streamed: re-sending them from the table (--on-gap backfill)"
        ),
        Change::Back { since, until } => tracing::warn!(
            table = %table, publications = %pubs,
            "the outbox {table} is in publication {pubs} again; acknowledging resumes. Inserts \
             between {since} and {until} were not streamed: the next line gives the backfill \
             command that re-sends them (from --backfill-margin earlier); /readyz fails until a \
             backfill covering that window completes"
        ),
        Change::Gap {
            since,
            until,
            cause,
        } => {
            out.metrics.publication_gaps.inc();
            tracing::error!(
                table = %table, publications = %pubs,
                "the outbox {table}'s publication membership changed between {since} and {until} \
                 ({cause}): inserts in between may not have been streamed. {}",
                if out.heal.is_some() {
                    "The relay re-sends them from the table now (--on-gap backfill)".to_owned()
                } else {
                    "The next line gives the backfill command that re-sends them (from --backfill-margin earlier); /readyz fails until a backfill covering that window completes".to_owned()
                }
            );
        }
    }
}
