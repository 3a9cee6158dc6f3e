//! Loading playbooks: TOML rules validated and compiled up front, so a bad rule fails at
//! start-up with its name rather than at the first incident.

use super::template::MAX_TEMPLATE_LEN;
use super::{Playbook, Rule, FALLBACK};
use pitcrew_model::trim::clip;
use regex::RegexBuilder;
use serde::Deserialize;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The shipped rules; a test proves they parse.
const DEFAULT_TOML: &str = include_str!("../../playbook.toml");
/// Largest playbook file read: rules are short, a huge file is a mistake.
pub const MAX_PLAYBOOK_BYTES: usize = 256 * 1024;
/// Most rules one playbook file may hold.
pub const MAX_RULES: usize = 256;
/// Most alternatives one rule may hold.
pub const MAX_ALTERNATIVES: usize = 8;
/// Commands per plan: one per line, never chained.
pub const MAX_PLAN_COMMANDS: usize = 3;
const MAX_PATTERN_LEN: usize = 1024;
/// Compiled-regex budget per rule, so a pathological pattern fails at load, not per incident.
const REGEX_SIZE_LIMIT: usize = 1 << 20;

/// Why a playbook could not be loaded. Every variant is a configuration mistake to fix;
/// rule errors name the rule and the problem.
#[derive(Debug, thiserror::Error)]
pub enum PlaybookError {
    #[error("playbook is not valid TOML: {0}")]
    Toml(String),
    #[error("playbook rule '{rule}': {problem}")]
    Rule { rule: String, problem: String },
    #[error("playbook is larger than the {MAX_PLAYBOOK_BYTES} bytes allowed")]
    TooLarge,
    #[error("cannot read playbook file {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("playbook file {}: {error}", path.display())]
    File {
        path: PathBuf,
        #[source]
        error: Box<PlaybookError>,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: String,
    #[serde(rename = "match")]
    pattern: String,
    diagnosis: String,
    plans: Vec<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFallback {
    diagnosis: String,
    plans: Vec<Vec<String>>,
}

fn rule_error(rule: &str, problem: impl Into<String>) -> PlaybookError {
    PlaybookError::Rule { rule: rule.to_string(), problem: problem.into() }
}

/// Check bounds and compile one rule; `pattern` is `None` only for the fallback.
fn compile(
    name: &str,
    pattern: Option<&str>,
    diagnosis: String,
    plans: Vec<Vec<String>>,
) -> Result<Rule, PlaybookError> {
    let pattern = match pattern {
        None => None,
        Some(p) if p.trim().is_empty() => return Err(rule_error(name, "empty match pattern")),
        Some(p) if p.len() > MAX_PATTERN_LEN => {
            return Err(rule_error(name, format!("match pattern longer than {MAX_PATTERN_LEN} bytes")))
        }
        Some(p) => {
            let re = RegexBuilder::new(p)
                .size_limit(REGEX_SIZE_LIMIT)
                .build()
                .map_err(|e| rule_error(name, format!("bad regex in 'match': {e}")))?;
            if re.is_match("") {
                return Err(rule_error(name, "match pattern matches empty text, so it would match every incident"));
            }
            Some(re)
        }
    };
    if diagnosis.trim().is_empty() || diagnosis.len() > MAX_TEMPLATE_LEN {
        return Err(rule_error(name, format!("diagnosis must be 1-{MAX_TEMPLATE_LEN} bytes")));
    }
    if plans.is_empty() {
        return Err(rule_error(name, "no plans"));
    }
    if plans.len() > MAX_ALTERNATIVES {
        return Err(rule_error(name, format!("{} plans, more than the {MAX_ALTERNATIVES} allowed", plans.len())));
    }
    for (i, plan) in plans.iter().enumerate() {
        if plan.is_empty() || plan.len() > MAX_PLAN_COMMANDS {
            let n = plan.len();
            return Err(rule_error(name, format!("plan {} has {n} commands (1-{MAX_PLAN_COMMANDS} allowed)", i + 1)));
        }
        for cmd in plan {
            if cmd.trim().is_empty() || cmd.len() > MAX_TEMPLATE_LEN || cmd.contains(['\n', '\r']) {
                return Err(rule_error(
                    name,
                    format!("plan {} has a command that is empty, multi-line or over {MAX_TEMPLATE_LEN} bytes", i + 1),
                ));
            }
        }
    }
    Ok(Rule { name: name.to_string(), pattern, diagnosis, plans })
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

/// The fallback when a file has none: the seeds' generic "restart it".
fn builtin_fallback() -> Rule {
    Rule {
        name: FALLBACK.to_string(),
        pattern: None,
        diagnosis: "{service} is unhealthy: {error}".to_string(),
        plans: vec![vec!["{restart}".to_string()]],
    }
}

impl Playbook {
    /// The rules shipped with pitcrew (`shared/llm/playbook.toml`).
    pub fn default_rules() -> Playbook {
        Playbook::from_toml(DEFAULT_TOML).expect("the embedded playbook.toml is valid (tested)")
    }

    /// Parse a playbook: `[[rule]]` tables and an optional `[fallback]` table.
    pub fn from_toml(text: &str) -> Result<Playbook, PlaybookError> {
        if text.len() > MAX_PLAYBOOK_BYTES {
            return Err(PlaybookError::TooLarge);
        }
        let table: toml::Table = toml::from_str(text).map_err(|e| PlaybookError::Toml(e.to_string()))?;
        let mut book = Playbook { rules: Vec::new(), fallback: builtin_fallback(), explicit_fallback: false };
        for (key, value) in table {
            match key.as_str() {
                "rule" => book.rules = parse_rules(value)?,
                "fallback" => {
                    let raw: RawFallback = value.try_into().map_err(|e| rule_error(FALLBACK, e.to_string()))?;
                    book.fallback = compile(FALLBACK, None, raw.diagnosis, raw.plans)?;
                    book.explicit_fallback = true;
                }
                other => {
                    return Err(PlaybookError::Toml(format!(
                        "unknown key '{other}' (expected [[rule]] tables and a [fallback] table)"
                    )))
                }
            }
        }
        Ok(book)
    }

    /// The user's rules (checked first) on top of the shipped defaults.
    pub fn with_user_file(path: &Path) -> Result<Playbook, PlaybookError> {
        let in_file = |error| PlaybookError::File { path: path.to_path_buf(), error: Box::new(error) };
        let read_err = |source| PlaybookError::Read { path: path.to_path_buf(), source };
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_PLAYBOOK_BYTES as u64 + 1).read_to_string(&mut text))
            .map_err(read_err)?;
        let user = Playbook::from_toml(&text).map_err(in_file)?;
        Ok(Playbook::merge(user, Playbook::default_rules()))
    }

    /// `user` rules first, then `defaults`; the user's `[fallback]` wins when it set one.
    pub fn merge(user: Playbook, defaults: Playbook) -> Playbook {
        let (fallback, explicit_fallback) = if user.explicit_fallback {
            (user.fallback, true)
        } else {
            (defaults.fallback, defaults.explicit_fallback)
        };
        let mut rules = user.rules;
        rules.extend(defaults.rules);
        Playbook { rules, fallback, explicit_fallback }
    }
}

fn parse_rules(value: toml::Value) -> Result<Vec<Rule>, PlaybookError> {
    let toml::Value::Array(items) = value else {
        return Err(PlaybookError::Toml("'rule' must be an array of tables ([[rule]])".into()));
    };
    if items.len() > MAX_RULES {
        return Err(PlaybookError::Toml(format!("{} rules, more than the {MAX_RULES} allowed", items.len())));
    }
    let mut rules: Vec<Rule> = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let label = item.get("name").and_then(|n| n.as_str()).map_or_else(|| format!("#{}", i + 1), clip_name);
        let raw: RawRule = item.try_into().map_err(|e: toml::de::Error| rule_error(&label, e.to_string()))?;
        if !valid_name(&raw.name) || raw.name == FALLBACK {
            return Err(rule_error(&label, "name must be 1-64 characters of [A-Za-z0-9._-] and not 'fallback'"));
        }
        if rules.iter().any(|r| r.name == raw.name) {
            return Err(rule_error(&label, "defined twice"));
        }
        rules.push(compile(&raw.name, Some(&raw.pattern), raw.diagnosis, raw.plans)?);
    }
    Ok(rules)
}

fn clip_name(name: &str) -> String {
    clip(name, 64)
}
