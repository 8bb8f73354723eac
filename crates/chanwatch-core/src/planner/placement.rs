//! Placement: where a channel may go.
//!
//! Owns: [`Loads`], the one place load arithmetic happens (channels per node, counting moves
//! in flight at their target; the least loaded and the busiest node, ties to the lowest ID);
//! which nodes are assignable (alive, not draining, not fenced); the per-channel back-offs
//! of nodes that failed a channel; what balance may move where; and the balance move picker
//! shared by the balance pass and the dry-run plan.
//!
//! Must not: build changes or touch the memory of moves; the passes do, with what it picks.

use std::collections::{btree_map, BTreeMap};

use serde::{Deserialize, Serialize};

use crate::keys::ChannelOwner;
use crate::types::{ChannelName, ChannelState, NodeId};

use super::{Planner, PlannerBug};

/// Channels per node, as placement counts them. Every pass that places channels takes one
/// ([`Planner::loads`]) and counts each channel it places with `Loads::add`, so the next
/// choice in the same pass sees it.
///
/// It tracks the nodes it was made with; a change naming another node is ignored, since a
/// node it does not track is never a target. Iterates in node ID order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Loads(BTreeMap<NodeId, usize>);

impl Loads {
    /// Channels on `node` (0 for a node not tracked).
    pub fn get(&self, node: NodeId) -> usize {
        self.0.get(&node).copied().unwrap_or(0)
    }

    /// Each tracked node with its load, in node ID order.
    pub fn iter(&self) -> impl Iterator<Item = (NodeId, usize)> + '_ {
        self.0.iter().map(|(n, l)| (*n, *l))
    }

    /// The loads alone, in node ID order.
    pub fn values(&self) -> btree_map::Values<'_, NodeId, usize> {
        self.0.values()
    }

    /// Number of tracked nodes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no node is tracked.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Max − min load (0 without nodes): balanced when at most 1.
    pub fn spread(&self) -> usize {
        self.0.values().max().unwrap_or(&0) - self.0.values().min().unwrap_or(&0)
    }

    /// One channel more on `node`.
    pub(super) fn add(&mut self, node: NodeId) {
        if let Some(l) = self.0.get_mut(&node) {
            *l += 1;
        }
    }

    /// One channel fewer on `node`, never below zero.
    pub(super) fn remove(&mut self, node: NodeId) {
        if let Some(l) = self.0.get_mut(&node) {
            *l = l.saturating_sub(1);
        }
    }

    /// Stops tracking the nodes `keep` refuses.
    pub(super) fn retain(&mut self, keep: impl Fn(NodeId) -> bool) {
        self.0.retain(|n, _| keep(*n));
    }

    /// The least loaded of `candidates` (an untracked one counts 0), ties to the lowest ID.
    pub(super) fn least_loaded(&self, candidates: impl Iterator<Item = NodeId>) -> Option<NodeId> {
        candidates.min_by_key(|n| (self.get(*n), *n))
    }

    /// The least loaded tracked node and its load, ties to the lowest ID.
    fn lightest(&self) -> Option<(NodeId, usize)> {
        self.iter().min_by_key(|(n, l)| (*l, *n))
    }

    /// The busiest tracked node and its load, ties to the lowest ID.
    fn busiest(&self) -> Option<(NodeId, usize)> {
        self.iter().max_by_key(|(n, l)| (*l, std::cmp::Reverse(*n)))
    }
}

impl FromIterator<(NodeId, usize)> for Loads {
    fn from_iter<I: IntoIterator<Item = (NodeId, usize)>>(iter: I) -> Self {
        Loads(iter.into_iter().collect())
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

impl Planner {
    /// Channels per live node, counting moves in flight at their target (and not at their
    /// source): what a pass places against. O(nodes + moves in flight).
    pub fn loads(&self) -> Loads {
        let mut loads: Loads = self.nodes.keys().map(|&n| (n, self.keys_of(n))).collect();
        for (channel, m) in &self.moves {
            if let Some(ChannelOwner::Node(from)) = self.entry(channel).map(|e| e.owner) {
                loads.remove(from);
            }
            loads.add(m.to);
        }
        loads
    }

    /// The keys each assignable node holds now, as if no move were in flight: what the
    /// dry-run balance plan starts from.
    pub(super) fn held_loads(&self) -> Loads {
        self.assignable().map(|n| (n, self.keys_of(n))).collect()
    }

    /// Assignment keys under `node`.
    fn keys_of(&self, node: NodeId) -> usize {
        self.owned.get(&node).copied().unwrap_or(0)
    }

    /// Nodes that may take a channel: alive, not draining, not being fenced.
    pub(super) fn assignable(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes.keys().copied().filter(|n| self.takes_new(*n))
    }

    /// Whether `node`, if alive, may take a channel: not draining, not being fenced.
    pub(super) fn takes_new(&self, node: NodeId) -> bool {
        !self.draining.contains(&node) && !self.fences.contains_key(&node) && !self.is_leaving(node)
    }

    /// Least-loaded assignable node, ties by ID, skipping `avoid`.
    pub(super) fn least_loaded(&self, loads: &Loads, avoid: Option<NodeId>) -> Option<NodeId> {
        loads.least_loaded(self.assignable().filter(|n| Some(*n) != avoid))
    }

    /// Whether `node` is still in its back-off for `channel`.
    pub(super) fn avoided(&self, channel: &ChannelName, node: NodeId, now_ms: u64) -> bool {
        self.avoid
            .get(channel)
            .and_then(|nodes| nodes.get(&node))
            .is_some_and(|until| *until > now_ms)
    }

    /// Least-loaded assignable node for `channel` that is not in a back-off for it and is
    /// not `not`.
    pub(super) fn least_loaded_for(
        &self,
        loads: &Loads,
        channel: &ChannelName,
        not: Option<NodeId>,
        now_ms: u64,
    ) -> Option<NodeId> {
        loads.least_loaded(
            self.assignable()
                .filter(|n| Some(*n) != not && !self.avoided(channel, *n, now_ms)),
        )
    }

    /// Whether balance may move `channel` to `to` now: not onto a node in a back-off for the
    /// channel or one that failed any channel lately, and not a channel in its cool-down.
    pub(super) fn balance_allows(&self, channel: &ChannelName, to: NodeId, now_ms: u64) -> bool {
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

    /// `Watched` channels with one key, per live node, in name order; `idle_only` leaves
    /// out channels with a move in flight.
    pub(super) fn movable(&self, idle_only: bool) -> BTreeMap<NodeId, Vec<ChannelName>> {
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
}

/// Up to `budget` moves, each of the last movable channel of the busiest node (ties: lowest
/// ID) to the least loaded one (ties: lowest ID), until max − min ≤ 1 or the busiest node
/// has nothing movable. `loads` ends as it would after the moves.
pub(super) fn pick_moves(
    loads: &mut Loads,
    movable: &mut BTreeMap<NodeId, Vec<ChannelName>>,
    budget: usize,
    allowed: impl Fn(&ChannelName, NodeId) -> bool,
) -> Vec<PlannedMove> {
    let mut out = Vec::new();
    while out.len() < budget {
        let Some((max_node, max)) = loads.busiest() else {
            break;
        };
        let Some((min_node, min)) = loads.lightest() else {
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
        loads.remove(max_node);
        loads.add(min_node);
        out.push(PlannedMove {
            channel,
            from: max_node,
            to: min_node,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::tests::{info, n, World};
    use crate::planner::PlannerConfig;

    fn loads(l: &[(u64, usize)]) -> Loads {
        l.iter().map(|&(n, l)| (NodeId(n), l)).collect()
    }

    #[test]
    fn ties_go_to_the_lowest_node_id_both_ways() {
        let l = loads(&[(3, 2), (1, 5), (2, 2), (4, 5)]);
        assert_eq!(l.lightest(), Some((NodeId(2), 2)));
        assert_eq!(l.busiest(), Some((NodeId(1), 5)));
        assert_eq!(
            l.least_loaded([4, 3, 2].map(NodeId).into_iter()),
            Some(NodeId(2))
        );
        assert_eq!(l.spread(), 3);
        assert_eq!(Loads::default().spread(), 0);
        assert_eq!(Loads::default().busiest(), None);
    }

    #[test]
    fn only_tracked_nodes_change_and_none_goes_below_zero() {
        let mut l = loads(&[(1, 0), (2, 1)]);
        l.add(NodeId(9));
        l.remove(NodeId(1));
        l.add(NodeId(2));
        assert_eq!(l, loads(&[(1, 0), (2, 2)]));
        // An untracked candidate counts as empty.
        assert_eq!(
            l.least_loaded([2, 9].map(NodeId).into_iter()),
            Some(NodeId(9))
        );
        l.retain(|n| n != NodeId(1));
        assert_eq!(l, loads(&[(2, 2)]));
    }

    #[test]
    fn loads_count_a_move_in_flight_at_its_target_not_its_source() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.node(2);
        w.put(n(1), info("a", ChannelState::Watched, 1, 0));
        w.put(n(1), info("b", ChannelState::Watched, 1, 0));
        assert_eq!(w.state.loads(), loads(&[(1, 2), (2, 0)]));
        w.move_to("a", 2);
        assert_eq!(w.state.loads(), loads(&[(1, 1), (2, 1)]));
        // The dry-run plan counts the keys held, as if nothing were moving.
        assert_eq!(w.state.held_loads(), loads(&[(1, 2), (2, 0)]));
    }
}
