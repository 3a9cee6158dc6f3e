//! What the openai provider adds per call on top of the HTTP round trip, against the scripted
//! OpenAI-compatible server: the median of 200 raw POSTs of a chat completion versus the
//! median of 200 `diagnose` calls (prompt building, the request, parsing the answer).
//!
//!     cargo run --release -p pitcrew --example llm_overhead

use pitcrew_llm::{OpenAi, OpenAiConfig, Playbook, ReasonInput, Reasoner, Target};
use pitcrew_model::Incident;
use pitcrew_testkit::llm::{Reply, ScriptedLlm};
use std::collections::BTreeMap;
use std::time::Instant;

const N: usize = 200;
const ANSWER: &str =
    r#"{"diagnosis": "web is not running: nothing listens on 8080", "evidence": ["connection refused"]}"#;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let llm = ScriptedLlm::start(Vec::new()).await?;
    for _ in 0..(2 * N + 10) {
        llm.push(Reply::answer(ANSWER));
    }
    let http = reqwest::Client::new();
    let url = format!("{}/chat/completions", llm.base_url);
    let body = serde_json::json!({
        "model": "scripted-model",
        "messages": [{ "role": "user", "content": "GET http://127.0.0.1:8080/health failed: connection refused" }],
    });
    let mut raw = Vec::with_capacity(N);
    for _ in 0..N {
        let t = Instant::now();
        let r = http.post(&url).json(&body).send().await?;
        r.bytes().await?;
        raw.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let cfg = OpenAiConfig {
        base_url: llm.base_url.clone(),
        model: "scripted-model".into(),
        api_key_env: String::new(),
        ..Default::default()
    };
    let provider = OpenAi::new(cfg, Playbook::default_rules()).map_err(anyhow::Error::msg)?;
    let incident = Incident::new("web", "GET http://127.0.0.1:8080/health failed: connection refused");
    let target = Target { host: "local".into(), ..Default::default() };
    let vars = BTreeMap::from([("service".to_string(), "web".to_string())]);
    let input = ReasonInput::new(&incident, &target, &vars);
    let mut through = Vec::with_capacity(N);
    for _ in 0..N {
        let t = Instant::now();
        provider.diagnose(&input).await?;
        through.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let (raw, through) = (median(raw), median(through));
    println!(
        "{}",
        serde_json::json!({
            "raw_post_ms_p50": (raw * 1000.0).round() / 1000.0,
            "provider_call_ms_p50": (through * 1000.0).round() / 1000.0,
            "overhead_ms_p50": ((through - raw) * 1000.0).round() / 1000.0,
            "samples": N,
        })
    );
    Ok(())
}
