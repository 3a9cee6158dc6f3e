//! One tracing set-up for every binary: `PITCREW_LOG` (or `RUST_LOG`) filters the log lines,
//! `PITCREW_LOG_FORMAT=json` (or `--log-format json`) switches them to JSON lines on stderr.
//! With `[telemetry] otlp_endpoint` set, pitcrew's spans are also exported over OTLP/HTTP
//! (JSON encoding) by a batch processor on its own thread: an unreachable collector is
//! reported once and never slows or stops the crew. Keep the [`Guard`] alive until exit: its
//! drop flushes the spans still queued.

use crate::config::TelemetryConfig;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanExporter};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

/// The OpenTelemetry set-up could not be built; the message names the setting.
#[derive(Debug, thiserror::Error)]
#[error("[telemetry] {0}")]
pub struct TelemetryError(String);

/// Flushes and stops span export when dropped (a no-op without export).
#[must_use = "dropping the guard stops span export"]
pub struct Guard {
    provider: Option<SdkTracerProvider>,
}

impl Guard {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Export what is queued now and stop (also done on drop).
    pub fn shutdown(&mut self) {
        if let Some(p) = self.provider.take() {
            if let Err(e) = p.shutdown_with_timeout(Duration::from_secs(5)) {
                tracing::warn!(error = %e, "flushing spans at shutdown failed: some spans are lost");
            }
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn log_filter(default: &str) -> EnvFilter {
    let filter = std::env::var("PITCREW_LOG")
        .ok()
        .or_else(|| std::env::var("RUST_LOG").ok())
        .unwrap_or_else(|| default.to_string());
    EnvFilter::try_new(&filter).unwrap_or_else(|_| EnvFilter::new(default))
}

/// Log lines only (no export): for commands that run before or without a config.
pub fn init(default: &str) {
    let _ = init_with(default, &TelemetryConfig::default());
}

/// Logs, plus span export when `cfg.otlp_endpoint` is set. Installs the global subscriber
/// (a second call in one process changes nothing and exports nothing).
pub fn init_with(default: &str, cfg: &TelemetryConfig) -> Result<Guard, TelemetryError> {
    let json = std::env::var("PITCREW_LOG_FORMAT").as_deref() == Ok("json");
    // Colour only on a terminal: a log a file, journald or `docker logs` keeps is plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = log_lines(std::io::stderr, json, ansi, log_filter(default));
    let Some(endpoint) = cfg.otlp_endpoint.as_deref().filter(|e| !e.trim().is_empty()) else {
        let _ = tracing_subscriber::registry().with(fmt).try_init();
        return Ok(Guard { provider: None });
    };
    let endpoint = traces_url(endpoint);
    // What logs and errors show of it: a collector behind basic auth has its password in it.
    let shown = crate::config::redact_url(&endpoint);
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpJson)
        .with_endpoint(endpoint.clone())
        .with_timeout(Duration::from_secs(cfg.export_timeout_secs.max(1)))
        .build()
        .map_err(|e| {
            TelemetryError(format!("otlp_endpoint = \"{shown}\": {}", crate::config::redact_urls_in(&e.to_string())))
        })?;
    let exporter = WarnOnce { inner: exporter, endpoint: shown.clone(), failing: AtomicBool::new(false) };
    let resource = opentelemetry_sdk::Resource::builder().with_service_name(cfg.service_name.clone()).build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(cfg.sample_ratio))))
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("pitcrew");
    // pitcrew's own spans at info and above: never the HTTP client's, so exporting cannot
    // feed on itself.
    let otel = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_threads(false)
        .with_filter(tracing_subscriber::filter::filter_fn(|m| {
            m.is_span() && m.target().starts_with("pitcrew") && *m.level() <= tracing::Level::INFO
        }))
        .boxed();
    if tracing_subscriber::registry().with(fmt).with(otel).try_init().is_err() {
        // Someone installed a subscriber first: nothing would reach our exporter.
        let _ = provider.shutdown();
        return Ok(Guard { provider: None });
    }
    crate::trace::set_exporting();
    tracing::info!(endpoint = %shown, service = %cfg.service_name, "exporting spans over OTLP/HTTP");
    Ok(Guard { provider: Some(provider) })
}

/// The log-line layer, written to `out`, with every secret a line shows redacted, whichever
/// field or message carries it: a wait's reason quotes the command it waits for (`--password
/// ...` as an inventory wrote it), an error quotes what failed, and a new log line would have to
/// remember to redact. Text lines have each field's value redacted before it is written
/// ([`RedactedFields`]: the names stay, `secret=DB_PASS` names a secret and shows none); JSON
/// lines have their string values redacted ([`RedactedJson`]), so each is still one JSON object.
fn log_lines<F, W>(out: F, json: bool, ansi: bool, filter: EnvFilter) -> Box<dyn Layer<Registry> + Send + Sync>
where
    F: Fn() -> W + Send + Sync + 'static,
    W: Write + 'static,
{
    if json {
        let fmt = tracing_subscriber::fmt::layer().with_writer(move || RedactedJson(out())).with_ansi(ansi);
        fmt.json().with_filter(filter).boxed()
    } else {
        let fmt = tracing_subscriber::fmt::layer().with_writer(out).with_ansi(ansi).fmt_fields(RedactedFields);
        fmt.compact().with_filter(filter).boxed()
    }
}

/// Text lines' fields as the default format writes them (`name=value`, the message bare), each
/// value redacted first: redacting the finished line would read field names as secrets' names
/// and meet colour codes between a name and its value.
struct RedactedFields;

impl<'w> FormatFields<'w> for RedactedFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'w>, fields: R) -> std::fmt::Result {
        let mut visitor = FieldsVisitor { writer, result: Ok(()), first: true };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct FieldsVisitor<'w> {
    writer: Writer<'w>,
    result: std::fmt::Result,
    first: bool,
}

impl FieldsVisitor<'_> {
    fn field(&mut self, field: &Field, value: &str, quoted: bool) {
        let name = field.name();
        if self.result.is_err() || name.starts_with("log.") {
            return;
        }
        let name = name.strip_prefix("r#").unwrap_or(name);
        // Redacted, then made inert (an escape sequence a decider or an alert put in a message
        // shown escaped, not acted on by the terminal that shows the log).
        let value = redact_logged(value);
        let value = pitcrew_model::trim::printable(&value);
        let gap = if std::mem::take(&mut self.first) { "" } else { " " };
        self.result = match (name, quoted) {
            ("message", _) => write!(self.writer, "{gap}{value}"),
            (_, true) => write!(self.writer, "{gap}{name}={value:?}"),
            (_, false) => write!(self.writer, "{gap}{name}={value}"),
        };
    }
}

impl Visit for FieldsVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.field(field, value, true);
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.field(field, &format!("{value:?}"), false);
    }

    /// An error with the errors it comes from, `: `-joined.
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        let mut text = value.to_string();
        let mut source = value.source();
        while let Some(s) = source {
            text.push_str(": ");
            text.push_str(&s.to_string());
            source = s.source();
        }
        self.field(field, &text, false);
    }
}

/// A JSON log line's way out: each string in it (keys too) read, redacted and written again
/// where it shows a secret, the rest as the formatter wrote it (the order of keys, numbers);
/// one write a line, as the formatter hands it over.
struct RedactedJson<W>(W);

impl<W: Write> Write for RedactedJson<W> {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(line);
        self.0.write_all(redact_json_text(&text).as_bytes())?;
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// `json` with the secrets of each string literal redacted in place. A quote or a backslash is
/// never part of a multi-byte character, so the literals are found byte by byte.
fn redact_json_text(json: &str) -> std::borrow::Cow<'_, str> {
    let bytes = json.as_bytes();
    let (mut out, mut copied, mut at) = (String::new(), 0, 0);
    while at < bytes.len() {
        if bytes[at] != b'"' {
            at += 1;
            continue;
        }
        let start = at;
        at += 1;
        while at < bytes.len() && bytes[at] != b'"' {
            at += if bytes[at] == b'\\' { 2 } else { 1 };
        }
        let end = (at + 1).min(bytes.len());
        at = end;
        let Ok(value) = serde_json::from_str::<String>(&json[start..end]) else { continue };
        if let std::borrow::Cow::Owned(redacted) = redact_logged(&value) {
            out.push_str(&json[copied..start]);
            out.push_str(&serde_json::Value::String(redacted).to_string());
            copied = end;
        }
    }
    if copied == 0 {
        return std::borrow::Cow::Borrowed(json);
    }
    out.push_str(&json[copied..]);
    std::borrow::Cow::Owned(out)
}

/// A logged value redacted; a `?`-formatted string (`"DB_PASSWORD=\"x\""`) also read
/// without its escapes, which would hide a quoted secret from the patterns, and written
/// escaped again where that shows one.
fn redact_logged(value: &str) -> std::borrow::Cow<'_, str> {
    if let Some(inner) = debug_literal(value) {
        if let std::borrow::Cow::Owned(redacted) = pitcrew_model::redact::redact(&inner) {
            return std::borrow::Cow::Owned(format!("{redacted:?}"));
        }
    }
    pitcrew_model::redact::redact(value)
}

/// What a string's `Debug` form (`"a \"b\"\n"`) holds, if `text` is one with an escape in it.
fn debug_literal(text: &str) -> Option<String> {
    let inner = text.strip_prefix('"')?.strip_suffix('"')?;
    if !inner.contains('\\') {
        return None;
    }
    let (mut out, mut chars) = (String::with_capacity(inner.len()), inner.chars());
    while let Some(c) = chars.next() {
        match c {
            '"' => return None,
            '\\' => out.push(match chars.next()? {
                'n' => '\n',
                'r' => '\r',
                't' => '\t',
                '0' => '\0',
                c @ ('"' | '\'' | '\\') => c,
                'u' => {
                    let hex: String = chars.by_ref().skip(1).take_while(|&c| c != '}').collect();
                    char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?
                }
                _ => return None,
            }),
            c => out.push(c),
        }
    }
    Some(out)
}

/// `http://host:4318` → `http://host:4318/v1/traces`; a URL naming the path is kept.
fn traces_url(endpoint: &str) -> String {
    let e = endpoint.trim().trim_end_matches('/');
    if e.ends_with("/v1/traces") {
        e.to_string()
    } else {
        format!("{e}/v1/traces")
    }
}

/// The OTLP exporter, reporting an unreachable collector once (and its return once), instead
/// of once per batch.
#[derive(Debug)]
struct WarnOnce<E> {
    inner: E,
    endpoint: String,
    failing: AtomicBool,
}

impl<E: SpanExporter> SpanExporter for WarnOnce<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        let res = self.inner.export(batch).await;
        match &res {
            Err(e) if !self.failing.swap(true, Ordering::Relaxed) => tracing::warn!(
                endpoint = %self.endpoint, error = %crate::config::redact_urls_in(&e.to_string()), dropped = n,
                "cannot export spans to the OTLP collector: pitcrew keeps running and drops spans until it answers"
            ),
            Ok(()) if self.failing.swap(false, Ordering::Relaxed) => {
                tracing::info!(endpoint = %self.endpoint, "the OTLP collector answers again: exporting spans")
            }
            _ => {}
        }
        res
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that comes from another.
    #[derive(Debug)]
    struct Wrapped(std::io::Error);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("wrapped")
        }
    }

    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    /// A buffer the log layer writes to, read back by the test.
    #[derive(Clone, Default)]
    struct Lines(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Whatever field or message carries a secret (a wait's reason quoting its command, an
    /// error quoting a value this process knows is secret, a quoted value, one that ends a
    /// field), the log line shows it redacted, in either format, coloured or not; the names of
    /// fields stay (a secret's name is no secret), and a JSON line is still one JSON object.
    #[test]
    fn log_lines_are_redacted_whatever_carries_the_secret() {
        let known = "kn0wn-Secret-4417";
        pitcrew_model::redact::register_secret(known).unwrap();
        for (json, ansi) in [(false, false), (false, true), (true, false)] {
            let lines = Lines::default();
            let out = lines.clone();
            let layer = log_lines(move || out.clone(), json, ansi, EnvFilter::new("info"));
            let subscriber = tracing_subscriber::registry().with(layer);
            tracing::subscriber::with_default(subscriber, || {
                let why = "command 1 (`/opt/web/start --password hunter2-ABC`) may still be running";
                tracing::info!(reason = %why, delivered = 2, "waiting");
                tracing::warn!(error = %format!("login refused for {known}"), attempt = 3, "will retry");
                tracing::info!(command = "psql --password pa55-SECRET", host = "db1", "ran");
                tracing::info!(config = r#"password="q-uoted-9""#, "read");
                tracing::warn!(secret = %"DB_PASS", "a secret commands name is not set");
                tracing::info!(line = ?"export DB_PASSWORD=\"dq-Secret-77\" \u{1b}", "debugged");
                tracing::info!("token=tok-XYZ-123456 in a message");
                tracing::warn!(by = %"mallory\u{1b}]52;c;aGk=\u{7}", "decision refused");
                let cause = std::io::Error::other("password=s0urce-SECRET");
                let failed = Wrapped(cause);
                tracing::warn!(error = &failed as &(dyn std::error::Error + 'static), "store failed");
            });
            let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
            assert_eq!(text.lines().count(), 9, "{text}");
            assert!(!text.contains('\u{1b}') || ansi, "an escape sequence from a decider is shown escaped: {text}");
            assert!(text.contains("mallory"), "{text}");
            assert!(
                !text.contains("s0urce-SECRET") && text.contains("wrapped"),
                "an error's sources, redacted: {text}"
            );
            for secret in ["hunter2-ABC", known, "pa55-SECRET", "q-uoted-9", "tok-XYZ-123456", "dq-Secret-77"] {
                assert!(!text.contains(secret), "json {json}, ansi {ansi}: {secret} in {text}");
            }
            // JSON lines show an error without its sources.
            assert_eq!(text.matches("[REDACTED]").count(), if json { 6 } else { 7 }, "{text}");
            for kept in
                ["waiting", "login refused for", "db1", "DB_PASS", "a secret commands name is not set", "export"]
            {
                assert!(text.contains(kept), "json {json}, ansi {ansi}: {kept} not in {text}");
            }
            if json {
                for line in text.lines() {
                    let line: serde_json::Value = serde_json::from_str(line).unwrap();
                    assert!(line["fields"]["message"].is_string(), "{line}");
                }
                assert!(text.contains(r#""host":"db1""#), "{text}");
                let first = text.lines().next().unwrap_or_default();
                assert!(first.starts_with(r#"{"timestamp":"#), "the formatter's order of keys: {first}");
            } else if !ansi {
                let refused = text.lines().find(|l| l.contains("decision refused")).unwrap_or_default();
                assert!(refused.contains(r"\u{1b}]52;c;aGk=\u{7}"), "{refused}");
            }
        }
    }

    #[test]
    fn the_traces_path_is_added_once() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/v1/traces"), "http://c:4318/v1/traces");
    }
}
