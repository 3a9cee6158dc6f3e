//! Running commands and health checks on target hosts: the only place pitcrew touches a
//! machine. Commands are argv (never a shell), output is capped, and every run has a deadline.

pub mod check;
pub mod local;
pub mod process;
pub mod secrets;
pub mod ssh;
pub mod sshd;
pub mod watchdog;

pub use check::{run_check, CheckOutcome, Inconclusive};
pub use local::LocalExecutor;
pub use ssh::SshExecutor;

use futures::future::BoxFuture;
use pitcrew_metrics::{Counter, Histogram, LATENCY_BUCKETS};
use std::future::Future;
use std::time::{Duration, Instant};
use tracing::Instrument;

static COMMANDS: Counter = Counter::new(
    "pitcrew_commands_total",
    "Commands run on targets, by executor and exit class (ok, failed, timed_out, error: could not run).",
    &["executor", "exit_class"],
);
static COMMAND_SECONDS: Histogram = Histogram::new(
    "pitcrew_command_duration_seconds",
    "Time a command took on its target, by executor.",
    &["executor"],
    LATENCY_BUCKETS,
);

/// Run one command inside a `command` span (its line redacted: it may carry a secret) and
/// count it by exit class.
pub(crate) async fn observed<F>(
    executor: &'static str,
    host: &str,
    command: &str,
    run: F,
) -> Result<CommandOutput, ExecError>
where
    F: Future<Output = Result<CommandOutput, ExecError>>,
{
    let span = tracing::info_span!(
        "command",
        executor,
        host,
        command = %pitcrew_model::redact::redact(command),
        exit_code = tracing::field::Empty,
        exit_class = tracing::field::Empty,
    );
    let began = Instant::now();
    let res = run.instrument(span.clone()).await;
    let class = match &res {
        Ok(o) if o.timed_out => "timed_out",
        Ok(o) if o.success() => "ok",
        Ok(_) => "failed",
        Err(_) => "error",
    };
    if let Ok(Some(code)) = res.as_ref().map(|o| o.exit_code) {
        span.record("exit_code", code);
    }
    span.record("exit_class", class);
    COMMANDS.inc(&[executor, class]);
    COMMAND_SECONDS.observe(&[executor], began.elapsed().as_secs_f64());
    res
}

/// Result of one command. Output is already capped by the executor, so it is safe to store
/// and ship; `timed_out` tells a hung command from one that failed.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandOutput {
    /// The exit code; `None` when the process was killed (by us at the deadline, or by a signal).
    pub exit_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    /// The deadline passed and the whole process group was killed.
    pub timed_out: bool,
    pub duration: Duration,
}

impl CommandOutput {
    /// The command did what it was asked: it exited 0 before its deadline.
    pub fn success(&self) -> bool {
        self.exit_code == Some(0) && !self.timed_out
    }
}

/// Why a command could not be run at all (a command that ran and failed is a
/// [`CommandOutput`], not an error). Each variant says what the caller should do.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The command text could not be parsed into argv (unbalanced quotes...): the plan is
    /// bad, do not retry.
    #[error("cannot parse command: {0}")]
    Parse(String),
    /// The command is empty: the plan is bad, do not retry.
    #[error("empty command")]
    Empty,
    /// The program does not exist or cannot be spawned: the command failed (not transient).
    #[error("cannot start '{program}': {error}")]
    Spawn { program: String, error: String },
    /// A `{secret:NAME}` in the command this worker has no value for (or one that is not a
    /// placeholder, or names the program): nothing ran; the worker's settings or the plan are
    /// wrong, do not retry.
    #[error("{0}")]
    Secret(String),
    /// The host is not known to this executor: the inventory or plan is wrong, do not retry.
    #[error("unknown host '{0}'")]
    UnknownHost(String),
    /// The host did not answer after a few tries, or refused the login (its host key is not
    /// trusted, the key is refused): nothing ran; escalate rather than retry forever.
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// Transient infrastructure error (connection lost, out of processes...): retry later.
    /// Over SSH it may come after the command reached the host (a channel that failed as it
    /// opened): whether it started is then unknown.
    #[error("transient: {0}")]
    Transient(String),
}

/// What a command's caller does just before it starts (see `Executor::run_when_ready`).
pub type BeforeStart<'a> = Box<dyn FnOnce() -> BoxFuture<'a, Result<(), String>> + Send + 'a>;

/// Runs commands on a target host. Object-safe so services hold an `Arc<dyn Executor>` and
/// tests or other transports (ssh) can be swapped in.
pub trait Executor: Send + Sync + 'static {
    /// Run one command line on `host`. The command is parsed with shell-words into argv and
    /// executed WITHOUT a shell, so no chaining, pipes or redirection can happen. Output is
    /// captured up to the executor's cap per stream; the whole process group is killed at
    /// `timeout`.
    fn run<'a>(
        &'a self,
        host: &'a str,
        command: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<CommandOutput, ExecError>>;

    /// As `run`, calling `ready` once the command has its turn on the host and a connection,
    /// just before it starts (an error from `ready` starts nothing: `ExecError::Transient`).
    fn run_when_ready<'a>(
        &'a self,
        host: &'a str,
        command: &'a str,
        timeout: Duration,
        ready: BeforeStart<'a>,
    ) -> BoxFuture<'a, Result<CommandOutput, ExecError>> {
        Box::pin(async move {
            ready().await.map_err(ExecError::Transient)?;
            self.run(host, command, timeout).await
        })
    }

    /// Whether a command on `host` starts at once after `run_when_ready` is called (no turn on
    /// the host or connection to wait for first), so that whoever records its intent just
    /// before may take that record as its start (a separate mark of the start, worth its
    /// cost only across a wait, would change nothing there), and whether a `Transient` error
    /// from it means the command never started. No unless an executor says so: this machine
    /// does.
    fn starts_at_once(&self, _host: &str) -> bool {
        false
    }

    /// Whether `tool` (a program name like "systemctl") exists on `host`, so planners only
    /// propose commands the host can run. Unknown hosts have no tools.
    fn has_tool<'a>(&'a self, host: &'a str, tool: &'a str) -> BoxFuture<'a, bool>;

    /// [`Executor::has_tool`], or None when the host could not say (its probe failed or ran
    /// out of time: a host slow or cut off for a moment), so a caller decides nothing on it.
    fn tool_answer<'a>(&'a self, host: &'a str, tool: &'a str) -> BoxFuture<'a, Option<bool>> {
        Box::pin(async move { Some(self.has_tool(host, tool).await) })
    }

    /// Whether `host` can be reached at all (an SSH host that stays silent is
    /// `ExecError::Unreachable`). This machine always can.
    fn reachable<'a>(&'a self, _host: &'a str) -> BoxFuture<'a, Result<(), ExecError>> {
        Box::pin(async { Ok(()) })
    }
}

/// The executor for a whole inventory: `local` (and localhost) on this machine, every other
/// host over SSH.
pub struct Fleet {
    pub local: LocalExecutor,
    pub ssh: SshExecutor,
}

impl Fleet {
    /// The executors for `hosts`; the secrets this worker holds are redacted from then on.
    pub fn new(hosts: std::collections::BTreeMap<String, pitcrew_model::HostSpec>, max_output: usize) -> Self {
        secrets::register_all();
        Fleet { local: LocalExecutor::new(max_output), ssh: SshExecutor::new(hosts, max_output) }
    }
}

impl Executor for Fleet {
    fn run<'a>(
        &'a self,
        host: &'a str,
        command: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<CommandOutput, ExecError>> {
        // Nothing to do before the start.
        self.run_when_ready(host, command, timeout, Box::new(|| Box::pin(async { Ok(()) })))
    }

    fn run_when_ready<'a>(
        &'a self,
        host: &'a str,
        command: &'a str,
        timeout: Duration,
        ready: BeforeStart<'a>,
    ) -> BoxFuture<'a, Result<CommandOutput, ExecError>> {
        if self.ssh.knows(host) {
            Box::pin(observed("ssh", host, command, self.ssh.run_ssh(host, command, timeout, ready)))
        } else {
            self.local.run_when_ready(host, command, timeout, ready)
        }
    }

    fn starts_at_once(&self, host: &str) -> bool {
        // Over SSH a command waits for its turn on the host and a channel, maybe a connection.
        !self.ssh.knows(host)
    }

    fn has_tool<'a>(&'a self, host: &'a str, tool: &'a str) -> BoxFuture<'a, bool> {
        if self.ssh.knows(host) {
            Box::pin(self.ssh.has_tool_ssh(host, tool))
        } else {
            self.local.has_tool(host, tool)
        }
    }

    fn tool_answer<'a>(&'a self, host: &'a str, tool: &'a str) -> BoxFuture<'a, Option<bool>> {
        if self.ssh.knows(host) {
            Box::pin(self.ssh.tool_answer_ssh(host, tool))
        } else {
            self.local.tool_answer(host, tool)
        }
    }

    fn reachable<'a>(&'a self, host: &'a str) -> BoxFuture<'a, Result<(), ExecError>> {
        if self.ssh.knows(host) {
            Box::pin(async move { self.ssh.session(host).await.map(|_| ()) })
        } else {
            self.local.reachable(host)
        }
    }
}
