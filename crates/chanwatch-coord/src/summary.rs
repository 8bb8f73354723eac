//! What the status page polls, kept small at 10,000 channels / 100 nodes: the cluster
//! [`Summary`] (counts by state, each node's load, the leader and standbys, the store's health
//! as the leader sees it, the parked and unsettled channels, capped) and one filtered,
//! naturally sorted [`ChannelPage`] of channel rows.
//!
//! Owns: those reads — the leader's view (through the term, like `detail.rs`), one range of
//! `{root}/coord/` (leader, standbys, compaction record, fences) and the store's alarms per
//! summary, with what the nodes last said about pausing (`probe.rs`) — and the natural
//! order of channel names. Must not: write anything, or hold the
//! term's loop longer than one pass over the view (sorting and paging happen after it).

use std::collections::BTreeMap;

use chanwatch_core::planner::{ChannelRow, Entry, Planner};
use chanwatch_core::{ChannelOwner, ChannelState, CoordSession};
use serde::{Deserialize, Serialize};

use crate::events::HistoryInfo;
use crate::handle::{ApiError, CoordHandle};
use crate::probe::NodeSays;

/// How many parked and how many unsettled channels a summary names (it counts them all).
pub const SUMMARY_LIST: usize = 20;

/// Most rows one [`ChannelPage`] carries.
pub const MAX_PAGE: usize = 500;

/// `GET /api/v1/summary`: the cluster at a glance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// When the leader answered (Unix ms, its clock).
    pub time_ms: u64,
    /// The leader as `{root}/coord/leader` says (`null`: the store did not answer).
    pub leader: Option<CoordInfo>,
    /// The other live coordinators (`{root}/coord/member/`).
    pub standbys: Vec<CoordInfo>,
    /// The store as the leader sees it.
    pub store: StoreHealth,
    /// Channels by state.
    pub channels: Counts,
    /// Every live node, by ID.
    pub nodes: Vec<NodeLoad>,
    /// Channels parked under `remaining` (no node has room, or none is live).
    pub remaining: Capped,
    /// Channels under a node but not `Watched`: loading, failed, releasing, moving.
    pub unsettled: Capped,
    /// The leader's event history (what `GET /api/v1/events?since=` counts in).
    pub history: HistoryInfo,
    /// The nodes that said their channels are paused (each node's own `GET /status`).
    pub paused: PausedNodes,
}

/// What the nodes said about pausing: the leader asks them (a paused node cannot tell the
/// store) at most every few seconds while summaries are read; a summary carries the last
/// answers and never waits for them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PausedNodes {
    /// How long ago the answers came (`null`: the nodes are being asked for the first time).
    pub asked_ms_ago: Option<u64>,
    /// Nodes whose channels are paused.
    pub nodes: usize,
    /// Channels on those nodes.
    pub channels: usize,
    /// Nodes that did not answer.
    pub unknown: usize,
    /// Nodes with no admin HTTP in their session (not asked: in-process nodes, say).
    pub no_admin: usize,
}

/// A coordinator: the leader or a standby.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoordInfo {
    /// Its `--id`.
    pub id: String,
    /// Its admin API.
    pub admin_addr: String,
    /// When it started (Unix ms).
    pub since_ms: u64,
    /// For the leader: the create revision of its leader key, which names its term (every
    /// write of the term is guarded by it). 0 for a standby.
    pub term: i64,
}

/// The store's health as the leader sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreHealth {
    /// Whether this summary's reads of the store succeeded.
    pub reachable: bool,
    /// Why not, when they did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The store's revision at the read (0: not read).
    pub revision: i64,
    /// Bytes of the database as last read by the leader's upkeep (0: not known — the embedded
    /// store has no file, or not read yet).
    pub db_bytes: i64,
    /// Its quota as `chanwatch_etcd_quota_bytes` exports it: etcd's own (3.6+), else `coord
    /// --quota-backend-bytes` (0: not known yet).
    pub quota_bytes: i64,
    /// The revision last compacted to (`{root}/coord/compact`; 0: never).
    pub compacted_to: i64,
    /// The store revision at which that compaction was recorded.
    pub compacted_at_revision: i64,
    /// Alarms the store raised (`NOSPACE on member 8e9e…`).
    pub alarms: Vec<String>,
    /// Keys under the root that do not decode (left alone, reported).
    pub corrupt: usize,
}

/// Channels counted by state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// All channels (keys; a duplicate awaiting clean-up counts twice).
    pub total: usize,
    /// Per state name (`Watched`, `ToWatch`, …), every state present.
    pub by_state: BTreeMap<String, usize>,
    /// Under `remaining` (also counted under their state).
    pub remaining: usize,
    /// Moves in flight.
    pub moving: usize,
}

/// One node's load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeLoad {
    /// Node ID.
    pub id: u64,
    /// Its `--name` (empty when it gave none).
    pub name: String,
    /// Channels it holds.
    pub channels: usize,
    /// Sum of their weights.
    pub weight: u64,
    /// Its capacity.
    pub capacity: u32,
    /// `weight / capacity`.
    pub load: f64,
    /// It carries a drain mark.
    pub draining: bool,
    /// It announced it is leaving (a planned restart).
    pub leaving: bool,
    /// The leader is fencing it (revoking its session).
    pub fenced: bool,
    /// Its admin HTTP, as its session says (empty: none).
    pub admin_addr: String,
    /// Whether it says its channels are paused (`null`: not asked yet, or no answer).
    pub paused: Option<bool>,
    /// Why paused, in its words; or why its answer is not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_reason: Option<String>,
}

/// A count and the first few in natural order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capped {
    /// How many there are.
    pub count: usize,
    /// The first [`SUMMARY_LIST`] of them.
    pub first: Vec<Brief>,
}

/// A channel named in a summary list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Brief {
    /// The channel.
    pub channel: String,
    /// Its node (`null`: `remaining`).
    pub node: Option<u64>,
    /// Its state.
    pub state: ChannelState,
    /// Why, when recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Which channels a page shows (every field optional: all channels).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChannelFilter {
    /// Part of the name, without case.
    pub name: Option<String>,
    /// The owner: a node, or `remaining`.
    pub owner: Option<ChannelOwner>,
    /// The state.
    pub state: Option<ChannelState>,
}

/// `GET /api/v1/channels?…&offset=&limit=`: one page of the matching rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChannelPage {
    /// How many channels match the filter.
    pub total: usize,
    /// Rows skipped before this page.
    pub offset: usize,
    /// Most rows asked for.
    pub limit: usize,
    /// The rows, in natural order of channel, then node.
    pub rows: Vec<ChannelRow>,
}

pub use chanwatch_core::natural;

fn brief(e: &Entry) -> Brief {
    Brief {
        channel: e.info.channel.to_string(),
        node: match e.owner {
            ChannelOwner::Node(n) => Some(n.0),
            ChannelOwner::Remaining => None,
        },
        state: e.info.state,
        reason: e.info.reason.clone(),
    }
}

fn capped(mut all: Vec<Brief>) -> Capped {
    let count = all.len();
    all.sort_by(|a, b| natural(&a.channel, &b.channel));
    all.truncate(SUMMARY_LIST);
    Capped { count, first: all }
}

/// What one pass over the leader's view gathers for a summary.
struct ViewPart {
    counts: Counts,
    nodes: Vec<NodeLoad>,
    remaining: Vec<Brief>,
    unsettled: Vec<Brief>,
    corrupt: usize,
}

fn view_part(p: &Planner) -> ViewPart {
    let census = p.census();
    let by_state = ChannelState::ALL
        .iter()
        .zip(census.by_state)
        .map(|(s, n)| (s.as_str().to_owned(), n))
        .collect::<BTreeMap<_, _>>();
    let total: usize = census.by_state.iter().sum();
    let not_watched = total - by_state.get("Watched").copied().unwrap_or(0);
    let (mut remaining, mut unsettled) = (Vec::new(), Vec::new());
    // Most of the time every channel is Watched under a node: no pass over them at all.
    if census.remaining > 0 || not_watched > 0 {
        for e in p.entries() {
            if e.owner == ChannelOwner::Remaining {
                remaining.push(brief(e));
            } else if e.info.state != ChannelState::Watched {
                unsettled.push(brief(e));
            }
        }
    }
    let fenced: std::collections::BTreeSet<u64> = p.fencing().map(|n| n.0).collect();
    let nodes = p
        .node_rows()
        .into_iter()
        .map(|r| {
            let id = chanwatch_core::NodeId(r.id);
            NodeLoad {
                draining: p.draining().contains(&id),
                leaving: p.nodes().get(&id).is_some_and(|s| s.leaving()),
                fenced: fenced.contains(&r.id),
                id: r.id,
                name: r.name,
                channels: r.channels,
                weight: r.weight,
                capacity: r.capacity,
                load: r.load,
                admin_addr: r.admin_addr,
                paused: None,
                paused_reason: None,
            }
        })
        .collect();
    ViewPart {
        counts: Counts {
            total,
            by_state,
            remaining: census.remaining,
            moving: p.moves_in_flight(),
        },
        nodes,
        remaining,
        unsettled,
        corrupt: p.corrupt().len(),
    }
}

impl CoordHandle {
    /// The cluster at a glance, for the status page: one pass over the leader's view, one
    /// range of `{root}/coord/` and the store's alarms. A store that does not answer is a
    /// finding (`store.reachable: false`), not an error.
    ///
    /// # Errors
    /// [`ApiError::NotLeader`] on a standby.
    pub async fn summary(&self) -> Result<Summary, ApiError> {
        let mut part = self.view(view_part).await?;
        let paused = self.mark_paused(&mut part.nodes);
        let r = self.reads();
        let mut store = StoreHealth {
            reachable: true,
            error: None,
            revision: 0,
            db_bytes: self.metrics().db_bytes(),
            quota_bytes: self.metrics().quota_bytes(),
            compacted_to: 0,
            compacted_at_revision: 0,
            alarms: Vec::new(),
            corrupt: part.corrupt,
        };
        let (mut leader, mut standbys) = (None, Vec::new());
        let coord_prefix = format!("{}/coord/", r.keys.root());
        let (leader_key, members, compact) = (
            r.keys.leader(),
            r.keys.coord_members_prefix(),
            r.keys.compact(),
        );
        match r.store.range(&coord_prefix).await {
            Ok(list) => {
                store.revision = list.revision;
                for kv in &list.kvs {
                    if kv.key == leader_key {
                        leader = CoordSession::decode(&kv.value)
                            .ok()
                            .map(|s| coord_info(s, kv.create_revision));
                    } else if kv.key.starts_with(&members) {
                        if let Ok(s) = CoordSession::decode(&kv.value) {
                            standbys.push(coord_info(s, 0));
                        }
                    } else if kv.key == compact {
                        store.compacted_to = std::str::from_utf8(&kv.value)
                            .ok()
                            .and_then(|v| v.trim().parse().ok())
                            .unwrap_or(0);
                        store.compacted_at_revision = kv.mod_revision;
                    }
                }
            }
            Err(e) => {
                store.reachable = false;
                store.error = Some(e.to_string());
            }
        }
        if let Some(l) = &leader {
            standbys.retain(|s| s.id != l.id);
        }
        if store.reachable {
            match r.store.alarms().await {
                Ok(a) => {
                    store.alarms = a
                        .iter()
                        .map(|a| format!("{} on member {:x}", a.kind, a.member))
                        .collect();
                }
                Err(e) => {
                    store.reachable = false;
                    store.error = Some(format!("cannot read alarms: {e}"));
                }
            }
        }
        Ok(Summary {
            time_ms: r.clock.unix_ms(),
            leader,
            standbys,
            store,
            channels: part.counts,
            nodes: part.nodes,
            remaining: capped(part.remaining),
            unsettled: capped(part.unsettled),
            history: self.events().info(),
            paused,
        })
    }

    /// Marks each node with what it last said about pausing, and counts; asks again in the
    /// background when those answers are old (`probe.rs`).
    fn mark_paused(&self, nodes: &mut [NodeLoad]) -> PausedNodes {
        let ask = nodes.iter().map(|n| (n.id, n.admin_addr.clone())).collect();
        let answers = self.probe().answers(ask);
        let mut out = PausedNodes {
            asked_ms_ago: answers.at.map(|t| chanwatch_store::millis(t.elapsed())),
            ..PausedNodes::default()
        };
        for n in nodes {
            match answers.nodes.get(&n.id) {
                Some(NodeSays::Running) => n.paused = Some(false),
                Some(NodeSays::Paused(why)) => {
                    n.paused = Some(true);
                    n.paused_reason = Some(why.clone());
                    out.nodes += 1;
                    out.channels += n.channels;
                }
                Some(NodeSays::Unknown(why)) => {
                    n.paused_reason = Some(format!("unknown: {why}"));
                    if n.admin_addr.is_empty() {
                        out.no_admin += 1;
                    } else {
                        out.unknown += 1;
                    }
                }
                // Joined since the last round: asked in the next.
                None => {}
            }
        }
        out
    }

    /// The channels `filter` lets through, in natural order, `limit` (at most [`MAX_PAGE`])
    /// from `offset`. The leader's loop only picks the rows; sorting happens here.
    ///
    /// # Errors
    /// [`ApiError::NotLeader`] on a standby.
    pub async fn channel_page(
        &self,
        filter: ChannelFilter,
        offset: usize,
        limit: usize,
    ) -> Result<ChannelPage, ApiError> {
        let needle = filter.name.as_ref().map(|n| n.to_ascii_lowercase());
        let (owner, state) = (filter.owner, filter.state);
        let mut rows = self
            .view(move |p| {
                p.entries()
                    .filter(|e| owner.map_or(true, |o| e.owner == o))
                    .filter(|e| state.map_or(true, |s| e.info.state == s))
                    .filter(|e| {
                        needle.as_ref().map_or(true, |n| {
                            e.info
                                .channel
                                .as_str()
                                .to_ascii_lowercase()
                                .contains(n.as_str())
                        })
                    })
                    .map(ChannelRow::of)
                    .collect::<Vec<_>>()
            })
            .await?;
        rows.sort_by(|a, b| {
            natural(a.channel.as_str(), b.channel.as_str()).then(a.node.cmp(&b.node))
        });
        let total = rows.len();
        let limit = limit.min(MAX_PAGE);
        let rows = rows.into_iter().skip(offset).take(limit).collect();
        Ok(ChannelPage {
            total,
            offset,
            limit,
            rows,
        })
    }
}

fn coord_info(s: CoordSession, term: i64) -> CoordInfo {
    CoordInfo {
        id: s.id,
        admin_addr: s.admin_addr,
        since_ms: s.started_at_ms,
        term,
    }
}
