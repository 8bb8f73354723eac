//! Packing: a round's changes into txns within the op and byte limits of one etcd txn,
//! keeping one compare slot for the runtime's leader guard and never splitting a change.
//!
//! Must not: reorder or drop changes; the passes decide what is in a round.

use super::commands::{Change, Op, PlannedTxn};
use super::Planner;

impl Planner {
    /// Packs changes into txns within the op and byte limits; one change is never split.
    pub(super) fn pack(&self, changes: Vec<Change>) -> Vec<PlannedTxn> {
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
    use crate::planner::tests::{info, n, World};
    use crate::planner::*;
    use crate::types::ChannelState;

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
}
