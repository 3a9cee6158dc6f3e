//! A fake chat API for tests: real HTTP on a loopback port speaking Slack's wire format
//! (`chat.postMessage`, `chat.update`, interaction `response_url`s) or Mattermost's
//! (`POST /api/v4/posts`), every call recorded with its Authorization header and the answer.
//! Failures can be scripted (e.g. a 429 with Retry-After). Plus Slack's request signature,
//! computed independently of the bridge's.

use crate::http::{read_request, write_json};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// One call the fake received, and what it answered.
#[derive(Debug, Clone)]
pub struct Call {
    /// The request path: `/api/chat.postMessage`, `/api/chat.update`, `/response/<n>`.
    pub path: String,
    pub authorization: Option<String>,
    pub body: Value,
    pub status: u16,
    pub answer: Value,
}

impl Call {
    /// The Web API method (`chat.postMessage`, `v4/posts`), or the path for other calls.
    pub fn method(&self) -> &str {
        self.path.strip_prefix("/api/").unwrap_or(&self.path)
    }

    /// The chat took it (Slack: 200 and ok, or a webhook's `ok`; Mattermost: 201).
    pub fn ok(&self) -> bool {
        (self.status == 200 && (self.answer["ok"] == true || self.answer == "ok")) || self.status == 201
    }
}

/// The fake's incoming webhook path (its last segment is the secret part).
const WEBHOOK_PATH: &str = "/services/T0TEAM/B0HOOK/hook0secret0xyzzy1234";

/// A scripted answer for the next call of a method.
type Scripted = (String, u16, Vec<(String, String)>, Value);

#[derive(Default)]
struct Shared {
    mattermost: bool,
    calls: Mutex<Vec<Call>>,
    script: Mutex<VecDeque<Scripted>>,
    next_ts: Mutex<u64>,
}

/// The running fake; stops when dropped.
pub struct FakeSlack {
    /// `http://127.0.0.1:PORT`
    pub url: String,
    shared: Arc<Shared>,
    changed: watch::Sender<usize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeSlack {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeSlack {
    /// Start answering; Web API calls must carry `Authorization: Bearer <token>` (Slack's
    /// `invalid_auth` otherwise).
    pub async fn start(token: &str) -> anyhow::Result<FakeSlack> {
        Self::start_as(token, false).await
    }

    /// Start answering as a Mattermost server: `POST /api/v4/posts` with
    /// `Authorization: Bearer <token>` creates a post (201 with its id).
    pub async fn start_mattermost(token: &str) -> anyhow::Result<FakeSlack> {
        Self::start_as(token, true).await
    }

    async fn start_as(token: &str, mattermost: bool) -> anyhow::Result<FakeSlack> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let shared = Arc::new(Shared { mattermost, ..Shared::default() });
        let (changed, _) = watch::channel(0usize);
        let (state, tx, token) = (shared.clone(), changed.clone(), format!("Bearer {token}"));
        let task = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (state, tx, token) = (state.clone(), tx.clone(), token.clone());
                tokio::spawn(async move {
                    let Ok(req) = read_request(&mut conn).await else { return };
                    let authorization = req.headers.iter().find(|(k, _)| k == "authorization").map(|(_, v)| v.clone());
                    let body: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
                    let (status, headers, answer) = answer(&state, &req.path, authorization.as_deref(), &token, &body);
                    state.calls.lock().unwrap().push(Call {
                        path: req.path.clone(),
                        authorization,
                        body,
                        status,
                        answer: answer.clone(),
                    });
                    tx.send_modify(|n| *n += 1);
                    // Slack's webhooks answer plain text (`ok`, `no_service`).
                    let text = match &answer {
                        Value::String(t) => t.clone(),
                        other => other.to_string(),
                    };
                    let _ = write_json(&mut conn, status, &headers, &text).await;
                });
            }
        });
        Ok(FakeSlack { url, shared, changed, task })
    }

    /// The Web API base to configure as `[bridge.slack] api_url`.
    pub fn api_url(&self) -> String {
        format!("{}/api", self.url)
    }

    /// The app's incoming webhook: its path is the credential (`no_service` for any other).
    pub fn webhook_url(&self) -> String {
        format!("{}{WEBHOOK_PATH}", self.url)
    }

    /// A `response_url` on this fake, as Slack puts in each interaction.
    pub fn response_url(&self, n: u32) -> String {
        format!("{}/response/{n}", self.url)
    }

    /// Answer the next call of `method` (e.g. `chat.postMessage`) with this instead.
    pub fn fail_next(&self, method: &str, status: u16, headers: &[(&str, &str)], body: Value) {
        let headers = headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.shared.script.lock().unwrap().push_back((method.to_string(), status, headers, body));
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<Call> {
        self.shared.calls.lock().unwrap().clone()
    }

    /// The calls of one method (`chat.postMessage`, `chat.update`, or a path).
    pub fn calls_to(&self, method: &str) -> Vec<Call> {
        self.calls().into_iter().filter(|c| c.method() == method).collect()
    }

    /// Wait until the calls so far satisfy `done`; on timeout the error lists them.
    pub async fn wait_for(
        &self,
        what: &str,
        done: impl Fn(&[Call]) -> bool,
        timeout: Duration,
    ) -> anyhow::Result<Vec<Call>> {
        let mut rx = self.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            rx.borrow_and_update();
            let calls = self.calls();
            if done(&calls) {
                return Ok(calls);
            }
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                let seen: Vec<String> =
                    calls.iter().map(|c| format!("{} {} -> {}", c.path, c.body, c.answer)).collect();
                anyhow::bail!("timed out after {timeout:?} waiting for {what}; Slack saw:\n{}", seen.join("\n"));
            }
        }
    }
}

fn answer(
    state: &Shared,
    path: &str,
    authorization: Option<&str>,
    token: &str,
    body: &Value,
) -> (u16, Vec<(String, String)>, Value) {
    if path.starts_with("/response/") {
        return (200, vec![], json!({"ok": true}));
    }
    if let Some(hook) = path.strip_prefix("/services/") {
        let ok = format!("/services/{hook}") == WEBHOOK_PATH;
        return match (ok, body["blocks"].is_array() || body["text"].is_string()) {
            (false, _) => (404, vec![], json!("no_service")),
            (true, false) => (400, vec![], json!("invalid_payload")),
            (true, true) => (200, vec![], json!("ok")),
        };
    }
    let Some(method) = path.strip_prefix("/api/") else {
        return (404, vec![], json!({"ok": false, "error": "not_found"}));
    };
    {
        let mut script = state.script.lock().unwrap();
        if let Some(i) = script.iter().position(|(m, ..)| m == method) {
            let (_, status, headers, body) = script.remove(i).expect("position is in range");
            return (status, headers, body);
        }
    }
    if state.mattermost {
        return mattermost(state, method, authorization == Some(token), body);
    }
    if authorization != Some(token) {
        let error = if authorization.is_none() { "not_authed" } else { "invalid_auth" };
        return (200, vec![], json!({"ok": false, "error": error}));
    }
    let channel = body["channel"].clone();
    match method {
        "chat.postMessage" if channel.is_string() => {
            let mut n = state.next_ts.lock().unwrap();
            *n += 1;
            let ts = format!("1700000000.{:06}", *n);
            (
                200,
                vec![],
                json!({"ok": true, "channel": channel, "ts": ts, "message": {"text": body["text"], "ts": ts}}),
            )
        }
        "chat.update" if channel.is_string() && body["ts"].is_string() => {
            (200, vec![], json!({"ok": true, "channel": channel, "ts": body["ts"], "text": body["text"]}))
        }
        "chat.postMessage" | "chat.update" => (200, vec![], json!({"ok": false, "error": "channel_not_found"})),
        _ => (200, vec![], json!({"ok": false, "error": "unknown_method"})),
    }
}

fn mattermost(state: &Shared, method: &str, authorized: bool, body: &Value) -> (u16, Vec<(String, String)>, Value) {
    let error = |status: u16, id: &str, message: &str| {
        (
            status,
            vec![],
            json!({"id": id, "message": message, "detailed_error": "", "request_id": "fake", "status_code": status}),
        )
    };
    if !authorized {
        return error(401, "api.context.session_expired.app_error", "Invalid or expired session, please login again.");
    }
    match method {
        "v4/posts" if body["channel_id"].is_string() => {
            let mut n = state.next_ts.lock().unwrap();
            *n += 1;
            let post = json!({
                "id": format!("post{:022}", *n), "create_at": 1_700_000_000_000u64 + *n, "user_id": "botuser",
                "channel_id": body["channel_id"], "message": body["message"], "props": body["props"],
            });
            (201, vec![], post)
        }
        "v4/posts" => error(400, "api.post.create_post.channel_id.app_error", "Invalid channel id."),
        _ => error(404, "api.context.404.app_error", "Sorry, we could not find the page."),
    }
}

/// Slack's `X-Slack-Signature` for `body` sent at `timestamp`: `v0=` + hex HMAC-SHA256 of
/// `v0:<timestamp>:<body>` (HMAC written out here from SHA-256, independent of the bridge).
pub fn slack_signature(secret: &str, timestamp: &str, body: &[u8]) -> String {
    let mut base = format!("v0:{timestamp}:").into_bytes();
    base.extend_from_slice(body);
    let tag = hmac_sha256(secret.as_bytes(), &base);
    format!("v0={}", tag.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// HMAC (RFC 2104) over SHA-256.
fn hmac_sha256(secret: &[u8], message: &[u8]) -> Vec<u8> {
    let mut key = secret.to_vec();
    if key.len() > 64 {
        key = Sha256::digest(&key).to_vec();
    }
    key.resize(64, 0);
    let pad = |b: u8| key.iter().map(|k| k ^ b).collect::<Vec<u8>>();
    let inner = Sha256::new().chain_update(pad(0x36)).chain_update(message).finalize();
    Sha256::new().chain_update(pad(0x5c)).chain_update(inner).finalize().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231() {
        let hex = |t: Vec<u8>| t.iter().map(|b| format!("{b:02x}")).collect::<String>();
        // Test case 2, and test case 6 (a key longer than the block).
        assert_eq!(
            hex(hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(
            hex(hmac_sha256(&[0xaa; 131], b"Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }
}
