//! toy: a tiny real HTTP service the demo breaks and pitcrew repairs.
//!
//! Faults are files in the toy's directory, so a demo (or test) can break it from outside:
//! `wedged` makes `/health` answer 503 until the next start; `broken` makes `start` refuse;
//! `toy.conf`, when present, must be readable by the toy's user or it refuses to start;
//! `logs/` over [`LOG_QUOTA`] refuses too. Refusals are also appended to `toy.log`, as a
//! real service logs why it did not come up. `squat` holds a port the way a stray process does.

use anyhow::{bail, Context};
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::sleep;
use std::time::{Duration, Instant};

/// How long to wait for the port: bind retries, start-up and SIGKILL aftermath.
const WAIT: Duration = Duration::from_secs(5);
/// How long a stopped toy gets to exit on SIGTERM before it is killed.
const TERM_GRACE: Duration = Duration::from_secs(3);
const POLL: Duration = Duration::from_millis(50);
/// Connections served at once; more are closed unanswered, so a flood cannot exhaust threads.
const MAX_CONNECTIONS: usize = 32;
/// Largest request head read; a slow or huge request cannot hold a thread for long.
const MAX_REQUEST: usize = 8 * 1024;
const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// Serve forever on 127.0.0.1:`port`. Writes `dir/pid` first, so `stop` can find us even
/// while we wait for a dying predecessor to release the port (bind is retried for 5 s).
/// GET /health answers 200 "ok", or 503 while `dir/wedged` exists; anything else is 404.
pub fn serve(port: u16, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    read_config(dir)?;
    let tmp = dir.join("pid.tmp");
    std::fs::write(&tmp, format!("{}\n", std::process::id())).context("writing pid file")?;
    std::fs::rename(&tmp, dir.join("pid")).context("writing pid file")?;
    let deadline = Instant::now() + WAIT;
    let listener = loop {
        match TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
            Ok(l) => break l,
            Err(_) if Instant::now() < deadline => sleep(Duration::from_millis(100)),
            Err(e) => return Err(e).with_context(|| format!("binding 127.0.0.1:{port}")),
        }
    };
    eprintln!("toy: serving on 127.0.0.1:{port} (pid {})", std::process::id());
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        let (active, wedged) = (active.clone(), dir.join("wedged"));
        std::thread::spawn(move || {
            let _ = answer(stream, &wedged);
            active.fetch_sub(1, Ordering::SeqCst);
        });
    }
    Ok(())
}

/// Read one request head (bounded in size and time) and write one response.
fn answer(mut stream: TcpStream, wedged: &Path) -> std::io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&head);
    let mut words = head.lines().next().unwrap_or("").split_whitespace();
    let (status, body) = match (words.next(), words.next()) {
        (Some("GET"), Some("/health")) if wedged.exists() => {
            ("503 Service Unavailable", "stuck: worker pool deadlocked\n")
        }
        (Some("GET"), Some("/health")) => ("200 OK", "ok\n"),
        _ => ("404 Not Found", "not found\n"),
    };
    let len = body.len();
    let response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {len}\r\n\
         connection: close\r\n\r\n{body}"
    );
    stream.write_all(response.as_bytes())
}

/// Bytes of logs the toy tolerates in `dir/logs` before it refuses to start.
pub const LOG_QUOTA: u64 = 1 << 20;

/// `dir/toy.conf`, when it exists, must be readable by whoever runs the toy.
fn read_config(dir: &Path) -> anyhow::Result<()> {
    let conf = dir.join("toy.conf");
    match std::fs::read_to_string(&conf) {
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("cannot read config {}", conf.display())),
        Ok(_) => Ok(()),
    }
}

/// The reason a start refused, appended to `dir/toy.log` (best effort) and returned.
fn refuse(dir: &Path, why: String) -> anyhow::Error {
    if let Ok(mut log) = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("toy.log")) {
        let _ = writeln!(log, "toy: refusing to start: {why}");
    }
    anyhow::anyhow!(why)
}

/// Hold 127.0.0.1:`port` forever, closing every connection unanswered: a stray process
/// squatting on a service's port (scenario (b) of the SSH fault suite).
pub fn squat(port: u16) -> anyhow::Result<()> {
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, port)).with_context(|| format!("binding 127.0.0.1:{port}"))?;
    eprintln!("toy: squatting on 127.0.0.1:{port} (pid {})", std::process::id());
    for conn in listener.incoming() {
        drop(conn);
    }
    Ok(())
}

/// Append `tag`, the time (microseconds since the epoch) and a newline to `file` in one write
/// (O_APPEND: concurrent marks never interleave), then create `touch` if given: a command
/// whose every run leaves a trace, and when. It takes `hold` in all, half before its trace
/// and half after, so a worker killed while it runs may leave it with or without its effect.
pub fn mark(file: &Path, tag: &str, touch: Option<&Path>, hold: Duration) -> anyhow::Result<()> {
    sleep(hold / 2);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_micros();
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(file)?;
    f.write_all(format!("{tag} {now}\n").as_bytes())?;
    if let Some(t) = touch {
        std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(t)?;
    }
    sleep(hold / 2);
    Ok(())
}

/// Total size of the regular files directly in `dir` (0 when it does not exist).
fn logs_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
        })
        .unwrap_or(0)
}

/// Start a detached `exe toy serve` (own session, output to `dir/toy.log`) and wait until it
/// answers. Already answering: Ok, nothing started. `dir/broken` present: refuse, like a
/// service whose config does not parse. A real start clears `dir/wedged`, as a restart
/// clears a deadlock.
pub fn start(exe: &Path, port: u16, dir: &Path) -> anyhow::Result<()> {
    let broken = dir.join("broken");
    if broken.exists() {
        return Err(refuse(dir, format!("config invalid: {} present (listen address missing)", broken.display())));
    }
    if probe(port).is_some() {
        return Ok(());
    }
    if let Err(e) = read_config(dir) {
        return Err(refuse(dir, format!("{e:#}")));
    }
    // Like a service that needs log space to start: `dir/logs` over its quota refuses.
    let used = logs_size(&dir.join("logs"));
    if used > LOG_QUOTA {
        let logs = dir.join("logs");
        return Err(refuse(
            dir,
            format!("no space left for logs: {} holds {used} bytes (quota {LOG_QUOTA})", logs.display()),
        ));
    }
    match std::fs::remove_file(dir.join("wedged")) {
        Err(e) if e.kind() != ErrorKind::NotFound => return Err(e).context("clearing wedged"),
        _ => {}
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let log_path = dir.join("toy.log");
    let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path)?;
    let mut cmd = Command::new(exe);
    cmd.args(["toy", "serve", "--port", &port.to_string(), "--dir"])
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // SAFETY: setsid(2) is async-signal-safe and touches no memory of the parent. A new
    // session detaches the toy from our terminal and from the process group of whoever
    // ran `start` (pitcrew's executor kills that group at its deadline).
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| match libc::setsid() {
            -1 => Err(std::io::Error::last_os_error()),
            _ => Ok(()),
        });
    }
    let mut child = cmd.spawn().with_context(|| format!("spawning {}", exe.display()))?;
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if probe(port).is_some() {
            // Reap it whenever it exits, so a long-lived caller collects no zombies.
            std::thread::spawn(move || child.wait());
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!("toy exited during start ({status}); see {}", log_path.display());
        }
        sleep(POLL);
    }
    let _ = child.kill();
    let _ = child.wait();
    bail!("toy did not answer on 127.0.0.1:{port} within 5 s; see {}", log_path.display())
}

/// Stop the toy: SIGTERM the pid in `dir/pid`, wait up to 3 s for the port to close, then
/// SIGKILL. Ok when nothing was running.
pub fn stop(port: u16, dir: &Path) -> anyhow::Result<()> {
    let pid_path = dir.join("pid");
    let pid = std::fs::read_to_string(&pid_path).ok().and_then(|s| s.trim().parse::<i32>().ok());
    // A pid <= 1 would signal init or every process we may signal; a stale file may name
    // a pid now reused by something that is not the toy.
    let Some(pid) = pid.filter(|p| *p > 1 && is_toy(*p)) else {
        if probe(port).is_some() {
            bail!("something answers on 127.0.0.1:{port} but {} names no toy", pid_path.display());
        }
        let _ = std::fs::remove_file(&pid_path);
        return Ok(());
    };
    signal(pid, libc::SIGTERM);
    if !wait_closed(port, TERM_GRACE) {
        signal(pid, libc::SIGKILL);
        if !wait_closed(port, WAIT) {
            bail!("toy pid {pid} still answers on 127.0.0.1:{port} after SIGKILL");
        }
    }
    let _ = std::fs::remove_file(&pid_path);
    Ok(())
}

fn signal(pid: i32, sig: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions; pid > 1 was checked by the caller.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// Whether `pid` is a live `toy serve` process. Without /proc we trust the pid file.
fn is_toy(pid: i32) -> bool {
    if !Path::new("/proc/self").exists() {
        return true;
    }
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    cmdline.windows(10).any(|w| w == b"toy\0serve\0")
}

fn wait_closed(port: u16, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        if TcpStream::connect_timeout(&addr, POLL).is_err() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        sleep(POLL);
    }
}

/// The HTTP status of GET /health on 127.0.0.1:`port`, or None when nothing answers HTTP.
fn probe(port: u16) -> Option<u16> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    stream.set_write_timeout(Some(Duration::from_secs(1))).ok()?;
    stream.write_all(b"GET /health HTTP/1.0\r\nhost: 127.0.0.1\r\n\r\n").ok()?;
    let mut buf = [0u8; 64];
    let n = stream.read(&mut buf).ok()?;
    let line = String::from_utf8_lossy(&buf[..n]);
    line.strip_prefix("HTTP/1.")?.get(2..5)?.parse().ok()
}
