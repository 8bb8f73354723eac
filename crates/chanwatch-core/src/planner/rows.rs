//! Rows for `ctl channels`, `ctl nodes` and the admin API ([`ChannelRow`], [`NodeRow`]),
//! read from the view (DESIGN.md §7).
//!
//! Must not: change the view; rows are a read-only projection.

use serde::Serialize;

use crate::keys::ChannelOwner;
use crate::types::{ChannelName, ChannelState};

use super::{Entry, Load, Planner};

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
    /// Its weight (DESIGN §5); left out when 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub weight: u32,
    /// Its group, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Whether balance leaves it alone; left out when not.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pinned: bool,
}

fn one() -> u32 {
    1
}

fn is_one(w: &u32) -> bool {
    *w == 1
}

/// One node as `ctl nodes --json` prints it (DESIGN.md §7).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
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
    /// Its name (`node --name`; empty for a node that gave none).
    #[serde(default)]
    pub name: String,
    /// Its capacity (`--capacity`, at least 1).
    #[serde(default = "one")]
    pub capacity: u32,
    /// Sum of its channels' weights.
    #[serde(default)]
    pub weight: u64,
    /// Its load: `weight / capacity` (DESIGN §5).
    #[serde(default)]
    pub load: f64,
}

impl ChannelRow {
    /// The row of one assignment entry.
    #[must_use]
    pub fn of(e: &Entry) -> Self {
        ChannelRow {
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
            weight: e.info.weight.max(1),
            group: e.info.group.clone(),
            pinned: e.info.pinned,
        }
    }
}

impl Planner {
    /// One row per channel, for `ctl channels` and the admin API.
    pub fn channel_rows(&self) -> Vec<ChannelRow> {
        self.channels
            .values()
            .flat_map(|m| m.values())
            .map(ChannelRow::of)
            .collect()
    }

    /// One row per live node, for `ctl nodes` and the admin API: its keys (from the
    /// per-node counts the view keeps), capacity, weight and load.
    pub fn node_rows(&self) -> Vec<NodeRow> {
        self.nodes
            .iter()
            .map(|(id, s)| {
                let held = self.owned.get(id).copied().unwrap_or_default();
                let load = Load {
                    weight: held.weight,
                    capacity: s.load_capacity(),
                };
                NodeRow {
                    id: id.0,
                    admin_addr: s.admin_addr.clone(),
                    channels: held.keys,
                    started_at_ms: s.started_at_ms,
                    draining: self.draining.contains(id) || self.is_leaving(*id),
                    name: s.name.clone(),
                    capacity: s.capacity.max(1),
                    weight: held.weight,
                    load: load.value(),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use crate::keys::ChannelOwner;
    use crate::planner::tests::{info, n, World};
    use crate::planner::*;
    use crate::types::{ChannelState, NodeId};

    #[test]
    fn rows_show_parked_channels_without_a_node_and_count_each_nodes_channels() {
        let mut w = World::new(PlannerConfig::default());
        w.node(1);
        w.node(2);
        w.put(n(1), info("a", ChannelState::Watched, 2, 10));
        w.put(n(1), info("b", ChannelState::ToWatch, 1, 20));
        w.put(
            ChannelOwner::Remaining,
            info("c", ChannelState::ToWatch, 1, 30),
        );
        let txn = w.state.drain(NodeId(2)).expect("live");
        w.rev += 1;
        w.state.applied(&txn, w.rev);
        let rows = w.state.channel_rows();
        let rows: Vec<(&str, Option<u64>, ChannelState, u64, u64)> = rows
            .iter()
            .map(|r| {
                (
                    r.channel.as_str(),
                    r.node,
                    r.state,
                    r.epoch,
                    r.start_time_ms,
                )
            })
            .collect();
        assert_eq!(
            rows,
            [
                ("a", Some(1), ChannelState::Watched, 2, 10),
                ("b", Some(1), ChannelState::ToWatch, 1, 20),
                ("c", None, ChannelState::ToWatch, 1, 30),
            ]
        );
        let nodes: Vec<(u64, usize, bool)> = w
            .state
            .node_rows()
            .iter()
            .map(|r| (r.id, r.channels, r.draining))
            .collect();
        assert_eq!(nodes, [(1, 2, false), (2, 0, true)]);
    }
}
