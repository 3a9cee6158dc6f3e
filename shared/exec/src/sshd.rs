//! A real OpenSSH server for tests: its own host key, an authorized user key, a known_hosts
//! file that trusts it, on a free loopback port; killed on drop, restartable.

use anyhow::{bail, Context};
use pitcrew_model::HostSpec;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SSHD: &str = "/usr/sbin/sshd";

/// A running sshd that accepts the test's key for the current user.
pub struct Sshd {
    child: Option<Child>,
    pub port: u16,
    pub dir: tempfile::TempDir,
    pub user: String,
}

fn keygen(path: &Path) -> anyhow::Result<()> {
    let ok = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .stdin(Stdio::null())
        .status()
        .context("ssh-keygen (package openssh-client)")?
        .success();
    if !ok {
        bail!("ssh-keygen failed for {}", path.display());
    }
    Ok(())
}

impl Sshd {
    pub fn start() -> anyhow::Result<Sshd> {
        if !Path::new(SSHD).exists() {
            bail!("{SSHD} not found: install openssh-server (scripts/dev test does)");
        }
        // sshd's privilege separation directory (made by the service unit, which tests skip).
        let _ = std::fs::create_dir_all("/run/sshd");
        let dir = tempfile::Builder::new().prefix("pitcrew-sshd-").tempdir()?;
        let p = |n: &str| dir.path().join(n);
        keygen(&p("host_key"))?;
        keygen(&p("user_key"))?;
        std::fs::copy(p("user_key.pub"), p("authorized_keys"))?;
        let user = String::from_utf8(Command::new("id").arg("-un").output()?.stdout)?.trim().to_string();
        let port = pitcrew_runtime::natsd::free_port()?;
        let host_pub = std::fs::read_to_string(p("host_key.pub"))?;
        let key: Vec<&str> = host_pub.split_whitespace().take(2).collect();
        std::fs::write(p("known_hosts"), format!("[127.0.0.1]:{port} {}\n", key.join(" ")))?;
        std::fs::write(p("empty_known_hosts"), "")?;
        std::fs::write(
            p("sshd_config"),
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {hk}\nPidFile {pid}\nAuthorizedKeysFile {ak}\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n\
                 PermitRootLogin yes\nStrictModes no\nUsePAM no\nLogLevel ERROR\nMaxSessions 64\nMaxStartups 64\n",
                hk = p("host_key").display(),
                pid = p("sshd.pid").display(),
                ak = p("authorized_keys").display(),
            ),
        )?;
        let mut s = Sshd { child: None, port, dir, user };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::File::create(self.path("sshd.log"))?;
        let child = Command::new(SSHD)
            .arg("-D")
            .arg("-e")
            .arg("-f")
            .arg(self.path("sshd_config"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting sshd")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                bail!(
                    "sshd exited with {status}: {}",
                    std::fs::read_to_string(self.path("sshd.log")).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!("sshd not listening on {} after 10 s", self.port)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The inventory entry for this server; `trusted` picks the known_hosts that has its key.
    pub fn host(&self, trusted: bool) -> HostSpec {
        HostSpec {
            address: "127.0.0.1".into(),
            port: self.port,
            user: self.user.clone(),
            key_file: Some(self.path("user_key").display().to_string()),
            known_hosts: Some(
                self.path(if trusted { "known_hosts" } else { "empty_known_hosts" }).display().to_string(),
            ),
            accept_unknown_host_key: false,
            tools: Vec::new(),
            lacks: Vec::new(),
            connect_timeout_secs: 5,
        }
    }

    /// Kill the server (established connections die with it).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // Processes serving open connections are its descendants: end them too.
            let mut doomed = descendants(c.id());
            doomed.reverse();
            let _ = c.kill();
            for pid in doomed {
                // SAFETY: kill(2) on pids that were this test's sshd's descendants a moment ago.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            let _ = c.wait();
        }
    }

    /// Kill and start again on the same port with the same keys.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn()
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Every process below `root`, parents before children (from /proc).
fn descendants(root: u32) -> Vec<u32> {
    let mut parent_of = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
            // The parent pid is the second field after the parenthesised command name.
            let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { continue };
            if let Some(ppid) = rest.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok()) {
                parent_of.push((pid, ppid));
            }
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for (pid, ppid) in &parent_of {
            if *ppid == p {
                out.push(*pid);
                frontier.push(*pid);
            }
        }
    }
    out
}
