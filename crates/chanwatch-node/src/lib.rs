//! # chanwatch-node
//!
//! The node runtime: it registers a session under a fresh node ID with a lease, watches
//! `{root}/channel/{id}/`, and drives [`chanwatch_core::node::NodeMachine`]: channel runners
//! run a [`ChannelHandler`] per channel, acknowledgements are compare-and-swap txns, and a node
//! whose keepalives stop succeeding fences itself (stops every channel) before its lease can
//! expire, then registers again under a new ID.
//!
//! Owns: the session, the keepalive loop, the runners and the handler lifecycle.
//! Must not: decide assignments (that is the coordinator's job) or write any key but its own
//! session, the ID counter, and acknowledgements of its own channels.

mod acks;
pub mod admin;
mod config;
mod embed;
pub mod handler;
mod keepalive;
pub mod metrics;
mod register;
mod runner;
mod runtime;
mod session;
mod watchdog;

pub use config::{NodeConfig, NodeError, NodeStatus, PlantedBug};
pub use embed::{Node, NodeBuilder, NodeHandle};
pub use handler::{AuditLog, ChannelContext, ChannelHandler, NamePatterns, SimulatedLoad};
/// Test fixtures (feature `testing`): a handler that records who ran what, when.
#[cfg(any(test, feature = "testing"))]
pub use handler::{Behaviour, Interval, RecordingHandler};
pub use metrics::NodeMetrics;
pub use runtime::run;
