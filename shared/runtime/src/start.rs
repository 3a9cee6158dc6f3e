//! Start-up: connecting to NATS and Postgres. A process that runs until told to stop (the crew,
//! the gateway, the monitor, the chat bridges) waits for them when they cannot be reached yet
//! (they start after it, or are down) instead of exiting: a supervisor's restarts back off far
//! longer (minutes under Kubernetes) than the outage may last. What waiting cannot mend (a login
//! refused, a URL that does not parse, a server without JetStream) still stops it at once.

use crate::{Bus, BusError, Config, Store, StoreError};
use futures::future::{BoxFuture, Shared};
use std::future::Future;
use std::time::Duration;

/// A shutdown signal every task can await.
pub type Shutdown = Shared<BoxFuture<'static, ()>>;

/// The longest wait between two tries.
const MAX_WAIT: Duration = Duration::from_secs(15);

/// Connect to NATS and make sure the streams exist.
pub async fn connect_bus(cfg: &Config) -> Result<Bus, BusError> {
    let bus = Bus::connect(cfg).await?;
    bus.ensure_streams().await?;
    Ok(bus)
}

/// Connect to NATS and Postgres and prepare streams and schema.
pub async fn connect(cfg: &Config) -> anyhow::Result<(Bus, Store)> {
    let bus = connect_bus(cfg).await?;
    let store = Store::connect(&cfg.database).await?;
    if cfg.database.migrate_on_start {
        store.migrate().await?;
    }
    Ok((bus, store))
}

/// As [`connect`], waiting while NATS or Postgres cannot be reached. `None` when `shutdown`
/// came first.
pub async fn connect_patiently(cfg: &Config, shutdown: &Shutdown) -> anyhow::Result<Option<(Bus, Store)>> {
    metrics_port_free(cfg).await?;
    patiently("NATS and Postgres", shutdown, || connect(cfg)).await
}

/// As [`connect_bus`], waiting while NATS cannot be reached. `None` when `shutdown` came first.
pub async fn connect_bus_patiently(cfg: &Config, shutdown: &Shutdown) -> anyhow::Result<Option<Bus>> {
    metrics_port_free(cfg).await?;
    patiently("NATS", shutdown, || async { Ok(connect_bus(cfg).await?) }).await
}

/// `[metrics] listen`, when set, can be bound: a port taken is said before the wait, not once
/// NATS and Postgres answer.
async fn metrics_port_free(cfg: &Config) -> anyhow::Result<()> {
    match cfg.metrics.listen.as_deref() {
        Some(listen) => crate::httpd::can_bind(listen, "[metrics] listen").await,
        None => Ok(()),
    }
}

/// Whether a start-up failure is one that waiting may mend: a server that did not answer (or a
/// JetStream not ready yet), or a Postgres error worth a retry.
pub fn worth_waiting_for(e: &anyhow::Error) -> bool {
    e.downcast_ref::<BusError>().is_some_and(BusError::is_unreachable)
        || e.downcast_ref::<StoreError>().is_some_and(StoreError::is_transient)
}

/// Try `attempt` until it succeeds, a failure [`worth_waiting_for`] is not, or `shutdown`
/// (`None`, also in the middle of a try, said in the log). Each failed try is a warning naming
/// `what` is waited for; the wait doubles from 1 s up to 15 s.
pub async fn patiently<T, F, Fut>(what: &str, shutdown: &Shutdown, mut attempt: F) -> anyhow::Result<Option<T>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let stopped = || {
        tracing::info!("stopped before {what} could be reached");
        Ok(None)
    };
    let (mut wait, mut tries) = (Duration::from_secs(1), 0u32);
    loop {
        tries += 1;
        let tried = tokio::select! {
            _ = shutdown.clone() => return stopped(),
            tried = attempt() => tried,
        };
        let e = match tried {
            Ok(done) => return Ok(Some(done)),
            Err(e) if worth_waiting_for(&e) => e,
            Err(e) => return Err(e),
        };
        tracing::warn!(error = %format!("{e:#}"), tries, retry_in_secs = wait.as_secs(), "waiting for {what}");
        tokio::select! {
            _ = shutdown.clone() => return stopped(),
            _ = tokio::time::sleep(wait) => {}
        }
        wait = (wait * 2).min(MAX_WAIT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn never() -> Shutdown {
        futures::future::pending::<()>().boxed().shared()
    }

    fn unreachable() -> anyhow::Error {
        BusError::Connect { url: "nats://127.0.0.1:1".into(), error: "IO error: connection refused".into() }.into()
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_that_did_not_answer_is_tried_again_until_it_does() {
        let tries = AtomicU32::new(0);
        let got = patiently("NATS", &never(), || async {
            match tries.fetch_add(1, Ordering::SeqCst) {
                0..=2 => Err(unreachable()),
                n => Ok(n),
            }
        })
        .await
        .unwrap();
        assert_eq!(got, Some(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_waiting_cannot_mend_is_returned_at_once() {
        let tries = AtomicU32::new(0);
        let got = patiently("NATS", &never(), || async {
            tries.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(anyhow::anyhow!("no [bridge.slack] in the config"))
        })
        .await;
        assert!(got.unwrap_err().to_string().contains("bridge.slack"));
        assert_eq!(tries.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_shutdown_ends_the_wait() {
        let shutdown: Shutdown = tokio::time::sleep(Duration::from_secs(10)).boxed().shared();
        let tries = AtomicU32::new(0);
        let got = patiently("NATS", &shutdown, || async {
            tries.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(unreachable())
        })
        .await
        .unwrap();
        assert!(got.is_none());
        // Tries at 0, 1, 3 and 7 s; the next would be at 15 s.
        assert_eq!(tries.load(Ordering::SeqCst), 4);
    }
}
