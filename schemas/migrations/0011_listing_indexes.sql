-- Listing one service's runs (`GET /v1/runs?service=web`, `pitcrew incidents --service`, a
-- dashboard polling) walked runs_created_at through every run of every other service: a
-- year of history read on every poll. (Listing by status needs no index of its own: the
-- open and waiting runs are those of runs_one_open_per_fingerprint, the rest are most runs.)
-- Building it locks writes to incidents while it runs (once, at upgrade).
CREATE INDEX IF NOT EXISTS incidents_service_received_at ON incidents (service, received_at DESC);
