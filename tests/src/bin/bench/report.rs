//! The run's table and JSON.

use std::time::Instant;

use serde_json::{Value, json};

use crate::Config;
use crate::results::{COLUMNS, Results};
use crate::stats::{Summary, summarize};

pub(crate) fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        return "–".to_owned();
    }
    let a = v.abs();
    if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

pub(crate) fn fmt_summary(s: Option<Summary>) -> String {
    match s {
        None => String::new(),
        Some(s) if s.n == 1 => fmt_num(s.median),
        Some(s) => format!(
            "{} ({}–{}, n={})",
            fmt_num(s.median),
            fmt_num(s.min),
            fmt_num(s.max),
            s.n
        ),
    }
}

pub(crate) fn render_table(r: &Results) -> String {
    let header = [
        "scenario",
        "figure",
        "unit",
        "ours",
        "baseline",
        "ours/baseline",
        "baseline-100ms",
        "baseline-4w",
        "target",
        "met",
    ];
    let mut lines: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    for row in &r.rows {
        let ours = row.values.get("ours").and_then(|v| summarize(v));
        let base = r.baseline_of(row);
        let ratio = match (ours, base) {
            (Some(o), Some(b)) if b.median != 0.0 => fmt_num(o.median / b.median),
            _ => String::new(),
        };
        let col = |c: &str| fmt_summary(row.values.get(c).and_then(|v| summarize(v)));
        let (target, met) = match (row.target, ours) {
            (Some(t), Some(o)) => (
                t.show(),
                if t.met(o.median) { "yes" } else { "NO" }.to_owned(),
            ),
            (Some(t), None) => (t.show(), "?".to_owned()),
            _ => (String::new(), String::new()),
        };
        let base_col = if row.baseline_from.is_some() {
            base.map(|b| format!("{}*", fmt_num(b.median)))
                .unwrap_or_default()
        } else {
            col("baseline")
        };
        lines.push(vec![
            row.scenario.clone(),
            row.metric.clone(),
            row.unit.clone(),
            col("ours"),
            base_col,
            ratio,
            col("baseline-100ms"),
            col("baseline-4w"),
            target,
            met,
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            lines
                .iter()
                .map(|l| l[i].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for (n, l) in lines.iter().enumerate() {
        out.push('|');
        for (i, cell) in l.iter().enumerate() {
            out.push_str(&format!(" {cell:<w$} |", w = widths[i]));
        }
        out.push('\n');
        if n == 0 {
            out.push('|');
            for w in &widths {
                out.push_str(&format!("{}|", "-".repeat(w + 2)));
            }
            out.push('\n');
        }
    }
    out.push_str(
        "* the baseline's figure for the same sink (its throughput does not depend on --max-in-flight)\n",
    );
    out
}

pub(crate) fn machine_info(pg: &str, pgss: bool, load_before: &str, load_after: &str) -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .map(|l| l.split_whitespace().nth(1).unwrap_or("").to_owned())
        .unwrap_or_default();
    json!({
        "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu_model": model,
        "mem_total_kb": mem,
        "postgresql": pg,
        "pg_stat_statements": pgss,
        "loadavg_before": load_before.trim(),
        "loadavg_after": load_after.trim(),
    })
}

pub(crate) fn to_json(
    r: &Results,
    machine: &Value,
    cfg: &Config,
    quick: bool,
    runs: u32,
    started: Instant,
) -> Value {
    let rows: Vec<Value> = r
        .rows
        .iter()
        .map(|row| {
            let mut contenders = serde_json::Map::new();
            for c in COLUMNS {
                if let Some(v) = row.values.get(c) {
                    let s = summarize(v);
                    contenders.insert(
                        c.to_owned(),
                        json!({
                            "values": v,
                            "median": s.map(|s| s.median),
                            "min": s.map(|s| s.min),
                            "max": s.map(|s| s.max),
                            "runs": v.len(),
                        }),
                    );
                }
            }
            let ours = row.values.get("ours").and_then(|v| summarize(v));
            let base = r.baseline_of(row);
            let ratio = match (ours, base) {
                (Some(o), Some(b)) if b.median != 0.0 => Some(o.median / b.median),
                _ => None,
            };
            json!({
                "scenario": row.scenario,
                "figure": row.metric,
                "unit": row.unit,
                "contenders": contenders,
                "baseline_median": base.map(|b| b.median),
                "ratio_ours_over_baseline": ratio,
                "target": row.target.map(|t| t.show()),
                "met": match (row.target, ours) {
                    (Some(t), Some(o)) => Some(t.met(o.median)),
                    _ => None,
                },
            })
        })
        .collect();
    json!({
        "machine": machine,
        "quick": quick,
        "runs": runs,
        "config": cfg,
        "elapsed_s": started.elapsed().as_secs_f64(),
        "rows": rows,
        "notes": r.notes,
    })
}
