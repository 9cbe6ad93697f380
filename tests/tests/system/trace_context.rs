//! One order followed through every hop (issue 32): the W3C trace context
//! from the Orders request, stored in the outbox row, carried by each of
//! the relay's attempts, continued by Billing, every span exported over
//! OTLP/HTTP to a real receiver (`harness::otlp`, decoding with the
//! OpenTelemetry project's protobuf types).

use std::time::Duration;

use harness::app;
use harness::oracle;
use harness::otlp::{Collector, ReceivedSpan};
use harness::scenario::{Inbox, Scenario};

/// Bound for spans to reach the receiver (the exporters batch for 1 s).
const EXPORTED: Duration = Duration::from_secs(30);
const DRAIN: Duration = Duration::from_secs(60);

/// A client's `traceparent` for trace number `i`: its own trace id, span
/// id `00f067aa0ba902b7`, sampled.
fn client_traceparent(i: usize) -> (String, String) {
    let trace_id = format!("4bf92f3577b34da6a3ce929d{i:08x}");
    (format!("00-{trace_id}-00f067aa0ba902b7-01"), trace_id)
}

/// POSTs an order with `traceparent`; returns the event id.
async fn post_traced_order(
    http: &reqwest::Client,
    orders: &str,
    traceparent: Option<&str>,
) -> anyhow::Result<String> {
    let mut request = http
        .post(format!("{orders}/orders"))
        .json(&serde_json::json!({"amount_cents": 1250, "currency": "EUR"}));
    if let Some(tp) = traceparent {
        request = request.header("traceparent", tp);
    }
    let response = request.send().await?;
    anyhow::ensure!(
        response.status() == 201,
        "POST /orders: {}",
        response.status()
    );
    let body: serde_json::Value = response.json().await?;
    Ok(body["event_id"].as_str().unwrap_or_default().to_owned())
}

/// The `traceparent` of every request `sink` received, in order.
fn sent_traceparents(sink: &harness::sink::ScriptedSink) -> Vec<String> {
    sink.received()
        .iter()
        .filter_map(|r| r.traceparent.clone())
        .collect()
}

fn one<'a>(spans: &'a [ReceivedSpan], name: &str) -> &'a ReceivedSpan {
    let found: Vec<_> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "one {name} span expected: {spans:#?}");
    found[0]
}

fn traced_scenario(collector: &Collector, inbox: Inbox) -> harness::scenario::Plan {
    let endpoint = collector.endpoint();
    Scenario::plan(inbox)
        .orders()
        .relay_args(&["--otlp-endpoint", &endpoint])
        .service_env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_order_is_one_trace_from_orders_through_the_relay_into_billing() -> anyhow::Result<()>
{
    let collector = Collector::start().await?;
    let s = traced_scenario(&collector, Inbox::Billing).start().await?;
    let http = reqwest::Client::new();
    const N: usize = 5;
    let mut orders = Vec::new();
    for i in 0..N {
        let (tp, trace_id) = client_traceparent(i);
        let event_id = post_traced_order(&http, &s.orders().url, Some(&tp)).await?;
        orders.push((trace_id, event_id));
    }
    // An order without a traceparent starts its own trace.
    let untraced_event = post_traced_order(&http, &s.orders().url, None).await?;
    oracle::wait_ledger_clean(&s.stack, N + 1, DRAIN).await?;

    collector
        .wait_for("3 spans in each of the 5 traces", EXPORTED, |spans| {
            orders
                .iter()
                .all(|(trace, _)| spans.iter().filter(|s| &s.trace_id == trace).count() >= 3)
        })
        .await?;
    for (trace_id, event_id) in &orders {
        let spans = collector.trace(trace_id);
        assert_eq!(spans.len(), 3, "{spans:#?}");
        let created = one(&spans, "orders.create");
        let deliver = one(&spans, "outbox.deliver");
        let inbox = one(&spans, "billing.inbox");
        assert_eq!(created.service, "orders");
        assert_eq!(deliver.service, "cdc-relay");
        assert_eq!(inbox.service, "billing");
        // Parent ids: client → Orders → the relay's attempt → Billing.
        assert_eq!(created.parent_span_id, "00f067aa0ba902b7");
        assert_eq!(deliver.parent_span_id, created.span_id);
        assert_eq!(inbox.parent_span_id, deliver.span_id);
        assert_eq!(created.attr("outbox.event_id"), Some(event_id.as_str()));
        assert_eq!(deliver.attr("outbox.event_id"), Some(event_id.as_str()));
        assert_eq!(deliver.attr("outbox.event_type"), Some("OrderCreated"));
        assert_eq!(deliver.attr("outbox.endpoint"), Some("default"));
        assert_eq!(deliver.attr("outbox.attempt"), Some("1"));
        assert_eq!(deliver.attr("http.response.status_code"), Some("204"));
        assert!(
            deliver
                .attr("outbox.commit_lsn")
                .is_some_and(|l| l.contains('/'))
        );
        let since_commit: f64 = deliver
            .attr("outbox.commit_to_attempt_ms")
            .unwrap_or_default()
            .parse()?;
        assert!(since_commit >= 0.0, "{since_commit}");
        assert_eq!(inbox.attr("outbox.event_id"), Some(event_id.as_str()));
        assert_eq!(inbox.attr("billing.inbox"), Some("new"));
        assert_eq!(inbox.attr("billing.invoice_created"), Some("true"));
        // The hops in time order: the attempt starts after the order's
        // span began and contains Billing's.
        assert!(deliver.start_unix_nanos >= created.start_unix_nanos);
        assert!(inbox.start_unix_nanos >= deliver.start_unix_nanos);
        assert!(inbox.end_unix_nanos <= deliver.end_unix_nanos);
    }
    let untraced = collector
        .wait_for("the untraced order's trace", EXPORTED, |spans| {
            spans.iter().any(|s| {
                s.name == "billing.inbox" && s.attr("outbox.event_id") == Some(&untraced_event)
            })
        })
        .await?;
    let inbox = untraced
        .iter()
        .find(|s| s.name == "billing.inbox" && s.attr("outbox.event_id") == Some(&untraced_event))
        .expect("found above");
    let trace = collector.trace(&inbox.trace_id);
    let created = one(&trace, "orders.create");
    assert_eq!(created.parent_span_id, "", "Orders started the trace");
    assert_eq!(
        one(&trace, "outbox.deliver").parent_span_id,
        created.span_id
    );
    s.assert_balanced().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_then_a_204_are_two_attempts_in_the_same_trace() -> anyhow::Result<()> {
    let collector = Collector::start().await?;
    let s = traced_scenario(&collector, Inbox::ScriptedBilling)
        .relay_args(&[
            "--otlp-endpoint",
            &collector.endpoint(),
            "--backoff-base",
            "200ms",
        ])
        .start()
        .await?;
    s.sink().set_status(503);
    let http = reqwest::Client::new();
    let (tp, trace_id) = client_traceparent(0xa1);
    post_traced_order(&http, &s.orders().url, Some(&tp)).await?;
    harness::wait_until("the first attempt", Duration::from_secs(30), || async {
        s.sink().arrivals() >= 1
    })
    .await?;
    s.sink().set_status(204);
    oracle::wait_ledger_clean(&s.stack, 1, DRAIN).await?;

    collector
        .wait_for("two attempts and Billing's span", EXPORTED, |spans| {
            let t: Vec<_> = spans.iter().filter(|s| s.trace_id == trace_id).collect();
            t.iter().any(|s| s.name == "billing.inbox")
                && t.iter().any(|s| {
                    s.name == "outbox.deliver" && s.attr("http.response.status_code") == Some("204")
                })
        })
        .await?;
    let trace = collector.trace(&trace_id);
    let created = one(&trace, "orders.create");
    let attempts: Vec<_> = trace
        .iter()
        .filter(|s| s.name == "outbox.deliver")
        .collect();
    assert!(attempts.len() >= 2, "{trace:#?}");
    for a in &attempts {
        assert_eq!(
            a.parent_span_id, created.span_id,
            "every attempt is the order's child"
        );
    }
    let failed = attempts
        .iter()
        .find(|a| a.attr("outbox.attempt") == Some("1"))
        .expect("attempt 1");
    assert_eq!(failed.attr("http.response.status_code"), Some("503"));
    assert_eq!(failed.status_code, 2, "a failed attempt's status is error");
    assert!(failed.attr("error.type").is_some());
    let delivered = attempts
        .iter()
        .find(|a| a.attr("http.response.status_code") == Some("204"))
        .expect("the 204");
    assert!(
        delivered
            .attr("outbox.attempt")
            .unwrap_or_default()
            .parse::<u32>()?
            >= 2
    );
    assert_eq!(
        one(&trace, "billing.inbox").parent_span_id,
        delivered.span_id
    );
    // Each request named its own attempt's span, in the same trace.
    let sent = sent_traceparents(s.sink());
    assert!(
        sent.len() >= 2 && sent.iter().all(|tp| tp.contains(&trace_id)),
        "{sent:?}"
    );
    // The retry's log line names the trace.
    let logs = s.relay.process.logs();
    assert!(
        logs.lines()
            .any(|l| l.contains("will retry") && l.contains(&format!("trace_id={trace_id}"))),
        "{logs}"
    );
    s.assert_balanced().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_after_sigkill_continues_the_original_trace() -> anyhow::Result<()> {
    let collector = Collector::start().await?;
    let endpoint = collector.endpoint();
    let mut s = traced_scenario(&collector, Inbox::ScriptedBilling)
        .start()
        .await?;
    s.sink().set_delay(Duration::from_secs(30));
    let http = reqwest::Client::new();
    let (tp, trace_id) = client_traceparent(0xb2);
    post_traced_order(&http, &s.orders().url, Some(&tp)).await?;
    harness::wait_until(
        "the attempt on the wire",
        Duration::from_secs(30),
        || async { s.sink().in_progress() == 1 },
    )
    .await?;
    s.relay.process.sigkill();
    s.relay.process.wait_exit(Duration::from_secs(10)).await?;
    s.sink().set_delay(Duration::ZERO);
    s.relay = app::start_relay(&s.stack, s.inbox_url(), &["--otlp-endpoint", &endpoint]).await?;
    oracle::wait_ledger_clean(&s.stack, 1, DRAIN).await?;

    collector
        .wait_for("the redelivery's span and Billing's", EXPORTED, |spans| {
            let t: Vec<_> = spans.iter().filter(|s| s.trace_id == trace_id).collect();
            t.iter().any(|s| s.name == "outbox.deliver")
                && t.iter()
                    .any(|s| s.name == "billing.inbox" && s.attr("billing.inbox") == Some("new"))
        })
        .await?;
    let trace = collector.trace(&trace_id);
    let created = one(&trace, "orders.create");
    let redelivery = trace
        .iter()
        .find(|s| s.name == "outbox.deliver" && s.attr("http.response.status_code") == Some("204"))
        .expect("the redelivered attempt");
    assert_eq!(redelivery.parent_span_id, created.span_id);
    // Both requests, the killed one and the redelivery, carried the trace.
    let sent = sent_traceparents(s.sink());
    assert!(
        !sent.is_empty() && sent.iter().all(|tp| tp.contains(&trace_id)),
        "{sent:?}"
    );
    assert!(
        s.sink().arrivals() >= 2,
        "the killed attempt and the redelivery"
    );
    s.assert_balanced().await
}

/// A batch's request is a span `outbox.deliver_batch` in a trace of its
/// own, linked to each event's `outbox.deliver` span, which stays a child
/// of the event's stored context in the event's trace; the request's
/// `traceparent` names the batch span, so Billing's `billing.inbox` for
/// the batch is its child. (A batch request carried no `traceparent`, and
/// its events' attempts were in no trace.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_one_span_linked_to_each_events_attempt() -> anyhow::Result<()> {
    let collector = Collector::start().await?;
    let endpoint = collector.endpoint();
    let mut s = traced_scenario(&collector, Inbox::Billing).start().await?;
    // A backlog, so that requests carry batches.
    s.stop_relay().await?;
    let http = reqwest::Client::new();
    const N: usize = 12;
    let mut orders = Vec::new();
    for i in 0..N {
        let (tp, trace_id) = client_traceparent(0xba00 + i);
        let event_id = post_traced_order(&http, &s.orders().url, Some(&tp)).await?;
        orders.push((trace_id, event_id));
    }
    s.restart_relay(&[
        "--otlp-endpoint",
        &endpoint,
        "--batch-max-events",
        "64",
        "--max-in-flight",
        "1",
    ])
    .await?;
    oracle::wait_ledger_clean(&s.stack, N, DRAIN).await?;
    let spans = collector
        .wait_for("each event's attempt and a batch", EXPORTED, |spans| {
            orders.iter().all(|(trace, _)| {
                spans
                    .iter()
                    .any(|s| &s.trace_id == trace && s.name == "outbox.deliver")
            }) && spans.iter().any(|s| s.name == "outbox.deliver_batch")
        })
        .await?;
    // Each event's attempt is in its trace, under Orders' span.
    for (trace_id, event_id) in &orders {
        let trace = collector.trace(trace_id);
        let created = one(&trace, "orders.create");
        let deliver = one(&trace, "outbox.deliver");
        assert_eq!(deliver.parent_span_id, created.span_id);
        assert_eq!(deliver.attr("outbox.event_id"), Some(event_id.as_str()));
        assert_eq!(deliver.attr("http.response.status_code"), Some("204"));
    }
    let batches: Vec<&ReceivedSpan> = spans
        .iter()
        .filter(|s| s.name == "outbox.deliver_batch")
        .collect();
    let mut batched = 0;
    for batch in &batches {
        assert_eq!(batch.parent_span_id, "", "a trace of its own: {batch:#?}");
        assert!(
            orders.iter().all(|(t, _)| t != &batch.trace_id),
            "not in an event's trace"
        );
        let id = batch.attr("outbox.batch_id").expect("its batch id");
        let size: usize = batch.attr("outbox.batch_size").unwrap_or("0").parse()?;
        assert_eq!(batch.links.len(), size, "a link per event: {batch:#?}");
        assert_eq!(batch.attr("http.response.status_code"), Some("204"));
        // Each link names an event's attempt of this batch.
        for (trace, span) in &batch.links {
            let attempt = spans
                .iter()
                .find(|s| &s.trace_id == trace && &s.span_id == span)
                .unwrap_or_else(|| panic!("no span {trace}/{span}: {spans:#?}"));
            assert_eq!(attempt.name, "outbox.deliver");
            assert_eq!(attempt.attr("outbox.batch_id"), Some(id));
        }
        batched += size;
        // Billing's span for the request is the batch span's child.
        let inbox = collector
            .wait_for("Billing's span of the batch", EXPORTED, |spans| {
                spans
                    .iter()
                    .any(|s| s.name == "billing.inbox" && s.parent_span_id == batch.span_id)
            })
            .await?;
        let inbox = inbox
            .iter()
            .find(|s| s.name == "billing.inbox" && s.parent_span_id == batch.span_id)
            .expect("found above");
        assert_eq!(inbox.trace_id, batch.trace_id);
    }
    assert!(batched > 1, "events went in batches: {batches:#?}");
    s.assert_balanced().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_collector_changes_nothing_for_delivery_and_is_counted() -> anyhow::Result<()> {
    // A port nothing listens on.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        format!("http://{}", l.local_addr()?)
    };
    let s = Scenario::plan(Inbox::ScriptedBilling)
        .orders()
        .relay_args(&["--otlp-endpoint", &dead])
        .start()
        .await?;
    let http = reqwest::Client::new();
    const N: usize = 20;
    for i in 0..N {
        let (tp, _) = client_traceparent(0xc00 + i);
        post_traced_order(&http, &s.orders().url, Some(&tp)).await?;
    }
    let ledger = oracle::wait_ledger_clean(&s.stack, N, DRAIN).await?;
    assert!(ledger.is_clean(), "{ledger:?}");
    harness::wait_until("the failed exports counted", EXPORTED, || async {
        s.relay.metrics().await.is_ok_and(|m| {
            m.value(
                "cdc_relay_trace_spans_dropped_total",
                &[("reason", "export_failed")],
            )
            .unwrap_or(0.0)
                >= 1.0
        })
    })
    .await?;
    let logs = s.relay.process.logs();
    assert!(
        logs.contains("cannot export spans to the OTLP collector"),
        "{logs}"
    );
    // Each request still carried its attempt's span in the stored trace.
    let received = s.sink().received();
    assert!(received.len() >= N);
    assert!(received.iter().all(|r| {
        r.traceparent
            .as_deref()
            .is_some_and(|tp| tp.contains("4bf92f3577b34da6a3ce929d"))
    }));
    s.assert_balanced().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_exporter_the_stored_context_is_forwarded_and_bad_values_are_ignored()
-> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let aggregate = s.insert_order().await?;
    let stored = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01 congo=t61rcWkgMzE";
    let values = [
        Some(stored),
        None,
        Some("not a traceparent"),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331"),
    ];
    let mut ids = Vec::new();
    for value in values {
        let id = uuid::Uuid::new_v4();
        s.db.execute(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload, trace_context) \
             VALUES ($1, $2, 'OrderCreated', '{}', $3)",
            &[&id, &aggregate, &value],
        )
        .await?;
        ids.push(id.to_string());
    }
    harness::wait_until("4 deliveries", DRAIN, || async {
        s.sink().delivered().len() >= 4
    })
    .await?;
    let received = s.sink().delivered();
    let by_id = |id: &str| received.iter().find(|r| r.id() == id).expect("delivered");
    let first = by_id(&ids[0]);
    assert_eq!(
        first.traceparent.as_deref(),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    assert_eq!(first.tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
    for id in &ids[1..] {
        let r = by_id(id);
        assert_eq!(r.traceparent, None, "{id}: no context, no header");
        assert_eq!(r.tracestate, None);
    }
    s.settle().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_replay_and_a_backfill_continue_the_stored_trace() -> anyhow::Result<()> {
    let collector = Collector::start().await?;
    let endpoint = collector.endpoint();
    let s = Scenario::plan(Inbox::ScriptedBilling)
        .relay_args(&["--otlp-endpoint", &endpoint])
        .start()
        .await?;
    let since: String = s.db.query_one("SELECT now()::text", &[]).await?.get(0);
    let aggregate = s.insert_order().await?;
    let id = uuid::Uuid::new_v4();
    let trace_id = "5bf92f3577b34da6a3ce929d0e0e4736";
    let stored = format!("00-{trace_id}-00f067aa0ba902b7-01");
    s.sink().reject(&id.to_string(), 422);
    s.db.execute(
        "INSERT INTO outbox (id, aggregate_id, event_type, payload, trace_context) \
         VALUES ($1, $2, 'OrderCreated', \
                 jsonb_build_object('order_id', $2::uuid, 'amount_cents', 99, 'currency', 'EUR'), $3)",
        &[&id, &aggregate, &stored],
    )
    .await?;
    harness::wait_until("the refused event dead-lettered", DRAIN, || async {
        s.db.query_one(
            "SELECT count(*) FROM cdc_relay_dead_letter WHERE trace_context = $1",
            &[&stored],
        )
        .await
        .map(|r| r.get::<_, i64>(0) == 1)
        .unwrap_or(false)
    })
    .await?;
    s.settle().await?;

    // The replay's attempt is a span of the stored trace.
    s.sink().clear_rejections();
    let env = [
        ("CDC_RELAY_SINK_URL", s.inbox_url()),
        ("EVENT_SECRET", app::TEST_SECRET),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
    ];
    let out = app::relay_command(
        &s.stack,
        &s.stack.relay_url,
        &["dead-letter", "replay", "--all"],
        &env,
    )
    .await?;
    assert!(out.success(), "{}", out.text());
    let spans = collector
        .wait_for("the replay's span", EXPORTED, |spans| {
            spans.iter().any(|s| {
                s.trace_id == trace_id
                    && s.attr("outbox.dead_letter_id").is_some()
                    && s.attr("http.response.status_code") == Some("204")
            })
        })
        .await?;
    let replayed = spans
        .iter()
        .find(|s| s.trace_id == trace_id && s.attr("outbox.dead_letter_id").is_some())
        .expect("found above");
    assert_eq!(replayed.parent_span_id, "00f067aa0ba902b7");
    let last = s.sink().received().pop().expect("the replayed request");
    assert_eq!(last.id(), id.to_string());
    assert!(
        last.traceparent
            .as_deref()
            .is_some_and(|tp| tp.contains(trace_id))
    );

    // A backfill of the same row: its attempt is in the trace too.
    let before = collector.trace(trace_id).len();
    let out = app::relay_command(
        &s.stack,
        &s.stack.relay_url,
        &["backfill", "--since", &since],
        &env,
    )
    .await?;
    assert!(out.success(), "{}", out.text());
    collector
        .wait_for("the backfill's span", EXPORTED, |spans| {
            spans.iter().filter(|s| s.trace_id == trace_id).count() > before
        })
        .await?;
    let last = s.sink().received().pop().expect("the backfilled request");
    assert_eq!(last.id(), id.to_string());
    assert!(
        last.traceparent
            .as_deref()
            .is_some_and(|tp| tp.contains(trace_id))
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_table_without_the_column_still_takes_rows() -> anyhow::Result<()> {
    // A database whose sql/ was not applied since the upgrade.
    let s = Scenario::start(Inbox::Scripted).await?;
    s.db.batch_execute("ALTER TABLE cdc_relay_dead_letter DROP COLUMN trace_context")
        .await?;
    let aggregate = s.insert_order().await?;
    let id = uuid::Uuid::new_v4();
    s.sink().reject(&id.to_string(), 422);
    s.db.execute(
        "INSERT INTO outbox (id, aggregate_id, event_type, payload, trace_context) \
         VALUES ($1, $2, 'OrderCreated', '{}', '00-6bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01')",
        &[&id, &aggregate],
    )
    .await?;
    harness::wait_until("the refused event dead-lettered", DRAIN, || async {
        s.db.query_one("SELECT count(*) FROM cdc_relay_dead_letter", &[])
            .await
            .map(|r| r.get::<_, i64>(0) == 1)
            .unwrap_or(false)
    })
    .await?;
    let logs = s.relay.process.logs();
    assert!(logs.contains("no trace_context column"), "{logs}");

    // The operator's reads and the replay work on the old table too.
    let list = app::relay_command(
        &s.stack,
        &s.stack.relay_url,
        &["dead-letter", "list", "--json"],
        &[],
    )
    .await?;
    assert!(list.success(), "{}", list.text());
    assert!(list.stdout.contains(&id.to_string()), "{}", list.text());
    assert!(!list.stdout.contains("trace_context"), "{}", list.text());
    s.sink().clear_rejections();
    let env = [
        ("CDC_RELAY_SINK_URL", s.inbox_url()),
        ("EVENT_SECRET", app::TEST_SECRET),
    ];
    let replay = app::relay_command(
        &s.stack,
        &s.stack.relay_url,
        &["dead-letter", "replay", "--all"],
        &env,
    )
    .await?;
    assert!(replay.success(), "{}", replay.text());
    assert!(
        s.sink()
            .delivered()
            .iter()
            .any(|r| r.id() == id.to_string()),
        "the replayed event reached the sink"
    );
    s.settle().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_tracestate_is_cut_to_512_bytes_where_it_enters() -> anyhow::Result<()> {
    let s = Scenario::plan(Inbox::Scripted).orders().start().await?;
    let (tp, trace_id) = client_traceparent(0xd4);
    // 32 members of 256-byte keys and values: the largest W3C parsing takes.
    let state: Vec<String> = (0..32)
        .map(|i| format!("{}{i:02}={}", "k".repeat(254), "v".repeat(256)))
        .chain(["short=1".to_owned()])
        .collect();
    let response = reqwest::Client::new()
        .post(format!("{}/orders", s.orders().url))
        .header("traceparent", &tp)
        .header("tracestate", state.join(","))
        .json(&serde_json::json!({"amount_cents": 1250, "currency": "EUR"}))
        .send()
        .await?;
    assert_eq!(response.status(), 201);
    let stored: String =
        s.db.query_one("SELECT trace_context FROM outbox", &[])
            .await?
            .get(0);
    assert!(stored.contains(&trace_id), "{stored}");
    assert!(
        stored.len() <= 55 + 1 + 512,
        "{} bytes stored",
        stored.len()
    );
    harness::wait_until("the delivery", DRAIN, || async {
        s.sink().delivered().len() == 1
    })
    .await?;
    let sent = s.sink().delivered().pop().expect("delivered");
    assert!(
        sent.traceparent
            .as_deref()
            .is_some_and(|t| t.contains(&trace_id))
    );
    assert!(sent.tracestate.as_deref().map_or(0, str::len) <= 512);
    s.settle().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_column_that_is_missing_or_not_text_is_refused_at_start() -> anyhow::Result<()> {
    let stack = harness::PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let env = [
        ("CDC_RELAY_SINK_URL", "http://127.0.0.1:9/inbox"),
        ("EVENT_SECRET", app::TEST_SECRET),
    ];
    for (column, says) in [
        ("payload", "has type jsonb; it must be text or varchar"),
        (
            "no_such_column",
            "no column \"no_such_column\" (--trace-column)",
        ),
    ] {
        let out = app::relay_command(
            &stack,
            &stack.relay_url,
            &["run", "--trace-column", column],
            &env,
        )
        .await?;
        assert_eq!(out.code(), Some(3), "{column}: {}", out.text());
        assert!(out.text().contains(says), "{column}: {}", out.text());
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_trace_column_dropped_while_streaming_stops_the_relay_naming_it()
-> anyhow::Result<()> {
    let stack = harness::PgCluster::shared().create_stack().await?;
    stack
        .orders_admin()
        .await?
        .batch_execute("ALTER TABLE outbox ADD COLUMN tc text")
        .await?;
    let mut s = Scenario::plan(Inbox::Scripted)
        .on(stack)
        .relay_args(&["--trace-column", "tc"])
        .start()
        .await?;
    s.db.batch_execute("ALTER TABLE outbox DROP COLUMN tc")
        .await?;
    let aggregate = s.insert_order().await?;
    let gap = s
        .insert_event(aggregate, "OrderCreated", Some("{}"))
        .await?;
    let after = oracle::wal_position(&s.db).await?;
    let status = s.wait_refusal(after).await?;
    let logs = s.relay.process.logs();
    assert_eq!(status.code(), Some(5), "{logs}");
    assert!(
        logs.contains("no column \"tc\" (set by --trace-column)"),
        "{logs}"
    );
    s.assert_held(&["outbox"]).await?;

    // The column back: the row committed without it is of the past, and
    // is delivered untraced (its content is whole), not refused again.
    s.db.batch_execute("ALTER TABLE outbox ADD COLUMN tc text")
        .await?;
    s.restart_relay(&["--trace-column", "tc"]).await?;
    s.expect_exactly(&[gap]).await?;
    Ok(())
}

/// A trace setting Orders or Billing cannot use (gRPC asked for, an
/// endpoint that is no URL) exits 2 naming it, as the relay does, and
/// before the database is tried: the database below is unreachable, and
/// its warning must not come first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_trace_setting_stops_orders_and_billing_with_exit_2_naming_it() -> anyhow::Result<()>
{
    let unreachable = "postgres://nobody:secret@127.0.0.1:9/none";
    let cases: [(&[(&str, &str)], &str); 2] = [
        (
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ],
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
        (
            &[("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")],
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ),
    ];
    for service in ["orders", "billing"] {
        for (env, named) in cases {
            let mut command = std::process::Command::new(harness::bins::path(service));
            command
                .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
                .args(["--database-url", unreachable])
                .env("EVENT_SECRET", app::TEST_SECRET)
                .envs(env.iter().copied());
            let mut process = harness::ServiceProcess::from_command(command)?;
            let status = process.wait_exit(Duration::from_secs(30)).await?;
            let logs = process.logs();
            assert_eq!(status.code(), Some(2), "{service}, {env:?}:\n{logs}");
            assert!(logs.contains(named), "{service}, {env:?}:\n{logs}");
            assert!(
                !logs.contains("not reachable"),
                "{service}, {env:?}: the setting first:\n{logs}"
            );
        }
    }
    Ok(())
}
