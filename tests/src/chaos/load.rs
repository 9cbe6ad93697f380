//! The load: orders posted through the Orders HTTP API at a fixed rate
//! (open loop: one post per timer tick, whatever the previous ones are
//! doing), and direct SQL producers writing multi-row transactions,
//! rolled-back transactions and savepoint rollbacks.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use uuid::Uuid;

/// Posts in flight at most; a tick finding none free counts as a failure
/// (`shed`), so the offered rate never silently drops.
const MAX_IN_FLIGHT_POSTS: usize = 256;

/// What the HTTP load recorded.
#[derive(Debug, Default, Clone)]
pub struct HttpTally {
    /// Posts attempted (ticks).
    pub posted: usize,
    /// `(event id, order id, seconds since the start)` of every 201.
    pub accepted: Vec<(Uuid, Uuid, f64)>,
    /// `(seconds since the start, kind)` of every failure.
    pub failures: Vec<(f64, String)>,
}

impl HttpTally {
    /// Failures by kind.
    pub fn failures_by_kind(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for (_, kind) in &self.failures {
            *m.entry(kind.clone()).or_insert(0) += 1;
        }
        m
    }
}

/// The running HTTP load.
pub struct HttpLoad {
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<HttpTally>>,
    ticker: JoinHandle<()>,
    permits: Arc<Semaphore>,
}

impl HttpLoad {
    /// Starts posting `rate` orders per second to `orders_url` (a stable
    /// front), timing from `epoch`.
    pub fn start(orders_url: String, rate: u32, epoch: Instant) -> HttpLoad {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .expect("an HTTP client");
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Mutex::new(HttpTally::default()));
        let permits = Arc::new(Semaphore::new(MAX_IN_FLIGHT_POSTS));
        let period = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
        let ticker = {
            let (stop, tally, permits) =
                (Arc::clone(&stop), Arc::clone(&tally), Arc::clone(&permits));
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                let mut amount: i64 = 100;
                while !stop.load(Ordering::SeqCst) {
                    tick.tick().await;
                    amount += 1;
                    let t = epoch.elapsed().as_secs_f64();
                    tally.lock().expect("tally lock").posted += 1;
                    let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
                        let mut tl = tally.lock().expect("tally lock");
                        tl.failures.push((t, "shed".into()));
                        continue;
                    };
                    let (http, url, tally) = (http.clone(), orders_url.clone(), Arc::clone(&tally));
                    tokio::spawn(async move {
                        let result = post(&http, &url, amount).await;
                        let mut tl = tally.lock().expect("tally lock");
                        match result {
                            Ok((order, event)) => tl.accepted.push((event, order, t)),
                            Err(kind) => tl.failures.push((t, kind)),
                        }
                        drop(permit);
                    });
                }
            })
        };
        HttpLoad {
            stop,
            tally,
            ticker,
            permits,
        }
    }

    /// Orders accepted so far.
    pub fn accepted(&self) -> usize {
        self.tally.lock().expect("tally lock").accepted.len()
    }

    /// Stops ticking, waits (bounded) for the posts in flight, returns the tally.
    pub async fn stop(self) -> HttpTally {
        self.stop.store(true, Ordering::SeqCst);
        let _ = tokio::time::timeout(Duration::from_secs(5), self.ticker).await;
        // Every permit back means every post answered or timed out.
        let all = u32::try_from(MAX_IN_FLIGHT_POSTS).expect("small");
        let _ = tokio::time::timeout(Duration::from_secs(15), self.permits.acquire_many(all)).await;
        self.tally.lock().expect("tally lock").clone()
    }
}

/// One post; `Err` names the failure kind (a status, `timeout`, `connect`, ...).
async fn post(http: &reqwest::Client, orders: &str, amount: i64) -> Result<(Uuid, Uuid), String> {
    let resp = http
        .post(format!("{orders}/orders"))
        .json(&serde_json::json!({"amount_cents": amount, "currency": "EUR"}))
        .send()
        .await
        .map_err(|e| error_kind(&e))?;
    let status = resp.status().as_u16();
    if status != 201 {
        return Err(format!("http {status}"));
    }
    let body: serde_json::Value = resp.json().await.map_err(|e| error_kind(&e))?;
    let field = |k: &str| {
        body[k]
            .as_str()
            .and_then(|s| s.parse::<Uuid>().ok())
            .ok_or_else(|| "bad 201 body".to_owned())
    };
    Ok((field("order_id")?, field("event_id")?))
}

fn error_kind(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timeout".into()
    } else if e.is_connect() {
        "connect".into()
    } else if e.is_body() || e.is_decode() {
        "body".into()
    } else {
        "connection".into()
    }
}

/// What the SQL producers recorded.
#[derive(Debug, Default, Clone)]
pub struct SqlTally {
    /// Transactions whose COMMIT returned OK.
    pub committed_tx: usize,
    /// Events in those transactions.
    pub committed_events: Vec<Uuid>,
    /// Transactions rolled back on purpose.
    pub rolled_back_tx: usize,
    /// Transactions that rolled back to a savepoint, then committed.
    pub savepoint_tx: usize,
    /// Transactions whose outcome is unknown (the connection failed).
    pub unknown_tx: usize,
    /// Event ids written and then rolled back: they must never reach Billing.
    pub phantom_candidates: Vec<Uuid>,
    /// Failed transactions and failed connects (PostgreSQL restarting, ...).
    pub errors: usize,
}

/// The running SQL producer.
pub struct SqlLoad {
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<SqlTally>>,
    task: JoinHandle<()>,
}

impl SqlLoad {
    /// Starts one producer at `tx_per_sec` transactions per second as the
    /// Orders role (`url`), choosing what to do with an RNG seeded by `seed`.
    pub fn start(url: String, tx_per_sec: f64, seed: u64) -> SqlLoad {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Mutex::new(SqlTally::default()));
        let task = {
            let (stop, tally) = (Arc::clone(&stop), Arc::clone(&tally));
            tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(seed);
                let mut client: Option<tokio_postgres::Client> = None;
                let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / tx_per_sec));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                while !stop.load(Ordering::SeqCst) {
                    tick.tick().await;
                    if client.as_ref().is_none_or(|c| c.is_closed()) {
                        client = crate::connect(&url).await.ok();
                    }
                    let Some(c) = client.as_ref() else {
                        tally.lock().expect("sql lock").errors += 1;
                        continue;
                    };
                    let step = Step::draw(&mut rng);
                    let result = c.batch_execute(&step.sql).await;
                    let mut tl = tally.lock().expect("sql lock");
                    tl.phantom_candidates.extend(&step.rolled_back);
                    match result {
                        Ok(()) => {
                            tl.committed_events.extend(&step.committed);
                            match step.kind {
                                StepKind::MultiRow => tl.committed_tx += 1,
                                StepKind::Savepoint => {
                                    tl.committed_tx += 1;
                                    tl.savepoint_tx += 1;
                                }
                                StepKind::RolledBack => tl.rolled_back_tx += 1,
                            }
                        }
                        Err(_) => {
                            tl.errors += 1;
                            if step.kind != StepKind::RolledBack {
                                tl.unknown_tx += 1;
                            }
                            client = None;
                        }
                    }
                }
            })
        };
        SqlLoad { stop, tally, task }
    }

    /// Stops and returns the tally.
    pub async fn stop(self) -> SqlTally {
        self.stop.store(true, Ordering::SeqCst);
        let _ = tokio::time::timeout(Duration::from_secs(15), self.task).await;
        self.tally.lock().expect("sql lock").clone()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StepKind {
    MultiRow,
    RolledBack,
    Savepoint,
}

/// One transaction as one simple-query string.
struct Step {
    kind: StepKind,
    sql: String,
    committed: Vec<Uuid>,
    rolled_back: Vec<Uuid>,
}

impl Step {
    fn draw(rng: &mut StdRng) -> Step {
        let roll: f64 = rng.random();
        let kind = if roll < 0.5 {
            StepKind::MultiRow
        } else if roll < 0.75 {
            StepKind::RolledBack
        } else {
            StepKind::Savepoint
        };
        // One multi-row transaction in ten is large.
        let rows = if rng.random_bool(0.1) {
            rng.random_range(50..=200)
        } else {
            rng.random_range(2..=6)
        };
        let mut sql = String::from("BEGIN;");
        let mut committed = Vec::new();
        let mut rolled_back = Vec::new();
        let insert = |sql: &mut String, rng: &mut StdRng| {
            let (order, event) = (Uuid::new_v4(), Uuid::new_v4());
            let amount: i64 = rng.random_range(1..1_000_000);
            sql.push_str(&format!(
                "INSERT INTO orders (id, amount_cents, currency) VALUES ('{order}', {amount}, 'EUR');\
                 INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES ('{event}', '{order}', 'OrderCreated', \
                 '{{\"order_id\":\"{order}\",\"amount_cents\":{amount},\"currency\":\"EUR\"}}');"
            ));
            event
        };
        match kind {
            StepKind::MultiRow => {
                for _ in 0..rows {
                    committed.push(insert(&mut sql, rng));
                }
                sql.push_str("COMMIT;");
            }
            StepKind::RolledBack => {
                for _ in 0..rows.min(10) {
                    rolled_back.push(insert(&mut sql, rng));
                }
                sql.push_str("ROLLBACK;");
            }
            StepKind::Savepoint => {
                committed.push(insert(&mut sql, rng));
                sql.push_str("SAVEPOINT s1;");
                for _ in 0..rows.min(10) {
                    rolled_back.push(insert(&mut sql, rng));
                }
                sql.push_str("ROLLBACK TO SAVEPOINT s1;");
                committed.push(insert(&mut sql, rng));
                sql.push_str("COMMIT;");
            }
        }
        Step {
            kind,
            sql,
            committed,
            rolled_back,
        }
    }
}

/// One committed event of the sequenced producer.
#[derive(Debug, Clone, Copy)]
pub struct SeqEvent {
    /// The event id.
    pub id: Uuid,
    /// `outbox.aggregate_id`: what the shard is chosen by.
    pub aggregate: Uuid,
    /// Position in its aggregate, from 0, in commit order.
    pub seq: u32,
}

/// What the sequenced producer recorded.
#[derive(Debug, Default, Clone)]
pub struct SeqTally {
    /// Events whose COMMIT returned OK.
    pub committed: Vec<SeqEvent>,
    /// Aggregates begun (their first event committed).
    pub aggregates: usize,
    /// Transactions whose outcome is unknown (the connection failed); the
    /// aggregate is abandoned there.
    pub unknown_tx: usize,
}

/// A producer of several events per aggregate, each in its own
/// transaction, back to back: the order the relay must keep per aggregate.
///
/// Billing takes only `OrderCreated` and invoices each `data.order_id`
/// once, so event `seq` of aggregate `A` is an `OrderCreated` for a child
/// order of its own (`A` itself for `seq` 0), with `outbox.aggregate_id =
/// A` and `data.seq`/`data.aggregate` telling the position. Every event is
/// a distinct invoice; the shard is chosen by `A`.
pub struct SeqLoad {
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<SeqTally>>,
    task: JoinHandle<()>,
}

impl SeqLoad {
    /// Starts `aggregates_per_sec` aggregates per second of `events` events
    /// each, as the Orders role (`url`).
    pub fn start(url: String, aggregates_per_sec: f64, events: u32) -> SeqLoad {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Mutex::new(SeqTally::default()));
        let task = {
            let (stop, tally) = (Arc::clone(&stop), Arc::clone(&tally));
            tokio::spawn(async move {
                let mut client: Option<tokio_postgres::Client> = None;
                let period = Duration::from_secs_f64(1.0 / aggregates_per_sec);
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                while !stop.load(Ordering::SeqCst) {
                    tick.tick().await;
                    if client.as_ref().is_none_or(|c| c.is_closed()) {
                        client = crate::connect(&url).await.ok();
                    }
                    let Some(c) = client.as_ref() else { continue };
                    if !write_aggregate(c, events, &tally).await {
                        client = None;
                    }
                }
            })
        };
        SeqLoad { stop, tally, task }
    }

    /// Stops and returns the tally.
    pub async fn stop(self) -> SeqTally {
        self.stop.store(true, Ordering::SeqCst);
        let _ = tokio::time::timeout(Duration::from_secs(15), self.task).await;
        self.tally.lock().expect("seq lock").clone()
    }
}

/// Commits the `events` events of one new aggregate, one transaction each;
/// `false` when a transaction failed (the rest of the aggregate is dropped).
async fn write_aggregate(c: &tokio_postgres::Client, events: u32, tally: &Mutex<SeqTally>) -> bool {
    let aggregate = Uuid::new_v4();
    for seq in 0..events {
        let (order, id) = if seq == 0 {
            (aggregate, Uuid::new_v4())
        } else {
            (Uuid::new_v4(), Uuid::new_v4())
        };
        let amount = 100 + i64::from(seq);
        let sql = format!(
            "BEGIN;\
             INSERT INTO orders (id, amount_cents, currency) VALUES ('{order}', {amount}, 'EUR');\
             INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES ('{id}', '{aggregate}', 'OrderCreated', \
             '{{\"order_id\":\"{order}\",\"amount_cents\":{amount},\"currency\":\"EUR\",\"aggregate\":\"{aggregate}\",\"seq\":{seq}}}');\
             COMMIT;"
        );
        let ok = c.batch_execute(&sql).await.is_ok();
        let mut tl = tally.lock().expect("seq lock");
        if !ok {
            tl.unknown_tx += 1;
            return false;
        }
        tl.aggregates += usize::from(seq == 0);
        tl.committed.push(SeqEvent { id, aggregate, seq });
    }
    true
}
