//! The policy gate: deterministic rules every plan passes after every model output.
//! Forbidden commands never run, critical ones wait for a human, the rest run unattended.

mod credentials;
mod ip;
mod ps;
mod read_only;
mod shell;
mod tc;
#[cfg(test)]
mod tests;

use pitcrew_model::trim::clip;
use pitcrew_model::SecurityFlag;
use regex::{Regex, RegexBuilder};
use serde::Deserialize;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The program a command runs past its wrappers and their options' values (`sudo -u app`,
/// `env X=1`, `nice -n 5`, `timeout 30`), as written (`/opt/app/bin/start`, `systemctl`): the
/// same reading the gate judges. None when the command does not parse or names no program.
pub fn program(command: &str) -> Option<String> {
    let argv = shell_words::split(command).ok()?;
    program_in(&argv).map(|p| p.path)
}

/// The program a command's words run, past its wrappers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    /// Where it stands among the words.
    pub index: usize,
    /// As written (`/opt/app/bin/start`, `systemctl`).
    pub path: String,
    /// A privilege wrapper (`sudo`, `doas`) runs it.
    pub elevated: bool,
}

/// The program `argv` runs past its wrappers and their options' values, as the gate reads it;
/// None when it names none, or `env -S` makes words of its own.
pub fn program_in(argv: &[String]) -> Option<Program> {
    let u = shell::unwrap(argv);
    Some(Program { index: u.index?, path: u.path, elevated: u.elevated }).filter(|p| !p.path.is_empty())
}

/// Whether two commands are the same words (`systemctl  restart 'web'` is `systemctl restart
/// web`): what already failed or was refused is not proposed again in another spelling. Either
/// not parsing, the same text.
pub fn same_command(a: &str, b: &str) -> bool {
    match (shell_words::split(a), shell_words::split(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => a.trim() == b.trim(),
    }
}

/// The shipped rules; a test proves they parse.
const DEFAULT_TOML: &str = include_str!("../policy.toml");
/// Largest policy file read.
pub const MAX_POLICY_BYTES: usize = 256 * 1024;
/// Most rules of one class in one file.
pub const MAX_RULES: usize = 256;
/// Longest command the gate will judge; longer ones are refused rather than scanned.
pub const MAX_COMMAND_LEN: usize = 4096;
/// Commands per plan: the plan contract is 1-3, one per line.
pub const MAX_PLAN_COMMANDS: usize = 3;
const MAX_PATTERN_LEN: usize = 2048;
/// Compiled-regex budget per rule, so a pathological pattern fails at load.
const REGEX_SIZE_LIMIT: usize = 1 << 20;
pub const FORBIDDEN: &str = "forbidden";
pub const CRITICAL: &str = "critical";
/// Rules implemented in code; policy files may not reuse their names.
const BUILT_IN: &[&str] = &[
    "shell-construct",
    "unparseable",
    "empty-command",
    "command-too-long",
    "empty-plan",
    "too-many-commands",
    "invisible-character",
    "control-character",
    "non-ascii-program",
    "option-as-program",
    "secret-as-program",
    "secret-use",
    "host-allow-list",
    "host-sudo-list",
];
/// Most distinct approvers a rule may require.
const MAX_QUORUM: u32 = 5;

/// Why a policy could not be loaded; rule errors name the rule and the problem.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("policy is not valid TOML: {0}")]
    Toml(String),
    #[error("policy rule '{rule}' ({class}): {problem}")]
    Rule { class: &'static str, rule: String, problem: String },
    #[error("policy is larger than the {MAX_POLICY_BYTES} bytes allowed")]
    TooLarge,
    #[error("cannot read policy file {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("policy file {}: {error}", path.display())]
    File {
        path: PathBuf,
        #[source]
        error: Box<PolicyError>,
    },
}

/// What the gate says about a whole plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateDecision {
    /// Every command is allowed without a human.
    Allow,
    /// At least one command needs an approver; names the first critical rule hit and the command.
    NeedsApproval { rule: String, command: String, reason: String },
    /// At least one command is forbidden: the plan must not run. Names the rule and command.
    Reject { rule: String, command: String, reason: String },
}

impl GateDecision {
    /// The rule behind the decision (`None` for `Allow`), for events and approval requests.
    pub fn rule(&self) -> Option<&str> {
        match self {
            GateDecision::Allow => None,
            GateDecision::NeedsApproval { rule, .. } | GateDecision::Reject { rule, .. } => Some(rule),
        }
    }
}

/// One rule hit by one command: the run's security flags are built from these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub command: String,
    pub rule: String,
    /// `forbidden` or `critical`.
    pub class: String,
    pub reason: String,
}

impl Finding {
    /// The flag recorded in the run state for `attempt`.
    pub fn to_flag(&self, attempt: u32) -> SecurityFlag {
        SecurityFlag { attempt, command: self.command.clone(), rule: self.rule.clone(), class: self.class.clone() }
    }
}

#[derive(Debug, Clone)]
struct Rule {
    name: String,
    reason: String,
    pattern: Regex,
    /// Distinct approvers a plan this critical rule flags needs (1 unless the rule says).
    quorum: u32,
}

/// The rules, loaded and compiled once. Forbidden rules are always checked before critical.
#[derive(Debug, Clone)]
pub struct Policy {
    forbidden: Vec<Rule>,
    critical: Vec<Rule>,
    /// `[hosts.<name>]`: what plans may run on that host.
    hosts: std::collections::BTreeMap<String, HostRules>,
}

/// `[hosts.<name>]`: `allow` lists the programs plans may run there (absent: any the rules
/// permit); `sudo` lists the programs that may run under sudo there (absent: any).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct HostRules {
    allow: Option<Vec<String>>,
    sudo: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: String,
    reason: String,
    pattern: String,
    #[serde(default)]
    quorum: Option<u32>,
}

impl Policy {
    /// The rules shipped with pitcrew (`services/approval/policy.toml`).
    pub fn default_policy() -> Policy {
        Policy::from_toml(DEFAULT_TOML).expect("the embedded policy.toml is valid (tested)")
    }

    /// Parse a policy: `[[forbidden]]` and `[[critical]]` tables of `name`, `reason`, `pattern`.
    pub fn from_toml(text: &str) -> Result<Policy, PolicyError> {
        if text.len() > MAX_POLICY_BYTES {
            return Err(PolicyError::TooLarge);
        }
        let table: toml::Table = toml::from_str(text).map_err(|e| PolicyError::Toml(e.to_string()))?;
        let mut policy = Policy { forbidden: Vec::new(), critical: Vec::new(), hosts: Default::default() };
        for (key, value) in table {
            match key.as_str() {
                FORBIDDEN => policy.forbidden = parse_class(FORBIDDEN, value)?,
                CRITICAL => policy.critical = parse_class(CRITICAL, value)?,
                "hosts" => {
                    policy.hosts = value
                        .try_into()
                        .map_err(|e: toml::de::Error| PolicyError::Toml(format!("[hosts.<name>]: {e}")))?
                }
                other => {
                    return Err(PolicyError::Toml(format!(
                        "unknown key '{other}' (expected [[forbidden]], [[critical]] and [hosts.<name>] tables)"
                    )))
                }
            }
        }
        policy.check_unique()?;
        Ok(policy)
    }

    /// The default rules plus the user's: a user file adds rules and cannot remove or
    /// redefine a default one.
    pub fn with_user_file(path: &Path) -> Result<Policy, PolicyError> {
        let in_file = |error| PolicyError::File { path: path.to_path_buf(), error: Box::new(error) };
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_POLICY_BYTES as u64 + 1).read_to_string(&mut text))
            .map_err(|source| PolicyError::Read { path: path.to_path_buf(), source })?;
        let user = Policy::from_toml(&text).map_err(in_file)?;
        let mut policy = Policy::default_policy();
        policy.forbidden.extend(user.forbidden);
        policy.critical.extend(user.critical);
        policy.hosts = user.hosts;
        policy.check_unique().map_err(in_file)?;
        Ok(policy)
    }

    /// Every rule name appears once, so a decision's rule names exactly one rule.
    fn check_unique(&self) -> Result<(), PolicyError> {
        let all = self.forbidden.iter().map(|r| (FORBIDDEN, r)).chain(self.critical.iter().map(|r| (CRITICAL, r)));
        let mut seen = std::collections::BTreeSet::new();
        for (class, rule) in all {
            if !seen.insert(rule.name.as_str()) {
                return Err(rule_error(
                    class,
                    &rule.name,
                    "defined more than once (a user policy cannot redefine a rule)",
                ));
            }
        }
        Ok(())
    }

    /// All findings for a plan that runs on `host`: the rules', then the host's allow-lists.
    pub fn findings_on(&self, host: &str, commands: &[String]) -> Vec<Finding> {
        let mut all = self.findings(commands);
        let Some(rules) = self.hosts.get(host) else { return all };
        let mut host_findings = Vec::new();
        for command in commands {
            let Ok(argv) = shell_words::split(command.trim()) else { continue };
            let unwrapped = shell::unwrap(&argv);
            let program = unwrapped.argv.first().cloned().unwrap_or_default();
            // A listed path admits that file only; a listed name, that program wherever it is.
            let listed = |list: &[String]| {
                list.iter().any(|p| if p.contains('/') { *p == unwrapped.path } else { *p == program })
            };
            let hit = |rule: &str, reason: String| Finding {
                command: command.clone(),
                rule: rule.to_string(),
                class: FORBIDDEN.to_string(),
                reason,
            };
            if let Some(allow) = &rules.allow {
                if !listed(allow) {
                    host_findings.push(hit("host-allow-list", format!("{program} is not on {host}'s allow-list")));
                }
            }
            if let (true, Some(sudo)) = (unwrapped.elevated, &rules.sudo) {
                if !listed(sudo) {
                    host_findings.push(hit("host-sudo-list", format!("{program} may not run under sudo on {host}")));
                }
            }
        }
        // Forbidden findings lead.
        let split = all.iter().position(|f| f.class != FORBIDDEN).unwrap_or(all.len());
        all.splice(split..split, host_findings);
        all
    }

    /// All findings for a plan (for security flags), forbidden first, then in command order.
    pub fn findings(&self, commands: &[String]) -> Vec<Finding> {
        let mut forbidden = Vec::new();
        let mut critical = Vec::new();
        for command in commands {
            let hit = |rule: &str, class: &str, reason: String| Finding {
                command: command.clone(),
                rule: rule.to_string(),
                class: class.to_string(),
                reason,
            };
            let cmd = command.trim();
            if cmd.is_empty() {
                forbidden.push(hit("empty-command", FORBIDDEN, "the command is empty".into()));
                continue;
            }
            if cmd.len() > MAX_COMMAND_LEN {
                let why = format!("the command is longer than {MAX_COMMAND_LEN} bytes");
                forbidden.push(hit("command-too-long", FORBIDDEN, why));
                continue;
            }
            let argv = match shell_words::split(cmd) {
                Ok(argv) => argv,
                Err(e) => {
                    let why = format!("cannot be parsed as shell words ({e}), so it cannot be judged");
                    forbidden.push(hit("unparseable", FORBIDDEN, why));
                    continue;
                }
            };
            // Invisible characters and look-alike letters make a command read as something
            // it is not (`rм`, `ｒｍ`, `r\u{200b}m`).
            if let Some(c) = cmd.chars().find(|c| pitcrew_model::trim::invisible(*c)) {
                let why = format!("contains the invisible character U+{:04X}", c as u32);
                forbidden.push(hit("invisible-character", FORBIDDEN, why));
            }
            // An escape sequence, a backspace or a line separator in a command changes how it
            // shows on a terminal or in a chat: an approver would approve what they see, not
            // what runs (`rm -f a '\x1b[8m' /srv/data` hides its last argument).
            if let Some(c) = cmd.chars().find(|c| is_control(*c)) {
                let why = format!("contains the control character U+{:04X}", c as u32);
                forbidden.push(hit("control-character", FORBIDDEN, why));
            }
            let unwrapped = shell::unwrap(&argv);
            if let Some(why) = &unwrapped.opaque {
                forbidden.push(hit("opaque-command", FORBIDDEN, why.clone()));
            }
            let program = unwrapped.argv.first().cloned().unwrap_or_default();
            // `-- rm -rf /`: over SSH the remote `exec` takes the word as its own option and
            // runs the rest, which no rule (each anchored on the program) ever read.
            if program.starts_with('-') {
                let why = format!("the program '{program}' reads as an option: what runs would be the words after it");
                forbidden.push(hit("option-as-program", FORBIDDEN, why));
            }
            if !program.is_ascii() {
                let why = format!("the program name '{program}' is not plain ASCII (a look-alike of another?)");
                forbidden.push(hit("non-ascii-program", FORBIDDEN, why));
            }
            // `{secret:NAME}` becomes the worker's value only when the command runs: in the
            // program's word (`sudo /opt/{secret:x}/run`), that value would choose what runs.
            if unwrapped.path.contains(pitcrew_model::redact::PLACEHOLDER) {
                let why = format!(
                    "a secret names the program ('{}'): what runs would not be what was judged",
                    unwrapped.path
                );
                forbidden.push(hit("secret-as-program", FORBIDDEN, why));
            }
            // Anywhere else, the value goes where the command sends it (`curl https://x/?k=...`):
            // a human approves that, unless the operator wrote the command (`gate_on_trusting`).
            // In the words the executor fills in, not the text: quotes (`{"secret:"x}`,
            // `\{secret:x}`) vanish from a word, and the placeholder with them would not show.
            if argv.iter().any(|w| w.contains(pitcrew_model::redact::PLACEHOLDER)) {
                let why = "puts a secret's value ({secret:NAME}) into the command: a human approves where it goes, \
                           unless the command is one the service's own configuration holds"
                    .to_string();
                critical.push(hit("secret-use", CRITICAL, why));
            }
            if let Some(construct) = shell::find_construct(cmd) {
                let why = format!(
                    "shell construct '{construct}' outside quotes: commands run one per line, \
                     never chained, redirected, backgrounded or substituted"
                );
                forbidden.push(hit("shell-construct", FORBIDDEN, why));
            }
            if let Some(file) = credentials::named(&argv) {
                let why = format!(
                    "names `{}`, a file that holds credentials: what a command shows of it would reach the \
                     timeline, the database and the model",
                    clip(file, 120)
                );
                critical.push(hit("credential-file", CRITICAL, why));
            }
            let names = &unwrapped.assignments;
            if let Some(name) = names.iter().find(|n| shell::runs_code(n)) {
                let why = format!(
                    "sets `{}`, which makes programs load or run code of its choosing: code the policy cannot see",
                    clip(name, 60)
                );
                forbidden.push(hit("code-in-environment", FORBIDDEN, why));
            } else if let Some(name) = names.iter().find(|n| !shell::read_only_assignment(n)) {
                let why = format!(
                    "sets `{}` for the command: a variable can change what a program does or runs",
                    clip(name, 60)
                );
                critical.push(hit("environment-assignment", CRITICAL, why));
            }
            if let Some(word) = argv.iter().find(|w| shell::climbs_above(w)) {
                let why = format!(
                    "names `{}`, a path above the directory the command runs in: where it lands cannot be told \
                     from the command",
                    clip(word, 120)
                );
                critical.push(hit("parent-path", CRITICAL, why));
            }
            let written = argv.join(" ");
            let normalised = unwrapped.argv.join(" ");
            // Paths as the kernel reads them (`/./etc`, `/tmp/../etc` -> `/etc`): the rules
            // anchored on a system directory see it however it is spelled.
            let pathed = unwrapped.argv.iter().map(|w| shell::lexical_path(w)).collect::<Vec<_>>().join(" ");
            // A file a wrapper writes (`time -o /etc/passwd true`) is judged as `tee FILE`
            // would be, so the rules that look for writes see it.
            let writes: Vec<String> =
                unwrapped.writes.iter().map(|f| format!("tee {}", shell::lexical_path(f))).collect();
            let matches = |r: &Rule| {
                r.pattern.is_match(&normalised)
                    || r.pattern.is_match(&written)
                    || (pathed != normalised && r.pattern.is_match(&pathed))
                    || writes.iter().any(|w| r.pattern.is_match(w))
            };
            for r in self.forbidden.iter().filter(|r| matches(r)) {
                forbidden.push(hit(&r.name, FORBIDDEN, r.reason.clone()));
            }
            for r in self.critical.iter().filter(|r| matches(r)) {
                critical.push(hit(&r.name, CRITICAL, r.reason.clone()));
            }
        }
        forbidden.extend(critical);
        forbidden
    }

    /// Distinct approvers the plan needs: the largest quorum of the critical rules it hits
    /// (1 when none asks for more).
    pub fn quorum(&self, commands: &[String]) -> u32 {
        self.findings(commands)
            .iter()
            .filter(|f| f.class == CRITICAL)
            .filter_map(|f| self.critical.iter().find(|r| r.name == f.rule).map(|r| r.quorum))
            .max()
            .unwrap_or(1)
    }

    /// Reject if any forbidden finding, else NeedsApproval if any critical, else Allow.
    /// An empty plan, or one longer than the plan contract, is rejected.
    pub fn gate(&self, commands: &[String]) -> GateDecision {
        self.gate_on("", commands)
    }

    /// As `gate`, for a plan that runs on `host` (its `[hosts.<name>]` lists apply).
    pub fn gate_on(&self, host: &str, commands: &[String]) -> GateDecision {
        self.gate_on_trusting(host, commands, &[])
    }

    /// The findings of `findings_on` but those of [`TRUSTED_RULES`] on a command `trusted`
    /// holds: the service's own commands as the operator configured them (its start, stop,
    /// restart) may name the secrets they need, and paths relative to where they run, without
    /// a human each time.
    pub fn findings_on_trusting(&self, host: &str, commands: &[String], trusted: &[String]) -> Vec<Finding> {
        let mut all = self.findings_on(host, commands);
        let words = |c: &str| shell_words::split(c).ok();
        let trusted: Vec<Vec<String>> = trusted.iter().filter_map(|t| words(t)).collect();
        all.retain(|f| {
            !(TRUSTED_RULES.contains(&f.rule.as_str()) && words(&f.command).is_some_and(|w| trusted.contains(&w)))
        });
        all
    }

    /// As `gate_on`, with the service's own commands `trusted` (see `findings_on_trusting`).
    pub fn gate_on_trusting(&self, host: &str, commands: &[String], trusted: &[String]) -> GateDecision {
        if commands.is_empty() {
            let reason = "rejected by policy rule 'empty-plan': the plan has no commands".to_string();
            return GateDecision::Reject { rule: "empty-plan".into(), command: String::new(), reason };
        }
        if commands.len() > MAX_PLAN_COMMANDS {
            let reason = format!(
                "rejected by policy rule 'too-many-commands': {} commands, at most {MAX_PLAN_COMMANDS} allowed",
                commands.len()
            );
            let command = commands[MAX_PLAN_COMMANDS].clone();
            return GateDecision::Reject { rule: "too-many-commands".into(), command, reason };
        }
        let Some(first) = self.findings_on_trusting(host, commands, trusted).into_iter().next() else {
            return GateDecision::Allow;
        };
        let describe = |verdict: &str| {
            // Redacted whole, then cut: a cut inside a secret (a URL's password before its `@`)
            // would leave what the patterns no longer find. The reason travels to approvers,
            // the bus, Postgres and chat.
            let cmd = clip(&pitcrew_model::redact::redact(&first.command), 200);
            format!("{verdict} by policy rule '{}' ({}): {} — `{cmd}`", first.rule, first.class, first.reason)
        };
        if first.class == FORBIDDEN {
            let reason = describe("rejected");
            GateDecision::Reject { rule: first.rule, command: first.command, reason }
        } else {
            let reason = describe("needs approval");
            GateDecision::NeedsApproval { rule: first.rule, command: first.command, reason }
        }
    }
}

impl Policy {
    /// The read-only class, for evidence: the gate must allow the command outright, and its
    /// program must be one that only reads (`systemctl status`, never `systemctl restart`).
    pub fn read_only(&self, command: &str) -> Result<(), String> {
        self.read_only_on("", command)
    }

    /// As [`read_only`](Self::read_only), for a command that runs on `host`: its
    /// `[hosts.<name>]` lists apply too (a program not on its allow-list, or under sudo when
    /// its sudo list does not name it, is refused).
    pub fn read_only_on(&self, host: &str, command: &str) -> Result<(), String> {
        if let GateDecision::Reject { reason, .. } | GateDecision::NeedsApproval { reason, .. } =
            self.gate_on(host, &[command.to_string()])
        {
            return Err(reason);
        }
        let argv = shell_words::split(command).map_err(|e| format!("cannot parse `{command}`: {e}"))?;
        let unwrapped = shell::unwrap(&argv);
        if let Some(why) = unwrapped.not_read_only {
            return Err(why);
        }
        read_only::check(&unwrapped.argv)
    }
}

/// Built-in critical rules a command the operator configured (the service's own start, stop,
/// restart) does not hit: what they guard against is a model's choice, not the operator's.
const TRUSTED_RULES: [&str; 2] = ["secret-use", "parent-path"];

/// Whether `command` runs its program as another user (`sudo`, `doas`, however written or
/// wrapped).
pub fn elevated(command: &str) -> bool {
    shell_words::split(command).is_ok_and(|argv| shell::unwrap(&argv).elevated)
}

/// Control characters but the tab (which reads as the space it splits like) and those
/// `shell-construct` names (newline, carriage return, NUL), and the Unicode line and
/// paragraph separators.
fn is_control(c: char) -> bool {
    (c.is_control() && !matches!(c, '\t' | '\n' | '\r' | '\0')) || matches!(c, '\u{2028}' | '\u{2029}')
}

fn rule_error(class: &'static str, rule: &str, problem: impl Into<String>) -> PolicyError {
    PolicyError::Rule { class, rule: clip(rule, 64), problem: problem.into() }
}

fn parse_class(class: &'static str, value: toml::Value) -> Result<Vec<Rule>, PolicyError> {
    let toml::Value::Array(items) = value else {
        return Err(PolicyError::Toml(format!("'{class}' must be an array of tables ([[{class}]])")));
    };
    if items.len() > MAX_RULES {
        return Err(PolicyError::Toml(format!("{} {class} rules, more than the {MAX_RULES} allowed", items.len())));
    }
    let mut rules = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let label = item.get("name").and_then(|n| n.as_str()).map_or_else(|| format!("#{}", i + 1), str::to_string);
        let raw: RawRule = item.try_into().map_err(|e: toml::de::Error| rule_error(class, &label, e.to_string()))?;
        let name_ok = !raw.name.is_empty()
            && raw.name.len() <= 64
            && raw.name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
        if !name_ok || BUILT_IN.contains(&raw.name.as_str()) {
            let problem = format!("name must be 1-64 characters of [A-Za-z0-9._-] and not one of {BUILT_IN:?}");
            return Err(rule_error(class, &label, problem));
        }
        if raw.reason.trim().is_empty() || raw.reason.len() > 512 {
            return Err(rule_error(class, &label, "reason must be 1-512 bytes"));
        }
        if raw.pattern.trim().is_empty() || raw.pattern.len() > MAX_PATTERN_LEN {
            return Err(rule_error(class, &label, format!("pattern must be 1-{MAX_PATTERN_LEN} bytes")));
        }
        let pattern = RegexBuilder::new(&raw.pattern)
            .size_limit(REGEX_SIZE_LIMIT)
            .build()
            .map_err(|e| rule_error(class, &label, format!("bad regex in 'pattern': {e}")))?;
        if pattern.is_match("") {
            return Err(rule_error(class, &label, "pattern matches empty text, so it would match every command"));
        }
        let quorum = match raw.quorum {
            None => 1,
            Some(_) if class != CRITICAL => {
                return Err(rule_error(class, &label, "quorum applies to critical rules only (they are approved)"))
            }
            Some(q) if (1..=MAX_QUORUM).contains(&q) => q,
            Some(q) => return Err(rule_error(class, &label, format!("quorum {q} is not within 1-{MAX_QUORUM}"))),
        };
        rules.push(Rule { name: raw.name, reason: raw.reason, pattern, quorum });
    }
    Ok(rules)
}
