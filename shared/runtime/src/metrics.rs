//! Prometheus metrics of this process: messages handled per consumer and outcome, handling
//! latency, messages in flight, runs finished by outcome. Served as the Prometheus text format
//! on `[metrics] listen` (off by default) at `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Upper bounds of the handling-latency buckets, in seconds.
const BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Largest request head the endpoint reads.
const MAX_REQUEST: usize = 8 * 1024;

#[derive(Default)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

#[derive(Default)]
struct State {
    messages: BTreeMap<(String, &'static str), u64>,
    in_flight: BTreeMap<String, i64>,
    latency: BTreeMap<String, Histogram>,
    runs: BTreeMap<&'static str, u64>,
}

static STATE: LazyLock<Mutex<State>> = LazyLock::new(Default::default);

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// A message of `consumer` started.
pub fn started(consumer: &str) {
    *state().in_flight.entry(consumer.to_string()).or_default() += 1;
}

/// A message of `consumer` was settled with `outcome` (`ack`, `nak`, `term`) after `took`.
pub fn finished(consumer: &str, outcome: &'static str, took: Duration) {
    let mut s = state();
    *s.in_flight.entry(consumer.to_string()).or_default() -= 1;
    *s.messages.entry((consumer.to_string(), outcome)).or_default() += 1;
    let h = s.latency.entry(consumer.to_string()).or_default();
    if h.counts.is_empty() {
        h.counts = vec![0; BUCKETS.len()];
    }
    let secs = took.as_secs_f64();
    for (i, le) in BUCKETS.iter().enumerate() {
        if secs <= *le {
            h.counts[i] += 1;
        }
    }
    h.sum += secs;
    h.count += 1;
}

/// A run ended (`resolved`, `escalated`, ...).
pub fn run_finished(outcome: &'static str) {
    *state().runs.entry(outcome).or_default() += 1;
}

/// Everything, in the Prometheus text exposition format (0.0.4).
pub fn render() -> String {
    let s = state();
    let mut out = String::new();
    out.push_str("# HELP pitcrew_messages_total Messages settled, by consumer and outcome.\n");
    out.push_str("# TYPE pitcrew_messages_total counter\n");
    for ((c, o), n) in &s.messages {
        let _ = writeln!(out, "pitcrew_messages_total{{consumer=\"{c}\",outcome=\"{o}\"}} {n}");
    }
    out.push_str("# HELP pitcrew_messages_in_flight Messages being handled now, by consumer.\n");
    out.push_str("# TYPE pitcrew_messages_in_flight gauge\n");
    for (c, n) in &s.in_flight {
        let _ = writeln!(out, "pitcrew_messages_in_flight{{consumer=\"{c}\"}} {n}");
    }
    out.push_str("# HELP pitcrew_handling_seconds Time from a message starting to it being settled.\n");
    out.push_str("# TYPE pitcrew_handling_seconds histogram\n");
    for (c, h) in &s.latency {
        for (le, n) in BUCKETS.iter().zip(&h.counts) {
            let _ = writeln!(out, "pitcrew_handling_seconds_bucket{{consumer=\"{c}\",le=\"{le}\"}} {n}");
        }
        let _ = writeln!(out, "pitcrew_handling_seconds_bucket{{consumer=\"{c}\",le=\"+Inf\"}} {}", h.count);
        let _ = writeln!(out, "pitcrew_handling_seconds_sum{{consumer=\"{c}\"}} {}", h.sum);
        let _ = writeln!(out, "pitcrew_handling_seconds_count{{consumer=\"{c}\"}} {}", h.count);
    }
    out.push_str("# HELP pitcrew_runs_finished_total Runs this process ended, by outcome.\n");
    out.push_str("# TYPE pitcrew_runs_finished_total counter\n");
    for (o, n) in &s.runs {
        let _ = writeln!(out, "pitcrew_runs_finished_total{{outcome=\"{o}\"}} {n}");
    }
    out
}

/// Serve `GET /metrics` on `listener` until `shutdown`; one request per connection.
pub async fn serve(listener: tokio::net::TcpListener, shutdown: impl std::future::Future<Output = ()>) {
    tokio::pin!(shutdown);
    loop {
        let conn = tokio::select! {
            c = listener.accept() => c,
            _ = &mut shutdown => return,
        };
        let Ok((mut conn, _)) = conn else { continue };
        tokio::spawn(async move {
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            let read = async {
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
            };
            if tokio::time::timeout(Duration::from_secs(5), read).await.is_err() {
                return;
            }
            let line = String::from_utf8_lossy(&head).lines().next().unwrap_or("").to_string();
            let mut words = line.split_whitespace();
            let (status, ctype, body) = match (words.next(), words.next()) {
                (Some("GET"), Some("/metrics")) => ("200 OK", "text/plain; version=0.0.4", render()),
                _ => ("404 Not Found", "text/plain", "not found\n".to_string()),
            };
            let reply = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(reply.as_bytes()).await;
            let _ = conn.shutdown().await;
        });
    }
}
