//! Scenario e: recovery after a Billing outage.

use std::time::{Duration, Instant};

use harness::app::{self, TEST_SECRET};
use harness::sink::ScriptedSink;

use crate::Ctx;
use crate::contender::{Contender, start_contender};
use crate::workload::{drop_stack, fresh_stack, post_at_rate, wait_invoices};

pub(crate) async fn recovery(ctx: &mut Ctx, run: u32) -> anyhow::Result<()> {
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

pub(crate) async fn recovery_one(ctx: &mut Ctx, who: Contender) -> anyhow::Result<()> {
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
