//! `bench`: cdc-relay against a faithful port of the tutorial's polling relay,
//! side by side in one run, on a throwaway PostgreSQL cluster with fsync ON.
//!
//! ```text
//! cargo run --release -p cdc-relay-tests --bin bench -- --quick          # ~11 min
//! cargo run --release -p cdc-relay-tests --bin bench                     # full, ~20 min
//!     [--runs N] [--only a,b,c,d,e] [--out target/bench.json]
//!     [--sinks billing,null] [--mif 16,64] [--rates 10 --latency-s 60]
//!     [--no-baselines] [--relay-threads N]                # focused runs
//!     [--signature-schemes legacy,both]                   # A/B of the signing cost (b)
//!     [--traced]                                          # b with trace contexts and an OTLP collector
//!     [--iso-window-s 600 --iso-runs healthy,frozen,frozen-no-lag]   # scenario j
//!     [--iso-raw target/bench-j]                          # j's raw latencies and readings
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
//!   invoiced, and requests/s sent during the outage;
//! - **f** retention (issue 17): `cdc-relay prune` deleting a delivered,
//!   month-old backlog (1,000,000 rows; 100,000 with `--quick`) while the
//!   relay delivers 1000 orders/s to a null sink: the relay's commit→2xx
//!   p99 with and without the prune running, and the prune's rate;
//! - **g** scaling with shards (issue 16): a backlog drained by one
//!   unsharded relay, then by 2 and 4 relays over `--shards N`
//!   (`--max-shards 1` each), every relay on one worker thread at
//!   `--max-in-flight 4`, into a sink answering after a fixed 2 ms:
//!   delivered events/s, the speed-up over one relay, and the walsenders'
//!   CPU per event (each slot decodes the whole WAL);
//! - **h** dead-letter replay (issue 15): `cdc-relay dead-letter replay --all`
//!   of 100,000 `OrderCreated` dead letters (20,000 with `--quick`) to real
//!   Billing, at `--replay-mif` (default 64): rows delivered, removed and
//!   audited per second of the command's run;
//! - **i** routing's own cost (issue 15): the scenario-b backlog drained into
//!   the null sink by `run --sink-url` and by `run --routes` with one
//!   endpoint taking `*`, alternating, `--parity-pairs` pairs: both medians
//!   and their ratio (target ≥ 0.95);
//! - **j** isolation and the WAL budget (issue 15): three endpoints of one
//!   routes file (billing, shipping, audit, each a recording sink process)
//!   at 500 orders/s for `--iso-window-s` (600; 60 with `--quick`), all
//!   healthy, then with billing's sink frozen (SIGSTOP) and parked by its
//!   `max_lag`, then frozen without `max_lag` (parked by
//!   `--max-retained-wal` only): the healthy endpoints' commit→2xx
//!   p50/p99/max, their p99 ratio frozen / healthy (target ≤ 1.2), the
//!   slot's retained WAL sampled every second against the budget, and
//!   billing's parked events.
//!
//! The baseline (see `baseline.rs`) runs as a child process of this
//! binary (`bench baseline-worker`), in three variants: the tutorial's 250 ms
//! poll with one worker, a 100 ms poll, and four workers. Scenario j's
//! sinks do too (`bench sink-worker`, `recording_sink.rs`), so that one can
//! be stopped with SIGSTOP.
//!
//! Layout: one module per scenario (`latency`, `throughput` for b and d,
//! `idle`, `recovery`), what they share (`workload`: databases, backlogs,
//! load, the null sink; `contender`: starting and measuring who delivers),
//! and the figures (`results`, with the targets; `report`: table and JSON;
//! `stats`: summaries of repeated runs).

mod baseline;
mod contender;
mod idle;
mod isolation;
mod latency;
mod prune;
mod recording_sink;
mod recovery;
mod replay;
mod report;
mod results;
mod routes;
mod shards;
mod stats;
mod throughput;
mod workload;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use harness::otlp::Collector;
use harness::{ClusterOptions, PgCluster};

use crate::baseline::BaselineArgs;
use crate::contender::{RELAY_THREADS, clk_tck};
use crate::idle::idle;
use crate::isolation::{Run, isolation};
use crate::latency::latency;
use crate::prune::prune_under_load;
use crate::recording_sink::SinkWorkerArgs;
use crate::recovery::recovery;
use crate::replay::replay;
use crate::report::{machine_info, render_table, to_json};
use crate::results::{Results, derived_rows, set_targets};
use crate::routes::routes_parity;
use crate::shards::shards;
use crate::throughput::throughput;

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
    /// Scenarios to run (a,b,c,d,e,f,g,h,i,j).
    #[arg(long, value_delimiter = ',', default_value = "a,b,c,d,e,f,g,h,i,j")]
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
    /// Run ours in scenario b once per listed `--signature-scheme`, in an
    /// order that alternates from run to run (the A/B of the signing cost:
    /// `--only b --sinks null --no-baselines --signature-schemes legacy,both
    /// --runs N`).
    #[arg(long, value_delimiter = ',', value_parser = ["standard", "legacy", "both"])]
    signature_schemes: Vec<String>,
    /// Run ours in scenario b once per listed `--batch-max-events` (issue
    /// 31; above 1 the figures' names end in `, batch N`), and measure
    /// Billing's batch inbox directly with arrays of each listed size
    /// above 1 (`--only b --sinks billing --no-baselines --batches
    /// 1,16,64,256`). Scenario a then runs ours once per listed size too
    /// (`--only a --rates 10 --no-baselines --batches 1,64`: adaptive
    /// batching must not cost latency at a low rate).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=1000))]
    batches: Vec<u32>,
    /// Scenario b with tracing on: every backlog row gets a distinct,
    /// sampled `trace_context`, and ours exports a span per delivery to an
    /// OTLP/HTTP collector in this process (`--otlp-endpoint`); the
    /// figures' names end in `, traced` and the collector's span count is
    /// a figure of its own (the A/B of the tracing cost: `--only b --sinks
    /// null --mif 64 --no-baselines --traced`).
    #[arg(long)]
    traced: bool,
    /// Scenario g: the sink's service time, milliseconds.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(0..=1000))]
    shard_sink_ms: u64,
    /// Scenario g: every relay's `--max-in-flight`.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=4096))]
    shard_mif: u32,
    /// Scenario g: the backlog (default 60,000; 20,000 with --quick).
    #[arg(long)]
    shard_backlog: Option<u64>,
    /// Scenario h: the replay's `--max-in-flight` values.
    #[arg(long, value_delimiter = ',', default_value = "64",
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    replay_mif: Vec<u32>,
    /// Scenario h: dead letters replayed (default 100,000; 20,000 with --quick).
    #[arg(long)]
    replay_rows: Option<u64>,
    /// Scenario i: pairs of drains (--sink-url, --routes), default 3 (2 with --quick).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=20))]
    parity_pairs: Option<u32>,
    /// Scenario j: the window of each run, seconds (default 600; 60 with --quick).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=7200))]
    iso_window_s: Option<u64>,
    /// Scenario j: the runs, in this order (rotated by one per --runs).
    #[arg(long, value_delimiter = ',', default_value = "healthy,frozen,frozen-no-lag",
          value_parser = ["healthy", "frozen", "frozen-no-lag"])]
    iso_runs: Vec<String>,
    /// Scenario j: orders posted per second.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=5000))]
    iso_rate: u32,
    /// Scenario j: billing's `max_lag`, seconds.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    iso_max_lag_s: u64,
    /// Scenario j: the relay's `--max-retained-wal`, MiB.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    iso_budget_mib: u64,
    /// Scenario j: also write each run's latencies and readings as TSV
    /// files into this directory.
    #[arg(long)]
    iso_raw: Option<PathBuf>,
    /// Where the JSON goes.
    #[arg(long, default_value = "target/bench.json")]
    out: PathBuf,
}

#[derive(Debug, Subcommand)]
enum Sub {
    /// The tutorial's polling relay (started by the benchmark).
    #[command(hide = true)]
    BaselineWorker(BaselineArgs),
    /// A recording sink of scenario j (started by the benchmark).
    #[command(hide = true)]
    SinkWorker(SinkWorkerArgs),
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
    prune_rows: u64,
    prune_rate: f64,
    prune_window_s: u64,
    shard_backlog: u64,
    shard_sink_ms: u64,
    shard_mif: u32,
    replay_rows: u64,
    replay_mif: Vec<u32>,
    parity_pairs: u32,
    iso_window_s: u64,
    iso_runs: Vec<Run>,
    iso_rate: f64,
    iso_max_lag_s: u64,
    iso_budget_mib: u64,
    iso_raw: Option<PathBuf>,
    max_in_flight: Vec<u32>,
    billing_max_requests: u64,
    billing_max_concurrency: Vec<usize>,
    seed_orders: u64,
    sinks: Vec<String>,
    baselines: bool,
    signature_schemes: Vec<&'static str>,
    batches: Vec<u32>,
    traced: bool,
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
            prune_rows: if quick { 100_000 } else { 1_000_000 },
            prune_rate: 1000.0,
            prune_window_s: if quick { 10 } else { 30 },
            shard_backlog: if quick { 20_000 } else { 60_000 },
            shard_sink_ms: 2,
            shard_mif: 4,
            replay_rows: if quick { 20_000 } else { 100_000 },
            replay_mif: vec![64],
            parity_pairs: if quick { 2 } else { 3 },
            iso_window_s: if quick { 60 } else { 600 },
            iso_runs: vec![Run::Healthy, Run::Frozen, Run::FrozenNoLag],
            iso_rate: 500.0,
            iso_max_lag_s: 10,
            iso_budget_mib: 64,
            iso_raw: None,
            max_in_flight: Vec::new(),
            billing_max_requests: if quick { 20_000 } else { 100_000 },
            billing_max_concurrency: vec![16, 64, 256],
            seed_orders: 10_000,
            sinks: vec!["billing".to_owned(), "null".to_owned()],
            baselines: true,
            signature_schemes: Vec::new(),
            batches: Vec::new(),
            traced: false,
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
        Some(Sub::SinkWorker(args)) => runtime.block_on(recording_sink::run(args)),
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
    /// With `--traced`: the OTLP receiver scenario b's relays export to.
    collector: Option<Collector>,
}

async fn bench(cli: Cli) -> anyhow::Result<()> {
    let mut cfg = Config::new(cli.quick, cli.no_1000);
    cfg.max_in_flight = cli.mif.clone();
    cfg.sinks = cli.sinks.clone();
    cfg.baselines = !cli.no_baselines;
    cfg.signature_schemes = cli
        .signature_schemes
        .iter()
        .map(|s| match s.as_str() {
            "standard" => "standard",
            "legacy" => "legacy",
            _ => "both",
        })
        .collect();
    cfg.traced = cli.traced;
    cfg.batches = cli.batches.clone();
    if let Some(rates) = &cli.rates {
        cfg.latency_rates = rates.clone();
    }
    if let Some(t) = cli.relay_threads {
        RELAY_THREADS.get_or_init(|| t);
    }
    cfg.shard_sink_ms = cli.shard_sink_ms;
    cfg.shard_mif = cli.shard_mif;
    if let Some(n) = cli.shard_backlog {
        cfg.shard_backlog = n;
    }
    cfg.replay_mif = cli.replay_mif.clone();
    if let Some(n) = cli.replay_rows {
        cfg.replay_rows = n;
    }
    if let Some(n) = cli.parity_pairs {
        cfg.parity_pairs = n;
    }
    if let Some(s) = cli.latency_s {
        cfg.latency_window_s = s;
    }
    if let Some(s) = cli.iso_window_s {
        cfg.iso_window_s = s;
    }
    cfg.iso_runs = cli.iso_runs.iter().filter_map(|r| Run::parse(r)).collect();
    cfg.iso_rate = f64::from(cli.iso_rate);
    cfg.iso_max_lag_s = cli.iso_max_lag_s;
    cfg.iso_budget_mib = cli.iso_budget_mib;
    cfg.iso_raw = cli.iso_raw.clone();
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
    let collector = if cli.traced {
        Some(Collector::start().await?)
    } else {
        None
    };
    let mut ctx = Ctx {
        cluster,
        cfg: cfg.clone(),
        http,
        clk_tck: clk_tck(),
        results: Results::default(),
        collector,
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
        if want("f")
            && let Err(err) = prune_under_load(&mut ctx).await
        {
            ctx.results.note(format!("f failed: {err:#}"));
        }
        if want("g")
            && let Err(err) = shards(&mut ctx).await
        {
            ctx.results.note(format!("g failed: {err:#}"));
        }
        if want("h")
            && let Err(err) = replay(&mut ctx).await
        {
            ctx.results.note(format!("h failed: {err:#}"));
        }
        if want("i")
            && let Err(err) = routes_parity(&mut ctx).await
        {
            ctx.results.note(format!("i failed: {err:#}"));
        }
        if want("j")
            && let Err(err) = isolation(&mut ctx, run).await
        {
            ctx.results.note(format!("j failed: {err:#}"));
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
