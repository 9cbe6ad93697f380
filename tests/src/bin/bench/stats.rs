//! Pure helpers of the benchmark: the quantiles of one run and the summary
//! of repeated runs. The percentile itself is the harness's
//! ([`harness::stats::percentile`]); the Prometheus parsing and histogram
//! quantiles are [`harness::prom`]'s.

use harness::stats::percentile;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_of_one_run() {
        assert_eq!(quantiles(&[3.0, 1.0, 2.0]), Some([2.0, 3.0, 3.0, 3.0]));
        let v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(quantiles(&v), Some([50.0, 90.0, 99.0, 100.0]));
        assert_eq!(quantiles(&[]), None);
    }

    #[test]
    fn summaries_take_the_middle() {
        let s = summarize(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max, s.n), (2.0, 1.0, 3.0, 3));
        assert_eq!(summarize(&[1.0, 4.0]).unwrap().median, 2.5);
        assert!(summarize(&[]).is_none());
    }
}
