//! The deployment files, checked without Docker: `deploy/nats.conf` is validated by the real
//! nats-server; `docker-compose.yml` agrees with itself (credentials, ports, health checks);
//! and every pitcrew service in it is started as the container would start it (the same
//! arguments after the image's `ENTRYPOINT ["pitcrew"]`, the same environment, with the
//! compose network's addresses mapped to this test's nats-server, database and ports) and must
//! come up, serve, and stop cleanly on SIGTERM.

use pitcrew_testkit::TestEnv;
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
            out.insert(k.as_str().unwrap_or_default().to_string(), value);
        }
    }
    out
}

#[test]
fn the_nats_config_is_valid_for_the_real_server() -> anyhow::Result<()> {
    let server = pitcrew_runtime::natsd::find_binary()?;
    let out = Command::new(&server).arg("-c").arg(repo().join("deploy/nats.conf")).arg("-t").output()?;
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "nats-server -t refused deploy/nats.conf: {said}");
    assert!(said.contains("is valid"), "{said}");
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
    // Postgres is created with the credentials and database the pitcrew services use.
    let pg = environment(&c["services"]["postgres"]);
    let url = format!("postgres://postgres:{}@postgres:5432/{}", pg["POSTGRES_PASSWORD"], pg["POSTGRES_DB"]);
    // NATS: the health check asks the monitoring port nats.conf opens; the client port is 4222.
    let conf = std::fs::read_to_string(repo().join("deploy/nats.conf"))?;
    assert!(conf.lines().any(|l| l.trim() == "http: 0.0.0.0:8222"), "nats.conf serves monitoring on 8222");
    let health = strings(&c["services"]["nats"]["healthcheck"]["test"]).join(" ");
    assert!(health.contains("http://localhost:8222/healthz"), "{health}");
    let dockerfile = std::fs::read_to_string(repo().join("deploy/Dockerfile"))?;
    assert!(dockerfile.contains("ENTRYPOINT [\"pitcrew\"]"), "the image runs pitcrew with the command as arguments");
    for name in ["pitcrew", "gateway"] {
        let svc = &c["services"][name];
        assert_eq!(svc["build"]["dockerfile"].as_str(), Some("deploy/Dockerfile"), "{name} is built from the image");
        let env = environment(svc);
        assert_eq!(env.get("DATABASE_URL"), Some(&url), "{name} uses the database compose creates");
        assert_eq!(env.get("PITCREW_NATS_URL").map(String::as_str), Some("nats://nats:4222"), "{name}");
        for dep in ["nats", "postgres"] {
            assert_eq!(svc["depends_on"][dep]["condition"].as_str(), Some("service_healthy"), "{name} waits for {dep}");
        }
    }
    // The gateway listens on the port compose publishes.
    let gateway = environment(&c["services"]["gateway"]);
    let listen = gateway.get("PITCREW_GATEWAY__LISTEN").expect("the gateway's listen address is set").clone();
    let port = listen.rsplit(':').next().unwrap_or_default().to_string();
    let published = strings(&c["services"]["gateway"]["ports"]);
    assert!(published.iter().any(|p| p.ends_with(&format!(":{port}"))), "{listen} is published: {published:?}");
    Ok(())
}

/// Compose's service `name`, started as its container would start it, must come up (`ready`
/// answers true), then exit 0 on SIGTERM.
async fn start_as_composed(
    env: &TestEnv,
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
            "nats://nats:4222" => env.nats.url(),
            "postgres://postgres:pitcrew@postgres:5432/pitcrew" => env.db.url.clone(),
            s if s.starts_with("0.0.0.0:") => {
                let p = pitcrew_runtime::natsd::free_port()?;
                port = Some(p);
                format!("127.0.0.1:{p}")
            }
            s => anyhow::bail!("{name}: {k} = {s}: no mapping to this test's environment"),
        };
        vars.insert(k, v);
    }
    // A directory without a pitcrew.toml, and none of this shell's settings: only compose's.
    let cwd = tempfile::tempdir()?;
    let log_path = env.dir.path().join(format!("compose-{name}.log"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pitcrew"));
    for (k, _) in std::env::vars() {
        if k.starts_with("PITCREW_") || k == "DATABASE_URL" {
            cmd.env_remove(k);
        }
    }
    let mut child = cmd
        .args(&args)
        .envs(&vars)
        .env("PITCREW_LOG", "info")
        .current_dir(cwd.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()?;
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if ready(&log(), port).await {
            break;
        }
        if let Some(status) = child.try_wait()? {
            anyhow::bail!("`pitcrew {}` exited ({status}):\n{}", args.join(" "), log());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "`pitcrew {}` never came up:\n{}",
            args.join(" "),
            log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // SAFETY: signalling our own child by its pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if tokio::time::Instant::now() > deadline {
            let _ = child.kill();
            anyhow::bail!("`pitcrew {}` ignored SIGTERM:\n{}", args.join(" "), log());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    anyhow::ensure!(status.success(), "`pitcrew {}` exited with {status}:\n{}", args.join(" "), log());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_composed_crew_and_gateway_start_serve_and_stop_cleanly() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    // The crew (`up`): every stage's consumer running.
    start_as_composed(&env, "pitcrew", |log, _| {
        let up = log.contains("crew running");
        Box::pin(async move { up })
    })
    .await?;
    // The gateway on the port compose gives it: its health endpoint answers.
    start_as_composed(&env, "gateway", |_, port| {
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
    Ok(())
}
