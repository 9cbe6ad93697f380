//! A server that withholds the stream: the relay's walsender is connected
//! and answers keepalives, but sends nothing new while the server's WAL
//! goes on (issue 30, item 6). The case that was met: on PostgreSQL 17, a
//! failover slot's walsender waits until every physical slot named in
//! `synchronized_standby_slots` has confirmed the WAL; with that standby
//! down, committed outbox rows are never decoded, yet the stream looks
//! healthy (keepalives flow, nothing is pending in the relay).
//!
//! The slot monitor's reading carries the walsender's `sent_lsn` and wait
//! event and the server's flushed WAL end. [`WithheldWatch`] says the
//! stream is withheld once the walsender has stayed behind the flushed WAL
//! without sending on for [`WITHHELD_AFTER`], except while it waits to
//! write to the relay (the relay's own backpressure, not the server's).
//! [`cause`] then names the PostgreSQL state in words, with the command
//! that ends it.

use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::Client;

use super::catalog::SlotInfo;
use super::error::SourceError;
use crate::lsn::Lsn;

/// How long the walsender may stay behind the server's flushed WAL without
/// sending on before the stream counts as withheld.
pub const WITHHELD_AFTER: Duration = Duration::from_secs(5);

/// How soon the monitor reads again when the walsender is behind (instead
/// of its interval), so a withheld stream is named within seconds.
pub const RECHECK: Duration = Duration::from_secs(2);

/// Wait events in which a walsender waits for its client (the relay), not
/// for the server: a full socket while the relay's window is full.
const CLIENT_WAITS: [&str; 2] = ["WalSenderWriteData", "ClientWrite"];

/// What [`WithheldWatch::observe`] concluded from one reading.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Sent up to the flushed WAL, or sending on.
    Flowing,
    /// Behind and not (yet) for long: read again soon.
    Behind,
    /// Behind without sending on for at least [`WITHHELD_AFTER`].
    Withheld {
        /// How far the walsender sent.
        sent: Lsn,
        /// The server's flushed WAL end.
        flushed: Lsn,
        /// Its wait event, if any.
        wait_event: Option<String>,
    },
}

/// Follows the walsender's `sent_lsn` across readings.
#[derive(Debug, Default)]
pub struct WithheldWatch {
    /// Where the walsender stood still, and since when.
    still: Option<(Lsn, Instant)>,
}

impl WithheldWatch {
    /// Judges one reading of the slot, taken at `now`.
    pub fn observe(&mut self, now: Instant, info: &SlotInfo) -> Verdict {
        let (Some(sent), Some(flushed)) = (info.sent_lsn, info.flushed_lsn) else {
            self.still = None;
            return Verdict::Flowing;
        };
        let client_wait = info
            .wait_event
            .as_deref()
            .is_some_and(|w| CLIENT_WAITS.contains(&w));
        if sent >= flushed || client_wait {
            self.still = None;
            return Verdict::Flowing;
        }
        match self.still {
            Some((at, since)) if at == sent => {
                if now.duration_since(since) >= WITHHELD_AFTER {
                    Verdict::Withheld {
                        sent,
                        flushed,
                        wait_event: info.wait_event.clone(),
                    }
                } else {
                    Verdict::Behind
                }
            }
            _ => {
                self.still = Some((sent, now));
                Verdict::Behind
            }
        }
    }
}

/// A one-shot judgement (for `status`) from two readings taken
/// [`RECHECK`] apart: withheld when the walsender stayed behind without
/// sending on between them, as [`WithheldWatch`] would judge readings
/// [`WITHHELD_AFTER`] apart.
pub fn judge_pair(first: &SlotInfo, second: &SlotInfo) -> Verdict {
    let t0 = Instant::now();
    let mut watch = WithheldWatch::default();
    watch.observe(t0, first);
    watch.observe(t0 + WITHHELD_AFTER, second)
}

/// Why the server withholds the stream from `slot`'s walsender `pid`, in
/// words and with the command that ends it. One statement; PostgreSQL 17's
/// `synchronized_standby_slots` is read where it exists.
pub async fn cause(
    client: &Client,
    slot: &str,
    pid: i32,
    verdict: &Verdict,
) -> Result<String, SourceError> {
    let Verdict::Withheld {
        sent,
        flushed,
        wait_event,
    } = verdict
    else {
        return Ok(String::new());
    };
    let row = client
        .query_one(
            "SELECT current_setting('synchronized_standby_slots', true), \
                    (SELECT string_agg(n || CASE WHEN s.slot_name IS NULL THEN ' (no such slot)' \
                                                WHEN NOT s.active THEN ' (inactive: its standby is not connected)' \
                                                ELSE ' (connected, behind)' END, ', ') \
                     FROM unnest(string_to_array(replace(coalesce( \
                              current_setting('synchronized_standby_slots', true), ''), ' ', ''), ',')) n \
                     LEFT JOIN pg_replication_slots s ON s.slot_name = n WHERE n <> ''), \
                    (SELECT string_agg(b::text, ', ') FROM unnest(pg_blocking_pids($1)) b)",
            &[&pid],
        )
        .await
        .map_err(|e| SourceError::sql("reading why the server withholds the stream", &e))?;
    Ok(explain(
        slot,
        pid,
        *sent,
        *flushed,
        wait_event.as_deref(),
        row.get::<_, Option<String>>(0).as_deref(),
        row.get::<_, Option<String>>(1).as_deref(),
        row.get::<_, Option<String>>(2).as_deref(),
    ))
}

/// The message for a withheld stream (see [`cause`]).
#[allow(clippy::too_many_arguments)]
fn explain(
    slot: &str,
    pid: i32,
    sent: Lsn,
    flushed: Lsn,
    wait_event: Option<&str>,
    standby_slots: Option<&str>,
    standby_states: Option<&str>,
    blockers: Option<&str>,
) -> String {
    let head = format!(
        "the server withholds changes from slot {slot}: its walsender (pid {pid}) has sent WAL \
         up to {sent} and stays there while the server has flushed up to {flushed}; nothing \
         committed after {sent} reaches the relay"
    );
    let standby_slots = standby_slots.filter(|s| !s.trim().is_empty());
    if let Some(names) = standby_slots {
        let one_down =
            standby_states.is_some_and(|s| s.contains("inactive") || s.contains("no such slot"));
        if wait_event == Some("WaitForStandbyConfirmation") || one_down {
            return format!(
                "{head}. It waits until the standbys of synchronized_standby_slots = '{names}' \
                 confirm that WAL ({}). Bring the standby back, or stop waiting for it: \
                 ALTER SYSTEM SET synchronized_standby_slots = '<the standby slots that are up>'; \
                 SELECT pg_reload_conf();",
                standby_states.unwrap_or("?")
            );
        }
    }
    match blockers {
        Some(pids) => format!(
            "{head}. It waits for a lock (wait event {}) held by pid {pids}: end that \
             transaction (SELECT pg_terminate_backend(pid))",
            wait_event.unwrap_or("?"),
        ),
        None => format!(
            "{head} (wait event {}). Look at the walsender in pg_stat_activity and the server's \
             log",
            wait_event.unwrap_or("none")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(sent: u64, flushed: u64, wait: Option<&str>) -> SlotInfo {
        SlotInfo {
            plugin: None,
            database: None,
            active: true,
            active_pid: Some(7),
            confirmed_flush_lsn: None,
            wal_status: None,
            safe_wal_size: None,
            lag_bytes: None,
            retained_wal_bytes: None,
            reply_age_secs: None,
            wait_event_type: None,
            local: true,
            invalidation_reason: None,
            wait_event: wait.map(Into::into),
            sent_lsn: Some(Lsn::new(sent)),
            flushed_lsn: Some(Lsn::new(flushed)),
        }
    }

    #[test]
    fn a_walsender_that_stays_behind_is_withheld_after_the_bound() {
        let t0 = Instant::now();
        let mut w = WithheldWatch::default();
        let wait = Some("WaitForStandbyConfirmation");
        assert_eq!(w.observe(t0, &reading(100, 200, wait)), Verdict::Behind);
        assert_eq!(
            w.observe(t0 + RECHECK, &reading(100, 300, wait)),
            Verdict::Behind
        );
        assert_eq!(
            w.observe(t0 + WITHHELD_AFTER, &reading(100, 300, wait)),
            Verdict::Withheld {
                sent: Lsn::new(100),
                flushed: Lsn::new(300),
                wait_event: wait.map(Into::into)
            }
        );
        // Caught up: flowing again, and the clock starts over.
        assert_eq!(
            w.observe(t0 + WITHHELD_AFTER * 2, &reading(300, 300, None)),
            Verdict::Flowing
        );
        assert_eq!(
            w.observe(t0 + WITHHELD_AFTER * 3, &reading(300, 400, None)),
            Verdict::Behind
        );
    }

    #[test]
    fn sending_on_or_waiting_for_the_relay_is_never_withheld() {
        let t0 = Instant::now();
        let mut w = WithheldWatch::default();
        // Behind at every reading under load, but moving.
        for i in 0..10u64 {
            let v = w.observe(t0 + RECHECK * (i as u32), &reading(100 + i, 200 + i, None));
            assert_eq!(v, Verdict::Behind, "{i}");
        }
        // Stuck writing to the relay (its window full): the relay's own
        // backpressure.
        let mut w = WithheldWatch::default();
        for i in 0..10u32 {
            let v = w.observe(
                t0 + RECHECK * i,
                &reading(100, 200, Some("WalSenderWriteData")),
            );
            assert_eq!(v, Verdict::Flowing, "{i}");
        }
        // Nothing to read: no verdict.
        let mut none = reading(1, 2, None);
        none.sent_lsn = None;
        assert_eq!(w.observe(t0, &none), Verdict::Flowing);
    }

    #[test]
    fn the_cause_is_named_with_its_fix() {
        let sb = explain(
            "s",
            7,
            Lsn::new(100),
            Lsn::new(300),
            Some("WaitForStandbyConfirmation"),
            Some("sb1"),
            Some("sb1 (inactive: its standby is not connected)"),
            None,
        );
        assert!(
            sb.contains("synchronized_standby_slots = 'sb1'")
                && sb.contains("inactive")
                && sb.contains("pg_reload_conf"),
            "{sb}"
        );
        let lock = explain(
            "s",
            7,
            Lsn::new(1),
            Lsn::new(2),
            Some("relation"),
            None,
            None,
            Some("42"),
        );
        assert!(
            lock.contains("pid 42") && lock.contains("pg_terminate_backend"),
            "{lock}"
        );
        let other = explain(
            "s",
            7,
            Lsn::new(1),
            Lsn::new(2),
            Some("Foo"),
            Some(""),
            None,
            None,
        );
        assert!(
            other.contains("wait event Foo") && !other.contains("synchronized"),
            "{other}"
        );
    }
}
