//! approval: the deterministic policy gate and the approval stage.
pub mod policy;
