//! HTTP handlers of the Billing service.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use serde::Deserialize;
use service_common::ServiceError;
use service_common::body::{RawJsonBody, parse_json};
use service_common::metrics::HttpMetrics;
use service_common::pool::Pool;
use service_common::server::Routes;
use service_common::telemetry::{RequestSpan, Spans};

use crate::batch;
use crate::charge::ChargeWorker;
use crate::event::{OrderCreated, parse_uuid};
use crate::signature::SharedVerifier;
use crate::store::{InboxStore, Invoice, Recorded};

/// Optional headers repeating the event id: each, when sent, must equal
/// the body's `id`.
pub const EVENT_ID_HEADERS: [&str; 2] = ["idempotency-key", "webhook-id"];

struct AppState {
    spans: Spans,
    verifier: SharedVerifier,
    store: InboxStore,
    charge: Option<ChargeWorker>,
    verified: IntCounterVec,
    invoiced: IntCounter,
    duplicates: IntCounter,
}

/// The service's own routes: `POST /inbox` (the relay's) on the public
/// listener, `GET /invoices` (an operator's read) on the admin listener;
/// registers `billing_signatures_verified_total{scheme}`,
/// `billing_invoices_created_total` and `billing_duplicates_absorbed_total`
/// in `metrics`. With a `charge` worker, each new invoice starts `pending`
/// and wakes it. Each `POST /inbox` is a span `billing.inbox` of `spans`,
/// a child of the request's `traceparent` (the relay's attempt).
pub fn router(
    pool: Pool,
    metrics: &HttpMetrics,
    spans: Spans,
    verifier: SharedVerifier,
    charge: Option<ChargeWorker>,
) -> anyhow::Result<Routes> {
    let verified = IntCounterVec::new(
        Opts::new(
            "billing_signatures_verified_total",
            "Requests whose signature was accepted, by scheme (standard, legacy)",
        ),
        &["scheme"],
    )?;
    metrics.registry().register(Box::new(verified.clone()))?;
    for scheme in ["standard", "legacy"] {
        verified.with_label_values(&[scheme]);
    }
    let state = Arc::new(AppState {
        spans,
        verifier,
        verified,
        store: InboxStore::new(pool, charge.is_some()),
        charge,
        invoiced: counter(
            metrics.registry(),
            "billing_invoices_created_total",
            "Events recorded for the first time: inbox row and invoice committed.",
        )?,
        duplicates: counter(
            metrics.registry(),
            "billing_duplicates_absorbed_total",
            "Redelivered events answered 204 without any change.",
        )?,
    });
    Ok(Routes {
        public: Router::new()
            .route("/inbox", post(inbox))
            .with_state(Arc::clone(&state)),
        admin: Router::new()
            .route("/invoices", get(invoices))
            .with_state(state),
    })
}

fn counter(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntCounter> {
    let counter = IntCounter::new(name, help)?;
    registry.register(Box::new(counter.clone()))?;
    Ok(counter)
}

/// `POST /inbox`: authenticate the exact bytes, then parse, validate, record.
async fn inbox(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    RawJsonBody(body): RawJsonBody,
) -> Result<Response, ServiceError> {
    let mut span = state.spans.server("billing.inbox", &headers);
    let result = record(&state, &headers, &body, &mut span).await;
    span.end(result)
}

async fn record(
    state: &AppState,
    headers: &HeaderMap,
    body: &[u8],
    span: &mut RequestSpan,
) -> Result<Response, ServiceError> {
    match state.verifier.current().verify(headers, body, unix_now()) {
        Ok(scheme) => state.verified.with_label_values(&[scheme]).inc(),
        Err(refusal) => {
            tracing::warn!(code = refusal.code, detail = %refusal.detail, "rejected event");
            return Err(ServiceError::new(
                StatusCode::UNAUTHORIZED,
                refusal.code,
                refusal.detail,
            ));
        }
    }
    let value = parse_json(body)?;
    if let Some(items) = value.as_array() {
        return record_batch(state, headers, items, span).await;
    }
    if headers.contains_key(batch::BATCH_HEADER) {
        // A marker on a single event's body: the sender and Billing
        // disagree on the format.
        batch::check_marker(headers, 1)?;
    }
    let event = OrderCreated::from_json(&value)?;
    check_event_id_headers(headers, &event)?;
    span.set("outbox.event_id", event.id.to_string());
    let recorded = state.store.record(&event).await?;
    span.set(
        "billing.inbox",
        match recorded {
            Recorded::Invoiced => "new",
            Recorded::Duplicate => "duplicate",
        },
    );
    span.set("billing.invoice_created", recorded == Recorded::Invoiced);
    match recorded {
        Recorded::Invoiced => {
            state.invoiced.inc();
            if let Some(worker) = &state.charge {
                worker.wake();
            }
        }
        Recorded::Duplicate => {
            tracing::debug!(event_id = %event.id, "duplicate delivery absorbed");
            state.duplicates.inc();
        }
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// A verified batch body: its valid events recorded in one transaction
/// (or none); 204 when every element was valid, else 207 answering each
/// event ([`batch::answers`]).
async fn record_batch(
    state: &AppState,
    headers: &HeaderMap,
    items: &[serde_json::Value],
    span: &mut RequestSpan,
) -> Result<Response, ServiceError> {
    let batch::Parsed {
        mut events,
        mut refused,
    } = batch::parse(items, headers)?;
    span.set("billing.batch_size", items.len() as i64);
    // An event whose order another already invoiced fails the statement:
    // it is refused, and the others recorded without it.
    let new = loop {
        if events.is_empty() {
            break 0;
        }
        let batch: Vec<&OrderCreated> = events.iter().map(|(_, e)| e).collect();
        match state.store.record_batch(&batch).await? {
            Ok(new) => break new,
            Err(culprits) => {
                for culprit in culprits.into_iter().rev() {
                    let (i, event) = events.remove(culprit);
                    tracing::warn!(event_id = %event.id, order_id = %event.order_id, "an event of a batch names an order another event already invoiced");
                    refused.push((
                        i,
                        ServiceError::invalid_field(
                            "order_already_invoiced",
                            "data.order_id",
                            "another event already invoiced this order; the event was not recorded",
                        ),
                    ));
                }
            }
        }
    };
    if !refused.is_empty() {
        refused.sort_by_key(|(i, _)| *i);
        span.set("billing.events_refused", refused.len() as i64);
        tracing::warn!(
            batch = items.len(),
            refused = refused.len(),
            "events of a batch refused: answering per event (207)"
        );
    }
    let seen = events.len() as u64 - new;
    span.set("billing.invoices_created", new as i64);
    state.invoiced.inc_by(new);
    state.duplicates.inc_by(seen);
    if seen > 0 {
        tracing::debug!(
            batch = events.len(),
            duplicates = seen,
            "events seen before absorbed"
        );
    }
    if new > 0
        && let Some(worker) = &state.charge
    {
        worker.wake();
    }
    if refused.is_empty() {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    Ok((
        StatusCode::MULTI_STATUS,
        Json(batch::answers(items, &refused)),
    )
        .into_response())
}

/// `Idempotency-Key` and `webhook-id`, when sent, must name the same event
/// as the body.
fn check_event_id_headers(headers: &HeaderMap, event: &OrderCreated) -> Result<(), ServiceError> {
    for (name, field) in EVENT_ID_HEADERS
        .into_iter()
        .zip(["Idempotency-Key", "webhook-id"])
    {
        let Some(key) = headers.get(name) else {
            continue;
        };
        match key.to_str().ok().and_then(parse_uuid) {
            Some(id) if id == event.id => {}
            _ => {
                return Err(ServiceError::invalid_field(
                    "invalid_event",
                    field,
                    "must equal the body's id",
                ));
            }
        }
    }
    Ok(())
}

/// Seconds since the Unix epoch, now (for `webhook-timestamp`).
fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

#[derive(Deserialize)]
struct InvoiceQuery {
    order_id: Option<String>,
}

/// `GET /invoices?order_id=<uuid>`.
async fn invoices(
    State(state): State<Arc<AppState>>,
    query: Result<Query<InvoiceQuery>, QueryRejection>,
) -> Result<Json<Vec<Invoice>>, ServiceError> {
    let order_id = query
        .ok()
        .and_then(|Query(q)| q.order_id)
        .as_deref()
        .and_then(parse_uuid)
        .ok_or_else(|| ServiceError::bad_request("invalid_query", "order_id=<uuid> is required"))?;
    Ok(Json(state.store.invoices_for(order_id).await?))
}
