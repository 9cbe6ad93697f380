//! Pure helpers of the benchmark: percentiles, run summaries, and the
//! Prometheus text format (histogram buckets and their quantiles).

/// Nearest-rank percentile (`q` in 0..=1) of `sorted` (ascending); `None` when empty.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let q = q.clamp(0.0, 1.0);
    // Nearest rank: the smallest value with at least q·n values at or below it.
    let rank = (q * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// p50, p90, p99 and max of `values` (any order); `None` when empty.
pub fn quantiles(values: &[f64]) -> Option<[f64; 4]> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    Some([
        percentile(&sorted, 0.50)?,
        percentile(&sorted, 0.90)?,
        percentile(&sorted, 0.99)?,
        *sorted.last()?,
    ])
}

/// Median, min and max of the runs of one figure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Median (mean of the two middle values for an even count).
    pub median: f64,
    /// Smallest run.
    pub min: f64,
    /// Largest run.
    pub max: f64,
    /// Number of runs.
    pub n: usize,
}

/// Summary of `values`; `None` when empty.
pub fn summarize(values: &[f64]) -> Option<Summary> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    let median = if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    };
    Some(Summary {
        median,
        min: sorted[0],
        max: sorted[n - 1],
        n,
    })
}

/// One sample of the Prometheus text format.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name (with `_bucket`, `_sum`, `_count` suffixes as exposed).
    pub name: String,
    /// Label pairs.
    pub labels: Vec<(String, String)>,
    /// Value.
    pub value: f64,
}

/// Parses the text exposition format; comments and malformed lines are skipped.
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let split = line.find(['{', ' '])?;
    let (name, mut rest) = line.split_at(split);
    let mut labels = Vec::new();
    if let Some(body) = rest.strip_prefix('{') {
        let end = body.find('}')?;
        for pair in body[..end].split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = pair.split_once('=')?;
            labels.push((k.trim().to_owned(), v.trim().trim_matches('"').to_owned()));
        }
        rest = &body[end + 1..];
    }
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// Sum of every sample named `name`.
pub fn sum(samples: &[Sample], name: &str) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .map(|s| s.value)
        .sum()
}

/// Cumulative buckets `(le, count)` of histogram `name`, ascending by `le`
/// (`+Inf` last).
pub fn buckets(samples: &[Sample], name: &str) -> Vec<(f64, f64)> {
    let bucket = format!("{name}_bucket");
    let mut out: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| s.name == bucket)
        .filter_map(|s| {
            let le = s.labels.iter().find(|(k, _)| k == "le")?.1.as_str();
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, s.value))
        })
        .collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// `after − before`, bucket by bucket (the observations between two scrapes).
pub fn bucket_delta(before: &[(f64, f64)], after: &[(f64, f64)]) -> Vec<(f64, f64)> {
    after
        .iter()
        .map(|&(le, n)| {
            let old = before
                .iter()
                .find(|(l, _)| *l == le)
                .map_or(0.0, |(_, c)| *c);
            (le, n - old)
        })
        .collect()
}

/// Quantile `q` of cumulative `buckets`, interpolated linearly inside the
/// bucket it falls in (as PromQL's `histogram_quantile`); a quantile in the
/// `+Inf` bucket returns the largest finite bound. `None` when empty.
pub fn histogram_quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total;
    let mut prev_le = 0.0;
    let mut prev_count = 0.0;
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(prev_le);
            }
            let in_bucket = count - prev_count;
            if in_bucket <= 0.0 {
                return Some(le);
            }
            return Some(prev_le + (le - prev_le) * (rank - prev_count) / in_bucket);
        }
        prev_le = le;
        prev_count = count;
    }
    Some(prev_le)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(50.0));
        assert_eq!(percentile(&v, 0.99), Some(99.0));
        assert_eq!(percentile(&v, 1.0), Some(100.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&[7.0], 0.99), Some(7.0));
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(quantiles(&[3.0, 1.0, 2.0]), Some([2.0, 3.0, 3.0, 3.0]));
    }

    #[test]
    fn summaries_take_the_middle() {
        let s = summarize(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max, s.n), (2.0, 1.0, 3.0, 3));
        assert_eq!(summarize(&[1.0, 4.0]).unwrap().median, 2.5);
        assert!(summarize(&[]).is_none());
    }

    #[test]
    fn histogram_parsing_delta_and_quantiles() {
        let before = parse_metrics(
            "# HELP h x\nh_bucket{le=\"0.001\"} 1\nh_bucket{le=\"0.002\"} 1\nh_bucket{le=\"+Inf\"} 1\nh_count 1\n",
        );
        let after = parse_metrics(
            "h_bucket{le=\"0.001\"} 1\nh_bucket{le=\"0.002\"} 11\nh_bucket{le=\"+Inf\"} 12\nh_count 12\n",
        );
        let d = bucket_delta(&buckets(&before, "h"), &buckets(&after, "h"));
        assert_eq!(d, vec![(0.001, 0.0), (0.002, 10.0), (f64::INFINITY, 11.0)]);
        let p50 = histogram_quantile(&d, 0.5).unwrap();
        assert!((p50 - 0.00155).abs() < 1e-9, "{p50}");
        assert_eq!(histogram_quantile(&d, 1.0), Some(0.002));
        assert_eq!(histogram_quantile(&[], 0.5), None);
        assert_eq!(sum(&after, "h_count"), 12.0);
    }
}
