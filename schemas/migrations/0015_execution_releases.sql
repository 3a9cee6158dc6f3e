-- A command's claim removed because nothing ran under it (its delivery released it after a
-- start that failed or a host unreachable, a later delivery removed one that never started
-- once its time was up, or its run left execute as it was claimed again) is kept here: the
-- audit of every claim ever made, and of why a command may appear to have been claimed twice.
CREATE TABLE IF NOT EXISTS execution_releases (
    run_id      uuid        NOT NULL REFERENCES runs (id),
    attempt     integer     NOT NULL,
    idx         integer     NOT NULL,
    command     text        NOT NULL,
    host        text        NOT NULL,
    worker      text        NOT NULL,
    claim       uuid,
    started     boolean     NOT NULL,
    claimed_at  timestamptz NOT NULL,
    released_at timestamptz NOT NULL DEFAULT now(),
    why         text        NOT NULL
);
CREATE INDEX IF NOT EXISTS execution_releases_run ON execution_releases (run_id, attempt, idx);
