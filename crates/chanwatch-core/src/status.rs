//! What a node's admin `GET /status` answers ([`StatusAnswer`]): a wire type shared by the
//! node that serves it and the readers (the coordinator's probe, `ctl`), so that neither
//! depends on the other.
//!
//! Owns: the answer's shape and its JSON. Must not: do I/O.

use serde::{Deserialize, Serialize};

/// What `GET /status` answers: the node's status as JSON. The node serves it; the
/// coordinator's status page and `ctl` read it back. A field the answer lacks reads as its
/// default, so a reader takes an answer with fewer fields.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StatusAnswer {
    /// The current session's node ID (`null` between sessions).
    pub id: Option<u64>,
    /// The node's name (`node --name`; empty: none).
    pub name: String,
    /// Sessions started so far: more than one means the node registered again.
    pub sessions: u64,
    /// Times the node fenced itself.
    pub fences: u64,
    /// Whether every channel is paused now: what the readers look for, since a paused node
    /// cannot tell the store.
    pub paused: bool,
    /// Why, while paused (`null` otherwise).
    pub paused_reason: Option<String>,
    /// Times the node paused its channels.
    pub pauses: u64,
}
