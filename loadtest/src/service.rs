//! The service the load's incidents are about, when it is checked over HTTP (`--check http`):
//! a real HTTP server on a loopback port (keep-alive, as most services' health endpoints) whose
//! `GET /health` answers 200 while the healthy file exists and 503 once it is gone, so the fix
//! (`touch` of that file) is what makes it healthy again, as with the command check.

use axum::http::StatusCode;
use axum::routing::get;
use std::path::PathBuf;

/// Serve `/health` for `healthy` until the process ends; returns the check's URL.
pub async fn start(healthy: PathBuf) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/health", listener.local_addr()?);
    let app = axum::Router::new().route(
        "/health",
        get(move || {
            let healthy = healthy.clone();
            // A `stat` of a file in the temp dir, answered in place: through tokio::fs it
            // would be a hand-over to a blocking thread and back for every check, CPU the
            // crew sharing this process would be charged for.
            async move {
                if healthy.exists() {
                    (StatusCode::OK, "ok")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "down")
                }
            }
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("loadtest: the health service stopped: {e}");
        }
    });
    Ok(url)
}
