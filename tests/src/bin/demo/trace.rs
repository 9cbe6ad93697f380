//! One order's trace, as the demo's OTLP receiver got it: Orders' request
//! span, the relay's attempt, Billing's inbox transaction, with when each
//! started (after the order's span began) and how long it took.

use std::time::Duration;

use harness::otlp::{Collector, ReceivedSpan};

/// How long the demo waits for the three spans of one order (the
/// exporters send a batch every second).
const EXPORTED: Duration = Duration::from_secs(10);

/// The hops of one order, in the order they happen.
const HOPS: [(&str, &str); 3] = [
    (
        "orders.create",
        "Orders: the request, committed with its outbox row",
    ),
    (
        "outbox.deliver",
        "cdc-relay: from the WAL to Billing (one attempt)",
    ),
    ("billing.inbox", "Billing: inbox row and invoice, committed"),
];

/// Prints one complete trace; says so when none arrived in time (tracing
/// never affects the ledger).
pub async fn print_sample(collector: &Collector) {
    let complete = |spans: &[ReceivedSpan]| sample(spans).is_some();
    let spans = match collector
        .wait_for("one order's three spans", EXPORTED, complete)
        .await
    {
        Ok(spans) => spans,
        Err(_) => {
            println!(
                "    no complete trace within {EXPORTED:?} ({} spans received)",
                collector.spans().len()
            );
            return;
        }
    };
    let Some(trace) = sample(&spans) else { return };
    let start = trace[0].start_unix_nanos;
    let ms = |nanos: u64| nanos as f64 / 1e6;
    println!(
        "    trace {}  (order's event {})",
        trace[0].trace_id,
        trace[0].attr("outbox.event_id").unwrap_or("?")
    );
    for (span, (_, what)) in trace.iter().zip(HOPS) {
        println!(
            "    +{:>7.1} ms  {:>6.1} ms  {:<15} {what}",
            ms(span.start_unix_nanos.saturating_sub(start)),
            ms(span.end_unix_nanos.saturating_sub(span.start_unix_nanos)),
            span.name,
        );
    }
    if let Some(wait) = trace[1]
        .attr("outbox.commit_to_attempt_ms")
        .and_then(|w| w.parse::<f64>().ok())
    {
        println!(
            "    (the order's commit → the relay's attempt: {wait:.1} ms, on the server's clock)"
        );
    }
}

/// The first trace with all three hops, each the parent of the next.
fn sample(spans: &[ReceivedSpan]) -> Option<[&ReceivedSpan; 3]> {
    spans
        .iter()
        .filter(|s| s.name == HOPS[0].0)
        .find_map(|created| {
            let child = |parent: &ReceivedSpan, name: &str| {
                spans.iter().find(|s| {
                    s.name == name
                        && s.trace_id == parent.trace_id
                        && s.parent_span_id == parent.span_id
                })
            };
            let deliver = child(created, HOPS[1].0)?;
            let inbox = child(deliver, HOPS[2].0)?;
            Some([created, deliver, inbox])
        })
}
