//! `ctl status`: the control plane at a glance (DESIGN.md §8) — the leader coordinator and
//! the standbys (`{root}/coord/leader`, `{root}/coord/member/`), each etcd endpoint's own
//! status (health, version, raft leader and term, db size against the quota), alarms, drains,
//! fenced and paused nodes, channels counted by state, and the last compaction
//! (`{root}/coord/compact`).
//!
//! The quota: etcd 3.6+ says it in its status; for older members `ctl` reads
//! `etcd_server_quota_backend_bytes` from the endpoint's `/metrics` (plain http only), and
//! failing both assumes `--quota-backend-bytes` (default 2 GiB, etcd's own default). The
//! report says which (`quota_source`: `status`, `metrics` or `assumed`).
//!
//! Owns: gathering those facts (one range read, one status call per endpoint, one `/status`
//! per node) and printing them in every `-o` format. Must not: write anywhere, or fail when
//! one endpoint or node does not answer (that is a finding to show).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use chanwatch_core::planner::{Planner, PlannerConfig};
use chanwatch_core::{ChannelState, CoordSession, Keys};
use chanwatch_store::{EtcdConfig, EtcdStore, MetaStore};
use serde::Serialize;

use super::age;
use super::live::{self, NodeSays};
use super::output::{machine, Columns, Format};
use crate::flags::EtcdArgs;

/// etcd's default `--quota-backend-bytes` (2 GiB), assumed when a member does not say.
pub const DEFAULT_QUOTA: u64 = 2 * 1024 * 1024 * 1024;

/// How long one endpoint may take to answer.
const ENDPOINT_TIMEOUT: Duration = Duration::from_secs(2);

/// A coordinator as `{root}/coord/leader` or `{root}/coord/member/{id}` says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Coord {
    /// Its ID.
    pub id: String,
    /// Its admin API.
    pub admin_addr: String,
    /// Leading (or standing by) since, Unix ms.
    pub since_ms: u64,
}

impl From<CoordSession> for Coord {
    fn from(s: CoordSession) -> Self {
        Coord {
            id: s.id,
            admin_addr: s.admin_addr,
            since_ms: s.started_at_ms,
        }
    }
}

/// One etcd endpoint as it answered (or why it did not).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Endpoint {
    /// The URL asked.
    pub endpoint: String,
    /// Whether it answered its status call.
    pub healthy: bool,
    /// Why not, when it did not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The member's ID (hex, as etcdctl prints it).
    pub member_id: String,
    /// Its etcd version.
    pub version: String,
    /// The member it takes for the raft leader (hex; empty: none).
    pub raft_leader: String,
    /// Whether it is the raft leader itself.
    pub is_leader: bool,
    /// Its raft term.
    pub raft_term: u64,
    /// Its raft index.
    pub raft_index: u64,
    /// Bytes of its database file (what the quota limits).
    pub db_size: i64,
    /// Bytes of it in use.
    pub db_size_in_use: i64,
    /// The quota in bytes.
    pub quota: u64,
    /// Where the quota came from: `status` (etcd 3.6+), `metrics` (the endpoint's
    /// `etcd_server_quota_backend_bytes`) or `assumed` (`--quota-backend-bytes`).
    pub quota_source: &'static str,
    /// Whether it is a learner.
    pub is_learner: bool,
    /// Errors the member reports about itself.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}

/// A node that is not running its channels normally, or did not say.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeNote {
    /// Node ID.
    pub node: u64,
    /// Why.
    pub why: String,
}

/// The last compaction by a coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Compaction {
    /// The revision compacted to.
    pub revision: i64,
    /// The revision at which the leader wrote it (just before it compacted).
    pub written_at_revision: i64,
}

/// Everything `ctl status` shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The leader, if any.
    pub leader: Option<Coord>,
    /// The other live coordinators.
    pub standbys: Vec<Coord>,
    /// Each endpoint given in `--endpoints`.
    pub etcd: Vec<Endpoint>,
    /// etcd alarms (`NOSPACE on member 8e9e05c52164694d`).
    pub alarms: Vec<String>,
    /// Nodes being drained.
    pub drains: Vec<u64>,
    /// Nodes being fenced (their session lease revoked).
    pub fenced: Vec<u64>,
    /// Nodes that paused their channels.
    pub paused: Vec<NodeNote>,
    /// Nodes that did not say whether they are paused.
    pub unknown: Vec<NodeNote>,
    /// Live nodes.
    pub nodes: usize,
    /// Channels by state; parked ones count under `remaining` as well as under their state.
    pub channels: BTreeMap<String, usize>,
    /// All channels.
    pub channels_total: usize,
    /// The last compaction, when a coordinator has compacted.
    pub compaction: Option<Compaction>,
    /// The store's revision when read.
    pub revision: i64,
}

/// Gathers the report.
///
/// # Errors
/// The range read fails (etcd unreachable through every endpoint).
pub async fn gather(
    store: &Arc<dyn MetaStore>,
    keys: &Keys,
    etcd: &EtcdArgs,
    assumed_quota: u64,
) -> Result<Report> {
    let list = store.range(&keys.all_prefix()).await?;
    let mut state = Planner::new(keys.clone(), PlannerConfig::default());
    state.reset(
        list.kvs
            .iter()
            .map(|kv| (kv.key.as_str(), kv.value.as_slice(), kv.mod_revision)),
    );
    let (leader_key, members, fences, compact_key) = (
        keys.leader(),
        keys.coord_members_prefix(),
        keys.fences_prefix(),
        keys.compact(),
    );
    let mut leader = None;
    let mut standbys = Vec::new();
    let mut fenced = Vec::new();
    let mut compaction = None;
    for kv in &list.kvs {
        if kv.key == leader_key {
            leader = CoordSession::decode(&kv.value).ok().map(Coord::from);
        } else if kv.key.starts_with(&members) {
            if let Ok(s) = CoordSession::decode(&kv.value) {
                standbys.push(Coord::from(s));
            }
        } else if kv.key.starts_with(&fences) {
            if let Ok(id) = keys.parse_fence(&kv.key) {
                fenced.push(id.0);
            }
        } else if kv.key == compact_key {
            compaction = Some(Compaction {
                revision: std::str::from_utf8(&kv.value)
                    .ok()
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0),
                written_at_revision: kv.mod_revision,
            });
        }
    }
    if let Some(l) = &leader {
        standbys.retain(|s| s.id != l.id);
    }
    let mut channels: BTreeMap<String, usize> = ChannelState::ALL
        .iter()
        .map(|s| (s.as_str().to_owned(), 0))
        .collect();
    let rows = state.channel_rows();
    for r in &rows {
        *channels.entry(r.state.as_str().to_owned()).or_default() += 1;
        if r.node.is_none() {
            *channels.entry("remaining".to_owned()).or_default() += 1;
        }
    }
    channels.entry("remaining".to_owned()).or_default();
    let nodes = state.node_rows();
    let said = live::ask(&nodes).await;
    let (mut paused, mut unknown) = (Vec::new(), Vec::new());
    for (id, l) in said {
        match l {
            NodeSays::Paused(why) => paused.push(NodeNote { node: id, why }),
            NodeSays::Unknown(why) => unknown.push(NodeNote { node: id, why }),
            NodeSays::Running => {}
        }
    }
    let alarms = match store.alarms().await {
        Ok(a) => a
            .iter()
            .map(|a| format!("{} on member {:x}", a.kind, a.member))
            .collect(),
        Err(e) => vec![format!("unknown: cannot read alarms ({e})")],
    };
    let asks = etcd
        .endpoints
        .iter()
        .map(|e| endpoint(etcd, e.clone(), assumed_quota));
    Ok(Report {
        leader,
        standbys,
        etcd: futures_util::future::join_all(asks).await,
        alarms,
        drains: state.draining().iter().map(|n| n.0).collect(),
        fenced,
        paused,
        unknown,
        nodes: nodes.len(),
        channels,
        channels_total: rows.len(),
        compaction,
        revision: list.revision,
    })
}

impl Endpoint {
    /// `url` before it has answered anything: not healthy, the quota assumed.
    fn unasked(url: String, assumed_quota: u64) -> Endpoint {
        Endpoint {
            endpoint: url,
            healthy: false,
            error: None,
            member_id: String::new(),
            version: String::new(),
            raft_leader: String::new(),
            is_leader: false,
            raft_term: 0,
            raft_index: 0,
            db_size: 0,
            db_size_in_use: 0,
            quota: assumed_quota,
            quota_source: "assumed",
            is_learner: false,
            errors: Vec::new(),
        }
    }
}

/// Asks one endpoint alone.
async fn endpoint(etcd: &EtcdArgs, url: String, assumed_quota: u64) -> Endpoint {
    let mut out = Endpoint::unasked(url.clone(), assumed_quota);
    let config = EtcdConfig {
        endpoints: vec![url.clone()],
        connect_timeout: ENDPOINT_TIMEOUT,
        request_timeout: ENDPOINT_TIMEOUT,
        probe_key: None,
        ..etcd.config()
    };
    let asked = async {
        let store = EtcdStore::connect(config).await?;
        store.member_status().await
    };
    let s = match tokio::time::timeout(ENDPOINT_TIMEOUT * 2, asked).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            out.error = Some(e.to_string());
            return out;
        }
        Err(_) => {
            out.error = Some(format!("no answer within {:?}", ENDPOINT_TIMEOUT * 2));
            return out;
        }
    };
    out.healthy = s.errors.is_empty();
    out.member_id = format!("{:x}", s.member_id);
    out.version = s.version;
    out.raft_leader = if s.leader == 0 {
        String::new()
    } else {
        format!("{:x}", s.leader)
    };
    out.is_leader = s.leader != 0 && s.leader == s.member_id;
    out.raft_term = s.raft_term;
    out.raft_index = s.raft_index;
    out.db_size = s.db_size;
    out.db_size_in_use = s.db_size_in_use;
    out.is_learner = s.is_learner;
    out.errors = s.errors;
    if s.db_size_quota > 0 {
        out.quota = s.db_size_quota as u64;
        out.quota_source = "status";
    } else if let Some(q) = quota_from_metrics(&url).await {
        out.quota = q;
        out.quota_source = "metrics";
    }
    out
}

/// `etcd_server_quota_backend_bytes` from a plain-http endpoint's `/metrics`.
async fn quota_from_metrics(url: &str) -> Option<u64> {
    if !url.starts_with("http://") {
        return None;
    }
    let client = reqwest::Client::builder()
        .timeout(ENDPOINT_TIMEOUT)
        .build()
        .ok()?;
    let text = client
        .get(format!("{}/metrics", url.trim_end_matches('/')))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    parse_quota(&text)
}

/// The quota gauge's value in a Prometheus exposition.
fn parse_quota(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("etcd_server_quota_backend_bytes "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

/// Bytes as `12.3 MiB`.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

fn ids(list: &[u64]) -> String {
    if list.is_empty() {
        "none".into()
    } else {
        list.iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The report in the format asked for.
///
/// # Errors
/// The report does not serialize (a bug).
pub fn render(report: &Report, format: Format, now_ms: u64) -> Result<String> {
    if let Some(text) = machine(format, report)? {
        return Ok(text);
    }
    let wide = format == Format::Wide;
    let mut out = String::new();
    let coord = |c: &Coord| {
        format!(
            "{}  {}  since {} ago",
            c.id,
            c.admin_addr,
            age(now_ms.saturating_sub(c.since_ms))
        )
    };
    out += &format!(
        "Leader:      {}\n",
        report
            .leader
            .as_ref()
            .map_or_else(|| "none (no coordinator is leader)".into(), coord)
    );
    if report.standbys.is_empty() {
        out += "Standbys:    none\n";
    }
    for (i, s) in report.standbys.iter().enumerate() {
        let label = if i == 0 { "Standbys:" } else { "" };
        out += &format!("{label:<13}{}\n", coord(s));
    }
    out += "etcd:\n";
    let mut header = vec![
        "ENDPOINT", "HEALTH", "VERSION", "MEMBER", "LEADER", "TERM", "DB", "QUOTA", "USED",
    ];
    if wide {
        header.extend(["IN USE", "QUOTA FROM", "RAFT INDEX", "LEARNER", "ERRORS"]);
    }
    let mut t = Columns::new(&header, &[5, 6, 7, 8, 9, 11]);
    for e in &report.etcd {
        if !e.healthy && e.member_id.is_empty() {
            let mut cells = vec![e.endpoint.clone(), "DOWN".into()];
            cells.resize(header.len(), String::new());
            if wide {
                let last = cells.len() - 1;
                cells[last] = e.error.clone().unwrap_or_default();
            }
            t.row(cells);
            continue;
        }
        let leader = if e.is_leader {
            "*self*".to_owned()
        } else {
            e.raft_leader.clone()
        };
        let used = if e.quota > 0 {
            format!("{:.1}%", e.db_size as f64 * 100.0 / e.quota as f64)
        } else {
            String::new()
        };
        let quota = if e.quota_source == "assumed" {
            format!("{}?", bytes(e.quota))
        } else {
            bytes(e.quota)
        };
        let mut cells = vec![
            e.endpoint.clone(),
            if e.healthy { "ok" } else { "ERRORS" }.into(),
            e.version.clone(),
            e.member_id.clone(),
            leader,
            e.raft_term.to_string(),
            bytes(e.db_size.max(0) as u64),
            quota,
            used,
        ];
        if wide {
            cells.extend([
                bytes(e.db_size_in_use.max(0) as u64),
                e.quota_source.into(),
                e.raft_index.to_string(),
                if e.is_learner { "yes" } else { "" }.into(),
                e.errors.join("; "),
            ]);
        }
        t.row(cells);
    }
    for line in t.render().lines() {
        out += &format!("  {line}\n");
    }
    if report.etcd.iter().any(|e| e.quota_source == "assumed") {
        out += "  (QUOTA with ?: the member did not say; assumed --quota-backend-bytes)\n";
    }
    for e in report.etcd.iter().filter(|e| e.error.is_some()) {
        out += &format!(
            "  {}: {}\n",
            e.endpoint,
            e.error.as_deref().unwrap_or_default()
        );
    }
    out += &format!(
        "Alarms:      {}\n",
        if report.alarms.is_empty() {
            "none".into()
        } else {
            report.alarms.join(", ")
        }
    );
    out += &format!("Draining:    {}\n", ids(&report.drains));
    if !report.fenced.is_empty() {
        out += &format!("Fenced:      {}\n", ids(&report.fenced));
    }
    let notes = |list: &[NodeNote]| {
        list.iter()
            .map(|n| format!("{} ({})", n.node, n.why))
            .collect::<Vec<_>>()
            .join(", ")
    };
    out += &format!(
        "Paused:      {}\n",
        if report.paused.is_empty() {
            "none".into()
        } else {
            notes(&report.paused)
        }
    );
    if !report.unknown.is_empty() {
        out += &format!("Unknown:     {}\n", notes(&report.unknown));
    }
    out += &format!("Nodes:       {}\n", report.nodes);
    let by_state: Vec<String> = ChannelState::ALL
        .iter()
        .map(|s| s.as_str())
        .chain(["remaining"])
        .map(|s| {
            format!(
                "{s} {}",
                report.channels.get(s).copied().unwrap_or_default()
            )
        })
        .collect();
    out += &format!(
        "Channels:    {} ({})\n",
        report.channels_total,
        by_state.join(", ")
    );
    out += &match report.compaction {
        Some(c) => format!(
            "Compacted:   to revision {} (written at revision {}; the store is at {})\n",
            c.revision, c.written_at_revision, report.revision
        ),
        None => format!(
            "Compacted:   never by a coordinator (the store is at revision {})\n",
            report.revision
        ),
    };
    Ok(out)
}

#[cfg(test)]
mod tests;
