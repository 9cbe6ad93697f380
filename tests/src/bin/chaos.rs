//! `chaos`: the full chaos run of issue 6 — a seeded "bad ten minutes"
//! (relay SIGKILLs every 15–20 s with a hot standby taking over, Billing and
//! Orders SIGKILLed and restarted, relay↔Billing and relay↔PostgreSQL
//! blackholes and resets, Billing 503 bursts, one PostgreSQL immediate
//! restart, one walsender terminated) under 100 orders/s, then the ledger.
//!
//! ```text
//! cargo run --release -p cdc-relay-tests --bin chaos -- [--seed N] [--duration 10m] [--rate 100]
//!                                                       [--out chaos.json] [--keep-logs DIR] [--no-fsync]
//!                                                       [--without-idempotency-key]
//! ```
//!
//! Prints the seed and the drawn schedule first, one line per fault as it
//! is applied, then the table; writes the JSON report to `--out`. Exit
//! status 1 when the ledger is not clean (lost, duplicate, phantom,
//! dead-lettered or accepted-but-not-committed is not 0), or an order was
//! charged twice or never at the payment provider. With
//! `--without-idempotency-key` Billing sends no key: the run counts the
//! double charges the key prevents (and exits 1 for them).
//!
//! `--shards N` runs issue 16's shard chaos instead
//! ([`chaos::shards`]): N shards streamed by 2 relays that may each hold
//! all of them, a random relay SIGKILLed every 10 s (and restarted) under
//! `--rate` orders/s plus a producer of 5 events per aggregate; exit 1 also
//! on a per-aggregate order violation or a takeover over 5 s.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use harness::chaos::shards::ShardConfig;
use harness::chaos::{self, Config};

#[derive(Debug, Parser)]
#[command(
    name = "chaos",
    about = "The seeded chaos run: faults under load, then the ledger"
)]
struct Args {
    /// Seed of the fault schedule (default: a random one, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Length of the fault phase, e.g. `10m`, `300s`, `90` (seconds).
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    duration: Duration,
    /// Orders per second through the Orders API.
    #[arg(long, default_value_t = 100)]
    rate: u32,
    /// Where to write the JSON report (default `chaos-<seed>.json`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Copy every process log and PostgreSQL's here (always done, to a
    /// temporary directory, when the ledger is not clean).
    #[arg(long)]
    keep_logs: Option<PathBuf>,
    /// Run PostgreSQL with fsync off (the full run keeps it on).
    #[arg(long)]
    no_fsync: bool,
    /// The comparison run: Billing sends no Idempotency-Key to the payment
    /// provider, and the report counts the double charges it prevents
    /// (the ledger is then not clean, on purpose).
    #[arg(long)]
    without_idempotency_key: bool,
    /// Issue 16's shard chaos over this many shards instead of the fault
    /// schedule.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    shards: Option<u32>,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map_or((s, "s"), |i| s.split_at(i));
    let n: f64 = num.parse().map_err(|_| format!("not a duration: {s:?}"))?;
    let secs = match unit {
        "s" => n,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("unknown unit in {s:?} (use s, m or h)")),
    };
    Ok(Duration::from_secs_f64(secs))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(rand::random);
    if let Some(shards) = args.shards {
        return shard_chaos(args, seed, shards).await;
    }
    let mut cfg = Config::full(seed, args.duration, args.rate);
    cfg.fsync = !args.no_fsync;
    cfg.keep_logs = args.keep_logs;
    cfg.idempotency_key = !args.without_idempotency_key;
    let report = match chaos::run(&cfg).await {
        Ok(r) => r,
        Err(err) => {
            eprintln!("chaos: the run could not be set up: {err:#}");
            return ExitCode::FAILURE;
        }
    };
    println!("{}", report.table());
    let out = args
        .out
        .unwrap_or_else(|| PathBuf::from(format!("chaos-{seed}.json")));
    if let Err(err) = chaos::write_json(&report, &out) {
        eprintln!("chaos: {err:#}");
    } else {
        println!("JSON report: {}", out.display());
    }
    if let Some(logs) = &report.logs {
        println!("process logs: {logs}");
    }
    if report.passed() {
        println!(
            "ledger clean: nothing lost, no order invoiced or charged twice, none left uncharged, no phantom, nothing dead-lettered"
        );
        ExitCode::SUCCESS
    } else {
        println!("LEDGER NOT CLEAN (seed {seed})");
        ExitCode::FAILURE
    }
}

async fn shard_chaos(args: Args, seed: u64, shards: u32) -> ExitCode {
    let mut cfg = ShardConfig::full(seed, args.duration, args.rate);
    cfg.shards = shards;
    cfg.fsync = !args.no_fsync;
    cfg.keep_logs = args.keep_logs;
    let report = match chaos::shards::run(&cfg).await {
        Ok(r) => r,
        Err(err) => {
            eprintln!("chaos: the shard run could not be set up: {err:#}");
            return ExitCode::FAILURE;
        }
    };
    println!("{}", report.table());
    let out = args
        .out
        .unwrap_or_else(|| PathBuf::from(format!("chaos-shards-{seed}.json")));
    match chaos::write_json(&report, &out) {
        Ok(()) => println!("JSON report: {}", out.display()),
        Err(err) => eprintln!("chaos: {err:#}"),
    }
    if let Some(logs) = &report.logs {
        println!("process logs: {logs}");
    }
    if report.passed() {
        println!("passed: nothing lost, no order violation, every takeover within the bound");
        ExitCode::SUCCESS
    } else {
        println!("FAILED (seed {seed})");
        ExitCode::FAILURE
    }
}
