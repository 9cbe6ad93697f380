//! `status` as text: the slot, the publication, the relays' admin
//! endpoints and the problems, for a reader (`--json` is the same
//! [`Status`] serialized).

use super::{RelayEndpoint, Status};

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        if !self.exists {
            writeln!(
                f,
                "slot {}: does not exist (run `cdc-relay setup`)",
                self.slot
            )?;
        } else {
            writeln!(f, "slot {}", self.slot)?;
            match (&self.held_by, self.active_pid) {
                (Some(who), Some(pid)) => writeln!(
                    f,
                    "  active:              true, held by {who} (walsender pid {pid})"
                )?,
                (None, Some(pid)) => {
                    writeln!(f, "  active:              true (walsender pid {pid})")?
                }
                _ => writeln!(f, "  active:              false (no relay streams from it)")?,
            }
            if let Some(who) = &self.last_progress_by {
                writeln!(f, "  last progress by:    {who}")?;
            }
            let lost = self.wal_status.as_deref() == Some("lost");
            writeln!(
                f,
                "  confirmed_flush_lsn: {}",
                opt(&self.confirmed_flush_lsn)
            )?;
            writeln!(
                f,
                "  lag:                 {}",
                match self.lag_bytes {
                    _ if lost => "lost".into(),
                    Some(b) => human_bytes(b),
                    None => "-".into(),
                }
            )?;
            writeln!(f, "  wal_status:          {}", opt(&self.wal_status))?;
            writeln!(
                f,
                "  safe_wal_size:       {}",
                match self.safe_wal_size {
                    _ if lost => "lost".into(),
                    Some(b) => human_bytes(b),
                    None => "unlimited (max_slot_wal_keep_size = -1)".into(),
                }
            )?;
        }
        writeln!(
            f,
            "publication {}: {}",
            self.publication,
            if self.publication_tables.is_empty() {
                "no tables (or missing)".into()
            } else {
                self.publication_tables.join(", ")
            }
        )?;
        if let Some(flag) = self.failover {
            writeln!(f, "  failover slot:       {flag}")?;
        }
        for c in &self.standbys {
            match &c.error {
                Some(e) => writeln!(f, "standby {}: cannot read ({e})", c.standby)?,
                None if c.primary => writeln!(
                    f,
                    "standby {}: not in recovery (a primary): no copy to check",
                    c.standby
                )?,
                None if !c.exists => writeln!(f, "standby {}: no copy of the slot", c.standby)?,
                None => writeln!(
                    f,
                    "standby {}: copy synced {}, {}, {} behind",
                    c.standby,
                    c.synced,
                    if c.temporary {
                        "TEMPORARY (dropped at promotion)"
                    } else {
                        "persistent"
                    },
                    c.lag_bytes.map_or("?".into(), |b| human_bytes(
                        i64::try_from(b).unwrap_or(i64::MAX)
                    ))
                )?,
            }
        }
        for o in &self.other_logical_slots {
            writeln!(
                f,
                "other logical slot {} (plugin {}, {}): it can read every row change in this \
                 database and holds WAL back; if nobody here owns it, drop it: \
                 SELECT pg_drop_replication_slot('{}')",
                o.name,
                o.plugin,
                if o.active { "active" } else { "inactive" },
                o.name
            )?;
        }
        for r in &self.relays {
            write_relay(f, r)?;
        }
        if let Some(n) = self.dead_letters_waiting {
            writeln!(
                f,
                "dead letters waiting: {n}{}",
                if n > 0 {
                    " (`cdc-relay dead-letter list`)"
                } else {
                    ""
                }
            )?;
        }
        for w in &self.warnings {
            writeln!(f, "warning: {w}")?;
        }
        if self.healthy {
            // The database alone cannot show a relay's circuit or queue:
            // when no admin endpoint answered, the verdict says how far it
            // goes.
            let unread: Vec<&str> = self
                .relays
                .iter()
                .filter(|r| r.detail.starts_with("no answer"))
                .map(|r| r.url.as_str())
                .collect();
            if unread.is_empty() {
                writeln!(f, "healthy: nothing stops delivery")
            } else {
                writeln!(
                    f,
                    "healthy as far as the database shows: the relay's own state (circuit, queue, readiness) was not read, {} did not answer; give the admin listener's address with --admin-url (or CDC_RELAY_ADMIN_LISTEN)",
                    unread.join(", ")
                )
            }
        } else {
            for p in &self.problems {
                writeln!(f, "problem (exit {}): {}", p.code, p.message)?;
            }
            Ok(())
        }
    }
}

/// One line for what a relay's admin endpoint said.
pub(super) fn write_relay(f: &mut std::fmt::Formatter<'_>, r: &RelayEndpoint) -> std::fmt::Result {
    let said = |state: f64| match state {
        0.0 => "closed",
        1.0 => "OPEN",
        2.0 => "probing",
        _ => "unknown",
    };
    // With a routes file, each endpoint has its circuit; the relay-wide
    // one is the single endpoint's (`default`).
    let routed = r.endpoint_circuits.keys().any(|name| name != "default");
    let circuit = if routed {
        let each: Vec<String> = r
            .endpoint_circuits
            .iter()
            .map(|(name, state)| format!("{name} {}", said(*state)))
            .collect();
        format!(", circuits: {}", each.join(", "))
    } else {
        r.circuit_state
            .map_or(String::new(), |state| format!(", circuit {}", said(state)))
    };
    let parked = if r.parked.is_empty() {
        String::new()
    } else {
        format!(", parked: {}", r.parked.join(", "))
    };
    writeln!(
        f,
        "relay {}: {}{circuit}{parked}{}",
        r.url,
        if r.ready {
            "ready"
        } else if r.standby {
            "hot standby, waiting for the slot"
        } else {
            &r.detail
        },
        r.oldest_unconfirmed_event_age_secs
            .filter(|a| *a > 0.0)
            .map_or(String::new(), |a| format!(
                ", oldest unconfirmed event {a:.0} s old"
            ))
    )
}

/// `bytes` for a reader: `512 bytes`, `1.5 KiB`, `12.0 MiB`, `3.2 GiB`
/// (binary units, one decimal). The JSON output keeps exact bytes.
pub(crate) fn human_bytes(bytes: i64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes.unsigned_abs() < 1024 {
        return format!("{bytes} bytes");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value.abs() >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}
