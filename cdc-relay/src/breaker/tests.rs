//! Tests of the circuit breaker and the storm guard, in paused time.

use super::*;
use std::sync::Arc;

#[tokio::test(start_paused = true)]
async fn an_open_circuit_says_it_is_still_open_once_a_minute() {
    let opened = Instant::now();
    let mut spell = OpenSpell::new(opened);
    let mut lines = Vec::new();
    // A failed probe every 5 s for 3.5 minutes.
    for _ in 0..42 {
        tokio::time::advance(Duration::from_secs(5)).await;
        if let Some(line) = spell.probe_failed(Instant::now()) {
            lines.push(line);
        }
    }
    assert_eq!(
        lines,
        [
            (Duration::from_secs(60), 12),
            (Duration::from_secs(120), 24),
            (Duration::from_secs(180), 36)
        ]
    );
}

fn breaker() -> Arc<Breaker> {
    Arc::new(Breaker::new(
        BreakerConfig {
            failure_threshold: 3,
            probe_interval: Duration::from_millis(500),
            storm_threshold: 3,
            retired_probe_interval: Duration::from_secs(60),
        },
        Metrics::new(),
    ))
}

#[tokio::test(start_paused = true)]
async fn starts_with_one_attempt_at_a_time_until_the_sink_answers() {
    let b = breaker();
    assert_eq!(b.admit(1).await, Admission::PROBE);
    let second = tokio::spawn({
        let b = b.clone();
        async move { b.admit(2).await }
    });
    tokio::task::yield_now().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        !second.is_finished(),
        "one attempt at a time before the first answer"
    );
    b.record(Admission::PROBE, Signal::Success, "");
    assert_eq!(
        second.await.unwrap(),
        Admission::NORMAL,
        "then the whole window"
    );
    assert_eq!(b.admit(3).await, Admission::NORMAL);
}

/// Issue 14, HTTP manners 6: a relay that starts (or takes over from
/// one killed mid-outage) while the sink is down sends its first
/// attempt at once and every later one a probe interval after the last
/// failure: not the K failures that open the circuit back to back.
/// Once the sink has answered, a failure is retried at once again
/// (one at a time), and K failures open the circuit as before.
#[tokio::test(start_paused = true)]
async fn a_fresh_breaker_paces_its_attempts_until_the_sink_first_answers() {
    let b = breaker();
    let t0 = Instant::now();
    let mut starts = Vec::new();
    for n in 1..=5 {
        assert_eq!(b.admit(1).await, Admission::PROBE);
        starts.push(t0.elapsed());
        b.record(Admission::PROBE, Signal::Transient, "connect");
        let expected = if n < 3 {
            CircuitState::Closed
        } else {
            CircuitState::Open
        };
        assert_eq!(b.state(), expected, "after {n} failures");
    }
    assert_eq!(starts[0], Duration::ZERO, "the first attempt goes at once");
    for pair in starts.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(
            gap >= Duration::from_millis(500) && gap <= Duration::from_millis(600),
            "attempts {gap:?} apart: {starts:?}"
        );
    }

    assert_eq!(b.admit(1).await, Admission::PROBE);
    b.record(Admission::PROBE, Signal::Success, "");
    assert_eq!(b.admit(2).await, Admission::NORMAL);
    b.record(Admission::NORMAL, Signal::Transient, "http_503");
    let t1 = Instant::now();
    assert_eq!(b.admit(2).await, Admission::PROBE);
    assert_eq!(t1.elapsed(), Duration::ZERO, "not paced once answered");
}

/// A relay that held the slot, lost it (a reconnect, or another relay
/// took over) and takes it over again later must not trust what the
/// sink answered back then: not a whole window at once, and failures
/// paced. Fails without the reset in `new_session`: the first admission
/// after it is Normal.
#[tokio::test(start_paused = true)]
async fn a_new_session_forgets_that_the_sink_answered() {
    let b = breaker();
    assert_eq!(b.admit(1).await, Admission::PROBE);
    b.record(Admission::PROBE, Signal::Success, "");
    assert_eq!(b.admit(2).await, Admission::NORMAL);

    b.new_session();
    assert_eq!(b.admit(1).await, Admission::PROBE, "one attempt at a time");
    let second = tokio::spawn({
        let b = b.clone();
        async move { b.admit(2).await }
    });
    tokio::task::yield_now().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!second.is_finished(), "the second waits for the first");
    b.record(Admission::PROBE, Signal::Transient, "connect");
    let failed = Instant::now();
    assert_eq!(second.await.unwrap(), Admission::PROBE);
    assert!(
        failed.elapsed() >= Duration::from_millis(500),
        "paced: {:?}",
        failed.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn opens_after_k_failures_and_probes_with_the_longest_waiting() {
    let b = breaker();
    b.record(Admission::NORMAL, Signal::Success, ""); // the sink answered once
    assert_eq!(b.admit(1).await, Admission::NORMAL);
    b.record(Admission::NORMAL, Signal::Transient, "http_503");
    // After a failure, one attempt at a time until the sink answers.
    assert_eq!(b.admit(1).await, Admission::PROBE);
    b.record(Admission::PROBE, Signal::Transient, "http_503");
    assert_eq!(b.state(), CircuitState::Closed);
    b.record(Admission::NORMAL, Signal::Transient, "http_503");
    assert_eq!(b.state(), CircuitState::Open);

    // Two deliveries wait; only the one waiting longest (seq 1, queued
    // first) probes, after the interval.
    let t0 = Instant::now();
    let first = tokio::spawn({
        let b = b.clone();
        async move { b.admit(1).await }
    });
    tokio::task::yield_now().await;
    let newer = tokio::spawn({
        let b = b.clone();
        async move { b.admit(7).await }
    });
    tokio::task::yield_now().await;
    assert_eq!(first.await.unwrap(), Admission::PROBE);
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(500) && waited <= Duration::from_millis(600),
        "{waited:?}"
    );
    assert!(!newer.is_finished(), "the newer delivery keeps waiting");

    // A failed probe: the next one only after another interval, and not
    // the delivery that just failed, back from its backoff: the one that
    // has waited longer goes first (seq 1 took every probe before, so one
    // event the sink kept failing held back every other aggregate).
    b.record(Admission::PROBE, Signal::Transient, "http_503");
    let t1 = Instant::now();
    let again = tokio::spawn({
        let b = b.clone();
        async move { b.admit(1).await }
    });
    let newer = tokio::time::timeout(Duration::from_secs(5), newer)
        .await
        .expect("seq 7 probes next, not seq 1 again");
    assert_eq!(newer.unwrap(), Admission::PROBE);
    assert!(t1.elapsed() >= Duration::from_millis(400));
    assert!(!again.is_finished(), "seq 1 waits its turn");

    // The first 2xx closes the circuit and releases everyone at once.
    b.record(Admission::PROBE, Signal::Success, "");
    assert_eq!(b.state(), CircuitState::Closed);
    assert_eq!(again.await.unwrap(), Admission::NORMAL);
}

#[tokio::test(start_paused = true)]
async fn probe_rate_stays_near_two_per_second() {
    let b = breaker();
    b.record(
        Admission::NORMAL,
        Signal::ConfigFault("check the secret"),
        "http_401",
    );
    assert_eq!(b.state(), CircuitState::Open);
    let start = Instant::now();
    let mut probes = 0;
    while start.elapsed() < Duration::from_secs(10) {
        assert_eq!(b.admit(1).await, Admission::PROBE);
        probes += 1;
        b.record(
            Admission::PROBE,
            Signal::ConfigFault("check the secret"),
            "http_401",
        );
    }
    assert!(
        (16..=20).contains(&probes),
        "{probes} probes in 10 s: never above 2/s"
    );
}

/// 410 Gone: the endpoint is marked retired and probed once per
/// retired interval (60 s here), not once per probe interval; a 2xx
/// clears it and the circuit.
#[tokio::test(start_paused = true)]
async fn a_retired_endpoint_is_probed_once_a_retired_interval() {
    let metrics = Metrics::new();
    let b = Breaker::new(
        BreakerConfig {
            failure_threshold: 3,
            probe_interval: Duration::from_millis(500),
            storm_threshold: 3,
            retired_probe_interval: Duration::from_secs(60),
        },
        metrics.clone(),
    );
    b.record(Admission::NORMAL, Signal::Retired, "http_410");
    assert_eq!(b.state(), CircuitState::Open);
    assert!(b.is_retired());
    assert_eq!(metrics.endpoints.retired(), ["default"]);
    let start = Instant::now();
    let mut probes = 0;
    while start.elapsed() < Duration::from_secs(600) {
        assert_eq!(b.admit(1).await, Admission::PROBE);
        probes += 1;
        b.record(Admission::PROBE, Signal::Retired, "http_410");
    }
    assert!(
        (9..=10).contains(&probes),
        "{probes} probes in 10 minutes: at most one a minute"
    );
    // A failure of another kind keeps the retired pace until a 2xx.
    b.record(Admission::PROBE, Signal::Transient, "connect");
    let t = Instant::now();
    assert_eq!(b.admit(1).await, Admission::PROBE);
    assert!(t.elapsed() >= Duration::from_secs(60));
    b.record(Admission::PROBE, Signal::Success, "");
    assert_eq!(b.state(), CircuitState::Closed);
    assert!(!b.is_retired());
    assert!(metrics.endpoints.retired().is_empty());
}

#[tokio::test(start_paused = true)]
async fn retry_after_pause_holds_every_delivery_and_the_probe() {
    let b = breaker();
    b.record(
        Admission::NORMAL,
        Signal::ConfigFault("check the secret"),
        "http_401",
    );
    assert_eq!(b.state(), CircuitState::Open);
    let t0 = Instant::now();
    b.pause_until(t0 + Duration::from_secs(20));
    b.pause_until(t0 + Duration::from_secs(5)); // an earlier end changes nothing
    assert_eq!(
        b.admit(1).await,
        Admission::PROBE,
        "the probe waits out the pause"
    );
    assert_eq!(t0.elapsed(), Duration::from_secs(20));

    // A closed, proven circuit pauses every delivery too.
    b.record(Admission::PROBE, Signal::Success, "");
    assert_eq!(b.admit(2).await, Admission::NORMAL);
    // (Answered: an attempt left unanswered through the pause would make
    // the sink silent, and slow start would follow it.)
    b.record(Admission::NORMAL, Signal::Success, "");
    let t1 = Instant::now();
    b.pause_until(t1 + Duration::from_secs(3));
    let (a, c) = tokio::join!(b.admit(3), b.admit(4));
    assert_eq!((a, c), (Admission::NORMAL, Admission::NORMAL));
    assert_eq!(t1.elapsed(), Duration::from_secs(3));
}

/// A closed, proven circuit whose sink leaves an attempt unanswered for two
/// probe intervals admits the next one alone (slow start), and returns to
/// normal admission once the sink answers.
#[tokio::test(start_paused = true)]
async fn a_silent_sink_gets_one_attempt_at_a_time_until_it_answers() {
    let b = breaker();
    assert_eq!(b.admit(1).await, Admission::PROBE, "slow start at first");
    b.record(Admission::PROBE, Signal::Success, "");
    assert_eq!(b.admit(2).await, Admission::NORMAL);
    tokio::time::sleep(Duration::from_millis(999)).await;
    assert_eq!(b.admit(3).await, Admission::NORMAL, "not silent yet");
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(b.admit(4).await, Admission::PROBE, "silent: one at a time");
    let held = tokio::time::timeout(Duration::from_secs(10), b.admit(5)).await;
    assert!(held.is_err(), "nothing else while the probe is out");
    b.record(Admission::PROBE, Signal::Success, "");
    assert_eq!(b.admit(5).await, Admission::NORMAL, "it answered");
}

#[test]
fn storm_guard_stops_dead_lettering_after_distinct_poison_events() {
    let b = breaker();
    assert!(b.poison("a"));
    assert!(b.poison("a"), "the same event does not count twice");
    assert!(b.poison("b"));
    assert!(!b.poison("c"), "third distinct event: storm");
    assert_eq!(b.state(), CircuitState::Open);
    assert!(!b.poison("d"), "no dead letter during the storm");
    b.record(Admission::PROBE, Signal::Success, "");
    assert_eq!(b.state(), CircuitState::Closed);
    assert!(b.poison("e"), "a 2xx ends the storm");
}

/// A 2xx to a request admitted before a run of refusals began (a request
/// sent before the sink turned on every event, answered late) neither
/// ends the run nor the storm; one admitted after the run began does.
/// Fails without it: the late 2xx cleared the run, and a sink refusing
/// everything got a second run of dead letters (a tester: 18 with a
/// threshold of 10).
#[tokio::test(start_paused = true)]
async fn a_late_2xx_to_a_request_sent_before_the_refusals_does_not_end_the_run() {
    let b = breaker();
    let first = b.admit(1).await;
    b.record(first, Signal::Success, "");
    // Three requests on the wire while the sink goes bad.
    let early = b.admit(2).await;
    let refused = b.admit(3).await;
    let late = b.admit(4).await;
    assert!(b.poison("a"), "the first refusal: dead-lettered");
    b.record(refused, Signal::DeadLettered, "http_400");
    b.record(early, Signal::Success, "");
    assert!(b.poison("b"), "the run goes on after the stale 2xx");
    assert!(!b.poison("c"), "third distinct event: storm");
    assert_eq!(b.state(), CircuitState::Open);
    b.record(late, Signal::Success, "");
    assert_eq!(b.state(), CircuitState::Open, "a stale 2xx closes no storm");
    assert!(!b.poison("d"), "still a storm");
    // A request admitted after the run began is the sink's word now.
    let probe = b.admit(5).await;
    assert!(probe.is_probe());
    b.record(probe, Signal::Success, "");
    assert_eq!(b.state(), CircuitState::Closed);
    assert!(b.poison("e"), "a fresh 2xx ends the storm");
}
