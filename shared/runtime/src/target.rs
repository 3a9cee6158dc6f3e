//! What stages need to know about the incident's target: its inventory entry, the template
//! variables for playbook commands, and every command already known to fail.

use crate::config::Config;
use crate::stage::Deps;
use crate::store::{Memory, StoreError};
use pitcrew_llm::{ReasonInput, Target};
use pitcrew_model::{Evidence, RunState, ServiceSpec};
use std::collections::BTreeMap;
use std::time::Duration;

/// The inventory entry of the run's service, or return `Transition::Escalate` with the
/// reason from the calling stage handler.
#[macro_export]
macro_rules! service_or_escalate {
    ($cfg:expr, $state:expr) => {
        match $crate::target::service($cfg, $state) {
            Ok(spec) => spec,
            Err(why) => return Ok($crate::Transition::Escalate(why)),
        }
    };
}

/// The inventory entry of the incident's service, or a message saying how to add it.
pub fn service<'c>(cfg: &'c Config, state: &RunState) -> Result<&'c ServiceSpec, String> {
    let name = &state.incident.service;
    cfg.services
        .get(name)
        .ok_or_else(|| format!("unknown service '{name}': add it under [services.{name}] in pitcrew.toml"))
}

/// Template variables: the service's, plus `pid` when diagnose read a live pid from the
/// pidfile this attempt, and `holder_pid` when it found another process holding the
/// service's port. Both are plain numbers above 1, written canonically (`0001` is no pid: as
/// `kill -9 0001` it would be init, written so the policy's `kill ... 1` rule misses it).
pub fn template_vars(spec: &ServiceSpec, state: &RunState) -> BTreeMap<String, String> {
    let mut vars = spec.template_vars(&state.incident.service);
    if let Some(pid) = state
        .current_evidence()
        .filter(|e| e.source == "port-holder" && e.ok)
        .filter_map(|e| e.output.split_once(" is held by pid ").map(|(_, rest)| rest))
        .filter_map(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .find_map(process_id)
    {
        vars.insert("holder_pid".into(), pid);
    }
    if let Some(pid) =
        state.current_evidence().filter(|e| e.source == "pidfile" && e.ok).find_map(|e| process_id(e.output.trim()))
    {
        vars.insert("pid".into(), pid);
    }
    vars
}

/// `text` as a process id a command may name: digits only, above 1 (never init, never the
/// "every process" of 0 or -1), without leading zeros.
fn process_id(text: &str) -> Option<String> {
    if text.is_empty() || !text.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    text.parse::<u32>().ok().filter(|n| *n > 1).map(|n| n.to_string())
}

/// Commands that failed in this run plus those episodic memory remembers failing.
pub fn failed_commands(state: &RunState, memory: &Memory) -> Vec<String> {
    let mut all: Vec<String> = state.failed_commands.clone();
    pitcrew_model::run::add_once(&mut all, memory.failed.iter().cloned());
    all
}

/// Episodic memory for the run's service and error signature, within the configured window.
pub async fn memory(deps: &Deps, state: &RunState) -> Result<Memory, StoreError> {
    let window = Duration::from_secs(deps.config.limits.memory_window_secs);
    deps.store.memory(&state.incident.service, &state.incident.signature(), window).await
}

/// Everything a reasoning provider is given about a run, owned so a `ReasonInput` can borrow it.
pub struct ReasonContext {
    pub failed: Vec<String>,
    pub fixes: Vec<Vec<String>>,
    pub vars: BTreeMap<String, String>,
    pub evidence: Vec<Evidence>,
    pub rejected: Vec<String>,
    pub target: Target,
}

impl ReasonContext {
    /// Memory, template variables and this attempt's evidence for `state` on `spec`.
    pub async fn gather(deps: &Deps, state: &RunState, spec: &ServiceSpec) -> Result<Self, StoreError> {
        let memory = memory(deps, state).await?;
        Ok(Self::with_memory(deps, state, spec, memory))
    }

    /// [`ReasonContext::gather`] with memory already read.
    pub fn with_memory(deps: &Deps, state: &RunState, spec: &ServiceSpec, memory: Memory) -> Self {
        ReasonContext {
            failed: failed_commands(state, &memory),
            fixes: memory.fixes,
            vars: template_vars(spec, state),
            evidence: state.current_evidence().cloned().collect(),
            rejected: Vec::new(),
            target: target_of(&deps.config, spec),
        }
    }

    /// The provider's view, with the evaluator's feedback of this attempt.
    pub fn input<'a>(&'a self, state: &'a RunState) -> ReasonInput<'a> {
        ReasonInput {
            incident: &state.incident,
            attempt: state.attempt,
            target: &self.target,
            evidence: &self.evidence,
            vars: &self.vars,
            failed_commands: &self.failed,
            known_fixes: &self.fixes,
            feedback: &state.feedback,
            rejected_commands: &self.rejected,
            tools: None,
            usage: None,
            progress: None,
            // A run the playbook already diagnosed (the model gave no diagnosis, or could not
            // be reached) does not wait out `playbook_after_secs` again at each step.
            fallback_if_unreachable: state
                .diagnosis_log
                .iter()
                .any(|d| d.source.starts_with(pitcrew_llm::playbook::SOURCE_PREFIX)),
            playbook_at: None,
        }
    }
}

/// Record what the reasoning provider spent for this stage of the run, if it spent anything
/// (written with the step's transition).
pub fn record_usage(
    cx: &mut crate::Cx<'_>,
    state: &RunState,
    stage: pitcrew_model::Stage,
    meter: &pitcrew_llm::UsageMeter,
) {
    let usage = meter.get();
    if usage.calls == 0 {
        return;
    }
    cx.record(crate::store::Record::LlmUsage {
        run: state.run_id,
        seq: state.seq,
        stage: stage.as_str(),
        attempt: state.attempt,
        usage,
    });
}

/// What the service's host can run, from the inventory.
pub fn target_of(cfg: &Config, spec: &ServiceSpec) -> Target {
    match cfg.hosts.get(&spec.host) {
        Some(h) => Target {
            host: spec.host.clone(),
            lacks: h.lacks.clone(),
            needs_sudo: h.user != "root",
            user: h.user.clone(),
            has: h.tools.clone(),
        },
        None => Target { host: spec.host.clone(), ..Default::default() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pitcrew_model::{Incident, RunState};

    #[test]
    fn evidence_gives_pid_and_holder_pid_only_when_sound() {
        let spec: ServiceSpec = serde_json::from_value(serde_json::json!({ "host": "box" })).unwrap();
        let mut state = RunState::new(uuid::Uuid::now_v7(), Incident::new("web", "connection refused"));
        let ev = |source: &str, output: &str, ok: bool| Evidence {
            attempt: state_attempt(),
            source: source.into(),
            detail: "-".into(),
            output: output.into(),
            ok,
        };
        state.push_evidence(ev("pidfile", "123\n", true));
        state.push_evidence(ev("port-holder", "port 80 is held by pid 4242 (squat), not by the service\n...", true));
        let vars = template_vars(&spec, &state);
        assert_eq!((vars["pid"].as_str(), vars["holder_pid"].as_str()), ("123", "4242"));

        let mut state = RunState::new(uuid::Uuid::now_v7(), Incident::new("web", "x"));
        state.push_evidence(ev("pidfile", "123", false));
        state.push_evidence(ev("port-holder", "port 80 is held by pid 1 (systemd), not by the service", true));
        state.push_evidence(ev("port", "port 80 is held by pid 77 (web), the service's own process", true));
        let vars = template_vars(&spec, &state);
        assert!(!vars.contains_key("pid") && !vars.contains_key("holder_pid"), "{vars:?}");

        // Init however written is no pid; leading zeros are dropped.
        for (written, want) in [("01", None), ("0001", None), ("1", None), ("0", None), ("007", Some("7"))] {
            let mut state = RunState::new(uuid::Uuid::now_v7(), Incident::new("web", "x"));
            state.push_evidence(ev("pidfile", written, true));
            state.push_evidence(ev("port-holder", &format!("port 80 is held by pid {written} (x), not by it"), true));
            let vars = template_vars(&spec, &state);
            assert_eq!(vars.get("pid").map(String::as_str), want, "pidfile {written}");
            assert_eq!(vars.get("holder_pid").map(String::as_str), want, "holder {written}");
        }
    }

    fn state_attempt() -> u32 {
        RunState::new(uuid::Uuid::now_v7(), Incident::new("a", "b")).attempt
    }
}
