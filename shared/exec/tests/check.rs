//! Health checks against real listeners started by the test: HTTP status and body, TCP
//! refusal and timeouts, and command checks through the local executor.

use pitcrew_exec::{run_check, LocalExecutor};
use pitcrew_model::CheckSpec;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Serve every connection with `status` and `body` until the test ends; returns the port.
async fn responder(status: &'static str, body: &'static str) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut req = Vec::new();
                let mut buf = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 16 * 1024 {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let resp =
                    format!("HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len());
                let _ = sock.write_all(resp.as_bytes()).await;
            });
        }
    });
    port
}

/// A port nothing listens on: bind one, then let it go.
async fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}

fn http(port: u16) -> CheckSpec {
    let url = format!("http://127.0.0.1:{port}/health");
    CheckSpec::Http { url, expect_status: 200, timeout_ms: 2000 }
}

fn command(command: &str, running_indicator: Option<&str>) -> CheckSpec {
    CheckSpec::Command {
        command: command.to_string(),
        running_indicator: running_indicator.map(str::to_string),
        timeout_ms: 2000,
    }
}

#[tokio::test]
async fn http_200_is_healthy() {
    let port = responder("200 OK", "ok\n").await;
    let out = run_check(&http(port), "local", &LocalExecutor::new(4096)).await;
    assert!(out.healthy, "{out:?}");
    assert_eq!(out.detail, format!("GET http://127.0.0.1:{port}/health -> 200"));
    assert_eq!(out.output, "ok\n");
}

#[tokio::test]
async fn http_503_is_unhealthy_with_the_body_in_detail() {
    let port = responder("503 Service Unavailable", "stuck: worker pool deadlocked\n").await;
    let out = run_check(&http(port), "local", &LocalExecutor::new(4096)).await;
    assert!(!out.healthy);
    assert_eq!(
        out.detail,
        format!(
            "GET http://127.0.0.1:{port}/health returned 503 (expected 200): \
             stuck: worker pool deadlocked"
        )
    );
    assert_eq!(out.output, "stuck: worker pool deadlocked\n");
}

#[tokio::test]
async fn http_refused_says_connection_refused() {
    let port = closed_port().await;
    let out = run_check(&http(port), "local", &LocalExecutor::new(4096)).await;
    assert!(!out.healthy);
    assert!(out.detail.contains("connection refused"), "{}", out.detail);
    assert!(!out.detail.contains('\n'));
}

#[tokio::test]
async fn http_silence_times_out() {
    // Accepts (the backlog does) but never answers.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}/health");
    let spec = CheckSpec::Http { url, expect_status: 200, timeout_ms: 300 };
    let started = Instant::now();
    let out = run_check(&spec, "local", &LocalExecutor::new(4096)).await;
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(!out.healthy);
    assert!(out.detail.contains("timed out after 300 ms"), "{}", out.detail);
    drop(listener);
}

#[tokio::test]
async fn tcp_open_and_closed() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let open = listener.local_addr().unwrap().to_string();
    let spec = CheckSpec::Tcp { address: open.clone(), timeout_ms: 2000 };
    let out = run_check(&spec, "local", &LocalExecutor::new(4096)).await;
    assert!(out.healthy, "{out:?}");
    assert_eq!(out.detail, format!("connect {open} -> ok"));

    let address = format!("127.0.0.1:{}", closed_port().await);
    let spec = CheckSpec::Tcp { address: address.clone(), timeout_ms: 2000 };
    let out = run_check(&spec, "local", &LocalExecutor::new(4096)).await;
    assert!(!out.healthy);
    assert!(out.detail.starts_with(&format!("connect {address} failed: ")), "{}", out.detail);
    assert!(out.detail.contains("connection refused"), "{}", out.detail);
}

#[tokio::test]
async fn command_check_uses_exit_code_and_running_indicator() {
    let exec = LocalExecutor::new(4096);
    let status = "printf 'web.service\\n   Active: active (running)\\n'";

    let out = run_check(&command(status, Some("active (running)")), "local", &exec).await;
    assert!(out.healthy, "{out:?}");
    assert!(out.output.contains("Active: active (running)"));

    let out = run_check(&command(status, Some("inactive")), "local", &exec).await;
    assert!(!out.healthy);
    assert!(out.detail.contains("lacks 'inactive'"), "{}", out.detail);

    let out = run_check(&command("true", None), "local", &exec).await;
    assert!(out.healthy, "{out:?}");

    let failing = "sh -c 'echo \"Unit web.service not found.\" >&2; exit 4'";
    let out = run_check(&command(failing, None), "local", &exec).await;
    assert!(!out.healthy);
    assert!(out.detail.contains("exited 4: Unit web.service not found."), "{}", out.detail);
}

#[tokio::test]
async fn command_check_failures_are_outcomes_not_errors() {
    let exec = LocalExecutor::new(4096);
    let out = run_check(&command("definitely-not-a-tool-xyz", None), "local", &exec).await;
    assert!(!out.healthy);
    assert!(out.detail.contains("cannot start"), "{}", out.detail);

    let out = run_check(&command("true", None), "db-7", &exec).await;
    assert!(!out.healthy);
    assert!(out.detail.contains("unknown host 'db-7'"), "{}", out.detail);

    let slow = CheckSpec::Command { command: "sleep 5".into(), running_indicator: None, timeout_ms: 200 };
    let out = run_check(&slow, "local", &exec).await;
    assert!(!out.healthy);
    assert!(out.detail.contains("timed out"), "{}", out.detail);
}

/// What a check saw is logged by the monitor and kept as evidence: a secret in the check's
/// URL, the body, the command line or its output never reaches either.
#[tokio::test]
async fn secrets_in_a_check_never_reach_its_detail_or_output() {
    let refused = closed_port().await;
    let spec = CheckSpec::Http {
        url: format!("http://admin:s3cretpw@127.0.0.1:{refused}/health"),
        expect_status: 200,
        timeout_ms: 2000,
    };
    let out = run_check(&spec, "local", &LocalExecutor::new(4096)).await;
    assert!(!out.healthy);
    assert!(out.detail.contains("127.0.0.1") && !out.detail.contains("s3cretpw"), "{}", out.detail);

    let port = responder("503 Service Unavailable", "db password=hunter22 rejected\n").await;
    let spec = CheckSpec::Http {
        url: format!("http://127.0.0.1:{port}/health?token=abc123secret"),
        expect_status: 200,
        timeout_ms: 2000,
    };
    let out = run_check(&spec, "local", &LocalExecutor::new(4096)).await;
    for shown in [&out.detail, &out.output] {
        assert!(shown.contains("[REDACTED]"), "{shown}");
        assert!(!shown.contains("hunter22") && !shown.contains("abc123secret"), "{shown}");
    }

    let check = command("sh -c 'echo api_key=k3y-value; echo password=hunter22 >&2; exit 3' --token t0ken", None);
    let out = run_check(&check, "local", &LocalExecutor::new(4096)).await;
    assert!(!out.healthy);
    for shown in [&out.detail, &out.output] {
        for secret in ["k3y-value", "hunter22", "t0ken"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
    }
    assert!(out.detail.contains("exited 3"), "{}", out.detail);
}
