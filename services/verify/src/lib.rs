//! verify: re-runs the service's health check. Recovered: report. Not recovered: back to
//! diagnose with what failed, until max_retries, then escalate.

use futures::future::BoxFuture;
use pitcrew_exec::run_check;
use pitcrew_model::{ApprovalStatus, EventKind, ExecutionStatus, RunState, Stage, Verification};
use pitcrew_runtime::store::{Episode, Record};
use pitcrew_runtime::{Cx, StageError, StageHandler, Transition};
use std::time::Duration;

/// The verify stage.
pub struct Verify;

/// What follows a verification, given the attempt and the retry limit. Pure.
pub fn next_step(recovered: bool, attempt: u32, max_retries: u32) -> Result<Stage, String> {
    if recovered {
        Ok(Stage::Report)
    } else if attempt >= max_retries {
        Err(format!("still unhealthy after {attempt} attempt(s): max_retries ({max_retries}) reached"))
    } else {
        Ok(Stage::Diagnose)
    }
}

/// Commands of this attempt that ran (or may have) without fixing the service.
pub fn tried_commands(state: &RunState) -> Vec<String> {
    state
        .executions
        .iter()
        .filter(|e| e.attempt == state.attempt && e.status != ExecutionStatus::Skipped)
        .map(|e| e.command.clone())
        .collect()
}

/// This attempt's tried commands that did not fix the service, split in two: those that now
/// count as failed, and those given one more try. A command interrupted for the first time in
/// the run (a worker died while it held the command's claim: it may never have started, as
/// when it waited for its turn on the host) gets another try in a later attempt; interrupted
/// again, it counts as failed (one that takes its worker down with it is not tried blindly).
pub fn judge_tried(state: &RunState) -> (Vec<String>, Vec<String>) {
    let (mut failed, mut again) = (Vec::new(), Vec::new());
    for e in state.executions.iter().filter(|e| e.attempt == state.attempt && e.status != ExecutionStatus::Skipped) {
        let first_interruption =
            e.status == ExecutionStatus::Interrupted && !state.interrupted_commands.contains(&e.command);
        let into = if first_interruption { &mut again } else { &mut failed };
        pitcrew_model::run::add_once(into, [e.command.clone()]);
    }
    // A command both interrupted and run to a failure in this attempt failed.
    again.retain(|c| !failed.contains(c));
    (failed, again)
}

/// Reset the per-attempt fields and count the next attempt, remembering what failed and
/// what was given one more try (`judge_tried`).
pub fn start_next_attempt(state: &mut RunState) {
    let (failed, again) = judge_tried(state);
    pitcrew_model::run::add_once(&mut state.failed_commands, failed);
    pitcrew_model::run::add_once(&mut state.interrupted_commands, again);
    state.attempt += 1;
    state.regeneration = 0;
    state.feedback.clear();
    state.rejected_commands.clear();
    state.plan = None;
    state.evaluation = None;
    state.approval = ApprovalStatus::Unchecked;
    state.executions.clear();
}

impl StageHandler for Verify {
    fn stage(&self) -> Stage {
        Stage::Verify
    }

    fn handle<'a>(
        &'a self,
        state: &'a mut RunState,
        cx: &'a mut Cx<'_>,
    ) -> BoxFuture<'a, Result<Transition, StageError>> {
        Box::pin(async move {
            let cfg = cx.deps.config.clone();
            let spec = pitcrew_runtime::service_or_escalate!(&cfg, state);
            let Some(check) = &spec.check else {
                return Ok(Transition::Escalate(format!(
                    "no health check configured for '{}': cannot verify the fix",
                    state.incident.service
                )));
            };
            let executor = cx.deps.executor.clone();
            let tries = cfg.verify.checks.max(1);
            let mut outcome = run_check(check, &spec.host, executor.as_ref()).await;
            for _ in 1..tries {
                if outcome.healthy {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(cfg.verify.interval_ms)).await;
                outcome = run_check(check, &spec.host, executor.as_ref()).await;
            }
            let recovered = outcome.healthy;
            if !recovered && outcome.host_unreachable {
                // Nothing is known of the service: the fix is neither a success nor a failure
                // (memory would bar a command that may have worked), and a human must look.
                cx.emit(
                    EventKind::Verification,
                    format!("cannot verify: {}", outcome.detail),
                    serde_json::json!({ "recovered": null, "attempt": state.attempt }),
                );
                return Ok(Transition::Escalate(format!(
                    "cannot reach {} to verify the fix: {}",
                    spec.host, outcome.detail
                )));
            }
            state.verification =
                Some(Verification { attempt: state.attempt, recovered, detail: outcome.detail.clone() });
            cx.emit(
                EventKind::Verification,
                format!("{}: {}", if recovered { "recovered" } else { "not recovered" }, outcome.detail),
                serde_json::json!({ "recovered": recovered, "attempt": state.attempt }),
            );
            let next = next_step(recovered, state.attempt, cfg.limits.max_retries);
            // What memory learns: the commands that fixed it, or those that count as failed
            // (a command given one more try in this run is not barred for its service meanwhile;
            // with no try left, every command tried counts). An attempt that ran nothing (its
            // plan was left alone because another run fixed the service first) teaches nothing.
            let learned = if recovered || next.is_err() { tried_commands(state) } else { judge_tried(state).0 };
            if !learned.is_empty() {
                cx.record(Record::Episode(Episode::of(state, &learned, recovered, &outcome.detail)));
            }
            match next {
                Ok(Stage::Diagnose) => {
                    start_next_attempt(state);
                    Ok(Transition::To(Stage::Diagnose))
                }
                Ok(next) => Ok(Transition::To(next)),
                Err(reason) => {
                    // The escalation tells the human every command that did not fix it, the
                    // last attempt's too.
                    pitcrew_model::run::add_once(&mut state.failed_commands, learned);
                    Ok(Transition::Escalate(format!("{reason}; last check: {}", outcome.detail)))
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pitcrew_model::{ExecutionRecord, Incident, Plan};

    #[test]
    fn retries_until_the_limit_then_escalates() {
        assert_eq!(next_step(true, 5, 5), Ok(Stage::Report));
        assert_eq!(next_step(false, 1, 5), Ok(Stage::Diagnose));
        assert_eq!(next_step(false, 4, 5), Ok(Stage::Diagnose));
        assert!(next_step(false, 5, 5).unwrap_err().contains("max_retries (5)"));
    }

    #[test]
    fn the_next_attempt_remembers_what_failed_and_starts_clean() {
        let mut s = RunState::new(uuid::Uuid::nil(), Incident::new("web", "down"));
        s.plan = Some(Plan {
            attempt: 1,
            commands: vec!["a".into(), "b".into()],
            rationale: String::new(),
            source: String::new(),
        });
        let rec = |i, c: &str, status| ExecutionRecord {
            attempt: 1,
            index: i,
            command: c.into(),
            status,
            exit_code: None,
            output: String::new(),
            duration_ms: 0,
        };
        s.executions = vec![rec(0, "a", ExecutionStatus::Failed), rec(1, "b", ExecutionStatus::Skipped)];
        s.regeneration = 2;
        s.rejected_commands = vec!["c".into()];
        start_next_attempt(&mut s);
        assert_eq!(s.failed_commands, vec!["a".to_string()]);
        assert_eq!((s.attempt, s.regeneration), (2, 0));
        assert!(s.plan.is_none() && s.executions.is_empty());
        assert!(s.rejected_commands.is_empty(), "a plan sent back is tried again in a new attempt");
    }

    #[test]
    fn an_interrupted_command_gets_one_more_try_then_counts_as_failed() {
        let mut s = RunState::new(uuid::Uuid::nil(), Incident::new("web", "down"));
        let rec = |attempt, i, c: &str, status| ExecutionRecord {
            attempt,
            index: i,
            command: c.into(),
            status,
            exit_code: None,
            output: String::new(),
            duration_ms: 0,
        };
        s.executions = vec![rec(1, 0, "a", ExecutionStatus::Interrupted), rec(1, 1, "b", ExecutionStatus::Skipped)];
        assert_eq!(judge_tried(&s), (vec![], vec!["a".to_string()]));
        start_next_attempt(&mut s);
        assert!(s.failed_commands.is_empty(), "{:?}", s.failed_commands);
        assert_eq!(s.interrupted_commands, ["a"]);
        s.executions = vec![rec(2, 0, "a", ExecutionStatus::Interrupted), rec(2, 1, "c", ExecutionStatus::Interrupted)];
        assert_eq!(judge_tried(&s), (vec!["a".to_string()], vec!["c".to_string()]));
        start_next_attempt(&mut s);
        assert_eq!(
            (s.failed_commands.as_slice(), s.interrupted_commands.as_slice()),
            (&["a".to_string()][..], &["a".to_string(), "c".to_string()][..])
        );
        // The escalation names what was interrupted and never counted as failed.
        assert_eq!(s.escalated_data("x")["interrupted_commands"], serde_json::json!(["c"]));
        // Run to its end earlier in the same attempt as its interruption (a plan naming it
        // twice): it did not fix the service, so it failed.
        s.executions = vec![
            rec(3, 0, "d", ExecutionStatus::Succeeded),
            rec(3, 1, "e", ExecutionStatus::Succeeded),
            rec(3, 2, "d", ExecutionStatus::Interrupted),
        ];
        assert_eq!(judge_tried(&s), (vec!["d".to_string(), "e".to_string()], vec![]));
    }
}
