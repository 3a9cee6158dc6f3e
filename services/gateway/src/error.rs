//! Errors as the API answers them: a status and `{"error": "..."}` saying what to do. The
//! message is also kept on the response for the audit trail.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

/// What went wrong, by what the caller should do about it.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed: fix it.
    #[error("{0}")]
    BadRequest(String),
    /// Well-formed but refused by a rule (unknown service, field out of bounds): fix the content.
    #[error("{0}")]
    Unprocessable(String),
    /// No key, or an unknown one.
    #[error("{0}")]
    Unauthorized(String),
    /// The key's role (or owner) may not do this.
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    /// The state changed under the caller (a stale plan, an approval already decided).
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    TooLarge(String),
    /// The body arrived too slowly.
    #[error("{0}")]
    Timeout(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// The caller holds too much at once (live streams): close some first.
    #[error("{0}")]
    TooMany(String),
    /// Slow down: retry after this many seconds.
    #[error("rate limit exceeded for key '{key}': retry after {retry_after} s")]
    RateLimited { key: String, retry_after: u64 },
    /// As `RateLimited`, for a sender that retries only 5xx (Alertmanager drops a
    /// notification answered 429): 503 with `Retry-After`.
    #[error("rate limit exceeded for key '{key}': retry after {retry_after} s (503: Alertmanager retries only 5xx)")]
    Busy { key: String, retry_after: u64 },
    #[error("{0}")]
    NotImplemented(String),
    /// NATS or Postgres failed: retry later.
    #[error("{0}")]
    Unavailable(String),
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::RateLimited { .. } | ApiError::TooMany(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            ApiError::Unavailable(_) | ApiError::Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// A store or bus failure, answered as 503 without its own words (a client library's or
    /// Postgres' text names subjects, streams, tables, constraints and values, to any caller
    /// with a key): the log has them, under the reference the answer gives.
    pub fn unavailable(what: &str, e: impl std::fmt::Display) -> ApiError {
        let reference = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
        tracing::warn!(what, %reference, error = %e, "backend failure");
        ApiError::Unavailable(format!(
            "{what} failed (retry later; the gateway's log has the error under reference {reference})"
        ))
    }
}

/// The outcome text the audit trail records for a response.
#[derive(Debug, Clone)]
pub struct Outcome(pub String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let message = self.to_string();
        let mut resp = (self.status(), Json(serde_json::json!({ "error": message }))).into_response();
        match &self {
            ApiError::RateLimited { retry_after, .. } | ApiError::Busy { retry_after, .. } => {
                resp.headers_mut().insert("retry-after", HeaderValue::from(*retry_after));
                resp.extensions_mut().insert(crate::access::RateRefused);
            }
            ApiError::Unauthorized(_) => {
                resp.headers_mut().insert("www-authenticate", HeaderValue::from_static("Bearer"));
            }
            _ => {}
        }
        resp.extensions_mut().insert(Outcome(message));
        resp
    }
}

impl From<pitcrew_runtime::StoreError> for ApiError {
    fn from(e: pitcrew_runtime::StoreError) -> Self {
        ApiError::unavailable("Postgres", e)
    }
}
