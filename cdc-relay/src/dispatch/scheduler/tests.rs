//! Tests of the scheduler: unit cases and a proptest of random schedules.

use super::*;
use crate::lsn::Lsn;
use proptest::prelude::*;
use std::collections::HashMap;

fn lsn(n: u64) -> Lsn {
    Lsn::new(n)
}

#[test]
fn one_job_per_key_and_at_most_max_in_flight() {
    let now = Instant::now();
    let mut s: Scheduler<Lsn, &str> = Scheduler::new(lsn(0), 2);
    s.begin();
    s.add(Some("a".into()), "a1", now);
    s.add(Some("a".into()), "a2", now);
    s.add(None, "x", now);
    s.add(Some("b".into()), "b1", now);
    s.commit(lsn(10));

    let (t1, w1) = s.next_job().unwrap();
    let (t2, w2) = s.next_job().unwrap();
    assert_eq!((w1, w2), ("a1", "x"), "a2 waits behind a1; x may pass it");
    assert!(s.next_job().is_none(), "max_in_flight = 2");
    s.complete(t2);
    let (t3, w3) = s.next_job().unwrap();
    assert_eq!(w3, "b1");
    s.complete(t1);
    let (t4, w4) = s.next_job().unwrap();
    assert_eq!(w4, "a2", "a1 done: a2 may go");
    assert_eq!(s.confirmed(), lsn(0), "a2 and b1 are not done");
    s.complete(t3);
    s.complete(t4);
    assert_eq!(s.confirmed(), lsn(10));
    assert!(s.is_idle());
    assert_eq!(s.pending(), 0);
}

#[test]
fn a_lane_in_stream_order_starts_nothing_past_a_job_waiting_on_its_aggregate() {
    let now = Instant::now();
    let mut s: Scheduler<Lsn, &str> = Scheduler::new(lsn(0), 4);
    s.in_stream_order(0);
    s.begin();
    s.add(Some("a".into()), "a1", now);
    s.add(Some("b".into()), "b1", now);
    s.add(Some("a".into()), "a2", now);
    s.add(Some("c".into()), "c1", now);
    s.add(None, "x", now);
    s.commit(lsn(10));

    let (ta1, w) = s.next_job().unwrap();
    assert_eq!(w, "a1");
    let (tb1, w) = s.next_job().unwrap();
    assert_eq!(w, "b1", "b1 has no earlier job waiting");
    assert!(
        s.next_job().is_none(),
        "c1 and x wait: a2, earlier, waits on a1 (room for four)"
    );
    s.complete(tb1);
    assert!(s.next_job().is_none(), "a2 still waits on a1");
    s.complete(ta1);
    let mut started = Vec::new();
    while let Some((t, w)) = s.next_job() {
        s.complete(t);
        started.push(w);
    }
    assert_eq!(started, ["a2", "c1", "x"], "in stream order");
    assert_eq!(s.confirmed(), lsn(10));
}

#[test]
fn a_held_lane_starts_nothing_and_keeps_its_jobs() {
    let now = Instant::now();
    let mut s: Scheduler<Lsn, &str> = Scheduler::with_lanes(lsn(0), &[4, 4]);
    s.begin();
    s.add_to(0, None, "x1@0", now);
    s.commit(lsn(10));
    let (t0, _) = s.next_job().unwrap();
    s.hold(0, true);
    s.begin();
    s.add_to(0, None, "x2@0", now);
    s.add_to(1, None, "y@1", now);
    s.commit(lsn(20));
    let (t1, w1) = s.next_job().unwrap();
    assert_eq!(w1, "y@1", "the other lane goes on");
    assert!(s.next_job().is_none(), "lane 0 is held");
    assert_eq!(s.lane_busy(0), 1, "its running job finishes");
    s.complete(t0);
    s.complete(t1);
    assert_eq!(s.lane_busy(0), 0);
    assert_eq!(s.confirmed(), lsn(10), "x2 waits, held");
    s.hold(0, false);
    let (t2, w2) = s.next_job().unwrap();
    assert_eq!(w2, "x2@0");
    s.complete(t2);
    assert_eq!(s.confirmed(), lsn(20));
}

#[test]
fn a_blocked_lane_does_not_hold_the_other_back() {
    let now = Instant::now();
    let mut s: Scheduler<Lsn, &str> = Scheduler::with_lanes(lsn(0), &[1, 1]);
    s.begin();
    s.add_to(0, Some("a".into()), "a1@0", now);
    s.add_to(1, Some("a".into()), "a1@1", now);
    s.commit(lsn(10));
    s.begin();
    s.add_to(0, Some("a".into()), "a2@0", now);
    s.add_to(1, Some("a".into()), "a2@1", now);
    s.commit(lsn(20));
    let (t0, w0) = s.next_job().unwrap();
    let (t1, w1) = s.next_job().unwrap();
    assert_eq!((w0, w1), ("a1@0", "a1@1"), "one per lane, the same key");
    assert!(s.next_job().is_none());
    assert_eq!(
        (s.lane_pending(0), s.lane_busy(0)),
        (2, 1),
        "a2 waits behind a1, not running"
    );
    s.complete(t1);
    let (t2, w2) = s.next_job().unwrap();
    assert_eq!(w2, "a2@1", "lane 1 goes on while lane 0 is stuck");
    s.complete(t2);
    assert_eq!(s.confirmed(), lsn(0), "both transactions wait for lane 0");
    assert_eq!((s.lane_pending(0), s.lane_pending(1)), (2, 0));
    s.complete(t0);
    assert_eq!(s.confirmed(), lsn(10));
    let (t3, _) = s.next_job().unwrap();
    s.complete(t3);
    assert_eq!(s.confirmed(), lsn(20));

    // A lane at its max_in_flight with more ready does not stop a later
    // job of another lane (no head-of-line blocking across lanes).
    let mut s: Scheduler<Lsn, &str> = Scheduler::with_lanes(lsn(0), &[1, 1]);
    s.begin();
    s.add_to(0, None, "x1@0", now);
    s.add_to(0, None, "x2@0", now);
    s.add_to(1, None, "y@1", now);
    s.commit(lsn(10));
    let started: Vec<&str> = std::iter::from_fn(|| s.next_job().map(|(_, w)| w)).collect();
    assert_eq!(started, ["x1@0", "y@1"]);
}

#[test]
fn a_hand_off_releases_the_claim_and_completes_in_its_own_time() {
    let now = Instant::now();
    let mut s: Scheduler<Lsn, &str> = Scheduler::with_lanes(lsn(0), &[1, 1]);
    s.begin();
    s.add_to(0, Some("a".into()), "a1", now);
    s.add_to(0, Some("a".into()), "a2", now);
    s.add_to(0, None, "x", now);
    s.commit(lsn(10));
    let (h1, w1) = s.hand_off(0).unwrap();
    let (h2, w2) = s.hand_off(0).unwrap();
    let (h3, w3) = s.hand_off(0).unwrap();
    assert_eq!(
        [w1, w2, w3],
        ["a1", "a2", "x"],
        "a2 follows a1 at once, in stream order; no max_in_flight"
    );
    assert!(s.hand_off(0).is_none() && s.next_job().is_none());
    s.begin();
    s.add_to(0, None, "y", now);
    s.commit(lsn(15));
    s.drain(0, true);
    assert!(s.next_job().is_none(), "a draining lane starts nothing");
    let (h4, _) = s.hand_off(0).unwrap();
    s.drain(0, false);
    s.complete(h4);
    assert_eq!((s.lane_busy(0), s.running()), (3, 0));
    s.complete(h1);
    s.complete(h3);
    assert_eq!(s.confirmed(), lsn(0), "a2 is still being written");
    s.complete(h2);
    assert_eq!(s.confirmed(), lsn(15));
    assert!(s.is_idle());

    // A running job handed off lets its aggregate's next job go.
    s.begin();
    s.add_to(1, Some("b".into()), "b1", now);
    s.add_to(1, Some("b".into()), "b2", now);
    s.commit(lsn(20));
    let (mut t1, _) = s.next_job().unwrap();
    assert!(s.next_job().is_none(), "b2 waits behind b1");
    s.hand_off_running(&mut t1);
    let (t2, w) = s.hand_off(1).unwrap();
    assert_eq!(w, "b2");
    s.hold(1, true);
    assert_eq!(s.lane_busy(1), 2, "both with the writer");
    s.complete(t2);
    s.complete(t1);
    assert_eq!((s.confirmed(), s.lane_busy(1)), (lsn(20), 0));
}

#[test]
fn an_abandoned_job_holds_its_aggregate_and_gives_back_what_waits() {
    let now = Instant::now();
    let mut s: Scheduler<Lsn, &str> = Scheduler::new(lsn(0), 4);
    s.begin();
    s.add(Some("a".into()), "a1", now);
    s.add(Some("a".into()), "a2", now);
    s.add(Some("b".into()), "b1", now);
    s.commit(lsn(10));
    let (ta, _) = s.next_job().unwrap();
    let (tb, _) = s.next_job().unwrap();
    s.abandon(ta);
    assert_eq!(s.take_abandoned(), [(0, "a2")], "a2 must not overtake a1");
    s.begin();
    s.add(Some("a".into()), "a3", now);
    s.add(Some("c".into()), "c1", now);
    s.commit(lsn(20));
    assert_eq!(s.take_abandoned(), [(0, "a3")], "later ones of a too");
    let (tc, w) = s.next_job().unwrap();
    assert_eq!(w, "c1", "other aggregates go on");
    s.complete(tb);
    s.complete(tc);
    assert_eq!(s.confirmed(), lsn(0), "an abandoned job is never done");
    assert!(s.is_idle(), "nothing left to start or wait for");
}

#[test]
fn what_a_lane_alone_holds_counts_events_done_everywhere_else() {
    let now = Instant::now();
    let mut s: Scheduler<Lsn, &str> = Scheduler::with_lanes(lsn(0), &[4, 4]);
    s.begin();
    s.add_event(None, [(0, "e1@0"), (1, "e1@1")], now);
    s.add_event(None, [(0, "e2@0"), (1, "e2@1")], now);
    s.add_event(None, [(1, "e3@1")], now);
    s.commit(lsn(10));
    assert_eq!((s.lane_exclusive(0), s.lane_exclusive(1)), (0, 1));
    let started: Vec<(Ticket, &str)> = std::iter::from_fn(|| s.next_job()).collect();
    for (t, w) in started {
        if w.ends_with("@0") {
            s.complete(t);
        }
    }
    assert_eq!(
        (s.lane_exclusive(0), s.lane_exclusive(1)),
        (0, 3),
        "lane 0 is done with e1 and e2: lane 1 alone holds all three, running ones included"
    );
}

#[derive(Debug, Clone)]
enum Step {
    /// A transaction whose events have these keys (`None`: no key) and
    /// go to these lanes (bit 0: lane 0, bit 1: lane 1; 0 = none).
    Tx(Vec<(Option<u8>, u8)>),
    /// Complete the running job at this index (mod the running count).
    Complete(usize),
    /// Start whatever may start.
    Start,
    Keepalive,
    /// Hold lane (index mod 2), or let it go.
    Hold(usize, bool),
    /// Hand off every ready job of a lane to the writer.
    HandOff(usize),
    /// The writer completes its oldest job.
    Write,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => proptest::collection::vec((proptest::option::of(0u8..4), 0u8..4), 0..4).prop_map(Step::Tx),
        3 => any::<usize>().prop_map(Step::Complete),
        3 => Just(Step::Start),
        1 => Just(Step::Keepalive),
        1 => (0usize..2, any::<bool>()).prop_map(|(l, h)| Step::Hold(l, h)),
        1 => (0usize..2).prop_map(Step::HandOff),
        2 => Just(Step::Write),
    ]
}

proptest! {
    /// Random streams over two lanes (events to one, both or neither)
    /// and completion orders, lanes held and let go, jobs handed off
    /// to a writer that completes them in order: no two running
    /// jobs of a lane share a key, never more than a lane's
    /// max_in_flight run in it, no job of a held lane starts or is
    /// handed off, jobs of one key start (or are handed off) in stream
    /// order in each lane, the confirmed
    /// position never passes a transaction with an incomplete job at
    /// any lane, and everything drains.
    #[test]
    fn keys_window_and_watermark_hold(
        max in (1usize..5, 1usize..5),
        steps in proptest::collection::vec(step(), 1..150),
    ) {
        let now = Instant::now();
        let maxes = [max.0, max.1];
        let mut s: Scheduler<Lsn, (u64, Option<u8>, Lsn)> = Scheduler::with_lanes(lsn(100), &maxes);
        // Lane 1 starts its jobs strictly in stream order.
        s.in_stream_order(1);
        let mut last_in_order: Option<u64> = None;
        let mut wal = 100u64;
        let mut running: Vec<(Ticket, Option<u8>)> = Vec::new();
        // end position of each incomplete job, by seq
        let mut incomplete: BTreeMap<u64, Lsn> = BTreeMap::new();
        let mut last_started: HashMap<(usize, u8), u64> = HashMap::new();
        let mut seq = 0u64;
        let mut held = [false, false];
        let mut writer: VecDeque<Ticket> = VecDeque::new();
        // lane and event number of each job, by seq
        let mut job_of: HashMap<u64, (usize, u64)> = HashMap::new();
        let mut event = 0u64;
        let start = |s: &mut Scheduler<Lsn, (u64, Option<u8>, Lsn)>,
                         running: &mut Vec<(Ticket, Option<u8>)>,
                         last_started: &mut HashMap<(usize, u8), u64>,
                         last_in_order: &mut Option<u64>,
                         held: &[bool; 2]|
         -> Result<(), TestCaseError> {
            while let Some((ticket, (job_seq, key, _))) = s.next_job() {
                prop_assert_eq!(ticket.seq, job_seq);
                let lane = ticket.lane;
                if lane == 1
                    && let Some(prev) = last_in_order.replace(job_seq)
                {
                    prop_assert!(prev < job_seq, "lane 1 started {} after {}", job_seq, prev);
                }
                prop_assert!(!held[lane], "a job of held lane {} started", lane);
                if let Some(k) = key {
                    prop_assert!(
                        running.iter().all(|(t, rk)| t.lane != lane || *rk != Some(k)),
                        "two jobs of key {} running in lane {}", k, lane
                    );
                    if let Some(prev) = last_started.insert((lane, k), job_seq) {
                        prop_assert!(prev < job_seq, "key {} out of order in lane {}", k, lane);
                    }
                }
                running.push((ticket, key));
                let in_lane = running.iter().filter(|(t, _)| t.lane == lane).count();
                prop_assert!(in_lane <= maxes[lane], "more than lane {}'s max_in_flight", lane);
                prop_assert_eq!(s.running(), running.len());
            }
            Ok(())
        };
        for step in steps {
            match step {
                Step::Tx(keys) => {
                    s.begin();
                    wal += 10;
                    for (key, mask) in &keys {
                        let mut jobs = Vec::new();
                        for lane in (0..2).filter(|l| mask & (1 << l) != 0) {
                            jobs.push((lane, (seq, *key, lsn(wal))));
                            incomplete.insert(seq, lsn(wal));
                            job_of.insert(seq, (lane, event));
                            seq += 1;
                        }
                        s.add_event(key.map(|k| k.to_string().into()), jobs, now);
                        event += 1;
                    }
                    s.commit(lsn(wal));
                }
                Step::Complete(i) if !running.is_empty() => {
                    let (ticket, _) = running.swap_remove(i % running.len());
                    incomplete.remove(&ticket.seq);
                    s.complete(ticket);
                }
                Step::Complete(_) => {}
                Step::Start => start(&mut s, &mut running, &mut last_started, &mut last_in_order, &held)?,
                Step::Keepalive => {
                    wal += 5;
                    s.keepalive(lsn(wal));
                }
                Step::Hold(lane, h) => {
                    held[lane] = h;
                    s.hold(lane, h);
                }
                Step::HandOff(lane) => {
                    while let Some((ticket, (job_seq, key, _))) = s.hand_off(lane) {
                        prop_assert!(!held[lane], "a job of held lane {} handed off", lane);
                        if let Some(k) = key
                            && let Some(prev) = last_started.insert((lane, k), job_seq)
                        {
                            prop_assert!(prev < job_seq, "key {} handed off out of order in lane {}", k, lane);
                        }
                        writer.push_back(ticket);
                    }
                }
                Step::Write => {
                    if let Some(ticket) = writer.pop_front() {
                        incomplete.remove(&ticket.seq);
                        s.complete(ticket);
                    }
                }
            }
            for end in incomplete.values() {
                prop_assert!(s.confirmed() < *end, "confirmed {} passed an incomplete job ending {}", s.confirmed(), end);
            }
            prop_assert_eq!(s.pending(), incomplete.len());
            for lane in 0..2 {
                let alone = incomplete
                    .keys()
                    .filter(|q| job_of[q].0 == lane)
                    .filter(|q| {
                        let ev = job_of[q].1;
                        incomplete.keys().filter(|o| job_of[o].1 == ev).count() == 1
                    })
                    .count();
                prop_assert_eq!(s.lane_exclusive(lane), alone, "what lane {} holds alone", lane);
            }
        }
        // Drain: everything completes, whatever the order so far.
        for lane in 0..2 {
            s.hold(lane, false);
        }
        while let Some(ticket) = writer.pop_front() {
            incomplete.remove(&ticket.seq);
            s.complete(ticket);
        }
        loop {
            start(&mut s, &mut running, &mut last_started, &mut last_in_order, &[false, false])?;
            let Some((ticket, _)) = running.pop() else { break };
            incomplete.remove(&ticket.seq);
            s.complete(ticket);
        }
        prop_assert!(incomplete.is_empty(), "jobs never started: {:?}", incomplete);
        prop_assert!(s.is_idle());
        prop_assert_eq!(s.confirmed(), s.received());
    }
}
