//! What the bridge says in Mattermost: an approval request as a message attachment with
//! Approve/Deny buttons. Mattermost does not sign its action calls, so each button's context
//! carries an HMAC of its action, run and plan made with the bridge's action secret: only a
//! button this bridge made can decide, and only what it says.

use crate::clip;
use crate::secret::Secret;
use pitcrew_model::{ApprovalRequest, Decision};
use ring::hmac;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use uuid::Uuid;

const TEXT_MAX: usize = 9000;
/// The plan's commands shown whole in at most this many characters (else cut, and no Approve).
const COMMANDS_MAX: usize = 6000;

/// A button's context: what it decides, and the proof this bridge made it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Context {
    pub action: String,
    pub run: Uuid,
    pub plan_hash: String,
    /// The attempt whose request the button is on (signed; none on a button made before it
    /// was added).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    pub mac: String,
}

impl Context {
    pub fn new(secret: &Secret, action: &str, run: Uuid, plan_hash: &str, attempt: u32) -> Context {
        let key = hmac::Key::new(hmac::HMAC_SHA256, secret.expose().as_bytes());
        let tag = hmac::sign(&key, signed(action, run, plan_hash, Some(attempt)).as_bytes());
        Context {
            action: action.into(),
            run,
            plan_hash: plan_hash.into(),
            attempt: Some(attempt),
            mac: hex::encode(tag.as_ref()),
        }
    }

    /// The decision, if the MAC is this bridge's (checked in constant time).
    pub fn verify(&self, secret: &Secret) -> Result<Decision, String> {
        let bad = || "bad button context: it was not made by this bridge (wrong or changed MAC)".to_string();
        let tag = hex::decode(&self.mac).map_err(|_| bad())?;
        let key = hmac::Key::new(hmac::HMAC_SHA256, secret.expose().as_bytes());
        let text = signed(&self.action, self.run, &self.plan_hash, self.attempt);
        hmac::verify(&key, text.as_bytes(), &tag).map_err(|_| bad())?;
        match self.action.as_str() {
            "approve" => Ok(Decision::Approve),
            "deny" => Ok(Decision::Deny),
            other => Err(format!("unknown action '{other}': only approve and deny")),
        }
    }
}

fn signed(action: &str, run: Uuid, plan_hash: &str, attempt: Option<u32>) -> String {
    match attempt {
        Some(attempt) => format!("pitcrew/mattermost/v2:{action}:{run}:{plan_hash}:{attempt}"),
        None => format!("pitcrew/mattermost/v1:{action}:{run}:{plan_hash}"),
    }
}

/// `POST /api/v4/posts` body for `req` in `channel_id`.
pub fn request(channel_id: &str, action_url: &str, secret: &Secret, req: &ApprovalRequest) -> Value {
    let button = |action: &str, name: &str, style: &str| {
        json!({"id": action, "name": name, "style": style, "type": "button",
               "integration": {"url": action_url, "context": Context::new(secret, action, req.run_id, &req.plan_hash, req.attempt)}})
    };
    let mut attachment = describe(req);
    // Approve only beside the whole plan to its closing fence, as the text shows it (a plan
    // of backticks makes fences as long).
    let whole = commands(req);
    let shown_whole = whole.chars().count() <= COMMANDS_MAX
        && attachment["text"].as_str().is_some_and(|t| t.contains(&format!("\n{whole}\n{}", fence(&whole))));
    attachment["actions"] = if shown_whole {
        json!([button("approve", "Approve", "good"), button("deny", "Deny", "danger")])
    } else {
        if let Some(fields) = attachment["fields"].as_array_mut() {
            fields.push(json!({"short": false, "title": "Approve", "value": crate::too_long_to_approve_here(req)}));
        }
        json!([button("deny", "Deny", "danger")])
    };
    json!({"channel_id": channel_id, "message": "", "props": {"attachments": [attachment]}})
}

/// The action call's answer once decided: the post as it was, buttons replaced by the outcome.
pub fn decided(req: &ApprovalRequest, decision: Decision, approver: &str) -> Value {
    let verb = if decision == Decision::Approve { "Approved" } else { "Denied" };
    let mut attachment = describe(req);
    attachment["color"] = json!(if decision == Decision::Approve { "#2eb67d" } else { "#d9534f" });
    if let Some(fields) = attachment["fields"].as_array_mut() {
        fields.push(json!({"short": false, "title": "Decision", "value": format!(
            "{verb} by {approver} at {}", chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC")
        )}));
    }
    json!({"update": {"message": "", "props": {"attachments": [attachment]}}})
}

/// An answer only the clicker sees; the post stays as it is.
pub fn ephemeral(text: &str) -> Value {
    json!({"ephemeral_text": text})
}

/// The plan's commands, one a line, exactly as they run (shown in a fence longer than any run
/// of backticks they hold, so none closes it).
fn commands(req: &ApprovalRequest) -> String {
    req.plan.join("\n")
}

/// A fence no run of backticks in `text` closes: at least three.
fn fence(text: &str) -> String {
    let longest = text.split(|c| c != '`').map(str::len).max().unwrap_or(0);
    "`".repeat(longest.max(2) + 1)
}

/// Untrusted text (the alert's, the model's, evidence) shown as what it says: Markdown's
/// characters escaped, so it can make no link, image, heading, emphasis, quote or code block
/// (a code fence in an alert would swallow the commands' header and show the commands as
/// Markdown: `*.pid` in italics), nor a mention; one line.
fn inert(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        match c {
            '\\' | '`' | '*' | '_' | '[' | ']' | '(' | ')' | '#' | '>' | '<' | '~' | '|' | '!' | '@' | ':' => {
                out.push('\\');
                out.push(c);
            }
            '\r' | '\n' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

fn describe(req: &ApprovalRequest) -> Value {
    let host = req.host.as_deref().map(|h| format!(" on {h}")).unwrap_or_default();
    let shown = clip(&commands(req), COMMANDS_MAX);
    let fence = fence(&shown);
    let commands = format!("**Commands:**\n{fence}\n{shown}\n{fence}");
    // What precedes the commands takes the room they leave (escaping can double the error's
    // and the diagnosis's length): the text's cut falls on the evidence, never on a command
    // beside an Approve button.
    let head = format!(
        "**Error:** {}\n**Diagnosis:** {}\n",
        inert(&clip(&req.error, 500)),
        inert(&clip(&req.diagnosis, 1000)),
    );
    let mut text = clip(&head, TEXT_MAX.saturating_sub(commands.chars().count())) + &commands;
    for e in req.evidence.iter().take(3) {
        text.push_str(&format!("\n> {}", inert(&clip(e, 300))));
    }
    let mut fields = vec![
        json!({"short": true, "title": "Risk", "value": req.risk}),
        json!({"short": true, "title": "Policy rule", "value": inert(&req.rule)}),
        json!({"short": true, "title": "Attempt", "value": req.attempt.to_string()}),
        json!({"short": true, "title": "Expires", "value": req.expires_at.format("%Y-%m-%d %H:%M UTC").to_string()}),
        json!({"short": false, "title": "Run", "value": format!("`{}` plan `{}`", req.run_id, req.plan_hash)}),
    ];
    if req.quorum > 1 {
        fields.push(json!({"short": true, "title": "Needs", "value": format!("{} distinct approvers", req.quorum)}));
    }
    json!({
        "fallback": clip(&format!("Approval needed for {}: {}", req.service, req.plan.join(" ; ")), 500),
        "color": "#e8a33d",
        "title": clip(&format!("Approval needed: {}{host}", req.service), 200),
        "text": clip(&text, TEXT_MAX),
        "fields": fields,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request for `plan` (run nil, plan ab12, attempt 1).
    fn req(plan: Vec<String>) -> ApprovalRequest {
        ApprovalRequest {
            run_id: Uuid::nil(),
            service: "web".into(),
            host: None,
            error: "down".into(),
            attempt: 1,
            plan,
            plan_hash: "ab12".into(),
            risk: "critical".into(),
            rule: "rm".into(),
            diagnosis: "d".into(),
            evidence: vec![],
            requested_at: chrono::Utc::now(),
            expires_at: chrono::Utc::now(),
            quorum: 1,
        }
    }

    #[test]
    fn approve_is_offered_only_for_a_plan_shown_whole() {
        let secret = Secret::new("action-secret");
        let actions = |m: &Value| -> Vec<String> {
            m["props"]["attachments"][0]["actions"].as_array().unwrap().iter().map(|a| a["id"].to_string()).collect()
        };
        let long = format!("/opt/web/fix {} --then-the-dangerous-tail", "x".repeat(2000));
        let m = request("c", "http://b/act", &secret, &req(vec![long.clone()]));
        assert!(m.to_string().contains(&long), "shown whole");
        assert_eq!(actions(&m), ["\"approve\"", "\"deny\""]);
        let huge = format!("/opt/web/fix {} --then-the-dangerous-tail", "x".repeat(7000));
        let m = request("c", "http://b/act", &secret, &req(vec![huge]));
        let text = m.to_string();
        assert!(!text.contains("--then-the-dangerous-tail"), "cut");
        assert_eq!(actions(&m), ["\"deny\""], "no Approve for what cannot be read");
        assert!(
            text.contains(
                "pitcrew approve 00000000-0000-0000-0000-000000000000 --by YOUR-NAME --plan ab12 --attempt 1"
            ),
            "{text}"
        );
    }

    /// What the alert, the model and the evidence say is shown as text: no code fence of theirs
    /// swallows the commands' header, no link of theirs shows other words than its address;
    /// the commands are shown exactly as they run, whatever backticks they hold.
    #[test]
    fn untrusted_text_cannot_reshape_the_request() {
        let secret = Secret::new("action-secret");
        let req = ApprovalRequest {
            error: "disk full\n```".into(),
            rule: "rm: deletes files".into(),
            diagnosis: "[Runbook: safe to approve](https://evil.example) @channel".into(),
            evidence: vec!["> **fake** `Commands:`\nline".into()],
            ..req(vec!["rm -f /var/run/web/*.pid /tmp/web/*.sock".into(), "echo '````'".into()])
        };
        let m = request("c", "http://b/act", &secret, &req);
        let text = m["props"]["attachments"][0]["text"].as_str().unwrap().to_string();
        assert!(text.contains("**Error:** disk full \\`\\`\\`\n"), "{text}");
        assert!(text.contains(r"\[Runbook\: safe to approve\]\(https\://evil.example\) \@channel"), "{text}");
        assert!(text.contains(r"> \> \*\*fake\*\* \`Commands\:\` line"), "{text}");
        assert!(
            text.contains("**Commands:**\n`````\nrm -f /var/run/web/*.pid /tmp/web/*.sock\necho '````'\n`````"),
            "{text}"
        );
    }

    /// An error and a diagnosis whose escaping doubles them do not push the commands past the
    /// text's cut: the plan beside Approve is shown to its closing fence.
    #[test]
    fn the_commands_are_shown_whole_however_long_what_precedes_them() {
        let secret = Secret::new("action-secret");
        let plan = format!("/opt/web/fix {} --the-tail", "y".repeat(COMMANDS_MAX - 30));
        let long = ApprovalRequest { error: "_".repeat(500), diagnosis: ":".repeat(1000), ..req(vec![plan.clone()]) };
        let m = request("c", "http://b/act", &secret, &long);
        let text = m["props"]["attachments"][0]["text"].as_str().unwrap().to_string();
        assert!(text.chars().count() <= TEXT_MAX, "{}", text.chars().count());
        assert!(text.contains(&format!("\n{plan}\n```")), "the commands and their closing fence");
        assert_eq!(m["props"]["attachments"][0]["actions"][0]["id"], "approve");
        // Backticks make the fences as long as the plan: no room for the whole, no Approve.
        let ticks = format!("echo '{}'", "`".repeat(4000));
        let m = request("c", "http://b/act", &secret, &req(vec![ticks]));
        assert_eq!(m["props"]["attachments"][0]["actions"].as_array().map(Vec::len), Some(1), "Deny only");
        assert_eq!(m["props"]["attachments"][0]["actions"][0]["id"], "deny");
    }

    #[test]
    fn a_context_decides_only_what_it_was_made_for() {
        let secret = Secret::new("action-secret");
        let run = Uuid::now_v7();
        let approve = Context::new(&secret, "approve", run, "ab12", 2);
        assert_eq!(approve.verify(&secret), Ok(Decision::Approve));
        assert_eq!(Context::new(&secret, "deny", run, "ab12", 2).verify(&secret), Ok(Decision::Deny));
        // The attempt is signed: a button cannot be moved to another attempt's request.
        let later = Context { attempt: Some(3), ..approve.clone() };
        assert!(later.verify(&secret).is_err());
        let unbound = Context { attempt: None, ..approve.clone() };
        assert!(unbound.verify(&secret).is_err(), "nor stripped of it");
        assert!(approve.verify(&Secret::new("other")).is_err(), "another secret");
        let turned = Context { action: "deny".into(), ..approve.clone() };
        assert!(turned.verify(&secret).unwrap_err().contains("bad button context"));
        let moved = Context { plan_hash: "cd34".into(), ..approve.clone() };
        assert!(moved.verify(&secret).is_err());
        let other_run = Context { run: Uuid::now_v7(), ..approve.clone() };
        assert!(other_run.verify(&secret).is_err());
        let junk = Context { mac: "zz".into(), ..approve };
        assert!(junk.verify(&secret).is_err());
    }
}
