//! Scenario g (issue 16): scaling with shards. A backlog drained by one
//! unsharded relay, then by N relays over `--shards N` (`--max-shards 1`
//! each), every relay held to one worker thread and `--max-in-flight 4`,
//! into a sink that answers each request after a fixed 2 ms: one relay is
//! then bound by the sink's latency (at most 4 / 2 ms = 2000 events/s),
//! not by its CPU, which is what sharding is for. `--shard-sink-ms` and
//! `--shard-mif` change the sink time and the window (0 ms and 64: the
//! CPU-bound case, where sharding on one small machine does not pay).
//!
//! Figures per N: delivered events/s while the sink's count went from 10 %
//! to 90 % of the backlog; CPU per event of the relays and of the
//! walsenders (utime + stime from `/proc/<pid>/stat` of every walsender in
//! `pg_stat_replication`, from its start to the end of the drain, over the
//! backlog: each shard's slot decodes the whole WAL and its row filter
//! drops the other shards' rows, so this grows with N); the speed-up of N
//! shards over one.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use harness::app::{self, Running};
use harness::stack::Stack;

use crate::Ctx;
use crate::contender::proc_cpu_s;
use crate::results::Target;
use crate::workload::{drop_stack, fresh_stack, insert_backlog};

/// Shard counts measured (1: unsharded).
const SHARDS: [u32; 3] = [1, 2, 4];

/// The scenario's name in the table, from its sink time and window.
fn scenario(ctx: &Ctx) -> String {
    format!(
        "g. shards ({} ms sink, 1 thread, mif {})",
        ctx.cfg.shard_sink_ms, ctx.cfg.shard_mif
    )
}

pub(crate) async fn shards(ctx: &mut Ctx) -> anyhow::Result<()> {
    let scen = scenario(ctx);
    let mut rates = HashMap::new();
    for n in SHARDS {
        eprintln!(
            "  g. drain {} → {} ms sink with {n} relay(s)",
            ctx.cfg.shard_backlog, ctx.cfg.shard_sink_ms
        );
        match drain(ctx, n).await {
            Ok(rate) => {
                rates.insert(n, rate);
            }
            Err(err) => ctx.results.note(format!("g {n} shards failed: {err:#}")),
        }
    }
    if let (Some(one), Some(four)) = (rates.get(&1), rates.get(&4)) {
        let metric = "speed-up 4 shards / 1";
        ctx.results.add(&scen, metric, "×", "ours", four / one);
        // Issue 16's target holds for its setup: a 2 ms sink.
        if ctx.cfg.shard_sink_ms == 2 {
            ctx.results.target(&scen, metric, Target::AtLeast(3.2));
        }
    }
    if let (Some(one), Some(two)) = (rates.get(&1), rates.get(&2)) {
        ctx.results
            .add(&scen, "speed-up 2 shards / 1", "×", "ours", two / one);
    }
    Ok(())
}

/// Drains the backlog with `n` relays (unsharded for 1); returns events/s.
async fn drain(ctx: &mut Ctx, n: u32) -> anyhow::Result<f64> {
    let backlog = ctx.cfg.shard_backlog;
    let stack = fresh_stack(ctx, false).await?;
    let shards = n.to_string();
    let mut setup_args = vec!["setup"];
    if n > 1 {
        setup_args = vec!["--shards", &shards, "setup"];
    }
    let out = app::relay_command(&stack, &stack.orders_admin_url, &setup_args, &[]).await?;
    anyhow::ensure!(out.success(), "setup failed:\n{}", out.text());
    insert_backlog(&stack, backlog).await?;
    let sink = SlowSink::start(Duration::from_millis(ctx.cfg.shard_sink_ms)).await?;
    let mut relays = Vec::new();
    for k in 1..=n {
        relays.push(start(&stack, &sink.url, n, k, ctx.cfg.shard_mif).await?);
    }
    let admin = stack.orders_admin().await?;
    let t0 = Instant::now();
    let (lo, hi) = (backlog / 10, backlog * 9 / 10);
    let (mut at_lo, mut at_hi) = (None, None);
    let mut walsenders: HashMap<i32, f64> = HashMap::new();
    let cap = Duration::from_secs(ctx.cfg.drain_cap_s);
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let c = sink.count.load(Ordering::Relaxed);
        let now = Instant::now();
        // The window opens once every relay streams its shard (a relay
        // whose first pick was taken retries 250–750 ms later).
        let streaming = read_walsenders(&admin, ctx.clk_tck, &mut walsenders).await?;
        if c >= lo && at_lo.is_none() && streaming == n as usize {
            at_lo = Some((now, c));
        }
        if c >= hi && at_hi.is_none() && at_lo.is_some() {
            at_hi = Some((now, c));
        }
        if c >= backlog || now - t0 >= cap {
            break;
        }
    }
    let delivered = sink.count.load(Ordering::Relaxed);
    anyhow::ensure!(
        delivered >= backlog,
        "only {delivered} of {backlog} delivered within {cap:?}"
    );
    // Every walsender has decoded everything by now; read them once more.
    read_walsenders(&admin, ctx.clk_tck, &mut walsenders).await?;
    let relay_cpu: f64 = relays
        .iter()
        .filter_map(|r| proc_cpu_s(r.process.pid(), ctx.clk_tck))
        .sum();
    let wal_cpu: f64 = walsenders.values().sum();
    let (Some((a, ca)), Some((b, cb))) = (at_lo, at_hi) else {
        anyhow::bail!("the 10–90 % window never opened with all {n} relays streaming");
    };
    let rate = (cb - ca) as f64 / (b - a).as_secs_f64();
    let per = |s: f64| s * 1e6 / backlog as f64;
    let label = if n == 1 {
        "1 relay, unsharded".to_owned()
    } else {
        format!("{n} shards × 1 relay")
    };
    let scen = scenario(ctx);
    ctx.results
        .add(&scen, &format!("{label}: delivered"), "ev/s", "ours", rate);
    ctx.results.add(
        &scen,
        &format!("{label}: walsender CPU per event"),
        "µs",
        "ours",
        per(wal_cpu),
    );
    ctx.results.add(
        &scen,
        &format!("{label}: relay CPU per event"),
        "µs",
        "ours",
        per(relay_cpu),
    );
    ctx.results.add(
        &scen,
        &format!("{label}: sink service time (mean)"),
        "ms",
        "ours",
        sink.mean_service_ms(),
    );
    if walsenders.len() != n as usize {
        ctx.results.note(format!(
            "g {label}: {} walsender pids seen (expected {n})",
            walsenders.len()
        ));
    }
    drop(relays);
    drop_shard_slots(&admin, &stack).await;
    drop(admin);
    drop_stack(ctx, &stack).await;
    Ok(rate)
}

/// Relay `k` of `n`: one worker thread, `--max-in-flight mif`, with
/// `--shards n --max-shards 1` when `n > 1`.
async fn start(stack: &Stack, sink_url: &str, n: u32, k: u32, mif: u32) -> anyhow::Result<Running> {
    let shards = n.to_string();
    let mif = mif.to_string();
    let name = format!("bench-shard-{k}");
    let mut args = vec![
        "--worker-threads",
        "1",
        "--max-in-flight",
        &mif,
        "--application-name",
        &name,
        "--log",
        "info,pgwire_replication=off",
    ];
    if n > 1 {
        args.extend(["--shards", &shards, "--max-shards", "1"]);
    }
    app::start_relay(stack, sink_url, &args).await
}

/// Adds the CPU seconds of every walsender now in `pg_stat_replication`
/// to `seen` (the latest reading per pid: a walsender's CPU only grows);
/// returns how many are streaming (catching up included).
async fn read_walsenders(
    admin: &tokio_postgres::Client,
    clk_tck: f64,
    seen: &mut HashMap<i32, f64>,
) -> anyhow::Result<usize> {
    let rows = admin
        .query(
            "SELECT pid FROM pg_stat_replication WHERE state IN ('catchup', 'streaming')",
            &[],
        )
        .await?;
    for row in &rows {
        let pid: i32 = row.get(0);
        if let Some(cpu) = u32::try_from(pid).ok().and_then(|p| proc_cpu_s(p, clk_tck)) {
            seen.insert(pid, cpu);
        }
    }
    Ok(rows.len())
}

/// `drop_stack` drops only the unsharded slot: drop the shard slots too
/// (each keeps WAL), once their walsenders are gone.
async fn drop_shard_slots(admin: &tokio_postgres::Client, stack: &Stack) {
    let pattern = format!("{}\\_%of%", stack.slot);
    for _ in 0..50 {
        let _ = admin
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                 WHERE slot_name LIKE $1 AND NOT active",
                &[&pattern],
            )
            .await;
        let left: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE $1",
                &[&pattern],
            )
            .await
            .map_or(0, |r| r.get(0));
        if left == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An in-process sink answering 204 after a fixed delay (a blocking-pool
/// thread sleeps it, within ~0.1 ms), any number of requests at once,
/// counting them and the time they were held.
struct SlowSink {
    url: String,
    count: Arc<AtomicU64>,
    held_us: Arc<AtomicU64>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl SlowSink {
    async fn start(delay: Duration) -> anyhow::Result<SlowSink> {
        type Shared = (Duration, Arc<AtomicU64>, Arc<AtomicU64>);
        async fn handle(State((delay, count, held)): State<Shared>, _body: Bytes) -> StatusCode {
            let t = Instant::now();
            // A thread's sleep, not tokio's: the timer wheel rounds up to
            // the next millisecond tick, which made 2 ms about 3.1 ms.
            let _ = tokio::task::spawn_blocking(move || std::thread::sleep(delay)).await;
            held.fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
            count.fetch_add(1, Ordering::Relaxed);
            StatusCode::NO_CONTENT
        }
        let count = Arc::new(AtomicU64::new(0));
        let held_us = Arc::new(AtomicU64::new(0));
        let app = Router::new().route("/inbox", post(handle)).with_state((
            delay,
            Arc::clone(&count),
            Arc::clone(&held_us),
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let stop = harness::sink::serve(listener, app);
        Ok(SlowSink {
            url: format!("http://{addr}/inbox"),
            count,
            held_us,
            _stop: stop,
        })
    }

    fn mean_service_ms(&self) -> f64 {
        let n = self.count.load(Ordering::Relaxed).max(1);
        self.held_us.load(Ordering::Relaxed) as f64 / n as f64 / 1000.0
    }
}
