//! Scenario h (issue 15): `cdc-relay dead-letter replay --all` of a large
//! dead-letter table to the real Billing service.
//!
//! The table is filled the way a Billing outage answered with 422s would
//! have left it: one `OrderCreated` per order (a fresh order id, 1000 to
//! 5999 cents, EUR: what Billing invoices), each its own aggregate,
//! `http_status` 422. The replay runs as the operator would run it, the
//! release binary as the relay role, and is timed from start to exit; the
//! figure is rows delivered (and removed, with their audit rows) per
//! second of that. Afterwards the table must be empty, the audit table must
//! hold one `replay` row per event and Billing one invoice per event. The
//! replay's own CPU per event and Billing's are printed beside the rate.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use harness::app::{self, TEST_SECRET};
use harness::stack::Stack;

use crate::Ctx;
use crate::contender::{clk_tck, proc_cpu_s};
use crate::workload::{billing_invoiced, drop_stack, fresh_stack};

/// Fills the dead-letter table with `n` `OrderCreated` rows Billing
/// accepts, one aggregate each.
async fn insert_dead_letters(db: &tokio_postgres::Client, n: u64) -> anyhow::Result<()> {
    db.batch_execute(&format!(
        "INSERT INTO cdc_relay_dead_letter
           (event_id, aggregate_key, event_type, payload, http_status, error,
            response_excerpt, attempts, first_attempt_at, last_attempt_at)
         SELECT gen_random_uuid()::text, o::text, 'OrderCreated',
                jsonb_build_object('order_id', o, 'amount_cents', 1000 + i % 5000,
                                   'currency', 'EUR')::text,
                422, 'http_422: billing refused the event',
                '{{\"error\":\"temporarily_unprocessable\"}}', 1,
                now() - interval '1 hour', now() - interval '1 hour'
         FROM (SELECT i, gen_random_uuid() AS o FROM generate_series(1, {n}) i) g;
         ANALYZE cdc_relay_dead_letter;"
    ))
    .await
    .context("inserting the dead letters")
}

/// Runs `cdc-relay dead-letter replay --all` as the relay role (what
/// [`app::relay_command`] does, but spawned here so its CPU can be read):
/// its output and its CPU seconds, the last `/proc` reading before it
/// exited (sampled every 20 ms).
async fn run_replay(
    stack: &Stack,
    sink_url: &str,
    mif: u32,
) -> anyhow::Result<(std::process::Output, f64)> {
    let mut command = tokio::process::Command::new(harness::bins::path("cdc-relay"));
    command
        .args(app::relay_globals(stack))
        .args(["--log", "warn", "dead-letter", "replay", "--all"])
        .args(["--max-in-flight", &mif.to_string(), "--actor", "bench"])
        .env("CDC_RELAY_DATABASE_URL", &stack.relay_url)
        .env("CDC_RELAY_SINK_URL", sink_url)
        .env("EVENT_SECRET", TEST_SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = command.spawn().context("starting the replay")?;
    let pid = child.id().context("the replay's pid")?;
    let output = tokio::spawn(child.wait_with_output());
    let tck = clk_tck();
    let mut cpu = 0.0;
    while !output.is_finished() {
        if let Some(c) = proc_cpu_s(pid, tck) {
            cpu = c;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok((output.await??, cpu))
}

pub(crate) async fn replay(ctx: &mut Ctx) -> anyhow::Result<()> {
    for mif in ctx.cfg.replay_mif.clone() {
        replay_one(ctx, mif).await?;
    }
    Ok(())
}

async fn replay_one(ctx: &mut Ctx, mif: u32) -> anyhow::Result<()> {
    let n = ctx.cfg.replay_rows;
    eprintln!("  h. replay {n} dead letters → Billing, --max-in-flight {mif}");
    let stack = fresh_stack(ctx, false).await?;
    let admin = stack.orders_admin().await?;
    let t = Instant::now();
    insert_dead_letters(&admin, n).await?;
    eprintln!(
        "    {n} dead letters inserted in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let billing = app::start_billing(&stack, TEST_SECRET).await?;
    let billing_pid = billing.process.pid();
    let sink_url = format!("{}/inbox", billing.url);
    let cpu_before = proc_cpu_s(billing_pid, clk_tck());
    let t = Instant::now();
    let (out, replay_cpu) = run_replay(&stack, &sink_url, mif).await?;
    let secs = t.elapsed().as_secs_f64();
    let billing_cpu = proc_cpu_s(billing_pid, clk_tck())
        .zip(cpu_before)
        .map(|(after, before)| after - before);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout.lines().last().unwrap_or_default().to_owned();
    anyhow::ensure!(
        out.status.success(),
        "replay failed: {summary} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let count = |sql: &'static str| {
        let admin = &admin;
        async move { anyhow::Ok(admin.query_one(sql, &[]).await?.get::<_, i64>(0) as u64) }
    };
    let left = count("SELECT count(*) FROM cdc_relay_dead_letter").await?;
    let audited =
        count("SELECT count(*) FROM cdc_relay_dead_letter_audit WHERE action = 'replay'").await?;
    let invoiced = billing_invoiced(&ctx.http, &billing).await?;
    anyhow::ensure!(
        left == 0 && audited == n && invoiced == n,
        "after the replay: {left} rows left, {audited} audit rows, {invoiced} invoices (of {n})"
    );
    let rate = n as f64 / secs;
    eprintln!("    {summary}");
    eprintln!("    {rate:.0} ev/s ({secs:.1} s)");
    let scen = "h. dead-letter replay → Billing";
    ctx.results.add(
        scen,
        &format!("replay {n}, max-in-flight {mif}"),
        "ev/s",
        "ours",
        rate,
    );
    ctx.results.add(
        scen,
        &format!("replay's own CPU per event, mif {mif}"),
        "µs",
        "ours",
        replay_cpu * 1e6 / n as f64,
    );
    if let Some(cpu) = billing_cpu {
        ctx.results.add(
            scen,
            &format!("Billing CPU per event, mif {mif}"),
            "µs",
            "ours",
            cpu * 1e6 / n as f64,
        );
    }
    drop(billing);
    drop_stack(ctx, &stack).await;
    Ok(())
}
