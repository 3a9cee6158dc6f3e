//! Approval decisions from the bridge subject resume parked runs; a sweeper turns requests
//! past their deadline into `expire` decisions so a forgotten approval escalates its run.

use futures::future::BoxFuture;
use pitcrew_model::codec::{self, CONTENT_TYPE};
use pitcrew_model::{ApprovalDecision, ApprovalStatus, Decision, EventKind, Stage};
use pitcrew_runtime::approvals::{answered_attempt, ATTEMPT_HEADER};
use pitcrew_runtime::bus::DECISIONS_CONSUMER;
use pitcrew_runtime::consume::{backoff, Disposition, MessageHandler};
use pitcrew_runtime::runner::{
    apply, dead_letter, delivery, exhausted, header, outage, publish_batch, publish_events, ApplyError,
};
use pitcrew_runtime::runner::{decision_event_index, DECISION_EVENTS, DECISION_EVENT_BASE, DECISION_EVENT_SPAN};
use pitcrew_runtime::store::{DecideOutcome, RunStatus, StoreError};
use pitcrew_runtime::{Bus, BusError, Cx, Deps, Transition};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// Most notes of decisions set aside (refused, ignored) one run's timeline takes.
pub const MAX_DECISION_NOTES: i64 = 256;

/// Consumes `pitcrew.approvals.decided.*`.
pub struct Decisions {
    pub bus: Bus,
    pub deps: Arc<Deps>,
}

/// Why a decision could not be applied: worth a retry, or never going to work.
#[derive(Debug, thiserror::Error)]
enum DecideError {
    #[error("{0}")]
    Transient(String),
    #[error("{0}")]
    Permanent(String),
}

impl From<StoreError> for DecideError {
    fn from(e: StoreError) -> Self {
        if e.is_transient() {
            DecideError::Transient(e.to_string())
        } else {
            DecideError::Permanent(e.to_string())
        }
    }
}

impl From<ApplyError> for DecideError {
    fn from(e: ApplyError) -> Self {
        match e {
            ApplyError::Store(s) => s.into(),
            ApplyError::Bus(b) => b.into(),
        }
    }
}

impl From<BusError> for DecideError {
    /// A publish NATS refuses (its permissions) or a stream it will not set up is refused the
    /// same way every time: dead-lettered for a human, not retried for good (a decision that
    /// fails for a while otherwise is retried whatever its deliveries).
    fn from(e: BusError) -> Self {
        match e {
            BusError::Refused { .. } | BusError::Setup { .. } => DecideError::Permanent(e.to_string()),
            _ => DecideError::Transient(e.to_string()),
        }
    }
}

impl From<serde_json::Error> for DecideError {
    fn from(e: serde_json::Error) -> Self {
        DecideError::Permanent(e.to_string())
    }
}

impl MessageHandler for Decisions {
    fn name(&self) -> String {
        DECISIONS_CONSUMER.into()
    }

    fn handle(self: Arc<Self>, msg: Arc<async_nats::jetstream::Message>) -> BoxFuture<'static, Disposition> {
        Box::pin(async move { self.process(&msg).await })
    }
}

impl Decisions {
    async fn process(&self, msg: &async_nats::jetstream::Message) -> Disposition {
        let (stream, seq, delivered) = delivery(msg);
        // As a stage's message: past its limits, a decision still gets its try (not while
        // Postgres is unreachable: an operator's approval is not dropped for an outage), and is
        // dead-lettered only when that fails too.
        let exhausted = exhausted(msg, self.deps.config.stage_settings(Stage::Approval));
        if exhausted.is_some() {
            if let Some(wait) = outage(&self.deps, DECISIONS_CONSUMER, delivered).await {
                return wait;
            }
        }
        let d = match codec::decode::<ApprovalDecision>(header(msg, CONTENT_TYPE), &msg.payload) {
            Ok(d) => d.storable(),
            Err(e) => return self.reject(msg, &format!("bad approval decision: {e}"), &stream, seq).await,
        };
        let subject_run = msg.subject.rsplit('.').next().and_then(|r| r.parse::<Uuid>().ok());
        if subject_run != Some(d.run_id) {
            return self
                .reject(
                    msg,
                    &format!("decision names run {} but was published on {}", d.run_id, msg.subject),
                    &stream,
                    seq,
                )
                .await;
        }
        // The decision resumes the run in the run's own trace (its request carries it); failing
        // that, in the trace its publisher (the gateway, a bot) sent along.
        let parent = match pitcrew_runtime::approvals::request_traceparent(&self.bus, d.run_id).await {
            Some(tp) => Some(tp),
            None => pitcrew_runtime::trace::traceparent(msg.headers.as_ref()),
        };
        let span = tracing::info_span!(
            "approval_decision",
            run = %d.run_id,
            decision = d.decision.as_str(),
            channel = %pitcrew_model::trim::clip(&d.channel, 32),
        );
        pitcrew_runtime::trace::adopt(&span, parent.as_deref());
        let attempt = answered_attempt(header(msg, ATTEMPT_HEADER));
        let decided = tracing::Instrument::instrument(self.decide(&d, attempt, seq), span);
        match pitcrew_runtime::trace::carrying(parent, decided).await {
            Ok(()) => Disposition::Ack,
            Err(DecideError::Permanent(e)) => {
                self.reject(msg, &format!("decision cannot be applied: {e}"), &stream, seq).await
            }
            // Retried whatever its deliveries, never dead-lettered: the decision may already
            // be recorded on its request (which then takes no other), and only this message
            // moves the run on. Dead-lettered past the limits (a lock, a deadlock, a publish
            // failing for an hour), it left the run waiting for good and every later incident
            // of its fingerprint a duplicate of it.
            Err(DecideError::Transient(e)) => {
                tracing::warn!(run = %d.run_id, error = %e, delivered, "applying decision failed: will retry");
                Disposition::Nak(backoff(delivered))
            }
        }
    }

    async fn reject(&self, msg: &async_nats::jetstream::Message, why: &str, stream: &str, seq: u64) -> Disposition {
        tracing::error!(error = %why, "poison approval decision: dead-lettering");
        match dead_letter(&self.bus, msg, "approval", why, &format!("{stream}.{seq}")).await {
            Ok(()) => Disposition::Term,
            Err(_) => Disposition::Nak(Duration::from_secs(1)),
        }
    }

    /// Keep a note about a decision that resumes nothing: stored and published. A note of a
    /// decision set aside (an error) is not once the run holds [`MAX_DECISION_NOTES`] of them
    /// (it is logged alone): anyone who may publish on the bridge subject could send decisions
    /// for a run over and over (a bot that never reads an answer) and grow its timeline, which
    /// every read of the run loads, without end. Votes counted are approvers' own, and kept.
    async fn record(
        &self,
        mut cx: Cx<'_>,
        kind: EventKind,
        message: String,
        d: &ApprovalDecision,
    ) -> Result<(), DecideError> {
        if kind == EventKind::Error {
            let noted = self.deps.store.decisions_set_aside(d.run_id).await?;
            if noted >= MAX_DECISION_NOTES {
                tracing::warn!(
                    run = %d.run_id, by = %d.by, channel = %d.channel, noted, note = %message,
                    "a decision set aside is not put on the run's timeline: it holds enough of them"
                );
                return Ok(());
            }
        }
        cx.emit(kind, message, serde_json::to_value(d)?);
        let events = cx.take_events();
        self.deps.store.insert_events(&events).await?;
        publish_events(&self.bus, &events).await?;
        Ok(())
    }

    /// Keep a note that `d` decides nothing (`ignored`, `refused`), and why.
    async fn set_aside(&self, cx: Cx<'_>, d: &ApprovalDecision, how: &str, why: &str) -> Result<(), DecideError> {
        let message = format!("{} by {} {how}: {why}", d.decision.as_str(), d.by);
        self.record(cx, EventKind::Error, message, d).await
    }

    async fn decide(&self, d: &ApprovalDecision, attempt: Option<u32>, seq: u64) -> Result<(), DecideError> {
        let store = &self.deps.store;
        let Some(run) = store.load_run(d.run_id).await? else {
            tracing::warn!(run = %d.run_id, "decision for an unknown run: ignored");
            return Ok(());
        };
        let mut state = run.state;
        let pending = match &state.approval {
            ApprovalStatus::Waiting { plan_hash, .. } => Some(plan_hash.clone()),
            _ => None,
        };
        let index = decision_event_index(seq);
        let mut cx = Cx::new(&self.deps, Stage::Approval, d.run_id, state.seq, index);
        let Some(plan_hash) = d.plan_hash.clone().or(pending.clone()) else {
            let why = format!("run is not waiting for an approval (it is {})", run.status.as_str());
            return self.set_aside(cx, d, "ignored", &why).await;
        };
        // An answer to another attempt's request (see ATTEMPT_HEADER) decides nothing now.
        if let Some(answered) = attempt.filter(|a| pending.is_some() && *a != state.attempt) {
            let why = format!(
                "it answered the request of attempt {answered}, and the run now waits on attempt {}'s: decide on that one",
                state.attempt
            );
            tracing::warn!(run = %d.run_id, by = %d.by, "decision for another attempt: ignored");
            return self.set_aside(cx, d, "ignored", &why).await;
        }
        // Only a configured approver decides; the sweeper's expiry only ever escalates.
        if d.decision != Decision::Expire {
            if let Some(why) = self.deps.config.refuse_approver(&d.by) {
                tracing::warn!(run = %d.run_id, by = %d.by, channel = %d.channel, "decision refused: {why}");
                return self.set_aside(cx, d, "refused", &why).await;
            }
        }
        // An approval after the request's deadline (the approval workers were down when the
        // sweeper would have expired it, or it sat on the bus) expires the request instead:
        // the plan was approved for a state of the service that old, and the run escalates as
        // the timeout promises.
        let expired_instead;
        let approving = d.decision == Decision::Approve && pending.as_deref() == Some(plan_hash.as_str());
        let deadline = if approving { store.approval_expired(d.run_id, &plan_hash, seq).await? } else { None };
        let d = match deadline {
            Some(deadline) => {
                tracing::warn!(run = %d.run_id, by = %d.by, %deadline, "approval after the request's deadline: expiring it");
                cx.emit(
                    EventKind::Error,
                    format!("approve by {} via {} refused: the request expired at {deadline}", d.by, d.channel),
                    serde_json::to_value(d)?,
                );
                expired_instead = ApprovalDecision {
                    decision: Decision::Expire,
                    by: "pitcrew".into(),
                    plan_hash: Some(plan_hash.clone()),
                    reason: Some(format!("expired at {deadline}, before {}'s approval arrived", d.by)),
                    channel: "timeout".into(),
                    decided_at: chrono::Utc::now(),
                    run_id: d.run_id,
                };
                &expired_instead
            }
            None => d,
        };
        // A plan that needs several approvers runs on the last approval of its quorum.
        let mut counted = None;
        if d.decision == Decision::Approve && pending.as_deref() == Some(plan_hash.as_str()) {
            if let Some((votes, quorum)) = store
                .vote(d.run_id, &plan_hash, &d.by, &d.channel, seq, attempt, &self.deps.config.approver_names())
                .await?
            {
                if votes < quorum {
                    let msg = format!("approve by {} via {} counted: {votes} of {quorum} approvals", d.by, d.channel);
                    return self.record(cx, EventKind::ApprovalDecided, msg, d).await;
                }
                counted = Some((votes, quorum));
            }
        }
        let outcome = store.decide_approval(&plan_hash, d, seq, attempt).await?;
        if outcome == DecideOutcome::Applied {
            // Best effort: a failed read costs one observation, never the decision.
            if let Ok(Some((requested, _))) = store.approval_window(d.run_id, &plan_hash).await {
                let waited = (d.decided_at - requested).to_std().unwrap_or_default();
                pitcrew_runtime::metrics::approval_decided(d.decision.as_str(), waited);
            }
        }
        let ignored = match &outcome {
            DecideOutcome::Applied => None,
            DecideOutcome::Repeated if run.status == RunStatus::WaitingApproval => None,
            DecideOutcome::Repeated => {
                // Applied and committed before a crash, or before all it sends reached the bus
                // (a publish that failed after the commit): send its events again, from what
                // it stored under its index, and the successor, but only if the stored state
                // is still the one this decision produced. Without the events, the run went
                // from waiting to executing on the bus with no word of who approved.
                // This decision's events: under the seq it was applied at (where its first event
                // sits at its index), in its index range (a decision a whole span of stream seqs
                // away shares it, under other seqs). Not when its last already is the last of
                // its kind on the bus.
                let timeline = store.timeline(d.run_id).await?;
                let at = |index: u32| {
                    timeline.iter().filter(|e| e.stage == Stage::Approval && e.index == index).map(|e| e.seq).max()
                };
                // Applied by a build before decisions' indexes were spaced (the stream seq
                // modulo the span): its events are under that index.
                let before = DECISION_EVENT_BASE + (seq % u64::from(DECISION_EVENT_SPAN)) as u32;
                let (index, applied_at) = match at(index) {
                    None => (before, at(before)),
                    found => (index, found),
                };
                let mut events: Vec<_> = timeline
                    .into_iter()
                    .filter(|e| {
                        Some(e.seq) == applied_at
                            && e.stage == Stage::Approval
                            && (index..index + DECISION_EVENTS).contains(&e.index)
                    })
                    .collect();
                if let Some(last) = events.last() {
                    if self.bus.holds_event(last).await? {
                        events.clear();
                    }
                }
                let produced = match (&state.step, &state.approval) {
                    (Stage::Execute, ApprovalStatus::Approved { plan_hash: h, .. }) => *h == plan_hash,
                    // An approved state too large for execute went to escalate instead.
                    (Stage::Escalate, ApprovalStatus::Approved { plan_hash: h, .. }) => *h == plan_hash,
                    (Stage::Escalate, ApprovalStatus::Denied { .. }) => true,
                    _ => false,
                };
                let successor = (produced && !run.status.is_final()).then_some(&state);
                publish_batch(&self.bus, &events, successor).await?;
                return Ok(());
            }
            // Two last votes of a quorum at once: each was counted, the other's approval of the
            // plan was applied first. This one is part of that approval, not ignored.
            DecideOutcome::AlreadyDecided { decision, by } if counted.is_some() && *decision == "approve" => {
                let (votes, quorum) = counted.unwrap_or_default();
                let msg = format!(
                    "approve by {} via {} counted: {votes} of {quorum} approvals (the plan was approved with {by}'s, \
                     counted at the same moment)",
                    d.by, d.channel
                );
                return self.record(cx, EventKind::ApprovalDecided, msg, d).await;
            }
            DecideOutcome::AlreadyDecided { decision, by } => {
                Some(format!("plan {plan_hash} was already decided ({decision} by {by})"))
            }
            DecideOutcome::Stale => Some(format!(
                "decided before plan {plan_hash} was asked for again by a later attempt (an answer to the earlier request)"
            )),
            DecideOutcome::NoSuchRequest => {
                Some(format!("no approval request for plan {plan_hash} (was the plan regenerated?)"))
            }
        };
        if ignored.is_none() && pending.as_deref() != Some(plan_hash.as_str()) {
            // Decided a request that is not the one the run waits on: recorded, nothing resumes.
            return self
                .record(
                    cx,
                    EventKind::ApprovalDecided,
                    format!(
                        "{} by {} recorded for plan {plan_hash}, but the run is not waiting on it",
                        d.decision.as_str(),
                        d.by
                    ),
                    d,
                )
                .await;
        }
        if let Some(why) = ignored {
            return self.set_aside(cx, d, "ignored", &why).await;
        }
        let channel = &d.channel;
        let t = match d.decision {
            Decision::Approve => {
                cx.emit(
                    EventKind::ApprovalDecided,
                    format!("approved by {} via {channel}", d.by),
                    serde_json::to_value(d)?,
                );
                state.approval = ApprovalStatus::Approved { by: d.by.clone(), plan_hash: plan_hash.clone() };
                Transition::To(Stage::Execute)
            }
            Decision::Deny => {
                let reason = d.reason.clone().unwrap_or_else(|| "no reason given".into());
                cx.emit(
                    EventKind::ApprovalDecided,
                    format!("denied by {} via {channel}: {reason}", d.by),
                    serde_json::to_value(d)?,
                );
                state.approval = ApprovalStatus::Denied { by: d.by.clone(), reason: reason.clone() };
                Transition::Escalate(format!("plan denied by {}: {reason}", d.by))
            }
            Decision::Expire => {
                cx.emit(EventKind::ApprovalDecided, "approval request expired undecided", serde_json::to_value(d)?);
                state.approval = ApprovalStatus::Denied { by: d.by.clone(), reason: "expired".into() };
                Transition::Escalate(format!(
                    "approval for plan {plan_hash} not decided within {} s",
                    self.deps.config.limits.approval_timeout_secs
                ))
            }
        };
        let events = cx.take_events();
        apply(&self.bus, &self.deps, state, t, events, Vec::new()).await?;
        Ok(())
    }
}

/// Every `every`, publish an `expire` decision for each request past its deadline. Decisions
/// are deduplicated by message id, so any number of approval workers may sweep. Told to stop,
/// it stops at once, mid-sweep too: while NATS takes no expiry each publish waits out its ack,
/// and a sweep of a hundred would hold the stopping worker for minutes. An expiry left
/// unpublished is published by the next sweep, of this worker or another.
pub async fn sweep_expired(bus: Bus, deps: Arc<Deps>, every: Duration, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = &mut shutdown => return,
        }
        tokio::select! {
            _ = sweep_once(&bus, &deps) => {}
            _ = &mut shutdown => return,
        }
    }
}

/// Publish an `expire` decision for each request past its deadline (at most 100).
async fn sweep_once(bus: &Bus, deps: &Deps) {
    let expired = match deps.store.pending_approvals(true, 100).await {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(error = %e, "cannot list expired approvals");
            return;
        }
    };
    for p in expired {
        let d = ApprovalDecision {
            run_id: p.run_id,
            decision: Decision::Expire,
            by: "pitcrew".into(),
            plan_hash: Some(p.plan_hash.clone()),
            reason: Some(format!("undecided since {}", p.requested_at)),
            channel: "timeout".into(),
            decided_at: chrono::Utc::now(),
        };
        let payload = serde_json::to_vec(&d).expect("decision serialises");
        // For the attempt whose request expired: one held up until a later attempt asks
        // for the same plan again must not expire that fresh request.
        let id = format!("{}.{}.{}.expire", p.run_id, p.plan_hash, p.attempt);
        let headers = pitcrew_runtime::approvals::decision_headers(&id, p.run_id, p.attempt);
        if let Err(e) = bus.publish_with_headers(bus.subjects.approval_decided(p.run_id), headers, payload.into()).await
        {
            tracing::warn!(run = %p.run_id, error = %e, "cannot publish expiry");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decision is retried whatever its deliveries while it fails for a while; one NATS
    /// refuses every time (its permissions) is dead-lettered for a human, not retried for good.
    #[test]
    fn a_refusal_is_permanent_and_a_failed_publish_is_not() {
        let refused = BusError::Refused { what: "publish".into(), error: "permissions violation".into() };
        assert!(matches!(DecideError::from(refused), DecideError::Permanent(_)));
        let applied = ApplyError::Bus(BusError::Refused { what: "publish".into(), error: "denied".into() });
        assert!(matches!(DecideError::from(applied), DecideError::Permanent(_)));
        let lost = BusError::Publish { subject: "s".into(), error: "timed out".into() };
        assert!(matches!(DecideError::from(lost), DecideError::Transient(_)));
    }
}
