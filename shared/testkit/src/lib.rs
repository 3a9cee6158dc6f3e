//! Test harness: every test gets its own nats-server (random port, temp store, killed on drop)
//! and its own freshly created Postgres database (dropped afterwards), so tests run in
//! parallel without seeing each other. Waits are on events, each with a timeout.

pub mod alertmanager;
pub mod http;
pub mod llm;
pub mod pg;
pub mod slack;
pub mod sshd;

use anyhow::{anyhow, bail, Context};
use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use futures::StreamExt;
use pitcrew_model::{EventKind, RunEvent};
use pitcrew_runtime::natsd::NatsServer;
use pitcrew_runtime::Bus;
use std::time::Duration;
use tokio_postgres::NoTls;
use uuid::Uuid;

/// The server tests create their databases on: `PITCREW_TEST_DATABASE_URL`, else the local one.
pub fn admin_url() -> String {
    std::env::var("PITCREW_TEST_DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A database that exists for one test.
pub struct TestDb {
    pub url: String,
    name: String,
    admin: String,
}

impl TestDb {
    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub async fn create() -> anyhow::Result<TestDb> {
        Self::create_on(&admin_url()).await
    }

    /// A fresh database on the server `admin` names.
    pub async fn create_on(admin: &str) -> anyhow::Result<TestDb> {
        let admin = admin.to_string();
        let name = format!("pitcrew_test_{}", Uuid::new_v4().simple());
        let (client, conn) = tokio_postgres::connect(&admin, NoTls)
            .await
            .with_context(|| format!("cannot reach Postgres at {admin} (set PITCREW_TEST_DATABASE_URL)"))?;
        tokio::spawn(conn);
        client.batch_execute(&format!("CREATE DATABASE \"{name}\"")).await?;
        let mut cfg: tokio_postgres::Config = admin.parse()?;
        cfg.dbname(&name);
        let url = replace_db(&admin, &name);
        Ok(TestDb { url, name, admin })
    }

    /// A plain client on the test database, for assertions.
    pub async fn client(&self) -> anyhow::Result<tokio_postgres::Client> {
        let (client, conn) = tokio_postgres::connect(&self.url, NoTls).await?;
        tokio::spawn(conn);
        Ok(client)
    }
}

fn replace_db(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, format!("?{q}")),
        None => (url, String::new()),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let host_end = base[scheme_end..].find('/').map(|i| i + scheme_end).unwrap_or(base.len());
    format!("{}/{db}{query}", &base[..host_end])
}

/// Set (to anything) to keep each test's database and scratch directory when it ends, to
/// look at a failure: the test prints where they are.
pub const KEEP_VAR: &str = "PITCREW_TEST_KEEP";

fn keep() -> bool {
    std::env::var_os(KEEP_VAR).is_some()
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if keep() {
            eprintln!("{KEEP_VAR}: kept database {}", self.url);
            return;
        }
        let name = self.name.clone();
        let admin = self.admin.clone();
        // Drop from a thread of its own: Drop may run inside or outside a runtime.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            rt.block_on(async {
                let (client, conn) = tokio_postgres::connect(&admin, NoTls).await.ok()?;
                tokio::spawn(conn);
                client.batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).await.ok()
            })
        })
        .join();
    }
}

/// A nats-server and a database for one test, plus a scratch directory.
pub struct TestEnv {
    pub nats: NatsServer,
    pub db: TestDb,
    pub dir: tempfile::TempDir,
}

impl TestEnv {
    pub async fn start() -> anyhow::Result<TestEnv> {
        Self::start_on(&admin_url()).await
    }

    /// As `start`, with the database on the Postgres server `admin` names.
    pub async fn start_on(admin: &str) -> anyhow::Result<TestEnv> {
        let nats = NatsServer::start()?;
        let db = TestDb::create_on(admin).await?;
        let dir = tempfile::Builder::new().prefix("pitcrew-test-").disable_cleanup(keep()).tempdir()?;
        if keep() {
            eprintln!("{KEEP_VAR}: keeping {}", dir.path().display());
        }
        Ok(TestEnv { nats, db, dir })
    }

    /// A config document for this environment, with `extra` TOML appended.
    pub fn config_toml(&self, extra: &str) -> String {
        format!("[nats]\nurl = \"{}\"\n[database]\nurl = \"{}\"\npool_size = 8\n{extra}", self.nats.url(), self.db.url)
    }

    pub fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }
}

/// Follows the whole event stream of a bus from now on; waits pick the events they need.
pub struct Events {
    messages: async_nats::jetstream::consumer::pull::Ordered,
    pub seen: Vec<RunEvent>,
}

impl Events {
    /// Start following every event published from now on (or from the start with `all`).
    pub async fn follow(bus: &Bus, all: bool) -> anyhow::Result<Events> {
        let stream = bus.js.get_stream(bus.subjects.events_stream()).await?;
        let consumer = stream
            .create_consumer(OrderedConfig {
                filter_subject: bus.subjects.events_all(),
                deliver_policy: if all { DeliverPolicy::All } else { DeliverPolicy::New },
                ..Default::default()
            })
            .await?;
        Ok(Events { messages: consumer.messages().await?, seen: Vec::new() })
    }

    /// The first event of `run` matching `want`, within `timeout`; on timeout the error lists
    /// the run's events so far.
    pub async fn wait(
        &mut self,
        run: Uuid,
        want: impl Fn(&RunEvent) -> bool,
        timeout: Duration,
    ) -> anyhow::Result<RunEvent> {
        self.wait_any(|e| e.run_id == run && want(e), timeout).await.map_err(|err| {
            let mine: Vec<String> = self
                .seen
                .iter()
                .filter(|e| e.run_id == run)
                .map(|e| format!("{}/{}: {}", e.stage, e.kind.as_str(), e.message))
                .collect();
            anyhow!("{err} (run {run}); its events so far:\n{}", mine.join("\n"))
        })
    }

    /// The first event of any run matching `want`, within `timeout`.
    pub async fn wait_any(&mut self, want: impl Fn(&RunEvent) -> bool, timeout: Duration) -> anyhow::Result<RunEvent> {
        if let Some(e) = self.seen.iter().find(|e| want(e)) {
            return Ok(e.clone());
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let msg = match tokio::time::timeout_at(deadline, self.messages.next()).await {
                Ok(Some(Ok(m))) => m,
                Ok(Some(Err(e))) => return Err(anyhow!("event stream: {e}")),
                Ok(None) => bail!("event stream ended"),
                Err(_) => bail!("timed out after {timeout:?} waiting for an event"),
            };
            // Other publishers share the events stream (the monitor's recoveries): skip them.
            let Ok(e) = serde_json::from_slice::<RunEvent>(&msg.payload) else { continue };
            self.seen.push(e.clone());
            if want(&e) {
                return Ok(e);
            }
        }
    }

    /// The terminal event of `run`.
    pub async fn terminal(&mut self, run: Uuid, timeout: Duration) -> anyhow::Result<RunEvent> {
        self.wait(run, |e| e.kind.is_terminal(), timeout).await
    }

    /// The first event of `kind` for `run`.
    pub async fn kind(&mut self, run: Uuid, kind: EventKind, timeout: Duration) -> anyhow::Result<RunEvent> {
        self.wait(run, move |e| e.kind == kind, timeout).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_name_is_replaced_in_urls() {
        assert_eq!(replace_db("postgres://u@h:5432/postgres", "t1"), "postgres://u@h:5432/t1");
        assert_eq!(replace_db("postgres://u@h/postgres?sslmode=disable", "t1"), "postgres://u@h/t1?sslmode=disable");
        assert_eq!(replace_db("postgres://u@h", "t1"), "postgres://u@h/t1");
    }
}
