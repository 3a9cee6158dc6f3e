-- Migration 6 set run states to lz4 but caught every error, the lock it waits for past
-- lock_timeout included: a database upgraded while a long transaction held `runs` recorded it
-- applied and kept pglz for good. Set it again where it is not set (no lock is taken where it
-- is); a Postgres built without lz4 keeps pglz, and a notice says why. Postgres before 14 has
-- no compression setting: nothing to do there.
DO $$
BEGIN
    IF current_setting('server_version_num')::integer >= 140000 THEN
        IF EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = 'runs'::regclass AND attname = 'state' AND attcompression <> 'l') THEN
            EXECUTE 'ALTER TABLE runs ALTER COLUMN state SET COMPRESSION lz4';
        END IF;
    END IF;
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'run states stay pglz-compressed: %', SQLERRM;
END $$;
