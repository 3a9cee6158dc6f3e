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

pub fn ending(kind: EventKind, expected: Option<EventKind>) -> Ending {
    match kind {
        EventKind::Resolved | EventKind::Escalated if expected.is_none_or(|e| e == kind) => Ending::Completed,
        EventKind::Resolved | EventKind::Escalated => Ending::Unexpected,
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
    /// Runs that ended resolved or escalated against their scenario.
    pub unexpected: usize,
    /// Runs that ended as a duplicate or rejected.
    pub not_run: usize,
}

impl Tally {
    /// Count `ended` (each run's terminal event: when, which kind, the run), the runs sent
    /// (their publish times) and what was expected of each.
    pub fn of(ended: &[(At, EventKind, Uuid)], sent: &HashMap<Uuid, At>, planned: &HashMap<Uuid, Planned>) -> Tally {
        let mut t = Tally {
            e2e: Vec::with_capacity(ended.len()),
            completed: Vec::with_capacity(ended.len()),
            outcomes: [("resolved", 0), ("escalated", 0)].into(),
            unexpected: 0,
            not_run: 0,
        };
        for (at, kind, run) in ended {
            let Some(published) = sent.get(run) else { continue };
            let plan = planned.get(run);
            *t.outcomes.entry(kind.as_str()).or_default() += 1;
            match ending(*kind, plan.and_then(|p| p.expected)) {
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
        for expected in [Resolved, Escalated] {
            assert_eq!(ending(expected, Some(expected)), Ending::Completed);
        }
        assert_eq!(ending(Escalated, Some(Resolved)), Ending::Unexpected);
        assert_eq!(ending(Resolved, Some(Escalated)), Ending::Unexpected);
        for kind in [Duplicate, Rejected] {
            for expected in [Some(Resolved), Some(Escalated), None] {
                assert_eq!(ending(kind, expected), Ending::NotRun, "{kind:?} {expected:?}");
            }
        }
        // With --target the running crew decides: either way completes.
        assert_eq!(ending(Resolved, None), Ending::Completed);
        assert_eq!(ending(Escalated, None), Ending::Completed);
    }

    #[test]
    fn errors_are_left_out_of_the_latencies_and_a_late_publish_counts_from_its_due_time() {
        let runs: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
        let expect = |e, due| Planned { expected: Some(e), due };
        let planned: HashMap<Uuid, Planned> = [
            // Due at 0, sent at 300 ms after a stall, ended at 310 ms.
            (runs[0], expect(EventKind::Resolved, Some(t(0)))),
            (runs[1], expect(EventKind::Escalated, None)),
            (runs[2], expect(EventKind::Resolved, None)),
            (runs[3], expect(EventKind::Resolved, None)),
            (runs[4], expect(EventKind::Resolved, None)),
        ]
        .into();
        let sent: HashMap<Uuid, At> = runs.iter().map(|r| (*r, t(300))).collect();
        let ended = [
            (t(310), EventKind::Resolved, runs[0]),
            (t(320), EventKind::Escalated, runs[1]),
            (t(330), EventKind::Escalated, runs[2]),
            (t(340), EventKind::Duplicate, runs[3]),
            (t(350), EventKind::Rejected, runs[4]),
            // Not sent (its publish failed): not counted at all.
            (t(360), EventKind::Resolved, Uuid::new_v4()),
        ];
        let tally = Tally::of(&ended, &sent, &planned);
        assert_eq!(tally.e2e, vec![310.0, 20.0]);
        assert_eq!(tally.completed, vec![t(310), t(320)]);
        assert_eq!((tally.unexpected, tally.not_run), (1, 2));
        let outcomes: BTreeMap<&str, usize> =
            [("resolved", 1), ("escalated", 2), ("duplicate", 1), ("rejected", 1)].into();
        assert_eq!(tally.outcomes, outcomes);
    }
}
