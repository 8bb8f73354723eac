//! # chanwatch-coord
//!
//! The coordinator runtime. It campaigns for `{root}/coord/leader` with a lease; the winner
//! lists everything, drives the pure planner ([`chanwatch_core::coord::CoordState`]) from a
//! list-watch of the whole root and a periodic tick, and runs the planned txns — each one
//! guarded by the leader key's create revision, so a deposed leader cannot write. Standbys
//! watch the leader key and take over when it disappears; a leader watches it too and steps
//! down the moment it is deleted or replaced.
//!
//! Owns: election, the leader loop, txn execution (pipelined), the [`CoordHandle`] request
//! channel and the admin HTTP API ([`api`]).
//! Must not: run channels, or write any key outside `{root}/coord/leader` and `{root}/channel/`.

pub mod api;
mod availability;
mod coordinator;
pub mod election;
mod execute;
mod handle;
pub mod metrics;
mod term;

pub use coordinator::CoordinatorConfig;
pub use election::{run, CoordError};
pub use handle::{ApiError, CoordHandle, CoordStatus, Request};
pub use metrics::CoordMetrics;
