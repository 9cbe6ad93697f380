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
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::outbox::{OutboxEvent, TxContext};
use crate::sink::classify::status_class;
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
    /// The open transaction committed; `end_lsn` is its end LSN.
    Commit {
        /// End LSN of the transaction.
        end_lsn: Lsn,
    },
    /// A keepalive or XLogData reported the server's WAL end.
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
}

struct Job {
    seq: u64,
    tx: TxSeq,
    event: OutboxEvent,
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
    sink: HttpSink,
    metrics: Metrics,
    start: Lsn,
    mut items: mpsc::Receiver<Item>,
    confirmed: watch::Sender<Lsn>,
    health: Arc<Health>,
) -> Lsn {
    let mut d = Dispatcher {
        health,
        cfg,
        sink,
        metrics,
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
            return d.tracker.confirmed();
        }
        tokio::select! {
            item = items.recv(), if items_open => match item {
                Some(item) => d.handle(item),
                None => items_open = false,
            },
            Some(done) = d.running.join_next() => {
                d.finish(done.expect("delivery tasks do not panic"));
            }
            _ = tick.tick() => d.update_age(),
        }
    }
}

struct Dispatcher {
    health: Arc<Health>,
    cfg: DispatchConfig,
    sink: HttpSink,
    metrics: Metrics,
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
    running: JoinSet<Done>,
}

impl Dispatcher {
    fn handle(&mut self, item: Item) {
        match item {
            Item::Begin(_) => self.tx = Some(self.tracker.begin()),
            Item::Event(event, permit) => {
                let tx = self.tx.expect("source sends Begin before events");
                self.tracker.add_event(tx);
                self.metrics.events_received.inc();
                self.metrics.pending_events.inc();
                let seq = self.next_seq;
                self.next_seq += 1;
                self.received_at.insert(seq, Instant::now());
                let job = Job {
                    seq,
                    tx,
                    event,
                    _permit: permit,
                };
                match job.event.aggregate_key.clone() {
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
            Item::Commit { end_lsn } => {
                let tx = self.tx.take().expect("source sends Begin before Commit");
                self.tracker.commit(tx, end_lsn);
                self.metrics
                    .received_lsn
                    .set(lsn_gauge(self.tracker.received()));
            }
            Item::Keepalive { wal_end } => {
                self.metrics.server_wal_lsn.set(lsn_gauge(wal_end));
                if self.tx.is_none() {
                    self.tracker.keepalive(wal_end);
                }
            }
        }
    }

    fn start_ready(&mut self) {
        while self.running.len() < self.cfg.max_in_flight {
            let Some((_, job)) = self.ready.pop_first() else {
                break;
            };
            let sink = self.sink.clone();
            let cfg = self.cfg.clone();
            let metrics = self.metrics.clone();
            self.running.spawn(deliver(sink, cfg, metrics, job));
        }
    }

    fn finish(&mut self, done: Done) {
        self.tracker.complete(done.tx);
        self.received_at.remove(&done.seq);
        self.metrics.pending_events.dec();
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
            self.health.progress();
        }
        self.metrics.confirmed_lsn.set(lsn_gauge(lsn));
    }

    fn update_age(&self) {
        let age = self
            .received_at
            .values()
            .next()
            .map_or(0.0, |t| t.elapsed().as_secs_f64());
        self.metrics.oldest_unconfirmed_event_age.set(age);
    }
}

/// Delivers one event, retrying until it is done. Returns what the
/// dispatcher needs to release its key and count it done.
async fn deliver(sink: HttpSink, cfg: DispatchConfig, metrics: Metrics, job: Job) -> Done {
    let event = &job.event;
    let (body, signature) = sink.prepare(event);
    let mut backoff = Backoff::new(cfg.backoff_base, cfg.backoff_cap, cfg.retry_after_max);
    let mut attempts: u64 = 0;
    loop {
        attempts += 1;
        metrics.in_flight.inc();
        let started = Instant::now();
        let attempt = sink.post(&event.id, body.clone(), &signature).await;
        metrics.in_flight.dec();
        metrics
            .request_duration
            .observe(started.elapsed().as_secs_f64());
        let disposition = classify(&attempt, &cfg.policy);
        let outcome = match &disposition {
            Disposition::Delivered => "delivered",
            Disposition::Retry(_) => "retry",
            Disposition::DeadLetter(_) => "dead_letter",
            Disposition::ConfigFault(_) => "config_fault",
        };
        metrics
            .delivery_attempts
            .with_label_values(&[outcome, status_class(&attempt)])
            .inc();
        let reason = match disposition {
            Disposition::Delivered => {
                metrics.events_delivered.inc();
                metrics
                    .commit_to_delivery
                    .observe(seconds_since_commit(event.commit_time_micros));
                tracing::debug!(event_id = %event.id, commit_lsn = %event.commit_lsn, attempts, "delivered");
                return Done {
                    seq: job.seq,
                    tx: job.tx,
                    key: event.aggregate_key.clone(),
                };
            }
            // Until the dead-letter table exists, poison is retried like the
            // rest: an event is never skipped.
            Disposition::Retry(r) | Disposition::DeadLetter(r) | Disposition::ConfigFault(r) => r,
        };
        metrics.retries.with_label_values(&[&reason.label]).inc();
        let retry_after = match &attempt {
            Attempt::Response { retry_after, .. } => *retry_after,
            _ => None,
        };
        let delay = backoff.next_delay(retry_after, &mut rand::rng());
        if attempts == 1 || attempts.is_multiple_of(20) {
            tracing::warn!(
                event_id = %event.id, commit_lsn = %event.commit_lsn, attempts,
                reason = %reason.label, detail = %attempt_detail(&attempt),
                retry_in_ms = delay.as_millis() as u64, "delivery failed; will retry"
            );
        }
        tokio::time::sleep(delay).await;
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

fn seconds_since_commit(commit_time_micros: i64) -> f64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
    let unix = commit_time_micros.saturating_add(PG_EPOCH_UNIX_MICROS);
    (now.saturating_sub(unix).max(0) as f64) / 1e6
}

fn lsn_gauge(lsn: Lsn) -> i64 {
    i64::try_from(lsn.0).unwrap_or(i64::MAX)
}
