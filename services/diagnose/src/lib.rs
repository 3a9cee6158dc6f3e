//! diagnose: gathers read-only evidence (the service's health check, its pid), consults
//! episodic memory, and asks the reasoning provider what is wrong.

use futures::future::BoxFuture;
use pitcrew_exec::{run_check, Executor};
use pitcrew_llm::{ReasonError, ToolOutput, ToolSpec, Tools};
use pitcrew_model::{EventKind, Evidence, RunState, ServiceSpec, Stage};
use pitcrew_policy::Policy;
use pitcrew_runtime::{target, Cx, StageError, StageHandler, Transition};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub mod web;

/// The diagnose stage.
#[derive(Default)]
pub struct Diagnose {
    /// The configured HTTP tools, built once (their client pools connections).
    web: std::sync::OnceLock<Option<web::WebTools>>,
    /// The read-only commands this process's runs are running, for the runs that ask for the
    /// same ones meanwhile (one executor per process).
    flights: Flights,
}

/// What a read-only command's run said: (succeeded, trimmed and redacted output or the error).
type Read = (bool, String);

/// One command's run on one host, for whoever asks for it while it runs.
struct Flight {
    began: Instant,
    answer: tokio::sync::OnceCell<Read>,
}

static JOINED: pitcrew_metrics::Counter = pitcrew_metrics::Counter::new(
    "pitcrew_commands_joined_total",
    "Read-only commands a run did not start because its host was running the same one for another run: \
     the run took that one's answer.",
    &[],
);

/// How long a run waits on a command another run started: its deadline, and time to be
/// started again by a waiting run when the one that started it is cancelled.
const JOIN_WITHIN: Duration = Duration::from_secs(EVIDENCE_WITHIN.as_secs() + 5);

/// The read-only commands in flight, by host and command line. A run that asks for a command
/// a host is already running for another run (an alert storm: hundreds of incidents on one
/// host, each gathering the same `df -h`) waits for that run's answer instead of starting its
/// own, so the host is not sent a copy a run. A run on a later attempt joins only a command
/// begun since its diagnosis began (never one begun before its own fix), and nothing is kept
/// once it answers: the next ask runs it afresh. The answers of one executor only.
#[derive(Default)]
pub struct Flights {
    running: Mutex<HashMap<(String, String), Arc<Flight>>>,
}

impl Flights {
    /// This process's flights on `executor`, for a run that may join any command under way.
    pub fn any<'a>(&'a self, executor: &'a dyn Executor) -> Reads<'a> {
        Reads { flights: self, executor, since: None }
    }

    /// This process's flights on `executor`, for a run that may join only a command begun at
    /// `since` or later.
    pub fn since<'a>(&'a self, executor: &'a dyn Executor, since: Instant) -> Reads<'a> {
        Reads { flights: self, executor, since: Some(since) }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<(String, String), Arc<Flight>>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The commands in flight.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One run's way to run read-only commands on its executor, joining its process's flights:
/// see [`Flights`].
#[derive(Clone, Copy)]
pub struct Reads<'a> {
    flights: &'a Flights,
    executor: &'a dyn Executor,
    since: Option<Instant>,
}

impl Reads<'_> {
    /// Run `cmd` on `host`, or wait for its run under way (begun at `since` or later). When
    /// the run that started it is dropped (its message's handling cancelled), one of those
    /// waiting starts it anew.
    pub async fn run(&self, host: &str, cmd: &str) -> Read {
        let key = (host.to_string(), cmd.to_string());
        let (flight, joined) = {
            let mut running = self.flights.lock();
            let fresh = || Arc::new(Flight { began: Instant::now(), answer: Default::default() });
            match running.entry(key.clone()) {
                std::collections::hash_map::Entry::Occupied(mut e)
                    if self.since.is_some_and(|since| e.get().began < since) =>
                {
                    // Its seats keep it; it is no longer found.
                    e.insert(fresh());
                    (e.get().clone(), false)
                }
                std::collections::hash_map::Entry::Occupied(e) => (e.get().clone(), true),
                std::collections::hash_map::Entry::Vacant(e) => (e.insert(fresh()).clone(), false),
            }
        };
        if joined {
            JOINED.inc(&[]);
            let command = pitcrew_model::redact::redact(cmd);
            tracing::debug!(host, %command, "joined the same command under way for another run");
        }
        let seat = Seat { flights: self.flights, key, flight: Some(flight) };
        let flight = seat.flight.as_ref().expect("held until the seat is dropped");
        match tokio::time::timeout(JOIN_WITHIN, flight.answer.get_or_init(|| run_evidence(self.executor, host, cmd)))
            .await
        {
            Ok(read) => read.clone(),
            Err(_) => (false, format!("no answer within {} s", JOIN_WITHIN.as_secs())),
        }
    }
}

/// One run's place on a flight: its leaving takes the flight off the map once the command has
/// answered (later asks run it afresh) or when no one else is on it.
struct Seat<'a> {
    flights: &'a Flights,
    key: (String, String),
    flight: Option<Arc<Flight>>,
}

impl Drop for Seat<'_> {
    fn drop(&mut self) {
        let mut running = self.flights.lock();
        let Some(flight) = self.flight.take() else { return };
        let alone = Arc::strong_count(&flight) == 2; // the map's and this seat's
        if (flight.answer.initialized() || alone) && running.get(&self.key).is_some_and(|f| Arc::ptr_eq(f, &flight)) {
            running.remove(&self.key);
        }
        // Let go under the lock, so the next seat to leave counts the holders as they are.
        drop(flight);
    }
}

/// Read-only evidence for `attempt`: the check's result, the pidfile, the port's holder and,
/// at the same time, the service's evidence commands (log tail, journal, ports, disk,
/// memory), each admitted by the policy's read-only class first. Each item comes with the
/// timeline line that reports it, in that order. Everything runs on `reads`' executor; the
/// read-only commands (all but the check) join a run of the same command on the host.
pub async fn gather(spec: &ServiceSpec, attempt: u32, reads: Reads<'_>, policy: &Policy) -> Vec<(Evidence, String)> {
    // The check, the pidfile and the port depend on each other; the evidence commands
    // depend on nothing: both run at once (kept in this order).
    let chain = async {
        let mut found = Vec::new();
        let mut healthy = true;
        if let Some(check) = &spec.check {
            let out = run_check(check, &spec.host, reads.executor).await;
            healthy = out.healthy;
            let line = format!("check: {}", out.detail);
            found.push((
                Evidence { attempt, source: "check".into(), detail: out.detail, output: out.output, ok: out.healthy },
                line,
            ));
        }
        if let Some(pidfile) = &spec.pidfile {
            let cmd = format!("cat {}", shell_words::quote(pidfile));
            let (mut ok, output) = reads.run(&spec.host, &cmd).await;
            let pid = output.trim().to_string();
            let mut line = format!("pidfile {pidfile}: {}", if ok { pid.as_str() } else { "unreadable" });
            // A pid is only evidence if that process still runs: a stale pidfile must never hand
            // a playbook someone else's pid (`kill -9 {pid}`).
            if ok {
                let alive = !pid.is_empty()
                    && pid.chars().all(|c| c.is_ascii_digit())
                    && reads.run(&spec.host, &format!("ps -p {pid}")).await.0;
                if !alive {
                    ok = false;
                    line = format!("pidfile {pidfile}: {pid} is stale (no such process)");
                }
            }
            found.push((Evidence { attempt, source: "pidfile".into(), detail: cmd, output, ok }, line));
        }
        if let (false, Some(port)) = (healthy, spec.port()) {
            let service_pid = found.iter().find(|(e, _)| e.source == "pidfile" && e.ok).map(|(e, _)| e.output.trim());
            let service_pid = service_pid.map(str::to_string);
            found.push(port_holder(spec, port, service_pid.as_deref(), attempt, reads, policy).await);
        }
        found
    };
    // The evidence commands are independent of each other too: all at once.
    let commands = spec.evidence_commands().into_iter().map(|cmd| async move {
        let (ok, output, line) = match policy.read_only_on(&spec.host, &cmd) {
            Err(why) => (false, String::new(), format!("`{cmd}` not run: {why}")),
            Ok(()) => {
                let (ok, output) = reads.run(&spec.host, &cmd).await;
                let line = evidence_line(&format!("`{cmd}`"), ok, &output);
                (ok, output, line)
            }
        };
        (Evidence { attempt, source: "command".into(), detail: cmd, output, ok }, line)
    });
    let (mut found, commands) = futures::future::join(chain, futures::future::join_all(commands)).await;
    found.extend(commands);
    found
}

/// Who listens on the service's port while its check fails. With a pidfile configured, a
/// listener that is not the service's own process is a squatter: evidence `port-holder`
/// (ok), whose output starts `port <port> is held by pid <pid> (<program>), not by the service`
/// and gives playbooks `{holder_pid}`. Anything else is reported as `port` evidence.
async fn port_holder(
    spec: &ServiceSpec,
    port: u16,
    service_pid: Option<&str>,
    attempt: u32,
    reads: Reads<'_>,
    policy: &Policy,
) -> (Evidence, String) {
    let cmd = format!("ss -Hltnp sport = :{port}");
    let evidence = |source: &str, ok: bool, output: String| Evidence {
        attempt,
        source: source.into(),
        detail: cmd.clone(),
        output,
        ok,
    };
    if let Err(why) = policy.read_only_on(&spec.host, &cmd) {
        return (evidence("port", false, String::new()), format!("`{cmd}` not run: {why}"));
    }
    let (ok, output) = reads.run(&spec.host, &cmd).await;
    if !ok {
        let line = format!("port {port}: `{cmd}` failed: {}", output.lines().next().unwrap_or("(no output)"));
        return (evidence("port", false, output), line);
    }
    let listeners: Vec<&str> = output.lines().filter(|l| !l.trim().is_empty()).collect();
    if listeners.is_empty() {
        return (evidence("port", true, output.clone()), format!("port {port}: nothing listens"));
    }
    let Some(procs) = listeners.iter().map(|l| socket_users(l)).collect::<Option<Vec<_>>>() else {
        // A program's name is printed as it is: one with a quote in it could make a line read
        // as another pid's (`",pid=777` shows pid 777), which a playbook would then kill.
        let line = format!("port {port} is held by a process whose name `ss` cannot show unambiguously: no pid taken");
        return (evidence("port", true, output.clone()), line);
    };
    let procs: Vec<(String, String)> = procs.into_iter().flatten().collect();
    let Some((pid, program)) = procs.first().cloned() else {
        let line = format!("port {port} is held by a process this login cannot see (ss -p shows no pid)");
        return (evidence("port", true, output.clone()), line);
    };
    let ours = service_pid.is_some_and(|sp| procs.iter().any(|(p, _)| p == sp));
    if spec.pidfile.is_none() || ours {
        let whose = if ours { "the service's own process" } else { "a process (no pidfile to tell whose)" };
        let line = format!("port {port} is held by pid {pid} ({program}), {whose}");
        return (evidence("port", true, output.clone()), line);
    }
    let own = match service_pid {
        Some(sp) => format!("its pidfile names {sp}"),
        None => "its pidfile names no running process".to_string(),
    };
    let line = format!("port {port} is held by pid {pid} ({program}), not by the service ({own})");
    (evidence("port-holder", true, format!("{line}\n{output}")), line)
}

/// The (pid, program) pairs of one `ss -p` line: `users:(("nginx",pid=10,fd=6),...)`; none
/// when the line shows no users (another login's sockets). `ss` prints program names as they
/// are, and a process may name itself anything (`prctl(PR_SET_NAME)`): the users are read
/// strictly, each `("name",pid=N,fd=M)` with no quote in the name, or not at all (`None`), so a
/// name like `",pid=777` can never pass for a pid.
fn socket_users(line: &str) -> Option<Vec<(String, String)>> {
    let Some((_, mut rest)) = line.split_once("users:(") else { return Some(Vec::new()) };
    let digits = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let mut users = Vec::new();
    loop {
        let after = rest.strip_prefix("(\"")?;
        let (program, after) = after.split_once('"')?;
        let after = after.strip_prefix(",pid=")?;
        let (pid, after) = after.split_at(digits(after));
        let after = after.strip_prefix(",fd=")?;
        let (fd, after) = after.split_at(digits(after));
        let after = after.strip_prefix(')')?;
        if pid.is_empty() || fd.is_empty() {
            return None;
        }
        users.push((pid.to_string(), program.to_string()));
        match after.strip_prefix(',') {
            Some(next) => rest = next,
            None => return after.strip_prefix(')').filter(|end| end.trim().is_empty()).map(|_| users),
        }
    }
}

/// Tool calls one diagnosis may make.
const MAX_TOOL_CALLS: usize = 16;

/// The read-only tools a model may call while diagnosing: `run_command` on the service's host,
/// admitted by the policy's read-only class. Every call is kept (as `tool` evidence) for the
/// run state and the timeline.
pub struct EvidenceTools<'a> {
    host: &'a str,
    attempt: u32,
    reads: Reads<'a>,
    policy: &'a Policy,
    web: Option<&'a web::WebTools>,
    found: std::sync::Mutex<Vec<(Evidence, String)>>,
    /// Calls begun: a call takes its slot before it runs, so calls made at once (a model
    /// turn's calls run together) cannot all see an unspent budget.
    begun: std::sync::atomic::AtomicUsize,
}

impl<'a> EvidenceTools<'a> {
    /// The tools of a diagnosis of `attempt` on `host`: commands run by `reads`, joining the
    /// same ones under way.
    pub fn new(host: &'a str, attempt: u32, reads: Reads<'a>, policy: &'a Policy) -> Self {
        EvidenceTools { host, attempt, reads, policy, web: None, found: Default::default(), begun: Default::default() }
    }

    /// Also offer the configured HTTP tools.
    pub fn with_web(mut self, web: Option<&'a web::WebTools>) -> Self {
        self.web = web;
        self
    }

    /// Take a call's slot; the refusal once this diagnosis began all the tool calls it may.
    fn budget_spent(&self) -> Option<ToolOutput> {
        let calls = self.begun.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        (calls >= MAX_TOOL_CALLS).then(|| ToolOutput {
            ok: false,
            output: format!("tool budget spent ({MAX_TOOL_CALLS} calls): answer now"),
        })
    }

    async fn web_call(&self, web: &web::WebTools, name: &str, arguments: &str) -> ToolOutput {
        let args: serde_json::Value = match serde_json::from_str(arguments) {
            Ok(v) => v,
            Err(e) => return ToolOutput { ok: false, output: format!("arguments are not JSON: {e}") },
        };
        if let Some(spent) = self.budget_spent() {
            return spent;
        }
        let (asked, out) = web.call(name, &args).await;
        let output = pitcrew_model::redact::kept(&out.output, pitcrew_model::run::MAX_OUTPUT);
        let line = evidence_line(&format!("tool {name} {asked}"), out.ok, &output);
        self.keep(out.ok, &asked, output.clone(), line);
        ToolOutput { ok: out.ok, output }
    }

    /// Every call made so far, with its timeline line.
    pub fn take(&self) -> Vec<(Evidence, String)> {
        std::mem::take(&mut *self.found.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn keep(&self, ok: bool, command: &str, output: String, line: String) {
        let ev = Evidence { attempt: self.attempt, source: "tool".into(), detail: command.into(), output, ok };
        self.found.lock().unwrap_or_else(|p| p.into_inner()).push((ev, line));
    }

    async fn run_command(&self, arguments: &str) -> ToolOutput {
        let refuse = |output: String| ToolOutput { ok: false, output };
        let command = match serde_json::from_str::<serde_json::Value>(arguments) {
            Ok(v) => match v.get("command").and_then(|c| c.as_str()) {
                Some(c) if !c.trim().is_empty() => c.trim().to_string(),
                _ => return refuse("arguments must be {\"command\": \"...\"}".into()),
            },
            Err(e) => return refuse(format!("arguments are not JSON: {e}")),
        };
        if let Some(spent) = self.budget_spent() {
            return spent;
        }
        // The model's calls never run as another user: `sudo cat` reads any file, secrets
        // included, and hands them to the model. The host's lists apply as to any command.
        let checked = if pitcrew_policy::elevated(&command) {
            Err("a tool call never runs under sudo or doas".to_string())
        } else {
            self.policy.read_only_on(self.host, &command)
        };
        if let Err(why) = checked {
            self.keep(false, &command, String::new(), format!("tool `{command}` not run: {why}"));
            return refuse(format!("refused: {why}"));
        }
        let (ok, output) = self.reads.run(self.host, &command).await;
        let line = evidence_line(&format!("tool `{command}`"), ok, &output);
        self.keep(ok, &command, output.clone(), line);
        ToolOutput { ok, output }
    }
}

impl Tools for EvidenceTools<'_> {
    fn specs(&self) -> Vec<ToolSpec> {
        let mut specs = vec![ToolSpec {
            name: "run_command".into(),
            description: format!(
                "Run one read-only command on {} (the service's host) and return its output, e.g. \
                 `ss -ltnp`, `tail -n 100 /var/log/app.log`, `journalctl -u app -n 50 --no-pager`, \
                 `df -h`, `ps aux`, `cat /etc/app.conf`. Commands that change anything, shells, pipes \
                 and redirections are refused.",
                self.host
            ),
            parameters: serde_json::json!({
                "type": "object",
                "properties": { "command": { "type": "string", "description": "one command line" } },
                "required": ["command"],
            }),
        }];
        specs.extend(self.web.map(|w| w.specs()).unwrap_or_default());
        specs
    }

    fn call<'b>(&'b self, name: &'b str, arguments: &'b str) -> BoxFuture<'b, ToolOutput> {
        // The tool name is the model's: bounded before it becomes a span field.
        let span =
            tracing::info_span!("tool_call", tool = %pitcrew_model::trim::clip(name, 64), ok = tracing::field::Empty);
        let recorded = span.clone();
        Box::pin(tracing::Instrument::instrument(
            async move {
                let out = match name {
                    // Refused before anything reads them: kept, they would ride in the run's
                    // state and in every later prompt. A call's slot all the same: refusals
                    // kept past the budget would push out the evidence that was gathered.
                    _ if arguments.len() > MAX_TOOL_ARGUMENTS => match self.budget_spent() {
                        Some(spent) => spent,
                        None => {
                            let why = format!(
                                "arguments of {} bytes, more than the {MAX_TOOL_ARGUMENTS} a tool call may have",
                                arguments.len()
                            );
                            let asked = format!(
                                "{} {}",
                                pitcrew_model::trim::clip(name, 64),
                                pitcrew_model::trim::clip(arguments, 200)
                            );
                            self.keep(false, &asked, String::new(), format!("tool call not run: {why}"));
                            ToolOutput { ok: false, output: format!("refused: {why}") }
                        }
                    },
                    "run_command" => self.run_command(arguments).await,
                    other => match self.web.filter(|w| w.offers(other)) {
                        Some(w) => self.web_call(w, other, arguments).await,
                        None => {
                            let names: Vec<String> = self.specs().into_iter().map(|s| s.name).collect();
                            ToolOutput {
                                ok: false,
                                output: format!("unknown tool '{other}'; available: {}", names.join(", ")),
                            }
                        }
                    },
                };
                recorded.record("ok", out.ok);
                out
            },
            span,
        ))
    }
}

/// Largest arguments of one tool call, in bytes: a command the policy reads is at most 4096
/// (`MAX_COMMAND_LEN`), a query about as long.
const MAX_TOOL_ARGUMENTS: usize = 8192;

/// How long one evidence command may run.
const EVIDENCE_WITHIN: Duration = Duration::from_secs(10);

/// Run one evidence command: (succeeded, trimmed output or the error).
async fn run_evidence(executor: &dyn Executor, host: &str, cmd: &str) -> (bool, String) {
    evidence_of(executor.run(host, cmd, EVIDENCE_WITHIN).await)
}

/// What an evidence command's run says: (succeeded, trimmed output or the error).
fn evidence_of(ran: Result<pitcrew_exec::CommandOutput, pitcrew_exec::ExecError>) -> (bool, String) {
    let (ok, text) = match ran {
        Ok(o) if o.success() => (true, o.stdout),
        // Said as such: an empty output read as the command's answer would mislead the model.
        Ok(o) if o.timed_out => {
            (false, format!("timed out after {} s\n{}{}", EVIDENCE_WITHIN.as_secs(), o.stdout, o.stderr))
        }
        Ok(o) => (false, if o.stderr.is_empty() { o.stdout } else { o.stderr }),
        Err(e) => (false, e.to_string()),
    };
    // Redacted before it is evidence, a timeline line or a model's tool result.
    (ok, pitcrew_model::redact::kept(&text, pitcrew_model::run::MAX_OUTPUT))
}

/// The timeline line for one piece of evidence: what ran, whether it failed, and its first
/// line that looks like an error (else its first line).
fn evidence_line(what: &str, ok: bool, output: &str) -> String {
    let first = output.lines().find(|l| pitcrew_model::trim::looks_like_error(l)).or(output.lines().next());
    format!("{what}{}: {}", if ok { "" } else { " failed" }, first.unwrap_or("(no output)"))
}

/// Keep evidence in the run state and in the timeline (with its trimmed output).
fn record(cx: &mut Cx<'_>, state: &mut RunState, found: Vec<(Evidence, String)>) {
    for (evidence, line) in found {
        let data = serde_json::json!({
            "source": evidence.source,
            "command": evidence.detail,
            "ok": evidence.ok,
            "output": evidence.output,
        });
        cx.emit(EventKind::Evidence, line, data);
        state.push_evidence(evidence);
    }
}

impl StageHandler for Diagnose {
    fn stage(&self) -> Stage {
        Stage::Diagnose
    }

    fn handle<'a>(
        &'a self,
        state: &'a mut RunState,
        cx: &'a mut Cx<'_>,
    ) -> BoxFuture<'a, Result<Transition, StageError>> {
        Box::pin(async move {
            // On a later attempt, a command begun before now may have begun before this
            // run's own fix: not its evidence. The first attempt follows no fix of its own.
            let reads = match state.attempt {
                0 | 1 => self.flights.any(cx.deps.executor.as_ref()),
                _ => self.flights.since(cx.deps.executor.as_ref(), Instant::now()),
            };
            let cfg = cx.deps.config.clone();
            let spec = pitcrew_runtime::service_or_escalate!(&cfg, state);
            // A redelivery starts over from the input state: evidence of this attempt is regathered.
            state.evidence.retain(|e| e.attempt != state.attempt);
            // Episodic memory does not depend on the evidence: read it while the commands run.
            let (found, memory) = futures::future::join(
                gather(spec, state.attempt, reads, &cx.deps.policy),
                target::memory(cx.deps, state),
            )
            .await;
            let memory = memory?;
            record(cx, state, found);
            let reasoning = target::ReasonContext::with_memory(cx.deps, state, spec, memory);
            let failed = reasoning.failed.clone();
            let web = self.web.get_or_init(|| web::WebTools::from_config(&cfg)).as_ref();
            let tools = EvidenceTools::new(&spec.host, state.attempt, reads, &cx.deps.policy).with_web(web);
            let meter = pitcrew_llm::UsageMeter::default();
            let mut input = reasoning.input(state);
            input.tools = Some(&tools);
            input.usage = Some(&meter);
            cx.bound_model(&mut input);
            let thinking = cx.thinking();
            input.progress = thinking.as_ref().map(|t| t as &dyn pitcrew_llm::Progress);
            let answer = cx.deps.reasoner.diagnose(&input).await;
            if let Some(t) = thinking {
                t.finish().await;
            }
            target::record_usage(cx, state, Stage::Diagnose, &meter);
            // What the model looked at is evidence too, whatever it concluded.
            record(cx, state, tools.take());
            let diagnosis = match answer {
                Ok(d) => d,
                Err(ReasonError::Transient(e)) => return Err(StageError::Transient(e)),
                Err(e) => return Ok(Transition::Escalate(e.to_string())),
            };
            cx.emit(
                EventKind::Diagnosis,
                diagnosis.summary.clone(),
                serde_json::json!({ "source": diagnosis.source, "grounds": diagnosis.grounds, "known_failed": failed }),
            );
            state.diagnosis_log.retain(|d| d.attempt != state.attempt);
            state.diagnosis_log.push(diagnosis);
            state.plan = None;
            state.evaluation = None;
            Ok(Transition::To(Stage::Plan))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pitcrew_exec::LocalExecutor;
    use pitcrew_model::CheckSpec;

    #[test]
    fn an_evidence_command_that_timed_out_says_so() {
        let out = pitcrew_exec::CommandOutput {
            exit_code: None,
            stdout: String::new(),
            stderr: String::new(),
            timed_out: true,
            duration: EVIDENCE_WITHIN,
        };
        let (ok, text) = evidence_of(Ok(out));
        assert!(!ok);
        assert!(text.starts_with("timed out after 10 s"), "{text}");
        assert_eq!(evidence_line("`df -h`", ok, &text), "`df -h` failed: timed out after 10 s");
    }

    /// What `gather` finds with the local executor and the shipped policy, for a run alone.
    async fn gathered(spec: &ServiceSpec, attempt: u32) -> Vec<(Evidence, String)> {
        let exec = LocalExecutor::new(4096);
        gather(spec, attempt, Flights::default().any(&exec), &Policy::default_policy()).await
    }

    fn spec(dir: &std::path::Path) -> ServiceSpec {
        let mut s: ServiceSpec = serde_json::from_value(serde_json::json!({})).unwrap();
        s.check = Some(CheckSpec::Command {
            command: format!("test -f {}/up", dir.display()),
            running_indicator: None,
            timeout_ms: 2000,
        });
        s.pidfile = Some(format!("{}/pid", dir.display()));
        s.log_file = Some(format!("{}/app.log", dir.display()));
        s.evidence = Some(vec!["df -h".into(), "touch /tmp/never".into()]);
        s
    }

    #[tokio::test]
    async fn evidence_is_the_check_and_the_pid() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pid"), format!("{}\n", std::process::id())).unwrap();
        let mut log = String::new();
        for i in 0..200 {
            log.push_str(&format!("request {i} ok\n"));
        }
        log.push_str("ERROR: config invalid: listen address missing\n");
        std::fs::write(dir.path().join("app.log"), log).unwrap();
        let found = gathered(&spec(dir.path()), 3).await;
        assert_eq!(found.len(), 5);
        let (check, line) = &found[0];
        assert!(!check.ok && check.attempt == 3 && line.contains("exited 1"), "{check:?} {line}");
        let (pid, line) = &found[1];
        let me = std::process::id().to_string();
        assert!(pid.ok && pid.output.trim() == me && line.ends_with(&format!(": {me}")), "{pid:?} {line}");
        let (tail, line) = &found[2];
        assert!(tail.ok && tail.output.lines().count() == 50, "only the last lines: {tail:?}");
        assert!(line.contains("ERROR: config invalid"), "the line that looks like an error leads: {line}");
        let (df, _) = &found[3];
        assert!(df.ok && df.output.contains("Filesystem"), "{df:?}");
        let (refused, line) = &found[4];
        assert!(!refused.ok && line.contains("not run") && line.contains("read-only"), "{line}");
        assert!(!std::path::Path::new("/tmp/never").exists(), "a write is never run as evidence");
    }

    #[tokio::test]
    async fn a_stale_pid_is_not_evidence() {
        let dir = tempfile::tempdir().unwrap();
        // A pid far above any real one (pid_max is at most 2^22).
        std::fs::write(dir.path().join("pid"), "99999999\n").unwrap();
        let found = gathered(&spec(dir.path()), 1).await;
        let (pid, line) = &found[1];
        assert!(!pid.ok && line.contains("stale"), "{pid:?} {line}");
        std::fs::write(dir.path().join("pid"), format!("{}\n", std::process::id())).unwrap();
        let found = gathered(&spec(dir.path()), 1).await;
        assert!(found[1].0.ok, "a live pid is evidence: {:?}", found[1]);
    }

    #[tokio::test]
    async fn a_missing_pidfile_is_reported_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("up"), "").unwrap();
        let found = gathered(&spec(dir.path()), 1).await;
        assert!(found[0].0.ok, "the check passes");
        assert!(!found[1].0.ok && found[1].1.ends_with("unreadable"));
    }
}

#[cfg(test)]
mod port_tests {
    use super::*;
    use pitcrew_exec::LocalExecutor;
    use pitcrew_model::CheckSpec;

    #[test]
    fn ss_users_are_parsed() {
        let line = r#"LISTEN 0 128 0.0.0.0:80 0.0.0.0:* users:(("nginx",pid=10,fd=6),("nginx",pid=11,fd=6))"#;
        assert_eq!(socket_users(line), Some(vec![("10".into(), "nginx".into()), ("11".into(), "nginx".into())]));
        assert_eq!(socket_users("LISTEN 0 128 0.0.0.0:80 0.0.0.0:*"), Some(vec![]), "no users: another login's");
        let odd = r#"LISTEN 0 128 0.0.0.0:80 0.0.0.0:* users:(("my (app),1",pid=12,fd=3))   "#;
        assert_eq!(socket_users(odd), Some(vec![("12".into(), "my (app),1".into())]), "no quote: still plain");
    }

    #[test]
    fn a_program_named_to_look_like_another_pid_gives_no_pid() {
        // A process on pid 4242 named `",pid=777` (PR_SET_NAME), and the forms near it.
        for line in [
            r#"LISTEN 0 128 0.0.0.0:80 0.0.0.0:* users:(("",pid=777",pid=4242,fd=3))"#,
            r#"LISTEN 0 128 0.0.0.0:80 0.0.0.0:* users:(("sh",pid=7,fd=1)",pid=4242,fd=3))"#,
            r#"LISTEN 0 128 0.0.0.0:80 0.0.0.0:* users:(("a"),("b",pid=4242,fd=3))"#,
            r#"LISTEN 0 128 0.0.0.0:80 0.0.0.0:* users:(("nginx",pid=10,fd=6)) pid=777"#,
            r#"LISTEN 0 128 0.0.0.0:80 0.0.0.0:* users:(("nginx",pid=,fd=6))"#,
        ] {
            assert_eq!(socket_users(line), None, "{line}");
        }
    }

    /// What `gather` finds with the local executor and the shipped policy, for a run alone.
    async fn gathered(spec: &ServiceSpec) -> Vec<(Evidence, String)> {
        let exec = LocalExecutor::new(64 * 1024);
        gather(spec, 1, Flights::default().any(&exec), &Policy::default_policy()).await
    }

    /// A service checked over HTTP on `port` (nothing there answers it), its pidfile in `dir`
    /// naming no running process.
    fn on_port(dir: &std::path::Path, port: u16) -> ServiceSpec {
        let mut spec: ServiceSpec = serde_json::from_value(serde_json::json!({ "evidence": [] })).unwrap();
        spec.check = Some(CheckSpec::Http {
            url: format!("http://127.0.0.1:{port}/health"),
            expect_status: 200,
            timeout_ms: 300,
        });
        spec.pidfile = Some(dir.join("pid").display().to_string());
        std::fs::write(dir.join("pid"), "99999999\n").unwrap();
        spec
    }

    #[tokio::test]
    async fn a_foreign_listener_on_the_port_is_named_with_its_pid() {
        let dir = tempfile::tempdir().unwrap();
        // This test process holds the port and does not answer HTTP: the check fails.
        let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = squatter.local_addr().unwrap().port();
        let spec = on_port(dir.path(), port);
        let found = gathered(&spec).await;
        let (holder, line) = found.iter().find(|(e, _)| e.source.starts_with("port")).expect("port evidence");
        let me = std::process::id();
        assert_eq!(holder.source, "port-holder", "{holder:?} {line}");
        assert!(line.starts_with(&format!("port {port} is held by pid {me} (")), "{line}");
        assert!(line.contains("not by the service"), "{line}");

        // The service's own pid on its port is not a squatter.
        std::fs::write(dir.path().join("pid"), format!("{me}\n")).unwrap();
        let found = gathered(&spec).await;
        let (own, line) = found.iter().find(|(e, _)| e.source.starts_with("port")).unwrap();
        assert_eq!(own.source, "port", "{line}");
        assert!(line.contains("the service's own process"), "{line}");

        // Nothing listening: said so, no holder.
        drop(squatter);
        let found = gathered(&spec).await;
        let (none, line) = found.iter().find(|(e, _)| e.source.starts_with("port")).unwrap();
        assert!(none.source == "port" && line.ends_with("nothing listens"), "{line}");
    }

    /// A process may name itself to look like another pid in `ss -p` (here by the name it is
    /// started under: `",pid=<this test's pid>`): no pid is taken from it, so no playbook kills
    /// the process it names.
    #[tokio::test]
    async fn a_squatter_named_like_another_pid_hands_no_pid_to_a_playbook() {
        let dir = tempfile::tempdir().unwrap();
        let me = std::process::id();
        let disguised = dir.path().join(format!("\",pid={me}"));
        // The interpreter itself, not a launcher script (pyenv's shims pick by their name).
        let python = std::process::Command::new("python3")
            .args(["-c", "import os, sys; print(os.path.realpath(sys.executable))"])
            .output()
            .expect("python3 is on the machine");
        let python = String::from_utf8(python.stdout).unwrap().trim().to_string();
        std::os::unix::fs::symlink(&python, &disguised).unwrap();
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = probe.local_addr().unwrap().port();
        drop(probe);
        let listen = format!(
            "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); print('up', flush=True); time.sleep(60)"
        );
        let mut squatter = std::process::Command::new(&disguised)
            .args(["-c", &listen])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut up = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(squatter.stdout.take().unwrap()), &mut up).unwrap();
        assert_eq!(up.trim(), "up");
        let comm = std::fs::read_to_string(format!("/proc/{}/comm", squatter.id())).unwrap();
        assert_eq!(comm.trim(), format!("\",pid={me}"), "the squatter goes by the disguised name");

        let spec = on_port(dir.path(), port);
        let found = gathered(&spec).await;
        let _ = squatter.kill();
        let _ = squatter.wait();
        let (port_evidence, line) = found.iter().find(|(e, _)| e.source.starts_with("port")).expect("port evidence");
        assert_eq!(port_evidence.source, "port", "no holder taken: {line}");
        assert!(line.contains("cannot show unambiguously"), "{line}");
        assert!(!line.contains(&format!("held by pid {me}")), "{line}");
    }
}

#[cfg(test)]
mod web_tests {
    use super::*;
    use pitcrew_exec::LocalExecutor;
    use pitcrew_testkit::http::StubHttp;
    use serde_json::json;

    /// The model's calls never run as another user (`sudo cat` reads any secret on the host
    /// and hands it to the model), whatever the host's sudo list says.
    #[tokio::test]
    async fn a_tool_call_never_runs_under_sudo() {
        let (exec, policy, flights) = (LocalExecutor::new(4096), Policy::default_policy(), Flights::default());
        let tools = EvidenceTools::new("local", 1, flights.any(&exec), &policy);
        for cmd in ["sudo cat /etc/hostname", "env sudo -n cat /etc/hostname", "doas cat /etc/hostname"] {
            let out = tools.call("run_command", &json!({ "command": cmd }).to_string()).await;
            assert!(!out.ok && out.output.contains("never runs under sudo"), "{cmd}: {out:?}");
        }
        assert!(tools.call("run_command", r#"{"command": "cat /etc/hostname"}"#).await.ok);
    }

    /// Arguments past the bound are refused unread, and what is kept of them is bounded: the
    /// run's state and every later prompt carry it.
    #[tokio::test]
    async fn an_oversized_tool_call_is_refused_and_kept_short() {
        let (exec, policy, flights) = (LocalExecutor::new(4096), Policy::default_policy(), Flights::default());
        let tools = EvidenceTools::new("local", 1, flights.any(&exec), &policy);
        let huge = format!("cat /etc/hostname {}", "x".repeat(1 << 20));
        let out = tools.call("run_command", &json!({ "command": huge }).to_string()).await;
        assert!(!out.ok && out.output.contains("more than the 8192 a tool call may have"), "{}", out.output.len());
        let kept = tools.take();
        assert_eq!(kept.len(), 1);
        let (ev, line) = &kept[0];
        assert!(ev.detail.len() <= 300 && line.len() <= 300, "{} {}", ev.detail.len(), line.len());
        // Each takes a call's slot: past the budget nothing more is kept.
        for _ in 1..MAX_TOOL_CALLS {
            tools.call("run_command", &json!({ "command": huge }).to_string()).await;
        }
        let out = tools.call("run_command", &json!({ "command": huge }).to_string()).await;
        assert!(out.output.contains("tool budget spent"), "{}", out.output);
        assert_eq!(tools.take().len(), MAX_TOOL_CALLS - 1, "the refusals within the budget");
        // And any evidence's detail is bounded in the state.
        let mut state = RunState::new(uuid::Uuid::nil(), pitcrew_model::Incident::new("web", "down"));
        state.push_evidence(Evidence { detail: "y".repeat(1 << 20), ..ev.clone() });
        assert!(state.evidence[0].detail.len() <= pitcrew_model::run::MAX_DETAIL + "…".len());
    }

    /// A model turn's calls run together: all of them at once still get no more than the
    /// diagnosis' budget, the rest are refused without running.
    #[tokio::test]
    async fn calls_made_at_once_share_one_budget() {
        let (exec, policy, flights) = (LocalExecutor::new(4096), Policy::default_policy(), Flights::default());
        let tools = EvidenceTools::new("local", 1, flights.any(&exec), &policy);
        let outs =
            futures::future::join_all((0..40).map(|_| tools.call("run_command", r#"{"command": "uptime"}"#))).await;
        let ran = outs.iter().filter(|o| o.ok).count();
        let spent = outs.iter().filter(|o| o.output.contains("tool budget spent")).count();
        assert_eq!((ran, spent), (MAX_TOOL_CALLS, 40 - MAX_TOOL_CALLS), "{outs:?}");
        assert_eq!(tools.take().len(), MAX_TOOL_CALLS, "only the calls that ran are evidence");
    }

    #[tokio::test]
    async fn configured_http_tools_query_prometheus_loki_and_inventory_hosts_only() {
        let stub = StubHttp::start(vec![
            (
                "/api/v1/query",
                200,
                json!({"status": "success", "data": {"resultType": "vector", "result": [
                {"metric": {"__name__": "up", "job": "web"}, "value": [1700000000, "0"]}]}}),
            ),
            (
                "/api/v1/query_range",
                200,
                json!({"status": "success", "data": {"resultType": "matrix", "result": [
                {"metric": {"job": "web"}, "values": [[1, "0.5"], [2, "0.9"], [3, "0.7"]]}]}}),
            ),
            (
                "/loki/api/v1/query_range",
                200,
                json!({"status": "success", "data": {"resultType": "streams", "result": [
                {"stream": {"app": "web"}, "values": [["1700000000000000000", "ERROR out of memory"]]}]}}),
            ),
            ("/health", 503, json!({"ok": false})),
        ])
        .await
        .unwrap();
        let text = format!(
            "[reasoning.tools]\nhttp_probe = true\nprometheus_url = \"{u}\"\nloki_url = \"{u}/\"\n\
             [services.web]\nhost = \"local\"\ncheck = {{ kind = \"http\", url = \"{u}/health\" }}\n",
            u = stub.url
        );
        let cfg = pitcrew_runtime::Config::from_toml(&text).unwrap();
        let web = web::WebTools::from_config(&cfg).expect("tools configured");
        let (exec, policy, flights) = (LocalExecutor::new(4096), Policy::default_policy(), Flights::default());
        let tools = EvidenceTools::new("local", 1, flights.any(&exec), &policy).with_web(Some(&web));
        let names: Vec<String> = tools.specs().into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["run_command", "http_probe", "prometheus_query", "loki_query"]);

        let out = tools.call("prometheus_query", r#"{"query": "up{job=\"web\"} == 0"}"#).await;
        assert!(out.ok && out.output == "up{job=\"web\"} 0", "{out:?}");
        let out = tools.call("prometheus_query", r#"{"query": "rate(errors[5m])", "minutes": 30}"#).await;
        assert!(out.output.contains("min 0.5 max 0.9 last 0.7 (3 points)"), "{out:?}");
        let out = tools.call("loki_query", r#"{"query": "{app=\"web\"} |= \"ERROR\""}"#).await;
        assert!(out.ok && out.output.contains("ERROR out of memory"), "{out:?}");
        let out = tools.call("http_probe", &json!({ "url": format!("{}/health", stub.url) }).to_string()).await;
        assert!(!out.ok && out.output.starts_with("HTTP 503"), "{out:?}");
        let out = tools.call("http_probe", r#"{"url": "http://10.255.1.2/admin"}"#).await;
        assert!(!out.ok && out.output.contains("not a host of the inventory"), "{out:?}");
        // The check's host, on another port (a local admin API: Consul's, Docker's).
        let host = stub.url.trim_start_matches("http://").rsplit_once(':').map(|(h, _)| h.to_string()).unwrap();
        let out =
            tools.call("http_probe", &json!({ "url": format!("http://{host}:8500/v1/kv/?recurse") }).to_string()).await;
        assert!(!out.ok && out.output.contains("refused: port 8500 of"), "{out:?}");

        let seen = stub.requests();
        assert!(seen[0].starts_with("/api/v1/query?query=up%7Bjob%3D%22web%22%7D+%3D%3D+0&time="), "{seen:?}");
        assert!(seen[1].starts_with("/api/v1/query_range?query=rate") && seen[1].contains("&step=30"), "{seen:?}");
        assert!(
            seen[2].starts_with("/loki/api/v1/query_range?query=") && seen[2].contains("direction=backward"),
            "{seen:?}"
        );
        assert_eq!(seen.len(), 4, "the refused probe never left the process: {seen:?}");
        let kept = tools.take();
        assert_eq!(kept.len(), 6, "every call is evidence for the timeline");
        assert!(kept[0].1.starts_with("tool prometheus_query PromQL: up"), "{}", kept[0].1);
    }

    #[test]
    fn no_http_tool_unless_configured() {
        let cfg = pitcrew_runtime::Config::from_toml("").unwrap();
        assert!(web::WebTools::from_config(&cfg).is_none());
    }
}

#[cfg(test)]
mod flight_tests {
    use super::*;
    use pitcrew_exec::LocalExecutor;
    use std::future::Future;

    /// A command that answers after a while with a value no two runs share.
    const SLOW_UNIQUE: &str = "sh -c 'sleep 0.3; cat /proc/sys/kernel/random/uuid'";

    /// A waiter that hangs fails the test instead of hanging the suite.
    async fn within<T>(f: impl Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(20), f).await.expect("answered in time")
    }

    #[tokio::test]
    async fn the_same_command_asked_for_at_once_runs_once() {
        let (exec, flights) = (LocalExecutor::new(4096), Flights::default());
        let reads = flights.since(&exec, Instant::now());
        let ask = || reads.run("local", SLOW_UNIQUE);
        let joined = JOINED.get(&[]);
        let (a, b, c) = within(async { tokio::join!(ask(), ask(), ask()) }).await;
        assert!(a.0 && a.1.trim().len() == 36, "{a:?}");
        assert_eq!(a, b, "joined the run under way");
        assert_eq!(a, c, "joined the run under way");
        assert!(JOINED.get(&[]) >= joined + 2.0, "the two joins are counted");
        assert!(flights.is_empty(), "nothing kept once it answered");

        // Asked again once it answered: run afresh, never the earlier answer.
        let later = within(ask()).await;
        assert!(later.0 && later.1 != a.1, "{later:?} after {a:?}");
        // Another command, or another host, is another run.
        let other = format!("{SLOW_UNIQUE} x");
        let (d, e) = within(async { tokio::join!(ask(), reads.run("local", &other)) }).await;
        assert!(d.0 && e.0 && d.1 != e.1, "{d:?} {e:?}");
        let (f, g) = within(async { tokio::join!(ask(), reads.run("elsewhere", SLOW_UNIQUE)) }).await;
        assert!(f.0 && !g.0 && g.1.contains("elsewhere"), "{f:?} {g:?}");
        assert!(flights.is_empty());
    }

    /// A run on a later attempt, whose diagnosis began after a command did (after its own
    /// fix), starts its own; runs on a first attempt still join the first.
    #[tokio::test]
    async fn a_command_begun_before_a_run_s_handling_is_not_its_evidence() {
        let (exec, flights) = (LocalExecutor::new(4096), Flights::default());
        let early = flights.any(&exec);
        let mut first = Box::pin(early.run("local", SLOW_UNIQUE));
        assert!(futures::poll!(first.as_mut()).is_pending(), "the command runs");
        let late = flights.since(&exec, Instant::now() + Duration::from_millis(1));
        let (first, same_start, fresh, joins_fresh) = within(async {
            tokio::join!(
                first,
                early.run("local", SLOW_UNIQUE),
                late.run("local", SLOW_UNIQUE),
                early.run("local", SLOW_UNIQUE)
            )
        })
        .await;
        assert!(first.0 && fresh.0, "{first:?} {fresh:?}");
        assert_eq!(first, same_start, "a first attempt joins whatever runs");
        assert_ne!(first, fresh, "begun before the run's handling: not joined");
        assert_eq!(fresh, joins_fresh, "the later flight is the one found");
        assert!(flights.is_empty(), "neither kept");
    }

    #[tokio::test]
    async fn a_run_dropped_mid_command_leaves_those_waiting_an_answer() {
        let (exec, flights) = (LocalExecutor::new(4096), Flights::default());
        let reads = flights.since(&exec, Instant::now());
        let mut first = Box::pin(reads.run("local", SLOW_UNIQUE));
        assert!(futures::poll!(first.as_mut()).is_pending(), "the command runs");
        let second = reads.run("local", SLOW_UNIQUE);
        let third = async {
            // The second waits on the first's run by now (polled first); the first goes, and
            // a third asks: the second's new run, or its own that the second joins.
            drop(first);
            reads.run("local", SLOW_UNIQUE).await
        };
        let (second, third) = within(async { tokio::join!(second, third) }).await;
        assert!(second.0 && second.1.trim().len() == 36, "{second:?}");
        assert_eq!(second, third);
        assert!(flights.is_empty());

        // The only one on a run, dropped: the run is off the map, the next ask starts anew.
        let mut alone = Box::pin(reads.run("local", SLOW_UNIQUE));
        assert!(futures::poll!(alone.as_mut()).is_pending());
        assert_eq!(flights.len(), 1);
        drop(alone);
        assert!(flights.is_empty(), "no one waits on it");
    }

    /// The run that got the answer leaves first; one waiting on the same run has not yet
    /// been polled to read it. A run asking in between starts afresh: an answered command is
    /// never handed out again.
    #[tokio::test]
    async fn an_answered_command_is_not_joined_while_others_still_read_it() {
        let (exec, flights) = (LocalExecutor::new(4096), Flights::default());
        let reads = flights.since(&exec, Instant::now());
        let answered = std::cell::Cell::new(false);
        let first = async {
            let read = reads.run("local", SLOW_UNIQUE).await;
            answered.set(true);
            read
        };
        let between = async {
            while !answered.get() {
                tokio::task::yield_now().await;
            }
            reads.run("local", SLOW_UNIQUE).await
        };
        let waiting = reads.run("local", SLOW_UNIQUE);
        // Polled in this order each round: `between` asks in the round `first` ends, before
        // `waiting` is polled again.
        let (first, between, waiting) = within(async { tokio::join!(first, between, waiting) }).await;
        assert_eq!(first, waiting, "{first:?} {waiting:?}");
        assert!(between.0 && between.1 != first.1, "asked after the answer: its own run ({between:?})");
        assert!(flights.is_empty());
    }

    /// Two runs of services on one host gathering at once: the shared evidence command ran
    /// once, and both runs hold its answer as their own evidence; each ran its own check.
    #[tokio::test]
    async fn runs_on_one_host_share_an_evidence_command_under_way() {
        let dir = tempfile::tempdir().unwrap();
        let mut spec: ServiceSpec = serde_json::from_value(serde_json::json!({})).unwrap();
        spec.log_file = Some(format!("{}/app.log", dir.path().display()));
        std::fs::write(dir.path().join("app.log"), "started\n").unwrap();
        spec.evidence = Some(vec!["cat /proc/sys/kernel/random/uuid".into()]);
        spec.check = Some(pitcrew_model::CheckSpec::Command {
            command: "cat /proc/sys/kernel/random/uuid".into(),
            running_indicator: None,
            timeout_ms: 2000,
        });
        let (exec, policy, flights) = (LocalExecutor::new(4096), Policy::default_policy(), Flights::default());
        let reads = flights.since(&exec, Instant::now());
        let (a, b) =
            within(async { tokio::join!(gather(&spec, 1, reads, &policy), gather(&spec, 2, reads, &policy)) }).await;
        let uuid = |found: &[(Evidence, String)]| {
            let e = found.iter().find(|(e, _)| e.source == "command" && e.detail.contains("uuid"));
            let (e, _) = e.expect("the evidence command");
            assert!(e.ok, "{e:?}");
            e.output.clone()
        };
        assert_eq!(uuid(&a), uuid(&b), "one run of the command");
        let check = |found: &[(Evidence, String)]| {
            let (e, _) = &found[0];
            assert!(e.source == "check" && e.ok, "{e:?}");
            e.output.clone()
        };
        assert_ne!(check(&a), check(&b), "the check is each run's own");
        assert_eq!((a[0].0.attempt, b[0].0.attempt), (1, 2), "each run's own evidence");
        let again = within(gather(&spec, 1, reads, &policy)).await;
        assert_ne!(uuid(&again), uuid(&a), "gathered later: run afresh");

        // A model's tool call joins the same way; tools on other flights (another process's)
        // run their own.
        let elsewhere = Flights::default();
        let shared = EvidenceTools::new("local", 1, reads, &policy);
        let alone = EvidenceTools::new("local", 1, elsewhere.any(&exec), &policy);
        let args = serde_json::json!({ "command": "cat /proc/sys/kernel/random/uuid" }).to_string();
        let (x, y, z) = within(async {
            tokio::join!(
                shared.call("run_command", &args),
                shared.call("run_command", &args),
                alone.call("run_command", &args)
            )
        })
        .await;
        assert!(x.ok && x.output == y.output, "{x:?} {y:?}");
        assert!(z.ok && z.output != x.output, "without the flights, a run of its own: {z:?}");
        assert!(flights.is_empty());
    }
}
