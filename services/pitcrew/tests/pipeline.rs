//! End to end against a real nats-server and a fresh Postgres database per test: the
//! remediation graph's paths (resolve, forbid, approve, deny, retry to the limit), dedup.

mod common;

use common::{count, marker_service, sample, scrape, texts, write, Crew, WAIT};
use pitcrew::cli::{self, DecisionInput};
use pitcrew_model::{ApprovalDecision, Decision, EventKind, Stage};
use pitcrew_testkit::TestEnv;

/// A user playbook whose rules name the test's own commands.
const PLAYBOOK: &str = r#"
[[rule]]
name = "wiped"
match = "(?i)disk wiped"
diagnosis = "{service} lost its data disk"
plans = [["rm -rf /"]]

[[rule]]
name = "locked"
match = "(?i)stale lock"
diagnosis = "{service} is held by a stale lock"
plans = [["rm -f {dir}/svc.lock", "touch {dir}/svc-healthy"]]

[[rule]]
name = "slow"
match = "(?i)needs a slow fix"
diagnosis = "{service} needs a slow fix"
plans = [["{dir}/slow-fix"]]

[[rule]]
name = "cursed"
match = "(?i)cursed"
diagnosis = "{service} is cursed"
plans = [["mkdir {dir}/try-1"], ["mkdir {dir}/try-2"], ["mkdir {dir}/try-3"], ["mkdir {dir}/try-4"]]
"#;

/// A decision as any client of the bridge subject may publish it (channel `script`), past
/// every check the CLI and the HTTP API make.
fn scripted(run: uuid::Uuid, decision: Decision, by: &str, reason: Option<String>) -> ApprovalDecision {
    ApprovalDecision {
        run_id: run,
        decision,
        by: by.into(),
        plan_hash: None,
        reason,
        channel: "script".into(),
        decided_at: chrono::Utc::now(),
    }
}

/// Publish `d` on its run's bridge subject as a plain NATS message.
async fn publish_raw(crew: &Crew, d: &ApprovalDecision) -> anyhow::Result<()> {
    crew.bus.client.publish(crew.bus.subjects.approval_decided(d.run_id), serde_json::to_vec(d)?.into()).await?;
    Ok(())
}

async fn crew_with_playbook(extra: &str) -> anyhow::Result<Crew> {
    let env = TestEnv::start().await?;
    let book = write(&env, "playbook.toml", PLAYBOOK);
    let svc = marker_service(&env, "svc");
    let text = format!("[reasoning]\nplaybook_file = \"{book}\"\n{svc}{extra}");
    Crew::start_in(env, &text, &Stage::ALL).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incident_is_resolved_end_to_end_with_episode_and_evaluation() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    let run = crew.open("svc", "GET /health: connection refused").await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    assert!(std::path::Path::new(&crew.env.path("svc-healthy")).exists());
    let db = crew.db().await?;
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1", &[&run]).await?.get(0);
    assert_eq!(status, "resolved");
    let ep = db.query_one("SELECT success, commands, attempt FROM episodes WHERE run_id = $1", &[&run]).await?;
    assert!(ep.get::<_, bool>(0));
    assert_eq!(ep.get::<_, Vec<String>>(1), vec![format!("touch {}", crew.env.path("svc-healthy"))]);
    let ev = db.query_one("SELECT verdict, score, checks FROM evaluations WHERE run_id = $1", &[&run]).await?;
    assert_eq!(ev.get::<_, String>(0), "pass");
    assert!(ev.get::<_, f64>(1) >= 0.7);
    assert_eq!(ev.get::<_, serde_json::Value>(2).as_array().map(Vec::len), Some(7));
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1 AND status = 'succeeded'", run).await, 1);
    // The timeline is stored, in order, one step per stage visited; a clean first delivery
    // of attempt 1 has no start line, so the one status line is intake's.
    let steps =
        texts(&db, "SELECT stage FROM run_events WHERE run_id = $1 GROUP BY seq, stage ORDER BY seq", run).await;
    assert_eq!(steps, ["intake", "diagnose", "plan", "evaluate", "approval", "execute", "verify", "report"]);
    let status =
        texts(&db, "SELECT message FROM run_events WHERE run_id = $1 AND kind = 'status' ORDER BY seq, idx", run).await;
    assert_eq!(status.len(), 1, "{status:?}");
    assert!(status[0].starts_with("run opened for svc"), "{status:?}");
    crew.shutdown().await
}

/// Output with NUL bytes (`/proc/*/cmdline` separates its words with them) is evidence like
/// any other: Postgres takes neither NUL in `text` nor `\u0000` in `jsonb`, and the run that
/// held it could never be stored (diagnose retried it until it was dead-lettered). So is an
/// incident whose JSON error carries `\u0000`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_and_incidents_with_nul_bytes_are_kept_and_the_run_resolves() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let book = write(&env, "playbook.toml", PLAYBOOK);
    let svc = marker_service(&env, "svc");
    let text = format!("[reasoning]\nplaybook_file = \"{book}\"\n{svc}evidence = [\"cat /proc/self/cmdline\"]\n");
    let mut crew = Crew::start_in(env, &text, &Stage::ALL).await?;
    let run = crew.open("svc", "GET /health: connection refused\u{0}after deploy").await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    let db = crew.db().await?;
    let kept: String = db
        .query_one(
            "SELECT e->>'output' FROM runs, jsonb_array_elements(state->'evidence') e \
             WHERE id = $1 AND e->>'detail' LIKE '%cmdline%'",
            &[&run],
        )
        .await?
        .get(0);
    assert!(kept.starts_with("cat\u{FFFD}/proc/self/cmdline"), "{kept:?}");
    let error: String = db.query_one("SELECT error FROM incidents WHERE id = $1", &[&run]).await?.get(0);
    assert_eq!(error, "GET /health: connection refused\u{FFFD}after deploy");
    crew.shutdown().await
}

/// The `pitcrew` binary run against the crew's config (and not an outer `DATABASE_URL`):
/// its exit code, standard output and standard error.
async fn pitcrew_cli(config: &std::path::Path, args: &[&str]) -> anyhow::Result<(Option<i32>, String, String)> {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pitcrew"))
        .arg("--config")
        .arg(config)
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .await?;
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    Ok((out.status.code(), text(&out.stdout), text(&out.stderr)))
}

/// `pitcrew watch` says how the run ended in its exit status, for the script or CI job that
/// opened the incident: 0 resolved, 3 escalated, 1 for no such run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_exits_with_how_the_run_ended() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    let fixed = crew.open("svc", "GET /health: connection refused").await?;
    let refused = crew.open_with("svc", "disk wiped", Some("wiped".into())).await?;
    for run in [fixed, refused] {
        crew.events.terminal(run, WAIT).await?;
    }
    let config = crew.config_file()?;
    let watch = |run: uuid::Uuid| {
        let config = config.clone();
        async move {
            let (code, out, _) = pitcrew_cli(&config, &["watch", &run.to_string(), "--timeout", "30"]).await?;
            anyhow::Ok((code, out))
        }
    };
    let (code, out) = watch(fixed).await?;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.ends_with("outcome: resolved\n"), "{out}");
    let (code, out) = watch(refused).await?;
    assert_eq!(code, Some(3), "{out}");
    assert!(out.ends_with("outcome: escalated\n"), "{out}");
    assert_eq!(watch(uuid::Uuid::new_v4()).await?.0, Some(1), "no such run is an error, not an outcome");
    // A timeout past any deadline is as good as none: the run's end, not a panic.
    let (code, out, err) =
        pitcrew_cli(&config, &["watch", &fixed.to_string(), "--timeout", &u64::MAX.to_string()]).await?;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(!err.contains("panicked"), "{err}");
    crew.shutdown().await
}

/// An alert's text reaches the operator's terminal through `watch`, `show` and `incidents`:
/// escape sequences in it (conceal the rest, set the clipboard, go back to the line's start)
/// are printed as inert text, never sent to the terminal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_prints_escape_sequences_from_an_alert_as_text() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    let hostile = "GET /health: connection refused\u{1b}]52;c;cm0=\u{7}\u{1b}[8m\r\nplan: fake\u{9b}2J";
    let run = crew.open("svc", hostile).await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    let config = crew.config_file()?;
    let id = run.to_string();
    for args in [&["watch", id.as_str(), "--timeout", "30"][..], &["show", id.as_str()], &["incidents"]] {
        let (code, out, err) = pitcrew_cli(&config, args).await?;
        assert_eq!(code, Some(0), "{args:?}: {out}{err}");
        for c in ['\u{1b}', '\u{7}', '\r', '\u{9b}'] {
            assert!(!out.contains(c), "{args:?} printed {c:?} raw: {out:?}");
        }
        assert!(out.contains(r"refused\u{1b}]52;c;cm0=\u{7}\u{1b}[8m\r\nplan: fake\u{9b}2J"), "{args:?}: {out}");
    }
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forbidden_plan_is_escalated_and_nothing_runs() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    let run = crew.open("svc", "disk wiped").await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Escalated);
    assert!(end.message.contains("policy rejected `rm -rf /`"), "{}", end.message);
    assert!(end.message.contains("rm-system-path"), "the reason names the rule: {}", end.message);
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1", &[&run]).await?.get(0);
    assert_eq!(status, "escalated");
    crew.shutdown().await
}

/// A run nothing will move any more holds its fingerprint: `pitcrew abandon` closes it as
/// escalated, by an approver and for a reason, denies what it waited on, and the next
/// incident with the fingerprint opens a run of its own instead of being folded into it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_run_frees_its_fingerprint_for_the_next_incident() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    let fp = Some("stale-lock-fp".to_string());
    let run = crew.open_with("svc", "stale lock held", fp.clone()).await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    let folded = crew.open_with("svc", "stale lock held", fp.clone()).await?;
    assert_eq!(crew.events.terminal(folded, WAIT).await?.kind, EventKind::Duplicate, "folded into the parked run");
    let config = crew.config_file()?;
    let id = run.to_string();
    // Only an approver, with a reason.
    let (code, _, err) = pitcrew_cli(&config, &["abandon", &id, "--by", "mallory", "--reason", "x"]).await?;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("mallory"), "{err}");
    // Not while a command of it may still be running: its target would be free beside it.
    let db = crew.db().await?;
    db.execute(
        "INSERT INTO executions (run_id, attempt, idx, command, host, worker, gone_by, started)
         VALUES ($1, 9, 0, 'systemctl restart svc', 'box', 'w', now() + interval '1 minute', true)",
        &[&run],
    )
    .await?;
    let (code, _, err) = pitcrew_cli(&config, &["abandon", &id, "--by", "carol", "--reason", "gone"]).await?;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("may still be running `systemctl restart svc` on box"), "{err}");
    db.execute(
        "UPDATE executions SET gone_by = now() - interval '1 second' WHERE run_id = $1 AND attempt = 9",
        &[&run],
    )
    .await?;
    let (code, said, err) =
        pitcrew_cli(&config, &["abandon", &id, "--by", "carol", "--reason", "host decommissioned"]).await?;
    assert_eq!(code, Some(0), "{said}{err}");
    assert!(said.contains("closed by carol: host decommissioned"), "{said}");
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Escalated, "the end on the bus, for followers: {}", end.message);
    assert!(end.message.contains("closed by carol: host decommissioned"), "{}", end.message);
    let (status, reason): (String, String) =
        db.query_one("SELECT status, reason FROM runs WHERE id = $1", &[&run]).await.map(|r| (r.get(0), r.get(1)))?;
    assert_eq!(status, "escalated");
    assert!(reason.contains("host decommissioned"), "{reason}");
    let denied = count(&db, "SELECT count(*) FROM approvals WHERE run_id = $1 AND decision = 'deny'", run).await;
    assert_eq!(denied, 1, "what it waited on is no longer pending");
    assert_eq!(crew.cli(&["approvals"])?.trim(), "no pending approvals");
    let ran = count(&db, "SELECT count(*) FROM executions WHERE run_id = $1 AND attempt <> 9", run).await;
    assert_eq!(ran, 0, "nothing ran but the command written in by hand");
    // Closed once: a second time says so.
    let (code, _, err) = pitcrew_cli(&config, &["abandon", &id, "--by", "carol", "--reason", "again"]).await?;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("is escalated already"), "{err}");
    // The fingerprint is free: the next incident opens a run of its own.
    let next = crew.open_with("svc", "stale lock held", fp).await?;
    let asked = crew.events.kind(next, EventKind::ApprovalRequested, WAIT).await?;
    assert_eq!(asked.run_id, next);
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1", &[&next]).await?.get(0);
    assert_eq!(status, "waiting_approval");
    assert_eq!(crew.dead_letters().await?, 0);
    // Nothing here is a day old: pruning keeps it all, and says so.
    let (code, said, err) = pitcrew_cli(&config, &["prune", "--older-than-days", "1"]).await?;
    assert_eq!(code, Some(0), "{err}");
    assert!(said.contains(": 0 closed runs, 0 incidents without a run, 0 gateway audit lines"), "{said}");
    assert_eq!(count(&db, "SELECT count(*) FROM runs WHERE id = $1", run).await, 1);
    let (code, _, err) = pitcrew_cli(&config, &["prune", "--older-than-days", "0"]).await?;
    assert_eq!(code, Some(2), "a cutoff of now is refused: {err}");
    // A reader names a database that does not exist: an error saying so, and none is created.
    let missing = format!("pitcrew_missing_{}", uuid::Uuid::new_v4().simple());
    let elsewhere = crew.env.path("elsewhere.toml");
    let url = format!("{}/{missing}", pitcrew_testkit::admin_url().rsplit_once('/').unwrap().0);
    std::fs::write(&elsewhere, format!("[database]\nurl = \"{url}\"\n"))?;
    let (code, _, err) = pitcrew_cli(std::path::Path::new(&elsewhere), &["incidents"]).await?;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("does not exist"), "{err}");
    let created: i64 = db.query_one("SELECT count(*) FROM pg_database WHERE datname = $1", &[&missing]).await?.get(0);
    assert_eq!(created, 0, "a reader creates no database");
    // A cutoff inside episodic memory's window would delete failures open runs still read.
    let week = crew.env.path("week.toml");
    std::fs::write(&week, "[limits]\nmemory_window_secs = 604800\n")?;
    let (code, _, err) = pitcrew_cli(std::path::Path::new(&week), &["prune", "--older-than-days", "3"]).await?;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("keep at least 7 days"), "{err}");
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_critical_plan_parks_until_approved_then_runs() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    let run = crew.open("svc", "stale lock held").await?;
    let asked = crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    assert!(asked.message.contains("waiting for approval"), "{}", asked.message);
    let db = crew.db().await?;
    // Parked: waiting, nothing executed, the request stored and on the bridge stream.
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1", &[&run]).await?.get(0);
    assert_eq!(status, "waiting_approval");
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    let req = cli::approval_request(&crew.bus, run).await?;
    assert_eq!(req.plan.len(), 2);
    assert!(req.rule.contains("rm"), "{}", req.rule);
    // Someone not under [approvers], straight on the bridge subject: refused, nothing changes.
    let forged = ApprovalDecision {
        plan_hash: Some(req.plan_hash.clone()),
        ..scripted(run, Decision::Approve, "mallory", None)
    };
    publish_raw(&crew, &forged).await?;
    let refused = crew.events.wait(run, |e| e.kind == EventKind::Error && e.message.contains("refused"), WAIT).await?;
    assert!(refused.message.contains("mallory is not a configured approver"), "{}", refused.message);
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1", &[&run]).await?.get(0);
    assert_eq!(status, "waiting_approval");
    assert_eq!(count(&db, "SELECT count(*) FROM approvals WHERE run_id = $1 AND decision IS NOT NULL", run).await, 0);
    let pending = crew.cli(&["approvals"])?;
    let line = pending.lines().find(|l| l.starts_with(&run.to_string())).unwrap_or_default();
    assert!(line.contains(" rm ") && line.contains(&req.plan[0]), "{pending}");
    let attempt = line.split_whitespace().nth(1).unwrap_or_default();
    assert_eq!(attempt, "1", "the attempt that asks: {pending}");
    assert_eq!(line.split_whitespace().nth(2), Some(req.plan_hash.as_str()), "what --plan binds to: {pending}");
    // An approval read off another attempt's request (the run asked again, the same plan
    // included) is refused too.
    let (code, _, err) = pitcrew_cli(
        &crew.config_file()?,
        &["approve", &run.to_string(), "--by", "ann", "--plan", &req.plan_hash, "--attempt", "2"],
    )
    .await?;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("stale request: this one was for attempt 2"), "{err}");
    // An approval naming another plan than the one the run waits on (the one the operator read,
    // since replaced) is refused, and changes nothing.
    let (code, _, err) =
        pitcrew_cli(&crew.config_file()?, &["approve", &run.to_string(), "--by", "ann", "--plan", "0000ffff"]).await?;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("stale plan: run {run} now waits on plan {}, not 0000ffff", req.plan_hash)), "{err}");
    assert_eq!(count(&db, "SELECT count(*) FROM approvals WHERE run_id = $1 AND decision IS NOT NULL", run).await, 0);
    let decided = chrono::Utc::now();
    let (code, said, err) = pitcrew_cli(
        &crew.config_file()?,
        &["approve", &run.to_string(), "--by", "ann", "--plan", &req.plan_hash, "--attempt", attempt],
    )
    .await?;
    assert_eq!(code, Some(0), "{said}{err}");
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    assert!(end.message.contains("approved by ann (policy rule rm)"), "the report names who and why: {}", end.message);
    let first: chrono::DateTime<chrono::Utc> =
        db.query_one("SELECT min(started_at) FROM executions WHERE run_id = $1", &[&run]).await?.get(0);
    let ms = (first - decided).num_microseconds().unwrap_or(0) as f64 / 1000.0;
    assert!(ms > 0.0, "the first command started after the decision: {ms} ms");
    eprintln!("decision published to first command started: {ms:.1} ms");
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1 AND status = 'succeeded'", run).await, 2);
    assert_eq!(crew.cli(&["approvals"])?.trim(), "no pending approvals");
    let shown = crew.cli(&["show", &run.to_string()])?;
    for want in ["run ", "resolved", "approval trail:", "approve by ann via cli", "executions:", &req.plan[0]] {
        assert!(shown.contains(want), "`pitcrew show` lacks {want:?}:\n{shown}");
    }
    assert!(shown.contains("needs approval by policy rule"), "the policy decision names its rule:\n{shown}");
    let who: String = db
        .query_one("SELECT decided_by FROM approvals WHERE run_id = $1 AND decision = 'approve'", &[&run])
        .await?
        .get(0);
    assert_eq!(who, "ann");
    assert!(!shown.contains("claims released"), "none was:\n{shown}");
    // A claim removed with nothing run under it is shown with why.
    db.execute(
        "INSERT INTO execution_releases (run_id, attempt, idx, command, host, worker, started, claimed_at, why)
         VALUES ($1, 1, 0, 'touch /tmp/x', 'local', 'w0', false, now(), 'never started')",
        &[&run],
    )
    .await?;
    let shown = crew.cli(&["show", &run.to_string()])?;
    assert!(
        shown.contains(
            "claims released, nothing run under them:\n  attempt 1 command 0  local  touch /tmp/x: never started"
        ),
        "{shown}"
    );
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fix_nothing_could_check_is_not_remembered_as_failed() -> anyhow::Result<()> {
    // A service without a health check: its fix runs, and verify cannot say whether it worked.
    let mut crew =
        Crew::start("[services.bare]\nhost = \"local\"\nstart = \"touch {dir}/bare-started\"\n", &Stage::ALL).await?;
    let first = crew.open_with("bare", "connection refused", Some("bare-1".into())).await?;
    let end = crew.end(first).await?;
    assert_eq!(end.kind, EventKind::Escalated, "{}", end.message);
    assert!(end.message.contains("no health check configured"), "{}", end.message);
    let db = crew.db().await?;
    assert!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", first).await > 0, "the fix ran");
    let failed: Vec<String> = db.query_one("SELECT commands FROM episodes WHERE run_id = $1", &[&first]).await?.get(0);
    assert!(failed.is_empty(), "nothing failed, so nothing is barred: {failed:?}");
    // The next outage may try the same fix again.
    let second = crew.open_with("bare", "connection refused", Some("bare-2".into())).await?;
    let end = crew.end(second).await?;
    assert!(end.message.contains("no health check configured"), "{}", end.message);
    assert!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", second).await > 0, "ran again");
    crew.shutdown().await
}

/// An approval whose run's transition keeps failing for a while (a lock, a serialization
/// failure: Postgres up all along) is retried until it goes through, whatever its deliveries.
/// Dead-lettered past the limits, the decision stayed recorded on its request, which then
/// took no other, and the run waited for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_whose_transition_fails_for_a_while_is_retried_not_dead_lettered() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("[stages]\nmax_deliveries = 1\npoison_after_secs = 1\n").await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    let db = crew.db().await?;
    db.batch_execute(&format!(
        "CREATE FUNCTION busy_run() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.id = '{run}' THEN RAISE EXCEPTION 'busy' USING ERRCODE = 'serialization_failure'; END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER busy_run BEFORE UPDATE ON runs FOR EACH ROW EXECUTE FUNCTION busy_run();"
    ))
    .await?;
    cli::submit(&crew.bus, Some(&crew.store), DecisionInput::cli(run, Decision::Approve, "ann", None, &crew.cfg))
        .await?;
    // Past both limits (a second delivery, a second old) several times over.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    assert_eq!(crew.dead_letters().await?, 0, "the decision was dead-lettered");
    db.batch_execute("DROP TRIGGER busy_run ON runs").await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    crew.shutdown().await
}

/// An approval whose events cannot reach the bus after its transition committed (a publish
/// that failed: here the events stream refuses a second message on the decision's subject)
/// is delivered again, and that delivery sends the decision's stored events, not only the run
/// on. It sent the run on alone: on the bus the run went from waiting to executing with no
/// word of who approved it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_whose_events_missed_the_bus_after_its_commit_sends_them_again() -> anyhow::Result<()> {
    use async_nats::jetstream::stream::DiscardPolicy;
    let mut crew = crew_with_playbook("").await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    let subject = crew.bus.subjects.event(run, EventKind::ApprovalDecided.as_str());
    let mut events = crew.bus.js.get_stream(crew.bus.subjects.events_stream()).await?;
    let kept = events.info().await?.config.clone();
    crew.bus.js.publish(subject.clone(), "taken".into()).await?.await?;
    crew.bus
        .js
        .update_stream(async_nats::jetstream::stream::Config {
            max_messages_per_subject: 1,
            discard: DiscardPolicy::New,
            discard_new_per_subject: true,
            ..kept.clone()
        })
        .await?;
    cli::submit(&crew.bus, Some(&crew.store), DecisionInput::cli(run, Decision::Approve, "ann", None, &crew.cfg))
        .await?;
    let committed = tokio::time::Instant::now() + WAIT;
    while crew.store.load_run(run).await?.map(|r| r.state.step) == Some(Stage::Approval) {
        anyhow::ensure!(tokio::time::Instant::now() < committed, "the approval never committed");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    events.purge().filter(subject.clone()).await?;
    crew.bus.js.update_stream(kept).await?;
    let decided = crew
        .store
        .timeline(run)
        .await?
        .into_iter()
        .find(|e| e.kind == EventKind::ApprovalDecided)
        .ok_or_else(|| anyhow::anyhow!("no decision stored"))?;
    assert!(decided.message.contains("approved by ann"), "{}", decided.message);
    let sent = tokio::time::Instant::now() + WAIT;
    while !crew.bus.holds_event(&decided).await? {
        anyhow::ensure!(tokio::time::Instant::now() < sent, "the stored decision never reached the bus");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    assert_eq!(crew.dead_letters().await?, 0);
    crew.shutdown().await
}

/// A publisher that sends decisions for a run over and over (a bot that never reads an
/// answer) puts a bounded number of notes on the run's timeline, which every read of the run
/// loads; the rest are logged. An approver's decision still decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_set_aside_over_and_over_put_a_bounded_number_of_notes_on_the_timeline() -> anyhow::Result<()> {
    use pitcrew_approval::decisions::MAX_DECISION_NOTES;
    let mut crew = crew_with_playbook("").await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    let sent = MAX_DECISION_NOTES + 40;
    for _ in 0..sent {
        publish_raw(&crew, &scripted(run, Decision::Approve, "mallory", None)).await?;
    }
    let db = crew.db().await?;
    let notes = "SELECT count(*) FROM run_events WHERE run_id = $1 AND stage = 'approval' AND kind = 'error'";
    let mut consumer = crew
        .bus
        .js
        .get_stream(crew.bus.subjects.approvals_stream())
        .await?
        .get_consumer::<async_nats::jetstream::consumer::pull::Config>(pitcrew_runtime::bus::DECISIONS_CONSUMER)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let handled = tokio::time::Instant::now() + WAIT;
    loop {
        let info = consumer.info().await?;
        if info.num_pending == 0 && info.num_ack_pending == 0 && info.delivered.stream_sequence > 0 {
            break;
        }
        anyhow::ensure!(tokio::time::Instant::now() < handled, "the decisions were not all handled: {info:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let noted = count(&db, notes, run).await;
    assert!(noted >= MAX_DECISION_NOTES && noted < sent, "{noted} notes of {sent} decisions set aside");
    // The CLI refuses to add to so many decisions since the request; a client of the bridge
    // subject may still.
    publish_raw(&crew, &scripted(run, Decision::Approve, "ann", None)).await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    assert_eq!(crew.dead_letters().await?, 0);
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_plan_is_escalated_and_nothing_runs() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    let deny = DecisionInput::cli(run, Decision::Deny, "bob", Some("not during the sale".into()), &crew.cfg);
    cli::submit(&crew.bus, Some(&crew.store), deny).await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Escalated);
    assert!(end.message.contains("denied by bob: not during the sale"), "{}", end.message);
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    // A late approval of the same plan changes nothing: the CLI refuses it, and a decision
    // published by any other client is ignored by the crew.
    let refused =
        cli::submit(&crew.bus, Some(&crew.store), DecisionInput::cli(run, Decision::Approve, "carol", None, &crew.cfg))
            .await
            .unwrap_err();
    assert!(refused.to_string().contains("already decided: deny by bob"), "{refused}");
    let late = scripted(run, Decision::Approve, "carol", None);
    publish_raw(&crew, &late).await?;
    crew.events
        .wait(run, |e| e.kind == EventKind::Error && e.message.contains("not waiting for an approval"), WAIT)
        .await?;
    // Naming the plan explicitly: the request was already settled.
    let named = ApprovalDecision { plan_hash: Some(cli::approval_request(&crew.bus, run).await?.plan_hash), ..late };
    publish_raw(&crew, &named).await?;
    crew.events
        .wait(run, |e| e.kind == EventKind::Error && e.message.contains("already decided (deny by bob)"), WAIT)
        .await?;
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denial_whose_reason_holds_a_nul_byte_stops_the_plan() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    // Any publisher on the bridge subject (a bot, a script, the HTTP API): Postgres takes no
    // NUL in text, and a denial it refused to record was dead-lettered while the run waited
    // on for someone else's approval.
    let deny = scripted(run, Decision::Deny, "bob", Some(format!("no\0t now{}", "!".repeat(2000))));
    publish_raw(&crew, &deny).await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Escalated, "{}", end.message);
    assert!(end.message.contains("denied by bob: no\u{FFFD}t now!!!"), "{}", end.message);
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    let reason: String = db.query_one("SELECT reason FROM approvals WHERE run_id = $1", &[&run]).await?.get(0);
    assert!(
        reason.starts_with("no\u{FFFD}t now") && reason.len() < 1100,
        "kept, cut to the limit: {} bytes",
        reason.len()
    );
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_decision_racing_one_the_crew_has_not_recorded_yet_is_refused() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    // The crew is stopped: Ann's approval is on the bridge subject, not recorded yet.
    crew.shutdown().await?;
    let approve = DecisionInput::cli(run, Decision::Approve, "ann", None, &crew.cfg);
    cli::submit(&crew.bus, Some(&crew.store), approve).await?;
    // Carol's denial from a terminal would be ignored by the crew: she is told so, and who won.
    let deny = DecisionInput::cli(run, Decision::Deny, "carol", Some("wait".into()), &crew.cfg);
    let refused = cli::submit(&crew.bus, Some(&crew.store), deny).await.unwrap_err();
    let why = refused.to_string();
    assert!(why.contains("already decided: approve by ann via cli") && why.contains("being recorded"), "{why}");
    // Nothing of hers reached the bridge subject: the last decision there is still Ann's.
    let stream = crew.bus.js.get_stream(crew.bus.subjects.approvals_stream()).await?;
    let last = stream.get_last_raw_message_by_subject(&crew.bus.subjects.approval_decided(run)).await?;
    let last: ApprovalDecision = serde_json::from_slice(&last.payload)?;
    assert_eq!((last.by.as_str(), last.decision), ("ann", Decision::Approve));
    // Restarted, the crew records Ann's approval and runs the plan.
    crew.run(&Stage::ALL);
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    crew.shutdown().await
}

/// Two deciders at the same moment (a chat click and a terminal, the crew not yet recording
/// either): exactly one decision is published and told so; the other is refused, naming it,
/// never told "denied" for a plan that runs. Over several runs, each pair started together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_decisions_at_the_same_moment_publish_exactly_one() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    let mut runs = Vec::new();
    for i in 0..8 {
        runs.push(crew.open_with("svc", "stale lock held", Some(format!("race-{i}"))).await?);
    }
    for run in &runs {
        crew.events.kind(*run, EventKind::ApprovalRequested, WAIT).await?;
    }
    crew.shutdown().await?;
    let subject_count = |run: uuid::Uuid| {
        let bus = crew.bus.clone();
        async move {
            let stream = bus.js.get_stream(bus.subjects.approvals_stream()).await?;
            let info = stream.info_with_subjects(bus.subjects.approval_decided(run)).await?;
            let mut n = 0;
            futures::pin_mut!(info);
            while let Some(s) = futures::StreamExt::next(&mut info).await {
                n += s?.1;
            }
            anyhow::Ok(n)
        }
    };
    for run in &runs {
        let approve = DecisionInput::cli(*run, Decision::Approve, "ann", None, &crew.cfg);
        let deny = DecisionInput::cli(*run, Decision::Deny, "carol", Some("wait".into()), &crew.cfg);
        let (a, d) = tokio::join!(
            cli::submit(&crew.bus, Some(&crew.store), approve),
            cli::submit(&crew.bus, Some(&crew.store), deny)
        );
        let (won, lost) = match (a, d) {
            (Ok(_), Err(e)) => ("approve by ann", e),
            (Err(e), Ok(_)) => ("deny by carol", e),
            (a, d) => panic!("run {run}: exactly one decision goes: {a:?} / {d:?}"),
        };
        let why = lost.to_string();
        assert!(why.contains(&format!("already decided: {won} via cli")), "{why}");
        assert_eq!(subject_count(*run).await?, 1, "one decision on the subject of run {run}");
    }
    crew.shutdown().await
}

/// Under a two-person rule, two approvals the crew has not recorded yet make the quorum: a
/// denial after them would be ignored (the plan runs), so it is refused, naming both
/// approvers, rather than answered "denied".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denial_after_a_quorum_of_approvals_not_yet_recorded_is_refused() -> anyhow::Result<()> {
    let (mut crew, run) = waiting_for_two_approvers().await?;
    crew.shutdown().await?;
    for by in ["ann", "bob"] {
        cli::submit(&crew.bus, Some(&crew.store), DecisionInput::cli(run, Decision::Approve, by, None, &crew.cfg))
            .await?;
    }
    let deny = DecisionInput::cli(run, Decision::Deny, "carol", Some("no".into()), &crew.cfg);
    let why = cli::submit(&crew.bus, Some(&crew.store), deny).await.unwrap_err().to_string();
    assert!(why.contains("already approved by ann, bob (2 of 2 approvals, being recorded)"), "{why}");
    crew.run(&Stage::ALL);
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "the quorum ran the plan: {}", end.message);
    crew.shutdown().await
}

/// Under a two-person rule an approver who voted and thinks better of it may still deny,
/// before the quorum is met, whether the crew recorded the vote or not: the denial stops the
/// plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approver_may_deny_after_their_own_vote_until_the_quorum_is_met() -> anyhow::Result<()> {
    let (mut crew, run) = waiting_for_two_approvers().await?;
    crew.shutdown().await?;
    cli::submit(&crew.bus, Some(&crew.store), DecisionInput::cli(run, Decision::Approve, "ann", None, &crew.cfg))
        .await?;
    let deny = DecisionInput::cli(run, Decision::Deny, "ann", Some("wrong lock file".into()), &crew.cfg);
    cli::submit(&crew.bus, Some(&crew.store), deny).await?;
    crew.run(&Stage::ALL);
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Escalated, "{}", end.message);
    assert!(end.message.contains("plan denied by ann: wrong lock file"), "{}", end.message);
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0, "the plan never ran");
    crew.shutdown().await
}

/// The playbook's slow fix: two seconds between its start and its end, each written to
/// `fix.log`; a second copy started while one runs fails at once (so interleaved runs show in
/// the log). It makes the service healthy when `heals`.
fn slow_fix(env: &pitcrew_testkit::TestEnv, heals: bool) {
    let heal = if heals { "touch {dir}/svc-healthy\n" } else { "" };
    fix_script(
        env,
        &format!(
            "#!/bin/sh\nmkdir {{dir}}/fixing || exit 1\necho start >> {{dir}}/fix.log\nsleep 2\n\
             echo end >> {{dir}}/fix.log\nrmdir {{dir}}/fixing\n{heal}"
        ),
    );
}

/// Write the playbook's `slow-fix` script (`{dir}` replaced) and make it executable.
fn fix_script(env: &pitcrew_testkit::TestEnv, script: &str) {
    use std::os::unix::fs::PermissionsExt;
    let path = write(env, "slow-fix", script);
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

/// Open two runs of `svc` with the slow fix's incident (different fingerprints) and wait for
/// both to end as `kind`; returns them and their terminal messages.
async fn two_runs_of_svc(
    crew: &mut Crew,
    kind: EventKind,
) -> anyhow::Result<(uuid::Uuid, uuid::Uuid, std::collections::HashMap<uuid::Uuid, String>)> {
    let a = crew.open_with("svc", "svc needs a slow fix", Some("fp-a".into())).await?;
    let b = crew.open_with("svc", "svc needs a slow fix", Some("fp-b".into())).await?;
    let mut said = std::collections::HashMap::new();
    for run in [a, b] {
        let end = crew.events.terminal(run, WAIT).await?;
        assert_eq!(end.kind, kind, "{}", end.message);
        said.insert(run, end.message);
    }
    Ok((a, b, said))
}

/// The status lines a run's execute steps said, in order.
async fn execute_said(db: &tokio_postgres::Client, run: uuid::Uuid) -> Vec<String> {
    texts(
        db,
        "SELECT message FROM run_events WHERE run_id = $1 AND kind = 'status' AND stage = 'execute' ORDER BY seq, idx",
        run,
    )
    .await
}

/// Two runs of one service at once (their incidents' fingerprints differ: the monitor's and
/// Alertmanager's, say) with a fix that works: the second waits while the first executes and
/// verifies, and then runs nothing, since the service its diagnosis saw failing passes now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_run_of_a_service_waits_for_the_first_and_runs_nothing_once_it_is_fixed() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    slow_fix(&crew.env, true);
    let (a, b, summaries) = two_runs_of_svc(&mut crew, EventKind::Resolved).await?;
    assert_eq!(std::fs::read_to_string(crew.env.path("fix.log"))?, "start\nend\n", "the fix ran once");
    let db = crew.db().await?;
    let ran = |run| count(&db, "SELECT count(*) FROM executions WHERE run_id = $1 AND status = 'succeeded'", run);
    let (first, second) = if ran(a).await == 1 { (a, b) } else { (b, a) };
    assert_eq!((ran(first).await, ran(second).await), (1, 0));
    // The second's plan is recorded as not run, in Postgres (a redelivery finds it decided).
    let skipped = texts(&db, "SELECT output FROM executions WHERE run_id = $1 AND status = 'skipped'", second).await;
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    let why = format!("not run: run {first} remediated svc on local since this run opened, and its check passes now");
    assert!(skipped[0].starts_with(&why), "{skipped:?}");
    let said = execute_said(&db, second).await;
    assert!(said.iter().any(|m| m.starts_with(&why)), "{said:?}");
    // It waited: its execute message was naked until the first had verified; its timeline
    // says so once, with who it waited for.
    assert!(said.iter().any(|m| m.starts_with("execute: attempt 1, delivery ")), "{said:?}");
    let waits: Vec<_> = said.iter().filter(|m| m.starts_with("execute waits: ")).collect();
    assert_eq!(waits, [&format!("execute waits: svc on local: run {first} is remediating it")], "{said:?}");
    let at = |prefix: &str| said.iter().position(|m| m.starts_with(prefix));
    assert!(at("execute waits: ") < at(&why), "the wait comes first on the timeline: {said:?}");
    let summary = &summaries[&second];
    assert!(summary.contains(&format!("ran nothing (run {first} remediated svc")), "{summary}");
    assert_eq!(count(&db, "SELECT count(*) FROM episodes WHERE run_id = $1", second).await, 0, "it tried nothing");
    crew.shutdown().await
}

/// The same with a fix that does not work: the second run still waits for the first, finds
/// the service failing, and runs its plan after the first's, never beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_run_of_a_service_runs_its_plan_after_the_first_not_beside_it() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("[limits]\nmax_retries = 1\n").await?;
    slow_fix(&crew.env, false);
    let (a, b, _) = two_runs_of_svc(&mut crew, EventKind::Escalated).await?;
    let log = std::fs::read_to_string(crew.env.path("fix.log"))?;
    assert_eq!(log, "start\nend\nstart\nend\n", "one after the other");
    let db = crew.db().await?;
    for run in [a, b] {
        assert_eq!(
            count(&db, "SELECT count(*) FROM executions WHERE run_id = $1 AND status = 'succeeded'", run).await,
            1
        );
    }
    let db = &db;
    let still = |run| async move {
        execute_said(db, run)
            .await
            .into_iter()
            .find(|m| m.contains("its check still fails") && m.ends_with("running the plan"))
    };
    let (first, second) = if still(a).await.is_none() { (a, b) } else { (b, a) };
    let said = still(second).await.unwrap_or_default();
    assert!(said.starts_with(&format!("run {first} remediated svc on local since this run opened")), "{said}");
    assert!(still(first).await.is_none());
    crew.shutdown().await
}

/// A storm of runs of one service (many incidents with different fingerprints at once): at
/// most 16 wait for the target; the others escalate at once rather than queue, each saying
/// why. The fix runs once, and the waiters run nothing after it. (The fix holds on until every
/// run has reached execute, whatever the machine's speed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_sixteen_runs_waiting_for_one_target_the_next_escalates() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    fix_script(
        &crew.env,
        "#!/bin/sh\necho start >> {dir}/fix.log\nwhile [ ! -f {dir}/release ]; do sleep 0.1; done\n\
         echo end >> {dir}/fix.log\ntouch {dir}/svc-healthy\n",
    );
    const RUNS: i64 = 24;
    let mut runs = Vec::new();
    for i in 0..RUNS {
        runs.push(crew.open_with("svc", "svc needs a slow fix", Some(format!("storm-{i}"))).await?);
    }
    // Release the fix once one run holds the target, 16 wait and the rest were turned away.
    let db = crew.db().await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let row = db
            .query_one(
                "SELECT (SELECT count(*) FROM runs WHERE status = 'open' AND stage = 'execute'), \
                        (SELECT count(*) FROM runs WHERE status = 'escalated')",
                &[],
            )
            .await?;
        let (at_execute, escalated): (i64, i64) = (row.get(0), row.get(1));
        if at_execute == 17 && escalated == RUNS - 17 {
            break;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "{at_execute} at execute, {escalated} escalated");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    std::fs::write(crew.env.path("release"), "")?;
    let (mut resolved, mut turned_away) = (0, 0);
    for run in runs {
        let end = crew.events.terminal(run, WAIT).await?;
        match end.kind {
            EventKind::Resolved => resolved += 1,
            EventKind::Escalated if end.message.contains("runs are already waiting to remediate svc on local") => {
                turned_away += 1
            }
            _ => panic!("{:?}: {}", end.kind, end.message),
        }
    }
    assert_eq!((resolved, turned_away), (17, RUNS - 17));
    assert_eq!(std::fs::read_to_string(crew.env.path("fix.log"))?, "start\nend\n", "the fix ran once");
    // The turned-away runs' notes are gone once anyone looks at the target again; the
    // waiters' went as each took it.
    assert_eq!(db.query_one("SELECT count(*) FROM target_waits", &[]).await?.get::<_, i64>(0), 0);
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_that_never_recovers_escalates_after_exactly_max_retries() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("[limits]\nmax_retries = 3\n").await?;
    let run = crew.open("svc", "the service is cursed").await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Escalated);
    assert!(end.message.contains("after 3 attempt(s): max_retries (3)"), "{}", end.message);
    // The human is told every command that did not fix it, the last attempt's too.
    let failed = end.data["failed_commands"].as_array().cloned().unwrap_or_default();
    assert_eq!(failed.len(), 3, "{failed:?}");
    assert!(failed.iter().any(|c| c.as_str().is_some_and(|c| c.contains("try-3"))), "{failed:?}");
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(DISTINCT attempt) FROM executions WHERE run_id = $1", run).await, 3);
    assert_eq!(count(&db, "SELECT count(*) FROM episodes WHERE run_id = $1 AND NOT success", run).await, 3);
    // Each attempt ran a new command: never one that already failed.
    for i in 1..=3 {
        assert!(std::path::Path::new(&crew.env.path(&format!("try-{i}"))).is_dir());
    }
    assert!(!std::path::Path::new(&crew.env.path("try-4")).exists());
    // Each retry attempt is marked where it starts, the first is not.
    let starts = texts(
        &db,
        "SELECT message FROM run_events WHERE run_id = $1 AND kind = 'status' AND stage = 'diagnose' ORDER BY seq",
        run,
    )
    .await;
    assert_eq!(starts, ["diagnose: attempt 2", "diagnose: attempt 3"]);
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_open_run_per_fingerprint() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    let first = crew.open_with("svc", "stale lock held", Some("fp-1".into())).await?;
    crew.events.kind(first, EventKind::ApprovalRequested, WAIT).await?;
    let second = crew.open_with("svc", "stale lock held again", Some("fp-1".into())).await?;
    let dup = crew.events.terminal(second, WAIT).await?;
    assert_eq!(dup.kind, EventKind::Duplicate);
    assert!(dup.message.contains(&first.to_string()));
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(*) FROM runs WHERE id = $1", second).await, 0);
    // Once the first run ends, the fingerprint may open a new run.
    cli::submit(
        &crew.bus,
        Some(&crew.store),
        DecisionInput::cli(first, Decision::Deny, "bob", Some("no".into()), &crew.cfg),
    )
    .await?;
    crew.events.terminal(first, WAIT).await?;
    // The duplicate delivered again after the first run closed (its worker died before the
    // ack) stays a duplicate: its timeline already ended so, and it opened no run.
    let mut incident = pitcrew_model::Incident::new("svc", "stale lock held again");
    incident.id = Some(second);
    incident.fingerprint = Some("fp-1".into());
    let redelivered = pitcrew_model::RunState::new(second, incident);
    assert_eq!(crew.store.open_run(&redelivered).await?, pitcrew_runtime::store::OpenRun::Duplicate(first));
    assert_eq!(count(&db, "SELECT count(*) FROM runs WHERE id = $1", second).await, 0);
    let third = crew.open_with("svc", "stale lock held", Some("fp-1".into())).await?;
    crew.events.kind(third, EventKind::ApprovalRequested, WAIT).await?;
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_not_decided_in_time_escalates_the_run() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("[limits]\napproval_timeout_secs = 1\n").await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Escalated);
    assert!(end.message.contains("not decided within 1 s"), "{}", end.message);
    let db = crew.db().await?;
    let row = db.query_one("SELECT decision, channel FROM approvals WHERE run_id = $1", &[&run]).await?;
    assert_eq!((row.get::<_, String>(0).as_str(), row.get::<_, String>(1).as_str()), ("expire", "timeout"));
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    // The expiry names the attempt whose request it expires: held up until a later attempt
    // asked for the same plan again, it would not expire that one.
    let stream = crew.bus.js.get_stream(crew.bus.subjects.approvals_stream()).await?;
    let expired = stream.get_last_raw_message_by_subject(&crew.bus.subjects.approval_decided(run)).await?;
    assert_eq!(expired.headers.get(pitcrew_runtime::approvals::ATTEMPT_HEADER).map(|v| v.as_str()), Some("1"));
    crew.shutdown().await
}

/// A stopping approval worker's expiry sweeper stops with it at once, mid-sweep too: with NATS
/// gone each expiry's publish waits out its ack, and a sweep of many would hold the worker
/// past its drain deadline (and its orchestrator's grace period).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expiry_sweeper_stops_mid_sweep_when_told() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("[limits]\napproval_timeout_secs = 1\n").await?;
    for fp in ["fp-a", "fp-b", "fp-c"] {
        let run = crew.open_with("svc", "stale lock held", Some(fp.into())).await?;
        crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    }
    // The crew is stopped (so nothing expires them) until all three are past their deadline.
    crew.shutdown().await?;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let deps = std::sync::Arc::new(common::deps_of(&crew)?);
    crew.env.nats.kill();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let sweeper = tokio::spawn(pitcrew_approval::decisions::sweep_expired(
        crew.bus.clone(),
        deps,
        std::time::Duration::from_millis(10),
        async move {
            let _ = stopped.await;
        },
    ));
    // Mid-sweep: the three expired requests listed, the first expiry's publish waiting.
    tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
    assert!(!sweeper.is_finished(), "the sweeper ended before it was told to");
    let _ = stop.send(());
    tokio::time::timeout(std::time::Duration::from_secs(2), sweeper)
        .await
        .map_err(|_| anyhow::anyhow!("the sweeper went on publishing expiries after it was told to stop"))??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_arriving_after_the_deadline_expires_the_request_instead() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("[limits]\napproval_timeout_secs = 1\n").await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    // The crew is down past the deadline (so its sweeper expires nothing), and an approval
    // waits on the bridge subject for it.
    crew.shutdown().await?;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    // The CLI (and the HTTP API, and the chat bridges: they submit the same way) says so.
    let refused =
        cli::submit(&crew.bus, Some(&crew.store), DecisionInput::cli(run, Decision::Approve, "ann", None, &crew.cfg))
            .await
            .unwrap_err();
    assert!(refused.to_string().contains("expired at"), "{refused}");
    // A client that does not ask publishes it anyway.
    let late = scripted(run, Decision::Approve, "ann", None);
    publish_raw(&crew, &late).await?;
    crew.run(&Stage::ALL);
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Escalated, "{}", end.message);
    assert!(end.message.contains("not decided within 1 s"), "{}", end.message);
    crew.events
        .wait(
            run,
            |e| {
                e.kind == EventKind::Error
                    && e.message.contains("approve by ann via script refused: the request expired")
            },
            WAIT,
        )
        .await?;
    let db = crew.db().await?;
    let row = db.query_one("SELECT decision, channel FROM approvals WHERE run_id = $1", &[&run]).await?;
    assert_eq!((row.get::<_, String>(0).as_str(), row.get::<_, String>(1).as_str()), ("expire", "timeout"));
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0, "the plan never ran");
    crew.shutdown().await
}

/// A crew whose policy asks two approvers for `rm`, and a run waiting for them.
async fn waiting_for_two_approvers() -> anyhow::Result<(Crew, uuid::Uuid)> {
    let env = TestEnv::start().await?;
    let policy = write(
        &env,
        "policy.toml",
        "[[critical]]\nname = \"two-person-rm\"\nreason = \"deleting needs two people\"\npattern = '^rm\\s'\nquorum = 2\n",
    );
    let book = write(&env, "playbook.toml", PLAYBOOK);
    let svc = marker_service(&env, "svc");
    let text = format!("[reasoning]\nplaybook_file = \"{book}\"\n[policy]\nfile = \"{policy}\"\n{svc}");
    let mut crew = Crew::start_in(env, &text, &Stage::ALL).await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    Ok((crew, run))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_person_rule_runs_the_plan_only_after_two_distinct_approvers() -> anyhow::Result<()> {
    let (mut crew, run) = waiting_for_two_approvers().await?;
    let req = cli::approval_request(&crew.bus, run).await?;
    assert_eq!(req.quorum, 2, "{req:?}");
    let db = crew.db().await?;

    // `pitcrew approve` says the approval is one vote of two, not that the plan is approved.
    let (code, said, err) = pitcrew_cli(&crew.config_file()?, &["approve", &run.to_string(), "--by", "ann"]).await?;
    assert_eq!(code, Some(0), "{said}{err}");
    assert!(said.contains("is counted (1 of 2, by ann): it runs once 2 distinct approvers approve"), "{said}");
    crew.events.wait(run, |e| e.message.contains("approve by ann via cli counted: 1 of 2"), WAIT).await?;
    // The same approver again is still one approval (published straight to the subject).
    let again = ApprovalDecision {
        plan_hash: Some(req.plan_hash.clone()),
        channel: "chat".into(),
        ..scripted(run, Decision::Approve, "ann", None)
    };
    publish_raw(&crew, &again).await?;
    crew.events.wait(run, |e| e.message.contains("approve by ann via chat counted: 1 of 2"), WAIT).await?;
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1", &[&run]).await?.get(0);
    assert_eq!(status, "waiting_approval");
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);

    cli::submit(&crew.bus, Some(&crew.store), DecisionInput::cli(run, Decision::Approve, "bob", None, &crew.cfg))
        .await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    let voters = texts(&db, "SELECT approver FROM approval_votes WHERE run_id = $1 ORDER BY approver", run).await;
    assert_eq!(voters, ["ann", "bob"]);
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1 AND status = 'succeeded'", run).await, 2);
    crew.shutdown().await
}

/// Under a quorum an approval is one vote, not the decision: a second approver's denial right
/// after it is not refused as racing a decision ("already decided: approve by ann"), and it
/// stops the plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_two_person_rule_a_denial_right_after_one_approval_stops_the_plan() -> anyhow::Result<()> {
    let (mut crew, run) = waiting_for_two_approvers().await?;
    // `pitcrew approve` says the approval is one vote of two, not that the plan is approved.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pitcrew"))
        .arg("--config")
        .arg(crew.config_file()?)
        .args(["approve", &run.to_string(), "--by", "ann"])
        .env_remove("DATABASE_URL")
        .output()
        .await?;
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("is counted (1 of 2, by ann): it runs once 2 distinct approvers approve"), "{said}");
    crew.events.wait(run, |e| e.message.contains("approve by ann via cli counted: 1 of 2"), WAIT).await?;
    // Within the minute a published decision counts as in flight.
    let no = DecisionInput::cli(run, Decision::Deny, "bob", Some("not on a Friday".into()), &crew.cfg);
    cli::submit(&crew.bus, Some(&crew.store), no).await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Escalated, "{}", end.message);
    assert!(end.message.contains("denied by bob"), "{}", end.message);
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    crew.shutdown().await
}

/// The last two votes of a quorum counted at the same moment: one of them applies the
/// approval, the other finds the plan decided. Both are counted on the timeline; neither is
/// said to be ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_last_votes_at_once_are_both_counted_and_neither_ignored() -> anyhow::Result<()> {
    let (mut crew, run) = waiting_for_two_approvers().await?;
    let plan_hash = cli::approval_request(&crew.bus, run).await?.plan_hash;
    let db = crew.db().await?;
    // Both votes in (as two decisions handled at the same moment insert theirs before either
    // counts), and the request's row held: whichever decision comes first, each counts two
    // votes and waits to settle the request.
    let mut holder = crew.db().await?;
    let hold = holder.transaction().await?;
    hold.execute("SELECT 1 FROM approvals WHERE run_id = $1 FOR UPDATE", &[&run]).await?;
    db.execute(
        "INSERT INTO approval_votes (run_id, plan_hash, approver, channel)
         VALUES ($1, $2, 'ann', 'script'), ($1, $2, 'bob', 'script')",
        &[&run, &plan_hash],
    )
    .await?;
    for by in ["ann", "bob"] {
        let vote =
            ApprovalDecision { plan_hash: Some(plan_hash.clone()), ..scripted(run, Decision::Approve, by, None) };
        publish_raw(&crew, &vote).await?;
    }
    let blocked =
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()";
    let deadline = std::time::Instant::now() + WAIT;
    while db.query_one(blocked, &[]).await?.get::<_, i64>(0) < 2 {
        anyhow::ensure!(std::time::Instant::now() < deadline, "the two decisions never both waited to settle it");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    hold.commit().await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    let approval = "SELECT message FROM run_events WHERE run_id = $1 AND stage = 'approval' ORDER BY seq, idx";
    let said = texts(&db, approval, run).await;
    assert!(said.iter().all(|m| !m.contains("ignored")), "{said:?}");
    assert!(said.iter().any(|m| m.contains("counted: 2 of 2 approvals (the plan was approved with")), "{said:?}");
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1 AND status = 'succeeded'", run).await, 2);
    crew.shutdown().await
}

/// A decision answers one attempt's request: every channel stamps the attempt it checked, and
/// a vote for another attempt than the one the run waits on (published for attempt 1 just
/// before attempt 2 asked for the same plan again) is not counted toward the quorum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vote_for_another_attempt_than_the_one_waited_on_is_not_counted() -> anyhow::Result<()> {
    let (mut crew, run) = waiting_for_two_approvers().await?;
    let req = cli::approval_request(&crew.bus, run).await?;
    assert_eq!(req.attempt, 1);
    cli::submit(&crew.bus, Some(&crew.store), DecisionInput::cli(run, Decision::Approve, "ann", None, &crew.cfg))
        .await?;
    crew.events.wait(run, |e| e.message.contains("approve by ann via cli counted: 1 of 2"), WAIT).await?;
    // The CLI stamped the attempt of the request it decided.
    let stream = crew.bus.js.get_stream(crew.bus.subjects.approvals_stream()).await?;
    let decided = stream.get_last_raw_message_by_subject(&crew.bus.subjects.approval_decided(run)).await?;
    assert_eq!(decided.headers.get(pitcrew_runtime::approvals::ATTEMPT_HEADER).map(|v| v.as_str()), Some("1"));
    // Bob's vote for another attempt's request: ignored, with why.
    let other =
        ApprovalDecision { plan_hash: Some(req.plan_hash.clone()), ..scripted(run, Decision::Approve, "bob", None) };
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(pitcrew_runtime::approvals::ATTEMPT_HEADER, "2");
    crew.bus
        .client
        .publish_with_headers(crew.bus.subjects.approval_decided(run), headers, serde_json::to_vec(&other)?.into())
        .await?;
    let ignored = crew.events.wait(run, |e| e.message.starts_with("approve by bob ignored"), WAIT).await?;
    assert!(
        ignored.message.contains("answered the request of attempt 2, and the run now waits on attempt 1's"),
        "{}",
        ignored.message
    );
    let db = crew.db().await?;
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1", &[&run]).await?.get(0);
    assert_eq!(status, "waiting_approval", "one vote of two, not the quorum");
    assert_eq!(count(&db, "SELECT count(*) FROM approval_votes WHERE run_id = $1", run).await, 1);
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    // Bob's vote for the request the run waits on completes the quorum.
    cli::submit(&crew.bus, Some(&crew.store), DecisionInput::cli(run, Decision::Approve, "bob", None, &crew.cfg))
        .await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    crew.shutdown().await
}

/// The same plan asked for again by a later attempt (its commands were all skipped the first
/// time) is decided anew, however soon: the approver's second approval is neither refused as
/// racing the first (which answered the earlier request) nor dropped by the bus as its
/// duplicate (the same run, plan, decision and approver, within the bus's two-minute window),
/// which left the run waiting until its request expired while the approver was told it went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_plan_asked_for_again_by_a_later_attempt_is_approved_anew_at_once() -> anyhow::Result<()> {
    use futures::StreamExt;
    // No stage runs: the requests are published here, as the approval stage would.
    let crew = Crew::start("", &[]).await?;
    let run = uuid::Uuid::now_v7();
    let request = |attempt: u32| pitcrew_model::ApprovalRequest {
        run_id: run,
        service: "svc".into(),
        host: None,
        error: "down".into(),
        attempt,
        plan: vec!["systemctl restart svc".into()],
        plan_hash: "ab12".into(),
        risk: "critical".into(),
        rule: "restart".into(),
        diagnosis: "svc is down".into(),
        evidence: Vec::new(),
        requested_at: chrono::Utc::now(),
        expires_at: chrono::Utc::now() + chrono::Duration::minutes(10),
        quorum: 1,
    };
    let ask = |req: pitcrew_model::ApprovalRequest| {
        let bus = crew.bus.clone();
        async move {
            let id = format!("{run}.{}.{}.request", req.plan_hash, req.attempt);
            let payload = serde_json::to_vec(&req)?;
            bus.publish(bus.subjects.approval_requested(run), &id, "application/json", Some(run), payload.into())
                .await?;
            anyhow::Ok(())
        }
    };
    ask(request(1)).await?;
    cli::submit(&crew.bus, None, DecisionInput::cli(run, Decision::Approve, "ann", None, &crew.cfg)).await?;
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    ask(request(2)).await?;
    let again =
        cli::submit(&crew.bus, None, DecisionInput::cli(run, Decision::Approve, "ann", None, &crew.cfg)).await?;
    assert_eq!(again.attempt, 2);
    // Both decisions are on the bridge subject, for the crew to read.
    let stream = crew.bus.js.get_stream(crew.bus.subjects.approvals_stream()).await?;
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            filter_subject: crew.bus.subjects.approval_decided(run),
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?.take(2);
    let mut decided = Vec::new();
    while let Ok(Some(m)) = tokio::time::timeout(WAIT, messages.next()).await {
        decided.push(serde_json::from_slice::<ApprovalDecision>(&m?.payload)?);
    }
    assert_eq!(decided.len(), 2, "{decided:?}");
    assert!(decided.iter().all(|d| d.decision == Decision::Approve && d.by == "ann"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_approval_survives_a_restart_of_every_pitcrew_process() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    let run = crew.open("svc", "stale lock held").await?;
    crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    // Every stage stops (the approval sweeper and decision consumer with them) ...
    crew.shutdown().await?;
    let db = crew.db().await?;
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1", &[&run]).await?.get(0);
    assert_eq!(status, "waiting_approval");
    // ... the decision arrives while nothing runs, and the crew comes back.
    cli::submit(&crew.bus, Some(&crew.store), DecisionInput::cli(run, Decision::Approve, "ann", None, &crew.cfg))
        .await?;
    crew.run(&Stage::ALL);
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1 AND status = 'succeeded'", run).await, 2);
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hosts_allow_list_refuses_programs_it_does_not_name() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let policy = write(&env, "policy.toml", "[hosts.local]\nallow = [\"touch\"]\n");
    let book = write(&env, "playbook.toml", PLAYBOOK);
    let svc = marker_service(&env, "svc");
    let text = format!("[reasoning]\nplaybook_file = \"{book}\"\n[policy]\nfile = \"{policy}\"\n{svc}");
    let mut crew = Crew::start_in(env, &text, &Stage::ALL).await?;
    // The plan starts with `rm -f <lock>`: rm is not on local's list.
    let run = crew.open("svc", "stale lock held").await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Escalated);
    assert!(
        end.message.contains("host-allow-list") && end.message.contains("rm is not on local's allow-list"),
        "{}",
        end.message
    );
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    // A plan of listed programs only still runs.
    let ok = crew.open_with("svc", "connection refused", Some("fp-allowed".into())).await?;
    assert_eq!(crew.events.terminal(ok, WAIT).await?.kind, EventKind::Resolved);
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_as_prometheus_text_and_move_as_runs_complete() -> anyhow::Result<()> {
    let port = pitcrew_runtime::natsd::free_port()?;
    let mut crew = crew_with_playbook(&format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n")).await?;
    let url = format!("http://127.0.0.1:{port}/metrics");
    let first = crew.open("svc", "GET /health: connection refused").await?;
    assert_eq!(crew.events.terminal(first, WAIT).await?.kind, EventKind::Resolved);
    let before = scrape(&url).await?;
    let acked = "pitcrew_messages_total{consumer=\"diagnose\",outcome=\"ack\"}";
    let resolved = "pitcrew_runs_finished_total{outcome=\"resolved\"}";
    assert!(sample(&before, acked) >= 1.0, "{before:?}");
    assert!(sample(&before, resolved) >= 1.0, "{before:?}");
    assert!(sample(&before, "pitcrew_handling_seconds_count{consumer=\"verify\"}") >= 1.0);
    let second = crew.open_with("svc", "GET /health: connection refused", Some("fp-second".into())).await?;
    assert_eq!(crew.events.terminal(second, WAIT).await?.kind, EventKind::Resolved);
    let after = scrape(&url).await?;
    assert!(sample(&after, acked) > sample(&before, acked), "the counters move");
    assert!(sample(&after, resolved) > sample(&before, resolved));
    let missing = reqwest::get(format!("http://127.0.0.1:{port}/other")).await?;
    assert_eq!(missing.status().as_u16(), 404);
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incident_for_an_unknown_service_escalates_with_a_clear_error() -> anyhow::Result<()> {
    let mut crew = crew_with_playbook("").await?;
    let run = crew.open("nosuch", "connection refused").await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Escalated);
    assert!(
        end.message.contains("unknown service 'nosuch': add it under [services.nosuch]"),
        "the reason says what to do: {}",
        end.message
    );
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    // The crew is unharmed: the next incident is handled.
    let ok = crew.open("svc", "GET /health: connection refused").await?;
    assert_eq!(crew.events.terminal(ok, WAIT).await?.kind, EventKind::Resolved);
    crew.shutdown().await
}

#[tokio::test]
async fn the_demo_on_a_shared_nats_server_keeps_to_streams_of_its_own() -> anyhow::Result<()> {
    // A crew's streams on that server, under the default prefix.
    let env = TestEnv::start().await?;
    let cfg = pitcrew_runtime::Config::from_toml(&env.config_toml(""))?;
    let bus = pitcrew_runtime::bus::Bus::connect(&cfg).await?;
    bus.ensure_streams().await?;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pitcrew"))
        .arg("demo")
        .env("PITCREW_NATS_URL", env.nats.url())
        .env("DATABASE_URL", &env.db.url)
        .env_remove("OPENAI_API_KEY")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(std::time::Duration::from_secs(180), out).await??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("under a prefix of its own: demo_"), "{stdout}");
    assert_eq!(stdout.lines().last(), Some("demo: 3 runs, 2 resolved, 1 escalated"), "{stdout}");
    // None of its incidents, work or events reached the crew's streams, and its own are gone.
    let s = &bus.subjects;
    let mut ours =
        vec![s.incidents_stream(), s.stages_stream(), s.approvals_stream(), s.events_stream(), s.dlq_stream()];
    ours.sort();
    let mut names: Vec<String> = futures::TryStreamExt::try_collect(bus.js.stream_names()).await?;
    names.sort();
    assert_eq!(names, ours);
    for name in names {
        let held = bus.js.get_stream(&name).await?.info().await?.state.messages;
        assert_eq!(held, 0, "the demo left {held} messages on {name}");
    }
    Ok(())
}

/// A mistake in the environment's settings stops the demo with it said, instead of the demo
/// going on with the defaults (another database than DATABASE_URL's, say).
#[tokio::test]
async fn the_demo_says_what_is_wrong_with_the_environments_settings() -> anyhow::Result<()> {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pitcrew"))
        .arg("demo")
        .env("PITCREW_NATS_URL", "nats://127.0.0.1:1")
        .env("PITCREW_STAGES__CONCURRENCY", "many")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(std::time::Duration::from_secs(60), out).await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("the environment's PITCREW_* or DATABASE_URL"), "{stderr}");
    assert!(stderr.to_lowercase().contains("stages.concurrency"), "{stderr}");
    Ok(())
}

/// With `[verify] healthy_checks = 2` a fix has to hold: a service that answers once after
/// it and then falls over again is not recovered, and the verification says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fix_that_does_not_hold_is_not_recovered_under_two_healthy_checks() -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let env = TestEnv::start().await?;
    let healthy = env.path("svc-healthy");
    fix_script(&env, &format!("#!/bin/sh\ntouch {healthy}\n"));
    // Healthy the first time it is asked once the fix ran, never again.
    let check = write(
        &env,
        "flappy-check",
        &format!("#!/bin/sh\n[ -f {healthy} ] || exit 1\n[ -f {healthy}.seen ] && exit 1\ntouch {healthy}.seen\n"),
    );
    std::fs::set_permissions(&check, std::fs::Permissions::from_mode(0o755))?;
    let book = write(&env, "playbook.toml", PLAYBOOK);
    let text = format!(
        "[reasoning]\nplaybook_file = \"{book}\"\n[limits]\nmax_retries = 1\n[services.svc]\nhost = \"local\"\n\
         restart = \"touch {healthy}\"\ncheck = {{ kind = \"command\", command = \"{check}\" }}\n"
    );
    let verify = "[verify]\nchecks = 2\ninterval_ms = 100\nhealthy_checks = 2\n";
    let mut crew = Crew::start_verifying(env, &text, &Stage::ALL, verify).await?;
    let run = crew.open("svc", "svc needs a slow fix").await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Escalated, "{}", end.message);
    let verified = crew.events.kind(run, EventKind::Verification, WAIT).await?;
    assert_eq!(verified.data["recovered"], false, "{}", verified.message);
    assert!(
        verified.message.starts_with("not recovered: healthy at first, then failed again: "),
        "{}",
        verified.message
    );
    crew.shutdown().await
}

/// A fix that takes a few seconds to show (a service that binds its port a while after its
/// restart returns, as most do): with the default verification it counts as the fix it is,
/// not as a failed one that memory would bar from later plans.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fix_that_takes_seconds_to_show_is_verified_under_the_defaults() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let healthy = env.path("svc-healthy");
    fix_script(&env, &format!("#!/bin/sh\n(sleep 4; touch {healthy}) >/dev/null 2>&1 </dev/null &\n"));
    let book = write(&env, "playbook.toml", PLAYBOOK);
    let text = format!("[reasoning]\nplaybook_file = \"{book}\"\n{}", marker_service(&env, "svc"));
    let mut crew = Crew::start_verifying(env, &text, &Stage::ALL, "").await?;
    let run = crew.open("svc", "svc needs a slow fix").await?;
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    let verified = crew.events.kind(run, EventKind::Verification, WAIT).await?;
    assert_eq!(verified.data["recovered"], true, "{}", verified.message);
    assert_eq!(verified.data["attempt"], 1, "the first attempt's fix, not a later one: {}", verified.message);
    crew.shutdown().await
}
