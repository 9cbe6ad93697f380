//! What an answer means: the one judgement from a response (or one
//! event's answer in a 207) to the breaker's signal and the attempt's
//! outcome, shared by single requests and batches.

use crate::breaker::Signal;
use crate::dispatch::lane::Lane;
use crate::metrics::{AttemptOutcome, Metrics};
use crate::sink::answers;
use crate::sink::{Attempt, Disposition, Reason, ReasonLabel, config_fault_hint};

/// The answer to one event's request, read as a batch's 207 is
/// (`docs/architecture.md#batches`): a 207 whose body reads as per-event
/// answers stands for the event's own answer, as if that status (with
/// the 207's `Retry-After`) had been the response. A 207 naming only
/// other events, or whose body does not read as per-event answers (any
/// other shape, cut short, over [`answers::ANSWERS_BYTES`]), is an `Err`:
/// its reason, why, and the 207; the event is not done and is sent
/// again. A 207 is Multi-Status: it never means "taken" by itself. Any
/// other answer is returned as it is.
pub(super) fn own_answer(
    attempt: Attempt,
    event_id: &str,
) -> Result<Attempt, (Reason, String, Attempt)> {
    let Attempt::Response {
        status: 207,
        retry_after,
        excerpt,
    } = &attempt
    else {
        return Ok(attempt);
    };
    let mut answers = match answers::parse(excerpt) {
        Ok(answers) => answers,
        Err(why) => return Err((unnamed_in_207(), why, attempt)),
    };
    match answers.remove(event_id) {
        Some(own) => Ok(Attempt::Response {
            status: own.status,
            retry_after: *retry_after,
            excerpt: own.error,
        }),
        None => Err((
            unnamed_in_207(),
            "the answer does not name the event".into(),
            attempt,
        )),
    }
}

/// Why an event a 207 does not name is sent again.
pub(super) fn unnamed_in_207() -> Reason {
    Reason {
        label: ReasonLabel::HttpOther,
        status: Some(207),
    }
}

/// What an answer about one event means ([`judge`]).
pub(super) enum Verdict {
    /// A 2xx: the event is done.
    Delivered,
    /// Poison, and no poison storm is on: the event is dead-lettered.
    Poison(Reason),
    /// Not done, to be sent again: the attempt's outcome label, what the
    /// breaker is told, and why.
    Failed(AttemptOutcome, Signal, Reason),
}

/// Judges the answer `attempt` about event `event_id` (its
/// `disposition` by [`classify`]): the one mapping from an answer to the
/// breaker's signal and the attempt's outcome, for a response to one event
/// and for each event's answer in a batch's 207 alike. A poison verdict
/// goes through the storm guard (during a storm it waits like a transient
/// failure).
pub(super) fn judge<S>(
    lane: &Lane<S>,
    metrics: &Metrics,
    disposition: Disposition,
    attempt: &Attempt,
    event_id: &str,
) -> Verdict {
    match disposition {
        Disposition::Delivered => Verdict::Delivered,
        Disposition::DeadLetter(r) if lane.breaker.poison(event_id) => Verdict::Poison(r),
        Disposition::DeadLetter(r) | Disposition::Retry(r) => {
            Verdict::Failed(AttemptOutcome::Retry, Signal::Transient, r)
        }
        Disposition::ConfigFault(r) => {
            let hint = config_fault_hint(&r, attempt, metrics.clock_skew.get());
            Verdict::Failed(AttemptOutcome::ConfigFault, Signal::ConfigFault(hint), r)
        }
        Disposition::Retired(r) => Verdict::Failed(AttemptOutcome::Retired, Signal::Retired, r),
    }
}

/// One event's verdict in a batch's 207 ([`Tried::PerEvent`]).
#[derive(Clone, Debug)]
pub(super) enum EventVerdict {
    /// Taken with this status (counted delivered).
    Delivered(u16),
    /// Refused as poison (its answer as the attempt): to be dead-lettered.
    Poison(Reason, Attempt),
    /// Not done (the answer's detail): sent again.
    Again(String),
}

/// The reason label an attempt's span records as `error.type`: `None`
/// when it was delivered.
pub(super) fn failure_label(disposition: &Disposition) -> Option<&'static str> {
    match disposition {
        Disposition::Delivered => None,
        Disposition::DeadLetter(r)
        | Disposition::Retry(r)
        | Disposition::ConfigFault(r)
        | Disposition::Retired(r) => Some(r.label.as_str()),
    }
}
