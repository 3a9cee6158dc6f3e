//! The monitor where its outages meet intake's duplicates: in a process of its own, as the
//! monitor's metrics are the process's.

mod common;

use common::{crew_fixing_on_approval, WAIT};
use futures::StreamExt;
use pitcrew::cli;
use pitcrew::cli::DecisionInput;
use pitcrew_model::{Decision, EventKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relapse_after_a_run_that_an_outage_joined_as_a_duplicate_is_seen() -> anyhow::Result<()> {
    // Run A opens; the service answers once (an outage ends), fails again (a new outage, whose
    // incident joins A as a duplicate); A resolves and the service fails at once: the new
    // outage's run is A, and its relapse opens a run at the next round, not an hour later.
    let mut crew = crew_fixing_on_approval("interval_ms = 1500\nrealert_secs = 3600").await?;
    let healthy = crew.env.path("svc-healthy");
    let recovered_subject = format!("{}.events.monitor.svc.recovered", crew.bus.subjects.prefix());
    let mut recoveries = crew.bus.client.subscribe(recovered_subject).await?;
    let (stop, monitor) = common::spawn_monitor(crew.cfg.clone());

    let a = crew.events.wait_any(|e| e.kind == EventKind::ApprovalRequested, WAIT).await?.run_id;
    std::fs::write(&healthy, b"")?;
    tokio::time::timeout(WAIT, recoveries.next()).await?.expect("recovery event");
    std::fs::remove_file(&healthy)?;
    crew.events.wait_any(|e| e.kind == EventKind::Duplicate && e.message.contains(&a.to_string()), WAIT).await?;
    cli::submit(&crew.bus, Some(&crew.store), DecisionInput::cli(a, Decision::Approve, "ann", None, &crew.cfg)).await?;
    assert_eq!(crew.end(a).await?.kind, EventKind::Resolved);
    std::fs::remove_file(&healthy)?;
    common::a_second_run_opens_for_the_relapse(&mut crew, a).await?;
    let _ = stop.send(());
    monitor.await??;
    crew.shutdown().await
}
