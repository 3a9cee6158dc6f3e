//! The local executor: runs argv commands on this machine in their own process group, with
//! capped output and a deadline after which the whole group is killed.

use crate::{CommandOutput, ExecError, Executor};
use futures::future::BoxFuture;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::time::Instant;

/// Host names that mean "this machine".
const LOCAL_HOSTS: [&str; 3] = ["local", "localhost", "127.0.0.1"];

/// After the command exits, how long we keep reading pipes that something it left behind
/// (a backgrounded child) still holds open before the command's output is taken as complete.
/// We do not wait for, or kill, such processes: a start script may legitimately leave a
/// daemon running. Their pipes are then read on, and discarded ([`linger`]).
const PIPE_GRACE: Duration = Duration::from_secs(1);

/// Outputs of commands still held open by what they left running, read on at once ([`linger`]);
/// past it, a new one is closed (its holder gets SIGPIPE on its next write).
pub const MAX_LINGERING: usize = 256;
static LINGERING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// After killing the group at the deadline, how long we wait for the leader to be reaped and
/// for the last buffered output. SIGKILL cannot be ignored, so this is only a safety net.
const KILL_GRACE: Duration = Duration::from_secs(2);

/// Used when `now + timeout` does not fit in an `Instant` (a "forever" timeout).
const FAR_FUTURE: Duration = Duration::from_secs(365 * 24 * 3600);

/// The variables of pitcrew's environment every command inherits: where programs are, who
/// and where the user is, the locale and time zone, and where TLS trust and proxies are (a
/// `curl` health check needs them as much as the shell would). pitcrew's own environment holds
/// its secrets (`OPENAI_API_KEY`, `SLACK_BOT_TOKEN`, the database URL): a command's output is
/// evidence, a timeline line and a model's input, and `env` or `cat /proc/self/environ` would
/// hand them on. More are passed by name with `[exec] pass_env`.
pub const INHERITED: [&str; 18] = [
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "TZ",
    "TMPDIR",
    "XDG_RUNTIME_DIR",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "CURL_CA_BUNDLE",
    "REQUESTS_CA_BUNDLE",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
];

/// Runs commands on the machine pitcrew itself runs on.
#[derive(Debug, Clone)]
pub struct LocalExecutor {
    /// Bytes kept from each of stdout and stderr; the rest is read and discarded so the
    /// child never blocks on a full pipe.
    pub max_output: usize,
    /// Variables passed on besides [`INHERITED`] and the locale's `LC_*` (`[exec] pass_env`).
    pass_env: Vec<String>,
    /// The process that ends the commands at their deadlines if this one dies
    /// ([`crate::watchdog`]).
    watchdog: Option<std::sync::Arc<crate::watchdog::Watchdog>>,
}

impl LocalExecutor {
    /// Commands are watched by this process's watchdog once [`crate::watchdog::use_own`] has
    /// set it up (a `pitcrew` process does).
    pub fn new(max_output: usize) -> Self {
        Self { max_output, pass_env: Vec::new(), watchdog: crate::watchdog::own() }
    }

    /// Tell `watchdog` of every command (None: no watchdog).
    pub fn with_watchdog(mut self, watchdog: Option<std::sync::Arc<crate::watchdog::Watchdog>>) -> Self {
        self.watchdog = watchdog;
        self
    }

    /// Also pass these variables of pitcrew's environment on to every command.
    pub fn passing(mut self, vars: &[String]) -> Self {
        self.pass_env = vars.to_vec();
        self
    }

    /// The environment a command runs with: the inherited variables, the locale's `LC_*` and
    /// those passed by name; nothing else.
    fn env(&self) -> impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)> + '_ {
        std::env::vars_os().filter(|(k, _)| {
            k.to_str()
                .is_some_and(|k| INHERITED.contains(&k) || k.starts_with("LC_") || self.pass_env.iter().any(|p| p == k))
        })
    }

    async fn run_local(&self, host: &str, command: &str, timeout: Duration) -> Result<CommandOutput, ExecError> {
        if !is_local(host) {
            return Err(ExecError::UnknownHost(host.to_string()));
        }
        let argv = crate::secrets::argv_of(command)?;
        let (program, args) = argv.split_first().ok_or(ExecError::Empty)?;

        let started = Instant::now();
        let deadline = started.checked_add(timeout).unwrap_or(started + FAR_FUTURE);
        // Found here, not by the child: with its environment replaced, std would look the
        // program up in the child's PATH, which it can only do by forking the whole crew
        // (posix_spawn looks in ours) — measured at 2-3x the CPU a command costs.
        let located = locate(program);
        let mut child = tokio::process::Command::new(located.as_deref().unwrap_or(std::path::Path::new(program)))
            .arg0(program)
            .args(args)
            .env_clear()
            .envs(self.env())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .process_group(0)
            .spawn()
            .map_err(|e| spawn_error(program, e))?;
        // Told the end when dropped, after the group below: once it is reaped or killed.
        let _watched = self.watchdog.as_deref().zip(child.id()).map(|(w, pid)| w.guard(pid, timeout));
        // process_group(0) makes the child the leader of a group whose id is its pid.
        let mut group = GroupGuard(child.id().and_then(|p| i32::try_from(p).ok()));
        let mut stdout = child.stdout.take();
        let mut stderr = child.stderr.take();

        let (mut out, mut err) = (Vec::new(), Vec::new());
        let mut wait_error = None;
        let (waited, timed_out) = {
            let max = self.max_output;
            let drain = async {
                tokio::join!(read_capped(&mut stdout, max, &mut out), read_capped(&mut stderr, max, &mut err))
            };
            tokio::pin!(drain);
            let mut drained = false;
            let waited: Option<std::io::Result<ExitStatus>> = loop {
                tokio::select! {
                    status = child.wait() => break Some(status),
                    _ = &mut drain, if !drained => drained = true,
                    _ = tokio::time::sleep_until(deadline) => break None,
                }
            };
            match waited {
                Some(Ok(status)) => {
                    // Reaped: the group id may be reused from now on, never signal it again.
                    group.disarm();
                    if !drained {
                        let until = deadline.min(Instant::now() + PIPE_GRACE);
                        let _ = tokio::time::timeout_at(until, &mut drain).await;
                    }
                    (Some(status), false)
                }
                other => {
                    group.kill();
                    let _ = tokio::time::timeout(KILL_GRACE, child.wait()).await;
                    group.disarm();
                    if !drained {
                        let _ = tokio::time::timeout(KILL_GRACE, &mut drain).await;
                    }
                    // The command ran (and may have had effects): never report it as
                    // something to retry. A failed wait is a failed command.
                    if let Some(Err(e)) = other {
                        wait_error = Some(format!("\npitcrew: waiting for '{program}' failed: {e}"));
                        (None, false)
                    } else {
                        (None, true)
                    }
                }
            }
        };
        if let Some(e) = wait_error {
            // Kept whole past a full stderr: it says why there is no exit code.
            append_within(&mut err, self.max_output, &e);
        }
        // Still open after the leader exited: something it started holds them.
        let held: Vec<Box<dyn AsyncRead + Send + Unpin>> = [
            stdout.map(|p| Box::new(p) as Box<dyn AsyncRead + Send + Unpin>),
            stderr.map(|p| Box::new(p) as Box<dyn AsyncRead + Send + Unpin>),
        ]
        .into_iter()
        .flatten()
        .collect();
        if waited.is_some() && !held.is_empty() {
            linger(program, held, self.max_output, &mut err);
        }
        let output = CommandOutput {
            exit_code: waited.and_then(|s| s.code()),
            // U+FFFD for NUL or bad UTF-8 is three bytes: the cap holds after it too.
            stdout: pitcrew_model::trim::text_within(&out, self.max_output),
            stderr: pitcrew_model::trim::text_within(&err, self.max_output),
            timed_out,
            duration: started.elapsed(),
        };
        tracing::debug!(
            program = %program,
            exit_code = ?output.exit_code,
            timed_out,
            duration_ms = output.duration.as_millis() as u64,
            "local command finished"
        );
        Ok(output)
    }
}

impl Executor for LocalExecutor {
    /// A process starts as soon as it is asked for, and one that fails to start with a
    /// `Transient` error (out of processes, memory, descriptors) never ran.
    fn starts_at_once(&self, _host: &str) -> bool {
        true
    }

    fn run<'a>(
        &'a self,
        host: &'a str,
        command: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<CommandOutput, ExecError>> {
        Box::pin(crate::observed("local", host, command, self.run_local(host, command, timeout)))
    }

    fn has_tool<'a>(&'a self, host: &'a str, tool: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(async move { is_local(host) && find_tool(tool).await })
    }
}

/// Whether `host` names this machine (`local`, `localhost`, `127.0.0.1`).
pub fn is_local(host: &str) -> bool {
    LOCAL_HOSTS.contains(&host)
}

/// Resource exhaustion is worth retrying; anything else (missing program, not executable,
/// bad argument) will fail the same way next time.
fn spawn_error(program: &str, e: std::io::Error) -> ExecError {
    let transient = matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::ENOMEM | libc::EMFILE | libc::ENFILE));
    if transient {
        ExecError::Transient(format!("cannot start '{program}': {e}"))
    } else {
        ExecError::Spawn { program: program.to_string(), error: e.to_string() }
    }
}

/// An executable regular file at `tool` if it contains '/', else in some `PATH` entry. The
/// whole walk is one blocking task (a `stat` per `PATH` entry), not one hand-over to the
/// blocking pool per entry.
async fn find_tool(tool: &str) -> bool {
    if tool.is_empty() || tool.contains('\0') {
        return false;
    }
    let tool = tool.to_string();
    tokio::task::spawn_blocking(move || locate(&tool).is_some()).await.unwrap_or(false)
}

/// The executable `tool` names: itself if it contains '/', else the first in a `PATH` entry.
fn locate(tool: &str) -> Option<std::path::PathBuf> {
    if tool.contains('/') {
        let path = std::path::PathBuf::from(tool);
        return is_executable(&path).then_some(path);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(tool))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &std::path::Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::metadata(path) {
        Ok(m) => m.is_file() && m.permissions().mode() & 0o111 != 0,
        Err(_) => false,
    }
}

/// Read `pipe` to EOF, keeping the first `max` bytes in `buf` and discarding the rest, so
/// memory stays bounded while the writer never blocks. An interrupted read is retried; any
/// other read error ends the stream with a line saying so, so output that was lost never
/// reads as output that was empty.
///
/// The pipe is left in `pipe` until it ends (then None), and a read cancelled by the caller
/// loses nothing: what is still Some after a deadline is held open by someone.
pub(crate) async fn read_capped<R: AsyncRead + Unpin>(pipe: &mut Option<R>, max: usize, buf: &mut Vec<u8>) {
    let Some(reading) = pipe.as_mut() else { return };
    let mut chunk = [0u8; 8192];
    loop {
        match reading.read(&mut chunk).await {
            Ok(0) => {
                *pipe = None;
                return;
            }
            Ok(n) => {
                let room = max.saturating_sub(buf.len());
                buf.extend_from_slice(&chunk[..n.min(room)]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(error = %e, "reading a command's output failed: the rest of it is lost");
                append_within(buf, max, &format!("\npitcrew: reading the output failed: {e}"));
                *pipe = None;
                return;
            }
        }
    }
}

/// Read on, and discard, the output pipes of a finished command that something it started
/// still holds (a daemon backgrounded without redirecting its output, `nohup app &` in a
/// start script): closing them would kill that process with SIGPIPE on its next write, a fix
/// undone a moment after it was verified. They are read for as long as this worker runs (up
/// to [`MAX_LINGERING`] commands' at once); `err` gets a line saying so, for the operator and
/// the next plan. (Over SSH the channel ends with the command, whatever holds its output:
/// sshd's doing, not ours.)
fn linger(program: &str, pipes: Vec<Box<dyn AsyncRead + Send + Unpin>>, max: usize, err: &mut Vec<u8>) {
    use std::sync::atomic::Ordering::Relaxed;
    let taken = LINGERING.fetch_update(Relaxed, Relaxed, |n| (n < MAX_LINGERING).then_some(n + 1)).is_ok();
    let fate = if taken {
        tracing::warn!(
            program,
            "a process the command left running holds its output: reading it on while this worker runs"
        );
        // Every pipe at once: one left unread fills and blocks its writer.
        let discard = pipes.into_iter().map(|mut pipe| async move {
            let mut chunk = vec![0u8; 8192];
            loop {
                match pipe.read(&mut chunk).await {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        });
        tokio::spawn(async move {
            futures::future::join_all(discard).await;
            LINGERING.fetch_sub(1, Relaxed);
        });
        "pitcrew reads it on and discards it while this worker runs; once the worker stops, that process gets \
         SIGPIPE on its next write"
            .to_string()
    } else {
        tracing::warn!(program, "a process the command left running holds its output: too many such, closed");
        format!(
            "pitcrew already reads {MAX_LINGERING} such outputs on: this one is closed, and that process gets \
             SIGPIPE on its next write"
        )
    };
    let line = format!(
        "\npitcrew: a process '{program}' left running holds its output (backgrounded without redirecting it): \
         {fate}. Start daemons with their output redirected (>/dev/null 2>&1) or by the service manager."
    );
    append_within(err, max, &line);
}

/// Append pitcrew's own `line` to a command's output of at most `max` bytes, cutting the
/// output rather than the line: it is never the part cut off. A known secret the cut goes
/// through is marked redacted: whole values are redacted later, but not the start of one
/// left before a line that is not the end of the text.
pub(crate) fn append_within(buf: &mut Vec<u8>, max: usize, line: &str) {
    use pitcrew_model::redact::{redact_cut, MARK};
    let room = max.saturating_sub(line.len());
    if buf.len() > room {
        buf.truncate(room);
        let text = String::from_utf8_lossy(buf).into_owned();
        if let std::borrow::Cow::Owned(marked) = redact_cut(&text) {
            let at = marked.len() - MARK.len();
            // The mark may be longer than the start it replaces: the output gives way.
            let mut keep = at.min(room.saturating_sub(MARK.len()));
            while !marked.is_char_boundary(keep) {
                keep -= 1;
            }
            *buf = format!("{}{MARK}", &marked[..keep]).into_bytes();
        }
    }
    buf.extend_from_slice(line.as_bytes());
}

/// Kills the command's whole process group if the run is abandoned (deadline, or the caller
/// dropping the future), so nothing it spawned outlives it. Disarmed once the leader is
/// reaped, because from then on the group id may belong to someone else.
struct GroupGuard(Option<i32>);

impl GroupGuard {
    fn kill(&mut self) {
        // A pgid <= 1 would make kill(-pgid) signal every process we may signal: never.
        if let Some(pgid) = self.0.filter(|p| *p > 1) {
            // SAFETY: kill(2) has no memory-safety preconditions; the group is ours and its
            // leader has not been reaped yet (we disarm on reap), so the id is not reused.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
        }
    }

    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// Output cut short for pitcrew's note, the cut through a secret this process knows: its
    /// start is not kept before the note.
    #[test]
    fn a_cut_before_a_note_leaves_no_start_of_a_secret() {
        let secret = "cut-secret-Q7w9-xyz";
        pitcrew_model::redact::register_secret(secret).unwrap();
        let line = "\npitcrew: a note";
        for through in [4, 10, secret.len() - 1] {
            let mut buf = format!("{}{secret} and more", "x".repeat(40)).into_bytes();
            let max = 40 + through + line.len();
            append_within(&mut buf, max, line);
            let text = String::from_utf8(buf).unwrap();
            assert!(!text.contains(&secret[..4]), "{through}: {text}");
            assert!(text.ends_with(line) && text.len() <= max, "{through}: {text}");
        }
        // No secret where it cut: the output as it was, up to the room.
        let mut buf = b"plain output that goes on".to_vec();
        append_within(&mut buf, 10 + line.len(), line);
        assert_eq!(String::from_utf8(buf).unwrap(), format!("plain outp{line}"));
    }
    use std::io;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// A pipe that answers each read with the next of `reads`, then EOF.
    struct Pipe(VecDeque<io::Result<&'static [u8]>>);

    impl AsyncRead for Pipe {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Poll::Ready(match self.0.pop_front() {
                Some(Ok(bytes)) => {
                    buf.put_slice(bytes);
                    Ok(())
                }
                Some(Err(e)) => Err(e),
                None => Ok(()),
            })
        }
    }

    async fn read(reads: Vec<io::Result<&'static [u8]>>, max: usize) -> String {
        let mut buf = Vec::new();
        read_capped(&mut Some(Pipe(reads.into())), max, &mut buf).await;
        String::from_utf8(buf).unwrap()
    }

    #[tokio::test]
    async fn an_interrupted_read_is_retried_and_a_failed_one_is_said() {
        let interrupted = || Err(io::Error::new(io::ErrorKind::Interrupted, "signal"));
        assert_eq!(read(vec![Ok(b"12"), interrupted(), Ok(b"3\n")], 100).await, "123\n", "nothing lost to a signal");

        let failed = read(vec![Ok(b"partial"), Err(io::Error::other("channel closed")), Ok(b"never read")], 100).await;
        assert_eq!(failed, "partial\npitcrew: reading the output failed: channel closed");

        // Output already at the cap gives way to the line saying the rest was lost.
        let full = read(vec![Ok(&[b'x'; 64]), Err(io::Error::other("channel closed"))], 64).await;
        assert_eq!(full.len(), 64);
        assert!(full.ends_with("\npitcrew: reading the output failed: channel closed"), "{full}");
    }
}
