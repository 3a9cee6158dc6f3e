//! Reading a model's answer: the commands of a plan out of whatever prose, fences, numbering
//! and comments surround them, and a diagnosis out of JSON or plain text.

use serde::Deserialize;

/// Lines longer than this are not commands (a paragraph of prose, a pasted log).
const MAX_COMMAND_LEN: usize = 512;

/// The commands of a plan answer, in order, without duplicates.
///
/// Fenced code blocks win: when the answer has any, only their lines count. Otherwise lines
/// marked as list items or inline code count, and when nothing is marked, every line that
/// does not read as prose. In every case list markers, shell prompts, backticks, comments,
/// headings and blank lines are dropped.
pub fn plan_commands(answer: &str) -> Vec<String> {
    let fenced = fenced_lines(answer);
    let candidates: Vec<(String, bool)> = match fenced {
        Some(lines) => lines.into_iter().map(|l| (l, true)).collect(),
        None => {
            let all: Vec<(String, bool)> = answer.lines().map(|l| (l.to_string(), is_marked(l))).collect();
            if all.iter().any(|(_, marked)| *marked) {
                all.into_iter().filter(|(_, m)| *m).collect()
            } else {
                all.into_iter().filter(|(l, _)| !reads_as_prose(l)).map(|(l, _)| (l, true)).collect()
            }
        }
    };
    let mut out: Vec<String> = Vec::new();
    for (line, _) in candidates {
        if let Some(cmd) = clean(&line) {
            if !out.contains(&cmd) {
                out.push(cmd);
            }
        }
    }
    out
}

/// The lines inside ``` fences, or None when the answer has no complete fence.
fn fenced_lines(answer: &str) -> Option<Vec<String>> {
    let mut inside = false;
    let mut seen = false;
    let mut lines = Vec::new();
    for line in answer.lines() {
        if line.trim_start().starts_with("```") {
            inside = !inside;
            seen |= !inside;
            continue;
        }
        if inside {
            lines.push(line.to_string());
        }
    }
    seen.then_some(lines)
}

/// A list item (`1.`, `2)`, `-`, `*`) or a line holding inline code.
fn is_marked(line: &str) -> bool {
    let t = line.trim_start();
    list_marker_len(t) > 0 || t.matches('`').count() >= 2
}

/// Length of a leading list marker with its space: `1. `, `12) `, `- `, `* `, `• `.
fn list_marker_len(t: &str) -> usize {
    for bullet in ["- ", "* ", "• "] {
        if t.starts_with(bullet) {
            return bullet.len();
        }
    }
    let digits = t.chars().take_while(|c| c.is_ascii_digit()).count();
    if digits > 0 && digits <= 2 {
        let rest = &t[digits..];
        if rest.starts_with(". ") || rest.starts_with(") ") {
            return digits + 2;
        }
    }
    0
}

/// Sentences, not commands: ends like a sentence, or opens with a capitalised word and runs on.
fn reads_as_prose(line: &str) -> bool {
    let t = line.trim();
    if t.is_empty() {
        return true;
    }
    let words = t.split_whitespace().count();
    let capitalised = t.chars().next().is_some_and(|c| c.is_ascii_uppercase())
        && t.split_whitespace().next().is_some_and(|w| w.chars().skip(1).all(|c| c.is_ascii_lowercase()));
    t.ends_with(':') || (t.ends_with('.') && words > 2) || (capitalised && words > 3)
}

/// One command from one line, or None for blanks, comments, headings and prose.
fn clean(line: &str) -> Option<String> {
    let mut t = line.trim();
    t = &t[list_marker_len(t)..];
    // Inline code inside prose: `1. Run `sudo kill 42` to stop it.`
    if let Some(start) = t.find('`') {
        if let Some(len) = t[start + 1..].find('`') {
            t = &t[start + 1..start + 1 + len];
        }
    }
    t = t.trim();
    for prompt in ["$ ", "% "] {
        t = t.strip_prefix(prompt).unwrap_or(t);
    }
    let t = t.trim();
    if t.is_empty() || t.starts_with('#') || t.starts_with("//") || t.ends_with(':') || t.len() > MAX_COMMAND_LEN {
        return None;
    }
    Some(t.to_string())
}

/// A diagnosis answer: `summary` and the quoted evidence it rests on.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DiagnosisAnswer {
    pub summary: String,
    pub grounds: Vec<String>,
}

#[derive(Deserialize)]
struct DiagnosisJson {
    #[serde(alias = "summary", alias = "cause")]
    diagnosis: String,
    #[serde(default, alias = "grounds", alias = "evidence_quotes")]
    evidence: Vec<String>,
}

/// The one JSON object an answer holds (fenced or surrounded by prose): from its first `{`
/// to its last `}`, if that parses as `T`.
pub fn json_object<T: serde::de::DeserializeOwned>(answer: &str) -> Option<T> {
    let (a, b) = (answer.find('{')?, answer.rfind('}')?);
    (a < b).then(|| serde_json::from_str(&answer[a..=b]).ok()).flatten()
}

/// Read `{"diagnosis": ..., "evidence": [...]}` (fenced or surrounded by prose), else take
/// the text itself as the summary. None when there is nothing to read.
pub fn diagnosis(answer: &str) -> Option<DiagnosisAnswer> {
    if let Some(j) = json_object::<DiagnosisJson>(answer) {
        let summary = j.diagnosis.trim().to_string();
        if summary.is_empty() {
            return None;
        }
        let grounds = j.evidence.into_iter().map(|g| g.trim().to_string()).filter(|g| !g.is_empty()).collect();
        return Some(DiagnosisAnswer { summary, grounds });
    }
    let text: Vec<&str> = answer.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with("```")).collect();
    (!text.is_empty()).then(|| DiagnosisAnswer { summary: text.join(" "), grounds: Vec::new() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn fenced_commands_win_over_prose() {
        let answer = "The service is down because its port is taken.\n\nRun these:\n```bash\n# stop the squatter\nsudo kill 4242\n\n/opt/web/bin/start --port 8080\n```\nThis should bring it back.";
        assert_eq!(plan_commands(answer), v(&["sudo kill 4242", "/opt/web/bin/start --port 8080"]));
    }

    #[test]
    fn numbered_and_inline_code_lines_are_read() {
        let answer =
            "Here is the plan:\n1. Run `sudo kill 4242` to free the port.\n2) $ /opt/web/bin/start\nThat is all.";
        assert_eq!(plan_commands(answer), v(&["sudo kill 4242", "/opt/web/bin/start"]));
        assert_eq!(plan_commands("- systemctl restart web\n- systemctl restart web"), v(&["systemctl restart web"]));
    }

    #[test]
    fn bare_lines_skip_prose_and_comments() {
        let answer = "I would restart the service now.\n# restart\nsystemctl restart web\nThe logs show it crashed after an upgrade";
        assert_eq!(plan_commands(answer), v(&["systemctl restart web"]));
        assert!(plan_commands("").is_empty());
        assert!(plan_commands("I cannot help with that.").is_empty());
    }

    #[test]
    fn chaining_is_kept_verbatim_for_the_gate_to_refuse() {
        // Parsing never splits or rewrites a command: the policy gate sees what the model said.
        assert_eq!(plan_commands("```\nrm -rf / && reboot\n```"), v(&["rm -rf / && reboot"]));
    }

    #[test]
    fn diagnosis_reads_json_or_text() {
        let d = diagnosis("```json\n{\"diagnosis\": \"web is down: port 8080 is held by pid 4242\", \"evidence\": [\"port 8080 is held by pid 4242\"]}\n```").unwrap();
        assert_eq!(d.summary, "web is down: port 8080 is held by pid 4242");
        assert_eq!(d.grounds, v(&["port 8080 is held by pid 4242"]));
        let d = diagnosis("The web service crashed.\nNothing listens on 8080.").unwrap();
        assert_eq!(d.summary, "The web service crashed. Nothing listens on 8080.");
        assert!(diagnosis("  \n```\n```").is_none());
        assert!(diagnosis("{\"diagnosis\": \"  \"}").is_none());
    }
}
