//! Measures the SSH command round trip against a real local sshd: on the reused master
//! connection versus a fresh connection per command, logged in as the fault suite's target
//! user (as root) or as yourself. Prints medians in milliseconds.
//!
//!     cargo run --release -p pitcrew --example ssh_rtt

use pitcrew_exec::{Executor, Fleet};
use pitcrew_testkit::sshd::start_target;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let sshd = start_target()?;
    let hosts = || BTreeMap::from([("box".to_string(), sshd.host(true))]);
    let t = Duration::from_secs(10);
    let reused = Fleet::new(hosts(), 4096);
    reused.run("box", "true", t).await?;
    let mut warm = Vec::new();
    for _ in 0..100 {
        let s = Instant::now();
        reused.run("box", "true", t).await?;
        warm.push(s.elapsed().as_secs_f64() * 1000.0);
    }
    let mut fresh = Vec::new();
    for _ in 0..20 {
        let f = Fleet::new(hosts(), 4096);
        let s = Instant::now();
        f.run("box", "true", t).await?;
        fresh.push(s.elapsed().as_secs_f64() * 1000.0);
    }
    println!(
        "{}",
        serde_json::json!({
            "reused_connection_ms_p50": (median(warm) * 100.0).round() / 100.0,
            "fresh_connection_ms_p50": (median(fresh) * 100.0).round() / 100.0,
            "samples": { "reused": 100, "fresh": 20 },
        })
    );
    Ok(())
}
