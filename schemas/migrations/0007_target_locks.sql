-- One remediation at a time on a target (a service on its host). A run takes its target's row
-- in execute, before its first command, and holds it while it executes and verifies: the row
-- is free once its run is closed or has moved past verify (nothing releases it, so a worker
-- killed mid-plan leaves nothing locked). `previous_run` held it before this run's attempt
-- took it, kept so the run can tell that another remediated its target after it opened.
CREATE TABLE target_locks (
    service       text        NOT NULL,
    host          text        NOT NULL,
    run_id        uuid        NOT NULL,
    attempt       integer     NOT NULL,
    taken_at      timestamptz NOT NULL DEFAULT now(),
    previous_run  uuid,
    PRIMARY KEY (service, host)
);
