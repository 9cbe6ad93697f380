//! A batch's attempts (`docs/architecture.md#batches`): one request for
//! several events, split when refused, judged per event on a 207.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Instant;

use crate::breaker::{Admission, Signal};
use crate::dead_letter::DeadLetterStore;
use crate::dispatch::lane::Lane;
use crate::dispatch::span::BatchSpans;
use crate::dispatch::{DispatchError, Persist};
use crate::metrics::{AttemptOutcome, Metrics};
use crate::outbox::OutboxEvent;
use crate::sink::answers::{self, EventAnswer};
use crate::sink::{Attempt, Disposition, Prepared, Reason, ReasonLabel, Sink, classify};

use super::Ctx;
use super::attempt::{
    Answered, Carried, Finished, InFlight, Tried, Waited, count_attempt, count_delivered, deliver,
    failed, interrupted, poisoned, status_of, unless_interrupted, until_answered,
};
use super::judge::{EventVerdict, Verdict, failure_label, judge, unnamed_in_207};

/// The result of [`deliver_group`]: each event's end, in order.
pub(super) type GroupDelivered<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<Finished>, DispatchError>> + Send + 'a>>;

/// Delivers `events` (each with its job's `seq`; of distinct aggregates:
/// the scheduler runs one job per aggregate at a time) at `lane` as one
/// request, a batch (`docs/architecture.md#batches`), until they are done
/// there or handed back; one event goes as [`deliver`] sends it. A 2xx
/// does every event; a failure retries the whole batch (backoff, breaker,
/// `Retry-After` as for one event); a refusal (poison, 413 included)
/// splits it in halves, each delivered the same way, until the refused
/// event is alone and dead-lettered as any poison event, and every other
/// event of the batch delivered. A 207 with per-event answers
/// ([`crate::sink::answers`]) judges each event by its own status: done,
/// dead-lettered, or sent again (with the other events not done, after a
/// backoff).
pub(super) fn deliver_group<'a, S: Sink, D: DeadLetterStore>(
    lane: &'a Lane<S>,
    ctx: &'a Ctx<D>,
    events: &'a [(u64, &'a OutboxEvent)],
) -> GroupDelivered<'a> {
    Box::pin(async move {
        let mut done: Vec<Option<Finished>> = vec![None; events.len()];
        // The events not done yet, by index, in body order.
        let mut todo: Vec<usize> = (0..events.len()).collect();
        let first_attempt = crate::clock::unix_micros();
        let mut attempts: u32 = 0;
        let mut backoff = lane.backoff();
        while let Some(&first) = todo.first() {
            if let [i] = todo[..] {
                done[i] = Some(deliver(lane, ctx, events[i].0, events[i].1).await?);
                break;
            }
            let members: Vec<&OutboxEvent> = todo.iter().map(|&i| events[i].1).collect();
            let (id, request) = lane.sink.prepare_batch(&members);
            let carried = Carried::Batch(&members, &id);
            let (verdicts, retry_after) =
                match until_answered(lane, ctx, events[first].0, carried, &request, &mut attempts)
                    .await
                {
                    Answered::Delivered(status) => {
                        tracing::debug!(batch = %id, events = members.len(), attempts, "delivered");
                        todo.iter()
                            .for_each(|&i| done[i] = Some(Finished::Delivered(status)));
                        break;
                    }
                    Answered::Ended(finished) => {
                        todo.iter().for_each(|&i| done[i] = Some(finished.clone()));
                        break;
                    }
                    Answered::Refused(..) | Answered::Split => {
                        let rest: Vec<(u64, &OutboxEvent)> =
                            todo.iter().map(|&i| events[i]).collect();
                        let (left, right) = rest.split_at(rest.len() / 2);
                        let ends = if lane.cfg.in_commit_order() {
                            // The earlier half first, and an event the
                            // endpoint keeps failing holds the rest, as it
                            // does without batches.
                            let mut ends = deliver_group(lane, ctx, left).await?;
                            ends.extend(deliver_group(lane, ctx, right).await?);
                            ends
                        } else {
                            // The halves go at once: a half whose event the
                            // endpoint keeps failing must not hold the other
                            // back.
                            let (left, right) = tokio::join!(
                                deliver_group(lane, ctx, left),
                                deliver_group(lane, ctx, right)
                            );
                            let mut ends = left?;
                            ends.extend(right?);
                            ends
                        };
                        todo.iter().zip(ends).for_each(|(&i, f)| done[i] = Some(f));
                        break;
                    }
                    Answered::PerEvent(verdicts, retry_after) => (verdicts, retry_after),
                };
            let mut again = Vec::new();
            for (&i, verdict) in todo.iter().zip(verdicts) {
                match verdict {
                    EventVerdict::Delivered(status) => done[i] = Some(Finished::Delivered(status)),
                    EventVerdict::Poison(r, attempt) => {
                        let event = events[i].1;
                        let end =
                            poisoned(lane, ctx, event, (&r, &attempt), attempts, first_attempt);
                        done[i] = Some(end.await?);
                    }
                    EventVerdict::Again(detail) => again.push((i, detail)),
                }
            }
            let Some((_, detail)) = again.first() else {
                break;
            };
            if ctx.persist != Persist::UntilDone {
                let failing = Finished::Failing(detail.clone());
                again
                    .iter()
                    .for_each(|&(i, _)| done[i] = Some(failing.clone()));
                break;
            }
            let delay = backoff.next_delay(retry_after, &mut rand::rng());
            tracing::warn!(
                endpoint = %lane.name, batch = %id, events = again.len(), detail = %detail,
                retry_in_ms = delay.as_millis() as u64, "events of a batch answered per event are not done; will retry them"
            );
            todo = again.into_iter().map(|(i, _)| i).collect();
            let slept = unless_interrupted(lane, ctx, tokio::time::sleep(delay)).await;
            if !matches!(slept, Waited::Done(())) {
                let finished = interrupted(&slept);
                todo.iter().for_each(|&i| done[i] = Some(finished.clone()));
                break;
            }
        }
        Ok(done
            .into_iter()
            .map(|f| f.expect("every event of a batch ends"))
            .collect())
    })
}

/// One attempt of a batch, as [`attempt`] makes one for an event. A
/// refusal is not poison for the breaker's storm guard (it counts events,
/// and judges each once the batch is split down to it): the endpoint
/// answered, and the batch is split. A 207 is read as per-event answers;
/// one that does not read so is a refusal of the batch.
pub(super) async fn attempt_batch<S: Sink, D>(
    lane: &Lane<S>,
    ctx: &Ctx<D>,
    admission: Admission,
    events: &[&OutboxEvent],
    id: &str,
    request: &Prepared,
    number: u32,
) -> Tried {
    let metrics = &ctx.metrics;
    let spans = BatchSpans::start(
        lane.tracer.as_ref(),
        &lane.name,
        (id, events),
        number,
        metrics.clock_skew.get(),
    );
    let started = Instant::now();
    let attempt = {
        let _in_flight = InFlight::start(metrics, &lane.metrics);
        let trace = spans.as_ref().and_then(BatchSpans::headers);
        lane.sink.post(id, request, trace).await
    };
    metrics
        .request_duration
        .observe(started.elapsed().as_secs_f64());
    let disposition = match classify(&attempt, &lane.cfg.policy) {
        // Too large: the batch is the relay's making, so it is split
        // whatever --poison-statuses says of 413 (the events alone are
        // judged by it); never "the endpoint rejects the relay".
        Disposition::ConfigFault(r) if r.status == Some(413) => Disposition::DeadLetter(r),
        d => d,
    };
    if let Some(spans) = spans {
        spans.end(&attempt, failure_label(&disposition));
    }
    let carried = Carried::Batch(events, id);
    match disposition {
        Disposition::Delivered => {
            if let Attempt::Response {
                status: 207,
                excerpt,
                ..
            } = &attempt
            {
                let why = match answers::parse(excerpt) {
                    // Naming none of the batch's events says nothing of
                    // any: sent again as it is, it would be forever.
                    Ok(answers) if !events.iter().any(|e| answers.contains_key(&e.id)) => {
                        "its results name none of the batch's events".to_owned()
                    }
                    Ok(answers) => {
                        return per_event(lane, metrics, admission, carried, &answers, attempt);
                    }
                    Err(why) => why,
                };
                lane.breaker
                    .record(admission, Signal::DeadLettered, "http_207");
                count_attempt(metrics, AttemptOutcome::Split, &attempt);
                tracing::warn!(
                    endpoint = %lane.name, batch = %id, events = events.len(), why = %why,
                    "the endpoint answered the batch 207 without per-event answers (docs/architecture.md#batches): splitting it"
                );
                let r = Reason {
                    label: ReasonLabel::HttpOther,
                    status: Some(207),
                };
                return Tried::Poison(r, attempt);
            }
            lane.breaker.record(admission, Signal::Success, "");
            count_attempt(metrics, AttemptOutcome::Delivered, &attempt);
            for event in events {
                count_delivered(lane, metrics, event);
            }
            Tried::Delivered(status_of(&attempt))
        }
        // During a poison storm, a refusal waits like a transient failure.
        Disposition::DeadLetter(r) if lane.breaker.in_storm() => failed(
            lane,
            metrics,
            (admission, AttemptOutcome::Retry, Signal::Transient, r),
            attempt,
            carried,
        ),
        Disposition::DeadLetter(r) => {
            // Answered, but no event done: the storm guard's run goes on.
            lane.breaker
                .record(admission, Signal::DeadLettered, &r.to_string());
            count_attempt(metrics, AttemptOutcome::Split, &attempt);
            tracing::info!(
                endpoint = %lane.name, batch = %id, events = events.len(), reason = %r,
                detail = %attempt.detail(), "the endpoint refuses the batch: splitting it"
            );
            Tried::Poison(r, attempt)
        }
        other => match judge(lane, metrics, other, &attempt, id) {
            Verdict::Failed(outcome, signal, reason) => failed(
                lane,
                metrics,
                (admission, outcome, signal, reason),
                attempt,
                carried,
            ),
            Verdict::Delivered | Verdict::Poison(_) => {
                unreachable!("neither delivered nor refused, so failed")
            }
        },
    }
}

/// A 207 read as per-event answers (`answers`, by event id): each event
/// of the batch judged by its own answer, as a response to it alone
/// would be ([`judge`]), and the request recorded once, by what it did:
/// a 410 or a configuration fault among the answers tells the breaker so
/// (and counts the attempt so); else an event taken counts as a 2xx (the
/// endpoint works), else a failure as a transient one, else (every event
/// refused) as a poison verdict. Events to send again count a retry
/// (by the first one's reason), and the answer's `Retry-After` pauses the
/// endpoint, as for any failed attempt. An event the answer does not name
/// is not done: sent again.
fn per_event<S>(
    lane: &Lane<S>,
    metrics: &Metrics,
    admission: Admission,
    carried: Carried<'_>,
    answers: &HashMap<String, EventAnswer>,
    attempt: Attempt,
) -> Tried {
    let Carried::Batch(events, id) = carried else {
        unreachable!("only a batch is answered per event")
    };
    let retry_after = match &attempt {
        Attempt::Response { retry_after, .. } => *retry_after,
        _ => None,
    };
    let mut verdicts = Vec::with_capacity(events.len());
    let (mut taken, mut refused) = (false, false);
    // The failure the breaker hears of: a 410 before a configuration
    // fault before the first transient one.
    let mut failure: Option<(AttemptOutcome, Signal, Reason)> = None;
    let rank = |s: &Signal| match s {
        Signal::Retired => 2,
        Signal::ConfigFault(_) => 1,
        _ => 0,
    };
    for event in events {
        let Some(answer) = answers.get(event.id.as_str()) else {
            verdicts.push(EventVerdict::Again("not named in the 207 answer".into()));
            failure.get_or_insert((AttemptOutcome::Retry, Signal::Transient, unnamed_in_207()));
            continue;
        };
        let one = Attempt::Response {
            status: answer.status,
            retry_after: None,
            excerpt: answer.error.clone(),
        };
        match judge(
            lane,
            metrics,
            classify(&one, &lane.cfg.policy),
            &one,
            &event.id,
        ) {
            Verdict::Delivered => {
                taken = true;
                count_delivered(lane, metrics, event);
                verdicts.push(EventVerdict::Delivered(answer.status));
            }
            Verdict::Poison(r) => {
                refused = true;
                tracing::warn!(
                    endpoint = %lane.name, event_id = %event.id, commit_lsn = %crate::shown(&event.commit_lsn), reason = %r,
                    batch = %id, detail = %one.detail(), "poison event: the endpoint refuses it (answered per event)"
                );
                verdicts.push(EventVerdict::Poison(r, one));
            }
            Verdict::Failed(outcome, signal, reason) => {
                verdicts.push(EventVerdict::Again(one.detail()));
                if failure.as_ref().is_none_or(|f| rank(&signal) > rank(&f.1)) {
                    failure = Some((outcome, signal, reason));
                }
            }
        }
    }
    match failure {
        Some((outcome, signal, reason)) => {
            let (outcome, signal) = match signal {
                Signal::Retired | Signal::ConfigFault(_) => (outcome, signal),
                _ if taken => (AttemptOutcome::Delivered, Signal::Success),
                _ => (outcome, signal),
            };
            failed(
                lane,
                metrics,
                (admission, outcome, signal, reason),
                attempt,
                carried,
            );
        }
        None if taken => {
            lane.breaker.record(admission, Signal::Success, "");
            count_attempt(metrics, AttemptOutcome::Delivered, &attempt);
        }
        None => {
            debug_assert!(refused, "a batch has events");
            lane.breaker
                .record(admission, Signal::DeadLettered, "http_207");
            count_attempt(metrics, AttemptOutcome::DeadLetter, &attempt);
        }
    }
    Tried::PerEvent(verdicts, retry_after)
}

/// A batch's event ids for a log line: the first 20, then how many more.
pub(super) fn ids_of(events: &[&OutboxEvent]) -> String {
    let mut ids: Vec<&str> = events.iter().take(20).map(|e| e.id.as_str()).collect();
    let more = format!("… and {} more", events.len().saturating_sub(20));
    if events.len() > 20 {
        ids.push(&more);
    }
    ids.join(",")
}
