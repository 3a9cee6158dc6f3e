//! The gateway in the crew's traces and metrics: every request is an `http_request` span that
//! continues the caller's W3C `traceparent` (so an incident or decision posted here carries
//! the caller's trace on through the crew), and is counted by route, method and status.

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use std::time::Instant;
use tracing::Instrument;

/// A method as a label: the standard ones by name, anything else (hyper accepts any token
/// as a method, before any key is checked) as `other`, so no caller can fill the metric
/// family's series with made-up methods.
fn method_label(m: &axum::http::Method) -> String {
    use axum::http::Method;
    let known = [Method::GET, Method::HEAD, Method::POST, Method::PUT, Method::DELETE, Method::PATCH, Method::OPTIONS];
    if known.contains(m) {
        m.as_str().to_string()
    } else {
        "other".to_string()
    }
}

/// Middleware: the request's span, its trace context, and its metrics.
pub async fn traced(req: Request, next: Next) -> Response {
    // The route template, never the raw path: run ids must not become labels.
    let route =
        req.extensions().get::<MatchedPath>().map(|m| m.as_str().to_string()).unwrap_or_else(|| "unmatched".into());
    let method = method_label(req.method());
    let span = tracing::info_span!("http_request", %method, route = %route, status = tracing::field::Empty);
    let parent = pitcrew_runtime::trace::continue_http(&span, req.headers());
    let started = Instant::now();
    let recorded = span.clone();
    let resp = pitcrew_runtime::trace::carrying(parent, next.run(req).instrument(span)).await;
    let status = resp.status().as_u16();
    recorded.record("status", status);
    pitcrew_runtime::metrics::http_request(&route, &method, status, started.elapsed());
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_made_up_method_is_one_label() {
        assert_eq!(method_label(&axum::http::Method::POST), "POST");
        let made_up = axum::http::Method::from_bytes(b"X0001").unwrap();
        assert_eq!(method_label(&made_up), "other");
    }
}
