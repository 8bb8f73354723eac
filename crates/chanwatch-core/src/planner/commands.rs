//! The planner's vocabulary out: what a round asks the runtime to do.
//!
//! Owns: [`PlannedTxn`] (all [`Guard`]s hold → all [`Op`]s apply, atomically), the
//! [`Transition`] line per channel touched, its [`Cause`], and `Change` — one channel's
//! change, never split across txns — with the builders every pass uses: `reassign` (delete
//! and put `ToWatch` with the next epoch elsewhere), `park` (under `remaining`) and
//! `release` (ask the owner to stop, first half of a break-before-make move).
//!
//! Must not: look at the view. A builder sees only the entry it changes.

use serde::{Deserialize, Serialize};

use crate::keys::ChannelOwner;
use crate::types::{ChannelInfo, ChannelName, ChannelState, Epoch, NodeId};

use super::view::Entry;

/// Why a channel's assignment changed; used in logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// A new channel was registered.
    Assign,
    /// Its node's session is gone.
    Failover,
    /// No node is alive; parked under `remaining`.
    Park,
    /// A node appeared; taken out of `remaining`.
    Unpark,
    /// Not acknowledged in time, or stuck releasing past the release timeout.
    Timeout,
    /// The load failed or the running channel broke (`WatchFailed`).
    Failed,
    /// Moved to even out load.
    Balance,
    /// Moved off a draining node.
    Drain,
    /// Moved by an operator.
    Manual,
    /// Removed by an operator.
    Remove,
    /// A second key for the same channel was removed.
    Dedupe,
    /// Pinned by an operator (balance leaves it alone); nothing moved.
    Pin,
    /// Unpinned by an operator; nothing moved.
    Unpin,
}

impl Cause {
    /// Label used in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Assign => "assign",
            Cause::Failover => "failover",
            Cause::Park => "park",
            Cause::Unpark => "unpark",
            Cause::Timeout => "timeout",
            Cause::Failed => "failed",
            Cause::Balance => "balance",
            Cause::Drain => "drain",
            Cause::Manual => "manual",
            Cause::Remove => "remove",
            Cause::Dedupe => "dedupe",
            Cause::Pin => "pin",
            Cause::Unpin => "unpin",
        }
    }
}

/// A condition of a planned txn: the key still has `mod_revision` (0: the key is absent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guard {
    /// Owner part of the key.
    pub owner: ChannelOwner,
    /// Channel part of the key.
    pub channel: ChannelName,
    /// Expected mod revision; 0 means "must not exist".
    pub mod_revision: i64,
}

/// One write of a planned txn.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Put `info` at `channel/{owner}/{info.channel}`.
    Put {
        /// Owner part of the key.
        owner: ChannelOwner,
        /// The value, boxed: a failover's round holds a delete beside each put, and an
        /// unboxed value made every op 440 bytes (moving them into txns was a fifth of the
        /// round).
        info: Box<ChannelInfo>,
    },
    /// Delete `channel/{owner}/{channel}`.
    Delete {
        /// Owner part of the key.
        owner: ChannelOwner,
        /// Channel part of the key.
        channel: ChannelName,
    },
    /// Delete `worker/checkpoint/{channel}`: the channel is removed, its committed position with it
    /// (a channel added again later starts from the beginning).
    DeleteCheckpoint {
        /// The channel.
        channel: ChannelName,
    },
    /// Put the drain mark `coord/drain/{node}`.
    Drain {
        /// The node to drain.
        node: NodeId,
    },
    /// Delete the drain mark of a node that is gone.
    Undrain {
        /// The node.
        node: NodeId,
    },
    /// Put the fence mark `coord/fence/{node}`; once it has landed, the runtime revokes the
    /// node's session lease (see [`Planner::take_fence_requests`]).
    ///
    /// [`Planner::take_fence_requests`]: crate::planner::Planner::take_fence_requests
    Fence {
        /// The node to fence.
        node: NodeId,
    },
    /// Delete the fence mark of a node that is gone and whose channels have moved.
    Unfence {
        /// The node.
        node: NodeId,
    },
}

/// What a planned txn does to one channel, for logs and metrics. The admin API answers
/// with it (owners as a node ID, `"remaining"` or `null`), and `ctl` reads it back typed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transition {
    /// The channel.
    pub channel: ChannelName,
    /// Why.
    pub cause: Cause,
    /// Owner before (`None`: new channel).
    #[serde(serialize_with = "ser_owner_opt", deserialize_with = "de_owner_opt")]
    pub from: Option<ChannelOwner>,
    /// Owner after (`None`: removed).
    #[serde(serialize_with = "ser_owner_opt", deserialize_with = "de_owner_opt")]
    pub to: Option<ChannelOwner>,
    /// State written (`None`: removed).
    pub state: Option<ChannelState>,
    /// Epoch written.
    pub epoch: Epoch,
}

fn ser_owner_opt<S: serde::Serializer>(o: &Option<ChannelOwner>, s: S) -> Result<S::Ok, S::Error> {
    match o {
        None => s.serialize_none(),
        Some(ChannelOwner::Remaining) => s.serialize_str("remaining"),
        Some(ChannelOwner::Node(id)) => s.serialize_u64(id.0),
    }
}

/// The inverse of [`ser_owner_opt`]: `null`, `"remaining"` or a node ID.
fn de_owner_opt<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<ChannelOwner>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Wire {
        Node(u64),
        Named(String),
    }
    match Option::<Wire>::deserialize(d)? {
        None => Ok(None),
        Some(Wire::Node(id)) => Ok(Some(ChannelOwner::Node(NodeId(id)))),
        Some(Wire::Named(s)) if s == crate::keys::REMAINING => Ok(Some(ChannelOwner::Remaining)),
        Some(Wire::Named(s)) => Err(serde::de::Error::custom(format!(
            "owner {s:?} is neither a node ID nor {:?}",
            crate::keys::REMAINING
        ))),
    }
}

/// A txn for the runtime to run: all `guards` hold → all `ops` apply, atomically.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedTxn {
    /// Compare-and-swap conditions (the runtime adds its leader guard).
    pub guards: Vec<Guard>,
    /// Writes; never more than `max_txn_ops - 1`.
    pub ops: Vec<Op>,
    /// One line per channel touched.
    pub transitions: Vec<Transition>,
}

/// One channel's change, never split across txns.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Change {
    pub(super) guards: Vec<Guard>,
    pub(super) ops: Vec<Op>,
    /// `None` for bookkeeping that moves no channel (drain marks).
    pub(super) transition: Option<Transition>,
}

pub(super) fn guard(e: &Entry) -> Guard {
    Guard {
        owner: e.owner,
        channel: e.info.channel.clone(),
        mod_revision: e.mod_revision,
    }
}

/// Delete the old key and put `ToWatch` with the next epoch under `to`, in one txn.
pub(super) fn reassign(e: &Entry, to: ChannelOwner, cause: Cause, now_ms: u64) -> Change {
    let mut info = e.info.clone();
    info.state = ChannelState::ToWatch;
    info.epoch = info.epoch.next();
    info.start_time_ms = now_ms;
    info.progress = None;
    info.reason = Some(match (&e.info.reason, e.info.state) {
        // What the node said when it failed the channel goes along — into the coordinator's
        // event (`ctl events`) and log line, and the value until the next node acks — cut
        // to a bound.
        (Some(why), ChannelState::WatchFailed) if cause == Cause::Failed => {
            format!("{}: {}", cause.as_str(), bounded(why))
        }
        _ => cause.as_str().to_owned(),
    });
    let mut ops = Vec::with_capacity(2);
    if e.owner != to {
        ops.push(Op::Delete {
            owner: e.owner,
            channel: info.channel.clone(),
        });
    }
    let transition = Transition {
        channel: info.channel.clone(),
        cause,
        from: Some(e.owner),
        to: Some(to),
        state: Some(info.state),
        epoch: info.epoch,
    };
    ops.push(Op::Put {
        owner: to,
        info: Box::new(info),
    });
    Change {
        guards: vec![guard(e)],
        ops,
        transition: Some(transition),
    }
}

/// Most characters of a node's reason a reassignment carries on.
const REASON_MAX: usize = 1_000;

/// `why` cut to [`REASON_MAX`] characters, on one line (`ctl events` prints one per event).
fn bounded(why: &str) -> String {
    why.chars()
        .take(REASON_MAX)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// Park under `remaining`, saying `why`: no node owns it, so the epoch stays.
pub(super) fn park(e: &Entry, why: String) -> Change {
    let mut info = e.info.clone();
    info.state = ChannelState::ToWatch;
    info.progress = None;
    info.reason = Some(format!("{}: {why}", Cause::Park.as_str()));
    let transition = Transition {
        channel: info.channel.clone(),
        cause: Cause::Park,
        from: Some(e.owner),
        to: Some(ChannelOwner::Remaining),
        state: Some(info.state),
        epoch: info.epoch,
    };
    Change {
        guards: vec![guard(e)],
        ops: vec![
            Op::Delete {
                owner: e.owner,
                channel: info.channel.clone(),
            },
            Op::Put {
                owner: ChannelOwner::Remaining,
                info: Box::new(info),
            },
        ],
        transition: Some(transition),
    }
}

/// Ask the owner to stop the channel (first half of a break-before-make move).
pub(super) fn release(e: &Entry, cause: Cause) -> Change {
    let mut info = e.info.clone();
    info.state = ChannelState::ToRelease;
    info.reason = Some(cause.as_str().to_owned());
    let transition = Transition {
        channel: info.channel.clone(),
        cause,
        from: Some(e.owner),
        to: Some(e.owner),
        state: Some(info.state),
        epoch: info.epoch,
    };
    Change {
        guards: vec![guard(e)],
        ops: vec![Op::Put {
            owner: e.owner,
            info: Box::new(info),
        }],
        transition: Some(transition),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::tests::{info, n, name};

    fn entry(owner: ChannelOwner, state: ChannelState, epoch: u64) -> Entry {
        Entry {
            owner,
            info: info("a", state, epoch, 0),
            mod_revision: 7,
        }
    }

    fn guarded_on_the_old_key() -> Vec<Guard> {
        vec![Guard {
            owner: n(1),
            channel: name("a"),
            mod_revision: 7,
        }]
    }

    #[test]
    fn reassign_deletes_the_old_key_and_puts_to_watch_with_the_next_epoch() {
        let c = reassign(
            &entry(n(1), ChannelState::Watched, 3),
            n(2),
            Cause::Failover,
            50,
        );
        let mut put = info("a", ChannelState::ToWatch, 4, 50);
        put.reason = Some("failover".into());
        assert_eq!(c.guards, guarded_on_the_old_key());
        assert_eq!(
            c.ops,
            vec![
                Op::Delete {
                    owner: n(1),
                    channel: name("a")
                },
                Op::Put {
                    owner: n(2),
                    info: Box::new(put)
                }
            ]
        );
        let t = c.transition.expect("a channel moved");
        assert_eq!((t.from, t.to, t.epoch), (Some(n(1)), Some(n(2)), Epoch(4)));
        // To the same node: the key stays, only the value changes.
        let c = reassign(
            &entry(n(1), ChannelState::WatchFailed, 3),
            n(1),
            Cause::Failed,
            50,
        );
        assert!(matches!(&c.ops[..], [Op::Put { owner, .. }] if *owner == n(1)));
        // A failed channel's new value carries what its node said (bounded).
        let mut failed = entry(n(1), ChannelState::WatchFailed, 3);
        failed.info.reason = Some("the worker exited before POST /ready (exit code 2)".into());
        let c = reassign(&failed, n(2), Cause::Failed, 50);
        let Some(Op::Put { info, .. }) = c.ops.last() else {
            panic!("a put");
        };
        assert_eq!(
            info.reason.as_deref(),
            Some("failed: the worker exited before POST /ready (exit code 2)")
        );
        failed.info.reason = Some(format!("line 1\nline 2{}", "é".repeat(5_000)));
        let c = reassign(&failed, n(2), Cause::Failed, 50);
        let Some(Op::Put { info, .. }) = c.ops.last() else {
            panic!("a put");
        };
        let reason = info.reason.as_deref().unwrap_or_default();
        assert_eq!(reason.chars().count(), 1_008);
        assert!(reason.starts_with("failed: line 1 line 2é"), "{reason}");
        // Other causes say only themselves.
        let c = reassign(&failed, n(2), Cause::Failover, 50);
        let Some(Op::Put { info, .. }) = c.ops.last() else {
            panic!("a put");
        };
        assert_eq!(info.reason.as_deref(), Some("failover"));
    }

    #[test]
    fn park_keeps_the_epoch_and_release_keeps_owner_and_epoch() {
        let c = park(
            &entry(n(1), ChannelState::Watched, 3),
            "no live node".into(),
        );
        assert_eq!(c.guards, guarded_on_the_old_key());
        assert!(matches!(
            &c.ops[..],
            [Op::Delete { .. }, Op::Put { owner: ChannelOwner::Remaining, info }]
                if info.epoch == Epoch(3) && info.state == ChannelState::ToWatch
        ));
        let c = release(&entry(n(1), ChannelState::Watched, 3), Cause::Balance);
        assert_eq!(c.guards, guarded_on_the_old_key());
        assert!(matches!(
            &c.ops[..],
            [Op::Put { owner, info }]
                if *owner == n(1) && info.epoch == Epoch(3) && info.state == ChannelState::ToRelease
        ));
    }

    /// The admin API answers with transitions as JSON and `ctl` reads them back: every owner
    /// form (node, `remaining`, none) survives the trip, and an unknown owner is refused.
    #[test]
    fn a_transition_reads_back_what_it_writes_as_json() {
        for (from, to, state) in [
            (None, Some(n(2)), Some(ChannelState::ToWatch)),
            (
                Some(n(1)),
                Some(ChannelOwner::Remaining),
                Some(ChannelState::Watched),
            ),
            (Some(ChannelOwner::Remaining), None, None),
        ] {
            let t = Transition {
                channel: name("a"),
                cause: Cause::Failover,
                from,
                to,
                state,
                epoch: Epoch(4),
            };
            let json = serde_json::to_value(&t).expect("serializes");
            let back: Transition = serde_json::from_value(json.clone()).expect("deserializes");
            assert_eq!(back, t, "{json}");
        }
        let bad = serde_json::json!({
            "channel": "a", "cause": "assign", "from": "elsewhere", "to": null,
            "state": null, "epoch": 1
        });
        let e = serde_json::from_value::<Transition>(bad).expect_err("no such owner");
        assert!(e.to_string().contains("elsewhere"), "{e}");
    }
}
