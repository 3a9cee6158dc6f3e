//! Read queries for the HTTP API (filtered run lists, a run's evaluations and executions in
//! full) and the gateway's audit trail.

use super::{RunSummary, Store, StoreError};
use chrono::{DateTime, Utc};
use uuid::Uuid;

/// Which runs to list; every field narrows the list, none means all.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    /// `open`, `waiting_approval`, `resolved` or `escalated`.
    pub status: Option<String>,
    pub service: Option<String>,
    /// Runs created at or after.
    pub since: Option<DateTime<Utc>>,
    /// Runs created before.
    pub until: Option<DateTime<Utc>>,
    pub limit: i64,
}

impl RunFilter {
    /// The statement `Store::list_runs` runs: only the filters given, as plain predicates, the
    /// status as a literal (one of the four a run may have; any other matches nothing) and
    /// the rest as parameters (`$1` on) in the order service, since, until, then the limit.
    /// `($1 IS NULL OR status = $1)` would keep a cached generic plan from any index, and a
    /// rare status would be found by reading every run; with the literal, the planner sees
    /// that `open` and `waiting_approval` are what the partial index of open runs
    /// (`runs_one_open_per_fingerprint`) holds: no index of its own for the status (every
    /// transition would pay for one).
    pub fn statement(&self) -> String {
        let mut sql = String::from(
            "SELECT r.id, i.service, i.error, r.status, r.stage, r.attempt, r.reason, r.created_at, r.updated_at \
             FROM runs r JOIN incidents i ON i.id = r.id WHERE true",
        );
        if let Some(status) = &self.status {
            match ["open", "waiting_approval", "resolved", "escalated"].iter().find(|s| **s == status.as_str()) {
                Some(known) => sql.push_str(&format!(" AND r.status = '{known}'")),
                None => sql.push_str(" AND false"),
            }
        }
        let given = [
            self.service.as_ref().map(|_| "i.service ="),
            self.since.as_ref().map(|_| "r.created_at >="),
            self.until.as_ref().map(|_| "r.created_at <"),
        ];
        let mut n = 0;
        for predicate in given.into_iter().flatten() {
            n += 1;
            sql.push_str(&format!(" AND {predicate} ${n}"));
        }
        sql.push_str(&format!(" ORDER BY r.created_at DESC LIMIT ${}", n + 1));
        sql
    }
}

/// One stored evaluation of a diagnosis and plan.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EvaluationRow {
    pub attempt: i32,
    pub regeneration: i32,
    pub score: f64,
    pub verdict: String,
    pub checks: serde_json::Value,
    pub feedback: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// One command run (or started) for a run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ExecutionRow {
    pub attempt: i32,
    pub index: i32,
    pub command: String,
    pub host: String,
    pub worker: String,
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// None while the command runs.
    pub status: Option<String>,
    pub exit_code: Option<i32>,
    pub output: Option<String>,
}

/// A command's claim removed with nothing run under it (`execution_releases`): the audit of
/// why a command may show as claimed more than once.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReleasedClaim {
    pub attempt: i32,
    pub index: i32,
    pub command: String,
    pub host: String,
    pub worker: String,
    pub claimed_at: DateTime<Utc>,
    pub released_at: DateTime<Utc>,
    pub why: String,
}

/// One line of the gateway's audit trail. `principal` is a key's owner (or `anonymous`),
/// never the key.
#[derive(Debug, Clone)]
pub struct AuditEntry {
    pub principal: String,
    pub role: Option<String>,
    pub method: String,
    pub path: String,
    pub status: i32,
    pub outcome: String,
    pub remote: Option<String>,
    pub run_id: Option<Uuid>,
}

impl Store {
    /// Runs matching `filter`, newest first.
    pub async fn list_runs(&self, filter: &RunFilter) -> Result<Vec<RunSummary>, StoreError> {
        let client = self.client().await?;
        let sql = filter.statement();
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = Vec::new();
        if let Some(service) = &filter.service {
            params.push(service);
        }
        for value in [&filter.since, &filter.until].into_iter().flatten() {
            params.push(value);
        }
        params.push(&filter.limit);
        let stmt = client.prepare_cached(&sql).await?;
        let rows = client.query(&stmt, &params).await?;
        Ok(rows
            .iter()
            .map(|r| RunSummary {
                id: r.get(0),
                service: r.get(1),
                error: r.get(2),
                status: r.get(3),
                stage: r.get(4),
                attempt: r.get(5),
                reason: r.get(6),
                created_at: r.get(7),
                updated_at: r.get(8),
            })
            .collect())
    }

    /// When the run was created, last changed and finished: (created, updated, finished).
    pub async fn run_times(
        &self,
        run: Uuid,
    ) -> Result<Option<(DateTime<Utc>, DateTime<Utc>, Option<DateTime<Utc>>)>, StoreError> {
        let client = self.client().await?;
        let row =
            client.query_opt("SELECT created_at, updated_at, finished_at FROM runs WHERE id = $1", &[&run]).await?;
        Ok(row.map(|r| (r.get(0), r.get(1), r.get(2))))
    }

    /// Every evaluation of a run, in order.
    pub async fn evaluations_of(&self, run: Uuid) -> Result<Vec<EvaluationRow>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT attempt, regeneration, score, verdict, checks, feedback, created_at FROM evaluations
                 WHERE run_id = $1 ORDER BY attempt, regeneration",
                &[&run],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| EvaluationRow {
                attempt: r.get(0),
                regeneration: r.get(1),
                score: r.get(2),
                verdict: r.get(3),
                checks: r.get(4),
                feedback: r.get(5),
                created_at: r.get(6),
            })
            .collect())
    }

    /// Every command of a run with its outcome, in order.
    pub async fn execution_rows(&self, run: Uuid) -> Result<Vec<ExecutionRow>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT attempt, idx, command, host, worker, started_at, finished_at, status, exit_code, output
                 FROM executions WHERE run_id = $1 ORDER BY attempt, idx",
                &[&run],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| ExecutionRow {
                attempt: r.get(0),
                index: r.get(1),
                command: r.get(2),
                host: r.get(3),
                worker: r.get(4),
                started_at: r.get(5),
                finished_at: r.get(6),
                status: r.get(7),
                exit_code: r.get(8),
                output: r.get(9),
            })
            .collect())
    }

    /// Every claim of a run's commands removed with nothing run under it, in order.
    pub async fn released_claims(&self, run: Uuid) -> Result<Vec<ReleasedClaim>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT attempt, idx, command, host, worker, claimed_at, released_at, why
                 FROM execution_releases WHERE run_id = $1 ORDER BY released_at, attempt, idx",
                &[&run],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| ReleasedClaim {
                attempt: r.get(0),
                index: r.get(1),
                command: r.get(2),
                host: r.get(3),
                worker: r.get(4),
                claimed_at: r.get(5),
                released_at: r.get(6),
                why: r.get(7),
            })
            .collect())
    }

    /// Append to the gateway's audit trail.
    #[tracing::instrument(name = "db_write", skip_all, fields(op = "record_audit"))]
    pub async fn record_audit(&self, e: &AuditEntry) -> Result<(), StoreError> {
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(
                "INSERT INTO gateway_audit (principal, role, method, path, status, outcome, remote, run_id)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            )
            .await?;
        client
            .execute(&stmt, &[&e.principal, &e.role, &e.method, &e.path, &e.status, &e.outcome, &e.remote, &e.run_id])
            .await?;
        Ok(())
    }

    /// A cheap round trip: the readiness probe.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        client.query_one("SELECT 1", &[]).await?;
        Ok(())
    }

    /// Whether Postgres takes writes now: reachable, and not read-only (a standby, a primary
    /// demoted by a failover, a read-only default answer `SELECT 1` but refuse every write).
    /// Read-only is `StoreError::Unavailable`: transient, an outage for writers.
    pub async fn writable(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        let read_only: bool = client
            .query_one("SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'", &[])
            .await?
            .get(0);
        if read_only {
            return Err(StoreError::Unavailable(
                "Postgres is read-only (a standby, or a primary demoted by a failover): writes wait".into(),
            ));
        }
        Ok(())
    }
}
