//! approval: the deterministic policy gate and the approval stage.
pub mod decisions;
pub mod gate;
/// The policy gate lives in its own crate (diagnose checks evidence commands with it too).
pub use pitcrew_policy as policy;
