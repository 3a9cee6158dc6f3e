//! Secrets a command names without holding them: `{secret:NAME}` in a command's words stands
//! for the value the worker that runs it has in `PITCREW_SECRET_NAME` (or in the file
//! `PITCREW_SECRET_NAME_FILE` names, its last newline dropped). The command as planned,
//! judged, approved, stored and shown keeps the placeholder; only the words handed to the
//! program hold the value, and the value is redacted from whatever the process logs, stores
//! or publishes from then on (its output included).

use crate::ExecError;

/// What a placeholder opens with.
const OPEN: &str = "{secret:";

/// Longest secret name.
const MAX_NAME: usize = 64;

/// Largest secret value read from a file.
const MAX_VALUE: u64 = 64 * 1024;

/// `argv` with every `{secret:NAME}` replaced by its value, each within its own word (a value
/// with spaces or quotes stays one argument). The program's own word may not hold one: what
/// runs must be what the gate judged. A name this worker has no value for runs nothing.
pub fn expand(argv: Vec<String>) -> Result<Vec<String>, ExecError> {
    expand_with(argv, |name| {
        let var = format!("PITCREW_SECRET_{}", name.to_ascii_uppercase());
        if let Ok(value) = std::env::var(&var) {
            return Ok(Some(value));
        }
        let Ok(path) = std::env::var(format!("{var}_FILE")) else { return Ok(None) };
        let read = || -> std::io::Result<String> {
            use std::io::Read;
            let mut text = String::new();
            std::fs::File::open(&path)?.take(MAX_VALUE).read_to_string(&mut text)?;
            Ok(text)
        };
        let text = read().map_err(|e| format!("{var}_FILE names {path}, which cannot be read: {e}"))?;
        Ok(Some(text.strip_suffix('\n').map(|t| t.strip_suffix('\r').unwrap_or(t)).unwrap_or(&text).to_string()))
    })
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
            let value = lookup(name).map_err(ExecError::Secret)?.ok_or_else(|| {
                ExecError::Secret(format!(
                    "secret '{name}' is not set on this worker: set PITCREW_SECRET_{} (or PITCREW_SECRET_{}_FILE to a file holding it)",
                    name.to_ascii_uppercase(),
                    name.to_ascii_uppercase()
                ))
            })?;
            pitcrew_model::redact::register_secret(&value);
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

    #[test]
    fn a_missing_or_malformed_secret_runs_nothing() {
        let missing = expand_with(words("app --key {secret:nope}"), vault).unwrap_err().to_string();
        assert!(missing.contains("secret 'nope' is not set") && missing.contains("PITCREW_SECRET_NOPE"), "{missing}");
        let malformed = expand_with(words("app --key {secret:a-b}"), vault).unwrap_err().to_string();
        assert!(malformed.contains("not a secret's placeholder"), "{malformed}");
        let program = expand_with(words("{secret:token} --version"), vault).unwrap_err().to_string();
        assert!(program.contains("cannot name the program"), "{program}");
    }

    #[test]
    fn a_value_may_come_from_a_file_and_is_redacted_from_then_on() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "from-a-file-42\n").unwrap();
        // The process's own environment, as a worker's: a name no other test uses.
        std::env::set_var("PITCREW_SECRET_EXEC_TEST_FILED_FILE", &file);
        let argv = expand(words("app --password {secret:exec_test_filed}")).unwrap();
        assert_eq!(argv[2], "from-a-file-42");
        assert_eq!(pitcrew_model::redact::redact("echoed from-a-file-42 back"), "echoed [REDACTED] back");
    }
}
