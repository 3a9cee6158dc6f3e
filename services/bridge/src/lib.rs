//! Chat bridges: approval requests posted where people talk, their decisions taken from the
//! message's buttons and published on the bridge subject like any other channel's. A bridge
//! keeps no state of its own: the durable consumer remembers what was posted, Postgres what
//! was decided, and the chat message itself carries the run and plan it is about.

pub mod decide;
pub mod inbound;
pub mod mattermost;
pub mod outbound;
pub mod post;
pub mod secret;
pub mod slack;

pub use pitcrew_runtime::start::Shutdown;

static POSTS: pitcrew_metrics::Counter = pitcrew_metrics::Counter::new(
    "pitcrew_bridge_posts_total",
    "Approval requests the bridge handled, by chat and outcome (posted, decided_elsewhere, superseded, expired, retry, dropped, unreadable).",
    &["chat", "outcome"],
);
static CLICKS: pitcrew_metrics::Counter = pitcrew_metrics::Counter::new(
    "pitcrew_bridge_clicks_total",
    "Approve and deny clicks, by chat and result (decided, counted: one vote of a quorum, refused).",
    &["chat", "result"],
);

/// An approval request ended its turn in the bridge with `outcome`.
pub(crate) fn posted(chat: &str, outcome: &str) {
    POSTS.inc(&[chat, outcome]);
}

/// Serve `/metrics` on `[metrics] listen` (when set): this process's counters, the backlog of
/// requests not yet posted (the bridge's durable consumer) and pending approvals.
pub async fn serve_metrics(
    cfg: &pitcrew_runtime::Config,
    bus: &pitcrew_runtime::Bus,
    store: &pitcrew_runtime::Store,
    durable: &str,
    shutdown: Shutdown,
) -> anyhow::Result<Option<std::net::SocketAddr>> {
    let collector = pitcrew_runtime::metrics::Collector {
        bus: bus.clone(),
        store: Some(store.clone()),
        consumers: vec![(bus.subjects.approvals_stream(), durable.to_string())],
    };
    pitcrew_runtime::metrics::spawn_endpoint(cfg.metrics.listen.as_deref(), Some(collector), shutdown).await
}

/// Why a message offers no Approve button: its plan does not fit whole (a chat would show it
/// cut, and the button approves all of it). Deny still works there.
pub(crate) fn too_long_to_approve_here(req: &pitcrew_model::ApprovalRequest) -> String {
    format!(
        "The plan is too long to show here in full, so it cannot be approved here: read it with `pitcrew show {run}` \
         and approve it with `pitcrew approve {run} --by YOUR-NAME --plan {hash} --attempt {attempt}` or the gateway. \
         Deny works here.",
        run = req.run_id,
        hash = req.plan_hash,
        attempt = req.attempt
    )
}

/// `s` cut to at most `max` characters (chat APIs count characters), an ellipsis marking a cut.
pub(crate) fn clip(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}
