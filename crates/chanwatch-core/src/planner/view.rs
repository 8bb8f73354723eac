//! The planner's view of the store and its ingest.
//!
//! Just over 600 lines: decoding, ingest and the indexes it keeps in step (counts, attention)
//! change together; its tests are in `view/tests.rs`.
//!
//! Owns: decoding keys and values under the root (sessions, assignments, drain and fence
//! marks; a key that does not decode is reported, never acted on), applying PUTs, DELETEs, a
//! full relist and the planner's own committed txns, the tombstones that keep a lagging
//! watch from bringing back a deleted key, and the two indexes that keep a round cheap: the
//! attention set (channels that are not one `Watched` key under a live node) and the
//! per-node key counts. Read-only accessors for the runtime and metrics ([`Census`]).
//!
//! Must not: plan. Ingest records what the store holds (and, when the store was away, shifts
//! the clocks of moves and timeouts by as much); deciding is for the passes.

use std::collections::{BTreeMap, BTreeSet};

use crate::keys::{ChannelOwner, KeyKind};
use crate::types::{ChannelInfo, ChannelName, ChannelState, NodeId, NodeSession};
use crate::IdBlock;

use super::commands::Op;
use super::{PlannedTxn, Planner};

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
pub(super) struct Owners(Vec<Entry>);

impl Owners {
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub(super) fn values(&self) -> std::slice::Iter<'_, Entry> {
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
    pub(super) fn settled(&self) -> bool {
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
    IdName(String, IdBlock),
    Ignored,
}

impl Planner {
    fn decode(&mut self, key: &str, value: &[u8]) -> Decoded {
        let parsed = match self.keys.kind(key) {
            KeyKind::Drain => {
                // A drain mark whose node part is not an ID is reported like any other key
                // that does not decode, never silently dropped.
                self.keys
                    .parse_drain(key)
                    .map(Decoded::Drain)
                    .map_err(|e| e.to_string())
            }
            KeyKind::Fence => match self.keys.parse_fence(key) {
                Ok(id) => Ok(Decoded::Fence(id)),
                Err(_) => return Decoded::Ignored,
            },
            KeyKind::Session => self
                .keys
                .parse_session(key)
                .map_err(|e| e.to_string())
                .and_then(|id| {
                    let s = NodeSession::decode(value).map_err(|e| e.to_string())?;
                    // NodeRestriction: a session where only its block's name may write.
                    match crate::idblock::foreign(id, &s.name, &self.blocks) {
                        Some(why) => Err(format!("refused, not a node: {why}")),
                        None => Ok(Decoded::Session(id, s)),
                    }
                }),
            KeyKind::IdName => self
                .keys
                .parse_id_name(key)
                .map_err(|e| e.to_string())
                .and_then(|name| {
                    let block: IdBlock = std::str::from_utf8(value)
                        .map_err(|_| "not UTF-8".to_owned())?
                        .parse()?;
                    match self.blocks.get(&block) {
                        Some(other) if other != name => Err(format!(
                            "ID block {block} is reserved for node name {other:?} already"
                        )),
                        _ => Ok(Decoded::IdName(name.to_owned(), block)),
                    }
                }),
            KeyKind::Channel => self
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
                    Ok(Decoded::Channel(ck.owner, info))
                }),
            KeyKind::Other => return Decoded::Ignored,
        };
        match parsed {
            Ok(d) => {
                if !self.corrupt.is_empty() {
                    self.corrupt.remove(key);
                }
                d
            }
            Err(e) => {
                self.corrupt.insert(key.to_owned(), e);
                Decoded::Ignored
            }
        }
    }

    /// Applies a PUT seen in the store. Returns the decode error if the value is corrupt
    /// (the key is then reported by [`Planner::corrupt`] and left alone).
    pub fn apply_put(&mut self, key: &str, value: &[u8], mod_revision: i64) -> Option<String> {
        if self.holds_since(key, mod_revision) {
            // The echo of our own txn's put (or an older write): the value is known, no
            // need to decode it (a failover's watch brings one per moved channel).
            return None;
        }
        match self.decode(key, value) {
            Decoded::Session(id, s) => {
                let seen = self.session_revs.entry(id).or_insert(0);
                if mod_revision < *seen {
                    return None; // an older value than one a refused txn read back
                }
                *seen = mod_revision;
                let new = self.nodes.insert(id, s).is_none();
                self.disturbed |= new;
                if new {
                    self.remark(id);
                }
                None
            }
            Decoded::Drain(id) => {
                self.draining.insert(id);
                None
            }
            Decoded::IdName(name, block) => {
                // Sessions seen before are checked against it at the next full list.
                self.blocks.retain(|_, n| *n != name);
                self.blocks.insert(block, name);
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

    /// Whether `key` is an assignment the view holds at `mod_revision` or later.
    fn holds_since(&self, key: &str, mod_revision: i64) -> bool {
        if self.keys.kind(key) != KeyKind::Channel {
            return false;
        }
        let Ok(ck) = self.keys.parse_channel(key) else {
            return false;
        };
        self.channels
            .get(&ck.channel)
            .and_then(|m| m.get(&ck.owner))
            .is_some_and(|e| e.mod_revision >= mod_revision)
    }

    #[cfg(test)]
    pub(super) fn kill_for_test(&mut self, node: NodeId) {
        let key = self.keys.session(node);
        self.apply_delete(&key, i64::MAX);
    }

    /// Inserts or replaces an entry, keeping the per-node counts in step.
    fn insert_entry(&mut self, channel: ChannelName, entry: Entry) {
        let owner = entry.owner;
        let owners = self.channels.entry(channel.clone()).or_default();
        let added = (entry.info.load_weight(), entry.info.group.clone());
        let old = owners.insert(owner, entry);
        let settled = owners.settled() && alive(&self.nodes, owner);
        if let Some(old) = old {
            self.count(
                owner,
                old.info.load_weight(),
                old.info.group.as_deref(),
                false,
            );
        }
        self.count(owner, added.0, added.1.as_deref(), true);
        mark(&mut self.attention, &channel, settled);
    }

    /// Counts one key of `owner` with `weight` and `group` in (or out of) the per-node
    /// counts, group counts and weights.
    fn count(&mut self, owner: ChannelOwner, weight: u64, group: Option<&str>, add: bool) {
        let step = |c: &mut usize| {
            if add {
                *c += 1;
            } else {
                *c = c.saturating_sub(1);
            }
        };
        step(self.weights.entry(weight).or_default());
        if self.weights.get(&weight) == Some(&0) {
            self.weights.remove(&weight);
        }
        let ChannelOwner::Node(n) = owner else {
            return;
        };
        let held = self.owned.entry(n).or_default();
        step(&mut held.keys);
        held.weight = if add {
            held.weight.saturating_add(weight)
        } else {
            held.weight.saturating_sub(weight)
        };
        if let Some(g) = group {
            let groups = self.grouped.entry(n).or_default();
            match groups.get_mut(g) {
                Some(c) => step(c),
                None if add => {
                    groups.insert(g.to_owned(), 1);
                }
                None => {}
            }
            if groups.get(g) == Some(&0) {
                groups.remove(g);
            }
            if groups.is_empty() {
                self.grouped.remove(&n);
            }
        }
    }

    /// Applies a DELETE seen in the store: `key` is absent as of `revision` (the delete's
    /// revision, or a later one at which it was read absent).
    pub fn apply_delete(&mut self, key: &str, revision: i64) {
        if !self.corrupt.is_empty() {
            self.corrupt.remove(key);
        }
        let kind = self.keys.kind(key);
        if kind == KeyKind::Other {
            return;
        }
        if kind == KeyKind::Channel && self.tombstones.get(key).is_some_and(|d| *d >= revision) {
            return; // the echo of our own txn's delete: already applied
        }
        if kind == KeyKind::IdName {
            if let Ok(name) = self.keys.parse_id_name(key) {
                self.blocks.retain(|_, n| n != name);
            }
            return;
        }
        if let Ok(id) = self.keys.parse_session(key) {
            let gone = self.nodes.remove(&id).is_some();
            self.session_revs.remove(&id);
            self.disturbed |= gone;
            if gone {
                self.remark(id);
            }
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
                let removed = entries.remove(&ck.owner);
                let settled =
                    entries.settled() && entries.values().all(|e| alive(&self.nodes, e.owner));
                let empty = entries.is_empty();
                if let Some(old) = removed {
                    self.count(
                        ck.owner,
                        old.info.load_weight(),
                        old.info.group.as_deref(),
                        false,
                    );
                }
                mark(&mut self.attention, &ck.channel, settled);
                if empty {
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
        self.session_revs.clear();
        self.blocks.clear();
        self.channels.clear();
        self.owned.clear();
        self.grouped.clear();
        self.weights.clear();
        self.attention.clear();
        self.corrupt.clear();
        self.draining.clear();
        self.listing = true;
        for (key, value, rev) in kvs {
            self.apply_put(key, value, rev);
        }
        self.listing = false;
        // Channels come before sessions in key order: whether their owner lives is known
        // only now.
        let nodes = &self.nodes;
        self.attention = self
            .channels
            .iter()
            .filter(|(_, o)| !(o.settled() && o.values().all(|e| alive(nodes, e.owner))))
            .map(|(c, _)| c.clone())
            .collect();
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
        // A fence mark this leader wrote may be missing from a list read before that txn
        // committed (a stall relist asked for in the same turn as the fence): only the leader
        // removes its marks, so one it knew stays. Forgotten, the fenced node's channels moved
        // at once instead of after the fence wait, beside a node that had not yet noticed its
        // revoked lease (found by the simulation, seed 123458222: 134 ms on two nodes).
        for (node, f) in fences {
            self.fences.entry(node).or_insert(f);
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
                // The planner keeps no checkpoints in its view.
                Op::DeleteCheckpoint { .. } => {}
                Op::Put { owner, info } => {
                    self.insert_entry(
                        info.channel.clone(),
                        Entry {
                            owner: *owner,
                            info: (**info).clone(),
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

    /// The mod revision of each live node's session key as seen.
    pub fn session_revisions(&self) -> &BTreeMap<NodeId, i64> {
        &self.session_revs
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

    /// The channels that need attention, in name order (as a full scan would visit them).
    pub(super) fn unsettled(&self) -> impl Iterator<Item = (&ChannelName, &Owners)> {
        self.attention
            .iter()
            .filter_map(|c| self.channels.get_key_value(c))
    }

    /// The channels of which `node` holds a key while its session is gone, in name order:
    /// what its failover moves. O(channels needing attention): a node's death put its
    /// channels there.
    pub fn held_by_gone(&self, node: NodeId) -> Vec<ChannelName> {
        if self.nodes.contains_key(&node) || self.owned.get(&node).map_or(true, |h| h.keys == 0) {
            return Vec::new();
        }
        let owner = ChannelOwner::Node(node);
        self.unsettled()
            .filter(|(_, o)| o.values().any(|e| e.owner == owner))
            .map(|(c, _)| c.clone())
            .collect()
    }

    /// `node`'s session came or went: its channels enter or leave the attention set. One
    /// walk of every channel, and only when the node holds keys (a node that just joined
    /// holds none); a full list rebuilds the set once instead.
    fn remark(&mut self, node: NodeId) {
        if self.listing || self.owned.get(&node).map_or(true, |h| h.keys == 0) {
            return;
        }
        let owner = ChannelOwner::Node(node);
        for (channel, owners) in &self.channels {
            if owners.values().any(|e| e.owner == owner) {
                let settled = owners.settled() && alive(&self.nodes, owner);
                mark(&mut self.attention, channel, settled);
            }
        }
    }
}

/// Whether `owner` is a node with a session (`remaining` is no node).
fn alive(nodes: &BTreeMap<NodeId, NodeSession>, owner: ChannelOwner) -> bool {
    matches!(owner, ChannelOwner::Node(n) if nodes.contains_key(&n))
}

/// Keeps the attention set in step after a change to `channel`.
fn mark(attention: &mut BTreeSet<ChannelName>, channel: &ChannelName, settled: bool) {
    if settled {
        attention.remove(channel);
    } else if !attention.contains(channel) {
        attention.insert(channel.clone());
    }
}

#[cfg(test)]
mod tests;
