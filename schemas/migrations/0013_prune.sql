-- `pitcrew prune` deletes the incidents folded into each run it prunes: found by this index,
-- not by reading every incident once a batch. Duplicates only: most incidents are none.
CREATE INDEX IF NOT EXISTS incidents_duplicate_of ON incidents (duplicate_of) WHERE duplicate_of IS NOT NULL;
