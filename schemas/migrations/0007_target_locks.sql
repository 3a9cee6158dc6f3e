-- One remediation at a time on a target (a service on its host). A run takes its target's row
-- in execute, before its first command, and holds it while it executes and verifies: the row
-- is free once its run is closed or has moved past verify (nothing releases it, so a worker
-- killed mid-plan leaves no lock that outlives its run). `previous_run` held it before this
-- run's attempt took it, kept so the run can tell that another remediated its target after it
-- opened; `taken_at` (when this attempt took it) is for operators.
CREATE TABLE target_locks (
    service       text        NOT NULL,
    host          text        NOT NULL,
    run_id        uuid        NOT NULL,
    attempt       integer     NOT NULL,
    taken_at      timestamptz NOT NULL DEFAULT now(),
    previous_run  uuid,
    PRIMARY KEY (service, host)
);

-- Runs waiting for a target another run holds. The wait's limit counts the time this attempt
-- was seen waiting: from its first look (a backlog at execute is no wait), with any gap
-- between two looks longer than 30 s (retries are at most 5 s apart: the crew was down) left
-- out (`since` moves forward by it; `looked` is the last look). The number waiting ahead of a
-- run bounds the queue; waiters take the target in `since` order. A row goes
-- when its run takes the target, or at the next look at the target once its run stopped
-- waiting (closed, or moved on).
CREATE TABLE target_waits (
    run_id   uuid        NOT NULL,
    attempt  integer     NOT NULL,
    service  text        NOT NULL,
    host     text        NOT NULL,
    since    timestamptz NOT NULL DEFAULT now(),
    looked   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, attempt)
);
CREATE INDEX target_waits_target ON target_waits (service, host);
