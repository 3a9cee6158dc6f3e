//! Typed settings: embedded defaults, then `pitcrew.toml`, then `DATABASE_URL` and `PITCREW_*`.

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use pitcrew_model::{HostSpec, ServiceSpec, Stage};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Everything a pitcrew process reads at start-up.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Subject prefix (streams are named from it too).
    pub prefix: String,
    /// Worker identity in events and executions; default host:pid.
    pub worker_name: Option<String>,
    pub nats: NatsConfig,
    pub database: DatabaseConfig,
    pub limits: Limits,
    /// Defaults for every stage's consumer.
    pub stages: StageDefaults,
    /// Per-stage overrides, keyed by stage name.
    pub stage: BTreeMap<String, StageOverride>,
    pub reasoning: ReasoningConfig,
    pub policy: PolicyConfig,
    pub verify: VerifyConfig,
    pub monitor: MonitorConfig,
    /// The inventory: hosts reached over SSH (services on `local` run on this machine).
    pub hosts: BTreeMap<String, HostSpec>,
    /// The inventory: services pitcrew may remediate.
    pub services: BTreeMap<String, ServiceSpec>,
    /// Who may decide approvals: name -> role (`approver` or `admin`). A decision from
    /// anyone else is refused and changes nothing.
    pub approvers: BTreeMap<String, String>,
    pub metrics: MetricsConfig,
    /// `[telemetry]`: OpenTelemetry trace export (off unless `otlp_endpoint` is set).
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    /// `[gateway]`: the HTTP API (`pitcrew gateway`).
    #[serde(default)]
    pub gateway: GatewayConfig,
    /// `[bridge.*]`: chat bridges carrying approval requests to people and decisions back.
    #[serde(default)]
    pub bridge: BridgeConfig,
    /// `[exec]`: how commands run on this machine.
    #[serde(default)]
    pub exec: ExecConfig,
}

/// `[exec]`: commands run on this machine (`local` services) inherit only a few variables of
/// pitcrew's environment (`pitcrew_exec::local::INHERITED`: the path, the user, the locale,
/// TLS trust and proxies), never its secrets; a check or start script that needs more
/// (`JAVA_HOME`, `KUBECONFIG`, `DOCKER_HOST`) names them here.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ExecConfig {
    pub pass_env: Vec<String>,
}

/// `[telemetry]`: where spans go. Off by default; an unreachable collector never stops
/// pitcrew (it warns once and drops spans until the collector answers).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// OTLP/HTTP collector, e.g. `http://127.0.0.1:4318` (`/v1/traces` is added unless the
    /// URL already ends with it). Unset: no export (traceparent headers still flow through).
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans.
    pub service_name: String,
    /// Fraction of new traces sampled (a continued trace follows its parent's decision).
    pub sample_ratio: f64,
    /// Per export request.
    pub export_timeout_secs: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            service_name: "pitcrew".into(),
            sample_ratio: 1.0,
            export_timeout_secs: 10,
        }
    }
}

/// `[gateway]`: the HTTP API, its keys and how Alertmanager labels map to incidents.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    /// `host:port` the gateway listens on.
    pub listen: String,
    /// Largest request body accepted; larger ones get 413.
    pub body_limit_bytes: usize,
    /// Largest Alertmanager notification accepted (one group's alerts, about 1 KB each; a
    /// notification refused with 413 is never sent again, whatever it holds).
    pub alertmanager_body_limit_bytes: usize,
    /// Requests per second each key may make on average (a token bucket refilled at this rate).
    pub rate_per_sec: f64,
    /// Requests a key may make at once before the rate applies.
    pub rate_burst: u32,
    /// Events buffered per live stream client; a client that falls this far behind is dropped.
    pub sse_buffer: usize,
    /// Live streams one key may hold open at once (of the gateway's 1024): a dashboard that
    /// leaks connections, or one key's owner, cannot take them all.
    pub streams_per_key: usize,
    /// Alert labels tried in order for the incident's service (`service`, then `job`).
    pub service_labels: Vec<String>,
    /// Alert labels tried in order for the incident's host; a trailing `:port` is dropped.
    pub host_labels: Vec<String>,
    /// API keys by owner name. Only the SHA-256 of each key is stored; the owner is who
    /// decides approvals made with it (and must then be under `[approvers]`).
    pub keys: BTreeMap<String, ApiKey>,
}

/// One API key: its role and the hex SHA-256 of the key (`pitcrew gateway hash-key`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// `readonly`, `operator`, `approver` or `admin`.
    pub role: String,
    /// Hex SHA-256 of the key: the key itself is never stored.
    pub sha256: String,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: "127.0.0.1:8088".into(),
            body_limit_bytes: 256 * 1024,
            alertmanager_body_limit_bytes: 4 << 20,
            rate_per_sec: 20.0,
            rate_burst: 40,
            sse_buffer: 256,
            streams_per_key: 64,
            service_labels: vec!["service".into(), "job".into()],
            host_labels: vec!["host".into(), "instance".into()],
            keys: BTreeMap::new(),
        }
    }
}

/// `[bridge]`: the chat bridges (`pitcrew bridge <kind>`), each off until configured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeConfig {
    /// `[bridge.slack]`: `pitcrew bridge slack` (any Slack-compatible Web API).
    pub slack: Option<SlackConfig>,
    /// `[bridge.mattermost]`: `pitcrew bridge mattermost` (Mattermost's REST API v4).
    pub mattermost: Option<MattermostConfig>,
}

/// `[bridge.mattermost]`: where requests are posted, the URL Mattermost calls back, who is who.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MattermostConfig {
    /// The server (`POST {url}/api/v4/posts`).
    pub url: String,
    /// The channel id requests are posted to.
    pub channel_id: String,
    /// The variable holding the bot's access token.
    pub token_env: String,
    /// The variable holding the secret the buttons' context is signed with (Mattermost does
    /// not sign its calls: each button carries an HMAC of its run, plan and action instead).
    pub action_secret_env: String,
    /// `host:port` of the action endpoint (`POST /mattermost/actions`).
    pub listen: String,
    /// How Mattermost reaches that endpoint: buttons call `{public_url}/mattermost/actions`.
    pub public_url: String,
    /// Mattermost user id -> approver name (which must be under `[approvers]`).
    pub users: BTreeMap<String, String>,
    /// The addresses (IPs or CIDR blocks) action calls are taken from: Mattermost signs
    /// nothing, so the clicker's user id is only the caller's word. Empty: this machine only
    /// (and then `listen` must be a loopback address).
    pub allow_from: Vec<String>,
    pub durable: String,
    pub concurrency: usize,
    pub timeout_secs: u64,
}

impl Default for MattermostConfig {
    fn default() -> Self {
        MattermostConfig {
            url: String::new(),
            channel_id: String::new(),
            token_env: "MATTERMOST_TOKEN".into(),
            action_secret_env: "MATTERMOST_ACTION_SECRET".into(),
            listen: "127.0.0.1:3001".into(),
            public_url: String::new(),
            users: BTreeMap::new(),
            allow_from: Vec::new(),
            durable: "mattermost-bridge".into(),
            concurrency: 4,
            timeout_secs: 10,
        }
    }
}

/// `[bridge.slack]`: where requests are posted, where Slack calls back, and who is who.
/// The secrets themselves are never in the config: it names the variables holding them.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SlackConfig {
    /// The Web API base (`chat.postMessage` and `chat.update` are called under it).
    pub api_url: String,
    /// The channel id (or name) requests are posted to.
    pub channel: String,
    /// The variable holding the bot token (`xoxb-...`).
    pub token_env: String,
    /// The variable holding the app's signing secret (verifies Slack's callbacks).
    pub signing_secret_env: String,
    /// Post through an incoming webhook instead of `chat.postMessage`: the variable holding
    /// its URL (a secret). The bot token is then optional; without it a decided message is
    /// replaced through the interaction's `response_url`.
    pub webhook_url_env: Option<String>,
    /// `host:port` of the interactivity endpoint (`POST /slack/interactions`).
    pub listen: String,
    /// Slack user id -> approver name (which must be under `[approvers]`).
    pub users: BTreeMap<String, String>,
    /// The durable consumer of approval requests: a restarted bridge resumes where it stopped.
    pub durable: String,
    /// Requests posted at once.
    pub concurrency: usize,
    /// Per Slack API call.
    pub timeout_secs: u64,
}

impl Default for SlackConfig {
    fn default() -> Self {
        SlackConfig {
            api_url: "https://slack.com/api".into(),
            channel: String::new(),
            token_env: "SLACK_BOT_TOKEN".into(),
            signing_secret_env: "SLACK_SIGNING_SECRET".into(),
            webhook_url_env: None,
            listen: "127.0.0.1:3000".into(),
            users: BTreeMap::new(),
            durable: "slack-bridge".into(),
            concurrency: 4,
            timeout_secs: 10,
        }
    }
}

/// `[metrics]`: the Prometheus endpoint of each worker, gateway, monitor and bridge process.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// `host:port` to serve `GET /metrics` on (off when unset).
    pub listen: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    pub url: String,
    /// Give up connecting at start-up after this long.
    pub connect_timeout_secs: u64,
    /// Where replies to this process come back (`<prefix>.<id>`: stream acks, API answers,
    /// the messages its pulls take). Under per-user permissions give each user its own
    /// (`_INBOX_crew`, deploy/nats.conf): with one shared `_INBOX.>` every user may read what
    /// the crew pulls from the stage stream.
    #[serde(default = "default_inbox_prefix")]
    pub inbox_prefix: String,
}

fn default_inbox_prefix() -> String {
    "_INBOX".into()
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// May hold a password: never logged as is (see `redact_url`).
    pub url: String,
    pub pool_size: usize,
    /// Apply migrations when a worker starts.
    pub migrate_on_start: bool,
    /// A statement running longer than this is cancelled by Postgres (0: never), so a stuck
    /// query fails the step (retried later) instead of holding its run. Migrations are exempt.
    pub statement_timeout_secs: u64,
}

/// Most remediation attempts (`limits.max_retries`) and plans per attempt
/// (`limits.max_attempts`): each leaves its diagnosis, flags and commands in the run state.
pub const MAX_TRIES: u32 = 10;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Remediation attempts before escalation (verify failures).
    pub max_retries: u32,
    /// Plans evaluated per attempt (1 + regenerations) before escalation.
    pub max_attempts: u32,
    pub command_timeout_secs: u64,
    /// Bytes of stdout and of stderr captured per command.
    pub max_output_bytes: usize,
    /// An approval undecided this long escalates its run.
    pub approval_timeout_secs: u64,
    /// How far back episodic memory looks for failed commands.
    pub memory_window_secs: u64,
    /// How long execute waits while another run executes or verifies a plan on the same
    /// service and host (one remediation at a time on a target) before escalating.
    pub target_wait_secs: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageDefaults {
    /// Messages handled at once per process per stage. A stage that waits on a model wants
    /// as many as the runs it should hold in flight (`[stage.diagnose]`, `[stage.plan]`);
    /// one that only uses the CPU does best with a few dozen: more at once only shares the
    /// cores among more runs, so each of them waits longer for its hand-over.
    pub concurrency: usize,
    /// JetStream redelivers a message not acked within this (progress acks extend it).
    pub ack_wait_secs: u64,
    /// Unacked messages the server lets the consumer hold, across all processes.
    pub max_ack_pending: i64,
    /// A message delivered more often than this, and first published longer than
    /// `poison_after_secs` ago, is dead-lettered when its next try fails too; never while
    /// Postgres is unreachable (an outage is waited out, however long).
    pub max_deliveries: u64,
    pub poison_after_secs: u64,
    /// On SIGTERM a worker stops pulling and gives the messages in hand this long to finish
    /// (execute starts no command that might outlast it: the rest of the plan goes to another
    /// worker); it then stops what is left and hands those messages back for another worker
    /// at once (0: at once). Keep it a few seconds below the time the supervisor allows before
    /// SIGKILL (`stop_grace_period`, `terminationGracePeriodSeconds`); at least
    /// `limits.command_timeout_secs` + 10, a restart never cuts a command short.
    pub drain_secs: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageOverride {
    pub concurrency: Option<usize>,
    pub ack_wait_secs: Option<u64>,
    pub max_ack_pending: Option<i64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReasoningConfig {
    /// `playbook` (offline, the default) or `openai` (any OpenAI-compatible endpoint; the
    /// playbook stays the fallback for unusable answers).
    pub provider: String,
    /// User rules, checked before the shipped ones.
    pub playbook_file: Option<PathBuf>,
    /// `[reasoning.openai]`: endpoint, models, key variable, limits.
    #[serde(default)]
    pub openai: pitcrew_llm::OpenAiConfig,
    /// `[reasoning.tools]`: read-only tools beyond `run_command` a model may call while
    /// diagnosing, each only when configured.
    #[serde(default)]
    pub tools: ToolsConfig,
    /// Evaluate also asks the provider to judge each diagnosis and plan (the openai provider
    /// can; a judge that scores below 0.5 sends the plan back with its reason).
    #[serde(default)]
    pub judge: bool,
    /// When the provider has been unreachable (timeouts, 5xx, rate limits) for a step that
    /// has been trying this long, the offline playbook answers that step instead, so an
    /// outage of the model does not hold every incident until its step's limits escalate it
    /// (an hour by default); a model still at work on the step then (slow, a long tool loop)
    /// is cut off, and the playbook answers too (a judge is not consulted), each delivery
    /// giving it at least a minute (`Cx::playbook_at`). 0: never; the step keeps retrying.
    #[serde(default = "default_playbook_after_secs")]
    pub playbook_after_secs: u64,
}

fn default_playbook_after_secs() -> u64 {
    300
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ToolsConfig {
    /// `http_probe`: GET a URL whose host is in the inventory (service checks, [hosts]), on
    /// the port of a service's check there or on one of `http_probe_ports`: not any port of
    /// those hosts (an admin API on the same machine, Consul's or Docker's, answers a GET
    /// with secrets).
    pub http_probe: bool,
    /// Ports `http_probe` may reach on every inventory host, besides its checks' own.
    pub http_probe_ports: Vec<u16>,
    /// `prometheus_query`: PromQL instant and range queries against this Prometheus.
    pub prometheus_url: Option<String>,
    /// `loki_query`: LogQL queries against this Loki.
    pub loki_url: Option<String>,
    /// Per tool call.
    pub timeout_secs: u64,
}

impl Default for ToolsConfig {
    fn default() -> Self {
        ToolsConfig {
            http_probe: false,
            http_probe_ports: vec![80, 443],
            prometheus_url: None,
            loki_url: None,
            timeout_secs: 10,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// User rules added to the shipped policy.
    pub file: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyConfig {
    /// Health checks made before declaring the service still down (the first at once after
    /// the plan, then one each `interval_ms`; the first healthy one ends them). The defaults
    /// give a fix 27 s to show: most services bind their port seconds after their restart
    /// returns, and a fix judged too early is recorded as failed and not tried again.
    pub checks: u32,
    pub interval_ms: u64,
    /// Healthy checks in a row, `interval_ms` apart, before the service counts as recovered:
    /// more than 1 holds a fix to a service that stays up (one that starts, answers once and
    /// falls over again is not recovered). A run of healthy checks begun within `checks`
    /// is always seen through.
    #[serde(default = "one")]
    pub healthy_checks: u32,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MonitorConfig {
    /// Time between rounds of checks.
    pub interval_ms: u64,
    /// A service still down is reported again this often (intake deduplicates while its
    /// run is open); at once when the run of its outage resolved (a relapse).
    pub realert_secs: u64,
    /// Failed checks in a row before a service is reported down (1: the first): one lost
    /// connection or slow answer opens no incident, and no remediation of a healthy service.
    pub failures_before_incident: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            prefix: "pitcrew".into(),
            worker_name: None,
            nats: NatsConfig {
                url: "nats://127.0.0.1:4222".into(),
                connect_timeout_secs: 5,
                inbox_prefix: default_inbox_prefix(),
            },
            database: DatabaseConfig {
                url: "postgres://postgres@127.0.0.1:5432/pitcrew".into(),
                pool_size: 16,
                migrate_on_start: true,
                statement_timeout_secs: 30,
            },
            limits: Limits {
                max_retries: 5,
                max_attempts: 3,
                command_timeout_secs: 60,
                max_output_bytes: 64 * 1024,
                approval_timeout_secs: 3600,
                memory_window_secs: 86_400,
                target_wait_secs: 900,
            },
            stages: StageDefaults {
                concurrency: 32,
                ack_wait_secs: 30,
                max_ack_pending: 1024,
                max_deliveries: 20,
                poison_after_secs: 3600,
                drain_secs: 20,
            },
            stage: BTreeMap::new(),
            reasoning: ReasoningConfig {
                provider: "playbook".into(),
                playbook_file: None,
                openai: pitcrew_llm::OpenAiConfig::default(),
                tools: ToolsConfig::default(),
                judge: false,
                playbook_after_secs: default_playbook_after_secs(),
            },
            policy: PolicyConfig { file: None },
            verify: VerifyConfig { checks: 10, interval_ms: 3000, healthy_checks: 1 },
            monitor: MonitorConfig { interval_ms: 30_000, realert_secs: 3600, failures_before_incident: 2 },
            hosts: BTreeMap::new(),
            services: BTreeMap::new(),
            approvers: BTreeMap::new(),
            metrics: MetricsConfig::default(),
            gateway: GatewayConfig::default(),
            bridge: BridgeConfig::default(),
            telemetry: TelemetryConfig::default(),
            exec: ExecConfig::default(),
        }
    }
}

/// Roles that may decide approvals.
pub const APPROVER_ROLES: &[&str] = &["approver", "admin"];

impl Config {
    /// The configured approvers' names, sorted.
    pub fn approver_names(&self) -> Vec<String> {
        self.approvers.keys().cloned().collect()
    }

    /// Why `name` may not decide approvals, or None when `[approvers]` lists them.
    pub fn refuse_approver(&self, name: &str) -> Option<String> {
        if self.approvers.contains_key(name) {
            return None;
        }
        Some(if self.approvers.is_empty() {
            format!("{name} is not a configured approver (no [approvers] are configured: add `{name} = \"approver\"`)")
        } else {
            format!("{name} is not a configured approver")
        })
    }
}

impl SlackConfig {
    fn validate(&self, cfg: &Config) -> Result<(), String> {
        if self.channel.trim().is_empty() && self.webhook_url_env.is_none() {
            return Err("[bridge.slack] channel is required: the channel id requests are posted to \
                        (or webhook_url_env, to post through an incoming webhook)"
                .into());
        }
        check_bridge("slack", &[("api_url", &self.api_url)], &self.durable, self.concurrency, &self.users, cfg)
    }
}

impl MattermostConfig {
    /// Where action calls are taken from (`allow_from`, checked against `listen`).
    pub fn sources(&self) -> Result<crate::sources::Sources, String> {
        crate::sources::Sources::parse(&self.allow_from, &self.listen, "[bridge.mattermost] allow_from")
    }

    fn validate(&self, cfg: &Config) -> Result<(), String> {
        if self.channel_id.trim().is_empty() {
            return Err("[bridge.mattermost] channel_id is required: the channel requests are posted to".into());
        }
        self.sources()?;
        let urls = [("url", self.url.as_str()), ("public_url", self.public_url.as_str())];
        check_bridge("mattermost", &urls, &self.durable, self.concurrency, &self.users, cfg)
    }
}

/// What every `[bridge.<kind>]` needs: http(s) URLs, a durable name NATS accepts, and users
/// who are configured approvers.
fn check_bridge(
    kind: &str,
    urls: &[(&str, &str)],
    durable: &str,
    concurrency: usize,
    users: &BTreeMap<String, String>,
    cfg: &Config,
) -> Result<(), String> {
    for (key, url) in urls {
        if !url.starts_with("http://") && !url.starts_with("https://") {
            // Without its scheme a proxy's `user:password@` reads as no URL's: hidden whole.
            let shown = pitcrew_model::redact::url_shown(url);
            return Err(format!("[bridge.{kind}] {key} '{shown}' must be an http(s) URL"));
        }
    }
    if durable.is_empty() || !durable.chars().all(name_char) {
        return Err(format!("[bridge.{kind}] durable '{durable}' must be letters, digits, '-' or '_'"));
    }
    if concurrency == 0 {
        return Err(format!("[bridge.{kind}] concurrency must be at least 1"));
    }
    for (user, approver) in users {
        if !cfg.approvers.contains_key(approver) {
            return Err(format!("[bridge.{kind}.users] {user} = \"{approver}\": {approver} is not under [approvers]"));
        }
    }
    Ok(())
}

/// The config could not be read; the message names the file or variable.
#[derive(Debug, thiserror::Error)]
#[error("bad configuration: {0}")]
pub struct ConfigError(String);

/// Resolved consumer settings for one stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageSettings {
    pub concurrency: usize,
    pub ack_wait: Duration,
    pub max_ack_pending: i64,
    pub max_deliveries: u64,
    pub poison_after: Duration,
}

/// A document that did not parse: its error may quote the line it stumbled on, a password
/// and all (`url = "postgres://app:pa\ss@db/x"`, an invalid escape), and goes to stderr.
fn unreadable(e: figment::Error) -> ConfigError {
    ConfigError(pitcrew_model::redact::redact(&redact_urls_in(&e.to_string())).into_owned())
}

/// `text` with every URL it quotes shown as `redact_url` shows it (a Postgres password may
/// hold `/`, which the general patterns stop at): for errors of libraries that quote the URL
/// they were given.
pub fn redact_urls_in(text: &str) -> String {
    static URL: std::sync::LazyLock<regex::Regex> =
        std::sync::LazyLock::new(|| regex::Regex::new(r#"(?i)[a-z][a-z0-9+.-]*://[^\s"']+"#).expect("url pattern"));
    URL.replace_all(text, |c: &regex::Captures<'_>| redact_url(&c[0])).into_owned()
}

/// A character of the names pitcrew puts in subjects, stream and consumer names and SQL
/// identifiers (a prefix, an inbox, a durable, a database): ASCII letters, digits, `-`, `_`.
pub(crate) fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

/// Longest `limits.approval_timeout_secs`: 30 days (the approvals stream keeps requests 90).
pub const MAX_APPROVAL_TIMEOUT_SECS: u64 = 30 * 24 * 3600;

/// Most messages one process handles at once for one stage.
pub const MAX_STAGE_CONCURRENCY: usize = 65_536;

/// The most `[limits] max_output_bytes` may keep of each of a command's outputs.
pub const MAX_OUTPUT_BYTES: usize = 16 << 20;

/// Longest ack wait a stage may set.
pub const MAX_ACK_WAIT_SECS: u64 = 86_400;

/// `PITCREW_*` variables that are not config keys (read elsewhere).
const NOT_CONFIG: &[&str] = &[
    "log",
    "log_format",
    "config",
    "nats_server",
    "alertmanager",
    "test_database_url",
    "test_tied_helper",
    "test_keep",
    "bless",
];

/// A variable Kubernetes sets for every Service in the namespace (`enableServiceLinks`): a
/// Service called `pitcrew-gateway` gives every pod `PITCREW_GATEWAY_SERVICE_HOST`,
/// `PITCREW_GATEWAY_PORT_8088_TCP_ADDR` and the like, which no config key is named after.
/// Read as config, each would stop every pitcrew process with "unknown field".
fn service_link(name: &str) -> bool {
    // `name` without `PITCREW_`, lower case: a Service called `pitcrew` gives `service_host`
    // and `port`, one called `pitcrew-gateway-service` `gateway_service_service_host`.
    static LINK: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(
            r"(^|_)(service_host|service_port(_[a-z0-9_]+)?|port(_[0-9]+_(tcp|udp|sctp)(_(addr|port|proto))?)?)$",
        )
        .expect("service link pattern")
    });
    !name.contains("__") && LINK.is_match(name)
}

/// Short env names for the settings people change most.
const ENV_ALIASES: &[(&str, &str)] = &[
    ("nats_url", "nats.url"),
    ("database_url", "database.url"),
    ("max_retries", "limits.max_retries"),
    ("max_attempts", "limits.max_attempts"),
    ("concurrency", "stages.concurrency"),
    ("playbook_file", "reasoning.playbook_file"),
    ("policy_file", "policy.file"),
];

impl Config {
    /// Defaults, then `file` (if given it must exist; else `./pitcrew.toml` if present), then
    /// `DATABASE_URL`, then `PITCREW_*` (`PITCREW_NATS_URL`, or any key as `PITCREW_LIMITS__MAX_RETRIES`).
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        let mut fig = Figment::from(Serialized::defaults(Config::default()));
        match file {
            Some(p) if !p.exists() => return Err(ConfigError(format!("config file {} does not exist", p.display()))),
            Some(p) => fig = fig.merge(Toml::file(p)),
            None if Path::new("pitcrew.toml").exists() => fig = fig.merge(Toml::file("pitcrew.toml")),
            None => {}
        }
        fig = fig.merge(Env::raw().only(&["database_url"]).map(|_| "database.url".into())).merge(
            Env::prefixed("PITCREW_").filter_map(|k| {
                let k = k.as_str().to_ascii_lowercase();
                // `PITCREW_SECRET_<NAME>`: the values of commands' `{secret:NAME}` (pitcrew_exec::secrets).
                if NOT_CONFIG.contains(&k.as_str()) || service_link(&k) || k.starts_with("secret_") {
                    return None;
                }
                let key = ENV_ALIASES
                    .iter()
                    .find(|(a, _)| *a == k)
                    .map(|(_, to)| to.to_string())
                    .unwrap_or_else(|| k.replace("__", "."));
                Some(key.into())
            }),
        );
        let cfg: Config = fig.extract().map_err(unreadable)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parse a TOML document over the defaults (no environment): for tests and the demo.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let cfg: Config = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string(text))
            .extract()
            .map_err(unreadable)?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError(m));
        if self.prefix.is_empty() || !self.prefix.chars().all(name_char) {
            return bad(format!("prefix '{}' must be letters, digits, '-' or '_'", self.prefix));
        }
        // Each attempt and each plan sent back leaves its diagnosis, flags and commands in the
        // run state, which travels with every message and is refused past its size cap.
        if !(1..=MAX_TRIES).contains(&self.limits.max_retries) || !(1..=MAX_TRIES).contains(&self.limits.max_attempts) {
            return bad(format!(
                "limits.max_retries ({}) and limits.max_attempts ({}) must be 1 to {MAX_TRIES}: more attempts \
                 than that are for a human to decide",
                self.limits.max_retries, self.limits.max_attempts
            ));
        }
        let inbox = &self.nats.inbox_prefix;
        if inbox.is_empty() || inbox.len() > 64 || !inbox.chars().all(name_char) {
            return bad(format!("nats.inbox_prefix '{inbox}' must be 1-64 letters, digits, '_' or '-'"));
        }
        if !(1..=MAX_APPROVAL_TIMEOUT_SECS).contains(&self.limits.approval_timeout_secs) {
            return bad(format!(
                "limits.approval_timeout_secs ({}) must be 1 to {MAX_APPROVAL_TIMEOUT_SECS} (30 days): an approval \
                 nobody decides in that long is for escalation",
                self.limits.approval_timeout_secs
            ));
        }
        if !(1..=MAX_OUTPUT_BYTES).contains(&self.limits.max_output_bytes) {
            return bad(format!(
                "limits.max_output_bytes ({}) must be 1 to {MAX_OUTPUT_BYTES} (16 MiB): it is kept of each of a \
                 command's outputs, in memory, in the run state and in its events",
                self.limits.max_output_bytes
            ));
        }
        if !(1..=100).contains(&self.verify.healthy_checks) {
            return bad(format!("verify.healthy_checks ({}) must be 1 to 100", self.verify.healthy_checks));
        }
        if self.monitor.interval_ms == 0 || self.verify.interval_ms == 0 {
            return bad("monitor.interval_ms and verify.interval_ms must be at least 1".into());
        }
        if !(1..=100).contains(&self.monitor.failures_before_incident) {
            return bad(format!(
                "monitor.failures_before_incident ({}) must be 1 to 100",
                self.monitor.failures_before_incident
            ));
        }
        if self.stages.concurrency == 0 || self.database.pool_size == 0 {
            return bad("stages.concurrency and database.pool_size must be at least 1".into());
        }
        for name in self.stage.keys() {
            if name.parse::<Stage>().is_err() {
                return bad(format!("[stage.{name}]: unknown stage"));
            }
        }
        // Past these, a number stops meaning what it says: NATS takes the ack wait in
        // nanoseconds as an i64 (18446744074 s arrives as 0.29 s), and tokio's semaphore
        // panics above `usize::MAX >> 3` permits.
        let scopes =
            std::iter::once(("stages".to_string(), Some(self.stages.concurrency), Some(self.stages.ack_wait_secs)))
                .chain(self.stage.iter().map(|(name, o)| (format!("stage.{name}"), o.concurrency, o.ack_wait_secs)));
        for (scope, concurrency, ack_wait) in scopes {
            if let Some(c) = concurrency.filter(|c| *c > MAX_STAGE_CONCURRENCY) {
                return bad(format!("[{scope}] concurrency ({c}) must be at most {MAX_STAGE_CONCURRENCY}"));
            }
            if let Some(w) = ack_wait.filter(|w| *w > MAX_ACK_WAIT_SECS) {
                return bad(format!(
                    "[{scope}] ack_wait_secs ({w}) must be at most {MAX_ACK_WAIT_SECS} (a day): a step holding \
                     its message longer sends progress acks, whatever this is"
                ));
            }
        }
        for (name, host) in &self.hosts {
            if host.max_sessions == 0 {
                return bad(format!("[hosts.{name}]: max_sessions must be at least 1"));
            }
            // OpenSSH reads a `ControlPersist` of 0 as "forever": the leak this limit is for.
            if !(1..=86_400).contains(&host.master_idle_secs) {
                return bad(format!("[hosts.{name}]: master_idle_secs ({}) must be 1 to 86400", host.master_idle_secs));
            }
        }
        for (name, svc) in &self.services {
            if !pitcrew_exec::local::is_local(&svc.host) && !self.hosts.contains_key(&svc.host) {
                return bad(format!("[services.{name}]: host '{}' is not under [hosts]", svc.host));
            }
            if let Some(problem) = svc.check.as_ref().and_then(|c| c.problem()) {
                return bad(format!("[services.{name}] check: {problem}"));
            }
        }
        for name in self.services.keys() {
            // An incident for any other name is refused, so such a service could never be
            // remediated (the monitor would report it every round, to be refused every time).
            if !pitcrew_model::incident::valid_service_name(name) {
                return bad(format!(
                    "[services.\"{}\"]: a service name is 1-128 characters of letters, digits, '.', '_' or '-'",
                    pitcrew_model::trim::clip(name, 64)
                ));
            }
        }
        for (name, role) in &self.approvers {
            // A decision's `by` is kept to that length: a longer name could never decide.
            if name.len() > pitcrew_model::approval::MAX_DECIDER {
                return bad(format!(
                    "[approvers] \"{}\": a name is at most {} bytes",
                    pitcrew_model::trim::clip(name, 64),
                    pitcrew_model::approval::MAX_DECIDER
                ));
            }
            if !APPROVER_ROLES.contains(&role.as_str()) {
                return bad(format!("[approvers] {name} = \"{role}\": the role must be one of {APPROVER_ROLES:?}"));
            }
        }
        if let Some(slack) = &self.bridge.slack {
            slack.validate(self).map_err(ConfigError)?;
        }
        if let Some(mm) = &self.bridge.mattermost {
            mm.validate(self).map_err(ConfigError)?;
        }
        if !["playbook", "openai"].contains(&self.reasoning.provider.as_str()) {
            return bad(format!(
                "reasoning.provider '{}' is not available (this build has: playbook, openai)",
                self.reasoning.provider
            ));
        }
        if !(0.0..=1.0).contains(&self.telemetry.sample_ratio) {
            return bad(format!("telemetry.sample_ratio = {} must be between 0 and 1", self.telemetry.sample_ratio));
        }
        Ok(())
    }

    /// Consumer settings of `stage`: its override, else the defaults.
    pub fn stage_settings(&self, stage: Stage) -> StageSettings {
        let o = self.stage.get(stage.as_str()).cloned().unwrap_or_default();
        StageSettings {
            concurrency: o.concurrency.unwrap_or(self.stages.concurrency).max(1),
            ack_wait: Duration::from_secs(o.ack_wait_secs.unwrap_or(self.stages.ack_wait_secs).max(1)),
            max_ack_pending: o.max_ack_pending.unwrap_or(self.stages.max_ack_pending),
            max_deliveries: self.stages.max_deliveries.max(1),
            poison_after: Duration::from_secs(self.stages.poison_after_secs),
        }
    }

    /// This process's name in events and execution records.
    pub fn worker(&self) -> String {
        self.worker_name.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| "localhost".into());
            format!("{host}:{}", std::process::id())
        })
    }

    pub fn command_timeout(&self) -> Duration {
        Duration::from_secs(self.limits.command_timeout_secs.max(1))
    }

    /// How long a stopping worker lets the messages in hand finish (`stages.drain_secs`).
    pub fn drain(&self) -> Duration {
        Duration::from_secs(self.stages.drain_secs)
    }
}

/// `postgres://user:secret@host/db` → `postgres://user:***@host/db`, for logs and errors; in a
/// NATS URL every server of a list, and a token (`nats://token@host`) as `***`.
pub fn redact_url(url: &str) -> String {
    // Postgres's keyword form (`host=db user=app password=hunter2`) has no user part (and its
    // password may hold a comma).
    if !url.contains("://") {
        static PASSWORD: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
            regex::Regex::new(r"(?i)(password\s*=\s*)(?:'(?:[^'\\]|\\.)*'?|\S+)").expect("password pattern")
        });
        return PASSWORD.replace_all(url, "${1}***").into_owned();
    }
    // A Postgres URL lists its hosts after one user part, which tokio-postgres reads up to the
    // first `@` wherever it stands (a password may hold `/`, `,` or `?`): everything before
    // the last `@` may be a password, and is hidden once a `:` says one is there. A NATS URL
    // may list several servers, each with its own credentials.
    let lower = url.to_ascii_lowercase();
    let url = if lower.starts_with("postgres://") || lower.starts_with("postgresql://") {
        let at = url.find("://").map_or(0, |i| i + 3);
        let rest = &url[at..];
        match (rest.find('@'), rest.rfind('@')) {
            // A password is there when the user part (up to the first `@`) has a `:`; what it
            // is may run to the last `@` (one left unencoded in it).
            (Some(first), Some(last)) if rest[..first].contains(':') => {
                let user = rest[..first].split(':').next().unwrap_or_default();
                format!("{}{user}:***{}", &url[..at], &rest[last..])
            }
            // No password (`app@db/x?application_name=ops@team`): nothing to hide.
            _ => url.to_string(),
        }
    } else {
        url.split(',').map(redact_one).collect::<Vec<_>>().join(",")
    };
    // libpq also takes the password (and the client key's, `sslpassword`) as a parameter:
    // `postgres://app@db/x?password=hunter2`.
    static PARAM: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"(?i)([?&](?:ssl)?password=)[^&]*").expect("password parameter pattern")
    });
    PARAM.replace_all(&url, "${1}***").into_owned()
}

fn redact_one(url: &str) -> String {
    match userinfo(url) {
        Some((at, info)) => match info.split_once(':') {
            Some((user, _)) => format!("{}{user}:***{}", &url[..at], &url[at + info.len()..]),
            // A NATS URL's lone user part is a token (see `bus::url_credentials`); Postgres's
            // is a user name.
            None if !url.starts_with("postgres") => format!("{}***{}", &url[..at], &url[at + info.len()..]),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

/// The user part of one URL (`user:password` in `scheme://user:password@host/path`) and
/// where it starts; None when the URL has none.
pub(crate) fn userinfo(url: &str) -> Option<(usize, &str)> {
    let at = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[at..];
    // A NATS URL has no path: its user part runs to its last `@`, whatever it holds
    // unencoded (`nats://crew:Ab3/xYz@nats`, a token with a `/`): such a URL does not connect,
    // and the error that says so must not show it.
    let nats = ["nats://", "tls://", "ws://", "wss://"].iter().any(|s| url[..at].eq_ignore_ascii_case(s));
    let authority = if nats { rest } else { &rest[..rest.find(['/', '?']).unwrap_or(rest.len())] };
    authority.rsplit_once('@').map(|(info, _)| (at, info))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact_url("postgres://u:p%40ss@h:5432/db"), "postgres://u:***@h:5432/db");
        // A NATS password or token with an unencoded `/` or `?` (it does not connect: the
        // error says so without it).
        assert_eq!(redact_url("nats://crew:Ab3/xYz@nats:4222"), "nats://crew:***@nats:4222");
        assert_eq!(redact_url("nats://tok3n/AbC+x==@nats:4222"), "nats://***@nats:4222");
        assert_eq!(
            redact_url("TLS://crew:a?b@n1:4222,tls://crew:c/d@n2:4222"),
            "TLS://crew:***@n1:4222,tls://crew:***@n2:4222"
        );
        assert_eq!(redact_url("nats://nats:4222"), "nats://nats:4222");
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
        // What tokio-postgres takes for the password, whatever it holds: `/`, `,`, `?`, `@`.
        assert_eq!(redact_url("postgres://app:Zx9/Qw+e@db/pitcrew"), "postgres://app:***@db/pitcrew");
        assert_eq!(redact_url("postgres://app:a,b@db1,db2/x"), "postgres://app:***@db1,db2/x");
        assert_eq!(redact_url("postgresql://app:p?w@ss@db:5432/x"), "postgresql://app:***@db:5432/x");
        assert_eq!(redact_url("POSTGRES://app:s3cret@db/x"), "POSTGRES://app:***@db/x");
        // An `@` in a parameter is no password.
        assert_eq!(
            redact_url("postgres://app@db:5432/x?application_name=ops@team"),
            "postgres://app@db:5432/x?application_name=ops@team"
        );
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        // Every server of a list, not only the first.
        assert_eq!(redact_url("nats://a:p1@h1:4222,nats://b:p2@h2:4222"), "nats://a:***@h1:4222,nats://b:***@h2:4222");
        // A NATS URL's lone user part is a token: hidden.
        assert_eq!(redact_url("nats://s3cret-token@h:4222"), "nats://***@h:4222");
        assert_eq!(redact_url("host=db user=app password=hun,ter2 dbname=x"), "host=db user=app password=*** dbname=x");
        assert_eq!(redact_url("host=db password = 'a b\\' c' user=app"), "host=db password = *** user=app");
        assert_eq!(redact_url("tls://a:p@h1:4222,tls://tok@h2:4222"), "tls://a:***@h1:4222,tls://***@h2:4222");
        // libpq's password parameters, wherever they stand among the others.
        assert_eq!(
            redact_url("postgres://app@db/x?password=hun%26ter2&sslmode=require"),
            "postgres://app@db/x?password=***&sslmode=require"
        );
        assert_eq!(
            redact_url("postgresql://app@db/x?sslmode=verify-full&sslpassword=k3y&Password=p"),
            "postgresql://app@db/x?sslmode=verify-full&sslpassword=***&Password=***"
        );
        assert_eq!(redact_url("host=db sslpassword=k3y user=app"), "host=db sslpassword=*** user=app");
        // A URL to Postgres has no fragment: a `#` is part of the password.
        assert_eq!(redact_url("postgres://app@db/x?password=ab#cd&x=1"), "postgres://app@db/x?password=***&x=1");
    }

    #[test]
    fn toml_overrides_and_validation() {
        let c = Config::from_toml("[limits]\nmax_retries = 2\n[stage.diagnose]\nconcurrency = 4\n").unwrap();
        assert_eq!(c.limits.max_retries, 2);
        for limits in ["max_retries = 0", "max_retries = 11", "max_attempts = 0", "max_attempts = 50"] {
            let e = Config::from_toml(&format!("[limits]\n{limits}\n")).unwrap_err();
            assert!(e.to_string().contains("must be 1 to 10"), "{limits}: {e}");
        }
        assert!(Config::from_toml("[limits]\nmax_retries = 10\nmax_attempts = 10\n").is_ok());
        assert_eq!(c.stage_settings(Stage::Diagnose).concurrency, 4);
        assert_eq!(c.stage_settings(Stage::Plan).concurrency, 32);
        let e = Config::from_toml("[stage.diagnoze]\nconcurrency = 4\n").unwrap_err();
        assert!(e.to_string().contains("diagnoze"), "{e}");
        let e = Config::from_toml("[limits]\nmax_retrys = 2\n").unwrap_err();
        assert!(e.to_string().contains("max_retrys"), "{e}");
        assert!(Config::load(Some(Path::new("/nonexistent/pitcrew.toml"))).is_err());
        assert!(Config::default().exec.pass_env.is_empty(), "nothing passed on unless named");
        let c = Config::from_toml("[exec]\npass_env = [\"JAVA_HOME\", \"KUBECONFIG\"]\n").unwrap();
        assert_eq!(c.exec.pass_env, ["JAVA_HOME", "KUBECONFIG"]);
        assert!(Config::from_toml("[exec]\npass_envs = []\n").is_err());
    }

    #[test]
    fn services_name_known_hosts() {
        let ok = Config::from_toml(
            "[hosts.pe1]\naddress = \"10.0.0.1\"\nuser = \"sentinel\"\nlacks = [\"systemctl\"]\n\
             [services.bgp]\nhost = \"pe1\"\n",
        )
        .unwrap();
        assert_eq!(ok.hosts["pe1"].port, 22);
        assert!(!ok.hosts["pe1"].accept_unknown_host_key, "unknown host keys are refused by default");
        assert_eq!(ok.hosts["pe1"].max_sessions, 8, "under sshd's default MaxSessions of 10");
        let e = Config::from_toml("[hosts.pe1]\naddress = \"10.0.0.1\"\nuser = \"s\"\nmax_sessions = 0\n").unwrap_err();
        assert!(e.to_string().contains("[hosts.pe1]: max_sessions must be at least 1"), "{e}");
        assert_eq!(ok.hosts["pe1"].master_idle_secs, 600, "an idle master connection closes after 10 minutes");
        let e =
            Config::from_toml("[hosts.pe1]\naddress = \"10.0.0.1\"\nuser = \"s\"\nmaster_idle_secs = 0\n").unwrap_err();
        assert!(e.to_string().contains("[hosts.pe1]: master_idle_secs (0) must be 1 to 86400"), "{e}");
        let e = Config::from_toml("[services.bgp]\nhost = \"pe9\"\n").unwrap_err();
        assert!(e.to_string().contains("host 'pe9' is not under [hosts]"), "{e}");
    }

    #[test]
    fn an_approver_name_longer_than_a_decision_keeps_is_refused() {
        let long = "a".repeat(pitcrew_model::approval::MAX_DECIDER + 1);
        let e = Config::from_toml(&format!("[approvers]\n{long} = \"approver\"\n")).unwrap_err();
        assert!(e.to_string().contains("a name is at most 256 bytes"), "{e}");
        let fits = "a".repeat(pitcrew_model::approval::MAX_DECIDER);
        Config::from_toml(&format!("[approvers]\n{fits} = \"approver\"\n")).unwrap();
    }

    #[test]
    fn slack_users_must_be_approvers() {
        let ok = Config::from_toml(
            "[approvers]\nann = \"approver\"\n[bridge.slack]\nchannel = \"C1\"\n[bridge.slack.users]\nU1 = \"ann\"\n",
        )
        .unwrap();
        let slack = ok.bridge.slack.unwrap();
        assert_eq!(slack.users["U1"], "ann");
        assert_eq!(slack.token_env, "SLACK_BOT_TOKEN", "defaults fill what the table leaves out");
        assert!(Config::default().bridge.slack.is_none(), "no bridge unless configured");
        let e =
            Config::from_toml("[bridge.slack]\nchannel = \"C1\"\n[bridge.slack.users]\nU1 = \"zed\"\n").unwrap_err();
        assert!(e.to_string().contains("zed is not under [approvers]"), "{e}");
        let e = Config::from_toml("[bridge.slack]\nlisten = \"127.0.0.1:1\"\n").unwrap_err();
        assert!(e.to_string().contains("channel is required"), "{e}");
        let e = Config::from_toml("[bridge.slack]\nchannel = \"C1\"\ntoken = \"xoxb\"\n").unwrap_err();
        assert!(e.to_string().contains("token"), "a secret in the file is an unknown key: {e}");
        let e = Config::from_toml("[bridge.mattermost]\nurl = \"http://mm\"\nchannel_id = \"c1\"\n").unwrap_err();
        assert!(e.to_string().contains("public_url '' must be an http(s) URL"), "{e}");
        // A scheme forgotten: the proxy's password is not quoted with the URL.
        let e = Config::from_toml("[bridge.mattermost]\nurl = \"ops:S3cret-pw@proxy:8080/mm\"\nchannel_id = \"c1\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("url '***@proxy:8080/mm' must be an http(s) URL") && !e.contains("S3cret-pw"), "{e}");
        let mm = "[bridge.mattermost]\nurl = \"http://mm\"\nchannel_id = \"c1\"\npublic_url = \"https://b\"\n";
        let e = Config::from_toml(&format!("{mm}listen = \"0.0.0.0:3001\"\n")).unwrap_err();
        assert!(e.to_string().contains("allow_from is empty but listen 0.0.0.0:3001 takes calls"), "{e}");
        let e = Config::from_toml(&format!("{mm}listen = \"0.0.0.0:3001\"\nallow_from = [\"mm\"]\n")).unwrap_err();
        assert!(e.to_string().contains("'mm' is not an IP address"), "{e}");
        assert!(Config::from_toml(&format!("{mm}listen = \"0.0.0.0:3001\"\nallow_from = [\"10.0.0.0/8\"]\n")).is_ok());
        assert!(Config::from_toml(mm).is_ok(), "the default listen is loopback: no list needed");
    }

    /// A check that could not tell anything would fail on every healthy service: refused at
    /// start-up, naming the service and what is wrong.
    #[test]
    fn a_check_that_cannot_tell_anything_is_refused() {
        let with = |check: &str| Config::from_toml(&format!("[services.web]\nhost = \"local\"\ncheck = {check}\n"));
        for (check, why) in [
            (r#"{ kind = "http", url = "localhost:8080/health" }"#, "must be http:// or https://"),
            (r#"{ kind = "http", url = "http:///health" }"#, "must be http:// or https://"),
            (r#"{ kind = "http", url = "http://web/health", expect_status = 2000 }"#, "expect_status (2000)"),
            (r#"{ kind = "tcp", address = "db.internal" }"#, "must be host:port"),
            (r#"{ kind = "tcp", address = "db:0" }"#, "must be host:port"),
            (r#"{ kind = "tcp", address = "db:5432", timeout_ms = 0 }"#, "timeout_ms must be at least 1"),
            (r#"{ kind = "command", command = " " }"#, "command is empty"),
        ] {
            let e = with(check).unwrap_err().to_string();
            assert!(e.contains("[services.web] check: ") && e.contains(why), "{check}: {e}");
        }
        for check in [
            r#"{ kind = "http", url = "https://web.example:8443/health?deep=1" }"#,
            r#"{ kind = "tcp", address = "[2001:db8::1]:5432" }"#,
            r#"{ kind = "command", command = "systemctl is-active web" }"#,
        ] {
            assert!(with(check).is_ok(), "{check}");
        }
        let e = Config::from_toml("[monitor]\ninterval_ms = 0\n").unwrap_err().to_string();
        assert!(e.contains("monitor.interval_ms"), "{e}");
    }

    #[test]
    fn a_service_name_no_incident_could_carry_is_refused() {
        let e = Config::from_toml("[services.\"payments api\"]\nhost = \"local\"\n").unwrap_err();
        assert!(e.to_string().contains("[services.\"payments api\"]: a service name is"), "{e}");
        assert!(Config::from_toml(&format!("[services.{}]\nhost = \"local\"\n", "s".repeat(129))).is_err());
        assert!(Config::from_toml("[services.\"web-1_a.b\"]\nhost = \"local\"\n").is_ok());
    }

    #[test]
    fn a_document_that_does_not_parse_is_quoted_without_its_password() {
        let e = Config::from_toml("[database]\nurl = \"postgres://app:hunter2\\q@db/x\"\n").unwrap_err().to_string();
        assert!(e.contains("bad configuration"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        // A password holding `/`, on a line left unterminated.
        let e = Config::from_toml("[database]\nurl = \"postgres://app:Zx9/Qw+e@db/x\n").unwrap_err().to_string();
        assert!(!e.contains("Zx9") && !e.contains("Qw+e"), "{e}");
    }

    /// `[limits] key` is refused at `past` (saying it must be 1 to `max`) and at 0, and taken
    /// at `max`.
    fn a_limit_from_one_to(key: &str, max: u64, past: u64) {
        let e = Config::from_toml(&format!("[limits]\n{key} = {past}\n")).unwrap_err().to_string();
        assert!(e.contains(&format!("limits.{key} ({past}) must be 1 to {max}")), "{e}");
        assert!(Config::from_toml(&format!("[limits]\n{key} = 0\n")).is_err());
        assert!(Config::from_toml(&format!("[limits]\n{key} = {max}\n")).is_ok());
    }

    #[test]
    fn an_approval_timeout_past_thirty_days_is_refused_not_an_overflow_later() {
        a_limit_from_one_to("approval_timeout_secs", 2_592_000, 10_000_000_000_000);
    }

    #[test]
    fn an_output_cap_past_sixteen_mib_is_refused() {
        a_limit_from_one_to("max_output_bytes", 16_777_216, 16_777_217);
    }

    /// An ack wait NATS would read wrapped (it takes nanoseconds as an i64) and a concurrency
    /// tokio's semaphore panics on are refused as the configuration is read.
    #[test]
    fn stage_numbers_past_what_they_can_mean_are_refused() {
        let e = Config::from_toml("[stages]\nack_wait_secs = 18446744074\n").unwrap_err().to_string();
        assert!(e.contains("[stages] ack_wait_secs (18446744074) must be at most 86400"), "{e}");
        let e = Config::from_toml("[stage.diagnose]\nack_wait_secs = 86401\n").unwrap_err().to_string();
        assert!(e.contains("[stage.diagnose] ack_wait_secs (86401)"), "{e}");
        let e = Config::from_toml("[stage.plan]\nconcurrency = 4611686018427387904\n").unwrap_err().to_string();
        assert!(e.contains("[stage.plan] concurrency (4611686018427387904) must be at most 65536"), "{e}");
        assert!(Config::from_toml("[stages]\nconcurrency = 65537\n").is_err());
        let fine = "[stages]\nack_wait_secs = 86400\nconcurrency = 65536\n[stage.diagnose]\nconcurrency = 1000\n";
        assert!(Config::from_toml(fine).is_ok());
    }

    #[test]
    fn environment_overrides_and_ignores_non_config_variables() {
        // One test touches the environment, so no other test races it.
        std::env::set_var("PITCREW_LOG", "debug");
        std::env::set_var("PITCREW_NATS_URL", "nats://10.0.0.9:4222");
        std::env::set_var("PITCREW_LIMITS__MAX_RETRIES", "7");
        std::env::set_var("PITCREW_GATEWAY__KEYS__ALICE__ROLE", "admin");
        std::env::set_var("PITCREW_GATEWAY__KEYS__ALICE__SHA256", "ab12");
        // The test tools' own variables (README, "Tests") are not config keys.
        std::env::set_var("PITCREW_ALERTMANAGER", "/usr/bin/prometheus-alertmanager");
        std::env::set_var("PITCREW_BLESS", "1");
        // What Kubernetes sets for a Service called pitcrew-gateway is no config.
        let links = [
            ("PITCREW_SERVICE_HOST", "10.96.0.9"),
            ("PITCREW_PORT", "tcp://10.96.0.9:4222"),
            ("PITCREW_PORTAL_SERVICE_HOST", "10.96.0.8"),
            ("PITCREW_GATEWAY_SERVICE_SERVICE_PORT", "80"),
            ("PITCREW_GATEWAY_SERVICE_HOST", "10.96.0.7"),
            ("PITCREW_GATEWAY_SERVICE_PORT", "8088"),
            ("PITCREW_GATEWAY_SERVICE_PORT_HTTP", "8088"),
            ("PITCREW_GATEWAY_PORT", "tcp://10.96.0.7:8088"),
            ("PITCREW_GATEWAY_PORT_8088_TCP", "tcp://10.96.0.7:8088"),
            ("PITCREW_GATEWAY_PORT_8088_TCP_ADDR", "10.96.0.7"),
        ];
        for (k, v) in links {
            std::env::set_var(k, v);
        }
        let c = Config::load(Some(Path::new("/dev/null"))).unwrap();
        assert_eq!(c.nats.url, "nats://10.0.0.9:4222");
        assert_eq!(c.limits.max_retries, 7);
        assert_eq!(c.gateway.keys["alice"], ApiKey { role: "admin".into(), sha256: "ab12".into() });
        assert_eq!(c.gateway.listen, "127.0.0.1:8088", "the rest of [gateway] keeps its defaults");
        std::env::remove_var("PITCREW_GATEWAY__KEYS__ALICE__ROLE");
        std::env::remove_var("PITCREW_GATEWAY__KEYS__ALICE__SHA256");
        std::env::set_var("PITCREW_BOGUS", "1");
        let e = Config::load(Some(Path::new("/dev/null"))).unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
        for (k, _) in links {
            std::env::remove_var(k);
        }
        for k in [
            "PITCREW_LOG",
            "PITCREW_NATS_URL",
            "PITCREW_LIMITS__MAX_RETRIES",
            "PITCREW_BOGUS",
            "PITCREW_ALERTMANAGER",
            "PITCREW_BLESS",
        ] {
            std::env::remove_var(k);
        }
    }
}
