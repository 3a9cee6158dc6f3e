//! The gateway over a real crew (nats-server, a fresh Postgres database) and a real
//! Prometheus Alertmanager: alerts become exactly one run each, every route's access, live
//! event streams, approvals over HTTP, malformed and oversized bodies, rate limits, readiness.

mod common;

use common::{count, marker_service, write, Crew, LOCKED_PLAYBOOK, WAIT};
use futures::FutureExt;
use pitcrew_gateway::access::{hash_key, Access, Role};
use pitcrew_gateway::Gateway;
use pitcrew_model::{EventKind, RunEvent, Stage};
use pitcrew_runtime::Config;
use pitcrew_testkit::alertmanager::{Alertmanager, Timing};
use pitcrew_testkit::TestEnv;
use reqwest::StatusCode;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::time::Duration;
use uuid::Uuid;

/// (owner, role, key). ann and carol are under the crew's [approvers]; eve is not.
const KEYS: &[(&str, &str, &str)] = &[
    ("rita", "readonly", "key-rita-readonly-0001"),
    ("otto", "operator", "key-otto-operator-0002"),
    ("ann", "approver", "key-ann-approver-0003"),
    ("carol", "admin", "key-carol-admin-0004"),
    ("eve", "approver", "key-eve-approver-0005"),
];

fn key(owner: &str) -> &'static str {
    KEYS.iter().find(|(o, _, _)| *o == owner).map(|(_, _, k)| *k).expect("a test key")
}

fn gateway_toml(rate: &str) -> String {
    let mut t =
        format!("[gateway]\nbody_limit_bytes = 4096\nalertmanager_body_limit_bytes = 16384\n{rate}\nsse_buffer = 64\n");
    for (owner, role, k) in KEYS {
        t.push_str(&format!("[gateway.keys.{owner}]\nrole = \"{role}\"\nsha256 = \"{}\"\n", hash_key(k)));
    }
    t
}

/// A crew running `stages` and a gateway in-process on a random port.
struct Api {
    crew: Crew,
    url: String,
    http: reqwest::Client,
    gw: std::sync::Arc<Gateway>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Api {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// Start a gateway over `cfg`, `bus` and `store`; returns its URL and its stop switch.
async fn start_gateway(
    crew: &Crew,
    cfg: Config,
) -> anyhow::Result<(String, std::sync::Arc<Gateway>, tokio::sync::oneshot::Sender<()>)> {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        let _ = rx.await;
    }
    .boxed()
    .shared();
    let gw = Gateway::new(cfg, crew.bus.clone(), crew.store.clone(), shutdown)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(pitcrew_gateway::serve(gw.clone(), listener));
    Ok((url, gw, tx))
}

impl Api {
    async fn start(stages: &[Stage], rate: &str) -> anyhow::Result<Api> {
        let env = TestEnv::start().await?;
        let book = write(&env, "playbook.toml", LOCKED_PLAYBOOK);
        let svc = marker_service(&env, "svc");
        let text = format!("[reasoning]\nplaybook_file = \"{book}\"\n{svc}{}", gateway_toml(rate));
        let crew = Crew::start_in(env, &text, stages).await?;
        let (url, gw, stop) = start_gateway(&crew, crew.cfg.clone()).await?;
        Ok(Api { crew, url, http: reqwest::Client::new(), gw, stop: Some(stop) })
    }

    /// Open an incident over HTTP whose plan waits for approval; its run, once it waits.
    async fn parked(&mut self) -> anyhow::Result<Uuid> {
        let (status, body) =
            self.post("/v1/incidents", "otto", &json!({"service": "svc", "error": "stale lock held"})).await?;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        let run: Uuid = body["run_id"].as_str().unwrap_or_default().parse()?;
        self.crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
        Ok(run)
    }

    fn req(&self, method: reqwest::Method, path: &str, owner: Option<&str>) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.url)).timeout(Duration::from_secs(30));
        match owner {
            Some(o) => r.bearer_auth(key(o)),
            None => r,
        }
    }

    /// A streaming GET: no overall timeout (each read has one).
    async fn stream(&self, path: &str, owner: &str) -> anyhow::Result<reqwest::Response> {
        Ok(self.http.get(format!("{}{path}", self.url)).bearer_auth(key(owner)).send().await?)
    }

    async fn get(&self, path: &str, owner: &str) -> anyhow::Result<(StatusCode, Value)> {
        let resp = self.req(reqwest::Method::GET, path, Some(owner)).send().await?;
        Ok((resp.status(), resp.json().await?))
    }

    async fn post(&self, path: &str, owner: &str, body: &Value) -> anyhow::Result<(StatusCode, Value)> {
        let resp = self.req(reqwest::Method::POST, path, Some(owner)).json(body).send().await?;
        Ok((resp.status(), resp.json().await?))
    }
}

/// Reads Server-Sent Events from a streaming response.
struct Sse {
    body: reqwest::Response,
    buf: String,
}

impl Sse {
    fn new(resp: reqwest::Response) -> Sse {
        Sse { body: resp, buf: String::new() }
    }

    /// The next event's (id, kind, RunEvent), or None when the stream ended.
    async fn next(&mut self) -> anyhow::Result<Option<(String, String, RunEvent)>> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..end + 2).collect();
                let (mut id, mut kind, mut data) = (String::new(), String::new(), String::new());
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("id:") {
                        id = v.trim().to_string();
                    } else if let Some(v) = line.strip_prefix("event:") {
                        kind = v.trim().to_string();
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push_str(v.trim_start());
                    }
                }
                if data.is_empty() {
                    continue; // a keep-alive comment
                }
                return Ok(Some((id, kind, serde_json::from_str(&data)?)));
            }
            match tokio::time::timeout(WAIT, self.body.chunk()).await {
                Err(_) => anyhow::bail!("no event within {WAIT:?}"),
                Ok(chunk) => match chunk? {
                    None => return Ok(None),
                    Some(chunk) => self.buf.push_str(&String::from_utf8_lossy(&chunk)),
                },
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alertmanager_alert_opens_exactly_one_run_and_its_resolution_is_recorded() -> anyhow::Result<()> {
    let mut api = Api::start(&Stage::ALL, "").await?;
    let am = Alertmanager::start(&format!("{}/v1/alerts/alertmanager", api.url), key("otto"), &Timing::default())?;
    let starts = chrono::Utc::now() - chrono::Duration::seconds(5);
    let alert = |ends: Option<chrono::DateTime<chrono::Utc>>| {
        let mut a = json!({
            "labels": { "alertname": "SvcDown", "service": "svc", "instance": "127.0.0.1:9100", "severity": "critical" },
            "annotations": { "summary": "GET /health: connection refused" },
            "startsAt": starts.to_rfc3339(),
        });
        if let Some(e) = ends {
            a["endsAt"] = json!(e.to_rfc3339());
        }
        json!([a])
    };
    am.post_alerts(&alert(None)).await?;
    let opened = api.crew.events.wait_any(|e| e.kind == EventKind::Status && e.stage == Stage::Intake, WAIT).await?;
    let run = opened.run_id;
    let end = api.crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    // Alertmanager re-sends the unchanged group every repeat_interval (2 s): wait for two
    // more deliveries, each answered 200 and publishing nothing.
    let db = api.crew.db().await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let n: i64 = db
            .query_one(
                "SELECT count(*) FROM gateway_audit WHERE path = '/v1/alerts/alertmanager' AND status = 200",
                &[],
            )
            .await?
            .get(0);
        if n >= 3 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "Alertmanager delivered {n} times; its log:\n{}", am.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let outcomes: Vec<String> = db
        .query("SELECT outcome FROM gateway_audit WHERE path = '/v1/alerts/alertmanager' ORDER BY id", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(outcomes[0].contains("1 incident(s) published"), "{outcomes:?}");
    assert!(outcomes[1..].iter().all(|o| o.contains("0 incident(s) published")), "{outcomes:?}");
    let principals: i64 =
        db.query_one("SELECT count(*) FROM gateway_audit WHERE principal <> 'otto'", &[]).await?.get(0);
    assert_eq!(principals, 0, "Alertmanager authenticated with the operator's key");
    assert_eq!(db.query_one("SELECT count(*) FROM runs", &[]).await?.get::<_, i64>(0), 1, "exactly one run");
    assert_eq!(db.query_one("SELECT count(*) FROM incidents", &[]).await?.get::<_, i64>(0), 1);
    let (svc, host, source, fp): (String, Option<String>, Option<String>, String) = {
        let r = db.query_one("SELECT service, host, source, fingerprint FROM incidents WHERE id = $1", &[&run]).await?;
        (r.get(0), r.get(1), r.get(2), r.get(3))
    };
    assert_eq!((svc.as_str(), host.as_deref(), source.as_deref()), ("svc", Some("127.0.0.1"), Some("alertmanager")));
    assert!(fp.starts_with("am-"), "{fp}");

    // The source resolves the alert: recorded on the run, once.
    am.post_alerts(&alert(Some(chrono::Utc::now() - chrono::Duration::seconds(1)))).await?;
    let rec = api
        .crew
        .events
        .wait(run, |e| e.kind == EventKind::Status && e.data["alert"] == "resolved", WAIT)
        .await
        .map_err(|e| anyhow::anyhow!("{e}\nAlertmanager log:\n{}", am.log()))?;
    assert!(rec.message.contains("alert resolved at the source"), "{}", rec.message);
    let stored =
        count(&db, "SELECT count(*) FROM run_events WHERE run_id = $1 AND data->>'alert' = 'resolved'", run).await;
    assert_eq!(stored, 1);
    assert_eq!(db.query_one("SELECT count(*) FROM runs", &[]).await?.get::<_, i64>(0), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incident_sent_again_after_the_run_it_joined_closed_opens_its_own_run() -> anyhow::Result<()> {
    let mut api = Api::start(&Stage::ALL, "").await?;
    let incident = |id: Uuid| json!({"id": id, "service": "svc", "error": "stale lock held", "fingerprint": "fp-flap"});
    let (first, again) = (Uuid::now_v7(), Uuid::now_v7());
    let (status, body) = api.post("/v1/incidents", "otto", &incident(first)).await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    api.crew.events.kind(first, EventKind::ApprovalRequested, WAIT).await?;
    // The alert fires again under a new id (Alertmanager: a new startsAt) while the first run
    // is open: it joins that run, and sent again it is still taken care of.
    let (status, body) = api.post("/v1/incidents", "otto", &incident(again)).await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    api.crew.events.kind(again, EventKind::Duplicate, WAIT).await?;
    let (status, body) = api.post("/v1/incidents", "otto", &incident(again)).await?;
    assert_eq!((status, &body["outcome"]), (StatusCode::OK, &json!("already_received")), "{body}");
    // The first run ends without fixing it; the alert, still firing, is sent again.
    let (status, body) = api.post(&format!("/v1/runs/{first}/deny"), "ann", &json!({"reason": "not now"})).await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(api.crew.end(first).await?.kind, EventKind::Escalated);
    let (status, body) = api.post("/v1/incidents", "otto", &incident(again)).await?;
    assert_eq!((status, &body["outcome"]), (StatusCode::ACCEPTED, &json!("accepted")), "{body}");
    // A run of its own, under a new id: the old id's timeline ended in `duplicate`.
    let reopened: Uuid = body["run_id"].as_str().unwrap_or_default().parse()?;
    assert_ne!(reopened, again);
    let opened = api
        .crew
        .events
        .wait(reopened, |e| e.kind == EventKind::Status && e.stage == Stage::Intake, WAIT)
        .await
        .map_err(|e| anyhow::anyhow!("the incident sent again opened no run of its own: {e}"))?;
    assert!(opened.message.starts_with("run opened for svc"), "{}", opened.message);
    api.crew.events.kind(reopened, EventKind::ApprovalRequested, WAIT).await?;
    // Sent again, it names that run and publishes nothing more.
    let (status, body) = api.post("/v1/incidents", "otto", &incident(again)).await?;
    assert_eq!(
        (status, &body["outcome"], &body["run_id"]),
        (StatusCode::OK, &json!("already_received"), &json!(reopened))
    );
    // Its id reused for another incident is a conflict, said so, and publishes nothing.
    let other = json!({"id": again, "service": "svc", "error": "disk full on /var"});
    let (status, body) = api.post("/v1/incidents", "otto", &other).await?;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(body.to_string().contains("received before for another incident"), "{body}");
    // The same incident sent again as it was, naming the service's own host (which intake
    // does not count in its fingerprint): the same incident, not a conflict.
    let hosted = json!({"id": Uuid::now_v7(), "service": "svc", "host": "localhost", "error": "clock skew"});
    let (status, body) = api.post("/v1/incidents", "otto", &hosted).await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let id: Uuid = body["run_id"].as_str().unwrap_or_default().parse()?;
    api.crew.events.wait(id, |e| e.stage == Stage::Intake, WAIT).await?;
    let (status, body) = api.post("/v1/incidents", "otto", &hosted).await?;
    assert_eq!((status, &body["outcome"]), (StatusCode::OK, &json!("already_received")), "{body}");
    // Its timeline is its own: it opened, and nothing ended it.
    let (status, run) = api.get(&format!("/v1/runs/{reopened}"), "otto").await?;
    assert_eq!(status, StatusCode::OK, "{run}");
    assert_eq!(run["status"], "waiting_approval", "{run}");
    assert!(run["report"].is_null(), "no terminal event in its timeline: {run}");
    let db = api.crew.db().await?;
    assert_eq!(db.query_one("SELECT count(*) FROM runs", &[]).await?.get::<_, i64>(0), 3);
    api.crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alert_opened_again_gets_its_resolution_on_the_run_it_opened() -> anyhow::Result<()> {
    let mut api = Api::start(&Stage::ALL, "").await?;
    // One Alertmanager alert (fingerprint f1) firing twice: from S1, then again from S2.
    let alert = |status: &str, starts: &str| {
        json!({"version": "4", "status": status, "alerts": [{
            "status": status, "labels": {"alertname": "Locked", "service": "svc"},
            "annotations": {"summary": "stale lock held"}, "startsAt": starts, "fingerprint": "f1",
            "endsAt": if status == "resolved" { "2026-11-22T09:00:00Z" } else { "0001-01-01T00:00:00Z" }}]})
    };
    const AM: &str = "/v1/alerts/alertmanager";
    let run_of = |body: &Value| body["alerts"][0]["run_id"].as_str().unwrap_or_default().parse::<Uuid>();
    let (_, body) = api.post(AM, "otto", &alert("firing", "2026-11-22T07:00:00Z")).await?;
    let first = run_of(&body)?;
    api.crew.events.kind(first, EventKind::ApprovalRequested, WAIT).await?;
    let (_, body) = api.post(AM, "otto", &alert("firing", "2026-11-22T08:00:00Z")).await?;
    let second = run_of(&body)?;
    api.crew.events.kind(second, EventKind::Duplicate, WAIT).await?;
    // While the run it joined is open, its resolution at the source is news for that run,
    // beside the resolution of the run's own alert: neither takes the other's place.
    let (_, body) = api.post(AM, "otto", &alert("resolved", "2026-11-22T07:00:00Z")).await?;
    assert_eq!(body["alerts"][0]["outcome"], "recorded", "{body}");
    let (_, body) = api.post(AM, "otto", &alert("resolved", "2026-11-22T08:00:00Z")).await?;
    assert_eq!(body["alerts"][0]["outcome"], "recorded", "{body}");
    let resolutions = |e: &pitcrew_model::RunEvent| e.kind == EventKind::Status && e.data["alert"] == "resolved";
    let own = api.crew.events.wait(first, resolutions, WAIT).await?;
    let joined = api.crew.events.wait(first, |e| resolutions(e) && e.index != own.index, WAIT).await?;
    let db = api.crew.db().await?;
    let resolved =
        "SELECT count(*) FROM run_events WHERE run_id = $1 AND kind = 'status' AND data->>'alert' = 'resolved'";
    let stored = count(&db, resolved, first).await;
    assert_eq!(stored, 2, "both resolutions are on the run's timeline: {own:?} {joined:?}");
    let (status, body) = api.post(&format!("/v1/runs/{first}/deny"), "ann", &json!({"reason": "not now"})).await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    api.crew.end(first).await?;
    // Still firing, sent again: opened again under a run of its own.
    let (_, body) = api.post(AM, "otto", &alert("firing", "2026-11-22T08:00:00Z")).await?;
    assert_eq!(body["alerts"][0]["outcome"], "accepted", "{body}");
    let reopened = run_of(&body)?;
    assert_ne!(reopened, second);
    api.crew.events.kind(reopened, EventKind::ApprovalRequested, WAIT).await?;
    // Its resolution at the source is news for that run, not for the closed duplicate.
    let (_, body) = api.post(AM, "otto", &alert("resolved", "2026-11-22T08:00:00Z")).await?;
    assert_eq!(body["alerts"][0]["outcome"], "recorded", "{body}");
    let rec =
        api.crew.events.wait(reopened, |e| e.kind == EventKind::Status && e.data["alert"] == "resolved", WAIT).await?;
    assert!(rec.message.contains("alert resolved at the source"), "{}", rec.message);
    // An alert whose id another incident took is refused alone: the rest of its group opens.
    let starts = "2026-11-22T10:00:00Z";
    let taken = pitcrew_gateway::alertmanager::run_id("f2", chrono::DateTime::parse_from_rfc3339(starts)?.into());
    let other = json!({"id": taken, "service": "svc", "error": "disk full on /var"});
    let (status, body) = api.post("/v1/incidents", "otto", &other).await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    api.crew.events.wait(taken, |e| e.stage == Stage::Intake, WAIT).await?;
    let alerts: Vec<Value> = ["f2", "f3"]
        .map(|f| {
            json!({"status": "firing", "labels": {"alertname": "Locked", "service": "svc", "f": f},
                   "annotations": {"summary": "stale lock held"}, "startsAt": starts, "fingerprint": f,
                   "endsAt": "0001-01-01T00:00:00Z"})
        })
        .into();
    let group = json!({"version": "4", "status": "firing", "alerts": alerts});
    let (status, body) = api.post(AM, "otto", &group).await?;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        (&body["alerts"][0]["outcome"], &body["alerts"][1]["outcome"]),
        (&json!("refused"), &json!("accepted")),
        "{body}"
    );
    assert!(body["alerts"][0]["error"].as_str().is_some_and(|e| e.contains("another incident")), "{body}");
    api.crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_refuses_no_key_and_the_wrong_role_and_admits_the_right_one() -> anyhow::Result<()> {
    let mut api = Api::start(&Stage::ALL, "").await?;
    // A finished run to read.
    let (status, body) =
        api.post("/v1/incidents", "otto", &json!({"service": "svc", "error": "connection refused"})).await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let run: Uuid = body["run_id"].as_str().unwrap_or_default().parse()?;
    api.crew.end(run).await?;
    // The same incident again (a client's retry): nothing published, the same run named.
    let again = json!({"id": run, "service": "svc", "error": "connection refused"});
    let (status, body) = api.post("/v1/incidents", "otto", &again).await?;
    assert_eq!((status, &body["outcome"], &body["run_id"]), (StatusCode::OK, &json!("already_received"), &json!(run)));
    let mut incidents = api.crew.bus.js.get_stream(api.crew.bus.subjects.incidents_stream()).await?;
    assert_eq!(incidents.info().await?.state.last_sequence, 1, "published once");

    let doc: Value = serde_json::from_str(pitcrew_gateway::OPENAPI)?;
    let (mut checked, mut heads) = (0, 0);
    for (path, ops) in doc["paths"].as_object().expect("paths") {
        for (method, op) in ops.as_object().expect("operations") {
            let access = Access::parse(op["x-pitcrew-access"].as_str().expect("access")).expect("known access");
            let path = path.replace("{id}", &run.to_string());
            let method: reqwest::Method = method.to_ascii_uppercase().parse()?;
            // A body that passes no handler's checks: only access decides 401/403.
            let send = |owner: Option<&str>| {
                api.req(method.clone(), &path, owner).header("content-type", "application/json").body("{}").send()
            };
            let anon = send(None).await?;
            if access == Access::Public {
                assert_eq!(anon.status(), StatusCode::OK, "{method} {path} is public");
                continue;
            }
            assert_eq!(anon.status(), StatusCode::UNAUTHORIZED, "{method} {path} without a key");
            let err: Value = anon.json().await?;
            assert!(err["error"].as_str().unwrap_or_default().contains("missing API key"), "{err}");
            for owner in ["rita", "otto", "ann", "carol"] {
                let role = Role::parse(KEYS.iter().find(|k| k.0 == owner).unwrap().1).unwrap();
                let resp = send(Some(owner)).await?;
                let status = resp.status();
                if role.may(access) {
                    assert!(
                        status != StatusCode::UNAUTHORIZED && status != StatusCode::FORBIDDEN,
                        "{method} {path} as {owner} ({role:?}): {status}"
                    );
                } else {
                    assert_eq!(status, StatusCode::FORBIDDEN, "{method} {path} as {owner} ({role:?})");
                    let err: Value = resp.json().await?;
                    assert!(err["error"].as_str().unwrap_or_default().contains("needs role"), "{err}");
                }
                checked += 1;
            }
            let wrong = api.req(method.clone(), &path, None).bearer_auth("not-a-key").send().await?;
            assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED, "{method} {path} with an unknown key");
            // HEAD runs the GET handler: it needs what GET needs.
            if method == reqwest::Method::GET {
                let head = api.req(reqwest::Method::HEAD, &path, None).send().await?;
                assert_eq!(head.status(), StatusCode::UNAUTHORIZED, "HEAD {path} without a key");
                let head = api.req(reqwest::Method::HEAD, &path, Some("rita")).send().await?;
                assert!(head.status().is_success(), "HEAD {path} as rita: {}", head.status());
                heads += 1;
            }
        }
    }
    assert!(heads >= 5, "every GET route was tried with HEAD ({heads})");
    assert!(checked >= 40, "every operation was tried with every role ({checked})");
    // X-API-Key works too; an approver who is not under [approvers] may not decide.
    let r = api.req(reqwest::Method::GET, "/v1/runs", None).header("x-api-key", key("rita")).send().await?;
    assert_eq!(r.status(), StatusCode::OK);
    let (status, body) = api.post(&format!("/v1/runs/{run}/approve"), "eve", &json!({})).await?;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(body["error"].as_str().unwrap_or_default().contains("eve is not a configured approver"), "{body}");
    // Every mutating request was audited, refusals too, by owner: never a key.
    let db = api.crew.db().await?;
    let audited: i64 = db.query_one("SELECT count(*) FROM gateway_audit", &[]).await?.get(0);
    assert!(audited >= 20, "{audited}");
    let anon: i64 = db
        .query_one("SELECT count(*) FROM gateway_audit WHERE principal = 'anonymous' AND status = 401", &[])
        .await?
        .get(0);
    assert!(anon >= 5, "{anon}");
    let all: String = db
        .query_one("SELECT string_agg(concat_ws(' ', principal, role, path, outcome), ' ') FROM gateway_audit", &[])
        .await?
        .get(0);
    for (_, _, k) in KEYS {
        assert!(!all.contains(k), "a key reached the audit trail");
    }
    // The document served is the one in schemas/ (the access rules above come from it).
    let served = api.req(reqwest::Method::GET, "/v1/openapi.json", None).send().await?.text().await?;
    let file = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../schemas/openapi.json"))?;
    assert_eq!(served, file);
    // The helper prints the hash the config holds.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pitcrew"))
        .args(["gateway", "hash-key"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().expect("stdin").write_all(b"key-rita-readonly-0001\n")?;
            c.wait_with_output()
        })?;
    assert_eq!(String::from_utf8(out.stdout)?.trim(), hash_key(key("rita")));
    api.crew.shutdown().await
}

/// A client that leaves while its mutating request is under way (here the audit table is
/// locked, so the request waits for its audit row) does not cost the audit: the request runs
/// to its end, and its row is stored once the table is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_request_still_leaves_its_audit_row() -> anyhow::Result<()> {
    let api = Api::start(&[], "").await?;
    let db = api.crew.db().await?;
    let locker = api.crew.db().await?;
    locker.batch_execute("BEGIN; LOCK TABLE gateway_audit IN EXCLUSIVE MODE").await?;
    let sent = api
        .req(reqwest::Method::POST, "/v1/incidents", Some("otto"))
        .timeout(Duration::from_millis(500))
        .json(&json!({"service": "svc", "error": "the client left early"}))
        .send()
        .await;
    assert!(sent.as_ref().is_err_and(|e| e.is_timeout()), "the request waits on its audit row: {sent:?}");
    // Time for a request dropped with its connection to be gone before the table is free.
    tokio::time::sleep(Duration::from_millis(500)).await;
    locker.batch_execute("COMMIT").await?;
    let audited =
        "SELECT count(*) FROM gateway_audit WHERE principal = 'otto' AND path = '/v1/incidents' AND status = 202";
    tokio::time::timeout(WAIT, async {
        while db.query_one(audited, &[]).await.map(|r| r.get::<_, i64>(0)).unwrap_or(0) == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .map_err(|_| anyhow::anyhow!("the request that changed something was not audited"))?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_streams_its_past_then_live_events_and_is_approved_over_http() -> anyhow::Result<()> {
    let mut api = Api::start(&Stage::ALL, "").await?;
    let all = api.stream("/v1/events?kind=resolved,approval_decided", "rita").await?;
    assert_eq!(all.status(), StatusCode::OK);
    let mut all = Sse::new(all);
    let run = api.parked().await?;
    let (status, pending) = api.get("/v1/approvals", "rita").await?;
    assert_eq!(status, StatusCode::OK);
    let plan_hash = pending["approvals"][0]["plan_hash"].as_str().unwrap_or_default().to_string();
    assert_eq!(pending["approvals"][0]["run_id"], json!(run), "{pending}");
    assert_eq!(pending["approvals"][0]["attempt"], json!(1), "{pending}");

    // The stream replays the past (intake first, up to the approval request) ...
    let resp = api.stream(&format!("/v1/runs/{run}/events"), "rita").await?;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut sse = Sse::new(resp);
    let mut kinds = Vec::new();
    loop {
        let (id, kind, e) = sse.next().await?.expect("replayed events");
        assert!(id.parse::<u64>().is_ok() && kind == e.kind.as_str() && e.run_id == run);
        kinds.push(e.kind);
        if e.kind == EventKind::ApprovalRequested {
            break;
        }
    }
    assert_eq!(kinds[0], EventKind::Status);
    // ... refuses stale and reasonless decisions ...
    let (status, body) = api.post(&format!("/v1/runs/{run}/approve"), "ann", &json!({"plan_hash": "0ld"})).await?;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(body["error"].as_str().unwrap_or_default().contains("stale plan"), "{body}");
    let (status, body) = api.post(&format!("/v1/runs/{run}/deny"), "ann", &json!({})).await?;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(body["error"].as_str().unwrap_or_default().contains("needs a reason"), "{body}");
    // A decision read off another attempt's request (the run asked again, the same plan
    // included) is refused: a retry of an old decision does not approve the new request.
    let stale = json!({"plan_hash": plan_hash, "attempt": 2});
    let (status, body) = api.post(&format!("/v1/runs/{run}/approve"), "ann", &stale).await?;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(body["error"].as_str().unwrap_or_default().contains("stale request"), "{body}");
    // ... then follows live events as the approval lets the plan run, and ends with the run.
    let read = json!({"plan_hash": plan_hash, "attempt": 1});
    let (status, body) = api.post(&format!("/v1/runs/{run}/approve"), "ann", &read).await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(body["attempt"], json!(1), "{body}");
    let mut live = Vec::new();
    let mut ids = Vec::new();
    while let Some((id, _, e)) = sse.next().await? {
        live.push(e.kind);
        ids.push(id);
    }
    assert!(live.contains(&EventKind::Execution), "{live:?}");
    assert_eq!(live.last(), Some(&EventKind::Resolved), "the stream ends with the run: {live:?}");
    // A client reconnecting with Last-Event-ID after the run ended gets what it missed, and
    // the stream ends: from the first live event, the rest up to the end ...
    let resume = |last: String| {
        api.http
            .get(format!("{}/v1/runs/{run}/events", api.url))
            .bearer_auth(key("rita"))
            .header("last-event-id", last)
            .send()
    };
    // (Keep-alives would hold a stream open forever: each read here has a deadline.)
    let mut rest = Sse::new(resume(ids[0].clone()).await?);
    let missed = tokio::time::timeout(WAIT, async {
        let mut missed = Vec::new();
        while let Some((id, _, _)) = rest.next().await? {
            missed.push(id);
        }
        anyhow::Ok(missed)
    })
    .await
    .map_err(|_| anyhow::anyhow!("the resumed stream of an ended run never ended"))??;
    assert_eq!(missed, ids[1..], "the events after Last-Event-ID, then the end");
    // ... and from the last event, nothing: 204 No Content, which stops an EventSource from
    // reconnecting (an empty 200 stream has it reconnect every few seconds, for ever).
    let none = resume(ids.last().cloned().unwrap_or_default()).await?;
    assert_eq!(none.status(), StatusCode::NO_CONTENT, "a resumed stream of an ended run with nothing left");
    assert_eq!(none.text().await?, "");
    // The all-runs stream, filtered, saw the decision and the end.
    let (_, _, first) = all.next().await?.expect("filtered events");
    assert_eq!((first.run_id, first.kind), (run, EventKind::ApprovalDecided));
    let (_, _, second) = all.next().await?.expect("filtered events");
    assert_eq!((second.run_id, second.kind), (run, EventKind::Resolved));

    // The full record.
    let (status, rec) = api.get(&format!("/v1/runs/{run}"), "rita").await?;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(rec["status"], "resolved");
    assert_eq!(rec["incident"]["service"], "svc");
    assert_eq!(rec["approvals"][0]["decision"], "approve");
    assert_eq!(rec["approvals"][0]["by"], "ann");
    assert_eq!(rec["approvals"][0]["channel"], "http");
    assert_eq!(rec["executions"].as_array().map(Vec::len), Some(2));
    assert!(!rec["evaluations"].as_array().expect("evaluations").is_empty());
    assert!(rec["timeline"].as_array().expect("timeline").len() >= 8);
    assert_eq!(rec["report"]["outcome"], "resolved");
    assert!(rec["report"]["summary"].as_str().unwrap_or_default().contains("approved by ann"), "{}", rec["report"]);
    // A claim removed with nothing run under it is part of the record.
    assert_eq!(rec["released_claims"], json!([]));
    api.crew
        .db()
        .await?
        .execute(
            "INSERT INTO execution_releases (run_id, attempt, idx, command, host, worker, started, claimed_at, why)
             VALUES ($1, 1, 0, 'touch /tmp/x', 'local', 'w0', false, now(), 'never started')",
            &[&run],
        )
        .await?;
    let (_, rec) = api.get(&format!("/v1/runs/{run}"), "rita").await?;
    let released = &rec["released_claims"][0];
    assert_eq!((released["index"].clone(), released["why"].clone()), (json!(0), json!("never started")), "{rec}");
    assert_eq!((released["command"].clone(), released["worker"].clone()), (json!("touch /tmp/x"), json!("w0")));
    let (_, listed) = api.get("/v1/runs?status=resolved&service=svc&limit=5", "rita").await?;
    assert_eq!(listed["runs"][0]["id"], json!(run));
    let (_, none) = api.get("/v1/runs?status=open", "rita").await?;
    assert_eq!(none["runs"].as_array().map(Vec::len), Some(0));
    let (_, later) = api
        .get(
            &format!(
                "/v1/runs?since={}",
                (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339().replace('+', "%2B")
            ),
            "rita",
        )
        .await?;
    assert_eq!(later["runs"].as_array().map(Vec::len), Some(0), "{later}");
    // The all-runs stream replays from a time, for one run and kind.
    let since = (chrono::Utc::now() - chrono::Duration::minutes(5)).to_rfc3339().replace('+', "%2B");
    let mut past = Sse::new(api.stream(&format!("/v1/events?run={run}&kind=status&since={since}"), "rita").await?);
    let (_, kind, e) = past.next().await?.expect("replayed from the start time");
    assert_eq!((kind.as_str(), e.run_id, e.stage), ("status", run, Stage::Intake));
    // Once the run's events are gone from the bus (they expire), its stream is the stored
    // timeline, ending with the run.
    let stream = api.crew.bus.js.get_stream(api.crew.bus.subjects.events_stream()).await?;
    stream.purge().filter(api.crew.bus.subjects.events_of(run)).await.map_err(|e| anyhow::anyhow!("purge: {e}"))?;
    let mut stored = Sse::new(api.stream(&format!("/v1/runs/{run}/events"), "rita").await?);
    let mut kinds = Vec::new();
    let mut stored_ids = Vec::new();
    while let Some((id, _, e)) = stored.next().await? {
        assert_eq!(id, format!("stored.{}.{}", e.seq, e.index), "a stored event's id is its place in the timeline");
        stored_ids.push(id);
        kinds.push(e.kind);
    }
    assert_eq!(kinds.len(), rec["timeline"].as_array().map(Vec::len).unwrap_or_default(), "{kinds:?}");
    assert_eq!((kinds.first(), kinds.last()), (Some(&EventKind::Status), Some(&EventKind::Resolved)));
    // A client resuming it with the last id it saw gets what is left (nothing) and the end,
    // not keep-alives for ever: the run has ended, whatever the bus still holds.
    let resumed = api
        .req(reqwest::Method::GET, &format!("/v1/runs/{run}/events"), Some("rita"))
        .header("last-event-id", "1")
        .send()
        .await?;
    assert_eq!(resumed.status(), StatusCode::NO_CONTENT, "the resumed stream of a finished run has nothing left");
    // An EventSource reconnecting after the stored timeline's end (its last id) is told there
    // is nothing more, not sent the whole timeline again and again.
    let again = api
        .req(reqwest::Method::GET, &format!("/v1/runs/{run}/events"), Some("rita"))
        .header("last-event-id", stored_ids.last().cloned().unwrap_or_default())
        .send()
        .await?;
    assert_eq!(again.status(), StatusCode::NO_CONTENT);
    // That id is a run timeline's, not one the all-runs stream can resume from.
    let (status, err) = api
        .req(reqwest::Method::GET, "/v1/events", Some("rita"))
        .header("last-event-id", stored_ids.last().cloned().unwrap_or_default())
        .send()
        .await
        .map(|r| (r.status(), r))?;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(err.text().await?.contains("stored timeline"));
    // An event published after the end (a late refusal) is on the bus, the end is not: the
    // stored timeline is the run's, and it ends.
    let late = pitcrew_model::RunEvent {
        run_id: run,
        seq: 99,
        index: 0,
        stage: Stage::Approval,
        kind: EventKind::Error,
        message: "approve ignored: the run is not waiting".into(),
        data: json!({}),
        worker: "test".into(),
        at: chrono::Utc::now(),
    };
    let subject = api.crew.bus.subjects.event(run, late.kind.as_str());
    api.crew.bus.js.publish(subject, serde_json::to_vec(&late)?.into()).await?.await?;
    let mut replay = Sse::new(api.stream(&format!("/v1/runs/{run}/events"), "rita").await?);
    let mut last = None;
    while let Some((_, _, e)) = replay.next().await? {
        last = Some(e.kind);
    }
    assert_eq!(last, Some(EventKind::Resolved));
    // The run's end committed in Postgres and published a moment later (the crew's order): a
    // client resuming in between gets the end once it is on the bus, not 204 before it.
    let mut events = api.crew.bus.js.get_stream(api.crew.bus.subjects.events_stream()).await?;
    let last_seq = events.info().await?.state.last_sequence;
    let end = pitcrew_model::RunEvent { kind: EventKind::Resolved, message: "resolved".into(), seq: 98, ..late };
    let bus = api.crew.bus.clone();
    let publish_end = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let subject = bus.subjects.event(end.run_id, end.kind.as_str());
        bus.js.publish(subject, serde_json::to_vec(&end)?.into()).await?.await?;
        anyhow::Ok(())
    });
    let resumed = api
        .req(reqwest::Method::GET, &format!("/v1/runs/{run}/events"), Some("rita"))
        .header("last-event-id", last_seq.to_string())
        .send()
        .await?;
    assert_eq!(resumed.status(), StatusCode::OK, "the end was on its way");
    let mut resumed = Sse::new(resumed);
    let (_, kind, e) = resumed.next().await?.expect("the end");
    assert_eq!((kind.as_str(), e.seq), ("resolved", 98));
    assert!(resumed.next().await?.is_none(), "and the stream ends with it");
    publish_end.await??;
    // A decision on a decided plan is refused with who decided it.
    let (status, body) = api.post(&format!("/v1/runs/{run}/deny"), "carol", &json!({"reason": "late"})).await?;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(body["error"].as_str().unwrap_or_default().contains("already decided: approve by ann via http"), "{body}");
    api.crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_bodies_are_refused_precisely_and_nothing_is_published() -> anyhow::Result<()> {
    let api = Api::start(&[], "").await?;
    let post_raw = |path: &str, ct: &str, body: Vec<u8>| {
        api.req(reqwest::Method::POST, path, Some("otto")).header("content-type", ct).body(body).send()
    };
    let cases: Vec<(&str, &str, Vec<u8>, StatusCode, &str)> = vec![
        ("/v1/incidents", "application/json", b"{not json".to_vec(), StatusCode::BAD_REQUEST, "invalid JSON body: key must be a string at line 1 column 2"),
        ("/v1/incidents", "application/json", br#"{"service":"svc","error":"x","sevrity":"critical"}"#.to_vec(), StatusCode::BAD_REQUEST, "unknown field `sevrity`"),
        ("/v1/incidents", "application/json", br#"{"error":"x"}"#.to_vec(), StatusCode::BAD_REQUEST, "missing field `service`"),
        ("/v1/incidents", "application/json", br#"{"service":" ","error":"x"}"#.to_vec(), StatusCode::UNPROCESSABLE_ENTITY, "field 'service' is empty"),
        ("/v1/incidents", "application/json", br#"{"service":"nope","error":"x"}"#.to_vec(), StatusCode::UNPROCESSABLE_ENTITY, "unknown service 'nope'"),
        ("/v1/incidents", "application/json", b"".to_vec(), StatusCode::BAD_REQUEST, "request body is empty"),
        // A time Postgres cannot keep: refused now, not accepted and then never opened.
        ("/v1/incidents", "application/json", br#"{"service":"svc","error":"x","observed_at":"-5000-01-01T00:00:00Z"}"#.to_vec(), StatusCode::UNPROCESSABLE_ENTITY, "field 'observed_at' must fall in the years 1-9999"),
        ("/v1/incidents", "text/plain", br#"{"service":"svc","error":"x"}"#.to_vec(), StatusCode::UNSUPPORTED_MEDIA_TYPE, "Content-Type: application/json"),
        ("/v1/incidents", "application/json", format!(r#"{{"service":"svc","error":"{}"}}"#, "x".repeat(5000)).into_bytes(), StatusCode::PAYLOAD_TOO_LARGE, "larger than the 4096-byte limit"),
        ("/v1/alerts/alertmanager", "application/json", br#"{"version":"3","status":"firing","alerts":[]}"#.to_vec(), StatusCode::UNPROCESSABLE_ENTITY, "version '3'"),
        ("/v1/alerts/alertmanager", "application/json", br#"{"version":"4","status":"firing"}"#.to_vec(), StatusCode::BAD_REQUEST, "missing field `alerts`"),
        ("/v1/alerts/alertmanager", "application/json", br#"{"version":"4","status":"firing","alerts":[{"status":"firing","startsAt":"yesterday","fingerprint":"a1"}]}"#.to_vec(), StatusCode::BAD_REQUEST, "invalid JSON body: input contains invalid characters"),
        // Every alert of the group unusable (here its only one): 422, naming each.
        ("/v1/alerts/alertmanager", "application/json", serde_json::to_vec(&json!({"version": "4", "status": "firing", "alerts": [
            {"status": "firing", "labels": {"alertname": "B", "job": ""}, "startsAt": "2026-11-22T07:00:00Z", "fingerprint": "b2"}]}))?,
            StatusCode::UNPROCESSABLE_ENTITY, "alerts[0] (alertname B, fingerprint b2): none of the labels [\"service\", \"job\"] names the service"),
        ("/v1/runs/not-a-uuid/approve", "application/json", b"{}".to_vec(), StatusCode::FORBIDDEN, "needs role approver or admin"),
        // A NUL in what the answer quotes back (here a field's name).
        ("/v1/incidents", "application/json", br#"{"service":"svc","error":"x","se\u0000v":1}"#.to_vec(), StatusCode::BAD_REQUEST, "unknown field"),
        // A secret in what the answer quotes back (here the service named): the audit row
        // keeps it redacted.
        ("/v1/incidents", "application/json", br#"{"service":"postgres://app:hunter2-XYZ@db/app","error":"x"}"#.to_vec(), StatusCode::UNPROCESSABLE_ENTITY, "field 'service'"),
    ];
    for (path, ct, body, want, msg) in cases {
        let resp = post_raw(path, ct, body).await?;
        let status = resp.status();
        let err: Value = resp.json().await?;
        assert_eq!(status, want, "{path}: {err}");
        assert!(err["error"].as_str().unwrap_or_default().contains(msg), "{path}: want {msg:?} in {err}");
    }
    let db = api.crew.db().await?;
    let audited: String =
        db.query_one("SELECT string_agg(concat_ws(' ', path, outcome), ' ') FROM gateway_audit", &[]).await?.get(0);
    assert!(audited.contains("field 'service'") && !audited.contains("hunter2-XYZ"), "{audited}");
    let (status, err) = api.get("/v1/runs/not-a-uuid", "rita").await?;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(err["error"].as_str().unwrap_or_default().contains("'not-a-uuid' is not a run id"), "{err}");
    // A path segment that is no text once decoded: the JSON error too, as any other.
    for path in ["/v1/runs/%FF", "/v1/runs/%FF/events"] {
        let resp = api.req(reqwest::Method::GET, path, Some("rita")).send().await?;
        let status = resp.status();
        let err: Value = resp.json().await?;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {err}");
        assert!(err["error"].as_str().is_some_and(|e| e.contains("the run id in the path")), "{path}: {err}");
    }
    // The caller's own bad values are 400, not a failed query's 503 (Postgres takes no NUL and
    // no time before 4714 BC).
    for q in [
        "limit=abc",
        "status=bogus",
        "limit=0",
        "colour=red",
        "since=yesterday",
        "service=a%00b",
        "since=-5000-01-01T00:00:00Z",
        "until=-5000-01-01T00:00:00Z",
    ] {
        let (status, err) = api.get(&format!("/v1/runs?{q}"), "rita").await?;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{q}: {err}");
        assert!(err["error"].is_string());
    }
    for (method, path, want) in [
        (reqwest::Method::GET, "/v1/incidents", StatusCode::METHOD_NOT_ALLOWED),
        (reqwest::Method::DELETE, "/v1/runs", StatusCode::METHOD_NOT_ALLOWED),
        (reqwest::Method::GET, "/v2/nothing", StatusCode::NOT_FOUND),
    ] {
        let resp = api.req(method.clone(), path, Some("rita")).send().await?;
        assert_eq!(resp.status(), want, "{method} {path}");
        let err: Value = resp.json().await?;
        assert!(err["error"].is_string(), "{err}");
    }
    let (status, err) = api.get(&format!("/v1/runs/{}", Uuid::new_v4()), "rita").await?;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(err["error"].as_str().unwrap_or_default().contains("no incident with this id"), "{err}");
    // A Last-Event-ID at the end of the sequence range is refused, not an overflow.
    let resp = api
        .req(reqwest::Method::GET, "/v1/events", Some("rita"))
        .header("last-event-id", u64::MAX.to_string())
        .send()
        .await?;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let err: Value = resp.json().await?;
    assert!(err["error"].as_str().unwrap_or_default().contains("Last-Event-ID"), "{err}");
    // A kind named twice is one filter (JetStream refuses overlapping ones).
    let twice = api.stream("/v1/events?kind=status,status", "rita").await?;
    assert_eq!(twice.status(), StatusCode::OK);
    drop(twice);
    let (status, err) = api.get("/v1/events?kind=nonsense", "rita").await?;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(err["error"].as_str().unwrap_or_default().contains("kind 'nonsense'"), "{err}");
    let (status, err) = api.post("/v1/ask", "otto", &json!({"question": "why is checkout slow"})).await?;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED);
    assert!(err["error"].as_str().unwrap_or_default().contains("investigation mode"), "{err}");
    // Nothing reached the incidents subject.
    let mut stream = api.crew.bus.js.get_stream(api.crew.bus.subjects.incidents_stream()).await?;
    assert_eq!(stream.info().await?.state.last_sequence, 0, "a refused request published nothing");
    // Every refusal is in the audit trail, the one quoting a NUL too (Postgres takes no NUL).
    let db = api.crew.db().await?;
    let nul: i64 = db
        .query_one(
            "SELECT count(*) FROM gateway_audit WHERE status = 400 AND outcome LIKE '%se' || chr(65533) || 'v%'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(nul, 1);
    // An oversized body is refused whatever its route, Alertmanager's past its own limit.
    let resp = post_raw("/v1/incidents", "application/json", vec![b' '; 10_000]).await?;
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let resp = post_raw("/v1/alerts/alertmanager", "application/json", vec![b' '; 20_000]).await?;
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let err: Value = resp.json().await?;
    let err = err["error"].as_str().unwrap_or_default();
    assert!(err.contains("16384-byte limit ([gateway] alertmanager_body_limit_bytes)"), "{err}");
    // One good alert and one without a service label in a group: the good one opens its run
    // (Alertmanager never re-sends a group answered 4xx), the other is refused by name. The
    // group is larger than the other routes' limit: a group of alerts has its own.
    let group = json!({"version": "4", "status": "firing", "alerts": [
        {"status": "firing", "labels": {"alertname": "A", "service": "svc"}, "startsAt": "2026-11-22T07:00:00Z", "fingerprint": "a1",
         "annotations": {"runbook": "r".repeat(6000)}},
        {"status": "firing", "labels": {"alertname": "B", "job": ""}, "startsAt": "2026-11-22T07:00:00Z", "fingerprint": "b2"}]});
    let resp = post_raw("/v1/alerts/alertmanager", "application/json", serde_json::to_vec(&group)?).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    let body: Value = resp.json().await?;
    assert_eq!(body["alerts"][0]["outcome"], "accepted", "{body}");
    assert_eq!((&body["alerts"][1]["outcome"], &body["alerts"][1]["fingerprint"]), (&json!("refused"), &json!("b2")));
    let why = body["alerts"][1]["error"].as_str().unwrap_or_default();
    assert!(why.contains("alerts[1] (alertname B, fingerprint b2): none of the labels"), "{body}");
    assert_eq!(stream.info().await?.state.last_sequence, 1, "the good alert, and only it, was published");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_over_its_rate_gets_429_with_retry_after_and_readiness_follows_nats() -> anyhow::Result<()> {
    let mut api = Api::start(&[], "rate_per_sec = 0.5\nrate_burst = 3").await?;
    for _ in 0..3 {
        assert_eq!(api.get("/v1/runs", "rita").await?.0, StatusCode::OK);
    }
    let resp = api.req(reqwest::Method::GET, "/v1/runs", Some("rita")).send().await?;
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = resp.headers()["retry-after"].to_str()?.parse()?;
    assert!((1..=2).contains(&retry), "{retry}");
    let err: Value = resp.json().await?;
    assert!(err["error"].as_str().unwrap_or_default().contains("rate limit exceeded for key 'rita'"), "{err}");
    assert_eq!(api.get("/v1/runs", "carol").await?.0, StatusCode::OK, "another key has its own bucket");
    // Alertmanager drops what is answered 4xx and retries 5xx: over its rate, its webhook
    // answers 503 with Retry-After, and such a refusal is not stored either.
    let empty = json!({"version": "4", "status": "firing", "alerts": []});
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let r = api.req(reqwest::Method::POST, "/v1/alerts/alertmanager", Some("otto")).json(&empty).send().await?;
        statuses.push(r.status());
        if r.status() == StatusCode::SERVICE_UNAVAILABLE {
            assert!(r.headers().contains_key("retry-after"));
            let err: Value = r.json().await?;
            assert!(err["error"].as_str().unwrap_or_default().contains("rate limit exceeded for key 'otto'"), "{err}");
        }
    }
    assert_eq!(statuses.last(), Some(&StatusCode::SERVICE_UNAVAILABLE), "{statuses:?}");
    assert!(!statuses.contains(&StatusCode::TOO_MANY_REQUESTS), "{statuses:?}");
    let db = api.crew.db().await?;
    let busy: i64 = db.query_one("SELECT count(*) FROM gateway_audit WHERE status = 503", &[]).await?.get(0);
    assert_eq!(busy, 0, "a refusal by the rate limit is only logged");
    // Guessing keys is limited like one key.
    for _ in 0..3 {
        let r = api.req(reqwest::Method::GET, "/v1/runs", None).bearer_auth("guess").send().await?;
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    }
    let r = api.req(reqwest::Method::GET, "/v1/runs", None).bearer_auth("guess").send().await?;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(r.headers().contains_key("retry-after"));
    // Anonymous writes share that bucket, and one refused by it writes no audit row: nobody
    // fills Postgres by sending requests fast.
    let mut refused = 0;
    let mut answered = 0;
    for path in ["/v1/incidents", "/v1/alerts/alertmanager", "/v1/ask"].repeat(2) {
        let r = api.req(reqwest::Method::POST, path, None).send().await?;
        if r.status() == StatusCode::TOO_MANY_REQUESTS {
            refused += 1;
        } else {
            answered += 1;
        }
    }
    assert!(refused >= 4, "{refused} of 6 anonymous writes refused");
    let db = api.crew.db().await?;
    let rows: i64 = db.query_one("SELECT count(*) FROM gateway_audit WHERE principal = 'anonymous'", &[]).await?.get(0);
    assert_eq!(rows, answered, "only the answered writes are in the audit trail");
    let ready = api.req(reqwest::Method::GET, "/readyz", None).send().await?;
    assert_eq!(ready.status(), StatusCode::OK);
    let body: Value = ready.json().await?;
    assert_eq!((body["nats"].as_str(), body["postgres"].as_str()), (Some("ok"), Some("ok")), "{body}");
    // A flood of readiness probes shares one check a second (it is public: no key, no limit).
    for _ in 0..20 {
        let again: Value = api.req(reqwest::Method::GET, "/readyz", None).send().await?.json().await?;
        if again["checked_at"] != body["checked_at"] {
            break; // a second passed: a new check is due
        }
        assert_eq!(again, body, "within the second every caller gets the same answer");
    }
    api.crew.env.nats.kill();
    // Readiness follows within about a second (the shared answer's age).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let ready = loop {
        let ready = api.req(reqwest::Method::GET, "/readyz", None).send().await?;
        if ready.status() != StatusCode::OK || tokio::time::Instant::now() > deadline {
            break ready;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = ready.json().await?;
    let nats = body["nats"].as_str().unwrap_or_default();
    assert!(["unavailable", "no answer within 2 s"].contains(&nats), "public: the part, not its error: {body}");
    assert_eq!(body["postgres"], "ok", "{body}");
    // A decision while NATS is down is "try again" (503), not "no such request" (404).
    let (status, body) = api.post(&format!("/v1/runs/{}/approve", Uuid::now_v7()), "ann", &json!({})).await?;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    // Said without the client library's words (they name subjects and streams), under a
    // reference the log has.
    assert_answered_by_reference(&body, "NATS");
    assert_eq!(api.req(reqwest::Method::GET, "/healthz", None).send().await?.status(), StatusCode::OK);
    Ok(())
}

/// A key refused by its role pays for the request like any other: a read-only key looping on
/// an approval gets 429 once its burst is spent, and its refusals stop reaching Postgres.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_refused_by_its_role_is_rate_limited_and_stops_filling_the_audit_trail() -> anyhow::Result<()> {
    // Slow enough a refill that no token comes back while the ten requests are sent.
    let api = Api::start(&[], "rate_per_sec = 0.05\nrate_burst = 2").await?;
    let path = format!("/v1/runs/{}/approve", Uuid::now_v7());
    let mut statuses = Vec::new();
    for _ in 0..10 {
        let resp = api.req(reqwest::Method::POST, &path, Some("rita")).json(&json!({})).send().await?;
        if resp.status() == StatusCode::TOO_MANY_REQUESTS {
            let retry: u64 = resp.headers()["retry-after"].to_str()?.parse()?;
            assert!(retry >= 1, "{retry}");
        }
        statuses.push(resp.status());
    }
    let mut want = vec![StatusCode::FORBIDDEN; 2];
    want.resize(10, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(statuses, want);
    // A refusal by role is audited under the key's owner and role (its key is valid: who
    // tried is known); one by the rate limit is not stored.
    let db = api.crew.db().await?;
    let rows: i64 =
        db.query_one("SELECT count(*) FROM gateway_audit WHERE outcome LIKE '%key ''rita''%'", &[]).await?.get(0);
    assert_eq!(rows, 2, "the refusals within the burst are audited, none past it");
    let named: i64 = db
        .query_one(
            "SELECT count(*) FROM gateway_audit WHERE principal = 'rita' AND role = 'readonly' AND status = 403",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(named, 2, "audited under who tried, not as anonymous");
    Ok(())
}

/// A client that asks for every event and then reads nothing, with a tiny receive window.
async fn slow_client(api: &Api) -> anyhow::Result<tokio::net::TcpStream> {
    use tokio::io::AsyncWriteExt;
    let addr: std::net::SocketAddr = api.url.trim_start_matches("http://").parse()?;
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.set_recv_buffer_size(4096)?;
    let mut slow = socket.connect(addr).await?;
    let ask = format!(
        "GET /v1/events HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
        key("rita")
    );
    slow.write_all(ask.as_bytes()).await?;
    Ok(slow)
}

/// Publish a `status` event of `size` bytes of message on the bus for each of `runs`.
async fn publish_events(api: &Api, runs: impl IntoIterator<Item = Uuid>, size: usize) -> anyhow::Result<()> {
    for run in runs {
        let e = RunEvent {
            run_id: run,
            seq: 0,
            index: 0,
            stage: Stage::Intake,
            kind: EventKind::Status,
            message: "x".repeat(size),
            data: Value::Null,
            worker: "test".into(),
            at: chrono::Utc::now(),
        };
        api.crew.bus.client.publish(api.crew.bus.subjects.event(run, "status"), serde_json::to_vec(&e)?.into()).await?;
    }
    api.crew.bus.client.flush().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_live_stream_client_is_dropped_and_blocks_no_one() -> anyhow::Result<()> {
    use tokio::io::AsyncReadExt;
    let api = Api::start(&[], "").await?;
    let mut slow = slow_client(&api).await?;
    let mut fast = Sse::new(api.stream("/v1/events", "rita").await?);
    // 8000 events of 2 KiB: far more than the slow client's socket buffers and its 64 events.
    let n = 8000;
    let last = Uuid::new_v4();
    publish_events(&api, (0..n).map(|_| Uuid::new_v4()).chain([last]), 2048).await?;
    // The fast client gets everything, to the last event, while the slow one stalls.
    let mut got = 0;
    loop {
        let (_, _, e) = fast.next().await?.expect("the fast stream stays open");
        got += 1;
        if e.run_id == last {
            break;
        }
    }
    assert_eq!(got, n + 1);
    let health = api.req(reqwest::Method::GET, "/healthz", None).send().await?;
    assert_eq!(health.status(), StatusCode::OK);
    // The slow client is dropped once its buffer stayed full for SLOW_CLIENT.
    let deadline = tokio::time::Instant::now() + WAIT;
    while api.gw.slow_dropped.load(Ordering::Relaxed) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the slow client was never dropped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // What it can still read ends well before the last event; its stream's slot is given
    // back with its answer: one stream is left.
    let mut seen = Vec::new();
    let read = tokio::time::timeout(WAIT, slow.read_to_end(&mut seen)).await;
    assert!(read.is_ok(), "the slow client's stream was closed");
    let open = |gw: &Gateway| pitcrew_gateway::events::MAX_STREAMS - gw.streams.available_permits();
    let deadline = tokio::time::Instant::now() + WAIT;
    while open(&api.gw) > 1 {
        assert!(tokio::time::Instant::now() < deadline, "the slow client's slot was never given back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let text = String::from_utf8_lossy(&seen);
    assert!(text.starts_with("HTTP/1.1 200"), "{}", &text[..text.len().min(200)]);
    let events = text.matches("event: status").count();
    assert!(events < n, "the slow client was cut off after {events} events");
    assert!(!text.contains(&last.to_string()));
    Ok(())
}

/// A Postgres failure is answered 503 without Postgres' own words (they name tables,
/// constraints and values), with a reference the gateway's log has them under.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_failure_is_answered_without_its_details() -> anyhow::Result<()> {
    let api = Api::start(&[], "").await?;
    let db = api.crew.db().await?;
    db.batch_execute("ALTER TABLE runs RENAME TO runs_elsewhere").await?;
    let answer = api.get(&format!("/v1/runs/{}", Uuid::now_v7()), "rita").await;
    db.batch_execute("ALTER TABLE runs_elsewhere RENAME TO runs").await?;
    let (status, body) = answer?;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_answered_by_reference(&body, "Postgres");
    Ok(())
}

/// A backend failure's answer: `what` failed, retry, and the log's reference (12 hex digits),
/// nothing of the error's own text.
fn assert_answered_by_reference(body: &Value, what: &str) {
    let error = body["error"].as_str().unwrap_or_default();
    let said = format!("{what} failed (retry later; the gateway's log has the error under reference ");
    let reference = error.strip_prefix(&said).and_then(|rest| rest.strip_suffix(')'));
    assert!(reference.is_some_and(|r| r.len() == 12 && r.chars().all(|c| c.is_ascii_hexdigit())), "{body}");
}

/// A live stream's buffer is bounded in bytes as well as in events: a client that reads
/// nothing is dropped once large events fill it, though they are fewer than its 64 events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_s_buffer_is_bounded_in_bytes_too() -> anyhow::Result<()> {
    let api = Api::start(&[], "").await?;
    let slow = slow_client(&api).await?;
    let open = |gw: &Gateway| pitcrew_gateway::events::MAX_STREAMS - gw.streams.available_permits();
    let deadline = tokio::time::Instant::now() + WAIT;
    while open(&api.gw) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the stream never opened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // 40 events of 200 KiB: 8 MB, far past the socket buffers, in fewer than 64 events.
    publish_events(&api, (0..40).map(|_| Uuid::new_v4()), 200 * 1024).await?;
    // Dropped for its full buffer (after SLOW_CLIENT), well before the connection's write
    // timeout would end it anyway.
    let within = pitcrew_runtime::httpd::WRITE_TIMEOUT / 2;
    let deadline = tokio::time::Instant::now() + within;
    while api.gw.slow_dropped.load(Ordering::Relaxed) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the slow client was not dropped within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // What its answer still buffers counts against the streams' bounds until the answer
    // ends: the slot is held while the connection lives, given back when it closes.
    assert_eq!(open(&api.gw), 1, "a dropped client's answer still holds its slot");
    drop(slow);
    let deadline = tokio::time::Instant::now() + WAIT;
    while open(&api.gw) > 0 {
        assert!(tokio::time::Instant::now() < deadline, "a closed connection's slot was never given back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// One key cannot hold every live stream: past `streams_per_key` it gets 429, other keys are
/// served, and a stream its client closes is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_holds_at_most_its_share_of_live_streams() -> anyhow::Result<()> {
    let api = Api::start(&[], "streams_per_key = 2").await?;
    let first = api.stream("/v1/events", "rita").await?;
    let second = api.stream("/v1/events?kind=status", "rita").await?;
    assert_eq!((first.status(), second.status()), (StatusCode::OK, StatusCode::OK));
    let third = api.stream("/v1/events", "rita").await?;
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    let err: Value = third.json().await?;
    let why = err["error"].as_str().unwrap_or_default();
    assert!(why.contains("key 'rita' holds 2 live streams already") && why.contains("streams_per_key"), "{err}");
    let other = api.stream("/v1/events", "otto").await?;
    assert_eq!(other.status(), StatusCode::OK, "another key is served");
    drop(first);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let again = api.stream("/v1/events", "rita").await?;
        if again.status() == StatusCode::OK {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "a closed stream was never given back: {}", again.status());
        drop(again);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop((second, other));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_process_logs_and_audits_requests_but_never_a_key() -> anyhow::Result<()> {
    let api = Api::start(&[], "").await?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let log_path = api.crew.env.dir.path().join("gateway.log");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_pitcrew"))
        .arg("--config")
        .arg(api.crew.config_file()?)
        .arg("gateway")
        .env("PITCREW_GATEWAY__LISTEN", format!("127.0.0.1:{port}"))
        .env("PITCREW_LOG", "debug")
        .env_remove("DATABASE_URL")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()?;
    let url = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while http.get(format!("{url}/readyz")).send().await.map(|r| r.status() != StatusCode::OK).unwrap_or(true) {
        assert!(tokio::time::Instant::now() < deadline, "{}", std::fs::read_to_string(&log_path)?);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let opened = http
        .post(format!("{url}/v1/incidents"))
        .bearer_auth(key("otto"))
        .json(&json!({"service": "svc", "error": "connection refused"}))
        .send()
        .await?;
    assert_eq!(opened.status(), StatusCode::ACCEPTED);
    let wrong = http.post(format!("{url}/v1/incidents")).bearer_auth("wrong-key-XYZ-123").send().await?;
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    let read = http.get(format!("{url}/v1/runs")).header("x-api-key", key("rita")).send().await?;
    assert_eq!(read.status(), StatusCode::OK);
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(&log_path)?;
    assert!(log.contains("audit") && log.contains("otto"), "{log}");
    for k in KEYS.iter().map(|k| k.2).chain(["wrong-key-XYZ-123"]) {
        assert!(!log.contains(k), "a key reached the log:\n{log}");
    }
    let db = api.crew.db().await?;
    let rows: Vec<(String, i32)> = db
        .query("SELECT principal, status FROM gateway_audit ORDER BY id", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows, [("otto".to_string(), 202), ("anonymous".to_string(), 401)], "reads are not audited");
    let remotes: i64 = db.query_one("SELECT count(*) FROM gateway_audit WHERE remote = '127.0.0.1'", &[]).await?.get(0);
    assert_eq!(remotes, 2, "each row names the client's address");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_too_slow_with_its_headers_or_its_body_holds_no_connection() -> anyhow::Result<()> {
    use pitcrew_gateway::body::BODY_TIMEOUT;
    use pitcrew_runtime::httpd::HEADER_TIMEOUT;
    use tokio::io::AsyncWriteExt;
    let api = Api::start(&[], "").await?;
    let addr = api.url.trim_start_matches("http://").to_string();
    // Slowloris: half a request's headers, then nothing.
    let mut headers = tokio::net::TcpStream::connect(&addr).await?;
    headers.write_all(b"POST /v1/incidents HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n").await?;
    // A body that never arrives whole.
    let mut body = tokio::net::TcpStream::connect(&addr).await?;
    let head = format!(
        "POST /v1/incidents HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"service\": \"svc\"",
        key("otto")
    );
    body.write_all(head.as_bytes()).await?;
    let started = tokio::time::Instant::now();
    let limit = HEADER_TIMEOUT.max(BODY_TIMEOUT) + Duration::from_secs(10);
    let closed = |s| common::closed_within(s, limit);
    // A connection that says nothing at all (an idle keep-alive looks the same).
    let silent = tokio::net::TcpStream::connect(&addr).await?;
    let (h, b, quiet) = tokio::join!(closed(headers), closed(body), closed(silent));
    let (h, b, quiet) = (h?, b?, quiet?);
    assert!(started.elapsed() >= HEADER_TIMEOUT.min(BODY_TIMEOUT) - Duration::from_secs(1), "cut by the timeouts");
    assert!(!h.contains("202"), "the half request was not served: {h}");
    assert!(!quiet.contains("HTTP/1.1 2"), "{quiet}");
    assert!(b.starts_with("HTTP/1.1 408"), "{b}");
    assert!(b.contains("the request body took more than 10 s to arrive"), "{b}");
    // The gateway serves on, and nothing was published.
    assert_eq!(api.req(reqwest::Method::GET, "/healthz", None).send().await?.status(), StatusCode::OK);
    let mut stream = api.crew.bus.js.get_stream(api.crew.bus.subjects.incidents_stream()).await?;
    assert_eq!(stream.info().await?.state.last_sequence, 0, "nothing published");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_racing_one_the_crew_has_not_recorded_yet_gets_409() -> anyhow::Result<()> {
    let mut api = Api::start(&Stage::ALL, "").await?;
    let run = api.parked().await?;
    // The crew is stopped: Ann's approval is published, not recorded yet.
    api.crew.shutdown().await?;
    let (status, body) = api.post(&format!("/v1/runs/{run}/approve"), "ann", &json!({})).await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    // Carol's denial races it: 409, naming the decision that won.
    let (status, body) = api.post(&format!("/v1/runs/{run}/deny"), "carol", &json!({"reason": "wait"})).await?;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let why = body["error"].as_str().unwrap_or_default();
    assert!(why.contains("already decided: approve by ann via http") && why.contains("being recorded"), "{body}");
    api.crew.run(&Stage::ALL);
    let end = api.crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    assert!(end.message.contains("approved by ann"), "{}", end.message);
    api.crew.shutdown().await
}

/// An approval while NATS is down and the client's queue is full (what piles up over a long
/// outage: publishes, pulls, requests) answers 503 within the bus's API limit, and nothing is
/// decided behind the operator's back once NATS is back: the request waited in that queue with
/// no limit and went on when NATS returned, approving a plan the operator was never told
/// was approved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_while_the_nats_client_is_backed_up_answers_503_and_decides_nothing_later() -> anyhow::Result<()> {
    let mut api = Api::start(&Stage::ALL, "").await?;
    let run = api.parked().await?;
    let (_, pending) = api.get("/v1/approvals", "rita").await?;
    let plan_hash = pending["approvals"][0]["plan_hash"].as_str().unwrap_or_default().to_string();
    api.crew.env.nats.kill();
    // Fill the client's queue (2048 commands) with publishes to a subject no stream keeps.
    let filler = format!("{}.test.filler", api.crew.bus.subjects.prefix());
    for i in 0..2100 {
        let (bus, subject) = (api.crew.bus.clone(), filler.clone());
        tokio::spawn(async move {
            let _ = bus.publish(subject, &format!("filler-{i}"), "application/json", None, "{}".into()).await;
        });
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Full: a request cannot even be queued (one that could would time out waiting for its
    // reply within the client's 10 s, and the test would prove nothing).
    let queued = tokio::time::timeout(
        Duration::from_secs(12),
        api.crew.bus.js.get_stream(api.crew.bus.subjects.approvals_stream()),
    )
    .await;
    assert!(queued.is_err(), "the client's queue is not full: {:?}", queued.map(|r| r.map(|_| ())));
    let asked = std::time::Instant::now();
    let (status, body) = api.post(&format!("/v1/runs/{run}/approve"), "ann", &json!({"plan_hash": plan_hash})).await?;
    let took = asked.elapsed();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(took < Duration::from_secs(15), "answered after {took:?}");
    assert!(body["error"].as_str().unwrap_or_default().contains("NATS"), "{body}");
    api.crew.env.nats.restart()?;
    // What the client held goes out; the run must still wait for a decision.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let db = api.crew.db().await?;
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1", &[&run]).await?.get(0);
    assert_eq!(status, "waiting_approval");
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    Ok(())
}
