//! The run state: one versioned struct that carries everything a stage needs.

use crate::{Incident, Stage};
use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use uuid::Uuid;

/// Bumped when a field changes meaning; readers refuse versions they do not know.
pub const RUN_STATE_VERSION: u32 = 1;
/// Evidence items kept in the state (earlier attempts' first, then the oldest but an
/// attempt's own check, pidfile and port: see `RunState::push_evidence`).
pub const MAX_EVIDENCE: usize = 32;

/// The evidence an attempt's gathering starts with, which its plan and evaluation read.
const FOUNDATION: [&str; 4] = ["check", "pidfile", "port", "port-holder"];
/// Bytes of output kept per evidence item or execution in the state.
pub const MAX_OUTPUT: usize = 4096;
/// Bytes kept of what an evidence item ran or asked (its `detail`).
pub const MAX_DETAIL: usize = 2048;

/// A diagnosis: what the reasoning provider believes is wrong.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Diagnosis {
    pub attempt: u32,
    pub summary: String,
    /// The playbook rule or model that produced it.
    pub source: String,
    /// Observed facts (error text or evidence) the diagnosis rests on.
    #[serde(default)]
    pub grounds: Vec<String>,
}

/// Read-only output gathered while diagnosing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Evidence {
    pub attempt: u32,
    /// What produced it: `check`, `pidfile`, `command`, ...
    pub source: String,
    pub detail: String,
    /// Trimmed to `MAX_OUTPUT`.
    pub output: String,
    pub ok: bool,
}

/// Candidate remediation: 1-3 commands, one per line, never chained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Plan {
    pub attempt: u32,
    pub commands: Vec<String>,
    pub rationale: String,
    /// The playbook rule or model that produced it.
    pub source: String,
}

impl Plan {
    /// A hash of the exact commands: an approval names the plan it approves.
    pub fn hash(&self) -> String {
        let mut h = Sha256::new();
        for c in &self.commands {
            h.update(c.as_bytes());
            h.update([b'\n']);
        }
        hex::encode(&h.finalize()[..12])
    }
}

/// Where the run stands with the policy gate and the approvers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ApprovalStatus {
    /// The gate has not looked at the current plan yet.
    #[default]
    Unchecked,
    /// Nothing in the plan needs a human.
    AutoApproved,
    /// Parked until a decision arrives on the bridge subject.
    Waiting {
        plan_hash: String,
        rule: String,
    },
    Approved {
        by: String,
        plan_hash: String,
    },
    Denied {
        by: String,
        reason: String,
    },
    /// The gate refused the plan outright.
    Rejected {
        rule: String,
    },
}

/// One policy finding about one command; every decision names its rule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SecurityFlag {
    pub attempt: u32,
    pub command: String,
    pub rule: String,
    /// `forbidden` or `critical`.
    pub class: String,
}

/// PASS, REGENERATE or BLOCK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Pass,
    Regenerate,
    Block,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Regenerate => "regenerate",
            Verdict::Block => "block",
        }
    }
}

/// One deterministic check of the evaluator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct EvaluationCheck {
    pub name: String,
    pub passed: bool,
    pub weight: f64,
    pub detail: String,
}

/// The evaluator's score of a diagnosis and plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Evaluation {
    pub attempt: u32,
    pub regeneration: u32,
    pub score: f64,
    pub verdict: Verdict,
    pub checks: Vec<EvaluationCheck>,
    pub feedback: Option<String>,
}

/// How one command of an attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionStatus {
    Succeeded,
    Failed,
    TimedOut,
    /// Started by an earlier delivery that never recorded an end: not run again.
    Interrupted,
    /// Not run: an earlier command of the plan did not succeed, the plan was left alone
    /// (another run fixed the service first), or the worker did not hold a secret the command
    /// names. Its output says which.
    Skipped,
}

/// The record of one command run for one attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ExecutionRecord {
    pub attempt: u32,
    pub index: u32,
    pub command: String,
    pub status: ExecutionStatus,
    pub exit_code: Option<i32>,
    /// Trimmed stdout then stderr.
    pub output: String,
    pub duration_ms: u64,
}

/// What verify saw.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Verification {
    pub attempt: u32,
    pub recovered: bool,
    pub detail: String,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Resolved,
    Escalated,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Resolved => "resolved",
            Outcome::Escalated => "escalated",
        }
    }
}

/// Everything a stage needs, passed stage to stage as MessagePack.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunState {
    /// `RUN_STATE_VERSION` of the writer.
    pub version: u32,
    pub run_id: Uuid,
    /// The normalised incident (id and fingerprint set).
    pub incident: Incident,
    /// The stage this state is addressed to.
    pub step: Stage,
    /// Transition counter: with `run_id` it makes the deterministic `Nats-Msg-Id`.
    pub seq: u32,
    /// Remediation attempt, from 1.
    pub attempt: u32,
    /// Plan regenerations within this attempt.
    pub regeneration: u32,
    #[serde(default)]
    pub diagnosis_log: Vec<Diagnosis>,
    #[serde(default)]
    pub evidence: Vec<Evidence>,
    #[serde(default)]
    pub plan: Option<Plan>,
    #[serde(default)]
    pub approval: ApprovalStatus,
    #[serde(default)]
    pub security_flags: Vec<SecurityFlag>,
    #[serde(default)]
    pub evaluation: Option<Evaluation>,
    /// Evaluator feedback for the next plan of this attempt.
    #[serde(default)]
    pub feedback: Vec<String>,
    /// Commands of every plan the evaluator sent back in this attempt: none is proposed again
    /// in it (the plan to regenerate alone would let the one before it come back).
    #[serde(default)]
    pub rejected_commands: Vec<String>,
    /// Commands that failed in this run: never proposed again.
    #[serde(default)]
    pub failed_commands: Vec<String>,
    /// Executions of the current attempt.
    #[serde(default)]
    pub executions: Vec<ExecutionRecord>,
    #[serde(default)]
    pub verification: Option<Verification>,
    #[serde(default)]
    pub escalation_reason: Option<String>,
    #[serde(default)]
    pub outcome: Option<Outcome>,
    pub started_at: DateTime<Utc>,
}

impl RunState {
    /// The first state of a run, addressed to intake.
    pub fn new(run_id: Uuid, incident: Incident) -> Self {
        RunState {
            version: RUN_STATE_VERSION,
            run_id,
            incident,
            step: Stage::Intake,
            seq: 0,
            attempt: 1,
            regeneration: 0,
            diagnosis_log: Vec::new(),
            evidence: Vec::new(),
            plan: None,
            approval: ApprovalStatus::Unchecked,
            security_flags: Vec::new(),
            evaluation: None,
            feedback: Vec::new(),
            rejected_commands: Vec::new(),
            failed_commands: Vec::new(),
            executions: Vec::new(),
            verification: None,
            escalation_reason: None,
            outcome: None,
            started_at: Utc::now(),
        }
    }

    /// The current diagnosis (last of the log, if it belongs to this attempt).
    pub fn diagnosis(&self) -> Option<&Diagnosis> {
        self.diagnosis_log.last().filter(|d| d.attempt == self.attempt)
    }

    /// Evidence gathered during the current attempt.
    pub fn current_evidence(&self) -> impl Iterator<Item = &Evidence> {
        self.evidence.iter().filter(move |e| e.attempt == self.attempt)
    }

    /// The current attempt's execution records, in order.
    pub fn current_executions(&self) -> impl Iterator<Item = &ExecutionRecord> {
        self.executions.iter().filter(move |e| e.attempt == self.attempt)
    }

    /// The commands the current attempt ran, or may have (whatever their end), in order: not
    /// those it left alone.
    pub fn ran_commands(&self) -> impl Iterator<Item = &str> {
        self.current_executions().filter(|e| e.status != ExecutionStatus::Skipped).map(|e| e.command.as_str())
    }

    /// Add evidence, keeping the list and each output bounded.
    pub fn push_evidence(&mut self, mut ev: Evidence) {
        ev.output = crate::redact::kept(&ev.output, MAX_OUTPUT);
        // What was run or asked: a tool call's is the model's words, bounded here for every
        // source.
        ev.detail = crate::trim::clip(&crate::redact::redact(&ev.detail), MAX_DETAIL);
        self.evidence.push(ev);
        // Past the bound, the oldest of earlier attempts goes first, then the oldest of this
        // one but its own check, pidfile and port: what the plan's values (`{pid}`,
        // `{holder_pid}`) and the evaluation's grounding read, never pushed out by tool calls.
        while self.evidence.len() > MAX_EVIDENCE {
            let attempt = self.attempt;
            let at = self
                .evidence
                .iter()
                .position(|e| e.attempt != attempt)
                .or_else(|| self.evidence.iter().position(|e| !FOUNDATION.contains(&e.source.as_str())))
                .unwrap_or(0);
            self.evidence.remove(at);
        }
    }

    /// The state as MessagePack within `limit` bytes. A larger one sheds, oldest first, what
    /// a stage can do without: evidence (as past `MAX_EVIDENCE`), then the diagnoses of
    /// earlier attempts. `Err` with the size it still has when that is not enough.
    pub fn encode_within(&mut self, limit: usize) -> Result<Vec<u8>, usize> {
        loop {
            let payload = crate::codec::to_msgpack(self);
            if payload.len() <= limit {
                return Ok(payload);
            }
            if !self.evidence.is_empty() {
                // A quarter at a time: a few encodings, whatever the excess.
                let drop = self.evidence.len().div_ceil(4);
                self.evidence.drain(..drop);
            } else if self.diagnosis_log.len() > 1 {
                let drop = self.diagnosis_log.len() - 1;
                self.diagnosis_log.drain(..drop);
            } else {
                return Err(payload.len());
            }
        }
    }

    /// Keep only what escalation reads, bounded: the last diagnosis, the last of the failed
    /// commands and flags, each execution's output clipped. For a state that `encode_within`
    /// could not fit.
    pub fn shed_for_escalation(&mut self) {
        const KEEP: usize = 16;
        const OUTPUT: usize = 512;
        fn last<T>(list: &mut Vec<T>, n: usize) {
            let drop = list.len().saturating_sub(n);
            list.drain(..drop);
        }
        self.evidence.clear();
        last(&mut self.diagnosis_log, 1);
        last(&mut self.failed_commands, KEEP);
        last(&mut self.security_flags, KEEP);
        self.rejected_commands.clear();
        self.feedback.clear();
        for e in &mut self.executions {
            e.output = crate::trim::clip(&e.output, OUTPUT);
        }
        if let Some(ev) = &mut self.evaluation {
            ev.checks.clear();
        }
    }

    /// The deterministic message id of the transition that produced this state.
    pub fn msg_id(&self) -> String {
        format!("{}.{}", self.run_id, self.seq)
    }

    /// The evaluator sends the plan back with `feedback`: the next plan of this attempt is a
    /// regeneration. When the plan itself was at fault (not a diagnosis that claimed what
    /// nobody observed: its plan may be the right one), none of its commands comes back in
    /// this attempt, whatever plans come after it.
    pub fn send_back_plan(&mut self, feedback: String, plan_at_fault: bool) {
        self.regeneration += 1;
        self.feedback.push(feedback);
        if !plan_at_fault {
            return;
        }
        add_once(&mut self.rejected_commands, self.plan.iter().flat_map(|p| p.commands.iter().cloned()));
    }

    /// Address this state to `next`, counting the transition.
    pub fn advance(&mut self, next: Stage) {
        self.step = next;
        self.seq += 1;
    }

    /// Address this state to escalate with a reason.
    pub fn escalate(&mut self, reason: impl Into<String>) {
        self.escalation_reason = Some(reason.into());
        self.advance(Stage::Escalate);
    }

    /// The data of the run's `escalated` event: why, after how many attempts, what was tried
    /// and did not work, and what the policy flagged.
    pub fn escalated_data(&self, reason: &str) -> serde_json::Value {
        serde_json::json!({
            "reason": reason,
            "attempts": self.attempt,
            "failed_commands": self.failed_commands,
            "security_flags": self.security_flags,
        })
    }
}

/// Add to a list of commands those it does not hold yet, in order.
pub fn add_once(list: &mut Vec<String>, commands: impl IntoIterator<Item = String>) {
    for c in commands {
        if !list.contains(&c) {
            list.push(c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_hash_depends_on_exact_commands() {
        let p = |c: &[&str]| Plan {
            attempt: 1,
            commands: c.iter().map(|s| s.to_string()).collect(),
            rationale: String::new(),
            source: String::new(),
        };
        assert_eq!(p(&["a", "b"]).hash(), p(&["a", "b"]).hash());
        assert_ne!(p(&["a", "b"]).hash(), p(&["ab"]).hash());
        assert_ne!(p(&["a"]).hash(), p(&["a "]).hash());
    }

    /// Output no compression or repetition makes small: distinct digits.
    fn noise(n: usize, seed: u64) -> String {
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                char::from(b'a' + (x >> 59) as u8 % 26)
            })
            .collect()
    }

    #[test]
    fn a_state_past_the_payload_limit_sheds_its_oldest_evidence_first() {
        let mut s = RunState::new(Uuid::now_v7(), Incident::new("web", "down"));
        for i in 0..MAX_EVIDENCE {
            s.push_evidence(Evidence {
                attempt: 1,
                source: "command".into(),
                detail: format!("evidence {i}"),
                output: noise(MAX_OUTPUT, i as u64),
                ok: true,
            });
        }
        for attempt in 1..=3 {
            s.diagnosis_log.push(Diagnosis { attempt, summary: noise(400, 99), source: "m".into(), grounds: vec![] });
        }
        let whole = crate::codec::to_msgpack(&s).len();
        assert!(whole > 32 * MAX_OUTPUT, "{whole}");
        // Room enough: nothing is shed.
        let payload = s.clone().encode_within(whole).expect("fits");
        assert_eq!(payload.len(), whole);
        // Half the room: the newest evidence stays, the oldest goes, the diagnoses stay.
        let mut half = s.clone();
        let payload = half.encode_within(whole / 2).expect("fits once evidence is shed");
        assert!(payload.len() <= whole / 2);
        assert!(!half.evidence.is_empty() && half.evidence.len() < MAX_EVIDENCE);
        assert_eq!(half.evidence.last().unwrap().detail, format!("evidence {}", MAX_EVIDENCE - 1));
        assert_eq!(half.diagnosis_log.len(), 3);
        let back: RunState = crate::codec::decode(Some(crate::codec::MSGPACK), &payload).unwrap();
        assert_eq!(back, half, "the payload is the state as shed");
        // Less room than the evidence alone allows: it all goes, then the earlier diagnoses.
        let mut tight = s.clone();
        let bare = {
            let mut b = s.clone();
            b.evidence.clear();
            b.diagnosis_log.drain(..2);
            crate::codec::to_msgpack(&b).len()
        };
        tight.encode_within(bare).expect("fits with the last diagnosis alone");
        assert!(tight.evidence.is_empty());
        assert_eq!(tight.diagnosis_log.len(), 1);
        assert_eq!(tight.diagnosis_log[0].attempt, 3, "the current attempt's diagnosis is kept");
        // Not even that: the size it still has.
        let mut no_room = s.clone();
        assert_eq!(no_room.encode_within(bare - 1), Err(bare));
        // What escalation keeps of a state that cannot fit is small and bounded.
        let mut huge = s;
        huge.failed_commands = (0..1000).map(|i| format!("{i} {}", noise(500, i))).collect();
        huge.rejected_commands = huge.failed_commands.clone();
        huge.executions = vec![ExecutionRecord {
            attempt: 3,
            index: 0,
            command: "x".into(),
            status: ExecutionStatus::Failed,
            exit_code: Some(1),
            output: noise(MAX_OUTPUT, 7),
            duration_ms: 1,
        }];
        assert!(huge.clone().encode_within(256 * 1024).is_err());
        huge.shed_for_escalation();
        assert_eq!(huge.failed_commands.len(), 16);
        assert!(huge.failed_commands[15].starts_with("999 "), "the latest failures are kept");
        assert!(crate::codec::to_msgpack(&huge).len() < 16 * 1024, "{}", crate::codec::to_msgpack(&huge).len());
    }

    #[test]
    fn every_plan_sent_back_in_an_attempt_stays_barred_in_it() {
        let mut s = RunState::new(Uuid::now_v7(), Incident::new("web", "down"));
        let plan = |c: &[&str]| Plan {
            attempt: 1,
            commands: c.iter().map(|s| s.to_string()).collect(),
            rationale: String::new(),
            source: String::new(),
        };
        s.plan = Some(plan(&["a", "b"]));
        s.send_back_plan("a is not on the host".into(), true);
        s.plan = Some(plan(&["b", "c"]));
        s.send_back_plan("c repeats a failure".into(), true);
        assert_eq!(s.rejected_commands, ["a", "b", "c"]);
        // A diagnosis sent back for an invented fact: its plan may be the right one.
        s.plan = Some(plan(&["d"]));
        s.send_back_plan("nobody saw /dev/sda1".into(), false);
        assert_eq!(s.rejected_commands, ["a", "b", "c"]);
        assert_eq!((s.regeneration, s.feedback.len()), (3, 3));
    }

    #[test]
    fn evidence_is_bounded() {
        let mut s = RunState::new(Uuid::now_v7(), Incident::new("web", "down"));
        for i in 0..100 {
            s.push_evidence(Evidence {
                attempt: 1,
                source: "check".into(),
                detail: format!("{i}"),
                output: "x\n".repeat(10_000),
                ok: false,
            });
        }
        assert_eq!(s.evidence.len(), MAX_EVIDENCE);
        assert_eq!(s.evidence[0].detail, "68");
        assert!(s.evidence.iter().all(|e| e.output.len() <= MAX_OUTPUT + 64));
    }

    /// Tool calls beyond the bound push out earlier attempts' evidence first, then this
    /// attempt's own, but never its check, pidfile or port-holder (the plan's `{pid}` and
    /// `{holder_pid}`, the evaluation's grounds).
    #[test]
    fn the_bound_keeps_the_attempts_own_check_pidfile_and_port_holder() {
        let mut s = RunState::new(Uuid::now_v7(), Incident::new("web", "down"));
        let ev = |attempt: u32, source: &str, detail: String| Evidence {
            attempt,
            source: source.into(),
            detail,
            output: String::new(),
            ok: true,
        };
        for i in 0..10 {
            s.push_evidence(ev(1, "command", format!("first attempt {i}")));
        }
        s.attempt = 2;
        for source in ["check", "pidfile", "port-holder"] {
            s.push_evidence(ev(2, source, source.to_string()));
        }
        for i in 0..100 {
            s.push_evidence(ev(2, "tool", format!("tool {i}")));
        }
        assert_eq!(s.evidence.len(), MAX_EVIDENCE);
        let sources: Vec<&str> = s.evidence.iter().take(3).map(|e| e.source.as_str()).collect();
        assert_eq!(sources, ["check", "pidfile", "port-holder"]);
        assert!(s.evidence.iter().all(|e| e.attempt == 2), "the first attempt's went first");
        assert_eq!(s.evidence.last().unwrap().detail, "tool 99");
        assert_eq!(s.evidence[3].detail, "tool 71", "then this attempt's oldest tool calls");
    }

    #[test]
    fn advance_counts_transitions() {
        let mut s = RunState::new(Uuid::nil(), Incident::new("web", "down"));
        s.advance(Stage::Diagnose);
        s.escalate("why");
        assert_eq!((s.step, s.seq), (Stage::Escalate, 2));
        assert_eq!(s.msg_id(), format!("{}.2", Uuid::nil()));
    }
}
