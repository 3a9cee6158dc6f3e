//! A run's end is counted once by the process that ends it, however often its end is
//! published. In a test binary of its own: the counters are the process's.

mod common;

use common::{marker_service, Crew};
use futures::StreamExt;
use pitcrew_model::{Incident, RunState, Stage};
use pitcrew_runtime::consume::{Disposition, MessageHandler};
use pitcrew_runtime::runner::StageRunner;
use pitcrew_runtime::store::{OpenRun, RunStatus};
use pitcrew_testkit::TestEnv;
use std::sync::Arc;
use std::time::Duration;

fn escalated_count() -> f64 {
    let text = pitcrew_runtime::metrics::render();
    text.lines()
        .find(|l| l.starts_with("pitcrew_runs_finished_total{outcome=\"escalated\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// The closing step commits, then the publish of its end fails (the events stream refuses
/// it); the redelivery finds the run closed by it and publishes the end. The run ended once:
/// it was counted at each publish, twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_end_is_published_again_is_counted_once() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let text = marker_service(&env, "svc");
    let crew = Crew::start_in(env, &text, &[]).await?;
    let mut state = RunState::new(uuid::Uuid::now_v7(), Incident::new("svc", "down"));
    assert_eq!(crew.store.open_run(&state).await?, OpenRun::Created);
    state.escalate("a human must look");
    assert!(crew.store.commit_transition_with(&state, RunStatus::Open, &[], vec![]).await?);
    pitcrew_runtime::runner::publish_state(&crew.bus, &state).await?;
    let settings = pitcrew_runtime::config::StageSettings {
        ack_wait: Duration::from_secs(1),
        ..crew.cfg.stage_settings(Stage::Escalate)
    };
    let consumer = crew.bus.stage_consumer(Stage::Escalate, settings).await?;
    let (playbook, policy) = pitcrew::crew::providers(&crew.cfg)?;
    let deps = pitcrew_runtime::Deps {
        config: Arc::new(crew.cfg.clone()),
        store: crew.store.clone(),
        reasoner: pitcrew::crew::reasoner(&crew.cfg, playbook)?,
        executor: Arc::new(pitcrew_exec::LocalExecutor::new(4096)),
        policy: Arc::new(policy.clone()),
        worker: "test".into(),
        live: None,
        stopping: Default::default(),
    };
    let runner = Arc::new(StageRunner {
        bus: crew.bus.clone(),
        deps: Arc::new(deps),
        handler: pitcrew::crew::handler(Stage::Escalate, &policy),
    });
    let mut events = crew.bus.js.get_stream(crew.bus.subjects.events_stream()).await?;
    let open = events.info().await?.config.clone();
    let before = escalated_count();
    for delivery in 1..=2 {
        let refusing = delivery == 1;
        // The first delivery's events are refused (too large for the stream): its commit lands,
        // its publish fails.
        let config = async_nats::jetstream::stream::Config {
            max_message_size: if refusing { 16 } else { open.max_message_size },
            ..open.clone()
        };
        crew.bus.js.update_stream(config).await?;
        let next = consumer.fetch().max_messages(1).expires(Duration::from_secs(5)).messages().await?.next().await;
        let msg = next.ok_or_else(|| anyhow::anyhow!("delivery {delivery} never came"))?;
        let msg = Arc::new(msg.map_err(|e| anyhow::anyhow!("{e}"))?);
        let disposition = runner.clone().handle(msg.clone()).await;
        if refusing {
            assert!(matches!(disposition, Disposition::Nak(_)), "{disposition:?}");
            msg.ack_with(async_nats::jetstream::AckKind::Nak(None)).await.map_err(|e| anyhow::anyhow!("{e}"))?;
        } else {
            assert_eq!(disposition, Disposition::Ack);
        }
    }
    let end = crew.bus.subjects.event(state.run_id, "escalated");
    assert!(events.get_last_raw_message_by_subject(&end).await.is_ok(), "the run's end reached the bus");
    assert_eq!(escalated_count() - before, 1.0, "{}", pitcrew_runtime::metrics::render());
    Ok(())
}
