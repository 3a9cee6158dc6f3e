//! What stages need to know about the incident's target: its inventory entry, the template
//! variables for playbook commands, and every command already known to fail.

use crate::config::Config;
use crate::store::Memory;
use pitcrew_model::{RunState, ServiceSpec};
use std::collections::BTreeMap;

/// The inventory entry of the incident's service, or a message saying how to add it.
pub fn service<'c>(cfg: &'c Config, state: &RunState) -> Result<&'c ServiceSpec, String> {
    let name = &state.incident.service;
    cfg.services
        .get(name)
        .ok_or_else(|| format!("unknown service '{name}': add it under [services.{name}] in pitcrew.toml"))
}

/// Template variables: the service's, plus `pid` when diagnose read a pidfile this attempt.
pub fn template_vars(spec: &ServiceSpec, state: &RunState) -> BTreeMap<String, String> {
    let mut vars = spec.template_vars(&state.incident.service);
    if let Some(pid) = state
        .current_evidence()
        .filter(|e| e.source == "pidfile" && e.ok)
        .map(|e| e.output.trim())
        .find(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
    {
        vars.insert("pid".into(), pid.to_string());
    }
    vars
}

/// Commands that failed in this run plus those episodic memory remembers failing.
pub fn failed_commands(state: &RunState, memory: &Memory) -> Vec<String> {
    let mut all: Vec<String> = state.failed_commands.clone();
    for c in &memory.failed {
        if !all.contains(c) {
            all.push(c.clone());
        }
    }
    all
}
