//! A gateway to measure `POST /v1/incidents` against: its own nats-server and fresh database
//! (pitcrew-testkit), one operator key, the service `web` in the inventory, no crew (only the
//! gateway's own work is measured: a Postgres lookup, the JetStream publish and its ack, the
//! audit row). Prints the URL and a `wrk` command, writes the wrk script, and serves for
//! `SECONDS` (default 120) or until Ctrl-C.
//!
//! `cargo run -p pitcrew-gateway --example incidents_load -- 120`

use futures::FutureExt;
use pitcrew_gateway::access::hash_key;
use pitcrew_runtime::{Bus, Config, Store};
use pitcrew_testkit::TestEnv;
use std::time::Duration;

const KEY: &str = "load-test-operator-key";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let secs: u64 = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(120);
    let env = TestEnv::start().await?;
    let toml = env.config_toml(&format!(
        "[services.web]\nhost = \"local\"\n\
         [gateway]\nrate_per_sec = 1000000.0\nrate_burst = 1000000\n\
         [gateway.keys.load]\nrole = \"operator\"\nsha256 = \"{}\"\n",
        hash_key(KEY)
    ));
    let toml = toml.replacen("pool_size = 8\n", "pool_size = 16\n", 1);
    let cfg = Config::from_toml(&toml)?;
    let bus = Bus::connect(&cfg).await?;
    bus.ensure_streams().await?;
    let store = Store::connect(&cfg.database).await?;
    store.migrate().await?;
    let shutdown = async move {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(secs)) => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    .boxed()
    .shared();
    let gw = pitcrew_gateway::Gateway::new(cfg, bus.clone(), store, shutdown)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let script = env.dir.path().join("incidents.lua");
    std::fs::write(
        &script,
        format!(
            "wrk.method = \"POST\"\nwrk.path = \"/v1/incidents\"\n\
             wrk.headers[\"Content-Type\"] = \"application/json\"\nwrk.headers[\"Authorization\"] = \"Bearer {KEY}\"\n\
             counter = 0\nrequest = function()\n  counter = counter + 1\n  \
             return wrk.format(nil, nil, nil, '{{\"service\":\"web\",\"error\":\"connection refused ' .. counter .. '\"}}')\nend\n"
        ),
    )?;
    println!("gateway at {url} for {secs} s");
    println!("wrk -t2 -c32 -d30s --latency -s {} {url}", script.display());
    pitcrew_gateway::serve(gw, listener).await?;
    let mut stream = bus.js.get_stream(bus.subjects.incidents_stream()).await?;
    println!("incidents published: {}", stream.info().await?.state.last_sequence);
    Ok(())
}
