//! monitor: checks every configured service on an interval (concurrently, each bounded by
//! its timeout), opens an incident on `pitcrew.incidents.new` when one fails — with a
//! fingerprint, so a service that stays down never opens a second run while one is open —
//! and publishes a recovery event when it answers again.

use futures::future::join_all;
use futures::StreamExt;
use pitcrew_exec::{run_check, CheckOutcome, Executor};
use pitcrew_metrics::{Counter, Gauge, Histogram, LATENCY_BUCKETS};
use pitcrew_model::codec::JSON;
use pitcrew_model::{EventKind, Incident, ServiceSpec, Severity};
use pitcrew_runtime::{Bus, BusError};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

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

/// Per-service memory of the last result. A change is only remembered as reported once its
/// message is on the bus ([`Tracker::reported`]): one that could not be published is seen,
/// and published, again the next round, a recovery included.
#[derive(Debug, Default, Clone)]
pub struct Tracker {
    /// Failed checks in a row before a service reads as down (0 reads as 1).
    threshold: u32,
    /// Services failing but not yet down: how many checks in a row, since when.
    failing: HashMap<String, (u32, chrono::DateTime<chrono::Utc>)>,
    /// Services currently down.
    down: HashMap<String, Outage>,
    /// When each service was last reported at once after its run resolved (a relapse).
    relapsed: HashMap<String, chrono::DateTime<chrono::Utc>>,
    /// When each service's last two outages were first reported, newest last: kept across
    /// recoveries, so a service that keeps coming back up and failing (a crash loop a
    /// restart fixes for a while) is not given a run every time.
    opened: HashMap<String, [Option<chrono::DateTime<chrono::Utc>>; 2]>,
    /// Services whose check the monitor cannot run now (said once, until it runs again).
    unsure: std::collections::HashSet<String>,
}

#[derive(Debug, Clone)]
struct Outage {
    since: chrono::DateTime<chrono::Utc>,
    /// When its incident was last published.
    reported: Option<chrono::DateTime<chrono::Utc>>,
    /// The incidents published for it (the run the first opened, reminders: duplicates of it
    /// or runs of their own once it closed), newest last, at most `RUNS_KEPT`: the first and
    /// the latest reminders.
    runs: Vec<Uuid>,
    /// The id its next incident goes out under, kept across failed tries: a publish that
    /// reached the bus after all (its ack lost in an outage, or queued in the client until
    /// NATS came back) and its retry are then one incident, not a run and its duplicates.
    next: Uuid,
}

/// Incidents of one outage whose runs are looked at for a resolution (one a `realert`).
const RUNS_KEPT: usize = 4;

impl Outage {
    fn new(since: chrono::DateTime<chrono::Utc>) -> Outage {
        Outage { since, reported: None, runs: Vec::new(), next: Uuid::now_v7() }
    }
}

impl Tracker {
    /// A tracker that takes a service for down after `threshold` failed checks in a row: one
    /// lost SSH connection or slow answer must not open an incident (and a remediation).
    pub fn new(threshold: u32) -> Tracker {
        Tracker { threshold, ..Default::default() }
    }

    /// Fold one check result in: what should be published. A service still down is reported
    /// again after `realert` (intake deduplicates by fingerprint while its run is open).
    pub fn observe(
        &mut self,
        service: &str,
        healthy: bool,
        now: chrono::DateTime<chrono::Utc>,
        realert: Duration,
    ) -> Change {
        if healthy {
            self.failing.remove(service);
        }
        match (healthy, self.down.get(service)) {
            (true, None) => Change::Nothing,
            (true, Some(_)) => Change::Recovered,
            (false, None) => {
                let (count, first) = self.failing.entry(service.to_string()).or_insert((0, now));
                *count += 1;
                if *count < self.threshold.max(1) {
                    return Change::Nothing;
                }
                // Down since its first failed check of the row.
                let since = *first;
                self.failing.remove(service);
                let mut outage = Outage::new(since);
                // Its third outage within `realert` (it came back up in between, for a while):
                // flapping. Tracked as reported with the last one, reminded after `realert`
                // from it like any outage that goes on, not given a run each time.
                let recent = |at: &Option<chrono::DateTime<chrono::Utc>>| {
                    at.is_some_and(|at| (now - at).to_std().unwrap_or_default() < realert)
                };
                // A relapse (down again as its run resolved, never seen healthy: see `relapsed`)
                // has its own limit, once per `realert`.
                let relapse = self.relapsed.get(service) == Some(&since);
                if let Some([older, Some(last)]) =
                    self.opened.get(service).filter(|[older, _]| !relapse && recent(older))
                {
                    tracing::warn!(
                        service,
                        outages_since = %older.map(|o| o.to_rfc3339()).unwrap_or_default(),
                        "down a third time within realert: flapping; reported again once realert has passed since its last incident, not now"
                    );
                    outage.reported = Some(*last);
                    self.down.insert(service.to_string(), outage);
                    return Change::Nothing;
                }
                self.down.insert(service.to_string(), outage);
                Change::Down
            }
            (false, Some(Outage { reported: None, .. })) => Change::Down,
            (false, Some(Outage { reported: Some(last), .. })) => {
                if (now - *last).to_std().unwrap_or_default() >= realert {
                    Change::Down
                } else {
                    Change::Nothing
                }
            }
        }
    }

    /// Take up an outage an earlier monitor reported (`Reported`) and saw no recovery of: down
    /// since then, reported then, its run the one to look at for a resolution. A monitor
    /// restarted mid-outage then reminds after `realert` as if it had run throughout, instead
    /// of opening a run for an outage whose run escalated (people's now) at once.
    pub fn resume(&mut self, r: &Reported) {
        let mut outage = Outage::new(r.down_since);
        outage.reported = Some(r.reported_at);
        outage.runs.push(r.run);
        self.down.insert(r.service.clone(), outage);
    }

    /// The id the incident `service`'s outage is reported under now (the same on every try
    /// until one is published), if it is down.
    pub fn incident_id(&self, service: &str) -> Option<Uuid> {
        self.down.get(service).map(|o| o.next)
    }

    /// `change` of `service` was published at `now`.
    pub fn reported(&mut self, service: &str, change: &Change, now: chrono::DateTime<chrono::Utc>) {
        match change {
            Change::Nothing => {}
            Change::Down => {
                if let Some(outage) = self.down.get_mut(service) {
                    if outage.reported.is_none() {
                        let opened = self.opened.entry(service.to_string()).or_default();
                        *opened = [opened[1], Some(now)];
                    }
                    outage.reported = Some(now);
                    outage.runs.push(outage.next);
                    // The first run is kept (while it is open, every reminder joins it as a
                    // duplicate that never resolves); the oldest reminder goes.
                    if outage.runs.len() > RUNS_KEPT {
                        outage.runs.remove(1);
                    }
                    outage.next = Uuid::now_v7();
                }
            }
            Change::Recovered => {
                self.down.remove(service);
            }
        }
    }

    /// When `service` went down, if it is down.
    pub fn down_since(&self, service: &str) -> Option<chrono::DateTime<chrono::Utc>> {
        self.down.get(service).map(|o| o.since)
    }

    /// The incidents published for `service`'s outage (their runs), newest last.
    pub fn runs_of(&self, service: &str) -> &[Uuid] {
        self.down.get(service).map_or(&[], |o| o.runs.as_slice())
    }

    /// `service` is down again after the run of its outage resolved it (between two rounds,
    /// so the monitor never saw it healthy): a new outage, reported now rather than after
    /// `realert`. Once per `realert` only: a service that keeps failing right after each fix
    /// (a crash loop the fix only restarts) gets a run an hour, not one a round.
    pub fn relapsed(&mut self, service: &str, now: chrono::DateTime<chrono::Utc>, realert: Duration) -> Change {
        if let Some(last) = self.relapsed.get(service) {
            if (now - *last).to_std().unwrap_or_default() < realert {
                return Change::Nothing;
            }
        }
        self.relapsed.insert(service.to_string(), now);
        if self.threshold > 1 {
            // A new outage like any other: down once the checks in a row the threshold asks
            // have failed, this one the first (one lost connection right after a fix opens
            // nothing either).
            self.down.remove(service);
            self.failing.insert(service.to_string(), (1, now));
            return Change::Nothing;
        }
        self.down.insert(service.to_string(), Outage::new(now));
        Change::Down
    }
}

/// The last event of `kind` the bus holds for `run`. Any failure to ask (bounded:
/// `Bus::last_on`) reads as none: an outage is then reported again after `realert`, as before.
async fn last_event(bus: &Bus, run: Uuid, kind: EventKind) -> Option<pitcrew_runtime::bus::StreamMessage> {
    let subject = bus.subjects.event(run, kind.as_str());
    match bus.last_on(&bus.subjects.events_stream(), &subject).await {
        Ok(msg) => msg,
        Err(e) => {
            tracing::debug!(run = %run, kind = kind.as_str(), error = %e, "cannot ask the bus for the run's event");
            None
        }
    }
}

/// When `run` ended resolved (its `resolved` event is on the bus), if it did.
async fn resolved_at(bus: &Bus, run: Uuid) -> Option<chrono::DateTime<chrono::Utc>> {
    let msg = last_event(bus, run, EventKind::Resolved).await?;
    chrono::DateTime::from_timestamp(msg.time.unix_timestamp(), msg.time.nanosecond())
}

/// The run incident `run` joined, when intake found it a duplicate of one still open (its
/// `duplicate` event names it).
async fn joined(bus: &Bus, run: Uuid) -> Option<Uuid> {
    let msg = last_event(bus, run, EventKind::Duplicate).await?;
    let event: pitcrew_model::RunEvent = serde_json::from_slice(&msg.payload).ok()?;
    event.data["run"].as_str()?.parse().ok()
}

/// The fingerprint of the monitor's incidents for `service`: one open run per service outage.
/// Within the 128 bytes an incident's fingerprint may have: a name too long for the prefix
/// (121-128 characters) keeps its head and a digest of the whole (intake refused every one of
/// its incidents before, so its outage was never remediated).
pub fn fingerprint(service: &str) -> String {
    const PREFIX: &str = "monitor:";
    if PREFIX.len() + service.len() <= pitcrew_model::incident::MAX_NAME_LEN {
        return format!("{PREFIX}{service}");
    }
    let digest = Uuid::new_v5(&Uuid::NAMESPACE_OID, service.as_bytes()).simple().to_string();
    let mut head = pitcrew_model::incident::MAX_NAME_LEN - PREFIX.len() - 1 - digest.len();
    while !service.is_char_boundary(head) {
        head -= 1;
    }
    format!("{PREFIX}{}~{digest}", &service[..head])
}

/// Published on `<prefix>.events.monitor.<service>.down` with each incident the monitor opens:
/// what a monitor started later takes the outage up from (`Tracker::resume`).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct Reported {
    pub service: String,
    /// The incident's id: its run's, unless it joined an open one.
    pub run: Uuid,
    pub down_since: chrono::DateTime<chrono::Utc>,
    pub reported_at: chrono::DateTime<chrono::Utc>,
}

fn monitor_subject(bus: &Bus, service: &str, what: &str) -> String {
    format!("{}.events.monitor.{service}.{what}", bus.subjects.prefix())
}

/// The outage of `service` an earlier monitor reported last, unless it saw it recover after.
/// Any failure to ask (bounded: `Bus::last_on`) reads as none: the outage is reported anew.
async fn reported_earlier(bus: &Bus, service: &str) -> Option<Reported> {
    let stream = bus.subjects.events_stream();
    let last = |what: &'static str| {
        let subject = monitor_subject(bus, service, what);
        let stream = stream.clone();
        async move {
            bus.last_on(&stream, &subject).await.unwrap_or_else(|e| {
                tracing::warn!(service, error = %e, "cannot read what an earlier monitor reported");
                None
            })
        }
    };
    let (down, recovered) = futures::join!(last("down"), last("recovered"));
    let down = down?;
    if recovered.is_some_and(|r| r.sequence > down.sequence) {
        return None;
    }
    serde_json::from_slice(&down.payload).ok()
}

/// Published on `<prefix>.events.monitor.<service>.recovered`.
#[derive(Debug, Clone, Serialize)]
pub struct Recovery {
    pub service: String,
    pub down_since: Option<chrono::DateTime<chrono::Utc>>,
    pub recovered_at: chrono::DateTime<chrono::Utc>,
    pub detail: String,
}

/// Whether the check's command did not run (or may not have) for a reason other than its
/// host: a host that does not answer is an outage to report.
fn not_run(out: &CheckOutcome) -> bool {
    matches!(out.inconclusive, Some(pitcrew_exec::Inconclusive::NotRun))
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
            if not_run(&out) {
                // Nothing is known of the service: neither up nor down (NaN, not the last
                // answer kept: a service up before must not read as up while unknown).
                CHECKS.inc(&[name, "unknown"]);
                UP.set(&[name], f64::NAN);
            } else {
                CHECKS.inc(&[name, if out.healthy { "up" } else { "down" }]);
                UP.set(&[name], if out.healthy { 1.0 } else { 0.0 });
            }
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
    threshold: u32,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut tracker = Tracker::new(threshold);
    let earlier: Vec<Option<Reported>> = futures::stream::iter(services.keys().cloned().map(|service| {
        let bus = bus.clone();
        async move { reported_earlier(&bus, &service).await }
    }))
    .buffer_unordered(16)
    .collect()
    .await;
    for r in earlier.into_iter().flatten() {
        tracing::info!(service = %r.service, run = %r.run, down_since = %r.down_since, "taking up an outage reported before this start");
        tracker.resume(&r);
    }
    tracing::info!(services = services.len(), every_ms = every.as_millis() as u64, "monitor running");
    loop {
        // A round is raced with shutdown: its checks and publishes may each take seconds while
        // NATS is down. One left half-done is done again by the next start, under a new
        // incident id (the tracker is in memory): a publish of this one that landed after all
        // makes that one a duplicate of its run.
        tokio::select! {
            _ = one_round(&bus, &services, executor.as_ref(), &mut tracker, realert) => {}
            _ = &mut shutdown => return,
        }
        let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        LAST_ROUND.set(&[], at.as_secs_f64());
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = &mut shutdown => return,
        }
    }
}

/// Check every service once and publish what changed.
async fn one_round(
    bus: &Bus,
    services: &BTreeMap<String, ServiceSpec>,
    executor: &dyn Executor,
    tracker: &mut Tracker,
    realert: Duration,
) {
    let round = chrono::Utc::now();
    for (service, out) in check_all(services, executor).await {
        // A check the monitor could not run (a secret it lacks, its program missing, a failed
        // channel) tells nothing of the service: an incident would have the crew remediate a
        // service perhaps healthy. Said once, until it runs again; the count of failed checks
        // in a row goes on from where it was.
        if not_run(&out) {
            if tracker.unsure.insert(service.clone()) {
                tracing::warn!(service = %service, detail = %out.detail, "cannot run the service's check: reporting nothing of it until it runs");
            }
            continue;
        }
        if tracker.unsure.remove(&service) {
            tracing::info!(service = %service, "the service's check runs again");
        }
        let now = chrono::Utc::now();
        let mut change = tracker.observe(&service, out.healthy, now, realert);
        if change == Change::Nothing && !out.healthy {
            // Reported recently: unless a run of the outage has resolved meanwhile (a run that
            // escalated is people's now, reminded of after `realert`), before this round's
            // check began (one that began earlier may have seen the fix at work).
            for run in tracker.runs_of(&service).to_vec().into_iter().rev() {
                // An incident that joined another open run as a duplicate never resolves
                // itself: the run it joined is the outage's.
                let run = joined(bus, run).await.unwrap_or(run);
                if resolved_at(bus, run).await.is_some_and(|at| at < round) {
                    change = tracker.relapsed(&service, now, realert);
                    if change == Change::Down {
                        tracing::warn!(service = %service, run = %run, "service down again after its run resolved");
                    }
                    break;
                }
            }
        }
        let since = tracker.down_since(&service);
        let (kind, sent) = match change {
            Change::Nothing => continue,
            Change::Down => {
                let id = tracker.incident_id(&service).unwrap_or_else(Uuid::now_v7);
                ("incident", open(bus, &service, &out, since.unwrap_or(now), id).await)
            }
            Change::Recovered => ("recovery", recovered(bus, &service, &out, since).await),
        };
        PUBLISHED.inc(&[kind, if sent.is_ok() { "ok" } else { "failed" }]);
        match sent {
            Ok(()) => tracker.reported(&service, &change, now),
            // Not remembered as reported: the next round publishes it again.
            Err(e) => tracing::warn!(service = %service, error = %e, "monitor publish failed: retrying next round"),
        }
    }
}

async fn open(
    bus: &Bus,
    service: &str,
    out: &CheckOutcome,
    since: chrono::DateTime<chrono::Utc>,
    id: Uuid,
) -> Result<(), BusError> {
    let mut incident = Incident::new(service, out.detail.clone());
    incident.id = Some(id);
    incident.source = Some("monitor".into());
    incident.severity = Severity::Critical;
    incident.fingerprint = Some(fingerprint(service));
    incident.observed_at = Some(since);
    bus.open_incident(&incident).await?;
    tracing::warn!(service, detail = %out.detail, run = %id, "service down: incident opened");
    // For a monitor started later. Not kept, that one reports the outage anew.
    let r = Reported { service: service.into(), run: id, down_since: since, reported_at: chrono::Utc::now() };
    let payload = serde_json::to_vec(&r).expect("a report serialises");
    let msg_id = format!("monitor.{service}.{id}.down");
    if let Err(e) = bus.publish(monitor_subject(bus, service, "down"), &msg_id, JSON, None, payload.into()).await {
        tracing::warn!(service, error = %e, "cannot record the incident for a later monitor to take up");
    }
    Ok(())
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
    let subject = monitor_subject(bus, service, "recovered");
    let id = format!("monitor.{service}.{}", r.recovered_at.timestamp_micros());
    bus.publish(subject, &id, JSON, None, serde_json::to_vec(&r).expect("recovery serialises").into()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fingerprint_fits_an_incident_whatever_the_service_name() {
        let fits = |service: &str| {
            let mut incident = Incident::new(service, "connection refused");
            incident.fingerprint = Some(fingerprint(service));
            incident.validate()
        };
        assert_eq!(fingerprint("web"), "monitor:web");
        let longest = "a".repeat(pitcrew_model::incident::MAX_NAME_LEN);
        assert!(pitcrew_model::incident::valid_service_name(&longest));
        for len in [120, 121, 127, 128] {
            let name = &longest[..len];
            assert!(fits(name).is_ok(), "{len}: {:?}", fits(name));
        }
        assert_eq!(fingerprint(&longest[..120]), format!("monitor:{}", &longest[..120]), "120 fit as they are");
        // Names alike but for their tail stay apart.
        let other = format!("{}b", &longest[..127]);
        assert_ne!(fingerprint(&longest), fingerprint(&other));
        assert_eq!(fingerprint(&longest), fingerprint(&longest.clone()), "the same name, the same outage");
    }

    const HOUR: Duration = Duration::from_secs(3600);

    /// Observe `web` and publish at once, as a round does when the bus takes every message
    /// (`realert` an hour).
    fn round(t: &mut Tracker, healthy: bool, at: chrono::DateTime<chrono::Utc>) -> Change {
        let change = t.observe("web", healthy, at, HOUR);
        t.reported("web", &change, at);
        change
    }

    #[test]
    fn one_incident_per_outage_then_a_recovery() {
        let mut t = Tracker::default();
        let t0 = chrono::Utc::now();
        let s = |n: i64| t0 + chrono::Duration::seconds(n);
        assert_eq!(round(&mut t, true, s(0)), Change::Nothing);
        assert_eq!(round(&mut t, false, s(10)), Change::Down);
        assert_eq!(round(&mut t, false, s(20)), Change::Nothing, "still down: no second incident");
        assert_eq!(t.down_since("web"), Some(s(10)));
        assert_eq!(round(&mut t, false, s(3700)), Change::Down, "a reminder after realert");
        assert_eq!(t.down_since("web"), Some(s(10)), "a reminder keeps the outage's start");
        assert_eq!(round(&mut t, true, s(3710)), Change::Recovered);
        assert_eq!(round(&mut t, true, s(3720)), Change::Nothing);
        assert_eq!(t.down_since("web"), None);
    }

    #[test]
    fn a_service_is_down_only_after_failing_the_checks_in_a_row_the_threshold_asks() {
        let mut t = Tracker::new(2);
        let t0 = chrono::Utc::now();
        let s = |n: i64| t0 + chrono::Duration::seconds(n);
        let hour = Duration::from_secs(3600);
        // One failed check (a lost connection), then healthy again: nothing to report.
        assert_eq!(t.observe("web", false, s(0), hour), Change::Nothing);
        assert_eq!(t.observe("web", true, s(10), hour), Change::Nothing);
        // A healthy check in between starts the count again.
        assert_eq!(t.observe("web", false, s(20), hour), Change::Nothing);
        assert_eq!(t.down_since("web"), None);
        assert_eq!(t.observe("web", false, s(30), hour), Change::Down);
        assert_eq!(t.down_since("web"), Some(s(20)), "down since the first failed check of the row");
        t.reported("web", &Change::Down, s(30));
        // Its run resolved, and one check fails right after: a relapse, once the threshold's
        // checks in a row have failed, not on the first.
        assert_eq!(t.observe("web", false, s(40), hour), Change::Nothing, "reported recently");
        assert_eq!(t.relapsed("web", s(40), hour), Change::Nothing);
        assert_eq!(t.observe("web", true, s(50), hour), Change::Nothing, "one lost connection: nothing to report");
        assert_eq!(t.observe("web", false, s(60), hour), Change::Nothing);
        assert_eq!(t.observe("web", false, s(70), hour), Change::Down);
        assert_eq!(t.down_since("web"), Some(s(60)));
    }

    /// A crash loop a restart fixes for a while: the service is seen healthy between its
    /// outages, so each is a new one. Two within `realert` get a run each; a third is
    /// flapping, reminded an hour after the last incident, not given a run every cycle.
    #[test]
    fn a_flapping_service_gets_no_run_every_cycle() {
        let mut t = Tracker::default();
        let t0 = chrono::Utc::now();
        let s = |n: i64| t0 + chrono::Duration::seconds(n);
        assert_eq!(round(&mut t, false, s(0)), Change::Down);
        assert_eq!(round(&mut t, true, s(60)), Change::Recovered);
        assert_eq!(round(&mut t, false, s(180)), Change::Down, "a second outage gets its run");
        assert_eq!(round(&mut t, true, s(240)), Change::Recovered);
        assert_eq!(round(&mut t, false, s(360)), Change::Nothing, "a third within the hour: flapping");
        assert_eq!(t.down_since("web"), Some(s(360)), "still seen down");
        assert_eq!(round(&mut t, false, s(390)), Change::Nothing);
        assert_eq!(round(&mut t, false, s(3780)), Change::Down, "reminded an hour after the last incident");
        // Recovered at last, and down an hour after the first two: a run at once again.
        assert_eq!(round(&mut t, true, s(3800)), Change::Recovered);
        assert_eq!(round(&mut t, false, s(7400)), Change::Down);
    }

    #[test]
    fn a_relapse_is_reported_at_once_only_once_per_realert() {
        let mut t = Tracker::default();
        let t0 = chrono::Utc::now();
        let s = |n: i64| t0 + chrono::Duration::seconds(n);
        let hour = Duration::from_secs(3600);
        assert_eq!(t.observe("web", false, s(0), hour), Change::Down);
        let first = t.incident_id("web");
        t.reported("web", &Change::Down, s(0));
        assert_eq!(t.runs_of("web"), first.as_slice());
        // Its run resolved, yet the next round sees it down: a new outage, at once.
        assert_eq!(t.relapsed("web", s(30), hour), Change::Down);
        assert_eq!(t.down_since("web"), Some(s(30)));
        let second = t.incident_id("web");
        assert_ne!(second, first, "a new outage, a new incident");
        t.reported("web", &Change::Down, s(30));
        assert_eq!(t.runs_of("web"), second.as_slice(), "the new outage's run alone");
        // And again right after the next fix: a crash loop. Not a run a round: after realert.
        assert_eq!(t.relapsed("web", s(60), hour), Change::Nothing);
        assert_eq!(t.observe("web", false, s(90), hour), Change::Nothing);
        assert_eq!(t.relapsed("web", s(3631), hour), Change::Down, "an hour after the last relapse");
    }

    #[test]
    fn a_change_that_could_not_be_published_is_published_the_next_round() {
        let mut t = Tracker::default();
        let t0 = chrono::Utc::now();
        let s = |n: i64| t0 + chrono::Duration::seconds(n);
        let hour = Duration::from_secs(3600);
        // The outage's incident fails to publish: the next round reports it again, with the
        // outage's start unchanged; once published, it is not repeated.
        assert_eq!(t.observe("web", false, s(10), hour), Change::Down);
        let id = t.incident_id("web");
        assert_eq!(t.observe("web", false, s(20), hour), Change::Down, "not published yet");
        assert_eq!(t.incident_id("web"), id, "a retry is the same incident: a copy that landed after all dedupes");
        assert_eq!(t.down_since("web"), Some(s(10)));
        t.reported("web", &Change::Down, s(20));
        assert_eq!(t.runs_of("web"), id.as_slice());
        assert_ne!(t.incident_id("web"), id, "a reminder is an incident of its own");
        assert_eq!(t.observe("web", false, s(30), hour), Change::Nothing);
        // The recovery fails to publish: it is reported again, with when the outage began,
        // until the bus takes it.
        assert_eq!(t.observe("web", true, s(40), hour), Change::Recovered);
        assert_eq!(t.observe("web", true, s(50), hour), Change::Recovered, "a lost recovery is not forgotten");
        assert_eq!(t.down_since("web"), Some(s(10)));
        t.reported("web", &Change::Recovered, s(50));
        assert_eq!(t.observe("web", true, s(60), hour), Change::Nothing);
        assert_eq!(t.down_since("web"), None);
    }

    #[test]
    fn the_first_run_is_remembered_with_the_latest_reminders() {
        let mut t = Tracker::default();
        let t0 = chrono::Utc::now();
        let s = |n: i64| t0 + chrono::Duration::seconds(n);
        let hour = Duration::from_secs(3600);
        let mut published = Vec::new();
        for k in 0..6 {
            assert_eq!(t.observe("web", false, s(k * 3600), hour), Change::Down);
            published.extend(t.incident_id("web"));
            t.reported("web", &Change::Down, s(k * 3600));
        }
        let kept: Vec<Uuid> =
            std::iter::once(published[0]).chain(published[6 - RUNS_KEPT + 1..].iter().copied()).collect();
        assert_eq!(t.runs_of("web"), kept, "the first and the newest reminders, {RUNS_KEPT} in all");
    }
}
