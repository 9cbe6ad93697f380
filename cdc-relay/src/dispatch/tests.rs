//! The whole dispatcher — scheduler, delivery workers, breaker, dead letters —
//! against a scripted in-memory sink and store, in paused time: every
//! schedule below is exact and the tests never sleep on the wall clock.
//!
//! Broken on purpose once, to show these tests can fail:
//! - key claims ignored (then in `Scheduler::add`, now in
//!   `Scheduler::add_event`'s `l.claimed.contains(k)`): `two_events_of_one_aggregate_are_never_in_flight_together`
//!   failed ("e4 and e8 of key k0 overlap"), as did the poison test and both
//!   scheduler tests.
//! - `Scheduler::next_job` without its `running >= max_in_flight` check:
//!   `max_in_flight_is_never_exceeded` failed ("39 in flight, max 4"), as
//!   did both scheduler tests.
//!
//! The breaker test found a real defect when it was written: with the
//! circuit open and a probe in flight, every other waiting delivery spun
//! on an already-past `next_probe_at` until the probe returned (a busy
//! loop for up to a request timeout on a real sink).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::*;
use crate::breaker::{Breaker, BreakerConfig};
use crate::dead_letter::{NewDeadLetter, StoreError};
use crate::health::Health;
use crate::sink::StatusPolicy;

mod batches;
mod breaker;
mod dead_letters;
mod routed;
use crate::lsn::Lsn;
use crate::sink::{Attempt, Prepared};

/// One attempt as the sink saw it.
#[derive(Clone, Debug)]
struct Call {
    id: String,
    /// A batch's event ids, in body order (empty for one event).
    members: Vec<String>,
    start: Instant,
    end: Instant,
    status: u16,
}

type Script = dyn Fn(&str, Instant) -> (Duration, u16) + Send + Sync;

/// A sink that answers each attempt as `script(event_id, now)` says: after
/// the given latency, with the given status. Records every call.
struct ScriptedSink {
    script: Box<Script>,
    calls: Mutex<Vec<Call>>,
    /// Answer each request per event: 207 with each member's (or the one
    /// event's) scripted status, leaving out those scripted [`UNNAMED`].
    per_event: std::sync::atomic::AtomicBool,
    /// The `Retry-After` of every per-event answer (207).
    retry_after: Mutex<Option<Duration>>,
}

impl ScriptedSink {
    fn new(script: impl Fn(&str, Instant) -> (Duration, u16) + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(ScriptedSink {
            script: Box::new(script),
            calls: Mutex::new(Vec::new()),
            per_event: Default::default(),
            retry_after: Mutex::new(None),
        })
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }
}

impl Sink for Arc<ScriptedSink> {
    fn prepare(&self, event: &OutboxEvent) -> Prepared {
        Prepared::unsigned(crate::sink::encoder::body(event))
    }

    fn prepare_batch(&self, events: &[&OutboxEvent]) -> (String, Prepared) {
        let id = crate::sink::encoder::batch_id(events.iter().map(|e| e.id.as_str()));
        let body = crate::sink::encoder::batch_body(events.iter().copied());
        (id, Prepared::unsigned(body).batch_of(events.len()))
    }

    /// A batch is answered as its members would be: after the longest
    /// latency, with the first member's status that is not a 2xx (else the
    /// first member's).
    async fn post(
        &self,
        event_id: &str,
        request: &Prepared,
        _trace: Option<&crate::sink::TraceHeaders>,
    ) -> Attempt {
        let start = Instant::now();
        let members: Vec<String> = match request.batch {
            None => Vec::new(),
            Some(_) => serde_json::from_slice::<Vec<serde_json::Value>>(&request.body)
                .expect("a batch body is a JSON array")
                .iter()
                .map(|e| e["id"].as_str().expect("an id").to_owned())
                .collect(),
        };
        let per_event = self.per_event.load(Ordering::Relaxed);
        let mut results = Vec::new();
        let (latency, status) = if members.is_empty() && !per_event {
            (self.script)(event_id, start)
        } else if per_event {
            let mut latency = Duration::ZERO;
            // A member scripted with no response (or a garbled one)
            // makes the whole request so.
            let mut whole: Option<u16> = None;
            let one = [event_id.to_owned()];
            for id in if members.is_empty() {
                &one[..]
            } else {
                &members
            } {
                let (l, status) = (self.script)(id, start);
                latency = latency.max(l);
                if status < UNNAMED || status == GARBLED {
                    whole.get_or_insert(status);
                    continue;
                }
                if status != UNNAMED {
                    results
                        .push(serde_json::json!({"id": id, "status": status, "error": "scripted"}));
                }
            }
            (latency, whole.unwrap_or(207))
        } else {
            let answers: Vec<(Duration, u16)> =
                members.iter().map(|id| (self.script)(id, start)).collect();
            let latency = answers.iter().map(|a| a.0).max().unwrap_or_default();
            let status = answers
                .iter()
                .map(|a| a.1)
                .find(|s| !(200..300).contains(s))
                .unwrap_or(answers[0].1);
            (latency, status)
        };
        tokio::time::sleep(latency).await;
        self.calls.lock().unwrap().push(Call {
            id: event_id.to_owned(),
            members,
            start,
            end: Instant::now(),
            status,
        });
        match status {
            GARBLED => Attempt::Response {
                status: 207,
                retry_after: None,
                excerpt: format!(r#"{{"results":[{{"id":"{event_id}","status":"503"}}]}}"#),
            },
            TIMEOUT => Attempt::Timeout,
            CONNECT => Attempt::Connect("connection refused".into()),
            TLS => Attempt::Tls("invalid peer certificate".into()),
            TRANSPORT => Attempt::Transport("connection reset by peer".into()),
            status => Attempt::Response {
                status,
                retry_after: if per_event {
                    *self.retry_after.lock().unwrap()
                } else {
                    None
                },
                excerpt: if per_event {
                    serde_json::json!({ "results": results }).to_string()
                } else {
                    String::new()
                },
            },
        }
    }
}

/// Scripted "statuses" that stand for the failures without a response.
const TIMEOUT: u16 = 0;
const CONNECT: u16 = 1;
const TLS: u16 = 2;
const TRANSPORT: u16 = 3;
/// In a per-event answer: the event is not named.
const UNNAMED: u16 = 4;
/// The whole answer is a 207 whose body is not per-event answers (a
/// status given as a string).
const GARBLED: u16 = 5;

/// Dead letters, in memory: every row written (`.0`, by id − 1, refused
/// rows rewritten in place), the ids replayed (removed), when each row
/// commits (`.2`, by id − 1: it is invisible until then), and a switch
/// that holds every write uncommitted while it is on (`.3`: a writer that
/// cannot write).
#[derive(Default)]
struct MemoryStore(
    Mutex<Vec<NewDeadLetter>>,
    Mutex<Vec<i64>>,
    Mutex<Vec<Instant>>,
    watch::Sender<bool>,
);

/// A write takes a moment, as on a database: what runs meanwhile is what
/// the tests must get right.
const WRITE_TAKES: Duration = Duration::from_millis(15);

impl MemoryStore {
    /// Ids of the committed parked rows of `endpoint` still in the table.
    fn parked_ids(&self, endpoint: &str) -> Vec<i64> {
        let removed: std::collections::HashSet<i64> =
            self.1.lock().unwrap().iter().copied().collect();
        let committed = self.2.lock().unwrap().clone();
        let now = Instant::now();
        self.0
            .lock()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, r)| (i as i64 + 1, r))
            .filter(|(id, r)| {
                r.endpoint.as_deref() == Some(endpoint)
                    && r.error.starts_with("parked:")
                    && !removed.contains(id)
                    && committed[*id as usize - 1] <= now
            })
            .map(|(id, _)| id)
            .collect()
    }
}

impl DeadLetterStore for MemoryStore {
    fn write(
        &self,
        row: &NewDeadLetter,
        _urgency: crate::dead_letter::Urgency,
    ) -> impl std::future::Future<Output = Result<crate::dead_letter::Written, StoreError>>
    + Send
    + 'static {
        // Queued (and numbered) now, committed a moment later.
        let at = Instant::now() + WRITE_TAKES;
        let mut rows = self.0.lock().unwrap();
        rows.push(row.clone());
        self.2.lock().unwrap().push(at);
        let id = rows.len() as i64;
        let mut held = self.3.subscribe();
        async move {
            tokio::time::sleep_until(at).await;
            let _ = held.wait_for(|h| !h).await;
            Ok(crate::dead_letter::Written { id, new: true })
        }
    }

    async fn parked(
        &self,
        endpoint: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<crate::dead_letter::ParkedRow>, StoreError> {
        tokio::time::sleep(Duration::from_millis(1)).await;
        let ids = self.parked_ids(endpoint);
        let rows = self.0.lock().unwrap();
        Ok(ids
            .into_iter()
            .filter(|id| *id > after)
            .take(limit as usize)
            .map(|id| {
                let r = &rows[id as usize - 1];
                crate::dead_letter::ParkedRow {
                    id,
                    event: OutboxEvent {
                        id: r.event_id.clone().unwrap_or_default(),
                        event_type: r.event_type.clone().unwrap_or_default(),
                        payload: r.payload.clone(),
                        aggregate_key: r.aggregate_key.clone(),
                        commit_lsn: r.commit_lsn,
                        commit_time_micros: 0,
                        dead_letter_id: Some(id),
                        trace: None,
                    },
                }
            })
            .collect())
    }

    async fn replayed(&self, ids: &[i64], _why: &'static str) -> Result<(), StoreError> {
        self.1.lock().unwrap().extend_from_slice(ids);
        Ok(())
    }

    async fn refused(&self, id: i64, row: &NewDeadLetter) -> Result<(), StoreError> {
        self.0.lock().unwrap()[id as usize - 1] = row.clone();
        Ok(())
    }

    async fn resume_lock(&self, _endpoint: &str, _take: bool) -> Result<bool, StoreError> {
        Ok(true)
    }
}

fn config(max_in_flight: usize) -> DispatchConfig {
    DispatchConfig {
        max_in_flight,
        batch_max_events: 1,
        batch_max_bytes: usize::MAX,
        backoff_base: Duration::from_millis(1),
        backoff_cap: Duration::from_millis(1),
        retry_after_max: Duration::from_secs(1),
        policy: StatusPolicy::default(),
        breaker: BreakerConfig {
            failure_threshold: 3,
            probe_interval: Duration::from_millis(500),
            storm_threshold: 10,
            retired_probe_interval: Duration::from_secs(60),
        },
        max_lag: None,
        rate: None,
        auto_resume: true,
    }
}

fn event(id: &str, key: Option<&str>) -> OutboxEvent {
    OutboxEvent {
        id: id.to_owned(),
        event_type: "OrderCreated".into(),
        payload: Some(Bytes::from_static(b"{}")),
        aggregate_key: key.map(str::to_owned),
        commit_lsn: None,
        commit_time_micros: 0,
        dead_letter_id: None,
        trace: None,
    }
}

/// A pipeline over `store` with its own health, retrying until done.
fn pipeline(
    store: &Arc<MemoryStore>,
    metrics: Metrics,
    stopping: CancellationToken,
) -> Pipeline<MemoryStore> {
    Pipeline::new(
        Arc::clone(store),
        metrics,
        Health::new(Duration::from_secs(60)),
        stopping,
    )
}

/// Feeds `txs` (each a list of events, ending at LSN 100·(i+1)) through a
/// dispatcher and waits until it has done everything. Returns the final
/// confirmed LSN and the dead letters.
async fn dispatch_all(
    cfg: DispatchConfig,
    sink: Arc<ScriptedSink>,
    txs: Vec<Vec<OutboxEvent>>,
) -> (Lsn, Vec<NewDeadLetter>) {
    dispatch_all_counted(cfg, sink, txs, Metrics::new()).await
}

/// [`dispatch_all`], counting into `metrics`.
async fn dispatch_all_counted(
    cfg: DispatchConfig,
    sink: Arc<ScriptedSink>,
    txs: Vec<Vec<OutboxEvent>>,
    metrics: Metrics,
) -> (Lsn, Vec<NewDeadLetter>) {
    let store = Arc::new(MemoryStore::default());
    let lane = Lane::single(cfg, sink, &metrics);
    let pipeline = pipeline(&store, metrics, CancellationToken::new());
    let (items, items_rx) = mpsc::channel(16);
    let (confirmed, _) = watch::channel(Confirmed::default());
    let dispatcher = tokio::spawn(run(vec![lane], pipeline, Lsn::ZERO, items_rx, confirmed));
    let window = Window::new(10_000, 1 << 20);
    for (i, tx) in txs.into_iter().enumerate() {
        send_tx(&items, &window, tx, Lsn::new(100 * (i as u64 + 1))).await;
    }
    drop(items);
    let last = dispatcher.await.unwrap().unwrap();
    let rows = store.0.lock().unwrap().clone();
    (last, rows)
}

/// Sends one transaction to the dispatcher: Begin, each of `events`
/// admitted to `window`, and its Commit at `end`.
async fn send_tx(
    items: &mpsc::Sender<Item<Lsn>>,
    window: &Window,
    events: Vec<OutboxEvent>,
    end: Lsn,
) {
    items.send(Item::Begin).await.unwrap();
    for e in events {
        let permit = window.admit(e.size_bytes()).await;
        items.send(Item::Event(e, permit)).await.unwrap();
    }
    items
        .send(Item::Commit {
            end,
            commit_time_micros: 0,
        })
        .await
        .unwrap();
}

/// The most calls in flight at any instant.
fn max_concurrency(calls: &[Call]) -> usize {
    calls
        .iter()
        .map(|c| {
            calls
                .iter()
                .filter(|o| o.start <= c.start && c.start < o.end)
                .count()
        })
        .max()
        .unwrap_or(0)
}

#[tokio::test(start_paused = true)]
async fn two_events_of_one_aggregate_are_never_in_flight_together() {
    // 16 events over 4 aggregates, each attempt 10 ms; a wide window.
    let sink = ScriptedSink::new(|_, _| (Duration::from_millis(10), 204));
    let txs: Vec<Vec<OutboxEvent>> = (0..8)
        .map(|t| {
            (0..2)
                .map(|j| {
                    let n = t * 2 + j;
                    event(&format!("e{n}"), Some(&format!("k{}", n % 4)))
                })
                .collect()
        })
        .collect();
    let (last, dead) = dispatch_all(config(64), Arc::clone(&sink), txs).await;
    assert_eq!(last, Lsn::new(800));
    assert!(dead.is_empty());
    let calls = sink.calls();
    assert_eq!(calls.len(), 16);
    let mut by_key: HashMap<usize, Vec<&Call>> = HashMap::new();
    for c in &calls {
        let n: usize = c.id[1..].parse().unwrap();
        by_key.entry(n % 4).or_default().push(c);
    }
    for (key, mut calls) in by_key {
        calls.sort_by_key(|c| c.start);
        for pair in calls.windows(2) {
            assert!(
                pair[0].end <= pair[1].start,
                "{} and {} of key k{key} overlap",
                pair[0].id,
                pair[1].id
            );
            let (a, b): (usize, usize) = (
                pair[0].id[1..].parse().unwrap(),
                pair[1].id[1..].parse().unwrap(),
            );
            assert!(
                a < b,
                "key k{key}: {} sent before {}",
                pair[1].id,
                pair[0].id
            );
        }
    }
    assert_eq!(
        max_concurrency(&calls),
        4,
        "the four aggregates run side by side"
    );
}

#[tokio::test(start_paused = true)]
async fn max_in_flight_is_never_exceeded() {
    // 40 independent events with latencies of 1..=7 ms; at most 4 at once.
    let sink = ScriptedSink::new(|id, _| {
        let n: u64 = id[1..].parse().unwrap();
        (Duration::from_millis(1 + n % 7), 204)
    });
    let txs = (0..40)
        .map(|n| vec![event(&format!("e{n}"), None)])
        .collect();
    let (last, _) = dispatch_all(config(4), Arc::clone(&sink), txs).await;
    assert_eq!(last, Lsn::new(4_000));
    let calls = sink.calls();
    assert_eq!(calls.len(), 40);
    let most = max_concurrency(&calls);
    assert_eq!(most, 4, "{most} in flight, max 4");
}

#[tokio::test(start_paused = true)]
async fn poison_is_dead_lettered_once_and_counts_as_done() {
    let sink = ScriptedSink::new(|id, _| {
        let status = if id == "e1" { 422 } else { 204 };
        (Duration::from_millis(5), status)
    });
    let txs = vec![
        vec![event("e0", Some("a"))],
        vec![event("e1", Some("a")), event("e2", Some("b"))],
        vec![event("e3", Some("a"))],
    ];
    let (last, dead) = dispatch_all(config(8), Arc::clone(&sink), txs).await;
    assert_eq!(last, Lsn::new(300), "the poison transaction is done too");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].event_id.as_deref(), Some("e1"));
    assert_eq!(dead[0].http_status, Some(422));
    assert_eq!(dead[0].attempts, 1);
    let calls = sink.calls();
    assert_eq!(
        calls.iter().filter(|c| c.id == "e1").count(),
        1,
        "never retried"
    );
    let e1 = calls.iter().find(|c| c.id == "e1").unwrap();
    let e3 = calls.iter().find(|c| c.id == "e3").unwrap();
    assert!(
        e1.end <= e3.start,
        "e3 (same aggregate) waits for e1's verdict"
    );
}

/// Issue 14, HTTP manners 4: once the pipeline is stopping no new attempt
/// starts: a delivery in backoff gives up at once, the dispatcher returns
/// without waiting for it, and the confirmed position stays before the
/// undelivered event's transaction.
#[tokio::test(start_paused = true)]
async fn stopping_starts_no_new_attempt_and_confirms_nothing_undone() {
    let sink = ScriptedSink::new(|id, _| {
        (
            Duration::from_millis(2),
            if id == "bad" { 503 } else { 204 },
        )
    });
    let store = Arc::new(MemoryStore::default());
    let metrics = Metrics::new();
    let stopping = CancellationToken::new();
    let lane = Lane::single(config(8), Arc::clone(&sink), &metrics);
    let pipeline = pipeline(&store, metrics, stopping.clone());
    let (items, items_rx) = mpsc::channel(16);
    let (confirmed, _) = watch::channel(Confirmed::default());
    let dispatcher = tokio::spawn(run(vec![lane], pipeline, Lsn::ZERO, items_rx, confirmed));
    let window = Window::new(10_000, 1 << 20);
    for (n, id) in ["ok", "bad"].into_iter().enumerate() {
        let end = Lsn::new(100 * (n as u64 + 1));
        send_tx(&items, &window, vec![event(id, None)], end).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = sink.calls().len();
    let t = Instant::now();
    stopping.cancel();
    drop(items);
    let confirmed = dispatcher.await.unwrap().unwrap();
    assert_eq!(t.elapsed(), Duration::ZERO, "returned at once");
    assert_eq!(sink.calls().len(), before, "no attempt after the stop");
    assert_eq!(
        confirmed,
        Lsn::new(100),
        "the failing event's transaction is not confirmed"
    );
}

#[tokio::test(start_paused = true)]
async fn a_rate_cap_spaces_the_attempts_of_every_delivery() {
    // 30 events, 16 at once, capped at 10 requests/s: the starts are
    // 100 ms apart, whatever the window.
    let sink = ScriptedSink::new(|_, _| (Duration::from_millis(5), 204));
    let cfg = DispatchConfig {
        rate: Some(10.0),
        ..config(16)
    };
    let txs = (0..30)
        .map(|i| vec![event(&format!("e{i}"), None)])
        .collect();
    let (last, _) = dispatch_all(cfg, Arc::clone(&sink), txs).await;
    assert_eq!(last, Lsn::new(3000));
    let mut starts: Vec<Instant> = sink.calls().iter().map(|c| c.start).collect();
    starts.sort();
    let gaps: Vec<Duration> = starts.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(
        gaps.iter().all(|g| *g >= Duration::from_millis(99)),
        "{gaps:?}"
    );
    assert!(starts[29] - starts[0] >= Duration::from_millis(2900));
}
