//! Serving an axum router over HTTP/1.1 with the limits `axum::serve` lacks: a client must
//! send its request headers within [`HEADER_TIMEOUT`] (an idle keep-alive connection is closed
//! after it too), so a slow or silent client (slowloris) cannot hold connections open forever;
//! a client that stops reading its answer is cut off once nothing could be written to it for
//! [`WRITE_TIMEOUT`] (hyper has no write timeout: such a connection, its buffers and its
//! slot were held for good); at most [`MAX_CONNECTIONS`] connections are served at once. On shutdown it stops accepting,
//! lets the requests in hand finish for [`DRAIN`], then returns. Each request carries the
//! peer's address as axum's `ConnectInfo<SocketAddr>`.

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::io;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::time::Sleep;

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
/// How long an answer may wait to be written (a client that does not read: its socket's
/// buffers full) before its connection is closed. A client that reads, however slowly,
/// resets it with every byte taken.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// At most one warning of refused connections this often.
const REFUSED_WARN_EVERY: Duration = Duration::from_secs(10);

static REFUSED: pitcrew_metrics::Counter = pitcrew_metrics::Counter::new(
    "pitcrew_http_connections_refused_total",
    "Connections closed as they arrived because MAX_CONNECTIONS (4096) were served already.",
    &[],
);

/// How long a stopping server waits for the connections in hand.
pub const DRAIN: Duration = Duration::from_secs(10);

/// Serve `router` on `listener` until `shutdown` resolves, then drain.
pub async fn serve(listener: TcpListener, router: Router, shutdown: impl Future<Output = ()>) -> std::io::Result<()> {
    serve_limited(listener, router, shutdown, WRITE_TIMEOUT).await
}

async fn serve_limited(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()>,
    write_timeout: Duration,
) -> std::io::Result<()> {
    let conns = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    // Connections refused since the last warning, and when that was: one line every 10 s at
    // most, however fast they come (a flood would otherwise write a line a handshake).
    let mut refused: (u64, Option<tokio::time::Instant>) = (0, None);
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
            REFUSED.inc(&[]);
            refused.0 += 1;
            if refused.1.is_none_or(|at| at.elapsed() >= REFUSED_WARN_EVERY) {
                tracing::warn!(%remote, limit = MAX_CONNECTIONS, refused = refused.0, "too many connections: closed as they come");
                refused = (0, Some(tokio::time::Instant::now()));
            }
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
                .serve_connection(TokioIo::new(WriteDeadline::new(stream, write_timeout)), svc);
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

/// A stream whose writes fail (`TimedOut`) once they have made no progress for `limit`: the
/// peer stopped reading. Reads pass through.
struct WriteDeadline<S> {
    inner: S,
    limit: Duration,
    /// Set when a write found no room, cleared when one goes through.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteDeadline<S> {
    fn new(inner: S, limit: Duration) -> Self {
        WriteDeadline { inner, limit, stalled: None }
    }

    /// Pass on a write's result; while it cannot go on, see whether it has waited too long.
    fn watch<T>(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.limit;
        let stalled = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        ready!(stalled.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("nothing could be written for {} s: the client does not read", limit.as_secs_f64()),
        )))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// An endless answer, 64 KiB at a time.
    fn endless() -> Router {
        let chunk = bytes::Bytes::from(vec![b'x'; 64 * 1024]);
        let body = move || {
            let chunk = chunk.clone();
            async move {
                let chunks = futures::stream::repeat_with(move || Ok::<_, io::Error>(chunk.clone()));
                axum::body::Body::from_stream(chunks)
            }
        };
        Router::new().route("/", axum::routing::get(body))
    }

    /// Read until the server closes the connection, or give up past `cap` bytes or 10 s:
    /// whether it was closed.
    async fn closed_within(stream: &mut tokio::net::TcpStream, cap: usize) -> bool {
        let mut buf = vec![0u8; 256 * 1024];
        let mut total = 0;
        let read_all = async {
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return true,
                    Ok(n) => total += n,
                }
                if total > cap {
                    return false;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), read_all).await.unwrap_or(false)
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_is_cut_off_and_one_that_reads_is_not() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_limited(
            listener,
            endless(),
            async move {
                let _ = stopped.await;
            },
            Duration::from_millis(500),
        ));
        let request = format!("GET / HTTP/1.1\r\nHost: {at}\r\n\r\n");

        // Asks, then reads nothing for longer than the limit: the server gives up on it (what
        // the socket's buffers held still comes, then the end).
        let mut idle = tokio::net::TcpStream::connect(at).await.unwrap();
        idle.write_all(request.as_bytes()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(closed_within(&mut idle, 256 * 1024 * 1024).await, "a client that stopped reading was cut off");

        // One that keeps reading gets its endless answer well past the limit.
        let mut reader = tokio::net::TcpStream::connect(at).await.unwrap();
        reader.write_all(request.as_bytes()).await.unwrap();
        let mut buf = vec![0u8; 64 * 1024];
        let began = tokio::time::Instant::now();
        while began.elapsed() < Duration::from_secs(2) {
            let n = reader.read(&mut buf).await.unwrap();
            assert!(n > 0, "a reading client is never cut off");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = stop.send(());
        drop((idle, reader));
        server.await.unwrap().unwrap();
    }
}
