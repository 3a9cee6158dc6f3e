//! The monitor against the real crew: a failing check opens one run per outage (however
//! often it is reported), the crew fixes it, and the monitor reports the recovery.

mod common;

use common::{count, marker_service, write, Crew, WAIT};
use futures::{FutureExt, StreamExt};
use pitcrew::cli::DecisionInput;
use pitcrew::{cli, crew};
use pitcrew_model::{Decision, EventKind, Stage};
use pitcrew_testkit::TestEnv;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_opens_one_run_and_its_recovery_is_reported() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    // The fix needs approval, so the run stays open while the monitor keeps reporting.
    let book = write(
        &env,
        "playbook.toml",
        "[[rule]]\nname = \"down\"\nmatch = \"exited 1\"\ndiagnosis = \"{service} marker missing\"\n\
         plans = [[\"rm -f {dir}/lock\", \"{start}\"]]\n",
    );
    let text = format!(
        "[reasoning]\nplaybook_file = \"{book}\"\n[monitor]\ninterval_ms = 100\nrealert_secs = 0\n{}",
        marker_service(&env, "svc")
    );
    let mut crew = Crew::start_in(env, &text, &Stage::ALL).await?;
    let recovered_subject = format!("{}.events.monitor.svc.recovered", crew.bus.subjects.prefix());
    let mut recoveries = crew.bus.client.subscribe(recovered_subject).await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        let _ = stopped.await;
    }
    .boxed()
    .shared();
    let monitor = tokio::spawn(crew::monitor(crew.cfg.clone(), shutdown));

    // The first report opens a run; the ones that follow are duplicates of it.
    let first = crew.events.wait_any(|e| e.kind == EventKind::ApprovalRequested, WAIT).await?.run_id;
    crew.events.wait_any(|e| e.kind == EventKind::Duplicate && e.message.contains(&first.to_string()), WAIT).await?;
    let db = crew.db().await?;
    let runs: i64 = db.query_one("SELECT count(*) FROM runs WHERE fingerprint = 'monitor:svc'", &[]).await?.get(0);
    assert_eq!(runs, 1, "one open run per outage");
    cli::submit(&crew.bus, Some(&crew.store), DecisionInput::cli(first, Decision::Approve, "ann", None, &crew.cfg))
        .await?;
    assert_eq!(crew.end(first).await?.kind, EventKind::Resolved);
    let msg = tokio::time::timeout(WAIT, recoveries.next()).await?.expect("recovery event");
    let r: serde_json::Value = serde_json::from_slice(&msg.payload)?;
    assert_eq!(r["service"], "svc");
    assert!(r["down_since"].is_string());
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", first).await, 2);
    let _ = stop.send(());
    monitor.await??;
    crew.shutdown().await
}
