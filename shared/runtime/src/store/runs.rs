//! Incidents, runs and the timeline.

use super::{Store, StoreError};
use chrono::{DateTime, Utc};
use pitcrew_model::{RunEvent, RunState, Stage};
use uuid::Uuid;

/// Where a run stands, as stored in `runs.status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunStatus {
    Open,
    WaitingApproval,
    Resolved,
    Escalated,
}

impl RunStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Open => "open",
            RunStatus::WaitingApproval => "waiting_approval",
            RunStatus::Resolved => "resolved",
            RunStatus::Escalated => "escalated",
        }
    }
    fn parse(s: &str) -> RunStatus {
        match s {
            "waiting_approval" => RunStatus::WaitingApproval,
            "resolved" => RunStatus::Resolved,
            "escalated" => RunStatus::Escalated,
            _ => RunStatus::Open,
        }
    }
    pub fn is_final(self) -> bool {
        matches!(self, RunStatus::Resolved | RunStatus::Escalated)
    }
}

/// What became of an incident, by its id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IncidentSeen {
    /// Never received.
    New,
    /// Received and taken care of: it has a run of its own, or joined one still open, or is
    /// being opened now.
    Taken,
    /// It joined this run (same fingerprint), which has closed since. The same alert sent
    /// again (an Alertmanager alert keeps its id while it fires) is a fault that run did not
    /// end: it must be published again to open a run of its own.
    JoinedClosed(Uuid),
    /// It joined this run (same fingerprint), still open: news of it (its resolution at the
    /// source) belongs there, not on its own timeline, which ended in `duplicate`.
    JoinedOpen(Uuid),
    /// The id was received for an incident of another fingerprint (another service, host or
    /// error): a sender reusing ids, not the same incident sent again.
    Another,
}

/// What intake found when it tried to start a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenRun {
    /// A new run was created.
    Created,
    /// This incident's run already exists (a redelivery): carry on with it.
    Existing,
    /// Another open run has the same fingerprint: this incident joins it.
    Duplicate(Uuid),
}

/// A run as stored.
#[derive(Debug, Clone)]
pub struct StoredRun {
    pub status: RunStatus,
    pub state: RunState,
    pub reason: Option<String>,
}

/// One line of `pitcrew incidents`.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub id: Uuid,
    pub service: String,
    pub error: String,
    pub status: String,
    pub stage: String,
    pub attempt: i32,
    pub reason: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// The state as a jsonb parameter, serialised straight into the wire buffer.
fn state_json(state: &RunState) -> tokio_postgres::types::Json<&RunState> {
    tokio_postgres::types::Json(state)
}

impl Store {
    /// Persist the incident and start its run, unless one is open for its fingerprint.
    #[tracing::instrument(name = "db_write", skip_all, fields(op = "open_run"))]
    pub async fn open_run(&self, state: &RunState) -> Result<OpenRun, StoreError> {
        let inc = &state.incident;
        let fp = inc.effective_fingerprint();
        let severity =
            serde_json::to_value(inc.severity).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
        let labels = serde_json::to_value(&inc.labels).unwrap_or_default();
        let client = self.client().await?;
        // The common case, a new incident starting its run, is one statement (one round trip,
        // atomic without BEGIN/COMMIT; the run's foreign key is checked at its end). A run not
        // created is a redelivery or joins another open run with the fingerprint: read which.
        let fast = client
            .prepare_cached(
                "WITH i AS (
                     INSERT INTO incidents (id, fingerprint, service, host, error, severity, source, labels, observed_at)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (id) DO NOTHING),
                 r AS (
                     INSERT INTO runs (id, fingerprint, status, stage, seq, attempt, state)
                     SELECT $1, $2, 'open', $10, $11, $12, $13
                      WHERE NOT EXISTS (SELECT 1 FROM incidents WHERE id = $1 AND duplicate_of IS NOT NULL)
                     ON CONFLICT DO NOTHING RETURNING 1)
                 SELECT count(*) FROM r",
            )
            .await?;
        let created: i64 = client
            .query_one(
                &fast,
                &[
                    &state.run_id,
                    &fp,
                    &inc.service,
                    &inc.host,
                    &inc.error,
                    &severity,
                    &inc.source,
                    &labels,
                    &inc.observed_at,
                    &state.step.as_str(),
                    &(state.seq as i32),
                    &(state.attempt as i32),
                    &state_json(state),
                ],
            )
            .await?
            .get(0);
        if created == 1 {
            return Ok(OpenRun::Created);
        }
        // Not created: the incident is stored now (by this statement or an earlier delivery).
        if client.query_opt("SELECT 1 FROM runs WHERE id = $1", &[&state.run_id]).await?.is_some() {
            return Ok(OpenRun::Existing);
        }
        // A redelivery of an incident an earlier delivery found a duplicate: it stays one, even
        // once the run it joined has closed (its timeline already ends in `duplicate`).
        let joined = client
            .query_opt(
                "SELECT duplicate_of FROM incidents WHERE id = $1 AND duplicate_of IS NOT NULL",
                &[&state.run_id],
            )
            .await?;
        if let Some(row) = joined {
            return Ok(OpenRun::Duplicate(row.get(0)));
        }
        let open = client
            .query_opt("SELECT id FROM runs WHERE fingerprint = $1 AND status IN ('open', 'waiting_approval')", &[&fp])
            .await?;
        match open {
            Some(r) => {
                let other: Uuid = r.get(0);
                client
                    .execute("UPDATE incidents SET duplicate_of = $2 WHERE id = $1", &[&state.run_id, &other])
                    .await?;
                Ok(OpenRun::Duplicate(other))
            }
            // The open run closed between our insert and this read: let the redelivery retry.
            None => Err(StoreError::Unavailable("fingerprint race, retrying".into())),
        }
    }

    /// Record a transition: the run's new state and status, and the events of the step, in one
    /// transaction. An older transition never overwrites a newer one, nor anything a closed
    /// run, nor an open one of the same step its first (seq guard; a step that parks or
    /// closes its run writes at the seq it came with, and a parked one's request is asked
    /// again). Returns whether the run took the transition: `false`
    /// means the input was stale (a transition at its seq or newer exists) and nothing must
    /// follow from it but what that transition committed.
    pub async fn commit_transition(
        &self,
        state: &RunState,
        status: RunStatus,
        events: &[RunEvent],
    ) -> Result<bool, StoreError> {
        self.commit_transition_with(state, status, events, Vec::new()).await
    }

    /// [`Store::commit_transition`], writing `records` in the same statement when the run
    /// takes the transition.
    #[tracing::instrument(name = "db_write", skip_all, fields(op = "commit_transition"))]
    pub async fn commit_transition_with(
        &self,
        state: &RunState,
        status: RunStatus,
        events: &[RunEvent],
        records: Vec<super::Record>,
    ) -> Result<bool, StoreError> {
        // Queued for the group committer: alone it is written at once in one statement (one
        // round trip, atomic without BEGIN/COMMIT); under load it shares a statement with the
        // transitions of other runs waiting at the same moment.
        self.committer.commit(state, status, events, records).await
    }

    /// Close `state`'s run by hand as escalated (`state` addressed to escalate, with its reason,
    /// and `event` its end), only if it is still where it was read (`was`: its step and seq,
    /// open or parked): a step that moved it meanwhile, an escalation of its own at the same
    /// seq included, stands. What it waited on is denied by `by`, in the same statement.
    /// Not while a command of it may be running (claimed, unfinished, its time not past): the
    /// run's row is locked first, so a claim or a start at that moment either comes before
    /// (and is seen) or after (and finds the run closed: [`Store::claim_execution`] and
    /// [`Store::command_starts`] lock it too). Returns whether it was closed.
    pub async fn close_run(
        &self,
        was: (Stage, u32),
        state: &RunState,
        event: &RunEvent,
        by: &str,
    ) -> Result<bool, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        tx.execute("SELECT 1 FROM runs WHERE id = $1 FOR UPDATE", &[&state.run_id]).await?;
        let stmt = tx
            .prepare_cached(
                "WITH upd AS (
                     UPDATE runs SET stage = $2, seq = $3, state = $4::text::jsonb, status = 'escalated',
                            reason = $5, updated_at = now(), finished_at = now()
                     WHERE id = $1 AND seq = $6 AND stage = $7 AND status IN ('open', 'waiting_approval')
                       AND NOT EXISTS (SELECT 1 FROM executions
                                        WHERE run_id = $1 AND finished_at IS NULL AND gone_by > now())
                     RETURNING id),
                 ev AS (
                     INSERT INTO run_events (run_id, seq, idx, stage, kind, message, data, worker, at)
                     SELECT $1, $3, 0, $2, $8, $9, $10::jsonb, $11, $12 WHERE EXISTS (SELECT 1 FROM upd)
                     ON CONFLICT DO NOTHING),
                 denied AS (
                     UPDATE approvals SET decision = 'deny', decided_by = $13, decided_at = now(), channel = 'cli',
                            reason = $5
                     WHERE run_id = $1 AND decision IS NULL AND EXISTS (SELECT 1 FROM upd))
                 SELECT count(*) FROM upd",
            )
            .await?;
        let text = serde_json::to_string(state).expect("run state serialises");
        let closed: i64 = tx
            .query_one(
                &stmt,
                &[
                    &state.run_id,
                    &state.step.as_str(),
                    &(state.seq as i32),
                    &text,
                    &state.escalation_reason,
                    &(was.1 as i32),
                    &was.0.as_str(),
                    &event.kind.as_str(),
                    &event.message,
                    &tokio_postgres::types::Json(&event.data),
                    &event.worker,
                    &event.at,
                    &by,
                ],
            )
            .await?
            .get(0);
        tx.commit().await?;
        Ok(closed == 1)
    }

    /// Store events that belong to no run row (a rejected incident).
    #[tracing::instrument(name = "db_write", skip_all, fields(op = "insert_events"))]
    pub async fn insert_events(&self, events: &[RunEvent]) -> Result<(), StoreError> {
        let client = self.client().await?;
        insert_events(&client, events).await
    }

    /// How many notes of decisions set aside (refused, ignored: errors at the decisions' event
    /// indexes, from [`crate::runner::DECISION_EVENT_BASE`]) `run`'s timeline holds.
    pub async fn decisions_set_aside(&self, run: Uuid) -> Result<i64, StoreError> {
        let client = self.client().await?;
        let (from, to) = (crate::runner::DECISION_EVENT_BASE as i32, crate::runner::DECISION_EVENT_END as i32);
        let row = client
            .query_one(
                "SELECT count(*) FROM run_events
                 WHERE run_id = $1 AND stage = 'approval' AND kind = 'error' AND idx >= $2 AND idx < $3",
                &[&run, &from, &to],
            )
            .await?;
        Ok(row.get(0))
    }

    pub async fn load_run(&self, run: Uuid) -> Result<Option<StoredRun>, StoreError> {
        let client = self.client().await?;
        let stmt = client.prepare_cached("SELECT status, state, reason FROM runs WHERE id = $1").await?;
        let Some(row) = client.query_opt(&stmt, &[&run]).await? else { return Ok(None) };
        let status: String = row.get(0);
        let state: serde_json::Value = row.get(1);
        let state: RunState = serde_json::from_value(state)
            .map_err(|e| StoreError::Config(format!("run {run}: stored state unreadable: {e}")))?;
        Ok(Some(StoredRun { status: RunStatus::parse(&status), state, reason: row.get(2) }))
    }

    /// Whether an incident with this id was ever received (run or duplicate).
    pub async fn incident_exists(&self, id: Uuid) -> Result<bool, StoreError> {
        let client = self.client().await?;
        Ok(client.query_opt("SELECT 1 FROM incidents WHERE id = $1", &[&id]).await?.is_some())
    }

    /// What became of the incident `id`: see [`IncidentSeen`]. With `fingerprint`, an id
    /// received for an incident of another fingerprint is [`IncidentSeen::Another`].
    pub async fn incident_seen(&self, id: Uuid, fingerprint: Option<&str>) -> Result<IncidentSeen, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                "SELECT i.duplicate_of, d.status IN ('open', 'waiting_approval'),
                        EXISTS (SELECT 1 FROM runs own WHERE own.id = i.id), i.fingerprint
                 FROM incidents i LEFT JOIN runs d ON d.id = i.duplicate_of
                 WHERE i.id = $1",
                &[&id],
            )
            .await?;
        let Some(row) = row else { return Ok(IncidentSeen::New) };
        let joined: Option<Uuid> = row.get(0);
        let joined_open: Option<bool> = row.get(1);
        let own: bool = row.get(2);
        if fingerprint.is_some_and(|f| f != row.get::<_, &str>(3)) {
            return Ok(IncidentSeen::Another);
        }
        Ok(match joined {
            Some(run) if !own && joined_open != Some(true) => IncidentSeen::JoinedClosed(run),
            Some(run) if !own => IncidentSeen::JoinedOpen(run),
            _ => IncidentSeen::Taken,
        })
    }

    /// The most recent runs, newest first.
    pub async fn recent_runs(&self, limit: i64) -> Result<Vec<RunSummary>, StoreError> {
        self.list_runs(&super::RunFilter { limit, ..Default::default() }).await
    }

    /// A run's timeline in order.
    pub async fn timeline(&self, run: Uuid) -> Result<Vec<RunEvent>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT seq, idx, stage, kind, message, data, worker, at FROM run_events
                 WHERE run_id = $1 ORDER BY seq, idx",
                &[&run],
            )
            .await?;
        Ok(events_of(run, rows))
    }

    /// The events `stage` filed under `seq` of `run` (one step's), in order.
    pub async fn step_events(&self, run: Uuid, seq: u32, stage: Stage) -> Result<Vec<RunEvent>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT seq, idx, stage, kind, message, data, worker, at FROM run_events
                 WHERE run_id = $1 AND seq = $2 AND stage = $3 ORDER BY idx",
                &[&run, &(seq as i32), &stage.as_str()],
            )
            .await?;
        Ok(events_of(run, rows))
    }
}

/// Rows of `run_events` (seq, idx, stage, kind, message, data, worker, at) as events of `run`;
/// a row this build cannot read (a stage or kind from a newer one) is left out.
fn events_of(run: Uuid, rows: Vec<tokio_postgres::Row>) -> Vec<RunEvent> {
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let stage: String = r.get(2);
        let kind: String = r.get(3);
        let (Ok(stage), Ok(kind)) = (stage.parse(), serde_json::from_value(serde_json::Value::String(kind))) else {
            continue;
        };
        out.push(RunEvent {
            run_id: run,
            seq: r.get::<_, i32>(0) as u32,
            index: r.get::<_, i32>(1) as u32,
            stage,
            kind,
            message: r.get(4),
            data: r.get(5),
            worker: r.get(6),
            at: r.get(7),
        });
    }
    out
}

/// Events as columns, for one `unnest` insert (one round trip for any number of events).
pub(super) struct EventColumns<'e> {
    pub run_id: Vec<Uuid>,
    pub seq: Vec<i32>,
    pub idx: Vec<i32>,
    pub stage: Vec<&'static str>,
    pub kind: Vec<&'static str>,
    pub message: Vec<&'e str>,
    pub data: Vec<&'e serde_json::Value>,
    pub worker: Vec<&'e str>,
    pub at: Vec<DateTime<Utc>>,
}

impl<'e> EventColumns<'e> {
    pub fn of(events: impl IntoIterator<Item = &'e RunEvent>) -> Self {
        let events = events.into_iter();
        let n = events.size_hint().0;
        let mut c = EventColumns {
            run_id: Vec::with_capacity(n),
            seq: Vec::with_capacity(n),
            idx: Vec::with_capacity(n),
            stage: Vec::with_capacity(n),
            kind: Vec::with_capacity(n),
            message: Vec::with_capacity(n),
            data: Vec::with_capacity(n),
            worker: Vec::with_capacity(n),
            at: Vec::with_capacity(n),
        };
        for e in events {
            c.run_id.push(e.run_id);
            c.seq.push(e.seq as i32);
            c.idx.push(e.index as i32);
            c.stage.push(e.stage.as_str());
            c.kind.push(e.kind.as_str());
            c.message.push(e.message.as_str());
            c.data.push(&e.data);
            c.worker.push(e.worker.as_str());
            c.at.push(e.at);
        }
        c
    }
}

async fn insert_events(client: &deadpool_postgres::Object, events: &[RunEvent]) -> Result<(), StoreError> {
    if events.is_empty() {
        return Ok(());
    }
    let stmt = client
        .prepare_cached(
            "INSERT INTO run_events (run_id, seq, idx, stage, kind, message, data, worker, at)
             SELECT * FROM unnest($1::uuid[], $2::int4[], $3::int4[], $4::text[], $5::text[], $6::text[],
                                  $7::jsonb[], $8::text[], $9::timestamptz[])
             ON CONFLICT DO NOTHING",
        )
        .await?;
    let c = EventColumns::of(events);
    client
        .execute(&stmt, &[&c.run_id, &c.seq, &c.idx, &c.stage, &c.kind, &c.message, &c.data, &c.worker, &c.at])
        .await?;
    Ok(())
}
