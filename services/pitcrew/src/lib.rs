//! The pitcrew application: the crew wiring, operator commands, the demo and its toy
//! service. `main.rs` only parses arguments and calls in here, so tests can too.

pub mod cli;
pub mod crew;
pub mod demo;
pub mod top;
pub mod toy;
