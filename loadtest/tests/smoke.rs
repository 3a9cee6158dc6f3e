//! The load tool itself, end to end on small batches: it starts its own nats-server and
//! database, runs the crew, and its one JSON line accounts for every incident.

use std::process::Command;

/// Run the tool with `args` (and `--timeout 120` unless they give one) and parse the JSON
/// line it prints; whether it succeeded too.
fn run_as_is(args: &[&str]) -> (bool, serde_json::Value) {
    let timeout: &[&str] = if args.contains(&"--timeout") { &[] } else { &["--timeout", "120"] };
    let out = Command::new(env!("CARGO_BIN_EXE_pitcrew-loadtest"))
        .args(args)
        .args(timeout)
        .output()
        .expect("the load tool starts");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = String::from_utf8_lossy(&out.stdout);
    let report =
        serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("not one JSON line ({e}): {line}\n{stderr}"));
    (out.status.success(), report)
}

/// Run the tool with `args`, which must succeed, and parse the JSON line it prints.
fn run(args: &[&str]) -> serde_json::Value {
    let (ok, report) = run_as_is(args);
    assert!(ok, "pitcrew-loadtest {args:?} failed: {report}");
    report
}

/// Every incident ended once, as its scenario dictates, and each stage of the resolving
/// path has one latency per run that passed it.
fn accounts_for(report: &serde_json::Value, incidents: u64, resolved: u64) {
    assert_eq!(report["completed"], incidents, "{report}");
    assert_eq!(report["errors"], 0, "{report}");
    for error in ["publish_errors", "unexpected_outcomes", "timed_out"] {
        assert_eq!(report[error], 0, "{error}: {report}");
    }
    assert_eq!(report["outcomes"]["resolved"], resolved, "{report}");
    assert_eq!(report["outcomes"]["escalated"], incidents - resolved, "{report}");
    assert_eq!(report["e2e_ms"]["n"], incidents, "{report}");
    // Against a crew already running, intake's start and end are two clocks': not measured.
    let against_a_running_crew = !report["target"].is_null();
    assert_eq!(report["stage_ms"]["intake"].is_null(), against_a_running_crew, "{report}");
    let measured: &[&str] = if against_a_running_crew {
        &["diagnose", "plan", "evaluate"]
    } else {
        &["intake", "diagnose", "plan", "evaluate"]
    };
    for stage in measured {
        assert_eq!(report["stage_ms"][stage]["n"], incidents, "{stage}: {report}");
    }
    for stage in ["approval", "execute", "verify"] {
        assert_eq!(report["stage_ms"][stage]["n"], resolved, "{stage}: {report}");
    }
    assert!(report["completed_per_second"].as_f64().unwrap_or(0.0) > 0.0, "{report}");
}

#[test]
fn runs_kept_in_flight_with_http_checks_all_end_and_are_counted() {
    // Four in flight over three services: runs of one service take turns remediating it.
    let report = run(&["--incidents", "20", "--in-flight", "4", "--check", "http", "--no-evidence", "--services", "3"]);
    accounts_for(&report, 20, 16);
    assert_eq!(report["check"], "http");
    assert_eq!(report["services"], 3);
    assert_eq!(report["in_flight"], 4);
    assert!(report["steady_per_second"].as_f64().unwrap_or(0.0) > 0.0, "{report}");
    // Measured from each run's publish to its end: never more than the tool lets in flight.
    let mean = report["in_flight_mean"].as_f64().unwrap_or(0.0);
    assert!(mean > 0.0 && mean <= 4.0, "{report}");
    assert!(report["llm_bound"].is_null(), "no model, no bound: {report}");
}

#[test]
fn a_paced_batch_accounts_for_every_incident() {
    // Latency from each incident's due time; the mix spread over the batch: 4 of 6 resolve.
    let report = run(&["--incidents", "6", "--rate", "50", "--no-evidence"]);
    accounts_for(&report, 6, 4);
    assert!(report["llm_bound"].is_null() && report["steady_per_second"].is_null(), "{report}");
}

#[test]
fn runs_that_do_not_end_in_time_are_reported_as_errors_before_the_tool_fails() {
    // One run in flight, no time to wait: it cannot end (its model call alone takes 1 s),
    // and the two incidents behind it are never published.
    let (ok, report) =
        run_as_is(&["--incidents", "3", "--in-flight", "1", "--llm-latency-ms", "1000", "--timeout", "0"]);
    assert!(!ok, "{report}");
    assert_eq!(report["timed_out"], 3, "{report}");
    assert_eq!(report["errors"], 3, "{report}");
    assert_eq!(report["completed"], 0, "{report}");
    assert_eq!(report["e2e_ms"]["n"], 0, "{report}");
}

#[test]
fn a_simulated_model_is_called_twice_a_run() {
    let report = run(&["--incidents", "10", "--llm-latency-ms", "50"]);
    accounts_for(&report, 10, 8);
    // Diagnosis and plan, once each a run: the refused plans escalate without a retry.
    assert_eq!(report["llm_calls"], 20, "{report}");
    assert_eq!(report["evidence_commands"], false, "{report}");
    // Ten runs at once, 2 x 50 ms of model time each: at most 100 runs a second.
    let bound = &report["llm_bound"];
    assert_eq!(bound["in_flight"], 10, "{report}");
    assert_eq!(bound["model_seconds_per_run"], 0.1, "{report}");
    assert_eq!(bound["per_second"], 100.0, "{report}");
    let reached = bound["reached"].as_f64().unwrap_or(0.0);
    let expected = report["completed_per_second"].as_f64().unwrap_or(0.0) / 100.0;
    assert!((reached - expected).abs() < 0.002 && reached > 0.0, "{report}");
}

/// `--target`: the tool starts nothing and drives a crew that is already running (here, in
/// this test's process, on its own nats-server and database), through that crew's config.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drives_a_crew_that_is_already_running() -> anyhow::Result<()> {
    use futures::FutureExt;
    let env = pitcrew_testkit::TestEnv::start().await?;
    let healthy = env.path("healthy");
    std::fs::write(&healthy, "")?;
    let text = env.config_toml(&format!(
        "[verify]\nchecks = 1\n[services.svc]\nhost = \"local\"\nstart = \"touch {healthy}\"\nevidence = []\n\
         check = {{ kind = \"command\", command = \"test -f {healthy}\" }}\n"
    ));
    let file = env.path("pitcrew.toml");
    std::fs::write(&file, &text)?;
    let cfg = pitcrew_runtime::Config::from_toml(&text)?;
    // The streams and schema exist before the tool looks, as with any crew already running.
    pitcrew::crew::connect(&cfg).await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        let _ = stopped.await;
    }
    .boxed()
    .shared();
    let crew = tokio::spawn(pitcrew::crew::run(cfg, &pitcrew_model::Stage::ALL, shutdown));

    let tool = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_pitcrew-loadtest"))
                .args(&args)
                .args(["--timeout", "120"])
                .env_remove("DATABASE_URL")
                .output()
        })
    };
    let args = |more: &[&str]| {
        let mut a: Vec<String> =
            ["--target", &file, "--incidents", "12", "--in-flight", "3"].map(String::from).to_vec();
        a.extend(more.iter().map(|s| s.to_string()));
        a
    };
    let out = tool(args(&["--service", "svc"])).await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim())?;
    // Every incident reported `connection refused`: the running crew's playbook fixes each.
    accounts_for(&report, 12, 12);
    assert_eq!(report["target"], file.as_str(), "{report}");
    assert_eq!(report["service"], "svc", "{report}");
    assert!(report["cpu_ms_per_run"]["crew"].is_null(), "the crew's CPU is not in the tool's process: {report}");
    assert!(report["peak_rss_mb"].is_null(), "{report}");

    // A service the running crew does not know, and an option only the tool's own crew has.
    let out = tool(args(&["--service", "nope"])).await??;
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains("--service nope: not under [services]"), "{said}");
    let out = tool(args(&["--service", "svc", "--llm-latency-ms", "10"])).await??;
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains("--llm-latency-ms shapes the crew this tool starts"), "{said}");

    let _ = stop.send(());
    crew.await??;
    Ok(())
}

/// The tool started on an endless paced batch (`extra` added) that gives up after `timeout`
/// seconds, up to its "publishing" line: the process, what it said so far, its crew's database
/// and directory.
fn endless_batch(extra: &[&str], timeout: u32) -> anyhow::Result<(std::process::Child, Vec<String>, String, String)> {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pitcrew-loadtest"));
    // Started as from a terminal, whatever this test runs under: a harness started with
    // `nohup` passes SIGHUP on ignored, and the tool (rightly) keeps it ignored then.
    // SAFETY: signal(2) only, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_DFL);
            Ok(())
        });
    }
    endless_batch_of(cmd, extra, timeout)
}

/// [`endless_batch`] of the tool as `cmd` starts it.
fn endless_batch_of(
    mut cmd: Command,
    extra: &[&str],
    timeout: u32,
) -> anyhow::Result<(std::process::Child, Vec<String>, String, String)> {
    use std::io::{BufRead, BufReader};
    let mut tool = cmd
        .args(["--incidents", "100000", "--rate", "20", "--no-evidence", "--timeout", &timeout.to_string()])
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(tool.stderr.as_mut().expect("stderr")).lines();
    let mut said = Vec::new();
    let (mut database, mut dir) = (String::new(), String::new());
    for line in lines.by_ref() {
        let line = line?;
        if let Some(rest) = line.strip_prefix("loadtest: the crew's database ") {
            let (db, rest) = rest.split_once(" and directory ").expect("the line names both");
            database = db.to_string();
            dir = rest.split_once(" (").expect("then why").0.to_string();
        }
        let publishing = line.starts_with("loadtest: publishing");
        said.push(line);
        if publishing {
            break;
        }
    }
    assert!(!database.is_empty() && std::path::Path::new(&dir).is_dir(), "{said:#?}");
    Ok((tool, said, database, dir))
}

/// The rest of what `tool` says on stderr, its JSON line (null if none), once it exits.
fn rest_of(tool: &mut std::process::Child, said: &mut Vec<String>) -> anyhow::Result<(bool, serde_json::Value)> {
    use std::io::{BufRead, BufReader, Read};
    said.extend(BufReader::new(tool.stderr.take().expect("stderr")).lines().map_while(Result::ok));
    let mut out = String::new();
    tool.stdout.take().expect("stdout").read_to_string(&mut out)?;
    let status = tool.wait()?;
    Ok((status.success(), serde_json::from_str(out.trim()).unwrap_or(serde_json::Value::Null)))
}

/// Whether the database `name` still exists.
fn database_left(name: &str) -> anyhow::Result<bool> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let (client, conn) = tokio_postgres::connect(&pitcrew_testkit::admin_url(), tokio_postgres::NoTls).await?;
        tokio::spawn(conn);
        let row = client.query_one("SELECT count(*) FROM pg_database WHERE datname = $1", &[&name]).await?;
        anyhow::Ok(row.get::<_, i64>(0) > 0)
    })
}

/// A signal mid-batch (SIGTERM; SIGHUP, its terminal closed): the tool stops at once, says
/// so, fails, and leaves neither its crew's database nor its directory behind.
#[test]
fn an_interrupted_batch_removes_its_database_and_directory() -> anyhow::Result<()> {
    for (signal, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGHUP, "SIGHUP")] {
        let (mut tool, mut said, database, dir) = endless_batch(&[], 600)?;
        std::thread::sleep(std::time::Duration::from_millis(500));
        assert_eq!(unsafe { libc::kill(tool.id() as i32, signal) }, 0);
        let (ok, _) = rest_of(&mut tool, &mut said)?;
        assert!(!ok, "{said:#?}");
        assert!(said.iter().any(|l| l.contains(&format!("interrupted by {name}"))), "{said:#?}");
        assert!(!std::path::Path::new(&dir).exists(), "{name}: {dir} is left behind");
        assert!(!database_left(&database)?, "{name}: database {database} is left behind");
    }
    Ok(())
}

/// Started as `nohup` starts it (SIGHUP ignored), a batch outlives a hangup: the tool leaves
/// that signal ignored rather than stop on it.
#[test]
fn a_batch_started_ignoring_hangups_outlives_one() -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pitcrew-loadtest"));
    // SAFETY: signal(2) only, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
            Ok(())
        });
    }
    let (mut tool, mut said, database, dir) = endless_batch_of(cmd, &[], 600)?;
    assert_eq!(unsafe { libc::kill(tool.id() as i32, libc::SIGHUP) }, 0);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(tool.try_wait()?.is_none(), "a hangup ended a batch started ignoring it");
    assert_eq!(unsafe { libc::kill(tool.id() as i32, libc::SIGTERM) }, 0);
    let (ok, _) = rest_of(&mut tool, &mut said)?;
    assert!(!ok && said.iter().any(|l| l.contains("interrupted by SIGTERM")), "{said:#?}");
    assert!(!said.iter().any(|l| l.contains("interrupted by SIGHUP")), "{said:#?}");
    assert!(!std::path::Path::new(&dir).exists(), "{dir} is left behind");
    assert!(!database_left(&database)?, "database {database} is left behind");
    Ok(())
}

/// A diagnose worker process that dies mid-batch: the tool stops at once (not at its
/// timeout), says which and how, with the end of its log, counts what did not end as timed
/// out, prints its line, fails, and removes its database and directory.
#[test]
fn a_crew_worker_that_dies_stops_the_batch_at_once_saying_why() -> anyhow::Result<()> {
    let beside = std::path::Path::new(env!("CARGO_BIN_EXE_pitcrew-loadtest")).with_file_name("pitcrew");
    assert!(beside.exists(), "{} is needed: cargo build -p pitcrew", beside.display());
    let (mut tool, mut said, database, dir) = endless_batch(&["--diagnose-processes", "1"], 120)?;
    std::thread::sleep(std::time::Duration::from_millis(1000));
    // The worker: the tool's child running `pitcrew ... worker diagnose`.
    let worker = std::fs::read_dir("/proc")?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .find(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat.rsplit_once(") ").and_then(|(_, rest)| rest.split(' ').nth(1)?.parse::<u32>().ok());
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            ppid == Some(tool.id()) && String::from_utf8_lossy(&cmdline).contains("worker\0diagnose")
        })
        .expect("the tool runs a diagnose worker");
    let killed = std::time::Instant::now();
    assert_eq!(unsafe { libc::kill(worker, libc::SIGKILL) }, 0);
    let (ok, report) = rest_of(&mut tool, &mut said)?;
    assert!(killed.elapsed() < std::time::Duration::from_secs(60), "it ran on towards its timeout: {said:#?}");
    assert!(!ok, "{said:#?}");
    assert!(said.iter().any(|l| l.contains("diagnose worker 0 exited (signal: 9")), "{said:#?}");
    assert!(said.iter().any(|l| l.contains("the crew failed before the batch ended")), "{said:#?}");
    let (timed_out, incidents) = (report["timed_out"].as_u64().unwrap_or(0), report["incidents"].as_u64().unwrap_or(0));
    assert!(timed_out > 0 && timed_out + report["completed"].as_u64().unwrap_or(0) == incidents, "{report}");
    assert!(!std::path::Path::new(&dir).exists(), "{dir} is left behind");
    assert!(!database_left(&database)?, "database {database} is left behind");
    Ok(())
}
