//! The inventory: services pitcrew may remediate and how to check them. Read from config.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How to tell whether a service is healthy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum CheckSpec {
    /// GET `url`; healthy when the status equals `expect_status`.
    Http {
        url: String,
        #[serde(default = "default_status")]
        expect_status: u16,
        #[serde(default = "default_check_timeout_ms")]
        timeout_ms: u64,
    },
    /// Healthy when a TCP connection to `address` (host:port) opens.
    Tcp {
        address: String,
        #[serde(default = "default_check_timeout_ms")]
        timeout_ms: u64,
    },
    /// Run `command` on the service's host through the executor; healthy when it exits 0
    /// and, if `running_indicator` is set, its stdout contains it.
    Command {
        command: String,
        #[serde(default)]
        running_indicator: Option<String>,
        #[serde(default = "default_check_timeout_ms")]
        timeout_ms: u64,
    },
}

impl CheckSpec {
    /// What makes this check unable to tell anything (a URL without its scheme, an address
    /// without its port, no time to answer): such a check would fail on every healthy
    /// service, which the monitor and verify would take for an outage.
    pub fn problem(&self) -> Option<String> {
        let timeout = match self {
            CheckSpec::Http { url, expect_status, timeout_ms } => {
                let rest = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://"));
                let host = rest.map(|r| r.split(['/', '?', '#']).next().unwrap_or_default());
                if host.is_none_or(|h| h.is_empty() || h.contains(char::is_whitespace)) {
                    return Some(format!(
                        "url '{}' must be http:// or https:// and a host",
                        crate::trim::clip(url, 200)
                    ));
                }
                if !(100..=599).contains(expect_status) {
                    return Some(format!("expect_status ({expect_status}) must be an HTTP status, 100 to 599"));
                }
                timeout_ms
            }
            CheckSpec::Tcp { address, timeout_ms } => {
                let port = address.rsplit_once(':').filter(|(host, _)| !host.is_empty()).map(|(_, p)| p.parse::<u16>());
                if !matches!(port, Some(Ok(p)) if p > 0) {
                    return Some(format!("address '{}' must be host:port", crate::trim::clip(address, 200)));
                }
                timeout_ms
            }
            CheckSpec::Command { command, timeout_ms, .. } => {
                if command.trim().is_empty() {
                    return Some("command is empty".into());
                }
                timeout_ms
            }
        };
        (*timeout == 0).then(|| "timeout_ms must be at least 1".into())
    }
}

fn default_status() -> u16 {
    200
}
fn default_check_timeout_ms() -> u64 {
    2000
}
fn default_host() -> String {
    "local".to_string()
}
fn default_ssh_port() -> u16 {
    22
}
fn default_connect_timeout() -> u64 {
    10
}
/// Commands at once on one SSH host unless its entry says otherwise: under sshd's default
/// `MaxSessions` of 10.
pub const DEFAULT_MAX_SESSIONS: usize = 8;
fn default_max_sessions() -> usize {
    DEFAULT_MAX_SESSIONS
}
fn default_master_idle() -> u64 {
    600
}

/// A machine reached over SSH as a (usually non-root) user with sudo.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSpec {
    /// Hostname or IP address.
    pub address: String,
    #[serde(default = "default_ssh_port")]
    pub port: u16,
    pub user: String,
    /// Private key to log in with (default: the ssh client's own).
    #[serde(default)]
    pub key_file: Option<String>,
    /// The known_hosts file the host key is checked against (default: the user's).
    #[serde(default)]
    pub known_hosts: Option<String>,
    /// Accept (and remember) a host key not yet known. Off unless set for this host: an
    /// unknown key is otherwise refused.
    #[serde(default)]
    pub accept_unknown_host_key: bool,
    /// Programs known to exist on the host (skips a lookup).
    #[serde(default)]
    pub tools: Vec<String>,
    /// Programs known to be missing (e.g. `systemctl` on a host without systemd).
    #[serde(default)]
    pub lacks: Vec<String>,
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_secs: u64,
    /// Most commands running on the host at once; more wait their turn. Every command is a
    /// channel on the one connection to the host, and sshd refuses channels past its
    /// `MaxSessions` (10 unless its config says otherwise): keep this at or below it. The
    /// default, 8, also keeps an alert storm from starting hundreds of commands at once on a
    /// host that is already in trouble.
    #[serde(default = "default_max_sessions")]
    pub max_sessions: usize,
    /// How long the master connection to the host stays open with no command on it
    /// (OpenSSH's `ControlPersist`), 10 minutes unless set. The next command connects anew.
    /// A worker killed outright (SIGKILL, the OOM killer) cannot close its masters: they end
    /// by themselves this long after their last command instead of staying logged in to the
    /// host for good.
    #[serde(default = "default_master_idle")]
    pub master_idle_secs: u64,
}

impl HostSpec {
    /// How long connecting may take (OpenSSH's `ConnectTimeout`: the TCP connect, handshake and
    /// key exchange), and a command's channel to open on a live connection: at least 1 s.
    pub fn connect_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.connect_timeout_secs.max(1))
    }

    /// How long the master connection may sit with no command on it: at least 1 s.
    pub fn master_idle(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.master_idle_secs.max(1))
    }
}

/// One service pitcrew may remediate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceSpec {
    /// Inventory host name; `local` runs commands on this machine.
    #[serde(default = "default_host")]
    pub host: String,
    #[serde(default)]
    pub check: Option<CheckSpec>,
    /// Commands for hosts without a service manager (templates may use `{service}`).
    #[serde(default)]
    pub start: Option<String>,
    #[serde(default)]
    pub stop: Option<String>,
    #[serde(default)]
    pub restart: Option<String>,
    /// A file holding the service's pid, read as evidence (gives playbooks `{pid}`).
    #[serde(default)]
    pub pidfile: Option<String>,
    /// Extra template variables for playbook commands.
    #[serde(default)]
    pub vars: BTreeMap<String, String>,
    /// A log file whose last lines diagnose reads as evidence.
    #[serde(default)]
    pub log_file: Option<String>,
    /// A systemd unit whose journal diagnose reads as evidence.
    #[serde(default)]
    pub journal_unit: Option<String>,
    /// Read-only commands diagnose runs as evidence (each must pass the policy's read-only
    /// class). Default: listening ports, disk and memory headroom; `[]` runs none.
    #[serde(default)]
    pub evidence: Option<Vec<String>>,
}

/// Evidence commands when a service names none: listening ports, disk and memory headroom.
pub const DEFAULT_EVIDENCE: &[&str] = &["ss -ltn", "df -h", "free -m"];

impl ServiceSpec {
    /// Every read-only command diagnose runs for this service, in order.
    pub fn evidence_commands(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(f) = &self.log_file {
            out.push(format!("tail -n 50 {}", shell_quote(f)));
        }
        if let Some(u) = &self.journal_unit {
            out.push(format!("journalctl -u {} -n 50 --no-pager", shell_quote(u)));
        }
        match &self.evidence {
            Some(list) => out.extend(list.iter().cloned()),
            None => out.extend(DEFAULT_EVIDENCE.iter().map(|c| c.to_string())),
        }
        out
    }
}

/// Single-quote `s` for a command line unless it is plainly safe.
fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "/._-@:+=,".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

impl ServiceSpec {
    /// The TCP port the service listens on: `vars.port`, else the port of its HTTP or TCP
    /// check (an HTTP URL without one: 80, or 443 for https). None for command checks.
    pub fn port(&self) -> Option<u16> {
        if let Some(p) = self.vars.get("port") {
            return p.trim().parse().ok();
        }
        match self.check.as_ref()? {
            CheckSpec::Http { url, .. } => {
                let (scheme, rest) = url.split_once("://")?;
                let authority = rest.split(['/', '?', '#']).next()?;
                let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
                // `[::1]:8080` or `host:8080`; a bare IPv6 literal or host has no port.
                let port = match authority.strip_prefix('[') {
                    Some(v6) => v6.split_once("]:").map(|(_, p)| p),
                    None => authority.rsplit_once(':').map(|(_, p)| p),
                };
                match port {
                    Some(p) => p.parse().ok(),
                    None => match scheme.to_ascii_lowercase().as_str() {
                        "http" => Some(80),
                        "https" => Some(443),
                        _ => None,
                    },
                }
            }
            CheckSpec::Tcp { address, .. } => address.rsplit_once(':')?.1.parse().ok(),
            CheckSpec::Command { .. } => None,
        }
    }

    /// The service's own commands as the operator configured them (start, stop, restart): the
    /// policy gate trusts them with what it guards against in a model's (`trusted`).
    pub fn own_commands(&self) -> Vec<String> {
        [&self.start, &self.stop, &self.restart].into_iter().flatten().cloned().collect()
    }

    /// The template variables a playbook may use for this service: `service`, `host`,
    /// `start`, `stop`, `restart` (systemctl defaults when not configured), plus `vars`.
    pub fn template_vars(&self, service: &str) -> BTreeMap<String, String> {
        let mut v = self.vars.clone();
        v.insert("service".into(), service.to_string());
        v.insert("host".into(), self.host.clone());
        let or = |c: &Option<String>, verb: &str| c.clone().unwrap_or_else(|| format!("systemctl {verb} {service}"));
        v.insert("start".into(), or(&self.start, "start"));
        v.insert("stop".into(), or(&self.stop, "stop"));
        v.insert("restart".into(), or(&self.restart, "restart"));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_port_comes_from_vars_or_the_check() {
        let with = |check: serde_json::Value, vars: serde_json::Value| -> Option<u16> {
            let s: ServiceSpec = serde_json::from_value(serde_json::json!({ "check": check, "vars": vars })).unwrap();
            s.port()
        };
        let http = |url: &str| with(serde_json::json!({ "kind": "http", "url": url }), serde_json::json!({}));
        assert_eq!(http("http://127.0.0.1:8080/health"), Some(8080));
        assert_eq!(http("http://user:pw@web.internal:81"), Some(81));
        assert_eq!(http("https://web.internal/health"), Some(443));
        assert_eq!(http("http://web.internal?x=1:2"), Some(80));
        assert_eq!(http("http://[::1]:9000/"), Some(9000));
        assert_eq!(http("http://[::1]/"), Some(80));
        assert_eq!(http("ftp://files"), None);
        let tcp = serde_json::json!({ "kind": "tcp", "address": "db:5432" });
        assert_eq!(with(tcp.clone(), serde_json::json!({})), Some(5432));
        assert_eq!(with(tcp, serde_json::json!({ "port": "6000" })), Some(6000), "vars win");
        let cmd = serde_json::json!({ "kind": "command", "command": "true" });
        assert_eq!(with(cmd, serde_json::json!({})), None);
    }

    #[test]
    fn vars_default_to_systemctl() {
        let s = ServiceSpec {
            host: "local".into(),
            check: None,
            start: Some("/opt/web/start".into()),
            stop: None,
            restart: None,
            pidfile: None,
            vars: BTreeMap::new(),
            log_file: Some("/var/log/my web.log".into()),
            journal_unit: None,
            evidence: None,
        };
        assert_eq!(s.evidence_commands(), ["tail -n 50 '/var/log/my web.log'", "ss -ltn", "df -h", "free -m"]);
        let v = s.template_vars("web");
        assert_eq!(v["start"], "/opt/web/start");
        assert_eq!(v["restart"], "systemctl restart web");
    }
}
