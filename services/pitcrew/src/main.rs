//! pitcrew: the one binary. Parses arguments, sets up logging, and hands over to the crew,
//! the operator commands or the demo. Errors end as one readable line, never a panic trace.

use pitcrew::cli::DecisionInput;
use pitcrew::{cli, crew, demo, top, toy};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use pitcrew_model::{Decision, Severity, Stage};
use pitcrew_runtime::{Bus, Config};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use uuid::Uuid;

/// mimalloc instead of glibc malloc: a run's state is encoded, decoded and copied at every
/// step, and glibc's malloc and free were a sixth of the crew's CPU under load (loadtest/README.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "pitcrew",
    version,
    about = "Turns alerts into fixed incidents: a crew of workers on NATS JetStream and Postgres."
)]
struct Args {
    /// Config file (default: ./pitcrew.toml when present). PITCREW_* variables override it.
    #[arg(long, short, global = true, env = "PITCREW_CONFIG")]
    config: Option<PathBuf>,
    /// Log lines as `text` (for people) or `json` (one object a line, for collectors).
    #[arg(long, global = true, env = "PITCREW_LOG_FORMAT", value_parser = ["text", "json"])]
    log_format: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run every stage in this process.
    Up,
    /// Run some stages (run the same stage in several processes to scale it).
    Worker {
        #[arg(required = true, value_name = "STAGE")]
        stages: Vec<Stage>,
    },
    /// Check every configured service and open an incident when one fails.
    Monitor,
    /// Carry approval requests to a chat and decisions back ([bridge.<kind>] in the config).
    Bridge {
        #[command(subcommand)]
        command: BridgeCommand,
    },
    /// Start everything it needs and show three runs live: resolved, approved, escalated.
    Demo {
        /// Instead: repair a killed service over SSH on a private local sshd (needs openssh-server).
        #[arg(long, conflicts_with = "llm")]
        ssh: bool,
        /// Reason with this OpenAI-compatible endpoint (e.g. http://127.0.0.1:11434/v1); the key,
        /// if any, from OPENAI_API_KEY.
        #[arg(long, value_name = "BASE_URL")]
        llm: Option<String>,
        /// The model (Azure: deployment) for --llm.
        #[arg(long, default_value = "gpt-4o-mini", requires = "llm")]
        model: String,
    },
    /// Incidents.
    Incident {
        #[command(subcommand)]
        command: IncidentCommand,
    },
    /// Print a run's events as they happen, until it ends. Exits 0 when it resolved, 3 when it
    /// escalated, 4 when the incident was a duplicate or refused, 1 on an error (no such run,
    /// no end within the timeout).
    Watch {
        run: Uuid,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
    },
    /// Approve the plan a run is waiting on.
    Approve {
        run: Uuid,
        #[arg(long)]
        by: String,
        /// The hash of the plan you read (`pitcrew approvals`, `pitcrew show`): refused if the
        /// run now waits on another plan. Without it, whatever plan the run waits on.
        #[arg(long)]
        plan: Option<String>,
        /// The attempt whose request you read (`pitcrew approvals`): refused if the run now
        /// asks again for a later one, even for the same plan.
        #[arg(long)]
        attempt: Option<u32>,
    },
    /// Deny the plan a run is waiting on (the run escalates).
    Deny {
        run: Uuid,
        #[arg(long)]
        by: String,
        #[arg(long)]
        reason: String,
        /// The hash of the plan you read: refused if the run now waits on another plan.
        #[arg(long)]
        plan: Option<String>,
        /// The attempt whose request you read: refused if the run now asks again.
        #[arg(long)]
        attempt: Option<u32>,
    },
    /// Close a run nothing moves any more (open or waiting for approval) as escalated: its
    /// fingerprint is free for the next incident, its pending approvals denied.
    Abandon {
        run: Uuid,
        #[arg(long)]
        by: String,
        #[arg(long)]
        reason: String,
    },
    /// Delete closed runs (with all that belongs to them), incidents that started none, and
    /// gateway audit lines, older than the cutoff; open and parked runs are kept however old.
    /// Nothing is deleted otherwise: run it from cron.
    Prune {
        /// Keep what is younger than this many days (at least 1).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        older_than_days: u32,
        /// Rows of each kind a batch deletes (each batch its own transaction).
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=100_000))]
        batch: i64,
    },
    /// Recent runs and their outcomes.
    Incidents {
        #[arg(long, default_value_t = 20)]
        limit: i64,
    },
    /// Pending approvals with their age and the rule that flagged them.
    Approvals {
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// A run's plan, policy decisions, approval trail and executions.
    Show { run: Uuid },
    /// A live view of the crew: each stage's consumer (pending, in flight, rates) and the
    /// most recent runs, from JetStream and Postgres.
    #[command(alias = "status")]
    Top {
        /// Print one frame (rates over one second) and exit.
        #[arg(long)]
        once: bool,
        /// Seconds between frames.
        #[arg(long, default_value_t = 1)]
        interval: u64,
    },
    /// Apply database migrations.
    Migrate,
    /// The HTTP API: Alertmanager webhook, incidents, runs, approvals, live events ([gateway]).
    Gateway {
        #[command(subcommand)]
        command: Option<GatewayCommand>,
    },
    /// The demo's toy service (used by the demo's remediation commands).
    #[command(hide = true)]
    Toy {
        #[command(subcommand)]
        command: ToyCommand,
    },
}

#[derive(Subcommand)]
enum BridgeCommand {
    /// Post each approval request to a Slack-compatible API with Approve/Deny buttons and
    /// serve the interactive callback (bot token and signing secret from the environment).
    Slack,
    /// Post each approval request to a Mattermost channel with Approve/Deny buttons and serve
    /// their action calls (bot token and action secret from the environment).
    Mattermost,
}

#[derive(Subcommand)]
enum IncidentCommand {
    /// Publish an incident on the bus and print its run id.
    Open {
        #[arg(long)]
        service: String,
        #[arg(long)]
        error: String,
        #[arg(long)]
        host: Option<String>,
        #[arg(long, value_parser = parse_severity, default_value = "warning")]
        severity: Severity,
        #[arg(long)]
        fingerprint: Option<String>,
        /// Follow the run until it ends; the exit status is then `pitcrew watch`'s.
        #[arg(long)]
        watch: bool,
    },
}

#[derive(Subcommand)]
enum GatewayCommand {
    /// Serve the API on `[gateway] listen` (the default).
    Serve,
    /// Read an API key from standard input and print the SHA-256 that
    /// `[gateway.keys.<name>] sha256` holds (the key never appears in arguments or config).
    HashKey,
    /// Make a new random API key; print it (once) and its SHA-256.
    NewKey,
}

#[derive(Subcommand)]
enum ToyCommand {
    Serve {
        #[arg(long)]
        port: u16,
        #[arg(long)]
        dir: PathBuf,
    },
    Start {
        #[arg(long)]
        port: u16,
        #[arg(long)]
        dir: PathBuf,
    },
    Stop {
        #[arg(long)]
        port: u16,
        #[arg(long)]
        dir: PathBuf,
    },
    Restart {
        #[arg(long)]
        port: u16,
        #[arg(long)]
        dir: PathBuf,
    },
    /// Hold a port without serving it.
    Squat {
        #[arg(long)]
        port: u16,
    },
    /// Append `tag` and the time to `file` (the target's own record of what ran), then
    /// create `touch`; take `hold_ms` in all, half before and half after.
    Mark {
        #[arg(long)]
        file: PathBuf,
        #[arg(long)]
        tag: String,
        #[arg(long)]
        touch: Option<PathBuf>,
        #[arg(long, default_value_t = 0)]
        hold_ms: u64,
    },
}

fn parse_severity(s: &str) -> Result<Severity, String> {
    serde_json::from_value(serde_json::Value::String(s.to_string()))
        .map_err(|_| format!("unknown severity '{s}' (info, warning, critical)"))
}

fn main() -> ExitCode {
    // Before anything else: this process may be a worker's local watchdog.
    pitcrew_exec::watchdog::serve_if_asked();
    pitcrew_exec::watchdog::use_own();
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    if let Command::Toy { command } = &args.command {
        return report(toy_command(command));
    }
    if let Some(format) = &args.log_format {
        // Read by the subscriber set-up; still one thread here.
        std::env::set_var("PITCREW_LOG_FORMAT", format);
    }
    let default_log = match args.command {
        Command::Demo { .. } => "warn",
        Command::Up | Command::Worker { .. } | Command::Monitor | Command::Bridge { .. } => "info",
        Command::Gateway { command: None | Some(GatewayCommand::Serve) } => "info",
        _ => "warn",
    };
    // The demo and the key helpers need no config; everything else reads it first, so span
    // export can be set up with the logs (and configuration errors are one line on stderr).
    let no_config = matches!(
        args.command,
        Command::Demo { .. } | Command::Gateway { command: Some(GatewayCommand::HashKey | GatewayCommand::NewKey) }
    );
    let (cfg, mut guard) = if no_config {
        pitcrew_runtime::telemetry::init(default_log);
        (None, None)
    } else {
        let cfg = match Config::load(args.config.as_deref()) {
            Ok(c) => c,
            Err(e) => return report(Err(e.into())),
        };
        match pitcrew_runtime::telemetry::init_with(default_log, &cfg.telemetry) {
            Ok(g) => (Some(cfg), Some(g)),
            Err(e) => return report(Err(e.into())),
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return report(Err(e.into())),
    };
    let res = rt.block_on(run(args, cfg));
    // Flush the spans still queued before exiting.
    if let Some(g) = guard.as_mut() {
        g.shutdown();
    }
    // Everything held is settled and flushed by now; what may still run is blocking work that
    // can wait for ever (closing an SSH master that stopped answering reads its socket with no
    // deadline), and a runtime dropped the usual way waits for it: the process would never exit.
    rt.shutdown_timeout(std::time::Duration::from_secs(5));
    report(res)
}

/// `pitcrew gateway hash-key`: the key from stdin (one line), its hex SHA-256 on stdout.
fn gateway_hash_key() -> anyhow::Result<()> {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).context("cannot read the key from standard input")?;
    let key = line.trim_end_matches(['\r', '\n']);
    if key.trim().is_empty() {
        bail!("no key on standard input: `printf %s \"$KEY\" | pitcrew gateway hash-key`");
    }
    println!("{}", pitcrew_gateway::access::hash_key(key));
    Ok(())
}

fn report(res: anyhow::Result<()>) -> ExitCode {
    match res {
        Ok(()) => ExitCode::SUCCESS,
        // Already said on stdout ("outcome: escalated").
        Err(e) if e.is::<cli::Unresolved>() => {
            ExitCode::from(e.downcast_ref::<cli::Unresolved>().map(cli::Unresolved::exit_code).unwrap_or(1))
        }
        Err(e) => {
            // An error may quote what a decider or the bus sent: each of its lines made inert.
            let text = format!("{e:#}");
            let lines: Vec<_> = text.lines().map(pitcrew_model::trim::printable).collect();
            eprintln!("error: {}", lines.join("\n"));
            ExitCode::FAILURE
        }
    }
}

fn toy_command(c: &ToyCommand) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("cannot find my own executable")?;
    match c {
        ToyCommand::Serve { port, dir } => toy::serve(*port, dir),
        ToyCommand::Start { port, dir } => toy::start(&exe, *port, dir),
        ToyCommand::Stop { port, dir } => toy::stop(*port, dir),
        ToyCommand::Restart { port, dir } => {
            toy::stop(*port, dir)?;
            toy::start(&exe, *port, dir)
        }
        ToyCommand::Squat { port } => toy::squat(*port),
        ToyCommand::Mark { file, tag, touch, hold_ms } => {
            toy::mark(file, tag, touch.as_deref(), Duration::from_millis(*hold_ms))
        }
    }
}

async fn run(args: Args, cfg: Option<Config>) -> anyhow::Result<()> {
    if let Command::Demo { ssh, llm, model } = args.command {
        let llm = llm.map(|base_url| demo::LlmDemo { base_url, model });
        return demo::run(ssh, llm).await;
    }
    match &args.command {
        Command::Gateway { command: Some(GatewayCommand::HashKey) } => return gateway_hash_key(),
        Command::Gateway { command: Some(GatewayCommand::NewKey) } => {
            let key = format!("pck_{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple());
            println!("key:    {key}\nsha256: {}", pitcrew_gateway::access::hash_key(&key));
            println!("add to pitcrew.toml: [gateway.keys.<owner>] role = \"...\", sha256 = \"<the sha256 above>\"");
            return Ok(());
        }
        _ => {}
    }
    let Some(cfg) = cfg else { bail!("no configuration loaded") };
    match args.command {
        Command::Gateway { .. } => pitcrew_gateway::run(cfg, crew::signals()).await,
        Command::Up => crew::run(cfg, &Stage::ALL, crew::signals()).await,
        Command::Monitor => crew::monitor(cfg, crew::signals()).await,
        Command::Bridge { command: BridgeCommand::Slack } => {
            pitcrew_bridge::slack::run_from_env(cfg, crew::signals()).await
        }
        Command::Bridge { command: BridgeCommand::Mattermost } => {
            pitcrew_bridge::mattermost::run_from_env(cfg, crew::signals()).await
        }
        Command::Worker { stages } => {
            let mut stages = stages;
            stages.sort();
            stages.dedup();
            crew::run(cfg, &stages, crew::signals()).await
        }
        Command::Incident { command: IncidentCommand::Open { service, error, host, severity, fingerprint, watch } } => {
            let bus = Bus::connect(&cfg).await?;
            bus.ensure_streams().await?;
            let incident = cli::incident(&service, &error, host, severity, fingerprint)?;
            let id = bus.open_incident(&incident).await?;
            println!("{id}");
            if watch {
                let end = cli::watch(&bus, None, id, Duration::from_secs(3600)).await?;
                return cli::ended(&end);
            }
            Ok(())
        }
        Command::Watch { run, timeout } => {
            let bus = Bus::connect(&cfg).await?;
            bus.ensure_streams().await?;
            let store = cli::store(&cfg).await.ok();
            let end = cli::watch(&bus, store.as_ref(), run, Duration::from_secs(timeout)).await?;
            cli::ended(&end)
        }
        Command::Approve { run, by, plan, attempt } => {
            if let Some(why) = cfg.refuse_approver(&by) {
                bail!("{why}");
            }
            let bus = Bus::connect(&cfg).await?;
            let store = cli::store(&cfg).await.ok();
            let input = DecisionInput {
                plan_hash: plan.as_deref(),
                attempt,
                ..DecisionInput::cli(run, Decision::Approve, &by, None, &cfg)
            };
            let req = cli::submit(&bus, store.as_ref(), input).await?;
            let voters = match (&store, req.quorum > 1) {
                (Some(store), true) => store.voters_with(run, &req.plan_hash, &by, &cfg.approver_names()).await.ok(),
                _ => None,
            };
            println!("{}", cli::approved(&req, &by, voters.as_deref()));
            Ok(())
        }
        Command::Deny { run, by, reason, plan, attempt } => {
            if let Some(why) = cfg.refuse_approver(&by) {
                bail!("{why}");
            }
            let bus = Bus::connect(&cfg).await?;
            let store = cli::store(&cfg).await.ok();
            let input = DecisionInput {
                plan_hash: plan.as_deref(),
                attempt,
                ..DecisionInput::cli(run, Decision::Deny, &by, Some(reason), &cfg)
            };
            let req = cli::submit(&bus, store.as_ref(), input).await?;
            println!("denied plan {} of run {run}", pitcrew_model::trim::printable(&req.plan_hash));
            Ok(())
        }
        Command::Abandon { run, by, reason } => {
            if let Some(why) = cfg.refuse_approver(&by) {
                bail!("{why}");
            }
            let bus = Bus::connect(&cfg).await?;
            let store = cli::store(&cfg).await?;
            let end = cli::abandon(&bus, &store, &cfg, run, &by, &reason).await?;
            println!("{}", end.message);
            Ok(())
        }
        Command::Prune { older_than_days, batch } => {
            // Episodic memory reads failures within its window: what an open run still reads
            // to keep from trying a command known to fail is not deleted.
            let window_days = cfg.limits.memory_window_secs.div_ceil(86_400);
            if u64::from(older_than_days) < window_days {
                anyhow::bail!(
                    "--older-than-days {older_than_days} would delete episodic memory open runs still read \
                     ([limits] memory_window_secs = {}, {window_days} days): keep at least {window_days} days",
                    cfg.limits.memory_window_secs
                );
            }
            let store = cli::store(&cfg).await?;
            cli::prune(&store, older_than_days, batch).await
        }
        Command::Incidents { limit } => cli::incidents(&cli::store(&cfg).await?, limit).await,
        Command::Approvals { limit } => cli::approvals(&cli::store(&cfg).await?, limit).await,
        Command::Show { run } => cli::show(&cli::store(&cfg).await?, run).await,
        Command::Top { once, interval } => {
            let bus = Bus::connect(&cfg).await?;
            let store = cli::store(&cfg).await.ok();
            top::run(&bus, store.as_ref(), once, Duration::from_secs(interval.max(1))).await
        }
        Command::Migrate => {
            let store = cli::store(&cfg).await?;
            let n = store.migrate().await?;
            println!("migrations: {n} applied, schema at version {}", pitcrew_runtime::store::MIGRATIONS.len());
            Ok(())
        }
        Command::Demo { .. } | Command::Toy { .. } => bail!("unreachable"),
    }
}
