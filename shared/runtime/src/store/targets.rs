//! One remediation at a time on a target (a service on its host): see
//! schemas/migrations/0007_target_locks.sql.

use super::{Store, StoreError};
use std::time::Duration;
use tokio_postgres::error::SqlState;
use uuid::Uuid;

/// Whether a run may remediate its target now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetLock {
    /// The run's attempt holds the target (taken now, or by an earlier delivery of its step).
    Held {
        /// Another run that held the target before this attempt took it and was still at work
        /// after this run opened: its remediation may have changed what this run's
        /// diagnosis saw.
        remediated_since: Option<Uuid>,
        /// Whether a command of this attempt was claimed already (by an earlier delivery).
        started: bool,
    },
    /// Another run is executing or verifying a plan there (`holder`), or the target is free
    /// and runs that have waited longer go first (`holder` is `None` then, and when it changed
    /// hands while we looked). `waiting`: since this attempt first found it taken; `ahead`:
    /// runs waiting there since before that, and still looking; `queue`: the same, looking or
    /// not (each is a message pending on the execute consumer). Neither grows while a run
    /// waits: a run that comes later waits behind it. `first`: this attempt's first look.
    Busy { holder: Option<Uuid>, waiting: Duration, ahead: u32, queue: u32, first: bool },
}

/// One statement, one snapshot: take the target's row unless another run holds it (a holder
/// lets go once its run is closed, or past verify, or on to another attempt, and none of its
/// commands may still be running: claimed, unfinished, its deadline not past, as when a run
/// was escalated or closed by hand mid-command) or a run that has waited longer is still
/// waiting for it (waiters are served in order; one that has not looked for `$6` seconds, its
/// crew down or its message backing off, is passed over); otherwise note this attempt as
/// waiting.
///
/// Taking it again is the same attempt's redelivery, which keeps who held it before; a new
/// attempt of the same run starts afresh, and queues like any other. Taken, the run waits no
/// more. Waiting, the wait counts from the attempt's first look, leaving out any gap between
/// two looks longer than `$5` seconds (nobody was looking), and the target's waiters whose
/// runs stopped waiting are forgotten. Returns whether it was taken; if so, who held it before
/// since this run opened and whether this attempt claimed a command already; if not, who holds
/// it, how long this attempt has waited, how many of the runs waiting there have waited
/// longer (those still looking, and all of them), and whether this was the attempt's first
/// look.
const TAKE: &str = "
    WITH mine AS (
        SELECT CASE WHEN now() - looked > make_interval(secs => $5) THEN since + (now() - looked) ELSE since END AS since
          FROM target_waits WHERE run_id = $3 AND attempt = $4),
    -- The other runs waiting for the target: at execute, at the attempt that noted its wait.
    waiting AS (
        SELECT w.run_id, w.attempt, w.since, w.looked FROM target_waits w
          JOIN runs r ON r.id = w.run_id AND r.attempt = w.attempt
         WHERE w.service = $1 AND w.host = $2 AND w.run_id <> $3 AND r.status = 'open' AND r.stage = 'execute'),
    taken AS (
        INSERT INTO target_locks AS l (service, host, run_id, attempt) VALUES ($1, $2, $3, $4)
        ON CONFLICT (service, host) DO UPDATE SET
            run_id = excluded.run_id,
            attempt = excluded.attempt,
            taken_at = CASE WHEN (l.run_id, l.attempt) = (excluded.run_id, excluded.attempt)
                            THEN l.taken_at ELSE now() END,
            previous_run = CASE WHEN (l.run_id, l.attempt) = (excluded.run_id, excluded.attempt) THEN l.previous_run
                                WHEN l.run_id = excluded.run_id THEN NULL
                                ELSE l.run_id END
        WHERE (l.run_id, l.attempt) = (excluded.run_id, excluded.attempt) OR (
            NOT EXISTS (
                SELECT 1 FROM runs h WHERE h.id = l.run_id AND h.attempt = l.attempt
                   AND h.status IN ('open', 'waiting_approval') AND h.stage IN ('execute', 'verify'))
            AND NOT EXISTS (
                SELECT 1 FROM executions e WHERE e.run_id = l.run_id AND e.attempt = l.attempt
                   AND e.finished_at IS NULL AND e.gone_by > now())
            AND NOT EXISTS (
                SELECT 1 FROM waiting w WHERE w.looked > now() - make_interval(secs => $6)
                   AND (w.since, w.run_id) < (coalesce((SELECT since FROM mine), now()), $3)))
        RETURNING previous_run),
    forgot AS (DELETE FROM target_waits WHERE run_id = $3 AND EXISTS (SELECT 1 FROM taken)),
    gone AS (
        DELETE FROM target_waits w WHERE w.service = $1 AND w.host = $2 AND w.run_id <> $3
           AND NOT EXISTS (SELECT 1 FROM taken)
           AND NOT EXISTS (SELECT 1 FROM waiting k WHERE k.run_id = w.run_id AND k.attempt = w.attempt)),
    noted AS (
        INSERT INTO target_waits AS w (run_id, attempt, service, host)
        SELECT $3, $4, $1, $2 WHERE NOT EXISTS (SELECT 1 FROM taken)
        ON CONFLICT (run_id, attempt) DO UPDATE SET
            since = CASE WHEN now() - w.looked > make_interval(secs => $5) THEN w.since + (now() - w.looked)
                         ELSE w.since END,
            looked = now()
        RETURNING since)
    SELECT EXISTS (SELECT 1 FROM taken),
           (SELECT CASE WHEN p.updated_at > r.created_at THEN t.previous_run END
              FROM taken t LEFT JOIN runs r ON r.id = $3 LEFT JOIN runs p ON p.id = t.previous_run),
           EXISTS (SELECT 1 FROM executions e WHERE e.run_id = $3 AND e.attempt = $4),
           (SELECT l.run_id FROM target_locks l JOIN runs h ON h.id = l.run_id AND h.attempt = l.attempt
             WHERE l.service = $1 AND l.host = $2 AND l.run_id <> $3
               AND ((h.status IN ('open', 'waiting_approval') AND h.stage IN ('execute', 'verify'))
                    OR EXISTS (SELECT 1 FROM executions e WHERE e.run_id = l.run_id AND e.attempt = l.attempt
                                 AND e.finished_at IS NULL AND e.gone_by > now()))),
           (SELECT EXTRACT(EPOCH FROM now() - since)::float8 FROM noted),
           (SELECT count(*) FROM waiting w WHERE w.looked > now() - make_interval(secs => $6)
               AND (w.since, w.run_id) < ((SELECT since FROM noted), $3)),
           (SELECT count(*) FROM waiting w WHERE (w.since, w.run_id) < ((SELECT since FROM noted), $3)),
           NOT EXISTS (SELECT 1 FROM mine)";

/// The take's transaction: one snapshot for the holder's row, its run and the waiters (under
/// READ COMMITTED the holder's run could be read from before it reached execute while its row
/// is read as taken, and two runs would hold the target; a row changed since the snapshot fails
/// the statement instead, a serialization failure: busy, look again). Its commit need not wait
/// for the disk: no command runs on the strength of a take alone (at most a health check,
/// which changes nothing), and the first command's claim, committed before the command
/// starts, flushes the take with it. A take lost in a Postgres crash before that is taken
/// again by the run's redelivery.
const BEGIN: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ; SET LOCAL synchronous_commit TO off";

/// A gap between two looks of a waiting run longer than this is not counted as waiting (the
/// retries are at most 5 s apart: a longer gap is a crew that was down).
const LOOK_GAP: Duration = Duration::from_secs(30);

/// A waiter that has not looked for this long is not waited for, nor counted ahead of others:
/// three times the longest retry, so a run whose redelivery is handled in time is not passed
/// over (one held up longer behind a full execute stage may be: order only, never safety),
/// and a target freed while the next in line backs off from a failure (up to 30 s) is not
/// left idle.
const LIVE: Duration = Duration::from_secs(15);

impl Store {
    /// Take `service` on `host` for attempt `attempt` of `run`, unless another run is
    /// remediating it there or has waited longer for it.
    #[tracing::instrument(name = "db_write", skip_all, fields(op = "take_target"))]
    pub async fn take_target(
        &self,
        service: &str,
        host: &str,
        run: Uuid,
        attempt: u32,
    ) -> Result<TargetLock, StoreError> {
        let client = self.client().await?;
        let take = client.prepare_cached(TAKE).await?;
        let (attempt, gap, live) = (attempt as i32, LOOK_GAP.as_secs_f64(), LIVE.as_secs_f64());
        // BEGIN, the statement and COMMIT go out together, one round trip: each request is
        // sent when first polled, and `join3` polls all three at once, in order, so none can
        // be left unsent (a connection left inside a transaction) by a caller that gives up. A
        // failed statement turns the COMMIT into a rollback.
        let (begun, taken, committed) = futures::future::join3(
            client.batch_execute(BEGIN),
            client.query_one(&take, &[&service, &host, &run, &attempt, &gap, &live]),
            client.batch_execute("COMMIT"),
        )
        .await;
        begun?;
        let row = match taken {
            Ok(row) => row,
            Err(e) if e.code() == Some(&SqlState::T_R_SERIALIZATION_FAILURE) => {
                committed?;
                return Ok(TargetLock::Busy {
                    holder: None,
                    waiting: Duration::ZERO,
                    ahead: 0,
                    queue: 0,
                    first: false,
                });
            }
            Err(e) => return Err(e.into()),
        };
        committed?;
        if row.get(0) {
            return Ok(TargetLock::Held { remediated_since: row.get(1), started: row.get(2) });
        }
        let waiting = Duration::from_secs_f64(row.get::<_, Option<f64>>(4).unwrap_or(0.0).max(0.0));
        let count = |n: i64| u32::try_from(n).unwrap_or(u32::MAX);
        let ahead = count(row.get::<_, Option<i64>>(5).unwrap_or(0));
        let queue = count(row.get::<_, Option<i64>>(6).unwrap_or(0));
        Ok(TargetLock::Busy { holder: row.get(3), waiting, ahead, queue, first: row.get(7) })
    }
}
