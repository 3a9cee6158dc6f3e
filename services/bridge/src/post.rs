//! Posting: a durable JetStream consumer of `<prefix>.approvals.requested.*` that posts each
//! request to a chat, acked only once the chat said ok. The consumer's position, and a note in
//! Postgres of each request posted, are a bridge's memory: a restarted bridge posts what
//! arrived while it was down, and a request delivered again (its ack lost, the consumer made
//! anew) is not posted twice.

use crate::outbound::ApiError;
use crate::Shutdown;
use async_nats::jetstream::{self, consumer};
use futures::future::BoxFuture;
use futures::FutureExt;
use pitcrew_model::ApprovalRequest;
use pitcrew_runtime::config::StageSettings;
use pitcrew_runtime::consume::{backoff, consume, Disposition, MessageHandler, Remake};
use pitcrew_runtime::{Bus, Store};
use std::sync::Arc;
use std::time::Duration;

/// How long a chat may take before the server redelivers a request (progress acks extend it).
pub const ACK_WAIT: Duration = Duration::from_secs(30);
/// How long a stopping bridge waits for the posts in hand.
pub const DRAIN: Duration = Duration::from_secs(10);

/// A chat approval requests are posted to.
pub trait Chat: Send + Sync + 'static {
    /// For logs: `slack`, `mattermost`.
    fn name(&self) -> &'static str;
    /// Post `req` with its buttons; on success, where it landed (for the log).
    fn post<'a>(&'a self, req: &'a ApprovalRequest) -> BoxFuture<'a, Result<String, ApiError>>;
}

/// Post every approval request to `chat` from the durable consumer `durable` until
/// `shutdown`, at most `concurrency` at once.
pub async fn spawn<C: Chat>(
    bus: &Bus,
    store: Store,
    chat: C,
    durable: &str,
    concurrency: usize,
    shutdown: Shutdown,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let concurrency = concurrency.max(1);
    let max_ack_pending = concurrency as i64 * 4;
    let consumer = requests_consumer(bus, durable, max_ack_pending).await?;
    // The crew makes the approvals stream again if the server lost it; the bridge its consumer.
    let remake: Remake = {
        let (bus, durable) = (bus.clone(), durable.to_string());
        Arc::new(move || {
            let (bus, durable) = (bus.clone(), durable.clone());
            Box::pin(async move { requests_consumer(&bus, &durable, max_ack_pending).await.map_err(|e| e.to_string()) })
        })
    };
    let settings = StageSettings {
        concurrency,
        ack_wait: ACK_WAIT,
        max_ack_pending,
        max_deliveries: u64::MAX,
        poison_after: Duration::MAX,
    };
    let poster = Arc::new(Poster { chat, store, bus: bus.clone(), durable: durable.to_string() });
    Ok(tokio::spawn(consume(bus.client.clone(), consumer, Some(remake), settings, poster, shutdown, DRAIN)))
}

/// The bridge's durable consumer of approval requests, created if missing.
pub async fn requests_consumer(
    bus: &Bus,
    durable: &str,
    max_ack_pending: i64,
) -> anyhow::Result<consumer::PullConsumer> {
    let stream_name = bus.subjects.approvals_stream();
    let stream = bus.js.get_stream(&stream_name).await.map_err(|e| {
        anyhow::anyhow!("JetStream stream {stream_name}: {e} (a nats-server >= 2.10 with -js is required)")
    })?;
    let config = consumer::pull::Config {
        durable_name: Some(durable.to_string()),
        filter_subject: format!("{}.approvals.requested.*", bus.subjects.prefix()),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: ACK_WAIT,
        max_deliver: -1,
        max_ack_pending,
        ..Default::default()
    };
    stream.create_consumer(config).await.map_err(|e| {
        anyhow::anyhow!(
            "consumer {durable} on {stream_name}: {e} (is another bridge using this name with other settings?)"
        )
    })
}

/// Posts each approval request to one chat.
struct Poster<C> {
    chat: C,
    store: Store,
    bus: Bus,
    durable: String,
}

impl<C: Chat> MessageHandler for Poster<C> {
    fn name(&self) -> String {
        self.durable.clone()
    }

    fn handle(self: Arc<Self>, msg: Arc<jetstream::Message>) -> BoxFuture<'static, Disposition> {
        async move { self.post(&msg).await }.boxed()
    }
}

impl<C: Chat> Poster<C> {
    async fn post(&self, msg: &jetstream::Message) -> Disposition {
        let chat = self.chat.name();
        let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
        let req: ApprovalRequest = match serde_json::from_slice(&msg.payload) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(chat, subject = %msg.subject, error = %e, "approval request unreadable: not posted");
                crate::posted(chat, "unreadable");
                return Disposition::Term;
            }
        };
        let run = req.run_id;
        // Settled already (decided elsewhere, or expired while the bridge was down): nobody
        // needs to be asked any more.
        match self.store.approval_decision(run, &req.plan_hash).await {
            Ok(Some((decision, by, via, _))) => {
                tracing::info!(chat, %run, plan = %req.plan_hash, %decision, %by, %via, "approval request already decided: not posted");
                crate::posted(chat, "decided_elsewhere");
                return Disposition::Ack;
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(chat, %run, error = %e, "cannot check whether the request is decided: retrying");
                return Disposition::Nak(backoff(delivered));
            }
        }
        // Asked again since (another plan, or the same one by a later attempt), as a request
        // posted late (the chat was down) would be: its buttons could only be refused.
        match pitcrew_runtime::approvals::find_request(&self.bus, run).await {
            Ok(Some(latest))
                if (latest.plan_hash.as_str(), latest.attempt) != (req.plan_hash.as_str(), req.attempt) =>
            {
                tracing::info!(
                    chat, %run, plan = %req.plan_hash, attempt = req.attempt, now_plan = %latest.plan_hash,
                    now_attempt = latest.attempt, "approval request superseded by a later one: not posted"
                );
                crate::posted(chat, "superseded");
                return Disposition::Ack;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(chat, %run, error = %e, "cannot check whether the request is the run's latest: retrying");
                return Disposition::Nak(backoff(delivered));
            }
        }
        // Posted already, its ack lost (or its consumer made anew): not posted twice.
        let poster = format!("{}:{}", self.durable, req.attempt);
        match self.store.request_posted(run, &req.plan_hash, &poster).await {
            Ok(true) => {
                tracing::info!(chat, %run, plan = %req.plan_hash, attempt = req.attempt, "approval request posted before: not posted again");
                crate::posted(chat, "posted_before");
                return Disposition::Ack;
            }
            Ok(false) => {}
            // Posted twice is the lesser harm than not at all (a database without the note's
            // column yet, its migration still to run).
            Err(e) => tracing::warn!(chat, %run, error = %e, "cannot check whether the request was posted: posting it"),
        }
        if req.expires_at < chrono::Utc::now() {
            tracing::info!(chat, %run, plan = %req.plan_hash, "approval request expired: not posted");
            crate::posted(chat, "expired");
            return Disposition::Ack;
        }
        match self.chat.post(&req).await {
            Ok(at) => {
                tracing::info!(chat, %run, plan = %req.plan_hash, %at, "approval request posted");
                crate::posted(chat, "posted");
                // Best effort: without the note, a redelivery would post it again, no worse.
                if let Err(e) = self.store.mark_posted(run, &req.plan_hash, &poster).await {
                    tracing::warn!(chat, %run, error = %e, "cannot note the request as posted: a redelivery would post it again");
                }
                Disposition::Ack
            }
            Err(ApiError::Retry { after, why }) => {
                let wait = after.max(backoff(delivered));
                tracing::warn!(chat, %run, error = %why, retry_in_s = wait.as_secs(), delivered, "cannot post the approval request yet");
                crate::posted(chat, "retry");
                Disposition::Nak(wait)
            }
            Err(ApiError::Permanent(why)) => {
                tracing::error!(
                    chat, %run, plan = %req.plan_hash, error = %why,
                    "approval request cannot be posted: dropped (decide it with `pitcrew approve|deny`)"
                );
                crate::posted(chat, "dropped");
                Disposition::Term
            }
        }
    }
}
