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

/// An incident may name the host it saw the fault on: it must be the service's own host,
/// where every stage acts (its evidence, fix and check run there). A fault seen on another
/// host, even one the inventory knows, is not one pitcrew can fix from this service's entry:
/// fixing the service's host instead, and verifying there, would report a fault fixed that
/// still stands.
pub fn known_host(cfg: &pitcrew_runtime::Config, host: &str, service_host: &str) -> Result<(), String> {
    let local = ["local", "localhost", "127.0.0.1"];
    if host == service_host || (local.contains(&host) && local.contains(&service_host)) {
        return Ok(());
    }
    if cfg.hosts.contains_key(host) || local.contains(&host) {
        return Err(format!(
            "the incident is on host '{host}' but its service runs on '{service_host}' (its [services.<name>] \
             host): pitcrew acts on a service's own host only; give the service on '{host}' an entry of its own"
        ));
    }
    Err(format!(
        "unknown host '{host}': add it under [hosts.{host}] in pitcrew.toml (the service runs on '{service_host}')"
    ))
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
            let spec = match pitcrew_runtime::target::service(cx.config(), state) {
                Ok(spec) => spec,
                Err(why) => return Ok(Transition::Escalate(why)),
            };
            if let Some(host) = &state.incident.host {
                if let Err(why) = known_host(cx.config(), host, &spec.host) {
                    return Ok(Transition::Escalate(why));
                }
            }
            Ok(Transition::To(Stage::Diagnose))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_incident_names_a_host_the_inventory_knows() {
        let cfg = pitcrew_runtime::Config::from_toml("[hosts.pe1]\naddress = \"10.0.0.1\"\nuser = \"s\"\n").unwrap();
        assert!(known_host(&cfg, "localhost", "local").is_ok());
        assert!(known_host(&cfg, "web-7", "web-7").is_ok());
        assert!(known_host(&cfg, "pe1", "pe1").is_ok());
        assert!(known_host(&cfg, "pe9", "pe1").unwrap_err().contains("unknown host 'pe9'"));
        // A host the inventory knows, but not the service's: nothing would run where the fault is.
        let elsewhere = known_host(&cfg, "pe1", "local").unwrap_err();
        assert!(elsewhere.contains("on host 'pe1' but its service runs on 'local'"), "{elsewhere}");
        assert!(known_host(&cfg, "localhost", "pe1").unwrap_err().contains("runs on 'pe1'"));
    }

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
