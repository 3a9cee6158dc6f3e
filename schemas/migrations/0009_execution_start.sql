-- Whether a claimed command was started. The claim (`claim`, a token of the delivery that made
-- it) is written before the command waits for its turn on its host and a connection;
-- `started` is set, for that token only, just before the process starts. A delivery that finds
-- a claim unfinished past its time and never started (its worker died while the command
-- waited: nothing ran) removes it and runs the command; one that may have started is recorded
-- interrupted and never run again. Null on rows claimed before this migration: they may have
-- started.
ALTER TABLE executions ADD COLUMN claim uuid, ADD COLUMN started boolean;
