//! Trace context across processes: the W3C `traceparent` travels in a header of every NATS
//! message pitcrew publishes, so one incident is one trace from intake to report.
//!
//! Consuming, the runner reads the header ([`traceparent`]), makes it the parent of the stage
//! span ([`adopt`]) and runs the handler inside [`carrying`]; publishing, [`inject`] (called by
//! `bus::headers`) writes the current span's context. When this process does not export
//! spans, the incoming header is passed on unchanged, so a trace survives a hop through a
//! process without an exporter, at the cost of one string copy.
//!
//! The gateway continues an HTTP caller's trace: `let tp = continue_http(&span, req.headers());`
//! then runs the request with `carrying(tp, work.instrument(span))`, so what it publishes
//! carries the caller's trace whether or not the gateway exports spans itself.

use async_nats::header::HeaderMap;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C trace-context header.
pub const TRACEPARENT: &str = "traceparent";

static EXPORTING: AtomicBool = AtomicBool::new(false);

tokio::task_local! {
    /// The traceparent of the message being handled (the pass-through when not exporting).
    static CARRIED: Option<String>;
}

pub(crate) fn set_exporting() {
    EXPORTING.store(true, Ordering::Relaxed);
}

/// Whether this process exports spans (then contexts are real spans, not pass-through).
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// A well-formed W3C traceparent (`00-<32 hex>-<16 hex>-<2 hex>`, ids not all zero), or None.
/// Always its first 55 characters: version 00 has exactly four fields, and of a later
/// version's, only those four are read (W3C), so a caller's header, carried on every message
/// of the run, cannot grow them.
pub fn valid(v: &str) -> Option<&str> {
    const LEN: usize = 55;
    let v = v.trim();
    let parts: Vec<&str> = v.splitn(5, '-').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let ok = parts.len() >= 4
        && (parts.len() == 4 || parts[0] != "00")
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && hex(parts[2], 16)
        && hex(parts[3], 2)
        && parts[1].bytes().any(|b| b != b'0')
        && parts[2].bytes().any(|b| b != b'0');
    ok.then(|| &v[..LEN])
}

/// The traceparent of a NATS message, if it carries a valid one.
pub fn traceparent(headers: Option<&HeaderMap>) -> Option<String> {
    headers.and_then(|h| h.get(TRACEPARENT)).and_then(|v| valid(v.as_str())).map(str::to_string)
}

/// The traceparent of an HTTP request (the gateway's callers), if valid.
pub fn parent_from_http(headers: &http::HeaderMap) -> Option<String> {
    headers.get(TRACEPARENT).and_then(|v| v.to_str().ok()).and_then(valid).map(str::to_string)
}

struct One<'a>(&'a str);

impl Extractor for One<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        (key == TRACEPARENT).then_some(self.0)
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT]
    }
}

struct Nats<'a>(&'a mut HeaderMap);

impl Injector for Nats<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value.as_str());
    }
}

/// Make `traceparent` the parent of `span` (before the span is first entered). Without
/// export this does nothing: [`carrying`] passes the header on instead.
pub fn adopt(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(tp) = traceparent.filter(|_| exporting()) else { return };
    let cx = TraceContextPropagator::new().extract(&One(tp));
    if cx.span().span_context().is_remote() {
        let _ = span.set_parent(cx);
    }
}

/// [`parent_from_http`] and [`adopt`] in one: the gateway's request span continues the
/// caller's trace, and messages published inside it carry that trace on.
pub fn continue_http(span: &tracing::Span, headers: &http::HeaderMap) -> Option<String> {
    let tp = parent_from_http(headers);
    adopt(span, tp.as_deref());
    tp
}

/// Run `f` with `traceparent` as the context to pass on when this process makes no spans.
pub async fn carrying<F: Future>(traceparent: Option<String>, f: F) -> F::Output {
    CARRIED.scope(traceparent, f).await
}

/// Run `f` to its end in a task of its own and wait for it: the caller dropped meanwhile (a
/// client that left) does not cut it off. The task goes on with this one's trace (the current
/// span, the context this task carries: a task inherits neither); a panic in it goes on in
/// the caller. None only when the task was cancelled (the runtime shutting down).
pub async fn to_the_end<F>(f: F) -> Option<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let carried = CARRIED.try_with(|c| c.clone()).ok().flatten();
    match tokio::spawn(tracing::Instrument::in_current_span(carrying(carried, f))).await {
        Ok(out) => Some(out),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => None,
    }
}

/// The traceparent to publish now: the current span's when exporting, else the carried one.
pub fn current() -> Option<String> {
    if exporting() {
        let mut h = HeaderMap::new();
        let cx = tracing::Span::current().context();
        if cx.span().span_context().is_valid() {
            TraceContextPropagator::new().inject_context(&cx, &mut Nats(&mut h));
            if let Some(v) = h.get(TRACEPARENT) {
                return Some(v.as_str().to_string());
            }
        }
    }
    CARRIED.try_with(|c| c.clone()).ok().flatten()
}

/// Write the current trace context into `headers` (every message pitcrew publishes).
pub fn inject(headers: &mut HeaderMap) {
    if let Some(tp) = current() {
        headers.insert(TRACEPARENT, tp.as_str());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn only_well_formed_traceparents_are_taken() {
        assert_eq!(valid(TP), Some(TP));
        assert_eq!(valid("00-00000000000000000000000000000000-00f067aa0ba902b7-01"), None);
        assert_eq!(valid("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"), None);
        assert_eq!(valid("garbage"), None);
        // Nothing past the four fields is carried: version 00 has no more, a later one's are
        // not read (a caller's 400 KB header would ride on every message of the run).
        assert_eq!(valid(&format!("{TP}-{}", "x".repeat(400_000))), None);
        let later = format!("cc{}-{}", &TP[2..], "x".repeat(400_000));
        assert_eq!(valid(&later), Some(&later[..55]));
        assert_eq!(valid("00-4bf92f-00f067aa0ba902b7-01"), None);
        let mut h = http::HeaderMap::new();
        h.insert(TRACEPARENT, TP.parse().unwrap());
        assert_eq!(parent_from_http(&h).as_deref(), Some(TP));
    }

    #[tokio::test]
    async fn without_export_the_incoming_traceparent_is_passed_on() {
        assert_eq!(current(), None);
        let out = carrying(Some(TP.to_string()), async {
            let mut h = HeaderMap::new();
            inject(&mut h);
            h.get(TRACEPARENT).map(|v| v.as_str().to_string())
        })
        .await;
        assert_eq!(out.as_deref(), Some(TP));
    }
}
