//! The ssh executor against a real OpenSSH server: argv quoting, exit codes, deadlines,
//! output caps, host-key checking, one reused master connection, reconnecting, sudo -n.

mod common;

use pitcrew_exec::{ExecError, Executor, Fleet};
use pitcrew_model::HostSpec;
use pitcrew_testkit::sshd::Sshd;
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
    let sshd = Sshd::start()?;
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
    let sshd = Sshd::start()?;
    let f = fleet(sshd.host(true), 1024);
    let started = Instant::now();
    let out = f.run("box", "sleep 30", Duration::from_secs(1)).await?;
    assert!(out.timed_out && out.exit_code.is_none(), "{out:?}");
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    let out = f.run("box", "head -c 1000000 /dev/zero", T).await?;
    assert_eq!(out.exit_code, Some(0));
    assert!(out.stdout.len() <= 1024, "{}", out.stdout.len());
    Ok(())
}

#[tokio::test]
async fn an_unknown_host_key_is_refused_unless_accepted_for_that_host() -> anyhow::Result<()> {
    let sshd = Sshd::start()?;
    let f = fleet(sshd.host(false), 4096);
    match f.run("box", "true", T).await {
        Err(ExecError::Spawn { error, .. }) => assert!(error.contains("not trusted"), "{error}"),
        other => panic!("an unknown host key must be refused, got {other:?}"),
    }
    let mut opted_in = sshd.host(false);
    opted_in.accept_unknown_host_key = true;
    let f = fleet(opted_in, 4096);
    assert_eq!(f.run("box", "true", T).await?.exit_code, Some(0));
    let remembered = std::fs::read_to_string(sshd.path("empty_known_hosts"))?;
    assert!(remembered.contains("ssh-ed25519"), "the accepted key is remembered: {remembered}");
    Ok(())
}

/// The client address and port sshd saw for this command's connection.
async fn conn(f: &Fleet) -> anyhow::Result<String> {
    Ok(f.run("box", "sh -c 'echo $SSH_CONNECTION'", T).await?.stdout)
}

#[tokio::test]
async fn one_master_connection_is_reused_and_reestablished() -> anyhow::Result<()> {
    let mut sshd = Sshd::start()?;
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

#[tokio::test]
async fn sudo_is_non_interactive_and_tools_are_known() -> anyhow::Result<()> {
    let sshd = Sshd::start()?;
    let mut host = sshd.host(true);
    host.lacks = vec!["systemctl".into()];
    let f = fleet(host, 4096);
    let out = f.run("box", "sudo id -u", T).await?;
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    assert!(f.has_tool("box", "sh").await);
    assert!(!f.has_tool("box", "definitely-not-a-program-xyz").await);
    assert!(!f.has_tool("box", "systemctl").await, "the inventory says the host lacks it");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incident_on_an_ssh_host_is_remediated_over_ssh() -> anyhow::Result<()> {
    use pitcrew_model::{EventKind, Stage};
    let sshd = Sshd::start()?;
    let h = sshd.host(true);
    let env = pitcrew_testkit::TestEnv::start().await?;
    let healthy = env.path("box-healthy");
    let text = format!(
        "{host}lacks = [\"systemctl\"]\n\
         [services.svc]\nhost = \"box\"\nstart = \"touch {healthy}\"\nrestart = \"touch {healthy}\"\n\
         check = {{ kind = \"command\", command = \"test -f {healthy}\" }}\n",
        host = host_toml("box", &h),
    );
    let mut crew = common::Crew::start_in(env, &text, &Stage::ALL).await?;
    let run = crew.open("svc", "connection refused").await?;
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    let db = crew.db().await?;
    let row = db.query_one("SELECT host, command, status FROM executions WHERE run_id = $1", &[&run]).await?;
    assert_eq!(row.get::<_, String>(0), "box");
    assert_eq!(row.get::<_, String>(1), format!("touch {healthy}"));
    assert_eq!(row.get::<_, String>(2), "succeeded");
    assert!(std::path::Path::new(&healthy).exists(), "the target's own record: the file exists");
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
    assert_eq!(end.kind, EventKind::Escalated);
    assert!(end.message.contains("host gone unreachable"), "{}", end.message);
    assert!(started.elapsed() < Duration::from_secs(60), "{:?}", started.elapsed());
    let db = crew.db().await?;
    let n: i64 = db.query_one("SELECT count(*) FROM executions WHERE run_id = $1", &[&run]).await?.get(0);
    assert_eq!(n, 0, "nothing is recorded as run on a host that was never reached");
    crew.shutdown().await
}

/// Scenario (a): the service process is killed; the monitor sees it, the crew starts it again
/// over SSH, verify sees it answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_service_is_restarted_over_ssh_from_the_monitors_incident() -> anyhow::Result<()> {
    use futures::FutureExt;
    use pitcrew_model::{EventKind, Stage};
    let sshd = Sshd::start()?;
    let h = sshd.host(true);
    let env = pitcrew_testkit::TestEnv::start().await?;
    let exe = env!("CARGO_BIN_EXE_pitcrew");
    let dir = env.path("web");
    std::fs::create_dir_all(&dir)?;
    let port = pitcrew_runtime::natsd::free_port()?;
    let args = format!("--port {port} --dir {dir}");
    let text = format!(
        "[monitor]\ninterval_ms = 200\n\
         {host}lacks = [\"systemctl\"]\n\
         [services.web]\nhost = \"box\"\nstart = \"{exe} toy start {args}\"\nrestart = \"{exe} toy restart {args}\"\n\
         pidfile = \"{dir}/pid\"\nlog_file = \"{dir}/toy.log\"\n\
         check = {{ kind = \"http\", url = \"http://127.0.0.1:{port}/health\", timeout_ms = 1000 }}\n",
        host = host_toml("box", &h),
    );
    let mut crew = common::Crew::start_in(env, &text, &Stage::ALL).await?;
    pitcrew::toy::start(std::path::Path::new(exe), port, std::path::Path::new(&dir))?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let monitor = tokio::spawn(pitcrew::crew::monitor(
        crew.cfg.clone(),
        async move {
            let _ = stopped.await;
        }
        .boxed()
        .shared(),
    ));

    // The fault: SIGKILL, as a crash would.
    let pid: i32 = std::fs::read_to_string(format!("{dir}/pid"))?.trim().parse()?;
    let broke = Instant::now();
    // SAFETY: kill(2) on the toy's own pid, read from its pidfile.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let opened = crew
        .events
        .wait_any(|e| e.kind == EventKind::Status && e.message.starts_with("run opened for web"), WAIT)
        .await?;
    let end = crew.end(opened.run_id).await?;
    let took = broke.elapsed();
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    eprintln!("scenario (a) over ssh: fault to resolved in {:.2} s", took.as_secs_f64());
    let db = crew.db().await?;
    let row = db.query_one("SELECT host, status FROM executions WHERE run_id = $1", &[&opened.run_id]).await?;
    assert_eq!((row.get::<_, String>(0).as_str(), row.get::<_, String>(1).as_str()), ("box", "succeeded"));
    let ok: bool = db.query_one("SELECT success FROM episodes WHERE run_id = $1", &[&opened.run_id]).await?.get(0);
    assert!(ok);
    // The target's own state: a new process answers.
    let new_pid: i32 = std::fs::read_to_string(format!("{dir}/pid"))?.trim().parse()?;
    assert_ne!(new_pid, pid);
    let check = pitcrew_model::CheckSpec::Http {
        url: format!("http://127.0.0.1:{port}/health"),
        expect_status: 200,
        timeout_ms: 1000,
    };
    assert!(pitcrew_exec::run_check(&check, "local", &pitcrew_exec::LocalExecutor::new(1024)).await.healthy);
    let _ = stop.send(());
    monitor.await??;
    let _ = pitcrew::toy::stop(port, std::path::Path::new(&dir));
    crew.shutdown().await
}

/// Scenario (e): a fault no allowed command fixes (the service's config is broken): every
/// attempt runs a new command over SSH, then the run escalates at max_retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfixable_fault_over_ssh_escalates_after_max_retries() -> anyhow::Result<()> {
    use pitcrew_model::{EventKind, Stage};
    let sshd = Sshd::start()?;
    let h = sshd.host(true);
    let env = pitcrew_testkit::TestEnv::start().await?;
    let exe = env!("CARGO_BIN_EXE_pitcrew");
    let dir = env.path("batch");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(format!("{dir}/broken"), "")?;
    let port = pitcrew_runtime::natsd::free_port()?;
    let args = format!("--port {port} --dir {dir}");
    let text = format!(
        "[limits]\nmax_retries = 2\n\
         {host}\
         [services.batch]\nhost = \"box\"\nstart = \"{exe} toy start {args}\"\nrestart = \"{exe} toy restart {args}\"\n\
         check = {{ kind = \"http\", url = \"http://127.0.0.1:{port}/health\", timeout_ms = 1000 }}\n",
        host = host_toml("box", &h),
    );
    let mut crew = common::Crew::start_in(env, &text, &Stage::ALL).await?;
    let started = Instant::now();
    let run = crew.open("batch", &format!("GET http://127.0.0.1:{port}/health failed: connection refused")).await?;
    let end = crew.end(run).await?;
    eprintln!("scenario (e) over ssh: incident to escalated in {:.2} s", started.elapsed().as_secs_f64());
    assert_eq!(end.kind, EventKind::Escalated);
    assert!(end.message.contains("max_retries (2)"), "{}", end.message);
    let db = crew.db().await?;
    let rows = db
        .query("SELECT attempt, host, status, output FROM executions WHERE run_id = $1 ORDER BY attempt", &[&run])
        .await?;
    assert_eq!(rows.len(), 2, "one command per attempt");
    for r in &rows {
        assert_eq!((r.get::<_, String>(1).as_str(), r.get::<_, String>(2).as_str()), ("box", "failed"));
        assert!(r.get::<_, String>(3).contains("config invalid"), "the target said why");
    }
    let commands: Vec<String> = db
        .query("SELECT command FROM executions WHERE run_id = $1 ORDER BY attempt", &[&run])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_ne!(commands[0], commands[1], "a failed command is never repeated");
    let failed: i64 =
        db.query_one("SELECT count(*) FROM episodes WHERE run_id = $1 AND NOT success", &[&run]).await?.get(0);
    assert_eq!(failed, 2);
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "the target is still down");
    crew.shutdown().await
}

/// Scenario (d): the log directory filled past its quota, so the service refuses to start;
/// deleting logs is critical, so the plan waits for an approver, then runs over SSH.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_log_dir_is_cleared_after_approval_over_ssh() -> anyhow::Result<()> {
    use pitcrew_model::{Decision, EventKind, Stage};
    let sshd = Sshd::start()?;
    let h = sshd.host(true);
    let env = pitcrew_testkit::TestEnv::start().await?;
    let exe = env!("CARGO_BIN_EXE_pitcrew");
    let dir = env.path("app");
    std::fs::create_dir_all(format!("{dir}/logs"))?;
    std::fs::write(format!("{dir}/logs/app.log"), vec![b'x'; 2 << 20])?;
    let port = pitcrew_runtime::natsd::free_port()?;
    let args = format!("--port {port} --dir {dir}");
    let book = common::write(
        &env,
        "playbook.toml",
        "[[rule]]\nname = \"logs-full\"\nmatch = \"no space left for logs\"\n\
         diagnosis = \"{service} cannot start: its log directory is over quota\"\n\
         plans = [[\"find {log_dir} -name '*.log' -delete\", \"{start}\"]]\n",
    );
    let text = format!(
        "[reasoning]\nplaybook_file = \"{book}\"\n\
         {host}\
         [services.app]\nhost = \"box\"\nstart = \"{exe} toy start {args}\"\nvars = {{ log_dir = \"{dir}/logs\" }}\n\
         check = {{ kind = \"http\", url = \"http://127.0.0.1:{port}/health\", timeout_ms = 1000 }}\n",
        host = host_toml("box", &h),
    );
    let mut crew = common::Crew::start_in(env, &text, &Stage::ALL).await?;
    // What the service says when it is started: the fault the alert carries.
    let refused = pitcrew::toy::start(std::path::Path::new(exe), port, std::path::Path::new(&dir)).unwrap_err();
    let run = crew.open("app", &refused.to_string()).await?;
    let asked = crew.events.kind(run, EventKind::ApprovalRequested, WAIT).await?;
    assert!(asked.message.contains("waiting for approval"));
    let db = crew.db().await?;
    let none: i64 = db.query_one("SELECT count(*) FROM executions WHERE run_id = $1", &[&run]).await?.get(0);
    assert_eq!(none, 0, "nothing runs before the approval");
    let req = pitcrew::cli::decide(&crew.bus, run, Decision::Approve, "ann", None, "cli").await?;
    assert!(req.rule.contains("find-delete"), "{}", req.rule);
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    let ran: i64 = db
        .query_one(
            "SELECT count(*) FROM executions WHERE run_id = $1 AND host = 'box' AND status = 'succeeded'",
            &[&run],
        )
        .await?
        .get(0);
    assert_eq!(ran, 2);
    assert!(!std::path::Path::new(&format!("{dir}/logs/app.log")).exists(), "the logs are gone");
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(), "the service answers");
    let _ = pitcrew::toy::stop(port, std::path::Path::new(&dir));
    crew.shutdown().await
}
