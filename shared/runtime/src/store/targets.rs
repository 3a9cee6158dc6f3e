//! One remediation at a time on a target (a service on its host): see
//! schemas/migrations/0007_target_locks.sql.

use super::{Store, StoreError};
use uuid::Uuid;

/// Whether a run may remediate its target now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetLock {
    /// The run holds the target (taken now, or already by an earlier delivery of its step).
    Held {
        /// Another run that took the target after this run opened: its remediation may have
        /// changed what this run's diagnosis saw.
        remediated_since: Option<Uuid>,
        /// Whether a command of this attempt was claimed already (by an earlier delivery).
        started: bool,
    },
    /// Another run is executing or verifying its plan there (`None`: it let go while we
    /// looked; try again).
    Busy(Option<Uuid>),
}

/// Take the row unless another run holds it: a holder lets go once its run is closed or past
/// verify. Taking it again (a redelivery) keeps who held it before.
const TAKE: &str = "
    WITH taken AS (
        INSERT INTO target_locks AS l (service, host, run_id) VALUES ($1, $2, $3)
        ON CONFLICT (service, host) DO UPDATE SET
            run_id = excluded.run_id,
            taken_at = CASE WHEN l.run_id = excluded.run_id THEN l.taken_at ELSE now() END,
            previous_run = CASE WHEN l.run_id = excluded.run_id THEN l.previous_run ELSE l.run_id END,
            previous_at = CASE WHEN l.run_id = excluded.run_id THEN l.previous_at ELSE l.taken_at END
        WHERE l.run_id = excluded.run_id OR NOT EXISTS (
            SELECT 1 FROM runs r WHERE r.id = l.run_id
               AND r.status IN ('open', 'waiting_approval') AND r.stage IN ('execute', 'verify'))
        RETURNING previous_run, previous_at)
    SELECT CASE WHEN t.previous_at > r.created_at THEN t.previous_run END,
           EXISTS (SELECT 1 FROM executions e WHERE e.run_id = $3 AND e.attempt = $4)
    FROM taken t LEFT JOIN runs r ON r.id = $3";

impl Store {
    /// Take `service` on `host` for `run`'s attempt `attempt`, unless another run is
    /// remediating it.
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
        if let Some(row) = client.query_opt(&take, &[&service, &host, &run, &(attempt as i32)]).await? {
            return Ok(TargetLock::Held { remediated_since: row.get(0), started: row.get(1) });
        }
        let holder = client
            .query_opt("SELECT run_id FROM target_locks WHERE service = $1 AND host = $2", &[&service, &host])
            .await?
            .map(|r| r.get::<_, Uuid>(0))
            .filter(|holder| *holder != run);
        Ok(TargetLock::Busy(holder))
    }
}
