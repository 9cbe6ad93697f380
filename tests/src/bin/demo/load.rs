//! The load phase: orders posted on a steady ticker while a progress line
//! follows their invoices.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context;
use harness::app;
use harness::stack::Stack;
use harness::stats::percentile;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::args::Args;
use crate::fmt::fmt_us;

/// How often the progress line is refreshed (on a terminal).
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// Without a terminal, one progress line per this many refreshes.
const PLAIN_PROGRESS_EVERY_N: u64 = 8;

/// POSTs to Orders that may be outstanding at once. The ticker waits when
/// they are all taken, so a slow Orders lowers the rate instead of piling up
/// requests.
const MAX_OUTSTANDING_POSTS: usize = 256;

/// Counters shared by the posting tasks and the progress loop.
#[derive(Default)]
struct Shared {
    sent: AtomicU64,
    accepted: AtomicU64,
    failed: AtomicU64,
    /// Accepted orders whose invoice has not been seen yet.
    pending: Mutex<Vec<Uuid>>,
    first_error: Mutex<Option<String>>,
}

impl Shared {
    fn pending(&self) -> MutexGuard<'_, Vec<Uuid>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What the load phase observed.
pub(crate) struct LoadReport {
    pub(crate) total: u64,
    pub(crate) sent: u64,
    pub(crate) accepted: u64,
    pub(crate) failed: u64,
    pub(crate) first_error: Option<String>,
    /// First tick to last tick.
    pub(crate) sending: Duration,
    /// Whether every accepted order got its invoice within the drain timeout.
    pub(crate) drained: bool,
    /// Last order accepted to last invoice seen.
    pub(crate) drain: Duration,
}

/// Posts the orders from a ticker while the progress loop follows the
/// invoices; returns once every accepted order is invoiced or the drain
/// timeout passed.
pub(crate) async fn run_load(
    args: &Args,
    total: u64,
    http: &reqwest::Client,
    orders_url: &str,
    stack: &Stack,
) -> anyhow::Result<LoadReport> {
    let shared = Arc::new(Shared::default());
    let mut tracker = Tracker::connect(stack).await?;
    let poster = tokio::spawn(post_orders(
        http.clone(),
        orders_url.to_owned(),
        total,
        args.rate,
        Arc::clone(&shared),
    ));
    // If this future is dropped (error, Ctrl-C), stop posting too.
    let poster = AbortOnDrop(Some(poster));

    let tty = std::io::stderr().is_terminal();
    let started = Instant::now();
    let mut ticker = tokio::time::interval(PROGRESS_EVERY);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut refreshes: u64 = 0;
    let mut posted_at: Option<Instant> = None;
    let mut drained = false;
    loop {
        ticker.tick().await;
        tracker.poll(&shared).await?;
        refreshes += 1;
        let posting_done = poster.is_finished();
        if posting_done && posted_at.is_none() {
            posted_at = Some(Instant::now());
        }
        let done = posting_done && shared.pending().is_empty();
        let timed_out = posted_at.is_some_and(|at| at.elapsed() >= args.drain_timeout);
        if tty || refreshes % PLAIN_PROGRESS_EVERY_N == 1 || done || timed_out {
            let phase = match (posting_done, done) {
                (false, _) => "",
                (true, false) => "draining",
                (true, true) => "drained",
            };
            let line = tracker.line(&shared, total, started.elapsed(), phase);
            if tty {
                eprint!("\r\x1b[2K{line}");
            } else {
                eprintln!("{line}");
            }
            let _ = std::io::stderr().flush();
        }
        if done {
            drained = true;
            break;
        }
        if timed_out {
            break;
        }
    }
    let sending = poster.join().await.context("the posting task failed")?;
    let drain = posted_at.map(|at| at.elapsed()).unwrap_or_default();
    let first_error = shared
        .first_error
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    Ok(LoadReport {
        total,
        sent: shared.sent.load(Ordering::Relaxed),
        accepted: shared.accepted.load(Ordering::Relaxed),
        failed: shared.failed.load(Ordering::Relaxed),
        first_error,
        sending,
        drained,
        drain,
    })
}

/// Aborts a spawned task when dropped (until [`AbortOnDrop::join`]).
struct AbortOnDrop<T>(Option<tokio::task::JoinHandle<T>>);

impl<T> AbortOnDrop<T> {
    fn is_finished(&self) -> bool {
        self.0
            .as_ref()
            .is_none_or(tokio::task::JoinHandle::is_finished)
    }

    async fn join(mut self) -> anyhow::Result<T> {
        let handle = self.0.take().context("the task was already joined")?;
        Ok(handle.await?)
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        if let Some(handle) = &self.0 {
            handle.abort();
        }
    }
}

/// One POST per tick; returns the time from the first tick to the last.
async fn post_orders(
    http: reqwest::Client,
    orders_url: String,
    total: u64,
    rate: f64,
    shared: Arc<Shared>,
) -> Duration {
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    // Behind schedule (a stalled Orders): continue at the rate, never catch
    // up with a burst.
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let limit = Arc::new(Semaphore::new(MAX_OUTSTANDING_POSTS));
    let mut posts = JoinSet::new();
    let mut first_tick = None;
    for _ in 0..total {
        ticker.tick().await;
        first_tick.get_or_insert_with(Instant::now);
        let Ok(permit) = Arc::clone(&limit).acquire_owned().await else {
            break;
        };
        shared.sent.fetch_add(1, Ordering::Relaxed);
        let (http, url, shared) = (http.clone(), orders_url.clone(), Arc::clone(&shared));
        posts.spawn(async move {
            let amount = rand::random_range(100..100_000);
            let result = app::post_order(&http, &url, amount).await;
            drop(permit);
            match result.and_then(|(order_id, _)| Ok(Uuid::parse_str(&order_id)?)) {
                Ok(order_id) => {
                    shared.pending().push(order_id);
                    shared.accepted.fetch_add(1, Ordering::Relaxed);
                }
                Err(err) => {
                    shared.failed.fetch_add(1, Ordering::Relaxed);
                    shared
                        .first_error
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert_with(|| format!("{err:#}"));
                }
            }
        });
        while posts.try_join_next().is_some() {}
    }
    let sending = first_tick.map(|t| t.elapsed()).unwrap_or_default();
    while posts.join_next().await.is_some() {}
    sending
}

/// Follows the invoices of the accepted orders for the progress line.
struct Tracker {
    orders_db: Client,
    billing_db: Client,
    invoiced: u64,
    /// Order commit → invoice commit, microseconds, one per invoice seen.
    latencies_us: Vec<i64>,
}

/// Commit time and creation time of a row's transaction, microseconds since
/// the Unix epoch. `xmin` is the inserting transaction (rows never updated).
pub(crate) const TIMES: &str = "(extract(epoch FROM pg_xact_commit_timestamp(xmin)) * 1000000)::int8, \
                     (extract(epoch FROM created_at) * 1000000)::int8";

impl Tracker {
    async fn connect(stack: &Stack) -> anyhow::Result<Tracker> {
        Ok(Tracker {
            orders_db: stack.orders_admin().await?,
            billing_db: stack.billing_admin().await?,
            invoiced: 0,
            latencies_us: Vec::new(),
        })
    }

    /// Moves the pending orders that got their invoice to `invoiced`.
    async fn poll(&mut self, shared: &Shared) -> anyhow::Result<()> {
        let pending: Vec<Uuid> = shared.pending().clone();
        if pending.is_empty() {
            return Ok(());
        }
        let invoices = times_by_id(
            &self.billing_db,
            &format!("SELECT order_id, {TIMES} FROM invoices WHERE order_id = ANY($1)"),
            &pending,
        )
        .await?;
        if invoices.is_empty() {
            return Ok(());
        }
        let ids: Vec<Uuid> = invoices.keys().copied().collect();
        let orders = times_by_id(
            &self.orders_db,
            &format!("SELECT id, {TIMES} FROM orders WHERE id = ANY($1)"),
            &ids,
        )
        .await?;
        for (id, invoice) in &invoices {
            if let (Some(order), Some(invoice_commit)) = (orders.get(id), invoice.commit_us)
                && let Some(order_commit) = order.commit_us
            {
                self.latencies_us.push(invoice_commit - order_commit);
            }
        }
        self.invoiced += invoices.len() as u64;
        shared.pending().retain(|id| !invoices.contains_key(id));
        Ok(())
    }

    fn line(&self, shared: &Shared, total: u64, elapsed: Duration, phase: &str) -> String {
        let sent = shared.sent.load(Ordering::Relaxed);
        let failed = shared.failed.load(Ordering::Relaxed);
        let in_flight = shared.pending().len();
        let width = total.to_string().len();
        let mut sorted = self.latencies_us.clone();
        sorted.sort_unstable();
        let p50 = percentile(&sorted, 0.50).map_or_else(|| "-".to_owned(), fmt_us);
        let mut line = format!(
            "  {:>6.1}s  sent {sent:>width$}/{total}  invoiced {:>width$}  in flight {in_flight:>4}  p50 {p50:>8}",
            elapsed.as_secs_f64(),
            self.invoiced,
        );
        if failed > 0 {
            line.push_str(&format!("  failed {failed}"));
        }
        if !phase.is_empty() {
            line.push_str("  ");
            line.push_str(phase);
        }
        line
    }
}

/// A row's transaction times, microseconds since the epoch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowTimes {
    /// `pg_xact_commit_timestamp(xmin)`; `None` if the server has none.
    pub(crate) commit_us: Option<i64>,
    /// `created_at` (`now()` of the transaction).
    pub(crate) created_us: i64,
}

/// Runs `sql` (selecting `id, commit_us, created_us`, with `$1` a uuid
/// array) and indexes the rows by id.
async fn times_by_id(
    db: &Client,
    sql: &str,
    ids: &[Uuid],
) -> anyhow::Result<HashMap<Uuid, RowTimes>> {
    let rows = db.query(sql, &[&ids]).await.context("reading row times")?;
    Ok(rows
        .iter()
        .map(|r| {
            (
                r.get(0),
                RowTimes {
                    commit_us: r.get(1),
                    created_us: r.get(2),
                },
            )
        })
        .collect())
}
