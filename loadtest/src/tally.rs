//! How the batch's ends count: a run is completed only when it ends resolved or escalated as
//! its incident's scenario expects. One that ends the other way, or as a duplicate or
//! rejected, did not do what was measured, so it is an error, and neither its end nor its
//! latency is in the rates and percentiles.

use chrono::{DateTime, Utc};
use pitcrew_model::EventKind;
use std::collections::{BTreeMap, HashMap};
use uuid::Uuid;

type At = DateTime<Utc>;

/// What the tool expects of an incident it publishes.
#[derive(Clone, Copy)]
pub struct Planned {
    /// `Resolved` or `Escalated`, from its scenario; None with `--target`, whose crew decides.
    pub expected: Option<EventKind>,
    /// With `--rate`: when it was due (`started + i / rate`). Its end-to-end latency counts
    /// from here, not from its send: a publisher held up (its window of unacked publishes
    /// full) sends the overdue incidents in a burst, and their wait is part of what a caller
    /// publishing at that rate would see.
    pub due: Option<At>,
}

/// How one run's end counts.
#[derive(Debug, PartialEq, Eq)]
pub enum Ending {
    /// Resolved or escalated, as expected.
    Completed,
    /// Resolved where its scenario escalates, or the other way round.
    Unexpected,
    /// A duplicate or rejected: the crew never ran it.
    NotRun,
}

/// What the refused scenario's runs escalate with: the policy gate refusing their plan. Any
/// other escalation of them (a step that failed, a model error, a target never free) did not
/// do what was measured.
pub const REFUSAL: &str = "policy rejected `rm -rf /`";

/// One run's terminal event, as the tool saw it.
#[derive(Debug, Clone)]
pub struct Ended {
    /// When it reached the tool, by the tool's clock.
    pub at: At,
    pub kind: EventKind,
    pub run: Uuid,
    /// An escalation whose reason is the policy's refusal ([`REFUSAL`]).
    pub refused: bool,
}

impl Ended {
    pub fn of(at: At, event: &pitcrew_model::RunEvent) -> Ended {
        let refused = event.kind == EventKind::Escalated
            && event.data.get("reason").and_then(|r| r.as_str()).is_some_and(|r| r.starts_with(REFUSAL));
        Ended { at, kind: event.kind, run: event.run_id, refused }
    }
}

/// How an end counts against what was expected of its incident (`None`: `--target`, whose
/// crew decides, so either end completes). An expected escalation completes only as the
/// policy's refusal.
pub fn ending(kind: EventKind, refused: bool, expected: Option<EventKind>) -> Ending {
    match (kind, expected) {
        (EventKind::Resolved | EventKind::Escalated, None) => Ending::Completed,
        (EventKind::Resolved, Some(EventKind::Resolved)) => Ending::Completed,
        (EventKind::Escalated, Some(EventKind::Escalated)) if refused => Ending::Completed,
        (EventKind::Resolved | EventKind::Escalated, Some(_)) => Ending::Unexpected,
        _ => Ending::NotRun,
    }
}

/// The batch's ends, counted.
pub struct Tally {
    /// Each completed run's end-to-end latency, in ms.
    pub e2e: Vec<f64>,
    /// The completed runs' ends.
    pub completed: Vec<At>,
    /// How the runs ended, by kind (resolved and escalated always present).
    pub outcomes: BTreeMap<&'static str, usize>,
    /// Runs that ended resolved or escalated against their scenario (an expected escalation
    /// for another reason than the policy's refusal too).
    pub unexpected: usize,
    /// Runs that ended as a duplicate or rejected.
    pub not_run: usize,
}

impl Tally {
    /// Count `ended` (each run's terminal event: when, which kind, the run), the runs sent
    /// (their publish times) and what was expected of each.
    pub fn of(ended: &[Ended], sent: &HashMap<Uuid, At>, planned: &HashMap<Uuid, Planned>) -> Tally {
        let mut t = Tally {
            e2e: Vec::with_capacity(ended.len()),
            completed: Vec::with_capacity(ended.len()),
            outcomes: [("resolved", 0), ("escalated", 0)].into(),
            unexpected: 0,
            not_run: 0,
        };
        for Ended { at, kind, run, refused } in ended {
            let Some(published) = sent.get(run) else { continue };
            let plan = planned.get(run);
            *t.outcomes.entry(kind.as_str()).or_default() += 1;
            match ending(*kind, *refused, plan.and_then(|p| p.expected)) {
                Ending::Completed => {
                    let t0 = plan.and_then(|p| p.due).unwrap_or(*published);
                    // From its publish to its end seen here, both by this process's clock.
                    t.e2e.push(at.signed_duration_since(t0).num_microseconds().unwrap_or(0) as f64 / 1000.0);
                    t.completed.push(*at);
                }
                Ending::Unexpected => t.unexpected += 1,
                Ending::NotRun => t.not_run += 1,
            }
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: i64) -> At {
        DateTime::from_timestamp_millis(1_800_000_000_000 + ms).unwrap()
    }

    #[test]
    fn only_the_expected_resolution_or_escalation_completes_a_run() {
        use EventKind::*;
        assert_eq!(ending(Resolved, false, Some(Resolved)), Ending::Completed);
        assert_eq!(ending(Escalated, true, Some(Escalated)), Ending::Completed);
        // Escalated, but not by the policy's refusal: a step that failed, say.
        assert_eq!(ending(Escalated, false, Some(Escalated)), Ending::Unexpected);
        assert_eq!(ending(Escalated, false, Some(Resolved)), Ending::Unexpected);
        assert_eq!(ending(Escalated, true, Some(Resolved)), Ending::Unexpected);
        assert_eq!(ending(Resolved, false, Some(Escalated)), Ending::Unexpected);
        for kind in [Duplicate, Rejected] {
            for expected in [Some(Resolved), Some(Escalated), None] {
                assert_eq!(ending(kind, false, expected), Ending::NotRun, "{kind:?} {expected:?}");
            }
        }
        // With --target the running crew decides: either way completes, for any reason.
        assert_eq!(ending(Resolved, false, None), Ending::Completed);
        assert_eq!(ending(Escalated, false, None), Ending::Completed);
    }

    fn end(ms: i64, kind: EventKind, run: Uuid, refused: bool) -> Ended {
        Ended { at: t(ms), kind, run, refused }
    }

    #[test]
    fn errors_are_left_out_of_the_latencies_and_a_late_publish_counts_from_its_due_time() {
        let runs: Vec<Uuid> = (0..6).map(|_| Uuid::new_v4()).collect();
        let expect = |e, due| Planned { expected: Some(e), due };
        let planned: HashMap<Uuid, Planned> = [
            // Due at 0, sent at 300 ms after a stall, ended at 310 ms.
            (runs[0], expect(EventKind::Resolved, Some(t(0)))),
            (runs[1], expect(EventKind::Escalated, None)),
            (runs[2], expect(EventKind::Resolved, None)),
            (runs[3], expect(EventKind::Resolved, None)),
            (runs[4], expect(EventKind::Resolved, None)),
            (runs[5], expect(EventKind::Escalated, None)),
        ]
        .into();
        let sent: HashMap<Uuid, At> = runs.iter().map(|r| (*r, t(300))).collect();
        let ended = [
            end(310, EventKind::Resolved, runs[0], false),
            end(320, EventKind::Escalated, runs[1], true),
            end(330, EventKind::Escalated, runs[2], false),
            end(340, EventKind::Duplicate, runs[3], false),
            end(350, EventKind::Rejected, runs[4], false),
            // Escalated as expected, but not by the policy's refusal.
            end(355, EventKind::Escalated, runs[5], false),
            // Not sent (its publish failed): not counted at all.
            end(360, EventKind::Resolved, Uuid::new_v4(), false),
        ];
        let tally = Tally::of(&ended, &sent, &planned);
        assert_eq!(tally.e2e, vec![310.0, 20.0]);
        assert_eq!(tally.completed, vec![t(310), t(320)]);
        assert_eq!((tally.unexpected, tally.not_run), (2, 2));
        let outcomes: BTreeMap<&str, usize> =
            [("resolved", 1), ("escalated", 3), ("duplicate", 1), ("rejected", 1)].into();
        assert_eq!(tally.outcomes, outcomes);
    }

    #[test]
    fn a_refusal_is_read_from_the_escalation_s_reason() {
        use pitcrew_model::{Incident, RunEvent, RunState, Stage};
        let state = RunState::new(Uuid::new_v4(), Incident::new("svc-4", "disk wiped"));
        let event = |kind, reason: &str| RunEvent {
            run_id: state.run_id,
            seq: 3,
            index: 0,
            stage: Stage::Escalate,
            kind,
            message: format!("escalated svc-4: {reason}"),
            data: state.escalated_data(reason),
            worker: "here:1".into(),
            at: t(0),
        };
        let refusal = format!("{REFUSAL}: it removes the root filesystem");
        assert!(Ended::of(t(5), &event(EventKind::Escalated, &refusal)).refused);
        assert!(!Ended::of(t(5), &event(EventKind::Escalated, "retry limit reached")).refused);
        assert!(!Ended::of(t(5), &event(EventKind::Resolved, &refusal)).refused);
    }
}
