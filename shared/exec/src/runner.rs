//! The local runner: a small process of its own that starts a worker's local commands and
//! holds them to their deadlines, so that a worker killed outright (SIGKILL, the OOM killer)
//! never leaves a command running past its deadline (over SSH, the host's `timeout` does
//! this). It is the same binary (`/proc/self/exe`, so an upgrade in place changes nothing
//! under a running worker), started on its first command with [`MARKER`] as its argument.
//!
//! The worker sends it commands on its stdin and reads their results on its stdout, each a
//! length-prefixed MessagePack frame. When its stdin ends (the worker stopped, or died) it
//! takes no new command, lets those it holds run to their end or their deadline (then kills
//! their process groups), and exits. It ignores SIGINT and SIGTERM: a Ctrl-C or a service
//! manager's stop reaches the worker, which drains and closes its stdin; a command cut off
//! as the worker finished it would be a remediation half done.
//!
//! Starting commands from a small process is also cheaper: a worker holding thousands of
//! sockets (the model's connections) had every command's child close them all at `exec`.

use crate::local::run_argv;
use crate::{CommandOutput, ExecError};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// The first argument that makes a pitcrew binary serve as a runner ([`serve_if_asked`]).
pub const MARKER: &str = "__pitcrew-local-runner";

/// The largest frame either side reads: a result holds two outputs of at most
/// `[limits] max_output_bytes` each (at most 16 MiB: `pitcrew_runtime`'s `MAX_OUTPUT_BYTES`).
const MAX_FRAME: usize = 64 << 20;

/// How long past a command's timeout its result may take before the runner counts as hung:
/// the runner itself reports within the timeout and a few seconds (the kill's grace and the
/// last of the output).
const ANSWER_GRACE: Duration = Duration::from_secs(30);

/// After a runner was lost, its command is reported once its deadline and this have passed:
/// by then a live runner would have killed it (see [`crate::local`]'s kill grace).
const LOST_GRACE: Duration = Duration::from_secs(2);

/// A request to the runner.
#[derive(Serialize, Deserialize)]
enum Request {
    /// Run `program` (found at `located`, if it was found) with `args` and exactly `env`.
    Run {
        id: u64,
        program: String,
        located: Option<Vec<u8>>,
        args: Vec<String>,
        env: Vec<(Vec<u8>, Vec<u8>)>,
        timeout_us: u64,
        max_output: u64,
    },
    /// The worker no longer waits for command `id`: kill its group if it still runs.
    Cancel { id: u64 },
}

/// The runner's answer for one command.
#[derive(Serialize, Deserialize)]
struct Reply {
    id: u64,
    outcome: Outcome,
}

#[derive(Serialize, Deserialize)]
enum Outcome {
    Ran {
        exit_code: Option<i32>,
        stdout: String,
        stderr: String,
        timed_out: bool,
        duration_us: u64,
    },
    /// It could not start, and will not next time either ([`ExecError::Spawn`]).
    Spawn {
        program: String,
        error: String,
    },
    /// It could not start for now ([`ExecError::Transient`]): it never ran.
    Transient(String),
}

/// One frame: the message's length (4 bytes, little-endian), then the message.
fn frame<T: Serialize>(message: &T) -> Vec<u8> {
    let mut bytes = vec![0u8; 4];
    // Writing into a Vec fails only for types serde cannot encode: none of these.
    rmp_serde::encode::write(&mut bytes, message).expect("a runner message encodes");
    let len = u32::try_from(bytes.len() - 4).unwrap_or(u32::MAX);
    bytes[..4].copy_from_slice(&len.to_le_bytes());
    bytes
}

/// The next frame's message, None at a clean end of the stream (between frames).
async fn read_frame<R, T>(from: &mut R, buf: &mut Vec<u8>) -> std::io::Result<Option<T>>
where
    R: AsyncRead + Unpin,
    T: for<'de> Deserialize<'de>,
{
    let mut len = [0u8; 4];
    match from.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!("a frame of {len} bytes, over the {MAX_FRAME} allowed")));
    }
    buf.resize(len, 0);
    from.read_exact(buf).await?;
    // Not the decoder's words: they may quote a value, and a command's arguments hold secrets.
    rmp_serde::from_slice(buf)
        .map(Some)
        .map_err(|_| std::io::Error::other(format!("a frame of {len} bytes that does not decode")))
}

/// If this process was started as a runner (its first argument is [`MARKER`]), serve as one
/// and exit; else return at once. Called first thing in `main`, before any thread starts.
pub fn serve_if_asked() {
    if std::env::args_os().nth(1).as_deref() == Some(OsStr::new(MARKER)) {
        std::process::exit(serve());
    }
}

/// Serve as a runner on stdin and stdout (both pipes) until stdin ends and the last command
/// has ended; the exit code.
pub fn serve() -> i32 {
    let served =
        tokio::runtime::Builder::new_current_thread().enable_all().build().and_then(|rt| rt.block_on(serving()));
    match served {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("pitcrew local runner: {e}");
            2
        }
    }
}

async fn serving() -> std::io::Result<()> {
    use std::os::fd::AsFd;
    use tokio::net::unix::pipe;
    let not_a_pipe = |what: &str, e: std::io::Error| {
        std::io::Error::other(format!("its {what} must be a pipe from the worker that started it: {e}"))
    };
    let stdin = std::fs::File::from(std::io::stdin().as_fd().try_clone_to_owned()?);
    let stdout = std::fs::File::from(std::io::stdout().as_fd().try_clone_to_owned()?);
    let input = pipe::Receiver::from_file(stdin).map_err(|e| not_a_pipe("stdin", e))?;
    let mut output = pipe::Sender::from_file(stdout).map_err(|e| not_a_pipe("stdout", e))?;

    // Handled, not ignored: an ignored signal would stay ignored in every command started.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
    });

    // Requests are read by a task of their own, so no frame is ever cut by a select.
    let (requests_tx, mut requests) = mpsc::channel::<std::io::Result<Request>>(64);
    tokio::spawn(async move {
        let mut input = tokio::io::BufReader::with_capacity(64 * 1024, input);
        let mut buf = Vec::new();
        loop {
            let next = read_frame(&mut input, &mut buf).await.transpose();
            let ended = !matches!(next, Some(Ok(_)));
            if let Some(next) = next {
                if requests_tx.send(next).await.is_err() {
                    return;
                }
            }
            if ended {
                return;
            }
        }
    });
    let (replies, mut to_write) = mpsc::unbounded_channel::<Vec<u8>>();
    let writer = tokio::spawn(async move {
        while let Some(reply) = to_write.recv().await {
            // The worker is gone: its results have no reader, the commands still their deadline.
            if output.write_all(&reply).await.is_err() {
                return;
            }
        }
    });

    let mut running = tokio::task::JoinSet::new();
    let mut handles: HashMap<u64, tokio::task::AbortHandle> = HashMap::new();
    loop {
        tokio::select! {
            request = requests.recv() => match request {
                Some(Ok(Request::Run { id, program, located, args, env, timeout_us, max_output })) => {
                    let replies = replies.clone();
                    let handle = running.spawn(async move {
                        // A run that panics is still answered: it may have started the command.
                        let mut answer = Answer { id, replies, sent: false };
                        let located = located.map(|l| PathBuf::from(OsString::from_vec(l)));
                        let env = env.into_iter().map(|(k, v)| (OsString::from_vec(k), OsString::from_vec(v))).collect();
                        let timeout = Duration::from_micros(timeout_us);
                        let max_output = usize::try_from(max_output).unwrap_or(usize::MAX);
                        let outcome = match run_argv(&program, located.as_deref(), &args, env, timeout, max_output).await {
                            Ok(out) => Outcome::Ran {
                                exit_code: out.exit_code,
                                stdout: out.stdout,
                                stderr: out.stderr,
                                timed_out: out.timed_out,
                                duration_us: micros(out.duration),
                            },
                            Err(ExecError::Transient(why)) => Outcome::Transient(why),
                            Err(ExecError::Spawn { program, error }) => Outcome::Spawn { program, error },
                            Err(other) => Outcome::Spawn { program, error: other.to_string() },
                        };
                        answer.send(outcome);
                        id
                    });
                    handles.insert(id, handle);
                }
                Some(Ok(Request::Cancel { id })) => {
                    // Aborting drops the run, whose guard kills the command's group.
                    if let Some(handle) = handles.remove(&id) {
                        handle.abort();
                    }
                }
                Some(Err(e)) => {
                    // The stream cannot be followed past a bad frame: as if the worker had gone.
                    eprintln!("pitcrew local runner: reading requests failed, taking no more: {e}");
                    break;
                }
                None => break,
            },
            Some(ended) = running.join_next(), if !running.is_empty() => {
                if let Ok(id) = ended {
                    handles.remove(&id);
                }
            }
        }
    }
    // No more requests: the commands held run on to their end or their deadline.
    while running.join_next().await.is_some() {}
    drop(replies);
    let _ = writer.await;
    Ok(())
}

/// Sends a command's outcome, or, if its run ends without one (a panic; a cancel, whose
/// answer nobody reads), one saying it may have run.
struct Answer {
    id: u64,
    replies: mpsc::UnboundedSender<Vec<u8>>,
    sent: bool,
}

impl Answer {
    fn send(&mut self, outcome: Outcome) {
        self.sent = true;
        let _ = self.replies.send(frame(&Reply { id: self.id, outcome }));
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        if !self.sent {
            self.send(Outcome::Ran {
                exit_code: None,
                stdout: String::new(),
                stderr: "pitcrew: the local runner failed while running it: it may have run".to_string(),
                timed_out: false,
                duration_us: 0,
            });
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// A worker's side of a runner: starts it on the first command and again after it was lost.
pub struct Runner {
    program: PathBuf,
    args: Vec<OsString>,
    conn: Mutex<Option<Arc<Conn>>>,
    next_id: AtomicU64,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner").field("program", &self.program).field("args", &self.args).finish_non_exhaustive()
    }
}

/// One started runner.
struct Conn {
    requests: mpsc::UnboundedSender<Vec<u8>>,
    /// Who waits for which command; None once the runner is gone (every waiter then hears so).
    waiting: Mutex<Option<HashMap<u64, oneshot::Sender<Outcome>>>>,
    pid: Option<u32>,
}

impl Conn {
    fn alive(&self) -> bool {
        !self.requests.is_closed() && self.waiting.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// The runner is gone: every command still waited for is answered "lost".
    fn gone(&self) {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    fn forget(&self, id: u64) {
        if let Some(waiting) = self.waiting.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            waiting.remove(&id);
        }
    }
}

/// Marks a runner gone when its reader ends, however it ends.
struct GoneOnDrop(std::sync::Weak<Conn>);

impl Drop for GoneOnDrop {
    fn drop(&mut self) {
        if let Some(conn) = self.0.upgrade() {
            conn.gone();
        }
    }
}

/// Tells the runner to kill a command nobody waits for any more (the caller dropped the run).
struct CancelOnDrop<'a> {
    conn: &'a Conn,
    id: u64,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.conn.forget(self.id);
            let _ = self.conn.requests.send(frame(&Request::Cancel { id: self.id }));
        }
    }
}

static OWN: OnceLock<Arc<Runner>> = OnceLock::new();

/// From now on, every [`crate::LocalExecutor`] made in this process starts its commands
/// through one runner: this same binary, which must call [`serve_if_asked`] first thing in
/// its `main`.
pub fn use_own() {
    let _ = OWN.set(Arc::new(Runner::new("/proc/self/exe", [MARKER])));
}

/// The runner [`use_own`] set up, if it did.
pub fn own() -> Option<Arc<Runner>> {
    OWN.get().cloned()
}

impl Runner {
    /// A runner started as `program args...` (a binary that calls [`serve`] or
    /// [`serve_if_asked`]); not started until its first command.
    pub fn new<I, S>(program: impl Into<PathBuf>, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        Runner {
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            conn: Mutex::new(None),
            next_id: AtomicU64::new(0),
        }
    }

    /// The process id of the runner now started, if one is.
    pub fn pid(&self) -> Option<u32> {
        let conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        conn.as_ref().filter(|c| c.alive()).and_then(|c| c.pid)
    }

    /// The runner that is up, or a new one.
    fn conn(&self) -> Result<Arc<Conn>, ExecError> {
        let mut slot = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(conn) = slot.as_ref().filter(|c| c.alive()) {
            return Ok(conn.clone());
        }
        let conn = self.start().map_err(|e| {
            ExecError::Transient(format!("cannot start the local runner ({}): {e}", self.program.display()))
        })?;
        *slot = Some(conn.clone());
        Ok(conn)
    }

    fn start(&self) -> std::io::Result<Arc<Conn>> {
        use std::process::Stdio;
        // Only the variables every command may see: none of the worker's secrets.
        let env = std::env::vars_os()
            .filter(|(k, _)| k.to_str().is_some_and(|k| crate::local::INHERITED.contains(&k) || k.starts_with("LC_")));
        let mut child = tokio::process::Command::new(&self.program)
            .args(&self.args)
            .env_clear()
            .envs(env)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            // Out of the terminal's group: a Ctrl-C is for the worker, which drains first.
            .process_group(0)
            .spawn()?;
        let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(std::io::Error::other("no pipes to the runner"));
        };
        let (requests, mut to_send) = mpsc::unbounded_channel::<Vec<u8>>();
        let conn = Arc::new(Conn { requests, waiting: Mutex::new(Some(HashMap::new())), pid: child.id() });
        let sending = Arc::downgrade(&conn);
        tokio::spawn(async move {
            while let Some(request) = to_send.recv().await {
                if let Err(e) = stdin.write_all(&request).await {
                    tracing::error!(error = %e, "the local runner stopped taking commands");
                    if let Some(conn) = sending.upgrade() {
                        conn.gone();
                    }
                    return;
                }
            }
            // Every sender dropped (the worker is done): the runner's stdin ends with this.
        });
        let reading = Arc::downgrade(&conn);
        let pid = child.id();
        tokio::spawn(async move {
            // Also when this task is dropped with its runtime: nobody would answer the waiters.
            let gone = GoneOnDrop(reading.clone());
            let mut stdout = tokio::io::BufReader::with_capacity(64 * 1024, stdout);
            let mut buf = Vec::new();
            let why = loop {
                match read_frame::<_, Reply>(&mut stdout, &mut buf).await {
                    Ok(Some(reply)) => {
                        // Read on while the runner answers, whoever waits: it exits once it
                        // has written its last answer.
                        let Some(conn) = reading.upgrade() else { continue };
                        let waiter = conn
                            .waiting
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .as_mut()
                            .and_then(|w| w.remove(&reply.id));
                        if let Some(waiter) = waiter {
                            let _ = waiter.send(reply.outcome);
                        }
                        buf.shrink_to(64 * 1024);
                    }
                    Ok(None) => break None,
                    Err(e) => break Some(e),
                }
            };
            drop(gone);
            // Its next write fails, not blocks: it ends once its commands have.
            drop(stdout);
            let status = child.wait().await;
            match (why, status) {
                (None, Ok(s)) if s.success() => tracing::debug!(pid, "the local runner ended"),
                (why, status) => tracing::error!(
                    pid,
                    error = why.map(|e| e.to_string()),
                    status = ?status,
                    "the local runner ended unexpectedly: the commands it held are reported once their deadlines pass"
                ),
            }
        });
        Ok(conn)
    }

    /// Run `program` through the runner: what [`run_argv`] would return in this process.
    pub(crate) async fn run(
        &self,
        program: &str,
        located: Option<&Path>,
        args: &[String],
        env: Vec<(OsString, OsString)>,
        timeout: Duration,
        max_output: usize,
    ) -> Result<CommandOutput, ExecError> {
        let started = Instant::now();
        let conn = self.conn()?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let never_ran = || ExecError::Transient(format!("cannot start '{program}': the local runner has gone"));
        match conn.waiting.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            Some(waiting) => waiting.insert(id, tx),
            None => return Err(never_ran()),
        };
        let request = Request::Run {
            id,
            program: program.to_string(),
            located: located.map(|l| l.as_os_str().as_bytes().to_vec()),
            args: args.to_vec(),
            env: env.into_iter().map(|(k, v)| (k.into_vec(), v.into_vec())).collect(),
            timeout_us: micros(timeout),
            max_output: max_output as u64,
        };
        if conn.requests.send(frame(&request)).is_err() {
            conn.forget(id);
            return Err(never_ran());
        }
        let mut cancel = CancelOnDrop { conn: &conn, id, armed: true };
        let answered = tokio::time::timeout(timeout.saturating_add(ANSWER_GRACE), rx).await;
        cancel.armed = false;
        let why = match answered {
            Ok(Ok(Outcome::Ran { exit_code, stdout, stderr, timed_out, duration_us })) => {
                return Ok(CommandOutput {
                    exit_code,
                    stdout,
                    stderr,
                    timed_out,
                    duration: Duration::from_micros(duration_us),
                });
            }
            Ok(Ok(Outcome::Spawn { program, error })) => return Err(ExecError::Spawn { program, error }),
            Ok(Ok(Outcome::Transient(why))) => return Err(ExecError::Transient(why)),
            Ok(Err(_)) => "ended",
            Err(_) => {
                // Hung: the next command gets a new runner. This one is not killed (its other
                // commands would run on with no deadline): it gets no more commands, and its
                // stdin ends with the last of its waiters, when it holds its commands to their
                // deadlines and exits.
                conn.forget(id);
                conn.gone();
                "did not answer"
            }
        };
        // The command may have run, and may still run: reported as failed, never as something
        // to retry, once its deadline has passed (a runner that only stopped answering still
        // ends it by then; one killed left it to run on, orphaned, with its own deadline only).
        if let Some(at) = started.checked_add(timeout.saturating_add(LOST_GRACE)) {
            tokio::time::sleep_until(at).await;
        }
        tracing::error!(program, "the local runner {why} while a command ran: reported as failed");
        Ok(CommandOutput {
            exit_code: None,
            stdout: String::new(),
            stderr: format!(
                "pitcrew: the local runner {why} while '{program}' ran: it may have run to its end, been stopped, or \
                 still run (reported once its deadline had passed; a runner killed could not end it then)"
            ),
            timed_out: false,
            duration: started.elapsed(),
        })
    }
}

/// CPU time of the runner now started, in ms: its own, and that of the commands it has
/// reaped (from `/proc`; None when none runs or it cannot be read).
pub fn cpu_ms(runner: &Runner) -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", runner.pid()?)).ok()?;
    // Fields after the command name (which may hold spaces): state is field 3; utime, stime,
    // cutime, cstime are fields 14-17.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i - 3).and_then(|f| f.parse::<f64>().ok());
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let ms = |t: f64| t * 1000.0 / hz;
    Some((ms(ticks(14)? + ticks(15)?), ms(ticks(16)? + ticks(17)?)))
}
