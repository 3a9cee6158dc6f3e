//! `pitcrew bridge mattermost`: approval requests posted to a Mattermost channel with
//! Approve/Deny buttons, and the buttons' action calls turned into decisions on the bridge
//! subject. Like the Slack bridge it keeps no state: restart it at any time.

pub mod api;
pub mod callback;
pub mod message;

use crate::secret::Secret;
use crate::Shutdown;
use anyhow::Context as _;
use pitcrew_runtime::config::MattermostConfig;
use pitcrew_runtime::Config;
use std::sync::Arc;
use std::time::Duration;

/// The bridge's two secrets, read from the variables the config names.
#[derive(Debug, Clone)]
pub struct Secrets {
    pub token: Secret,
    pub action_secret: Secret,
}

impl Secrets {
    pub fn from_env(mm: &MattermostConfig) -> anyhow::Result<Secrets> {
        Ok(Secrets {
            token: Secret::from_env(&mm.token_env, "the Mattermost bot token", "token_env", "mattermost")?,
            action_secret: Secret::from_env(
                &mm.action_secret_env,
                "the Mattermost action secret",
                "action_secret_env",
                "mattermost",
            )?,
        })
    }
}

/// The `[bridge.mattermost]` table, or what to add.
pub fn settings(cfg: &Config) -> anyhow::Result<&MattermostConfig> {
    cfg.bridge
        .mattermost
        .as_ref()
        .context("no [bridge.mattermost] in the config: add it with `url`, `channel_id` and `public_url`")
}

/// `pitcrew bridge mattermost`: secrets from the environment, the endpoint on `listen`.
pub async fn run_from_env(cfg: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    let secrets = Secrets::from_env(settings(&cfg)?)?;
    run(cfg, secrets, shutdown).await
}

/// Run both halves until `shutdown`: post requests, serve action calls on `listen`. The
/// settings are checked first; the port opens only once NATS and Postgres answer: a click the
/// kernel took in before could not be decided, would time out in Mattermost, and be applied
/// once they answered, behind the clicker's back.
pub async fn run(cfg: Config, secrets: Secrets, shutdown: Shutdown) -> anyhow::Result<()> {
    let mm = settings(&cfg)?.clone();
    let sources = mm.sources().map_err(|e| anyhow::anyhow!("bad configuration: {e}"))?;
    let api = api::MattermostApi::new(&mm.url, secrets.token, Duration::from_secs(mm.timeout_secs.max(1)))?;
    pitcrew_runtime::httpd::can_bind(&mm.listen, "[bridge.mattermost] listen").await?;
    let Some((bus, store)) = pitcrew_runtime::start::connect_patiently(&cfg, &shutdown).await? else { return Ok(()) };
    crate::serve_metrics(&cfg, &bus, &store, &mm.durable, shutdown.clone()).await?;
    let action_url = format!("{}/mattermost/actions", mm.public_url.trim_end_matches('/'));
    let chat = api::MattermostChat {
        api,
        channel_id: mm.channel_id.clone(),
        action_url: action_url.clone(),
        action_secret: secrets.action_secret.clone(),
    };
    let posting = crate::post::spawn(&bus, store.clone(), chat, &mm.durable, mm.concurrency, shutdown.clone()).await?;
    let app = Arc::new(callback::App {
        bus: bus.clone(),
        store,
        users: mm.users.clone(),
        cfg: Arc::new(cfg),
        action_secret: secrets.action_secret,
        sources,
        deciding: callback::App::deciding(),
    });
    // Last: clicks come in only once every part of the bridge is ready to decide them.
    let listener = pitcrew_runtime::httpd::bind(&mm.listen, "[bridge.mattermost] listen").await?;
    let listen = listener.local_addr()?;
    tracing::info!(
        %listen, server = %pitcrew_runtime::config::redact_url(&mm.url), channel = %mm.channel_id, %action_url, users = mm.users.len(), allow_from = ?mm.allow_from, durable = %mm.durable,
        "mattermost bridge running: posting approval requests, actions on POST /mattermost/actions"
    );
    let served = pitcrew_runtime::httpd::serve(listener, callback::router(app.clone()), shutdown).await;
    app.finish_decisions(Duration::from_secs(15)).await;
    posting.await.context("the posting task failed")?;
    bus.flush_before_exit().await;
    tracing::info!("mattermost bridge stopped");
    served.context("the action server failed")
}
