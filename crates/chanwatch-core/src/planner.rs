//! The coordinator's decisions, as a pure state machine.
//!
//! Owns: the coordinator's view of the store (sessions, assignment keys with their mod
//! revisions, undecodable keys), the moves it has in flight, and [`Planner::plan`], which
//! turns the view and the time into transactions to run. Level-triggered: every call
//! re-derives what to do from the whole view, so a missed event or a lost txn only delays
//! the fix until the next call (DESIGN.md §3 "Nothing waits on an event alone").
//!
//! A round costs O(channels that need attention), not O(channels): the view keeps, in step
//! with every event, the set of channels that are not simply `Watched` under one key, and
//! per node a count of keys, which tells in O(nodes) whether a dead node still owns any
//! (then, and only then, the orphan pass scans every channel). Everything else a round
//! needs is derived from those, so re-deriving stays cheap at 100,000 channels.
//!
//! Must not: do I/O or read the clock. The runtime feeds store events in
//! ([`Planner::apply_put`], [`Planner::apply_delete`], [`Planner::reset`]), passes
//! `now_ms`, runs the returned [`PlannedTxn`]s (adding its leader guard), and reports each
//! success back with [`Planner::applied`].

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::keys::{ChannelOwner, Keys};
use crate::types::{
    ChannelInfo, ChannelName, ChannelState, Epoch, NodeId, NodeSession, VChannelInfo,
};

/// Tunables of the planner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannerConfig {
    /// A `ToWatch` with no progress for this long is reassigned.
    pub watch_timeout_ms: u64,
    /// A `ToRelease` not `Released` within this long is force-moved, once its owner is
    /// fenced: the planner asks the runtime to revoke the owner's session lease
    /// ([`Planner::take_fence_requests`]) instead of moving the channel beside it.
    pub release_timeout_ms: u64,
    /// How long the channels of a node whose lease this coordinator revoked are held before
    /// they fail over: the node's session TTL, by which a node that could not hear of the
    /// revoke has fenced itself (it fences when no keepalive succeeded for `ttl - margin`).
    pub fence_wait_ms: u64,
    /// Balance starts no move for this long after a membership change (a node joined or
    /// left), a failed load or a timeout: the cluster settles before load is evened out.
    pub balance_quiet_ms: u64,
    /// A channel that moved (for any reason) is not picked by balance again for this long.
    pub move_cooldown_ms: u64,
    /// How long a node that failed or timed out a channel is avoided for that channel.
    pub failed_node_backoff_ms: u64,
    /// Most operations (and compares) in one txn, including the runtime's leader guard.
    pub max_txn_ops: usize,
    /// Most bytes of values in one txn, kept under etcd's request limit.
    pub max_txn_bytes: usize,
    /// Most balance/drain moves in flight at once.
    pub max_concurrent_moves: usize,
    /// A safety rule switched off, for tests only: proves the simulation catches it.
    pub planted_bug: Option<PlannerBug>,
}

/// Safety rules of the planner a test can switch off ([`PlannerConfig::planted_bug`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlannerBug {
    /// A release past the release timeout is moved at once, beside a live owner, as before
    /// DESIGN v2 (no fencing by lease revoke).
    ForceWithoutFence,
    /// Balance ignores failing-node back-offs, troubled nodes and cool-downs.
    BalanceIgnoresBackoff,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            watch_timeout_ms: 30_000,
            release_timeout_ms: 30_000,
            fence_wait_ms: 10_000,
            balance_quiet_ms: 5_000,
            move_cooldown_ms: 60_000,
            failed_node_backoff_ms: 30_000,
            max_txn_ops: 128,
            max_txn_bytes: 1024 * 1024,
            max_concurrent_moves: 16,
            planted_bug: None,
        }
    }
}

/// Why a channel's assignment changed; used in logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// A new channel was registered.
    Assign,
    /// Its node's session is gone.
    Failover,
    /// No node is alive; parked under `remaining`.
    Park,
    /// A node appeared; taken out of `remaining`.
    Unpark,
    /// Not acknowledged in time, or stuck releasing past the release timeout.
    Timeout,
    /// The load failed or the running channel broke (`WatchFailed`).
    Failed,
    /// Moved to even out load.
    Balance,
    /// Moved off a draining node.
    Drain,
    /// Moved by an operator.
    Manual,
    /// Removed by an operator.
    Remove,
    /// A second key for the same channel was removed.
    Dedupe,
}

impl Cause {
    /// Label used in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Assign => "assign",
            Cause::Failover => "failover",
            Cause::Park => "park",
            Cause::Unpark => "unpark",
            Cause::Timeout => "timeout",
            Cause::Failed => "failed",
            Cause::Balance => "balance",
            Cause::Drain => "drain",
            Cause::Manual => "manual",
            Cause::Remove => "remove",
            Cause::Dedupe => "dedupe",
        }
    }
}

/// One assignment key as the coordinator last saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Node or `remaining`.
    pub owner: ChannelOwner,
    /// The decoded value.
    pub info: ChannelInfo,
    /// Mod revision of the key, for compare-and-swap.
    pub mod_revision: i64,
}

/// The keys of one channel, by owner: one almost always, two only until a duplicate is
/// cleaned up. A sorted `Vec` rather than a `BTreeMap`: a map allocates a whole node (room
/// for 11 entries) per channel, which made the view cost ~4.9 KB per channel instead of ~1.5.
#[derive(Debug, Clone, Default)]
struct Owners(Vec<Entry>);

impl Owners {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    fn values(&self) -> std::slice::Iter<'_, Entry> {
        self.0.iter()
    }
    fn get(&self, owner: &ChannelOwner) -> Option<&Entry> {
        self.0.iter().find(|e| &e.owner == owner)
    }
    fn remove(&mut self, owner: &ChannelOwner) -> Option<Entry> {
        let i = self.0.iter().position(|e| &e.owner == owner)?;
        Some(self.0.remove(i))
    }
    /// One `Watched` key under a node: nothing for a round to do unless the node is dead
    /// or the cluster is unbalanced.
    fn settled(&self) -> bool {
        match self.0.as_slice() {
            [e] => {
                matches!(e.owner, ChannelOwner::Node(_)) && e.info.state == ChannelState::Watched
            }
            _ => false,
        }
    }
    /// Inserts or replaces the entry of `owner`, keeping owners in order.
    fn insert(&mut self, owner: ChannelOwner, entry: Entry) -> Option<Entry> {
        match self.0.binary_search_by(|e| e.owner.cmp(&owner)) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i], entry)),
            Err(i) => {
                // `Vec` grows to room for 4 entries of this size on its first push (1.7 KB
                // per channel for one entry): reserve exactly what is needed.
                self.0.reserve_exact(1);
                self.0.insert(i, entry);
                None
            }
        }
    }
}

/// A condition of a planned txn: the key still has `mod_revision` (0: the key is absent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guard {
    /// Owner part of the key.
    pub owner: ChannelOwner,
    /// Channel part of the key.
    pub channel: ChannelName,
    /// Expected mod revision; 0 means "must not exist".
    pub mod_revision: i64,
}

/// One write of a planned txn.
// Ops are built and consumed within one planning round; boxing the value would add an
// allocation per op for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Put `info` at `channel/{owner}/{info.channel}`.
    Put {
        /// Owner part of the key.
        owner: ChannelOwner,
        /// The value.
        info: ChannelInfo,
    },
    /// Delete `channel/{owner}/{channel}`.
    Delete {
        /// Owner part of the key.
        owner: ChannelOwner,
        /// Channel part of the key.
        channel: ChannelName,
    },
    /// Put the drain mark `coord/drain/{node}`.
    Drain {
        /// The node to drain.
        node: NodeId,
    },
    /// Delete the drain mark of a node that is gone.
    Undrain {
        /// The node.
        node: NodeId,
    },
    /// Put the fence mark `coord/fence/{node}`; once it has landed, the runtime revokes the
    /// node's session lease (see [`Planner::take_fence_requests`]).
    Fence {
        /// The node to fence.
        node: NodeId,
    },
    /// Delete the fence mark of a node that is gone and whose channels have moved.
    Unfence {
        /// The node.
        node: NodeId,
    },
}

/// What a planned txn does to one channel, for logs and metrics.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Transition {
    /// The channel.
    pub channel: ChannelName,
    /// Why.
    pub cause: Cause,
    /// Owner before (`None`: new channel).
    #[serde(serialize_with = "ser_owner_opt")]
    pub from: Option<ChannelOwner>,
    /// Owner after (`None`: removed).
    #[serde(serialize_with = "ser_owner_opt")]
    pub to: Option<ChannelOwner>,
    /// State written (`None`: removed).
    pub state: Option<ChannelState>,
    /// Epoch written.
    pub epoch: Epoch,
}

fn ser_owner_opt<S: serde::Serializer>(o: &Option<ChannelOwner>, s: S) -> Result<S::Ok, S::Error> {
    match o {
        None => s.serialize_none(),
        Some(ChannelOwner::Remaining) => s.serialize_str("remaining"),
        Some(ChannelOwner::Node(id)) => s.serialize_u64(id.0),
    }
}

/// A txn for the runtime to run: all `guards` hold → all `ops` apply, atomically.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedTxn {
    /// Compare-and-swap conditions (the runtime adds its leader guard).
    pub guards: Vec<Guard>,
    /// Writes; never more than `max_txn_ops - 1`.
    pub ops: Vec<Op>,
    /// One line per channel touched.
    pub transitions: Vec<Transition>,
}

/// One channel's change, never split across txns.
#[derive(Debug, Clone, PartialEq)]
struct Change {
    guards: Vec<Guard>,
    ops: Vec<Op>,
    /// `None` for bookkeeping that moves no channel (drain marks).
    transition: Option<Transition>,
}

/// A move in flight: the channel was asked to release and will go to `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PendingMove {
    to: NodeId,
    since_ms: u64,
    cause: Cause,
}

/// Refusals of admin requests. None is retryable as is; each says what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    /// The channel is already registered.
    #[error("channel {0} already exists")]
    AlreadyExists(ChannelName),
    /// The channel is not registered.
    #[error("channel {0} does not exist")]
    UnknownChannel(ChannelName),
    /// The node has no live session.
    #[error("node {0} is not alive")]
    UnknownNode(NodeId),
    /// The node is draining and takes no channels.
    #[error("node {0} is draining and takes no channels")]
    Draining(NodeId),
    /// The channel is already moving.
    #[error("channel {0} is already being moved; wait for the move to finish")]
    Busy(ChannelName),
    /// The channel is already on that node.
    #[error("channel {0} is already on node {1}")]
    AlreadyThere(ChannelName, NodeId),
}

/// One row of a balance plan: move `channel` from `from` to `to`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlannedMove {
    /// The channel.
    pub channel: ChannelName,
    /// Its node now.
    pub from: NodeId,
    /// Where it goes.
    pub to: NodeId,
}

/// One channel as `ctl channels --json` prints it (DESIGN.md §7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ChannelRow {
    /// The channel.
    pub channel: ChannelName,
    /// Owning node, `null` when parked under `remaining`.
    pub node: Option<u64>,
    /// State.
    pub state: ChannelState,
    /// Epoch.
    pub epoch: u64,
    /// When this assignment began (Unix ms).
    pub start_time_ms: u64,
    /// Why it is in this state, if recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Load progress in percent, while loading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<u8>,
}

/// One node as `ctl nodes --json` prints it (DESIGN.md §7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct NodeRow {
    /// Node ID.
    pub id: u64,
    /// Its admin address.
    pub admin_addr: String,
    /// Channels assigned to it.
    pub channels: usize,
    /// When its session began (Unix ms).
    pub started_at_ms: u64,
    /// Whether it is being drained.
    #[serde(default)]
    pub draining: bool,
}

/// The coordinator's view and memory. See the module docs.
#[derive(Debug, Clone)]
pub struct Planner {
    keys: Keys,
    config: PlannerConfig,
    nodes: BTreeMap<NodeId, NodeSession>,
    /// Normally one entry per channel; more only if the store was edited by hand.
    channels: BTreeMap<ChannelName, Owners>,
    /// Entries per node, kept in step with `channels`, so that `loads` (needed by every
    /// assignment) costs O(nodes + moves), not O(channels).
    owned: BTreeMap<NodeId, usize>,
    /// Channels that are not one `Watched` key under a node (duplicates, parked, loading,
    /// failed, releasing), kept in step with `channels`: what the passes of a round visit.
    attention: BTreeSet<ChannelName>,
    /// Assignment keys known deleted at a revision the watch has not delivered yet (our own
    /// txns, keys read back after a refused txn): a lagging watch's older PUT of such a key
    /// must not bring it back. Pruned by [`Planner::caught_up`]. Found by the failover
    /// bench: resurrected keys made the coordinator re-plan failovers of channels it had
    /// already moved, and every such txn was refused.
    tombstones: BTreeMap<String, i64>,
    /// Keys under the managed prefixes whose value or key does not decode: reported, never
    /// overwritten or deleted.
    corrupt: BTreeMap<String, String>,
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
}

/// What this leader knows of a fence mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Fence {
    /// When this leader last asked the runtime to revoke the lease (`None`: not yet).
    requested_ms: Option<u64>,
    /// When this leader first planned with the node's session gone (`None`: alive, or not
    /// planned since). A revoke happens before the session vanishes, so holding the
    /// channels `fence_wait_ms` from here is never too short, whoever revoked.
    gone_ms: Option<u64>,
}

impl Fence {
    /// Until when a fenced node's channels stay where they are.
    fn hold_until(&self, wait_ms: u64) -> u64 {
        self.gone_ms.map_or(u64::MAX, |g| g.saturating_add(wait_ms))
    }
}

/// Counts of assignment keys, from [`Planner::census`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Census {
    /// Keys per state, in the order of [`ChannelState::ALL`].
    pub by_state: [usize; 5],
    /// Keys under `remaining`.
    pub remaining: usize,
}

/// What a key under the root turned out to be.
// Lives for one function call.
#[allow(clippy::large_enum_variant)]
enum Decoded {
    Session(NodeId, NodeSession),
    Drain(NodeId),
    Fence(NodeId),
    Channel(ChannelOwner, ChannelInfo),
    Ignored,
}

impl Planner {
    /// An empty view.
    pub fn new(keys: Keys, config: PlannerConfig) -> Self {
        Planner {
            keys,
            config,
            nodes: BTreeMap::new(),
            channels: BTreeMap::new(),
            owned: BTreeMap::new(),
            attention: BTreeSet::new(),
            tombstones: BTreeMap::new(),
            corrupt: BTreeMap::new(),
            moves: BTreeMap::new(),
            avoid: BTreeMap::new(),
            draining: BTreeSet::new(),
            fences: BTreeMap::new(),
            fence_requests: Vec::new(),
            troubled: BTreeMap::new(),
            quiet_since_ms: 0,
            disturbed: false,
            moved_at: BTreeMap::new(),
            next_prune_ms: 0,
            timeouts_after_ms: 0,
        }
    }

    /// The planner's configuration.
    pub fn config(&self) -> &PlannerConfig {
        &self.config
    }

    fn decode(&mut self, key: &str, value: &[u8]) -> Decoded {
        if key.starts_with(&self.keys.drains_prefix()) {
            // A drain mark whose node part is not an ID is reported like any other key that
            // does not decode, never silently dropped.
            return match self.keys.parse_drain(key) {
                Ok(id) => {
                    self.corrupt.remove(key);
                    Decoded::Drain(id)
                }
                Err(e) => {
                    self.corrupt.insert(key.to_owned(), e.to_string());
                    Decoded::Ignored
                }
            };
        }
        if let Ok(id) = self.keys.parse_fence(key) {
            return Decoded::Fence(id);
        }
        if key.starts_with(&self.keys.sessions_prefix()) {
            let parsed = self
                .keys
                .parse_session(key)
                .map_err(|e| e.to_string())
                .and_then(|id| {
                    NodeSession::decode(value)
                        .map(|s| (id, s))
                        .map_err(|e| e.to_string())
                });
            return match parsed {
                Ok((id, s)) => {
                    self.corrupt.remove(key);
                    Decoded::Session(id, s)
                }
                Err(e) => {
                    self.corrupt.insert(key.to_owned(), e);
                    Decoded::Ignored
                }
            };
        }
        if key.starts_with(&self.keys.channels_prefix()) {
            let parsed = self
                .keys
                .parse_channel(key)
                .map_err(|e| e.to_string())
                .and_then(|ck| {
                    let info = ChannelInfo::decode(value).map_err(|e| e.to_string())?;
                    if info.channel != ck.channel {
                        return Err(format!(
                            "value names channel {} but the key names {}",
                            info.channel, ck.channel
                        ));
                    }
                    Ok((ck.owner, info))
                });
            return match parsed {
                Ok((owner, info)) => {
                    self.corrupt.remove(key);
                    Decoded::Channel(owner, info)
                }
                Err(e) => {
                    self.corrupt.insert(key.to_owned(), e);
                    Decoded::Ignored
                }
            };
        }
        Decoded::Ignored
    }

    /// Applies a PUT seen in the store. Returns the decode error if the value is corrupt
    /// (the key is then reported by [`Planner::corrupt`] and left alone).
    pub fn apply_put(&mut self, key: &str, value: &[u8], mod_revision: i64) -> Option<String> {
        match self.decode(key, value) {
            Decoded::Session(id, s) => {
                self.disturbed |= self.nodes.insert(id, s).is_none();
                None
            }
            Decoded::Drain(id) => {
                self.draining.insert(id);
                None
            }
            Decoded::Fence(id) => {
                self.fences.entry(id).or_default();
                None
            }
            Decoded::Channel(owner, info) => {
                if self.tombstones.get(key).is_some_and(|d| mod_revision < *d) {
                    return None; // an echo older than a delete we already know of
                }
                let channel = info.channel.clone();
                let known = self
                    .channels
                    .get(&channel)
                    .and_then(|m| m.get(&owner))
                    .map_or(0, |e| e.mod_revision);
                if mod_revision < known {
                    // An echo older than what we applied after our own txn: ignore it.
                    return None;
                }
                self.insert_entry(
                    channel,
                    Entry {
                        owner,
                        info,
                        mod_revision,
                    },
                );
                None
            }
            Decoded::Ignored => self.corrupt.get(key).cloned(),
        }
    }

    #[cfg(test)]
    fn kill_for_test(&mut self, node: NodeId) {
        let key = self.keys.session(node);
        self.apply_delete(&key, i64::MAX);
    }

    /// Inserts or replaces an entry, keeping the per-node counts in step.
    fn insert_entry(&mut self, channel: ChannelName, entry: Entry) {
        let owner = entry.owner;
        let owners = self.channels.entry(channel.clone()).or_default();
        let fresh = owners.insert(owner, entry).is_none();
        let settled = owners.settled();
        if let (true, ChannelOwner::Node(n)) = (fresh, owner) {
            *self.owned.entry(n).or_default() += 1;
        }
        mark(&mut self.attention, &channel, settled);
    }

    /// Applies a DELETE seen in the store: `key` is absent as of `revision` (the delete's
    /// revision, or a later one at which it was read absent).
    pub fn apply_delete(&mut self, key: &str, revision: i64) {
        self.corrupt.remove(key);
        if let Ok(id) = self.keys.parse_session(key) {
            self.disturbed |= self.nodes.remove(&id).is_some();
        } else if let Ok(id) = self.keys.parse_drain(key) {
            self.draining.remove(&id);
        } else if let Ok(id) = self.keys.parse_fence(key) {
            self.fences.remove(&id);
        } else if let Ok(ck) = self.keys.parse_channel(key) {
            let newer = self
                .channels
                .get(&ck.channel)
                .and_then(|m| m.get(&ck.owner))
                .is_some_and(|e| e.mod_revision > revision);
            if newer {
                return; // a delete older than the value we hold: the key was re-created
            }
            let known = self.tombstones.entry(key.to_owned()).or_insert(revision);
            *known = (*known).max(revision);
            if let Some(entries) = self.channels.get_mut(&ck.channel) {
                if entries.remove(&ck.owner).is_some() {
                    if let ChannelOwner::Node(n) = ck.owner {
                        if let Some(c) = self.owned.get_mut(&n) {
                            *c = c.saturating_sub(1);
                        }
                    }
                }
                mark(&mut self.attention, &ck.channel, entries.settled());
                if entries.is_empty() {
                    self.attention.remove(&ck.channel);
                    self.channels.remove(&ck.channel);
                    self.moves.remove(&ck.channel);
                    // `avoid` stays: a reassignment deletes the old key before it puts the
                    // new one, and the back-offs must outlive that. The next full list
                    // forgets the back-offs of channels that are gone.
                }
            }
        }
    }

    /// Replaces the whole view with a fresh list (after start, compaction or a broken watch).
    /// Memory of moves in flight is kept for channels that still exist.
    pub fn reset<'a>(&mut self, kvs: impl IntoIterator<Item = (&'a str, &'a [u8], i64)>) {
        let before: BTreeSet<NodeId> = self.nodes.keys().copied().collect();
        let disturbed = self.disturbed;
        let fences = std::mem::take(&mut self.fences);
        self.nodes.clear();
        self.channels.clear();
        self.owned.clear();
        self.attention.clear();
        self.corrupt.clear();
        self.draining.clear();
        for (key, value, rev) in kvs {
            self.apply_put(key, value, rev);
        }
        let channels = &self.channels;
        self.moves.retain(|c, _| channels.contains_key(c));
        // `avoid` stays: a list can be older than our own last txn (a relist after a broken
        // watch, read before the txn committed, handed over after it), so a channel that just
        // moved may be missing from it, and forgetting its back-offs let it bounce straight
        // back (found by the simulation's ping-pong check). `prune` forgets old back-offs.
        self.disturbed = disturbed || !self.nodes.keys().copied().eq(before);
        for (node, f) in &mut self.fences {
            if let Some(known) = fences.get(node) {
                *f = *known;
            }
        }
    }

    /// The store could not be reached for `away_ms` up to `now_ms` (or this leader has just
    /// taken over, knowing nothing of the time before): the time measured etcd's absence,
    /// not the nodes'. Releases in flight restart their clock by as much, and no watch
    /// timeout fires for `away_ms` more, so an etcd outage does not end in forced moves
    /// and reassignments when it is over (invariant 9; found by the simulation: a drain's
    /// release, unanswerable during a 3.5 s outage, timed out the moment etcd came back).
    pub fn store_was_away(&mut self, now_ms: u64, away_ms: u64) {
        for m in self.moves.values_mut() {
            m.since_ms = m.since_ms.saturating_add(away_ms).min(now_ms);
        }
        self.timeouts_after_ms = self.timeouts_after_ms.max(now_ms.saturating_add(away_ms));
    }

    /// Nodes whose session lease the runtime must revoke now: their fence mark has landed
    /// (see [`PlannerConfig::release_timeout_ms`]). A node still alive a second after a request
    /// is asked for again (a revoke that failed).
    pub fn take_fence_requests(&mut self) -> Vec<NodeId> {
        std::mem::take(&mut self.fence_requests)
    }

    /// Nodes with a fence mark (for status and tests).
    pub fn fencing(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.fences.keys().copied()
    }

    /// The watch (or a full list) has delivered everything up to `revision`: no older event
    /// can arrive any more, so deletes at or below it need no tombstone.
    pub fn caught_up(&mut self, revision: i64) {
        self.tombstones.retain(|_, d| *d > revision);
    }

    /// Records that a planned txn committed at `revision`, so the next plan does not repeat
    /// it before the watch echoes it.
    pub fn applied(&mut self, txn: &PlannedTxn, revision: i64) {
        for op in &txn.ops {
            match op {
                Op::Delete { owner, channel } => {
                    let key = self.keys.channel(*owner, channel);
                    self.apply_delete(&key, revision);
                }
                Op::Drain { node } => {
                    self.draining.insert(*node);
                }
                Op::Undrain { node } => {
                    self.draining.remove(node);
                }
                Op::Fence { node } => {
                    // The mark landed: now the lease may be revoked.
                    self.fences.entry(*node).or_default();
                    self.fence_requests.push(*node);
                }
                Op::Unfence { node } => {
                    self.fences.remove(node);
                }
                Op::Put { owner, info } => {
                    self.insert_entry(
                        info.channel.clone(),
                        Entry {
                            owner: *owner,
                            info: info.clone(),
                            mod_revision: revision,
                        },
                    );
                }
            }
        }
    }

    /// Live nodes and their sessions.
    pub fn nodes(&self) -> &BTreeMap<NodeId, NodeSession> {
        &self.nodes
    }

    /// Every assignment entry, by channel.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.channels.values().flat_map(|m| m.values())
    }

    /// The entry of one channel (the highest epoch if there are several).
    pub fn entry(&self, channel: &ChannelName) -> Option<&Entry> {
        self.channels
            .get(channel)
            .and_then(|m| m.values().max_by_key(|e| e.info.epoch))
    }

    /// Number of registered channels.
    pub fn channel_count(&self) -> usize {
        self.channels.len()
    }

    /// Keys whose value does not decode, with the reason.
    pub fn corrupt(&self) -> &BTreeMap<String, String> {
        &self.corrupt
    }

    /// Nodes being drained.
    pub fn draining(&self) -> &BTreeSet<NodeId> {
        &self.draining
    }

    /// Assignment keys by state and how many are parked, in O(channels needing attention):
    /// the metrics read it after every round.
    pub fn census(&self) -> Census {
        let mut c = Census {
            by_state: [0; 5],
            remaining: 0,
        };
        let watched = ChannelState::ALL
            .iter()
            .position(|s| *s == ChannelState::Watched)
            .unwrap_or(1);
        c.by_state[watched] = self.channels.len() - self.attention.len();
        for e in self.unsettled().flat_map(|(_, o)| o.values()) {
            if let Some(i) = ChannelState::ALL.iter().position(|s| *s == e.info.state) {
                c.by_state[i] += 1;
            }
            if e.owner == ChannelOwner::Remaining {
                c.remaining += 1;
            }
        }
        c
    }

    /// Moves in flight (`ToRelease` sent, waiting for `Released`).
    pub fn moves_in_flight(&self) -> usize {
        self.moves.len()
    }

    /// Channels per live node, counting moves in flight at their target.
    pub fn loads(&self) -> BTreeMap<NodeId, usize> {
        let mut loads: BTreeMap<NodeId, usize> = self
            .nodes
            .keys()
            .map(|&n| (n, self.owned.get(&n).copied().unwrap_or(0)))
            .collect();
        for (channel, m) in &self.moves {
            if let Some(ChannelOwner::Node(from)) = self.entry(channel).map(|e| e.owner) {
                if let Some(l) = loads.get_mut(&from) {
                    *l = l.saturating_sub(1);
                }
            }
            if let Some(l) = loads.get_mut(&m.to) {
                *l += 1;
            }
        }
        loads
    }

    fn assignable(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes
            .keys()
            .copied()
            .filter(|n| !self.draining.contains(n) && !self.fences.contains_key(n))
    }

    /// Least-loaded assignable node, ties by ID, skipping `avoid`.
    fn least_loaded(
        &self,
        loads: &BTreeMap<NodeId, usize>,
        avoid: Option<NodeId>,
    ) -> Option<NodeId> {
        self.assignable()
            .filter(|n| Some(*n) != avoid)
            .min_by_key(|n| (loads.get(n).copied().unwrap_or(0), *n))
    }

    /// Whether `node` is still in its back-off for `channel`.
    fn avoided(&self, channel: &ChannelName, node: NodeId, now_ms: u64) -> bool {
        self.avoid
            .get(channel)
            .and_then(|nodes| nodes.get(&node))
            .is_some_and(|until| *until > now_ms)
    }

    /// Least-loaded assignable node for `channel` that is not in a back-off for it and is
    /// not `not`.
    fn least_loaded_for(
        &self,
        loads: &BTreeMap<NodeId, usize>,
        channel: &ChannelName,
        not: Option<NodeId>,
        now_ms: u64,
    ) -> Option<NodeId> {
        self.assignable()
            .filter(|n| Some(*n) != not && !self.avoided(channel, *n, now_ms))
            .min_by_key(|n| (loads.get(n).copied().unwrap_or(0), *n))
    }

    /// Registers a new channel on the least-loaded node, or under `remaining`.
    ///
    /// # Errors
    /// [`AdminError::AlreadyExists`].
    pub fn add_channel(
        &self,
        channel: ChannelName,
        vchannel: VChannelInfo,
        now_ms: u64,
    ) -> Result<PlannedTxn, AdminError> {
        if self.channels.contains_key(&channel) {
            return Err(AdminError::AlreadyExists(channel));
        }
        let loads = self.loads();
        let owner = self
            .least_loaded(&loads, None)
            .map_or(ChannelOwner::Remaining, ChannelOwner::Node);
        let info = ChannelInfo::new(channel.clone(), Epoch(1), now_ms, vchannel);
        let change = Change {
            guards: vec![Guard {
                owner,
                channel: channel.clone(),
                mod_revision: 0,
            }],
            transition: Some(Transition {
                channel,
                cause: Cause::Assign,
                from: None,
                to: Some(owner),
                state: Some(info.state),
                epoch: info.epoch,
            }),
            ops: vec![Op::Put { owner, info }],
        };
        Ok(self.pack(vec![change]).remove(0))
    }

    /// Removes a channel: deletes every key it has. Its node stops it on the DELETE.
    ///
    /// # Errors
    /// [`AdminError::UnknownChannel`].
    pub fn remove_channel(&self, channel: &ChannelName) -> Result<PlannedTxn, AdminError> {
        let entries = self
            .channels
            .get(channel)
            .ok_or_else(|| AdminError::UnknownChannel(channel.clone()))?;
        let mut changes = Vec::new();
        for e in entries.values() {
            changes.push(Change {
                guards: vec![guard(e)],
                ops: vec![Op::Delete {
                    owner: e.owner,
                    channel: channel.clone(),
                }],
                transition: Some(Transition {
                    channel: channel.clone(),
                    cause: Cause::Remove,
                    from: Some(e.owner),
                    to: None,
                    state: None,
                    epoch: e.info.epoch,
                }),
            });
        }
        Ok(merge(self.pack(changes)))
    }

    /// Moves a channel to `to`, break-before-make (`ToRelease` first). A channel that is not
    /// running (`ToWatch`, `WatchFailed`, parked) moves at once.
    ///
    /// # Errors
    /// Unknown channel or node, draining target, a move already in flight, or already there.
    pub fn move_channel(
        &mut self,
        channel: &ChannelName,
        to: NodeId,
        now_ms: u64,
    ) -> Result<PlannedTxn, AdminError> {
        let e = self
            .entry(channel)
            .cloned()
            .ok_or_else(|| AdminError::UnknownChannel(channel.clone()))?;
        if !self.nodes.contains_key(&to) {
            return Err(AdminError::UnknownNode(to));
        }
        if self.draining.contains(&to) {
            return Err(AdminError::Draining(to));
        }
        if self.moves.contains_key(channel) {
            return Err(AdminError::Busy(channel.clone()));
        }
        if e.owner == ChannelOwner::Node(to) {
            return Err(AdminError::AlreadyThere(channel.clone(), to));
        }
        let change = match e.info.state {
            ChannelState::Watched | ChannelState::ToWatch | ChannelState::ToRelease => {
                self.moves.insert(
                    channel.clone(),
                    PendingMove {
                        to,
                        since_ms: now_ms,
                        cause: Cause::Manual,
                    },
                );
                release(&e, Cause::Manual)
            }
            _ => reassign(&e, ChannelOwner::Node(to), Cause::Manual, now_ms),
        };
        Ok(self.pack(vec![change]).remove(0))
    }

    /// Marks a node as draining (a key in the store, so it survives a coordinator failover):
    /// it gets no new channels and the planner moves its channels off, break-before-make, at
    /// most `max_concurrent_moves` at a time.
    ///
    /// # Errors
    /// [`AdminError::UnknownNode`].
    pub fn drain(&self, node: NodeId) -> Result<PlannedTxn, AdminError> {
        if !self.nodes.contains_key(&node) {
            return Err(AdminError::UnknownNode(node));
        }
        Ok(PlannedTxn {
            guards: Vec::new(),
            ops: vec![Op::Drain { node }],
            transitions: Vec::new(),
        })
    }

    /// The moves balance would make now, without making them.
    pub fn balance_plan(&self) -> Vec<PlannedMove> {
        // As if no move were in flight and any number could be: loads are the keys each
        // node holds now, and every `Watched` channel may move. No copy of the view (it
        // runs on every metrics tick, and the view can be 100 MB).
        let mut loads: BTreeMap<NodeId, usize> = self
            .assignable()
            .map(|n| (n, self.owned.get(&n).copied().unwrap_or(0)))
            .collect();
        if spread(&loads) <= 1 {
            return Vec::new();
        }
        let mut movable = self.movable(false);
        pick_moves(&mut loads, &mut movable, usize::MAX, |_, _| true)
    }

    /// `Watched` channels with one key, per live node, in name order; `idle_only` leaves
    /// out channels with a move in flight.
    fn movable(&self, idle_only: bool) -> BTreeMap<NodeId, Vec<ChannelName>> {
        let mut movable: BTreeMap<NodeId, Vec<ChannelName>> = BTreeMap::new();
        for (channel, entries) in &self.channels {
            if entries.len() != 1 || (idle_only && self.moves.contains_key(channel)) {
                continue;
            }
            let Some(e) = entries.values().next() else {
                continue;
            };
            if let (ChannelOwner::Node(n), ChannelState::Watched) = (e.owner, e.info.state) {
                movable.entry(n).or_default().push(channel.clone());
            }
        }
        movable
    }

    /// Everything that should change now. See the module docs.
    pub fn plan(&mut self, now_ms: u64) -> Vec<PlannedTxn> {
        self.forget_failed_moves(now_ms);
        if std::mem::take(&mut self.disturbed) {
            self.quiet_since_ms = now_ms;
        }
        self.prune(now_ms);
        let mut changes = Vec::new();
        // Drain marks of nodes that are gone.
        for node in self.draining.iter().filter(|n| !self.nodes.contains_key(n)) {
            changes.push(Change {
                guards: Vec::new(),
                ops: vec![Op::Undrain { node: *node }],
                transition: None,
            });
        }
        self.plan_fences(now_ms, &mut changes);
        self.plan_dedupe(&mut changes);
        self.plan_orphans(now_ms, &mut changes);
        self.plan_timeouts(now_ms, &mut changes);
        self.plan_releases(now_ms, &mut changes);
        // Loads are computed from the view, which does not yet show the changes planned
        // above: start new moves only in a round that planned nothing else, so they are
        // based on the view those changes produced.
        if changes.is_empty() {
            self.plan_drains(now_ms, &mut changes);
            self.plan_balance(now_ms, &mut changes);
        }
        // One change per channel per round: two would each put the channel somewhere (two
        // assignment keys) or guard on a revision the other changes.
        let mut touched = BTreeSet::new();
        changes.retain(|c| {
            let fresh = c.guards.iter().all(|g| !touched.contains(&g.channel));
            if fresh {
                touched.extend(c.guards.iter().map(|g| g.channel.clone()));
            }
            fresh
        });
        for t in changes.iter().filter_map(|c| c.transition.as_ref()) {
            if !matches!(
                t.cause,
                Cause::Assign | Cause::Remove | Cause::Dedupe | Cause::Park
            ) {
                self.moved_at.insert(t.channel.clone(), now_ms);
            }
        }
        self.pack(changes)
    }

    /// Forgets cool-downs, troubled nodes and fences that are over, at most once a second
    /// (each is a scan of a map that a failover can fill with every channel).
    fn prune(&mut self, now_ms: u64) {
        if now_ms < self.next_prune_ms {
            return;
        }
        self.next_prune_ms = now_ms + 1_000;
        let cooldown = self.config.move_cooldown_ms;
        self.moved_at.retain(|_, t| *t + cooldown > now_ms);
        self.troubled.retain(|_, until| *until > now_ms);
        // A back-off is kept for one more back-off after it ends: `plan_timeouts` retries a
        // channel that failed everywhere on its node once that node's own back-off is over.
        let backoff = self.config.failed_node_backoff_ms;
        self.avoid.retain(|_, nodes| {
            nodes.retain(|_, until| until.saturating_add(backoff) > now_ms);
            !nodes.is_empty()
        });
    }

    /// Dates the fenced nodes seen gone, asks again for revokes that did not take, and
    /// removes the marks of nodes that are gone, held long enough and own nothing.
    fn plan_fences(&mut self, now_ms: u64, changes: &mut Vec<Change>) {
        let wait = self.config.fence_wait_ms;
        for (node, f) in &mut self.fences {
            if self.nodes.contains_key(node) {
                f.gone_ms = None;
                let retry = f
                    .requested_ms
                    .map_or(true, |r| now_ms >= r.saturating_add(1_000));
                if retry {
                    f.requested_ms = Some(now_ms);
                    self.fence_requests.push(*node);
                }
                continue;
            }
            let gone = *f.gone_ms.get_or_insert(now_ms);
            let owns = self.owned.get(node).copied().unwrap_or(0) > 0;
            if gone.saturating_add(wait) <= now_ms && !owns {
                changes.push(Change {
                    guards: Vec::new(),
                    ops: vec![Op::Unfence { node: *node }],
                    transition: None,
                });
            }
        }
    }

    /// Whether balance may move `channel` to `to` now: not onto a node in a back-off for the
    /// channel or one that failed any channel lately, and not a channel in its cool-down.
    fn balance_allows(&self, channel: &ChannelName, to: NodeId, now_ms: u64) -> bool {
        if self.config.planted_bug == Some(PlannerBug::BalanceIgnoresBackoff) {
            return true;
        }
        !self.avoided(channel, to, now_ms)
            && !self.troubled.get(&to).is_some_and(|until| *until > now_ms)
            && !self
                .moved_at
                .get(channel)
                .is_some_and(|t| *t + self.config.move_cooldown_ms > now_ms)
    }

    /// A move whose release txn never landed (its compare failed) would block the channel
    /// forever: forget it once it is older than the release timeout.
    fn forget_failed_moves(&mut self, now_ms: u64) {
        let timeout = self.config.release_timeout_ms;
        let channels = &self.channels;
        self.moves.retain(|c, m| {
            let releasing = channels.get(c).is_some_and(|es| {
                es.values().any(|e| {
                    matches!(
                        e.info.state,
                        ChannelState::ToRelease | ChannelState::Released
                    )
                })
            });
            releasing || now_ms.saturating_sub(m.since_ms) <= timeout
        });
    }

    /// One row per channel, for `ctl channels` and the admin API.
    pub fn channel_rows(&self) -> Vec<ChannelRow> {
        self.channels
            .values()
            .flat_map(|m| m.values())
            .map(|e| ChannelRow {
                channel: e.info.channel.clone(),
                node: match e.owner {
                    ChannelOwner::Node(n) => Some(n.0),
                    ChannelOwner::Remaining => None,
                },
                state: e.info.state,
                epoch: e.info.epoch.0,
                start_time_ms: e.info.start_time_ms,
                reason: e.info.reason.clone(),
                progress: e.info.progress.as_ref().map(|p| p.percent),
            })
            .collect()
    }

    /// One row per live node, for `ctl nodes` and the admin API.
    pub fn node_rows(&self) -> Vec<NodeRow> {
        let mut counts: BTreeMap<NodeId, usize> = BTreeMap::new();
        for e in self.entries() {
            if let ChannelOwner::Node(n) = e.owner {
                *counts.entry(n).or_default() += 1;
            }
        }
        self.nodes
            .iter()
            .map(|(id, s)| NodeRow {
                id: id.0,
                admin_addr: s.admin_addr.clone(),
                channels: counts.get(id).copied().unwrap_or(0),
                started_at_ms: s.started_at_ms,
                draining: self.draining.contains(id),
            })
            .collect()
    }

    /// The channels that need attention, in name order (as a full scan would visit them).
    fn unsettled(&self) -> impl Iterator<Item = (&ChannelName, &Owners)> {
        self.attention
            .iter()
            .filter_map(|c| self.channels.get_key_value(c))
    }

    /// Whether a node without a session still owns a key: its channels must fail over.
    fn dead_owner(&self) -> bool {
        self.owned
            .iter()
            .any(|(n, count)| *count > 0 && !self.nodes.contains_key(n))
    }

    /// More than one key for a channel: keep the highest epoch.
    fn plan_dedupe(&self, changes: &mut Vec<Change>) {
        for (channel, entries) in self.unsettled() {
            if entries.len() < 2 {
                continue;
            }
            let keep = entries
                .values()
                .max_by_key(|e| (e.info.epoch, e.owner != ChannelOwner::Remaining))
                .map(|e| e.owner);
            for e in entries.values().filter(|e| Some(e.owner) != keep) {
                changes.push(Change {
                    guards: vec![guard(e)],
                    ops: vec![Op::Delete {
                        owner: e.owner,
                        channel: channel.clone(),
                    }],
                    transition: Some(Transition {
                        channel: channel.clone(),
                        cause: Cause::Dedupe,
                        from: Some(e.owner),
                        to: None,
                        state: None,
                        epoch: e.info.epoch,
                    }),
                });
            }
        }
    }

    /// Channels of dead nodes go to live nodes (or `remaining`); parked ones come back.
    fn plan_orphans(&mut self, now_ms: u64, changes: &mut Vec<Change>) {
        let mut loads = self.loads();
        let mut planned = Vec::new();
        // Settled channels under live nodes are skipped either way; scan them all only when
        // a dead node's channels are among them.
        let scan: Box<dyn Iterator<Item = (&ChannelName, &Owners)>> = if self.dead_owner() {
            Box::new(self.channels.iter())
        } else {
            Box::new(self.unsettled())
        };
        for (channel, entries) in scan {
            if entries.len() != 1 {
                continue; // dedupe first
            }
            let Some(e) = entries.values().next() else {
                continue;
            };
            let cause = match e.owner {
                ChannelOwner::Node(n) if !self.nodes.contains_key(&n) => {
                    // A node whose lease we revoked may not have heard of it yet: it runs
                    // its channels until it fences itself, at most its TTL later.
                    if self
                        .fences
                        .get(&n)
                        .is_some_and(|f| f.hold_until(self.config.fence_wait_ms) > now_ms)
                    {
                        continue;
                    }
                    Cause::Failover
                }
                ChannelOwner::Remaining => Cause::Unpark,
                ChannelOwner::Node(_) => continue,
            };
            let target = self
                .least_loaded_for(&loads, channel, None, now_ms)
                .or_else(|| self.least_loaded(&loads, None));
            match target {
                Some(target) => {
                    *loads.entry(target).or_default() += 1;
                    planned.push(reassign(e, ChannelOwner::Node(target), cause, now_ms));
                }
                None if cause == Cause::Failover => {
                    planned.push(park(e));
                }
                None => {}
            }
        }
        for t in planned.iter().filter_map(|c| c.transition.as_ref()) {
            self.moves.remove(&t.channel);
        }
        changes.extend(planned);
    }

    fn plan_timeouts(&mut self, now_ms: u64, changes: &mut Vec<Change>) {
        let mut loads = self.loads();
        let backoff = self.config.failed_node_backoff_ms;
        let mut planned = Vec::new();
        let mut newly_avoided = Vec::new();
        let mut troubled = Vec::new();
        let mut new_moves = Vec::new();
        for (channel, entries) in self.unsettled() {
            if entries.len() != 1 {
                continue;
            }
            let Some(e) = entries.values().next() else {
                continue;
            };
            let ChannelOwner::Node(node) = e.owner else {
                continue;
            };
            if !self.nodes.contains_key(&node) {
                continue;
            }
            let timed_out = match e.info.state {
                ChannelState::ToWatch if now_ms < self.timeouts_after_ms => false,
                ChannelState::ToWatch => {
                    let last = e.info.progress.as_ref().map_or(e.info.start_time_ms, |p| {
                        p.updated_at_ms.max(e.info.start_time_ms)
                    });
                    now_ms.saturating_sub(last) > self.config.watch_timeout_ms
                }
                ChannelState::WatchFailed => true,
                _ => false,
            };
            if !timed_out {
                continue;
            }
            let target = match self.least_loaded_for(&loads, channel, Some(node), now_ms) {
                Some(t) => t,
                // Every other node is in its back-off for this channel (or there is none):
                // retry here once this node's own back-off has passed, else wait.
                None => match self.avoid.get(channel).and_then(|a| a.get(&node)) {
                    // Only a back-off set for this very assignment (at or after it began)
                    // covers this failure; an older one is from an earlier failure here,
                    // and retrying at once would bounce the channel within milliseconds
                    // (found by the simulation's ping-pong check).
                    Some(until)
                        if *until <= now_ms
                            && until.saturating_sub(backoff) >= e.info.start_time_ms =>
                    {
                        node
                    }
                    Some(until) if *until > now_ms => continue,
                    Some(_) | None => {
                        newly_avoided.push((channel.clone(), node));
                        continue;
                    }
                },
            };
            if let Some(l) = loads.get_mut(&target) {
                *l += 1;
            }
            newly_avoided.push((channel.clone(), node));
            troubled.push(node);
            if e.info.state == ChannelState::ToWatch {
                // The node lives and may still be loading (its progress writes may be what
                // failed): release first, break-before-make, and force the move only after
                // the release timeout, when a node that cannot hear us has fenced itself
                // (found by the simulation: a direct move overlapped such a load).
                new_moves.push((
                    channel.clone(),
                    PendingMove {
                        to: target,
                        since_ms: now_ms,
                        cause: Cause::Timeout,
                    },
                ));
                planned.push(release(e, Cause::Timeout));
            } else {
                planned.push(reassign(
                    e,
                    ChannelOwner::Node(target),
                    Cause::Failed,
                    now_ms,
                ));
            }
        }
        if !troubled.is_empty() {
            self.quiet_since_ms = now_ms;
        }
        for node in troubled {
            self.troubled.insert(node, now_ms + backoff);
        }
        for (channel, node) in newly_avoided {
            self.avoid
                .entry(channel)
                .or_default()
                .insert(node, now_ms + backoff);
        }
        self.moves.extend(new_moves);
        changes.extend(planned);
    }

    /// Finish moves whose channel is `Released`; force those stuck in `ToRelease`.
    fn plan_releases(&mut self, now_ms: u64, changes: &mut Vec<Change>) {
        let mut loads = self.loads();
        let mut done = Vec::new();
        let mut adopt = Vec::new();
        let mut to_fence = BTreeSet::new();
        for (channel, entries) in self.unsettled() {
            if entries.len() != 1 {
                continue;
            }
            let Some(e) = entries.values().next() else {
                continue;
            };
            let ChannelOwner::Node(from) = e.owner else {
                continue;
            };
            // A dead node's channels are failovers (`plan_orphans`), whatever their state.
            if !self.nodes.contains_key(&from) {
                continue;
            }
            if !matches!(
                e.info.state,
                ChannelState::ToRelease | ChannelState::Released
            ) {
                continue;
            }
            let pending = match self.moves.get(channel) {
                Some(m) => *m,
                None => {
                    // A move begun by an earlier leader: pick a target now.
                    let to = self
                        .least_loaded_for(&loads, channel, Some(from), now_ms)
                        .unwrap_or(from);
                    let m = PendingMove {
                        to,
                        since_ms: now_ms,
                        cause: Cause::Balance,
                    };
                    adopt.push((channel.clone(), m));
                    m
                }
            };
            let stuck = e.info.state == ChannelState::ToRelease
                && now_ms.saturating_sub(pending.since_ms) > self.config.release_timeout_ms;
            let planted = self.config.planted_bug == Some(PlannerBug::ForceWithoutFence);
            if stuck && !planted {
                // The owner is alive but did not release in time: it may be blind (a
                // stalled watch) and still running the channel. Moving the channel now
                // would run it twice; fence the owner instead. Once its session is gone,
                // `plan_orphans` moves its channels (DESIGN §3, found from outside).
                to_fence.insert(from);
                continue;
            }
            if e.info.state == ChannelState::Released || stuck {
                // The target may have died, started draining or failed the channel
                // meanwhile: then the least loaded node not in a back-off for it.
                let to = if self.nodes.contains_key(&pending.to)
                    && !self.draining.contains(&pending.to)
                    && !self.avoided(channel, pending.to, now_ms)
                {
                    pending.to
                } else {
                    match self
                        .least_loaded_for(&loads, channel, Some(from), now_ms)
                        .or_else(|| self.least_loaded(&loads, Some(from)))
                        .or_else(|| self.least_loaded(&loads, None))
                    {
                        Some(t) => t,
                        None => continue,
                    }
                };
                if let Some(l) = loads.get_mut(&to) {
                    *l += 1;
                }
                done.push((
                    channel.clone(),
                    reassign(e, ChannelOwner::Node(to), pending.cause, now_ms),
                ));
            }
        }
        for (c, m) in adopt {
            self.moves.insert(c, m);
        }
        for node in to_fence {
            if !self.fences.contains_key(&node) {
                // The mark first (leader-guarded, so a deposed leader revokes nothing); the
                // revoke follows once it has landed (`applied`).
                changes.push(Change {
                    guards: Vec::new(),
                    ops: vec![Op::Fence { node }],
                    transition: None,
                });
                self.quiet_since_ms = now_ms;
            }
        }
        for (channel, change) in done {
            self.moves.remove(&channel);
            changes.push(change);
        }
    }

    fn plan_drains(&mut self, now_ms: u64, changes: &mut Vec<Change>) {
        if self.draining.is_empty() {
            return;
        }
        let mut loads = self.loads();
        let mut budget = self
            .config
            .max_concurrent_moves
            .saturating_sub(self.moves.len());
        let mut new_moves = Vec::new();
        for (channel, entries) in &self.channels {
            if budget == 0 {
                break;
            }
            if entries.len() != 1 || self.moves.contains_key(channel) {
                continue;
            }
            let Some(e) = entries.values().next() else {
                continue;
            };
            let ChannelOwner::Node(from) = e.owner else {
                continue;
            };
            if !self.draining.contains(&from) || !self.nodes.contains_key(&from) {
                continue;
            }
            let Some(to) = self.least_loaded_for(&loads, channel, Some(from), now_ms) else {
                continue;
            };
            *loads.entry(to).or_default() += 1;
            budget -= 1;
            match e.info.state {
                // A loading channel runs too: it is released first like a watched one, or a
                // node that misses the delete (a stalled connection) would load it while the
                // target does (found by the simulation).
                ChannelState::Watched | ChannelState::ToWatch => {
                    new_moves.push((
                        channel.clone(),
                        PendingMove {
                            to,
                            since_ms: now_ms,
                            cause: Cause::Drain,
                        },
                    ));
                    changes.push(release(e, Cause::Drain));
                }
                ChannelState::WatchFailed => {
                    changes.push(reassign(e, ChannelOwner::Node(to), Cause::Drain, now_ms))
                }
                _ => {}
            }
        }
        self.moves.extend(new_moves);
    }

    /// Move `Watched` channels from the most to the least loaded node until max - min <= 1,
    /// with at most `max_concurrent_moves` in flight.
    fn plan_balance(&mut self, now_ms: u64, changes: &mut Vec<Change>) {
        if now_ms
            < self
                .quiet_since_ms
                .saturating_add(self.config.balance_quiet_ms)
        {
            return; // something just changed: let the cluster settle first
        }
        let mut loads: BTreeMap<NodeId, usize> = self
            .loads()
            .into_iter()
            .filter(|(n, _)| !self.draining.contains(n) && !self.fences.contains_key(n))
            .collect();
        if loads.len() < 2 {
            return;
        }
        if spread(&loads) <= 1 {
            return; // balanced: skip collecting movable channels, the costly part
        }
        let mut movable = self.movable(true);
        let budget = self
            .config
            .max_concurrent_moves
            .saturating_sub(self.moves.len());
        let allowed = |c: &ChannelName, to: NodeId| self.balance_allows(c, to, now_ms);
        for m in pick_moves(&mut loads, &mut movable, budget, allowed) {
            if let Some(e) = self.entry(&m.channel) {
                changes.push(release(e, Cause::Balance));
            }
            self.moves.insert(
                m.channel,
                PendingMove {
                    to: m.to,
                    since_ms: now_ms,
                    cause: Cause::Balance,
                },
            );
        }
    }

    /// Packs changes into txns within the op and byte limits; one change is never split.
    fn pack(&self, changes: Vec<Change>) -> Vec<PlannedTxn> {
        // One compare slot is the runtime's leader guard.
        let max_ops = self.config.max_txn_ops.saturating_sub(1).max(2);
        let mut out: Vec<PlannedTxn> = Vec::new();
        let mut cur = PlannedTxn {
            guards: Vec::new(),
            ops: Vec::new(),
            transitions: Vec::new(),
        };
        let mut cur_bytes = 0usize;
        for c in changes {
            let bytes: usize = c.ops.iter().map(op_bytes).sum();
            let full = cur.ops.len() + c.ops.len() > max_ops
                || cur.guards.len() + c.guards.len() > max_ops
                || (cur_bytes + bytes > self.config.max_txn_bytes && !cur.ops.is_empty());
            if full {
                out.push(std::mem::replace(
                    &mut cur,
                    PlannedTxn {
                        guards: Vec::new(),
                        ops: Vec::new(),
                        transitions: Vec::new(),
                    },
                ));
                cur_bytes = 0;
            }
            cur_bytes += bytes;
            cur.guards.extend(c.guards);
            cur.ops.extend(c.ops);
            cur.transitions.extend(c.transition);
        }
        if !cur.ops.is_empty() {
            out.push(cur);
        }
        out
    }
}

/// Joins txns produced for one admin request (removal of a channel with duplicates).
/// Max − min load.
fn spread(loads: &BTreeMap<NodeId, usize>) -> usize {
    loads.values().max().unwrap_or(&0) - loads.values().min().unwrap_or(&0)
}

/// Up to `budget` moves, each of the last movable channel of the busiest node (ties: lowest
/// ID) to the least loaded one (ties: lowest ID), until max − min ≤ 1 or the busiest node
/// has nothing movable. `loads` ends as it would after the moves.
fn pick_moves(
    loads: &mut BTreeMap<NodeId, usize>,
    movable: &mut BTreeMap<NodeId, Vec<ChannelName>>,
    budget: usize,
    allowed: impl Fn(&ChannelName, NodeId) -> bool,
) -> Vec<PlannedMove> {
    let mut out = Vec::new();
    while out.len() < budget {
        let Some((&max_node, &max)) = loads
            .iter()
            .max_by_key(|(n, l)| (**l, std::cmp::Reverse(**n)))
        else {
            break;
        };
        let Some((&min_node, &min)) = loads.iter().min_by_key(|(n, l)| (**l, **n)) else {
            break;
        };
        if max <= min + 1 {
            break;
        }
        // The last movable channel of the busiest node that may go to the least loaded.
        let Some(channel) = movable.get_mut(&max_node).and_then(|cs| {
            let i = cs.iter().rposition(|c| allowed(c, min_node))?;
            Some(cs.remove(i))
        }) else {
            // Everything on the busiest node is mid-transition, cooling down or kept off
            // the least loaded node; wait for it.
            break;
        };
        *loads.entry(max_node).or_default() -= 1;
        *loads.entry(min_node).or_default() += 1;
        out.push(PlannedMove {
            channel,
            from: max_node,
            to: min_node,
        });
    }
    out
}

/// Keeps the attention set in step after a change to `channel`.
fn mark(attention: &mut BTreeSet<ChannelName>, channel: &ChannelName, settled: bool) {
    if settled {
        attention.remove(channel);
    } else if !attention.contains(channel) {
        attention.insert(channel.clone());
    }
}

fn merge(txns: Vec<PlannedTxn>) -> PlannedTxn {
    let mut out = PlannedTxn {
        guards: Vec::new(),
        ops: Vec::new(),
        transitions: Vec::new(),
    };
    for t in txns {
        out.guards.extend(t.guards);
        out.ops.extend(t.ops);
        out.transitions.extend(t.transitions);
    }
    out
}

fn op_bytes(op: &Op) -> usize {
    match op {
        Op::Put { info, .. } => info.encode().len() + 300,
        Op::Delete { .. }
        | Op::Drain { .. }
        | Op::Undrain { .. }
        | Op::Fence { .. }
        | Op::Unfence { .. } => 300,
    }
}

fn guard(e: &Entry) -> Guard {
    Guard {
        owner: e.owner,
        channel: e.info.channel.clone(),
        mod_revision: e.mod_revision,
    }
}

/// Delete the old key and put `ToWatch` with the next epoch under `to`, in one txn.
fn reassign(e: &Entry, to: ChannelOwner, cause: Cause, now_ms: u64) -> Change {
    let mut info = e.info.clone();
    info.state = ChannelState::ToWatch;
    info.epoch = info.epoch.next();
    info.start_time_ms = now_ms;
    info.progress = None;
    info.reason = Some(cause.as_str().to_owned());
    let mut ops = Vec::with_capacity(2);
    if e.owner != to {
        ops.push(Op::Delete {
            owner: e.owner,
            channel: info.channel.clone(),
        });
    }
    let transition = Transition {
        channel: info.channel.clone(),
        cause,
        from: Some(e.owner),
        to: Some(to),
        state: Some(info.state),
        epoch: info.epoch,
    };
    ops.push(Op::Put { owner: to, info });
    Change {
        guards: vec![guard(e)],
        ops,
        transition: Some(transition),
    }
}

/// Park under `remaining`: no node owns it, so the epoch stays.
fn park(e: &Entry) -> Change {
    let mut info = e.info.clone();
    info.state = ChannelState::ToWatch;
    info.progress = None;
    info.reason = Some(Cause::Park.as_str().to_owned());
    let transition = Transition {
        channel: info.channel.clone(),
        cause: Cause::Park,
        from: Some(e.owner),
        to: Some(ChannelOwner::Remaining),
        state: Some(info.state),
        epoch: info.epoch,
    };
    Change {
        guards: vec![guard(e)],
        ops: vec![
            Op::Delete {
                owner: e.owner,
                channel: info.channel.clone(),
            },
            Op::Put {
                owner: ChannelOwner::Remaining,
                info,
            },
        ],
        transition: Some(transition),
    }
}

/// Ask the owner to stop the channel (first half of a break-before-make move).
fn release(e: &Entry, cause: Cause) -> Change {
    let mut info = e.info.clone();
    info.state = ChannelState::ToRelease;
    info.reason = Some(cause.as_str().to_owned());
    let transition = Transition {
        channel: info.channel.clone(),
        cause,
        from: Some(e.owner),
        to: Some(e.owner),
        state: Some(info.state),
        epoch: info.epoch,
    };
    Change {
        guards: vec![guard(e)],
        ops: vec![Op::Put {
            owner: e.owner,
            info,
        }],
        transition: Some(transition),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Progress;

    pub(super) fn name(s: &str) -> ChannelName {
        ChannelName::new(s).expect("valid")
    }

    fn session(id: u64) -> NodeSession {
        NodeSession {
            id: NodeId(id),
            admin_addr: String::new(),
            version: "t".into(),
            started_at_ms: 0,
            capacity: 0,
            extra: Default::default(),
        }
    }

    pub(super) fn info(ch: &str, state: ChannelState, epoch: u64, start: u64) -> ChannelInfo {
        let mut i = ChannelInfo::new(name(ch), Epoch(epoch), start, VChannelInfo::default());
        i.state = state;
        i
    }

    pub(super) struct World {
        pub(super) state: Planner,
        pub(super) keys: Keys,
        pub(super) rev: i64,
    }

    impl World {
        pub(super) fn new(config: PlannerConfig) -> Self {
            let keys = Keys::default();
            World {
                state: Planner::new(keys.clone(), config),
                keys,
                rev: 100,
            }
        }
        pub(super) fn node(&mut self, id: u64) {
            self.rev += 1;
            let key = self.keys.session(NodeId(id));
            self.state.apply_put(&key, &session(id).encode(), self.rev);
        }
        pub(super) fn kill(&mut self, id: u64) {
            self.state
                .apply_delete(&self.keys.session(NodeId(id)), self.rev);
        }
        pub(super) fn put(&mut self, owner: ChannelOwner, i: ChannelInfo) -> i64 {
            self.rev += 1;
            let key = self.keys.channel(owner, &i.channel);
            assert_eq!(self.state.apply_put(&key, &i.encode(), self.rev), None);
            self.rev
        }
        /// Plans and applies everything, as a runtime whose txns all succeed would.
        fn settle(&mut self, now: u64) -> Vec<PlannedTxn> {
            let txns = self.state.plan(now);
            for t in &txns {
                self.rev += 1;
                self.state.applied(t, self.rev);
            }
            txns
        }
        fn owner_of(&self, ch: &str) -> (ChannelOwner, ChannelState, Epoch) {
            let e = self.state.entry(&name(ch)).expect("exists");
            (e.owner, e.info.state, e.info.epoch)
        }
    }

    fn n(id: u64) -> ChannelOwner {
        ChannelOwner::Node(NodeId(id))
    }

    #[test]
    fn add_channel_goes_to_the_least_loaded_node_with_epoch_one() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.node(2);
        w.put(n(1), info("a", ChannelState::Watched, 1, 0));
        let txn = w
            .state
            .add_channel(name("b"), VChannelInfo::default(), 7)
            .expect("new");
        assert_eq!(
            txn.guards,
            vec![Guard {
                owner: n(2),
                channel: name("b"),
                mod_revision: 0
            }]
        );
        assert_eq!(
            txn.ops,
            vec![Op::Put {
                owner: n(2),
                info: info("b", ChannelState::ToWatch, 1, 7)
            }]
        );
        assert_eq!(
            w.state.add_channel(name("a"), VChannelInfo::default(), 7),
            Err(AdminError::AlreadyExists(name("a")))
        );
    }

    #[test]
    fn add_channel_with_no_node_alive_parks_it() {
        let w = World::new(PlannerConfig::default());
        let txn = w
            .state
            .add_channel(name("a"), VChannelInfo::default(), 0)
            .expect("new");
        assert!(matches!(
            &txn.ops[..],
            [Op::Put {
                owner: ChannelOwner::Remaining,
                ..
            }]
        ));
    }

    #[test]
    fn failover_moves_only_the_dead_nodes_channels_with_the_next_epoch() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.node(2);
        w.node(3);
        let rev_a = w.put(n(1), info("a", ChannelState::Watched, 4, 0));
        w.put(n(2), info("b", ChannelState::Watched, 1, 0));
        w.put(n(3), info("c", ChannelState::Watched, 1, 0));
        w.kill(1);
        let txns = w.state.plan(50);
        assert_eq!(txns.len(), 1);
        let mut moved = info("a", ChannelState::ToWatch, 5, 50);
        moved.reason = Some("failover".into());
        assert_eq!(
            txns[0].guards,
            vec![Guard {
                owner: n(1),
                channel: name("a"),
                mod_revision: rev_a
            }]
        );
        assert_eq!(
            txns[0].ops,
            vec![
                Op::Delete {
                    owner: n(1),
                    channel: name("a")
                },
                Op::Put {
                    owner: n(2),
                    info: moved
                }
            ]
        );
        assert_eq!(txns[0].transitions[0].cause, Cause::Failover);
    }

    #[test]
    fn failover_with_no_node_alive_parks_under_remaining_and_a_new_node_gets_everything() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.put(n(1), info("a", ChannelState::Watched, 2, 0));
        w.put(n(1), info("b", ChannelState::Watched, 3, 0));
        w.kill(1);
        w.settle(10);
        assert_eq!(
            w.owner_of("a"),
            (ChannelOwner::Remaining, ChannelState::ToWatch, Epoch(2))
        );
        assert_eq!(
            w.owner_of("b"),
            (ChannelOwner::Remaining, ChannelState::ToWatch, Epoch(3))
        );
        assert!(w.settle(20).is_empty(), "nothing to do while no node lives");
        w.node(2);
        let txns = w.settle(30);
        assert!(txns
            .iter()
            .flat_map(|t| &t.transitions)
            .all(|t| t.cause == Cause::Unpark));
        assert_eq!(w.owner_of("a"), (n(2), ChannelState::ToWatch, Epoch(3)));
        assert_eq!(w.owner_of("b"), (n(2), ChannelState::ToWatch, Epoch(4)));
    }

    #[test]
    fn a_slow_load_reporting_progress_is_not_reassigned_but_a_hung_one_is() {
        let cfg = PlannerConfig {
            watch_timeout_ms: 1_000,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(1);
        w.node(2);
        let mut slow = info("slow", ChannelState::ToWatch, 1, 0);
        slow.progress = Some(Progress {
            percent: 50,
            updated_at_ms: 900,
        });
        w.put(n(1), slow);
        w.put(n(1), info("hung", ChannelState::ToWatch, 1, 0));
        assert!(w.state.plan(1_000).is_empty(), "nothing has timed out yet");
        let txns = w.settle(1_500);
        let moved: Vec<&str> = txns
            .iter()
            .flat_map(|t| &t.transitions)
            .map(|t| t.channel.as_str())
            .collect();
        assert_eq!(moved, ["hung"]);
        // Released first: the node may still be loading it.
        assert_eq!(
            w.owner_of("hung"),
            (n(1), ChannelState::ToRelease, Epoch(1))
        );
        assert_eq!(w.owner_of("slow"), (n(1), ChannelState::ToWatch, Epoch(1)));
        // The node acks Released: the move completes on the other node.
        w.put(n(1), info("hung", ChannelState::Released, 1, 0));
        w.settle(1_600);
        assert_eq!(w.owner_of("hung"), (n(2), ChannelState::ToWatch, Epoch(2)));
    }

    #[test]
    fn watch_failed_goes_to_another_node_at_once() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.node(2);
        w.put(n(1), info("a", ChannelState::WatchFailed, 1, 0));
        let txns = w.settle(5);
        assert_eq!(txns[0].transitions[0].cause, Cause::Failed);
        assert_eq!(w.owner_of("a"), (n(2), ChannelState::ToWatch, Epoch(2)));
    }

    #[test]
    fn watch_failed_on_the_only_node_is_retried_there_after_the_backoff() {
        let cfg = PlannerConfig {
            failed_node_backoff_ms: 1_000,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(1);
        w.put(n(1), info("a", ChannelState::WatchFailed, 1, 0));
        assert!(w.settle(100).is_empty());
        assert!(w.settle(900).is_empty());
        let txns = w.settle(1_200);
        assert_eq!(txns.len(), 1);
        assert_eq!(w.owner_of("a"), (n(1), ChannelState::ToWatch, Epoch(2)));
        // Same key: a put, no delete.
        assert!(matches!(&txns[0].ops[..], [Op::Put { .. }]));
    }

    #[test]
    fn a_channel_failing_everywhere_is_retried_once_per_node_per_backoff() {
        let cfg = PlannerConfig {
            failed_node_backoff_ms: 1_000,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        for id in 1..=3 {
            w.node(id);
        }
        w.put(n(1), info("a", ChannelState::WatchFailed, 1, 0));
        // The node acks WatchFailed for whatever it was given.
        let fail = |w: &mut World| {
            let (owner, _, epoch) = w.owner_of("a");
            w.put(owner, info("a", ChannelState::WatchFailed, epoch.0, 0));
        };
        let mut moves = 0;
        for now in (0..3_000).step_by(10) {
            moves += w.settle(now).len();
            if w.owner_of("a").1 == ChannelState::ToWatch {
                fail(&mut w);
            }
        }
        // t=0: 1 -> 2 -> 3 (each fails at once), then every node waits out its back-off:
        // about one move per node per second, not one per plan.
        assert!((3..=9).contains(&moves), "{moves} moves in 3 s");
        assert!(w.owner_of("a").2 <= Epoch(10));
    }

    #[test]
    fn a_released_channel_of_a_dead_node_moves_once() {
        // Found by the simulation: a new leader saw a channel `Released` on a node that had
        // died; the failover and the unfinished move each put it somewhere, in one txn.
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.node(2);
        w.node(3);
        w.put(n(3), info("a", ChannelState::Released, 5, 0));
        w.put(n(1), info("b", ChannelState::ToRelease, 5, 0));
        w.kill(3);
        w.kill(1);
        let txns = w.settle(10);
        let puts: Vec<&Op> = txns
            .iter()
            .flat_map(|t| &t.ops)
            .filter(|op| matches!(op, Op::Put { .. }))
            .collect();
        assert_eq!(puts.len(), 2, "{puts:?}");
        assert_eq!(w.owner_of("a"), (n(2), ChannelState::ToWatch, Epoch(6)));
        assert_eq!(w.owner_of("b"), (n(2), ChannelState::ToWatch, Epoch(6)));
    }

    #[test]
    fn balance_is_break_before_make_and_bounded() {
        let cfg = PlannerConfig {
            max_concurrent_moves: 2,
            balance_quiet_ms: 0,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(1);
        for i in 0..6 {
            w.put(n(1), info(&format!("c{i}"), ChannelState::Watched, 1, 0));
        }
        w.node(2);
        let txns = w.settle(10);
        let t: Vec<&Transition> = txns.iter().flat_map(|t| &t.transitions).collect();
        assert_eq!(t.len(), 2, "at most 2 moves in flight");
        assert!(t
            .iter()
            .all(|t| t.cause == Cause::Balance && t.state == Some(ChannelState::ToRelease)));
        assert!(w.settle(11).is_empty(), "no more moves until one finishes");
        // The node releases one: the coordinator moves it to node 2 and starts another.
        let ch = t[0].channel.clone();
        let mut released = w.state.entry(&ch).expect("exists").info.clone();
        released.state = ChannelState::Released;
        w.put(n(1), released);
        let txns = w.settle(12);
        let t: Vec<&Transition> = txns.iter().flat_map(|t| &t.transitions).collect();
        assert_eq!(t[0].channel, ch);
        assert_eq!(
            (t[0].to, t[0].state, t[0].epoch),
            (Some(n(2)), Some(ChannelState::ToWatch), Epoch(2))
        );
        assert_eq!(
            t.len(),
            1,
            "new moves wait for a round that sees the finished one"
        );
        let txns = w.settle(13);
        let t: Vec<&Transition> = txns.iter().flat_map(|t| &t.transitions).collect();
        assert_eq!(t.len(), 1, "one new move started");
        assert_eq!(t[0].state, Some(ChannelState::ToRelease));
        assert_eq!(w.state.moves_in_flight(), 2);
    }

    #[test]
    fn balance_plan_reaches_within_one_with_the_minimum_moves() {
        let mut w = World::new(PlannerConfig::default());
        for id in 1..=3 {
            w.node(id);
        }
        for i in 0..10 {
            w.put(n(1), info(&format!("c{i:02}"), ChannelState::Watched, 1, 0));
        }
        let plan = w.state.balance_plan();
        // 10/0/0 -> 4/3/3: 6 moves, the minimum.
        assert_eq!(plan.len(), 6);
        assert!(plan.iter().all(|m| m.from == NodeId(1)));
        assert_eq!(w.state.moves_in_flight(), 0, "a dry run changes nothing");
    }

    #[test]
    fn a_stuck_release_fences_the_owner_and_moves_only_after_its_ttl() {
        let cfg = PlannerConfig {
            release_timeout_ms: 1_000,
            fence_wait_ms: 3_000,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(1);
        w.node(2);
        w.put(n(1), info("a", ChannelState::Watched, 1, 0));
        w.put(n(1), info("b", ChannelState::Watched, 1, 0));
        let txn = w
            .state
            .move_channel(&name("a"), NodeId(2), 0)
            .expect("move");
        w.rev += 1;
        w.state.applied(&txn, w.rev);
        assert_eq!(w.owner_of("a").1, ChannelState::ToRelease);
        assert!(w.settle(500).is_empty());
        assert!(w.state.take_fence_requests().is_empty());
        // Past the release timeout the owner is alive (a stalled watch keeps renewing its
        // lease): nothing moves beside it; a fence mark is written, then the lease revoked.
        let txns = w.settle(1_500);
        assert_eq!(txns.len(), 1);
        assert_eq!(txns[0].ops, vec![Op::Fence { node: NodeId(1) }]);
        assert!(
            txns[0].transitions.is_empty(),
            "never a move beside a live owner"
        );
        assert_eq!(w.state.take_fence_requests(), vec![NodeId(1)]);
        assert_eq!(w.owner_of("a"), (n(1), ChannelState::ToRelease, Epoch(1)));
        // A fenced node gets nothing new.
        let add = w
            .state
            .add_channel(name("c"), VChannelInfo::default(), 1_500)
            .expect("add");
        assert!(matches!(add.ops[0], Op::Put { owner, .. } if owner == n(2)));
        // The session goes; the node may not know yet, so its channels stay until it has
        // surely fenced itself: fence_wait_ms after the session was seen gone.
        w.kill(1);
        assert!(w.settle(2_000).is_empty());
        assert!(w.settle(4_900).is_empty());
        w.settle(5_000);
        assert_eq!(w.owner_of("a"), (n(2), ChannelState::ToWatch, Epoch(2)));
        assert_eq!(w.owner_of("b"), (n(2), ChannelState::ToWatch, Epoch(2)));
        // The mark goes once the node owns nothing.
        let txns = w.settle(5_100);
        assert_eq!(txns[0].ops, vec![Op::Unfence { node: NodeId(1) }]);
        w.settle(5_200);
        assert_eq!(w.state.fencing().count(), 0);
    }

    #[test]
    fn a_new_leader_holds_the_channels_of_a_node_being_fenced() {
        // Found by the simulation: the leader revoked a blind node's lease, lost its own
        // lease, was elected again with a fresh view and moved the node's channels at once,
        // 333 ms before the node noticed and stopped them.
        let cfg = PlannerConfig {
            fence_wait_ms: 3_000,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(2);
        w.put(n(1), info("a", ChannelState::ToRelease, 1, 0));
        w.rev += 1;
        let mark = w.keys.fence(NodeId(1));
        assert_eq!(w.state.apply_put(&mark, b"{}", w.rev), None);
        assert!(w.settle(10_000).is_empty(), "node 1 may still run `a`");
        assert!(w.settle(12_900).is_empty());
        w.settle(13_000);
        assert_eq!(w.owner_of("a"), (n(2), ChannelState::ToWatch, Epoch(2)));
    }

    #[test]
    fn a_failed_revoke_is_asked_for_again() {
        let cfg = PlannerConfig {
            release_timeout_ms: 1_000,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(1);
        w.node(2);
        w.put(n(1), info("a", ChannelState::ToRelease, 1, 0));
        w.settle(0);
        w.settle(1_001);
        assert_eq!(w.state.take_fence_requests(), vec![NodeId(1)]);
        w.settle(1_500);
        w.state.take_fence_requests();
        w.settle(2_000);
        assert!(w.state.take_fence_requests().is_empty());
        w.settle(2_600);
        assert_eq!(w.state.take_fence_requests(), vec![NodeId(1)]);
    }

    #[test]
    fn a_failing_channel_does_not_ping_pong_back_through_balance() {
        // Seen from outside: a channel failing on node A went to B, and 10-35 ms later
        // balance put it (or a healthy channel) back on A; 601 transitions in 7 s.
        let cfg = PlannerConfig {
            failed_node_backoff_ms: 30_000,
            balance_quiet_ms: 5_000,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(1);
        w.node(2);
        for i in 0..4 {
            w.put(n(1), info(&format!("a{i}"), ChannelState::Watched, 1, 0));
            w.put(n(2), info(&format!("b{i}"), ChannelState::Watched, 1, 0));
        }
        w.put(n(1), info("bad", ChannelState::WatchFailed, 1, 0));
        w.settle(10_000);
        assert_eq!(w.owner_of("bad"), (n(2), ChannelState::ToWatch, Epoch(2)));
        let mut bad = w.state.entry(&name("bad")).expect("bad").info.clone();
        bad.state = ChannelState::Watched;
        w.put(n(2), bad);
        // 4 on node 1, 5 on node 2: balanced. Node 1 failed a channel, so nothing more goes
        // there for the back-off, whatever the loads.
        let mut moves = 0;
        for t in (10_010..45_000).step_by(500) {
            moves += w
                .settle(t)
                .iter()
                .map(|t| t.transitions.len())
                .sum::<usize>();
        }
        assert_eq!(moves, 0);
        // A node joining later is fed only after the quiet period, and never `bad`.
        w.node(3);
        assert!(w.settle(45_500).is_empty(), "balance waits after a join");
        let txns = w.settle(51_000);
        let moved: Vec<&Transition> = txns.iter().flat_map(|t| &t.transitions).collect();
        assert_eq!(moved.len(), 3, "4/5/0 -> 3/3/3: {moved:?}");
        assert!(moved
            .iter()
            .all(|t| t.cause == Cause::Balance && t.channel.as_str() != "bad"));
    }

    #[test]
    fn balance_does_not_feed_a_node_that_fails_loads() {
        let cfg = PlannerConfig {
            failed_node_backoff_ms: 30_000,
            balance_quiet_ms: 1_000,
            move_cooldown_ms: 0,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(1);
        w.node(2);
        for i in 0..6 {
            w.put(n(1), info(&format!("c{i}"), ChannelState::Watched, 1, 0));
        }
        w.put(n(2), info("hung", ChannelState::WatchFailed, 1, 0));
        w.settle(0);
        assert_eq!(w.owner_of("hung").0, n(1));
        let mut hung = w.state.entry(&name("hung")).expect("hung").info.clone();
        hung.state = ChannelState::Watched;
        w.put(n(1), hung);
        // Node 2 is empty, but it just failed a load: balance leaves it alone.
        for t in (1_000..30_000).step_by(1_000) {
            assert!(w.settle(t).is_empty(), "at {t}");
        }
        // After the back-off it is a target again.
        let txns = w.settle(31_000);
        assert!(!txns.is_empty());
        assert!(txns
            .iter()
            .flat_map(|t| &t.transitions)
            .all(|t| t.cause == Cause::Balance));
    }

    #[test]
    fn a_channel_that_just_moved_is_not_moved_again_by_balance() {
        let cfg = PlannerConfig {
            balance_quiet_ms: 0,
            move_cooldown_ms: 60_000,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(1);
        w.node(2);
        w.put(n(1), info("a", ChannelState::Watched, 1, 0));
        w.put(n(1), info("b", ChannelState::Watched, 1, 0));
        w.put(n(1), info("c", ChannelState::Watched, 1, 0));
        // An operator moves `c` to node 2 and then `a`, `b` are on node 1: balanced.
        let txn = w
            .state
            .move_channel(&name("c"), NodeId(2), 0)
            .expect("move");
        w.rev += 1;
        w.state.applied(&txn, w.rev);
        let mut c = w.state.entry(&name("c")).expect("c").info.clone();
        c.state = ChannelState::Released;
        w.put(n(1), c);
        w.settle(10);
        let mut c = w.state.entry(&name("c")).expect("c").info.clone();
        c.state = ChannelState::Watched;
        w.put(n(2), c);
        // Node 2 dies and comes back as node 3: `c` fails over to node 1 (3 there, 0 on 3).
        w.kill(2);
        w.settle(20);
        let mut c = w.state.entry(&name("c")).expect("c").info.clone();
        c.state = ChannelState::Watched;
        w.put(n(1), c);
        w.node(3);
        let txns = w.settle(30);
        let moved: Vec<&ChannelName> = txns
            .iter()
            .flat_map(|t| &t.transitions)
            .map(|t| &t.channel)
            .collect();
        assert_eq!(moved.len(), 1);
        assert_ne!(moved[0].as_str(), "c", "c moved twice in a minute");
    }

    #[test]
    fn big_failovers_are_packed_within_the_op_limit_without_splitting_a_move() {
        let cfg = PlannerConfig {
            max_txn_ops: 9,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(1);
        w.node(2);
        for i in 0..10 {
            w.put(n(1), info(&format!("c{i}"), ChannelState::Watched, 1, 0));
        }
        w.kill(1);
        let txns = w.state.plan(0);
        // 8 ops per txn (one compare slot is the leader guard) = 4 moves of delete+put.
        assert_eq!(
            txns.iter().map(|t| t.transitions.len()).collect::<Vec<_>>(),
            [4, 4, 2]
        );
        for t in &txns {
            assert!(t.ops.len() <= 8 && t.guards.len() <= 8);
            assert_eq!(t.ops.len(), 2 * t.transitions.len());
        }
    }

    #[test]
    fn late_echoes_do_not_bring_back_keys_known_deleted() {
        let mut w = World::new(PlannerConfig::default());
        w.node(2);
        let old = w.keys.channel(n(1), &name("c"));
        let stale = info("c", ChannelState::ToWatch, 1, 0);
        w.put(n(1), stale.clone()); // node 1 has no session: the channel fails over
        let before = w.rev;
        w.rev += 5; // other keys' writes
        let txns = w.settle(0);
        assert_eq!(txns.len(), 1);
        let moved = w.rev;
        assert_eq!(w.owner_of("c").0, n(2));
        // The watch lags: it now delivers an older write of the old key (the ack of a node
        // that died), then the delete of our own txn.
        assert_eq!(w.state.apply_put(&old, &stale.encode(), before + 2), None);
        assert_eq!(w.state.channel_count(), 1);
        assert!(
            w.state.entries().all(|e| e.owner == n(2)),
            "the old key came back"
        );
        assert!(
            w.state.plan(0).is_empty(),
            "a resurrected key was re-planned"
        );
        // A delete older than a value we hold is stale too.
        let new = w.keys.channel(n(2), &name("c"));
        w.state.apply_delete(&new, moved - 1);
        assert_eq!(w.owner_of("c").0, n(2));
        // Once the watch has passed the delete, the tombstone goes; a real re-creation of the
        // old key (a later revision) is applied.
        w.state.apply_delete(&old, moved);
        w.state.caught_up(moved);
        assert!(w.state.tombstones.is_empty());
        assert_eq!(w.state.apply_put(&old, &stale.encode(), moved + 5), None);
        assert_eq!(w.state.entries().count(), 2);
    }

    #[test]
    fn corrupt_values_are_reported_and_left_alone() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        let key = "chanwatch/channel/1/bad";
        assert!(w.state.apply_put(key, b"{not json", 5).is_some());
        assert!(w.state.corrupt().contains_key(key));
        assert!(w.state.plan(0).is_empty());
        w.state.apply_delete(key, 6);
        assert!(w.state.corrupt().is_empty());
    }

    #[test]
    fn a_value_naming_another_channel_than_its_key_is_corrupt_and_left_alone() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.node(2);
        let key = "chanwatch/channel/1/bad2";
        let other = info("other", ChannelState::WatchFailed, 1, 0);
        let why = w.state.apply_put(key, &other.encode(), 5).expect("corrupt");
        assert!(why.contains("other") && why.contains("bad2"), "{why}");
        assert!(w.state.corrupt().contains_key(key));
        assert_eq!(w.state.channel_count(), 0, "neither bad2 nor other exists");
        assert!(w.state.plan(10_000).is_empty(), "nothing planned for it");
    }

    #[test]
    fn an_unparsable_drain_key_is_reported_as_corrupt_and_drains_nothing() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        let key = "chanwatch/coord/drain/abc";
        let why = w.state.apply_put(key, b"{}", 5).expect("reported");
        assert!(why.contains("abc") || why.contains("decimal"), "{why}");
        assert!(w.state.corrupt().contains_key(key));
        assert!(w.state.draining().is_empty());
        // Listed again (a relist) it is still reported; a good mark next to it still counts.
        w.state.reset([
            (key, b"{}".as_slice(), 5),
            ("chanwatch/coord/drain/1", b"{}".as_slice(), 6),
        ]);
        assert!(w.state.corrupt().contains_key(key));
        assert!(w.state.draining().contains(&NodeId(1)));
        w.state.apply_delete(key, 7);
        assert!(w.state.corrupt().is_empty());
    }

    #[test]
    fn a_duplicate_key_is_removed_keeping_the_highest_epoch() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.node(2);
        w.put(n(1), info("a", ChannelState::Watched, 3, 0));
        w.put(n(2), info("a", ChannelState::Watched, 2, 0));
        let txns = w.settle(0);
        assert_eq!(
            txns[0].ops,
            vec![Op::Delete {
                owner: n(2),
                channel: name("a")
            }]
        );
        assert_eq!(w.owner_of("a"), (n(1), ChannelState::Watched, Epoch(3)));
    }

    #[test]
    fn drain_moves_everything_off_and_assigns_nothing_new_there() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.node(2);
        w.put(n(1), info("a", ChannelState::Watched, 1, 0));
        w.put(n(1), info("b", ChannelState::ToWatch, 1, 0));
        w.put(n(1), info("f", ChannelState::WatchFailed, 1, 0));
        let txn = w.state.drain(NodeId(1)).expect("live");
        w.rev += 1;
        w.state.applied(&txn, w.rev);
        w.settle(0);
        w.settle(1); // new moves start in a round with nothing else to do
                     // Loading or running: released first (break-before-make); failed: moved at once.
        assert_eq!(w.owner_of("a").1, ChannelState::ToRelease);
        assert_eq!(w.owner_of("b").1, ChannelState::ToRelease);
        assert_eq!(w.owner_of("f"), (n(2), ChannelState::ToWatch, Epoch(2)));
        let txn = w
            .state
            .add_channel(name("c"), VChannelInfo::default(), 0)
            .expect("new");
        assert!(matches!(&txn.ops[..], [Op::Put { owner, .. }] if *owner == n(2)));
    }
}

#[cfg(test)]
mod convergence_tests {
    use super::*;

    #[test]
    fn balance_converges_and_stops_moving() {
        let keys = Keys::default();
        let mut s = Planner::new(keys.clone(), PlannerConfig::default());
        let mut rev = 1;
        for id in 1..=2u64 {
            rev += 1;
            let sess = NodeSession {
                id: NodeId(id),
                admin_addr: String::new(),
                version: String::new(),
                started_at_ms: 0,
                capacity: 0,
                extra: Default::default(),
            };
            s.apply_put(&keys.session(NodeId(id)), &sess.encode(), rev);
        }
        for i in 0..21 {
            let owner = ChannelOwner::Node(NodeId(1 + (i % 2)));
            let mut info = ChannelInfo::new(
                ChannelName::new(format!("c{i:02}")).expect("valid"),
                Epoch(1),
                0,
                VChannelInfo::default(),
            );
            info.state = ChannelState::Watched;
            rev += 1;
            s.apply_put(&keys.channel(owner, &info.channel), &info.encode(), rev);
        }
        rev += 1;
        let sess = NodeSession {
            id: NodeId(3),
            admin_addr: String::new(),
            version: String::new(),
            started_at_ms: 0,
            capacity: 0,
            extra: Default::default(),
        };
        s.apply_put(&keys.session(NodeId(3)), &sess.encode(), rev);
        let mut total_moves = 0;
        for round in 0..50 {
            // A second per round: balance waits `balance_quiet_ms` after node 3 joined.
            let txns = s.plan(round * 1_000);
            for t in &txns {
                rev += 1;
                s.applied(t, rev);
                total_moves += t
                    .transitions
                    .iter()
                    .filter(|t| t.state == Some(ChannelState::ToWatch))
                    .count();
            }
            // Nodes answer: ToRelease -> Released, ToWatch -> Watched.
            let entries: Vec<Entry> = s.entries().cloned().collect();
            for e in entries {
                let mut info = e.info.clone();
                info.state = match info.state {
                    ChannelState::ToRelease => ChannelState::Released,
                    ChannelState::ToWatch => ChannelState::Watched,
                    other => other,
                };
                if info != e.info {
                    rev += 1;
                    s.apply_put(&keys.channel(e.owner, &info.channel), &info.encode(), rev);
                }
            }
        }
        let loads: Vec<usize> = s.loads().values().copied().collect();
        assert_eq!(loads, [7, 7, 7]);
        // The incremental per-node counts agree with a full count.
        let mut brute: BTreeMap<NodeId, usize> = BTreeMap::new();
        for e in s.entries() {
            if let ChannelOwner::Node(n) = e.owner {
                *brute.entry(n).or_default() += 1;
            }
        }
        assert_eq!(brute.values().copied().collect::<Vec<_>>(), [7, 7, 7]);
        s.kill_for_test(NodeId(3));
        let failed_over = s.plan(100);
        for t in &failed_over {
            rev += 1;
            s.applied(t, rev);
        }
        let loads: Vec<usize> = s.loads().values().copied().collect();
        assert_eq!(loads, [11, 10], "failover keeps the counts right");
        assert_eq!(total_moves, 7, "moves beyond the minimum");
    }

    mod index {
        //! The attention index must make a round plan exactly what a scan of every channel
        //! would.
        use super::super::tests::{info, name, World};
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Step {
            Up(u64),
            Down(u64),
            Put {
                ch: u8,
                owner: u64,
                state: ChannelState,
                epoch: u64,
            },
            Delete {
                ch: u8,
                owner: u64,
            },
            Plan {
                advance_ms: u64,
                apply: bool,
            },
        }

        fn step() -> impl Strategy<Value = Step> {
            prop_oneof![
                (1..5u64).prop_map(Step::Up),
                (1..5u64).prop_map(Step::Down),
                (
                    0..8u8,
                    0..5u64,
                    proptest::sample::select(ChannelState::ALL.to_vec()),
                    1..4u64
                )
                    .prop_map(|(ch, owner, state, epoch)| Step::Put {
                        ch,
                        owner,
                        state,
                        epoch
                    }),
                (0..8u8, 0..5u64).prop_map(|(ch, owner)| Step::Delete { ch, owner }),
                (0..20_000u64, any::<bool>())
                    .prop_map(|(advance_ms, apply)| Step::Plan { advance_ms, apply }),
            ]
        }

        fn owner(id: u64) -> ChannelOwner {
            if id == 0 {
                ChannelOwner::Remaining
            } else {
                ChannelOwner::Node(NodeId(id))
            }
        }

        fn check(state: &Planner) {
            let expect: BTreeSet<ChannelName> = state
                .channels
                .iter()
                .filter(|(_, o)| !o.settled())
                .map(|(c, _)| c.clone())
                .collect();
            assert_eq!(state.attention, expect, "attention set out of step");
            let mut census = Census {
                by_state: [0; 5],
                remaining: 0,
            };
            for e in state.entries() {
                let i = ChannelState::ALL
                    .iter()
                    .position(|s| *s == e.info.state)
                    .expect("a state");
                census.by_state[i] += 1;
                census.remaining += usize::from(e.owner == ChannelOwner::Remaining);
            }
            assert_eq!(state.census(), census, "census differs from a full count");
            // `balance_plan` must be the round a copy of the view would plan with no move
            // in flight and no limit.
            let mut sim = state.clone();
            sim.config.max_concurrent_moves = usize::MAX;
            sim.config.balance_quiet_ms = 0;
            sim.quiet_since_ms = 0;
            sim.moves.clear();
            sim.moved_at.clear();
            sim.troubled.clear();
            sim.avoid.clear();
            sim.plan_balance(0, &mut Vec::new());
            let expect: BTreeMap<ChannelName, NodeId> =
                sim.moves.iter().map(|(c, m)| (c.clone(), m.to)).collect();
            let got: BTreeMap<ChannelName, NodeId> = state
                .balance_plan()
                .into_iter()
                .map(|m| (m.channel, m.to))
                .collect();
            assert_eq!(got, expect, "balance plan differs from a round on a copy");
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(300))]
            #[test]
            fn rounds_plan_what_a_full_scan_plans(steps in proptest::collection::vec(step(), 1..60)) {
                let mut w = World::new(PlannerConfig::default());
                let mut now = 1_000u64;
                for s in steps {
                    match s {
                        Step::Up(id) => w.node(id),
                        Step::Down(id) => w.kill(id),
                        Step::Put { ch, owner: o, state, epoch } => {
                            w.put(owner(o), info(&format!("c{ch}"), state, epoch, now));
                        }
                        Step::Delete { ch, owner: o } => {
                            let key = w.keys.channel(owner(o), &name(&format!("c{ch}")));
                            w.rev += 1;
                            w.state.apply_delete(&key, w.rev);
                        }
                        Step::Plan { advance_ms, apply } => {
                            now += advance_ms;
                            let mut full = w.state.clone();
                            full.attention = full.channels.keys().cloned().collect();
                            let expect = full.plan(now);
                            let got = w.state.plan(now);
                            prop_assert_eq!(&got, &expect);
                            prop_assert_eq!(&w.state.moves, &full.moves);
                            prop_assert_eq!(&w.state.avoid, &full.avoid);
                            if apply {
                                for t in &got {
                                    w.rev += 1;
                                    w.state.applied(t, w.rev);
                                }
                            }
                        }
                    }
                    check(&w.state);
                }
            }
        }
    }
}
