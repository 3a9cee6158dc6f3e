//! Prometheus metrics of this process: messages handled per consumer and outcome, handling
//! latency, messages in flight, runs finished by outcome, approval decision latency; at scrape
//! time, consumer pending counts (JetStream) and pending approvals (Postgres). The LLM provider
//! and the executors record theirs in the same registry (`pitcrew-metrics`). Served as the
//! Prometheus text format on `[metrics] listen` (off by default) at `GET /metrics`.

use pitcrew_metrics::{Counter, Gauge, Histogram, LATENCY_BUCKETS, WAIT_BUCKETS};
use std::time::Duration;

static MESSAGES: Counter =
    Counter::new("pitcrew_messages_total", "Messages settled, by consumer and outcome.", &["consumer", "outcome"]);
static IN_FLIGHT: Gauge =
    Gauge::new("pitcrew_messages_in_flight", "Messages being handled now, by consumer.", &["consumer"]);
static HANDLING: Histogram = Histogram::new(
    "pitcrew_handling_seconds",
    "Time from a message starting to it being settled.",
    &["consumer"],
    LATENCY_BUCKETS,
);
static RUNS: Counter =
    Counter::new("pitcrew_runs_finished_total", "Runs this process ended, by outcome.", &["outcome"]);
static APPROVALS_PENDING: Gauge =
    Gauge::new("pitcrew_approvals_pending", "Approval requests waiting for a decision (read from Postgres).", &[]);
static DECISION: Histogram = Histogram::new(
    "pitcrew_approval_decision_seconds",
    "Time from an approval request to its decision, by decision.",
    &["decision"],
    WAIT_BUCKETS,
);
static CONSUMER_PENDING: Gauge = Gauge::new(
    "pitcrew_consumer_pending_messages",
    "Messages not yet delivered to a consumer (read from JetStream).",
    &["consumer"],
);
static CONSUMER_ACK_PENDING: Gauge = Gauge::new(
    "pitcrew_consumer_ack_pending_messages",
    "Messages delivered to a consumer and not yet acknowledged (read from JetStream).",
    &["consumer"],
);
static SCRAPE_ERRORS: Counter = Counter::new(
    "pitcrew_metrics_collect_errors_total",
    "Scrape-time reads (JetStream, Postgres) that failed or timed out, by source.",
    &["source"],
);
static DB_TRANSITIONS: Counter = Counter::new(
    "pitcrew_db_transitions_total",
    "Run transitions sent to Postgres, by how: alone, or sharing a statement (group commit). Each try counts: one that failed and was sent again (Postgres down, a redelivery) counts again.",
    &["how"],
);
static DB_STATEMENTS: Counter = Counter::new(
    "pitcrew_db_transition_statements_total",
    "Statements sent to Postgres with run transitions, by how: alone, or as a group (each try counts).",
    &["how"],
);

static HTTP_REQUESTS: Counter = Counter::new(
    "pitcrew_http_requests_total",
    "Gateway requests answered, by route template, method and status.",
    &["route", "method", "status"],
);
static HTTP_SECONDS: Histogram = Histogram::new(
    "pitcrew_http_request_duration_seconds",
    "Time to answer a gateway request with its headers (a live stream: until it opened), by route template.",
    &["route"],
    LATENCY_BUCKETS,
);

/// The gateway answered `method route` (a route template, never a raw path) with `status`.
pub fn http_request(route: &str, method: &str, status: u16, took: Duration) {
    HTTP_REQUESTS.inc(&[route, method, &status.to_string()]);
    HTTP_SECONDS.observe(&[route], took.as_secs_f64());
}

/// A message of `consumer` started.
pub fn started(consumer: &str) {
    IN_FLIGHT.add(&[consumer], 1.0);
}

/// A message of `consumer` was settled with `outcome` (`ack`, `nak`, `term`) after `took`.
pub fn finished(consumer: &str, outcome: &'static str, took: Duration) {
    IN_FLIGHT.add(&[consumer], -1.0);
    MESSAGES.inc(&[consumer, outcome]);
    HANDLING.observe(&[consumer], took.as_secs_f64());
}

/// This process committed a run's end (`resolved`, `escalated`).
pub fn run_finished(outcome: &'static str) {
    RUNS.inc(&[outcome]);
}

/// A statement wrote `size` run transitions (group commit when more than one).
pub fn transitions_written(size: usize) {
    let how = if size > 1 { "grouped" } else { "alone" };
    DB_TRANSITIONS.add(&[how], size as f64);
    DB_STATEMENTS.inc(&[how]);
}

/// An approval was decided (`approve`, `deny`, `timeout`) `waited` after it was requested.
pub fn approval_decided(decision: &str, waited: Duration) {
    DECISION.observe(&[decision], waited.as_secs_f64());
}

/// Everything, in the Prometheus text exposition format (0.0.4).
pub fn render() -> String {
    pitcrew_metrics::render()
}

/// Reads, at scrape time, what only the servers know: consumer pending counts from JetStream
/// and pending approvals from Postgres. Each read is bounded by a timeout; a failed one is
/// counted and the gauge keeps its last value.
#[derive(Clone)]
pub struct Collector {
    pub bus: crate::Bus,
    pub store: Option<crate::Store>,
    /// Durable consumers to report (stream, consumer name).
    pub consumers: Vec<(String, String)>,
}

/// The server's view of a durable consumer (one request).
pub async fn consumer_info(
    bus: &crate::Bus,
    stream: &str,
    name: &str,
) -> Result<async_nats::jetstream::consumer::Info, String> {
    let c: async_nats::jetstream::consumer::PullConsumer =
        bus.js.get_consumer_from_stream(name, stream).await.map_err(|e| e.to_string())?;
    Ok(c.cached_info().clone())
}

/// How long a scrape waits on JetStream and Postgres.
const COLLECT_TIMEOUT: Duration = Duration::from_secs(2);

impl Collector {
    /// Refresh the scrape-time gauges: every read at once, all within `COLLECT_TIMEOUT` (one
    /// after another, ten consumers of an unreachable NATS held a scrape 20 s, past
    /// Prometheus' own timeout: every series would vanish just when it is wanted).
    pub async fn collect(&self) {
        let consumers = self.consumers.iter().map(|(stream, name)| async move {
            match tokio::time::timeout(COLLECT_TIMEOUT, consumer_info(&self.bus, stream, name)).await {
                Ok(Ok(info)) => {
                    CONSUMER_PENDING.set(&[name], info.num_pending as f64);
                    CONSUMER_ACK_PENDING.set(&[name], info.num_ack_pending as f64);
                }
                _ => SCRAPE_ERRORS.inc(&["jetstream"]),
            }
        });
        let approvals = async {
            if let Some(store) = &self.store {
                match tokio::time::timeout(COLLECT_TIMEOUT, store.pending_approval_count()).await {
                    Ok(Ok(n)) => APPROVALS_PENDING.set(&[], n as f64),
                    _ => SCRAPE_ERRORS.inc(&["postgres"]),
                }
            }
        };
        futures::future::join(futures::future::join_all(consumers), approvals).await;
    }
}

/// Serve `GET /metrics` on `listen` (`[metrics] listen`; `None`: off) in the background until
/// `shutdown`, refreshing `collector`'s gauges on each scrape. The address is bound before
/// this returns, so a taken or malformed one fails the process at start (named, with the
/// setting) instead of leaving a silent gap in the dashboards. Returns the bound address.
pub async fn spawn_endpoint(
    listen: Option<&str>,
    collector: Option<Collector>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Option<std::net::SocketAddr>> {
    let Some(listen) = listen else { return Ok(None) };
    let listener = crate::httpd::bind(listen, "[metrics] listen").await?;
    let at = listener.local_addr()?;
    tracing::info!(listen = %at, "serving Prometheus metrics at /metrics");
    tokio::spawn(serve(listener, collector, shutdown));
    Ok(Some(at))
}

/// Scrapes closer together than this share one collection: the endpoint has no key, and each
/// collection asks Postgres and JetStream (a scanner hammering the port would load both).
const MIN_COLLECT_INTERVAL: Duration = Duration::from_secs(1);

/// When something last ran; callers that come at once wait for the one running it.
#[derive(Clone, Default)]
struct Throttle(std::sync::Arc<tokio::sync::Mutex<Option<tokio::time::Instant>>>);

impl Throttle {
    /// Run `f` unless it ran less than `interval` ago (or runs now: then wait for it).
    async fn at_most_every<F: std::future::Future<Output = ()>>(&self, interval: Duration, f: impl FnOnce() -> F) {
        let mut last = self.0.lock().await;
        if last.is_none_or(|t| t.elapsed() >= interval) {
            f().await;
            *last = Some(tokio::time::Instant::now());
        }
    }
}

/// Serve `GET /metrics` on `listener` until `shutdown`, refreshing the scrape-time gauges of
/// `collector` before each answer. Served by [`crate::httpd`], so a slow or silent scraper
/// holds no connection and connections are capped.
async fn serve(
    listener: tokio::net::TcpListener,
    collector: Option<Collector>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    use axum::http::header::CONTENT_TYPE;
    let not_found = || async { (axum::http::StatusCode::NOT_FOUND, [(CONTENT_TYPE, "text/plain")], "not found\n") };
    let last = Throttle::default();
    let scrape = move || {
        let (collector, last) = (collector.clone(), last.clone());
        async move {
            if let Some(c) = &collector {
                last.at_most_every(MIN_COLLECT_INTERVAL, || c.collect()).await;
            }
            ([(CONTENT_TYPE, "text/plain; version=0.0.4")], render())
        }
    };
    let router = axum::Router::new()
        .route("/metrics", axum::routing::get(scrape))
        .fallback(not_found)
        .method_not_allowed_fallback(not_found);
    if let Err(e) = crate::httpd::serve(listener, router, shutdown).await {
        tracing::warn!(error = %e, "the metrics endpoint stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn scrapes_at_once_share_one_collection_and_a_later_one_collects_again() {
        let (throttle, runs) = (Throttle::default(), std::sync::atomic::AtomicUsize::new(0));
        let collect = || async {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let interval = Duration::from_millis(300);
        futures::future::join_all((0..100).map(|_| throttle.at_most_every(interval, collect))).await;
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1, "100 scrapes at once, one collection");
        tokio::time::sleep(interval).await;
        throttle.at_most_every(interval, collect).await;
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn an_endpoint_is_off_unless_set_and_a_taken_address_is_an_error_naming_the_setting() {
        let never = std::future::pending::<()>();
        assert_eq!(spawn_endpoint(None, None, never).await.unwrap(), None);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let at = spawn_endpoint(Some("127.0.0.1:0"), None, async move {
            let _ = stopped.await;
        })
        .await
        .unwrap()
        .expect("bound");
        let taken = at.to_string();
        let err = spawn_endpoint(Some(&taken), None, std::future::pending::<()>()).await.unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains(&format!("[metrics] listen = \"{taken}\": cannot bind")), "{text}");
        let _ = stop.send(());
    }
}
