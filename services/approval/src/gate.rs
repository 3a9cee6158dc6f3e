//! The approval stage: the deterministic policy gate after every model output. Forbidden:
//! escalate. Critical: publish an approval request and park. Otherwise: auto-approved.

use crate::policy::{GateDecision, Policy};
use chrono::Utc;
use futures::future::BoxFuture;
use pitcrew_model::{ApprovalRequest, ApprovalStatus, EventKind, RunState, SecurityFlag, Stage};
use pitcrew_runtime::{Cx, StageError, StageHandler, Transition};

/// The approval stage, holding the loaded policy.
pub struct ApprovalStage {
    pub policy: Policy,
}

/// Build the request a human is asked to decide: the plan as it will run on `host`, the
/// service's own host (where execute runs it), whatever host the incident named.
pub fn request(
    state: &RunState,
    host: &str,
    rule: &str,
    reason: &str,
    timeout_secs: u64,
    quorum: u32,
) -> ApprovalRequest {
    let plan = state.plan.as_ref().expect("the gate only requests approval for a plan");
    let now = Utc::now();
    ApprovalRequest {
        run_id: state.run_id,
        service: state.incident.service.clone(),
        host: Some(host.to_string()).filter(|h| !h.is_empty()),
        error: state.incident.error.clone(),
        attempt: state.attempt,
        // Shown to approvers (chat, the CLI, the gateway) and kept 90 days on the bus: a
        // secret in a command (a service's `start` with its `--password`) is shown redacted.
        // The hash, which decisions name, is the plan's as it will run.
        plan: plan.commands.iter().map(|c| pitcrew_model::redact::redact(c).into_owned()).collect(),
        plan_hash: plan.hash(),
        risk: "critical".into(),
        // The reason quotes the command it flagged, redacted by the policy as the plan is here.
        rule: format!("{rule}: {reason}"),
        diagnosis: state
            .diagnosis()
            .map(|d| pitcrew_model::redact::redact(&d.summary).into_owned())
            .unwrap_or_default(),
        evidence: state
            .current_evidence()
            // Redacted as they were kept (`RunState::push_evidence`).
            .map(|e| format!("{}: {}", e.source, pitcrew_model::trim::clip(&e.detail, 300)))
            .take(5)
            .collect(),
        requested_at: now,
        expires_at: now + chrono::Duration::seconds(timeout_secs.min(i64::MAX as u64 / 2) as i64),
        quorum,
    }
}

impl StageHandler for ApprovalStage {
    fn stage(&self) -> Stage {
        Stage::Approval
    }

    fn handle<'a>(
        &'a self,
        state: &'a mut RunState,
        cx: &'a mut Cx<'_>,
    ) -> BoxFuture<'a, Result<Transition, StageError>> {
        Box::pin(async move {
            let Some(plan) = state.plan.clone() else {
                return Err(StageError::Poison("run state reached approval without a plan".into()));
            };
            let attempt = state.attempt;
            state.security_flags.retain(|f| f.attempt != attempt);
            // The host's own allow-lists apply too ([hosts.<name>] in the policy file): a
            // service this worker's inventory lacks (its configuration behind the others'
            // during a rollout) has no host to judge for, and escalates.
            let spec = pitcrew_runtime::service_or_escalate!(cx.config(), state);
            let host = spec.host.clone();
            // The service's own commands, as the operator wrote them, may name its secrets.
            let trusted = spec.own_commands();
            for f in self.policy.findings_on_trusting(&host, &plan.commands, &trusted) {
                state.security_flags.push(SecurityFlag { attempt, command: f.command, rule: f.rule, class: f.class });
            }
            match self.policy.gate_on_trusting(&host, &plan.commands, &trusted) {
                GateDecision::Allow => {
                    cx.emit(
                        EventKind::Policy,
                        "policy: allowed without approval",
                        serde_json::json!({ "decision": "allow" }),
                    );
                    state.approval = ApprovalStatus::AutoApproved;
                    Ok(Transition::To(Stage::Execute))
                }
                GateDecision::Reject { rule, command, reason } => {
                    cx.emit(
                        EventKind::Policy,
                        format!("policy: {reason}"),
                        serde_json::json!({ "decision": "reject", "rule": rule, "command": command }),
                    );
                    state.approval = ApprovalStatus::Rejected { rule: rule.clone() };
                    Ok(Transition::Escalate(format!("policy rejected `{command}`: {reason}")))
                }
                GateDecision::NeedsApproval { rule, command, reason } => {
                    let quorum = self.policy.quorum(&plan.commands);
                    let req = request(state, &host, &rule, &reason, cx.config().limits.approval_timeout_secs, quorum);
                    cx.emit(
                        EventKind::Policy,
                        format!("policy: {reason}"),
                        serde_json::json!({ "decision": "needs_approval", "rule": rule, "command": command }),
                    );
                    cx.emit(
                        EventKind::ApprovalRequested,
                        format!(
                            "waiting for approval of plan {} (`pitcrew approve {} --by NAME --plan {} --attempt {}`)",
                            req.plan_hash, state.run_id, req.plan_hash, req.attempt
                        ),
                        serde_json::to_value(&req).unwrap_or_default(),
                    );
                    state.approval = ApprovalStatus::Waiting { plan_hash: req.plan_hash.clone(), rule };
                    Ok(Transition::Park(Box::new(req)))
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pitcrew_model::{Diagnosis, Evidence, Incident, Plan};

    #[test]
    fn a_request_names_the_exact_plan_the_rule_and_the_deadline() {
        let mut s = RunState::new(uuid::Uuid::nil(), Incident::new("web", "wedged"));
        s.diagnosis_log.push(Diagnosis {
            attempt: 1,
            summary: "web is wedged".into(),
            source: "p".into(),
            grounds: vec![],
        });
        s.push_evidence(Evidence {
            attempt: 1,
            source: "check".into(),
            detail: "503".into(),
            output: String::new(),
            ok: false,
        });
        let plan =
            Plan { attempt: 1, commands: vec!["kill -9 42".into()], rationale: String::new(), source: String::new() };
        let hash = plan.hash();
        s.plan = Some(plan);
        s.incident.host = Some("web-2".into());
        let r = request(&s, "web-1", "kill-9", "SIGKILL loses state", 600, 1);
        assert_eq!(r.host.as_deref(), Some("web-1"), "where it runs, whatever the incident said");
        assert_eq!(r.plan, vec!["kill -9 42".to_string()]);
        assert_eq!(r.plan_hash, hash);
        assert_eq!(r.rule, "kill-9: SIGKILL loses state");
        assert_eq!(r.diagnosis, "web is wedged");
        // A secret in a command is shown redacted; the hash stays the plan's as it runs.
        let secret = vec!["/opt/web/start --password hunter2-ABC".to_string()];
        s.plan.as_mut().unwrap().commands = secret.clone();
        let r = request(&s, "web-1", "kill-9", "SIGKILL loses state", 600, 1);
        assert!(!r.plan[0].contains("hunter2-ABC") && r.plan[0].contains("[REDACTED]"), "{:?}", r.plan);
        // The rule's reason quotes the command as the policy redacted it, the cut after: a
        // long command's password is not left half there.
        let long = format!(
            "env PGPASSWORD=hunter2-ABC /opt/web/start {} --db postgres://app:VerySecret@db/app",
            "-v ".repeat(60)
        );
        let GateDecision::NeedsApproval { rule, reason, .. } = Policy::default_policy().gate(&[long]) else {
            panic!("an environment assignment needs approval")
        };
        let r = request(&s, "web-1", &rule, &reason, 600, 1);
        assert!(!r.rule.contains("hunter2") && !r.rule.contains("VerySec"), "{}", r.rule);
        assert_eq!(r.plan_hash, Plan { commands: secret, ..s.plan.clone().unwrap() }.hash());
        assert_eq!(r.evidence, vec!["check: 503".to_string()]);
        assert_eq!((r.expires_at - r.requested_at).num_seconds(), 600);
    }

    #[test]
    fn the_shipped_policy_sorts_plans_into_allow_approve_reject() {
        let p = Policy::default_policy();
        let cmds = |c: &[&str]| c.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(p.gate(&cmds(&["systemctl restart web"])), GateDecision::Allow);
        assert!(matches!(p.gate(&cmds(&["kill -9 42", "systemctl start web"])), GateDecision::NeedsApproval { .. }));
        assert!(matches!(p.gate(&cmds(&["kill -9 42", "rm -rf /"])), GateDecision::Reject { .. }));
        assert!(matches!(p.gate(&cmds(&["systemctl restart web && rm -rf /tmp/x"])), GateDecision::Reject { .. }));
    }
}
