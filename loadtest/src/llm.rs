//! The simulated model for `--llm-latency-ms`: an OpenAI-compatible chat-completions server
//! (real HTTP on a loopback port, keep-alive like a real endpoint, the response JSON and usage
//! block of the test kit's scripted server) that answers every call after a fixed delay. It
//! keeps no request: it only counts them.
//!
//! It runs in a process of its own (this binary with `--serve-llm`), so the crew's process,
//! whose CPU, peak memory and descriptors the tool reports, holds only the client side of the
//! model's connections, as it would against a real endpoint.

use anyhow::Context;
use axum::extract::State;
use axum::routing::post;
use axum::Json;
use pitcrew_testkit::llm::{add_usage, completion_body, prompt_chars};
use serde_json::{json, Value};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout};

/// How long the server process may take to say where it listens, or its count when asked.
const ANSWER: Duration = Duration::from_secs(10);

/// The server process, killed if dropped.
pub struct SimulatedLlm {
    /// The API root to configure as `base_url` (`http://127.0.0.1:PORT/v1`).
    pub base_url: String,
    child: Child,
    out: Lines<BufReader<ChildStdout>>,
}

impl SimulatedLlm {
    /// Stop the server and return the calls it answered: closing its stdin asks it for its
    /// counts, which it prints before it exits.
    pub async fn finish(mut self) -> anyhow::Result<Calls> {
        drop(self.child.stdin.take());
        let line = tokio::time::timeout(ANSWER, self.out.next_line())
            .await
            .context("the simulated LLM did not report its calls")??
            .context("the simulated LLM exited without reporting its calls")?;
        let _ = tokio::time::timeout(ANSWER, self.child.wait()).await;
        let counts = line.split_whitespace().map(str::parse).collect::<Result<Vec<u64>, _>>();
        match counts.as_deref() {
            Ok([all, diagnose]) if diagnose <= all => Ok(Calls { all: *all, diagnose: *diagnose }),
            _ => anyhow::bail!("the simulated LLM's counts: {line:?}"),
        }
    }
}

/// The calls the simulated model answered: all of them, and diagnose's (the rest are plan's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calls {
    pub all: u64,
    pub diagnose: u64,
}

struct Shared {
    delay: Duration,
    /// The fix the plan step answers with (`touch` of the healthy file).
    fix: String,
    calls: AtomicU64,
    diagnose_calls: AtomicU64,
}

/// Start the server process: this binary with `--serve-llm`.
pub async fn start(delay: Duration, fix: &str) -> anyhow::Result<SimulatedLlm> {
    let exe = std::env::current_exe().context("finding this binary to run the simulated LLM")?;
    let mut child = tokio::process::Command::new(exe)
        .args(["--serve-llm", "--llm-latency-ms", &delay.as_millis().to_string(), "--llm-fix", fix])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the simulated LLM process")?;
    let mut out = BufReader::new(child.stdout.take().expect("piped")).lines();
    let base_url = tokio::time::timeout(ANSWER, out.next_line())
        .await
        .context("the simulated LLM did not say where it listens")??
        .context("the simulated LLM exited before listening")?;
    Ok(SimulatedLlm { base_url, child, out })
}

/// `--serve-llm`: print the API root, serve until stdin closes (the tool asks for the count,
/// or ended however it ended), then print the calls answered.
pub async fn serve(delay: Duration, fix: String) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base_url = format!("http://{}/v1", listener.local_addr()?);
    let shared = Arc::new(Shared { delay, fix, calls: AtomicU64::new(0), diagnose_calls: AtomicU64::new(0) });
    let app = axum::Router::new().route("/v1/chat/completions", post(complete)).with_state(shared.clone());
    let mut stdout = tokio::io::stdout();
    stdout.write_all(format!("{base_url}\n").as_bytes()).await?;
    stdout.flush().await?;
    let closed = async {
        let mut stdin = tokio::io::stdin();
        let mut buf = [0u8; 64];
        while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
    };
    tokio::select! {
        served = axum::serve(listener, app) => served.context("the simulated LLM stopped")?,
        _ = closed => {}
    }
    let calls = shared.calls.load(Ordering::Relaxed);
    let diagnose = shared.diagnose_calls.load(Ordering::Relaxed);
    // The tool may be gone: nobody to tell is not an error.
    let _ = stdout.write_all(format!("{calls} {diagnose}\n").as_bytes()).await;
    let _ = stdout.flush().await;
    Ok(())
}

/// The diagnosis step gets a grounded diagnosis quoting the incident's error; the plan step
/// gets the playbook's fix (or, for the forbidden scenario, the command policy must refuse).
async fn complete(State(shared): State<Arc<Shared>>, Json(body): Json<Value>) -> Json<Value> {
    let text = |i: usize| body["messages"][i]["content"].as_str().unwrap_or_default();
    let (system, user) = (text(0), text(1));
    let first = user.lines().find(|l| l.starts_with("Incident:")).unwrap_or_default();
    let error = first.split_once("): ").map(|(_, e)| e).unwrap_or(first);
    let diagnosis = system.contains("diagnosis step");
    let answer = if diagnosis {
        json!({ "diagnosis": "svc is unhealthy", "evidence": [error] }).to_string()
    } else if error.contains("disk wiped") {
        "```sh\nrm -rf /\n```".to_string()
    } else {
        format!("```sh\n{}\n```", shared.fix)
    };
    let prompt = prompt_chars(&body);
    tokio::time::sleep(shared.delay).await;
    shared.calls.fetch_add(1, Ordering::Relaxed);
    if diagnosis {
        shared.diagnose_calls.fetch_add(1, Ordering::Relaxed);
    }
    let mut completion = completion_body(json!({ "role": "assistant", "content": answer }));
    add_usage(&mut completion, prompt);
    Json(completion)
}
