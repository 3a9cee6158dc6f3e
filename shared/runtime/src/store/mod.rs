//! The store: Postgres, the system of record. Pooled connections, cached prepared statements,
//! and every write keyed so that a redelivered stage writes nothing twice.

mod group;
mod migrate;
mod observe;
mod query;
mod recall;
mod runs;
mod votes;
mod work;

pub use migrate::{ensure_database, migrate as apply_migrations, MIGRATIONS};
pub use query::{AuditEntry, EvaluationRow, ExecutionRow, RunFilter};
pub use runs::{OpenRun, RunStatus, RunSummary, StoredRun};
pub use work::{Claim, DecideOutcome, Episode, Memory, PendingApproval, Record, FAILED_COMMANDS};

use crate::config::{redact_url, DatabaseConfig};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use std::time::Duration;
use tokio_postgres::NoTls;

/// What went wrong with Postgres. Every variant but `Config` and `Migration` is worth a retry.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot reach Postgres at {url}: {error} (is PostgreSQL running? set DATABASE_URL)")]
    Connect { url: String, error: String },
    #[error("database unavailable: {0}")]
    Unavailable(String),
    #[error("database error: {0}")]
    Query(#[from] tokio_postgres::Error),
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Migration(String),
}

impl StoreError {
    pub(crate) fn connect(url: &str, e: impl std::fmt::Display) -> Self {
        StoreError::Connect { url: redact_url(url), error: e.to_string() }
    }

    /// A retry later may succeed (connection lost, pool exhausted, serialization failure).
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Connect { .. } | StoreError::Unavailable(_) => true,
            StoreError::Query(e) => {
                e.is_closed()
                    || e.code().is_none()
                    || e.code().is_some_and(|c| {
                        c.code().starts_with("08")
                            || c.code().starts_with("40")
                            || c.code().starts_with("53")
                            || c.code().starts_with("57")
                    })
            }
            StoreError::Config(_) | StoreError::Migration(_) => false,
        }
    }
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
        ensure_database(&cfg.url).await?;
        let pg: tokio_postgres::Config = cfg
            .url
            .parse()
            .map_err(|e| StoreError::Config(format!("bad database URL {}: {e}", redact_url(&cfg.url))))?;
        let mgr = Manager::from_config(pg, NoTls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
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
        let _proof = store.client().await.map_err(|e| StoreError::connect(&cfg.url, e))?;
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
