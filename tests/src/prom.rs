//! The Prometheus text exposition format (0.0.4), parsed strictly: the one
//! parser behind the system tests, the demo and the benchmark.
//!
//! Strict means a malformed line is an error naming the line, never skipped:
//! every sample belongs to a family with a `# TYPE` line, label values are
//! quoted and escaped, values are numbers, and each histogram's `+Inf`
//! bucket equals its `_count`. A scrape that parses is one Prometheus would
//! ingest as the operator expects.
//!
//! The histogram arithmetic the demo and the benchmark report with lives
//! here too: cumulative buckets, the observations between two scrapes, and
//! PromQL's `histogram_quantile`.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Context;

/// The metric types a `# TYPE` line may name.
const KINDS: [&str; 5] = ["counter", "gauge", "histogram", "summary", "untyped"];

/// Suffixes of the samples of a histogram or summary family.
const SERIES_SUFFIXES: [&str; 3] = ["_bucket", "_sum", "_count"];

/// One parsed scrape.
#[derive(Debug, Default)]
pub struct Exposition {
    /// Family name → type, from the `# TYPE` lines.
    types: BTreeMap<String, String>,
    samples: Vec<Sample>,
}

/// One sample line: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The sample's name as exposed (with `_bucket`, `_sum`, `_count`).
    pub name: String,
    /// Label name → unescaped value.
    pub labels: BTreeMap<String, String>,
    /// The value (`+Inf`, `-Inf` and `NaN` included).
    pub value: f64,
}

impl Sample {
    /// The value of label `key`, if the sample has it.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.get(key).map(String::as_str)
    }
}

impl Exposition {
    /// Parses a whole scrape; the first malformed line is the error.
    pub fn parse(text: &str) -> anyhow::Result<Exposition> {
        let mut e = Exposition::default();
        for (n, line) in text.lines().enumerate() {
            let at = || format!("line {}: {line:?}", n + 1);
            if line.is_empty() {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').with_context(at)?;
                anyhow::ensure!(is_metric_name(name), "bad name, {}", at());
                anyhow::ensure!(KINDS.contains(&kind), "bad type, {}", at());
                e.types.insert(name.to_owned(), kind.to_owned());
                continue;
            }
            if line.starts_with('#') {
                continue;
            }
            let sample = parse_sample(line).with_context(at)?;
            anyhow::ensure!(
                e.family_of(&sample.name).is_some(),
                "sample without a # TYPE, {}",
                at()
            );
            e.samples.push(sample);
        }
        e.check_histograms()?;
        Ok(e)
    }

    /// The type of `family` (`counter`, `gauge`, ...), if it has a `# TYPE` line.
    pub fn kind(&self, family: &str) -> Option<&str> {
        self.types.get(family).map(String::as_str)
    }

    /// Every family with a `# TYPE` line.
    pub fn families(&self) -> impl Iterator<Item = &str> {
        self.types.keys().map(String::as_str)
    }

    /// Every sample, in exposition order.
    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// Whether any sample belongs to `family`.
    pub fn has_samples(&self, family: &str) -> bool {
        self.samples
            .iter()
            .any(|s| self.family_of(&s.name) == Some(family))
    }

    /// Sum of every sample named exactly `name`, whatever its labels; 0
    /// (not `-0`, which `Iterator::sum` gives for no samples) when absent.
    pub fn sum(&self, name: &str) -> f64 {
        self.samples
            .iter()
            .filter(|s| s.name == name)
            .fold(0.0, |total, s| total + s.value)
    }

    /// The sample named `name` with exactly these labels.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        self.samples
            .iter()
            .find(|s| s.name == name && s.labels == want)
            .map(|s| s.value)
    }

    /// The values label `label` takes on the samples named `name`.
    pub fn label_values(&self, name: &str, label: &str) -> BTreeSet<String> {
        self.samples
            .iter()
            .filter(|s| s.name == name)
            .filter_map(|s| s.labels.get(label).cloned())
            .collect()
    }

    /// Sums of the samples named `name` whose label `filter.0` is
    /// `filter.1`, grouped by the value of label `by` (empty when absent).
    pub fn sum_by(&self, name: &str, filter: (&str, &str), by: &str) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for s in self.samples.iter().filter(|s| s.name == name) {
            if s.label(filter.0) == Some(filter.1) {
                let key = s.label(by).unwrap_or_default().to_owned();
                *out.entry(key).or_insert(0.0) += s.value;
            }
        }
        out
    }

    /// Cumulative buckets `(le, count)` of histogram `family`, ascending by
    /// `le` (`+Inf` last).
    pub fn buckets(&self, family: &str) -> Vec<(f64, f64)> {
        let bucket = format!("{family}_bucket");
        let mut out: Vec<(f64, f64)> = self
            .samples
            .iter()
            .filter(|s| s.name == bucket)
            .filter_map(|s| Some((parse_value(s.label("le")?).ok()?, s.value)))
            .collect();
        out.sort_by(|a, b| a.0.total_cmp(&b.0));
        out
    }

    /// The family a sample name belongs to.
    fn family_of(&self, sample: &str) -> Option<&str> {
        if let Some((family, _)) = self.types.get_key_value(sample) {
            return Some(family);
        }
        SERIES_SUFFIXES.iter().find_map(|suffix| {
            let family = sample.strip_suffix(suffix)?;
            let (k, kind) = self.types.get_key_value(family)?;
            (kind == "histogram" || kind == "summary").then_some(k.as_str())
        })
    }

    fn check_histograms(&self) -> anyhow::Result<()> {
        for (family, _) in self.types.iter().filter(|(_, k)| *k == "histogram") {
            let bucket = format!("{family}_bucket");
            if let Some(s) = self
                .samples
                .iter()
                .find(|s| s.name == bucket && s.label("le").is_none())
            {
                anyhow::bail!("{family}: a bucket without le: {s:?}");
            }
            let inf = self
                .samples
                .iter()
                .filter(|s| s.name == bucket && s.label("le") == Some("+Inf"))
                .map(|s| s.value)
                .sum::<f64>();
            let count = self.sum(&format!("{family}_count"));
            anyhow::ensure!(
                inf == count,
                "{family}: +Inf bucket {inf} != _count {count}"
            );
        }
        Ok(())
    }
}

/// `GET <base>/metrics`, parsed strictly.
pub async fn scrape(http: &reqwest::Client, base: &str) -> anyhow::Result<Exposition> {
    let url = format!("{base}/metrics");
    let text = http
        .get(&url)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .with_context(|| format!("GET {url}"))?
        .text()
        .await?;
    Exposition::parse(&text).with_context(|| format!("parsing {url}"))
}

/// Whether `s` is a valid metric (or label) name: `[a-zA-Z_:][a-zA-Z0-9_:]*`.
pub fn is_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `after − before`, bucket by bucket: the observations between two scrapes.
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

/// Quantile `q` (clamped to 0..=1) of cumulative `buckets`, interpolated
/// linearly inside the bucket it falls in, as PromQL's
/// `histogram_quantile`; a quantile in the `+Inf` bucket is the largest
/// finite bound. `None` when there are no observations.
pub fn histogram_quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total;
    let (mut prev_le, mut prev_count) = (0.0, 0.0);
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
        (prev_le, prev_count) = (le, count);
    }
    Some(prev_le)
}

/// `name{k="v",...} value [timestamp]`.
fn parse_sample(line: &str) -> anyhow::Result<Sample> {
    let name_end = line.find(['{', ' ']).context("no value")?;
    let name = &line[..name_end];
    anyhow::ensure!(is_metric_name(name), "bad metric name {name:?}");
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(body) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(body)?;
        labels = parsed;
        rest = after;
    }
    let mut fields = rest
        .strip_prefix(' ')
        .context("no space before the value")?
        .split(' ');
    let value = parse_value(fields.next().context("no value")?)?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().context("bad timestamp")?;
    }
    anyhow::ensure!(fields.next().is_none(), "trailing fields");
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// Parses `k="v",k2="v2"}` and returns the labels and what follows `}`.
fn parse_labels(mut s: &str) -> anyhow::Result<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    loop {
        if let Some(after) = s.strip_prefix('}') {
            return Ok((labels, after));
        }
        let (key, rest) = s.split_once("=\"").context("label without =\"")?;
        anyhow::ensure!(is_metric_name(key), "bad label name {key:?}");
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next().context("unterminated label value")? {
                (_, '\\') => match chars.next().context("dangling escape")?.1 {
                    'n' => value.push('\n'),
                    c @ ('\\' | '"') => value.push(c),
                    c => anyhow::bail!("bad escape \\{c}"),
                },
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        anyhow::ensure!(
            labels.insert(key.to_owned(), value).is_none(),
            "label {key} twice"
        );
        s = &rest[end + 1..];
        s = s.strip_prefix(',').unwrap_or(s);
    }
}

fn parse_value(v: &str) -> anyhow::Result<f64> {
    match v {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => v.parse().with_context(|| format!("bad value {v:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_families_samples_and_escaped_labels() {
        let text = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\\\"q\"} 3\n\
                    # TYPE billing_http_requests_total counter\n\
                    billing_http_requests_total{method=\"POST\",route=\"/inbox\",status=\"204\"} 12\n\
                    billing_http_requests_total{method=\"POST\",route=\"/inbox\",status=\"401\"} 2\n\
                    # TYPE g gauge\ng 7 1700000000000\n\
                    # TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 0.5\nh_count 2\n";
        let m = Exposition::parse(text).expect("valid text");
        assert_eq!(m.value("a_total", &[("x", "1\"q")]), Some(3.0));
        assert_eq!(m.kind("h"), Some("histogram"));
        assert_eq!(
            m.families().collect::<Vec<_>>(),
            ["a_total", "billing_http_requests_total", "g", "h"]
        );
        assert!(m.has_samples("h"));
        assert_eq!(m.value("g", &[]), Some(7.0));
        assert_eq!(m.sum("billing_http_requests_total"), 14.0);
        assert_eq!(
            m.sum_by("billing_http_requests_total", ("route", "/inbox"), "status"),
            BTreeMap::from([("204".to_owned(), 12.0), ("401".to_owned(), 2.0)])
        );
        assert_eq!(
            m.label_values("billing_http_requests_total", "status"),
            BTreeSet::from(["204".to_owned(), "401".to_owned()])
        );
        assert_eq!(m.buckets("h"), vec![(f64::INFINITY, 2.0)]);
        assert_eq!(format!("{:.0}", m.sum("absent_total")), "0");
    }

    #[test]
    fn rejects_malformed_text() {
        for bad in [
            "a_total 1\n",                                              // no TYPE
            "# TYPE a gauge\na{x=1} 1\n",                               // unquoted label
            "# TYPE a gauge\na{x=\"1\" 1\n",                            // unterminated labels
            "# TYPE a gauge\na{x=\"\\t\"} 1\n",                         // bad escape
            "# TYPE a gauge\na{x=\"1\",x=\"2\"} 1\n",                   // label twice
            "# TYPE a gauge\na 1 2 3\n",                                // trailing junk
            "# TYPE a gauge\na 1 soon\n",                               // bad timestamp
            "# TYPE a gauge\na one\n",                                  // not a number
            "# TYPE a gauge\na\n",                                      // no value
            "# TYPE a wobble\na 1\n",                                   // unknown type
            "# TYPE 1a gauge\n",                                        // bad family name
            "# TYPE a_total counter\na_total_bucket 1\n",               // suffix of a counter
            "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_count 3\n", // +Inf != count
            "# TYPE h histogram\nh_bucket 2\nh_count 2\n",              // bucket without le
        ] {
            assert!(Exposition::parse(bad).is_err(), "accepted {bad:?}");
        }
    }

    #[test]
    fn histogram_quantile_interpolates_within_the_bucket() {
        let m = Exposition::parse(
            "# TYPE h histogram\n\
             h_bucket{le=\"0.01\"} 0\nh_bucket{le=\"0.02\"} 100\nh_bucket{le=\"+Inf\"} 100\n\
             h_sum 1.5\nh_count 100\n",
        )
        .expect("valid text");
        let p50 = histogram_quantile(&m.buckets("h"), 0.5).expect("observations");
        assert!((p50 - 0.015).abs() < 1e-9, "{p50}");
        assert_eq!(histogram_quantile(&m.buckets("absent"), 0.5), None);
    }

    #[test]
    fn bucket_delta_gives_the_observations_between_two_scrapes() {
        let before = Exposition::parse(
            "# HELP h x\n# TYPE h histogram\n\
             h_bucket{le=\"0.001\"} 1\nh_bucket{le=\"0.002\"} 1\nh_bucket{le=\"+Inf\"} 1\nh_count 1\n",
        )
        .expect("valid text");
        let after = Exposition::parse(
            "# TYPE h histogram\n\
             h_bucket{le=\"0.001\"} 1\nh_bucket{le=\"0.002\"} 11\nh_bucket{le=\"+Inf\"} 12\nh_count 12\n",
        )
        .expect("valid text");
        let d = bucket_delta(&before.buckets("h"), &after.buckets("h"));
        assert_eq!(d, vec![(0.001, 0.0), (0.002, 10.0), (f64::INFINITY, 11.0)]);
        let p50 = histogram_quantile(&d, 0.5).expect("observations");
        assert!((p50 - 0.00155).abs() < 1e-9, "{p50}");
        assert_eq!(
            histogram_quantile(&d, 1.0),
            Some(0.002),
            "the +Inf bucket gives the largest finite bound"
        );
        assert_eq!(histogram_quantile(&[], 0.5), None);
        assert_eq!(after.sum("h_count"), 12.0);
    }
}
