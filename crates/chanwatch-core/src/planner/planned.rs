//! Planned events (DESIGN §5): nodes that leave on purpose, and the cold-start gate.
//!
//! Owns: which nodes are leaving (a session value with `leaving: true`, written by the node
//! itself on SIGTERM; read through [`NodeSession::leaving`]) — the drain pass moves their
//! channels off break-before-make and placement gives them nothing new, exactly as for a
//! drain mark — and the cold-start gate: a leader that finds no live assignment waits for
//! `expected_nodes` live nodes, or `startup_grace_ms`, before it places anything, so the
//! first node up does not get every channel. A leader taking over a running cluster (some
//! channel under a live node) never waits. The gate opens once and stays open for the
//! planner's life.
//!
//! And the hold of balance after a planned restart: balance starts no move for
//! `move_cooldown_ms` after the last round that saw a node leaving. In a rolling restart
//! without surge the replacement of one node joins empty, and the drain of the next leaving
//! node fills it (placement puts each channel on the least loaded node): the channels go
//! where the final layout wants them, once each. Balance filling the replacement first would
//! move other channels now and leave the next drain to pile onto the rest, and after the
//! last restart every channel would be in its cool-down, the last replacement empty. After
//! the hold the channels the restarts moved are out of their cool-down (they moved while a
//! node was leaving), so balance evens out what is left without waiving it: a channel that
//! moved is still left alone for `move_cooldown_ms`. An operator's `ctl balance` does not
//! wait for the hold.
//!
//! Must not: pick nodes or weigh loads (`placement`), or build txns.
//!
//! [`NodeSession::leaving`]: crate::types::NodeSession::leaving

use crate::types::NodeId;

use super::{Cause, Planner};

/// Where the cold-start gate stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Startup {
    /// No round has run yet.
    #[default]
    Unknown,
    /// Cold: nothing is placed before `until_ms` unless `expected_nodes` are live.
    Waiting {
        /// When the grace ends.
        until_ms: u64,
    },
    /// Placing as usual.
    Open,
}

/// The cold-start gate holding placement, for the runtime's log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartupWait {
    /// Live nodes now.
    pub live: usize,
    /// Nodes the gate waits for (`--expected-nodes`).
    pub expected: usize,
    /// Milliseconds of grace left.
    pub left_ms: u64,
}

impl Planner {
    /// Whether `node` announced that it is leaving (its session says `leaving`).
    pub(super) fn is_leaving(&self, node: NodeId) -> bool {
        self.nodes.get(&node).is_some_and(|s| s.leaving())
    }

    /// Whether any live node is leaving (O(nodes)).
    pub(super) fn any_leaving(&self) -> bool {
        self.nodes.values().any(|s| s.leaving())
    }

    /// Notes, at the start of a round, that a node is leaving on purpose.
    pub(super) fn note_planned(&mut self, now_ms: u64) {
        if self.any_leaving() {
            self.planned_at_ms = Some(now_ms);
        }
    }

    /// Whether balance holds off after a planned restart (see the module docs).
    pub(super) fn planned_hold(&self, now_ms: u64) -> bool {
        self.planned_at_ms
            .is_some_and(|t| now_ms < t.saturating_add(self.config.move_cooldown_ms))
    }

    /// Whether some channel is under a live node: the cluster is running.
    fn has_live_assignments(&self) -> bool {
        self.owned
            .iter()
            .any(|(n, count)| count.keys > 0 && self.nodes.contains_key(n))
    }

    /// Moves the gate on at the start of a round; `Some` while it holds placement.
    pub(super) fn startup_gate(&mut self, now_ms: u64) -> Option<StartupWait> {
        let expected = self.config.expected_nodes;
        if self.startup == Startup::Unknown {
            self.startup = if expected == 0 || self.has_live_assignments() {
                Startup::Open
            } else {
                Startup::Waiting {
                    until_ms: now_ms.saturating_add(self.config.startup_grace_ms),
                }
            };
        }
        let Startup::Waiting { until_ms } = self.startup else {
            return None;
        };
        let live = self.nodes.len();
        if live >= expected || now_ms >= until_ms || self.has_live_assignments() {
            self.startup = Startup::Open;
            return None;
        }
        Some(StartupWait {
            live,
            expected,
            left_ms: until_ms - now_ms,
        })
    }

    /// Whether the cold-start gate holds placement (for operator commands between rounds:
    /// a channel added meanwhile is parked, and placed with the rest when the gate opens).
    pub(super) fn startup_holds(&self) -> bool {
        match self.startup {
            Startup::Open => false,
            Startup::Waiting { .. } => self.nodes.len() < self.config.expected_nodes,
            Startup::Unknown => {
                self.config.expected_nodes > 0
                    && self.nodes.len() < self.config.expected_nodes
                    && !self.has_live_assignments()
            }
        }
    }

    /// Why a channel added while the cold-start gate holds waits in `remaining` (its value's
    /// reason: `ctl add-channel`, `ctl channels` and `describe` show it; a newcomer saw the
    /// channel parked with no word of the gate).
    pub(super) fn startup_reason(&self) -> String {
        format!(
            "{}: cold start: waiting for {} expected node(s), {} live, or the end of --startup-grace",
            Cause::Park.as_str(),
            self.config.expected_nodes,
            self.nodes.len()
        )
    }

    /// The cold-start gate's hold, as of the last round (`None`: placing as usual).
    pub fn startup_wait(&self, now_ms: u64) -> Option<StartupWait> {
        match self.startup {
            Startup::Waiting { until_ms } if self.startup_holds() => Some(StartupWait {
                live: self.nodes.len(),
                expected: self.config.expected_nodes,
                left_ms: until_ms.saturating_sub(now_ms),
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use crate::keys::ChannelOwner;
    use crate::planner::tests::{info, n, World};
    use crate::planner::*;
    use crate::types::{ChannelState, Epoch, NodeId, NodeSession, VChannelInfo};

    fn leave(w: &mut World, id: u64) {
        let mut s = NodeSession::decode(format!(r#"{{"id":{id},"started_at_ms":0}}"#).as_bytes())
            .expect("session");
        s.set_leaving(true);
        w.rev += 1;
        let key = w.keys.session(NodeId(id));
        w.state.apply_put(&key, &s.encode(), w.rev);
    }

    fn transitions(txns: &[PlannedTxn]) -> Vec<&Transition> {
        txns.iter().flat_map(|t| &t.transitions).collect()
    }

    #[test]
    fn a_leaving_node_is_drained_break_before_make_within_the_budget_and_gets_nothing_new() {
        let cfg = PlannerConfig {
            max_concurrent_moves: 2,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        for id in 1..=3 {
            w.node(id);
        }
        for i in 0..3 {
            w.put(n(1), info(&format!("c{i}"), ChannelState::Watched, 1, 0));
        }
        w.settle(0);
        leave(&mut w, 1);
        let txns = w.settle(10);
        let t = transitions(&txns);
        assert_eq!(t.len(), 2, "the move budget: {t:?}");
        assert!(t
            .iter()
            .all(|t| t.cause == Cause::Drain && t.state == Some(ChannelState::ToRelease)));
        // Nothing new goes to the leaving node.
        let add = w
            .state
            .add_channel(
                crate::planner::tests::name("new"),
                VChannelInfo::default(),
                10,
            )
            .expect("added");
        assert_ne!(add.transitions[0].to, Some(n(1)));
        // The node releases, the channels move once each, with one epoch more: no failover.
        for _ in 0..3 {
            let releasing: Vec<_> = w
                .state
                .entries()
                .filter(|e| e.info.state == ChannelState::ToRelease)
                .map(|e| e.info.clone())
                .collect();
            for mut i in releasing {
                i.state = ChannelState::Released;
                w.put(n(1), i);
            }
            w.settle(20);
        }
        for i in 0..3 {
            let (owner, state, epoch) = w.owner_of(&format!("c{i}"));
            assert!(owner == n(2) || owner == n(3), "c{i} on {owner:?}");
            assert_eq!((state, epoch), (ChannelState::ToWatch, Epoch(2)));
        }
        assert!(w.state.node_rows().iter().any(|r| r.id == 1 && r.draining));
    }

    /// A rolling restart without surge, 5 nodes × 20 channels: each node leaves, is drained,
    /// exits, and a fresh node replaces it. Balance holds off while nodes leave, so each
    /// drain fills the previous replacement: each channel moves at most once per restart, 140
    /// moves in all (20 + 4 × 25 drained, 20 balanced at the end; balance filling each
    /// replacement at once made 186, and left the last one empty until the cool-downs
    /// ended), and the end is balanced once the hold is over.
    #[test]
    fn a_rolling_restart_without_surge_drains_into_the_last_replacement_and_ends_balanced() {
        let cfg = PlannerConfig {
            balance_quiet_ms: 1_000,
            move_cooldown_ms: 60_000,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        for id in 1..=5 {
            w.node(id);
        }
        for i in 0..100 {
            w.put(
                n(1 + i / 20),
                info(&format!("c{i:03}"), ChannelState::Watched, 1, 0),
            );
        }
        let mut t = 0;
        // Rounds every 100 ms for `ms`, nodes answering as they do; moves (owner changes)
        // counted per channel into `moved`.
        let rounds = |w: &mut World, t: &mut u64, ms: u64, moved: &mut BTreeMap<String, usize>| {
            let end = *t + ms;
            while *t < end {
                for tr in transitions(&w.settle(*t)) {
                    if tr.from != tr.to && matches!(tr.to, Some(ChannelOwner::Node(_))) {
                        *moved.entry(tr.channel.to_string()).or_default() += 1;
                    }
                }
                w.answer();
                *t += 100;
            }
        };
        let mut total = 0;
        let mut worst = 0;
        for k in 0..5 {
            let mut moved = BTreeMap::new();
            leave(&mut w, 1 + k);
            rounds(&mut w, &mut t, 2_000, &mut moved);
            assert!(
                w.state
                    .node_rows()
                    .iter()
                    .all(|r| r.id != 1 + k || r.channels == 0),
                "node {} not drained",
                1 + k
            );
            w.kill(1 + k);
            w.node(6 + k);
            rounds(&mut w, &mut t, 5_000, &mut moved);
            total += moved.values().sum::<usize>();
            worst = worst.max(moved.values().copied().max().unwrap_or(0));
        }
        let mut moved = BTreeMap::new();
        rounds(&mut w, &mut t, 61_000, &mut moved);
        total += moved.values().sum::<usize>();
        worst = worst.max(moved.values().copied().max().unwrap_or(0));
        let counts: Vec<usize> = w.state.node_rows().iter().map(|r| r.channels).collect();
        let spread =
            counts.iter().max().copied().unwrap_or(0) - counts.iter().min().copied().unwrap_or(0);
        assert!(spread <= 1, "{counts:?}");
        assert_eq!(worst, 1, "a channel moved twice in one restart");
        assert_eq!(total, 140, "{counts:?}");
    }

    #[test]
    fn a_cold_start_waits_for_the_expected_nodes_then_places_each_channel_once() {
        let cfg = PlannerConfig {
            expected_nodes: 3,
            startup_grace_ms: 10_000,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg);
        for i in 0..6 {
            w.put(
                ChannelOwner::Remaining,
                info(&format!("c{i}"), ChannelState::ToWatch, 1, 0),
            );
        }
        w.node(1);
        assert!(w.settle(0).is_empty(), "one node of three: wait");
        w.node(2);
        assert!(w.settle(1_000).is_empty(), "two of three: wait");
        let wait = w.state.startup_wait(3_000).expect("waiting");
        assert_eq!((wait.live, wait.expected, wait.left_ms), (2, 3, 7_000));
        // A channel added meanwhile waits in remaining and says why.
        let added = w
            .state
            .add_channel(
                crate::types::ChannelName::new("late").expect("name"),
                crate::types::VChannelInfo::default(),
                3_000,
            )
            .expect("added");
        let reason = added.ops.iter().find_map(|op| match op {
            crate::planner::Op::Put { owner, info } if *owner == ChannelOwner::Remaining => {
                info.reason.clone()
            }
            _ => None,
        });
        assert_eq!(
            reason.as_deref(),
            Some("park: cold start: waiting for 3 expected node(s), 2 live, or the end of --startup-grace")
        );
        w.node(3);
        let txns = w.settle(2_000);
        let t = transitions(&txns);
        assert_eq!(t.len(), 6);
        assert!(t
            .iter()
            .all(|t| t.cause == Cause::Unpark && t.epoch == Epoch(2)));
        let rows = w.state.node_rows();
        assert!(rows.iter().all(|r| r.channels == 2), "{rows:?}");
        assert!(w.state.startup_wait(2_000).is_none());
    }

    #[test]
    fn a_cold_start_places_after_the_grace_and_a_running_cluster_never_waits() {
        let cfg = PlannerConfig {
            expected_nodes: 3,
            startup_grace_ms: 10_000,
            ..PlannerConfig::default()
        };
        let mut w = World::new(cfg.clone());
        w.put(
            ChannelOwner::Remaining,
            info("a", ChannelState::ToWatch, 1, 0),
        );
        w.node(1);
        assert!(w.settle(5_000).is_empty());
        // A channel added while the gate holds is parked with the rest.
        let add = w
            .state
            .add_channel(
                crate::planner::tests::name("b"),
                VChannelInfo::default(),
                6_000,
            )
            .expect("added");
        assert_eq!(add.transitions[0].to, Some(ChannelOwner::Remaining));
        assert!(w.settle(14_999).is_empty());
        assert_eq!(transitions(&w.settle(15_000)).len(), 1, "the grace is over");

        let mut w = World::new(cfg);
        w.node(1);
        w.put(n(1), info("run", ChannelState::Watched, 1, 0));
        w.put(
            ChannelOwner::Remaining,
            info("parked", ChannelState::ToWatch, 1, 0),
        );
        let t = w.settle(0);
        assert_eq!(transitions(&t).len(), 1, "a running cluster: no wait");
    }
}
