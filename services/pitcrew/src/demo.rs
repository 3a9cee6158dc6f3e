//! `pitcrew demo`: with nothing configured, starts a nats-server (or uses PITCREW_NATS_URL),
//! uses Postgres from DATABASE_URL (creating the database), starts every stage and two toy
//! services, then shows three runs live: a killed service restarted, a wedged one fixed after
//! an operator's approval, and a broken one retried to the limit and escalated.
//!
//! `pitcrew demo --ssh` does the same over SSH: it starts a private sshd on loopback (it needs
//! /usr/sbin/sshd), logs in as you with a fresh key and a pinned host key, runs the toy web
//! service on that "remote" host, kills it, and lets the monitor and the crew bring it back
//! over SSH.

use crate::cli::DecisionInput;
use crate::{cli, crew, toy};
use anyhow::{bail, Context};
use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use futures::{FutureExt, StreamExt};
use pitcrew_exec::{run_check, LocalExecutor};
use pitcrew_model::{CheckSpec, Decision, EventKind, RunEvent};
use pitcrew_runtime::config::redact_url;
use pitcrew_runtime::natsd::{free_port, NatsServer};
use pitcrew_runtime::Config;
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use uuid::Uuid;

/// One demo service: a toy on its own port and directory.
struct Toy {
    name: &'static str,
    port: u16,
    dir: std::path::PathBuf,
}

impl Toy {
    fn config(&self, exe: &Path) -> String {
        self.config_on("local", exe)
    }

    fn command(&self, exe: &Path, verb: &str) -> String {
        format!("{} toy {verb} --port {} --dir {}", exe.display(), self.port, self.dir.display())
    }

    fn config_on(&self, host: &str, exe: &Path) -> String {
        let (exe, dir) = (exe.display(), self.dir.display());
        let args = format!("--port {} --dir {dir}", self.port);
        format!(
            "[services.{name}]\nhost = \"{host}\"\nstart = \"{exe} toy start {args}\"\nstop = \"{exe} toy stop {args}\"\n\
             restart = \"{exe} toy restart {args}\"\npidfile = \"{dir}/pid\"\nlog_file = \"{dir}/toy.log\"\n\
             check = {{ kind = \"http\", url = \"http://127.0.0.1:{port}/health\", expect_status = 200, timeout_ms = 1000 }}\n",
            name = self.name,
            port = self.port,
        )
    }

    fn check(&self) -> CheckSpec {
        CheckSpec::Http { url: format!("http://127.0.0.1:{}/health", self.port), expect_status: 200, timeout_ms: 1000 }
    }

    /// SIGKILL the toy, as a crash would.
    fn kill(&self) -> anyhow::Result<()> {
        let pid: i32 = std::fs::read_to_string(self.dir.join("pid"))?.trim().parse()?;
        // SAFETY: kill(2) with a pid read from the toy's own pidfile.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

/// The demo's own nats-server, unless PITCREW_NATS_URL names one.
fn nats() -> anyhow::Result<Option<NatsServer>> {
    match std::env::var("PITCREW_NATS_URL") {
        Ok(_) => Ok(None),
        Err(_) => Ok(Some(NatsServer::start()?)),
    }
}

/// The demo's config: `text`, its own nats-server, then the environment overrides as for
/// every command (PITCREW_NATS_URL, DATABASE_URL, ...).
fn config(text: &str, nats: &Option<NatsServer>) -> anyhow::Result<Config> {
    let mut cfg = Config::from_toml(text)?;
    if let Some(n) = nats {
        cfg.nats.url = n.url();
    }
    // A mistake in them is said, not passed over for the defaults (another database).
    let env = Config::load(Some(Path::new("/dev/null"))).context("the environment's PITCREW_* or DATABASE_URL")?;
    if std::env::var("PITCREW_NATS_URL").is_ok() {
        cfg.nats.url = env.nats.url;
    }
    cfg.database = env.database;
    if nats.is_none() {
        // A server the demo does not own may carry a crew's work under the default prefix: the
        // demo's crew would take that crew's messages, and that crew the demo's incidents
        // (about services called `web` and `batch`). Streams and consumers of its own, removed
        // when it ends.
        cfg.prefix = format!("demo_{}", &Uuid::now_v7().simple().to_string()[20..]);
        println!("demo: on a nats-server it does not own, under a prefix of its own: {}", cfg.prefix);
    }
    let (nats_url, db_url) = (redact_url(&cfg.nats.url), redact_url(&cfg.database.url));
    println!("demo: nats {nats_url} · postgres {db_url}");
    Ok(cfg)
}

/// `--llm <base-url> --model <name>`: reason with an OpenAI-compatible endpoint.
#[derive(Debug, Clone)]
pub struct LlmDemo {
    pub base_url: String,
    pub model: String,
}

impl LlmDemo {
    /// The `[reasoning]` tables; the key comes from OPENAI_API_KEY when it is set.
    fn config(&self) -> anyhow::Result<String> {
        let key =
            if std::env::var("OPENAI_API_KEY").is_ok_and(|k| !k.trim().is_empty()) { "OPENAI_API_KEY" } else { "" };
        let tables = serde_json::json!({ "reasoning": {
            "provider": "openai",
            "openai": { "base_url": self.base_url, "model": self.model, "api_key_env": key },
        }});
        Ok(toml::to_string(&tables)?)
    }
}

pub async fn run(ssh: bool, llm: Option<LlmDemo>) -> anyhow::Result<()> {
    if ssh {
        return run_ssh().await;
    }
    let started = Instant::now();
    let exe = std::env::current_exe().context("cannot find my own executable")?;
    let work = tempfile::Builder::new().prefix("pitcrew-demo-").tempdir()?;
    let nats = nats()?;
    let toys = [
        Toy { name: "web", port: free_port()?, dir: work.path().join("web") },
        Toy { name: "batch", port: free_port()?, dir: work.path().join("batch") },
    ];
    let mut text = String::from(
        "[limits]\nmax_retries = 2\napproval_timeout_secs = 300\n[verify]\nchecks = 4\ninterval_ms = 250\n\
         [approvers]\ndemo-operator = \"approver\"\n",
    );
    for t in &toys {
        std::fs::create_dir_all(&t.dir)?;
        text.push_str(&t.config(&exe));
    }
    if let Some(l) = &llm {
        text.push_str(&l.config()?);
        println!(
            "demo: reasoning with {} at {} (the playbook answers when the model's answer is unusable)",
            l.model,
            pitcrew_runtime::config::redact_url(&l.base_url)
        );
    }
    let cfg = config(&text, &nats)?;
    for t in &toys {
        toy::start(&exe, t.port, &t.dir).with_context(|| format!("starting toy service {}", t.name))?;
        println!("demo: toy service '{}' listening on 127.0.0.1:{}", t.name, t.port);
    }

    let Live { bus, store, stop_tx, mut crew, mut rx, labels, .. } = launch(&cfg, false, '?').await?;

    let session = Uuid::now_v7().simple().to_string();
    let executor = LocalExecutor::new(64 * 1024);
    let mut outcomes = Vec::new();
    let scenarios: [(char, &Toy, &str); 3] = [
        ('a', &toys[0], "the web service is killed; the crew starts it again"),
        ('b', &toys[0], "the web service wedges; the fix needs SIGKILL, so an operator approves it"),
        ('c', &toys[1], "the batch service's config is broken; no restart fixes it"),
    ];
    // Played in a block of its own: whatever it ends with, the crew stops, the toys stop and
    // the streams the demo made on a server it does not own are removed.
    let played: anyhow::Result<()> = async {
        for (label, t, story) in scenarios {
            println!("\ndemo ({label}): {story}");
            match label {
                'a' => t.kill()?,
                'b' => std::fs::write(t.dir.join("wedged"), b"")?,
                _ => {
                    std::fs::write(t.dir.join("broken"), b"")?;
                    t.kill()?;
                }
            }
            // Detect the fault as a monitor would: run the health check, report what it saw.
            let seen = run_check(&t.check(), "local", &executor).await;
            if seen.healthy {
                bail!("the toy service {} still answers after breaking it", t.name);
            }
            let mut incident = cli::incident(
                t.name,
                &seen.detail,
                None,
                pitcrew_model::Severity::Critical,
                Some(format!("demo-{session}-{label}")),
            )?;
            incident.source = Some("demo".into());
            let run = incident.id.expect("new incidents have an id");
            labels.lock().unwrap().insert(run, label);
            bus.open_incident(&incident).await?;
            println!("demo ({label}): incident published on {} — run {run}", bus.subjects.incidents_new());
            // A plan that needs approval is approved, as an operator would (a model may propose one
            // in any scenario; the playbook does in (b)).
            let mut end = wait_for(&mut rx, &mut crew, |e| {
                e.run_id == run && (e.kind == EventKind::ApprovalRequested || e.kind.is_terminal())
            })
            .await?;
            while end.kind == EventKind::ApprovalRequested {
                println!("demo ({label}): operator 'demo-operator' approves on {}", bus.subjects.approval_decided(run));
                let input = DecisionInput::cli(run, Decision::Approve, "demo-operator", None, &cfg);
                cli::submit(&bus, Some(&store), DecisionInput { channel: "demo", ..input }).await?;
                end = wait_for(&mut rx, &mut crew, |e| {
                    e.run_id == run && (e.kind == EventKind::ApprovalRequested || e.kind.is_terminal())
                })
                .await?;
            }
            outcomes.push((label, run, cli::outcome_of(&end)));
        }

        println!("\ndemo: summary (from Postgres)");
        for (label, run, _) in &outcomes {
            let stored = store.load_run(*run).await?.context("run missing from Postgres")?;
            println!(
                "  ({label}) {run}  {:<9}  attempts {}  {}",
                stored.status.as_str(),
                stored.state.attempt,
                stored.reason.as_deref().unwrap_or("")
            );
        }
        Ok(())
    }
    .await;
    let _ = stop_tx.send(());
    // Its drain, and a little more for its last pull and the hand-back past the drain.
    // Unless it ended already (a scenario that failed may have seen it end): a finished
    // handle is not awaited twice.
    if !crew.is_finished() {
        let _ = tokio::time::timeout(cfg.drain().saturating_add(Duration::from_secs(5)), crew).await;
    }
    for t in &toys {
        let _ = std::fs::remove_file(t.dir.join("broken"));
        let _ = toy::stop(t.port, &t.dir);
    }
    tidy(&bus, &nats).await;
    drop(nats);
    played?;
    let resolved = outcomes.iter().filter(|o| o.2 == "resolved").count();
    let escalated = outcomes.iter().filter(|o| o.2 == "escalated").count();
    let expected = outcomes.iter().map(|o| o.2).collect::<Vec<_>>() == ["resolved", "resolved", "escalated"];
    eprintln!("demo: finished in {:.1} s", started.elapsed().as_secs_f64());
    println!("demo: {} runs, {resolved} resolved, {escalated} escalated", outcomes.len());
    // A model may reason its way to other outcomes; the offline playbook must not.
    if !expected && llm.is_none() {
        bail!("unexpected outcomes: {:?}", outcomes.iter().map(|o| o.2).collect::<Vec<_>>());
    }
    Ok(())
}

/// On a nats-server the demo does not own, remove the streams it made there (their consumers
/// go with them).
async fn tidy(bus: &pitcrew_runtime::bus::Bus, nats: &Option<NatsServer>) {
    if nats.is_some() {
        return;
    }
    let s = &bus.subjects;
    for name in [s.incidents_stream(), s.stages_stream(), s.approvals_stream(), s.events_stream(), s.dlq_stream()] {
        if let Err(e) = bus.js.delete_stream(&name).await {
            eprintln!("demo: could not remove its stream {name}: {e}");
        }
    }
}

/// Wait for the first event that `want` accepts.
async fn wait_for(
    rx: &mut mpsc::Receiver<RunEvent>,
    crew: &mut tokio::task::JoinHandle<anyhow::Result<()>>,
    want: impl Fn(&RunEvent) -> bool,
) -> anyhow::Result<RunEvent> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let next = tokio::select! {
            e = tokio::time::timeout_at(deadline, rx.recv()) => e,
            stopped = &mut *crew => match stopped {
                Ok(Ok(())) => bail!("the crew stopped unexpectedly"),
                Ok(Err(e)) => return Err(e.context("the crew failed")),
                Err(e) => bail!("the crew panicked: {e}"),
            },
        };
        match next {
            Ok(Some(e)) if want(&e) => return Ok(e),
            Ok(Some(_)) => continue,
            Ok(None) => bail!("event stream ended"),
            Err(_) => bail!("the awaited event did not come within 90 s"),
        }
    }
}

/// The demo's crew, running in-process, and every event of its runs as it happens.
struct Live {
    bus: pitcrew_runtime::Bus,
    store: pitcrew_runtime::Store,
    stop_tx: tokio::sync::oneshot::Sender<()>,
    crew: tokio::task::JoinHandle<anyhow::Result<()>>,
    monitor: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    rx: mpsc::Receiver<RunEvent>,
    /// The demo's label for each run; events of other runs print with the default label.
    labels: std::sync::Arc<std::sync::Mutex<HashMap<Uuid, char>>>,
}

/// Start every stage (and the monitor, if asked) and print every event as it comes.
async fn launch(cfg: &Config, monitor: bool, default_label: char) -> anyhow::Result<Live> {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        let _ = stop_rx.await;
    }
    .boxed()
    .shared();
    let (bus, store) = crew::connect(cfg).await?;
    let stream = bus.js.get_stream(bus.subjects.events_stream()).await?;
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject: bus.subjects.events_all(),
            deliver_policy: DeliverPolicy::New,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let (tx, rx) = mpsc::channel::<RunEvent>(1024);
    let labels: std::sync::Arc<std::sync::Mutex<HashMap<Uuid, char>>> = Default::default();
    let printer_labels = labels.clone();
    tokio::spawn(async move {
        while let Some(Ok(m)) = messages.next().await {
            let Ok(e) = serde_json::from_slice::<RunEvent>(&m.payload) else { continue };
            let label = printer_labels.lock().unwrap().get(&e.run_id).copied().unwrap_or(default_label);
            println!("  ({label}) {}", cli::format_event(&e));
            if tx.send(e).await.is_err() {
                return;
            }
        }
    });
    let crew_cfg = cfg.clone();
    let crew_stop = shutdown.clone();
    let crew = tokio::spawn(async move { crew::run(crew_cfg, &pitcrew_model::Stage::ALL, crew_stop).await });
    let monitor = monitor.then(|| tokio::spawn(crew::monitor(cfg.clone(), shutdown)));
    Ok(Live { bus, store, stop_tx, crew, monitor, rx, labels })
}

/// `pitcrew demo --ssh`: scenario (a) of the SSH fault suite against a private local sshd.
async fn run_ssh() -> anyhow::Result<()> {
    use pitcrew_exec::sshd::{self, Sshd};
    use pitcrew_exec::{Executor, Fleet};
    let started = Instant::now();
    if !sshd::available() {
        bail!(
            "--ssh needs a local OpenSSH server at {}: install it (Debian: apt-get install openssh-server)",
            sshd::SSHD
        );
    }
    let exe = std::env::current_exe().context("cannot find my own executable")?;
    let work = tempfile::Builder::new().prefix("pitcrew-demo-").tempdir()?;
    let sshd = Sshd::start().context("starting a private sshd on loopback")?;
    let host = sshd.host(true);
    println!(
        "demo: private sshd on 127.0.0.1:{} · login {} with a fresh key · its host key pinned in {}",
        sshd.port,
        host.user,
        host.known_hosts.as_deref().unwrap_or("-")
    );
    let nats = nats()?;
    let web = Toy { name: "web", port: free_port()?, dir: work.path().join("web") };
    std::fs::create_dir_all(&web.dir)?;
    let mut box_host = host.clone();
    // The host has no service manager, like the seeds' targets: plans use the toy's own commands.
    box_host.lacks = vec!["systemctl".into()];
    let hosts = toml::to_string(&HashMap::from([("hosts", HashMap::from([("demo-box", &box_host)]))]))?;
    let text = format!(
        "[limits]\nmax_retries = 2\n[verify]\nchecks = 4\ninterval_ms = 250\n[monitor]\ninterval_ms = 500\n{hosts}\n{}",
        web.config_on("demo-box", &exe)
    );
    let cfg = config(&text, &nats)?;
    let fleet = Fleet::new(cfg.hosts.clone(), 64 * 1024);
    let start = fleet.run("demo-box", &web.command(&exe, "start"), Duration::from_secs(20)).await?;
    if !start.success() {
        bail!("starting the toy web service over SSH failed: {}", start.stderr.trim());
    }
    println!("demo: toy service 'web' started over SSH on demo-box, listening on 127.0.0.1:{}", web.port);

    let Live { bus, store, stop_tx, mut crew, monitor, mut rx, .. } = launch(&cfg, true, 'a').await?;
    println!("\ndemo (a): the web service on demo-box is killed (SIGKILL); the monitor notices, the crew repairs it over SSH");
    let broke = Instant::now();
    // Played in a block of its own, as in the local demo: whatever it ends with, the crew and
    // the toy stop and the demo's streams are removed.
    let played = async {
        web.kill()?;
        let opened = wait_for(&mut rx, &mut crew, |e| {
            e.kind == EventKind::Status && e.message.starts_with("run opened for web")
        })
        .await?;
        let run = opened.run_id;
        let end = wait_for(&mut rx, &mut crew, |e| e.run_id == run && e.kind.is_terminal()).await?;
        let took = broke.elapsed();
        println!("\ndemo: what ran on demo-box (from Postgres)");
        for (command, host, status) in store.executions(run).await? {
            println!("  {host}  {status:<9}  {command}");
        }
        anyhow::Ok((run, end, took))
    }
    .await;
    let _ = stop_tx.send(());
    // Its drain, and a little more for its last pull and the hand-back past the drain.
    // Unless it ended already (a scenario that failed may have seen it end): a finished
    // handle is not awaited twice.
    if !crew.is_finished() {
        let _ = tokio::time::timeout(cfg.drain().saturating_add(Duration::from_secs(5)), crew).await;
    }
    if let Some(m) = monitor {
        let _ = tokio::time::timeout(Duration::from_secs(5), m).await;
    }
    let _ = fleet.run("demo-box", &web.command(&exe, "stop"), Duration::from_secs(20)).await;
    tidy(&bus, &nats).await;
    drop(nats);
    let (run, end, took) = played?;
    let outcome = cli::outcome_of(&end);
    eprintln!("demo: finished in {:.1} s", started.elapsed().as_secs_f64());
    println!("demo: run {run} {outcome} {:.2} s after the fault, over SSH as {}", took.as_secs_f64(), host.user);
    if outcome != "resolved" {
        bail!("the run ended {outcome}: {}", end.message);
    }
    Ok(())
}
