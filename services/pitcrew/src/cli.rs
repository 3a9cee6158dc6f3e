//! The operator commands: open an incident, watch a run, approve or deny, list runs, migrate.

use anyhow::{anyhow, bail};
use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use futures::StreamExt;
use pitcrew_model::trim::printable;
use pitcrew_model::{EventKind, Incident, RunEvent, Severity};
pub use pitcrew_runtime::approvals::{approval_request, submit, DecisionInput};
use pitcrew_runtime::{Bus, Config, Store};
use std::time::Duration;
use uuid::Uuid;

/// Build an incident from the command line.
pub fn incident(
    service: &str,
    error: &str,
    host: Option<String>,
    severity: Severity,
    fingerprint: Option<String>,
) -> anyhow::Result<Incident> {
    let mut i = Incident::new(service, error);
    i.host = host;
    i.severity = severity;
    i.fingerprint = fingerprint;
    i.source = Some("cli".into());
    i.validate()?;
    Ok(i)
}

/// What `pitcrew approve` says once its approval is published: under a quorum it is one vote,
/// and the plan runs only once enough distinct approvers have approved (`voters`: those
/// counted so far with this one; `None` when Postgres cannot say).
pub fn approved(req: &pitcrew_model::ApprovalRequest, by: &str, voters: Option<&[String]>) -> String {
    let (plan, run, quorum) = (printable(&req.plan_hash), req.run_id, req.quorum);
    let commands = printable(&req.plan.join(" ; ")).into_owned();
    if quorum <= 1 {
        return format!("approved plan {plan} of run {run}: {commands}");
    }
    match voters {
        Some(v) if v.len() as u32 >= quorum => {
            format!(
                "approved plan {plan} of run {run} ({quorum} of {quorum} approvers: {}): {commands}",
                printable(&v.join(", "))
            )
        }
        Some(v) => format!(
            "your approval of plan {plan} of run {run} is counted ({} of {quorum}, by {}): it runs once {quorum} \
             distinct approvers approve: {commands}",
            v.len(),
            printable(&v.join(", "))
        ),
        None => format!(
            "your approval of plan {plan} of run {run} is published as {}'s vote: it runs once {quorum} distinct \
             approvers approve (the votes so far are unknown: Postgres is unreachable): {commands}",
            printable(by)
        ),
    }
}

/// One event as a line for humans (its message, which may quote an alert, a host or a model,
/// made [`printable`]).
pub fn format_event(e: &RunEvent) -> String {
    format!("{} {:<9} {:<18} {}", e.at.format("%H:%M:%S%.3f"), e.stage.as_str(), e.kind.as_str(), printable(&e.message))
}

/// Print a run's events (past and live) until a terminal one; returns it.
pub async fn watch(bus: &Bus, store: Option<&Store>, run: Uuid, timeout: Duration) -> anyhow::Result<RunEvent> {
    let known = match store {
        Some(s) => s.incident_exists(run).await.unwrap_or(true),
        None => true,
    };
    // A finished run is told from Postgres, the system of record (events expire from the bus).
    if let Some(store) = store {
        let timeline = store.timeline(run).await.unwrap_or_default();
        if let Some(end) = timeline.iter().find(|e| e.kind.is_terminal()).cloned() {
            for e in &timeline {
                println!("{}", format_event(e));
            }
            return Ok(end);
        }
    }
    let stream = bus.js.get_stream(bus.subjects.events_stream()).await?;
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject: bus.subjects.events_of(run),
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let first_wait = if known { timeout } else { Duration::from_secs(5) };
    let deadline = tokio::time::Instant::now() + timeout;
    let mut seen = false;
    loop {
        let wait = if seen { deadline } else { tokio::time::Instant::now() + first_wait };
        let msg = match tokio::time::timeout_at(wait.min(deadline), messages.next()).await {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(e))) => return Err(anyhow!("event stream failed: {e}")),
            Ok(None) => bail!("event stream closed"),
            Err(_) if !seen && !known => {
                bail!(
                    "unknown run {run}: no incident with this id, and no event of it in 5 s (`pitcrew incidents` \
                     lists runs; an incident just sent may still wait for intake: watch it again)"
                )
            }
            Err(_) => bail!("run {run} did not finish within {} s", timeout.as_secs()),
        };
        seen = true;
        let Ok(event) = serde_json::from_slice::<RunEvent>(&msg.payload) else { continue };
        println!("{}", format_event(&event));
        if event.kind.is_terminal() {
            return Ok(event);
        }
    }
}

/// `pitcrew incidents`: recent runs from Postgres.
pub async fn incidents(store: &Store, limit: i64) -> anyhow::Result<()> {
    let runs = store.recent_runs(limit).await?;
    if runs.is_empty() {
        println!("no runs yet");
        return Ok(());
    }
    println!(
        "{:<36}  {:<19}  {:<12}  {:<16}  {:>3}  {:<9}  reason / error",
        "run", "started", "service", "status", "try", "stage"
    );
    for r in runs {
        println!(
            "{}  {}  {:<12}  {:<16}  {:>3}  {:<9}  {}",
            r.id,
            r.created_at.format("%Y-%m-%d %H:%M:%S"),
            printable(&pitcrew_model::trim::clip(&r.service, 12)),
            r.status,
            r.attempt,
            r.stage,
            printable(&pitcrew_model::trim::clip(r.reason.as_deref().unwrap_or(&r.error), 80))
        );
    }
    Ok(())
}

/// `pitcrew approvals`: pending approvals, oldest first, with their age, rule and plan.
pub async fn approvals(store: &Store, limit: i64) -> anyhow::Result<()> {
    let pending = store.pending_approvals(false, limit).await?;
    if pending.is_empty() {
        println!("no pending approvals");
        return Ok(());
    }
    let now = chrono::Utc::now();
    // The plan's hash and the attempt are what `approve --plan --attempt` binds a decision to:
    // without them, it goes to whatever the run waits on when it arrives (a later plan too).
    println!(
        "{:<36}  {:>7}  {:<16}  {:>8}  {:>10}  {:<20}  commands",
        "run", "attempt", "plan", "age", "expires in", "flagged by rule"
    );
    for p in pending {
        let age = (now - p.requested_at).num_seconds().max(0);
        let left = (p.expires_at - now).num_seconds();
        println!(
            "{}  {:>7}  {:<16}  {:>8}  {:>10}  {:<20}  {}",
            p.run_id,
            p.attempt,
            printable(&p.plan_hash),
            human_secs(age),
            if left > 0 { human_secs(left) } else { "expired".into() },
            // The stored rule reads `<name>: <why>`; the name fits the table.
            printable(&pitcrew_model::trim::clip(p.rule.split(':').next().unwrap_or(&p.rule), 20)),
            printable(&pitcrew_model::trim::clip(&p.commands.join(" ; "), 100))
        );
    }
    Ok(())
}

fn human_secs(s: i64) -> String {
    match s {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s => format!("{}h", s / 3600),
    }
}

/// `pitcrew show <run>`: the run's incident, diagnosis, plan, policy decisions, approval
/// trail, executions and outcome, from Postgres.
pub async fn show(store: &Store, run: Uuid) -> anyhow::Result<()> {
    let Some(stored) = store.load_run(run).await? else {
        bail!("unknown run {run}: no run with this id (`pitcrew incidents` lists runs)");
    };
    let s = &stored.state;
    println!("run {run}: {} at stage {} (attempt {})", stored.status.as_str(), s.step.as_str(), s.attempt);
    // Whatever came from an alert, a host, a model or a decider is printed through `printable`.
    println!(
        "incident: {} on {}: {}",
        printable(&s.incident.service),
        printable(s.incident.host.as_deref().unwrap_or("-")),
        printable(&s.incident.error)
    );
    if let Some(r) = &stored.reason {
        println!("outcome: {}", printable(r));
    }
    for d in &s.diagnosis_log {
        println!("diagnosis (attempt {}, {}): {}", d.attempt, d.source, printable(&d.summary));
    }
    if let Some(p) = &s.plan {
        println!("plan (attempt {}, {}, hash {}):", p.attempt, p.source, p.hash());
        for c in &p.commands {
            println!("  {}", printable(c));
        }
    }
    let timeline = store.timeline(run).await?;
    let decisions: Vec<&RunEvent> = timeline
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Policy | EventKind::Evaluation | EventKind::ApprovalRequested))
        .collect();
    if !decisions.is_empty() {
        println!("policy and evaluation:");
        for e in decisions {
            println!("  {}", format_event(e));
        }
    }
    let approvals = store.approvals_of(run).await?;
    if !approvals.is_empty() {
        println!("approval trail:");
        for a in approvals {
            println!(
                "  {} requested for plan {} (rule {}): {}",
                a.requested_at.format("%Y-%m-%d %H:%M:%S"),
                printable(&a.plan_hash),
                printable(&a.rule),
                printable(&a.commands.join(" ; "))
            );
            match (&a.decision, &a.by) {
                (Some(d), Some(by)) => println!(
                    "  {} {} by {} via {}{}",
                    a.decided_at.map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string()).unwrap_or_default(),
                    printable(d),
                    printable(by),
                    printable(a.channel.as_deref().unwrap_or("-")),
                    a.reason.as_deref().map(|r| format!(": {}", printable(r))).unwrap_or_default()
                ),
                _ => println!("  (undecided)"),
            }
        }
    }
    let ran = store.executions(run).await?;
    if !ran.is_empty() {
        println!("executions:");
        for (command, host, status) in ran {
            let status = if status.is_empty() { "running".into() } else { printable(&status) };
            println!("  {}  {status:<11}  {}", printable(&host), printable(&command));
        }
    }
    let released = store.released_claims(run).await?;
    if !released.is_empty() {
        println!("claims released, nothing run under them:");
        for r in released {
            println!(
                "  attempt {} command {}  {}  {}: {}",
                r.attempt,
                r.index,
                printable(&r.host),
                printable(&r.command),
                printable(&r.why)
            );
        }
    }
    Ok(())
}

/// A watched run that ended without being resolved: its outcome, as `pitcrew watch`'s exit
/// status (scripts and CI jobs that open an incident and wait for it can tell).
#[derive(Debug)]
pub struct Unresolved(pub EventKind);

impl Unresolved {
    /// 3: escalated (a human must act); 4: not remediated by this run (a duplicate of an open
    /// run, or refused at intake).
    pub fn exit_code(&self) -> u8 {
        if self.0 == EventKind::Escalated {
            3
        } else {
            4
        }
    }
}

impl std::fmt::Display for Unresolved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the run ended {}", kind_outcome(self.0))
    }
}

impl std::error::Error for Unresolved {}

/// Print a watched run's outcome; an error (`Unresolved`) unless it resolved.
pub fn ended(end: &RunEvent) -> anyhow::Result<()> {
    println!("outcome: {}", outcome_of(end));
    if end.kind == EventKind::Resolved {
        Ok(())
    } else {
        Err(Unresolved(end.kind).into())
    }
}

/// Outcome word of a terminal event.
pub fn outcome_of(e: &RunEvent) -> &'static str {
    kind_outcome(e.kind)
}

fn kind_outcome(kind: EventKind) -> &'static str {
    match kind {
        EventKind::Resolved => "resolved",
        EventKind::Escalated => "escalated",
        EventKind::Duplicate => "duplicate",
        EventKind::Rejected => "rejected",
        _ => "unknown",
    }
}

/// Close an open or parked run by hand, as escalated by `by` for `reason`: a run nothing moves
/// any more (its message lost, its stage's upgrade rolled back) holds its fingerprint, and
/// every incident with it would be folded into it. Its requests for approval are denied, its
/// target freed (a holder lets go once its run is closed), and a step still under way finds
/// it closed and does nothing more. Refused while one of its commands may still be running:
/// its target freed, another run could remediate the service beside it. The escalated event
/// goes to Postgres and the bus, as any run's end.
pub async fn abandon(
    bus: &Bus,
    store: &Store,
    cfg: &Config,
    run: Uuid,
    by: &str,
    reason: &str,
) -> anyhow::Result<RunEvent> {
    use pitcrew_runtime::store::RunStatus;
    let reason = pitcrew_model::redact::redact(reason.trim()).into_owned();
    if reason.is_empty() {
        bail!("say why: --reason is empty");
    }
    let Some(stored) = store.load_run(run).await? else { bail!("no run {run}") };
    if !matches!(stored.status, RunStatus::Open | RunStatus::WaitingApproval) {
        bail!("run {run} is {} already", stored.status.as_str());
    }
    refuse_while_running(store, run).await?;
    let mut state = stored.state;
    let was = (state.step, state.seq);
    let why = format!("closed by {by}: {reason}");
    state.escalate(why.clone());
    let event = RunEvent {
        run_id: run,
        seq: state.seq,
        index: 0,
        stage: pitcrew_model::Stage::Escalate,
        kind: EventKind::Escalated,
        message: format!("escalated {}: {why}", state.incident.service),
        data: state.escalated_data(&why),
        worker: cfg.worker(),
        at: chrono::Utc::now(),
    };
    if !store.close_run(was, &state, &event, by).await? {
        // A command claimed or started since the look above: the close refused it too.
        refuse_while_running(store, run).await?;
        bail!("run {run} moved on from {} (seq {}) while it was being closed: look again", was.0, was.1);
    }
    pitcrew_runtime::runner::publish_events(bus, std::slice::from_ref(&event)).await.map_err(|e| {
        anyhow!(
            "run {run} is closed (escalated in Postgres: {}), but its end could not be published: {e}; \
             `pitcrew watch` and the chat bridges will not hear of it",
            printable(&why)
        )
    })?;
    Ok(event)
}

/// Refuse to close `run` while one of its commands may still be running.
async fn refuse_while_running(store: &Store, run: Uuid) -> anyhow::Result<()> {
    if let Some((command, host, until)) = store.running_execution(run).await? {
        bail!(
            "run {run} may still be running `{}` on {} (until {} at the latest): closing it now would free its target \
             for another run while the command runs; abandon it once that command has ended",
            printable(&command),
            printable(&host),
            until.format("%Y-%m-%d %H:%M:%S UTC")
        );
    }
    Ok(())
}

/// Prune what is older than `days`, batch after batch, a line for each, until nothing is left.
pub async fn prune(store: &Store, days: u32, batch: i64) -> anyhow::Result<()> {
    let before = chrono::Utc::now() - chrono::Duration::days(i64::from(days));
    let mut total = pitcrew_runtime::store::Pruned::default();
    loop {
        let pruned = store.prune(before, batch).await.map_err(|e| {
            anyhow!(
                "pruning stopped after {} runs, {} incidents without a run and {} audit lines: {e} (run it again; \
                 a smaller --batch if a batch took too long)",
                total.runs,
                total.incidents,
                total.audit
            )
        })?;
        if pruned.is_empty() {
            break;
        }
        total.runs += pruned.runs;
        total.incidents += pruned.incidents;
        total.audit += pruned.audit;
        eprintln!(
            "pruned {} runs, {} incidents without a run, {} audit lines ({} / {} / {} so far)",
            pruned.runs, pruned.incidents, pruned.audit, total.runs, total.incidents, total.audit
        );
    }
    println!(
        "pruned before {}: {} closed runs, {} incidents without a run, {} gateway audit lines",
        before.format("%Y-%m-%d %H:%M:%S UTC"),
        total.runs,
        total.incidents,
        total.audit
    );
    Ok(())
}

/// Connect to Postgres for a read-only command.
pub async fn store(cfg: &Config) -> anyhow::Result<Store> {
    Ok(Store::connect_existing(&cfg.database).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_approval_under_a_quorum_says_it_is_one_vote_until_the_quorum_is_met() {
        let mut req = pitcrew_model::ApprovalRequest {
            run_id: Uuid::nil(),
            service: "svc".into(),
            host: None,
            error: "down".into(),
            attempt: 1,
            plan: vec!["rm -f /run/svc.lock".into()],
            plan_hash: "ab12".into(),
            risk: "critical".into(),
            rule: "two-person-rm".into(),
            diagnosis: String::new(),
            evidence: Vec::new(),
            requested_at: chrono::Utc::now(),
            expires_at: chrono::Utc::now(),
            quorum: 1,
        };
        let run = Uuid::nil();
        assert_eq!(approved(&req, "ann", None), format!("approved plan ab12 of run {run}: rm -f /run/svc.lock"));
        req.quorum = 2;
        let one = approved(&req, "ann", Some(&["ann".to_string()]));
        assert!(
            one.starts_with(&format!("your approval of plan ab12 of run {run} is counted (1 of 2, by ann)")),
            "{one}"
        );
        assert!(!one.contains("approved plan"), "{one}");
        let both = approved(&req, "bob", Some(&["ann".to_string(), "bob".to_string()]));
        assert!(both.starts_with(&format!("approved plan ab12 of run {run} (2 of 2 approvers: ann, bob)")), "{both}");
        let unknown = approved(&req, "ann", None);
        assert!(unknown.contains("published as ann's vote: it runs once 2 distinct approvers approve"), "{unknown}");
    }
}
