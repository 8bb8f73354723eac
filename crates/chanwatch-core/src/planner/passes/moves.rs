//! Passes that start new moves, run only in a round that planned nothing else: drains move
//! every channel off a draining or leaving node, and balance moves `Watched` channels from the busiest
//! to the least loaded node until max − min ≤ 1. Both break-before-make (`ToRelease`
//! first), at most `max_concurrent_moves` in flight.
//!
//! Must not: pick targets or weigh loads itself (`placement` does, including what balance
//! may not touch: back-offs, troubled nodes, cool-downs).

use crate::keys::ChannelOwner;
use crate::types::{ChannelName, ChannelState, NodeId};

use super::super::commands::{reassign, release, Cause, Change};
use super::super::placement::{pick_moves, Loads, Want};
use super::super::{PendingMove, Planner};

impl Planner {
    pub(super) fn plan_drains(&mut self, now_ms: u64, changes: &mut Vec<Change>) {
        if self.draining.is_empty() && !self.any_leaving() {
            return;
        }
        let mut loads = self.loads();
        let mut budget = self
            .config
            .max_concurrent_moves
            .saturating_sub(self.moves.len());
        let mut new_moves = Vec::new();
        for (channel, entries) in &self.channels {
            if budget == 0 {
                break;
            }
            if entries.len() != 1 || self.moves.contains_key(channel) {
                continue;
            }
            let Some(e) = entries.values().next() else {
                continue;
            };
            let ChannelOwner::Node(from) = e.owner else {
                continue;
            };
            // A drain mark, or the node's own `leaving` (a planned restart): the same moves.
            if !(self.draining.contains(&from) || self.is_leaving(from))
                || !self.nodes.contains_key(&from)
            {
                continue;
            }
            let want = Want::of(&e.info);
            let Some(to) = self.least_loaded_for(&loads, channel, want, Some(from), now_ms) else {
                continue; // no node has room: it stays where it runs
            };
            loads.add(to, want);
            budget -= 1;
            match e.info.state {
                // A loading channel runs too: it is released first like a watched one, or a
                // node that misses the delete (a stalled connection) would load it while the
                // target does (found by the simulation).
                ChannelState::Watched | ChannelState::ToWatch => {
                    new_moves.push((
                        channel.clone(),
                        PendingMove {
                            to,
                            since_ms: now_ms,
                            cause: Cause::Drain,
                        },
                    ));
                    changes.push(release(e, Cause::Drain));
                }
                ChannelState::WatchFailed => {
                    changes.push(reassign(e, ChannelOwner::Node(to), Cause::Drain, now_ms))
                }
                _ => {}
            }
        }
        self.moves.extend(new_moves);
    }

    /// Move `Watched`, unpinned channels from the most to the least loaded node until the
    /// spread is within one channel's weight by capacity, with at most
    /// `max_concurrent_moves` in flight; only with `auto_balance` or when asked.
    pub(in crate::planner) fn plan_balance(&mut self, now_ms: u64, changes: &mut Vec<Change>) {
        if !self.config.auto_balance && !self.balance_asked {
            return;
        }
        if now_ms
            < self
                .quiet_since_ms
                .saturating_add(self.config.balance_quiet_ms)
        {
            return; // something just changed: let the cluster settle first
        }
        if self.planned_hold(now_ms) && !self.balance_asked {
            return; // a planned restart: the next leaving node's drain fills the replacement
        }
        let mut loads = self.loads();
        loads.retain(|n| self.takes_new(n));
        let unit = self.heaviest_weight();
        if loads.len() < 2 || loads.balanced(unit) {
            // Balanced: skip collecting movable channels, the costly part.
            self.balance_asked = false;
            return;
        }
        let mut movable = self.movable(true);
        let budget = self
            .config
            .max_concurrent_moves
            .saturating_sub(self.moves.len());
        let allowed = |c: &ChannelName, to: NodeId| self.balance_allows(c, to, now_ms);
        let room = |l: &Loads, to: NodeId, w: u64| {
            self.fits(
                l,
                to,
                Want {
                    weight: w,
                    group: None,
                },
            )
        };
        let picked = pick_moves(&mut loads, &mut movable, budget, unit, room, allowed);
        if picked.is_empty()
            && budget > 0
            && !self.moves.values().any(|m| m.cause == Cause::Balance)
        {
            // Nothing can move now (pinned, cooling down, no room): an operator's request
            // is answered; automatic balance tries again next round.
            self.balance_asked = false;
        }
        for m in picked {
            if let Some(e) = self.entry(&m.channel) {
                changes.push(release(e, Cause::Balance));
            }
            self.moves.insert(
                m.channel,
                PendingMove {
                    to: m.to,
                    since_ms: now_ms,
                    cause: Cause::Balance,
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::tests::{info, n, name, World};
    use crate::planner::*;
    use crate::types::{ChannelName, ChannelState, Epoch};

    #[test]
    fn balance_is_break_before_make_and_bounded() {
        let cfg = PlannerConfig {
            max_concurrent_moves: 2,
            balance_quiet_ms: 0,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(1);
        for i in 0..6 {
            w.put(n(1), info(&format!("c{i}"), ChannelState::Watched, 1, 0));
        }
        w.node(2);
        let txns = w.settle(10);
        let t: Vec<&Transition> = txns.iter().flat_map(|t| &t.transitions).collect();
        assert_eq!(t.len(), 2, "at most 2 moves in flight");
        assert!(t
            .iter()
            .all(|t| t.cause == Cause::Balance && t.state == Some(ChannelState::ToRelease)));
        assert!(w.settle(11).is_empty(), "no more moves until one finishes");
        // The node releases one: the coordinator moves it to node 2 and starts another.
        let ch = t[0].channel.clone();
        let mut released = w.state.entry(&ch).expect("exists").info.clone();
        released.state = ChannelState::Released;
        w.put(n(1), released);
        let txns = w.settle(12);
        let t: Vec<&Transition> = txns.iter().flat_map(|t| &t.transitions).collect();
        assert_eq!(t[0].channel, ch);
        assert_eq!(
            (t[0].to, t[0].state, t[0].epoch),
            (Some(n(2)), Some(ChannelState::ToWatch), Epoch(2))
        );
        assert_eq!(
            t.len(),
            1,
            "new moves wait for a round that sees the finished one"
        );
        let txns = w.settle(13);
        let t: Vec<&Transition> = txns.iter().flat_map(|t| &t.transitions).collect();
        assert_eq!(t.len(), 1, "one new move started");
        assert_eq!(t[0].state, Some(ChannelState::ToRelease));
        assert_eq!(w.state.moves_in_flight(), 2);
    }

    #[test]
    fn a_failing_channel_does_not_ping_pong_back_through_balance() {
        // Seen from outside: a channel failing on node A went to B, and 10-35 ms later
        // balance put it (or a healthy channel) back on A; 601 transitions in 7 s.
        let cfg = PlannerConfig {
            failed_node_backoff_ms: 30_000,
            balance_quiet_ms: 5_000,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(1);
        w.node(2);
        for i in 0..4 {
            w.put(n(1), info(&format!("a{i}"), ChannelState::Watched, 1, 0));
            w.put(n(2), info(&format!("b{i}"), ChannelState::Watched, 1, 0));
        }
        w.put(n(1), info("bad", ChannelState::WatchFailed, 1, 0));
        w.settle(10_000);
        assert_eq!(w.owner_of("bad"), (n(2), ChannelState::ToWatch, Epoch(2)));
        let mut bad = w.state.entry(&name("bad")).expect("bad").info.clone();
        bad.state = ChannelState::Watched;
        w.put(n(2), bad);
        // 4 on node 1, 5 on node 2: balanced. Node 1 failed a channel, so nothing more goes
        // there for the back-off, whatever the loads.
        let mut moves = 0;
        for t in (10_010..45_000).step_by(500) {
            moves += w
                .settle(t)
                .iter()
                .map(|t| t.transitions.len())
                .sum::<usize>();
        }
        assert_eq!(moves, 0);
        // A node joining later is fed only after the quiet period, and never `bad`.
        w.node(3);
        assert!(w.settle(45_500).is_empty(), "balance waits after a join");
        let txns = w.settle(51_000);
        let moved: Vec<&Transition> = txns.iter().flat_map(|t| &t.transitions).collect();
        assert_eq!(moved.len(), 3, "4/5/0 -> 3/3/3: {moved:?}");
        assert!(moved
            .iter()
            .all(|t| t.cause == Cause::Balance && t.channel.as_str() != "bad"));
    }

    #[test]
    fn balance_does_not_feed_a_node_that_fails_loads() {
        let cfg = PlannerConfig {
            failed_node_backoff_ms: 30_000,
            balance_quiet_ms: 1_000,
            move_cooldown_ms: 0,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(1);
        w.node(2);
        for i in 0..6 {
            w.put(n(1), info(&format!("c{i}"), ChannelState::Watched, 1, 0));
        }
        w.put(n(2), info("hung", ChannelState::WatchFailed, 1, 0));
        w.settle(0);
        assert_eq!(w.owner_of("hung").0, n(1));
        let mut hung = w.state.entry(&name("hung")).expect("hung").info.clone();
        hung.state = ChannelState::Watched;
        w.put(n(1), hung);
        // Node 2 is empty, but it just failed a load: balance leaves it alone.
        for t in (1_000..30_000).step_by(1_000) {
            assert!(w.settle(t).is_empty(), "at {t}");
        }
        // After the back-off it is a target again.
        let txns = w.settle(31_000);
        assert!(!txns.is_empty());
        assert!(txns
            .iter()
            .flat_map(|t| &t.transitions)
            .all(|t| t.cause == Cause::Balance));
    }

    #[test]
    fn a_channel_that_just_moved_is_not_moved_again_by_balance() {
        let cfg = PlannerConfig {
            balance_quiet_ms: 0,
            move_cooldown_ms: 60_000,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        w.node(1);
        w.node(2);
        w.put(n(1), info("a", ChannelState::Watched, 1, 0));
        w.put(n(1), info("b", ChannelState::Watched, 1, 0));
        w.put(n(1), info("c", ChannelState::Watched, 1, 0));
        // An operator moves `c` to node 2 and then `a`, `b` are on node 1: balanced.
        w.move_to("c", 2);
        let mut c = w.state.entry(&name("c")).expect("c").info.clone();
        c.state = ChannelState::Released;
        w.put(n(1), c);
        w.settle(10);
        let mut c = w.state.entry(&name("c")).expect("c").info.clone();
        c.state = ChannelState::Watched;
        w.put(n(2), c);
        // Node 2 dies and comes back as node 3: `c` fails over to node 1 (3 there, 0 on 3).
        w.kill(2);
        w.settle(20);
        let mut c = w.state.entry(&name("c")).expect("c").info.clone();
        c.state = ChannelState::Watched;
        w.put(n(1), c);
        w.node(3);
        let txns = w.settle(30);
        let moved: Vec<&ChannelName> = txns
            .iter()
            .flat_map(|t| &t.transitions)
            .map(|t| &t.channel)
            .collect();
        assert_eq!(moved.len(), 1);
        assert_ne!(moved[0].as_str(), "c", "c moved twice in a minute");
    }
}
