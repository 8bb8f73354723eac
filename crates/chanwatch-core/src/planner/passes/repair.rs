//! Repair passes: a channel with two keys keeps the highest epoch (`plan_dedupe`); the
//! channels of a node whose session is gone go to live nodes, or under `remaining` when none
//! lives, and parked ones come back when a node appears (`plan_orphans`), except the
//! channels of a node being fenced, held until it has surely stopped them.
//!
//! Must not: start moves of live nodes' channels.

use crate::keys::ChannelOwner;

use super::super::commands::{guard, park, reassign, Cause, Change, Op, Transition};
use super::super::placement::Want;
use super::super::Planner;

impl Planner {
    /// More than one key for a channel: keep the highest epoch.
    pub(super) fn plan_dedupe(&self, changes: &mut Vec<Change>) {
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
    pub(super) fn plan_orphans(&mut self, now_ms: u64, changes: &mut Vec<Change>) {
        let mut loads = self.loads();
        let mut planned = Vec::new();
        // A dead node's channels are in the attention set (marked when its session went).
        for (channel, entries) in self.unsettled() {
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
            let want = Want::of(&e.info);
            // Back-offs hold here too: a node that failed the channel lately does not get it
            // back early because it looks like the only candidate (with a stale view it may
            // not be: a node registered meanwhile, found by the simulation). The channel
            // waits under `remaining`, saying why, and comes back when a back-off ends.
            match self.least_loaded_for(&loads, channel, want, None, now_ms) {
                Some(target) => {
                    loads.add(target, want);
                    planned.push(reassign(e, ChannelOwner::Node(target), cause, now_ms));
                }
                None if cause == Cause::Failover => {
                    planned.push(park(e, self.nowhere(&loads, channel, want, now_ms)));
                }
                None => {}
            }
        }
        for t in planned.iter().filter_map(|c| c.transition.as_ref()) {
            self.moves.remove(&t.channel);
        }
        // Grouped by target (name order within each), so each packed txn puts under few
        // nodes: a node then sees its channels in one or two watch batches and acks them in
        // as many txns. In name order a txn of ~60 moves spread over every live node, and
        // each node acked its share of each of the 16 txns apart (~14 ack txns per node).
        planned.sort_by_key(|c| c.transition.as_ref().and_then(|t| t.to));
        changes.extend(planned);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::ChannelOwner;
    use crate::planner::tests::{info, n, name, World};
    use crate::planner::*;
    use crate::types::{ChannelState, Epoch, NodeId};

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
                    info: Box::new(moved)
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

    /// A failover does not put a channel back on the node that failed it, inside its
    /// back-off, even when that node is the only one left: the channel waits under
    /// `remaining`, saying why, and goes there once the back-off ends.
    #[test]
    fn a_failover_waits_out_the_back_off_of_the_only_node_left_rather_than_go_back_early() {
        let backoff = PlannerConfig::default().failed_node_backoff_ms;
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.node(2);
        w.put(n(1), info("a", ChannelState::WatchFailed, 1, 0));
        w.settle(10);
        assert_eq!(w.owner_of("a"), (n(2), ChannelState::ToWatch, Epoch(2)));
        w.kill(2);
        w.settle(20);
        assert_eq!(
            w.owner_of("a"),
            (ChannelOwner::Remaining, ChannelState::ToWatch, Epoch(2)),
            "node 1 failed it 10 ms ago: not back there"
        );
        let reason = w
            .state
            .entry(&name("a"))
            .and_then(|e| e.info.reason.clone())
            .unwrap_or_default();
        assert!(reason.contains("back-off"), "{reason}");
        assert!(w.settle(backoff).is_empty(), "still inside the back-off");
        w.settle(backoff + 11);
        assert_eq!(w.owner_of("a"), (n(1), ChannelState::ToWatch, Epoch(3)));
    }

    /// A channel whose only candidate is the node that failed it is retried there once
    /// that node's back-off passed — but not while the runtime says its view is behind (a
    /// node may have registered unseen).
    #[test]
    fn a_retry_on_the_failing_node_waits_while_the_view_is_behind() {
        let backoff = PlannerConfig::default().failed_node_backoff_ms;
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.put(n(1), info("a", ChannelState::WatchFailed, 1, 0));
        assert!(
            w.settle(10).is_empty(),
            "no other node: it waits out node 1's back-off"
        );
        w.state.set_behind(true);
        assert!(w.settle(backoff + 20).is_empty(), "behind: no retry");
        w.state.set_behind(false);
        w.settle(backoff + 30);
        assert_eq!(w.owner_of("a"), (n(1), ChannelState::ToWatch, Epoch(2)));
    }

    #[test]
    fn a_failovers_txns_each_put_under_as_few_nodes_as_the_packing_allows() {
        // 4 moves per txn (8 ops; one compare slot is the leader guard).
        let mut w = World::new(PlannerConfig {
            max_txn_ops: 9,
            ..PlannerConfig::default()
        });
        for id in 1..=4 {
            w.node(id);
        }
        for i in 0..12 {
            w.put(n(1), info(&format!("c{i:02}"), ChannelState::Watched, 1, 0));
        }
        w.kill(1);
        let txns = w.state.plan(0);
        assert_eq!(txns.len(), 3);
        for t in &txns {
            let targets: std::collections::BTreeSet<_> = t
                .ops
                .iter()
                .filter_map(|op| match op {
                    Op::Put { owner, .. } => Some(*owner),
                    _ => None,
                })
                .collect();
            assert_eq!(targets.len(), 1, "one txn puts under {targets:?}");
        }
        // Placement is what it was: each live node gets 4.
        for t in &txns {
            w.rev += 1;
            w.state.applied(t, w.rev);
        }
        for id in 2..=4 {
            assert_eq!(w.state.loads().channels(NodeId(id)), 4);
        }
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
}
