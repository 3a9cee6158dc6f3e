//! Serving an axum router over HTTP/1.1 with the limits `axum::serve` lacks: a client must
//! send its request headers within [`HEADER_TIMEOUT`] (an idle keep-alive connection is closed
//! after it too), so a slow or silent client (slowloris) cannot hold connections open forever;
//! at most [`MAX_CONNECTIONS`] connections are served at once. On shutdown it stops accepting,
//! lets the requests in hand finish for [`DRAIN`], then returns. Each request carries the
//! peer's address as axum's `ConnectInfo<SocketAddr>`.

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// Bind `listen`, the setting `what` (as in `[gateway] listen`): an error names both.
pub async fn bind(listen: &str, what: &str) -> anyhow::Result<TcpListener> {
    use anyhow::Context;
    TcpListener::bind(listen).await.with_context(|| format!("{what} = \"{listen}\": cannot bind"))
}

/// Bind `listen` and let it go at once: a port taken, or an address that is not this
/// machine's, is said before a process waits for NATS and Postgres, though it serves only
/// after (a socket listening meanwhile would take in requests nobody answers).
pub async fn can_bind(listen: &str, what: &str) -> anyhow::Result<()> {
    bind(listen, what).await.map(drop)
}

/// How long a client may take to send a request's headers (or stay idle between requests).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; more are closed as they arrive.
pub const MAX_CONNECTIONS: usize = 4096;
/// How long a stopping server waits for the connections in hand.
pub const DRAIN: Duration = Duration::from_secs(10);

/// Serve `router` on `listener` until `shutdown` resolves, then drain.
pub async fn serve(listener: TcpListener, router: Router, shutdown: impl Future<Output = ()>) -> std::io::Result<()> {
    let conns = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    loop {
        // Shutdown first: with connections queued too, an unbiased select could go on
        // accepting them after the server was told to stop.
        let accepted = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            a = listener.accept() => a,
        };
        let (stream, remote) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors, or a connection reset before it was accepted: not
                // fatal, but do not spin on it.
                tracing::warn!(error = %e, "cannot accept a connection: retrying in 100 ms");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = conns.clone().try_acquire_owned() else {
            tracing::warn!(%remote, limit = MAX_CONNECTIONS, "too many connections: one closed");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let svc = TowerToHyperService::new(router.clone().into_service::<Incoming>());
        let svc = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
            req.extensions_mut().insert(ConnectInfo(remote));
            hyper::service::Service::call(&svc, req)
        });
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), svc);
            let mut conn = pin!(conn);
            let stopping = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            let ended = tokio::select! {
                r = conn.as_mut() => Some(r),
                _ = stopping => None,
            };
            let ended = match ended {
                Some(r) => r,
                None => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(%remote, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let all = u32::try_from(MAX_CONNECTIONS).unwrap_or(u32::MAX);
    if tokio::time::timeout(DRAIN, conns.acquire_many(all)).await.is_err() {
        tracing::warn!(
            open = MAX_CONNECTIONS - conns.available_permits(),
            "connections still open after the drain: no longer waited for"
        );
    }
    Ok(())
}
