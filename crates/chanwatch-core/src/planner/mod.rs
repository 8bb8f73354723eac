//! The coordinator's decisions, as a pure state machine: the planner.
//!
//! Owns: the coordinator's view of the store (sessions, assignment keys with their mod
//! revisions, undecodable keys), the moves it has in flight, and [`Planner::plan`], which
//! turns the view and the time into transactions to run. Level-triggered: every call
//! re-derives what to do from the whole view, so a missed event or a lost txn only delays
//! the fix until the next call (DESIGN.md §3 "Nothing waits on an event alone").
//!
//! A round costs O(channels that need attention), not O(channels): the view keeps, in step
//! with every event, the set of channels that are not simply `Watched` under one key of a
//! live node (a node's death puts its channels there with one walk, when its session goes),
//! and per node a count of keys. Loads are derived from those counts in O(nodes + moves in
//! flight), and placing a channel walks the loads once. Only two passes scan every channel, and only while
//! they have work: drains while a node is draining, and balance once loads are uneven.
//!
//! Must not: do I/O or read the clock. The runtime feeds store events in
//! ([`Planner::apply_put`], [`Planner::apply_delete`], [`Planner::reset`]), passes
//! `now_ms`, runs the returned [`PlannedTxn`]s (adding its leader guard), and reports each
//! success back with [`Planner::applied`].
//!
//! Where each part lives (all of them `impl Planner` blocks over the one struct below):
//!
//! - `config`: [`PlannerConfig`], the tunables, and [`PlannerBug`];
//! - `commands`: the vocabulary out — [`PlannedTxn`] = [`Guard`]s + [`Op`]s +
//!   [`Transition`]s with their [`Cause`] — and the builders of one channel's change
//!   (reassign, park, release);
//! - `view`: the view and its ingest (`apply_put`, `apply_delete`, `reset`, `applied`,
//!   `caught_up`), the attention index, [`Census`];
//! - `passes`: [`Planner::plan`], one round, and its passes — repair (duplicates, failover,
//!   unpark), timeouts and releases, moves (drains, balance);
//! - `placement`: where a channel may go — [`Loads`] (all load arithmetic), the
//!   least-loaded choice, back-offs, what balance may move, the balance move picker;
//! - `fencing`: fence marks of nodes stuck releasing, and the lease revokes the runtime does;
//! - `packing`: changes into txns within the op and byte limits;
//! - `planned`: planned events — nodes leaving (SIGTERM) and the cold-start gate;
//! - `admin`: operator commands (add, remove, move, drain, the balance plan), [`AdminError`];
//! - `bulk`: registering a list of channels at once, packed ([`Planner::add_channels`]);
//! - `rows`: [`ChannelRow`] and [`NodeRow`] for `ctl` and the admin API;
//! - `pacer`: when the leader plans and what it serves — [`Pacer`] (round spacing, the retry
//!   of a refused round, the hold over a burst of session losses, recovery, a blind leader's
//!   resignation, the cold-start gate's log); a struct of its own beside the planner, fed by
//!   the coordinator's loop;
//! - `tests` (test builds only): the `World` helper every module's tests use, and the tests
//!   of the planner as a whole.

mod admin;
mod bulk;
mod commands;
mod config;
mod fencing;
pub mod pacer;
mod packing;
mod passes;
mod placement;
mod planned;
mod rows;
#[cfg(test)]
mod tests;
mod view;

pub use admin::{AdminError, Placement};
pub use commands::{Cause, Guard, Op, PlannedTxn, Transition};
#[cfg(feature = "planted-bugs")]
pub use config::PlannerBug;
pub use config::PlannerConfig;
pub use pacer::{GateLog, Pacer};
pub use placement::{Load, Loads, MaxLoad, PlannedMove, Want};
pub use planned::StartupWait;
pub use rows::{ChannelRow, NodeRow};
pub use view::{Census, Entry};

use std::collections::{BTreeMap, BTreeSet};

use crate::keys::Keys;
use crate::types::{ChannelName, NodeId, NodeSession};

use fencing::Fence;
use view::Owners;

/// What a node holds: assignment keys and their total weight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Held {
    keys: usize,
    weight: u64,
}

/// A move in flight: the channel was asked to release and will go to `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PendingMove {
    to: NodeId,
    since_ms: u64,
    cause: Cause,
}

/// The coordinator's view and memory. See the module docs.
#[derive(Debug, Clone)]
pub struct Planner {
    keys: Keys,
    config: PlannerConfig,
    nodes: BTreeMap<NodeId, NodeSession>,
    /// The mod revision of each live node's session key as seen: the coordinator's puts under
    /// a node compare it, so a put planned before the node announced `leaving` (a session
    /// rewrite) is refused rather than landing on a node about to end its session.
    session_revs: BTreeMap<NodeId, i64>,
    /// ID blocks reserved per node name (`{root}/id/name/{name}`, NodeRestriction): a
    /// session in a reserved block's key prefix that is not that name's is refused.
    blocks: BTreeMap<crate::IdBlock, String>,
    /// Normally one entry per channel; more only if the store was edited by hand.
    channels: BTreeMap<ChannelName, Owners>,
    /// Entries and their total weight per node, kept in step with `channels`, so that
    /// `loads` (needed by every assignment) costs O(nodes + moves), not O(channels).
    owned: BTreeMap<NodeId, Held>,
    /// Channels per group per node (keys under nodes with a `group`), kept in step with
    /// `channels`: placement prefers the node with fewer of a channel's group.
    grouped: BTreeMap<NodeId, BTreeMap<String, usize>>,
    /// How many keys carry each weight, kept in step with `channels`: the heaviest is the
    /// balance goal's unit.
    weights: BTreeMap<u64, usize>,
    /// An operator asked for a balance (`ctl balance`): it runs even with
    /// `auto_balance` off, until the cluster is balanced or nothing more can move.
    balance_asked: bool,
    /// Channels that are not one `Watched` key under a live node (duplicates, parked,
    /// loading, failed, releasing, or held by a node whose session is gone), kept in step
    /// with `channels` and `nodes`: what the passes of a round visit. A node's death marks
    /// its channels once (one walk of `channels`), so the rounds of a failover visit only
    /// them, not every channel while its keys remain (at 1,000,000 channels that walk was
    /// the largest cost of a failover).
    attention: BTreeSet<ChannelName>,
    /// A full list is being applied: session changes do not re-mark channels one node at
    /// a time; the list rebuilds `attention` once at its end.
    listing: bool,
    /// Assignment keys known deleted at a revision the watch has not delivered yet (our own
    /// txns, keys read back after a refused txn): a lagging watch's older PUT of such a key
    /// must not bring it back. Pruned by [`Planner::caught_up`]. Found by the failover
    /// bench: resurrected keys made the coordinator re-plan failovers of channels it had
    /// already moved, and every such txn was refused.
    tombstones: BTreeMap<String, i64>,
    /// Keys under the managed prefixes whose value or key does not decode: reported, never
    /// overwritten or deleted.
    corrupt: BTreeMap<String, String>,
    /// Moves in flight: channels asked to release, each to go to its `to` once `Released`.
    /// Counted at their target by [`Planner::loads`].
    moves: BTreeMap<ChannelName, PendingMove>,
    /// Per channel, the nodes that failed or timed out the channel, each avoided until a
    /// time. Every failing node is remembered, not just the last, so a channel that fails
    /// everywhere is retried on each node at most once per back-off instead of bouncing
    /// between nodes as fast as txns commit (found by the simulation: epochs in the hundreds
    /// within seconds).
    avoid: BTreeMap<ChannelName, BTreeMap<NodeId, u64>>,
    draining: BTreeSet<NodeId>,
    /// Nodes being fenced (a `coord/fence/{id}` mark in the store): a channel sat in
    /// `ToRelease` past the release timeout (a stalled watch, a hung release), so the leader
    /// revokes the node's session lease. They get nothing new, and once their session is
    /// gone their channels are held until the node has surely fenced itself: a forced move
    /// never overlaps a live owner (DESIGN §3). The mark is in the store because a leader
    /// that takes over must hold them too (found by the simulation: a re-elected leader
    /// moved a just-revoked node's channels at once, 333 ms of double ownership).
    fences: BTreeMap<NodeId, Fence>,
    /// Fences for the runtime to carry out, taken by [`Planner::take_fence_requests`].
    fence_requests: Vec<NodeId>,
    /// Nodes that failed or timed out any channel, until a time: balance moves nothing to
    /// them meanwhile (a node that hangs every load would otherwise be fed by balance as
    /// fast as its channels time out; found from outside: 60 transitions in 30 s).
    troubled: BTreeMap<NodeId, u64>,
    /// The last round id given to puts ([`Planner::round_id`]).
    last_round_id: u64,
    /// When the last membership change, failure or timeout was seen: balance waits
    /// `balance_quiet_ms` after it.
    quiet_since_ms: u64,
    /// A membership change was applied since the last round (events carry no time; the
    /// next round dates it).
    disturbed: bool,
    /// When each recently moved channel moved: balance leaves it alone for
    /// `move_cooldown_ms`. Pruned once a second.
    moved_at: BTreeMap<ChannelName, u64>,
    next_prune_ms: u64,
    /// No watch timeout fires before this: the store was away (or this leader just took
    /// over), and a node could not have loaded or acknowledged meanwhile.
    timeouts_after_ms: u64,
    /// The cold-start gate (see `planned`).
    startup: planned::Startup,
    /// The last round that saw a node leaving on purpose (see `planned`): balance holds
    /// off for `move_cooldown_ms` after it.
    planned_at_ms: Option<u64>,
    /// The runtime knows its view is behind the store (its watch has not reached a revision
    /// the store named since): decisions that rest on "no other node can take it" wait.
    behind: bool,
}

impl Planner {
    /// An empty view.
    pub fn new(keys: Keys, config: PlannerConfig) -> Self {
        Planner {
            keys,
            config,
            nodes: BTreeMap::new(),
            session_revs: BTreeMap::new(),
            blocks: BTreeMap::new(),
            channels: BTreeMap::new(),
            owned: BTreeMap::new(),
            grouped: BTreeMap::new(),
            weights: BTreeMap::new(),
            balance_asked: false,
            attention: BTreeSet::new(),
            listing: false,
            tombstones: BTreeMap::new(),
            corrupt: BTreeMap::new(),
            moves: BTreeMap::new(),
            avoid: BTreeMap::new(),
            draining: BTreeSet::new(),
            fences: BTreeMap::new(),
            fence_requests: Vec::new(),
            troubled: BTreeMap::new(),
            last_round_id: 0,
            quiet_since_ms: 0,
            disturbed: false,
            moved_at: BTreeMap::new(),
            next_prune_ms: 0,
            timeouts_after_ms: 0,
            startup: planned::Startup::Unknown,
            planned_at_ms: None,
            behind: false,
        }
    }

    /// The planner's configuration.
    pub fn config(&self) -> &PlannerConfig {
        &self.config
    }
}
