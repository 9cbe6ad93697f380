//! Is the outbox still in its publication? Decided from the slot monitor's
//! readings (`catalog::monitor_reading`), without statements of its own.
//!
//! pgoutput decodes each change with the catalog as it was at that change:
//! an insert into the outbox while the table is not in the publication
//! (`ALTER PUBLICATION … DROP TABLE`, or `DROP TABLE` + `CREATE TABLE` under
//! a `FOR TABLE` publication) is never streamed, and nothing in the stream
//! says so. So the monitor checks membership on every reading, and:
//!
//! - while the table is out, the confirmed position is held at the WAL
//!   position of the last reading that found it in (the stream's other
//!   transactions and keepalives would otherwise move the slot on), and
//!   `/readyz` fails;
//! - a change of the membership's identity between two readings that both
//!   found it in (it left and rejoined, or the table was recreated and
//!   added, faster than the monitor looks) is a gap too.
//!
//! - the identity last verified is recorded in `cdc_relay_progress` (only
//!   when it changes), and a session's first reading is compared with it:
//!   a change made while no relay watched (the relay stopped, or between
//!   two sessions) is a gap like one between two readings.
//!
//! Either way the rows inserted meanwhile cannot come from the slot: the
//! operator re-sends them with `cdc-relay backfill`, and the messages say
//! the exact `--since`.

use super::catalog::Membership;
use crate::lsn::Lsn;

/// What a reading changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Still in, as before.
    Steady,
    /// The table left the publication(s).
    Left {
        /// When it was last seen in (server time, UTC), a `--since` for backfill.
        since: String,
    },
    /// Still out.
    StillOut,
    /// Back in after [`Change::Left`].
    Back {
        /// When it was last seen in before it left.
        since: String,
        /// Now.
        until: String,
    },
    /// In at both readings, but not the same membership: it left and
    /// rejoined (or the table was recreated) in between.
    Gap {
        /// The earlier reading's time.
        since: String,
        /// This reading's time.
        until: String,
        /// What the catalog shows changed, in words
        /// ([`super::catalog::Membership::gap_since`]).
        cause: String,
    },
}

/// A verified reading: the table was in at this WAL position and time.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Verified {
    wal_lsn: Lsn,
    at: String,
    membership: Membership,
}

/// The membership state of one session.
#[derive(Debug)]
pub struct MembershipWatch {
    /// The last reading that found the table in; `None` before the first.
    last_in: Option<Verified>,
    /// Where the session started (the slot's position): what to hold at
    /// when the very first reading already finds the table out.
    start: Lsn,
    /// The server's time when the session's monitor started (UTC,
    /// `YYYY-MM-DD HH:MM:SS+00`): the `since` of a gap found at the first
    /// reading when nothing was recorded before (the start-up check found
    /// the table in; `--backfill-margin` covers the moments in between).
    started_at: String,
    out: bool,
}

impl MembershipWatch {
    /// A watch for a session that started streaming at `start`, after the
    /// start-up check found the table in its publication. `recorded` is the
    /// membership last verified before this session (its `at` the latest
    /// time it is known to have held): the first reading is compared with
    /// it.
    /// `started_at` is the server's time as the watch starts.
    pub fn new(start: Lsn, started_at: String, recorded: Option<Membership>) -> Self {
        MembershipWatch {
            last_in: recorded.map(|m| Verified {
                wal_lsn: start,
                at: m.at.clone(),
                membership: m,
            }),
            start,
            started_at,
            out: false,
        }
    }

    /// Takes one reading into account.
    pub fn observe(&mut self, m: &Membership) -> Change {
        let since = || {
            self.last_in
                .as_ref()
                .map_or_else(|| self.started_at.clone(), |v| v.at.clone())
        };
        let change = match (m.included(), self.out) {
            (false, false) => {
                self.out = true;
                return Change::Left { since: since() };
            }
            (false, true) => return Change::StillOut,
            (true, true) => Change::Back {
                since: since(),
                until: m.at.clone(),
            },
            (true, false) => match &self.last_in {
                Some(v) => match m.gap_since(&v.membership) {
                    Some(cause) => Change::Gap {
                        since: v.at.clone(),
                        until: m.at.clone(),
                        cause,
                    },
                    None => Change::Steady,
                },
                None => Change::Steady,
            },
        };
        self.out = false;
        self.last_in = Some(Verified {
            wal_lsn: m.wal_lsn,
            at: m.at.clone(),
            membership: m.clone(),
        });
        change
    }

    /// The position the confirmed LSN must not pass: `None` while the
    /// table is in; while it is out, the WAL position of the last reading
    /// that found it in.
    pub fn ceiling(&self) -> Option<Lsn> {
        self.out
            .then(|| self.last_in.as_ref().map_or(self.start, |v| v.wal_lsn))
    }

    /// Whether the table is in its publication(s), as last read.
    pub fn is_in(&self) -> bool {
        !self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reading; `carriers` comma-separated ("" for none).
    fn reading(included: bool, carriers: &str, lsn: u64, at: &str) -> Membership {
        Membership {
            carriers: if included {
                carriers.split(',').map(str::to_owned).collect()
            } else {
                Vec::new()
            },
            table_oid: Some(7),
            problem: None,
            wal_lsn: Lsn::new(lsn),
            at: at.into(),
        }
    }

    #[test]
    fn leaving_holds_the_ceiling_at_the_last_verified_position_until_back() {
        let mut w = MembershipWatch::new(Lsn::new(10), "t-start".into(), None);
        assert_eq!(w.observe(&reading(true, "a", 100, "t1")), Change::Steady);
        assert_eq!(w.ceiling(), None);
        assert_eq!(w.observe(&reading(true, "a", 200, "t2")), Change::Steady);
        assert_eq!(
            w.observe(&reading(false, "", 300, "t3")),
            Change::Left { since: "t2".into() }
        );
        assert_eq!(w.ceiling(), Some(Lsn::new(200)));
        assert!(!w.is_in());
        assert_eq!(w.observe(&reading(false, "", 400, "t4")), Change::StillOut);
        assert_eq!(w.ceiling(), Some(Lsn::new(200)), "never moves while out");
        assert_eq!(
            w.observe(&reading(true, "b", 500, "t5")),
            Change::Back {
                since: "t2".into(),
                until: "t5".into()
            }
        );
        assert_eq!(w.ceiling(), None);
        assert_eq!(w.observe(&reading(true, "b", 600, "t6")), Change::Steady);
    }

    #[test]
    fn a_flap_between_readings_is_a_gap() {
        let mut w = MembershipWatch::new(Lsn::new(10), "t-start".into(), None);
        w.observe(&reading(true, "p1:r5", 100, "t1"));
        assert_eq!(
            w.observe(&reading(true, "p1:r9", 200, "t2")),
            Change::Gap {
                since: "t1".into(),
                until: "t2".into(),
                cause: "publication p1:r5 carries it differently now".into()
            }
        );
        assert_eq!(w.ceiling(), None);
    }

    #[test]
    fn a_change_in_one_of_two_carriers_is_no_gap() {
        let mut w = MembershipWatch::new(Lsn::new(10), "t-start".into(), None);
        w.observe(&reading(true, "a:r1,b:r2", 100, "t1"));
        assert_eq!(w.observe(&reading(true, "a:r1", 200, "t2")), Change::Steady);
        assert_eq!(
            w.observe(&reading(true, "a:r1,b:r3", 300, "t3")),
            Change::Steady
        );
        let mut recreated = reading(true, "a:r1", 400, "t4");
        recreated.table_oid = Some(8);
        assert!(
            matches!(w.observe(&recreated), Change::Gap { .. }),
            "the table is another relation"
        );
    }

    #[test]
    fn out_at_the_first_reading_holds_at_the_session_start() {
        let mut w = MembershipWatch::new(Lsn::new(42), "t-start".into(), None);
        assert_eq!(
            w.observe(&reading(false, "", 100, "t1")),
            Change::Left {
                since: "t-start".into()
            },
            "since the watch's start, a time a backfill can start from"
        );
        assert_eq!(w.ceiling(), Some(Lsn::new(42)));
        assert_eq!(
            w.observe(&reading(true, "a", 200, "t2")),
            Change::Back {
                since: "t-start".into(),
                until: "t2".into()
            }
        );
    }

    /// What the monitor records for a gap found at a first reading, when
    /// nothing was recorded before: no carriers. The next session's first
    /// reading that finds the table in is then a gap from that time.
    #[test]
    fn a_recorded_membership_of_no_carriers_makes_the_next_reading_a_gap() {
        let recorded = reading(false, "", 0, "t0");
        let mut w = MembershipWatch::new(Lsn::new(10), "t-start".into(), Some(recorded));
        assert_eq!(
            w.observe(&reading(true, "p1:r9", 100, "t1")),
            Change::Gap {
                since: "t0".into(),
                until: "t1".into(),
                cause: "no publication carried it when it was last verified".into()
            }
        );
    }

    #[test]
    fn a_change_while_no_relay_watched_is_a_gap_at_the_first_reading() {
        let recorded = reading(true, "p1:r5", 0, "t0");
        let mut w = MembershipWatch::new(Lsn::new(10), "t-start".into(), Some(recorded.clone()));
        assert_eq!(
            w.observe(&reading(true, "p1:r9", 100, "t1")),
            Change::Gap {
                since: "t0".into(),
                until: "t1".into(),
                cause: "publication p1:r5 carries it differently now".into()
            }
        );
        let mut same = MembershipWatch::new(Lsn::new(10), "t-start".into(), Some(recorded.clone()));
        assert_eq!(
            same.observe(&reading(true, "p1:r5", 100, "t1")),
            Change::Steady
        );
        let mut out = MembershipWatch::new(Lsn::new(10), "t-start".into(), Some(recorded));
        assert_eq!(
            out.observe(&reading(false, "", 100, "t1")),
            Change::Left { since: "t0".into() }
        );
        assert_eq!(
            out.ceiling(),
            Some(Lsn::new(10)),
            "held at the session start"
        );
    }
}
