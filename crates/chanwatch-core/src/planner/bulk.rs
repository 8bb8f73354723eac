//! Bulk registration: many new channels placed at once and packed into as few txns as the
//! store allows (DESIGN §7): one call per channel cost many times the store's own floor
//! (docs/BENCHMARKS.md, "Bulk registration and the failover replay floor").
//!
//! Owns: [`Planner::add_channels`] — every entry is checked against the view first (all or
//! nothing: one refusal and no txn is planned), then each channel goes to the least-loaded
//! node counting the ones placed before it in the same list, and the puts are packed.
//! Must not: validate names, sizes or duplicates within the list (the admin API does, with
//! what the caller can fix), or write anything.

use crate::keys::ChannelOwner;
use crate::types::{ChannelInfo, ChannelState, Epoch};

use super::commands::{Cause, Change, Guard, Op, PlannedTxn, Transition};
use super::placement::Want;
use super::{AdminError, Planner};

impl Planner {
    /// Balance waits `balance_quiet_ms` from `now_ms`, as after a membership change: the
    /// coordinator calls it while bulk lists are being written, when the view holds only
    /// the part of them the watch has shown (uneven by node) and a balance pass would move
    /// channels that the rest of the lists even out anyway (found by `bench register` with
    /// lists written off the leader's loop: balance moves started mid-registration).
    pub fn hold_balance(&mut self, now_ms: u64) {
        self.quiet_since_ms = self.quiet_since_ms.max(now_ms);
    }

    /// Tells the planner whether its view is known to be behind the store (the leader's
    /// watch has not reached a revision its keepalive answers named). While it is, a channel
    /// whose only candidate is the node that failed it is not retried there: another node
    /// may have registered unseen (found by a sweep of the simulation's seeds: with the
    /// leader's watch stalled, a channel went back to the node that had just failed it while
    /// a new node could take it). It waits until the view catches up.
    pub fn set_behind(&mut self, behind: bool) {
        self.behind = behind;
    }

    /// Registers every channel of `infos` (their `channel`, `vchannel` and unknown fields
    /// are kept; state, epoch and start time are set here) on the least-loaded nodes, or under
    /// `remaining` when no node takes channels. Each put is guarded by the key's absence, so
    /// a racing registration refuses its txn instead of being overwritten.
    ///
    /// # Errors
    /// Every entry already registered, with its index in `infos`; then nothing is planned.
    pub fn add_channels(
        &mut self,
        infos: Vec<ChannelInfo>,
        now_ms: u64,
    ) -> Result<Vec<PlannedTxn>, Vec<(usize, AdminError)>> {
        let refused: Vec<(usize, AdminError)> = infos
            .iter()
            .enumerate()
            .filter(|(_, i)| self.channels.contains_key(&i.channel))
            .map(|(k, i)| (k, AdminError::AlreadyExists(i.channel.clone())))
            .collect();
        if !refused.is_empty() {
            return Err(refused);
        }
        let mut loads = self.loads();
        let holds = self.startup_holds();
        let someone = self.assignable().next().is_some();
        let changes = infos
            .into_iter()
            .map(|mut info| {
                info.state = ChannelState::ToWatch;
                info.epoch = Epoch(1);
                info.start_time_ms = now_ms;
                info.reason = None;
                info.progress = None;
                let want = Want::of(&info);
                // Cold start: parked with the rest until the gate opens (planned.rs).
                let node = if holds {
                    None
                } else {
                    self.least_loaded(&loads, want, None)
                };
                let owner = match node {
                    Some(n) => {
                        loads.add(n, want);
                        ChannelOwner::Node(n)
                    }
                    None => {
                        if holds {
                            info.reason = Some(self.startup_reason());
                        } else if someone {
                            info.reason =
                                Some(format!("{}: {}", Cause::Park.as_str(), self.no_room(want)));
                        }
                        ChannelOwner::Remaining
                    }
                };
                Change {
                    guards: vec![Guard {
                        owner,
                        channel: info.channel.clone(),
                        mod_revision: 0,
                    }],
                    transition: Some(Transition {
                        channel: info.channel.clone(),
                        cause: Cause::Assign,
                        from: None,
                        to: Some(owner),
                        state: Some(info.state),
                        epoch: info.epoch,
                    }),
                    ops: vec![Op::Put {
                        owner,
                        info: Box::new(info),
                    }],
                }
            })
            .collect();
        let round = self.round_id(now_ms);
        Ok(self.pack(changes, Some(round)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{n, World};
    use super::super::PlannerConfig;
    use super::*;
    use crate::types::{ChannelName, VChannelInfo};
    use std::collections::BTreeSet;

    fn new(name: &str) -> ChannelInfo {
        ChannelInfo::new(
            ChannelName::new(name).expect("valid"),
            Epoch(7),
            0,
            VChannelInfo::default(),
        )
    }

    /// A list is spread over the nodes as one-by-one adds would spread it (each placement
    /// counts the ones before it), packed into txns of at most `max_txn_ops - 1` puts, each
    /// guarded by its key's absence.
    #[test]
    fn a_list_is_spread_evenly_and_packed_into_full_txns() {
        let mut w = World::new(PlannerConfig {
            max_txn_ops: 11,
            ..PlannerConfig::default()
        });
        w.node(1);
        w.node(2);
        w.node(3);
        w.put(n(1), new("old"));
        let infos: Vec<ChannelInfo> = (0..29).map(|i| new(&format!("c{i:02}"))).collect();
        let txns = w.state.add_channels(infos, 5).expect("none registered");
        assert_eq!(
            txns.iter().map(|t| t.ops.len()).collect::<Vec<_>>(),
            [10, 10, 9]
        );
        let mut per_node = std::collections::BTreeMap::new();
        let mut rounds = BTreeSet::new();
        for t in &txns {
            assert!(t.guards.iter().all(|g| g.mod_revision == 0));
            for op in &t.ops {
                let Op::Put { owner, info } = op else {
                    panic!("only puts: {op:?}")
                };
                assert_eq!(
                    (info.epoch, info.state, info.start_time_ms),
                    (Epoch(1), ChannelState::ToWatch, 5)
                );
                *per_node.entry(*owner).or_insert(0) += 1;
                rounds.insert((*owner, info.round.map(|r| (r.id, r.puts))));
            }
        }
        // 30 channels over 3 nodes, node 1 already holding one.
        assert_eq!(per_node.values().copied().collect::<Vec<_>>(), [9, 10, 10]);
        // Each put says how many the list writes to its node, under one id (DESIGN §2).
        let id = rounds
            .iter()
            .find_map(|(_, r)| r.map(|r| r.0))
            .expect("the puts carry a round");
        let want: BTreeSet<_> = per_node
            .iter()
            .map(|(owner, k)| (*owner, Some((id, *k))))
            .collect();
        assert_eq!(rounds, want);
        // A list of one puts one channel on its node: no hint.
        let txns = w.state.add_channels(vec![new("single")], 6).expect("new");
        assert!(txns[0]
            .ops
            .iter()
            .all(|op| matches!(op, Op::Put { info, .. } if info.round.is_none())));
    }

    /// One registered name refuses the whole list, naming every such entry by index.
    #[test]
    fn registered_names_refuse_the_whole_list() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.put(n(1), new("b"));
        w.put(n(1), new("d"));
        let infos = ["a", "b", "c", "d"].map(new).to_vec();
        let refused = w.state.add_channels(infos, 0).expect_err("b and d exist");
        assert_eq!(refused.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [1, 3]);
        assert!(matches!(&refused[0].1, AdminError::AlreadyExists(c) if c.as_str() == "b"));
    }

    /// Without a live node the list is parked under `remaining`.
    #[test]
    fn without_nodes_the_list_is_parked() {
        let mut w = World::new(PlannerConfig::default());
        let txns = w.state.add_channels(vec![new("a")], 0).expect("fine");
        assert!(matches!(
            &txns[0].ops[0],
            Op::Put {
                owner: ChannelOwner::Remaining,
                ..
            }
        ));
    }
}
