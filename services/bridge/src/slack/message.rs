//! What the bridge says in Slack: an approval request as Block Kit blocks with Approve/Deny
//! buttons (each button's value names the run and the exact plan), and the same message with
//! the outcome in place of the buttons once someone decided.

use crate::clip;
use pitcrew_model::{ApprovalRequest, Decision};
use serde_json::{json, Value};
use uuid::Uuid;

/// Slack's limit on a section's text, with room to spare.
const SECTION_MAX: usize = 2900;
/// Lines of evidence shown.
const EVIDENCE_LINES: usize = 3;

/// The `action_id`s of the two buttons.
pub const APPROVE: &str = "approve";
pub const DENY: &str = "deny";

/// `chat.postMessage` body for `req` in `channel`: Approve only when every command is shown
/// whole (each in a block of its own).
pub fn request(channel: &str, req: &ApprovalRequest) -> Value {
    let mut blocks = describe(req);
    let value = button_value(req.run_id, &req.plan_hash, req.attempt);
    let approve = json!({"type": "button", "action_id": APPROVE, "style": "primary", "value": value,
                         "text": {"type": "plain_text", "text": "Approve"}});
    let deny = json!({"type": "button", "action_id": DENY, "style": "danger", "value": value,
                      "text": {"type": "plain_text", "text": "Deny"}});
    let elements = if req.plan.iter().all(|c| command_text(c).is_some()) {
        vec![approve, deny]
    } else {
        blocks.push(json!({"type": "context", "elements": [{"type": "mrkdwn", "text": escape(&crate::too_long_to_approve_here(req))}]}));
        vec![deny]
    };
    blocks.push(json!({"type": "actions", "block_id": "pitcrew_approval", "elements": elements}));
    json!({"channel": channel, "text": fallback(req), "blocks": blocks, "unfurl_links": false})
}

/// `chat.update` body: the request as posted, the buttons replaced by who decided what.
pub fn decided(
    channel: &str,
    ts: &str,
    req: &ApprovalRequest,
    decision: Decision,
    approver: &str,
    user: &str,
) -> Value {
    let verb = match decision {
        Decision::Approve => "Approved",
        Decision::Deny => "Denied",
        Decision::Expire => "Expired",
    };
    let mut blocks = describe(req);
    blocks.push(json!({
        "type": "section",
        "text": {"type": "mrkdwn", "text": format!(
            "*{verb} by {}* (<@{}>) at {}", escape(approver), escape(user), chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC")
        )}
    }));
    json!({"channel": channel, "ts": ts, "text": format!("{verb} by {approver}: {}", fallback(req)), "blocks": blocks})
}

/// A `response_url` answer replacing the message with the outcome (when there is no bot
/// token for `chat.update`).
pub fn replaced(req: &ApprovalRequest, decision: Decision, approver: &str, user: &str) -> Value {
    let mut body = decided("", "", req, decision, approver, user);
    if let Some(fields) = body.as_object_mut() {
        fields.remove("channel");
        fields.remove("ts");
        fields.insert("replace_original".into(), json!(true));
    }
    body
}

/// An answer only the clicker sees, leaving the message as it is.
pub fn ephemeral(text: &str) -> Value {
    json!({"response_type": "ephemeral", "replace_original": false, "text": text})
}

/// `<run>:<plan hash>`: what a button carries back.
pub fn button_value(run: Uuid, plan_hash: &str, attempt: u32) -> String {
    format!("{run}:{plan_hash}:{attempt}")
}

/// The run, plan hash and attempt a button names (no attempt on a button posted before it was
/// added), or why the value is not one of ours.
pub fn parse_button_value(value: &str) -> Result<(Uuid, String, Option<u32>), String> {
    let (run, rest) =
        value.split_once(':').ok_or_else(|| format!("button value '{}' is not <run>:<plan>", clip(value, 80)))?;
    let (hash, attempt) = match rest.split_once(':') {
        Some((hash, attempt)) => {
            let n = attempt
                .parse::<u32>()
                .map_err(|_| format!("button value names no attempt: '{}'", clip(attempt, 80)))?;
            (hash, Some(n))
        }
        None => (rest, None),
    };
    let run = Uuid::parse_str(run).map_err(|_| format!("button value names no run id: '{}'", clip(run, 80)))?;
    if hash.is_empty() || hash.len() > 128 || !hash.chars().all(|c| c.is_ascii_alphanumeric()) {
        return Err(format!("button value names no plan hash: '{}'", clip(hash, 80)));
    }
    Ok((run, hash.to_string(), attempt))
}

fn fallback(req: &ApprovalRequest) -> String {
    clip(&format!("Approval needed for {}: {}", req.service, req.plan.join(" ; ")), 500)
}

fn describe(req: &ApprovalRequest) -> Vec<Value> {
    let host = req.host.as_deref().map(|h| format!(" on {}", escape(h))).unwrap_or_default();
    let mut summary = format!(
        "*Approval needed: {}{host}*\n*Risk:* {}   *Policy rule:* {}   *Attempt:* {}\n*Error:* {}\n*Diagnosis:* {}",
        escape(&req.service),
        escape(&req.risk),
        escape(&req.rule),
        req.attempt,
        escape(&clip(&req.error, 500)),
        escape(&clip(&req.diagnosis, 1000)),
    );
    if req.quorum > 1 {
        summary.push_str(&format!("\n*Needs:* {} distinct approvers", req.quorum));
    }
    let mut blocks = vec![
        json!({"type": "section", "text": {"type": "mrkdwn", "text": clip(&summary, SECTION_MAX)}}),
        json!({"type": "section", "text": {"type": "mrkdwn", "text": "*Commands* (run in order)"}}),
    ];
    for c in &req.plan {
        let text = command_text(c).unwrap_or_else(|| clip(&code(c), SECTION_MAX - 40) + " (cut: too long to show)");
        blocks.push(json!({"type": "section", "text": {"type": "mrkdwn", "text": text}}));
    }
    let evidence: Vec<String> =
        req.evidence.iter().take(EVIDENCE_LINES).map(|e| format!("• {}", escape(&clip(e, 300)))).collect();
    if !evidence.is_empty() {
        blocks.push(json!({"type": "context", "elements": [{"type": "mrkdwn", "text": clip(&evidence.join("\n"), SECTION_MAX)}]}));
    }
    blocks.push(json!({"type": "context", "elements": [{"type": "mrkdwn", "text": format!(
        "run `{}` · plan `{}` · expires {}", req.run_id, escape(&req.plan_hash), req.expires_at.format("%Y-%m-%d %H:%M UTC")
    )}]}));
    blocks
}

/// A command as a code block.
fn code(c: &str) -> String {
    format!("```{}```", escape(&c.replace("```", "'''")))
}

/// A command as its own block's text, whole; None when it does not fit one.
fn command_text(c: &str) -> Option<String> {
    Some(code(c)).filter(|t| t.chars().count() <= SECTION_MAX)
}

/// Slack's mrkdwn control characters.
fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> ApprovalRequest {
        ApprovalRequest {
            run_id: Uuid::nil(),
            service: "web".into(),
            host: Some("web-1".into()),
            error: "HTTP 503 <wedged>".into(),
            attempt: 1,
            plan: vec!["kill -9 4242".into(), "systemctl start web".into()],
            plan_hash: "ab12".into(),
            risk: "critical".into(),
            rule: "kill-9".into(),
            diagnosis: "web is wedged".into(),
            evidence: vec!["curl: 503".into()],
            requested_at: chrono::Utc::now(),
            expires_at: chrono::Utc::now(),
            quorum: 1,
        }
    }

    #[test]
    fn a_request_shows_what_would_run_and_carries_run_and_plan_on_both_buttons() {
        let m = request("C1", &req());
        assert_eq!(m["channel"], "C1");
        let text = m.to_string();
        for want in ["kill -9 4242", "systemctl start web", "kill-9", "critical", "web is wedged", "&lt;wedged&gt;"] {
            assert!(text.contains(want), "{want} missing: {text}");
        }
        let actions = m["blocks"].as_array().unwrap().last().unwrap();
        let ids: Vec<&str> =
            actions["elements"].as_array().unwrap().iter().map(|b| b["action_id"].as_str().unwrap()).collect();
        assert_eq!(ids, [APPROVE, DENY]);
        let value = actions["elements"][0]["value"].as_str().unwrap();
        assert_eq!(parse_button_value(value).unwrap(), (Uuid::nil(), "ab12".to_string(), Some(req().attempt)));
        // A button posted before the attempt was carried.
        let old = format!("{}:ab12", Uuid::nil());
        assert_eq!(parse_button_value(&old).unwrap(), (Uuid::nil(), "ab12".to_string(), None));
        let done = decided("C1", "1.2", &req(), Decision::Approve, "ann", "U1");
        assert!(!done.to_string().contains("\"actions\""), "the buttons are gone");
        assert!(done["text"].as_str().unwrap().starts_with("Approved by ann"));
    }

    /// An approver sees every command whole before Approve: a long one gets a block of its
    /// own; one too long for any block is shown cut, and the message offers only Deny.
    #[test]
    fn approve_is_offered_only_for_a_plan_shown_whole() {
        let long = format!("/opt/web/fix {} --then-the-dangerous-tail", "x".repeat(700));
        let m = request("C1", &ApprovalRequest { plan: vec![long.clone(), "systemctl start web".into()], ..req() });
        let text = m.to_string();
        assert!(text.contains(&long), "shown whole: {text}");
        let actions = m["blocks"].as_array().unwrap().last().unwrap();
        assert_eq!(actions["elements"].as_array().unwrap().len(), 2, "approve and deny");
        let huge = format!("/opt/web/fix {} --then-the-dangerous-tail", "x".repeat(3000));
        let m = request("C1", &ApprovalRequest { plan: vec![huge], ..req() });
        let text = m.to_string();
        assert!(!text.contains("--then-the-dangerous-tail") && text.contains("cut: too long to show"), "{text}");
        let actions = m["blocks"].as_array().unwrap().last().unwrap();
        let ids: Vec<&str> =
            actions["elements"].as_array().unwrap().iter().map(|b| b["action_id"].as_str().unwrap()).collect();
        assert_eq!(ids, [DENY], "no Approve for what cannot be read");
        assert!(
            text.contains(
                "pitcrew approve 00000000-0000-0000-0000-000000000000 --by YOUR-NAME --plan ab12 --attempt 1"
            ),
            "{text}"
        );
    }

    #[test]
    fn foreign_button_values_are_refused() {
        assert!(parse_button_value("nope").is_err());
        assert!(parse_button_value("not-a-uuid:ab").is_err());
        assert!(parse_button_value(&format!("{}:", Uuid::nil())).is_err());
        assert!(parse_button_value(&format!("{}:a b", Uuid::nil())).is_err());
        assert!(parse_button_value(&format!("{}:ab:x", Uuid::nil())).is_err());
    }
}
