//! Dead-letter rows and the live pipeline: a row an earlier session wrote
//! for an event the slot streams again goes once that event is delivered.

use super::*;

#[tokio::test(start_paused = true)]
async fn a_restreamed_event_delivered_now_removes_its_earlier_dead_letter() {
    // An earlier session dead-lettered e1 (row 7) and e3 (row 9, at
    // another endpoint) and stopped before confirming them; the slot
    // streams them again and the sink now takes everything.
    let sink = ScriptedSink::new(|_, _| (Duration::from_millis(5), 204));
    let store = Arc::new(MemoryStore::default());
    let metrics = Metrics::new();
    let lane = Lane::single(config(4), Arc::clone(&sink), &metrics);
    let mut pipeline = pipeline(&store, metrics, CancellationToken::new());
    pipeline.restreamed = [
        (("e1".to_owned(), String::new()), 7),
        (("e3".to_owned(), "billing".to_owned()), 9),
    ]
    .into_iter()
    .collect();
    let (items, items_rx) = mpsc::channel(16);
    let (confirmed, _) = watch::channel(Confirmed::default());
    let dispatcher = tokio::spawn(run(vec![lane], pipeline, Lsn::ZERO, items_rx, confirmed));
    let window = Window::new(100, 1 << 20);
    let events = ["e0", "e1", "e2", "e3"].map(|id| event(id, None)).to_vec();
    send_tx(&items, &window, events, Lsn::new(100)).await;
    drop(items);
    assert_eq!(dispatcher.await.unwrap().unwrap(), Lsn::new(100));
    tokio::time::sleep(Duration::from_millis(10)).await; // the removal
    assert_eq!(
        *store.1.lock().unwrap(),
        [7],
        "e1's row goes; e3's row is another endpoint's"
    );
}
