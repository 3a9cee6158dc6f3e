//! Ingestion: pitcrew's own incident JSON and Alertmanager's webhook, each checked whole
//! before anything is published, and idempotent: an incident whose id was already received
//! is not published again, and JetStream drops a repeat within its duplicate window (the
//! message id is the incident id).

use crate::access::AuditRun;
use crate::alertmanager::{self, Action, Payload};
use crate::body::JsonBody;
use crate::error::{ApiError, Outcome};
use crate::Gateway;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use pitcrew_model::codec::JSON;
use pitcrew_model::{EventKind, Incident, RunEvent, Stage};
use pitcrew_runtime::store::IncidentSeen;
use serde_json::json;
use std::sync::Arc;
use uuid::Uuid;

/// Index of the "alert resolved at the source" event in its run's timeline: clear of the
/// stage events (and of live thinking events), so a re-sent resolution writes nothing twice.
pub const RESOLVED_EVENT_INDEX: u32 = 2_000_000;

/// The indexes after `RESOLVED_EVENT_INDEX` for the resolutions of alerts that joined a run
/// (one each, by the alert's id).
const JOINED_RESOLUTIONS: u32 = 1_000_000;

/// Whether the incident was published now or had been received before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    Published,
    Existing,
}

impl Received {
    fn as_str(self) -> &'static str {
        match self {
            Received::Published => "accepted",
            Received::Existing => "already_received",
        }
    }
}

/// Namespace of the ids of incidents opened again after the run they joined closed.
const REOPENED: Uuid = Uuid::from_u128(0x3c9e_51d2_7a4b_4f08_9e16_c2d7_0b5a_e413);

/// How many closed runs one incident may have joined in turn before it is no longer opened
/// again (an alert firing for days, flapping into open runs: each hop is one lookup).
const MAX_REOPENS: usize = 64;

/// Where an incident stands after following the ids it was opened again under.
struct Opening {
    id: Uuid,
    seen: IncidentSeen,
    /// The id before `id` in that chain, if `id` is not the incident's own.
    before: Option<Uuid>,
}

/// The id incident `id` is opened again under once the run it joined, `closed`, has closed.
fn reopened_id(id: Uuid, closed: Uuid) -> Uuid {
    Uuid::new_v5(&REOPENED, format!("{id}:{closed}").as_bytes())
}

impl Gateway {
    /// Publish a checked incident on `incidents.new` unless its id is already taken care of.
    /// One that joined a run since closed (`IncidentSeen::JoinedClosed`) is a fault that run
    /// did not end: it is published again as a new incident, under an id derived from its own
    /// and the closed run's (so sending it again names the same new run), and that id is
    /// answered. A new id, not the old one: the old one's timeline already ends in
    /// `duplicate`, which would end a watch of the new run and take its first event's key.
    ///
    /// An id received before for an incident of another fingerprint is a conflict: answered,
    /// not taken as the same incident sent again (the new one would be lost unsaid).
    pub async fn open(&self, incident: &Incident) -> Result<(Uuid, Received), ApiError> {
        let id = incident.id.ok_or_else(|| ApiError::BadRequest("incident has no id".into()))?;
        // Its fingerprint as intake stores it (a host that is the service's own counts as
        // none): the same incident sent again is the same fingerprint.
        let mut stored = incident.clone();
        pitcrew_intake::normalise(&mut stored, &self.cfg).map_err(|e| ApiError::Unprocessable(e.to_string()))?;
        let fingerprint = stored.effective_fingerprint();
        let now = self.opening(id, Some(&fingerprint)).await?;
        if now.seen == IncidentSeen::Another {
            return Err(ApiError::Conflict(format!(
                "incident id {id} was received before for another incident (another service, host or error): \
                 send this one under a new id, or without one"
            )));
        }
        if now.seen != IncidentSeen::New {
            if let IncidentSeen::JoinedClosed(_) = now.seen {
                tracing::warn!(incident = %id, "incident joined {MAX_REOPENS} runs that closed: not opened again");
            }
            return Ok((now.id, Received::Existing));
        }
        let mut incident = std::borrow::Cow::Borrowed(incident);
        if now.id != id {
            tracing::info!(incident = %id, again = %now.id, "the run this incident joined has closed: opening it again");
            incident.to_mut().id = Some(now.id);
        }
        self.bus.open_incident(&incident).await.map_err(|e| ApiError::unavailable("NATS", e))?;
        Ok((now.id, Received::Published))
    }

    /// Where incident `id` stands: followed through the ids it was opened again under (see
    /// [`Gateway::open`]) to the first one that is new or taken care of, with the one before
    /// it. After `MAX_REOPENS` closed runs: the next id, still `JoinedClosed`. With
    /// `fingerprint`, `Another` if `id` was received for an incident of another one.
    async fn opening(&self, id: Uuid, fingerprint: Option<&str>) -> Result<Opening, ApiError> {
        let (mut id, mut before) = (id, None);
        let mut seen = IncidentSeen::New;
        for _ in 0..MAX_REOPENS {
            seen = self.store.incident_seen(id, fingerprint).await?;
            let IncidentSeen::JoinedClosed(closed) = seen else { break };
            (id, before) = (reopened_id(id, closed), Some(id));
        }
        Ok(Opening { id, seen, before })
    }

    /// The last id `id` was opened again under, or `id` itself: where news of the alert (its
    /// resolution at the source) belongs; with whether that is another alert's run, which it
    /// joined while open.
    async fn latest_opening(&self, id: Uuid) -> Result<(Uuid, bool), ApiError> {
        let now = self.opening(id, None).await?;
        Ok(match (now.seen, now.before) {
            // Not opened again (yet) under the last id: the one before it is the latest.
            (IncidentSeen::New, Some(before)) => (before, false),
            // It joined a run still open: that run is the one remediating it.
            (IncidentSeen::JoinedOpen(run), _) => (run, true),
            _ => (now.id, false),
        })
    }

    fn check_service(&self, service: &str) -> Result<(), ApiError> {
        if self.cfg.services.contains_key(service) {
            return Ok(());
        }
        Err(ApiError::Unprocessable(format!(
            "unknown service '{}': add [services.{}] to the inventory",
            pitcrew_model::trim::clip(service, 64),
            pitcrew_model::trim::clip(service, 64)
        )))
    }
}

/// `POST /v1/incidents`: pitcrew's own incident JSON.
pub async fn post_incident(
    State(gw): State<Arc<Gateway>>,
    JsonBody(mut incident): JsonBody<Incident>,
) -> Result<Response, ApiError> {
    incident.validate().map_err(|e| ApiError::Unprocessable(e.to_string()))?;
    gw.check_service(&incident.service)?;
    incident.id.get_or_insert_with(Uuid::now_v7);
    incident.source.get_or_insert_with(|| "http".into());
    let (id, received) = gw.open(&incident).await?;
    let status = if received == Received::Published { StatusCode::ACCEPTED } else { StatusCode::OK };
    let mut resp = (status, Json(json!({ "run_id": id, "outcome": received.as_str() }))).into_response();
    resp.extensions_mut().insert(AuditRun(id));
    resp.extensions_mut().insert(Outcome(format!("incident {id} for {}: {}", incident.service, received.as_str())));
    Ok(resp)
}

/// `POST /v1/alerts/alertmanager`: Alertmanager's webhook (version 4).
pub async fn post_alertmanager(
    State(gw): State<Arc<Gateway>>,
    JsonBody(payload): JsonBody<Payload>,
) -> Result<Response, ApiError> {
    let known = |s: &str| gw.cfg.services.contains_key(s);
    let group = pitcrew_model::trim::clip(&payload.group_key, 120);
    let actions = alertmanager::actions(&payload, &gw.cfg.gateway, &known).map_err(ApiError::Unprocessable)?;
    if payload.truncated_alerts > 0 {
        // Alertmanager's max_alerts cut the group: those alerts never reach pitcrew.
        tracing::warn!(group = %group, truncated = payload.truncated_alerts, "alertmanager truncated alerts: pitcrew takes at most 1000 a notification; split the group (group_by) to see the rest");
    }
    let refusals: Vec<&alertmanager::Refused> = actions.iter().filter_map(|a| a.as_ref().err()).collect();
    for r in &refusals {
        tracing::warn!(group = %group, fingerprint = %r.fingerprint, error = %r.error, "alert refused");
    }
    if refusals.len() == actions.len() {
        // Nothing of it can be used: the sender's configuration is wrong, say so.
        let all: Vec<&str> = refusals.iter().map(|r| r.error.as_str()).collect();
        return Err(ApiError::Unprocessable(pitcrew_model::trim::clip(&all.join("; "), 2000)));
    }
    let mut results = Vec::with_capacity(actions.len());
    let (mut opened, mut resolved) = (0, 0);
    for action in &actions {
        let action = match action {
            Ok(action) => action,
            Err(r) => {
                results.push(json!({ "fingerprint": r.fingerprint, "outcome": "refused", "error": r.error }));
                continue;
            }
        };
        match action {
            Action::Fire(incident) => {
                let (id, received) = match gw.open(incident).await {
                    Ok(opened) => opened,
                    // This alert alone cannot be taken (its id names another incident): said
                    // in its result, and the rest of the group goes on (a 4xx would drop the
                    // whole group: Alertmanager does not send it again).
                    Err(ApiError::Conflict(why) | ApiError::Unprocessable(why)) => {
                        tracing::warn!(group = %group, fingerprint = %incident.fingerprint.as_deref().unwrap_or(""), error = %why, "alert refused");
                        results.push(json!({
                            "fingerprint": incident.fingerprint, "status": "firing", "outcome": "refused", "error": why
                        }));
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                opened += usize::from(received == Received::Published);
                results.push(json!({
                    "fingerprint": incident.fingerprint, "status": "firing", "run_id": id, "outcome": received.as_str()
                }));
            }
            Action::Resolve { run, fingerprint, ends_at } => {
                let outcome = gw.record_resolved(*run, fingerprint, *ends_at).await?;
                resolved += usize::from(outcome == "recorded");
                results.push(json!({
                    "fingerprint": format!("am-{fingerprint}"), "status": "resolved", "run_id": run, "outcome": outcome
                }));
            }
        }
    }
    let note = format!(
        "alertmanager group {group} ({} alerts): {opened} incident(s) published, {resolved} resolution(s) recorded, {} refused",
        actions.len(),
        refusals.len()
    );
    let mut resp = (StatusCode::OK, Json(json!({ "alerts": results }))).into_response();
    if let [Ok(Action::Fire(Incident { id: Some(id), .. }) | Action::Resolve { run: id, .. })] = actions.as_slice() {
        resp.extensions_mut().insert(AuditRun(*id));
    }
    resp.extensions_mut().insert(Outcome(note));
    Ok(resp)
}

impl Gateway {
    /// Record on a run that its alert resolved at the source: a `status` event, stored and
    /// published with a fixed key so a repeat writes nothing twice. Returns `recorded`, or
    /// `no_run` when no incident has this id (the firing alert was never received).
    async fn record_resolved(
        &self,
        run: Uuid,
        fingerprint: &str,
        ends_at: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<&'static str, ApiError> {
        if !self.store.incident_exists(run).await? {
            return Ok("no_run");
        }
        let alert = run;
        let (run, joined) = self.latest_opening(run).await?;
        // Its own run's resolution has its own place in that timeline; a joined run's has one
        // per alert that joined it (the run's own alert may resolve too: both are news).
        let index = match joined {
            false => RESOLVED_EVENT_INDEX,
            true => RESOLVED_EVENT_INDEX + 1 + (alert.as_u128() % JOINED_RESOLUTIONS as u128) as u32,
        };
        let ended = ends_at.map(|t| t.to_rfc3339()).unwrap_or_else(|| "-".into());
        let event = RunEvent {
            run_id: run,
            seq: 0,
            index,
            stage: Stage::Intake,
            kind: EventKind::Status,
            message: format!("alert resolved at the source (alertmanager, ended {ended})"),
            data: json!({ "alert": "resolved", "source": "alertmanager", "fingerprint": format!("am-{fingerprint}"), "ends_at": ends_at }),
            worker: self.worker.clone(),
            at: chrono::Utc::now(),
        };
        self.store.insert_events(std::slice::from_ref(&event)).await?;
        let payload = serde_json::to_vec(&event).map_err(|e| ApiError::unavailable("encoding", e))?;
        self.bus
            .publish(
                self.bus.subjects.event(run, event.kind.as_str()),
                &event.msg_id(),
                JSON,
                Some(run),
                payload.into(),
            )
            .await
            .map_err(|e| ApiError::unavailable("NATS", e))?;
        Ok("recorded")
    }
}
