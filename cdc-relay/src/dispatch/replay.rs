//! Replaying dead letters through the one pipeline: the rows are a source,
//! the way a backfill's rows are.
//!
//! ```text
//!  Rows::next_page ──▶ window ──▶ Begin, Event(row), Commit{end: DeadLetterId(id)} ──▶ dispatch::run ──▶ sink
//!    (id order)                                                                            │ each job's end
//!  Rows::remove ◀── delivered ids, in batches ◀────────────────────────────────────────────┘ (Ended)
//! ```
//!
//! Each row is its own transaction to the pipeline, positioned by its row
//! id ([`DeadLetterId`]); its event carries the id
//! ([`OutboxEvent::dead_letter_id`]). So the rules are the pipeline's:
//! rows go oldest first, one at a time within an aggregate and several
//! aggregates at once (up to the lane's `max_in_flight`), paced by its
//! `rate`, through its breaker, judged by `sink::classify`; how hard each
//! is tried is the pipeline's [`Persist`](super::Persist). A row is removed, with its audit
//! row, only after its 2xx: in batches of [`BATCH`], at the first 2xx
//! [`FLUSH_EVERY`] after the previous removal, and at the end. A replay
//! killed between a 2xx and its removal leaves the row, and a later replay
//! sends it again: the receiver sees the event id twice, which it must
//! absorb anyway (delivery is at least once).
//!
//! Two replayers use it: `dead-letter replay` (with [`Persist::OneAttempt`](super::Persist::OneAttempt))
//! and a parked endpoint's resume ([`super::resume`]).

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::lane::Lane;
use super::park::Park;
use super::{Confirmed, DispatchError, Ended, Item, Outcome, Pipeline, Window};
use crate::ack::Position;
use crate::dead_letter::{DeadLetterStore, StoreError};
use crate::outbox::OutboxEvent;
use crate::sink::Sink;

/// A replay's position: row `id` of the dead-letter table, handed to the
/// pipeline as a transaction of its own that ends at `DeadLetterId(id)`.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeadLetterId(pub i64);

impl fmt::Display for DeadLetterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dead letter {}", self.0)
    }
}

impl Position for DeadLetterId {
    fn gauge(self) -> i64 {
        self.0
    }
}

/// Delivered rows removed per statement, at most.
pub const BATCH: usize = 1000;

/// A 2xx this long after the previous removal writes the batch, however
/// small (a slow, rate-capped replay removes as it goes).
pub const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// Rows a replay holds in memory at once (its window), and their bytes.
const WINDOW_EVENTS: usize = 2000;
const WINDOW_BYTES: u32 = 16 << 20;

/// Where a replay's rows come from and where delivered ones go.
pub trait Rows: Send {
    /// The next rows to send, oldest first, each event carrying its row id
    /// ([`OutboxEvent::dead_letter_id`]); empty when there are no more.
    fn next_page(&mut self) -> impl Future<Output = Result<Vec<OutboxEvent>, StoreError>> + Send;

    /// Rows delivered with a 2xx: remove them, with their audit rows.
    fn remove(&mut self, ids: &[i64]) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// What a replay did.
#[derive(Debug, Default)]
pub struct Replayed {
    /// Rows handed to the pipeline.
    pub fed: usize,
    /// Rows delivered (and removed) or dead-lettered again.
    pub done: usize,
    /// Every row there was was read.
    pub exhausted: bool,
    /// Rows read whose job never ended (the pipeline stopped first, or
    /// they were read and not handed over yet): row id and event id, by
    /// row id.
    pub unended: Vec<(i64, String)>,
}

/// Replays `rows` to `lane` through a pipeline of its own (`pipeline`:
/// its store, stopping token and [`Persist`](super::Persist); its report channel is the
/// replay's), at most `limit` rows, calling `ended` for each job's end.
/// The lane keeps its sink, breaker, rate cap and series, but is never
/// parked: a replay writes no parked rows. Returns when every row handed
/// over has ended or the pipeline stopped. An error when the store is
/// lost or `rows` fails.
pub async fn replay<S, D, R>(
    mut lane: Lane<S>,
    mut pipeline: Pipeline<D>,
    rows: &mut R,
    limit: usize,
    mut ended: impl FnMut(&Ended) + Send,
) -> Result<Replayed, DispatchError>
where
    S: Sink,
    D: DeadLetterStore,
    R: Rows,
{
    lane.park = Park::default();
    lane.cfg.max_lag = None;
    lane.cfg.auto_resume = false;
    let (report, mut reports) = mpsc::unbounded_channel();
    pipeline.report = Some(report);
    pipeline.wal_budget = None;
    pipeline.window = None;
    pipeline.gauges = false;
    let stopping = pipeline.stopping.clone();
    let (items, items_rx) = mpsc::channel(1024);
    let (confirmed, _) = watch::channel(Confirmed {
        position: DeadLetterId(0),
        last_done: None,
    });
    let mut run = tokio::spawn(super::run(
        vec![lane],
        pipeline,
        DeadLetterId(0),
        items_rx,
        confirmed,
    ));
    let window = Window::new(WINDOW_EVENTS, WINDOW_BYTES);
    let mut out = Replayed::default();
    let mut fed = BTreeMap::new();
    let mut page: VecDeque<OutboxEvent> = VecDeque::new();
    let mut items = Some(items);
    let mut removals = Vec::new();
    let mut last_flush = Instant::now();
    let result = loop {
        if items.is_some() && page.is_empty() && !out.exhausted && out.fed < limit {
            match rows.next_page().await {
                Ok(p) if p.is_empty() => out.exhausted = true,
                Ok(p) => page.extend(p),
                Err(e) => break Err(store_error(e)),
            }
        }
        if out.fed >= limit || stopping.is_cancelled() || (page.is_empty() && out.exhausted) {
            // Closing the items lets the pipeline end once the rows handed
            // over are done.
            items = None;
        }
        let next_size = page.front().map(OutboxEvent::size_bytes);
        tokio::select! {
            joined = &mut run => {
                break joined.expect("the replay's pipeline does not panic").map(drop);
            }
            Some(e) = reports.recv() => {
                if let Err(e) = on_report(&e, &mut out, &mut fed, &mut removals, &mut last_flush, rows).await {
                    break Err(e);
                }
                ended(&e);
            }
            permit = window.admit(next_size.unwrap_or(0)), if items.is_some() && next_size.is_some() => {
                let event = page.pop_front().expect("a row to hand over");
                let id = event.dead_letter_id.unwrap_or_default();
                let event_id = event.id.clone();
                let tx = items.as_ref().expect("items open");
                let sent = tx.send(Item::Begin).await.is_ok()
                    && tx.send(Item::Event(event, permit)).await.is_ok()
                    && tx.send(Item::Commit { end: DeadLetterId(id), commit_time_micros: 0 }).await.is_ok();
                if sent {
                    fed.insert(id, event_id);
                    out.fed += 1;
                }
            }
            _ = stopping.cancelled(), if items.is_some() => {}
        }
    };
    // The pipeline has ended (or the replay failed): what it reported
    // still counts, and delivered rows are removed whatever happened.
    run.abort();
    while let Ok(e) = reports.try_recv() {
        removals_only(&e, &mut out, &mut fed, &mut removals);
        ended(&e);
    }
    let flushed = flush(rows, &mut removals).await;
    result?;
    flushed.map_err(store_error)?;
    fed.extend(
        page.into_iter()
            .map(|e| (e.dead_letter_id.unwrap_or_default(), e.id)),
    );
    out.unended = fed.into_iter().collect();
    Ok(out)
}

/// Books one job's end: a delivered row joins the removals, written when
/// [`BATCH`] wait or at the first 2xx [`FLUSH_EVERY`] after the last write.
async fn on_report<R: Rows>(
    e: &Ended,
    out: &mut Replayed,
    fed: &mut BTreeMap<i64, String>,
    removals: &mut Vec<i64>,
    last_flush: &mut Instant,
    rows: &mut R,
) -> Result<(), DispatchError> {
    let delivered = removals_only(e, out, fed, removals);
    if delivered && (removals.len() >= BATCH || last_flush.elapsed() >= FLUSH_EVERY) {
        flush(rows, removals).await.map_err(store_error)?;
        *last_flush = Instant::now();
    }
    Ok(())
}

/// [`on_report`] without the write; `true` for a 2xx.
fn removals_only(
    e: &Ended,
    out: &mut Replayed,
    fed: &mut BTreeMap<i64, String>,
    removals: &mut Vec<i64>,
) -> bool {
    let Some(id) = e.event.dead_letter_id else {
        return false;
    };
    fed.remove(&id);
    match e.outcome {
        Outcome::Delivered(_) => {
            out.done += 1;
            removals.push(id);
            true
        }
        Outcome::DeadLettered => {
            out.done += 1;
            false
        }
        _ => false,
    }
}

/// Removes the delivered rows not removed yet.
async fn flush<R: Rows>(rows: &mut R, removals: &mut Vec<i64>) -> Result<(), StoreError> {
    if removals.is_empty() {
        return Ok(());
    }
    let ids: Vec<String> = removals.iter().take(10).map(ToString::to_string).collect();
    let more = if removals.len() > 10 { ", …" } else { "" };
    let said = |e: String| {
        format!(
            "removing {} delivered row(s) (ids {}{more}): {e}. They were delivered and stay in the table: replaying them again is harmless (the inbox deduplicates)",
            removals.len(),
            ids.join(", ")
        )
    };
    rows.remove(removals).await.map_err(|e| match e {
        StoreError::Lost(e) => StoreError::Lost(said(e)),
        StoreError::Failed(e) => StoreError::Failed(said(e)),
    })?;
    removals.clear();
    Ok(())
}

fn store_error(e: StoreError) -> DispatchError {
    match e {
        StoreError::Lost(e) => DispatchError::StoreLost(e),
        StoreError::Failed(e) => DispatchError::Rows(e),
    }
}
