//! HTTP handlers of the Orders service.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prometheus::IntCounter;
use service_common::ServiceError;
use service_common::body::JsonBody;
use service_common::metrics::HttpMetrics;
use service_common::pool::Pool;
use service_common::telemetry::{RequestSpan, Spans};
use uuid::Uuid;

use crate::idempotency::{self, IdempotencyKey};
use crate::order::NewOrder;
use crate::store::{CreatedOrder, OrderStore, Outcome};

#[derive(Clone)]
struct AppState {
    store: OrderStore,
    spans: Spans,
    created: IntCounter,
    replayed: IntCounter,
}

/// The service's own routes (`POST /orders`, `GET /orders/{id}`); registers
/// `orders_created_total` and `orders_idempotent_replays_total` in
/// `metrics`. Each `POST /orders` is a span `orders.create` of `spans`,
/// whose context the outbox row stores. `fault_after_order_insert` is the
/// test hook of [`crate::OrdersArgs`]; `key_ttl` how long an
/// `Idempotency-Key` is kept.
pub fn router(
    pool: Pool,
    metrics: &HttpMetrics,
    spans: Spans,
    fault_after_order_insert: bool,
    key_ttl: std::time::Duration,
) -> anyhow::Result<Router> {
    let created = IntCounter::new(
        "orders_created_total",
        "Orders committed with their outbox event.",
    )?;
    metrics.registry().register(Box::new(created.clone()))?;
    let replayed = IntCounter::new(
        "orders_idempotent_replays_total",
        "POST /orders answered from a stored Idempotency-Key (no new order).",
    )?;
    metrics.registry().register(Box::new(replayed.clone()))?;
    if fault_after_order_insert {
        tracing::warn!("TEST HOOK fault_after_order_insert is ON: every POST /orders fails");
    }
    let state = Arc::new(AppState {
        store: OrderStore::new(pool, fault_after_order_insert, key_ttl),
        spans,
        created,
        replayed,
    });
    Ok(Router::new()
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(get_order))
        .with_state(state))
}

async fn create_order(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ServiceError> {
    let mut span = state.spans.server("orders.create", &headers);
    let result = create(&state, &headers, &body, &mut span).await;
    span.end(result)
}

async fn create(
    state: &AppState,
    headers: &HeaderMap,
    body: &serde_json::Value,
    span: &mut RequestSpan,
) -> Result<Response, ServiceError> {
    let key = IdempotencyKey::from_request(headers, body)?;
    let order = NewOrder::from_json(body)?;
    let trace = span.context();
    let outcome = state
        .store
        .create(&order, key.as_ref(), trace.as_ref())
        .await?;
    let (created, status, replayed) = match outcome {
        Outcome::Created(created) => {
            state.created.inc();
            (created, StatusCode::CREATED, false)
        }
        Outcome::Replayed { order, status } => {
            state.replayed.inc();
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::CREATED);
            (order, status, true)
        }
    };
    span.set("order.id", created.order_id.to_string());
    span.set("outbox.event_id", created.event_id.to_string());
    span.set("orders.replayed", replayed);
    created_response(created, status, replayed)
}

fn created_response(
    created: CreatedOrder,
    status: StatusCode,
    replayed: bool,
) -> Result<Response, ServiceError> {
    let location = HeaderValue::try_from(format!("/orders/{}", created.order_id))
        .map_err(|_| ServiceError::internal())?;
    let mut response = (status, [(header::LOCATION, location)], Json(created)).into_response();
    if replayed {
        response.headers_mut().insert(
            idempotency::REPLAYED_HEADER,
            HeaderValue::from_static("true"),
        );
    }
    Ok(response)
}

async fn get_order(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Response, ServiceError> {
    let missing = || ServiceError::not_found("order_not_found", "no order with this id");
    let id = Uuid::try_parse(&id).map_err(|_| missing())?;
    let order = state.store.find(id).await?.ok_or_else(missing)?;
    Ok(Json(order).into_response())
}
