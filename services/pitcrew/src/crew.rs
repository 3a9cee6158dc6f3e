//! The crew: wires config, bus, store and providers, then runs the chosen stages until the
//! shutdown future resolves. `pitcrew up`, `pitcrew worker` and `pitcrew demo` all use it.

use anyhow::Context;
use futures::future::FutureExt;
use pitcrew_approval::decisions::{sweep_expired, Decisions};
use pitcrew_approval::gate::ApprovalStage;
use pitcrew_approval::policy::Policy;
use pitcrew_exec::Fleet;
use pitcrew_llm::{OpenAi, Playbook, Reasoner};
use pitcrew_model::Stage;
use pitcrew_runtime::consume::{consume, Remake};
use pitcrew_runtime::runner::StageRunner;
use pitcrew_runtime::{Bus, BusError, Config, Deps, StageHandler, Stopping};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;

pub use pitcrew_runtime::start::{connect, connect_patiently, Shutdown};

/// The handler of one stage.
pub fn handler(stage: Stage, policy: &Policy) -> Arc<dyn StageHandler> {
    match stage {
        Stage::Intake => Arc::new(pitcrew_intake::Intake),
        Stage::Diagnose => Arc::new(pitcrew_diagnose::Diagnose::default()),
        Stage::Plan => Arc::new(pitcrew_plan::PlanStage),
        Stage::Evaluate => Arc::new(pitcrew_evaluate::EvaluateStage),
        Stage::Approval => Arc::new(ApprovalStage { policy: policy.clone() }),
        Stage::Execute => Arc::new(pitcrew_execute::Execute { policy: policy.clone() }),
        Stage::Verify => Arc::new(pitcrew_verify::Verify),
        Stage::Report => Arc::new(pitcrew_report::Report),
        Stage::Escalate => Arc::new(pitcrew_escalate::Escalate),
    }
}

/// The reasoning provider the config names; the playbook is also the openai provider's
/// fallback for unusable answers.
pub fn reasoner(cfg: &Config, playbook: Playbook) -> anyhow::Result<Arc<dyn Reasoner>> {
    Ok(match cfg.reasoning.provider.as_str() {
        "openai" => Arc::new(OpenAi::new(cfg.reasoning.openai.clone(), playbook).map_err(anyhow::Error::msg)?),
        _ => Arc::new(playbook),
    })
}

/// Load the playbook and the policy the config names.
pub fn providers(cfg: &Config) -> anyhow::Result<(Playbook, Policy)> {
    let playbook = match &cfg.reasoning.playbook_file {
        Some(p) => Playbook::with_user_file(p).with_context(|| format!("playbook {}", p.display()))?,
        None => Playbook::default_rules(),
    };
    let policy = match &cfg.policy.file {
        Some(p) => Policy::with_user_file(p).with_context(|| format!("policy {}", p.display()))?,
        None => Policy::default_policy(),
    };
    Ok((playbook, policy))
}

/// How a crew consumer is made again when the server lost it: the streams first (a
/// nats-server restarted without its store has none), then the consumer.
fn remaking<F, Fut>(bus: &Bus, make: F) -> Remake
where
    F: Fn(Bus) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<async_nats::jetstream::consumer::PullConsumer, BusError>> + Send + 'static,
{
    let bus = bus.clone();
    let make = Arc::new(make);
    Arc::new(move || {
        let (bus, make) = (bus.clone(), make.clone());
        Box::pin(async move {
            bus.ensure_streams().await.map_err(|e| e.to_string())?;
            make(bus).await.map_err(|e| e.to_string())
        })
    })
}

/// Say which stage subjects hold work no stage of this version reads: it stays on the work
/// queue until a worker that reads it runs, or a human removes it.
async fn warn_of_unread_stage_subjects(bus: &Bus) {
    match bus.unread_stage_subjects(20).await {
        Ok(unread) => {
            for (subject, messages) in unread {
                tracing::warn!(
                    subject = %subject,
                    messages,
                    stream = %bus.subjects.stages_stream(),
                    "no stage of this version reads these messages (a stage of a newer crew in a rolling upgrade, \
                     or of one rolled back): they wait for a worker that reads them, or for \
                     `nats stream purge <stream> --subject <subject>`"
                );
            }
        }
        Err(e) => tracing::debug!(error = %e, "cannot list the stages stream's subjects"),
    }
}

/// Run `stages` until `shutdown`, then drain. Returns when every consumer has stopped.
pub async fn run(cfg: Config, stages: &[Stage], shutdown: Shutdown) -> anyhow::Result<()> {
    let (playbook, policy) = providers(&cfg)?;
    let reasoner = reasoner(&cfg, playbook)?;
    let Some((bus, store)) = connect_patiently(&cfg, &shutdown).await? else { return Ok(()) };
    warn_of_unread_stage_subjects(&bus).await;
    let cfg = Arc::new(cfg);
    let deps = Arc::new(Deps {
        worker: cfg.worker(),
        config: cfg.clone(),
        store,
        reasoner,
        executor: Arc::new(fleet(&cfg)),
        policy: Arc::new(policy.clone()),
        live: Some(pitcrew_runtime::live::Live { client: bus.client.clone(), subjects: bus.subjects.clone() }),
        stopping: Stopping::default(),
    });
    {
        let (stopping, shutdown, drain) = (deps.stopping.clone(), shutdown.clone(), cfg.drain());
        tokio::spawn(async move {
            shutdown.await;
            stopping.begin(drain);
        });
    }
    let mut tasks = JoinSet::new();
    let collector = pitcrew_runtime::metrics::Collector {
        bus: bus.clone(),
        store: Some(deps.store.clone()),
        consumers: consumers_of(&bus, stages),
    };
    pitcrew_runtime::metrics::spawn_endpoint(cfg.metrics.listen.as_deref(), Some(collector), shutdown.clone()).await?;
    // Every consumer is made before any is read: one that cannot be made stops the worker
    // before a stage has taken a message the stopping process would then drop (it would wait
    // out its ack wait in no one's hands).
    let mut made = Vec::with_capacity(stages.len());
    for &stage in stages {
        let settings = cfg.stage_settings(stage);
        let consumer = bus.stage_consumer(stage, settings).await?;
        let decisions = if stage == Stage::Approval { Some(bus.decisions_consumer(settings).await?) } else { None };
        made.push((stage, settings, consumer, decisions));
    }
    for (stage, settings, consumer, decisions) in made {
        let runner = Arc::new(StageRunner { bus: bus.clone(), deps: deps.clone(), handler: handler(stage, &policy) });
        let remake = remaking(&bus, move |bus| async move { bus.stage_consumer(stage, settings).await });
        tasks.spawn(consume(
            bus.client.clone(),
            consumer,
            Some(remake),
            settings,
            runner,
            shutdown.clone(),
            cfg.drain(),
        ));
        if let Some(consumer) = decisions {
            let handler = Arc::new(Decisions { bus: bus.clone(), deps: deps.clone() });
            let remake = remaking(&bus, move |bus| async move { bus.decisions_consumer(settings).await });
            tasks.spawn(consume(
                bus.client.clone(),
                consumer,
                Some(remake),
                settings,
                handler,
                shutdown.clone(),
                cfg.drain(),
            ));
            // Sweep often enough that a request expires within about a quarter of its timeout.
            let every = Duration::from_millis(cfg.limits.approval_timeout_secs.saturating_mul(250))
                .clamp(Duration::from_millis(200), Duration::from_secs(5));
            tasks.spawn(sweep_expired(bus.clone(), deps.clone(), every, shutdown.clone()));
        }
    }
    let names: Vec<&str> = stages.iter().map(|s| s.as_str()).collect();
    let nats = pitcrew_runtime::config::redact_url(&cfg.nats.url);
    tracing::info!(stages = ?names, worker = %deps.worker, nats = %nats, "crew running");
    while tasks.join_next().await.is_some() {}
    bus.flush_before_exit().await;
    tracing::info!("crew stopped");
    Ok(())
}

/// The durable consumers `stages` read: (stream, consumer name).
pub fn consumers_of(bus: &Bus, stages: &[Stage]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for &stage in stages {
        let stream =
            if stage == Stage::Intake { bus.subjects.incidents_stream() } else { bus.subjects.stages_stream() };
        out.push((stream, stage.as_str().to_string()));
        if stage == Stage::Approval {
            out.push((bus.subjects.approvals_stream(), pitcrew_runtime::bus::DECISIONS_CONSUMER.to_string()));
        }
    }
    out
}

/// Resolves on SIGINT or SIGTERM.
pub fn signals() -> Shutdown {
    async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        let term = async move {
            match term.as_mut() {
                Some(t) => {
                    t.recv().await;
                }
                None => futures::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term => {}
        }
        tracing::info!("shutdown requested: finishing messages in hand");
    }
    .boxed()
    .shared()
}

/// The executor of the configured inventory: SSH hosts, and this machine with the variables
/// `[exec] pass_env` names passed on to its commands.
fn fleet(cfg: &Config) -> Fleet {
    let mut fleet = Fleet::new(cfg.hosts.clone(), cfg.limits.max_output_bytes);
    fleet.local = fleet.local.passing(&cfg.exec.pass_env);
    fleet
}

/// `pitcrew monitor`: check every service with a health check until `shutdown`.
pub async fn monitor(cfg: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    let executor: Arc<dyn pitcrew_exec::Executor> = Arc::new(fleet(&cfg));
    let checked = cfg.services.values().filter(|s| s.check.is_some()).count();
    if checked == 0 {
        anyhow::bail!("no service has a health check: add `check = {{ ... }}` under [services.<name>]");
    }
    let Some(bus) = pitcrew_runtime::start::connect_bus_patiently(&cfg, &shutdown).await? else { return Ok(()) };
    // Nothing to read at scrape time: the monitor's series are its own counters.
    pitcrew_runtime::metrics::spawn_endpoint(cfg.metrics.listen.as_deref(), None, shutdown.clone()).await?;
    pitcrew_monitor::run(
        bus,
        cfg.services.clone(),
        executor,
        Duration::from_millis(cfg.monitor.interval_ms.max(100)),
        Duration::from_secs(cfg.monitor.realert_secs),
        cfg.monitor.failures_before_incident,
        shutdown,
    )
    .await;
    Ok(())
}
