//! Deciding approvals, shared by every channel (CLI, gateway, chat bridges): find the run's
//! pending request on the bridge stream and publish a decision for its exact plan hash, unless
//! that plan is decided already (in Postgres; the bridge and the gateway also look for a
//! decision on the bridge subject not yet recorded: `racing`).

use crate::{Bus, Config, Store};
use anyhow::{anyhow, Context};
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::StreamMessage;
use pitcrew_model::codec::JSON;
use pitcrew_model::{ApprovalDecision, ApprovalRequest, Decision};
use std::time::Duration;
use uuid::Uuid;

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
    Ok(request_at(bus, run).await?.map(|(req, _)| req))
}

/// [`find_request`], with the request's sequence in the approvals stream: a decision on the
/// stream after it was published after it.
async fn request_at(bus: &Bus, run: Uuid) -> anyhow::Result<Option<(ApprovalRequest, u64)>> {
    match last_on(bus, &bus.subjects.approval_requested(run)).await? {
        Some(msg) => {
            let req = serde_json::from_slice(&msg.payload).context("approval request unreadable")?;
            Ok(Some((req, msg.sequence)))
        }
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
    /// has not recorded yet (two operators deciding at once: see [`submit`]).
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

/// How often a decision is checked again when another one landed on the run's decision
/// subject between its checks and its publish (see [`submit`]).
const CHECK_TRIES: u32 = 5;

/// Most messages [`submit`] reads on one run's decision subject (a run sees a handful: one a
/// decider and attempt).
const MAX_DECISIONS_READ: usize = 256;

/// Publish `input` on `pitcrew.approvals.decided.<run>` once it names the pending plan and,
/// with the store, that plan is still undecided (and, with `racing`, no decision not yet
/// recorded settles it first). Returns the request decided.
///
/// The checks and the publish are one step on the bus: the decision is published only if the
/// subject's last message is still the one the checks read (JetStream's expected last subject
/// sequence). Two deciders at once cannot both pass: the later publish is refused, checked
/// again against the other's decision, and answered as that says (a vote under a quorum still
/// counts; a denial after an approval that settled the plan does not, and is told so).
pub async fn submit(
    bus: &Bus,
    store: Option<&Store>,
    input: DecisionInput<'_>,
) -> Result<ApprovalRequest, DecideError> {
    if input.by.trim().is_empty() {
        return Err(DecideError::Invalid("--by must name who decides".into()));
    }
    for _ in 0..CHECK_TRIES {
        match check_and_publish(bus, store, &input).await? {
            Some(req) => return Ok(req),
            None => {
                tracing::info!(run = %input.run, "another decision landed while this one was checked: checking again")
            }
        }
    }
    Err(DecideError::Conflict(format!(
        "other decisions for run {} kept landing while this one was checked ({CHECK_TRIES} times): nothing was \
         decided; look at the run (`pitcrew show {}`) and decide again",
        input.run, input.run
    )))
}

/// One round of [`submit`]: the request decided, or None when another decision landed on the
/// subject after the checks read it (check again).
async fn check_and_publish(
    bus: &Bus,
    store: Option<&Store>,
    input: &DecisionInput<'_>,
) -> Result<Option<ApprovalRequest>, DecideError> {
    let DecisionInput { run, plan_hash, attempt, decision, by, ref reason, channel, racing } = *input;
    let found = request_at(bus, run).await.map_err(|e| DecideError::Bus(format!("{e:#}")))?;
    let (req, asked_at) = found.ok_or(DecideError::NoRequest(run))?;
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
    // Read before the store: a decision the crew records in between is then either in
    // Postgres or among these, never missed by both.
    let on_bus = decisions_on(bus, run, asked_at).await?;
    let mut recorded = Vec::new();
    if let Some(store) = store {
        if let Some((prev, who, via, when)) = store.approval_decision(run, &req.plan_hash).await? {
            return Err(DecideError::Conflict(format!(
                "plan {} of run {run} was already decided: {prev} by {who} via {via} at {}",
                req.plan_hash,
                when.format("%Y-%m-%d %H:%M:%S")
            )));
        }
        if let Some(cfg) = racing.filter(|_| req.quorum > 1) {
            recorded = store.approval_voters(run, &req.plan_hash, &cfg.approver_names()).await?;
        }
    }
    if let Some(cfg) = racing {
        if let Some(why) = settled(cfg, &req, &recorded, &on_bus.in_flight) {
            return Err(DecideError::Conflict(why));
        }
    }
    let d = ApprovalDecision {
        run_id: run,
        decision,
        by: by.to_string(),
        plan_hash: Some(req.plan_hash.clone()),
        reason: reason.clone(),
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
    let mut headers = decision_headers(&id, run, req.attempt);
    headers.insert(async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, on_bus.last_seq.to_string().as_str());
    let subject = bus.subjects.approval_decided(run);
    let failed = |e: &dyn std::fmt::Display| DecideError::Bus(format!("publish to {subject} failed: {e}"));
    let ack = bus.js.publish_with_headers(subject.clone(), headers, payload.into()).await.map_err(|e| failed(&e))?;
    match ack.await {
        Ok(_) => Ok(Some(req)),
        Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => Ok(None),
        Err(e) => {
            bus.unacked(&subject, &e);
            Err(failed(&format!("{e}: no ack, so it may be stored all the same")))
        }
    }
}

/// A run's decision subject as [`submit`] read it: the sequence of its last message (0: none,
/// which the publish then expects) and the decisions published after the request, oldest
/// first, each with the attempt it answered when it says.
struct OnBus {
    last_seq: u64,
    in_flight: Vec<(ApprovalDecision, Option<u32>)>,
}

/// `run`'s decision subject: its last message, and every decision published after the
/// request (stream sequence `asked_at`), one read each, at most [`MAX_DECISIONS_READ`]. By
/// sequence, not by time: a decision stays in the way however long the crew takes to record
/// it (stopped, or Postgres down), whatever the clock of the host that published it.
async fn decisions_on(bus: &Bus, run: Uuid, asked_at: u64) -> Result<OnBus, DecideError> {
    let subject = bus.subjects.approval_decided(run);
    let unread = |e: &dyn std::fmt::Display| DecideError::Bus(format!("reading {subject} failed: {e} (retry)"));
    let last = last_on(bus, &subject).await.map_err(|e| unread(&e))?;
    let mut seen = OnBus { last_seq: last.as_ref().map_or(0, |m| m.sequence), in_flight: Vec::new() };
    if seen.last_seq <= asked_at {
        return Ok(seen);
    }
    let read = async {
        let stream = bus.js.get_stream(bus.subjects.approvals_stream()).await.map_err(|e| unread(&e))?;
        let mut next = asked_at + 1;
        for _ in 0..MAX_DECISIONS_READ {
            let msg = match stream.get_first_raw_message_by_subject(&subject, next).await {
                Ok(m) => m,
                Err(e) if e.kind() == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound => {
                    return Ok(seen);
                }
                Err(e) => return Err(unread(&e)),
            };
            (seen.last_seq, next) = (seen.last_seq.max(msg.sequence), msg.sequence + 1);
            if let Ok(d) = serde_json::from_slice::<ApprovalDecision>(&msg.payload) {
                let answered = answered_attempt(msg.headers.get(ATTEMPT_HEADER).map(|v| v.as_str()));
                seen.in_flight.push((d, answered));
            }
        }
        Err(DecideError::Conflict(format!(
            "run {run} has more than {MAX_DECISIONS_READ} decisions on {subject} since its request: nothing was \
             decided (look at who publishes them; `pitcrew show {run}`)"
        )))
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .map_err(|_| DecideError::Bus(format!("NATS did not answer a read of {subject} within 10 s (retry)")))?
}

/// What the decisions published since the request (`in_flight`, perhaps recorded by the crew
/// already) settle for `req`'s plan, taken in the order the crew records them: a denial stops
/// the plan; an approval decides it alone, or with the votes that complete its quorum
/// (`recorded`: the approvers Postgres counted so far). One for another plan or attempt, an
/// expiry, or one by someone the crew refuses settles nothing. None: nothing is settled, a
/// new decision counts; else why it is refused.
fn settled(
    cfg: &Config,
    req: &ApprovalRequest,
    recorded: &[String],
    in_flight: &[(ApprovalDecision, Option<u32>)],
) -> Option<String> {
    let (run, plan_hash) = (req.run_id, req.plan_hash.as_str());
    let quorum = req.quorum.max(1) as usize;
    let mut voters: Vec<&str> = recorded.iter().map(String::as_str).collect();
    let approved = |voters: &[&str]| {
        format!(
            "plan {plan_hash} of run {run} was already approved by {} ({} of {} approvals, being recorded): this \
             decision is ignored",
            voters.join(", "),
            voters.len(),
            req.quorum
        )
    };
    if req.quorum > 1 && voters.len() >= quorum {
        return Some(approved(&voters));
    }
    for (prev, answered) in in_flight {
        let counts = prev.plan_hash.as_deref() == Some(plan_hash)
            && answered.is_none_or(|a| a == req.attempt)
            && prev.decision != Decision::Expire
            && cfg.refuse_approver(&prev.by).is_none();
        if !counts {
            continue;
        }
        // Under a quorum an approval is one vote, whoever cast it: a vote or a denial (the
        // voter's own too) goes on until the votes are enough (the crew counts each approver
        // once, and one denial stops the plan).
        if req.quorum > 1 && prev.decision == Decision::Approve {
            if !voters.contains(&prev.by.as_str()) {
                voters.push(&prev.by);
            }
            if voters.len() >= quorum {
                return Some(approved(&voters));
            }
            continue;
        }
        return Some(format!(
            "plan {plan_hash} of run {run} was already decided: {} by {} via {} at {} (being recorded: this decision is ignored)",
            prev.decision.as_str(),
            prev.by,
            prev.channel,
            prev.decided_at.format("%Y-%m-%d %H:%M:%S")
        ));
    }
    None
}

/// The headers of a decision on `run`'s request of `attempt`: its message id, content type,
/// run and [`ATTEMPT_HEADER`].
pub fn decision_headers(id: &str, run: Uuid, attempt: impl std::fmt::Display) -> async_nats::HeaderMap {
    let mut headers = crate::bus::headers(id, JSON, Some(run));
    headers.insert(ATTEMPT_HEADER, attempt.to_string().as_str());
    headers
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
