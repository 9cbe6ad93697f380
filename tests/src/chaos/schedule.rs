//! The fault schedule, drawn from the seed: the same seed and the same
//! [`Shape`] give the same faults at the same offsets, every time.
//!
//! Two timelines run side by side:
//!
//! - **relay kills**: the active relay is SIGKILLed every 15–20 s (uniform),
//!   from the first interval to the end of the fault phase;
//! - **the other faults**, one after another, never overlapping each other:
//!   a first round holding every kind once (in a drawn order, including the
//!   one PostgreSQL immediate restart and the one walsender termination),
//!   then further rounds of the repeatable kinds while they fit, each fault
//!   followed by a drawn gap.
//!
//! A relay kill may therefore land in the middle of any other fault, as it
//! would in production.

use std::fmt;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// One kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL of the relay holding the slot; a new relay starts as standby.
    RelayKill,
    /// SIGKILL of Billing; restarted (on a new port) after the hold.
    BillingKill,
    /// SIGKILL of Orders; restarted (on a new port) after the hold.
    OrdersKill,
    /// relay↔Billing partition: nothing flows, nobody gets an error.
    BillingLinkBlackhole,
    /// relay↔Billing connections reset (TCP RST), new ones too.
    BillingLinkReset,
    /// relay↔PostgreSQL partition (both relays, replication and SQL).
    PgLinkBlackhole,
    /// relay↔PostgreSQL connections reset.
    PgLinkReset,
    /// Billing answers 503 to everything.
    Billing503,
    /// `pg_ctl restart -m immediate`: SIGQUIT, crash recovery, start.
    PgRestartImmediate,
    /// `pg_terminate_backend` of the walsender serving the slot.
    WalsenderTerminate,
    /// SIGKILL of the payment provider; restarted (on a new port) after the hold.
    PaymentsKill,
    /// Billing dies between the provider's charge and its own record of it
    /// (restarted with `--fault-exit-after-charge`, it exits at its next
    /// charge); restarted after the hold.
    BillingExitAfterCharge,
    /// The provider dies between its charge and its answer (restarted with
    /// `--fault-exit-after-commit`); restarted after the hold.
    PaymentsExitAfterCharge,
}

impl FaultKind {
    /// Every kind, in report order.
    pub const ALL: [FaultKind; 13] = [
        FaultKind::RelayKill,
        FaultKind::BillingKill,
        FaultKind::OrdersKill,
        FaultKind::BillingLinkBlackhole,
        FaultKind::BillingLinkReset,
        FaultKind::PgLinkBlackhole,
        FaultKind::PgLinkReset,
        FaultKind::Billing503,
        FaultKind::PgRestartImmediate,
        FaultKind::WalsenderTerminate,
        FaultKind::PaymentsKill,
        FaultKind::BillingExitAfterCharge,
        FaultKind::PaymentsExitAfterCharge,
    ];

    /// Kinds that come back in every round.
    const REPEATABLE: [FaultKind; 10] = [
        FaultKind::BillingKill,
        FaultKind::OrdersKill,
        FaultKind::BillingLinkBlackhole,
        FaultKind::BillingLinkReset,
        FaultKind::PgLinkBlackhole,
        FaultKind::PgLinkReset,
        FaultKind::Billing503,
        FaultKind::PaymentsKill,
        FaultKind::BillingExitAfterCharge,
        FaultKind::PaymentsExitAfterCharge,
    ];

    /// A short name for tables and logs.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::RelayKill => "relay SIGKILL",
            FaultKind::BillingKill => "Billing SIGKILL",
            FaultKind::OrdersKill => "Orders SIGKILL",
            FaultKind::BillingLinkBlackhole => "relay↔Billing blackhole",
            FaultKind::BillingLinkReset => "relay↔Billing reset",
            FaultKind::PgLinkBlackhole => "relay↔PostgreSQL blackhole",
            FaultKind::PgLinkReset => "relay↔PostgreSQL reset",
            FaultKind::Billing503 => "Billing 503 burst",
            FaultKind::PgRestartImmediate => "PostgreSQL restart -m immediate",
            FaultKind::WalsenderTerminate => "walsender terminated",
            FaultKind::PaymentsKill => "Payments SIGKILL",
            FaultKind::BillingExitAfterCharge => "Billing dies after a charge",
            FaultKind::PaymentsExitAfterCharge => "Payments dies before answering",
        }
    }

    /// How long the fault holds, drawn: the down time of a killed service,
    /// the length of a cut or of a 503 burst; zero for instant faults.
    fn draw_hold(self, rng: &mut StdRng) -> Duration {
        let secs = match self {
            FaultKind::RelayKill
            | FaultKind::PgRestartImmediate
            | FaultKind::WalsenderTerminate => 0.0,
            FaultKind::BillingKill => rng.random_range(2.0..5.0),
            FaultKind::OrdersKill
            | FaultKind::PaymentsKill
            | FaultKind::BillingExitAfterCharge
            | FaultKind::PaymentsExitAfterCharge => rng.random_range(1.0..3.0),
            FaultKind::BillingLinkBlackhole
            | FaultKind::BillingLinkReset
            | FaultKind::PgLinkBlackhole
            | FaultKind::PgLinkReset => 5.0,
            FaultKind::Billing503 => rng.random_range(5.0..30.0),
        };
        Duration::from_secs_f64(secs)
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What shapes a schedule besides the seed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Shape {
    /// Length of the fault phase; the first round of other faults may
    /// run past it.
    pub duration: Duration,
    /// Interval between relay kills, uniform in this range (seconds).
    pub kill_every: (f64, f64),
    /// Gap after each other fault, uniform in this range (seconds).
    pub gap: (f64, f64),
    /// When the first other fault starts.
    pub first_at: Duration,
}

impl Shape {
    /// The full run: 15–20 s between relay kills, 4–10 s gaps.
    pub fn full(duration: Duration) -> Shape {
        Shape {
            duration,
            kill_every: (15.0, 20.0),
            gap: (4.0, 10.0),
            first_at: Duration::from_secs(5),
        }
    }

    /// The same schedule compressed for CI: the same fault kinds and holds,
    /// shorter gaps (1.5–3 s).
    pub fn compressed(duration: Duration) -> Shape {
        Shape {
            duration,
            kill_every: (15.0, 20.0),
            gap: (1.5, 3.0),
            first_at: Duration::from_secs(3),
        }
    }
}

/// One scheduled fault.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Fault {
    /// Position in the schedule (0-based, in start order).
    pub n: usize,
    /// What.
    pub kind: FaultKind,
    /// Start, from the beginning of the fault phase.
    #[serde(serialize_with = "secs")]
    pub at: Duration,
    /// How long it holds.
    #[serde(serialize_with = "secs")]
    pub hold: Duration,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64((d.as_secs_f64() * 1000.0).round() / 1000.0)
}

/// The drawn schedule.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Schedule {
    /// The seed it was drawn from.
    pub seed: u64,
    /// The shape it was drawn with.
    pub shape: Shape,
    /// Every fault, by start time.
    pub faults: Vec<Fault>,
    /// When the fault phase ends: the shape's duration, or the end of the
    /// last fault if later.
    #[serde(serialize_with = "secs")]
    pub end: Duration,
}

impl Schedule {
    /// Draws the schedule for `seed`.
    pub fn draw(seed: u64, shape: Shape) -> Schedule {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut faults = Vec::new();
        let total = shape.duration.as_secs_f64();

        let mut t = rng.random_range(shape.kill_every.0..shape.kill_every.1);
        while t < total {
            faults.push((FaultKind::RelayKill, t, Duration::ZERO));
            t += rng.random_range(shape.kill_every.0..shape.kill_every.1);
        }

        let mut t = shape.first_at.as_secs_f64();
        let mut end = total;
        let mut first: Vec<FaultKind> = FaultKind::REPEATABLE.to_vec();
        first.extend([FaultKind::PgRestartImmediate, FaultKind::WalsenderTerminate]);
        first.shuffle(&mut rng);
        for kind in first {
            let hold = kind.draw_hold(&mut rng);
            faults.push((kind, t, hold));
            end = end.max(t + hold.as_secs_f64());
            t += hold.as_secs_f64() + rng.random_range(shape.gap.0..shape.gap.1);
        }
        'rounds: loop {
            let mut round = FaultKind::REPEATABLE.to_vec();
            round.shuffle(&mut rng);
            for kind in round {
                let hold = kind.draw_hold(&mut rng);
                if t + hold.as_secs_f64() > total {
                    break 'rounds;
                }
                faults.push((kind, t, hold));
                t += hold.as_secs_f64() + rng.random_range(shape.gap.0..shape.gap.1);
            }
        }
        faults.sort_by(|a, b| a.1.total_cmp(&b.1));
        let faults = faults
            .into_iter()
            .enumerate()
            .map(|(n, (kind, at, hold))| Fault {
                n,
                kind,
                at: Duration::from_secs_f64(at),
                hold,
            })
            .collect();
        Schedule {
            seed,
            shape,
            faults,
            end: Duration::from_secs_f64(end),
        }
    }

    /// How many faults of `kind`.
    pub fn count(&self, kind: FaultKind) -> usize {
        self.faults.iter().filter(|f| f.kind == kind).count()
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "chaos schedule: seed {}, {} faults over {:.0} s",
            self.seed,
            self.faults.len(),
            self.end.as_secs_f64()
        )?;
        for fault in &self.faults {
            write!(
                f,
                "  #{:<3} t={:>7.2}s  {}",
                fault.n,
                fault.at.as_secs_f64(),
                fault.kind
            )?;
            if !fault.hold.is_zero() {
                write!(f, " for {:.1}s", fault.hold.as_secs_f64())?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_schedule_and_every_kind_present() {
        let shape = Shape::compressed(Duration::from_secs(90));
        let a = Schedule::draw(7, shape);
        assert_eq!(a, Schedule::draw(7, shape));
        assert_ne!(a, Schedule::draw(8, shape));
        for kind in FaultKind::ALL {
            assert!(a.count(kind) >= 1, "{kind} missing:\n{a}");
        }
        assert_eq!(a.count(FaultKind::PgRestartImmediate), 1);
        assert_eq!(a.count(FaultKind::WalsenderTerminate), 1);
        assert!(a.count(FaultKind::RelayKill) >= 4, "{a}");
    }

    #[test]
    fn other_faults_never_overlap() {
        for seed in 0..50 {
            let s = Schedule::draw(seed, Shape::full(Duration::from_secs(600)));
            let others: Vec<&Fault> = s
                .faults
                .iter()
                .filter(|f| f.kind != FaultKind::RelayKill)
                .collect();
            for w in others.windows(2) {
                assert!(w[0].at + w[0].hold <= w[1].at, "seed {seed}:\n{s}");
            }
            assert!(s.count(FaultKind::RelayKill) >= 29, "seed {seed}");
            assert!(s.count(FaultKind::BillingKill) >= 3, "seed {seed}:\n{s}");
        }
    }
}
