//! The delivery pipeline: a bounded window, per-aggregate ordering,
//! pipelined requests with retries, and the acknowledgement watermark.
//!
//! ```text
//!  source ──Item──▶ dispatcher ──spawn──▶ delivery (retry until done) ─┐
//!    ▲  (in stream      │  ready (by stream order), waiting (per key)   │
//!    │   order)         ◀──────────────── Done ─────────────────────────┘
//!    └── confirmed LSN (watch) ◀── AckTracker
//! ```
//!
//! A poison event is quarantined in the dead-letter table and then counts
//! as done; the circuit breaker pauses dispatch while the sink is down.
//!
//! The source admits an event only with a [`WindowPermit`] (bounded in events
//! and bytes), so when deliveries stall the source stops reading and WAL
//! waits on the server, not in relay memory. The dispatcher owns the
//! [`AckTracker`] and is the only writer of the confirmed LSN, which travels
//! back to the source as a value through a `watch` channel.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::JoinSet;

use crate::ack::{AckTracker, TxSeq};
use crate::admin::Health;
use crate::breaker::{Breaker, BreakerConfig, Signal};
use crate::deadletter::{self, NewDeadLetter};
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::outbox::{OutboxEvent, TxContext};
use crate::sink::classify::{Reason, status_class};
use crate::sink::{Attempt, Backoff, Disposition, HttpSink, StatusPolicy, classify};

/// Bounds what the relay holds in memory: events received and not yet done.
#[derive(Clone, Debug)]
pub struct Window {
    events: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
    max_bytes: u32,
}

/// Room for one event in the [`Window`]; released when dropped (when the
/// event is done or abandoned).
#[derive(Debug)]
pub struct WindowPermit {
    _events: OwnedSemaphorePermit,
    _bytes: OwnedSemaphorePermit,
}

impl Window {
    /// At most `max_events` events and `max_bytes` bytes (payload plus
    /// overhead). An event larger than `max_bytes` is admitted alone.
    pub fn new(max_events: usize, max_bytes: u32) -> Self {
        Window {
            events: Arc::new(Semaphore::new(max_events.max(1))),
            bytes: Arc::new(Semaphore::new(max_bytes.max(1) as usize)),
            max_bytes: max_bytes.max(1),
        }
    }

    /// Waits until an event of `size` bytes fits.
    pub async fn admit(&self, size: usize) -> WindowPermit {
        let cost = u32::try_from(size)
            .unwrap_or(u32::MAX)
            .clamp(1, self.max_bytes);
        let events = Arc::clone(&self.events)
            .acquire_owned()
            .await
            .expect("window semaphore is never closed");
        let bytes = Arc::clone(&self.bytes)
            .acquire_many_owned(cost)
            .await
            .expect("window semaphore is never closed");
        WindowPermit {
            _events: events,
            _bytes: bytes,
        }
    }
}

/// What the source hands the dispatcher, in stream order.
#[derive(Debug)]
pub enum Item {
    /// A transaction starts.
    Begin(TxContext),
    /// An outbox insert of the open transaction, admitted to the window.
    Event(OutboxEvent, WindowPermit),
    /// An outbox insert that cannot become an event (NULL id or type, bad
    /// text): it is quarantined as it is, never skipped.
    Unreadable(Box<NewDeadLetter>, WindowPermit),
    /// The open transaction committed; `end_lsn` is its end LSN.
    Commit {
        /// End LSN of the transaction.
        end_lsn: Lsn,
    },
    /// A keepalive reported the server's WAL end.
    Keepalive {
        /// Server WAL end.
        wal_end: Lsn,
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

/// What a session's pipeline shares: the sink, the dead-letter store (the
/// side SQL connection), metrics and health.
#[derive(Clone)]
pub struct Services {
    /// The HTTP sink.
    pub sink: HttpSink,
    /// The side connection that writes dead letters.
    pub store: Arc<tokio_postgres::Client>,
    /// Metrics.
    pub metrics: Metrics,
    /// Readiness.
    pub health: Arc<Health>,
}

/// The pipeline stopped before its input ended.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    /// Dead letters cannot be written: the side connection is gone.
    #[error("cannot write the dead-letter table: {0}")]
    StoreLost(String),
}

enum Work {
    Deliver(OutboxEvent),
    Quarantine(Box<NewDeadLetter>),
}

struct Job {
    seq: u64,
    tx: TxSeq,
    key: Option<String>,
    work: Work,
    _permit: WindowPermit,
}

struct Done {
    seq: u64,
    tx: TxSeq,
    key: Option<String>,
}

/// Runs until `items` closes and everything admitted is done, then returns
/// the final confirmed LSN. Dropping the future aborts deliveries in flight
/// (they are redelivered after a restart: at-least-once).
pub async fn run(
    cfg: DispatchConfig,
    services: Services,
    start: Lsn,
    mut items: mpsc::Receiver<Item>,
    confirmed: watch::Sender<Lsn>,
) -> Result<Lsn, DispatchError> {
    let breaker = Arc::new(Breaker::new(cfg.breaker.clone(), services.metrics.clone()));
    let mut d = Dispatcher {
        delivery: Arc::new(Ctx {
            cfg: cfg.clone(),
            services: services.clone(),
            breaker,
        }),
        cfg,
        services,
        tracker: AckTracker::new(start),
        tx: None,
        next_seq: 0,
        ready: BTreeMap::new(),
        waiting: HashMap::new(),
        claimed: HashSet::new(),
        received_at: BTreeMap::new(),
        running: JoinSet::new(),
    };
    let mut items_open = true;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        d.start_ready();
        d.publish(&confirmed);
        if !items_open && d.running.is_empty() && d.ready.is_empty() {
            return Ok(d.tracker.confirmed());
        }
        tokio::select! {
            item = items.recv(), if items_open => match item {
                Some(item) => d.handle(item),
                None => items_open = false,
            },
            Some(done) = d.running.join_next() => {
                d.finish(done.expect("delivery tasks do not panic")?);
            }
            _ = tick.tick() => d.update_age(),
        }
    }
}

struct Dispatcher {
    cfg: DispatchConfig,
    services: Services,
    /// What every delivery task shares (one allocation, not one per event).
    delivery: Arc<Ctx>,
    tracker: AckTracker,
    tx: Option<TxSeq>,
    next_seq: u64,
    /// Jobs free to start, by stream order.
    ready: BTreeMap<u64, Job>,
    /// Jobs whose aggregate key is claimed by an earlier job, per key, in order.
    waiting: HashMap<String, VecDeque<Job>>,
    /// Keys with a job ready or running.
    claimed: HashSet<String>,
    /// When each not-done job was received, by stream order.
    received_at: BTreeMap<u64, Instant>,
    running: JoinSet<Result<Done, DispatchError>>,
}

impl Dispatcher {
    fn handle(&mut self, item: Item) {
        match item {
            Item::Begin(_) => self.tx = Some(self.tracker.begin()),
            Item::Event(event, permit) => {
                let key = event.aggregate_key.clone();
                self.admit(key, Work::Deliver(event), permit);
            }
            Item::Unreadable(row, permit) => self.admit(None, Work::Quarantine(row), permit),
            Item::Commit { end_lsn } => {
                let tx = self.tx.take().expect("source sends Begin before Commit");
                self.tracker.commit(tx, end_lsn);
                let received = lsn_gauge(self.tracker.received());
                self.services.metrics.received_lsn.set(received);
            }
            Item::Keepalive { wal_end } => {
                self.services.metrics.server_wal_lsn.set(lsn_gauge(wal_end));
                if self.tx.is_none() {
                    self.tracker.keepalive(wal_end);
                }
            }
        }
    }

    fn admit(&mut self, key: Option<String>, work: Work, permit: WindowPermit) {
        let tx = self.tx.expect("source sends Begin before events");
        self.tracker.add_event(tx);
        self.services.metrics.events_received.inc();
        self.services.metrics.pending_events.inc();
        let seq = self.next_seq;
        self.next_seq += 1;
        self.received_at.insert(seq, Instant::now());
        let job = Job {
            seq,
            tx,
            key: key.clone(),
            work,
            _permit: permit,
        };
        match key {
            Some(key) if self.claimed.contains(&key) => {
                self.waiting.entry(key).or_default().push_back(job)
            }
            Some(key) => {
                self.claimed.insert(key);
                self.ready.insert(seq, job);
            }
            None => {
                self.ready.insert(seq, job);
            }
        }
    }

    fn start_ready(&mut self) {
        while self.running.len() < self.cfg.max_in_flight {
            let Some((_, job)) = self.ready.pop_first() else {
                break;
            };
            self.running.spawn(Arc::clone(&self.delivery).run(job));
        }
    }

    fn finish(&mut self, done: Done) {
        self.tracker.complete(done.tx);
        self.received_at.remove(&done.seq);
        self.services.metrics.pending_events.dec();
        if let Some(key) = done.key {
            match self.waiting.get_mut(&key).and_then(VecDeque::pop_front) {
                Some(next) => {
                    if self.waiting.get(&key).is_some_and(VecDeque::is_empty) {
                        self.waiting.remove(&key);
                    }
                    self.ready.insert(next.seq, next);
                }
                None => {
                    self.claimed.remove(&key);
                }
            }
        }
    }

    fn publish(&self, confirmed: &watch::Sender<Lsn>) {
        let lsn = self.tracker.confirmed();
        let advanced = confirmed.send_if_modified(|cur| {
            let changed = *cur != lsn;
            *cur = lsn;
            changed
        });
        if advanced || self.tracker.outstanding_events() == 0 {
            self.services.health.progress();
        }
        self.services.metrics.confirmed_lsn.set(lsn_gauge(lsn));
    }

    fn update_age(&self) {
        let age = self
            .received_at
            .values()
            .next()
            .map_or(0.0, |t| t.elapsed().as_secs_f64());
        self.services.metrics.oldest_unconfirmed_event_age.set(age);
    }
}

/// What one delivery task needs.
struct Ctx {
    cfg: DispatchConfig,
    services: Services,
    breaker: Arc<Breaker>,
}

impl Ctx {
    async fn run(self: Arc<Self>, job: Job) -> Result<Done, DispatchError> {
        match &job.work {
            Work::Deliver(event) => self.deliver(job.seq, event).await?,
            Work::Quarantine(row) => self.quarantine(row).await?,
        }
        Ok(Done {
            seq: job.seq,
            tx: job.tx,
            key: job.key,
        })
    }

    /// Delivers one event until it is done: a 2xx, or quarantined.
    async fn deliver(&self, seq: u64, event: &OutboxEvent) -> Result<(), DispatchError> {
        let metrics = &self.services.metrics;
        let (body, signature) = self.services.sink.prepare(event);
        let mut backoff = Backoff::new(
            self.cfg.backoff_base,
            self.cfg.backoff_cap,
            self.cfg.retry_after_max,
        );
        let first_attempt = unix_micros();
        let mut attempts: u32 = 0;
        loop {
            let admission = self.breaker.admit(seq).await;
            attempts += 1;
            metrics.in_flight.inc();
            let started = Instant::now();
            let attempt = self
                .services
                .sink
                .post(&event.id, body.clone(), &signature)
                .await;
            metrics.in_flight.dec();
            metrics
                .request_duration
                .observe(started.elapsed().as_secs_f64());
            let disposition = classify(&attempt, &self.cfg.policy);
            let (outcome, signal, reason) = match disposition {
                Disposition::Delivered => {
                    self.breaker.record(admission, Signal::Success, "");
                    count_attempt(metrics, "delivered", &attempt);
                    metrics.events_delivered.inc();
                    metrics
                        .commit_to_delivery
                        .observe(seconds_since_commit(event.commit_time_micros));
                    tracing::debug!(event_id = ?event.id, commit_lsn = %event.commit_lsn, attempts, "delivered");
                    return Ok(());
                }
                Disposition::DeadLetter(r) if self.breaker.poison(&event.id) => {
                    self.breaker
                        .record(admission, Signal::Quarantined, &r.label);
                    count_attempt(metrics, "dead_letter", &attempt);
                    let row = dead_letter(event, &attempt, &r, attempts, first_attempt);
                    tracing::warn!(
                        event_id = ?event.id, commit_lsn = %event.commit_lsn, reason = %r.label,
                        detail = %attempt_detail(&attempt), "poison event: quarantining in the dead-letter table"
                    );
                    return self.quarantine(&row).await;
                }
                // During a poison storm, poison waits like a transient failure.
                Disposition::DeadLetter(r) | Disposition::Retry(r) => {
                    ("retry", Signal::Transient, r)
                }
                Disposition::ConfigFault(r) => ("config_fault", Signal::ConfigFault, r),
            };
            self.breaker.record(admission, signal, &reason.label);
            count_attempt(metrics, outcome, &attempt);
            metrics.retries.with_label_values(&[&reason.label]).inc();
            let retry_after = match &attempt {
                Attempt::Response { retry_after, .. } => *retry_after,
                _ => None,
            };
            let delay = backoff.next_delay(retry_after, &mut rand::rng());
            if attempts == 1 || attempts.is_multiple_of(20) {
                tracing::warn!(
                    event_id = ?event.id, commit_lsn = %event.commit_lsn, attempts,
                    reason = %reason.label, detail = %attempt_detail(&attempt),
                    retry_in_ms = delay.as_millis() as u64, "delivery failed; will retry"
                );
            }
            tokio::time::sleep(delay).await;
        }
    }

    /// Writes a dead-letter row, retrying until it is committed. The event
    /// stays pending meanwhile; a lost side connection ends the session.
    async fn quarantine(&self, row: &NewDeadLetter) -> Result<(), DispatchError> {
        let mut backoff = Backoff::new(self.cfg.backoff_base, self.cfg.backoff_cap, Duration::ZERO);
        loop {
            match deadletter::insert(&self.services.store, row).await {
                Ok(id) => {
                    self.services.metrics.events_dead_lettered.inc();
                    tracing::warn!(dead_letter_id = id, event_id = ?row.event_id, error = %row.error, "quarantined");
                    return Ok(());
                }
                Err(e) if self.services.store.is_closed() => {
                    return Err(DispatchError::StoreLost(e.to_string()));
                }
                Err(e) => {
                    tracing::error!(error = %e, event_id = ?row.event_id, "cannot write the dead-letter row; the event stays pending");
                    let delay = backoff.next_delay(None, &mut rand::rng());
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }
}

fn count_attempt(metrics: &Metrics, outcome: &str, attempt: &Attempt) {
    metrics
        .delivery_attempts
        .with_label_values(&[outcome, status_class(attempt)])
        .inc();
}

fn dead_letter(
    event: &OutboxEvent,
    attempt: &Attempt,
    reason: &Reason,
    attempts: u32,
    first: i64,
) -> NewDeadLetter {
    let (status, excerpt) = match attempt {
        Attempt::Response {
            status, excerpt, ..
        } => (Some(*status), Some(excerpt.clone())),
        _ => (None, None),
    };
    NewDeadLetter {
        event_id: Some(event.id.clone()),
        aggregate_key: event.aggregate_key.clone(),
        event_type: Some(event.event_type.clone()),
        payload: event
            .payload
            .as_ref()
            .map(|p| String::from_utf8_lossy(p).into_owned()),
        commit_lsn: event.commit_lsn,
        http_status: status,
        error: format!("{}: {}", reason.label, attempt_detail(attempt)),
        response_excerpt: excerpt,
        attempts,
        first_attempt_unix_micros: Some(first),
    }
}

fn attempt_detail(a: &Attempt) -> String {
    match a {
        Attempt::Response {
            status, excerpt, ..
        } => {
            let mut e: String = excerpt.chars().take(120).collect();
            e.retain(|c| !c.is_control());
            format!("status {status}: {e}")
        }
        Attempt::Timeout => "request timed out".into(),
        Attempt::Connect(e) | Attempt::Transport(e) => e.clone(),
    }
}

/// PostgreSQL timestamps count microseconds from 2000-01-01 00:00:00 UTC.
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

fn unix_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

fn seconds_since_commit(commit_time_micros: i64) -> f64 {
    let unix = commit_time_micros.saturating_add(PG_EPOCH_UNIX_MICROS);
    (unix_micros().saturating_sub(unix).max(0) as f64) / 1e6
}

fn lsn_gauge(lsn: Lsn) -> i64 {
    i64::try_from(lsn.0).unwrap_or(i64::MAX)
}
