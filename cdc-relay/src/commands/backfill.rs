//! `cdc-relay backfill`: re-send outbox rows from the table, with a
//! progress line on stderr and a summary on stdout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{ConfigError, connect, outln};
use crate::backfill::{self, BackfillPlan};
use crate::cli::{BackfillArgs, GlobalArgs};

/// Runs a backfill to the end (or the first error).
pub async fn command(g: &GlobalArgs, a: BackfillArgs) -> anyhow::Result<()> {
    let dispatch = a.delivery.dispatch().map_err(ConfigError)?;
    let sink = a.sink.build().map_err(ConfigError)?;
    let mut reader = connect(g).await?;
    let store = Arc::new(connect(g).await?);
    let plan = BackfillPlan {
        table: g.table.clone(),
        columns: g.columns(),
        time_column: a.time_column.clone(),
        since: a.since.clone(),
        until: a.until.clone(),
        window_events: a.delivery.max_pending_events as usize,
        window_bytes: a.delivery.max_pending_bytes,
    };
    backfill::check_bounds(&reader, &plan)
        .await
        .map_err(config)?;
    if a.dry_run {
        let p = backfill::preview(&reader, &plan).await.map_err(config)?;
        if a.json {
            outln!("{}", serde_json::to_string_pretty(&p)?);
        } else {
            let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
            outln!(
                "backfill --dry-run: {} row(s) in {} from {} to {}; nothing sent\n  first: {} (id {})\n  last:  {} (id {})",
                p.rows,
                plan.table,
                plan.since,
                plan.until.as_deref().unwrap_or("now"),
                opt(&p.first_time),
                opt(&p.first_id),
                opt(&p.last_time),
                opt(&p.last_id)
            );
        }
        return Ok(());
    }
    let total = backfill::count(&reader, &plan).await.map_err(config)?;
    eprintln!(
        "backfill: {total} row(s) in {} from {} to {}",
        plan.table,
        plan.since,
        plan.until.as_deref().unwrap_or("now")
    );
    let started = Instant::now();
    let mut last_print = Instant::now();
    let report = backfill::run(&mut reader, store, sink, dispatch, &plan, |sent| {
        if last_print.elapsed() >= Duration::from_millis(500) || sent == total {
            eprint!("\rbackfill: {sent}/{total} handed to delivery");
            last_print = Instant::now();
        }
    })
    .await?;
    eprintln!();
    outln!(
        "backfill done in {:.1} s: {} row(s) read, {} delivered, {} dead-lettered",
        started.elapsed().as_secs_f64(),
        report.rows,
        report.delivered,
        report.dead_lettered
    );
    Ok(())
}

/// A setting the message names is wrong: exit 2; anything else: exit 1.
fn config(e: backfill::BackfillError) -> anyhow::Error {
    match e {
        backfill::BackfillError::Bound(m) => ConfigError(m).into(),
        other => other.into(),
    }
}
