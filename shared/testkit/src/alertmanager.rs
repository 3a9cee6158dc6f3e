//! A real Prometheus Alertmanager (Debian's `prometheus-alertmanager`) on a loopback port,
//! clustering off, with one route whose receiver is a webhook (the gateway under test) and
//! short group timings; alerts are posted to its own API (`POST /api/v2/alerts`). Killed on
//! drop.

use anyhow::{bail, Context};
use pitcrew_exec::process::{free_port, listening, wait_ready};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// `$PITCREW_ALERTMANAGER`, else Debian's binary.
pub fn binary() -> PathBuf {
    std::env::var_os("PITCREW_ALERTMANAGER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/prometheus-alertmanager"))
}

/// How Alertmanager groups and repeats notifications.
#[derive(Debug, Clone)]
pub struct Timing {
    pub group_wait: &'static str,
    pub group_interval: &'static str,
    pub repeat_interval: &'static str,
}

impl Default for Timing {
    /// Fast first notification; a re-send of an unchanged group every 2 s.
    fn default() -> Self {
        Timing { group_wait: "100ms", group_interval: "1s", repeat_interval: "2s" }
    }
}

/// A running Alertmanager.
pub struct Alertmanager {
    /// `http://127.0.0.1:PORT`
    pub url: String,
    child: Child,
    dir: tempfile::TempDir,
}

impl Drop for Alertmanager {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Alertmanager {
    /// Start one whose only receiver posts to `webhook` with `Authorization: Bearer <bearer>`.
    pub fn start(webhook: &str, bearer: &str, timing: &Timing) -> anyhow::Result<Alertmanager> {
        let bin = binary();
        if !bin.exists() {
            bail!(
                "{} not found: `apt-get install prometheus-alertmanager` (or set PITCREW_ALERTMANAGER)",
                bin.display()
            );
        }
        let dir = tempfile::Builder::new().prefix("pitcrew-alertmanager-").tempdir()?;
        let token = dir.path().join("token");
        std::fs::write(&token, bearer)?;
        let config = dir.path().join("alertmanager.yml");
        std::fs::write(
            &config,
            format!(
                "route:\n  receiver: pitcrew\n  group_by: ['alertname', 'service']\n  group_wait: {gw}\n  \
                 group_interval: {gi}\n  repeat_interval: {ri}\n\
                 receivers:\n  - name: pitcrew\n    webhook_configs:\n      - url: '{webhook}'\n        \
                 send_resolved: true\n        http_config:\n          authorization:\n            type: Bearer\n            \
                 credentials_file: '{token}'\n",
                gw = timing.group_wait,
                gi = timing.group_interval,
                ri = timing.repeat_interval,
                token = token.display(),
            ),
        )?;
        let port = free_port()?;
        let log_path = dir.path().join("alertmanager.log");
        let log = std::fs::File::create(&log_path)?;
        let mut child = Command::new(&bin)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--cluster.listen-address=")
            .arg("--log.level=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot run {}", bin.display()))?;
        if let Err(e) = wait_ready("alertmanager", &mut child, &log_path, Duration::from_secs(20), || listening(port)) {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{e}");
        }
        Ok(Alertmanager { url: format!("http://127.0.0.1:{port}"), child, dir })
    }

    /// Post alerts (Alertmanager's API v2 objects: labels, annotations, startsAt, endsAt).
    pub async fn post_alerts(&self, alerts: &serde_json::Value) -> anyhow::Result<()> {
        let resp = reqwest::Client::new()
            .post(format!("{}/api/v2/alerts", self.url))
            .json(alerts)
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .context("posting alerts to Alertmanager")?;
        let status = resp.status();
        if !status.is_success() {
            bail!("Alertmanager refused the alerts: {status}: {}", resp.text().await.unwrap_or_default());
        }
        Ok(())
    }

    /// Alertmanager's own log (its notify errors say why a webhook failed).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("alertmanager.log")).unwrap_or_default()
    }
}
