//! Criterion benchmarks of the hot paths every stage transition takes:
//! - `codec/*`: a typical mid-run state (incident, six pieces of evidence, diagnosis, plan,
//!   evaluation, one execution) encoded and decoded as MessagePack (the bus format) and JSON
//!   (the Postgres format, encoded to a string as the store's group committer does), and the
//!   redaction every kept text goes through;
//! - `policy/*`: the shipped policy gate over a typical three-command plan (evaluate and
//!   approval each judge every plan);
//! - `hop/*`: one hop through JetStream: publish a state and wait for the stream's ack, pull it
//!   from a durable consumer and ack it as the crew settles a message (`publish_consume_ack`:
//!   the ack sent, not waited for), or waiting for the server to confirm the ack
//!   (`publish_consume_double_ack`) (a real nats-server the bench starts);
//! - `store/*`: the Postgres writes of a transition (a fresh database the bench creates):
//!   `commit_transition` with two events (alone, and 64 runs' at once), `open_run` (a fresh
//!   run's state, as intake opens it).
//!
//! Run: `cargo bench -p pitcrew-loadtest --bench hot_paths` (needs what `scripts/dev test`
//! sets up: a nats-server >= 2.10 and Postgres).

use async_nats::jetstream::consumer::{pull, PullConsumer};
use async_nats::jetstream::AckKind;
use criterion::{criterion_group, criterion_main, BatchSize, Bencher, Criterion, Throughput};
use futures::StreamExt;
use pitcrew_model::codec::{self, JSON, MSGPACK};
use pitcrew_model::{
    Diagnosis, Evaluation, EvaluationCheck, EventKind, Evidence, ExecutionRecord, ExecutionStatus, Incident, Plan,
    RunEvent, RunState, Stage, Verdict,
};
use pitcrew_runtime::runner::publish_state;
use pitcrew_runtime::store::RunStatus;
use pitcrew_runtime::{Bus, Config, Store};
use pitcrew_testkit::TestEnv;
use std::time::Duration;
use uuid::Uuid;

/// The incident every state here is about.
fn typical_incident() -> Incident {
    let mut incident = Incident::new("checkout", "connection refused on :8080 after deploy 4711");
    incident.host = Some("web-1".into());
    incident.fingerprint = Some("alertmanager:4f1c2a".into());
    incident
}

/// A state as it leaves execute: what every later hop carries.
fn typical_state() -> RunState {
    let mut s = RunState::new(Uuid::now_v7(), typical_incident());
    let output = "tcp LISTEN 0 4096 127.0.0.1:5432 0.0.0.0:*\n".repeat(12);
    for (source, detail) in [
        ("check", "http http://127.0.0.1:8080/health"),
        ("pidfile", "cat /run/checkout.pid"),
        ("command", "tail -n 50 /var/log/checkout.log"),
        ("command", "ss -ltn"),
        ("command", "df -h"),
        ("command", "free -m"),
    ] {
        s.push_evidence(Evidence {
            attempt: 1,
            source: source.into(),
            detail: detail.into(),
            output: output.clone(),
            ok: source != "check",
        });
    }
    s.diagnosis_log.push(Diagnosis {
        attempt: 1,
        summary: "checkout is not running: the pidfile names no live process".into(),
        source: "playbook:service-down".into(),
        grounds: vec!["connection refused".into(), "pidfile stale".into()],
    });
    s.plan = Some(Plan {
        attempt: 1,
        commands: vec!["systemctl restart checkout".into()],
        rationale: "the service is down; a restart brings it back".into(),
        source: "playbook:service-down".into(),
    });
    s.evaluation = Some(Evaluation {
        attempt: 1,
        regeneration: 0,
        score: 0.92,
        verdict: Verdict::Pass,
        checks: (0..5)
            .map(|i| EvaluationCheck {
                name: format!("check-{i}"),
                passed: true,
                weight: 0.2,
                detail: "grounded in this run's evidence".into(),
            })
            .collect(),
        feedback: None,
    });
    s.executions.push(ExecutionRecord {
        attempt: 1,
        index: 0,
        command: "systemctl restart checkout".into(),
        status: ExecutionStatus::Succeeded,
        exit_code: Some(0),
        output: String::new(),
        duration_ms: 41,
    });
    s.advance(Stage::Verify);
    s
}

fn event(run: Uuid, seq: u32, index: u32) -> RunEvent {
    RunEvent {
        run_id: run,
        seq,
        index,
        stage: Stage::Execute,
        kind: if index == 0 { EventKind::Status } else { EventKind::Execution },
        message: "execute: `systemctl restart checkout` exited 0 in 41 ms".into(),
        data: serde_json::json!({ "attempt": 1, "command": "systemctl restart checkout", "exit_code": 0 }),
        worker: "bench:1".into(),
        at: chrono::Utc::now(),
    }
}

fn codec_benches(c: &mut Criterion) {
    let state = typical_state();
    let packed = codec::to_msgpack(&state);
    let json = serde_json::to_vec(&state).expect("json");
    eprintln!("typical state: {} bytes MessagePack, {} bytes JSON", packed.len(), json.len());
    let mut g = c.benchmark_group("codec");
    g.throughput(Throughput::Elements(1));
    g.bench_function("msgpack_encode", |b| b.iter(|| codec::to_msgpack(std::hint::black_box(&state))));
    g.bench_function("msgpack_decode", |b| {
        b.iter(|| codec::decode::<RunState>(Some(MSGPACK), std::hint::black_box(&packed)).expect("decodes"))
    });
    // As the store encodes a state for its row (`serde_json::to_string`, store/group.rs).
    g.bench_function("json_encode", |b| b.iter(|| serde_json::to_string(std::hint::black_box(&state))));
    g.bench_function("json_decode", |b| {
        b.iter(|| codec::decode::<RunState>(Some(JSON), std::hint::black_box(&json)).expect("decodes"))
    });
    // Every event and every piece of evidence is redacted before it is kept: mostly clean text.
    let clean = "tcp LISTEN 0 4096 127.0.0.1:5432 0.0.0.0:* users:((\"postgres\",pid=812,fd=6))\n".repeat(50);
    let dirty = format!("{clean}curl -H 'Authorization: Bearer abcdef0123456789' https://u:pw@example.com\n");
    g.bench_function("redact_clean_4k", |b| b.iter(|| pitcrew_model::redact::redact(std::hint::black_box(&clean))));
    g.bench_function("redact_secret_4k", |b| b.iter(|| pitcrew_model::redact::redact(std::hint::black_box(&dirty))));
    // `systemctl status` and many logs are not ASCII: the same automaton must serve them.
    let status = "● web.service - web\n     Active: active (running) since Tue; 2h ago\n   CGroup: /system.slice/web.service\n             └─812 /usr/bin/web --port 8080\n".repeat(20);
    g.bench_function("redact_status_4k", |b| b.iter(|| pitcrew_model::redact::redact(std::hint::black_box(&status))));
    g.finish();
}

fn policy_benches(c: &mut Criterion) {
    let policy = pitcrew_policy::Policy::default_policy();
    let plan: Vec<String> =
        ["systemctl restart checkout", "rm -f /run/checkout.pid", "sudo -n /opt/checkout/bin/start --port 8080"]
            .map(String::from)
            .to_vec();
    let mut g = c.benchmark_group("policy");
    g.throughput(Throughput::Elements(1));
    g.bench_function("gate_3_commands", |b| b.iter(|| policy.gate_on("web-1", std::hint::black_box(&plan))));
    g.bench_function("findings_3_commands", |b| b.iter(|| policy.findings_on("web-1", std::hint::black_box(&plan))));
    g.finish();
}

struct Live {
    _env: TestEnv,
    bus: Bus,
    store: Store,
}

async fn live(rt: &tokio::runtime::Runtime) -> Live {
    let _ = rt;
    let env = TestEnv::start().await.expect("nats-server and a fresh database (see scripts/dev test)");
    let cfg = Config::from_toml(&env.config_toml("")).expect("config");
    let bus = Bus::connect(&cfg).await.expect("bus");
    bus.ensure_streams().await.expect("streams");
    let store = Store::connect(&cfg.database).await.expect("store");
    store.migrate().await.expect("migrations");
    Live { _env: env, bus, store }
}

fn hop_bench(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let live = rt.block_on(live(&rt));
    let bus = live.bus.clone();
    let consumer = rt.block_on(async {
        let stream = bus.js.get_stream(bus.subjects.stages_stream()).await.expect("stages stream");
        stream
            .create_consumer(pull::Config {
                durable_name: Some("bench-verify".into()),
                filter_subject: bus.subjects.stage(Stage::Verify),
                ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                ..Default::default()
            })
            .await
            .expect("consumer")
    });
    let mut g = c.benchmark_group("hop");
    g.throughput(Throughput::Elements(1));
    g.bench_function("publish_consume_ack", |b| hop(b, &rt, &bus, &consumer, false));
    g.bench_function("publish_consume_double_ack", |b| hop(b, &rt, &bus, &consumer, true));
    g.finish();
    rt.block_on(all_acked(&bus, &consumer));
    drop(live);
}

/// Publish a state and wait for the stream's ack, pull it and ack it: as the crew settles a
/// message (`ack_with(AckKind::Ack)`: the ack is on the connection, ahead of the next pull,
/// when the hop ends; the server's answer is not waited for), or with `double` waiting for
/// the server to confirm it.
fn hop(b: &mut Bencher, rt: &tokio::runtime::Runtime, bus: &Bus, consumer: &PullConsumer, double: bool) {
    b.to_async(rt).iter_batched(
        || {
            let mut s = typical_state();
            s.run_id = Uuid::now_v7();
            s
        },
        |state| {
            let (bus, consumer) = (bus.clone(), consumer.clone());
            async move {
                publish_state(&bus, &state).await.expect("publish");
                let mut batch =
                    consumer.fetch().max_messages(1).expires(Duration::from_secs(5)).messages().await.expect("fetch");
                let msg = batch.next().await.expect("a message").expect("no error");
                let got: RunState = codec::decode(Some(MSGPACK), &msg.payload).expect("decodes");
                assert_eq!(got.run_id, state.run_id);
                if double {
                    msg.double_ack().await.expect("ack");
                } else {
                    msg.ack_with(AckKind::Ack).await.expect("ack");
                }
            }
        },
        BatchSize::SmallInput,
    )
}

/// Every message the hops pulled was acked: once the connection is flushed, the server soon
/// holds none pending (the acks sent without waiting are checked here, not in each hop).
async fn all_acked(bus: &Bus, consumer: &PullConsumer) {
    bus.client.flush().await.expect("flush");
    let mut pending = usize::MAX;
    for _ in 0..50 {
        pending = consumer.get_info().await.expect("consumer info").num_ack_pending;
        if pending == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{pending} messages of the hop benchmarks still unacked");
}

fn store_benches(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let live = rt.block_on(live(&rt));
    let store = live.store.clone();
    let mut g = c.benchmark_group("store");
    g.throughput(Throughput::Elements(1));
    // A fresh run's state, as intake opens it (the incident, nothing gathered yet).
    g.bench_function("open_run", |b| {
        b.to_async(&rt).iter_batched(
            || {
                let mut s = RunState::new(Uuid::now_v7(), typical_incident());
                s.incident.fingerprint = Some(s.run_id.to_string());
                s
            },
            |state| {
                let store = store.clone();
                async move {
                    store.open_run(&state).await.expect("open_run");
                }
            },
            BatchSize::SmallInput,
        )
    });
    // Transitions of one open run, each newer than the last (the seq guard admits them).
    let mut base = typical_state();
    base.incident.fingerprint = Some(base.run_id.to_string());
    rt.block_on(store.open_run(&base)).expect("open_run");
    let mut seq = base.seq;
    g.bench_function("commit_transition_2_events", |b| {
        b.to_async(&rt).iter_batched(
            || {
                seq += 1;
                let mut s = base.clone();
                s.seq = seq;
                let events = vec![event(s.run_id, seq, 0), event(s.run_id, seq, 1)];
                (s, events)
            },
            |(state, events)| {
                let store = store.clone();
                async move {
                    let took = store.commit_transition(&state, RunStatus::Open, &events).await.expect("commit");
                    assert!(took, "a newer transition is always taken");
                }
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();

    // 64 runs' transitions at once, as a loaded crew writes them: the group committer shares
    // statements among them. Throughput is per transition.
    let mut g = c.benchmark_group("store");
    g.throughput(Throughput::Elements(64));
    let runs: Vec<RunState> = (0..64)
        .map(|_| {
            let mut s = typical_state();
            s.run_id = Uuid::now_v7();
            s.incident.fingerprint = Some(s.run_id.to_string());
            s
        })
        .collect();
    for r in &runs {
        rt.block_on(store.open_run(r)).expect("open_run");
    }
    let mut group_seq = 0u32;
    g.bench_function("commit_transition_64_runs_at_once", |b| {
        b.to_async(&rt).iter_batched(
            || {
                group_seq += 1;
                runs.iter()
                    .map(|r| {
                        let mut s = r.clone();
                        s.seq = group_seq;
                        let events = vec![event(s.run_id, group_seq, 0), event(s.run_id, group_seq, 1)];
                        (s, events)
                    })
                    .collect::<Vec<_>>()
            },
            |steps| {
                let store = store.clone();
                async move {
                    let commits = steps.iter().map(|(s, e)| store.commit_transition(s, RunStatus::Open, e));
                    for took in futures::future::join_all(commits).await {
                        assert!(took.expect("commit"), "a newer transition is always taken");
                    }
                }
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();

    drop(live);
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(50).measurement_time(Duration::from_secs(5));
    targets = codec_benches, policy_benches, hop_bench, store_benches
}
criterion_main!(benches);
