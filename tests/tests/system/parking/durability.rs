//! How parked rows are committed: a parked event is done only once its
//! row's batch has committed (with the server's `synchronous_commit`), so
//! PostgreSQL crashing while the relay parks them must lose none of the
//! endpoint's events, and synchronous replication needs nothing special.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use ::harness::{ClusterOptions, StopMode};

use super::*;

/// How long the relay may take to stream again after PostgreSQL restarts.
const RECOVERY: Duration = Duration::from_secs(60);

/// billing (`max_lag` 3 s, `resume = "auto"`) answers 503 and is parked;
/// shipping is healthy. Twice, 40 transactions (80 events) are committed
/// and PostgreSQL is restarted in immediate mode at once, while the relay
/// is still writing their parked rows: a commit whose WAL was not yet
/// written is lost (the test cluster runs with `fsync = off`, so what
/// reached the kernel survives; the server's WAL buffers do not). The
/// slot was not confirmed past such a row, so its event is streamed again
/// and parked again. Before the second crash billing answers again; the
/// session after it starts billing parked, replays the backlog, then
/// delivers live. Billing gets every event, each aggregate in commit order
/// over its first receipts, no parked row left; shipping gets every
/// event.
///
/// This exercises the path end to end (rows lost or not, replayed, a
/// relay reconnecting parked); whether a crash lands between a row's
/// queueing and its commit is timing. The rule itself (a parked job is
/// complete only once its row is committed) is proven by the model check,
/// which fails without it (`ack_model`, the rule "a parked job completes
/// before its row is written"). Broken on purpose
/// once: with the restarted relay not starting billing parked
/// (`parked_at_start` ignoring the table), it failed (billing's backlog
/// was never replayed: an endpoint not parked is not resumed); a first version,
/// where billing came back only after the crashes, passed with that break
/// (billing, still refusing, was parked again by its `max_lag`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_crash_while_parking_loses_no_event() {
    let cluster = Arc::new(PgCluster::start(ClusterOptions::default()).unwrap());
    let (stack, sinks, dir) = two_sinks_on(&cluster).await;
    let path = routes_file(dir.path(), &sinks, "auto");
    let relay = start(&stack, &path).await;
    let db = stack.orders_admin().await.unwrap();
    let aggregates = orders(&db, 4).await;
    sinks[0].set_status(503);
    let mut events = commit(&db, &aggregates, 5, 0).await;
    wait_until("billing parked", PARK_BY, || async {
        parked_rows(&db).await.len() == events.len()
    })
    .await
    .unwrap();

    let mut db = db;
    for round in 0..2 {
        events.extend(commit(&db, &aggregates, 40, 10 + round * 80).await);
        if round == 1 {
            // billing answers again as PostgreSQL goes down: the next
            // session must start it parked (its rows wait in the table),
            // or it would take events live before its backlog.
            sinks[0].set_status(204);
        }
        let before = app::sessions(&relay);
        let c = Arc::clone(&cluster);
        tokio::task::spawn_blocking(move || c.restart(StopMode::Immediate))
            .await
            .unwrap()
            .unwrap();
        app::wait_new_session(&relay, before, RECOVERY)
            .await
            .unwrap();
        db = stack.orders_admin().await.unwrap();
    }
    events.extend(commit(&db, &aggregates, 5, 170).await);
    oracle::settle(&db, &stack.slot).await.unwrap();

    let all: BTreeSet<String> = events.iter().map(|e| e.id.clone()).collect();
    wait_until("billing has every event", PARK_BY, || async {
        sinks[0]
            .delivered()
            .iter()
            .map(|r| r.id())
            .collect::<BTreeSet<_>>()
            == all
    })
    .await
    .unwrap();
    wait_until("billing's backlog replayed", PARK_BY, || async {
        parked_rows(&db).await.is_empty()
    })
    .await
    .unwrap();
    let received = sinks[0].delivered().iter().map(|r| r.id()).collect();
    let firsts = first_receipts_in_order("billing", received, &events);
    assert_eq!(firsts.len(), events.len(), "billing: every event");
    let shipping: BTreeSet<String> = sinks[1].delivered().iter().map(|r| r.id()).collect();
    assert_eq!(shipping, all, "shipping: every event");
    drop(relay);
}

/// With `synchronous_standby_names` set, parking works the same: the
/// relay's dead letters commit as every commit of the server does (here
/// with `synchronous_commit = local`, since the standby the cluster names
/// never connects and every commit would otherwise wait forever), and a
/// parked event is done once its row is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_synchronous_replication_parking_works_the_same() {
    let cluster = PgCluster::start(ClusterOptions {
        extra_settings: vec![
            ("synchronous_standby_names".into(), "phantom".into()),
            ("synchronous_commit".into(), "local".into()),
        ],
        ..ClusterOptions::default()
    })
    .unwrap();
    let (stack, sinks, dir) = two_sinks_on(&cluster).await;
    let path = routes_file(dir.path(), &sinks, "manual");
    let relay = start(&stack, &path).await;
    let db = stack.orders_admin().await.unwrap();
    let aggregates = [oracle::expected::insert_order(&db).await.unwrap()];
    sinks[0].set_status(503);
    let events = commit(&db, &aggregates, 5, 0).await;
    wait_until("billing parked", PARK_BY, || async {
        parked_rows(&db).await.len() == events.len()
    })
    .await
    .unwrap();
    oracle::settle(&db, &stack.slot).await.unwrap();
    let shipping: BTreeSet<String> = sinks[1].delivered().iter().map(|r| r.id()).collect();
    assert_eq!(shipping.len(), events.len(), "shipping: every event");
    drop(relay);
}
