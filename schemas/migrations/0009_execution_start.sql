-- Whether a claimed command was started. The claim (`claim`, a token of the delivery that made
-- it) is written before the command starts. A command that starts at once after its claim
-- (on the crew's own machine) is claimed with `started` set: the claim counts as its start.
-- One that first waits for its turn on its host and a channel (over SSH) is claimed with it
-- unset, and `started` is set, for that token only, just before it starts. A delivery that
-- finds a claim unfinished past its time and never started (its worker died while the command
-- waited: nothing ran) removes it and runs the command; one that may have started is recorded
-- interrupted and never run again. Null on rows claimed before this migration: they may have
-- started.
ALTER TABLE executions ADD COLUMN claim uuid, ADD COLUMN started boolean;
