//! A private PostgreSQL server for tests that stop and restart it: its own data directory
//! (initdb, trust auth, fsync off), a free loopback port, killed on drop. It runs as the
//! `postgres` account when the test runs as root (PostgreSQL refuses root).

use anyhow::{bail, Context};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct PrivatePostgres {
    child: Option<Child>,
    pub port: u16,
    bin: PathBuf,
    dir: tempfile::TempDir,
    ids: Option<(u32, u32)>,
}

/// The newest `/usr/lib/postgresql/<version>/bin`.
fn bin_dir() -> anyhow::Result<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .context("PostgreSQL server binaries not found under /usr/lib/postgresql (package postgresql)")?
        .flatten()
        .filter_map(|e| Some((e.file_name().to_string_lossy().parse().ok()?, e.path().join("bin"))))
        .filter(|(_, p): &(u32, PathBuf)| p.join("postgres").exists())
        .collect();
    versions.sort();
    versions.pop().map(|(_, p)| p).context("no PostgreSQL server binaries under /usr/lib/postgresql")
}

fn id_of(flag: &str, user: &str) -> anyhow::Result<u32> {
    let out = Command::new("id").args([flag, user]).output()?;
    if !out.status.success() {
        bail!("no '{user}' account to run PostgreSQL as");
    }
    Ok(String::from_utf8(out.stdout)?.trim().parse()?)
}

impl PrivatePostgres {
    pub fn start() -> anyhow::Result<PrivatePostgres> {
        let bin = bin_dir()?;
        let dir = tempfile::Builder::new().prefix("pitcrew-pg-").tempdir()?;
        // SAFETY: geteuid(2) cannot fail and touches no memory.
        let ids = if unsafe { libc::geteuid() } == 0 {
            Some((id_of("-u", "postgres")?, id_of("-g", "postgres")?))
        } else {
            None
        };
        if let Some((uid, gid)) = ids {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))?;
        }
        let port = pitcrew_runtime::natsd::free_port()?;
        let mut pg = PrivatePostgres { child: None, port, bin, dir, ids };
        let data = pg.data();
        let out = pg
            .command("initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8", "-D"])
            .arg(&data)
            .output()
            .context("initdb")?;
        if !out.status.success() {
            bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        pg.spawn()?;
        Ok(pg)
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.bin.join(program));
        if let Some((uid, gid)) = self.ids {
            cmd.uid(uid).gid(gid);
        }
        cmd.current_dir(self.dir.path());
        cmd
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::File::create(self.dir.path().join("postgres.log"))?;
        let sockets = self.dir.path().display().to_string();
        let child = self
            .command("postgres")
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string(), "-k", &sockets])
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=200"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting postgres")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                // Accepting TCP is not accepting queries: wait for pg_isready.
                let ready = self
                    .command("pg_isready")
                    .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q"])
                    .status()
                    .is_ok_and(|s| s.success());
                if ready {
                    return Ok(());
                }
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                let log = std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default();
                bail!("postgres exited with {status}: {log}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("postgres not ready on {} after 30 s", self.port)
    }

    /// The server's `postgres` database, to create test databases on.
    pub fn admin_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stop the server now (fast shutdown: connections are cut).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start it again on the same port and data.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        self.spawn()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
