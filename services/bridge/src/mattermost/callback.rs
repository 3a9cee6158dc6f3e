//! The action endpoint Mattermost calls when someone clicks Approve or Deny: check the
//! button's signed context, map the Mattermost user to an approver, publish the decision
//! through the runtime, and answer with the updated post. Every refusal changes nothing and
//! is answered with its reason, shown only to the clicker.

use super::message::{self, Context};
use crate::decide::{decide, Click, Outcome, MAX_DECIDING, TOO_MANY_DECIDING};
use crate::secret::Secret;
use axum::body::Body;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pitcrew_runtime::sources::Sources;
use pitcrew_runtime::{Bus, Config, Store};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::Semaphore;

/// What the endpoint needs.
pub struct App {
    pub bus: Bus,
    pub store: Store,
    pub cfg: Arc<Config>,
    /// Mattermost user id -> approver name.
    pub users: BTreeMap<String, String>,
    pub action_secret: Secret,
    /// Where action calls are taken from (`[bridge.mattermost] allow_from`).
    pub sources: Sources,
    /// A permit for each decision under way (at most [`MAX_DECIDING`]).
    pub deciding: Arc<Semaphore>,
}

impl App {
    /// Permits for [`App::deciding`].
    pub fn deciding() -> Arc<Semaphore> {
        Arc::new(Semaphore::new(MAX_DECIDING))
    }

    /// Wait, at most `within`, for the decisions under way (the action server has stopped
    /// taking clicks): one cut off at exit could land half-published behind its clicker.
    pub async fn finish_decisions(&self, within: std::time::Duration) {
        if tokio::time::timeout(within, self.deciding.acquire_many(MAX_DECIDING as u32)).await.is_err() {
            tracing::warn!(within_secs = within.as_secs(), "Mattermost decisions still under way at exit");
        }
    }
}

/// `POST /mattermost/actions` and `GET /healthz`.
pub fn router(app: Arc<App>) -> Router {
    Router::new().route("/mattermost/actions", post(actions)).route("/healthz", get(|| async { "ok" })).with_state(app)
}

/// The parts of Mattermost's action call the bridge reads.
#[derive(Debug, Clone, Deserialize)]
struct ActionCall {
    #[serde(default)]
    user_id: String,
    context: Context,
}

async fn actions(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    // Mattermost signs nothing: the clicker's user id is the caller's word, so only the
    // addresses the operator named may call (before the body is read).
    if !app.sources.allows(peer.ip()) {
        let source = peer.ip();
        tracing::warn!(%source, "Mattermost action refused: the caller is not in [bridge.mattermost] allow_from");
        let why = format!("action calls are taken only from [bridge.mattermost] allow_from; {source} is not in it");
        return (StatusCode::FORBIDDEN, why).into_response();
    }
    let body = match crate::inbound::read_body(&headers, body).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let call: ActionCall = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => {
            let why = format!("not a Mattermost action call from a pitcrew button: {e}");
            tracing::warn!(reason = %why, "Mattermost action refused: unreadable");
            return (StatusCode::BAD_REQUEST, why).into_response();
        }
    };
    let (user, run) = (call.user_id.as_str(), call.context.run);
    let decision = match call.context.verify(&app.action_secret) {
        Ok(d) => d,
        Err(why) => {
            tracing::warn!(mattermost_user = %user, %run, reason = %why, "Mattermost action refused: not authenticated");
            return (StatusCode::UNAUTHORIZED, why).into_response();
        }
    };
    // Decided in a task of its own: Mattermost giving up on the call (its timeout) or the
    // connection dropping must not cut a decision off half way, a vote counted and its
    // decision not published. Bounded: callers that give up (and click again, or are retried
    // by Mattermost) while Postgres or NATS is slow would otherwise pile such tasks up.
    let Ok(permit) = app.deciding.clone().try_acquire_owned() else {
        tracing::warn!(mattermost_user = %user, %run, "too many Mattermost decisions under way: this click is refused");
        return Json(message::ephemeral(TOO_MANY_DECIDING)).into_response();
    };
    let decided = pitcrew_runtime::trace::to_the_end({
        let app = app.clone();
        let call = call.clone();
        async move {
            let _permit = permit;
            let context = &call.context;
            let click = Click {
                chat: "mattermost",
                user: &call.user_id,
                run: context.run,
                plan_hash: &context.plan_hash,
                attempt: context.attempt,
                decision,
            };
            decide(&app.bus, &app.store, &app.cfg, &app.users, click).await
        }
    })
    .await
    .unwrap_or_else(|| Err("the decision's task was cancelled".to_string()));
    match decided {
        Ok(Outcome::Decided { req, approver }) => Json(message::decided(&req, decision, &approver)).into_response(),
        Ok(Outcome::Counted { note }) => Json(message::ephemeral(&note)).into_response(),
        Err(why) => {
            tracing::warn!(mattermost_user = %user, %run, reason = %why, "Mattermost decision refused: nothing changed");
            Json(message::ephemeral(&why)).into_response()
        }
    }
}
