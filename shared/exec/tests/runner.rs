//! The local runner (`pitcrew_exec::runner`): a worker killed outright leaves no command
//! running past its deadline, a run the worker gives up on is killed, a runner lost is
//! reported once the command's deadline has passed and replaced, and a stop signal meant for
//! the worker does not cut its commands short.

use pitcrew_exec::runner::Runner;
use pitcrew_exec::{Executor, LocalExecutor};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn runner() -> Arc<Runner> {
    Arc::new(Runner::new(env!("CARGO_BIN_EXE_pitcrew-local-runner"), Vec::<String>::new()))
}

fn exec(runner: &Arc<Runner>) -> LocalExecutor {
    LocalExecutor::new(4096).with_runner(Some(runner.clone()))
}

/// Whether `pid` is still a live (not zombie) process.
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// The pid a command wrote to `file`, once it has.
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

/// Set in the helper process of the next test: the directory it works in.
const WORKER_HELPER: &str = "PITCREW_TEST_RUNNER_WORKER";

/// Not a test on its own: the worker the next test kills. Runs a long command with a 3 s
/// deadline through a runner and names the runner.
#[tokio::test]
async fn worker_helper() {
    let Some(dir) = std::env::var_os(WORKER_HELPER) else { return };
    let dir = Path::new(&dir);
    let runner = runner();
    let exec = exec(&runner);
    let command = sleeper(&dir.join("command"));
    let run = exec.run("local", &command, Duration::from_secs(3));
    let name = async {
        let _ = pid_in(&dir.join("command")).await;
        std::fs::write(dir.join("runner"), runner.pid().unwrap().to_string()).unwrap();
        std::future::pending::<()>().await
    };
    // Killed long before either ends.
    let _ = tokio::join!(run, name);
}

#[tokio::test]
async fn a_command_of_a_killed_worker_is_killed_at_its_deadline_and_the_runner_exits() {
    let dir = tempfile::tempdir().unwrap();
    let mut worker = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "worker_helper", "--test-threads", "1"])
        .env(WORKER_HELPER, dir.path())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let command = pid_in(&dir.path().join("command")).await;
    let started = Instant::now();
    let runner = pid_in(&dir.path().join("runner")).await;
    worker.kill().unwrap();
    worker.wait().unwrap();

    // It runs on (a remediation is not cut off half done when its worker dies) ...
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(started.elapsed() < Duration::from_secs(3), "too slow to tell: {:?}", started.elapsed());
    assert!(alive(command), "the command was killed with its worker, before its deadline");
    // ... until its 3 s deadline, no later; then the runner, with nothing left to run, ends.
    assert!(dies_within(command, Duration::from_secs(10)).await, "the command {command} outlived its deadline");
    assert!(started.elapsed() >= Duration::from_millis(2500), "killed before its deadline: {:?}", started.elapsed());
    assert!(dies_within(runner, Duration::from_secs(10)).await, "the runner {runner} outlived its worker");
}

#[tokio::test]
async fn a_run_given_up_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pid");
    let runner = runner();
    let exec = exec(&runner);
    let command = sleeper(&file);
    let mut run = Box::pin(exec.run("local", &command, Duration::from_secs(60)));
    // Given up once it runs.
    let pid = tokio::select! {
        ended = &mut run => panic!("a sleep of 300 s ended: {ended:?}"),
        pid = pid_in(&file) => pid,
    };
    drop(run);
    assert!(dies_within(pid, Duration::from_secs(10)).await, "the command {pid} outlived the run given up");
    // The runner is still there for the next one.
    let out = exec.run("local", "echo still", Duration::from_secs(10)).await.unwrap();
    assert_eq!(out.stdout, "still\n");
}

#[tokio::test]
async fn a_lost_runner_is_reported_after_the_deadline_and_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pid");
    let runner = runner();
    let exec = exec(&runner);
    let started = Instant::now();
    let command = sleeper(&file);
    let run = exec.run("local", &command, Duration::from_secs(2));
    let kill = async {
        let command = pid_in(&file).await;
        let first = runner.pid().expect("a runner runs");
        unsafe { libc::kill(first as i32, libc::SIGKILL) };
        (command, first)
    };
    let (out, (pid, first)) = tokio::join!(run, kill);
    let out = out.expect("a command that may have run is an outcome, not an error to retry");
    assert!(started.elapsed() >= Duration::from_secs(2), "reported before its deadline: {:?}", started.elapsed());
    assert_eq!((out.exit_code, out.timed_out, out.success()), (None, false, false));
    assert!(out.stderr.contains("the local runner ended while 'sh' ran"), "{}", out.stderr);
    unsafe { libc::kill(pid, libc::SIGKILL) };

    let out = exec.run("local", "echo again", Duration::from_secs(10)).await.unwrap();
    assert_eq!(out.stdout, "again\n");
    let second = runner.pid().expect("a new runner");
    assert_ne!(first, second);
}

#[tokio::test]
async fn stop_signals_reach_the_worker_not_the_runners_commands() {
    let runner = runner();
    let exec = exec(&runner);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pid");
    let command = format!("sh -c 'echo $$ > {}; sleep 1; echo done'", file.display());
    let run = exec.run("local", &command, Duration::from_secs(20));
    let signal = async {
        // The command runs: the runner has long set its handlers.
        let _ = pid_in(&file).await;
        let pid = runner.pid().expect("a runner runs") as i32;
        unsafe {
            libc::kill(pid, libc::SIGTERM);
            libc::kill(pid, libc::SIGINT);
        }
    };
    let (out, ()) = tokio::join!(run, signal);
    let out = out.unwrap();
    assert_eq!((out.exit_code, out.stdout.as_str()), (Some(0), "done\n"));
    // The runner's handlers are not inherited: a command still dies of SIGTERM.
    let out =
        exec.run("local", "sh -c 'kill -TERM $$; sleep 5; echo survived'", Duration::from_secs(20)).await.unwrap();
    assert_eq!((out.exit_code, out.stdout.as_str()), (None, ""), "{out:?}");
}

#[test]
fn a_runner_refuses_a_terminal_and_says_why() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pitcrew-local-runner"))
        .stdin(std::fs::File::open("/dev/null").unwrap())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("its stdin must be a pipe from the worker that started it"), "{err}");
}
