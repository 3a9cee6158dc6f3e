//! The bus: NATS connection, the five streams, the durable consumers and publishing helpers.

use crate::config::{Config, StageSettings};
use async_nats::header::{HeaderMap, NATS_MESSAGE_ID};
pub use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::{self, consumer, stream};
use bytes::Bytes;
use pitcrew_model::codec::{self, CONTENT_TYPE};
use pitcrew_model::subjects::Subjects;
use pitcrew_model::{Incident, Stage};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a stopping process waits for NATS to take what it still holds.
pub const FLUSH_LIMIT: Duration = Duration::from_secs(5);
/// How long a JetStream API request (a stream, a consumer, a stream's last message) may take,
/// its wait for room in the client's queue included: while NATS is unreachable nothing reads
/// that queue, and once it is full a request would wait there for as long as the outage lasts
/// (async-nats bounds only the wait for the reply).
pub const API_LIMIT: Duration = Duration::from_secs(10);
/// The durable consumer of approval decisions.
pub const DECISIONS_CONSUMER: &str = "approval-decisions";
/// Header naming the run a message belongs to (lets a poison message still escalate its run).
pub const RUN_HEADER: &str = "Pitcrew-Run";
/// Header carrying the dead-letter reason.
pub const ERROR_HEADER: &str = "Pitcrew-Error";
/// Header naming the stage that dead-lettered a message.
pub const STAGE_HEADER: &str = "Pitcrew-Stage";
/// Header naming the subject a dead-lettered message came from.
pub const ORIGIN_HEADER: &str = "Pitcrew-Origin";
/// Header of a dead letter whose payload was cut to fit: the original's size in bytes.
pub const TRUNCATED_HEADER: &str = "Pitcrew-Truncated";
/// Header of a dead letter that could not carry the original's headers: their size.
pub const DROPPED_HEADER: &str = "Pitcrew-Headers-Dropped";
/// How often at most a connection makes its streams again when a publish finds none
/// ([`Bus::unacked`]).
pub const REMAKE_STREAMS_EVERY: Duration = Duration::from_secs(10);

/// The largest message any stream stores, headers included (the dead letters' too).
pub const MAX_MESSAGE: usize = codec::MAX_PAYLOAD * 2;

/// What went wrong talking to NATS; the message says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("cannot reach NATS at {url}: {error} ({})", connect_hint(error))]
    Connect { url: String, error: String },
    #[error("JetStream set-up failed for {what}: {error} (a nats-server >= 2.10 with -js is required)")]
    Setup { what: String, error: String },
    #[error("publish to {subject} failed: {error}")]
    Publish { subject: String, error: String },
    #[error("NATS did not answer {what} within {} s (is it reachable?)", API_LIMIT.as_secs())]
    Unanswered { what: String },
    #[error("NATS refused {what} to this user: {error} (check the user's permissions in the server's config, and pitcrew's prefix)")]
    Refused { what: String, error: String },
    #[error("reading {what} failed: {error}")]
    Read { what: String, error: String },
    #[error("NATS is set up so pitcrew cannot work: {what} ({fix})")]
    Misconfigured { what: String, fix: String },
}

/// Most messages [`Bus::held_since`] reads before it answers no.
pub const HELD_SCAN: usize = 10_000;

/// Whether `headers` carry the message id `id`.
fn carries_id(headers: Option<&HeaderMap>, id: &str) -> bool {
    headers.and_then(|h| h.get(NATS_MESSAGE_ID)).is_some_and(|held| held.as_str() == id)
}

/// `call`, a JetStream API request about `what`, given at most [`API_LIMIT`].
pub async fn within<F: std::future::Future>(what: &str, call: F) -> Result<F::Output, BusError> {
    tokio::time::timeout(API_LIMIT, call).await.map_err(|_| BusError::Unanswered { what: what.to_string() })
}

impl BusError {
    /// No server answered, or JetStream was not ready yet (a server still starting, a cluster
    /// electing its leader, a connection lost between connect and set-up): worth waiting for,
    /// unlike a login the server refused, a URL that does not parse, TLS, or a server without
    /// JetStream.
    pub fn is_unreachable(&self) -> bool {
        let said = |error: &str, signs: &[&str]| {
            let error = error.to_lowercase();
            signs.iter().any(|s| error.contains(s))
        };
        match self {
            // A TLS handshake refused reads "IO error: invalid peer certificate ..." too.
            BusError::Connect { error, .. } => {
                !login_refused(error)
                    && said(error, &["io error", "timed out", "no answer", "dns"])
                    && !said(error, &["certificate", "tls", "ssl", "handshake"])
            }
            BusError::Setup { error, .. } => said(
                error,
                &["timed out", "timeout", "no responders", "503", "temporarily unavailable", "disconnected"],
            ),
            BusError::Publish { .. } => false,
            BusError::Unanswered { .. } => true,
            BusError::Refused { .. } | BusError::Read { .. } | BusError::Misconfigured { .. } => false,
        }
    }
}

fn login_refused(error: &str) -> bool {
    let error = error.to_lowercase();
    error.contains("authorization violation") || error.contains("authentication")
}

/// What to check when connecting failed.
fn connect_hint(error: &str) -> &'static str {
    if login_refused(error) {
        "the server refused the login: check the user and password (or token) in the NATS URL"
    } else {
        "is nats-server running?"
    }
}

/// The headers every pitcrew message carries: a deterministic message id (JetStream drops a
/// duplicate within the stream's window), the content type, when it has one, the run, and
/// the trace context (`traceparent`) of the work that publishes it.
pub fn headers(msg_id: &str, content_type: &str, run: Option<uuid::Uuid>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    crate::trace::inject(&mut headers);
    headers.insert(NATS_MESSAGE_ID, msg_id);
    headers.insert(CONTENT_TYPE, content_type);
    if let Some(run) = run {
        headers.insert(RUN_HEADER, run.to_string().as_str());
    }
    headers
}

/// Credentials in a NATS URL's user part.
#[derive(Debug, PartialEq, Eq)]
enum Credentials {
    /// `nats://user:password@host`
    UserPassword(String, String),
    /// `nats://token@host`
    Token(String),
}

/// The credentials of `url` (of its first server when it lists several, comma-separated),
/// percent-decoded.
fn url_credentials(url: &str) -> Option<Credentials> {
    let (_, userinfo) = crate::config::userinfo(url.split(',').next()?.trim())?;
    match userinfo.split_once(':') {
        Some((user, password)) => Some(Credentials::UserPassword(percent_decode(user), percent_decode(password))),
        None if userinfo.is_empty() => None,
        None => Some(Credentials::Token(percent_decode(userinfo))),
    }
}

/// `%XX` escapes decoded; anything else (a stray `%`) kept as it is.
pub(crate) fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (b[i], b.get(i + 1).copied().and_then(hex), b.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A connected bus: the client, its JetStream context and the subject names.
#[derive(Clone)]
pub struct Bus {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub subjects: Subjects,
    /// The last permissions violation the server reported on this connection: async-nats
    /// surfaces it only as an event, and the request it refused just times out.
    refused: Arc<Mutex<Option<String>>>,
    /// Intake's consumer settings, for the consumer `ensure_streams` makes before any intake
    /// process runs (the incidents stream keeps an incident only while a consumer wants it).
    intake: StageSettings,
    /// When a publish that found no stream last had the streams made again ([`Bus::unacked`]).
    remade: Arc<Mutex<Option<std::time::Instant>>>,
}

/// A stage's durable pull consumer, shared by every process that runs it.
fn pull_config(name: &str, filter: String, settings: StageSettings) -> consumer::pull::Config {
    consumer::pull::Config {
        durable_name: Some(name.to_string()),
        filter_subject: filter,
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: settings.ack_wait,
        // The runner dead-letters itself after `max_deliveries`: the server never drops.
        max_deliver: -1,
        max_ack_pending: settings.max_ack_pending,
        ..Default::default()
    }
}

/// pitcrew's settings for a stream, but the limits an operator raised on it by hand: a larger
/// size (a stages stream that filled in a storm, whose runs wait for room), a longer age, a
/// larger message. Lowered, or an older pitcrew's, they are brought back to pitcrew's.
fn raised_limits_kept(old: &stream::Config, mut new: stream::Config) -> stream::Config {
    let more = |old: i64, new: i64| old < 0 || (new >= 0 && old > new);
    if more(old.max_bytes, new.max_bytes) {
        new.max_bytes = old.max_bytes;
    }
    if more(i64::from(old.max_message_size), i64::from(new.max_message_size)) {
        new.max_message_size = old.max_message_size;
    }
    // Zero is no limit: ours (pending work never expires) is kept; another's no limit too.
    if !new.max_age.is_zero() && (old.max_age.is_zero() || old.max_age > new.max_age) {
        new.max_age = old.max_age;
    }
    new
}

/// Whether a stream's settings differ from the ones pitcrew manages.
fn differs(old: &stream::Config, new: &stream::Config) -> bool {
    old.subjects != new.subjects
        || old.max_age != new.max_age
        || old.max_bytes != new.max_bytes
        || old.max_message_size != new.max_message_size
        || old.duplicate_window != new.duplicate_window
        || old.discard != new.discard
        || old.retention != new.retention
}

impl Bus {
    /// Connect, failing fast with a readable error when no server answers.
    pub async fn connect(cfg: &Config) -> Result<Bus, BusError> {
        let url = cfg.nats.url.clone();
        // The URL may carry credentials: errors show it redacted.
        let err = |e: String| BusError::Connect { url: crate::config::redact_url(&url), error: e };
        let refused: Arc<Mutex<Option<String>>> = Arc::default();
        let refusals = refused.clone();
        let mut opts = async_nats::ConnectOptions::new()
            .name(format!("pitcrew {}", cfg.worker()))
            .custom_inbox_prefix(&cfg.nats.inbox_prefix)
            .connection_timeout(Duration::from_secs(cfg.nats.connect_timeout_secs.max(1)))
            // Fail fast at start-up with a readable error; once connected, reconnect forever.
            .max_reconnects(None)
            // What the server refuses after connecting (a subject this user may not publish
            // to, say) reaches the client only as an event: say it, or the publish just
            // times out waiting for its ack.
            .event_callback(move |event| {
                let refusals = refusals.clone();
                async move {
                    match event {
                        async_nats::Event::ServerError(e) => {
                            tracing::error!(error = %e, "NATS server refused a request");
                            let said = e.to_string();
                            if said.to_lowercase().contains("permissions violation") {
                                *refusals.lock().unwrap_or_else(|p| p.into_inner()) = Some(said);
                            }
                        }
                        async_nats::Event::SlowConsumer(sid) => {
                            tracing::warn!(
                                subscription = sid,
                                "NATS: a subscription fell behind, messages were dropped"
                            )
                        }
                        // async-nats logs the rest (connected, disconnected, ...) itself.
                        _ => {}
                    }
                }
            });
        // async-nats ignores credentials in the URL: pass them on.
        opts = match url_credentials(&url) {
            Some(Credentials::UserPassword(user, password)) => {
                let _ = pitcrew_model::redact::register_secret(&password);
                opts.user_and_password(user, password)
            }
            Some(Credentials::Token(token)) => {
                let _ = pitcrew_model::redact::register_secret(&token);
                opts.token(token)
            }
            None => opts,
        };
        let connecting = opts.connect(url.as_str());
        let client = tokio::time::timeout(Duration::from_secs(cfg.nats.connect_timeout_secs.max(1)), connecting)
            .await
            .map_err(|_| err("no answer within the connect timeout".into()))?
            .map_err(|e| err(e.to_string()))?;
        let js = jetstream::new(client.clone());
        Ok(Bus {
            client,
            js,
            subjects: Subjects::new(&cfg.prefix),
            refused,
            intake: cfg.stage_settings(Stage::Intake),
            remade: Arc::default(),
        })
    }

    /// Write out what the client still holds (acks, naks, publishes) before the process
    /// exits, waiting at most `FLUSH_LIMIT`: while the server is unreachable the client only
    /// reconnects, and an unbounded flush would keep a stopping process from ever exiting.
    /// What is not written is not lost: its messages come again after their ack wait.
    pub async fn flush_before_exit(&self) {
        match tokio::time::timeout(FLUSH_LIMIT, self.client.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot flush to NATS before exiting: messages not settled come again after their ack wait")
            }
            Err(_) => tracing::warn!(
                limit_secs = FLUSH_LIMIT.as_secs(),
                state = ?self.client.connection_state(),
                "NATS did not take what this process still held in time: messages not settled come again after their ack wait"
            ),
        }
    }

    /// Create the five streams if missing. Safe when many processes start at once.
    /// Refused at once: a server whose `max_payload` is below [`MAX_MESSAGE`] (a run's state
    /// or a dead letter would be refused mid-run, for good, and its run stuck).
    pub async fn ensure_streams(&self) -> Result<(), BusError> {
        let max_payload = self.client.server_info().max_payload;
        if max_payload < MAX_MESSAGE {
            return Err(BusError::Misconfigured {
                what: format!(
                    "the server's max_payload is {max_payload} bytes, less than the {MAX_MESSAGE} a run's state or a \
                     dead letter may take"
                ),
                fix: "set max_payload to 1MB, nats-server's default, or more in its config".into(),
            });
        }
        let s = &self.subjects;
        let day = Duration::from_secs(86_400);
        let streams = [
            // Work in flight never expires: a full stream refuses new work (discard new)
            // instead of deleting runs' pending messages, or incidents not taken yet (its
            // publisher is told, and tries again). An incident leaves its stream once intake
            // took it (interest: every consumer of the stream acknowledged it).
            (s.incidents_stream(), s.incidents_new(), stream::RetentionPolicy::Interest, Duration::ZERO, 1 << 30),
            (s.stages_stream(), s.stages_all(), stream::RetentionPolicy::WorkQueue, Duration::ZERO, 4 << 30),
            (s.approvals_stream(), s.approvals_all(), stream::RetentionPolicy::Limits, 90 * day, 1 << 30),
            (s.events_stream(), s.events_all(), stream::RetentionPolicy::Limits, 7 * day, 4 << 30),
            (s.dlq_stream(), s.dlq_all(), stream::RetentionPolicy::Limits, 30 * day, 1 << 30),
        ];
        for (name, subject, retention, max_age, max_bytes) in streams {
            let config = stream::Config {
                name: name.clone(),
                subjects: vec![subject],
                retention,
                max_age,
                max_bytes,
                max_message_size: MAX_MESSAGE as i32,
                duplicate_window: Duration::from_secs(120),
                storage: stream::StorageType::File,
                discard: if retention == stream::RetentionPolicy::Limits {
                    stream::DiscardPolicy::Old
                } else {
                    stream::DiscardPolicy::New
                },
                ..Default::default()
            };
            // An interest stream keeps a message only for the consumers it has when the
            // message comes: made without intake's, it would drop every incident published
            // before an intake process first ran. It is made as an older pitcrew made it,
            // and turned into one once that consumer is made (below).
            let first = match retention {
                stream::RetentionPolicy::Interest => stream::Config {
                    retention: stream::RetentionPolicy::Limits,
                    max_age: 7 * day,
                    discard: stream::DiscardPolicy::Old,
                    ..config.clone()
                },
                _ => config.clone(),
            };
            let mut last = None;
            let mut found = None;
            // Only a refusal of this stream's own requests counts below (one of an update
            // refused earlier, which some users may not make, is no reason to stop).
            self.refused.lock().unwrap_or_else(|p| p.into_inner()).take();
            let refused = || self.refusal(|violation| violation.contains(&format!(".{name}")));
            for _ in 0..3 {
                match self.js.get_or_create_stream(first.clone()).await {
                    Ok(stream) => {
                        last = None;
                        found = Some(stream.cached_info().clone());
                        break;
                    }
                    Err(e) => {
                        last = Some(e.to_string());
                        // Refused: trying again is refused again.
                        if refused().is_some() {
                            break;
                        }
                    }
                }
            }
            if let Some(error) = last {
                // Refused, the request only timed out: say what the server said instead.
                if let Some(violation) = refused() {
                    return Err(BusError::Refused { what: format!("stream {name}"), error: violation });
                }
                return Err(BusError::Setup { what: format!("stream {name}"), error });
            }
            let Some(info) = found else { continue };
            if retention == stream::RetentionPolicy::Interest && !self.incidents_ready(&info).await {
                continue;
            }
            // A stream made by an older pitcrew keeps its settings: bring them up to date (the
            // stages stream once expired and dropped pending work). Only the crew's and the
            // operator's NATS users may; the others leave it to them.
            let old = info.config;
            let config = raised_limits_kept(&old, config);
            if differs(&old, &config) {
                match self.js.update_stream(config.clone()).await {
                    Ok(_) => tracing::info!(
                        stream = %name,
                        retention = ?config.retention,
                        max_age_secs = config.max_age.as_secs(),
                        max_bytes = config.max_bytes,
                        discard = ?config.discard,
                        was_retention = ?old.retention,
                        was_max_age_secs = old.max_age.as_secs(),
                        was_discard = ?old.discard,
                        "stream settings brought up to date"
                    ),
                    Err(e) => {
                        tracing::warn!(stream = %name, error = %e, "stream settings differ from this version's and could not be updated")
                    }
                }
            }
        }
        Ok(())
    }

    /// The durable pull consumer of `stage`, shared by every process that runs it.
    /// Intake reads the incidents stream; every other stage its subject of the stages stream.
    pub async fn stage_consumer(
        &self,
        stage: Stage,
        settings: StageSettings,
    ) -> Result<consumer::PullConsumer, BusError> {
        let (stream, filter) = if stage == Stage::Intake {
            (self.subjects.incidents_stream(), self.subjects.incidents_new())
        } else {
            (self.subjects.stages_stream(), self.subjects.stage(stage))
        };
        self.durable(&stream, stage.as_str(), filter, settings).await
    }

    /// The durable consumer of approval decisions (run by the approval stage), named
    /// [`DECISIONS_CONSUMER`].
    pub async fn decisions_consumer(&self, settings: StageSettings) -> Result<consumer::PullConsumer, BusError> {
        let stream = self.subjects.approvals_stream();
        let filter = self.subjects.approvals_decided_all();
        self.durable(&stream, DECISIONS_CONSUMER, filter, settings).await
    }

    /// Whether the incidents stream (`info`, as found) may keep an incident only until intake
    /// took it: intake's consumer is there (made now if it is not), and no other consumer
    /// would hold every incident until it took it too. An interest stream without intake's
    /// consumer (deleted by hand) has it made again.
    async fn incidents_ready(&self, info: &stream::Info) -> bool {
        let name = &info.config.name;
        if info.config.retention == stream::RetentionPolicy::Interest {
            if info.state.consumer_count == 0 {
                match self.intake_consumer().await {
                    Ok(()) => tracing::warn!(stream = %name, "intake's consumer was gone: made again"),
                    Err(e) => tracing::warn!(
                        stream = %name, error = %e,
                        "intake's consumer is gone and this process cannot make it: incidents published until a crew process starts are not kept"
                    ),
                }
            }
            return true;
        }
        if let Err(e) = self.intake_consumer().await {
            tracing::info!(
                stream = %name, error = %e,
                "intake's consumer cannot be made by this process: the incidents stream keeps its older settings until a crew process starts"
            );
            return false;
        }
        let consumers = match self.js.get_stream(name).await {
            Ok(mut stream) => stream.info().await.map(|i| i.state.consumer_count).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match consumers {
            Ok(1) => true,
            Ok(n) => {
                tracing::warn!(
                    stream = %name, consumers = n,
                    "the incidents stream has consumers besides intake's: it keeps its older settings (kept 7 days, the oldest dropped when full), \
                     as an incident would otherwise stay until every one of them took it"
                );
                false
            }
            Err(e) => {
                tracing::warn!(stream = %name, error = %e, "cannot count the incidents stream's consumers: it keeps its older settings");
                false
            }
        }
    }

    /// The last permissions violation the server reported, if `about` it.
    fn refusal(&self, about: impl Fn(&str) -> bool) -> Option<String> {
        self.refused.lock().unwrap_or_else(|p| p.into_inner()).clone().filter(|violation| about(violation))
    }

    /// Intake's consumer, made with this process's settings for it if there is none yet.
    async fn intake_consumer(&self) -> Result<(), BusError> {
        let (stream, name) = (self.subjects.incidents_stream(), Stage::Intake.as_str());
        let setup = |e: String| BusError::Setup { what: format!("consumer {name} on {stream}"), error: e };
        let st = self.js.get_stream(&stream).await.map_err(|e| setup(e.to_string()))?;
        let config = pull_config(name, self.subjects.incidents_new(), self.intake);
        // A user who may not (the gateway's, the monitor's) is refused by an event, while the
        // request itself waits for its timeout: whichever comes first.
        let refused = async {
            loop {
                if let Some(violation) = self.refusal(|v| v.contains("CONSUMER.") && v.contains(&stream)) {
                    return violation;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let what = format!("consumer {name} on {stream}");
        tokio::select! {
            made = within(&what, st.get_or_create_consumer(name, config)) => {
                made?.map_err(|e| setup(e.to_string()))?;
                Ok(())
            }
            violation = refused => Err(BusError::Refused { what, error: violation }),
        }
    }

    async fn durable(
        &self,
        stream: &str,
        name: &str,
        filter: String,
        settings: StageSettings,
    ) -> Result<consumer::PullConsumer, BusError> {
        let setup = |e: String| BusError::Setup { what: format!("consumer {name} on {stream}"), error: e };
        let st = self.js.get_stream(stream).await.map_err(|e| setup(e.to_string()))?;
        let config = pull_config(name, filter, settings);
        // Every process of a stage shares the consumer, and the last to make it sets it: a
        // process configured apart from the others changes their ack wait too (a step still
        // running elsewhere would be handed to another worker past the shorter one). Said,
        // so the difference is found and the processes configured alike.
        if let Ok(was) = st.consumer_info(name).await.map(|i| i.config) {
            if was.ack_wait != config.ack_wait || was.max_ack_pending != config.max_ack_pending {
                tracing::warn!(
                    consumer = name,
                    stream,
                    ack_wait_secs = config.ack_wait.as_secs_f64(),
                    was_ack_wait_secs = was.ack_wait.as_secs_f64(),
                    max_ack_pending = config.max_ack_pending,
                    was_max_ack_pending = was.max_ack_pending,
                    "this process changes the settings of a consumer every process of its stage shares: \
                     configure them alike"
                );
            }
        }
        let mut last = String::new();
        for _ in 0..3 {
            match st.create_consumer(config.clone()).await {
                Ok(c) => return Ok(c),
                Err(e) => last = e.to_string(),
            }
        }
        Err(setup(last))
    }

    /// Subjects of the stages stream that hold messages no stage of this version reads (a
    /// stage a newer crew added in a rolling upgrade, or a rolled-back one's, or a typo in a
    /// hand-made publish), with their counts: nothing takes them off the work queue but a
    /// worker that reads them or a human. At most `limit` are listed.
    pub async fn unread_stage_subjects(&self, limit: usize) -> Result<Vec<(String, usize)>, BusError> {
        use futures::TryStreamExt;
        let failed =
            |e: String| BusError::Read { what: format!("the subjects of {}", self.subjects.stages_stream()), error: e };
        let known: Vec<String> = Stage::ALL.iter().map(|s| self.subjects.stage(*s)).collect();
        within("a listing of the stages stream's subjects", async {
            let stream = self.js.get_stream(self.subjects.stages_stream()).await.map_err(|e| failed(e.to_string()))?;
            let mut subjects =
                stream.info_with_subjects(self.subjects.stages_all()).await.map_err(|e| failed(e.to_string()))?;
            let mut unread = Vec::new();
            while let Some((subject, count)) = subjects.try_next().await.map_err(|e| failed(e.to_string()))? {
                if !known.contains(&subject) && unread.len() < limit {
                    unread.push((subject, count));
                }
            }
            Ok(unread)
        })
        .await?
    }

    /// The last message on `subject` of `stream`, asked within [`API_LIMIT`]: None when it
    /// has none.
    pub async fn last_on(&self, stream: &str, subject: &str) -> Result<Option<StreamMessage>, BusError> {
        let failed = |e: String| BusError::Read { what: subject.to_string(), error: e };
        let last = within(&format!("a read of {subject}"), async {
            let stream = self.js.get_stream(stream).await.map_err(|e| failed(e.to_string()))?;
            Ok::<_, BusError>(stream.get_last_raw_message_by_subject(subject).await)
        })
        .await??;
        match last {
            Ok(msg) => Ok(Some(msg)),
            Err(e) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(failed(e.to_string())),
        }
    }

    /// Whether the last event of `event`'s run and kind on the bus is `event` itself (by its
    /// message id). For a run's end, one a run: a publish that landed longer ago than the
    /// stream's duplicate window is not deduplicated, so a step delivered again that late asks
    /// this before publishing its end again.
    pub async fn holds_event(&self, event: &pitcrew_model::RunEvent) -> Result<bool, BusError> {
        let subject = self.subjects.event(event.run_id, event.kind.as_str());
        self.holds(&self.subjects.events_stream(), &subject, &event.msg_id()).await
    }

    /// Whether any message on `subject` of `stream` stored since `since` has the message id
    /// `id` (read in order from then, at most `HELD_SCAN` messages): for a subject many
    /// messages share (a stage's dead letters), where the last one may be another's. Their
    /// headers alone are read: a letter holds its message whole (up to the bus's 512 KiB), and
    /// a backlog of them read whole for each one dead-lettered would be gigabytes.
    pub async fn held_since(
        &self,
        stream: &str,
        subject: &str,
        id: &str,
        since: time::OffsetDateTime,
    ) -> Result<bool, BusError> {
        let failed = |e: String| BusError::Read { what: subject.to_string(), error: e };
        within(&format!("a search of {subject}"), async {
            let stream = self.js.get_stream(stream).await.map_err(|e| failed(e.to_string()))?;
            let consumer = stream
                .create_consumer(consumer::pull::OrderedConfig {
                    filter_subject: subject.to_string(),
                    deliver_policy: consumer::DeliverPolicy::ByStartTime { start_time: since },
                    headers_only: true,
                    ..Default::default()
                })
                .await
                .map_err(|e| failed(e.to_string()))?;
            if consumer.cached_info().num_pending == 0 {
                return Ok(false);
            }
            let mut messages = consumer.messages().await.map_err(|e| failed(e.to_string()))?;
            let mut read = 0;
            while let Some(msg) = futures::StreamExt::next(&mut messages).await {
                let msg = msg.map_err(|e| failed(e.to_string()))?;
                if carries_id(msg.headers.as_ref(), id) {
                    return Ok(true);
                }
                read += 1;
                let pending = msg.info().map(|i| i.pending).unwrap_or(0);
                if pending == 0 || read >= HELD_SCAN {
                    break;
                }
            }
            Ok(false)
        })
        .await?
    }

    /// Whether the last message on `subject` of `stream` has the message id `id`: one sent
    /// again past the stream's duplicate window would not be dropped as a duplicate.
    pub async fn holds(&self, stream: &str, subject: &str, id: &str) -> Result<bool, BusError> {
        let last = self.last_on(stream, subject).await?;
        Ok(last.is_some_and(|last| carries_id(Some(&last.headers), id)))
    }

    /// Publish an incident (JSON) on `incidents.new`, its id as the message id and the run
    /// header, and wait for the stream's ack; returns the id (the run's id). The one way the
    /// monitor, the gateway, the CLI and the load tool open an incident.
    pub async fn open_incident(&self, incident: &Incident) -> Result<uuid::Uuid, BusError> {
        let subject = self.subjects.incidents_new();
        let refused = |error: String| BusError::Publish { subject: subject.clone(), error };
        let id = incident.id.ok_or_else(|| refused("the incident has no id".into()))?;
        let payload = serde_json::to_vec(incident).map_err(|e| refused(format!("encoding the incident: {e}")))?;
        self.publish(subject, &id.to_string(), codec::JSON, Some(id), payload.into()).await?;
        Ok(id)
    }

    /// Publish to JetStream with a deterministic message id and wait for the stream's ack.
    pub async fn publish(
        &self,
        subject: String,
        msg_id: &str,
        content_type: &str,
        run: Option<uuid::Uuid>,
        payload: Bytes,
    ) -> Result<(), BusError> {
        self.publish_with_headers(subject, headers(msg_id, content_type, run), payload).await
    }

    /// Publish with caller-built headers and wait for the stream's ack.
    pub async fn publish_with_headers(
        &self,
        subject: String,
        headers: HeaderMap,
        payload: Bytes,
    ) -> Result<(), BusError> {
        let err = |e: String| BusError::Publish { subject: subject.clone(), error: e };
        let ack =
            self.js.publish_with_headers(subject.clone(), headers, payload).await.map_err(|e| err(e.to_string()))?;
        // Sent, or queued in the client: without its ack nobody can say whether it is stored,
        // or will be once NATS answers.
        ack.await.map_err(|e| {
            self.unacked(&subject, &e);
            err(format!("{e}: no ack, so it may be stored all the same"))
        })?;
        Ok(())
    }

    /// Note a publish to `subject` that got no ack: one no stream takes (a stream deleted by
    /// hand while pitcrew runs) has the streams made again, at most once every
    /// [`REMAKE_STREAMS_EVERY`] in this process, from a task of its own. The publish fails as
    /// any unacked one and is tried again by its caller, then finds its stream.
    pub fn unacked(&self, subject: &str, e: &jetstream::context::PublishError) {
        if e.kind() != jetstream::context::PublishErrorKind::StreamNotFound {
            return;
        }
        {
            let mut remade = self.remade.lock().unwrap_or_else(|p| p.into_inner());
            if remade.is_some_and(|at| at.elapsed() < REMAKE_STREAMS_EVERY) {
                return;
            }
            *remade = Some(std::time::Instant::now());
        }
        tracing::warn!(subject, "no stream takes this subject (deleted?): making pitcrew's streams again");
        let bus = self.clone();
        tokio::spawn(async move {
            match bus.ensure_streams().await {
                Ok(()) => tracing::info!("pitcrew's streams are there again"),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot make pitcrew's streams again (tried again on the next such publish)")
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_come_from_the_url() {
        let up = |u: &str, p: &str| Some(Credentials::UserPassword(u.into(), p.into()));
        assert_eq!(url_credentials("nats://crew:s3cret@nats:4222"), up("crew", "s3cret"));
        assert_eq!(url_credentials("nats://crew:p%40ss%3Aw0rd@nats:4222"), up("crew", "p@ss:w0rd"));
        assert_eq!(url_credentials("nats://a:b@h1:4222,nats://a:b@h2:4222"), up("a", "b"));
        assert_eq!(url_credentials("tls://tok%2Fen@nats"), Some(Credentials::Token("tok/en".into())));
        assert_eq!(url_credentials("nats://nats:4222"), None);
        assert_eq!(url_credentials("127.0.0.1:4222"), None);
        assert_eq!(url_credentials("nats://@nats:4222"), None);
        assert_eq!(percent_decode("100%"), "100%");
    }

    /// What the real client says when nothing listens, or the URL is bad: only the first is
    /// worth waiting for at start-up.
    #[tokio::test]
    async fn only_a_server_that_did_not_answer_is_worth_waiting_for() {
        let port = crate::natsd::free_port().unwrap();
        let connect = |url: String| async move {
            let mut cfg = Config::from_toml("").unwrap();
            cfg.nats.url = url;
            cfg.nats.connect_timeout_secs = 2;
            Bus::connect(&cfg).await.err().expect("no server there")
        };
        let down = connect(format!("nats://127.0.0.1:{port}")).await;
        assert!(down.is_unreachable(), "{down}");
        let bad = connect("nats://127.0.0.1:notaport".into()).await;
        assert!(!bad.is_unreachable(), "{bad}");
        let setup = |error: &str| BusError::Setup { what: "stream X".into(), error: error.into() };
        assert!(setup("timed out: didn't receive any response").is_unreachable());
        assert!(setup("jetstream error: JetStream system temporarily unavailable (code 503)").is_unreachable());
        assert!(!setup("stream name already in use with a different configuration").is_unreachable());
        let refused = BusError::Connect { url: "nats://x".into(), error: "authorization violation".into() };
        assert!(!refused.is_unreachable());
        let tls = BusError::Connect {
            url: "tls://x".into(),
            error: "IO error: invalid peer certificate: UnknownIssuer".into(),
        };
        assert!(!tls.is_unreachable());
        let expired =
            BusError::Connect { url: "nats://x".into(), error: "IO error: -ERR 'User Authentication Expired'".into() };
        assert!(!expired.is_unreachable());
    }
}
