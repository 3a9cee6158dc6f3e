//! The Slack Web API calls the bridge makes (`chat.postMessage`, `chat.update`, and answers on
//! an interaction's `response_url`), each bounded in time and in the size of what it reads,
//! with every failure sorted into "retry later" or "will never work".

use crate::outbound::{self, net, read_bounded, retry_status, ApiError};
use crate::post::Chat;
use crate::secret::Secret;
use futures::future::BoxFuture;
use futures::FutureExt;
use pitcrew_model::ApprovalRequest;
use pitcrew_runtime::config::redact_url;
use serde_json::Value;
use std::time::Duration;

/// Slack `error` codes worth another try later.
const TRANSIENT: &[&str] = &["ratelimited", "internal_error", "fatal_error", "service_unavailable", "request_timeout"];
/// Slack `error` codes that mean the token is wrong: retried slowly, since the fix (a new
/// token and a restart) must not lose the requests in between.
const AUTH: &[&str] = &["not_authed", "invalid_auth", "token_revoked", "token_expired", "account_inactive"];

/// Slack `error` codes that mean the bot's setup is wrong (not invited to the channel, the
/// channel renamed or archived, a scope missing): retried slowly like a bad token, since the
/// request stays worth posting once someone fixes it, until it expires.
const SETUP: &[&str] = &[
    "not_in_channel",
    "channel_not_found",
    "is_archived",
    "missing_scope",
    "restricted_action",
    "access_denied",
    "team_access_not_granted",
    "not_allowed_token_type",
    "ekm_access_denied",
];

/// Slack's answers to an incoming webhook that mean its URL no longer works, or its channel
/// does not take the post (gone, archived, posting restricted): retried slowly, like a bad
/// token or a wrong setup of the Web API, since the request stays worth posting once someone
/// fixes it.
const WEBHOOK_GONE: &[&str] = &[
    "no_service",
    "invalid_token",
    "no_team",
    "team_disabled",
    "channel_not_found",
    "channel_is_archived",
    "action_prohibited",
    "posting_to_general_channel_denied",
];

/// A client of one Slack-compatible Web API with a bot token, an incoming webhook, or both.
#[derive(Clone)]
pub struct SlackApi {
    http: reqwest::Client,
    base: String,
    token: Option<Secret>,
    webhook: Option<Secret>,
}

impl SlackApi {
    pub fn new(
        base: &str,
        token: Option<Secret>,
        webhook: Option<Secret>,
        timeout: Duration,
    ) -> anyhow::Result<SlackApi> {
        anyhow::ensure!(token.is_some() || webhook.is_some(), "the Slack bridge needs a bot token or a webhook");
        let http = outbound::client(timeout)?;
        Ok(SlackApi { http, base: base.trim_end_matches('/').to_string(), token, webhook })
    }

    /// Post a message: through the incoming webhook when there is one (Slack's answer is then
    /// `{"ok":true}` alone), else `chat.postMessage` (`channel` and `ts` name the message).
    pub async fn post_message(&self, body: &Value) -> Result<Value, ApiError> {
        match &self.webhook {
            Some(hook) => self.post_webhook(hook, body).await,
            None => self.call("chat.postMessage", body).await,
        }
    }

    /// Messages can be edited with `chat.update` (there is a bot token).
    pub fn can_update(&self) -> bool {
        self.token.is_some()
    }

    /// `chat.update` of the message `ts` in `channel`.
    pub async fn update(&self, body: &Value) -> Result<Value, ApiError> {
        self.call("chat.update", body).await
    }

    /// Answer an interaction on its `response_url` (no token: the URL is the credential).
    /// Only URLs of Slack's hooks host or of the configured API's host are called.
    pub async fn respond(&self, response_url: &str, body: &Value) -> Result<(), ApiError> {
        if !self.may_respond_to(response_url) {
            return Err(ApiError::Permanent("the response_url is not on Slack's hooks host: not called".into()));
        }
        let resp = self.http.post(response_url).json(body).send().await.map_err(|e| net("response_url", e))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(ApiError::Permanent(format!("response_url answered HTTP {status}")));
        }
        Ok(())
    }

    fn may_respond_to(&self, url: &str) -> bool {
        let origin = outbound::origin(url);
        url.starts_with("https://hooks.slack.com/") || (origin.is_some() && origin == outbound::origin(&self.base))
    }

    async fn post_webhook(&self, hook: &Secret, body: &Value) -> Result<Value, ApiError> {
        let method = "incoming webhook";
        let mut body = body.clone();
        // An app's webhook posts to its own channel.
        if let Some(fields) = body.as_object_mut() {
            fields.remove("channel");
        }
        let resp = self.http.post(hook.expose()).json(&body).send().await.map_err(|e| net(method, e))?;
        if let Some(retry) = retry_status(method, &resp) {
            return Err(retry);
        }
        let status = resp.status();
        let text = read_bounded(resp).await.unwrap_or_default();
        let said: String = String::from_utf8_lossy(&text).trim().chars().take(200).collect();
        if status.is_success() {
            return Ok(serde_json::json!({"ok": true}));
        }
        if WEBHOOK_GONE.contains(&said.as_str()) {
            return Err(ApiError::Retry {
                after: Duration::from_secs(60),
                why: format!("{method}: HTTP {status}: {said}: check the webhook URL"),
            });
        }
        Err(ApiError::Permanent(format!("{method}: HTTP {status}: Slack refused it: {said}")))
    }

    async fn call(&self, method: &str, body: &Value) -> Result<Value, ApiError> {
        let Some(token) = &self.token else {
            return Err(ApiError::Permanent(format!("{method} needs a bot token: set token_env's variable")));
        };
        let url = format!("{}/{method}", self.base);
        let resp =
            self.http.post(&url).bearer_auth(token.expose()).json(body).send().await.map_err(|e| net(method, e))?;
        if let Some(retry) = retry_status(method, &resp) {
            return Err(retry);
        }
        let status = resp.status();
        if !status.is_success() {
            let why = format!("{method}: HTTP {status} from {} (is api_url right?)", redact_url(&self.base));
            // Refused or not found: a proxy's or the URL's setup, which someone can fix while
            // the request waits; anything else will not work as sent.
            if [401, 403, 404].contains(&status.as_u16()) {
                return Err(ApiError::Retry { after: Duration::from_secs(60), why });
            }
            return Err(ApiError::Permanent(why));
        }
        let body = read_bounded(resp).await.map_err(|why| ApiError::Retry {
            after: Duration::from_secs(10),
            why: format!("{method}: reading the answer: {why}"),
        })?;
        let answer: Value = serde_json::from_slice(&body).map_err(|e| {
            ApiError::Permanent(format!("{method}: the answer is not JSON ({e}): is api_url a Slack API?"))
        })?;
        if answer.get("ok").and_then(Value::as_bool) == Some(true) {
            return Ok(answer);
        }
        let code = answer.get("error").and_then(Value::as_str).unwrap_or("no error given").to_string();
        if TRANSIENT.contains(&code.as_str()) {
            return Err(ApiError::Retry {
                after: Duration::from_secs(30),
                why: format!("{method}: Slack says {code}"),
            });
        }
        if AUTH.contains(&code.as_str()) {
            return Err(ApiError::Retry {
                after: Duration::from_secs(60),
                why: format!("{method}: Slack says {code}: check the bot token"),
            });
        }
        if SETUP.contains(&code.as_str()) {
            return Err(ApiError::Retry {
                after: Duration::from_secs(60),
                why: format!(
                    "{method}: Slack says {code}: check the channel, that the bot is invited to it, and its scopes"
                ),
            });
        }
        Err(ApiError::Permanent(format!("{method}: Slack refused it: {code}")))
    }
}

/// Posting to one channel through `chat.postMessage`.
pub struct SlackChat {
    pub api: SlackApi,
    pub channel: String,
}

impl Chat for SlackChat {
    fn name(&self) -> &'static str {
        "slack"
    }

    fn post<'a>(&'a self, req: &'a ApprovalRequest) -> BoxFuture<'a, Result<String, ApiError>> {
        async move {
            let answer = self.api.post_message(&super::message::request(&self.channel, req)).await?;
            if self.api.webhook.is_some() {
                return Ok("the incoming webhook's channel".to_string());
            }
            let field = |k: &str| answer.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
            Ok(format!("channel {} ts {}", field("channel"), field("ts")))
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responds_only_to_slack_hooks_or_the_api_host() {
        let api =
            SlackApi::new("http://127.0.0.1:9/api", Some(Secret::new("t")), None, Duration::from_secs(1)).unwrap();
        assert!(api.may_respond_to("https://hooks.slack.com/actions/T1/2/3"));
        assert!(api.may_respond_to("http://127.0.0.1:9/response/1"));
        assert!(!api.may_respond_to("http://127.0.0.1:10/response/1"));
        assert!(!api.may_respond_to("https://hooks.slack.com.evil.example/x"));
        assert!(!api.may_respond_to("file:///etc/passwd"));
    }

    /// A Web API on loopback that answers every call with `answer` (HTTP 200, as Slack does).
    async fn answering(answer: &'static str) -> String {
        answering_with(200, answer).await
    }

    /// A server on loopback that answers every call with HTTP `status` and `answer`.
    async fn answering_with(status: u16, answer: &'static str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}/api", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut req = Vec::new();
                    let mut buf = [0u8; 4096];
                    // Headers, then the body its content-length announces.
                    loop {
                        match sock.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => req.extend_from_slice(&buf[..n]),
                        }
                        let text = String::from_utf8_lossy(&req).to_lowercase();
                        let Some(end) = text.find("\r\n\r\n") else { continue };
                        let len = text
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0)))
                            .unwrap_or(0usize);
                        if req.len() >= end + 4 + len {
                            break;
                        }
                    }
                    let resp = format!(
                        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                        answer.len()
                    );
                    let _ = sock.write_all(resp.as_bytes()).await;
                });
            }
        });
        base
    }

    #[tokio::test]
    async fn a_webhook_whose_channel_refuses_is_retried_slowly_and_a_bad_payload_is_not() {
        let hook = |base: &str| {
            SlackApi::new(base, None, Some(Secret::new(format!("{base}/hook"))), Duration::from_secs(5)).unwrap()
        };
        for (status, said) in
            [(404, "channel_not_found"), (410, "channel_is_archived"), (403, "action_prohibited"), (404, "no_service")]
        {
            let base = answering_with(status, said).await;
            match hook(&base).post_message(&serde_json::json!({"text": "x"})).await {
                Err(ApiError::Retry { after, why }) => {
                    assert_eq!(after, Duration::from_secs(60), "{said}");
                    assert!(why.contains(said), "{why}");
                }
                other => panic!("{said}: {other:?}"),
            }
        }
        let base = answering_with(400, "invalid_payload").await;
        assert!(matches!(hook(&base).post_message(&serde_json::json!({})).await, Err(ApiError::Permanent(_))));
        // The Web API behind a proxy that refuses, or at a wrong path: retried slowly too.
        let api = |base: &str| SlackApi::new(base, Some(Secret::new("xoxb-t")), None, Duration::from_secs(5)).unwrap();
        for status in [401, 403, 404] {
            let base = answering_with(status, "{}").await;
            let got = api(&base).post_message(&serde_json::json!({"channel": "C1", "text": "x"})).await;
            assert!(matches!(got, Err(ApiError::Retry { .. })), "{status}: {got:?}");
        }
        let base = answering_with(400, "{}").await;
        let got = api(&base).post_message(&serde_json::json!({"channel": "C1", "text": "x"})).await;
        assert!(matches!(got, Err(ApiError::Permanent(_))), "{got:?}");
    }

    #[tokio::test]
    async fn an_api_url_with_a_password_is_not_quoted_with_it() {
        // A Web API behind a proxy with basic auth: the error that quotes the URL hides it.
        for status in [401, 400] {
            let base = answering_with(status, "{}").await.replace("http://", "http://ops:pr0xy-S3CRET@");
            let api = SlackApi::new(&base, Some(Secret::new("xoxb-t")), None, Duration::from_secs(5)).unwrap();
            let why = match api.post_message(&serde_json::json!({"channel": "C1", "text": "x"})).await {
                Err(ApiError::Retry { why, .. } | ApiError::Permanent(why)) => why,
                other => panic!("{status}: {other:?}"),
            };
            assert!(why.contains("ops:***@127.0.0.1") && !why.contains("pr0xy-S3CRET"), "{why}");
        }
    }

    #[tokio::test]
    async fn a_wrong_setup_is_retried_slowly_and_a_bad_request_is_not() {
        let api = |base: &str| SlackApi::new(base, Some(Secret::new("xoxb-t")), None, Duration::from_secs(5)).unwrap();
        for code in ["not_in_channel", "channel_not_found", "missing_scope", "invalid_auth"] {
            let base = answering(Box::leak(format!(r#"{{"ok":false,"error":"{code}"}}"#).into_boxed_str())).await;
            match api(&base).post_message(&serde_json::json!({"channel": "C1", "text": "x"})).await {
                Err(ApiError::Retry { after, why }) => {
                    assert_eq!(after, Duration::from_secs(60), "{code}");
                    assert!(why.contains(code), "{why}");
                }
                other => panic!("{code}: {other:?}"),
            }
        }
        let base = answering(r#"{"ok":false,"error":"invalid_blocks"}"#).await;
        match api(&base).post_message(&serde_json::json!({"channel": "C1", "text": "x"})).await {
            Err(ApiError::Permanent(why)) => assert!(why.contains("invalid_blocks"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}
