//! Reading requests: JSON bodies within the size limit and time (413 past it, 408 too slow,
//! 415 for another media type, 400 naming the line, column and field that are wrong), run ids and query strings,
//! each refused with a JSON error.

use crate::error::ApiError;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use std::time::Duration;
use uuid::Uuid;

/// How long a client may take to send its body once its headers are in (a slow body holds a
/// connection and a task: refused with 408).
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// A JSON body parsed into `T`.
pub struct JsonBody<T>(pub T);

/// The body as bytes, within the limit; a JSON `Content-Type` when there is a body.
pub struct RawJson(pub Bytes);

fn too_large(limit: BodyLimit) -> ApiError {
    ApiError::TooLarge(format!("request body is larger than the {}-byte limit ([gateway] {})", limit.0, limit.1))
}

impl<S: Send + Sync> FromRequest<S> for RawJson {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let limit = req.extensions().get::<BodyLimit>().copied().unwrap_or(BodyLimit(0, "body_limit_bytes"));
        let ct = req.headers().get("content-type").and_then(|v| v.to_str().ok()).map(str::to_string);
        let read = tokio::time::timeout(BODY_TIMEOUT, Bytes::from_request(req, state)).await.map_err(|_| {
            ApiError::Timeout(format!("the request body took more than {} s to arrive", BODY_TIMEOUT.as_secs()))
        })?;
        let bytes = read.map_err(|e: BytesRejection| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                too_large(limit)
            } else {
                ApiError::BadRequest(format!("request body unreadable: {}", e.body_text()))
            }
        })?;
        if !bytes.is_empty() {
            let json = ct.as_deref().map(|c| {
                let c = c.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
                c == "application/json" || c.ends_with("+json")
            });
            if json != Some(true) {
                return Err(ApiError::UnsupportedMediaType(format!(
                    "send the body as JSON with `Content-Type: application/json` (got {})",
                    ct.as_deref().unwrap_or("no Content-Type")
                )));
            }
        }
        Ok(RawJson(bytes))
    }
}

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let RawJson(bytes) = RawJson::from_request(req, state).await?;
        parse(&bytes).map(JsonBody)
    }
}

/// Parse a JSON document; the error says where and what is wrong.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::BadRequest("request body is empty: a JSON document is required".into()));
    }
    serde_json::from_slice(bytes).map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")))
}

/// The configured body limit of a route, made known to the extractors, and its key's name.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize, pub &'static str);

/// A route's `{id}`, the run it names: one that is no text once decoded (`%FF`) or no UUID is
/// answered as every other bad request (JSON, audited), not with axum's plain-text rejection.
pub struct RunPath(pub Uuid);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for RunPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<String>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(id)) => run_id(&id).map(RunPath),
            Err(e) => Err(ApiError::BadRequest(format!("the run id in the path: {}", e.body_text()))),
        }
    }
}

/// A run id from the path.
fn run_id(s: &str) -> Result<Uuid, ApiError> {
    s.parse()
        .map_err(|_| ApiError::BadRequest(format!("'{}' is not a run id (a UUID)", pitcrew_model::trim::clip(s, 64))))
}

/// A query string that did not parse, as a JSON error naming the parameter.
pub fn bad_query(e: axum::extract::rejection::QueryRejection) -> ApiError {
    ApiError::BadRequest(format!("bad query: {}", e.body_text()))
}
