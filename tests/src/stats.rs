//! Order statistics of measured samples: the one percentile definition the
//! demo, the benchmark and the chaos report share, so their p50 and p99
//! mean the same thing.

/// Nearest-rank percentile of `sorted` (ascending): the smallest value with
/// at least `q`·n values at or below it. `q` is clamped to 0..=1; `q = 0`
/// is the minimum and `q = 1` the maximum. `None` when empty.
pub fn percentile<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    // Saturating float-to-int conversion; the clamp keeps the rank in 1..=n.
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn nearest_rank_over_a_hundred_values() {
        let v: Vec<i64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.5), Some(50));
        assert_eq!(percentile(&v, 0.9), Some(90));
        assert_eq!(percentile(&v, 0.99), Some(99));
        assert_eq!(percentile(&v, 1.0), Some(100));
        assert_eq!(percentile(&v, 0.0), Some(1));
        assert_eq!(percentile(&v, 0.001), Some(1));
    }

    #[test]
    fn nearest_rank_rounds_up_and_never_interpolates() {
        let v = [10.0, 20.0, 30.0, 40.0];
        // 0.5·4 = 2: the second value; 0.51·4 = 2.04: the third.
        assert_eq!(percentile(&v, 0.5), Some(20.0));
        assert_eq!(percentile(&v, 0.51), Some(30.0));
        assert_eq!(percentile(&[7.0], 0.99), Some(7.0));
    }

    #[test]
    fn empty_input_and_out_of_range_q() {
        assert_eq!(percentile::<f64>(&[], 0.5), None);
        assert_eq!(percentile(&[1, 2, 3], 1.5), Some(3));
        assert_eq!(percentile(&[1, 2, 3], -1.0), Some(1));
        assert_eq!(percentile(&[1, 2, 3], f64::NAN), Some(1));
    }
}
