//! pitcrew's runtime, shared by every stage: configuration, the bus (NATS JetStream), the store
//! (Postgres), telemetry, and the runner that turns a stage's decision into durable effects.

pub mod approvals;
pub mod bus;
pub mod config;
pub mod consume;
pub mod httpd;
pub mod live;
pub mod metrics;
pub mod natsd;
pub mod runner;
pub mod sources;
pub mod stage;
pub mod start;
pub mod store;
pub mod target;
pub mod telemetry;
pub mod trace;

pub use bus::{Bus, BusError};
pub use config::Config;
pub use stage::{Cx, Deps, StageError, StageHandler, Stopping, Transition, WaitNote};
pub use store::{Store, StoreError};
