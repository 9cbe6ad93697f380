//! HTTP handlers of the Payments service.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use serde::Deserialize;
use service_common::ServiceError;
use service_common::body::JsonBody;
use service_common::idempotency::{IdempotencyKey, REPLAYED_HEADER};
use service_common::metrics::HttpMetrics;
use service_common::pool::Pool;
use uuid::Uuid;

use crate::charge::{self, Answer, NewCharge};
use crate::config::Settings;
use crate::faults::{self, After, EXIT_AFTER_COMMIT_STATUS, Faults};
use crate::store::{Charge, ChargeStore, Outcome};

struct AppState {
    store: ChargeStore,
    decline_above_cents: i64,
    faults: Faults,
    charged: IntCounter,
    declined: IntCounter,
    replayed: IntCounter,
    injected: IntCounterVec,
}

/// The service's routes (`POST /charges`, `GET /charges?reference=`);
/// registers `payments_charges_total`, `payments_declines_total`,
/// `payments_idempotent_replays_total` and
/// `payments_faults_injected_total{hook}` in `metrics`.
pub fn router(pool: Pool, metrics: &HttpMetrics, settings: Settings) -> anyhow::Result<Router> {
    let registry = metrics.registry();
    let injected = IntCounterVec::new(
        Opts::new(
            "payments_faults_injected_total",
            "Test hooks that fired, by hook (fail, drop, exit)",
        ),
        &["hook"],
    )?;
    registry.register(Box::new(injected.clone()))?;
    if !settings.faults.is_off() {
        tracing::warn!(faults = ?settings.faults, "TEST HOOKS are ON: this provider misbehaves on purpose");
    }
    let state = Arc::new(AppState {
        store: ChargeStore::new(pool, settings.key_ttl),
        decline_above_cents: settings.decline_above_cents,
        faults: settings.faults,
        charged: counter(
            registry,
            "payments_charges_total",
            "Charges committed (each one money moved).",
        )?,
        declined: counter(
            registry,
            "payments_declines_total",
            "Charges declined (402), stored under their key.",
        )?,
        replayed: counter(
            registry,
            "payments_idempotent_replays_total",
            "POST /charges answered from a stored Idempotency-Key (nothing charged).",
        )?,
        injected,
    });
    Ok(Router::new()
        .route("/charges", post(create_charge).get(list_charges))
        .with_state(state))
}

fn counter(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntCounter> {
    let counter = IntCounter::new(name, help)?;
    registry.register(Box::new(counter.clone()))?;
    Ok(counter)
}

/// `POST /charges`.
async fn create_charge(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ServiceError> {
    if state.faults.fail_before() {
        state.injected.with_label_values(&["fail"]).inc();
        return Err(ServiceError::unavailable(
            "fault_injected",
            "test hook: failing before charging; nothing was charged",
            1,
        ));
    }
    let key = IdempotencyKey::from_request(&headers, &body)?;
    let charge = NewCharge::from_json(&body)?;
    let (charge_id, answer) = match charge.amount_cents > state.decline_above_cents {
        true => (None, charge::declined(state.decline_above_cents)),
        false => {
            let id = Uuid::new_v4();
            let answer = Answer {
                status: StatusCode::CREATED,
                body: charge.succeeded(id),
            };
            (Some(id), answer)
        }
    };
    let (answer, fresh) = match state
        .store
        .create(&charge, charge_id, answer, key.as_ref())
        .await?
    {
        Outcome::Fresh(answer) => {
            match charge_id {
                Some(id) => {
                    tracing::info!(charge_id = %id, reference = %charge.reference, "charged");
                    state.charged.inc();
                }
                None => state.declined.inc(),
            }
            (answer, true)
        }
        Outcome::Replayed(answer) => {
            state.replayed.inc();
            (answer, false)
        }
    };
    match state.faults.after(fresh && charge_id.is_some()).await {
        After::Answer => Ok(respond(answer, !fresh)),
        After::Drop => {
            state.injected.with_label_values(&["drop"]).inc();
            tracing::warn!(reference = %charge.reference, "test hook: dropping the answer after the commit");
            Ok(faults::dropped_connection())
        }
        After::Exit => {
            tracing::warn!(reference = %charge.reference, "test hook: exiting after the commit, before answering");
            std::process::exit(EXIT_AFTER_COMMIT_STATUS);
        }
    }
}

fn respond(answer: Answer, replayed: bool) -> Response {
    let mut response = (answer.status, Json(answer.body)).into_response();
    if replayed {
        response
            .headers_mut()
            .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
    response
}

#[derive(Deserialize)]
struct ChargeQuery {
    reference: Option<String>,
}

/// `GET /charges?reference=<text>`: every charge made for it.
async fn list_charges(
    State(state): State<Arc<AppState>>,
    query: Result<Query<ChargeQuery>, QueryRejection>,
) -> Result<Json<Vec<Charge>>, ServiceError> {
    let reference = query
        .ok()
        .and_then(|Query(q)| q.reference)
        .filter(|r| !r.is_empty())
        .ok_or_else(|| {
            ServiceError::bad_request("invalid_query", "reference=<text> is required")
        })?;
    Ok(Json(state.store.by_reference(&reference).await?))
}
