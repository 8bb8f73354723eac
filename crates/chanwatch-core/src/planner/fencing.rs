//! Fencing: a node that sat on a `ToRelease` past the release timeout may be blind (a
//! stalled watch) and still running the channel, so instead of moving the channel beside it
//! the leader writes a fence mark `coord/fence/{id}` and asks the runtime to revoke the
//! node's session lease; the node's channels move only `fence_wait_ms` after its session is
//! seen gone, when it has surely fenced itself (DESIGN.md §3).
//!
//! Owns: what this leader knows of each mark ([`Fence`]), the revoke requests for the runtime
//! ([`Planner::take_fence_requests`]), re-asking a revoke that did not take, and removing a
//! mark once its node is gone, held long enough and owns nothing.
//!
//! Must not: move channels; the release pass asks for a fence, the repair pass honours it.

use super::commands::{Change, Op};
use super::Planner;
use crate::types::NodeId;

/// What this leader knows of a fence mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Fence {
    /// When this leader last asked the runtime to revoke the lease (`None`: not yet).
    requested_ms: Option<u64>,
    /// When this leader first planned with the node's session gone (`None`: alive, or not
    /// planned since). A revoke happens before the session vanishes, so holding the
    /// channels `fence_wait_ms` from here is never too short, whoever revoked.
    gone_ms: Option<u64>,
}

impl Fence {
    /// Until when a fenced node's channels stay where they are.
    pub(super) fn hold_until(&self, wait_ms: u64) -> u64 {
        self.gone_ms.map_or(u64::MAX, |g| g.saturating_add(wait_ms))
    }
}

impl Planner {
    /// Nodes whose session lease the runtime must revoke now: their fence mark has landed
    /// (see [`PlannerConfig::release_timeout_ms`]). A node still alive a second after a
    /// request is asked for again (a revoke that failed).
    ///
    /// [`PlannerConfig::release_timeout_ms`]: crate::planner::PlannerConfig::release_timeout_ms
    pub fn take_fence_requests(&mut self) -> Vec<NodeId> {
        std::mem::take(&mut self.fence_requests)
    }

    /// Nodes with a fence mark (for status and tests).
    pub fn fencing(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.fences.keys().copied()
    }

    /// Dates the fenced nodes seen gone, asks again for revokes that did not take, and
    /// removes the marks of nodes that are gone, held long enough and own nothing.
    pub(super) fn plan_fences(&mut self, now_ms: u64, changes: &mut Vec<Change>) {
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
            let owns = self.owned.get(node).is_some_and(|h| h.keys > 0);
            if gone.saturating_add(wait) <= now_ms && !owns {
                changes.push(Change {
                    guards: Vec::new(),
                    ops: vec![Op::Unfence { node: *node }],
                    transition: None,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::tests::{info, n, name, World};
    use crate::planner::*;
    use crate::types::{ChannelState, Epoch, NodeId, VChannelInfo};

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
        w.move_to("a", 2);
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

    /// A fence mark this leader wrote survives a full list read before that txn committed
    /// (the list lacks the mark): the fenced node's channels still wait `fence_wait_ms`
    /// after its session is gone. Forgotten, they moved at once, beside a node that had not
    /// yet noticed its revoked lease (simulation seed 123458222).
    #[test]
    fn a_fence_mark_survives_a_list_older_than_its_txn() {
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
        w.move_to("a", 2);
        let txns = w.settle(1_500);
        assert_eq!(txns[0].ops, vec![Op::Fence { node: NodeId(1) }]);
        // A list from before the fence txn, with node 1's session already gone.
        let a = info("a", ChannelState::ToRelease, 1, 0).encode();
        let b = info("b", ChannelState::Watched, 1, 0).encode();
        let s2 = {
            let mut s = crate::types::NodeSession {
                id: NodeId(2),
                admin_addr: String::new(),
                version: "t".into(),
                started_at_ms: 0,
                capacity: 0,
                name: String::new(),
                extra: Default::default(),
            };
            s.capacity = 1;
            s.encode()
        };
        let (ka, kb, k2) = (
            w.keys.channel(n(1), &name("a")),
            w.keys.channel(n(1), &name("b")),
            w.keys.session(NodeId(2)),
        );
        w.state.reset([
            (ka.as_str(), a.as_slice(), 3),
            (kb.as_str(), b.as_slice(), 4),
            (k2.as_str(), s2.as_slice(), 2),
        ]);
        assert_eq!(w.state.fencing().collect::<Vec<_>>(), vec![NodeId(1)]);
        assert!(
            w.settle(2_000).is_empty(),
            "node 1 may still run its channels"
        );
        assert!(w.settle(4_900).is_empty());
        w.settle(5_000);
        assert_eq!(w.owner_of("b").0, n(2));
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
}
