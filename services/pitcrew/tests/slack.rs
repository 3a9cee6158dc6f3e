//! The chat bridges end to end: a real nats-server and a fresh database, the crew in-process,
//! the bridge as a real `pitcrew bridge slack|mattermost` process, and a fake chat API (real
//! HTTP, Slack's or Mattermost's wire format) that records every call. Slack callbacks are
//! signed as Slack signs them; Mattermost action calls carry the button's context.

mod common;

use common::{count, marker_service, sample, scrape, write, Crew, LOCKED_PLAYBOOK, WAIT};
use futures::TryStreamExt;
use pitcrew::cli;
use pitcrew_model::{ApprovalDecision, Decision, EventKind, Stage};
use pitcrew_testkit::slack::{slack_signature, Call, FakeSlack};
use pitcrew_testkit::TestEnv;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use uuid::Uuid;

const TOKEN: &str = "xoxb-4242-test-bot-token-never-logged";
const SIGNING_SECRET: &str = "8f742231b10e8888abcd99yyyzzz85a5-test";
const CHANNEL: &str = "C0OPS";
const MM_TOKEN: &str = "mm-bot-token-5f0c2a9e7d1b4c3a";
const MM_ACTION_SECRET: &str = "mm-action-secret-9a8b7c6d5e4f";

/// The crew, the fake Slack and the port the bridge listens on.
async fn setup() -> anyhow::Result<(Crew, FakeSlack, u16)> {
    setup_with_policy(None).await
}

/// As `setup`, with a policy file of these rules.
async fn setup_with_policy(policy: Option<&str>) -> anyhow::Result<(Crew, FakeSlack, u16)> {
    let slack = FakeSlack::start(TOKEN).await?;
    let port = pitcrew_runtime::natsd::free_port()?;
    let bridge = format!(
        "[bridge.slack]\napi_url = \"{}\"\nchannel = \"{CHANNEL}\"\nlisten = \"127.0.0.1:{port}\"\ntimeout_secs = 5\n\
         [bridge.slack.users]\nU0ANN = \"ann\"\nU0BOB = \"bob\"\n",
        slack.api_url()
    );
    Ok((crew_with(&bridge, policy).await?, slack, port))
}

/// The crew with the critical-plan playbook, `policy` rules if any, and `bridge` (a
/// `[bridge.*]` table).
async fn crew_with(bridge: &str, policy: Option<&str>) -> anyhow::Result<Crew> {
    let env = TestEnv::start().await?;
    let book = write(&env, "playbook.toml", LOCKED_PLAYBOOK);
    let policy = match policy {
        Some(rules) => format!("[policy]\nfile = \"{}\"\n", write(&env, "policy.toml", rules)),
        None => String::new(),
    };
    let svc = marker_service(&env, "svc");
    let text = format!("[reasoning]\nplaybook_file = \"{book}\"\n{policy}{svc}{bridge}");
    Crew::start_in(env, &text, &Stage::ALL).await
}

/// `pitcrew bridge <kind>` as a real process, its log in the test directory.
struct Bridge {
    child: Child,
    log: PathBuf,
    url: String,
    /// Its `/metrics` (the crew's config plus `[metrics] listen`).
    metrics: String,
}

impl Bridge {
    /// Start the Slack bridge and wait until its endpoint answers.
    async fn start(crew: &Crew, port: u16, name: &str) -> anyhow::Result<Bridge> {
        let secrets = [("SLACK_BOT_TOKEN", TOKEN), ("SLACK_SIGNING_SECRET", SIGNING_SECRET)];
        Self::start_kind(crew, port, name, "slack", &secrets).await
    }

    /// Start `pitcrew bridge <kind>` with `secrets` in its environment.
    async fn start_kind(
        crew: &Crew,
        port: u16,
        name: &str,
        kind: &str,
        secrets: &[(&str, &str)],
    ) -> anyhow::Result<Bridge> {
        let log = crew.env.dir.path().join(format!("{name}.log"));
        let metrics_port = pitcrew_runtime::natsd::free_port()?;
        let config = crew.env.dir.path().join(format!("{name}.toml"));
        let toml = std::fs::read_to_string(crew.config_file()?)?;
        std::fs::write(&config, format!("{toml}\n[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n"))?;
        let child = Command::new(env!("CARGO_BIN_EXE_pitcrew"))
            .arg("--config")
            .arg(&config)
            .args(["bridge", kind])
            .envs(secrets.iter().copied())
            .env("PITCREW_LOG", "debug")
            .env_remove("DATABASE_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        let mut bridge = Bridge {
            child,
            log,
            url: format!("http://127.0.0.1:{port}"),
            metrics: format!("http://127.0.0.1:{metrics_port}/metrics"),
        };
        let http = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Ok(r) = http.get(format!("{}/healthz", bridge.url)).send().await {
                anyhow::ensure!(r.status() == 200, "healthz: {}", r.status());
                return Ok(bridge);
            }
            if let Some(status) = bridge.child.try_wait()? {
                anyhow::bail!("the bridge exited ({status}):\n{}", bridge.log_text());
            }
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "the bridge never served:\n{}", bridge.log_text());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGTERM, wait for a clean exit, return its log.
    async fn stop(mut self) -> anyhow::Result<String> {
        // SAFETY: signalling our own child by its pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = self.child.try_wait()? {
                break s;
            }
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "the bridge ignored SIGTERM");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let log = self.log_text();
        anyhow::ensure!(status.success(), "the bridge exited with {status}:\n{log}");
        Ok(log)
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// POST a callback body with Slack's headers; (status, body).
    async fn callback(&self, body: &str, timestamp: i64, signature: &str) -> anyhow::Result<(u16, String)> {
        let r = reqwest::Client::new()
            .post(format!("{}/slack/interactions", self.url))
            .header("content-type", "application/x-www-form-urlencoded")
            .header("x-slack-request-timestamp", timestamp.to_string())
            .header("x-slack-signature", signature)
            .body(body.to_string())
            .send()
            .await?;
        Ok((r.status().as_u16(), r.text().await?))
    }

    /// A Mattermost action call: `user` clicked the button whose context is `context`.
    async fn action(&self, user: &str, context: &Value) -> anyhow::Result<(u16, String)> {
        self.action_from(user, context, None).await
    }

    /// As `action`, sent from `source` (a loopback address other than 127.0.0.1, say).
    async fn action_from(
        &self,
        user: &str,
        context: &Value,
        source: Option<std::net::IpAddr>,
    ) -> anyhow::Result<(u16, String)> {
        let call = json!({
            "user_id": user, "user_name": user.trim_end_matches('0'), "channel_id": "chan0ops", "channel_name": "ops",
            "team_id": "team0", "team_domain": "example", "post_id": "post0", "trigger_id": "trigger0",
            "type": "", "data_source": "", "context": context,
        });
        let http = reqwest::Client::builder().local_address(source).build()?;
        let r = http.post(format!("{}/mattermost/actions", self.url)).json(&call).send().await?;
        Ok((r.status().as_u16(), r.text().await?))
    }

    /// A click signed with the real signing secret, sent now.
    async fn click(&self, body: &str) -> anyhow::Result<(u16, String)> {
        let now = chrono::Utc::now().timestamp();
        self.callback(body, now, &slack_signature(SIGNING_SECRET, &now.to_string(), body.as_bytes())).await
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        eprintln!(
            "--- {} ---\n{}",
            self.log.display(),
            self.log_text().lines().rev().take(30).collect::<Vec<_>>().join("\n")
        );
    }
}

/// A run parked for approval, its request posted: the run, the post and the message's `ts`.
async fn parked(crew: &mut Crew, slack: &FakeSlack) -> anyhow::Result<(Uuid, Call, String)> {
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    let post = posted(slack, run).await?;
    let ts = post.answer["ts"].as_str().unwrap_or_default().to_string();
    Ok((run, post, ts))
}

/// The form body Slack sends when `user` clicks the button `action` carrying `value` on the
/// message `ts`.
fn interaction(user: &str, action: &str, value: &str, ts: &str, response_url: &str) -> String {
    let payload = json!({
        "type": "block_actions",
        "user": {"id": user, "username": user.to_lowercase(), "team_id": "T0TEAM"},
        "api_app_id": "A0APP",
        "team": {"id": "T0TEAM", "domain": "example"},
        "container": {"type": "message", "message_ts": ts, "channel_id": CHANNEL, "is_ephemeral": false},
        "channel": {"id": CHANNEL, "name": "ops"},
        "message": {"type": "message", "ts": ts, "text": "Approval needed"},
        "response_url": response_url,
        "trigger_id": "123.456.abc",
        "actions": [{
            "action_id": action, "block_id": "pitcrew_approval", "value": value, "type": "button",
            "action_ts": "1700000000.000200", "text": {"type": "plain_text", "text": action}
        }],
    });
    format!("payload={}", form_urlencoded::byte_serialize(payload.to_string().as_bytes()).collect::<String>())
}

/// The value of the button `action_id` in a posted message.
fn button(post: &Call, action_id: &str) -> String {
    post.body["blocks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["type"] == "actions")
        .flat_map(|b| b["elements"].as_array().cloned().unwrap_or_default())
        .find(|e| e["action_id"] == action_id)
        .and_then(|e| e["value"].as_str().map(String::from))
        .unwrap_or_default()
}

/// The successful chat.postMessage of `run`.
async fn posted(slack: &FakeSlack, run: Uuid) -> anyhow::Result<Call> {
    posted_with(slack, "chat.postMessage", run).await
}

/// The successful call of `method` (`chat.postMessage`, `v4/posts`) about `run`.
async fn posted_with(slack: &FakeSlack, method: &str, run: Uuid) -> anyhow::Result<Call> {
    let of_run = |c: &Call| c.method() == method && c.ok() && c.body.to_string().contains(&run.to_string());
    let calls = slack.wait_for(&format!("the request of run {run} posted"), |cs| cs.iter().any(of_run), WAIT).await?;
    Ok(calls.into_iter().find(of_run).expect("waited for it"))
}

/// How many decisions were published on the run's bridge subject.
async fn decisions_published(crew: &Crew, run: Uuid) -> anyhow::Result<u64> {
    let stream = crew.bus.js.get_stream(crew.bus.subjects.approvals_stream()).await?;
    let subject = crew.bus.subjects.approval_decided(run);
    let mut subjects = stream.info_with_subjects(&subject).await?;
    let mut n = 0;
    while let Some((s, c)) = subjects.try_next().await? {
        if s == subject {
            n += c as u64;
        }
    }
    Ok(n)
}

/// Wait until the bridge's consumer holds nothing: no post can come any more.
async fn settled(crew: &Crew) -> anyhow::Result<()> {
    let stream = crew.bus.js.get_stream(crew.bus.subjects.approvals_stream()).await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let info = stream.consumer_info("slack-bridge").await?;
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            return Ok(());
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "the bridge's consumer never settled: {info:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A refused click changed nothing: still waiting, the request undecided, no decision on
/// the bridge subject, no command run, the Slack message not updated.
async fn unchanged(crew: &Crew, slack: &FakeSlack, run: Uuid) -> anyhow::Result<()> {
    let db = crew.db().await?;
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1", &[&run]).await?.get(0);
    assert_eq!(status, "waiting_approval");
    assert_eq!(count(&db, "SELECT count(*) FROM approvals WHERE run_id = $1 AND decision IS NULL", run).await, 1);
    assert_eq!(count(&db, "SELECT count(*) FROM approvals WHERE run_id = $1 AND decision IS NOT NULL", run).await, 0);
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    assert_eq!(decisions_published(crew, run).await?, 0, "no decision reached the bridge subject");
    assert!(slack.calls_to("chat.update").is_empty(), "the message was not updated");
    Ok(())
}

/// Neither Slack secret is in the bridge's logs, the run's events or any row of any table.
async fn secrets_kept(crew: &Crew, logs: &[String]) -> anyhow::Result<()> {
    secrets_kept_of(crew, logs, &[TOKEN, SIGNING_SECRET]).await
}

async fn secrets_kept_of(crew: &Crew, logs: &[String], secrets: &[&str]) -> anyhow::Result<()> {
    for &secret in secrets {
        for log in logs {
            assert!(!log.contains(secret), "a secret is in the bridge's log");
        }
        for e in &crew.events.seen {
            assert!(!serde_json::to_string(e)?.contains(secret), "a secret is in an event");
        }
        let db = crew.db().await?;
        let tables = db
            .query("SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public'", &[])
            .await?;
        assert!(tables.len() >= 5, "the schema is there to search");
        for t in tables {
            let table: String = t.get(0);
            let sql = format!("SELECT count(*) FROM \"{table}\" t WHERE strpos(t::text, $1) > 0");
            let n: i64 = db.query_one(&sql, &[&secret]).await?.get(0);
            assert_eq!(n, 0, "a secret is in table {table}");
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_slack_approval_runs_the_plan_and_forged_stale_or_second_clicks_change_nothing() -> anyhow::Result<()>
{
    let (mut crew, slack, port) = setup().await?;
    let bridge = Bridge::start(&crew, port, "bridge").await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    let req = cli::approval_request(&crew.bus, run).await?;

    // The request is posted once, with the bot token, to the channel, buttons naming the plan.
    let post = posted(&slack, run).await?;
    assert_eq!(post.authorization.as_deref(), Some(format!("Bearer {TOKEN}").as_str()));
    assert_eq!(post.body["channel"], CHANNEL);
    let shown = post.body["blocks"].to_string();
    for want in [req.plan[0].as_str(), req.plan[1].as_str(), "critical", req.rule.as_str(), "stale lock"] {
        assert!(shown.contains(want), "the message lacks {want:?}: {shown}");
    }
    let value = button(&post, "approve");
    assert_eq!(value, format!("{run}:{}:{}", req.plan_hash, req.attempt));
    assert_eq!(button(&post, "deny"), value);
    let ts = post.answer["ts"].as_str().expect("Slack named the message").to_string();
    let approve = interaction("U0ANN", "approve", &value, &ts, &slack.response_url(1));

    // A bad signature: 401, nothing changes.
    let now = chrono::Utc::now().timestamp();
    let forged = slack_signature("not-the-signing-secret", &now.to_string(), approve.as_bytes());
    let (status, text) = bridge.callback(&approve, now, &forged).await?;
    assert_eq!(status, 401, "{text}");
    assert!(text.contains("bad signature"), "{text}");
    // A body changed after signing: same.
    let signed = slack_signature(SIGNING_SECRET, &now.to_string(), approve.as_bytes());
    let tampered = interaction("U0BOB", "approve", &value, &ts, &slack.response_url(1));
    let (status, text) = bridge.callback(&tampered, now, &signed).await?;
    assert_eq!((status, text.contains("bad signature")), (401, true), "{text}");
    unchanged(&crew, &slack, run).await?;

    // A replayed request: correctly signed, six minutes old.
    let old = now - 360;
    let (status, text) =
        bridge.callback(&approve, old, &slack_signature(SIGNING_SECRET, &old.to_string(), approve.as_bytes())).await?;
    assert_eq!(status, 401, "{text}");
    assert!(text.contains("more than 300 s") && text.contains("replay"), "{text}");
    unchanged(&crew, &slack, run).await?;

    // A button of another attempt's request (the same plan asked again later is decided anew):
    // refused, naming the attempt that asks now.
    let stale_value = format!("{run}:{}:{}", req.plan_hash, req.attempt + 1);
    let stale = interaction("U0ANN", "approve", &stale_value, &ts, &slack.response_url(2));
    let (status, text) = bridge.click(&stale).await?;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text)?;
    let reason = answer["text"].as_str().unwrap_or_default();
    assert!(reason.contains(&format!("now asks again for attempt {}", req.attempt)), "{text}");
    unchanged(&crew, &slack, run).await?;

    // A Slack user who is not mapped to an approver: refused with the reason, shown to them.
    let eve = interaction("U0EVE", "approve", &value, &ts, &slack.response_url(2));
    let (status, text) = bridge.click(&eve).await?;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text)?;
    assert_eq!(answer["response_type"], "ephemeral");
    assert_eq!(answer["replace_original"], false);
    let reason = answer["text"].as_str().unwrap_or_default();
    assert!(reason.contains("Slack user U0EVE is not mapped to an approver"), "{reason}");
    let told = |cs: &[Call]| cs.iter().any(|c| c.path == "/response/2" && c.body["text"] == reason);
    slack.wait_for("the refusal on the response_url", told, WAIT).await?;
    unchanged(&crew, &slack, run).await?;

    // A button of a plan the run no longer waits on.
    let stale =
        interaction("U0ANN", "approve", &format!("{run}:00aa11bb22cc33dd44ee55ff"), &ts, &slack.response_url(3));
    let (status, text) = bridge.click(&stale).await?;
    assert_eq!(status, 200, "{text}");
    let reason: Value = serde_json::from_str(&text)?;
    assert!(reason["text"].as_str().unwrap_or_default().contains("stale plan"), "{text}");
    assert!(reason["text"].as_str().unwrap_or_default().contains(&req.plan_hash), "names the plan pending: {text}");
    unchanged(&crew, &slack, run).await?;

    // The real click: published, the run resumes and executes, the message shows the outcome.
    let clicked = chrono::Utc::now();
    let (status, text) = bridge.click(&approve).await?;
    assert_eq!((status, text.as_str()), (200, ""), "a decision is acknowledged with an empty 200");
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    assert!(end.message.contains("approved by ann"), "{}", end.message);
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1 AND status = 'succeeded'", run).await, 2);
    let first: chrono::DateTime<chrono::Utc> =
        db.query_one("SELECT min(started_at) FROM executions WHERE run_id = $1", &[&run]).await?.get(0);
    let ms = (first - clicked).num_microseconds().unwrap_or(0) as f64 / 1000.0;
    assert!(ms > 0.0, "the first command started after the click: {ms} ms");
    eprintln!("Slack click sent to first command started: {ms:.1} ms");
    let row = db.query_one("SELECT decision, decided_by, channel FROM approvals WHERE run_id = $1", &[&run]).await?;
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, String>(1), row.get::<_, String>(2)),
        ("approve".into(), "ann".into(), "slack".into())
    );
    let updated = |cs: &[Call]| cs.iter().any(|c| c.method() == "chat.update" && c.ok());
    let calls = slack.wait_for("the message updated", updated, WAIT).await?;
    let update = calls.iter().find(|c| c.method() == "chat.update").expect("waited for it");
    assert_eq!(update.authorization.as_deref(), Some(format!("Bearer {TOKEN}").as_str()));
    assert_eq!((update.body["channel"].as_str(), update.body["ts"].as_str()), (Some(CHANNEL), Some(ts.as_str())));
    assert!(update.body["text"].as_str().unwrap_or_default().starts_with("Approved by ann"), "{}", update.body);
    assert!(!update.body["blocks"].to_string().contains("\"actions\""), "the buttons are gone: {}", update.body);
    assert_eq!(decisions_published(&crew, run).await?, 1);

    // A second decision on the same plan: refused, naming who decided; nothing changes.
    let second = interaction("U0BOB", "deny", &value, &ts, &slack.response_url(4));
    let (status, text) = bridge.click(&second).await?;
    assert_eq!(status, 200, "{text}");
    let reason: Value = serde_json::from_str(&text)?;
    assert!(
        reason["text"].as_str().unwrap_or_default().contains("already decided: approve by ann via slack"),
        "{text}"
    );
    assert_eq!(decisions_published(&crew, run).await?, 1);
    let row = db.query_one("SELECT decision, decided_by FROM approvals WHERE run_id = $1", &[&run]).await?;
    assert_eq!((row.get::<_, String>(0), row.get::<_, String>(1)), ("approve".into(), "ann".into()));
    assert_eq!(slack.calls_to("chat.update").len(), 1);
    assert_eq!(slack.calls_to("chat.postMessage").len(), 1, "posted exactly once");

    // A body over the limit is refused before anything reads it.
    let (status, _) = bridge.click(&"x".repeat(100 * 1024)).await?;
    assert_eq!(status, 413);

    // The bridge's own /metrics: one post, one decision, four refusals (the stale attempt, Eve,
    // the stale plan, Bob's second decision; forged ones never reach a decision), nothing left
    // to post.
    let m = scrape(&bridge.metrics).await?;
    assert_eq!(sample(&m, r#"pitcrew_bridge_posts_total{chat="slack",outcome="posted"}"#), 1.0, "{m:?}");
    assert_eq!(sample(&m, r#"pitcrew_bridge_clicks_total{chat="slack",result="decided"}"#), 1.0, "{m:?}");
    assert_eq!(sample(&m, r#"pitcrew_bridge_clicks_total{chat="slack",result="refused"}"#), 4.0, "{m:?}");
    let backlog = r#"pitcrew_consumer_pending_messages{consumer="slack-bridge"}"#;
    assert!(m.iter().any(|(s, v)| s == backlog && *v == 0.0), "the posting backlog is read: {m:?}");
    let metrics_text: String = m.iter().map(|(s, v)| format!("{s} {v}\n")).collect();

    let log = bridge.stop().await?;
    assert!(log.contains("chat decision published") && log.contains("Slack decision refused"), "{log}");
    assert!(log.contains("U0EVE"), "a refusal names who clicked: {log}");
    secrets_kept(&crew, &[log, metrics_text]).await?;
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_bridge_posts_what_arrived_while_it_was_down_and_nothing_twice() -> anyhow::Result<()> {
    let (mut crew, slack, port) = setup().await?;
    let first = Bridge::start(&crew, port, "bridge-1").await?;
    let a = crew.open_with("svc", "stale lock held", Some("fp-a".into())).await?;
    crew.events.kind(a, EventKind::ApprovalRequested, WAIT).await?;
    posted(&slack, a).await?;
    let log_1 = first.stop().await?;

    // While the bridge is down a second request arrives; Slack will rate-limit its first post.
    slack.fail_next("chat.postMessage", 429, &[("retry-after", "1")], json!({"ok": false, "error": "ratelimited"}));
    let b = crew.open_with("svc", "stale lock held", Some("fp-b".into())).await?;
    crew.events.kind(b, EventKind::ApprovalRequested, WAIT).await?;
    assert_eq!(slack.calls_to("chat.postMessage").len(), 1, "nothing is posted while the bridge is down");

    let second = Bridge::start(&crew, port, "bridge-2").await?;
    let post_b = posted(&slack, b).await?;
    settled(&crew).await?;
    let posts = slack.calls_to("chat.postMessage");
    let of = |run: Uuid| posts.iter().filter(|c| c.body.to_string().contains(&run.to_string())).collect::<Vec<_>>();
    assert_eq!(of(a).len(), 1, "the request posted before the restart is not posted again");
    let tries_b: Vec<(u16, bool)> = of(b).iter().map(|c| (c.status, c.ok())).collect();
    assert_eq!(tries_b, [(429, false), (200, true)], "rate-limited once, then posted once");

    // The restarted bridge decides too: Bob denies in Slack, the run escalates, nothing runs.
    let ts = post_b.answer["ts"].as_str().unwrap_or_default().to_string();
    let deny = interaction("U0BOB", "deny", &button(&post_b, "deny"), &ts, &slack.response_url(1));
    let (status, text) = second.click(&deny).await?;
    assert_eq!(status, 200, "{text}");
    let end = crew.end(b).await?;
    assert_eq!(end.kind, EventKind::Escalated, "{}", end.message);
    assert!(end.message.contains("denied by bob: denied in Slack by bob"), "{}", end.message);
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", b).await, 0);
    let denied = |cs: &[Call]| {
        cs.iter().any(|c| {
            c.method() == "chat.update" && c.body["text"].as_str().is_some_and(|t| t.starts_with("Denied by bob"))
        })
    };
    slack.wait_for("the message updated with the denial", denied, WAIT).await?;
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1", &[&a]).await?.get(0);
    assert_eq!(status, "waiting_approval", "the other run still waits");

    // A request Slack can never take (its message is refused as such) is dropped with a clear
    // error, not retried forever. (A wrong setup, `channel_not_found` say, is retried slowly
    // until someone fixes it: the slack::api unit tests.)
    slack.fail_next("chat.postMessage", 200, &[], json!({"ok": false, "error": "invalid_blocks"}));
    let c = crew.open_with("svc", "stale lock held", Some("fp-c".into())).await?;
    crew.events.kind(c, EventKind::ApprovalRequested, WAIT).await?;
    let tried_c = |cs: &[Call]| {
        cs.iter().any(|x| x.method() == "chat.postMessage" && x.body.to_string().contains(&c.to_string()))
    };
    slack.wait_for("the request of run c tried", tried_c, WAIT).await?;
    settled(&crew).await?;
    let tries_c =
        slack.calls_to("chat.postMessage").iter().filter(|x| x.body.to_string().contains(&c.to_string())).count();
    assert_eq!(tries_c, 1, "a permanent refusal is not retried");

    let log_2 = second.stop().await?;
    assert!(log_2.contains("cannot post the approval request yet"), "the 429 is logged: {log_2}");
    assert!(
        log_2.contains("approval request cannot be posted: dropped") && log_2.contains("invalid_blocks"),
        "a dropped request is logged with Slack's reason: {log_2}"
    );
    secrets_kept(&crew, &[log_1, log_2]).await?;
    crew.shutdown().await
}

/// A request the bridge posted, delivered to it again (its ack lost, or, as here, its consumer
/// made anew and the stream read from its start), is not posted a second time: Postgres
/// notes where each request went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_delivered_again_after_its_post_is_not_posted_twice() -> anyhow::Result<()> {
    let (mut crew, slack, port) = setup().await?;
    let first = Bridge::start(&crew, port, "bridge-1").await?;
    let a = crew.open_with("svc", "stale lock held", Some("fp-a".into())).await?;
    crew.events.kind(a, EventKind::ApprovalRequested, WAIT).await?;
    posted(&slack, a).await?;
    first.stop().await?;
    let stream = crew.bus.js.get_stream(crew.bus.subjects.approvals_stream()).await?;
    stream.delete_consumer("slack-bridge").await?;

    let second = Bridge::start(&crew, port, "bridge-2").await?;
    let b = crew.open_with("svc", "stale lock held", Some("fp-b".into())).await?;
    crew.events.kind(b, EventKind::ApprovalRequested, WAIT).await?;
    // The new consumer reads the stream from its start: a's request, then b's.
    posted(&slack, b).await?;
    let posts = slack.calls_to("chat.postMessage");
    let of = |run: Uuid| posts.iter().filter(|c| c.body.to_string().contains(&run.to_string())).count();
    assert_eq!((of(a), of(b)), (1, 1), "each request posted once");
    let log = second.stop().await?;
    assert!(log.contains("approval request posted before: not posted again"), "{log}");
    crew.shutdown().await
}

/// A request the run has asked again since (the same plan, by a later attempt), still
/// unposted when the bridge comes back, is not posted: its buttons could only be refused. The
/// latest request is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_superseded_while_the_bridge_was_down_is_not_posted() -> anyhow::Result<()> {
    let (mut crew, slack, port) = setup().await?;
    // The bridge's consumer exists (it starts from there), then the bridge is down.
    Bridge::start(&crew, port, "bridge-1").await?.stop().await?;
    let run = Uuid::now_v7();
    for attempt in [1, 2] {
        let req = pitcrew_model::ApprovalRequest {
            run_id: run,
            service: "svc".into(),
            host: None,
            error: "down".into(),
            attempt,
            plan: vec!["rm -f /tmp/svc.lock".into()],
            plan_hash: "ab12".into(),
            risk: "critical".into(),
            rule: "rm".into(),
            diagnosis: "a stale lock".into(),
            evidence: Vec::new(),
            requested_at: chrono::Utc::now(),
            expires_at: chrono::Utc::now() + chrono::Duration::minutes(10),
            quorum: 1,
        };
        let id = format!("{run}.{}.{attempt}.request", req.plan_hash);
        let subject = crew.bus.subjects.approval_requested(run);
        crew.bus.publish(subject, &id, "application/json", Some(run), serde_json::to_vec(&req)?.into()).await?;
    }
    let bridge = Bridge::start(&crew, port, "bridge-2").await?;
    let post = posted(&slack, run).await?;
    assert!(button(&post, "approve").ends_with(":ab12:2"), "the latest request's: {}", button(&post, "approve"));
    settled(&crew).await?;
    let posts = slack.calls_to("chat.postMessage");
    assert_eq!(posts.iter().filter(|c| c.body.to_string().contains(&run.to_string())).count(), 1, "{posts:?}");
    let log = bridge.stop().await?;
    assert!(log.contains("approval request superseded by a later one: not posted"), "{log}");
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_refuses_to_start_without_its_secrets() -> anyhow::Result<()> {
    let (crew, _slack, _port) = setup().await?;
    let out = Command::new(env!("CARGO_BIN_EXE_pitcrew"))
        .arg("--config")
        .arg(crew.config_file()?)
        .args(["bridge", "slack"])
        .env_remove("SLACK_BOT_TOKEN")
        .env("SLACK_SIGNING_SECRET", SIGNING_SECRET)
        .env_remove("DATABASE_URL")
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("the Slack bot token is not set: export SLACK_BOT_TOKEN"), "{err}");
    assert!(!err.contains(SIGNING_SECRET), "{err}");
    Ok(())
}

/// A fake Mattermost, a crew whose bridge posts there (ann and bob mapped to approvers), the
/// bridge, and the public URL its buttons call.
async fn mattermost_crew() -> anyhow::Result<(FakeSlack, Crew, Bridge, String)> {
    let mm = FakeSlack::start_mattermost(MM_TOKEN).await?;
    let port = pitcrew_runtime::natsd::free_port()?;
    let public = format!("http://127.0.0.1:{port}");
    let bridge = format!(
        "[bridge.mattermost]\nurl = \"{}\"\nchannel_id = \"chan0ops\"\nlisten = \"127.0.0.1:{port}\"\n\
         public_url = \"{public}\"\ntimeout_secs = 5\nallow_from = [\"127.0.0.1\"]\n[bridge.mattermost.users]\nmmann0 = \"ann\"\nmmbob0 = \"bob\"\n",
        mm.url
    );
    let crew = crew_with(&bridge, None).await?;
    let secrets = [("MATTERMOST_TOKEN", MM_TOKEN), ("MATTERMOST_ACTION_SECRET", MM_ACTION_SECRET)];
    let bridge = Bridge::start_kind(&crew, port, "mattermost", "mattermost", &secrets).await?;
    Ok((mm, crew, bridge, public))
}

/// A run waiting for approval on Mattermost, the approvals table locked (by the client
/// returned, in a transaction: `COMMIT` frees it), and ann's click on Approve, to send.
async fn ann_clicks_behind_a_locked_table(
) -> anyhow::Result<(FakeSlack, Crew, Bridge, uuid::Uuid, tokio_postgres::Client, Value)> {
    let (mm, mut crew, bridge, _) = mattermost_crew().await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    let post = posted_with(&mm, "v4/posts", run).await?;
    let approve = post.body["props"]["attachments"][0]["actions"][0]["integration"]["context"].clone();
    let locker = crew.db().await?;
    locker.batch_execute("BEGIN; LOCK TABLE approvals IN ACCESS EXCLUSIVE MODE").await?;
    let call = json!({ "user_id": "mmann0", "context": approve });
    Ok((mm, crew, bridge, run, locker, call))
}

/// Mattermost gives up on an action call (its timeout) while the decision is under way (here
/// the approvals table is locked, so the decision waits on it): the decision still runs to
/// its end once the table is free, and the run resolves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mattermost_click_whose_caller_gives_up_is_still_decided() -> anyhow::Result<()> {
    let (_mm, mut crew, bridge, run, locker, call) = ann_clicks_behind_a_locked_table().await?;
    let sent = reqwest::Client::new()
        .post(format!("{}/mattermost/actions", bridge.url))
        .timeout(Duration::from_millis(500))
        .json(&call)
        .send()
        .await;
    assert!(sent.as_ref().is_err_and(|e| e.is_timeout()), "the decision waits on the table: {sent:?}");
    // Time for a decision dropped with its connection to be gone before the table is free.
    tokio::time::sleep(Duration::from_millis(500)).await;
    locker.batch_execute("COMMIT").await?;
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    assert_eq!(decisions_published(&crew, run).await?, 1);
    bridge.stop().await?;
    crew.shutdown().await
}

/// Callers that give up while decisions wait (Mattermost's timeout, its retries, users
/// clicking again while Postgres is slow) leave their decisions under way, each in a task of its
/// own: past 64 of them a click is answered at once that too many are under way, instead of
/// piling up one more task. The decisions under way still end, and the run is decided once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mattermost_clicks_past_the_decisions_under_way_are_told_to_wait() -> anyhow::Result<()> {
    let (_mm, mut crew, bridge, run, locker, call) = ann_clicks_behind_a_locked_table().await?;
    let http = reqwest::Client::new();
    let url = format!("{}/mattermost/actions", bridge.url);
    let given_up = futures::future::join_all(
        (0..64).map(|_| http.post(&url).timeout(Duration::from_millis(1500)).json(&call).send()),
    )
    .await;
    assert!(given_up.iter().all(|sent| sent.as_ref().is_err_and(|e| e.is_timeout())), "each waits on the table");
    let told: serde_json::Value =
        http.post(&url).timeout(Duration::from_secs(5)).json(&call).send().await?.error_for_status()?.json().await?;
    assert!(told["ephemeral_text"].as_str().unwrap_or_default().contains("Too many decisions"), "{told}");
    locker.batch_execute("COMMIT").await?;
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    assert_eq!(decisions_published(&crew, run).await?, 1);
    bridge.stop().await?;
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mattermost_click_runs_the_plan_and_forged_or_second_clicks_change_nothing() -> anyhow::Result<()> {
    let (mm, mut crew, bridge, public) = mattermost_crew().await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    let req = cli::approval_request(&crew.bus, run).await?;

    // Posted with the bot token; the buttons call the bridge back with a signed context,
    // never the secret itself.
    let post = posted_with(&mm, "v4/posts", run).await?;
    assert_eq!(post.authorization.as_deref(), Some(format!("Bearer {MM_TOKEN}").as_str()));
    assert_eq!(post.body["channel_id"], "chan0ops");
    let text = post.body.to_string();
    assert!(text.contains(&req.plan[0]), "{text}");
    // The rule quotes the command: shown as text, its Markdown escaped.
    let rule = post.body["props"]["attachments"][0]["fields"][1]["value"].as_str().unwrap_or_default();
    assert_eq!(rule.replace('\\', ""), req.rule, "{text}");
    assert!(!text.contains(MM_ACTION_SECRET), "the action secret never leaves the bridge");
    let actions = &post.body["props"]["attachments"][0]["actions"];
    assert_eq!(actions[0]["integration"]["url"], format!("{public}/mattermost/actions"));
    let (approve, deny) = (actions[0]["integration"]["context"].clone(), actions[1]["integration"]["context"].clone());
    assert_eq!((approve["action"].as_str(), deny["action"].as_str()), (Some("approve"), Some("deny")));
    assert_eq!(approve["plan_hash"], req.plan_hash.as_str());

    // Ann's genuine click, from an address not in allow_from (Mattermost signs nothing: the
    // user id is only the caller's word): refused before it is read, nothing changes.
    let elsewhere = Some("127.0.0.2".parse()?);
    let (status, text) = bridge.action_from("mmann0", &approve, elsewhere).await?;
    assert_eq!(status, 403, "{text}");
    assert!(text.contains("127.0.0.2 is not in it"), "{text}");
    unchanged(&crew, &mm, run).await?;

    // The Deny button's context turned into an approval: refused, nothing changes.
    let mut turned = deny.clone();
    turned["action"] = json!("approve");
    let (status, text) = bridge.action("mmann0", &turned).await?;
    assert_eq!(status, 401, "{text}");
    assert!(text.contains("bad button context"), "{text}");
    unchanged(&crew, &mm, run).await?;

    // A Mattermost user who is not mapped to an approver.
    let (status, text) = bridge.action("mmeve0", &approve).await?;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text)?;
    let reason = answer["ephemeral_text"].as_str().unwrap_or_default();
    assert!(reason.contains("Mattermost user mmeve0 is not mapped to an approver"), "{text}");
    assert!(answer.get("update").is_none(), "the post stays as it is: {text}");
    unchanged(&crew, &mm, run).await?;

    // Ann approves: the run resumes and executes; the post shows who decided, buttons gone.
    let (status, text) = bridge.action("mmann0", &approve).await?;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text)?;
    let updated = &answer["update"]["props"]["attachments"][0];
    assert!(updated.get("actions").is_none(), "the buttons are gone: {text}");
    assert!(updated["fields"].to_string().contains("Approved by ann"), "{text}");
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1 AND status = 'succeeded'", run).await, 2);
    let row = db.query_one("SELECT decided_by, channel FROM approvals WHERE run_id = $1", &[&run]).await?;
    assert_eq!((row.get::<_, String>(0), row.get::<_, String>(1)), ("ann".into(), "mattermost".into()));

    // Bob's Deny after that: refused, naming who decided.
    let (status, text) = bridge.action("mmbob0", &deny).await?;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text)?;
    let reason = answer["ephemeral_text"].as_str().unwrap_or_default();
    assert!(reason.contains("already decided: approve by ann via mattermost"), "{text}");
    assert_eq!(decisions_published(&crew, run).await?, 1);
    assert_eq!(mm.calls_to("v4/posts").len(), 1, "posted exactly once");
    let m = scrape(&bridge.metrics).await?;
    assert_eq!(sample(&m, r#"pitcrew_bridge_posts_total{chat="mattermost",outcome="posted"}"#), 1.0, "{m:?}");
    assert_eq!(sample(&m, r#"pitcrew_bridge_clicks_total{chat="mattermost",result="decided"}"#), 1.0, "{m:?}");
    assert_eq!(sample(&m, r#"pitcrew_bridge_clicks_total{chat="mattermost",result="refused"}"#), 2.0, "{m:?}");

    let log = bridge.stop().await?;
    assert!(log.contains("chat decision published") && log.contains("mmeve0"), "{log}");
    secrets_kept_of(&crew, &[log], &[MM_TOKEN, MM_ACTION_SECRET]).await?;
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_person_rule_in_slack_counts_the_first_click_and_runs_after_the_second() -> anyhow::Result<()> {
    let two_person = "[[critical]]\nname = \"two-person-rm\"\nreason = \"deleting needs two people\"\n\
                      pattern = '^rm\\s'\nquorum = 2\n";
    let (mut crew, slack, port) = setup_with_policy(Some(two_person)).await?;
    let bridge = Bridge::start(&crew, port, "bridge").await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    let post = posted(&slack, run).await?;
    assert!(post.body["blocks"].to_string().contains("2 distinct approvers"), "{}", post.body);
    let ts = post.answer["ts"].as_str().unwrap_or_default().to_string();
    let value = button(&post, "approve");

    // Ann's click counts, the buttons stay for the second approver, nothing runs yet.
    let (status, text) = bridge.click(&interaction("U0ANN", "approve", &value, &ts, &slack.response_url(1))).await?;
    assert_eq!(status, 200, "{text}");
    let note: Value = serde_json::from_str(&text)?;
    assert!(
        note["text"].as_str().unwrap_or_default().contains("counted (1 of 2): it runs once 2 distinct approvers"),
        "{text}"
    );
    crew.events.wait(run, |e| e.message.contains("approve by ann via slack counted: 1 of 2"), WAIT).await?;
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    assert!(slack.calls_to("chat.update").is_empty(), "the buttons stay");

    // Bob's click completes the quorum: the plan runs and the message shows it.
    let (status, text) = bridge.click(&interaction("U0BOB", "approve", &value, &ts, &slack.response_url(2))).await?;
    assert_eq!((status, text.as_str()), (200, ""));
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    let votes = "SELECT approver || '/' || channel FROM approval_votes WHERE run_id = $1 ORDER BY approver";
    let voters = common::texts(&db, votes, run).await;
    assert_eq!(voters, ["ann/slack", "bob/slack"]);
    let updated = |cs: &[Call]| {
        cs.iter().any(|c| {
            c.method() == "chat.update"
                && c.body["text"].as_str().is_some_and(|t| t.starts_with("Approved by ann, bob"))
        })
    };
    slack.wait_for("the message updated", updated, WAIT).await?;
    bridge.stop().await?;
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_an_incoming_webhook_the_decided_message_is_replaced_on_its_response_url() -> anyhow::Result<()> {
    let slack = FakeSlack::start(TOKEN).await?;
    let port = pitcrew_runtime::natsd::free_port()?;
    let bridge = format!(
        "[bridge.slack]\nwebhook_url_env = \"SLACK_WEBHOOK_URL\"\napi_url = \"{}\"\nlisten = \"127.0.0.1:{port}\"\n\
         timeout_secs = 5\n[bridge.slack.users]\nU0ANN = \"ann\"\n",
        slack.api_url()
    );
    let mut crew = crew_with(&bridge, None).await?;
    let hook = slack.webhook_url();
    // No bot token: the webhook posts, the response_url updates.
    let secrets = [("SLACK_WEBHOOK_URL", hook.as_str()), ("SLACK_SIGNING_SECRET", SIGNING_SECRET)];
    let bridge = Bridge::start_kind(&crew, port, "bridge", "slack", &secrets).await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    let hooked = |c: &Call| c.path.starts_with("/services/") && c.ok() && c.body.to_string().contains(&run.to_string());
    let calls = slack.wait_for("the request posted to the webhook", |cs| cs.iter().any(hooked), WAIT).await?;
    let post = calls.into_iter().find(hooked).expect("waited for it");
    assert_eq!(post.authorization, None, "the webhook's URL is its credential");
    let value = button(&post, "approve");
    assert!(value.starts_with(&run.to_string()), "{}", post.body);

    let (status, text) = bridge.click(&interaction("U0ANN", "approve", &value, "", &slack.response_url(7))).await?;
    assert_eq!((status, text.as_str()), (200, ""));
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    let replaced = |cs: &[Call]| {
        cs.iter().any(|c| {
            c.path == "/response/7"
                && c.body["replace_original"] == true
                && c.body["text"].as_str().is_some_and(|t| t.starts_with("Approved by ann"))
        })
    };
    slack.wait_for("the message replaced on the response_url", replaced, WAIT).await?;
    assert!(slack.calls_to("chat.postMessage").is_empty() && slack.calls_to("chat.update").is_empty());
    let log = bridge.stop().await?;
    assert!(log.contains("approval request posted"), "{log}");
    secrets_kept_of(&crew, &[log], &[hook.as_str(), "hook0secret0xyzzy1234", SIGNING_SECRET]).await?;
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_click_racing_one_the_crew_has_not_recorded_yet_is_refused() -> anyhow::Result<()> {
    let (mut crew, slack, port) = setup().await?;
    let bridge = Bridge::start(&crew, port, "bridge").await?;
    let (run, post, ts) = parked(&mut crew, &slack).await?;
    // The crew is stopped: what reaches the bridge subject is not recorded yet. First a
    // decision from someone who is not an approver (the crew will refuse it): it blocks nothing.
    crew.shutdown().await?;
    let req = cli::approval_request(&crew.bus, run).await?;
    let forged = ApprovalDecision {
        run_id: run,
        decision: Decision::Deny,
        by: "mallory".into(),
        plan_hash: Some(req.plan_hash.clone()),
        reason: Some("no".into()),
        channel: "script".into(),
        decided_at: chrono::Utc::now(),
    };
    crew.bus.js.publish(crew.bus.subjects.approval_decided(run), serde_json::to_vec(&forged)?.into()).await?.await?;
    // Ann's click is published.
    let ann = interaction("U0ANN", "approve", &button(&post, "approve"), &ts, &slack.response_url(1));
    let (status, text) = bridge.click(&ann).await?;
    assert_eq!((status, text.as_str()), (200, ""));
    assert_eq!(decisions_published(&crew, run).await?, 2);
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(*) FROM approvals WHERE run_id = $1 AND decision IS NULL", run).await, 1);
    // Bob's Deny arrives before the crew recorded Ann's: refused, naming the decision that won.
    let bob = interaction("U0BOB", "deny", &button(&post, "deny"), &ts, &slack.response_url(2));
    let (status, text) = bridge.click(&bob).await?;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text)?;
    let reason = answer["text"].as_str().unwrap_or_default();
    assert!(reason.contains("already decided: approve by ann via slack"), "{text}");
    assert!(reason.contains("this decision is ignored"), "{text}");
    assert_eq!(decisions_published(&crew, run).await?, 2, "the racing decision was not published");
    // The crew comes back and runs what Ann approved.
    crew.run(&Stage::ALL);
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    assert!(end.message.contains("approved by ann"), "{}", end.message);
    let row = db.query_one("SELECT decision, decided_by FROM approvals WHERE run_id = $1", &[&run]).await?;
    assert_eq!((row.get::<_, String>(0), row.get::<_, String>(1)), ("approve".into(), "ann".into()));
    bridge.stop().await?;
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_too_slow_with_its_headers_or_its_body_holds_no_connection() -> anyhow::Result<()> {
    use pitcrew_bridge::inbound::BODY_TIMEOUT;
    use pitcrew_runtime::httpd::HEADER_TIMEOUT;
    use tokio::io::AsyncWriteExt;
    let (mut crew, _slack, port) = setup().await?;
    let bridge = Bridge::start(&crew, port, "bridge").await?;
    let addr = format!("127.0.0.1:{port}");
    // Slowloris: half a request's headers, then nothing.
    let mut headers = tokio::net::TcpStream::connect(&addr).await?;
    headers.write_all(b"POST /slack/interactions HTTP/1.1\r\nHost: bridge\r\n").await?;
    // A signed-looking callback whose body never arrives whole.
    let mut body = tokio::net::TcpStream::connect(&addr).await?;
    let now = chrono::Utc::now().timestamp();
    let head = format!(
        "POST /slack/interactions HTTP/1.1\r\nHost: bridge\r\nContent-Type: application/x-www-form-urlencoded\r\n\
         X-Slack-Request-Timestamp: {now}\r\nX-Slack-Signature: v0=00\r\nContent-Length: 1000\r\n\r\npayload=%7B"
    );
    body.write_all(head.as_bytes()).await?;
    let started = tokio::time::Instant::now();
    let limit = HEADER_TIMEOUT.max(BODY_TIMEOUT) + Duration::from_secs(10);
    let closed = |s| common::closed_within(s, limit);
    let (h, b) = tokio::join!(closed(headers), closed(body));
    let (h, b) = (h?, b?);
    assert!(started.elapsed() >= HEADER_TIMEOUT.min(BODY_TIMEOUT) - Duration::from_secs(1), "cut by the timeouts");
    assert!(!h.contains("200"), "the half request was not served: {h}");
    assert!(b.starts_with("HTTP/1.1 408"), "{b}");
    assert!(b.contains("the body took too long to arrive"), "{b}");
    // The bridge serves on.
    let health = reqwest::get(format!("{}/healthz", bridge.url)).await?;
    assert_eq!(health.status(), 200);
    bridge.stop().await?;
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_click_while_nats_is_slow_is_answered_in_time_and_its_decision_still_lands_across_a_stop(
) -> anyhow::Result<()> {
    let (mut crew, slack, port) = setup().await?;
    let bridge = Bridge::start(&crew, port, "bridge").await?;
    let (run, post, ts) = parked(&mut crew, &slack).await?;
    let ann = interaction("U0ANN", "approve", &button(&post, "approve"), &ts, &slack.response_url(1));
    // NATS stops answering: the decision's reads wait. Slack wants an answer within 3 s.
    let frozen = crew.env.nats.freeze();
    let started = std::time::Instant::now();
    let (status, text) = bridge.click(&ann).await?;
    let took = started.elapsed();
    assert_eq!(status, 200, "{text}");
    assert!(took < Duration::from_secs(3), "answered after {took:?}");
    assert!(text.contains("the outcome follows here"), "{text}");
    // The bridge is stopped meanwhile: it waits for the decision under way before it exits.
    let stopping = tokio::spawn(bridge.stop());
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(frozen);
    stopping.await??;
    // The decision went on behind the answer: the plan Ann approved runs.
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    assert!(end.message.contains("approved by ann"), "{}", end.message);
    crew.shutdown().await
}
