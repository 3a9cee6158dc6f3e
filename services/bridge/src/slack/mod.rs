//! `pitcrew bridge slack`: approval requests posted to a Slack-compatible Web API with
//! Approve/Deny buttons, and the buttons' callbacks turned into decisions on the bridge
//! subject. Two halves share nothing but the config: posting (a durable consumer) and the
//! callback endpoint (an HTTP server). Restart it at any time: nothing is lost.

pub mod api;
pub mod callback;
pub mod message;
pub mod signature;

use crate::secret::Secret;
use crate::Shutdown;
use anyhow::Context;
use pitcrew_runtime::config::SlackConfig;
use pitcrew_runtime::Config;
use std::sync::Arc;
use std::time::Duration;

/// The bridge's secrets, read from the variables the config names.
#[derive(Debug, Clone)]
pub struct Secrets {
    /// Required unless posting through a webhook.
    pub token: Option<Secret>,
    pub signing_secret: Secret,
    /// The incoming webhook's URL, when `webhook_url_env` names one.
    pub webhook_url: Option<Secret>,
}

impl Secrets {
    pub fn from_env(slack: &SlackConfig) -> anyhow::Result<Secrets> {
        let webhook_url = match &slack.webhook_url_env {
            Some(var) => Some(Secret::from_env(var, "the Slack incoming webhook URL", "webhook_url_env", "slack")?),
            None => None,
        };
        let token = Secret::from_env(&slack.token_env, "the Slack bot token", "token_env", "slack");
        let token = match (token, &webhook_url) {
            (Ok(t), _) => Some(t),
            (Err(_), Some(_)) => None,
            (Err(missing), None) => return Err(missing.into()),
        };
        let signing_secret =
            Secret::from_env(&slack.signing_secret_env, "the Slack signing secret", "signing_secret_env", "slack")?;
        Ok(Secrets { token, signing_secret, webhook_url })
    }
}

/// The `[bridge.slack]` table, or what to add.
pub fn settings(cfg: &Config) -> anyhow::Result<&SlackConfig> {
    cfg.bridge
        .slack
        .as_ref()
        .context("no [bridge.slack] in the config: add at least `[bridge.slack]` with `channel = \"C0123\"`")
}

/// `pitcrew bridge slack`: secrets from the environment, the endpoint on `listen`.
pub async fn run_from_env(cfg: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    let secrets = Secrets::from_env(settings(&cfg)?)?;
    run(cfg, secrets, shutdown).await
}

/// Run both halves until `shutdown`: post requests, serve callbacks on `listen`. The settings
/// are checked first; the port opens only once NATS and Postgres answer: a click the kernel
/// took in before could not be decided, would time out in Slack, and be applied once they
/// answered, behind the clicker's back.
pub async fn run(cfg: Config, secrets: Secrets, shutdown: Shutdown) -> anyhow::Result<()> {
    let slack = settings(&cfg)?.clone();
    let timeout = Duration::from_secs(slack.timeout_secs.max(1));
    let api = api::SlackApi::new(&slack.api_url, secrets.token, secrets.webhook_url, timeout)?;
    pitcrew_runtime::httpd::can_bind(&slack.listen, "[bridge.slack] listen").await?;
    let Some((bus, store)) = pitcrew_runtime::start::connect_patiently(&cfg, &shutdown).await? else { return Ok(()) };
    crate::serve_metrics(&cfg, &bus, &store, &slack.durable, shutdown.clone()).await?;
    let chat = api::SlackChat { api: api.clone(), channel: slack.channel.clone() };
    let posting =
        crate::post::spawn(&bus, store.clone(), chat, &slack.durable, slack.concurrency, shutdown.clone()).await?;
    let cfg = Arc::new(cfg);
    let app = Arc::new(callback::App::new(bus.clone(), store, cfg.clone(), api, secrets.signing_secret));
    // Last: clicks come in only once every part of the bridge is ready to decide them.
    let listener = pitcrew_runtime::httpd::bind(&slack.listen, "[bridge.slack] listen").await?;
    let listen = listener.local_addr()?;
    tracing::info!(
        %listen, api = %pitcrew_runtime::config::redact_url(&slack.api_url), channel = %slack.channel, webhook = slack.webhook_url_env.is_some(), users = slack.users.len(), durable = %slack.durable,
        "slack bridge running: posting approval requests, callbacks on POST /slack/interactions"
    );
    let served = pitcrew_runtime::httpd::serve(listener, callback::router(app.clone()), shutdown).await;
    app.finish_decisions(Duration::from_secs(15)).await;
    posting.await.context("the posting task failed")?;
    bus.flush_before_exit().await;
    tracing::info!("slack bridge stopped");
    served.context("the callback server failed")
}
