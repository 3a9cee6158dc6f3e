//! Live streams as Server-Sent Events. A run's stream replays its past events from JetStream
//! (an ordered consumer from the start) and follows live ones until a terminal event (a client
//! resuming with `Last-Event-ID` after the run ended gets what is left, then the end); the
//! all-runs stream follows from now (or `since`, or `Last-Event-ID`) with a kind/run filter.
//! Each client has its own consumer, task and bounded buffer: a client whose buffer stays
//! full for `SLOW_CLIENT` is dropped (it reconnects with `Last-Event-ID`), so no client ever
//! blocks the bus, the crew or another client.

use crate::access::Caller;
use crate::body::{bad_query, RunPath};
use crate::error::ApiError;
use crate::Gateway;
use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Extension, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, KeepAliveStream, Sse};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use futures::{Stream, StreamExt};
use pitcrew_model::{EventKind, RunEvent};
use pitcrew_runtime::bus::within;
use serde::Deserialize;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use uuid::Uuid;

/// Live streams open at once; more are refused with 503.
pub const MAX_STREAMS: usize = 1024;
/// How long a run id that is not known yet (an incident just posted) is waited for.
const UNKNOWN_GRACE: Duration = Duration::from_secs(3);
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// How long a stream resumed after the run ended in Postgres waits for its end to be on the
/// bus (published right after the commit; expired after 7 days).
const PUBLISH_GRACE: Duration = Duration::from_secs(2);
/// A client whose buffer stays full this long is dropped.
pub const SLOW_CLIENT: Duration = Duration::from_secs(5);
/// The most a live stream holds for its client, in bytes of events (one larger than this is
/// held alone), besides `[gateway] sse_buffer` events: whichever is reached first makes the
/// buffer full. With [`MAX_STREAMS`] streams, 256 MiB in all, whatever the events' size.
pub const STREAM_BUFFER_BYTES: usize = 256 * 1024;

type EventStream = Sse<KeepAliveStream<std::pin::Pin<Box<dyn Stream<Item = Result<Event, Infallible>> + Send>>>>;

/// When a live stream ends, besides its client leaving, a slow client or shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Never: the all-runs stream.
    Never,
    /// At the run's terminal event.
    Terminal,
    /// The run ended before the client (re)connected: at its terminal event, or once what
    /// the bus holds of the run is sent.
    CaughtUp,
}

/// The id prefix of an event replayed from the stored timeline (`stored.<seq>.<index>`): not
/// a stream sequence, and only ever sent for a run that has ended.
const STORED_ID: &str = "stored.";

/// Where a reconnecting client (`Last-Event-ID`) resumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resume {
    /// A first connection.
    Start,
    /// At this stream sequence, the one after the last event the client saw.
    Bus(u64),
    /// After an event of a stored timeline: the run had ended.
    Stored,
}

fn last_event_id(headers: &HeaderMap) -> Result<Resume, ApiError> {
    match headers.get("last-event-id").map(|v| v.to_str().unwrap_or("").trim()) {
        None | Some("") => Ok(Resume::Start),
        Some(v) if v.starts_with(STORED_ID) => Ok(Resume::Stored),
        Some(v) => v.parse::<u64>().ok().and_then(|seq| seq.checked_add(1)).map(Resume::Bus).ok_or_else(|| {
            ApiError::BadRequest(format!(
                "Last-Event-ID '{}' is not an event id of this stream",
                pitcrew_model::trim::clip(v, 32)
            ))
        }),
    }
}

/// The answer to a client resuming a stream with nothing left to send: 204 No Content, which
/// tells an `EventSource` to stop reconnecting (an empty 200 stream would have it reconnect
/// every few seconds, for ever).
fn nothing_left() -> Response {
    StatusCode::NO_CONTENT.into_response()
}

/// `GET /v1/runs/{id}/events`
pub async fn run_events(
    State(gw): State<Arc<Gateway>>,
    Extension(caller): Extension<Caller>,
    RunPath(run): RunPath,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let resume = last_event_id(&headers)?;
    let deadline = tokio::time::Instant::now() + UNKNOWN_GRACE;
    while !gw.store.incident_exists(run).await? {
        if tokio::time::Instant::now() >= deadline {
            return Err(ApiError::NotFound(format!("unknown run {run}: no incident with this id")));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (deliver, end) = match resume {
        Resume::Start => {
            if let Some(stored) = stored_replay(&gw, &caller, run).await? {
                return Ok(stored.into_response());
            }
            (DeliverPolicy::All, End::Terminal)
        }
        // The client has the whole stored timeline, which ends with the run's end.
        Resume::Stored => return Ok(nothing_left()),
        Resume::Bus(next) => {
            // Ended, by the bus or by Postgres (the bus keeps events 7 days): nothing more to
            // wait for once the client has what is left. Ended in Postgres alone, the end may
            // be committed and not yet published (its events go out right after the commit):
            // the bus gets a moment to catch up, or the client would be told there is nothing
            // left (204, and an EventSource stops) just before the end arrives.
            let ended = ended_on_bus(&gw, run).await? || {
                let in_store = ended_in_store(&gw, run).await?;
                if in_store {
                    wait_for_end_on_bus(&gw, run, PUBLISH_GRACE).await?;
                }
                in_store
            };
            let end = if ended { End::CaughtUp } else { End::Terminal };
            (DeliverPolicy::ByStartSequence { start_sequence: next }, end)
        }
    };
    let followed = follow(&gw, &caller, vec![gw.bus.subjects.events_of(run)], deliver, None, end).await?;
    Ok(followed.map_or_else(nothing_left, IntoResponse::into_response))
}

/// Whether the bus holds the run's terminal event (a client resuming after it has no more to
/// wait for).
async fn ended_on_bus(gw: &Gateway, run: Uuid) -> Result<bool, ApiError> {
    Ok(subjects_on_bus(gw, run).await?.iter().any(|subject| {
        let kind = subject.rsplit('.').next().unwrap_or_default();
        let kind: Option<EventKind> = serde_json::from_value(serde_json::Value::String(kind.to_string())).ok();
        kind.is_some_and(EventKind::is_terminal)
    }))
}

/// Wait up to `grace` for the bus to hold the run's terminal event, which it did not hold a
/// moment ago: the stream then starts with whatever the bus holds by then.
async fn wait_for_end_on_bus(gw: &Gateway, run: Uuid, grace: Duration) -> Result<(), ApiError> {
    let deadline = tokio::time::Instant::now() + grace;
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if ended_on_bus(gw, run).await? {
            break;
        }
    }
    Ok(())
}

/// Whether the run's stored timeline has ended (the system of record).
async fn ended_in_store(gw: &Gateway, run: Uuid) -> Result<bool, ApiError> {
    Ok(gw.store.timeline(run).await?.iter().any(|e| e.kind.is_terminal()))
}

/// The subjects the bus holds events of the run on (one per kind of event: a few).
async fn subjects_on_bus(gw: &Gateway, run: Uuid) -> Result<Vec<String>, ApiError> {
    let nats = |e: String| ApiError::unavailable("NATS", e);
    let listed = within("the run's event subjects", async {
        let stream = gw.bus.js.get_stream(gw.bus.subjects.events_stream()).await.map_err(|e| e.to_string())?;
        let mut subjects =
            stream.info_with_subjects(gw.bus.subjects.events_of(run)).await.map_err(|e| e.to_string())?;
        let mut found = Vec::new();
        while let Some(s) = subjects.next().await {
            found.push(s.map_err(|e| e.to_string())?.0);
        }
        Ok(found)
    });
    listed.await.map_err(|e| nats(e.to_string()))?.map_err(nats)
}

/// A finished run whose end has expired from the bus (7 days) is replayed from its stored
/// timeline in Postgres, the system of record; None when the bus still has its end (what it
/// holds of the run besides, an event published after the end, could never end a stream).
async fn stored_replay(gw: &Gateway, caller: &Caller, run: Uuid) -> Result<Option<EventStream>, ApiError> {
    let permits = stream_permits(gw, caller)?;
    let timeline = gw.store.timeline(run).await?;
    if !timeline.iter().any(|e| e.kind.is_terminal()) {
        return Ok(None);
    }
    if ended_on_bus(gw, run).await? {
        return Ok(None);
    }
    let events: Vec<Result<Event, Infallible>> = timeline
        .iter()
        .filter_map(|e| {
            serde_json::to_string(e).ok().map(|data| {
                let id = format!("{STORED_ID}{}.{}", e.seq, e.index);
                Ok(Event::default().id(id).event(e.kind.as_str()).data(data))
            })
        })
        .collect();
    // The stream's slots are held as long as its answer is, like a live stream's.
    let body = futures::stream::unfold((events.into_iter(), permits), |(mut events, permits)| async move {
        events.next().map(|e| (e, (events, permits)))
    });
    let body: std::pin::Pin<Box<dyn Stream<Item = Result<Event, Infallible>> + Send>> = Box::pin(body);
    Ok(Some(Sse::new(body).keep_alive(KeepAlive::new().interval(KEEP_ALIVE))))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    /// Comma-separated event kinds.
    kind: Option<String>,
    run: Option<Uuid>,
    since: Option<DateTime<Utc>>,
}

/// `GET /v1/events?kind=&run=&since=`
pub async fn all_events(
    State(gw): State<Arc<Gateway>>,
    Extension(caller): Extension<Caller>,
    q: Result<Query<EventsQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(bad_query)?;
    let mut kinds = Vec::new();
    for k in q.kind.iter().flat_map(|k| k.split(',')).map(str::trim).filter(|k| !k.is_empty()) {
        let kind: EventKind = serde_json::from_value(serde_json::Value::String(k.to_string())).map_err(|_| {
            ApiError::BadRequest(format!("kind '{}' is not an event kind", pitcrew_model::trim::clip(k, 32)))
        })?;
        // Twice the same kind would be overlapping filters, which JetStream refuses.
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    let prefix = gw.bus.subjects.prefix().to_string();
    let run = q.run.map(|r| r.to_string()).unwrap_or_else(|| "*".into());
    let subjects = if kinds.is_empty() {
        vec![format!("{prefix}.events.{run}.>")]
    } else {
        kinds.iter().map(|k| format!("{prefix}.events.{run}.{}", k.as_str())).collect()
    };
    let deliver = match (last_event_id(&headers)?, q.since) {
        (Resume::Bus(next), _) => DeliverPolicy::ByStartSequence { start_sequence: next },
        (Resume::Stored, _) => {
            return Err(ApiError::BadRequest(
                "Last-Event-ID of a run's stored timeline is not an event id of the all-runs stream".into(),
            ))
        }
        (Resume::Start, Some(t)) => DeliverPolicy::ByStartTime { start_time: start_time(t)? },
        (Resume::Start, None) => DeliverPolicy::New,
    };
    let followed = follow(&gw, &caller, subjects, deliver, Some(kinds), End::Never).await?;
    // (Never None: only a run that has ended is ever caught up.)
    Ok(followed.map_or_else(nothing_left, IntoResponse::into_response))
}

/// `since` as JetStream's start time. Nanoseconds since 1970 in an i64 reach from 1677 to
/// 2262: a `since` outside is refused (as 1970 it would replay every stored event).
fn start_time(since: DateTime<Utc>) -> Result<time::OffsetDateTime, ApiError> {
    since
        .timestamp_nanos_opt()
        .and_then(|nanos| time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(nanos)).ok())
        .ok_or_else(|| {
            ApiError::BadRequest(format!(
                "since '{}' is out of range: it must be between 1677-09-21 and 2262-04-11",
                since.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
            ))
        })
}

static SLOW_DROPPED: pitcrew_metrics::Counter = pitcrew_metrics::Counter::new(
    "pitcrew_gateway_slow_streams_dropped_total",
    "Live event streams ended because their client did not read for SLOW_CLIENT with a full buffer.",
    &[],
);

/// A slot among all streams and one of `caller`'s own share, held while its answer lives.
fn stream_permits(gw: &Gateway, caller: &Caller) -> Result<(OwnedSemaphorePermit, OwnedSemaphorePermit), ApiError> {
    let permit = gw
        .streams
        .clone()
        .try_acquire_owned()
        .map_err(|_| ApiError::Unavailable(format!("{MAX_STREAMS} live streams are open already: retry later")))?;
    Ok((permit, key_permit(gw, caller)?))
}

/// A permit of `caller`'s own share of live streams.
fn key_permit(gw: &Gateway, caller: &Caller) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
    let per_key = gw.cfg.gateway.streams_per_key;
    let slots = gw
        .streams_of
        .lock()
        .expect("streams_of lock")
        .entry(caller.name.clone())
        .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(per_key)))
        .clone();
    slots.try_acquire_owned().map_err(|_| {
        ApiError::TooMany(format!(
            "key '{}' holds {per_key} live streams already ([gateway] streams_per_key): close one first",
            pitcrew_model::trim::clip(&caller.name, 64)
        ))
    })
}

/// Open an ordered consumer and feed its events to a bounded per-client channel from a task
/// of its own; the response streams the channel. The task ends as `end` says, on a full buffer
/// (a slow client), a gone client or shutdown. None: the run has ended and nothing is left to
/// send from where the client resumes.
async fn follow(
    gw: &Arc<Gateway>,
    caller: &Caller,
    filter_subjects: Vec<String>,
    deliver_policy: DeliverPolicy,
    kinds: Option<Vec<EventKind>>,
    end: End,
) -> Result<Option<EventStream>, ApiError> {
    let permits = stream_permits(gw, caller)?;
    let nats = |e| ApiError::unavailable("NATS", e);
    let stream = within("the events stream", gw.bus.js.get_stream(gw.bus.subjects.events_stream()))
        .await
        .map_err(nats)?
        .map_err(|e| ApiError::unavailable("NATS", e))?;
    let config = OrderedConfig { filter_subjects, deliver_policy, ..Default::default() };
    let consumer = within("a consumer of events", stream.create_consumer(config))
        .await
        .map_err(nats)?
        .map_err(|e| ApiError::unavailable("NATS", e))?;
    if end == End::CaughtUp && consumer.cached_info().num_pending == 0 {
        return Ok(None);
    }
    let mut messages = consumer.messages().await.map_err(|e| ApiError::unavailable("NATS", e))?;
    let (tx, rx) = mpsc::channel::<(Event, OwnedSemaphorePermit)>(gw.cfg.gateway.sse_buffer.max(1));
    // Its bytes: each event takes its size from `room` until the client's side takes it.
    let room = Arc::new(Semaphore::new(STREAM_BUFFER_BYTES));
    let mut shutdown = gw.shutdown.clone();
    let gw = gw.clone();
    tokio::spawn(async move {
        loop {
            // Shutdown and a gone client first: with a message ready too, an unbiased select
            // could go on forwarding after either.
            let msg = tokio::select! {
                biased;
                _ = &mut shutdown => break,
                _ = tx.closed() => break,
                m = messages.next() => m,
            };
            let msg = match msg {
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "event stream failed: closing the client's stream");
                    break;
                }
                None => break,
            };
            let info = msg.info().ok().map(|i| (i.stream_sequence, i.pending));
            let seq = info.map(|i| i.0).unwrap_or(0);
            let caught_up = end == End::CaughtUp && info.is_some_and(|i| i.1 == 0);
            let Ok(event) = serde_json::from_slice::<RunEvent>(&msg.payload) else {
                if caught_up {
                    break;
                }
                continue;
            };
            if let Some(kinds) = &kinds {
                if !kinds.is_empty() && !kinds.contains(&event.kind) {
                    continue;
                }
            }
            let sse = Event::default()
                .id(seq.to_string())
                .event(event.kind.as_str())
                .data(String::from_utf8_lossy(&msg.payload));
            // A full buffer (in events or in bytes): the client gets a moment to catch up (a
            // burst), then is dropped.
            let size = u32::try_from(msg.payload.len().clamp(1, STREAM_BUFFER_BYTES)).unwrap_or(u32::MAX);
            let handed = async {
                let held = room.clone().acquire_many_owned(size).await.ok()?;
                tx.send((sse, held)).await.ok()
            };
            match tokio::time::timeout(SLOW_CLIENT, handed).await {
                Ok(Some(())) => {}
                // The client is gone.
                Ok(None) => break,
                Err(_) => {
                    gw.slow_dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    SLOW_DROPPED.inc(&[]);
                    tracing::warn!(
                        run = %event.run_id,
                        "live stream client too slow: dropped (it may reconnect with Last-Event-ID)"
                    );
                    break;
                }
            }
            if (end != End::Never && event.kind.is_terminal()) || caught_up {
                break;
            }
        }
    });
    // An event's bytes are given back as it leaves for the client. The stream's slots are the
    // answer's, not the task's: a client dropped as too slow still holds what its answer
    // buffers until the answer ends, so its slots count until then.
    let body = futures::stream::unfold((rx, permits), |(mut rx, permits)| async move {
        rx.recv().await.map(|(e, _held)| (Ok(e), (rx, permits)))
    });
    let body: std::pin::Pin<Box<dyn Stream<Item = Result<Event, Infallible>> + Send>> = Box::pin(body);
    Ok(Some(Sse::new(body).keep_alive(KeepAlive::new().interval(KEEP_ALIVE))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_since_beyond_what_jetstream_can_start_at_is_refused_not_1970() {
        let t = |s: &str| s.parse::<DateTime<Utc>>().unwrap();
        let start = start_time(t("2026-11-22T07:00:00.5Z")).unwrap();
        assert_eq!((start.year(), start.nanosecond()), (2026, 500_000_000));
        for far in ["2300-01-01T00:00:00Z", "1600-01-01T00:00:00Z"] {
            let e = start_time(t(far)).unwrap_err();
            assert!(
                matches!(&e, ApiError::BadRequest(m) if m.contains(&format!("since '{far}' is out of range"))),
                "{e:?}"
            );
        }
    }
}
