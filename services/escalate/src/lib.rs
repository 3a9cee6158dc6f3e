//! escalate: the run needs a human. Closes it with the reason and stores the episode.

use futures::future::BoxFuture;
use pitcrew_model::{EventKind, ExecutionStatus, Outcome, RunState, Stage};
use pitcrew_runtime::store::{Episode, Record};
use pitcrew_runtime::{Cx, StageError, StageHandler, Transition};

/// The escalate stage (terminal).
pub struct Escalate;

pub fn reason(state: &RunState) -> String {
    state.escalation_reason.clone().unwrap_or_else(|| "escalated without a recorded reason".into())
}

impl StageHandler for Escalate {
    fn stage(&self) -> Stage {
        Stage::Escalate
    }

    fn handle<'a>(
        &'a self,
        state: &'a mut RunState,
        cx: &'a mut Cx<'_>,
    ) -> BoxFuture<'a, Result<Transition, StageError>> {
        Box::pin(async move {
            let why = reason(state);
            // What failed this attempt, unless verify already stored it. Only commands that
            // ran and failed count (or never told how they ended: one that took its worker
            // down with it is not one to try again blindly): a denied or rejected plan is not
            // a failure of its commands, and neither is one that ran to the end where nothing
            // could check it (no health check, the host lost after it): memory would bar a
            // fix that may work.
            if state.plan.is_some() && state.verification.as_ref().is_none_or(|v| v.attempt != state.attempt) {
                let failed: Vec<String> = state
                    .current_executions()
                    .filter(|e| {
                        matches!(
                            e.status,
                            ExecutionStatus::Failed | ExecutionStatus::TimedOut | ExecutionStatus::Interrupted
                        )
                    })
                    .map(|e| e.command.clone())
                    .collect();
                cx.record(Record::Episode(Episode::of(state, &failed, false, &why)));
            }
            cx.emit(
                EventKind::Escalated,
                format!("escalated {}: {why}", state.incident.service),
                state.escalated_data(&why),
            );
            Ok(Transition::Done(Outcome::Escalated))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pitcrew_model::Incident;

    #[test]
    fn the_reason_is_never_empty() {
        let mut s = RunState::new(uuid::Uuid::nil(), Incident::new("web", "down"));
        assert_eq!(reason(&s), "escalated without a recorded reason");
        s.escalate("denied by bob");
        assert_eq!(reason(&s), "denied by bob");
    }
}
