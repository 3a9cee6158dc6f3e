//! What the tool watches, kept off the path it measures: while the batch runs, only each
//! run's terminal event (a consumer filtered to the four terminal kinds, so the bus does not
//! deliver the other sixteen events of a run to the tool); after it, each stage's latency
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

/// The kinds that end a run or an incident.
const TERMINAL: [EventKind; 4] = [EventKind::Resolved, EventKind::Escalated, EventKind::Duplicate, EventKind::Rejected];

/// Follow every run's terminal event from now on. Each run's first one is sent on the
/// returned channel and gives a permit back to `in_flight` (the publisher takes one per
/// incident, so at most its initial count of runs are in flight).
pub async fn terminals(bus: &Bus, in_flight: Arc<Semaphore>) -> anyhow::Result<mpsc::UnboundedReceiver<RunEvent>> {
    let stream = bus.js.get_stream(bus.subjects.events_stream()).await?;
    // `<prefix>.events.>` -> `<prefix>.events.*.<kind>`
    let base = bus.subjects.events_all();
    let base = base.trim_end_matches('>');
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subjects: TERMINAL.iter().map(|k| format!("{base}*.{}", k.as_str())).collect(),
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
            if done.insert(event.run_id) {
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

/// Each stage's latency, per run step: from the stage taking the run (its `status` event of
/// index 0) to the next stage taking it, queueing included, from the timestamps Postgres holds.
pub async fn stage_latencies(db: &tokio_postgres::Client) -> anyhow::Result<BTreeMap<String, Vec<f64>>> {
    let rows = db
        .query("SELECT run_id, stage, at FROM run_events WHERE kind = 'status' AND idx = 0 ORDER BY run_id, seq", &[])
        .await
        .context("reading the timelines")?;
    let mut by_run: HashMap<Uuid, Vec<(String, chrono::DateTime<chrono::Utc>)>> = HashMap::new();
    for r in rows {
        by_run.entry(r.get(0)).or_default().push((r.get(1), r.get(2)));
    }
    let mut out: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for starts in by_run.values() {
        for w in starts.windows(2) {
            let ms = w[1].1.signed_duration_since(w[0].1).num_microseconds().unwrap_or(0) as f64 / 1000.0;
            out.entry(w[0].0.clone()).or_default().push(ms);
        }
    }
    Ok(out)
}
