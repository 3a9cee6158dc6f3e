//! diagnose: gathers read-only evidence (the service's health check, its pid), consults
//! episodic memory, and asks the reasoning provider what is wrong.

use futures::future::BoxFuture;
use pitcrew_exec::run_check;
use pitcrew_llm::ReasonError;
use pitcrew_model::{EventKind, Evidence, RunState, ServiceSpec, Stage};
use pitcrew_runtime::{target, Cx, StageError, StageHandler, Transition};
use std::time::Duration;

/// The diagnose stage.
pub struct Diagnose;

/// Read-only evidence for this attempt: the check's result, then the pidfile.
async fn gather(state: &mut RunState, spec: &ServiceSpec, cx: &mut Cx<'_>) {
    let executor = cx.deps.executor.clone();
    if let Some(check) = &spec.check {
        let out = run_check(check, &spec.host, executor.as_ref()).await;
        cx.emit(
            EventKind::Evidence,
            format!("check: {}", out.detail),
            serde_json::json!({ "source": "check", "healthy": out.healthy }),
        );
        state.push_evidence(Evidence {
            attempt: state.attempt,
            source: "check".into(),
            detail: out.detail,
            output: out.output,
            ok: out.healthy,
        });
    }
    if let Some(pidfile) = &spec.pidfile {
        let cmd = format!("cat {}", shell_words::quote(pidfile));
        let (ok, output) = match executor.run(&spec.host, &cmd, Duration::from_secs(10)).await {
            Ok(o) => (o.success(), if o.success() { o.stdout } else { o.stderr }),
            Err(e) => (false, e.to_string()),
        };
        cx.emit(
            EventKind::Evidence,
            format!("pidfile {pidfile}: {}", if ok { output.trim() } else { "unreadable" }),
            serde_json::json!({ "source": "pidfile", "ok": ok }),
        );
        state.push_evidence(Evidence { attempt: state.attempt, source: "pidfile".into(), detail: cmd, output, ok });
    }
}

impl StageHandler for Diagnose {
    fn stage(&self) -> Stage {
        Stage::Diagnose
    }

    fn handle<'a>(
        &'a self,
        state: &'a mut RunState,
        cx: &'a mut Cx<'_>,
    ) -> BoxFuture<'a, Result<Transition, StageError>> {
        Box::pin(async move {
            let cfg = cx.deps.config.clone();
            let spec = match target::service(&cfg, state) {
                Ok(s) => s,
                Err(why) => return Ok(Transition::Escalate(why)),
            };
            // A redelivery starts over from the input state: evidence of this attempt is regathered.
            state.evidence.retain(|e| e.attempt != state.attempt);
            gather(state, spec, cx).await;
            let reasoning = target::ReasonContext::gather(cx.deps, state, spec).await?;
            let failed = reasoning.failed.clone();
            let input = reasoning.input(state);
            let diagnosis = match cx.deps.reasoner.diagnose(&input).await {
                Ok(d) => d,
                Err(ReasonError::Transient(e)) => return Err(StageError::Transient(e)),
                Err(e) => return Ok(Transition::Escalate(e.to_string())),
            };
            cx.emit(
                EventKind::Diagnosis,
                diagnosis.summary.clone(),
                serde_json::json!({ "source": diagnosis.source, "grounds": diagnosis.grounds, "known_failed": failed }),
            );
            state.diagnosis_log.retain(|d| d.attempt != state.attempt);
            state.diagnosis_log.push(diagnosis);
            state.plan = None;
            state.evaluation = None;
            Ok(Transition::To(Stage::Plan))
        })
    }
}
