//! Timeline events: published on `pitcrew.events.<run>.<kind>` and stored in `run_events`.

use crate::Stage;
use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// What happened. Terminal kinds end `pitcrew watch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A stage took the run.
    Status,
    Evidence,
    Diagnosis,
    Plan,
    Evaluation,
    Policy,
    ApprovalRequested,
    ApprovalDecided,
    Execution,
    Verification,
    /// Something failed that the run survives (a retry, a transient error).
    Error,
    Resolved,
    Escalated,
    /// The incident joined an open run with the same fingerprint.
    Duplicate,
    /// The incident was refused at intake.
    Rejected,
    /// A model's answer as it streams in (published live, not stored in Postgres: the
    /// stored timeline has the finished diagnosis or plan).
    Thinking,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Status => "status",
            EventKind::Evidence => "evidence",
            EventKind::Diagnosis => "diagnosis",
            EventKind::Plan => "plan",
            EventKind::Evaluation => "evaluation",
            EventKind::Policy => "policy",
            EventKind::ApprovalRequested => "approval_requested",
            EventKind::ApprovalDecided => "approval_decided",
            EventKind::Execution => "execution",
            EventKind::Verification => "verification",
            EventKind::Error => "error",
            EventKind::Resolved => "resolved",
            EventKind::Escalated => "escalated",
            EventKind::Duplicate => "duplicate",
            EventKind::Rejected => "rejected",
            EventKind::Thinking => "thinking",
        }
    }

    /// The kinds after which the run (or incident) is over.
    pub const TERMINAL: [EventKind; 4] =
        [EventKind::Resolved, EventKind::Escalated, EventKind::Duplicate, EventKind::Rejected];

    /// The run (or incident) is over after this event.
    pub fn is_terminal(self) -> bool {
        Self::TERMINAL.contains(&self)
    }
}

/// One line of a run's timeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunEvent {
    pub run_id: Uuid,
    /// The transition this event belongs to.
    pub seq: u32,
    /// Order within the transition.
    pub index: u32,
    pub stage: Stage,
    pub kind: EventKind,
    pub message: String,
    #[serde(default)]
    pub data: serde_json::Value,
    /// host:pid of the worker that emitted it.
    pub worker: String,
    pub at: DateTime<Utc>,
}

impl RunEvent {
    /// The deterministic message id: a redelivered handler re-publishing is deduplicated.
    pub fn msg_id(&self) -> String {
        format!("{}.{}.e{}", self.run_id, self.seq, self.index)
    }
}
