//! Rows for `ctl channels`, `ctl nodes` and the admin API ([`ChannelRow`], [`NodeRow`]),
//! read from the view (DESIGN.md §7).
//!
//! Must not: change the view; rows are a read-only projection.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::keys::ChannelOwner;
use crate::types::{ChannelName, ChannelState, NodeId};

use super::Planner;

/// One channel as `ctl channels --json` prints it (DESIGN.md §7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ChannelRow {
    /// The channel.
    pub channel: ChannelName,
    /// Owning node, `null` when parked under `remaining`.
    pub node: Option<u64>,
    /// State.
    pub state: ChannelState,
    /// Epoch.
    pub epoch: u64,
    /// When this assignment began (Unix ms).
    pub start_time_ms: u64,
    /// Why it is in this state, if recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Load progress in percent, while loading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<u8>,
}

/// One node as `ctl nodes --json` prints it (DESIGN.md §7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct NodeRow {
    /// Node ID.
    pub id: u64,
    /// Its admin address.
    pub admin_addr: String,
    /// Channels assigned to it.
    pub channels: usize,
    /// When its session began (Unix ms).
    pub started_at_ms: u64,
    /// Whether it is being drained.
    #[serde(default)]
    pub draining: bool,
}

impl Planner {
    /// One row per channel, for `ctl channels` and the admin API.
    pub fn channel_rows(&self) -> Vec<ChannelRow> {
        self.channels
            .values()
            .flat_map(|m| m.values())
            .map(|e| ChannelRow {
                channel: e.info.channel.clone(),
                node: match e.owner {
                    ChannelOwner::Node(n) => Some(n.0),
                    ChannelOwner::Remaining => None,
                },
                state: e.info.state,
                epoch: e.info.epoch.0,
                start_time_ms: e.info.start_time_ms,
                reason: e.info.reason.clone(),
                progress: e.info.progress.as_ref().map(|p| p.percent),
            })
            .collect()
    }

    /// One row per live node, for `ctl nodes` and the admin API.
    pub fn node_rows(&self) -> Vec<NodeRow> {
        let mut counts: BTreeMap<NodeId, usize> = BTreeMap::new();
        for e in self.entries() {
            if let ChannelOwner::Node(n) = e.owner {
                *counts.entry(n).or_default() += 1;
            }
        }
        self.nodes
            .iter()
            .map(|(id, s)| NodeRow {
                id: id.0,
                admin_addr: s.admin_addr.clone(),
                channels: counts.get(id).copied().unwrap_or(0),
                started_at_ms: s.started_at_ms,
                draining: self.draining.contains(id),
            })
            .collect()
    }
}
