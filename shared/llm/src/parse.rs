//! Reading a model's answer: the commands of a plan out of whatever prose, fences, numbering
//! and comments surround them, and a diagnosis out of JSON or plain text.

use serde::Deserialize;

/// Lines longer than this are not commands (a paragraph of prose, a pasted log).
const MAX_COMMAND_LEN: usize = 512;

/// The info strings of a fenced block that holds shell commands (an untagged block may too).
const SHELL_TAGS: [&str; 6] = ["sh", "bash", "shell", "console", "zsh", "shell-session"];

/// The commands of a plan answer, in order, without duplicates, or why the answer holds no
/// plan that can be read without guessing.
///
/// A fenced shell block wins: when the answer has one (tagged `sh`, `bash`, `shell`, ... or,
/// failing a tagged one, untagged), its lines are the plan, verbatim but for blank lines,
/// comments and a leading `$ ` prompt; blocks tagged otherwise (`json`, `log`, `text`) are
/// quotes, never commands. Two candidate blocks are ambiguous and refused, as is a block left
/// open. Without a fence, lines marked as list items count (or, when nothing is marked, every
/// line), each whole: a bare command or one wholly in inline code; prose, with or without
/// inline code in it (`Do not run `x``), never does; but a list item quoting a command in
/// prose beside items that are commands makes the list ambiguous (`1. Back up first: `cp -a
/// ...``, `2. rm ...`: a plan without its first step), refused. A reasoning model's thinking
/// is never read (see [`without_thinking`]).
pub fn plan_commands(answer: &str) -> Result<Vec<String>, String> {
    let answer = without_thinking(answer);
    let candidates: Vec<String> = match fenced_blocks(answer)? {
        blocks if !blocks.is_empty() => {
            let tagged: Vec<&Block> = blocks.iter().filter(|b| SHELL_TAGS.contains(&b.tag.as_str())).collect();
            let shell = if tagged.is_empty() { blocks.iter().filter(|b| b.tag.is_empty()).collect() } else { tagged };
            match shell.as_slice() {
                [] => return Err("no shell block (```sh) in the answer".into()),
                [one] => {
                    // A terminal session: its prompted lines; root's `# ` prompt only where no
                    // line has `$ ` (else `# ` opens a comment, or an output line).
                    let console = ["console", "shell-session"].contains(&one.tag.as_str()).then(|| {
                        let user = one.lines.iter().any(|l| l.trim_start().starts_with("$ "));
                        if user {
                            "$ "
                        } else {
                            "# "
                        }
                    });
                    one.lines.iter().filter_map(|l| fenced_command(l, console)).collect::<Result<_, _>>()?
                }
                more => return Err(format!("{} shell blocks in the answer, not one", more.len())),
            }
        }
        _ => {
            let marked = answer.lines().any(|l| list_marker_len(l.trim_start()) > 0);
            let (mut commands, mut quoting) = (Vec::new(), None);
            for item in answer.lines().map(str::trim).filter(|l| !marked || list_marker_len(l) > 0) {
                let item = &item[list_marker_len(item)..];
                match bare_command(item) {
                    Some(c) => commands.push(c),
                    None if marked && quotes_a_command(item) => quoting = quoting.or(Some(item)),
                    None => {}
                }
            }
            if let Some(item) = quoting.filter(|_| !commands.is_empty()) {
                return Err(format!(
                    "the step \"{}\" quotes a command inside prose, so the plan would run without it: \
                     give the plan's commands alone, in one ```sh block",
                    pitcrew_model::trim::clip(item, 100)
                ));
            }
            commands
        }
    };
    let mut out: Vec<String> = Vec::new();
    for cmd in candidates {
        if !out.contains(&cmd) {
            out.push(cmd);
        }
    }
    Ok(out)
}

/// Whether prose `item` holds a span of inline code that reads as a command (`Back up first:
/// `cp -a /var/lib/db /backup``), not a name (`Watch `web`'s log`).
fn quotes_a_command(item: &str) -> bool {
    item.split('`').skip(1).step_by(2).any(|code| code.contains(' ') && bare_command(code).is_some())
}

/// The answer without a reasoning model's thinking: what follows its last `</think>` (a
/// template may open the tag in the prompt, so only the closing one is in the answer), or,
/// with `<think>` never closed, what precedes it. What the model weighed and dropped is
/// neither its plan nor its diagnosis.
fn without_thinking(answer: &str) -> &str {
    if let Some(end) = answer.rfind("</think>") {
        return &answer[end + "</think>".len()..];
    }
    answer.find("<think>").map_or(answer, |start| &answer[..start])
}

/// A complete fenced block: its info string's first word, lowercased, and its lines.
struct Block {
    tag: String,
    lines: Vec<String>,
}

/// An opening fence (CommonMark): three or more backticks or tildes, then an info string (no
/// backtick in it after backticks: ```` ```x``` ```` is inline code). Its character, its
/// length and the info string's first word, lowercased.
fn opening_fence(line: &str) -> Option<(char, usize, String)> {
    let t = line.trim_start();
    let c = t.chars().next().filter(|c| *c == '`' || *c == '~')?;
    let n = t.chars().take_while(|x| *x == c).count();
    let info = &t[n..];
    if n < 3 || (c == '`' && info.contains('`')) {
        return None;
    }
    Some((c, n, info.split_whitespace().next().unwrap_or("").to_ascii_lowercase()))
}

/// Whether `line` closes a block opened with `n` of `c`: as many or more, nothing after.
fn closes(line: &str, c: char, n: usize) -> bool {
    let t = line.trim();
    t.chars().take_while(|x| *x == c).count() >= n && t.chars().all(|x| x == c)
}

/// The answer's fenced blocks, or an error when one is left open (a cut-off answer).
fn fenced_blocks(answer: &str) -> Result<Vec<Block>, String> {
    let mut blocks = Vec::new();
    let mut open: Option<(char, usize, Block)> = None;
    for line in answer.lines() {
        match open.as_mut() {
            Some((c, n, block)) => {
                if closes(line, *c, *n) {
                    let (_, _, block) = open.take().expect("open");
                    blocks.push(block);
                } else {
                    block.lines.push(line.to_string());
                }
            }
            None => {
                if let Some((c, n, tag)) = opening_fence(line) {
                    open = Some((c, n, Block { tag, lines: Vec::new() }));
                }
            }
        }
    }
    match open {
        Some(_) => Err("a code block is left open".into()),
        None => Ok(blocks),
    }
}

/// One command from a line of a shell block: verbatim (the policy gate sees what the model
/// wrote), but for a `$ ` prompt, a list marker (`1. `) and backticks around the whole line;
/// None for blanks and comments. In a `console` block (a terminal session) only lines with its
/// `prompt` (`$ `, or root's `# ` in a block without one) are commands: the rest is output.
fn fenced_command(line: &str, console: Option<&str>) -> Option<Result<String, String>> {
    let t = line.trim();
    let t = if let Some(prompt) = console {
        t.strip_prefix(prompt)?
    } else {
        let t = &t[list_marker_len(t)..];
        let t = t.strip_prefix("$ ").unwrap_or(t).trim();
        // `` `systemctl restart web` ``: the whole line in inline code, not a substitution.
        inline_code(t).unwrap_or(t)
    };
    let t = t.trim();
    if t.is_empty() || t.starts_with('#') {
        return None;
    }
    if t.len() > MAX_COMMAND_LEN {
        return Some(Err(format!("a command longer than {MAX_COMMAND_LEN} characters")));
    }
    Some(Ok(t.to_string()))
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

/// What `t` holds when all of it is one span of inline code (`` `systemctl restart web` ``).
fn inline_code(t: &str) -> Option<&str> {
    t.strip_prefix('`').and_then(|x| x.strip_suffix('`')).filter(|code| !code.contains('`'))
}

/// One command from a line outside any fence (its list marker gone): the whole line, or the
/// whole of it in inline code; None for blanks, comments, headings and prose. A line with
/// inline code inside prose is prose: what it quotes may be what not to run.
fn bare_command(line: &str) -> Option<String> {
    let mut t = line.trim();
    if let Some(code) = inline_code(t) {
        t = code.trim();
    } else if t.contains('`') {
        return None;
    }
    for prompt in ["$ ", "% "] {
        t = t.strip_prefix(prompt).unwrap_or(t);
    }
    let t = t.trim();
    if t.is_empty() || t.starts_with('#') || t.starts_with("//") || t.len() > MAX_COMMAND_LEN || reads_as_prose(t) {
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
    let answer = without_thinking(answer);
    let (a, b) = (answer.find('{')?, answer.rfind('}')?);
    (a < b).then(|| serde_json::from_str(&answer[a..=b]).ok()).flatten()
}

/// Read `{"diagnosis": ..., "evidence": [...]}` (fenced or surrounded by prose), else take
/// the text itself as the summary. None when there is nothing to read.
pub fn diagnosis(answer: &str) -> Option<DiagnosisAnswer> {
    let answer = without_thinking(answer);
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

    fn plan(answer: &str) -> Vec<String> {
        plan_commands(answer).unwrap_or_else(|e| panic!("{answer:?}: {e}"))
    }

    #[test]
    fn fenced_commands_win_over_prose() {
        let answer = "The service is down because its port is taken.\n\nRun these:\n```bash\n# stop the squatter\nsudo kill 4242\n\n$ /opt/web/bin/start --port 8080\n```\nThis should bring it back.";
        assert_eq!(plan(answer), v(&["sudo kill 4242", "/opt/web/bin/start --port 8080"]));
    }

    #[test]
    fn a_quoted_log_block_is_never_a_command() {
        // The logs quoted in an untagged or a `log` block, the plan in its `sh` block.
        let answer =
            "The log says:\n```\nrm -rf /var/lib/web\n```\n```log\nreboot\n```\nSo:\n```sh\nsystemctl restart web\n```";
        assert_eq!(plan(answer), v(&["systemctl restart web"]));
        // Two shell blocks: which is the plan? Neither is guessed.
        let two = "```sh\nsystemctl stop web\n```\nor\n```bash\nsystemctl restart web\n```";
        assert!(plan_commands(two).unwrap_err().contains("2 shell blocks"));
        let two_untagged = "```\nsystemctl stop web\n```\n```\nsystemctl restart web\n```";
        assert!(plan_commands(two_untagged).is_err());
        // Only a quote: no plan.
        assert!(plan_commands("```json\n{\"a\": 1}\n```").unwrap_err().contains("no shell block"));
        // A cut-off answer is not read as far as it went.
        assert!(plan_commands("```sh\nsystemctl stop web\n").unwrap_err().contains("left open"));
    }

    #[test]
    fn fences_follow_commonmark() {
        // Tildes fence too: a log quoted in one is a quote.
        let answer = "~~~\nrm -rf /var/lib/web\n~~~\n```sh\nsystemctl restart web\n```";
        assert_eq!(plan(answer), v(&["systemctl restart web"]));
        assert_eq!(plan("~~~bash\nsystemctl restart web\n~~~"), v(&["systemctl restart web"]));
        // Triple backticks on one line are inline code, not a fence.
        assert_eq!(plan("```systemctl restart web```\n```sh\n/opt/web/start\n```"), v(&["/opt/web/start"]));
        // A fence inside a longer one is content; a closing fence has nothing after it.
        let nested = "````text\n```sh\nreboot\n```\n````\n```sh\n/opt/web/start\n``` then check\n```";
        assert_eq!(plan(nested), v(&["/opt/web/start", "``` then check"]));
    }

    #[test]
    fn a_console_block_gives_its_prompted_lines_not_their_output() {
        let answer = "```console\n# restart it\n$ systemctl restart web\n● web.service - Web\n# listen 8080\n```";
        assert_eq!(plan(answer), v(&["systemctl restart web"]), "`# ` is a comment or output beside `$ `");
        let root = "```console\n# systemctl restart web\n● web.service - Web\n# /opt/web/check\n```";
        assert_eq!(plan(root), v(&["systemctl restart web", "/opt/web/check"]));
    }

    #[test]
    fn a_fenced_line_in_backticks_or_numbered_is_read_as_its_command() {
        let answer = "```bash\n`sudo systemctl restart web`\n2. /opt/web/check\n```";
        assert_eq!(plan(answer), v(&["sudo systemctl restart web", "/opt/web/check"]));
    }

    #[test]
    fn a_fenced_line_is_taken_whole_or_refused() {
        // Backticks in a shell block are the shell's (the gate refuses substitution): not inline code.
        assert_eq!(plan("```sh\necho `id`\n```"), v(&["echo `id`"]));
        let long = format!("```sh\nsystemctl restart web\necho {}\n```", "x".repeat(600));
        assert!(plan_commands(&long).unwrap_err().contains("longer than"), "a step is never dropped silently");
    }

    #[test]
    fn unfenced_list_items_and_whole_inline_code_are_read() {
        let answer = "Here is the plan:\n1. `sudo kill 4242`\n2) $ /opt/web/bin/start\nThat is all.";
        assert_eq!(plan(answer), v(&["sudo kill 4242", "/opt/web/bin/start"]));
        assert_eq!(plan("- systemctl restart web\n- systemctl restart web"), v(&["systemctl restart web"]));
    }

    #[test]
    fn inline_code_inside_prose_is_not_a_command() {
        // What a model says not to run must never become the plan.
        let answer = "Do not run `systemctl restart postgresql`, it drops connections.\n`systemctl restart web`";
        assert_eq!(plan(answer), v(&["systemctl restart web"]));
        assert!(plan("1. Run `sudo kill 4242` to free the port.\n2. Check the logs first.").is_empty());
    }

    #[test]
    fn a_list_whose_step_quotes_a_command_in_prose_is_refused_not_cut() {
        let answer = "1. Back up first: `cp -a /var/lib/db /var/lib/db.bak`\n2. rm -f /var/lib/db/postmaster.pid\n3. systemctl restart db";
        let why = plan_commands(answer).unwrap_err();
        assert!(why.contains("Back up first") && why.contains("```sh block"), "{why}");
        // Prose steps without a command in them are commentary, as before, a name in inline
        // code too.
        assert_eq!(plan("1. Check the logs first.\n2. `systemctl restart db`"), v(&["systemctl restart db"]));
        assert_eq!(plan("1. Watch `web`'s log.\n2. `systemctl restart web`"), v(&["systemctl restart web"]));
    }

    #[test]
    fn a_reasoning_models_thinking_is_never_read() {
        let answer = "<think>\nMaybe:\n- rm -rf /var/lib/db\nNo, too much.\n</think>\n- systemctl restart db";
        assert_eq!(plan(answer), v(&["systemctl restart db"]));
        // The template opened the tag: only its end is in the answer.
        assert_eq!(plan("1. reboot?\nno.\n</think>\n```sh\nsystemctl restart db\n```"), v(&["systemctl restart db"]));
        // Thinking that never ended holds no answer.
        assert!(plan("<think>\n- reboot\n- rm -rf /").is_empty());
        let d = diagnosis("<think>{\"diagnosis\": \"guess\"}</think>{\"diagnosis\": \"db down\", \"evidence\": []}");
        assert_eq!(d.map(|d| d.summary), Some("db down".to_string()));
    }

    #[test]
    fn bare_lines_skip_prose_and_comments() {
        let answer = "I would restart the service now.\n# restart\nsystemctl restart web\nThe logs show it crashed after an upgrade";
        assert_eq!(plan(answer), v(&["systemctl restart web"]));
        assert!(plan("").is_empty());
        assert!(plan("I cannot help with that.").is_empty());
    }

    #[test]
    fn chaining_is_kept_verbatim_for_the_gate_to_refuse() {
        // Parsing never splits or rewrites a command: the policy gate sees what the model said.
        assert_eq!(plan("```\nrm -rf / && reboot\n```"), v(&["rm -rf / && reboot"]));
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
