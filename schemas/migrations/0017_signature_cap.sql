-- Error signatures are capped at 1024 bytes (their first bytes up to 1006, moved back to a
-- character's start, then ` ~` and the first 16 hex digits of the sha256 of the whole), so the
-- episodes of any error fit the memory indexes. Episodes an earlier build stored under a
-- longer signature get the capped one, the same as `error_signature` computes, so episodic
-- memory still finds what was tried for their error.
DO $$
DECLARE
    ep record;
    whole bytea;
    keep integer;
BEGIN
    FOR ep IN SELECT run_id, attempt, signature FROM episodes WHERE octet_length(signature) > 1024 LOOP
        whole := convert_to(ep.signature, 'UTF8');
        keep := 1006;
        -- A continuation byte (10xxxxxx) is inside a character: cut before it.
        WHILE get_byte(whole, keep) & 192 = 128 LOOP
            keep := keep - 1;
        END LOOP;
        UPDATE episodes
           SET signature = convert_from(substring(whole FROM 1 FOR keep), 'UTF8') || ' ~'
                           || left(encode(sha256(whole), 'hex'), 16)
         WHERE run_id = ep.run_id AND attempt = ep.attempt;
    END LOOP;
END $$;
