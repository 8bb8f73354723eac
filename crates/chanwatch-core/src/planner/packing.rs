//! Packing: a round's changes into txns within the op and byte limits of one etcd txn,
//! keeping one compare slot for the runtime's leader guard and never splitting a change; and
//! the round hint on its puts (DESIGN §2).
//!
//! Must not: reorder or drop changes; the passes decide what is in a round.

use std::collections::HashMap;

use super::commands::{Change, Op, PlannedTxn};
use super::Planner;
use crate::keys::ChannelOwner;
use crate::types::{ChannelState, NodeId, RoundHint};

impl Planner {
    /// A fresh round id for [`Planner::pack`]: the plan's Unix milliseconds, or one more than
    /// the last id when rounds come faster, so that ids stay unique across leaders too (a
    /// node keeps a round for milliseconds; a clash would only end its hold early).
    pub(super) fn round_id(&mut self, now_ms: u64) -> u64 {
        self.last_round_id = now_ms.max(self.last_round_id + 1);
        self.last_round_id
    }

    /// Packs changes into txns within the op and byte limits; one change is never split.
    /// With a `round` id, each `ToWatch` put to a node that gets more than one in these
    /// changes says how many (its [`RoundHint`]); every other put carries none (a value
    /// copied from the view may hold an older round's).
    pub(super) fn pack(&self, mut changes: Vec<Change>, round: Option<u64>) -> Vec<PlannedTxn> {
        hint_rounds(&mut changes, round);
        // One compare slot is the runtime's leader guard.
        let max_ops = self.config.max_txn_ops.saturating_sub(1).max(2);
        // Each txn's lists are sized once: grown push by push, a failover's 16 txns of 125
        // ops made ~300 reallocations, and in a process holding 1,000,000 channels each
        // one of those (glibc consolidating its free lists) cost ~0.5 ms — most of a
        // 1,000-channel failover round.
        let mut left: usize = changes.iter().map(|c| c.ops.len()).sum();
        let fresh = |left: usize| {
            let cap = left.min(max_ops);
            PlannedTxn {
                guards: Vec::with_capacity(cap),
                ops: Vec::with_capacity(cap),
                transitions: Vec::with_capacity(cap),
            }
        };
        let mut out: Vec<PlannedTxn> = Vec::with_capacity(left.div_ceil(max_ops));
        let mut cur = fresh(left);
        let mut cur_bytes = 0usize;
        for c in changes {
            let bytes: usize = c.ops.iter().map(op_bytes).sum();
            let full = cur.ops.len() + c.ops.len() > max_ops
                || cur.guards.len() + c.guards.len() > max_ops
                || (cur_bytes + bytes > self.config.max_txn_bytes && !cur.ops.is_empty());
            if full {
                out.push(std::mem::replace(&mut cur, fresh(left)));
                cur_bytes = 0;
            }
            left = left.saturating_sub(c.ops.len());
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

/// See [`Planner::pack`].
fn hint_rounds(changes: &mut [Change], round: Option<u64>) {
    let receiving = |owner: &ChannelOwner, state| match owner {
        ChannelOwner::Node(n) if state == ChannelState::ToWatch => Some(*n),
        _ => None,
    };
    let mut puts: HashMap<NodeId, u32> = HashMap::new();
    if round.is_some() {
        for op in changes.iter().flat_map(|c| &c.ops) {
            if let Op::Put { owner, info } = op {
                if let Some(n) = receiving(owner, info.state) {
                    *puts.entry(n).or_default() += 1;
                }
            }
        }
    }
    for op in changes.iter_mut().flat_map(|c| &mut c.ops) {
        if let Op::Put { owner, info } = op {
            info.round = match (round, receiving(owner, info.state)) {
                (Some(id), Some(n)) => puts
                    .get(&n)
                    .filter(|&&k| k > 1)
                    .map(|&puts| RoundHint { id, puts }),
                _ => None,
            };
        }
    }
}

/// Joins txns produced for one admin request (removal of a channel with duplicates).
pub(super) fn merge(txns: Vec<PlannedTxn>) -> PlannedTxn {
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
        Op::Put { info, .. } => info.encoded_len() + 300,
        Op::Delete { .. }
        | Op::DeleteCheckpoint { .. }
        | Op::Drain { .. }
        | Op::Undrain { .. }
        | Op::Fence { .. }
        | Op::Unfence { .. } => 300,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use crate::keys::ChannelOwner;
    use crate::planner::commands::Op;
    use crate::planner::tests::{info, n, World};
    use crate::planner::*;
    use crate::types::{ChannelState, RoundHint};

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
    fn each_put_says_how_many_the_round_writes_to_its_node() {
        let mut w = World::new(PlannerConfig::default());
        for id in 1..=4 {
            w.node(id);
        }
        // Node 1 holds five channels, node 2 one; both die.
        for i in 0..5 {
            w.put(n(1), info(&format!("c{i}"), ChannelState::Watched, 1, 0));
        }
        w.put(n(2), info("solo", ChannelState::Watched, 1, 0));
        w.kill(1);
        w.kill(2);
        let txns = w.state.plan(1_000);
        let puts: Vec<(ChannelOwner, Option<RoundHint>)> = txns
            .iter()
            .flat_map(|t| &t.ops)
            .filter_map(|op| match op {
                Op::Put { owner, info } => Some((*owner, info.round)),
                _ => None,
            })
            .collect();
        assert_eq!(puts.len(), 6, "{puts:?}");
        let mut per_node: BTreeMap<ChannelOwner, u32> = BTreeMap::new();
        for (owner, _) in &puts {
            *per_node.entry(*owner).or_default() += 1;
        }
        let ids: BTreeSet<u64> = puts.iter().filter_map(|(_, r)| r.map(|r| r.id)).collect();
        assert_eq!(ids.len(), 1, "one id per round: {puts:?}");
        for (owner, round) in &puts {
            let k = per_node[owner];
            assert_eq!(
                round.map(|r| r.puts),
                (k > 1).then_some(k),
                "{owner:?}: {puts:?}"
            );
        }
        // The next round gets another id; an admin move's put carries none, though it is
        // copied from a value (the view's, as applied) that had one.
        for t in &txns {
            w.rev += 1;
            w.state.applied(t, w.rev);
        }
        assert!(!ids.contains(&w.state.round_id(1_000)));
        let (owner, _, _) = w.owner_of("c0");
        let to = if owner == n(3) { 4 } else { 3 };
        let moved = w.move_to("c0", to);
        assert!(moved
            .ops
            .iter()
            .all(|op| !matches!(op, Op::Put { info, .. } if info.round.is_some())));
    }
}
