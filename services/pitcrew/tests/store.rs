//! Group commit of run transitions against a real Postgres: transitions written at the same
//! moment share statements, yet each caller gets its own run's answer, the seq guard and
//! closed runs hold per run, one transition Postgres refuses fails no other, and the rows a
//! step writes with its transition (evaluations, episodes) land only if the run takes it.

use chrono::Utc;
use pitcrew_model::{Evaluation, EvaluationCheck, EventKind, Incident, RunEvent, RunState, Stage, Verdict};
use pitcrew_runtime::config::DatabaseConfig;
use pitcrew_runtime::store::{Episode, OpenRun, Record, RunStatus};
use pitcrew_runtime::Store;
use pitcrew_testkit::TestDb;
use uuid::Uuid;

fn secs(n: u64) -> std::time::Duration {
    std::time::Duration::from_secs(n)
}

async fn store(db: &TestDb) -> anyhow::Result<Store> {
    store_with_pool(db, 4).await
}

async fn store_with_pool(db: &TestDb, pool_size: usize) -> anyhow::Result<Store> {
    let store = Store::connect(&DatabaseConfig {
        url: db.url.clone(),
        pool_size,
        migrate_on_start: false,
        statement_timeout_secs: 30,
    })
    .await?;
    store.migrate().await?;
    Ok(store)
}

/// `n` runs, opened at intake.
async fn open_runs(store: &Store, n: usize) -> anyhow::Result<Vec<RunState>> {
    let mut runs = Vec::with_capacity(n);
    for i in 0..n {
        let mut incident = Incident::new(format!("svc-{i}"), "down");
        incident.fingerprint = Some(format!("group-{i}"));
        let state = RunState::new(Uuid::now_v7(), incident);
        assert_eq!(store.open_run(&state).await?, OpenRun::Created);
        runs.push(state);
    }
    Ok(runs)
}

/// A fresh database, a store on it, one run opened at intake, and a client on the database.
async fn one_run() -> anyhow::Result<(TestDb, Store, RunState, tokio_postgres::Client)> {
    let db = TestDb::create().await?;
    let store = store(&db).await?;
    let run = open_runs(&store, 1).await?.remove(0);
    let pg = db.client().await?;
    Ok((db, store, run, pg))
}

/// Where a transition commit leaves a run: its stage and status, and its attempt if given.
async fn move_run(
    pg: &tokio_postgres::Client,
    run: Uuid,
    stage: &str,
    status: &str,
    attempt: Option<i32>,
) -> Result<u64, tokio_postgres::Error> {
    pg.execute(
        "UPDATE runs SET stage = $2, status = $3, attempt = coalesce($4, attempt), updated_at = now() WHERE id = $1",
        &[&run, &stage, &status, &attempt],
    )
    .await
}

fn event(state: &RunState, index: u32, message: &str) -> RunEvent {
    RunEvent {
        run_id: state.run_id,
        seq: state.seq,
        index,
        stage: state.step,
        kind: EventKind::Status,
        message: message.into(),
        data: serde_json::json!({ "index": index }),
        worker: "test".into(),
        at: Utc::now(),
    }
}

/// The state moved on to `next`, with the two events the step emitted.
fn step(state: &RunState, next: Stage, note: &str) -> (RunState, Vec<RunEvent>) {
    let events = vec![event(state, 0, note), event(state, 1, note)];
    let mut moved = state.clone();
    moved.advance(next);
    (moved, events)
}

/// A fresh database with `n` open runs, a client on it, and this test's turn at the counter.
async fn setup(
    n: usize,
) -> anyhow::Result<(tokio::sync::MutexGuard<'static, ()>, TestDb, Store, Vec<RunState>, tokio_postgres::Client)> {
    let turn = COUNTER.lock().await;
    let db = TestDb::create().await?;
    let store = store(&db).await?;
    let runs = open_runs(&store, n).await?;
    let pg = db.client().await?;
    Ok((turn, db, store, runs, pg))
}

/// The group counter is the process's: tests that read it take turns.
static COUNTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How many transitions this process wrote sharing a statement so far.
fn grouped_so_far() -> f64 {
    pitcrew_runtime::metrics::render()
        .lines()
        .find_map(|l| l.strip_prefix("pitcrew_db_transitions_total{how=\"grouped\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn transitions_written_together_each_get_their_own_runs_answer() -> anyhow::Result<()> {
    let (_turn, _db, store, runs, pg) = setup(200).await?;

    // 200 transitions at once: they share statements, and every run takes its own.
    let before = grouped_so_far();
    let steps: Vec<_> = runs.iter().map(|s| step(s, Stage::Plan, &format!("diagnosed {}", s.run_id))).collect();
    let answers = futures::future::join_all(
        steps.iter().map(|(state, events)| store.commit_transition(state, RunStatus::Open, events)),
    )
    .await;
    for a in &answers {
        assert!(matches!(a, Ok(true)), "every run takes its transition: {a:?}");
    }
    assert!(grouped_so_far() - before >= 100.0, "200 transitions at once were written in groups");
    for (state, _) in &steps {
        let row = pg.query_one("SELECT seq, stage, state->>'step' FROM runs WHERE id = $1", &[&state.run_id]).await?;
        assert_eq!(row.get::<_, i32>(0), 1);
        assert_eq!(row.get::<_, String>(1), "plan");
        assert_eq!(row.get::<_, String>(2), "plan", "each run holds its own state");
        // Its own two events, and no other run's.
        let msgs: Vec<String> = pg
            .query("SELECT message FROM run_events WHERE run_id = $1 ORDER BY idx", &[&state.run_id])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(msgs, vec![format!("diagnosed {}", state.run_id); 2]);
    }

    // Each run's next transition and, beside it, a late redelivery of its first step (seq
    // 0 -> 1 again): whichever is written first, the newer transition holds, the late one
    // never undoes it, and the step's events stay the ones first written.
    let next: Vec<_> = steps.iter().map(|(s, _)| step(s, Stage::Evaluate, "planned")).collect();
    let late: Vec<_> = runs.iter().map(|s| step(s, Stage::Plan, "late redelivery")).collect();
    let (fresh, stale) = futures::future::join(
        futures::future::join_all(next.iter().map(|(s, e)| store.commit_transition(s, RunStatus::Open, e))),
        futures::future::join_all(late.iter().map(|(s, e)| store.commit_transition(s, RunStatus::Open, e))),
    )
    .await;
    for a in &fresh {
        assert!(matches!(a, Ok(true)), "a newer transition is always taken: {a:?}");
    }
    for a in &stale {
        assert!(a.is_ok(), "a late transition is answered, not failed: {a:?}");
    }
    let behind: i64 =
        pg.query_one("SELECT count(*) FROM runs WHERE seq <> 2 OR stage <> 'evaluate'", &[]).await?.get(0);
    assert_eq!(behind, 0, "no late transition moved a run back");
    let late_events: i64 =
        pg.query_one("SELECT count(*) FROM run_events WHERE message = 'late redelivery'", &[]).await?.get(0);
    assert_eq!(late_events, 0, "a redelivered step's events are the ones first written");

    // Closed runs stay closed: the first 50 end; transitions after that are refused and
    // change nothing, while the other runs' transitions written with them go through.
    let done: Vec<_> = next.iter().take(50).map(|(s, _)| step(s, Stage::Report, "resolved")).collect();
    for a in
        futures::future::join_all(done.iter().map(|(s, e)| store.commit_transition(s, RunStatus::Resolved, e))).await
    {
        assert!(matches!(a, Ok(true)), "{a:?}");
    }
    let after: Vec<_> = done
        .iter()
        .map(|(s, _)| s)
        .chain(next.iter().skip(50).map(|(s, _)| s))
        .map(|s| step(s, Stage::Approval, "after"))
        .collect();
    let answers =
        futures::future::join_all(after.iter().map(|(s, e)| store.commit_transition(s, RunStatus::Open, e))).await;
    for (i, a) in answers.iter().enumerate() {
        let want = i >= 50;
        assert!(matches!(a, Ok(took) if *took == want), "run {i}: closed runs refuse, open runs take: {a:?}");
    }
    let reopened: i64 =
        pg.query_one("SELECT count(*) FROM runs WHERE status <> 'resolved' AND stage = 'report'", &[]).await?.get(0);
    assert_eq!(reopened, 0);
    let resolved: i64 = pg
        .query_one("SELECT count(*) FROM runs WHERE status = 'resolved' AND finished_at IS NOT NULL", &[])
        .await?
        .get(0);
    assert_eq!(resolved, 50, "the closed runs kept their end");
    Ok(())
}

#[tokio::test]
async fn one_transition_postgres_refuses_fails_no_other_written_with_it() -> anyhow::Result<()> {
    let (_turn, _db, store, runs, pg) = setup(60).await?;

    // Postgres cannot store U+0000 in jsonb: the transition of run 30 is refused.
    let before = grouped_so_far();
    let steps: Vec<_> = runs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let (mut moved, events) = step(s, Stage::Plan, "diagnosed");
            if i == 30 {
                moved.incident.error = "down\u{0}".into();
            }
            (moved, events)
        })
        .collect();
    let answers = futures::future::join_all(
        steps.iter().map(|(state, events)| store.commit_transition(state, RunStatus::Open, events)),
    )
    .await;
    assert!(grouped_so_far() - before >= 2.0, "the transitions were queued together");
    for (i, a) in answers.iter().enumerate() {
        if i == 30 {
            let e = a.as_ref().expect_err("the refused transition fails");
            assert!(!e.is_transient(), "a value Postgres cannot store is not worth a retry: {e}");
        } else {
            assert!(matches!(a, Ok(true)), "run {i} took its transition: {a:?}");
        }
    }
    let moved: i64 = pg.query_one("SELECT count(*) FROM runs WHERE seq = 1", &[]).await?.get(0);
    assert_eq!(moved, 59);
    let refused = &steps[30].0;
    let row = pg.query_one("SELECT seq FROM runs WHERE id = $1", &[&refused.run_id]).await?;
    assert_eq!(row.get::<_, i32>(0), 0, "the refused run did not move");
    assert_eq!(
        pg.query_one("SELECT count(*) FROM run_events WHERE run_id = $1", &[&refused.run_id]).await?.get::<_, i64>(0),
        0,
        "nor did its events land"
    );
    Ok(())
}

#[tokio::test]
async fn records_are_written_with_their_transition_and_only_if_the_run_takes_it() -> anyhow::Result<()> {
    let (_turn, _db, store, runs, pg) = setup(40).await?;

    // Every run one step on; the even ones also move on beside it from another worker first,
    // so the records of their (now stale) step must not land.
    let ahead: Vec<_> =
        runs.iter().step_by(2).map(|s| step(&step(s, Stage::Plan, "x").0, Stage::Evaluate, "ahead")).collect();
    for (s, e) in &ahead {
        // seq 2 straight away: the stale step below is seq 1.
        assert!(store.commit_transition(s, RunStatus::Open, e).await?);
    }
    let records = |s: &RunState, i: usize| {
        let ev = Evaluation {
            attempt: 1,
            regeneration: i as u32 % 3,
            score: 0.5 + i as f64 / 100.0,
            verdict: Verdict::Pass,
            checks: vec![EvaluationCheck {
                name: "grounded".into(),
                passed: true,
                weight: 1.0,
                detail: format!("d{i}"),
            }],
            feedback: (i % 2 == 1).then(|| format!("feedback {i}")),
        };
        let ep = Episode::of(
            s,
            &[format!("touch /tmp/fix-{i}"), "systemctl restart web".into()],
            i.is_multiple_of(3),
            &format!("result {i}"),
        );
        let usage = pitcrew_llm::Usage {
            model: format!("model-{i}"),
            calls: 2,
            prompt_tokens: 100 + i as u64,
            completion_tokens: 10,
        };
        vec![
            Record::Evaluation(s.run_id, ev),
            Record::Episode(ep),
            Record::LlmUsage { run: s.run_id, seq: s.seq, stage: "plan", attempt: 1, usage },
        ]
    };
    let steps: Vec<_> =
        runs.iter().enumerate().map(|(i, s)| (step(s, Stage::Plan, "with records"), records(s, i))).collect();
    let answers = futures::future::join_all(
        steps.iter().map(|((s, e), r)| store.commit_transition_with(s, RunStatus::Open, e, r.clone())),
    )
    .await;
    for (i, a) in answers.iter().enumerate() {
        let took = i % 2 == 1;
        assert!(matches!(a, Ok(t) if *t == took), "run {i}: {a:?}");
    }
    for (i, ((s, _), _)) in steps.iter().enumerate() {
        let evals = pg
            .query("SELECT regeneration, score, verdict, checks->0->>'detail', feedback FROM evaluations WHERE run_id = $1", &[&s.run_id])
            .await?;
        let eps = pg
            .query(
                "SELECT attempt, commands, success, result, service, error FROM episodes WHERE run_id = $1",
                &[&s.run_id],
            )
            .await?;
        let usage = pg
            .query(
                "SELECT model, calls, prompt_tokens FROM llm_usage WHERE run_id = $1 AND stage = 'plan'",
                &[&s.run_id],
            )
            .await?;
        if i.is_multiple_of(2) {
            assert!(
                evals.is_empty() && eps.is_empty() && usage.is_empty(),
                "run {i}: a stale step's records never land"
            );
            continue;
        }
        assert_eq!(evals.len(), 1, "run {i}");
        let e = &evals[0];
        assert_eq!(e.get::<_, i32>(0), (i % 3) as i32);
        assert!((e.get::<_, f64>(1) - (0.5 + i as f64 / 100.0)).abs() < 1e-9);
        assert_eq!(e.get::<_, String>(2), "pass");
        assert_eq!(e.get::<_, String>(3), format!("d{i}"));
        assert_eq!(e.get::<_, Option<String>>(4), Some(format!("feedback {i}")));
        assert_eq!(eps.len(), 1, "run {i}");
        let p = &eps[0];
        assert_eq!(p.get::<_, i32>(0), 1);
        assert_eq!(
            p.get::<_, Vec<String>>(1),
            vec![format!("touch /tmp/fix-{i}"), "systemctl restart web".to_string()]
        );
        assert_eq!(p.get::<_, bool>(2), i.is_multiple_of(3));
        assert_eq!(p.get::<_, String>(3), format!("result {i}"));
        assert_eq!(p.get::<_, String>(4), format!("svc-{i}"));
        assert_eq!(p.get::<_, String>(5), "down");
        assert_eq!(usage.len(), 1, "run {i}");
        assert_eq!(usage[0].get::<_, String>(0), format!("model-{i}"));
        assert_eq!(usage[0].get::<_, i32>(1), 2);
        assert_eq!(usage[0].get::<_, i64>(2), 100 + i as i64);
    }
    // Memory reads what the transitions wrote.
    let mem = store.memory("svc-3", &runs[3].incident.signature(), std::time::Duration::from_secs(3600)).await?;
    assert_eq!(mem.fixes, vec![vec!["touch /tmp/fix-3".to_string(), "systemctl restart web".to_string()]]);
    Ok(())
}

#[tokio::test]
async fn memory_reads_failures_from_the_failures_alone_however_many_successes() -> anyhow::Result<()> {
    let (_db, store, run, pg) = one_run().await?;
    // A popular signature: 2,000 successes within the window, one failure still unanswered,
    // and one a later success answered.
    pg.execute(
        "INSERT INTO episodes (run_id, attempt, service, signature, error, diagnosis, commands, result, success, created_at)
         SELECT $1, g, 'web', 'sig', 'down', 'd', ARRAY['systemctl restart web'], 'ok', true, now() - g * interval '1 s'
         FROM generate_series(1, 2000) g",
        &[&run.run_id],
    )
    .await?;
    pg.execute(
        "INSERT INTO episodes (run_id, attempt, service, signature, error, diagnosis, commands, result, success, created_at)
         VALUES ($1, 3001, 'web', 'sig', 'down', 'd', ARRAY['rm -f /tmp/web.lock'], 'exit 1', false, now() - interval '10 s'),
                ($1, 3002, 'web', 'sig', 'down', 'd', ARRAY['systemctl restart web'], 'exit 1', false, now() - interval '1500 s')",
        &[&run.run_id],
    )
    .await?;
    pg.batch_execute("ANALYZE episodes").await?;

    let mem = store.memory("web", "sig", std::time::Duration::from_secs(86_400)).await?;
    assert_eq!(mem.failed, vec!["rm -f /tmp/web.lock".to_string()], "the restart worked since it failed");
    assert_eq!(mem.fixes.len(), 3);

    // A storm of distinct failed commands (a new pid in each) over the last hour, then a
    // restart failing a minute ago: what failed last is remembered, however it sorts.
    pg.execute(
        "INSERT INTO episodes (run_id, attempt, service, signature, error, diagnosis, commands, result, success, created_at)
         SELECT $1, 4000 + g, 'web', 'sig', 'down', 'd', ARRAY['kill -9 ' || (1000 + g)], 'exit 1', false,
                now() - interval '1 h' + g * interval '1 s'
         FROM generate_series(1, 150) g",
        &[&run.run_id],
    )
    .await?;
    pg.execute(
        "INSERT INTO episodes (run_id, attempt, service, signature, error, diagnosis, commands, result, success, created_at)
         VALUES ($1, 5000, 'web', 'sig', 'down', 'd', ARRAY['svcadm restart web'], 'exit 1', false, now() - interval '1 min')",
        &[&run.run_id],
    )
    .await?;
    let mem = store.memory("web", "sig", std::time::Duration::from_secs(86_400)).await?;
    assert_eq!(mem.failed.len(), 100, "bounded");
    assert_eq!(
        mem.failed[..3],
        ["rm -f /tmp/web.lock", "svcadm restart web", "kill -9 1150"],
        "the latest failures first (10 s, 1 min ago), then the storm's newest"
    );

    // The plan reads the failures' own index, not every episode of the signature.
    let prepare = format!("PREPARE failed(text, text, float8) AS {}", pitcrew_runtime::store::FAILED_COMMANDS);
    pg.batch_execute(&prepare).await?;
    let plan: Vec<String> =
        pg.query("EXPLAIN EXECUTE failed('web', 'sig', 86400)", &[]).await?.iter().map(|r| r.get(0)).collect();
    let plan = plan.join("\n");
    assert!(plan.contains("episodes_failed on episodes e"), "{plan}");
    assert!(!plan.contains("Seq Scan on episodes e"), "{plan}");
    Ok(())
}

#[tokio::test]
async fn run_states_are_compressed_with_lz4_where_postgres_has_it() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    let _store = store(&db).await?;
    let pg = db.client().await?;
    // lz4 where this Postgres was built with it (Debian's is); elsewhere the default stays.
    let has_lz4 = pg.batch_execute("SET default_toast_compression = 'lz4'").await.is_ok();
    let method: String = pg
        .query_one(
            "SELECT attcompression::text FROM pg_attribute WHERE attrelid = 'runs'::regclass AND attname = 'state'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(method, if has_lz4 { "l" } else { "" }, "runs.state compression");
    Ok(())
}

/// A state like one with the default evidence commands' output (`ss -ltn`, `df -h`, `free -m`):
/// about 4 KB of JSON that lz4 brings to about 2.3 KB, over the ~2 KB past which Postgres moves
/// a value of default storage out of the row.
fn state_with_evidence(state: &RunState) -> RunState {
    let mut s = state.clone();
    // Varied enough that compression leaves about what the real outputs leave.
    let mut x: u64 = 0x9e37_79b9;
    let mut next = move || {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (x >> 33) as u32
    };
    let listening: String = (0..50)
        .map(|_| {
            let (a, b, port, q) = (next() % 256, next() % 256, next() % 65536, next() % 4097);
            format!("LISTEN 0      {q:<5}      10.{a}.{b}.7:{port:<6}      0.0.0.0:*\n")
        })
        .collect();
    let disks: String = (0..8)
        .map(|i| {
            format!(
                "/dev/vd{i}       {}G  {}G  {}G  {}% /srv/{}\n",
                next() % 900,
                next() % 500,
                next() % 400,
                next() % 100,
                next()
            )
        })
        .collect();
    for (detail, output) in
        [("ss -ltn", listening), ("df -h", disks), ("free -m", "Mem: 24000 1200 22000 1 800 22500\n".into())]
    {
        s.push_evidence(pitcrew_model::Evidence {
            attempt: 1,
            source: "command".into(),
            detail: detail.into(),
            output,
            ok: true,
        });
    }
    s.advance(Stage::Plan);
    s
}

#[tokio::test]
async fn a_state_with_evidence_stays_in_its_row_not_in_the_toast_table() -> anyhow::Result<()> {
    let (_turn, _db, store, runs, pg) = setup(1).await?;
    let state = state_with_evidence(&runs[0]);
    let json = serde_json::to_string(&state)?;
    assert!((3500..8000).contains(&json.len()), "a state the size evidence makes: {} bytes", json.len());
    assert!(store.commit_transition(&state, RunStatus::Open, &[]).await?);

    let toast = |table: &str| format!("SELECT reltoastrelid::regclass::text FROM pg_class WHERE relname = '{table}'");
    let runs_toast: String = pg.query_one(&toast("runs"), &[]).await?.get(0);
    let out_of_line: i64 = pg.query_one(&format!("SELECT count(*) FROM {runs_toast}"), &[]).await?.get(0);
    assert_eq!(out_of_line, 0, "the state is kept (compressed) in the run's row");
    let stored: String = pg.query_one("SELECT state::text FROM runs WHERE id = $1", &[&state.run_id]).await?.get(0);
    let back: RunState = serde_json::from_str(&stored)?;
    assert_eq!(back, state, "and reads back whole");

    // The same value under default storage goes out of line: the case this test is about.
    pg.batch_execute("CREATE TABLE default_storage (state jsonb)").await?;
    // As `runs` has it where this Postgres has lz4; pglz compresses it less, if anything.
    let _ = pg.batch_execute("ALTER TABLE default_storage ALTER COLUMN state SET COMPRESSION lz4").await;
    pg.execute("INSERT INTO default_storage SELECT state FROM runs WHERE id = $1", &[&state.run_id]).await?;
    let default_toast: String = pg.query_one(&toast("default_storage"), &[]).await?.get(0);
    let moved: i64 = pg.query_one(&format!("SELECT count(*) FROM {default_toast}"), &[]).await?.get(0);
    let size: i32 =
        pg.query_one("SELECT pg_column_size(state) FROM runs WHERE id = $1", &[&state.run_id]).await?.get(0);
    assert!(
        moved > 0,
        "under default storage this state ({} bytes, {size} stored) would be moved to the TOAST table",
        json.len()
    );
    Ok(())
}

#[tokio::test]
async fn concurrent_memory_reads_share_statements_but_never_answer_from_before_the_call() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    // One connection: reads queue for it, so concurrent reads of one key join each other.
    let store = store_with_pool(&db, 1).await?;
    let run = open_runs(&store, 1).await?.remove(0);
    let pg = db.client().await?;
    let window = std::time::Duration::from_secs(3600);
    // Readers of the same key keep reads in flight the whole time.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut readers = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let (store, stop) = (store.clone(), stop.clone());
        readers.spawn(async move {
            let mut reads = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                store.memory("web", "sig", window).await?;
                reads += 1;
            }
            anyhow::Ok(reads)
        });
    }
    for i in 0..30 {
        let command = format!("rm -f /tmp/lock-{i}");
        pg.execute(
            "INSERT INTO episodes (run_id, attempt, service, signature, error, diagnosis, commands, result, success)
             VALUES ($1, $2, 'web', 'sig', 'down', 'd', ARRAY[$3], 'exit 1', false)",
            &[&run.run_id, &(i + 1), &command],
        )
        .await?;
        // Committed before this call began: the answer must know it, whoever else is reading.
        let (a, b) = tokio::join!(store.memory("web", "sig", window), store.memory("web", "sig", window));
        for mem in [a?, b?] {
            assert!(mem.failed.contains(&command), "read {i} misses a failure committed before it: {mem:?}");
            assert_eq!(mem.failed.len(), i as usize + 1);
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    while let Some(done) = readers.join_next().await {
        assert!(done?? > 0, "every reader read");
    }
    Ok(())
}

/// A command another delivery took over while it ran (marked interrupted, the rest of the
/// plan skipped, the run moved on): its late finish does not turn it into a success that a
/// later delivery would run the next command after; it says so, and keeps the real outcome.
#[tokio::test]
async fn a_late_finish_of_a_command_taken_over_by_another_delivery_changes_no_decision() -> anyhow::Result<()> {
    use pitcrew_model::{ExecutionRecord, ExecutionStatus};
    use pitcrew_runtime::store::Claim;
    let db = TestDb::create().await?;
    let store = store(&db).await?;
    let run = open_runs(&store, 1).await?.remove(0).run_id;
    let [t0, t1, t3, t5, t6] = [(); 5].map(|_| Uuid::new_v4());
    // Nothing is claimed for a run that is not at execute in that attempt (a copy of the step
    // that loaded it before another copy moved it on).
    let pg = db.client().await?;
    let refused = store.claim_execution(run, 1, 0, "touch /tmp/x0", "local", "a", t0, false, secs(70)).await;
    assert!(matches!(&refused, Err(e) if e.is_transient() && e.to_string().contains("left execute")), "{refused:?}");
    move_run(&pg, run, "escalate", "open", None).await?;
    assert!(store.claim_execution(run, 1, 0, "touch /tmp/x0", "local", "a", t0, false, secs(70)).await.is_err());
    move_run(&pg, run, "execute", "open", Some(2)).await?;
    assert!(store.claim_execution(run, 1, 0, "touch /tmp/x0", "local", "a", t0, false, secs(70)).await.is_err());
    move_run(&pg, run, "execute", "open", Some(1)).await?;
    assert_eq!(store.execution_claim(run, 1, 0).await?, None, "nothing was claimed");
    let done = |index: u32| ExecutionRecord {
        attempt: 1,
        index,
        command: format!("touch /tmp/x{index}"),
        status: ExecutionStatus::Succeeded,
        exit_code: Some(0),
        output: "ok".into(),
        duration_ms: 5,
    };
    // Its own delivery finishes a command nobody else touched.
    assert_eq!(
        store.claim_execution(run, 1, 0, "touch /tmp/x0", "local", "a", t0, false, secs(70)).await?,
        Claim::Claimed
    );
    assert!(store.finish_execution(run, &done(0), t0).await?, "still ours");
    // Another delivery finds command 1 claimed and never finished: interrupted.
    assert_eq!(
        store.claim_execution(run, 1, 1, "touch /tmp/x1", "local", "a", t1, false, secs(70)).await?,
        Claim::Claimed
    );
    let unfinished = || store.claim_execution(run, 1, 1, "touch /tmp/x1", "local", "b", Uuid::new_v4(), false, secs(5));
    match unfinished().await? {
        // The claim's own time counts, not the later reader's.
        Claim::Unfinished { running_for, gone_in: Some(gone_in), unstarted } => {
            assert_eq!(unstarted, Some(t1), "known never started");
            assert!(running_for < secs(10), "{running_for:?}");
            assert!(gone_in > secs(60) && gone_in <= secs(70), "{gone_in:?}");
        }
        other => panic!("{other:?}"),
    }
    // Only its own delivery's token marks its start.
    assert!(!store.command_starts(run, 1, 1, Uuid::new_v4(), secs(100)).await?, "another token marked it");
    // Started long after its claim: gone that long after its start, and no longer known
    // never started.
    assert!(store.command_starts(run, 1, 1, t1, secs(100)).await?);
    match unfinished().await? {
        Claim::Unfinished { gone_in: Some(gone_in), unstarted, .. } => {
            assert!(gone_in > secs(90), "{gone_in:?}");
            assert_eq!(unstarted, None, "it may have started");
        }
        other => panic!("{other:?}"),
    }
    // Not recorded interrupted while it may still be running.
    assert!(!store.mark_interrupted(run, 1, 1).await?, "marked before its time");
    pg.execute("UPDATE executions SET gone_by = now() WHERE run_id = $1 AND idx = 1", &[&run]).await?;
    assert!(store.mark_interrupted(run, 1, 1).await?);
    // Past its time and taken over: a start that comes now is refused (it must not run).
    assert!(!store.command_starts(run, 1, 1, t1, secs(100)).await?, "a taken-over claim started");
    assert_eq!(
        store.claim_execution(run, 1, 3, "touch /tmp/x3", "local", "a", t3, false, secs(0)).await?,
        Claim::Claimed
    );
    // Past its time but not taken over: a late start moves it, and the mark then waits.
    assert!(store.command_starts(run, 1, 3, t3, secs(100)).await?);
    assert!(!store.mark_interrupted(run, 1, 3).await?, "marked a command that just started");
    assert_eq!(store.execution_claim(run, 1, 4).await?, None, "reading claims none");
    assert!(matches!(store.execution_claim(run, 1, 3).await?, Some(Claim::Unfinished { .. })));
    // A start racing a mark: the mark holds the row, the start waits for it, sees the claim
    // taken over and is refused.
    assert_eq!(
        store.claim_execution(run, 1, 5, "touch /tmp/x5", "local", "a", t5, false, secs(0)).await?,
        Claim::Claimed
    );
    let mut marker = db.client().await?;
    let tx = marker.transaction().await?;
    let marked = tx
        .execute(
            "UPDATE executions SET status = 'interrupted', finished_at = now()
             WHERE run_id = $1 AND idx = 5 AND status IS NULL AND gone_by <= now()",
            &[&run],
        )
        .await?;
    assert_eq!(marked, 1);
    let start = {
        let store = store.clone();
        tokio::spawn(async move { store.command_starts(run, 1, 5, t5, secs(100)).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!start.is_finished(), "the start did not wait for the mark's row lock");
    tx.commit().await?;
    assert!(!start.await??, "a start went ahead of a mark that committed first");
    // A claim never started is removed only past its time, only under its token, and only
    // while not started; its delivery's late start is then refused, and its release removes
    // nothing another delivery claimed since.
    assert_eq!(
        store.claim_execution(run, 1, 6, "touch /tmp/x6", "local", "a", t6, false, secs(70)).await?,
        Claim::Claimed
    );
    assert!(!store.drop_unstarted(run, 1, 6, t6).await?, "dropped before its time");
    pg.execute("UPDATE executions SET gone_by = now() WHERE run_id = $1 AND idx = 6", &[&run]).await?;
    assert!(!store.drop_unstarted(run, 1, 6, Uuid::new_v4()).await?, "dropped under another token");
    assert!(store.drop_unstarted(run, 1, 6, t6).await?);
    let t6b = Uuid::new_v4();
    assert_eq!(
        store.claim_execution(run, 1, 6, "touch /tmp/x6", "local", "b", t6b, false, secs(70)).await?,
        Claim::Claimed
    );
    assert!(!store.command_starts(run, 1, 6, t6, secs(100)).await?, "the first delivery's late start");
    assert!(!store.release_execution(run, 1, 6, t6, false).await?, "released the claim another made since");
    assert!(
        !store.finish_execution(run, &done(6), t6).await?,
        "the first delivery finished the claim another made since"
    );
    assert!(store.command_starts(run, 1, 6, t6b, secs(100)).await?, "the claim that stands starts");
    pg.execute("UPDATE executions SET gone_by = now() WHERE run_id = $1 AND idx = 6", &[&run]).await?;
    assert!(!store.drop_unstarted(run, 1, 6, t6b).await?, "a started claim is never dropped");
    // Nor released: an error after its start was marked does not prove nothing ran.
    assert!(!store.release_execution(run, 1, 6, t6b, false).await?);
    assert!(matches!(store.execution_claim(run, 1, 6).await?, Some(Claim::Unfinished { unstarted: None, .. })));
    // A claim that counts as its command's start (one that starts at once after it) may have
    // started from the first; only a caller that knows nothing ran releases it.
    let t7 = Uuid::new_v4();
    assert_eq!(
        store.claim_execution(run, 1, 7, "touch /tmp/x7", "local", "a", t7, true, secs(70)).await?,
        Claim::Claimed
    );
    assert!(matches!(store.execution_claim(run, 1, 7).await?, Some(Claim::Unfinished { unstarted: None, .. })));
    assert!(!store.release_execution(run, 1, 7, t7, false).await?);
    assert!(store.execution_claim(run, 1, 7).await?.is_some(), "released a claim that counts as started");
    assert!(store.release_execution(run, 1, 7, t7, true).await?);
    assert_eq!(store.execution_claim(run, 1, 7).await?, None);
    // Every claim removed so stays on record, with its delivery's token and why.
    let released = pg
        .query(
            "SELECT idx, claim, started, why FROM execution_releases WHERE run_id = $1 ORDER BY released_at",
            &[&run],
        )
        .await?;
    let released: Vec<(i32, Uuid, bool, String)> =
        released.iter().map(|r| (r.get(0), r.get(1), r.get(2), r.get(3))).collect();
    assert_eq!(released.len(), 2, "{released:?}");
    assert_eq!((released[0].0, released[0].1, released[0].2), (6, t6, false), "{released:?}");
    assert!(released[0].3.starts_with("never started"), "{released:?}");
    assert_eq!((released[1].0, released[1].1, released[1].2), (7, t7, true), "{released:?}");
    assert!(released[1].3.starts_with("released by its delivery"), "{released:?}");
    // The first delivery's command ends after all: not ours any more, nothing is overwritten.
    assert!(!store.finish_execution(run, &done(1), t1).await?, "taken over");
    match store.claim_execution(run, 1, 1, "touch /tmp/x1", "local", "c", Uuid::new_v4(), false, secs(70)).await? {
        Claim::Finished(rec) => {
            assert_eq!(rec.status, ExecutionStatus::Interrupted, "later deliveries decide as the one that took over");
            assert!(rec.output.contains("finished it later: succeeded (exit 0)"), "{}", rec.output);
        }
        other => panic!("{other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn a_statement_stuck_behind_a_lock_fails_at_the_timeout_and_its_retry_succeeds() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    let store = Store::connect(&DatabaseConfig {
        url: db.url.clone(),
        pool_size: 4,
        migrate_on_start: false,
        statement_timeout_secs: 1,
    })
    .await?;
    // Migrations are exempt from the timeout: they run under it here all the same.
    store.migrate().await?;
    let runs = open_runs(&store, 2).await?;

    // A transaction elsewhere (a stuck operator session, a half-dead worker) holds one run's row.
    let mut holder = db.client().await?;
    let tx = holder.transaction().await?;
    tx.execute("SELECT 1 FROM runs WHERE id = $1 FOR UPDATE", &[&runs[0].run_id]).await?;

    let (locked, locked_events) = step(&runs[0], Stage::Plan, "behind the lock");
    let (free, free_events) = step(&runs[1], Stage::Plan, "beside it");
    let started = std::time::Instant::now();
    let (stuck, beside) = tokio::time::timeout(std::time::Duration::from_secs(20), async {
        tokio::join!(
            store.commit_transition(&locked, RunStatus::Open, &locked_events),
            store.commit_transition(&free, RunStatus::Open, &free_events)
        )
    })
    .await
    .expect("a statement behind a lock returns at the statement timeout instead of waiting for the lock");
    let err = stuck.expect_err("the transition behind the lock fails");
    assert!(err.is_transient(), "a cancelled statement is worth a retry: {err}");
    assert!(err.to_string().contains("statement timeout"), "Postgres says why: {err}");
    assert!(started.elapsed() >= std::time::Duration::from_millis(900), "it waited for the timeout");
    assert!(matches!(beside, Ok(true)), "the run beside it, maybe in the same group, takes its transition: {beside:?}");

    // Once the lock is gone, the retry is taken.
    tx.rollback().await?;
    assert!(matches!(store.commit_transition(&locked, RunStatus::Open, &locked_events).await, Ok(true)));
    Ok(())
}

/// A request's deadline is kept by Postgres's clock, however wrong the clock of the worker
/// that made it: one an hour behind would have its requests expired at once.
#[tokio::test]
async fn an_approval_deadline_follows_the_database_clock() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    let store = store(&db).await?;
    let mut state = open_runs(&store, 1).await?.remove(0);
    let run = state.run_id;
    let behind = Utc::now() - chrono::Duration::hours(1);
    let req = pitcrew_model::ApprovalRequest {
        run_id: run,
        service: "svc-0".into(),
        host: None,
        error: "down".into(),
        attempt: 1,
        plan: vec!["systemctl restart svc-0".into()],
        plan_hash: "h1".into(),
        risk: "critical".into(),
        rule: "restart".into(),
        diagnosis: "down".into(),
        evidence: vec![],
        requested_at: behind,
        expires_at: behind + chrono::Duration::seconds(600),
        quorum: 1,
    };
    state.seq += 1;
    let records = vec![Record::Approval(Box::new(req))];
    assert!(store.commit_transition_with(&state, RunStatus::WaitingApproval, &[], records).await?, "parked");
    assert!(store.approval_expired(run, "h1", 3).await?.is_none(), "ten minutes from now, by Postgres");
    assert!(store.pending_approvals(true, 10).await?.is_empty(), "none expired");
    let pg = db.client().await?;
    let left: f64 = pg
        .query_one("SELECT extract(epoch FROM expires_at - now())::float8 FROM approvals WHERE run_id = $1", &[&run])
        .await?
        .get(0);
    assert!((590.0..=600.0).contains(&left), "{left}");
    // As the runner reads them back for the request it publishes.
    let (at, until) = store.approval_window(run, "h1").await?.expect("the request");
    assert!((Utc::now() - at).num_seconds().abs() < 60, "{at}");
    assert_eq!((until - at).num_seconds(), 600);
    Ok(())
}

#[tokio::test]
async fn an_expiry_written_for_a_late_approval_is_found_again_on_its_redelivery() -> anyhow::Result<()> {
    let (_db, store, run, pg) = one_run().await?;
    let run = run.run_id;
    pg.execute(
        "INSERT INTO approvals (run_id, plan_hash, attempt, commands, risk, rule, requested_at, expires_at, quorum)
         VALUES ($1, 'h1', 1, ARRAY['rm -f /tmp/x'], 'critical', 'rm', now() - interval '2 h', now() - interval '1 h', 1)",
        &[&run],
    )
    .await?;
    assert!(store.approval_expired(run, "h1", 7).await?.is_some(), "pending past its deadline");
    // Message 7, a late approval, is recorded as the expiry it became...
    let expire = pitcrew_model::ApprovalDecision {
        run_id: run,
        decision: pitcrew_model::Decision::Expire,
        by: "pitcrew".into(),
        plan_hash: Some("h1".into()),
        reason: None,
        channel: "timeout".into(),
        decided_at: Utc::now(),
    };
    assert_eq!(store.decide_approval("h1", &expire, 7, None).await?, pitcrew_runtime::store::DecideOutcome::Applied);
    // ...and its redelivery (the run's transition failed after that write) finds it expired
    // again, rather than going on as the approval it was.
    assert!(store.approval_expired(run, "h1", 7).await?.is_some(), "the same message: expired");
    assert!(store.approval_expired(run, "h1", 8).await?.is_none(), "another message: decided, not pending");
    Ok(())
}

/// The same plan asked for again by a later attempt (its commands all skipped the first time)
/// is a new request: the first attempt's approval does not settle it, neither as it stands nor
/// by a redelivery of the message that decided it, nor do its votes count; a new decision does.
#[tokio::test]
async fn the_same_plan_asked_for_again_by_a_later_attempt_waits_for_a_new_decision() -> anyhow::Result<()> {
    use pitcrew_runtime::store::DecideOutcome;
    let db = TestDb::create().await?;
    let store = store(&db).await?;
    let mut state = open_runs(&store, 1).await?.remove(0);
    let run = state.run_id;
    let names: Vec<String> = ["ann", "bob", "carol"].map(String::from).to_vec();
    let request = |attempt: u32, quorum: u32| pitcrew_model::ApprovalRequest {
        run_id: run,
        service: "svc-0".into(),
        host: None,
        error: "down".into(),
        attempt,
        plan: vec!["systemctl restart svc-0".into()],
        plan_hash: "h1".into(),
        risk: "critical".into(),
        rule: "restart".into(),
        diagnosis: "down".into(),
        evidence: vec![],
        requested_at: Utc::now(),
        expires_at: Utc::now() + chrono::Duration::hours(1),
        quorum,
    };
    let approve = |by: &str| pitcrew_model::ApprovalDecision {
        run_id: run,
        decision: pitcrew_model::Decision::Approve,
        by: by.into(),
        plan_hash: Some("h1".into()),
        reason: None,
        channel: "cli".into(),
        decided_at: Utc::now(),
    };
    // Each request is written with the park that waits for it.
    let park = |state: &RunState, req: pitcrew_model::ApprovalRequest| {
        let state = state.clone();
        let store = &store;
        async move {
            let records = vec![Record::Approval(Box::new(req))];
            store.commit_transition_with(&state, RunStatus::WaitingApproval, &[], records).await
        }
    };
    state.seq += 1;
    assert!(park(&state, request(1, 2)).await?, "parked");
    assert_eq!(store.vote(run, "h1", "ann", "cli", 4, None, &names).await?, Some((1, 2)));
    assert_eq!(store.vote(run, "h1", "bob", "cli", 5, None, &names).await?, Some((2, 2)));
    assert_eq!(store.decide_approval("h1", &approve("bob"), 5, None).await?, DecideOutcome::Applied);
    // Attempt 1's request again (a redelivery of its step, which parks again): still decided.
    assert!(park(&state, request(1, 2)).await?, "parked again");
    assert_eq!(store.decide_approval("h1", &approve("bob"), 5, None).await?, DecideOutcome::Repeated);

    // Attempt 2 plans the same commands: pending again, and what decided attempt 1 does not.
    state.attempt = 2;
    state.seq += 1;
    assert!(park(&state, request(2, 2)).await?, "parked in attempt 2");
    let pending = store.approval_decision(run, "h1").await?;
    assert!(pending.is_none(), "the request waits for a decision: {pending:?}");
    assert_eq!(
        store.vote(run, "h1", "ann", "cli", 4, None, &names).await?,
        None,
        "a vote from before counts for nothing"
    );
    // A decision for attempt 1's request held up until now (message 12, after the floor):
    // neither counted nor settling attempt 2's request, which would leave the run parked on
    // a request decided behind it.
    assert_eq!(store.vote(run, "h1", "carol", "cli", 12, Some(1), &names).await?, None, "another attempt's vote");
    assert_eq!(store.decide_approval("h1", &approve("carol"), 12, Some(1)).await?, DecideOutcome::Stale);
    assert!(store.approval_decision(run, "h1").await?.is_none(), "still pending");
    assert_eq!(store.decide_approval("h1", &approve("bob"), 5, None).await?, DecideOutcome::Stale);
    assert!(store.approval_decision(run, "h1").await?.is_none(), "still pending");
    // New votes, counted from none, and only while their approvers are configured ones.
    assert_eq!(store.vote(run, "h1", "ann", "cli", 9, None, &names).await?, Some((1, 2)));
    let without_ann: Vec<String> = ["bob", "carol"].map(String::from).to_vec();
    let counted = store.vote(run, "h1", "bob", "cli", 10, Some(2), &without_ann).await?;
    assert_eq!(counted, Some((1, 2)), "ann was removed from the approvers after she voted");
    assert_eq!(store.approval_voters(run, "h1", &without_ann).await?, ["bob"]);
    assert_eq!(store.voters_with(run, "h1", "carol", &without_ann).await?, ["bob", "carol"]);
    assert_eq!(store.vote(run, "h1", "bob", "cli", 10, Some(2), &names).await?, Some((2, 2)));
    assert_eq!(store.decide_approval("h1", &approve("bob"), 10, Some(2)).await?, DecideOutcome::Applied);
    let attempt: i32 =
        db.client().await?.query_one("SELECT attempt FROM approvals WHERE run_id = $1", &[&run]).await?.get(0);
    assert_eq!(attempt, 2);
    Ok(())
}

/// A run closed while a command of it may still be running (escalated as poison mid-command,
/// say) holds its target until that command has ended or its deadline has passed: no other
/// run remediates the service beside it.
#[tokio::test]
async fn a_closed_run_holds_its_target_while_a_command_of_it_may_still_run() -> anyhow::Result<()> {
    use pitcrew_runtime::store::TargetLock;
    let db = TestDb::create().await?;
    let store = store(&db).await?;
    let pg = db.client().await?;
    let runs: Vec<Uuid> = open_runs(&store, 2).await?.iter().map(|s| s.run_id).collect();
    let (a, b) = (runs[0], runs[1]);
    for run in [a, b] {
        move_run(&pg, run, "execute", "open", None).await?;
    }
    assert!(matches!(store.take_target("web", "web-1", a, 1).await?, TargetLock::Held { .. }));
    store.claim_execution(a, 1, 0, "systemctl restart web", "web-1", "w", Uuid::new_v4(), true, secs(70)).await?;
    move_run(&pg, a, "escalate", "escalated", None).await?;
    match store.take_target("web", "web-1", b, 1).await? {
        TargetLock::Busy { holder, .. } => assert_eq!(holder, Some(a), "its holder is named"),
        held => panic!("taken beside a command that may still run: {held:?}"),
    }
    pg.execute("UPDATE executions SET gone_by = now() - interval '1 second' WHERE run_id = $1", &[&a]).await?;
    assert_eq!(
        store.take_target("web", "web-1", b, 1).await?,
        TargetLock::Held { remediated_since: Some(a), started: false },
        "past its deadline the command is over"
    );
    Ok(())
}

/// One remediation at a time on a target: a run in execute or verify holds its service's host
/// against every other run until it is closed or has moved on, whatever process it was in (no
/// release step a killed worker could miss); taking it again is the same attempt's
/// redelivery; a run that takes it after another was at work there since it opened is told
/// which one; a waiting run learns how long it has waited since its first look (gaps when
/// nobody looked left out) and how many wait ahead of it.
#[tokio::test]
async fn a_target_is_held_by_one_run_while_it_executes_and_verifies() -> anyhow::Result<()> {
    use pitcrew_runtime::store::TargetLock;
    let db = TestDb::create().await?;
    let store = store(&db).await?;
    let pg = db.client().await?;
    let runs: Vec<Uuid> = open_runs(&store, 3).await?.iter().map(|s| s.run_id).collect();
    let (a, b, c) = (runs[0], runs[1], runs[2]);
    let at = |stage: &'static str, status: &'static str, run: Uuid| move_run(&pg, run, stage, status, None);
    let holder = |lock: TargetLock| match lock {
        TargetLock::Busy { holder, .. } => holder,
        held => panic!("not busy: {held:?}"),
    };
    for run in [a, b, c] {
        at("execute", "open", run).await?;
    }
    let fresh = TargetLock::Held { remediated_since: None, started: false };
    assert_eq!(store.take_target("web", "web-1", a, 1).await?, fresh);
    assert_eq!(holder(store.take_target("web", "web-1", b, 1).await?), Some(a));
    // Another host, or another service, is another target.
    assert_eq!(store.take_target("web", "web-2", b, 1).await?, fresh);
    assert_eq!(store.take_target("db", "web-1", c, 1).await?, fresh);
    // A's redelivery holds it still, and sees the command its first delivery claimed.
    store.claim_execution(a, 1, 0, "touch /tmp/x", "web-1", "w", Uuid::new_v4(), false, secs(70)).await?;
    assert_eq!(
        store.take_target("web", "web-1", a, 1).await?,
        TargetLock::Held { remediated_since: None, started: true }
    );
    pg.execute("UPDATE executions SET finished_at = now(), status = 'succeeded' WHERE run_id = $1", &[&a]).await?;
    // Verifying, A still holds it; once it reports, B takes it and learns A was there.
    at("verify", "open", a).await?;
    assert_eq!(holder(store.take_target("web", "web-1", b, 1).await?), Some(a));
    at("report", "open", a).await?;
    let after_a = TargetLock::Held { remediated_since: Some(a), started: false };
    assert_eq!(store.take_target("web", "web-1", b, 1).await?, after_a);
    assert_eq!(store.take_target("web", "web-1", b, 1).await?, after_a, "a redelivery is told the same");
    // B's next attempt starts afresh: nobody else was there since B's last.
    pg.execute("UPDATE runs SET attempt = 2 WHERE id = $1", &[&b]).await?;
    assert_eq!(store.take_target("web", "web-1", b, 2).await?, fresh);
    // C waits from its first look, across deliveries (not from its arrival at execute: a
    // backlog there is no wait), and a run that comes to wait after it has C ahead of it.
    pg.execute("UPDATE runs SET updated_at = now() - interval '1 hour' WHERE id = $1", &[&c]).await?;
    let waiting = |lock: TargetLock| match lock {
        TargetLock::Busy { holder, waiting, ahead, .. } => (holder, waiting, ahead),
        held => panic!("not busy: {held:?}"),
    };
    let (by, first, ahead) = waiting(store.take_target("web", "web-1", c, 1).await?);
    assert_eq!((by, ahead), (Some(b), 0));
    assert!(first < std::time::Duration::from_secs(60), "{first:?}");
    pg.execute("UPDATE target_waits SET since = now() - interval '10 minutes' WHERE run_id = $1", &[&c]).await?;
    let (_, waited, _) = waiting(store.take_target("web", "web-1", c, 1).await?);
    assert!(waited >= std::time::Duration::from_secs(599), "{waited:?}");
    // Twenty minutes when nobody looked (the crew was down) are not counted as waiting.
    pg.execute(
        "UPDATE target_waits SET since = now() - interval '21 minutes', looked = now() - interval '20 minutes' \
         WHERE run_id = $1",
        &[&c],
    )
    .await?;
    let (_, waited, _) = waiting(store.take_target("web", "web-1", c, 1).await?);
    let minute = std::time::Duration::from_secs(60);
    assert!(waited >= minute && waited < 2 * minute, "{waited:?}");
    let mut next = Incident::new("web", "down");
    next.fingerprint = Some("next".into());
    let d = RunState::new(Uuid::now_v7(), next);
    assert_eq!(store.open_run(&d).await?, OpenRun::Created);
    let d = d.run_id;
    at("execute", "open", d).await?;
    assert_eq!(waiting(store.take_target("web", "web-1", d, 1).await?).2, 1, "C waits ahead of D");
    // A closed run holds nothing, whatever stage it stopped at; C takes it and waits no more.
    at("execute", "escalated", b).await?;
    assert_eq!(
        store.take_target("web", "web-1", c, 1).await?,
        TargetLock::Held { remediated_since: Some(b), started: false }
    );
    let left: i64 = pg.query_one("SELECT count(*) FROM target_waits WHERE run_id = $1", &[&c]).await?.get(0);
    assert_eq!(left, 0);
    at("diagnose", "open", d).await?;
    // A run opened after the last one there stopped working is not told of it.
    at("diagnose", "open", c).await?;
    let mut late = Incident::new("web", "down");
    late.fingerprint = Some("late".into());
    let late = RunState::new(Uuid::now_v7(), late);
    assert_eq!(store.open_run(&late).await?, OpenRun::Created);
    assert_eq!(store.take_target("web", "web-1", late.run_id, 1).await?, fresh);
    Ok(())
}

/// Waiting runs take a target in the order they came to wait: once its holder lets go, a run
/// that comes later is told how many go first and waits, while the one that waited longest
/// takes it; the holder's own next attempt queues like any other; a waiter that stopped
/// looking for 15 s (its crew down, its message backing off) is neither waited for nor counted
/// ahead, and is back in line once it looks again.
#[tokio::test]
async fn waiting_runs_take_a_target_in_the_order_they_came() -> anyhow::Result<()> {
    use pitcrew_runtime::store::TargetLock;
    let db = TestDb::create().await?;
    let store = store(&db).await?;
    let pg = db.client().await?;
    let runs: Vec<Uuid> = open_runs(&store, 10).await?.iter().map(|s| s.run_id).collect();
    let at = |stage: &'static str, attempt: i32, run: Uuid| move_run(&pg, run, stage, "open", Some(attempt));
    for run in &runs {
        at("execute", 1, *run).await?;
    }
    let busy = |lock: TargetLock| match lock {
        TargetLock::Busy { holder, ahead, .. } => (holder, ahead),
        held => panic!("not busy: {held:?}"),
    };
    let lines = |lock: TargetLock| match lock {
        TargetLock::Busy { ahead, queue, first, .. } => (ahead, queue, first),
        held => panic!("not busy: {held:?}"),
    };
    let (holder, first, later) = (runs[0], runs[1], runs[2]);
    assert!(matches!(store.take_target("api", "api-1", holder, 1).await?, TargetLock::Held { .. }));
    // Who waits ahead: those still looking, and all of them (each is a pending message);
    // and whether it is the run's first look (the one that goes on its timeline).
    assert_eq!(lines(store.take_target("api", "api-1", first, 1).await?), (0, 0, true));
    assert_eq!(lines(store.take_target("api", "api-1", later, 1).await?), (1, 1, true));
    pg.execute("UPDATE target_waits SET looked = now() - interval '20 seconds' WHERE run_id = $1", &[&first]).await?;
    assert_eq!(lines(store.take_target("api", "api-1", later, 1).await?), (0, 1, false));
    pg.execute("DELETE FROM target_waits WHERE run_id = $1", &[&later]).await?;
    assert_eq!(busy(store.take_target("api", "api-1", first, 1).await?), (Some(holder), 0));
    at("report", 1, holder).await?;
    // Free, but not for a newcomer: the run that waited longer goes first.
    assert_eq!(busy(store.take_target("api", "api-1", later, 1).await?), (None, 1));
    assert_eq!(
        store.take_target("api", "api-1", first, 1).await?,
        TargetLock::Held { remediated_since: Some(holder), started: false }
    );
    assert_eq!(busy(store.take_target("api", "api-1", later, 1).await?), (Some(first), 0));
    // The holder's verify failed: its second attempt comes back behind the run waiting.
    at("execute", 2, first).await?;
    assert_eq!(busy(store.take_target("api", "api-1", first, 2).await?), (None, 1));
    assert!(matches!(store.take_target("api", "api-1", later, 1).await?, TargetLock::Held { .. }));
    // A waiter that has not looked for 20 s holds nobody up and counts for nobody.
    let (holder, stalled, newcomer, next) = (runs[3], runs[4], runs[5], runs[6]);
    assert!(matches!(store.take_target("db", "db-1", holder, 1).await?, TargetLock::Held { .. }));
    assert_eq!(busy(store.take_target("db", "db-1", stalled, 1).await?), (Some(holder), 0));
    pg.execute("UPDATE target_waits SET looked = now() - interval '20 seconds' WHERE run_id = $1", &[&stalled]).await?;
    assert_eq!(busy(store.take_target("db", "db-1", next, 1).await?), (Some(holder), 0), "none ahead that looks");
    at("report", 1, holder).await?;
    assert!(matches!(store.take_target("db", "db-1", next, 1).await?, TargetLock::Held { .. }));
    // Looking again, it is first in line once more, and ahead of a run that comes after.
    assert_eq!(busy(store.take_target("db", "db-1", stalled, 1).await?), (Some(next), 0));
    assert_eq!(busy(store.take_target("db", "db-1", newcomer, 1).await?), (Some(next), 1));
    // A waiter away for longer than 30 s loses the time it was away: one that came to wait
    // meanwhile, and has waited longer than it since, goes first.
    let (holder, away, stayed) = (runs[7], runs[8], runs[9]);
    assert!(matches!(store.take_target("mq", "mq-1", holder, 1).await?, TargetLock::Held { .. }));
    busy(store.take_target("mq", "mq-1", away, 1).await?);
    pg.execute(
        "UPDATE target_waits SET since = now() - interval '41 seconds', looked = now() - interval '40 seconds' \
         WHERE run_id = $1",
        &[&away],
    )
    .await?;
    busy(store.take_target("mq", "mq-1", stayed, 1).await?);
    pg.execute("UPDATE target_waits SET since = now() - interval '10 seconds' WHERE run_id = $1", &[&stayed]).await?;
    at("report", 1, holder).await?;
    assert_eq!(busy(store.take_target("mq", "mq-1", away, 1).await?), (None, 1));
    assert!(matches!(store.take_target("mq", "mq-1", stayed, 1).await?, TargetLock::Held { .. }));
    Ok(())
}

/// A Postgres address that accepts connections and never answers (a hung server, a proxy in
/// front of a dead one) fails start-up within the URL's `connect_timeout` (10 s without one),
/// saying so, instead of waiting for ever in the handshake.
#[tokio::test]
async fn a_postgres_that_never_answers_fails_start_up_within_the_connect_timeout() -> anyhow::Result<()> {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = silent.local_addr()?.port();
    let _held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            open.push(conn);
        }
    });
    let cfg = DatabaseConfig {
        url: format!("postgres://postgres@127.0.0.1:{port}/pitcrew?connect_timeout=1"),
        pool_size: 1,
        migrate_on_start: false,
        statement_timeout_secs: 30,
    };
    let started = std::time::Instant::now();
    let refused = tokio::time::timeout(std::time::Duration::from_secs(30), Store::connect(&cfg))
        .await
        .map_err(|_| anyhow::anyhow!("still connecting after 30 s"))?;
    let error = refused.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(error.contains("no answer within 1 s"), "{error}");
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "{:?}", started.elapsed());
    Ok(())
}

/// A failover can leave the pool on a server that refuses writes (a standby, a demoted
/// primary: SQLSTATE 25006): that is worth a retry, as a connection lost is, never a reason to
/// dead-letter the step. A value Postgres cannot store is not.
#[tokio::test]
async fn a_write_refused_by_a_read_only_server_is_worth_a_retry() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    let store = store(&db).await?;
    let runs = open_runs(&store, 1).await?;
    let sep = if db.url.contains('?') { '&' } else { '?' };
    let read_only = Store::connect(&DatabaseConfig {
        url: format!("{}{sep}options=-c%20default_transaction_read_only%3Don", db.url),
        pool_size: 1,
        migrate_on_start: false,
        statement_timeout_secs: 30,
    })
    .await?;
    let (moved, events) = step(&runs[0], Stage::Plan, "diagnosed");
    let err = read_only.commit_transition(&moved, RunStatus::Open, &events).await.expect_err("a read-only server");
    assert!(err.to_string().contains("25006"), "Postgres says why: {err}");
    assert!(err.is_transient(), "a server that turned read-only is worth a retry: {err}");
    // It answers a ping, but is no place to write: an outage for writers.
    read_only.ping().await?;
    let refused = read_only.writable().await.expect_err("read-only");
    assert!(refused.is_transient() && refused.to_string().contains("read-only"), "{refused}");
    store.writable().await?;
    // The same write where it can be written: taken.
    assert!(matches!(store.commit_transition(&moved, RunStatus::Open, &events).await, Ok(true)));
    Ok(())
}

/// A store on `url`, its database made if missing.
async fn store_at(url: String) -> Result<Store, pitcrew_runtime::store::StoreError> {
    Store::connect(&DatabaseConfig { url, pool_size: 2, migrate_on_start: false, statement_timeout_secs: 30 }).await
}

/// Whether the connections of `application` to the private server are encrypted (each of
/// them), `None` when it has none.
async fn encrypted(admin: &tokio_postgres::Client, application: &str) -> anyhow::Result<Option<bool>> {
    let row = admin
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
             WHERE a.application_name = $1",
            &[&application],
        )
        .await?;
    let (all, ssl): (i64, i64) = (row.get(0), row.get(1));
    Ok((all > 0).then_some(all == ssl))
}

#[tokio::test]
async fn the_store_connects_over_tls_as_the_url_asks_and_refuses_what_cannot_be_met() -> anyhow::Result<()> {
    use pitcrew_testkit::pg::{PrivatePostgres, TLS_SERVER_NAME};
    let server = PrivatePostgres::start_with_tls()?;
    let (admin, conn) = tokio_postgres::connect(&server.admin_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    let ca = server.ca_file().display().to_string();
    let base = format!("postgres://postgres@127.0.0.1:{}/pitcrew_tls", server.port);
    let connect = |query: String| store_at(format!("{base}?{query}"));

    // The certificate is issued for TLS_SERVER_NAME, not the address connected to: verify-ca
    // (its authority only) connects, creating the database over TLS too; require (libpq's:
    // encrypted, checked only against a given authority) connects without one.
    let ca_store = connect(format!("sslmode=verify-ca&sslrootcert={ca}&application_name=verify-ca")).await?;
    ca_store.migrate().await?;
    assert_eq!(encrypted(&admin, "verify-ca").await?, Some(true));
    let _require = connect("sslmode=require&application_name=require".into()).await?;
    assert_eq!(encrypted(&admin, "require").await?, Some(true));
    // No sslmode: plain, though the server offers TLS.
    let _plain = connect("application_name=plain".into()).await?;
    assert_eq!(encrypted(&admin, "plain").await?, Some(false));

    // verify-full passes when the name connected to is the certificate's (`hostaddr` gives the
    // address, `host` the name checked).
    let full = format!(
        "host={TLS_SERVER_NAME} hostaddr=127.0.0.1 port={} user=postgres dbname=pitcrew_tls sslmode=verify-full \
         sslrootcert={ca} application_name=verify-full",
        server.port
    );
    let _full = store_at(full).await?;
    assert_eq!(encrypted(&admin, "verify-full").await?, Some(true));

    // Over the server's Unix-domain socket, no TLS whatever sslmode says (as psql): connects.
    let socket = format!(
        "host={} port={} user=postgres dbname=pitcrew_tls sslmode=verify-full application_name=socket",
        server.dir().display(),
        server.port
    );
    let _socket = store_at(socket).await?;
    assert_eq!(encrypted(&admin, "socket").await?, Some(false));

    // What cannot be met is refused at once, saying why, not waited for as an outage.
    let other = server.other_ca_file().display().to_string();
    for (query, why) in [
        (format!("sslmode=verify-full&sslrootcert={ca}"), "IP address mismatch"),
        ("sslmode=verify-full".to_string(), "certificate verify failed"),
        (format!("sslmode=verify-ca&sslrootcert={other}"), "certificate verify failed"),
        (format!("sslmode=require&sslrootcert={other}"), "certificate verify failed"),
    ] {
        let e = connect(query.clone()).await.err().unwrap_or_else(|| panic!("{query} connected"));
        assert!(!e.is_transient(), "{query}: {e:?}");
        assert!(e.to_string().contains(why), "{query}: {e}");
    }
    let plain_server = PrivatePostgres::start()?;
    let e = store_at(format!("postgres://postgres@127.0.0.1:{}/pitcrew_tls?sslmode=require", plain_server.port))
        .await
        .err()
        .expect("a server without TLS cannot meet sslmode=require");
    assert!(!e.is_transient() && e.to_string().contains("server does not support TLS"), "{e:?}");
    Ok(())
}

#[tokio::test]
async fn a_tls_handshake_cut_short_by_the_server_is_an_outage_to_wait_out() -> anyhow::Result<()> {
    // What a TLS-terminating proxy that is restarting does: it takes the connection, agrees
    // to TLS, and closes it (then, a reset).
    for reset in [false, true] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let server = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut socket, _) = listener.accept().await?;
            let mut request = [0u8; 8]; // the SSLRequest message
            socket.read_exact(&mut request).await?;
            socket.write_all(b"S").await?;
            if reset {
                socket.set_zero_linger()?;
            }
            drop(socket);
            anyhow::Ok(())
        });
        let e = store_at(format!("postgres://postgres@127.0.0.1:{port}/p?sslmode=require"))
            .await
            .err()
            .expect("nothing answers the handshake");
        server.await??;
        assert!(e.is_transient(), "reset {reset}: {e:?}");
        assert!(e.to_string().contains("cannot reach Postgres"), "reset {reset}: {e}");
    }
    Ok(())
}

#[tokio::test]
async fn listing_a_rare_status_or_one_service_uses_their_indexes_not_every_run() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    let store = store(&db).await?;
    let pg = db.client().await?;
    // A year of history: 20,000 finished runs over 50 services, and one waiting.
    pg.batch_execute(
        "INSERT INTO incidents (id, fingerprint, service, error, severity, received_at)
           SELECT gen_random_uuid(), 'f' || n, 'svc-' || (n % 50), 'down', 'critical', now() - n * interval '30 minutes'
           FROM generate_series(1, 20000) n;
         INSERT INTO runs (id, fingerprint, status, stage, seq, attempt, state, created_at)
           SELECT id, fingerprint, 'resolved', 'report', 8, 1, '{}', received_at FROM incidents;
         UPDATE runs SET status = 'waiting_approval' WHERE fingerprint = 'f7';
         ANALYZE incidents; ANALYZE runs;
         -- As a statement the store has run a few times is planned: for any parameters.
         SET plan_cache_mode = force_generic_plan;",
    )
    .await?;
    let plan = |filter: pitcrew_runtime::store::RunFilter| {
        let pg = &pg;
        async move {
            let explain = format!("EXPLAIN {}", filter.statement());
            let rows = match &filter.service {
                None => pg.query(&explain, &[&filter.limit]).await?,
                Some(s) => pg.query(&explain, &[s, &filter.limit]).await?,
            };
            anyhow::Ok(rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>().join("\n"))
        }
    };
    use pitcrew_runtime::store::RunFilter;
    let waiting = RunFilter { status: Some("waiting_approval".into()), limit: 50, ..Default::default() };
    let shown = plan(waiting.clone()).await?;
    assert!(shown.contains("runs_one_open_per_fingerprint"), "{shown}");
    let listed = store.list_runs(&waiting).await?;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].status, "waiting_approval");
    let one = RunFilter { service: Some("svc-3".into()), limit: 50, ..Default::default() };
    let shown = plan(one.clone()).await?;
    assert!(shown.contains("incidents_service_received_at"), "{shown}");
    let listed = store.list_runs(&one).await?;
    assert_eq!(listed.len(), 50);
    assert!(listed.iter().all(|r| r.service == "svc-3"));
    assert!(listed.windows(2).all(|w| w[0].created_at >= w[1].created_at), "newest first");
    Ok(())
}

/// Workers starting at once on a new database: one migrates while the others wait, then find
/// nothing left; each migration commits on its own (the locks one takes are not held through
/// the next), and no advisory lock is left on the pooled connections.
#[tokio::test]
async fn migrators_at_once_apply_each_migration_once_in_its_own_transaction() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    let cfg = DatabaseConfig { url: db.url.clone(), pool_size: 1, migrate_on_start: false, statement_timeout_secs: 30 };
    let stores = futures::future::try_join_all((0..3).map(|_| Store::connect(&cfg))).await?;
    let applied = futures::future::try_join_all(stores.iter().map(|s| s.migrate())).await?;
    let n = pitcrew_runtime::store::MIGRATIONS.len();
    assert_eq!(applied.iter().sum::<usize>(), n, "{applied:?}");
    let pg = db.client().await?;
    let versions: i64 = pg.query_one("SELECT count(*) FROM pitcrew_migrations", &[]).await?.get(0);
    assert_eq!(versions as usize, n);
    // One transaction each: each recorded at its own transaction's time.
    let times: i64 = pg.query_one("SELECT count(DISTINCT applied_at) FROM pitcrew_migrations", &[]).await?.get(0);
    assert_eq!(times as usize, n, "a transaction a migration");
    let held: i64 = pg
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(held, 0, "the migrators let go of their lock");
    // And again: nothing to do.
    assert_eq!(stores[0].migrate().await?, 0);
    Ok(())
}

/// A migration whose table another session holds locked gives up within its lock wait, as a
/// transient failure (start-up waits and tries again), instead of
/// waiting without end with every statement of the crew on that table queued behind it; once
/// the lock is let go it applies.
#[tokio::test]
async fn a_migration_behind_a_held_lock_gives_up_in_time_and_is_retried() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    let cfg = DatabaseConfig { url: db.url.clone(), pool_size: 1, migrate_on_start: false, statement_timeout_secs: 30 };
    let store = Store::connect(&cfg).await?;
    store.migrate().await?;
    let mut pg = db.client().await?;
    pg.execute("DELETE FROM pitcrew_migrations WHERE version = 13", &[]).await?;
    let holder = pg.transaction().await?;
    holder.batch_execute("LOCK TABLE incidents IN ACCESS EXCLUSIVE MODE").await?;
    let began = std::time::Instant::now();
    let refused = store.migrate().await.unwrap_err();
    assert!(refused.is_transient(), "{refused}");
    assert!(began.elapsed() < std::time::Duration::from_secs(20), "{:?}", began.elapsed());
    holder.rollback().await?;
    assert_eq!(store.migrate().await?, 1);
    Ok(())
}

/// Setting run states to lz4 behind a lock held past the migrations' lock wait fails, to be
/// tried again, instead of being recorded done with pglz kept for good (every error was
/// caught, the lock's timeout with the rest); a database upgraded that way before gets lz4
/// from migration 16.
#[tokio::test]
async fn run_states_set_to_lz4_behind_a_held_lock_are_set_on_the_next_try() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    let cfg = DatabaseConfig { url: db.url.clone(), pool_size: 1, migrate_on_start: false, statement_timeout_secs: 30 };
    let store = Store::connect(&cfg).await?;
    store.migrate().await?;
    let mut pg = db.client().await?;
    if pg.batch_execute("SET default_toast_compression = 'lz4'").await.is_err() {
        eprintln!("this Postgres has no lz4: nothing to set");
        return Ok(());
    }
    let method =
        "SELECT attcompression::text FROM pg_attribute WHERE attrelid = 'runs'::regclass AND attname = 'state'";
    pg.batch_execute("ALTER TABLE runs ALTER COLUMN state SET COMPRESSION pglz").await?;
    pg.execute("DELETE FROM pitcrew_migrations WHERE version = 6", &[]).await?;
    let holder = pg.transaction().await?;
    holder.batch_execute("LOCK TABLE runs IN ACCESS SHARE MODE").await?;
    let refused = store.migrate().await.unwrap_err();
    assert!(refused.is_transient(), "{refused}");
    holder.rollback().await?;
    assert_eq!(pg.query_one(method, &[]).await?.get::<_, String>(0), "p", "nothing set while the lock was held");
    assert_eq!(store.migrate().await?, 1);
    assert_eq!(pg.query_one(method, &[]).await?.get::<_, String>(0), "l");
    // A database an earlier build upgraded that way: migration 6 recorded, pglz kept.
    // Migration 16 sets lz4 there.
    pg.batch_execute("ALTER TABLE runs ALTER COLUMN state SET COMPRESSION pglz").await?;
    pg.execute("DELETE FROM pitcrew_migrations WHERE version = 16", &[]).await?;
    assert_eq!(store.migrate().await?, 1);
    assert_eq!(pg.query_one(method, &[]).await?.get::<_, String>(0), "l");
    Ok(())
}

/// The last fixes of a signature never fixed are read from the successes alone, however many
/// failures it has.
#[tokio::test]
async fn the_fixes_of_a_signature_are_read_without_walking_its_failures() -> anyhow::Result<()> {
    let (_db, store, run, pg) = one_run().await?;
    let run = run.run_id;
    pg.execute(
        "INSERT INTO episodes (run_id, attempt, service, signature, error, diagnosis, commands, result, success)
         SELECT $1, a, 'web', 'sig', 'down', 'd', ARRAY['systemctl restart web'], 'still down', false
         FROM generate_series(1, 5000) a",
        &[&run],
    )
    .await?;
    pg.batch_execute("ANALYZE episodes").await?;
    let plan: String = pg
        .query(
            "EXPLAIN SELECT commands FROM episodes WHERE service = 'web' AND signature = 'sig' AND success
             ORDER BY created_at DESC LIMIT 3",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(plan.contains("episodes_fixed"), "{plan}");
    let memory = store.memory("web", "sig", std::time::Duration::from_secs(3600)).await?;
    assert!(memory.fixes.is_empty() && memory.failed == ["systemctl restart web"], "{memory:?}");
    Ok(())
}

/// An incident's error may be 4096 bytes that do not compress (random letters, another
/// alphabet): its episode is stored all the same, and episodic memory finds it by that
/// signature. Postgres refuses an index entry past 2704 bytes, and the episode's transition
/// (verify's, escalate's) with it, at every delivery.
#[tokio::test]
async fn an_episode_of_a_long_error_that_does_not_compress_is_stored_and_remembered() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    let store = store(&db).await?;
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let error: String = (0..pitcrew_model::incident::MAX_ERROR_LEN)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (b'a' + (seed % 26) as u8) as char
        })
        .collect();
    let mut incident = Incident::new("web", error);
    incident.validate()?;
    let run = RunState::new(Uuid::now_v7(), incident);
    assert_eq!(store.open_run(&run).await?, OpenRun::Created);
    let (verified, events) = step(&run, Stage::Report, "still down");
    let episode = Episode::of(&verified, &["systemctl restart web".into()], false, "still down");
    assert!(store.commit_transition_with(&verified, RunStatus::Open, &events, vec![Record::Episode(episode)]).await?);
    let memory = store.memory("web", &run.incident.signature(), secs(3600)).await?;
    assert_eq!(memory.failed, ["systemctl restart web"], "{memory:?}");
    Ok(())
}

/// An episode an earlier build stored under a signature longer than today's cap (the cut
/// falling inside a character here) gets the capped signature from the migration, the one
/// `error_signature` gives its error now: episodic memory still finds what was tried.
#[tokio::test]
async fn episodes_stored_under_a_long_signature_are_found_under_its_capped_form() -> anyhow::Result<()> {
    let (_db, store, run, pg) = one_run().await?;
    let error = format!("{}é{}", "a".repeat(1005), " refusée".repeat(200));
    let capped = pitcrew_model::incident::error_signature(&error);
    assert!(capped.len() <= pitcrew_model::incident::MAX_SIGNATURE_LEN && capped.len() < error.len());
    pg.execute(
        "INSERT INTO episodes (run_id, attempt, service, signature, error, diagnosis, commands, result, success)
         VALUES ($1, 1, 'web', $2, $2, 'd', ARRAY['systemctl restart web'], 'still down', false)",
        &[&run.run_id, &error],
    )
    .await?;
    pg.execute("DELETE FROM pitcrew_migrations WHERE version = 17", &[]).await?;
    assert_eq!(store.migrate().await?, 1);
    let stored: String = pg.query_one("SELECT signature FROM episodes WHERE run_id = $1", &[&run.run_id]).await?.get(0);
    assert_eq!(stored, capped);
    let memory = store.memory("web", &capped, secs(3600)).await?;
    assert_eq!(memory.failed, ["systemctl restart web"], "{memory:?}");
    Ok(())
}

/// Pruning deletes closed runs older than the cutoff with all that belongs to them, incidents
/// that started no run, and old audit lines; open runs, however old, and recent ones stay.
#[tokio::test]
async fn prune_deletes_old_closed_runs_with_all_they_hold_and_keeps_the_rest() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    let store = store(&db).await?;
    let runs = open_runs(&store, 4).await?;
    let (old, old_open, recent, folded_into) = (&runs[0], &runs[1], &runs[2], &runs[3]);
    let pg = db.client().await?;
    // Everything a run may hold, for each run.
    for r in &runs {
        let (moved, events) = step(r, Stage::Escalate, "x");
        assert!(store.commit_transition(&moved, RunStatus::Open, &events).await?);
        pg.batch_execute(&format!(
            "INSERT INTO executions (run_id, attempt, idx, command, host, worker) VALUES ('{id}', 1, 0, 'true', 'local', 'w');
             INSERT INTO execution_releases (run_id, attempt, idx, command, host, worker, started, claimed_at, why)
               VALUES ('{id}', 1, 0, 'true', 'local', 'w', false, now(), 'never started');
             INSERT INTO episodes (run_id, attempt, service, signature, error, diagnosis, commands, result, success)
               VALUES ('{id}', 1, 's', 'sig', 'e', 'd', ARRAY['true'], 'r', true);
             INSERT INTO evaluations (run_id, attempt, regeneration, score, verdict, checks) VALUES ('{id}', 1, 0, 1, 'pass', '[]');
             INSERT INTO approvals (run_id, plan_hash, attempt, commands, risk, rule, requested_at, expires_at)
               VALUES ('{id}', 'h', 1, ARRAY['true'], 'critical', 'r', now(), now());
             INSERT INTO approval_votes (run_id, plan_hash, approver, channel) VALUES ('{id}', 'h', 'ann', 'cli');
             INSERT INTO llm_usage (run_id, seq, stage, attempt, model, calls, prompt_tokens, completion_tokens)
               VALUES ('{id}', 1, 'diagnose', 1, 'm', 1, 1, 1);
             INSERT INTO target_waits (run_id, attempt, service, host) VALUES ('{id}', 1, 's', 'h');",
            id = r.run_id
        ))
        .await?;
    }
    // An incident folded into the old run; one refused at intake, long ago; audit lines.
    let (dup, refused, unstored) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    pg.execute(
        "INSERT INTO incidents (id, fingerprint, service, error, severity, duplicate_of, received_at)
         VALUES ($1, 'group-0', 'svc-0', 'down', 'critical', $2, now() - interval '40 days'),
                ($3, 'f', 'nope', 'down', 'critical', NULL, now() - interval '40 days')",
        &[&dup, &old.run_id, &refused],
    )
    .await?;
    pg.batch_execute(&format!(
        "INSERT INTO run_events (run_id, seq, idx, stage, kind, message, worker, at)
           VALUES ('{dup}', 0, 0, 'intake', 'duplicate', 'd', 'w', now()), ('{refused}', 0, 0, 'intake', 'rejected', 'r', 'w', now()),
                  -- Refused before anything of it was stored (its incident did not validate):
                  -- a timeline alone, long ago.
                  ('{unstored}', 0, 0, 'intake', 'rejected', 'r', 'w', now() - interval '40 days');
         INSERT INTO gateway_audit (principal, method, path, status, outcome, at)
           VALUES ('a', 'GET', '/v1/runs', 200, 'ok', now() - interval '40 days'), ('a', 'GET', '/v1/runs', 200, 'ok', now());
         UPDATE runs SET status = 'escalated', created_at = now() - interval '40 days'
          WHERE id IN ('{a}', '{c}');
         UPDATE runs SET created_at = now() - interval '40 days' WHERE id = '{b}';
         UPDATE runs SET status = 'resolved' WHERE id = '{d}';
         -- A redelivery racing the fold: the recent run's own incident also folded into the old.
         UPDATE incidents SET duplicate_of = '{a}' WHERE id = '{d}';",
        a = old.run_id,
        b = old_open.run_id,
        c = folded_into.run_id,
        d = recent.run_id,
    ))
    .await?;
    let before = Utc::now() - chrono::Duration::days(30);
    // Batches of one: the loop a caller runs.
    let mut total = pitcrew_runtime::store::Pruned::default();
    loop {
        let p = store.prune(before, 1).await?;
        assert!(p.runs <= 1 && p.incidents <= 1 && p.audit <= 1, "{p:?}");
        assert!(p.runs == 0 || (p.incidents, p.audit) == (0, 0), "runs go first, the rest after them: {p:?}");
        if p.is_empty() {
            break;
        }
        total.runs += p.runs;
        total.incidents += p.incidents;
        total.audit += p.audit;
    }
    assert_eq!((total.runs, total.incidents, total.audit), (2, 2, 1), "{total:?}");
    let left = |table: &'static str, column: &'static str| {
        let pg = &pg;
        async move {
            let sql = format!("SELECT {column} FROM {table} ORDER BY 1");
            anyhow::Ok(pg.query(&sql, &[]).await?.iter().map(|r| r.get::<_, Uuid>(0)).collect::<Vec<_>>())
        }
    };
    let mut kept = vec![old_open.run_id, recent.run_id];
    kept.sort();
    assert_eq!(left("runs", "id").await?, kept);
    assert_eq!(left("incidents", "id").await?, kept, "the pruned runs', the folded and the refused incident went");
    for table in [
        "executions",
        "execution_releases",
        "episodes",
        "evaluations",
        "approvals",
        "approval_votes",
        "llm_usage",
        "target_waits",
    ] {
        assert_eq!(left(table, "DISTINCT run_id").await?, kept, "{table}");
    }
    assert_eq!(left("run_events", "DISTINCT run_id").await?, kept, "run_events");
    let audit: i64 = pg.query_one("SELECT count(*) FROM gateway_audit", &[]).await?.get(0);
    assert_eq!(audit, 1);
    assert!(store.prune(before, 100).await?.is_empty(), "nothing left to prune");
    Ok(())
}

/// A close by hand and a command of the run are ordered by the run's row: a close is refused
/// while a claimed command may run (the claim came first), and a claim that waited past its
/// time for its turn does not start on a run closed meanwhile (the close came first).
#[tokio::test]
async fn a_run_closed_by_hand_runs_no_command_claimed_before_or_after() -> anyhow::Result<()> {
    let (_db, store, read, pg) = one_run().await?;
    let run = read.run_id;
    move_run(&pg, run, "execute", "open", None).await?;
    let mut at_execute = store.load_run(run).await?.expect("run").state;
    at_execute.step = Stage::Execute;
    let close = |state: &RunState| {
        let was = (state.step, state.seq);
        let mut closing = state.clone();
        closing.escalate("closed by carol: gone");
        let event =
            RunEvent { kind: EventKind::Escalated, ..event(&closing, 0, "escalated svc-0: closed by carol: gone") };
        (was, closing, event)
    };
    // A command claimed and not yet past its time may be running: the close is refused.
    let first = Uuid::new_v4();
    store.claim_execution(run, 1, 0, "touch /tmp/x0", "web-1", "a", first, false, secs(70)).await?;
    let (was, closing, ev) = close(&at_execute);
    assert!(!store.close_run(was, &closing, &ev, "carol").await?, "a claimed command may be running");
    assert!(store.command_starts(run, 1, 0, first, secs(70)).await?, "the run still stands: it starts");
    // Its time passed as it waited for a connection (claimed, never started): the close goes
    // through, and the start that comes after it is refused.
    let late = Uuid::new_v4();
    store.claim_execution(run, 1, 1, "touch /tmp/x1", "web-1", "a", late, false, secs(70)).await?;
    pg.execute("UPDATE executions SET gone_by = now() - interval '1 s' WHERE run_id = $1", &[&run]).await?;
    assert!(store.close_run(was, &closing, &ev, "carol").await?, "nothing may be running");
    assert!(!store.command_starts(run, 1, 1, late, secs(70)).await?, "a closed run starts nothing");
    let refused =
        store.claim_execution(run, 1, 2, "touch /tmp/x2", "web-1", "a", Uuid::new_v4(), false, secs(70)).await;
    assert!(matches!(&refused, Err(e) if e.to_string().contains("left execute")), "{refused:?}");
    Ok(())
}

/// A claim, or a command's start, and a step moving the run off execute are ordered by the
/// run's row: made while that step's commit is in flight (another copy of the step escalating
/// the run), it waits for the commit, then finds the run gone from execute: nothing is claimed
/// or started that a target freed by the move could see run alongside another run's fix.
#[tokio::test]
async fn a_claim_or_a_start_waits_for_a_move_off_execute_in_flight_and_is_refused() -> anyhow::Result<()> {
    let (db, store, read, pg) = one_run().await?;
    let run = read.run_id;
    move_run(&pg, run, "execute", "open", None).await?;
    let claimed = Uuid::new_v4();
    store.claim_execution(run, 1, 0, "touch /tmp/x0", "web-1", "a", claimed, false, secs(70)).await?;
    // The other copy's transition: the run's row updated, its commit not yet made.
    let other = db.client().await?;
    other.batch_execute(&format!("BEGIN; UPDATE runs SET stage = 'escalate' WHERE id = '{run}'")).await?;
    let (s1, s2) = (store.clone(), store.clone());
    let claiming = tokio::spawn(async move {
        s1.claim_execution(run, 1, 1, "touch /tmp/x1", "web-1", "a", Uuid::new_v4(), false, secs(70)).await
    });
    let starting = tokio::spawn(async move { s2.command_starts(run, 1, 0, claimed, secs(70)).await });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!claiming.is_finished(), "the claim waits for the move in flight");
    assert!(!starting.is_finished(), "the start waits for the move in flight");
    other.batch_execute("COMMIT").await?;
    let refused = claiming.await?;
    assert!(matches!(&refused, Err(e) if e.to_string().contains("left execute")), "{refused:?}");
    assert!(!starting.await??, "a run moved off execute starts nothing");
    assert_eq!(store.execution_claim(run, 1, 1).await?, None, "nothing was claimed");
    Ok(())
}

/// A claim tried again by its own delivery (same token: its first answer was lost after the
/// commit) is still its own while the run is at execute; to any other delivery it is a claim
/// that may be running, and to its own once the run left execute, no claim to run.
#[tokio::test]
async fn a_claim_tried_again_under_its_token_is_its_own_while_the_run_is_at_execute() -> anyhow::Result<()> {
    use pitcrew_runtime::store::Claim;
    let (_db, store, read, pg) = one_run().await?;
    let run = read.run_id;
    move_run(&pg, run, "execute", "open", None).await?;
    let mine = Uuid::new_v4();
    let claim = |token: Uuid| store.claim_execution(run, 1, 0, "touch /tmp/x0", "local", "a", token, true, secs(70));
    assert_eq!(claim(mine).await?, Claim::Claimed);
    assert_eq!(claim(mine).await?, Claim::Claimed, "the same delivery's retry");
    match claim(Uuid::new_v4()).await? {
        Claim::Unfinished { unstarted: None, .. } => {}
        other => panic!("another delivery must wait it out: {other:?}"),
    }
    // Taken over once past its time (recorded interrupted by another delivery): the retry
    // finds that, not a claim to run.
    pg.execute("UPDATE executions SET gone_by = now() - interval '1 s' WHERE run_id = $1", &[&run]).await?;
    assert!(store.mark_interrupted(run, 1, 0).await?);
    match claim(mine).await? {
        Claim::Finished(rec) => assert_eq!(rec.status, pitcrew_model::ExecutionStatus::Interrupted),
        other => panic!("{other:?}"),
    }
    // Its own claim of the next command, the run gone from execute when it is tried again:
    // refused for good (not a failure to retry), and the claim, under which nothing ran,
    // removed rather than left to hold the target and be recorded interrupted.
    let next = |token: Uuid| store.claim_execution(run, 1, 1, "touch /tmp/x1", "local", "a", token, true, secs(70));
    assert_eq!(next(mine).await?, Claim::Claimed);
    move_run(&pg, run, "escalate", "open", None).await?;
    let refused = next(mine).await;
    assert!(
        matches!(&refused, Err(e @ pitcrew_runtime::StoreError::Moved(_)) if e.to_string().contains("left execute")),
        "{refused:?}"
    );
    assert_eq!(store.execution_claim(run, 1, 1).await?, None, "nothing ran under it: removed");
    let kept = pg.query_one("SELECT claim, why FROM execution_releases WHERE run_id = $1 AND idx = 1", &[&run]).await?;
    assert_eq!(kept.get::<_, Uuid>(0), mine);
    assert!(kept.get::<_, String>(1).starts_with("its run left execute"), "{:?}", kept.get::<_, String>(1));
    Ok(())
}

/// Closing a run by hand takes only where it was read: a step that moved it meanwhile (its
/// own escalation, at the very seq the close would take) stands, and the close says so.
#[tokio::test]
async fn a_run_closed_by_hand_only_where_it_was_read() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    let store = store(&db).await?;
    let read = open_runs(&store, 1).await?.remove(0);
    let was = (read.step, read.seq);
    let close = |state: &RunState| {
        let mut closing = state.clone();
        closing.escalate("closed by carol: gone");
        let event =
            RunEvent { kind: EventKind::Escalated, ..event(&closing, 0, "escalated svc-0: closed by carol: gone") };
        (closing, event)
    };
    // Meanwhile the crew escalated it itself, at the seq the close would take.
    let mut crew = read.clone();
    crew.escalate("approval timed out");
    assert!(store.commit_transition(&crew, RunStatus::Open, &[]).await?);
    let (closing, ev) = close(&read);
    assert!(!store.close_run(was, &closing, &ev, "carol").await?, "the crew's step stands");
    let stored = store.load_run(read.run_id).await?.expect("run");
    assert_eq!(stored.state.escalation_reason.as_deref(), Some("approval timed out"));
    // Read again, it closes, and denies what the run waited on.
    let pg = db.client().await?;
    pg.execute(
        "INSERT INTO approvals (run_id, plan_hash, attempt, commands, risk, rule, requested_at, expires_at)
         VALUES ($1, 'h', 1, ARRAY['rm -f /tmp/x'], 'critical', 'rm', now(), now() + interval '1 h')",
        &[&read.run_id],
    )
    .await?;
    let (closing, ev) = close(&stored.state);
    assert!(store.close_run((stored.state.step, stored.state.seq), &closing, &ev, "carol").await?);
    let row = pg.query_one("SELECT status, reason FROM runs WHERE id = $1", &[&read.run_id]).await?;
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, String>(1)),
        ("escalated".into(), "closed by carol: gone".into())
    );
    let denied = pg
        .query_one("SELECT decision || ' ' || decided_by FROM approvals WHERE run_id = $1", &[&read.run_id])
        .await?
        .get::<_, String>(0);
    assert_eq!(denied, "deny carol");
    let kinds = pg.query("SELECT kind FROM run_events WHERE run_id = $1", &[&read.run_id]).await?;
    assert!(kinds.iter().any(|r| r.get::<_, String>(0) == "escalated"));
    // Closed: a second close takes nothing.
    let (closing, ev) = close(&closing);
    assert!(!store.close_run((closing.step, closing.seq - 1), &closing, &ev, "carol").await?);
    Ok(())
}
