//! Scenarios b and d: sustained throughput draining a backlog (to Billing
//! and to the null sink; Billing's own maximum as the ceiling) and the peak
//! memory while draining.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use harness::app::{self, TEST_SECRET};
use harness::otlp::Collector;
use harness::prom;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::Ctx;
use crate::contender::{Contender, Proc, proc_cpu_s, proc_kb, start_contender_with};
use crate::results::Results;
use crate::workload::{
    billing_invoiced, drop_stack, fresh_stack, insert_backlog, insert_traced_backlog, null_sink,
};

pub(crate) async fn throughput(
    ctx: &mut Ctx,
    run: u32,
    drains: bool,
    memory_big: bool,
) -> anyhow::Result<()> {
    let n = ctx.cfg.backlog;
    let mifs = ctx.cfg.max_in_flight.clone();
    let sinks = ctx.cfg.sinks.clone();
    let has = |s: &str| sinks.iter().any(|x| x == s);
    if drains && has("billing") {
        eprintln!("  b. Billing's own maximum insert rate");
        billing_max(ctx).await?;
    }
    let chosen = [(true, has("billing")), (false, has("null"))];
    for (to_billing, _) in chosen.into_iter().filter(|(_, on)| drains && *on) {
        let sink = if to_billing { "Billing" } else { "null sink" };
        // With --signature-schemes, every mif once per scheme; the rotation
        // below alternates their order from run to run.
        let schemes = match ctx.cfg.signature_schemes.as_slice() {
            [] => vec![None],
            listed => listed.iter().map(|s| Some(*s)).collect(),
        };
        let batches = match ctx.cfg.batches.as_slice() {
            [] => vec![1],
            listed => listed.to_vec(),
        };
        let mut contenders: Vec<Contender> = mifs
            .iter()
            .flat_map(|&m| schemes.iter().map(move |&s| (m, s)))
            .flat_map(|(m, s)| {
                batches.iter().map(move |&batch| Contender::Ours {
                    max_in_flight: m,
                    signature: s,
                    batch,
                })
            })
            .collect();
        if ctx.cfg.baselines {
            contenders.extend(Contender::BASELINES);
        }
        let len = contenders.len();
        contenders.rotate_left(run as usize % len);
        for who in contenders {
            eprintln!("  b. drain {n} → {sink}: {who:?}");
            if let Err(err) = drain_one(ctx, who, to_billing, n, false).await {
                ctx.results
                    .note(format!("b {sink} {who:?} failed: {err:#}"));
            }
        }
    }
    if memory_big {
        let big = ctx.cfg.big_backlog;
        eprintln!("  d. drain {big} → null sink: ours (memory)");
        drain_one(ctx, Contender::OURS, false, big, true).await?;
    }
    Ok(())
}

pub(crate) async fn drain_one(
    ctx: &mut Ctx,
    who: Contender,
    to_billing: bool,
    n: u64,
    big: bool,
) -> anyhow::Result<()> {
    // --traced: ours drains rows with trace contexts and exports a span per
    // delivery to the in-process collector (scenario b only, not d's big drain).
    let collector = ctx
        .collector
        .clone()
        .filter(|_| ctx.cfg.traced && !big && who.is_ours());
    let stack = fresh_stack(ctx, who.is_ours()).await?;
    let mut extra = Vec::new();
    if let Some(c) = &collector {
        insert_traced_backlog(&stack, n).await?;
        extra.extend(["--otlp-endpoint".to_owned(), c.endpoint()]);
    } else {
        insert_backlog(&stack, n).await?;
    }
    let before = collector
        .as_ref()
        .map_or((0, 0), |c| (c.spans().len(), c.requests()));
    let null = null_sink().await?;
    let billing = if to_billing {
        Some(app::start_billing(&stack, TEST_SECRET).await?)
    } else {
        None
    };
    let sink_url = match &billing {
        Some(b) => format!("{}/inbox", b.url),
        None => null.url.clone(),
    };
    let proc = start_contender_with(&stack, who, &sink_url, &extra).await?;
    let pid = proc.pid();
    eprintln!("    draining (pid {pid})");
    let cap = Duration::from_secs(if who.is_ours() {
        ctx.cfg.drain_cap_s
    } else {
        ctx.cfg.baseline_window_s
    });
    let count = async |http: &reqwest::Client| -> anyhow::Result<u64> {
        match &billing {
            Some(b) => billing_invoiced(http, b).await,
            None => Ok(null.count.load(Ordering::Relaxed)),
        }
    };
    let t0 = Instant::now();
    let mut first: Option<(Instant, u64)> = None;
    let mut last;
    // The contender's CPU seconds at the first and the last observation.
    let mut cpu_first = None;
    let mut cpu_last = None;
    let mut rss_samples: Vec<(f64, f64)> = Vec::new();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let c = count(&ctx.http).await?;
        let now = Instant::now();
        let cpu = proc_cpu_s(pid, ctx.clk_tck);
        if let Some(kb) = proc_kb(pid, "VmRSS:") {
            rss_samples.push((c as f64 / n as f64, kb));
        }
        if c > 0 && first.is_none() {
            first = Some((now, c));
            cpu_first = cpu;
        }
        if first.is_some() {
            cpu_last = cpu;
        }
        last = (now, c);
        if c >= n || now - t0 >= cap {
            break;
        }
    }
    let hwm_mb = proc_kb(pid, "VmHWM:").unwrap_or(0.0) / 1024.0;
    let (f_at, f_c) = first.unwrap_or((t0, 0));
    let secs = (last.0 - f_at).as_secs_f64();
    let rate = if secs > 0.0 {
        (last.1 - f_c) as f64 / secs
    } else {
        0.0
    };
    let sink = if to_billing { "Billing" } else { "null sink" };
    let col = who.column();
    // What a figure's name adds: the signature scheme, `, traced`.
    let tag = format!(
        "{}{}",
        who.signing(),
        if collector.is_some() { ", traced" } else { "" }
    );
    if big {
        let scen = "d. memory";
        ctx.results.add(
            scen,
            &format!("peak RSS, {n} backlog → null"),
            "MB",
            col,
            hwm_mb,
        );
        // Flatness: RSS while the first and the last fifth of the backlog drained.
        let max_in = |lo: f64, hi: f64| {
            rss_samples
                .iter()
                .filter(|(f, _)| *f >= lo && *f < hi)
                .map(|(_, kb)| kb / 1024.0)
                .fold(0.0, f64::max)
        };
        ctx.results
            .add(scen, "RSS first 20% of drain", "MB", col, max_in(0.0, 0.2));
        ctx.results
            .add(scen, "RSS last 20% of drain", "MB", col, max_in(0.8, 1.01));
        ctx.results.add(
            scen,
            &format!("drain rate, {n} backlog → null"),
            "ev/s",
            col,
            rate,
        );
    } else {
        let scen = format!("b. throughput → {sink}");
        let metric = match who {
            Contender::Ours { max_in_flight, .. } => {
                format!("max-in-flight {max_in_flight}{tag}")
            }
            Contender::Baseline { .. } => "baseline (fixed)".to_owned(),
        };
        ctx.results.add(&scen, &metric, "ev/s", col, rate);
        let row = ctx.results.row(&scen, &metric, "ev/s");
        if who.is_ours() {
            row.baseline_from = Some(Results::key(&scen, "baseline (fixed)"));
        }
        // CPU per event: steadier than the rate on a shared box (it does not
        // depend on how much CPU the neighbours left).
        if let (Some(a), Some(b)) = (cpu_first, cpu_last)
            && last.1 > f_c
        {
            let us = (b - a) * 1e6 / (last.1 - f_c) as f64;
            let cmetric = match who {
                Contender::Ours { max_in_flight, .. } => {
                    format!("CPU per event, mif {max_in_flight}{tag}")
                }
                Contender::Baseline { .. } => "CPU per event (baseline)".to_owned(),
            };
            ctx.results.add(&scen, &cmetric, "µs", col, us);
            if who.is_ours() {
                ctx.results.row(&scen, &cmetric, "µs").baseline_from =
                    Some(Results::key(&scen, "CPU per event (baseline)"));
            }
        }
        let mscen = "d. memory";
        let mmetric = match who {
            Contender::Ours { max_in_flight, .. } => {
                format!("peak RSS → {sink}, mif {max_in_flight}{tag}")
            }
            Contender::Baseline { .. } => format!("peak RSS → {sink} (baseline)"),
        };
        ctx.results.add(mscen, &mmetric, "MB", col, hwm_mb);
        if who.is_ours() {
            ctx.results.row(mscen, &mmetric, "MB").baseline_from = Some(Results::key(
                mscen,
                &format!("peak RSS → {sink} (baseline)"),
            ));
        }
        if let (Some(c), Contender::Ours { max_in_flight, .. }) = (&collector, who) {
            // After the last observation, so the CPU figure does not include it.
            let spans = traced_spans(ctx, c, &proc, before, last.1).await;
            let what = format!("mif {max_in_flight}{tag}");
            ctx.results.add(
                &scen,
                &format!("OTLP spans received, {what}"),
                "spans",
                col,
                spans.received as f64,
            );
            ctx.results.add(
                &scen,
                &format!("OTLP spans dropped, {what}"),
                "spans",
                col,
                spans.dropped,
            );
            ctx.results.note(format!(
                "{scen} {what}: the collector received {} spans ({} traces, {} with a parent) for {} events in {} export requests; the relay counted {} exported, {} dropped (queue_full {}, export_failed {})",
                spans.received,
                spans.traces,
                spans.with_parent,
                last.1,
                spans.requests,
                spans.exported,
                spans.dropped,
                spans.queue_full,
                spans.dropped - spans.queue_full,
            ));
            eprintln!(
                "    OTLP: {} spans received in {} requests, {} dropped by the relay",
                spans.received, spans.requests, spans.dropped
            );
        }
        if who.is_ours() && last.1 < n {
            ctx.results.note(format!(
                "{scen} {metric}: only {} of {n} drained within the {} s cap",
                last.1,
                cap.as_secs()
            ));
        }
    }
    drop(proc);
    drop(billing);
    drop_stack(ctx, &stack).await;
    Ok(())
}

/// Drives Billing's POST /inbox directly with correctly signed, distinct
/// events at several concurrencies; the best rate is the ceiling.
pub(crate) async fn billing_max(ctx: &mut Ctx) -> anyhow::Result<()> {
    let total = ctx.cfg.billing_max_requests;
    for conc in ctx.cfg.billing_max_concurrency.clone() {
        let stack = ctx.cluster.create_stack().await?;
        let billing = app::start_billing(&stack, TEST_SECRET).await?;
        let url = format!("{}/inbox", billing.url);
        let next = Arc::new(AtomicU64::new(0));
        // Warm-up of 500 requests, not counted.
        drive_billing(&ctx.http, &url, 500, 32, &Arc::new(AtomicU64::new(0))).await?;
        let t = Instant::now();
        let errors = drive_billing(&ctx.http, &url, total, conc, &next).await?;
        let rate = total as f64 / t.elapsed().as_secs_f64();
        ctx.results.add(
            "b. throughput → Billing",
            &format!("Billing max, direct, concurrency {conc}"),
            "ev/s",
            "ours",
            rate,
        );
        if errors > 0 {
            ctx.results
                .note(format!("Billing max c={conc}: {errors} non-2xx answers"));
        }
        drop(billing);
        drop_stack(ctx, &stack).await;
    }
    // The batch inbox's own maximum: arrays of each listed size above 1,
    // at concurrency 16, events per second.
    for batch in ctx.cfg.batches.clone().into_iter().filter(|b| *b > 1) {
        let stack = ctx.cluster.create_stack().await?;
        let billing = app::start_billing(&stack, TEST_SECRET).await?;
        let url = format!("{}/inbox", billing.url);
        let requests = (total / u64::from(batch)).max(50);
        let batch = batch as usize;
        drive_billing_batches(&ctx.http, &url, 50, 16, batch, &Arc::new(AtomicU64::new(0))).await?;
        let next = Arc::new(AtomicU64::new(0));
        let t = Instant::now();
        let errors = drive_billing_batches(&ctx.http, &url, requests, 16, batch, &next).await?;
        let rate = (requests * batch as u64) as f64 / t.elapsed().as_secs_f64();
        ctx.results.add(
            "b. throughput → Billing",
            &format!("Billing batch inbox max, direct, batch {batch}, concurrency 16"),
            "ev/s",
            "ours",
            rate,
        );
        if errors > 0 {
            ctx.results.note(format!(
                "Billing batch max, batch {batch}: {errors} non-2xx answers"
            ));
        }
        drop(billing);
        drop_stack(ctx, &stack).await;
    }
    Ok(())
}

/// One signed event body for Billing, new ids.
fn billing_event() -> String {
    format!(
        r#"{{"id":"{}","type":"OrderCreated","data":{{"order_id":"{}","amount_cents":2599,"currency":"EUR"}}}}"#,
        Uuid::new_v4(),
        Uuid::new_v4()
    )
}

/// [`drive_billing`] with `total` batch requests of `batch` events each.
async fn drive_billing_batches(
    http: &reqwest::Client,
    url: &str,
    total: u64,
    conc: usize,
    batch: usize,
    next: &Arc<AtomicU64>,
) -> anyhow::Result<u64> {
    let errors = Arc::new(AtomicU64::new(0));
    let mut set = JoinSet::new();
    for _ in 0..conc {
        let (http, url, next, errors) = (
            http.clone(),
            url.to_owned(),
            Arc::clone(next),
            Arc::clone(&errors),
        );
        set.spawn(async move {
            let mac = Hmac::<Sha256>::new_from_slice(TEST_SECRET.as_bytes()).expect("any key");
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let events: Vec<String> = (0..batch).map(|_| billing_event()).collect();
                let body = format!("[{}]", events.join(","));
                let sig = hex::encode(
                    mac.clone()
                        .chain_update(body.as_bytes())
                        .finalize()
                        .into_bytes(),
                );
                let ok = match http
                    .post(&url)
                    .header("content-type", "application/json")
                    .header("x-event-signature", sig)
                    .header("x-event-batch", batch.to_string())
                    .body(body)
                    .send()
                    .await
                {
                    Ok(r) => r.status().is_success(),
                    Err(_) => false,
                };
                if !ok {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
    while set.join_next().await.is_some() {}
    Ok(errors.load(Ordering::Relaxed))
}

pub(crate) async fn drive_billing(
    http: &reqwest::Client,
    url: &str,
    total: u64,
    conc: usize,
    next: &Arc<AtomicU64>,
) -> anyhow::Result<u64> {
    let errors = Arc::new(AtomicU64::new(0));
    let mut set = JoinSet::new();
    for _ in 0..conc {
        let (http, url, next, errors) = (
            http.clone(),
            url.to_owned(),
            Arc::clone(next),
            Arc::clone(&errors),
        );
        set.spawn(async move {
            let mac = Hmac::<Sha256>::new_from_slice(TEST_SECRET.as_bytes()).expect("any key");
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let body = billing_event();
                let sig = hex::encode(
                    mac.clone()
                        .chain_update(body.as_bytes())
                        .finalize()
                        .into_bytes(),
                );
                let ok = match http
                    .post(&url)
                    .header("content-type", "application/json")
                    .header("x-event-signature", sig)
                    .body(body)
                    .send()
                    .await
                {
                    Ok(r) => r.status().is_success(),
                    Err(_) => false,
                };
                if !ok {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
    while set.join_next().await.is_some() {}
    Ok(errors.load(Ordering::Relaxed))
}

/// What the collector and the relay's counters say about one traced drain.
struct TracedSpans {
    /// Spans the collector received during this drain.
    received: usize,
    /// Its export requests during this drain.
    requests: u64,
    /// Distinct trace ids among them, and spans with a parent (the row's
    /// stored context).
    traces: usize,
    with_parent: usize,
    exported: f64,
    dropped: f64,
    queue_full: f64,
}

/// Waits until the collector holds a span per delivered event, or no export
/// request came for 3 s (a batch waits at most 1 s for company), at most
/// 20 s; then reads the relay's span counters.
async fn traced_spans(
    ctx: &Ctx,
    collector: &Collector,
    proc: &Proc,
    (spans_before, requests_before): (usize, u64),
    delivered: u64,
) -> TracedSpans {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut requests = collector.requests();
    let mut received = collector.spans().len() - spans_before;
    let mut quiet_since = Instant::now();
    while (received as u64) < delivered
        && quiet_since.elapsed() < Duration::from_secs(3)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let r = collector.requests();
        if r != requests {
            requests = r;
            received = collector.spans().len() - spans_before;
            quiet_since = Instant::now();
        }
    }
    let spans = collector.spans();
    let mine = spans.get(spans_before..).unwrap_or_default();
    let traces = mine
        .iter()
        .map(|s| s.trace_id.as_str())
        .collect::<std::collections::HashSet<_>>()
        .len();
    let with_parent = mine.iter().filter(|s| !s.parent_span_id.is_empty()).count();
    let (mut exported, mut dropped, mut queue_full) = (f64::NAN, f64::NAN, f64::NAN);
    if let Some(url) = proc.admin_url()
        && let Ok(m) = prom::scrape(&ctx.http, url).await
    {
        exported = m.sum("cdc_relay_trace_spans_exported_total");
        dropped = m.sum("cdc_relay_trace_spans_dropped_total");
        queue_full = m
            .value(
                "cdc_relay_trace_spans_dropped_total",
                &[("reason", "queue_full")],
            )
            .unwrap_or(0.0);
    }
    TracedSpans {
        received,
        requests: requests - requests_before,
        traces,
        with_parent,
        exported,
        dropped,
        queue_full,
    }
}
