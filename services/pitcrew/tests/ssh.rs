//! The ssh executor against a real OpenSSH server, logged in as the dedicated unprivileged
//! `pitcrew-target` account (see `pitcrew_testkit::sshd`): argv quoting, exit codes,
//! deadlines, output caps, host-key checking, one reused master connection, reconnecting,
//! sudo -n within a limited rule. Then the fault suite: each scenario breaks something real
//! on the target and the whole crew (monitor included) brings it back over SSH, or escalates.

mod common;

use pitcrew_exec::{ExecError, Executor, Fleet};
use pitcrew_model::HostSpec;
use pitcrew_testkit::sshd::{start_target, Sshd};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(20);
const WAIT: Duration = Duration::from_secs(60);

/// The `[hosts.<name>]` table for `h`.
fn host_toml(name: &str, h: &HostSpec) -> String {
    format!(
        "[hosts.{name}]\naddress = \"{}\"\nport = {}\nuser = \"{}\"\nkey_file = \"{}\"\nknown_hosts = \"{}\"\n",
        h.address,
        h.port,
        h.user,
        h.key_file.clone().unwrap_or_default(),
        h.known_hosts.clone().unwrap_or_default(),
    )
}

fn fleet(host: HostSpec, max_output: usize) -> Fleet {
    Fleet::new(BTreeMap::from([("box".to_string(), host)]), max_output)
}

#[tokio::test]
async fn commands_run_as_argv_with_exit_codes() -> anyhow::Result<()> {
    let sshd = start_target()?;
    let f = fleet(sshd.host(true), 64 * 1024);
    let out = f.run("box", "echo hello", T).await?;
    assert_eq!((out.exit_code, out.stdout.as_str()), (Some(0), "hello\n"));
    assert_eq!(f.run("box", "sh -c 'exit 3'", T).await?.exit_code, Some(3));
    // Quoting survives the remote shell: the argv policy approved is the argv that runs.
    assert_eq!(f.run("box", "printf '%s|' 'a b' c", T).await?.stdout, "a b|c|");
    assert_eq!(f.run("box", "echo 'a; rm -rf /tmp/x' '$HOME'", T).await?.stdout, "a; rm -rf /tmp/x $HOME\n");
    match f.run("box", "definitely-not-a-program-xyz", T).await {
        Err(ExecError::Spawn { error, .. }) => assert!(error.contains("not found on box"), "{error}"),
        other => panic!("expected a spawn error, got {other:?}"),
    }
    assert!(matches!(f.run("nowhere", "true", T).await, Err(ExecError::UnknownHost(_))));
    Ok(())
}

#[tokio::test]
async fn deadlines_and_output_caps_hold() -> anyhow::Result<()> {
    let sshd = start_target()?;
    let f = fleet(sshd.host(true), 1024);
    let started = Instant::now();
    let out = f.run("box", "sleep 30", Duration::from_secs(1)).await?;
    assert!(out.timed_out && out.exit_code.is_none(), "{out:?}");
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    // Before the deadline, 124 and 137 are the command's own exit codes, not a timeout.
    for code in [124, 137] {
        let out = f.run("box", &format!("sh -c 'exit {code}'"), T).await?;
        assert_eq!((out.exit_code, out.timed_out), (Some(code), false), "{out:?}");
    }
    // A command that ignores SIGTERM is ended by `timeout`'s SIGKILL, which ends `timeout`
    // too: still a timeout, not a failure.
    let out = f.run("box", "sh -c 'trap \"\" TERM; sleep 30'", Duration::from_secs(1)).await?;
    assert!(out.timed_out && out.exit_code.is_none(), "{out:?}");
    // A limit under a second is not cut to a second (a check's timeout_ms).
    let out = f.run("box", "sleep 1.2", Duration::from_millis(1500)).await?;
    assert_eq!((out.exit_code, out.timed_out), (Some(0), false), "{out:?}");
    // 127 is the command's own exit code (openssh reads it as "command not found").
    let out = f.run("box", "sh -c 'exit 127'", T).await?;
    assert_eq!((out.exit_code, out.timed_out), (Some(127), false), "{out:?}");
    assert!(!out.stderr.contains("failed while running"), "{out:?}");
    // A "forever" deadline (a huge command_timeout_secs) is no overflow.
    assert_eq!(f.run("box", "true", Duration::MAX).await?.exit_code, Some(0));
    let out = f.run("box", "head -c 1000000 /dev/zero", T).await?;
    assert_eq!(out.exit_code, Some(0));
    assert!(out.stdout.len() <= 1024, "{}", out.stdout.len());
    Ok(())
}

#[tokio::test]
async fn a_command_that_leaves_a_daemon_holding_its_output_ends_when_it_exits() -> anyhow::Result<()> {
    let sshd = start_target()?;
    let f = fleet(sshd.host(true), 1024);
    let started = Instant::now();
    // A start script as many are written: the service goes to the background with the
    // script's output, and the script exits at once.
    let out = f.run("box", "sh -c 'sleep 25.0417 & echo started'", Duration::from_secs(10)).await?;
    let took = started.elapsed();
    assert_eq!((out.exit_code, out.timed_out, out.stdout.as_str()), (Some(0), false, "started\n"), "{out:?}");
    assert!(took < Duration::from_secs(5), "the script's end is the command's, not the daemon's: {took:?}");
    // The daemon itself is left running (a start script's service must be).
    let alive = f.run("box", "pgrep -f 'sleep 25.0417'", T).await?;
    assert_eq!(alive.exit_code, Some(0), "{alive:?}");
    // The command's words are not in the argv of what runs it on the host: `pkill -f` signals
    // the daemon alone (not its own `timeout`), and `pgrep -f` then finds nothing.
    let killed = f.run("box", "pkill -f 'sleep 25.0417'", T).await?;
    assert_eq!((killed.exit_code, killed.timed_out), (Some(0), false), "{killed:?}");
    let gone = f.run("box", "pgrep -f 'sleep 25.0417'", T).await?;
    assert_eq!(gone.exit_code, Some(1), "{gone:?}");
    let none = f.run("box", "pgrep -f no-such-proc-zq9", T).await?;
    assert_eq!(none.exit_code, Some(1), "{none:?}");
    Ok(())
}

#[tokio::test]
async fn an_unknown_host_key_is_refused_unless_accepted_for_that_host() -> anyhow::Result<()> {
    let sshd = start_target()?;
    let f = fleet(sshd.host(false), 4096);
    match f.run("box", "true", T).await {
        // Nothing ran, and a human must trust the key: the run escalates, as for a host down.
        Err(ExecError::Unreachable(error)) => assert!(error.contains("not trusted"), "{error}"),
        other => panic!("an unknown host key must be refused, got {other:?}"),
    }
    let mut opted_in = sshd.host(false);
    opted_in.accept_unknown_host_key = true;
    let f = fleet(opted_in, 4096);
    assert_eq!(f.run("box", "true", T).await?.exit_code, Some(0));
    let remembered = std::fs::read_to_string(sshd.path("empty_known_hosts"))?;
    assert!(remembered.contains("ssh-ed25519"), "the accepted key is remembered: {remembered}");
    // A key the host does not authorise: refused the same way, nothing ran.
    let stranger = sshd.path("stranger_key");
    let made = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&stranger)
        .stdin(std::process::Stdio::null())
        .status()?;
    assert!(made.success());
    let mut refused = sshd.host(true);
    refused.key_file = Some(stranger.display().to_string());
    match fleet(refused, 4096).run("box", "true", T).await {
        Err(ExecError::Unreachable(error)) => {
            assert!(error.contains("login to box as") && error.contains("refused"), "{error}")
        }
        other => panic!("a refused login must escalate, got {other:?}"),
    }
    Ok(())
}

/// The client address and port sshd saw for this command's connection.
async fn conn(f: &Fleet) -> anyhow::Result<String> {
    Ok(f.run("box", "sh -c 'echo $SSH_CONNECTION'", T).await?.stdout)
}

#[tokio::test]
async fn one_master_connection_is_reused_and_reestablished() -> anyhow::Result<()> {
    let mut sshd = start_target()?;
    let f = fleet(sshd.host(true), 4096);
    let first = conn(&f).await?;
    for _ in 0..5 {
        assert_eq!(conn(&f).await?, first, "every command rides the same TCP connection");
    }
    sshd.restart()?;
    let again = conn(&f).await?;
    assert!(!again.trim().is_empty());
    assert_ne!(again, first, "a new master connection after the server restarted");
    Ok(())
}

/// The processes whose command line names `path` (a master's control socket).
fn processes_naming(path: &std::path::Path) -> Vec<i32> {
    let needle = path.as_os_str().as_encoded_bytes();
    let Ok(procs) = std::fs::read_dir("/proc") else { return Vec::new() };
    procs
        .flatten()
        .filter_map(|p| p.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle))
        })
        .collect()
}

/// A master connection with no command on it ends after the host's `master_idle_secs`: a
/// worker that lives on connects anew for its next command, and the master of a worker
/// killed outright (SIGKILL, the OOM killer: nothing closes it) is not left logged in to the
/// host for good.
#[tokio::test]
async fn an_idle_master_connection_ends_by_itself_even_when_its_worker_was_killed() -> anyhow::Result<()> {
    let sshd = start_target()?;
    let mut host = sshd.host(true);
    host.master_idle_secs = 2;
    let lives_on = fleet(host.clone(), 4096);
    let first = conn(&lives_on).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let again = conn(&lives_on).await?;
    assert!(!again.trim().is_empty());
    assert_ne!(again, first, "a new master connection after the idle time");

    let killed = fleet(host, 4096);
    conn(&killed).await?;
    let socket = killed.ssh.session("box").await?.control_socket().to_path_buf();
    let masters = processes_naming(&socket);
    assert_eq!(masters.len(), 1, "one master process for {}: {masters:?}", socket.display());
    // What SIGKILL does to a worker's masters: nothing asks them to exit.
    std::mem::forget(killed);
    let waited = Instant::now();
    while !processes_naming(&socket).is_empty() && waited.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        processes_naming(&socket).is_empty(),
        "the orphaned master {masters:?} still runs after {:?}",
        waited.elapsed()
    );
    Ok(())
}

/// The connection lost while a command runs (its worker's master killed): on the host the
/// command may run on to its end or its deadline (`timeout`: a partition leaves sshd none the
/// wiser), so it is not reported ended, and nothing after it runs, before that deadline has
/// passed. It was reported ended at once, as killed by a signal.
#[tokio::test]
async fn a_command_whose_connection_is_lost_is_not_reported_ended_before_its_deadline() -> anyhow::Result<()> {
    let sshd = start_target()?;
    let f = std::sync::Arc::new(fleet(sshd.host(true), 4096));
    conn(&f).await?;
    let socket = f.ssh.session("box").await?.control_socket().to_path_buf();
    let started = Instant::now();
    let limit = Duration::from_secs(4);
    let running = tokio::spawn({
        let f = f.clone();
        async move { f.run("box", "sleep 2", limit).await }
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    let masters = processes_naming(&socket);
    assert_eq!(masters.len(), 1, "{masters:?}");
    // SAFETY: kill(2) on the pid of the master process read from /proc just now.
    unsafe { libc::kill(masters[0], libc::SIGKILL) };
    let out = running.await??;
    let took = started.elapsed();
    assert_eq!((out.exit_code, out.timed_out), (None, false), "{out:?}");
    assert!(out.stderr.contains("failed while running"), "{out:?}");
    assert!(took >= limit, "reported after {took:?}, before the command's deadline");
    // The next command connects anew.
    assert_eq!(f.run("box", "true", T).await?.exit_code, Some(0));
    Ok(())
}

/// A host that stops answering while its connection stays up (hung, or cut off by a
/// partition the keepalives have not noticed yet): a command waits no longer than the host's
/// connect timeout for its channel, not the keepalives' 45 s, fails as transient (it may have
/// reached the host: never reported as not run), and the next command connects anew.
#[tokio::test]
async fn a_host_that_stops_answering_fails_a_command_at_its_connect_timeout_then_reconnects() -> anyhow::Result<()> {
    let sshd = start_target()?;
    let mut host = sshd.host(true);
    host.connect_timeout_secs = 2;
    let f = fleet(host, 4096);
    let first = conn(&f).await?;
    let frozen = sshd.freeze_connections();
    assert!(frozen.count() > 0, "the master connection is served by a process of its own");
    let started = Instant::now();
    let result = f.run("box", "true", T).await;
    let waited = started.elapsed();
    drop(frozen);
    match result {
        Err(ExecError::Transient(e)) => assert!(e.contains("no channel opened within 2 s"), "{e}"),
        other => panic!("expected a transient error, got {other:?}"),
    }
    assert!(waited < Duration::from_secs(20), "given up at the connect timeout, not the keepalives': {waited:?}");
    let again = conn(&f).await?;
    assert!(!again.trim().is_empty());
    assert_ne!(again, first, "a new master connection, not the one that stopped answering");
    Ok(())
}

/// A host that stops answering cannot say whether it has a program: its answer is unknown,
/// not "absent" (evaluate sent a good plan back as naming a program the host lacks), and it is
/// asked again once the host answers.
#[tokio::test]
async fn a_host_that_cannot_say_whether_it_has_a_program_is_not_taken_as_lacking_it() -> anyhow::Result<()> {
    let sshd = start_target()?;
    let mut host = sshd.host(true);
    host.connect_timeout_secs = 2;
    let f = fleet(host, 4096);
    conn(&f).await?;
    let frozen = sshd.freeze_connections();
    let asked = Instant::now();
    let answer = f.tool_answer("box", "sh").await;
    drop(frozen);
    assert_eq!(answer, None, "a probe that got no answer");
    assert!(asked.elapsed() < Duration::from_secs(20), "{:?}", asked.elapsed());
    assert_eq!(f.tool_answer("box", "sh").await, Some(true), "asked again, not cached");
    assert_eq!(f.tool_answer("box", "definitely-not-a-program-xyz").await, Some(false));
    Ok(())
}

/// An alert storm on one host: many more commands at once than sshd lets one connection
/// carry (its `MaxSessions`, 10 by default, which the test server keeps). Every command
/// runs, none is refused a channel, and never more at once than the host's limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_commands_on_one_host_waits_for_channels_instead_of_failing() -> anyhow::Result<()> {
    let sshd = start_target()?;
    let mut host = sshd.host(true);
    host.max_sessions = 2;
    let f = std::sync::Arc::new(fleet(host, 4096));
    let marks = sshd.workdir("storm")?;
    // Few and short: the other SSH scenarios share the machine with this test.
    let tasks: Vec<_> = (0..12)
        .map(|i| {
            let f = f.clone();
            // Each command leaves a file while it runs and lists the folder meanwhile: the
            // listing counts those running at once on the host, as the host sees them.
            let cmd = format!("sh -c 'touch {d}/{i} && sleep 0.1 && ls {d} && rm {d}/{i}'", d = marks.display());
            tokio::spawn(async move { f.run("box", &cmd, T).await })
        })
        .collect();
    let mut most = 0;
    for t in tasks {
        let out = t.await??;
        assert_eq!(out.exit_code, Some(0), "every command of the storm runs: {out:?}");
        let running = out.stdout.lines().filter(|l| !l.trim().is_empty()).count();
        assert!(running >= 1, "the listing shows at least its own file: {out:?}");
        most = most.max(running);
    }
    assert!((1..=2).contains(&most), "at most max_sessions (2) at once on the host, saw {most}");

    // The default stays under sshd's own default of 10 channels a connection.
    let f = std::sync::Arc::new(fleet(sshd.host(true), 4096));
    let tasks: Vec<_> = (0..12)
        .map(|_| {
            let f = f.clone();
            tokio::spawn(async move { f.run("box", "sleep 0.1", T).await })
        })
        .collect();
    for t in tasks {
        let out = t.await??;
        assert_eq!(out.exit_code, Some(0), "{out:?}");
    }
    Ok(())
}

/// `run_when_ready` calls its hook once the command has its turn on the host (here behind
/// another on a one-session host), just before the command starts; a hook that fails starts
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_says_when_it_starts_after_waiting_for_its_turn() -> anyhow::Result<()> {
    let sshd = start_target()?;
    let mut host = sshd.host(true);
    host.max_sessions = 1;
    let f = std::sync::Arc::new(fleet(host, 4096));
    let dir = sshd.workdir("ready")?;
    let first = {
        let f = f.clone();
        tokio::spawn(async move { f.run("box", "sleep 1.5", T).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked = Instant::now();
    let ready_at = std::sync::Arc::new(std::sync::Mutex::new(None));
    let at = ready_at.clone();
    let mark = dir.join("ran");
    let cmd = format!("touch {}", mark.display());
    let out = f
        .run_when_ready(
            "box",
            &cmd,
            T,
            Box::new(move || {
                Box::pin(async move {
                    *at.lock().unwrap() = Some(asked.elapsed());
                    Ok(())
                })
            }),
        )
        .await?;
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    first.await??;
    let waited = ready_at.lock().unwrap().expect("the hook was called");
    assert!(waited >= Duration::from_millis(900), "the hook was called before the command had its turn: {waited:?}");
    assert!(mark.exists(), "the command ran after its hook");

    let refused = dir.join("refused");
    let cmd = format!("touch {}", refused.display());
    let failed = f.run_when_ready("box", &cmd, T, Box::new(|| Box::pin(async { Err("no".to_string()) }))).await;
    assert!(matches!(failed, Err(ExecError::Transient(ref e)) if e == "no"), "{failed:?}");
    assert!(!refused.exists(), "a failed hook started the command");
    Ok(())
}

#[tokio::test]
async fn sudo_is_non_interactive_and_tools_are_known() -> anyhow::Result<()> {
    let sshd = start_target()?;
    let mut host = sshd.host(true);
    host.lacks = vec!["systemctl".into()];
    let f = fleet(host, 4096);
    let out = f.run("box", "sudo id -u", T).await?;
    assert_eq!((out.exit_code, out.stdout.as_str()), (Some(0), "0\n"), "{out:?}");
    if sshd.user != "root" {
        assert_ne!(f.run("box", "id -u", T).await?.stdout, "0\n", "the login itself is unprivileged");
        // Outside its sudo rule: refused at once, never a password prompt that hangs.
        let started = Instant::now();
        let out = f.run("box", "sudo cat /etc/shadow", T).await?;
        assert_ne!(out.exit_code, Some(0), "{out:?}");
        assert!(out.stderr.contains("password is required") || out.stderr.contains("not allowed"), "{out:?}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }
    assert!(f.has_tool("box", "sh").await);
    assert!(!f.has_tool("box", "definitely-not-a-program-xyz").await);
    assert!(!f.has_tool("box", "systemctl").await, "the inventory says the host lacks it");
    Ok(())
}

/// Whether this process may set up the dedicated target account (scenarios that need a
/// non-root login and its sudo rule are skipped, loudly, for anyone else).
fn as_root() -> bool {
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("skipped: needs root to log in as the dedicated pitcrew-target account");
    }
    root
}

/// The toy HTTP service on the target: run by the login user from a directory it owns.
struct Toy {
    name: &'static str,
    dir: String,
    port: u16,
    exe: String,
}

impl Toy {
    fn new(sshd: &Sshd, name: &'static str) -> anyhow::Result<Toy> {
        let exe = sshd.program(std::path::Path::new(env!("CARGO_BIN_EXE_pitcrew")))?;
        let dir = sshd.workdir(name)?.display().to_string();
        Ok(Toy { name, dir, port: pitcrew_runtime::natsd::free_port()?, exe: exe.display().to_string() })
    }

    fn command(&self, verb: &str) -> String {
        format!("{} toy {verb} --port {} --dir {}", self.exe, self.port, self.dir)
    }

    fn file(&self, name: &str) -> String {
        format!("{}/{name}", self.dir)
    }

    /// Its `[services.<name>]` table on host `box`, plus `extra` lines.
    fn service(&self, extra: &str) -> String {
        format!(
            "[services.{name}]\nhost = \"box\"\nstart = \"{start}\"\nrestart = \"{restart}\"\n\
             pidfile = \"{dir}/pid\"\nlog_file = \"{dir}/toy.log\"\n\
             check = {{ kind = \"http\", url = \"http://127.0.0.1:{port}/health\", timeout_ms = 1000 }}\n{extra}",
            name = self.name,
            start = self.command("start"),
            restart = self.command("restart"),
            dir = self.dir,
            port = self.port,
        )
    }

    fn pid(&self) -> anyhow::Result<i32> {
        Ok(std::fs::read_to_string(self.file("pid"))?.trim().parse()?)
    }

    async fn answers(&self) -> bool {
        let check = pitcrew_model::CheckSpec::Http {
            url: format!("http://127.0.0.1:{}/health", self.port),
            expect_status: 200,
            timeout_ms: 1000,
        };
        pitcrew_exec::run_check(&check, "local", &pitcrew_exec::LocalExecutor::new(1024)).await.healthy
    }

    /// Wait until nothing accepts on its port (a killed process's socket is gone).
    async fn wait_closed(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            anyhow::ensure!(Instant::now() < deadline, "port {} still open 5 s after the kill", self.port);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }
}

/// SIGKILL, as a crash would.
fn crash(pid: i32) {
    // SAFETY: kill(2) on a pid the test read from the toy's own pidfile.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

/// The inventory of a scenario: the monitor every 200 ms, host `box` (no systemctl), `toy`.
fn scenario_config(sshd: &Sshd, toy: &Toy, extra: &str) -> String {
    format!(
        "[monitor]\ninterval_ms = 200\n{host}lacks = [\"systemctl\"]\n{service}",
        host = host_toml("box", &sshd.host(true)),
        service = toy.service(extra),
    )
}

/// `pitcrew monitor` in-process until stopped.
struct Monitor {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Monitor {
    fn start(crew: &common::Crew) -> Monitor {
        use futures::FutureExt;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let task = tokio::spawn(pitcrew::crew::monitor(crew.cfg.clone(), shutdown.boxed().shared()));
        Monitor { stop, task }
    }

    async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        self.task.await?
    }
}

/// The crew over `text`, with the toy already started over SSH by the login user.
async fn crew_with_toy_running(sshd: &Sshd, toy: &Toy, text: &str) -> anyhow::Result<(common::Crew, Fleet)> {
    let env = pitcrew_testkit::TestEnv::start().await?;
    let crew = common::Crew::start_in(env, text, &pitcrew_model::Stage::ALL).await?;
    let target = fleet(sshd.host(true), 64 * 1024);
    let out = target.run("box", &toy.command("start"), T).await?;
    anyhow::ensure!(out.exit_code == Some(0), "the toy did not start over SSH: {out:?}");
    Ok((crew, target))
}

/// Stop the monitor and the toy, then the crew.
async fn finish(monitor: Monitor, toy: &Toy, mut crew: common::Crew) -> anyhow::Result<()> {
    monitor.stop().await?;
    let _ = pitcrew::toy::stop(toy.port, std::path::Path::new(&toy.dir));
    crew.shutdown().await
}

/// The run the monitor opened for `service`.
async fn monitor_opened(crew: &mut common::Crew, service: &str) -> anyhow::Result<uuid::Uuid> {
    use pitcrew_model::EventKind;
    let prefix = format!("run opened for {service}");
    let e = crew.events.wait_any(|e| e.kind == EventKind::Status && e.message.starts_with(&prefix), WAIT).await?;
    Ok(e.run_id)
}

/// (command, status) of every execution of `run` on host box, in order.
async fn executions(db: &tokio_postgres::Client, run: uuid::Uuid) -> anyhow::Result<Vec<(String, String)>> {
    let rows = db
        .query(
            "SELECT command, coalesce(status, '') FROM executions WHERE run_id = $1 AND host = 'box' \
             ORDER BY attempt, idx",
            &[&run],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// (success, diagnosis) of every episode of `run`, in order.
async fn episodes(db: &tokio_postgres::Client, run: uuid::Uuid) -> anyhow::Result<Vec<(bool, String)>> {
    let rows = db.query("SELECT success, diagnosis FROM episodes WHERE run_id = $1 ORDER BY attempt", &[&run]).await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Host box (the target, `host_extra` added to its table) and service svc on it, fixed by
/// touching `healthy` and checked by its presence.
fn touched_service(sshd: &Sshd, healthy: &str, host_extra: &str) -> String {
    format!(
        "{host}lacks = [\"systemctl\"]\n{host_extra}\
         [services.svc]\nhost = \"box\"\nstart = \"touch {healthy}\"\nrestart = \"touch {healthy}\"\n\
         check = {{ kind = \"command\", command = \"test -f {healthy}\" }}\n",
        host = host_toml("box", &sshd.host(true)),
    )
}

fn ok(cmd: String) -> (String, String) {
    (cmd, "succeeded".to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incident_on_an_ssh_host_is_remediated_over_ssh() -> anyhow::Result<()> {
    use pitcrew_model::{EventKind, Stage};
    let sshd = start_target()?;
    let env = pitcrew_testkit::TestEnv::start().await?;
    let healthy = format!("{}/healthy", sshd.workdir("svc")?.display());
    let text = touched_service(&sshd, &healthy, "");
    let mut crew = common::Crew::start_in(env, &text, &Stage::ALL).await?;
    let run = crew.open("svc", "connection refused").await?;
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    let db = crew.db().await?;
    assert_eq!(executions(&db, run).await?, vec![ok(format!("touch {healthy}"))]);
    let meta = std::fs::metadata(&healthy)?;
    use std::os::unix::fs::MetadataExt;
    assert_eq!(meta.uid(), sshd.ids().0, "the target's own record: the login user made the file");
    crew.shutdown().await
}

/// The host is lost between the fix and its verification: verify cannot tell whether the fix
/// worked, so it escalates saying so, and memory is not told the fix failed (it was: every
/// check that could not reach the host read as "not recovered", the fix was recorded as a
/// failure, barred from every run of the service for a day, and an attempt spent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_lost_before_verification_escalates_without_blaming_the_fix() -> anyhow::Result<()> {
    use pitcrew_model::{EventKind, Stage};
    let sshd = start_target()?;
    let env = pitcrew_testkit::TestEnv::start().await?;
    let healthy = format!("{}/healthy", sshd.workdir("svc")?.display());
    let text = touched_service(&sshd, &healthy, "connect_timeout_secs = 2\n");
    let others: Vec<Stage> = Stage::ALL.into_iter().filter(|s| *s != Stage::Verify).collect();
    let mut crew = common::Crew::start_in(env, &text, &others).await?;
    let run = crew.open("svc", "connection refused").await?;
    crew.events.wait(run, |e| e.kind == EventKind::Execution, WAIT).await?;
    // The verifier sees box where nothing answers any more.
    let gone = pitcrew_runtime::natsd::free_port()?.to_string();
    let mut verifier = crew.spawn_worker("verifier", &["verify"], &[("PITCREW_HOSTS__BOX__PORT", gone.as_str())])?;
    let end = crew.end(run).await?;
    common::stop(&mut verifier)?;
    assert_eq!(end.kind, EventKind::Escalated, "{}", end.message);
    assert!(end.message.contains("cannot reach box to verify the fix"), "{}", end.message);
    assert_eq!(end.data["failed_commands"], serde_json::json!([]), "{}", end.data);
    let db = crew.db().await?;
    assert_eq!(executions(&db, run).await?, vec![ok(format!("touch {healthy}"))]);
    let barred =
        common::count(&db, "SELECT count(*) FROM episodes WHERE run_id = $1 AND cardinality(commands) > 0", run);
    assert_eq!(barred.await, 0, "memory is not told the fix failed");
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_host_escalates_with_a_clear_error_and_no_hang() -> anyhow::Result<()> {
    use pitcrew_model::{EventKind, Stage};
    let env = pitcrew_testkit::TestEnv::start().await?;
    // Nothing listens on this port: every connection is refused.
    let port = pitcrew_runtime::natsd::free_port()?;
    let text = format!(
        "[hosts.gone]\naddress = \"127.0.0.1\"\nport = {port}\nuser = \"nobody\"\nconnect_timeout_secs = 2\n\
         [services.svc]\nhost = \"gone\"\nstart = \"touch /tmp/x\"\n\
         check = {{ kind = \"command\", command = \"true\" }}\n"
    );
    let mut crew = common::Crew::start_in(env, &text, &Stage::ALL).await?;
    let started = Instant::now();
    let run = crew.open("svc", "connection refused").await?;
    let end = crew.end(run).await?;
    let took = started.elapsed();
    eprintln!("scenario (f) over ssh: incident to escalated in {:.2} s", took.as_secs_f64());
    assert_eq!(end.kind, EventKind::Escalated);
    assert!(end.message.contains("host gone unreachable"), "{}", end.message);
    assert!(took < Duration::from_secs(60), "{took:?}");
    let db = crew.db().await?;
    assert!(executions(&db, run).await?.is_empty(), "nothing is recorded as run on a host never reached");
    let n: i64 = db.query_one("SELECT count(*) FROM executions WHERE run_id = $1", &[&run]).await?.get(0);
    assert_eq!(n, 0);
    let ep =
        db.query_one("SELECT success, cardinality(commands), result FROM episodes WHERE run_id = $1", &[&run]).await?;
    let (success, ran, result): (bool, i32, String) = (ep.get(0), ep.get(1), ep.get(2));
    assert!(!success && ran == 0 && result.contains("unreachable"), "the episode remembers the failure: {result}");
    crew.shutdown().await
}

/// A host that goes down between evaluate (which found it reachable) and execute, while
/// another delivery takes the command's claim over as this one tries to connect (a redelivery
/// after this one's ack wait ran out, say): this one leaves the step to the claim that stands
/// instead of escalating under it, and the run escalates once the delivery holding the claim
/// finds the host gone. Here the database plays the other delivery: a trigger hands the first
/// claim to another token, as from a delivery that died before its start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_gone_at_execute_escalates_only_under_the_claim_that_stands() -> anyhow::Result<()> {
    use pitcrew_model::{EventKind, Stage};
    let mut sshd = start_target()?;
    let env = pitcrew_testkit::TestEnv::start().await?;
    let mut host = sshd.host(true);
    host.connect_timeout_secs = 2;
    let text = format!(
        "{}[services.svc]\nhost = \"box\"\nstart = \"touch /tmp/pitcrew-never-run\"\n\
         check = {{ kind = \"command\", command = \"false\" }}\n",
        host_toml("box", &host)
    );
    let before: Vec<Stage> = Stage::ALL.into_iter().filter(|s| *s != Stage::Execute).collect();
    let mut crew = common::Crew::start_in(env, &text, &before).await?;
    let run = crew.open("svc", "svc is down").await?;
    crew.events.wait(run, |e| e.kind == EventKind::Policy, WAIT).await?;
    crew.shutdown().await?;
    sshd.kill();
    let db = crew.db().await?;
    db.batch_execute(
        "CREATE TABLE taken_over (at timestamptz NOT NULL);
         CREATE FUNCTION take_over() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF NOT EXISTS (SELECT 1 FROM taken_over) THEN
             INSERT INTO taken_over VALUES (now());
             NEW.claim := gen_random_uuid();
             NEW.gone_by := now();
           END IF;
           RETURN NEW;
         END $$;
         CREATE TRIGGER take_over BEFORE INSERT ON executions FOR EACH ROW EXECUTE FUNCTION take_over();",
    )
    .await?;
    crew.run(&[Stage::Execute, Stage::Escalate]);
    let end = crew.end(run).await?;
    let sql = "SELECT stage || ': ' || message FROM run_events WHERE run_id = $1 ORDER BY seq, idx";
    let timeline = common::texts(&db, sql, run).await;
    assert_eq!(end.kind, EventKind::Escalated, "{timeline:#?}");
    assert!(end.message.contains("host box unreachable"), "{}", end.message);
    let taken: i64 = db.query_one("SELECT count(*) FROM taken_over", &[]).await?.get(0);
    assert_eq!(taken, 1, "execute claimed the command");
    assert!(
        timeline.iter().any(|l| l.contains("was claimed by a delivery that never started it: claiming it anew")),
        "a later delivery took the step back from the claim that never started: {timeline:#?}"
    );
    assert!(timeline.iter().any(|l| l.starts_with("execute: execute: attempt 1, delivery")), "{timeline:#?}");
    let n: i64 = db.query_one("SELECT count(*) FROM executions WHERE run_id = $1", &[&run]).await?.get(0);
    assert_eq!(n, 0, "the escalating delivery released its own claim, and nothing else is left");
    assert_eq!(crew.dead_letters().await?, 0);
    crew.shutdown().await
}

/// A command's start mark whose answer is lost (Postgres restarting as it commits) leaves its
/// claim marked started though nothing ran. The mark is made again under the same claim; when
/// Postgres keeps failing it, the delivery releases its claim as never run (the start hook
/// refused the start) and the next one runs the command, once. It was recorded interrupted after
/// a straggler's wait and remembered as a failed fix though it never ran, and the run escalated.
/// Here the database plays the lost answers: the first claim is written started (a mark
/// committed), then the first four marks fail as a server shutting down fails them (three for
/// the first delivery's tries, one for the second's first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_mark_whose_answer_is_lost_is_made_again_and_never_counts_as_a_start() -> anyhow::Result<()> {
    use pitcrew_model::{EventKind, Stage};
    let sshd = start_target()?;
    let env = pitcrew_testkit::TestEnv::start().await?;
    let healthy = format!("{}/healthy", sshd.workdir("svc")?.display());
    let text = touched_service(&sshd, &healthy, "");
    let mut crew = common::Crew::start_in(env, &text, &Stage::ALL).await?;
    let db = crew.db().await?;
    db.batch_execute(
        "CREATE SEQUENCE claims; CREATE SEQUENCE marks;
         CREATE FUNCTION marked_claim() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF nextval('claims') = 1 THEN NEW.started := true; END IF;
           RETURN NEW;
         END $$;
         CREATE TRIGGER marked_claim BEFORE INSERT ON executions FOR EACH ROW EXECUTE FUNCTION marked_claim();
         CREATE FUNCTION lost_mark() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF NEW.started AND NEW.status IS NULL AND NEW.claim = OLD.claim AND nextval('marks') <= 4 THEN
             RAISE EXCEPTION 'terminating connection due to administrator command' USING ERRCODE = '57P01';
           END IF;
           RETURN NEW;
         END $$;
         CREATE TRIGGER lost_mark BEFORE UPDATE ON executions FOR EACH ROW EXECUTE FUNCTION lost_mark();",
    )
    .await?;
    let run = crew.open("svc", "connection refused").await?;
    let end = crew.end(run).await?;
    let sql = "SELECT stage || ': ' || message FROM run_events WHERE run_id = $1 ORDER BY seq, idx";
    let timeline = common::texts(&db, sql, run).await;
    assert_eq!(end.kind, EventKind::Resolved, "{}: {timeline:#?}", end.message);
    assert_eq!(executions(&db, run).await?, vec![ok(format!("touch {healthy}"))], "run once, on attempt 1");
    let marks: i64 = db.query_one("SELECT last_value FROM marks", &[]).await?.get(0);
    assert_eq!(marks, 5, "four marks failed, the fifth took");
    let released = db
        .query("SELECT started, why FROM execution_releases WHERE run_id = $1", &[&run])
        .await?
        .iter()
        .map(|r| (r.get::<_, bool>(0), r.get::<_, String>(1)))
        .collect::<Vec<_>>();
    assert_eq!(released.len(), 1, "the first delivery released its claim: {released:?}");
    assert!(released[0].0 && released[0].1.contains("nothing ran"), "{released:?}");
    assert_eq!(episodes(&db, run).await?.iter().filter(|(success, _)| !success).count(), 0, "no failure remembered");
    assert_eq!(crew.dead_letters().await?, 0);
    crew.shutdown().await
}

/// A start mark Postgres refuses for good (a constraint, a schema it does not expect) is not
/// retried as a passing failure would be, whatever the message's deliveries: it counts towards
/// the dead letter, and the run escalates with nothing run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_mark_refused_for_good_is_dead_lettered_not_retried_for_ever() -> anyhow::Result<()> {
    use pitcrew_model::{EventKind, Stage};
    let sshd = start_target()?;
    let env = pitcrew_testkit::TestEnv::start().await?;
    let healthy = format!("{}/healthy", sshd.workdir("svc")?.display());
    let text = format!("{}[stages]\nmax_deliveries = 2\npoison_after_secs = 1\n", touched_service(&sshd, &healthy, ""));
    let mut crew = common::Crew::start_in(env, &text, &Stage::ALL).await?;
    let db = crew.db().await?;
    db.batch_execute(
        "CREATE FUNCTION refused_mark() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF NEW.started AND NOT OLD.started AND NEW.status IS NULL THEN
             RAISE EXCEPTION 'no starts here' USING ERRCODE = 'check_violation';
           END IF;
           RETURN NEW;
         END $$;
         CREATE TRIGGER refused_mark BEFORE UPDATE ON executions FOR EACH ROW EXECUTE FUNCTION refused_mark();",
    )
    .await?;
    let run = crew.open("svc", "connection refused").await?;
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Escalated, "{}", end.message);
    assert!(std::fs::metadata(&healthy).is_err(), "nothing ran");
    assert!(executions(&db, run).await?.is_empty());
    assert_eq!(crew.dead_letters().await?, 1);
    crew.shutdown().await
}

/// Scenario (a): the service process is killed; the monitor sees it, the crew starts it again
/// over SSH as the login user, verify sees it answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_service_is_restarted_over_ssh_from_the_monitors_incident() -> anyhow::Result<()> {
    use pitcrew_model::EventKind;
    let sshd = start_target()?;
    let toy = Toy::new(&sshd, "web")?;
    let (mut crew, _target) = crew_with_toy_running(&sshd, &toy, &scenario_config(&sshd, &toy, "")).await?;
    let monitor = Monitor::start(&crew);

    let pid = toy.pid()?;
    let broke = Instant::now();
    crash(pid);
    let run = monitor_opened(&mut crew, "web").await?;
    let end = crew.end(run).await?;
    let took = broke.elapsed();
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    eprintln!("scenario (a) over ssh: fault to resolved in {:.2} s", took.as_secs_f64());
    let db = crew.db().await?;
    assert_eq!(executions(&db, run).await?, vec![ok(toy.command("start"))]);
    let eps = episodes(&db, run).await?;
    assert_eq!(eps.len(), 1);
    assert!(eps[0].0 && eps[0].1.contains("not running"), "{eps:?}");
    // The target's own state: a new process, the login user's, answers.
    let new_pid = toy.pid()?;
    assert_ne!(new_pid, pid);
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(format!("/proc/{new_pid}"))?.uid(), sshd.ids().0);
    assert!(toy.answers().await);
    finish(monitor, &toy, crew).await
}

/// Scenario (b): the service crashed and a stray process took its port, so it cannot start:
/// diagnose finds the squatter in `ss -ltnp`, the plan stops it (sudo kill) and starts the
/// service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_squatter_is_found_and_stopped_then_the_service_starts() -> anyhow::Result<()> {
    use pitcrew_model::EventKind;
    use std::os::unix::process::CommandExt;
    if !as_root() {
        return Ok(());
    }
    let sshd = start_target()?;
    let toy = Toy::new(&sshd, "web")?;
    let (mut crew, target) = crew_with_toy_running(&sshd, &toy, &scenario_config(&sshd, &toy, "")).await?;

    crash(toy.pid()?);
    toy.wait_closed().await?;
    let (uid, gid) = sshd.ids();
    let mut squatter = std::process::Command::new(&toy.exe)
        .args(["toy", "squat", "--port", &toy.port.to_string()])
        .uid(uid)
        .gid(gid)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(("127.0.0.1", toy.port)).is_err() {
        anyhow::ensure!(Instant::now() < deadline, "the squatter never bound {}", toy.port);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused = target.run("box", &toy.command("start"), T).await?;
    assert_ne!(refused.exit_code, Some(0), "the service cannot start while its port is taken: {refused:?}");
    // The clock starts once the fault is in place (the refused start above takes 5 s).
    let broke = Instant::now();
    let monitor = Monitor::start(&crew);

    let run = monitor_opened(&mut crew, "web").await?;
    let end = crew.end(run).await?;
    let took = broke.elapsed();
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    eprintln!("scenario (b) over ssh: fault to resolved in {:.2} s", took.as_secs_f64());
    let db = crew.db().await?;
    let expect = vec![ok(format!("sudo kill {}", squatter.id())), ok(toy.command("start"))];
    assert_eq!(executions(&db, run).await?, expect);
    let eps = episodes(&db, run).await?;
    assert_eq!(eps.len(), 1);
    assert!(eps[0].0 && eps[0].1.contains(&format!("pid {} holds it", squatter.id())), "{eps:?}");
    // The target's own state: the squatter is gone (SIGTERM) and the service answers.
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(status) = squatter.try_wait()? {
            break status;
        }
        anyhow::ensure!(Instant::now() < deadline, "the squatter still runs");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
    assert!(toy.answers().await);
    assert_ne!(toy.pid()?, squatter.id() as i32);
    finish(monitor, &toy, crew).await
}

/// Scenario (c): the service's config (root's, 0644) lost its read permission and the service
/// was restarted, so it cannot start: the log says why, the plan restores read access
/// (`sudo chmod a+r`, within the sudo rule) and starts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_that_lost_its_read_permission_is_restored_then_the_service_starts() -> anyhow::Result<()> {
    use pitcrew_model::EventKind;
    use std::os::unix::fs::PermissionsExt;
    if !as_root() {
        return Ok(());
    }
    let sshd = start_target()?;
    let toy = Toy::new(&sshd, "api")?;
    let conf = toy.file("toy.conf");
    std::fs::write(&conf, "listen = 127.0.0.1\n")?;
    std::fs::set_permissions(&conf, std::fs::Permissions::from_mode(0o644))?;
    let text = scenario_config(&sshd, &toy, &format!("vars = {{ config = \"{conf}\" }}\n"));
    let (mut crew, target) = crew_with_toy_running(&sshd, &toy, &text).await?;

    std::fs::set_permissions(&conf, std::fs::Permissions::from_mode(0o600))?;
    let refused = target.run("box", &toy.command("restart"), T).await?;
    assert_ne!(refused.exit_code, Some(0));
    assert!(refused.stderr.contains("Permission denied"), "{refused:?}");
    let broke = Instant::now();
    let monitor = Monitor::start(&crew);

    let run = monitor_opened(&mut crew, "api").await?;
    let end = crew.end(run).await?;
    let took = broke.elapsed();
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    eprintln!("scenario (c) over ssh: fault to resolved in {:.2} s", took.as_secs_f64());
    let db = crew.db().await?;
    assert_eq!(executions(&db, run).await?, vec![ok(format!("sudo chmod a+r {conf}")), ok(toy.command("start"))]);
    let eps = episodes(&db, run).await?;
    assert_eq!(eps.len(), 1);
    assert!(eps[0].0 && eps[0].1.contains("not readable"), "{eps:?}");
    // The target's own state: readable again, still root's, and the service answers.
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(&conf)?;
    assert_eq!((meta.mode() & 0o777, meta.uid()), (0o644, 0));
    assert!(toy.answers().await);
    finish(monitor, &toy, crew).await
}

/// Scenario (d): the log directory filled past its quota, so the service refuses to start;
/// deleting logs is critical, so the plan waits for an approver, then runs over SSH.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_log_dir_is_cleared_after_approval_over_ssh() -> anyhow::Result<()> {
    use pitcrew::cli::DecisionInput;
    use pitcrew_model::{Decision, EventKind, Stage};
    let sshd = start_target()?;
    let env = pitcrew_testkit::TestEnv::start().await?;
    let toy = Toy::new(&sshd, "app")?;
    let logs = toy.file("logs");
    std::fs::create_dir_all(&logs)?;
    std::fs::write(format!("{logs}/app.log"), vec![b'x'; 2 << 20])?;
    sshd.give(std::path::Path::new(&logs))?;
    let book = common::write(
        &env,
        "playbook.toml",
        "[[rule]]\nname = \"logs-full\"\nmatch = \"no space left for logs\"\n\
         diagnosis = \"{service} cannot start: its log directory is over quota\"\n\
         plans = [[\"find {log_dir} -name '*.log' -delete\", \"{start}\"]]\n",
    );
    let text = format!(
        "[reasoning]\nplaybook_file = \"{book}\"\n{}",
        scenario_config(&sshd, &toy, &format!("vars = {{ log_dir = \"{logs}\" }}\n"))
    );
    let mut crew = common::Crew::start_in(env, &text, &Stage::ALL).await?;
    let target = fleet(sshd.host(true), 64 * 1024);
    // What the service says when it is started: the fault the monitor's incident leads to.
    let refused = target.run("box", &toy.command("start"), T).await?;
    assert!(refused.stderr.contains("no space left for logs"), "{refused:?}");
    let broke = Instant::now();
    let monitor = Monitor::start(&crew);
    let run = monitor_opened(&mut crew, "app").await?;
    let asked = crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    assert!(asked.message.contains("waiting for approval"));
    let db = crew.db().await?;
    assert!(executions(&db, run).await?.is_empty(), "nothing runs before the approval");
    let req = pitcrew::cli::submit(
        &crew.bus,
        Some(&crew.store),
        DecisionInput::cli(run, Decision::Approve, "ann", None, &crew.cfg),
    )
    .await?;
    assert!(req.rule.contains("find-delete"), "{}", req.rule);
    let end = crew.end(run).await?;
    let took = broke.elapsed();
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    eprintln!("scenario (d) over ssh: fault to resolved in {:.2} s (approved at once)", took.as_secs_f64());
    let expect = vec![ok(format!("find {logs} -name '*.log' -delete")), ok(toy.command("start"))];
    assert_eq!(executions(&db, run).await?, expect);
    let eps = episodes(&db, run).await?;
    assert!(eps.len() == 1 && eps[0].0, "{eps:?}");
    let by: String = db.query_one("SELECT decided_by FROM approvals WHERE run_id = $1", &[&run]).await?.get(0);
    assert_eq!(by, "ann");
    assert!(!std::path::Path::new(&format!("{logs}/app.log")).exists(), "the logs are gone");
    assert!(toy.answers().await, "the service answers");
    finish(monitor, &toy, crew).await
}

/// Scenario (e): a fault no allowed command fixes (the service's config is broken): every
/// attempt runs a new command over SSH, then the run escalates at max_retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfixable_fault_over_ssh_escalates_after_max_retries() -> anyhow::Result<()> {
    use pitcrew_model::{EventKind, Stage};
    let sshd = start_target()?;
    let env = pitcrew_testkit::TestEnv::start().await?;
    let toy = Toy::new(&sshd, "batch")?;
    std::fs::write(toy.file("broken"), "")?;
    let text = format!("[limits]\nmax_retries = 2\n{}", scenario_config(&sshd, &toy, ""));
    let mut crew = common::Crew::start_in(env, &text, &Stage::ALL).await?;
    let broke = Instant::now();
    let monitor = Monitor::start(&crew);
    let run = monitor_opened(&mut crew, "batch").await?;
    let end = crew.end(run).await?;
    let took = broke.elapsed();
    eprintln!("scenario (e) over ssh: fault to escalated in {:.2} s", took.as_secs_f64());
    assert_eq!(end.kind, EventKind::Escalated);
    assert!(end.message.contains("max_retries (2)"), "{}", end.message);
    let db = crew.db().await?;
    let rows = db
        .query("SELECT command, status, output FROM executions WHERE run_id = $1 ORDER BY attempt, idx", &[&run])
        .await?;
    assert_eq!(rows.len(), 2, "one command per attempt");
    for r in &rows {
        assert_eq!(r.get::<_, String>(1), "failed");
        assert!(r.get::<_, String>(2).contains("config invalid"), "the target said why");
    }
    let commands: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(commands, vec![toy.command("start"), toy.command("restart")], "a failed command is never repeated");
    let eps = episodes(&db, run).await?;
    assert_eq!(eps.iter().filter(|(success, _)| !success).count(), 2, "{eps:?}");
    assert!(!toy.answers().await, "the target is still down");
    monitor.stop().await?;
    crew.shutdown().await
}

/// `pitcrew demo --ssh`, the real binary: a private sshd logging in as whoever runs it, the
/// toy killed, the monitor's run resolved over SSH, the execution recorded against demo-box.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ssh_demo_repairs_a_killed_service_over_ssh() -> anyhow::Result<()> {
    let db = pitcrew_testkit::TestDb::create().await?;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pitcrew"))
        .args(["demo", "--ssh"])
        .env("DATABASE_URL", &db.url)
        .env_remove("PITCREW_NATS_URL")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), out).await??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.contains(" resolved ") && last.contains("over SSH"), "{last}");
    let run: uuid::Uuid = last.split_whitespace().nth(2).unwrap_or_default().parse()?;
    let client = db.client().await?;
    let rows = client.query("SELECT host, command, status FROM executions WHERE run_id = $1", &[&run]).await?;
    assert_eq!(rows.len(), 1);
    let (host, command, status): (String, String, String) = (rows[0].get(0), rows[0].get(1), rows[0].get(2));
    assert_eq!((host.as_str(), status.as_str()), ("demo-box", "succeeded"));
    assert!(command.contains(" toy start "), "{command}");
    let ok: bool = client.query_one("SELECT success FROM episodes WHERE run_id = $1", &[&run]).await?.get(0);
    assert!(ok);
    Ok(())
}

/// The local master process stops answering (SIGSTOP): the next command finds it wedged,
/// connects anew and runs. Closing the wedged master asks it to exit and waits for an answer
/// that never comes: that wait is on a blocking thread, never on one of the runtime's.
#[test]
fn a_wedged_local_master_is_replaced_without_stalling_the_runtime() -> anyhow::Result<()> {
    // On a runtime of its own, in a thread of its own: a runtime stalled behind the wedged
    // master fails the test after two minutes instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let _ = tx.send(rt.block_on(wedged_master_scenario()).map_err(|e| format!("{e:#}")));
        rt.shutdown_background();
    });
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(done) => done.map_err(anyhow::Error::msg),
        Err(_) => anyhow::bail!("the runtime stalled behind a wedged ssh master"),
    }
}

async fn wedged_master_scenario() -> anyhow::Result<()> {
    let sshd = start_target()?;
    let f = std::sync::Arc::new(fleet(sshd.host(true), 4096));
    let first = conn(&f).await?;
    let socket = f.ssh.session("box").await?.control_socket().display().to_string();
    // The master: the `ssh` process whose command line names its control socket.
    let pid = std::fs::read_dir("/proc")?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let words: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            words.first().is_some_and(|w| w.ends_with(b"ssh")) && words.contains(&socket.as_bytes())
        })
        .ok_or_else(|| anyhow::anyhow!("no ssh master process names {socket}"))?;
    let frozen = pitcrew_exec::sshd::Frozen::stop(vec![pid]);
    let ticks = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let ticker = {
        let ticks = ticks.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                ticks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        })
    };
    // On the runtime's workers (a stalled one must not stall this test's own clock).
    let run = |f: std::sync::Arc<pitcrew_exec::Fleet>| tokio::spawn(async move { conn(&f).await });
    let again = tokio::time::timeout(Duration::from_secs(40), run(f.clone())).await;
    let ticked = ticks.load(std::sync::atomic::Ordering::Relaxed);
    // A second command on the new master, with the old one still wedged.
    let third = tokio::time::timeout(Duration::from_secs(20), run(f.clone())).await;
    ticker.abort();
    drop(frozen);
    let again = again.map_err(|_| anyhow::anyhow!("the command behind a wedged master never ran"))???;
    assert_ne!(again, first, "a new master connection");
    assert_eq!(third.map_err(|_| anyhow::anyhow!("the next command hung"))???, again);
    assert!(ticked >= 20, "the runtime kept ticking while the master was replaced: {ticked}");
    Ok(())
}

/// A loopback port that answers the TCP connect and the SSH banner, then nothing; its
/// listener's task (abort it when done).
async fn stalled_after_banner() -> anyhow::Result<(u16, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let held = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        let mut open = Vec::new();
        while let Ok((mut sock, _)) = listener.accept().await {
            let _ = sock.write_all(b"SSH-2.0-OpenSSH_9.2\r\n").await;
            open.push(sock); // and never a word more
        }
    });
    Ok((port, held))
}

/// A host that answers the TCP connect and the SSH banner, then nothing (a hung sshd, a
/// middlebox eating packets): connecting is bounded, the host is reported unreachable, and
/// the executor is not held for good.
#[tokio::test]
async fn a_host_stalled_after_its_banner_fails_within_its_connect_timeout() -> anyhow::Result<()> {
    let (port, held) = stalled_after_banner().await?;
    let sshd = start_target()?;
    let host = HostSpec { port, connect_timeout_secs: 2, ..sshd.host(true) };
    let f = fleet(host, 1024);
    let started = Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(120), f.run("box", "true", T)).await;
    let took = started.elapsed();
    held.abort();
    match got {
        Ok(Err(ExecError::Unreachable(e))) => eprintln!("unreachable after {took:?}: {e}"),
        other => panic!("after {took:?}: {other:?}"),
    }
    assert!(took < Duration::from_secs(20), "{took:?}");
    // The `ssh` it launched is not left in its handshake (killed: at most a zombie until
    // the runtime reaps it).
    let (running, children) = ssh_children_to(port)?;
    assert_eq!(running, 0, "{children}");
    Ok(())
}

/// A host down for a moment (its sshd restarted, as a fix may do) is reached again within
/// seconds: one found unreachable is set aside for 10 s, less than verify's checks span.
#[tokio::test]
async fn a_host_back_after_a_moment_is_reached_again_within_seconds() -> anyhow::Result<()> {
    let mut sshd = start_target()?;
    let f = fleet(sshd.host(true), 1024);
    sshd.kill();
    let down = f.run("box", "true", T).await;
    assert!(matches!(down, Err(ExecError::Unreachable(_))), "{down:?}");
    sshd.restart()?;
    let back = Instant::now();
    loop {
        match f.run("box", "true", T).await {
            Ok(o) if o.success() => break,
            other => {
                assert!(back.elapsed() < Duration::from_secs(15), "not reached {:?} after: {other:?}", back.elapsed());
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    Ok(())
}

/// How many of this process's children are `ssh` launchers to `port` and not zombies (only
/// the calling test's: others run beside it in this process), and `ps`'s list of them all.
fn ssh_children_to(port: u16) -> anyhow::Result<(usize, String)> {
    let me = std::process::id().to_string();
    let children = std::process::Command::new("ps").args(["-o", "stat=,args=", "--ppid", &me]).output()?;
    let children = String::from_utf8_lossy(&children.stdout).into_owned();
    let to_port = format!(" -p {port} ");
    let running = children.lines().filter(|l| l.contains(&to_port) && !l.trim_start().starts_with('Z')).count();
    Ok((running, children))
}

/// The same stalled host, given up on by the caller before the login's own bound (diagnose
/// holds its evidence to a deadline of its own): the launcher of the dropped connect is
/// killed all the same, not left in its handshake until TCP gives up.
#[tokio::test]
async fn a_connect_its_caller_gives_up_on_leaves_no_ssh_behind() -> anyhow::Result<()> {
    let (port, held) = stalled_after_banner().await?;
    let sshd = start_target()?;
    // Its login's bound: 2 × 5 s + 5 s; the caller gives up after 3 s.
    let host = HostSpec { port, connect_timeout_secs: 5, ..sshd.host(true) };
    let f = fleet(host, 1024);
    let got = tokio::time::timeout(Duration::from_secs(3), f.run("box", "true", T)).await;
    assert!(got.is_err(), "the caller's deadline came first: {got:?}");
    let gone_by = Instant::now() + Duration::from_secs(5);
    loop {
        let (running, children) = ssh_children_to(port)?;
        if running == 0 {
            break;
        }
        assert!(Instant::now() < gone_by, "an ssh launcher outlived its dropped connect: {children}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    held.abort();
    Ok(())
}

/// A process stopped on SIGTERM exits promptly even when an SSH master it holds stopped
/// answering (closing a master asks it over its socket, with no deadline of its own; pitcrew
/// also bounds its runtime's shutdown at 5 s for any blocking work left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_holding_a_wedged_ssh_master_still_exits_on_sigterm() -> anyhow::Result<()> {
    let sshd = start_target()?;
    let host = sshd.host(true);
    let key = std::path::PathBuf::from(host.key_file.clone().unwrap_or_default());
    let text = format!(
        "{}[services.web]\nhost = \"box\"\nstart = \"true\"\ncheck = {{ kind = \"command\", command = \"true\" }}\n",
        host_toml("box", &host)
    );
    let crew = common::Crew::start_in(pitcrew_testkit::TestEnv::start().await?, &text, &[]).await?;
    let mut monitor = crew.spawn_process("monitor", &["monitor"], &[("PITCREW_MONITOR__INTERVAL_MS", "200")], "")?;
    // The monitor's checks run over a master connection to the host.
    let waited = Instant::now();
    let master = loop {
        // The only processes whose command line names this server's user key: its masters.
        if let Some(pid) = processes_naming(&key).first() {
            break *pid;
        }
        anyhow::ensure!(waited.elapsed() < Duration::from_secs(30), "no master connection in 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Wedged: it holds its socket and answers nothing.
    // SAFETY: kill(2) on the master this test's monitor started.
    unsafe { libc::kill(master, libc::SIGSTOP) };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let took = common::sigterm(&mut monitor, Duration::from_secs(30)).await;
    for pid in processes_naming(&key) {
        // SAFETY: kill(2) on the masters of this test's host.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let log = std::fs::read_to_string(&monitor.log)?;
    let took = took.map_err(|e| anyhow::anyhow!("{e}: {log}"))?;
    assert!(took < Duration::from_secs(20), "the monitor took {took:?} to exit: {log}");
    Ok(())
}
