//! Access control: API keys (stored as SHA-256, compared in constant time, never logged)
//! mapped to roles, what each route needs (read from the OpenAPI document, so the document
//! and the rules cannot disagree), a token bucket per key, and the audit of every mutating
//! request (Postgres and the log; one refused by the rate limit only in the log).

use crate::error::{ApiError, Outcome};
use crate::Gateway;
use axum::extract::{ConnectInfo, MatchedPath, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use pitcrew_model::redact::redact;
use pitcrew_model::trim::storable;
use pitcrew_runtime::config::{ApiKey, GatewayConfig};
use pitcrew_runtime::store::AuditEntry;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;
use uuid::Uuid;

/// What a route needs (`x-pitcrew-access` in the OpenAPI document).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// No key: health probes and the OpenAPI document.
    Public,
    /// Read runs, approvals and events.
    Read,
    /// Open incidents (also through Alertmanager), ask questions.
    Operate,
    /// Approve or deny plans.
    Decide,
    /// Only admins (also what a route missing from the document needs).
    Admin,
}

impl Access {
    pub fn parse(s: &str) -> Option<Access> {
        Some(match s {
            "public" => Access::Public,
            "read" => Access::Read,
            "operate" => Access::Operate,
            "decide" => Access::Decide,
            "admin" => Access::Admin,
            _ => return None,
        })
    }

    /// The roles that may, for error messages.
    fn roles(self) -> &'static str {
        match self {
            Access::Public | Access::Read => "readonly, operator, approver or admin",
            Access::Operate => "operator or admin",
            Access::Decide => "approver or admin",
            Access::Admin => "admin",
        }
    }
}

/// A key's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Readonly,
    Operator,
    Approver,
    Admin,
}

pub const ROLES: &[&str] = &["readonly", "operator", "approver", "admin"];

impl Role {
    pub fn parse(s: &str) -> Option<Role> {
        Some(match s {
            "readonly" => Role::Readonly,
            "operator" => Role::Operator,
            "approver" => Role::Approver,
            "admin" => Role::Admin,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Readonly => "readonly",
            Role::Operator => "operator",
            Role::Approver => "approver",
            Role::Admin => "admin",
        }
    }

    /// Every role reads; operators operate, approvers decide, admins do everything.
    pub fn may(self, access: Access) -> bool {
        match access {
            Access::Public | Access::Read => true,
            Access::Operate => matches!(self, Role::Operator | Role::Admin),
            Access::Decide => matches!(self, Role::Approver | Role::Admin),
            Access::Admin => self == Role::Admin,
        }
    }
}

/// Who made a request: the key's owner and role. Handlers find it in the request extensions.
#[derive(Debug, Clone)]
pub struct Caller {
    pub name: String,
    pub role: Role,
}

/// Marks a response refused by the rate limit, whatever its status (429, or 503 for
/// Alertmanager): such a refusal is only logged, never stored.
#[derive(Debug, Clone, Copy)]
pub struct RateRefused;

/// The run a mutating request acted on, for the audit trail (set by handlers on the response).
#[derive(Debug, Clone, Copy)]
pub struct AuditRun(pub Uuid);

struct Key {
    name: String,
    role: Role,
    hash: [u8; 32],
}

/// The configured keys, by hash only.
pub struct Keys(Vec<Key>);

impl std::fmt::Debug for Keys {
    /// Owners and roles only.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.0.iter().map(|k| (&k.name, k.role.as_str()))).finish()
    }
}

/// The hex SHA-256 of a key: what `[gateway.keys.<name>] sha256` holds.
pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

impl Keys {
    /// Parse `[gateway.keys]`; the error names the bad entry (never a key: only hashes are here).
    pub fn from_config(keys: &BTreeMap<String, ApiKey>) -> Result<Keys, String> {
        let mut out = Vec::with_capacity(keys.len());
        for (name, k) in keys {
            let role = Role::parse(&k.role).ok_or_else(|| {
                format!("[gateway.keys.{name}] role = \"{}\": the role must be one of {ROLES:?}", k.role)
            })?;
            let hash: [u8; 32] =
                hex::decode(k.sha256.trim()).ok().and_then(|b| b.try_into().ok()).ok_or_else(|| {
                    format!(
                        "[gateway.keys.{name}] sha256 must be 64 hex digits (the SHA-256 of the key: \
                         `pitcrew gateway hash-key` prints it)"
                    )
                })?;
            out.push(Key { name: name.clone(), role, hash });
        }
        Ok(Keys(out))
    }

    /// The owner of `presented`, comparing its hash with every configured hash in constant time.
    pub fn authenticate(&self, presented: &str) -> Option<Caller> {
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        let mut found = None;
        for k in &self.0 {
            let same: bool = k.hash.ct_eq(&digest).into();
            if same && found.is_none() {
                found = Some(Caller { name: k.name.clone(), role: k.role });
            }
        }
        found
    }
}

/// Most rate-limit buckets kept at once.
pub const MAX_BUCKETS: usize = 10_000;

/// A token bucket per key: `burst` requests at once, refilled at `rate` per second.
pub struct RateLimiter {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, (f64, Instant)>>,
}

impl RateLimiter {
    pub fn new(cfg: &GatewayConfig) -> RateLimiter {
        RateLimiter {
            rate: cfg.rate_per_sec.max(0.001),
            burst: f64::from(cfg.rate_burst.max(1)),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Take a token for `key`, or say how long until one is there. Keys are the configured
    /// owners, but the map is bounded whatever the keys: past [`MAX_BUCKETS`], buckets that
    /// have refilled (the same as no bucket) are dropped, then the least recently used.
    pub fn take(&self, key: &str) -> Result<(), Duration> {
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() >= MAX_BUCKETS && !buckets.contains_key(key) {
            let (rate, burst) = (self.rate, self.burst);
            buckets.retain(|_, (tokens, last)| *tokens + now.duration_since(*last).as_secs_f64() * rate < burst);
            if buckets.len() >= MAX_BUCKETS {
                if let Some(oldest) = buckets.iter().min_by_key(|(_, (_, last))| *last).map(|(k, _)| k.clone()) {
                    buckets.remove(&oldest);
                }
            }
        }
        let (tokens, last) = buckets.entry(key.to_string()).or_insert((self.burst, now));
        *tokens = (*tokens + now.duration_since(*last).as_secs_f64() * self.rate).min(self.burst);
        *last = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - *tokens) / self.rate))
        }
    }
}

/// The presented key: `Authorization: Bearer <key>` or `X-API-Key: <key>`.
fn presented_key(req: &Request) -> Option<&str> {
    let h = req.headers();
    if let Some(v) = h.get("authorization").and_then(|v| v.to_str().ok()) {
        let v = v.trim();
        if let Some(k) = v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")) {
            return Some(k.trim());
        }
    }
    h.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim)
}

/// Longest request path kept in the audit trail.
const MAX_AUDIT_PATH: usize = 512;

/// The rate-limit bucket of requests without a valid key (a name no owner has in practice).
const UNAUTHENTICATED: &str = "\0unauthenticated";

fn mutating(m: &Method) -> bool {
    !matches!(*m, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Authenticate, authorise and rate-limit the request, run it, then log it and (when it
/// changes anything) audit it. A request that changes anything runs to its end in a task of
/// its own, even when its client leaves: dropped with the connection half way, a decision or
/// an incident already published would go through without its audit row.
pub async fn guard(State(gw): State<Arc<Gateway>>, req: Request, next: Next) -> Response {
    if !mutating(req.method()) {
        return guarded(gw, req, next).await;
    }
    pitcrew_runtime::trace::to_the_end(guarded(gw, req, next)).await.unwrap_or_else(|| {
        tracing::error!("a request's task was cancelled");
        StatusCode::INTERNAL_SERVER_ERROR.into_response()
    })
}

async fn guarded(gw: Arc<Gateway>, mut req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let route = req.extensions().get::<MatchedPath>().map(|m| m.as_str().to_string());
    let remote = req.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0.ip().to_string());
    // HEAD is answered by the GET handler (axum runs it and drops the body): it needs what
    // GET needs, or a HEAD without a key would tell who may not read whether a run exists.
    let asked = if method == Method::HEAD { Method::GET } else { method.clone() };
    let access = match &route {
        Some(r) => match gw.access.get(&(asked, r.clone())) {
            Some(a) => *a,
            // A documented route, another method: the router answers 405 (the router and the
            // document list the same routes, a unit test checks).
            None if gw.access.keys().any(|(_, p)| p == r) => Access::Public,
            None => Access::Admin,
        },
        // No route matched: let the router answer 404.
        None => Access::Public,
    };
    // The caller is known once its key is, admitted or not: a refusal by role or by the rate
    // limit is logged and audited under the key's owner.
    let (caller, admitted) = authorise(&gw, &req, access);
    let resp = match admitted {
        Ok(()) => {
            if let Some(c) = &caller {
                req.extensions_mut().insert(c.clone());
            }
            next.run(req).await
        }
        Err(e) => e.into_response(),
    };
    let status = resp.status().as_u16();
    let principal = caller.as_ref().map(|c| c.name.as_str()).unwrap_or("anonymous");
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    tracing::info!(%method, path = %path, status, principal, ms, "request");
    if mutating(&method) {
        let outcome = resp.extensions().get::<Outcome>().map(|o| o.0.clone()).unwrap_or_else(|| {
            if resp.status().is_success() {
                "ok".into()
            } else {
                resp.status().canonical_reason().unwrap_or("error").to_ascii_lowercase()
            }
        });
        let entry = AuditEntry {
            principal: principal.to_string(),
            role: caller.as_ref().map(|c| c.role.as_str().to_string()),
            method: method.to_string(),
            // Postgres refuses NUL in text: a caller's `\u0000` quoted back (a field name, a
            // group key) must not cost the audit row. Nor is a secret the caller sent and the
            // answer quotes back (a service named by a URL with its password) kept.
            path: storable(pitcrew_model::trim::clip(&redact(&path), MAX_AUDIT_PATH)),
            status: i32::from(status),
            outcome: storable(pitcrew_model::trim::clip(&redact(&outcome), 1000)),
            remote,
            run_id: resp.extensions().get::<AuditRun>().map(|r| r.0),
        };
        tracing::info!(
            principal = %entry.principal,
            role = entry.role.as_deref().unwrap_or("-"),
            method = %entry.method,
            path = %entry.path,
            status,
            outcome = %entry.outcome,
            run = ?entry.run_id,
            "audit"
        );
        // A refusal by the rate limit is only logged: stored, it would let anyone write rows
        // to Postgres as fast as they can send requests.
        let rate_refused = status == 429 || resp.extensions().get::<RateRefused>().is_some();
        let stored = if rate_refused { Ok(()) } else { gw.store.record_audit(&entry).await };
        if let Err(e) = stored {
            tracing::error!(error = %e, path = %entry.path, "audit record not stored in Postgres (the log line above has it)");
        }
    }
    resp
}

/// Who is calling (when the key is known) and whether they may: a valid key refused by its
/// role or its rate limit is still named.
fn authorise(gw: &Gateway, req: &Request, access: Access) -> (Option<Caller>, Result<(), ApiError>) {
    if access == Access::Public {
        return (None, Ok(()));
    }
    match admit(gw, req, access) {
        Ok(caller) => (Some(caller), Ok(())),
        Err((caller, e)) => (caller, Err(e)),
    }
}

fn admit(gw: &Gateway, req: &Request, access: Access) -> Result<Caller, (Option<Caller>, ApiError)> {
    // Requests without a valid key share one bucket: guessing keys is as slow as one key.
    let refused = |e: ApiError| match gw.limiter.take(UNAUTHENTICATED) {
        Ok(()) => e,
        Err(wait) => ApiError::RateLimited {
            key: "(requests without a valid key)".into(),
            retry_after: wait.as_secs_f64().ceil().max(1.0) as u64,
        },
    };
    let Some(key) = presented_key(req).filter(|k| !k.is_empty()) else {
        return Err((
            None,
            refused(ApiError::Unauthorized(
                "missing API key: send `Authorization: Bearer <key>` (or `X-API-Key: <key>`)".into(),
            )),
        ));
    };
    let Some(caller) = gw.keys.authenticate(key) else {
        return Err((None, refused(ApiError::Unauthorized("unknown API key".into()))));
    };
    // The token is taken before the role is checked: a refusal costs its key a token too, or
    // a key looping on a route its role may not use would write an audit row to Postgres per
    // request, as fast as it can send them.
    if let Err(wait) = gw.limiter.take(&caller.name) {
        let retry_after = wait.as_secs_f64().ceil().max(1.0) as u64;
        let key = caller.name.clone();
        // Alertmanager retries a notification only on 5xx: a 429 would drop a whole group of
        // alerts until its next group interval (an alert storm is when many groups come at once).
        let e = match req.uri().path() {
            "/v1/alerts/alertmanager" => ApiError::Busy { key, retry_after },
            _ => ApiError::RateLimited { key, retry_after },
        };
        return Err((Some(caller), e));
    }
    if !caller.role.may(access) {
        let e = ApiError::Forbidden(format!(
            "key '{}' has role {}: {} {} needs role {}",
            caller.name,
            caller.role.as_str(),
            req.method(),
            req.uri().path(),
            access.roles()
        ));
        return Err((Some(caller), e));
    }
    Ok(caller)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_by_hash_only() {
        let mut cfg = BTreeMap::new();
        cfg.insert("ann".to_string(), ApiKey { role: "approver".into(), sha256: hash_key("s3cret") });
        let keys = Keys::from_config(&cfg).unwrap();
        let c = keys.authenticate("s3cret").unwrap();
        assert_eq!((c.name.as_str(), c.role), ("ann", Role::Approver));
        assert!(keys.authenticate("s3cret ").is_none());
        assert!(keys.authenticate("").is_none());
        cfg.insert("bad".to_string(), ApiKey { role: "root".into(), sha256: hash_key("x") });
        assert!(Keys::from_config(&cfg).unwrap_err().contains("role must be one of"));
        cfg.insert("bad".to_string(), ApiKey { role: "admin".into(), sha256: "abc".into() });
        assert!(Keys::from_config(&cfg).unwrap_err().contains("64 hex digits"));
    }

    #[test]
    fn roles_grant_what_the_issue_says() {
        assert!(Role::Readonly.may(Access::Read) && !Role::Readonly.may(Access::Operate));
        assert!(Role::Operator.may(Access::Operate) && !Role::Operator.may(Access::Decide));
        assert!(Role::Approver.may(Access::Decide) && !Role::Approver.may(Access::Operate));
        assert!(Role::Admin.may(Access::Decide) && Role::Admin.may(Access::Operate) && Role::Admin.may(Access::Admin));
    }

    #[test]
    fn the_bucket_refuses_past_the_burst_and_says_when_to_retry() {
        let cfg = GatewayConfig { rate_per_sec: 1.0, rate_burst: 2, ..GatewayConfig::default() };
        let rl = RateLimiter::new(&cfg);
        assert!(rl.take("a").is_ok() && rl.take("a").is_ok());
        let wait = rl.take("a").unwrap_err();
        assert!(wait > Duration::from_millis(500) && wait <= Duration::from_secs(1), "{wait:?}");
        assert!(rl.take("b").is_ok(), "buckets are per key");
    }

    #[test]
    fn the_buckets_stay_bounded_whatever_the_keys() {
        let cfg = GatewayConfig { rate_per_sec: 0.001, rate_burst: 1, ..GatewayConfig::default() };
        let rl = RateLimiter::new(&cfg);
        for i in 0..MAX_BUCKETS + 500 {
            assert!(rl.take(&format!("k{i}")).is_ok());
        }
        assert!(rl.buckets.lock().unwrap().len() <= MAX_BUCKETS);
        // The newest keys keep their (empty) buckets: still refused.
        assert!(rl.take(&format!("k{}", MAX_BUCKETS + 499)).is_err());
    }
}
