//! `ctl channels`: one line per assignment, with what `-o wide` and `-o json|yaml` add — the
//! vchannel info and the channel's checkpoint (position, epoch, age) — and the `--node` /
//! `--state` filters.
//!
//! The checkpoints come from the same single range read as the assignments (`{root}/` holds
//! `{root}/worker/checkpoint/`): no read per channel, and assignment and checkpoint are of one
//! revision.
//!
//! Owns: joining assignments, vchannel infos and checkpoints into [`Line`]s, and their table.
//! Must not: read the store or the network itself (the caller hands it the listed keys).

use std::collections::{BTreeMap, HashMap};

use chanwatch_core::planner::ChannelRow;
use chanwatch_core::{ChannelInfo, ChannelName, ChannelOwner, Checkpoint, Keys, VChannelInfo};
use chanwatch_store::KeyValue;
use serde::Serialize;

use super::live::{self, NodeSays};
use super::output::{natural, Columns};

/// Which channels to show.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this owner (`None`: any).
    pub owner: Option<ChannelOwner>,
    /// Only this state, by name without case (`None`: any).
    pub state: Option<chanwatch_core::ChannelState>,
}

/// A channel's checkpoint as `ctl` shows it (its state is left out: it is the handler's).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct CheckpointLine {
    /// Opaque stream position.
    pub position: String,
    /// The epoch of the assignment it was written under.
    pub epoch: u64,
    /// When it was written (Unix ms, the writer's clock).
    pub updated_at_ms: u64,
    /// Now minus `updated_at_ms`, in ms (0 when the writer's clock is ahead).
    pub age_ms: u64,
}

/// One channel line: the row of `ctl channels --json` before `-o` (its fields unchanged)
/// plus `paused`, `vchannel` and `checkpoint`.
#[derive(Debug, Clone, Serialize)]
pub struct Line {
    /// The assignment.
    #[serde(flatten)]
    pub row: ChannelRow,
    /// Whether its node says it is paused (`null`: parked, or the node did not say).
    pub paused: Option<bool>,
    /// What a node needs to restore it; `null` when read through `--admin`, whose list does
    /// not carry it (`describe channel` shows it).
    pub vchannel: Option<VChannelInfo>,
    /// Its checkpoint, `null` when none was committed yet.
    pub checkpoint: Option<CheckpointLine>,
}

/// Joins `rows` with the vchannel infos and checkpoints found in `kvs` (the list the rows were
/// made from), keeps those `filter` lets through, and sorts them naturally by channel, then
/// owner. Checkpoints that do not decode are reported on stderr and shown as absent.
pub fn lines(
    keys: &Keys,
    kvs: &[KeyValue],
    rows: Vec<ChannelRow>,
    live: &BTreeMap<u64, NodeSays>,
    filter: &Filter,
    now_ms: u64,
) -> Vec<Line> {
    let mut vchannels: HashMap<(ChannelName, Option<u64>), VChannelInfo> = HashMap::new();
    let mut checkpoints: HashMap<ChannelName, CheckpointLine> = HashMap::new();
    for kv in kvs {
        if let Ok(k) = keys.parse_channel(&kv.key) {
            if let Ok(info) = ChannelInfo::decode(&kv.value) {
                let node = match k.owner {
                    ChannelOwner::Node(n) => Some(n.0),
                    ChannelOwner::Remaining => None,
                };
                vchannels.insert((k.channel, node), info.vchannel);
            }
        } else if let Ok(channel) = keys.parse_checkpoint(&kv.key) {
            match Checkpoint::decode(&kv.value) {
                Ok(cp) => {
                    checkpoints.insert(
                        channel,
                        CheckpointLine {
                            position: cp.position,
                            epoch: cp.epoch.0,
                            updated_at_ms: cp.updated_at_ms,
                            age_ms: now_ms.saturating_sub(cp.updated_at_ms),
                        },
                    );
                }
                Err(e) => eprintln!("warning: {} does not decode ({e}); shown as none", kv.key),
            }
        }
    }
    let wanted = |r: &ChannelRow| {
        let owner_ok = filter.owner.map_or(true, |o| {
            r.node
                == match o {
                    ChannelOwner::Node(n) => Some(n.0),
                    ChannelOwner::Remaining => None,
                }
        });
        owner_ok && filter.state.map_or(true, |s| s == r.state)
    };
    let mut out: Vec<Line> = rows
        .into_iter()
        .filter(wanted)
        .map(|row| Line {
            paused: row
                .node
                .and_then(|n| live.get(&n))
                .and_then(|l| live::fields(l).0.as_bool()),
            vchannel: vchannels.remove(&(row.channel.clone(), row.node)),
            checkpoint: checkpoints.get(&row.channel).cloned(),
            row,
        })
        .collect();
    out.sort_by(|a, b| {
        natural(a.row.channel.as_str(), b.row.channel.as_str()).then(a.row.node.cmp(&b.row.node))
    });
    out
}

/// The vchannel info in one short cell: collection, seek position and segment counts, cut
/// at 32 characters; `-` when empty.
pub fn vchannel_cell(v: &VChannelInfo) -> String {
    let mut parts = Vec::new();
    if v.collection_id != 0 {
        parts.push(format!("coll={}", v.collection_id));
    }
    if let Some(seek) = &v.seek_position {
        parts.push(format!("seek={seek}"));
    }
    let segs = v.unflushed_segment_ids.len() + v.flushed_segment_ids.len();
    if segs > 0 {
        parts.push(format!("segs={segs}"));
    }
    if !v.metadata.is_empty() || !v.extra.is_empty() {
        parts.push("+".into());
    }
    if parts.is_empty() {
        return "-".into();
    }
    let all = parts.join(" ");
    if all.chars().count() > 32 {
        let cut: String = all.chars().take(31).collect();
        format!("{cut}…")
    } else {
        all
    }
}

/// The table (`wide` adds weight, group, pinned, vchannel and checkpoint columns). `age` formats a duration in ms.
pub fn table(lines: &[Line], wide: bool, age: impl Fn(u64) -> String, now_ms: u64) -> String {
    let mut header = vec!["CHANNEL", "NODE", "STATE", "EPOCH", "AGE", "NODE SAYS"];
    let mut right = vec![1, 3, 4];
    if wide {
        header.extend(["WEIGHT", "GROUP", "PINNED"]);
        header.extend(["VCHANNEL", "POSITION", "CP EPOCH", "CP AGE"]);
        right.extend([6, 11, 12]);
    }
    let mut t = Columns::new(&header, &right);
    for l in lines {
        let r = &l.row;
        let says = match l.paused {
            Some(true) => "PAUSED",
            Some(false) => "running",
            None if r.node.is_some() => "?",
            None => "",
        };
        let mut cells = vec![
            r.channel.to_string(),
            r.node
                .map_or_else(|| "remaining".to_owned(), |n| n.to_string()),
            r.state.as_str().to_owned(),
            r.epoch.to_string(),
            age(now_ms.saturating_sub(r.start_time_ms)),
            says.to_owned(),
        ];
        if wide {
            cells.extend([
                r.weight.to_string(),
                r.group.clone().unwrap_or_else(|| "-".into()),
                if r.pinned { "pinned" } else { "-" }.to_owned(),
            ]);
            cells.push(
                l.vchannel
                    .as_ref()
                    .map_or_else(|| "-".to_owned(), vchannel_cell),
            );
            match &l.checkpoint {
                Some(cp) => {
                    cells.extend([cp.position.clone(), cp.epoch.to_string(), age(cp.age_ms)])
                }
                None => cells.extend(["-".into(), "-".into(), "-".into()]),
            }
        }
        t.row(cells);
    }
    t.render()
}

/// One line per channel waiting under `remaining` with a reason (no room under
/// `--max-load`, no live node): the table has no room for it.
pub fn parked_lines(lines: &[Line]) -> String {
    lines
        .iter()
        .filter(|l| l.row.node.is_none())
        .filter_map(|l| {
            let why = l.row.reason.as_deref()?;
            Some(format!("{} waits in remaining: {why}\n", l.row.channel))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vchannel_cell_is_short() {
        assert_eq!(vchannel_cell(&VChannelInfo::default()), "-");
        let v = VChannelInfo::from_json(
            br#"{"collection_id":7,"seek_position":"p-42","flushed_segment_ids":[1,2]}"#,
        )
        .expect("vchannel");
        assert_eq!(vchannel_cell(&v), "coll=7 seek=p-42 segs=2");
        let long = VChannelInfo::from_json(
            format!(r#"{{"seek_position":"{}"}}"#, "x".repeat(100)).as_bytes(),
        )
        .expect("vchannel");
        assert_eq!(vchannel_cell(&long).chars().count(), 32);
    }
}
