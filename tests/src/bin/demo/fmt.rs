//! How the demo prints durations, rates and LSNs.

use std::time::Duration;

use harness::stats::percentile;

pub(crate) fn q(sorted: &[i64], quantile: f64) -> String {
    percentile(sorted, quantile).map_or_else(|| "-".to_owned(), fmt_us)
}

pub(crate) fn fmt_us(us: i64) -> String {
    fmt_seconds(us as f64 / 1e6)
}

pub(crate) fn fmt_seconds(s: f64) -> String {
    if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

pub(crate) fn fmt_duration(d: Duration) -> String {
    fmt_seconds(d.as_secs_f64())
}

pub(crate) fn fmt_rate(rate: f64) -> String {
    if rate.fract() == 0.0 {
        format!("{rate:.0}")
    } else {
        format!("{rate}")
    }
}

/// PostgreSQL's text form of an LSN.
pub(crate) fn fmt_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_text_form() {
        assert_eq!(fmt_lsn(0x1_0000_00A0), "1/A0");
    }

    #[test]
    fn quantiles_print_as_milliseconds_or_seconds() {
        assert_eq!(q(&[1_500, 2_500, 90_000], 0.5), "2.5 ms");
        assert_eq!(q(&[1_500, 2_500, 90_000], 1.0), "90.0 ms");
        assert_eq!(q(&[], 0.5), "-");
        assert_eq!(fmt_seconds(2.5), "2.50 s");
        assert_eq!(fmt_rate(50.0), "50");
        assert_eq!(fmt_rate(12.5), "12.5");
    }
}
