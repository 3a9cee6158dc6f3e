//! Posting: a durable JetStream consumer of `<prefix>.approvals.requested.*` that posts each
//! request to Slack, acked only once Slack said ok. The consumer's position is the bridge's
//! only memory: a restarted bridge posts what arrived while it was down, and nothing twice.

use super::api::{ApiError, SlackApi};
use super::message;
use async_nats::jetstream::{self, consumer};
use futures::future::BoxFuture;
use futures::FutureExt;
use pitcrew_model::ApprovalRequest;
use pitcrew_runtime::consume::{backoff, Disposition, MessageHandler};
use pitcrew_runtime::{Bus, Store};
use std::sync::Arc;
use std::time::Duration;

/// How long Slack may take before the server redelivers a request (progress acks extend it).
pub const ACK_WAIT: Duration = Duration::from_secs(30);

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

/// Posts each approval request to one channel.
pub struct Poster {
    pub api: SlackApi,
    pub store: Store,
    pub channel: String,
    pub durable: String,
}

impl MessageHandler for Poster {
    fn name(&self) -> String {
        self.durable.clone()
    }

    fn handle(self: Arc<Self>, msg: Arc<jetstream::Message>) -> BoxFuture<'static, Disposition> {
        async move { self.post(&msg).await }.boxed()
    }
}

impl Poster {
    async fn post(&self, msg: &jetstream::Message) -> Disposition {
        let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
        let req: ApprovalRequest = match serde_json::from_slice(&msg.payload) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(subject = %msg.subject, error = %e, "approval request unreadable: not posted to Slack");
                return Disposition::Term;
            }
        };
        let run = req.run_id;
        // Settled already (decided elsewhere, or expired while the bridge was down): nobody
        // needs to be asked any more.
        match self.store.approval_decision(run, &req.plan_hash).await {
            Ok(Some((decision, by, via, _))) => {
                tracing::info!(%run, plan = %req.plan_hash, %decision, %by, %via, "approval request already decided: not posted");
                return Disposition::Ack;
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(%run, error = %e, "cannot check whether the request is decided: retrying");
                return Disposition::Nak(backoff(delivered));
            }
        }
        if req.expires_at < chrono::Utc::now() {
            tracing::info!(%run, plan = %req.plan_hash, "approval request expired: not posted");
            return Disposition::Ack;
        }
        match self.api.post_message(&message::request(&self.channel, &req)).await {
            Ok(answer) => {
                let ts = answer.get("ts").and_then(|v| v.as_str()).unwrap_or("");
                let channel = answer.get("channel").and_then(|v| v.as_str()).unwrap_or(&self.channel);
                tracing::info!(%run, plan = %req.plan_hash, %channel, %ts, "approval request posted to Slack");
                Disposition::Ack
            }
            Err(ApiError::Retry { after, why }) => {
                let wait = after.max(backoff(delivered));
                tracing::warn!(%run, error = %why, retry_in_s = wait.as_secs(), delivered, "cannot post the approval request yet");
                Disposition::Nak(wait)
            }
            Err(ApiError::Permanent(why)) => {
                tracing::error!(
                    %run, plan = %req.plan_hash, error = %why,
                    "approval request cannot be posted to Slack: dropped (decide it with `pitcrew approve|deny`)"
                );
                Disposition::Term
            }
        }
    }
}
