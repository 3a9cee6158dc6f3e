//! The simulated model for `--llm-latency-ms`: an OpenAI-compatible chat-completions server
//! (real HTTP on a loopback port, keep-alive like a real endpoint, the response JSON and usage
//! block of the test kit's scripted server) that answers every call after a fixed delay. It keeps no request: it only
//! counts them, so the tool's own memory stays flat however long the run.

use axum::extract::State;
use axum::routing::post;
use axum::Json;
use pitcrew_testkit::llm::{add_usage, completion_body, prompt_chars};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The running server.
pub struct SimulatedLlm {
    /// The API root to configure as `base_url` (`http://127.0.0.1:PORT/v1`).
    pub base_url: String,
    calls: Arc<AtomicU64>,
}

impl SimulatedLlm {
    /// Calls answered so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}

struct Shared {
    delay: Duration,
    /// The fix the plan step answers with (`touch` of the healthy file).
    fix: String,
    calls: Arc<AtomicU64>,
}

/// Serve until the process ends.
pub async fn start(delay: Duration, fix: String) -> anyhow::Result<SimulatedLlm> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base_url = format!("http://{}/v1", listener.local_addr()?);
    let calls = Arc::new(AtomicU64::new(0));
    let shared = Arc::new(Shared { delay, fix, calls: calls.clone() });
    let app = axum::Router::new().route("/v1/chat/completions", post(complete)).with_state(shared);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("loadtest: the simulated LLM stopped: {e}");
        }
    });
    Ok(SimulatedLlm { base_url, calls })
}

/// The diagnosis step gets a grounded diagnosis quoting the incident's error; the plan step
/// gets the playbook's fix (or, for the forbidden scenario, the command policy must refuse).
async fn complete(State(shared): State<Arc<Shared>>, Json(body): Json<Value>) -> Json<Value> {
    let text = |i: usize| body["messages"][i]["content"].as_str().unwrap_or_default();
    let (system, user) = (text(0), text(1));
    let first = user.lines().find(|l| l.starts_with("Incident:")).unwrap_or_default();
    let error = first.split_once("): ").map(|(_, e)| e).unwrap_or(first);
    let answer = if system.contains("diagnosis step") {
        json!({ "diagnosis": "svc is unhealthy", "evidence": [error] }).to_string()
    } else if error.contains("disk wiped") {
        "```sh\nrm -rf /\n```".to_string()
    } else {
        format!("```sh\n{}\n```", shared.fix)
    };
    let prompt = prompt_chars(&body);
    tokio::time::sleep(shared.delay).await;
    shared.calls.fetch_add(1, Ordering::Relaxed);
    let mut completion = completion_body(json!({ "role": "assistant", "content": answer }));
    add_usage(&mut completion, prompt);
    Json(completion)
}
