//! Schema migrations (schemas/migrations) applied once, safely when many workers start at once.

use super::StoreError;
use std::time::Duration;

/// Every migration in order; the number is the version recorded in `pitcrew_migrations`.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "init", include_str!("../../../../schemas/migrations/0001_init.sql")),
    (2, "llm_usage", include_str!("../../../../schemas/migrations/0002_llm_usage.sql")),
    (3, "approval_quorum", include_str!("../../../../schemas/migrations/0003_approval_quorum.sql")),
    (4, "gateway_audit", include_str!("../../../../schemas/migrations/0004_gateway_audit.sql")),
    (5, "memory_failures", include_str!("../../../../schemas/migrations/0005_memory_failures.sql")),
    (6, "state_lz4", include_str!("../../../../schemas/migrations/0006_state_lz4.sql")),
    (7, "target_locks", include_str!("../../../../schemas/migrations/0007_target_locks.sql")),
    (8, "execution_gone_by", include_str!("../../../../schemas/migrations/0008_execution_gone_by.sql")),
    (9, "execution_start", include_str!("../../../../schemas/migrations/0009_execution_start.sql")),
    (10, "state_inline", include_str!("../../../../schemas/migrations/0010_state_inline.sql")),
    (11, "listing_indexes", include_str!("../../../../schemas/migrations/0011_listing_indexes.sql")),
    (12, "memory_fixes", include_str!("../../../../schemas/migrations/0012_memory_fixes.sql")),
    (13, "prune", include_str!("../../../../schemas/migrations/0013_prune.sql")),
    (14, "refused_timelines", include_str!("../../../../schemas/migrations/0014_refused_timelines.sql")),
    (15, "execution_releases", include_str!("../../../../schemas/migrations/0015_execution_releases.sql")),
    (16, "state_lz4_again", include_str!("../../../../schemas/migrations/0016_state_lz4_again.sql")),
    (17, "signature_cap", include_str!("../../../../schemas/migrations/0017_signature_cap.sql")),
    (18, "chat_posts", include_str!("../../../../schemas/migrations/0018_chat_posts.sql")),
];

/// How long a migration waits for a table's lock before giving up (to be tried again).
const MIGRATION_LOCK_WAIT: Duration = Duration::from_secs(5);

/// Arbitrary constant: the advisory lock that serialises migrators.
const MIGRATION_LOCK: i64 = 0x0070_6974_6372_6577;

/// Apply pending migrations, each in a transaction of its own, under an advisory lock held
/// for them all (one migrator at a time; the others wait, then find nothing left). Each its
/// own transaction: the locks one takes (a table rewritten, an index built) are let go as it
/// commits, not held through the next, every transition of the crew waiting behind them.
/// Returns how many ran.
pub async fn migrate(client: &mut tokio_postgres::Client) -> Result<usize, StoreError> {
    // Waiting for another migrator, as a migration itself, may outlast the pool's statement
    // timeout: not for this session, until it is done.
    client.batch_execute("SET statement_timeout = 0").await?;
    let applied = locked_apply(client).await;
    // Whatever happened (the lock itself may have failed): a pooled connection goes back to
    // the pool with its statement timeout.
    let reset = client.batch_execute("RESET statement_timeout").await;
    let applied = applied?;
    reset?;
    Ok(applied)
}

/// [`apply`] under the migration lock.
async fn locked_apply(client: &mut tokio_postgres::Client) -> Result<usize, StoreError> {
    let locked: bool = client.query_one("SELECT pg_try_advisory_lock($1)", &[&MIGRATION_LOCK]).await?.get(0);
    if !locked {
        tracing::info!("another process is migrating the database: waiting for it");
        client.execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK]).await?;
    }
    let applied = apply(client).await;
    // A session's lock outlives its transactions: let go whatever happened.
    let unlocked = client.execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK]).await;
    let applied = applied?;
    unlocked?;
    Ok(applied)
}

async fn apply(client: &mut tokio_postgres::Client) -> Result<usize, StoreError> {
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS pitcrew_migrations (
                version integer PRIMARY KEY,
                name text NOT NULL,
                applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .await?;
    let mut applied = 0;
    for (version, name, sql) in MIGRATIONS {
        let done = client.query_opt("SELECT 1 FROM pitcrew_migrations WHERE version = $1", &[version]).await?.is_some();
        if done {
            continue;
        }
        tracing::info!(version, name, "applying migration");
        let started = std::time::Instant::now();
        let tx = client.transaction().await?;
        // A table lock waited for without end (a session idle in a transaction that read the
        // table) would hold every statement of the crew on that table behind it: not granted
        // in time, it is a transient failure, and start-up waits and tries again.
        tx.batch_execute(&format!("SET LOCAL lock_timeout = '{}ms'", MIGRATION_LOCK_WAIT.as_millis())).await?;
        tx.batch_execute(sql).await.map_err(|e| {
            let why = super::said(&e);
            let failed = StoreError::Query(e);
            if failed.is_transient() {
                failed
            } else {
                StoreError::Migration(format!("migration {version} ({name}) failed: {why}"))
            }
        })?;
        tx.execute("INSERT INTO pitcrew_migrations (version, name) VALUES ($1, $2)", &[version, name]).await?;
        tx.commit().await?;
        tracing::info!(version, name, ms = started.elapsed().as_millis() as u64, "migration applied");
        applied += 1;
    }
    Ok(applied)
}

/// How long connecting (TCP and Postgres's start-up) may take when the URL sets no
/// `connect_timeout`: a host that accepts and never answers must not stall start-up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connect with `cfg` over `tls`, the whole handshake bounded by `limit`.
async fn connect_within(
    cfg: &tokio_postgres::Config,
    tls: &postgres_native_tls::MakeTlsConnector,
    limit: Duration,
) -> Result<Result<tokio_postgres::Client, tokio_postgres::Error>, StoreError> {
    match tokio::time::timeout(limit, cfg.connect(tls.clone())).await {
        Err(_) => Err(StoreError::Unavailable(format!("no answer within {} s", limit.as_secs_f64()))),
        Ok(Err(e)) => Ok(Err(e)),
        Ok(Ok((client, conn))) => {
            tokio::spawn(conn);
            Ok(Ok(client))
        }
    }
}

/// Create the database named in `url` if it does not exist. The database itself is tried
/// first: a role that may not connect to `postgres` (managed services often refuse it) needs
/// nothing more when the database is there; only a missing one is created from `postgres`.
pub async fn ensure_database(url: &str) -> Result<(), StoreError> {
    ensure_database_at(url, &super::tls::target(url)?).await
}

/// [`ensure_database`] with `url` already read (`target`: its settings as written, its TLS).
pub(super) async fn ensure_database_at(url: &str, target: &super::tls::Target) -> Result<(), StoreError> {
    let (cfg, tls) = (&target.config, &target.tls);
    let Some(db) = cfg.get_dbname().map(str::to_string) else { return Ok(()) };
    if !db.chars().all(crate::config::name_char) {
        return Err(StoreError::Config(format!("database name '{db}' must be letters, digits, '_' or '-'")));
    }
    // tokio-postgres tries each host in turn, each within `connect_timeout`.
    let per_host = cfg.get_connect_timeout().copied().unwrap_or(CONNECT_TIMEOUT);
    let limit = per_host.saturating_mul(cfg.get_hosts().len().max(1) as u32);
    let failed = |e: StoreError| StoreError::connect(url, e);
    match connect_within(cfg, tls, limit).await.map_err(failed)? {
        Ok(_) => return Ok(()),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::INVALID_CATALOG_NAME) => {}
        Err(e) => return Err(failed(StoreError::Query(e))),
    }
    let mut admin = cfg.clone();
    admin.dbname("postgres");
    let missing = |e: StoreError| {
        failed(StoreError::Config(format!(
            "database '{db}' does not exist, and creating it needs the 'postgres' database: {e}"
        )))
    };
    // Refused there (a role that may not connect to it): the database cannot be made. Not
    // reached (a restart, too many connections): as any connection failure, worth a retry.
    let client = match connect_within(&admin, tls, limit).await.map_err(failed)? {
        Ok(client) => client,
        Err(e) if super::refusal(&e) => return Err(missing(StoreError::Query(e))),
        Err(e) => return Err(failed(StoreError::Query(e))),
    };
    let exists = client.query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&db]).await?.is_some();
    if !exists {
        if let Err(e) = client.batch_execute(&format!("CREATE DATABASE \"{db}\"")).await {
            // Another process created it first (concurrent creators can also see a unique
            // violation on pg_database): fine.
            let raced = [
                tokio_postgres::error::SqlState::DUPLICATE_DATABASE,
                tokio_postgres::error::SqlState::UNIQUE_VIOLATION,
            ];
            if !e.code().is_some_and(|c| raced.contains(c)) {
                return Err(e.into());
            }
        }
    }
    drop(client);
    Ok(())
}
