//! diagnose: gathers read-only evidence (the service's health check, its pid), consults
//! episodic memory, and asks the reasoning provider what is wrong.

use futures::future::BoxFuture;
use pitcrew_exec::{run_check, Executor};
use pitcrew_llm::ReasonError;
use pitcrew_model::{EventKind, Evidence, RunState, ServiceSpec, Stage};
use pitcrew_policy::Policy;
use pitcrew_runtime::{target, Cx, StageError, StageHandler, Transition};
use std::time::Duration;

/// The diagnose stage.
pub struct Diagnose;

/// Read-only evidence for `attempt`: the check's result, the pidfile, then the service's
/// evidence commands (log tail, journal, ports, disk, memory), each admitted by the policy's
/// read-only class first. Each item comes with the timeline line that reports it.
pub async fn gather(
    spec: &ServiceSpec,
    attempt: u32,
    executor: &dyn Executor,
    policy: &Policy,
) -> Vec<(Evidence, String)> {
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
        let (mut ok, output) = run_evidence(executor, &spec.host, &cmd).await;
        let pid = output.trim().to_string();
        let mut line = format!("pidfile {pidfile}: {}", if ok { pid.as_str() } else { "unreadable" });
        // A pid is only evidence if that process still runs: a stale pidfile must never hand
        // a playbook someone else's pid (`kill -9 {pid}`).
        if ok {
            let alive = !pid.is_empty()
                && pid.chars().all(|c| c.is_ascii_digit())
                && run_evidence(executor, &spec.host, &format!("ps -p {pid}")).await.0;
            if !alive {
                ok = false;
                line = format!("pidfile {pidfile}: {pid} is stale (no such process)");
            }
        }
        found.push((Evidence { attempt, source: "pidfile".into(), detail: cmd, output, ok }, line));
    }
    for cmd in spec.evidence_commands() {
        let (ok, output, line) = match policy.read_only(&cmd) {
            Err(why) => (false, String::new(), format!("`{cmd}` not run: {why}")),
            Ok(()) => {
                let (ok, output) = run_evidence(executor, &spec.host, &cmd).await;
                let first = output.lines().find(|l| pitcrew_model::trim::looks_like_error(l)).or(output.lines().next());
                let line = format!("`{cmd}`{}: {}", if ok { "" } else { " failed" }, first.unwrap_or("(no output)"));
                (ok, output, line)
            }
        };
        found.push((Evidence { attempt, source: "command".into(), detail: cmd, output, ok }, line));
    }
    found
}

/// Run one evidence command: (succeeded, trimmed output or the error).
async fn run_evidence(executor: &dyn Executor, host: &str, cmd: &str) -> (bool, String) {
    let (ok, text) = match executor.run(host, cmd, Duration::from_secs(10)).await {
        Ok(o) if o.success() => (true, o.stdout),
        Ok(o) => (false, if o.stderr.is_empty() { o.stdout } else { o.stderr }),
        Err(e) => (false, e.to_string()),
    };
    (ok, pitcrew_model::trim::trim_output(&text, pitcrew_model::run::MAX_OUTPUT))
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
            let spec = pitcrew_runtime::service_or_escalate!(&cfg, state);
            // A redelivery starts over from the input state: evidence of this attempt is regathered.
            state.evidence.retain(|e| e.attempt != state.attempt);
            let found = gather(spec, state.attempt, cx.deps.executor.as_ref(), &cx.deps.policy).await;
            for (evidence, line) in found {
                // The timeline keeps the (trimmed) output too.
                let data = serde_json::json!({
                    "source": evidence.source,
                    "command": evidence.detail,
                    "ok": evidence.ok,
                    "output": evidence.output,
                });
                cx.emit(EventKind::Evidence, line, data);
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
        s.log_file = Some(format!("{}/app.log", dir.display()));
        s.evidence = Some(vec!["df -h".into(), "touch /tmp/never".into()]);
        s
    }

    #[tokio::test]
    async fn evidence_is_the_check_and_the_pid() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pid"), format!("{}\n", std::process::id())).unwrap();
        let mut log = String::new();
        for i in 0..200 {
            log.push_str(&format!("request {i} ok\n"));
        }
        log.push_str("ERROR: config invalid: listen address missing\n");
        std::fs::write(dir.path().join("app.log"), log).unwrap();
        let found = gather(&spec(dir.path()), 3, &LocalExecutor::new(4096), &Policy::default_policy()).await;
        assert_eq!(found.len(), 5);
        let (check, line) = &found[0];
        assert!(!check.ok && check.attempt == 3 && line.contains("exited 1"), "{check:?} {line}");
        let (pid, line) = &found[1];
        let me = std::process::id().to_string();
        assert!(pid.ok && pid.output.trim() == me && line.ends_with(&format!(": {me}")), "{pid:?} {line}");
        let (tail, line) = &found[2];
        assert!(tail.ok && tail.output.lines().count() == 50, "only the last lines: {tail:?}");
        assert!(line.contains("ERROR: config invalid"), "the line that looks like an error leads: {line}");
        let (df, _) = &found[3];
        assert!(df.ok && df.output.contains("Filesystem"), "{df:?}");
        let (refused, line) = &found[4];
        assert!(!refused.ok && line.contains("not run") && line.contains("read-only"), "{line}");
        assert!(!std::path::Path::new("/tmp/never").exists(), "a write is never run as evidence");
    }

    #[tokio::test]
    async fn a_stale_pid_is_not_evidence() {
        let dir = tempfile::tempdir().unwrap();
        // A pid far above any real one (pid_max is at most 2^22).
        std::fs::write(dir.path().join("pid"), "99999999\n").unwrap();
        let found = gather(&spec(dir.path()), 1, &LocalExecutor::new(4096), &Policy::default_policy()).await;
        let (pid, line) = &found[1];
        assert!(!pid.ok && line.contains("stale"), "{pid:?} {line}");
        std::fs::write(dir.path().join("pid"), format!("{}\n", std::process::id())).unwrap();
        let found = gather(&spec(dir.path()), 1, &LocalExecutor::new(4096), &Policy::default_policy()).await;
        assert!(found[1].0.ok, "a live pid is evidence: {:?}", found[1]);
    }

    #[tokio::test]
    async fn a_missing_pidfile_is_reported_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("up"), "").unwrap();
        let found = gather(&spec(dir.path()), 1, &LocalExecutor::new(4096), &Policy::default_policy()).await;
        assert!(found[0].0.ok, "the check passes");
        assert!(!found[1].0.ok && found[1].1.ends_with("unreadable"));
    }
}
