//! The local watchdog (`pitcrew_exec::watchdog`): a worker killed outright leaves no command
//! running past its deadline, and nothing is signalled for a command that had ended; a
//! watchdog that dies is started again; a stop signal meant for the worker does not end it.

use pitcrew_exec::watchdog::Watchdog;
use pitcrew_exec::{Executor, LocalExecutor};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn watchdog() -> Arc<Watchdog> {
    Arc::new(Watchdog::new(env!("CARGO_BIN_EXE_pitcrew-watchdog"), Vec::<String>::new()))
}

fn exec(watchdog: &Arc<Watchdog>) -> LocalExecutor {
    LocalExecutor::new(4096).with_watchdog(Some(watchdog.clone()))
}

/// Whether `pid` is still a live (not zombie) process.
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// The pid written to `file`, once it is.
async fn pid_in(file: &Path) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(pid) = std::fs::read_to_string(file).ok().and_then(|p| p.trim().parse().ok()) {
            return pid;
        }
        assert!(Instant::now() < deadline, "nothing wrote a pid to {}", file.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn dies_within(pid: i32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while alive(pid) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    !alive(pid)
}

/// A command that writes its pid to `file` and then sleeps far past any deadline here.
fn sleeper(file: &Path) -> String {
    format!("sh -c 'echo $$ > {}; exec sleep 300'", file.display())
}

/// Set in the helper process of the tests below: the directory it works in.
const WORKER_HELPER: &str = "PITCREW_TEST_WATCHED_WORKER";
/// Set with it: `long` (a command with a 3 s deadline still running) or `ended` (a command
/// that ended, and a process of the same group left running).
const WORKER_SCENE: &str = "PITCREW_TEST_WATCHED_SCENE";

/// Not a test on its own: the worker the tests below kill. Names its watchdog, and its
/// command's pid, in files of its directory, then waits to be killed.
#[tokio::test]
async fn worker_helper() {
    let Some(dir) = std::env::var_os(WORKER_HELPER) else { return };
    let dir = Path::new(&dir);
    let watchdog = watchdog();
    let exec = exec(&watchdog);
    let name = |watchdog: &Watchdog| std::fs::write(dir.join("watchdog"), watchdog.pid().unwrap().to_string()).unwrap();
    if std::env::var(WORKER_SCENE).as_deref() == Ok("ended") {
        // The leader exits at once; its background child, of the same group, runs on.
        let cmd = format!("sh -c 'sleep 300 >/dev/null 2>&1 & echo $! > {}'", dir.join("command").display());
        let out = exec.run("local", &cmd, Duration::from_secs(1)).await.unwrap();
        assert!(out.success(), "{out:?}");
        name(&watchdog);
        // Killed long before; gone on its own if the test that started it failed.
        tokio::time::sleep(Duration::from_secs(60)).await;
        return;
    }
    let command = sleeper(&dir.join("command"));
    let run = exec.run("local", &command, Duration::from_secs(3));
    let named = async {
        let _ = pid_in(&dir.join("command")).await;
        name(&watchdog);
        tokio::time::sleep(Duration::from_secs(60)).await
    };
    // Killed long before either ends.
    let _ = tokio::join!(run, named);
}

/// The helper worker, killed when dropped (a test that fails leaves none behind).
struct Worker(std::process::Child);

impl Worker {
    fn kill(&mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start the helper worker in `scene`; its command's pid and its watchdog's.
async fn worker(dir: &Path, scene: &str) -> (Worker, i32, i32) {
    let worker = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "worker_helper", "--test-threads", "1"])
        .env(WORKER_HELPER, dir)
        .env(WORKER_SCENE, scene)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let worker = Worker(worker);
    let command = pid_in(&dir.join("command")).await;
    let watchdog = pid_in(&dir.join("watchdog")).await;
    (worker, command, watchdog)
}

#[tokio::test]
async fn a_command_of_a_killed_worker_is_killed_at_its_deadline_and_the_watchdog_exits() {
    let dir = tempfile::tempdir().unwrap();
    let (mut worker, command, watchdog) = worker(dir.path(), "long").await;
    let started = Instant::now();
    worker.kill();

    // It runs on (a remediation is not cut off half done when its worker dies) ...
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(started.elapsed() < Duration::from_millis(2500), "too slow to tell: {:?}", started.elapsed());
    assert!(alive(command), "the command was killed with its worker, before its deadline");
    // ... until its 3 s deadline, no later; then the watchdog, with nothing left, ends.
    assert!(dies_within(command, Duration::from_secs(10)).await, "the command {command} outlived its deadline");
    assert!(started.elapsed() >= Duration::from_millis(2000), "killed before its deadline: {:?}", started.elapsed());
    assert!(dies_within(watchdog, Duration::from_secs(10)).await, "the watchdog {watchdog} outlived its worker");
}

/// A command that ended is forgotten: what it left running in its group (a daemon a start
/// script backgrounds) is not the watchdog's to kill, and the watchdog exits at once.
#[tokio::test]
async fn a_command_that_ended_is_not_killed_when_its_worker_dies() {
    let dir = tempfile::tempdir().unwrap();
    let (mut worker, daemon, watchdog) = worker(dir.path(), "ended").await;
    worker.kill();
    assert!(dies_within(watchdog, Duration::from_secs(5)).await, "the watchdog {watchdog} waited for nothing");
    // Past the 1 s deadline its command had.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let was_alive = alive(daemon);
    unsafe { libc::kill(daemon, libc::SIGKILL) };
    assert!(was_alive, "the daemon {daemon} a finished command left was killed");
}

#[tokio::test]
async fn a_watchdog_that_dies_is_started_again_and_commands_run_on() {
    let watchdog = watchdog();
    let exec = exec(&watchdog);
    assert!(exec.run("local", "true", Duration::from_secs(10)).await.unwrap().success());
    let first = watchdog.pid().expect("a watchdog runs");
    unsafe { libc::kill(first as i32, libc::SIGKILL) };
    assert!(dies_within(first as i32, Duration::from_secs(5)).await);
    // The first command after may still go to the dead one's pipe: the one after that starts anew.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = exec.run("local", "echo on", Duration::from_secs(10)).await.unwrap();
        assert_eq!(out.stdout, "on\n");
        if watchdog.pid().is_some_and(|p| p != first) {
            break;
        }
        assert!(Instant::now() < deadline, "no new watchdog after the first died");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn stop_signals_are_for_the_worker_not_its_watchdog() {
    let watchdog = watchdog();
    let exec = exec(&watchdog);
    assert!(exec.run("local", "true", Duration::from_secs(10)).await.unwrap().success());
    let pid = watchdog.pid().expect("a watchdog runs") as i32;
    // Once it handles both (SigCgt: bit 1 is SIGINT, bit 14 SIGTERM).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let caught = status.lines().find_map(|l| l.strip_prefix("SigCgt:")).map(str::trim).unwrap().to_string();
        let caught = u64::from_str_radix(&caught, 16).unwrap();
        if caught & (1 << 1) != 0 && caught & (1 << 14) != 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the watchdog never handled SIGINT and SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    unsafe {
        libc::kill(pid, libc::SIGTERM);
        libc::kill(pid, libc::SIGINT);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(alive(pid), "the watchdog died of a stop signal");
    drop(exec);
    drop(watchdog);
}

#[test]
fn a_watchdog_refuses_a_terminal_and_says_why() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pitcrew-watchdog"))
        .stdin(std::fs::File::open("/dev/null").unwrap())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("its stdin must be a pipe from the worker that started it"), "{err}");
}
