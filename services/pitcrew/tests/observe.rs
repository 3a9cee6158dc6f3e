//! Observability end to end: an incident handled by three `pitcrew worker` processes is one
//! trace (spans exported over OTLP/HTTP to a receiver this test runs), each worker's
//! `/metrics` parses as Prometheus text and moves as runs complete, and `pitcrew top --once`
//! shows every stage and the recent runs.

mod common;

use common::otlp::{Receiver, Span};
use common::{sample, scrape, stop, Crew};
use pitcrew_model::EventKind;
use pitcrew_testkit::llm::{Reply, ScriptedLlm};
use serde_json::json;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// An OpenAI-compatible model: diagnose first asks for one read-only command (a tool call),
/// then answers with a diagnosis quoting the incident; plan answers with the fix.
async fn model(healthy: String) -> anyhow::Result<ScriptedLlm> {
    let llm = ScriptedLlm::start(Vec::new()).await?;
    llm.respond_with(move |body| {
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let system = messages.first().and_then(|m| m["content"].as_str()).unwrap_or_default().to_string();
        let user = messages.get(1).and_then(|m| m["content"].as_str()).unwrap_or_default().to_string();
        let first = user.lines().find(|l| l.starts_with("Incident:")).unwrap_or_default();
        let error = first.split_once("): ").map(|(_, e)| e).unwrap_or(first).to_string();
        if system.contains("diagnosis step") {
            if !messages.iter().any(|m| m["role"] == "tool") {
                return Reply::tool_calls(&[("call-1", "run_command", json!({ "command": "df -h" }))]);
            }
            return Reply::answer(&json!({ "diagnosis": "svc is down", "evidence": [error] }).to_string());
        }
        Reply::answer(&format!("```sh\ntouch {healthy}\n```"))
    });
    Ok(llm)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_through_three_workers_is_one_trace_and_metrics_move() -> anyhow::Result<()> {
    let receiver = Receiver::start().await?;
    let env = pitcrew_testkit::TestEnv::start().await?;
    let svc = common::marker_service(&env, "svc");
    let llm = model(env.path("svc-healthy")).await?;
    let mut crew = Crew::start_in(env, &svc, &[]).await?;
    let ports: Vec<u16> = (0..3).map(|_| pitcrew_runtime::natsd::free_port()).collect::<Result<_, _>>()?;
    let worker = |name: &str, port: u16, stages: &[&str], reasoning: &str| {
        let extra = format!(
            "{reasoning}[metrics]\nlisten = \"127.0.0.1:{port}\"\n\
             [telemetry]\notlp_endpoint = \"{}\"\nservice_name = \"{name}\"\n",
            receiver.url
        );
        crew.spawn_worker_with(name, stages, &[("OTEL_BSP_SCHEDULE_DELAY", "200")], &extra)
    };
    let reasoning = format!(
        "[reasoning]\nprovider = \"openai\"\n[reasoning.openai]\nbase_url = \"{}\"\nmodel = \"scripted-1\"\n\
         api_key_env = \"\"\nstream = false\n",
        llm.base_url
    );
    let mut workers = vec![
        worker("w1", ports[0], &["intake", "diagnose", "plan"], &reasoning)?,
        worker("w2", ports[1], &["evaluate", "approval", "execute"], "")?,
        worker("w3", ports[2], &["verify", "report", "escalate"], "")?,
    ];
    let metrics = |i: usize| format!("http://127.0.0.1:{}/metrics", ports[i]);

    let run = crew.open("svc", "GET /health: connection refused").await?;
    let end = crew.events.terminal(run, common::WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);

    // Each process's /metrics parses (scrape checks every line) and has what it did.
    let w1 = scrape(&metrics(0)).await?;
    let w2 = scrape(&metrics(1)).await?;
    let w3 = scrape(&metrics(2)).await?;
    let llm_ok = "pitcrew_llm_calls_total{provider=\"openai\",model=\"scripted-1\",outcome=\"ok\"}";
    assert!(sample(&w1, llm_ok) >= 3.0, "a tool call turn, a diagnosis and a plan: {w1:?}");
    assert!(sample(&w1, "pitcrew_llm_call_duration_seconds_count{provider=\"openai\",model=\"scripted-1\"}") >= 3.0);
    // The scripted server reports usage (four characters a token): the counters take it.
    let prompt = "pitcrew_llm_tokens_total{provider=\"openai\",model=\"scripted-1\",kind=\"prompt\"}";
    let completion = "pitcrew_llm_tokens_total{provider=\"openai\",model=\"scripted-1\",kind=\"completion\"}";
    assert!(sample(&w1, prompt) >= 100.0, "three prompts of a few hundred characters: {w1:?}");
    assert!(sample(&w1, completion) >= 1.0, "{w1:?}");
    assert!(sample(&w1, "pitcrew_messages_total{consumer=\"diagnose\",outcome=\"ack\"}") >= 1.0);
    let has = |s: &[(String, f64)], series: &str| s.iter().any(|(k, _)| k == series);
    assert!(has(&w1, "pitcrew_consumer_pending_messages{consumer=\"intake\"}"), "{w1:?}");
    assert!(has(&w2, "pitcrew_consumer_ack_pending_messages{consumer=\"approval-decisions\"}"), "{w2:?}");
    assert!(has(&w2, "pitcrew_approvals_pending"), "read from Postgres: {w2:?}");
    let cmd_ok = "pitcrew_commands_total{executor=\"local\",exit_class=\"ok\"}";
    assert!(sample(&w2, cmd_ok) >= 1.0, "execute ran the fix: {w2:?}");
    let resolved = "pitcrew_runs_finished_total{outcome=\"resolved\"}";
    assert_eq!(sample(&w3, resolved), 1.0, "{w3:?}");

    // A second run moves the counters.
    std::fs::remove_file(crew.env.path("svc-healthy"))?;
    let second = crew.open_with("svc", "GET /health: connection refused", Some("fp-2".into())).await?;
    assert_eq!(crew.events.terminal(second, common::WAIT).await?.kind, EventKind::Resolved);
    let w1_after = scrape(&metrics(0)).await?;
    assert!(sample(&w1_after, llm_ok) > sample(&w1, llm_ok));
    assert!(sample(&w1_after, prompt) > sample(&w1, prompt), "tokens move with the calls");
    assert!(sample(&scrape(&metrics(1)).await?, cmd_ok) > sample(&w2, cmd_ok));
    assert_eq!(sample(&scrape(&metrics(2)).await?, resolved), 2.0);

    // `pitcrew top --once`: every stage's consumer and the recent runs.
    let top = crew.cli(&["top", "--once"])?;
    eprintln!("{top}");
    for stage in pitcrew_model::Stage::ALL {
        assert!(top.lines().any(|l| l.starts_with(stage.as_str())), "{stage} missing from:\n{top}");
    }
    assert!(top.contains(&run.to_string()) && top.contains(&second.to_string()), "{top}");
    assert!(top.contains("resolved"), "{top}");

    // Stopping flushes what is still queued; then the trace of the first run is complete.
    for w in &mut workers {
        stop(w)?;
    }
    let id = run.to_string();
    let deadline = Instant::now() + Duration::from_secs(20);
    let (traces, services) = loop {
        let spans = receiver.spans();
        let stages: Vec<&Span> =
            spans.iter().filter(|s| s.name == "stage" && s.attrs.get("run") == Some(&id)).collect();
        let traces: BTreeSet<String> = stages.iter().map(|s| s.trace.clone()).collect();
        let services: BTreeSet<String> = stages.iter().map(|s| s.service.clone()).collect();
        if services.len() == 3 || Instant::now() > deadline {
            break (traces, services);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let spans = receiver.spans();
    assert_eq!(
        services.len(),
        3,
        "stage spans of the run from w1, w2 and w3: {services:?} ({} posts)",
        receiver.posts()
    );
    assert_eq!(traces.len(), 1, "one trace for the whole run: {traces:?}");
    let trace = traces.into_iter().next().unwrap_or_default();
    let of_run: Vec<&Span> = spans.iter().filter(|s| s.trace == trace).collect();
    let named = |n: &str| of_run.iter().filter(|s| s.name == n).count();
    let stages: BTreeSet<String> =
        of_run.iter().filter(|s| s.name == "stage").filter_map(|s| s.attrs.get("stage").cloned()).collect();
    for stage in ["intake", "diagnose", "plan", "evaluate", "approval", "execute", "verify", "report"] {
        assert!(stages.contains(stage), "{stage} handled in the trace: {stages:?}");
    }
    let intake =
        of_run.iter().find(|s| s.name == "stage" && s.attrs.get("stage").map(String::as_str) == Some("intake"));
    assert_eq!(
        intake.and_then(|s| s.attrs.get("attempt")).map(String::as_str),
        Some("1"),
        "the stage span has the attempt"
    );
    assert!(named("db_write") >= 8, "Postgres writes in the trace: {}", named("db_write"));
    assert!(named("command") >= 2, "evidence and the fix in the trace: {}", named("command"));
    assert!(named("llm_call") >= 3, "model calls in the trace: {}", named("llm_call"));
    assert!(named("tool_call") >= 1, "the model's tool call in the trace");
    let fix =
        of_run.iter().find(|s| s.name == "command" && s.attrs.get("command").is_some_and(|c| c.starts_with("touch")));
    assert_eq!(fix.map(|s| s.service.as_str()), Some("w2"), "execute ran the fix in w2");
    // The second run is a trace of its own.
    let second_traces: BTreeSet<&str> = spans
        .iter()
        .filter(|s| s.name == "stage" && s.attrs.get("run") == Some(&second.to_string()))
        .map(|s| s.trace.as_str())
        .collect();
    assert_eq!(second_traces.len(), 1);
    assert!(!second_traces.contains(trace.as_str()));
    drop(workers);
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_collector_is_reported_once_and_runs_go_on() -> anyhow::Result<()> {
    let env = pitcrew_testkit::TestEnv::start().await?;
    let svc = common::marker_service(&env, "svc");
    let mut crew = Crew::start_in(env, &svc, &[]).await?;
    // Nothing listens there; a collector behind basic auth has a password in its URL.
    let port = pitcrew_runtime::natsd::free_port()?;
    let extra = format!("[telemetry]\notlp_endpoint = \"http://ops:c0llector-S3CRET@127.0.0.1:{port}\"\n");
    let stages: Vec<&str> = pitcrew_model::Stage::ALL.iter().map(|s| s.as_str()).collect();
    let env = [
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ("PITCREW_LOG", "info,pitcrew_exec=debug"),
        ("PITCREW_LOG_FORMAT", "json"),
    ];
    let mut w = crew.spawn_worker_with("w", &stages, &env, &extra)?;
    let mut runs = Vec::new();
    for i in 0..3 {
        std::fs::remove_file(crew.env.path("svc-healthy")).ok();
        let run = crew.open_with("svc", "GET /health: connection refused", Some(format!("fp-{i}"))).await?;
        assert_eq!(crew.events.terminal(run, common::WAIT).await?.kind, EventKind::Resolved);
        runs.push(run);
        // Let a few export rounds fail.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    stop(&mut w)?;
    let log = std::fs::read_to_string(&w.log)?;
    let warned = log.matches("cannot export spans to the OTLP collector").count();
    assert_eq!(warned, 1, "one warning, not one per batch:\n{log}");
    // The endpoint as configured, its password marked (`***` by the URL's own redaction, then
    // marked again as the log line is written).
    assert!(log.contains("http://ops:[REDACTED]@127.0.0.1") && !log.contains("c0llector-S3CRET"), "{log}");
    // JSON lines; those written while a stage handled a run carry the run (its span's fields).
    let lines: Vec<serde_json::Value> =
        log.lines().map(serde_json::from_str).collect::<Result<_, _>>().map_err(|e| anyhow::anyhow!("{e}: {log}"))?;
    let commands: Vec<&serde_json::Value> =
        lines.iter().filter(|l| l["fields"]["message"] == "local command finished").collect();
    assert!(!commands.is_empty(), "{log}");
    for r in &runs {
        let id = r.to_string();
        assert!(
            commands.iter().any(|l| l["span"]["name"] == "command" && l.to_string().contains(&id)),
            "{id} in {log}"
        );
    }
    for l in &commands {
        let run = l["spans"].as_array().and_then(|s| s.iter().find_map(|s| s["run"].as_str()));
        assert!(run.is_some(), "a line inside a run names it: {l}");
    }
    drop(w);
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_parked_for_approval_stays_one_trace() -> anyhow::Result<()> {
    let receiver = Receiver::start().await?;
    let env = pitcrew_testkit::TestEnv::start().await?;
    // `rm` is critical in the shipped policy: the run parks until someone approves.
    let book = common::write(
        &env,
        "playbook.toml",
        "[[rule]]\nname = \"locked\"\nmatch = \"stale lock\"\ndiagnosis = \"{service} is held by a stale lock\"\n\
         plans = [[\"rm -f {dir}/svc.lock\", \"touch {dir}/svc-healthy\"]]\n",
    );
    let text = format!("[reasoning]\nplaybook_file = \"{book}\"\n{}", common::marker_service(&env, "svc"));
    let mut crew = Crew::start_in(env, &text, &[]).await?;
    let extra = format!("[telemetry]\notlp_endpoint = \"{}\"\nservice_name = \"w\"\n", receiver.url);
    let stages: Vec<&str> = pitcrew_model::Stage::ALL.iter().map(|s| s.as_str()).collect();
    let mut w = crew.spawn_worker_with("w", &stages, &[("OTEL_BSP_SCHEDULE_DELAY", "100")], &extra)?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, common::WAIT).await?;
    crew.cli(&["approve", &run.to_string(), "--by", "ann"])?;
    assert_eq!(crew.events.terminal(run, common::WAIT).await?.kind, EventKind::Resolved);
    stop(&mut w)?;
    let id = run.to_string();
    let spans = receiver.spans();
    let of_run: Vec<&Span> = spans.iter().filter(|s| s.attrs.get("run") == Some(&id)).collect();
    let traces: BTreeSet<&str> = of_run.iter().map(|s| s.trace.as_str()).collect();
    assert_eq!(traces.len(), 1, "before and after the approval, one trace: {traces:?}");
    let stages: BTreeSet<&str> = of_run.iter().filter_map(|s| s.attrs.get("stage").map(String::as_str)).collect();
    assert!(stages.contains("approval") && stages.contains("execute") && stages.contains("report"), "{stages:?}");
    assert!(of_run.iter().any(|s| s.name == "approval_decision"), "the decision is in the trace");
    drop(w);
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_continues_the_callers_trace_and_counts_requests() -> anyhow::Result<()> {
    let receiver = Receiver::start().await?;
    let env = pitcrew_testkit::TestEnv::start().await?;
    let key = "key-otto-operator-0002";
    let text = format!(
        "{}[gateway.keys.otto]\nrole = \"operator\"\nsha256 = \"{}\"\n",
        common::marker_service(&env, "svc"),
        pitcrew_gateway::access::hash_key(key)
    );
    let mut crew = Crew::start_in(env, &text, &[]).await?;
    // The gateway in this process, exporting nothing: it passes the caller's trace on.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = futures::FutureExt::shared(futures::FutureExt::boxed(async move {
        let _ = rx.await;
    }));
    let gw = pitcrew_gateway::Gateway::new(crew.cfg.clone(), crew.bus.clone(), crew.store.clone(), shutdown)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(pitcrew_gateway::serve(gw, listener));
    let extra = format!("[telemetry]\notlp_endpoint = \"{}\"\nservice_name = \"w\"\n", receiver.url);
    let stages: Vec<&str> = pitcrew_model::Stage::ALL.iter().map(|s| s.as_str()).collect();
    let mut w = crew.spawn_worker_with("w", &stages, &[("OTEL_BSP_SCHEDULE_DELAY", "100")], &extra)?;

    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/incidents"))
        .bearer_auth(key)
        .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
        .json(&json!({ "service": "svc", "error": "GET /health: connection refused" }))
        .send()
        .await?;
    assert_eq!(resp.status().as_u16(), 202);
    let body: serde_json::Value = resp.json().await?;
    let run: Uuid = body["run_id"].as_str().unwrap_or_default().parse()?;
    assert_eq!(crew.events.terminal(run, common::WAIT).await?.kind, EventKind::Resolved);
    stop(&mut w)?;
    let id = run.to_string();
    let spans = receiver.spans();
    let traces: BTreeSet<&str> = spans
        .iter()
        .filter(|s| s.name == "stage" && s.attrs.get("run") == Some(&id))
        .map(|s| s.trace.as_str())
        .collect();
    assert_eq!(traces, BTreeSet::from([trace]), "the run joined the caller's trace");

    let text = pitcrew_runtime::metrics::render();
    let series = "pitcrew_http_requests_total{route=\"/v1/incidents\",method=\"POST\",status=\"202\"} 1";
    assert!(text.contains(series), "{text}");
    let _ = tx.send(());
    drop(w);
    crew.shutdown().await
}
