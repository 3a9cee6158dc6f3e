//! A click turned into a decision, the same for every chat: the chat user mapped to an
//! approver, the approver checked against `[approvers]`, and the decision published through
//! the runtime, which refuses a stale plan, a plan already decided and a click racing a
//! decision not yet recorded. Refusals are errors whose text is shown to the clicker
//! as is.

use pitcrew_model::{ApprovalRequest, Decision};
use pitcrew_runtime::approvals::{submit, DecisionInput};
use pitcrew_runtime::{Bus, Config, Store};
use std::collections::BTreeMap;
use uuid::Uuid;

/// Decisions under way at once in one chat bridge; a click past them is told to click again.
/// Each holds a task (its caller may have gone: the decision runs to its end) and, while
/// Postgres or NATS is slow, a wait for a pooled connection.
pub const MAX_DECIDING: usize = 64;

/// What a clicker is told when [`MAX_DECIDING`] decisions are under way.
pub const TOO_MANY_DECIDING: &str = "Too many decisions are under way: click again in a moment.";

/// What a button said, and who clicked it.
#[derive(Debug, Clone)]
pub struct Click<'a> {
    /// `slack`, `mattermost`: the decision's channel.
    pub chat: &'static str,
    /// The chat's user id.
    pub user: &'a str,
    pub run: Uuid,
    pub plan_hash: &'a str,
    /// The attempt the button was made for (None: a button older than this field).
    pub attempt: Option<u32>,
    pub decision: Decision,
}

/// What the clicker is told after a click that counted.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// The plan is decided: show who decided on the message.
    Decided { req: Box<ApprovalRequest>, approver: String },
    /// One approval of several needed: tell the clicker, leave the buttons.
    Counted { note: String },
}

/// The approver behind a chat user, or why there is none.
pub fn approver<'a>(
    cfg: &Config,
    users: &'a BTreeMap<String, String>,
    chat: &str,
    user: &str,
) -> Result<&'a str, String> {
    if user.is_empty() {
        return Err("the click names no user".into());
    }
    let approver = users.get(user).ok_or_else(|| {
        let label = if chat == "slack" { "Slack" } else { "Mattermost" };
        format!("{label} user {user} is not mapped to an approver (add it under [bridge.{chat}.users])")
    })?;
    match cfg.refuse_approver(approver) {
        Some(why) => Err(why),
        None => Ok(approver),
    }
}

/// Publish the click's decision, or refuse it with the reason.
pub async fn decide(
    bus: &Bus,
    store: &Store,
    cfg: &Config,
    users: &BTreeMap<String, String>,
    click: Click<'_>,
) -> Result<Outcome, String> {
    let chat = click.chat;
    let decided = decide_click(bus, store, cfg, users, click).await;
    let result = match &decided {
        Ok(Outcome::Decided { .. }) => "decided",
        Ok(Outcome::Counted { .. }) => "counted",
        Err(_) => "refused",
    };
    crate::CLICKS.inc(&[chat, result]);
    decided
}

async fn decide_click(
    bus: &Bus,
    store: &Store,
    cfg: &Config,
    users: &BTreeMap<String, String>,
    click: Click<'_>,
) -> Result<Outcome, String> {
    let Click { chat, user, run, plan_hash, attempt, decision } = click;
    if !matches!(decision, Decision::Approve | Decision::Deny) {
        return Err("only approve and deny can be clicked".into());
    }
    let approver = approver(cfg, users, chat, user)?;
    let label = if chat == "slack" { "Slack" } else { "Mattermost" };
    let reason = (decision == Decision::Deny).then(|| format!("denied in {label} by {approver}"));
    let input = DecisionInput {
        run,
        plan_hash: Some(plan_hash),
        attempt,
        decision,
        by: approver,
        reason,
        channel: chat,
        racing: Some(cfg),
    };
    let req = submit(bus, Some(store), input).await.map_err(|e| format!("{e:#}"))?;
    tracing::info!(chat, user, approver, %run, plan = plan_hash, decision = decision.as_str(), "chat decision published");
    if decision == Decision::Approve && req.quorum > 1 {
        // The crew counts the votes; this click completes the quorum when the approvers
        // already counted and this one are enough (a vote still in flight counts later).
        let voters = store.voters_with(run, plan_hash, approver, &cfg.approver_names()).await.unwrap_or_else(|e| {
            tracing::warn!(%run, error = %e, "cannot read the votes so far: the message is left as it is");
            vec![approver.to_string()]
        });
        if (voters.len() as u32) < req.quorum {
            return Ok(Outcome::Counted {
                note: format!(
                    "Your approval of plan {plan_hash} is counted ({} of {}): it runs once {} distinct approvers approve.",
                    voters.len(),
                    req.quorum,
                    req.quorum
                ),
            });
        }
        return Ok(Outcome::Decided { req: Box::new(req), approver: voters.join(", ") });
    }
    Ok(Outcome::Decided { req: Box::new(req), approver: approver.to_string() })
}
