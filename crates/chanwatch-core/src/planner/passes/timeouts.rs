//! Time-bound passes over live nodes' channels: a load not acknowledged within the watch
//! timeout is released (break-before-make) and a `WatchFailed` channel reassigned, each
//! avoiding the failing node for the back-off (`plan_timeouts`); a move whose channel is
//! `Released` completes, and one stuck in `ToRelease` past the release timeout has its owner
//! fenced (`plan_releases`).
//!
//! Must not: move a channel beside a live owner that has not released it (only the planted
//! bug `ForceWithoutFence`, a test switch, does).

use std::collections::BTreeSet;

use crate::keys::ChannelOwner;
use crate::types::ChannelState;

use super::super::commands::{park, reassign, release, Cause, Change, Op};
use super::super::placement::Want;
#[cfg(feature = "planted-bugs")]
use super::super::PlannerBug;
use super::super::{PendingMove, Planner};

impl Planner {
    /// Whether the view is known to be behind the store (the runtime's `set_behind`): then
    /// no decision rests on an ack *not* seen — a watch timeout, a release timeout — nor on
    /// "no other candidate" (a node that registered may not be in view yet); the runtime
    /// relists, and the timers pick up from a current view.
    fn view_behind(&self) -> bool {
        #[cfg(feature = "planted-bugs")]
        if self.config.planted(PlannerBug::IgnoreBehind) {
            return false;
        }
        self.behind
    }

    pub(super) fn plan_timeouts(&mut self, now_ms: u64, changes: &mut Vec<Change>) {
        let behind = self.view_behind();
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
                ChannelState::ToWatch if now_ms < self.timeouts_after_ms || behind => false,
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
            let want = Want::of(&e.info);
            let target = match self.least_loaded_for(&loads, channel, want, Some(node), now_ms) {
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
                        if behind {
                            continue; // "no other candidate" may be a stale view's
                        }
                        node
                    }
                    Some(until) if *until > now_ms => continue,
                    Some(_) | None => {
                        newly_avoided.push((channel.clone(), node));
                        continue;
                    }
                },
            };
            loads.add(target, want);
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
    pub(super) fn plan_releases(&mut self, now_ms: u64, changes: &mut Vec<Change>) {
        let behind = self.view_behind();
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
                        .least_loaded_for(&loads, channel, Want::of(&e.info), Some(from), now_ms)
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
            // A `Released` the stale view does not show yet would make a healthy node look
            // stuck, and fencing it fails over every channel it holds.
            let stuck = e.info.state == ChannelState::ToRelease
                && !behind
                && now_ms.saturating_sub(pending.since_ms) > self.config.release_timeout_ms;
            #[cfg(feature = "planted-bugs")]
            let fence = stuck && !self.config.planted(PlannerBug::ForceWithoutFence);
            #[cfg(not(feature = "planted-bugs"))]
            let fence = stuck;
            if fence {
                // The owner is alive but did not release in time: it may be blind (a
                // stalled watch) and still running the channel. Moving the channel now
                // would run it twice; fence the owner instead. Once its session is gone,
                // `plan_orphans` moves its channels (DESIGN §3, found from outside).
                to_fence.insert(from);
                continue;
            }
            if e.info.state == ChannelState::Released || stuck {
                // The target may have died, started draining or leaving, or failed the
                // channel meanwhile: then the least loaded node not in a back-off for it.
                // (The pending target counts the channel already: its room was checked
                // when the move was picked.)
                let want = Want::of(&e.info);
                // The planted BalanceIgnoresBackoff (feature `planted-bugs`) ignores the
                // target's back-off here too, as balance did when it picked it.
                #[cfg(feature = "planted-bugs")]
                let avoided = !self.config.planted(PlannerBug::BalanceIgnoresBackoff)
                    && self.avoided(channel, pending.to, now_ms);
                #[cfg(not(feature = "planted-bugs"))]
                let avoided = self.avoided(channel, pending.to, now_ms);
                // Leaving or being fenced counts as draining: a leaving node that emptied
                // ends its session, and a put landing then fails over (found by the
                // simulation, seed 2140: a balance picked a node that then began a planned
                // restart, and the move completed onto it).
                let to = if self.nodes.contains_key(&pending.to)
                    && self.takes_new(pending.to)
                    && !avoided
                {
                    Some(pending.to)
                } else {
                    // Another node first, else back to its old owner; never onto a node in
                    // its back-off for the channel.
                    self.least_loaded_for(&loads, channel, want, Some(from), now_ms)
                        .or_else(|| self.least_loaded_for(&loads, channel, want, None, now_ms))
                };
                let change = match to {
                    Some(to) => {
                        loads.add(to, want);
                        reassign(e, ChannelOwner::Node(to), pending.cause, now_ms)
                    }
                    // Stopped, and no node has room under `--max-load`: it waits under
                    // `remaining`, saying why, until room appears.
                    None if e.info.state == ChannelState::Released => {
                        park(e, self.nowhere(&loads, channel, want, now_ms))
                    }
                    None => continue,
                };
                done.push((channel.clone(), change));
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::tests::{info, n, World};
    use crate::planner::*;
    use crate::types::{ChannelState, Epoch, Progress};

    /// While the runtime says the view is behind the store, no load times out and no
    /// owner is fenced for a release it may have acked unseen; once the view is current,
    /// both happen as before.
    #[test]
    fn a_view_known_to_be_behind_times_out_nothing_until_it_is_current() {
        let cfg = PlannerConfig {
            watch_timeout_ms: 1_000,
            release_timeout_ms: 2_000,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(1);
        w.node(2);
        w.put(n(1), info("load", ChannelState::ToWatch, 1, 0));
        w.put(n(1), info("rel", ChannelState::Watched, 1, 0));
        w.move_to("rel", 2);
        assert_eq!(w.owner_of("rel").1, ChannelState::ToRelease);
        w.state.set_behind(true);
        assert!(
            w.state.plan(10_000).is_empty(),
            "a stale view timed something out"
        );
        w.state.set_behind(false);
        let txns = w.settle(10_000);
        assert!(
            txns.iter()
                .any(|t| t.ops.iter().any(|op| matches!(op, Op::Fence { .. }))),
            "the stuck release fences its owner once the view is current: {txns:?}"
        );
        assert_eq!(
            w.owner_of("load").1,
            ChannelState::ToRelease,
            "the hung load is released"
        );
    }

    /// A move whose target begins a planned restart (or a drain) before the old owner has
    /// released completes elsewhere: a leaving node that emptied ends its session, and the
    /// put would fail over (seed 2140).
    #[test]
    fn a_move_whose_target_began_leaving_completes_on_another_node() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.node(2);
        w.node(3);
        w.put(n(1), info("c", ChannelState::Watched, 1, 0));
        w.move_to("c", 2);
        assert_eq!(w.owner_of("c").1, ChannelState::ToRelease);
        w.leaving(2);
        w.put(n(1), info("c", ChannelState::Released, 1, 0));
        w.settle(10);
        assert_eq!(w.owner_of("c").0, n(3), "not onto the leaving node 2");
        // And an operator's move to a leaving node is refused.
        assert!(matches!(
            w.state
                .move_channel(&crate::planner::tests::name("c"), NodeId(2), 20),
            Err(AdminError::Draining(_))
        ));
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
}
