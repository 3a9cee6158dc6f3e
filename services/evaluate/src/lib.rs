//! evaluate: scores the diagnosis and plan with deterministic checks — grounded in observed
//! evidence (the grounds it cites and every fact its summary states), parseable, 1-3
//! commands, within the host's tools, no repeated failure, not forbidden by policy — and
//! decides PASS (>= 0.7), REGENERATE (with feedback, bounded: an ungrounded diagnosis goes
//! back to diagnose, a bad plan to plan) or BLOCK (< 0.3, forbidden, or out of attempts:
//! escalate).

use futures::future::BoxFuture;
use pitcrew_exec::ExecError;
use pitcrew_model::{Evaluation, EvaluationCheck, EventKind, RunState, Stage, Verdict};
use pitcrew_policy::GateDecision;
use pitcrew_runtime::store::Record;
use pitcrew_runtime::{target, Cx, StageError, StageHandler, Transition};
use std::collections::BTreeMap;

pub const PASS: f64 = 0.7;
pub const BLOCK: f64 = 0.3;

/// The evaluate stage.
pub struct EvaluateStage;

/// The program a command runs, past its wrappers and their options (`sudo -u postgres`), as
/// written, if it parses: as the policy gate reads it.
pub use pitcrew_policy::program;

fn check(name: &str, weight: f64, passed: bool, detail: String) -> EvaluationCheck {
    EvaluationCheck { name: name.into(), passed, weight, detail }
}

/// Facts a diagnosis states that can be checked against what was observed: numbers of two or
/// more digits (pids, ports, sizes, percentages), paths, addresses.
fn facts(summary: &str) -> Vec<String> {
    summary
        .split(|c: char| c.is_whitespace() || "(),;\"'`".contains(c))
        .map(|w| w.trim_end_matches(['.', ':', '!', '?']).trim_start_matches(':'))
        .filter(|w| {
            let digits = w.chars().filter(|c| c.is_ascii_digit()).count();
            (digits >= 2 && w.len() <= 64) || (w.starts_with('/') && w.len() > 1)
        })
        .map(|w| w.to_lowercase())
        .collect()
}

/// Whether a tool call (its words, lower-cased) searches for what it quotes in what the host
/// holds, so a line it answers is the host's, around the quote: grep and its kin (under sudo
/// too), journalctl, and LogQL that only selects lines (`line_format` and `label_format`
/// write them).
fn searches(call: &str) -> bool {
    if let Some(query) = call.strip_prefix("logql") {
        return !query.contains("line_format") && !query.contains("label_format");
    }
    let mut words = call.split_whitespace().filter(|w| *w != "sudo");
    let program = words.next().map(|p| p.rsplit('/').next().unwrap_or(p)).unwrap_or("");
    matches!(program, "grep" | "egrep" | "fgrep" | "zgrep" | "rg" | "journalctl")
}

/// The words of `text`: its runs of letters and digits.
fn words(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty())
}

/// Letters and digits a ground must hold to count as one.
const MIN_GROUND: usize = 4;

/// A judge scoring below this sends the plan back.
pub const JUDGE_PASS: f64 = 0.5;

/// What evaluate knows beyond the run state: which programs exist on the host, commands known
/// to fail for this error, the policy gate's refusal of a command (if any), and the optional
/// judge's verdict (`Err`: it was asked and could not answer).
#[derive(Debug, Default)]
pub struct Findings {
    pub tools: BTreeMap<String, bool>,
    pub failed: Vec<String>,
    pub forbidden: Option<String>,
    pub judge: Option<Result<pitcrew_llm::Judgement, String>>,
    /// The host the service runs on, from the inventory: like the service's name and the
    /// incident's host, a name the diagnosis may state without having observed it.
    pub host: Option<String>,
}

/// Score the current diagnosis and plan. Pure: no I/O.
pub fn assess(state: &RunState, found: &Findings, max_attempts: u32) -> Evaluation {
    let (failed, tools, forbidden) = (&found.failed, &found.tools, found.forbidden.clone());
    let commands: Vec<String> = state.plan.as_ref().map(|p| p.commands.clone()).unwrap_or_default();
    let mut checks = Vec::new();

    // Grounded: every ground the diagnosis cites was observed in this run. A tool call's
    // detail is the command the model itself wrote, and a failed call's output mostly echoes
    // it (`cat: 'pid 42 holds :8080': No such file`): only what a call that worked answered
    // counts, so a model cannot ground a claim in its own words.
    // Each observation with, for a tool call's answer, the words of the call: a quote the call
    // itself holds is no observation either (`ps -o 'pid=port 8080 is held by pid 4242'`
    // works, and prints its header: the model's words).
    let observed: Vec<(String, Option<String>)> = std::iter::once((state.incident.error.to_lowercase(), None))
        .chain(state.current_evidence().flat_map(|e| {
            let tool = e.source == "tool";
            let detail = (!tool).then(|| (e.detail.to_lowercase(), None));
            let output = (!tool || e.ok).then(|| (e.output.to_lowercase(), tool.then(|| e.detail.to_lowercase())));
            detail.into_iter().chain(output)
        }))
        .collect();
    // What the run is about is known, not claimed: "pe1's BGP session is down" states `pe1`.
    let names: Vec<String> = [Some(&state.incident.service), state.incident.host.as_ref(), found.host.as_ref()]
        .into_iter()
        .flatten()
        .map(|n| n.to_lowercase())
        .collect();
    let seen = |fact: &str| observed.iter().any(|(o, _)| o.contains(fact)) || names.iter().any(|n| n == fact);
    // A quote the call's own words hold counts only where the call searched for it in what
    // the host holds (see `searches`) and the answer's line says more than the call did: a
    // word the call does not hold (`grep -F OutOfMemoryError app.log` answering a log line).
    // Not a line of the quote and the call's own words (an `echo` of them, grep finding its
    // own command line), nor anything a call formats itself (a `ps -o` header, a `date`
    // format, PromQL's `label_replace`), whatever it prints beside the quote.
    let more_than = |o: &str, ground: &str, own: &str| {
        let own_words: std::collections::HashSet<&str> = words(own).collect();
        searches(own)
            && o.lines()
                .any(|l| l.contains(ground) && words(&l.replacen(ground, " ", 1)).any(|w| !own_words.contains(w)))
    };
    let quoted = |ground: &str| {
        observed.iter().any(|(o, own)| {
            o.contains(ground) && own.as_ref().is_none_or(|w| !w.contains(ground) || more_than(o, ground, w))
        })
    };
    // A ground too short to say anything (`…`, `.`, `e`) is found in any text: none counts.
    let grounds: Vec<String> = state.diagnosis().map_or_else(Vec::new, |d| {
        d.grounds
            .iter()
            .map(|g| g.trim().trim_end_matches('…').trim().to_lowercase())
            .filter(|g| g.chars().filter(|c| c.is_alphanumeric()).count() >= MIN_GROUND)
            .collect()
    });
    let (grounded, detail) = match state.diagnosis() {
        None => (false, "no diagnosis for this attempt".to_string()),
        Some(_) if grounds.is_empty() => (false, "the diagnosis cites no observed evidence".to_string()),
        Some(d) => match grounds.iter().find(|g| !quoted(g)) {
            Some(g) => (false, format!("claim not backed by anything observed in this run: '{g}'")),
            None => match facts(&d.summary).into_iter().find(|f| !seen(f)) {
                Some(f) => (false, format!("the diagnosis states '{f}', which nothing observed in this run shows")),
                None => (true, format!("{} ground(s) found in observed evidence", grounds.len())),
            },
        },
    };
    checks.push(check("grounded", 0.25, grounded, detail));

    let count_ok = (1..=3).contains(&commands.len());
    checks.push(check("count", 0.15, count_ok, format!("{} command(s); 1-3 required", commands.len())));

    let unparseable: Vec<&String> = commands.iter().filter(|c| program(c).is_none()).collect();
    checks.push(check(
        "parseable",
        0.2,
        unparseable.is_empty() && !commands.is_empty(),
        if unparseable.is_empty() { "every command parses".into() } else { format!("cannot parse: {unparseable:?}") },
    ));

    let missing: Vec<String> =
        commands.iter().filter_map(|c| program(c)).filter(|p| !tools.get(p).copied().unwrap_or(false)).collect();
    checks.push(check(
        "tools",
        0.2,
        missing.is_empty(),
        if missing.is_empty() {
            "every program exists on the host".into()
        } else {
            format!("not on the host: {}", missing.join(", "))
        },
    ));

    let repeated: Vec<&String> =
        commands.iter().filter(|c| failed.iter().any(|f| pitcrew_policy::same_command(f, c))).collect();
    checks.push(check(
        "not_repeated",
        0.2,
        repeated.is_empty(),
        if repeated.is_empty() {
            "no command already failed for this error".into()
        } else {
            format!("already failed for this error: {repeated:?}")
        },
    ));

    // Not scored, but no plan passes without it: each command is shown to its approver as a
    // whole, its secrets' values redacted and nothing more. A secret written out in a form
    // whose redaction takes the words after it (a `Cookie:` header's runs to the line's end)
    // would hide what the command does from whoever approves it.
    let hiding: Vec<usize> = commands
        .iter()
        .enumerate()
        .filter(|(_, c)| pitcrew_model::redact::redact(c).split_whitespace().count() < c.split_whitespace().count())
        .map(|(i, _)| i + 1)
        .collect();
    checks.push(check(
        "shown_whole",
        0.0,
        hiding.is_empty(),
        if hiding.is_empty() {
            "every command can be shown whole, its secrets redacted".into()
        } else {
            format!(
                "command(s) {hiding:?} hold a secret whose redaction would hide the words after it from the \
                 approver: name it as {{secret:NAME}} instead of writing it out"
            )
        },
    ));

    // Not scored: a forbidden command blocks the plan outright (the gate would refuse it too;
    // here the evaluation records why).
    let allowed = forbidden.is_none();
    checks.push(check("policy", 0.0, allowed, forbidden.unwrap_or_else(|| "no command is forbidden".into())));

    // The judge's objection sends the plan back (its reason is the feedback); a judge that
    // could not answer is noted, not held against the plan.
    let judged_ok = match &found.judge {
        None => true,
        Some(Ok(j)) => {
            let ok = j.score >= JUDGE_PASS;
            checks.push(check("judge", 0.2, ok, format!("scored {:.2}: {}", j.score, j.reason)));
            ok
        }
        Some(Err(e)) => {
            checks.push(check("judge", 0.0, true, format!("not consulted: {e}")));
            true
        }
    };

    let total: f64 = checks.iter().map(|c| c.weight).sum();
    let mut score: f64 = checks.iter().filter(|c| c.passed).map(|c| c.weight).sum::<f64>() / total.max(f64::EPSILON);
    // A plan that cannot run as written, or repeats a failure, never passes on points.
    let critical_failed = checks.iter().any(|c| !c.passed && c.name != "grounded" && c.name != "judge");
    if critical_failed {
        score *= 0.5;
    }
    let score = (score * 1000.0).round() / 1000.0;
    let problems: Vec<String> =
        checks.iter().filter(|c| !c.passed).map(|c| format!("{}: {}", c.name, c.detail)).collect();
    let feedback = (!problems.is_empty()).then(|| problems.join("; "));
    let verdict = if !allowed {
        Verdict::Block
    } else if score >= PASS && !critical_failed && grounded && judged_ok {
        Verdict::Pass
    } else if score < BLOCK || state.regeneration + 1 >= max_attempts {
        Verdict::Block
    } else {
        Verdict::Regenerate
    };
    Evaluation { attempt: state.attempt, regeneration: state.regeneration, score, verdict, checks, feedback }
}

/// Ask the provider's judge about this attempt's diagnosis and plan (recording its usage).
async fn judge(
    cx: &mut Cx<'_>,
    state: &RunState,
    reasoning: &target::ReasonContext,
) -> Result<Option<Result<pitcrew_llm::Judgement, String>>, StageError> {
    let (Some(diagnosis), Some(plan)) = (state.diagnosis().cloned(), state.plan.clone()) else { return Ok(None) };
    let meter = pitcrew_llm::UsageMeter::default();
    let mut input = reasoning.input(state);
    input.usage = Some(&meter);
    // A judge slower than the step's time is not consulted.
    cx.bound_model(&mut input);
    let verdict = cx.deps.reasoner.judge(&input, &diagnosis, &plan).await;
    target::record_usage(cx, state, Stage::Evaluate, &meter);
    Ok(match verdict {
        Ok(Some(j)) => Some(Ok(j)),
        Ok(None) => None,
        // Its own words: a judge cut by the step's time was slow, not unreachable.
        Err(pitcrew_llm::ReasonError::Transient(why)) => Some(Err(why)),
        Err(e) => Some(Err(e.to_string())),
    })
}

impl StageHandler for EvaluateStage {
    fn stage(&self) -> Stage {
        Stage::Evaluate
    }

    fn handle<'a>(
        &'a self,
        state: &'a mut RunState,
        cx: &'a mut Cx<'_>,
    ) -> BoxFuture<'a, Result<Transition, StageError>> {
        Box::pin(async move {
            let cfg = cx.deps.config.clone();
            let spec = pitcrew_runtime::service_or_escalate!(&cfg, state);
            if state.plan.is_none() {
                return Err(StageError::Poison("run state reached evaluate without a plan".into()));
            }
            // Memory (commands known to fail) and, for the judge, everything a provider sees.
            let reasoning = target::ReasonContext::gather(cx.deps, state, spec).await?;
            let failed = reasoning.failed.clone();
            if let Err(ExecError::Unreachable(e)) = cx.deps.executor.reachable(&spec.host).await {
                return Ok(Transition::Escalate(format!("host {} unreachable: {e}", spec.host)));
            }
            let mut tools = BTreeMap::new();
            for c in state.plan.iter().flat_map(|p| p.commands.iter()) {
                if let Some(p) = program(c) {
                    // A host that cannot say now (slow, cut off for a moment) says nothing of the
                    // plan: read as "not there", a good plan was sent back as naming a program
                    // the host lacks, and blocked at the last regeneration.
                    let Some(present) = cx.deps.executor.tool_answer(&spec.host, &p).await else {
                        return Err(StageError::Transient(format!(
                            "host {} did not say whether it has `{p}` (its probe failed or took too long): \
                             the plan is evaluated again",
                            spec.host
                        )));
                    };
                    tools.insert(p, present);
                }
            }
            let commands: Vec<String> = state.plan.iter().flat_map(|p| p.commands.clone()).collect();
            // The approval gate would refuse it too; refusing here puts the reason in the
            // evaluation. The escalation reads as the gate's would.
            let (forbidden, refused) = match cx.deps.policy.gate_on(&spec.host, &commands) {
                GateDecision::Reject { command, reason, .. } => {
                    (Some(reason.clone()), Some(format!("policy rejected `{command}`: {reason}")))
                }
                _ => (None, None),
            };
            let judge = if cfg.reasoning.judge { judge(cx, state, &reasoning).await? } else { None };
            let host = cfg.services.get(&state.incident.service).map(|spec| spec.host.clone());
            let found = Findings { tools, failed, forbidden, judge, host };
            let ev = assess(state, &found, cfg.limits.max_attempts);
            let ungrounded = ev.checks.iter().any(|c| c.name == "grounded" && !c.passed);
            cx.record(Record::Evaluation(state.run_id, ev.clone()));
            cx.emit(
                EventKind::Evaluation,
                format!(
                    "{} (score {:.2}){}",
                    ev.verdict.as_str().to_uppercase(),
                    ev.score,
                    ev.feedback.as_ref().map(|f| format!(": {f}")).unwrap_or_default()
                ),
                serde_json::to_value(&ev).unwrap_or_default(),
            );
            let verdict = ev.verdict;
            let feedback = ev.feedback.clone();
            let score = ev.score;
            state.evaluation = Some(ev);
            Ok(match verdict {
                Verdict::Pass => Transition::To(Stage::Approval),
                Verdict::Regenerate => {
                    state.send_back_plan(feedback.unwrap_or_default(), !ungrounded);
                    // A diagnosis that claims what nobody observed is redone, not just its plan.
                    Transition::To(if ungrounded { Stage::Diagnose } else { Stage::Plan })
                }
                Verdict::Block if refused.is_some() => Transition::Escalate(refused.unwrap_or_default()),
                Verdict::Block => Transition::Escalate(format!(
                    "evaluation blocked the plan (score {score:.2}, regeneration {} of {}): {}",
                    state.regeneration + 1,
                    cfg.limits.max_attempts,
                    feedback.unwrap_or_default()
                )),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pitcrew_model::{Diagnosis, Evidence, Incident, Plan};

    fn state(grounds: &[&str], commands: &[&str]) -> RunState {
        let mut s = RunState::new(uuid::Uuid::nil(), Incident::new("web", "GET /health: connection refused"));
        s.push_evidence(Evidence {
            attempt: 1,
            source: "check".into(),
            detail: "port 80 closed".into(),
            output: String::new(),
            ok: false,
        });
        s.diagnosis_log.push(Diagnosis {
            attempt: 1,
            summary: "down".into(),
            source: "playbook:x".into(),
            grounds: grounds.iter().map(|g| g.to_string()).collect(),
        });
        s.plan = Some(Plan {
            attempt: 1,
            commands: commands.iter().map(|c| c.to_string()).collect(),
            rationale: String::new(),
            source: String::new(),
        });
        s
    }

    fn tools(present: &[&str]) -> BTreeMap<String, bool> {
        ["systemctl", "touch", "kill", "nosuchtool"].iter().map(|t| (t.to_string(), present.contains(t))).collect()
    }

    fn found(failed: &[&str], present: &[&str], forbidden: Option<String>) -> Findings {
        Findings {
            tools: tools(present),
            failed: failed.iter().map(|f| f.to_string()).collect(),
            forbidden,
            judge: None,
            host: None,
        }
    }

    #[test]
    fn the_judge_is_weighed_and_its_objection_sends_the_plan_back() {
        let s = state(&["connection refused"], &["systemctl restart web"]);
        let mut f = found(&[], &["systemctl"], None);
        f.judge = Some(Ok(pitcrew_llm::Judgement { score: 0.9, reason: "sound".into() }));
        let ev = assess(&s, &f, 3);
        assert_eq!((ev.verdict, ev.score), (Verdict::Pass, 1.0));
        f.judge = Some(Ok(pitcrew_llm::Judgement { score: 0.1, reason: "restarting will not free the disk".into() }));
        let ev = assess(&s, &f, 3);
        assert_eq!(ev.verdict, Verdict::Regenerate);
        assert!((ev.score - 1.0 / 1.2).abs() < 0.001, "{}", ev.score);
        assert!(ev.feedback.unwrap().contains("restarting will not free the disk"));
        f.judge = Some(Err("reasoning provider unavailable: timeout".into()));
        let ev = assess(&s, &f, 3);
        assert_eq!(ev.verdict, Verdict::Pass, "an unavailable judge is noted, not held against the plan");
        assert!(ev.checks.iter().any(|c| c.name == "judge" && c.detail.starts_with("not consulted")));
    }

    #[test]
    fn a_grounded_runnable_plan_passes() {
        let s = state(&["connection refused", "Port 80 closed"], &["systemctl restart web"]);
        let ev = assess(&s, &found(&[], &["systemctl"], None), 3);
        assert_eq!(ev.verdict, Verdict::Pass, "{ev:?}");
        assert_eq!(ev.score, 1.0);
        assert!(ev.feedback.is_none());
    }

    #[test]
    fn a_repeated_failure_is_sent_back_with_feedback() {
        let s = state(&["connection refused"], &["systemctl restart web"]);
        let ev = assess(&s, &found(&["systemctl restart web"], &["systemctl"], None), 3);
        assert_eq!(ev.verdict, Verdict::Regenerate);
        assert!(ev.feedback.unwrap().contains("already failed"));
        // The same words spelled otherwise are the same command.
        let s = state(&["connection refused"], &["systemctl  restart 'web'"]);
        let ev = assess(&s, &found(&["systemctl restart web"], &["systemctl"], None), 3);
        assert_eq!(ev.verdict, Verdict::Regenerate);
    }

    #[test]
    fn regeneration_is_bounded_then_blocks() {
        let mut s = state(&["connection refused"], &["nosuchtool --fix"]);
        s.regeneration = 2;
        let ev = assess(&s, &found(&[], &[], None), 3);
        assert_eq!(ev.verdict, Verdict::Block);
    }

    #[test]
    fn ungrounded_claims_and_bad_plans_score_low() {
        let s = state(&["disk is full"], &["echo 'unterminated", "a", "b", "c"]);
        let ev = assess(&s, &found(&[], &[], None), 3);
        assert!(ev.score < BLOCK, "{ev:?}");
        assert_eq!(ev.verdict, Verdict::Block);
        let grounded = ev.checks.iter().find(|c| c.name == "grounded").unwrap();
        assert!(!grounded.passed && grounded.detail.contains("disk is full"));
    }

    #[test]
    fn a_model_cannot_ground_a_claim_in_its_own_tool_call() {
        let mut s = state(&["pid 4242 holds port 8080"], &["systemctl restart web"]);
        // The model asked for a command quoting its own claim; the host answered nothing of it.
        s.push_evidence(Evidence {
            attempt: 1,
            source: "tool".into(),
            detail: "cat 'pid 4242 holds port 8080'".into(),
            output: "cat: 'pid 4242 holds port 8080': No such file".into(),
            ok: false,
        });
        let grounded = |s: &RunState| {
            assess(s, &found(&[], &["systemctl"], None), 3).checks.into_iter().find(|c| c.name == "grounded").unwrap()
        };
        assert!(!grounded(&s).passed, "neither the model's command line nor a failure's echo of it is an observation");
        // Nor is a call that worked and printed the model's own words back.
        let last = s.evidence.last_mut().unwrap();
        last.ok = true;
        last.detail = "ps -p 1 -o 'pid=pid 4242 holds port 8080'".into();
        last.output = "pid 4242 holds port 8080\n  1\n".into();
        assert!(!grounded(&s).passed, "a header the model wrote is not an observation");
        // A line the host answered that holds the words asked for, and more, is one.
        let last = s.evidence.last_mut().unwrap();
        last.detail = "grep -F 'pid 4242 holds port 8080' /var/log/web.log".into();
        last.output = "12:01:07 warn: pid 4242 holds port 8080, retrying\n".into();
        assert!(grounded(&s).passed, "a matching log line is an observation");
        // A line of the quote and the call's own words is not, whatever program printed it.
        let last = s.evidence.last_mut().unwrap();
        last.detail = "echo 'pid 4242 holds port 8080' retrying".into();
        last.output = "pid 4242 holds port 8080 retrying\n".into();
        assert!(!grounded(&s).passed, "an echo of the call's own words is not an observation");
        // Nor a header a call formats itself, beside words it did not write.
        let last = s.evidence.last_mut().unwrap();
        last.detail = "ps -o 'pcpu,args=pid 4242 holds port 8080' -p 1".into();
        last.output = "%CPU pid 4242 holds port 8080\n 0.0 /sbin/init\n".into();
        assert!(!grounded(&s).passed, "a ps header the model wrote is not an observation");
        // Nor a PromQL answer, whose labels the query can write (beside ones it did not).
        let last = s.evidence.last_mut().unwrap();
        last.detail = r#"PromQL: label_replace(up, "why", "pid 4242 holds port 8080", "", "")"#.into();
        last.output = r#"up{instance="web-1",job="web",why="pid 4242 holds port 8080"} 1"#.into();
        assert!(!grounded(&s).passed, "a label the query wrote is not an observation");
        // A LogQL line filter answering a log line is one; a line the query rewrote is not.
        let last = s.evidence.last_mut().unwrap();
        last.detail = r#"LogQL over 30 min: {app="web"} |= "pid 4242 holds port 8080""#.into();
        last.output = "2026-11-28T12:01:07Z warn: pid 4242 holds port 8080, retrying\n".into();
        assert!(grounded(&s).passed, "a log line Loki found is an observation");
        let last = s.evidence.last_mut().unwrap();
        last.detail = r#"LogQL over 30 min: {app="web"} | line_format "pid 4242 holds port 8080 {{.level}}""#.into();
        last.output = "2026-11-28T12:01:07Z pid 4242 holds port 8080 warn\n".into();
        assert!(!grounded(&s).passed, "a line the query wrote is not an observation");
        // What the host answered to a call that worked is.
        let last = s.evidence.last_mut().unwrap();
        last.detail = "ss -ltnp".into();
        last.output = "LISTEN 0 128 *:8080 users:((\"x\",pid=4242)) pid 4242 holds port 8080".into();
        assert!(grounded(&s).passed);
    }

    #[test]
    fn grounds_too_short_to_say_anything_ground_nothing() {
        for grounds in [&["…"][..], &["."], &["e", " refused "], &["  ", "50"]] {
            let mut s = state(grounds, &["systemctl restart web"]);
            s.diagnosis_log[0].summary = "the config is invalid".into();
            let ev = assess(&s, &found(&[], &["systemctl"], None), 3);
            let check = ev.checks.iter().find(|c| c.name == "grounded").unwrap();
            if grounds.contains(&" refused ") {
                // One real ground among them: the short ones are left out, not held against it.
                assert!(check.passed, "{grounds:?}: {check:?}");
            } else {
                assert!(!check.passed && check.detail.contains("cites no observed evidence"), "{grounds:?}: {check:?}");
                assert_eq!(ev.verdict, Verdict::Regenerate, "{grounds:?}");
            }
        }
    }

    #[test]
    fn an_ungrounded_diagnosis_is_regenerated_even_with_a_runnable_plan() {
        let s = state(&["something never seen"], &["systemctl restart web"]);
        let ev = assess(&s, &found(&[], &["systemctl"], None), 3);
        assert_eq!(ev.score, 0.75);
        assert_eq!(ev.verdict, Verdict::Regenerate, "an invented fact never passes on points");
        assert!(ev.feedback.unwrap().contains("something never seen"));
    }

    #[test]
    fn facts_the_summary_states_must_have_been_observed() {
        let mut s = state(&["connection refused"], &["systemctl restart web"]);
        s.diagnosis_log[0].summary = "web is down: port 80 closed, see /health".into();
        let ev = assess(&s, &found(&[], &["systemctl"], None), 3);
        assert_eq!(ev.verdict, Verdict::Pass, "80 and /health were observed: {ev:?}");
        s.diagnosis_log[0].summary = "web is down: /dev/sda1 is 100% full (pid 4242)".into();
        let ev = assess(&s, &found(&[], &["systemctl"], None), 3);
        assert_eq!(ev.verdict, Verdict::Regenerate);
        let grounded = ev.checks.iter().find(|c| c.name == "grounded").unwrap();
        assert!(grounded.detail.contains("/dev/sda1"), "{grounded:?}");
        assert_eq!(facts("pid 4242 holds :8080, see /var/log/x.log."), vec!["4242", "8080", "/var/log/x.log"]);
    }

    /// The service's name, the incident's host and the inventory's host are what the run is
    /// about: a diagnosis may name them (`pe1`, `svc-72`, `web-01`) without observing them, but
    /// a number inside one of them grounds nothing else.
    #[test]
    fn the_names_a_run_is_about_need_no_observing() {
        let mut s = state(&["connection refused"], &["systemctl restart web"]);
        s.incident.service = "svc-72".into();
        s.diagnosis_log[0].summary = "svc-72 is down on web-01".into();
        let ev = assess(&s, &found(&[], &["systemctl"], None), 3);
        assert_eq!(ev.verdict, Verdict::Regenerate, "web-01 is known to no one here: {ev:?}");
        let mut on_host = found(&[], &["systemctl"], None);
        on_host.host = Some("WEB-01".into());
        let ev = assess(&s, &on_host, 3);
        assert_eq!(ev.verdict, Verdict::Pass, "the service and its host: {ev:?}");
        s.incident.host = Some("web-01".into());
        assert_eq!(assess(&s, &found(&[], &["systemctl"], None), 3).verdict, Verdict::Pass, "the incident's host");
        s.diagnosis_log[0].summary = "svc-72 is down: port 72 closed".into();
        let ev = assess(&s, &found(&[], &["systemctl"], None), 3);
        assert_eq!(ev.verdict, Verdict::Regenerate, "72 is part of a name, not an observation: {ev:?}");
    }

    #[test]
    fn a_forbidden_command_blocks_and_the_evaluation_says_why() {
        let s = state(&["connection refused"], &["systemctl restart web"]);
        let why = "rejected by policy rule 'rm-system-path' (forbidden): deletes the root — `rm -rf /`".to_string();
        let ev = assess(&s, &found(&[], &["systemctl"], Some(why.clone())), 3);
        assert_eq!(ev.verdict, Verdict::Block);
        let policy = ev.checks.iter().find(|c| c.name == "policy").unwrap();
        assert!(!policy.passed && policy.detail == why);
        assert!(ev.feedback.unwrap().contains("rm-system-path"));
    }

    /// A secret written so that its redaction would take the rest of the command (a cookie
    /// header's pattern runs to the line's end) hides what the approver approves: the plan is
    /// sent back, never passed. A value redacted in place is shown whole.
    #[test]
    fn a_command_whose_redaction_would_hide_part_of_it_never_passes() {
        let hiding = "curl -H 'Cookie: sid=abc' -o /usr/local/bin/web-helper https://x.example/p";
        let s = state(&["connection refused"], &[hiding]);
        let ev = assess(&s, &found(&[], &["curl"], None), 3);
        assert_eq!(ev.verdict, Verdict::Regenerate, "{ev:?}");
        let shown = ev.checks.iter().find(|c| c.name == "shown_whole").unwrap();
        assert!(!shown.passed && shown.detail.contains("[1]") && shown.detail.contains("{secret:NAME}"), "{shown:?}");
        let s = state(&["connection refused"], &["systemctl restart web", "curl -u admin:hunter2 http://web/reload"]);
        let ev = assess(&s, &found(&[], &["systemctl", "curl"], None), 3);
        assert!(ev.checks.iter().find(|c| c.name == "shown_whole").unwrap().passed, "{ev:?}");
    }

    #[test]
    fn program_skips_sudo_and_its_flags() {
        assert_eq!(program("sudo -n systemctl restart x").as_deref(), Some("systemctl"));
        // An option's value is not the program.
        assert_eq!(program("sudo -u postgres pg_ctl restart").as_deref(), Some("pg_ctl"));
        assert_eq!(program("sudo -n -u app /opt/app/bin/start").as_deref(), Some("/opt/app/bin/start"));
        assert_eq!(program("'unterminated"), None);
        assert_eq!(program(""), None);
    }
}
