//! Local server processes the demo and the tests start (nats-server, sshd, postgres): a free
//! port to give them, and a bounded wait for them to become ready.

use std::net::TcpListener;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

/// A free TCP port on loopback (the kernel's choice, released before returning).
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The uid and gid of the account `user` (from `id`).
pub fn account_ids(user: &str) -> Result<(u32, u32), String> {
    let id = |flag: &str| -> Result<u32, String> {
        let out =
            std::process::Command::new("id").args([flag, user]).output().map_err(|e| format!("running id: {e}"))?;
        if !out.status.success() {
            return Err(format!("no such user '{user}': {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
        String::from_utf8_lossy(&out.stdout).trim().parse().map_err(|e| format!("id {flag} {user}: {e}"))
    };
    Ok((id("-u")?, id("-g")?))
}

/// Whether something accepts TCP connections on 127.0.0.1:`port`.
pub fn listening(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// Wait until `ready()` holds. Fails at once if `child` exits (saying how, with its log) and
/// after `within` otherwise. `what` names the server in the error.
pub fn wait_ready(
    what: &str,
    child: &mut Child,
    log: &Path,
    within: Duration,
    mut ready: impl FnMut() -> bool,
) -> Result<(), String> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if ready() {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            return Err(format!("{what} exited with {status}: {}", log.trim()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(format!("{what} not ready after {} s", within.as_secs()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_that_exits_is_reported_with_its_log() {
        let dir = std::env::temp_dir().join(format!("pitcrew-process-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("log");
        std::fs::write(&log, "bad flag\n").unwrap();
        let mut child = std::process::Command::new("false").spawn().unwrap();
        let err = wait_ready("demo", &mut child, &log, Duration::from_secs(5), || false).unwrap_err();
        assert!(err.starts_with("demo exited with") && err.ends_with("bad flag"), "{err}");
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let err = wait_ready("demo", &mut child, &log, Duration::from_millis(100), || false).unwrap_err();
        assert_eq!(err, "demo not ready after 0 s");
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(account_ids("root").unwrap(), (0, 0));
        assert!(account_ids("no-such-user-pitcrew").unwrap_err().contains("no such user"));
        let port = free_port().unwrap();
        assert!(!listening(port));
        let _ = std::fs::remove_dir_all(dir);
    }
}
