//! Issue 15's proof with a stopped process: an endpoint whose sink process
//! is stopped (SIGSTOP) while events keep coming, parked, then continued.

use std::collections::BTreeSet;

use super::*;

/// A sink in a process of its own (`bench sink-worker`): it answers 204
/// and lists the ids it answered, in order, at `GET /received`.
struct SinkProcess {
    process: ::harness::ServiceProcess,
    base: String,
}

impl SinkProcess {
    async fn start() -> SinkProcess {
        let process =
            ::harness::ServiceProcess::spawn(env!("CARGO_BIN_EXE_bench"), &["sink-worker"], &[])
                .unwrap();
        let base = process
            .listen_addr(std::time::Duration::from_secs(30))
            .await
            .unwrap();
        SinkProcess { process, base }
    }

    fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.process.pid()).unwrap());
        nix::sys::signal::kill(pid, signal).unwrap();
    }

    /// The ids answered, in the order answered (repeats included).
    async fn received(&self) -> Vec<String> {
        reqwest::get(format!("{}/received", self.base))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
            .lines()
            .filter_map(|l| l.split(' ').next().map(str::to_owned))
            .collect()
    }
}

/// The proof with a stopped process: billing's sink is a process
/// of its own, stopped with SIGSTOP (it keeps its sockets, the kernel
/// keeps accepting, nothing is answered) while events keep coming, then
/// continued. No `max_lag`: billing, holding the window alone, is parked;
/// the slot moves past its events while it is stopped; once it answers
/// again the relay replays its parked backlog and returns it to live
/// delivery. Billing gets every event, each aggregate in commit order
/// over its first receipts (a request it had read before it stopped may
/// be answered again later: at-least-once), and no event after the
/// backlog's before the backlog is through; shipping gets everything,
/// in order. Broken on purpose once: with the resume task never asking
/// for the handover (`Handover::Hold` not sent), it failed (billing stayed
/// parked: "billing back live" timed out).
#[tokio::test]
async fn an_endpoint_whose_process_is_stopped_is_parked_then_back_in_order() {
    use nix::sys::signal::Signal;
    let stack = PgCluster::shared().create_stack().await.unwrap();
    app::relay_setup(&stack).await.unwrap();
    let billing = SinkProcess::start().await;
    let shipping = ScriptedSink::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[[endpoint]]\nname = \"billing\"\nurl = \"{}/inbox\"\nevent_types = [\"*\"]\nsecret_env = {:?}\nrequest_timeout = \"1s\"\nprobe_interval = \"200ms\"\n\n\
         [[endpoint]]\nname = \"shipping\"\nurl = {:?}\nevent_types = [\"*\"]\nsecret_env = {:?}\n",
        billing.base, SECRETS[0].0, shipping.url, SECRETS[1].0
    );
    let path = dir.path().join("stopped.toml");
    std::fs::write(&path, text).unwrap();
    let relay = app::start_relay_with_routes(
        &stack,
        &path,
        &["--backoff-cap", "200ms", "--max-pending-events", "30"],
        &SECRETS,
    )
    .await
    .unwrap();
    app::wait_streaming(&relay).await.unwrap();
    let db = stack.orders_admin().await.unwrap();
    let aggregates = orders(&db, 4).await;
    let mut events = commit(&db, &aggregates, 5, 0).await;
    oracle::settle(&db, &stack.slot).await.unwrap();

    billing.signal(Signal::SIGSTOP);
    events.extend(commit(&db, &aggregates, 40, 10).await);
    oracle::settle(&db, &stack.slot).await.unwrap();
    let parked = parked_rows(&db).await;
    assert!(
        parked.len() >= 40,
        "billing's events parked while it is stopped: {}",
        parked.len()
    );
    let m = relay.metrics().await.unwrap();
    assert_eq!(
        m.value("cdc_relay_endpoint_parked", &[("endpoint", "billing")]),
        Some(1.0)
    );

    billing.signal(Signal::SIGCONT);
    wait_until("billing back live", PARK_BY, || async {
        let m = relay.metrics().await.unwrap();
        m.value("cdc_relay_endpoint_parked", &[("endpoint", "billing")]) == Some(0.0)
    })
    .await
    .unwrap();
    let backlog = events.len();
    events.extend(commit(&db, &aggregates, 5, 90).await);
    oracle::settle(&db, &stack.slot).await.unwrap();
    let all: BTreeSet<String> = events.iter().map(|e| e.id.clone()).collect();
    wait_until("billing has every event", PARK_BY, || async {
        billing
            .received()
            .await
            .into_iter()
            .collect::<BTreeSet<_>>()
            == all
    })
    .await
    .unwrap();
    assert!(
        parked_rows(&db).await.is_empty(),
        "the backlog was replayed"
    );

    let firsts = first_receipts_in_order("billing", billing.received().await, &events);
    let first_live = firsts.iter().position(|n| *n >= backlog).unwrap();
    assert!(
        firsts[..first_live].len() == backlog,
        "the whole backlog reached billing before any event committed after it came back"
    );
    let shipping: BTreeSet<String> = in_order("shipping", &shipping, &events)
        .into_iter()
        .collect();
    assert_eq!(shipping, all, "shipping: everything");
    drop(relay);
}
