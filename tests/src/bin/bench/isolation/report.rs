//! Scenario j's figures and notes (see the module above for what each
//! means).

use super::sampler::Reading;
use super::{ENDPOINTS, Latency, Outcome, Run, SCENARIO, WINDOW_EVENTS};
use crate::Ctx;
use crate::stats::{quantiles, summarize};

const MIB: f64 = 1024.0 * 1024.0;

/// The figures and notes of one run.
pub(super) fn run(ctx: &mut Ctx, run: Run, o: &Outcome) {
    let name = run.name();
    let add = |ctx: &mut Ctx, figure: &str, unit: &str, v: f64| {
        ctx.results
            .add(SCENARIO, &format!("{name}: {figure}"), unit, "ours", v);
    };
    add(ctx, "orders posted/s (achieved)", "/s", o.achieved);
    for (endpoint, lat) in ENDPOINTS.iter().zip(&o.latency) {
        if let Some(lat) = lat {
            endpoint_latency(ctx, run, o, endpoint, lat);
        }
    }
    for (q, v) in [("p50", o.relay_histogram.0), ("p99", o.relay_histogram.1)] {
        if let Some(v) = v {
            add(
                ctx,
                &format!("relay histogram {q} (all endpoints)"),
                "ms",
                v,
            );
        }
    }
    if let Some(cpu) = o.relay_cpu {
        add(ctx, "relay CPU", "% of a core", cpu * 100.0);
    }
    readings(ctx, run, o);
    if run.frozen() {
        parked(ctx, run, o);
    }
}

/// Each healthy endpoint's p99 in a frozen run over its p99 in a healthy
/// run: over the whole window, and as the median of the per-minute p99s
/// (steadier when a neighbour's burst falls on one minute).
pub(super) fn ratio(ctx: &mut Ctx, run: Run, healthy: &Outcome, frozen: &Outcome) {
    for (i, endpoint) in ENDPOINTS.iter().enumerate() {
        let (Some(h), Some(f)) = (&healthy.latency[i], &frozen.latency[i]) else {
            continue;
        };
        let (h, f) = (&h.by_commit, &f.by_commit);
        let p99 = |lat: &[(i64, f64)]| quantiles(&ms_of(lat)).map(|q| q[2]);
        let per_minute = |lat: &[(i64, f64)]| summarize(&per_minute_p99(lat)).map(|s| s.median);
        for (what, h, f) in [
            ("p99 ratio", p99(h), p99(f)),
            ("per-minute p99 median ratio", per_minute(h), per_minute(f)),
        ] {
            if let (Some(h), Some(f)) = (h, f) {
                ctx.results.add(
                    SCENARIO,
                    &format!("{endpoint} {what} {} / healthy", run.name()),
                    "×",
                    "ours",
                    f / h,
                );
            }
        }
    }
}

/// One answering endpoint's commit→2xx over the window (and, in a frozen
/// run, before and after billing was parked), with its p99 per minute.
fn endpoint_latency(ctx: &mut Ctx, run: Run, o: &Outcome, endpoint: &str, latency: &Latency) {
    let name = run.name();
    let lat = &latency.by_commit;
    let r = &mut ctx.results;
    if let Some([p50, _, p99, max]) = quantiles(&ms_of(lat)) {
        for (q, v) in [("p50", p50), ("p99", p99), ("max", max)] {
            r.add(
                SCENARIO,
                &format!("{name}: {endpoint} commit→2xx {q}"),
                "ms",
                "ours",
                v,
            );
        }
    }
    if let Some(parked_at) = o.parked.first.filter(|_| run.frozen()) {
        let split = lat.partition_point(|(c, _)| *c < parked_at);
        for (phase, part) in [("before", &lat[..split]), ("after", &lat[split..])] {
            if let Some(q) = quantiles(&ms_of(part)) {
                r.add(
                    SCENARIO,
                    &format!("{name}: {endpoint} p99, committed {phase} billing was parked"),
                    "ms",
                    "ours",
                    q[2],
                );
            }
        }
    }
    let minutes: Vec<String> = per_minute_p99(lat)
        .iter()
        .map(|v| format!("{v:.1}"))
        .collect();
    r.note(format!(
        "j {name}: {endpoint} p99 per minute of the window (ms): {}",
        minutes.join(", ")
    ));
    if latency.missing > 0 {
        r.note(format!(
            "j {name}: {endpoint} never answered {} of {} events of the window (its percentiles are over the others: a lower bound)",
            latency.missing, o.events
        ));
    }
}

/// The slot's retained WAL against the budget, the WAL written and fsynced
/// per second over the window, and how full billing kept the window.
fn readings(ctx: &mut Ctx, run: Run, o: &Outcome) {
    let name = run.name();
    let budget = ctx.cfg.iso_budget_mib as f64 * MIB;
    let window = ctx.cfg.iso_window_s as f64;
    let r = &mut ctx.results;
    let mut add = |figure: &str, unit: &str, v: f64| {
        r.add(SCENARIO, &format!("{name}: {figure}"), unit, "ours", v);
    };
    let retained: Vec<f64> = o.readings.iter().map(|s| s.retained as f64).collect();
    if let Some([_, _, p99, max]) = quantiles(&retained) {
        add("retained WAL max", "MiB", max / MIB);
        add("retained WAL p99", "MiB", p99 / MIB);
        add("retained WAL max / budget", "%", max / budget * 100.0);
    }
    let in_window: Vec<_> = o.readings.iter().filter(|s| s.at_s <= window).collect();
    if let (Some(first), Some(last)) = (in_window.first(), in_window.last())
        && last.at_s > first.at_s
    {
        let secs = last.at_s - first.at_s;
        add(
            "WAL written",
            "MiB/s",
            (last.wal - first.wal) as f64 / secs / MIB,
        );
        add(
            "WAL fsyncs",
            "/s",
            (last.wal_syncs - first.wal_syncs) as f64 / secs,
        );
    }
    let pending = o.readings.iter().filter_map(|s| s.billing_pending);
    if let Some(max) = pending.reduce(f64::max) {
        add(
            &format!("billing pending events max (window {WINDOW_EVENTS})"),
            "events",
            max,
        );
    }
    let over: Vec<_> = o
        .readings
        .iter()
        .filter(|s| s.retained as f64 > budget)
        .collect();
    if let (Some(first), Some(last)) = (over.first(), over.last()) {
        r.note(format!(
            "j {name}: retained WAL above the budget in {} of {} readings, from {:.0} s to {:.0} s into the window",
            over.len(),
            o.readings.len(),
            first.at_s,
            last.at_s
        ));
    }
}

/// billing's parked events: how many, when, why, how long the backlog it
/// held when it was parked took to clear, and the most parked dead letters
/// written in one second (one commit each: this is how fast they can go;
/// with the stream's unread WAL behind the window, clearing takes longer
/// than the window's backlog alone suggests).
fn parked(ctx: &mut Ctx, run: Run, o: &Outcome) {
    let name = run.name();
    let rate = ctx.cfg.iso_rate;
    let p = &o.parked;
    let r = &mut ctx.results;
    let mut add = |figure: &str, unit: &str, v: f64| {
        r.add(SCENARIO, &format!("{name}: {figure}"), unit, "ours", v);
    };
    add("billing events parked", "events", p.count as f64);
    if let Some(n) = p.busiest_second {
        add(
            "parked dead letters written, busiest second",
            "/s",
            n as f64,
        );
    }
    if let Some(first) = p.first {
        let parked_s = (first - o.freeze_at) as f64 / 1e6;
        add("billing parked after the freeze", "s", parked_s);
        let pending = |s: &Reading| s.billing_pending.unwrap_or(0.0);
        let backlog = o
            .readings
            .iter()
            .filter(|s| s.at_s >= parked_s - 1.0)
            .map(pending)
            .fold(0.0, f64::max);
        let cleared = o
            .readings
            .iter()
            .find(|s| s.at_s > parked_s && pending(s) < rate)
            .map(|s| s.at_s - parked_s);
        add("billing backlog when parked", "events", backlog);
        match cleared {
            Some(secs) => add("billing backlog cleared after parking", "s", secs),
            None => {
                let seen = o.readings.last().map_or(0.0, |s| s.at_s - parked_s);
                r.note(format!(
                    "j {name}: billing's backlog of {backlog:.0} events did not fall below a second's events in the {seen:.0} s of readings after parking"
                ));
            }
        }
    }
    r.note(format!(
        "j {name}: {} of the window's {} events parked for billing; why: {}",
        p.count,
        o.events,
        p.why.as_deref().unwrap_or("(not parked)")
    ));
}

fn ms_of(lat: &[(i64, f64)]) -> Vec<f64> {
    lat.iter().map(|(_, ms)| *ms).collect()
}

/// The p99 of each minute of the window, by commit time (ms); a last
/// minute with fewer than half the events of the fullest is left out.
fn per_minute_p99(lat: &[(i64, f64)]) -> Vec<f64> {
    let Some(start) = lat.first().map(|(c, _)| *c) else {
        return Vec::new();
    };
    let mut minutes: Vec<Vec<f64>> = Vec::new();
    for (c, ms) in lat {
        let m = usize::try_from((c - start) / 60_000_000).unwrap_or(0);
        if minutes.len() <= m {
            minutes.resize_with(m + 1, Vec::new);
        }
        minutes[m].push(*ms);
    }
    let full = minutes.iter().map(Vec::len).max().unwrap_or(0);
    minutes
        .iter()
        .filter(|m| m.len() * 2 >= full)
        .filter_map(|m| quantiles(m).map(|q| q[2]))
        .collect()
}
