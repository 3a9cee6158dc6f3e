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
    /// Serving TLS with a certificate of its own (`start_with_tls`).
    tls: bool,
}

/// The name the TLS server's certificate is issued for (and no other: not 127.0.0.1).
pub const TLS_SERVER_NAME: &str = "pitcrew-test-db";

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

impl PrivatePostgres {
    pub fn start() -> anyhow::Result<PrivatePostgres> {
        Self::start_as(false)
    }

    /// A server that also takes TLS, with a self-signed certificate issued for
    /// [`TLS_SERVER_NAME`] alone; the certificate (to trust) is `ca_file()`.
    pub fn start_with_tls() -> anyhow::Result<PrivatePostgres> {
        Self::start_as(true)
    }

    /// The TLS server's certificate, its own authority.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    fn start_as(tls: bool) -> anyhow::Result<PrivatePostgres> {
        let bin = bin_dir()?;
        let dir = tempfile::Builder::new().prefix("pitcrew-pg-").tempdir()?;
        // SAFETY: geteuid(2) cannot fail and touches no memory.
        let ids = if unsafe { libc::geteuid() } == 0 {
            let ids = pitcrew_exec::process::account_ids("postgres");
            Some(ids.map_err(|e| anyhow::anyhow!("PostgreSQL must run as the postgres account: {e}"))?)
        } else {
            None
        };
        if let Some((uid, gid)) = ids {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))?;
        }
        let port = pitcrew_runtime::natsd::free_port()?;
        let mut pg = PrivatePostgres { child: None, port, bin, dir, ids, tls };
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
        if tls {
            pg.make_certificate()?;
        }
        pg.spawn()?;
        Ok(pg)
    }

    /// A key and a self-signed certificate in the data directory, owned by the server's
    /// account (PostgreSQL refuses a key others may read), and a copy of the certificate for
    /// clients to trust.
    fn make_certificate(&self) -> anyhow::Result<()> {
        let (key, cert) = (self.data().join("server.key"), self.data().join("server.crt"));
        self_signed(TLS_SERVER_NAME, true, &key, &cert)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))?;
        if let Some((uid, gid)) = self.ids {
            std::os::unix::fs::chown(&key, Some(uid), Some(gid))?;
            std::os::unix::fs::chown(&cert, Some(uid), Some(gid))?;
        }
        std::fs::copy(&cert, self.ca_file())?;
        // An authority that signed nothing here: trusting it alone must refuse the server.
        self_signed("another-authority", false, &self.dir.path().join("other-ca.key"), &self.other_ca_file())
    }

    /// A certificate authority the TLS server's certificate has nothing to do with.
    pub fn other_ca_file(&self) -> PathBuf {
        self.dir.path().join("other-ca.crt")
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
        let log_file = std::fs::File::create(self.dir.path().join("postgres.log"))?;
        let sockets = self.dir.path().display().to_string();
        let child = self
            .command("postgres")
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string(), "-k", &sockets])
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=200"])
            .args(if self.tls { &["-c", "ssl=on"][..] } else { &[] })
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .context("starting postgres")?;
        let log = self.dir.path().join("postgres.log");
        // Accepting TCP is not accepting queries: ready once pg_isready says so.
        let mut isready = self.command("pg_isready");
        isready.args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q"]);
        let port = self.port;
        let child = self.child.insert(child);
        pitcrew_exec::process::wait_ready("postgres", child, &log, Duration::from_secs(30), || {
            pitcrew_exec::process::listening(port) && isready.status().is_ok_and(|s| s.success())
        })
        .map_err(anyhow::Error::msg)
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

/// A key and a self-signed certificate for `name` (as its subject alternative name too, with
/// `san`), made by the `openssl` command.
fn self_signed(name: &str, san: bool, key: &Path, cert: &Path) -> anyhow::Result<()> {
    let mut cmd = Command::new("openssl");
    cmd.args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj"]).arg(format!("/CN={name}"));
    if san {
        cmd.arg("-addext").arg(format!("subjectAltName=DNS:{name}"));
    }
    let out = cmd
        .arg("-keyout")
        .arg(key)
        .arg("-out")
        .arg(cert)
        .output()
        .context("openssl (package openssl) makes the test server's certificates")?;
    if !out.status.success() {
        bail!("openssl req failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}
