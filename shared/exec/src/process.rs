//! Local server processes the demo and the tests start (nats-server, sshd, postgres): a free
//! port to give them, and a bounded wait for them to become ready.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A free TCP port on loopback (released before returning), below the kernel's range of
/// ephemeral ports when there is room: the tests restart servers (nats-server, Postgres) on
/// their port, and a port in that range may be taken meanwhile by any outgoing connection, or
/// by a client retrying to reach the server, which then connects to itself (a TCP
/// self-connect: its local port is the port it dials). Failing that, the kernel's choice.
pub fn free_port() -> std::io::Result<u16> {
    let low = ephemeral_ports().map_or(32_768, |(low, _)| low);
    if low > FIXED_PORTS_FROM + 1_000 {
        use std::hash::BuildHasher;
        let random = std::collections::hash_map::RandomState::new();
        for i in 0..64u64 {
            let pick = random.hash_one((i, std::time::SystemTime::now()));
            let port = FIXED_PORTS_FROM + (pick % u64::from(low - FIXED_PORTS_FROM)) as u16;
            if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
                return Ok(l.local_addr()?.port());
            }
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Ports `free_port` picks from, up to the ephemeral range (clear of well-known services).
const FIXED_PORTS_FROM: u16 = 10_000;

/// The kernel's range of ephemeral ports (`net.ipv4.ip_local_port_range`).
fn ephemeral_ports() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut parts = text.split_whitespace().map(|p| p.parse::<u16>().ok());
    Some((parts.next()??, parts.next()??))
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

/// `/proc/<pid>/stat` of a process: what follows its command name (which may hold spaces and
/// parentheses).
pub struct ProcStat(String);

impl ProcStat {
    /// None if there is no such process.
    pub fn read(pid: u32) -> Option<ProcStat> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        Some(ProcStat(stat.rsplit_once(')')?.1.to_string()))
    }

    /// Numeric field `n`, numbered as in proc(5) (4: the parent's pid; 14, 15: user and
    /// system time in clock ticks; 22: the start time in clock ticks since boot).
    pub fn field(&self, n: usize) -> Option<u64> {
        self.0.split_whitespace().nth(n.checked_sub(3)?)?.parse().ok()
    }
}

/// A spawn request for the thread that starts tied servers, and where its answer goes.
type SpawnJob = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Start `cmd` so that it dies with this process, even when this process is killed with
/// SIGKILL and runs no destructor (a demo or load tool killed with `kill -9` left its
/// nats-server running, holding a port and a temp store): the child asks the kernel for
/// SIGKILL when its parent goes. The kernel ties that to the *thread* that started it, so every
/// such child is started by one thread that lives as long as the process; a pool thread that
/// exits (tokio's blocking threads do, after 10 s idle) would take the server with it.
pub fn spawn_tied(mut cmd: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnJob>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("tied-spawner".into())
            .spawn(move || {
                // The sender is static and never dropped: this thread never ends.
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("cannot start the spawner thread");
        tx
    });
    let parent = std::process::id();
    // SAFETY: only async-signal-safe calls (prctl, getppid) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent died before the request took effect: nobody would kill us.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::other("the parent exited while starting"));
            }
            Ok(())
        });
    }
    let (reply, answer) = mpsc::channel();
    let gone = || std::io::Error::other("the spawner thread is gone");
    spawner.send((cmd, reply)).map_err(|_| gone())?;
    answer.recv().map_err(|_| gone())?
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

    /// Set in the helper process of the test below: the file it writes the tied child's pid to.
    const TIED_HELPER: &str = "PITCREW_TEST_TIED_HELPER";

    /// Not a test on its own: the process the next test kills. Starts a tied `sleep`, writes
    /// its pid and waits to be killed.
    #[test]
    fn tied_helper() {
        let Some(file) = std::env::var_os(TIED_HELPER) else { return };
        let mut sleep = Command::new("sleep");
        sleep.arg("120");
        let mut child = spawn_tied(sleep).expect("tied sleep starts");
        std::fs::write(&file, child.id().to_string()).unwrap();
        // Killed long before this returns.
        let _ = child.wait();
    }

    #[test]
    fn a_tied_child_dies_with_a_parent_killed_by_sigkill() {
        let file = std::env::temp_dir().join(format!("pitcrew-tied-{}", std::process::id()));
        let _ = std::fs::remove_file(&file);
        let mut helper = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "process::tests::tied_helper", "--test-threads", "1"])
            .env(TIED_HELPER, &file)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let pid = loop {
            if let Some(pid) = std::fs::read_to_string(&file).ok().and_then(|p| p.trim().parse::<i32>().ok()) {
                break pid;
            }
            assert!(Instant::now() < deadline, "the helper never named its child");
            std::thread::sleep(Duration::from_millis(20));
        };
        let _ = std::fs::remove_file(&file);
        let alive = |pid: i32| {
            // A zombie waiting for its new parent to reap it is dead too.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
                .unwrap_or(false)
        };
        assert!(alive(pid), "the tied child runs while its parent does");
        helper.kill().unwrap();
        helper.wait().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while alive(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!alive(pid), "the tied child {pid} outlived its parent's SIGKILL");
    }

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
        if let Some((low, _)) = ephemeral_ports().filter(|(low, _)| *low > FIXED_PORTS_FROM + 1_000) {
            assert!((FIXED_PORTS_FROM..low).contains(&port), "{port} is not below the ephemeral range ({low})");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
