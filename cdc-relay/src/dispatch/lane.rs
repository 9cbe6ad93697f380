//! One endpoint of the pipeline: a *lane* of the scheduler.
//!
//! A [`Lane`] is everything about one endpoint that outlives a session:
//! its name, the event types it takes, its delivery settings, its sink,
//! circuit breaker, rate cap, parking switch and metrics. `--sink-url` is
//! one lane that takes every event; a routes file is one lane per
//! `[[endpoint]]`, in file order. What the lane's jobs are doing right now
//! (queued, running, handed to the dead-letter writer) is the scheduler's
//! to know ([`super::scheduler`]), not the lane's.
//!
//! A lane is cheap to clone: its breaker, pacer and switch are shared, so a
//! clone is the same endpoint (a session's pipeline and the replay of its
//! parked rows use one breaker and one rate cap).

use std::sync::Arc;

use opentelemetry_sdk::trace::SdkTracer;
use tokio::sync::watch;

use super::DispatchConfig;
use super::route::Pattern;
use crate::backoff::Backoff;
use crate::breaker::Breaker;
use crate::endpoint_metrics::{DEFAULT_ENDPOINT, EndpointMetrics};
use crate::metrics::Metrics;
use crate::pace::Pacer;

/// One endpoint (see the module doc).
#[derive(Clone, Debug)]
pub struct Lane<S> {
    /// Its name: `default` for `--sink-url`, else the routes file's; the
    /// `endpoint` label of its metrics.
    pub name: String,
    /// The event types it takes; `None`: every event (`--sink-url`).
    pub takes: Option<Vec<Pattern>>,
    /// Its delivery settings.
    pub cfg: DispatchConfig,
    /// Where its events are POSTed.
    pub sink: S,
    /// Its circuit breaker and storm guard, kept across sessions: a
    /// reconnect does not reset an open circuit or a storm.
    pub breaker: Breaker,
    /// Its rate cap (`rate`), shared by live deliveries and the replay of
    /// its parked rows.
    pub pace: Option<Arc<Pacer>>,
    /// Its parking switch (`docs/architecture.md#parking`).
    pub park: Park,
    /// Its labelled series.
    pub metrics: EndpointMetrics,
    /// Where its attempts' spans are made (`--otlp-endpoint`); `None`:
    /// none are (a stored trace context is forwarded as it is).
    pub tracer: Option<SdkTracer>,
}

impl<S> Lane<S> {
    /// The one lane of `--sink-url` (named `default`, takes every event),
    /// its series and breaker in `metrics`.
    pub fn single(cfg: DispatchConfig, sink: S, metrics: &Metrics) -> Self {
        Self::new(DEFAULT_ENDPOINT.to_owned(), None, cfg, sink, metrics)
    }

    /// A routes file's endpoint `name`, taking the event types matching
    /// `takes`, its series and breaker in `metrics`.
    ///
    /// # Panics
    /// With a `rate`, outside a Tokio runtime (the pacer makes a timer).
    pub fn routed(
        name: String,
        takes: Vec<Pattern>,
        cfg: DispatchConfig,
        sink: S,
        metrics: &Metrics,
    ) -> Self {
        Self::new(name, Some(takes), cfg, sink, metrics)
    }

    fn new(
        name: String,
        takes: Option<Vec<Pattern>>,
        cfg: DispatchConfig,
        sink: S,
        metrics: &Metrics,
    ) -> Self {
        let breaker = match takes {
            None => Breaker::new(cfg.breaker.clone(), metrics.clone()),
            Some(_) => Breaker::for_endpoint(cfg.breaker.clone(), metrics.clone(), &name),
        };
        Lane {
            metrics: metrics.endpoints.endpoint(&name),
            pace: cfg.rate.map(|r| Arc::new(Pacer::new(r))),
            park: Park::default(),
            breaker,
            name,
            takes,
            cfg,
            sink,
            tracer: None,
        }
    }

    /// The same endpoint, its attempts spans of `tracer`.
    pub fn traced(mut self, tracer: Option<SdkTracer>) -> Self {
        self.tracer = tracer;
        self
    }

    /// The same endpoint with its series and a fresh breaker in another
    /// registry (each relay of a sharded process has its own), and the
    /// sink `sink` (the same sink, counting there too).
    pub fn in_registry<T>(self, metrics: &Metrics, sink: T) -> Lane<T> {
        Lane::new(self.name, self.takes, self.cfg, sink, metrics).traced(self.tracer)
    }

    /// The `endpoint` column of this endpoint's dead letters: its name for
    /// a routes file's endpoint, `None` (NULL) for `--sink-url`'s.
    pub fn dead_letter_endpoint(&self) -> Option<&str> {
        self.takes.as_ref().map(|_| self.name.as_str())
    }

    /// A fresh retry backoff for one job, from the lane's settings.
    pub fn backoff(&self) -> Backoff {
        Backoff::new(
            self.cfg.backoff_base,
            self.cfg.backoff_cap,
            self.cfg.retry_after_max,
        )
    }
}

/// One endpoint's parking switch, shared by the dispatcher (which throws
/// it and turns it back) and the endpoint's deliveries (which watch it).
/// Cheap to clone.
#[derive(Clone, Debug)]
pub struct Park {
    /// Why the endpoint is parked; `None` while it is live.
    state: Arc<watch::Sender<Option<String>>>,
}

impl Default for Park {
    fn default() -> Self {
        Park {
            state: Arc::new(watch::Sender::new(None)),
        }
    }
}

impl Park {
    /// Parks the endpoint for reason `why` (kept in its dead letters);
    /// returns false when it already was.
    pub fn throw(&self, why: String) -> bool {
        self.state.send_if_modified(|s| {
            if s.is_some() {
                return false;
            }
            *s = Some(why);
            true
        })
    }

    /// Turns the endpoint back to live; returns false when it was not
    /// parked. Only the dispatcher calls it, at a moment the endpoint has
    /// no job running and no parked row left ([`crate::dispatch::resume`]).
    pub fn resume(&self) -> bool {
        self.state.send_if_modified(|s| s.take().is_some())
    }

    /// Whether the endpoint is parked.
    pub fn is_parked(&self) -> bool {
        self.state.borrow().is_some()
    }

    /// Completes once the endpoint is parked (at once if it is).
    pub async fn parked(&self) {
        let mut rx = self.state.subscribe();
        // The sender lives in `self`: the wait cannot fail.
        let _ = rx.wait_for(Option::is_some).await;
    }

    /// Why it is parked (empty while live).
    pub fn why(&self) -> String {
        self.state.borrow().clone().unwrap_or_default()
    }
}
