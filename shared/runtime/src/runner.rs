//! The stage runner: decode, call the stage, then commit to Postgres, publish the events and
//! the successor, and only then ack. Poison goes to the dead-letter subject and escalates.

use crate::bus::{
    Bus, BusError, DROPPED_HEADER, ERROR_HEADER, MAX_MESSAGE, ORIGIN_HEADER, RUN_HEADER, STAGE_HEADER, TRUNCATED_HEADER,
};
use crate::consume::{backoff, Disposition, MessageHandler};
use crate::stage::{Cx, Deps, StageError, StageHandler, Transition};
use crate::store::{Record, RunStatus, StoreError};
use async_nats::header::{HeaderMap, NATS_MESSAGE_ID};
use async_nats::jetstream;
use futures::future::BoxFuture;
use futures::FutureExt;
use pitcrew_model::codec::{self, CONTENT_TYPE, JSON, MSGPACK};
use pitcrew_model::{ApprovalRequest, EventKind, Incident, Outcome, RunEvent, RunState, Stage, RUN_STATE_VERSION};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use tracing::Instrument;
use uuid::Uuid;

/// First event index of runtime events about poison messages (2 a delivery, up to
/// `POISON_EVENT_END`).
const POISON_EVENT_BASE: u32 = 10_000;
/// How many deliveries of one message get poison events of their own.
const POISON_DELIVERIES: u32 = 100_000;
const POISON_EVENT_END: u32 = POISON_EVENT_BASE + 2 * POISON_DELIVERIES + 1;
/// Index of a refused incident's `rejected` event: one an incident, whichever delivery
/// writes it, so a delivery after one whose publish landed but whose answer was lost writes
/// the same event again (deduplicated) instead of a second end.
const REJECTED_EVENT_INDEX: u32 = POISON_EVENT_END + 1;
/// First event index of approval decisions' events: each decision has `DECISION_EVENTS`
/// indexes of its own from [`decision_event_index`], within `DECISION_EVENT_SPAN`.
pub const DECISION_EVENT_BASE: u32 = 300_000;
pub const DECISION_EVENT_SPAN: u32 = 699_000;
/// Events one decision emits at most (an expiry: why, then the decision).
pub const DECISION_EVENTS: u32 = 2;

/// The first event index of the decision at `stream_seq` on the decisions' stream: the same
/// for every delivery of it, and `DECISION_EVENTS` apart from its neighbours' (decisions set
/// aside leave the run's seq as it was, so consecutive decisions file under one seq, and
/// overlapping indexes would make one's second event and the next one's first one row).
pub fn decision_event_index(stream_seq: u64) -> u32 {
    const SLOTS: u64 = (DECISION_EVENT_SPAN / DECISION_EVENTS) as u64;
    DECISION_EVENT_BASE + (stream_seq % SLOTS) as u32 * DECISION_EVENTS
}
/// The end of the decisions' event indexes.
pub const DECISION_EVENT_END: u32 = DECISION_EVENT_BASE + DECISION_EVENT_SPAN + DECISION_EVENTS;
/// Index of the first timeline event saying a step waits (one a kind of wait a step, up to
/// `WAIT_EVENT_INDEX + WAIT_NOTE_KINDS - 1`: `WaitNote::index`), above every other event
/// stored under a transition's seq (its step's own from 0, poison events from
/// `POISON_EVENT_BASE`, approval decisions from `DECISION_EVENT_BASE`, live ones from
/// 1_000_000, not stored), so they sort last under the seq they are filed at; below the
/// gateway's resolved event (2_000_000, seq 0 only).
pub const WAIT_EVENT_INDEX: u32 = 1_500_000;
/// How many indexes from `WAIT_EVENT_INDEX` wait notes may use.
pub const WAIT_NOTE_KINDS: u32 = 16;
/// Live events' first index (never stored).
const LIVE_EVENT_BASE: u32 = crate::live::FIRST_INDEX;

// The ranges never meet: two events of one run under one seq and one index are one row, and
// the second is dropped. A step's own events stay below `POISON_EVENT_BASE`.
const _: () = assert!(REJECTED_EVENT_INDEX < DECISION_EVENT_BASE);
const _: () = assert!(DECISION_EVENT_END <= LIVE_EVENT_BASE);
const _: () = assert!(LIVE_EVENT_BASE < WAIT_EVENT_INDEX && WAIT_EVENT_INDEX + WAIT_NOTE_KINDS < 2_000_000);

/// How long a wait's timeline note may take before the message is naked without it.
const NOTE_WAIT_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Failing to commit or publish: worth a retry, unless Postgres or NATS refused it for good.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Bus(#[from] BusError),
}

impl ApplyError {
    /// Postgres unreachable or busy (a deadlock, a statement timeout, a lock not granted), or a
    /// publish NATS did not take in time: an outage, however often the message came before.
    /// A permission NATS refuses, or a statement Postgres refuses as written, is not.
    pub fn is_transient(&self) -> bool {
        match self {
            ApplyError::Store(e) => e.is_transient(),
            ApplyError::Bus(BusError::Refused { .. } | BusError::Setup { .. } | BusError::Misconfigured { .. }) => {
                false
            }
            ApplyError::Bus(_) => true,
        }
    }
}

/// Why a message cannot be read as this stage's input.
enum Unreadable {
    /// Never will be: dead-letter it.
    Bad(String),
    /// Written by a newer worker: leave it for one.
    Newer(String),
}

/// Just the version of a run state, whatever else its layout holds.
#[derive(serde::Deserialize)]
struct Versioned {
    version: u32,
}

/// How long a worker leaves a run state written by a newer worker before looking again.
const NEWER_STATE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Runs one stage handler over its consumer's messages.
pub struct StageRunner {
    pub bus: Bus,
    pub deps: Arc<Deps>,
    pub handler: Arc<dyn StageHandler>,
}

impl MessageHandler for StageRunner {
    fn name(&self) -> String {
        self.handler.stage().to_string()
    }

    fn handle(self: Arc<Self>, msg: Arc<jetstream::Message>) -> BoxFuture<'static, Disposition> {
        Box::pin(async move { self.process(&msg).await })
    }
}

/// How long ago the message was stored (its first publish): every delivery of it included.
fn age_of(info: &jetstream::message::Info<'_>) -> std::time::Duration {
    std::time::Duration::try_from(time::OffsetDateTime::now_utc() - info.published).unwrap_or_default()
}

/// Why a message has had enough deliveries: more than `max_deliveries` and older than
/// `poison_after`. Such a message still gets its try (not while Postgres is unreachable), and
/// is dead-lettered only when that fails too.
pub fn exhausted(msg: &jetstream::Message, settings: crate::config::StageSettings) -> Option<String> {
    let info = msg.info().ok()?;
    let age = age_of(&info);
    (info.delivered as u64 > settings.max_deliveries && age > settings.poison_after).then(|| {
        format!(
            "delivered {} times over {} s without success (limits: {} deliveries, {} s)",
            info.delivered,
            age.as_secs(),
            settings.max_deliveries,
            settings.poison_after.as_secs()
        )
    })
}

/// A message past its limits is neither tried nor dead-lettered while Postgres is unreachable
/// or read-only (`Store::writable`): that is an outage, not a poison message. `Some(nak)` then
/// (said in the log), `None` when Postgres answers. Asked again after a try that failed, so a
/// try failing because Postgres went away meanwhile (or its pool is swamped by the backlog an
/// outage left) waits too.
pub async fn outage(deps: &Deps, consumer: &str, delivered: i64) -> Option<Disposition> {
    match deps.store.writable().await {
        Err(e) if e.is_transient() => {
            tracing::warn!(consumer, error = %e, delivered, "Postgres cannot take writes: retrying the message later, not dead-lettering it");
            Some(Disposition::Nak(backoff(delivered)))
        }
        _ => None,
    }
}

/// Stream name, stream sequence and delivery count of a JetStream message.
pub fn delivery(msg: &jetstream::Message) -> (String, u64, i64) {
    match msg.info() {
        Ok(i) => (i.stream.to_string(), i.stream_sequence, i.delivered),
        Err(_) => (String::new(), 0, 1),
    }
}

pub fn header<'m>(msg: &'m jetstream::Message, name: &str) -> Option<&'m str> {
    msg.headers.as_ref().and_then(|h| h.get(name)).map(|v| v.as_str())
}

impl StageRunner {
    /// Handle one message inside its trace: the incoming `traceparent` is the parent of the
    /// stage span and what this step's messages carry on.
    async fn process(&self, msg: &jetstream::Message) -> Disposition {
        let parent = crate::trace::traceparent(msg.headers.as_ref());
        crate::trace::carrying(parent.clone(), self.process_in_trace(msg, parent)).await
    }

    async fn process_in_trace(&self, msg: &jetstream::Message, parent: Option<String>) -> Disposition {
        let stage = self.handler.stage();
        let (stream, stream_seq, delivered) = delivery(msg);
        let settings = self.deps.config.stage_settings(stage);
        // Past its limits, a message still gets its try, and is dead-lettered when that fails
        // too (a panic counts). Not tried while Postgres is unreachable: that is an outage, not
        // a poison message (dead-lettered then, an intake is refused for want of a run once
        // Postgres is back, any other step escalated untried, however long the outage).
        let exhausted = exhausted(msg, settings);
        if exhausted.is_some() {
            if let Some(wait) = outage(&self.deps, stage.as_str(), delivered).await {
                return wait;
            }
        }
        let mut state = match self.decode(msg, &stream, stream_seq) {
            Ok(s) => s,
            Err(Unreadable::Newer(why)) => {
                // Written by a newer worker (a rolling upgrade): not poison. Left for a worker
                // that reads it; this one looks again in a while. Past the limits, none came
                // (an upgrade rolled back): the DLQ keeps it for a human. Its run is left as it
                // is: this worker cannot read the state it would escalate.
                if let Some(limits) = &exhausted {
                    return self
                        .dead_letter_only(msg, &format!("{why}; no worker that reads it took it: {limits}"))
                        .await;
                }
                tracing::warn!(stage = %stage, error = %why, delivered, "run state from a newer worker: leaving it for one");
                return Disposition::Nak(NEWER_STATE_WAIT);
            }
            Err(Unreadable::Bad(why)) => return self.poison(msg, None, &why).await,
        };
        let input_seq = state.seq;
        // Everything this step does (the handler, its commands, model calls and tool calls,
        // the commit and the publishes) happens inside the stage span, so every log line of
        // it carries the run, and every span of it joins the run's trace.
        let span = tracing::info_span!(
            "stage",
            stage = %stage,
            run = %state.run_id,
            seq = input_seq,
            attempt = state.attempt,
            delivered,
            outcome = tracing::field::Empty,
        );
        crate::trace::adopt(&span, parent.as_deref());
        let work = async {
            // A delivery after the first may follow its step's commit (the publish after it
            // failed, or its worker died before the ack): the committed transition is sent on
            // without doing the step's work again (its model calls, its commands), however
            // often the publish fails (a full stages stream).
            if delivered > 1 {
                if let Some(done) = self.committed_already(&state, delivered).await {
                    tracing::Span::current().record("outcome", "committed");
                    return done;
                }
            }
            let mut cx = Cx::new(&self.deps, stage, state.run_id, input_seq, 0);
            if let Ok(info) = msg.info() {
                cx.set_age(age_of(&info));
            }
            // Index 0 is the start line's, used or not: the step's own events keep their
            // indexes, so their ids, on every delivery. A redelivery of a step whose commit
            // landed (its worker died before the ack) then finds its own transition refused
            // and sends the committed one on under the same ids (the bus drops them as
            // duplicates): its terminal event is not published a second time under another id.
            match start_line(stage, state.attempt, delivered) {
                Some((message, data)) => cx.emit(EventKind::Status, message, data),
                None => cx.leave_index(),
            }
            let handled = match AssertUnwindSafe(self.handler.handle(&mut state, &mut cx)).catch_unwind().await {
                Ok(handled) => handled,
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "no message".into());
                    tracing::error!(error = %what, delivered, "the stage handler panicked");
                    Err(StageError::Transient(format!("the stage handler panicked: {what}")))
                }
            };
            let span = tracing::Span::current();
            match handled {
                Ok(t) => {
                    span.record("outcome", transition_name(&t));
                    let events = cx.take_events();
                    let records = cx.take_records();
                    match apply(&self.bus, &self.deps, state, t, events, records).await {
                        Ok(()) => Disposition::Ack,
                        // The step did its work; writing it down failed for a while (`apply`
                        // is idempotent): retried whatever its deliveries, never a poison
                        // message. A message past its limits after a long outage would
                        // otherwise be dead-lettered, and its run escalated, for one deadlock
                        // in the backlog the outage left.
                        Err(e) if e.is_transient() => {
                            tracing::warn!(error = %e, delivered, "commit or publish failed: will retry");
                            Disposition::Nak(backoff(delivered))
                        }
                        Err(e) => {
                            self.failed_try(msg, exhausted.as_deref(), &e.to_string(), "commit or publish failed").await
                        }
                    }
                }
                Err(StageError::Transient(e)) => {
                    span.record("outcome", "transient");
                    self.failed_try(msg, exhausted.as_deref(), &e, "transient failure").await
                }
                Err(StageError::Store(e)) => {
                    span.record("outcome", "transient");
                    tracing::warn!(error = %e, delivered, "Postgres failed the step: will retry");
                    Disposition::Nak(backoff(delivered))
                }
                // Waiting is bounded by the stage itself (it escalates past its own limit), so
                // the deliveries it takes never count as failures: never dead-lettered for them.
                Err(StageError::Wait { why, retry, note }) => {
                    span.record("outcome", "waiting");
                    tracing::info!(reason = %why, retry_in_ms = retry.as_millis() as u64, delivered, "waiting");
                    if let Some(kind) = note {
                        // Bounded: a slow store or bus must not hold up the next look.
                        let note = self.note_wait(state.run_id, input_seq, &why, kind.index());
                        if tokio::time::timeout(NOTE_WAIT_LIMIT, note).await.is_err() {
                            tracing::warn!("cannot put the wait on the run's timeline in time (waiting anyway)");
                        }
                    }
                    Disposition::Nak(retry)
                }
                Err(StageError::Poison(e)) => {
                    span.record("outcome", "poison");
                    self.poison(msg, Some(state), &e).await
                }
            }
        };
        work.instrument(span).await
    }

    /// When Postgres holds this very step committed (the run open or parked, one transition
    /// past the message): send it on as a refused commit would, and say how to settle the
    /// message. None when it is not, or Postgres cannot say: the step runs as on a first
    /// delivery (and its commit finds out).
    async fn committed_already(&self, state: &RunState, delivered: i64) -> Option<Disposition> {
        let run = self.deps.store.load_run(state.run_id).await.ok()??;
        let parked_or_open = matches!(run.status, RunStatus::Open | RunStatus::WaitingApproval);
        if !parked_or_open || run.state.seq != state.seq + 1 {
            return None;
        }
        let committed = RunState { seq: state.seq + 1, ..state.clone() };
        match resend_stored(&self.bus, &self.deps, Some(run), &committed, (state.step, state.seq)).await {
            Ok(()) => Some(Disposition::Ack),
            Err(e) => {
                tracing::warn!(error = %e, delivered, "sending the committed step on failed: will retry");
                Some(Disposition::Nak(backoff(delivered)))
            }
        }
    }

    /// Put a step's wait on its run's timeline (stored and published), so `pitcrew watch` and
    /// the run's events say why it does not move on. Best effort: the wait goes on either way.
    async fn note_wait(&self, run: Uuid, seq: u32, why: &str, index: u32) {
        let stage = self.handler.stage();
        // Filed under the transition that brought the run here, after its events: the
        // timeline (ordered by seq, then index) shows the wait before the step's own events,
        // which are stored only when the step ends.
        let mut cx = Cx::new(&self.deps, stage, run, seq.saturating_sub(1), index);
        cx.emit(EventKind::Status, format!("{stage} waits: {why}"), serde_json::json!({ "waiting": why }));
        let events = cx.take_events();
        let written = async {
            self.deps.store.insert_events(&events).await.map_err(|e| e.to_string())?;
            publish_events(&self.bus, &events).await.map_err(|e| e.to_string())
        };
        if let Err(e) = written.await {
            tracing::warn!(error = %e, "cannot put the wait on the run's timeline (waiting anyway)");
        }
    }

    /// Decode the message into the state this stage works on.
    fn decode(&self, msg: &jetstream::Message, stream: &str, stream_seq: u64) -> Result<RunState, Unreadable> {
        let ct = header(msg, CONTENT_TYPE);
        let stage = self.handler.stage();
        if stage == Stage::Intake {
            let mut incident: Incident =
                codec::decode(ct, &msg.payload).map_err(|e| Unreadable::Bad(format!("bad incident: {e}")))?;
            // A publisher that sets no id gets one derived from the stream position:
            // a redelivery derives the same id, so it cannot open a second run.
            // The publish time is part of the key, so a recreated stream (sequences restart)
            // cannot hand out an old incident's id.
            let published = msg.info().map(|i| i.published.unix_timestamp_nanos()).unwrap_or(0);
            let id = *incident.id.get_or_insert_with(|| {
                Uuid::new_v5(&Uuid::NAMESPACE_OID, format!("{stream}:{stream_seq}:{published}").as_bytes())
            });
            return Ok(RunState::new(id, incident));
        }
        let newer = |version: u32| {
            Unreadable::Newer(format!(
                "run state version {version} is newer than this worker understands ({RUN_STATE_VERSION}): upgrade the worker"
            ))
        };
        let state: RunState = match codec::decode(ct, &msg.payload) {
            Ok(s) => s,
            Err(e) => {
                // A newer layout may not decode at all: its version field still says so.
                if let Ok(v) = codec::decode::<Versioned>(ct, &msg.payload) {
                    if v.version > RUN_STATE_VERSION {
                        return Err(newer(v.version));
                    }
                }
                return Err(Unreadable::Bad(format!("bad run state: {e}")));
            }
        };
        if state.version > RUN_STATE_VERSION {
            return Err(newer(state.version));
        }
        if state.step != stage {
            return Err(Unreadable::Bad(format!("run state addressed to {} arrived at {stage}", state.step)));
        }
        Ok(state)
    }

    /// A try that failed: retried later, or, for a message past its limits (`exhausted`),
    /// dead-lettered with both reasons.
    async fn failed_try(
        &self,
        msg: &jetstream::Message,
        exhausted: Option<&str>,
        error: &str,
        what: &str,
    ) -> Disposition {
        let (stream, stream_seq, delivered) = delivery(msg);
        let Some(limits) = exhausted else {
            tracing::warn!(error = %error, delivered, "{what}: will retry");
            return Disposition::Nak(backoff(delivered));
        };
        // `poison` waits out a Postgres outage before it dead-letters anything.
        let state = self.decode(msg, &stream, stream_seq).ok();
        self.poison(msg, state, &format!("{limits}; the last try: {error}")).await
    }

    /// Store the message in the DLQ, unless it is there already: a message whose run could
    /// not be escalated after its dead letter comes back (past the bus's duplicate window, it
    /// would be stored again). `Err` holds the retry when the publish failed.
    async fn dead_letter_once(&self, msg: &jetstream::Message, why: &str) -> Result<(), Disposition> {
        let stage = self.handler.stage();
        let (stream, stream_seq, delivered) = delivery(msg);
        let id = format!("{stream}.{stream_seq}");
        let (dlq, subject) = (self.bus.subjects.dlq_stream(), self.bus.subjects.dlq(stage.as_str()));
        // Any of the stage's dead letters since the message was first stored may be its own (the
        // last may be another's: it came back past the bus's duplicate window after another
        // message was dead-lettered).
        let since = msg.info().map(|i| i.published).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
        if matches!(self.bus.held_since(&dlq, &subject, &format!("dlq.{id}"), since).await, Ok(true)) {
            return Ok(());
        }
        tracing::error!(stage = %stage, error = %why, stream_seq, "poison message: dead-lettering");
        dead_letter(&self.bus, msg, stage.as_str(), why, &id).await.map_err(|e| {
            tracing::warn!(stage = %stage, error = %e, "dead-letter publish failed: will retry");
            Disposition::Nak(backoff(delivered))
        })
    }

    /// Dead-letter the message and settle it, its run left alone.
    async fn dead_letter_only(&self, msg: &jetstream::Message, why: &str) -> Disposition {
        match self.dead_letter_once(msg, why).await {
            Ok(()) => Disposition::Term,
            Err(wait) => wait,
        }
    }

    /// Dead-letter the message, then escalate its run (when it has one). Term only once the
    /// dead letter is safely stored; otherwise retry.
    async fn poison(&self, msg: &jetstream::Message, state: Option<RunState>, why: &str) -> Disposition {
        let stage = self.handler.stage();
        let (_, stream_seq, delivered) = delivery(msg);
        // Its run is looked up and escalated in Postgres after the dead letter: while Postgres
        // cannot take writes, each retry would store another dead letter (past the bus's
        // duplicate window) for the same message.
        if let Some(wait) = outage(&self.deps, stage.as_str(), delivered).await {
            tracing::warn!(stage = %stage, error = %why, stream_seq, "not dead-lettered while Postgres cannot take writes");
            return wait;
        }
        if let Err(wait) = self.dead_letter_once(msg, why).await {
            return wait;
        }
        // Find the run: from the decoded state, or the run header and the store.
        let state = match state {
            Some(s) => Some(s),
            None => match header(msg, RUN_HEADER).and_then(|r| r.parse::<Uuid>().ok()) {
                // An incident that does not decode opened no run, and its header names one on
                // its publisher's word alone (the monitor, the gateway): acting on that run
                // would let any publisher of incidents escalate any open run.
                Some(_) if stage == Stage::Intake => None,
                Some(run) => match self.deps.store.load_run(run).await {
                    Ok(found) => found.filter(|r| !r.status.is_final()).map(|r| r.state),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot load run of poison message: will retry");
                        return Disposition::Nak(backoff(delivered));
                    }
                },
                None => None,
            },
        };
        let Some(state) = state else { return Disposition::Term };
        // Runtime events about a poison message get indexes of their own, so they never
        // collide with events an earlier delivery stored for the same step.
        let index = POISON_EVENT_BASE + delivered.clamp(0, i64::from(POISON_DELIVERIES)) as u32 * 2;
        let run_exists = match self.deps.store.load_run(state.run_id).await {
            Ok(found) => found.is_some(),
            Err(e) if e.is_transient() => return Disposition::Nak(backoff(delivered)),
            Err(_) => false,
        };
        if stage == Stage::Intake && !run_exists {
            // A refused incident has no run: record why, under its id, for `pitcrew watch`. Its
            // one end: the same event at every delivery, not sent again once on the bus (past
            // the duplicate window, a second copy would be a second end).
            let mut cx = Cx::new(&self.deps, stage, state.run_id, 0, REJECTED_EVENT_INDEX);
            cx.emit(EventKind::Rejected, format!("incident refused: {why}"), serde_json::json!({ "error": why }));
            let events = cx.take_events();
            let stored = self.deps.store.insert_events(&events).await;
            let published = publish_fresh(&self.bus, events).await;
            if stored.is_err() || published.is_err() {
                return Disposition::Nak(backoff(delivered));
            }
            return Disposition::Term;
        }
        let mut cx = Cx::new(&self.deps, stage, state.run_id, state.seq, index);
        cx.emit(EventKind::Error, format!("{stage} failed: {why}"), serde_json::json!({ "error": why }));
        if stage == Stage::Escalate {
            // The run ends here, and whoever follows it on the bus (`pitcrew watch`, the
            // gateway's streams) waits for its end, which the escalate step never published;
            // unless it did before failing (its end is one a run).
            let end = self.bus.subjects.event(state.run_id, EventKind::Escalated.as_str());
            match self.bus.last_on(&self.bus.subjects.events_stream(), &end).await {
                Ok(Some(_)) => {}
                Ok(None) => {
                    let (reason, message) = match &state.escalation_reason {
                        Some(r) => (r.clone(), format!("{r} (the escalate step failed: {why})")),
                        None => (format!("{stage} failed: {why}"), format!("{stage} failed: {why}")),
                    };
                    cx.emit(
                        EventKind::Escalated,
                        format!("escalated {}: {message}", state.incident.service),
                        state.escalated_data(&reason),
                    );
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot tell whether the run's end is on the bus: will retry");
                    return Disposition::Nak(backoff(delivered));
                }
            }
        }
        let events = cx.take_events();
        let t = if stage == Stage::Escalate {
            Transition::Done(Outcome::Escalated)
        } else {
            Transition::Escalate(format!("{stage} failed: {why}"))
        };
        let mut state = state;
        if stage == Stage::Escalate && state.escalation_reason.is_none() {
            state.escalation_reason = Some(why.to_string());
        }
        let run = state.run_id;
        match apply(&self.bus, &self.deps, state, t, events, Vec::new()).await {
            Ok(()) => Disposition::Term,
            Err(e) if e.is_transient() => {
                tracing::warn!(error = %e, "escalating poisoned run failed: will retry");
                Disposition::Nak(backoff(delivered))
            }
            // Refused as written (by Postgres, or NATS' permissions): every retry would be
            // refused the same way, and the message is in the DLQ. The run is left as it is,
            // for a human.
            Err(e) => {
                tracing::error!(
                    stage = %stage, run = %run, error = %e, stream_seq,
                    "the run of a dead-lettered message cannot be escalated: it is left as it is, for a human \
                     (its message is in the DLQ)"
                );
                Disposition::Term
            }
        }
    }
}

/// The timeline line a step starts with, only when it tells something: a redelivery (a
/// worker died or timed out holding the message) or a retry attempt. The plain first delivery
/// of attempt 1 gets none: a step's events are stored and published together when it ends, so
/// a start line would appear no sooner than the step's own events, and would be half of a
/// clean run's events (each a row and a JetStream message).
fn start_line(stage: Stage, attempt: u32, delivered: i64) -> Option<(String, serde_json::Value)> {
    let data = serde_json::json!({ "attempt": attempt, "delivered": delivered });
    match (attempt, delivered) {
        (a, d) if a <= 1 && d <= 1 => None,
        (a, d) if d <= 1 => Some((format!("{stage}: attempt {a}"), data)),
        (a, d) => Some((format!("{stage}: attempt {a}, delivery {d}"), data)),
    }
}

/// A transition's name for the stage span.
fn transition_name(t: &Transition) -> &'static str {
    match t {
        Transition::To(_) => "next",
        Transition::Escalate(_) => "escalate",
        Transition::Park(_) => "park",
        Transition::Done(_) => "done",
        Transition::Drop => "drop",
    }
}

/// Commit a transition to Postgres (with the step's records), publish its events and its
/// successor. Idempotent: the store is keyed by (run, seq) and the bus deduplicates on the
/// message id.
pub async fn apply(
    bus: &Bus,
    deps: &Deps,
    mut state: RunState,
    t: Transition,
    events: Vec<RunEvent>,
    records: Vec<Record>,
) -> Result<(), ApplyError> {
    let store = &deps.store;
    let from = (state.step, state.seq);
    // A stale input (the run moved on, or is closed) commits nothing and publishes nothing:
    // a late redelivery must not fork the run.
    let stale = |run: uuid::Uuid| {
        tracing::info!(run = %run, "stale delivery: the run has moved on; dropping it");
        Ok(())
    };
    match t {
        Transition::To(next) => {
            state.advance(next);
            let payload = within_limit(&mut state);
            if !store.commit_transition_with(&state, RunStatus::Open, &events, records).await? {
                return resend_committed(bus, deps, &state, from).await;
            }
            publish_encoded(bus, &events, Some((&state, payload))).await?;
        }
        Transition::Escalate(reason) => {
            state.escalate(reason);
            let payload = within_limit(&mut state);
            if !store.commit_transition_with(&state, RunStatus::Open, &events, records).await? {
                return resend_committed(bus, deps, &state, from).await;
            }
            publish_encoded(bus, &events, Some((&state, payload))).await?;
        }
        Transition::Park(req) => {
            state.seq += 1;
            let mut records = records;
            // The request's row is written with the park, or not at all.
            records.push(Record::Approval(req.clone()));
            if !store.commit_transition_with(&state, RunStatus::WaitingApproval, &events, records).await? {
                // An earlier delivery of this step went on without approval (another process,
                // its policy not this one's) and its publish failed: send that on.
                return resend_committed(bus, deps, &state, from).await;
            }
            let req = with_stored_window(store, *req).await;
            // The request first, then the events: whoever sees `approval_requested` (an
            // operator, `pitcrew watch`, the demo) finds the request on the bridge subject.
            send_request(bus, &req).await?;
            publish_events(bus, &events).await?;
        }
        Transition::Done(outcome) => {
            state.outcome = Some(outcome);
            let status = match outcome {
                Outcome::Resolved => RunStatus::Resolved,
                Outcome::Escalated => RunStatus::Escalated,
            };
            if !store.commit_transition_with(&state, status, &events, records).await? {
                // Closed already. By this very step, on a delivery whose publish failed after
                // its commit? Then its events (the terminal one among them) never reached the
                // bus, and whoever follows the run there waits for them: publish them now
                // (their ids dedupe a publish that did land).
                let closed_here = store
                    .load_run(state.run_id)
                    .await?
                    .is_some_and(|r| r.status == status && r.state.seq == state.seq && r.state.step == state.step);
                if closed_here {
                    // Unless its end is on the bus already: past the bus's duplicate window (a
                    // redelivery after a long outage, a long ack wait) a publish that landed is
                    // not deduplicated, and followers would see the run end twice.
                    let end = events.iter().find(|e| e.kind.is_terminal());
                    let published = match end {
                        Some(end) => bus.holds_event(end).await?,
                        None => false,
                    };
                    if !published {
                        publish_events(bus, &events).await?;
                    }
                    return Ok(());
                }
                return stale(state.run_id);
            }
            // Counted where the run ends, once: not at each publish of its end (a publish that
            // failed, then the redelivery's, counted it twice).
            crate::metrics::run_finished(outcome.as_str());
            publish_events(bus, &events).await?;
        }
        Transition::Drop => {
            if !records.is_empty() {
                tracing::warn!(run = %state.run_id, "a dropped step takes no transition: its records are not written");
            }
            store.insert_events(&events).await?;
            publish_fresh(bus, events).await?;
        }
    }
    Ok(())
}

/// The successor state's payload, no larger than a stage accepts (`codec::MAX_PAYLOAD`): its
/// next stage would refuse a larger one as poison, and the run would stop there. A state that
/// sheds its oldest evidence and diagnoses and still does not fit goes to escalate instead of
/// its next step, the same transition (the same seq), with only what escalation reads; one on
/// its way to report or escalate already keeps its way, with as little.
fn within_limit(state: &mut RunState) -> Vec<u8> {
    let size = match state.encode_within(codec::MAX_PAYLOAD) {
        Ok(payload) => return payload,
        Err(size) => size,
    };
    let why = format!("the run's state grew to {size} bytes, more than the {} a stage accepts", codec::MAX_PAYLOAD);
    // A run on its way to report (verified: it resolves) or to escalate keeps its way, shed to
    // what those steps read; any other goes to escalate: a human, not a step on half its state.
    if matches!(state.step, Stage::Report | Stage::Escalate) {
        tracing::warn!(run = %state.run_id, step = %state.step, size, "{why}: sending on only what its end reads");
    } else {
        tracing::warn!(run = %state.run_id, step = %state.step, size, "{why}: escalating with what escalation needs");
        // The same transition, addressed elsewhere.
        state.seq -= 1;
        state.escalate(format!("{why} (its next step was {})", state.step));
    }
    state.shed_for_escalation();
    // Bounded now (the incident's own fields are): it fits.
    state.encode_within(codec::MAX_PAYLOAD).unwrap_or_else(|_| codec::to_msgpack(state))
}

/// A transition the store refused. When an earlier delivery of the same step committed one
/// (at the seq this one would have taken: to another step, its check said otherwise then, or
/// to the same step with another content, a model answered otherwise), that one stands, and
/// its state is sent on again with the events that step stored: its own publish may have
/// failed after its commit, and nothing else would move the run or tell its followers (the
/// bus drops them as duplicates if they did land). The store never takes a second open
/// transition of a step at the same seq: the run's row would then say one thing while the
/// message in flight, the first, said another. When the earlier delivery parked the run for
/// approval instead (the approval step in processes whose policies differ), its request and
/// events are sent on the same way. Anything else is a stale delivery: nothing to do.
/// `from`: the step and seq the refused transition left.
async fn resend_committed(bus: &Bus, deps: &Deps, refused: &RunState, from: (Stage, u32)) -> Result<(), ApplyError> {
    let stored = deps.store.load_run(refused.run_id).await?;
    resend_stored(bus, deps, stored, refused, from).await
}

/// [`resend_committed`] with the run as Postgres holds it, read already.
async fn resend_stored(
    bus: &Bus,
    deps: &Deps,
    stored: Option<crate::store::StoredRun>,
    refused: &RunState,
    from: (Stage, u32),
) -> Result<(), ApplyError> {
    match stored {
        Some(run) if run.status == RunStatus::Open && run.state.seq == refused.seq => {
            tracing::info!(
                run = %refused.run_id, committed = %run.state.step, refused = %refused.step,
                "an earlier delivery of this step committed first: sending its transition on"
            );
            let events = deps.store.step_events(refused.run_id, from.1, from.0).await?;
            publish_batch(bus, &events, Some(&run.state)).await?;
        }
        Some(run)
            if run.status == RunStatus::WaitingApproval && run.state.seq == refused.seq && run.state.step == from.0 =>
        {
            // An earlier delivery parked the run (another process, its policy not this one's):
            // the park stands. Its request and events are sent again from what it stored,
            // unless they reached the bus (the request goes first, its event last): that
            // delivery's publish may have failed after its commit.
            let events = deps.store.step_events(refused.run_id, from.1, from.0).await?;
            let Some(asked) = events.iter().find(|e| e.kind == EventKind::ApprovalRequested) else {
                tracing::warn!(run = %refused.run_id, "the run is parked, but its step stored no request to send again");
                return Ok(());
            };
            if bus.holds_event(asked).await? {
                tracing::info!(run = %refused.run_id, "stale delivery: the run is parked for approval; dropping it");
                return Ok(());
            }
            tracing::info!(
                run = %refused.run_id, refused = %refused.step,
                "an earlier delivery of this step parked the run for approval: sending its request on"
            );
            match serde_json::from_value::<ApprovalRequest>(asked.data.clone()) {
                Ok(req) => send_request(bus, &with_stored_window(&deps.store, req).await).await?,
                Err(e) => {
                    tracing::warn!(run = %refused.run_id, error = %e, "the parked step's request cannot be read back: not sent again")
                }
            }
            publish_events(bus, &events).await?;
        }
        _ => tracing::info!(run = %refused.run_id, "stale delivery: the run has moved on; dropping it"),
    }
    Ok(())
}

/// `req` with its times as Postgres wrote them, by its clock, which decides its deadline (the
/// event's copy holds the parking worker's): a bridge or the CLI reading a worker's clock that
/// is behind would refuse the request as expired. Unread (Postgres gone since the commit):
/// as it came.
async fn with_stored_window(store: &crate::Store, mut req: ApprovalRequest) -> ApprovalRequest {
    match store.approval_window(req.run_id, &req.plan_hash).await {
        Ok(Some((at, until))) => (req.requested_at, req.expires_at) = (at, until),
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(run = %req.run_id, error = %e, "cannot read the request's deadline back: sending this worker's")
        }
    }
    req
}

/// Publish an approval request on the bridge subject, unless it is there already: a step
/// delivered again past the bus's duplicate window would show it to approvers twice. The
/// attempt is in its id: the same plan asked for again by a later attempt is a new request,
/// not a duplicate the bus drops.
async fn send_request(bus: &Bus, req: &ApprovalRequest) -> Result<(), BusError> {
    let id = format!("{}.{}.{}.request", req.run_id, req.plan_hash, req.attempt);
    let subject = bus.subjects.approval_requested(req.run_id);
    if bus.holds(&bus.subjects.approvals_stream(), &subject, &id).await? {
        return Ok(());
    }
    let payload = serde_json::to_vec(req).expect("approval request serialises");
    bus.publish(subject, &id, JSON, Some(req.run_id), payload.into()).await
}

/// Publish a state to the stage it is addressed to.
pub async fn publish_state(bus: &Bus, state: &RunState) -> Result<(), BusError> {
    publish_batch(bus, &[], Some(state)).await
}

/// Publish those of `events` the bus does not hold yet. Each is on a subject of its own (its
/// run's, its kind's): one on the bus already (a delivery whose acks were lost, redelivered
/// past the duplicate window) is not published again, or followers would see it twice.
async fn publish_fresh(bus: &Bus, events: Vec<RunEvent>) -> Result<(), BusError> {
    let mut fresh = Vec::with_capacity(events.len());
    for e in events {
        if !bus.holds_event(&e).await? {
            fresh.push(e);
        }
    }
    publish_events(bus, &fresh).await
}

/// Publish events to `pitcrew.events.<run>.<kind>`, all at once, then wait for every ack.
pub async fn publish_events(bus: &Bus, events: &[RunEvent]) -> Result<(), BusError> {
    publish_batch(bus, events, None).await
}

/// Publish the events, then the successor state, without waiting in between, then wait for
/// every ack: one round trip to the server for the lot. One connection keeps their order, so
/// the next stage's events still follow this stage's in the stream.
pub async fn publish_batch(bus: &Bus, events: &[RunEvent], state: Option<&RunState>) -> Result<(), BusError> {
    publish_encoded(bus, events, state.map(|s| (s, codec::to_msgpack(s)))).await
}

/// `publish_batch` with the state already encoded.
async fn publish_encoded(bus: &Bus, events: &[RunEvent], state: Option<(&RunState, Vec<u8>)>) -> Result<(), BusError> {
    let mut acks = Vec::with_capacity(events.len() + 1);
    let failed = |subject: &str, err: String| BusError::Publish { subject: subject.to_string(), error: err };
    for e in events {
        let subject = bus.subjects.event(e.run_id, e.kind.as_str());
        let payload = serde_json::to_vec(e).expect("event serialises");
        let ack = bus
            .js
            .publish_with_headers(subject.clone(), crate::bus::headers(&e.msg_id(), JSON, None), payload.into())
            .await
            .map_err(|err| failed(&subject, err.to_string()))?;
        acks.push((subject, ack));
    }
    if let Some((state, payload)) = state {
        let subject = bus.subjects.stage(state.step);
        let headers = crate::bus::headers(&state.msg_id(), MSGPACK, Some(state.run_id));
        let ack = bus
            .js
            .publish_with_headers(subject.clone(), headers, payload.into())
            .await
            .map_err(|err| failed(&subject, err.to_string()))?;
        acks.push((subject, ack));
    }
    for (subject, ack) in acks {
        ack.await.map_err(|err| {
            bus.unacked(&subject, &err);
            failed(&subject, err.to_string())
        })?;
    }
    Ok(())
}

/// Room kept in a dead letter for its own headers (the reason, the stage, the origin, the id).
const DLQ_OWN_HEADERS: usize = 4 * 1024;

/// The most of a message's own headers a dead letter carries; past it, none are kept.
const DLQ_KEPT_HEADERS: usize = 16 * 1024;

/// Publish the original payload and headers to `pitcrew.dlq.<stage>` with the reason. Always
/// something the DLQ stream stores: a letter it refused would be retried for good, the
/// message held unsettled meanwhile. So the original's `Nats-` headers are not copied (they
/// are instructions to the server: `Nats-Expected-Stream` names another stream,
/// `Nats-Rollup` would purge the DLQ), nor its other headers when they are large, and a
/// payload too large to fit beside them is cut (header `Pitcrew-Truncated`: its full size).
pub async fn dead_letter(
    bus: &Bus,
    msg: &jetstream::Message,
    stage: &str,
    why: &str,
    id: &str,
) -> Result<(), BusError> {
    let mut headers = HeaderMap::new();
    let mut kept = 0;
    if let Some(h) = &msg.headers {
        fn name(k: &async_nats::HeaderName) -> &str {
            k.as_ref()
        }
        let copied = h.iter().filter(|(k, _)| !name(k).get(..5).is_some_and(|p| p.eq_ignore_ascii_case("nats-")));
        let size: usize =
            copied.clone().map(|(k, vs)| vs.iter().map(|v| name(k).len() + v.as_str().len() + 4).sum::<usize>()).sum();
        if size <= DLQ_KEPT_HEADERS {
            for (k, vs) in copied {
                for v in vs {
                    headers.append(k.clone(), v.clone());
                }
            }
            kept = size;
        } else {
            headers.insert(DROPPED_HEADER, format!("{size} bytes of headers").as_str());
        }
    }
    headers.insert(NATS_MESSAGE_ID, format!("dlq.{id}").as_str());
    headers.insert(ERROR_HEADER, pitcrew_model::trim::clip(&why.replace(['\r', '\n'], " "), 1000).as_str());
    headers.insert(STAGE_HEADER, stage);
    headers.insert(ORIGIN_HEADER, pitcrew_model::trim::clip(msg.subject.as_str(), 256).as_str());
    let room = MAX_MESSAGE - DLQ_OWN_HEADERS - kept;
    let payload = if msg.payload.len() > room {
        headers.insert(TRUNCATED_HEADER, msg.payload.len().to_string().as_str());
        msg.payload.slice(..room)
    } else {
        msg.payload.clone()
    };
    bus.publish_with_headers(bus.subjects.dlq(stage), headers, payload).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbouring_decisions_never_share_an_event_index() {
        for seq in [0u64, 1, 2, 349_498, 349_499, 349_500, 1 << 40, u64::MAX - 1] {
            let (a, b) = (decision_event_index(seq), decision_event_index(seq + 1));
            let (ra, rb) = (a..a + DECISION_EVENTS, b..b + DECISION_EVENTS);
            assert!(!ra.clone().any(|i| rb.contains(&i)), "seq {seq}: {ra:?} and {rb:?} overlap");
            for r in [ra, rb] {
                assert!(r.start >= DECISION_EVENT_BASE && r.end <= DECISION_EVENT_END, "seq {seq}: {r:?}");
            }
        }
        assert_eq!(decision_event_index(7), decision_event_index(7), "a decision delivered again keeps its index");
    }

    /// Commands no compression makes small, more than any message may carry.
    fn state_commands() -> Vec<String> {
        (0..1000u32).map(|i| format!("{i}:{}", "x".repeat(300) + &i.to_string().repeat(60))).collect()
    }

    #[test]
    fn a_state_too_large_for_its_next_stage_goes_to_escalate_in_the_same_transition() {
        let mut state = RunState::new(Uuid::now_v7(), Incident::new("web", "down"));
        state.advance(Stage::Diagnose);
        state.advance(Stage::Plan);
        // Commands no compression makes small, more than any message may carry.
        state.failed_commands = state_commands();
        let seq = state.seq;
        let payload = within_limit(&mut state);
        assert!(payload.len() <= codec::MAX_PAYLOAD, "{}", payload.len());
        assert_eq!((state.step, state.seq), (Stage::Escalate, seq), "the same transition, to escalate");
        let reason = state.escalation_reason.clone().unwrap();
        assert!(
            reason.contains("more than the 262144 a stage accepts") && reason.contains("next step was plan"),
            "{reason}"
        );
        let back: RunState = codec::decode(Some(MSGPACK), &payload).expect("escalate can read it");
        assert_eq!(back, state);
        // A verified run on its way to report keeps its way, shed.
        let mut verified = RunState::new(Uuid::now_v7(), Incident::new("web", "down"));
        verified.failed_commands = state_commands();
        verified.advance(Stage::Report);
        let seq = verified.seq;
        let payload = within_limit(&mut verified);
        assert!(payload.len() <= codec::MAX_PAYLOAD, "{}", payload.len());
        assert_eq!((verified.step, verified.seq, verified.escalation_reason.as_deref()), (Stage::Report, seq, None));
        // A state that fits is sent as it is.
        let mut small = RunState::new(Uuid::now_v7(), Incident::new("web", "down"));
        small.advance(Stage::Diagnose);
        let before = small.clone();
        assert_eq!(within_limit(&mut small), codec::to_msgpack(&before));
        assert_eq!(small, before);
    }

    #[test]
    fn a_step_starts_with_a_line_only_on_a_redelivery_or_a_retry() {
        assert_eq!(start_line(Stage::Diagnose, 1, 1), None);
        let (line, data) = start_line(Stage::Plan, 2, 1).expect("a retry attempt is marked");
        assert_eq!(line, "plan: attempt 2");
        assert_eq!(data, serde_json::json!({ "attempt": 2, "delivered": 1 }));
        let (line, data) = start_line(Stage::Execute, 1, 3).expect("a redelivery is marked");
        assert_eq!(line, "execute: attempt 1, delivery 3");
        assert_eq!(data, serde_json::json!({ "attempt": 1, "delivered": 3 }));
    }
}
