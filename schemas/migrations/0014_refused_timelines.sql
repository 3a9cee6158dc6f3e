-- `pitcrew prune` deletes the timelines of incidents refused at intake, which have neither a
-- run nor an incident row (refused before anything was stored): found by this index, not by
-- reading every event. Refusals only: most events are none.
CREATE INDEX IF NOT EXISTS run_events_rejected_at ON run_events (at) WHERE kind = 'rejected';
