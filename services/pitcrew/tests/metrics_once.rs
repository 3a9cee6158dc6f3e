//! A run's end is counted once by the process that ends it, however often its end is
//! published. In a test binary of its own: the counters are the process's.

mod common;

use futures::StreamExt;
use pitcrew_runtime::consume::{Disposition, MessageHandler};
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
    let (crew, state, consumer, runner) = common::at_escalate().await?;
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
