//! From what the run observed to the ledger, the figures, the table and
//! the JSON file.
//!
//! Every time is in seconds from the start of the fault phase (`t = 0`);
//! the warm-up is negative. Database timestamps (commit timestamps of the
//! order and of the invoice, one cluster, one clock) are mapped onto the
//! same axis through the wall clock read at `t = 0`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;

use serde::Serialize;
use uuid::Uuid;

use super::load::{HttpTally, SqlTally};
use super::schedule::{Fault, FaultKind, Schedule};
use crate::oracle::Charges;
use crate::stats::percentile;

/// One request as the sink (in front of Billing) answered it.
#[derive(Debug, Clone)]
pub struct SinkRecord {
    /// Answered at.
    pub t: f64,
    /// The event id (body `id`).
    pub id: Option<Uuid>,
    /// The status the relay got.
    pub status: u16,
}

/// How one fault went.
#[derive(Debug, Clone, Serialize)]
pub struct FaultOutcome {
    /// The scheduled fault.
    #[serde(flatten)]
    pub fault: Fault,
    /// When it was applied.
    pub started: f64,
    /// When it was lifted (the service restarted, the link healed, the
    /// PostgreSQL restart returned); `started` for instant faults.
    pub ended: f64,
    /// The process killed (relay name, `billing`, `orders`).
    pub victim: Option<String>,
    /// Relay kills: seconds from the SIGKILL until another relay held the slot.
    pub takeover: Option<f64>,
    /// Anything unusual (a fallback taken, an error while applying it).
    pub note: Option<String>,
    /// Seconds from the end of the fault to the next 2xx at the sink
    /// (relay kills: from the SIGKILL to the first 2xx after the takeover).
    pub first_2xx_after: Option<f64>,
    /// Seconds from the end of the fault until every order committed before
    /// that end was invoiced (0 if they all already were).
    pub caught_up_after: Option<f64>,
    /// 2xx for event ids that had a 2xx already, answered between this
    /// fault's start and the next fault's start.
    pub redelivered: usize,
    /// Requests the sink answered while the fault held (any status).
    pub sink_requests_during: usize,
    /// Faults between the relay and Billing (Billing killed, a 503 burst,
    /// the link cut or reset): requests that reached the sink's side from
    /// one second after the fault began until it was lifted (Billing's
    /// front for a kill or a burst, new connections at the relay↔Billing
    /// proxy for a cut or a reset: each attempt there needs one), and the
    /// length of that span in seconds. The first second is left out: it
    /// holds the requests already in flight and the failures that open the
    /// circuit.
    pub sink_requests_after_first_second: Option<(usize, f64)>,
    /// Relay kills within the span `sink_requests_after_first_second`
    /// counts: the relay taking over knows nothing of the sink and sends
    /// its first request at once, possibly less than a probe interval after
    /// the killed relay's last one.
    pub relay_kills_while_counted: usize,
    /// Another fault held during this one, or had ended less than
    /// [`SETTLE`] seconds before it started: its figures mix both, and the
    /// per-kind statistics leave it out.
    pub overlapped: bool,
}

impl FaultOutcome {
    /// For a fault against Billing, the most requests "at most 2 per
    /// second" allows in the span `sink_requests_after_first_second`
    /// counts (issue 14, HTTP manners 6): each relay keeps its requests to
    /// a dead sink at least a probe interval (500 ms) apart, so a span of
    /// `secs` holds at most `2·secs + 1` of them (one may sit on each
    /// edge), plus one per relay kill inside it (the relay taking over
    /// sends its first request at once).
    pub fn sink_requests_allowed(&self) -> Option<usize> {
        let (_, secs) = self.sink_requests_after_first_second?;
        Some((2.0 * secs + 1.0).floor() as usize + self.relay_kills_while_counted)
    }
}

/// Seconds after a fault's end during which it still counts as overlapping.
pub const SETTLE: f64 = 2.0;

/// Everything the run observed.
pub struct Observed {
    /// The schedule.
    pub schedule: Schedule,
    /// One per scheduled fault.
    pub outcomes: Vec<FaultOutcome>,
    /// Every request the sink answered.
    pub sink: Vec<SinkRecord>,
    /// Requests that reached the sink, answered or not.
    pub sink_arrivals: usize,
    /// The HTTP load.
    pub http: HttpTally,
    /// The SQL producers.
    pub sql: SqlTally,
    /// `(event id, order id)` of every committed outbox row.
    pub outbox: Vec<(Uuid, Uuid)>,
    /// `(order id, commit time)` of every committed order.
    pub orders: Vec<(Uuid, Option<f64>)>,
    /// `(order id, commit time)` of every invoice.
    pub invoices: Vec<(Uuid, Option<f64>)>,
    /// Billing's inbox.
    pub processed: Vec<Uuid>,
    /// Rows in the relay's dead-letter table.
    pub dead_lettered: usize,
    /// `(t, bytes)` slot lag samples.
    pub lag: Vec<(f64, u64)>,
    /// Seconds the drain took (None: it did not finish within the bound).
    pub drain: Option<f64>,
    /// Relays, Orders or Billing that exited without being killed.
    pub unexpected_exits: Vec<String>,
}

/// The five figures that must be zero.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct LedgerFigures {
    /// Committed outbox events.
    pub committed_events: usize,
    /// Invoices.
    pub invoices: usize,
    /// Committed outbox events without an inbox row or without an invoice.
    pub lost: usize,
    /// Orders with more than one invoice.
    pub duplicate_effects: usize,
    /// Inbox rows or invoices for events that never committed, and
    /// rolled-back events the relay sent at all.
    pub phantom: usize,
    /// Rows in the dead-letter table.
    pub dead_lettered: usize,
    /// Orders answered 201 whose event is not in the outbox.
    pub accepted_not_committed: usize,
    /// SQL transactions whose COMMIT returned OK but whose events are missing.
    pub sql_committed_missing: usize,
}

impl LedgerFigures {
    /// Whether every must-be-zero figure is zero.
    pub fn is_clean(&self) -> bool {
        self.lost == 0
            && self.duplicate_effects == 0
            && self.phantom == 0
            && self.dead_lettered == 0
            && self.accepted_not_committed == 0
            && self.sql_committed_missing == 0
            && self.invoices == self.committed_events
    }
}

/// Summary statistics of a set of seconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Stats {
    /// Values.
    pub n: usize,
    /// Median.
    pub p50: Option<f64>,
    /// Largest.
    pub max: Option<f64>,
}

impl Stats {
    pub(crate) fn of(mut v: Vec<f64>) -> Stats {
        v.sort_by(f64::total_cmp);
        Stats {
            n: v.len(),
            p50: percentile(&v, 0.5),
            max: v.last().copied(),
        }
    }
}

/// Per fault kind.
#[derive(Debug, Clone, Serialize)]
pub struct KindFigures {
    /// The kind.
    pub kind: FaultKind,
    /// Occurrences.
    pub count: usize,
    /// Of which overlapped another fault (left out of the statistics).
    pub overlapped: usize,
    /// Fault end → next 2xx.
    pub first_2xx_after: Stats,
    /// Fault end → everything committed before it invoiced.
    pub caught_up_after: Stats,
    /// Redelivered requests, total over this kind's windows.
    pub redelivered: usize,
    /// Faults against Billing: the highest rate of requests reaching it
    /// after the fault's first second, requests per second, over every
    /// fault of the kind (those with a relay kill inside included).
    pub sink_rps_after_first_second_max: Option<f64>,
}

/// The reported figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Figures {
    /// Requests the sink answered.
    pub sink_requests: usize,
    /// Requests that reached the sink (answered or not).
    pub sink_arrivals: usize,
    /// 2xx answers.
    pub sink_2xx: usize,
    /// 2xx answers for an event that had one already.
    pub redelivered_total: usize,
    /// Redelivered requests after each relay kill, in order.
    pub redelivered_per_relay_kill: Vec<usize>,
    /// Their mean.
    pub redelivered_per_relay_kill_mean: f64,
    /// Mean over the kills that overlapped no other fault.
    pub redelivered_per_isolated_relay_kill_mean: Option<f64>,
    /// Largest over those.
    pub redelivered_per_isolated_relay_kill_max: Option<usize>,
    /// Relay kill → another relay holds the slot.
    pub takeover: Stats,
    /// Requests per second reaching Billing's front while Billing was killed.
    pub rps_while_billing_killed: Option<f64>,
    /// Requests per second reaching Billing's front during 503 bursts.
    pub rps_during_503: Option<f64>,
    /// The highest per-window rate during a 503 burst.
    pub rps_during_503_max_window: Option<f64>,
    /// Order commit → invoice commit, milliseconds: p50.
    pub latency_p50_ms: Option<f64>,
    /// p99.
    pub latency_p99_ms: Option<f64>,
    /// Largest.
    pub latency_max_ms: Option<f64>,
    /// Peak `pg_current_wal_lsn() - confirmed_flush_lsn`, bytes.
    pub peak_slot_lag_bytes: u64,
    /// When it peaked.
    pub peak_slot_lag_at: Option<f64>,
    /// Seconds from the end of the load to a clean ledger.
    pub drain: Option<f64>,
}

/// What the load did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LoadFigures {
    /// Orders posted through the API.
    pub http_posted: usize,
    /// Answered 201.
    pub http_accepted: usize,
    /// Failed (status, timeout, connection error, shed).
    pub http_failed: usize,
    /// Failures by kind.
    pub http_failures_by_kind: BTreeMap<String, usize>,
    /// SQL transactions committed (multi-row and savepoint).
    pub sql_committed_tx: usize,
    /// Events they committed.
    pub sql_committed_events: usize,
    /// Transactions rolled back on purpose.
    pub sql_rolled_back_tx: usize,
    /// Transactions with a savepoint rollback.
    pub sql_savepoint_tx: usize,
    /// Transactions whose outcome is unknown (connection lost).
    pub sql_unknown_tx: usize,
    /// Rolled-back event ids (phantom candidates).
    pub phantom_candidates: usize,
}

/// The whole report (also the JSON file).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Which run: `full` or `ci`.
    pub label: String,
    /// The seed.
    pub seed: u64,
    /// Orders per second offered through the API.
    pub rate: u32,
    /// Whether PostgreSQL ran with fsync on.
    pub fsync: bool,
    /// `debug` or `release` binaries.
    pub profile: String,
    /// Length of the fault phase, seconds.
    pub fault_phase_s: f64,
    /// Wall time of the whole run, seconds.
    pub wall_s: f64,
    /// Unix time of `t = 0`.
    pub started_unix: f64,
    /// The must-be-zero figures.
    pub ledger: LedgerFigures,
    /// Whether Billing sent its `Idempotency-Key` (`false`: the comparison
    /// run).
    pub idempotency_key: bool,
    /// The provider's charges per order (double charges and uncharged
    /// invoices must be 0).
    pub charges: Charges,
    /// The measured figures.
    pub figures: Figures,
    /// Per fault kind.
    pub by_kind: Vec<KindFigures>,
    /// What the load did.
    pub load: LoadFigures,
    /// Every fault.
    pub faults: Vec<FaultOutcome>,
    /// Processes that exited without being killed.
    pub unexpected_exits: Vec<String>,
    /// Where the process logs were copied, if anywhere.
    pub logs: Option<String>,
}

impl Report {
    /// Whether the ledger is clean, every order was charged exactly once,
    /// and the drain finished.
    pub fn passed(&self) -> bool {
        self.ledger.is_clean() && self.charges.is_clean() && self.figures.drain.is_some()
    }
}

/// Computes the ledger and the figures.
pub fn analyse(
    mut obs: Observed,
) -> (
    LedgerFigures,
    Figures,
    Vec<KindFigures>,
    LoadFigures,
    Vec<FaultOutcome>,
) {
    obs.sink.sort_by(|a, b| a.t.total_cmp(&b.t));
    let outbox_ids: HashSet<Uuid> = obs.outbox.iter().map(|(e, _)| *e).collect();
    let order_ids: HashSet<Uuid> = obs.orders.iter().map(|(o, _)| *o).collect();
    let processed: HashSet<Uuid> = obs.processed.iter().copied().collect();
    let mut invoice_count: HashMap<Uuid, usize> = HashMap::new();
    for (o, _) in &obs.invoices {
        *invoice_count.entry(*o).or_insert(0) += 1;
    }
    let candidates: HashSet<Uuid> = obs.sql.phantom_candidates.iter().copied().collect();
    let sent_ids: HashSet<Uuid> = obs.sink.iter().filter_map(|r| r.id).collect();

    let lost = obs
        .outbox
        .iter()
        .filter(|(e, o)| !processed.contains(e) || !invoice_count.contains_key(o))
        .count();
    let mut phantom_events: HashSet<Uuid> = processed.difference(&outbox_ids).copied().collect();
    phantom_events.extend(candidates.intersection(&sent_ids));
    let phantom_invoices = invoice_count
        .keys()
        .filter(|o| !order_ids.contains(o))
        .count();
    let ledger = LedgerFigures {
        committed_events: obs.outbox.len(),
        invoices: obs.invoices.len(),
        lost,
        duplicate_effects: invoice_count.values().filter(|&&n| n > 1).count(),
        phantom: phantom_events.len() + phantom_invoices,
        dead_lettered: obs.dead_lettered,
        accepted_not_committed: obs
            .http
            .accepted
            .iter()
            .filter(|(e, o, _)| !outbox_ids.contains(e) || !order_ids.contains(o))
            .count(),
        sql_committed_missing: obs
            .sql
            .committed_events
            .iter()
            .filter(|e| !outbox_ids.contains(e))
            .count(),
    };

    // Redeliveries, attributed to the latest fault started before them.
    let mut outcomes = obs.outcomes;
    outcomes.sort_by(|a, b| a.started.total_cmp(&b.started));
    let windows: Vec<(usize, f64, f64)> = outcomes
        .iter()
        .map(|o| (o.fault.n, o.started, o.ended))
        .collect();
    let kills_at: Vec<f64> = outcomes
        .iter()
        .filter(|o| o.fault.kind == FaultKind::RelayKill)
        .map(|o| o.started)
        .collect();
    for o in &mut outcomes {
        o.overlapped = windows
            .iter()
            .any(|&(n, s, e)| n != o.fault.n && s <= o.ended && e + SETTLE >= o.started);
        if let Some((_, secs)) = o.sink_requests_after_first_second {
            // The counted span ends when the fault was lifted.
            let from = o.ended - secs;
            o.relay_kills_while_counted = kills_at
                .iter()
                .filter(|&&t| t >= from && t <= o.ended)
                .count();
        }
    }
    let mut seen = HashSet::new();
    let mut redelivered_total = 0;
    let mut sink_2xx = 0;
    for r in &obs.sink {
        if !(200..300).contains(&r.status) {
            continue;
        }
        sink_2xx += 1;
        let Some(id) = r.id else { continue };
        if seen.insert(id) {
            continue;
        }
        redelivered_total += 1;
        let idx = outcomes.partition_point(|o| o.started <= r.t);
        if idx > 0 {
            outcomes[idx - 1].redelivered += 1;
        }
    }

    // Caught up: prefix maximum of invoice commit times over orders by commit time.
    let invoice_at: HashMap<Uuid, f64> = obs
        .invoices
        .iter()
        .filter_map(|(o, t)| Some((*o, (*t)?)))
        .collect();
    let mut by_commit: Vec<(f64, f64)> = obs
        .orders
        .iter()
        .filter_map(|(o, t)| Some(((*t)?, *invoice_at.get(o)?)))
        .collect();
    by_commit.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut prefix_max = Vec::with_capacity(by_commit.len());
    let mut m = f64::NEG_INFINITY;
    for (_, inv) in &by_commit {
        m = m.max(*inv);
        prefix_max.push(m);
    }
    let mut latencies: Vec<f64> = by_commit.iter().map(|(o, i)| (i - o) * 1000.0).collect();
    latencies.sort_by(f64::total_cmp);

    for o in &mut outcomes {
        let from = match (o.fault.kind, o.takeover) {
            (FaultKind::RelayKill, Some(tk)) => o.started + tk,
            _ => o.ended,
        };
        let first = obs
            .sink
            .iter()
            .find(|r| r.t >= from && (200..300).contains(&r.status));
        o.first_2xx_after = first.map(|r| r.t - o.ended);
        let n = by_commit.partition_point(|(c, _)| *c <= o.ended);
        o.caught_up_after = (n > 0).then(|| (prefix_max[n - 1] - o.ended).max(0.0));
        o.sink_requests_during = obs
            .sink
            .iter()
            .filter(|r| r.t >= o.started && r.t <= o.ended)
            .count();
    }

    let rate_over = |kind: FaultKind| {
        let windows: Vec<&FaultOutcome> = outcomes
            .iter()
            .filter(|o| o.fault.kind == kind && o.ended > o.started)
            .collect();
        let secs: f64 = windows.iter().map(|o| o.ended - o.started).sum();
        let reqs: usize = windows.iter().map(|o| o.sink_requests_during).sum();
        let max = windows
            .iter()
            .map(|o| o.sink_requests_during as f64 / (o.ended - o.started))
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
        ((secs > 0.0).then(|| reqs as f64 / secs), max)
    };
    let kills: Vec<&FaultOutcome> = outcomes
        .iter()
        .filter(|o| o.fault.kind == FaultKind::RelayKill)
        .collect();
    let per_kill: Vec<usize> = kills.iter().map(|o| o.redelivered).collect();
    let isolated: Vec<usize> = kills
        .iter()
        .filter(|o| !o.overlapped)
        .map(|o| o.redelivered)
        .collect();
    let (peak_lag, peak_at) = obs
        .lag
        .iter()
        .max_by_key(|(_, l)| *l)
        .map_or((0, None), |(t, l)| (*l, Some(*t)));
    let figures = Figures {
        sink_requests: obs.sink.len(),
        sink_arrivals: obs.sink_arrivals,
        sink_2xx,
        redelivered_total,
        redelivered_per_relay_kill_mean: if per_kill.is_empty() {
            0.0
        } else {
            per_kill.iter().sum::<usize>() as f64 / per_kill.len() as f64
        },
        redelivered_per_relay_kill: per_kill,
        redelivered_per_isolated_relay_kill_mean: (!isolated.is_empty())
            .then(|| isolated.iter().sum::<usize>() as f64 / isolated.len() as f64),
        redelivered_per_isolated_relay_kill_max: isolated.iter().max().copied(),
        takeover: Stats::of(kills.iter().filter_map(|o| o.takeover).collect()),
        rps_while_billing_killed: rate_over(FaultKind::BillingKill).0,
        rps_during_503: rate_over(FaultKind::Billing503).0,
        rps_during_503_max_window: rate_over(FaultKind::Billing503).1,
        latency_p50_ms: percentile(&latencies, 0.5),
        latency_p99_ms: percentile(&latencies, 0.99),
        latency_max_ms: latencies.last().copied(),
        peak_slot_lag_bytes: peak_lag,
        peak_slot_lag_at: peak_at,
        drain: obs.drain,
    };
    let by_kind = FaultKind::ALL
        .iter()
        .map(|&kind| {
            let all: Vec<&FaultOutcome> =
                outcomes.iter().filter(|o| o.fault.kind == kind).collect();
            let of: Vec<&FaultOutcome> = all.iter().copied().filter(|o| !o.overlapped).collect();
            KindFigures {
                kind,
                count: all.len(),
                overlapped: all.len() - of.len(),
                first_2xx_after: Stats::of(of.iter().filter_map(|o| o.first_2xx_after).collect()),
                caught_up_after: Stats::of(of.iter().filter_map(|o| o.caught_up_after).collect()),
                redelivered: all.iter().map(|o| o.redelivered).sum(),
                sink_rps_after_first_second_max: all
                    .iter()
                    .filter_map(|o| o.sink_requests_after_first_second)
                    .filter(|&(_, secs)| secs > 0.0)
                    .map(|(n, secs)| n as f64 / secs)
                    .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v)))),
            }
        })
        .collect();
    let load = LoadFigures {
        http_posted: obs.http.posted,
        http_accepted: obs.http.accepted.len(),
        http_failed: obs.http.failures.len(),
        http_failures_by_kind: obs.http.failures_by_kind(),
        sql_committed_tx: obs.sql.committed_tx,
        sql_committed_events: obs.sql.committed_events.len(),
        sql_rolled_back_tx: obs.sql.rolled_back_tx,
        sql_savepoint_tx: obs.sql.savepoint_tx,
        sql_unknown_tx: obs.sql.unknown_tx,
        phantom_candidates: obs.sql.phantom_candidates.len(),
    };
    outcomes.sort_by_key(|o| o.fault.n);
    (ledger, figures, by_kind, load, outcomes)
}

fn secs(v: Option<f64>) -> String {
    v.map_or_else(|| "–".to_owned(), |s| format!("{s:.2} s"))
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "–".to_owned(), |s| format!("{s:.0} ms"))
}

fn verdict(n: usize) -> String {
    if n == 0 {
        "0 ✔".to_owned()
    } else {
        format!("{n} ✘")
    }
}

impl Report {
    /// The Markdown table: the ledger, the figures, then one row per fault kind.
    pub fn table(&self) -> String {
        let l = &self.ledger;
        let f = &self.figures;
        let d = &self.load;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "Chaos run `{}`: seed {}, {:.0} s of faults ({} faults), {} orders/s through the API, fsync {}, {} build, {:.0} s wall.\n",
            self.label,
            self.seed,
            self.fault_phase_s,
            self.faults.len(),
            self.rate,
            if self.fsync { "on" } else { "off" },
            self.profile,
            self.wall_s
        );
        let _ = writeln!(s, "| ledger (must be 0) | count |\n|---|---:|");
        let _ = writeln!(
            s,
            "| lost (committed events without an invoice) | {} |",
            verdict(l.lost)
        );
        let _ = writeln!(
            s,
            "| duplicate effects (orders with >1 invoice) | {} |",
            verdict(l.duplicate_effects)
        );
        let _ = writeln!(
            s,
            "| phantom (invoices/inbox rows/requests for uncommitted events) | {} |",
            verdict(l.phantom)
        );
        let _ = writeln!(s, "| dead-lettered | {} |", verdict(l.dead_lettered));
        let _ = writeln!(
            s,
            "| accepted (201) but not committed | {} |",
            verdict(l.accepted_not_committed)
        );
        let _ = writeln!(
            s,
            "| SQL COMMIT ok but not committed | {} |",
            verdict(l.sql_committed_missing)
        );
        let _ = writeln!(
            s,
            "| committed events / invoices | {} / {} |",
            l.committed_events, l.invoices
        );
        let c = &self.charges;
        let _ = writeln!(
            s,
            "| double charges (orders charged twice or more{}) | {} |",
            if self.idempotency_key {
                ""
            } else {
                "; Idempotency-Key OFF, the comparison run"
            },
            verdict(c.twice)
        );
        let _ = writeln!(
            s,
            "| invoices never charged / not recorded `charged` | {} / {} |",
            verdict(c.never),
            verdict(c.invoices - c.by_status.get("charged").copied().unwrap_or(0))
        );
        let _ = writeln!(
            s,
            "| charges for no invoice / recorded with another charge id | {} / {} |",
            verdict(c.orphan),
            verdict(c.mismatched)
        );
        let _ = writeln!(
            s,
            "| charges / orders charged once / extra charges | {} / {} / {} |\n",
            c.charges, c.once, c.extra_charges
        );
        let _ = writeln!(s, "| figure | value |\n|---|---:|");
        let _ = writeln!(
            s,
            "| orders posted / 201 / failed | {} / {} / {} {:?} |",
            d.http_posted, d.http_accepted, d.http_failed, d.http_failures_by_kind
        );
        let _ = writeln!(
            s,
            "| SQL tx committed (events) / rolled back / savepoint rollbacks / unknown | {} ({}) / {} / {} / {} |",
            d.sql_committed_tx,
            d.sql_committed_events,
            d.sql_rolled_back_tx,
            d.sql_savepoint_tx,
            d.sql_unknown_tx
        );
        let _ = writeln!(
            s,
            "| phantom candidates (rolled-back event ids) | {} |",
            d.phantom_candidates
        );
        let _ = writeln!(
            s,
            "| requests to Billing's front (answered) / 2xx / redelivered | {} ({}) / {} / {} |",
            f.sink_arrivals, f.sink_requests, f.sink_2xx, f.redelivered_total
        );
        let _ = writeln!(
            s,
            "| redelivered requests per relay kill: mean / max ({} kills) | {:.1} / {} |",
            f.redelivered_per_relay_kill.len(),
            f.redelivered_per_relay_kill_mean,
            f.redelivered_per_relay_kill
                .iter()
                .max()
                .copied()
                .unwrap_or(0)
        );
        let _ = writeln!(
            s,
            "| … per relay kill that overlapped no other fault: mean / max | {} / {} |",
            f.redelivered_per_isolated_relay_kill_mean
                .map_or("–".into(), |m| format!("{m:.1}")),
            f.redelivered_per_isolated_relay_kill_max
                .map_or("–".into(), |m| m.to_string())
        );
        let _ = writeln!(
            s,
            "| relay kill → standby holds the slot: p50 / max | {} / {} |",
            secs(f.takeover.p50),
            secs(f.takeover.max)
        );
        let rps = |v: Option<f64>| v.map_or_else(|| "–".to_owned(), |r| format!("{r:.1}/s"));
        let _ = writeln!(
            s,
            "| requests/s to Billing while killed / during 503 bursts (worst burst) | {} / {} ({}) |",
            rps(f.rps_while_billing_killed),
            rps(f.rps_during_503),
            rps(f.rps_during_503_max_window)
        );
        let _ = writeln!(
            s,
            "| order commit → invoice commit: p50 / p99 / max | {} / {} / {} |",
            ms(f.latency_p50_ms),
            ms(f.latency_p99_ms),
            ms(f.latency_max_ms)
        );
        let _ = writeln!(
            s,
            "| peak slot lag | {:.1} MiB at t={} |",
            f.peak_slot_lag_bytes as f64 / 1048576.0,
            f.peak_slot_lag_at
                .map_or("–".into(), |t| format!("{t:.0} s"))
        );
        let _ = writeln!(s, "| drain after the load stopped | {} |\n", secs(f.drain));
        let _ = writeln!(
            s,
            "Per-kind times leave out faults that overlapped another one (or began within {SETTLE:.0} s of its end); the requests/s column does not; every fault is in the JSON file."
        );
        let _ = writeln!(
            s,
            "\n| fault | n (overlapped) | fault end → next 2xx: p50 / max | fault end → backlog invoiced: p50 / max | redelivered after it | requests/s to Billing after the fault's first second: max |\n|---|---:|---:|---:|---:|---:|"
        );
        for k in &self.by_kind {
            let _ = writeln!(
                s,
                "| {} | {} ({}) | {} / {} | {} / {} | {} | {} |",
                k.kind,
                k.count,
                k.overlapped,
                secs(k.first_2xx_after.p50),
                secs(k.first_2xx_after.max),
                secs(k.caught_up_after.p50),
                secs(k.caught_up_after.max),
                k.redelivered,
                k.sink_rps_after_first_second_max
                    .map_or_else(|| "–".to_owned(), |r| format!("{r:.1}/s"))
            );
        }
        if !self.unexpected_exits.is_empty() {
            let _ = writeln!(s, "\nunexpected exits: {:?}", self.unexpected_exits);
        }
        s
    }
}
