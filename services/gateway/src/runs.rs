//! The run API: list and filter runs, a run's full record, pending approvals, approve and
//! deny (the key's owner decides, through the same `approvals::submit` as every channel),
//! and questions (investigation mode, not built yet: 501).

use crate::access::{AuditRun, Caller};
use crate::body::{bad_query, parse, RawJson, RunPath};
use crate::error::{ApiError, Outcome};
use crate::Gateway;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use pitcrew_model::Decision;
use pitcrew_runtime::approvals::{self, DecideError, DecisionInput};
use pitcrew_runtime::store::RunFilter;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// Most runs or approvals one request lists.
pub const MAX_LIST: i64 = 500;

const STATUSES: &[&str] = &["open", "waiting_approval", "resolved", "escalated"];

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunsQuery {
    status: Option<String>,
    service: Option<String>,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    limit: Option<i64>,
}

fn limit(l: Option<i64>) -> Result<i64, ApiError> {
    match l.unwrap_or(50) {
        l @ 1..=MAX_LIST => Ok(l),
        l => Err(ApiError::BadRequest(format!("limit {l} is out of range: 1-{MAX_LIST}"))),
    }
}

/// `GET /v1/runs?status=&service=&since=&until=&limit=`
pub async fn list(
    State(gw): State<Arc<Gateway>>,
    q: Result<Query<RunsQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Query(q) = q.map_err(bad_query)?;
    if let Some(s) = &q.status {
        if !STATUSES.contains(&s.as_str()) {
            return Err(ApiError::BadRequest(format!("status '{s}' is not one of {STATUSES:?}")));
        }
    }
    // Bad values are the caller's, answered 400 here, not a failed query answered 503.
    if let Some(service) = &q.service {
        if !pitcrew_model::incident::valid_service_name(service) {
            return Err(ApiError::BadRequest(format!(
                "service '{}' is not a service name: 1-{} characters of [A-Za-z0-9._-]",
                pitcrew_model::trim::printable(&pitcrew_model::trim::clip(service, 64)),
                pitcrew_model::incident::MAX_NAME_LEN
            )));
        }
    }
    for (name, at) in [("since", q.since), ("until", q.until)] {
        if let Some(at) = at {
            if !pitcrew_model::incident::storable_time(&at) {
                return Err(ApiError::BadRequest(format!(
                    "{name} '{}' is out of range: it must fall in the years 1-9999",
                    at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
                )));
            }
        }
    }
    let filter =
        RunFilter { status: q.status, service: q.service, since: q.since, until: q.until, limit: limit(q.limit)? };
    let runs = gw.store.list_runs(&filter).await?;
    let runs: Vec<Value> = runs
        .into_iter()
        .map(|r| {
            json!({
                "id": r.id, "service": r.service, "error": r.error, "status": r.status, "stage": r.stage,
                "attempt": r.attempt, "reason": r.reason, "created_at": r.created_at, "updated_at": r.updated_at,
            })
        })
        .collect();
    Ok(Json(json!({ "runs": runs })))
}

/// `GET /v1/runs/{id}`: incident, state, timeline, evaluations, approvals, executions, report.
pub async fn get(State(gw): State<Arc<Gateway>>, RunPath(run): RunPath) -> Result<Json<Value>, ApiError> {
    let Some(stored) = gw.store.load_run(run).await? else {
        let why = if gw.store.incident_exists(run).await? {
            "the incident was received but has no run of its own (a duplicate of an open run, or not opened yet)"
        } else {
            "no incident with this id"
        };
        return Err(ApiError::NotFound(format!("unknown run {run}: {why}")));
    };
    let times = gw.store.run_times(run).await?;
    let timeline = gw.store.timeline(run).await?;
    let evaluations = gw.store.evaluations_of(run).await?;
    let approvals: Vec<Value> = gw
        .store
        .approvals_of(run)
        .await?
        .into_iter()
        .map(|a| {
            json!({
                "plan_hash": a.plan_hash, "rule": a.rule, "commands": a.commands, "requested_at": a.requested_at,
                "decision": a.decision, "by": a.by, "channel": a.channel, "decided_at": a.decided_at, "reason": a.reason,
            })
        })
        .collect();
    let executions = gw.store.execution_rows(run).await?;
    let released_claims = gw.store.released_claims(run).await?;
    let report = timeline
        .iter()
        .rev()
        .find(|e| e.kind.is_terminal())
        .map(|e| json!({ "outcome": e.kind.as_str(), "summary": e.message, "details": e.data, "at": e.at }));
    Ok(Json(json!({
        "id": run,
        "status": stored.status.as_str(),
        "stage": stored.state.step.as_str(),
        "attempt": stored.state.attempt,
        "reason": stored.reason,
        "created_at": times.map(|t| t.0),
        "updated_at": times.map(|t| t.1),
        "finished_at": times.and_then(|t| t.2),
        "incident": stored.state.incident,
        "state": stored.state,
        "timeline": timeline,
        "evaluations": evaluations,
        "approvals": approvals,
        "executions": executions,
        "released_claims": released_claims,
        "report": report,
    })))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitQuery {
    limit: Option<i64>,
}

/// `GET /v1/approvals`: pending approvals, oldest first.
pub async fn pending(
    State(gw): State<Arc<Gateway>>,
    q: Result<Query<LimitQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Query(q) = q.map_err(bad_query)?;
    let pending = gw.store.pending_approvals(false, limit(q.limit)?).await?;
    let list: Vec<Value> = pending
        .into_iter()
        .map(|p| {
            json!({
                "run_id": p.run_id, "plan_hash": p.plan_hash, "attempt": p.attempt, "rule": p.rule, "commands": p.commands,
                "requested_at": p.requested_at, "expires_at": p.expires_at,
            })
        })
        .collect();
    Ok(Json(json!({ "approvals": list })))
}

/// The body of approve and deny; every field optional for approve, `reason` required to deny.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionBody {
    /// The plan the decider saw: refused (409) when the run now waits on another.
    plan_hash: Option<String>,
    /// The attempt whose request the decider saw: refused (409) when the run now asks again
    /// for a later one, the same plan included (its earlier run did not fix the service).
    attempt: Option<u32>,
    reason: Option<String>,
}

/// `POST /v1/runs/{id}/approve`
pub async fn approve(
    gw: State<Arc<Gateway>>,
    caller: Extension<Caller>,
    run: RunPath,
    body: RawJson,
) -> Result<Response, ApiError> {
    decide(gw, caller, run, body, Decision::Approve).await
}

/// `POST /v1/runs/{id}/deny`
pub async fn deny(
    gw: State<Arc<Gateway>>,
    caller: Extension<Caller>,
    run: RunPath,
    body: RawJson,
) -> Result<Response, ApiError> {
    decide(gw, caller, run, body, Decision::Deny).await
}

async fn decide(
    State(gw): State<Arc<Gateway>>,
    Extension(caller): Extension<Caller>,
    RunPath(run): RunPath,
    RawJson(body): RawJson,
    decision: Decision,
) -> Result<Response, ApiError> {
    let body: DecisionBody =
        if body.iter().all(u8::is_ascii_whitespace) { DecisionBody::default() } else { parse(&body)? };
    let reason = body.reason.map(|r| r.trim().to_string()).filter(|r| !r.is_empty());
    if decision == Decision::Deny && reason.is_none() {
        return Err(ApiError::Unprocessable("a denial needs a reason: send {\"reason\": \"...\"}".into()));
    }
    if let Some(r) = &reason {
        if r.len() > pitcrew_model::approval::MAX_REASON {
            return Err(ApiError::Unprocessable(format!(
                "reason is {} bytes, more than the {} allowed",
                r.len(),
                pitcrew_model::approval::MAX_REASON
            )));
        }
    }
    if let Some(why) = gw.cfg.refuse_approver(&caller.name) {
        return Err(ApiError::Forbidden(format!(
            "key owner {why}: the owner of a deciding key must be under [approvers]"
        )));
    }
    let input = DecisionInput {
        run,
        plan_hash: body.plan_hash.as_deref(),
        attempt: body.attempt,
        decision,
        by: &caller.name,
        reason,
        channel: "http",
        racing: Some(&gw.cfg),
    };
    let req = approvals::submit(&gw.bus, Some(&gw.store), input).await.map_err(|e| match e {
        DecideError::NoRequest(_) => {
            ApiError::NotFound(format!("run {run} has no approval request (`GET /v1/approvals` lists pending ones)"))
        }
        DecideError::Conflict(why) => ApiError::Conflict(why),
        DecideError::Invalid(why) => ApiError::Unprocessable(why),
        DecideError::Bus(why) => ApiError::unavailable("NATS", why),
        DecideError::Store(e) => e.into(),
    })?;
    let mut resp = (
        StatusCode::ACCEPTED,
        Json(json!({
            "run_id": run, "decision": decision.as_str(), "by": caller.name, "plan_hash": req.plan_hash,
            "attempt": req.attempt,
            "plan": req.plan, "quorum": req.quorum,
        })),
    )
        .into_response();
    resp.extensions_mut().insert(AuditRun(run));
    resp.extensions_mut().insert(Outcome(format!("{} plan {} of run {run}", decision.as_str(), req.plan_hash)));
    Ok(resp)
}

/// `POST /v1/ask`: investigation mode does not exist yet.
pub async fn ask(RawJson(_): RawJson) -> ApiError {
    ApiError::NotImplemented(
        "investigation mode (questions rather than alerts) is not available in this version of pitcrew: \
         open an incident with POST /v1/incidents instead"
            .into(),
    )
}
