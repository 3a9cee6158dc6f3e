-- Tokens a reasoning provider used, per run and stage; keyed by the run state's seq so a
-- redelivered message overwrites rather than double-counts.
CREATE TABLE llm_usage (
    run_id            uuid        NOT NULL REFERENCES runs (id),
    seq               integer     NOT NULL,
    stage             text        NOT NULL,
    attempt           integer     NOT NULL,
    model             text        NOT NULL,
    calls             integer     NOT NULL,
    prompt_tokens     bigint      NOT NULL,
    completion_tokens bigint      NOT NULL,
    at                timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, seq, stage)
);
CREATE INDEX llm_usage_at ON llm_usage (at);
