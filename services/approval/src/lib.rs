//! approval: the deterministic policy gate and the approval stage.
pub mod decisions;
pub mod gate;
pub mod policy;
