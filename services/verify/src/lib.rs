//! verify: re-runs the service's health check. Recovered: report. Not recovered: back to
//! diagnose with what failed, until max_retries, then escalate.

use futures::future::BoxFuture;
use pitcrew_exec::{run_check, CheckOutcome, Inconclusive};
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

/// The checks of one verification so far.
#[derive(Debug, Default)]
struct Checks {
    made: u32,
    /// Healthy checks in a row, up to the last.
    streak: u32,
    was_healthy: bool,
    /// The last failed check that ran, since the last healthy one (a failure before a healthy
    /// check no longer says how the fix stands), unless the host went silent after it.
    said: Option<CheckOutcome>,
    /// Checks in a row, up to the last, that could not tell anything (inconclusive).
    silent: u32,
}

/// Checks in a row that tell nothing after a failure for that failure to no longer decide: one
/// is a blip (a channel slow to open), more is a host gone quiet (the fix rebooted it, or took
/// its network down), and whether the fix worked is then unknown, not a failure memory would
/// bar the command for.
const SILENT_OUTWEIGHS_A_FAILURE: u32 = 2;

impl Checks {
    fn saw(&mut self, outcome: &CheckOutcome) {
        self.made += 1;
        if outcome.healthy {
            self.streak += 1;
            self.was_healthy = true;
            self.said = None;
            self.silent = 0;
        } else {
            self.streak = 0;
            if outcome.inconclusive.is_none() {
                self.said = Some(outcome.clone());
                self.silent = 0;
            } else {
                self.silent += 1;
                if self.silent >= SILENT_OUTWEIGHS_A_FAILURE {
                    self.said = None;
                }
            }
        }
    }
}

/// What the checks of one verification say when they end unhealthy: the last, unless it told
/// nothing of the service (inconclusive: a channel that did not open in time, the host silent
/// for a moment) and an earlier one did (`said`: the last failed check that ran): that one
/// decides, and the fix counts as not having worked instead of escalating as unverifiable.
/// Pure.
pub fn settled_outcome(last: CheckOutcome, said: Option<CheckOutcome>) -> CheckOutcome {
    match (last.inconclusive, said) {
        (Some(_), Some(said)) if !last.healthy => {
            CheckOutcome { detail: format!("{} (the last check could not run: {})", said.detail, last.detail), ..said }
        }
        _ => last,
    }
}

/// Commands of this attempt that ran (or may have) without fixing the service.
pub fn tried_commands(state: &RunState) -> Vec<String> {
    state.ran_commands().map(str::to_string).collect()
}

/// What this attempt teaches memory. When the service recovered: the commands that succeeded.
/// One that failed, timed out or was cut short is no known fix, even when the service came
/// back anyway (by itself, or half-fixed by it), and an episode of success naming it would
/// erase its recorded failures. When it did not recover: every command that ran, or may have,
/// without fixing it.
pub fn learned_commands(state: &RunState, recovered: bool) -> Vec<String> {
    if !recovered {
        return tried_commands(state);
    }
    state.current_executions().filter(|e| e.status == ExecutionStatus::Succeeded).map(|e| e.command.clone()).collect()
}

/// Reset the per-attempt fields and count the next attempt, remembering what failed.
pub fn start_next_attempt(state: &mut RunState) {
    remember_failed(state);
    state.attempt += 1;
    state.regeneration = 0;
    state.feedback.clear();
    state.rejected_commands.clear();
    state.plan = None;
    state.evaluation = None;
    state.approval = ApprovalStatus::Unchecked;
    state.executions.clear();
}

/// This attempt's commands join the run's failed ones (once each).
fn remember_failed(state: &mut RunState) {
    let tried = tried_commands(state);
    pitcrew_model::run::add_once(&mut state.failed_commands, tried);
}

/// A failed check of an attempt none of whose commands ran (each recorded as not run: a
/// secret the execute worker lacked, the plan left alone) says so, and why: the escalation
/// would otherwise read as though the fix had been tried.
fn with_nothing_run(state: &RunState, outcome: CheckOutcome) -> CheckOutcome {
    match state.current_executions().next() {
        Some(first) if state.ran_commands().next().is_none() => {
            let why = pitcrew_model::trim::clip(first.output.trim_start_matches("not run: "), 240);
            CheckOutcome {
                detail: format!("{} (no command of attempt {} ran: {why})", outcome.detail, state.attempt),
                ..outcome
            }
        }
        _ => outcome,
    }
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
            let needed = cfg.verify.healthy_checks.max(1);
            let mut seen = Checks::default();
            let outcome = loop {
                let outcome = run_check(check, &spec.host, executor.as_ref()).await;
                seen.saw(&outcome);
                // A run of healthy checks under way is seen through, past `checks` too.
                if seen.streak >= needed || (seen.streak == 0 && seen.made >= tries) {
                    break outcome;
                }
                tokio::time::sleep(Duration::from_millis(cfg.verify.interval_ms)).await;
            };
            let recovered = seen.streak >= needed;
            let was_healthy = seen.was_healthy;
            let outcome = if recovered { outcome } else { settled_outcome(outcome, seen.said) };
            let outcome = if !recovered && was_healthy {
                // Up for a moment, then down again: the fix did not hold.
                let detail = format!("healthy at first, then failed again: {}", outcome.detail);
                CheckOutcome { detail, ..outcome }
            } else {
                outcome
            };
            if let Some(why) = outcome.inconclusive.filter(|_| !recovered) {
                // Nothing is known of the service (its host did not answer, or the check's
                // command did not run: a secret this worker lacks, its program missing): the
                // fix is neither a success nor a failure (memory would bar a command that may
                // have worked, another attempt would remediate a service perhaps healthy), and
                // a human must look.
                cx.emit(
                    EventKind::Verification,
                    format!("cannot verify: {}", outcome.detail),
                    serde_json::json!({ "recovered": null, "attempt": state.attempt }),
                );
                return Ok(Transition::Escalate(match why {
                    Inconclusive::Unreachable => {
                        format!("cannot reach {} to verify the fix: {}", spec.host, outcome.detail)
                    }
                    Inconclusive::NotRun => format!("cannot verify the fix: {}", outcome.detail),
                }));
            }
            let outcome = if recovered { outcome } else { with_nothing_run(state, outcome) };
            state.verification =
                Some(Verification { attempt: state.attempt, recovered, detail: outcome.detail.clone() });
            cx.emit(
                EventKind::Verification,
                format!("{}: {}", if recovered { "recovered" } else { "not recovered" }, outcome.detail),
                serde_json::json!({ "recovered": recovered, "attempt": state.attempt }),
            );
            // An attempt that ran nothing (its plan was left alone because another run fixed
            // the service first), or whose every command failed though the service came back,
            // teaches memory nothing about its commands.
            let learned = learned_commands(state, recovered);
            if !learned.is_empty() {
                cx.record(Record::Episode(Episode::of(state, &learned, recovered, &outcome.detail)));
            }
            match next_step(recovered, state.attempt, cfg.limits.max_retries) {
                Ok(Stage::Diagnose) => {
                    start_next_attempt(state);
                    Ok(Transition::To(Stage::Diagnose))
                }
                Ok(next) => Ok(Transition::To(next)),
                Err(reason) => {
                    // The escalation tells the human every command that did not fix it, the
                    // last attempt's too.
                    remember_failed(state);
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

    /// A failed check saying `detail`, inconclusive as given.
    fn failed(detail: &str, inconclusive: Option<Inconclusive>) -> CheckOutcome {
        CheckOutcome { healthy: false, detail: detail.into(), output: String::new(), inconclusive }
    }

    #[test]
    fn a_last_check_that_could_not_run_does_not_outweigh_the_ones_that_did() {
        let said = failed("GET /health returned 503", None);
        let blip = failed("channel did not open within 10 s", Some(Inconclusive::NotRun));
        let settled = settled_outcome(blip.clone(), Some(said.clone()));
        assert_eq!(settled.inconclusive, None, "a conclusive failure decides: {settled:?}");
        assert_eq!(
            settled.detail,
            "GET /health returned 503 (the last check could not run: channel did not open within 10 s)"
        );
        // No check ran at all: still nothing known of the service.
        assert_eq!(settled_outcome(blip.clone(), None), blip);
        // The last check said something itself: it decides.
        let last = failed("GET /health returned 500", None);
        assert_eq!(settled_outcome(last.clone(), Some(said.clone())), last);
        // A failure before a healthy check decides nothing: then only the check that could
        // not run is left, and nothing is known.
        let healthy = CheckOutcome { healthy: true, ..said.clone() };
        let mut seen = Checks::default();
        for outcome in [&said, &healthy, &blip] {
            seen.saw(outcome);
        }
        assert_eq!((seen.made, seen.streak, seen.was_healthy), (3, 0, true));
        assert_eq!(settled_outcome(blip.clone(), seen.said).inconclusive, Some(Inconclusive::NotRun));
    }

    /// A failure followed by the host going quiet (a fix that rebooted it: every later check
    /// finds it unreachable) says nothing of whether the fix worked: verification is
    /// inconclusive, and the fix is not blamed. One quiet check after a failure is a blip, and
    /// the failure still decides.
    #[test]
    fn a_host_gone_quiet_after_a_failure_leaves_the_fix_unjudged() {
        let starting = failed("`systemctl is-active web` exited 3", None);
        let gone = failed("cannot reach box: connection refused", Some(Inconclusive::Unreachable));
        let mut seen = Checks::default();
        for outcome in [&starting, &gone] {
            seen.saw(outcome);
        }
        let settled = settled_outcome(gone.clone(), seen.said.clone());
        assert_eq!(settled.inconclusive, None, "one quiet check: the failure decides");
        for _ in 0..8 {
            seen.saw(&gone);
        }
        let settled = settled_outcome(gone.clone(), seen.said.clone());
        assert_eq!(settled.inconclusive, Some(Inconclusive::Unreachable), "{settled:?}");
        // A conclusive failure after the quiet spell decides again.
        seen.saw(&starting);
        seen.saw(&gone);
        assert_eq!(settled_outcome(gone.clone(), seen.said).inconclusive, None);
    }

    /// Command `index` of `attempt`, `command`, ended as `status`.
    fn rec(attempt: u32, index: u32, command: &str, status: ExecutionStatus) -> ExecutionRecord {
        ExecutionRecord {
            attempt,
            index,
            command: command.into(),
            status,
            exit_code: None,
            output: String::new(),
            duration_ms: 0,
        }
    }

    #[test]
    fn a_recovery_teaches_only_the_commands_that_succeeded() {
        let mut s = RunState::new(uuid::Uuid::nil(), Incident::new("web", "down"));
        s.attempt = 2;
        s.executions = vec![
            rec(1, 0, "old", ExecutionStatus::Succeeded),
            rec(2, 0, "a", ExecutionStatus::Failed),
            rec(2, 1, "b", ExecutionStatus::Skipped),
        ];
        // The service came back though `a` failed: `a` is no fix, and nothing else ran.
        assert!(learned_commands(&s, true).is_empty());
        assert_eq!(learned_commands(&s, false), ["a"], "not recovered: what ran without fixing it");
        s.executions = vec![
            rec(2, 0, "a", ExecutionStatus::Succeeded),
            rec(2, 1, "b", ExecutionStatus::TimedOut),
            rec(2, 2, "c", ExecutionStatus::Interrupted),
        ];
        assert_eq!(learned_commands(&s, true), ["a"]);
        assert_eq!(learned_commands(&s, false), ["a", "b", "c"]);
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
        s.executions = vec![rec(1, 0, "a", ExecutionStatus::Failed), rec(1, 1, "b", ExecutionStatus::Skipped)];
        s.regeneration = 2;
        s.rejected_commands = vec!["c".into()];
        start_next_attempt(&mut s);
        assert_eq!(s.failed_commands, vec!["a".to_string()]);
        assert_eq!((s.attempt, s.regeneration), (2, 0));
        assert!(s.plan.is_none() && s.executions.is_empty());
        assert!(s.rejected_commands.is_empty(), "a plan sent back is tried again in a new attempt");
    }
}
