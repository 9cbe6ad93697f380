//! Scenario c: what an idle contender costs the database and the CPU.

use std::time::{Duration, Instant};

use harness::app::{self, Running, TEST_SECRET};
use harness::stack::Stack;

use crate::Ctx;
use crate::contender::{Contender, Proc, proc_cpu_s, start_contender};
use crate::workload::{drop_stack, fresh_stack};

pub(crate) struct IdleProbe {
    pub(crate) who: Contender,
    pub(crate) stack: Stack,
    pub(crate) proc: Proc,
    pub(crate) _billing: Running,
}

pub(crate) async fn idle(ctx: &mut Ctx, has_pgss: bool) -> anyhow::Result<()> {
    eprintln!(
        "  c. idle cost over {} s (every contender at once, each on its own databases)",
        ctx.cfg.idle_window_s
    );
    let mut probes = Vec::new();
    for who in Contender::all_default() {
        let stack = fresh_stack(ctx, who.is_ours()).await?;
        let billing = app::start_billing(&stack, TEST_SECRET).await?;
        let proc = start_contender(&stack, who, &format!("{}/inbox", billing.url)).await?;
        probes.push(IdleProbe {
            who,
            stack,
            proc,
            _billing: billing,
        });
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let admin = ctx.cluster.connect_superuser("postgres").await?;
    let snapshot = async |p: &IdleProbe| -> anyhow::Result<(f64, f64, f64)> {
        let calls: f64 = if has_pgss {
            admin
                .query_one(
                    "SELECT coalesce(sum(calls), 0)::float8 FROM pg_stat_statements s
                     JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = $1",
                    &[&p.stack.orders_db],
                )
                .await?
                .get(0)
        } else {
            f64::NAN
        };
        let xacts: f64 = admin
            .query_one(
                "SELECT (xact_commit + xact_rollback)::float8 FROM pg_stat_database WHERE datname = $1",
                &[&p.stack.orders_db],
            )
            .await?
            .get(0);
        let cpu = proc_cpu_s(p.proc.pid(), ctx.clk_tck).unwrap_or(f64::NAN);
        Ok((calls, xacts, cpu))
    };
    let mut before = Vec::new();
    for p in &probes {
        before.push(snapshot(p).await?);
    }
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(ctx.cfg.idle_window_s)).await;
    let mut after = Vec::new();
    for p in &probes {
        after.push(snapshot(p).await?);
    }
    let secs = t.elapsed().as_secs_f64();
    let mut top = Vec::new();
    for ((p, b), a) in probes.iter().zip(&before).zip(&after) {
        let col = p.who.column();
        if has_pgss {
            ctx.results.add(
                "c. idle",
                "statements/s on orders db (pg_stat_statements)",
                "/s",
                col,
                (a.0 - b.0) / secs,
            );
        }
        ctx.results.add(
            "c. idle",
            "transactions/s on orders db (pg_stat_database)",
            "/s",
            col,
            (a.1 - b.1) / secs,
        );
        ctx.results.add(
            "c. idle",
            "CPU of the process",
            "%",
            col,
            (a.2 - b.2) / secs * 100.0,
        );
        if has_pgss && p.who.is_ours() {
            for r in admin
                .query(
                    "SELECT calls, left(regexp_replace(query, '\\s+', ' ', 'g'), 100)
                     FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
                     WHERE d.datname = $1 AND s.userid = 'cdc_relay'::regrole
                     ORDER BY calls DESC LIMIT 5",
                    &[&p.stack.orders_db],
                )
                .await?
            {
                let calls: i64 = r.get(0);
                let q: String = r.get(1);
                top.push(format!("{calls}× {q}"));
            }
        }
    }
    if !top.is_empty() {
        ctx.results.note(format!(
            "c. statements the cdc_relay role ran on the orders db since the relay started (pg_stat_statements): {}",
            top.join(" | ")
        ));
    }
    for p in probes {
        let stack = p.stack.clone();
        drop(p);
        drop_stack(ctx, &stack).await;
    }
    Ok(())
}
