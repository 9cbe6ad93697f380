//! The chaos run (issue 6): a seeded, reproducible "bad ten minutes" against
//! the whole stack, ending with a ledger that must come out clean.
//!
//! ```text
//!  load (HTTP, fixed rate) ──▶ Front ──▶ Orders ──┐            (Orders SIGKILLed, restarted on a new port)
//!  SQL producers (multi-row, ROLLBACK, SAVEPOINT) ─┤
//!                                                  ▼
//!                                   PostgreSQL (own cluster; restart -m immediate, walsender terminated)
//!                                                  ▲
//!          relay A (active) ─┬── FaultProxy "pg link" (blackhole / reset)
//!          relay B (standby) ┘        │ (the active relay is SIGKILLed every 15–20 s;
//!                │                    │  a new one starts as the standby)
//!                ▼
//!        FaultProxy "billing link" ──▶ ScriptedSink (503 bursts; records every answer)
//!                                          ──▶ Front ──▶ Billing  (SIGKILLed, restarted on a new port;
//!                                                          │       dies between a charge and its record)
//!                                              POST /charges, Idempotency-Key
//!                                                          ▼
//!                                          Front ──▶ Payments (2 % 503s, 2 % answers dropped after the
//!                                                     charge; SIGKILLed; dies between its charge and its answer)
//! ```
//!
//! The [`front::Front`]s are stable TCP forwarders whose upstream is
//! re-pointed when Orders or Billing comes back on a new port, so the load
//! and the sink never learn a new address.
//!
//! The faults come from a [`schedule::Schedule`] drawn from the
//! seed (printed first, with the schedule). After the fault phase the load
//! stops, every fault is lifted, and the run waits (bounded) for every
//! committed outbox event to reach Billing's inbox. Then
//! [`report::analyse`] counts, from both databases and the sink's record:
//! lost, duplicate effects, phantom, dead-lettered and accepted-but-not-
//! committed (all must be 0), the provider's charges per order
//! ([`Charges`]: double charges and uncharged invoices must be 0), and the figures (redeliveries per relay kill,
//! recovery after each fault, requests per second to Billing while it was
//! down, commit-to-invoice latency, peak slot lag).
//!
//! Entry points: the `chaos` binary (the full run) and the `chaos` system
//! test (the same schedule compressed, on every CI). [`shards`] is the
//! sharded variant of issue 16 (relay kills only, over N shards and a pool
//! of relays; `chaos --shards N`).

pub mod front;
pub mod load;
pub mod report;
pub mod schedule;
mod services;
pub mod shards;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use tokio::sync::Mutex as AsyncMutex;

use crate::app::{self, Running, TEST_SECRET};
use crate::oracle::Charges;
use crate::proxy::{FaultProxy, Mode};
use crate::sink::ScriptedSink;
use crate::stack::PaymentsDb;
use crate::{ClusterOptions, PgCluster, ServiceProcess, Stack, StopMode, bins, wait_until};

use front::Front;
use load::{HttpLoad, SqlLoad};
use report::{FaultOutcome, Observed, Report, SinkRecord};
use schedule::{Fault, FaultKind, Schedule, Shape};
use services::Service;

/// How a run is set up.
#[derive(Debug, Clone)]
pub struct Config {
    /// `full` or `ci`, for the report.
    pub label: String,
    /// Seeds the schedule and the SQL producers' choices.
    pub seed: u64,
    /// The schedule's shape (duration, intervals, gaps).
    pub shape: Shape,
    /// Orders per second through the Orders API.
    pub rate: u32,
    /// SQL producer transactions per second.
    pub sql_tx_per_sec: f64,
    /// PostgreSQL `fsync` (and `full_page_writes`).
    pub fsync: bool,
    /// PostgreSQL `wal_sender_timeout`.
    pub wal_sender_timeout: String,
    /// The relay's `--request-timeout`.
    pub request_timeout: String,
    /// Bound on the drain after the load stops.
    pub drain_timeout: Duration,
    /// Copy every process log (and PostgreSQL's) here at the end; when
    /// `None`, logs are copied only if the ledger is not clean.
    pub keep_logs: Option<PathBuf>,
    /// Billing sends its `Idempotency-Key` to the provider; `false` is the
    /// comparison run that counts the double charges the key prevents.
    pub idempotency_key: bool,
    /// Flags every relay of the run gets besides the schedule's own (the
    /// batched variant's `--batch-max-events`).
    pub relay_args: Vec<String>,
}

impl Config {
    /// The full run: `duration` of faults at `rate` orders/s, fsync on.
    pub fn full(seed: u64, duration: Duration, rate: u32) -> Config {
        Config {
            label: "full".into(),
            seed,
            shape: Shape::full(duration),
            rate,
            sql_tx_per_sec: 4.0,
            fsync: true,
            wal_sender_timeout: "5s".into(),
            request_timeout: "3s".into(),
            drain_timeout: Duration::from_secs(300),
            keep_logs: None,
            idempotency_key: true,
            relay_args: Vec::new(),
        }
    }

    /// The CI variant: the same schedule compressed to 90 s of faults, 40
    /// orders/s, fsync off.
    pub fn ci(seed: u64) -> Config {
        Config {
            label: "ci".into(),
            seed,
            shape: Shape::compressed(Duration::from_secs(90)),
            rate: 40,
            sql_tx_per_sec: 2.0,
            fsync: false,
            wal_sender_timeout: "5s".into(),
            request_timeout: "3s".into(),
            drain_timeout: Duration::from_secs(90),
            keep_logs: None,
            idempotency_key: true,
            relay_args: Vec::new(),
        }
    }
}

impl Config {
    /// The same run with every relay sending batches of up to 16 events
    /// (`docs/architecture.md#batches`; Billing takes them).
    pub fn batched(mut self) -> Config {
        self.label = format!("{}-batched", self.label);
        self.relay_args = ["--batch-max-events", "16"].map(String::from).to_vec();
        self
    }
}

/// Bound for a service or relay to print its listening line.
const START: Duration = Duration::from_secs(30);
/// Bound for another relay to take the slot after a kill.
const TAKEOVER: Duration = Duration::from_secs(60);

/// One relay process and the application_name it shows in pg_stat_replication.
struct Relay {
    name: String,
    running: Running,
}

/// Starts relay `name` (its `application_name`): `run` as the relay role
/// through `db_url` to `sink_url`, with `extra` flags (the shard chaos's
/// `--shards`); returns once its admin endpoint listens.
async fn spawn_relay(
    stack: &Stack,
    db_url: &str,
    sink_url: &str,
    name: String,
    request_timeout: &str,
    extra: &[&str],
) -> anyhow::Result<Relay> {
    let mut argv = app::relay_globals(stack);
    argv.extend(
        [
            "run",
            "--sink-url",
            sink_url,
            "--admin-listen",
            "127.0.0.1:0",
            "--application-name",
            &name,
            "--request-timeout",
            request_timeout,
        ]
        .map(String::from),
    );
    argv.extend(extra.iter().map(|a| (*a).to_owned()));
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let process = ServiceProcess::spawn(
        bins::path("cdc-relay"),
        &argv,
        &[
            ("CDC_RELAY_DATABASE_URL", db_url),
            ("EVENT_SECRET", TEST_SECRET),
            ("CDC_RELAY_LOG", "info,pgwire_replication=off"),
        ],
    )?;
    let url = process.listen_addr(START).await?;
    Ok(Relay {
        name,
        running: Running::single(process, url),
    })
}

/// Everything the fault tasks share.
struct World {
    cluster: Arc<PgCluster>,
    stack: Stack,
    epoch: Instant,
    billing: AsyncMutex<Running>,
    billing_front: Front,
    orders: AsyncMutex<Running>,
    orders_front: Front,
    payments_db: PaymentsDb,
    payments: AsyncMutex<Running>,
    payments_front: Front,
    idempotency_key: bool,
    relay_args: Vec<String>,
    sink: ScriptedSink,
    billing_link: FaultProxy,
    pg_link: FaultProxy,
    relay_db_url: String,
    relay_sink_url: String,
    request_timeout: String,
    relays: AsyncMutex<Vec<Relay>>,
    next_relay: AtomicUsize,
    /// Killed processes, kept for their logs.
    dead: Mutex<Vec<(String, ServiceProcess)>>,
    unexpected_exits: Mutex<Vec<String>>,
}

impl World {
    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    async fn spawn_relay(&self) -> anyhow::Result<Relay> {
        let n = self.next_relay.fetch_add(1, Ordering::SeqCst);
        spawn_relay(
            &self.stack,
            &self.relay_db_url,
            &self.relay_sink_url,
            format!("chaos-relay-{n}"),
            &self.request_timeout,
            &self
                .relay_args
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        )
        .await
    }

    /// The application_name of the relay whose walsender holds the slot.
    async fn slot_holder(&self) -> anyhow::Result<Option<String>> {
        let db = self.stack.orders_admin().await?;
        let row = db
            .query_opt(
                "SELECT r.application_name FROM pg_replication_slots s \
                 JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = $1",
                &[&self.stack.slot],
            )
            .await?;
        Ok(row.map(|r| r.get(0)))
    }

    fn bury(&self, name: &str, process: ServiceProcess) {
        self.dead
            .lock()
            .expect("dead lock")
            .push((name.to_owned(), process));
    }

    /// Applies one fault and lifts it; never fails (problems go in `note`).
    async fn apply(self: Arc<Self>, fault: Fault) -> FaultOutcome {
        let mut out = FaultOutcome {
            fault,
            started: self.now(),
            ended: self.now(),
            victim: None,
            takeover: None,
            note: None,
            first_2xx_after: None,
            caught_up_after: None,
            redelivered: 0,
            sink_requests_during: 0,
            sink_requests_after_first_second: None,
            relay_kills_while_counted: 0,
            overlapped: false,
        };
        let result = match fault.kind {
            FaultKind::RelayKill => self.kill_relay(&mut out).await,
            FaultKind::BillingKill => self.kill_service(&mut out, Service::Billing).await,
            FaultKind::OrdersKill => self.kill_service(&mut out, Service::Orders).await,
            FaultKind::PaymentsKill => self.kill_service(&mut out, Service::Payments).await,
            FaultKind::BillingExitAfterCharge => {
                self.exit_after_charge(&mut out, Service::Billing).await
            }
            FaultKind::PaymentsExitAfterCharge => {
                self.exit_after_charge(&mut out, Service::Payments).await
            }
            FaultKind::BillingLinkBlackhole => {
                self.cut(&self.billing_link, Mode::Blackhole, &mut out)
                    .await
            }
            FaultKind::BillingLinkReset => {
                self.cut(&self.billing_link, Mode::Reset, &mut out).await
            }
            FaultKind::PgLinkBlackhole => self.cut(&self.pg_link, Mode::Blackhole, &mut out).await,
            FaultKind::PgLinkReset => self.cut(&self.pg_link, Mode::Reset, &mut out).await,
            FaultKind::Billing503 => {
                out.started = self.now();
                self.sink.set_status(503);
                let counted = self.count_sink_requests(false, fault.hold).await;
                self.sink.set_status(204);
                out.ended = self.now();
                out.sink_requests_after_first_second = Some(counted.finish(&self));
                Ok(())
            }
            FaultKind::PgRestartImmediate => {
                out.started = self.now();
                let cluster = Arc::clone(&self.cluster);
                let r = tokio::task::spawn_blocking(move || cluster.restart(StopMode::Immediate))
                    .await
                    .map_err(anyhow::Error::from)
                    .and_then(|r| r);
                out.ended = self.now();
                r
            }
            FaultKind::WalsenderTerminate => self.terminate_walsender(&mut out).await,
        };
        if let Err(err) = result {
            out.note = Some(format!("{err:#}"));
            eprintln!("chaos: fault #{} ({}) failed: {err:#}", fault.n, fault.kind);
        }
        eprintln!(
            "chaos: t={:7.2}s #{:<3} {:<32} {:.2}s{}{}",
            out.started,
            fault.n,
            fault.kind.name(),
            out.ended - out.started,
            out.victim
                .as_deref()
                .map_or(String::new(), |v| format!(" victim {v}")),
            out.takeover.map_or(String::new(), |t| format!(
                ", slot taken over after {t:.2}s"
            )),
        );
        out
    }

    async fn cut(
        &self,
        proxy: &FaultProxy,
        mode: Mode,
        out: &mut FaultOutcome,
    ) -> anyhow::Result<()> {
        out.started = self.now();
        proxy.set_mode(mode);
        let billing = std::ptr::eq(proxy, &self.billing_link);
        let counted = self.count_sink_requests(billing, out.fault.hold).await;
        proxy.set_mode(Mode::Pass);
        out.ended = self.now();
        if billing {
            out.sink_requests_after_first_second = Some(counted.finish(self));
        }
        Ok(())
    }

    /// Requests reaching Billing's side now: new connections at the
    /// relay↔Billing proxy (`link`: when it cuts or resets them, every
    /// attempt needs a new one), else requests at the sink in front of
    /// Billing.
    fn sink_requests(&self, link: bool) -> usize {
        if link {
            self.billing_link.accepted()
        } else {
            self.sink.arrivals()
        }
    }

    /// Sleeps `hold` (a fault holds), counting the requests that reach
    /// Billing's side from one second in.
    async fn count_sink_requests(&self, link: bool, hold: Duration) -> Counted {
        let first = Duration::from_secs(1).min(hold);
        tokio::time::sleep(first).await;
        let counted = Counted {
            link,
            from: self.now(),
            before: self.sink_requests(link),
        };
        tokio::time::sleep(hold - first).await;
        counted
    }

    async fn kill_relay(&self, out: &mut FaultOutcome) -> anyhow::Result<()> {
        // Whoever holds the slot is the active relay; during a restart or a
        // cut nobody may, for a moment.
        let mut holder = None;
        let deadline = Instant::now() + Duration::from_secs(3);
        while holder.is_none() && Instant::now() < deadline {
            holder = self.slot_holder().await.ok().flatten();
            if holder.is_none() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let mut relays = self.relays.lock().await;
        let idx = match holder
            .as_ref()
            .and_then(|h| relays.iter().position(|r| &r.name == h))
        {
            Some(i) => i,
            None => {
                out.note = Some(format!(
                    "no relay held the slot (holder {holder:?}): killed the oldest relay"
                ));
                0
            }
        };
        let mut victim = relays.remove(idx);
        out.started = self.now();
        out.ended = out.started;
        victim.running.process.sigkill();
        out.victim = Some(victim.name.clone());
        self.bury(&victim.name, victim.running.process);
        drop(relays);
        let killed = Instant::now();
        let victim_name = victim.name;
        let takeover = async {
            while killed.elapsed() < TAKEOVER {
                let h = self.slot_holder().await.ok().flatten();
                if h.is_some_and(|h| h != victim_name) {
                    return Some(killed.elapsed().as_secs_f64());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            None
        };
        let (spawned, taken) = tokio::join!(self.spawn_relay(), takeover);
        out.takeover = taken;
        self.relays
            .lock()
            .await
            .push(spawned.context("starting the new standby relay")?);
        if taken.is_none() {
            anyhow::bail!("no other relay held the slot within {TAKEOVER:?} of the kill");
        }
        Ok(())
    }

    async fn terminate_walsender(&self, out: &mut FaultOutcome) -> anyhow::Result<()> {
        let db = self.stack.orders_admin().await?;
        let deadline = Instant::now() + Duration::from_secs(15);
        let pid = loop {
            let pid: Option<i32> = db
                .query_one(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                    &[&self.stack.slot],
                )
                .await?
                .get(0);
            match pid {
                Some(pid) => break pid,
                None if Instant::now() >= deadline => {
                    anyhow::bail!("no walsender held the slot for 15 s")
                }
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        out.victim = self.slot_holder().await.ok().flatten();
        out.started = self.now();
        let done: bool = db
            .query_one("SELECT pg_terminate_backend($1)", &[&pid])
            .await?
            .get(0);
        out.ended = self.now();
        anyhow::ensure!(done, "pg_terminate_backend({pid}) returned false");
        Ok(())
    }

    /// Restarts relays that exited on their own (a crash is a finding).
    async fn check_relays(&self) {
        let mut relays = self.relays.lock().await;
        let mut i = 0;
        while i < relays.len() {
            if let Ok(status) = relays[i].running.process.wait_exit(Duration::ZERO).await {
                let r = relays.remove(i);
                let msg = format!(
                    "{} exited on its own ({status}) at t={:.1}s",
                    r.name,
                    self.now()
                );
                eprintln!("chaos: {msg}");
                self.unexpected_exits.lock().expect("exits lock").push(msg);
                self.bury(&r.name, r.running.process);
                match self.spawn_relay().await {
                    Ok(new) => relays.push(new),
                    Err(err) => eprintln!("chaos: could not replace it: {err:#}"),
                }
                continue;
            }
            i += 1;
        }
    }
}

/// Requests to Billing's side counted from one second into a fault.
struct Counted {
    link: bool,
    from: f64,
    before: usize,
}

impl Counted {
    /// The requests since then and the seconds they span, up to now.
    fn finish(self, world: &World) -> (usize, f64) {
        let n = world.sink_requests(self.link).saturating_sub(self.before);
        (n, world.now() - self.from)
    }
}

/// Samples the slot lag every 500 ms and watches for relays that died on
/// their own, until `stop`.
fn monitor(
    world: Arc<World>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<Vec<(f64, u64)>> {
    tokio::spawn(async move {
        let mut samples = Vec::new();
        let mut db: Option<tokio_postgres::Client> = None;
        while !*stop.borrow() {
            if db.as_ref().is_none_or(|c| c.is_closed()) {
                db = world.stack.orders_admin().await.ok();
            }
            if let Some(c) = &db {
                let lag = c
                    .query_one(
                        "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::int8 \
                         FROM pg_replication_slots WHERE slot_name = $1",
                        &[&world.stack.slot],
                    )
                    .await;
                match lag {
                    Ok(row) => {
                        let lag: Option<i64> = row.get(0);
                        samples.push((world.now(), u64::try_from(lag.unwrap_or(0)).unwrap_or(0)));
                    }
                    Err(_) => db = None,
                }
            }
            world.check_relays().await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        samples
    })
}

/// Runs the whole thing and returns the report (the ledger may be dirty:
/// check [`Report::passed`]). Errors only when the stack cannot be set up.
pub async fn run(cfg: &Config) -> anyhow::Result<Report> {
    let wall = Instant::now();
    let schedule = Schedule::draw(cfg.seed, cfg.shape);
    eprintln!(
        "chaos: seed {} (rerun with --seed {}); {} orders/s, fsync {}\n{schedule}",
        cfg.seed,
        cfg.seed,
        cfg.rate,
        if cfg.fsync { "on" } else { "off" }
    );

    let opts = ClusterOptions {
        fsync: cfg.fsync,
        wal_sender_timeout: cfg.wal_sender_timeout.clone(),
        max_slot_wal_keep_size: None,
        extra_settings: vec![("track_commit_timestamp".into(), "on".into())],
    };
    let cluster = Arc::new(
        tokio::task::spawn_blocking(move || PgCluster::start(opts))
            .await?
            .context("starting the chaos cluster")?,
    );
    let stack = cluster.create_stack().await?;
    let payments_db = cluster.create_payments(&stack).await?;
    app::relay_setup(&stack).await?;

    let payments = services::start_payments(&payments_db, false).await?;
    let payments_front = Front::start(front::socket_addr(&payments.url)?).await?;
    let billing =
        services::start_billing(&stack, &payments_front.url(), cfg.idempotency_key, false).await?;
    let billing_front = Front::start(front::socket_addr(&billing.url)?).await?;
    let sink = ScriptedSink::proxy(&format!("{}/inbox", billing_front.url())).await?;
    let (billing_link, relay_sink_url) = app::proxied(&sink.url).await?;
    let orders = app::start_orders(&stack).await?;
    let orders_front = Front::start(front::socket_addr(&orders.url)?).await?;
    let (pg_link, relay_db_url) = app::proxied(&stack.relay_url).await?;

    let world = Arc::new(World {
        cluster: Arc::clone(&cluster),
        stack: stack.clone(),
        epoch: Instant::now(),
        billing: AsyncMutex::new(billing),
        billing_front,
        orders: AsyncMutex::new(orders),
        orders_front,
        payments_db,
        payments: AsyncMutex::new(payments),
        payments_front,
        idempotency_key: cfg.idempotency_key,
        relay_args: cfg.relay_args.clone(),
        sink,
        billing_link,
        pg_link,
        relay_db_url,
        relay_sink_url,
        request_timeout: cfg.request_timeout.clone(),
        relays: AsyncMutex::new(Vec::new()),
        next_relay: AtomicUsize::new(1),
        dead: Mutex::new(Vec::new()),
        unexpected_exits: Mutex::new(Vec::new()),
    });

    // The active relay, then the standby.
    let active = world.spawn_relay().await?;
    app::wait_streaming(&active.running).await?;
    let standby = world.spawn_relay().await?;
    standby
        .running
        .process
        .wait_for_line("waiting as hot standby", START)
        .await?;
    world.relays.lock().await.extend([active, standby]);

    // The load, then the first invoice, then t = 0.
    let http = HttpLoad::start(world.orders_front.url(), cfg.rate, world.epoch);
    let sql = SqlLoad::start(stack.orders_app_url.clone(), cfg.sql_tx_per_sec, cfg.seed);
    wait_until("the first invoice", Duration::from_secs(60), || async {
        world.sink.delivered().len() >= 10
    })
    .await?;
    let warm = world.now();
    eprintln!(
        "chaos: stack up and first invoices after {:.1}s; faults start (t = 0)",
        wall.elapsed().as_secs_f64()
    );
    let t0 = tokio::time::Instant::now();
    let wall0 = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let monitor = monitor(Arc::clone(&world), stop_rx);

    let mut tasks = Vec::new();
    for fault in schedule.faults.iter().copied() {
        tokio::time::sleep_until(t0 + fault.at).await;
        tasks.push(tokio::spawn(Arc::clone(&world).apply(fault)));
    }
    tokio::time::sleep_until(t0 + schedule.end).await;
    let mut outcomes = Vec::new();
    for (task, fault) in tasks.into_iter().zip(&schedule.faults) {
        match tokio::time::timeout(Duration::from_secs(120), task).await {
            Ok(Ok(o)) => outcomes.push(o),
            other => {
                eprintln!("chaos: fault #{} did not finish: {other:?}", fault.n);
                outcomes.push(FaultOutcome {
                    fault: *fault,
                    started: f64::NAN,
                    ended: f64::NAN,
                    victim: None,
                    takeover: None,
                    note: Some(format!("did not finish: {other:?}")),
                    first_2xx_after: None,
                    caught_up_after: None,
                    redelivered: 0,
                    sink_requests_during: 0,
                    sink_requests_after_first_second: None,
                    relay_kills_while_counted: 0,
                    overlapped: false,
                });
            }
        }
    }
    let fault_phase = t0.elapsed().as_secs_f64();

    // Stop the load, lift everything, drain.
    let http = http.stop().await;
    let sql = sql.stop().await;
    world.billing_link.set_mode(Mode::Pass);
    world.pg_link.set_mode(Mode::Pass);
    world.sink.set_status(204);
    let drain_start = Instant::now();
    eprintln!(
        "chaos: load stopped at t={:.1}s ({} accepted); draining (bound {:?})",
        world.now() - warm,
        http.accepted.len(),
        cfg.drain_timeout
    );
    let drained = wait_until(
        "every committed outbox event in Billing's inbox, and every invoice charged or failed",
        cfg.drain_timeout,
        || async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            drained(&stack, &world.payments_db).await
        },
    )
    .await;
    let drain = match &drained {
        Ok(()) => {
            eprintln!(
                "chaos: drained after {:.1}s ({:.1}s since the start)",
                drain_start.elapsed().as_secs_f64(),
                wall.elapsed().as_secs_f64()
            );
            Some(drain_start.elapsed().as_secs_f64())
        }
        Err(err) => {
            eprintln!("chaos: {err:#}");
            None
        }
    };
    let _ = stop_tx.send(true);
    let lag = monitor.await.unwrap_or_default();

    // Read everything back.
    let shift = |t: f64| t - warm;
    let sink_records: Vec<SinkRecord> = world
        .sink
        .received()
        .iter()
        .map(|r| SinkRecord {
            t: r.at.saturating_duration_since(world.epoch).as_secs_f64() - warm,
            id: r.json()["id"].as_str().and_then(|s| s.parse().ok()),
            status: r.status,
        })
        .collect();
    let orders_db = stack.orders_admin().await?;
    let billing_db = stack.billing_admin().await?;
    let outbox = orders_db
        .query("SELECT id, aggregate_id FROM outbox", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let commit_time = "extract(epoch FROM pg_xact_commit_timestamp(xmin))::float8";
    let orders = orders_db
        .query(&format!("SELECT id, {commit_time} FROM orders"), &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get::<_, Option<f64>>(1).map(|t| t - wall0)))
        .collect();
    let invoices = billing_db
        .query(
            &format!("SELECT order_id, {commit_time} FROM invoices"),
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get::<_, Option<f64>>(1).map(|t| t - wall0)))
        .collect();
    let processed = billing_db
        .query("SELECT event_id FROM processed_events", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let dead_lettered: i64 = orders_db
        .query_one("SELECT count(*) FROM cdc_relay_dead_letter", &[])
        .await?
        .get(0);
    for o in &mut outcomes {
        o.started = shift(o.started);
        o.ended = shift(o.ended);
    }
    let observed = Observed {
        schedule: schedule.clone(),
        outcomes,
        sink: sink_records,
        sink_arrivals: world.sink.arrivals(),
        http: shift_http(http, warm),
        sql,
        outbox,
        orders,
        invoices,
        processed,
        dead_lettered: usize::try_from(dead_lettered)?,
        lag: lag.into_iter().map(|(t, l)| (shift(t), l)).collect(),
        drain,
        unexpected_exits: world.unexpected_exits.lock().expect("exits lock").clone(),
    };
    let unexpected_exits = observed.unexpected_exits.clone();
    let charges = Charges::read(&stack, &world.payments_db).await?;
    let (ledger, figures, by_kind, load, faults) = report::analyse(observed);
    let mut report = Report {
        label: cfg.label.clone(),
        seed: cfg.seed,
        rate: cfg.rate,
        fsync: cfg.fsync,
        profile: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
        .into(),
        fault_phase_s: fault_phase,
        wall_s: wall.elapsed().as_secs_f64(),
        started_unix: wall0,
        ledger,
        idempotency_key: cfg.idempotency_key,
        charges,
        figures,
        by_kind,
        load,
        faults,
        unexpected_exits,
        logs: None,
    };
    let keep = cfg.keep_logs.clone().or_else(|| {
        (!report.passed()).then(|| {
            std::env::temp_dir().join(format!(
                "cdc-relay-chaos-{}-{}",
                cfg.seed,
                std::process::id()
            ))
        })
    });
    if let Some(dir) = keep {
        match keep_logs(&world, &cluster, &dir).await {
            Ok(()) => report.logs = Some(dir.display().to_string()),
            Err(err) => eprintln!(
                "chaos: could not copy the logs to {}: {err:#}",
                dir.display()
            ),
        }
    }
    // Stop the relays cleanly-ish; everything else is killed on drop.
    for r in world.relays.lock().await.iter_mut() {
        r.running.process.sigkill();
    }
    Ok(report)
}

fn shift_http(mut http: load::HttpTally, warm: f64) -> load::HttpTally {
    for a in &mut http.accepted {
        a.2 -= warm;
    }
    for f in &mut http.failures {
        f.0 -= warm;
    }
    http
}

/// Whether every committed outbox event has an inbox row, and no invoice
/// waits for its charge.
async fn drained(stack: &Stack, payments: &PaymentsDb) -> anyhow::Result<bool> {
    Ok(crate::oracle::Ledger::read(stack).await?.lost == 0
        && Charges::read(stack, payments).await?.settled())
}

async fn keep_logs(world: &World, cluster: &PgCluster, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("postgres.log"), cluster.log_contents())?;
    let copy = |name: &str, p: &ServiceProcess, i: usize| {
        let _ = std::fs::copy(
            p.log_dir().join("output.log"),
            dir.join(format!("{i:03}-{name}.log")),
        );
    };
    let mut i = 0;
    for (name, p) in world.dead.lock().expect("dead lock").iter() {
        copy(name, p, i);
        i += 1;
    }
    for r in world.relays.lock().await.iter() {
        copy(&r.name, &r.running.process, i);
        i += 1;
    }
    copy("billing", &world.billing.lock().await.process, i);
    copy("orders", &world.orders.lock().await.process, i + 1);
    copy("payments", &world.payments.lock().await.process, i + 2);
    Ok(())
}

/// Writes a report as pretty JSON to `path`.
pub fn write_json(report: &impl serde::Serialize, path: &Path) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(report)?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
