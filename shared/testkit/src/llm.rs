//! A scripted OpenAI-compatible server: real HTTP on a loopback port, the real
//! chat-completions JSON (tool calls included) or, when the request asks to stream, the real
//! server-sent events (content and tool-call deltas, usage in the last chunk, `[DONE]`),
//! answering each request with the next reply of its script and recording what it was sent.

use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

/// One scripted answer.
#[derive(Debug, Clone)]
pub struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Value,
    delay: Duration,
    ending: Ending,
    /// Streamed, the wait before each event after the first.
    trickle: Duration,
}

/// How a streamed answer ends.
#[derive(Debug, Clone, PartialEq)]
enum Ending {
    /// Its finish reason, the usage chunk, `[DONE]`.
    Done,
    /// The connection closes after half the content: no finish reason, no `[DONE]`.
    Cut,
    /// Half the content, then an error event (OpenAI's `{"error": {...}}`), then `[DONE]`.
    Error(String),
}

impl Reply {
    /// A chat completion whose message says `content`.
    pub fn answer(content: &str) -> Reply {
        Reply::completion(json!({ "role": "assistant", "content": content }))
    }

    /// A chat completion asking for these tool calls: (id, function name, arguments).
    pub fn tool_calls(calls: &[(&str, &str, Value)]) -> Reply {
        let calls: Vec<Value> = calls
            .iter()
            .map(|(id, name, args)| {
                json!({ "id": id, "type": "function", "function": { "name": name, "arguments": args.to_string() } })
            })
            .collect();
        Reply::completion(json!({ "role": "assistant", "content": null, "tool_calls": calls }))
    }

    /// A chat completion whose message is `message` as given (a server's own dialect of it).
    pub fn message(message: Value) -> Reply {
        Reply::completion(message)
    }

    fn completion(message: Value) -> Reply {
        Reply {
            status: 200,
            headers: Vec::new(),
            body: completion_body(message),
            delay: Duration::ZERO,
            ending: Ending::Done,
            trickle: Duration::ZERO,
        }
    }

    /// An error status with an OpenAI-style error body.
    pub fn status(status: u16, message: &str) -> Reply {
        Reply::error(status, "scripted", message)
    }

    /// An error status whose OpenAI-style body carries `code` (`insufficient_quota`, ...).
    pub fn error(status: u16, code: &str, message: &str) -> Reply {
        Reply {
            status,
            headers: Vec::new(),
            body: json!({ "error": { "message": message, "type": "scripted", "code": code } }),
            delay: Duration::ZERO,
            ending: Ending::Done,
            trickle: Duration::ZERO,
        }
    }

    /// Streamed, each event after the first comes `gap` after the one before (a slow model
    /// writing a long answer).
    pub fn trickled(mut self, gap: Duration) -> Reply {
        self.trickle = gap;
        self
    }

    /// Streamed, the answer breaks off halfway: the connection closes with no finish reason
    /// and no `[DONE]` (not streamed, it is whole).
    pub fn cut_short(mut self) -> Reply {
        self.ending = Ending::Cut;
        self
    }

    /// Streamed, the answer stops halfway with an error event (a rate limit, a content filter).
    pub fn broken_by(mut self, message: &str) -> Reply {
        self.ending = Ending::Error(message.into());
        self
    }

    /// The answer ends with this `finish_reason` (`length`: cut at the token limit), streamed
    /// or not.
    pub fn finished(mut self, reason: &str) -> Reply {
        self.body["choices"][0]["finish_reason"] = reason.into();
        self
    }

    pub fn header(mut self, name: &str, value: &str) -> Reply {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Answer only after `d` (a slow or hung endpoint).
    pub fn delayed(mut self, d: Duration) -> Reply {
        self.delay = d;
        self
    }
}

/// What the server was sent.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub path: String,
    /// Header names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: Value,
    pub at: Instant,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// The running server; stops when dropped.
pub struct ScriptedLlm {
    /// The API root to configure as `base_url` (`http://127.0.0.1:PORT/v1`).
    pub base_url: String,
    script: Arc<Mutex<VecDeque<Reply>>>,
    seen: Arc<Mutex<Vec<Recorded>>>,
    responder: Arc<Mutex<Option<Responder>>>,
    task: tokio::task::JoinHandle<()>,
}

/// Computes a reply from the request body once the script is exhausted.
pub type Responder = Arc<dyn Fn(&Value) -> Reply + Send + Sync>;

impl Drop for ScriptedLlm {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ScriptedLlm {
    pub async fn start(script: Vec<Reply>) -> anyhow::Result<ScriptedLlm> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let base_url = format!("http://{}/v1", listener.local_addr()?);
        let script = Arc::new(Mutex::new(VecDeque::from(script)));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let responder: Arc<Mutex<Option<Responder>>> = Arc::new(Mutex::new(None));
        let (s, r, f) = (script.clone(), seen.clone(), responder.clone());
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(serve(conn, s.clone(), r.clone(), f.clone()));
            }
        });
        Ok(ScriptedLlm { base_url, script, seen, responder, task })
    }

    /// Answer with `f(request body)` whenever the script is exhausted.
    pub fn respond_with(&self, f: impl Fn(&Value) -> Reply + Send + Sync + 'static) {
        *self.responder.lock().unwrap() = Some(Arc::new(f));
    }

    /// Add a reply at the end of the script.
    pub fn push(&self, reply: Reply) {
        self.script.lock().unwrap().push_back(reply);
    }

    /// Every request so far, in arrival order.
    pub fn requests(&self) -> Vec<Recorded> {
        self.seen.lock().unwrap().clone()
    }

    /// Replies not yet given.
    pub fn remaining(&self) -> usize {
        self.script.lock().unwrap().len()
    }
}

/// A chat completion whose choice is `message` (finish reason `tool_calls` when it calls tools,
/// else `stop`), without its usage block (see [`add_usage`]).
pub fn completion_body(message: Value) -> Value {
    let finish = if message.get("tool_calls").is_some() { "tool_calls" } else { "stop" };
    json!({
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "created": 0,
        "model": "scripted",
        "choices": [{ "index": 0, "message": message, "finish_reason": finish }],
    })
}

/// Characters of content in a chat-completions request's messages.
pub fn prompt_chars(request: &Value) -> usize {
    request["messages"]
        .as_array()
        .map(|m| m.iter().map(|m| m["content"].as_str().map_or(0, str::len)).sum())
        .unwrap_or(0)
}

/// Add the usage block to a completion body: this server's "tokenizer" counts four characters
/// a token, as a rough English average, over the prompt and the answer's message.
pub fn add_usage(completion: &mut Value, prompt_chars: usize) {
    let completion_chars = completion["choices"][0]["message"].to_string().len();
    completion["usage"] = json!({
        "prompt_tokens": prompt_chars.div_ceil(4),
        "completion_tokens": completion_chars.div_ceil(4),
        "total_tokens": (prompt_chars + completion_chars).div_ceil(4),
    });
}

/// One request per connection (`connection: close`).
async fn serve(
    mut conn: tokio::net::TcpStream,
    script: Arc<Mutex<VecDeque<Reply>>>,
    seen: Arc<Mutex<Vec<Recorded>>>,
    responder: Arc<Mutex<Option<Responder>>>,
) -> anyhow::Result<()> {
    let crate::http::Request { path, headers, body } = crate::http::read_request(&mut conn).await?;
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let wants_stream = body["stream"] == true;
    let prompt = prompt_chars(&body);
    let computed = responder.lock().unwrap().clone().map(|f| f(&body));
    seen.lock().unwrap().push(Recorded { path, headers, body, at: Instant::now() });
    let scripted = script.lock().unwrap().pop_front();
    let reply = scripted.or(computed).unwrap_or_else(|| Reply::status(500, "the script is exhausted"));
    tokio::time::sleep(reply.delay).await;
    let mut body = reply.body;
    if reply.status == 200 {
        add_usage(&mut body, prompt);
    }
    if reply.status == 200 && wants_stream {
        return stream(conn, &reply.headers, &body, &reply.ending, reply.trickle).await;
    }
    crate::http::write_json(&mut conn, reply.status, &reply.headers, &body.to_string()).await?;
    Ok(())
}

/// The completion `body` as server-sent events: the content in 8-character deltas, each tool
/// call's arguments in two halves, then the usage chunk and `[DONE]`; one write per event.
async fn stream(
    mut conn: tokio::net::TcpStream,
    headers: &[(String, String)],
    body: &Value,
    ending: &Ending,
    trickle: Duration,
) -> anyhow::Result<()> {
    let mut head = String::from("HTTP/1.1 200 Scripted\r\ncontent-type: text/event-stream\r\nconnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes()).await?;
    let message = &body["choices"][0]["message"];
    let chunk = |delta: Value, finish: Value| {
        json!({ "id": "chatcmpl-scripted", "object": "chat.completion.chunk", "model": "scripted",
                "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] })
    };
    let mut events = vec![chunk(json!({ "role": "assistant" }), Value::Null)];
    // Content given as a list of parts (a server's dialect) streams a part a delta, as such.
    for part in message["content"].as_array().into_iter().flatten() {
        events.push(chunk(json!({ "content": [part] }), Value::Null));
    }
    let content: Vec<char> = message["content"].as_str().unwrap_or("").chars().collect();
    for piece in content.chunks(8) {
        events.push(chunk(json!({ "content": piece.iter().collect::<String>() }), Value::Null));
    }
    for (i, call) in message["tool_calls"].as_array().into_iter().flatten().enumerate() {
        if call["function"]["arguments"].is_object() {
            // Arguments given as an object (a server's dialect) stream whole, in one delta.
            events.push(chunk(json!({ "tool_calls": [{ "index": i, "id": call["id"], "type": "function", "function": call["function"] }] }), Value::Null));
            continue;
        }
        let args: Vec<char> = call["function"]["arguments"].as_str().unwrap_or("").chars().collect();
        let (a, b) = args.split_at(args.len() / 2);
        events.push(chunk(
            json!({ "tool_calls": [{ "index": i, "id": call["id"], "type": "function",
                    "function": { "name": call["function"]["name"], "arguments": a.iter().collect::<String>() } }] }),
            Value::Null,
        ));
        events.push(chunk(
            json!({ "tool_calls": [{ "index": i, "function": { "arguments": b.iter().collect::<String>() } }] }),
            Value::Null,
        ));
    }
    events.push(chunk(json!({}), body["choices"][0]["finish_reason"].clone()));
    events.push(
        json!({ "id": "chatcmpl-scripted", "object": "chat.completion.chunk", "choices": [], "usage": body["usage"] }),
    );
    if *ending != Ending::Done {
        // Half of what comes before the finish chunk.
        events.truncate(events.len().saturating_sub(2).div_ceil(2).max(1));
    }
    if let Ending::Error(message) = ending {
        events.push(json!({ "error": { "message": message, "type": "server_error" } }));
    }
    for (i, e) in events.into_iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(trickle).await;
        }
        conn.write_all(format!("data: {e}\n\n").as_bytes()).await?;
    }
    if *ending != Ending::Cut {
        conn.write_all(b"data: [DONE]\n\n").await?;
    }
    conn.shutdown().await?;
    Ok(())
}
