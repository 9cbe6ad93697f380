//! The delivery pipeline: a bounded window, per-aggregate ordering,
//! pipelined requests with retries, and the acknowledgement watermark.
//!
//! ```text
//!  source ──Item──▶ run ──▶ Scheduler (pure: keys, max_in_flight, AckTracker)
//!    ▲  (stream        │        │ next_job
//!    │   order)        │        ▼
//!    │                 │   delivery task ──Sink::post──▶ Attempt ─classify─▶ done | retry | dead letter
//!    │                 ◀── complete(ticket) ─────────────────────────────────────┘
//!    └── confirmed position (watch) ◀── Scheduler::confirmed
//! ```
//!
//! - [`window`]: the memory bound the source admits events through.
//! - [`scheduler`]: the state machine, free of I/O (unit- and
//!   property-tested).
//! - [`delivery`]: one event's life: attempts through the breaker, backoff,
//!   the dead-letter write.
//!
//! The two I/O seams are traits: [`Sink`] (the HTTP client) and
//! [`DeadLetterStore`] (the side connection), so the whole pipeline runs in
//! unit tests against a scripted sink in paused time. [`run`] is the only
//! writer of the confirmed position, which travels back to the source as a
//! value through a `watch` channel.

pub mod delivery;
pub mod progress;
pub mod scheduler;
pub mod window;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::ack::Position;
use crate::breaker::{Breaker, BreakerConfig};
use crate::deadletter::DeadLetterStore;
use crate::health::Health;
use crate::metrics::Metrics;
use crate::outbox::{OutboxEvent, UnreadableRow};
use crate::sink::{Sink, StatusPolicy};
use delivery::{Delivery, Finished, Work};
use progress::DoneLog;
pub use progress::{Confirmed, DoneTx};
use scheduler::{Scheduler, Ticket};
pub use window::{Window, WindowPermit};

/// What the source hands the dispatcher, in stream order. `P` is the
/// source's position type (an LSN for the stream).
#[derive(Debug)]
pub enum Item<P> {
    /// A transaction starts.
    Begin,
    /// An outbox insert of the open transaction, admitted to the window.
    Event(OutboxEvent, WindowPermit),
    /// An outbox insert that cannot become an event (NULL id or type, bad
    /// text): it is dead-lettered as it is, never skipped.
    Unreadable(Box<UnreadableRow>, WindowPermit),
    /// The open transaction committed.
    Commit {
        /// End position of the transaction (its end LSN).
        end: P,
        /// Its commit time, microseconds since 2000-01-01 UTC.
        commit_time_micros: i64,
    },
    /// A keepalive reported the server's WAL end.
    Keepalive {
        /// Server WAL end.
        wal_end: P,
    },
}

/// Delivery settings.
#[derive(Clone, Debug)]
pub struct DispatchConfig {
    /// Maximum deliveries running at once (requests plus their backoff
    /// sleeps). 1 gives strict global commit order.
    pub max_in_flight: usize,
    /// First retry delay ceiling.
    pub backoff_base: Duration,
    /// Retry delay cap (full jitter below it).
    pub backoff_cap: Duration,
    /// Largest `Retry-After` honoured.
    pub retry_after_max: Duration,
    /// Which statuses are poison.
    pub policy: StatusPolicy,
    /// Circuit breaker and storm guard.
    pub breaker: BreakerConfig,
}

/// What a pipeline shares: the sink, the dead-letter store, the breaker,
/// metrics and health.
pub struct Services<S, D> {
    /// Where events are POSTed.
    pub sink: S,
    /// Where dead letters are written (the side SQL connection).
    pub store: Arc<D>,
    /// Metrics.
    pub metrics: Metrics,
    /// Readiness.
    pub health: Arc<Health>,
    /// The circuit breaker and storm guard: the caller keeps it across
    /// sessions, so a reconnect does not reset an open circuit or a storm.
    pub breaker: Breaker,
    /// Cancelled when shutdown begins: from then on no new attempt starts
    /// (`docs/architecture.md#shutdown`); attempts on the wire finish.
    pub stopping: CancellationToken,
}

/// The pipeline stopped before its input ended.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    /// Dead letters cannot be written: the side connection is gone.
    #[error("cannot write the dead-letter table: {0}")]
    StoreLost(String),
}

/// A job: its work, and its room in the window (released when done).
type Job = (Work, WindowPermit);

/// Runs until `items` closes and everything admitted is done, then returns
/// the final confirmed position. Once `services.stopping` is cancelled no
/// new attempt starts: it returns when `items` is closed and the attempts
/// on the wire have finished, with what was not done left unconfirmed.
/// Dropping the future aborts deliveries in flight (they are redelivered
/// after a restart: at-least-once). The
/// confirmed position (and the last done transaction with events) is
/// published on `confirmed` whenever it moves.
pub async fn run<P: Position, S: Sink, D: DeadLetterStore>(
    cfg: DispatchConfig,
    services: Services<S, D>,
    start: P,
    mut items: mpsc::Receiver<Item<P>>,
    confirmed: watch::Sender<Confirmed<P>>,
) -> Result<P, DispatchError> {
    let metrics = services.metrics.clone();
    let health = Arc::clone(&services.health);
    let breaker = services.breaker.clone();
    let stopping = services.stopping.clone();
    breaker.new_session();
    let delivery = Arc::new(Delivery::new(cfg.clone(), services, breaker));
    let mut scheduler: Scheduler<P, Job> = Scheduler::new(start, cfg.max_in_flight);
    let mut done = DoneLog::new();
    let mut running: JoinSet<Result<Option<Ticket>, DispatchError>> = JoinSet::new();
    let mut items_open = true;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        while !stopping.is_cancelled()
            && let Some((ticket, (work, permit))) = scheduler.next_job()
        {
            let delivery = Arc::clone(&delivery);
            running.spawn(async move {
                match delivery.run(ticket.seq, work).await? {
                    Finished::Done => {
                        drop(permit);
                        Ok(Some(ticket))
                    }
                    Finished::Abandoned => Ok(None),
                }
            });
        }
        publish(&scheduler, &mut done, &confirmed, &metrics, &health);
        if !items_open && (scheduler.is_idle() || (stopping.is_cancelled() && running.is_empty())) {
            return Ok(scheduler.confirmed());
        }
        tokio::select! {
            item = items.recv(), if items_open => match item {
                Some(item) => handle(&mut scheduler, &mut done, item, &metrics),
                None => items_open = false,
            },
            Some(done) = running.join_next() => {
                if let Some(ticket) = done.expect("delivery tasks do not panic")? {
                    scheduler.complete(ticket);
                }
            }
            // Stopping: wake up to stop spawning and to see whether the
            // attempts on the wire are all done.
            _ = stopping.cancelled(), if !stopping.is_cancelled() => {}
            _ = tick.tick() => {
                let age = scheduler
                    .oldest_pending_since()
                    .map_or(0.0, |t| t.elapsed().as_secs_f64());
                metrics.oldest_unconfirmed_event_age.set(age);
            }
        }
    }
}

fn handle<P: Position>(
    scheduler: &mut Scheduler<P, Job>,
    done: &mut DoneLog<P>,
    item: Item<P>,
    metrics: &Metrics,
) {
    match item {
        Item::Begin => scheduler.begin(),
        Item::Event(event, permit) => {
            metrics.events_received.inc();
            done.event(Some(&event.id));
            let key = event.aggregate_key.clone();
            scheduler.add(key, (Work::Deliver(event), permit), Instant::now());
        }
        Item::Unreadable(row, permit) => {
            metrics.events_received.inc();
            done.event(row.event_id.as_deref());
            scheduler.add(None, (Work::DeadLetter(row), permit), Instant::now());
        }
        Item::Commit {
            end,
            commit_time_micros,
        } => {
            scheduler.commit(end);
            done.commit(end, commit_time_micros);
            metrics.received_lsn.set(scheduler.received().gauge());
        }
        Item::Keepalive { wal_end } => {
            metrics.server_wal_lsn.set(wal_end.gauge());
            scheduler.keepalive(wal_end);
        }
    }
}

/// Sends the confirmed position when it moved, marks progress for
/// `/readyz`, and sets the gauges derived from the scheduler's state.
fn publish<P: Position, W>(
    scheduler: &Scheduler<P, W>,
    done: &mut DoneLog<P>,
    confirmed: &watch::Sender<Confirmed<P>>,
    metrics: &Metrics,
    health: &Health,
) {
    let position = scheduler.confirmed();
    let passed = done.passed(position);
    let advanced = confirmed.send_if_modified(|cur| {
        let changed = cur.position != position || passed.is_some();
        cur.position = position;
        if passed.is_some() {
            cur.last_done = passed;
        }
        changed
    });
    let pending = scheduler.pending();
    if advanced || pending == 0 {
        health.progress();
    }
    metrics.confirmed_lsn.set(position.gauge());
    metrics
        .pending_events
        .set(i64::try_from(pending).unwrap_or(i64::MAX));
}
