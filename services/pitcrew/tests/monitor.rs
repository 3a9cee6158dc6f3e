//! The monitor against the real crew: a failing check opens one run per outage (however
//! often it is reported), the crew fixes it, and the monitor reports the recovery.

mod common;

use common::{count, crew_fixing_on_approval, sample, scrape, WAIT};
use futures::StreamExt;
use pitcrew::cli;
use pitcrew::cli::DecisionInput;
use pitcrew_model::{Decision, EventKind};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_opens_one_run_and_its_recovery_is_reported() -> anyhow::Result<()> {
    // The run stays open while the monitor keeps reporting.
    let mut crew = crew_fixing_on_approval("interval_ms = 100\nrealert_secs = 0").await?;
    let recovered_subject = format!("{}.events.monitor.svc.recovered", crew.bus.subjects.prefix());
    let mut recoveries = crew.bus.client.subscribe(recovered_subject).await?;
    // The monitor serves its own /metrics (the crew, in this process too, serves none here).
    let port = pitcrew_runtime::natsd::free_port()?;
    let mut monitor_cfg = crew.cfg.clone();
    monitor_cfg.metrics.listen = Some(format!("127.0.0.1:{port}"));
    let metrics = format!("http://127.0.0.1:{port}/metrics");
    let (stop, monitor) = common::spawn_monitor(monitor_cfg);

    // The first report opens a run; the ones that follow are duplicates of it.
    let first = crew.events.wait_any(|e| e.kind == EventKind::ApprovalRequested, WAIT).await?.run_id;
    crew.events.wait_any(|e| e.kind == EventKind::Duplicate && e.message.contains(&first.to_string()), WAIT).await?;
    let db = crew.db().await?;
    let runs: i64 = db.query_one("SELECT count(*) FROM runs WHERE fingerprint = 'monitor:svc'", &[]).await?.get(0);
    assert_eq!(runs, 1, "one open run per outage");
    let down = scrape(&metrics).await?;
    assert!(sample(&down, r#"pitcrew_monitor_checks_total{service="svc",result="down"}"#) >= 2.0, "{down:?}");
    assert_eq!(sample(&down, r#"pitcrew_monitor_service_up{service="svc"}"#), 0.0, "{down:?}");
    assert!(sample(&down, r#"pitcrew_monitor_publishes_total{kind="incident",outcome="ok"}"#) >= 2.0, "{down:?}");
    assert!(sample(&down, r#"pitcrew_monitor_check_seconds_count{service="svc"}"#) >= 2.0, "{down:?}");
    assert!(down.iter().any(|(s, _)| s.starts_with("pitcrew_monitor_check_seconds_bucket{service=\"svc\"")));
    let round = sample(&down, "pitcrew_monitor_last_round_timestamp_seconds");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs_f64();
    assert!(now - round < 30.0 && round <= now + 1.0, "the last round is recent: {round} vs {now}");
    cli::submit(&crew.bus, Some(&crew.store), DecisionInput::cli(first, Decision::Approve, "ann", None, &crew.cfg))
        .await?;
    assert_eq!(crew.end(first).await?.kind, EventKind::Resolved);
    let msg = tokio::time::timeout(WAIT, recoveries.next()).await?.expect("recovery event");
    let r: serde_json::Value = serde_json::from_slice(&msg.payload)?;
    assert_eq!(r["service"], "svc");
    assert!(r["down_since"].is_string());
    // One recovery counted, and the service reads as up.
    let up = scrape(&metrics).await?;
    assert_eq!(sample(&up, r#"pitcrew_monitor_publishes_total{kind="recovery",outcome="ok"}"#), 1.0, "{up:?}");
    assert_eq!(sample(&up, r#"pitcrew_monitor_service_up{service="svc"}"#), 1.0, "{up:?}");
    assert!(sample(&up, r#"pitcrew_monitor_checks_total{service="svc",result="up"}"#) >= 1.0, "{up:?}");
    assert!(sample(&up, "pitcrew_monitor_last_round_timestamp_seconds") >= round);
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", first).await, 2);
    let _ = stop.send(());
    monitor.await??;
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_down_again_right_after_its_run_resolved_opens_a_new_run_at_once() -> anyhow::Result<()> {
    // Reminders an hour apart, rounds 1.5 s apart: the service fails again right after the
    // run resolves, before the monitor's next round can see it healthy.
    // A service of its own: the monitor's metrics (`service_up`), which the first test reads,
    // are the test process's.
    let mut crew = common::crew_fixing_on_approval_of("svc-relapse", "interval_ms = 1500\nrealert_secs = 3600").await?;
    let healthy = crew.env.path("svc-relapse-healthy");
    let (stop, monitor) = common::spawn_monitor(crew.cfg.clone());

    let first = crew.events.wait_any(|e| e.kind == EventKind::ApprovalRequested, WAIT).await?.run_id;
    cli::submit(&crew.bus, Some(&crew.store), DecisionInput::cli(first, Decision::Approve, "ann", None, &crew.cfg))
        .await?;
    assert_eq!(crew.end(first).await?.kind, EventKind::Resolved);
    std::fs::remove_file(&healthy)?;
    // A new outage, reported at the next round rather than an hour later.
    common::a_second_run_of_opens_for_the_relapse(&mut crew, "svc-relapse", first).await?;
    let _ = stop.send(());
    monitor.await??;
    crew.shutdown().await
}

/// A monitor restarted during an outage whose run escalated takes the outage up where the
/// one before left it: the humans have it, so no run opens again (and no fix runs again)
/// before `realert`, however many rounds the new monitor sees it down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_monitor_takes_up_the_outage_it_reported() -> anyhow::Result<()> {
    // A service of its own: the monitor's metrics, read below, are the test process's.
    let mut crew =
        common::crew_fixing_on_approval_of("svc-restarted", "interval_ms = 100\nrealert_secs = 3600").await?;
    let spawn = |crew: &common::Crew| -> anyhow::Result<_> {
        let port = pitcrew_runtime::natsd::free_port()?;
        let mut cfg = crew.cfg.clone();
        cfg.metrics.listen = Some(format!("127.0.0.1:{port}"));
        let (stop, monitor) = common::spawn_monitor(cfg);
        Ok((stop, monitor, format!("http://127.0.0.1:{port}/metrics")))
    };
    let (stop, monitor, _) = spawn(&crew)?;
    let first = crew.events.wait_any(|e| e.kind == EventKind::ApprovalRequested, WAIT).await?.run_id;
    let deny = DecisionInput::cli(first, Decision::Deny, "ann", Some("not now: we are on it".into()), &crew.cfg);
    cli::submit(&crew.bus, Some(&crew.store), deny).await?;
    assert_eq!(crew.end(first).await?.kind, EventKind::Escalated);
    let _ = stop.send(());
    monitor.await??;

    // The service is still down when the monitor starts again.
    let (stop, monitor, metrics) = spawn(&crew)?;
    let down = r#"pitcrew_monitor_checks_total{service="svc-restarted",result="down"}"#;
    let checks = |m: &[(String, f64)]| sample(m, down);
    let deadline = tokio::time::Instant::now() + WAIT;
    let before = loop {
        match scrape(&metrics).await {
            Ok(m) => break checks(&m),
            Err(_) if tokio::time::Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => return Err(e),
        }
    };
    loop {
        let now = checks(&scrape(&metrics).await?);
        if now >= before + 10.0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the new monitor checked {now} - {before} times");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let db = crew.db().await?;
    let runs: i64 =
        db.query_one("SELECT count(*) FROM runs WHERE fingerprint = 'monitor:svc-restarted'", &[]).await?.get(0);
    assert_eq!(runs, 1, "ten rounds of the outage after the restart: no second run");
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", first).await, 0, "nothing ran");
    let _ = stop.send(());
    monitor.await??;
    crew.shutdown().await
}

/// A check the monitor cannot run (it names a secret the monitor does not hold) tells nothing
/// of the service: no incident, no remediation of a service perhaps healthy; the checks count
/// as `unknown`, and the service reads neither up nor down (NaN).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_the_monitor_cannot_run_opens_no_incident() -> anyhow::Result<()> {
    let env = pitcrew_testkit::TestEnv::start().await?;
    let text = "[monitor]\ninterval_ms = 100\nrealert_secs = 0\n[services.keyed-mon]\nhost = \"local\"\n\
                start = \"true\"\ncheck = { kind = \"command\", command = \"test -n {secret:mon_key}\" }\n";
    let crew = common::Crew::start_in(env, text, &pitcrew_model::Stage::ALL).await?;
    let port = pitcrew_runtime::natsd::free_port()?;
    let mut monitor_cfg = crew.cfg.clone();
    monitor_cfg.metrics.listen = Some(format!("127.0.0.1:{port}"));
    let metrics = format!("http://127.0.0.1:{port}/metrics");
    let (stop, monitor) = common::spawn_monitor(monitor_cfg);
    let unknown = r#"pitcrew_monitor_checks_total{service="keyed-mon",result="unknown"}"#;
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let seen = scrape(&metrics).await.unwrap_or_default();
        if sample(&seen, unknown) >= 5.0 {
            assert_eq!(sample(&seen, r#"pitcrew_monitor_checks_total{service="keyed-mon",result="down"}"#), 0.0);
            let up = sample(&seen, r#"pitcrew_monitor_service_up{service="keyed-mon"}"#);
            assert!(up.is_nan(), "neither up nor down: {up} in {seen:?}");
            break;
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "no unknown checks counted: {seen:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let db = crew.db().await?;
    let incidents: i64 = db.query_one("SELECT count(*) FROM incidents WHERE service = 'keyed-mon'", &[]).await?.get(0);
    assert_eq!(incidents, 0, "five rounds and no incident");
    let _ = stop.send(());
    monitor.await??;
    let mut crew = crew;
    crew.shutdown().await
}
