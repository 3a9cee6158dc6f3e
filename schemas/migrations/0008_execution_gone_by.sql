-- When a claimed command can no longer be running: its timeout plus a grace past its start,
-- written with its claim (and moved forward when the command starts long after it: a turn
-- for an SSH channel, a connection). A delivery that finds a command claimed and never
-- finished (its worker died or was stopped) records it interrupted only after this, so
-- nothing moves on (verify, a next attempt, another run on the target) while it may still run.
-- Null on rows claimed before this migration: the reader's own timeout applies then.
ALTER TABLE executions ADD COLUMN gone_by timestamptz;
