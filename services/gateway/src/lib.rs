//! gateway: pitcrew's HTTP API. Ingests Alertmanager webhooks and pitcrew incidents onto
//! `incidents.new`, serves runs, approvals and decisions from Postgres and the bridge
//! subject, streams run events as Server-Sent Events, and guards it all with API keys
//! (hashed, per-key rate limits, every mutating request audited). The OpenAPI document in
//! `schemas/openapi.json` is served as is and says what each route needs.

pub mod access;
pub mod alertmanager;
pub mod body;
pub mod error;
pub mod events;
pub mod ingest;
pub mod observe;
pub mod runs;

use access::{Access, Keys, RateLimiter};
use anyhow::Context;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use pitcrew_runtime::{Bus, Config, Store};
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// The OpenAPI document, served at `GET /v1/openapi.json`.
pub const OPENAPI: &str = include_str!("../../../schemas/openapi.json");

pub use pitcrew_runtime::start::Shutdown;

/// Everything a request needs.
pub struct Gateway {
    pub cfg: Arc<Config>,
    pub bus: Bus,
    pub store: Store,
    pub keys: Keys,
    pub limiter: RateLimiter,
    /// What each (method, route) needs, from the OpenAPI document.
    pub access: HashMap<(Method, String), Access>,
    /// Live streams open at once: a slot is held as long as its answer is.
    pub streams: Arc<Semaphore>,
    /// Live stream clients dropped as too slow.
    pub slow_dropped: std::sync::atomic::AtomicU64,
    /// Live streams open at once per key owner (`streams_per_key` each; one entry per
    /// configured key at most).
    pub streams_of: std::sync::Mutex<HashMap<String, Arc<Semaphore>>>,
    /// This process's name on the events it writes.
    pub worker: String,
    pub shutdown: Shutdown,
    /// The last readiness answer: `/readyz` is public, so a flood of it must not become a
    /// flood of NATS and Postgres checks. One check at a time; its answer serves for a second.
    pub ready: tokio::sync::Mutex<Option<(std::time::Instant, StatusCode, serde_json::Value)>>,
}

/// How long one readiness answer is served before the next check.
const READY_FOR: Duration = Duration::from_secs(1);
/// Most events a live stream client may fall behind by before it is dropped.
const MAX_SSE_BUFFER: usize = 65_536;

/// Each route's access from the OpenAPI document's `x-pitcrew-access`; the error names an
/// operation without one.
pub fn access_table() -> anyhow::Result<HashMap<(Method, String), Access>> {
    let doc: serde_json::Value = serde_json::from_str(OPENAPI).context("schemas/openapi.json is not JSON")?;
    let mut out = HashMap::new();
    let paths = doc["paths"].as_object().context("openapi.json has no paths")?;
    for (path, ops) in paths {
        for (method, op) in ops.as_object().into_iter().flatten() {
            let Ok(m) = method.to_ascii_uppercase().parse::<Method>() else { continue };
            let access = op["x-pitcrew-access"]
                .as_str()
                .and_then(Access::parse)
                .with_context(|| format!("openapi.json: {method} {path} lacks a valid x-pitcrew-access"))?;
            out.insert((m, path.clone()), access);
        }
    }
    Ok(out)
}

impl Gateway {
    /// Check `[gateway]` and build the shared state.
    pub fn new(cfg: Config, bus: Bus, store: Store, shutdown: Shutdown) -> anyhow::Result<Arc<Gateway>> {
        let keys = Gateway::check(&cfg)?;
        Ok(Arc::new(Gateway {
            limiter: RateLimiter::new(&cfg.gateway),
            keys,
            access: access_table()?,
            streams: Arc::new(Semaphore::new(events::MAX_STREAMS)),
            streams_of: Default::default(),
            slow_dropped: Default::default(),
            worker: format!("gateway:{}", cfg.worker()),
            cfg: Arc::new(cfg),
            bus,
            store,
            shutdown,
            ready: tokio::sync::Mutex::new(None),
        }))
    }

    /// Check `[gateway]` (before anything is reached for: a bad setting is said at once, not
    /// once NATS and Postgres answer); its keys.
    pub fn check(cfg: &Config) -> anyhow::Result<Keys> {
        let keys = Keys::from_config(&cfg.gateway.keys).map_err(|e| anyhow::anyhow!("bad configuration: {e}"))?;
        if !cfg.gateway.rate_per_sec.is_finite()
            || cfg.gateway.rate_per_sec <= 0.0
            || cfg.gateway.body_limit_bytes == 0
            || cfg.gateway.alertmanager_body_limit_bytes == 0
        {
            anyhow::bail!("bad configuration: [gateway] rate_per_sec, body_limit_bytes and alertmanager_body_limit_bytes must be above 0");
        }
        if !(1..=MAX_SSE_BUFFER).contains(&cfg.gateway.sse_buffer) {
            anyhow::bail!("bad configuration: [gateway] sse_buffer must be between 1 and {MAX_SSE_BUFFER} events");
        }
        if !(1..=events::MAX_STREAMS).contains(&cfg.gateway.streams_per_key) {
            anyhow::bail!("bad configuration: [gateway] streams_per_key must be between 1 and {}", events::MAX_STREAMS);
        }
        access_table()?;
        Ok(keys)
    }
}

/// `POST /v1/alerts/alertmanager` with a body limit of its own (`key` names it in a 413).
fn post_alertmanager_limited(limit: usize, key: &'static str) -> axum::routing::MethodRouter<Arc<Gateway>> {
    post(ingest::post_alertmanager)
        .layer::<_, std::convert::Infallible>(Extension(body::BodyLimit(limit, key)))
        .layer(DefaultBodyLimit::max(limit))
}

/// Every route. The access each needs is looked up by the guard from the OpenAPI document.
pub fn router(gw: Arc<Gateway>) -> Router {
    let limit = gw.cfg.gateway.body_limit_bytes;
    let alerts = gw.cfg.gateway.alertmanager_body_limit_bytes;
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/v1/openapi.json", get(openapi))
        // A group of alerts is larger than any other request, and Alertmanager never sends
        // again what was answered 413: its own limit (inside the router's, so it wins).
        .route("/v1/alerts/alertmanager", post_alertmanager_limited(alerts, "alertmanager_body_limit_bytes"))
        .route("/v1/incidents", post(ingest::post_incident))
        .route("/v1/runs", get(runs::list))
        .route("/v1/runs/{id}", get(runs::get))
        .route("/v1/runs/{id}/events", get(events::run_events))
        .route("/v1/runs/{id}/approve", post(runs::approve))
        .route("/v1/runs/{id}/deny", post(runs::deny))
        .route("/v1/approvals", get(runs::pending))
        .route("/v1/ask", post(runs::ask))
        .route("/v1/events", get(events::all_events))
        .layer(axum::middleware::from_fn_with_state(gw.clone(), access::guard))
        .layer(Extension(body::BodyLimit(limit, "body_limit_bytes")))
        .layer(DefaultBodyLimit::max(limit))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Outermost: the span covers the guard and the handler (route_layer would miss 404s).
        .layer(axum::middleware::from_fn(observe::traced))
        .with_state(gw)
}

async fn not_found() -> error::ApiError {
    error::ApiError::NotFound("no such route (GET /v1/openapi.json lists them)".into())
}

async fn method_not_allowed() -> Response {
    let body = json!({ "error": "method not allowed on this route (GET /v1/openapi.json lists them)" });
    (StatusCode::METHOD_NOT_ALLOWED, Json(body)).into_response()
}

async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

/// One part's readiness for `/readyz`: `ok`, or why not in words safe to show anyone; the
/// log has the error (a backend's error names hosts, users, the database).
async fn part_ready<T, E: std::fmt::Display>(
    part: &str,
    check: impl std::future::Future<Output = Result<T, E>>,
) -> &'static str {
    match tokio::time::timeout(Duration::from_secs(2), check).await {
        Ok(Ok(_)) => "ok",
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "not ready: {part} refused the readiness check");
            "unavailable"
        }
        Err(_) => {
            tracing::warn!("not ready: {part} did not answer the readiness check within 2 s");
            "no answer within 2 s"
        }
    }
}

/// Ready when NATS (JetStream answers) and Postgres (a query answers) do, each within 2 s.
/// Checked at most once a second (`checked_at` tells when); callers meanwhile share the answer.
async fn readyz(State(gw): State<Arc<Gateway>>) -> Response {
    let mut last = gw.ready.lock().await;
    if let Some((at, status, body)) = last.as_ref() {
        if at.elapsed() < READY_FOR {
            return (*status, Json(body.clone())).into_response();
        }
    }
    // The answer is public (probes carry no key): it says which part is down, the log why.
    let (nats, postgres) = tokio::join!(
        part_ready("JetStream", gw.bus.js.get_stream(gw.bus.subjects.incidents_stream())),
        part_ready("Postgres", gw.store.ping()),
    );
    let ready = nats == "ok" && postgres == "ok";
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = json!({
        "status": if ready { "ready" } else { "not ready" },
        "nats": nats,
        "postgres": postgres,
        "checked_at": chrono::Utc::now(),
    });
    *last = Some((std::time::Instant::now(), status, body.clone()));
    (status, Json(body)).into_response()
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

/// Serve on `listener` until `shutdown`; live streams end with it. Headers must arrive within
/// `httpd::HEADER_TIMEOUT` and bodies within `body::BODY_TIMEOUT`: a slow client holds nothing.
pub async fn serve(gw: Arc<Gateway>, listener: tokio::net::TcpListener) -> anyhow::Result<()> {
    let shutdown = gw.shutdown.clone();
    pitcrew_runtime::httpd::serve(listener, router(gw), shutdown).await.context("gateway server failed")
}

/// `pitcrew gateway`: connect (waiting for NATS and Postgres), bind `[gateway] listen` and
/// serve until `shutdown`.
pub async fn run(cfg: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    Gateway::check(&cfg)?;
    pitcrew_runtime::httpd::can_bind(&cfg.gateway.listen, "[gateway] listen").await?;
    let Some((bus, store)) = pitcrew_runtime::start::connect_patiently(&cfg, &shutdown).await? else { return Ok(()) };
    if cfg.gateway.keys.is_empty() {
        tracing::warn!("no [gateway.keys] configured: every route but health and the OpenAPI document answers 401");
    }
    let listen = cfg.gateway.listen.clone();
    let collector =
        pitcrew_runtime::metrics::Collector { bus: bus.clone(), store: Some(store.clone()), consumers: Vec::new() };
    pitcrew_runtime::metrics::spawn_endpoint(cfg.metrics.listen.as_deref(), Some(collector), shutdown.clone()).await?;
    let gw = Gateway::new(cfg, bus, store, shutdown)?;
    let listener = pitcrew_runtime::httpd::bind(&listen, "[gateway] listen").await?;
    tracing::info!(listen = %listener.local_addr()?, "gateway serving");
    serve(gw, listener).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// (METHOD, path) of every `.route(...)` in `router` above, read from this file.
    fn routed() -> BTreeSet<(String, String)> {
        let src = include_str!("lib.rs");
        let mut out = BTreeSet::new();
        for line in src.lines().map(str::trim).filter(|l| l.starts_with(".route(\"")) {
            let path = line.split('"').nth(1).unwrap_or_default().to_string();
            let rest = line.split("\", ").nth(1).unwrap_or_default();
            // `get(...)`, `post(...)`, or a helper named after its method (`post_alertmanager_limited(...)`).
            let method = rest.split(['(', '_']).next().unwrap_or_default().to_ascii_uppercase();
            out.insert((method, path));
        }
        out
    }

    #[test]
    fn the_openapi_document_lists_exactly_the_routes_served_with_their_access() {
        let table = access_table().unwrap();
        let documented: BTreeSet<(String, String)> =
            table.keys().map(|(m, p)| (m.as_str().to_string(), p.clone())).collect();
        let served = routed();
        assert_eq!(served.len(), 13, "{served:?}");
        assert_eq!(documented, served, "schemas/openapi.json and the router disagree");
        assert_eq!(table[&(Method::POST, "/v1/runs/{id}/approve".to_string())], Access::Decide);
        assert_eq!(table[&(Method::GET, "/healthz".to_string())], Access::Public);
    }
}
