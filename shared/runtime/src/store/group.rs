//! Group commit of run transitions. Every stage ends a step with one transition (the run's
//! new state and the step's events); under load, the transitions waiting while the earlier
//! ones are written share one statement: one round trip and one WAL flush for the lot instead
//! of one each. A transition that finds nothing in flight goes at once, alone, so a quiet
//! crew waits for nothing.
//!
//! Each transition keeps its own answer: the seq guard is per run, and a run the batch did
//! not move (stale input, closed run) is reported to its caller alone. A batch never holds
//! two transitions of one run (the second waits for the next batch), so batching changes no
//! outcome. A batch that fails for a reason other than the connection is split into single
//! statements, so one transition Postgres refuses never fails the others with it.

use super::runs::EventColumns;
use super::{RunStatus, StoreError};
use deadpool_postgres::Pool;
use pitcrew_model::{RunEvent, RunState};
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot, Semaphore};
use uuid::Uuid;

/// Most transitions in one statement (bounds its parameters: states are capped in size).
const MAX_BATCH: usize = 128;

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
    reply: oneshot::Sender<Result<bool, StoreError>>,
}

impl Pending {
    pub(super) fn new(
        state: &RunState,
        status: RunStatus,
        events: &[RunEvent],
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
    ) -> Result<bool, StoreError> {
        let (pending, answer) = Pending::new(state, status, events);
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
    if batch.len() == 1 {
        let p = batch.into_iter().next().expect("one");
        let result = single(pool, &p).await;
        let _ = p.reply.send(result);
        return;
    }
    match together(pool, &batch).await {
        Ok(moved) => {
            for (i, p) in batch.into_iter().enumerate() {
                let _ = p.reply.send(Ok(moved.contains(&(i as i64 + 1))));
            }
        }
        Err(e) if e.is_transient() => {
            // Postgres is unreachable or busy: every caller retries later anyway.
            let why = e.to_string();
            for p in batch {
                let _ = p.reply.send(Err(StoreError::Unavailable(why.clone())));
            }
        }
        Err(e) => {
            // One transition Postgres refuses (a value it cannot store, say) must not fail
            // the others: each goes alone and gets its own answer.
            tracing::debug!(error = %e, size = batch.len(), "batched transition refused: committing one by one");
            futures::future::join_all(batch.into_iter().map(|p| async move {
                let result = single(pool, &p).await;
                let _ = p.reply.send(result);
            }))
            .await;
        }
    }
}

async fn client(pool: &Pool) -> Result<deadpool_postgres::Object, StoreError> {
    pool.get().await.map_err(|e| StoreError::Unavailable(e.to_string()))
}

/// One transition in one statement: the run's update and its events, written only when the
/// run took the transition (seq guard, closed runs never reopen).
async fn single(pool: &Pool, p: &Pending) -> Result<bool, StoreError> {
    let client = client(pool).await?;
    let stmt = client
        .prepare_cached(
            "WITH upd AS (
                 UPDATE runs SET stage = $2, seq = $3, attempt = $4, state = $5::text::jsonb, status = $6, reason = $7,
                        updated_at = now(),
                        finished_at = CASE WHEN $6 IN ('resolved', 'escalated') THEN now() ELSE NULL END
                 WHERE id = $1 AND seq <= $3 AND status NOT IN ('resolved', 'escalated')
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

/// Many runs' transitions in one statement; returns the (1-based) positions of the
/// transitions their runs took.
async fn together(pool: &Pool, batch: &[Pending]) -> Result<HashSet<i64>, StoreError> {
    let client = client(pool).await?;
    let stmt = client
        .prepare_cached(
            "WITH u AS (
                 SELECT * FROM unnest($1::uuid[], $2::text[], $3::int4[], $4::int4[], $5::text[], $6::text[], $7::text[])
                      WITH ORDINALITY AS u(id, stage, seq, attempt, state, status, reason, item)),
             upd AS (
                 UPDATE runs r SET stage = u.stage, seq = u.seq, attempt = u.attempt, state = u.state::jsonb,
                        status = u.status, reason = u.reason, updated_at = now(),
                        finished_at = CASE WHEN u.status IN ('resolved', 'escalated') THEN now() ELSE NULL END
                 FROM u
                 WHERE r.id = u.id AND r.seq <= u.seq AND r.status NOT IN ('resolved', 'escalated')
                 RETURNING u.item),
             ins AS (
                 INSERT INTO run_events (run_id, seq, idx, stage, kind, message, data, worker, at)
                 SELECT e.run_id, e.seq, e.idx, e.stage, e.kind, e.message, e.data, e.worker, e.at
                 FROM unnest($8::int8[], $9::uuid[], $10::int4[], $11::int4[], $12::text[], $13::text[],
                             $14::text[], $15::jsonb[], $16::text[], $17::timestamptz[])
                      AS e(item, run_id, seq, idx, stage, kind, message, data, worker, at)
                 WHERE e.item IN (SELECT item FROM upd)
                 ON CONFLICT DO NOTHING)
             SELECT item FROM upd",
        )
        .await?;
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
    let rows = client
        .query(
            &stmt,
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
        )
        .await?;
    Ok(rows.iter().map(|r| r.get::<_, i64>(0)).collect())
}
