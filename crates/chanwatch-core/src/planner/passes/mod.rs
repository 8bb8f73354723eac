//! One planning round ([`Planner::plan`]) and the order of its passes.
//!
//! Owns: the round itself — forgetting moves whose release never landed, dating
//! disturbances for the quiet period, pruning expired cool-downs and back-offs, running the
//! passes in order, keeping one change per channel per round, recording what moved — and
//! the passes, one module each:
//!
//! - `repair`: duplicate keys, channels of dead nodes (failover) and parked ones (unpark);
//! - `timeouts`: loads not acknowledged in time, failed loads, finished and stuck releases;
//! - `moves`: new moves, drains and balance, started only in a round with nothing else to do.
//!
//! Must not: compute loads or pick nodes by hand (that is `placement`), or build txns
//! (`packing`).

use std::collections::HashSet;

use super::commands::{Cause, Change, Op, PlannedTxn};
use super::Planner;
use crate::types::ChannelState;

mod moves;
mod repair;
mod timeouts;

impl Planner {
    /// Everything that should change now. See the module docs.
    pub fn plan(&mut self, now_ms: u64) -> Vec<PlannedTxn> {
        if self.startup_gate(now_ms).is_some() {
            return Vec::new(); // cold start: waiting for the expected nodes
        }
        self.forget_failed_moves(now_ms);
        if std::mem::take(&mut self.disturbed) {
            self.quiet_since_ms = now_ms;
        }
        self.prune(now_ms);
        self.note_planned(now_ms);
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
        // (Decided over borrowed names, then kept: cloning each name into a set was a
        // seventh of a 1,000-channel failover round.)
        let keep: Vec<bool> = {
            let mut touched = HashSet::with_capacity(changes.len());
            changes
                .iter()
                .map(|c| {
                    let fresh = c.guards.iter().all(|g| !touched.contains(&g.channel));
                    if fresh {
                        touched.extend(c.guards.iter().map(|g| &g.channel));
                    }
                    fresh
                })
                .collect()
        };
        let mut keep = keep.into_iter();
        changes.retain(|_| keep.next().unwrap_or(true));
        for t in changes.iter().filter_map(|c| c.transition.as_ref()) {
            if !matches!(
                t.cause,
                Cause::Assign
                    | Cause::Remove
                    | Cause::Dedupe
                    | Cause::Park
                    | Cause::Pin
                    | Cause::Unpin
            ) {
                self.moved_at.insert(t.channel.clone(), now_ms);
            }
        }
        let round = self.round_id(now_ms);
        self.pack(changes, Some(round))
    }

    /// Forgets cool-downs, troubled nodes and back-offs that are over, at most once a second
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::tests::{info, n, World};
    use crate::planner::*;
    use crate::types::{ChannelState, Epoch};

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
}
