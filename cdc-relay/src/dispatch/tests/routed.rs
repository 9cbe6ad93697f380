//! The routed pipeline (several endpoints, `run --routes`) against scripted
//! sinks in paused time: fan-out, unrouted dead letters, per-endpoint
//! isolation, and the watermark waiting for every endpoint.
//!
//! Broken on purpose once, to show these tests can fail: `handle` adding
//! each event to its first lane only (`to.iter().take(1)`) failed both
//! ("b waited for a": b got only e2; "b took e1 although a refused it").
//! Head-of-line blocking across lanes (`next_job` taking the lowest ready
//! job and giving up when its lane is full) is caught by the scheduler's
//! `a_blocked_lane_does_not_hold_the_other_back`, not here.

use super::*;
use crate::dispatch::route::Pattern;

mod parked;
mod resumed;

fn typed(id: &str, ty: &str, key: Option<&str>) -> OutboxEvent {
    OutboxEvent {
        event_type: ty.into(),
        ..event(id, key)
    }
}

struct Routed {
    confirmed: watch::Receiver<Confirmed<Lsn>>,
    items: mpsc::Sender<Item<Lsn>>,
    dispatcher: tokio::task::JoinHandle<Result<Lsn, DispatchError>>,
    store: Arc<MemoryStore>,
    metrics: Metrics,
    window: Window,
    txs: u64,
}

impl Routed {
    fn start(lanes: Vec<(&str, Arc<ScriptedSink>, Vec<&str>)>, unrouted: Unrouted) -> Self {
        Self::start_parking(lanes, unrouted, &[], None)
    }

    /// As [`Self::start`], with lane `i`'s `max_lag` `max_lags[i]` (absent:
    /// none) and a WAL budget.
    fn start_parking(
        lanes: Vec<(&str, Arc<ScriptedSink>, Vec<&str>)>,
        unrouted: Unrouted,
        max_lags: &[Duration],
        wal_budget: Option<RetainedWal>,
    ) -> Self {
        let parks = lanes.iter().map(|_| park::Park::default()).collect();
        Self::start_parked(lanes, unrouted, max_lags, wal_budget, parks, false)
    }

    /// As [`Self::start_parking`], with lane `i`'s parking switch
    /// `parks[i]`; `auto_resume`: every endpoint has `resume = "auto"`
    /// (else `"manual"`).
    fn start_parked(
        lanes: Vec<(&str, Arc<ScriptedSink>, Vec<&str>)>,
        unrouted: Unrouted,
        max_lags: &[Duration],
        wal_budget: Option<RetainedWal>,
        parks: Vec<park::Park>,
        auto_resume: bool,
    ) -> Self {
        let window = Window::new(10_000, 1 << 20);
        Self::start_windowed(
            lanes,
            unrouted,
            max_lags,
            wal_budget,
            parks,
            auto_resume,
            window,
        )
    }

    /// Endpoints `a` and `b`, each taking every event type, `a` behind
    /// the parking switch `park_a` (b has its own), no `max_lag`, no WAL
    /// budget; `auto_resume` as in [`Self::start_parked`].
    fn a_and_b(
        a: &Arc<ScriptedSink>,
        b: &Arc<ScriptedSink>,
        park_a: park::Park,
        auto_resume: bool,
    ) -> Self {
        Self::start_parked(
            vec![
                ("a", Arc::clone(a), vec!["*"]),
                ("b", Arc::clone(b), vec!["*"]),
            ],
            Unrouted::DeadLetter,
            &[],
            None,
            vec![park_a, park::Park::default()],
            auto_resume,
        )
    }

    /// As [`Self::start_parked`], events admitted through `window`.
    fn start_windowed(
        lanes: Vec<(&str, Arc<ScriptedSink>, Vec<&str>)>,
        unrouted: Unrouted,
        max_lags: &[Duration],
        wal_budget: Option<RetainedWal>,
        parks: Vec<park::Park>,
        auto_resume: bool,
        window: Window,
    ) -> Self {
        let store = Arc::new(MemoryStore::default());
        let metrics = Metrics::new();
        let lanes = lanes
            .into_iter()
            .zip(parks)
            .enumerate()
            .map(|(i, ((name, sink, types), park))| {
                let cfg = DispatchConfig {
                    max_lag: max_lags.get(i).copied(),
                    auto_resume,
                    ..config(4)
                };
                let takes = types.iter().map(|t| Pattern::new(t)).collect();
                Lane {
                    park,
                    ..Lane::routed(name.to_owned(), takes, cfg, sink, &metrics)
                }
            })
            .collect();
        let pipeline = Pipeline {
            unrouted,
            wal_budget,
            window: Some(window.clone()),
            ..pipeline(&store, metrics.clone(), CancellationToken::new())
        };
        let (items, items_rx) = mpsc::channel(16);
        let (confirmed_tx, confirmed) = watch::channel(Confirmed::default());
        let dispatcher = tokio::spawn(run(lanes, pipeline, Lsn::ZERO, items_rx, confirmed_tx));
        Routed {
            confirmed,
            items,
            dispatcher,
            store,
            metrics,
            window,
            txs: 0,
        }
    }

    /// Sends one transaction ending at LSN 100·n (n counts from 1).
    async fn tx(&mut self, events: Vec<OutboxEvent>) {
        self.items.send(Item::Begin).await.unwrap();
        for e in events {
            let permit = self.window.admit(e.size_bytes()).await;
            self.items.send(Item::Event(e, permit)).await.unwrap();
        }
        self.txs += 1;
        let end = Lsn::new(100 * self.txs);
        let commit = Item::Commit {
            end,
            commit_time_micros: 0,
        };
        self.items.send(commit).await.unwrap();
    }

    fn position(&self) -> Lsn {
        self.confirmed.borrow().position
    }

    async fn finish(self) -> (Lsn, Vec<NewDeadLetter>, Metrics) {
        drop(self.items);
        let last = self.dispatcher.await.unwrap().unwrap();
        let rows = self.store.0.lock().unwrap().clone();
        (last, rows, self.metrics)
    }
}

fn ids(sink: &ScriptedSink, status: u16) -> Vec<String> {
    sink.calls()
        .into_iter()
        .filter(|c| c.status == status)
        .map(|c| c.id)
        .collect()
}

#[tokio::test(start_paused = true)]
async fn fan_out_isolation_and_the_watermark() {
    let t0 = Instant::now();
    // a answers 503 for its first 2 s, then 204; b always 204.
    let a = ScriptedSink::new(move |_, now| {
        let status = if now < t0 + Duration::from_secs(2) {
            503
        } else {
            204
        };
        (Duration::from_millis(5), status)
    });
    let b = ScriptedSink::new(|_, _| (Duration::from_millis(5), 204));
    let mut r = Routed::start(
        vec![
            ("a", Arc::clone(&a), vec!["Order*"]),
            ("b", Arc::clone(&b), vec!["OrderCreated", "Invoice*"]),
        ],
        Unrouted::DeadLetter,
    );
    r.tx(vec![typed("e1", "OrderCreated", Some("k"))]).await;
    r.tx(vec![typed("e2", "InvoicePaid", Some("k"))]).await;
    r.tx(vec![typed("e3", "Refund", Some("k"))]).await;
    r.tx(vec![
        typed("e4", "OrderShipped", Some("k")),
        typed("e5", "OrderCreated", Some("k")),
    ])
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // b is done with everything it takes while a still fails.
    assert_eq!(ids(&b, 204), ["e1", "e2", "e5"], "b waited for a");
    assert!(ids(&a, 204).is_empty());
    assert_eq!(
        r.position(),
        Lsn::ZERO,
        "tx 1 is not done at a: nothing may be confirmed"
    );
    let (last, rows, metrics) = r.finish().await;
    assert_eq!(last, Lsn::new(400));
    assert_eq!(ids(&a, 204), ["e1", "e4", "e5"], "a: its types, in order");
    assert_eq!(ids(&b, 204), ["e1", "e2", "e5"], "b: its types, in order");
    assert!(
        ids(&a, 503).iter().all(|id| id == "e1"),
        "a: only e1 probes while its key waits"
    );
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].event_id.as_deref(), Some("e3"));
    assert!(rows[0].error.starts_with("unrouted: "), "{}", rows[0].error);
    assert_eq!(rows[0].endpoint, None);
    let text = metrics.render();
    for line in [
        "cdc_relay_endpoint_events_delivered_total{endpoint=\"a\"} 3",
        "cdc_relay_endpoint_events_delivered_total{endpoint=\"b\"} 3",
        "cdc_relay_unrouted_events_total{action=\"dead_letter\"} 1",
        "cdc_relay_events_delivered_total 6",
        "cdc_relay_endpoint_circuit_state{endpoint=\"a\"} 0",
    ] {
        assert!(text.contains(line), "missing {line}");
    }
}

#[tokio::test(start_paused = true)]
async fn poison_at_one_endpoint_names_it_and_skip_drops_unrouted() {
    let a =
        ScriptedSink::new(|id, _| (Duration::from_millis(1), if id == "e1" { 422 } else { 204 }));
    let b = ScriptedSink::new(|_, _| (Duration::from_millis(1), 204));
    let mut r = Routed::start(
        vec![
            ("a", Arc::clone(&a), vec!["*"]),
            ("b", Arc::clone(&b), vec!["T"]),
        ],
        Unrouted::Skip,
    );
    r.tx(vec![typed("e1", "T", None), typed("e2", "U", None)])
        .await;
    let (last, rows, metrics) = r.finish().await;
    assert_eq!(last, Lsn::new(100));
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        rows[0].endpoint.as_deref(),
        Some("a"),
        "the endpoint that refused it"
    );
    assert_eq!(ids(&b, 204), ["e1"], "b took e1 although a refused it");
    let text = metrics.render();
    assert!(text.contains("cdc_relay_endpoint_events_dead_lettered_total{endpoint=\"a\"} 1"));
    assert!(text.contains("cdc_relay_unrouted_events_total{action=\"skip\"} 0"));

    // Nothing matches: skipped, done at once, counted.
    let c = ScriptedSink::new(|_, _| (Duration::from_millis(1), 204));
    let mut r = Routed::start(vec![("c", Arc::clone(&c), vec!["T"])], Unrouted::Skip);
    r.tx(vec![typed("e9", "Nope", None)]).await;
    let (last, rows, metrics) = r.finish().await;
    assert_eq!(last, Lsn::new(100));
    assert!(rows.is_empty() && c.calls().is_empty());
    assert!(
        metrics
            .render()
            .contains("cdc_relay_unrouted_events_total{action=\"skip\"} 1")
    );
}
