//! Subject and stream names, all under one configurable prefix (default `pitcrew`).

use crate::Stage;
use uuid::Uuid;

/// The names of every subject and stream for one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
    stream_prefix: String,
}

impl Default for Subjects {
    fn default() -> Self {
        Subjects::new("pitcrew")
    }
}

impl Subjects {
    pub fn new(prefix: &str) -> Self {
        let stream_prefix =
            prefix.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' }).collect();
        Subjects { prefix: prefix.to_string(), stream_prefix }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn incidents_new(&self) -> String {
        format!("{}.incidents.new", self.prefix)
    }
    pub fn stage(&self, stage: Stage) -> String {
        format!("{}.stage.{}", self.prefix, stage.as_str())
    }
    pub fn stages_all(&self) -> String {
        format!("{}.stage.>", self.prefix)
    }
    pub fn approval_requested(&self, run: Uuid) -> String {
        format!("{}.approvals.requested.{run}", self.prefix)
    }
    pub fn approval_decided(&self, run: Uuid) -> String {
        format!("{}.approvals.decided.{run}", self.prefix)
    }
    pub fn approvals_all(&self) -> String {
        format!("{}.approvals.>", self.prefix)
    }
    pub fn approvals_decided_all(&self) -> String {
        format!("{}.approvals.decided.*", self.prefix)
    }
    pub fn event(&self, run: Uuid, kind: &str) -> String {
        format!("{}.events.{run}.{kind}", self.prefix)
    }
    pub fn events_of(&self, run: Uuid) -> String {
        format!("{}.events.{run}.>", self.prefix)
    }
    pub fn events_all(&self) -> String {
        format!("{}.events.>", self.prefix)
    }
    pub fn dlq(&self, stage: &str) -> String {
        format!("{}.dlq.{stage}", self.prefix)
    }
    pub fn dlq_all(&self) -> String {
        format!("{}.dlq.>", self.prefix)
    }

    pub fn incidents_stream(&self) -> String {
        format!("{}_INCIDENTS", self.stream_prefix)
    }
    pub fn stages_stream(&self) -> String {
        format!("{}_STAGES", self.stream_prefix)
    }
    pub fn approvals_stream(&self) -> String {
        format!("{}_APPROVALS", self.stream_prefix)
    }
    pub fn events_stream(&self) -> String {
        format!("{}_EVENTS", self.stream_prefix)
    }
    pub fn dlq_stream(&self) -> String {
        format!("{}_DLQ", self.stream_prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_names_match_the_design() {
        let s = Subjects::default();
        assert_eq!(s.stage(Stage::Diagnose), "pitcrew.stage.diagnose");
        assert_eq!(s.stages_stream(), "PITCREW_STAGES");
        assert_eq!(s.dlq("intake"), "pitcrew.dlq.intake");
        let t = Subjects::new("t-1");
        assert_eq!(t.events_stream(), "T_1_EVENTS");
    }
}
