-- A run's state is rewritten by every transition. With the default storage (EXTENDED) a state
-- over ~2 KB once compressed (one with the default evidence commands' output: 3.9 KB of JSON,
-- 2.3 KB with lz4) is moved to the TOAST table: every transition then writes its chunks and
-- their index entries and leaves the old ones to vacuum. MAIN keeps it compressed in the row
-- unless the row would not fit in a page (~8 KB compressed): half the WAL records an update.
-- Rows already written keep their storage until their next transition.
ALTER TABLE runs ALTER COLUMN state SET STORAGE MAIN;
