//! `demo`: the README's main command. One process brings up the whole local
//! stack on a throwaway PostgreSQL cluster, posts real orders through it at a
//! steady rate, and checks that every order was invoiced exactly once.
//!
//! ```text
//! cargo run --release -p cdc-relay-tests --bin demo -- [--rate 50] [--duration 20s | --orders N]
//!                                                      [--max-in-flight 64] [--keep-running]
//! ```
//!
//! 1. Builds the workspace binaries with the profile of this executable
//!    (release under `cargo run --release`), starts a throwaway cluster
//!    (`fsync` on and `max_slot_wal_keep_size = 10GB`, as in production;
//!    `track_commit_timestamp` on, for the latency figure) and creates the `orders_*` and `billing_*` databases
//!    from `sql/`, with the least-privilege roles.
//! 2. Runs `cdc-relay setup` (as the superuser: it creates the publication
//!    and the slot) and prints its output; starts Billing, Orders and
//!    `cdc-relay run` as the `cdc_relay` role (LOGIN REPLICATION, nothing else).
//! 3. Posts orders to Orders' `POST /orders`, one per tick of an interval
//!    timer (a steady rate, never a burst), with a progress line on stderr
//!    refreshed 4×/s: sent, invoiced, in flight (accepted by Orders, no
//!    invoice yet) and the p50 commit-to-invoice latency so far.
//! 4. Waits (bounded by `--drain-timeout`) for the last invoices, then prints
//!    the summary and the ledger verdict. Exit status 1 when any committed
//!    event was lost, invoiced twice, or an invoice has no committed event.
//! 5. Stops the relay with SIGTERM (a clean stop flushes the confirmed LSN),
//!    kills Orders and Billing and removes the cluster: on a normal end, on
//!    an error and on Ctrl-C (exit status 130). If this process is killed,
//!    the harness's guardians still stop every child and remove the cluster.
//!
//! # What the latency figures measure
//!
//! Both databases live in one cluster, so all timestamps come from one clock.
//! For every invoice, the demo joins `billing.invoices` to `orders.orders` by
//! order id (in this program: they are two databases) and computes:
//!
//! - **order commit → invoice commit**: `pg_xact_commit_timestamp(xmin)` of
//!   the invoice row minus that of the order row. That is the commit of the
//!   Orders transaction (order + outbox row) to the commit of Billing's
//!   transaction (inbox row + invoice): WAL flush of the order, decoding,
//!   the relay, the HTTP request and Billing's insert. PostgreSQL takes a
//!   commit timestamp as it writes the commit record, just before the flush.
//!   This is the figure of the progress line.
//! - **created_at → created_at**: `invoices.created_at - orders.created_at`.
//!   Both are `DEFAULT now()`, the START of their transactions: this spans
//!   the order's inserts and commit, and not Billing's insert and commit.
//!
//! The relay's own **commit → 2xx** comes from its
//! `cdc_relay_commit_to_delivery_seconds` histogram (the commit time of the
//! pgoutput Commit message to the 2xx); its quantiles are interpolated within
//! the histogram's buckets, so they are approximate.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use harness::app::{self, Running, TEST_SECRET};
use harness::oracle::{Ledger, SlotPosition, slot_position};
use harness::prom::{self, Exposition};
use harness::stack::Stack;
use harness::stats::percentile;
use harness::{ClusterOptions, PgCluster, bins};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;
use tokio_postgres::Client;
use uuid::Uuid;

/// How often the progress line is refreshed (on a terminal).
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// Without a terminal, one progress line per this many refreshes.
const PLAIN_PROGRESS_EVERY_N: u64 = 8;

/// POSTs to Orders that may be outstanding at once. The ticker waits when
/// they are all taken, so a slow Orders lowers the rate instead of piling up
/// requests.
const MAX_OUTSTANDING_POSTS: usize = 256;

/// Longest wait for the slot to be confirmed past the last commit.
const SLOT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(15);

/// After Ctrl-C, how long the relay may take to stop on the terminal's
/// SIGINT before it is sent SIGTERM.
const SIGINT_GRACE: Duration = Duration::from_secs(2);

/// The relay's budget for a clean stop, plus margin.
const RELAY_STOP_TIMEOUT: Duration = Duration::from_secs(20);

/// Command line of `demo`.
#[derive(Debug, Parser)]
#[command(
    name = "demo",
    about = "Run cdc-relay end to end on a throwaway PostgreSQL: Orders → outbox → slot → relay → Billing",
    long_about = "Run cdc-relay end to end on a throwaway PostgreSQL cluster (fsync on): \
        `cdc-relay setup`, then Billing, Orders and the relay as real processes; post real orders \
        through the Orders HTTP API at a steady rate with a live progress line; wait for the last \
        invoices; print a summary (orders, invoices, duplicates absorbed, commit-to-invoice \
        p50/p99, slot lag) and the ledger verdict (lost / duplicate / phantom must be 0, else exit \
        status 1). Everything is stopped and removed at the end, on error and on Ctrl-C.\n\n\
        Needs the PostgreSQL server binaries (`apt-get install postgresql`, or \
        CDC_RELAY_PG_BINDIR). Under root the server runs as the `postgres` user."
)]
struct Args {
    /// Orders per second, posted one per tick of an interval timer.
    #[arg(long, default_value_t = 50.0, value_parser = parse_rate)]
    rate: f64,
    /// How long to post orders (`20s`, `2m`, ...).
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    duration: Duration,
    /// Post exactly N orders (at --rate) instead of running for --duration.
    #[arg(long, value_name = "N", conflicts_with = "duration", value_parser = clap::value_parser!(u64).range(1..))]
    orders: Option<u64>,
    /// The relay's --max-in-flight: deliveries to Billing at once.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    max_in_flight: u32,
    /// After the run, keep the stack up and print how to reach it (URLs,
    /// psql connection strings, a curl that posts an order) until Ctrl-C.
    #[arg(long)]
    keep_running: bool,
    /// Longest wait for the last invoices once the last order is accepted.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    drain_timeout: Duration,
}

fn parse_rate(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(rate) if rate.is_finite() && rate > 0.0 && rate <= 100_000.0 => Ok(rate),
        _ => Err("a number of orders per second, above 0 and at most 100000".to_owned()),
    }
}

/// `20s`, `1.5s`, `500ms`, `2m`, `1h`, or a bare number of seconds.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale = match unit.trim() {
        "ms" => 1e-3,
        "" | "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => return Err(format!("unknown unit {unit:?}: use ms, s, m or h")),
    };
    number
        .parse::<f64>()
        .ok()
        .map(|n| n * scale)
        .filter(|secs| secs.is_finite() && *secs > 0.0 && *secs < 1e9)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("{text:?} is not a positive duration such as 20s or 2m"))
}

impl Args {
    fn total_orders(&self) -> u64 {
        self.orders.unwrap_or_else(|| {
            // Saturating float-to-int conversion; at least one order.
            ((self.rate * self.duration.as_secs_f64()).round() as u64).max(1)
        })
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = Args::parse();

    // One listener for the whole run, so a signal is never missed between
    // phases: every phase waits on this flag.
    let (stop_tx, stop_rx) = watch::channel(false);
    let signals = match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(int), Ok(term)) => (int, term),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("error: cannot install the signal handlers: {e}");
            return ExitCode::FAILURE;
        }
    };
    tokio::spawn(async move {
        let (mut int, mut term) = signals;
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        let _ = stop_tx.send(true);
    });

    let mut stop = stop_rx.clone();
    // The run future owns every process and the cluster: when a signal wins
    // the race, it is dropped here, which kills the processes and removes
    // the cluster before the message below is printed.
    let outcome = tokio::select! {
        outcome = run(&args) => Some(outcome),
        () = stopped(&mut stop) => None,
    };
    let (demo, verdict) = match outcome {
        None => {
            end_progress_line();
            eprintln!("interrupted: processes stopped, cluster removed");
            return ExitCode::from(130);
        }
        Some(Err(err)) => {
            end_progress_line();
            eprintln!("error: {err:#}");
            eprintln!("(whatever had been started is stopped and removed)");
            return ExitCode::FAILURE;
        }
        Some(Ok(done)) => done,
    };

    if args.keep_running {
        demo.print_access();
        stopped(&mut stop).await;
        println!();
    }
    demo.shutdown(args.keep_running).await;
    if verdict.clean {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Resolves once SIGINT or SIGTERM arrived (at any time since start).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    if stop.wait_for(|stopped| *stopped).await.is_err() {
        // The listener task is gone without a signal: never resolve.
        std::future::pending::<()>().await;
    }
}

/// Everything the demo started. Fields drop in declaration order: the
/// processes first, the cluster last.
struct Demo {
    relay: Running,
    orders: Running,
    billing: Running,
    stack: Stack,
    cluster: PgCluster,
}

/// The end state the exit status depends on.
struct Verdict {
    clean: bool,
}

/// Steps 1 to 4; returns the running stack for step 5.
async fn run(args: &Args) -> anyhow::Result<(Demo, Verdict)> {
    let total = args.total_orders();
    println!(
        "cdc-relay demo: {total} orders at {} orders/s (~{:.1} s), relay --max-in-flight {}",
        fmt_rate(args.rate),
        total as f64 / args.rate,
        args.max_in_flight
    );

    step("building the workspace binaries (orders, billing, cdc-relay; minutes on a first run)");
    let relay_bin = tokio::task::spawn_blocking(build_binaries)
        .await
        .context("the build task failed")??;
    println!("    {}", display_dir(&relay_bin));

    step(
        "starting a throwaway PostgreSQL cluster (fsync on, max_slot_wal_keep_size 10GB, track_commit_timestamp on)",
    );
    let cluster = tokio::task::spawn_blocking(|| {
        PgCluster::start(ClusterOptions {
            fsync: true,
            // As deploy/postgresql/postgresql.conf recommends.
            max_slot_wal_keep_size: Some("10GB".to_owned()),
            extra_settings: vec![("track_commit_timestamp".to_owned(), "on".to_owned())],
            ..ClusterOptions::default()
        })
    })
    .await
    .context("the cluster start panicked")??;
    let version = cluster
        .connect_superuser("postgres")
        .await?
        .query_one("SHOW server_version", &[])
        .await?
        .get::<_, String>(0);
    println!(
        "    PostgreSQL {version} on 127.0.0.1:{}, data in {}",
        cluster.port(),
        cluster.data_dir().display()
    );

    let stack = cluster.create_stack().await?;
    println!(
        "    databases {} and {} from sql/; roles orders_app, billing_app, cdc_relay",
        stack.orders_db, stack.billing_db
    );

    step("cdc-relay setup (as the superuser)");
    let setup = app::relay_setup(&stack).await?;
    for line in setup.lines() {
        println!("    {line}");
    }

    step("starting Billing, Orders and cdc-relay run (as the cdc_relay role)");
    let billing = app::start_billing(&stack, TEST_SECRET).await?;
    let orders = app::start_orders(&stack).await?;
    let max_in_flight = args.max_in_flight.to_string();
    let relay = app::start_relay(
        &stack,
        &format!("{}/inbox", billing.url),
        &[
            "--max-in-flight",
            &max_in_flight,
            "--slot-stats-interval",
            "1s",
        ],
    )
    .await?;
    app::wait_streaming(&relay).await?;
    println!("    Billing      {}", billing.url);
    println!("    Orders       {}", orders.url);
    println!(
        "    relay admin  {}   (streaming from slot {})",
        relay.url, stack.slot
    );

    step(&format!(
        "posting {total} orders to {}/orders at {} orders/s",
        orders.url,
        fmt_rate(args.rate)
    ));
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(15))
        .build()?;
    let load = run_load(args, total, &http, &orders.url, &stack).await?;
    end_progress_line();

    let summary = summarize(&http, &stack, &relay, &billing, &load).await?;
    let clean = summary.print(&load);
    let demo = Demo {
        relay,
        orders,
        billing,
        stack,
        cluster,
    };
    Ok((demo, Verdict { clean }))
}

/// Builds (if needed) the workspace binaries through the harness and
/// returns the relay's path. The harness panics with cargo's output on a
/// failed build: that message becomes the error, printed once.
fn build_binaries() -> anyhow::Result<PathBuf> {
    let previous_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let built = std::panic::catch_unwind(|| {
        for name in bins::WORKSPACE_BINS {
            bins::path(name);
        }
        bins::path("cdc-relay")
    });
    std::panic::set_hook(previous_hook);
    built.map_err(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("the build panicked");
        anyhow::anyhow!("{message}")
    })
}

/// Counters shared by the posting tasks and the progress loop.
#[derive(Default)]
struct Shared {
    sent: AtomicU64,
    accepted: AtomicU64,
    failed: AtomicU64,
    /// Accepted orders whose invoice has not been seen yet.
    pending: Mutex<Vec<Uuid>>,
    first_error: Mutex<Option<String>>,
}

impl Shared {
    fn pending(&self) -> MutexGuard<'_, Vec<Uuid>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What the load phase observed.
struct LoadReport {
    total: u64,
    sent: u64,
    accepted: u64,
    failed: u64,
    first_error: Option<String>,
    /// First tick to last tick.
    sending: Duration,
    /// Whether every accepted order got its invoice within the drain timeout.
    drained: bool,
    /// Last order accepted to last invoice seen.
    drain: Duration,
}

/// Posts the orders from a ticker while the progress loop follows the
/// invoices; returns once every accepted order is invoiced or the drain
/// timeout passed.
async fn run_load(
    args: &Args,
    total: u64,
    http: &reqwest::Client,
    orders_url: &str,
    stack: &Stack,
) -> anyhow::Result<LoadReport> {
    let shared = Arc::new(Shared::default());
    let mut tracker = Tracker::connect(stack).await?;
    let poster = tokio::spawn(post_orders(
        http.clone(),
        orders_url.to_owned(),
        total,
        args.rate,
        Arc::clone(&shared),
    ));
    // If this future is dropped (error, Ctrl-C), stop posting too.
    let poster = AbortOnDrop(Some(poster));

    let tty = std::io::stderr().is_terminal();
    let started = Instant::now();
    let mut ticker = tokio::time::interval(PROGRESS_EVERY);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut refreshes: u64 = 0;
    let mut posted_at: Option<Instant> = None;
    let mut drained = false;
    loop {
        ticker.tick().await;
        tracker.poll(&shared).await?;
        refreshes += 1;
        let posting_done = poster.is_finished();
        if posting_done && posted_at.is_none() {
            posted_at = Some(Instant::now());
        }
        let done = posting_done && shared.pending().is_empty();
        let timed_out = posted_at.is_some_and(|at| at.elapsed() >= args.drain_timeout);
        if tty || refreshes % PLAIN_PROGRESS_EVERY_N == 1 || done || timed_out {
            let phase = match (posting_done, done) {
                (false, _) => "",
                (true, false) => "draining",
                (true, true) => "drained",
            };
            let line = tracker.line(&shared, total, started.elapsed(), phase);
            if tty {
                eprint!("\r\x1b[2K{line}");
            } else {
                eprintln!("{line}");
            }
            let _ = std::io::stderr().flush();
        }
        if done {
            drained = true;
            break;
        }
        if timed_out {
            break;
        }
    }
    let sending = poster.join().await.context("the posting task failed")?;
    let drain = posted_at.map(|at| at.elapsed()).unwrap_or_default();
    let first_error = shared
        .first_error
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    Ok(LoadReport {
        total,
        sent: shared.sent.load(Ordering::Relaxed),
        accepted: shared.accepted.load(Ordering::Relaxed),
        failed: shared.failed.load(Ordering::Relaxed),
        first_error,
        sending,
        drained,
        drain,
    })
}

/// Aborts a spawned task when dropped (until [`AbortOnDrop::join`]).
struct AbortOnDrop<T>(Option<tokio::task::JoinHandle<T>>);

impl<T> AbortOnDrop<T> {
    fn is_finished(&self) -> bool {
        self.0
            .as_ref()
            .is_none_or(tokio::task::JoinHandle::is_finished)
    }

    async fn join(mut self) -> anyhow::Result<T> {
        let handle = self.0.take().context("the task was already joined")?;
        Ok(handle.await?)
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        if let Some(handle) = &self.0 {
            handle.abort();
        }
    }
}

/// One POST per tick; returns the time from the first tick to the last.
async fn post_orders(
    http: reqwest::Client,
    orders_url: String,
    total: u64,
    rate: f64,
    shared: Arc<Shared>,
) -> Duration {
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    // Behind schedule (a stalled Orders): continue at the rate, never catch
    // up with a burst.
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let limit = Arc::new(Semaphore::new(MAX_OUTSTANDING_POSTS));
    let mut posts = JoinSet::new();
    let mut first_tick = None;
    for _ in 0..total {
        ticker.tick().await;
        first_tick.get_or_insert_with(Instant::now);
        let Ok(permit) = Arc::clone(&limit).acquire_owned().await else {
            break;
        };
        shared.sent.fetch_add(1, Ordering::Relaxed);
        let (http, url, shared) = (http.clone(), orders_url.clone(), Arc::clone(&shared));
        posts.spawn(async move {
            let amount = rand::random_range(100..100_000);
            let result = app::post_order(&http, &url, amount).await;
            drop(permit);
            match result.and_then(|(order_id, _)| Ok(Uuid::parse_str(&order_id)?)) {
                Ok(order_id) => {
                    shared.pending().push(order_id);
                    shared.accepted.fetch_add(1, Ordering::Relaxed);
                }
                Err(err) => {
                    shared.failed.fetch_add(1, Ordering::Relaxed);
                    shared
                        .first_error
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert_with(|| format!("{err:#}"));
                }
            }
        });
        while posts.try_join_next().is_some() {}
    }
    let sending = first_tick.map(|t| t.elapsed()).unwrap_or_default();
    while posts.join_next().await.is_some() {}
    sending
}

/// Follows the invoices of the accepted orders for the progress line.
struct Tracker {
    orders_db: Client,
    billing_db: Client,
    invoiced: u64,
    /// Order commit → invoice commit, microseconds, one per invoice seen.
    latencies_us: Vec<i64>,
}

/// Commit time and creation time of a row's transaction, microseconds since
/// the Unix epoch. `xmin` is the inserting transaction (rows never updated).
const TIMES: &str = "(extract(epoch FROM pg_xact_commit_timestamp(xmin)) * 1000000)::int8, \
                     (extract(epoch FROM created_at) * 1000000)::int8";

impl Tracker {
    async fn connect(stack: &Stack) -> anyhow::Result<Tracker> {
        Ok(Tracker {
            orders_db: stack.orders_admin().await?,
            billing_db: stack.billing_admin().await?,
            invoiced: 0,
            latencies_us: Vec::new(),
        })
    }

    /// Moves the pending orders that got their invoice to `invoiced`.
    async fn poll(&mut self, shared: &Shared) -> anyhow::Result<()> {
        let pending: Vec<Uuid> = shared.pending().clone();
        if pending.is_empty() {
            return Ok(());
        }
        let invoices = times_by_id(
            &self.billing_db,
            &format!("SELECT order_id, {TIMES} FROM invoices WHERE order_id = ANY($1)"),
            &pending,
        )
        .await?;
        if invoices.is_empty() {
            return Ok(());
        }
        let ids: Vec<Uuid> = invoices.keys().copied().collect();
        let orders = times_by_id(
            &self.orders_db,
            &format!("SELECT id, {TIMES} FROM orders WHERE id = ANY($1)"),
            &ids,
        )
        .await?;
        for (id, invoice) in &invoices {
            if let (Some(order), Some(invoice_commit)) = (orders.get(id), invoice.commit_us)
                && let Some(order_commit) = order.commit_us
            {
                self.latencies_us.push(invoice_commit - order_commit);
            }
        }
        self.invoiced += invoices.len() as u64;
        shared.pending().retain(|id| !invoices.contains_key(id));
        Ok(())
    }

    fn line(&self, shared: &Shared, total: u64, elapsed: Duration, phase: &str) -> String {
        let sent = shared.sent.load(Ordering::Relaxed);
        let failed = shared.failed.load(Ordering::Relaxed);
        let in_flight = shared.pending().len();
        let width = total.to_string().len();
        let mut sorted = self.latencies_us.clone();
        sorted.sort_unstable();
        let p50 = percentile(&sorted, 0.50).map_or_else(|| "-".to_owned(), fmt_us);
        let mut line = format!(
            "  {:>6.1}s  sent {sent:>width$}/{total}  invoiced {:>width$}  in flight {in_flight:>4}  p50 {p50:>8}",
            elapsed.as_secs_f64(),
            self.invoiced,
        );
        if failed > 0 {
            line.push_str(&format!("  failed {failed}"));
        }
        if !phase.is_empty() {
            line.push_str("  ");
            line.push_str(phase);
        }
        line
    }
}

/// A row's transaction times, microseconds since the epoch.
#[derive(Debug, Clone, Copy)]
struct RowTimes {
    /// `pg_xact_commit_timestamp(xmin)`; `None` if the server has none.
    commit_us: Option<i64>,
    /// `created_at` (`now()` of the transaction).
    created_us: i64,
}

/// Runs `sql` (selecting `id, commit_us, created_us`, with `$1` a uuid
/// array) and indexes the rows by id.
async fn times_by_id(
    db: &Client,
    sql: &str,
    ids: &[Uuid],
) -> anyhow::Result<HashMap<Uuid, RowTimes>> {
    let rows = db.query(sql, &[&ids]).await.context("reading row times")?;
    Ok(rows
        .iter()
        .map(|r| {
            (
                r.get(0),
                RowTimes {
                    commit_us: r.get(1),
                    created_us: r.get(2),
                },
            )
        })
        .collect())
}

/// Everything the summary prints, gathered after the drain.
struct Summary {
    ledger: Ledger,
    /// Invoices joined to their orders.
    joined: usize,
    commit_us: Vec<i64>,
    created_us: Vec<i64>,
    /// Last invoice commit minus last order commit, microseconds.
    last_invoice_after_last_order_us: Option<i64>,
    relay: Exposition,
    billing: Exposition,
    slot: SlotPosition,
    slot_caught_up: bool,
}

async fn summarize(
    http: &reqwest::Client,
    stack: &Stack,
    relay: &Running,
    billing: &Running,
    load: &LoadReport,
) -> anyhow::Result<Summary> {
    // The slot: confirmed past everything committed so far?
    let orders = stack.orders_admin().await?;
    let target = slot_position(&orders, &stack.slot).await?.current;
    let slot_caught_up = harness::wait_until(
        "the slot confirmed past the last commit",
        if load.drained {
            SLOT_CONFIRM_TIMEOUT
        } else {
            Duration::from_secs(1)
        },
        || async {
            slot_position(&orders, &stack.slot)
                .await
                .map(|p| p.confirmed >= target)
        },
    )
    .await
    .is_ok();
    let slot = slot_position(&orders, &stack.slot).await?;

    // Latencies over every invoice, joined to its order by id.
    let billing_db = stack.billing_admin().await?;
    let all_orders: HashMap<Uuid, RowTimes> = orders
        .query(&format!("SELECT id, {TIMES} FROM orders"), &[])
        .await?
        .iter()
        .map(|r| {
            (
                r.get(0),
                RowTimes {
                    commit_us: r.get(1),
                    created_us: r.get(2),
                },
            )
        })
        .collect();
    let mut commit_us = Vec::new();
    let mut created_us = Vec::new();
    let mut joined = 0;
    let last_order = all_orders.values().filter_map(|o| o.commit_us).max();
    let mut last_invoice = None;
    for row in billing_db
        .query(&format!("SELECT order_id, {TIMES} FROM invoices"), &[])
        .await?
    {
        let id: Uuid = row.get(0);
        let Some(order) = all_orders.get(&id) else {
            continue;
        };
        joined += 1;
        let invoice = RowTimes {
            commit_us: row.get(1),
            created_us: row.get(2),
        };
        created_us.push(invoice.created_us - order.created_us);
        if let (Some(i), Some(o)) = (invoice.commit_us, order.commit_us) {
            commit_us.push(i - o);
            last_invoice = last_invoice.max(Some(i));
        }
    }
    commit_us.sort_unstable();
    created_us.sort_unstable();

    let relay_metrics = prom::scrape(http, &relay.url).await?;
    let billing_metrics = prom::scrape(http, &billing.url).await?;
    Ok(Summary {
        ledger: Ledger::read(stack).await?,
        joined,
        commit_us,
        created_us,
        last_invoice_after_last_order_us: last_invoice.zip(last_order).map(|(i, o)| i - o),
        relay: relay_metrics,
        billing: billing_metrics,
        slot,
        slot_caught_up,
    })
}

impl Summary {
    /// Prints the summary; returns the ledger verdict.
    fn print(&self, load: &LoadReport) -> bool {
        let l = &self.ledger;
        println!();
        println!("== summary ==");
        let rate = if load.sending.is_zero() || load.sent < 2 {
            String::new()
        } else {
            format!(
                " over {:.1} s ({:.1}/s)",
                load.sending.as_secs_f64(),
                (load.sent - 1) as f64 / load.sending.as_secs_f64()
            )
        };
        println!(
            "orders         {} sent{rate}: {} accepted (201), {} failed",
            load.sent, load.accepted, load.failed
        );
        if load.sent < load.total {
            println!("               (stopped before sending all {})", load.total);
        }
        if let Some(err) = &load.first_error {
            println!("               first failure: {err}");
        }
        let inbox =
            self.billing
                .sum_by("billing_http_requests_total", ("route", "/inbox"), "status");
        let inbox_text = inbox
            .iter()
            .map(|(status, n)| format!("{n:.0}×{status}"))
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "invoices       {} (Billing: POST /inbox answered {}; duplicates absorbed {:.0})",
            l.invoices,
            if inbox_text.is_empty() {
                "never".to_owned()
            } else {
                inbox_text
            },
            self.billing.sum("billing_duplicates_absorbed_total"),
        );
        let drain = if load.drained {
            self.last_invoice_after_last_order_us.map_or_else(
                || "every accepted order invoiced".to_owned(),
                |us| {
                    format!(
                        "every accepted order invoiced; the last invoice committed {} after the last order",
                        fmt_us(us)
                    )
                },
            )
        } else {
            format!(
                "NOT drained: invoices still missing after {}",
                fmt_duration(load.drain)
            )
        };
        println!("drain          {drain}");
        println!(
            "commit→invoice p50 {}  p99 {}  max {}   order commit → invoice commit (pg_xact_commit_timestamp, {} invoices)",
            q(&self.commit_us, 0.50),
            q(&self.commit_us, 0.99),
            q(&self.commit_us, 1.0),
            self.commit_us.len()
        );
        println!(
            "               p50 {}  p99 {}  max {}   invoices.created_at − orders.created_at (now() of each transaction, {} invoices)",
            q(&self.created_us, 0.50),
            q(&self.created_us, 0.99),
            q(&self.created_us, 1.0),
            self.joined
        );
        let hist = "cdc_relay_commit_to_delivery_seconds";
        let hq = |quantile: f64| {
            prom::histogram_quantile(&self.relay.buckets(hist), quantile)
                .map_or_else(|| "-".to_owned(), |s| format!("≈{}", fmt_seconds(s)))
        };
        println!(
            "relay          commit → 2xx p50 {}  p99 {} (its histogram, interpolated in buckets); {:.0} delivered, {:.0} retries",
            hq(0.50),
            hq(0.99),
            self.relay.sum("cdc_relay_events_delivered_total"),
            self.relay.sum("cdc_relay_retries_total"),
        );
        let lag = self.slot.lag();
        println!(
            "slot           confirmed_flush_lsn {}, pg_current_wal_lsn {}: lag {lag} bytes{}",
            fmt_lsn(self.slot.confirmed),
            fmt_lsn(self.slot.current),
            if self.slot_caught_up {
                ""
            } else {
                " (NOT yet confirmed past the last commit)"
            }
        );
        let clean = l.is_clean();
        println!(
            "ledger         committed {}, invoices {}: lost {}, duplicate {}, phantom {} → {}",
            l.committed,
            l.invoices,
            l.lost,
            l.duplicate_effects,
            l.phantom,
            if clean {
                "OK: every committed order invoiced exactly once"
            } else {
                "FAILED"
            }
        );
        clean
    }
}

impl Demo {
    /// `--keep-running`: how to reach the stack.
    fn print_access(&self) {
        let s = &self.stack;
        let relay_bin = bins::path("cdc-relay");
        println!();
        println!("== the stack keeps running: Ctrl-C stops it and removes everything ==");
        println!(
            "Orders       {}   POST /orders, GET /orders/{{id}}, /metrics",
            self.orders.url
        );
        println!(
            "Billing      {}   POST /inbox (signed), GET /invoices?order_id=, /metrics",
            self.billing.url
        );
        println!(
            "relay admin  {}   /metrics, /healthz, /readyz",
            self.relay.url
        );
        println!();
        println!("post an order:");
        println!(
            "  curl -sS -X POST {}/orders -H 'Content-Type: application/json' -d '{{\"amount_cents\":2599,\"currency\":\"EUR\"}}'",
            self.orders.url
        );
        println!("its invoice (order_id from the answer):");
        println!(
            "  curl -sS '{}/invoices?order_id=<order_id>'",
            self.billing.url
        );
        println!("relay metrics and slot status:");
        println!(
            "  curl -sS {}/metrics | grep -v '^#' | grep cdc_relay_",
            self.relay.url
        );
        println!(
            "  CDC_RELAY_DATABASE_URL='{}' {} --slot {} --publication {} status",
            s.relay_url,
            relay_bin.display(),
            s.slot,
            s.publication
        );
        println!("psql:");
        println!("  psql '{}'   # orders, superuser", s.orders_admin_url);
        println!("  psql '{}'   # billing, superuser", s.billing_admin_url);
        println!("  psql '{}'   # orders, as orders_app", s.orders_app_url);
        println!("  psql '{}'   # billing, as billing_app", s.billing_app_url);
        println!("logs:");
        for (name, r) in [
            ("relay", &self.relay),
            ("orders", &self.orders),
            ("billing", &self.billing),
        ] {
            println!(
                "  {name:<8} {}",
                r.process.log_dir().join("output.log").display()
            );
        }
        println!(
            "  postgres {}",
            self.cluster.socket_dir().join("postgres.log").display()
        );
        let _ = std::io::stdout().flush();
    }

    /// Step 5: a clean relay stop, then everything else. After a Ctrl-C
    /// (`after_signal`) the relay may have received the terminal's SIGINT
    /// too, and a second signal makes it exit at once without its final
    /// flush: give it a moment to stop on its own first.
    async fn shutdown(mut self, after_signal: bool) {
        step("stopping: cdc-relay (SIGTERM, clean stop), Orders, Billing, PostgreSQL");
        let stopping_already =
            after_signal && self.relay.process.wait_exit(SIGINT_GRACE).await.is_ok();
        if !stopping_already {
            self.relay.process.sigterm();
        }
        match self.relay.process.wait_exit(RELAY_STOP_TIMEOUT).await {
            Ok(status) if status.success() => println!("    cdc-relay exited cleanly"),
            Ok(status) => println!("    cdc-relay exited with {status}"),
            Err(err) => println!("    cdc-relay did not stop in time, killed: {err:#}"),
        }
        let dir = self.cluster.socket_dir().to_path_buf();
        // Dropping stops the cluster (blocking, bounded): off the runtime.
        let _ = tokio::task::spawn_blocking(move || drop(self)).await;
        if dir.exists() {
            println!("    processes stopped; {} NOT removed", dir.display());
        } else {
            println!("    processes stopped, cluster removed ({})", dir.display());
        }
    }
}

fn q(sorted: &[i64], quantile: f64) -> String {
    percentile(sorted, quantile).map_or_else(|| "-".to_owned(), fmt_us)
}

fn fmt_us(us: i64) -> String {
    fmt_seconds(us as f64 / 1e6)
}

fn fmt_seconds(s: f64) -> String {
    if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

fn fmt_duration(d: Duration) -> String {
    fmt_seconds(d.as_secs_f64())
}

fn fmt_rate(rate: f64) -> String {
    if rate.fract() == 0.0 {
        format!("{rate:.0}")
    } else {
        format!("{rate}")
    }
}

/// PostgreSQL's text form of an LSN.
fn fmt_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

fn display_dir(bin: &std::path::Path) -> String {
    let dir: PathBuf = bin.parent().map(PathBuf::from).unwrap_or_default();
    format!("binaries in {}", dir.display())
}

fn step(what: &str) {
    println!("==> {what}");
    let _ = std::io::stdout().flush();
}

/// Ends the in-place progress line (terminal only) before other output.
fn end_progress_line() {
    if std::io::stderr().is_terminal() {
        eprintln!();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("20s"), Ok(Duration::from_secs(20)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn lsn_text_form() {
        assert_eq!(fmt_lsn(0x1_0000_00A0), "1/A0");
    }
}
