//! The interactivity endpoint Slack calls when someone clicks Approve or Deny: verify the
//! signature, map the Slack user to an approver, publish the decision through the runtime
//! (which refuses stale plans and plans already decided), then update the message. Every
//! refusal changes nothing and is answered with its reason, shown only to the clicker.

use super::api::SlackApi;
use super::message::{self, APPROVE, DENY};
use super::signature;
use crate::decide::{decide, Click, Outcome};
use crate::secret::Secret;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pitcrew_model::Decision;
use pitcrew_runtime::{Bus, Config, Store};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::Semaphore;

/// Message updates and ephemeral answers in flight at once; beyond it they are skipped.
const MAX_FOLLOW_UPS: usize = 32;

/// Slack shows the clicker an error when no answer comes within 3 s: a decision still under
/// way by then is answered as such, and its outcome follows on the response_url.
const ANSWER_WITHIN: std::time::Duration = std::time::Duration::from_millis(2500);

use crate::decide::{MAX_DECIDING, TOO_MANY_DECIDING};

/// What the endpoint needs: where to publish, what to check, whom to believe.
pub struct App {
    pub bus: Bus,
    pub store: Store,
    pub cfg: Arc<Config>,
    /// Slack user id -> approver name.
    pub users: BTreeMap<String, String>,
    pub api: SlackApi,
    pub signing_secret: Secret,
    follow_ups: Arc<Semaphore>,
    /// A permit per decision under way: a stopping bridge waits for them all.
    deciding: Arc<Semaphore>,
}

impl App {
    pub fn new(bus: Bus, store: Store, cfg: Arc<Config>, api: SlackApi, signing_secret: Secret) -> App {
        let users = cfg.bridge.slack.as_ref().map(|s| s.users.clone()).unwrap_or_default();
        App {
            bus,
            store,
            cfg,
            users,
            api,
            signing_secret,
            follow_ups: Arc::new(Semaphore::new(MAX_FOLLOW_UPS)),
            deciding: Arc::new(Semaphore::new(MAX_DECIDING)),
        }
    }

    /// Wait, at most `within`, for the decisions under way (the callback server has stopped
    /// taking clicks): one cut off at exit could land half-published behind its clicker; then
    /// for the Slack calls that follow them (the message updated, the clicker told).
    pub async fn finish_decisions(&self, within: std::time::Duration) {
        let all = async {
            let _decided = self.deciding.acquire_many(MAX_DECIDING as u32).await;
            let _told = self.follow_ups.acquire_many(MAX_FOLLOW_UPS as u32).await;
        };
        if tokio::time::timeout(within, all).await.is_err() {
            tracing::warn!(
                within_secs = within.as_secs(),
                "Slack decisions or their follow-ups still under way at exit"
            );
        }
    }
}

/// `POST /slack/interactions` and `GET /healthz`.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/slack/interactions", post(interactions))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(app)
}

/// The parts of a `block_actions` payload the bridge reads (Slack sends many more).
#[derive(Debug, Deserialize)]
struct Interaction {
    #[serde(rename = "type")]
    kind: String,
    user: Option<Id>,
    #[serde(default)]
    actions: Vec<Action>,
    channel: Option<Id>,
    message: Option<Ts>,
    container: Option<Container>,
    response_url: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Id {
    id: String,
}

#[derive(Debug, Deserialize)]
struct Ts {
    ts: String,
}

#[derive(Debug, Deserialize)]
struct Container {
    channel_id: Option<String>,
    message_ts: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Action {
    action_id: String,
    value: Option<String>,
}

async fn interactions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let body = match crate::inbound::read_body(&headers, body).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let now = chrono::Utc::now().timestamp();
    let verified = signature::verify(
        &app.signing_secret,
        header("x-slack-request-timestamp"),
        header("x-slack-signature"),
        &body,
        now,
    );
    if let Err(why) = verified {
        tracing::warn!(reason = %why, "Slack callback refused: not authenticated");
        return (StatusCode::UNAUTHORIZED, why.to_string()).into_response();
    }
    let interaction = match parse(&body) {
        Ok(i) => i,
        Err(why) => {
            tracing::warn!(reason = %why, "Slack callback refused: unreadable payload");
            return (StatusCode::BAD_REQUEST, why).into_response();
        }
    };
    if interaction.kind != "block_actions" {
        tracing::debug!(kind = %interaction.kind, "Slack interaction ignored: not a button");
        return StatusCode::OK.into_response();
    }
    let user = interaction.user.as_ref().map(|u| u.id.clone()).unwrap_or_default();
    // For the log: the run the button names, if it names one.
    let run = interaction
        .actions
        .first()
        .and_then(|a| message::parse_button_value(a.value.as_deref()?).ok())
        .map(|(run, _, _)| run.to_string())
        .unwrap_or_default();
    // The decision goes on whatever happens to this request (a decision cut off mid-publish
    // could land with the clicker told it failed); the answer waits for it only so long.
    let interaction = Arc::new(interaction);
    let Ok(permit) = app.deciding.clone().try_acquire_owned() else {
        tracing::warn!(slack_user = %user, %run, "too many Slack decisions under way: this click is refused");
        return Json(message::ephemeral(TOO_MANY_DECIDING)).into_response();
    };
    let mut deciding = {
        let (app, interaction, user) = (app.clone(), interaction.clone(), user.clone());
        tokio::spawn(async move {
            let decided = app.decide(&interaction, &user).await;
            drop(permit);
            decided
        })
    };
    let decided = match tokio::time::timeout(ANSWER_WITHIN, &mut deciding).await {
        Ok(decided) => decided,
        Err(_) => {
            tracing::warn!(slack_user = %user, %run, "Slack decision slow (NATS or Postgres): answering that it follows");
            tokio::spawn(async move {
                let decided = deciding.await;
                settle(&app, &interaction, &user, &run, decided, false);
            });
            let note = "Deciding takes longer than usual (NATS or Postgres is slow): the outcome follows here.";
            return Json(message::ephemeral(note)).into_response();
        }
    };
    settle(&app, &interaction, &user, &run, decided, true)
}

/// What a click decided, told to the clicker: on the response_url, and as the HTTP answer when
/// `answering` (the decision came in time for it).
fn settle(
    app: &App,
    interaction: &Interaction,
    user: &str,
    run: &str,
    decided: Result<Result<Option<String>, String>, tokio::task::JoinError>,
    answering: bool,
) -> Response {
    let decided = decided.unwrap_or_else(|e| Err(format!("the decision failed inside the bridge: {e}")));
    let note = match decided {
        Ok(None) => return StatusCode::OK.into_response(),
        Ok(Some(note)) => note,
        Err(why) => {
            tracing::warn!(slack_user = %user, %run, reason = %why, "Slack decision refused: nothing changed");
            why
        }
    };
    app.answer(interaction, &note);
    match answering {
        true => Json(message::ephemeral(&note)).into_response(),
        false => StatusCode::OK.into_response(),
    }
}

fn parse(body: &[u8]) -> Result<Interaction, String> {
    let payload = form_urlencoded::parse(body)
        .find(|(k, _)| k == "payload")
        .map(|(_, v)| v)
        .ok_or("the body has no `payload` field: not a Slack interaction")?;
    serde_json::from_str(&payload).map_err(|e| format!("the interaction payload is not what Slack sends: {e}"))
}

impl App {
    /// Publish the clicker's decision. Ok(None): decided (the message is being updated);
    /// Ok(Some(note)): counted, with a note for the clicker; Err: refused, with the reason.
    async fn decide(&self, i: &Interaction, user: &str) -> Result<Option<String>, String> {
        let action = i.actions.first().ok_or("the interaction carries no action")?;
        let decision = match action.action_id.as_str() {
            APPROVE => Decision::Approve,
            DENY => Decision::Deny,
            other => {
                return Err(format!(
                    "unknown action '{}': only approve and deny",
                    other.chars().take(40).collect::<String>()
                ))
            }
        };
        let (run, plan_hash, attempt) = message::parse_button_value(action.value.as_deref().unwrap_or(""))?;
        let click = Click { chat: "slack", user, run, plan_hash: &plan_hash, attempt, decision };
        let (req, approver) = match decide(&self.bus, &self.store, &self.cfg, &self.users, click).await? {
            Outcome::Counted { note } => return Ok(Some(note)),
            Outcome::Decided { req, approver } => (req, approver),
        };
        if !self.api.can_update() {
            // No bot token (posting through a webhook): replace it through the response_url.
            let Some(url) = i.response_url.clone() else {
                tracing::warn!(%run, "no bot token and no response_url: the message is not updated");
                return Ok(None);
            };
            let body = message::replaced(&req, decision, &approver, user);
            self.follow_up(move |api| async move {
                match api.respond(&url, &body).await {
                    Ok(()) => tracing::info!(%run, "Slack message replaced with the outcome"),
                    Err(e) => tracing::warn!(%run, error = %e, "cannot replace the Slack message with the outcome"),
                }
            });
            return Ok(None);
        }
        let channel = i.channel.as_ref().map(|c| c.id.clone()).or_else(|| i.container.as_ref()?.channel_id.clone());
        let ts = i.message.as_ref().map(|m| m.ts.clone()).or_else(|| i.container.as_ref()?.message_ts.clone());
        let (Some(channel), Some(ts)) = (channel, ts) else {
            tracing::warn!(%run, "the interaction names no message: it is not updated");
            return Ok(None);
        };
        let body = message::decided(&channel, &ts, &req, decision, &approver, user);
        self.follow_up(move |api| async move {
            match api.update(&body).await {
                Ok(_) => tracing::info!(%run, %channel, %ts, "Slack message updated with the outcome"),
                Err(e) => tracing::warn!(%run, error = %e, "cannot update the Slack message with the outcome"),
            }
        });
        Ok(None)
    }

    /// Tell the clicker `text` on the interaction's `response_url`, when it has one.
    fn answer(&self, i: &Interaction, text: &str) {
        let Some(url) = i.response_url.clone() else { return };
        let body = message::ephemeral(text);
        self.follow_up(move |api| async move {
            if let Err(e) = api.respond(&url, &body).await {
                tracing::warn!(error = %e, "cannot answer on the interaction's response_url");
            }
        });
    }

    /// Run a Slack call after the HTTP answer (Slack wants one within 3 s), bounded in number.
    fn follow_up<F, Fut>(&self, f: F)
    where
        F: FnOnce(SlackApi) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let Ok(permit) = self.follow_ups.clone().try_acquire_owned() else {
            tracing::warn!("too many Slack follow-ups in flight: one skipped");
            return;
        };
        let work = f(self.api.clone());
        tokio::spawn(async move {
            work.await;
            drop(permit);
        });
    }
}
