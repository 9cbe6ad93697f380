//! The shard chaos run (issue 16): N hash shards streamed by a pool of
//! relays, a random relay SIGKILLed at a fixed interval and restarted, under
//! orders through the Orders API and a producer of several events per
//! aggregate; then the ledger, the per-aggregate order as Billing received
//! it, and how long each kill left a shard without a holder.
//!
//! ```text
//!  load (HTTP, fixed rate) ──▶ Orders ──┐
//!  SeqLoad (k events per aggregate) ────┤
//!                                       ▼
//!       PostgreSQL: setup --shards N (N publications, N slots)
//!                                       ▲
//!   relay 1 ─┬─ run --shards N --max-shards N   (every kill_every: a random
//!   relay 2 ─┘                                   relay SIGKILLed, restarted)
//!        │
//!        ▼
//!  ScriptedSink (records every arrival) ──▶ Billing
//! ```
//!
//! Each relay may hold every shard, so the survivor takes the killed one's
//! shards while it restarts; the restarted relay waits as a hot standby.
//! Takeover after a kill is the time from the SIGKILL until every shard's
//! slot is active again under another relay (`pg_replication_slots` joined
//! to `pg_stat_replication` by the walsender pid: each relay has its own
//! `application_name`). A kill of a relay that held no shard takes nothing
//! over; it is reported apart.
//!
//! Order: an event is a violation when Billing's door (the sink in front of
//! it) first received it after a later event of its aggregate; a
//! redelivery of an event already received is not (at-least-once).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use uuid::Uuid;

use super::Relay;
use super::load::{HttpLoad, HttpTally, SeqLoad, SeqTally};
use super::report::{LedgerFigures, Stats};
use crate::app::{self, TEST_SECRET};
use crate::sink::ScriptedSink;
use crate::{ClusterOptions, PgCluster, ServiceProcess, Stack, wait_until};

/// How a shard chaos run is set up.
#[derive(Debug, Clone)]
pub struct ShardConfig {
    /// `full` or `ci`, for the report.
    pub label: String,
    /// Seeds the choice of victims.
    pub seed: u64,
    /// Length of the kill phase.
    pub duration: Duration,
    /// One relay SIGKILLed every this long.
    pub kill_every: Duration,
    /// `--shards`.
    pub shards: u32,
    /// Relay processes, each `--max-shards shards`.
    pub relays: usize,
    /// Orders per second through the Orders API.
    pub rate: u32,
    /// New aggregates per second of the sequenced producer.
    pub aggregates_per_sec: f64,
    /// Events per aggregate, each in its own transaction.
    pub events_per_aggregate: u32,
    /// PostgreSQL `fsync`.
    pub fsync: bool,
    /// Bound on the drain after the load stops.
    pub drain_timeout: Duration,
    /// Takeover the run is held to (seconds).
    pub takeover_bound: f64,
    /// Copy every process log here at the end; when `None`, only if the
    /// run did not pass.
    pub keep_logs: Option<PathBuf>,
}

impl ShardConfig {
    /// Issue 16's run: 4 shards × 2 relays, a kill every 10 s for
    /// `duration`, `rate` orders/s plus 10 aggregates/s of 5 events, fsync on.
    pub fn full(seed: u64, duration: Duration, rate: u32) -> ShardConfig {
        ShardConfig {
            label: "full".into(),
            seed,
            duration,
            kill_every: Duration::from_secs(10),
            shards: 4,
            relays: 2,
            rate,
            aggregates_per_sec: 10.0,
            events_per_aggregate: 5,
            fsync: true,
            drain_timeout: Duration::from_secs(300),
            takeover_bound: 5.0,
            keep_logs: None,
        }
    }

    /// The CI variant: the same shape over 90 s at 50 orders/s plus 5
    /// aggregates/s of 5 events, fsync off.
    pub fn ci(seed: u64) -> ShardConfig {
        ShardConfig {
            label: "ci".into(),
            duration: Duration::from_secs(90),
            rate: 50,
            aggregates_per_sec: 5.0,
            fsync: false,
            drain_timeout: Duration::from_secs(90),
            ..ShardConfig::full(seed, Duration::ZERO, 0)
        }
    }
}

/// Bound on waiting for the shards to be held again after a kill.
const TAKEOVER_WAIT: Duration = Duration::from_secs(60);

/// How one kill went.
#[derive(Debug, Clone, Serialize)]
pub struct KillOutcome {
    /// 0-based.
    pub n: usize,
    /// When (seconds from t = 0).
    pub at: f64,
    /// The relay killed.
    pub victim: String,
    /// Shards it streamed when it was killed.
    pub victim_held: usize,
    /// Seconds from the SIGKILL until every shard was streamed by another
    /// relay (None: not within 60 s).
    pub takeover: Option<f64>,
    /// 2xx at the sink for events that had one already, from this kill to
    /// the next.
    pub redelivered: usize,
    /// A problem while applying it.
    pub note: Option<String>,
}

/// Per-aggregate order on Billing's received sequence.
#[derive(Debug, Clone, Default, Serialize)]
pub struct OrderFigures {
    /// Aggregates of the sequenced producer with at least one event.
    pub aggregates: usize,
    /// Their events.
    pub events: usize,
    /// Events first received after a later event of their aggregate.
    pub violations: usize,
    /// The first few, described.
    pub examples: Vec<String>,
    /// Events of those aggregates received more than once.
    pub redelivered: usize,
}

/// What the load did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ShardLoad {
    /// Orders posted through the API.
    pub http_posted: usize,
    /// Answered 201.
    pub http_accepted: usize,
    /// Failed.
    pub http_failed: usize,
    /// Aggregates the sequenced producer began.
    pub seq_aggregates: usize,
    /// Its committed events.
    pub seq_events: usize,
    /// Its transactions with an unknown outcome.
    pub seq_unknown_tx: usize,
}

/// The report (also the JSON file).
#[derive(Debug, Clone, Serialize)]
pub struct ShardReport {
    /// `full` or `ci`.
    pub label: String,
    /// The seed.
    pub seed: u64,
    /// `--shards`.
    pub shards: u32,
    /// Relay processes.
    pub relays: usize,
    /// Orders per second offered.
    pub rate: u32,
    /// fsync on.
    pub fsync: bool,
    /// `debug` or `release`.
    pub profile: String,
    /// Length of the kill phase, seconds.
    pub kill_phase_s: f64,
    /// Wall time, seconds.
    pub wall_s: f64,
    /// Unix time of t = 0.
    pub started_unix: f64,
    /// The must-be-zero figures.
    pub ledger: LedgerFigures,
    /// Per-aggregate order.
    pub order: OrderFigures,
    /// Requests the sink answered.
    pub sink_requests: usize,
    /// 2xx for an event that had one already (duplicates the inbox absorbed).
    pub redelivered_total: usize,
    /// Takeover over every kill of a relay that held a shard.
    pub takeover: Stats,
    /// The bound takeovers are held to.
    pub takeover_bound: f64,
    /// Seconds from the end of the load to a clean ledger.
    pub drain: Option<f64>,
    /// What the load did.
    pub load: ShardLoad,
    /// Every kill.
    pub kills: Vec<KillOutcome>,
    /// Relays that exited without being killed.
    pub unexpected_exits: Vec<String>,
    /// Where the logs were copied.
    pub logs: Option<String>,
}

impl ShardReport {
    /// Ledger clean, drained, no order violation, every takeover within
    /// the bound, no relay exiting on its own.
    pub fn passed(&self) -> bool {
        self.ledger.is_clean()
            && self.drain.is_some()
            && self.order.violations == 0
            && self
                .kills
                .iter()
                .all(|k| k.takeover.is_some_and(|t| t <= self.takeover_bound))
            && self.unexpected_exits.is_empty()
    }

    /// The human-readable summary.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let l = &self.ledger;
        let f = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2}"));
        let _ = writeln!(
            s,
            "shard chaos ({}, seed {}, {} build): {} shards × {} relays, {} orders/s, fsync {}, {:.0} s of kills, {:.0} s wall",
            self.label,
            self.seed,
            self.profile,
            self.shards,
            self.relays,
            self.rate,
            if self.fsync { "on" } else { "off" },
            self.kill_phase_s,
            self.wall_s
        );
        let _ = writeln!(
            s,
            "ledger       committed {} invoices {}: lost {}, duplicate effects {}, phantom {}, dead-lettered {}, 201-not-committed {}, SQL-commit-missing {}",
            l.committed_events,
            l.invoices,
            l.lost,
            l.duplicate_effects,
            l.phantom,
            l.dead_lettered,
            l.accepted_not_committed,
            l.sql_committed_missing
        );
        let _ = writeln!(
            s,
            "duplicates   {} redelivered 2xx of {} sink requests (absorbed by Billing's inbox)",
            self.redelivered_total, self.sink_requests
        );
        let o = &self.order;
        let _ = writeln!(
            s,
            "order        {} aggregates, {} sequenced events: {} violations on Billing's received sequence ({} of those events received more than once)",
            o.aggregates, o.events, o.violations, o.redelivered
        );
        for e in &o.examples {
            let _ = writeln!(s, "               {e}");
        }
        let holders: Vec<&KillOutcome> = self.kills.iter().filter(|k| k.victim_held > 0).collect();
        let _ = writeln!(
            s,
            "takeover     {} kills ({} of a relay holding shards): kill → all {} slots active again p50 {} s, max {} s (bound {} s); kills of an idle relay max {} s",
            self.kills.len(),
            holders.len(),
            self.shards,
            f(self.takeover.p50),
            f(self.takeover.max),
            self.takeover_bound,
            f(self
                .kills
                .iter()
                .filter(|k| k.victim_held == 0)
                .filter_map(|k| k.takeover)
                .reduce(f64::max)),
        );
        let _ = writeln!(
            s,
            "load         {} orders posted, {} accepted, {} failed; {} aggregates / {} sequenced events committed ({} unknown)",
            self.load.http_posted,
            self.load.http_accepted,
            self.load.http_failed,
            self.load.seq_aggregates,
            self.load.seq_events,
            self.load.seq_unknown_tx
        );
        let _ = writeln!(
            s,
            "drain        {}",
            self.drain
                .map_or("NOT FINISHED".to_owned(), |d| format!("{d:.1} s"))
        );
        for k in &self.kills {
            let _ = writeln!(
                s,
                "  kill #{:<3} t={:7.2}s {:<22} held {} → takeover {} s, {} redelivered{}",
                k.n,
                k.at,
                k.victim,
                k.victim_held,
                f(k.takeover),
                k.redelivered,
                k.note
                    .as_deref()
                    .map_or(String::new(), |n| format!(" ({n})"))
            );
        }
        for e in &self.unexpected_exits {
            let _ = writeln!(s, "UNEXPECTED EXIT {e}");
        }
        s
    }
}

/// The relays and what they share.
struct Fleet {
    stack: Stack,
    cfg: ShardConfig,
    sink_url: String,
    slots: Vec<String>,
    relays: Vec<Relay>,
    next: usize,
    dead: Vec<(String, ServiceProcess)>,
    unexpected_exits: Vec<String>,
}

impl Fleet {
    async fn spawn(&mut self) -> anyhow::Result<Relay> {
        self.next += 1;
        let name = format!("shard-relay-{}", self.next);
        spawn_relay(&self.stack, &self.cfg, &self.sink_url, name).await
    }

    /// Each shard's holder (`application_name`), in shard order.
    async fn holders(&self, db: &tokio_postgres::Client) -> anyhow::Result<Vec<Option<String>>> {
        let rows = db
            .query(
                "SELECT r.application_name FROM pg_replication_slots s \
                 LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid \
                 WHERE s.slot_name = ANY($1) ORDER BY s.slot_name",
                &[&self.slots],
            )
            .await?;
        anyhow::ensure!(rows.len() == self.slots.len(), "a shard slot is missing");
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Kills relay `i`, restarts one in its place and measures the takeover.
    async fn kill(&mut self, i: usize, n: usize, at: f64) -> anyhow::Result<KillOutcome> {
        let db = self.stack.orders_admin().await?;
        let mut victim = self.relays.remove(i);
        let held = self
            .holders(&db)
            .await?
            .iter()
            .filter(|h| h.as_deref() == Some(victim.name.as_str()))
            .count();
        victim.running.process.sigkill();
        let killed = Instant::now();
        let mut out = KillOutcome {
            n,
            at,
            victim: victim.name.clone(),
            victim_held: held,
            takeover: None,
            redelivered: 0,
            note: None,
        };
        let victim_name = victim.name.clone();
        self.dead.push((victim.name, victim.running.process));
        self.next += 1;
        let name = format!("shard-relay-{}", self.next);
        let takeover = async {
            while killed.elapsed() < TAKEOVER_WAIT {
                if let Ok(h) = self.holders(&db).await
                    && h.iter()
                        .all(|h| h.as_ref().is_some_and(|h| *h != victim_name))
                {
                    return Some(killed.elapsed().as_secs_f64());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            None
        };
        let (spawned, taken) = tokio::join!(
            spawn_relay(&self.stack, &self.cfg, &self.sink_url, name),
            takeover
        );
        out.takeover = taken;
        match spawned {
            Ok(r) => self.relays.push(r),
            Err(err) => out.note = Some(format!("restart failed: {err:#}")),
        }
        if taken.is_none() {
            out.note = Some(format!(
                "the shards were not all held again within {TAKEOVER_WAIT:?}"
            ));
        }
        Ok(out)
    }

    /// Replaces relays that exited on their own (a finding).
    async fn check_relays(&mut self, now: f64) {
        let mut i = 0;
        while i < self.relays.len() {
            if let Ok(status) = self.relays[i]
                .running
                .process
                .wait_exit(Duration::ZERO)
                .await
            {
                let r = self.relays.remove(i);
                let msg = format!("{} exited on its own ({status}) at t={now:.1}s", r.name);
                eprintln!("shard chaos: {msg}");
                self.unexpected_exits.push(msg);
                self.dead.push((r.name, r.running.process));
                match self.spawn().await {
                    Ok(new) => self.relays.push(new),
                    Err(err) => eprintln!("shard chaos: could not replace it: {err:#}"),
                }
                continue;
            }
            i += 1;
        }
    }
}

async fn spawn_relay(
    stack: &Stack,
    cfg: &ShardConfig,
    sink_url: &str,
    name: String,
) -> anyhow::Result<Relay> {
    let shards = cfg.shards.to_string();
    let extra = ["--shards", &shards, "--max-shards", &shards];
    super::spawn_relay(stack, &stack.relay_url, sink_url, name, "3s", &extra).await
}

/// Runs the whole thing; errors only when the stack cannot be set up.
pub async fn run(cfg: &ShardConfig) -> anyhow::Result<ShardReport> {
    let wall = Instant::now();
    eprintln!(
        "shard chaos: seed {} (rerun with --seed {}); {} shards × {} relays, a kill every {:?} for {:?}, {} orders/s + {} aggregates/s × {} events, fsync {}",
        cfg.seed,
        cfg.seed,
        cfg.shards,
        cfg.relays,
        cfg.kill_every,
        cfg.duration,
        cfg.rate,
        cfg.aggregates_per_sec,
        cfg.events_per_aggregate,
        if cfg.fsync { "on" } else { "off" }
    );
    let opts = ClusterOptions {
        fsync: cfg.fsync,
        wal_sender_timeout: "5s".into(),
        max_slot_wal_keep_size: None,
        extra_settings: Vec::new(),
    };
    let cluster = tokio::task::spawn_blocking(move || PgCluster::start(opts))
        .await?
        .context("starting the shard chaos cluster")?;
    let stack = cluster.create_stack().await?;
    let shards = cfg.shards.to_string();
    let setup = app::relay_command(
        &stack,
        &stack.orders_admin_url,
        &["--shards", &shards, "setup"],
        &[],
    )
    .await?;
    anyhow::ensure!(setup.success(), "setup --shards failed:\n{}", setup.text());
    let billing = app::start_billing(&stack, TEST_SECRET).await?;
    let sink = ScriptedSink::proxy(&billing.inbox()).await?;
    let orders = app::start_orders(&stack).await?;
    let slots = (0..cfg.shards)
        .map(|k| format!("{}_{k}of{}", stack.slot, cfg.shards))
        .collect();
    let mut fleet = Fleet {
        stack: stack.clone(),
        cfg: cfg.clone(),
        sink_url: sink.url.clone(),
        slots,
        relays: Vec::new(),
        next: 0,
        dead: Vec::new(),
        unexpected_exits: Vec::new(),
    };
    // All relays at once: the first claims split the shards among them.
    for _ in 0..cfg.relays {
        let r = fleet.spawn().await?;
        fleet.relays.push(r);
    }
    let db = stack.orders_admin().await?;
    let streamed = wait_until("every shard streamed", Duration::from_secs(60), || async {
        fleet
            .holders(&db)
            .await
            .is_ok_and(|h| h.iter().all(Option::is_some))
    })
    .await;
    if let Err(err) = streamed {
        let logs: Vec<String> = fleet
            .relays
            .iter()
            .map(|r| format!("--- {}:\n{}", r.name, r.running.process.logs()))
            .collect();
        return Err(err.context(logs.join("\n")));
    }

    let epoch = Instant::now();
    let http = HttpLoad::start(orders.url.clone(), cfg.rate, epoch);
    let seq = SeqLoad::start(
        stack.orders_app_url.clone(),
        cfg.aggregates_per_sec,
        cfg.events_per_aggregate,
    );
    wait_until("the first deliveries", Duration::from_secs(60), || async {
        sink.delivered().len() >= 10
    })
    .await?;
    let t0 = Instant::now();
    let wall0 = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64();
    let now = || t0.elapsed().as_secs_f64();
    eprintln!(
        "shard chaos: up after {:.1}s; kills start (t = 0)",
        wall.elapsed().as_secs_f64()
    );

    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let mut kills = Vec::new();
    let mut n = 0;
    loop {
        let at = cfg.kill_every * u32::try_from(n + 1)?;
        if at > cfg.duration {
            break;
        }
        while t0.elapsed() < at {
            fleet.check_relays(now()).await;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let victim = rng.random_range(0..fleet.relays.len());
        let out = match fleet.kill(victim, n, now()).await {
            Ok(o) => o,
            Err(err) => KillOutcome {
                n,
                at: now(),
                victim: String::new(),
                victim_held: 0,
                takeover: None,
                redelivered: 0,
                note: Some(format!("{err:#}")),
            },
        };
        eprintln!(
            "shard chaos: t={:7.2}s kill #{:<3} {} (held {}) → takeover {}",
            out.at,
            n,
            out.victim,
            out.victim_held,
            out.takeover
                .map_or("NONE".to_owned(), |t| format!("{t:.2}s"))
        );
        kills.push(out);
        n += 1;
    }
    let kill_phase = now();

    let http = http.stop().await;
    let seq = seq.stop().await;
    let drain_start = Instant::now();
    eprintln!(
        "shard chaos: load stopped at t={kill_phase:.1}s; draining (bound {:?})",
        cfg.drain_timeout
    );
    let drained = wait_until(
        "every committed outbox event in Billing's inbox",
        cfg.drain_timeout,
        || async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            crate::oracle::Ledger::read(&stack)
                .await
                .is_ok_and(|l| l.lost == 0)
        },
    )
    .await;
    let drain = match drained {
        Ok(()) => Some(drain_start.elapsed().as_secs_f64()),
        Err(err) => {
            eprintln!("shard chaos: {err:#}");
            None
        }
    };
    fleet.check_relays(now()).await;

    let received: Vec<Arrival> = sink
        .received()
        .iter()
        .map(|r| Arrival {
            t: r.arrived.saturating_duration_since(t0).as_secs_f64()
                - t0.saturating_duration_since(r.arrived).as_secs_f64(),
            id: r.json()["id"].as_str().and_then(|s| s.parse().ok()),
            ok: (200..300).contains(&r.status),
        })
        .collect();
    let ledger = read_ledger(&stack, &http, &seq).await?;
    let order = order_figures(&received, &seq);
    let (redelivered_total, per_kill) = redeliveries(&received, &kills);
    for (k, r) in kills.iter_mut().zip(per_kill) {
        k.redelivered = r;
    }
    let mut report = ShardReport {
        label: cfg.label.clone(),
        seed: cfg.seed,
        shards: cfg.shards,
        relays: cfg.relays,
        rate: cfg.rate,
        fsync: cfg.fsync,
        profile: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
        .into(),
        kill_phase_s: kill_phase,
        wall_s: wall.elapsed().as_secs_f64(),
        started_unix: wall0,
        ledger,
        order,
        sink_requests: received.len(),
        redelivered_total,
        takeover: Stats::of(
            kills
                .iter()
                .filter(|k| k.victim_held > 0)
                .filter_map(|k| k.takeover)
                .collect(),
        ),
        takeover_bound: cfg.takeover_bound,
        drain,
        load: ShardLoad {
            http_posted: http.posted,
            http_accepted: http.accepted.len(),
            http_failed: http.failures.len(),
            seq_aggregates: seq.aggregates,
            seq_events: seq.committed.len(),
            seq_unknown_tx: seq.unknown_tx,
        },
        kills,
        unexpected_exits: fleet.unexpected_exits.clone(),
        logs: None,
    };
    let keep = cfg.keep_logs.clone().or_else(|| {
        (!report.passed()).then(|| {
            std::env::temp_dir().join(format!(
                "cdc-relay-shard-chaos-{}-{}",
                cfg.seed,
                std::process::id()
            ))
        })
    });
    if let Some(dir) = keep {
        match keep_logs(&fleet, &cluster, &dir) {
            Ok(()) => report.logs = Some(dir.display().to_string()),
            Err(err) => eprintln!("shard chaos: could not copy the logs: {err:#}"),
        }
    }
    for r in &mut fleet.relays {
        r.running.process.sigkill();
    }
    Ok(report)
}

/// One request at Billing's door.
struct Arrival {
    /// Arrived at (seconds from t = 0).
    t: f64,
    id: Option<Uuid>,
    ok: bool,
}

/// The ledger from both databases and what the producers were told.
async fn read_ledger(
    stack: &Stack,
    http: &HttpTally,
    seq: &SeqTally,
) -> anyhow::Result<LedgerFigures> {
    let orders_db = stack.orders_admin().await?;
    let billing_db = stack.billing_admin().await?;
    // Each event invoices its payload's order (the sequenced producer's
    // events bill child orders of their aggregate).
    let outbox: Vec<(Uuid, Uuid)> = orders_db
        .query("SELECT id, (payload->>'order_id')::uuid FROM outbox", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let orders: HashSet<Uuid> = orders_db
        .query("SELECT id FROM orders", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut invoices: HashMap<Uuid, usize> = HashMap::new();
    for r in billing_db
        .query("SELECT order_id FROM invoices", &[])
        .await?
    {
        *invoices.entry(r.get(0)).or_insert(0) += 1;
    }
    let processed: HashSet<Uuid> = billing_db
        .query("SELECT event_id FROM processed_events", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let dead_lettered: i64 = orders_db
        .query_one("SELECT count(*) FROM cdc_relay_dead_letter", &[])
        .await?
        .get(0);
    let outbox_ids: HashSet<Uuid> = outbox.iter().map(|(e, _)| *e).collect();
    Ok(LedgerFigures {
        committed_events: outbox.len(),
        invoices: invoices.values().sum(),
        lost: outbox
            .iter()
            .filter(|(e, o)| !processed.contains(e) || !invoices.contains_key(o))
            .count(),
        duplicate_effects: invoices.values().filter(|&&n| n > 1).count(),
        phantom: processed.difference(&outbox_ids).count()
            + invoices.keys().filter(|o| !orders.contains(o)).count(),
        dead_lettered: usize::try_from(dead_lettered)?,
        accepted_not_committed: http
            .accepted
            .iter()
            .filter(|(e, o, _)| !outbox_ids.contains(e) || !orders.contains(o))
            .count(),
        sql_committed_missing: seq
            .committed
            .iter()
            .filter(|e| !outbox_ids.contains(&e.id))
            .count(),
    })
}

/// Walks the arrivals in arrival order: each sequenced event's first
/// arrival must come after no later event of its aggregate.
fn order_figures(received: &[Arrival], seq: &SeqTally) -> OrderFigures {
    let position: HashMap<Uuid, (Uuid, u32)> = seq
        .committed
        .iter()
        .map(|e| (e.id, (e.aggregate, e.seq)))
        .collect();
    let mut arrivals: Vec<&Arrival> = received.iter().collect();
    arrivals.sort_by(|a, b| a.t.total_cmp(&b.t));
    let mut seen: HashSet<Uuid> = HashSet::new();
    let mut again: HashSet<Uuid> = HashSet::new();
    let mut highest: HashMap<Uuid, u32> = HashMap::new();
    let mut out = OrderFigures {
        aggregates: seq
            .committed
            .iter()
            .map(|e| e.aggregate)
            .collect::<HashSet<_>>()
            .len(),
        events: seq.committed.len(),
        ..OrderFigures::default()
    };
    for a in arrivals {
        let Some(id) = a.id else { continue };
        let Some(&(aggregate, s)) = position.get(&id) else {
            continue;
        };
        if !seen.insert(id) {
            again.insert(id);
            continue;
        }
        let top = highest.entry(aggregate).or_insert(s);
        if s < *top {
            out.violations += 1;
            if out.examples.len() < 5 {
                out.examples.push(format!(
                    "aggregate {aggregate}: event {s} first received at t={:.3}s, after event {}",
                    a.t, *top
                ));
            }
        }
        *top = (*top).max(s);
    }
    out.redelivered = again.len();
    out
}

/// 2xx for an id that had one already: in total, and per kill (from it to
/// the next).
fn redeliveries(received: &[Arrival], kills: &[KillOutcome]) -> (usize, Vec<usize>) {
    let mut arrivals: Vec<&Arrival> = received.iter().filter(|a| a.ok).collect();
    arrivals.sort_by(|a, b| a.t.total_cmp(&b.t));
    let mut seen = HashSet::new();
    let mut per_kill = vec![0; kills.len()];
    let mut total = 0;
    for a in arrivals {
        let Some(id) = a.id else { continue };
        if seen.insert(id) {
            continue;
        }
        total += 1;
        if let Some(k) = kills.iter().rposition(|k| k.at <= a.t) {
            per_kill[k] += 1;
        }
    }
    (total, per_kill)
}

fn keep_logs(fleet: &Fleet, cluster: &PgCluster, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("postgres.log"), cluster.log_contents())?;
    let procs = fleet
        .dead
        .iter()
        .map(|(n, p)| (n, p))
        .chain(fleet.relays.iter().map(|r| (&r.name, &r.running.process)));
    for (i, (name, p)) in procs.enumerate() {
        let _ = std::fs::copy(
            p.log_dir().join("output.log"),
            dir.join(format!("{i:03}-{name}.log")),
        );
    }
    Ok(())
}
