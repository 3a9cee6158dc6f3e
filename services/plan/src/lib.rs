//! plan: asks the reasoning provider for 1-3 commands that fit the target, never one that
//! already failed for this error, with the evaluator's feedback when regenerating.

use futures::future::BoxFuture;
use pitcrew_llm::ReasonError;
use pitcrew_model::{ApprovalStatus, EventKind, RunState, Stage, Verdict};
use pitcrew_runtime::{target, Cx, StageError, StageHandler, Transition};

/// The plan stage.
pub struct PlanStage;

/// Commands the evaluator sent back during this attempt: not to be proposed again in it.
/// Every plan sent back (`rejected_commands`), and the one just sent back (a state from a
/// worker that kept only that one).
pub fn rejected_commands(state: &RunState) -> Vec<String> {
    let mut rejected = state.rejected_commands.clone();
    if let (Some(ev), Some(plan)) = (&state.evaluation, &state.plan) {
        if ev.attempt == state.attempt && ev.verdict == Verdict::Regenerate {
            pitcrew_model::run::add_once(&mut rejected, plan.commands.iter().cloned());
        }
    }
    rejected
}

impl StageHandler for PlanStage {
    fn stage(&self) -> Stage {
        Stage::Plan
    }

    fn handle<'a>(
        &'a self,
        state: &'a mut RunState,
        cx: &'a mut Cx<'_>,
    ) -> BoxFuture<'a, Result<Transition, StageError>> {
        Box::pin(async move {
            let cfg = cx.deps.config.clone();
            let spec = pitcrew_runtime::service_or_escalate!(&cfg, state);
            let Some(diagnosis) = state.diagnosis().cloned() else {
                return Err(StageError::Poison("run state reached plan without a diagnosis for this attempt".into()));
            };
            let mut reasoning = target::ReasonContext::gather(cx.deps, state, spec).await?;
            reasoning.rejected = rejected_commands(state);
            let meter = pitcrew_llm::UsageMeter::default();
            let mut input = reasoning.input(state);
            input.usage = Some(&meter);
            cx.bound_model(&mut input);
            let thinking = cx.thinking();
            input.progress = thinking.as_ref().map(|t| t as &dyn pitcrew_llm::Progress);
            let answer = cx.deps.reasoner.plan(&input, &diagnosis).await;
            if let Some(t) = thinking {
                t.finish().await;
            }
            target::record_usage(cx, state, Stage::Plan, &meter);
            let plan = match answer {
                Ok(p) => p,
                Err(ReasonError::Transient(e)) => return Err(StageError::Transient(e)),
                Err(e) => return Ok(Transition::Escalate(e.to_string())),
            };
            cx.emit(
                EventKind::Plan,
                format!("plan: {}", plan.commands.join(" ; ")),
                serde_json::json!({ "commands": plan.commands, "rationale": plan.rationale, "source": plan.source }),
            );
            state.plan = Some(plan);
            state.approval = ApprovalStatus::Unchecked;
            Ok(Transition::To(Stage::Evaluate))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pitcrew_model::{Evaluation, Incident, Plan};

    fn with(verdict: Verdict, eval_attempt: u32) -> RunState {
        let mut s = RunState::new(uuid::Uuid::nil(), Incident::new("web", "down"));
        s.plan = Some(Plan { attempt: 1, commands: vec!["a".into()], rationale: String::new(), source: String::new() });
        s.evaluation = Some(Evaluation {
            attempt: eval_attempt,
            regeneration: 0,
            score: 0.5,
            verdict,
            checks: Vec::new(),
            feedback: None,
        });
        s
    }

    #[test]
    fn only_a_plan_sent_back_in_this_attempt_is_excluded() {
        assert_eq!(rejected_commands(&with(Verdict::Regenerate, 1)), vec!["a".to_string()]);
        assert!(rejected_commands(&with(Verdict::Pass, 1)).is_empty());
        let mut later = with(Verdict::Regenerate, 1);
        later.attempt = 2;
        assert!(rejected_commands(&later).is_empty(), "a new attempt starts clean");
        // Plan a was sent back, then plan b: neither comes back (a third plan may not be a).
        let mut third = with(Verdict::Regenerate, 1);
        third.plan.as_mut().expect("a plan").commands = vec!["b".into()];
        third.rejected_commands = vec!["a".into()];
        assert_eq!(rejected_commands(&third), vec!["a".to_string(), "b".to_string()]);
    }
}
