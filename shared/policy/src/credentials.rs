//! Files that hold credentials: keys, password hashes, tokens, shell histories, a process's
//! environment, memory or open files. What a command shows of such a file lands in its output,
//! so in the run's timeline, in Postgres and in what the model is sent; the gate makes any
//! command that names one a human's call (the read-only class then refuses it: evidence and
//! the model never read them).
//!
//! Every word but the program is judged (an option's value after its `=` too), by its path
//! components as written, with no normalisation: `/etc//shadow`, `/etc/./shadow`,
//! `../shadow`, `-f/root/.ssh/id_rsa`, a bare `server.key` and `tar -C /etc -cf - shadow` all
//! end in or pass through a name listed here (a `..` after one errs on the side of asking).
//! Nothing runs through a shell (the SSH executor quotes each word), so no glob or `~` turns
//! a harmless word into one of these. Not seen: a path reached through a link someone made
//! (making one is a write, never read-only), a recursive read of a directory above one
//! (`grep -r x /root`), and a key file whose name says nothing (pitcrew's own SSH key is
//! wherever the inventory puts it).

/// Directories whose files are credentials, wherever they are.
const DIRECTORIES: &[&str] = &[
    ".ssh",
    ".gnupg",
    ".aws",
    ".kube",
    ".docker",
    ".azure",
    "gcloud",
    "private",
    "secrets",
    "credentials",
    "wireguard",
];

/// Files that are credentials by their name (or, with `.` after it, a name's variants:
/// `.env.production`, `credentials.toml`).
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
    "debian.cnf",
    ".vault-token",
    ".npmrc",
    ".pypirc",
    ".env",
    "credentials",
    "ipsec.secrets",
    "chap-secrets",
    "pap-secrets",
    "admin.conf",
    "super-admin.conf",
    "controller-manager.conf",
    "scheduler.conf",
    "kubelet.conf",
    "k3s.yaml",
    // k3s' join tokens (`/var/lib/rancher/k3s/server/token`), and any file called a token.
    "token",
    "node-token",
    // A container's configuration as Docker keeps it: its `Env`, secrets and all.
    "config.v2.json",
    "id_rsa",
    "id_dsa",
    "id_ecdsa",
    "id_ed25519",
    "id_ecdsa_sk",
    "id_ed25519_sk",
];

/// Names that are a credential only under `/proc` or `/dev` (as bare words they are common).
const SPECIAL_FILES: &[&str] = &["environ", "mem", "kmem", "kcore"];

/// Directories under `/proc` (or `/dev`) whose entries are links to a process's open files
/// or mappings: `/proc/<pid>/fd/7` may be a key file already open.
const OPEN_FILES: &[&str] = &["fd", "map_files"];

/// Endings of key, key-store and history files (compared without case): `server.key`,
/// `ssh_host_rsa_key`, `client.p12`, `krb5.keytab`, `.bash_history`.
const ENDINGS: &[&str] = &[".key", "_key", ".p12", ".pfx", ".jks", ".keystore", ".kdbx", ".keytab", ".ppk", "_history"];

/// The first word of `argv` after the program that names a credential file, if any.
pub(crate) fn named(argv: &[String]) -> Option<&str> {
    argv.iter().skip(1).map(String::as_str).find(|w| is_credential(w))
}

fn is_credential(word: &str) -> bool {
    // `--file=/etc/shadow`: the value is the path.
    let path = match word.split_once('=') {
        Some((option, value)) if option.starts_with('-') => value,
        _ => word,
    };
    let components: Vec<&str> = path.split('/').collect();
    let name = components.last().copied().unwrap_or_default();
    let lower = name.to_ascii_lowercase();
    let under_proc_or_dev = components.iter().any(|c| *c == "proc" || *c == "dev");
    // A directory's name alone is a word like another (`kubectl get secrets` is no path).
    (components.len() > 1 && components.iter().any(|c| DIRECTORIES.contains(c)))
        || FILES.iter().any(|f| name == *f || name.strip_prefix(f).is_some_and(|rest| rest.starts_with('.')))
        || ENDINGS.iter().any(|e| lower.ends_with(e))
        || (lower.ends_with(".pem") && lower.contains("key"))
        || (under_proc_or_dev && SPECIAL_FILES.contains(&name))
        || (under_proc_or_dev && components.iter().any(|c| OPEN_FILES.contains(c)))
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
            "tar -C /etc -cf - shadow",
            "cat /root/.ssh/id_ed25519",
            "cat -- /home/app/.ssh/config",
            "head -c 400 /etc/ssl/private/site.key",
            "cat server.key",
            "cat /etc/ssh/ssh_host_ed25519_key",
            "cat /etc/letsencrypt/live/example.com/privkey.pem",
            "cat /srv/tls/server-key.pem",
            "cat /srv/app/.env",
            "cat /srv/app/.env.production",
            "cat .pgpass",
            "cat /root/.aws/credentials",
            "cat /root/.cargo/credentials.toml",
            "cat /run/credentials/web.service/db",
            "cat /var/run/secrets/kubernetes.io/serviceaccount/token",
            "cat /etc/kubernetes/admin.conf",
            "cat /etc/kubernetes/super-admin.conf",
            "head /etc/kubernetes/controller-manager.conf",
            "cat /var/lib/rancher/k3s/server/token",
            "cat /var/lib/docker/containers/0123abcd/config.v2.json",
            "cat /etc/krb5.keytab",
            "cat /etc/wireguard/wg0.conf",
            "cat /etc/ipsec.secrets",
            "cat /etc/mysql/debian.cnf",
            "tail -n 50 /root/.bash_history",
            "cat /proc/1/mem",
            "cat /proc/kcore",
            "cat /proc/4242/fd/7",
            "cat /dev/fd/3",
            "cat /proc/1/map_files/7f00-7f01",
            "cat /opt/app/TLS.KEY",
            "cat /opt/app/keystore.p12",
            "tail -f/home/u/.git-credentials",
            "grep --file=/etc/shadow x",
            "cat /root/.ssh/../.bashrc",
        ] {
            assert!(named(&words(cmd)).is_some(), "{cmd}");
        }
        for cmd in [
            "cat /etc/hosts",
            "cat /etc/passwd",
            "ssh-keygen -l -f /etc/ssh/ssh_host_rsa_key.pub",
            "openssl x509 -noout -enddate -in /etc/letsencrypt/live/example.com/cert.pem",
            "tail -n 50 /var/log/app.log",
            "cat /proc/meminfo",
            "cat /proc/1234/status",
            "ps -o pid,%mem",
            "ps -o pid,mem",
            "cat /etc/ssl/certs/ca-certificates.crt",
            "journalctl -u web -n 50 --no-pager",
            "free -m",
            "ss -ltn",
            "df -h",
            "systemctl restart web",
            "touch /tmp/svc-healthy",
            "keydb-cli ping",
            "apt-get install -y wireguard",
        ] {
            assert_eq!(named(&words(cmd)), None, "{cmd}");
        }
    }
}
