//! Crash safety under load: a batch of 200 incidents through worker processes (offline
//! providers, the local executor) while workers are SIGKILLed and restarted, or the
//! nats-server is restarted, or Postgres is stopped. After each, once nothing is left in
//! flight: every run has exactly one terminal state, the one its scenario dictates (in
//! Postgres and on the bus), the DLQ is empty, and no command ran twice for the same run and
//! attempt — checked in the executions table and against the target's own record of what ran
//! and when (`toy mark` appends a line each time it runs).

mod common;

use common::{exited, sigterm, Crew, Worker};
use pitcrew_model::Stage;
use pitcrew_testkit::TestEnv;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const N: usize = 200;
const DEADLINE: Duration = Duration::from_secs(240);
/// How long each fix takes (half before its trace, half after): long enough for a kill to
/// land while one runs.
const HOLD_MS: u64 = 400;

/// Service `i`'s fixes never make it healthy: its run ends escalated, after every plan.
fn doomed(i: usize) -> bool {
    i % 10 == 9
}

/// N services, each healthy once its marker exists (the doomed ones' fixes never make it);
/// start and restart leave a line in the shared record `ran.log`.
fn inventory(env: &TestEnv) -> String {
    let exe = env!("CARGO_BIN_EXE_pitcrew");
    let dir = env.dir.path().display().to_string();
    let mut text = String::new();
    for i in 0..N {
        let touch = if doomed(i) { String::new() } else { format!(" --touch {dir}/s{i}-up") };
        let mark =
            |verb: &str| format!("{exe} toy mark --file {dir}/ran.log --tag s{i}-{verb} --hold-ms {HOLD_MS}{touch}");
        text.push_str(&format!(
            "[services.s{i}]\nhost = \"local\"\nstart = \"{}\"\nrestart = \"{}\"\nevidence = []\n\
             check = {{ kind = \"command\", command = \"test -f {dir}/s{i}-up\" }}\n",
            mark("start"),
            mark("restart"),
        ));
    }
    text
}

fn all_stages() -> Vec<&'static str> {
    Stage::ALL.iter().map(|s| s.as_str()).collect()
}

/// A pseudo-random number below `n` (uuid v4 bytes are random).
fn below(n: u64) -> u64 {
    let b = uuid::Uuid::new_v4();
    u64::from_le_bytes(b.as_bytes()[..8].try_into().unwrap_or([0; 8])) % n.max(1)
}

/// Runs that reached a terminal state.
async fn finished(db: &tokio_postgres::Client) -> anyhow::Result<i64> {
    Ok(db.query_one("SELECT count(*) FROM runs WHERE status IN ('resolved', 'escalated')", &[]).await?.get(0))
}

/// Wait until at least `n` runs finished; past the deadline, fail saying `what`.
async fn wait_finished(db: &tokio_postgres::Client, n: usize, started: Instant, what: &str) -> anyhow::Result<()> {
    while finished(db).await? < n as i64 {
        anyhow::ensure!(started.elapsed() < DEADLINE, "{what} ({} of {n} finished)", finished(db).await?);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// The batch under way in `env`: no stage in this process, every stage in two worker
/// processes (`w0`, `w1`), one incident per service published.
async fn batch_under_way(env: TestEnv) -> anyhow::Result<(Crew, Vec<Worker>)> {
    // A command cut short by a kill is recorded interrupted once it can no longer be running:
    // its timeout and 10 s past its claim (which counts as the start of a local command).
    // Messages a killed worker held come back after 10 s.
    // A message delivered 8 times and over 30 s old whose next try fails is dead-lettered
    // (the defaults, 20 and an hour, could never be reached here): retrying in circles shows.
    let text = format!(
        "[limits]\ncommand_timeout_secs = 5\n[stages]\nack_wait_secs = 10\nmax_deliveries = 8\n\
         poison_after_secs = 30\n{}",
        inventory(&env)
    );
    let crew = Crew::start_in(env, &text, &[]).await?;
    let stages = all_stages();
    let workers = vec![crew.spawn_worker("w0", &stages, &[])?, crew.spawn_worker("w1", &stages, &[])?];
    for i in 0..N {
        crew.open(&format!("s{i}"), "connection refused").await?;
    }
    Ok((crew, workers))
}

/// Wait until nothing is left in flight: no stage message in the work-queue stream (naked,
/// held by a killed worker, waiting), none pending or unacknowledged at intake. A message a
/// killed worker held comes back after its ack wait, after its run ended: what it does then
/// is checked too.
async fn settled(crew: &Crew) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut stages = crew.bus.js.get_stream(crew.bus.subjects.stages_stream()).await?;
    let incidents = crew.bus.js.get_stream(crew.bus.subjects.incidents_stream()).await?;
    loop {
        let left = stages.info().await?.state.messages;
        let mut intake: async_nats::jetstream::consumer::PullConsumer =
            incidents.get_consumer(Stage::Intake.as_str()).await.map_err(|e| anyhow::anyhow!("{e}"))?;
        let intake = intake.info().await?;
        let (pending, unacked) = (intake.num_pending, intake.num_ack_pending);
        if left == 0 && pending == 0 && unacked == 0 {
            eprintln!("nothing left in flight {:.1} s after the last run ended", started.elapsed().as_secs_f64());
            return Ok(());
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(120),
            "still in flight 120 s after the batch: {left} stage messages, intake {pending} pending, {unacked} unacked"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Everything the batch must hold once it is over; the number of commands recorded
/// interrupted (cut short by a kill: run at most once, never started again).
async fn check_batch(crew: &Crew) -> anyhow::Result<i64> {
    settled(crew).await?;
    let db = crew.db().await?;
    // Each service's one run ended as its scenario dictates, with one terminal event.
    let rows = db
        .query(
            "SELECT state->'incident'->>'service', r.id, status,
                    (SELECT count(*) FROM run_events e WHERE e.run_id = r.id AND e.kind IN ('resolved', 'escalated')),
                    (SELECT min(kind) FROM run_events e WHERE e.run_id = r.id AND e.kind IN ('resolved', 'escalated'))
             FROM runs r",
            &[],
        )
        .await?;
    anyhow::ensure!(rows.len() == N, "one run a service: {} runs", rows.len());
    let mut ended = BTreeMap::new();
    for r in &rows {
        let (service, run, status, terminal, kind): (String, uuid::Uuid, String, i64, Option<String>) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
        let i: usize = service.trim_start_matches('s').parse()?;
        let want = if doomed(i) { "escalated" } else { "resolved" };
        anyhow::ensure!(status == want, "{service}'s run {run} is {status}, not {want}");
        anyhow::ensure!(
            (terminal, kind.as_deref()) == (1, Some(want)),
            "{service}'s run {run}: {terminal} terminal events ({kind:?}), one {want} expected"
        );
        ended.insert(run, want);
    }
    // Escalated for the scenario's reason (every fix tried, the service still down), not for
    // one the disruption caused (a step that failed, a target never free, a check not run).
    for r in db.query("SELECT id, reason FROM runs WHERE status = 'escalated'", &[]).await? {
        let (run, reason): (uuid::Uuid, Option<String>) = (r.get(0), r.get(1));
        anyhow::ensure!(
            reason.as_deref().is_some_and(|r| r.starts_with("no untried remediation left: ")),
            "run {run} escalated for another reason than its scenario's: {reason:?}"
        );
    }
    // Subscribers see the same: one terminal event a run on the bus.
    let events = crew.bus.js.get_stream(crew.bus.subjects.events_stream()).await?;
    let base = crew.bus.subjects.events_all().trim_end_matches('>').to_string();
    let mut on_bus: BTreeMap<uuid::Uuid, Vec<(String, usize)>> = BTreeMap::new();
    for kind in ["resolved", "escalated"] {
        let mut subjects = events.info_with_subjects(format!("{base}*.{kind}")).await?;
        while let Some(subject) = futures::StreamExt::next(&mut subjects).await {
            let (subject, count) = subject?;
            let run: uuid::Uuid = subject.trim_start_matches(&base).split('.').next().unwrap_or_default().parse()?;
            on_bus.entry(run).or_default().push((kind.to_string(), count));
        }
    }
    anyhow::ensure!(on_bus.len() == N, "every run's end was published: {} of {N}", on_bus.len());
    for (run, published) in &on_bus {
        anyhow::ensure!(
            published == &vec![(ended[run].to_string(), 1)],
            "run {run}: one terminal event on the bus, {} expected: {published:?}",
            ended[run]
        );
    }

    let mut dlq = crew.bus.js.get_stream(crew.bus.subjects.dlq_stream()).await?;
    let dead = dlq.info().await?.state.messages;
    if dead > 0 {
        let first = dlq.get_raw_message(1).await?;
        anyhow::bail!(
            "the DLQ holds {dead} messages; the first, on {}: {:?} {}",
            first.subject,
            first.headers,
            String::from_utf8_lossy(&first.payload).chars().take(400).collect::<String>()
        );
    }

    // The target's own record against the executions table. Each line lies inside exactly one
    // execution's window of its command (from its claim to its end, or to when it was recorded
    // interrupted): a finished execution holds exactly one line, an interrupted one at most
    // one (it may have been cut before it ran), one finished as not run none.
    let record = std::fs::read_to_string(crew.env.path("ran.log"))?;
    let mut lines: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for line in record.lines() {
        let (tag, at) = line.split_once(' ').ok_or_else(|| anyhow::anyhow!("bad record line {line:?}"))?;
        lines.entry(tag.to_string()).or_default().push(at.parse()?);
    }
    let rows = db
        .query(
            "SELECT substring(command from '--tag ([^ ]+)'), run_id, attempt, idx, coalesce(status, ''),
                    (EXTRACT(EPOCH FROM started_at) * 1000000)::int8,
                    (EXTRACT(EPOCH FROM coalesce(finished_at, now())) * 1000000)::int8
             FROM executions",
            &[],
        )
        .await?;
    anyhow::ensure!(rows.len() >= N, "every run ran a command: {} executions", rows.len());
    // The lines of `tag`'s command within a window.
    let inside = |tag: &str, from: i64, to: i64| {
        lines.get(tag).map_or(0, |at| at.iter().filter(|t| (from..=to).contains(*t)).count())
    };
    let (mut interrupted, mut statuses) = (0, BTreeMap::<String, usize>::new());
    for r in &rows {
        let (tag, run, attempt, idx, status, from, to): (String, uuid::Uuid, i32, i32, String, i64, i64) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5), r.get(6));
        let inside = inside(&tag, from, to);
        let what = format!("{tag} (run {run}, attempt {attempt}, command {idx}, {status:?}) ran {inside} times");
        match status.as_str() {
            "succeeded" | "failed" => anyhow::ensure!(inside == 1, "{what}"),
            // Killed at its deadline, maybe before it wrote its line (a slow start).
            "timed_out" | "interrupted" => {
                anyhow::ensure!(inside <= 1, "{what}");
                interrupted += i64::from(status == "interrupted");
            }
            _ => anyhow::ensure!(inside == 0, "{what}"),
        }
        *statuses.entry(status).or_default() += 1;
    }
    // A claim released or removed (kept in `execution_releases`) had nothing run under it: no
    // line of its command inside its window.
    let released = db
        .query(
            "SELECT substring(command from '--tag ([^ ]+)'), run_id, attempt, idx, why,
                    (EXTRACT(EPOCH FROM claimed_at) * 1000000)::int8,
                    (EXTRACT(EPOCH FROM released_at) * 1000000)::int8
             FROM execution_releases",
            &[],
        )
        .await?;
    for r in &released {
        let (tag, run, attempt, idx, why, from, to): (String, uuid::Uuid, i32, i32, String, i64, i64) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5), r.get(6));
        let inside = inside(&tag, from, to);
        anyhow::ensure!(
            inside == 0,
            "{tag} (run {run}, attempt {attempt}, command {idx}) ran {inside} times under a claim released: {why}"
        );
    }
    for (tag, at) in &lines {
        for t in at {
            let windows = rows
                .iter()
                .filter(|r| r.get::<_, String>(0) == *tag && (r.get::<_, i64>(5)..=r.get::<_, i64>(6)).contains(t))
                .count();
            anyhow::ensure!(windows == 1, "{tag} ran at {t} inside {windows} executions' windows (one expected)");
        }
    }
    eprintln!(
        "batch of {N}: {} resolved, {} escalated, each as its scenario dictates; {} executions {statuses:?}, \
         {} claims released; {} lines in the target's record",
        ended.values().filter(|k| **k == "resolved").count(),
        ended.values().filter(|k| **k == "escalated").count(),
        rows.len(),
        released.len(),
        record.lines().count()
    );
    Ok(interrupted)
}

/// A worker that holds a command running now, among `names`: its index. Running: claimed as
/// started (not a plan's skip) 150 ms ago, so its process surely started (the fixes take 400
/// ms). A kill in the few milliseconds between a local command's claim (which counts as its
/// start) and its process start leaves it recorded interrupted though it never ran, and never
/// run again (whether it ran is unknown from outside); two such kills on one run used up its
/// fixes and it escalated (the CI failure of 2026-11-26). The kills aimed here are aimed at
/// commands running, not at that window.
async fn running_a_command(db: &tokio_postgres::Client, names: &[String]) -> anyhow::Result<Option<usize>> {
    let row = db
        .query_opt(
            "SELECT worker FROM executions WHERE status IS NULL AND started AND worker = ANY($1)
               AND started_at < now() - interval '150 milliseconds' LIMIT 1",
            &[&names],
        )
        .await?;
    Ok(row.and_then(|r| names.iter().position(|n| *n == r.get::<_, String>(0))))
}

/// A command running now, waited for up to 10 s: its run, attempt and index, and the
/// database's time as it was seen running. Started 150-250 ms ago (as for
/// [`running_a_command`], so its process surely started), so the fix (400 ms) has 150 ms or
/// more to run: a disruption that follows at once comes while it runs.
async fn a_command_running(
    db: &tokio_postgres::Client,
) -> anyhow::Result<((uuid::Uuid, i32, i32), chrono::DateTime<chrono::Utc>)> {
    let looking = Instant::now();
    while looking.elapsed() < Duration::from_secs(10) {
        let row = db
            .query_opt(
                "SELECT run_id, attempt, idx, now() FROM executions WHERE status IS NULL AND started
                   AND started_at < now() - interval '150 milliseconds'
                   AND started_at > now() - interval '250 milliseconds' LIMIT 1",
                &[],
            )
            .await?;
        if let Some(r) = row {
            return Ok(((r.get(0), r.get(1), r.get(2)), r.get(3)));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::bail!("no command was running in 10 s")
}

/// The command that ran across a disruption ended after `after` (by the database's clock), and
/// its end was recorded as it ended, not as cut short: the step running it went through the
/// disruption.
async fn ended_after(
    db: &tokio_postgres::Client,
    (run, attempt, idx): (uuid::Uuid, i32, i32),
    after: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<()> {
    let row = db
        .query_one(
            "SELECT status, finished_at FROM executions WHERE run_id = $1 AND attempt = $2 AND idx = $3",
            &[&run, &attempt, &idx],
        )
        .await?;
    let (status, finished): (Option<String>, Option<chrono::DateTime<chrono::Utc>>) = (row.get(0), row.get(1));
    anyhow::ensure!(
        matches!(status.as_deref(), Some("succeeded" | "failed")),
        "command {idx} of run {run}'s attempt {attempt}, running across the disruption, ended {status:?}"
    );
    anyhow::ensure!(
        finished.is_some_and(|f| f > after),
        "command {idx} of run {run}'s attempt {attempt} ended at {finished:?}, not after {after}"
    );
    Ok(())
}

/// Workers SIGKILLed 12 times, 200-800 ms apart; every other kill waits (up to 10 s) for a
/// worker that is running a command and kills that one, so kills land mid-command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_killed_at_random_lose_nothing_and_repeat_nothing() -> anyhow::Result<()> {
    let (crew, mut workers) = batch_under_way(TestEnv::start().await?).await?;
    let mut names = vec!["w0".to_string(), "w1".to_string()];
    let stages = all_stages();
    let db = crew.db().await?;
    let started = Instant::now();
    let (mut kills, mut mid_command) = (0, 0);
    while finished(&db).await? < N as i64 {
        anyhow::ensure!(started.elapsed() < DEADLINE, "batch not done in {DEADLINE:?} ({kills} kills)");
        tokio::time::sleep(Duration::from_millis(200 + below(600))).await;
        if kills < 12 {
            let mut k = below(2) as usize;
            if kills % 2 == 1 {
                let looking = Instant::now();
                while looking.elapsed() < Duration::from_secs(10) {
                    if let Some(busy) = running_a_command(&db, &names).await? {
                        (k, mid_command) = (busy, mid_command + 1);
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            let _ = workers[k].child.kill();
            let _ = workers[k].child.wait();
            kills += 1;
            names[k] = format!("w{k}-{kills}");
            workers[k] = crew.spawn_worker(&names[k], &stages, &[])?;
        }
    }
    eprintln!(
        "SIGKILLed a worker {kills} times ({mid_command} while it ran a command); batch done in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    anyhow::ensure!(kills >= 3, "the batch outlived several kills ({kills})");
    let interrupted = check_batch(&crew).await?;
    anyhow::ensure!(
        mid_command >= 1 && interrupted >= 1,
        "no kill landed mid-command ({mid_command}, {interrupted} interrupted)"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_restart_mid_batch_loses_nothing_and_repeats_nothing() -> anyhow::Result<()> {
    let (mut crew, _workers) = batch_under_way(TestEnv::start().await?).await?;
    let db = crew.db().await?;
    let started = Instant::now();
    wait_finished(&db, N / 4, started, "the batch never got going").await?;
    // Restarted while a command runs: a step is mid-work across the restart.
    let (running, seen) = a_command_running(&db).await?;
    crew.env.nats.restart()?;
    let at = finished(&db).await?;
    anyhow::ensure!(at < N as i64, "the restart came mid-batch");
    eprintln!("nats-server restarted with {at} of {N} runs finished");
    wait_finished(&db, N, started, "batch not done after the restart").await?;
    eprintln!("batch done in {:.1} s", started.elapsed().as_secs_f64());
    check_batch(&crew).await?;
    ended_after(&db, running, seen).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down_for_ten_seconds_mid_batch_loses_nothing_and_repeats_nothing() -> anyhow::Result<()> {
    let mut pg = pitcrew_testkit::pg::PrivatePostgres::start()?;
    let (crew, _workers) = batch_under_way(TestEnv::start_on(&pg.admin_url()).await?).await?;
    let started = Instant::now();
    let db = crew.db().await?;
    wait_finished(&db, N / 4, started, "the batch never got going").await?;
    // Stopped while a command runs: its end is recorded once Postgres is back.
    let (running, _) = a_command_running(&db).await?;
    drop(db);
    pg.stop();
    eprintln!("postgres stopped at {:.1} s", started.elapsed().as_secs_f64());
    tokio::time::sleep(Duration::from_secs(10)).await;
    pg.restart()?;
    let back = crew.db().await?.query_one("SELECT now()", &[]).await?.get(0);
    eprintln!("postgres back at {:.1} s", started.elapsed().as_secs_f64());
    wait_finished(&crew.db().await?, N, started, "batch not done after the outage").await?;
    eprintln!("batch done in {:.1} s", started.elapsed().as_secs_f64());
    let cut = check_batch(&crew).await?;
    anyhow::ensure!(cut == 0, "a command that ran through the outage is recorded as it ended, not interrupted ({cut})");
    ended_after(&crew.db().await?, running, back).await?;
    // The steps retried through the outage say so where they start in their timelines; a
    // first delivery has no such line.
    let rows = crew
        .db()
        .await?
        .query(
            "SELECT message, (data->>'delivered')::int4 FROM run_events
             WHERE kind = 'status' AND (data->>'delivered')::int4 >= 2",
            &[],
        )
        .await?;
    anyhow::ensure!(!rows.is_empty(), "no step was redelivered through a ten-second outage");
    for r in &rows {
        let (line, delivered): (String, i32) = (r.get(0), r.get(1));
        anyhow::ensure!(
            delivered >= 2 && line.contains(": attempt ") && line.ends_with(&format!(", delivery {delivered}")),
            "{line}"
        );
    }
    eprintln!("{} steps marked as redelivered in their timelines", rows.len());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_sigtermed_mid_batch_drains_and_exits_cleanly() -> anyhow::Result<()> {
    let (crew, mut workers) = batch_under_way(TestEnv::start().await?).await?;
    let w0 = &mut workers[0];
    let db = crew.db().await?;
    let started = Instant::now();
    wait_finished(&db, N / 4, started, "the batch never got going").await?;
    sigterm(w0, Duration::from_secs(45)).await?;
    let log = std::fs::read_to_string(&w0.log)?;
    anyhow::ensure!(log.contains("finishing messages in hand"), "{log}");
    wait_finished(&db, N, started, "batch not done with one worker left").await?;
    let cut = check_batch(&crew).await?;
    anyhow::ensure!(cut == 0, "a drained worker leaves no command half-done ({cut} interrupted)");
    Ok(())
}

/// A playbook whose first plan starts with a nap (`sleep <secs>`), then makes the service
/// healthy; its second plan only makes it healthy.
fn nap_playbook(secs: &str) -> String {
    format!(
        r#"
[[rule]]
name = "nap"
match = "(?i)needs a nap"
diagnosis = "{{service}} needs a nap"
plans = [["sleep {secs}", "touch {{dir}}/svc-healthy"], ["touch {{dir}}/svc-healthy"]]
"#
    )
}

/// Processes on this machine running `sleep <secs>`.
fn naps(secs: &str) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    let line = format!("sleep\0{secs}\0");
    dir.filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok()).filter(|c| c == line.as_bytes()).count()
}

/// A crew in `env` with no stage of its own whose one service needs the nap of `secs`, under
/// `limits`.
async fn napping(env: TestEnv, secs: &str, limits: &str) -> anyhow::Result<Crew> {
    let book = common::write(&env, "playbook.toml", &nap_playbook(secs));
    let text = format!("{limits}[reasoning]\nplaybook_file = \"{book}\"\n{}", common::marker_service(&env, "svc"));
    Crew::start_in(env, &text, &[]).await
}

/// The status of command `index` of `run`'s first attempt, once claimed ("" while it runs).
async fn command_status(db: &tokio_postgres::Client, run: uuid::Uuid, index: i32) -> anyhow::Result<Option<String>> {
    let row = db
        .query_opt(
            "SELECT coalesce(status, '') FROM executions WHERE run_id = $1 AND attempt = 1 AND idx = $2",
            &[&run, &index],
        )
        .await?;
    Ok(row.map(|r| r.get(0)))
}

/// Wait until `run`'s first command, the nap of `secs`, is claimed and running.
async fn nap_started(db: &tokio_postgres::Client, run: uuid::Uuid, secs: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    while !(command_status(db, run, 0).await?.as_deref() == Some("") && naps(secs) > 0) {
        anyhow::ensure!(started.elapsed() < Duration::from_secs(60), "the nap never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// A run whose nap (`secs`, longer than its 8 s timeout) runs on worker `w0`, whose drain is
/// 1 s: a SIGTERM cuts the nap short. The crew, the worker, the run and a Postgres client.
async fn cut_by_the_drain(secs: &str) -> anyhow::Result<(Crew, Worker, uuid::Uuid, tokio_postgres::Client)> {
    let crew = napping(TestEnv::start().await?, secs, "[limits]\ncommand_timeout_secs = 8\n").await?;
    let w0 = crew.spawn_worker("w0", &all_stages(), &[("PITCREW_STAGES__DRAIN_SECS", "1")])?;
    let run = crew.open("svc", "svc needs a nap").await?;
    let db = crew.db().await?;
    nap_started(&db, run, secs).await?;
    Ok((crew, w0, run, db))
}

/// Wait (up to 60 s) until `w`'s log holds `text`, failing if `w` exits first; the first line
/// holding it.
async fn logged(w: &mut Worker, text: &str) -> anyhow::Result<String> {
    let started = Instant::now();
    loop {
        let log = std::fs::read_to_string(&w.log)?;
        if let Some(line) = log.lines().find(|l| l.contains(text)) {
            return Ok(line.to_string());
        }
        anyhow::ensure!(w.child.try_wait()?.is_none(), "the worker exited: {log}");
        // Start-up tries are up to 15 s apart.
        anyhow::ensure!(started.elapsed() < Duration::from_secs(60), "no {text:?} in 60 s: {log}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Wait (up to 120 s, polling Postgres: the bus may have been down) until `run` resolved; how
/// long it took.
async fn resolved(db: &tokio_postgres::Client, run: uuid::Uuid) -> anyhow::Result<Duration> {
    let started = Instant::now();
    loop {
        // No row yet: intake has not opened the run.
        let status: Option<String> =
            db.query_opt("SELECT status FROM runs WHERE id = $1", &[&run]).await?.map(|r| r.get(0));
        if status.as_deref() == Some("resolved") {
            return Ok(started.elapsed());
        }
        anyhow::ensure!(started.elapsed() < Duration::from_secs(120), "run {run} never resolved: {status:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A worker stopped while a command outlasts its drain deadline (`drain_secs = 1`): it exits 0
/// about a second after SIGTERM, the command killed with it, and hands the message back at
/// once: the next worker takes it over within seconds (not after the 30 s ack wait), but
/// records the command interrupted only once it can no longer be running (its 8 s timeout and
/// 10 s past its claim), then the run moves on and resolves on its second plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_past_its_drain_deadline_hands_its_run_on_at_once() -> anyhow::Result<()> {
    // Longer than its timeout: whenever the SIGTERM comes, the drain cuts it.
    const NAP: &str = "30.73";
    let (mut crew, mut w0, run, db) = cut_by_the_drain(NAP).await?;
    let stages = all_stages();
    let exited = sigterm(&mut w0, Duration::from_secs(15)).await?;
    assert!(exited >= Duration::from_secs(1), "exited before its drain deadline: {exited:?}");
    assert_eq!(naps(NAP), 0, "the command was killed with the worker");
    assert_eq!(command_status(&db, run, 0).await?.as_deref(), Some(""), "nobody recorded an end");
    let log = std::fs::read_to_string(&w0.log)?;
    assert!(!log.contains('\x1b'), "a log written to a file has no colour codes: {log}");
    assert!(log.contains("drain deadline passed") && log.contains("handed_back=1"), "{log}");

    let _w1 = crew.spawn_worker("w1", &stages, &[])?;
    let handed = Instant::now();
    let waiting = crew.events.wait(run, |e| e.message.contains("may still be running on local"), common::WAIT).await?;
    let took = handed.elapsed();
    eprintln!("w1 took the run over {:.2} s after it started: {}", took.as_secs_f64(), waiting.message);
    assert!(took < Duration::from_secs(15), "not handed back at once: the next worker took {took:?}");
    let end = crew.events.terminal(run, common::WAIT).await?;
    assert_eq!(end.kind, pitcrew_model::EventKind::Resolved, "{}", end.message);
    let row = db
        .query_one(
            "SELECT status, EXTRACT(EPOCH FROM finished_at - started_at)::float8 FROM executions
             WHERE run_id = $1 AND attempt = 1 AND idx = 0",
            &[&run],
        )
        .await?;
    let (status, after): (String, f64) = (row.get(0), row.get(1));
    assert_eq!(status, "interrupted");
    assert!(after >= 18.0, "recorded interrupted {after:.1} s after its claim, before its deadline (8 + 10 s)");
    let naps_run: i64 = db
        .query_one(
            "SELECT count(*) FROM executions WHERE run_id = $1 AND command = $2",
            &[&run, &format!("sleep {NAP}")],
        )
        .await?
        .get(0);
    assert_eq!(naps_run, 1, "the interrupted command is never started again");
    Ok(())
}

/// A stopping worker finishes the command it is running but starts no other that its drain
/// (3 s) might cut short (a command may take 5 s, and 10 s more to be ended): the rest of the
/// plan goes to the next worker, and the run resolves on its first attempt with nothing
/// interrupted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_worker_starts_no_command_its_drain_might_cut_short() -> anyhow::Result<()> {
    const NAP: &str = "1.37";
    let mut crew =
        napping(TestEnv::start().await?, NAP, "[limits]\ncommand_timeout_secs = 5\n[stages]\ndrain_secs = 3\n").await?;
    let stages = all_stages();
    let mut w0 = crew.spawn_worker("w0", &stages, &[])?;
    let run = crew.open("svc", "svc needs a nap").await?;
    let db = crew.db().await?;
    nap_started(&db, run, NAP).await?;
    sigterm(&mut w0, Duration::from_secs(15)).await?;
    assert_eq!(command_status(&db, run, 0).await?.as_deref(), Some("succeeded"), "the running command finished");
    assert_eq!(command_status(&db, run, 1).await?, None, "a stopping worker started the next command");
    let log = std::fs::read_to_string(&w0.log)?;
    assert!(!log.contains("drain deadline passed"), "{log}");

    let _w1 = crew.spawn_worker("w1", &stages, &[])?;
    let end = crew.events.terminal(run, common::WAIT).await?;
    assert_eq!(end.kind, pitcrew_model::EventKind::Resolved, "{}", end.message);
    let rows = db
        .query("SELECT attempt, idx, worker, status FROM executions WHERE run_id = $1 ORDER BY attempt, idx", &[&run])
        .await?;
    let rows: Vec<(i32, i32, String, String)> = rows.iter().map(|r| (r.get(0), r.get(1), r.get(2), r.get(3))).collect();
    assert_eq!(
        rows,
        vec![(1, 0, "w0".to_string(), "succeeded".to_string()), (1, 1, "w1".to_string(), "succeeded".to_string())]
    );
    let timeline = common::texts(&db, "SELECT message FROM run_events WHERE run_id = $1 ORDER BY seq, idx", run).await;
    assert!(
        timeline
            .iter()
            .any(|m| m.contains("worker w0 is stopping") && m.contains("command 1 of the plan and the rest")),
        "{timeline:#?}"
    );
    Ok(())
}

/// An outage that outlasts the delivery limits (here 2 deliveries and 1 s, against the
/// defaults' 20 and an hour): messages past them are retried while Postgres is unreachable,
/// not dead-lettered. An incident that arrived during the outage is not refused for want of a
/// run once it is back: it is opened and remediated; an approval given during the outage is
/// not dropped: the plan it approves runs once Postgres is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_longer_than_the_delivery_limits_dead_letters_nothing() -> anyhow::Result<()> {
    let mut pg = pitcrew_testkit::pg::PrivatePostgres::start()?;
    let env = TestEnv::start_on(&pg.admin_url()).await?;
    let book = common::write(&env, "playbook.toml", common::LOCKED_PLAYBOOK);
    let svc = common::marker_service(&env, "svc");
    let limits = "[stages]\nmax_deliveries = 2\npoison_after_secs = 1\n";
    let text = format!("{limits}[reasoning]\nplaybook_file = \"{book}\"\n{svc}");
    let mut crew = Crew::start_in(env, &text, &[]).await?;
    let _worker = crew.spawn_worker("w0", &all_stages(), &[])?;
    // The worker is up: a first incident goes through.
    let first = crew.open_with("svc", "GET /health: connection refused", Some("first".into())).await?;
    assert_eq!(crew.events.terminal(first, common::WAIT).await?.kind, pitcrew_model::EventKind::Resolved);
    std::fs::remove_file(crew.env.path("svc-healthy"))?;
    // A run whose plan waits for an approval.
    let parked = crew.open_with("svc", "stale lock held", Some("parked".into())).await?;
    crew.events.kind(parked, pitcrew_model::EventKind::ApprovalRequested, common::WAIT).await?;
    pg.stop();
    let run = crew.open_with("svc", "GET /health: connection refused", Some("second".into())).await?;
    // Given while Postgres is down (the CLI cannot look at the store either).
    let approve = pitcrew::cli::DecisionInput::cli(parked, pitcrew_model::Decision::Approve, "ann", None, &crew.cfg);
    pitcrew::cli::submit(&crew.bus, None, approve).await?;
    // Intake and the decision are delivered again and again past both limits while Postgres
    // is down.
    tokio::time::sleep(Duration::from_secs(6)).await;
    pg.restart()?;
    let end = crew.events.terminal(run, common::WAIT).await?;
    assert_eq!(end.kind, pitcrew_model::EventKind::Resolved, "{}", end.message);
    let end = crew.events.terminal(parked, common::WAIT).await?;
    assert_eq!(end.kind, pitcrew_model::EventKind::Resolved, "{}", end.message);
    assert!(end.message.contains("approved by ann"), "{}", end.message);
    assert_eq!(crew.dead_letters().await?, 0, "nothing was dead-lettered");
    Ok(())
}

/// A crew that dead-letters past 1 delivery and 1 s, a run waiting at diagnose, and another
/// session holding `lock(run)` in a transaction it leaves open (`ROLLBACK` ends it); the crew
/// then runs every stage with a 1 s statement timeout. Returns the crew, the run, a client
/// for looking, and the session holding the lock.
async fn diagnose_meets_a_lock(
    lock: impl Fn(uuid::Uuid) -> String,
) -> anyhow::Result<(Crew, uuid::Uuid, tokio_postgres::Client, tokio_postgres::Client)> {
    let env = TestEnv::start().await?;
    let svc = common::marker_service(&env, "svc");
    let text = format!("[stages]\nmax_deliveries = 1\npoison_after_secs = 1\n{svc}");
    let before: Vec<Stage> = Stage::ALL.into_iter().filter(|s| *s != Stage::Diagnose).collect();
    let mut crew = Crew::start_in(env, &text, &before).await?;
    let run = crew.open("svc", "GET /health: connection refused").await?;
    let db = crew.db().await?;
    let deadline = Instant::now() + common::WAIT;
    while common::count(&db, "SELECT count(*) FROM runs WHERE id = $1 AND stage = 'diagnose'", run).await == 0 {
        anyhow::ensure!(Instant::now() < deadline, "the run never reached diagnose");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (locker, conn) = tokio_postgres::connect(&crew.cfg.database.url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    locker.batch_execute(&format!("BEGIN; {}", lock(run))).await?;
    crew.shutdown().await?;
    crew.cfg.database.statement_timeout_secs = 1;
    crew.run(&Stage::ALL);
    Ok((crew, run, db, locker))
}

/// Wait until three tries have met the lock (a statement naming `named` waiting on it; each
/// try ends at the statement timeout), or something was dead-lettered, which ends the tries.
async fn tries_meet_the_lock(crew: &Crew, db: &tokio_postgres::Client, named: &str, never: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + common::WAIT;
    let sql =
        format!("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%{named}%'");
    let mut waits = 0;
    while waits < 3 && crew.dead_letters().await? == 0 {
        anyhow::ensure!(Instant::now() < deadline, "{never}");
        if db.query_one(&sql, &[]).await?.get::<_, i64>(0) > 0 {
            waits += 1;
            tokio::time::sleep(Duration::from_millis(1100)).await;
        } else {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(())
}

/// A step whose commit fails for a passing reason (here: the run's row locked elsewhere, past
/// the statement timeout) on a delivery past the limits (2 deliveries and 1 s here; after a
/// long outage, any backlog) is retried, not dead-lettered: the step did its work, only
/// writing it down failed for a while. The run resolves once the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_fails_for_a_while_past_the_delivery_limits_is_retried_not_dead_lettered() -> anyhow::Result<()> {
    // Another session holds the run's row: every commit of diagnose's transition waits out
    // the statement timeout, delivery after delivery, past both limits.
    let (mut crew, run, db, locker) =
        diagnose_meets_a_lock(|run| format!("SELECT 1 FROM runs WHERE id = '{run}' FOR UPDATE")).await?;
    tries_meet_the_lock(&crew, &db, "UPDATE runs", "diagnose never tried to commit").await?;
    locker.batch_execute("ROLLBACK").await?;
    let end = crew.events.terminal(run, common::WAIT).await?;
    assert_eq!(end.kind, pitcrew_model::EventKind::Resolved, "{}", end.message);
    assert_eq!(crew.dead_letters().await?, 0, "nothing was dead-lettered");
    let deliveries = common::texts(
        &db,
        "SELECT message FROM run_events WHERE run_id = $1 AND stage = 'diagnose' AND message LIKE 'diagnose: attempt 1, delivery %'",
        run,
    )
    .await;
    assert!(!deliveries.is_empty(), "diagnose committed on a redelivery past its limits");
    crew.shutdown().await
}

/// A step whose own read of Postgres fails for a passing reason (here: the episodes table
/// locked elsewhere, so diagnose's read of its memory meets the statement timeout) on a
/// delivery past the limits is retried like a commit that fails for a while, not
/// dead-lettered: Postgres answered the check that it can take writes, so the step's error
/// was read as the step's own, and a backlog past its limits after an outage lost runs to one
/// lock or dropped connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_reads_fail_for_a_while_past_the_delivery_limits_is_retried_not_dead_lettered(
) -> anyhow::Result<()> {
    let (mut crew, run, db, locker) =
        diagnose_meets_a_lock(|_| "LOCK TABLE episodes IN ACCESS EXCLUSIVE MODE".into()).await?;
    tries_meet_the_lock(&crew, &db, "episodes", "diagnose never read its memory").await?;
    assert_eq!(crew.dead_letters().await?, 0, "dead-lettered while its reads timed out");
    locker.batch_execute("ROLLBACK").await?;
    let end = crew.events.terminal(run, common::WAIT).await?;
    assert_eq!(end.kind, pitcrew_model::EventKind::Resolved, "{}", end.message);
    assert_eq!(crew.dead_letters().await?, 0, "nothing was dead-lettered");
    crew.shutdown().await
}

/// A message that can never be read, arriving while Postgres is down, waits for Postgres
/// before it is dead-lettered: its run is looked up and escalated there, and every retry in
/// the outage stored another dead letter of it once past the bus's duplicate window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_in_a_postgres_outage_is_dead_lettered_once_postgres_is_back() -> anyhow::Result<()> {
    use async_nats::header::{HeaderMap, NATS_MESSAGE_ID};
    let mut pg = pitcrew_testkit::pg::PrivatePostgres::start()?;
    let env = TestEnv::start_on(&pg.admin_url()).await?;
    let svc = common::marker_service(&env, "svc");
    let mut crew = Crew::start_in(env, &svc, &Stage::ALL).await?;
    let run = crew.open("svc", "GET /health: connection refused").await?;
    assert_eq!(crew.events.terminal(run, common::WAIT).await?.kind, pitcrew_model::EventKind::Resolved);
    pg.stop();
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, "garbage-in-an-outage");
    headers.insert(pitcrew_model::codec::CONTENT_TYPE, pitcrew_model::codec::MSGPACK);
    headers.insert(pitcrew_runtime::bus::RUN_HEADER, run.to_string().as_str());
    crew.bus.publish_with_headers(crew.bus.subjects.stage(Stage::Verify), headers, "\u{1}not msgpack".into()).await?;
    // Delivered, and retried, while Postgres is down: not dead-lettered yet.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(crew.dead_letters().await?, 0, "dead-lettered while Postgres was down");
    pg.restart()?;
    let deadline = Instant::now() + common::WAIT;
    while crew.dead_letters().await? == 0 {
        anyhow::ensure!(Instant::now() < deadline, "never dead-lettered once Postgres was back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(crew.dead_letters().await?, 1);
    crew.shutdown().await
}

/// A worker told to stop while the nats-server is down still exits, within its drain deadline
/// and the bounded wait for NATS to take its hand-backs and acks (it used to wait forever for
/// its last flush), and nothing it held is lost: once NATS is back, the run it held comes
/// again after its ack wait and the next worker resolves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_while_nats_is_down_still_exits_and_loses_nothing() -> anyhow::Result<()> {
    const NAP: &str = "30.79";
    let (mut crew, mut w0, run, db) = cut_by_the_drain(NAP).await?;
    let stages = all_stages();
    crew.env.nats.kill();
    let exited = sigterm(&mut w0, Duration::from_secs(20)).await?;
    assert!(exited >= Duration::from_secs(1), "exited before its drain deadline: {exited:?}");
    assert_eq!(naps(NAP), 0, "the command was killed with the worker");
    let log = std::fs::read_to_string(&w0.log)?;
    assert!(log.contains("drain deadline passed"), "{log}");

    crew.env.nats.restart()?;
    let _w1 = crew.spawn_worker("w1", &stages, &[])?;
    let took = resolved(&db, run).await?;
    eprintln!("the run resolved {:.1} s after NATS came back", took.as_secs_f64());
    assert_eq!(command_status(&db, run, 0).await?.as_deref(), Some("interrupted"));
    Ok(())
}

/// A command that ends while Postgres is down is recorded as it ended once Postgres is back:
/// its worker knows the result and retries writing it (it used to give up at once, and the
/// next delivery recorded the command interrupted, outcome unknown, a minute later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_ending_during_a_postgres_outage_is_recorded_as_it_ended() -> anyhow::Result<()> {
    const NAP: &str = "4.71";
    let mut pg = pitcrew_testkit::pg::PrivatePostgres::start()?;
    let crew = napping(TestEnv::start_on(&pg.admin_url()).await?, NAP, "").await?;
    let _w0 = crew.spawn_worker("w0", &all_stages(), &[])?;
    let run = crew.open("svc", "svc needs a nap").await?;
    nap_started(&crew.db().await?, run, NAP).await?;
    pg.stop();
    assert!(naps(NAP) > 0, "the nap ended before Postgres was down");
    let down = Instant::now();
    while naps(NAP) > 0 {
        anyhow::ensure!(down.elapsed() < Duration::from_secs(30), "the nap never ended");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The nap ended with Postgres down; it stays down a while longer.
    tokio::time::sleep(Duration::from_secs(3)).await;
    pg.restart()?;
    eprintln!("postgres down for {:.1} s", down.elapsed().as_secs_f64());
    let db = crew.db().await?;
    let took = resolved(&db, run).await?;
    eprintln!("the run resolved {:.1} s after Postgres came back", took.as_secs_f64());
    assert_eq!(command_status(&db, run, 0).await?.as_deref(), Some("succeeded"), "the nap is recorded as it ended");
    let later: i64 =
        db.query_one("SELECT count(*) FROM executions WHERE run_id = $1 AND attempt > 1", &[&run]).await?.get(0);
    assert_eq!(later, 0, "resolved by its first plan");
    Ok(())
}

/// A crew (no stage in this process) on a Postgres of its own, with the marker service `svc`
/// and the config `extra`; then NATS killed and Postgres stopped: the outage a process started
/// now meets. Postgres is handed back, to be restarted.
async fn crew_in_an_outage(extra: &str) -> anyhow::Result<(pitcrew_testkit::pg::PrivatePostgres, Crew)> {
    let mut pg = pitcrew_testkit::pg::PrivatePostgres::start()?;
    let env = TestEnv::start_on(&pg.admin_url()).await?;
    let svc = common::marker_service(&env, "svc");
    let mut crew = Crew::start_in(env, &format!("{svc}{extra}"), &[]).await?;
    crew.env.nats.kill();
    pg.stop();
    Ok((pg, crew))
}

/// A worker started while NATS and Postgres are both down (started after it, or in an outage)
/// waits for them, saying so, instead of exiting; once they are up it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_started_before_nats_and_postgres_waits_for_them() -> anyhow::Result<()> {
    let (mut pg, mut crew) = crew_in_an_outage("").await?;
    let mut w0 = crew.spawn_worker("w0", &all_stages(), &[])?;
    logged(&mut w0, "waiting for NATS and Postgres error=cannot reach NATS").await?;
    crew.env.nats.restart()?;
    // Its next try gets past NATS.
    logged(&mut w0, "waiting for NATS and Postgres error=cannot reach Postgres").await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    anyhow::ensure!(w0.child.try_wait()?.is_none(), "the worker exited: {}", std::fs::read_to_string(&w0.log)?);
    pg.restart()?;
    // The test's own client reconnects to the restarted server on its own.
    let started = Instant::now();
    let run = loop {
        match crew.open("svc", "GET /health: connection refused").await {
            Ok(run) => break run,
            Err(e) if started.elapsed() < Duration::from_secs(30) => {
                eprintln!("cannot open the incident yet: {e:#}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e),
        }
    };
    let took = resolved(&crew.db().await?, run).await?;
    eprintln!("the worker that waited resolved a run {:.1} s after it was opened", took.as_secs_f64());
    Ok(())
}

/// The gateway, the monitor and a chat bridge started while NATS and Postgres are down wait for
/// them as the crew does (they exited at once before), say what they wait for, and serve once
/// both are back (the monitor, which needs only NATS, once NATS is); a SIGTERM while one waits
/// stops it cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_the_monitor_and_a_bridge_wait_for_nats_and_postgres_too() -> anyhow::Result<()> {
    let free = pitcrew_runtime::natsd::free_port;
    let (gateway_at, spare_at, bridge_port) =
        (format!("127.0.0.1:{}", free()?), format!("127.0.0.1:{}", free()?), free()?);
    let slack = format!(
        "[bridge.slack]\napi_url = \"http://127.0.0.1:9\"\nchannel = \"C1\"\nlisten = \"127.0.0.1:{bridge_port}\"\n"
    );
    let (mut pg, mut crew) = crew_in_an_outage(&slack).await?;
    let mut gateway = crew.spawn_process("gateway", &["gateway"], &[("PITCREW_GATEWAY__LISTEN", &gateway_at)], "")?;
    let mut spare = crew.spawn_process("spare", &["gateway"], &[("PITCREW_GATEWAY__LISTEN", &spare_at)], "")?;
    let mut monitor = crew.spawn_process("monitor", &["monitor"], &[], "")?;
    let secrets = [("SLACK_BOT_TOKEN", "xoxb-test"), ("SLACK_SIGNING_SECRET", "signing-secret")];
    let mut bridge = crew.spawn_process("bridge", &["bridge", "slack"], &secrets, "")?;
    for p in [&mut gateway, &mut spare, &mut bridge] {
        logged(p, "waiting for NATS and Postgres error=cannot reach NATS").await?;
    }
    logged(&mut monitor, "waiting for NATS error=cannot reach NATS").await?;
    sigterm(&mut spare, Duration::from_secs(10)).await?;
    crew.env.nats.restart()?;
    logged(&mut monitor, "monitor running").await?;
    for p in [&mut gateway, &mut bridge] {
        logged(p, "waiting for NATS and Postgres error=cannot reach Postgres").await?;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    for p in [&mut gateway, &mut bridge] {
        anyhow::ensure!(p.child.try_wait()?.is_none(), "it exited: {}", std::fs::read_to_string(&p.log)?);
    }
    pg.restart()?;
    logged(&mut gateway, "gateway serving").await?;
    logged(&mut bridge, "slack bridge running").await?;
    let ready = reqwest::get(format!("http://{gateway_at}/readyz")).await?;
    assert_eq!(ready.status(), 200, "{}", ready.text().await?);
    for p in [&mut gateway, &mut monitor, &mut bridge] {
        sigterm(p, Duration::from_secs(20)).await?;
    }
    Ok(())
}

/// A worker that cannot make one of its consumers (here report's: another consumer already
/// reads its subject, which a work-queue stream allows only once) stops, saying which,
/// before any of its stages has read a message: the incident waiting for intake is neither
/// taken nor opened, and stays for the next worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_make_a_consumer_stops_before_any_stage_reads() -> anyhow::Result<()> {
    use async_nats::jetstream::consumer::pull;
    let env = TestEnv::start().await?;
    let svc = common::marker_service(&env, "svc");
    let crew = Crew::start_in(env, &svc, &[]).await?;
    let stages = crew.bus.js.get_stream(crew.bus.subjects.stages_stream()).await?;
    stages
        .create_consumer(pull::Config {
            durable_name: Some("reporter-of-old".into()),
            filter_subject: crew.bus.subjects.stage(Stage::Report),
            ..Default::default()
        })
        .await?;
    let run = crew.open("svc", "GET /health: connection refused").await?;
    let mut w0 = crew.spawn_worker("w0", &all_stages(), &[])?;
    let status = exited(&mut w0, Duration::from_secs(30), "though a consumer cannot be made").await?;
    let log = std::fs::read_to_string(&w0.log)?;
    assert!(!status.success(), "{status}: {log}");
    assert!(log.contains("consumer report"), "{log}");
    let mut intake = crew
        .bus
        .js
        .get_consumer_from_stream::<pull::Config, _, _>("intake", crew.bus.subjects.incidents_stream())
        .await?;
    let info = intake.info().await?;
    assert_eq!((info.num_pending, info.num_ack_pending, info.delivered.consumer_sequence), (1, 0, 0), "{info:?}");
    let opened = common::count(&crew.db().await?, "SELECT count(*) FROM runs WHERE id = $1", run).await;
    assert_eq!(opened, 0);
    Ok(())
}

/// Every process of a stage shares its consumer, and the last to start sets its ack wait and
/// pending limit for all: a process configured apart says so when it changes them (a step
/// still running in another process would be handed on past the shorter wait), and one
/// configured alike says nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_changes_its_stages_shared_consumer_settings_says_so() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let svc = common::marker_service(&env, "svc");
    let crew = Crew::start_in(env, &svc, &[]).await?;
    let stages = crew.bus.js.get_stream(crew.bus.subjects.stages_stream()).await?;
    let said = "changes the settings of a consumer every process of its stage shares";
    let mut first = crew.spawn_worker("first", &["verify"], &[])?;
    logged(&mut first, "crew running").await?;
    let mut alike = crew.spawn_worker("alike", &["verify"], &[])?;
    logged(&mut alike, "crew running").await?;
    let mut apart = crew.spawn_worker_with("apart", &["verify"], &[], "[stage.verify]\nack_wait_secs = 9\n")?;
    let line = logged(&mut apart, said).await?;
    assert!(line.contains("was_ack_wait_secs=30") && line.contains(" ack_wait_secs=9"), "{line}");
    let info = stages.consumer_info("verify").await?;
    assert_eq!(info.config.ack_wait, Duration::from_secs(9), "the last to start set it");
    for w in [&mut first, &mut alike, &mut apart] {
        common::stop(w)?;
    }
    let alike_log = std::fs::read_to_string(&alike.log)?;
    assert!(alike_log.contains("verify") && !alike_log.contains(said), "{alike_log}");
    Ok(())
}

/// The monitor while NATS is down: a service that goes down then is reported every round
/// until a publish gets its ack, and every try is one incident (one id), so the copies the
/// client held and sent once NATS was back are one message on the bus, not a run and its
/// duplicates (each try had an id of its own); and a SIGTERM mid-round, its request to the bus
/// unanswerable, stops it at once (it waited for the round's end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_monitor_reports_an_outage_seen_while_nats_is_down_once_and_stops_at_once() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let svc = common::marker_service(&env, "svc");
    let healthy = env.path("svc-healthy");
    std::fs::write(&healthy, "")?;
    let mut crew = Crew::start_in(env, &svc, &[]).await?;
    let incidents = || async {
        let mut stream = crew.bus.js.get_stream(crew.bus.subjects.incidents_stream()).await?;
        anyhow::Ok(stream.info().await?.state.last_sequence)
    };
    let mut monitor = crew.spawn_process("monitor", &["monitor"], &[("PITCREW_MONITOR__INTERVAL_MS", "200")], "")?;
    logged(&mut monitor, "monitor running").await?;
    crew.env.nats.kill();
    std::fs::remove_file(&healthy)?;
    // Two tries at least, each failing for want of an ack.
    let started = Instant::now();
    while std::fs::read_to_string(&monitor.log)?.matches("monitor publish failed").count() < 2 {
        anyhow::ensure!(started.elapsed() < Duration::from_secs(60), "{}", std::fs::read_to_string(&monitor.log)?);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    crew.env.nats.restart()?;
    logged(&mut monitor, "service down: incident opened").await?;
    // Whatever the client held is out by now (it reconnected before the last try's ack).
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(incidents().await?, 1, "one incident on the bus: {}", std::fs::read_to_string(&monitor.log)?);
    // Reported: each round now asks the bus whether its run resolved, and with NATS down that
    // question goes unanswered (up to its 10 s limit).
    crew.env.nats.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let took = sigterm(&mut monitor, Duration::from_secs(30)).await?;
    assert!(took < Duration::from_secs(5), "the monitor took {took:?} to stop");
    Ok(())
}

/// ... but a login Postgres refuses stops it at once, saying what to check: waiting would not
/// mend it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_postgres_login_is_refused_stops_at_once() -> anyhow::Result<()> {
    let crew = Crew::start_in(TestEnv::start().await?, "", &[]).await?;
    // The test database's URL with its user (and password, if any) replaced.
    let url = &crew.cfg.database.url;
    let (scheme, rest) = url.split_once("://").ok_or_else(|| anyhow::anyhow!("bad URL {url}"))?;
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let url = format!("{scheme}://pitcrew-no-such-role@{host}");
    let mut w0 = crew.spawn_worker("w0", &all_stages(), &[("PITCREW_DATABASE__URL", &url)])?;
    let status = exited(&mut w0, Duration::from_secs(30), "of its start: it is still waiting").await?;
    let log = std::fs::read_to_string(&w0.log)?;
    assert!(!status.success(), "{status}: {log}");
    assert!(log.contains("refused the connection") && log.contains("check the user"), "{log}");
    assert!(!log.contains("waiting for NATS and Postgres"), "{log}");
    Ok(())
}
