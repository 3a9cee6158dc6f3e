//! Files that hold credentials: keys, password hashes, tokens, a process's environment or
//! memory. What a command shows of such a file lands in its output, so in the run's timeline,
//! in Postgres and in what the model is sent; the gate makes any command that names one a
//! human's call (the read-only class then refuses it: evidence and the model never read them).
//!
//! A word is read as a path when it has a `/` in it or starts with `.`, and judged by its
//! components as written, with no normalisation: `/etc//shadow`, `/etc/./shadow`, `../shadow`
//! and `-f/root/.ssh/id_rsa` all end in or pass through a name listed here (a `..` after one
//! errs on the side of asking). A path reached through a symbolic link is not seen; making one
//! is a write, which the class does not allow.

/// Directories whose files are credentials, wherever they are.
const DIRECTORIES: &[&str] = &[".ssh", ".gnupg", ".aws", ".kube", ".docker", ".azure", "gcloud", "private", "secrets"];

/// Files that are credentials (or a process's environment or memory) by their name.
const FILES: &[&str] = &[
    "shadow",
    "gshadow",
    "shadow-",
    "gshadow-",
    "opasswd",
    ".pgpass",
    ".netrc",
    ".git-credentials",
    ".my.cnf",
    ".vault-token",
    ".env",
    "credentials",
    "id_rsa",
    "id_dsa",
    "id_ecdsa",
    "id_ed25519",
    "environ",
    "mem",
    "kmem",
    "kcore",
];

/// Endings of key and key-store files (compared without case): `server.key`,
/// `ssh_host_rsa_key`, `client.p12`.
const ENDINGS: &[&str] = &[".key", "_key", ".p12", ".pfx", ".jks", ".keystore", ".kdbx"];

/// The first word of `argv` that names a credential file, if any.
pub(crate) fn named(argv: &[String]) -> Option<&str> {
    argv.iter().map(String::as_str).find(|w| is_credential(w))
}

fn is_credential(word: &str) -> bool {
    if !word.contains('/') && !word.starts_with('.') {
        return false;
    }
    let components: Vec<&str> = word.split('/').collect();
    let name = components.last().copied().unwrap_or_default();
    let lower = name.to_ascii_lowercase();
    components.iter().any(|c| DIRECTORIES.contains(c))
        || FILES.contains(&name)
        || ENDINGS.iter().any(|e| lower.ends_with(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(cmd: &str) -> Vec<String> {
        shell_words::split(cmd).unwrap()
    }

    #[test]
    fn credential_files_are_named_however_the_path_is_spelled() {
        for cmd in [
            "cat /etc/shadow",
            "cat /etc//shadow",
            "head -n 5 /etc/./gshadow",
            "tail ../../etc/shadow",
            "cat /root/.ssh/id_ed25519",
            "cat -- /home/app/.ssh/config",
            "head -c 400 /etc/ssl/private/site.key",
            "cat /etc/ssh/ssh_host_ed25519_key",
            "cat /srv/app/.env",
            "cat .pgpass",
            "cat /root/.aws/credentials",
            "cat /var/run/secrets/kubernetes.io/serviceaccount/token",
            "cat /proc/1/mem",
            "cat /proc/kcore",
            "cat /opt/app/TLS.KEY",
            "cat /opt/app/keystore.p12",
            "tail -f/home/u/.git-credentials",
            "cat /root/.ssh/../.bashrc",
        ] {
            assert!(named(&words(cmd)).is_some(), "{cmd}");
        }
        for cmd in [
            "cat /etc/hosts",
            "cat /etc/passwd",
            "ssh-keygen -l -f /etc/ssh/ssh_host_rsa_key.pub",
            "tail -n 50 /var/log/app.log",
            "cat /proc/meminfo",
            "ps -o pid,%mem",
            "cat /etc/ssl/certs/ca-certificates.crt",
            "journalctl -u web -n 50 --no-pager",
            "free -m",
        ] {
            assert_eq!(named(&words(cmd)), None, "{cmd}");
        }
    }
}
