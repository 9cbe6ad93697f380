//! `cdc-relay backfill`: re-send outbox rows from the table, with a
//! progress line on stderr (rows done, rate, ETA) and a summary on stdout.
//! SIGINT/SIGTERM, or a sink down longer than `--give-up-after`, stop it
//! with the `--since` that resumes where it stopped.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::{ConfigError, connect, outln};
use crate::backfill::{self, BackfillControl, BackfillPlan, BackfillReport};
use crate::cli::{BackfillArgs, GlobalArgs};
use crate::metrics::Metrics;

/// Runs a backfill to the end, the first error, a signal or the give-up
/// limit. Exit 0 when every row is done, 1 when it stopped early (the
/// summary says how to resume), 2 for a bad setting.
pub async fn command(g: &GlobalArgs, a: BackfillArgs) -> anyhow::Result<()> {
    // Settings first, so a mistake exits 2 before anything connects; a dry
    // run sends nothing and needs neither sink URL nor secret.
    let delivery = if a.dry_run {
        None
    } else {
        Some((
            a.delivery.dispatch().map_err(ConfigError)?,
            a.sink.build().map_err(ConfigError)?,
        ))
    };
    let mut reader = connect(g).await?;
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
    let Some((dispatch, sink)) = delivery else {
        return dry_run(&reader, &plan, a.json).await;
    };
    // Said, not refused: a publication gap a relay owes (`--on-gap tell`)
    // is backfilled beside it by design.
    if let Some((slot, pid)) =
        crate::source::shards::blocker(&reader, &g.slot, &g.slot, None).await?
    {
        eprintln!(
            "warning: slot {slot} is streamed by a relay (walsender pid {}): the rows this backfill re-sends \
             may reach the sink after newer events of the same aggregates, which the relay delivers meanwhile. \
             To keep each aggregate's order, stop the relay(s) and start them after the backfill \
             (docs/operations.md, \"An invalidated slot\")",
            pid.map_or("unknown".to_owned(), |p| p.to_string())
        );
    }
    let store = Arc::new(connect(g).await?);
    // The server's time before any row is read: only a publication gap
    // that had ended by then is covered by what this backfill reads.
    let read_from: String = reader
        .query_one("SELECT now()::text", &[])
        .await
        .map_err(|e| crate::source::SourceError::sql("reading the server's time", &e))?
        .get(0);
    let total = backfill::count(&reader, &plan).await.map_err(config)?;
    eprintln!(
        "backfill: {total} row(s) in {} from {} to {}",
        plan.table,
        plan.since,
        plan.until.as_deref().unwrap_or("now")
    );
    let mut control = BackfillControl::default();
    let export = super::start_export(&a.trace, &control.metrics)?;
    control.tracer = export.as_ref().map(|e| e.tracer().clone());
    let stop_reason = Arc::new(std::sync::Mutex::new(None::<String>));
    let watcher = tokio::spawn(watch(
        control.clone(),
        total,
        a.give_up_after,
        Arc::clone(&stop_reason),
    ));
    let started = Instant::now();
    let result = backfill::run(&mut reader, store, sink, dispatch, &plan, control).await;
    watcher.abort();
    if let Some(export) = export {
        export.shutdown(super::EXPORT_FLUSH).await;
    }
    if std::io::stderr().is_terminal() {
        eprintln!();
    }
    let report = result?;
    let stopped_by = stop_reason.lock().expect("not poisoned").clone();
    let summary = Summary::new(&plan, total, &report, stopped_by, started.elapsed());
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        outln!("{}", summary.text(&plan));
    }
    if report.complete {
        // A publication gap a relay owes (`--on-gap tell`) inside this
        // window is re-sent now: its relays are ready again.
        match crate::source::progress::clear_owed_covered(
            &reader,
            &plan.table,
            (&plan.since, plan.until.as_deref()),
            &read_from,
        )
        .await
        {
            Ok(cleared) => {
                for (slot, gap) in cleared {
                    eprintln!(
                        "backfill: the publication gap slot {slot} owed ({} to {}) is re-sent: cleared",
                        gap.since, gap.until
                    );
                }
            }
            Err(e) => eprintln!(
                "backfill: cannot clear an owed publication gap this backfill covers in cdc_relay_progress ({}): the relay keeps reporting it; run this as the relay's role (sql/roles.sql grants it UPDATE there)",
                crate::source::SourceError::sql("updating cdc_relay_progress", &e)
            ),
        }
        Ok(())
    } else {
        // The summary said how to resume; the error line says why it stopped.
        Err(anyhow::anyhow!(
            "backfill stopped: {}",
            summary
                .stopped_by
                .as_deref()
                .unwrap_or("not every row was done")
        ))
    }
}

async fn dry_run(
    reader: &tokio_postgres::Client,
    plan: &BackfillPlan,
    json: bool,
) -> anyhow::Result<()> {
    let p = backfill::preview(reader, plan).await.map_err(config)?;
    if json {
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
    Ok(())
}

/// What the summary says, on stdout (text, or JSON with `--json`).
#[derive(Debug, serde::Serialize)]
struct Summary {
    /// Every row of the range is done.
    complete: bool,
    /// Why it stopped early: `SIGINT`, `SIGTERM`, or the give-up limit.
    stopped_by: Option<String>,
    /// Rows the range held when the backfill started.
    rows_total: u64,
    /// Rows read and handed to delivery.
    rows_read: u64,
    /// Rows delivered with a 2xx.
    delivered: u64,
    /// Rows written to the dead-letter table.
    dead_lettered: u64,
    /// Seconds from the first row to the summary.
    seconds: f64,
    /// When not complete: the `--since` to resume from.
    resume_since: Option<String>,
    /// When not complete: the whole command to resume with.
    resume_command: Option<String>,
}

impl Summary {
    fn new(
        plan: &BackfillPlan,
        total: u64,
        r: &BackfillReport,
        stopped_by: Option<String>,
        took: Duration,
    ) -> Self {
        let resume_command = r.resume_since.as_ref().map(|since| {
            let until = plan
                .until
                .as_ref()
                .map(|u| format!(" --until '{u}'"))
                .unwrap_or_default();
            format!("cdc-relay backfill --since '{since}'{until}")
        });
        Self {
            complete: r.complete,
            stopped_by,
            rows_total: total,
            rows_read: r.rows,
            delivered: r.delivered,
            dead_lettered: r.dead_lettered,
            seconds: took.as_secs_f64(),
            resume_since: r.resume_since.clone(),
            resume_command,
        }
    }

    fn text(&self, plan: &BackfillPlan) -> String {
        let counts = format!(
            "{} row(s) read, {} delivered, {} dead-lettered",
            self.rows_read, self.delivered, self.dead_lettered
        );
        let mut out = if self.complete {
            format!("backfill done in {:.1} s: {counts}", self.seconds)
        } else {
            format!(
                "backfill stopped after {:.1} s ({}): {counts} of {} in {}; nothing after the resume point was skipped",
                self.seconds,
                self.stopped_by.as_deref().unwrap_or("an error"),
                self.rows_total,
                plan.table
            )
        };
        if self.dead_lettered > 0 {
            out.push_str("\n  dead letters: cdc-relay dead-letter list");
        }
        if let Some(cmd) = &self.resume_command {
            out.push_str(&format!("\n  resume with: {cmd}"));
        }
        out
    }
}

/// Draws the progress line (rows done of the total, rate, ETA, retries)
/// and stops the backfill on SIGINT/SIGTERM (a second one exits 130 at
/// once) or when nothing was done for
/// `give_up_after` while rows wait. On a terminal the line updates in
/// place each second; otherwise a line every 10 s.
async fn watch(
    control: BackfillControl,
    total: u64,
    give_up_after: Duration,
    stop_reason: Arc<std::sync::Mutex<Option<String>>>,
) {
    let stop = |why: String, token: &CancellationToken| {
        if token.is_cancelled() && why.starts_with("SIG") {
            tracing::warn!("second signal: exiting without waiting for the attempts on the wire");
            std::process::exit(130);
        }
        tracing::warn!("backfill stopping: {why}; attempts on the wire finish");
        stop_reason.lock().expect("not poisoned").get_or_insert(why);
        token.cancel();
    };
    let Some(mut signals) = super::StopSignals::install() else {
        return;
    };
    let terminal = std::io::stderr().is_terminal();
    // The give-up limit is checked every second; the line is drawn every
    // second on a terminal, every 10 s otherwise.
    let print_every: u32 = if terminal { 1 } else { 10 };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let mut ticks: u32 = 0;
    let started = Instant::now();
    let (mut last_done, mut last_change) = (0, Instant::now());
    loop {
        tokio::select! {
            signal = signals.next() => stop(signal.into(), &control.stopping),
            _ = tick.tick() => {
                let m = &control.metrics;
                let done = m.events_delivered.get() + m.events_dead_lettered.get();
                if done != last_done {
                    (last_done, last_change) = (done, Instant::now());
                }
                ticks = ticks.wrapping_add(1);
                if ticks.is_multiple_of(print_every) {
                    let line = progress_line(done, total, started.elapsed(), &retries(m));
                    // Written, not printed: a closed stderr must not panic.
                    let mut err = std::io::stderr();
                    let _ = if terminal {
                        write!(err, "\r\x1b[K{line}").and_then(|()| err.flush())
                    } else {
                        writeln!(err, "{line}")
                    };
                }
                let waiting = m.events_received.get() > done;
                if !give_up_after.is_zero() && waiting && last_change.elapsed() >= give_up_after {
                    stop(
                        format!(
                            "gave up: nothing delivered for {} (--give-up-after)",
                            humantime::format_duration(give_up_after)
                        ),
                        &control.stopping,
                    );
                }
            }
        }
    }
}

/// `backfill: 1200/20000 done (6.0%), 400 rows/s, ETA 42s; retries: http_5xx 3`.
fn progress_line(done: u64, total: u64, elapsed: Duration, retries: &str) -> String {
    let secs = elapsed.as_secs_f64().max(0.001);
    let rate = done as f64 / secs;
    let pct = if total == 0 {
        100.0
    } else {
        done as f64 * 100.0 / total as f64
    };
    let eta = if done >= total {
        "0s".to_owned()
    } else if rate < 0.01 {
        "unknown".to_owned()
    } else {
        let left = Duration::from_secs(((total - done) as f64 / rate).ceil() as u64);
        humantime::format_duration(left).to_string()
    };
    let mut line =
        format!("backfill: {done}/{total} done ({pct:.1}%), {rate:.0} rows/s, ETA {eta}");
    if !retries.is_empty() {
        line.push_str("; retries: ");
        line.push_str(retries);
    }
    line
}

/// Retries so far by reason, e.g. `http_5xx 12, connect 3` (the reasons
/// are the bounded `cdc_relay_retries_total` labels; the log has each
/// event's only at debug level during a backfill).
fn retries(m: &Metrics) -> String {
    let mut parts = Vec::new();
    for family in m.registry().gather() {
        if family.name() != "cdc_relay_retries_total" {
            continue;
        }
        for metric in family.get_metric() {
            let n = metric.get_counter().get_value();
            if n > 0.0
                && let Some(label) = metric.get_label().iter().find(|l| l.name() == "reason")
            {
                parts.push(format!("{} {n}", label.value()));
            }
        }
    }
    parts.join(", ")
}

/// A setting the message names is wrong: exit 2; anything else: exit 1.
fn config(e: backfill::BackfillError) -> anyhow::Error {
    match e {
        backfill::BackfillError::Bound(m) => ConfigError(m).into(),
        other => other.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_line_gives_rate_and_eta() {
        let line = progress_line(1000, 5000, Duration::from_secs(10), "");
        assert_eq!(
            line,
            "backfill: 1000/5000 done (20.0%), 100 rows/s, ETA 40s"
        );
        let stalled = progress_line(0, 10, Duration::from_secs(3), "connect 4");
        assert_eq!(
            stalled,
            "backfill: 0/10 done (0.0%), 0 rows/s, ETA unknown; retries: connect 4"
        );
        assert!(progress_line(10, 10, Duration::from_secs(1), "").ends_with("ETA 0s"));
    }
}
