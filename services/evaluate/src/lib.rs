//! evaluate: scores the diagnosis and plan with deterministic checks — grounded in observed
//! evidence, parseable, 1-3 commands, within the host's tools, no repeated failure — and
//! decides PASS (>= 0.7), REGENERATE (with feedback, bounded) or BLOCK (< 0.3, escalate).

use futures::future::BoxFuture;
use pitcrew_exec::ExecError;
use pitcrew_model::{Evaluation, EvaluationCheck, EventKind, RunState, Stage, Verdict};
use pitcrew_runtime::{target, Cx, StageError, StageHandler, Transition};
use std::collections::BTreeMap;

pub const PASS: f64 = 0.7;
pub const BLOCK: f64 = 0.3;

/// The evaluate stage.
pub struct EvaluateStage;

/// The program a command runs (after `sudo` and its flags), if it parses.
pub fn program(command: &str) -> Option<String> {
    let words = shell_words::split(command).ok()?;
    let mut it = words.into_iter().peekable();
    if it.peek().map(String::as_str) == Some("sudo") {
        it.next();
        while it.peek().is_some_and(|w| w.starts_with('-')) {
            it.next();
        }
    }
    it.next()
}

fn check(name: &str, weight: f64, passed: bool, detail: String) -> EvaluationCheck {
    EvaluationCheck { name: name.into(), passed, weight, detail }
}

/// Score the current diagnosis and plan. `tools` says which programs exist on the host;
/// `failed` lists commands known to fail for this error. Pure: no I/O.
pub fn assess(state: &RunState, failed: &[String], tools: &BTreeMap<String, bool>, max_attempts: u32) -> Evaluation {
    let commands: Vec<String> = state.plan.as_ref().map(|p| p.commands.clone()).unwrap_or_default();
    let mut checks = Vec::new();

    // Grounded: every ground the diagnosis cites was observed in this run.
    let observed: Vec<String> = std::iter::once(state.incident.error.to_lowercase())
        .chain(state.current_evidence().flat_map(|e| [e.detail.to_lowercase(), e.output.to_lowercase()]))
        .collect();
    let (grounded, detail) = match state.diagnosis() {
        None => (false, "no diagnosis for this attempt".to_string()),
        Some(d) if d.grounds.is_empty() => (false, "the diagnosis cites no observed evidence".to_string()),
        Some(d) => match d.grounds.iter().find(|g| {
            let g = g.to_lowercase();
            let g = g.trim_end_matches('…');
            !observed.iter().any(|o| o.contains(g))
        }) {
            Some(g) => (false, format!("claim not backed by anything observed in this run: '{g}'")),
            None => (true, format!("{} ground(s) found in observed evidence", d.grounds.len())),
        },
    };
    checks.push(check("grounded", 0.25, grounded, detail));

    let count_ok = (1..=3).contains(&commands.len());
    checks.push(check("count", 0.15, count_ok, format!("{} command(s); 1-3 required", commands.len())));

    let unparseable: Vec<&String> = commands.iter().filter(|c| program(c).is_none()).collect();
    checks.push(check(
        "parseable",
        0.2,
        unparseable.is_empty() && !commands.is_empty(),
        if unparseable.is_empty() { "every command parses".into() } else { format!("cannot parse: {unparseable:?}") },
    ));

    let missing: Vec<String> =
        commands.iter().filter_map(|c| program(c)).filter(|p| !tools.get(p).copied().unwrap_or(false)).collect();
    checks.push(check(
        "tools",
        0.2,
        missing.is_empty(),
        if missing.is_empty() {
            "every program exists on the host".into()
        } else {
            format!("not on the host: {}", missing.join(", "))
        },
    ));

    let repeated: Vec<&String> = commands.iter().filter(|c| failed.contains(c)).collect();
    checks.push(check(
        "not_repeated",
        0.2,
        repeated.is_empty(),
        if repeated.is_empty() {
            "no command already failed for this error".into()
        } else {
            format!("already failed for this error: {repeated:?}")
        },
    ));

    let mut score: f64 = checks.iter().filter(|c| c.passed).map(|c| c.weight).sum();
    // A plan that cannot run as written, or repeats a failure, never passes on points.
    let critical_failed = checks.iter().any(|c| !c.passed && c.name != "grounded");
    if critical_failed {
        score *= 0.5;
    }
    let score = (score * 1000.0).round() / 1000.0;
    let problems: Vec<String> =
        checks.iter().filter(|c| !c.passed).map(|c| format!("{}: {}", c.name, c.detail)).collect();
    let feedback = (!problems.is_empty()).then(|| problems.join("; "));
    let verdict = if score >= PASS && !critical_failed {
        Verdict::Pass
    } else if score < BLOCK || state.regeneration + 1 >= max_attempts {
        Verdict::Block
    } else {
        Verdict::Regenerate
    };
    Evaluation { attempt: state.attempt, regeneration: state.regeneration, score, verdict, checks, feedback }
}

impl StageHandler for EvaluateStage {
    fn stage(&self) -> Stage {
        Stage::Evaluate
    }

    fn handle<'a>(
        &'a self,
        state: &'a mut RunState,
        cx: &'a mut Cx<'_>,
    ) -> BoxFuture<'a, Result<Transition, StageError>> {
        Box::pin(async move {
            let cfg = cx.deps.config.clone();
            let spec = pitcrew_runtime::service_or_escalate!(&cfg, state);
            if state.plan.is_none() {
                return Err(StageError::Poison("run state reached evaluate without a plan".into()));
            }
            let memory = target::memory(cx.deps, state).await?;
            let failed = target::failed_commands(state, &memory);
            if let Err(ExecError::Unreachable(e)) = cx.deps.executor.reachable(&spec.host).await {
                return Ok(Transition::Escalate(format!("host {} unreachable: {e}", spec.host)));
            }
            let mut tools = BTreeMap::new();
            for c in state.plan.iter().flat_map(|p| p.commands.iter()) {
                if let Some(p) = program(c) {
                    let present = cx.deps.executor.has_tool(&spec.host, &p).await;
                    tools.insert(p, present);
                }
            }
            let ev = assess(state, &failed, &tools, cfg.limits.max_attempts);
            cx.deps.store.record_evaluation(state.run_id, &ev).await?;
            cx.emit(
                EventKind::Evaluation,
                format!(
                    "{} (score {:.2}){}",
                    ev.verdict.as_str().to_uppercase(),
                    ev.score,
                    ev.feedback.as_ref().map(|f| format!(": {f}")).unwrap_or_default()
                ),
                serde_json::to_value(&ev).unwrap_or_default(),
            );
            let verdict = ev.verdict;
            let feedback = ev.feedback.clone();
            let score = ev.score;
            state.evaluation = Some(ev);
            Ok(match verdict {
                Verdict::Pass => Transition::To(Stage::Approval),
                Verdict::Regenerate => {
                    state.regeneration += 1;
                    state.feedback.push(feedback.unwrap_or_default());
                    Transition::To(Stage::Plan)
                }
                Verdict::Block => Transition::Escalate(format!(
                    "evaluation blocked the plan (score {score:.2}, regeneration {} of {}): {}",
                    state.regeneration + 1,
                    cfg.limits.max_attempts,
                    feedback.unwrap_or_default()
                )),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pitcrew_model::{Diagnosis, Evidence, Incident, Plan};

    fn state(grounds: &[&str], commands: &[&str]) -> RunState {
        let mut s = RunState::new(uuid::Uuid::nil(), Incident::new("web", "GET /health: connection refused"));
        s.push_evidence(Evidence {
            attempt: 1,
            source: "check".into(),
            detail: "port 80 closed".into(),
            output: String::new(),
            ok: false,
        });
        s.diagnosis_log.push(Diagnosis {
            attempt: 1,
            summary: "down".into(),
            source: "playbook:x".into(),
            grounds: grounds.iter().map(|g| g.to_string()).collect(),
        });
        s.plan = Some(Plan {
            attempt: 1,
            commands: commands.iter().map(|c| c.to_string()).collect(),
            rationale: String::new(),
            source: String::new(),
        });
        s
    }

    fn tools(present: &[&str]) -> BTreeMap<String, bool> {
        ["systemctl", "touch", "kill", "nosuchtool"].iter().map(|t| (t.to_string(), present.contains(t))).collect()
    }

    #[test]
    fn a_grounded_runnable_plan_passes() {
        let s = state(&["connection refused", "Port 80 closed"], &["systemctl restart web"]);
        let ev = assess(&s, &[], &tools(&["systemctl"]), 3);
        assert_eq!(ev.verdict, Verdict::Pass, "{ev:?}");
        assert_eq!(ev.score, 1.0);
        assert!(ev.feedback.is_none());
    }

    #[test]
    fn a_repeated_failure_is_sent_back_with_feedback() {
        let s = state(&["connection refused"], &["systemctl restart web"]);
        let ev = assess(&s, &["systemctl restart web".into()], &tools(&["systemctl"]), 3);
        assert_eq!(ev.verdict, Verdict::Regenerate);
        assert!(ev.feedback.unwrap().contains("already failed"));
    }

    #[test]
    fn regeneration_is_bounded_then_blocks() {
        let mut s = state(&["connection refused"], &["nosuchtool --fix"]);
        s.regeneration = 2;
        let ev = assess(&s, &[], &tools(&[]), 3);
        assert_eq!(ev.verdict, Verdict::Block);
    }

    #[test]
    fn ungrounded_claims_and_bad_plans_score_low() {
        let s = state(&["disk is full"], &["echo 'unterminated", "a", "b", "c"]);
        let ev = assess(&s, &[], &tools(&[]), 3);
        assert!(ev.score < BLOCK, "{ev:?}");
        assert_eq!(ev.verdict, Verdict::Block);
        let grounded = ev.checks.iter().find(|c| c.name == "grounded").unwrap();
        assert!(!grounded.passed && grounded.detail.contains("disk is full"));
    }

    #[test]
    fn an_ungrounded_but_runnable_plan_still_passes_on_points() {
        let s = state(&["something never seen"], &["systemctl restart web"]);
        let ev = assess(&s, &[], &tools(&["systemctl"]), 3);
        assert_eq!(ev.score, 0.75);
        assert_eq!(ev.verdict, Verdict::Pass);
    }

    #[test]
    fn program_skips_sudo_and_its_flags() {
        assert_eq!(program("sudo -n systemctl restart x").as_deref(), Some("systemctl"));
        assert_eq!(program("'unterminated"), None);
        assert_eq!(program(""), None);
    }
}
