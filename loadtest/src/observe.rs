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

/// The runs of this batch: the publisher adds each before it publishes the incident.
pub type Ours = Arc<std::sync::Mutex<HashSet<Uuid>>>;

/// Follow the terminal events of `ours` from now on (a crew driven with `--target` may be
/// ending other runs too). Each run's first one is sent on the returned channel and gives a
/// permit back to `in_flight` (the publisher takes one per incident, so at most its initial
/// count of runs are in flight).
pub async fn terminals(
    bus: &Bus,
    in_flight: Arc<Semaphore>,
    ours: Ours,
) -> anyhow::Result<mpsc::UnboundedReceiver<RunEvent>> {
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
        let mut done = HashSet::new();
        while let Some(msg) = messages.next().await {
            let msg = match msg {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("loadtest: terminal-event stream: {e}");
                    continue;
                }
            };
            let Ok(event) = serde_json::from_slice::<RunEvent>(&msg.payload) else { continue };
            let mine = ours.lock().map(|o| o.contains(&event.run_id)).unwrap_or(false);
            if mine && done.insert(event.run_id) {
                // Without a limit the count starts at the maximum: an end the tool did not
                // count a permit out for (a publish whose ack was lost) must not pass it.
                if in_flight.available_permits() < Semaphore::MAX_PERMITS {
                    in_flight.add_permits(1);
                }
                if tx.send(event).is_err() {
                    return;
                }
            }
        }
    });
    Ok(rx)
}

/// Each stage's latency, per run step: from the previous step's end (its last event; for
/// intake, the incident's publish, from `published`) to this step's end, so queueing, the
/// stage's work and the hand-over (the previous step's commit and publish) are all in it.
/// From the timestamps Postgres holds.
pub async fn stage_latencies(
    db: &tokio_postgres::Client,
    published: &HashMap<Uuid, chrono::DateTime<chrono::Utc>>,
) -> anyhow::Result<BTreeMap<String, Vec<f64>>> {
    // Only this batch's runs: against a crew that has run before (`--target`), the table
    // holds every timeline it ever wrote.
    let ids: Vec<Uuid> = published.keys().copied().collect();
    let rows = db
        .query(
            "SELECT run_id, stage, max(at) FROM run_events WHERE run_id = ANY($1)
             GROUP BY run_id, seq, stage ORDER BY run_id, seq",
            &[&ids],
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
            previous = published.get(&id).copied();
        }
        if let Some(start) = previous {
            let ms = end.signed_duration_since(start).num_microseconds().unwrap_or(0) as f64 / 1000.0;
            out.entry(stage).or_default().push(ms);
        }
        previous = Some(end);
    }
    Ok(out)
}
