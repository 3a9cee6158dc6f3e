//! Calls from a chat into a bridge, bounded: a body larger than the limit is refused (413)
//! and one that takes too long to arrive is dropped (408), before anything reads it.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use std::time::Duration;

/// Largest call accepted (interaction payloads are a few KiB).
pub const MAX_BODY: usize = 64 * 1024;
/// How long a caller may take to send its body.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// The whole body, or the answer refusing it.
pub async fn read_body(headers: &HeaderMap, body: Body) -> Result<Bytes, Response> {
    let too_large = || (StatusCode::PAYLOAD_TOO_LARGE, format!("the body is over {MAX_BODY} bytes")).into_response();
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(too_large());
    }
    match tokio::time::timeout(BODY_TIMEOUT, axum::body::to_bytes(body, MAX_BODY)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        // Over the limit without a Content-Length, or cut off.
        Ok(Err(_)) => Err(too_large()),
        Err(_) => Err((StatusCode::REQUEST_TIMEOUT, "the body took too long to arrive").into_response()),
    }
}
