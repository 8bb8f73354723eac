//! A node's decisions, as a pure state machine.
//!
//! Owns: what the node believes about each channel under its prefix (the value and mod
//! revision it last saw, and what its runner is doing), and the commands that follow from an
//! event: start or stop a runner, and write an acknowledgement by compare-and-swap on the mod
//! revision it last saw (so a stale ack for an old assignment never lands).
//!
//! Must not: do I/O, run handlers or read the clock. The runtime feeds events in and carries
//! the commands out; `now_ms` arrives inside the events that need it.
//!
//! Over 600 lines because about half of it is the tests beside the machine, which assert
//! the exact command lists (STYLE.md 2); the machine itself is about 400 lines.

use std::collections::BTreeMap;

pub mod leave;

use crate::error::{DecodeError, KeyError};
use crate::keys::{ChannelKey, Keys};
use crate::types::{ChannelInfo, ChannelName, ChannelState, Epoch, Progress};

/// An assignment key or value a node must not act on. Fatal for that key only: the node
/// logs it (naming the key), counts it and leaves the key alone; the coordinator reports it.
#[derive(Debug, thiserror::Error)]
pub enum BadAssignment {
    /// The key is not `{root}/channel/{owner}/{channel}`.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The value does not decode.
    #[error(transparent)]
    Value(#[from] DecodeError),
    /// The value names another channel than its key (DESIGN.md §2: they must agree).
    #[error(
        "value names channel {value} but the key names {key}; the key and its value must \
         name the same channel: fix or delete the key"
    )]
    Mismatch {
        /// The channel in the key.
        key: ChannelName,
        /// The channel in the value.
        value: ChannelName,
    },
}

/// Decodes the assignment `key` = `value`, refusing a value whose channel is not the key's.
///
/// # Errors
/// [`BadAssignment`] for a key off the layout, a value that does not decode, or a value that
/// names another channel: a node must not start a channel under another channel's key.
pub fn decode_assignment(
    keys: &Keys,
    key: &str,
    value: &[u8],
) -> Result<(ChannelKey, ChannelInfo), BadAssignment> {
    let ck = keys.parse_channel(key)?;
    let info = ChannelInfo::decode(value)?;
    if info.channel != ck.channel {
        return Err(BadAssignment::Mismatch {
            key: ck.channel,
            value: info.channel,
        });
    }
    Ok((ck, info))
}

/// What the runner of a channel is doing, as far as the machine knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The handler is loading the channel.
    Loading,
    /// Loaded and acknowledged (or being acknowledged) as `Watched`.
    Running,
    /// The load failed; nothing runs.
    Failed,
    /// Asked to stop; `release_ack` says whether to acknowledge `Released` afterwards.
    Stopping {
        /// Acknowledge `Released` once stopped (a `ToRelease`), or not (a DELETE).
        release_ack: bool,
    },
    /// Nothing runs.
    Stopped,
}

/// The node's memory of one channel.
#[derive(Debug, Clone, PartialEq)]
pub struct Local {
    /// The value last seen (or written by us).
    pub info: ChannelInfo,
    /// Its mod revision, for the next compare-and-swap.
    pub mod_revision: i64,
    /// The runner's phase.
    pub phase: Phase,
    /// Set when the handler reported the channel broken: its runner is stopping, and once
    /// it has stopped the node acknowledges `WatchFailed` with this reason (stop first, so
    /// the channel never runs here beside its next owner). Reported during the load, it waits
    /// for the load's end: then the run is stopped instead of acknowledged `Watched`.
    pub broken: Option<String>,
}

/// Inputs of the machine.
// Events are consumed at once by `step`; boxing would only add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum NodeEvent {
    /// A PUT of `channel/{me}/{channel}` (from the watch or a relist).
    Put {
        /// The decoded value.
        info: ChannelInfo,
        /// Its mod revision.
        mod_revision: i64,
    },
    /// A DELETE of `channel/{me}/{channel}`.
    Delete {
        /// The channel.
        channel: ChannelName,
    },
    /// The handler's load finished for `epoch`.
    LoadDone {
        /// The channel.
        channel: ChannelName,
        /// The epoch it loaded for.
        epoch: Epoch,
        /// `Err(reason)` when the load failed.
        result: Result<(), String>,
    },
    /// The handler reported load progress.
    Progress {
        /// The channel.
        channel: ChannelName,
        /// The epoch it loads for.
        epoch: Epoch,
        /// Progress to publish.
        progress: Progress,
    },
    /// The runner stopped after a [`NodeCommand::Stop`].
    Stopped {
        /// The channel.
        channel: ChannelName,
    },
    /// The handler reported the running channel broken (`ChannelContext::fail`).
    Broke {
        /// The channel.
        channel: ChannelName,
        /// The epoch it runs for.
        epoch: Epoch,
        /// Why, written with `WatchFailed`.
        reason: String,
    },
    /// An acknowledgement txn finished: `Some(rev)` committed at `rev`, `None` its compare
    /// failed (the assignment changed; the watch brings the new value).
    AckDone {
        /// The channel.
        channel: ChannelName,
        /// New mod revision, if committed.
        committed: Option<i64>,
    },
}

/// Outputs of the machine.
#[derive(Debug, Clone, PartialEq)]
pub enum NodeCommand {
    /// Start a runner for this assignment.
    Start {
        /// The assignment.
        info: ChannelInfo,
    },
    /// Stop the channel's runner, cancelling a load in progress.
    Stop {
        /// The channel.
        channel: ChannelName,
    },
    /// Write `info` if the key's mod revision is still `expect_mod_revision`.
    Ack {
        /// The value to write.
        info: ChannelInfo,
        /// The mod revision it must still have.
        expect_mod_revision: i64,
    },
}

/// The machine. See the module docs.
#[derive(Debug, Clone, Default)]
pub struct NodeMachine {
    channels: BTreeMap<ChannelName, Local>,
}

impl NodeMachine {
    /// No channels.
    pub fn new() -> Self {
        Self::default()
    }

    /// What the node believes about its channels.
    pub fn channels(&self) -> &BTreeMap<ChannelName, Local> {
        &self.channels
    }

    /// Channels whose runner is loading or running.
    pub fn active(&self) -> impl Iterator<Item = &ChannelName> {
        self.channels
            .iter()
            .filter(|(_, l)| matches!(l.phase, Phase::Loading | Phase::Running))
            .map(|(c, _)| c)
    }

    /// Replaces the view with a fresh list: channels missing from it are deleted.
    pub fn reset(&mut self, list: Vec<(ChannelInfo, i64)>) -> Vec<NodeCommand> {
        let listed: std::collections::BTreeSet<ChannelName> =
            list.iter().map(|(i, _)| i.channel.clone()).collect();
        let gone: Vec<ChannelName> = self
            .channels
            .keys()
            .filter(|c| !listed.contains(*c))
            .cloned()
            .collect();
        let mut out = Vec::new();
        for channel in gone {
            out.extend(self.step(NodeEvent::Delete { channel }));
        }
        for (info, mod_revision) in list {
            out.extend(self.step(NodeEvent::Put { info, mod_revision }));
        }
        out
    }

    /// Feeds one event; returns the commands to carry out, in order.
    pub fn step(&mut self, event: NodeEvent) -> Vec<NodeCommand> {
        match event {
            NodeEvent::Put { info, mod_revision } => self.on_put(info, mod_revision),
            NodeEvent::Delete { channel } => match self.channels.remove(&channel) {
                Some(l) if l.phase != Phase::Stopped && l.phase != Phase::Failed => {
                    vec![NodeCommand::Stop { channel }]
                }
                _ => vec![],
            },
            NodeEvent::LoadDone {
                channel,
                epoch,
                result,
            } => {
                let Some(l) = self.channels.get_mut(&channel) else {
                    return vec![];
                };
                if l.phase != Phase::Loading || l.info.epoch != epoch {
                    return vec![];
                }
                // Reported broken while it loaded (a worker's `/fail`, or its exit, just before
                // or after its `/ready`): a load that then succeeds is stopped, not
                // acknowledged `Watched`; the ack `WatchFailed` comes once it stopped.
                if result.is_ok() && l.broken.is_some() {
                    l.phase = Phase::Stopping { release_ack: false };
                    return vec![NodeCommand::Stop { channel }];
                }
                let mut info = l.info.clone();
                info.progress = None;
                l.broken = None;
                match result {
                    Ok(()) => {
                        l.phase = Phase::Running;
                        info.state = ChannelState::Watched;
                        info.reason = None;
                    }
                    Err(reason) => {
                        l.phase = Phase::Failed;
                        info.state = ChannelState::WatchFailed;
                        info.reason = Some(reason);
                    }
                }
                vec![NodeCommand::Ack {
                    info,
                    expect_mod_revision: l.mod_revision,
                }]
            }
            NodeEvent::Progress {
                channel,
                epoch,
                progress,
            } => {
                let Some(l) = self.channels.get(&channel) else {
                    return vec![];
                };
                // A load reported broken is not given more time by its progress: it fails
                // once it returns.
                if l.phase != Phase::Loading
                    || l.info.epoch != epoch
                    || l.info.state != ChannelState::ToWatch
                    || l.broken.is_some()
                {
                    return vec![];
                }
                let mut info = l.info.clone();
                info.progress = Some(progress);
                vec![NodeCommand::Ack {
                    info,
                    expect_mod_revision: l.mod_revision,
                }]
            }
            NodeEvent::Stopped { channel } => {
                let Some(l) = self.channels.get_mut(&channel) else {
                    return vec![];
                };
                let Phase::Stopping { release_ack } = l.phase else {
                    return vec![];
                };
                l.phase = Phase::Stopped;
                if let Some(reason) = l.broken.take() {
                    if matches!(l.info.state, ChannelState::ToWatch | ChannelState::Watched) {
                        l.phase = Phase::Failed;
                        let mut info = l.info.clone();
                        info.state = ChannelState::WatchFailed;
                        info.reason = Some(reason);
                        info.progress = None;
                        return vec![NodeCommand::Ack {
                            info,
                            expect_mod_revision: l.mod_revision,
                        }];
                    }
                }
                if release_ack && l.info.state == ChannelState::ToRelease {
                    let mut info = l.info.clone();
                    info.state = ChannelState::Released;
                    return vec![NodeCommand::Ack {
                        info,
                        expect_mod_revision: l.mod_revision,
                    }];
                }
                vec![]
            }
            NodeEvent::Broke {
                channel,
                epoch,
                reason,
            } => {
                let Some(l) = self.channels.get_mut(&channel) else {
                    return vec![];
                };
                let ours = l.info.epoch == epoch
                    && matches!(l.info.state, ChannelState::ToWatch | ChannelState::Watched);
                if ours && l.phase == Phase::Loading {
                    // Acted on when the load returns (`LoadDone`): the first reason stands.
                    l.broken.get_or_insert(reason);
                    return vec![];
                }
                if !ours || l.phase != Phase::Running {
                    return vec![]; // stale: that run is gone already
                }
                l.phase = Phase::Stopping { release_ack: false };
                l.broken = Some(reason);
                vec![NodeCommand::Stop { channel }]
            }
            NodeEvent::AckDone { channel, committed } => {
                if let (Some(l), Some(rev)) = (self.channels.get_mut(&channel), committed) {
                    l.mod_revision = l.mod_revision.max(rev);
                }
                vec![]
            }
        }
    }

    fn on_put(&mut self, info: ChannelInfo, mod_revision: i64) -> Vec<NodeCommand> {
        let channel = info.channel.clone();
        let prev = self.channels.get(&channel).cloned();
        if let Some(p) = &prev {
            if mod_revision < p.mod_revision {
                return vec![]; // an echo older than what we already know
            }
        }
        let same_epoch = prev.as_ref().is_some_and(|p| p.info.epoch == info.epoch);
        let phase = prev.as_ref().map(|p| p.phase);
        let active = matches!(phase, Some(Phase::Loading | Phase::Running));
        // A run reported broken is stopping and then acks WatchFailed; a later echo of the
        // same assignment must not start it again.
        let broken = prev
            .as_ref()
            .and_then(|p| p.broken.clone())
            .filter(|_| same_epoch)
            .filter(|_| matches!(info.state, ChannelState::ToWatch | ChannelState::Watched));
        let mut out = Vec::new();
        let new_phase = match info.state {
            _ if broken.is_some() => phase.unwrap_or(Phase::Stopped),
            ChannelState::ToWatch | ChannelState::Watched if same_epoch && active => {
                let phase = phase.unwrap_or(Phase::Loading);
                if phase == Phase::Running && info.state == ChannelState::ToWatch {
                    // We loaded it but the Watched ack did not land: acknowledge again.
                    let mut ack = info.clone();
                    ack.state = ChannelState::Watched;
                    ack.progress = None;
                    ack.reason = None;
                    out.push(NodeCommand::Ack {
                        info: ack,
                        expect_mod_revision: mod_revision,
                    });
                }
                phase
            }
            // We reported this epoch failed: never run it again, whatever a relist shows
            // (the coordinator moves a failed channel at once, without a release, so a
            // restart here would run beside the next owner; found by the simulation: a
            // relist after a slow keepalive restarted a failed load that then succeeded).
            // Acknowledge the failure again in case that ack did not land.
            ChannelState::ToWatch | ChannelState::Watched
                if same_epoch && phase == Some(Phase::Failed) =>
            {
                if info.state == ChannelState::ToWatch {
                    let mut ack = info.clone();
                    ack.state = ChannelState::WatchFailed;
                    ack.progress = None;
                    ack.reason = prev
                        .as_ref()
                        .and_then(|p| p.info.reason.clone())
                        .or_else(|| Some("the load failed".to_owned()));
                    out.push(NodeCommand::Ack {
                        info: ack,
                        expect_mod_revision: mod_revision,
                    });
                }
                Phase::Failed
            }
            ChannelState::ToWatch | ChannelState::Watched => {
                if active || matches!(phase, Some(Phase::Stopping { .. })) {
                    out.push(NodeCommand::Stop {
                        channel: channel.clone(),
                    });
                }
                out.push(NodeCommand::Start { info: info.clone() });
                Phase::Loading
            }
            ChannelState::WatchFailed | ChannelState::Released => {
                if active {
                    out.push(NodeCommand::Stop {
                        channel: channel.clone(),
                    });
                    Phase::Stopping { release_ack: false }
                } else {
                    phase.unwrap_or(Phase::Stopped)
                }
            }
            ChannelState::ToRelease => match phase {
                Some(Phase::Loading | Phase::Running) => {
                    out.push(NodeCommand::Stop {
                        channel: channel.clone(),
                    });
                    Phase::Stopping { release_ack: true }
                }
                Some(Phase::Stopping { .. }) => Phase::Stopping { release_ack: true },
                _ => {
                    let mut ack = info.clone();
                    ack.state = ChannelState::Released;
                    out.push(NodeCommand::Ack {
                        info: ack,
                        expect_mod_revision: mod_revision,
                    });
                    Phase::Stopped
                }
            },
        };
        self.channels.insert(
            channel,
            Local {
                info,
                mod_revision,
                phase: new_phase,
                broken,
            },
        );
        out
    }
}

#[cfg(test)]
mod tests;
