//! One tracing set-up for every binary: `PITCREW_LOG` (or `RUST_LOG`) filters, and
//! `PITCREW_LOG_FORMAT=json` switches to JSON lines. Logs go to stderr.

use tracing_subscriber::EnvFilter;

/// Install the global subscriber; `default` is the filter when no variable is set.
pub fn init(default: &str) {
    let filter = std::env::var("PITCREW_LOG")
        .ok()
        .or_else(|| std::env::var("RUST_LOG").ok())
        .unwrap_or_else(|| default.to_string());
    let filter = EnvFilter::try_new(&filter).unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let res = if std::env::var("PITCREW_LOG_FORMAT").as_deref() == Ok("json") {
        builder.json().try_init()
    } else {
        builder.compact().try_init()
    };
    let _ = res;
}
