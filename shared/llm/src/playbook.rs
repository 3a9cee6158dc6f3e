//! The offline `playbook` provider: error patterns -> a diagnosis and remediation
//! alternatives, from TOML rules (a shipped default plus an optional user file checked first).

mod load;
mod template;
#[cfg(test)]
mod tests;

pub use load::{PlaybookError, MAX_ALTERNATIVES, MAX_PLAN_COMMANDS, MAX_PLAYBOOK_BYTES, MAX_RULES};

use crate::{ReasonError, ReasonInput, Reasoner};
use futures::future::BoxFuture;
use pitcrew_model::trim::clip;
use pitcrew_model::{Diagnosis, Plan};
use regex::Regex;
use std::collections::BTreeSet;
use template::{render, Missing};

const MAX_GROUND_LEN: usize = 200;
const MAX_GROUNDS: usize = 8;
/// Known fixes looked at, most recent first.
const MAX_KNOWN_FIXES: usize = 16;
/// Longest incident error quoted into a diagnosis.
const MAX_ERROR_IN_SUMMARY: usize = 300;
const MAX_SUMMARY_LEN: usize = 1000;
const FALLBACK: &str = "fallback";
pub const SOURCE_PREFIX: &str = "playbook:";

/// One rule, validated: a compiled pattern and templates known to be within bounds.
#[derive(Debug, Clone)]
struct Rule {
    name: String,
    /// `None` for the fallback, which matches nothing by itself.
    pattern: Option<Regex>,
    diagnosis: String,
    plans: Vec<Vec<String>>,
}

/// Deterministic offline reasoning: the default provider, and the one that still answers
/// when a model is down. Rules are checked in order; user rules come first.
#[derive(Debug, Clone)]
pub struct Playbook {
    rules: Vec<Rule>,
    fallback: Rule,
    /// The file set `[fallback]` itself (a user fallback then replaces the default one).
    explicit_fallback: bool,
}

impl Playbook {
    /// Rule names in the order they are checked (for `pitcrew` diagnostics and tests).
    pub fn rule_names(&self) -> impl Iterator<Item = &str> {
        self.rules.iter().map(|r| r.name.as_str())
    }

    /// The diagnosis, synchronously: the first matching rule, else the fallback.
    pub fn diagnose_now(&self, input: &ReasonInput<'_>) -> Diagnosis {
        let hit = self.rules.iter().find_map(|rule| {
            let grounds = rule.pattern.as_ref().map(|re| grounds(re, input)).unwrap_or_default();
            (!grounds.is_empty()).then_some((rule, grounds))
        });
        let (rule, grounds) =
            hit.unwrap_or_else(|| (&self.fallback, vec![clip(&input.incident.error, MAX_GROUND_LEN)]));
        let lookup = |name: &str| match name {
            "error" => Some(clip(&input.incident.error, MAX_ERROR_IN_SUMMARY)),
            // A diagnosis is prose: an unknown variable stays visible rather than failing.
            _ => Some(var(input, name).unwrap_or_else(|| format!("{{{name}}}"))),
        };
        let summary = render(&rule.diagnosis, lookup).unwrap_or_else(|_| rule.diagnosis.clone());
        Diagnosis {
            attempt: input.attempt,
            summary: clip(&summary, MAX_SUMMARY_LEN),
            source: format!("{SOURCE_PREFIX}{}", rule.name),
            grounds,
        }
    }

    /// The plan, synchronously: known fixes, then the rule's alternatives, then the
    /// fallback's, skipping anything that already failed or was rejected.
    pub fn plan_now(&self, input: &ReasonInput<'_>, diagnosis: &Diagnosis) -> Result<Plan, ReasonError> {
        let rule = self.rule_for(&diagnosis.source);
        let excluded: BTreeSet<&str> = input
            .failed_commands
            .iter()
            .chain(input.rejected_commands)
            .map(|c| c.trim())
            .filter(|c| !c.is_empty())
            .collect();
        let mut blocked_by = BTreeSet::new();
        let mut check = |cmds: &[String]| {
            let hits: Vec<&str> = cmds.iter().map(|c| c.trim()).filter(|c| excluded.contains(c)).collect();
            let free = hits.is_empty();
            blocked_by.extend(hits.into_iter().map(str::to_string));
            free
        };
        let plan = |commands: Vec<String>, rationale: String, source: &str| Plan {
            attempt: input.attempt,
            commands,
            rationale: with_feedback(rationale, input.feedback),
            source: format!("{SOURCE_PREFIX}{source}"),
        };

        // Memory reorders, never invents: a known fix is reused only when it is one of the
        // alternatives this playbook renders for this target now (a fix recorded for another
        // port, path or host would be a stale command).
        let current: Vec<Vec<String>> = std::iter::once(rule)
            .chain((rule.name != FALLBACK).then_some(&self.fallback))
            .flat_map(|r| r.plans.iter())
            .filter_map(|alt| render_commands(alt, input).ok())
            .collect();
        for (i, fix) in input.known_fixes.iter().take(MAX_KNOWN_FIXES).enumerate() {
            let cmds: Vec<String> = fix.iter().map(|c| c.trim().to_string()).collect();
            let usable = current.contains(&cmds);
            if usable && check(&cmds) {
                let why = format!(
                    "known fix #{} from memory (worked before for this error); playbook rule '{}'",
                    i + 1,
                    rule.name
                );
                return Ok(plan(cmds, why, &rule.name));
            }
        }

        let mut unusable = BTreeSet::new();
        let ladders = std::iter::once(rule).chain((rule.name != FALLBACK).then_some(&self.fallback));
        for r in ladders {
            for (i, alt) in r.plans.iter().enumerate() {
                let cmds = match render_commands(alt, input) {
                    Ok(cmds) => cmds,
                    Err(why) => {
                        unusable.insert(why);
                        continue;
                    }
                };
                if !check(&cmds) {
                    continue;
                }
                let n = r.plans.len();
                let why = if r.name == rule.name {
                    let skipped = if i > 0 {
                        " (earlier alternatives already failed, were rejected or are unusable here)"
                    } else {
                        ""
                    };
                    format!("alternative {} of {n} of playbook rule '{}'{skipped}", i + 1, r.name)
                } else {
                    format!(
                        "playbook rule '{}' has no untried alternative left; fallback alternative {} of {n}",
                        rule.name,
                        i + 1
                    )
                };
                return Ok(plan(cmds, why, &r.name));
            }
        }

        let tried: Vec<String> = blocked_by.into_iter().collect();
        let mut reason = format!(
            "every playbook alternative for '{}' already failed: {}",
            rule.name,
            if tried.is_empty() { "-".to_string() } else { tried.join(", ") }
        );
        if !unusable.is_empty() {
            reason.push_str(&format!("; unusable here: {}", unusable.into_iter().collect::<Vec<_>>().join(", ")));
        }
        Err(ReasonError::Exhausted(clip(&reason, MAX_SUMMARY_LEN)))
    }

    /// The rule a diagnosis came from; the fallback for unknown or non-playbook sources.
    fn rule_for(&self, source: &str) -> &Rule {
        source
            .strip_prefix(SOURCE_PREFIX)
            .and_then(|name| self.rules.iter().find(|r| r.name == name))
            .unwrap_or(&self.fallback)
    }
}

/// A variable's value: the service's vars, with the incident's service name as default.
fn var(input: &ReasonInput<'_>, name: &str) -> Option<String> {
    input.vars.get(name).cloned().or_else(|| (name == "service").then(|| input.incident.service.clone()))
}

/// Render one alternative; `Err` says why it cannot be used here (a missing variable, ...).
fn render_commands(alt: &[String], input: &ReasonInput<'_>) -> Result<Vec<String>, String> {
    // The alert text is untrusted: inside a command it is always one quoted argument.
    let lookup = |name: &str| match name {
        "error" => Some(shell_words::quote(&clip(&input.incident.error, MAX_ERROR_IN_SUMMARY)).into_owned()),
        _ => var(input, name),
    };
    alt.iter()
        .map(|t| {
            let cmd = render(t, lookup).map_err(|Missing(v)| format!("missing variable {{{v}}}"))?;
            let cmd = cmd.trim();
            if cmd.is_empty() || cmd.contains(['\n', '\r']) {
                return Err(format!("'{t}' renders empty or multi-line"));
            }
            crate::fit_to_target(cmd, input.target)
        })
        .collect()
}

/// Say which evaluator feedback the new plan answers, so the timeline shows the loop.
fn with_feedback(rationale: String, feedback: &[String]) -> String {
    if feedback.is_empty() {
        return rationale;
    }
    clip(&format!("{rationale}; previous plan rejected: {}", feedback.join("; ")), MAX_SUMMARY_LEN)
}

/// The observed text a pattern matches: the incident error, evidence details, and the
/// matching line of evidence outputs; each clipped, at most `MAX_GROUNDS`.
fn grounds(re: &Regex, input: &ReasonInput<'_>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut push = |s: String| {
        if out.len() < MAX_GROUNDS && !out.contains(&s) {
            out.push(s);
        }
    };
    if re.is_match(&input.incident.error) {
        push(clip(&input.incident.error, MAX_GROUND_LEN));
    }
    for ev in input.evidence {
        if re.is_match(&ev.detail) {
            push(clip(&ev.detail, MAX_GROUND_LEN));
        } else if let Some(m) = re.find(&ev.output) {
            push(clip(matched_line(&ev.output, m.start(), m.end()), MAX_GROUND_LEN));
        }
    }
    out
}

/// The line around a match, starting close enough before it that clipping keeps the match.
fn matched_line(text: &str, start: usize, end: usize) -> &str {
    let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[end..].find('\n').map_or(text.len(), |i| end + i);
    let mut from = line_start.max(start.saturating_sub(MAX_GROUND_LEN / 2));
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    text[from..line_end].trim()
}

impl Reasoner for Playbook {
    fn name(&self) -> &str {
        "playbook"
    }

    fn diagnose<'a>(&'a self, input: &'a ReasonInput<'a>) -> BoxFuture<'a, Result<Diagnosis, ReasonError>> {
        Box::pin(std::future::ready(Ok(self.diagnose_now(input))))
    }

    fn plan<'a>(
        &'a self,
        input: &'a ReasonInput<'a>,
        diagnosis: &'a Diagnosis,
    ) -> BoxFuture<'a, Result<Plan, ReasonError>> {
        Box::pin(std::future::ready(self.plan_now(input, diagnosis)))
    }
}
