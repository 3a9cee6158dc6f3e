//! Reasoning providers: the `Reasoner` trait the diagnose and plan stages call, and the
//! offline, deterministic `playbook` provider that is the default and the fallback.

pub mod playbook;

pub use playbook::{Playbook, PlaybookError};

use futures::future::BoxFuture;
use pitcrew_model::{Diagnosis, Evidence, Incident, Plan};
use std::collections::BTreeMap;

/// What a reasoning provider sees. Built by the diagnose/plan stages.
///
/// Borrowed rather than owned so a stage can build one from its run state without cloning
/// evidence and memory for every call.
#[derive(Debug, Clone, Copy)]
pub struct ReasonInput<'a> {
    pub incident: &'a Incident,
    pub attempt: u32,
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
}
