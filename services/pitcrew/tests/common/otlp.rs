//! A real OTLP/HTTP trace receiver for tests (JSON encoding): what pitcrew's workers export.

use pitcrew_testkit::http::{read_request, write_json};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// One exported span: the process it came from (`service.name`), name, trace id and attributes.
#[derive(Debug, Clone)]
pub struct Span {
    pub service: String,
    pub name: String,
    pub trace: String,
    pub attrs: BTreeMap<String, String>,
}

/// A real OTLP/HTTP receiver (JSON encoding) on a loopback port: every span posted to
/// `/v1/traces` is kept.
pub struct Receiver {
    pub url: String,
    spans: Arc<Mutex<Vec<Span>>>,
    posts: Arc<Mutex<usize>>,
    bodies: Arc<Mutex<String>>,
}

fn text_of(v: &Value) -> String {
    let v = &v["value"];
    v["stringValue"]
        .as_str()
        .map(str::to_string)
        .or_else(|| v["intValue"].as_str().map(str::to_string))
        .or_else(|| v["intValue"].as_i64().map(|i| i.to_string()))
        .or_else(|| v["boolValue"].as_bool().map(|b| b.to_string()))
        .unwrap_or_default()
}

fn attrs(list: &Value) -> BTreeMap<String, String> {
    list.as_array()
        .into_iter()
        .flatten()
        .map(|a| (a["key"].as_str().unwrap_or_default().to_string(), text_of(a)))
        .collect()
}

/// The spans of one `ExportTraceServiceRequest` in its JSON encoding.
fn spans_of(body: &Value) -> Vec<Span> {
    let mut out = Vec::new();
    for rs in body["resourceSpans"].as_array().into_iter().flatten() {
        let service = attrs(&rs["resource"]["attributes"]).get("service.name").cloned().unwrap_or_default();
        for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
            for s in ss["spans"].as_array().into_iter().flatten() {
                out.push(Span {
                    service: service.clone(),
                    name: s["name"].as_str().unwrap_or_default().to_string(),
                    trace: s["traceId"].as_str().unwrap_or_default().to_string(),
                    attrs: attrs(&s["attributes"]),
                });
            }
        }
    }
    out
}

impl Receiver {
    pub async fn start() -> anyhow::Result<Receiver> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let spans = Arc::new(Mutex::new(Vec::new()));
        let posts = Arc::new(Mutex::new(0));
        let bodies = Arc::new(Mutex::new(String::new()));
        let (kept, counted, raw) = (spans.clone(), posts.clone(), bodies.clone());
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (kept, counted, raw) = (kept.clone(), counted.clone(), raw.clone());
                tokio::spawn(async move {
                    let Ok(req) = read_request(&mut conn).await else { return };
                    let json_body = req.headers.iter().any(|(k, v)| k == "content-type" && v.contains("json"));
                    let parsed = serde_json::from_slice::<Value>(&req.body);
                    let (status, answer) = match (req.path.as_str(), json_body, parsed) {
                        ("/v1/traces", true, Ok(body)) => {
                            kept.lock().unwrap().extend(spans_of(&body));
                            raw.lock().unwrap().push_str(&String::from_utf8_lossy(&req.body));
                            *counted.lock().unwrap() += 1;
                            (200, "{}".to_string())
                        }
                        (path, _, _) => (400, json!({ "error": format!("unexpected request to {path}") }).to_string()),
                    };
                    let _ = write_json(&mut conn, status, &[], &answer).await;
                });
            }
        });
        Ok(Receiver { url, spans, posts, bodies })
    }

    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    /// Export requests received.
    pub fn posts(&self) -> usize {
        *self.posts.lock().unwrap()
    }

    /// Every request body received, as text (for the secrets check).
    pub fn bodies(&self) -> String {
        self.bodies.lock().unwrap().clone()
    }
}
