//! Read-only queries for observing the crew: the pending-approvals gauge and `pitcrew top`.

use super::{Store, StoreError};

impl Store {
    /// Approval requests still waiting for a decision.
    pub async fn pending_approval_count(&self) -> Result<i64, StoreError> {
        let client = self.client().await?;
        let stmt = client.prepare_cached("SELECT count(*) FROM approvals WHERE decision IS NULL").await?;
        Ok(client.query_one(&stmt, &[]).await?.get(0))
    }
}

impl Store {
    /// When the approval request for `plan_hash` of `run` was made and until when it may be
    /// decided, as Postgres wrote them (by its clock: see `Record::Approval`).
    pub async fn approval_window(
        &self,
        run: uuid::Uuid,
        plan_hash: &str,
    ) -> Result<Option<(chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>)>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                "SELECT requested_at, expires_at FROM approvals WHERE run_id = $1 AND plan_hash = $2",
                &[&run, &plan_hash],
            )
            .await?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }
}
