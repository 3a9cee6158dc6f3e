//! The stages of the remediation graph and their wire names.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// One node of the remediation graph. Each stage is a worker with its own durable consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    Intake,
    Diagnose,
    Plan,
    Evaluate,
    Approval,
    Execute,
    Verify,
    Report,
    Escalate,
}

impl Stage {
    /// Every stage, in graph order.
    pub const ALL: [Stage; 9] = [
        Stage::Intake,
        Stage::Diagnose,
        Stage::Plan,
        Stage::Evaluate,
        Stage::Approval,
        Stage::Execute,
        Stage::Verify,
        Stage::Report,
        Stage::Escalate,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Intake => "intake",
            Stage::Diagnose => "diagnose",
            Stage::Plan => "plan",
            Stage::Evaluate => "evaluate",
            Stage::Approval => "approval",
            Stage::Execute => "execute",
            Stage::Verify => "verify",
            Stage::Report => "report",
            Stage::Escalate => "escalate",
        }
    }

    /// Report and escalate end a run.
    pub fn is_terminal(self) -> bool {
        matches!(self, Stage::Report | Stage::Escalate)
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The name did not match any stage.
#[derive(Debug, thiserror::Error)]
#[error("unknown stage '{0}' (expected one of: intake, diagnose, plan, evaluate, approval, execute, verify, report, escalate)")]
pub struct UnknownStage(pub String);

impl FromStr for Stage {
    type Err = UnknownStage;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Stage::ALL.into_iter().find(|st| st.as_str() == s).ok_or_else(|| UnknownStage(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for st in Stage::ALL {
            assert_eq!(st.as_str().parse::<Stage>().unwrap(), st);
        }
        assert!("nope".parse::<Stage>().is_err());
        assert!(Stage::Report.is_terminal() && !Stage::Verify.is_terminal());
    }
}
