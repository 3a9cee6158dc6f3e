//! Secrets a command names without holding them: `{secret:NAME}` in a command's words stands
//! for the value the worker that runs it has in `PITCREW_SECRET_NAME` (or in the file
//! `PITCREW_SECRET_NAME_FILE` names, its last newline dropped). The command as planned,
//! judged, approved, stored and shown keeps the placeholder; only the words handed to the
//! program hold the value, and the value is redacted from whatever the process logs, stores
//! or publishes from then on (its output included). A value redaction could not find again
//! (under 10 bytes, or letters only) is not used.

use crate::ExecError;

use pitcrew_model::redact::PLACEHOLDER as OPEN;

/// Longest secret name.
const MAX_NAME: usize = 64;

/// Largest secret value read from a file.
const MAX_VALUE: u64 = 64 * 1024;

/// `argv` with every `{secret:NAME}` replaced by its value, each within its own word (a value
/// with spaces or quotes stays one argument). The program's own word may not hold one: what
/// runs must be what the gate judged. A name this worker has no value for runs nothing.
fn expand(argv: Vec<String>) -> Result<Vec<String>, ExecError> {
    expand_with(argv, |name| value_of(&var_of(name)))
}

/// The variable that holds secret `name`'s value on a worker.
fn var_of(name: &str) -> String {
    format!("PITCREW_SECRET_{}", name.to_ascii_uppercase())
}

/// The value `var` holds, or the file `<var>_FILE` names holds (its last newline dropped).
fn value_of(var: &str) -> Result<Option<String>, String> {
    if let Ok(value) = std::env::var(var) {
        return Ok(Some(value));
    }
    let Ok(path) = std::env::var(format!("{var}_FILE")) else { return Ok(None) };
    let read = || -> std::io::Result<Vec<u8>> {
        use std::io::Read;
        let mut bytes = Vec::new();
        std::fs::File::open(&path)?.take(MAX_VALUE + 1).read_to_end(&mut bytes)?;
        Ok(bytes)
    };
    // The file's path is not said: were a value put there by mistake, it would show.
    let bytes = read().map_err(|e| format!("the file {var}_FILE names cannot be read: {e}"))?;
    if bytes.len() as u64 > MAX_VALUE {
        return Err(format!("the file {var}_FILE names is larger than the {MAX_VALUE} bytes a secret may be"));
    }
    let text = String::from_utf8(bytes).map_err(|_| format!("the file {var}_FILE names is not UTF-8 text"))?;
    Ok(Some(text.strip_suffix('\n').map(|t| t.strip_suffix('\r').unwrap_or(t)).unwrap_or(&text).to_string()))
}

/// The secrets this worker's environment names (`PITCREW_SECRET_<NAME>`, or `..._FILE` for
/// one held in a file), each once; with `files_only`, those held in a file.
fn named(files_only: bool) -> Vec<String> {
    let mut names: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter_map(|k| {
            let name = k.strip_prefix("PITCREW_SECRET_")?;
            match name.strip_suffix("_FILE") {
                Some(file) => Some(file.to_string()),
                None => (!files_only).then(|| name.to_string()),
            }
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Redact every secret this worker holds (`PITCREW_SECRET_*`, `_FILE` ones read) from
/// everything it logs, stores or publishes from now on, expanded or not: a process list or a
/// log that shows one is then kept redacted too. Called once as the executors are made.
pub fn register_all() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for name in named(false) {
            match value_of(&var_of(&name)) {
                Ok(Some(value)) => {
                    if let Err(e) = remember(&name, &value) {
                        tracing::warn!(secret = %name, "this secret is {e}: commands that name it will not run");
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(secret = %name, error = %e, "cannot read this secret"),
            }
        }
    });
}

/// How often a worker reads its `_FILE` secrets again, at most.
const REFRESH_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Read the `_FILE` secrets again (at most every [`REFRESH_EVERY`]), so a value rotated in
/// its file, or written there after this worker started (a sidecar that fetches secrets), is
/// redacted from what this worker reads from then on, though it never runs a command that
/// names it (diagnose reads `ps`, logs and status that may show it). Called before each
/// command runs; its earlier value stays redacted for a while (see [`Held`]).
pub fn refresh() {
    static LAST: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    // Held by another thread: that one reads them now.
    let Ok(mut last) = LAST.try_lock() else { return };
    if last.is_some_and(|at| at.elapsed() < REFRESH_EVERY) {
        return;
    }
    *last = Some(std::time::Instant::now());
    for name in named(true) {
        if let Ok(Some(value)) = value_of(&var_of(&name)) {
            if let Err(e) = remember(&name, &value) {
                tracing::debug!(secret = %name, "this secret's value is {e}");
            }
        }
    }
}

/// Redact `value`, the value of secret `name` now, from then on.
fn remember(name: &str, value: &str) -> Result<(), pitcrew_model::redact::NotKept> {
    static HELD: std::sync::Mutex<Held> =
        std::sync::Mutex::new(Held { values: Vec::new(), retired: std::collections::VecDeque::new() });
    let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
    held.remember(name, value, pitcrew_model::redact::register_command_secret, pitcrew_model::redact::forget_secret)
}

/// The values of the secrets this worker fills in.
struct Held {
    /// Each secret's value now, by upper-case name.
    values: Vec<(String, String)>,
    /// Values replaced by a rotation, oldest first: still redacted (a command started with one
    /// may still print it, and a rotated credential often stays valid a while), until the room
    /// is wanted for a value in use.
    retired: std::collections::VecDeque<String>,
}

impl Held {
    fn remember(
        &mut self,
        name: &str,
        value: &str,
        register: impl Fn(&str) -> Result<(), pitcrew_model::redact::NotKept>,
        forget: impl Fn(&str),
    ) -> Result<(), pitcrew_model::redact::NotKept> {
        let key = name.to_ascii_uppercase();
        let at = self.values.iter().position(|(n, _)| *n == key);
        if at.is_some_and(|i| self.values[i].1 == value) {
            return Ok(());
        }
        // Held as the secret's value only once redaction keeps it: a value refused (too plain,
        // no room) is refused again at its next use, never used unredacted.
        loop {
            match register(value) {
                Err(pitcrew_model::redact::NotKept::Full) => match self.retired.pop_front() {
                    Some(oldest) if !self.values.iter().any(|(_, v)| *v == oldest) => forget(&oldest),
                    Some(_) => {}
                    None => return Err(pitcrew_model::redact::NotKept::Full),
                },
                Err(e) => return Err(e),
                Ok(()) => break,
            }
        }
        match at {
            Some(i) => {
                let before = std::mem::replace(&mut self.values[i].1, value.to_string());
                self.retired.push_back(before);
            }
            None => self.values.push((key, value.to_string())),
        }
        // A value in use again (rotated back) is no longer retired: never forgotten as one.
        self.retired.retain(|r| r != value);
        Ok(())
    }
}

/// The words `command` runs: split as a shell would (no shell runs it), its secrets filled
/// in, at least one.
pub fn argv_of(command: &str) -> Result<Vec<String>, ExecError> {
    refresh();
    let argv = shell_words::split(command).map_err(|e| ExecError::Parse(e.to_string()))?;
    if argv.is_empty() {
        return Err(ExecError::Empty);
    }
    // A program word that reads as an option: over SSH the remote `exec "$@"` would take it
    // as exec's own (`-- rm ...` runs rm under bash), so what runs is not what was judged.
    if argv[0].starts_with('-') {
        return Err(ExecError::Parse(format!("the program '{}' starts with '-': it would read as an option", argv[0])));
    }
    expand(argv)
}

/// [`expand`] with the values from `lookup` (None: not set; an error: set but unreadable).
fn expand_with(
    argv: Vec<String>,
    lookup: impl Fn(&str) -> Result<Option<String>, String>,
) -> Result<Vec<String>, ExecError> {
    if !argv.iter().any(|w| w.contains(OPEN)) {
        return Ok(argv);
    }
    if argv.first().is_some_and(|w| w.contains(OPEN)) {
        return Err(ExecError::Secret("a secret cannot name the program to run".into()));
    }
    let mut out = Vec::with_capacity(argv.len());
    for word in argv {
        let mut expanded = String::with_capacity(word.len());
        let mut rest = word.as_str();
        while let Some(at) = rest.find(OPEN) {
            expanded.push_str(&rest[..at]);
            let after = &rest[at + OPEN.len()..];
            let name_len = after.bytes().take_while(|b| b.is_ascii_alphanumeric() || *b == b'_').count();
            if name_len == 0 || name_len > MAX_NAME || after.as_bytes().get(name_len) != Some(&b'}') {
                return Err(ExecError::Secret(format!(
                    "`{}` is not a secret's placeholder: write {{secret:NAME}}, NAME letters, digits or _ (at most {MAX_NAME})",
                    pitcrew_model::trim::clip(&rest[at..], 80)
                )));
            }
            let name = &after[..name_len];
            if name.to_ascii_uppercase().ends_with("_FILE") {
                return Err(ExecError::Secret(format!(
                    "secret '{name}': a name may not end in _FILE (PITCREW_SECRET_<NAME>_FILE names a file holding <NAME>)"
                )));
            }
            let value = lookup(name).map_err(ExecError::Secret)?.ok_or_else(|| {
                let var = var_of(name);
                ExecError::Secret(format!(
                    "secret '{name}' is not set on this worker: set {var} (or {var}_FILE to a file holding it)"
                ))
            })?;
            if value.contains('\0') {
                return Err(ExecError::Secret(format!("secret '{name}' holds a NUL byte, which no argument can")));
            }
            // Redacted from then on, or not used: a value redaction would pass over (short,
            // letters only) would show in the command's output and everything quoting it.
            if let Err(e) = remember(name, &value) {
                return Err(ExecError::Secret(format!("secret '{name}' is {e}: it is not used")));
            }
            expanded.push_str(&value);
            rest = &after[name_len + 1..];
        }
        expanded.push_str(rest);
        out.push(expanded);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(cmd: &str) -> Vec<String> {
        shell_words::split(cmd).unwrap()
    }

    fn vault(name: &str) -> Result<Option<String>, String> {
        Ok(match name {
            "db" => Some("s3cr3t pass'word".into()),
            "token" => Some("tok-9f8e7d6c".into()),
            _ => None,
        })
    }

    #[test]
    fn a_placeholder_becomes_its_value_within_its_own_word() {
        let argv = expand_with(words("mysqladmin --password={secret:db} -h db{secret:token}x ping"), vault).unwrap();
        assert_eq!(argv, ["mysqladmin", "--password=s3cr3t pass'word", "-h", "dbtok-9f8e7d6cx", "ping"]);
        let plain = words("systemctl restart web");
        assert_eq!(expand_with(plain.clone(), vault).unwrap(), plain);
    }

    /// Over SSH the remote `exec "$@"` would take a program word starting with `-` as its
    /// own option and run the words after it: no such command runs, locally or anywhere.
    #[test]
    fn a_program_that_reads_as_an_option_runs_nothing() {
        for cmd in ["-- rm -rf /tmp/x", "-a reboot systemctl"] {
            let e = argv_of(cmd).unwrap_err();
            assert!(matches!(&e, ExecError::Parse(m) if m.contains("starts with '-'")), "{cmd}: {e}");
        }
        assert_eq!(argv_of("rm -- -f").unwrap(), ["rm", "--", "-f"]);
    }

    #[test]
    fn a_missing_or_malformed_secret_runs_nothing() {
        let missing = expand_with(words("app --key {secret:nope}"), vault).unwrap_err().to_string();
        assert!(missing.contains("secret 'nope' is not set") && missing.contains("PITCREW_SECRET_NOPE"), "{missing}");
        let malformed = expand_with(words("app --key {secret:a-b}"), vault).unwrap_err().to_string();
        assert!(malformed.contains("not a secret's placeholder"), "{malformed}");
        let program = expand_with(words("{secret:token} --version"), vault).unwrap_err().to_string();
        assert!(program.contains("cannot name the program"), "{program}");
        let short = |name: &str| Ok(Some(if name == "pin" { "4711".into() } else { "onlyletterssecret".into() }));
        for name in ["pin", "plain"] {
            let e = expand_with(words(&format!("app --key {{secret:{name}}}")), short).unwrap_err().to_string();
            assert!(e.contains("too short or plain to be redacted"), "{e}");
        }
        let file = expand_with(words("app --key {secret:key_file}"), vault).unwrap_err().to_string();
        assert!(file.contains("may not end in _FILE"), "{file}");
    }

    /// A rotated value stays redacted (a command started with it may still print it, and the
    /// old credential is often still valid): it was forgotten at once. It gives its room up
    /// only when a value in use needs it, oldest first.
    #[test]
    fn a_rotated_value_stays_redacted_until_its_room_is_wanted() {
        let first = |_: &str| Ok(Some("rotation-one-5a6b7c".to_string()));
        let second = |_: &str| Ok(Some("rotation-two-8d9e0f".to_string()));
        expand_with(words("app --key {secret:rotating}"), first).unwrap();
        expand_with(words("app --key {secret:rotating}"), second).unwrap();
        assert_eq!(pitcrew_model::redact::redact("rotation-two-8d9e0f"), "[REDACTED]");
        assert_eq!(pitcrew_model::redact::redact("rotation-one-5a6b7c"), "[REDACTED]", "still redacted");

        // Room for three values.
        use pitcrew_model::redact::NotKept;
        let kept = std::cell::RefCell::new(Vec::<String>::new());
        let register = |v: &str| {
            let mut kept = kept.borrow_mut();
            if kept.iter().any(|k| k == v) {
                return Ok(());
            }
            if kept.len() == 3 {
                return Err(NotKept::Full);
            }
            kept.push(v.to_string());
            Ok(())
        };
        let forget = |v: &str| kept.borrow_mut().retain(|k| k != v);
        let mut held = Held { values: Vec::new(), retired: Default::default() };
        for (name, value) in [("a", "a1"), ("a", "a2"), ("b", "b1"), ("a", "a3")] {
            assert_eq!(held.remember(name, value, register, forget), Ok(()), "{name}={value}");
        }
        assert_eq!(*kept.borrow(), ["a2", "b1", "a3"], "the oldest retired value gave its room up");
        // Rotated back to a value in use: that one is never given up as retired.
        assert_eq!(held.remember("a", "a2", register, forget), Ok(()));
        assert_eq!(held.remember("c", "c1", register, forget), Ok(()));
        assert_eq!(*kept.borrow(), ["a2", "b1", "c1"]);
        // With nothing retired left, a new value finds no room, at each use: it is never held
        // as the secret's value, so never used unredacted.
        for _ in 0..2 {
            assert_eq!(held.remember("d", "d1", register, forget), Err(NotKept::Full));
        }
        assert_eq!(*kept.borrow(), ["a2", "b1", "c1"], "values in use are kept");
        let plain = |_: &str| Err(NotKept::Plain);
        for _ in 0..2 {
            assert_eq!(held.remember("pin", "12345678", plain, forget), Err(NotKept::Plain));
        }
    }

    /// A file holding `value` (and a newline), named by `var` in the process's own
    /// environment, as a worker's (each test a name no other uses); the file goes with the dir.
    fn secret_file(var: &str, value: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, format!("{value}\n")).unwrap();
        std::env::set_var(var, &file);
        (dir, file)
    }

    #[test]
    fn a_value_may_come_from_a_file_and_is_redacted_from_then_on() {
        let _file = secret_file("PITCREW_SECRET_EXEC_TEST_FILED_FILE", "from-a-file-42");
        let argv = expand(words("app --password {secret:exec_test_filed}")).unwrap();
        assert_eq!(argv[2], "from-a-file-42");
        assert_eq!(pitcrew_model::redact::redact("echoed from-a-file-42 back"), "echoed [REDACTED] back");
    }

    /// A value rotated in its file is redacted from what the worker's commands read, though
    /// none of them names it (diagnose's `ps` of the service that uses it).
    #[test]
    fn a_value_rotated_in_its_file_is_redacted_before_any_command_uses_it() {
        let (_dir, file) = secret_file("PITCREW_SECRET_EXEC_TEST_ROTATED_FILE", "rotated-first-0001");
        refresh();
        std::thread::sleep(REFRESH_EVERY);
        argv_of("ps aux").unwrap();
        assert_eq!(pitcrew_model::redact::redact("app -a rotated-first-0001"), "app -a [REDACTED]");
        std::fs::write(&file, "rotated-second-0002\n").unwrap();
        std::thread::sleep(REFRESH_EVERY);
        // The next command this worker runs, whatever it is, reads the file again first.
        argv_of("ps aux").unwrap();
        assert_eq!(pitcrew_model::redact::redact("app -a rotated-second-0002"), "app -a [REDACTED]");
        assert_eq!(pitcrew_model::redact::redact("app -a rotated-first-0001"), "app -a [REDACTED]", "still");
    }
}
