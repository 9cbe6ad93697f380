//! Scenario j (issue 15): does a frozen endpoint slow the healthy ones, and
//! does the WAL budget bound what the slot retains meanwhile?
//!
//! One relay with a routes file of three endpoints, billing, shipping and
//! audit, each taking every event type (so every order's event goes to all
//! three, and every transaction waits for all three before the slot may
//! move); each endpoint is a [`RecordingSink`] in a child process. Orders
//! are posted through Orders' API at a fixed rate (500/s) for the window
//! (10 min by default), after a 2 s warm-up at that rate that all three
//! receive. Every run is a fresh stack and the same relay settings
//! (`--max-retained-wal`, the default window of 10,000 events, billing's
//! `max_lag`); what differs is billing's sink:
//!
//! - **healthy**: it answers, as the others do;
//! - **frozen**: it is stopped (SIGSTOP) after the warm-up, for the whole
//!   window: it holds its connections, the kernel completes new ones for
//!   it, nothing is ever answered. Its `max_lag` parks it;
//! - **frozen-no-lag**: the same, with no `max_lag` in billing's entry:
//!   only the WAL budget can park it.
//!
//! Figures ([`report`]), per run: each answering endpoint's commit→2xx
//! p50, p99 and max — its sink's answer time minus the order's
//! `pg_xact_commit_timestamp`, both on this machine's clock, over every
//! event of the window (an event never answered is counted and left out:
//! a lower bound then) — and in a frozen run its p99 before and after
//! billing was parked; the healthy endpoints' p99 in a frozen run over the
//! same endpoint's p99 in each healthy run of the invocation (target
//! ≤ 1.2); from [`sampler`]'s readings every second, from the window's
//! start until the healthy endpoints had everything, the slot's retained
//! WAL (`pg_current_wal_lsn() − restart_lsn`, max and p99 against the
//! budget), the WAL written and fsynced per second, and how many events
//! billing held in the window; billing's parked events, when and why it
//! was parked, how long the backlog it held then took to clear, and the
//! most parked dead letters written in one second.

mod report;
mod sampler;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use harness::app::{self, Running, TEST_SECRET};
use harness::prom;
use harness::stack::Stack;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::Ctx;
use crate::contender::{RELAY_THREADS, proc_cpu_s};
use crate::recording_sink::RecordingSink;
use crate::workload::{drop_stack, fresh_stack, post_at_rate};
use sampler::Reading;

/// The scenario's name in the results.
pub(crate) const SCENARIO: &str = "j. isolation and the WAL budget";

/// The endpoints of the routes file; the first is the one frozen.
const ENDPOINTS: [&str; 3] = ["billing", "shipping", "audit"];

/// The environment variable the routes file names for every endpoint's
/// secret.
const SECRET_ENV: &str = "BENCH_ROUTE_SECRET";

/// The relay's `--max-pending-events` (its default): the window every
/// endpoint's pending events share.
const WINDOW_EVENTS: u32 = 10_000;

/// How long the healthy endpoints may take, after the window, to receive
/// the window's last events.
const DRAIN_CAP: Duration = Duration::from_secs(120);

/// One run of the scenario: what billing's sink does, and whether billing
/// has a `max_lag`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Run {
    Healthy,
    Frozen,
    FrozenNoLag,
}

impl Run {
    /// The run's name in the figures (and on the command line).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Run::Healthy => "healthy",
            Run::Frozen => "frozen",
            Run::FrozenNoLag => "frozen-no-lag",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<Run> {
        [Run::Healthy, Run::Frozen, Run::FrozenNoLag]
            .into_iter()
            .find(|r| r.name() == s)
    }

    fn frozen(self) -> bool {
        self != Run::Healthy
    }

    fn max_lag(self) -> bool {
        self != Run::FrozenNoLag
    }
}

/// What one run measured.
struct Outcome {
    /// Per endpoint (as [`ENDPOINTS`]); `None` for the frozen one.
    latency: Vec<Option<Latency>>,
    /// The slot and the relay, every second from the window's start.
    readings: Vec<Reading>,
    /// When billing's sink was frozen (or would have been), Unix µs.
    freeze_at: i64,
    /// billing's parked dead letters.
    parked: Parked,
    /// Events of the window.
    events: usize,
    /// Orders posted per second (achieved).
    achieved: f64,
    /// The relay's own commit→2xx histogram over the window, p50 and p99
    /// (ms; every endpoint's deliveries; its last bucket is 60 s).
    relay_histogram: (Option<f64>, Option<f64>),
    /// The relay's CPU over the window and the drain, share of one core.
    relay_cpu: Option<f64>,
}

/// One endpoint's commit→2xx over the window.
struct Latency {
    /// Every answered event of the window: (commit time in Unix µs, ms),
    /// in commit order.
    by_commit: Vec<(i64, f64)>,
    /// The window's events it never answered.
    missing: usize,
}

/// billing's parked dead letters.
struct Parked {
    count: u64,
    /// When the first was written, Unix µs.
    first: Option<i64>,
    /// The first one's error: which rule parked billing.
    why: Option<String>,
    /// The most written in one second (by `quarantined_at`).
    busiest_second: Option<i64>,
    /// Per statement that wrote them: its start (`quarantined_at`, the
    /// statement's `now()`) and commit (`pg_xact_commit_timestamp`), Unix
    /// µs, and its rows; in start order.
    statements: Vec<(i64, i64, i64)>,
}

pub(crate) async fn isolation(ctx: &mut Ctx, run: u32) -> anyhow::Result<()> {
    let mut runs = ctx.cfg.iso_runs.clone();
    let len = runs.len().max(1);
    runs.rotate_left(run as usize % len);
    let mut healthy: Vec<Outcome> = Vec::new();
    let mut frozen: Vec<(Run, Outcome)> = Vec::new();
    for (n, r) in runs.into_iter().enumerate() {
        eprintln!(
            "  j. 3 endpoints at {}/s for {} s: {}",
            ctx.cfg.iso_rate,
            ctx.cfg.iso_window_s,
            r.name()
        );
        let outcome = one_run(ctx, r).await?;
        if let Some(dir) = &ctx.cfg.iso_raw {
            write_raw(dir, &format!("{run}-{n}-{}", r.name()), &outcome)?;
        }
        report::run(ctx, r, &outcome);
        match r {
            Run::Healthy => healthy.push(outcome),
            _ => frozen.push((r, outcome)),
        }
    }
    for h in &healthy {
        for (r, f) in &frozen {
            report::ratio(ctx, *r, h, f);
        }
    }
    Ok(())
}

async fn one_run(ctx: &Ctx, run: Run) -> anyhow::Result<Outcome> {
    let stack = fresh_stack(ctx, true).await?;
    let result = measure(ctx, &stack, run).await;
    drop_stack(ctx, &stack).await;
    result
}

async fn measure(ctx: &Ctx, stack: &Stack, run: Run) -> anyhow::Result<Outcome> {
    let mut sinks = Vec::new();
    for _ in ENDPOINTS {
        sinks.push(RecordingSink::start().await?);
    }
    let dir = tempfile::tempdir()?;
    let relay = start_relay(ctx, stack, &sinks, run, dir.path()).await?;
    let orders = app::start_orders(stack).await?;
    // Warm-up at the window's rate, so that the relay's, Orders' and the
    // sinks' connection pools have grown before the window starts.
    let (warm, _, _) = post_at_rate(
        &ctx.http,
        &orders.url,
        ctx.cfg.iso_rate,
        Duration::from_secs(2),
    )
    .await?;
    wait_counts(ctx, &sinks, warm.len() as u64, Duration::from_secs(30)).await?;
    let freeze_at = unix_micros();
    if run.frozen() {
        sinks[0].freeze()?;
    }
    let answering = if run.frozen() {
        &sinks[1..]
    } else {
        &sinks[..]
    };

    let hist = "cdc_relay_commit_to_delivery_seconds";
    let before = prom::scrape(&ctx.http, &relay.admin_url).await?;
    let cpu = || proc_cpu_s(relay.process.pid(), ctx.clk_tck);
    let (cpu0, t0) = (cpu(), Instant::now());
    let sampler = sampler::start(ctx, &stack.slot, &relay.admin_url).await?;
    let window = Duration::from_secs(ctx.cfg.iso_window_s);
    let (ids, achieved, errors) =
        post_at_rate(&ctx.http, &orders.url, ctx.cfg.iso_rate, window).await?;
    anyhow::ensure!(errors == 0, "{errors} orders failed");
    anyhow::ensure!(
        !run.frozen() || sinks[0].frozen()?,
        "billing's sink was resumed during the window (SIGCONT from elsewhere): the run measured no freeze"
    );
    let expected = (warm.len() + ids.len()) as u64;
    if let Err(err) = wait_counts(ctx, answering, expected, DRAIN_CAP).await {
        eprintln!("    {err:#}");
    }
    let relay_cpu = cpu()
        .zip(cpu0)
        .map(|(b, a)| (b - a) / t0.elapsed().as_secs_f64());
    let readings = sampler.stop().await?;
    let after = prom::scrape(&ctx.http, &relay.admin_url).await?;
    let d = prom::bucket_delta(&before.buckets(hist), &after.buckets(hist));
    let ms = |q| prom::histogram_quantile(&d, q).map(|s| s * 1000.0);

    let db = stack.orders_admin().await?;
    let committed = commit_times(&db, &ids).await?;
    let mut latency = Vec::new();
    for (i, sink) in sinks.iter().enumerate() {
        let answered = !(run.frozen() && i == 0);
        latency.push(match answered {
            true => Some(latencies(&committed, &sink.answers(&ctx.http).await?)),
            false => None,
        });
    }
    Ok(Outcome {
        latency,
        readings,
        freeze_at,
        parked: parked(&db).await?,
        events: committed.len(),
        achieved,
        relay_histogram: (ms(0.5), ms(0.99)),
        relay_cpu,
    })
}

/// The routes file of `run` (billing with `max_lag` unless `run` says
/// otherwise) and the relay on it, streaming.
async fn start_relay(
    ctx: &Ctx,
    stack: &Stack,
    sinks: &[RecordingSink],
    run: Run,
    dir: &Path,
) -> anyhow::Result<Running> {
    let mut text = String::new();
    for (i, (name, sink)) in ENDPOINTS.iter().zip(sinks).enumerate() {
        text.push_str(&format!(
            "[[endpoint]]\nname = {name:?}\nurl = {:?}\nevent_types = [\"*\"]\nsecret_env = {SECRET_ENV:?}\n",
            sink.url
        ));
        if i == 0 && run.max_lag() {
            text.push_str(&format!("max_lag = \"{}s\"\n", ctx.cfg.iso_max_lag_s));
        }
        text.push('\n');
    }
    let path = dir.join("routes.toml");
    std::fs::write(&path, text)?;
    let mut args = vec![
        "--max-retained-wal".to_owned(),
        format!("{}MiB", ctx.cfg.iso_budget_mib),
        "--max-pending-events".to_owned(),
        WINDOW_EVENTS.to_string(),
        "--log".to_owned(),
        "info,pgwire_replication=off".to_owned(),
    ];
    if let Some(t) = RELAY_THREADS.get() {
        args.extend(["--worker-threads".to_owned(), t.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let relay =
        app::start_relay_with_routes(stack, &path, &args, &[(SECRET_ENV, TEST_SECRET)]).await?;
    app::wait_streaming(&relay).await?;
    Ok(relay)
}

/// Waits until every sink of `sinks` answered `n` events, or `cap` passes
/// (an error naming the counts).
async fn wait_counts(
    ctx: &Ctx,
    sinks: &[RecordingSink],
    n: u64,
    cap: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + cap;
    loop {
        let mut counts = Vec::new();
        for s in sinks {
            counts.push(s.count(&ctx.http).await?);
        }
        if counts.iter().all(|c| *c >= n) {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the sinks answered {counts:?} of {n} events after {cap:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Each event of the orders `ids`: its id and commit time (Unix µs).
async fn commit_times(db: &Client, ids: &[Uuid]) -> anyhow::Result<HashMap<String, i64>> {
    let rows = db
        .query(
            // A join, not `= ANY($1)`: that compares each row with every
            // id of the window (300,000 × 300,000 at the defaults).
            "SELECT o.id::text,
                    floor(extract(epoch FROM pg_xact_commit_timestamp(o.xmin)) * 1e6)::int8
             FROM outbox o JOIN unnest($1::uuid[]) AS w(order_id) ON o.aggregate_id = w.order_id",
            &[&ids],
        )
        .await
        .context("reading the events' commit times")?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// An endpoint's [`Latency`] from the events' commit times and its
/// answers (both by event id, Unix µs).
fn latencies(committed: &HashMap<String, i64>, answers: &HashMap<String, i64>) -> Latency {
    let mut by_commit: Vec<(i64, f64)> = committed
        .iter()
        .filter_map(|(id, c)| answers.get(id).map(|a| (*c, (a - c) as f64 / 1000.0)))
        .collect();
    by_commit.sort_by_key(|(c, _)| *c);
    Latency {
        missing: committed.len() - by_commit.len(),
        by_commit,
    }
}

/// billing's parked dead letters (error `parked: ...`).
async fn parked(db: &Client) -> anyhow::Result<Parked> {
    let row = db
        .query_one(
            "WITH parked AS (SELECT * FROM cdc_relay_dead_letter
                             WHERE endpoint = 'billing' AND error LIKE 'parked:%')
             SELECT count(*),
                    floor(extract(epoch FROM min(quarantined_at)) * 1e6)::int8,
                    (SELECT error FROM parked ORDER BY id LIMIT 1),
                    (SELECT max(n) FROM (SELECT count(*) AS n FROM parked
                                         GROUP BY date_trunc('second', quarantined_at)) s)
             FROM parked",
            &[],
        )
        .await
        .context("counting billing's parked dead letters")?;
    let statements = db
        .query(
            "SELECT floor(extract(epoch FROM quarantined_at) * 1e6)::int8,
                    floor(extract(epoch FROM pg_xact_commit_timestamp(xmin)) * 1e6)::int8,
                    count(*)
             FROM cdc_relay_dead_letter
             WHERE endpoint = 'billing' AND error LIKE 'parked:%'
             GROUP BY 1, 2 ORDER BY 1",
            &[],
        )
        .await
        .context("reading the parked dead letters' statements")?
        .iter()
        // A row without a commit timestamp (committed before
        // track_commit_timestamp was on) has no place in the timeline.
        .filter_map(|r| Some((r.get(0), r.get::<_, Option<i64>>(1)?, r.get(2))))
        .collect();
    Ok(Parked {
        count: row.get::<_, i64>(0) as u64,
        first: row.get(1),
        why: row.get(2),
        busiest_second: row.get(3),
        statements,
    })
}

/// `--iso-raw DIR`: each answering endpoint's latencies (`<tag>-<endpoint>.tsv`:
/// commit time in seconds from the freeze, ms), the readings
/// (`<tag>-readings.tsv`) and, in a frozen run, the statements that wrote
/// billing's parked rows (`<tag>-parked.tsv`: start and commit in seconds
/// from the freeze, rows), for a closer look than the figures give.
fn write_raw(dir: &Path, tag: &str, o: &Outcome) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (endpoint, lat) in ENDPOINTS.iter().zip(&o.latency) {
        let Some(lat) = lat else { continue };
        let mut text = String::from("commit_s\tms\n");
        for (c, ms) in &lat.by_commit {
            text.push_str(&format!("{:.6}\t{ms:.3}\n", (c - o.freeze_at) as f64 / 1e6));
        }
        std::fs::write(dir.join(format!("{tag}-{endpoint}.tsv")), text)?;
    }
    let mut text = String::from("at_s\tretained\twal\twal_syncs\tbilling_pending\n");
    for r in &o.readings {
        text.push_str(&format!(
            "{:.1}\t{}\t{}\t{}\t{}\n",
            r.at_s,
            r.retained,
            r.wal,
            r.wal_syncs,
            r.billing_pending.map_or(String::new(), |p| p.to_string())
        ));
    }
    std::fs::write(dir.join(format!("{tag}-readings.tsv")), text)?;
    if !o.parked.statements.is_empty() {
        let s = |us: i64| (us - o.freeze_at) as f64 / 1e6;
        let mut text = String::from("start_s\tcommit_s\trows\n");
        for (start, commit, rows) in &o.parked.statements {
            text.push_str(&format!("{:.6}\t{:.6}\t{rows}\n", s(*start), s(*commit)));
        }
        std::fs::write(dir.join(format!("{tag}-parked.tsv")), text)?;
    }
    Ok(())
}

fn unix_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}
