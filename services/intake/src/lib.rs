//! intake: validates and normalises an incident, deduplicates it by fingerprint (one open run
//! per fingerprint), persists it and starts its run.

use futures::future::BoxFuture;
use pitcrew_model::{EventKind, Incident, IncidentError, RunState, Stage};
use pitcrew_runtime::store::OpenRun;
use pitcrew_runtime::{Cx, StageError, StageHandler, Transition};

/// The intake stage.
pub struct Intake;

/// Validate and normalise in place: trimmed fields, fingerprint set.
pub fn normalise(incident: &mut Incident) -> Result<(), IncidentError> {
    incident.validate()?;
    incident.fingerprint = Some(incident.effective_fingerprint());
    Ok(())
}

impl StageHandler for Intake {
    fn stage(&self) -> Stage {
        Stage::Intake
    }

    fn handle<'a>(
        &'a self,
        state: &'a mut RunState,
        cx: &'a mut Cx<'_>,
    ) -> BoxFuture<'a, Result<Transition, StageError>> {
        Box::pin(async move {
            normalise(&mut state.incident).map_err(|e| StageError::Poison(e.to_string()))?;
            let inc = &state.incident;
            match cx.deps.store.open_run(state).await? {
                OpenRun::Duplicate(other) => {
                    cx.emit(
                        EventKind::Duplicate,
                        format!("duplicate of open run {other} (same fingerprint): not opening a second run"),
                        serde_json::json!({ "run": other, "fingerprint": inc.fingerprint }),
                    );
                    return Ok(Transition::Drop);
                }
                OpenRun::Created | OpenRun::Existing => {}
            }
            cx.emit(
                EventKind::Status,
                format!("run opened for {}: {}", inc.service, inc.error),
                serde_json::json!({ "service": inc.service, "host": inc.host, "fingerprint": inc.fingerprint, "source": inc.source }),
            );
            if let Err(why) = pitcrew_runtime::target::service(cx.config(), state) {
                return Ok(Transition::Escalate(why));
            }
            Ok(Transition::To(Stage::Diagnose))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalise_sets_a_stable_fingerprint_and_refuses_bad_input() {
        let mut a = Incident::new(" web ", "connection refused on :8080");
        normalise(&mut a).unwrap();
        let mut b = Incident::new("web", "connection refused on :9090");
        normalise(&mut b).unwrap();
        assert_eq!(a.fingerprint, b.fingerprint);
        assert_eq!(a.service, "web");
        let mut explicit = Incident::new("web", "x");
        explicit.fingerprint = Some("am-123".into());
        normalise(&mut explicit).unwrap();
        assert_eq!(explicit.fingerprint.as_deref(), Some("am-123"));
        let mut bad = Incident::new("web", "");
        assert_eq!(normalise(&mut bad), Err(IncidentError::EmptyError));
    }
}
