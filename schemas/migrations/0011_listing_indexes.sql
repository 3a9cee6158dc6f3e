-- Listing runs by status or by service (`GET /v1/runs?status=waiting_approval`, `pitcrew
-- incidents --status`, a dashboard polling) walked runs_created_at through every row when few
-- matched: a year of history read on every poll. Building these locks writes to the tables
-- while it runs (once, at upgrade).
CREATE INDEX IF NOT EXISTS runs_status_created_at ON runs (status, created_at DESC);
CREATE INDEX IF NOT EXISTS incidents_service_received_at ON incidents (service, received_at DESC);
