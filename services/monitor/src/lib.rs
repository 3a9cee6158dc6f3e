//! monitor: checks every configured service on an interval (concurrently, each bounded by
//! its timeout), opens an incident on `pitcrew.incidents.new` when one fails — with a
//! fingerprint, so a service that stays down never opens a second run while one is open —
//! and publishes a recovery event when it answers again.

use futures::future::join_all;
use pitcrew_exec::{run_check, CheckOutcome, Executor};
use pitcrew_metrics::{Counter, Gauge, Histogram, LATENCY_BUCKETS};
use pitcrew_model::codec::JSON;
use pitcrew_model::{Incident, ServiceSpec, Severity};
use pitcrew_runtime::{Bus, BusError};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

static CHECKS: Counter = Counter::new(
    "pitcrew_monitor_checks_total",
    "Health checks the monitor ran, by service and result.",
    &["service", "result"],
);
static UP: Gauge =
    Gauge::new("pitcrew_monitor_service_up", "1 if the service's last health check passed, else 0.", &["service"]);
static CHECK_SECONDS: Histogram = Histogram::new(
    "pitcrew_monitor_check_seconds",
    "Time one health check took (its own timeout bounds it), by service.",
    &["service"],
    LATENCY_BUCKETS,
);
static PUBLISHED: Counter = Counter::new(
    "pitcrew_monitor_publishes_total",
    "Incidents and recoveries the monitor published, by kind and outcome (ok, failed: retried next round).",
    &["kind", "outcome"],
);
static LAST_ROUND: Gauge = Gauge::new(
    "pitcrew_monitor_last_round_timestamp_seconds",
    "When the monitor last finished checking every service (Unix time): alert when it stops moving.",
    &[],
);

/// What the monitor decided about one service after a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Healthy before and now, or down and already reported recently.
    Nothing,
    /// It went down (or is still down and due a reminder): open an incident.
    Down,
    /// It answers again after being down.
    Recovered,
}

/// Per-service memory of the last result.
#[derive(Debug, Default, Clone)]
pub struct Tracker {
    /// Service -> (down since, last incident published at), for services currently down.
    down: HashMap<String, (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>)>,
}

impl Tracker {
    /// Fold one check result in. A service still down is reported again after `realert`
    /// (intake deduplicates by fingerprint while its run is open).
    pub fn observe(
        &mut self,
        service: &str,
        healthy: bool,
        now: chrono::DateTime<chrono::Utc>,
        realert: Duration,
    ) -> Change {
        match (healthy, self.down.get_mut(service)) {
            (true, None) => Change::Nothing,
            (true, Some(_)) => {
                self.down.remove(service);
                Change::Recovered
            }
            (false, None) => {
                self.down.insert(service.to_string(), (now, now));
                Change::Down
            }
            (false, Some((_, last))) => {
                if (now - *last).to_std().unwrap_or_default() >= realert {
                    *last = now;
                    Change::Down
                } else {
                    Change::Nothing
                }
            }
        }
    }

    /// When `service` went down, if it is down.
    pub fn down_since(&self, service: &str) -> Option<chrono::DateTime<chrono::Utc>> {
        self.down.get(service).map(|(since, _)| *since)
    }
}

/// The fingerprint of the monitor's incidents for `service`: one open run per service outage.
pub fn fingerprint(service: &str) -> String {
    format!("monitor:{service}")
}

/// Published on `<prefix>.events.monitor.<service>.recovered`.
#[derive(Debug, Clone, Serialize)]
pub struct Recovery {
    pub service: String,
    pub down_since: Option<chrono::DateTime<chrono::Utc>>,
    pub recovered_at: chrono::DateTime<chrono::Utc>,
    pub detail: String,
}

/// Check every service once, concurrently; each check is bounded by its own timeout.
pub async fn check_all(
    services: &BTreeMap<String, ServiceSpec>,
    executor: &dyn Executor,
) -> Vec<(String, CheckOutcome)> {
    let checks = services.iter().filter_map(|(name, spec)| {
        let check = spec.check.as_ref()?;
        Some(async move {
            let started = Instant::now();
            let out = run_check(check, &spec.host, executor).await;
            CHECK_SECONDS.observe(&[name], started.elapsed().as_secs_f64());
            CHECKS.inc(&[name, if out.healthy { "up" } else { "down" }]);
            UP.set(&[name], if out.healthy { 1.0 } else { 0.0 });
            (name.clone(), out)
        })
    });
    join_all(checks).await
}

/// Run the monitor until `shutdown`: check, publish incidents and recoveries, sleep.
pub async fn run(
    bus: Bus,
    services: BTreeMap<String, ServiceSpec>,
    executor: Arc<dyn Executor>,
    every: Duration,
    realert: Duration,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut tracker = Tracker::default();
    tracing::info!(services = services.len(), every_ms = every.as_millis() as u64, "monitor running");
    loop {
        for (service, out) in check_all(&services, executor.as_ref()).await {
            let now = chrono::Utc::now();
            let since = tracker.down_since(&service);
            let change = tracker.observe(&service, out.healthy, now, realert);
            let (kind, sent) = match change {
                Change::Nothing => continue,
                Change::Down => {
                    ("incident", open(&bus, &service, &out, tracker.down_since(&service).unwrap_or(now)).await)
                }
                Change::Recovered => ("recovery", recovered(&bus, &service, &out, since).await),
            };
            PUBLISHED.inc(&[kind, if sent.is_ok() { "ok" } else { "failed" }]);
            if let Err(e) = sent {
                // Forget the transition so the next round tries again.
                tracing::warn!(service = %service, error = %e, "monitor publish failed");
                tracker = Tracker { down: tracker.down.into_iter().filter(|(s, _)| *s != service).collect() };
            }
        }
        let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        LAST_ROUND.set(&[], at.as_secs_f64());
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = &mut shutdown => return,
        }
    }
}

async fn open(
    bus: &Bus,
    service: &str,
    out: &CheckOutcome,
    since: chrono::DateTime<chrono::Utc>,
) -> Result<(), BusError> {
    let mut incident = Incident::new(service, out.detail.clone());
    incident.source = Some("monitor".into());
    incident.severity = Severity::Critical;
    incident.fingerprint = Some(fingerprint(service));
    incident.observed_at = Some(since);
    let id = incident.id.expect("new incidents have an id");
    tracing::warn!(service, detail = %out.detail, run = %id, "service down: incident opened");
    let payload = serde_json::to_vec(&incident).expect("incident serialises");
    bus.publish(bus.subjects.incidents_new(), &id.to_string(), JSON, Some(id), payload.into()).await
}

async fn recovered(
    bus: &Bus,
    service: &str,
    out: &CheckOutcome,
    since: Option<chrono::DateTime<chrono::Utc>>,
) -> Result<(), BusError> {
    let r = Recovery {
        service: service.into(),
        down_since: since,
        recovered_at: chrono::Utc::now(),
        detail: out.detail.clone(),
    };
    tracing::info!(service, "service recovered");
    let subject = format!("{}.events.monitor.{service}.recovered", bus.subjects.prefix());
    let id = format!("monitor.{service}.{}", r.recovered_at.timestamp_micros());
    bus.publish(subject, &id, JSON, None, serde_json::to_vec(&r).expect("recovery serialises").into()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_incident_per_outage_then_a_recovery() {
        let mut t = Tracker::default();
        let t0 = chrono::Utc::now();
        let s = |n: i64| t0 + chrono::Duration::seconds(n);
        let hour = Duration::from_secs(3600);
        assert_eq!(t.observe("web", true, s(0), hour), Change::Nothing);
        assert_eq!(t.observe("web", false, s(10), hour), Change::Down);
        assert_eq!(t.observe("web", false, s(20), hour), Change::Nothing, "still down: no second incident");
        assert_eq!(t.down_since("web"), Some(s(10)));
        assert_eq!(t.observe("web", false, s(3700), hour), Change::Down, "a reminder after realert");
        assert_eq!(t.observe("web", true, s(3710), hour), Change::Recovered);
        assert_eq!(t.observe("web", true, s(3720), hour), Change::Nothing);
        assert_eq!(t.down_since("web"), None);
    }
}
