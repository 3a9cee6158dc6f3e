//! Chat bridges: approval requests posted where people talk, their decisions taken from the
//! message's buttons and published on the bridge subject like any other channel's. A bridge
//! keeps no state of its own: the durable consumer remembers what was posted, Postgres what
//! was decided, and the chat message itself carries the run and plan it is about.

pub mod secret;
pub mod slack;

/// A shutdown signal every task can await (the crew's `signals()` is one).
pub type Shutdown = futures::future::Shared<futures::future::BoxFuture<'static, ()>>;
