//! One remediation at a time on a target (a service on its host): see
//! schemas/migrations/0007_target_locks.sql.

use super::{Store, StoreError};
use std::time::Duration;
use tokio_postgres::error::SqlState;
use tokio_postgres::IsolationLevel;
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
    /// Another run is executing or verifying a plan there (`holder`; `None`: it changed hands
    /// while we looked). `waiting`: since this attempt first found it taken; `ahead`: runs
    /// of the target waiting since before that.
    Busy { holder: Option<Uuid>, waiting: Duration, ahead: u32 },
}

/// Take the row unless another run holds it: a holder lets go once its run is closed or past
/// verify. The same attempt taking it again (a redelivery) keeps who held it before; a new
/// attempt of the same run starts afresh.
const TAKE: &str = "
    WITH taken AS (
        INSERT INTO target_locks AS l (service, host, run_id, attempt) VALUES ($1, $2, $3, $4)
        ON CONFLICT (service, host) DO UPDATE SET
            run_id = excluded.run_id,
            attempt = excluded.attempt,
            taken_at = CASE WHEN (l.run_id, l.attempt) = (excluded.run_id, excluded.attempt)
                            THEN l.taken_at ELSE now() END,
            previous_run = CASE WHEN (l.run_id, l.attempt) = (excluded.run_id, excluded.attempt) THEN l.previous_run
                                WHEN l.run_id = excluded.run_id THEN NULL
                                ELSE l.run_id END
        WHERE l.run_id = excluded.run_id OR NOT EXISTS (
            SELECT 1 FROM runs h WHERE h.id = l.run_id
               AND h.status IN ('open', 'waiting_approval') AND h.stage IN ('execute', 'verify'))
        RETURNING previous_run),
    -- Taken: this run waits no more.
    forgot AS (DELETE FROM target_waits WHERE run_id = $3 AND EXISTS (SELECT 1 FROM taken))
    SELECT CASE WHEN p.updated_at > r.created_at THEN t.previous_run END,
           EXISTS (SELECT 1 FROM executions e WHERE e.run_id = $3 AND e.attempt = $4)
    FROM taken t LEFT JOIN runs r ON r.id = $3 LEFT JOIN runs p ON p.id = t.previous_run";

/// Note the attempt as waiting (from its first look; a gap between two looks longer than
/// `$5` seconds is not counted: nobody was looking); forget the target's waiters whose runs
/// stopped waiting; who holds the target, how long this attempt has waited, and how many
/// runs still waiting there have waited longer.
const WAIT: &str = "
    WITH gone AS (
        DELETE FROM target_waits w WHERE w.service = $1 AND w.host = $2 AND w.run_id <> $3
           AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = w.run_id AND r.attempt = w.attempt
                              AND r.status = 'open' AND r.stage = 'execute')),
    noted AS (
        INSERT INTO target_waits AS w (run_id, attempt, service, host) VALUES ($3, $4, $1, $2)
        ON CONFLICT (run_id, attempt) DO UPDATE SET
            since = CASE WHEN now() - w.looked > make_interval(secs => $5) THEN w.since + (now() - w.looked)
                         ELSE w.since END,
            looked = now()
        RETURNING since)
    SELECT (SELECT run_id FROM target_locks WHERE service = $1 AND host = $2),
           EXTRACT(EPOCH FROM now() - noted.since)::float8,
           (SELECT count(*) FROM target_waits w JOIN runs r ON r.id = w.run_id AND r.attempt = w.attempt
             WHERE w.service = $1 AND w.host = $2 AND r.status = 'open' AND r.stage = 'execute'
               AND (w.since, w.run_id) < (noted.since, $3))
    FROM noted";

/// A gap between two looks of a waiting run longer than this is not counted as waiting (the
/// retries are at most 5 s apart: a longer gap is a crew that was down).
const LOOK_GAP: Duration = Duration::from_secs(30);

impl Store {
    /// Take `service` on `host` for attempt `attempt` of `run`, unless another run is
    /// remediating it there.
    #[tracing::instrument(name = "db_write", skip_all, fields(op = "take_target"))]
    pub async fn take_target(
        &self,
        service: &str,
        host: &str,
        run: Uuid,
        attempt: u32,
    ) -> Result<TargetLock, StoreError> {
        let mut client = self.client().await?;
        // One snapshot for the holder's row and its run: under READ COMMITTED the holder's
        // run could be read from before it reached execute while its row is read as taken,
        // and two runs would hold the target. A row changed since the snapshot fails the
        // statement instead (a serialization failure): busy, look again.
        let tx = client.build_transaction().isolation_level(IsolationLevel::RepeatableRead).start().await?;
        let taken = async {
            let take = tx.prepare_cached(TAKE).await?;
            let args: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&service, &host, &run, &(attempt as i32)];
            if let Some(row) = tx.query_opt(&take, &args).await? {
                return Ok(TargetLock::Held { remediated_since: row.get(0), started: row.get(1) });
            }
            let wait = tx.prepare_cached(WAIT).await?;
            let gap = LOOK_GAP.as_secs_f64();
            let row = tx.query_one(&wait, &[&service, &host, &run, &(attempt as i32), &gap]).await?;
            let holder = row.get::<_, Option<Uuid>>(0).filter(|h| *h != run);
            let waiting = Duration::from_secs_f64(row.get::<_, Option<f64>>(1).unwrap_or(0.0).max(0.0));
            let ahead = u32::try_from(row.get::<_, i64>(2)).unwrap_or(u32::MAX);
            Ok::<_, tokio_postgres::Error>(TargetLock::Busy { holder, waiting, ahead })
        }
        .await;
        match taken {
            Ok(lock) => {
                tx.commit().await?;
                Ok(lock)
            }
            Err(e) if e.code() == Some(&SqlState::T_R_SERIALIZATION_FAILURE) => {
                Ok(TargetLock::Busy { holder: None, waiting: Duration::ZERO, ahead: 0 })
            }
            Err(e) => Err(e.into()),
        }
    }
}
