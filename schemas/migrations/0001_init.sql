-- pitcrew: the system of record. Applied at start-up under an advisory lock (see store/migrate.rs).

CREATE TABLE incidents (
    id           uuid PRIMARY KEY,
    fingerprint  text        NOT NULL,
    service      text        NOT NULL,
    host         text,
    error        text        NOT NULL,
    severity     text        NOT NULL,
    source       text,
    labels       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    observed_at  timestamptz,
    received_at  timestamptz NOT NULL DEFAULT now(),
    -- set when the incident joined an already open run with the same fingerprint
    duplicate_of uuid
);
CREATE INDEX incidents_received_at ON incidents (received_at DESC);

-- One run per incident that was not a duplicate; run id = incident id.
CREATE TABLE runs (
    id          uuid PRIMARY KEY REFERENCES incidents (id),
    fingerprint text        NOT NULL,
    status      text        NOT NULL CHECK (status IN ('open', 'waiting_approval', 'resolved', 'escalated')),
    stage       text        NOT NULL,
    seq         integer     NOT NULL,
    attempt     integer     NOT NULL,
    state       jsonb       NOT NULL,
    reason      text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);
-- Intake deduplicates on this: one open run per fingerprint.
CREATE UNIQUE INDEX runs_one_open_per_fingerprint ON runs (fingerprint)
    WHERE status IN ('open', 'waiting_approval');
CREATE INDEX runs_created_at ON runs (created_at DESC);

-- The timeline. (run_id, seq, idx) is deterministic, so a redelivered stage writes nothing twice.
CREATE TABLE run_events (
    run_id  uuid        NOT NULL,
    seq     integer     NOT NULL,
    idx     integer     NOT NULL,
    stage   text        NOT NULL,
    kind    text        NOT NULL,
    message text        NOT NULL,
    data    jsonb       NOT NULL DEFAULT 'null'::jsonb,
    worker  text        NOT NULL,
    at      timestamptz NOT NULL,
    PRIMARY KEY (run_id, seq, idx)
);

-- What was tried for an error and whether it worked: episodic memory.
CREATE TABLE episodes (
    run_id     uuid        NOT NULL REFERENCES runs (id),
    attempt    integer     NOT NULL,
    service    text        NOT NULL,
    signature  text        NOT NULL,
    error      text        NOT NULL,
    diagnosis  text        NOT NULL,
    commands   text[]      NOT NULL,
    result     text        NOT NULL,
    success    boolean     NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, attempt)
);
CREATE INDEX episodes_memory ON episodes (service, signature, created_at DESC);

CREATE TABLE evaluations (
    run_id       uuid             NOT NULL REFERENCES runs (id),
    attempt      integer          NOT NULL,
    regeneration integer          NOT NULL,
    score        double precision NOT NULL,
    verdict      text             NOT NULL,
    checks       jsonb            NOT NULL,
    feedback     text,
    created_at   timestamptz      NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, attempt, regeneration)
);

CREATE TABLE approvals (
    run_id       uuid        NOT NULL REFERENCES runs (id),
    plan_hash    text        NOT NULL,
    attempt      integer     NOT NULL,
    commands     text[]      NOT NULL,
    risk         text        NOT NULL,
    rule         text        NOT NULL,
    requested_at timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL,
    decision     text CHECK (decision IN ('approve', 'deny', 'expire')),
    decided_by   text,
    decided_at   timestamptz,
    channel      text,
    reason       text,
    -- the bridge-stream sequence of the deciding message: a redelivery of it is recognised
    decision_seq bigint,
    PRIMARY KEY (run_id, plan_hash)
);
CREATE INDEX approvals_pending ON approvals (expires_at) WHERE decision IS NULL;

-- One row per command per attempt, written (intent) before the command runs.
CREATE TABLE executions (
    run_id      uuid        NOT NULL REFERENCES runs (id),
    attempt     integer     NOT NULL,
    idx         integer     NOT NULL,
    command     text        NOT NULL,
    host        text        NOT NULL,
    worker      text        NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    status      text,
    exit_code   integer,
    output      text,
    PRIMARY KEY (run_id, attempt, idx)
);
