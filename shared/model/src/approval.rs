//! Approval requests and decisions: the messages of the bridge subject.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Published on `pitcrew.approvals.requested.<run>` when a plan needs a human.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalRequest {
    pub run_id: Uuid,
    pub service: String,
    pub host: Option<String>,
    pub error: String,
    pub attempt: u32,
    /// The exact commands that would run.
    pub plan: Vec<String>,
    /// Decisions must name this hash: approving an older plan does nothing.
    pub plan_hash: String,
    pub risk: String,
    /// The policy rule that asked for approval.
    pub rule: String,
    pub diagnosis: String,
    pub evidence: Vec<String>,
    pub requested_at: DateTime<Utc>,
    /// Undecided by then, the run escalates.
    pub expires_at: DateTime<Utc>,
    /// Distinct approvers needed before the plan runs (one deny is enough to stop it).
    #[serde(default = "one")]
    pub quorum: u32,
}

fn one() -> u32 {
    1
}

/// What an approver said.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    Approve,
    Deny,
    /// Published by pitcrew itself when a request times out.
    Expire,
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Approve => "approve",
            Decision::Deny => "deny",
            Decision::Expire => "expire",
        }
    }
}

/// Published on `pitcrew.approvals.decided.<run>` by the CLI, the gateway or a chat bridge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalDecision {
    pub run_id: Uuid,
    pub decision: Decision,
    /// Who decided.
    pub by: String,
    /// The plan this decision is for; when absent, the plan pending now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_hash: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// `cli`, `http`, `slack`, `timeout`, ...
    #[serde(default = "default_channel")]
    pub channel: String,
    #[serde(default = "Utc::now")]
    pub decided_at: DateTime<Utc>,
}

/// Bytes of a decision's reason kept (the HTTP API refuses more; other publishers are cut).
pub const MAX_REASON: usize = 1000;

/// Bytes of a decision's `by` and `channel` kept (a name: a publisher that sends more is cut).
pub const MAX_DECIDER: usize = 256;

impl ApprovalDecision {
    /// The decision as Postgres can store it, whoever published it: NUL bytes become U+FFFD
    /// (Postgres refuses NUL in text, and a denial it refused would be lost while its run
    /// waited on for someone else's approval), the reason is cut to `MAX_REASON` bytes, `by`,
    /// `channel` and `plan_hash` (a real one is 64 hex digits) to `MAX_DECIDER`.
    pub fn storable(self) -> Self {
        use crate::trim::{clip, storable};
        ApprovalDecision {
            by: clip(&storable(self.by), MAX_DECIDER),
            plan_hash: self.plan_hash.map(|h| clip(&storable(h), MAX_DECIDER)),
            reason: self.reason.map(|r| clip(&storable(r), MAX_REASON)),
            channel: clip(&storable(self.channel), MAX_DECIDER),
            ..self
        }
    }
}

fn default_channel() -> String {
    "unknown".to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whoever published it, a decision's names are kept to a name's length: a bot that puts a
    /// blob in `by` (200,000 control characters, six bytes each as JSON) made an event no bus
    /// message could carry, and the decision was retried for good.
    #[test]
    fn a_decisions_names_are_cut_to_a_names_length() {
        let d = ApprovalDecision {
            run_id: Uuid::nil(),
            decision: Decision::Approve,
            by: "\u{1}".repeat(200_000),
            plan_hash: Some("h".repeat(100_000)),
            reason: Some("r\0".repeat(1000)),
            channel: "c".repeat(10_000),
            decided_at: Utc::now(),
        }
        .storable();
        assert!(d.by.len() <= MAX_DECIDER + '…'.len_utf8(), "{}", d.by.len());
        assert!(d.channel.len() <= MAX_DECIDER + '…'.len_utf8(), "{}", d.channel.len());
        assert!(d.plan_hash.as_ref().is_some_and(|h| h.len() <= MAX_DECIDER + '…'.len_utf8()));
        let reason = d.reason.clone().unwrap_or_default();
        assert!(reason.len() <= MAX_REASON + '…'.len_utf8() && !reason.contains('\0'), "{reason}");
        let short = ApprovalDecision { by: "ann".into(), channel: "cli".into(), ..d }.storable();
        assert_eq!((short.by.as_str(), short.channel.as_str()), ("ann", "cli"));
    }
}
