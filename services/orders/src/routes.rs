//! HTTP handlers of the Orders service.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use deadpool_postgres::Pool;
use prometheus::IntCounter;
use service_common::ServiceError;
use service_common::body::JsonBody;
use service_common::metrics::HttpMetrics;
use uuid::Uuid;

use crate::order::NewOrder;
use crate::store::OrderStore;

#[derive(Clone)]
struct AppState {
    store: OrderStore,
    created: IntCounter,
}

/// The service's own routes (`POST /orders`, `GET /orders/{id}`); registers
/// `orders_created_total` in `metrics`. `fault_after_order_insert` is the
/// test hook of [`crate::OrdersArgs`].
pub fn router(
    pool: Pool,
    metrics: &HttpMetrics,
    fault_after_order_insert: bool,
) -> anyhow::Result<Router> {
    let created = IntCounter::new(
        "orders_created_total",
        "Orders committed with their outbox event.",
    )?;
    metrics.registry().register(Box::new(created.clone()))?;
    if fault_after_order_insert {
        tracing::warn!("TEST HOOK fault_after_order_insert is ON: every POST /orders fails");
    }
    let state = Arc::new(AppState {
        store: OrderStore::new(pool, fault_after_order_insert),
        created,
    });
    Ok(Router::new()
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(get_order))
        .with_state(state))
}

async fn create_order(
    State(state): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Response, ServiceError> {
    let order = NewOrder::from_json(&body)?;
    let created = state.store.create(&order).await?;
    state.created.inc();
    let location = HeaderValue::try_from(format!("/orders/{}", created.order_id))
        .map_err(|_| ServiceError::internal())?;
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(created),
    )
        .into_response())
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
