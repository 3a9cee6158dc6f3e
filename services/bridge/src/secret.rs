//! Secrets read from the environment at start-up, wrapped so that no `Debug`, `Display` or
//! log line can print them.

use std::fmt;

/// A token or signing secret. Only `expose` gives the value, at the one place it is used.
#[derive(Clone)]
pub struct Secret(String);

/// A secret variable is missing or empty; the message names the variable, never a value.
#[derive(Debug, thiserror::Error)]
#[error("{what} is not set: export {var} (the variable named by {key} in [bridge.{bridge}])")]
pub struct MissingSecret {
    pub what: &'static str,
    pub var: String,
    pub key: &'static str,
    pub bridge: &'static str,
}

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// Read `var`; missing or blank is an error naming what it should hold.
    pub fn from_env(
        var: &str,
        what: &'static str,
        key: &'static str,
        bridge: &'static str,
    ) -> Result<Secret, MissingSecret> {
        match std::env::var(var) {
            Ok(v) if !v.trim().is_empty() => {
                // Redacted wherever it shows, a command's output or a log line.
                let _ = pitcrew_model::redact::register_secret(&v);
                Ok(Secret(v.trim().to_string()))
            }
            _ => Err(MissingSecret { what, var: var.to_string(), key, bridge }),
        }
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_printed() {
        let s = Secret::new("xoxb-very-secret");
        assert_eq!(format!("{s:?} {s}"), "[redacted] [redacted]");
        assert_eq!(s.expose(), "xoxb-very-secret");
        let e =
            Secret::from_env("PITCREW_BRIDGE_TEST_UNSET_VAR", "the Slack bot token", "token_env", "slack").unwrap_err();
        assert_eq!(
            e.to_string(),
            "the Slack bot token is not set: export PITCREW_BRIDGE_TEST_UNSET_VAR (the variable named by token_env in [bridge.slack])"
        );
    }
}
