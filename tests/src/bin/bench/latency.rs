//! Scenario a: commit-to-invoice latency at fixed order rates.

use std::collections::BTreeMap;
use std::time::Duration;

use harness::app::{self, TEST_SECRET};
use harness::prom;
use uuid::Uuid;

use crate::Ctx;
use crate::contender::{Contender, start_contender};
use crate::stats;
use crate::workload::{drop_stack, fresh_stack, post_at_rate, wait_invoices};

pub(crate) async fn latency(ctx: &mut Ctx, run: u32) -> anyhow::Result<()> {
    let rates = ctx.cfg.latency_rates.clone();
    let mut order = Contender::all_default();
    if !ctx.cfg.baselines {
        order.retain(|c| c.is_ours());
    }
    // With --batches, ours once per batch size (adaptive batching must
    // not cost latency at a low rate).
    if !ctx.cfg.batches.is_empty() {
        order.retain(|c| !c.is_ours());
        for &batch in ctx.cfg.batches.iter().rev() {
            order.insert(
                0,
                Contender::Ours {
                    max_in_flight: 64,
                    signature: None,
                    batch,
                },
            );
        }
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

pub(crate) async fn latency_one(ctx: &mut Ctx, who: Contender, rate: u32) -> anyhow::Result<()> {
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
    let tag = who.signing();
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
            "{scen} {col}{tag}: slowest of {} orders (first at {:.3} s, Unix time): {}",
            timeline.len(),
            t0 as f64 / 1e6,
            slow.join(", ")
        ));
    }
    if let Some(q) = stats::quantiles(&created) {
        for (name, v) in ["p50", "p90", "p99", "max"].iter().zip(q) {
            ctx.results.add(
                &scen,
                &format!("created_at→created_at {name}{tag}"),
                "ms",
                col,
                v,
            );
        }
    }
    if let Some(q) = stats::quantiles(&committed) {
        for (name, v) in ["p50", "p99"].iter().zip([q[0], q[2]]) {
            ctx.results
                .add(&scen, &format!("commit→commit {name}{tag}"), "ms", col, v);
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
                    &format!("relay histogram {label}{tag}"),
                    "ms",
                    col,
                    v * 1000.0,
                );
            }
        }
    }
    ctx.results.add(
        &scen,
        &format!("orders posted/s (achieved){tag}"),
        "/s",
        col,
        achieved,
    );
    if undelivered > 0 || errors > 0 {
        ctx.results.note(format!(
            "{scen} {col}{tag}: {undelivered} of {expected} orders not invoiced after {} s, {errors} POST errors \
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
