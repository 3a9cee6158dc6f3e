#!/bin/sh
# pitcrew's own Postgres login: owner of its database and of what is in it, and nothing more
# (no superuser, no other database, no roles). The postgres image runs this once, as its
# superuser, on an empty data directory (/docker-entrypoint-initdb.d). On a database made
# before it (whose tables the superuser owns), run it once by hand in the container, whose
# environment compose gives the password:
#   docker compose exec postgres sh /docker-entrypoint-initdb.d/pitcrew.sh
# It is safe to run again: it sets the password and hands over whatever the superuser made.
# The password goes into pitcrew's DATABASE_URL as it is: no @ : / % # ? in it.
set -eu
: "${PITCREW_DB_PASSWORD:?set PITCREW_DB_PASSWORD, the password of pitcrew's database login}"
psql -X -v ON_ERROR_STOP=1 -v role=pitcrew -v password="$PITCREW_DB_PASSWORD" \
  --username "${POSTGRES_USER:-postgres}" --dbname "${POSTGRES_DB:-pitcrew}" <<'SQL'
SELECT format('CREATE ROLE %I', :'role') WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'role')
\gexec
ALTER ROLE :"role" WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION PASSWORD :'password';
SELECT format('ALTER DATABASE %I OWNER TO %I', current_database(), :'role')
\gexec
ALTER SCHEMA public OWNER TO :"role";
SELECT format('ALTER TABLE public.%I OWNER TO %I', tablename, :'role') FROM pg_tables WHERE schemaname = 'public'
\gexec
SELECT format('ALTER SEQUENCE public.%I OWNER TO %I', sequencename, :'role') FROM pg_sequences
 WHERE schemaname = 'public' AND sequenceowner <> :'role'
\gexec
SQL
