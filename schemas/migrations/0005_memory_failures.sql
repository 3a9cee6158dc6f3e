-- Episodic memory asks, for a service and error signature, which commands failed within the
-- window. episodes_memory holds every episode, so that question read every success of the
-- signature too (a popular service's successes grow without bound: the read grew with them).
-- The failures alone, indexed, answer it from the failures alone.
CREATE INDEX episodes_failed ON episodes (service, signature, created_at DESC) WHERE NOT success;
