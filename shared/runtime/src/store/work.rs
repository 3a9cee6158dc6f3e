//! Evaluations, episodes (episodic memory), approvals and executions.

use super::{Store, StoreError};
use chrono::{DateTime, Utc};
use pitcrew_model::{ApprovalDecision, ApprovalRequest, Evaluation, ExecutionRecord, ExecutionStatus, RunState};
use std::time::Duration;
use uuid::Uuid;

/// Posts noted of one approval request at most (a bridge an attempt: a few).
const MAX_POSTERS: i32 = 64;

/// The SQL condition that run `$1` is open at execute in attempt `$2`, its row read `FOR
/// SHARE` (see [`Store::claim_execution`]): what a claim, a start and a claim's own retry ask.
macro_rules! at_execute {
    () => {
        "EXISTS (SELECT 1 FROM runs WHERE id = $1 AND attempt = $2 AND stage = 'execute' AND status = 'open' \
         FOR SHARE)"
    };
}

/// The statement that removes the claim `$4` of command `$3` of attempt `$2` of run `$1` where
/// `$predicate` holds too, and keeps it in `execution_releases` saying `$why`: for a claim with
/// nothing run under it.
macro_rules! release_claim {
    ($predicate:literal, $why:literal) => {
        concat!(
            "WITH gone AS (
                 DELETE FROM executions
                  WHERE run_id = $1 AND attempt = $2 AND idx = $3 AND claim = $4 AND ",
            $predicate,
            "
                 RETURNING *)
             INSERT INTO execution_releases (run_id, attempt, idx, command, host, worker, claim, started, claimed_at, why)
             SELECT run_id, attempt, idx, command, host, worker, claim, coalesce(started, false), started_at, '",
            $why,
            "' FROM gone"
        )
    };
}

/// What episodic memory knows about an error on a service.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Memory {
    /// Commands that failed for this error within the window and have not worked since.
    pub failed: Vec<String>,
    /// Plans that fixed this error, most recent first.
    pub fixes: Vec<Vec<String>>,
}

/// A row a stage writes with its run's transition: in the transition's statement, and only if
/// the run takes the transition (a stale redelivery writes none, nor a step that drops its
/// input: it takes no transition).
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// The evaluation of a plan.
    Evaluation(Uuid, Evaluation),
    /// What an attempt ran and whether it worked (episodic memory).
    Episode(Episode),
    /// Tokens the reasoning provider used for a stage of the run; keyed by the run state's
    /// seq, so a redelivered step overwrites its row rather than counting twice.
    LlmUsage { run: Uuid, seq: u32, stage: &'static str, attempt: u32, usage: pitcrew_llm::Usage },
    /// A request for a human's decision on the run's plan, written with the park that waits
    /// for it: a park the store refuses (the run went on from another delivery) leaves no
    /// pending request behind. The same plan asked for again by a later attempt (its commands
    /// all skipped the first time, so none failed) is a new request: the earlier attempt's
    /// decision and votes are dropped, and the sequence of the decision that settled it is
    /// kept as a floor, so no decision message from before (a redelivery) settles the new
    /// one. A redelivery of the same attempt's request changes nothing.
    Approval(Box<ApprovalRequest>),
}

/// One attempt remembered: what ran for which error, and whether it worked.
#[derive(Debug, Clone, PartialEq)]
pub struct Episode {
    pub run_id: Uuid,
    pub attempt: i32,
    pub service: String,
    pub signature: String,
    pub error: String,
    pub diagnosis: String,
    /// Only commands that actually ran: a plan that was denied or rejected is never
    /// remembered as failing.
    pub commands: Vec<String>,
    pub result: String,
    pub success: bool,
}

impl Episode {
    /// The episode of `state`'s current attempt.
    pub fn of(state: &RunState, commands: &[String], success: bool, result: &str) -> Episode {
        Episode {
            run_id: state.run_id,
            attempt: state.attempt as i32,
            service: state.incident.service.clone(),
            signature: state.incident.signature(),
            error: state.incident.error.clone(),
            diagnosis: state.diagnosis().map(|d| d.summary.clone()).unwrap_or_default(),
            commands: commands.to_vec(),
            result: result.to_string(),
            success,
        }
    }
}

/// `gone_after` as the seconds `gone_by` is set to from now, at most a year (a larger timeout
/// is not a time).
fn gone_secs(gone_after: std::time::Duration) -> f64 {
    gone_after.as_secs_f64().min(365.0 * 86_400.0)
}

/// The result of trying to record intent to run a command.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// Nobody ran it yet: run it now.
    Claimed,
    /// An earlier delivery ran it to the end: reuse its record.
    Finished(ExecutionRecord),
    /// An earlier delivery claimed it `running_for` ago (Postgres' clock) and never recorded
    /// an end: do not run it again, unless it never started. `gone_in`: how long it may still
    /// be running, by its claim (None on a claim written before that was recorded).
    /// `unstarted`: the claim's token when it is known never to have started (its delivery
    /// died waiting for the command's turn or a channel, or deciding to skip it): once its
    /// time is up, `drop_unstarted` removes it and the command may run.
    Unfinished { running_for: std::time::Duration, gone_in: Option<std::time::Duration>, unstarted: Option<Uuid> },
}

/// The result of applying a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecideOutcome {
    /// This decision settled the request.
    Applied,
    /// This same decision was applied before (a redelivery): carry on as if applied.
    Repeated,
    /// The request was already settled by another decision.
    AlreadyDecided { decision: String, by: String },
    /// The decision came before the request was made again for a later attempt (the same
    /// commands planned again): it answered the earlier request, not this one.
    Stale,
    /// No request for this run and plan.
    NoSuchRequest,
}

/// An approval request still waiting for a decision.
#[derive(Debug, Clone)]
pub struct PendingApproval {
    pub run_id: Uuid,
    pub plan_hash: String,
    /// The attempt that asks: a plan asked again by a later attempt is a new request.
    pub attempt: i32,
    pub rule: String,
    pub commands: Vec<String>,
    pub requested_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

/// One approval request of a run and its decision, if any.
#[derive(Debug, Clone)]
pub struct ApprovalRow {
    pub plan_hash: String,
    pub rule: String,
    pub commands: Vec<String>,
    pub requested_at: DateTime<Utc>,
    pub decision: Option<String>,
    pub by: Option<String>,
    pub channel: Option<String>,
    pub decided_at: Option<DateTime<Utc>>,
    pub reason: Option<String>,
}

/// Commands that failed for a service and error signature within a window (`$3` seconds) and
/// have not worked since, the most recent failures first (100 at most: a storm of distinct
/// commands, `kill -9 <pid>` with a new pid each run, must not crowd out the restart that
/// failed a minute ago). Answered from the failures alone (`episodes_failed`), however many
/// successes the signature has.
pub const FAILED_COMMANDS: &str = "SELECT c FROM episodes e, unnest(e.commands) AS c
     WHERE e.service = $1 AND e.signature = $2 AND NOT e.success
       AND e.created_at > now() - make_interval(secs => $3)
       AND NOT EXISTS (SELECT 1 FROM episodes s
                       WHERE s.service = e.service AND s.signature = e.signature AND s.success
                         AND c = ANY (s.commands) AND s.created_at > e.created_at)
     GROUP BY c ORDER BY max(e.created_at) DESC, c LIMIT 100";

impl Store {
    /// Episodic memory for `service` and error `signature`, read on `client` now (callers go
    /// through `memory`, which shares a read among concurrent callers).
    pub(super) async fn read_memory(
        &self,
        client: deadpool_postgres::Object,
        service: &str,
        signature: &str,
        window: Duration,
    ) -> Result<Memory, StoreError> {
        let failed = client.prepare_cached(FAILED_COMMANDS).await?;
        let fixes = client
            .prepare_cached(
                "SELECT commands FROM episodes WHERE service = $1 AND signature = $2 AND success
                 ORDER BY created_at DESC LIMIT 3",
            )
            .await?;
        let secs = window.as_secs_f64();
        // Both on one connection at once: tokio-postgres pipelines them (one round trip).
        type Arg<'a> = &'a (dyn tokio_postgres::types::ToSql + Sync);
        let (failed_args, fixes_args): ([Arg; 3], [Arg; 2]) = ([&service, &signature, &secs], [&service, &signature]);
        let (failed, fixes) =
            futures::try_join!(client.query(&failed, &failed_args), client.query(&fixes, &fixes_args))?;
        Ok(Memory {
            failed: failed.iter().map(|r| r.get(0)).collect(),
            fixes: fixes.iter().map(|r| r.get(0)).collect(),
        })
    }

    /// Count `by`'s approval of a pending request that needs a quorum: (distinct approvals so
    /// far, quorum), or None when the request is not pending (decided, or never made, or made
    /// again by an attempt other than `attempt`, the one the approver answered, when known).
    /// An approver who already voted is counted once; only votes of `approvers` (the
    /// configured ones) count: one cast by someone removed from them since counts no more.
    #[tracing::instrument(name = "db_write", skip_all, fields(op = "vote"))]
    #[allow(clippy::too_many_arguments)]
    pub async fn vote(
        &self,
        run: Uuid,
        plan_hash: &str,
        by: &str,
        channel: &str,
        seq: u64,
        attempt: Option<u32>,
        approvers: &[String],
    ) -> Result<Option<(i64, i64)>, StoreError> {
        let client = self.client().await?;
        // A vote from before the request was made again (see `Record::Approval`), or for
        // another attempt's request of the same plan, counts for nothing.
        let attempt = attempt.map(|a| a as i32);
        let quorum = client
            .query_opt(
                "SELECT quorum FROM approvals WHERE run_id = $1 AND plan_hash = $2 AND decision IS NULL
                   AND (decision_seq IS NULL OR decision_seq < $3) AND ($4::int4 IS NULL OR attempt = $4)",
                &[&run, &plan_hash, &(seq as i64), &attempt],
            )
            .await?;
        let Some(quorum) = quorum.map(|r| i64::from(r.get::<_, i32>(0))) else { return Ok(None) };
        client
            .execute(
                "INSERT INTO approval_votes (run_id, plan_hash, approver, channel) VALUES ($1, $2, $3, $4)
                 ON CONFLICT DO NOTHING",
                &[&run, &plan_hash, &by, &channel],
            )
            .await?;
        let votes: i64 = client
            .query_one(
                "SELECT count(*) FROM approval_votes WHERE run_id = $1 AND plan_hash = $2 AND approver = ANY($3)",
                &[&run, &plan_hash, &approvers],
            )
            .await?
            .get(0);
        Ok(Some((votes, quorum)))
    }

    /// The deadline of the request for `plan_hash` if it is still pending and past it (by
    /// Postgres's clock): an approval arriving then must not run the plan. Also when the
    /// decision message `seq` itself already expired it (its redelivery, after a failure
    /// between that write and the run's transition, must expire it again, not approve).
    pub async fn approval_expired(
        &self,
        run: Uuid,
        plan_hash: &str,
        seq: u64,
    ) -> Result<Option<chrono::DateTime<chrono::Utc>>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                "SELECT expires_at FROM approvals
                 WHERE run_id = $1 AND plan_hash = $2
                   AND ((decision IS NULL AND expires_at <= now()) OR (decision = 'expire' AND decision_seq = $3))",
                &[&run, &plan_hash, &(seq as i64)],
            )
            .await?;
        Ok(row.map(|r| r.get(0)))
    }

    /// Settle the request for `plan_hash` with `d`, only if it is still pending, and when
    /// `attempt` (the one whose request the decision answered) is known, only if that attempt
    /// made it: a decision held up until a later attempt asked for the same plan again settles
    /// nothing (it would leave that attempt's run parked on a request decided behind it).
    /// `seq` is the bridge-stream sequence of the decision message, recognising redeliveries.
    #[tracing::instrument(name = "db_write", skip_all, fields(op = "decide_approval"))]
    pub async fn decide_approval(
        &self,
        plan_hash: &str,
        d: &ApprovalDecision,
        seq: u64,
        attempt: Option<u32>,
    ) -> Result<DecideOutcome, StoreError> {
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(
                "UPDATE approvals SET decision = $3, decided_by = $4, decided_at = $5, channel = $6, reason = $7,
                        decision_seq = $8
                 WHERE run_id = $1 AND plan_hash = $2 AND decision IS NULL
                   AND (decision_seq IS NULL OR decision_seq < $8) AND ($9::int4 IS NULL OR attempt = $9)",
            )
            .await?;
        let attempt = attempt.map(|a| a as i32);
        let n = client
            .execute(
                &stmt,
                &[
                    &d.run_id,
                    &plan_hash,
                    &d.decision.as_str(),
                    &d.by,
                    &d.decided_at,
                    &d.channel,
                    &d.reason,
                    &(seq as i64),
                    &attempt,
                ],
            )
            .await?;
        if n == 1 {
            return Ok(DecideOutcome::Applied);
        }
        let row = client
            .query_opt(
                "SELECT decision, decided_by, decision_seq FROM approvals WHERE run_id = $1 AND plan_hash = $2",
                &[&d.run_id, &plan_hash],
            )
            .await?;
        Ok(match row {
            None => DecideOutcome::NoSuchRequest,
            Some(r) => {
                let decision: Option<String> = r.get(0);
                let by: Option<String> = r.get(1);
                let decided_seq: Option<i64> = r.get(2);
                match decision {
                    // Pending, and this decision is from before its floor, or answered another
                    // attempt's request of the plan.
                    None => DecideOutcome::Stale,
                    Some(_) if decided_seq == Some(seq as i64) => DecideOutcome::Repeated,
                    Some(decision) => DecideOutcome::AlreadyDecided { decision, by: by.unwrap_or_default() },
                }
            }
        })
    }

    /// The decision recorded for a plan, if any: (decision, by, channel, when).
    pub async fn approval_decision(
        &self,
        run: Uuid,
        plan_hash: &str,
    ) -> Result<Option<(String, String, String, chrono::DateTime<chrono::Utc>)>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                "SELECT decision, decided_by, coalesce(channel, ''), decided_at FROM approvals
                 WHERE run_id = $1 AND plan_hash = $2 AND decision IS NOT NULL",
                &[&run, &plan_hash],
            )
            .await?;
        Ok(row.map(|r| (r.get(0), r.get(1), r.get(2), r.get(3))))
    }

    /// Whether `poster` (a bridge's consumer and the request's attempt: `slack-bridge:2`)
    /// posted the approval request of `run`'s plan already.
    pub async fn request_posted(&self, run: Uuid, plan_hash: &str, poster: &str) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM approvals WHERE run_id = $1 AND plan_hash = $2 AND $3 = ANY(posted_to))",
                &[&run, &plan_hash, &poster],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Note that `poster` posted the approval request of `run`'s plan (once; at most
    /// `MAX_POSTERS` a request).
    pub async fn mark_posted(&self, run: Uuid, plan_hash: &str, poster: &str) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .execute(
                "UPDATE approvals SET posted_to = array_append(posted_to, $3)
                  WHERE run_id = $1 AND plan_hash = $2 AND NOT ($3 = ANY(posted_to)) AND cardinality(posted_to) < $4",
                &[&run, &plan_hash, &poster, &MAX_POSTERS],
            )
            .await?;
        Ok(())
    }

    /// Every approval request of a run, oldest first: (plan hash, rule, commands, requested,
    /// decision, by, channel, when, reason).
    pub async fn approvals_of(&self, run: Uuid) -> Result<Vec<ApprovalRow>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT plan_hash, rule, commands, requested_at, decision, decided_by, channel, decided_at, reason
                 FROM approvals WHERE run_id = $1 ORDER BY requested_at",
                &[&run],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| ApprovalRow {
                plan_hash: r.get(0),
                rule: r.get(1),
                commands: r.get(2),
                requested_at: r.get(3),
                decision: r.get(4),
                by: r.get(5),
                channel: r.get(6),
                decided_at: r.get(7),
                reason: r.get(8),
            })
            .collect())
    }

    /// Pending approvals (all, or only those past their deadline), oldest first.
    pub async fn pending_approvals(&self, only_expired: bool, limit: i64) -> Result<Vec<PendingApproval>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT run_id, plan_hash, rule, commands, requested_at, expires_at, attempt FROM approvals
                 WHERE decision IS NULL AND (NOT $1 OR expires_at < now())
                 ORDER BY requested_at LIMIT $2",
                &[&only_expired, &limit],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| PendingApproval {
                run_id: r.get(0),
                plan_hash: r.get(1),
                rule: r.get(2),
                commands: r.get(3),
                requested_at: r.get(4),
                expires_at: r.get(5),
                attempt: r.get(6),
            })
            .collect())
    }

    /// Record the intent to run command `index` of `attempt` before running it, under the
    /// delivery's token `claim`; should it never be finished, it may be running for up to
    /// `gone_after` from now. `started`: the claim counts as the command's start (it starts at
    /// once after it); otherwise `command_starts` marks the start, after a wait. Only while the
    /// run is open at execute in `attempt`: a copy of the step that loaded the run before another
    /// copy moved it on (escalated it, freeing its target) claims nothing and runs nothing. The
    /// run's row is read `FOR SHARE`, which waits for a transition of the run in flight and
    /// then reads its outcome (`FOR KEY SHARE`, which a transition's update does not conflict
    /// with, read the row as it was before it: the claim went through as the run left execute,
    /// and another run could take the freed target before the claim was seen).
    #[tracing::instrument(name = "db_write", skip_all, fields(op = "claim_execution"))]
    #[allow(clippy::too_many_arguments)]
    pub async fn claim_execution(
        &self,
        run: Uuid,
        attempt: u32,
        index: u32,
        command: &str,
        host: &str,
        worker: &str,
        claim: Uuid,
        started: bool,
        gone_after: std::time::Duration,
    ) -> Result<Claim, StoreError> {
        let client = self.client().await?;
        let ins = client
            .prepare_cached(concat!(
                "INSERT INTO executions (run_id, attempt, idx, command, host, worker, gone_by, claim, started)
                 SELECT $1, $2, $3, $4, $5, $6, now() + $7::float8 * interval '1 second', $8, $9
                  WHERE ",
                at_execute!(),
                " ON CONFLICT DO NOTHING"
            ))
            .await?;
        let secs = gone_secs(gone_after);
        let n = client
            .execute(
                &ins,
                &[&run, &(attempt as i32), &(index as i32), &command, &host, &worker, &secs, &claim, &started],
            )
            .await?;
        if n == 1 {
            return Ok(Claim::Claimed);
        }
        let gone = || {
            StoreError::Moved(format!(
                "command {index} of attempt {attempt}: its claim was released, or its run left execute, as it was claimed"
            ))
        };
        // Its own claim, unfinished, is this delivery's retry of a claim whose answer was lost
        // (the connection dropped after the commit): still its own while the run is at
        // execute, as for a claim made now. None: a claim released or removed since the insert
        // found it (nothing ran), or the run left the step. The retry claims it, or finds the
        // run moved on.
        match existing_claim(&client, run, attempt, index, Some(claim)).await? {
            Some(Claim::Claimed) => {
                let here = client.prepare_cached(concat!("SELECT ", at_execute!())).await?;
                let here: bool = client.query_one(&here, &[&run, &(attempt as i32)]).await?.get(0);
                if here {
                    return Ok(Claim::Claimed);
                }
                // Nothing ran under it (its delivery is the caller, which has not started it):
                // not left to hold the target and be recorded interrupted.
                client
                    .execute(
                        release_claim!("status IS NULL", "its run left execute as its delivery claimed it again"),
                        &[&run, &(attempt as i32), &(index as i32), &claim],
                    )
                    .await?;
                Err(gone())
            }
            Some(other) => Ok(other),
            None => Err(gone()),
        }
    }

    /// What became of command `index` of `attempt`, without claiming it: None if nobody has.
    pub async fn execution_claim(&self, run: Uuid, attempt: u32, index: u32) -> Result<Option<Claim>, StoreError> {
        let client = self.client().await?;
        existing_claim(&client, run, attempt, index, None).await
    }

    /// The command `claim` (a delivery's token) holds starts now: it may be running for up to
    /// `gone_after` from now. Written before it starts, so a claim without it is known never to
    /// have started (a worker killed as it waited for its turn on the host or a connection),
    /// and one with it may have, and a worker killed as it runs leaves the right time behind.
    /// False when the claim no longer stands (another delivery recorded it interrupted, or
    /// removed it as never started, and moved on) or its run left execute (closed by hand
    /// while the command waited for its turn past its claim's time): it must not start then.
    /// The run's row is locked for the mark, as for the claim, so a close by hand
    /// ([`Store::close_run`]) or a transition moving the run off execute either sees the start
    /// or is seen by it. A claim past its
    /// time that nobody marked yet is moved (the mark checks the time again).
    #[tracing::instrument(name = "db_write", skip_all, fields(op = "command_starts"))]
    pub async fn command_starts(
        &self,
        run: Uuid,
        attempt: u32,
        index: u32,
        claim: Uuid,
        gone_after: std::time::Duration,
    ) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(concat!(
                "UPDATE executions SET gone_by = now() + $4::float8 * interval '1 second', started = true
                     WHERE run_id = $1 AND attempt = $2 AND idx = $3 AND status IS NULL AND claim = $5 AND ",
                at_execute!()
            ))
            .await?;
        let secs = gone_secs(gone_after);
        Ok(client.execute(&stmt, &[&run, &(attempt as i32), &(index as i32), &secs, &claim]).await? == 1)
    }

    /// Remove the claim `claim` of a command that never started, once its time is up (its
    /// delivery is gone, or its start would now be refused): the command may be claimed and
    /// run anew, by the same attempt. False when it started meanwhile, or changed.
    #[tracing::instrument(name = "db_write", skip_all, fields(op = "drop_unstarted"))]
    pub async fn drop_unstarted(&self, run: Uuid, attempt: u32, index: u32, claim: Uuid) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(release_claim!(
                "status IS NULL AND started = false AND gone_by <= now()",
                "never started: removed by a later delivery once its time was up"
            ))
            .await?;
        Ok(client.execute(&stmt, &[&run, &(attempt as i32), &(index as i32), &claim]).await? == 1)
    }

    /// Record that a claimed command's outcome is unknown (its worker died while it ran): only
    /// while nothing finished it, so a late finish by a live worker is never overwritten, and
    /// only once the time its claim gave has passed (a late start may have just moved it).
    /// False when either kept it from being recorded.
    #[tracing::instrument(name = "db_write", skip_all, fields(op = "mark_interrupted"))]
    pub async fn mark_interrupted(&self, run: Uuid, attempt: u32, index: u32) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(
                "UPDATE executions SET status = 'interrupted', finished_at = now(),
                     output = 'started by an earlier delivery that never finished: not run again'
                 WHERE run_id = $1 AND attempt = $2 AND idx = $3 AND status IS NULL
                   AND (gone_by IS NULL OR gone_by <= now())",
            )
            .await?;
        Ok(client.execute(&stmt, &[&run, &(attempt as i32), &(index as i32)]).await? == 1)
    }

    /// (command, host, status) of every command run for `run`, in order; status is empty
    /// while a command is still running.
    pub async fn executions(&self, run: Uuid) -> Result<Vec<(String, String, String)>, StoreError> {
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(
                "SELECT command, host, coalesce(status, '') FROM executions WHERE run_id = $1 ORDER BY attempt, idx",
            )
            .await?;
        let rows = client.query(&stmt, &[&run]).await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect())
    }

    /// A command of `run` that may still be running: claimed, not finished, and its deadline
    /// (`gone_by`, by Postgres's clock) not past. Its command, host and deadline.
    pub async fn running_execution(
        &self,
        run: Uuid,
    ) -> Result<Option<(String, String, chrono::DateTime<chrono::Utc>)>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                "SELECT command, host, gone_by FROM executions
                  WHERE run_id = $1 AND finished_at IS NULL AND gone_by > now() ORDER BY gone_by DESC LIMIT 1",
                &[&run],
            )
            .await?;
        Ok(row.map(|r| (r.get(0), r.get(1), r.get(2))))
    }

    /// Record how a claimed command ended. Returns false when another delivery of the step
    /// took it over meanwhile (marked it interrupted, skipped the rest of the plan and moved
    /// the run on): its status then stays `interrupted`, so every later delivery decides as
    /// that one did, the real outcome is added to its output, and the caller must run nothing
    /// more of the plan.
    #[tracing::instrument(name = "db_write", skip_all, fields(op = "finish_execution"))]
    pub async fn finish_execution(&self, run: Uuid, rec: &ExecutionRecord, claim: Uuid) -> Result<bool, StoreError> {
        let client = self.client().await?;
        // Only under its own claim: one removed as never started (by a delivery that then
        // claimed it anew) is not this delivery's to finish.
        let stmt = client
            .prepare_cached(
                "UPDATE executions SET finished_at = now(), status = $4, exit_code = $5, output = $6
                 WHERE run_id = $1 AND attempt = $2 AND idx = $3 AND status IS NULL AND claim = $7",
            )
            .await?;
        let status =
            serde_json::to_value(rec.status).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
        let (attempt, index) = (rec.attempt as i32, rec.index as i32);
        let n = client.execute(&stmt, &[&run, &attempt, &index, &status, &rec.exit_code, &rec.output, &claim]).await?;
        if n == 1 {
            return Ok(true);
        }
        let late = client
            .prepare_cached(
                "UPDATE executions SET output = left(coalesce(output, '') || $4, 65536)
                 WHERE run_id = $1 AND attempt = $2 AND idx = $3 AND status = 'interrupted' AND claim = $5",
            )
            .await?;
        let code = rec.exit_code.map(|c| format!(" (exit {c})")).unwrap_or_default();
        let note = format!("\nthe delivery that started it finished it later: {status}{code}");
        client.execute(&late, &[&run, &attempt, &index, &note, &claim]).await?;
        Ok(false)
    }
}

impl Store {
    /// Forget the claim `claim` whose command never started (the host could not be reached,
    /// the start was refused or failed): only that delivery's own claim, never one another
    /// delivery made since, and, unless the caller knows nothing ran (`not_run`: a process
    /// that could not be started on this machine), never one whose start was marked (an SSH
    /// error after the mark does not prove nothing ran: such a claim is recorded interrupted
    /// later). Whether it did: false when the claim is no longer this delivery's to release.
    #[tracing::instrument(name = "db_write", skip_all, fields(op = "release_execution"))]
    pub async fn release_execution(
        &self,
        run: Uuid,
        attempt: u32,
        index: u32,
        claim: Uuid,
        not_run: bool,
    ) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let released = client
            .execute(
                release_claim!(
                    "finished_at IS NULL AND (started = false OR $5)",
                    "released by its delivery: nothing ran under it"
                ),
                &[&run, &(attempt as i32), &(index as i32), &claim, &not_run],
            )
            .await?;
        Ok(released == 1)
    }
}

/// The claim of command `index` of `attempt` as it stands: finished, or unfinished with its
/// times; None if there is none.
async fn existing_claim(
    client: &deadpool_postgres::Object,
    run: Uuid,
    attempt: u32,
    index: u32,
    mine: Option<Uuid>,
) -> Result<Option<Claim>, StoreError> {
    let stmt = client
        .prepare_cached(
            "SELECT command, status, exit_code, output,
                    (EXTRACT(EPOCH FROM (finished_at - started_at)) * 1000)::bigint,
                    (EXTRACT(EPOCH FROM (now() - started_at)) * 1000)::bigint,
                    (EXTRACT(EPOCH FROM (gone_by - now())) * 1000)::bigint,
                    CASE WHEN started = false THEN claim END,
                    coalesce(claim = $4, false)
             FROM executions WHERE run_id = $1 AND attempt = $2 AND idx = $3",
        )
        .await?;
    let Some(row) = client.query_opt(&stmt, &[&run, &(attempt as i32), &(index as i32), &mine]).await? else {
        return Ok(None);
    };
    let status: Option<String> = row.get(1);
    if status.is_none() && row.get::<_, bool>(8) {
        return Ok(Some(Claim::Claimed));
    }
    let Some(status) = status else {
        let ms = |v: i64| std::time::Duration::from_millis(v.max(0) as u64);
        let gone_in: Option<i64> = row.get(6);
        return Ok(Some(Claim::Unfinished {
            running_for: ms(row.get(5)),
            gone_in: gone_in.map(ms),
            unstarted: row.get(7),
        }));
    };
    let status: ExecutionStatus =
        serde_json::from_value(serde_json::Value::String(status)).unwrap_or(ExecutionStatus::Failed);
    let ms: Option<i64> = row.get(4);
    Ok(Some(Claim::Finished(ExecutionRecord {
        attempt,
        index,
        command: row.get(0),
        status,
        exit_code: row.get(2),
        output: row.get::<_, Option<String>>(3).unwrap_or_default(),
        duration_ms: ms.unwrap_or(0).max(0) as u64,
    })))
}
