//! The local watchdog: a small process of its own that holds a worker's local commands to
//! their deadlines once the worker is gone. A worker kills a command's process group at its
//! deadline itself; killed outright (SIGKILL, the OOM killer), it can't, and the command would
//! run on with no deadline but its own (over SSH, the host's `timeout` ends it).
//!
//! The worker starts its commands itself, as before, and only tells the watchdog of each:
//! "command `id`, process group `pgid` (its leader's start time), deadline in `ms`" when it
//! starts, "`id` ended" once
//! its group is dealt with. These are fire-and-forget writes on the watchdog's stdin, off the
//! command's path: nothing waits for the watchdog. When its stdin ends (the worker stopped or
//! died), the watchdog kills at its deadline each group it still holds whose leader is still
//! the process that was started (its start time in `/proc` unchanged: a pid freed and reused
//! is never signalled), and exits once it holds none. A worker that stops cleanly has told it
//! of every end: it exits at once.
//!
//! It is the same binary (`/proc/self/exe`, so an upgrade in place changes nothing under a
//! running worker), started with [`MARKER`] as its only argument on the first command. It
//! handles SIGTERM and SIGINT by doing nothing: a Ctrl-C or a service manager's stop is for
//! the worker, which drains first. A watchdog that dies is started again with the next
//! command; the commands it held are then guarded by their worker alone.

use crate::process::ProcStat;
use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::time::Instant;

/// The first argument that makes a pitcrew binary serve as a watchdog ([`serve_if_asked`]).
pub const MARKER: &str = "__pitcrew-watchdog";

/// One message: a kind byte, the command's id, its group, its deadline in ms from now and its
/// leader's start time (read by the worker before it could have reaped the leader). At most
/// `PIPE_BUF` bytes: a non-blocking write of it is whole or fails.
const MESSAGE: usize = 1 + 8 + 4 + 8 + 8;
const STARTED: u8 = 1;
const ENDED: u8 = 2;

/// A deadline further than this is no deadline (a "forever" timeout): such a group is left.
const FOREVER_MS: u64 = 365 * 24 * 3600 * 1000;

fn message(kind: u8, id: u64, pgid: u32, deadline_ms: u64, started: u64) -> [u8; MESSAGE] {
    let mut m = [0u8; MESSAGE];
    m[0] = kind;
    m[1..9].copy_from_slice(&id.to_le_bytes());
    m[9..13].copy_from_slice(&pgid.to_le_bytes());
    m[13..21].copy_from_slice(&deadline_ms.to_le_bytes());
    m[21..29].copy_from_slice(&started.to_le_bytes());
    m
}

/// How many starts between two sweeps of the groups held for ones that are gone (their end
/// was not heard: a message dropped, see [`Watchdog::send`]).
const SWEEP_EVERY: u64 = 1024;

/// If this process was started as a watchdog (its first argument is [`MARKER`]), serve as one
/// and exit; else return at once. Called first thing in `main`, before any thread starts.
pub fn serve_if_asked() {
    if std::env::args_os().nth(1).as_deref() == Some(OsStr::new(MARKER)) {
        std::process::exit(serve());
    }
}

/// Serve as a watchdog on stdin (a pipe from the worker) until it ends and the last group
/// held has been dealt with; the exit code.
pub fn serve() -> i32 {
    let served =
        tokio::runtime::Builder::new_current_thread().enable_all().build().and_then(|rt| rt.block_on(serving()));
    match served {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("pitcrew watchdog: {e}");
            2
        }
    }
}

/// A group held: its leader's pid and start time, and its deadline.
struct Held {
    pgid: u32,
    started: u64,
    deadline: Option<Instant>,
}

impl Held {
    /// Its leader is still the process that was started: the group id is still its own.
    fn still_there(&self) -> bool {
        self.pgid > 1 && start_time(self.pgid) == Some(self.started)
    }
}

async fn serving() -> std::io::Result<()> {
    use std::os::fd::AsFd;
    let stdin = std::fs::File::from(std::io::stdin().as_fd().try_clone_to_owned()?);
    let input = tokio::net::unix::pipe::Receiver::from_file(stdin)
        .map_err(|e| std::io::Error::other(format!("its stdin must be a pipe from the worker that started it: {e}")))?;
    // Handled, not ignored: an ignored signal would stay ignored in whatever it starts (it
    // starts nothing, but a handler costs nothing more).
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

    let mut input = tokio::io::BufReader::with_capacity(64 * 1024, input);
    let mut held: HashMap<u64, Held> = HashMap::new();
    let mut starts = 0u64;
    let mut m = [0u8; MESSAGE];
    loop {
        match input.read_exact(&mut m).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => {
                eprintln!("pitcrew watchdog: reading from the worker failed, taking it as gone: {e}");
                break;
            }
        }
        let id = u64::from_le_bytes(m[1..9].try_into().expect("8 bytes"));
        match m[0] {
            STARTED => {
                let pgid = u32::from_le_bytes(m[9..13].try_into().expect("4 bytes"));
                let ms = u64::from_le_bytes(m[13..21].try_into().expect("8 bytes"));
                let started = u64::from_le_bytes(m[21..29].try_into().expect("8 bytes"));
                let deadline = (ms < FOREVER_MS).then(|| Instant::now() + Duration::from_millis(ms));
                starts += 1;
                if starts.is_multiple_of(SWEEP_EVERY) {
                    held.retain(|_, h| h.still_there());
                }
                held.insert(id, Held { pgid, started, deadline });
            }
            ENDED => {
                held.remove(&id);
            }
            other => {
                eprintln!("pitcrew watchdog: a message of kind {other} from the worker, taking it as gone");
                break;
            }
        }
    }
    // The worker is gone: each group still held is ended at its deadline, in their order.
    let mut left: Vec<Held> = held.into_values().filter(|h| h.deadline.is_some() && h.still_there()).collect();
    left.sort_by_key(|h| h.deadline);
    for group in left {
        if let Some(at) = group.deadline {
            tokio::time::sleep_until(at).await;
        }
        if let Some(pgid) = i32::try_from(group.pgid).ok().filter(|_| group.still_there()) {
            // SAFETY: kill(2) has no memory-safety preconditions. The group's leader is the
            // process started (same pid, same start time), so the group id is still its own.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
        }
    }
    Ok(())
}

/// When process `pid` started (in clock ticks since boot, `/proc/<pid>/stat`'s 22nd field):
/// with the pid, it names one process for good. None if there is no such process.
fn start_time(pid: u32) -> Option<u64> {
    ProcStat::read(pid)?.field(22)
}

/// A worker's side of a watchdog: started with the first command, and again after it died.
pub struct Watchdog {
    program: PathBuf,
    args: Vec<OsString>,
    to: Mutex<Link>,
    next_id: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog").field("program", &self.program).field("args", &self.args).finish_non_exhaustive()
    }
}

/// The worker's link to its watchdog.
enum Link {
    /// None started yet, or the last one has gone.
    Down,
    Up(Started),
    /// A start failed then: the next is tried no sooner than [`RETRY_AFTER`] later.
    Failed(std::time::Instant),
}

/// A watchdog started: the write end of its stdin (non-blocking) and the process.
struct Started {
    pipe: std::fs::File,
    child: std::process::Child,
}

impl Started {
    /// Close its stdin and reap it once it exits (at once if it holds nothing), on a thread
    /// of its own: it may hold groups to their deadlines.
    fn reap(self) {
        let Started { pipe, mut child } = self;
        drop(pipe);
        if !matches!(child.try_wait(), Ok(Some(_))) {
            let _ = std::thread::Builder::new().name("watchdog-reaper".into()).spawn(move || child.wait());
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Link::Up(started) = std::mem::replace(self.to.get_mut().unwrap_or_else(|e| e.into_inner()), Link::Down) {
            started.reap();
        }
    }
}

/// After a watchdog could not be started, how long commands go without one before the next try.
const RETRY_AFTER: Duration = Duration::from_secs(10);

static OWN: OnceLock<Arc<Watchdog>> = OnceLock::new();

/// From now on, every [`crate::LocalExecutor`] made in this process tells one watchdog of its
/// commands: this same binary, which must call [`serve_if_asked`] first thing in its `main`.
pub fn use_own() {
    let _ = OWN.set(Arc::new(Watchdog::new("/proc/self/exe", [MARKER])));
}

/// The watchdog [`use_own`] set up, if it did.
pub fn own() -> Option<Arc<Watchdog>> {
    OWN.get().cloned()
}

/// A command the watchdog was told of; tells it of the end when dropped.
pub(crate) struct Guarded<'a> {
    watchdog: &'a Watchdog,
    id: u64,
}

impl Drop for Guarded<'_> {
    fn drop(&mut self) {
        self.watchdog.send(message(ENDED, self.id, 0, 0, 0));
    }
}

impl Watchdog {
    /// A watchdog started as `program args...` (a binary that calls [`serve`] or
    /// [`serve_if_asked`]); not started until the first command.
    pub fn new<I, S>(program: impl Into<PathBuf>, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        Watchdog {
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            to: Mutex::new(Link::Down),
            next_id: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The process id of the watchdog now started, if one is.
    pub fn pid(&self) -> Option<u32> {
        match &*self.to.lock().unwrap_or_else(|e| e.into_inner()) {
            Link::Up(started) => Some(started.child.id()),
            Link::Down | Link::Failed(_) => None,
        }
    }

    /// CPU time (user + system) of the watchdog now started, in ms (None: none runs, or
    /// `/proc` cannot be read).
    pub fn cpu_ms(&self) -> Option<f64> {
        let stat = ProcStat::read(self.pid()?)?;
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        Some((stat.field(14)? + stat.field(15)?) as f64 * 1000.0 / hz.max(1.0))
    }

    /// Tell the watchdog that process group `pgid` started with `timeout` to run; it is told
    /// of the end when the returned guard is dropped (once the group is reaped or killed).
    ///
    /// Called before the leader can have been reaped (before its child is first waited for),
    /// so the start time read here is surely the command's.
    pub(crate) fn guard(&self, pgid: u32, timeout: Duration) -> Guarded<'_> {
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        // Unreadable only if /proc is not mounted: 0 matches no process, nothing is signalled.
        let started = start_time(pgid).unwrap_or(0);
        self.send(message(STARTED, id, pgid, ms, started));
        Guarded { watchdog: self, id }
    }

    /// Write `m` to the watchdog, starting one if none runs; a write of a few bytes to a pipe,
    /// whole or not at all, that never waits. A message the watchdog has no room for (it is
    /// some 2000 behind: its pipe is full) is dropped, said once: it may leave one command
    /// unguarded, or one that ended held until a sweep, never signal one that ended (the
    /// leader's start time tells).
    fn send(&self, m: [u8; MESSAGE]) {
        use std::io::Write;
        static FULL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let mut link = self.to.lock().unwrap_or_else(|e| e.into_inner());
        if let Link::Up(started) = &mut *link {
            match (&started.pipe).write(&m) {
                Ok(n) if n == MESSAGE => return,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if !FULL.swap(true, std::sync::atomic::Ordering::Relaxed) {
                        tracing::warn!("the local watchdog is behind: a command goes unguarded");
                    }
                    return;
                }
                // Gone (EPIPE): replaced below, and reaped off this thread.
                _ => {
                    tracing::error!(pid = started.child.id(), "the local watchdog has gone: starting another");
                    if let Link::Up(gone) = std::mem::replace(&mut *link, Link::Down) {
                        gone.reap();
                    }
                }
            }
        }
        // An end of a command the last watchdog held is no news to a new one.
        if m[0] == ENDED {
            return;
        }
        if matches!(*link, Link::Failed(at) if at.elapsed() < RETRY_AFTER) {
            return;
        }
        match self.start() {
            Ok(started) => {
                let _ = (&started.pipe).write(&m);
                *link = Link::Up(started);
            }
            Err(e) => {
                tracing::error!(
                    program = %self.program.display(),
                    error = %e,
                    "cannot start the local watchdog (tried again in 10 s): until then a local command of a worker \
                     killed outright runs past its deadline"
                );
                *link = Link::Failed(std::time::Instant::now());
            }
        }
    }

    fn start(&self) -> std::io::Result<Started> {
        use std::os::unix::process::CommandExt;
        use std::process::Stdio;
        let mut child = std::process::Command::new(&self.program)
            .args(&self.args)
            // It needs none of the worker's variables (its secrets among them).
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            // Out of the terminal's group: a Ctrl-C is for the worker, which drains first.
            .process_group(0)
            .spawn()?;
        let Some(stdin) = child.stdin.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::other("no pipe to the watchdog"));
        };
        let pipe = std::fs::File::from(std::os::fd::OwnedFd::from(stdin));
        // SAFETY: fcntl on a descriptor we own, with flags it takes.
        let nonblocking = unsafe {
            use std::os::fd::AsRawFd;
            let flags = libc::fcntl(pipe.as_raw_fd(), libc::F_GETFL);
            flags >= 0 && libc::fcntl(pipe.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !nonblocking {
            let e = std::io::Error::last_os_error();
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        Ok(Started { pipe, child })
    }
}
