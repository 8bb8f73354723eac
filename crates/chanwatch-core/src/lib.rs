//! # chanwatch-core
//!
//! The pure heart of chanwatch: the domain types of the design contract (DESIGN.md §2) and
//! their JSON encoding, the key layout in the store, and the two state machines that make
//! every decision — the coordinator's planner and the node's machine. Each takes events in
//! and gives commands out; the runtimes (`chanwatch-coord`, `chanwatch-node`) feed the events
//! from the store and carry the commands out.
//!
//! ```text
//!                 +--------------------+         +-----------------------+
//!   ctl / HTTP -->|   coordinator      |  txns   |   MetaStore           |
//!                 | (chanwatch-coord)  |-------->|  etcd | embedded      |
//!                 +--------------------+         +-----------------------+
//!                          ^  watch sessions/channels      |  watch channel/{id}/
//!                          |                               v
//!                 +--------------------+         +-----------------------+
//!                 |  chanwatch-core    |<--------|   node                |
//!                 |  types, keys,      |  uses   | (chanwatch-node)      |
//!                 |  state machines    |         |  runs channel handlers|
//!                 +--------------------+         +-----------------------+
//! ```
//!
//! This crate owns:
//!
//! - [`types`]: `NodeId`, `ChannelName`, `Epoch`, `ChannelState`, `ChannelInfo`,
//!   `NodeSession`, `CoordSession`, `Checkpoint` and their JSON;
//! - [`keys`]: the [`Keys`] layout, the only place a key is formatted or parsed;
//! - [`idblock`]: node ID blocks reserved per node name (etcd roles bound to one node);
//! - [`planner`]: the coordinator's [`planner::Planner`] — its view of the store (fed by store
//!   events) and `plan(now)`, the transactions that bring the assignments where they should
//!   be; admin commands and the rows `ctl` prints;
//! - [`node`]: the node's [`node::NodeMachine`] — events about its assignments in; start and
//!   stop runners and acknowledge by compare-and-swap out;
//! - [`error`]: what fails to decode or parse, and why.
//!
//! It must not: do I/O, spawn tasks, read the clock, or depend on tokio. Time enters as a
//! plain `u64` of Unix milliseconds passed in by the caller.

pub mod error;
pub mod idblock;
pub mod keys;
pub mod natural;
pub mod node;
pub mod planner;
pub mod status;
pub mod types;

pub use error::{DecodeError, KeyError, NameError};
pub use idblock::IdBlock;
pub use keys::{ChannelKey, ChannelOwner, KeyKind, Keys};
pub use natural::natural;
pub use status::StatusAnswer;
pub use types::{
    ChannelInfo, ChannelName, ChannelState, Checkpoint, CoordSession, Epoch, NodeId, NodeSession,
    Progress, RoundHint, VChannelInfo, CHANNEL_INFO_VERSION, COORDINATOR_FIELDS,
    MAX_CHANNEL_EXTRA_BYTES, MAX_VCHANNEL_BYTES,
};
