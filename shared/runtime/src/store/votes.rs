//! Read-only queries for the chat bridges: who has approved a plan that needs a quorum.

use super::{Store, StoreError};
use uuid::Uuid;

impl Store {
    /// The distinct approvers counted so far for `plan_hash` of `run`, sorted.
    pub async fn approval_voters(&self, run: Uuid, plan_hash: &str) -> Result<Vec<String>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT DISTINCT approver FROM approval_votes WHERE run_id = $1 AND plan_hash = $2 ORDER BY approver",
                &[&run, &plan_hash],
            )
            .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }
}
