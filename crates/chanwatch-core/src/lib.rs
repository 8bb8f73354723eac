//! # chanwatch-core
//!
//! The pure heart of chanwatch: the domain types of the design contract (`../shared/DESIGN.md`
//! §2), their JSON encoding, and the key layout in the store.
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
//! This crate owns: `NodeId`, `ChannelName`, `Epoch`, `ChannelState`, `ChannelInfo`,
//! `NodeSession`, `CoordSession`, `Checkpoint`, and the [`keys::Keys`] layout.
//!
//! It must not: do I/O, spawn tasks, read the clock, or depend on tokio. Time enters as a
//! plain `u64` of Unix milliseconds passed in by the caller.

pub mod error;
pub mod keys;
pub mod node;
pub mod planner;
pub mod types;

pub use error::{DecodeError, KeyError, NameError};
pub use keys::{ChannelKey, ChannelOwner, Keys};
pub use types::{
    ChannelInfo, ChannelName, ChannelState, Checkpoint, CoordSession, Epoch, NodeId, NodeSession,
    Progress, VChannelInfo, CHANNEL_INFO_VERSION, MAX_VCHANNEL_BYTES,
};
