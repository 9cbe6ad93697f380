//! A batch's attempts (`docs/architecture.md#batches`): one request for
//! several events, split when refused, judged per event on a 207.

use std::future::Future;
use std::pin::Pin;
use std::time::Instant;

use crate::breaker::{Admission, Signal};
use crate::dead_letter::DeadLetterStore;
use crate::dispatch::lane::Lane;
use crate::dispatch::span::BatchSpans;
use crate::dispatch::{DispatchError, Persist};
use crate::metrics::AttemptOutcome;
use crate::outbox::OutboxEvent;
use crate::sink::answers;
use crate::sink::{
    Attempt, Disposition, Prepared, Reason, ReasonLabel, Sink, classify, config_fault_hint,
};

use super::Ctx;
use super::attempt::{
    Answered, Carried, Finished, InFlight, Tried, Waited, count_attempt, count_delivered, deliver,
    failed, failure_label, interrupted, poisoned, status_of, unless_interrupted, until_answered,
};

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
            let answers =
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
                        // The halves go at once: a half whose event the
                        // endpoint keeps failing must not hold the other back.
                        let rest: Vec<(u64, &OutboxEvent)> =
                            todo.iter().map(|&i| events[i]).collect();
                        let (left, right) = rest.split_at(rest.len() / 2);
                        let (left, right) = tokio::join!(
                            deliver_group(lane, ctx, left),
                            deliver_group(lane, ctx, right)
                        );
                        let mut ends = left?;
                        ends.extend(right?);
                        todo.iter().zip(ends).for_each(|(&i, f)| done[i] = Some(f));
                        break;
                    }
                    Answered::PerEvent(answers) => answers,
                };
            let mut again = Vec::new();
            for &i in &todo {
                let event = events[i].1;
                let Some(answer) = answers.get(event.id.as_str()) else {
                    again.push((i, "not named in the answer".to_owned()));
                    continue;
                };
                let attempt = Attempt::Response {
                    status: answer.status,
                    retry_after: None,
                    excerpt: answer.error.clone(),
                };
                match classify(&attempt, &lane.cfg.policy) {
                    Disposition::Delivered => {
                        count_delivered(lane, &ctx.metrics, event);
                        done[i] = Some(Finished::Delivered(answer.status));
                    }
                    Disposition::DeadLetter(r) if lane.breaker.poison(&event.id) => {
                        tracing::warn!(
                            endpoint = %lane.name, event_id = %event.id, commit_lsn = %crate::shown(&event.commit_lsn), reason = %r,
                            batch = %id, detail = %attempt.detail(), "poison event: the endpoint refuses it (answered per event)"
                        );
                        let end =
                            poisoned(lane, ctx, event, (&r, &attempt), attempts, first_attempt);
                        done[i] = Some(end.await?);
                    }
                    _ => again.push((i, attempt.detail())),
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
            let delay = backoff.next_delay(None, &mut rand::rng());
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
    let disposition = classify(&attempt, &lane.cfg.policy);
    if let Some(spans) = spans {
        spans.end(&attempt, failure_label(&disposition));
    }
    let (outcome, signal, reason) = match disposition {
        Disposition::Delivered => {
            if let Attempt::Response {
                status: 207,
                excerpt,
                ..
            } = &attempt
            {
                let why = match answers::parse(excerpt) {
                    Ok(answers) => {
                        // A 2xx for the breaker only when an event is done:
                        // that ends the storm guard's run of refusals.
                        let done = answers.values().any(|a| (200..300).contains(&a.status));
                        // During a storm, refusals wait like failures.
                        let signal = if done {
                            Signal::Success
                        } else if lane.breaker.in_storm() {
                            Signal::Transient
                        } else {
                            Signal::DeadLettered
                        };
                        lane.breaker.record(admission, signal, "http_207");
                        count_attempt(metrics, AttemptOutcome::Delivered, &attempt);
                        return Tried::PerEvent(answers);
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
            return Tried::Delivered(status_of(&attempt));
        }
        // During a poison storm, a refusal waits like a transient failure.
        Disposition::DeadLetter(r) if lane.breaker.in_storm() => {
            (AttemptOutcome::Retry, Signal::Transient, r)
        }
        Disposition::DeadLetter(r) => {
            // Answered, but no event done: the storm guard's run goes on.
            lane.breaker
                .record(admission, Signal::DeadLettered, &r.to_string());
            count_attempt(metrics, AttemptOutcome::Split, &attempt);
            tracing::info!(
                endpoint = %lane.name, batch = %id, events = events.len(), reason = %r,
                detail = %attempt.detail(), "the endpoint refuses the batch: splitting it"
            );
            return Tried::Poison(r, attempt);
        }
        Disposition::Retry(r) => (AttemptOutcome::Retry, Signal::Transient, r),
        Disposition::ConfigFault(r) => {
            let hint = config_fault_hint(&r, &attempt, metrics.clock_skew.get());
            (AttemptOutcome::ConfigFault, Signal::ConfigFault(hint), r)
        }
        Disposition::Retired(r) => (AttemptOutcome::Retired, Signal::Retired, r),
    };
    failed(
        lane,
        metrics,
        (admission, outcome, signal, reason),
        attempt,
        Carried::Batch(events, id),
    )
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
