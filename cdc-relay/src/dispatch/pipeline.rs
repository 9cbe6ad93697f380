//! What the pipeline takes and gives: the source's [`Item`]s, a lane's
//! [`DispatchConfig`], what its lanes share ([`Pipeline`]), how hard it
//! tries ([`Persist`]), and how a job or the whole run ended ([`Ended`],
//! [`Outcome`], [`DispatchError`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::route::Unrouted;
use super::window::{Window, WindowPermit};
use crate::breaker::BreakerConfig;
use crate::health::Health;
use crate::metrics::Metrics;
use crate::outbox::{OutboxEvent, UnreadableRow};
use crate::sink::StatusPolicy;

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

/// One lane's delivery settings.
#[derive(Clone, Debug)]
pub struct DispatchConfig {
    /// Maximum deliveries running at once (requests plus their backoff
    /// sleeps). 1 gives strict global commit order.
    pub max_in_flight: usize,
    /// Events one request may carry at most (`docs/architecture.md#batches`);
    /// 1: one request per event, the wire format every receiver takes.
    pub batch_max_events: usize,
    /// A batch's body size at most, bytes, as estimated from its events'
    /// sizes before encoding (a receiver's 413 splits it further).
    pub batch_max_bytes: usize,
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

impl DispatchConfig {
    /// One request at a time: strict commit order, batches included. Its
    /// batches take events in stream order only
    /// ([`super::scheduler::Scheduler::in_stream_order`]) and a split
    /// batch's halves go one after the other, the earlier first.
    pub fn in_commit_order(&self) -> bool {
        self.max_in_flight == 1
    }
}

/// How hard a pipeline tries each event.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Persist {
    /// Until it is done: failures are retried (backoff, breaker), poison
    /// is dead-lettered. The relay and backfill.
    #[default]
    UntilDone,
    /// Poison is dead-lettered, but the first failure stops the pipeline
    /// (the event stays pending): a bounded pass (a resume's final pass).
    UntilFailing,
    /// One attempt: poison is kept as it is (not done, and its aggregate's
    /// later events are not tried), the first failure stops the pipeline.
    /// `dead-letter replay`.
    OneAttempt,
}

/// What a pipeline's lanes share.
pub struct Pipeline<D> {
    /// Where dead letters are written (the side SQL connection).
    pub store: Arc<D>,
    /// Relay-wide series (attempts, and the pipeline's gauges).
    pub metrics: Metrics,
    /// Readiness: progress is marked whenever the confirmed position moves.
    pub health: Arc<Health>,
    /// Cancelled when shutdown begins: from then on no new attempt starts
    /// (`docs/architecture.md#shutdown`); attempts on the wire finish.
    pub stopping: CancellationToken,
    /// What happens to an event no lane takes.
    pub unrouted: Unrouted,
    /// `--max-retained-wal` and the slot monitor's readings; `None`: no
    /// budget.
    pub wal_budget: Option<RetainedWal>,
    /// The window the source admits events through, watched for an
    /// endpoint holding more than its share of it
    /// (`docs/architecture.md#parking`); `None`: not watched.
    pub window: Option<Window>,
    /// How hard each event is tried.
    pub persist: Persist,
    /// Whether the pipeline sets the relay-wide gauges (confirmed and
    /// received positions, pending events, the oldest one's age): not a
    /// replay's pipeline nested in a session.
    pub gauges: bool,
    /// Where each delivery job's end is reported (replays); `None`: not
    /// reported.
    pub report: Option<mpsc::UnboundedSender<Ended>>,
    /// Dead-letter rows an earlier session wrote for events the slot
    /// streams again ([`crate::dead_letter::restreamable`]), by (event id,
    /// endpoint: `""` for `--sink-url`): such an event delivered now has
    /// its row removed, so that it is not both delivered and waiting in
    /// the table (a replay would send it again). Usually empty.
    pub restreamed: HashMap<(String, String), i64>,
}

impl<D> Pipeline<D> {
    /// A pipeline over `store` that retries until done, parks nothing and
    /// reports nothing; unrouted events are dead-lettered.
    pub fn new(
        store: Arc<D>,
        metrics: Metrics,
        health: Arc<Health>,
        stopping: CancellationToken,
    ) -> Self {
        Pipeline {
            store,
            metrics,
            health,
            stopping,
            unrouted: Unrouted::DeadLetter,
            wal_budget: None,
            window: None,
            persist: Persist::UntilDone,
            gauges: true,
            report: None,
            restreamed: HashMap::new(),
        }
    }
}

/// How one delivery job ended ([`Pipeline::report`]).
#[derive(Clone, Debug)]
pub struct Ended {
    /// The event.
    pub event: Arc<OutboxEvent>,
    /// Its lane.
    pub lane: usize,
    /// What became of it there.
    pub outcome: Outcome,
}

/// What became of an event at one lane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A 2xx with this status.
    Delivered(u16),
    /// Its dead-letter row is committed (refused as poison, or parked).
    DeadLettered,
    /// [`Persist::OneAttempt`]: refused as poison and kept (the answer).
    Kept(String),
    /// Not delivered: the sink is failing (the answer), and the pipeline
    /// stopped.
    Failing(String),
    /// Never tried: an earlier event of its aggregate at this lane was
    /// not done and it must not overtake it.
    NotAttempted,
}

/// The pipeline stopped before its input ended.
#[derive(Clone, Debug, thiserror::Error)]
pub enum DispatchError {
    /// Dead letters cannot be written: the side connection is gone.
    #[error("cannot write the dead-letter table: {0}")]
    StoreLost(String),
    /// A replay could not read or remove its rows.
    #[error("reading or removing dead letters: {0}")]
    Rows(String),
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
