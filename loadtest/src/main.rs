//! pitcrew-loadtest: starts a nats-server, a fresh database and the whole crew in this
//! process (offline providers, local executor), publishes incidents through the real bus at a
//! fixed rate or as fast as possible, waits for every run to end, and prints one JSON line:
//! completed runs per second, end-to-end latency percentiles, per-stage latency (from the
//! timeline's timestamps) and errors. With `--target CONFIG --service NAME` it starts nothing
//! and drives a pitcrew that is already running, on that config's bus and database.
//!
//! With `--llm-latency-ms N` diagnose and plan reason with an OpenAI-compatible server the tool
//! starts in a process of its own (real HTTP) that answers every call after N ms, modelling
//! LLM-bound stages; with `--diagnose-processes K` diagnose runs in K `pitcrew worker
//! diagnose` processes instead of this one. The peak RSS of this process is reported. With
//! `--otlp-endpoint URL` (or `--otlp-sink`, a receiver in this tool) the crew's spans are
//! exported over OTLP/HTTP, to measure what tracing export costs.

mod llm;
mod observe;
mod service;
mod steady;
mod tally;

use anyhow::{bail, Context};
use clap::{Parser, ValueEnum};
use futures::FutureExt;
use pitcrew::{cli, crew};
use pitcrew_model::{EventKind, Severity, Stage};
use pitcrew_runtime::Config;
use pitcrew_testkit::TestEnv;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// mimalloc instead of glibc malloc: a run's state is encoded, decoded and copied at every
/// step, and glibc's malloc and free were a sixth of the crew's CPU under load (loadtest/README.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(about = "Drive pitcrew through the real bus and report throughput and latency")]
struct Args {
    /// Incidents to publish.
    #[arg(long, default_value_t = 200)]
    incidents: usize,
    /// Incidents per second; 0 publishes as fast as possible. End-to-end latency then counts
    /// from each incident's due time, so a publisher that falls behind counts its delay. Not
    /// with `--in-flight`, which paces the publishes by the ends instead.
    #[arg(long, default_value_t = 0.0, conflicts_with = "in_flight")]
    rate: f64,
    /// Percentage of incidents that resolve (the rest are refused by policy and escalate),
    /// spread evenly over the batch.
    #[arg(long, default_value_t = 80, value_parser = clap::value_parser!(u8).range(0..=100))]
    resolve_percent: u8,
    /// Messages each stage of the crew handles at once per process (diagnose and plan too,
    /// unless --model-concurrency is given).
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Give up waiting for runs after this many seconds.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Reason with a simulated LLM answering each call after this many milliseconds (0: the
    /// offline playbook).
    #[arg(long, default_value_t = 0)]
    llm_latency_ms: u64,
    /// Run diagnose in this many `pitcrew worker diagnose` processes (0: in this process).
    #[arg(long, default_value_t = 0)]
    diagnose_processes: usize,
    /// Internal: be the simulated LLM's server process (started by the tool itself).
    #[arg(long, hide = true)]
    serve_llm: bool,
    /// Internal: the fix the simulated LLM's plans answer with.
    #[arg(long, hide = true, default_value = "")]
    llm_fix: String,
    /// Export the crew's spans over OTLP/HTTP to this collector (e.g. http://127.0.0.1:4318).
    #[arg(long, value_name = "URL", conflicts_with = "otlp_sink")]
    otlp_endpoint: Option<String>,
    /// Export the crew's spans to an OTLP/HTTP receiver this tool runs (real HTTP on a
    /// loopback port; it counts what arrives and keeps nothing): the cost of export without
    /// a collector.
    #[arg(long)]
    otlp_sink: bool,
    /// Install the log subscriber with this filter (e.g. `info`, what a worker runs with):
    /// spans are then recorded for the log lines even without export. Default: no logging
    /// (warn when exporting).
    #[arg(long, value_name = "FILTER")]
    log: Option<String>,
    /// Runs diagnose and plan, the stages that wait on the model, each hold at once per
    /// process (default: --concurrency). With a model, set it to the runs to keep in flight
    /// and leave --concurrency low for the stages that only use the CPU: more of their runs
    /// at once only share the cores among more runs, and every hand-over waits longer.
    #[arg(long)]
    model_concurrency: Option<usize>,
    /// Runs diagnose holds at once per process (default: --model-concurrency). Set it low with a
    /// simulated LLM to make diagnose the bottleneck and see how a second process scales it.
    #[arg(long)]
    diagnose_concurrency: Option<usize>,
    /// Skip the service's default evidence commands (`ss -ltn`, `df -h`, `free -m`): what is
    /// left is the orchestration itself (the health check, the fix and verify still run).
    #[arg(long)]
    no_evidence: bool,
    /// Postgres connections of the crew's pool (pitcrew's default is 16; on 2 cores 8 measured
    /// faster: fewer backends competing for the cores).
    #[arg(long, default_value_t = 8)]
    pool_size: usize,
    /// Keep at most this many runs in flight: a new incident is published as a run ends
    /// (0: no limit, every incident is published at once or at `--rate`). Measures the
    /// sustained rate at that many in flight (`steady_per_second`).
    #[arg(long, default_value_t = 0)]
    in_flight: usize,
    /// How the service's health is checked: `command` runs `test -f` through the local
    /// executor (a process per check); `http` GETs a health endpoint this tool serves.
    #[arg(long, value_enum, default_value_t = CheckKind::Command)]
    check: CheckKind,
    /// Drive a pitcrew that is already running instead of starting one: the config file its
    /// workers run with (`PITCREW_*` variables apply, as for them). The tool starts nothing:
    /// it publishes on that bus, follows the terminal events there and reads the stage
    /// latencies from that database. The running crew's config decides reasoning, checks and
    /// fixes, so the options that shape the tool's own crew do not apply. Needs `--service`.
    #[arg(long, value_name = "CONFIG", requires = "service")]
    target: Option<std::path::PathBuf>,
    /// With `--target`: the configured service the incidents are about.
    #[arg(long, requires = "target")]
    service: Option<String>,
    /// Services of the tool's own crew the incidents are spread over (`svc-0`, `svc-1`, ...,
    /// identical; incident i is about `svc-{i % N}`; default: one per incident). pitcrew
    /// remediates a service on a host one run at a time, so runs of one service take turns in
    /// execute (past 16 waiting, the next escalate): many incidents at once are many services
    /// in production.
    #[arg(long, conflicts_with = "target", value_parser = clap::value_parser!(u32).range(1..))]
    services: Option<u32>,
    /// With `--target`: the error every incident reports (what the crew's playbook or model
    /// acts on). Default: `connection refused`.
    #[arg(long, requires = "target")]
    error: Option<String>,
}

impl Args {
    /// How many services the tool's own crew has: `--services`, else one per incident.
    fn services(&self) -> usize {
        self.services.map(|n| n as usize).unwrap_or(self.incidents).max(1)
    }

    /// What diagnose and plan hold at once per process: `--model-concurrency`, else
    /// `--concurrency`.
    fn model_concurrency(&self) -> usize {
        self.model_concurrency.unwrap_or(self.concurrency)
    }

    /// Model calls a process may have in flight: diagnose's runs and plan's at once (one call
    /// each), so neither stage's calls queue in the client behind the other's. A diagnose
    /// worker process (`--diagnose-processes`) holds only diagnose's, this one only plan's.
    fn model_calls_at_once(&self) -> usize {
        self.diagnose_concurrency.unwrap_or(self.model_concurrency()) + self.model_concurrency()
    }
}

/// Whether incident `i` resolves (else it escalates): the first k incidents hold
/// floor(k * percent / 100) resolving ones, for every k, so each stretch of the batch sees
/// the chosen mix (not the resolving ones first and the escalating ones last).
fn resolves(i: usize, percent: u8) -> bool {
    let p = percent as usize;
    (i + 1) * p / 100 != i * p / 100
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CheckKind {
    Command,
    Http,
}

/// What the in-tool OTLP receiver saw.
#[derive(Default)]
struct SinkCounts {
    posts: AtomicU64,
    spans: AtomicU64,
    bytes: AtomicU64,
}

/// Accept OTLP/HTTP export requests on a loopback port, count them and answer 200.
async fn otlp_sink() -> anyhow::Result<(String, Arc<SinkCounts>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let counts = Arc::new(SinkCounts::default());
    let seen = counts.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let Ok(req) = pitcrew_testkit::http::read_request(&mut conn).await else { return };
                seen.posts.fetch_add(1, Ordering::Relaxed);
                seen.bytes.fetch_add(req.body.len() as u64, Ordering::Relaxed);
                let spans = req.body.windows(9).filter(|w| w == b"\"traceId\"").count() as u64;
                seen.spans.fetch_add(spans, Ordering::Relaxed);
                let _ = pitcrew_testkit::http::write_json(&mut conn, 200, &[], "{}").await;
            });
        }
    });
    Ok((url, counts))
}

const PLAYBOOK: &str = r#"
[[rule]]
name = "loadtest-forbidden"
match = "disk wiped"
diagnosis = "{service} lost its disk"
plans = [["rm -rf /"]]
"#;

/// A child process killed when dropped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// To one decimal, as the rates are printed.
fn tenth(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// This process's peak resident set (VmHWM), in MiB.
fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some((kb / 1024.0 * 10.0).round() / 10.0)
}

/// CPU time (user + system) of this process and its local watchdog, and of its reaped
/// children (the commands the crew ran), in ms, from getrusage and /proc.
fn cpu_ms() -> (f64, f64) {
    let of = |who| {
        // SAFETY: getrusage only writes the struct we hand it.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        if unsafe { libc::getrusage(who, &mut ru) } != 0 {
            return 0.0;
        }
        let ms = |t: libc::timeval| t.tv_sec as f64 * 1000.0 + t.tv_usec as f64 / 1000.0;
        ms(ru.ru_utime) + ms(ru.ru_stime)
    };
    let watchdog = pitcrew_exec::watchdog::own().and_then(|w| w.cpu_ms()).unwrap_or(0.0);
    (of(libc::RUSAGE_SELF) + watchdog, of(libc::RUSAGE_CHILDREN))
}

/// Busy CPU time of the whole machine so far (every process: Postgres and nats-server too),
/// in ms, from /proc/stat.
fn machine_busy_ms() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu: Vec<f64> = stat.lines().next()?.split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal: busy = all but idle and iowait.
    let busy: f64 = cpu.iter().take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, v)| v).sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some(busy * 1000.0 / hz.max(1.0))
}

/// With a simulated model and a known number of runs in flight (`--in-flight`, at most the
/// batch, or every incident at once): the most runs a second the model's latency allows, that
/// number (or the model stages' concurrency, when lower) over the model time a run spends (the calls over the `runs` that ended, times the
/// latency), and the share of it `rate` (the steady rate, or the overall one) reached. None
/// without a model or with `--rate`.
fn llm_bound(args: &Args, calls: Option<llm::Calls>, runs: usize, rate: f64) -> Option<serde_json::Value> {
    let in_flight = match (args.in_flight, args.rate > 0.0) {
        (0, false) => args.incidents,
        (n, false) => n.min(args.incidents),
        (_, true) => return None,
    };
    let calls = calls.filter(|c| c.all > 0 && runs > 0 && args.llm_latency_ms > 0)?;
    let secs_per_run = |calls: u64| calls as f64 / runs as f64 * args.llm_latency_ms as f64 / 1000.0;
    let model_secs = secs_per_run(calls.all);
    let mut per_second = in_flight as f64 / model_secs;
    let mut bounded_by = "in_flight";
    // The crew the tool runs holds at most a model stage's concurrency in its calls at once
    // (diagnose's in each of its processes), however many runs are in flight: that stage
    // lets no more runs a second through than that over its model time a run.
    if args.target.is_none() {
        let diagnose = args.diagnose_concurrency.unwrap_or(args.model_concurrency()) * args.diagnose_processes.max(1);
        for (stage, at_once, stage_calls) in [
            ("diagnose_concurrency", diagnose, calls.diagnose),
            ("plan_concurrency", args.model_concurrency(), calls.all - calls.diagnose),
        ] {
            let through = at_once as f64 / secs_per_run(stage_calls);
            if stage_calls > 0 && through < per_second {
                (per_second, bounded_by) = (through, stage);
            }
        }
    }
    Some(serde_json::json!({
        "in_flight": in_flight,
        "bounded_by": bounded_by,
        "model_seconds_per_run": (model_secs * 1000.0).round() / 1000.0,
        "per_second": (per_second * 10.0).round() / 10.0,
        "reached": ((rate / per_second) * 1000.0).round() / 1000.0,
    }))
}

/// Most incident publishes waiting for their acks at once.
const PUBLISH_WINDOW: usize = 256;

/// What a publish task answers: when it published, and the run or why not.
type Published = (chrono::DateTime<chrono::Utc>, Result<Uuid, pitcrew_runtime::bus::BusError>);

/// The incident publishes awaiting their acks, each task's run by its task id (so a failed
/// task still names its run).
struct Publishing {
    tasks: tokio::task::JoinSet<Published>,
    runs: HashMap<tokio::task::Id, Uuid>,
}

impl Publishing {
    /// Publish `run`'s incident in a task of its own, remembered by the task's id.
    fn spawn(&mut self, run: Uuid, publish: impl std::future::Future<Output = Published> + Send + 'static) {
        let task = self.tasks.spawn(publish);
        self.runs.insert(task.id(), run);
    }

    /// One publish has its answer: the run is sent, or it counts as an error and leaves the
    /// runs in flight (unless its end came first: see `observe::Ours`).
    fn answered(
        &mut self,
        done: Result<(tokio::task::Id, Published), tokio::task::JoinError>,
        sent: &mut HashMap<Uuid, chrono::DateTime<chrono::Utc>>,
        errors: &mut usize,
        ours: &observe::Ours,
    ) {
        let task = match &done {
            Ok((task, _)) => *task,
            Err(e) => e.id(),
        };
        let run = self.runs.remove(&task);
        let failure = match done {
            Ok((_, (at, Ok(id)))) => {
                sent.insert(id, at);
                return;
            }
            Ok((_, (_, Err(e)))) => e.to_string(),
            Err(e) => format!("the publish task failed: {e}"),
        };
        if *errors == 0 {
            eprintln!("loadtest: publishing an incident failed: {failure}");
        }
        *errors += 1;
        if let Some(run) = run {
            ours.release(run);
        }
    }
}

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

/// The crew the tool runs itself (every stage in this process, or diagnose in worker
/// processes), on its own nats-server and fresh database, and what it needs to stop it.
struct Local {
    env: TestEnv,
    cfg: Config,
    bus: pitcrew_runtime::Bus,
    crew_task: tokio::task::JoinHandle<anyhow::Result<()>>,
    /// Told how the crew's task ended (dropped unsent: it panicked).
    crew_ended: tokio::sync::oneshot::Receiver<String>,
    stop: tokio::sync::oneshot::Sender<()>,
    workers: Vec<KillOnDrop>,
    llm: Option<llm::SimulatedLlm>,
    /// Why the crew can no longer finish the batch, once seen.
    down: Option<String>,
}

impl Local {
    /// Why the crew can no longer finish the batch: its task ended (the tool stops it only
    /// after the batch: an error or a panic) or a diagnose worker process exited (with the end
    /// of its log, which goes with the tool's directory).
    fn gone(&mut self) -> Option<String> {
        if self.down.is_none() {
            use tokio::sync::oneshot::error::TryRecvError;
            self.down = match self.crew_ended.try_recv() {
                Ok(how) => Some(format!("the crew stopped: {how}")),
                Err(TryRecvError::Closed) => Some("the crew's task panicked".into()),
                Err(TryRecvError::Empty) => None,
            };
        }
        if self.down.is_none() {
            for (k, w) in self.workers.iter_mut().enumerate() {
                if let Ok(Some(status)) = w.0.try_wait() {
                    let log = std::fs::read(self.env.path(&format!("diagnose-{k}.log"))).unwrap_or_default();
                    let tail = String::from_utf8_lossy(&log[log.len().saturating_sub(2048)..]).trim().to_string();
                    self.down = Some(format!("diagnose worker {k} exited ({status}); the end of its log:\n{tail}"));
                    break;
                }
            }
        }
        self.down.clone()
    }
}

/// Resolves when the tool's own crew can no longer finish the batch, saying why (checked
/// every 200 ms); never with `--target`, whose crew is not the tool's to watch.
async fn crew_down(local: &mut Option<Local>) -> String {
    let Some(l) = local.as_mut() else { return std::future::pending().await };
    loop {
        if let Some(why) = l.gone() {
            return why;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The crew's stage settings: `concurrency` for the stages that only use the CPU,
/// `model` for the two that wait on the model (diagnose may have its own), and room in every
/// consumer for all of them (the `diagnose_processes` worker processes share one consumer).
fn stage_config(concurrency: usize, model: usize, diagnose: Option<usize>, diagnose_processes: usize) -> String {
    let diagnose = diagnose.unwrap_or(model);
    let widest = concurrency.max(model).max(diagnose * diagnose_processes.max(1));
    let pending = (widest * 4).max(256);
    format!(
        "[stages]\nconcurrency = {concurrency}\nmax_ack_pending = {pending}\n\
         [stage.diagnose]\nconcurrency = {diagnose}\n[stage.plan]\nconcurrency = {model}\n"
    )
}

/// Start nats-server, a fresh database, the simulated model if asked for, and the crew.
async fn start_local(args: &Args, endpoint: Option<&str>, crew_rt: &tokio::runtime::Handle) -> anyhow::Result<Local> {
    let env = TestEnv::start().await.context("starting nats-server and a fresh database")?;
    eprintln!(
        "loadtest: the crew's database {} and directory {} (both removed at the end, or on SIGINT, SIGTERM, SIGHUP or SIGQUIT)",
        env.db.name(),
        env.dir.path().display()
    );
    let book = env.path("playbook.toml");
    std::fs::write(&book, PLAYBOOK)?;
    let healthy = env.path("healthy");
    std::fs::write(&healthy, "")?;
    let model_concurrency = args.model_concurrency();
    // The simulated LLM: a grounded diagnosis quoting the incident, and the playbook's plan.
    let llm = if args.llm_latency_ms > 0 {
        Some(llm::start(Duration::from_millis(args.llm_latency_ms), &format!("touch {healthy}")).await?)
    } else {
        None
    };
    let reasoning = match &llm {
        Some(l) => format!(
            "[reasoning]\nprovider = \"openai\"\nplaybook_file = \"{book}\"\n[reasoning.openai]\nbase_url = \"{}\"\n\
             model = \"simulated\"\napi_key_env = \"\"\nmax_concurrent = {}\ntimeout_secs = 120\nstream = false\n",
            l.base_url,
            args.model_calls_at_once()
        ),
        None => format!("[reasoning]\nplaybook_file = \"{book}\"\n"),
    };
    // LLM-bound runs skip the evidence commands so the model's latency is what is measured.
    let evidence = if llm.is_some() || args.no_evidence { "evidence = []\n" } else { "" };
    let check = match args.check {
        CheckKind::Command => format!("{{ kind = \"command\", command = \"test -f {healthy}\" }}"),
        CheckKind::Http => {
            format!("{{ kind = \"http\", url = \"{}\" }}", service::start(healthy.clone().into()).await?)
        }
    };
    let text = env.config_toml(&format!(
        "{stages}{reasoning}\
         [verify]\nchecks = 1\n{services}",
        stages = stage_config(args.concurrency, model_concurrency, args.diagnose_concurrency, args.diagnose_processes),
        services = (0..args.services())
            .map(|i| format!(
                "[services.svc-{i}]\nhost = \"local\"\nstart = \"touch {healthy}\"\n{evidence}check = {check}\n"
            ))
            .collect::<String>(),
    ));
    let text = text.replacen("pool_size = 8\n", &format!("pool_size = {}\n", args.pool_size.max(1)), 1);
    // Worker processes (--diagnose-processes) export to the same place.
    let text = match endpoint {
        Some(url) => format!("{text}[telemetry]\notlp_endpoint = \"{url}\"\nservice_name = \"pitcrew-diagnose\"\n"),
        None => text,
    };
    let cfg = Config::from_toml(&text)?;
    let (bus, _store) = crew::connect(&cfg).await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        let _ = stopped.await;
    }
    .boxed()
    .shared();
    let crew_cfg = cfg.clone();
    let here: Vec<Stage> =
        Stage::ALL.into_iter().filter(|s| args.diagnose_processes == 0 || *s != Stage::Diagnose).collect();
    let (ended, crew_ended) = tokio::sync::oneshot::channel();
    let crew_task = crew_rt.spawn(async move {
        let r = crew::run(crew_cfg, &here, shutdown).await;
        let _ = ended.send(match &r {
            Ok(()) => "it ended without an error".to_string(),
            Err(e) => format!("{e:#}"),
        });
        r
    });
    let mut workers = Vec::new();
    if args.diagnose_processes > 0 {
        let exe = std::env::current_exe()?.with_file_name("pitcrew");
        if !exe.exists() {
            bail!("--diagnose-processes needs {} (cargo build --release -p pitcrew)", exe.display());
        }
        let file = env.path("pitcrew.toml");
        std::fs::write(&file, &text)?;
        for k in 0..args.diagnose_processes {
            let log = std::fs::File::create(env.path(&format!("diagnose-{k}.log")))?;
            let mut cmd = std::process::Command::new(&exe);
            cmd.args(["--config", &file, "worker", "diagnose"])
                .env("PITCREW_WORKER_NAME", format!("diagnose-{k}"))
                .env_remove("DATABASE_URL")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(log);
            // Tied to this process: killed with it, however it ends.
            let child = pitcrew_exec::process::spawn_tied(cmd)?;
            workers.push(KillOnDrop(child));
        }
    }

    Ok(Local { env, cfg, bus, crew_task, crew_ended, stop, workers, llm, down: None })
}

/// `--target`: the running crew's config, its bus and its database. Refuses the options that
/// only shape the tool's own crew, and a service the crew does not know.
async fn connect_target(
    args: &Args,
    path: &std::path::Path,
) -> anyhow::Result<(Config, pitcrew_runtime::Bus, tokio_postgres::Client)> {
    let own = [
        (args.llm_latency_ms > 0, "--llm-latency-ms"),
        (args.diagnose_processes > 0, "--diagnose-processes"),
        (args.model_concurrency.is_some(), "--model-concurrency"),
        (args.diagnose_concurrency.is_some(), "--diagnose-concurrency"),
        (args.no_evidence, "--no-evidence"),
        (args.check != CheckKind::Command, "--check"),
        (args.otlp_endpoint.is_some() || args.otlp_sink, "--otlp-endpoint/--otlp-sink"),
    ];
    if let Some((_, flag)) = own.iter().find(|(set, _)| *set) {
        bail!("{flag} shapes the crew this tool starts; with --target the running crew's own config decides");
    }
    let cfg = Config::load(Some(path)).with_context(|| format!("--target {}", path.display()))?;
    let service = args.service.as_deref().unwrap_or_default();
    if !cfg.services.contains_key(service) {
        let known: Vec<&String> = cfg.services.keys().collect();
        bail!("--service {service}: not under [services] in {} (it has {known:?})", path.display());
    }
    let bus = pitcrew_runtime::Bus::connect(&cfg).await.context("connecting to the target's NATS")?;
    let events = bus.subjects.events_stream();
    bus.js.get_stream(&events).await.with_context(|| {
        format!("the target's bus has no stream {events}: is pitcrew running there, with this config's prefix?")
    })?;
    // TLS as the crew's own connections have it (the URL's sslmode and sslrootcert).
    let target = pitcrew_runtime::store::database_target(&cfg.database.url)?;
    let (db, conn) = target
        .config
        .connect(target.tls)
        .await
        .context("connecting to the target's database (for the stage latencies)")?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            eprintln!("loadtest: the database connection ended: {e}");
        }
    });
    Ok((cfg, bus, db))
}

fn main() -> anyhow::Result<()> {
    // As in a `pitcrew` process: the crew's local commands are watched by a watchdog, this
    // binary again (its CPU is counted with the crew's).
    pitcrew_exec::watchdog::serve_if_asked();
    pitcrew_exec::watchdog::use_own();
    let args = Args::parse();
    // A worker thread a core (or TOKIO_WORKER_THREADS) unless `workers` says.
    let runtime = |name: &str, workers: Option<usize>| {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        if let Some(n) = workers {
            builder.worker_threads(n);
        }
        builder.enable_all().thread_name(name).build()
    };
    if args.serve_llm {
        return runtime("llm", None)?.block_on(llm::serve(Duration::from_millis(args.llm_latency_ms), args.llm_fix));
    }
    // The crew gets a runtime of its own, as in a `pitcrew` process (a worker thread a core,
    // or TOKIO_WORKER_THREADS); the tool (publishing, watching the ends, the target's health
    // endpoint) runs on one thread of its own, so it is never queued behind the crew's tasks:
    // a run's end starts the next run as soon as the tool hears of it.
    let crew = runtime("crew", None)?;
    let tool = runtime("tool", Some(1))?;
    let mut batch = Box::pin(drive(args, crew.handle().clone()));
    let finished = tool.block_on(async {
        tokio::select! {
            r = &mut batch => Ok(r),
            s = interrupted() => Err(s),
        }
    });
    // Interrupted, the batch is dropped: its crew first (nothing of it writes in the
    // directory as it goes), then its nats-server, database and directory.
    match finished {
        Ok(result) => {
            drop(tool);
            crew.shutdown_timeout(Duration::from_secs(5));
            result
        }
        Err(signal) => {
            crew.shutdown_timeout(Duration::from_secs(5));
            tool.block_on(async move { drop(batch) });
            Err(anyhow::anyhow!("interrupted by {signal}: the batch was abandoned, its crew removed"))
        }
    }
}

/// The first SIGINT, SIGTERM, SIGHUP (the terminal or SSH session running the batch closed)
/// or SIGQUIT: each would otherwise end the tool without its clean-up.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let watched = [
        (SignalKind::interrupt(), "SIGINT"),
        (SignalKind::terminate(), "SIGTERM"),
        (SignalKind::hangup(), "SIGHUP"),
        (SignalKind::quit(), "SIGQUIT"),
    ];
    let mut waits = Vec::new();
    for (kind, name) in watched {
        // One this process was started ignoring (`nohup` ignores SIGHUP; a shell's `cmd &`,
        // SIGINT and SIGQUIT) stays ignored: watching it would end a batch its user meant to
        // outlive the terminal.
        if ignored(kind.as_raw_value()) {
            continue;
        }
        match signal(kind) {
            Ok(mut s) => waits.push(async move { s.recv().await.map(|_| name) }.boxed()),
            Err(e) => {
                eprintln!("loadtest: cannot watch for {name} ({e}): if it comes, the batch leaves its database behind")
            }
        }
    }
    if waits.is_empty() {
        return std::future::pending().await;
    }
    loop {
        let (got, _, rest) = futures::future::select_all(waits).await;
        match got {
            Some(name) => return name,
            // That signal's stream ended: watch the others.
            None if rest.is_empty() => return std::future::pending().await,
            None => waits = rest,
        }
    }
}

/// Whether signal `sig` is ignored in this process (inherited so from its parent).
fn ignored(sig: libc::c_int) -> bool {
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: a null new action only reads the current one into `old`.
    let read = unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) };
    read == 0 && old.sa_sigaction == libc::SIG_IGN
}

async fn drive(args: Args, crew_rt: tokio::runtime::Handle) -> anyhow::Result<()> {
    // Span export, when asked for: logs stay at warn so only export's cost is added.
    let sink = if args.otlp_sink { Some(otlp_sink().await?) } else { None };
    let endpoint = args.otlp_endpoint.clone().or_else(|| sink.as_ref().map(|(url, _)| url.clone()));
    let mut telemetry = if endpoint.is_some() || args.log.is_some() {
        let cfg = pitcrew_runtime::config::TelemetryConfig {
            otlp_endpoint: endpoint.clone(),
            service_name: "pitcrew-loadtest".into(),
            ..Default::default()
        };
        // The tool's filter wins over PITCREW_LOG / RUST_LOG.
        if let Some(filter) = &args.log {
            std::env::set_var("PITCREW_LOG", filter);
        }
        Some(pitcrew_runtime::telemetry::init_with("warn", &cfg)?)
    } else {
        None
    };
    let mut local = None;
    let (cfg, bus, db) = match &args.target {
        Some(path) => connect_target(&args, path).await?,
        None => {
            let l = start_local(&args, endpoint.as_deref(), &crew_rt).await?;
            let db = l.env.db.client().await?;
            let (cfg, bus) = (l.cfg.clone(), l.bus.clone());
            local = Some(l);
            (cfg, bus, db)
        }
    };
    // The tool's own crew has `--services` of them; a running crew, the one named.
    let service_of = |i: usize| match &args.service {
        Some(name) => name.clone(),
        None => format!("svc-{}", i % args.services()),
    };
    // One permit per run allowed in flight; the observer gives one back as each run ends.
    let in_flight = Arc::new(tokio::sync::Semaphore::new(if args.in_flight > 0 {
        args.in_flight
    } else {
        tokio::sync::Semaphore::MAX_PERMITS
    }));
    let ours = observe::Ours::new(in_flight.clone());
    let mut finished = observe::terminals(&bus, ours.clone()).await?;
    // A tag of this batch in each incident's fingerprint: a run of an earlier batch still
    // open on the same crew never swallows one of this batch's as a duplicate.
    let batch = Uuid::new_v4().simple().to_string()[..8].to_string();

    eprintln!(
        "loadtest: publishing {} incidents ({}/s{})",
        args.incidents,
        if args.rate > 0.0 { args.rate.to_string() } else { "max".into() },
        if args.in_flight > 0 { format!(", at most {} in flight", args.in_flight) } else { String::new() }
    );
    let started = Instant::now();
    let started_at = chrono::Utc::now();
    let (cpu_self0, cpu_children0) = cpu_ms();
    let machine0 = machine_busy_ms();
    let mut sent: HashMap<Uuid, chrono::DateTime<chrono::Utc>> = HashMap::with_capacity(args.incidents);
    let mut planned: HashMap<Uuid, tally::Planned> = HashMap::with_capacity(args.incidents);
    let mut ended: Vec<tally::Ended> = Vec::with_capacity(args.incidents);
    let mut publish_errors = 0usize;
    // Incidents left unpublished because the runs in flight did not end before the deadline.
    let mut unpublished = 0usize;
    let mut publishing = Publishing { tasks: tokio::task::JoinSet::new(), runs: HashMap::new() };
    let mut last_progress = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(args.timeout);
    for i in 0..args.incidents {
        let due = (args.rate > 0.0).then(|| Duration::from_secs_f64(i as f64 / args.rate));
        if let Some(after) = due {
            if started + after >= deadline {
                eprintln!("loadtest: --timeout {} s passed at --rate {}: publishing stopped", args.timeout, args.rate);
                unpublished = args.incidents - i;
                break;
            }
            tokio::time::sleep_until((started + after).into()).await;
        }
        let permit = tokio::select! {
            biased;
            why = crew_down(&mut local) => {
                eprintln!("loadtest: {why}: publishing stopped");
                unpublished = args.incidents - i;
                break;
            }
            permit = tokio::time::timeout_at(deadline.into(), in_flight.acquire()) => permit,
        };
        let Ok(permit) = permit else {
            eprintln!("loadtest: {} runs still in flight after {} s: publishing stopped", args.in_flight, args.timeout);
            unpublished = args.incidents - i;
            break;
        };
        permit?.forget();
        while let Ok((seen, e)) = finished.try_recv() {
            ended.push(tally::Ended::of(seen, &e));
        }
        let (error, expected) = match (&args.target, &args.error) {
            (Some(_), Some(e)) => (e.as_str(), None),
            (Some(_), None) => ("connection refused", None),
            (None, _) if resolves(i, args.resolve_percent) => ("connection refused", Some(EventKind::Resolved)),
            (None, _) => ("disk wiped", Some(EventKind::Escalated)),
        };
        let inc = cli::incident(&service_of(i), error, None, Severity::Warning, Some(format!("lt-{batch}-{i}")))?;
        let run = inc.id.context("the incident has no id")?;
        planned.insert(run, tally::Planned { expected, due: due.map(|after| started_at + after) });
        ours.add(run);
        // Publishes overlap (each waits for its own ack), so the next run starts as soon as
        // a permit frees, not one stream ack later: a publisher that waits for each ack in
        // turn falls behind the ends and keeps fewer runs in flight than asked.
        while publishing.tasks.len() >= PUBLISH_WINDOW {
            if let Some(done) = publishing.tasks.join_next_with_id().await {
                publishing.answered(done, &mut sent, &mut publish_errors, &ours);
            }
        }
        while let Some(done) = publishing.tasks.try_join_next_with_id() {
            publishing.answered(done, &mut sent, &mut publish_errors, &ours);
        }
        let bus = bus.clone();
        publishing.spawn(run, async move {
            let at = chrono::Utc::now();
            (at, bus.open_incident(&inc).await)
        });
        if last_progress.elapsed() > Duration::from_secs(5) {
            eprintln!("loadtest: {} published, {} runs finished", i + 1, ended.len());
            last_progress = Instant::now();
        }
    }
    while let Some(done) = publishing.tasks.join_next_with_id().await {
        publishing.answered(done, &mut sent, &mut publish_errors, &ours);
    }
    let published = started.elapsed().as_secs_f64();
    // A run whose publish failed may have ended anyway (its ack lost on the way back): it is
    // an error, not a result.
    ended.retain(|e| sent.contains_key(&e.run));
    // A run that does not end by the deadline is an error of the report, not its loss.
    while ended.len() < sent.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        let next = tokio::select! {
            biased;
            why = crew_down(&mut local) => {
                eprintln!("loadtest: {why}: the runs not seen to end count as timed out");
                // The ends that came before it count.
                while let Ok((seen, e)) = finished.try_recv() {
                    if sent.contains_key(&e.run_id) {
                        ended.push(tally::Ended::of(seen, &e));
                    }
                }
                break;
            }
            next = tokio::time::timeout(left, finished.recv()) => next,
        };
        match next {
            Ok(Some((seen, e))) if sent.contains_key(&e.run_id) => ended.push(tally::Ended::of(seen, &e)),
            Ok(Some(_)) => {}
            // Counted as timed out: what could not be watched did not end as far as we know.
            Ok(None) => {
                eprintln!("loadtest: the terminal-event stream ended: the runs not seen to end count as timed out");
                break;
            }
            Err(_) => break,
        }
        if last_progress.elapsed() > Duration::from_secs(5) {
            eprintln!("loadtest: {} of {} runs finished", ended.len(), sent.len());
            last_progress = Instant::now();
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    // With --target the crew runs elsewhere: this process holds only the tool.
    let own = args.target.is_none();
    // Here, before the timelines are read below (rows of every run in this process's memory).
    let peak_rss = if own { peak_rss_mb() } else { None };
    let (cpu_self1, cpu_children1) = cpu_ms();
    let machine1 = machine_busy_ms();
    let timed_out = unpublished + (sent.len() - ended.len());
    let tally = tally::Tally::of(&ended, &sent, &planned);
    let errors = publish_errors + tally.unexpected + tally.not_run + timed_out;
    // With runs kept in flight: the rate while N were in flight (see `steady::window`). Every
    // end frees a slot, so every end places the window; only completed runs count in its rate.
    let mut ends: Vec<chrono::DateTime<chrono::Utc>> = ended.iter().map(|e| e.at).collect();
    ends.sort();
    let window =
        (args.in_flight > 0).then(|| steady::window(&ends, args.in_flight, sent.values().max().copied())).flatten();
    let steady = window.map(|w| steady::rate(&tally.completed, w));
    // What the bound assumes is `--in-flight`; a tool that lags behind the ends keeps fewer.
    // Every run published counts, those that never ended too (in flight to the window's end).
    let in_flight_mean = window.map(|w| {
        let end_of: HashMap<Uuid, chrono::DateTime<chrono::Utc>> = ended.iter().map(|e| (e.run, e.at)).collect();
        steady::mean_in_flight(sent.iter().map(|(run, s)| (*s, end_of.get(run).copied())), w)
    });
    let per_run = |ms: f64| ((ms / ended.len().max(1) as f64) * 100.0).round() / 100.0;
    // What a run that ended costs in CPU: this process (the crew and the tool), the commands
    // it ran, and the whole machine (adds Postgres and nats-server; only meaningful on a quiet
    // one).
    let cpu = serde_json::json!({
        "crew": own.then(|| per_run(cpu_self1 - cpu_self0)),
        "commands": own.then(|| per_run(cpu_children1 - cpu_children0)),
        "machine": machine0.zip(machine1).map(|(a, b)| per_run(b - a)),
    });
    // Neither this nor the model's count below keeps the line from being printed.
    let stage_ms = observe::stage_latencies(&db, &sent, args.target.is_none()).await.unwrap_or_else(|e| {
        eprintln!("loadtest: cannot read the stage latencies: {e:#}");
        Default::default()
    });
    // Why the crew stopped before the batch did, if it did: the runs it left count as timed out.
    let crew_failed = local.as_mut().and_then(|l| l.down.clone());
    let llm_calls = match local.take() {
        Some(l) => {
            let _ = l.stop.send(());
            match tokio::time::timeout(Duration::from_secs(30), l.crew_task).await {
                Ok(Ok(Ok(()))) => {}
                // Said already, when it ended before the batch did.
                _ if l.down.is_some() => {}
                Ok(Ok(Err(e))) => eprintln!("loadtest: the crew ended with an error: {e:#}"),
                Ok(Err(e)) => eprintln!("loadtest: the crew's task failed: {e}"),
                Err(_) => eprintln!("loadtest: the crew did not stop within 30 s of being told to"),
            }
            drop(l.workers);
            let calls = match l.llm {
                Some(m) => m
                    .finish()
                    .await
                    .map_err(|e| eprintln!("loadtest: cannot read the simulated model's call count: {e:#}"))
                    .ok(),
                None => None,
            };
            drop(l.env);
            calls
        }
        None => None,
    };
    // Flush the spans still queued, so the sink's counts are complete.
    if let Some(t) = telemetry.as_mut() {
        tokio::task::block_in_place(|| t.shutdown());
    }
    let otlp = endpoint.as_ref().map(|url| {
        let counts = sink.as_ref().map(|(_, c)| {
            serde_json::json!({
                "posts": c.posts.load(Ordering::Relaxed),
                "spans": c.spans.load(Ordering::Relaxed),
                "bytes": c.bytes.load(Ordering::Relaxed),
            })
        });
        serde_json::json!({ "endpoint": url, "received": counts })
    });
    let stages: serde_json::Map<String, serde_json::Value> =
        stage_ms.into_iter().map(|(k, v)| (k, summary(v))).collect();
    let completed = tally.e2e.len();
    // Unrounded: `reached` is computed from it (or the steady one); printed to one decimal.
    let rate = completed as f64 / elapsed;
    // The model's calls over the runs that made them: not when some never ended or may have
    // run unseen (their calls are counted, they are not), and duplicates or rejections made
    // none.
    let bound = (timed_out == 0 && publish_errors == 0)
        .then(|| llm_bound(&args, llm_calls, completed + tally.unexpected, steady.unwrap_or(rate)))
        .flatten();
    println!(
        "{}",
        serde_json::json!({
            "incidents": args.incidents,
            "completed": completed,
            "seconds": (elapsed * 1000.0).round() / 1000.0,
            "publish_seconds": (published * 1000.0).round() / 1000.0,
            "completed_per_second": tenth(rate),
            "steady_per_second": steady.map(tenth),
            "in_flight": args.in_flight,
            "in_flight_mean": in_flight_mean,
            "check": own.then_some(match args.check { CheckKind::Command => "command", CheckKind::Http => "http" }),
            "e2e_ms": summary(tally.e2e),
            "stage_ms": stages,
            "outcomes": tally.outcomes,
            "errors": errors,
            "publish_errors": publish_errors,
            "unexpected_outcomes": tally.unexpected,
            "timed_out": timed_out,
            "concurrency": own.then_some(args.concurrency),
            "pool_size": cfg.database.pool_size,
            "llm_latency_ms": args.llm_latency_ms,
            "llm_calls": llm_calls.map(|c| c.all),
            "llm_bound": bound,
            "diagnose_processes": args.diagnose_processes,
            "model_concurrency": own.then(|| args.model_concurrency()),
            "diagnose_concurrency": args.diagnose_concurrency,
            "evidence_commands": own.then_some(!(args.no_evidence || args.llm_latency_ms > 0)),
            "peak_rss_mb": peak_rss,
            "target": args.target.as_ref().map(|p| p.display().to_string()),
            "service": args.service,
            "services": own.then(|| args.services()),
            "cpu_ms_per_run": cpu,
            "otlp": otlp,
            "log": args.log,
        })
    );
    if let Some(why) = crew_failed {
        let why = why.lines().next().unwrap_or_default().to_string();
        bail!("the crew failed before the batch ended ({why}): {timed_out} incidents counted as timed out");
    }
    if timed_out > 0 {
        bail!("{timed_out} incidents did not end within {} s (counted in errors)", args.timeout);
    }
    if errors > 0 {
        bail!(
            "{errors} of {} incidents did not complete as their scenario expects (see the line's errors)",
            args.incidents
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(more: &[&str]) -> Args {
        Args::parse_from(std::iter::once("pitcrew-loadtest").chain(more.iter().copied()))
    }

    #[test]
    fn the_mix_is_spread_so_every_prefix_holds_the_chosen_share() {
        for percent in 0..=100u8 {
            let mut resolving = 0;
            for i in 0..1000 {
                resolving += resolves(i, percent) as usize;
                // The first i + 1 incidents: their share, rounded down, exactly.
                assert_eq!(resolving, (i + 1) * percent as usize / 100, "{percent} % after {}", i + 1);
            }
        }
        // 80 %: one escalation in every five, not the last fifth of the batch.
        let five: Vec<bool> = (0..10).map(|i| resolves(i, 80)).collect();
        assert_eq!(five, [false, true, true, true, true, false, true, true, true, true]);
    }

    #[test]
    fn percentiles_are_nearest_rank_over_the_sorted_values_to_two_decimals() {
        let empty = summary(Vec::new());
        assert_eq!(empty, serde_json::json!({ "p50": 0.0, "p90": 0.0, "p99": 0.0, "n": 0 }));
        // 0..=100 in reverse: the p-th percentile is p.
        let hundred = summary((0..=100).rev().map(f64::from).collect());
        assert_eq!(hundred, serde_json::json!({ "p50": 50.0, "p90": 90.0, "p99": 99.0, "n": 101 }));
        assert_eq!(summary(vec![1.23456])["p99"], 1.23);
        assert_eq!(percentile(&[1.0, 2.0], 100.0), 2.0);
    }

    #[test]
    fn the_model_bound_counts_no_more_runs_in_flight_than_the_batch_has() {
        let bound = |more: &[&str]| {
            let mut all = vec!["--incidents", "10", "--llm-latency-ms", "100"];
            all.extend_from_slice(more);
            llm_bound(&args(&all), Some(llm::Calls { all: 20, diagnose: 10 }), 10, 25.0)
        };
        // Ten runs at 2 x 100 ms of model time each: 50 a second, whatever --in-flight says above ten.
        for more in [&[][..], &["--in-flight", "50"][..], &["--in-flight", "10"][..]] {
            let b = bound(more).unwrap();
            assert_eq!(b["in_flight"], 10, "{more:?}");
            assert_eq!(b["per_second"], 50.0, "{more:?}");
            assert_eq!(b["reached"], 0.5, "{more:?}");
        }
        assert_eq!(bound(&["--in-flight", "4"]).unwrap()["per_second"], 20.0);
        // Fewer model calls at once in a stage than runs in flight: that stage's concurrency
        // bounds it (2 at once in diagnose, 0.1 s a run: 20 a second).
        let capped = bound(&["--model-concurrency", "3", "--diagnose-concurrency", "2"]).unwrap();
        assert_eq!(
            (&capped["bounded_by"], &capped["per_second"]),
            (&serde_json::json!("diagnose_concurrency"), &serde_json::json!(20.0))
        );
        let capped = bound(&["--model-concurrency", "3", "--diagnose-concurrency", "8"]).unwrap();
        assert_eq!(
            (&capped["bounded_by"], &capped["per_second"]),
            (&serde_json::json!("plan_concurrency"), &serde_json::json!(30.0))
        );
        assert_eq!(bound(&[]).unwrap()["bounded_by"], "in_flight");
        assert!(bound(&["--rate", "5"]).is_none());
    }

    #[test]
    fn rate_and_in_flight_are_not_taken_together() {
        let both = Args::try_parse_from(["pitcrew-loadtest", "--rate", "10", "--in-flight", "4"]);
        let said = both.err().expect("refused").to_string();
        assert!(said.contains("--rate") && said.contains("--in-flight"), "{said}");
        assert!(Args::try_parse_from(["pitcrew-loadtest", "--resolve-percent", "101"]).is_err());
    }

    #[test]
    fn the_model_client_lets_diagnose_and_plan_all_call_at_once() {
        assert_eq!(args(&["--concurrency", "8"]).model_calls_at_once(), 16);
        assert_eq!(args(&["--model-concurrency", "100"]).model_calls_at_once(), 200);
        // Diagnose above the model stages' own concurrency: its calls too.
        let a = args(&["--model-concurrency", "10", "--diagnose-concurrency", "50"]);
        assert_eq!(a.model_calls_at_once(), 60);
    }

    #[test]
    fn model_stages_get_their_own_concurrency_and_every_consumer_room_for_it() {
        let cfg = Config::from_toml(&stage_config(32, 1000, None, 0)).unwrap();
        for stage in [Stage::Intake, Stage::Evaluate, Stage::Approval, Stage::Execute, Stage::Verify, Stage::Report] {
            assert_eq!(cfg.stage_settings(stage).concurrency, 32, "{stage:?}");
            assert_eq!(cfg.stage_settings(stage).max_ack_pending, 4000, "{stage:?}");
        }
        for stage in [Stage::Diagnose, Stage::Plan] {
            assert_eq!(cfg.stage_settings(stage).concurrency, 1000, "{stage:?}");
            assert_eq!(cfg.stage_settings(stage).max_ack_pending, 4000, "{stage:?}");
        }
        let cfg = Config::from_toml(&stage_config(64, 64, Some(20), 0)).unwrap();
        assert_eq!(cfg.stage_settings(Stage::Diagnose).concurrency, 20);
        assert_eq!(cfg.stage_settings(Stage::Plan).concurrency, 64);
        assert_eq!(cfg.stage_settings(Stage::Execute).max_ack_pending, 256);
        // Eight diagnose processes of 1000 each share one consumer: it lets them all hold theirs.
        let cfg = Config::from_toml(&stage_config(32, 1000, None, 8)).unwrap();
        assert!(cfg.stage_settings(Stage::Diagnose).max_ack_pending >= 8000);
    }

    #[tokio::test]
    async fn a_failed_publish_or_publish_task_is_an_error_and_releases_its_run() {
        let in_flight = Arc::new(tokio::sync::Semaphore::new(3));
        let ours = observe::Ours::new(in_flight.clone());
        let mut publishing = Publishing { tasks: tokio::task::JoinSet::new(), runs: HashMap::new() };
        let (sent_ok, refused, panicked) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        for (run, outcome) in [(sent_ok, 0), (refused, 1), (panicked, 2)] {
            in_flight.try_acquire().unwrap().forget();
            ours.add(run);
            publishing.spawn(run, async move {
                let at = chrono::Utc::now();
                match outcome {
                    0 => (at, Ok(run)),
                    1 => {
                        let error = "no ack".to_string();
                        (at, Err(pitcrew_runtime::bus::BusError::Publish { subject: "s".into(), error }))
                    }
                    _ => panic!("the publish task failed"),
                }
            });
        }
        let (mut sent, mut errors) = (HashMap::new(), 0);
        while let Some(done) = publishing.tasks.join_next_with_id().await {
            publishing.answered(done, &mut sent, &mut errors, &ours);
        }
        assert_eq!(errors, 2);
        assert_eq!(sent.keys().collect::<Vec<_>>(), vec![&sent_ok]);
        // The two failures gave their permits back; the sent run still holds its own.
        assert_eq!(in_flight.available_permits(), 2);
        assert!(!ours.release(refused) && !ours.release(panicked));
        assert!(ours.release(sent_ok));
        assert_eq!(in_flight.available_permits(), 3);
        assert!(publishing.runs.is_empty());
    }
}
