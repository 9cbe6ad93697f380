//! Time as the relay reads it against the database server's clock.
//!
//! The replication protocol's timestamps — a transaction's commit time,
//! the send time of every keepalive and WAL data message — count
//! microseconds since 2000-01-01 00:00:00 UTC on the **server's** clock
//! (PostgreSQL docs, "Streaming Replication Protocol": `XLogData`,
//! "Primary keepalive message"; "Logical Replication Message Formats":
//! `Begin`, `Commit`). This machine's clock may differ from it, and may be
//! stepped while the relay runs (an NTP step, a VM resumed). So the relay
//! measures the difference on every message ([`skew_seconds`]: local now
//! minus the message's send time; the network delay, milliseconds on a
//! LAN, is part of it) and corrects by it wherever it compares a server
//! time with now ([`seconds_since`]). The samples are taken on a steady
//! timeline ([`steady_micros`]: the wall clock read once, advanced by the
//! monotonic clock), which a step of the wall clock does not move, so the
//! estimate (the least sample of the last minute, `source::skew`) holds
//! across a step; the step itself (the second half of [`skew_seconds`]) is added back for
//! the wall clock's skew at every message. A step is thus corrected at the
//! next message either way, never read as a commit 10 minutes old or in
//! the future.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The longest duration a setting takes (a flag or a routes file key):
/// 3,650 days. The relay adds its settings to monotonic instants
/// (deadlines, probe and backoff times), and a much larger one would
/// overflow them, a panic at the first use instead of an error at start.
pub const MAX_SETTING: Duration = Duration::from_secs(3650 * 24 * 3600);

/// `d` if it is at most [`MAX_SETTING`], else the error to show with the
/// setting's name.
pub fn within_max_setting(d: Duration) -> Result<Duration, String> {
    if d <= MAX_SETTING {
        Ok(d)
    } else {
        Err(format!(
            "{} is above the longest duration accepted, 3650 days",
            humantime::format_duration(d)
        ))
    }
}

/// A duration setting in humantime syntax (`500ms`, `2s`, `1m 30s`, `7d`),
/// at most [`MAX_SETTING`]. The error says what is wrong without the
/// setting's name (the caller adds it): a negative value, a value that is
/// not a duration, or one above the longest accepted.
pub fn parse_setting(s: &str) -> Result<Duration, String> {
    if s.trim_start().starts_with('-') {
        return Err(format!(
            "{s:?} is negative; a duration is 0 or more (examples: 500ms, 2s, 1m)"
        ));
    }
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration: {e} (examples: 500ms, 2s, 1m)"))
        .and_then(within_max_setting)
}

/// 2000-01-01 00:00:00 UTC, PostgreSQL's epoch, in microseconds since the
/// Unix epoch.
pub const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

/// A skew at least this large is logged at WARN: receivers refuse
/// signatures whose `webhook-timestamp` is further from their clock than
/// their tolerance (5 minutes in the Standard Webhooks libraries, often
/// less), and a skew this size says the machine's time sync is off.
pub const SKEW_WARN: Duration = Duration::from_secs(30);

/// What a skew of `skew` seconds (positive: this machine ahead of the
/// database server) means and how to fix it, one sentence for every
/// place that names it (the running relay's WARN, `status`); `None` below
/// [`SKEW_WARN`].
pub fn skew_warning(skew: f64) -> Option<String> {
    if skew.abs() < SKEW_WARN.as_secs_f64() {
        return None;
    }
    let way = if skew > 0.0 { "ahead of" } else { "behind" };
    Some(format!(
        "this machine's clock is {:.0} s {way} the database server's: a relay on this machine \
         signs each event's webhook-timestamp with it, and receivers refuse timestamps outside \
         their tolerance (often 5 minutes) with a 401. Fix time synchronisation (NTP: chrony, \
         systemd-timesyncd) on this machine or on the server; `chronyc tracking` or \
         `timedatectl` shows whether it is synchronised",
        skew.abs()
    ))
}

/// Microseconds since the Unix epoch, now, on this machine's clock.
pub fn unix_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// This machine's time on a steady timeline, microseconds since the Unix
/// epoch: the wall clock as it read at the first call, advanced by the
/// monotonic clock since. A step of the wall clock does not move it.
pub fn steady_micros() -> i64 {
    static ANCHOR: std::sync::OnceLock<(i64, std::time::Instant)> = std::sync::OnceLock::new();
    let (wall, mono) = ANCHOR.get_or_init(|| (unix_micros(), std::time::Instant::now()));
    wall.saturating_add(i64::try_from(mono.elapsed().as_micros()).unwrap_or(i64::MAX))
}

/// One message's sample, for a message the server sent at `server_micros`
/// (microseconds since PostgreSQL's epoch, its clock) and that arrives
/// now, in seconds: the steady timeline minus the server's clock, and how
/// far the wall clock has been stepped since the steady timeline began
/// (wall minus [`steady_micros`]; 0 without a step). The wall clock's skew
/// is their sum. Positive: ahead of the server. One read of each clock.
pub fn skew_seconds(server_micros: i64) -> (f64, f64) {
    let sent = server_micros.saturating_add(PG_EPOCH_UNIX_MICROS);
    let steady = steady_micros();
    (
        steady.saturating_sub(sent) as f64 / 1e6,
        unix_micros().saturating_sub(steady) as f64 / 1e6,
    )
}

/// Seconds from a commit at `commit_micros` (microseconds since
/// PostgreSQL's epoch, the server's clock) to now, with this machine's
/// wall clock corrected by `skew` seconds (the wall clock's skew,
/// `cdc_relay_clock_skew_seconds`); never negative.
pub fn seconds_since(commit_micros: i64, skew: f64) -> f64 {
    let committed = commit_micros.saturating_add(PG_EPOCH_UNIX_MICROS);
    let now_on_server = unix_micros() as f64 - skew * 1e6;
    ((now_on_server - committed as f64) / 1e6).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Now on this clock, as a server time `ahead` seconds behind it.
    fn server_now(ahead: f64) -> i64 {
        unix_micros() - PG_EPOCH_UNIX_MICROS - (ahead * 1e6) as i64
    }

    #[test]
    fn a_clock_ten_minutes_ahead_or_behind_is_measured() {
        for ahead in [600.0, -600.0, 0.0] {
            let (steady, stepped) = skew_seconds(server_now(ahead));
            let skew = steady + stepped;
            assert!((skew - ahead).abs() < 1.0, "{skew} for {ahead}");
        }
    }

    #[test]
    fn a_commit_two_seconds_ago_is_two_seconds_old_whatever_the_skew() {
        for ahead in [600.0, -600.0, 0.0] {
            let commit = server_now(ahead) - 2_000_000;
            let since = seconds_since(commit, ahead);
            assert!((since - 2.0).abs() < 0.5, "{since} with a skew of {ahead}");
            // Uncorrected, the step shows: 0 (clamped) or 600 s too many.
            let raw = seconds_since(commit, 0.0);
            assert!(
                ahead == 0.0 || (raw - 2.0).abs() > 500.0 || raw == 0.0,
                "{raw}"
            );
        }
    }
}
