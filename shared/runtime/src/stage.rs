//! The stage contract: `handle(state, cx) -> Result<Transition, StageError>`. A stage crate holds
//! only domain logic; the runner does consuming, persisting, publishing and acking.

use crate::config::Config;
use crate::store::{Record, Store, StoreError};
use chrono::Utc;
use futures::future::BoxFuture;
use pitcrew_exec::Executor;
use pitcrew_llm::Reasoner;
use pitcrew_model::{ApprovalRequest, EventKind, Outcome, RunEvent, RunState, Stage};
use std::sync::Arc;
use uuid::Uuid;

/// What every stage may use. Built once per process.
pub struct Deps {
    pub config: Arc<Config>,
    pub store: Store,
    pub reasoner: Arc<dyn Reasoner>,
    pub executor: Arc<dyn Executor>,
    /// The policy gate (approval gates plans; diagnose checks evidence commands with it).
    pub policy: Arc<pitcrew_policy::Policy>,
    /// This process's name (host:pid unless configured).
    pub worker: String,
    /// Live events (a model's answer as it streams); None where nothing watches.
    pub live: Option<crate::live::Live>,
    /// Set when this process stops taking work (SIGTERM).
    pub stopping: Stopping,
}

/// When this process stops taking work: set once, on SIGTERM, to the end of its drain
/// (`stages.drain_secs`). A step asks it before starting what it might not finish by then.
#[derive(Debug, Clone, Default)]
pub struct Stopping(Arc<std::sync::OnceLock<std::time::Instant>>);

impl Stopping {
    /// The process stops: what it holds has `drain` from now (the consumers' own deadline
    /// starts a little later, once their last pull has ended).
    pub fn begin(&self, drain: std::time::Duration) {
        let now = std::time::Instant::now();
        // A drain too long for the clock is no deadline: nothing is ever refused for it.
        if let Some(end) = now.checked_add(drain) {
            let _ = self.0.set(end);
        }
    }

    /// What is left of the drain, once the process is stopping.
    pub fn left(&self) -> Option<std::time::Duration> {
        self.0.get().map(|end| end.saturating_duration_since(std::time::Instant::now()))
    }

    /// What is left of the drain when the process is stopping and that is less than `need`
    /// (what is about to start might not end by then); `None` otherwise.
    pub fn short_of(&self, need: std::time::Duration) -> Option<std::time::Duration> {
        self.left().filter(|left| *left < need)
    }
}

/// Where the run goes next.
#[derive(Debug, Clone, PartialEq)]
pub enum Transition {
    /// Send the state on to `Stage`.
    To(Stage),
    /// Send the state to escalate with this reason.
    Escalate(String),
    /// Park the run until a decision arrives for this request.
    Park(Box<ApprovalRequest>),
    /// The run is over (report and escalate only).
    Done(Outcome),
    /// Nothing follows (a duplicate incident): only the events are kept.
    Drop,
}

/// What the runner must do when a stage fails.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// Worth retrying later (a database or network hiccup): nak with backoff.
    #[error("transient: {0}")]
    Transient(String),
    /// Postgres failed the step for a passing reason (a lost connection, a deadlock, a lock
    /// or statement timeout): naked with backoff whatever the message's deliveries, as a
    /// commit that fails for a while is. Past its limits after an outage, a backlog would
    /// otherwise be dead-lettered for one dropped connection.
    #[error("transient: {0}")]
    Store(String),
    /// Retrying cannot help: dead-letter the message and escalate its run.
    #[error("{0}")]
    Poison(String),
    /// Not a failure: the step must wait for something outside it (another run's
    /// remediation of the same target, a command that may still be running, another worker).
    /// Naked after `retry`, logged at info, never dead-lettered: the stage bounds its own
    /// wait. With a `note`, the wait is also put on the run's timeline (once a kind a step).
    #[error("waiting: {why}")]
    Wait { why: String, retry: std::time::Duration, note: Option<WaitNote> },
}

/// The kinds of wait a step puts on its run's timeline. Each has its own event index, so the
/// note of one never hides another's (a note is stored and published once per index).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitNote {
    /// Another run holds the target, or runs that came first wait for it.
    Target = 0,
    /// A command an earlier delivery started may still be running.
    Straggler = 1,
    /// This worker is stopping: another takes the step over.
    Stopping = 2,
    /// A command an earlier delivery claimed but never started is claimed anew.
    Reclaimed = 3,
}

/// The last kind must stay inside the range the runner gives wait notes (keep it the last).
const _: () = assert!((WaitNote::Reclaimed as u32) < crate::runner::WAIT_NOTE_KINDS, "a wait note past its range");

impl WaitNote {
    /// Its event index under the seq it is filed at (`runner::WAIT_EVENT_INDEX` and up).
    pub fn index(self) -> u32 {
        crate::runner::WAIT_EVENT_INDEX + self as u32
    }
}

impl From<StoreError> for StageError {
    fn from(e: StoreError) -> Self {
        if e.is_transient() {
            StageError::Store(e.to_string())
        } else {
            StageError::Poison(e.to_string())
        }
    }
}

/// The per-message context: dependencies and the events this step emits.
pub struct Cx<'a> {
    pub deps: &'a Deps,
    stage: Stage,
    run_id: Uuid,
    seq: u32,
    next_index: u32,
    events: Vec<RunEvent>,
    records: Vec<Record>,
    /// How long the message of this step has been waiting to be done (since it was
    /// published; its earlier deliveries included).
    age: std::time::Duration,
    /// When this delivery's step began (its `age` was taken then).
    began: std::time::Instant,
}

/// What a step gives the model at least, each delivery, before the playbook answers (or
/// `playbook_after_secs`, if shorter): see [`Cx::playbook_at`].
const MODEL_AT_LEAST: std::time::Duration = std::time::Duration::from_secs(60);

/// [`Cx::playbook_at`] for a delivery that `began` with its message `age` old.
fn model_deadline(
    began: std::time::Instant,
    age: std::time::Duration,
    after: std::time::Duration,
    waited: bool,
) -> Option<std::time::Instant> {
    if after.is_zero() {
        return None;
    }
    let left = if waited { std::time::Duration::ZERO } else { after.saturating_sub(age) };
    // A setting past what a clock holds (years) is no limit.
    began.checked_add(left.max(after.min(MODEL_AT_LEAST)))
}

impl<'a> Cx<'a> {
    /// A context for one step of `run_id`; events are keyed by (run, `seq`, index from `first_index`).
    pub fn new(deps: &'a Deps, stage: Stage, run_id: Uuid, seq: u32, first_index: u32) -> Self {
        Cx {
            deps,
            stage,
            run_id,
            seq,
            next_index: first_index,
            events: Vec::new(),
            records: Vec::new(),
            age: std::time::Duration::ZERO,
            began: std::time::Instant::now(),
        }
    }

    pub(crate) fn set_age(&mut self, age: std::time::Duration) {
        self.age = age;
        self.began = std::time::Instant::now();
    }

    /// Whether a reasoning provider that cannot be reached should answer this step from the
    /// offline playbook (`[reasoning] playbook_after_secs`).
    fn playbook_now(&self) -> bool {
        let after = self.deps.config.reasoning.playbook_after_secs;
        after > 0 && self.age >= std::time::Duration::from_secs(after)
    }

    /// When a provider still at work on this step answers from the offline playbook instead:
    /// `[reasoning] playbook_after_secs` from the step's hand-over, but never less than a
    /// minute (or all of a shorter `playbook_after_secs`) from this delivery's start, so a step
    /// that waited in line, or is delivered again, still gives the model that long. `waited`:
    /// the run already waited on the model (its diagnosis is the playbook's), so only that
    /// minute. None when `playbook_after_secs` is 0 (never).
    fn playbook_at(&self, waited: bool) -> Option<std::time::Instant> {
        let after = std::time::Duration::from_secs(self.deps.config.reasoning.playbook_after_secs);
        model_deadline(self.began, self.age, after, waited)
    }

    /// Bound the model's work on this step in `input`: its deadline ([`playbook_at`](Self::playbook_at)),
    /// and the playbook's answer for a provider that cannot be reached once the step has tried
    /// long enough ([`playbook_now`](Self::playbook_now)). An input that already lets the
    /// playbook answer at once (the run waited on the model before: a playbook diagnosis) gets
    /// only the minimum.
    pub fn bound_model(&self, input: &mut pitcrew_llm::ReasonInput<'_>) {
        input.playbook_at = self.playbook_at(input.fallback_if_unreachable);
        input.fallback_if_unreachable |= self.playbook_now();
    }

    /// Leave the next index unused.
    pub fn leave_index(&mut self) {
        self.next_index += 1;
    }

    /// Add a timeline event (stored and published once the step commits): redacted, storable,
    /// its message clipped and its data bounded, so it fits one bus message.
    pub fn emit(&mut self, kind: EventKind, message: impl Into<String>, mut data: serde_json::Value) {
        // Secrets never reach the timeline, the bus or Postgres; nor a NUL, which Postgres
        // refuses (the event, and the step holding it, would never be stored).
        pitcrew_model::redact::redact_json(&mut data);
        pitcrew_model::trim::storable_json(&mut data);
        pitcrew_model::trim::bounded_json(&mut data);
        let message = pitcrew_model::trim::storable(pitcrew_model::redact::redact(&message.into()).into_owned());
        self.events.push(RunEvent {
            run_id: self.run_id,
            seq: self.seq,
            index: self.next_index,
            stage: self.stage,
            kind,
            message: pitcrew_model::trim::clip(&message, 2000),
            data,
            worker: self.deps.worker.clone(),
            at: Utc::now(),
        });
        self.next_index += 1;
    }

    pub fn events(&self) -> &[RunEvent] {
        &self.events
    }

    pub fn take_events(&mut self) -> Vec<RunEvent> {
        std::mem::take(&mut self.events)
    }

    /// Write a row with this step's transition (in its statement; not at all if the run
    /// does not take it).
    pub fn record(&mut self, record: Record) {
        self.records.push(record);
    }

    pub fn take_records(&mut self) -> Vec<Record> {
        std::mem::take(&mut self.records)
    }

    pub fn config(&self) -> &Config {
        &self.deps.config
    }

    /// Stream a model's answer for this transition as live `thinking` events.
    pub fn thinking(&self) -> Option<crate::live::Thinking> {
        let live = self.deps.live.as_ref()?;
        Some(crate::live::Thinking::start(live, self.run_id, self.seq, self.stage, self.deps.worker.clone()))
    }
}

/// One stage of the graph. Object-safe so a process can run any subset.
pub trait StageHandler: Send + Sync + 'static {
    fn stage(&self) -> Stage;
    /// Decide what happens to the run. May mutate the state (diagnosis, plan, ...); must be
    /// idempotent: a redelivery calls it again with the same input.
    fn handle<'a>(
        &'a self,
        state: &'a mut RunState,
        cx: &'a mut Cx<'_>,
    ) -> BoxFuture<'a, Result<Transition, StageError>>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// The model gets what is left of `playbook_after_secs` since the hand-over, but at least a
    /// minute (or all of a shorter setting) each delivery; only that minute once the run
    /// waited on it already; no limit with 0.
    #[test]
    fn the_models_deadline_counts_from_the_hand_over_with_a_floor() {
        let now = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(model_deadline(now, s(0), s(300), false), Some(now + s(300)));
        assert_eq!(model_deadline(now, s(100), s(300), false), Some(now + s(200)));
        assert_eq!(model_deadline(now, s(290), s(300), false), Some(now + s(60)), "waited in line: a minute");
        assert_eq!(model_deadline(now, s(900), s(300), false), Some(now + s(60)), "delivered again, past it");
        assert_eq!(model_deadline(now, s(0), s(300), true), Some(now + s(60)), "the run waited already");
        assert_eq!(model_deadline(now, s(5), s(2), false), Some(now + s(2)), "a shorter setting, whole");
        assert_eq!(model_deadline(now, s(0), s(0), false), None, "0: never");
        assert_eq!(model_deadline(now, s(0), s(u64::MAX), false), None, "past what a clock holds: no limit");
    }
}
