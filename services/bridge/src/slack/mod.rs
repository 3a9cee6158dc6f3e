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
use tokio::net::TcpListener;

/// The bridge's two secrets, read from the variables the config names.
#[derive(Debug, Clone)]
pub struct Secrets {
    pub token: Secret,
    pub signing_secret: Secret,
}

impl Secrets {
    pub fn from_env(slack: &SlackConfig) -> anyhow::Result<Secrets> {
        Ok(Secrets {
            token: Secret::from_env(&slack.token_env, "the Slack bot token", "token_env", "slack")?,
            signing_secret: Secret::from_env(
                &slack.signing_secret_env,
                "the Slack signing secret",
                "signing_secret_env",
                "slack",
            )?,
        })
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
    let slack = settings(&cfg)?;
    let secrets = Secrets::from_env(slack)?;
    let listener = TcpListener::bind(&slack.listen)
        .await
        .with_context(|| format!("[bridge.slack] listen = \"{}\": cannot bind", slack.listen))?;
    run(cfg, secrets, listener, shutdown).await
}

/// Run both halves until `shutdown`: post requests, serve callbacks on `listener`.
pub async fn run(cfg: Config, secrets: Secrets, listener: TcpListener, shutdown: Shutdown) -> anyhow::Result<()> {
    let slack = settings(&cfg)?.clone();
    let (bus, store) = crate::connect(&cfg).await?;
    let api = api::SlackApi::new(&slack.api_url, secrets.token, Duration::from_secs(slack.timeout_secs.max(1)))?;
    let chat = api::SlackChat { api: api.clone(), channel: slack.channel.clone() };
    let posting =
        crate::post::spawn(&bus, store.clone(), chat, &slack.durable, slack.concurrency, shutdown.clone()).await?;
    let cfg = Arc::new(cfg);
    let app = Arc::new(callback::App::new(bus.clone(), store, cfg.clone(), api, secrets.signing_secret));
    let listen = listener.local_addr()?;
    tracing::info!(
        %listen, api = %slack.api_url, channel = %slack.channel, users = slack.users.len(), durable = %slack.durable,
        "slack bridge running: posting approval requests, callbacks on POST /slack/interactions"
    );
    let served = axum::serve(listener, callback::router(app)).with_graceful_shutdown(shutdown).await;
    posting.await.context("the posting task failed")?;
    bus.client.flush().await.ok();
    tracing::info!("slack bridge stopped");
    served.context("the callback server failed")
}
