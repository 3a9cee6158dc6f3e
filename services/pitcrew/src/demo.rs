//! `pitcrew demo`: with nothing configured, starts a nats-server (or uses PITCREW_NATS_URL),
//! uses Postgres from DATABASE_URL (creating the database), starts every stage and two toy
//! services, then shows three runs live: a killed service restarted, a wedged one fixed after
//! an operator's approval, and a broken one retried to the limit and escalated.

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
        let (exe, dir) = (exe.display(), self.dir.display());
        let args = format!("--port {} --dir {dir}", self.port);
        format!(
            "[services.{name}]\nhost = \"local\"\nstart = \"{exe} toy start {args}\"\nstop = \"{exe} toy stop {args}\"\n\
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

pub async fn run() -> anyhow::Result<()> {
    let started = Instant::now();
    let exe = std::env::current_exe().context("cannot find my own executable")?;
    let work = tempfile::Builder::new().prefix("pitcrew-demo-").tempdir()?;
    let nats = match std::env::var("PITCREW_NATS_URL") {
        Ok(_) => None,
        Err(_) => Some(NatsServer::start()?),
    };
    let toys = [
        Toy { name: "web", port: free_port()?, dir: work.path().join("web") },
        Toy { name: "batch", port: free_port()?, dir: work.path().join("batch") },
    ];
    let mut text = String::from(
        "[limits]\nmax_retries = 2\napproval_timeout_secs = 300\n[verify]\nchecks = 4\ninterval_ms = 250\n",
    );
    for t in &toys {
        std::fs::create_dir_all(&t.dir)?;
        text.push_str(&t.config(&exe));
    }
    let mut cfg = Config::from_toml(&text)?;
    if let Some(n) = &nats {
        cfg.nats.url = n.url();
    }
    // Environment overrides as for every command (PITCREW_NATS_URL, DATABASE_URL, ...).
    let env = Config::load(Some(Path::new("/dev/null"))).ok();
    if let Some(env) = env {
        if std::env::var("PITCREW_NATS_URL").is_ok() {
            cfg.nats.url = env.nats.url;
        }
        cfg.database = env.database;
    }
    let (nats_url, db_url) = (redact_url(&cfg.nats.url), redact_url(&cfg.database.url));
    println!("demo: nats {nats_url} · postgres {db_url}");
    for t in &toys {
        toy::start(&exe, t.port, &t.dir).with_context(|| format!("starting toy service {}", t.name))?;
        println!("demo: toy service '{}' listening on 127.0.0.1:{}", t.name, t.port);
    }

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        let _ = stop_rx.await;
    }
    .boxed()
    .shared();
    let (bus, store) = crew::connect(&cfg).await?;
    let crew_cfg = cfg.clone();
    let mut crew = tokio::spawn(async move { crew::run(crew_cfg, &pitcrew_model::Stage::ALL, shutdown).await });

    // Print every event of the demo's runs as it happens.
    let stream = bus.js.get_stream(bus.subjects.events_stream()).await?;
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject: bus.subjects.events_all(),
            deliver_policy: DeliverPolicy::New,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let (tx, mut rx) = mpsc::channel::<RunEvent>(1024);
    let labels: std::sync::Arc<std::sync::Mutex<HashMap<Uuid, char>>> = Default::default();
    let printer_labels = labels.clone();
    tokio::spawn(async move {
        while let Some(Ok(m)) = messages.next().await {
            let Ok(e) = serde_json::from_slice::<RunEvent>(&m.payload) else { continue };
            let label = printer_labels.lock().unwrap().get(&e.run_id).copied().unwrap_or('?');
            println!("  ({label}) {}", cli::format_event(&e));
            if tx.send(e).await.is_err() {
                return;
            }
        }
    });

    let session = Uuid::now_v7().simple().to_string();
    let executor = LocalExecutor::new(64 * 1024);
    let mut outcomes = Vec::new();
    let scenarios: [(char, &Toy, &str); 3] = [
        ('a', &toys[0], "the web service is killed; the crew starts it again"),
        ('b', &toys[0], "the web service wedges; the fix needs SIGKILL, so an operator approves it"),
        ('c', &toys[1], "the batch service's config is broken; no restart fixes it"),
    ];
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
        cli::open_incident(&bus, &incident).await?;
        println!("demo ({label}): incident published on {} — run {run}", bus.subjects.incidents_new());
        if label == 'b' {
            wait_for(&mut rx, &mut crew, run, |k| k == EventKind::ApprovalRequested).await?;
            println!("demo ({label}): operator 'demo-operator' approves on {}", bus.subjects.approval_decided(run));
            cli::decide(&bus, run, Decision::Approve, "demo-operator", None, "demo").await?;
        }
        let end = wait_for(&mut rx, &mut crew, run, |k| k.is_terminal()).await?;
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
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(25), crew).await;
    for t in &toys {
        let _ = std::fs::remove_file(t.dir.join("broken"));
        let _ = toy::stop(t.port, &t.dir);
    }
    drop(nats);
    let resolved = outcomes.iter().filter(|o| o.2 == "resolved").count();
    let escalated = outcomes.iter().filter(|o| o.2 == "escalated").count();
    let expected = outcomes.iter().map(|o| o.2).collect::<Vec<_>>() == ["resolved", "resolved", "escalated"];
    eprintln!("demo: finished in {:.1} s", started.elapsed().as_secs_f64());
    println!("demo: {} runs, {resolved} resolved, {escalated} escalated", outcomes.len());
    if !expected {
        bail!("unexpected outcomes: {:?}", outcomes.iter().map(|o| o.2).collect::<Vec<_>>());
    }
    Ok(())
}

/// Wait for the first event of `run` that `want` accepts.
async fn wait_for(
    rx: &mut mpsc::Receiver<RunEvent>,
    crew: &mut tokio::task::JoinHandle<anyhow::Result<()>>,
    run: Uuid,
    want: fn(EventKind) -> bool,
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
            Ok(Some(e)) if e.run_id == run && want(e.kind) => return Ok(e),
            Ok(Some(_)) => continue,
            Ok(None) => bail!("event stream ended"),
            Err(_) => bail!("run {run} did not finish within 90 s"),
        }
    }
}
