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
//! them (version `00` exactly, no all-zero ids, lowercase hex); a value
//! that breaks them is no context at all, never an error: the event is
//! delivered as if the column were NULL.

use std::collections::HashMap;

use opentelemetry::Context;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanContext, TraceContextExt};
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// `traceparent`, the header name.
pub const TRACEPARENT: &str = "traceparent";
/// `tracestate`, the header name.
pub const TRACESTATE: &str = "tracestate";

/// The span context in a stored value, remote and valid; `None` for a value
/// that is not a valid `traceparent` (optionally followed by a space and a
/// `tracestate`).
pub fn parse(text: &str) -> Option<SpanContext> {
    let text = text.trim();
    let (parent, state) = match text.split_once(' ') {
        Some((p, s)) => (p, s.trim()),
        None => (text, ""),
    };
    if !well_formed(parent) {
        return None;
    }
    let mut carrier = HashMap::with_capacity(2);
    carrier.insert(TRACEPARENT.to_owned(), parent.to_owned());
    if !state.is_empty() {
        carrier.insert(TRACESTATE.to_owned(), state.to_owned());
    }
    valid(TraceContextPropagator::new().extract(&carrier))
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
    let mut carrier: HashMap<String, String> = HashMap::with_capacity(2);
    let context = Context::new().with_remote_span_context(cx.clone());
    TraceContextPropagator::new().inject_context(&context, &mut carrier);
    let parent = carrier.remove(TRACEPARENT)?;
    let state = carrier.remove(TRACESTATE).filter(|s| !s.is_empty());
    Some((parent, state))
}

/// The remote span context of an incoming request's `traceparent` (and
/// `tracestate`) headers; `None` when absent or invalid.
pub fn from_headers(headers: &http::HeaderMap) -> Option<SpanContext> {
    let parent = headers.get(TRACEPARENT)?.to_str().ok()?;
    if !well_formed(parent.trim()) {
        return None;
    }
    valid(TraceContextPropagator::new().extract(&opentelemetry_http::HeaderExtractor(headers)))
}

/// The field widths the propagator leaves unchecked: 2, 32, 16 and 2
/// lowercase hex digits (a later version may append fields after a `-`).
fn well_formed(parent: &str) -> bool {
    let mut fields = parent.split('-');
    [2, 32, 16, 2].iter().all(|&width| {
        fields.next().is_some_and(|f| {
            f.len() == width && f.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        })
    })
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
        ] {
            assert!(parse(bad).is_none(), "{bad:?} must not parse");
        }
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
