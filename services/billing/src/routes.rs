//! HTTP handlers of the Billing service.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use deadpool_postgres::Pool;
use prometheus::{IntCounter, Registry};
use serde::Deserialize;
use service_common::ServiceError;
use service_common::body::{RawJsonBody, parse_json};
use service_common::metrics::HttpMetrics;

use crate::event::{OrderCreated, parse_uuid};
use crate::signature::EventSecrets;
use crate::store::{InboxStore, Invoice, Recorded};

/// Header carrying the body's HMAC (`docs/architecture.md#wire-format`).
pub const SIGNATURE_HEADER: &str = "x-event-signature";

/// Optional header repeating the event id.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

struct AppState {
    secrets: EventSecrets,
    store: InboxStore,
    invoiced: IntCounter,
    duplicates: IntCounter,
}

/// The service's own routes (`POST /inbox`, `GET /invoices`); registers
/// `billing_invoices_created_total` and `billing_duplicates_absorbed_total`
/// in `metrics`.
pub fn router(pool: Pool, metrics: &HttpMetrics, secrets: EventSecrets) -> anyhow::Result<Router> {
    let state = Arc::new(AppState {
        secrets,
        store: InboxStore::new(pool),
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
    Ok(Router::new()
        .route("/inbox", post(inbox))
        .route("/invoices", get(invoices))
        .with_state(state))
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
) -> Result<StatusCode, ServiceError> {
    let signature = headers.get(SIGNATURE_HEADER).map(|v| v.as_bytes());
    if !state.secrets.verify(&body, signature) {
        tracing::warn!(
            present = signature.is_some(),
            "rejected event: invalid signature"
        );
        return Err(ServiceError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_signature",
            "X-Event-Signature is not the HMAC-SHA256 of the body under an accepted secret",
        ));
    }
    let event = OrderCreated::from_json(&parse_json(&body)?)?;
    check_idempotency_key(&headers, &event)?;
    match state.store.record(&event).await? {
        Recorded::Invoiced => state.invoiced.inc(),
        Recorded::Duplicate => {
            tracing::debug!(event_id = %event.id, "duplicate delivery absorbed");
            state.duplicates.inc();
        }
    }
    Ok(StatusCode::NO_CONTENT)
}

/// `Idempotency-Key`, when sent, must name the same event as the body.
fn check_idempotency_key(headers: &HeaderMap, event: &OrderCreated) -> Result<(), ServiceError> {
    let Some(key) = headers.get(IDEMPOTENCY_KEY_HEADER) else {
        return Ok(());
    };
    match key.to_str().ok().and_then(parse_uuid) {
        Some(id) if id == event.id => Ok(()),
        _ => Err(ServiceError::invalid_field(
            "invalid_event",
            "Idempotency-Key",
            "must equal the body's id",
        )),
    }
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
