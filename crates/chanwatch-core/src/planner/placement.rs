//! Placement: where a channel may go.
//!
//! Owns: [`Loads`], the one place load arithmetic happens (channels per node, counting moves
//! in flight at their target); which nodes are assignable (alive, not draining, not fenced);
//! the least-loaded choice with its tie-break (lowest ID); the per-channel back-offs of nodes
//! that failed a channel; what balance may move where; and the balance move picker shared by
//! the balance pass and the dry-run plan.
//!
//! Must not: build changes or touch the memory of moves; the passes do, with what it picks.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::keys::ChannelOwner;
use crate::types::{ChannelName, ChannelState, NodeId};

use super::{Planner, PlannerBug};

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

impl Planner {
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

    pub(super) fn assignable(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes
            .keys()
            .copied()
            .filter(|n| !self.draining.contains(n) && !self.fences.contains_key(n))
    }

    /// Least-loaded assignable node, ties by ID, skipping `avoid`.
    pub(super) fn least_loaded(
        &self,
        loads: &BTreeMap<NodeId, usize>,
        avoid: Option<NodeId>,
    ) -> Option<NodeId> {
        self.assignable()
            .filter(|n| Some(*n) != avoid)
            .min_by_key(|n| (loads.get(n).copied().unwrap_or(0), *n))
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
        loads: &BTreeMap<NodeId, usize>,
        channel: &ChannelName,
        not: Option<NodeId>,
        now_ms: u64,
    ) -> Option<NodeId> {
        self.assignable()
            .filter(|n| Some(*n) != not && !self.avoided(channel, *n, now_ms))
            .min_by_key(|n| (loads.get(n).copied().unwrap_or(0), *n))
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

/// Max − min load.
pub(super) fn spread(loads: &BTreeMap<NodeId, usize>) -> usize {
    loads.values().max().unwrap_or(&0) - loads.values().min().unwrap_or(&0)
}

/// Up to `budget` moves, each of the last movable channel of the busiest node (ties: lowest
/// ID) to the least loaded one (ties: lowest ID), until max − min ≤ 1 or the busiest node
/// has nothing movable. `loads` ends as it would after the moves.
pub(super) fn pick_moves(
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
