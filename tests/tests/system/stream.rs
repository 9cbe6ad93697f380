//! What the relay makes of unusual replication streams and payloads: big and
//! aborted transactions, savepoints, prepared transactions, schema changes
//! mid-stream and while stopped, logical messages, updates/deletes/truncates
//! on the outbox, and payloads that must reach the sink byte for byte.
//!
//! Every test checks the sink received EXACTLY the expected bodies: the
//! `data` part byte-identical to `payload::text` as PostgreSQL returned it,
//! each event once, nothing else. "Nothing else" is established without
//! sleeping: the relay confirms an LSN only once every transaction before it
//! is done, so once the slot's `confirmed_flush_lsn` passed the WAL position
//! taken after the last statement, every delivery that will ever come for
//! those transactions has come.

use std::collections::HashMap;
use std::time::Duration;

use harness::app::{self, Running, TEST_SECRET};
use harness::sink::{Received, ScriptedSink};
use harness::{ClusterOptions, PgCluster, Stack, wait_until};
use tokio_postgres::Client;
use uuid::Uuid;

/// Bound for expected deliveries to arrive.
const DELIVER: Duration = Duration::from_secs(45);
/// Bound for the slot's confirmed LSN to pass a WAL position.
const SETTLE: Duration = Duration::from_secs(30);

/// One committed outbox row as PostgreSQL returned it: what the relay must send.
#[derive(Debug, Clone)]
struct Expected {
    id: String,
    event_type: String,
    /// `payload::text`; `None` for SQL NULL.
    payload: Option<String>,
    aggregate: String,
}

/// A stack with the relay streaming into a scripted sink, and a superuser
/// connection to the orders database.
struct Bench {
    stack: Stack,
    sink: ScriptedSink,
    relay: Running,
    db: Client,
}

impl Bench {
    /// Fresh stack on the shared cluster.
    async fn start() -> anyhow::Result<Bench> {
        let stack = PgCluster::shared().create_stack().await?;
        Bench::start_on(stack).await
    }

    /// `cdc-relay setup`, a scripted sink, the relay, streaming.
    async fn start_on(stack: Stack) -> anyhow::Result<Bench> {
        let t0 = std::time::Instant::now();
        app::relay_setup(&stack).await?;
        eprintln!("[{:?}] setup done", t0.elapsed());
        let sink = ScriptedSink::start().await?;
        let relay = app::start_relay(&stack, &sink.url, &[]).await?;
        app::wait_streaming(&relay).await?;
        eprintln!("[{:?}] streaming", t0.elapsed());
        let db = stack.orders_admin().await?;
        Ok(Bench {
            stack,
            sink,
            relay,
            db,
        })
    }

    /// An order row to reference from outbox rows.
    async fn order(&self) -> anyhow::Result<Uuid> {
        new_order(&self.db).await
    }

    /// Inserts one outbox row (in whatever transaction the connection is in).
    async fn insert(
        &self,
        aggregate: Uuid,
        event_type: &str,
        payload: Option<&str>,
    ) -> anyhow::Result<Expected> {
        insert_event(&self.db, aggregate, event_type, payload).await
    }

    /// Waits until the sink saw at least `n` requests.
    async fn wait_count(&self, n: usize) -> anyhow::Result<()> {
        let what = format!("the sink to receive {n} requests");
        wait_until(&what, DELIVER, || async { self.sink.count() >= n }).await
    }

    /// Waits until every transaction committed so far is done (see the module doc).
    async fn settle(&self) -> anyhow::Result<()> {
        settle(&self.db, &self.stack.slot).await
    }

    /// Waits for `expected.len()` requests, settles, and asserts the sink got
    /// exactly these bodies.
    async fn expect_exactly(&self, expected: &[Expected]) -> anyhow::Result<()> {
        self.wait_count(expected.len()).await?;
        self.settle().await?;
        assert_exact(&self.sink.received(), expected);
        Ok(())
    }

    /// Stops the relay with SIGTERM (must exit 0) and drops the slot so the
    /// shared cluster does not accumulate slots.
    async fn finish(mut self) -> anyhow::Result<()> {
        stop_relay(&mut self.relay).await?;
        drop_slot(&self.db, &self.stack.slot).await
    }
}

async fn new_order(db: &Client) -> anyhow::Result<Uuid> {
    let id = Uuid::new_v4();
    db.execute(
        "INSERT INTO orders (id, amount_cents, currency) VALUES ($1, 100, 'EUR')",
        &[&id],
    )
    .await?;
    Ok(id)
}

/// Inserts an outbox row; the payload is given as JSON text (`None` = SQL
/// NULL) and read back with `RETURNING payload::text`.
async fn insert_event(
    db: &Client,
    aggregate: Uuid,
    event_type: &str,
    payload: Option<&str>,
) -> anyhow::Result<Expected> {
    let row = db
        .query_one(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), $1, $2, $3::text::jsonb) \
             RETURNING id::text, event_type, payload::text, aggregate_id::text",
            &[&aggregate, &event_type, &payload],
        )
        .await?;
    Ok(Expected {
        id: row.get(0),
        event_type: row.get(1),
        payload: row.get(2),
        aggregate: row.get(3),
    })
}

/// The slot's confirmed LSN and the current WAL position, as bytes.
async fn positions(db: &Client, slot: &str) -> anyhow::Result<(i64, i64)> {
    let r = db
        .query_one(
            "SELECT (confirmed_flush_lsn - '0/0')::bigint, (pg_current_wal_lsn() - '0/0')::bigint \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok((r.get(0), r.get(1)))
}

async fn settle(db: &Client, slot: &str) -> anyhow::Result<()> {
    let t0 = std::time::Instant::now();
    let (_, now) = positions(db, slot).await?;
    let what =
        format!("slot {slot} confirmed past WAL position {now} (every earlier transaction done)");
    wait_until(&what, SETTLE, || async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        positions(db, slot)
            .await
            .map(|(confirmed, _)| confirmed >= now)
    })
    .await?;
    eprintln!("settled in {:?}", t0.elapsed());
    Ok(())
}

async fn stop_relay(relay: &mut Running) -> anyhow::Result<()> {
    relay.process.sigterm();
    let status = relay.process.wait_exit(Duration::from_secs(15)).await?;
    anyhow::ensure!(
        status.success(),
        "relay exited with {status} after SIGTERM\n{}",
        relay.process.logs()
    );
    Ok(())
}

async fn drop_slot(db: &Client, slot: &str) -> anyhow::Result<()> {
    // The walsender may take a moment to release the slot after the relay exited.
    wait_until(
        "the slot to be dropped",
        Duration::from_secs(10),
        || async {
            db.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
                .await
                .map(|_| true)
                .map_err(anyhow::Error::from)
        },
    )
    .await
}

/// The `id` of a body that starts `{"id":"<id>"` (without parsing the rest,
/// which may nest deeper than serde_json's recursion limit).
fn body_id(body: &[u8]) -> Option<String> {
    let rest = body.strip_prefix(br#"{"id":""#)?;
    let end = rest.iter().position(|&b| b == b'"')?;
    String::from_utf8(rest[..end].to_vec()).ok()
}

/// Checks one body against what PostgreSQL stored: exactly
/// `{"id":"<id>","type":<T>,"data":<payload::text>}` where `T` is one JSON
/// string whose value is the event type. That makes the body valid JSON with
/// exactly three keys and `data` byte-identical to the payload's text.
fn check_body(got: &Received, exp: &Expected) -> Result<(), String> {
    let body = &got.body[..];
    let prefix = format!(r#"{{"id":"{}","type":"#, exp.id);
    let suffix = format!(r#","data":{}}}"#, exp.payload.as_deref().unwrap_or("null"));
    let shown = || {
        let s = String::from_utf8_lossy(body);
        if s.len() > 300 {
            format!(
                "{}… ({} bytes)",
                s.chars().take(300).collect::<String>(),
                s.len()
            )
        } else {
            s.into_owned()
        }
    };
    if !body.starts_with(prefix.as_bytes()) {
        return Err(format!("body does not start with {prefix}: {}", shown()));
    }
    if body.len() < prefix.len() + suffix.len() || !body.ends_with(suffix.as_bytes()) {
        let expected = exp.payload.as_deref().unwrap_or("null");
        let shown_exp: String = expected.chars().take(300).collect();
        return Err(format!(
            "data is not byte-identical to payload::text ({} bytes, starts {shown_exp}): {}",
            expected.len(),
            shown()
        ));
    }
    let middle = &body[prefix.len()..body.len() - suffix.len()];
    match serde_json::from_slice::<String>(middle) {
        Ok(t) if t == exp.event_type => {}
        Ok(t) => return Err(format!("type {t:?}, expected {:?}", exp.event_type)),
        Err(e) => {
            return Err(format!(
                "type is not a single JSON string ({e}): {}",
                String::from_utf8_lossy(middle)
            ));
        }
    }
    if !got.signature_valid(TEST_SECRET) {
        return Err(format!("bad signature {:?}", got.signature));
    }
    if got.idempotency_key.as_deref() != Some(exp.id.as_str()) {
        return Err(format!("Idempotency-Key {:?}", got.idempotency_key));
    }
    Ok(())
}

/// Asserts `received` holds each expected event exactly once, with the
/// right body, and nothing else.
fn assert_exact(received: &[Received], expected: &[Expected]) {
    let by_id: HashMap<&str, &Expected> = expected.iter().map(|e| (e.id.as_str(), e)).collect();
    assert_eq!(by_id.len(), expected.len(), "expected ids are unique");
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut problems = Vec::new();
    for got in received {
        let Some(id) = body_id(&got.body) else {
            problems.push(format!(
                "body without a leading id: {}",
                String::from_utf8_lossy(&got.body[..got.body.len().min(200)])
            ));
            continue;
        };
        *seen.entry(id.clone()).or_default() += 1;
        match by_id.get(id.as_str()) {
            None => problems.push(format!("unexpected event {id}")),
            Some(exp) => {
                if let Err(e) = check_body(got, exp) {
                    problems.push(format!("event {id}: {e}"));
                }
            }
        }
    }
    for (id, n) in &seen {
        if *n > 1 {
            problems.push(format!("event {id} received {n} times"));
        }
    }
    for e in expected {
        if !seen.contains_key(&e.id) {
            problems.push(format!("event {} ({}) never received", e.id, e.event_type));
        }
    }
    assert!(
        problems.is_empty(),
        "{} requests, {} expected; problems (first 20):\n{}",
        received.len(),
        expected.len(),
        problems
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    for got in received {
        assert!(
            (200..300).contains(&got.status),
            "the sink answered {}",
            got.status
        );
    }
}

/// Ids in arrival order.
fn arrival_ids(received: &[Received]) -> Vec<String> {
    received.iter().filter_map(|r| body_id(&r.body)).collect()
}

/// The pid of the walsender holding `slot`.
async fn active_pid(db: &Client, slot: &str) -> anyhow::Result<Option<i32>> {
    Ok(db
        .query_one(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?
        .get(0))
}

/// Starts a cluster of this test's own (initdb is blocking).
async fn dedicated_cluster(opts: ClusterOptions) -> anyhow::Result<PgCluster> {
    tokio::task::spawn_blocking(move || PgCluster::start(opts)).await?
}

/// The oracle itself: `check_body`/`assert_exact` accept the exact body and
/// reject near misses (no PostgreSQL needed).
#[test]
fn body_oracle_rejects_near_misses() {
    use hmac::{Hmac, Mac};
    let signed = |body: &str, id: &str| {
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(TEST_SECRET.as_bytes()).expect("key");
        mac.update(body.as_bytes());
        Received {
            body: axum::body::Bytes::copy_from_slice(body.as_bytes()),
            signature: Some(hex::encode(mac.finalize().into_bytes())),
            idempotency_key: Some(id.to_owned()),
            content_type: Some("application/json".into()),
            status: 204,
            at: std::time::Instant::now(),
        }
    };
    let exp = |payload: Option<&str>| Expected {
        id: "e1".into(),
        event_type: "T\"x".into(),
        payload: payload.map(str::to_owned),
        aggregate: "a".into(),
    };
    let good = r#"{"id":"e1","type":"T\"x","data":{"a": 1}}"#;
    assert_eq!(
        check_body(&signed(good, "e1"), &exp(Some(r#"{"a": 1}"#))),
        Ok(())
    );
    // Escaping the type differently is still the same JSON string.
    let alt = r#"{"id":"e1","type":"T\u0022x","data":{"a": 1}}"#;
    assert_eq!(
        check_body(&signed(alt, "e1"), &exp(Some(r#"{"a": 1}"#))),
        Ok(())
    );
    for (bad, payload) in [
        (
            r#"{"id":"e1","type":"T\"x","data":{"a":1}}"#,
            Some(r#"{"a": 1}"#),
        ),
        (r#"{"id":"e1","type":"T\"x","data":""}"#, None),
        (r#"{"id":"e1","type":"T\"x","data":null}"#, Some(r#""""#)),
        (r#"{"id":"e1","type":"T","x":"x","data":null}"#, None),
        (r#"{"id":"e1","type":"T\"y","data":null}"#, None),
        (r#"{"id":"e1","type":"T\"x","data":null} "#, None),
        (r#"{"id":"e2","type":"T\"x","data":null}"#, None),
    ] {
        assert!(
            check_body(&signed(bad, "e1"), &exp(payload)).is_err(),
            "{bad}"
        );
    }
    let mut unsigned = signed(good, "e1");
    unsigned.signature = Some("0".repeat(64));
    assert!(check_body(&unsigned, &exp(Some(r#"{"a": 1}"#))).is_err());
    let once = [signed(good, "e1")];
    assert_exact(&once, &[exp(Some(r#"{"a": 1}"#))]);
    for received in [vec![], vec![signed(good, "e1"), signed(good, "e1")]] {
        let r = std::panic::catch_unwind(|| assert_exact(&received, &[exp(Some(r#"{"a": 1}"#))]));
        assert!(r.is_err(), "{} requests accepted", received.len());
    }
}

// ---------------------------------------------------------------------------
// Transactions
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_inserts_in_one_transaction_keep_per_aggregate_order() -> anyhow::Result<()>
{
    let b = Bench::start().await?;
    let mut aggregates = Vec::new();
    for _ in 0..50 {
        aggregates.push(b.order().await?);
    }
    b.db.execute(
        "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), ($1::uuid[])[1 + g % 50], 'Seq', \
                jsonb_build_object('seq', g, 'pad', repeat('x', g % 13)) \
         FROM generate_series(1, 20000) g ORDER BY g",
        &[&aggregates],
    )
    .await?;
    // The heap of a fresh table fills in insertion order: check that the
    // rows went in by seq, so seq order is the stream's (commit) order.
    let rows = b
        .db
        .query(
            "SELECT id::text, event_type, payload::text, aggregate_id::text, (payload->>'seq')::int \
             FROM outbox ORDER BY ctid",
            &[],
        )
        .await?;
    let seqs: Vec<i32> = rows.iter().map(|r| r.get(4)).collect();
    assert_eq!(seqs, (1..=20000).collect::<Vec<i32>>(), "insertion order");
    let expected: Vec<Expected> = rows
        .iter()
        .map(|r| Expected {
            id: r.get(0),
            event_type: r.get(1),
            payload: r.get(2),
            aggregate: r.get(3),
        })
        .collect();

    b.expect_exactly(&expected).await?;

    // Per aggregate, arrival order is commit order.
    let position: HashMap<&str, usize> = expected
        .iter()
        .enumerate()
        .map(|(i, e)| (e.id.as_str(), i))
        .collect();
    let mut per_aggregate: HashMap<&str, Vec<usize>> = HashMap::new();
    for id in arrival_ids(&b.sink.received()) {
        let i = position[id.as_str()];
        per_aggregate
            .entry(expected[i].aggregate.as_str())
            .or_default()
            .push(i);
    }
    assert_eq!(per_aggregate.len(), 50);
    for (aggregate, order) in &per_aggregate {
        assert_eq!(order.len(), 400, "aggregate {aggregate}");
        if let Some(w) = order.windows(2).find(|w| w[0] > w[1]) {
            panic!(
                "aggregate {aggregate}: seq {} arrived before seq {}",
                w[0] + 1,
                w[1] + 1
            );
        }
    }
    b.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolled_back_transactions_and_savepoints_deliver_only_survivors() -> anyhow::Result<()> {
    let b = Bench::start().await?;
    let agg = b.order().await?;

    // A rolled-back transaction: nothing.
    b.db.batch_execute("BEGIN").await?;
    for i in 0..3 {
        b.insert(agg, "RolledBack", Some(&format!(r#"{{"i":{i}}}"#)))
            .await?;
    }
    b.db.batch_execute("ROLLBACK").await?;
    b.settle().await?;
    assert_eq!(b.sink.count(), 0, "a rolled-back transaction delivered");

    // A transaction that errors out (aborted, then rolled back): nothing.
    b.db.batch_execute("BEGIN").await?;
    b.insert(agg, "Aborted", Some("{}")).await?;
    assert!(b.db.batch_execute("SELECT 1/0").await.is_err());
    b.db.batch_execute("ROLLBACK").await?;

    // Savepoints inside a committed transaction: only the survivors, in order.
    let mut expected = Vec::new();
    b.db.batch_execute("BEGIN").await?;
    expected.push(b.insert(agg, "Kept", Some(r#"{"n":1}"#)).await?);
    b.db.batch_execute("SAVEPOINT a").await?;
    b.insert(agg, "Discarded", Some(r#"{"n":2}"#)).await?;
    b.db.batch_execute("SAVEPOINT nested").await?;
    b.insert(agg, "Discarded", Some(r#"{"n":3}"#)).await?;
    b.db.batch_execute("ROLLBACK TO SAVEPOINT a").await?;
    expected.push(b.insert(agg, "Kept", Some(r#"{"n":4}"#)).await?);
    b.db.batch_execute("SAVEPOINT b").await?;
    expected.push(b.insert(agg, "Kept", Some(r#"{"n":5}"#)).await?);
    b.db.batch_execute("RELEASE SAVEPOINT b").await?;
    b.db.batch_execute("SAVEPOINT c").await?;
    b.insert(agg, "Discarded", Some(r#"{"n":6}"#)).await?;
    b.db.batch_execute("ROLLBACK TO SAVEPOINT c").await?;
    b.db.batch_execute("COMMIT").await?;

    // A rolled-back transaction whose subtransaction was released: nothing.
    b.db.batch_execute("BEGIN").await?;
    b.db.batch_execute("SAVEPOINT s").await?;
    b.insert(agg, "RolledBack", Some("{}")).await?;
    b.db.batch_execute("RELEASE SAVEPOINT s").await?;
    b.db.batch_execute("ROLLBACK").await?;

    let last = b.insert(agg, "Last", Some("[]")).await?;
    expected.push(last);
    b.expect_exactly(&expected).await?;
    // One aggregate: arrival order is commit order.
    let ids: Vec<String> = expected.iter().map(|e| e.id.clone()).collect();
    assert_eq!(arrival_ids(&b.sink.received()), ids);
    b.finish().await
}

/// On a cluster of its own: a prepared transaction left behind by a failing
/// test would block every later slot creation on a shared cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_transactions_deliver_only_after_commit_prepared() -> anyhow::Result<()> {
    let cluster = dedicated_cluster(ClusterOptions::default()).await?;
    let stack = cluster.create_stack().await?;
    let b = Bench::start_on(stack).await?;
    let agg = b.order().await?;
    let gid_commit = format!("stream-commit-{}", Uuid::new_v4());
    let gid_rollback = format!("stream-rollback-{}", Uuid::new_v4());

    b.db.batch_execute("BEGIN").await?;
    let p1 = b.insert(agg, "Prepared", Some(r#"{"p":1}"#)).await?;
    let p2 = b.insert(agg, "Prepared", Some(r#"{"p":2}"#)).await?;
    b.db.batch_execute(&format!("PREPARE TRANSACTION '{gid_commit}'"))
        .await?;

    b.db.batch_execute("BEGIN").await?;
    b.insert(agg, "PreparedThenRolledBack", Some(r#"{"p":3}"#))
        .await?;
    b.db.batch_execute(&format!("PREPARE TRANSACTION '{gid_rollback}'"))
        .await?;

    // Other work commits meanwhile and is delivered; the prepared ones are not.
    let other_agg = b.order().await?;
    let before = b.insert(other_agg, "Committed", Some(r#"{"c":1}"#)).await?;
    b.expect_exactly(std::slice::from_ref(&before)).await?;

    b.db.batch_execute(&format!("COMMIT PREPARED '{gid_commit}'"))
        .await?;
    b.db.batch_execute(&format!("ROLLBACK PREPARED '{gid_rollback}'"))
        .await?;
    let after = b.insert(other_agg, "Committed", Some(r#"{"c":2}"#)).await?;
    b.expect_exactly(&[before, p1.clone(), p2.clone(), after])
        .await?;
    let ids = arrival_ids(&b.sink.received());
    let pos = |id: &str| ids.iter().position(|x| x == id);
    assert!(pos(&p1.id) < pos(&p2.id), "p1 before p2: {ids:?}");
    b.finish().await?;
    drop(cluster);
    Ok(())
}

/// A 1,000,000-row DELETE is decoded (and skipped: the publication publishes
/// inserts only) for a while with no data for the relay. With
/// `wal_sender_timeout = 2s` the session must survive it, and the insert
/// after it must arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn million_row_delete_does_not_time_out_the_walsender() -> anyhow::Result<()> {
    let cluster = dedicated_cluster(ClusterOptions {
        wal_sender_timeout: "2s".into(),
        ..ClusterOptions::default()
    })
    .await?;
    let stack = cluster.create_stack().await?;
    let db = stack.orders_admin().await?;
    let agg = new_order(&db).await?;
    // Loaded before the slot exists, so none of these rows is an event. The
    // rows all reference one existing order: skipping the FK triggers for
    // the load only saves time.
    let started = std::time::Instant::now();
    db.batch_execute("SET session_replication_role = replica")
        .await?;
    db.execute(
        "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), $1, 'Bulk', '{}' FROM generate_series(1, 1000000)",
        &[&agg],
    )
    .await?;
    db.batch_execute("RESET session_replication_role").await?;
    eprintln!("loaded 1,000,000 rows in {:?}", started.elapsed());

    let mut b = Bench::start_on(stack).await?;
    let pid_before = active_pid(&b.db, &b.stack.slot).await?;

    let started = std::time::Instant::now();
    let deleted = b.db.execute("DELETE FROM outbox", &[]).await?;
    assert_eq!(deleted, 1_000_000);
    let last = b
        .insert(agg, "AfterDelete", Some(r#"{"after":"delete"}"#))
        .await?;
    if let Err(e) = b.expect_exactly(std::slice::from_ref(&last)).await {
        let relay_log = b.relay.process.logs();
        let tail: Vec<&str> = relay_log.lines().rev().take(40).collect();
        anyhow::bail!(
            "{e:#}\n{}\n--- relay (last 40 lines, newest first) ---\n{}",
            cluster.log_tail(40),
            tail.join("\n")
        );
    }
    eprintln!(
        "delete decoded and the next insert delivered in {:?}",
        started.elapsed()
    );

    let log = cluster.log_contents();
    assert!(
        !log.contains("terminating walsender process due to replication timeout"),
        "walsender timed out:\n{}",
        cluster.log_tail(40)
    );
    assert_eq!(
        active_pid(&b.db, &b.stack.slot).await?,
        pid_before,
        "the walsender changed"
    );
    let relay_log = b.relay.process.logs();
    assert!(
        !relay_log.contains("reconnecting"),
        "the relay reconnected:\n{relay_log}"
    );
    stop_relay(&mut b.relay).await?;
    drop(b);
    drop(cluster);
    Ok(())
}

// ---------------------------------------------------------------------------
// Decode stream edge cases
// ---------------------------------------------------------------------------

/// An enum column makes pgoutput send a Type message before the Relation;
/// TRUNCATE (not published; then published) between inserts changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enum_column_and_truncate_between_inserts() -> anyhow::Result<()> {
    let b = Bench::start().await?;
    let agg = b.order().await?;
    let mut expected = vec![b.insert(agg, "BeforeEnum", Some(r#"{"k":0}"#)).await?];

    b.db.batch_execute(
        "CREATE TYPE stream_mood AS ENUM ('calm', 'stormy'); \
         ALTER TABLE outbox ADD COLUMN mood stream_mood",
    )
    .await?;
    expected.push(b.insert(agg, "WithEnum", Some(r#"{"k":1}"#)).await?);
    b.db.execute(
        "UPDATE outbox SET mood = 'stormy' WHERE id = $1::text::uuid",
        &[&expected[1].id],
    )
    .await?;
    let row =
        b.db.query_one(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload, mood) \
             VALUES (gen_random_uuid(), $1, 'EnumSet', '{\"k\":2}', 'calm') \
             RETURNING id::text, event_type, payload::text, aggregate_id::text",
            &[&agg],
        )
        .await?;
    expected.push(Expected {
        id: row.get(0),
        event_type: row.get(1),
        payload: row.get(2),
        aggregate: row.get(3),
    });
    // The enum grows while streaming (the Type message is sent again).
    b.db.batch_execute("ALTER TYPE stream_mood ADD VALUE 'sunny'")
        .await?;
    let row =
        b.db.query_one(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload, mood) \
             VALUES (gen_random_uuid(), $1, 'EnumGrown', '{\"k\":3}', 'sunny') \
             RETURNING id::text, event_type, payload::text, aggregate_id::text",
            &[&agg],
        )
        .await?;
    expected.push(Expected {
        id: row.get(0),
        event_type: row.get(1),
        payload: row.get(2),
        aggregate: row.get(3),
    });
    b.expect_exactly(&expected).await?;

    // TRUNCATE between two inserts, as its own transaction and inside one.
    b.db.batch_execute("TRUNCATE outbox").await?;
    expected.push(b.insert(agg, "AfterTruncate", Some(r#"{"k":4}"#)).await?);
    b.db.batch_execute("BEGIN").await?;
    expected.push(b.insert(agg, "TruncatedLater", Some(r#"{"k":5}"#)).await?);
    b.db.batch_execute("TRUNCATE outbox").await?;
    expected.push(
        b.insert(agg, "AfterTruncateInTx", Some(r#"{"k":6}"#))
            .await?,
    );
    b.db.batch_execute("COMMIT").await?;
    b.expect_exactly(&expected).await?;

    // Now with truncates published: Truncate messages reach the relay.
    b.db.batch_execute(&format!(
        "ALTER PUBLICATION {} SET (publish = 'insert, truncate')",
        b.stack.publication
    ))
    .await?;
    expected.push(b.insert(agg, "BeforePublishedTruncate", Some("{}")).await?);
    b.db.batch_execute("TRUNCATE outbox").await?;
    b.db.batch_execute("BEGIN").await?;
    expected.push(b.insert(agg, "InTruncatingTx", Some("[1]")).await?);
    b.db.batch_execute("TRUNCATE outbox, orders CASCADE")
        .await?;
    b.db.batch_execute("ROLLBACK").await?;
    b.db.batch_execute("BEGIN").await?;
    expected.push(b.insert(agg, "InTruncatingTx", Some("[2]")).await?);
    b.db.batch_execute("TRUNCATE outbox").await?;
    b.db.batch_execute("COMMIT").await?;
    expected.retain(|e| e.payload.as_deref() != Some("[1]"));
    expected.push(b.insert(agg, "AfterPublishedTruncate", Some("{}")).await?);
    b.expect_exactly(&expected).await?;
    b.finish().await
}

/// Transactional and non-transactional logical decoding messages (the
/// transport asks for them with `messages 'true'`) are never posted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logical_messages_around_inserts_are_not_posted() -> anyhow::Result<()> {
    let b = Bench::start().await?;
    let agg = b.order().await?;
    let emit = |transactional: bool, content: &'static str| {
        let db = &b.db;
        async move {
            db.execute(
                &format!(
                    "SELECT pg_logical_emit_message({transactional}, 'stream-test', {content})"
                ),
                &[],
            )
            .await
        }
    };
    let big = "repeat('m', 100000)";
    let mut expected = Vec::new();

    // Before any insert.
    emit(false, "''").await?;
    emit(true, "''").await?;
    emit(false, big).await?;
    emit(true, big).await?;
    emit(false, "'\\xff00fe'::bytea").await?;
    // Around inserts, in one transaction.
    b.db.batch_execute("BEGIN").await?;
    emit(true, "''").await?;
    expected.push(b.insert(agg, "Between", Some(r#"{"m":1}"#)).await?);
    emit(true, big).await?;
    emit(false, big).await?;
    emit(false, "''").await?;
    expected.push(b.insert(agg, "Between", Some(r#"{"m":2}"#)).await?);
    emit(true, "'\\x00'::bytea").await?;
    b.db.batch_execute("COMMIT").await?;
    // Non-transactional messages from a transaction that rolls back are
    // still sent; the insert is not.
    b.db.batch_execute("BEGIN").await?;
    b.insert(agg, "RolledBack", Some("{}")).await?;
    emit(false, big).await?;
    emit(true, big).await?;
    b.db.batch_execute("ROLLBACK").await?;
    // Between and after.
    emit(false, "''").await?;
    expected.push(b.insert(agg, "After", Some(r#"{"m":3}"#)).await?);
    emit(true, big).await?;
    emit(false, big).await?;
    b.expect_exactly(&expected).await?;
    let ids: Vec<String> = expected.iter().map(|e| e.id.clone()).collect();
    assert_eq!(arrival_ids(&b.sink.received()), ids);
    b.finish().await
}

/// Inserts into another published table, and transactions carrying a
/// replication origin (pgoutput sends an Origin message), are not events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_published_tables_and_origin_messages_are_not_posted() -> anyhow::Result<()> {
    let b = Bench::start().await?;
    b.db.batch_execute(&format!(
        "ALTER PUBLICATION {} ADD TABLE orders",
        b.stack.publication
    ))
    .await?;
    let mut expected = Vec::new();
    // Orders rows (published now) before, with and after outbox rows.
    let lone = b.order().await?;
    b.db.batch_execute("BEGIN").await?;
    let agg = b.order().await?;
    expected.push(b.insert(agg, "WithOrder", Some(r#"{"o":1}"#)).await?);
    b.order().await?;
    b.db.batch_execute("COMMIT").await?;

    // A session with a replication origin: its transactions carry Origin.
    let origin = format!("stream_origin_{}", Uuid::new_v4().simple());
    b.db.execute("SELECT pg_replication_origin_create($1)", &[&origin])
        .await?;
    b.db.execute("SELECT pg_replication_origin_session_setup($1)", &[&origin])
        .await?;
    b.db.batch_execute("BEGIN").await?;
    b.db.batch_execute("SELECT pg_replication_origin_xact_setup('0/1', now())")
        .await?;
    expected.push(b.insert(agg, "FromOrigin", Some(r#"{"o":2}"#)).await?);
    b.db.batch_execute("COMMIT").await?;
    expected.push(
        b.insert(lone, "FromOriginAutocommit", Some(r#"{"o":3}"#))
            .await?,
    );
    b.db.batch_execute("SELECT pg_replication_origin_session_reset()")
        .await?;
    b.db.execute("SELECT pg_replication_origin_drop($1)", &[&origin])
        .await?;

    expected.push(b.insert(lone, "After", Some(r#"{"o":4}"#)).await?);
    b.db.batch_execute("UPDATE orders SET amount_cents = amount_cents + 1")
        .await?;
    b.expect_exactly(&expected).await?;
    b.finish().await
}

/// Columns are resolved by name from the latest Relation message: added,
/// dropped and re-added (which moves them to the end) while streaming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_added_dropped_and_readded_while_streaming() -> anyhow::Result<()> {
    let b = Bench::start().await?;
    let agg = b.order().await?;
    let mut expected = vec![b.insert(agg, "Original", Some(r#"{"v":0}"#)).await?];
    b.expect_exactly(&expected).await?;

    b.db.batch_execute("ALTER TABLE outbox ADD COLUMN note text DEFAULT 'n'")
        .await?;
    expected.push(b.insert(agg, "Added", Some(r#"{"v":1}"#)).await?);
    b.db.batch_execute("ALTER TABLE outbox DROP COLUMN attempts, DROP COLUMN claimed_by")
        .await?;
    expected.push(b.insert(agg, "Dropped", Some(r#"{"v":2}"#)).await?);
    // Re-added columns move to the end of the row.
    b.db.batch_execute(
        "ALTER TABLE outbox DROP COLUMN event_type, ADD COLUMN event_type text NOT NULL DEFAULT 'x'",
    )
    .await?;
    expected.push(b.insert(agg, "TypeMoved", Some(r#"{"v":3}"#)).await?);
    b.db.batch_execute("ALTER TABLE outbox DROP COLUMN payload, ADD COLUMN payload jsonb")
        .await?;
    expected.push(b.insert(agg, "PayloadMoved", Some(r#"{"v":4}"#)).await?);
    b.db.batch_execute("ALTER TABLE outbox DROP COLUMN id, ADD COLUMN id uuid PRIMARY KEY DEFAULT gen_random_uuid()")
        .await?;
    expected.push(b.insert(agg, "IdMoved", Some(r#"{"v":5}"#)).await?);
    b.db.batch_execute("ALTER TABLE outbox DROP COLUMN note")
        .await?;
    expected.push(b.insert(agg, "NoteDropped", Some(r#"{"v":6}"#)).await?);
    let columns: Vec<String> =
        b.db.query(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = 'outbox'::regclass \
             AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        columns[columns.len() - 3..],
        ["event_type", "payload", "id"],
        "{columns:?}"
    );
    b.expect_exactly(&expected).await?;
    b.finish().await
}

/// Schema changes while the relay is stopped: the restarted session decodes
/// each insert with the schema of its time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_changed_while_the_relay_is_stopped() -> anyhow::Result<()> {
    let mut b = Bench::start().await?;
    let agg = b.order().await?;
    let mut expected = vec![b.insert(agg, "BeforeStop", Some(r#"{"s":0}"#)).await?];
    b.expect_exactly(&expected).await?;
    stop_relay(&mut b.relay).await?;

    b.db.batch_execute("ALTER TABLE outbox ADD COLUMN extra int DEFAULT 7")
        .await?;
    expected.push(b.insert(agg, "Added", Some(r#"{"s":1}"#)).await?);
    b.db.batch_execute(
        "ALTER TABLE outbox DROP COLUMN event_type, ADD COLUMN event_type text NOT NULL DEFAULT 'd'",
    )
    .await?;
    expected.push(b.insert(agg, "TypeMoved", Some(r#"{"s":2}"#)).await?);
    b.db.batch_execute("ALTER TABLE outbox DROP COLUMN extra, DROP COLUMN payload")
        .await?;
    b.db.batch_execute("ALTER TABLE outbox ADD COLUMN payload jsonb")
        .await?;
    expected.push(b.insert(agg, "PayloadMoved", Some(r#"{"s":3}"#)).await?);
    b.db.batch_execute("ALTER TABLE outbox ADD COLUMN later text")
        .await?;
    expected.push(b.insert(agg, "AddedAgain", Some(r#"{"s":4}"#)).await?);
    assert_eq!(b.sink.count(), 1);

    b.relay = app::start_relay(&b.stack, &b.sink.url, &[]).await?;
    app::wait_streaming(&b.relay).await?;
    b.expect_exactly(&expected).await?;
    let ids: Vec<String> = expected.iter().map(|e| e.id.clone()).collect();
    assert_eq!(arrival_ids(&b.sink.received()), ids);

    // And while streaming again after the restart.
    b.db.batch_execute("ALTER TABLE outbox DROP COLUMN later")
        .await?;
    expected.push(b.insert(agg, "AfterRestart", Some(r#"{"s":5}"#)).await?);
    b.expect_exactly(&expected).await?;
    b.finish().await
}

/// DDL and inserts in one transaction: each insert is decoded with the
/// schema at its command, even when a later command of the same
/// transaction drops the column it was written in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ddl_and_inserts_in_one_transaction() -> anyhow::Result<()> {
    let b = Bench::start().await?;
    let agg = b.order().await?;
    let mut expected = Vec::new();
    b.db.batch_execute("BEGIN").await?;
    expected.push(b.insert(agg, "First", Some(r#"{"t":1}"#)).await?);
    b.db.batch_execute("ALTER TABLE outbox ADD COLUMN tag text DEFAULT 'tagged'")
        .await?;
    expected.push(b.insert(agg, "AfterAdd", Some(r#"{"t":2}"#)).await?);
    b.db.batch_execute("ALTER TABLE outbox DROP COLUMN payload, ADD COLUMN payload jsonb")
        .await?;
    expected.push(b.insert(agg, "AfterMove", Some(r#"{"t":3}"#)).await?);
    b.db.batch_execute("ALTER TABLE outbox DROP COLUMN tag, DROP COLUMN event_type")
        .await?;
    b.db.batch_execute("ALTER TABLE outbox ADD COLUMN event_type text")
        .await?;
    expected.push(b.insert(agg, "AfterTypeMove", Some(r#"{"t":4}"#)).await?);
    b.db.batch_execute("COMMIT").await?;

    // A transaction whose DDL rolls back, with inserts before the rollback point.
    b.db.batch_execute("BEGIN").await?;
    expected.push(b.insert(agg, "BeforeSavepoint", Some(r#"{"t":5}"#)).await?);
    b.db.batch_execute("SAVEPOINT ddl; ALTER TABLE outbox ADD COLUMN gone int DEFAULT 1")
        .await?;
    b.insert(agg, "RolledBackWithDdl", Some(r#"{"t":6}"#))
        .await?;
    b.db.batch_execute("ROLLBACK TO SAVEPOINT ddl").await?;
    expected.push(
        b.insert(agg, "AfterDdlRollback", Some(r#"{"t":7}"#))
            .await?,
    );
    b.db.batch_execute("COMMIT").await?;

    expected.push(b.insert(agg, "Outside", Some(r#"{"t":8}"#)).await?);
    b.expect_exactly(&expected).await?;
    let ids: Vec<String> = expected.iter().map(|e| e.id.clone()).collect();
    assert_eq!(arrival_ids(&b.sink.received()), ids);
    b.finish().await
}

/// Cleanup jobs update and delete outbox rows: nothing extra is posted,
/// first with the insert-only publication, then with one that publishes
/// updates and deletes too (Update/Delete messages with key and full old
/// tuples reach the relay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_and_deletes_on_the_outbox_deliver_nothing() -> anyhow::Result<()> {
    let b = Bench::start().await?;
    let agg = b.order().await?;
    let mut expected = Vec::new();
    for i in 0..3 {
        expected.push(
            b.insert(agg, "Row", Some(&format!(r#"{{"r":{i}}}"#)))
                .await?,
        );
    }
    b.db.batch_execute(
        "UPDATE outbox SET published_at = now(), attempts = attempts + 1, claimed_by = 'cleanup'; \
         UPDATE outbox SET payload = '{\"rewritten\": true}', event_type = 'Rewritten'",
    )
    .await?;
    b.db.execute(
        "DELETE FROM outbox WHERE id = $1::text::uuid",
        &[&expected[0].id],
    )
    .await?;
    expected.push(b.insert(agg, "AfterCleanup", Some(r#"{"r":3}"#)).await?);
    b.expect_exactly(&expected).await?;

    b.db.batch_execute(&format!(
        "ALTER PUBLICATION {} SET (publish = 'insert, update, delete')",
        b.stack.publication
    ))
    .await?;
    expected.push(b.insert(agg, "Published", Some(r#"{"r":4}"#)).await?);
    b.db.batch_execute(
        "UPDATE outbox SET published_at = now(); \
         UPDATE outbox SET id = gen_random_uuid() WHERE event_type = 'Rewritten'; \
         DELETE FROM outbox WHERE event_type = 'AfterCleanup'",
    )
    .await?;
    b.db.batch_execute("ALTER TABLE outbox REPLICA IDENTITY FULL")
        .await?;
    b.db.batch_execute(
        "UPDATE outbox SET attempts = 9; \
         UPDATE outbox SET payload = jsonb_build_object('big', repeat('z', 100000)); \
         DELETE FROM outbox WHERE event_type = 'Rewritten'",
    )
    .await?;
    b.db.batch_execute("BEGIN").await?;
    expected.push(
        b.insert(agg, "InsertedThenDeleted", Some(r#"{"r":5}"#))
            .await?,
    );
    b.db.batch_execute("UPDATE outbox SET event_type = 'Changed'; DELETE FROM outbox")
        .await?;
    b.db.batch_execute("COMMIT").await?;
    expected.push(b.insert(agg, "Last", Some(r#"{"r":6}"#)).await?);
    b.expect_exactly(&expected).await?;
    b.finish().await
}

// ---------------------------------------------------------------------------
// Payloads
// ---------------------------------------------------------------------------

/// JSON shapes, unicode, huge numbers and deep nesting: `data` is the
/// payload's text exactly as PostgreSQL prints it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_are_sent_byte_identical_to_payload_text() -> anyhow::Result<()> {
    let b = Bench::start().await?;
    let deep_array = format!("{}1{}", "[".repeat(1000), "]".repeat(1000));
    let deep_object = format!("{}null{}", r#"{"a":"#.repeat(1000), "}".repeat(1000));
    let payloads: Vec<String> = [
        // Objects (key order and whitespace normalised by jsonb), arrays.
        r#"{"b": 1, "a": [1, 2, {"c": null}], "nested": {"x": "y", "aa": {}}}"#,
        r#"{ "spaced" :  [ 1 , 2 ] , "dup": 1, "dup": 2 }"#,
        "{}",
        "[]",
        r#"[1, "two", 3.0, null, true, false, [], {}]"#,
        // Scalars: strings, JSON null, booleans.
        r#""just a string""#,
        r#""quotes \" backslash \\ slash \/ controls \b\f\n\r\t \u0001 \u001f""#,
        "null",
        "true",
        "false",
        // Numbers beyond f64 and long decimals.
        "9007199254740993",
        "123456789012345678901234567890123456789012345678901234567890",
        "-9223372036854775809",
        "3.14159265358979323846264338327950288419716939937510582097494459230781640628",
        "0.000000000000000000000000000000000000001",
        "1.10000000000000000001",
        "1E+2",
        "1e400",
        "-0",
        "-0.0",
        r#"{"big": 18446744073709551617, "neg": -1.5e-300, "exact": 0.1}"#,
        // Unicode: combining marks, ZWJ emoji, U+2028/2029, BOM, astral,
        // escapes that jsonb decodes (and prints raw).
        "\"e\u{301} a\u{308}\u{323} \u{1F469}\u{200D}\u{1F469}\u{200D}\u{1F467}\u{200D}\u{1F466} \u{1F600}\"",
        "{\"ls\": \"a\u{2028}b\u{2029}c\", \"bom\": \"\u{FEFF}\", \"astral\": \"\u{1D11E}\u{10FFFD}\"}",
        r#"{"escaped": "\u2028 \u00e9 \ud83d\ude00 \u0000x"}"#,
        "{\"\u{1F600}key\": \"\u{05D0}\u{05D1} rtl \u{202E}override\"}",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([deep_array, deep_object])
    .collect();

    let mut expected = Vec::new();
    let mut rejected = Vec::new();
    for (i, p) in payloads.iter().enumerate() {
        let agg = b.order().await?;
        match b.insert(agg, "Shape", Some(p)).await {
            Ok(e) => expected.push(e),
            // jsonb refuses some inputs (\u0000); nothing to relay then.
            Err(err) => rejected.push(format!("#{i} {p:.40}: {err}")),
        }
    }
    assert_eq!(rejected.len(), 1, "only \\u0000 is refused: {rejected:?}");
    b.expect_exactly(&expected).await?;
    // The deep payloads really are 1,000 levels deep.
    let depth: i32 =
        b.db.query_one(
            "SELECT max(jsonb_array_length(payload #> array_fill('0'::text, ARRAY[999]))) \
             FROM outbox WHERE jsonb_typeof(payload) = 'array' AND payload::text LIKE '[[[%'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(depth, 1);
    b.finish().await
}

/// A `json` (not `jsonb`) payload column keeps the text as written:
/// whitespace, key order, duplicate keys, `\u0000` escapes. The relay must
/// still send it verbatim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_typed_payload_is_sent_verbatim() -> anyhow::Result<()> {
    let b = Bench::start().await?;
    b.db.batch_execute("ALTER TABLE outbox ALTER COLUMN payload TYPE json USING payload::json")
        .await?;
    let agg = b.order().await?;
    let mut expected = Vec::new();
    for p in [
        "{ \"b\" : 1,\n\t\"a\":[ 1e400 , -0.0, 1.10000000000000000001 ], \"b\": 2 }",
        r#"{"nul": "\u0000", "esc": "\ud83d\ude00 \u2028", "solidus": "\/"}"#,
        "  [ ]  ",
        "\"e\u{301}\u{2028}\u{1F600}\"",
    ] {
        let row =
            b.db.query_one(
                "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
                 VALUES (gen_random_uuid(), $1, 'Json', $2::text::json) \
                 RETURNING id::text, event_type, payload::text, aggregate_id::text",
                &[&agg, &p],
            )
            .await?;
        let e = Expected {
            id: row.get(0),
            event_type: row.get(1),
            payload: row.get(2),
            aggregate: row.get(3),
        };
        assert_eq!(e.payload.as_deref(), Some(p), "json keeps the text");
        expected.push(e);
    }
    b.expect_exactly(&expected).await?;
    b.finish().await
}

/// SQL NULL in the payload column is `"data":null`, never `""` or missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_null_payload_is_sent_as_json_null() -> anyhow::Result<()> {
    let b = Bench::start().await?;
    b.db.batch_execute("ALTER TABLE outbox ALTER COLUMN payload DROP NOT NULL")
        .await?;
    let agg = b.order().await?;
    let sql_null = b.insert(agg, "SqlNull", None).await?;
    assert_eq!(sql_null.payload, None);
    let json_null = b.insert(agg, "JsonNull", Some("null")).await?;
    let empty_string = b.insert(agg, "EmptyString", Some(r#""""#)).await?;
    // No aggregate key at all (NULL): delivered, just without an ordering key.
    b.db.batch_execute("ALTER TABLE outbox ALTER COLUMN aggregate_id DROP NOT NULL")
        .await?;
    let row =
        b.db.query_one(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), NULL, 'NoAggregate', NULL) RETURNING id::text",
            &[],
        )
        .await?;
    let no_aggregate = Expected {
        id: row.get(0),
        event_type: "NoAggregate".into(),
        payload: None,
        aggregate: String::new(),
    };
    let expected = [sql_null.clone(), json_null, empty_string, no_aggregate];
    b.expect_exactly(&expected).await?;
    let got = b
        .sink
        .received()
        .into_iter()
        .find(|r| body_id(&r.body).as_deref() == Some(sql_null.id.as_str()))
        .expect("delivered");
    assert_eq!(
        std::str::from_utf8(&got.body)?,
        format!(r#"{{"id":"{}","type":"SqlNull","data":null}}"#, sql_null.id)
    );
    b.finish().await
}

/// Quotes, backslashes and control characters in `event_type`: the body is
/// valid JSON with exactly the three keys and `type` equal to the column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_types_with_quotes_and_control_characters_are_escaped() -> anyhow::Result<()> {
    let b = Bench::start().await?;
    let all_controls: String = (1u8..0x20).chain([0x7f]).map(char::from).collect();
    let types = [
        r#"Order"Created"#.to_owned(),
        r#"back\slash\"#.to_owned(),
        "new\nline\r\nX-Injected: yes".to_owned(),
        "tab\there".to_owned(),
        all_controls,
        r#"","data":{"injected":true},"x":""#.to_owned(),
        r#"\u0000 \" not an escape"#.to_owned(),
        "</script><!--".to_owned(),
        "line\u{2028}sep\u{2029} e\u{301} \u{1F600}".to_owned(),
        String::new(),
        " ".repeat(3),
        // 100 KB of quotes, backslashes, newlines and control characters.
        "\"\\\n\u{1}x".repeat(20_000),
    ];
    let mut expected = Vec::new();
    for t in &types {
        let agg = b.order().await?;
        expected.push(b.insert(agg, t, Some(r#"{"ok":true}"#)).await?);
    }
    b.expect_exactly(&expected).await?;
    for got in b.sink.received() {
        let v: serde_json::Value = serde_json::from_slice(&got.body)?;
        let obj = v.as_object().expect("a JSON object");
        let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["data", "id", "type"]);
        let id = obj["id"].as_str().expect("id is a string");
        let exp = expected.iter().find(|e| e.id == id).expect("known id");
        assert_eq!(obj["type"].as_str(), Some(exp.event_type.as_str()));
        assert_eq!(obj["data"], serde_json::json!({"ok": true}));
    }
    b.finish().await
}

/// A 10 MB incompressible payload (stored out of line in TOAST) arrives whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_megabyte_toasted_payload_arrives_whole() -> anyhow::Result<()> {
    let b = Bench::start().await?;
    let agg = b.order().await?;
    let before = b.insert(agg, "Small", Some(r#"{"before":true}"#)).await?;
    // 8,000,000 pseudo-random bytes as base64 (newlines removed): 10.7 MB
    // of text that pglz cannot shrink, so it is stored out of line as is.
    let row = b
        .db
        .query_one(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), $1, 'Huge', jsonb_build_object( \
                        'blob', translate(encode(decode(string_agg(md5(random()::text), ''), 'hex'), 'base64'), E'\\n', ''), \
                        'n', 1) \
             FROM generate_series(1, 500000) \
             RETURNING id::text, event_type, payload::text, aggregate_id::text",
            &[&agg],
        )
        .await?;
    let huge = Expected {
        id: row.get(0),
        event_type: row.get(1),
        payload: row.get(2),
        aggregate: row.get(3),
    };
    let huge_len = huge.payload.as_ref().map_or(0, String::len);
    assert!(huge_len > 10 * 1024 * 1024, "payload is {huge_len} bytes");
    let stored: i32 =
        b.db.query_one(
            "SELECT pg_column_size(payload) FROM outbox WHERE id = $1::text::uuid",
            &[&huge.id],
        )
        .await?
        .get(0);
    assert!(
        stored > 10 * 1024 * 1024,
        "stored compressed: {stored} bytes"
    );
    let after = b.insert(agg, "Small", Some(r#"{"after":true}"#)).await?;
    b.expect_exactly(&[before, huge.clone(), after]).await?;
    let ids = arrival_ids(&b.sink.received());
    assert_eq!(ids[1], huge.id, "per-aggregate order around the huge event");
    b.finish().await
}

/// DateStyle, TimeZone, IntervalStyle and extra_float_digits set on the
/// orders database (and on the relay role in it) change nothing the relay
/// sends. Per-database settings, so nothing leaks into other tests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_and_role_settings_do_not_change_bodies() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    {
        let admin = stack.orders_admin().await?;
        let db = &stack.orders_db;
        admin
            .batch_execute(&format!(
                "ALTER DATABASE {db} SET DateStyle = 'SQL, DMY'; \
                 ALTER DATABASE {db} SET TimeZone = 'Pacific/Chatham'; \
                 ALTER DATABASE {db} SET IntervalStyle = 'sql_standard'; \
                 ALTER DATABASE {db} SET extra_float_digits = -15; \
                 ALTER ROLE cdc_relay IN DATABASE {db} SET DateStyle = 'German, YMD'; \
                 ALTER ROLE cdc_relay IN DATABASE {db} SET TimeZone = 'Asia/Kathmandu'; \
                 ALTER ROLE cdc_relay IN DATABASE {db} SET bytea_output = 'escape'"
            ))
            .await?;
    }
    let b = Bench::start_on(stack).await?;
    let shown: String = b.db.query_one("SHOW TimeZone", &[]).await?.get(0);
    assert_eq!(
        shown, "Pacific/Chatham",
        "database settings apply to new sessions"
    );
    let agg = b.order().await?;
    let mut expected = Vec::new();
    for payload in [
        r#"{"at": "2024-02-29T23:59:59.123456+00:00", "n": 12.50, "f": 0.1}"#,
        r#"[1.0, 1e-7, 100000000000000000000.000000000000000001]"#,
    ] {
        expected.push(b.insert(agg, "Settings", Some(payload)).await?);
    }
    // Values rendered by this session's settings into the payload.
    let row =
        b.db.query_one(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), $1, 'Rendered', jsonb_build_object( \
                 'ts', '2024-02-29 23:59:59.123456+00'::timestamptz, 'd', date '2024-03-05', \
                 'iv', interval '1 day 2:03:04', 'f8', 0.1::float8, 'now', now())) \
             RETURNING id::text, event_type, payload::text, aggregate_id::text",
            &[&agg],
        )
        .await?;
    expected.push(Expected {
        id: row.get(0),
        event_type: row.get(1),
        payload: row.get(2),
        aggregate: row.get(3),
    });
    assert!(
        expected[2]
            .payload
            .as_deref()
            .unwrap_or("")
            .contains("+13:45"),
        "{:?}",
        expected[2].payload
    );
    b.expect_exactly(&expected).await?;
    b.finish().await
}
