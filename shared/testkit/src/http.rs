//! A stub HTTP API for tests (Prometheus, Loki, ...): real HTTP on a loopback port, fixed JSON
//! answers by path, every request target recorded. One request per connection.

use serde_json::Value;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Largest request read.
const MAX_REQUEST: usize = 4 << 20;

/// A parsed request: its target (path and query), headers (names lower-cased) and body.
pub struct Request {
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// Read one HTTP/1.1 request (Content-Length bodies only), bounded in size.
pub async fn read_request(conn: &mut TcpStream) -> anyhow::Result<Request> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        let n = conn.read(&mut chunk).await?;
        anyhow::ensure!(n > 0, "connection closed before the request head");
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        anyhow::ensure!(buf.len() < MAX_REQUEST, "request head too large");
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.lines();
    let path = lines.next().unwrap_or("").split_whitespace().nth(1).unwrap_or("").to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let len: usize = headers.iter().find(|(k, _)| k == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
    anyhow::ensure!(len <= MAX_REQUEST, "request body too large");
    while buf.len() < head_end + len {
        let n = conn.read(&mut chunk).await?;
        anyhow::ensure!(n > 0, "connection closed inside the body");
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(Request { path, headers, body: buf[head_end..head_end + len].to_vec() })
}

/// Write one JSON response with `headers` and close the connection.
pub async fn write_json(
    conn: &mut TcpStream,
    status: u16,
    headers: &[(String, String)],
    body: &str,
) -> std::io::Result<()> {
    let mut out = format!(
        "HTTP/1.1 {status} Stub\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(body);
    conn.write_all(out.as_bytes()).await?;
    conn.shutdown().await
}

/// The running stub; stops when dropped.
pub struct StubHttp {
    /// `http://127.0.0.1:PORT`
    pub url: String,
    seen: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for StubHttp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl StubHttp {
    /// Answer GETs of each path (query ignored) with (status, JSON body); 404 otherwise.
    pub async fn start(routes: Vec<(&str, u16, Value)>) -> anyhow::Result<StubHttp> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let routes: Arc<Vec<(String, u16, String)>> =
            Arc::new(routes.into_iter().map(|(p, s, b)| (p.to_string(), s, b.to_string())).collect());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let recorded = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (routes, recorded) = (routes.clone(), recorded.clone());
                tokio::spawn(async move {
                    let Ok(req) = read_request(&mut conn).await else { return };
                    let path = req.path.split('?').next().unwrap_or("").to_string();
                    recorded.lock().unwrap().push(req.path.clone());
                    let (status, body) = routes
                        .iter()
                        .find(|(p, _, _)| *p == path)
                        .map(|(_, s, b)| (*s, b.clone()))
                        .unwrap_or((404, "{\"status\":\"error\",\"error\":\"no such route\"}".into()));
                    let _ = write_json(&mut conn, status, &[], &body).await;
                });
            }
        });
        Ok(StubHttp { url, seen, task })
    }

    /// Every request target (path and query) so far.
    pub fn requests(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}
