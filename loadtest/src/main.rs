//! pitcrew-loadtest: starts a nats-server, a fresh database and the whole crew in this
//! process (offline providers, local executor), publishes incidents through the real bus at a
//! fixed rate or as fast as possible, waits for every run to end, and prints one JSON line:
//! completed runs per second, end-to-end latency percentiles, per-stage latency (from the
//! timeline's timestamps) and errors.

use anyhow::{bail, Context};
use clap::Parser;
use futures::FutureExt;
use pitcrew::{cli, crew};
use pitcrew_model::{EventKind, RunEvent, Severity, Stage};
use pitcrew_runtime::Config;
use pitcrew_testkit::{Events, TestEnv};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};
use uuid::Uuid;

#[derive(Parser)]
#[command(about = "Drive pitcrew through the real bus and report throughput and latency")]
struct Args {
    /// Incidents to publish.
    #[arg(long, default_value_t = 200)]
    incidents: usize,
    /// Incidents per second; 0 publishes as fast as possible.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Percentage of incidents that resolve (the rest are refused by policy and escalate).
    #[arg(long, default_value_t = 80)]
    resolve_percent: u8,
    /// Per-stage concurrency of the crew.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Give up waiting for runs after this many seconds.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
}

const PLAYBOOK: &str = r#"
[[rule]]
name = "loadtest-forbidden"
match = "disk wiped"
diagnosis = "{service} lost its disk"
plans = [["rm -rf /"]]
"#;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    (sorted[i.min(sorted.len() - 1)] * 100.0).round() / 100.0
}

fn summary(mut v: Vec<f64>) -> serde_json::Value {
    v.sort_by(|a, b| a.total_cmp(b));
    serde_json::json!({ "p50": percentile(&v, 50.0), "p90": percentile(&v, 90.0), "p99": percentile(&v, 99.0), "n": v.len() })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let env = TestEnv::start().await.context("starting nats-server and a fresh database")?;
    let book = env.path("playbook.toml");
    std::fs::write(&book, PLAYBOOK)?;
    let healthy = env.path("healthy");
    std::fs::write(&healthy, "")?;
    let cfg = Config::from_toml(&env.config_toml(&format!(
        "[stages]\nconcurrency = {c}\nmax_ack_pending = {p}\n[reasoning]\nplaybook_file = \"{book}\"\n\
         [verify]\nchecks = 1\n[services.svc]\nhost = \"local\"\nstart = \"touch {healthy}\"\n\
         check = {{ kind = \"command\", command = \"test -f {healthy}\" }}\n",
        c = args.concurrency,
        p = (args.concurrency * 4).max(256),
    )))?;
    let (bus, _store) = crew::connect(&cfg).await?;
    let mut events = Events::follow(&bus, false).await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        let _ = stopped.await;
    }
    .boxed()
    .shared();
    let crew_cfg = cfg.clone();
    let crew_task = tokio::spawn(async move { crew::run(crew_cfg, &Stage::ALL, shutdown).await });

    eprintln!(
        "loadtest: publishing {} incidents ({}/s)",
        args.incidents,
        if args.rate > 0.0 { args.rate.to_string() } else { "max".into() }
    );
    let started = Instant::now();
    let mut sent: HashMap<Uuid, chrono::DateTime<chrono::Utc>> = HashMap::with_capacity(args.incidents);
    let mut errors = 0usize;
    for i in 0..args.incidents {
        if args.rate > 0.0 {
            let due = started + Duration::from_secs_f64(i as f64 / args.rate);
            tokio::time::sleep_until(due.into()).await;
        }
        let resolve = (i * 100 / args.incidents.max(1)) < args.resolve_percent as usize;
        let error = if resolve { "connection refused" } else { "disk wiped" };
        let inc = cli::incident("svc", error, None, Severity::Warning, Some(format!("lt-{i}")))?;
        match cli::open_incident(&bus, &inc).await {
            Ok(id) => {
                sent.insert(id, chrono::Utc::now());
            }
            Err(_) => errors += 1,
        }
    }
    let mut e2e = Vec::with_capacity(sent.len());
    let mut outcomes: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut stage_ms: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut timelines: HashMap<Uuid, Vec<RunEvent>> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(args.timeout);
    let mut last_progress = Instant::now();
    let mut pending: Vec<Uuid> = sent.keys().copied().collect();
    while let Some(run) = pending.pop() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("{} runs did not finish within {} s", pending.len() + 1, args.timeout);
        }
        let end = events.terminal(run, left).await?;
        // Published (our clock) to the terminal event (the worker's clock: the same machine).
        e2e.push(end.at.signed_duration_since(sent[&run]).num_microseconds().unwrap_or(0) as f64 / 1000.0);
        *outcomes
            .entry(match end.kind {
                EventKind::Resolved => "resolved",
                EventKind::Escalated => "escalated",
                _ => "other",
            })
            .or_default() += 1;
        if last_progress.elapsed() > Duration::from_secs(5) {
            eprintln!("loadtest: {} of {} runs finished", e2e.len(), sent.len());
            last_progress = Instant::now();
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    for e in &events.seen {
        timelines.entry(e.run_id).or_default().push(e.clone());
    }
    for evs in timelines.values_mut() {
        evs.sort_by_key(|e| (e.seq, e.index));
        let starts: Vec<&RunEvent> = evs.iter().filter(|e| e.kind == EventKind::Status && e.index == 0).collect();
        for w in starts.windows(2) {
            let ms = w[1].at.signed_duration_since(w[0].at).num_microseconds().unwrap_or(0) as f64 / 1000.0;
            stage_ms.entry(w[0].stage.to_string()).or_default().push(ms);
        }
    }
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(30), crew_task).await;
    let stages: serde_json::Map<String, serde_json::Value> =
        stage_ms.into_iter().map(|(k, v)| (k, summary(v))).collect();
    println!(
        "{}",
        serde_json::json!({
            "incidents": args.incidents,
            "completed": e2e.len(),
            "seconds": (elapsed * 1000.0).round() / 1000.0,
            "completed_per_second": ((e2e.len() as f64 / elapsed) * 10.0).round() / 10.0,
            "e2e_ms": summary(e2e),
            "stage_ms": stages,
            "outcomes": outcomes,
            "errors": errors,
            "concurrency": args.concurrency,
        })
    );
    Ok(())
}
