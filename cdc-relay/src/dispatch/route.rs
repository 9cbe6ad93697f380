//! Which endpoints an event goes to: the routes of a routes file (`run
//! --routes`), or everything to the one endpoint of `--sink-url`.
//!
//! An endpoint is a *lane* of the dispatcher, numbered in the file's order.
//! An event type goes to every lane with a pattern that matches it
//! (fan-out); one that matches none is *unrouted*
//! (`docs/architecture.md#routing`). Pure: no I/O, no clock.

use std::collections::HashMap;
use std::sync::Arc;

/// What happens to an event no endpoint's `event_types` match.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Unrouted {
    /// Written to the dead-letter table with reason `unrouted` (the
    /// default: nothing is dropped silently).
    #[default]
    DeadLetter,
    /// Counted in `cdc_relay_unrouted_events_total{action="skip"}`, logged
    /// once per type, and done at once.
    Skip,
}

impl Unrouted {
    /// The `action` label of `cdc_relay_unrouted_events_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Unrouted::DeadLetter => "dead_letter",
            Unrouted::Skip => "skip",
        }
    }
}

/// An `event_types` entry: an exact name, or a glob where `*` stands for
/// any run of characters (including none). No other character is special.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern(String);

impl Pattern {
    /// The pattern as written in the routes file.
    pub fn new(text: &str) -> Self {
        Pattern(text.to_owned())
    }

    /// The text as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `event_type` matches the whole pattern.
    pub fn matches(&self, event_type: &str) -> bool {
        glob_match(self.0.as_bytes(), event_type.as_bytes())
    }
}

/// `*`-only glob over bytes, greedy with backtracking to the last star:
/// linear in practice, never recursive.
fn glob_match(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() && pattern[p] == b'*' {
            star = Some((p, t));
            p += 1;
        } else if p < pattern.len() && pattern[p] == text[t] {
            p += 1;
            t += 1;
        } else if let Some((sp, st)) = star {
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|b| *b == b'*')
}

/// Distinct event types remembered before the cache starts over (a bound
/// on memory whatever the stream carries).
const CACHE_TYPES: usize = 10_000;

/// Maps an event type to the lanes (endpoints) it goes to.
#[derive(Clone, Debug)]
pub struct Router {
    /// Per lane, its patterns; `None`: every event.
    lanes: Vec<Option<Vec<Pattern>>>,
    /// `true`: every event goes to lane 0 (`--sink-url`), without a
    /// lookup.
    single: bool,
    /// `[0]`, what every event of the one-endpoint router gets.
    lane_zero: Arc<[usize]>,
    unrouted: Unrouted,
    cache: HashMap<String, Arc<[usize]>>,
}

impl Router {
    /// Every event to lane 0: the one endpoint of `--sink-url`.
    pub fn single() -> Self {
        Self::new(vec![None], Unrouted::DeadLetter)
    }

    /// A router over lanes with these patterns, in lane order (`None`: the
    /// lane takes every event).
    pub fn new(lanes: Vec<Option<Vec<Pattern>>>, unrouted: Unrouted) -> Self {
        Router {
            single: matches!(lanes.as_slice(), [None]),
            lanes,
            lane_zero: Arc::from([0]),
            unrouted,
            cache: HashMap::new(),
        }
    }

    /// Number of lanes (endpoints).
    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// Whether this is the one-endpoint router of `--sink-url`.
    pub fn is_single(&self) -> bool {
        self.single
    }

    /// The unrouted policy.
    pub fn unrouted(&self) -> Unrouted {
        self.unrouted
    }

    /// The lanes `event_type` goes to, in lane order; empty: unrouted.
    pub fn route(&mut self, event_type: &str) -> Arc<[usize]> {
        if self.single {
            return Arc::clone(&self.lane_zero);
        }
        if let Some(lanes) = self.cache.get(event_type) {
            return Arc::clone(lanes);
        }
        let lanes: Arc<[usize]> = self.matching(event_type).into();
        if self.cache.len() >= CACHE_TYPES {
            self.cache.clear();
        }
        self.cache.insert(event_type.to_owned(), Arc::clone(&lanes));
        lanes
    }

    /// The lanes `event_type` goes to, without the cache.
    pub fn matching(&self, event_type: &str) -> Vec<usize> {
        if self.single {
            return vec![0];
        }
        self.lanes
            .iter()
            .enumerate()
            .filter(|(_, patterns)| {
                patterns
                    .as_ref()
                    .is_none_or(|ps| ps.iter().any(|p| p.matches(event_type)))
            })
            .map(|(lane, _)| lane)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn globs_match_whole_names() {
        let cases = [
            ("OrderCreated", "OrderCreated", true),
            ("OrderCreated", "OrderCreatedX", false),
            ("Order*", "OrderCreated", true),
            ("Order*", "Order", true),
            ("Order*", "XOrder", false),
            ("*Created", "OrderCreated", true),
            ("*Created", "OrderCreatedV2", false),
            ("*", "", true),
            ("a*b*c", "aXbYc", true),
            ("a*b*c", "aXbY", false),
            ("a*a", "aaa", true),
            ("", "", true),
            ("", "a", false),
            ("invoice.*", "invoice.paid", true),
            ("invoice.*", "invoice-paid", false),
        ];
        for (p, t, want) in cases {
            assert_eq!(Pattern::new(p).matches(t), want, "{p:?} vs {t:?}");
        }
    }

    #[test]
    fn fan_out_and_unrouted() {
        let mut r = Router::new(
            vec![
                Some(vec![Pattern::new("Order*")]),
                Some(vec![Pattern::new("OrderCreated"), Pattern::new("Invoice*")]),
                Some(vec![Pattern::new("Shipment*")]),
            ],
            Unrouted::DeadLetter,
        );
        assert_eq!(&*r.route("OrderCreated"), &[0, 1]);
        assert_eq!(&*r.route("OrderCancelled"), &[0]);
        assert_eq!(&*r.route("InvoicePaid"), &[1]);
        assert!(r.route("Refund").is_empty());
        assert_eq!(&*r.route("OrderCreated"), &[0, 1], "cached");
        assert_eq!(&*Router::single().route("anything"), &[0]);
    }

    /// The matcher against a regular-expression-free reference: `*` splits
    /// the pattern into literal parts that must appear in order, the first
    /// as a prefix and the last as a suffix.
    fn reference(pattern: &str, text: &str) -> bool {
        let parts: Vec<&str> = pattern.split('*').collect();
        if parts.len() == 1 {
            return pattern == text;
        }
        let (first, last) = (parts[0], parts[parts.len() - 1]);
        if !text.starts_with(first) || text.len() < first.len() + last.len() {
            return false;
        }
        let mut rest = &text[first.len()..text.len() - last.len()];
        if !text.ends_with(last) {
            return false;
        }
        for part in &parts[1..parts.len() - 1] {
            match rest.find(part) {
                Some(i) => rest = &rest[i + part.len()..],
                None => return false,
            }
        }
        true
    }

    proptest! {
        #[test]
        fn glob_agrees_with_the_reference(p in "[ab*]{0,6}", t in "[ab]{0,8}") {
            prop_assert_eq!(Pattern::new(&p).matches(&t), reference(&p, &t), "{:?} vs {:?}", p, t);
        }
    }
}
