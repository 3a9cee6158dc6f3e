//! Shared set-up for the end-to-end tests: a real nats-server, a fresh database, the crew
//! running in-process (or as real `pitcrew worker` processes), and event waits with timeouts.

#![allow(dead_code)]

pub mod otlp;

use futures::FutureExt;
use pitcrew::{cli, crew};
use pitcrew_model::{Incident, Severity, Stage};
use pitcrew_runtime::{Bus, Config, Store};
use pitcrew_testkit::{Events, TestEnv};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use uuid::Uuid;

pub const WAIT: Duration = Duration::from_secs(60);

/// A plan that policy marks critical (`rm`), so the run waits for a decision.
pub const LOCKED_PLAYBOOK: &str = r#"
[[rule]]
name = "locked"
match = "(?i)stale lock"
diagnosis = "{service} is held by a stale lock"
plans = [["rm -f {dir}/svc.lock", "touch {dir}/svc-healthy"]]
"#;

/// A running crew over its own environment.
pub struct Crew {
    pub env: TestEnv,
    pub cfg: Config,
    /// The config document (worker processes read it from a file).
    pub toml: String,
    pub bus: Bus,
    pub store: Store,
    pub events: Events,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

/// A service whose health is a marker file: `test -f DIR/healthy`, started by `touch`.
pub fn marker_service(env: &TestEnv, name: &str) -> String {
    let healthy = env.path(&format!("{name}-healthy"));
    format!(
        "[services.{name}]\nhost = \"local\"\nstart = \"touch {healthy}\"\nrestart = \"touch {healthy}\"\n\
         check = {{ kind = \"command\", command = \"test -f {healthy}\" }}\n"
    )
}

impl Crew {
    /// Start an environment and run `stages` in-process with the config `extra`.
    pub async fn start(extra: &str, stages: &[Stage]) -> anyhow::Result<Crew> {
        let env = TestEnv::start().await?;
        Self::start_in(env, extra, stages).await
    }

    pub async fn start_in(env: TestEnv, extra: &str, stages: &[Stage]) -> anyhow::Result<Crew> {
        // Quick verifications: the tests' fixes work (or not) at once.
        Self::start_verifying(env, extra, stages, "[verify]\nchecks = 2\ninterval_ms = 100\n").await
    }

    /// As `start_in`, with `verify` for the `[verify]` table ("": pitcrew's defaults).
    pub async fn start_verifying(env: TestEnv, extra: &str, stages: &[Stage], verify: &str) -> anyhow::Result<Crew> {
        let extra = extra.replace("{dir}", &env.dir.path().display().to_string());
        // The tests' cast of approvers; anyone else is refused.
        let toml = env.config_toml(&format!(
            "{verify}[approvers]\nann = \"approver\"\nbob = \"approver\"\n\
             carol = \"admin\"\n{extra}"
        ));
        let cfg = Config::from_toml(&toml)?;
        let (bus, store) = crew::connect(&cfg).await?;
        let events = Events::follow(&bus, false).await?;
        let mut c = Crew { env, cfg, toml, bus, store, events, stop: None, task: None };
        c.run(stages);
        Ok(c)
    }

    /// (Re)start the in-process stages.
    pub fn run(&mut self, stages: &[Stage]) {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = rx.await;
        }
        .boxed()
        .shared();
        let cfg = self.cfg.clone();
        let stages = stages.to_vec();
        self.stop = Some(tx);
        self.task = Some(tokio::spawn(async move { crew::run(cfg, &stages, shutdown).await }));
    }

    /// Stop the in-process stages and wait for them to drain.
    pub async fn shutdown(&mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(30), t).await???;
        }
        Ok(())
    }

    /// The terminal event of `run`; fails at once if the in-process crew stopped.
    pub async fn end(&mut self, run: Uuid) -> anyhow::Result<pitcrew_model::RunEvent> {
        let task = self.task.as_mut().expect("crew running");
        tokio::select! {
            e = self.events.terminal(run, WAIT) => e,
            stopped = task => Err(anyhow::anyhow!("the crew stopped: {stopped:?}")),
        }
    }

    pub async fn open(&self, service: &str, error: &str) -> anyhow::Result<Uuid> {
        self.open_with(service, error, None).await
    }

    pub async fn open_with(&self, service: &str, error: &str, fingerprint: Option<String>) -> anyhow::Result<Uuid> {
        let i: Incident = cli::incident(service, error, None, Severity::Warning, fingerprint)?;
        Ok(self.bus.open_incident(&i).await?)
    }

    /// Messages on the dead-letter stream.
    pub async fn dead_letters(&self) -> anyhow::Result<u64> {
        let mut dlq = self.bus.js.get_stream(self.bus.subjects.dlq_stream()).await?;
        Ok(dlq.info().await?.state.messages)
    }

    pub async fn db(&self) -> anyhow::Result<tokio_postgres::Client> {
        self.env.db.client().await
    }

    /// Write the config to a file for worker processes.
    pub fn config_file(&self) -> anyhow::Result<std::path::PathBuf> {
        let path = self.env.dir.path().join("pitcrew.toml");
        write_whole(&path, &self.toml)?;
        Ok(path)
    }

    /// Run the `pitcrew` binary with this crew's config; its stdout, or an error with stderr.
    pub fn cli(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new(env!("CARGO_BIN_EXE_pitcrew"))
            .arg("--config")
            .arg(self.config_file()?)
            .args(args)
            .env_remove("DATABASE_URL")
            .output()?;
        anyhow::ensure!(out.status.success(), "pitcrew {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        Ok(String::from_utf8(out.stdout)?)
    }

    /// Start `pitcrew worker <stages>` as a real process named `name`.
    pub fn spawn_worker(&self, name: &str, stages: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Worker> {
        self.spawn_worker_with(name, stages, env, "")
    }

    /// Start `pitcrew worker <stages>` whose config is the crew's plus `extra` (a table the
    /// in-process stages do not have, such as `[reasoning]`).
    pub fn spawn_worker_with(
        &self,
        name: &str,
        stages: &[&str],
        env: &[(&str, &str)],
        extra: &str,
    ) -> anyhow::Result<Worker> {
        let args: Vec<&str> = ["worker"].into_iter().chain(stages.iter().copied()).collect();
        self.spawn_process(name, &args, env, extra)
    }

    /// Start `pitcrew <args>` as a real process named `name` (its log in `<name>.log`), with
    /// the crew's config plus `extra`.
    pub fn spawn_process(
        &self,
        name: &str,
        args: &[&str],
        env: &[(&str, &str)],
        extra: &str,
    ) -> anyhow::Result<Worker> {
        let file = self.config_file()?;
        let file = if extra.is_empty() {
            file
        } else {
            let own = self.env.dir.path().join(format!("{name}.toml"));
            write_whole(&own, &format!("{}\n{extra}", self.toml))?;
            own
        };
        let log = std::fs::File::create(self.env.dir.path().join(format!("{name}.log")))?;
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pitcrew"));
        cmd.arg("--config").arg(&file).args(args);
        cmd.env("PITCREW_WORKER_NAME", name).env_remove("DATABASE_URL").env("PITCREW_LOG", "info");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log).spawn()?;
        Ok(Worker { child, log: self.env.dir.path().join(format!("{name}.log")) })
    }
}

/// Write `text` to `path` whole, never truncated in place: a process started a moment before
/// may be reading the file (rewritten by the next spawn), and a half-written config reads as
/// the defaults (the machine's own NATS and Postgres).
fn write_whole(path: &std::path::Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", Uuid::now_v7()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// A `pitcrew` process (a worker, or any other), killed on drop.
pub struct Worker {
    pub child: Child,
    pub log: std::path::PathBuf,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Shown by the test runner only when the test fails.
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        eprintln!("--- {} ---\n{}", self.log.display(), log.lines().rev().take(20).collect::<Vec<_>>().join("\n"));
    }
}

/// Wait (up to `within`) for `w` to exit; how, or fail saying `what` did not happen.
pub async fn exited(w: &mut Worker, within: Duration, what: &str) -> anyhow::Result<std::process::ExitStatus> {
    let started = Instant::now();
    loop {
        if let Some(status) = w.child.try_wait()? {
            return Ok(status);
        }
        anyhow::ensure!(started.elapsed() < within, "the worker did not exit within {within:?} {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// SIGTERM `w` and wait (up to `within`) for it to exit 0; how long it took.
pub async fn sigterm(w: &mut Worker, within: Duration) -> anyhow::Result<Duration> {
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(w.child.id() as i32, libc::SIGTERM) };
    let asked = Instant::now();
    let status = exited(w, within, "of SIGTERM").await?;
    eprintln!("worker exited {status} {:.2} s after SIGTERM", asked.elapsed().as_secs_f64());
    anyhow::ensure!(status.success(), "a stopping worker exits 0: {status}");
    Ok(asked.elapsed())
}

impl Drop for Crew {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// One value from a query.
pub async fn count(db: &tokio_postgres::Client, sql: &str, run: Uuid) -> i64 {
    db.query_one(sql, &[&run]).await.expect("query").get::<_, i64>(0)
}

/// The first column of a query's rows, as text.
pub async fn texts(db: &tokio_postgres::Client, sql: &str, run: Uuid) -> Vec<String> {
    db.query(sql, &[&run]).await.expect("query").iter().map(|r| r.get(0)).collect()
}

/// Write a file into the test's directory, `{dir}` replaced by the directory.
pub fn write(env: &TestEnv, name: &str, content: &str) -> String {
    let path = env.path(name);
    std::fs::write(&path, content.replace("{dir}", &env.dir.path().display().to_string())).expect("write test file");
    path
}

/// The Prometheus text of `url`, as (series, value) pairs; every line must parse.
pub async fn scrape(url: &str) -> anyhow::Result<Vec<(String, f64)>> {
    let text = reqwest::get(url).await?.error_for_status()?.text().await?;
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if line.starts_with("# HELP ") || line.starts_with("# TYPE ") {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').ok_or_else(|| anyhow::anyhow!("not a sample: {line}"))?;
        let name = series.split('{').next().unwrap_or_default();
        anyhow::ensure!(
            !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "bad metric name in {line}"
        );
        anyhow::ensure!(!series.contains('{') || series.ends_with('}'), "bad labels in {line}");
        out.push((series.to_string(), value.parse()?));
    }
    Ok(out)
}

pub fn sample(samples: &[(String, f64)], series: &str) -> f64 {
    samples.iter().find(|(s, _)| s == series).map(|(_, v)| *v).unwrap_or(0.0)
}

/// SIGTERM a worker and wait for it to exit (it flushes its spans on the way out).
pub fn stop(w: &mut Worker) -> anyhow::Result<()> {
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(w.child.id() as i32, libc::SIGTERM) };
    let asked = Instant::now();
    while w.child.try_wait()?.is_none() {
        anyhow::ensure!(asked.elapsed() < Duration::from_secs(30), "worker did not exit within 30 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// What a server sent before it closed `conn`; an error when it is still open after `limit`.
/// Closed with a reset counts too: either way the server let go.
pub async fn closed_within(mut conn: tokio::net::TcpStream, limit: Duration) -> anyhow::Result<String> {
    use tokio::io::AsyncReadExt;
    let mut seen = Vec::new();
    match tokio::time::timeout(limit, conn.read_to_end(&mut seen)).await {
        Err(_) => anyhow::bail!("the connection is still open after {limit:?}"),
        Ok(_) => Ok(String::from_utf8_lossy(&seen).to_string()),
    }
}

/// A crew (every stage) whose fix for `svc` needs approval, so its run stays open until the
/// test decides it, with the `[monitor]` settings `monitor`.
pub async fn crew_fixing_on_approval(monitor: &str) -> anyhow::Result<Crew> {
    crew_fixing_on_approval_of("svc", monitor).await
}

/// As [`crew_fixing_on_approval`], for a service of another name: the monitor's metrics are
/// the process's, so tests that run at once and read them keep to services of their own.
pub async fn crew_fixing_on_approval_of(service: &str, monitor: &str) -> anyhow::Result<Crew> {
    let env = TestEnv::start().await?;
    let book = write(
        &env,
        "playbook.toml",
        "[[rule]]\nname = \"down\"\nmatch = \"exited 1\"\ndiagnosis = \"{service} marker missing\"\n\
         plans = [[\"rm -f {dir}/lock\", \"{start}\"]]\n",
    );
    let text =
        format!("[reasoning]\nplaybook_file = \"{book}\"\n[monitor]\n{monitor}\n{}", marker_service(&env, service));
    Crew::start_in(env, &text, &Stage::ALL).await
}

/// After `first` (the monitor's run for `svc`) resolved and the service failed again: a run of
/// its own opens for the relapse within 20 s, and the fingerprint has those two runs.
pub async fn a_second_run_opens_for_the_relapse(crew: &mut Crew, first: Uuid) -> anyhow::Result<()> {
    a_second_run_of_opens_for_the_relapse(crew, "svc", first).await
}

/// As [`a_second_run_opens_for_the_relapse`], for `service`.
pub async fn a_second_run_of_opens_for_the_relapse(crew: &mut Crew, service: &str, first: Uuid) -> anyhow::Result<()> {
    use pitcrew_model::EventKind;
    let second = crew
        .events
        .wait_any(|e| e.kind == EventKind::ApprovalRequested && e.run_id != first, Duration::from_secs(20))
        .await
        .map_err(|e| anyhow::anyhow!("no run for the relapse: {e}"))?
        .run_id;
    let db = crew.db().await?;
    let fingerprint = format!("monitor:{service}");
    let runs: i64 = db.query_one("SELECT count(*) FROM runs WHERE fingerprint = $1", &[&fingerprint]).await?.get(0);
    anyhow::ensure!(runs == 2, "one run per outage: {first} then {second}, not {runs} runs");
    Ok(())
}

/// `pitcrew monitor` in-process over `cfg`: its stop switch and its task.
pub fn spawn_monitor(cfg: Config) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<anyhow::Result<()>>) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        let _ = stopped.await;
    }
    .boxed()
    .shared();
    (stop, tokio::spawn(crew::monitor(cfg, shutdown)))
}

/// What a stage's runner needs, from the crew's configuration, with the local executor.
pub fn deps_of(crew: &Crew) -> anyhow::Result<pitcrew_runtime::Deps> {
    let (playbook, policy) = pitcrew::crew::providers(&crew.cfg)?;
    Ok(pitcrew_runtime::Deps {
        config: std::sync::Arc::new(crew.cfg.clone()),
        store: crew.store.clone(),
        reasoner: pitcrew::crew::reasoner(&crew.cfg, playbook)?,
        executor: std::sync::Arc::new(pitcrew_exec::LocalExecutor::new(4096)),
        policy: std::sync::Arc::new(policy),
        worker: "test".into(),
        live: None,
        stopping: Default::default(),
    })
}

/// A crew running no stage; a run escalated, its state waiting on escalate's subject; that
/// stage's consumer (a 1 s ack wait: a delivery handled but never acked comes back at once)
/// and a runner of the stage, to hand its deliveries to by hand.
pub async fn at_escalate() -> anyhow::Result<(
    Crew,
    pitcrew_model::RunState,
    async_nats::jetstream::consumer::PullConsumer,
    std::sync::Arc<pitcrew_runtime::runner::StageRunner>,
)> {
    use pitcrew_runtime::store::{OpenRun, RunStatus};
    let env = TestEnv::start().await?;
    let text = marker_service(&env, "svc");
    let crew = Crew::start_in(env, &text, &[]).await?;
    let mut state = pitcrew_model::RunState::new(Uuid::now_v7(), Incident::new("svc", "down"));
    anyhow::ensure!(crew.store.open_run(&state).await? == OpenRun::Created, "the run was not opened");
    state.escalate("a human must look");
    anyhow::ensure!(crew.store.commit_transition_with(&state, RunStatus::Open, &[], vec![]).await?);
    pitcrew_runtime::runner::publish_state(&crew.bus, &state).await?;
    let settings = pitcrew_runtime::config::StageSettings {
        ack_wait: Duration::from_secs(1),
        ..crew.cfg.stage_settings(Stage::Escalate)
    };
    let consumer = crew.bus.stage_consumer(Stage::Escalate, settings).await?;
    let policy = pitcrew::crew::providers(&crew.cfg)?.1;
    let runner = std::sync::Arc::new(pitcrew_runtime::runner::StageRunner {
        bus: crew.bus.clone(),
        deps: std::sync::Arc::new(deps_of(&crew)?),
        handler: pitcrew::crew::handler(Stage::Escalate, &policy),
    });
    Ok((crew, state, consumer, runner))
}
