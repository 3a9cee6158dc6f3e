//! Group commit of run transitions. Every stage ends a step with one transition (the run's
//! new state and the step's events); under load, the transitions waiting while the earlier
//! ones are written share one statement: one round trip and one WAL flush for the lot instead
//! of one each. A transition that finds nothing in flight goes at once, alone, so a quiet
//! crew waits for nothing.
//!
//! Each transition keeps its own answer: the seq guard is per run, and a run the batch did
//! not move (stale input, closed run) is reported to its caller alone. A transition at the
//! seq the run is at is taken again only to the same step (a redelivered step rewriting what
//! it wrote); one to another step (a redelivered step that decided otherwise: a check that
//! now fails) is refused, so the run keeps the transition whose message may be on its way. A
//! batch never holds two transitions of one run (the second waits for the next batch), so
//! batching changes no outcome. A batch that fails for a reason other than the connection is
//! split into single statements, so one transition Postgres refuses never fails the others
//! with it.

use super::runs::EventColumns;
use super::{Record, RunStatus, StoreError};
use deadpool_postgres::Pool;
use futures::StreamExt;
use pitcrew_model::{RunEvent, RunState};
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot, Semaphore};
use uuid::Uuid;

/// Most transitions in one statement (bounds its parameters: states are capped in size).
const MAX_BATCH: usize = 128;

/// Transitions of a refused batch written at once when each goes alone.
const FALLBACK_AT_ONCE: usize = 4;

/// Transitions waiting for a statement; callers wait (backpressure) beyond this.
const QUEUE: usize = 1024;

/// One run's transition, owned, on its way to a statement.
pub(super) struct Pending {
    run_id: Uuid,
    stage: &'static str,
    seq: i32,
    attempt: i32,
    /// The state as JSON text.
    state: String,
    status: RunStatus,
    reason: Option<String>,
    events: Vec<RunEvent>,
    records: Vec<Record>,
    reply: oneshot::Sender<Result<bool, StoreError>>,
}

impl Pending {
    pub(super) fn new(
        state: &RunState,
        status: RunStatus,
        events: &[RunEvent],
        records: Vec<Record>,
    ) -> (Pending, oneshot::Receiver<Result<bool, StoreError>>) {
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            run_id: state.run_id,
            stage: state.step.as_str(),
            seq: state.seq as i32,
            attempt: state.attempt as i32,
            state: serde_json::to_string(state).expect("run state serialises"),
            status,
            reason: state.escalation_reason.clone(),
            events: events.to_vec(),
            records,
            reply,
        };
        (pending, answer)
    }
}

/// The handle callers queue transitions on.
#[derive(Clone)]
pub(super) struct Committer {
    queue: mpsc::Sender<Pending>,
}

impl Committer {
    /// Start the committer: at most `lanes` statements in flight at once (each holds one
    /// pooled connection while it runs).
    pub(super) fn start(pool: Pool, lanes: usize) -> Committer {
        let (queue, rx) = mpsc::channel(QUEUE);
        tokio::spawn(dispatch(pool, rx, lanes.max(1)));
        Committer { queue }
    }

    /// Queue a transition and wait for its answer.
    pub(super) async fn commit(
        &self,
        state: &RunState,
        status: RunStatus,
        events: &[RunEvent],
        records: Vec<Record>,
    ) -> Result<bool, StoreError> {
        let (pending, answer) = Pending::new(state, status, events, records);
        let gone = || StoreError::Unavailable("the transition committer stopped".into());
        self.queue.send(pending).await.map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }
}

/// Take what is waiting, up to `MAX_BATCH`, whenever a lane is free; stop when every handle
/// is dropped and nothing waits.
async fn dispatch(pool: Pool, mut rx: mpsc::Receiver<Pending>, lanes: usize) {
    let lanes = Arc::new(Semaphore::new(lanes));
    let mut deferred: VecDeque<Pending> = VecDeque::new();
    loop {
        let lane = lanes.clone().acquire_owned().await.expect("semaphore never closed");
        let first = match deferred.pop_front() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(p) => p,
                None => return,
            },
        };
        let mut runs = HashSet::from([first.run_id]);
        let mut batch = vec![first];
        // A second transition of a run already in the batch waits for the next one.
        for _ in 0..deferred.len() {
            let p = deferred.pop_front().expect("counted");
            if batch.len() < MAX_BATCH && runs.insert(p.run_id) {
                batch.push(p);
            } else {
                deferred.push_back(p);
            }
        }
        while batch.len() < MAX_BATCH {
            let Ok(p) = rx.try_recv() else { break };
            if runs.insert(p.run_id) {
                batch.push(p);
            } else {
                deferred.push_back(p);
            }
        }
        let pool = pool.clone();
        tokio::spawn(async move {
            write(&pool, batch).await;
            drop(lane);
        });
    }
}

/// Write a batch and answer each of its callers.
async fn write(pool: &Pool, batch: Vec<Pending>) {
    crate::metrics::transitions_written(batch.len());
    if batch.len() == 1 && batch[0].records.is_empty() {
        let p = batch.into_iter().next().expect("one");
        let result = single(pool, &p).await;
        let _ = p.reply.send(result);
        return;
    }
    match statement(pool, &batch).await {
        Ok(moved) => {
            for (i, p) in batch.into_iter().enumerate() {
                let _ = p.reply.send(Ok(moved.contains(&(i as i64 + 1))));
            }
        }
        Err(e) if batch.len() == 1 || (e.is_transient() && !e.may_be_one_row()) => {
            // Alone, the answer is its own; together and Postgres unreachable or busy, every
            // caller retries later anyway. A statement that ran out of time (or was refused a
            // lock) is most likely one run's row locked elsewhere, an internal error maybe one
            // corrupt row: the others go on alone, below.
            let why = e.to_string();
            let mut batch = batch.into_iter();
            if let Some(p) = batch.next() {
                let _ = p.reply.send(Err(e));
            }
            for p in batch {
                let _ = p.reply.send(Err(StoreError::Unavailable(why.clone())));
            }
        }
        Err(e) => {
            // One transition Postgres refuses (a value it cannot store, say) or that waits
            // on a lock past the statement timeout must not fail the others: each goes alone
            // and gets its own answer. A few at a time: all at once would take every pooled
            // connection the stages' own queries need, one after another would hold every
            // transition of the batch behind a locked row's statement timeout.
            tracing::debug!(error = %e, size = batch.len(), "grouped transitions refused: committing one by one");
            futures::stream::iter(batch)
                .for_each_concurrent(FALLBACK_AT_ONCE, |p| async move {
                    crate::metrics::transitions_written(1);
                    let result = statement(pool, std::slice::from_ref(&p)).await.map(|moved| !moved.is_empty());
                    let _ = p.reply.send(result);
                })
                .await;
        }
    }
}

/// A lone transition without records, in the plainer statement that costs least alone (380
/// against 520 µs for the grouped form, `store/commit_transition_2_events`): the run's update
/// and its events, written only when the run took the transition (seq guard, closed runs
/// never reopen).
async fn single(pool: &Pool, p: &Pending) -> Result<bool, StoreError> {
    let client = pool.get().await.map_err(|e| StoreError::Unavailable(e.to_string()))?;
    let stmt = client
        .prepare_cached(
            "WITH upd AS (
                 UPDATE runs SET stage = $2, seq = $3, attempt = $4, state = $5::text::jsonb, status = $6, reason = $7,
                        updated_at = now(),
                        finished_at = CASE WHEN $6 IN ('resolved', 'escalated') THEN now() ELSE NULL END
                 WHERE id = $1 AND (seq < $3 OR (seq = $3 AND stage = $2 AND $6 <> 'open'))
                       AND status NOT IN ('resolved', 'escalated')
                 RETURNING id),
             ins AS (
                 INSERT INTO run_events (run_id, seq, idx, stage, kind, message, data, worker, at)
                 SELECT e.* FROM unnest($8::uuid[], $9::int4[], $10::int4[], $11::text[], $12::text[],
                                        $13::text[], $14::jsonb[], $15::text[], $16::timestamptz[])
                      AS e(run_id, seq, idx, stage, kind, message, data, worker, at)
                 WHERE EXISTS (SELECT 1 FROM upd)
                 ON CONFLICT DO NOTHING)
             SELECT count(*) FROM upd",
        )
        .await?;
    let cols = EventColumns::of(&p.events);
    let updated: i64 = client
        .query_one(
            &stmt,
            &[
                &p.run_id,
                &p.stage,
                &p.seq,
                &p.attempt,
                &p.state,
                &p.status.as_str(),
                &p.reason,
                &cols.run_id,
                &cols.seq,
                &cols.idx,
                &cols.stage,
                &cols.kind,
                &cols.message,
                &cols.data,
                &cols.worker,
                &cols.at,
            ],
        )
        .await?
        .get(0);
    Ok(updated == 1)
}

/// The run updates and their events, always in the statement.
const TRANSITIONS: &str = "WITH u AS (
         SELECT * FROM unnest($?::uuid[], $?::text[], $?::int4[], $?::int4[], $?::text[], $?::text[], $?::text[])
              WITH ORDINALITY AS u(id, stage, seq, attempt, state, status, reason, item)),
     upd AS (
         UPDATE runs r SET stage = u.stage, seq = u.seq, attempt = u.attempt, state = u.state::jsonb,
                status = u.status, reason = u.reason, updated_at = now(),
                finished_at = CASE WHEN u.status IN ('resolved', 'escalated') THEN now() ELSE NULL END
         FROM u
         WHERE r.id = u.id AND (r.seq < u.seq OR (r.seq = u.seq AND r.stage = u.stage AND u.status <> 'open'))
           AND r.status NOT IN ('resolved', 'escalated')
         RETURNING u.item),
     ins AS (
         INSERT INTO run_events (run_id, seq, idx, stage, kind, message, data, worker, at)
         SELECT e.run_id, e.seq, e.idx, e.stage, e.kind, e.message, e.data, e.worker, e.at
         FROM unnest($?::int8[], $?::uuid[], $?::int4[], $?::int4[], $?::text[], $?::text[],
                     $?::text[], $?::jsonb[], $?::text[], $?::timestamptz[])
              AS e(item, run_id, seq, idx, stage, kind, message, data, worker, at)
         WHERE e.item IN (SELECT item FROM upd)
         ON CONFLICT DO NOTHING)";

/// Evaluations, only when the batch has some (each part costs the statement even when empty).
const EVALUATIONS: &str = ",
     evs AS (
         INSERT INTO evaluations (run_id, attempt, regeneration, score, verdict, checks, feedback)
         SELECT v.run_id, v.attempt, v.regeneration, v.score, v.verdict, v.checks, v.feedback
         FROM unnest($?::int8[], $?::uuid[], $?::int4[], $?::int4[], $?::float8[], $?::text[], $?::jsonb[], $?::text[])
              AS v(item, run_id, attempt, regeneration, score, verdict, checks, feedback)
         WHERE v.item IN (SELECT item FROM upd)
         ON CONFLICT DO NOTHING)";

const EPISODES: &str = ",
     eps AS (
         INSERT INTO episodes (run_id, attempt, service, signature, error, diagnosis, commands, result, success)
         SELECT p.run_id, p.attempt, p.service, p.signature, p.error, p.diagnosis,
                ARRAY(SELECT jsonb_array_elements_text(p.commands)), p.result, p.success
         FROM unnest($?::int8[], $?::uuid[], $?::int4[], $?::text[], $?::text[], $?::text[],
                     $?::text[], $?::jsonb[], $?::text[], $?::bool[])
              AS p(item, run_id, attempt, service, signature, error, diagnosis, commands, result, success)
         WHERE p.item IN (SELECT item FROM upd)
         ON CONFLICT DO NOTHING)";

const LLM_USAGE: &str = ",
     llm AS (
         INSERT INTO llm_usage (run_id, seq, stage, attempt, model, calls, prompt_tokens, completion_tokens)
         SELECT l.run_id, l.seq, l.stage, l.attempt, l.model, l.calls, l.prompt_tokens, l.completion_tokens
         FROM unnest($?::int8[], $?::uuid[], $?::int4[], $?::text[], $?::int4[], $?::text[],
                     $?::int4[], $?::int8[], $?::int8[])
              AS l(item, run_id, seq, stage, attempt, model, calls, prompt_tokens, completion_tokens)
         WHERE l.item IN (SELECT item FROM upd)
         ON CONFLICT (run_id, seq, stage) DO UPDATE SET model = excluded.model, calls = excluded.calls,
             prompt_tokens = excluded.prompt_tokens, completion_tokens = excluded.completion_tokens,
             at = now())";

/// Approval requests, written with the park that waits for them (see `Record::Approval`).
/// Their times are Postgres's (the request's timeout from now), as every check of a deadline
/// is: a worker's clock may be off.
const APPROVALS: &str = ",
     req AS (
         INSERT INTO approvals (run_id, plan_hash, attempt, commands, risk, rule, requested_at, expires_at, quorum)
         SELECT a.run_id, a.plan_hash, a.attempt, ARRAY(SELECT jsonb_array_elements_text(a.commands)), a.risk,
                a.rule, now(), now() + (a.expires_at - a.requested_at), a.quorum
         FROM unnest($?::int8[], $?::uuid[], $?::text[], $?::int4[], $?::jsonb[], $?::text[], $?::text[],
                     $?::timestamptz[], $?::timestamptz[], $?::int4[])
              AS a(item, run_id, plan_hash, attempt, commands, risk, rule, requested_at, expires_at, quorum)
         WHERE a.item IN (SELECT item FROM upd)
         ON CONFLICT (run_id, plan_hash) DO UPDATE SET
             attempt = excluded.attempt, commands = excluded.commands, risk = excluded.risk,
             rule = excluded.rule, requested_at = excluded.requested_at, expires_at = excluded.expires_at,
             quorum = excluded.quorum, decision = NULL, decided_by = NULL, decided_at = NULL,
             channel = NULL, reason = NULL
         WHERE approvals.attempt < excluded.attempt
         RETURNING run_id, plan_hash),
     unvote AS (
         DELETE FROM approval_votes v USING req WHERE v.run_id = req.run_id AND v.plan_hash = req.plan_hash)";

type Param<'p> = &'p (dyn tokio_postgres::types::ToSql + Sync);

/// Append `part` to `sql`, numbering its `$?` placeholders after those already there, one
/// for each of `values`.
fn append<'p>(sql: &mut String, part: &str, params: &mut Vec<Param<'p>>, values: &[Param<'p>]) {
    debug_assert_eq!(part.matches("$?").count(), values.len(), "one value per placeholder");
    let mut pieces = part.split("$?");
    sql.push_str(pieces.next().unwrap_or_default());
    for (value, piece) in values.iter().zip(pieces) {
        params.push(*value);
        sql.push_str(&format!("${}", params.len()));
        sql.push_str(piece);
    }
}

/// Transitions in one statement: each run's update (seq guard: an older transition never
/// overwrites a newer one; a closed run never reopens), and the events and records of the
/// transitions their runs took, atomic without BEGIN/COMMIT. Returns the (1-based) positions
/// of those transitions. Only the kinds of record the batch holds are part of the statement.
async fn statement(pool: &Pool, batch: &[Pending]) -> Result<HashSet<i64>, StoreError> {
    let client = pool.get().await.map_err(|e| StoreError::Unavailable(e.to_string()))?;
    let ids: Vec<Uuid> = batch.iter().map(|p| p.run_id).collect();
    let stages: Vec<&str> = batch.iter().map(|p| p.stage).collect();
    let seqs: Vec<i32> = batch.iter().map(|p| p.seq).collect();
    let attempts: Vec<i32> = batch.iter().map(|p| p.attempt).collect();
    let states: Vec<&str> = batch.iter().map(|p| p.state.as_str()).collect();
    let statuses: Vec<&str> = batch.iter().map(|p| p.status.as_str()).collect();
    let reasons: Vec<Option<&str>> = batch.iter().map(|p| p.reason.as_deref()).collect();
    let items: Vec<i64> =
        batch.iter().enumerate().flat_map(|(i, p)| std::iter::repeat_n(i as i64 + 1, p.events.len())).collect();
    let cols = EventColumns::of(batch.iter().flat_map(|p| p.events.iter()));
    let r = RecordColumns::of(batch);

    let mut sql = String::with_capacity(4096);
    let mut params: Vec<Param<'_>> = Vec::with_capacity(54);
    append(
        &mut sql,
        TRANSITIONS,
        &mut params,
        &[
            &ids,
            &stages,
            &seqs,
            &attempts,
            &states,
            &statuses,
            &reasons,
            &items,
            &cols.run_id,
            &cols.seq,
            &cols.idx,
            &cols.stage,
            &cols.kind,
            &cols.message,
            &cols.data,
            &cols.worker,
            &cols.at,
        ],
    );
    if !r.eval_item.is_empty() {
        let values: [Param<'_>; 8] = [
            &r.eval_item,
            &r.eval_run,
            &r.eval_attempt,
            &r.eval_regeneration,
            &r.eval_score,
            &r.eval_verdict,
            &r.eval_checks,
            &r.eval_feedback,
        ];
        append(&mut sql, EVALUATIONS, &mut params, &values);
    }
    if !r.ep_item.is_empty() {
        let values: [Param<'_>; 10] = [
            &r.ep_item,
            &r.ep_run,
            &r.ep_attempt,
            &r.ep_service,
            &r.ep_signature,
            &r.ep_error,
            &r.ep_diagnosis,
            &r.ep_commands,
            &r.ep_result,
            &r.ep_success,
        ];
        append(&mut sql, EPISODES, &mut params, &values);
    }
    if !r.llm_item.is_empty() {
        let values: [Param<'_>; 9] = [
            &r.llm_item,
            &r.llm_run,
            &r.llm_seq,
            &r.llm_stage,
            &r.llm_attempt,
            &r.llm_model,
            &r.llm_calls,
            &r.llm_prompt,
            &r.llm_completion,
        ];
        append(&mut sql, LLM_USAGE, &mut params, &values);
    }
    if !r.req_item.is_empty() {
        let values: [Param<'_>; 10] = [
            &r.req_item,
            &r.req_run,
            &r.req_hash,
            &r.req_attempt,
            &r.req_commands,
            &r.req_risk,
            &r.req_rule,
            &r.req_requested,
            &r.req_expires,
            &r.req_quorum,
        ];
        append(&mut sql, APPROVALS, &mut params, &values);
    }
    sql.push_str("\n     SELECT item FROM upd");
    let stmt = client.prepare_cached(&sql).await?;
    let rows = client.query(&stmt, &params).await?;
    Ok(rows.iter().map(|r| r.get::<_, i64>(0)).collect())
}

/// The batch's records as columns, each row tagged with its transition's position.
#[derive(Default)]
struct RecordColumns<'b> {
    eval_item: Vec<i64>,
    eval_run: Vec<Uuid>,
    eval_attempt: Vec<i32>,
    eval_regeneration: Vec<i32>,
    eval_score: Vec<f64>,
    eval_verdict: Vec<&'static str>,
    eval_checks: Vec<serde_json::Value>,
    eval_feedback: Vec<Option<&'b str>>,
    ep_item: Vec<i64>,
    ep_run: Vec<Uuid>,
    ep_attempt: Vec<i32>,
    ep_service: Vec<&'b str>,
    ep_signature: Vec<&'b str>,
    ep_error: Vec<&'b str>,
    ep_diagnosis: Vec<&'b str>,
    ep_commands: Vec<serde_json::Value>,
    ep_result: Vec<&'b str>,
    ep_success: Vec<bool>,
    llm_item: Vec<i64>,
    llm_run: Vec<Uuid>,
    llm_seq: Vec<i32>,
    llm_stage: Vec<&'static str>,
    llm_attempt: Vec<i32>,
    llm_model: Vec<&'b str>,
    llm_calls: Vec<i32>,
    llm_prompt: Vec<i64>,
    llm_completion: Vec<i64>,
    req_item: Vec<i64>,
    req_run: Vec<Uuid>,
    req_hash: Vec<&'b str>,
    req_attempt: Vec<i32>,
    req_commands: Vec<serde_json::Value>,
    req_risk: Vec<&'b str>,
    req_rule: Vec<&'b str>,
    req_requested: Vec<chrono::DateTime<chrono::Utc>>,
    req_expires: Vec<chrono::DateTime<chrono::Utc>>,
    req_quorum: Vec<i32>,
}

impl<'b> RecordColumns<'b> {
    fn of(batch: &'b [Pending]) -> Self {
        let mut c = RecordColumns::default();
        for (i, p) in batch.iter().enumerate() {
            let item = i as i64 + 1;
            for r in &p.records {
                match r {
                    Record::Evaluation(run, ev) => {
                        c.eval_item.push(item);
                        c.eval_run.push(*run);
                        c.eval_attempt.push(ev.attempt as i32);
                        c.eval_regeneration.push(ev.regeneration as i32);
                        c.eval_score.push(ev.score);
                        c.eval_verdict.push(ev.verdict.as_str());
                        c.eval_checks.push(serde_json::to_value(&ev.checks).unwrap_or_default());
                        c.eval_feedback.push(ev.feedback.as_deref());
                    }
                    Record::Episode(ep) => {
                        c.ep_item.push(item);
                        c.ep_run.push(ep.run_id);
                        c.ep_attempt.push(ep.attempt);
                        c.ep_service.push(&ep.service);
                        c.ep_signature.push(&ep.signature);
                        c.ep_error.push(&ep.error);
                        c.ep_diagnosis.push(&ep.diagnosis);
                        c.ep_commands.push(serde_json::json!(ep.commands));
                        c.ep_result.push(&ep.result);
                        c.ep_success.push(ep.success);
                    }
                    Record::LlmUsage { run, seq, stage, attempt, usage } => {
                        c.llm_item.push(item);
                        c.llm_run.push(*run);
                        c.llm_seq.push(*seq as i32);
                        c.llm_stage.push(stage);
                        c.llm_attempt.push(*attempt as i32);
                        c.llm_model.push(&usage.model);
                        c.llm_calls.push(usage.calls as i32);
                        c.llm_prompt.push(usage.prompt_tokens as i64);
                        c.llm_completion.push(usage.completion_tokens as i64);
                    }
                    Record::Approval(req) => {
                        c.req_item.push(item);
                        c.req_run.push(req.run_id);
                        c.req_hash.push(&req.plan_hash);
                        c.req_attempt.push(req.attempt as i32);
                        c.req_commands.push(serde_json::json!(req.plan));
                        c.req_risk.push(&req.risk);
                        c.req_rule.push(&req.rule);
                        c.req_requested.push(req.requested_at);
                        c.req_expires.push(req.expires_at);
                        c.req_quorum.push(req.quorum as i32);
                    }
                }
            }
        }
        c
    }
}
