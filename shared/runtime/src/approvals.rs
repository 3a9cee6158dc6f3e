//! Deciding approvals, shared by every channel (CLI, gateway, chat bridges): find the run's
//! pending request on the bridge stream and publish a decision for its exact plan hash, unless
//! that plan is decided already (in Postgres; the bridge and the gateway also look for a
//! decision on the bridge subject not yet recorded: `racing`).

use crate::{Bus, Config, Store};
use anyhow::{anyhow, Context};
use async_nats::jetstream::message::StreamMessage;
use pitcrew_model::codec::JSON;
use pitcrew_model::{ApprovalDecision, ApprovalRequest, Decision};
use std::time::Duration;
use uuid::Uuid;

/// How long a decision on the bridge subject counts as in flight (published, not yet recorded
/// by the crew). Past it, a decision the crew never recorded was refused by it and blocks
/// nothing.
pub const IN_FLIGHT: Duration = Duration::from_secs(60);

/// The header of a decision naming the attempt whose request it answers (every channel sets
/// it from the request it checked): the crew ignores a decision for another attempt than the
/// one the run waits on, such as a vote published for attempt 1 just before attempt 2 asked
/// for the same plan again (it would count toward attempt 2's quorum). A header rather than
/// a field of the decision, so a crew from before it still reads every decision. Absent (a
/// decision published by other means): whatever attempt.
pub const ATTEMPT_HEADER: &str = "Pitcrew-Attempt";

/// The latest approval request of a run, from the bridge stream.
pub async fn approval_request(bus: &Bus, run: Uuid) -> anyhow::Result<ApprovalRequest> {
    find_request(bus, run)
        .await?
        .ok_or_else(|| anyhow!("no approval request for run {run} (is the id right? `pitcrew incidents` lists runs)"))
}

/// The latest approval request of a run: None when it has none; an error when the bus could
/// not say (NATS unreachable), so a caller can tell "no such request" from "try again".
pub async fn find_request(bus: &Bus, run: Uuid) -> anyhow::Result<Option<ApprovalRequest>> {
    match last_on(bus, &bus.subjects.approval_requested(run)).await? {
        Some(msg) => Ok(Some(serde_json::from_slice(&msg.payload).context("approval request unreadable")?)),
        None => Ok(None),
    }
}

/// The last message on `subject` of the approvals stream: None when there is none; an error
/// when the bus could not say.
async fn last_on(bus: &Bus, subject: &str) -> anyhow::Result<Option<StreamMessage>> {
    bus.last_on(&bus.subjects.approvals_stream(), subject).await.map_err(|e| anyhow!("{e} (retry)"))
}

/// Why a decision was not published; the variant says what the channel answers.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// Not a decision (no decider named): fix the input.
    #[error("{0}")]
    Invalid(String),
    /// The run waits on no approval (a wrong id, or never parked).
    #[error("no approval request for run {0} (is the id right? `pitcrew incidents` lists runs)")]
    NoRequest(Uuid),
    /// Not the plan to decide any more: stale, decided, or a decision for it in flight.
    #[error("{0}")]
    Conflict(String),
    /// NATS could not be read or written: retry later.
    #[error("{0}")]
    Bus(String),
    #[error(transparent)]
    Store(#[from] crate::StoreError),
}

/// A decision as a channel received it.
#[derive(Debug, Clone)]
pub struct DecisionInput<'a> {
    pub run: Uuid,
    /// The plan the decider saw (a chat button or API call carries it): refused when the run
    /// now waits on another plan. None: whatever plan the run waits on (the CLI).
    pub plan_hash: Option<&'a str>,
    /// The attempt whose request the decider saw (a chat button carries it): refused when the
    /// run now asks again, for a later attempt, even for the same plan (that attempt's request
    /// is decided anew). None: whatever attempt.
    pub attempt: Option<u32>,
    pub decision: Decision,
    pub by: &'a str,
    pub reason: Option<String>,
    pub channel: &'a str,
    /// With the config: also refuse a decision racing one on the bridge subject that the crew
    /// has not recorded yet (two operators deciding at once, see [`IN_FLIGHT`]).
    pub racing: Option<&'a Config>,
}

impl<'a> DecisionInput<'a> {
    /// An operator's `pitcrew approve|deny`: the plan the run waits on now, refused like any
    /// other channel's when another decision for it is on the bridge subject, not yet
    /// recorded (an approval clicked in chat a moment before a denial typed in a terminal
    /// must not be answered "denied").
    pub fn cli(run: Uuid, decision: Decision, by: &'a str, reason: Option<String>, cfg: &'a Config) -> Self {
        DecisionInput { run, plan_hash: None, attempt: None, decision, by, reason, channel: "cli", racing: Some(cfg) }
    }
}

/// Publish `input` on `pitcrew.approvals.decided.<run>` once it names the pending plan and,
/// with the store, that plan is still undecided (and, with `racing`, no decision for it is in
/// flight). Returns the request decided.
pub async fn submit(
    bus: &Bus,
    store: Option<&Store>,
    input: DecisionInput<'_>,
) -> Result<ApprovalRequest, DecideError> {
    let DecisionInput { run, plan_hash, attempt, decision, by, reason, channel, racing } = input;
    if by.trim().is_empty() {
        return Err(DecideError::Invalid("--by must name who decides".into()));
    }
    let req = find_request(bus, run).await.map_err(|e| DecideError::Bus(format!("{e:#}")))?;
    let req = req.ok_or(DecideError::NoRequest(run))?;
    if let Some(seen) = plan_hash {
        if seen != req.plan_hash {
            return Err(DecideError::Conflict(format!(
                "stale plan: run {run} now waits on plan {}, not {seen}",
                req.plan_hash
            )));
        }
    }
    if let Some(seen) = attempt {
        if seen != req.attempt {
            return Err(DecideError::Conflict(format!(
                "stale request: this one was for attempt {seen} of run {run}, which now asks again for attempt {}: \
                 decide on that request",
                req.attempt
            )));
        }
    }
    // Past its deadline, an approval is turned into an expiry by the crew: say so here rather
    // than answer "approved" for a plan that will not run.
    if decision == Decision::Approve && req.expires_at <= chrono::Utc::now() {
        return Err(DecideError::Conflict(format!(
            "the approval request for plan {} of run {run} expired at {}: the run escalates, an approval now would not run it",
            req.plan_hash,
            req.expires_at.format("%Y-%m-%d %H:%M:%S")
        )));
    }
    if let Some(store) = store {
        if let Some((prev, who, via, when)) = store.approval_decision(run, &req.plan_hash).await? {
            return Err(DecideError::Conflict(format!(
                "plan {} of run {run} was already decided: {prev} by {who} via {via} at {}",
                req.plan_hash,
                when.format("%Y-%m-%d %H:%M:%S")
            )));
        }
    }
    if let Some(cfg) = racing {
        if let Some(why) = racing_decision(bus, cfg, &req, by).await? {
            return Err(DecideError::Conflict(why));
        }
    }
    let d = ApprovalDecision {
        run_id: run,
        decision,
        by: by.to_string(),
        plan_hash: Some(req.plan_hash.clone()),
        reason,
        channel: channel.to_string(),
        decided_at: chrono::Utc::now(),
    };
    // The attempt in the id, as in the request's: the same plan asked for again by a later
    // attempt is decided anew, and the bus must not drop that decision as a duplicate of the
    // earlier attempt's (its duplicate window is two minutes) while the decider is told it went.
    let id = format!("{run}.{}.{}.{}.{by}", req.plan_hash, req.attempt, decision.as_str());
    let payload = serde_json::to_vec(&d).expect("a decision serialises");
    // Not while the client is cut off: the publish would wait in its queue and go out whenever
    // NATS is back, long after the decider was told it failed.
    if bus.client.connection_state() != async_nats::connection::State::Connected {
        return Err(DecideError::Bus(format!(
            "NATS is unreachable ({:?}): nothing was decided, try again",
            bus.client.connection_state()
        )));
    }
    let mut headers = crate::bus::headers(&id, JSON, Some(run));
    headers.insert(ATTEMPT_HEADER, req.attempt.to_string().as_str());
    bus.publish_with_headers(bus.subjects.approval_decided(run), headers, payload.into())
        .await
        .map_err(|e| DecideError::Bus(e.to_string()))?;
    Ok(req)
}

/// Why a decision for `req`'s plan is refused because another one is on the bridge subject,
/// not yet recorded by the crew (two clicks racing): the last decision published for that plan
/// within [`IN_FLIGHT`] by a configured approver wins, unless it is an approval under a quorum
/// and this decision is another approver's (a vote, or a denial). None: not racing.
async fn racing_decision(
    bus: &Bus,
    cfg: &Config,
    req: &ApprovalRequest,
    by: &str,
) -> Result<Option<String>, DecideError> {
    let (run, plan_hash) = (req.run_id, req.plan_hash.as_str());
    let Some((prev, answered)) =
        in_flight(bus, run, plan_hash).await.map_err(|e| DecideError::Bus(format!("{e:#}")))?
    else {
        return Ok(None);
    };
    // A decision from before this request, or for another attempt's, answered an earlier one
    // (the same plan, asked for again by a later attempt): it decides nothing here.
    if prev.decided_at < req.requested_at || answered.is_some_and(|a| a != req.attempt) {
        return Ok(None);
    }
    if cfg.refuse_approver(&prev.by).is_some() {
        // The crew refuses it: it wins nothing.
        return Ok(None);
    }
    // Under a quorum an approval is one vote, not the decision: another approver's vote or
    // denial goes on (the crew counts votes, and one denial stops the plan).
    if req.quorum > 1 && prev.decision == Decision::Approve && prev.by != by {
        return Ok(None);
    }
    Ok(Some(format!(
        "plan {plan_hash} of run {run} was already decided: {} by {} via {} at {} (being recorded: this decision is ignored)",
        prev.decision.as_str(),
        prev.by,
        prev.channel,
        prev.decided_at.format("%Y-%m-%d %H:%M:%S")
    )))
}

/// The last decision published for `plan_hash` of `run` within [`IN_FLIGHT`], if any, with
/// the attempt it answered when it says.
async fn in_flight(bus: &Bus, run: Uuid, plan_hash: &str) -> anyhow::Result<Option<(ApprovalDecision, Option<u32>)>> {
    let Some(msg) = last_on(bus, &bus.subjects.approval_decided(run)).await? else { return Ok(None) };
    let Ok(d) = serde_json::from_slice::<ApprovalDecision>(&msg.payload) else { return Ok(None) };
    let age = time::OffsetDateTime::now_utc() - msg.time;
    if d.plan_hash.as_deref() != Some(plan_hash) || age > IN_FLIGHT {
        return Ok(None);
    }
    Ok(Some((d, answered_attempt(msg.headers.get(ATTEMPT_HEADER).map(|v| v.as_str())))))
}

/// The attempt a decision's [`ATTEMPT_HEADER`] names: one that is not a number names no
/// attempt a run could be on.
pub fn answered_attempt(header: Option<&str>) -> Option<u32> {
    header.map(|a| a.trim().parse::<u32>().unwrap_or(u32::MAX))
}

/// The trace context of a run's latest approval request (published inside the run's trace),
/// so the decision resumes the run in the same trace whoever decided and however.
pub async fn request_traceparent(bus: &Bus, run: Uuid) -> Option<String> {
    let read = async {
        let msg = last_on(bus, &bus.subjects.approval_requested(run)).await.ok()??;
        crate::trace::traceparent(Some(&msg.headers))
    };
    tokio::time::timeout(std::time::Duration::from_secs(2), read).await.ok().flatten()
}
