//! Mattermost's REST API v4, the one call the bridge makes: `POST /api/v4/posts` with the
//! bot's token. Bounded in time and answer size; failures sorted into retry or never.

use super::message;
use crate::outbound::{self, net, read_bounded, retry_status, ApiError};
use crate::post::Chat;
use crate::secret::Secret;
use futures::future::BoxFuture;
use futures::FutureExt;
use pitcrew_model::ApprovalRequest;
use pitcrew_runtime::config::redact_url;
use serde_json::Value;
use std::time::Duration;

/// A client of one Mattermost server with one bot token.
#[derive(Clone)]
pub struct MattermostApi {
    http: reqwest::Client,
    base: String,
    token: Secret,
}

impl MattermostApi {
    pub fn new(base: &str, token: Secret, timeout: Duration) -> anyhow::Result<MattermostApi> {
        Ok(MattermostApi { http: outbound::client(timeout)?, base: base.trim_end_matches('/').to_string(), token })
    }

    /// Create a post; returns the created post (its `id`).
    pub async fn create_post(&self, body: &Value) -> Result<Value, ApiError> {
        let method = "POST /api/v4/posts";
        let resp = self
            .http
            .post(format!("{}/api/v4/posts", self.base))
            .bearer_auth(self.token.expose())
            .json(body)
            .send()
            .await
            .map_err(|e| net(method, e))?;
        if let Some(retry) = retry_status(method, &resp) {
            return Err(retry);
        }
        let status = resp.status();
        let body = read_bounded(resp).await.map_err(|why| ApiError::Retry {
            after: Duration::from_secs(10),
            why: format!("{method}: reading the answer: {why}"),
        })?;
        let answer: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if status.is_success() {
            return Ok(answer);
        }
        let said = answer.get("message").and_then(Value::as_str).unwrap_or("no message").to_string();
        // A bad token, a bot not in the channel, a channel id that names none: fixed by the
        // operator, after which the request is still worth posting (until it expires).
        if matches!(status.as_u16(), 401 | 403 | 404) {
            return Err(ApiError::Retry {
                after: Duration::from_secs(60),
                why: format!(
                    "{method}: HTTP {status}: {said}: check the bot token, the channel id, api_url and the bot's channel membership"
                ),
            });
        }
        Err(ApiError::Permanent(format!("{method}: HTTP {status} from {}: {said}", redact_url(&self.base))))
    }
}

/// Posting to one channel, buttons calling back `action_url` with a signed context.
pub struct MattermostChat {
    pub api: MattermostApi,
    pub channel_id: String,
    pub action_url: String,
    pub action_secret: Secret,
}

impl Chat for MattermostChat {
    fn name(&self) -> &'static str {
        "mattermost"
    }

    fn post<'a>(&'a self, req: &'a ApprovalRequest) -> BoxFuture<'a, Result<String, ApiError>> {
        async move {
            let body = message::request(&self.channel_id, &self.action_url, &self.action_secret, req);
            let post = self.api.create_post(&body).await?;
            Ok(format!("post {}", post.get("id").and_then(Value::as_str).unwrap_or("?")))
        }
        .boxed()
    }
}
