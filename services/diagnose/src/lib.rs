//! diagnose: gathers read-only evidence (the service's health check, its pid), consults
//! episodic memory, and asks the reasoning provider what is wrong.

use futures::future::BoxFuture;
use pitcrew_exec::{run_check, Executor};
use pitcrew_llm::ReasonError;
use pitcrew_model::{EventKind, Evidence, RunState, ServiceSpec, Stage};
use pitcrew_runtime::{target, Cx, StageError, StageHandler, Transition};
use std::time::Duration;

/// The diagnose stage.
pub struct Diagnose;

/// Read-only evidence for `attempt`: the check's result, then the pidfile. Each item comes
/// with the timeline line that reports it.
pub async fn gather(spec: &ServiceSpec, attempt: u32, executor: &dyn Executor) -> Vec<(Evidence, String)> {
    let mut found = Vec::new();
    if let Some(check) = &spec.check {
        let out = run_check(check, &spec.host, executor).await;
        let line = format!("check: {}", out.detail);
        found.push((
            Evidence { attempt, source: "check".into(), detail: out.detail, output: out.output, ok: out.healthy },
            line,
        ));
    }
    if let Some(pidfile) = &spec.pidfile {
        let cmd = format!("cat {}", shell_words::quote(pidfile));
        let (ok, output) = match executor.run(&spec.host, &cmd, Duration::from_secs(10)).await {
            Ok(o) => (o.success(), if o.success() { o.stdout } else { o.stderr }),
            Err(e) => (false, e.to_string()),
        };
        let line = format!("pidfile {pidfile}: {}", if ok { output.trim() } else { "unreadable" });
        found.push((Evidence { attempt, source: "pidfile".into(), detail: cmd, output, ok }, line));
    }
    found
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
            for (evidence, line) in gather(spec, state.attempt, cx.deps.executor.as_ref()).await {
                cx.emit(EventKind::Evidence, line, serde_json::json!({ "source": evidence.source, "ok": evidence.ok }));
                state.push_evidence(evidence);
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use pitcrew_exec::LocalExecutor;
    use pitcrew_model::CheckSpec;

    fn spec(dir: &std::path::Path) -> ServiceSpec {
        let mut s: ServiceSpec = serde_json::from_value(serde_json::json!({})).unwrap();
        s.check = Some(CheckSpec::Command {
            command: format!("test -f {}/up", dir.display()),
            running_indicator: None,
            timeout_ms: 2000,
        });
        s.pidfile = Some(format!("{}/pid", dir.display()));
        s
    }

    #[tokio::test]
    async fn evidence_is_the_check_and_the_pid() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pid"), "4242\n").unwrap();
        let found = gather(&spec(dir.path()), 3, &LocalExecutor::new(4096)).await;
        assert_eq!(found.len(), 2);
        let (check, line) = &found[0];
        assert!(!check.ok && check.attempt == 3 && line.contains("exited 1"), "{check:?} {line}");
        let (pid, line) = &found[1];
        assert!(pid.ok && pid.output.trim() == "4242" && line.ends_with(": 4242"), "{pid:?} {line}");
    }

    #[tokio::test]
    async fn a_missing_pidfile_is_reported_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("up"), "").unwrap();
        let found = gather(&spec(dir.path()), 1, &LocalExecutor::new(4096)).await;
        assert!(found[0].0.ok, "the check passes");
        assert!(!found[1].0.ok && found[1].1.ends_with("unreadable"));
    }
}
