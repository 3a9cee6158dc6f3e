//! Prometheus Alertmanager's webhook payload (version 4) and how an alert becomes an
//! incident: the service and host from configurable labels, the error from the annotations,
//! and an id derived from the alert's fingerprint and start, so a re-sent alert (Alertmanager
//! retries and repeats) names the same run.

use chrono::{DateTime, SecondsFormat, Utc};
use pitcrew_model::trim::clip;
use pitcrew_model::{Incident, Severity};
use pitcrew_runtime::config::GatewayConfig;
use serde::Deserialize;
use std::collections::BTreeMap;
use uuid::Uuid;

/// The webhook body. Unknown fields are ignored: Alertmanager adds fields over versions.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Payload {
    pub version: String,
    #[serde(default)]
    pub group_key: String,
    #[serde(default)]
    pub truncated_alerts: u64,
    pub status: String,
    #[serde(default)]
    pub receiver: String,
    pub alerts: Vec<Alert>,
}

/// One alert of the group.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Alert {
    pub status: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    pub starts_at: DateTime<Utc>,
    #[serde(default)]
    pub ends_at: Option<DateTime<Utc>>,
    #[serde(default)]
    pub generator_url: String,
    pub fingerprint: String,
}

/// What to do with one alert, decided before anything is written.
#[derive(Debug, Clone)]
pub enum Action {
    /// Open (or find) the run of this incident.
    Fire(Incident),
    /// Record on the alert's run that the source says it is over.
    Resolve { run: Uuid, fingerprint: String, ends_at: Option<DateTime<Utc>> },
}

/// Namespace of alert-derived incident ids.
const NAMESPACE: Uuid = Uuid::from_u128(0x6a1f_2b1c_9d4e_4c7a_8f3b_5e2d_1c0a_9b77);

/// The run id of an alert: the same alert (fingerprint and start) always maps to the same run.
pub fn run_id(fingerprint: &str, starts_at: DateTime<Utc>) -> Uuid {
    let key = format!("alertmanager:{fingerprint}:{}", starts_at.to_rfc3339_opts(SecondsFormat::Nanos, true));
    Uuid::new_v5(&NAMESPACE, key.as_bytes())
}

/// Most alerts one payload may carry (Alertmanager's `max_alerts` keeps a group under it).
pub const MAX_ALERTS: usize = 1000;

/// One alert refused: where it is in the payload, its fingerprint, and what is wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    pub fingerprint: String,
    pub error: String,
}

/// Check the payload and turn each alert into an action, or a refusal naming the alert and
/// what is wrong. One alert that cannot become an incident (no service label, a service not
/// in the inventory) does not hold back the others of its group: Alertmanager retries only on
/// a 5xx and would never re-send them. A payload that is wrong as a whole is an error.
pub fn actions(
    p: &Payload,
    cfg: &GatewayConfig,
    services: &dyn Fn(&str) -> bool,
) -> Result<Vec<Result<Action, Refused>>, String> {
    if p.version != "4" {
        return Err(format!(
            "unsupported Alertmanager payload version '{}': pitcrew reads version 4",
            clip(&p.version, 16)
        ));
    }
    if p.alerts.is_empty() {
        return Err("the payload has no alerts".into());
    }
    // Each alert may open a run: one request (one rate-limit token) must not open thousands.
    if p.alerts.len() > MAX_ALERTS {
        return Err(format!(
            "the payload has {} alerts, more than the {MAX_ALERTS} one request may carry: \
             set max_alerts: {MAX_ALERTS} in Alertmanager's webhook_config for pitcrew",
            p.alerts.len()
        ));
    }
    let out = p.alerts.iter().enumerate().map(|(i, a)| action(i, a, cfg, services)).collect();
    Ok(out)
}

fn action(i: usize, a: &Alert, cfg: &GatewayConfig, services: &dyn Fn(&str) -> bool) -> Result<Action, Refused> {
    let name = a.labels.get("alertname").map(String::as_str).unwrap_or("-");
    let at = format!("alerts[{i}] (alertname {}, fingerprint {})", clip(name, 64), clip(&a.fingerprint, 32));
    let refused = |error: String| Refused { fingerprint: clip(&a.fingerprint, 64), error };
    if a.fingerprint.trim().is_empty() || a.fingerprint.len() > 64 {
        return Err(refused(format!("alerts[{i}]: 'fingerprint' must be 1-64 characters")));
    }
    // Alertmanager's are hex. A control character (a NUL) cannot be stored: its resolution
    // failed with 503 on every re-send, and the rest of its group with it.
    if a.fingerprint.chars().any(char::is_control) {
        return Err(refused(format!("alerts[{i}]: 'fingerprint' holds a control character")));
    }
    match a.status.as_str() {
        "firing" => incident(a, cfg, services).map(Action::Fire).map_err(|e| refused(format!("{at}: {e}"))),
        "resolved" => Ok(Action::Resolve {
            run: run_id(&a.fingerprint, a.starts_at),
            fingerprint: a.fingerprint.clone(),
            ends_at: a.ends_at,
        }),
        other => Err(refused(format!("{at}: status '{}' is neither firing nor resolved", clip(other, 16)))),
    }
}

fn first_label<'a>(a: &'a Alert, names: &[String]) -> Option<&'a str> {
    names.iter().find_map(|n| a.labels.get(n).map(|v| v.trim()).filter(|v| !v.is_empty()))
}

/// `10.0.0.5:9100` → `10.0.0.5`: the instance label names a scrape target, not a host. Also
/// a blackbox probe's URL (`https://web-1.example.com/health` → `web-1.example.com`) and a
/// bracketed IPv6 address (`[2001:db8::1]:9100` → `2001:db8::1`).
fn strip_port(instance: &str) -> &str {
    let host = instance.split_once("://").map_or(instance, |(_, rest)| rest);
    let host = host.split(['/', '?', '#']).next().unwrap_or(host);
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    if let Some(v6) = host.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    match host.rsplit_once(':') {
        Some((h, port)) if !h.is_empty() && !h.contains(':') && port.chars().all(|c| c.is_ascii_digit()) => h,
        _ => host,
    }
}

/// A host name an incident can carry, else none: an instance label that names no host the
/// inventory could (a path, a socket) leaves the alert on its service's own host rather than
/// refusing it (Alertmanager never sends a refused alert again).
fn host_of(instance: &str) -> Option<String> {
    let host = strip_port(instance);
    let ok = !host.is_empty()
        && host.len() <= pitcrew_model::incident::MAX_NAME_LEN
        && host.chars().all(|c| c.is_ascii_alphanumeric() || "._-:".contains(c));
    ok.then(|| host.to_string())
}

/// The alert's labels as an incident keeps them: at most `MAX_LABELS`, each value as
/// `Incident::validate` keeps it and cut to fit `MAX_LABEL_LEN` (a key longer than that is
/// dropped): labels describe, they never decide whether an alert is handled.
fn kept_labels(labels: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    use pitcrew_model::incident::{MAX_LABELS, MAX_LABEL_LEN};
    labels
        .iter()
        // validate replaces a key's NULs too (each becomes three bytes).
        .map(|(k, v)| (pitcrew_model::trim::storable(k.clone()), v))
        .filter(|(k, _)| k.len() <= MAX_LABEL_LEN)
        .take(MAX_LABELS)
        .map(|(k, v)| {
            let v = kept_value(&k, v);
            (k, v)
        })
        .collect()
}

/// A label's value that fits `MAX_LABEL_LEN` once `Incident::validate` has redacted it.
/// Redaction makes text longer (`app:pw@` becomes `app:[REDACTED]@`, a NUL a three-byte
/// U+FFFD): cut before it, a value at the limit would grow past it and the whole alert be
/// refused, which Alertmanager never sends again.
fn kept_value(key: &str, value: &str) -> String {
    use pitcrew_model::incident::MAX_LABEL_LEN;
    // What validate makes of a value.
    let validated = |v: &str| pitcrew_model::incident::kept_label_value(key, v);
    let whole = validated(value);
    if validated(&whole).len() <= MAX_LABEL_LEN {
        return whole;
    }
    // A cut can leave the start of a redaction a pattern matches again, longer (`token=[RED…`
    // becomes `token=[REDACTED]`): what validate makes of the cut is measured, and the cut
    // made shorter by what it is over until it fits. `clip` appends '…'.
    let mut cut = MAX_LABEL_LEN - '…'.len_utf8();
    loop {
        let kept = validated(&clip(&whole, cut));
        let over = validated(&kept).len().saturating_sub(MAX_LABEL_LEN);
        if over == 0 || cut == 0 {
            return kept;
        }
        cut = cut.saturating_sub(over);
    }
}

fn incident(a: &Alert, cfg: &GatewayConfig, services: &dyn Fn(&str) -> bool) -> Result<Incident, String> {
    let service = first_label(a, &cfg.service_labels).ok_or_else(|| {
        format!("none of the labels {:?} names the service ([gateway] service_labels)", cfg.service_labels)
    })?;
    if !services(service) {
        return Err(format!(
            "unknown service '{}': add [services.{}] to the inventory or map another label",
            clip(service, 64),
            clip(service, 64)
        ));
    }
    let alertname = a.labels.get("alertname").map(String::as_str).unwrap_or("alert");
    let text = ["summary", "description", "message"].iter().find_map(|k| a.annotations.get(*k)).map(|s| s.trim());
    let error = match text {
        Some(t) if !t.is_empty() => format!("{alertname}: {t}"),
        _ => format!("{alertname} is firing"),
    };
    let severity = match a.labels.get("severity").map(|s| s.to_ascii_lowercase()).as_deref() {
        Some("critical" | "page" | "error" | "high") => Severity::Critical,
        Some("info" | "none" | "low") => Severity::Info,
        _ => Severity::Warning,
    };
    let mut inc = Incident {
        id: Some(run_id(&a.fingerprint, a.starts_at)),
        service: service.to_string(),
        // The first of the host labels that names a host (an unusable `host` label does not
        // hide a usable `instance`).
        host: cfg.host_labels.iter().filter_map(|n| a.labels.get(n)).find_map(|v| host_of(v.trim())),
        // Redacted (and its NULs replaced, three bytes each) before it is cut: both make the
        // text longer, and an alert refused for it is never sent again.
        error: clip(
            &pitcrew_model::trim::storable(pitcrew_model::redact::redact(&error).into_owned()),
            pitcrew_model::incident::MAX_ERROR_LEN - 16,
        ),
        severity,
        source: Some("alertmanager".into()),
        fingerprint: Some(format!("am-{}", a.fingerprint.trim())),
        labels: kept_labels(&a.labels),
        observed_at: Some(a.starts_at),
    };
    inc.validate().map_err(|e| e.to_string())?;
    Ok(inc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(labels: &str, status: &str) -> Payload {
        serde_json::from_str(&format!(
            r#"{{"version":"4","groupKey":"g","status":"{status}","receiver":"pitcrew","groupLabels":{{}},
               "commonLabels":{{}},"commonAnnotations":{{}},"externalURL":"http://am","truncatedAlerts":0,
               "alerts":[{{"status":"{status}","labels":{labels},"annotations":{{"summary":"connection refused"}},
               "startsAt":"2026-11-22T07:00:00.123Z","endsAt":"0001-01-01T00:00:00Z",
               "generatorURL":"http://prom","fingerprint":"4c1f9e2a"}}]}}"#
        ))
        .unwrap()
    }

    #[test]
    fn a_firing_alert_becomes_a_stable_incident() {
        let cfg = GatewayConfig::default();
        let known = |s: &str| s == "web";
        let p =
            payload(r#"{"alertname":"WebDown","job":"web","instance":"10.0.0.5:9100","severity":"page"}"#, "firing");
        let a = actions(&p, &cfg, &known).unwrap();
        let Ok(Action::Fire(i)) = &a[0] else { panic!("{a:?}") };
        assert_eq!((i.service.as_str(), i.host.as_deref()), ("web", Some("10.0.0.5")));
        assert_eq!(i.error, "WebDown: connection refused");
        assert_eq!(i.severity, Severity::Critical);
        assert_eq!(i.fingerprint.as_deref(), Some("am-4c1f9e2a"));
        let again = actions(&p, &cfg, &known).unwrap();
        let Ok(Action::Fire(j)) = &again[0] else { panic!() };
        assert_eq!(i.id, j.id, "a re-sent alert names the same run");
        let resolved = payload(r#"{"alertname":"WebDown","job":"web"}"#, "resolved");
        let Ok(Action::Resolve { run, .. }) = &actions(&resolved, &cfg, &known).unwrap()[0] else { panic!() };
        assert_eq!(Some(*run), i.id, "the resolved alert names the firing alert's run");
    }

    /// One request opens at most MAX_ALERTS runs: a larger group is refused whole, naming
    /// Alertmanager's own setting that keeps groups under it.
    #[test]
    fn a_payload_of_more_alerts_than_one_request_may_open_is_refused() {
        let cfg = GatewayConfig::default();
        let known = |s: &str| s == "web";
        let mut p = payload(r#"{"alertname":"WebDown","job":"web"}"#, "firing");
        let one = p.alerts[0].clone();
        p.alerts = (0..MAX_ALERTS).map(|i| Alert { fingerprint: format!("{i:08x}"), ..one.clone() }).collect();
        assert_eq!(actions(&p, &cfg, &known).unwrap().len(), MAX_ALERTS);
        p.alerts.push(one);
        let err = actions(&p, &cfg, &known).unwrap_err();
        assert!(err.contains("1001 alerts, more than the 1000") && err.contains("max_alerts: 1000"), "{err}");
    }

    /// A fingerprint no row can hold is refused alone, firing or resolved: the alerts after
    /// it in the group are still taken.
    #[test]
    fn a_fingerprint_with_a_control_character_is_refused_alone() {
        let cfg = GatewayConfig::default();
        let known = |s: &str| s == "web";
        for status in ["resolved", "firing"] {
            let mut p = payload(r#"{"alertname":"WebDown","job":"web"}"#, status);
            let mut good = p.alerts[0].clone();
            good.fingerprint = "4c1f9e2b".into();
            p.alerts[0].fingerprint = "ab\u{0}".into();
            p.alerts.push(good);
            let a = actions(&p, &cfg, &known).unwrap();
            let Err(r) = &a[0] else { panic!("{status}: {a:?}") };
            assert!(r.error.contains("alerts[0]: 'fingerprint' holds a control character"), "{}", r.error);
            assert!(a[1].is_ok(), "{status}: {a:?}");
        }
    }

    #[test]
    fn an_alert_is_kept_whatever_its_instance_labels_and_summary_look_like() {
        for (instance, host) in [
            ("10.0.0.5:9100", Some("10.0.0.5")),
            ("https://web-1.example.com:8443/health?x=1", Some("web-1.example.com")),
            ("[2001:db8::1]:9100", Some("2001:db8::1")),
            ("2001:db8::1", Some("2001:db8::1")),
            ("unix:///run/web.sock", None),
        ] {
            assert_eq!(host_of(instance).as_deref(), host, "{instance}");
        }
        let cfg = GatewayConfig::default();
        let known = |s: &str| s == "web";
        let mut labels = serde_json::Map::new();
        labels.insert("service".into(), "web".into());
        labels.insert("instance".into(), "https://web-1.example.com/health".into());
        labels.insert("runbook".into(), "r".repeat(1000).into());
        for i in 0..80 {
            labels.insert(format!("extra{i:02}"), "x".into());
        }
        labels.insert("host".into(), "unix:///run/web.sock".into());
        let p = payload(&serde_json::Value::Object(labels).to_string(), "firing");
        let Ok(Action::Fire(i)) = &actions(&p, &cfg, &known).unwrap()[0] else { panic!("refused") };
        assert_eq!(i.host.as_deref(), Some("web-1.example.com"), "a usable instance behind an unusable host label");
        assert_eq!(i.labels.len(), pitcrew_model::incident::MAX_LABELS);
        // A summary at the length limit that grows when its secrets are redacted.
        let mut p = payload(r#"{"service":"web"}"#, "firing");
        let summary = format!("token=a token=b {}", "e".repeat(pitcrew_model::incident::MAX_ERROR_LEN));
        p.alerts[0].annotations.insert("summary".into(), summary);
        let Ok(Action::Fire(i)) = &actions(&p, &cfg, &known).unwrap()[0] else { panic!("refused") };
        assert!(i.error.len() <= pitcrew_model::incident::MAX_ERROR_LEN);
    }

    #[test]
    fn a_label_that_grows_when_redacted_is_cut_to_fit_not_refused() {
        use pitcrew_model::incident::MAX_LABEL_LEN;
        let cfg = GatewayConfig::default();
        let known = |s: &str| s == "web";
        let dsn = format!("postgres://app:pw@db/{}", "x".repeat(MAX_LABEL_LEN - 21));
        assert_eq!(dsn.len(), MAX_LABEL_LEN);
        // Cut in the middle of its redaction, `token=[RED…` would be redacted again, longer.
        let token = format!("{} token=abc", "y".repeat(242));
        let mut labels = serde_json::Map::new();
        labels.insert("service".into(), "web".into());
        labels.insert("dsn".into(), dsn.into());
        labels.insert("nul".into(), "\0".repeat(MAX_LABEL_LEN).into());
        labels.insert("note".into(), token.into());
        labels.insert("db_password".into(), "p".repeat(MAX_LABEL_LEN).into());
        let p = payload(&serde_json::Value::Object(labels).to_string(), "firing");
        let Ok(Action::Fire(i)) = &actions(&p, &cfg, &known).unwrap()[0] else { panic!("refused") };
        for (k, v) in &i.labels {
            assert!(v.len() <= MAX_LABEL_LEN, "{k}: {} bytes", v.len());
        }
        assert!(i.labels["dsn"].starts_with("postgres://app:[REDACTED]@db/xxx"), "{}", i.labels["dsn"]);
        assert!(i.labels["nul"].starts_with('\u{FFFD}') && !i.labels["nul"].contains('\0'));
        assert!(i.labels["note"].starts_with("yyy") && !i.labels["note"].contains("abc"), "{}", i.labels["note"]);
        assert_eq!(i.labels["db_password"], "[REDACTED]");

        // A summary of NULs (each kept as a three-byte U+FFFD) is cut to fit, not refused.
        let nuls = "\0".repeat(pitcrew_model::incident::MAX_ERROR_LEN);
        let mut p = payload(r#"{"service":"web"}"#, "firing");
        p.alerts[0].annotations.insert("summary".into(), nuls);
        let Ok(Action::Fire(i)) = &actions(&p, &cfg, &known).unwrap()[0] else { panic!("refused") };
        assert!(i.error.len() <= pitcrew_model::incident::MAX_ERROR_LEN && i.error.contains('\u{FFFD}'));
    }

    #[test]
    fn refusals_name_the_alert_and_the_rule() {
        let cfg = GatewayConfig::default();
        let known = |s: &str| s == "web";
        let refusal = |labels: &str, status: &str| {
            let mut a = actions(&payload(labels, status), &cfg, &known).unwrap();
            match a.pop() {
                Some(Err(r)) => {
                    assert_eq!(r.fingerprint, "4c1f9e2a");
                    r.error
                }
                other => panic!("{other:?}"),
            }
        };
        let e = refusal(r#"{"alertname":"Disk"}"#, "firing");
        assert!(e.contains("alerts[0] (alertname Disk") && e.contains("service_labels"), "{e}");
        assert!(refusal(r#"{"alertname":"Disk","service":"db"}"#, "firing").contains("unknown service 'db'"));
        assert!(refusal(r#"{"service":"web"}"#, "pending").contains("status 'pending'"));
        let mut p = payload(r#"{"service":"web"}"#, "firing");
        p.version = "3".into();
        assert!(actions(&p, &cfg, &known).unwrap_err().contains("version '3'"), "a wrong payload is refused whole");
    }
}
