//! A trace context as the outbox stores it, and as HTTP carries it.
//!
//! The column holds the [`traceparent`](https://www.w3.org/TR/trace-context/#traceparent-header)
//! value and, when the trace carries vendor state, one space and the
//! [`tracestate`](https://www.w3.org/TR/trace-context/#tracestate-header)
//! value (a `traceparent` never contains a space):
//!
//! ```text
//! 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01
//! 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 congo=t61rcWkgMzE,rojo=00f067aa0ba902b7
//! ```
//!
//! Parsing follows the W3C rules as the OpenTelemetry propagator applies
//! them (the field widths in lowercase hex, no all-zero ids; version `00`
//! has exactly four fields, a later version may append fields and is read
//! as `00`), plus the ones it leaves out: one `traceparent` header only,
//! several `tracestate` headers combined. A value that breaks them is no
//! context at all, never an error: the event is delivered as if the column
//! were NULL.
//!
//! `tracestate` is bounded where it enters (W3C Trace Context, "tracestate
//! Limits"): members that break the W3C grammar are dropped one by one
//! (not the whole state), a key is kept once (its first, the latest),
//! at most 32 members are kept, and beyond [`MAX_STATE`] bytes members
//! longer than 128 bytes go first, then members from the end. A producer
//! cannot make an outbox row's context, or a request's header, larger
//! than that.

use std::collections::HashMap;

use opentelemetry::Context;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanContext, TraceContextExt, TraceFlags};
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// `traceparent`, the header name.
pub const TRACEPARENT: &str = "traceparent";
/// `tracestate`, the header name.
pub const TRACESTATE: &str = "tracestate";

/// Bytes of `tracestate` kept at most (the W3C floor every vendor must
/// propagate).
pub const MAX_STATE: usize = 512;

/// Bytes a parsed context may hold in memory at most (ids, flags and a
/// [`MAX_STATE`] state with its bookkeeping): what a queue bounded in
/// bytes counts for it.
pub const MAX_HELD: usize = 2 * MAX_STATE + 128;

/// The span context in a stored value, remote and valid; `None` for a value
/// that is not a valid `traceparent` (optionally followed by a space and a
/// `tracestate`).
pub fn parse(text: &str) -> Option<SpanContext> {
    let text = text.trim();
    let (parent, state) = match text.split_once(' ') {
        Some((p, s)) => (p, s.trim()),
        None => (text, ""),
    };
    extract(parent, Some(state))
}

/// The context of `traceparent` and `tracestate` values, checked and
/// bounded as the module doc says.
fn extract(parent: &str, state: Option<&str>) -> Option<SpanContext> {
    if !well_formed(parent) {
        return None;
    }
    let mut carrier = HashMap::with_capacity(2);
    carrier.insert(TRACEPARENT.to_owned(), parent.to_owned());
    if let Some(state) = state.map(bounded).filter(|s| !s.is_empty()) {
        carrier.insert(TRACESTATE.to_owned(), state);
    }
    valid(TraceContextPropagator::new().extract(&carrier))
}

/// `state` within the limits of the module doc.
fn bounded(state: &str) -> String {
    let mut keys: Vec<&str> = Vec::new();
    let mut members: Vec<&str> = state
        .split(',')
        .map(|m| m.trim_matches([' ', '\t']))
        .filter(|m| {
            // The first of a key is the latest (W3C: a vendor puts its
            // member first), and keys are unique.
            member_key(m).is_some_and(|k| {
                let fresh = !keys.contains(&k);
                keys.push(k);
                fresh
            })
        })
        .take(32)
        .collect();
    let len = |m: &[&str]| {
        m.iter()
            .map(|s| s.len() + 1)
            .sum::<usize>()
            .saturating_sub(1)
    };
    if len(&members) > MAX_STATE {
        members.retain(|m| m.len() <= 128);
    }
    while len(&members) > MAX_STATE {
        members.pop();
    }
    members.join(",")
}

/// The key of a `tracestate` list member that follows the W3C grammar
/// (W3C Trace Context, "tracestate Header Field Values": a simple key, or
/// `tenant@system`; a value of printable ASCII without `,` and `=`, not
/// ending in a space); `None` for any other member. One member that breaks
/// it is dropped alone: the propagator would drop the whole state.
fn member_key(member: &str) -> Option<&str> {
    let (key, value) = member.split_once('=')?;
    let key_char = |b: u8| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'*' | b'/');
    let part = |s: &str, max: usize, alpha_first: bool| {
        let b = s.as_bytes();
        !b.is_empty()
            && b.len() <= max
            && (if alpha_first {
                b[0].is_ascii_lowercase()
            } else {
                b[0].is_ascii_lowercase() || b[0].is_ascii_digit()
            })
            && b.iter().all(|&c| key_char(c))
    };
    let key_ok = match key.split_once('@') {
        None => part(key, 256, true),
        Some((tenant, system)) => part(tenant, 241, false) && part(system, 14, true),
    };
    let value_ok = !value.is_empty()
        && value.len() <= 256
        && !value.ends_with(' ')
        && value
            .bytes()
            .all(|b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=');
    (key_ok && value_ok).then_some(key)
}

/// The stored form of `cx`; `None` when it is not a valid context.
pub fn format(cx: &SpanContext) -> Option<String> {
    let (parent, state) = headers(cx)?;
    Some(match state {
        Some(state) => format!("{parent} {state}"),
        None => parent,
    })
}

/// The `traceparent` value for `cx` and its `tracestate` value when it has
/// one; `None` when `cx` is not valid.
pub fn headers(cx: &SpanContext) -> Option<(String, Option<String>)> {
    if !cx.is_valid() {
        return None;
    }
    // What the propagator's inject writes, without its map (this runs once
    // per attempt): version 00, the ids in lowercase hex, the sampled bit.
    let flags = cx.trace_flags() & TraceFlags::SAMPLED;
    let parent = format!(
        "00-{}-{}-{:02x}",
        cx.trace_id(),
        cx.span_id(),
        flags.to_u8()
    );
    let state = cx.trace_state().header();
    Some((parent, (!state.is_empty()).then_some(state)))
}

/// The remote span context of an incoming request's `traceparent` (and
/// `tracestate`) headers; `None` when absent or invalid.
pub fn from_headers(headers: &http::HeaderMap) -> Option<SpanContext> {
    let mut parents = headers.get_all(TRACEPARENT).iter();
    let parent = parents.next()?.to_str().ok()?;
    if parents.next().is_some() {
        return None;
    }
    let states: Vec<&str> = headers
        .get_all(TRACESTATE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let state = (!states.is_empty()).then(|| states.join(","));
    extract(parent.trim(), state.as_deref())
}

/// The field widths the propagator leaves unchecked: 2, 32, 16 and 2
/// lowercase hex digits; version `00` has nothing after them, a later
/// version may append fields after a `-`.
fn well_formed(parent: &str) -> bool {
    let mut fields = parent.split('-');
    let widths = [2, 32, 16, 2].iter().all(|&width| {
        fields.next().is_some_and(|f| {
            f.len() == width && f.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        })
    });
    widths && (parent.len() == 55 || (!parent.starts_with("00") && parent.as_bytes()[55] == b'-'))
}

fn valid(context: Context) -> Option<SpanContext> {
    let cx = context.span().span_context().clone();
    cx.is_valid().then_some(cx)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn round_trips_with_and_without_state() {
        let cx = parse(PARENT).expect("valid");
        assert_eq!(
            cx.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(cx.span_id().to_string(), "00f067aa0ba902b7");
        assert!(cx.is_sampled() && cx.is_remote());
        assert_eq!(format(&cx).as_deref(), Some(PARENT));

        let with_state = format!("{PARENT} congo=t61rcWkgMzE,rojo=00f067aa0ba902b7");
        let cx = parse(&with_state).expect("valid");
        assert_eq!(cx.trace_state().get("congo"), Some("t61rcWkgMzE"));
        assert_eq!(format(&cx).as_deref(), Some(with_state.as_str()));
        assert_eq!(
            headers(&cx).unwrap().1.as_deref(),
            Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
        );
    }

    #[test]
    fn unsampled_flag_is_kept() {
        let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        let cx = parse(unsampled).expect("valid");
        assert!(!cx.is_sampled());
        assert_eq!(format(&cx).as_deref(), Some(unsampled));
    }

    #[test]
    fn invalid_values_are_no_context() {
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-00",
        ] {
            assert!(parse(bad).is_none(), "{bad:?} must not parse");
        }
    }

    #[test]
    fn a_later_version_is_read_as_00() {
        let cx = parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-beef").unwrap();
        assert_eq!(format(&cx).as_deref(), Some(PARENT));
    }

    #[test]
    fn tracestate_is_bounded() {
        let long = format!("big={}", "x".repeat(300));
        let many: Vec<String> = (0..40).map(|i| format!("k{i}=v{i}")).collect();
        let state = format!("{long},{},bad=\u{e9},tab=a\tb,noequals", many.join(","));
        let cx = parse(&format!("{PARENT} {state}")).expect("valid");
        let kept = cx.trace_state().header();
        assert!(kept.len() <= MAX_STATE, "{kept}");
        assert!(!kept.contains("big="), "the long member goes first: {kept}");
        assert!(!kept.contains("bad=") && !kept.contains("tab="), "{kept}");
        assert!(kept.starts_with("k0=v0,k1=v1"), "{kept}");
        // The long member's value is past 256 bytes: not a member at all.
        assert_eq!(kept.split(',').count(), 32, "32 members at most: {kept}");
        let huge = format!("{PARENT} a={}", "y".repeat(100_000));
        assert_eq!(parse(&huge).unwrap().trace_state().header(), "");
    }

    #[test]
    fn a_tracestate_member_that_breaks_the_grammar_goes_alone_and_keys_are_unique() {
        // A tester's: a duplicated key went on unchanged, and one bad
        // member cost every other member.
        for (state, kept) in [
            ("a=1,b=2,a=3", "a=1,b=2"),
            ("a=1,Bad=2,c=3", "a=1,c=3"),
            ("a=1,b=x=y,c=3", "a=1,c=3"),
            ("t@sys=1,1t@s=2,t@Sys=3,@s=4", "t@sys=1,1t@s=2"),
            // Spaces around a member are the list's, not the value's.
            ("a=1, b=2 ,c=3", "a=1,b=2,c=3"),
            ("a=,b=2", "b=2"),
        ] {
            let cx = parse(&format!("{PARENT} {state}")).expect("valid");
            assert_eq!(cx.trace_state().header(), kept, "{state}");
        }
    }

    #[test]
    fn several_traceparents_are_no_context_and_tracestates_combine() {
        let mut map = http::HeaderMap::new();
        map.append(TRACEPARENT, PARENT.parse().unwrap());
        map.append(TRACESTATE, "a=1".parse().unwrap());
        map.append(TRACESTATE, "b=2".parse().unwrap());
        assert_eq!(
            from_headers(&map).unwrap().trace_state().header(),
            "a=1,b=2"
        );
        map.append(TRACEPARENT, PARENT.parse().unwrap());
        assert!(from_headers(&map).is_none());
    }

    #[test]
    fn headers_are_read() {
        let mut map = http::HeaderMap::new();
        assert!(from_headers(&map).is_none());
        map.insert(TRACEPARENT, PARENT.parse().unwrap());
        map.insert(TRACESTATE, "a=b".parse().unwrap());
        let cx = from_headers(&map).expect("valid");
        assert_eq!(cx.trace_state().get("a"), Some("b"));
    }
}
