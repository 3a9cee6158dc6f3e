//! Live run events that are not part of the stored timeline: a model's answer while it
//! streams in, published on `<prefix>.events.<run>.thinking` as it comes (batched, bounded),
//! so `pitcrew watch` shows the model thinking.

use chrono::Utc;
use pitcrew_model::subjects::Subjects;
use pitcrew_model::{EventKind, RunEvent, Stage};
use std::time::Duration;
use tokio::sync::mpsc;
use uuid::Uuid;

/// Where live events go: the bus's client and subject names.
#[derive(Clone)]
pub struct Live {
    pub client: async_nats::Client,
    pub subjects: Subjects,
}

/// Chunks queued before new ones are dropped (a slow bus never blocks the model).
const QUEUE: usize = 1024;
/// A published line is at most this long; longer text is split.
const LINE: usize = 400;
/// Text waits at most this long before it is published.
const FLUSH: Duration = Duration::from_millis(250);
/// Thinking events published per stage visit; the rest is in the finished answer.
const MAX_EVENTS: u32 = 200;
/// Live events are numbered from here, clear of the stored ones of the same transition.
pub const FIRST_INDEX: u32 = 1_000_000;

/// Streams one stage's model output for one run. `finish` flushes what is left.
pub struct Thinking {
    tx: mpsc::Sender<String>,
    task: tokio::task::JoinHandle<()>,
}

impl Thinking {
    pub fn start(live: &Live, run_id: Uuid, seq: u32, stage: Stage, worker: String) -> Thinking {
        let (tx, mut rx) = mpsc::channel::<String>(QUEUE);
        let (client, subject) = (live.client.clone(), live.subjects.event(run_id, EventKind::Thinking.as_str()));
        let task = tokio::spawn(async move {
            let mut buf = String::new();
            let (mut sent, mut last) = (0u32, tokio::time::Instant::now());
            while sent < MAX_EVENTS {
                let open = match tokio::time::timeout(FLUSH, rx.recv()).await {
                    Ok(Some(text)) => {
                        buf.push_str(&text);
                        true
                    }
                    Ok(None) => false,
                    Err(_) => true,
                };
                let due = !open || buf.len() >= LINE || buf.contains('\n') || last.elapsed() >= FLUSH;
                if due && !buf.is_empty() {
                    while !buf.is_empty() && sent < MAX_EVENTS {
                        let line: String = buf.drain(..line_end(&buf)).collect();
                        if line.trim().is_empty() {
                            continue;
                        }
                        let event = RunEvent {
                            run_id,
                            seq,
                            index: FIRST_INDEX + sent,
                            stage,
                            kind: EventKind::Thinking,
                            // Redacted as every other event: what a model writes may look
                            // like a secret, whatever it was shown.
                            message: pitcrew_model::redact::redact(line.trim_end_matches('\n')).into_owned(),
                            data: serde_json::Value::Null,
                            worker: worker.clone(),
                            at: Utc::now(),
                        };
                        if let Ok(payload) = serde_json::to_vec(&event) {
                            if let Err(e) = client.publish(subject.clone(), payload.into()).await {
                                tracing::debug!(error = %e, "a thinking event was not published");
                            }
                        }
                        sent += 1;
                    }
                    last = tokio::time::Instant::now();
                }
                if !open {
                    break;
                }
            }
        });
        Thinking { tx, task }
    }

    /// Publish what is still buffered and stop.
    pub async fn finish(self) {
        drop(self.tx);
        let _ = tokio::time::timeout(Duration::from_secs(2), self.task).await;
    }
}

/// Where the next published line ends: after a newline, else at most `LINE` bytes (on a
/// character boundary), else everything.
fn line_end(buf: &str) -> usize {
    if let Some(i) = buf.find('\n') {
        if i < LINE {
            return i + 1;
        }
    }
    if buf.len() <= LINE {
        return buf.len();
    }
    let mut cut = LINE;
    while !buf.is_char_boundary(cut) {
        cut -= 1;
    }
    cut
}

impl pitcrew_llm::Progress for Thinking {
    fn text(&self, chunk: &str) {
        // Full queue: dropped, never waited for.
        let _ = self.tx.try_send(chunk.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_break_at_newlines_or_the_limit() {
        assert_eq!(line_end("abc\ndef"), 4);
        assert_eq!(line_end("abc"), 3);
        let long = "é".repeat(LINE);
        let cut = line_end(&long);
        assert!(cut <= LINE && long.is_char_boundary(cut));
    }
}
