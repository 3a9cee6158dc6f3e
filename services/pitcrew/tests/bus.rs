//! Delivery guarantees against a real nats-server: a stage message delivered twice runs
//! nothing twice, two processes of one stage share its work, poison goes to the DLQ, a consumer
//! told to stop pulls nothing more.

mod common;

use async_nats::header::{HeaderMap, NATS_MESSAGE_ID};
use common::{count, marker_service, texts, write, Crew, WAIT};
use futures::StreamExt;
use pitcrew_model::codec::{CONTENT_TYPE, MSGPACK};
use pitcrew_model::{EventKind, Stage};
use pitcrew_runtime::consume::{consume, Disposition, MessageHandler};
use pitcrew_testkit::TestEnv;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const PLAYBOOK: &str = r#"
[[rule]]
name = "once"
match = "(?i)needs a directory"
diagnosis = "{service} needs its directory"
plans = [["mkdir {dir}/made-once", "touch {dir}/svc-healthy"]]
"#;

/// A crew running every stage but execute, and a run approved and waiting on the execute
/// subject.
async fn held_before_execute() -> anyhow::Result<(Crew, uuid::Uuid)> {
    let env = TestEnv::start().await?;
    let book = write(&env, "playbook.toml", PLAYBOOK);
    let text = format!("[reasoning]\nplaybook_file = \"{book}\"\n{}", marker_service(&env, "svc"));
    let others: Vec<Stage> = Stage::ALL.into_iter().filter(|s| *s != Stage::Execute).collect();
    let mut crew = Crew::start_in(env, &text, &others).await?;
    let run = crew.open("svc", "svc needs a directory").await?;
    crew.events.wait(run, |e| e.kind == EventKind::Policy, WAIT).await?;
    Ok((crew, run))
}

/// Wait (up to `WAIT`) until the work-queue `stream` holds nothing: every message consumed.
async fn emptied(stream: &async_nats::jetstream::stream::Stream) -> anyhow::Result<()> {
    tokio::time::timeout(WAIT, async {
        while stream.get_info().await.map(|i| i.state.messages).unwrap_or(1) > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_message_delivered_twice_executes_nothing_twice() -> anyhow::Result<()> {
    let (mut crew, run) = held_before_execute().await?;

    // Take the execute message as published and publish it again under another id, so the
    // stream holds it twice: the redelivery a crash after running would cause.
    let stream = crew.bus.js.get_stream(crew.bus.subjects.stages_stream()).await?;
    let subject = crew.bus.subjects.stage(Stage::Execute);
    let original = tokio::time::timeout(WAIT, async {
        loop {
            if let Ok(m) = stream.get_last_raw_message_by_subject(&subject).await {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await?;
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, "a-second-copy");
    headers.insert(CONTENT_TYPE, MSGPACK);
    crew.bus.publish_with_headers(subject.clone(), headers, original.payload.clone()).await?;
    assert_eq!(stream.get_info().await?.state.messages, 2, "both copies are queued");

    crew.shutdown().await?;
    crew.run(&Stage::ALL);
    let end = crew.events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    // Wait until the second copy is consumed too (work-queue stream empties).
    emptied(&stream).await?;
    let db = crew.db().await?;
    let timeline =
        texts(&db, "SELECT stage || ': ' || message FROM run_events WHERE run_id = $1 ORDER BY seq, idx", run).await;
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 2, "{timeline:#?}");
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1 AND status = 'succeeded'", run).await, 2);
    // mkdir fails when run twice: the target's own record says it ran once.
    assert!(std::path::Path::new(&crew.env.path("made-once")).is_dir());
    assert_eq!(count(&db, "SELECT count(*) FROM run_events WHERE run_id = $1 AND kind = 'execution'", run).await, 2);
    assert_eq!(count(&db, "SELECT count(*) FROM run_events WHERE run_id = $1 AND kind = 'verification'", run).await, 1);
    crew.shutdown().await
}

/// An execute message delivered again after its step escalated without running its plan (as a
/// target wait past its limit or an unreachable host does) and its publish was lost (here: the
/// run moved to escalate in Postgres, no escalate message on the bus): it runs nothing (a late
/// delivery replays claims, never makes one, and holds no target) and sends the run on to
/// escalate again, so the run ends escalated instead of staying open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_execute_delivery_runs_nothing_and_resends_its_escalation() -> anyhow::Result<()> {
    let (mut crew, run) = held_before_execute().await?;
    crew.shutdown().await?;
    let db = crew.db().await?;
    let moved = db
        .execute(
            "UPDATE runs SET seq = seq + 1, stage = 'escalate',
                 state = jsonb_set(jsonb_set(jsonb_set(state, '{seq}', to_jsonb(seq + 1)), '{step}', '\"escalate\"'),
                                   '{escalation_reason}', '\"waited too long for svc\"')
             WHERE id = $1 AND stage = 'execute'",
            &[&run],
        )
        .await?;
    assert_eq!(moved, 1);
    crew.run(&[Stage::Execute, Stage::Escalate]);
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Escalated, "{}", end.message);
    assert!(end.message.contains("waited too long for svc"), "{}", end.message);
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    assert!(!std::path::Path::new(&crew.env.path("made-once")).exists(), "the late delivery ran the plan");
    assert_eq!(crew.dead_letters().await?, 0, "nothing dead-lettered");
    crew.shutdown().await
}

/// An execute message delivered again after its run moved on to its next attempt (its worker
/// died between the commit and the ack; the run failed verification meanwhile): the approval
/// stored now is the next attempt's, and the late delivery runs nothing and is no poison (it
/// was dead-lettered, an alarm for an operator about nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_execute_delivery_from_an_earlier_attempt_is_dropped_not_dead_lettered() -> anyhow::Result<()> {
    let (mut crew, run) = held_before_execute().await?;
    crew.shutdown().await?;
    let db = crew.db().await?;
    let moved = db
        .execute(
            "UPDATE runs SET seq = seq + 3, stage = 'plan', attempt = 2,
                 state = jsonb_set(jsonb_set(jsonb_set(state, '{seq}', to_jsonb(seq + 3)), '{step}', '\"plan\"'),
                                   '{attempt}', '2')
             WHERE id = $1 AND stage = 'execute'",
            &[&run],
        )
        .await?;
    assert_eq!(moved, 1);
    crew.run(&[Stage::Execute]);
    let stream = crew.bus.js.get_stream(crew.bus.subjects.stages_stream()).await?;
    emptied(&stream).await?;
    assert_eq!(crew.dead_letters().await?, 0, "nothing dead-lettered");
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    let (status, stage): (String, String) =
        db.query_one("SELECT status, stage FROM runs WHERE id = $1", &[&run]).await.map(|r| (r.get(0), r.get(1)))?;
    assert_eq!((status.as_str(), stage.as_str()), ("open", "plan"), "the run is left where it is");
    crew.shutdown().await
}

/// An execute message ahead of Postgres (a standby that lags, a failover that lost the
/// approval's commit: here the run moved back a step by hand): it runs nothing and is not
/// taken for a late delivery and dropped, which would leave the run where Postgres has it
/// with no message anywhere. It is looked at again; once Postgres has caught up (the step put
/// back), it runs, and the run resolves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_execute_message_ahead_of_postgres_waits_for_it_and_is_not_dropped() -> anyhow::Result<()> {
    let (mut crew, run) = held_before_execute().await?;
    crew.shutdown().await?;
    let db = crew.db().await?;
    let back = "UPDATE runs SET seq = seq - 1, stage = 'approval',
                    state = jsonb_set(jsonb_set(state, '{seq}', to_jsonb(seq - 1)), '{step}', '\"approval\"')
                WHERE id = $1 AND stage = 'execute'";
    assert_eq!(db.execute(back, &[&run]).await?, 1);
    crew.run(&[Stage::Execute]);
    let stream = crew.bus.js.get_stream(crew.bus.subjects.stages_stream()).await?;
    // Delivered three times, put back each time.
    tokio::time::timeout(WAIT, async {
        loop {
            // (Made as the stage starts.)
            if stream.consumer_info("execute").await.is_ok_and(|i| i.delivered.consumer_sequence >= 3) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await?;
    assert_eq!(stream.get_info().await?.state.messages, 1, "the message is kept");
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0, "nothing ran");
    assert_eq!(crew.dead_letters().await?, 0, "nothing dead-lettered");
    crew.shutdown().await?;

    // Postgres caught up: the same message runs the plan.
    let forward = "UPDATE runs SET seq = seq + 1, stage = 'execute',
                       state = jsonb_set(jsonb_set(state, '{seq}', to_jsonb(seq + 1)), '{step}', '\"execute\"')
                   WHERE id = $1 AND stage = 'approval'";
    assert_eq!(db.execute(forward, &[&run]).await?, 1);
    crew.run(&Stage::ALL);
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    assert!(std::path::Path::new(&crew.env.path("made-once")).exists(), "the plan ran");
    assert_eq!(crew.dead_letters().await?, 0, "nothing dead-lettered");
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_of_one_stage_share_its_work() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    // A service a run: runs of one service would take turns in execute (and past 16 waiting,
    // escalate), which is not what this test is about.
    let text: String = (0..30).map(|i| marker_service(&env, &format!("s{i}"))).collect();
    let others: Vec<Stage> = Stage::ALL.into_iter().filter(|s| *s != Stage::Diagnose).collect();
    let mut crew = Crew::start_in(env, &text, &others).await?;
    let limit = [("PITCREW_STAGE__DIAGNOSE__CONCURRENCY", "1")];
    let _w1 = crew.spawn_worker("diag-1", &["diagnose"], &limit)?;
    let _w2 = crew.spawn_worker("diag-2", &["diagnose"], &limit)?;
    let mut runs = Vec::new();
    for i in 0..30 {
        runs.push(crew.open_with(&format!("s{i}"), "connection refused", Some(format!("fp-{i}"))).await?);
    }
    for run in &runs {
        let end = crew.end(*run).await?;
        assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    }
    let db = crew.db().await?;
    let rows = db
        .query(
            "SELECT worker, count(*) FROM run_events WHERE stage = 'diagnose' AND kind = 'diagnosis' GROUP BY worker",
            &[],
        )
        .await?;
    let per_worker: Vec<(String, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(per_worker.len(), 2, "both processes diagnosed: {per_worker:?}");
    assert!(per_worker.iter().all(|(w, _)| w.starts_with("diag-")), "{per_worker:?}");
    assert_eq!(per_worker.iter().map(|(_, n)| n).sum::<i64>(), 30, "each run diagnosed exactly once");
    crew.shutdown().await
}

/// The events stream deleted by hand while a worker runs (an operator's slip): the first
/// publish that finds no stream has the streams made again, and the run goes on to its end,
/// its events on the bus again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_deleted_under_a_worker_is_made_again_and_its_run_goes_on() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let text = marker_service(&env, "svc");
    let mut crew = Crew::start_in(env, &text, &[]).await?;
    let stages = ["intake", "diagnose", "plan", "evaluate", "approval", "execute", "verify", "report", "escalate"];
    let worker = crew.spawn_worker("all", &stages, &[])?;
    let first = crew.open("svc", "connection refused").await?;
    assert_eq!(crew.events.terminal(first, WAIT).await?.kind, EventKind::Resolved);
    crew.bus.js.delete_stream(crew.bus.subjects.events_stream()).await?;
    let run = crew.open_with("svc", "connection refused", Some("again".into())).await?;
    // Its end on the bus (in Postgres it may be there first: a step's events are sent again).
    let deadline = std::time::Instant::now() + WAIT;
    let end = loop {
        let events = crew.bus.js.get_stream(crew.bus.subjects.events_stream()).await;
        let last = match events {
            Ok(s) => s.get_last_raw_message_by_subject(&crew.bus.subjects.event(run, "resolved")).await.ok(),
            Err(_) => None,
        };
        if let Some(msg) = last {
            break serde_json::from_slice::<pitcrew_model::RunEvent>(&msg.payload)?;
        }
        assert!(std::time::Instant::now() < deadline, "no end of run {run} on the bus, the events stream gone");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!((end.run_id, end.kind), (run, EventKind::Resolved));
    let status: String = crew.db().await?.query_one("SELECT status FROM runs WHERE id = $1", &[&run]).await?.get(0);
    assert_eq!(status, "resolved");
    let log = std::fs::read_to_string(crew.env.path("all.log")).unwrap_or_default();
    assert!(log.contains("making pitcrew's streams again"), "{log}");
    drop(worker);
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_incident_is_dead_lettered_and_the_worker_keeps_serving() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let text = marker_service(&env, "svc");
    let mut crew = Crew::start_in(env, &text, &Stage::ALL).await?;
    let client = crew.bus.client.clone();
    client.publish(crew.bus.subjects.incidents_new(), "{\"service\": \"svc\", \"error\": ".into()).await?;
    client.publish(crew.bus.subjects.incidents_new(), "{\"service\": \"svc\"}".into()).await?;
    let good = crew.open("svc", "connection refused").await?;
    let end = crew.events.terminal(good, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);

    let dlq = crew.bus.js.get_stream(crew.bus.subjects.dlq_stream()).await?;
    let consumer = dlq
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            filter_subject: crew.bus.subjects.dlq("intake"),
            ..Default::default()
        })
        .await?;
    let mut msgs = consumer.messages().await?;
    let mut errors = Vec::new();
    for _ in 0..2 {
        let m = tokio::time::timeout(WAIT, msgs.next()).await?.expect("dead letter")?;
        let why = m.headers.as_ref().and_then(|h| h.get("Pitcrew-Error")).map(|v| v.to_string()).unwrap_or_default();
        errors.push((why, m.payload.clone()));
    }
    // Both are dead-lettered (in either order: intake handles messages concurrently).
    errors.sort_by_key(|(_, payload)| payload.len());
    assert!(errors[1].0.starts_with("bad incident: invalid JSON"), "{:?}", errors[1].0);
    assert_eq!(&errors[1].1[..], b"{\"service\": \"svc\", \"error\": ", "the original payload is kept");
    assert!(errors[0].0.contains("missing field `error`"), "{:?}", errors[0].0);

    // Opening an incident through the bus needs its id (the run's id): one without is refused
    // with the reason, before anything reaches the stream.
    let incidents = crew.bus.js.get_stream(crew.bus.subjects.incidents_stream()).await?;
    let before = incidents.get_info().await?.state.last_sequence;
    let mut anonymous = pitcrew_model::Incident::new("svc", "connection refused");
    anonymous.id = None;
    let refused = crew.bus.open_incident(&anonymous).await.expect_err("an incident without an id is refused");
    assert!(refused.to_string().contains("the incident has no id"), "{refused}");
    assert_eq!(incidents.get_info().await?.state.last_sequence, before, "nothing was published");
    crew.shutdown().await
}

/// Incidents whose dead letter or refusal could not be stored as they came: one whose
/// `Nats-Expected-Stream` header names the incidents stream (copied, it would send the DLQ's
/// copy to the wrong stream), one too large to fit beside a dead letter's headers, one whose
/// service holds a NUL (the refusal quoting it is no text Postgres takes). Each was retried for
/// good, held unsettled by intake; each is now dead-lettered once and settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incidents_whose_refusal_could_not_be_stored_as_they_came_are_still_dead_lettered_and_settled(
) -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let text = marker_service(&env, "svc");
    let mut crew = Crew::start_in(env, &text, &[Stage::Intake]).await?;
    let subject = crew.bus.subjects.incidents_new();
    let mut expecting = HeaderMap::new();
    expecting.insert(NATS_MESSAGE_ID, "expects-its-stream");
    expecting.insert("Nats-Expected-Stream", crew.bus.subjects.incidents_stream().as_str());
    crew.bus.publish_with_headers(subject.clone(), expecting, "not json".into()).await?;
    let big = pitcrew_runtime::bus::MAX_MESSAGE - 200;
    let mut sized = HeaderMap::new();
    sized.insert(NATS_MESSAGE_ID, "too-big-for-a-dead-letter");
    crew.bus.publish_with_headers(subject.clone(), sized, vec![b'x'; big].into()).await?;
    let mut named = HeaderMap::new();
    named.insert(NATS_MESSAGE_ID, "nul-in-its-service");
    let nul = r#"{"id": "0193a0c4-5a8e-7f00-8000-000000000001", "service": "a\u0000b", "error": "down"}"#;
    crew.bus.publish_with_headers(subject, named, nul.into()).await?;

    let dlq = crew.bus.js.get_stream(crew.bus.subjects.dlq_stream()).await?;
    let mut letters = dlq
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            filter_subject: crew.bus.subjects.dlq("intake"),
            ..Default::default()
        })
        .await?
        .messages()
        .await?;
    let mut seen = std::collections::BTreeMap::new();
    for _ in 0..3 {
        let m = tokio::time::timeout(WAIT, letters.next()).await?.expect("a dead letter")?;
        let h = m.headers.clone().unwrap_or_default();
        let kept: Vec<String> = h.iter().map(|(k, _)| k.to_string()).collect();
        let truncated = h.get(pitcrew_runtime::bus::TRUNCATED_HEADER).map(|v| v.to_string());
        seen.insert(m.payload.len(), (kept, truncated, m.payload.clone()));
    }
    let (kept, truncated, payload) = &seen[&8];
    assert_eq!(&payload[..], b"not json");
    assert!(!kept.iter().any(|k| k.eq_ignore_ascii_case("Nats-Expected-Stream")), "{kept:?}");
    assert!(truncated.is_none());
    let (_, truncated, payload) = seen.values().next_back().expect("the large one");
    assert_eq!(truncated.as_deref(), Some(big.to_string().as_str()), "cut to fit, its full size said");
    assert!(payload.len() < big && payload.iter().all(|b| *b == b'x'), "{}", payload.len());
    assert!(seen.values().any(|(_, _, p)| std::str::from_utf8(p).is_ok_and(|p| p.contains(r"a\u0000b"))));

    // All three settled: nothing left unacknowledged or waiting at intake.
    let consumer_settled = tokio::time::timeout(WAIT, async {
        loop {
            let stream = crew.bus.js.get_stream(crew.bus.subjects.incidents_stream()).await?;
            let info = stream.consumer_info("intake").await?.clone();
            if info.num_ack_pending == 0 && info.num_pending == 0 {
                return anyhow::Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    consumer_settled.await??;
    let db = crew.db().await?;
    let id: uuid::Uuid = "0193a0c4-5a8e-7f00-8000-000000000001".parse()?;
    let refusals = texts(&db, "SELECT message FROM run_events WHERE run_id = $1 AND kind = 'rejected'", id).await;
    assert!(refusals.iter().any(|m| m.contains("a\u{FFFD}b")), "the NUL's refusal is stored: {refusals:?}");
    assert_eq!(dlq.get_info().await?.state.messages, 3, "one dead letter each, none again");
    crew.shutdown().await
}

/// A refused incident whose refusal reached the bus but not Postgres (a transient failure of
/// the insert) is refused again at its next delivery with the same event: its id holds one
/// `rejected` end, on the bus and in Postgres. Each delivery wrote one of its own (a second
/// end, which no deduplication drops).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_written_again_is_one_end_on_the_bus_and_in_postgres() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let text = marker_service(&env, "svc");
    let mut crew = Crew::start_in(env, &text, &[Stage::Intake]).await?;
    let db = crew.db().await?;
    db.batch_execute(
        "CREATE SEQUENCE refusals;
         CREATE FUNCTION lost_refusal() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF NEW.kind = 'rejected' AND nextval('refusals') = 1 THEN
             RAISE EXCEPTION 'terminating connection due to administrator command' USING ERRCODE = '57P01';
           END IF;
           RETURN NEW;
         END $$;
         CREATE TRIGGER lost_refusal BEFORE INSERT ON run_events FOR EACH ROW EXECUTE FUNCTION lost_refusal();",
    )
    .await?;
    let id: uuid::Uuid = "0193a0c4-5a8e-7f00-8000-0000000000aa".parse()?;
    let bad = format!(r#"{{"id": "{id}", "service": "no such service!", "error": "down"}}"#);
    crew.bus.client.publish(crew.bus.subjects.incidents_new(), bad.into()).await?;
    let stored = tokio::time::Instant::now() + WAIT;
    let sql = "SELECT count(*) FROM run_events WHERE run_id = $1 AND kind = 'rejected'";
    while count(&db, sql, id).await == 0 {
        anyhow::ensure!(tokio::time::Instant::now() < stored, "the refusal was never stored");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let tries: i64 = db.query_one("SELECT last_value FROM refusals", &[]).await?.get(0);
    assert_eq!(tries, 2, "the first insert failed, the second took");
    let on_bus = crew
        .bus
        .js
        .get_stream(crew.bus.subjects.events_stream())
        .await?
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            filter_subject: crew.bus.subjects.event(id, "rejected"),
            ..Default::default()
        })
        .await?
        .cached_info()
        .num_pending;
    assert_eq!(on_bus, 1, "one end on the bus");
    assert_eq!(count(&db, sql, id).await, 1);
    crew.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_incident_naming_an_open_run_leaves_that_run_alone() -> anyhow::Result<()> {
    let (mut crew, run) = held_before_execute().await?;
    // Whoever may publish incidents (the monitor's or the gateway's NATS user) names another
    // run in the header of an incident that does not decode.
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, "not-an-incident-1");
    headers.insert(pitcrew_runtime::bus::RUN_HEADER, run.to_string().as_str());
    crew.bus.publish_with_headers(crew.bus.subjects.incidents_new(), headers, "x".into()).await?;
    let dlq = crew.bus.js.get_stream(crew.bus.subjects.dlq_stream()).await?;
    let dead = tokio::time::timeout(WAIT, async {
        loop {
            if let Ok(m) = dlq.get_last_raw_message_by_subject(&crew.bus.subjects.dlq("intake")).await {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await?;
    assert_eq!(&dead.payload[..], b"x", "dead-lettered as it came");
    // The run it named is untouched: no error in its timeline, and it goes on to resolve.
    crew.shutdown().await?;
    crew.run(&Stage::ALL);
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    let db = crew.db().await?;
    let errors = count(&db, "SELECT count(*) FROM run_events WHERE run_id = $1 AND kind IN ('error', 'rejected')", run);
    assert_eq!(errors.await, 0, "nothing about the bad incident in the run's timeline");
    crew.shutdown().await
}

/// Publish bytes that are no run state to `stage`, naming `run` in the run header.
async fn publish_garbage(crew: &Crew, stage: Stage, run: uuid::Uuid, id: &str) -> anyhow::Result<()> {
    publish_as_state(crew, stage, run, id, "\u{1}not msgpack".into()).await
}

/// Publish `payload` to `stage` as a run state (MessagePack, `run` in the run header).
async fn publish_as_state(
    crew: &Crew,
    stage: Stage,
    run: uuid::Uuid,
    id: &str,
    payload: Vec<u8>,
) -> anyhow::Result<()> {
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, id);
    headers.insert(CONTENT_TYPE, MSGPACK);
    headers.insert(pitcrew_runtime::bus::RUN_HEADER, run.to_string().as_str());
    crew.bus.publish_with_headers(crew.bus.subjects.stage(stage), headers, payload.into()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_stage_message_is_dead_lettered_and_its_run_escalated() -> anyhow::Result<()> {
    let (mut crew, run) = held_before_execute().await?;
    publish_garbage(&crew, Stage::Verify, run, "garbage-1").await?;
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Escalated);
    assert!(end.message.contains("verify failed: bad run state: invalid MessagePack"), "{}", end.message);
    let dlq = crew.bus.js.get_stream(crew.bus.subjects.dlq_stream()).await?;
    let dead = dlq.get_last_raw_message_by_subject(&crew.bus.subjects.dlq("verify")).await?;
    assert!(std::str::from_utf8(&dead.payload)?.contains("not msgpack"));
    // The worker keeps serving: the next incident still resolves.
    crew.shutdown().await?;
    crew.run(&Stage::ALL);
    let next = crew.open_with("svc", "connection refused", Some("other".into())).await?;
    assert_eq!(crew.end(next).await?.kind, EventKind::Resolved);
    // The escalated run's plan, still queued for execute, never ran.
    crew.events.wait(run, |e| e.message.contains("already escalated: not executing"), WAIT).await?;
    let db = crew.db().await?;
    assert_eq!(count(&db, "SELECT count(*) FROM executions WHERE run_id = $1", run).await, 0);
    assert!(!std::path::Path::new(&crew.env.path("made-once")).exists());
    crew.shutdown().await
}

/// A poison message whose run Postgres refuses to escalate (a refusal, not an outage) is
/// settled once its dead letter is stored: every retry would be refused the same way, and each
/// stored another dead letter once past the bus's duplicate window. The run is left as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_whose_run_cannot_be_escalated_is_dead_lettered_once_and_settled() -> anyhow::Result<()> {
    let (mut crew, run) = held_before_execute().await?;
    let db = crew.db().await?;
    db.batch_execute(&format!(
        "CREATE FUNCTION refuse_escalation() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.id = '{run}' AND NEW.stage = 'escalate' THEN RAISE EXCEPTION 'no escalation here'; END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER refuse_escalation BEFORE UPDATE ON runs FOR EACH ROW EXECUTE FUNCTION refuse_escalation();"
    ))
    .await?;
    publish_garbage(&crew, Stage::Verify, run, "garbage-refused").await?;
    let stages = crew.bus.js.get_stream(crew.bus.subjects.stages_stream()).await?;
    let verify = crew.bus.subjects.stage(Stage::Verify);
    tokio::time::timeout(WAIT, async {
        while stages.get_last_raw_message_by_subject(&verify).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .map_err(|_| anyhow::anyhow!("the poison message was never settled"))?;
    let dlq = crew.bus.js.get_stream(crew.bus.subjects.dlq_stream()).await?;
    let dead = dlq.get_last_raw_message_by_subject(&crew.bus.subjects.dlq("verify")).await?;
    assert!(std::str::from_utf8(&dead.payload)?.contains("not msgpack"));
    assert_eq!(dlq.get_info().await?.state.messages, 1, "dead-lettered once");
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1", &[&run]).await?.get(0);
    assert_eq!(status, "open", "left as it is, for a human");
    crew.shutdown().await
}

/// Two copies of an execute message at once (a redelivery while the first still works, in
/// another process): one runs the plan's first command; the other takes the target after it,
/// finds the service passing its check (that command fixed it) after another run remediated
/// it, and decides to skip the plan. It must not skip the rest of a plan another copy started
/// (the plan would be left half run, recorded as skipped): it decides again, finds the attempt
/// started, and runs the rest. The database plays the first copy: a trigger records the first
/// command as run when the target is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_decided_to_skip_a_plan_another_copy_started_decides_again() -> anyhow::Result<()> {
    let (mut crew, run) = held_before_execute().await?;
    let other = crew.open_with("svc", "svc needs a directory", Some("other".into())).await?;
    crew.events.wait(other, |e| e.kind == EventKind::Policy, WAIT).await?;
    crew.shutdown().await?;
    let db = crew.db().await?;
    // The other run held the target after this run opened, and is done with it.
    db.execute("UPDATE runs SET status = 'resolved', updated_at = now() WHERE id = $1", &[&other]).await?;
    db.execute("INSERT INTO target_locks (service, host, run_id, attempt) VALUES ('svc', 'local', $1, 1)", &[&other])
        .await?;
    let first = format!("mkdir {}", crew.env.path("made-once"));
    db.batch_execute(&format!(
        "CREATE FUNCTION first_copy() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           INSERT INTO executions (run_id, attempt, idx, command, host, worker, finished_at, status, exit_code,
                                   output, claim, started, gone_by)
           VALUES (NEW.run_id, 1, 0, '{first}', 'local', 'first-copy', now(), 'succeeded', 0, '',
                   gen_random_uuid(), true, now())
           ON CONFLICT DO NOTHING;
           RETURN NEW;
         END $$;
         CREATE TRIGGER first_copy AFTER INSERT OR UPDATE ON target_locks FOR EACH ROW
           WHEN (NEW.run_id = '{run}') EXECUTE FUNCTION first_copy();"
    ))
    .await?;
    // The first command fixed the service: its check passes now.
    std::fs::write(crew.env.path("svc-healthy"), "")?;
    crew.run(&[Stage::Execute, Stage::Verify, Stage::Report, Stage::Escalate]);
    let end = crew.end(run).await?;
    let sql = "SELECT stage || ': ' || message FROM run_events WHERE run_id = $1 ORDER BY seq, idx";
    let timeline = texts(&db, sql, run).await;
    assert_eq!(end.kind, EventKind::Resolved, "{timeline:#?}");
    let statuses = texts(&db, "SELECT status FROM executions WHERE run_id = $1 ORDER BY idx", run).await;
    assert_eq!(statuses, ["succeeded", "succeeded"], "the rest of the started plan ran: {timeline:#?}");
    assert!(timeline.iter().any(|l| l.contains("execute: attempt 1, delivery")), "decided again: {timeline:#?}");
    crew.shutdown().await
}

/// A poison message at escalate closes its run escalated, and the run's end reaches the bus
/// as the `escalated` event its followers wait for (it got only an error event: `pitcrew
/// watch` and the gateway's streams waited for an end that never came).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_at_escalate_still_ends_its_run_on_the_bus() -> anyhow::Result<()> {
    let (mut crew, run) = held_before_execute().await?;
    publish_garbage(&crew, Stage::Escalate, run, "garbage-at-escalate").await?;
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Escalated, "{}", end.message);
    assert!(end.message.contains("escalate failed: bad run state: invalid MessagePack"), "{}", end.message);
    let db = crew.db().await?;
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1", &[&run]).await?.get(0);
    assert_eq!(status, "escalated");
    assert_eq!(count(&db, "SELECT count(*) FROM run_events WHERE run_id = $1 AND kind = 'escalated'", run).await, 1);
    assert_eq!(crew.dead_letters().await?, 1, "the poison message itself is dead-lettered");
    crew.shutdown().await
}

/// Counts the messages it is handed and acks them.
struct Counting(Arc<AtomicUsize>);

impl MessageHandler for Counting {
    fn name(&self) -> String {
        "counting".into()
    }

    fn handle(
        self: Arc<Self>,
        _msg: Arc<async_nats::jetstream::Message>,
    ) -> futures::future::BoxFuture<'static, Disposition> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Box::pin(async { Disposition::Ack })
    }
}

/// `consume` running in a task until the returned sender is used (or dropped).
fn consuming<H: MessageHandler>(
    client: async_nats::Client,
    consumer: async_nats::jetstream::consumer::PullConsumer,
    settings: pitcrew_runtime::config::StageSettings,
    handler: Arc<H>,
    drain: Duration,
) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let stopping = async {
        let _ = stopped.await;
    };
    (stop, tokio::spawn(consume(client, consumer, None, settings, handler, stopping, drain)))
}

/// A bus of its own (config `extra`) with `n` messages waiting on report's subject, and
/// report's consumer (the environment must outlive the bus: it runs the nats-server).
async fn waiting_on_report(
    extra: &str,
    n: usize,
) -> anyhow::Result<(
    TestEnv,
    pitcrew_runtime::Config,
    pitcrew_runtime::Bus,
    async_nats::jetstream::consumer::PullConsumer,
)> {
    let env = TestEnv::start().await?;
    let cfg = pitcrew_runtime::Config::from_toml(&env.config_toml(extra))?;
    let bus = pitcrew_runtime::Bus::connect(&cfg).await?;
    bus.ensure_streams().await?;
    for i in 0..n {
        let mut headers = HeaderMap::new();
        headers.insert(NATS_MESSAGE_ID, format!("waiting-{i}").as_str());
        bus.js.publish_with_headers(bus.subjects.stage(Stage::Report), headers, "x".into()).await?.await?;
    }
    let consumer = bus.stage_consumer(Stage::Report, cfg.stage_settings(Stage::Report)).await?;
    Ok((env, cfg, bus, consumer))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_told_to_stop_pulls_nothing_more() -> anyhow::Result<()> {
    const WAITING: usize = 50;
    let (_env, cfg, bus, consumer) = waiting_on_report("", WAITING).await?;
    let settings = cfg.stage_settings(Stage::Report);
    let handled = Arc::new(AtomicUsize::new(0));
    // Told to stop before it starts, again and again: it must never pull. (With an unbiased
    // select between a free permit and the shutdown, a stopping worker went on pulling in
    // about one round in four.)
    for _ in 0..20 {
        let handler = Arc::new(Counting(handled.clone()));
        consume(
            bus.client.clone(),
            consumer.clone(),
            None,
            settings,
            handler,
            std::future::ready(()),
            Duration::from_secs(5),
        )
        .await;
    }
    assert_eq!(handled.load(Ordering::SeqCst), 0, "a stopping consumer pulled messages");
    let info = consumer.clone().info().await?.clone();
    assert_eq!((info.num_pending, info.num_ack_pending), (WAITING as u64, 0), "{info:?}");
    // The same consumer, not stopping, takes every waiting message.
    let (stop, running) =
        consuming(bus.client.clone(), consumer, settings, Arc::new(Counting(handled.clone())), Duration::from_secs(5));
    let deadline = tokio::time::Instant::now() + WAIT;
    while handled.load(Ordering::SeqCst) < WAITING {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "only {} handled", handled.load(Ordering::SeqCst));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    running.await?;
    assert_eq!(handled.load(Ordering::SeqCst), WAITING);
    Ok(())
}

/// A message that arrives after the signal, while the worker's pull still waits for one (an
/// idle pull waits up to a second), is handed back at once, not started: a stopping worker
/// began handlers (model calls, commands) its drain could then cut short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_arrives_after_the_signal_is_handed_back_not_started() -> anyhow::Result<()> {
    // A message neither settled nor handed back would come back only after a minute.
    let (_env, cfg, bus, consumer) = waiting_on_report("[stage.report]\nack_wait_secs = 60\n", 0).await?;
    let settings = cfg.stage_settings(Stage::Report);
    let handled = Arc::new(AtomicUsize::new(0));
    let (stop, running) = consuming(
        bus.client.clone(),
        consumer.clone(),
        settings,
        Arc::new(Counting(handled.clone())),
        Duration::from_secs(5),
    );
    // Its pull waits on the empty stream; the signal comes, then a message.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stop.send(());
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, "after-the-signal");
    bus.js.publish_with_headers(bus.subjects.stage(Stage::Report), headers, "x".into()).await?.await?;
    tokio::time::timeout(WAIT, running).await??;
    assert_eq!(handled.load(Ordering::SeqCst), 0, "a stopping worker started a message");
    // Handed back: the next worker takes it at once.
    let (stop, running) =
        consuming(bus.client.clone(), consumer, settings, Arc::new(Counting(handled.clone())), Duration::from_secs(5));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while handled.load(Ordering::SeqCst) < 1 {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "the message was not handed back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    running.await?;
    Ok(())
}

/// A pull the server answers at once with nothing is not repeated at once. The server does
/// so ("408 Requests Pending") while it holds a message it cannot hand out (the consumer's
/// ack-pending limit is reached) and another worker's pull waits for more than it holds: the
/// worker pulled again and again, as fast as the round trip allowed, for as long as that
/// lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_answered_at_once_with_nothing_is_not_repeated_at_once() -> anyhow::Result<()> {
    let (_env, cfg, bus, consumer) = waiting_on_report("[stage.report]\nmax_ack_pending = 1\n", 2).await?;
    let settings = cfg.stage_settings(Stage::Report);
    // Another worker's pull takes the first message, holds it (the limit of one is reached:
    // the second cannot be handed out) and waits for more.
    let mut other = consumer.batch().max_messages(10).expires(Duration::from_secs(30)).messages().await?;
    let held = other.next().await.expect("the first message").map_err(|e| anyhow::anyhow!("{e}"))?;
    // Every pull request from here on, as the server receives them.
    let mut pulls = bus.client.subscribe("$JS.API.CONSUMER.MSG.NEXT.>").await?;
    bus.client.flush().await?;
    let handled = Arc::new(AtomicUsize::new(0));
    let (stop, running) =
        consuming(bus.client.clone(), consumer, settings, Arc::new(Counting(handled.clone())), Duration::from_secs(5));
    let watched = Duration::from_secs(2);
    let mut seen = 0usize;
    let until = tokio::time::Instant::now() + watched;
    while let Ok(Some(_)) = tokio::time::timeout_at(until, pulls.next()).await {
        seen += 1;
    }
    let _ = stop.send(());
    running.await?;
    held.ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
    assert!(seen > 0, "the worker pulled");
    // A pause of 100 ms after each: about 20 in 2 s (it spun thousands of times without it).
    assert!(seen <= 40, "{seen} pulls in {watched:?}");
    assert_eq!(handled.load(Ordering::SeqCst), 0, "the held message blocks the other");
    Ok(())
}

/// Records the payload of every message it is handed. Stalling, it never finishes one that
/// says "stuck" and acks the others after a moment; otherwise it acks everything at once.
struct Recording {
    seen: Arc<std::sync::Mutex<Vec<String>>>,
    stalling: bool,
    /// Set when a stuck handler is dropped (stopped).
    dropped: Arc<std::sync::atomic::AtomicBool>,
}

/// Sets its flag when dropped.
struct OnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl MessageHandler for Recording {
    fn name(&self) -> String {
        "recording".into()
    }

    fn handle(
        self: Arc<Self>,
        msg: Arc<async_nats::jetstream::Message>,
    ) -> futures::future::BoxFuture<'static, Disposition> {
        let payload = String::from_utf8_lossy(&msg.payload).to_string();
        self.seen.lock().unwrap().push(payload.clone());
        Box::pin(async move {
            if self.stalling {
                if payload == "stuck" {
                    let _guard = OnDrop(self.dropped.clone());
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Disposition::Ack
        })
    }
}

/// A stopping worker lets what it holds finish within its drain deadline; what is still
/// running then is stopped and handed back at once, so another worker takes it now instead of
/// after its ack wait (30 s here); what finished is not delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_past_its_drain_deadline_hands_back_what_it_holds_at_once() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let cfg = pitcrew_runtime::Config::from_toml(&env.config_toml("[stages]\ndrain_secs = 1\n"))?;
    assert_eq!(cfg.drain(), Duration::from_secs(1));
    let bus = pitcrew_runtime::Bus::connect(&cfg).await?;
    bus.ensure_streams().await?;
    for body in ["quick", "stuck"] {
        let mut headers = HeaderMap::new();
        headers.insert(NATS_MESSAGE_ID, body);
        bus.js.publish_with_headers(bus.subjects.stage(Stage::Report), headers, body.into()).await?.await?;
    }
    let settings = cfg.stage_settings(Stage::Report);
    assert_eq!(settings.ack_wait, Duration::from_secs(30));
    let consumer = bus.stage_consumer(Stage::Report, settings).await?;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handler = Arc::new(Recording { seen: seen.clone(), stalling: true, dropped: dropped.clone() });
    let (stop, running) = consuming(bus.client.clone(), consumer.clone(), settings, handler, cfg.drain());
    let deadline = tokio::time::Instant::now() + WAIT;
    while seen.lock().unwrap().len() < 2 {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "handed only {:?}", seen.lock().unwrap());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let asked = tokio::time::Instant::now();
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), running).await??;
    let took = asked.elapsed();
    assert!(took >= Duration::from_secs(1), "returned {took:?} after shutdown, before its drain deadline");

    // Another worker: the stuck message comes to it well within its ack wait, the quick one never.
    let again = Arc::new(std::sync::Mutex::new(Vec::new()));
    assert!(dropped.load(Ordering::SeqCst), "the stuck handler was stopped before its message was handed back");
    let handler = Arc::new(Recording { seen: again.clone(), stalling: false, dropped: Default::default() });
    let (stop, running) = consuming(bus.client.clone(), consumer.clone(), settings, handler, cfg.drain());
    let handed = tokio::time::Instant::now();
    while again.lock().unwrap().is_empty() {
        anyhow::ensure!(handed.elapsed() < Duration::from_secs(5), "the stuck message was not handed back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Time for a wrong redelivery of the quick one to show.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = stop.send(());
    running.await?;
    assert_eq!(*again.lock().unwrap(), vec!["stuck".to_string()]);
    let info = consumer.clone().info().await?.clone();
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0), "{info:?}");
    Ok(())
}

/// A step that keeps failing for a reason outside Postgres (here the model's endpoint refuses
/// every connection) is still given up on: past its limits it gets one more try, then it is
/// dead-lettered with both reasons and its run escalated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_failing_past_its_limits_is_tried_once_more_then_dead_lettered() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let text = format!(
        "[stages]\nmax_deliveries = 2\npoison_after_secs = 1\n\
         [reasoning]\nprovider = \"openai\"\n[reasoning.openai]\nbase_url = \"http://127.0.0.1:{closed}/v1\"\n\
         model = \"m\"\napi_key_env = \"\"\nmax_retries = 0\ntimeout_secs = 1\n{}",
        marker_service(&env, "svc")
    );
    let mut crew = Crew::start_in(env, &text, &Stage::ALL).await?;
    let run = crew.open("svc", "connection refused").await?;
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Escalated, "{}", end.message);
    assert!(
        end.message.contains("without success (limits: 2 deliveries, 1 s); the last try:")
            && end.message.contains("cannot reach http://127.0.0.1"),
        "{}",
        end.message
    );
    let dlq = crew.bus.js.get_stream(crew.bus.subjects.dlq_stream()).await?;
    dlq.get_last_raw_message_by_subject(&crew.bus.subjects.dlq("diagnose")).await?;
    crew.shutdown().await
}

/// A closing step delivered again after its commit landed and its events were published (its
/// worker died before the ack): the redelivery starts its timeline with a "delivery 2" line,
/// yet its terminal event keeps its id, so the bus holds the run's end once (it held it twice,
/// under two ids, and whoever follows the bus saw the run end twice). A third delivery, past
/// the bus's duplicate window, finds the end on the bus and does not publish it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closing_step_delivered_again_ends_its_run_once_on_the_bus() -> anyhow::Result<()> {
    let (crew, state, consumer, runner) = common::at_escalate().await?;
    let events = crew.bus.js.get_stream(crew.bus.subjects.events_stream()).await?;
    for delivery in 1..=3 {
        if delivery == 3 {
            // The third comes after the bus's duplicate window (shortened for the test: 2 min
            // in production) has forgotten the first publish.
            let mut config = events.cached_info().config.clone();
            config.duplicate_window = Duration::from_millis(500);
            crew.bus.js.update_stream(config).await?;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let next = consumer.fetch().max_messages(1).expires(Duration::from_secs(5)).messages().await?.next().await;
        let msg = next.ok_or_else(|| anyhow::anyhow!("delivery {delivery} never came"))?;
        let msg = Arc::new(msg.map_err(|e| anyhow::anyhow!("{e}"))?);
        assert_eq!(msg.info().map_err(|e| anyhow::anyhow!("{e}"))?.delivered, delivery);
        // Handled, never acked: the worker died first.
        assert_eq!(runner.clone().handle(msg).await, Disposition::Ack, "delivery {delivery}");
    }
    let mut ends = events.info_with_subjects(crew.bus.subjects.event(state.run_id, "escalated")).await?;
    let published: Vec<(String, usize)> = ends.by_ref().filter_map(|r| async move { r.ok() }).collect().await;
    assert_eq!(published.len(), 1, "{published:?}");
    assert_eq!(published[0].1, 1, "the run's end is on the bus once: {published:?}");
    let db = crew.db().await?;
    assert_eq!(
        count(&db, "SELECT count(*) FROM run_events WHERE run_id = $1 AND kind = 'escalated'", state.run_id).await,
        1
    );
    Ok(())
}

/// A crew running no stage, its deps for `runner::apply`, and a run opened and moved to `step`.
async fn run_at(step: Stage) -> anyhow::Result<(Crew, pitcrew_runtime::Deps, pitcrew_model::RunState)> {
    use pitcrew_model::{Incident, RunState};
    use pitcrew_runtime::store::{OpenRun, RunStatus};
    let env = TestEnv::start().await?;
    let text = marker_service(&env, "svc");
    let crew = Crew::start_in(env, &text, &[]).await?;
    let deps = common::deps_of(&crew)?;
    let mut state = RunState::new(uuid::Uuid::now_v7(), Incident::new("svc", "down"));
    assert_eq!(crew.store.open_run(&state).await?, OpenRun::Created);
    state.advance(step);
    assert!(crew.store.commit_transition_with(&state, RunStatus::Open, &[], vec![]).await?);
    Ok((crew, deps, state))
}

/// The last step's commit landed but publishing its events failed: the redelivered step finds
/// the run closed, by itself, and publishes the events then, so whoever follows the run on
/// the bus (`pitcrew watch`, live streams) still sees how it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closing_step_whose_publish_failed_publishes_its_events_when_redelivered() -> anyhow::Result<()> {
    use pitcrew_model::{Outcome, RunEvent};
    use pitcrew_runtime::store::RunStatus;
    use pitcrew_runtime::Transition;
    let (mut crew, deps, state) = run_at(Stage::Report).await?;
    let end = RunEvent {
        run_id: state.run_id,
        seq: state.seq,
        index: 0,
        stage: Stage::Report,
        kind: EventKind::Resolved,
        message: "resolved".into(),
        data: serde_json::Value::Null,
        worker: "test".into(),
        at: chrono::Utc::now(),
    };
    // The first delivery: committed, and then its publish failed (nothing reached the bus).
    let mut closed = state.clone();
    closed.outcome = Some(Outcome::Resolved);
    assert!(crew.store.commit_transition_with(&closed, RunStatus::Resolved, std::slice::from_ref(&end), vec![]).await?);
    // The redelivery.
    pitcrew_runtime::runner::apply(
        &crew.bus,
        &deps,
        state.clone(),
        Transition::Done(Outcome::Resolved),
        vec![end],
        vec![],
    )
    .await?;
    let seen = crew.events.terminal(state.run_id, Duration::from_secs(10)).await?;
    assert_eq!(seen.kind, EventKind::Resolved);
    // A step of a run closed by another step publishes nothing.
    let mut other = state.clone();
    other.step = Stage::Escalate;
    let late = RunEvent { kind: EventKind::Escalated, stage: Stage::Escalate, index: 1, ..seen.clone() };
    pitcrew_runtime::runner::apply(&crew.bus, &deps, other, Transition::Done(Outcome::Escalated), vec![late], vec![])
        .await?;
    let mut stream = crew.bus.js.get_stream(crew.bus.subjects.events_stream()).await?;
    assert_eq!(stream.info().await?.state.messages, 1, "only the closing step's own event");
    crew.shutdown().await
}

/// A step delivered again after its commit landed, deciding otherwise this time (verify: the
/// check passed, then failed): the first transition stands, and its state is sent on again
/// (its publish failed here), never the second's. The second overwrote the run's row at the
/// same seq, and its message went out unless the bus took it for a duplicate of the first:
/// the row and the message in flight disagreed, or the run forked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_redelivered_after_its_commit_keeps_the_transition_it_committed() -> anyhow::Result<()> {
    use pitcrew_model::RunState;
    use pitcrew_runtime::store::RunStatus;
    use pitcrew_runtime::Transition;
    let (mut crew, deps, state) = run_at(Stage::Verify).await?;
    // The first delivery: recovered, on to report; committed, then its publish failed.
    let recovered = pitcrew_model::RunEvent {
        run_id: state.run_id,
        seq: state.seq,
        index: 0,
        stage: Stage::Verify,
        kind: EventKind::Verification,
        message: "recovered: check passed".into(),
        data: serde_json::Value::Null,
        worker: "test".into(),
        at: chrono::Utc::now(),
    };
    let mut first = state.clone();
    first.advance(Stage::Report);
    assert!(
        crew.store.commit_transition_with(&first, RunStatus::Open, std::slice::from_ref(&recovered), vec![]).await?
    );
    assert!(!crew.bus.holds_event(&recovered).await?);
    // The redelivery: not recovered now, on to a next attempt.
    let mut second = state.clone();
    second.attempt += 1;
    pitcrew_runtime::runner::apply(&crew.bus, &deps, second, Transition::To(Stage::Diagnose), vec![], vec![]).await?;
    let db = crew.db().await?;
    let row = db.query_one("SELECT stage, seq, attempt FROM runs WHERE id = $1", &[&state.run_id]).await?;
    let row: (String, i32, i32) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(row, ("report".to_string(), 2, 1), "the committed transition stands");
    let stream = crew.bus.js.get_stream(crew.bus.subjects.stages_stream()).await?;
    let sent = stream.get_last_raw_message_by_subject(&crew.bus.subjects.stage(Stage::Report)).await?;
    let sent: RunState = pitcrew_model::codec::decode(Some(MSGPACK), &sent.payload)?;
    assert_eq!((sent.run_id, sent.seq, sent.step), (state.run_id, 2, Stage::Report), "sent on again");
    assert!(crew.bus.holds_event(&recovered).await?, "with the events its step stored");
    assert!(
        stream.get_last_raw_message_by_subject(&crew.bus.subjects.stage(Stage::Diagnose)).await.is_err(),
        "the redelivery's own transition never went out"
    );
    crew.shutdown().await
}

/// A step delivered again after its commit landed, taking the same transition with another
/// content this time (a model answers otherwise: a second diagnosis), while the first's
/// message is on the bus: the committed state stands and the redelivery's is dropped. The
/// second overwrote the run's row at the same seq, and the bus dropped its message as a
/// duplicate of the first: the row said one diagnosis, the next stage worked on the other
/// (and past the bus's duplicate window both went on, the run forked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_redelivered_after_its_commit_with_another_answer_keeps_the_committed_one() -> anyhow::Result<()> {
    use pitcrew_model::{Diagnosis, RunState};
    use pitcrew_runtime::Transition;
    let (mut crew, deps, state) = run_at(Stage::Diagnose).await?;
    let diagnosed = |summary: &str| {
        let mut s = state.clone();
        s.diagnosis_log.push(Diagnosis {
            attempt: 1,
            summary: summary.into(),
            source: "model".into(),
            grounds: vec![],
        });
        s
    };
    pitcrew_runtime::runner::apply(
        &crew.bus,
        &deps,
        diagnosed("first answer"),
        Transition::To(Stage::Plan),
        vec![],
        vec![],
    )
    .await?;
    pitcrew_runtime::runner::apply(
        &crew.bus,
        &deps,
        diagnosed("second answer"),
        Transition::To(Stage::Plan),
        vec![],
        vec![],
    )
    .await?;
    let db = crew.db().await?;
    let sql = "SELECT state->'diagnosis_log'->0->>'summary' FROM runs WHERE id = $1";
    assert_eq!(common::texts(&db, sql, state.run_id).await, ["first answer"], "the committed state stands");
    let stream = crew.bus.js.get_stream(crew.bus.subjects.stages_stream()).await?;
    let sent = stream.get_last_raw_message_by_subject(&crew.bus.subjects.stage(Stage::Plan)).await?;
    let sent: RunState = pitcrew_model::codec::decode(Some(MSGPACK), &sent.payload)?;
    assert_eq!(sent.diagnosis().map(|d| d.summary.as_str()), Some("first answer"), "what plan works on");
    assert_eq!(stream.get_info().await?.state.messages, 1, "one message for plan");
    crew.shutdown().await
}

/// A run at its approval step with a plan the gate holds for a human (`kill -9`), and the
/// request that step makes for it.
async fn at_approval_of_a_critical_plan(
) -> anyhow::Result<(Crew, pitcrew_runtime::Deps, pitcrew_model::RunState, pitcrew_model::ApprovalRequest)> {
    let (crew, deps, mut state) = run_at(Stage::Approval).await?;
    let commands = vec!["kill -9 42".into()];
    state.plan = Some(pitcrew_model::Plan { attempt: 1, commands, rationale: String::new(), source: "p".into() });
    let req = pitcrew_approval::gate::request(&state, "local", "kill-9", "SIGKILL loses state", 600, 1);
    Ok((crew, deps, state, req))
}

/// The approval step delivered again after its commit landed, parking this time where the
/// first delivery went on to execute (two processes of the stage with different policies,
/// one of them mid-change): the committed transition stands and is sent on (its publish
/// failed here). The redelivery's refused park was taken as stale, and the run sat at
/// execute with no message to move it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_step_that_parks_after_another_delivery_went_on_sends_that_one_on() -> anyhow::Result<()> {
    use pitcrew_model::RunState;
    use pitcrew_runtime::store::RunStatus;
    use pitcrew_runtime::Transition;
    let (mut crew, deps, state, req) = at_approval_of_a_critical_plan().await?;
    let mut first = state.clone();
    first.advance(Stage::Execute);
    assert!(crew.store.commit_transition_with(&first, RunStatus::Open, &[], vec![]).await?);
    pitcrew_runtime::runner::apply(&crew.bus, &deps, state.clone(), Transition::Park(Box::new(req)), vec![], vec![])
        .await?;
    let db = crew.db().await?;
    let row = db.query_one("SELECT stage, status FROM runs WHERE id = $1", &[&state.run_id]).await?;
    assert_eq!((row.get::<_, String>(0), row.get::<_, String>(1)), ("execute".into(), "open".into()));
    let stream = crew.bus.js.get_stream(crew.bus.subjects.stages_stream()).await?;
    let sent = stream.get_last_raw_message_by_subject(&crew.bus.subjects.stage(Stage::Execute)).await?;
    let sent: RunState = pitcrew_model::codec::decode(Some(MSGPACK), &sent.payload)?;
    assert_eq!((sent.run_id, sent.seq, sent.step), (state.run_id, first.seq, Stage::Execute), "sent on");
    let requests: i64 =
        db.query_one("SELECT count(*) FROM approvals WHERE run_id = $1", &[&state.run_id]).await?.get(0);
    assert_eq!(requests, 0, "the refused park leaves no pending request behind");
    crew.shutdown().await
}

/// The other order: the first delivery of the approval step parked the run (committed, then
/// its request's publish failed), and a redelivery, in a process whose policy lets the plan
/// run, would go on. The park stands, and its request is sent again: it was taken as stale,
/// and the request never reached the approvers; the run waited until its approval expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_step_that_goes_on_after_another_delivery_parked_sends_that_request() -> anyhow::Result<()> {
    use pitcrew_model::{ApprovalRequest, RunEvent};
    use pitcrew_runtime::store::{Record, RunStatus};
    use pitcrew_runtime::Transition;
    let (mut crew, deps, state, req) = at_approval_of_a_critical_plan().await?;
    let asked = RunEvent {
        run_id: state.run_id,
        seq: state.seq,
        index: 0,
        stage: Stage::Approval,
        kind: EventKind::ApprovalRequested,
        message: format!("waiting for approval of plan {}", req.plan_hash),
        data: serde_json::to_value(&req)?,
        worker: "test".into(),
        at: chrono::Utc::now(),
    };
    let mut parked = state.clone();
    parked.seq += 1;
    let records = vec![Record::Approval(Box::new(req.clone()))];
    assert!(
        crew.store
            .commit_transition_with(&parked, RunStatus::WaitingApproval, std::slice::from_ref(&asked), records)
            .await?
    );
    // The redelivery goes on, twice (a second redelivery sends nothing twice).
    for _ in 0..2 {
        pitcrew_runtime::runner::apply(&crew.bus, &deps, state.clone(), Transition::To(Stage::Execute), vec![], vec![])
            .await?;
    }
    let db = crew.db().await?;
    let row = db.query_one("SELECT stage, status FROM runs WHERE id = $1", &[&state.run_id]).await?;
    assert_eq!((row.get::<_, String>(0), row.get::<_, String>(1)), ("approval".into(), "waiting_approval".into()));
    let subject = crew.bus.subjects.approval_requested(state.run_id);
    let mut approvals = crew.bus.js.get_stream(crew.bus.subjects.approvals_stream()).await?;
    let sent = approvals.get_last_raw_message_by_subject(&subject).await?;
    let sent: ApprovalRequest = serde_json::from_slice(&sent.payload)?;
    assert_eq!((sent.run_id, &sent.plan_hash, sent.attempt), (req.run_id, &req.plan_hash, req.attempt), "the request");
    assert_eq!(approvals.info().await?.state.messages, 1, "sent once");
    let events = crew.bus.js.get_stream(crew.bus.subjects.events_stream()).await?;
    let told =
        events.get_last_raw_message_by_subject(&crew.bus.subjects.event(state.run_id, "approval_requested")).await?;
    assert!(!told.payload.is_empty(), "its event went out");
    let stages = crew.bus.js.get_stream(crew.bus.subjects.stages_stream()).await?;
    let execute = stages.get_last_raw_message_by_subject(&crew.bus.subjects.stage(Stage::Execute)).await;
    assert!(execute.is_err(), "nothing went on to execute");
    crew.shutdown().await
}

/// During a rolling upgrade a worker may pull a run state a newer worker wrote: it leaves it
/// for one (no dead letter, no escalation of a healthy run), whether the newer layout still
/// decodes or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_state_from_a_newer_worker_is_left_for_one() -> anyhow::Result<()> {
    let (mut crew, run) = held_before_execute().await?;
    crew.shutdown().await?;
    crew.run(&[Stage::Verify]);
    let db = crew.db().await?;
    let stored: serde_json::Value = db.query_one("SELECT state FROM runs WHERE id = $1", &[&run]).await?.get(0);
    let mut newer = stored.clone();
    newer["version"] = serde_json::json!(pitcrew_model::RUN_STATE_VERSION + 1);
    newer["step"] = serde_json::json!("verify");
    let mut unreadable = serde_json::json!({ "version": pitcrew_model::RUN_STATE_VERSION + 1, "layout": "v9" });
    unreadable["run_id"] = serde_json::json!(run);
    for (i, state) in [newer, unreadable].into_iter().enumerate() {
        let payload = pitcrew_model::codec::to_msgpack(&state);
        publish_as_state(&crew, Stage::Verify, run, &format!("newer-{i}"), payload).await?;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1", &[&run]).await?.get(0);
    assert_eq!(status, "open", "a healthy run is not escalated");
    assert_eq!(crew.dead_letters().await?, 0, "nothing dead-lettered");
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = crew
        .bus
        .js
        .get_stream(crew.bus.subjects.stages_stream())
        .await?
        .get_consumer("verify")
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let info = consumer.info().await?;
    assert_eq!(info.num_ack_pending + info.num_pending as usize, 2, "both wait for a newer worker: {info:?}");
    crew.shutdown().await
}

/// A state from a newer worker that no worker reading it took within the stage's limits (an
/// upgrade rolled back) goes to the DLQ for a human: it was handed back every 30 s for as long
/// as the stream kept it (forever). Its run is left as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_state_from_a_newer_worker_none_took_is_dead_lettered_past_the_limits() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let text = format!("[stages]\nmax_deliveries = 1\npoison_after_secs = 1\n{}", marker_service(&env, "svc"));
    let mut crew = Crew::start_in(env, &text, &[Stage::Verify]).await?;
    let run = uuid::Uuid::now_v7();
    let newer = serde_json::json!({ "version": pitcrew_model::RUN_STATE_VERSION + 1, "run_id": run, "step": "verify" });
    let payload = pitcrew_model::codec::to_msgpack(&newer);
    publish_as_state(&crew, Stage::Verify, run, "newer-rolled-back", payload).await?;
    // Handed back for 30 s once, then past both limits.
    let dlq = crew.bus.js.get_stream(crew.bus.subjects.dlq_stream()).await?;
    let subject = crew.bus.subjects.dlq("verify");
    let dead = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Ok(dead) = dlq.get_last_raw_message_by_subject(&subject).await {
                return dead;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .map_err(|_| anyhow::anyhow!("never dead-lettered"))?;
    let why = dead.headers.get(pitcrew_runtime::bus::ERROR_HEADER).map(|v| v.to_string()).unwrap_or_default();
    assert!(why.contains("newer") && why.contains("no worker that reads it took it"), "{why}");
    let stages = crew.bus.js.get_stream(crew.bus.subjects.stages_stream()).await?;
    emptied(&stages).await?;
    crew.shutdown().await
}

/// The incidents stream keeps an incident until intake took it, however long that is, and
/// however many come meanwhile: a full stream refuses the next one (its publisher is told)
/// rather than delete one not taken yet. A stream an older pitcrew made (kept 7 days, the
/// oldest dropped when full) is brought to that, with the incidents it holds, unless others
/// read it too, and so is a new one, which is made with intake's consumer before any intake
/// process runs: without one, it would keep nothing. A consumer deleted by hand is made again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_incidents_stream_keeps_an_incident_until_intake_took_it() -> anyhow::Result<()> {
    use async_nats::jetstream::{consumer, stream};
    use pitcrew_model::Incident;
    let (_env, bus) = bare_bus().await?;
    let name = bus.subjects.incidents_stream();
    bus.js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![bus.subjects.incidents_new()],
            retention: stream::RetentionPolicy::Limits,
            max_age: Duration::from_secs(7 * 86_400),
            max_bytes: 1 << 30,
            discard: stream::DiscardPolicy::Old,
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await?;
    let waiting = Incident::new("svc", "published before the upgrade, not taken yet");
    bus.open_incident(&waiting).await?;
    bus.ensure_streams().await?;
    let mut incidents = bus.js.get_stream(&name).await?;
    let info = incidents.info().await?.clone();
    assert_eq!(info.config.retention, stream::RetentionPolicy::Interest, "kept while intake wants it");
    assert_eq!((info.config.discard, info.config.max_age), (stream::DiscardPolicy::New, Duration::ZERO));
    assert_eq!(info.state.messages, 1, "the incident not taken yet is still there");
    let mut intake: consumer::PullConsumer =
        incidents.get_consumer("intake").await.map_err(|e| anyhow::anyhow!("{e}"))?;
    assert_eq!(intake.info().await?.num_pending, 1, "waiting for intake");

    // Taken: gone from the stream.
    let mut batch = intake.fetch().max_messages(1).messages().await?;
    let taken = batch.next().await.expect("the incident").map_err(|e| anyhow::anyhow!("{e}"))?;
    taken.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
    tokio::time::timeout(WAIT, async {
        while incidents.info().await.map(|i| i.state.messages).unwrap_or(1) > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await?;

    // A new stream, made with intake's consumer: an incident published before any intake
    // process ran waits for one.
    bus.js.delete_stream(&name).await?;
    bus.ensure_streams().await?;
    let mut incidents = bus.js.get_stream(&name).await?;
    assert_eq!(incidents.info().await?.config.retention, stream::RetentionPolicy::Interest);
    bus.open_incident(&Incident::new("svc", "published before intake ever ran")).await?;
    assert_eq!(incidents.info().await?.state.messages, 1, "kept for intake");

    // Intake's consumer deleted by hand: the next start makes it again.
    incidents.delete_consumer("intake").await?;
    bus.ensure_streams().await?;
    assert_eq!(incidents.info().await?.state.consumer_count, 1, "made again");
    bus.open_incident(&Incident::new("svc", "published after")).await?;
    assert_eq!(incidents.info().await?.state.messages, 1, "kept for intake");

    // A stream that others read too (an operator's own durable consumer) keeps its older
    // settings: as an interest stream, it would keep every incident until each took it.
    bus.js.delete_stream(&name).await?;
    let older = bus
        .js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![bus.subjects.incidents_new()],
            max_age: Duration::from_secs(7 * 86_400),
            ..Default::default()
        })
        .await?;
    older.create_consumer(consumer::pull::Config { durable_name: Some("audit".into()), ..Default::default() }).await?;
    bus.ensure_streams().await?;
    let info = bus.js.get_stream(&name).await?.info().await?.clone();
    assert_eq!(info.config.retention, stream::RetentionPolicy::Limits, "{info:?}");
    assert_eq!(info.state.consumer_count, 2, "intake's made beside it");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_made_with_older_settings_takes_the_current_ones() -> anyhow::Result<()> {
    use async_nats::jetstream::stream;
    let (_env, bus) = bare_bus().await?;
    // The stages stream as an older pitcrew made it: pending work expired after 7 days, and a
    // full stream dropped the oldest.
    bus.js
        .create_stream(stream::Config {
            name: bus.subjects.stages_stream(),
            subjects: vec![bus.subjects.stages_all()],
            retention: stream::RetentionPolicy::WorkQueue,
            max_age: Duration::from_secs(7 * 86_400),
            max_bytes: 4 << 30,
            discard: stream::DiscardPolicy::Old,
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await?;
    bus.ensure_streams().await?;
    let info = bus.js.get_stream(bus.subjects.stages_stream()).await?.info().await?.config.clone();
    assert_eq!(info.max_age, Duration::ZERO, "pending work never expires");
    assert_eq!(info.discard, stream::DiscardPolicy::New, "a full stream refuses new work");
    assert_eq!(info.duplicate_window, Duration::from_secs(120));

    // Limits an operator raised by hand (a stages stream that filled in a storm, events kept
    // longer) stay raised at the next start; lowered ones are brought back.
    let set = |name: String, change: fn(&mut stream::Config)| {
        let js = bus.js.clone();
        async move {
            let mut config = js.get_stream(&name).await?.info().await?.config.clone();
            change(&mut config);
            js.update_stream(config).await?;
            anyhow::Ok(())
        }
    };
    let (stages, events) = (bus.subjects.stages_stream(), bus.subjects.events_stream());
    set(stages.clone(), |c| c.max_bytes = 8 << 30).await?;
    set(events.clone(), |c| c.max_age = Duration::from_secs(30 * 86_400)).await?;
    bus.ensure_streams().await?;
    let config = |name: String| {
        let js = bus.js.clone();
        async move { anyhow::Ok(js.get_stream(&name).await?.info().await?.config.clone()) }
    };
    assert_eq!(config(stages.clone()).await?.max_bytes, 8 << 30, "raised by hand: kept");
    assert_eq!(config(events.clone()).await?.max_age, Duration::from_secs(30 * 86_400), "raised by hand: kept");
    set(stages.clone(), |c| c.max_bytes = 1 << 20).await?;
    set(events.clone(), |c| c.max_age = Duration::from_secs(86_400)).await?;
    bus.ensure_streams().await?;
    assert_eq!(config(stages).await?.max_bytes, 4 << 30, "lowered: pitcrew's again");
    assert_eq!(config(events).await?.max_age, Duration::from_secs(7 * 86_400), "lowered: pitcrew's again");
    Ok(())
}

/// A nats-server that lost its store (restarted on an empty volume, or streams deleted by
/// hand) leaves every worker pulling from consumers that no longer exist. The crew makes its
/// streams and consumers again, without a restart, and handles what is published after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crew_makes_its_streams_and_consumers_again_when_the_server_lost_them() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let text = marker_service(&env, "svc");
    let mut crew = Crew::start_in(env, &text, &Stage::ALL).await?;
    let first = crew.open_with("svc", "connection refused", Some("before".into())).await?;
    assert_eq!(crew.events.terminal(first, WAIT).await?.kind, EventKind::Resolved);
    for stream in [crew.bus.subjects.incidents_stream(), crew.bus.subjects.stages_stream()] {
        assert!(crew.bus.js.delete_stream(&stream).await?.success, "{stream}");
    }
    // Publishing fails until the crew has made the incidents stream again.
    let deadline = tokio::time::Instant::now() + WAIT;
    let second = loop {
        match crew.open_with("svc", "connection refused", Some("after".into())).await {
            Ok(run) => break run,
            Err(e) => anyhow::ensure!(tokio::time::Instant::now() < deadline, "never accepted again: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let end = crew.end(second).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    crew.shutdown().await
}

/// Claims left by workers that died (here written as they would have left them): one that
/// had started its command (it may have run: recorded interrupted, never run again: the run
/// goes on to its next plan) and one that had not (killed while the command waited for its
/// turn on an SSH host or a channel: nothing ran, so its attempt runs it after all, once the
/// claim's time is up). The run resolves on its second attempt's `restart`, run once, by this
/// crew (on this machine: what a delivery does with a claim does not depend on the host).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_its_worker_never_started_is_run_and_one_it_may_have_started_is_not() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let healthy = env.path("svc-healthy");
    let text = format!(
        "[services.svc]\nhost = \"local\"\nstart = \"touch {healthy}\"\nrestart = \"touch {healthy} {}\"\n\
         check = {{ kind = \"command\", command = \"test -f {healthy}\" }}\n",
        env.path("restarted")
    );
    let others: Vec<Stage> = Stage::ALL.into_iter().filter(|s| *s != Stage::Execute).collect();
    let mut crew = Crew::start_in(env, &text, &others).await?;
    let run = crew.open("svc", "connection refused").await?;
    crew.events.wait(run, |e| e.kind == EventKind::Policy, WAIT).await?;
    let db = crew.db().await?;
    for (attempt, started) in [(1, true), (2, false)] {
        db.execute(
            "INSERT INTO executions (run_id, attempt, idx, command, host, worker, started_at, gone_by, claim, started)
             VALUES ($1, $2, 0, 'claimed by a worker that died', 'local', 'gone',
                     now() - interval '30 seconds', now() - interval '1 second', gen_random_uuid(), $3)",
            &[&run, &attempt, &started],
        )
        .await?;
    }
    crew.shutdown().await?;
    crew.run(&Stage::ALL);
    let end = crew.end(run).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);
    let executions = texts(
        &db,
        "SELECT attempt || ' ' || status || ' ' || worker || ' ' || command FROM executions WHERE run_id = $1
         ORDER BY attempt",
        run,
    )
    .await;
    assert_eq!(executions.len(), 2, "{executions:?}");
    assert!(executions[0].starts_with("1 interrupted gone "), "{executions:?}");
    assert!(
        executions[1].starts_with("2 succeeded ")
            && !executions[1].contains(" gone ")
            && executions[1].contains("restarted"),
        "{executions:?}"
    );
    assert!(std::path::Path::new(&crew.env.path("restarted")).exists(), "restart ran");
    let plans = texts(
        &db,
        "SELECT (data->'commands')::text FROM run_events WHERE run_id = $1 AND kind = 'plan' ORDER BY seq",
        run,
    )
    .await;
    assert_eq!(plans.len(), 2, "start, then restart: {plans:?}");
    crew.shutdown().await
}

/// A step delivered again after its commit (the successor's publish refused: a full stages
/// stream) sends the committed transition on, and does not do its work again: the model is
/// asked for the diagnosis once, however many deliveries the refusals take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_delivered_again_after_its_commit_is_not_done_again() -> anyhow::Result<()> {
    use pitcrew_testkit::llm::{Reply, ScriptedLlm};
    let env = TestEnv::start().await?;
    let svc = marker_service(&env, "svc");
    let llm = ScriptedLlm::start(vec![]).await?;
    llm.respond_with(|_| Reply::answer(r#"{"diagnosis": "svc is down", "evidence": ["connection refused"]}"#));
    let text = format!(
        "{svc}[reasoning]\nprovider = \"openai\"\n[reasoning.openai]\nbase_url = \"{}\"\nmodel = \"m\"\n\
         api_key_env = \"\"\nstream = false\n",
        llm.base_url
    );
    let crew = Crew::start_in(env, &text, &[Stage::Intake, Stage::Diagnose]).await?;
    // Room for one message: the diagnose step's own. Its successor is refused (discard new).
    let stages = crew.bus.subjects.stages_stream();
    let room = |max_messages: i64| {
        let (js, stages) = (crew.bus.js.clone(), stages.clone());
        async move {
            let mut config = js.get_stream(&stages).await?.info().await?.config.clone();
            config.max_messages = max_messages;
            js.update_stream(config).await?;
            anyhow::Ok(())
        }
    };
    room(1).await?;
    let run = crew.open("svc", "GET /health: connection refused").await?;
    let db = crew.db().await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    async fn stage(db: &tokio_postgres::Client, run: uuid::Uuid) -> anyhow::Result<Option<String>> {
        Ok(db.query_opt("SELECT stage FROM runs WHERE id = $1", &[&run]).await?.map(|r| r.get(0)))
    }
    while stage(&db, run).await?.as_deref() != Some("plan") {
        assert!(tokio::time::Instant::now() < deadline, "diagnose never committed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let asked = llm.requests().len();
    assert!(asked >= 1);
    // Delivered again and again while the publish is refused.
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        crew.bus.js.get_stream(&stages).await?.get_consumer("diagnose").await.map_err(|e| anyhow::anyhow!("{e}"))?;
    while consumer.info().await?.delivered.consumer_sequence < 4 {
        assert!(tokio::time::Instant::now() < deadline, "the step was not delivered again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(llm.requests().len(), asked, "the diagnosis was asked for again after its commit");
    // Room again: the committed transition goes on to plan.
    room(-1).await?;
    let plan = crew.bus.subjects.stage(Stage::Plan);
    while crew.bus.last_on(&stages, &plan).await?.is_none() {
        assert!(tokio::time::Instant::now() < deadline, "the committed transition never went on");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(llm.requests().len(), asked);
    assert_eq!(stage(&db, run).await?.as_deref(), Some("plan"));
    Ok(())
}

/// Work on a stage subject no stage of this version reads (a rolled-back crew's stage) is
/// listed with its count, for the crew to say so at its start; the known stages' is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_no_stage_reads_is_named_with_its_count() -> anyhow::Result<()> {
    let (_env, bus) = bare_bus().await?;
    bus.ensure_streams().await?;
    assert!(bus.unread_stage_subjects(20).await?.is_empty());
    let unknown = format!("{}.stage.investigate", bus.subjects.prefix());
    for i in 0..3 {
        bus.js.publish(unknown.clone(), format!("{i}").into()).await?.await?;
    }
    bus.js.publish(bus.subjects.stage(Stage::Diagnose), "known".into()).await?.await?;
    assert_eq!(bus.unread_stage_subjects(20).await?, vec![(unknown, 3)]);
    assert!(bus.unread_stage_subjects(0).await?.is_empty(), "at most the limit");
    Ok(())
}

/// A bus on a nats-server (and database) of its own, with no crew: the env keeps them up.
async fn bare_bus() -> anyhow::Result<(TestEnv, pitcrew_runtime::Bus)> {
    let env = TestEnv::start().await?;
    let cfg = pitcrew_runtime::Config::from_toml(&env.config_toml(""))?;
    let bus = pitcrew_runtime::Bus::connect(&cfg).await?;
    Ok((env, bus))
}

/// A duplicate incident delivered again past the events stream's duplicate window (its first
/// delivery's acks lost) is not announced twice: its `duplicate` event is on the bus already.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_delivered_again_past_the_duplicate_window_is_announced_once() -> anyhow::Result<()> {
    let (mut crew, _open) = held_before_execute().await?;
    let dup = crew.open("svc", "svc needs a directory").await?;
    crew.events.kind(dup, EventKind::Duplicate, WAIT).await?;
    // The window passes (shortened here, two minutes by default).
    let mut events = crew.bus.js.get_stream(crew.bus.subjects.events_stream()).await?;
    let mut config = events.info().await?.config.clone();
    config.duplicate_window = Duration::from_millis(200);
    crew.bus.js.update_stream(config).await?;
    tokio::time::sleep(Duration::from_millis(400)).await;
    // The same incident again, as a redelivery would bring it (under another message id: the
    // incidents stream's own window would drop it).
    let mut incident = pitcrew::cli::incident("svc", "svc needs a directory", None, Default::default(), None)?;
    incident.id = Some(dup);
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, format!("{dup}-again").as_str());
    headers.insert(pitcrew_runtime::bus::RUN_HEADER, dup.to_string().as_str());
    let payload = serde_json::to_vec(&incident)?;
    crew.bus.js.publish_with_headers(crew.bus.subjects.incidents_new(), headers, payload.into()).await?.await?;
    let incidents = crew.bus.js.get_stream(crew.bus.subjects.incidents_stream()).await?;
    emptied(&incidents).await?;
    let subject = crew.bus.subjects.event(dup, EventKind::Duplicate.as_str());
    let mut held = events.info_with_subjects(&subject).await?;
    let mut on_bus = 0;
    while let Some(s) = held.next().await {
        on_bus += s?.1;
    }
    assert_eq!(on_bus, 1, "announced once");
    Ok(())
}

/// A scrape while NATS answers nothing reads every consumer at once, within one read's
/// timeout (2 s): one after another, ten consumers held it 20 s, past Prometheus' own
/// timeout, and every series vanished just when it was wanted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_while_nats_is_silent_ends_within_one_reads_timeout() -> anyhow::Result<()> {
    let (env, bus) = bare_bus().await?;
    bus.ensure_streams().await?;
    let consumers = Stage::ALL.iter().map(|s| (bus.subjects.stages_stream(), s.as_str().to_string())).collect();
    let collector = pitcrew_runtime::metrics::Collector { bus, store: None, consumers };
    let frozen = env.nats.freeze();
    let began = std::time::Instant::now();
    collector.collect().await;
    let took = began.elapsed();
    drop(frozen);
    assert!(took < Duration::from_secs(5), "{took:?} for {} consumers", Stage::ALL.len());
    Ok(())
}

/// A stage's dead letters share a subject: whether one message's letter is there is asked of
/// every letter since that message was stored, not of the last alone (A, then B, then A
/// again past the duplicate window would store A twice). The search reads the letters'
/// headers, not the messages they hold: 24 letters of 256 KiB cost it under 1 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_is_found_among_its_stages_later_ones() -> anyhow::Result<()> {
    let (_env, bus) = bare_bus().await?;
    bus.ensure_streams().await?;
    let (dlq, subject) = (bus.subjects.dlq_stream(), bus.subjects.dlq("verify"));
    let before = time::OffsetDateTime::now_utc() - time::Duration::seconds(1);
    for id in ["dlq.S.1", "dlq.S.2"] {
        bus.publish(subject.clone(), id, "application/json", None, b"{}".to_vec().into()).await?;
    }
    let big = vec![b'x'; 256 * 1024];
    for n in 0..24 {
        bus.publish(subject.clone(), &format!("dlq.B.{n}"), "application/json", None, big.clone().into()).await?;
    }
    let received = bus.client.statistics().in_bytes.load(std::sync::atomic::Ordering::Relaxed);
    assert!(bus.held_since(&dlq, &subject, "dlq.B.23", before).await?, "found behind 23 large letters");
    let read = bus.client.statistics().in_bytes.load(std::sync::atomic::Ordering::Relaxed) - received;
    assert!(read < 1024 * 1024, "{read} bytes read to search 26 letters");
    assert!(!bus.holds(&dlq, &subject, "dlq.S.1").await?, "the last letter is another's");
    assert!(bus.held_since(&dlq, &subject, "dlq.S.1", before).await?, "found among the later ones");
    assert!(bus.held_since(&dlq, &subject, "dlq.S.2", before).await?);
    assert!(!bus.held_since(&dlq, &subject, "dlq.S.3", before).await?, "one never stored");
    let after = time::OffsetDateTime::now_utc() + time::Duration::seconds(5);
    assert!(!bus.held_since(&dlq, &subject, "dlq.S.1", after).await?, "nothing stored since then");
    Ok(())
}
