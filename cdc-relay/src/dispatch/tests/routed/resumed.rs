//! Resuming a parked endpoint (`resume = "auto"`, `dispatch::resume`) in
//! paused time: once the endpoint answers again, its parked rows are
//! replayed oldest first and removed, and it returns to live delivery only
//! when none is left — so each aggregate's events reach it in commit
//! order across parking, even with events arriving all along.
//!
//! Broken on purpose once, to show these tests can fail: with the resume
//! task skipping the hold (its final pass and the switch to live straight
//! after an ordinary pass, the lane still starting jobs), a parked write in
//! flight during the final pass was left behind and
//! `the_backlog_goes_first_then_live_delivery_in_commit_order` failed
//! ("every parked row was replayed and removed"). The store's writes take
//! 15 ms of paused time so that such a write is in flight. With the
//! dispatcher granting every hold (not refusing one while the lane's
//! backlog is still queued), `a_slow_endpoint_stays_parked_until_it_has_caught_up`
//! failed ("parked at the end of the traffic": a slow endpoint was handed
//! back every second and its backlog never parked, a defect a tester found).

use std::collections::HashMap;

use super::*;

/// Sink `a`: down (503) until `up_at`, then answers 2xx (or `poison` for
/// the events it names).
fn down_until(up_at: Instant, poison: &'static [&'static str]) -> Arc<ScriptedSink> {
    ScriptedSink::new(move |id, now| {
        let status = if now < up_at {
            503
        } else if poison.contains(&id) {
            422
        } else {
            204
        };
        (Duration::from_millis(5), status)
    })
}

/// The aggregates' events in commit order: `e{n}` is in aggregate
/// `k{n % 3}`.
fn event_n(n: usize) -> OutboxEvent {
    typed(&format!("e{n}"), "T", Some(&format!("k{}", n % 3)))
}

/// Each aggregate's ids in the order `sink` took them (2xx), by attempt
/// start.
fn taken_per_aggregate(sink: &ScriptedSink) -> HashMap<String, Vec<usize>> {
    let mut calls: Vec<Call> = sink
        .calls()
        .into_iter()
        .filter(|c| c.status == 204)
        .collect();
    calls.sort_by_key(|c| c.start);
    let mut out: HashMap<String, Vec<usize>> = HashMap::new();
    for c in calls {
        let n: usize = c.id[1..].parse().unwrap();
        out.entry(format!("k{}", n % 3)).or_default().push(n);
    }
    out
}

/// Every event `sink` took (2xx), ascending, after checking that each
/// aggregate's events reached it in commit order.
fn in_commit_order(sink: &ScriptedSink) -> Vec<usize> {
    let taken = taken_per_aggregate(sink);
    for (k, seq) in &taken {
        let mut sorted = seq.clone();
        sorted.sort_unstable();
        assert_eq!(seq, &sorted, "aggregate {k} out of commit order at a");
    }
    let mut all: Vec<usize> = taken.values().flatten().copied().collect();
    all.sort_unstable();
    all
}

fn start(a: &Arc<ScriptedSink>, b: &Arc<ScriptedSink>) -> Routed {
    Routed::start_parked(
        vec![
            ("a", Arc::clone(a), vec!["*"]),
            ("b", Arc::clone(b), vec!["*"]),
        ],
        Unrouted::DeadLetter,
        &[Duration::from_secs(10)],
        None,
        vec![park::Park::default(), park::Park::default()],
        true,
    )
}

#[tokio::test(start_paused = true)]
async fn the_backlog_goes_first_then_live_delivery_in_commit_order() {
    let t0 = Instant::now();
    let a = down_until(t0 + Duration::from_secs(60), &[]);
    let b = ScriptedSink::new(|_, _| (Duration::from_millis(5), 204));
    let mut r = start(&a, &b);
    // One transaction of two events every 20 ms for 90 s: a is down for
    // the first 60 s (parked after 10 s), then back while events keep
    // coming.
    let mut n = 0;
    let mut parked_seen = false;
    while t0.elapsed() < Duration::from_secs(90) {
        r.tx(vec![event_n(n), event_n(n + 1)]).await;
        n += 2;
        tokio::time::sleep(Duration::from_millis(20)).await;
        if n % 100 == 0 {
            parked_seen |= !r.store.parked_ids("a").is_empty();
        }
    }
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(parked_seen, "a was parked while down");
    assert!(
        r.store.parked_ids("a").is_empty(),
        "every parked row was replayed and removed"
    );
    let position = r.position();
    let (last, rows, metrics) = r.finish().await;
    assert_eq!(last, Lsn::new(100 * (n as u64 / 2)), "everything confirmed");
    assert_eq!(position, last);
    let all = in_commit_order(&a);
    assert_eq!(all, (0..n).collect::<Vec<_>>(), "each event once at a");
    let replayed = rows
        .iter()
        .filter(|r| r.endpoint.as_deref() == Some("a"))
        .count();
    assert!(replayed > 0);
    let text = metrics.render();
    for line in [
        "cdc_relay_endpoint_parked{endpoint=\"a\"} 0".to_owned(),
        format!("cdc_relay_endpoint_replayed_events_total{{endpoint=\"a\"}} {replayed}"),
    ] {
        assert!(text.contains(&line), "missing {line}");
    }
    // The last events went live: delivered, not parked.
    assert!(
        rows.iter()
            .all(|r| r.event_id.as_deref() != Some(&format!("e{}", n - 1))),
        "the last event was delivered live"
    );
    assert_eq!(ids(&b, 204).len(), n, "b took everything live");
}

#[tokio::test(start_paused = true)]
async fn a_parked_row_refused_as_poison_stays_and_its_aggregate_goes_on() {
    let t0 = Instant::now();
    // e3 is k0's second event.
    let a = down_until(t0 + Duration::from_secs(20), &["e3"]);
    let b = ScriptedSink::new(|_, _| (Duration::from_millis(5), 204));
    let mut r = start(&a, &b);
    r.tx((0..9).map(event_n).collect()).await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(r.store.parked_ids("a").is_empty(), "none left parked");
    let (last, rows, _) = r.finish().await;
    assert_eq!(last, Lsn::new(100));
    let k0 = &taken_per_aggregate(&a)["k0"];
    assert_eq!(k0, &[0, 6], "e3 refused, e6 after it");
    let e3 = rows
        .iter()
        .find(|r| r.event_id.as_deref() == Some("e3"))
        .unwrap();
    assert_eq!(e3.http_status, Some(422));
    assert!(!e3.error.starts_with("parked:"), "{}", e3.error);
    assert_eq!(e3.endpoint.as_deref(), Some("a"));
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_still_down_stays_parked_and_sees_only_probes() {
    let t0 = Instant::now();
    let a = down_until(t0 + Duration::from_secs(3600), &[]);
    let b = ScriptedSink::new(|_, _| (Duration::from_millis(5), 204));
    let mut r = start(&a, &b);
    r.tx((0..30).map(event_n).collect()).await;
    tokio::time::sleep(Duration::from_secs(15)).await;
    let before = a.calls().len();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let probes = a.calls().len() - before;
    // One probe per 500 ms probe interval at most (jittered).
    assert!(
        (1..=150).contains(&probes),
        "{probes} attempts in 60 s while parked and down"
    );
    assert_eq!(r.store.parked_ids("a").len(), 30, "all still parked");
    assert_eq!(r.position(), Lsn::new(100), "the slot moved on");
    let (_, _, metrics) = r.finish().await;
    assert!(
        metrics
            .render()
            .contains("cdc_relay_endpoint_parked{endpoint=\"a\"} 1")
    );
}

/// The final pass of a resume holds the endpoint's lane, so it must end at
/// the first failure. Here a is slow and failing (503 after 2 s), holds a
/// small window alone and is parked by its share of it; the first pass
/// finds no row committed yet, so the lane is held for the final pass,
/// which meets a failing: it must let the lane go, and a's events are
/// parked while the slot keeps moving. Broken on purpose once: with the
/// final pass retrying failures (as a regular pass does), the lane stayed
/// held, the window stayed full and the test failed on "the window stayed
/// full".
#[tokio::test(start_paused = true)]
async fn a_final_pass_that_fails_lets_the_lane_go_and_the_slot_moves() {
    let a = ScriptedSink::new(|_, _| (Duration::from_secs(2), 503));
    let b = ScriptedSink::new(|_, _| (Duration::from_millis(5), 204));
    let mut r = Routed::start_windowed(
        vec![
            ("a", Arc::clone(&a), vec!["*"]),
            ("b", Arc::clone(&b), vec!["*"]),
        ],
        Unrouted::DeadLetter,
        &[],
        None,
        vec![park::Park::default(), park::Park::default()],
        true,
        Window::new(8, 1 << 20),
    );
    let sent = tokio::time::timeout(Duration::from_secs(60), async {
        for n in 0..40 {
            r.tx(vec![event_n(n)]).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(sent.is_ok(), "the window stayed full");
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(r.position(), Lsn::new(100 * 40), "the slot moved on");
    assert_eq!(r.store.parked_ids("a").len(), 40, "every event of a parked");
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_started_parked_with_nothing_left_goes_live() {
    // Started parked (its rows replayed meanwhile by an operator): the
    // first pass finds none, and the endpoint goes live.
    let a = ScriptedSink::new(|_, _| (Duration::from_millis(5), 204));
    let b = ScriptedSink::new(|_, _| (Duration::from_millis(5), 204));
    let parked = park::Park::default();
    parked.throw("its earlier parked events wait in the dead-letter table".into());
    let mut r = Routed::a_and_b(&a, &b, parked.clone(), true);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!parked.is_parked(), "live again");
    r.tx(vec![event_n(0), event_n(1)]).await;
    let (_, rows, _) = r.finish().await;
    assert!(rows.is_empty(), "nothing parked: {rows:?}");
    assert_eq!(ids(&a, 204), ["e0", "e1"]);
}

#[tokio::test(start_paused = true)]
async fn a_slow_endpoint_stays_parked_until_it_has_caught_up() {
    // a answers 2xx, but takes 1 s: with 4 at once it takes 4 events/s,
    // and 20/s arrive for 60 s. Parked after 10 s behind, it must stay
    // parked (its events becoming parked rows, the slot moving) until the
    // traffic stops and it has taken the whole backlog; then it is live.
    let a = ScriptedSink::new(|_, _| (Duration::from_secs(1), 204));
    let b = ScriptedSink::new(|_, _| (Duration::from_millis(5), 204));
    let mut r = start(&a, &b);
    let t0 = Instant::now();
    let mut n = 0;
    let mut live_flips = 0;
    let mut was_parked = false;
    while t0.elapsed() < Duration::from_secs(60) {
        r.tx(vec![event_n(n), event_n(n + 1)]).await;
        n += 2;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let parked = r
            .metrics
            .render()
            .contains("cdc_relay_endpoint_parked{endpoint=\"a\"} 1");
        if was_parked && !parked {
            live_flips += 1;
        }
        was_parked = parked;
    }
    assert!(was_parked, "parked at the end of the traffic");
    assert_eq!(live_flips, 0, "never handed back while behind");
    let behind = r.position();
    assert!(
        behind >= Lsn::new(100 * (n as u64 / 2 - 20)),
        "the slot kept moving: {behind}"
    );
    // Traffic over: a catches up from the parked rows and goes live.
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert!(r.store.parked_ids("a").is_empty(), "backlog replayed");
    let (last, _, metrics) = r.finish().await;
    assert_eq!(last, Lsn::new(100 * (n as u64 / 2)));
    assert!(
        metrics
            .render()
            .contains("cdc_relay_endpoint_parked{endpoint=\"a\"} 0")
    );
    let mut all = in_commit_order(&a);
    all.dedup();
    assert_eq!(all.len(), n, "a took every event");
}
