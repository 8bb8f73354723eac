//! Operator commands: add, remove and move a channel, drain a node, and the balance plan a
//! dry run shows. Each answers one txn to run (or an [`AdminError`] saying what to fix); a
//! move or drain the planner must finish over later rounds is remembered in its memory of
//! moves or as a drain mark.
//!
//! Must not: write anything itself. It refuses a move onto a draining or unknown node and a
//! second move of a channel already moving.

use crate::keys::ChannelOwner;
use crate::types::{
    ChannelInfo, ChannelName, ChannelState, Epoch, NodeId, VChannelInfo, MAX_CHANNEL_WEIGHT,
    MAX_GROUP_BYTES,
};

use super::commands::{guard, reassign, release, Cause, Change, Guard, Op, PlannedTxn, Transition};
use super::packing::merge;
use super::placement::{pick_moves, Loads, PlannedMove, Want};
use super::{PendingMove, Planner};

/// Refusals of admin requests. None is retryable as is; each says what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    /// The channel is already registered.
    #[error("channel {0} already exists")]
    AlreadyExists(ChannelName),
    /// The channel is not registered.
    #[error("channel {0} does not exist")]
    UnknownChannel(ChannelName),
    /// The node has no live session.
    #[error("node {0} is not alive")]
    UnknownNode(NodeId),
    /// The node is draining and takes no channels.
    #[error("node {0} is draining and takes no channels")]
    Draining(NodeId),
    /// The channel is already moving.
    #[error("channel {0} is already being moved; wait for the move to finish")]
    Busy(ChannelName),
    /// The channel is already on that node.
    #[error("channel {0} is already on node {1}")]
    AlreadyThere(ChannelName, NodeId),
    /// A weight or group that is not allowed: what to give instead.
    #[error("{0}")]
    BadPlacement(String),
    /// The target has no room for the channel under `--max-load`.
    #[error("node {0} has no room for channel {1} under --max-load")]
    NoRoom(NodeId, ChannelName),
}

/// How a new channel is placed: its weight and group (DESIGN §2, §5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Relative load, 1 to [`MAX_CHANNEL_WEIGHT`].
    pub weight: u32,
    /// Group (e.g. the collection) spread across nodes.
    pub group: Option<String>,
}

impl Default for Placement {
    fn default() -> Self {
        Placement {
            weight: 1,
            group: None,
        }
    }
}

impl Placement {
    /// Checks the weight range and the group's name (1-255 bytes of `[A-Za-z0-9._-]`).
    ///
    /// # Errors
    /// [`AdminError::BadPlacement`] saying which rule is broken.
    pub fn check(&self) -> Result<(), AdminError> {
        if self.weight == 0 || self.weight > MAX_CHANNEL_WEIGHT {
            return Err(AdminError::BadPlacement(format!(
                "weight {} is out of range: give 1 to {MAX_CHANNEL_WEIGHT}",
                self.weight
            )));
        }
        if let Some(g) = &self.group {
            let ok = !g.is_empty()
                && g.len() <= MAX_GROUP_BYTES
                && g.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
            if !ok {
                return Err(AdminError::BadPlacement(format!(
                    "group {g:?}: give 1-{MAX_GROUP_BYTES} characters of [A-Za-z0-9._-]"
                )));
            }
        }
        Ok(())
    }
}

impl Planner {
    /// Registers a new channel of weight 1 and no group: see [`Planner::add_channel_with`].
    ///
    /// # Errors
    /// [`AdminError::AlreadyExists`].
    pub fn add_channel(
        &self,
        channel: ChannelName,
        vchannel: VChannelInfo,
        now_ms: u64,
    ) -> Result<PlannedTxn, AdminError> {
        self.add_channel_with(channel, vchannel, Placement::default(), now_ms)
    }

    /// Registers a new channel on the least-loaded node with room for it (DESIGN §5), or
    /// under `remaining` with the reason when none has.
    ///
    /// # Errors
    /// [`AdminError::AlreadyExists`], [`AdminError::BadPlacement`].
    pub fn add_channel_with(
        &self,
        channel: ChannelName,
        vchannel: VChannelInfo,
        placement: Placement,
        now_ms: u64,
    ) -> Result<PlannedTxn, AdminError> {
        placement.check()?;
        if self.channels.contains_key(&channel) {
            return Err(AdminError::AlreadyExists(channel));
        }
        let loads = self.loads();
        let mut info = ChannelInfo::new(channel.clone(), Epoch(1), now_ms, vchannel);
        info.weight = placement.weight;
        info.group = placement.group;
        let want = Want::of(&info);
        let owner = if self.startup_holds() {
            // Cold start: placed with the rest when the gate opens.
            info.reason = Some(self.startup_reason());
            ChannelOwner::Remaining
        } else {
            match self.least_loaded(&loads, want, None) {
                Some(n) => ChannelOwner::Node(n),
                None => {
                    if self.assignable().next().is_some() {
                        info.reason =
                            Some(format!("{}: {}", Cause::Park.as_str(), self.no_room(want)));
                    }
                    ChannelOwner::Remaining
                }
            }
        };
        let change = Change {
            guards: vec![Guard {
                owner,
                channel: channel.clone(),
                mod_revision: 0,
            }],
            transition: Some(Transition {
                channel,
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
        };
        Ok(self.pack(vec![change], None).remove(0))
    }

    /// Pins (`true`) or unpins a channel: rewrites its key with `pinned` set, guarded on
    /// its mod revision, moving nothing (its owner, state and epoch stay). Balance never
    /// picks a pinned channel. Every key of the channel is rewritten (a duplicate too).
    ///
    /// # Errors
    /// [`AdminError::UnknownChannel`].
    pub fn set_pinned(
        &self,
        channel: &ChannelName,
        pinned: bool,
    ) -> Result<PlannedTxn, AdminError> {
        let entries = self
            .channels
            .get(channel)
            .ok_or_else(|| AdminError::UnknownChannel(channel.clone()))?;
        let mut changes = Vec::new();
        for e in entries.values().filter(|e| e.info.pinned != pinned) {
            let mut info = e.info.clone();
            info.pinned = pinned;
            changes.push(Change {
                guards: vec![guard(e)],
                transition: Some(Transition {
                    channel: channel.clone(),
                    cause: if pinned { Cause::Pin } else { Cause::Unpin },
                    from: Some(e.owner),
                    to: Some(e.owner),
                    state: Some(info.state),
                    epoch: info.epoch,
                }),
                ops: vec![Op::Put {
                    owner: e.owner,
                    info: Box::new(info),
                }],
            });
        }
        Ok(merge(self.pack(changes, None)))
    }

    /// Asks for a balance: it runs (within the damping rules) even with `auto_balance` off,
    /// until the cluster is balanced or nothing more can move.
    pub fn ask_balance(&mut self) {
        self.balance_asked = true;
    }

    /// Removes a channel: deletes every key it has. Its node stops it on the DELETE.
    ///
    /// # Errors
    /// [`AdminError::UnknownChannel`].
    pub fn remove_channel(&self, channel: &ChannelName) -> Result<PlannedTxn, AdminError> {
        let entries = self
            .channels
            .get(channel)
            .ok_or_else(|| AdminError::UnknownChannel(channel.clone()))?;
        let mut changes = Vec::new();
        for (i, e) in entries.values().enumerate() {
            let mut ops = vec![Op::Delete {
                owner: e.owner,
                channel: channel.clone(),
            }];
            if i == 0 {
                // The committed position goes with the channel (DESIGN §2).
                ops.push(Op::DeleteCheckpoint {
                    channel: channel.clone(),
                });
            }
            changes.push(Change {
                guards: vec![guard(e)],
                ops,
                transition: Some(Transition {
                    channel: channel.clone(),
                    cause: Cause::Remove,
                    from: Some(e.owner),
                    to: None,
                    state: None,
                    epoch: e.info.epoch,
                }),
            });
        }
        Ok(merge(self.pack(changes, None)))
    }

    /// Moves a channel to `to`, break-before-make (`ToRelease` first). A channel that is not
    /// running (`ToWatch`, `WatchFailed`, parked) moves at once.
    ///
    /// # Errors
    /// Unknown channel or node, draining target, a move already in flight, or already there.
    pub fn move_channel(
        &mut self,
        channel: &ChannelName,
        to: NodeId,
        now_ms: u64,
    ) -> Result<PlannedTxn, AdminError> {
        let e = self
            .entry(channel)
            .cloned()
            .ok_or_else(|| AdminError::UnknownChannel(channel.clone()))?;
        if !self.nodes.contains_key(&to) {
            return Err(AdminError::UnknownNode(to));
        }
        if self.draining.contains(&to) || self.is_leaving(to) {
            return Err(AdminError::Draining(to));
        }
        if self.moves.contains_key(channel) {
            return Err(AdminError::Busy(channel.clone()));
        }
        if e.owner == ChannelOwner::Node(to) {
            return Err(AdminError::AlreadyThere(channel.clone(), to));
        }
        if !self.fits(&self.loads(), to, Want::of(&e.info)) {
            return Err(AdminError::NoRoom(to, channel.clone()));
        }
        let change = match e.info.state {
            ChannelState::Watched | ChannelState::ToWatch | ChannelState::ToRelease => {
                self.moves.insert(
                    channel.clone(),
                    PendingMove {
                        to,
                        since_ms: now_ms,
                        cause: Cause::Manual,
                    },
                );
                release(&e, Cause::Manual)
            }
            _ => reassign(&e, ChannelOwner::Node(to), Cause::Manual, now_ms),
        };
        Ok(self.pack(vec![change], None).remove(0))
    }

    /// Marks a node as draining (a key in the store, so it survives a coordinator failover):
    /// it gets no new channels and the planner moves its channels off, break-before-make, at
    /// most `max_concurrent_moves` at a time.
    ///
    /// # Errors
    /// [`AdminError::UnknownNode`].
    pub fn drain(&self, node: NodeId) -> Result<PlannedTxn, AdminError> {
        if !self.nodes.contains_key(&node) {
            return Err(AdminError::UnknownNode(node));
        }
        Ok(PlannedTxn {
            guards: Vec::new(),
            ops: vec![Op::Drain { node }],
            transitions: Vec::new(),
        })
    }

    /// Undrain `node`: the txn that deletes its drain mark, `None` when it has none (nothing
    /// to do), or [`AdminError::UnknownNode`] when it has neither a mark nor a session (most
    /// likely a mistyped ID: said rather than "nothing to do"). Balance fills it afterwards.
    ///
    /// # Errors
    /// [`AdminError::UnknownNode`], as above.
    pub fn undrain(&self, node: NodeId) -> Result<Option<PlannedTxn>, AdminError> {
        if !self.draining.contains(&node) {
            return if self.nodes.contains_key(&node) {
                Ok(None)
            } else {
                Err(AdminError::UnknownNode(node))
            };
        }
        Ok(Some(PlannedTxn {
            guards: Vec::new(),
            ops: vec![Op::Undrain { node }],
            transitions: Vec::new(),
        }))
    }

    /// The moves balance would make now, without making them.
    pub fn balance_plan(&self) -> Vec<PlannedMove> {
        // As if no move were in flight and any number could be: loads are the keys each
        // node holds now, and every `Watched` channel may move. No copy of the view (it
        // runs on every metrics tick, and the view can be 100 MB).
        let mut loads = self.held_loads();
        let unit = self.heaviest_weight();
        if loads.len() < 2 || loads.balanced(unit) {
            return Vec::new();
        }
        let mut movable = self.movable(false);
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
        pick_moves(&mut loads, &mut movable, usize::MAX, unit, room, |_, _| {
            true
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::ChannelOwner;
    use crate::planner::tests::{info, n, name, World};
    use crate::planner::*;
    use crate::types::{ChannelState, Epoch, NodeId, VChannelInfo};

    #[test]
    fn removing_a_channel_deletes_its_checkpoint_once_even_with_two_keys() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.node(2);
        w.put(n(1), info("a", ChannelState::Watched, 1, 0));
        // A duplicate key (epoch 2 on node 2): both go, the checkpoint once.
        w.put(n(2), info("a", ChannelState::ToWatch, 2, 0));
        let txn = w.state.remove_channel(&name("a")).expect("known channel");
        let deletes = txn
            .ops
            .iter()
            .filter(|o| matches!(o, Op::Delete { .. }))
            .count();
        let checkpoints: Vec<_> = txn
            .ops
            .iter()
            .filter(|o| matches!(o, Op::DeleteCheckpoint { channel } if channel.as_str() == "a"))
            .collect();
        assert_eq!((deletes, checkpoints.len()), (2, 1), "{:?}", txn.ops);
    }

    #[test]
    fn add_channel_goes_to_the_least_loaded_node_with_epoch_one() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.node(2);
        w.put(n(1), info("a", ChannelState::Watched, 1, 0));
        let txn = w
            .state
            .add_channel(name("b"), VChannelInfo::default(), 7)
            .expect("new");
        assert_eq!(
            txn.guards,
            vec![Guard {
                owner: n(2),
                channel: name("b"),
                mod_revision: 0
            }]
        );
        assert_eq!(
            txn.ops,
            vec![Op::Put {
                owner: n(2),
                info: Box::new(info("b", ChannelState::ToWatch, 1, 7))
            }]
        );
        assert_eq!(
            w.state.add_channel(name("a"), VChannelInfo::default(), 7),
            Err(AdminError::AlreadyExists(name("a")))
        );
    }

    #[test]
    fn add_channel_with_no_node_alive_parks_it() {
        let w = World::new(PlannerConfig::default());
        let txn = w
            .state
            .add_channel(name("a"), VChannelInfo::default(), 0)
            .expect("new");
        assert!(matches!(
            &txn.ops[..],
            [Op::Put {
                owner: ChannelOwner::Remaining,
                ..
            }]
        ));
    }

    #[test]
    fn balance_plan_reaches_within_one_with_the_minimum_moves() {
        let mut w = World::new(PlannerConfig::default());
        for id in 1..=3 {
            w.node(id);
        }
        for i in 0..10 {
            w.put(n(1), info(&format!("c{i:02}"), ChannelState::Watched, 1, 0));
        }
        let plan = w.state.balance_plan();
        // 10/0/0 -> 4/3/3: 6 moves, the minimum.
        assert_eq!(plan.len(), 6);
        assert!(plan.iter().all(|m| m.from == NodeId(1)));
        assert_eq!(w.state.moves_in_flight(), 0, "a dry run changes nothing");
    }

    #[test]
    fn drain_moves_everything_off_and_assigns_nothing_new_there() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.node(2);
        w.put(n(1), info("a", ChannelState::Watched, 1, 0));
        w.put(n(1), info("b", ChannelState::ToWatch, 1, 0));
        w.put(n(1), info("f", ChannelState::WatchFailed, 1, 0));
        let txn = w.state.drain(NodeId(1)).expect("live");
        w.rev += 1;
        w.state.applied(&txn, w.rev);
        w.settle(0);
        w.settle(1); // new moves start in a round with nothing else to do
                     // Loading or running: released first (break-before-make); failed: moved at once.
        assert_eq!(w.owner_of("a").1, ChannelState::ToRelease);
        assert_eq!(w.owner_of("b").1, ChannelState::ToRelease);
        assert_eq!(w.owner_of("f"), (n(2), ChannelState::ToWatch, Epoch(2)));
        let txn = w
            .state
            .add_channel(name("c"), VChannelInfo::default(), 0)
            .expect("new");
        assert!(matches!(&txn.ops[..], [Op::Put { owner, .. }] if *owner == n(2)));
    }

    #[test]
    fn undrain_deletes_a_drain_mark_does_nothing_without_one_and_refuses_an_unknown_node() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        assert_eq!(w.state.undrain(NodeId(1)), Ok(None), "live, not draining");
        assert_eq!(
            w.state.undrain(NodeId(9)),
            Err(AdminError::UnknownNode(NodeId(9)))
        );
        let txn = w.state.drain(NodeId(1)).expect("live");
        w.rev += 1;
        w.state.applied(&txn, w.rev);
        let undrain = w.state.undrain(NodeId(1)).expect("known").expect("a mark");
        assert_eq!(undrain.ops, vec![Op::Undrain { node: NodeId(1) }]);
        assert!(undrain.transitions.is_empty());
    }
}
