//! Scenario i (issue 15): what routing costs when there is nothing to route.
//! The same backlog is drained into the null sink by `run --sink-url` and by
//! `run --routes FILE` whose one endpoint takes every type (`*`) at the same
//! URL, secret and `max_in_flight`; the two alternate (pair k starts with
//! the one pair k−1 ended with), each on a fresh stack, so a drift of the
//! shared machine falls on both. The figures are each side's median drain
//! rate and their ratio (routes ÷ sink-url; the target is ≥ 0.95), and
//! each side's median relay CPU per event (steadier on a shared box).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use harness::app::{self, Running, TEST_SECRET};

use crate::Ctx;
use crate::contender::{RELAY_THREADS, proc_cpu_s};
use crate::stats::summarize;
use crate::workload::{NullSink, drop_stack, fresh_stack, insert_backlog, null_sink};

/// `--max-in-flight` of both sides (the endpoint's `max_in_flight`).
const MIF: u32 = 64;

/// The environment variable the routes file names for its secret.
const SECRET_ENV: &str = "BENCH_ROUTE_SECRET";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    SinkUrl,
    Routes,
}

pub(crate) async fn routes_parity(ctx: &mut Ctx) -> anyhow::Result<()> {
    let n = ctx.cfg.backlog;
    let mut rates = [Vec::new(), Vec::new()];
    let mut cpus = [Vec::new(), Vec::new()];
    let mut order = [Target::SinkUrl, Target::Routes];
    for pair in 0..ctx.cfg.parity_pairs {
        for target in order {
            eprintln!(
                "  i. drain {n} → null sink, {target:?} (pair {}/{})",
                pair + 1,
                ctx.cfg.parity_pairs
            );
            let (rate, cpu_us) = drain(ctx, target, n).await?;
            eprintln!("    {rate:.0} ev/s, {cpu_us:.1} µs of relay CPU per event");
            rates[target as usize].push(rate);
            cpus[target as usize].push(cpu_us);
        }
        order.reverse();
    }
    let scen = "i. one endpoint: --routes vs --sink-url → null";
    let [sink_url, routes] = rates
        .clone()
        .map(|r| summarize(&r).map_or(0.0, |s| s.median));
    ctx.results
        .add(scen, "drain, --sink-url (median)", "ev/s", "ours", sink_url);
    ctx.results.add(
        scen,
        "drain, --routes one endpoint (median)",
        "ev/s",
        "ours",
        routes,
    );
    ctx.results.add(
        scen,
        "ratio routes / sink-url",
        "x",
        "ours",
        routes / sink_url,
    );
    // CPU per event is steadier than the rate on a shared box.
    let [cpu_sink_url, cpu_routes] = cpus
        .clone()
        .map(|r| summarize(&r).map_or(0.0, |s| s.median));
    ctx.results.add(
        scen,
        "relay CPU per event, --sink-url (median)",
        "µs",
        "ours",
        cpu_sink_url,
    );
    ctx.results.add(
        scen,
        "relay CPU per event, --routes (median)",
        "µs",
        "ours",
        cpu_routes,
    );
    let rounded = |v: &[f64]| {
        v.iter()
            .map(|r| (r * 10.0).round() / 10.0)
            .collect::<Vec<_>>()
    };
    ctx.results.note(format!(
        "i: --sink-url runs {:?} ev/s {:?} µs/event, --routes runs {:?} ev/s {:?} µs/event",
        rounded(&rates[0]),
        rounded(&cpus[0]),
        rounded(&rates[1]),
        rounded(&cpus[1])
    ));
    Ok(())
}

/// Drains a fresh backlog of `n` with one relay: its rate from the first
/// event counted to the last, and its CPU per event over that span (µs).
async fn drain(ctx: &Ctx, target: Target, n: u64) -> anyhow::Result<(f64, f64)> {
    let stack = fresh_stack(ctx, true).await?;
    insert_backlog(&stack, n).await?;
    let null = null_sink().await?;
    let dir = tempfile::tempdir()?;
    let relay = start(&stack, target, &null, dir.path()).await?;
    let cpu = || proc_cpu_s(relay.process.pid(), ctx.clk_tck);
    let rate = measure(&null, n, Duration::from_secs(ctx.cfg.drain_cap_s), cpu).await;
    drop(relay);
    drop_stack(ctx, &stack).await;
    rate
}

async fn start(
    stack: &harness::stack::Stack,
    target: Target,
    null: &NullSink,
    dir: &std::path::Path,
) -> anyhow::Result<Running> {
    let mif = MIF.to_string();
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
    let relay = match target {
        Target::SinkUrl => app::start_relay(stack, &null.url, &args).await?,
        Target::Routes => {
            let path = dir.join("routes.toml");
            std::fs::write(
                &path,
                format!(
                    "[[endpoint]]\nname = \"null\"\nurl = {:?}\nevent_types = [\"*\"]\n\
                     secret_env = {SECRET_ENV:?}\nmax_in_flight = {MIF}\n",
                    null.url
                ),
            )?;
            app::start_relay_with_routes(stack, &path, &args, &[(SECRET_ENV, TEST_SECRET)]).await?
        }
    };
    app::wait_streaming(&relay).await?;
    Ok(relay)
}

/// Events/s the null sink counted from its first event to its `n`th (or
/// to `cap`), and the µs of `cpu` (the relay's CPU seconds) per event
/// between the same two observations.
async fn measure(
    null: &NullSink,
    n: u64,
    cap: Duration,
    cpu: impl Fn() -> Option<f64>,
) -> anyhow::Result<(f64, f64)> {
    let t0 = Instant::now();
    let mut first: Option<(Instant, u64, Option<f64>)> = None;
    let mut last = (t0, 0, None);
    while last.1 < n && t0.elapsed() < cap {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let c = null.count.load(Ordering::Relaxed);
        let (now, cpu) = (Instant::now(), cpu());
        if c > 0 && first.is_none() {
            first = Some((now, c, cpu));
        }
        last = (now, c, cpu);
    }
    anyhow::ensure!(last.1 >= n, "only {} of {n} drained within {cap:?}", last.1);
    let (at, c0, cpu0) = first.unwrap_or((t0, 0, None));
    let events = (last.1 - c0) as f64;
    let rate = events / (last.0 - at).as_secs_f64().max(1e-9);
    let cpu_us = match (cpu0, last.2) {
        (Some(a), Some(b)) if events > 0.0 => (b - a) * 1e6 / events,
        _ => f64::NAN,
    };
    Ok((rate, cpu_us))
}
