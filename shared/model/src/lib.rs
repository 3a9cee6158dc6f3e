//! pitcrew's shared vocabulary: incidents, the run state that travels between stages,
//! approval requests and decisions, timeline events, subjects and the wire codec.
//! Types only: nothing here does I/O, so every crate (and every test) can depend on it.

pub mod approval;
pub mod codec;
pub mod event;
pub mod incident;
pub mod inventory;
pub mod jitter;
pub mod redact;
pub mod retry_after;
pub mod run;
pub mod schema;
pub mod stage;
pub mod subjects;
pub mod trim;

pub use approval::{ApprovalDecision, ApprovalRequest, Decision};
pub use event::{EventKind, RunEvent};
pub use incident::{Incident, IncidentError, Severity};
pub use inventory::{CheckSpec, HostSpec, ServiceSpec};
pub use run::{
    ApprovalStatus, Diagnosis, Evaluation, EvaluationCheck, Evidence, ExecutionRecord, ExecutionStatus, Outcome, Plan,
    RunState, SecurityFlag, Verdict, Verification, RUN_STATE_VERSION,
};
pub use stage::Stage;
