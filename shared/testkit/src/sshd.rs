//! The SSH fault suite's target: a private sshd (see [`pitcrew_exec::sshd`]) that logs in
//! as a dedicated unprivileged account, `pitcrew-target`, whose sudo rule allows only what
//! the scenarios need. Setting that account up needs root (CI runs as root); anyone else
//! gets an sshd that logs in as themselves.

pub use pitcrew_exec::sshd::Sshd;

use anyhow::{bail, Context};
use std::process::Command;
use std::sync::OnceLock;

/// The dedicated login of the fault suite.
pub const TARGET_USER: &str = "pitcrew-target";

/// Where its sudo rule lives.
const SUDOERS: &str = "/etc/sudoers.d/pitcrew-target";

/// An sshd logging in as [`TARGET_USER`] when this process is root, else as the current user.
pub fn start_target() -> anyhow::Result<Sshd> {
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Sshd::start();
    }
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    READY.get_or_init(|| ensure_target_user().map_err(|e| format!("{e:#}"))).clone().map_err(anyhow::Error::msg)?;
    Sshd::start_as(TARGET_USER)
}

/// The sudo rule: `id` (to prove sudo works), `kill` (a squatter on a service's port) and
/// `chmod a+r` on files under the harness's own directories (a config that lost its read
/// permission). Nothing else, and never a password prompt.
fn sudoers() -> String {
    let harness = std::env::temp_dir().join("pitcrew-sshd-");
    format!(
        "# Written by pitcrew's test harness (shared/testkit/src/sshd.rs).\n\
         Defaults:{u} !requiretty, !lecture\n\
         {u} ALL=(root) NOPASSWD: /usr/bin/id, /usr/bin/kill, /usr/bin/chmod a+r {dir}*\n",
        u = TARGET_USER,
        dir = harness.display(),
    )
}

/// Create the account (key login only: its password is `*`, which sshd accepts for keys
/// with `UsePAM no` where a locked `!` is refused) and install its sudo rule, validated by
/// visudo first. Idempotent; safe when several test processes race.
fn ensure_target_user() -> anyhow::Result<()> {
    if Command::new("id").args(["-u", TARGET_USER]).output()?.status.success() {
        run(Command::new("usermod").args(["-p", "*", TARGET_USER]))?;
    } else {
        let made = Command::new("useradd")
            .args(["--create-home", "--shell", "/bin/sh", "--password", "*", TARGET_USER])
            .output()
            .context("useradd (package passwd)")?;
        // Another test process may have created it meanwhile.
        if !made.status.success() && !Command::new("id").args(["-u", TARGET_USER]).output()?.status.success() {
            bail!("useradd {TARGET_USER}: {}", String::from_utf8_lossy(&made.stderr).trim());
        }
    }
    if !std::path::Path::new("/usr/bin/sudo").exists() {
        bail!("sudo is not installed (scripts/dev test installs it)");
    }
    let want = sudoers();
    if std::fs::read_to_string(SUDOERS).ok().as_deref() != Some(want.as_str()) {
        // sudo ignores files in sudoers.d whose names contain a dot: the draft is inert.
        let draft = format!("{SUDOERS}.{}.draft", std::process::id());
        std::fs::write(&draft, &want)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&draft, std::fs::Permissions::from_mode(0o440))?;
        let checked = run(Command::new("visudo").args(["-c", "-q", "-f", &draft]));
        if let Err(e) = checked {
            let _ = std::fs::remove_file(&draft);
            return Err(e.context("the harness's sudo rule does not validate"));
        }
        std::fs::rename(&draft, SUDOERS)?;
    }
    Ok(())
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}
