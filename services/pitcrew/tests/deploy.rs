//! The deployment files, checked without Docker: `deploy/nats.conf` is validated by the real
//! nats-server; `docker-compose.yml` agrees with itself (credentials, ports, health checks);
//! and every pitcrew service in it is started as the container would start it (the same
//! arguments after the image's `ENTRYPOINT ["pitcrew"]`, the same environment, with the
//! compose network's addresses mapped to this test's nats-server, database and ports) and must
//! come up, serve, and stop cleanly on SIGTERM, logged in to a nats-server running
//! `deploy/nats.conf` itself as the users compose gives them. Each of that config's users can
//! do its service's job and not the jobs it must never do (publish a run state to a stage,
//! delete the crew's streams, decide approvals when it is only a monitor).

use anyhow::Context;
use async_nats::jetstream::consumer::pull::OrderedConfig;
use futures::StreamExt;
use pitcrew_model::{Decision, EventKind, Severity, Stage};
use pitcrew_runtime::approvals::{submit, DecisionInput};
use pitcrew_runtime::{Bus, Config};
use pitcrew_testkit::{Events, TestEnv};
use serde_norway::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn compose() -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(repo().join("docker-compose.yml"))?;
    Ok(serde_norway::from_str(&text)?)
}

fn strings(v: &Value) -> Vec<String> {
    v.as_sequence().into_iter().flatten().filter_map(|s| s.as_str().map(String::from)).collect()
}

fn environment(service: &Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Some(map) = service["environment"].as_mapping() {
        for (k, v) in map {
            let value = match v {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                Value::Bool(b) => b.to_string(),
                _ => String::new(),
            };
            out.insert(k.as_str().unwrap_or_default().to_string(), interpolate(&value));
        }
    }
    out
}

/// Compose's `${VAR:-default}`, as compose would fill it in with VAR unset. Any other form
/// (no default, or `:?`) would make `docker compose up` depend on the caller's shell: refused.
fn interpolate(value: &str) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').map(|e| start + e).unwrap_or_else(|| panic!("unclosed ${{ in {value}"));
        let inner = &rest[start + 2..end];
        let (_, default) = inner.split_once(":-").unwrap_or_else(|| panic!("{value}: ${{{inner}}} has no default"));
        out.push_str(default);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// Whether `client`'s pull request on `next` (a consumer's `MSG.NEXT` subject) is answered
/// within 800 ms: allowed, it would be (with a message, or a 408 once its 200 ms expire);
/// refused, never.
async fn pull_answered(client: &async_nats::Client, next: &str) -> anyhow::Result<bool> {
    let inbox = client.new_inbox();
    let mut answers = client.subscribe(inbox.clone()).await?;
    client.publish_with_reply(next.to_string(), inbox, r#"{"batch":1,"expires":200000000}"#.into()).await?;
    client.flush().await?;
    Ok(tokio::time::timeout(Duration::from_millis(800), answers.next()).await.is_ok())
}

/// A nats-server running `deploy/nats.conf` itself, on a free loopback port with a temporary
/// store, its users' passwords in its environment. Killed on drop.
struct ConfiguredNats {
    child: std::process::Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl ConfiguredNats {
    fn start(passwords: &BTreeMap<String, String>) -> anyhow::Result<ConfiguredNats> {
        Self::start_with(passwords, &[])
    }

    /// The same, with lines of `deploy/nats.conf` changed as `edits` say (each must be there).
    fn start_with(passwords: &BTreeMap<String, String>, edits: &[(&str, &str)]) -> anyhow::Result<ConfiguredNats> {
        let dir = tempfile::tempdir()?;
        let port = pitcrew_runtime::natsd::free_port()?;
        let conf = std::fs::read_to_string(repo().join("deploy/nats.conf"))?;
        // Only the machine-specific lines change; each must be there to change.
        let store = dir.path().join("js");
        let mut text = conf;
        for (from, to) in [
            ("listen: 0.0.0.0:4222".to_string(), format!("listen: 127.0.0.1:{port}")),
            ("http: 0.0.0.0:8222".to_string(), String::new()),
            ("store_dir: /data/jetstream".to_string(), format!("store_dir: \"{}\"", store.display())),
        ]
        .into_iter()
        .chain(edits.iter().map(|(from, to)| (from.to_string(), to.to_string())))
        {
            anyhow::ensure!(text.contains(&from), "deploy/nats.conf no longer has `{from}`");
            text = text.replace(&from, &to);
        }
        let file = dir.path().join("nats.conf");
        std::fs::write(&file, text)?;
        let log = dir.path().join("nats.log");
        let mut cmd = Command::new(pitcrew_runtime::natsd::find_binary()?);
        cmd.arg("-c").arg(&file).envs(passwords).stdin(Stdio::null()).stdout(Stdio::null());
        let child = cmd.stderr(std::fs::File::create(&log)?).spawn()?;
        let mut nats = ConfiguredNats { child, port, dir };
        pitcrew_exec::process::wait_ready(
            "nats-server -c deploy/nats.conf",
            &mut nats.child,
            &log,
            Duration::from_secs(15),
            || pitcrew_exec::process::listening(port),
        )
        .map_err(anyhow::Error::msg)?;
        Ok(nats)
    }

    /// A client URL of `user` with `password`.
    fn url(&self, user: &str, password: &str) -> String {
        format!("nats://{user}:{password}@127.0.0.1:{}", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("nats.log")).unwrap_or_default()
    }
}

impl Drop for ConfiguredNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_nats_config_is_valid_for_the_real_server() -> anyhow::Result<()> {
    let server = pitcrew_runtime::natsd::find_binary()?;
    let check = |env: &BTreeMap<String, String>| -> anyhow::Result<(bool, String)> {
        let out = Command::new(&server).arg("-c").arg(repo().join("deploy/nats.conf")).arg("-t").envs(env).output()?;
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        Ok((out.status.success(), said))
    };
    // With the passwords compose gives the server: valid.
    let passwords = environment(&compose()?["services"]["nats"]);
    let (ok, said) = check(&passwords)?;
    assert!(ok && said.contains("is valid"), "nats-server -t refused deploy/nats.conf: {said}");
    // Without one of them the server refuses to start (there is no default password).
    let mut missing = passwords.clone();
    missing.remove("NATS_MONITOR_PASSWORD");
    let (ok, said) = check(&missing)?;
    assert!(!ok && said.contains("NATS_MONITOR_PASSWORD"), "a missing password must stop the server: {said}");
    Ok(())
}

#[test]
fn the_compose_file_agrees_with_itself_and_the_image() -> anyhow::Result<()> {
    let c = compose()?;
    let services = c["services"].as_mapping().expect("services");
    let names: Vec<&str> = services.keys().filter_map(|k| k.as_str()).collect();
    for want in ["nats", "postgres", "pitcrew", "gateway"] {
        assert!(names.contains(&want), "docker-compose.yml has no {want} service: {names:?}");
    }
    // Postgres is created with the database the pitcrew services use, and their own login
    // (not the superuser) made by the script the image runs on a new volume.
    let pg = environment(&c["services"]["postgres"]);
    let url = format!("postgres://pitcrew:{}@postgres:5432/{}", pg["PITCREW_DB_PASSWORD"], pg["POSTGRES_DB"]);
    let init = strings(&c["services"]["postgres"]["volumes"]);
    assert!(
        init.contains(&"./deploy/postgres-init.sh:/docker-entrypoint-initdb.d/pitcrew.sh:ro".to_string()),
        "{init:?}"
    );
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(repo().join("deploy/postgres-init.sh"))?.permissions(),
    );
    assert!(mode & 0o111 != 0, "the image runs an executable init script (it sources one that is not)");
    // NATS: the health check asks the monitoring port nats.conf opens; the client port is 4222.
    let conf = std::fs::read_to_string(repo().join("deploy/nats.conf"))?;
    assert!(conf.lines().any(|l| l.trim() == "http: 0.0.0.0:8222"), "nats.conf serves monitoring on 8222");
    let health = strings(&c["services"]["nats"]["healthcheck"]["test"]).join(" ");
    assert!(health.contains("http://localhost:8222/healthz"), "{health}");
    // Each service logs in as the nats.conf user made for it, with the password compose
    // gives the server for that user.
    let nats_env = environment(&c["services"]["nats"]);
    let nats_urls: BTreeMap<&str, String> = [("pitcrew", "crew"), ("gateway", "gateway")]
        .into_iter()
        .map(|(service, user)| {
            let password = &nats_env[&format!("NATS_{}_PASSWORD", user.to_uppercase())];
            assert!(conf.contains(&format!("user: {user}\n")), "nats.conf has a user {user}");
            (service, format!("nats://{user}:{password}@nats:4222"))
        })
        .collect();
    let dockerfile = std::fs::read_to_string(repo().join("deploy/Dockerfile"))?;
    assert!(
        dockerfile.contains("ENTRYPOINT [\"/usr/bin/tini\", \"--\", \"pitcrew\"]"),
        "the image runs pitcrew under an init that reaps orphans, with the command as arguments"
    );
    for name in ["pitcrew", "gateway"] {
        let svc = &c["services"][name];
        assert_eq!(svc["build"]["dockerfile"].as_str(), Some("deploy/Dockerfile"), "{name} is built from the image");
        let env = environment(svc);
        assert_eq!(env.get("DATABASE_URL"), Some(&url), "{name} uses the database compose creates");
        assert_eq!(env.get("PITCREW_NATS_URL"), Some(&nats_urls[name]), "{name} logs in to NATS as its own user");
        for dep in ["nats", "postgres"] {
            assert_eq!(svc["depends_on"][dep]["condition"].as_str(), Some("service_healthy"), "{name} waits for {dep}");
        }
    }
    // The crew and the gateway read one configuration, mounted where the image runs them
    // (its WORKDIR: pitcrew reads ./pitcrew.toml), and get longer to stop than their drain.
    assert!(dockerfile.contains("WORKDIR /var/lib/pitcrew"), "the image runs in /var/lib/pitcrew");
    for tool in ["openssh-client", "iproute2"] {
        assert!(dockerfile.contains(tool), "the image has {tool} (ssh for [hosts], ss for evidence)");
    }
    for name in ["pitcrew", "gateway"] {
        let svc = &c["services"][name];
        let mounts = strings(&svc["volumes"]);
        assert!(
            mounts.contains(&"./deploy/pitcrew.toml:/var/lib/pitcrew/pitcrew.toml:ro".to_string()),
            "{name} reads deploy/pitcrew.toml: {mounts:?}"
        );
        let grace = svc["stop_grace_period"].as_str().unwrap_or("10s");
        let secs: u64 = grace.trim_end_matches('s').parse()?;
        let shipped = Config::from_toml(&std::fs::read_to_string(repo().join("deploy/pitcrew.toml"))?)?;
        let drain = shipped.drain();
        assert!(
            secs > drain.as_secs() + 10,
            "{name} gets more than its {} s drain (its last pull, the hand-back, the flush) to stop, not {grace}",
            drain.as_secs()
        );
        assert!(
            drain >= shipped.command_timeout() + std::time::Duration::from_secs(10),
            "the shipped drain lets a command run out its timeout and be ended"
        );
        // Replies come back on the service's own inbox, the one nats.conf lets its user read.
        let inbox = environment(svc).get("PITCREW_NATS__INBOX_PREFIX").cloned().unwrap_or_default();
        let user = if name == "pitcrew" { "crew" } else { name };
        assert_eq!(inbox, format!("_INBOX_{user}"), "{name}'s inbox");
        assert!(conf.contains(&format!("subscribe: [\"{inbox}.>\"]")), "nats.conf lets {user} read {inbox}");
    }
    // The shipped file loads, and so does its example once uncommented.
    let shipped = std::fs::read_to_string(repo().join("deploy/pitcrew.toml"))?;
    Config::from_toml(&shipped).context("deploy/pitcrew.toml")?;
    let example: String = shipped
        .lines()
        .filter_map(|l| l.strip_prefix("# "))
        .filter(|l| l.starts_with('[') || l.split_once(" = ").is_some_and(|(k, _)| !k.contains(' ')))
        .map(|l| format!("{}\n", l.replace("<the output of `pitcrew gateway new-key`>", &"0".repeat(64))))
        .collect();
    let cfg = Config::from_toml(&example).with_context(|| format!("deploy/pitcrew.toml's example:\n{example}"))?;
    assert!(cfg.services.contains_key("web") && cfg.approvers.contains_key("alice"), "{example}");
    // The gateway listens on the port compose publishes.
    let gateway = environment(&c["services"]["gateway"]);
    let listen = gateway.get("PITCREW_GATEWAY__LISTEN").expect("the gateway's listen address is set").clone();
    let port = listen.rsplit(':').next().unwrap_or_default().to_string();
    let published = strings(&c["services"]["gateway"]["ports"]);
    assert!(published.iter().any(|p| p.ends_with(&format!(":{port}"))), "{listen} is published: {published:?}");
    // Every published port is on the loopback, and comes up without any variable set.
    for (name, service) in c["services"].as_mapping().into_iter().flatten() {
        for p in strings(&service["ports"]) {
            let filled = interpolate(&p);
            let parts: Vec<&str> = filled.split(':').collect();
            let valid = parts.len() == 3
                && parts[0] == "127.0.0.1"
                && parts[1].parse::<u16>().is_ok()
                && parts[2].parse::<u16>().is_ok();
            assert!(valid, "{name:?} publishes {p} ({filled}): not loopback:port:port");
        }
    }
    Ok(())
}

/// Compose's service `name`, started as its container would start it, must come up (`ready`
/// answers true), then exit 0 on SIGTERM.
async fn start_as_composed(
    env: &TestEnv,
    nats: &ConfiguredNats,
    name: &str,
    ready: impl Fn(&str, Option<u16>) -> futures::future::BoxFuture<'static, bool>,
) -> anyhow::Result<()> {
    let c = compose()?;
    let svc = &c["services"][name];
    let args = strings(&svc["command"]);
    anyhow::ensure!(!args.is_empty(), "{name} has no command");
    let mut port = None;
    let mut vars = BTreeMap::new();
    for (k, v) in environment(svc) {
        // The compose network's addresses, mapped to this test's.
        let v = match v.as_str() {
            s if s.starts_with("nats://") && s.ends_with("@nats:4222") => {
                s.replace("@nats:4222", &format!("@127.0.0.1:{}", nats.port))
            }
            "postgres://pitcrew:local-pitcrew@postgres:5432/pitcrew" => login_url(&env.db.url, "local-pitcrew")?,
            s if s.starts_with("_INBOX_") => s.to_string(),
            s if s.starts_with("0.0.0.0:") => {
                let p = pitcrew_runtime::natsd::free_port()?;
                port = Some(p);
                format!("127.0.0.1:{p}")
            }
            s => anyhow::bail!("{name}: {k} = {s}: no mapping to this test's environment"),
        };
        vars.insert(k, v);
    }
    // The container's working directory: the files compose mounts there, and none of this
    // shell's settings: only compose's.
    let cwd = tempfile::tempdir()?;
    for mount in strings(&svc["volumes"]) {
        let mut parts = mount.split(':');
        let (Some(from), Some(to)) = (parts.next(), parts.next()) else { continue };
        if let Some(name) = to.strip_prefix("/var/lib/pitcrew/") {
            std::fs::copy(repo().join(from), cwd.path().join(name)).with_context(|| format!("mounting {mount}"))?;
        }
    }
    let log_path = env.dir.path().join(format!("compose-{name}.log"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pitcrew"));
    for (k, _) in std::env::vars() {
        if k.starts_with("PITCREW_") || k == "DATABASE_URL" {
            cmd.env_remove(k);
        }
    }
    cmd.args(&args).envs(&vars).current_dir(cwd.path());
    let mut service = Pitcrew::spawn(cmd, &log_path, format!("`pitcrew {}`", args.join(" ")))?;
    service.wait_up(|log| ready(log, port)).await?;
    service.stop().await
}

/// A `pitcrew` process of a test: its log in a file, killed when the test ends, passed or
/// failed.
struct Pitcrew {
    child: std::process::Child,
    log: PathBuf,
    what: String,
}

impl Pitcrew {
    /// Start `cmd` (a `pitcrew` command) logging at info into `log`.
    fn spawn(mut cmd: Command, log: &Path, what: String) -> anyhow::Result<Pitcrew> {
        let child = cmd
            .env("PITCREW_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log)?)
            .spawn()?;
        Ok(Pitcrew { child, log: log.to_path_buf(), what })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait until `ready` answers true on the log so far; fails when the process exits first
    /// or after [`WAIT`].
    async fn wait_up(
        &mut self,
        ready: impl Fn(&str) -> futures::future::BoxFuture<'static, bool>,
    ) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !ready(&self.log()).await {
            if let Some(status) = self.child.try_wait()? {
                anyhow::bail!("{} exited ({status}):\n{}", self.what, self.log());
            }
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "{} never came up:\n{}", self.what, self.log());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// SIGTERM, then the process must exit 0 within 30 s.
    async fn stop(&mut self) -> anyhow::Result<()> {
        // SAFETY: signalling our own child by its pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = self.child.try_wait()? {
                break s;
            }
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "{} ignored SIGTERM:\n{}", self.what, self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        anyhow::ensure!(status.success(), "{} exited with {status}:\n{}", self.what, self.log());
        Ok(())
    }
}

impl Drop for Pitcrew {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Run `deploy/postgres-init.sh` as the postgres image does (as the superuser, on `url`'s
/// database), making pitcrew's login with `password`.
fn postgres_init(url: &str, password: &str) -> anyhow::Result<()> {
    let (cfg, host, port) = server_of(url)?;
    let out = Command::new("sh")
        .arg(repo().join("deploy/postgres-init.sh"))
        .env("PGHOST", host)
        .env("PGPORT", port.to_string())
        .env("POSTGRES_USER", cfg.get_user().unwrap_or("postgres"))
        .env("POSTGRES_DB", cfg.get_dbname().unwrap_or_default())
        .env("PITCREW_DB_PASSWORD", password)
        .output()?;
    let said = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(out.status.success(), "deploy/postgres-init.sh failed: {said}");
    Ok(())
}

/// The URL pitcrew's own login uses for `url`'s database.
fn login_url(url: &str, password: &str) -> anyhow::Result<String> {
    let (cfg, host, port) = server_of(url)?;
    Ok(format!("postgres://pitcrew:{password}@{host}:{port}/{}", cfg.get_dbname().unwrap_or_default()))
}

/// `url` read, with the TCP host and port of its server.
fn server_of(url: &str) -> anyhow::Result<(tokio_postgres::Config, String, u16)> {
    let cfg: tokio_postgres::Config = url.parse()?;
    let Some(tokio_postgres::config::Host::Tcp(host)) = cfg.get_hosts().first().cloned() else {
        anyhow::bail!("a TCP host in {url}")
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    Ok((cfg, host, port))
}

/// The owners of `url`'s tables and whether the `pitcrew` login is a superuser.
async fn owners(url: &str) -> anyhow::Result<(Vec<String>, bool)> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    let rows = client.query("SELECT DISTINCT tableowner::text FROM pg_tables WHERE schemaname = 'public'", &[]).await?;
    let owners = rows.iter().map(|r| r.get(0)).collect();
    let root: bool = client.query_one("SELECT rolsuper FROM pg_roles WHERE rolname = 'pitcrew'", &[]).await?.get(0);
    Ok((owners, root))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_composed_crew_and_gateway_start_serve_and_stop_cleanly() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let nats = ConfiguredNats::start(&environment(&compose()?["services"]["nats"]))?;
    // The database as the postgres image leaves it: pitcrew's login made, nothing else.
    let password = environment(&compose()?["services"]["postgres"])["PITCREW_DB_PASSWORD"].clone();
    postgres_init(&env.db.url, &password)?;
    // The crew (`up`): every stage's consumer running.
    start_as_composed(&env, &nats, "pitcrew", |log, _| {
        let up = log.contains("crew running");
        Box::pin(async move { up })
    })
    .await?;
    // The gateway on the port compose gives it: its health endpoint answers.
    start_as_composed(&env, &nats, "gateway", |_, port| {
        Box::pin(async move {
            let Some(port) = port else { return false };
            match reqwest::get(format!("http://127.0.0.1:{port}/healthz")).await {
                Ok(r) => r.status() == 200,
                Err(_) => false,
            }
        })
    })
    .await?;
    // Both migrated the same schema into the database compose names.
    let db = env.db.client().await?;
    let applied: i64 = db.query_one("SELECT count(*) FROM pitcrew_migrations", &[]).await?.get(0);
    assert!(applied >= 1, "the composed crew migrated its database");
    assert!(!nats.log().contains("Violation"), "nothing either did was refused:\n{}", nats.log());
    assert_eq!(owners(&env.db.url).await?, (vec!["pitcrew".to_string()], false), "as its own login, no superuser");

    // A database a superuser migrated (compose before the login): the script, run again by
    // hand, hands it over, and the login migrates and writes there.
    let older = pitcrew_testkit::TestDb::create().await?;
    let as_root = pitcrew_runtime::config::DatabaseConfig {
        url: older.url.clone(),
        pool_size: 1,
        migrate_on_start: false,
        statement_timeout_secs: 30,
    };
    pitcrew_runtime::Store::connect(&as_root).await?.migrate().await?;
    postgres_init(&older.url, &password)?;
    assert_eq!(owners(&older.url).await?.0, vec!["pitcrew".to_string()]);
    let login = pitcrew_runtime::config::DatabaseConfig { url: login_url(&older.url, &password)?, ..as_root };
    let store = pitcrew_runtime::Store::connect(&login).await?;
    store.migrate().await?;
    let state = pitcrew_model::RunState::new(uuid::Uuid::now_v7(), pitcrew_model::Incident::new("svc", "down"));
    assert_eq!(store.open_run(&state).await?, pitcrew_runtime::store::OpenRun::Created, "it writes");
    Ok(())
}

/// `user`'s bus on `nats`, its JetStream requests given up after a second (a refused publish
/// gets no answer at all: the server drops it and tells the connection).
async fn bus_as(nats: &ConfiguredNats, db: &str, user: &str, password: &str) -> anyhow::Result<Bus> {
    let cfg = Config::from_toml(&format!(
        "[nats]\nurl = \"{}\"\ninbox_prefix = \"{}\"\n[database]\nurl = \"{db}\"\n",
        nats.url(user, password),
        inbox_of(user)
    ))?;
    let mut bus = Bus::connect(&cfg).await?;
    bus.js.set_timeout(Duration::from_secs(1));
    Ok(bus)
}

/// The inbox nats.conf lets `user` read (the operator reads everything: the default).
fn inbox_of(user: &str) -> String {
    if user == "operator" {
        "_INBOX".into()
    } else {
        format!("_INBOX_{user}")
    }
}

/// What `user` must not do: each attempt must fail, leave the streams as they were, and be
/// named in the server's log as a violation by that user.
async fn refused(nats: &ConfiguredNats, bus: &Bus, user: &str, observer: &Bus) -> anyhow::Result<()> {
    let s = &bus.subjects;
    let stages = observer.js.get_stream(s.stages_stream()).await?.info().await?.state.last_sequence;
    let forged = serde_json::json!({ "run_id": uuid::Uuid::now_v7(), "step": "execute" });
    // A run state straight to execute: the subject plans travel on.
    let published = bus
        .publish(
            s.stage(Stage::Execute),
            &format!("{user}-forged"),
            "application/json",
            None,
            forged.to_string().into(),
        )
        .await;
    assert!(published.is_err(), "{user} published a run state to {}", s.stage(Stage::Execute));
    // The crew's streams are not its to delete.
    assert!(bus.js.delete_stream(s.stages_stream()).await.is_err(), "{user} deleted {}", s.stages_stream());
    // Nor its consumers' work to take: a pull request to execute's consumer. Allowed, it
    // would be answered (with a message, or a 408 when the 200 ms expire); refused, never.
    let next = format!("$JS.API.CONSUMER.MSG.NEXT.{}.execute", s.stages_stream());
    assert!(!pull_answered(&bus.client, &next).await?, "{user}'s pull from the crew's execute consumer was answered");
    let after = observer.js.get_stream(s.stages_stream()).await?.info().await?.state.last_sequence;
    assert_eq!(after, stages, "{user}'s attempts left the stage stream as it was");
    let log = nats.log();
    let named = |subject: &str| {
        log.lines().any(|l| l.contains(&format!("user:{user}\"")) && l.contains("Violation") && l.contains(subject))
    };
    for subject in [s.stage(Stage::Execute), format!("$JS.API.STREAM.DELETE.{}", s.stages_stream()), next] {
        assert!(named(&subject), "the server names {user}'s refused publish to {subject}:\n{log}");
    }
    Ok(())
}

/// A fresh password for each NATS user of deploy/nats.conf, by the variable it is read from.
fn passwords() -> BTreeMap<String, String> {
    ["CREW", "OPERATOR", "GATEWAY", "MONITOR", "BRIDGE"]
        .into_iter()
        .map(|u| (format!("NATS_{u}_PASSWORD"), format!("{}-{}", u.to_lowercase(), uuid::Uuid::new_v4().simple())))
        .collect()
}

/// A server whose `max_payload` cannot carry a run's state would refuse it mid-run, for good:
/// every process refuses it at start-up instead, saying what to set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_too_small_for_a_run_state_is_refused_at_start() -> anyhow::Result<()> {
    let passwords = passwords();
    let nats = ConfiguredNats::start_with(&passwords, &[("max_payload: 1MB", "max_payload: 64KB")])?;
    let url = nats.url("crew", &passwords["NATS_CREW_PASSWORD"]);
    let cfg = Config::from_toml(&format!("[nats]\nurl = \"{url}\"\ninbox_prefix = \"_INBOX_crew\"\n"))?;
    let bus = Bus::connect(&cfg).await?;
    let err = bus.ensure_streams().await.expect_err("refused").to_string();
    assert!(
        err.contains("max_payload is 65536 bytes, less than the 524288") && err.contains("set max_payload to 1MB"),
        "{err}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_nats_user_does_its_services_job_and_nothing_more() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let passwords = passwords();
    let pw = |user: &str| passwords[&format!("NATS_{}_PASSWORD", user.to_uppercase())].clone();
    let nats = ConfiguredNats::start(&passwords)?;
    let db = env.db.url.clone();
    // A wrong password is refused at connect, with a readable error that hides it.
    let wrong =
        Config::from_toml(&format!("[nats]\nurl = \"{}\"\n[database]\nurl = \"{db}\"\n", nats.url("crew", "guess")))?;
    let err = Bus::connect(&wrong).await.err().expect("a wrong password is refused").to_string();
    assert!(err.contains("authorization violation") && err.contains("check the user and password"), "{err}");
    assert!(!err.contains("guess"), "the error shows no password: {err}");

    // The crew, as `crew`, in its own process: a service whose fix policy holds for approval.
    let healthy = env.path("svc-healthy");
    let book = env.path("playbook.toml");
    std::fs::write(
        &book,
        "[[rule]]\nname = \"locked\"\nmatch = \"(?i)stale lock\"\ndiagnosis = \"{service} is held by a stale lock\"\n\
         plans = [[\"rm -f /nonexistent/svc.lock\", \"touch HEALTHY\"]]\n"
            .replace("HEALTHY", &healthy),
    )?;
    let toml = format!(
        "[nats]\nurl = \"{}\"\ninbox_prefix = \"_INBOX_crew\"\n[database]\nurl = \"{db}\"\n[verify]\nchecks = 2\ninterval_ms = 100\n\
         [approvers]\nann = \"approver\"\n[reasoning]\nplaybook_file = \"{book}\"\n\
         [services.svc]\nhost = \"local\"\nrestart = \"touch {healthy}\"\n\
         check = {{ kind = \"command\", command = \"test -f {healthy}\" }}\n",
        nats.url("crew", &pw("crew"))
    );
    let file = env.path("pitcrew.toml");
    std::fs::write(&file, &toml)?;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pitcrew"));
    cmd.args(["--config", &file, "up"]).env_remove("DATABASE_URL").env_remove("PITCREW_NATS_URL");
    let mut crew = Pitcrew::spawn(cmd, Path::new(&env.path("crew.log")), "the crew".into())?;
    crew.wait_up(|log| {
        let up = log.contains("crew running");
        Box::pin(async move { up })
    })
    .await?;
    // The operator watches everything.
    let operator = bus_as(&nats, &db, "operator", &pw("operator")).await?;
    let mut events = Events::follow(&operator, false).await.context("the operator follows the events")?;

    // The monitor opens an incident, as `pitcrew monitor` does.
    let monitor = bus_as(&nats, &db, "monitor", &pw("monitor")).await?;
    monitor.ensure_streams().await.context("the monitor's streams")?;
    let incident = pitcrew::cli::incident("svc", "stale lock held", None, Severity::Critical, None)?;
    let run = monitor.open_incident(&incident).await.context("the monitor opens an incident")?;
    events.kind(run, EventKind::ApprovalRequested, WAIT).await?;

    // The bridge takes the request from its durable consumer and publishes ann's click.
    let bridge = bus_as(&nats, &db, "bridge", &pw("bridge")).await?;
    bridge.ensure_streams().await.context("the bridge's streams")?;
    let requests = pitcrew_bridge::post::requests_consumer(&bridge, "deploy-test-bridge", 16)
        .await
        .context("the bridge's consumer")?;
    let mut batch = requests.fetch().max_messages(1).expires(Duration::from_secs(5)).messages().await?;
    let msg = batch.next().await.expect("the approval request reached the bridge").map_err(|e| anyhow::anyhow!(e))?;
    let req: pitcrew_model::ApprovalRequest = serde_json::from_slice(&msg.payload)?;
    assert_eq!(req.run_id, run);
    msg.ack().await.map_err(|e| anyhow::anyhow!(e))?;
    let store = pitcrew_runtime::Store::connect(&Config::from_toml(&toml)?.database).await?;
    let click = DecisionInput {
        run,
        plan_hash: Some(&req.plan_hash),
        attempt: Some(req.attempt),
        decision: Decision::Approve,
        by: "ann",
        reason: None,
        channel: "slack",
        racing: Some(&Config::from_toml(&toml)?),
    };
    submit(&bridge, Some(&store), click).await.context("the bridge publishes a decision")?;
    let end = events.terminal(run, WAIT).await?;
    assert_eq!(end.kind, EventKind::Resolved, "{}", end.message);

    // The gateway follows the run's timeline (an ordered consumer on the events stream) and
    // reads the request back, as its routes do.
    let gateway = bus_as(&nats, &db, "gateway", &pw("gateway")).await?;
    gateway.ensure_streams().await.context("the gateway's streams")?;
    let shown = pitcrew_runtime::approvals::approval_request(&gateway, run).await?;
    assert_eq!(shown.plan_hash, req.plan_hash);
    let timeline = gateway.js.get_stream(gateway.subjects.events_stream()).await?;
    let reader = timeline
        .create_consumer(OrderedConfig { filter_subject: gateway.subjects.events_of(run), ..Default::default() })
        .await?;
    let mut seen = reader.messages().await?;
    let first = tokio::time::timeout(WAIT, seen.next()).await?.expect("a timeline").map_err(|e| anyhow::anyhow!(e))?;
    assert!(first.subject.starts_with(&format!("pitcrew.events.{run}.")), "{}", first.subject);
    assert!(!nats.log().contains("Violation"), "the services' own work was never refused:\n{}", nats.log());

    // What none of them may do.
    refused(&nats, &monitor, "monitor", &operator).await?;
    refused(&nats, &bridge, "bridge", &operator).await?;
    refused(&nats, &gateway, "gateway", &operator).await?;
    // A monitor decides nothing, and a bridge opens no incidents.
    let decision = serde_json::json!({ "run_id": run, "decision": "approve", "by": "ann" }).to_string();
    let decided = monitor
        .publish(monitor.subjects.approval_decided(run), "m-decides", "application/json", Some(run), decision.into())
        .await;
    assert!(decided.is_err(), "the monitor published an approval decision");
    let opened = bridge.open_incident(&incident).await;
    assert!(opened.is_err(), "the bridge opened an incident");
    // Nobody reads another's inbox: what the crew pulls from the stage stream comes back on
    // the crew's, which a monitor may not subscribe to.
    let _spy = monitor.client.subscribe("_INBOX_crew.>").await?;
    let _shared = monitor.client.subscribe("_INBOX.>").await?;
    monitor.client.flush().await?;
    // Nor does a bridge take the crew's reader of the decisions.
    let next = format!("$JS.API.CONSUMER.MSG.NEXT.{}.approval-decisions", bridge.subjects.approvals_stream());
    assert!(
        !pull_answered(&bridge.client, &next).await?,
        "the bridge's pull from the crew's approval-decisions was answered"
    );
    let log = nats.log();
    let violation = |user: &str, what: &str| {
        log.lines().any(|l| l.contains(&format!("user:{user}\"")) && l.contains("Violation") && l.contains(what))
    };
    for spied in ["_INBOX_crew.>", "_INBOX.>"] {
        assert!(violation("monitor", spied), "the server refused the monitor's subscription to {spied}:\n{log}");
    }
    assert!(violation("bridge", &next), "the server refused the bridge's pull:\n{log}");

    crew.stop().await?;
    assert!(!crew.log().contains("Violation"), "the crew was never refused:\n{}", crew.log());
    Ok(())
}

/// A monitor (or gateway) that starts before any crew ever ran makes the incidents stream but
/// may not make intake's consumer: the stream keeps every incident until the crew's first
/// start makes the consumer and turns the stream into one that keeps an incident only until
/// intake took it. Made that way at once, with no consumer, it would have dropped them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incidents_opened_before_any_crew_ran_wait_for_it() -> anyhow::Result<()> {
    use async_nats::jetstream::{consumer::PullConsumer, stream::RetentionPolicy};
    let env = TestEnv::start().await?;
    let passwords = passwords();
    let pw = |user: &str| passwords[&format!("NATS_{}_PASSWORD", user.to_uppercase())].clone();
    let nats = ConfiguredNats::start(&passwords)?;
    let monitor = bus_as(&nats, &env.db.url, "monitor", &pw("monitor")).await?;
    monitor.ensure_streams().await.context("the monitor's streams")?;
    let incident = pitcrew::cli::incident("svc", "down before the crew ever ran", None, Severity::Critical, None)?;
    monitor.open_incident(&incident).await.context("the monitor opens an incident")?;
    let name = monitor.subjects.incidents_stream();
    let mut incidents = monitor.js.get_stream(&name).await?;
    let info = incidents.info().await?.clone();
    assert_eq!((info.config.retention, info.state.messages), (RetentionPolicy::Limits, 1), "kept: {info:?}");

    let crew = bus_as(&nats, &env.db.url, "crew", &pw("crew")).await?;
    crew.ensure_streams().await.context("the crew's streams")?;
    let info = incidents.info().await?.clone();
    assert_eq!((info.config.retention, info.state.messages), (RetentionPolicy::Interest, 1), "still kept: {info:?}");
    let mut intake: PullConsumer =
        crew.js.get_stream(&name).await?.get_consumer(Stage::Intake.as_str()).await.map_err(|e| anyhow::anyhow!(e))?;
    assert_eq!(intake.info().await?.num_pending, 1, "waiting for intake");
    Ok(())
}

/// A process whose NATS user may not do what start-up needs (here the monitor under another
/// prefix than the server's permissions name: it may not make that prefix's streams) stops at
/// once saying what the server refused: the refused request only times out in the client, and
/// the process waited for it forever as if NATS were down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_whose_nats_user_is_refused_at_start_up_stops_saying_so() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let passwords = passwords();
    let nats = ConfiguredNats::start(&passwords)?;
    let toml = format!(
        "prefix = \"elsewhere\"\n[nats]\nurl = \"{}\"\ninbox_prefix = \"_INBOX_monitor\"\n[database]\nurl = \"{}\"\n\
         [services.svc]\nhost = \"local\"\ncheck = {{ kind = \"command\", command = \"true\" }}\n",
        nats.url("monitor", &passwords["NATS_MONITOR_PASSWORD"]),
        env.db.url
    );
    let file = env.path("pitcrew.toml");
    std::fs::write(&file, &toml)?;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pitcrew"));
    cmd.args(["--config", &file, "monitor"]).env_remove("DATABASE_URL").env_remove("PITCREW_NATS_URL");
    let mut monitor = Pitcrew::spawn(cmd, Path::new(&env.path("monitor.log")), "the monitor".into())?;
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = monitor.child.try_wait()? {
            break status;
        }
        anyhow::ensure!(started.elapsed() < Duration::from_secs(90), "still running:\n{}", monitor.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let log = monitor.log();
    assert!(!status.success(), "{status}: {log}");
    assert!(log.contains("NATS refused stream ELSEWHERE_INCIDENTS") && log.contains("Permissions Violation"), "{log}");
    assert!(!log.contains("waiting for NATS"), "{log}");
    assert!(!log.contains(&passwords["NATS_MONITOR_PASSWORD"]), "{log}");
    Ok(())
}
