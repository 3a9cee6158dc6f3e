//! report: the run is resolved. Closes it and says what fixed it.

use futures::future::BoxFuture;
use pitcrew_model::{EventKind, Outcome, RunState, Stage};
use pitcrew_runtime::{Cx, StageError, StageHandler, Transition};

/// The report stage (terminal).
pub struct Report;

/// One line that says what happened.
pub fn summary(state: &RunState) -> String {
    let plan = state.plan.as_ref().map(|p| p.commands.join(" ; ")).unwrap_or_else(|| "nothing".into());
    let check = state.verification.as_ref().map(|v| v.detail.as_str()).unwrap_or("-");
    format!("resolved {} after {} attempt(s): ran `{plan}`; {check}", state.incident.service, state.attempt)
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
            let elapsed = (chrono::Utc::now() - state.started_at).num_milliseconds();
            cx.emit(
                EventKind::Resolved,
                summary(state),
                serde_json::json!({
                    "attempts": state.attempt,
                    "diagnosis": state.diagnosis().map(|d| d.summary.clone()),
                    "commands": state.plan.as_ref().map(|p| p.commands.clone()),
                    "approval": state.approval,
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
    }
}
