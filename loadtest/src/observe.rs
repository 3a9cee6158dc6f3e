//! What the tool watches, kept off the path it measures: while the batch runs, only each
//! run's terminal event (a consumer filtered to the four terminal kinds, so the bus does not
//! deliver the rest of a run's events to the tool); after it, each stage's latency
//! from the timeline Postgres stored.

use anyhow::Context;
use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use futures::StreamExt;
use pitcrew_model::{EventKind, RunEvent};
use pitcrew_runtime::Bus;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use tokio::sync::{mpsc, Semaphore};
use uuid::Uuid;

/// The runs of this batch still counted in flight, each holding one permit of `in_flight`
/// (the publisher takes one per incident, so at most its initial count of runs are in flight).
/// A run leaves once: at its first terminal event, or when its publish fails, whichever comes
/// first; only that gives its permit back. (A publish whose ack was lost may still have
/// reached the stream, and its run may end before or after the failure is known.)
#[derive(Clone)]
pub struct Ours {
    runs: Arc<std::sync::Mutex<HashSet<Uuid>>>,
    in_flight: Arc<Semaphore>,
}

impl Ours {
    pub fn new(in_flight: Arc<Semaphore>) -> Self {
        Self { runs: Arc::default(), in_flight }
    }

    /// A run about to be published, its permit already taken.
    pub fn add(&self, run: Uuid) {
        self.runs.lock().unwrap_or_else(|e| e.into_inner()).insert(run);
    }

    /// The run ended or its publish failed: true, and its permit back, the first time only.
    pub fn release(&self, run: Uuid) -> bool {
        let ours = self.runs.lock().unwrap_or_else(|e| e.into_inner()).remove(&run);
        if ours {
            self.in_flight.add_permits(1);
        }
        ours
    }
}

/// Follow the terminal events of `ours` from now on (a crew driven with `--target` may be
/// ending other runs too). A run's first one, while the run is still counted in flight, is
/// sent on the returned channel and releases it, with when it arrived here: a run ends for
/// its client when its end is seen, after the last step's commit and publish (the event's
/// own time is taken before them), and by this clock, the one its publish was timed by.
pub async fn terminals(
    bus: &Bus,
    ours: Ours,
) -> anyhow::Result<mpsc::UnboundedReceiver<(chrono::DateTime<chrono::Utc>, RunEvent)>> {
    let stream = bus.js.get_stream(bus.subjects.events_stream()).await?;
    // `<prefix>.events.>` -> `<prefix>.events.*.<kind>`
    let base = bus.subjects.events_all();
    let base = base.trim_end_matches('>');
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subjects: EventKind::TERMINAL.iter().map(|k| format!("{base}*.{}", k.as_str())).collect(),
            deliver_policy: DeliverPolicy::New,
            ..Default::default()
        })
        .await
        .context("creating the terminal-event consumer")?;
    let mut messages = consumer.messages().await?;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut unreadable = 0u64;
        while let Some(msg) = messages.next().await {
            let seen = chrono::Utc::now();
            let msg = match msg {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("loadtest: terminal-event stream: {e}");
                    continue;
                }
            };
            // Another pitcrew's event format (`--target`): its run is never seen to end, and
            // counts as timed out; said here, so that is not taken for a crew that stalled.
            let event = match serde_json::from_slice::<RunEvent>(&msg.payload) {
                Ok(event) => event,
                Err(e) => {
                    unreadable += 1;
                    if unreadable == 1 || unreadable.is_multiple_of(100) {
                        eprintln!(
                            "loadtest: {unreadable} unreadable terminal event(s), the last on {} ({e}): \
                             their runs count as timed out",
                            msg.subject
                        );
                    }
                    continue;
                }
            };
            if ours.release(event.run_id) && tx.send((seen, event)).is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

/// Each stage's latency, per run step: from the previous step's end (its last event; for
/// intake, the incident's publish, from `published`) to this step's end, so queueing, the
/// stage's work and the hand-over (the previous step's commit and publish) are all in it.
/// From the timestamps Postgres holds. A waiting step's note (filed under the previous
/// transition's seq, before the step ends) is no step's end and is left out. Intake is
/// measured only when `same_clock` (the crew runs in this process): its start is the
/// publish, by this machine's clock, and a crew elsewhere (`--target`) stamps its end by its
/// own, whose skew would be of intake's size.
pub async fn stage_latencies(
    db: &tokio_postgres::Client,
    published: &HashMap<Uuid, chrono::DateTime<chrono::Utc>>,
    same_clock: bool,
) -> anyhow::Result<BTreeMap<String, Vec<f64>>> {
    // Only this batch's runs: against a crew that has run before (`--target`), the table
    // holds every timeline it ever wrote.
    let ids: Vec<Uuid> = published.keys().copied().collect();
    let rows = db
        .query(
            "SELECT run_id, stage, max(at) FROM run_events
             WHERE run_id = ANY($1) AND idx NOT BETWEEN $2 AND $2 + $3 - 1
             GROUP BY run_id, seq, stage ORDER BY run_id, seq, max(at)",
            &[
                &ids,
                &(pitcrew_runtime::runner::WAIT_EVENT_INDEX as i32),
                &(pitcrew_runtime::runner::WAIT_NOTE_KINDS as i32),
            ],
        )
        .await
        .context("reading the timelines")?;
    let mut out: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut run = None;
    let mut previous = None;
    for r in rows {
        let (id, stage, end): (Uuid, String, chrono::DateTime<chrono::Utc>) = (r.get(0), r.get(1), r.get(2));
        if run != Some(id) {
            run = Some(id);
            previous = published.get(&id).copied().filter(|_| same_clock);
        }
        if let Some(start) = previous {
            let ms = end.signed_duration_since(start).num_microseconds().unwrap_or(0) as f64 / 1000.0;
            out.entry(stage).or_default().push(ms);
        }
        previous = Some(end);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two runs in flight out of two permits, as the publisher leaves them.
    fn two_in_flight() -> (Arc<Semaphore>, Ours, [Uuid; 2]) {
        let in_flight = Arc::new(Semaphore::new(2));
        let ours = Ours::new(in_flight.clone());
        let runs = [Uuid::new_v4(), Uuid::new_v4()];
        for run in runs {
            in_flight.try_acquire().unwrap().forget();
            ours.add(run);
        }
        (in_flight, ours, runs)
    }

    #[test]
    fn a_run_gives_its_permit_back_once_whichever_of_its_end_and_its_failed_publish_comes_first() {
        let (in_flight, ours, [a, b]) = two_in_flight();
        // a: its end first (a publish whose ack was lost, the run went ahead), then the failure.
        assert!(ours.release(a));
        assert!(!ours.release(a));
        // b: the failure first, then the end, then a second terminal event.
        assert!(ours.release(b));
        assert!(!ours.release(b));
        assert!(!ours.release(b));
        assert_eq!(in_flight.available_permits(), 2);
        // A run of another batch on the same crew is never ours.
        assert!(!ours.release(Uuid::new_v4()));
        assert_eq!(in_flight.available_permits(), 2);
    }
}
