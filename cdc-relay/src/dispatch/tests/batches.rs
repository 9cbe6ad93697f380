//! Batches (`batch_max_events` above 1, `docs/architecture.md#batches`)
//! against the scripted sink in paused time: batches form only under load,
//! never carry two events of one aggregate or two in flight at once for
//! it, and a refused batch is split until the refused event is alone.

use super::*;

fn batching(max_in_flight: usize, batch: usize) -> DispatchConfig {
    DispatchConfig {
        batch_max_events: batch,
        ..config(max_in_flight)
    }
}

/// Each event id a call carried (a batch's members, or the one event).
fn carried(c: &Call) -> Vec<String> {
    if c.members.is_empty() {
        vec![c.id.clone()]
    } else {
        c.members.clone()
    }
}

#[tokio::test(start_paused = true)]
async fn batches_form_under_load_and_keep_each_aggregate_one_at_a_time_in_order() {
    // 120 events over 10 aggregates, each request 10 ms, 2 at once, up to
    // 8 events a request.
    let sink = ScriptedSink::new(|_, _| (Duration::from_millis(10), 204));
    let txs: Vec<Vec<OutboxEvent>> = (0..120)
        .map(|n| vec![event(&format!("e{n}"), Some(&format!("k{}", n % 10)))])
        .collect();
    let (last, dead) = dispatch_all(batching(2, 8), Arc::clone(&sink), txs).await;
    assert_eq!(last, Lsn::new(12_000), "every transaction done");
    assert!(dead.is_empty());
    let calls = sink.calls();
    let mut seen: Vec<String> = calls.iter().flat_map(carried).collect();
    assert_eq!(seen.len(), 120, "each event sent once");
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 120);
    assert!(calls.iter().all(|c| carried(c).len() <= 8));
    assert!(
        calls.len() <= 120 / 4,
        "batches formed under load: {} requests for 120 events",
        calls.len()
    );
    assert!(
        max_concurrency(&calls) <= 2,
        "max_in_flight counts requests"
    );
    // Per aggregate: one event per request, requests in commit order, never
    // two in flight.
    let mut by_key: HashMap<usize, Vec<(usize, &Call)>> = HashMap::new();
    for c in &calls {
        let mut keys = std::collections::HashSet::new();
        for id in carried(c) {
            let n: usize = id[1..].parse().unwrap();
            assert!(
                keys.insert(n % 10),
                "two events of k{} in one request",
                n % 10
            );
            by_key.entry(n % 10).or_default().push((n, c));
        }
    }
    for (key, mut sent) in by_key {
        sent.sort_by_key(|(_, c)| c.start);
        for pair in sent.windows(2) {
            assert!(
                pair[0].0 < pair[1].0,
                "k{key}: e{} before e{}",
                pair[1].0,
                pair[0].0
            );
            assert!(
                pair[0].1.end <= pair[1].1.start,
                "k{key}: e{} and e{} overlap",
                pair[0].0,
                pair[1].0
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn at_a_low_rate_each_event_goes_alone_as_today() {
    // One event at a time, the sink faster than the events come: no batch.
    let sink = ScriptedSink::new(|_, _| (Duration::from_millis(1), 204));
    let store = Arc::new(MemoryStore::default());
    let metrics = Metrics::new();
    let lane = Lane::single(batching(4, 64), Arc::clone(&sink), &metrics);
    let pipeline = pipeline(&store, metrics, CancellationToken::new());
    let (items, items_rx) = mpsc::channel(16);
    let (confirmed, _) = watch::channel(Confirmed::default());
    let dispatcher = tokio::spawn(run(vec![lane], pipeline, Lsn::ZERO, items_rx, confirmed));
    let window = Window::new(10_000, 1 << 20);
    for i in 0..10u64 {
        let end = Lsn::new(100 * (i + 1));
        send_tx(&items, &window, vec![event(&format!("e{i}"), None)], end).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(items);
    assert_eq!(dispatcher.await.unwrap().unwrap(), Lsn::new(1_000));
    let calls = sink.calls();
    assert_eq!(calls.len(), 10);
    assert!(
        calls.iter().all(|c| c.members.is_empty()),
        "single requests"
    );
}

#[tokio::test(start_paused = true)]
async fn a_refused_batch_is_split_until_the_refused_event_is_alone() {
    // e13 is refused (422); everything else is taken. One request at a
    // time, 16 events a request, 32 events queued at once.
    let sink = ScriptedSink::new(|id, _| {
        (
            Duration::from_millis(5),
            if id == "e13" { 422 } else { 204 },
        )
    });
    let txs = vec![(0..32).map(|n| event(&format!("e{n}"), None)).collect()];
    let (last, dead) = dispatch_all(batching(1, 16), Arc::clone(&sink), txs).await;
    assert_eq!(last, Lsn::new(100), "the transaction is done");
    assert_eq!(dead.len(), 1, "only the refused event is dead-lettered");
    assert_eq!(dead[0].event_id.as_deref(), Some("e13"));
    assert_eq!(dead[0].http_status, Some(422));
    let calls = sink.calls();
    let mut delivered: Vec<String> = calls
        .iter()
        .filter(|c| c.status == 204)
        .flat_map(carried)
        .collect();
    delivered.sort();
    let mut expected: Vec<String> = (0..32)
        .filter(|n| *n != 13)
        .map(|n| format!("e{n}"))
        .collect();
    expected.sort();
    assert_eq!(delivered, expected, "every other event delivered once");
    // Halves: the refused batch (e0 went alone, the first job finding a
    // free worker), then the half with e13, … down to e13 alone: at most
    // one refused request per halving.
    let refused: Vec<usize> = calls
        .iter()
        .filter(|c| c.status == 422)
        .map(|c| carried(c).len())
        .collect();
    assert_eq!(refused, vec![15, 8, 4, 2, 1]);
}
