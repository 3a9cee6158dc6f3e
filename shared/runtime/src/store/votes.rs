//! Read-only queries for the chat bridges: who has approved a plan that needs a quorum.

use super::{Store, StoreError};
use uuid::Uuid;

impl Store {
    /// The distinct approvers counted so far for `plan_hash` of `run`, sorted: those among
    /// `approvers` (the configured ones; a vote of someone removed since counts no more).
    pub async fn approval_voters(
        &self,
        run: Uuid,
        plan_hash: &str,
        approvers: &[String],
    ) -> Result<Vec<String>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT DISTINCT approver FROM approval_votes WHERE run_id = $1 AND plan_hash = $2
                   AND approver = ANY($3) ORDER BY approver",
                &[&run, &plan_hash, &approvers],
            )
            .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// The distinct approvers of `plan_hash` once `approver`'s vote, just published, is
    /// counted (the crew records votes as they arrive: a vote still in flight counts later).
    pub async fn voters_with(
        &self,
        run: Uuid,
        plan_hash: &str,
        approver: &str,
        approvers: &[String],
    ) -> Result<Vec<String>, StoreError> {
        let mut voters = self.approval_voters(run, plan_hash, approvers).await?;
        if !voters.iter().any(|v| v == approver) {
            voters.push(approver.to_string());
            voters.sort();
        }
        Ok(voters)
    }
}
