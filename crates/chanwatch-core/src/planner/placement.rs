//! Placement: where a channel may go (DESIGN §5, placement v2).
//!
//! Owns: [`Loads`], the one place load arithmetic happens — a node's load is the sum of its
//! channels' weights over its capacity, compared exactly as fractions, counting moves in
//! flight at their target; the least-loaded choice (after adding the channel, then fewer
//! channels of its group, then the lowest ID); the `--max-load` cap; which nodes are
//! assignable (alive, not draining, not fenced); the per-channel back-offs of nodes that
//! failed a channel; what balance may move where (never a pinned channel); the balance goal
//! (spread within one channel's weight by capacity) and the move picker shared by the
//! balance pass and the dry-run plan.
//!
//! Must not: build changes or touch the memory of moves; the passes do, with what it picks.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::keys::ChannelOwner;
use crate::types::{ChannelInfo, ChannelName, ChannelState, NodeId};

use super::Planner;
#[cfg(feature = "planted-bugs")]
use super::PlannerBug;

/// A load: `weight / capacity`, compared exactly (cross-multiplied, never as a float).
#[derive(Debug, Clone, Copy, Default)]
pub struct Load {
    /// Sum of the weights of the node's channels.
    pub weight: u64,
    /// The node's capacity (at least 1).
    pub capacity: u64,
}

impl Load {
    /// The load as a float, for display and metrics only.
    pub fn value(&self) -> f64 {
        self.weight as f64 / self.capacity.max(1) as f64
    }

    /// This load with `w` more weight.
    pub(super) fn plus(self, w: u64) -> Load {
        Load {
            weight: self.weight.saturating_add(w),
            capacity: self.capacity,
        }
    }

    /// Whether `self - other <= w / c` (the spread between two loads is within one weight
    /// `w` over one capacity `c`): the balance goal (invariant 5), exactly.
    pub fn within(self, other: Load, w: u64, c: u64) -> bool {
        // a/b - x/y <= w/c  <=>  (a*y - x*b) * c <= w * b * y, all positive but the first.
        let (a, b) = (i128::from(self.weight), i128::from(self.capacity.max(1)));
        let (x, y) = (i128::from(other.weight), i128::from(other.capacity.max(1)));
        (a * y - x * b) * i128::from(c.max(1)) <= i128::from(w) * b * y
    }
}

impl PartialEq for Load {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Load {}

impl PartialOrd for Load {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Load {
    fn cmp(&self, other: &Self) -> Ordering {
        let l = u128::from(self.weight) * u128::from(other.capacity.max(1));
        let r = u128::from(other.weight) * u128::from(self.capacity.max(1));
        l.cmp(&r)
    }
}

/// The `--max-load` cap, in thousandths: a node may hold channels of total weight `w` at
/// capacity `c` only while `w * 1000 <= milli * c`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxLoad {
    /// The cap times 1000.
    pub milli: u64,
}

impl MaxLoad {
    /// The cap from its decimal value (as given to `--max-load`), rounded down to
    /// thousandths; `None` for a value that is not a positive finite number.
    pub fn from_f64(x: f64) -> Option<MaxLoad> {
        (x.is_finite() && x > 0.0).then(|| MaxLoad {
            milli: (x * 1000.0).floor() as u64,
        })
    }

    /// Whether a node at `load` may hold it.
    pub fn allows(self, load: Load) -> bool {
        u128::from(load.weight) * 1000 <= u128::from(self.milli) * u128::from(load.capacity.max(1))
    }
}

impl std::fmt::Display for MaxLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.milli % 1000 == 0 {
            write!(f, "{}.0", self.milli / 1000)
        } else {
            write!(f, "{}", self.milli as f64 / 1000.0)
        }
    }
}

/// What placement needs to know of a channel: its weight and group.
#[derive(Debug, Clone, Copy)]
pub struct Want<'a> {
    /// Its weight (at least 1).
    pub weight: u64,
    /// Its group, if any.
    pub group: Option<&'a str>,
}

impl<'a> Want<'a> {
    /// What `info` asks of placement.
    pub fn of(info: &'a ChannelInfo) -> Self {
        Want {
            weight: info.load_weight(),
            group: info.group.as_deref(),
        }
    }
}

/// One node's load as placement counts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Slot {
    load: Load,
    channels: usize,
    /// The node may take a channel (not draining, fenced or leaving), decided once when
    /// the loads are taken: a failover places each of its channels against every node,
    /// and asking the view per node per channel was ~1,000,000 lookups at 1,000 nodes.
    open: bool,
}

/// Loads per node, as placement counts them. Every pass that places channels takes one
/// ([`Planner::loads`]) and counts each channel it places with `Loads::add`, so the next
/// choice in the same pass sees it (its weight, and its group).
///
/// It tracks the nodes it was made with; a change naming another node is ignored, since a
/// node it does not track is never a target. Iterates in node ID order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Loads {
    nodes: BTreeMap<NodeId, Slot>,
    /// Channels of a group placed on a node by this pass, on top of the view's counts.
    placed: BTreeMap<NodeId, BTreeMap<String, usize>>,
}

impl Loads {
    /// The load of `node` (0 over capacity 1 for a node not tracked).
    pub fn get(&self, node: NodeId) -> Load {
        self.nodes.get(&node).map_or(
            Load {
                weight: 0,
                capacity: 1,
            },
            |s| s.load,
        )
    }

    /// Channels counted on `node` (0 for a node not tracked).
    pub fn channels(&self, node: NodeId) -> usize {
        self.nodes.get(&node).map_or(0, |s| s.channels)
    }

    /// Each tracked node with its load, in node ID order.
    pub fn iter(&self) -> impl Iterator<Item = (NodeId, Load)> + '_ {
        self.nodes.iter().map(|(n, s)| (*n, s.load))
    }

    /// Number of tracked nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether no node is tracked.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Starts tracking `node` with `channels` channels of total `weight` over `capacity`.
    pub(super) fn track(&mut self, node: NodeId, channels: usize, weight: u64, capacity: u64) {
        self.nodes.insert(
            node,
            Slot {
                load: Load {
                    weight,
                    capacity: capacity.max(1),
                },
                channels,
                open: true,
            },
        );
    }

    /// `node` takes no new channel (it still counts for balance and spread).
    pub(super) fn close(&mut self, node: NodeId) {
        if let Some(s) = self.nodes.get_mut(&node) {
            s.open = false;
        }
    }

    /// Whether the spread (max − min load) is within one channel of weight `w` on the
    /// smallest capacity tracked: the balance goal (DESIGN §5, invariant 5). True without
    /// nodes.
    pub fn balanced(&self, w: u64) -> bool {
        let (Some((_, max)), Some((_, min))) = (self.busiest(), self.lightest()) else {
            return true;
        };
        max.within(min, w, self.min_capacity())
    }

    /// The smallest capacity tracked (1 without nodes).
    pub fn min_capacity(&self) -> u64 {
        self.nodes
            .values()
            .map(|s| s.load.capacity)
            .min()
            .unwrap_or(1)
    }

    /// A channel `want` more on `node`.
    pub(super) fn add(&mut self, node: NodeId, want: Want<'_>) {
        if let Some(s) = self.nodes.get_mut(&node) {
            s.load.weight = s.load.weight.saturating_add(want.weight);
            s.channels += 1;
            if let Some(g) = want.group {
                let groups = self.placed.entry(node).or_default();
                match groups.get_mut(g) {
                    Some(c) => *c += 1,
                    None => {
                        groups.insert(g.to_owned(), 1);
                    }
                }
            }
        }
    }

    /// A channel of `weight` fewer on `node`, never below zero.
    pub(super) fn remove(&mut self, node: NodeId, weight: u64) {
        if let Some(s) = self.nodes.get_mut(&node) {
            s.load.weight = s.load.weight.saturating_sub(weight);
            s.channels = s.channels.saturating_sub(1);
        }
    }

    /// Stops tracking the nodes `keep` refuses.
    pub(super) fn retain(&mut self, keep: impl Fn(NodeId) -> bool) {
        self.nodes.retain(|n, _| keep(*n));
    }

    /// Channels of `group` this pass placed on `node`.
    fn placed(&self, node: NodeId, group: &str) -> usize {
        self.placed
            .get(&node)
            .and_then(|g| g.get(group))
            .copied()
            .unwrap_or(0)
    }

    /// The least loaded tracked node and its load, ties to the lowest ID.
    pub(super) fn lightest(&self) -> Option<(NodeId, Load)> {
        self.iter().min_by(|a, b| a.1.cmp(&b.1).then(a.0.cmp(&b.0)))
    }

    /// The busiest tracked node and its load, ties to the lowest ID.
    pub(super) fn busiest(&self) -> Option<(NodeId, Load)> {
        self.iter().min_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)))
    }

    /// Tracked nodes from the busiest down, ties to the lowest ID.
    pub(super) fn by_load_desc(&self) -> Vec<(NodeId, Load)> {
        let mut v: Vec<(NodeId, Load)> = self.iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    }
}

/// One row of a balance plan: move `channel` from `from` to `to`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedMove {
    /// The channel.
    pub channel: ChannelName,
    /// Its node now.
    pub from: NodeId,
    /// Where it goes.
    pub to: NodeId,
}

/// A channel balance may move: its name and weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Movable {
    pub(super) channel: ChannelName,
    pub(super) weight: u64,
}

impl Planner {
    /// Loads of live nodes, counting moves in flight at their target (and not at their
    /// source): what a pass places against. O(nodes + moves in flight).
    pub fn loads(&self) -> Loads {
        let mut loads = Loads::default();
        for (n, s) in &self.nodes {
            let held = self.owned.get(n).copied().unwrap_or_default();
            loads.track(*n, held.keys, held.weight, s.load_capacity());
            if !self.takes_new(*n) {
                loads.close(*n);
            }
        }
        for (channel, m) in &self.moves {
            let Some(e) = self.entry(channel) else {
                continue;
            };
            let w = e.info.load_weight();
            if let ChannelOwner::Node(from) = e.owner {
                loads.remove(from, w);
            }
            loads.add(
                m.to,
                Want {
                    weight: w,
                    group: None,
                },
            );
        }
        loads
    }

    /// The loads each assignable node holds now, as if no move were in flight: what the
    /// dry-run balance plan starts from.
    pub(super) fn held_loads(&self) -> Loads {
        let mut loads = Loads::default();
        for n in self.assignable() {
            let held = self.owned.get(&n).copied().unwrap_or_default();
            let cap = self.nodes.get(&n).map_or(1, |s| s.load_capacity());
            loads.track(n, held.keys, held.weight, cap);
        }
        loads
    }

    /// The heaviest registered channel's weight (1 without channels): the balance goal's
    /// unit (spread within one channel's weight by capacity).
    pub fn heaviest_weight(&self) -> u64 {
        self.weights.keys().next_back().copied().unwrap_or(1)
    }

    /// Nodes that may take a channel: alive, not draining, not being fenced.
    pub(super) fn assignable(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes.keys().copied().filter(|n| self.takes_new(*n))
    }

    /// Whether `node`, if alive, may take a channel: not draining, not being fenced.
    pub(super) fn takes_new(&self, node: NodeId) -> bool {
        !self.draining.contains(&node) && !self.fences.contains_key(&node) && !self.is_leaving(node)
    }

    /// Whether `node` has room for `want` under `--max-load` (always without a cap).
    pub(super) fn fits(&self, loads: &Loads, node: NodeId, want: Want<'_>) -> bool {
        self.room_for(loads.get(node).plus(want.weight))
    }

    /// Whether a node may reach load `after` under `--max-load` (always without a cap).
    fn room_for(&self, after: Load) -> bool {
        self.config.max_load.map_or(true, |m| m.allows(after))
    }

    /// Channels of `group` on `node`: held keys, plus those this pass placed there.
    fn in_group(&self, loads: &Loads, node: NodeId, group: Option<&str>) -> usize {
        let Some(g) = group else { return 0 };
        let held = self
            .grouped
            .get(&node)
            .and_then(|m| m.get(g))
            .copied()
            .unwrap_or(0);
        held + loads.placed(node, g)
    }

    /// The best node of `loads` that takes new channels, is not `not` and is not in a
    /// back-off of `avoid` (a channel's back-offs) for `want`: the least loaded after
    /// adding it, then fewer channels of its group, then the lowest ID; only nodes with
    /// room under `--max-load`. One walk of the loads, no lookup per node.
    fn best(
        &self,
        loads: &Loads,
        want: Want<'_>,
        not: Option<NodeId>,
        avoid: Option<(&BTreeMap<NodeId, u64>, u64)>,
    ) -> Option<NodeId> {
        loads
            .nodes
            .iter()
            .filter(|(n, s)| {
                s.open
                    && Some(**n) != not
                    && !avoid.is_some_and(|(a, now_ms)| in_backoff(a, **n, now_ms))
            })
            .map(|(n, s)| (*n, s.load.plus(want.weight)))
            .filter(|(_, after)| self.room_for(*after))
            .map(|(n, after)| (after, self.in_group(loads, n, want.group), n))
            .min()
            .map(|(_, _, n)| n)
    }

    /// The best assignable node for `want` with room for it, skipping `not`; back-offs
    /// are not looked at (a failover's fallback).
    pub(super) fn least_loaded(
        &self,
        loads: &Loads,
        want: Want<'_>,
        not: Option<NodeId>,
    ) -> Option<NodeId> {
        self.best(loads, want, not, None)
    }

    /// Whether `node` is still in its back-off for `channel`.
    pub(super) fn avoided(&self, channel: &ChannelName, node: NodeId, now_ms: u64) -> bool {
        self.avoid
            .get(channel)
            .is_some_and(|nodes| in_backoff(nodes, node, now_ms))
    }

    /// The best assignable node for `channel` (`want`) with room for it, not in a back-off
    /// for it and not `not`.
    pub(super) fn least_loaded_for(
        &self,
        loads: &Loads,
        channel: &ChannelName,
        want: Want<'_>,
        not: Option<NodeId>,
        now_ms: u64,
    ) -> Option<NodeId> {
        let avoid = self.avoid.get(channel).map(|a| (a, now_ms));
        self.best(loads, want, not, avoid)
    }

    /// Why a channel of `want` goes (or stays) under `remaining`: no live node, or none
    /// with room under `--max-load`.
    pub(super) fn no_room(&self, want: Want<'_>) -> String {
        match self.config.max_load {
            Some(m) if self.assignable().next().is_some() => format!(
                "no node has room under --max-load {m} (weight {})",
                want.weight
            ),
            _ => "no live node can take it".to_owned(),
        }
    }

    /// Why `channel` (`want`) can go nowhere now: every node with room for it is in its
    /// back-off for it (until when), or no node has room.
    pub(super) fn nowhere(
        &self,
        loads: &Loads,
        channel: &ChannelName,
        want: Want<'_>,
        now_ms: u64,
    ) -> String {
        match self.least_loaded(loads, want, None) {
            Some(n) => {
                let until = self
                    .avoid
                    .get(channel)
                    .and_then(|a| a.get(&n))
                    .copied()
                    .unwrap_or(now_ms);
                format!(
                    "every node with room failed it lately; it waits out their back-off (node {n} for {} ms more)",
                    until.saturating_sub(now_ms)
                )
            }
            None => self.no_room(want),
        }
    }

    /// Whether balance may move `channel` to `to` now: not onto a node in a back-off for the
    /// channel or one that failed any channel lately, and not a channel in its cool-down.
    pub(super) fn balance_allows(&self, channel: &ChannelName, to: NodeId, now_ms: u64) -> bool {
        #[cfg(feature = "planted-bugs")]
        if self.config.planted(PlannerBug::BalanceIgnoresBackoff) {
            return true;
        }
        !self.avoided(channel, to, now_ms)
            && !self.troubled.get(&to).is_some_and(|until| *until > now_ms)
            && !self
                .moved_at
                .get(channel)
                .is_some_and(|t| *t + self.config.move_cooldown_ms > now_ms)
    }

    /// `Watched`, unpinned channels with one key, per live node, in name order;
    /// `idle_only` leaves out channels with a move in flight.
    pub(super) fn movable(&self, idle_only: bool) -> BTreeMap<NodeId, Vec<Movable>> {
        let mut movable: BTreeMap<NodeId, Vec<Movable>> = BTreeMap::new();
        for (channel, entries) in &self.channels {
            if entries.len() != 1 || (idle_only && self.moves.contains_key(channel)) {
                continue;
            }
            let Some(e) = entries.values().next() else {
                continue;
            };
            if e.info.pinned {
                continue;
            }
            if let (ChannelOwner::Node(n), ChannelState::Watched) = (e.owner, e.info.state) {
                movable.entry(n).or_default().push(Movable {
                    channel: channel.clone(),
                    weight: e.info.load_weight(),
                });
            }
        }
        movable
    }
}

/// Whether `node` is still in one of a channel's back-offs (`avoid`: node → until).
fn in_backoff(avoid: &BTreeMap<NodeId, u64>, node: NodeId, now_ms: u64) -> bool {
    avoid.get(&node).is_some_and(|until| *until > now_ms)
}

mod pick;
pub(super) use pick::pick_moves;

#[cfg(test)]
mod tests;
