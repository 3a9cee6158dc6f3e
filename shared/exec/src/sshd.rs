//! A private OpenSSH server on loopback, for the SSH demo and the tests: its own host key,
//! a fresh user key authorised for one login user, a known_hosts file that trusts it, a free
//! port; killed on drop, restartable. It needs `/usr/sbin/sshd` (Debian: openssh-server).

use anyhow::{bail, Context};
use pitcrew_model::HostSpec;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Where Debian's openssh-server puts the daemon.
pub const SSHD: &str = "/usr/sbin/sshd";

/// Whether a private sshd can be started here.
pub fn available() -> bool {
    Path::new(SSHD).exists()
}

/// A running sshd that accepts its generated key for one login user.
pub struct Sshd {
    child: Option<Child>,
    pub port: u16,
    pub dir: tempfile::TempDir,
    /// The account the key logs in as.
    pub user: String,
    uid: u32,
    gid: u32,
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

/// `id <flag> <user>` as a number.
impl Sshd {
    /// An sshd that logs in as the user running this process.
    pub fn start() -> anyhow::Result<Sshd> {
        let user = String::from_utf8(Command::new("id").arg("-un").output()?.stdout)?.trim().to_string();
        Self::start_as(&user)
    }

    /// An sshd that logs in as `user` (an existing account; starting one for another user
    /// needs root). Its directory and authorised keys are readable by that user.
    pub fn start_as(user: &str) -> anyhow::Result<Sshd> {
        if !available() {
            bail!("{SSHD} not found: install openssh-server (scripts/dev test does)");
        }
        let (uid, gid) = crate::process::account_ids(user).map_err(anyhow::Error::msg)?;
        // sshd's privilege separation directory (made by the service unit, which tests skip).
        let _ = std::fs::create_dir_all("/run/sshd");
        let dir = tempfile::Builder::new().prefix("pitcrew-sshd-").tempdir()?;
        let p = |n: &str| dir.path().join(n);
        keygen(&p("host_key"))?;
        keygen(&p("user_key"))?;
        std::fs::copy(p("user_key.pub"), p("authorized_keys"))?;
        // sshd reads the authorised keys as the login user; the private key stays ours.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        std::fs::set_permissions(p("authorized_keys"), std::fs::Permissions::from_mode(0o644))?;
        let port = crate::process::free_port()?;
        let host_pub = std::fs::read_to_string(p("host_key.pub"))?;
        let key: Vec<&str> = host_pub.split_whitespace().take(2).collect();
        std::fs::write(p("known_hosts"), format!("[127.0.0.1]:{port} {}\n", key.join(" ")))?;
        std::fs::write(p("empty_known_hosts"), "")?;
        std::fs::write(
            p("sshd_config"),
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {hk}\nPidFile {pid}\nAuthorizedKeysFile {ak}\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n\
                 PermitRootLogin yes\nStrictModes no\nUsePAM no\nLogLevel ERROR\nMaxStartups 64\n",
                hk = p("host_key").display(),
                pid = p("sshd.pid").display(),
                ak = p("authorized_keys").display(),
            ),
        )?;
        let mut s = Sshd { child: None, port, dir, user: user.to_string(), uid, gid };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let log_file = std::fs::File::create(self.path("sshd.log"))?;
        let mut cmd = Command::new(SSHD);
        cmd.arg("-D").arg("-e").arg("-f").arg(self.path("sshd_config"));
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log_file);
        // Dies with this process, even one killed with SIGKILL (`pitcrew demo --ssh`).
        let child = crate::process::spawn_tied(cmd).context("starting sshd")?;
        let (port, log) = (self.port, self.path("sshd.log"));
        let child = self.child.insert(child);
        crate::process::wait_ready("sshd", child, &log, Duration::from_secs(10), || crate::process::listening(port))
            .map_err(anyhow::Error::msg)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A directory in the server's own, owned by the login user: where a remote service
    /// keeps its pidfile and logs.
    pub fn workdir(&self, name: &str) -> anyhow::Result<PathBuf> {
        let dir = self.path(name);
        std::fs::create_dir_all(&dir)?;
        self.give(&dir)?;
        Ok(dir)
    }

    /// Hand `path` (and, for a directory, everything in it) to the login user.
    pub fn give(&self, path: &Path) -> anyhow::Result<()> {
        std::os::unix::fs::lchown(path, Some(self.uid), Some(self.gid))
            .with_context(|| format!("chown {} to {}", path.display(), self.user))?;
        if path.is_dir() {
            for e in std::fs::read_dir(path)? {
                self.give(&e?.path())?;
            }
        }
        Ok(())
    }

    /// The login user's uid and gid.
    pub fn ids(&self) -> (u32, u32) {
        (self.uid, self.gid)
    }

    /// A path the login user can execute `program` at: the program itself when every
    /// directory above it lets others through, else a copy in the server's directory.
    pub fn program(&self, program: &Path) -> anyhow::Result<PathBuf> {
        let open = |p: &Path, bits: u32| p.metadata().is_ok_and(|m| m.mode() & bits == bits || m.uid() == self.uid);
        let reachable = program.ancestors().skip(1).all(|d| d.as_os_str().is_empty() || open(d, 0o001));
        if reachable && open(program, 0o005) {
            return Ok(program.to_path_buf());
        }
        let name = program.file_name().context("a program path names a file")?;
        let copy = self.path(&name.to_string_lossy());
        if !copy.exists() {
            std::fs::copy(program, &copy).with_context(|| format!("copying {}", program.display()))?;
            std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755))?;
        }
        Ok(copy)
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
            max_sessions: pitcrew_model::inventory::DEFAULT_MAX_SESSIONS,
            master_idle_secs: 600,
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

    /// Stop every process serving an open connection (SIGSTOP), as a host that hangs or is cut
    /// off by a partition: the connections stay up, nothing on them answers. New connections
    /// are still served. The guard resumes them (SIGCONT) when dropped.
    pub fn freeze_connections(&self) -> Frozen {
        Frozen::stop(self.child.as_ref().map(|c| descendants(c.id())).unwrap_or_default())
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

/// Connections frozen by `Sshd::freeze_connections`, resumed on drop.
pub struct Frozen {
    pids: Vec<u32>,
}

impl Frozen {
    /// Stop `pids` (SIGSTOP), a test's own processes, until the guard drops.
    pub fn stop(pids: Vec<u32>) -> Frozen {
        for &pid in &pids {
            // SAFETY: kill(2) on pids the caller owns (its test's servers).
            unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        }
        Frozen { pids }
    }

    /// How many processes are stopped.
    pub fn count(&self) -> usize {
        self.pids.len()
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        for &pid in &self.pids {
            // SAFETY: kill(2) on the pids this guard stopped.
            unsafe { libc::kill(pid as i32, libc::SIGCONT) };
        }
    }
}

/// Every process below `root`, parents before children (from /proc).
fn descendants(root: u32) -> Vec<u32> {
    let mut parent_of = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
            let ppid = crate::process::ProcStat::read(pid).and_then(|s| s.field(4)).and_then(|p| u32::try_from(p).ok());
            if let Some(ppid) = ppid {
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
