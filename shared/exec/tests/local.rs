//! The local executor against real processes: argv without a shell, capped output, exit
//! codes, spawn failures and deadlines that kill the whole process group. Every test runs
//! twice: alone, and with a local watchdog told of every command (`pitcrew_exec::watchdog`,
//! as in a `pitcrew` process).

use pitcrew_exec::watchdog::Watchdog;
use pitcrew_exec::{ExecError, Executor, LocalExecutor};
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(10);

/// A watchdog of the test's own (its pipe belongs to the runtime that started it).
fn watchdog() -> Option<Arc<Watchdog>> {
    Some(Arc::new(Watchdog::new(env!("CARGO_BIN_EXE_pitcrew-watchdog"), Vec::<String>::new())))
}

/// Whether `pid` is still a live (not zombie) process.
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

macro_rules! local_tests {
    ($watchdog:expr) => {
    fn exec() -> LocalExecutor {
        LocalExecutor::new(64 * 1024).with_watchdog($watchdog)
    }

    #[tokio::test]
    async fn echo_captures_stdout_and_exit_zero() {
        let out = exec().run("local", "echo hello", T).await.unwrap();
        assert_eq!(out.stdout, "hello\n");
        assert_eq!(out.exit_code, Some(0));
        assert!(out.success());
        assert!(!out.timed_out);
    }

    #[tokio::test]
    async fn exit_code_is_reported() {
        let out = exec().run("localhost", "sh -c 'echo oops >&2; exit 3'", T).await.unwrap();
        assert_eq!(out.exit_code, Some(3));
        assert_eq!(out.stderr, "oops\n");
        assert!(!out.success());
    }

    #[tokio::test]
    async fn missing_program_is_a_spawn_error() {
        let err = exec().run("127.0.0.1", "definitely-not-a-tool-xyz --flag", T).await.unwrap_err();
        match err {
            ExecError::Spawn { program, .. } => assert_eq!(program, "definitely-not-a-tool-xyz"),
            other => panic!("expected Spawn, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn bad_and_empty_commands_are_rejected() {
        assert!(matches!(exec().run("local", "echo 'unbalanced", T).await, Err(ExecError::Parse(_))));
        assert!(matches!(exec().run("local", "   ", T).await, Err(ExecError::Empty)));
    }

    #[tokio::test]
    async fn timeout_kills_quickly() {
        let started = Instant::now();
        let out = exec().run("local", "sleep 5", Duration::from_millis(200)).await.unwrap();
        assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
        assert!(out.timed_out);
        assert_eq!(out.exit_code, None);
        assert!(!out.success());
    }

    #[tokio::test]
    async fn timeout_kills_the_whole_process_group() {
        // The shell backgrounds a sleep (same process group) and prints its pid before waiting.
        let cmd = "sh -c 'sleep 30 & echo $!; wait'";
        let out = exec().run("local", cmd, Duration::from_millis(300)).await.unwrap();
        assert!(out.timed_out);
        let pid: i32 = out.stdout.trim().parse().expect("partial output kept on timeout");
        let deadline = Instant::now() + Duration::from_secs(3);
        while alive(pid) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!alive(pid), "background child {pid} survived the deadline");
    }

    #[tokio::test]
    async fn output_is_capped_without_hanging() {
        let small = LocalExecutor::new(1024).with_watchdog($watchdog);
        let cmd = "head -c 1000000 /dev/zero";
        let out = tokio::time::timeout(T, small.run("local", cmd, T)).await.expect("hung").unwrap();
        assert!(out.stdout.len() <= 1024, "{}", out.stdout.len());
        assert_eq!(out.exit_code, Some(0));
        assert!(!out.timed_out);
    }

    #[tokio::test]
    async fn arguments_are_argv_not_shell() {
        let out = exec().run("local", "printf '%s|' 'a b' c", T).await.unwrap();
        assert_eq!(out.stdout, "a b|c|");
    }

    #[tokio::test]
    async fn shell_metacharacters_are_literal() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("x");
        std::fs::write(&victim, "keep").unwrap();
        let cmd = format!("echo a; rm -rf {}", victim.display());
        let out = exec().run("local", &cmd, T).await.unwrap();
        assert_eq!(out.stdout, format!("a; rm -rf {}\n", victim.display()));
        assert!(victim.exists());
        let out = exec().run("local", "echo $HOME | cat > /tmp/nope && true", T).await.unwrap();
        assert_eq!(out.stdout, "$HOME | cat > /tmp/nope && true\n");
    }

    #[tokio::test]
    async fn unknown_host_is_rejected() {
        let err = exec().run("db-7", "echo hi", T).await.unwrap_err();
        assert!(matches!(err, ExecError::UnknownHost(ref h) if h == "db-7"), "{err:?}");
        assert!(!exec().has_tool("db-7", "sh").await);
    }

    #[tokio::test]
    async fn has_tool_searches_path() {
        let e = exec();
        assert!(e.has_tool("local", "sh").await);
        assert!(e.has_tool("local", "/bin/sh").await);
        assert!(!e.has_tool("local", "definitely-not-a-tool-xyz").await);
        let plain = tempfile::NamedTempFile::new().unwrap();
        let plain = plain.path().to_str().unwrap();
        assert!(!e.has_tool("local", plain).await, "not executable");
        assert!(!e.has_tool("local", "").await);
    }

    #[tokio::test]
    async fn works_as_a_trait_object() {
        let e: std::sync::Arc<dyn Executor> = std::sync::Arc::new(exec());
        let out = e.run("local", "true", T).await.unwrap();
        assert!(out.success());
    }

    /// pitcrew's environment holds its secrets (the model's key, the chat tokens, the database
    /// URL): a command inherits only where programs are, the user and the locale, so neither
    /// `env` nor `/proc/self/environ` shows the rest.
    #[tokio::test]
    async fn a_command_inherits_none_of_pitcrews_secrets() {
        let name = format!("PITCREW_TEST_SECRET_{}", std::process::id());
        std::env::set_var(&name, "do-not-show-me-4f2a");
        for cmd in ["env", "cat /proc/self/environ"] {
            let out = exec().run("local", cmd, T).await.unwrap();
            assert!(out.success(), "{cmd}: {out:?}");
            assert!(!out.stdout.contains("do-not-show-me-4f2a") && !out.stdout.contains(&name), "{cmd}: {}", out.stdout);
            assert!(out.stdout.contains("PATH="), "{cmd} still finds programs: {}", out.stdout);
        }
        // One a check needs is passed by name (`[exec] pass_env`).
        let passing = exec().passing(std::slice::from_ref(&name));
        let out = passing.run("local", "env", T).await.unwrap();
        assert!(out.stdout.contains(&format!("{name}=do-not-show-me-4f2a")), "{}", out.stdout);
        std::env::remove_var(&name);
    }

    /// A daemon a command starts in the background without redirecting its output (`nohup app &`
    /// in a start script) holds the command's pipes after the command exits: the command's
    /// result comes back after a short grace, and the daemon does not die of SIGPIPE on its next
    /// write (its output is read on and discarded), so a fix is not undone a moment after it was
    /// verified. The output says so, for the operator and the next plan.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_daemon_left_holding_the_output_is_not_killed_by_sigpipe() {
        let cmd = "sh -c 'sh -c \"while :; do echo tick; echo tock >&2; sleep 0.1; done\" & echo $!; exit 0'";
        let started = Instant::now();
        // The worker runs on: the daemon's output is read while it does.
        let worker = exec();
        let out = worker.run("local", cmd, T).await.unwrap();
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
        assert_eq!((out.exit_code, out.timed_out), (Some(0), false));
        // Its first ticks may come before the shell's line with its pid.
        let pid: i32 = out.stdout.lines().find_map(|l| l.trim().parse().ok()).expect("the daemon's pid");
        assert!(
            out.stderr.contains("left running holds its output (backgrounded without redirecting it): pitcrew reads it on"),
            "{}",
            out.stderr
        );
        // Writing on, well past the grace: alive, not killed by SIGPIPE.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let was_alive = alive(pid);
        unsafe { libc::kill(pid, libc::SIGKILL) };
        drop(worker);
        assert!(was_alive, "the daemon {pid} died once the command's output was closed");
    }
    };
}

mod in_process {
    use super::*;
    local_tests!(None);
}

mod watched {
    use super::*;
    local_tests!(watchdog());
}
