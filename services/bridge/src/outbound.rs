//! Calls to a chat's API, shared by every bridge: one bounded HTTP client, answers read up to
//! a limit, and every failure sorted into "retry later" or "will never work".

use std::time::Duration;

/// Largest answer read from a chat API.
pub const MAX_ANSWER: usize = 256 * 1024;

/// A chat API call failed; the variant says what the caller does.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The chat is busy, down or unreachable: try again after `after`.
    #[error("{why} (retrying in {} s)", after.as_secs())]
    Retry { after: Duration, why: String },
    /// This call will never succeed as it is (bad channel, bad request, bad endpoint).
    #[error("{0}")]
    Permanent(String),
}

/// A client with `timeout` per call, no redirects followed.
pub fn client(timeout: Duration) -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout.min(Duration::from_secs(5)))
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("pitcrew-bridge/", env!("CARGO_PKG_VERSION")))
        .build()?)
}

/// A failed send: worth a retry. The URL is left out (a webhook's URL is its secret).
pub fn net(method: &str, e: reqwest::Error) -> ApiError {
    let kind = if e.is_timeout() { "timed out" } else { "cannot reach the chat API" };
    ApiError::Retry { after: Duration::from_secs(5), why: format!("{method}: {kind}: {}", e.without_url()) }
}

/// 429 (after its Retry-After, default 30 s) and 5xx are retried; None for anything else.
pub fn retry_status(method: &str, resp: &reqwest::Response) -> Option<ApiError> {
    let status = resp.status();
    if status.as_u16() == 429 {
        let after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| pitcrew_model::retry_after::parse(v, std::time::SystemTime::now()))
            .unwrap_or(Duration::from_secs(30))
            .clamp(Duration::from_secs(1), Duration::from_secs(900));
        return Some(ApiError::Retry { after, why: format!("{method}: rate limited") });
    }
    status
        .is_server_error()
        .then(|| ApiError::Retry { after: Duration::from_secs(10), why: format!("{method}: HTTP {status}") })
}

/// The body, refused past [`MAX_ANSWER`] bytes.
pub async fn read_bounded(mut resp: reqwest::Response) -> Result<Vec<u8>, String> {
    let mut buf = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        if buf.len() + chunk.len() > MAX_ANSWER {
            return Err(format!("answer larger than {MAX_ANSWER} bytes"));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf)
}

/// `scheme://host:port/` of a URL, to compare origins.
pub fn origin(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    Some(format!("{scheme}://{}/", rest.split('/').next()?))
}
