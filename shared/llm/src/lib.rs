//! Reasoning providers: the `Reasoner` trait the diagnose and plan stages call, the
//! offline, deterministic `playbook` provider that is the default and the fallback, and the
//! `openai` provider for any OpenAI-compatible chat-completions endpoint.

pub mod openai;
pub mod parse;
pub mod playbook;

pub use openai::{OpenAi, OpenAiConfig, Usage, UsageMeter};

pub use playbook::{Playbook, PlaybookError};

use futures::future::BoxFuture;
use pitcrew_model::{Diagnosis, Evidence, Incident, Plan};
use std::collections::BTreeMap;

/// What the target host can run: plans are fitted to it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Target {
    /// Inventory name of the host (`local` for this machine).
    pub host: String,
    /// Programs the host does not have: no plan may use them.
    pub lacks: Vec<String>,
    /// The login user is not root: administrative programs run under `sudo`.
    pub needs_sudo: bool,
    /// The login user's name (empty: this machine's own user).
    pub user: String,
    /// Programs the inventory says the host has.
    pub has: Vec<String>,
}

/// Programs that administer the system and so need root.
pub const ADMIN_PROGRAMS: &[&str] = &[
    "systemctl",
    "service",
    "kill",
    "pkill",
    "chmod",
    "chown",
    "chgrp",
    "killall",
    "apt",
    "apt-get",
    "yum",
    "dnf",
    "journalctl",
    "ip",
    "iptables",
    "nft",
    "sysctl",
    "mount",
    "umount",
    "logrotate",
    "vtysh",
];

/// Fit one rendered command to the target: refuse programs the host lacks, add `sudo` for
/// administrative programs when the login user is not root (the seeds' ensure_sudo), and
/// make package managers non-interactive (`-y`).
pub fn fit_to_target(command: &str, target: &Target) -> Result<String, String> {
    let mut argv = shell_words::split(command).map_err(|e| format!("'{command}' does not parse: {e}"))?;
    // The program past `sudo` (or `doas`) and its options' values (`sudo -u postgres pg_ctl`),
    // as the policy gate reads it.
    let found = pitcrew_policy::program_in(&argv).ok_or_else(|| format!("'{command}' names no program"))?;
    let (at, has_sudo) = (found.index, found.elevated);
    let program = found.path.rsplit('/').next().unwrap_or(&found.path).to_string();
    if target.lacks.contains(&program) {
        return Err(format!("needs {program}, which {} lacks", target.host));
    }
    // The command's own text is kept unless something must be added (argv stays the same).
    let mut out = command.to_string();
    if ["apt", "apt-get", "yum", "dnf"].contains(&program.as_str())
        && argv
            .get(at + 1)
            .is_some_and(|sub| ["install", "remove", "purge", "upgrade", "autoremove"].contains(&sub.as_str()))
        && !argv.iter().any(|a| a == "-y" || a == "--yes" || a == "--assumeyes")
    {
        argv.insert(at + 2, "-y".into());
        out = shell_words::join(&argv);
    }
    if target.needs_sudo && !has_sudo && ADMIN_PROGRAMS.contains(&program.as_str()) {
        out = format!("sudo {out}");
    }
    Ok(out)
}

/// What a reasoning provider sees. Built by the diagnose/plan stages.
///
/// Borrowed rather than owned so a stage can build one from its run state without cloning
/// evidence and memory for every call.
#[derive(Debug, Clone, Copy)]
pub struct ReasonInput<'a> {
    pub incident: &'a Incident,
    pub attempt: u32,
    /// The host the plan will run on.
    pub target: &'a Target,
    /// Evidence of the current attempt.
    pub evidence: &'a [Evidence],
    /// Template variables for the target service (`ServiceSpec::template_vars` + evidence
    /// vars such as `pid`).
    pub vars: &'a BTreeMap<String, String>,
    /// Commands that already failed for this error (this run + episodic memory): NEVER
    /// propose any of them again.
    pub failed_commands: &'a [String],
    /// Commands of plans that worked before for this error (episodic memory), most recent
    /// first: prefer them.
    pub known_fixes: &'a [Vec<String>],
    /// Evaluator feedback for this attempt (the previous plan was rejected for these reasons).
    pub feedback: &'a [String],
    /// Commands the evaluator rejected in this attempt: do not propose again in this attempt.
    pub rejected_commands: &'a [String],
    /// Read-only tools a model may call while diagnosing (None: evidence only).
    pub tools: Option<&'a dyn Tools>,
    /// Where a provider counts the calls and tokens it spends (None: not counted).
    pub usage: Option<&'a UsageMeter>,
    /// Where a provider streams the model's answer as it comes (None: not streamed).
    pub progress: Option<&'a dyn Progress>,
    /// The step has waited on an unreachable provider long enough: a provider that cannot be
    /// reached now answers from its offline fallback (the playbook) instead of failing as
    /// `Transient`.
    pub fallback_if_unreachable: bool,
    /// When the step will have waited on the model long enough (`[reasoning]
    /// playbook_after_secs` from the step's hand-over, at least a minute a delivery): a
    /// provider still at work then (a slow model, a long tool loop, retries) answers from its
    /// offline fallback instead, and a judge it asks is not consulted. None: no limit.
    pub playbook_at: Option<std::time::Instant>,
}

impl<'a> ReasonInput<'a> {
    /// Attempt 1 of `incident` on `target` with `vars`: no evidence, memory, feedback, tools
    /// or meters (fill in what a caller has).
    pub fn new(incident: &'a Incident, target: &'a Target, vars: &'a BTreeMap<String, String>) -> Self {
        ReasonInput {
            incident,
            attempt: 1,
            target,
            evidence: &[],
            vars,
            failed_commands: &[],
            known_fixes: &[],
            feedback: &[],
            rejected_commands: &[],
            tools: None,
            usage: None,
            progress: None,
            fallback_if_unreachable: false,
            playbook_at: None,
        }
    }
}

/// Receives a model's answer while it streams in. Must not block.
pub trait Progress: Send + Sync {
    fn text(&self, chunk: &str);
}

impl std::fmt::Debug for dyn Progress + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress")
    }
}

/// A tool a model may call: its name, what it does, and its JSON Schema parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    pub parameters: serde_json::Value,
}

/// What a tool call returned: the full output (kept in the timeline) and whether it worked.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutput {
    pub ok: bool,
    pub output: String,
}

/// Read-only tools for a model's diagnosis, provided by the diagnose stage (it runs them
/// through the policy's read-only class and the executor, and keeps every result).
pub trait Tools: Send + Sync {
    fn specs(&self) -> Vec<ToolSpec>;
    /// Run `name` with the model's JSON `arguments`; a bad call is an output saying why.
    fn call<'a>(&'a self, name: &'a str, arguments: &'a str) -> BoxFuture<'a, ToolOutput>;
}

impl std::fmt::Debug for dyn Tools + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.specs().into_iter().map(|s| s.name).collect();
        write!(f, "Tools{names:?}")
    }
}

/// Why a provider gave no answer; each variant says what the run should do next.
#[derive(Debug, thiserror::Error)]
pub enum ReasonError {
    /// Nothing left to propose (every candidate already failed) — the run should escalate
    /// with this reason.
    #[error("no untried remediation left: {0}")]
    Exhausted(String),
    /// Provider temporarily unavailable (rate limit, network) — retry later.
    #[error("reasoning provider unavailable: {0}")]
    Transient(String),
    /// Provider misconfigured / bad output — escalate.
    #[error("reasoning failed: {0}")]
    Failed(String),
}

/// A reasoning provider: diagnose and plan. Object-safe (`Arc<dyn Reasoner>`), so stages
/// pick the provider from configuration at start-up.
pub trait Reasoner: Send + Sync + 'static {
    /// Short provider name for events and metrics (`playbook`, `openai`).
    fn name(&self) -> &str;

    /// Decide what is wrong from the incident and the evidence of this attempt.
    fn diagnose<'a>(&'a self, input: &'a ReasonInput<'a>) -> BoxFuture<'a, Result<Diagnosis, ReasonError>>;

    /// Propose 1-3 commands that remedy `diagnosis`, never one that already failed.
    fn plan<'a>(
        &'a self,
        input: &'a ReasonInput<'a>,
        diagnosis: &'a Diagnosis,
    ) -> BoxFuture<'a, Result<Plan, ReasonError>>;

    /// An independent review of a diagnosis and plan (evaluate's optional judge). None: this
    /// provider cannot judge.
    fn judge<'a>(
        &'a self,
        _input: &'a ReasonInput<'a>,
        _diagnosis: &'a Diagnosis,
        _plan: &'a Plan,
    ) -> BoxFuture<'a, Result<Option<Judgement>, ReasonError>> {
        Box::pin(async { Ok(None) })
    }
}

/// A judge's verdict on a diagnosis and plan: a score in [0, 1] and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Judgement {
    pub score: f64,
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sentinel() -> Target {
        Target {
            host: "pe1".into(),
            lacks: vec!["systemctl".into(), "lsof".into(), "fuser".into()],
            needs_sudo: true,
            ..Default::default()
        }
    }

    #[test]
    fn plans_fit_the_target() {
        let t = sentinel();
        assert_eq!(fit_to_target("kill -9 42", &t).unwrap(), "sudo kill -9 42");
        assert_eq!(fit_to_target("sudo kill -9 42", &t).unwrap(), "sudo kill -9 42");
        assert_eq!(fit_to_target("apt-get install nginx", &t).unwrap(), "sudo apt-get install -y nginx");
        assert_eq!(fit_to_target("/opt/web/bin/start --port 8080", &t).unwrap(), "/opt/web/bin/start --port 8080");
        assert!(fit_to_target("systemctl restart web", &t).unwrap_err().contains("pe1 lacks"));
        assert!(fit_to_target("sudo -n /bin/systemctl restart web", &t).unwrap_err().contains("systemctl"));
        // An option's value is not the program: `sudo -u fuser` runs `systemctl`, which pe1 lacks.
        // The program's own place, not a word like it before it; doas elevates as sudo does.
        assert_eq!(fit_to_target("sudo -u apt apt install x", &t).unwrap(), "sudo -u apt apt install -y x");
        assert_eq!(fit_to_target("doas kill -9 42", &t).unwrap(), "doas kill -9 42");
        let err = fit_to_target("sudo -u fuser systemctl restart web", &t).unwrap_err();
        assert!(err.contains("needs systemctl"), "{err}");
        assert_eq!(fit_to_target("sudo -u postgres pg_ctl restart", &t).unwrap(), "sudo -u postgres pg_ctl restart");
        assert_eq!(
            fit_to_target("sudo -u root apt-get install nginx", &t).unwrap(),
            "sudo -u root apt-get install -y nginx"
        );
        let root = Target { host: "local".into(), ..Default::default() };
        assert_eq!(fit_to_target("systemctl restart web", &root).unwrap(), "systemctl restart web");
        assert_eq!(fit_to_target("echo 'a b'", &root).unwrap(), "echo 'a b'");
    }
}
