//! The figures of a run: one row per scenario and figure, values per
//! contender and run, and the targets the `ours` median is held to.

use std::collections::BTreeMap;

use crate::report::fmt_num;
use crate::stats::{Summary, summarize};

pub(crate) const COLUMNS: [&str; 4] = ["ours", "baseline", "baseline-100ms", "baseline-4w"];

/// A target on the `ours` median.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Target {
    AtMost(f64),
    AtLeast(f64),
}

impl Target {
    pub(crate) fn met(self, v: f64) -> bool {
        match self {
            Target::AtMost(t) => v <= t,
            Target::AtLeast(t) => v >= t,
        }
    }

    pub(crate) fn show(self) -> String {
        match self {
            Target::AtMost(t) => format!("≤ {}", fmt_num(t)),
            Target::AtLeast(t) => format!("≥ {}", fmt_num(t)),
        }
    }
}

/// One figure: values per contender, one per run.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) scenario: String,
    pub(crate) metric: String,
    pub(crate) unit: String,
    pub(crate) target: Option<Target>,
    pub(crate) values: BTreeMap<&'static str, Vec<f64>>,
    /// Compare `ours` with this row's `baseline` column (b: the baseline's
    /// throughput to the same sink).
    pub(crate) baseline_from: Option<String>,
}

#[derive(Default)]
pub(crate) struct Results {
    pub(crate) rows: Vec<Row>,
    pub(crate) notes: Vec<String>,
}

impl Results {
    pub(crate) fn key(scenario: &str, metric: &str) -> String {
        format!("{scenario}/{metric}")
    }

    pub(crate) fn row(&mut self, scenario: &str, metric: &str, unit: &str) -> &mut Row {
        let key = Results::key(scenario, metric);
        let idx = match self
            .rows
            .iter()
            .position(|r| Results::key(&r.scenario, &r.metric) == key)
        {
            Some(i) => i,
            None => {
                self.rows.push(Row {
                    scenario: scenario.to_owned(),
                    metric: metric.to_owned(),
                    unit: unit.to_owned(),
                    target: None,
                    values: BTreeMap::new(),
                    baseline_from: None,
                });
                self.rows.len() - 1
            }
        };
        &mut self.rows[idx]
    }

    pub(crate) fn add(
        &mut self,
        scenario: &str,
        metric: &str,
        unit: &str,
        who: &'static str,
        v: f64,
    ) {
        eprintln!("    {scenario} {metric} [{who}] = {} {unit}", fmt_num(v));
        self.row(scenario, metric, unit)
            .values
            .entry(who)
            .or_default()
            .push(v);
    }

    /// Sets the target of an existing row (figures not measured stay absent).
    pub(crate) fn target(&mut self, scenario: &str, metric: &str, t: Target) {
        let key = Results::key(scenario, metric);
        if let Some(row) = self
            .rows
            .iter_mut()
            .find(|r| Results::key(&r.scenario, &r.metric) == key)
        {
            row.target = Some(t);
        }
    }

    pub(crate) fn note(&mut self, text: String) {
        eprintln!("    note: {text}");
        self.notes.push(text);
    }

    pub(crate) fn summary(&self, key: &str, who: &str) -> Option<Summary> {
        self.rows
            .iter()
            .find(|r| Results::key(&r.scenario, &r.metric) == key)
            .and_then(|r| r.values.get(who))
            .and_then(|v| summarize(v))
    }

    pub(crate) fn baseline_of(&self, row: &Row) -> Option<Summary> {
        match &row.baseline_from {
            Some(key) => self.summary(key, "baseline"),
            None => row.values.get("baseline").and_then(|v| summarize(v)),
        }
    }
}

pub(crate) fn set_targets(r: &mut Results) {
    let lat = [(10, 3.0, 15.0), (100, 5.0, 25.0)];
    for (rate, p50, p99) in lat {
        let scen = format!("a. latency @{rate}/s");
        r.target(&scen, "created_at→created_at p50", Target::AtMost(p50));
        r.target(&scen, "created_at→created_at p99", Target::AtMost(p99));
    }
    for row in r.rows.iter_mut() {
        // The target holds for the default setting; --max-in-flight 1 is the
        // strict-order mode (one round trip at a time) and is not held to it.
        if row.scenario == "b. throughput → null sink" && row.metric == "max-in-flight 64" {
            row.target = Some(Target::AtLeast(30_000.0));
        }
        if row.scenario == "d. memory" && row.unit == "MB" && row.values.contains_key("ours") {
            row.target = Some(Target::AtMost(64.0));
        }
        if row.scenario == "c. idle" && row.metric.starts_with("statements/s") {
            row.target = Some(Target::AtMost(0.1));
        }
        if row.scenario == crate::prune::SCENARIO && row.metric.starts_with("p99 ratio") {
            row.target = Some(Target::AtMost(2.0));
        }
        if row.scenario == crate::isolation::SCENARIO {
            if row.metric.contains("p99 ratio") {
                row.target = Some(Target::AtMost(1.2));
            }
            if row.metric.ends_with("retained WAL max / budget") {
                row.target = Some(Target::AtMost(100.0));
            }
        }
        if row.scenario.starts_with("e. recovery") {
            match row.metric.as_str() {
                "return → first invoice" => row.target = Some(Target::AtMost(0.5)),
                "requests/s to Billing during outage" => row.target = Some(Target::AtMost(2.0)),
                _ => {}
            }
        }
    }
}

/// Relative targets: ours → Billing against Billing's own maximum and the baseline.
pub(crate) fn derived_rows(r: &mut Results) {
    let scen = "b. throughput → Billing";
    let best = |r: &Results, prefix: &str| {
        r.rows
            .iter()
            .filter(|row| row.scenario == scen && row.metric.starts_with(prefix))
            .filter_map(|row| row.values.get("ours").and_then(|v| summarize(v)))
            .map(|s| s.median)
            .fold(f64::NAN, f64::max)
    };
    let ours = best(r, "max-in-flight");
    let ceiling = best(r, "Billing max");
    let base = r
        .summary(&Results::key(scen, "baseline (fixed)"), "baseline")
        .map(|s| s.median);
    if ours.is_finite() && ceiling.is_finite() {
        r.add(
            scen,
            "best ours / Billing max",
            "%",
            "ours",
            ours / ceiling * 100.0,
        );
        r.target(scen, "best ours / Billing max", Target::AtLeast(80.0));
    }
    if let Some(base) = base.filter(|b| *b > 0.0 && ours.is_finite()) {
        r.add(scen, "best ours / baseline", "×", "ours", ours / base);
        r.target(scen, "best ours / baseline", Target::AtLeast(20.0));
    }
    // d: flat under backlog: peak with the big backlog over peak with the small one.
    let big = r
        .rows
        .iter()
        .find(|row| row.scenario == "d. memory" && row.metric.starts_with("peak RSS, "))
        .and_then(|row| row.values.get("ours").and_then(|v| summarize(v)));
    let small = r.summary(
        &Results::key("d. memory", "peak RSS → null sink, mif 64"),
        "ours",
    );
    if let (Some(big), Some(small)) = (big, small) {
        r.add(
            "d. memory",
            "peak RSS big backlog / small backlog",
            "×",
            "ours",
            big.median / small.median,
        );
    }
}
