//! Health checks (HTTP, TCP, command): whether a service works, with a one-line reason that
//! diagnosis and error-pattern rules can match on.

use crate::Executor;
use pitcrew_model::redact::redact;
use pitcrew_model::trim::{clip, trim_output};
use pitcrew_model::CheckSpec;
use std::sync::OnceLock;
use std::time::Duration;

/// Bytes of an HTTP body we read; the rest is never downloaded.
const MAX_BODY: usize = 64 * 1024;
/// Bytes of body or stdout kept in [`CheckOutcome::output`].
const MAX_OUTPUT: usize = 4096;
/// Bytes of quoted text (body line, command, stderr line) kept in a detail.
const MAX_QUOTE: usize = 200;
/// Upper bound on any check's timeout, whatever the inventory says: checks run inside
/// remediation loops, and a typo like `timeout_ms: 2000000` must not stall one for days.
const MAX_TIMEOUT: Duration = Duration::from_secs(300);

/// What one health check found.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckOutcome {
    pub healthy: bool,
    /// One human-readable line saying what was tried and what happened, e.g.
    /// `GET http://127.0.0.1:8080/health returned 503 (expected 200): stuck`.
    pub detail: String,
    /// The response body or command stdout, trimmed to 4096 bytes (evidence for diagnosis).
    pub output: String,
    /// The check's command did not run, or may not have (its host unreachable, a secret this
    /// worker lacks, its program missing, a failed channel): nothing is known of the service,
    /// so a fix must not be judged by it.
    pub inconclusive: Option<Inconclusive>,
}

impl CheckOutcome {
    /// Redacted here, once for every caller: the monitor logs the detail, diagnose keeps
    /// both as evidence, and a check's URL, command line, body or output may carry a secret.
    fn new(healthy: bool, detail: String, output: &str) -> Self {
        let output = trim_output(output, MAX_OUTPUT);
        Self { healthy, detail: one_line(&redact(&detail)), output: redact(&output).into_owned(), inconclusive: None }
    }
}

/// Why a check told nothing of the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inconclusive {
    /// Its host did not answer or refused the login.
    Unreachable,
    /// Anything else that kept its command from running (or from being known to have run).
    NotRun,
}

/// Run one health check. Never errors: an unreachable service is an unhealthy outcome with
/// the reason in `detail`, because "cannot reach it" is exactly what the caller must know.
pub async fn run_check(spec: &CheckSpec, host: &str, executor: &dyn Executor) -> CheckOutcome {
    match spec {
        CheckSpec::Http { url, expect_status, timeout_ms } => {
            http_check(url, *expect_status, bounded(*timeout_ms)).await
        }
        CheckSpec::Tcp { address, timeout_ms } => tcp_check(address, bounded(*timeout_ms)).await,
        CheckSpec::Command { command, running_indicator, timeout_ms } => {
            let indicator = running_indicator.as_deref();
            command_check(command, indicator, host, bounded(*timeout_ms), executor).await
        }
    }
}

fn bounded(timeout_ms: u64) -> Duration {
    Duration::from_millis(timeout_ms).min(MAX_TIMEOUT)
}

/// One client for all HTTP checks (connection pools are per client). Proxies from the
/// environment are ignored: a health check must reach the service itself. Redirects are not
/// followed: a dead app's `/health` sent on to a maintenance or login page that answers 200
/// is not healthy; a check that expects the redirect says so (`expect_status = 302`).
fn client() -> Result<&'static reqwest::Client, String> {
    static CLIENT: OnceLock<Result<reqwest::Client, String>> = OnceLock::new();
    CLIENT
        .get_or_init(|| {
            reqwest::Client::builder()
                .no_proxy()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .map_err(|e| error_chain(&e))
        })
        .as_ref()
        .map_err(Clone::clone)
}

async fn http_check(url: &str, expect: u16, timeout: Duration) -> CheckOutcome {
    let client = match client() {
        Ok(c) => c,
        Err(e) => return CheckOutcome::new(false, format!("GET {url} failed: {e}"), ""),
    };
    let fetch = async {
        let mut resp = client.get(url).send().await?;
        let status = resp.status().as_u16();
        let location = resp.headers().get(reqwest::header::LOCATION).and_then(|v| v.to_str().ok()).map(str::to_string);
        let mut body = Vec::new();
        while body.len() < MAX_BODY {
            let Some(chunk) = resp.chunk().await? else {
                break;
            };
            let room = MAX_BODY - body.len();
            body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        }
        Ok::<_, reqwest::Error>((status, location, pitcrew_model::trim::text_of(&body)))
    };
    match tokio::time::timeout(timeout, fetch).await {
        Err(_) => CheckOutcome::new(false, format!("GET {url} failed: timed out after {} ms", timeout.as_millis()), ""),
        Ok(Err(e)) => {
            // A refused connection is the common case: say it plainly, not reqwest's chain.
            if io_kind(&e) == Some(std::io::ErrorKind::ConnectionRefused) {
                return CheckOutcome::new(false, format!("GET {url} failed: connection refused"), "");
            }
            let mut detail = format!("GET {url} failed: {}", error_chain(&e));
            if e.is_timeout() && !detail.contains("timed out") {
                detail.push_str(" (timed out)");
            }
            CheckOutcome::new(false, detail, "")
        }
        Ok(Ok((status, _, body))) if status == expect => {
            CheckOutcome::new(true, format!("GET {url} -> {status}"), &body)
        }
        Ok(Ok((status, location, body))) => {
            let mut detail = format!("GET {url} returned {status} (expected {expect})");
            let first = body.lines().map(str::trim).find(|l| !l.is_empty());
            if let Some(to) = location.filter(|_| (300..400).contains(&status)) {
                detail.push_str(&format!(": a redirect to {}, not followed", clip(&to, MAX_QUOTE)));
            } else if let Some(line) = first {
                detail.push_str(&format!(": {}", clip(line, MAX_QUOTE)));
            }
            CheckOutcome::new(false, detail, &body)
        }
    }
}

async fn tcp_check(address: &str, timeout: Duration) -> CheckOutcome {
    match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(address)).await {
        Ok(Ok(_stream)) => CheckOutcome::new(true, format!("connect {address} -> ok"), ""),
        Ok(Err(e)) => {
            let mut detail = format!("connect {address} failed: {e}");
            if e.kind() == std::io::ErrorKind::ConnectionRefused {
                mention_refused(&mut detail);
            }
            CheckOutcome::new(false, detail, "")
        }
        Err(_) => CheckOutcome::new(
            false,
            format!("connect {address} failed: timed out after {} ms", timeout.as_millis()),
            "",
        ),
    }
}

async fn command_check(
    command: &str,
    indicator: Option<&str>,
    host: &str,
    timeout: Duration,
    executor: &dyn Executor,
) -> CheckOutcome {
    let shown = clip(command, MAX_QUOTE);
    let out = match executor.run(host, command, timeout).await {
        Ok(out) => out,
        Err(e) => {
            let mut outcome = CheckOutcome::new(false, format!("`{shown}` on {host}: {e}"), "");
            outcome.inconclusive = Some(match e {
                crate::ExecError::Unreachable(_) => Inconclusive::Unreachable,
                _ => Inconclusive::NotRun,
            });
            return outcome;
        }
    };
    let detail = if out.timed_out {
        format!("`{shown}` timed out after {} ms", timeout.as_millis())
    } else if !out.success() {
        let code = out.exit_code.map_or("by a signal".to_string(), |c| c.to_string());
        let mut d = format!("`{shown}` exited {code}");
        if let Some(line) = out.stderr.lines().map(str::trim).find(|l| !l.is_empty()) {
            d.push_str(&format!(": {}", clip(line, MAX_QUOTE)));
        }
        d
    } else if let Some(ind) = indicator.filter(|i| !out.stdout.contains(*i)) {
        format!("`{shown}` exited 0 but its output lacks '{}'", clip(ind, MAX_QUOTE))
    } else {
        return CheckOutcome::new(true, format!("`{shown}` -> ok"), &out.stdout);
    };
    CheckOutcome::new(false, detail, &out.stdout)
}

/// Error-pattern rules match on the lowercase phrase; OS messages capitalise it.
fn mention_refused(detail: &mut String) {
    if !detail.contains("connection refused") {
        detail.push_str(" (connection refused)");
    }
}

/// `e` and its sources joined with ": ", skipping sources whose text is already shown
/// (reqwest's top-level message alone says only "error sending request").
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}

/// The kind of the first I/O error in `e`'s source chain, if any.
fn io_kind(e: &(dyn std::error::Error + 'static)) -> Option<std::io::ErrorKind> {
    let mut source = Some(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        source = s.source();
    }
    None
}

/// Details are single lines: logs and timelines show them verbatim.
fn one_line(text: &str) -> String {
    let flat: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    clip(&flat, 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server on loopback answering every request with `head` (status line and headers).
    async fn answering(head: &'static str) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let mut buf = [0u8; 2048];
                let _ = sock.read(&mut buf).await;
                let _ = sock
                    .write_all(format!("{head}\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok").as_bytes())
                    .await;
            }
        });
        format!("http://{addr}/health")
    }

    #[tokio::test]
    async fn a_redirect_is_not_followed_to_a_page_that_answers() {
        // The login page it points to would answer 200.
        let login = answering("HTTP/1.1 200 OK").await;
        let head: &'static str = Box::leak(format!("HTTP/1.1 302 Found\r\nlocation: {login}").into_boxed_str());
        let url = answering(head).await;
        let out = http_check(&url, 200, Duration::from_secs(5)).await;
        assert!(!out.healthy, "{out:?}");
        assert!(out.detail.contains("returned 302 (expected 200): a redirect to"), "{}", out.detail);
        // A check that expects the redirect has it.
        assert!(http_check(&url, 302, Duration::from_secs(5)).await.healthy);
        assert!(http_check(&login, 200, Duration::from_secs(5)).await.healthy);
    }
}
