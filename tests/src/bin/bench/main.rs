//! `bench`: cdc-relay against a faithful port of the tutorial's polling relay,
//! side by side in one run, on a throwaway PostgreSQL cluster with fsync ON.
//!
//! ```text
//! cargo run --release -p cdc-relay-tests --bin bench -- --quick          # ~11 min
//! cargo run --release -p cdc-relay-tests --bin bench                     # full, ~20 min
//!     [--runs N] [--only a,b,c,d,e] [--out target/bench.json]
//!     [--sinks billing,null] [--mif 16,64] [--rates 10 --latency-s 60]
//!     [--no-baselines] [--relay-threads N]                # focused runs
//! ```
//!
//! Scenarios (a fresh pair of databases per scenario, one cluster per run):
//! - **a** commit-to-invoice latency at 10, 100 and 1000 orders/s posted
//!   through Orders' HTTP API: `invoices.created_at − orders.created_at`
//!   (both `now()` of their transactions, one server clock), also the
//!   commit-timestamp difference, and for cdc-relay its own
//!   `cdc_relay_commit_to_delivery_seconds` histogram (delta over the window);
//! - **b** sustained throughput draining a pre-inserted backlog (one order
//!   per transaction) to real Billing and to a null 204 sink, cdc-relay at
//!   `--max-in-flight` 1/16/64/256; Billing's own maximum insert rate, driven
//!   directly with signed requests, as the ceiling; the relay's CPU per
//!   event between the first and the last observation;
//! - **c** idle cost: statements/s on the orders database (pg_stat_statements,
//!   and xact deltas of pg_stat_database) and the contender's CPU;
//! - **d** peak RSS (VmHWM) during b and with a much larger backlog;
//! - **e** recovery after a Billing outage (503 from a proxy in front of it):
//!   time from its return to the first invoice, until the outage's backlog is
//!   invoiced, and requests/s sent during the outage.
//!
//! The baseline (see `baseline.rs`) runs as a child process of this
//! binary (`bench baseline-worker`), in three variants: the tutorial's 250 ms
//! poll with one worker, a 100 ms poll, and four workers.

mod baseline;
mod stats;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use clap::{Parser, Subcommand};
use harness::app::{self, Running, TEST_SECRET};
use harness::prom;
use harness::sink::ScriptedSink;
use harness::stack::Stack;
use harness::{ClusterOptions, PgCluster, ServiceProcess};
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Sha256;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;
use uuid::Uuid;

use crate::baseline::BaselineArgs;
use crate::stats::{Summary, summarize};

/// Command line.
#[derive(Debug, Parser)]
#[command(
    name = "bench",
    about = "Benchmarks of cdc-relay side by side with the tutorial's polling relay"
)]
struct Cli {
    /// Internal: run the polling baseline (the benchmark starts it itself).
    #[command(subcommand)]
    command: Option<Sub>,
    /// Short run: smaller backlogs and windows.
    #[arg(long)]
    quick: bool,
    /// Repeat every scenario this many times (figures show median, min, max).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    runs: u32,
    /// Scenarios to run (a,b,c,d,e).
    #[arg(long, value_delimiter = ',', default_value = "a,b,c,d,e")]
    only: Vec<String>,
    /// Skip the 1000 orders/s latency step.
    #[arg(long)]
    no_1000: bool,
    /// Sinks scenario b drains to (billing, null); Billing's own maximum is
    /// measured only when billing is listed.
    #[arg(long, value_delimiter = ',', default_value = "billing,null",
          value_parser = ["billing", "null"])]
    sinks: Vec<String>,
    /// `--max-in-flight` values scenario b runs ours with.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256",
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    mif: Vec<u32>,
    /// Order rates of scenario a (orders/s); overrides --no-1000.
    #[arg(long, value_delimiter = ',',
          value_parser = clap::value_parser!(u32).range(1..=5000))]
    rates: Option<Vec<u32>>,
    /// Length of each latency window of scenario a (s); default 10 (quick) or 30.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3600))]
    latency_s: Option<u64>,
    /// Pass `--worker-threads N` to every cdc-relay started (default: its own
    /// default, one thread per CPU).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    relay_threads: Option<u16>,
    /// Leave the polling baselines out of scenarios a and b (for profiling ours).
    #[arg(long)]
    no_baselines: bool,
    /// Where the JSON goes.
    #[arg(long, default_value = "target/bench.json")]
    out: PathBuf,
}

#[derive(Debug, Subcommand)]
enum Sub {
    /// The tutorial's polling relay (started by the benchmark).
    #[command(hide = true)]
    BaselineWorker(BaselineArgs),
}

/// Sizes of one run.
#[derive(Debug, Clone, serde::Serialize)]
struct Config {
    latency_window_s: u64,
    latency_rates: Vec<u32>,
    backlog: u64,
    big_backlog: u64,
    baseline_window_s: u64,
    drain_cap_s: u64,
    idle_window_s: u64,
    outage_s: u64,
    max_in_flight: Vec<u32>,
    billing_max_requests: u64,
    billing_max_concurrency: Vec<usize>,
    seed_orders: u64,
    sinks: Vec<String>,
    baselines: bool,
}

impl Config {
    fn new(quick: bool, no_1000: bool) -> Config {
        let mut rates = vec![10, 100, 1000];
        if no_1000 {
            rates.pop();
        }
        Config {
            latency_window_s: if quick { 10 } else { 30 },
            latency_rates: rates,
            backlog: if quick { 20_000 } else { 100_000 },
            big_backlog: if quick { 200_000 } else { 1_000_000 },
            baseline_window_s: if quick { 10 } else { 30 },
            drain_cap_s: if quick { 120 } else { 400 },
            idle_window_s: if quick { 30 } else { 60 },
            outage_s: if quick { 10 } else { 30 },
            max_in_flight: Vec::new(),
            billing_max_requests: if quick { 20_000 } else { 100_000 },
            billing_max_concurrency: vec![16, 64, 256],
            seed_orders: 10_000,
            sinks: vec!["billing".to_owned(), "null".to_owned()],
            baselines: true,
        }
    }
}

/// Who delivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Contender {
    Ours { max_in_flight: u32 },
    Baseline { workers: usize, poll_ms: u64 },
}

impl Contender {
    const OURS: Contender = Contender::Ours { max_in_flight: 64 };
    const BASELINES: [Contender; 3] = [
        Contender::Baseline {
            workers: 1,
            poll_ms: 250,
        },
        Contender::Baseline {
            workers: 1,
            poll_ms: 100,
        },
        Contender::Baseline {
            workers: 4,
            poll_ms: 250,
        },
    ];

    fn all_default() -> Vec<Contender> {
        let mut v = vec![Contender::OURS];
        v.extend(Contender::BASELINES);
        v
    }

    /// Column name in the table.
    fn column(self) -> &'static str {
        match self {
            Contender::Ours { .. } => "ours",
            Contender::Baseline {
                workers: 1,
                poll_ms: 250,
            } => "baseline",
            Contender::Baseline { workers: 1, .. } => "baseline-100ms",
            Contender::Baseline { .. } => "baseline-4w",
        }
    }

    fn is_ours(self) -> bool {
        matches!(self, Contender::Ours { .. })
    }
}

const COLUMNS: [&str; 4] = ["ours", "baseline", "baseline-100ms", "baseline-4w"];

/// A target on the `ours` median.
#[derive(Debug, Clone, Copy)]
enum Target {
    AtMost(f64),
    AtLeast(f64),
}

impl Target {
    fn met(self, v: f64) -> bool {
        match self {
            Target::AtMost(t) => v <= t,
            Target::AtLeast(t) => v >= t,
        }
    }

    fn show(self) -> String {
        match self {
            Target::AtMost(t) => format!("≤ {}", fmt_num(t)),
            Target::AtLeast(t) => format!("≥ {}", fmt_num(t)),
        }
    }
}

/// One figure: values per contender, one per run.
#[derive(Debug, Clone)]
struct Row {
    scenario: String,
    metric: String,
    unit: String,
    target: Option<Target>,
    values: BTreeMap<&'static str, Vec<f64>>,
    /// Compare `ours` with this row's `baseline` column (b: the baseline's
    /// throughput to the same sink).
    baseline_from: Option<String>,
}

#[derive(Default)]
struct Results {
    rows: Vec<Row>,
    notes: Vec<String>,
}

impl Results {
    fn key(scenario: &str, metric: &str) -> String {
        format!("{scenario}/{metric}")
    }

    fn row(&mut self, scenario: &str, metric: &str, unit: &str) -> &mut Row {
        let key = Results::key(scenario, metric);
        let idx = match self
            .rows
            .iter()
            .position(|r| Results::key(&r.scenario, &r.metric) == key)
        {
            Some(i) => i,
            None => {
                self.rows.push(Row {
                    scenario: scenario.to_owned(),
                    metric: metric.to_owned(),
                    unit: unit.to_owned(),
                    target: None,
                    values: BTreeMap::new(),
                    baseline_from: None,
                });
                self.rows.len() - 1
            }
        };
        &mut self.rows[idx]
    }

    fn add(&mut self, scenario: &str, metric: &str, unit: &str, who: &'static str, v: f64) {
        eprintln!("    {scenario} {metric} [{who}] = {} {unit}", fmt_num(v));
        self.row(scenario, metric, unit)
            .values
            .entry(who)
            .or_default()
            .push(v);
    }

    /// Sets the target of an existing row (figures not measured stay absent).
    fn target(&mut self, scenario: &str, metric: &str, t: Target) {
        let key = Results::key(scenario, metric);
        if let Some(row) = self
            .rows
            .iter_mut()
            .find(|r| Results::key(&r.scenario, &r.metric) == key)
        {
            row.target = Some(t);
        }
    }

    fn note(&mut self, text: String) {
        eprintln!("    note: {text}");
        self.notes.push(text);
    }

    fn summary(&self, key: &str, who: &str) -> Option<Summary> {
        self.rows
            .iter()
            .find(|r| Results::key(&r.scenario, &r.metric) == key)
            .and_then(|r| r.values.get(who))
            .and_then(|v| summarize(v))
    }

    fn baseline_of(&self, row: &Row) -> Option<Summary> {
        match &row.baseline_from {
            Some(key) => self.summary(key, "baseline"),
            None => row.values.get("baseline").and_then(|v| summarize(v)),
        }
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // An explicit thread count: TOKIO_WORKER_THREADS, if set, reaches the
    // child processes (for experiments with the relay's runtime) and not us.
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?;
    match cli.command {
        Some(Sub::BaselineWorker(args)) => runtime.block_on(baseline::run(args)),
        None => runtime.block_on(bench(cli)),
    }
}

/// Everything a scenario needs.
struct Ctx {
    cluster: PgCluster,
    cfg: Config,
    http: reqwest::Client,
    clk_tck: f64,
    results: Results,
}

async fn bench(cli: Cli) -> anyhow::Result<()> {
    let mut cfg = Config::new(cli.quick, cli.no_1000);
    cfg.max_in_flight = cli.mif.clone();
    cfg.sinks = cli.sinks.clone();
    cfg.baselines = !cli.no_baselines;
    if let Some(rates) = &cli.rates {
        cfg.latency_rates = rates.clone();
    }
    if let Some(t) = cli.relay_threads {
        RELAY_THREADS.get_or_init(|| t);
    }
    if let Some(s) = cli.latency_s {
        cfg.latency_window_s = s;
    }
    let started = Instant::now();
    eprintln!("bench: building the workspace binaries (release under --release)");
    tokio::task::spawn_blocking(|| {
        for bin in harness::bins::WORKSPACE_BINS {
            harness::bins::path(bin);
        }
    })
    .await?;
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    eprintln!("bench: starting a throwaway cluster (fsync on, track_commit_timestamp on)");
    let cluster = tokio::task::spawn_blocking(|| {
        PgCluster::start(ClusterOptions {
            fsync: true,
            max_slot_wal_keep_size: Some("10GB".to_owned()),
            extra_settings: vec![("track_commit_timestamp".to_owned(), "on".to_owned())],
            ..ClusterOptions::default()
        })
    })
    .await??;
    let admin = cluster.connect_superuser("postgres").await?;
    let pg_version: String = admin.query_one("SHOW server_version", &[]).await?.get(0);
    let preload: String = admin
        .query_one("SHOW shared_preload_libraries", &[])
        .await?
        .get(0);
    let has_pgss = preload.contains("pg_stat_statements");
    if has_pgss {
        admin
            .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .await?;
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(512)
        .build()?;
    let mut ctx = Ctx {
        cluster,
        cfg: cfg.clone(),
        http,
        clk_tck: clk_tck(),
        results: Results::default(),
    };
    let want = |s: &str| cli.only.iter().any(|o| o == s);
    for run in 0..cli.runs {
        eprintln!("bench: run {}/{}", run + 1, cli.runs);
        if want("a") {
            latency(&mut ctx, run).await?;
        }
        if want("b") || want("d") {
            throughput(&mut ctx, run, want("b"), want("d")).await?;
        }
        if want("c") {
            idle(&mut ctx, has_pgss).await?;
        }
        if want("e") {
            recovery(&mut ctx, run).await?;
        }
    }
    set_targets(&mut ctx.results);
    derived_rows(&mut ctx.results);
    let load_after = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let machine = machine_info(&pg_version, has_pgss, &load_before, &load_after);
    let table = render_table(&ctx.results);
    println!("{table}");
    for n in &ctx.results.notes {
        println!("note: {n}");
    }
    let json = to_json(&ctx.results, &machine, &cfg, cli.quick, cli.runs, started);
    if let Some(dir) = cli.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&cli.out, serde_json::to_string_pretty(&json)?)?;
    eprintln!(
        "bench: wrote {} in {:.0} s",
        cli.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

// ---------------------------------------------------------------- stacks

/// A fresh pair of databases with seeded tables (10k published orders, so
/// plans are those of a used database); with `slot`, `cdc-relay setup` runs
/// after the seed, so the relay never sees it. `orders_app` may UPDATE the
/// outbox (the baseline needs it; the product's roles.sql does not grant it).
async fn fresh_stack(ctx: &Ctx, slot: bool) -> anyhow::Result<Stack> {
    let stack = ctx.cluster.create_stack().await?;
    let db = stack.orders_admin().await?;
    db.batch_execute(&format!(
        "INSERT INTO orders (id, amount_cents, currency, created_at)
           SELECT gen_random_uuid(), 1000 + i, 'EUR', now() - interval '1 day'
           FROM generate_series(1, {n}) i;
         INSERT INTO outbox (id, aggregate_id, event_type, payload, occurred_at, published_at)
           SELECT gen_random_uuid(), id, 'OrderCreated',
                  jsonb_build_object('order_id', id, 'amount_cents', amount_cents, 'currency', currency),
                  created_at, created_at
           FROM orders;
         ANALYZE orders; ANALYZE outbox;
         GRANT UPDATE ON outbox TO orders_app;",
        n = ctx.cfg.seed_orders
    ))
    .await
    .context("seeding the orders database")?;
    if slot {
        app::relay_setup(&stack).await?;
    }
    Ok(stack)
}

/// Drops the slot (once its walsender is gone) and both databases.
async fn drop_stack(ctx: &Ctx, stack: &Stack) {
    let Ok(admin) = ctx.cluster.connect_superuser("postgres").await else {
        return;
    };
    for _ in 0..50 {
        let r = admin
            .query(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                 WHERE slot_name = $1 AND NOT active",
                &[&stack.slot],
            )
            .await;
        let gone: bool = admin
            .query_one(
                "SELECT NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
                &[&stack.slot],
            )
            .await
            .map(|r| r.get(0))
            .unwrap_or(true);
        if r.is_ok() && gone {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for db in [&stack.orders_db, &stack.billing_db] {
        if let Err(err) = admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
            .await
        {
            eprintln!("    (could not drop {db}: {err})");
        }
    }
}

/// Inserts `n` outbox rows, each with its order in its own transaction
/// (synchronous_commit off for the loader only), in chunks.
async fn insert_backlog(stack: &Stack, n: u64) -> anyhow::Result<()> {
    let db = stack.orders_admin().await?;
    db.batch_execute("SET synchronous_commit = off").await?;
    let t = Instant::now();
    let chunk = 50_000;
    let mut done = 0;
    while done < n {
        let k = chunk.min(n - done);
        db.batch_execute(&format!(
            "DO $$ DECLARE o uuid; BEGIN
               FOR i IN 1..{k} LOOP
                 o := gen_random_uuid();
                 INSERT INTO orders (id, amount_cents, currency) VALUES (o, 1000 + i % 5000, 'EUR');
                 INSERT INTO outbox (id, aggregate_id, event_type, payload)
                   VALUES (gen_random_uuid(), o, 'OrderCreated',
                           jsonb_build_object('order_id', o, 'amount_cents', 1000 + i % 5000, 'currency', 'EUR'));
                 COMMIT;
               END LOOP; END $$"
        ))
        .await
        .context("inserting the backlog")?;
        done += k;
    }
    db.batch_execute("ANALYZE orders; ANALYZE outbox").await?;
    eprintln!(
        "    backlog of {n} rows inserted in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

// ---------------------------------------------------------------- contenders

enum Proc {
    Ours(Running),
    Base(ServiceProcess),
}

impl Proc {
    fn pid(&self) -> u32 {
        match self {
            Proc::Ours(r) => r.process.pid(),
            Proc::Base(p) => p.pid(),
        }
    }

    fn admin_url(&self) -> Option<&str> {
        match self {
            Proc::Ours(r) => Some(&r.url),
            Proc::Base(_) => None,
        }
    }
}

/// `--relay-threads`, set once before any scenario runs.
static RELAY_THREADS: std::sync::OnceLock<u16> = std::sync::OnceLock::new();

async fn start_contender(stack: &Stack, who: Contender, sink_url: &str) -> anyhow::Result<Proc> {
    match who {
        Contender::Ours { max_in_flight } => {
            let mif = max_in_flight.to_string();
            // Info level: the harness's default (debug) logs every event.
            let mut args = vec![
                "--max-in-flight".to_owned(),
                mif,
                "--log".to_owned(),
                "info,pgwire_replication=off".to_owned(),
            ];
            if let Some(t) = RELAY_THREADS.get() {
                args.extend(["--worker-threads".to_owned(), t.to_string()]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let relay = app::start_relay(stack, sink_url, &args).await?;
            app::wait_streaming(&relay).await?;
            Ok(Proc::Ours(relay))
        }
        Contender::Baseline { workers, poll_ms } => {
            let exe = std::env::current_exe()?;
            let workers = workers.to_string();
            let poll = poll_ms.to_string();
            let p = ServiceProcess::spawn(
                exe,
                &[
                    "baseline-worker",
                    "--db-url",
                    &stack.orders_app_url,
                    "--sink-url",
                    sink_url,
                    "--workers",
                    &workers,
                    "--poll-ms",
                    &poll,
                ],
                &[("EVENT_SECRET", TEST_SECRET)],
            )?;
            p.wait_for_line("baseline ready", Duration::from_secs(30))
                .await?;
            Ok(Proc::Base(p))
        }
    }
}

/// `/proc/PID/status` field in kB (VmRSS, VmHWM).
fn proc_kb(pid: u32, field: &str) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// utime + stime of PID, seconds.
fn proc_cpu_s(pid: u32, clk_tck: f64) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces) start after ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state); utime is field 14, stime field 15.
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / clk_tck)
}

fn clk_tck() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

// ---------------------------------------------------------------- sinks

/// A minimal in-process HTTP server answering 204 to every POST /inbox,
/// counting requests and recording nothing else.
struct NullSink {
    url: String,
    count: Arc<AtomicU64>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn null_sink() -> anyhow::Result<NullSink> {
    async fn handle(State(count): State<Arc<AtomicU64>>, _body: Bytes) -> StatusCode {
        count.fetch_add(1, Ordering::Relaxed);
        StatusCode::NO_CONTENT
    }
    let count = Arc::new(AtomicU64::new(0));
    let app = Router::new()
        .route("/inbox", post(handle))
        .with_state(Arc::clone(&count));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = harness::sink::serve(listener, app);
    Ok(NullSink {
        url: format!("http://{addr}/inbox"),
        count,
        _stop: stop,
    })
}

async fn billing_invoiced(http: &reqwest::Client, billing: &Running) -> anyhow::Result<u64> {
    let m = prom::scrape(http, &billing.url).await?;
    Ok(m.sum("billing_invoices_created_total") as u64)
}

// ---------------------------------------------------------------- load

/// Posts orders through Orders' API, one per tick at `rate`/s, for
/// `duration`; at most 512 outstanding (then the ticker waits, lowering the
/// rate). Returns the order ids and the achieved rate.
async fn post_at_rate(
    http: &reqwest::Client,
    orders_url: &str,
    rate: f64,
    duration: Duration,
) -> anyhow::Result<(Vec<Uuid>, f64, usize)> {
    let sem = Arc::new(Semaphore::new(512));
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    ticker.set_missed_tick_behavior(MissedTickBehavior::Burst);
    let total = (rate * duration.as_secs_f64()).round() as usize;
    let mut set = JoinSet::new();
    let t = Instant::now();
    for _ in 0..total {
        ticker.tick().await;
        let permit = Arc::clone(&sem).acquire_owned().await?;
        let http = http.clone();
        let url = orders_url.to_owned();
        set.spawn(async move {
            let r = app::post_order(&http, &url, 2599).await;
            drop(permit);
            r
        });
    }
    let posting = t.elapsed().as_secs_f64();
    let mut ids = Vec::with_capacity(total);
    let mut errors = 0;
    while let Some(r) = set.join_next().await {
        match r? {
            Ok((order, _)) => ids.push(order.parse()?),
            Err(_) => errors += 1,
        }
    }
    Ok((ids, total as f64 / posting.max(1e-9), errors))
}

/// Waits until Billing holds `n` invoices in total or `cap` passes.
async fn wait_invoices(stack: &Stack, n: u64, cap: Duration) -> anyhow::Result<u64> {
    let db = stack.billing_admin().await?;
    let deadline = Instant::now() + cap;
    loop {
        let c: i64 = db
            .query_one("SELECT count(*) FROM invoices", &[])
            .await?
            .get(0);
        if c as u64 >= n || Instant::now() >= deadline {
            return Ok(c as u64);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------- a. latency

async fn latency(ctx: &mut Ctx, run: u32) -> anyhow::Result<()> {
    let rates = ctx.cfg.latency_rates.clone();
    let mut order = Contender::all_default();
    if !ctx.cfg.baselines {
        order.retain(|c| c.is_ours());
    }
    let len = order.len();
    order.rotate_left(run as usize % len);
    for rate in rates {
        for &who in &order {
            eprintln!("  a. latency at {rate}/s: {}", who.column());
            if let Err(err) = latency_one(ctx, who, rate).await {
                ctx.results
                    .note(format!("a {rate}/s {} failed: {err:#}", who.column()));
            }
        }
    }
    Ok(())
}

async fn latency_one(ctx: &mut Ctx, who: Contender, rate: u32) -> anyhow::Result<()> {
    let stack = fresh_stack(ctx, who.is_ours()).await?;
    let billing = app::start_billing(&stack, TEST_SECRET).await?;
    let orders = app::start_orders(&stack).await?;
    let proc = start_contender(&stack, who, &format!("{}/inbox", billing.url)).await?;
    // Warm-up: connections, plans, the relay's HTTP pool.
    let (warm, _, _) =
        post_at_rate(&ctx.http, &orders.url, 50.0, Duration::from_millis(1000)).await?;
    wait_invoices(&stack, warm.len() as u64, Duration::from_secs(30)).await?;
    let before = match proc.admin_url() {
        Some(u) => Some(prom::scrape(&ctx.http, u).await?),
        None => None,
    };
    let window = Duration::from_secs(ctx.cfg.latency_window_s);
    let (ids, achieved, errors) =
        post_at_rate(&ctx.http, &orders.url, f64::from(rate), window).await?;
    let expected = (warm.len() + ids.len()) as u64;
    let cap = Duration::from_secs(if rate >= 1000 { 60 } else { 30 });
    let got = wait_invoices(&stack, expected, cap).await?;
    let undelivered = expected.saturating_sub(got);

    // Both timestamps from the one server clock.
    let o = stack.orders_admin().await?;
    let b = stack.billing_admin().await?;
    let sql_o = "SELECT id, floor(extract(epoch FROM created_at) * 1e6)::int8,
                        floor(extract(epoch FROM pg_xact_commit_timestamp(xmin)) * 1e6)::int8
                 FROM orders WHERE id = ANY($1)";
    let sql_b = "SELECT order_id, floor(extract(epoch FROM created_at) * 1e6)::int8,
                        floor(extract(epoch FROM pg_xact_commit_timestamp(xmin)) * 1e6)::int8
                 FROM invoices WHERE order_id = ANY($1)";
    let ord: BTreeMap<Uuid, (i64, Option<i64>)> = o
        .query(sql_o, &[&ids])
        .await?
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect();
    let mut created = Vec::new();
    let mut committed = Vec::new();
    // (latency ms, order created_at µs) of every order, for the slowest-events note.
    let mut timeline: Vec<(f64, i64)> = Vec::new();
    for r in b.query(sql_b, &[&ids]).await? {
        let id: Uuid = r.get(0);
        let (bc, bx): (i64, Option<i64>) = (r.get(1), r.get(2));
        if let Some((oc, ox)) = ord.get(&id) {
            created.push((bc - oc) as f64 / 1000.0);
            timeline.push(((bc - oc) as f64 / 1000.0, *oc));
            if let (Some(bx), Some(ox)) = (bx, ox) {
                committed.push((bx - ox) as f64 / 1000.0);
            }
        }
    }
    let scen = format!("a. latency @{rate}/s");
    let col = who.column();
    if who.is_ours() && !timeline.is_empty() {
        // When the slowest orders were created, in seconds from the first
        // order of the window: periodic work in the relay would line up.
        let t0 = timeline.iter().map(|t| t.1).min().unwrap_or(0);
        timeline.sort_by(|a, b| b.0.total_cmp(&a.0));
        let slow: Vec<String> = timeline
            .iter()
            .take(5)
            .map(|(ms, at)| format!("{ms:.1} ms at +{:.2} s", (at - t0) as f64 / 1e6))
            .collect();
        ctx.results.note(format!(
            "{scen} {col}: slowest of {} orders: {}",
            timeline.len(),
            slow.join(", ")
        ));
    }
    if let Some(q) = stats::quantiles(&created) {
        for (name, v) in ["p50", "p90", "p99", "max"].iter().zip(q) {
            ctx.results.add(
                &scen,
                &format!("created_at→created_at {name}"),
                "ms",
                col,
                v,
            );
        }
    }
    if let Some(q) = stats::quantiles(&committed) {
        for (name, v) in ["p50", "p99"].iter().zip([q[0], q[2]]) {
            ctx.results
                .add(&scen, &format!("commit→commit {name}"), "ms", col, v);
        }
    }
    if let (Some(before), Some(url)) = (before, proc.admin_url()) {
        let after = prom::scrape(&ctx.http, url).await?;
        let name = "cdc_relay_commit_to_delivery_seconds";
        let d = prom::bucket_delta(&before.buckets(name), &after.buckets(name));
        for (label, q) in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)] {
            if let Some(v) = prom::histogram_quantile(&d, q) {
                ctx.results.add(
                    &scen,
                    &format!("relay histogram {label}"),
                    "ms",
                    col,
                    v * 1000.0,
                );
            }
        }
    }
    ctx.results
        .add(&scen, "orders posted/s (achieved)", "/s", col, achieved);
    if undelivered > 0 || errors > 0 {
        ctx.results.note(format!(
            "{scen} {col}: {undelivered} of {expected} orders not invoiced after {} s, {errors} POST errors \
             (percentiles are over invoiced orders only: a lower bound)",
            cap.as_secs()
        ));
    }
    drop(proc);
    drop(orders);
    drop(billing);
    drop_stack(ctx, &stack).await;
    Ok(())
}

// ---------------------------------------------------------------- b/d. throughput and memory

async fn throughput(ctx: &mut Ctx, run: u32, drains: bool, memory_big: bool) -> anyhow::Result<()> {
    let n = ctx.cfg.backlog;
    let mifs = ctx.cfg.max_in_flight.clone();
    let sinks = ctx.cfg.sinks.clone();
    let has = |s: &str| sinks.iter().any(|x| x == s);
    if drains && has("billing") {
        eprintln!("  b. Billing's own maximum insert rate");
        billing_max(ctx).await?;
    }
    let chosen = [(true, has("billing")), (false, has("null"))];
    for (to_billing, _) in chosen.into_iter().filter(|(_, on)| drains && *on) {
        let sink = if to_billing { "Billing" } else { "null sink" };
        let mut contenders: Vec<Contender> = mifs
            .iter()
            .map(|&m| Contender::Ours { max_in_flight: m })
            .collect();
        if ctx.cfg.baselines {
            contenders.extend(Contender::BASELINES);
        }
        let len = contenders.len();
        contenders.rotate_left(run as usize % len);
        for who in contenders {
            eprintln!("  b. drain {n} → {sink}: {who:?}");
            if let Err(err) = drain_one(ctx, who, to_billing, n, false).await {
                ctx.results
                    .note(format!("b {sink} {who:?} failed: {err:#}"));
            }
        }
    }
    if memory_big {
        let big = ctx.cfg.big_backlog;
        eprintln!("  d. drain {big} → null sink: ours (memory)");
        drain_one(ctx, Contender::OURS, false, big, true).await?;
    }
    Ok(())
}

async fn drain_one(
    ctx: &mut Ctx,
    who: Contender,
    to_billing: bool,
    n: u64,
    big: bool,
) -> anyhow::Result<()> {
    let stack = fresh_stack(ctx, who.is_ours()).await?;
    insert_backlog(&stack, n).await?;
    let null = null_sink().await?;
    let billing = if to_billing {
        Some(app::start_billing(&stack, TEST_SECRET).await?)
    } else {
        None
    };
    let sink_url = match &billing {
        Some(b) => format!("{}/inbox", b.url),
        None => null.url.clone(),
    };
    let proc = start_contender(&stack, who, &sink_url).await?;
    let pid = proc.pid();
    eprintln!("    draining (pid {pid})");
    let cap = Duration::from_secs(if who.is_ours() {
        ctx.cfg.drain_cap_s
    } else {
        ctx.cfg.baseline_window_s
    });
    let count = async |http: &reqwest::Client| -> anyhow::Result<u64> {
        match &billing {
            Some(b) => billing_invoiced(http, b).await,
            None => Ok(null.count.load(Ordering::Relaxed)),
        }
    };
    let t0 = Instant::now();
    let mut first: Option<(Instant, u64)> = None;
    let mut last;
    // The contender's CPU seconds at the first and the last observation.
    let mut cpu_first = None;
    let mut cpu_last = None;
    let mut rss_samples: Vec<(f64, f64)> = Vec::new();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let c = count(&ctx.http).await?;
        let now = Instant::now();
        let cpu = proc_cpu_s(pid, ctx.clk_tck);
        if let Some(kb) = proc_kb(pid, "VmRSS:") {
            rss_samples.push((c as f64 / n as f64, kb));
        }
        if c > 0 && first.is_none() {
            first = Some((now, c));
            cpu_first = cpu;
        }
        if first.is_some() {
            cpu_last = cpu;
        }
        last = (now, c);
        if c >= n || now - t0 >= cap {
            break;
        }
    }
    let hwm_mb = proc_kb(pid, "VmHWM:").unwrap_or(0.0) / 1024.0;
    let (f_at, f_c) = first.unwrap_or((t0, 0));
    let secs = (last.0 - f_at).as_secs_f64();
    let rate = if secs > 0.0 {
        (last.1 - f_c) as f64 / secs
    } else {
        0.0
    };
    let sink = if to_billing { "Billing" } else { "null sink" };
    let col = who.column();
    if big {
        let scen = "d. memory";
        ctx.results.add(
            scen,
            &format!("peak RSS, {n} backlog → null"),
            "MB",
            col,
            hwm_mb,
        );
        // Flatness: RSS while the first and the last fifth of the backlog drained.
        let max_in = |lo: f64, hi: f64| {
            rss_samples
                .iter()
                .filter(|(f, _)| *f >= lo && *f < hi)
                .map(|(_, kb)| kb / 1024.0)
                .fold(0.0, f64::max)
        };
        ctx.results
            .add(scen, "RSS first 20% of drain", "MB", col, max_in(0.0, 0.2));
        ctx.results
            .add(scen, "RSS last 20% of drain", "MB", col, max_in(0.8, 1.01));
        ctx.results.add(
            scen,
            &format!("drain rate, {n} backlog → null"),
            "ev/s",
            col,
            rate,
        );
    } else {
        let scen = format!("b. throughput → {sink}");
        let metric = match who {
            Contender::Ours { max_in_flight } => format!("max-in-flight {max_in_flight}"),
            Contender::Baseline { .. } => "baseline (fixed)".to_owned(),
        };
        ctx.results.add(&scen, &metric, "ev/s", col, rate);
        let row = ctx.results.row(&scen, &metric, "ev/s");
        if who.is_ours() {
            row.baseline_from = Some(Results::key(&scen, "baseline (fixed)"));
        }
        // CPU per event: steadier than the rate on a shared box (it does not
        // depend on how much CPU the neighbours left).
        if let (Some(a), Some(b)) = (cpu_first, cpu_last)
            && last.1 > f_c
        {
            let us = (b - a) * 1e6 / (last.1 - f_c) as f64;
            let cmetric = match who {
                Contender::Ours { max_in_flight } => format!("CPU per event, mif {max_in_flight}"),
                Contender::Baseline { .. } => "CPU per event (baseline)".to_owned(),
            };
            ctx.results.add(&scen, &cmetric, "µs", col, us);
            if who.is_ours() {
                ctx.results.row(&scen, &cmetric, "µs").baseline_from =
                    Some(Results::key(&scen, "CPU per event (baseline)"));
            }
        }
        let mscen = "d. memory";
        let mmetric = match who {
            Contender::Ours { max_in_flight } => format!("peak RSS → {sink}, mif {max_in_flight}"),
            Contender::Baseline { .. } => format!("peak RSS → {sink} (baseline)"),
        };
        ctx.results.add(mscen, &mmetric, "MB", col, hwm_mb);
        if who.is_ours() {
            ctx.results.row(mscen, &mmetric, "MB").baseline_from = Some(Results::key(
                mscen,
                &format!("peak RSS → {sink} (baseline)"),
            ));
        }
        if who.is_ours() && last.1 < n {
            ctx.results.note(format!(
                "{scen} {metric}: only {} of {n} drained within the {} s cap",
                last.1,
                cap.as_secs()
            ));
        }
    }
    drop(proc);
    drop(billing);
    drop_stack(ctx, &stack).await;
    Ok(())
}

/// Drives Billing's POST /inbox directly with correctly signed, distinct
/// events at several concurrencies; the best rate is the ceiling.
async fn billing_max(ctx: &mut Ctx) -> anyhow::Result<()> {
    let total = ctx.cfg.billing_max_requests;
    for conc in ctx.cfg.billing_max_concurrency.clone() {
        let stack = ctx.cluster.create_stack().await?;
        let billing = app::start_billing(&stack, TEST_SECRET).await?;
        let url = format!("{}/inbox", billing.url);
        let next = Arc::new(AtomicU64::new(0));
        // Warm-up of 500 requests, not counted.
        drive_billing(&ctx.http, &url, 500, 32, &Arc::new(AtomicU64::new(0))).await?;
        let t = Instant::now();
        let errors = drive_billing(&ctx.http, &url, total, conc, &next).await?;
        let rate = total as f64 / t.elapsed().as_secs_f64();
        ctx.results.add(
            "b. throughput → Billing",
            &format!("Billing max, direct, concurrency {conc}"),
            "ev/s",
            "ours",
            rate,
        );
        if errors > 0 {
            ctx.results
                .note(format!("Billing max c={conc}: {errors} non-2xx answers"));
        }
        drop(billing);
        drop_stack(ctx, &stack).await;
    }
    Ok(())
}

async fn drive_billing(
    http: &reqwest::Client,
    url: &str,
    total: u64,
    conc: usize,
    next: &Arc<AtomicU64>,
) -> anyhow::Result<u64> {
    let errors = Arc::new(AtomicU64::new(0));
    let mut set = JoinSet::new();
    for _ in 0..conc {
        let (http, url, next, errors) = (
            http.clone(),
            url.to_owned(),
            Arc::clone(next),
            Arc::clone(&errors),
        );
        set.spawn(async move {
            let mac = Hmac::<Sha256>::new_from_slice(TEST_SECRET.as_bytes()).expect("any key");
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let body = format!(
                    r#"{{"id":"{}","type":"OrderCreated","data":{{"order_id":"{}","amount_cents":2599,"currency":"EUR"}}}}"#,
                    Uuid::new_v4(),
                    Uuid::new_v4()
                );
                let sig = hex::encode(mac.clone().chain_update(body.as_bytes()).finalize().into_bytes());
                let ok = match http
                    .post(&url)
                    .header("content-type", "application/json")
                    .header("x-event-signature", sig)
                    .body(body)
                    .send()
                    .await
                {
                    Ok(r) => r.status().is_success(),
                    Err(_) => false,
                };
                if !ok {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
    while set.join_next().await.is_some() {}
    Ok(errors.load(Ordering::Relaxed))
}

// ---------------------------------------------------------------- c. idle

struct IdleProbe {
    who: Contender,
    stack: Stack,
    proc: Proc,
    _billing: Running,
}

async fn idle(ctx: &mut Ctx, has_pgss: bool) -> anyhow::Result<()> {
    eprintln!(
        "  c. idle cost over {} s (every contender at once, each on its own databases)",
        ctx.cfg.idle_window_s
    );
    let mut probes = Vec::new();
    for who in Contender::all_default() {
        let stack = fresh_stack(ctx, who.is_ours()).await?;
        let billing = app::start_billing(&stack, TEST_SECRET).await?;
        let proc = start_contender(&stack, who, &format!("{}/inbox", billing.url)).await?;
        probes.push(IdleProbe {
            who,
            stack,
            proc,
            _billing: billing,
        });
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let admin = ctx.cluster.connect_superuser("postgres").await?;
    let snapshot = async |p: &IdleProbe| -> anyhow::Result<(f64, f64, f64)> {
        let calls: f64 = if has_pgss {
            admin
                .query_one(
                    "SELECT coalesce(sum(calls), 0)::float8 FROM pg_stat_statements s
                     JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = $1",
                    &[&p.stack.orders_db],
                )
                .await?
                .get(0)
        } else {
            f64::NAN
        };
        let xacts: f64 = admin
            .query_one(
                "SELECT (xact_commit + xact_rollback)::float8 FROM pg_stat_database WHERE datname = $1",
                &[&p.stack.orders_db],
            )
            .await?
            .get(0);
        let cpu = proc_cpu_s(p.proc.pid(), ctx.clk_tck).unwrap_or(f64::NAN);
        Ok((calls, xacts, cpu))
    };
    let mut before = Vec::new();
    for p in &probes {
        before.push(snapshot(p).await?);
    }
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(ctx.cfg.idle_window_s)).await;
    let mut after = Vec::new();
    for p in &probes {
        after.push(snapshot(p).await?);
    }
    let secs = t.elapsed().as_secs_f64();
    let mut top = Vec::new();
    for ((p, b), a) in probes.iter().zip(&before).zip(&after) {
        let col = p.who.column();
        if has_pgss {
            ctx.results.add(
                "c. idle",
                "statements/s on orders db (pg_stat_statements)",
                "/s",
                col,
                (a.0 - b.0) / secs,
            );
        }
        ctx.results.add(
            "c. idle",
            "transactions/s on orders db (pg_stat_database)",
            "/s",
            col,
            (a.1 - b.1) / secs,
        );
        ctx.results.add(
            "c. idle",
            "CPU of the process",
            "%",
            col,
            (a.2 - b.2) / secs * 100.0,
        );
        if has_pgss && p.who.is_ours() {
            for r in admin
                .query(
                    "SELECT calls, left(regexp_replace(query, '\\s+', ' ', 'g'), 100)
                     FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
                     WHERE d.datname = $1 AND s.userid = 'cdc_relay'::regrole
                     ORDER BY calls DESC LIMIT 5",
                    &[&p.stack.orders_db],
                )
                .await?
            {
                let calls: i64 = r.get(0);
                let q: String = r.get(1);
                top.push(format!("{calls}× {q}"));
            }
        }
    }
    if !top.is_empty() {
        ctx.results.note(format!(
            "c. statements the cdc_relay role ran on the orders db since the relay started (pg_stat_statements): {}",
            top.join(" | ")
        ));
    }
    for p in probes {
        let stack = p.stack.clone();
        drop(p);
        drop_stack(ctx, &stack).await;
    }
    Ok(())
}

// ---------------------------------------------------------------- e. recovery

async fn recovery(ctx: &mut Ctx, run: u32) -> anyhow::Result<()> {
    let mut order = vec![Contender::OURS, Contender::BASELINES[0]];
    order.rotate_left(run as usize % 2);
    for who in order {
        eprintln!("  e. Billing down {} s: {}", ctx.cfg.outage_s, who.column());
        if let Err(err) = recovery_one(ctx, who).await {
            ctx.results
                .note(format!("e {} failed: {err:#}", who.column()));
        }
    }
    Ok(())
}

async fn recovery_one(ctx: &mut Ctx, who: Contender) -> anyhow::Result<()> {
    let stack = fresh_stack(ctx, who.is_ours()).await?;
    let billing = app::start_billing(&stack, TEST_SECRET).await?;
    let orders = app::start_orders(&stack).await?;
    let proxy = ScriptedSink::proxy(&format!("{}/inbox", billing.url)).await?;
    let proc = start_contender(&stack, who, &proxy.url).await?;
    let settle = Duration::from_secs(3);
    let outage = Duration::from_secs(ctx.cfg.outage_s);
    let rate = 20.0;
    let poster = {
        let (http, url) = (ctx.http.clone(), orders.url.clone());
        tokio::spawn(async move { post_at_rate(&http, &url, rate, settle + outage).await })
    };
    tokio::time::sleep(settle).await;
    proxy.set_status(503);
    let down_at = Instant::now();
    let arrivals_down = proxy.arrivals();
    tokio::time::sleep(outage).await;
    let arrivals_up = proxy.arrivals();
    proxy.set_status(204);
    let up_at = Instant::now();
    let (ids, _, errors) = poster.await??;
    let outage_s = (up_at - down_at).as_secs_f64();
    // Every order posted (all before the return) must be invoiced.
    let got = wait_invoices(&stack, ids.len() as u64, Duration::from_secs(120)).await?;
    let drained_after = up_at.elapsed().as_secs_f64();
    let first = proxy
        .received()
        .iter()
        .filter(|r| r.at > up_at && (200..300).contains(&r.status))
        .map(|r| r.at)
        .min();
    let col = who.column();
    let scen = format!("e. recovery ({} s outage)", ctx.cfg.outage_s);
    if let Some(f) = first {
        ctx.results.add(
            &scen,
            "return → first invoice",
            "s",
            col,
            (f - up_at).as_secs_f64(),
        );
    }
    ctx.results.add(
        &scen,
        "return → outage backlog invoiced",
        "s",
        col,
        drained_after,
    );
    ctx.results.add(
        &scen,
        "requests/s to Billing during outage",
        "/s",
        col,
        (arrivals_up - arrivals_down) as f64 / outage_s,
    );
    if got < ids.len() as u64 || errors > 0 {
        ctx.results.note(format!(
            "{scen} {col}: {got} of {} invoiced, {errors} POST errors",
            ids.len()
        ));
    }
    drop(proc);
    drop(proxy);
    drop(orders);
    drop(billing);
    drop_stack(ctx, &stack).await;
    Ok(())
}

// ---------------------------------------------------------------- report

fn set_targets(r: &mut Results) {
    let lat = [(10, 3.0, 15.0), (100, 5.0, 25.0)];
    for (rate, p50, p99) in lat {
        let scen = format!("a. latency @{rate}/s");
        r.target(&scen, "created_at→created_at p50", Target::AtMost(p50));
        r.target(&scen, "created_at→created_at p99", Target::AtMost(p99));
    }
    for row in r.rows.iter_mut() {
        // The target holds for the default setting; --max-in-flight 1 is the
        // strict-order mode (one round trip at a time) and is not held to it.
        if row.scenario == "b. throughput → null sink" && row.metric == "max-in-flight 64" {
            row.target = Some(Target::AtLeast(30_000.0));
        }
        if row.scenario == "d. memory" && row.unit == "MB" && row.values.contains_key("ours") {
            row.target = Some(Target::AtMost(64.0));
        }
        if row.scenario == "c. idle" && row.metric.starts_with("statements/s") {
            row.target = Some(Target::AtMost(0.1));
        }
        if row.scenario.starts_with("e. recovery") {
            match row.metric.as_str() {
                "return → first invoice" => row.target = Some(Target::AtMost(0.5)),
                "requests/s to Billing during outage" => row.target = Some(Target::AtMost(2.0)),
                _ => {}
            }
        }
    }
}

/// Relative targets: ours → Billing against Billing's own maximum and the baseline.
fn derived_rows(r: &mut Results) {
    let scen = "b. throughput → Billing";
    let best = |r: &Results, prefix: &str| {
        r.rows
            .iter()
            .filter(|row| row.scenario == scen && row.metric.starts_with(prefix))
            .filter_map(|row| row.values.get("ours").and_then(|v| summarize(v)))
            .map(|s| s.median)
            .fold(f64::NAN, f64::max)
    };
    let ours = best(r, "max-in-flight");
    let ceiling = best(r, "Billing max");
    let base = r
        .summary(&Results::key(scen, "baseline (fixed)"), "baseline")
        .map(|s| s.median);
    if ours.is_finite() && ceiling.is_finite() {
        r.add(
            scen,
            "best ours / Billing max",
            "%",
            "ours",
            ours / ceiling * 100.0,
        );
        r.target(scen, "best ours / Billing max", Target::AtLeast(80.0));
    }
    if let Some(base) = base.filter(|b| *b > 0.0 && ours.is_finite()) {
        r.add(scen, "best ours / baseline", "×", "ours", ours / base);
        r.target(scen, "best ours / baseline", Target::AtLeast(20.0));
    }
    // d: flat under backlog: peak with the big backlog over peak with the small one.
    let big = r
        .rows
        .iter()
        .find(|row| row.scenario == "d. memory" && row.metric.starts_with("peak RSS, "))
        .and_then(|row| row.values.get("ours").and_then(|v| summarize(v)));
    let small = r.summary(
        &Results::key("d. memory", "peak RSS → null sink, mif 64"),
        "ours",
    );
    if let (Some(big), Some(small)) = (big, small) {
        r.add(
            "d. memory",
            "peak RSS big backlog / small backlog",
            "×",
            "ours",
            big.median / small.median,
        );
    }
}

fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        return "–".to_owned();
    }
    let a = v.abs();
    if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn fmt_summary(s: Option<Summary>) -> String {
    match s {
        None => String::new(),
        Some(s) if s.n == 1 => fmt_num(s.median),
        Some(s) => format!(
            "{} ({}–{}, n={})",
            fmt_num(s.median),
            fmt_num(s.min),
            fmt_num(s.max),
            s.n
        ),
    }
}

fn render_table(r: &Results) -> String {
    let header = [
        "scenario",
        "figure",
        "unit",
        "ours",
        "baseline",
        "ours/baseline",
        "baseline-100ms",
        "baseline-4w",
        "target",
        "met",
    ];
    let mut lines: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    for row in &r.rows {
        let ours = row.values.get("ours").and_then(|v| summarize(v));
        let base = r.baseline_of(row);
        let ratio = match (ours, base) {
            (Some(o), Some(b)) if b.median != 0.0 => fmt_num(o.median / b.median),
            _ => String::new(),
        };
        let col = |c: &str| fmt_summary(row.values.get(c).and_then(|v| summarize(v)));
        let (target, met) = match (row.target, ours) {
            (Some(t), Some(o)) => (
                t.show(),
                if t.met(o.median) { "yes" } else { "NO" }.to_owned(),
            ),
            (Some(t), None) => (t.show(), "?".to_owned()),
            _ => (String::new(), String::new()),
        };
        let base_col = if row.baseline_from.is_some() {
            base.map(|b| format!("{}*", fmt_num(b.median)))
                .unwrap_or_default()
        } else {
            col("baseline")
        };
        lines.push(vec![
            row.scenario.clone(),
            row.metric.clone(),
            row.unit.clone(),
            col("ours"),
            base_col,
            ratio,
            col("baseline-100ms"),
            col("baseline-4w"),
            target,
            met,
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            lines
                .iter()
                .map(|l| l[i].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for (n, l) in lines.iter().enumerate() {
        out.push('|');
        for (i, cell) in l.iter().enumerate() {
            out.push_str(&format!(" {cell:<w$} |", w = widths[i]));
        }
        out.push('\n');
        if n == 0 {
            out.push('|');
            for w in &widths {
                out.push_str(&format!("{}|", "-".repeat(w + 2)));
            }
            out.push('\n');
        }
    }
    out.push_str(
        "* the baseline's figure for the same sink (its throughput does not depend on --max-in-flight)\n",
    );
    out
}

fn machine_info(pg: &str, pgss: bool, load_before: &str, load_after: &str) -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .map(|l| l.split_whitespace().nth(1).unwrap_or("").to_owned())
        .unwrap_or_default();
    json!({
        "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu_model": model,
        "mem_total_kb": mem,
        "postgresql": pg,
        "pg_stat_statements": pgss,
        "loadavg_before": load_before.trim(),
        "loadavg_after": load_after.trim(),
    })
}

fn to_json(
    r: &Results,
    machine: &Value,
    cfg: &Config,
    quick: bool,
    runs: u32,
    started: Instant,
) -> Value {
    let rows: Vec<Value> = r
        .rows
        .iter()
        .map(|row| {
            let mut contenders = serde_json::Map::new();
            for c in COLUMNS {
                if let Some(v) = row.values.get(c) {
                    let s = summarize(v);
                    contenders.insert(
                        c.to_owned(),
                        json!({
                            "values": v,
                            "median": s.map(|s| s.median),
                            "min": s.map(|s| s.min),
                            "max": s.map(|s| s.max),
                            "runs": v.len(),
                        }),
                    );
                }
            }
            let ours = row.values.get("ours").and_then(|v| summarize(v));
            let base = r.baseline_of(row);
            let ratio = match (ours, base) {
                (Some(o), Some(b)) if b.median != 0.0 => Some(o.median / b.median),
                _ => None,
            };
            json!({
                "scenario": row.scenario,
                "figure": row.metric,
                "unit": row.unit,
                "contenders": contenders,
                "baseline_median": base.map(|b| b.median),
                "ratio_ours_over_baseline": ratio,
                "target": row.target.map(|t| t.show()),
                "met": match (row.target, ours) {
                    (Some(t), Some(o)) => Some(t.met(o.median)),
                    _ => None,
                },
            })
        })
        .collect();
    json!({
        "machine": machine,
        "quick": quick,
        "runs": runs,
        "config": cfg,
        "elapsed_s": started.elapsed().as_secs_f64(),
        "rows": rows,
        "notes": r.notes,
    })
}
