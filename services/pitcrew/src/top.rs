//! `pitcrew top`: a live view of the crew, read from JetStream and Postgres. Per stage: the
//! consumer's pending messages, messages in flight (delivered, not yet acked), pull requests
//! waiting (idle workers), and delivery and ack rates; then the most recent runs.

use pitcrew_model::trim::printable;
use pitcrew_model::Stage;
use pitcrew_runtime::metrics::consumer_info;
use pitcrew_runtime::{Bus, Store};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// One read of a consumer: (delivered, acked) consumer sequences and when they were read.
type Sample = (u64, u64, Instant);

/// How many recent runs a frame shows.
const RECENT: i64 = 10;

/// Build one frame; `prev` holds the previous samples (rates are over the time between).
pub async fn frame(bus: &Bus, store: Option<&Store>, prev: &mut HashMap<String, Sample>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "pitcrew top — {}   (pending: not yet delivered; in flight: delivered, not acked; waiting: idle pulls)\n",
        chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC")
    );
    let _ = writeln!(
        out,
        "{:<20} {:>9} {:>10} {:>8} {:>12} {:>10} {:>11}",
        "CONSUMER", "PENDING", "IN FLIGHT", "WAITING", "DELIVERED/S", "ACKED/S", "REDELIVERED"
    );
    let mut consumers: Vec<(String, String)> = Stage::ALL
        .iter()
        .map(|s| {
            let stream =
                if *s == Stage::Intake { bus.subjects.incidents_stream() } else { bus.subjects.stages_stream() };
            (stream, s.as_str().to_string())
        })
        .collect();
    consumers.push((bus.subjects.approvals_stream(), pitcrew_runtime::bus::DECISIONS_CONSUMER.into()));
    for (stream, name) in consumers {
        let info = tokio::time::timeout(Duration::from_secs(2), consumer_info(bus, &stream, &name)).await;
        match info {
            Ok(Ok(i)) => {
                let now = Instant::now();
                let sample = (i.delivered.consumer_sequence, i.ack_floor.consumer_sequence, now);
                let rate = |f: fn(&Sample) -> u64| match prev.get(&name) {
                    Some(p) if now > p.2 => {
                        let secs = now.duration_since(p.2).as_secs_f64();
                        format!("{:.1}", f(&sample).saturating_sub(f(p)) as f64 / secs)
                    }
                    _ => "-".into(),
                };
                let (delivered, acked) = (rate(|s| s.0), rate(|s| s.1));
                let _ = writeln!(
                    out,
                    "{:<20} {:>9} {:>10} {:>8} {:>12} {:>10} {:>11}",
                    name, i.num_pending, i.num_ack_pending, i.num_waiting, delivered, acked, i.num_redelivered
                );
                prev.insert(name, sample);
            }
            Ok(Err(e)) => {
                let why = if e.contains("not found") { "no consumer yet (no worker has run it)".into() } else { e };
                let _ = writeln!(out, "{name:<20} {why}");
            }
            Err(_) => {
                let _ = writeln!(out, "{name:<20} JetStream did not answer within 2 s");
            }
        }
    }
    let _ = writeln!(out, "\nRECENT RUNS");
    match store {
        None => {
            let _ = writeln!(out, "(Postgres unavailable: runs not shown)");
        }
        Some(store) => match store.recent_runs(RECENT).await {
            Ok(runs) if runs.is_empty() => {
                let _ = writeln!(out, "(no runs yet)");
            }
            Ok(runs) => {
                let _ = writeln!(
                    out,
                    "{:<36}  {:<12} {:<16} {:<9} {:>7}  {:<8}  ERROR",
                    "RUN", "SERVICE", "STATUS", "STAGE", "ATTEMPT", "UPDATED"
                );
                for r in runs {
                    let _ = writeln!(
                        out,
                        "{:<36}  {:<12} {:<16} {:<9} {:>7}  {:<8}  {}",
                        r.id,
                        printable(&pitcrew_model::trim::clip(&r.service, 12)),
                        r.status,
                        r.stage,
                        r.attempt,
                        r.updated_at.format("%H:%M:%S"),
                        printable(&pitcrew_model::trim::clip(r.error.lines().next().unwrap_or(""), 60)),
                    );
                }
            }
            Err(e) => {
                let _ = writeln!(out, "(cannot read runs from Postgres: {e})");
            }
        },
    }
    out
}

/// Print frames every `every` until ctrl-c; with `once`, print one frame (rates over one
/// second) and return.
pub async fn run(bus: &Bus, store: Option<&Store>, once: bool, every: Duration) -> anyhow::Result<()> {
    let mut prev = HashMap::new();
    if once {
        let _ = frame(bus, store, &mut prev).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        print!("{}", frame(bus, store, &mut prev).await);
        return Ok(());
    }
    loop {
        let text = frame(bus, store, &mut prev).await;
        // Clear the screen and draw from the top left.
        print!("\x1b[2J\x1b[H{text}");
        use std::io::Write as _;
        let _ = std::io::stdout().flush();
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}
