//! Scenario f (issue 17): `cdc-relay prune` deleting a large, delivered,
//! month-old outbox backlog while the relay delivers orders posted at a
//! steady rate. Figures: the relay's commit→2xx (its histogram) over a
//! window without pruning and over one with the prune running, their ratio
//! (the target: at most 2), and the prune's rows, time and rate.

use std::time::{Duration, Instant};

use anyhow::Context;
use harness::app;
use harness::prom;
use harness::stack::Stack;

use crate::Ctx;
use crate::contender::{Contender, start_contender};
use crate::workload::{drop_stack, fresh_stack, insert_backlog_at, null_sink, post_at_rate};

/// The scenario's name in the results.
pub(crate) const SCENARIO: &str = "f. prune under load";

pub(crate) async fn prune_under_load(ctx: &mut Ctx) -> anyhow::Result<()> {
    let (rows, rate) = (ctx.cfg.prune_rows, ctx.cfg.prune_rate);
    let window = Duration::from_secs(ctx.cfg.prune_window_s);
    eprintln!(
        "  f. prune {rows} delivered rows while the relay delivers {rate} orders/s ({} s windows)",
        window.as_secs()
    );
    let stack = fresh_stack(ctx, true).await?;
    let sink = null_sink().await?;
    let orders = app::start_orders(&stack).await?;
    let proc = start_contender(&stack, Contender::OURS, &sink.url).await?;
    let admin = proc
        .admin_url()
        .context("the relay's admin endpoint")?
        .to_owned();
    insert_old_backlog(&stack, rows).await?;
    let drained = Instant::now();
    while sink.count.load(std::sync::atomic::Ordering::Relaxed) < rows {
        anyhow::ensure!(
            drained.elapsed() < Duration::from_secs(ctx.cfg.drain_cap_s),
            "the backlog of {rows} was not delivered within {} s",
            ctx.cfg.drain_cap_s
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "    backlog delivered in {:.1} s",
        drained.elapsed().as_secs_f64()
    );
    // Warm-up, then the window without pruning.
    post_at_rate(&ctx.http, &orders.url, 50.0, Duration::from_secs(1)).await?;
    let (p99_alone, rate_alone) = p99_window(ctx, &orders.url, &admin, rate, window).await?;

    let started = Instant::now();
    let mut prune = tokio::process::Command::new(harness::bins::path("cdc-relay"))
        .args(app::relay_globals(&stack))
        .args(["prune", "--older-than", "7d", "--batch", "1000", "--json"])
        .env("CDC_RELAY_DATABASE_URL", &stack.orders_admin_url)
        .env("CDC_RELAY_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("starting cdc-relay prune")?;
    let stdout = prune.stdout.take().context("prune's stdout")?;
    let output = tokio::spawn(async move {
        let mut text = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut tokio::io::BufReader::new(stdout), &mut text)
            .await
            .map(|_| text)
    });
    let (p99_pruning, rate_pruning) = p99_window(ctx, &orders.url, &admin, rate, window).await?;
    let status = tokio::time::timeout(Duration::from_secs(ctx.cfg.drain_cap_s), prune.wait())
        .await
        .context("prune still running")??;
    let prune_s = started.elapsed().as_secs_f64();
    // The posting took at least the window: a prune that ended sooner left
    // part of it without pruning.
    let in_window = prune_s >= window.as_secs_f64();
    let summary: serde_json::Value = serde_json::from_str(&output.await??)
        .with_context(|| format!("prune's summary (it exited {status})"))?;
    let deleted = summary["rows_deleted"].as_f64().unwrap_or(f64::NAN);

    let col = Contender::OURS.column();
    let r = &mut ctx.results;
    r.add(
        SCENARIO,
        "relay commit→2xx p99, no prune",
        "ms",
        col,
        p99_alone,
    );
    r.add(
        SCENARIO,
        "relay commit→2xx p99, pruning",
        "ms",
        col,
        p99_pruning,
    );
    r.add(
        SCENARIO,
        "p99 ratio (pruning / no prune)",
        "×",
        col,
        p99_pruning / p99_alone,
    );
    r.add(SCENARIO, "orders posted/s, no prune", "/s", col, rate_alone);
    r.add(
        SCENARIO,
        "orders posted/s, pruning",
        "/s",
        col,
        rate_pruning,
    );
    r.add(SCENARIO, "rows pruned", "rows", col, deleted);
    r.add(SCENARIO, "prune time", "s", col, prune_s);
    r.add(SCENARIO, "prune rate", "rows/s", col, deleted / prune_s);
    if !in_window {
        r.note(format!(
            "{SCENARIO}: the prune took {prune_s:.1} s, less than the {} s window: part of the window ran without it",
            window.as_secs()
        ));
    }
    drop(proc);
    drop(orders);
    drop_stack(ctx, &stack).await;
    Ok(())
}

/// Posts orders at `rate` for `window` and returns the relay's commit→2xx
/// p99 over that window (ms, from its histogram's buckets) and the
/// achieved rate.
async fn p99_window(
    ctx: &Ctx,
    orders_url: &str,
    admin: &str,
    rate: f64,
    window: Duration,
) -> anyhow::Result<(f64, f64)> {
    let name = "cdc_relay_commit_to_delivery_seconds";
    let before = prom::scrape(&ctx.http, admin).await?;
    let (_, achieved, _) = post_at_rate(&ctx.http, orders_url, rate, window).await?;
    // The last orders of the window are delivered within a second.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = prom::scrape(&ctx.http, admin).await?;
    let d = prom::bucket_delta(&before.buckets(name), &after.buckets(name));
    let p99 = prom::histogram_quantile(&d, 0.99).unwrap_or(f64::NAN) * 1000.0;
    Ok((p99, achieved))
}

/// Inserts `n` outbox rows dated 30 days back, each with its order in its
/// own transaction (the relay delivers them like any other), in chunks.
async fn insert_old_backlog(stack: &Stack, n: u64) -> anyhow::Result<()> {
    insert_backlog_at(stack, n, "now() - interval '30 days'", "old backlog").await
}
