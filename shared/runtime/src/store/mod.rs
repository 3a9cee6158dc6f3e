//! The store: Postgres, the system of record. Pooled connections, cached prepared statements,
//! and every write keyed so that a redelivered stage writes nothing twice.

mod group;
mod migrate;
mod observe;
mod prune;
mod query;
mod recall;
mod runs;
mod targets;
mod tls;
mod votes;
mod work;

pub use migrate::{ensure_database, migrate as apply_migrations, MIGRATIONS};
pub use prune::Pruned;
pub use query::{AuditEntry, EvaluationRow, ExecutionRow, ReleasedClaim, RunFilter};
pub use runs::{IncidentSeen, OpenRun, RunStatus, RunSummary, StoredRun};
pub use targets::TargetLock;
pub use tls::{target as database_target, Target as DatabaseTarget, TlsMode};
pub use work::{Claim, DecideOutcome, Episode, Memory, PendingApproval, Record, FAILED_COMMANDS};

use crate::config::{redact_url, DatabaseConfig};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use std::time::Duration;

/// What went wrong with Postgres. Every variant but `Refused`, `Config` and `Migration` is
/// worth a retry.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot reach Postgres at {url}: {error} (is PostgreSQL running? set DATABASE_URL)")]
    Connect { url: String, error: String },
    /// Postgres answered and refused: a login (SQLSTATE class 28), a database that is not
    /// there and cannot be made (3D, or its creation refused), no right to connect (42501).
    /// Not worth waiting for.
    #[error(
        "Postgres at {url} refused the connection: {error} (check the user, password, database and TLS (sslmode, sslrootcert) in DATABASE_URL)"
    )]
    Refused { url: String, error: String },
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// What a write was for is gone (a run that left the step, a claim released as it was
    /// made): retrying the same write now finds the same; the step's next delivery decides
    /// afresh (so it counts as transient for it).
    #[error("{0}")]
    Moved(String),
    #[error("database error: {}", said(.0))]
    Query(#[from] tokio_postgres::Error),
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Migration(String),
}

/// Postgres answered a connection and refused it: a login (class 28), a database that does not
/// exist (3D), no CONNECT privilege on it (42501).
pub(crate) fn refusal(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|c| c.code().starts_with("28") || c.code().starts_with("3D") || c.code() == "42501")
}

/// What Postgres said (`tokio_postgres::Error` shows only "db error" for any server error).
fn said(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => e.to_string(),
    }
}

/// [`said`], with the causes of an error on the way to Postgres, which tokio-postgres's message
/// leaves out ("error performing TLS handshake", not which certificate or why; "error
/// connecting to server", not "Connection refused"). For connecting and reading the URL only:
/// a query's causes (a value that did not decode) may quote what is stored.
pub(crate) fn said_with_causes(e: &tokio_postgres::Error) -> String {
    let mut text = said(e);
    if e.as_db_error().is_some() {
        return text;
    }
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        // A wrapper often says again what it wraps (native-tls does): once is enough.
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(&format!(": {cause_text}"));
        }
        source = cause.source();
    }
    text
}

impl StoreError {
    /// Connecting to `url` failed with `e`: unreachable (worth a retry), or refused.
    pub(crate) fn connect(url: &str, e: StoreError) -> Self {
        let refused = match &e {
            StoreError::Config(_) | StoreError::Migration(_) | StoreError::Refused { .. } => true,
            StoreError::Query(q) => refusal(q) || tls::is_tls_failure(q),
            _ => false,
        };
        let error = match &e {
            StoreError::Query(q) => format!("database error: {}", said_with_causes(q)),
            other => other.to_string(),
        };
        let url = redact_url(url);
        if refused {
            StoreError::Refused { url, error }
        } else {
            StoreError::Connect { url, error }
        }
    }

    /// Postgres cancelled the statement at `statement_timeout` (SQLSTATE 57014).
    pub fn is_statement_timeout(&self) -> bool {
        matches!(self, StoreError::Query(e) if e.code() == Some(&tokio_postgres::error::SqlState::QUERY_CANCELED))
    }

    /// A failure that may come from one transition of a group alone (its row locked elsewhere
    /// past the statement or lock timeout, a corrupt row): the others are committed one by one.
    pub fn may_be_one_row(&self) -> bool {
        self.is_statement_timeout()
            || matches!(self, StoreError::Query(e) if e.code().is_some_and(|c| c.code() == "55P03" || c.code().starts_with("XX")))
    }

    /// A retry later may succeed (connection lost, pool exhausted, serialization failure, a
    /// server that turned read-only in a failover, an I/O or internal error of the server).
    /// What is left is about the statement or its data (a constraint, a value Postgres cannot
    /// store): the same try fails the same way.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Connect { .. } | StoreError::Unavailable(_) | StoreError::Moved(_) => true,
            StoreError::Query(e) => {
                e.is_closed()
                    || e.code().is_none()
                    || e.code().is_some_and(|c| {
                        let code = c.code();
                        // 08 connection, 40 rollback (serialization, deadlock), 53 resources,
                        // 57 operator intervention (shutdown, cancel), 58 system (I/O), XX
                        // internal; 25006: a write reached a standby or a demoted primary;
                        // 55P03: a lock not granted in time.
                        ["08", "40", "53", "57", "58", "XX"].iter().any(|class| code.starts_with(class))
                            || code == "25006"
                            || code == "55P03"
                    })
            }
            StoreError::Config(_) | StoreError::Migration(_) | StoreError::Refused { .. } => false,
        }
    }
}

/// How long a connection may wait on a silent Postgres before TCP gives up on it: idle 10 s,
/// then a probe every 5 s, 3 unanswered (or 30 s of unacknowledged data). Without them a
/// connection to a host that vanished (a failover, a cut link) waits hours for an answer, and
/// the step holding it holds its run as long.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_RETRIES: u32 = 3;
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

/// The pool's connection settings: the URL's as `target` read them (TLS as its `sslmode`
/// asks), with pitcrew's statement timeout and TCP keepalives unless the URL sets its own.
fn connection_config(cfg: &DatabaseConfig, mut target: tls::Target) -> tls::Target {
    let pg = &mut target.config;
    // `postgres://...?keepalives_idle=5` or `host=... keepalives_idle=5`.
    let names = |key: &str| cfg.url.split(['?', '&', ' ']).any(|kv| kv.split('=').next() == Some(key));
    if cfg.statement_timeout_secs > 0 && !pg.get_options().is_some_and(|o| o.contains("statement_timeout")) {
        let ms = cfg.statement_timeout_secs.saturating_mul(1000);
        let options = match pg.get_options() {
            Some(o) if !o.trim().is_empty() => format!("{o} -c statement_timeout={ms}"),
            _ => format!("-c statement_timeout={ms}"),
        };
        pg.options(options);
    }
    if !names("keepalives_idle") {
        pg.keepalives_idle(KEEPALIVE_IDLE);
    }
    if !names("keepalives_interval") {
        pg.keepalives_interval(KEEPALIVE_INTERVAL);
    }
    if !names("keepalives_retries") {
        pg.keepalives_retries(KEEPALIVE_RETRIES);
    }
    if !names("tcp_user_timeout") {
        pg.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
    target
}

/// A cheap-to-clone handle on the pool.
#[derive(Clone)]
pub struct Store {
    pool: Pool,
    committer: group::Committer,
    recalls: recall::Recalls,
}

impl Store {
    /// Create the database if missing, build the pool and prove a connection works.
    pub async fn connect(cfg: &DatabaseConfig) -> Result<Store, StoreError> {
        Store::connect_creating(cfg, true).await
    }

    /// [`Store::connect`] for a reader (the CLI's `show`, `incidents`, `approvals`, `prune`): a
    /// database that does not exist is an error saying so, not created empty (a typo in its
    /// name would leave a stray database, and then a confusing "relation does not exist").
    pub async fn connect_existing(cfg: &DatabaseConfig) -> Result<Store, StoreError> {
        Store::connect_creating(cfg, false).await
    }

    async fn connect_creating(cfg: &DatabaseConfig, create: bool) -> Result<Store, StoreError> {
        // The URL (and a root certificate it names) read once, for both connections.
        let target = tls::target(&cfg.url)?;
        if create {
            migrate::ensure_database_at(&cfg.url, &target).await?;
        }
        let target = connection_config(cfg, target);
        let mgr =
            Manager::from_config(target.config, target.tls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
        let pool = Pool::builder(mgr)
            .max_size(cfg.pool_size)
            .wait_timeout(Some(Duration::from_secs(10)))
            .create_timeout(Some(Duration::from_secs(5)))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|e| StoreError::Config(e.to_string()))?;
        // Half the pool at most writes transitions at once; the rest serves reads and the
        // other writes.
        let committer = group::Committer::start(pool.clone(), (cfg.pool_size / 2).max(1));
        let store = Store { pool, committer, recalls: recall::Recalls::default() };
        // A URL without a database name skips `ensure_database`: this is then the first
        // connection, and a refusal (a login, a certificate) must read as one.
        let _proof = store.pool.get().await.map_err(|e| {
            let e = match e {
                deadpool_postgres::PoolError::Backend(e) => StoreError::Query(e),
                other => StoreError::Unavailable(other.to_string()),
            };
            StoreError::connect(&cfg.url, e)
        })?;
        Ok(store)
    }

    /// Apply pending migrations; returns how many ran.
    pub async fn migrate(&self) -> Result<usize, StoreError> {
        let mut client = self.client().await?;
        apply_migrations(&mut client).await
    }

    pub(crate) async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(|e| StoreError::Unavailable(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(url: &str) -> DatabaseConfig {
        DatabaseConfig { url: url.into(), pool_size: 4, migrate_on_start: false, statement_timeout_secs: 30 }
    }

    #[test]
    fn the_pool_connects_over_tls_only_when_the_url_asks() {
        for (u, mode) in [
            ("postgres://u@db:5432/p", TlsMode::Off),
            ("postgres://u@db:5432/p?sslmode=prefer", TlsMode::Off),
            ("postgres://u@db/p?sslmode=require", TlsMode::Require),
            ("postgres://u@db/p?sslmode=verify-full&connect_timeout=3", TlsMode::VerifyFull),
        ] {
            let t = connection_config(&url(u), tls::target(u).unwrap());
            assert_eq!(t.mode, mode, "{u}");
            // pitcrew's own settings still apply.
            assert_eq!(t.config.get_keepalives_idle(), KEEPALIVE_IDLE, "{u}");
        }
    }

    /// The database password is redacted by its value wherever it shows (a command's output
    /// of a config file, an error of a client that quotes it), in either form of the URL.
    #[test]
    fn the_database_password_is_redacted_wherever_it_shows() {
        for (cfg, password) in [
            ("postgres://app:pw-in-the-url-7c1d@db/pitcrew", "pw-in-the-url-7c1d"),
            ("host=db user=app password=pw-as-a-keyword-5e2b dbname=pitcrew", "pw-as-a-keyword-5e2b"),
        ] {
            connection_config(&url(cfg), tls::target(cfg).unwrap());
            let text = format!("DB={password}");
            assert_eq!(pitcrew_model::redact::redact(&text), "DB=[REDACTED]", "{cfg}");
            assert!(!redact_url(cfg).contains(password), "{cfg}");
        }
    }
}
