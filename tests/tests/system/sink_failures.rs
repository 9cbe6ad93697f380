//! The sink misbehaves (PostgreSQL and the network are fine; see
//! `infra_faults` for those): poison events and the dead-letter table, the
//! circuit breaker with probe, the storm guard, configuration faults,
//! unreadable rows, poison answers whose bodies are any bytes, an answer
//! whose head is too large to read, and the
//! dead-letter commands (`backfill` is in `backfill.rs`). Each ends in a
//! ledger check.

use std::time::{Duration, Instant};

use harness::app::{self, CommandOutput, Running, TEST_SECRET};
use harness::oracle::{self, Ledger};
use harness::{Inbox, PgCluster, Scenario, Stack, wait_until};

pub(crate) const DRAIN: Duration = Duration::from_secs(60);

/// The relay's counter of judged delivery attempts.
const ATTEMPTS: &str = "cdc_relay_delivery_attempts_total";

pub(crate) async fn insert_order_event(db: &tokio_postgres::Client) -> anyhow::Result<String> {
    Ok(app::insert_order_event(db).await?.to_string())
}

async fn dead_letters(stack: &Stack) -> anyhow::Result<Vec<(Option<String>, Option<i32>, String)>> {
    let db = stack.orders_admin().await?;
    Ok(db
        .query(
            "SELECT event_id, http_status, error FROM cdc_relay_dead_letter ORDER BY id",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect())
}

/// Delivery attempts the relay judged `outcome` so far (`dead_letter`,
/// `retry`, `config_fault`, ...), from its own counter. An attempt is
/// counted the moment its answer is judged, before any dead-letter row is
/// written: the counter is the relay's decision, not its side effect.
async fn judged(relay: &Running, outcome: &str) -> anyhow::Result<f64> {
    let m = relay.metrics().await?;
    let by_outcome = m.sum_by(ATTEMPTS, ("outcome", outcome), "outcome");
    Ok(by_outcome.get(outcome).copied().unwrap_or(0.0))
}

/// Waits until the relay judged `more` further attempts `outcome` than
/// it had when called: evidence that it handled those answers.
async fn wait_judged(relay: &Running, outcome: &str, more: f64) -> anyhow::Result<()> {
    let target = judged(relay, outcome).await? + more;
    let what = format!("{target} delivery attempts judged {outcome}");
    wait_until(&what, Duration::from_secs(20), || async {
        judged(relay, outcome).await.map(|n| n >= target)
    })
    .await
}

/// Runs an operator command (`dead-letter ...`, `backfill ...`) as the relay
/// role, with the event secret and `sink_url`.
pub(crate) async fn cli(
    stack: &Stack,
    args: &[&str],
    sink_url: &str,
) -> anyhow::Result<CommandOutput> {
    app::relay_command(
        stack,
        &stack.relay_url,
        args,
        &[
            ("CDC_RELAY_SINK_URL", sink_url),
            ("EVENT_SECRET", TEST_SECRET),
        ],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_is_quarantined_others_flow_and_replay_delivers_once() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::ScriptedBilling).await?;
    let (stack, db, sink) = (&s.stack, &s.db, s.sink());

    let poison = uuid::Uuid::new_v4().to_string();
    sink.reject(&poison, 422);
    let order = uuid::Uuid::new_v4();
    db.batch_execute(&format!(
        "BEGIN; INSERT INTO orders (id, amount_cents, currency) VALUES ('{order}', 99, 'EUR'); \
         INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES ('{poison}', '{order}', 'OrderCreated', \
           jsonb_build_object('order_id', '{order}'::uuid, 'amount_cents', 99, 'currency', 'EUR')); COMMIT"
    ))
    .await?;
    for _ in 0..5 {
        insert_order_event(db).await?;
    }
    wait_until("the poison event quarantined", DRAIN, || async {
        dead_letters(stack).await.map(|d| d.len() == 1)
    })
    .await?;
    let dl = dead_letters(stack).await?;
    assert_eq!(dl[0].0.as_deref(), Some(poison.as_str()));
    assert_eq!(dl[0].1, Some(422));
    assert!(dl[0].2.contains("http_422"), "{}", dl[0].2);
    // The five after it are delivered; the poison one is not invoiced.
    wait_until("five invoices", DRAIN, || async {
        Ledger::read(stack).await.map(|l| l.invoices == 5)
    })
    .await?;
    // The confirmed LSN moves past the quarantined event's transaction.
    s.settle().await?;

    let list = cli(stack, &["dead-letter", "list", "--json"], &sink.url).await?;
    assert!(list.success(), "{}", list.text());
    let rows: serde_json::Value = serde_json::from_str(&list.stdout)?;
    let id = rows[0]["id"].as_i64().expect("row id");
    assert!(rows[0]["age_secs"].as_i64().is_some(), "{rows}");
    let show = cli(stack, &["dead-letter", "show", &id.to_string()], &sink.url).await?;
    let shown: serde_json::Value = serde_json::from_str(&show.stdout)?;
    assert!(
        shown["payload"].is_object(),
        "show prints the payload as JSON, not as a string: {shown}"
    );

    // Still rejected: replay keeps the row.
    let failed = cli(
        stack,
        &["dead-letter", "replay", &id.to_string()],
        &sink.url,
    )
    .await?;
    assert!(!failed.success(), "{}", failed.text());
    assert_eq!(dead_letters(stack).await?.len(), 1);
    // Billing fixed: replay delivers once and removes the row with an audit entry.
    sink.clear_rejections();
    let ok = cli(stack, &["dead-letter", "replay", "--all"], &sink.url).await?;
    assert!(ok.success(), "{}", ok.text());
    assert!(dead_letters(stack).await?.is_empty());
    let audit: i64 = db
        .query_one(
            "SELECT count(*) FROM cdc_relay_dead_letter_audit WHERE action = 'replay'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(audit, 1);
    let ledger = oracle::wait_ledger_clean(stack, 6, DRAIN).await?;
    assert_eq!(ledger.invoices, 6);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn circuit_opens_probes_slowly_and_recovers_within_a_probe_interval() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::ScriptedBilling).await?;
    let (sink, relay) = (s.sink(), &s.relay);
    sink.set_status(503);
    for _ in 0..50 {
        insert_order_event(&s.db).await?;
    }
    wait_until("the circuit opens", Duration::from_secs(20), || async {
        relay.process.logs().contains("circuit opened")
    })
    .await?;
    // Time is the subject: the request rate the failing sink sees while the
    // circuit is open, over 5 s, after 1 s for requests sent before it
    // opened to come back.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = sink.arrivals();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let rate = (sink.arrivals() - before) as f64 / 5.0;
    eprintln!("requests/s to the failing sink with the circuit open: {rate:.1}");
    assert!(rate <= 3.0, "{rate} requests/s while open");
    assert_eq!(
        relay.metrics().await?.value("cdc_relay_circuit_state", &[]),
        Some(1.0),
        "gauge shows open"
    );
    let ready = reqwest::get(format!("{}/readyz", relay.url)).await?;
    assert_eq!(
        ready.status().as_u16(),
        503,
        "not ready while the circuit is open"
    );

    let recovered = Instant::now();
    sink.set_status(204);
    wait_until(
        "first delivery after recovery",
        Duration::from_secs(5),
        || async { !sink.delivered().is_empty() },
    )
    .await?;
    let first = recovered.elapsed();
    eprintln!("first 2xx {:?} after the sink recovered", first);
    assert!(first <= Duration::from_millis(1200), "{first:?}");
    oracle::wait_ledger_clean(&s.stack, 50, DRAIN).await?;
    assert!(
        dead_letters(&s.stack).await?.is_empty(),
        "transient failures never dead-letter"
    );
    wait_until("the circuit closes", Duration::from_secs(5), || async {
        relay.process.logs().contains("circuit closed")
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_storm_stops_quarantining_and_config_faults_never_dead_letter() -> anyhow::Result<()>
{
    let s = Scenario::plan(Inbox::ScriptedBilling)
        .relay_args(&["--poison-storm-threshold", "5"])
        .start()
        .await?;
    let (stack, sink, relay) = (&s.stack, s.sink(), &s.relay);
    sink.set_status(422); // a broken sink that refuses everything
    for _ in 0..30 {
        insert_order_event(&s.db).await?;
    }
    wait_until("the storm guard trips", Duration::from_secs(20), || async {
        relay.process.logs().contains("poison storm")
    })
    .await?;
    // No sleep proves that quarantining stopped; the relay's own verdicts
    // do. Four events were judged poison before the fifth distinct one
    // tripped the guard, and the refusals it judges after that are retries.
    wait_judged(relay, "retry", 2.0).await?;
    assert_eq!(
        judged(relay, "dead_letter").await?,
        4.0,
        "quarantining stops at the threshold"
    );
    wait_until("the four dead-letter rows", DRAIN, || async {
        dead_letters(stack).await.map(|d| d.len() >= 4)
    })
    .await?;
    assert_eq!(
        dead_letters(stack).await?.len(),
        4,
        "quarantining stops at the threshold"
    );

    // Now a configuration fault: judged as one, still nothing dead-lettered.
    // The relay logs "rejects the relay itself" only when a configuration
    // fault opens the circuit, and the storm opened it already, so the log
    // cannot tell; its counter can. Every configuration fault in it comes
    // after the switch: no 422 is ever judged one.
    assert_eq!(
        judged(relay, "config_fault").await?,
        0.0,
        "422s are poison or retries, never configuration faults"
    );
    sink.set_status(401);
    wait_judged(relay, "config_fault", 2.0).await?;
    assert_eq!(judged(relay, "dead_letter").await?, 4.0);
    assert_eq!(dead_letters(stack).await?.len(), 4);

    sink.set_status(204);
    wait_until("26 invoices once the sink is fixed", DRAIN, || async {
        Ledger::read(stack).await.map(|l| l.invoices == 26)
    })
    .await?;
    assert_eq!(dead_letters(stack).await?.len(), 4);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_fault_opens_the_circuit_and_keeps_events() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (sink, relay) = (s.sink(), &s.relay);
    sink.set_status(401);
    let event = insert_order_event(&s.db).await?;
    wait_until(
        "the config fault is reported",
        Duration::from_secs(20),
        || async { relay.process.logs().contains("rejects the relay itself") },
    )
    .await?;
    // The first 401 opened the circuit; a probe's 401 is judged the same.
    wait_judged(relay, "config_fault", 2.0).await?;
    assert_eq!(judged(relay, "dead_letter").await?, 0.0);
    assert!(dead_letters(&s.stack).await?.is_empty());
    sink.set_status(204);
    wait_until(
        "delivered after the fix",
        Duration::from_secs(10),
        || async { sink.delivered().iter().any(|r| r.id() == event) },
    )
    .await?;

    // 415 (Billing's answer to a compressed body: a proxy compressing
    // requests) is the relay's configuration too, for every event alike.
    sink.set_status(415);
    let event = insert_order_event(&s.db).await?;
    wait_judged(relay, "config_fault", 1.0).await?;
    wait_until(
        "the 415 hint is logged",
        Duration::from_secs(20),
        || async { relay.process.logs().contains("Content-Encoding") },
    )
    .await?;
    assert_eq!(judged(relay, "dead_letter").await?, 0.0);
    assert!(dead_letters(&s.stack).await?.is_empty());
    sink.set_status(204);
    wait_until(
        "delivered after the proxy is fixed",
        Duration::from_secs(10),
        || async { sink.delivered().iter().any(|r| r.id() == event) },
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_rows_are_quarantined_instead_of_stopping() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    stack
        .orders_admin()
        .await?
        .batch_execute("ALTER TABLE outbox ALTER COLUMN event_type DROP NOT NULL")
        .await?;
    let s = Scenario::plan(Inbox::Scripted).on(stack).start().await?;
    let (db, sink) = (&s.db, s.sink());
    let order = uuid::Uuid::new_v4();
    let bad = uuid::Uuid::new_v4();
    db.batch_execute(&format!(
        "BEGIN; INSERT INTO orders (id, amount_cents, currency) VALUES ('{order}', 5, 'EUR'); \
         INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES ('{bad}', '{order}', NULL, '{{\"x\":1}}'); COMMIT"
    ))
    .await?;
    let good = insert_order_event(db).await?;
    wait_until(
        "the good event delivered",
        Duration::from_secs(20),
        || async { sink.delivered().iter().any(|r| r.id() == good) },
    )
    .await?;
    // Both transactions done: the bad row's dead letter is written, and
    // nothing for it is still on its way to the sink.
    s.settle().await?;
    let dl = dead_letters(&s.stack).await?;
    assert_eq!(dl.len(), 1);
    assert_eq!(dl[0].0.as_deref(), Some(bad.to_string().as_str()));
    assert!(
        dl[0].2.contains("NULL") && dl[0].2.contains("event_type"),
        "{}",
        dl[0].2
    );
    assert!(
        sink.received().iter().all(|r| r.id() != bad.to_string()),
        "never posted"
    );
    Ok(())
}

/// One filter (`--type` glob, `--reason`, `--since`/`--until`,
/// `--aggregate`) selects rows for `list`, `discard` and `replay`; a
/// discard by filter can be tried with `--dry-run`; `replay` keeps each
/// aggregate's order (a later event of an aggregate whose earlier one is
/// refused again is not attempted) and `--rate` paces it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_filters_select_rows_and_replay_keeps_aggregate_order() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    sink.set_status(400);
    let (a, b, c) = (
        s.insert_order().await?,
        s.insert_order().await?,
        s.insert_order().await?,
    );
    let a1 = s.insert_event(a, "OrderCreated", Some("{}")).await?;
    let a2 = s.insert_event(a, "OrderPaid", Some("{}")).await?;
    let b1 = s.insert_event(b, "OrderCreated", Some("{}")).await?;
    let c1 = s.insert_event(c, "InvoiceSent", Some("{}")).await?;
    wait_until("four dead letters", DRAIN, || async {
        dead_letters(stack).await.map(|d| d.len() == 4)
    })
    .await?;
    let listed = |args: Vec<String>| async move {
        let mut argv = vec![
            "dead-letter".to_owned(),
            "list".to_owned(),
            "--json".to_owned(),
        ];
        argv.extend(args);
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let out = cli(stack, &argv, &sink.url).await?;
        anyhow::ensure!(out.success(), "{argv:?}: {}", out.text());
        let rows: serde_json::Value = serde_json::from_str(&out.stdout)?;
        let mut ids: Vec<String> = rows
            .as_array()
            .map(|r| {
                r.iter()
                    .filter_map(|r| r["event_id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        ids.sort();
        anyhow::Ok(ids)
    };
    let sorted = |ids: &[&str]| {
        let mut v: Vec<String> = ids.iter().map(|s| (*s).to_owned()).collect();
        v.sort();
        v
    };
    let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    assert_eq!(
        listed(args(&["--type", "Order*"])).await?,
        sorted(&[&a1.id, &a2.id, &b1.id])
    );
    assert_eq!(
        listed(args(&["--aggregate", &a.to_string()])).await?,
        sorted(&[&a1.id, &a2.id])
    );
    assert_eq!(listed(args(&["--reason", "HTTP_400"])).await?.len(), 4);
    assert_eq!(
        listed(args(&["--error-contains", "HTTP_400"])).await?.len(),
        4,
        "the filter's former name still works"
    );
    assert_eq!(
        listed(args(&["--since=-infinity", "--until", "now"]))
            .await?
            .len(),
        4
    );
    assert!(listed(args(&["--since", "now"])).await?.is_empty());
    for bad in [&["--since", "2026-11-30 10:00"][..], &["--until", "soon"]] {
        let mut argv = vec!["dead-letter", "list"];
        argv.extend_from_slice(bad);
        let out = cli(stack, &argv, &sink.url).await?;
        assert_eq!(out.code(), Some(2), "{bad:?}: {}", out.text());
    }

    // Discard by filter: tried first, then done.
    let discard = [
        "dead-letter",
        "discard",
        "--type",
        "InvoiceSent",
        "--note",
        "test",
    ];
    let dry = cli(stack, &[&discard[..], &["--dry-run"]].concat(), &sink.url).await?;
    assert!(
        dry.success() && dry.text().contains(&c1.id),
        "{}",
        dry.text()
    );
    assert_eq!(
        dead_letters(stack).await?.len(),
        4,
        "a dry run removes nothing"
    );
    let none = cli(
        stack,
        &["dead-letter", "discard", "--note", "x", "--yes"],
        &sink.url,
    )
    .await?;
    assert_eq!(
        none.code(),
        Some(2),
        "no ids and no filter: {}",
        none.text()
    );
    let out = cli(stack, &[&discard[..], &["--yes"]].concat(), &sink.url).await?;
    assert!(out.success(), "{}", out.text());
    assert_eq!(listed(vec![]).await?, sorted(&[&a1.id, &a2.id, &b1.id]));

    // Replay keeps aggregate a's order: a1 refused again, so a2 waits.
    sink.set_status(204);
    sink.reject(&a1.id, 422);
    let before = sink.received().len();
    let out = cli(
        stack,
        &[
            "dead-letter",
            "replay",
            "--all",
            "--type",
            "Order*",
            "--json",
        ],
        &sink.url,
    )
    .await?;
    assert!(!out.success(), "a row was kept: {}", out.text());
    let v: serde_json::Value = serde_json::from_str(&out.stdout)?;
    let outcome = |id: &str| {
        v["rows"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["event_id"] == id))
            .map(|r| r["outcome"].as_str().unwrap_or_default().to_owned())
    };
    assert_eq!(outcome(&a1.id).as_deref(), Some("rejected"), "{v}");
    assert_eq!(outcome(&a2.id).as_deref(), Some("not_attempted"), "{v}");
    assert_eq!(outcome(&b1.id).as_deref(), Some("delivered"), "{v}");
    let sent: Vec<String> = sink.received()[before..].iter().map(|r| r.id()).collect();
    assert!(!sent.contains(&a2.id), "a2 never overtakes a1: {sent:?}");

    // Paced: two requests at 4/s are a quarter second apart at least.
    sink.clear_rejections();
    let started = Instant::now();
    let out = cli(
        stack,
        &["dead-letter", "replay", "--all", "--rate", "4/s"],
        &sink.url,
    )
    .await?;
    assert!(out.success(), "{}", out.text());
    assert!(
        started.elapsed() >= Duration::from_millis(240),
        "{:?}",
        started.elapsed()
    );
    assert!(dead_letters(stack).await?.is_empty());
    let sent: Vec<String> = sink.received()[before..].iter().map(|r| r.id()).collect();
    let (i1, i2) = (
        sent.iter().rposition(|id| *id == a1.id),
        sent.iter().position(|id| *id == a2.id),
    );
    assert!(i1 < i2, "a1 delivered before a2: {sent:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discard_leaves_an_audit_trail() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, db, sink) = (&s.stack, &s.db, s.sink());
    sink.set_status(400);
    let event = insert_order_event(db).await?;
    wait_until("quarantined", Duration::from_secs(20), || async {
        dead_letters(stack).await.map(|d| d.len() == 1)
    })
    .await?;
    let id: i64 = db
        .query_one("SELECT id FROM cdc_relay_dead_letter", &[])
        .await?
        .get(0);
    let id = id.to_string();
    // A note is required; without --yes (no terminal to ask on) nothing
    // is discarded. `--reason` (the note's name before 0.2) is now a
    // filter: alone it names no note, so a script written for the old
    // name stops with exit 2 and removes nothing.
    let no_reason = cli(stack, &["dead-letter", "discard", &id, "--yes"], &sink.url).await?;
    assert_eq!(no_reason.code(), Some(2), "{}", no_reason.text());
    let old_name = cli(
        stack,
        &[
            "dead-letter",
            "discard",
            &id,
            "--reason",
            "test data",
            "--yes",
        ],
        &sink.url,
    )
    .await?;
    assert_eq!(old_name.code(), Some(2), "{}", old_name.text());
    assert!(old_name.text().contains("--note"), "{}", old_name.text());
    let unconfirmed = cli(
        stack,
        &["dead-letter", "discard", &id, "--note", "test data"],
        &sink.url,
    )
    .await?;
    assert!(
        !unconfirmed.success() && unconfirmed.text().contains("--yes"),
        "{}",
        unconfirmed.text()
    );
    assert_eq!(dead_letters(stack).await?.len(), 1, "nothing discarded");
    // One missing id among several: nothing is discarded.
    let missing = cli(
        stack,
        &[
            "dead-letter",
            "discard",
            &id,
            "999999",
            "--note",
            "x",
            "--yes",
        ],
        &sink.url,
    )
    .await?;
    assert!(!missing.success() && missing.text().contains("999999"));
    assert_eq!(dead_letters(stack).await?.len(), 1, "nothing discarded");

    let out = cli(
        stack,
        &[
            "dead-letter",
            "discard",
            &id,
            "--note",
            "test data",
            "--actor",
            "alice",
            "--yes",
        ],
        &sink.url,
    )
    .await?;
    assert!(out.success(), "{}", out.text());
    assert!(dead_letters(stack).await?.is_empty());
    let row = db
        .query_one(
            "SELECT action, event_id, reason, entry->>'event_id', performed_by \
             FROM cdc_relay_dead_letter_audit",
            &[],
        )
        .await?;
    let (action, audit_event, reason, entry, actor): (
        String,
        Option<String>,
        Option<String>,
        Option<String>,
        String,
    ) = (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    assert_eq!(action, "discard");
    assert_eq!(audit_event.as_deref(), Some(event.as_str()));
    assert_eq!(reason.as_deref(), Some("test data"));
    assert_eq!(entry.as_deref(), Some(event.as_str()));
    assert_eq!(actor, "alice", "the operator, not the database role");
    Ok(())
}

/// `replay` stops at the first answer that says the sink is failing (it
/// would answer every row the same): one request reaches a 503 sink, the
/// other rows are reported not attempted and kept. `--dry-run` sends
/// nothing; `--json` gives the outcome per row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_stops_at_a_failing_sink_and_dry_run_sends_nothing() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, db, sink) = (&s.stack, &s.db, s.sink());
    sink.set_status(400);
    for _ in 0..3 {
        insert_order_event(db).await?;
    }
    wait_until("three dead letters", DRAIN, || async {
        dead_letters(stack).await.map(|d| d.len() == 3)
    })
    .await?;
    let before = sink.arrivals();
    // The slot monitor counts them for the waiting gauge (and its alert).
    let waiting = |n: f64| {
        let relay = &s.relay;
        async move {
            wait_until(
                &format!("cdc_relay_dead_letters_waiting {n}"),
                DRAIN,
                || async {
                    relay
                        .gauge("cdc_relay_dead_letters_waiting")
                        .await
                        .map(|v| v == Some(n))
                },
            )
            .await
        }
    };
    waiting(3.0).await?;

    // Without sink URL or secret: a dry run sends nothing and needs neither.
    let dry = app::relay_command(
        stack,
        &stack.relay_url,
        &["dead-letter", "replay", "--all", "--dry-run", "--json"],
        &[],
    )
    .await?;
    assert!(dry.success(), "{}", dry.text());
    let v: serde_json::Value = serde_json::from_str(&dry.stdout)?;
    assert_eq!(v["rows"].as_array().map(Vec::len), Some(3), "{v}");
    assert!(
        v["rows"]
            .as_array()
            .is_some_and(|r| r.iter().all(|r| r["outcome"] == "would_send")),
        "{v}"
    );
    assert_eq!(sink.arrivals(), before, "a dry run sends nothing");

    sink.set_status(503);
    let out = cli(stack, &["dead-letter", "replay", "--all"], &sink.url).await?;
    assert!(!out.success(), "{}", out.text());
    assert_eq!(sink.arrivals(), before + 1, "one request, then it stopped");
    assert!(
        out.text().contains("2 not attempted")
            && out.text().contains("1 not sent (sink failing)")
            && out.text().contains("0 rejected")
            && out.text().contains("the sink is failing"),
        "{}",
        out.text()
    );
    assert_eq!(dead_letters(stack).await?.len(), 3, "every row kept");

    sink.set_status(204);
    let ok = cli(
        stack,
        &["dead-letter", "replay", "--all", "--json", "--actor", "bob"],
        &sink.url,
    )
    .await?;
    assert!(ok.success(), "{}", ok.text());
    let v: serde_json::Value = serde_json::from_str(&ok.stdout)?;
    assert_eq!(v["delivered"], 3, "{v}");
    assert!(dead_letters(stack).await?.is_empty());
    let by: Vec<String> =
        s.db.query(
            "SELECT performed_by FROM cdc_relay_dead_letter_audit WHERE action = 'replay'",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(by.len() == 3 && by.iter().all(|b| b == "bob"), "{by:?}");
    waiting(0.0).await?;
    Ok(())
}

/// A poison answer (422) whose body is `body`: its dead letter is written
/// (one row, status 422), the event counts as done (the slot passes it),
/// and the events after it flow. Whatever the sink returns, writing the
/// dead letter must succeed.
async fn poison_answer_with_body_is_dead_lettered(body: Vec<u8>) -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, db, sink) = (&s.stack, &s.db, s.sink());
    let poison = uuid::Uuid::new_v4().to_string();
    sink.reject_with_body(&poison, 422, body);
    let order = uuid::Uuid::new_v4();
    db.batch_execute(&format!(
        "BEGIN; INSERT INTO orders (id, amount_cents, currency) VALUES ('{order}', 7, 'EUR'); \
         INSERT INTO outbox (id, aggregate_id, event_type, payload) \
         VALUES ('{poison}', '{order}', 'OrderCreated', '{{\"p\":1}}'); COMMIT"
    ))
    .await?;
    let mut others = Vec::new();
    for _ in 0..3 {
        others.push(insert_order_event(db).await?);
    }
    let quarantined = || async {
        let dl = dead_letters(stack).await?;
        anyhow::Ok(
            dl.iter()
                .filter(|d| d.0.as_deref() == Some(&poison))
                .count(),
        )
    };
    if let Err(err) = wait_until("the poison event's dead letter", DRAIN, || async {
        quarantined().await.map(|n| n >= 1)
    })
    .await
    {
        panic!(
            "{err:#}\n--- relay log tail ---\n{}",
            tail(&s.relay.process.logs(), 15)
        );
    }
    wait_until("the events after it delivered", DRAIN, || async {
        let ids = oracle::arrival_ids(&sink.delivered());
        others.iter().all(|o| ids.contains(o))
    })
    .await?;
    // Done: the slot passes the poison event's transaction.
    s.settle().await?;
    let dl = dead_letters(stack).await?;
    assert_eq!(dl.len(), 1, "one dead letter: {dl:?}");
    assert_eq!(dl[0].0.as_deref(), Some(poison.as_str()));
    assert_eq!(dl[0].1, Some(422));
    s.assert_balanced().await
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_answer_of_one_nul_byte_is_dead_lettered() -> anyhow::Result<()> {
    poison_answer_with_body_is_dead_lettered(vec![0]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_answer_of_100_kib_of_random_bytes_is_dead_lettered() -> anyhow::Result<()> {
    let mut body = vec![0u8; 100 * 1024];
    rand::Rng::fill(&mut rand::rng(), &mut body[..]);
    // Whatever the draw, the body holds a NUL and a byte no UTF-8 has.
    body[0] = 0;
    body[1] = 0xff;
    poison_answer_with_body_is_dead_lettered(body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_answer_of_invalid_utf8_is_dead_lettered() -> anyhow::Result<()> {
    poison_answer_with_body_is_dead_lettered(b"\xc3\x28 refused \xff\xfe \xed\xa0\x80".to_vec())
        .await
}

/// A sink on a loopback port that answers every request with `answer`
/// (raw bytes of a whole HTTP/1.1 response) once it has read the first
/// part of the request, then closes; stops when the handle is aborted.
async fn raw_sink(answer: String) -> anyhow::Result<(String, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/inbox", listener.local_addr()?);
    let sink = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut request = vec![0_u8; 64 * 1024];
                let _ = stream.read(&mut request).await;
                let _ = stream.write_all(answer.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok((url, sink))
}

/// Starts a relay delivering to `url` and commits one event.
async fn one_event_to(url: &str) -> anyhow::Result<(Stack, Running)> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let relay = app::start_relay(&stack, url, &[]).await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    app::insert_order_event(&db).await?;
    Ok((stack, relay))
}

/// A 2xx whose head the relay cannot read (150 header fields, over the
/// HTTP/1.1 client's 100) is a transport failure, retried (the sink may
/// have taken the event; its inbox deduplicates), and the log says what
/// happened and where to look, not only "message head is too large".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_head_too_large_to_read_is_named_in_the_log() -> anyhow::Result<()> {
    let mut answer = String::from("HTTP/1.1 200 OK\r\n");
    for n in 0..150 {
        answer.push_str(&format!("x-padding-{n}: a\r\n"));
    }
    answer.push_str("content-length: 0\r\n\r\n");
    let (url, sink) = raw_sink(answer).await?;
    let (_stack, relay) = one_event_to(&url).await?;
    wait_until(
        "the unreadable answer named in the log",
        Duration::from_secs(30),
        || async {
            relay
                .process
                .logs()
                .contains("response head is larger than the relay reads")
        },
    )
    .await?;
    let m = relay.metrics().await?;
    assert_eq!(m.sum("cdc_relay_events_delivered_total"), 0.0);
    let reasons = m.label_values("cdc_relay_retries_total", "reason");
    assert!(reasons.contains("transport"), "{reasons:?}");
    sink.abort();
    Ok(())
}

/// A redirect is a configuration fault (retried, never dead-lettered), and
/// the log shows where it points: the URL the operator must put in
/// `--sink-url`, without its query values. Before, it said only "the sink
/// redirects".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_shows_its_location_in_the_log() -> anyhow::Result<()> {
    let (url, sink) = raw_sink(
        "HTTP/1.1 307 Temporary Redirect\r\n\
         location: http://127.0.0.1:1/final-inbox?token=abc\r\n\
         content-length: 0\r\n\r\n"
            .to_owned(),
    )
    .await?;
    let (_stack, relay) = one_event_to(&url).await?;
    let line = relay
        .process
        .wait_for_line(
            "Location: http://127.0.0.1:1/final-inbox",
            Duration::from_secs(30),
        )
        .await?;
    assert!(!line.contains("abc"), "a query value is not logged: {line}");
    let m = relay.metrics().await?;
    assert_eq!(m.sum("cdc_relay_events_delivered_total"), 0.0);
    assert_eq!(m.sum("cdc_relay_events_dead_lettered_total"), 0.0);
    sink.abort();
    Ok(())
}
