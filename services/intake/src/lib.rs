//! intake: validates and normalises an incident, deduplicates it by fingerprint (one open run
//! per fingerprint), persists it and starts its run.

use futures::future::BoxFuture;
use pitcrew_model::{EventKind, Incident, IncidentError, RunState, Stage};
use pitcrew_runtime::store::OpenRun;
use pitcrew_runtime::{Cx, StageError, StageHandler, Transition};

/// The intake stage.
pub struct Intake;

/// Validate and normalise in place: trimmed fields, fingerprint set. Without a fingerprint of
/// its own, an incident's is derived from its service, host and error, where a host that is
/// the service's own (as `cfg` has it) counts as none: `{web, refused}` and `{web, refused,
/// host: localhost}` for a local `web` are one fault, and one run (they were two, remediating
/// the same target in turn).
pub fn normalise(incident: &mut Incident, cfg: &pitcrew_runtime::Config) -> Result<(), IncidentError> {
    incident.validate()?;
    if incident.fingerprint.is_none() {
        let own = match (&incident.host, cfg.services.get(&incident.service)) {
            (Some(host), Some(spec)) => same_host(cfg, host, &spec.host),
            _ => false,
        };
        let fingerprint = match own {
            true => Incident { host: None, ..incident.clone() }.effective_fingerprint(),
            false => incident.effective_fingerprint(),
        };
        incident.fingerprint = Some(fingerprint);
    }
    Ok(())
}

/// Whether `host`, named by an incident, is `service_host`, a service's own: by its inventory
/// name, or by the address its `[hosts.<name>]` entry reaches it at (an alert's `instance`
/// label names a scrape target by IP address or DNS name, not by inventory name; a name's
/// case and a trailing dot do not count). `localhost`, `127.0.0.1` and `local` are one.
fn same_host(cfg: &pitcrew_runtime::Config, host: &str, service_host: &str) -> bool {
    use pitcrew_exec::local::is_local;
    host == service_host
        || (is_local(host) && is_local(service_host))
        || cfg.hosts.get(service_host).is_some_and(|h| same_address(&h.address, host))
}

fn same_address(a: &str, b: &str) -> bool {
    let bare = |s: &str| s.trim_end_matches('.').to_ascii_lowercase();
    !a.is_empty() && bare(a) == bare(b)
}

/// An incident may name the host it saw the fault on: it must be the service's own host,
/// where every stage acts (its evidence, fix and check run there). A fault seen on another
/// host, even one the inventory knows, is not one pitcrew can fix from this service's entry:
/// fixing the service's host instead, and verifying there, would report a fault fixed that
/// still stands.
pub fn known_host(cfg: &pitcrew_runtime::Config, host: &str, service_host: &str) -> Result<(), String> {
    if same_host(cfg, host, service_host) {
        return Ok(());
    }
    let by_address = cfg.hosts.iter().find(|(_, h)| same_address(&h.address, host)).map(|(name, _)| name);
    if cfg.hosts.contains_key(host) || pitcrew_exec::local::is_local(host) || by_address.is_some() {
        let named =
            by_address.filter(|name| *name != host).map(|name| format!(" ([hosts.{name}])")).unwrap_or_default();
        return Err(format!(
            "the incident is on host '{host}'{named} but its service runs on '{service_host}' (its [services.<name>] \
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
            normalise(&mut state.incident, cx.config()).map_err(|e| StageError::Poison(e.to_string()))?;
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

    /// An alert names its host as Prometheus scraped it (`instance`, its port dropped): the
    /// address of the service's inventory entry is that host too.
    #[test]
    fn an_incident_may_name_its_service_s_host_by_address() {
        let cfg = pitcrew_runtime::Config::from_toml(
            "[services.db]\nhost = \"pe1\"\n[hosts.pe1]\naddress = \"DB-1.example.com\"\nuser = \"s\"\n\
             [hosts.pe2]\naddress = \"10.0.0.12\"\nuser = \"s\"\n",
        )
        .unwrap();
        assert!(known_host(&cfg, "db-1.example.com", "pe1").is_ok());
        assert!(known_host(&cfg, "db-1.example.com.", "pe1").is_ok());
        assert!(known_host(&cfg, "10.0.0.12", "pe2").is_ok());
        // Another host's address is still another host.
        let elsewhere = known_host(&cfg, "10.0.0.12", "pe1").unwrap_err();
        assert!(elsewhere.contains("on host '10.0.0.12' ([hosts.pe2]) but its service runs on 'pe1'"), "{elsewhere}");
        assert!(known_host(&cfg, "10.0.0.13", "pe1").unwrap_err().contains("unknown host '10.0.0.13'"));
        // One fault whether the alert names the host by address or not at all: one run.
        let mut by_address = Incident::new("db", "connection refused");
        by_address.host = Some("db-1.example.com".into());
        normalise(&mut by_address, &cfg).unwrap();
        let mut hostless = Incident::new("db", "connection refused");
        normalise(&mut hostless, &cfg).unwrap();
        assert_eq!(by_address.fingerprint, hostless.fingerprint);
    }

    #[test]
    fn normalise_sets_a_stable_fingerprint_and_refuses_bad_input() {
        let cfg = pitcrew_runtime::Config::from_toml(
            "[services.web]\nhost = \"local\"\n[services.db]\nhost = \"pe1\"\n\
             [hosts.pe1]\naddress = \"10.0.0.1\"\nuser = \"s\"\n",
        )
        .unwrap();
        let mut a = Incident::new(" web ", "connection refused on :8080");
        normalise(&mut a, &cfg).unwrap();
        let mut b = Incident::new("web", "connection refused on :9090");
        normalise(&mut b, &cfg).unwrap();
        assert_eq!(a.fingerprint, b.fingerprint);
        assert_eq!(a.service, "web");
        // The service's own host, however named, is no host: one fault, one run.
        for (service, host) in [("web", "localhost"), ("web", "127.0.0.1"), ("web", "local"), ("db", "pe1")] {
            let mut none = Incident::new(service, "connection refused");
            normalise(&mut none, &cfg).unwrap();
            let mut named = Incident::new(service, "connection refused");
            named.host = Some(host.into());
            normalise(&mut named, &cfg).unwrap();
            assert_eq!(named.fingerprint, none.fingerprint, "{service} on {host}");
            assert_eq!(named.host.as_deref(), Some(host), "the incident keeps what it said");
        }
        // Another host is another fault (escalated as such, not dropped as a duplicate).
        let mut other = Incident::new("web", "connection refused on :8080");
        other.host = Some("pe1".into());
        normalise(&mut other, &cfg).unwrap();
        assert_ne!(other.fingerprint, a.fingerprint);
        let mut explicit = Incident::new("web", "x");
        explicit.fingerprint = Some("am-123".into());
        normalise(&mut explicit, &cfg).unwrap();
        assert_eq!(explicit.fingerprint.as_deref(), Some("am-123"));
        let mut bad = Incident::new("web", "");
        assert_eq!(normalise(&mut bad, &cfg), Err(IncidentError::EmptyError));
    }
}
