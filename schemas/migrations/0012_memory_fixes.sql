-- Episodic memory also asks for the last fixes of a service and error signature (and whether a
-- failed command succeeded since). episodes_memory holds every episode: for a signature never
-- fixed, that read walked all its failures, on every run. The successes alone, indexed,
-- answer it from the successes alone.
CREATE INDEX IF NOT EXISTS episodes_fixed ON episodes (service, signature, created_at DESC) WHERE success;
