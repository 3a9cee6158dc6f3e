//! report: the run is resolved. Closes it and says what fixed it.

use futures::future::BoxFuture;
use pitcrew_model::{ApprovalStatus, EventKind, ExecutionStatus, Outcome, RunState, Stage};
use pitcrew_runtime::{Cx, StageError, StageHandler, Transition};

/// The report stage (terminal).
pub struct Report;

/// One line that says what happened: the commands this attempt ran (how each that did not
/// succeed ended, and those it skipped), not the plan as proposed.
pub fn summary(state: &RunState) -> String {
    let records: Vec<_> = state.current_executions().collect();
    let plan = if records.is_empty() {
        state.plan.as_ref().map(|p| format!("`{}`", p.commands.join(" ; "))).unwrap_or_else(|| "nothing".into())
    } else {
        let mut ran = Vec::new();
        let mut skipped = Vec::new();
        for e in &records {
            match e.status {
                ExecutionStatus::Succeeded => ran.push(e.command.clone()),
                ExecutionStatus::Skipped => skipped.push(e.command.as_str()),
                ExecutionStatus::Failed => ran.push(match e.exit_code {
                    Some(code) => format!("{} (failed, exit {code})", e.command),
                    None => format!("{} (failed)", e.command),
                }),
                ExecutionStatus::TimedOut => ran.push(format!("{} (timed out)", e.command)),
                ExecutionStatus::Interrupted => ran.push(format!("{} (interrupted)", e.command)),
            }
        }
        if skipped.is_empty() {
            format!("`{}`", ran.join(" ; "))
        } else if ran.is_empty() {
            // Nothing of the plan ran (another run fixed the service first): say why.
            let why = records.first().map(|e| e.output.as_str());
            format!("nothing ({})", why.unwrap_or_default().trim_start_matches("not run: "))
        } else {
            format!("`{}`, skipped `{}`", ran.join(" ; "), skipped.join(" ; "))
        }
    };
    let check = state.verification.as_ref().map(|v| v.detail.as_str()).unwrap_or("-");
    // Who let it run, and the policy rule that asked them.
    let approval = match &state.approval {
        ApprovalStatus::Approved { by, .. } => {
            let rules = policy_rules(state);
            let why = if rules.is_empty() { String::new() } else { format!(" (policy rule {})", rules.join(", ")) };
            format!(" approved by {by}{why};")
        }
        _ => String::new(),
    };
    format!("resolved {} after {} attempt(s): ran {plan};{approval} {check}", state.incident.service, state.attempt)
}

/// The policy rules that flagged this attempt's plan.
fn policy_rules(state: &RunState) -> Vec<String> {
    // Each rule once, in the order it first flagged (a rule flagging two commands with
    // another's between them is still one rule).
    let mut rules: Vec<String> = Vec::new();
    for f in state.security_flags.iter().filter(|f| f.attempt == state.attempt) {
        if !rules.contains(&f.rule) {
            rules.push(f.rule.clone());
        }
    }
    rules
}

/// Why this state may not resolve its run: only a verification of its attempt that saw the
/// service recovered closes it (a state that reached report otherwise, by a bug of a stage or
/// a message nobody's stage sent, goes to a human).
pub fn unverified(state: &RunState) -> Option<String> {
    match &state.verification {
        Some(v) if v.recovered && v.attempt == state.attempt => None,
        Some(v) if v.attempt == state.attempt => {
            Some(format!("reached report though attempt {} did not recover: {}", state.attempt, v.detail))
        }
        _ => Some(format!("reached report without a verification of attempt {}", state.attempt)),
    }
}

impl StageHandler for Report {
    fn stage(&self) -> Stage {
        Stage::Report
    }

    fn handle<'a>(
        &'a self,
        state: &'a mut RunState,
        cx: &'a mut Cx<'_>,
    ) -> BoxFuture<'a, Result<Transition, StageError>> {
        Box::pin(async move {
            if let Some(why) = unverified(state) {
                return Ok(Transition::Escalate(why));
            }
            let elapsed = (chrono::Utc::now() - state.started_at).num_milliseconds();
            cx.emit(
                EventKind::Resolved,
                summary(state),
                serde_json::json!({
                    "attempts": state.attempt,
                    "diagnosis": state.diagnosis().map(|d| d.summary.clone()),
                    "commands": state.ran_commands().collect::<Vec<_>>(),
                    "approval": state.approval,
                    "policy_rules": policy_rules(state),
                    "elapsed_ms": elapsed,
                }),
            );
            Ok(Transition::Done(Outcome::Resolved))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pitcrew_model::{Incident, Plan, Verification};

    #[test]
    fn the_summary_says_what_fixed_it() {
        let mut s = RunState::new(uuid::Uuid::nil(), Incident::new("web", "down"));
        s.attempt = 2;
        s.plan = Some(Plan {
            attempt: 2,
            commands: vec!["a".into(), "b".into()],
            rationale: String::new(),
            source: String::new(),
        });
        s.verification = Some(Verification { attempt: 2, recovered: true, detail: "GET / -> 200".into() });
        assert_eq!(summary(&s), "resolved web after 2 attempt(s): ran `a ; b`; GET / -> 200");
        s.approval = ApprovalStatus::Approved { by: "ann".into(), plan_hash: "h".into() };
        s.security_flags.push(pitcrew_model::SecurityFlag {
            attempt: 2,
            command: "a".into(),
            rule: "kill-9".into(),
            class: "critical".into(),
        });
        assert_eq!(
            summary(&s),
            "resolved web after 2 attempt(s): ran `a ; b`; approved by ann (policy rule kill-9); GET / -> 200"
        );
        // A rule that flagged two commands with another rule's between them is named once.
        let flag = |command: &str, rule: &str| pitcrew_model::SecurityFlag {
            attempt: 2,
            command: command.into(),
            rule: rule.into(),
            class: "critical".into(),
        };
        s.security_flags.extend([flag("b", "rm-rf"), flag("c", "kill-9")]);
        assert_eq!(policy_rules(&s), vec!["kill-9".to_string(), "rm-rf".to_string()]);
        s.security_flags.truncate(1);
        // What ran, as it ended: `a` failed, so `b` never ran, and the service came back anyway.
        let record = |index: u32, command: &str, status, exit_code| pitcrew_model::ExecutionRecord {
            attempt: 2,
            index,
            command: command.into(),
            status,
            exit_code,
            output: String::new(),
            duration_ms: 1,
        };
        s.executions = vec![
            record(0, "x", ExecutionStatus::Succeeded, Some(0)),
            record(0, "a", ExecutionStatus::Failed, Some(3)),
            record(1, "b", ExecutionStatus::Skipped, None),
        ];
        s.executions[0].attempt = 1;
        assert_eq!(
            summary(&s),
            "resolved web after 2 attempt(s): ran `a (failed, exit 3)`, skipped `b`; approved by ann (policy rule kill-9); GET / -> 200"
        );
        // Nothing of it ran: another run fixed the service first.
        let why = "not run: run 7 remediated web on web-1 since this run opened, and its check passes now";
        s.executions =
            vec![record(0, "a", ExecutionStatus::Skipped, None), record(1, "b", ExecutionStatus::Skipped, None)];
        s.executions.iter_mut().for_each(|e| e.output = why.into());
        assert_eq!(
            summary(&s),
            "resolved web after 2 attempt(s): ran nothing (run 7 remediated web on web-1 since this run opened, and its \
             check passes now); approved by ann (policy rule kill-9); GET / -> 200"
        );
        assert!(s.ran_commands().next().is_none(), "the event names no command left alone");
        s.executions[0].status = ExecutionStatus::Failed;
        assert_eq!(s.ran_commands().collect::<Vec<_>>(), ["a"]);
    }

    #[test]
    fn only_a_verified_recovery_of_the_attempt_resolves() {
        let mut s = RunState::new(uuid::Uuid::nil(), Incident::new("web", "down"));
        s.attempt = 2;
        let why = unverified(&s).expect("no verification");
        assert_eq!(why, "reached report without a verification of attempt 2");
        s.verification = Some(Verification { attempt: 1, recovered: true, detail: "GET / -> 200".into() });
        assert!(unverified(&s).is_some(), "an earlier attempt's recovery is not this one's");
        s.verification = Some(Verification { attempt: 2, recovered: false, detail: "GET / -> 503".into() });
        assert_eq!(unverified(&s).unwrap(), "reached report though attempt 2 did not recover: GET / -> 503");
        s.verification = Some(Verification { attempt: 2, recovered: true, detail: "GET / -> 200".into() });
        assert_eq!(unverified(&s), None);
    }
}
