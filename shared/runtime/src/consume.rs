//! The consumer loop shared by every worker: pull no more than we can start, bound the work
//! with a semaphore, keep long handlers alive with progress acks, and stop on shutdown.

use crate::config::StageSettings;
use async_nats::jetstream::{self, consumer::PullConsumer, AckKind};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// How long one pull waits on the server for messages. Also bounds how long a stopping
/// worker takes to notice shutdown (a pull in progress is finished, never abandoned).
const FETCH_EXPIRES: Duration = Duration::from_secs(1);

/// How often a consumer looks whether a client cut off from NATS is connected again.
const DISCONNECTED_LOOK: Duration = Duration::from_millis(250);

/// How long to wait before pulling again after a pull the server answered at once with nothing.
const EMPTY_PULL_PAUSE: Duration = Duration::from_millis(100);

/// What to do with a message once handled. Every path ends in exactly one of these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Done: the successor is published and Postgres has committed.
    Ack,
    /// Try again after the delay (transient failure).
    Nak(Duration),
    /// Never redeliver: it was dead-lettered.
    Term,
}

/// Handles one message of a consumer and says what to do with it.
pub trait MessageHandler: Send + Sync + 'static {
    /// Name for logs.
    fn name(&self) -> String;
    fn handle(self: Arc<Self>, msg: Arc<jetstream::Message>) -> BoxFuture<'static, Disposition>;
}

/// Makes a worker's consumer again when the server has lost it (its stream or the consumer
/// deleted, a nats-server restarted without its store): creates what of it is missing (the
/// crew's also makes the streams; the bridge waits for the crew to); a no-op on the server
/// when nothing is.
pub type Remake = Arc<dyn Fn() -> BoxFuture<'static, Result<PullConsumer, String>> + Send + Sync>;

/// Pulls in a row that failed before the consumer is made again.
const REMAKE_AFTER: u32 = 2;

/// Exponential backoff for the nth delivery, capped at 30 s, each wait shortened at random by
/// up to a fifth: the messages a Postgres or NATS outage naked together come back spread out,
/// not all in the same instant.
pub fn backoff(delivered: i64) -> Duration {
    let n = delivered.clamp(1, 16) as u32 - 1;
    let wait = Duration::from_millis(250u64.saturating_mul(1 << n.min(7))).min(Duration::from_secs(30));
    pitcrew_model::jitter::within(wait)
}

/// Run `handler` over `consumer` until `shutdown` resolves, then wait up to `drain` for the
/// messages in hand. A panicking handler naks its message instead of killing the worker.
/// Handlers still running at the deadline are stopped and their messages naked without delay,
/// so another worker takes them at once (not after their ack wait); every handler is
/// idempotent. Pulls that keep failing back off (capped), and with `remake` the consumer is
/// made again after `REMAKE_AFTER` of them in a row. Nothing is pulled while `client` (the
/// consumer's) is cut off from NATS.
pub async fn consume<H: MessageHandler>(
    client: async_nats::Client,
    mut consumer: PullConsumer,
    remake: Option<Remake>,
    settings: StageSettings,
    handler: Arc<H>,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) {
    let name = handler.name();
    let sem = Arc::new(Semaphore::new(settings.concurrency));
    let mut tasks = JoinSet::new();
    // The message of each task and when it started, to hand it back should the drain deadline
    // stop its handler: one entry per task not yet joined (`concurrency` running, and those
    // that ended since the last join).
    let mut held: HashMap<tokio::task::Id, (Arc<jetstream::Message>, Instant)> = HashMap::new();
    tokio::pin!(shutdown);
    let mut failures = 0u32;
    'outer: loop {
        while let Some(done) = tasks.try_join_next_with_id() {
            joined(&name, done, &mut held);
        }
        // Pull only what can start now: a message never waits in a client buffer while its
        // ack timer runs (async-nats' default pull batch would). Shutdown is looked at first
        // (`biased`): with a permit free as well, an unbiased select would pick either, and a
        // stopping worker would go on pulling.
        if client.connection_state() != async_nats::connection::State::Connected {
            // Nothing reads the client's queue while it is cut off: a pull now would only wait
            // there, and pulls piling up for the length of an outage fill it, holding up
            // every other request of the process. Pull again once it is back.
            tokio::select! {
                biased;
                _ = &mut shutdown => break 'outer,
                _ = tokio::time::sleep(DISCONNECTED_LOOK) => continue,
            }
        }
        let first = tokio::select! {
            biased;
            _ = &mut shutdown => break 'outer,
            p = sem.clone().acquire_owned() => p.expect("semaphore never closed"),
        };
        let want = 1 + sem.available_permits().min(255);
        let asked = Instant::now();
        let batch = tokio::select! {
            biased;
            _ = &mut shutdown => break 'outer,
            b = consumer.fetch().max_messages(want).expires(FETCH_EXPIRES).messages() => b,
        };
        let mut batch = match batch {
            Ok(b) => b,
            Err(e) => {
                drop(first);
                failures += 1;
                if pull_failed(&name, &e.to_string(), failures, &mut consumer, remake.as_ref(), &mut shutdown).await {
                    break 'outer;
                }
                continue;
            }
        };
        let mut permit = Some(first);
        let (mut pulled, mut error) = (0usize, None);
        // Set once shutdown came while the batch was read (an idle pull waits up to
        // `FETCH_EXPIRES` for messages): what arrives after it is handed back, not started.
        let mut stopping = false;
        let mut handed_back = 0usize;
        // A fetch holds at most `want` messages, and we hold `want` permits' worth: every
        // message starts at once. Finishing the batch is not raced with shutdown, so none of
        // the fetched messages is left unsettled (it would wait out its ack timer).
        while let Some(next) = batch.next().await {
            let msg = match next {
                Ok(m) => m,
                Err(e) => {
                    // A consumer the server no longer has answers every pull with an error at
                    // once: without backing off, the worker would spin on it.
                    error = Some(e.to_string());
                    continue;
                }
            };
            pulled += 1;
            // Looked at once a message is in hand, and never again once it fired (a finished
            // future is not polled twice).
            stopping = stopping || shutdown.as_mut().now_or_never().is_some();
            if stopping {
                // Without delay: another worker takes it now. Bounded: with NATS gone the nak
                // cannot go out, and the message comes back after its ack wait.
                match tokio::time::timeout(crate::bus::FLUSH_LIMIT, hand_back(&msg)).await {
                    Ok(true) => handed_back += 1,
                    Ok(false) => {}
                    Err(_) => {
                        tracing::warn!(subject = %msg.subject, "NATS did not take a hand-back in time: the message is redelivered after its ack wait")
                    }
                }
                continue;
            }
            let permit = match permit.take() {
                Some(p) => p,
                None => sem.clone().acquire_owned().await.expect("semaphore never closed"),
            };
            let handler = handler.clone();
            let ack_wait = settings.ack_wait;
            let metric_name = name.clone();
            let msg = Arc::new(msg);
            let kept = msg.clone();
            // Counted in flight from its spawn: a task stopped before it ran is settled too.
            crate::metrics::started(&name);
            let began = Instant::now();
            let task = tasks.spawn(async move {
                let work = AssertUnwindSafe(handler.handle(msg.clone())).catch_unwind();
                let disposition = tokio::select! {
                    d = work => d.unwrap_or_else(|_| {
                        tracing::error!(subject = %msg.subject, "handler panicked: the message will be redelivered");
                        Disposition::Nak(Duration::from_secs(5))
                    }),
                    _ = progress(msg.clone(), ack_wait) => unreachable!("progress never returns"),
                };
                let outcome = match disposition {
                    Disposition::Ack => "ack",
                    Disposition::Nak(_) => "nak",
                    Disposition::Term => "term",
                };
                settle(&msg, disposition).await;
                crate::metrics::finished(&metric_name, outcome, began.elapsed());
                drop(permit);
            });
            held.insert(task.id(), (kept, began));
        }
        drop(permit);
        if stopping {
            tracing::info!(consumer = %name, handed_back, "stopping: messages that came after the signal were handed back, not started");
            break 'outer;
        }
        if pulled > 0 {
            failures = 0;
        }
        match error {
            Some(e) if pulled == 0 => {
                failures += 1;
                if pull_failed(&name, &e, failures, &mut consumer, remake.as_ref(), &mut shutdown).await {
                    break 'outer;
                }
            }
            Some(e) => tracing::warn!(consumer = %name, error = %e, "pull error"),
            None => failures = 0,
        }
        // A pull answered at once with nothing: the server had messages it could not hand out
        // (other workers' pulls wait for them, its ack-pending limit is reached) and said
        // "408 Requests Pending", which ends a batch like an expiry. Pulling again at once
        // would spin on it for as long as that lasts; the pulls already waiting take the
        // messages meanwhile. (An idle stream holds the pull until it expires.)
        if pulled == 0 && asked.elapsed() < FETCH_EXPIRES / 2 {
            tokio::select! {
                biased;
                _ = &mut shutdown => break 'outer,
                _ = tokio::time::sleep(EMPTY_PULL_PAUSE) => {}
            }
        }
    }
    tracing::info!(consumer = %name, in_flight = tasks.len(), "stopping: draining messages in hand");
    let drained = tokio::time::timeout(drain, async {
        while let Some(done) = tasks.join_next_with_id().await {
            joined(&name, done, &mut held);
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            consumer = %name,
            left = tasks.len(),
            drain_secs = drain.as_secs_f64(),
            "drain deadline passed: stopping what is left and handing its messages back for another worker"
        );
        tasks.abort_all();
        // A task stopped at an await (or whose handler panicked as it was dropped): its handler
        // is gone (a local command it ran killed with it), its message neither acked nor naked.
        // One that ended anyway had settled its message: nothing to hand back (the settle is
        // each task's last await, so a task is never stopped after it). Naked without delay:
        // another worker takes it now rather than after its ack wait.
        let mut stopped = Vec::new();
        while let Some(done) = tasks.join_next_with_id().await {
            match done {
                Err(e) => {
                    if e.is_panic() {
                        tracing::error!(consumer = %name, error = %e, "a message task panicked as it was stopped");
                    }
                    stopped.extend(held.remove(&e.id()));
                }
                ok => joined(&name, ok, &mut held),
            }
        }
        for (_, began) in &stopped {
            crate::metrics::finished(&name, "nak", began.elapsed());
        }
        // Bounded: with NATS unreachable the naks cannot go out (the client's queue may be
        // full), and the worker must still exit; those messages come back after their ack wait.
        let naks = futures::future::join_all(stopped.iter().map(|(msg, _)| hand_back(msg)));
        match tokio::time::timeout(crate::bus::FLUSH_LIMIT, naks).await {
            Ok(naked) => {
                let handed_back = naked.into_iter().filter(|ok| *ok).count();
                tracing::info!(consumer = %name, handed_back, "messages handed back for another worker");
            }
            Err(_) => tracing::warn!(
                consumer = %name,
                left = stopped.len(),
                "NATS did not take the hand-backs in time: those messages are redelivered after their ack wait"
            ),
        }
    }
}

/// Nak `msg` without delay, so another worker takes it now; false (said) when NATS refused.
async fn hand_back(msg: &jetstream::Message) -> bool {
    match msg.ack_with(AckKind::Nak(None)).await {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(subject = %msg.subject, error = %e, "cannot hand a message back: it is redelivered after its ack wait");
            false
        }
    }
}

/// A message task ended: forget its message; say so if it failed (a handler's panic is caught
/// inside the task, so this is a bug, or an abort).
fn joined(
    name: &str,
    done: Result<(tokio::task::Id, ()), tokio::task::JoinError>,
    held: &mut HashMap<tokio::task::Id, (Arc<jetstream::Message>, Instant)>,
) {
    match done {
        Ok((id, ())) => {
            held.remove(&id);
        }
        Err(e) => {
            held.remove(&e.id());
            tracing::error!(consumer = %name, error = %e, "message task failed");
        }
    }
}

/// The `failures`-th pull in a row failed: say so, wait out the backoff and, after
/// `REMAKE_AFTER` of them, make the consumer again. Returns true when shutdown came meanwhile.
async fn pull_failed(
    name: &str,
    error: &str,
    failures: u32,
    consumer: &mut PullConsumer,
    remake: Option<&Remake>,
    shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
) -> bool {
    let wait = backoff(failures as i64);
    tracing::warn!(consumer = %name, error = %error, failures, retry_in_ms = wait.as_millis() as u64, "cannot pull messages");
    tokio::select! {
        biased;
        _ = shutdown.as_mut() => return true,
        _ = tokio::time::sleep(wait) => {}
    }
    if let (Some(remake), true) = (remake, failures >= REMAKE_AFTER) {
        // Bounded: a server that takes the connection but leaves JetStream's API unanswered
        // must not hold the worker here; the next failed pull tries again.
        let made = tokio::select! {
            biased;
            _ = shutdown.as_mut() => return true,
            made = crate::bus::within("making the consumer again", remake()) => made.unwrap_or_else(|e| Err(e.to_string())),
        };
        match made {
            Ok(made) => {
                *consumer = made;
                tracing::info!(consumer = %name, "consumer made again (its stream or itself was missing, or the pulls kept failing)");
            }
            Err(e) => tracing::warn!(consumer = %name, error = %e, "cannot make the consumer again: will retry"),
        }
    }
    false
}

/// How often a handler running under `ack_wait` says it is still at work.
fn progress_every(ack_wait: Duration) -> Duration {
    (ack_wait / 3).clamp(Duration::from_millis(500), PROGRESS_AT_MOST)
}

/// The longest wait between progress acks, whatever this process's `ack_wait`: the
/// consumer's is the last configuration's to reach the server (a rolled-out change lowers it
/// under processes still running the old one), so none waits longer than this.
pub const PROGRESS_AT_MOST: Duration = Duration::from_secs(10);

/// Tell the server we are still working, so a long handler is not redelivered mid-flight.
/// Never returns: it is raced against the handler.
async fn progress(msg: Arc<jetstream::Message>, ack_wait: Duration) {
    let every = progress_every(ack_wait);
    loop {
        tokio::time::sleep(every).await;
        if let Err(e) = msg.ack_with(AckKind::Progress).await {
            // Handlers are idempotent, but another worker may now take the message up while
            // this one still works on it: worth an operator's eye if it recurs.
            tracing::warn!(error = %e, "progress ack failed: the message may be delivered again meanwhile");
        }
    }
}

async fn settle(msg: &jetstream::Message, d: Disposition) {
    let kind = match d {
        Disposition::Ack => AckKind::Ack,
        Disposition::Nak(delay) => AckKind::Nak(Some(delay)),
        Disposition::Term => AckKind::Term,
    };
    if let Err(e) = msg.ack_with(kind).await {
        // The message will be redelivered; handlers are idempotent.
        tracing::warn!(subject = %msg.subject, error = %e, "ack failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        for _ in 0..50 {
            assert!((Duration::from_millis(200)..=Duration::from_millis(250)).contains(&backoff(1)));
            assert!((Duration::from_millis(400)..=Duration::from_millis(500)).contains(&backoff(2)));
            assert!(backoff(100) <= Duration::from_secs(30));
            assert!(backoff(8) > backoff(7));
        }
        // Spread: what one outage naked together does not all come back at once.
        let mut waits: Vec<Duration> = (0..50).map(|_| backoff(5)).collect();
        waits.sort_unstable();
        waits.dedup();
        assert!(waits.len() > 25, "{waits:?}");
    }

    /// A third of the ack wait, but never longer than PROGRESS_AT_MOST: a consumer whose
    /// ack wait a newer configuration lowered still hears from a long handler in time.
    #[test]
    fn progress_acks_come_at_least_every_ten_seconds() {
        assert_eq!(progress_every(Duration::from_secs(30)), Duration::from_secs(10));
        assert_eq!(progress_every(Duration::from_secs(300)), PROGRESS_AT_MOST);
        assert_eq!(progress_every(Duration::from_secs(6)), Duration::from_secs(2));
        assert_eq!(progress_every(Duration::from_millis(600)), Duration::from_millis(500));
    }
}
