//! Playbook behaviour: matching, precedence, fallback, the alternative ladder, loading errors.

use super::*;
use pitcrew_model::{Evidence, Incident};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Owns everything a `ReasonInput` borrows.
struct Case {
    incident: Incident,
    evidence: Vec<Evidence>,
    vars: BTreeMap<String, String>,
    failed: Vec<String>,
    known: Vec<Vec<String>>,
    feedback: Vec<String>,
    rejected: Vec<String>,
    target: crate::Target,
}

impl Case {
    fn new(error: &str) -> Case {
        let vars = [
            ("service", "toy"),
            ("host", "local"),
            ("start", "/usr/bin/toy start --port 1"),
            ("stop", "/usr/bin/toy stop"),
            ("restart", "/usr/bin/toy restart --port 1"),
        ];
        Case {
            incident: Incident::new("toy", error),
            evidence: Vec::new(),
            vars: vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            failed: Vec::new(),
            known: Vec::new(),
            feedback: Vec::new(),
            rejected: Vec::new(),
            target: crate::Target { host: "local".into(), ..Default::default() },
        }
    }

    fn evidence(mut self, detail: &str, output: &str) -> Case {
        let ev =
            Evidence { attempt: 1, source: "check".into(), detail: detail.into(), output: output.into(), ok: false };
        self.evidence.push(ev);
        self
    }

    fn input(&self) -> ReasonInput<'_> {
        ReasonInput {
            incident: &self.incident,
            attempt: 1,
            target: &self.target,
            evidence: &self.evidence,
            vars: &self.vars,
            failed_commands: &self.failed,
            known_fixes: &self.known,
            feedback: &self.feedback,
            rejected_commands: &self.rejected,
            tools: None,
            usage: None,
            progress: None,
            fallback_if_unreachable: false,
            playbook_at: None,
        }
    }
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn run(book: &Playbook, case: &Case) -> (Diagnosis, Result<Plan, ReasonError>) {
    let d = book.diagnose_now(&case.input());
    let p = book.plan_now(&case.input(), &d);
    (d, p)
}

#[test]
fn embedded_default_parses_with_the_required_rules() {
    let book = Playbook::default_rules();
    let names: Vec<&str> = book.rule_names().collect();
    for want in ["process-down", "wedged", "disk-full", "oom"] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    assert!(book.explicit_fallback);
}

#[test]
fn matches_on_the_incident_error() {
    let case = Case::new("dial tcp 127.0.0.1:8080: connection refused");
    let (d, p) = run(&Playbook::default_rules(), &case);
    assert_eq!(d.source, "playbook:process-down");
    assert_eq!(d.summary, "toy is not running: nothing is listening");
    assert_eq!(d.grounds, vec!["dial tcp 127.0.0.1:8080: connection refused"]);
    let p = p.unwrap();
    assert_eq!(p.commands, vec!["/usr/bin/toy start --port 1"]);
    assert_eq!(p.source, "playbook:process-down");
    assert!(p.rationale.contains("alternative 1 of 2"), "{}", p.rationale);
}

#[test]
fn matches_on_evidence_output_and_detail() {
    let output = format!("{}\nMay 1 toy[42]: worker deadlock detected\nmore", "ok line\n".repeat(100));
    let case = Case::new("health check failed").evidence("GET /health", &output);
    let d = Playbook::default_rules().diagnose_now(&case.input());
    assert_eq!(d.source, "playbook:wedged");
    assert_eq!(d.grounds, vec!["May 1 toy[42]: worker deadlock detected"]);

    let case = Case::new("health check failed").evidence("GET /health returned 503", "");
    let d = Playbook::default_rules().diagnose_now(&case.input());
    assert_eq!((d.source.as_str(), d.grounds[0].as_str()), ("playbook:wedged", "GET /health returned 503"));
}

#[test]
fn grounds_are_clipped_and_keep_the_match() {
    let line = format!("{} out of memory {}", "a".repeat(500), "b".repeat(500));
    let case = Case::new("x".repeat(300).as_str()).evidence("dmesg", &line);
    let d = Playbook::default_rules().diagnose_now(&case.input());
    assert_eq!(d.source, "playbook:oom");
    assert!(d.grounds[0].contains("out of memory") && d.grounds[0].len() <= MAX_GROUND_LEN + 4);
}

#[test]
fn user_rules_take_precedence() {
    let user = Playbook::from_toml(
        r#"
        [[rule]]
        name = "toy-port"
        match = "connection refused"
        diagnosis = "{service} lost its port"
        plans = [["/usr/bin/toy rebind"]]
        "#,
    )
    .unwrap();
    let book = Playbook::merge(user, Playbook::default_rules());
    assert_eq!(book.rule_names().next(), Some("toy-port"));
    let (d, p) = run(&book, &Case::new("connection refused"));
    assert_eq!(d.source, "playbook:toy-port");
    assert_eq!(p.unwrap().commands, vec!["/usr/bin/toy rebind"]);
    // Defaults still answer what the user did not cover.
    assert_eq!(book.diagnose_now(&Case::new("disk full").input()).source, "playbook:disk-full");
    assert!(book.explicit_fallback, "the default fallback is kept");
}

#[test]
fn fallback_when_nothing_matches() {
    let (d, p) = run(&Playbook::default_rules(), &Case::new("weird checksum mismatch"));
    assert_eq!(d.source, "playbook:fallback");
    assert_eq!(d.summary, "toy is unhealthy: weird checksum mismatch");
    assert_eq!(d.grounds, vec!["weird checksum mismatch"]);
    let p = p.unwrap();
    assert_eq!((p.commands, p.source), (strings(&["/usr/bin/toy restart --port 1"]), "playbook:fallback".into()));
}

#[test]
fn failed_commands_walk_the_ladder_then_exhaust() {
    let book = Playbook::from_toml(
        r#"
        [[rule]]
        name = "down"
        match = "down"
        diagnosis = "{service} is down"
        plans = [["{start}"], ["{restart}"], ["{stop}", "/usr/bin/toy start --clean"]]
        [fallback]
        diagnosis = "{service}: {error}"
        plans = [["{restart}"]]
        "#,
    )
    .unwrap();
    let mut case = Case::new("toy is down");
    let mut seen = Vec::new();
    loop {
        match run(&book, &case).1 {
            Ok(p) => {
                case.failed.extend(p.commands.iter().map(|c| format!("  {c} ")));
                seen.push(p.commands);
            }
            Err(e) => {
                let msg = e.to_string();
                assert!(matches!(e, ReasonError::Exhausted(_)));
                assert!(msg.contains("every playbook alternative for 'down' already failed: "), "{msg}");
                assert!(msg.contains("/usr/bin/toy restart --port 1"), "{msg}");
                break;
            }
        }
        assert!(seen.len() < 10, "the ladder must end");
    }
    let want = [
        vec!["/usr/bin/toy start --port 1"],
        vec!["/usr/bin/toy restart --port 1"],
        vec!["/usr/bin/toy stop", "/usr/bin/toy start --clean"],
    ];
    assert_eq!(seen, want.map(|w| strings(&w)).to_vec());
}

#[test]
fn default_process_down_never_repeats_a_failed_start() {
    // `{stop}, {start}` contains the failed `{start}`: it is skipped, never proposed.
    let book = Playbook::default_rules();
    let mut case = Case::new("connection refused");
    case.failed = strings(&["/usr/bin/toy start --port 1"]);
    assert_eq!(run(&book, &case).1.unwrap().commands, vec!["/usr/bin/toy restart --port 1"]);
    case.failed.push("/usr/bin/toy restart --port 1".into());
    let err = run(&book, &case).1.unwrap_err();
    assert!(err.to_string().contains("'process-down'"), "{err}");
}

#[test]
fn rejected_commands_are_skipped_and_feedback_is_cited() {
    let mut case = Case::new("connection refused");
    case.rejected = strings(&["/usr/bin/toy start --port 1"]);
    case.feedback = strings(&["start alone did not help"]);
    let p = run(&Playbook::default_rules(), &case).1.unwrap();
    assert_eq!(p.commands, vec!["/usr/bin/toy restart --port 1"]);
    assert!(p.rationale.contains("alternative 2 of 2") && p.rationale.contains("start alone did not help"));
}

#[test]
fn missing_pid_skips_the_kill_alternative() {
    let book = Playbook::default_rules();
    let case = Case::new("request timed out");
    let p = run(&book, &case).1.unwrap();
    assert_eq!(p.commands, vec!["/usr/bin/toy restart --port 1"]);
    let mut case = Case::new("request timed out");
    case.vars.insert("pid".into(), "4242".into());
    assert_eq!(run(&book, &case).1.unwrap().commands, vec!["kill -9 4242", "/usr/bin/toy start --port 1"]);
    case.vars.remove("pid");
    case.failed = strings(&["/usr/bin/toy restart --port 1"]);
    let err = run(&book, &case).1.unwrap_err().to_string();
    assert!(err.contains("unusable here: missing variable {pid}"), "{err}");
}

#[test]
fn known_fix_is_preferred_unless_it_failed() {
    let mut case = Case::new("connection refused");
    // The restart alternative (second in the ladder) worked before: it is tried first.
    case.known = vec![strings(&["/usr/bin/toy restart --port 1"])];
    let p = run(&Playbook::default_rules(), &case).1.unwrap();
    assert_eq!(p.commands, case.known[0]);
    assert!(p.rationale.contains("known fix #1"), "{}", p.rationale);
    assert_eq!(p.source, "playbook:process-down");
    case.failed = strings(&["/usr/bin/toy restart --port 1"]);
    assert_eq!(run(&Playbook::default_rules(), &case).1.unwrap().commands, vec!["/usr/bin/toy start --port 1"]);
}

#[test]
fn a_stale_known_fix_is_never_replayed() {
    // Recorded for another port (another target): not an alternative here, so ignored.
    let mut case = Case::new("connection refused");
    case.known = vec![strings(&["/usr/bin/toy start --port 9"]), strings(&["rm -rf /tmp/x"])];
    let p = run(&Playbook::default_rules(), &case).1.unwrap();
    assert_eq!(p.commands, vec!["/usr/bin/toy start --port 1"]);
    assert!(!p.rationale.contains("known fix"), "{}", p.rationale);
}

#[test]
fn error_text_is_quoted_inside_commands() {
    let book = Playbook::from_toml(
        "[[rule]]\nname = \"log\"\nmatch = \"boom\"\ndiagnosis = \"{error}\"\nplans = [[\"logger {error}\"]]\n",
    )
    .unwrap();
    let case = Case::new("boom; rm -rf /");
    let (d, p) = run(&book, &case);
    assert_eq!(d.summary, "boom; rm -rf /");
    assert_eq!(p.unwrap().commands, vec!["logger 'boom; rm -rf /'"]);
}

#[test]
fn unknown_or_foreign_diagnosis_source_uses_the_fallback() {
    let case = Case::new("connection refused");
    let d = Diagnosis { attempt: 1, summary: "x".into(), source: "openai:gpt".into(), grounds: vec![] };
    let p = Playbook::default_rules().plan_now(&case.input(), &d).unwrap();
    assert_eq!(p.source, "playbook:fallback");
}

#[test]
fn load_errors_name_the_rule_and_the_problem() {
    let rule = |body: &str| format!("[[rule]]\nname = \"r1\"\n{body}");
    let cases = [
        (rule("match = \"(\"\ndiagnosis = \"d\"\nplans = [[\"a\"]]"), "bad regex"),
        (rule("match = \"x\"\ndiagnosis = \"d\"\nplans = []"), "no plans"),
        (rule("match = \"x\"\ndiagnosis = \"d\"\nplans = [[]]"), "has 0 commands"),
        (rule("match = \"x\"\ndiagnosis = \"d\"\nplans = [[\"a\",\"b\",\"c\",\"d\"]]"), "has 4 commands"),
        (rule("match = \"x|\"\ndiagnosis = \"d\"\nplans = [[\"a\"]]"), "matches empty text"),
        (rule("match = \"x\"\ndiagnosis = \"d\"\nplan = [[\"a\"]]"), "plan"),
    ];
    for (text, want) in cases {
        let err = Playbook::from_toml(&text).unwrap_err().to_string();
        assert!(err.contains("rule 'r1'") && err.contains(want), "{err}");
    }
    let twice = format!("{0}\n{0}", rule("match = \"x\"\ndiagnosis = \"d\"\nplans = [[\"a\"]]"));
    assert!(Playbook::from_toml(&twice).unwrap_err().to_string().contains("defined twice"));
    let err = Playbook::from_toml("[[rule]]\nname = \"fallback\"\nmatch = \"x\"\ndiagnosis = \"d\"\nplans = [[\"a\"]]");
    assert!(err.unwrap_err().to_string().contains("not 'fallback'"));
    assert!(matches!(Playbook::from_toml("[[rule]\nname="), Err(PlaybookError::Toml(_))));
    assert!(Playbook::from_toml("[rules]\n").unwrap_err().to_string().contains("unknown key 'rules'"));
    assert!(matches!(Playbook::from_toml(&"#".repeat(MAX_PLAYBOOK_BYTES + 1)), Err(PlaybookError::TooLarge)));
}

#[test]
fn user_file_is_read_and_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("playbook.toml");
    std::fs::write(&path, "[[rule]]\nname = \"mine\"\nmatch = \"zzz\"\ndiagnosis = \"d\"\nplans = [[\"a\"]]\n")
        .unwrap();
    let book = Playbook::with_user_file(&path).unwrap();
    let names: Vec<&str> = book.rule_names().collect();
    assert_eq!((names[0], names[1]), ("mine", "port-taken"));
    std::fs::write(&path, "[[rule]]\nname = \"mine\"\nmatch = \"(\"\ndiagnosis = \"d\"\nplans = [[\"a\"]]\n").unwrap();
    let err = Playbook::with_user_file(&path).unwrap_err().to_string();
    assert!(err.contains("playbook.toml") && err.contains("rule 'mine'"), "{err}");
    let err = Playbook::with_user_file(&dir.path().join("absent.toml")).unwrap_err();
    assert!(matches!(err, PlaybookError::Read { .. }));
}

#[test]
fn works_as_a_trait_object() {
    let reasoner: Arc<dyn Reasoner> = Arc::new(Playbook::default_rules());
    let case = Case::new("no space left on device");
    let input = case.input();
    let d = futures::executor::block_on(reasoner.diagnose(&input)).unwrap();
    let p = futures::executor::block_on(reasoner.plan(&input, &d)).unwrap();
    assert_eq!((reasoner.name(), d.source.as_str()), ("playbook", "playbook:disk-full"));
    assert_eq!(p.commands, vec!["journalctl --vacuum-size=200M"]);
}

#[test]
fn plans_use_only_what_the_host_has_and_sudo_when_needed() {
    // A Sentinel-style host: no systemctl, a non-root login.
    let mut case = Case::new("connection refused");
    case.vars.insert("start".into(), "systemctl start toy".into());
    case.vars.insert("restart".into(), "service toy restart".into());
    case.target =
        crate::Target { host: "pe1".into(), lacks: strings(&["systemctl"]), needs_sudo: true, ..Default::default() };
    let p = run(&Playbook::default_rules(), &case).1.unwrap();
    assert_eq!(p.commands, vec!["sudo service toy restart"], "the systemctl alternative is skipped");
    case.failed = strings(&["sudo service toy restart"]);
    let err = run(&Playbook::default_rules(), &case).1.unwrap_err().to_string();
    assert!(err.contains("pe1 lacks"), "{err}");
}

#[test]
fn a_port_held_by_another_process_is_freed_before_the_start() {
    let book = Playbook::default_rules();
    let mut case = Case::new("GET http://127.0.0.1:1/health failed: connection closed").evidence(
        "ss -Hltnp sport = :1",
        "port 1 is held by pid 4242 (squatter), not by the service (its pidfile names no running process)",
    );
    case.vars.insert("holder_pid".into(), "4242".into());
    case.target.needs_sudo = true;
    let (d, p) = run(&book, &case);
    assert_eq!(d.source, "playbook:port-taken", "the specific cause beats 'connection ...': {d:?}");
    assert!(d.summary.contains("pid 4242 holds it"), "{}", d.summary);
    assert_eq!(p.unwrap().commands, strings(&["sudo kill 4242", "/usr/bin/toy start --port 1"]));
    // Without a pid (another user's process), the alternative cannot render: fall back.
    case.vars.remove("holder_pid");
    let (_, p) = run(&book, &case);
    assert_eq!(p.unwrap().commands, strings(&["/usr/bin/toy restart --port 1"]));
}

#[test]
fn an_unreadable_config_gets_its_read_permission_back() {
    let book = Playbook::default_rules();
    let mut case = Case::new("connection refused").evidence(
        "tail -n 50 /srv/toy/toy.log",
        "toy: refusing to start: cannot read config /srv/toy/toy.conf: Permission denied (os error 13)",
    );
    case.vars.insert("config".into(), "/srv/toy/toy.conf".into());
    case.target.needs_sudo = true;
    let (d, p) = run(&book, &case);
    assert_eq!(d.source, "playbook:config-unreadable", "{d:?}");
    assert_eq!(p.unwrap().commands, strings(&["sudo chmod a+r /srv/toy/toy.conf", "/usr/bin/toy start --port 1"]));
}
