//! The ssh executor: commands on inventory hosts over OpenSSH (the `openssh` crate, native
//! multiplexing). One master connection per host, reused by every command and stage,
//! re-established when it drops, and closed by itself after the host's idle time (so a
//! worker killed outright leaves no login behind on its hosts for good); host keys checked
//! against known_hosts (accepting an unknown key is a per-host opt-in); argv quoted so the
//! command policy approved is the command that runs; `sudo` always non-interactive; a
//! deadline enforced on the remote side; at most the host's `max_sessions` commands on it at
//! once (sshd refuses channels past its own `MaxSessions`), the rest waiting their turn.

use crate::local::read_capped;
use crate::{CommandOutput, ExecError};
use openssh::{ControlPersist, KnownHosts, Session, SessionBuilder, Stdio};
use pitcrew_model::HostSpec;
use std::collections::{BTreeMap, HashMap};
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Mutex, Semaphore};

/// Connection attempts before a host counts as unreachable.
const CONNECT_TRIES: u32 = 3;

/// Extra time past the remote deadline before we give up on the channel ourselves.
const LOCAL_GRACE: Duration = Duration::from_secs(5);

/// Commands over SSH to the hosts of the inventory.
pub struct SshExecutor {
    hosts: BTreeMap<String, HostSpec>,
    max_output: usize,
    /// One master connection per host; the per-host lock serialises (re)connecting.
    sessions: HashMap<String, Mutex<Option<Master>>>,
    /// Per host, a permit for each command it may run at once (its `max_sessions`).
    channels: HashMap<String, Semaphore>,
    /// Answers of `command -v` per (host, tool), for a while.
    tools: std::sync::Mutex<ToolAnswers>,
    /// Hosts found unreachable, with when to try them again (callers fail fast till then).
    down: std::sync::Mutex<HashMap<String, (Instant, String)>>,
}

/// How long the local master process may take to say its connection is up.
const CHECK_WITHIN: Duration = Duration::from_secs(5);

/// A host's master connection, shared by the commands on it. The last one to let go closes
/// it on a blocking thread: closing asks the master process to exit and waits for its answer
/// with no deadline, and the master being dropped is often one that stopped answering (the
/// runtime's few threads, and every other host's commands, would wait with it).
#[derive(Clone)]
pub struct Master(Arc<Closing>);

struct Closing {
    session: Option<Session>,
    /// When a command last let go of it (or it connected).
    used: std::sync::Mutex<Instant>,
}

impl Drop for Closing {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => drop(rt.spawn_blocking(move || drop(session))),
                Err(_) => drop(session),
            }
        }
    }
}

impl std::ops::Deref for Master {
    type Target = Session;

    fn deref(&self) -> &Session {
        self.0.session.as_ref().expect("a master holds its session until dropped")
    }
}

impl Master {
    fn new(session: Session) -> Self {
        Master(Arc::new(Closing { session: Some(session), used: std::sync::Mutex::new(Instant::now()) }))
    }

    fn same(&self, other: &Master) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// A command is done with it: its idle time starts again.
    fn used(&self) {
        *self.0.used.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// How long it has had no command on it; `None` while one holds it (the host's slot
    /// alone holds it otherwise).
    fn idle(&self) -> Option<Duration> {
        (Arc::strong_count(&self.0) == 1).then(|| self.0.used.lock().unwrap_or_else(|p| p.into_inner()).elapsed())
    }
}

/// Whether `master`, idle for `quiet`, is about to end by itself at the host's idle limit:
/// within the last quarter of it, at most 5 s. A new connection then, rather than a command
/// racing the master's exit for its channel.
fn expiring(quiet: Duration, limit: Duration) -> bool {
    quiet + (limit / 4).min(Duration::from_secs(5)) >= limit
}

/// How long an unreachable host is not tried again (its commands and checks fail at once
/// meanwhile): short of verify's window (ten checks 3 s apart by default), so a host down for
/// a moment, its sshd restarted by the fix, is seen back before verify gives up on it.
const DOWN_FOR: Duration = Duration::from_secs(10);

/// The remote `timeout`'s duration for `limit`: to the millisecond (a check's 1500 ms is not
/// cut to 1 s), whole seconds past a day (`timeout` reads any count of seconds; a "forever"
/// limit stays one), never 0 (which would mean no limit).
fn remote_limit(limit: Duration) -> String {
    if limit >= Duration::from_secs(86_400) || limit.subsec_millis() == 0 {
        format!("{}", limit.as_secs().max(1))
    } else {
        format!("{:.3}", limit.as_secs_f64())
    }
}

/// One word for the login shell on the host, read the same by sh, dash, bash, zsh and fish:
/// runs of ordinary characters in single quotes, and every `'` and `\` outside them, escaped
/// with a backslash. (Single quotes alone, as shell-escape writes them, are not read the same
/// everywhere: inside them fish takes `\'` as a quote, so `cat 'x\' ' ;reboot; #'`, one
/// argument to the policy, ran `reboot` under a fish login.)
pub fn quoted(word: &str) -> String {
    if !word.is_empty() && word.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-./:=@%+,".contains(&b)) {
        return word.to_string();
    }
    let mut out = String::with_capacity(word.len() + 2);
    let mut open = false;
    for c in word.chars() {
        if c == '\'' || c == '\\' {
            if open {
                out.push('\'');
                open = false;
            }
            out.push('\\');
            out.push(c);
        } else {
            if !open {
                out.push('\'');
                open = true;
            }
            out.push(c);
        }
    }
    if open {
        out.push('\'');
    }
    if out.is_empty() {
        out.push_str("''");
    }
    out
}

/// `sudo` never prompts: a missing sudo rule fails at once instead of hanging the worker.
/// However it is written (`/usr/bin/sudo`), and whatever the command's own `-n` is
/// (`sudo journalctl -n 50`): sudo's `-n` goes right after it unless already there (sudo
/// takes a repeated `-n`).
pub fn non_interactive_sudo(mut argv: Vec<String>) -> Vec<String> {
    let is_sudo = argv.first().is_some_and(|p| matches!(p.rsplit('/').next(), Some("sudo" | "sudo-rs" | "sudo.ws")));
    let has_n = argv.get(1).is_some_and(|a| a == "-n" || a == "--non-interactive");
    if is_sudo && !has_n {
        argv.insert(1, "-n".into());
    }
    argv
}

impl SshExecutor {
    pub fn new(hosts: BTreeMap<String, HostSpec>, max_output: usize) -> Self {
        let sessions = hosts.keys().map(|h| (h.clone(), Mutex::new(None))).collect();
        let channels = hosts.iter().map(|(h, spec)| (h.clone(), Semaphore::new(spec.max_sessions.max(1)))).collect();
        SshExecutor { hosts, max_output, sessions, channels, tools: Default::default(), down: Default::default() }
    }

    pub fn knows(&self, host: &str) -> bool {
        self.hosts.contains_key(host)
    }

    /// The live master connection to `host`, connecting (again) when there is none or it died.
    pub async fn session(&self, host: &str) -> Result<Master, ExecError> {
        let spec = self.hosts.get(host).ok_or_else(|| ExecError::UnknownHost(host.to_string()))?;
        let slot = self.sessions.get(host).ok_or_else(|| ExecError::UnknownHost(host.to_string()))?;
        if let Some((until, why)) = self.down.lock().expect("down map").get(host) {
            if Instant::now() < *until {
                return Err(ExecError::Unreachable(why.clone()));
            }
        }
        let mut slot = slot.lock().await;
        if let Some(s) = slot.as_ref() {
            match s.idle() {
                Some(quiet) if expiring(quiet, spec.master_idle()) => {
                    tracing::debug!(host, idle_secs = quiet.as_secs(), "ssh master connection idle: connecting anew");
                }
                // A question to the local master process: it answers at once unless it is wedged.
                _ => {
                    if let Ok(Ok(())) = tokio::time::timeout(CHECK_WITHIN, s.check()).await {
                        return Ok(s.clone());
                    }
                    tracing::warn!(host, "ssh master connection lost: reconnecting");
                }
            }
        }
        let mut b = SessionBuilder::default();
        b.user(spec.user.clone())
            .port(spec.port)
            .connect_timeout(spec.connect_timeout())
            .server_alive_interval(Duration::from_secs(15))
            // Not OpenSSH's "forever": a master outlives a worker killed outright, logged in
            // to the host until the host goes away.
            .control_persist(ControlPersist::IdleFor(
                std::num::NonZeroUsize::new(spec.master_idle().as_secs() as usize)
                    .unwrap_or(std::num::NonZeroUsize::MIN),
            ))
            .known_hosts_check(if spec.accept_unknown_host_key { KnownHosts::Add } else { KnownHosts::Strict });
        if let Some(dir) = control_dir() {
            b.control_directory(dir);
        }
        if let Some(k) = &spec.key_file {
            b.keyfile(k);
        }
        if let Some(k) = &spec.known_hosts {
            b.user_known_hosts_file(k);
        }
        // A few quick tries ride out a blip; a host that stays silent is unreachable.
        let mut tries = 0;
        let mut abandoned = AbandonedLaunchers { armed: true };
        let limit = connect_limit(spec);
        let session = loop {
            tries += 1;
            let Ok(connected) = tokio::time::timeout(limit, b.connect_mux(&spec.address)).await else {
                // Its `ConnectTimeout` bounds the TCP connect and the banner, not what follows:
                // a host that answers, then nothing, would hold this host's lock (every command
                // and check on it) until TCP gave up. Not a blip: no second try. Its launcher is
                // killed now (the connect is dropped already), not by the guard a moment later.
                kill_abandoned_launchers();
                abandoned.armed = false;
                let e = format!(
                    "cannot connect to {host} ({}:{}): no login within {} s (the host answered, then went silent)",
                    spec.address,
                    spec.port,
                    limit.as_secs()
                );
                self.down.lock().expect("down map").insert(host.to_string(), (Instant::now() + DOWN_FOR, e.clone()));
                return Err(ExecError::Unreachable(e));
            };
            match connected.map_err(|e| connect_error(host, spec, e)) {
                Ok(s) => break s,
                Err(ExecError::Transient(e)) if tries < CONNECT_TRIES => {
                    tracing::warn!(host, tries, error = %e, "ssh connect failed: retrying");
                    tokio::time::sleep(Duration::from_millis(500 * tries as u64)).await;
                }
                Err(ExecError::Transient(e)) => {
                    self.down
                        .lock()
                        .expect("down map")
                        .insert(host.to_string(), (Instant::now() + DOWN_FOR, e.clone()));
                    return Err(ExecError::Unreachable(e));
                }
                Err(e) => return Err(e),
            }
        };
        abandoned.armed = false;
        let session = Master::new(session);
        *slot = Some(session.clone());
        self.down.lock().expect("down map").remove(host);
        tracing::info!(host, address = %spec.address, port = spec.port, "ssh master connection up");
        Ok(session)
    }

    /// Drop `host`'s master connection if it is still `session`, so the next command connects
    /// anew (the connection closes once the commands still on it let go of it).
    async fn forget(&self, host: &str, session: &Master) {
        if let Some(slot) = self.sessions.get(host) {
            let mut slot = slot.lock().await;
            if slot.as_ref().is_some_and(|s| s.same(session)) {
                tracing::warn!(host, "ssh master connection stopped answering: dropped");
                *slot = None;
            }
        }
    }

    /// A turn to open a channel on `host`: held while the command runs.
    async fn channel(&self, host: &str) -> Result<tokio::sync::SemaphorePermit<'_>, ExecError> {
        let slots = self.channels.get(host).ok_or_else(|| ExecError::UnknownHost(host.to_string()))?;
        Ok(slots.acquire().await.expect("the channel semaphore is never closed"))
    }

    /// Run argv on `host` within `timeout`; `ready` is called once the command has a channel
    /// and a connection, just before it starts.
    pub async fn run_ssh(
        &self,
        host: &str,
        command: &str,
        timeout: Duration,
        ready: crate::BeforeStart<'_>,
    ) -> Result<CommandOutput, ExecError> {
        let argv = non_interactive_sudo(crate::secrets::argv_of(command)?);
        // Waiting for a channel is not the command's time: its deadline starts once it runs.
        let _channel = self.channel(host).await?;
        let session = self.session(host).await?;
        // A channel may take the host's connect timeout to open on the connection the master
        // holds. A host that keeps the TCP connection but answers nothing (hung, or cut off by
        // a partition) would otherwise hold the command until the keepalives give up on it
        // (`ServerAliveInterval` 15 s, three missed: 45 s).
        let open_within =
            self.hosts.get(host).ok_or_else(|| ExecError::UnknownHost(host.to_string()))?.connect_timeout();
        ready().await.map_err(ExecError::Transient)?;
        let started = Instant::now();
        // The remote `timeout` kills the command at the deadline even if our channel dies. The
        // command's words reach it on stdin, not in the argv of `timeout` or of the login
        // shell: `pgrep -f app` would find them there and always succeed (and `pkill -f app`
        // signal its own `timeout`). A nonce ends them, so a text cut short runs nothing.
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        let words: Vec<String> = argv.iter().map(|a| quoted(a)).collect();
        let text = format!("{}\n{nonce}", words.join(" "));
        let mut cmd = Session::to_command(session.clone(), "timeout");
        cmd.args(["-k", "2", &remote_limit(timeout)]).raw_args(["sh", "-c", &quoted(FROM_STDIN), "sh", &nonce]);
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = match tokio::time::timeout(open_within, cmd.spawn()).await {
            Ok(spawned) => spawned.map_err(|e| ExecError::Transient(format!("ssh to {host}: {e}")))?,
            Err(_) => {
                // The connection is up as far as the master knows, but the host answers
                // nothing: the next command connects anew rather than wait on it again.
                self.forget(host, &session).await;
                return Err(ExecError::Transient(format!(
                    "ssh to {host}: no channel opened within {} s (the host stopped answering): \
                     its connection is dropped",
                    open_within.as_secs()
                )));
            }
        };
        // The host's `timeout` counts from the channel's opening, up to `open_within` later.
        let opened = Instant::now();
        let (mut stdout, mut stderr) = (child.stdout().take(), child.stderr().take());
        let stdin = child.stdin().take();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let max = self.max_output;
        let feed = async move {
            use tokio::io::AsyncWriteExt;
            // A write that fails leaves the text without its nonce: the host runs nothing.
            if let Some(mut stdin) = stdin {
                if stdin.write_all(text.as_bytes()).await.is_ok() {
                    let _ = stdin.shutdown().await;
                }
            }
        };
        let run = async {
            let (_, _, _, status) = tokio::join!(
                feed,
                read_capped(&mut stdout, max, &mut out),
                read_capped(&mut stderr, max, &mut err),
                child.wait()
            );
            status
        };
        let ran = tokio::time::timeout(timeout.saturating_add(LOCAL_GRACE), run).await;
        // A channel that ended without an exit status before the deadline: the command ended
        // by a signal, or the connection was lost (the master killed reads the same) and the
        // command may still run on the host. The master tells them apart.
        let signalled = match &ran {
            Ok(Err(openssh::Error::RemoteProcessTerminated)) if started.elapsed() < timeout => {
                matches!(tokio::time::timeout(CHECK_WITHIN, session.check()).await, Ok(Ok(())))
            }
            _ => true,
        };
        let (exit_code, timed_out) = match ran {
            Err(_) => (None, true),
            // 124: `timeout` killed it at the deadline (137 when it needed SIGKILL). Before
            // the deadline they are the command's own codes (137: killed by the OOM killer).
            Ok(Ok(status)) => match status.code() {
                Some(124) | Some(137) if started.elapsed() >= timeout => (None, true),
                code => (code, false),
            },
            // Ended by a signal: at the deadline, `timeout`'s SIGKILL (it kills its whole
            // group, itself too, when the command ignored SIGTERM).
            Ok(Err(openssh::Error::RemoteProcessTerminated)) if signalled => (None, started.elapsed() >= timeout),
            // openssh reads exit status 127 as "command not found": it is the command's own
            // (or `timeout`'s, when it could not run the program: told apart below).
            Ok(Err(openssh::Error::Remote(e))) if e.kind() == std::io::ErrorKind::NotFound => (Some(127), false),
            Ok(Err(e)) => {
                // The command may have run, and may still run: the channel is gone, not the
                // host's `timeout`, which ends it by its deadline. Reported once that has surely
                // passed (what runs next, verify or another attempt, must not run beside it),
                // as failed: never as something to retry.
                let left = timeout.saturating_add(LOCAL_GRACE).saturating_sub(opened.elapsed());
                tokio::time::sleep(left).await;
                // Kept whole past a full stderr: it says why there is no exit code.
                crate::local::append_within(
                    &mut err,
                    max,
                    &format!(
                        "\npitcrew: ssh to {host} failed while running: {e} (reported once its deadline had passed: \
                         the host's `timeout` ends it by then)"
                    ),
                );
                (None, false)
            }
        };
        session.used();
        let stderr = pitcrew_model::trim::text_within(&err, self.max_output);
        if not_found(exit_code, &stderr) {
            return Err(ExecError::Spawn { program: argv[0].clone(), error: format!("not found on {host}") });
        }
        if exit_code == Some(CUT_SHORT) && stderr.starts_with(CUT_SHORT_SAID) {
            return Err(ExecError::Transient(format!("ssh to {host}: {}", stderr.trim_end())));
        }
        Ok(CommandOutput {
            exit_code,
            stdout: pitcrew_model::trim::text_within(&out, self.max_output),
            stderr,
            timed_out,
            duration: started.elapsed(),
        })
    }

    /// Whether `tool` exists on `host`: the inventory's word first, else `command -v` (cached);
    /// false when the host could not say.
    pub async fn has_tool_ssh(&self, host: &str, tool: &str) -> bool {
        self.tool_answer_ssh(host, tool).await.unwrap_or(false)
    }

    /// [`SshExecutor::has_tool_ssh`], or None when the host could not say (no connection, a
    /// probe that failed or ran past `TOOL_PROBE_LIMIT`).
    pub async fn tool_answer_ssh(&self, host: &str, tool: &str) -> Option<bool> {
        let Some(spec) = self.hosts.get(host) else { return Some(false) };
        let name = tool.rsplit('/').next().unwrap_or(tool);
        if spec.lacks.iter().any(|t| t == tool || t == name) {
            return Some(false);
        }
        if spec.tools.iter().any(|t| t == tool || t == name) {
            return Some(true);
        }
        let key = (host.to_string(), tool.to_string());
        if let Some(known) = self.tools.lock().expect("tool cache").get(&key, Instant::now()) {
            return Some(known);
        }
        let _channel = self.channel(host).await.ok()?;
        let session = self.session(host).await.ok()?;
        let probe = format!("command -v {}", shell_words::quote(tool));
        // A host that hangs must not hold the caller (diagnose, a plan's check) for good.
        let mut asked = Session::to_command(session.clone(), "sh");
        asked.raw_args(["-c", &quoted(&probe)]);
        let answer = tokio::time::timeout(TOOL_PROBE_LIMIT, asked.output()).await;
        session.used();
        let found = match answer {
            Ok(Ok(o)) => o.status.success(),
            // `command -v` of a program the shell cannot find exits 127, which openssh reads as
            // the remote command not found: the program is absent.
            Ok(Err(openssh::Error::Remote(e))) if e.kind() == std::io::ErrorKind::NotFound => false,
            // Not cached: the next look asks again.
            Ok(Err(_)) => return None,
            // The host answered nothing in time: the next look connects anew rather than wait on
            // this connection again.
            Err(_) => {
                self.forget(host, &session).await;
                return None;
            }
        };
        self.tools.lock().expect("tool cache").put(key, found, Instant::now());
        Some(found)
    }
}

/// How long a program `command -v` found on a host is taken as there without asking again.
const TOOL_FOUND_KEPT: Duration = Duration::from_secs(600);

/// How long a program `command -v` did not find is taken as absent: a fix may install it
/// (`apt-get install -y lsof`), and the plans after it should see it soon.
const TOOL_ABSENT_KEPT: Duration = Duration::from_secs(30);

/// Most answers kept: program names come from plans, which a model writes (a path per release,
/// `/opt/app/releases/<version>/bin/ctl`), and a worker lives for months.
const MAX_TOOL_ANSWERS: usize = 4096;

/// The answers of `command -v` per (host, program), each with when it was given.
#[derive(Default)]
struct ToolAnswers(HashMap<(String, String), (bool, Instant)>);

impl ToolAnswers {
    /// Whether an answer (`found`, given `at`) still holds at `now`.
    fn fresh(found: bool, at: Instant, now: Instant) -> bool {
        now.saturating_duration_since(at) < if found { TOOL_FOUND_KEPT } else { TOOL_ABSENT_KEPT }
    }

    /// The answer for `key` if it is recent enough at `now`.
    fn get(&self, key: &(String, String), now: Instant) -> Option<bool> {
        let (found, at) = *self.0.get(key)?;
        Self::fresh(found, at, now).then_some(found)
    }

    /// Keep an answer; when [`MAX_TOOL_ANSWERS`] are kept, those too old go first, then all.
    fn put(&mut self, key: (String, String), found: bool, now: Instant) {
        if self.0.len() >= MAX_TOOL_ANSWERS && !self.0.contains_key(&key) {
            self.0.retain(|_, (found, at)| Self::fresh(*found, *at, now));
            if self.0.len() >= MAX_TOOL_ANSWERS {
                self.0.clear();
            }
        }
        self.0.insert(key, (found, now));
    }
}

/// How long `has_tool` waits for a host to say whether it has a program.
const TOOL_PROBE_LIMIT: Duration = Duration::from_secs(10);

/// How long a control directory with no master answering in it is left alone: one being
/// made has its log file but not yet its socket while the master connects.
const STALE_AFTER: Duration = Duration::from_secs(600);

/// Where the masters' control sockets live: `pitcrew-ssh` in the user's state directory
/// (`$XDG_STATE_HOME`, else `~/.local/state`), made once per process, when what workers
/// killed outright left there is swept out. `None` (OpenSSH's default) when it cannot be made.
fn control_dir() -> Option<&'static std::path::Path> {
    static DIR: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
        let base = var("XDG_STATE_HOME").or_else(|| var("HOME").map(|home| home.join(".local/state")))?;
        let dir = base.join("pitcrew-ssh");
        use std::os::unix::fs::DirBuilderExt;
        if let Err(e) = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot make the ssh control directory: using OpenSSH's default");
            return None;
        }
        let swept = sweep(&dir, STALE_AFTER);
        if swept > 0 {
            tracing::info!(dir = %dir.display(), swept, "removed ssh control directories of masters that are gone");
        }
        Some(dir)
    })
    .as_deref()
}

/// Remove the control directories in `dir` whose master is gone (a worker killed outright
/// leaves its directory; its master ends after its idle time): no socket there that answers,
/// and nothing changed in it for `stale_after`. Returns how many went.
fn sweep(dir: &std::path::Path, stale_after: Duration) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut swept = 0;
    for entry in entries.flatten() {
        let path = entry.path();
        let ours = entry.file_name().to_string_lossy().starts_with(".ssh-connection");
        if !ours || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let quiet = entry.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
        let answers = std::os::unix::net::UnixStream::connect(path.join("master")).is_ok();
        if !answers && quiet.is_some_and(|q| q >= stale_after) && std::fs::remove_dir_all(&path).is_ok() {
            swept += 1;
        }
    }
    swept
}

/// How long connecting may take in all (TCP, banner, key exchange, login): twice the host's
/// connect timeout, and 5 s more.
fn connect_limit(spec: &HostSpec) -> Duration {
    spec.connect_timeout().saturating_mul(2) + Duration::from_secs(5)
}

/// Armed while a connect is under way: dropped armed (the caller gave up on it first, its own
/// deadline shorter than the login's bound; or the connect failed), it kills the launchers
/// left behind, from a thread of its own a moment later (once the crate, dropped too, has
/// removed the control directory that tells them apart).
struct AbandonedLaunchers {
    armed: bool,
}

impl Drop for AbandonedLaunchers {
    fn drop(&mut self) {
        if self.armed {
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(200));
                kill_abandoned_launchers();
            });
        }
    }
}

/// Kill this process's `ssh` launchers whose connect was given up on: the crate leaves the
/// launcher running when its future is dropped, but removes its control directory, which the
/// launcher's `-S` names. Without this, each would sit in its handshake until TCP gave up.
fn kill_abandoned_launchers() {
    let me = std::process::id();
    let Ok(procs) = std::fs::read_dir("/proc") else { return };
    for entry in procs.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // `pid (comm) state ppid ...`: comm may hold spaces and parentheses.
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid != Some(me) {
            continue;
        }
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let launcher = args.first().is_some_and(|a| a.ends_with(b"ssh")) && args.contains(&&b"-M"[..]);
        let socket = args.iter().position(|a| *a == b"-S").and_then(|i| args.get(i + 1));
        let gone = socket.is_some_and(|s| {
            std::path::Path::new(std::ffi::OsStr::from_bytes(s)).parent().is_some_and(|dir| !dir.exists())
        });
        if launcher && gone {
            // SAFETY: kill(2) on a pid just read, our own child; no memory is involved.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

fn connect_error(host: &str, spec: &HostSpec, e: openssh::Error) -> ExecError {
    let text = format!("{e}: {}", std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default());
    let lower = text.to_lowercase();
    if lower.contains("host key verification failed") || lower.contains("no matching host key") {
        let hint = if spec.accept_unknown_host_key {
            ""
        } else {
            " (add its key to known_hosts, or set accept_unknown_host_key = true for this host)"
        };
        return ExecError::Unreachable(format!("host key of {host} not trusted{hint}"));
    }
    // Nothing ran, and nothing will until a human mends the keys: the run escalates (it was
    // recorded as the command failing, which memory then barred for the service).
    if lower.contains("permission denied") {
        return ExecError::Unreachable(format!("login to {host} as {} refused", spec.user));
    }
    ExecError::Transient(format!("cannot connect to {host} ({}:{}): {text}", spec.address, spec.port))
}

/// Whether `timeout` could not start the program because it does not exist on the host: it
/// exits 127 then (126 when the program cannot be run), its message prefixed with its name.
/// The prefix is all that may arrive: coreutils writes it apart from the rest of the message,
/// and a remote command's last stderr has been seen cut after it (`timeout: `).
fn not_found(exit_code: Option<i32>, stderr: &str) -> bool {
    // `sh`'s own word when `exec` finds no program after all (a script whose interpreter is
    // missing): `sh: 1: exec: ./start: not found` (dash), `sh: line 1: exec: ...` (bash).
    let exec_failed = || {
        let first = stderr.lines().next().unwrap_or_default();
        first.starts_with("sh: ") && first.contains("exec: ") && first.ends_with("not found")
    };
    exit_code == Some(127) && (stderr.starts_with("timeout: ") || exec_failed())
}

/// What the host's `sh` runs under `timeout`: the command's words, read from stdin up to the
/// nonce (`$1`), each as one argument (as `quoted` wrote it), then `exec`: a program it cannot
/// find (a builtin alone is none) is said by `sh` in words `not_found` knows. Without the
/// nonce at the end (the text cut short) nothing runs.
const FROM_STDIN: &str = r#"c=$(cat); case $c in *"$1") ;; *) echo "pitcrew: the command did not arrive whole: nothing ran" >&2; exit 125;; esac; eval "set -- ${c%"$1"}"; exec "$@""#;

/// `FROM_STDIN`'s exit and first words when the text was cut short.
const CUT_SHORT: i32 = 125;
const CUT_SHORT_SAID: &str = "pitcrew: the command did not arrive whole";

#[cfg(test)]
mod tests {
    use super::*;

    /// A program found stays known for ten minutes, one not found for half a minute (a fix
    /// may install it); the answers kept are bounded however many programs plans name.
    #[test]
    fn tool_answers_expire_and_are_bounded() {
        let mut answers = ToolAnswers::default();
        let t0 = Instant::now();
        let key = |tool: &str| ("box".to_string(), tool.to_string());
        answers.put(key("lsof"), false, t0);
        answers.put(key("sh"), true, t0);
        assert_eq!(answers.get(&key("lsof"), t0 + Duration::from_secs(29)), Some(false));
        assert_eq!(answers.get(&key("lsof"), t0 + TOOL_ABSENT_KEPT), None, "asked again once installed");
        assert_eq!(answers.get(&key("sh"), t0 + Duration::from_secs(599)), Some(true));
        assert_eq!(answers.get(&key("sh"), t0 + TOOL_FOUND_KEPT), None);
        assert_eq!(answers.get(&key("ss"), t0), None);
        for n in 0..3 * MAX_TOOL_ANSWERS {
            answers.put(key(&format!("/opt/app/releases/{n}/bin/ctl")), false, t0 + Duration::from_millis(n as u64));
            assert!(answers.0.len() <= MAX_TOOL_ANSWERS, "{} answers kept", answers.0.len());
        }
    }

    /// What POSIX sh reads `quoted(word)` as: the same word, whatever it holds.
    #[test]
    fn a_quoted_word_is_read_back_whole_by_the_shell() {
        for word in [
            "plain",
            "",
            "a b",
            "x\\' ' ;reboot; #",
            "it's",
            "back\\slash",
            "\\",
            "'",
            "$(id) `id` $HOME * ? ~ ! & | ; < > ( ) { } [ ] # \" \n\t",
            "naïve ünïcode",
            "--opt=va l",
        ] {
            let q = quoted(word);
            // No backslash inside single quotes, where fish would read one.
            let mut inside = false;
            let mut escaped = false;
            for c in q.chars() {
                match c {
                    _ if escaped => escaped = false,
                    '\\' if !inside => escaped = true,
                    '\\' => panic!("a backslash inside quotes: {q}"),
                    '\'' => inside = !inside,
                    _ => {}
                }
            }
            let out = std::process::Command::new("sh").arg("-c").arg(format!("printf %s {q}")).output().unwrap();
            assert_eq!(String::from_utf8(out.stdout).unwrap(), word, "{q}");
        }
    }

    /// A control directory goes once its master is gone and nothing changed in it for a
    /// while; one whose master answers, or one being made, stays.
    #[test]
    fn only_control_directories_of_masters_that_are_gone_are_swept() {
        let dir = tempfile::tempdir().unwrap();
        let make = |name: &str| {
            let d = dir.path().join(name);
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("log"), "").unwrap();
            d
        };
        let gone = make(".ssh-connectionAAAA");
        let live = make(".ssh-connectionBBBB");
        let _master = std::os::unix::net::UnixListener::bind(live.join("master")).unwrap();
        let dead = make(".ssh-connectionCCCC");
        drop(std::os::unix::net::UnixListener::bind(dead.join("master")).unwrap());
        let other = make("not-a-control-dir");
        std::thread::sleep(Duration::from_millis(1100));
        let fresh = make(".ssh-connectionDDDD");
        assert_eq!(sweep(dir.path(), Duration::from_secs(1)), 2);
        assert!(!gone.exists() && !dead.exists(), "no master answers in them");
        assert!(live.exists(), "its master answers");
        assert!(fresh.exists(), "being made: its master may still be connecting");
        assert!(other.exists(), "not a control directory");
    }

    #[test]
    fn expiring_is_near_the_idle_limit() {
        let s = Duration::from_secs;
        assert!(!expiring(s(100), s(600)));
        assert!(!expiring(s(594), s(600)));
        assert!(expiring(s(595), s(600)), "5 s before a 10-minute limit");
        assert!(!expiring(Duration::from_millis(1400), s(2)));
        assert!(expiring(Duration::from_millis(1500), s(2)), "the last quarter of a short limit");
    }

    #[test]
    fn a_program_timeout_cannot_find_is_told_apart_from_one_that_exits_127() {
        let said = "timeout: failed to run command 'nope': No such file or directory\n";
        assert!(not_found(Some(127), said));
        assert!(not_found(Some(127), "timeout: "), "its message cut after the prefix");
        assert!(!not_found(Some(127), "sh: 1: nope: not found\n"), "the command's own 127");
        assert!(not_found(Some(127), "sh: 1: exec: nope: not found\n"), "dash's exec");
        assert!(not_found(Some(127), "sh: line 1: exec: nope: not found\n"), "bash's");
        assert!(!not_found(Some(1), "sh: 1: exec: nope: not found\n"));
        assert!(!not_found(Some(126), "timeout: failed to run command 'x': Permission denied\n"));
        assert!(!not_found(Some(0), ""));
    }

    /// What the host's `sh` makes of the text `run_ssh` sends it: every word whole, a text
    /// cut short nothing, a missing program told apart.
    #[test]
    fn the_words_sent_on_stdin_run_as_one_argv_and_only_whole() {
        use std::io::Write;
        let run = |text: &str, nonce: &str| {
            let mut child = std::process::Command::new("sh")
                .args(["-c", FROM_STDIN, "sh", nonce])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("sh");
            child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
            let out = child.wait_with_output().unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        };
        let words = ["printf", "%s|", "a b", "it's", "$(id) `id` $HOME * ;", "line\nnext", "--x=\\", "-"];
        let text = words.iter().map(|w| quoted(w)).collect::<Vec<_>>().join(" ");
        let (code, out, _) = run(&format!("{text}\nn0nce"), "n0nce");
        assert_eq!((code, out.as_str()), (Some(0), "a b|it's|$(id) `id` $HOME * ;|line\nnext|--x=\\|-|"));
        // Cut short: the nonce missing, or only part of it.
        for cut in [text.clone(), format!("{text}\nn0n")] {
            let (code, out, err) = run(&cut, "n0nce");
            assert_eq!((code, out.as_str()), (Some(CUT_SHORT), ""), "{err}");
            assert!(err.starts_with(CUT_SHORT_SAID), "{err}");
        }
        let (code, _, err) = run("no-such-program-zq9 x\nn0nce", "n0nce");
        assert!(not_found(code, &err), "{code:?} {err}");
        // A builtin is no program to run.
        let (code, _, err) = run("cd /\nn0nce", "n0nce");
        assert!(not_found(code, &err), "{code:?} {err}");
        // A script whose interpreter is missing.
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("start");
        std::fs::write(&script, "#!/no/such/interpreter\n").unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let (code, _, err) = run(&format!("{}\nn0nce", script.display()), "n0nce");
        assert!(not_found(code, &err), "{code:?} {err}");
        let (code, _, err) = run("sh -c 'exit 127'\nn0nce", "n0nce");
        assert!(code == Some(127) && !not_found(code, &err), "the command's own 127: {err}");
    }

    #[test]
    fn sudo_never_prompts() {
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            non_interactive_sudo(v(&["sudo", "systemctl", "restart", "x"])),
            v(&["sudo", "-n", "systemctl", "restart", "x"])
        );
        assert_eq!(non_interactive_sudo(v(&["sudo", "-n", "true"])), v(&["sudo", "-n", "true"]));
        assert_eq!(non_interactive_sudo(v(&["systemctl", "status"])), v(&["systemctl", "status"]));
        assert_eq!(
            non_interactive_sudo(v(&["sudo", "journalctl", "-n", "50"])),
            v(&["sudo", "-n", "journalctl", "-n", "50"]),
            "the command's own -n is not sudo's"
        );
        assert_eq!(non_interactive_sudo(v(&["/usr/bin/sudo", "true"])), v(&["/usr/bin/sudo", "-n", "true"]));
        assert_eq!(non_interactive_sudo(v(&["sudo-rs", "true"])), v(&["sudo-rs", "-n", "true"]));
        assert_eq!(
            non_interactive_sudo(v(&["sudo", "-u", "app", "-n", "x"])),
            v(&["sudo", "-n", "-u", "app", "-n", "x"])
        );
    }
}
