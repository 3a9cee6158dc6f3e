//! Read-only HTTP tools for a model's diagnosis, each offered only when configured:
//! `http_probe` (GET a URL on a host of the inventory), `prometheus_query` (PromQL, instant or
//! over the last minutes) and `loki_query` (LogQL over the last minutes).

use pitcrew_llm::{ToolOutput, ToolSpec};
use pitcrew_runtime::config::{Config, ToolsConfig};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Largest body read from any of these endpoints.
const MAX_BODY: usize = 1 << 20;
/// Series (Prometheus) or lines (Loki) reported from one query.
const MAX_ROWS: usize = 50;
/// The furthest back a query may look.
const MAX_MINUTES: u64 = 360;

/// The HTTP tools the configuration enables.
pub struct WebTools {
    cfg: ToolsConfig,
    /// Hosts `http_probe` may reach: those the inventory names.
    hosts: BTreeSet<String>,
    /// Ports it may reach on one of them besides `http_probe_ports`: its checks' own.
    checked: BTreeSet<(String, u16)>,
    http: reqwest::Client,
}

/// The host part of a URL (lower-cased, without brackets) and its port (the scheme's when
/// none is written).
fn url_target(url: &str) -> Option<(String, u16)> {
    let u = reqwest::Url::parse(url).ok()?;
    Some((u.host_str()?.trim_matches(['[', ']']).to_ascii_lowercase(), u.port_or_known_default()?))
}

impl WebTools {
    /// None when no HTTP tool is configured.
    pub fn from_config(cfg: &Config) -> Option<WebTools> {
        let t = &cfg.reasoning.tools;
        if !t.http_probe && t.prometheus_url.is_none() && t.loki_url.is_none() {
            return None;
        }
        let mut hosts: BTreeSet<String> = cfg.hosts.values().map(|h| h.address.to_ascii_lowercase()).collect();
        let mut checked = BTreeSet::new();
        for s in cfg.services.values() {
            let target = match &s.check {
                Some(pitcrew_model::CheckSpec::Http { url, .. }) => url_target(url),
                Some(pitcrew_model::CheckSpec::Tcp { address, .. }) => address
                    .rsplit_once(':')
                    .and_then(|(h, p)| Some((h.trim_matches(['[', ']']).to_ascii_lowercase(), p.parse().ok()?))),
                _ => None,
            };
            if let Some((host, port)) = target {
                hosts.insert(host.clone());
                checked.insert((host, port));
            }
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(t.timeout_secs.max(1)))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .ok()?;
        Some(WebTools { cfg: t.clone(), hosts, checked, http })
    }

    pub fn specs(&self) -> Vec<ToolSpec> {
        let mut out = Vec::new();
        if self.cfg.http_probe {
            out.push(ToolSpec {
                name: "http_probe".into(),
                description: "GET a URL on one of the inventory's hosts, on a service's health-check port or a \
                              usual web port (no redirects followed), and return the status and the start of the body."
                    .into(),
                parameters: json!({ "type": "object", "properties": { "url": { "type": "string" } }, "required": ["url"] }),
            });
        }
        if self.cfg.prometheus_url.is_some() {
            out.push(ToolSpec {
                name: "prometheus_query".into(),
                description: "Run a PromQL query: instant, or over the last `minutes` (then min, max and last value \
                              per series)."
                    .into(),
                parameters: json!({ "type": "object", "properties": {
                    "query": { "type": "string" },
                    "minutes": { "type": "integer", "description": "range to look back; omit for an instant query" },
                }, "required": ["query"] }),
            });
        }
        if self.cfg.loki_url.is_some() {
            out.push(ToolSpec {
                name: "loki_query".into(),
                description: "Run a LogQL query over the last `minutes` (default 15) and return the newest lines."
                    .into(),
                parameters: json!({ "type": "object", "properties": {
                    "query": { "type": "string" },
                    "minutes": { "type": "integer" },
                }, "required": ["query"] }),
            });
        }
        out
    }

    /// Whether `name` is one of these tools.
    pub fn offers(&self, name: &str) -> bool {
        self.specs().iter().any(|s| s.name == name)
    }

    /// (what was asked, for the timeline; the result).
    pub async fn call(&self, name: &str, args: &Value) -> (String, ToolOutput) {
        let text = |k: &str| args.get(k).and_then(Value::as_str).map(str::trim).filter(|s| !s.is_empty());
        let minutes = args.get("minutes").and_then(Value::as_u64).map(|m| m.clamp(1, MAX_MINUTES));
        let fail = |asked: String, output: String| (asked, ToolOutput { ok: false, output });
        match name {
            "http_probe" => {
                let Some(url) = text("url") else { return fail("http_probe".into(), "needs {\"url\": ...}".into()) };
                let asked = format!("GET {url}");
                match url_target(url) {
                    Some((h, _)) if !self.hosts.contains(&h) => {
                        return fail(asked, format!("refused: {h} is not a host of the inventory"))
                    }
                    Some((h, p))
                        if !self.cfg.http_probe_ports.contains(&p) && !self.checked.contains(&(h.clone(), p)) =>
                    {
                        return fail(
                            asked,
                            format!(
                                "refused: port {p} of {h} is neither a service's health-check port there nor one of \
                                 [reasoning.tools] http_probe_ports"
                            ),
                        )
                    }
                    Some(_) => {}
                    None => return fail(asked, "refused: not an http(s) URL".into()),
                }
                if !url.starts_with("http://") && !url.starts_with("https://") {
                    return fail(asked, "refused: not an http(s) URL".into());
                }
                match self.get(url).await {
                    Ok((status, body)) => {
                        let ok = (200..400).contains(&status);
                        (
                            asked,
                            ToolOutput {
                                ok,
                                output: format!("HTTP {status}\n{}", pitcrew_model::trim::text_of(&body)),
                            },
                        )
                    }
                    Err(e) => fail(asked, e),
                }
            }
            "prometheus_query" => {
                let (Some(base), Some(q)) = (&self.cfg.prometheus_url, text("query")) else {
                    return fail("prometheus_query".into(), "needs {\"query\": ...}".into());
                };
                let now = unix_now();
                let asked = match minutes {
                    Some(m) => format!("PromQL over {m} min: {q}"),
                    None => format!("PromQL: {q}"),
                };
                let url = match minutes {
                    Some(m) => {
                        // About 60 points, never finer than 15 s.
                        let step = m.max(15).to_string();
                        let (start, end) = ((now - m * 60).to_string(), now.to_string());
                        let params = [("query", q), ("start", &start), ("end", &end), ("step", &step)];
                        reqwest::Url::parse_with_params(
                            &format!("{}/api/v1/query_range", base.trim_end_matches('/')),
                            params,
                        )
                    }
                    None => {
                        let time = now.to_string();
                        let params = [("query", q), ("time", time.as_str())];
                        reqwest::Url::parse_with_params(&format!("{}/api/v1/query", base.trim_end_matches('/')), params)
                    }
                };
                let Ok(url) = url else { return fail(asked, "bad prometheus_url".into()) };
                match self.api(url.as_str()).await {
                    Ok(v) => (asked, ToolOutput { ok: true, output: prometheus_rows(&v) }),
                    Err(e) => fail(asked, e),
                }
            }
            "loki_query" => {
                let (Some(base), Some(q)) = (&self.cfg.loki_url, text("query")) else {
                    return fail("loki_query".into(), "needs {\"query\": ...}".into());
                };
                let m = minutes.unwrap_or(15);
                let asked = format!("LogQL over {m} min: {q}");
                let now_ns = u128::from(unix_now()) * 1_000_000_000;
                let (start, end) = ((now_ns - u128::from(m) * 60 * 1_000_000_000).to_string(), now_ns.to_string());
                let limit = MAX_ROWS.to_string();
                let params =
                    [("query", q), ("start", &start), ("end", &end), ("limit", &limit), ("direction", "backward")];
                let url = reqwest::Url::parse_with_params(
                    &format!("{}/loki/api/v1/query_range", base.trim_end_matches('/')),
                    params,
                );
                let Ok(url) = url else { return fail(asked, "bad loki_url".into()) };
                match self.api(url.as_str()).await {
                    Ok(v) => (asked, ToolOutput { ok: true, output: loki_rows(&v) }),
                    Err(e) => fail(asked, e),
                }
            }
            other => fail(other.into(), format!("unknown tool '{other}'")),
        }
    }

    /// GET `url`: the status and at most `MAX_BODY` bytes of the body.
    async fn get(&self, url: &str) -> Result<(u16, Vec<u8>), String> {
        let mut resp = self.http.get(url).send().await.map_err(|e| format!("GET failed: {e}"))?;
        let status = resp.status().as_u16();
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| format!("reading the body: {e}"))? {
            let room = MAX_BODY.saturating_sub(body.len());
            body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            if room <= chunk.len() {
                break;
            }
        }
        Ok((status, body))
    }

    /// A Prometheus/Loki API answer: `data` when `status` is success, else the error.
    async fn api(&self, url: &str) -> Result<Value, String> {
        let (status, body) = self.get(url).await?;
        let v: Value = serde_json::from_slice(&body).map_err(|e| format!("HTTP {status}, not JSON: {e}"))?;
        if v["status"] != "success" {
            return Err(format!(
                "HTTP {status}: {} {}",
                v["errorType"].as_str().unwrap_or(""),
                v["error"].as_str().unwrap_or("")
            ));
        }
        Ok(v["data"].clone())
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// `{a="b"}` for a label set (the metric name first).
fn labels(metric: &Value) -> String {
    let Some(m) = metric.as_object() else { return "{}".into() };
    let name = m.get("__name__").and_then(Value::as_str).unwrap_or("");
    let rest: Vec<String> = m
        .iter()
        .filter(|(k, _)| *k != "__name__")
        .map(|(k, v)| format!("{k}=\"{}\"", v.as_str().unwrap_or("")))
        .collect();
    format!("{name}{{{}}}", rest.join(","))
}

/// One line per series: the value (instant) or min/max/last (range).
fn prometheus_rows(data: &Value) -> String {
    let kind = data["resultType"].as_str().unwrap_or("");
    let results = data["result"].as_array().cloned().unwrap_or_default();
    let mut out: Vec<String> = Vec::new();
    match kind {
        "matrix" => {
            for r in results.iter().take(MAX_ROWS) {
                let vals: Vec<f64> = r["values"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| p[1].as_str().and_then(|s| s.parse().ok()))
                    .collect();
                let (min, max) =
                    vals.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(*v), b.max(*v)));
                match vals.last() {
                    Some(last) => out.push(format!(
                        "{} min {min} max {max} last {last} ({} points)",
                        labels(&r["metric"]),
                        vals.len()
                    )),
                    None => out.push(format!("{} (no points)", labels(&r["metric"]))),
                }
            }
        }
        "vector" => {
            for r in results.iter().take(MAX_ROWS) {
                out.push(format!("{} {}", labels(&r["metric"]), r["value"][1].as_str().unwrap_or("?")));
            }
        }
        "scalar" | "string" => out.push(data["result"][1].as_str().unwrap_or("?").to_string()),
        other => out.push(format!("unexpected result type '{other}'")),
    }
    if results.len() > MAX_ROWS {
        out.push(format!("... {} more series", results.len() - MAX_ROWS));
    }
    if out.is_empty() {
        return "no series".into();
    }
    out.join("\n")
}

/// The newest lines first, each with its stream's labels.
fn loki_rows(data: &Value) -> String {
    let mut lines: Vec<(String, String)> = Vec::new();
    for stream in data["result"].as_array().into_iter().flatten() {
        let l = labels(&stream["stream"]);
        for v in stream["values"].as_array().into_iter().flatten() {
            if let (Some(ts), Some(line)) = (v[0].as_str(), v[1].as_str()) {
                lines.push((ts.to_string(), format!("{l} {line}")));
            }
        }
    }
    lines.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(b.0.cmp(&a.0)));
    if lines.is_empty() {
        return "no lines".into();
    }
    lines.into_iter().take(MAX_ROWS).map(|(_, l)| l).collect::<Vec<_>>().join("\n")
}
