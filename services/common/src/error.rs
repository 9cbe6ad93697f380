//! The JSON error type every handler returns.
//!
//! Shape on the wire: `{"error":"<code>","detail":"<text>"}`, plus `"field"`
//! for validation failures (422) so a client knows which input to fix.
//! Database details are logged, never sent: a client learns the class of
//! failure, not table names or SQL.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use deadpool_postgres::PoolError;
use deadpool_postgres::tokio_postgres;
use serde::Serialize;

use crate::db::{PgErrorReport, PoolErrorReport, pool_sqlstate, sqlstate};

/// An HTTP error response with a machine-readable code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceError {
    status: StatusCode,
    code: &'static str,
    detail: String,
    field: Option<String>,
    retry_after_secs: Option<u64>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<&'a str>,
    detail: &'a str,
}

impl ServiceError {
    /// Any status with a code (`snake_case`) and a human-readable detail.
    pub fn new(status: StatusCode, code: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            code,
            detail: detail.into(),
            field: None,
            retry_after_secs: None,
        }
    }

    /// 400: the request is not well-formed (invalid JSON, too deep, bad query).
    pub fn bad_request(code: &'static str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, detail)
    }

    /// 422: well-formed but semantically invalid; `field` names the culprit
    /// (a JSON path such as `data.amount_cents`, or a header name).
    pub fn invalid_field(
        code: &'static str,
        field: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        let mut err = Self::new(StatusCode::UNPROCESSABLE_ENTITY, code, detail);
        err.field = Some(field.into());
        err
    }

    /// 404 with the given code.
    pub fn not_found(code: &'static str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, detail)
    }

    /// 500 `internal_error`. The detail sent is generic; log the cause first.
    pub fn internal() -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "the request failed; nothing was committed",
        )
    }

    /// 503 with a `Retry-After` hint in whole seconds.
    pub fn unavailable(
        code: &'static str,
        detail: impl Into<String>,
        retry_after_secs: u64,
    ) -> Self {
        let mut err = Self::new(StatusCode::SERVICE_UNAVAILABLE, code, detail);
        err.retry_after_secs = Some(retry_after_secs);
        err
    }

    /// The HTTP status this error renders with.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The machine-readable code (`"error"` in the body).
    pub fn code(&self) -> &'static str {
        self.code
    }

    /// The JSON body this error is sent as, `{"error","field"?,"detail"}`
    /// (e.g. to answer one event of a batch).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(ErrorBody {
            error: self.code,
            field: self.field.as_deref(),
            detail: &self.detail,
        })
        .unwrap_or_default()
    }

    /// The offending field of a 422, if any.
    pub fn field(&self) -> Option<&str> {
        self.field.as_deref()
    }

    /// The same error about element `index` of a JSON array body: its
    /// field becomes `[index].<field>` (`[index]` alone when it had none),
    /// so a client of a batch knows which element to fix.
    pub fn at_index(mut self, index: usize) -> Self {
        self.field = Some(match self.field.take() {
            Some(field) => format!("[{index}].{field}"),
            None => format!("[{index}]"),
        });
        self
    }
}

impl std::fmt::Display for ServiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status.as_u16(), self.code, self.detail)
    }
}

impl std::error::Error for ServiceError {}

impl IntoResponse for ServiceError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: self.code,
            field: self.field.as_deref(),
            detail: &self.detail,
        };
        let mut response = (self.status, Json(body)).into_response();
        if let Some(secs) = self.retry_after_secs {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// A failed statement: logged with its cause, answered with a bare 500.
impl From<tokio_postgres::Error> for ServiceError {
    fn from(err: tokio_postgres::Error) -> Self {
        tracing::error!(
            error = %PgErrorReport(&err),
            sqlstate = sqlstate(&err),
            "database statement failed"
        );
        Self::internal()
    }
}

/// Getting a connection failed. Exhaustion past the bounded wait and an
/// unreachable server are both "try again later" (503); the rest is a bug (500).
impl From<PoolError> for ServiceError {
    fn from(err: PoolError) -> Self {
        use deadpool_postgres::TimeoutType;
        match err {
            PoolError::Timeout(TimeoutType::Wait) => {
                tracing::warn!("connection pool exhausted past its wait timeout");
                Self::unavailable(
                    "pool_exhausted",
                    "all database connections are busy; retry shortly",
                    1,
                )
            }
            PoolError::Timeout(_) | PoolError::Backend(_) => {
                tracing::error!(
                    error = %PoolErrorReport(&err),
                    sqlstate = pool_sqlstate(&err),
                    "database unreachable"
                );
                Self::unavailable("database_unavailable", "the database is unreachable", 1)
            }
            PoolError::Closed | PoolError::NoRuntimeSpecified | PoolError::PostCreateHook(_) => {
                tracing::error!(
                    error = %PoolErrorReport(&err),
                    sqlstate = pool_sqlstate(&err),
                    "connection pool failure"
                );
                Self::internal()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_of(err: ServiceError) -> (StatusCode, http::HeaderMap, serde_json::Value) {
        let response = err.into_response();
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .expect("body");
        (
            status,
            headers,
            serde_json::from_slice(&bytes).expect("json"),
        )
    }

    #[tokio::test]
    async fn invalid_field_names_the_field() {
        let (status, _, body) = body_of(ServiceError::invalid_field(
            "invalid_order",
            "amount_cents",
            "must be an integer",
        ))
        .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(body["error"], "invalid_order");
        assert_eq!(body["field"], "amount_cents");
        assert_eq!(body["detail"], "must be an integer");
    }

    #[tokio::test]
    async fn unavailable_sets_retry_after_and_omits_field() {
        let (status, headers, body) =
            body_of(ServiceError::unavailable("pool_exhausted", "busy", 1)).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(headers[header::RETRY_AFTER], "1");
        assert!(body.get("field").is_none());
    }
}
