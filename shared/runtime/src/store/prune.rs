//! Retention: nothing is deleted as pitcrew runs; `pitcrew prune` deletes what is older than
//! a cutoff, in batches (each its own transaction, its locks short).

use super::{Store, StoreError};
use chrono::{DateTime, Utc};

/// Runs closed before `$1` (a run open for long, closed lately, is kept), up to `$2`, with
/// everything that belongs to them: their incident and those folded into it that started no
/// run of their own (and the timelines of both), evaluations, approvals and
/// votes, executions and released claims, episodes, model usage, target waits. One statement: the foreign keys are
/// checked at its end, when the children are gone too. Runs another transaction holds are
/// left for the next batch.
const PRUNE_RUNS: &str = "
    WITH doomed AS (
        SELECT id FROM runs WHERE created_at < $1 AND coalesce(finished_at, created_at) < $1
           AND status IN ('resolved', 'escalated')
         ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED),
    folded AS (SELECT i.id FROM incidents i JOIN doomed d ON i.duplicate_of = d.id
                WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = i.id)),
    ev AS (DELETE FROM run_events x WHERE x.run_id IN (SELECT id FROM doomed UNION ALL SELECT id FROM folded)),
    ep AS (DELETE FROM episodes x USING doomed d WHERE x.run_id = d.id),
    evl AS (DELETE FROM evaluations x USING doomed d WHERE x.run_id = d.id),
    ap AS (DELETE FROM approvals x USING doomed d WHERE x.run_id = d.id),
    av AS (DELETE FROM approval_votes x USING doomed d WHERE x.run_id = d.id),
    ex AS (DELETE FROM executions x USING doomed d WHERE x.run_id = d.id),
    er AS (DELETE FROM execution_releases x USING doomed d WHERE x.run_id = d.id),
    lu AS (DELETE FROM llm_usage x USING doomed d WHERE x.run_id = d.id),
    tw AS (DELETE FROM target_waits x USING doomed d WHERE x.run_id = d.id),
    r AS (DELETE FROM runs x USING doomed d WHERE x.id = d.id RETURNING x.id),
    inc AS (DELETE FROM incidents x WHERE x.id IN (SELECT id FROM doomed UNION ALL SELECT id FROM folded))
    SELECT count(*) FROM r";

/// Incidents received before `$1` that started no run and joined none that is still kept
/// (refused at intake; folded into a run pruned before), up to `$2`, with their timelines.
const PRUNE_ORPHANS: &str = "
    WITH doomed AS (
        SELECT i.id FROM incidents i
         WHERE i.received_at < $1
           AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = i.id)
           AND (i.duplicate_of IS NULL OR NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = i.duplicate_of))
         ORDER BY i.received_at LIMIT $2),
    ev AS (DELETE FROM run_events x USING doomed d WHERE x.run_id = d.id),
    inc AS (DELETE FROM incidents x USING doomed d WHERE x.id = d.id RETURNING x.id)
    SELECT count(*) FROM inc";

/// The timelines of incidents refused at intake before `$1` that left no incident row (refused
/// before anything was stored), up to `$2` of them, whole. Counted with the incidents above.
const PRUNE_REFUSED: &str = "
    WITH doomed AS (
        SELECT DISTINCT x.run_id FROM run_events x
         WHERE x.kind = 'rejected' AND x.at < $1
           AND NOT EXISTS (SELECT 1 FROM incidents i WHERE i.id = x.run_id)
           AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = x.run_id)
         LIMIT $2),
    gone AS (DELETE FROM run_events x USING doomed d WHERE x.run_id = d.run_id RETURNING x.run_id)
    SELECT count(DISTINCT run_id) FROM gone";

/// The gateway's audit lines written before `$1`, up to `$2`.
const PRUNE_AUDIT: &str = "
    WITH doomed AS (SELECT id FROM gateway_audit WHERE at < $1 ORDER BY at LIMIT $2),
    gone AS (DELETE FROM gateway_audit x USING doomed d WHERE x.id = d.id RETURNING x.id)
    SELECT count(*) FROM gone";

/// The count of [`Pruned`] a query's deletions add to.
type Counted = fn(&mut Pruned) -> &mut i64;

/// What one batch of pruning deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Closed runs, each with its incident and all that belonged to it.
    pub runs: i64,
    /// Incidents that had started no run (refused, or folded into a run pruned earlier), and
    /// the timelines of those refused before anything of them was stored.
    pub incidents: i64,
    /// Lines of the gateway's audit trail.
    pub audit: i64,
}

impl Pruned {
    pub fn is_empty(&self) -> bool {
        *self == Pruned::default()
    }
}

impl Store {
    /// One batch of pruning: up to `batch` rows older than `before`, runs first, then (once
    /// none is left) incidents without a run, then audit lines. Open and parked runs are never
    /// touched, however old. Call until it prunes nothing.
    ///
    /// One kind at a time: the search for incidents without a run passes every old incident
    /// that still has one, so it waits until the runs that can go are gone (run with each
    /// batch, a long backlog would cost it as much each time).
    pub async fn prune(&self, before: DateTime<Utc>, batch: i64) -> Result<Pruned, StoreError> {
        let client = self.client().await?;
        let mut pruned = Pruned::default();
        let kinds: [(&str, Counted); 4] = [
            (PRUNE_RUNS, |p| &mut p.runs),
            (PRUNE_ORPHANS, |p| &mut p.incidents),
            (PRUNE_REFUSED, |p| &mut p.incidents),
            (PRUNE_AUDIT, |p| &mut p.audit),
        ];
        for (sql, counted) in kinds {
            let stmt = client.prepare_cached(sql).await?;
            let count: i64 = client.query_one(&stmt, &[&before, &batch]).await?.get(0);
            *counted(&mut pruned) += count;
            if count >= batch {
                break;
            }
        }
        Ok(pruned)
    }
}
