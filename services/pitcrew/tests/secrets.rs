//! Secrets planted in an alert, a log the crew reads as evidence and a command's output never
//! reach a log line, an event, a Postgres row, an exported span or a metric.

mod common;

use common::otlp::Receiver;
use common::{scrape, stop, texts, write, Crew};
use pitcrew_model::{EventKind, Stage};
use pitcrew_testkit::TestEnv;

const SECRETS: &[&str] = &["hunter2-ABC", "tok-XYZ-123456", "pa55-SECRET", "MIIsecretKEYdata", "AKIAIOSFODNN7EXAMPLE"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_secrets_reach_no_log_event_or_row() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let creds = write(&env, "creds.txt", "db_password=hunter2-ABC\nAuthorization: Bearer tok-XYZ-123456\n");
    let log = write(
        &env,
        "svc.log",
        "starting\nERROR login failed for postgres://app:pa55-SECRET@db/app\n\
         -----BEGIN RSA PRIVATE KEY-----\nMIIsecretKEYdata\n-----END RSA PRIVATE KEY-----\n",
    );
    let book = write(
        &env,
        "playbook.toml",
        "[[rule]]\nname = \"drill\"\nmatch = \"secrets drill\"\ndiagnosis = \"{service} leaks: {error}\"\n\
         plans = [[\"cat {creds}\", \"{start}\"]]\n",
    );
    let text = format!(
        "[reasoning]\nplaybook_file = \"{book}\"\n{}log_file = \"{log}\"\nvars = {{ creds = \"{creds}\" }}\n",
        common::marker_service(&env, "svc")
    );
    let mut crew = Crew::start_in(env, &text, &[]).await?;
    let stages: Vec<&str> = Stage::ALL.iter().map(|s| s.as_str()).collect();
    let receiver = Receiver::start().await?;
    let port = pitcrew_runtime::natsd::free_port()?;
    let sinks =
        format!("[telemetry]\notlp_endpoint = \"{}\"\n[metrics]\nlisten = \"127.0.0.1:{port}\"\n", receiver.url);
    let env = [("PITCREW_LOG", "debug"), ("OTEL_BSP_SCHEDULE_DELAY", "100")];
    let mut worker = crew.spawn_worker_with("w", &stages, &env, &sinks)?;
    let run = crew.open("svc", "secrets drill: api_key=AKIAIOSFODNN7EXAMPLE leaked").await?;
    let end = crew.events.terminal(run, common::WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);

    let db = crew.db().await?;
    let output: String =
        db.query_one("SELECT output FROM executions WHERE run_id = $1 AND idx = 0", &[&run]).await?.get(0);
    assert!(output.contains("db_password=[REDACTED]") && output.contains("Bearer [REDACTED]"), "{output}");
    let everything: String = db
        .query_one(
            "SELECT concat_ws(' ',
               (SELECT string_agg(message || data::text, ' ') FROM run_events WHERE run_id = $1),
               (SELECT string_agg(state::text || coalesce(reason, ''), ' ') FROM runs WHERE id = $1),
               (SELECT string_agg(command || coalesce(output, ''), ' ') FROM executions WHERE run_id = $1),
               (SELECT string_agg(error || diagnosis || result, ' ') FROM episodes WHERE run_id = $1),
               (SELECT string_agg(error || labels::text, ' ') FROM incidents WHERE id = $1),
               (SELECT string_agg(checks::text || coalesce(feedback, ''), ' ') FROM evaluations WHERE run_id = $1))",
            &[&run],
        )
        .await?
        .get(0);
    assert!(everything.contains("[REDACTED]"), "the redaction ran");
    assert!(everything.contains("ERROR login failed"), "the useful part of the evidence is kept");
    for s in SECRETS {
        assert!(!everything.contains(s), "{s} reached Postgres");
    }
    let events: String = crew.events.seen.iter().map(|e| format!("{} {}", e.message, e.data)).collect();
    for s in SECRETS {
        assert!(!events.contains(s), "{s} reached the bus");
    }
    let metrics = scrape(&format!("http://127.0.0.1:{port}/metrics")).await?;
    let metrics: String = metrics.iter().map(|(series, _)| series.as_str()).collect();
    assert!(metrics.contains("pitcrew_commands_total"), "{metrics}");
    for s in SECRETS {
        assert!(!metrics.contains(s), "{s} reached /metrics");
    }
    stop(&mut worker)?;
    let spans = receiver.bodies();
    assert!(spans.contains(&run.to_string()) && spans.contains("\"command\""), "the run's spans were exported");
    for s in SECRETS {
        assert!(!spans.contains(s), "{s} reached an exported span");
    }
    let logged = std::fs::read_to_string(&worker.log)?;
    assert!(logged.contains(&run.to_string()), "the worker logged the run at debug level");
    for s in SECRETS {
        assert!(!logged.contains(s), "{s} reached the worker's log");
    }
    drop(worker);
    crew.shutdown().await
}

/// A command that names a secret as `{secret:NAME}` runs with the value the worker holds
/// (`PITCREW_SECRET_NAME`), while the run, its executions, its episode, its events and the
/// worker's log keep the placeholder: the value reaches only the program's arguments (and is
/// redacted from its output). The service's own commands, as configured, name it without
/// approval; any other command that does waits for a human. A worker without the value runs
/// nothing of the command and says which is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_a_command_names_reaches_the_program_and_nothing_else() -> anyhow::Result<()> {
    const VALUE: &str = "rotated-Kx9-7Qp2";
    let env = TestEnv::start().await?;
    let healthy = env.path("svc-healthy");
    // Its start echoes the secret back; its restart marks it with a name made with it.
    let book = write(
        &env,
        "playbook.toml",
        &format!(
            "[[rule]]\nname = \"rotate\"\nmatch = \"credentials expired\"\ndiagnosis = \"{{service}}: {{error}}\"\n\
             plans = [[\"{{start}}\", \"{{restart}}\", \"touch {healthy}\"]]\n\
             [[rule]]\nname = \"elsewhere\"\nmatch = \"send it\"\ndiagnosis = \"{{service}}: {{error}}\"\n\
             plans = [[\"touch {healthy}-elsewhere-{{secret:api_key}}\"]]\n\
             [[rule]]\nname = \"keyed\"\nmatch = \"keyed check\"\ndiagnosis = \"{{service}}: {{error}}\"\n\
             plans = [[\"touch {healthy}-keyed\"]]\n"
        ),
    );
    let text = format!(
        "[reasoning]\nplaybook_file = \"{book}\"\n[services.svc]\nhost = \"local\"\n\
         start = \"echo key={{secret:api_key}}\"\nrestart = \"touch {healthy}-{{secret:api_key}}\"\n\
         check = {{ kind = \"command\", command = \"test -f {healthy}\" }}\n\
         [services.keyed]\nhost = \"local\"\n\
         check = {{ kind = \"command\", command = \"test -f {healthy}-keyed --{{secret:api_key}}\" }}\n"
    );
    let mut crew = Crew::start_in(env, &text, &[]).await?;
    let stages: Vec<&str> = Stage::ALL.iter().map(|s| s.as_str()).collect();
    let secret = [("PITCREW_SECRET_API_KEY", VALUE), ("PITCREW_LOG", "debug")];
    let mut worker = crew.spawn_worker_with("w", &stages, &secret, "")?;
    let run = crew.open("svc", "credentials expired").await?;
    let end = crew.events.terminal(run, common::WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    assert!(std::path::Path::new(&format!("{healthy}-{VALUE}")).exists(), "the program got the value");

    let db = crew.db().await?;
    let commands = texts(&db, "SELECT command FROM executions WHERE run_id = $1 ORDER BY idx", run).await;
    assert_eq!(commands[0], "echo key={secret:api_key}", "kept as planned");
    let output = texts(&db, "SELECT coalesce(output, '') FROM executions WHERE run_id = $1 AND idx = 0", run).await;
    assert!(output[0].contains("key=[REDACTED]"), "{output:?}");
    let everything = texts(
        &db,
        "SELECT concat_ws(' ', (SELECT string_agg(state::text, ' ') FROM runs WHERE id = $1),
                (SELECT string_agg(command || coalesce(output, ''), ' ') FROM executions WHERE run_id = $1),
                (SELECT string_agg(array_to_string(commands, ' ') || coalesce(result, ''), ' ') FROM episodes WHERE run_id = $1),
                (SELECT string_agg(message || data::text, ' ') FROM run_events WHERE run_id = $1))",
        run,
    )
    .await
    .concat();
    assert!(everything.contains("{secret:api_key}"), "the placeholder is what is kept");
    assert!(!everything.contains(VALUE), "the value reached Postgres");

    // A command of another's making that names it: a human approves where the value goes.
    let elsewhere = crew.open("svc", "send it").await?;
    let asked = crew.events.wait(elsewhere, |e| e.kind == EventKind::ApprovalRequested, common::WAIT).await?;
    assert!(asked.message.contains("waiting for approval"), "{}", asked.message);
    let rule: String = db.query_one("SELECT rule FROM approvals WHERE run_id = $1", &[&elsewhere]).await?.get(0);
    assert!(rule.starts_with("secret-use"), "{rule}");
    let events: String = crew.events.seen.iter().map(|e| format!("{} {}", e.message, e.data)).collect();
    assert!(!events.contains(VALUE), "the value reached the bus");
    stop(&mut worker)?;
    let logged = std::fs::read_to_string(&worker.log)?;
    assert!(!logged.contains(VALUE), "the value reached the worker's log");
    drop(worker);

    // A worker that does not hold it runs none of the plan's commands that name it, nor the
    // rest of the plan, and says which is missing. Nothing is known of those commands: they
    // are recorded as not run, and episodic memory, which every worker reads, does not bar
    // them as failed (a worker that holds the value would not be let run them). Verify
    // decides, and with the same plan every attempt the run escalates.
    let mut bare = crew.spawn_worker_with("w2", &stages, &[], "")?;
    std::fs::remove_file(&healthy)?;
    let again = crew.open("svc", "credentials expired again").await?;
    let end = crew.events.terminal(again, common::WAIT).await?;
    assert_eq!(end.kind, EventKind::Escalated, "{}", end.message);
    // The escalation says nothing ran, and why.
    assert!(
        end.message.contains("(no command of attempt")
            && end.message.contains("ran: not run by worker w2")
            && end.message.contains("PITCREW_SECRET_API_KEY"),
        "{}",
        end.message
    );
    let sql = "SELECT idx || ' ' || status || ': ' || coalesce(output, '') FROM executions WHERE run_id = $1 \
               ORDER BY attempt, idx";
    let records = texts(&db, sql, again).await;
    assert!(records.len() >= 2, "every attempt tried its plan: {records:?}");
    for record in &records {
        assert!(record.starts_with("0 skipped: not run by worker w2"), "{records:?}");
        assert!(record.contains("secret 'api_key' is not set on this worker"), "{records:?}");
        assert!(record.contains("PITCREW_SECRET_API_KEY"), "{records:?}");
    }
    let sql = "SELECT e->>'status' || ': ' || (e->>'output') FROM runs, jsonb_array_elements(state->'executions') e \
               WHERE id = $1 AND e->>'index' = '2'";
    let rest = texts(&db, sql, again).await;
    assert_eq!(rest.len(), 1, "the last attempt's record of the plan's last command: {rest:?}");
    assert!(rest[0].starts_with("skipped: not run: command 0 of the plan could not start"), "{rest:?}");
    assert!(!std::path::Path::new(&healthy).exists(), "the plan's last command did not run");
    let barred: i64 = db
        .query_one(
            "SELECT count(*) FROM episodes WHERE NOT success AND 'echo key={secret:api_key}' = ANY(commands)",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(barred, 0, "memory would bar the service's own start for every worker");

    // A check this worker cannot run (it names the secret) tells nothing of the service: the
    // fix that ran is neither a success nor a failure, and no second attempt remediates a
    // service perhaps healthy: a human looks.
    let keyed = crew.open("keyed", "keyed check").await?;
    let end = crew.events.terminal(keyed, common::WAIT).await?;
    assert_eq!(end.kind, EventKind::Escalated, "{}", end.message);
    assert!(
        end.message.contains("cannot verify the fix") && end.message.contains("PITCREW_SECRET_API_KEY"),
        "{}",
        end.message
    );
    assert!(std::path::Path::new(&format!("{healthy}-keyed")).exists(), "its fix ran");
    let attempts = texts(&db, "SELECT DISTINCT attempt::text FROM executions WHERE run_id = $1", keyed).await;
    assert_eq!(attempts, ["1"], "one attempt");
    let sql = "SELECT success || ' ' || array_to_string(commands, ' ') FROM episodes WHERE run_id = $1";
    let episodes = texts(&db, sql, keyed).await;
    assert!(
        episodes.iter().all(|e| !e.contains("-keyed")),
        "memory learns nothing of a fix nobody could judge: {episodes:?}"
    );
    stop(&mut bare)?;
    drop(bare);
    crew.shutdown().await
}
