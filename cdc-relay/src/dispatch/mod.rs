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
//! - [`delivery`]: one event's life at one endpoint: attempts through the
//!   breaker, backoff, the dead-letter write.
//! - [`route`]: which endpoints (lanes) an event goes to.
//! - [`park`]: parking an endpoint that holds the slot back (its events
//!   dead-lettered with reason `parked`).
//! - [`resume`]: replaying a parked endpoint's rows and handing it back
//!   to live delivery.
//!
//! With a routes file each endpoint is a lane of the scheduler with its own
//! sink, breaker, backoff, `max_in_flight` and per-aggregate order; an
//! event is one job per endpoint it is routed to, and its transaction is
//! done when all of them are (`docs/architecture.md#acknowledgement`).
//!
//! The two I/O seams are traits: [`Sink`] (the HTTP client) and
//! [`DeadLetterStore`] (the side connection), so the whole pipeline runs in
//! unit tests against a scripted sink in paused time. [`run`] is the only
//! writer of the confirmed position, which travels back to the source as a
//! value through a `watch` channel.

pub mod delivery;
pub mod park;
pub mod progress;
pub mod resume;
pub mod route;
pub mod scheduler;
pub mod window;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::ack::Position;
use crate::breaker::{Breaker, BreakerConfig};
use crate::deadletter::DeadLetterStore;
use crate::durable::{Durability, FlushGate};
use crate::endpoint_metrics::{DEFAULT_ENDPOINT, EndpointMetrics};
use crate::health::Health;
use crate::metrics::Metrics;
use crate::outbox::{OutboxEvent, UnreadableRow};
use crate::sink::{Sink, StatusPolicy};
use delivery::{Delivery, DeliveryParts, Finished, Work};
use park::{Park, Parking};
use progress::DoneLog;
pub use progress::{Confirmed, DoneTx};
use resume::Resumes;
pub use route::{Router, Unrouted};
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
    /// Park the endpoint once its oldest pending event has waited this
    /// long; `None`: never parked for lag (routes file `max_lag`).
    pub max_lag: Option<Duration>,
    /// Requests per second at most, live and replayed together; `None`: no
    /// cap (routes file `rate`).
    pub rate: Option<f64>,
    /// Replay a parked endpoint's rows and return it to live delivery
    /// without an operator (`docs/architecture.md#parking`); `false`: it
    /// stays parked until its rows are replayed with the relay stopped
    /// (routes file `resume = "manual"`).
    pub auto_resume: bool,
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

/// One endpoint of a routed pipeline.
pub struct Endpoint<S> {
    /// Its name: the `endpoint` label of its metrics and the `endpoint`
    /// column of its dead letters.
    pub name: String,
    /// Its delivery settings.
    pub cfg: DispatchConfig,
    /// Where its events are POSTed.
    pub sink: S,
    /// Its circuit breaker, kept by the caller across sessions.
    pub breaker: Breaker,
    /// Its parking switch (thrown already when it starts parked: its parked
    /// dead letters are still waiting).
    pub park: Park,
}

/// What the endpoints of a routed pipeline share.
pub struct Shared<D> {
    /// Where dead letters are written (the side SQL connection).
    pub store: Arc<D>,
    /// Metrics.
    pub metrics: Metrics,
    /// Readiness.
    pub health: Arc<Health>,
    /// Cancelled when shutdown begins (see [`Services::stopping`]).
    pub stopping: CancellationToken,
    /// `--max-retained-wal` and the slot monitor's readings; `None`: no
    /// budget.
    pub wal_budget: Option<RetainedWal>,
    /// The window the source admits events through, watched for an
    /// endpoint holding more than its share of it
    /// (`docs/architecture.md#parking`); `None`: not watched.
    pub window: Option<Window>,
    /// Which of `store`'s asynchronous commits the server has flushed
    /// ([`crate::durable`]): the confirmed position passes a row only once
    /// it is. `None`: `store` commits synchronously.
    pub durability: Option<Durability>,
}

/// The WAL budget parking enforces (`docs/architecture.md#parking`).
#[derive(Clone, Debug)]
pub struct RetainedWal {
    /// `--max-retained-wal`, bytes.
    pub budget: u64,
    /// The slot's retained WAL (`pg_current_wal_lsn() - restart_lsn`) at the
    /// monitor's last reading, bytes; `None` before the first.
    pub retained: watch::Receiver<Option<u64>>,
}

/// Jobs of the lane after the endpoints' in a routed pipeline: dead-letter
/// writes of unrouted events and unreadable rows, at most this many at once.
const QUARANTINE_IN_FLIGHT: usize = 4;

/// A job: its work, and its room in the window, shared by the event's jobs
/// at every endpoint (released when the last is done).
type Job = (Work, Arc<WindowPermit>);

/// Runs the one-endpoint pipeline (`--sink-url`, backfill) until `items`
/// closes and everything admitted is done; see [`run_routed`].
pub async fn run<P: Position, S: Sink, D: DeadLetterStore>(
    cfg: DispatchConfig,
    services: Services<S, D>,
    start: P,
    items: mpsc::Receiver<Item<P>>,
    confirmed: watch::Sender<Confirmed<P>>,
) -> Result<P, DispatchError> {
    let endpoint = Endpoint {
        name: DEFAULT_ENDPOINT.to_owned(),
        cfg,
        sink: services.sink,
        breaker: services.breaker,
        park: Park::default(),
    };
    let shared = Shared {
        store: services.store,
        metrics: services.metrics,
        health: services.health,
        stopping: services.stopping,
        wal_budget: None,
        window: None,
        durability: None,
    };
    run_routed(
        vec![endpoint],
        Router::single(),
        shared,
        start,
        items,
        confirmed,
    )
    .await
}

/// Runs until `items` closes and everything admitted is done, then returns
/// the final confirmed position. Each event goes to the endpoints `router`
/// names (lane `i` is `endpoints[i]`). Once `shared.stopping` is cancelled
/// no new attempt starts: it returns when `items` is closed and the
/// attempts on the wire have finished, with what was not done left
/// unconfirmed. Dropping the future aborts deliveries in flight (they are
/// redelivered after a restart: at-least-once). The confirmed position
/// (and the last done transaction with events) is published on `confirmed`
/// whenever it moves.
///
/// # Panics
/// When `router` has another number of lanes than `endpoints`.
pub async fn run_routed<P: Position, S: Sink, D: DeadLetterStore>(
    endpoints: Vec<Endpoint<S>>,
    router: Router,
    shared: Shared<D>,
    start: P,
    mut items: mpsc::Receiver<Item<P>>,
    confirmed: watch::Sender<Confirmed<P>>,
) -> Result<P, DispatchError> {
    assert_eq!(router.lanes(), endpoints.len(), "one lane per endpoint");
    let metrics = shared.metrics.clone();
    let health = Arc::clone(&shared.health);
    let stopping = shared.stopping.clone();
    let single = router.is_single();
    let mut limits: Vec<usize> = endpoints.iter().map(|e| e.cfg.max_in_flight).collect();
    let mut lane_metrics: Vec<EndpointMetrics> = Vec::new();
    let mut deliveries: Vec<Arc<Delivery<S, D>>> = Vec::new();
    let mut parking = Parking {
        parks: Vec::new(),
        max_lags: Vec::new(),
        auto_resume: Vec::new(),
        wal_budget: shared.wal_budget.clone(),
        window: shared.window.clone(),
        waited: VecDeque::new(),
        running: Vec::new(),
    };
    for e in endpoints {
        e.breaker.new_session();
        let endpoint = metrics.endpoints.endpoint(&e.name);
        endpoint.parked.set(i64::from(e.park.is_parked()));
        parking.parks.push(e.park.clone());
        parking.max_lags.push(e.cfg.max_lag);
        parking.auto_resume.push(e.cfg.auto_resume);
        parking.running.push(HashMap::new());
        lane_metrics.push(endpoint.clone());
        deliveries.push(Arc::new(Delivery::new(DeliveryParts {
            cfg: e.cfg,
            sink: e.sink,
            store: Arc::clone(&shared.store),
            metrics: metrics.clone(),
            endpoint,
            dead_letter_endpoint: (!single).then_some(e.name),
            stopping: stopping.clone(),
            breaker: e.breaker,
            park: e.park,
        })));
    }
    // Routed: unrouted events and unreadable rows are dead-lettered on a
    // lane of their own, so a stuck endpoint never delays them. Those jobs
    // never touch the sink or the breaker of the delivery that runs them.
    let quarantine = if single {
        0
    } else {
        limits.push(QUARANTINE_IN_FLIGHT);
        deliveries.push(Arc::clone(&deliveries[0]));
        deliveries.len() - 1
    };
    let mut lanes = Lanes {
        router,
        quarantine,
        skipped_logged: HashSet::new(),
    };
    let mut scheduler: Scheduler<P, Job> = Scheduler::with_lanes(start, &limits);
    let mut gate = shared.durability.map(|d| FlushGate::new(d, start));
    let mut done = DoneLog::new();
    let mut running: JoinSet<Result<Option<Ticket>, DispatchError>> = JoinSet::new();
    let mut items_open = true;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut resumes = Resumes::new(parking.parks.len());
    // What the window's waits came to at the last tick (for the counter).
    let mut window_waited = Duration::ZERO;
    for lane in 0..parking.parks.len() {
        resumes.start(lane, &parking, &deliveries);
    }
    loop {
        while !stopping.is_cancelled()
            && let Some((ticket, (work, permit))) = scheduler.next_job()
        {
            let delivery = Arc::clone(&deliveries[ticket.lane]);
            parking.started(ticket.lane, ticket.seq, &permit);
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
        resumes.answer_quiet(&scheduler);
        publish(
            &scheduler,
            gate.as_mut(),
            &mut done,
            &confirmed,
            &metrics,
            &health,
        );
        if !items_open
            && (scheduler.is_idle()
                || (stopping.is_cancelled() && running.is_empty() && resumes.tasks.is_empty()))
        {
            return Ok(match gate.as_mut() {
                Some(g) => g.settle(scheduler.confirmed()).await,
                None => scheduler.confirmed(),
            });
        }
        tokio::select! {
            item = items.recv(), if items_open => match item {
                Some(item) => handle(&mut scheduler, &mut done, &mut lanes, item, &metrics),
                None => items_open = false,
            },
            Some(done) = running.join_next() => {
                if let Some(ticket) = done.expect("delivery tasks do not panic")? {
                    parking.completed(ticket.lane, ticket.seq);
                    scheduler.complete(ticket);
                }
            }
            Some(h) = resumes.handover.recv() => {
                resumes.handle(h, &mut scheduler, &parking, &lane_metrics);
            }
            Some(ended) = resumes.tasks.join_next() => {
                let (lane, r) = ended.expect("resume tasks do not panic");
                resumes.running[lane] = false;
                r?;
            }
            // More asynchronous commits flushed: publish sees what passed.
            () = flushed(gate.as_mut()) => {}
            // Stopping: wake up to stop spawning and to see whether the
            // attempts on the wire are all done.
            _ = stopping.cancelled(), if !stopping.is_cancelled() => {}
            _ = tick.tick() => {
                let age = scheduler
                    .oldest_pending_since()
                    .map_or(0.0, |t| t.elapsed().as_secs_f64());
                metrics.oldest_unconfirmed_event_age.set(age);
                for (lane, m) in lane_metrics.iter().enumerate() {
                    let age = scheduler
                        .lane_oldest_pending_since(lane)
                        .map_or(0.0, |t| t.elapsed().as_secs_f64());
                    m.oldest_pending_age.set(age);
                    m.pending.set(i64::try_from(scheduler.lane_pending(lane)).unwrap_or(i64::MAX));
                }
                if let Some(w) = &parking.window {
                    metrics.window_events.set(i64::try_from(w.held()).unwrap_or(i64::MAX));
                    let waited = w.waited();
                    metrics.window_wait_seconds.inc_by(waited.saturating_sub(window_waited).as_secs_f64());
                    window_waited = waited;
                }
                for lane in parking.check(&scheduler, &lane_metrics) {
                    resumes.start(lane, &parking, &deliveries);
                }
            }
        }
    }
}

/// How [`handle`] places events on lanes.
struct Lanes {
    router: Router,
    /// The lane of dead-letter-only jobs (unrouted events, unreadable rows).
    quarantine: usize,
    /// Event types skipped as unrouted and already logged (`unrouted =
    /// "skip"`), up to [`SKIP_LOGGED_TYPES`].
    skipped_logged: HashSet<String>,
}

/// Distinct skipped event types logged before the rest are only counted.
const SKIP_LOGGED_TYPES: usize = 1000;

fn handle<P: Position>(
    scheduler: &mut Scheduler<P, Job>,
    done: &mut DoneLog<P>,
    lanes: &mut Lanes,
    item: Item<P>,
    metrics: &Metrics,
) {
    match item {
        Item::Begin => scheduler.begin(),
        Item::Event(event, permit) => {
            metrics.events_received.inc();
            done.event(Some(&event.id));
            let key = event.aggregate_key.clone();
            let to = lanes.router.route(&event.event_type);
            let event = Arc::new(event);
            let permit = Arc::new(permit);
            let now = Instant::now();
            if to.is_empty() {
                match lanes.router.unrouted() {
                    Unrouted::DeadLetter => {
                        let work = (Work::Unrouted(event), permit);
                        scheduler.add_to(lanes.quarantine, None, work, now);
                    }
                    Unrouted::Skip => skip(lanes, &event, metrics),
                }
                return;
            }
            for lane in to.iter() {
                let work = (Work::Deliver(Arc::clone(&event)), Arc::clone(&permit));
                scheduler.add_to(*lane, key.clone(), work, now);
            }
        }
        Item::Unreadable(row, permit) => {
            metrics.events_received.inc();
            done.event(row.event_id.as_deref());
            let work = (Work::DeadLetter(row), Arc::new(permit));
            scheduler.add_to(lanes.quarantine, None, work, Instant::now());
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

/// An unrouted event under `unrouted = "skip"`: counted, logged once per
/// type, and done at once (its window permit is released here).
fn skip(lanes: &mut Lanes, event: &OutboxEvent, metrics: &Metrics) {
    metrics
        .endpoints
        .unrouted
        .with_label_values(&["skip"])
        .inc();
    if lanes.skipped_logged.len() < SKIP_LOGGED_TYPES
        && lanes.skipped_logged.insert(event.event_type.clone())
    {
        tracing::warn!(
            event_type = %event.event_type, event_id = %event.id,
            "no endpoint of the routes file takes this event type; skipping it (unrouted = \"skip\"): this is logged once per type, cdc_relay_unrouted_events_total{{action=\"skip\"}} counts every one"
        );
    }
}

/// Waits until `gate`'s poller reports more commits flushed; never, without
/// a gate.
async fn flushed<P: Position>(gate: Option<&mut FlushGate<P>>) {
    match gate {
        Some(g) => g.flushed().await,
        None => std::future::pending().await,
    }
}

/// Sends the confirmed position when it moved (the scheduler's, through
/// `gate` when dead letters commit asynchronously), marks progress for
/// `/readyz`, and sets the gauges derived from the scheduler's state.
fn publish<P: Position, W>(
    scheduler: &Scheduler<P, W>,
    gate: Option<&mut FlushGate<P>>,
    done: &mut DoneLog<P>,
    confirmed: &watch::Sender<Confirmed<P>>,
    metrics: &Metrics,
    health: &Health,
) {
    let position = scheduler.confirmed();
    let position = gate.map_or(position, |g| g.pass(position));
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
