//! The hot path as `run` builds it for `--sink-url`, minus the network to
//! PostgreSQL, shared by the allocation budget test (`alloc_budget.rs`)
//! and the instruction count example (`examples/hot_path.rs`).
//!
//! pgoutput bytes (made with [`pgoutput::encode`] before anything is
//! counted) are decoded, mapped to outbox events by the [`OutboxMapper`],
//! admitted to the [`Window`] and handed to [`dispatch::run`], whose one
//! lane is the real [`HttpSink`] (JSON body, both signature schemes,
//! pooled HTTP/1.1 connections) posting to an in-process HTTP server that
//! answers 204. Events come in transactions of [`PER_TX`], each of its own
//! aggregate, at `--max-in-flight` [`MAX_IN_FLIGHT`], on a current-thread
//! runtime (one thread: the order of tasks, so any count, is the same from
//! run to run).

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use cdc_relay::breaker::BreakerConfig;
use cdc_relay::dead_letter::{DeadLetterStore, NewDeadLetter, ParkedRow, StoreError, Urgency};
use cdc_relay::dispatch::{self, Confirmed, DispatchConfig, Item, Lane, Pipeline, Window};
use cdc_relay::health::Health;
use cdc_relay::lsn::Lsn;
use cdc_relay::metrics::Metrics;
use cdc_relay::outbox::{Mapped, OutboxColumns, OutboxMapper, TxContext};
use cdc_relay::pgoutput::{
    self, Begin, Column, ColumnFlags, ColumnValue, Commit, Insert, LogicalMessage, Relation,
    RelationId, ReplicaIdentity, TupleData,
};
use cdc_relay::sink::{HttpSink, SignatureScheme, Signer, Signing, SinkConfig, StatusPolicy};
use event_secret::{CURRENT, EventKeys, Key};

/// Events per transaction.
pub const PER_TX: u64 = 10;
/// The lane's `--max-in-flight`.
pub const MAX_IN_FLIGHT: usize = 16;

const OUTBOX_OID: u32 = 16_384;

/// A dead-letter store that is never written: every event gets a 204.
struct NoDeadLetters;

impl DeadLetterStore for NoDeadLetters {
    fn write(
        &self,
        row: &NewDeadLetter,
        _urgency: Urgency,
    ) -> impl std::future::Future<Output = Result<cdc_relay::dead_letter::Written, StoreError>>
    + Send
    + 'static {
        let row = format!("{row:?}");
        async move { panic!("nothing is dead-lettered here: {row}") }
    }
    async fn parked(
        &self,
        _endpoint: &str,
        _after: i64,
        _limit: i64,
    ) -> Result<Vec<ParkedRow>, StoreError> {
        Ok(Vec::new())
    }
    async fn replayed(&self, _ids: &[i64], _why: &'static str) -> Result<(), StoreError> {
        Ok(())
    }
    async fn refused(&self, _id: i64, _row: &NewDeadLetter) -> Result<(), StoreError> {
        Ok(())
    }
    async fn resume_lock(&self, _endpoint: &str, _take: bool) -> Result<bool, StoreError> {
        Ok(true)
    }
}

/// The outbox's Relation message, as the walsender sends it first.
fn relation() -> LogicalMessage {
    let column = |name: &str, type_oid: u32| Column {
        flags: ColumnFlags(0),
        name: name.into(),
        type_oid,
        type_modifier: -1,
    };
    LogicalMessage::Relation(Relation {
        oid: RelationId(OUTBOX_OID),
        namespace: "public".into(),
        name: "outbox".into(),
        replica_identity: ReplicaIdentity::Default,
        columns: vec![
            column("id", 2950),
            column("aggregate_id", 2950),
            column("event_type", 25),
            column("payload", 3802),
        ],
    })
}

/// Event `n`'s Insert message: a distinct aggregate, an order-sized payload.
fn insert(n: u64) -> Bytes {
    let text = |s: String| ColumnValue::Text(Bytes::from(s));
    pgoutput::encode(&LogicalMessage::Insert(Insert {
        relation: RelationId(OUTBOX_OID),
        new: TupleData(vec![
            text(format!("00000000-0000-4000-8000-{n:012x}")),
            text(format!("10000000-0000-4000-8000-{n:012x}")),
            text("OrderCreated".into()),
            text(format!(
                r#"{{"order_id": "10000000-0000-4000-8000-{n:012x}", "amount_cents": {n}, "currency": "EUR"}}"#
            )),
        ]),
    }))
}

/// Events `from..to` as the walsender sends them, encoded before the
/// count starts (making them is the test's work, not the relay's): per
/// transaction of [`PER_TX`] events, Begin, the Inserts, Commit.
fn stream(from: u64, to: u64) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut n = from;
    while n < to {
        let end = Lsn::new(1_000 + 100 * n);
        out.push(pgoutput::encode(&LogicalMessage::Begin(Begin {
            final_lsn: Lsn::new(end.as_u64() - 1),
            commit_time: 0,
            xid: 1,
        })));
        for _ in 0..PER_TX {
            out.push(insert(n));
            n += 1;
        }
        out.push(pgoutput::encode(&LogicalMessage::Commit(Commit {
            flags: 0,
            commit_lsn: Lsn::new(end.as_u64() - 1),
            end_lsn: end,
            commit_time: 0,
        })));
    }
    out
}

/// The stream's side, as `source::stream` does it: decode each message,
/// map inserts to events, admit them to the window, hand them on.
async fn feed(
    messages: Vec<Bytes>,
    mapper: &mut OutboxMapper,
    window: &Window,
    items: &mpsc::Sender<Item<Lsn>>,
) {
    let mut tx = None;
    for message in messages {
        let item = match pgoutput::decode(message).expect("decodes") {
            LogicalMessage::Begin(b) => {
                tx = Some(TxContext {
                    commit_lsn: Some(b.final_lsn),
                    commit_time_micros: b.commit_time,
                });
                Item::Begin
            }
            LogicalMessage::Insert(ins) => {
                let tx = tx.expect("an insert inside a transaction");
                let Mapped::Event(event) = mapper.on_insert(&ins, tx).expect("maps") else {
                    panic!("not an outbox event")
                };
                let permit = window.admit(event.size_bytes()).await;
                Item::Event(event, permit)
            }
            LogicalMessage::Commit(c) => Item::Commit {
                end: c.end_lsn,
                commit_time_micros: c.commit_time,
            },
            other => panic!("not in this stream: {other:?}"),
        };
        items.send(item).await.expect("dispatcher running");
    }
}

/// An HTTP server on 127.0.0.1 answering every POST to `/inbox` 204
/// after reading its body; its URL.
async fn inbox() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let app = axum::Router::new().route(
        "/inbox",
        axum::routing::post(|_body: Bytes| async { StatusCode::NO_CONTENT }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/inbox")
}

fn lane(url: &str, metrics: &Metrics) -> Lane<HttpSink> {
    let key = Key::parse(
        "a-secret-of-at-least-32-bytes-for-tests",
        "EVENT_SECRET",
        &CURRENT,
    )
    .expect("a valid secret");
    let signer = Signer::new(SignatureScheme::Both, &EventKeys::new(key, None));
    let sink = HttpSink::new(SinkConfig {
        url: url.parse().expect("a URL"),
        signing: Signing::new(signer),
        connect_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(30),
        connection_max_age: Duration::from_secs(3600),
        idle_timeout: Duration::from_secs(60),
        tls: Default::default(),
    })
    .expect("an HTTP sink");
    let cfg = DispatchConfig {
        max_in_flight: MAX_IN_FLIGHT,
        batch_max_events: 1,
        batch_max_bytes: usize::MAX,
        backoff_base: Duration::from_millis(100),
        backoff_cap: Duration::from_secs(1),
        retry_after_max: Duration::from_secs(60),
        policy: StatusPolicy::default(),
        breaker: BreakerConfig {
            failure_threshold: 5,
            probe_interval: Duration::from_millis(500),
            storm_threshold: 10,
            retired_probe_interval: Duration::from_secs(60),
        },
        max_lag: None,
        rate: None,
        auto_resume: true,
    };
    Lane::single(cfg, sink, metrics)
}

/// Waits until the dispatcher has confirmed `end`.
async fn confirmed_at(confirmed: &mut watch::Receiver<Confirmed<Lsn>>, end: Lsn) {
    tokio::time::timeout(Duration::from_secs(120), async {
        while confirmed.borrow_and_update().position < end {
            confirmed.changed().await.expect("dispatcher running");
        }
    })
    .await
    .expect("every event delivered within 2 minutes");
}

/// Runs `warm_up` events through the pipeline, then `events` more, and
/// returns what was counted while the latter went through: `measure()`
/// after them minus `measure()` before them (e.g. the heap allocations
/// made meanwhile), and the Tokio tasks spawned meanwhile. Both counts of
/// events should be multiples of [`PER_TX`].
///
/// Tasks are counted by their ids: Tokio takes a task's id from one
/// process-wide counter, in spawn order, so the ids of two probe tasks
/// spawned before and after differ by the tasks spawned in between, plus
/// one (this is how Tokio 1.x makes ids, not a documented promise; were it
/// to change, the count would be nonsense and the budget test fail, not
/// pass). The probes are spawned outside `measure()`'s window.
///
/// # Panics
/// When the pipeline fails or does not deliver everything within 2
/// minutes.
pub fn run(warm_up: u64, events: u64, measure: impl Fn() -> u64) -> Counted {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let url = inbox().await;
        let metrics = Metrics::new();
        let lanes = vec![lane(&url, &metrics)];
        let pipeline = Pipeline::new(
            Arc::new(NoDeadLetters),
            metrics,
            Health::new(Duration::from_secs(60)),
            CancellationToken::new(),
        );
        let (items, items_rx) = mpsc::channel(1_024);
        let (confirmed_tx, mut confirmed) = watch::channel(Confirmed::default());
        let dispatcher = tokio::spawn(dispatch::run(
            lanes,
            pipeline,
            Lsn::ZERO,
            items_rx,
            confirmed_tx,
        ));
        let window = Window::new(10_000, 16 << 20);
        let mut mapper = OutboxMapper::new(
            "public.outbox".parse().expect("a table name"),
            OutboxColumns::default(),
            Some(OUTBOX_OID),
        );
        let LogicalMessage::Relation(rel) =
            pgoutput::decode(pgoutput::encode(&relation())).expect("decodes")
        else {
            unreachable!("a Relation")
        };
        mapper.on_relation(&rel);

        feed(stream(0, warm_up), &mut mapper, &window, &items).await;
        confirmed_at(&mut confirmed, Lsn::new(1_000 + 100 * (warm_up - PER_TX))).await;
        let counted = stream(warm_up, warm_up + events);
        let first_probe = probe_task_id();
        let before = measure();
        feed(counted, &mut mapper, &window, &items).await;
        confirmed_at(
            &mut confirmed,
            Lsn::new(1_000 + 100 * (warm_up + events - PER_TX)),
        )
        .await;
        let after = measure();
        let last_probe = probe_task_id();
        drop(items);
        dispatcher
            .await
            .expect("the dispatcher does not panic")
            .expect("the dispatcher ends cleanly");
        Counted {
            measured: after - before,
            tasks_spawned: last_probe - first_probe - 1,
        }
    })
}

/// What [`run`] counted while its counted events went through.
pub struct Counted {
    /// `measure()` after minus before.
    #[allow(dead_code, reason = "the instruction count's example measures nothing")]
    pub measured: u64,
    /// Tokio tasks spawned (see [`run`]).
    pub tasks_spawned: u64,
}

/// The id of a task spawned now, as a number (see [`run`]).
fn probe_task_id() -> u64 {
    let id = tokio::spawn(async {}).id().to_string();
    id.parse().expect("a Tokio task id prints as a number")
}
