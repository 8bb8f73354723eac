//! The invariant checker of a simulation (DESIGN.md §6).
//!
//! The checks live beside this file by theme (`stability.rs`, `data.rs`, `settle.rs`), each
//! a set of methods on the one [`Checker`] and its one shadow of the key space.
//!
//! Owns: a shadow copy of the key space, rebuilt from every committed revision (through
//! [`chanwatch_store::EmbeddedStore::observe`], which no fault can break), the record of who
//! wrote each revision, and the list of violations.
//!
//! Checked on every revision: one assignment key per channel; epochs never go back and are
//! never reused by another owner; a node writes only keys that exist, of its own live
//! session, at the epoch already there (no stale ack or checkpoint); a coordinator writes only
//! while it holds the leader key; channels appear and disappear only by add and remove
//! requests. Checked after the run settles: see [`Checker::settled`]. Single ownership in time
//! is checked from the handler's intervals by [`overlaps`].
//!
//! Must not: drive the cluster or read the clock; the driver passes the time in.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use chanwatch_core::planner::Load;
use chanwatch_core::{
    ChannelInfo, ChannelName, ChannelOwner, ChannelState, CoordSession, Epoch, Keys, NodeId,
    NodeSession,
};
use chanwatch_node::Interval;
use chanwatch_store::{EventKind, KeyValue, Observed, Revision, WatchEvent};
use tokio::sync::mpsc;

mod data;
mod settle;
mod stability;
#[cfg(test)]
mod tests;

pub use settle::overlaps;

/// Who made a revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Writer {
    /// A coordinator, by its ID.
    Coord(String),
    /// A node process, by its slot in the simulation.
    Node(usize),
    /// The store itself (lease expiry).
    Store,
}

impl std::fmt::Display for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Writer::Coord(id) => write!(f, "{id}"),
            Writer::Node(slot) => write!(f, "proc{slot}"),
            Writer::Store => write!(f, "lease"),
        }
    }
}

/// Revision → writer, filled by the commit hooks of every actor's store.
pub type Writers = Arc<Mutex<BTreeMap<Revision, Writer>>>;

/// A time window during which a fault excuses two nodes running one channel at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Excuse {
    /// Whom it covers.
    pub scope: Scope,
    /// Unix ms, inclusive.
    pub from_ms: u64,
    /// Unix ms, inclusive.
    pub to_ms: u64,
}

/// What an [`Excuse`] covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every run of this node: it was frozen (`SIGSTOP`) and could not stop anything. This
    /// is the only fault that excuses an overlap; every other fault must be survived by
    /// break-before-make moves and fencing.
    Node(NodeId),
}

/// What [`Checker::outage_began`] remembers.
#[derive(Debug)]
struct Outage {
    until: Option<tokio::time::Instant>,
    grace: std::time::Duration,
    nodes: BTreeSet<NodeId>,
    procs: BTreeSet<String>,
}

/// The checker. Feed it with [`Checker::poll`] after every step.
#[derive(Debug)]
pub struct Checker {
    keys: Keys,
    rx: mpsc::UnboundedReceiver<Observed>,
    writers: Writers,
    kv: BTreeMap<String, KeyValue>,
    owners: BTreeMap<ChannelName, BTreeSet<ChannelOwner>>,
    max_epoch: BTreeMap<ChannelName, (Epoch, ChannelOwner)>,
    /// Channels the driver asked to add (granted or not).
    pub requested_adds: BTreeSet<ChannelName>,
    /// Channels the driver asked to remove (granted or not).
    pub requested_removes: BTreeSet<ChannelName>,
    /// What went wrong, with the revision or time.
    pub violations: Vec<String>,
    /// The last revision seen.
    pub revision: Revision,
    /// The planner's failing-node back-off: a channel must not be put back on a node that
    /// failed it within this long while another node could take it (invariant 7).
    pub failed_node_backoff: std::time::Duration,
    /// A store-wide outage being watched (invariant 9): its start, its end once known, and
    /// the nodes (IDs and process names) with a session when it began.
    outage: Option<Outage>,
    /// When each node last wrote `WatchFailed` for each channel.
    failed: BTreeMap<(ChannelName, NodeId), tokio::time::Instant>,
    /// When the current leader took the leader key: back-offs live in the leader's memory,
    /// so a new leader knows only failures it sees in the store (one retry per leader
    /// change is within invariant 7: at most one move per fault).
    term_since: Option<tokio::time::Instant>,
    /// The last committed checkpoint position of each channel (data plane), dropped when its
    /// checkpoint is deleted.
    positions: BTreeMap<ChannelName, u64>,
    /// Planned restarts under way (`departures.rs`).
    pub departures: crate::departures::Departures,
    /// Nodes ever asked to leave (their shutdown timeout may end them during an outage).
    asked_to_leave: BTreeSet<NodeId>,
}

impl Checker {
    /// A checker reading `rx` (opened before any write) under `keys`.
    pub fn new(keys: Keys, rx: mpsc::UnboundedReceiver<Observed>, writers: Writers) -> Self {
        Checker {
            keys,
            rx,
            writers,
            kv: BTreeMap::new(),
            owners: BTreeMap::new(),
            max_epoch: BTreeMap::new(),
            requested_adds: BTreeSet::new(),
            requested_removes: BTreeSet::new(),
            violations: Vec::new(),
            revision: 0,
            failed_node_backoff: std::time::Duration::ZERO,
            failed: BTreeMap::new(),
            outage: None,
            term_since: None,
            positions: BTreeMap::new(),
            departures: Default::default(),
            asked_to_leave: BTreeSet::new(),
        }
    }

    /// Applies and checks every revision committed since the last call; each becomes a
    /// trace line through `trace`.
    pub fn poll(&mut self, trace: &mut dyn FnMut(tokio::time::Instant, String)) {
        while let Ok(Observed {
            revision: rev,
            at,
            events,
        }) = self.rx.try_recv()
        {
            let writer = self
                .writers
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&rev)
                .unwrap_or(Writer::Store);
            self.revision = rev;
            for e in events.iter() {
                trace(at, format!("r{rev} {writer} {}", self.describe(e)));
            }
            self.check_churn(rev, at, &writer, &events);
            self.check_static_stability(rev, at, &writer, &events);
            self.check_checkpoints(rev, &writer, &events);
            self.check_revision(rev, &writer, &events);
            for f in self.departures.observe(&self.keys, &self.kv, &events) {
                self.violation(rev, f);
            }
        }
    }

    /// Node `node` begins a planned restart (see `departures.rs`).
    pub fn planned_restart(&mut self, node: NodeId) {
        self.departures.begin(&self.keys, &self.kv, node);
        self.asked_to_leave.insert(node);
    }

    fn describe(&self, e: &WatchEvent) -> String {
        let key = e.kv.key.strip_prefix(self.keys.root()).unwrap_or(&e.kv.key);
        match e.kind {
            EventKind::Delete => format!("del {key}"),
            EventKind::Put => match ChannelInfo::decode(&e.kv.value) {
                Ok(i) if self.keys.parse_channel(&e.kv.key).is_ok() => {
                    let progress = i.progress.map(|p| format!(" {}%", p.percent));
                    format!(
                        "put {key} {} {}{}",
                        i.state,
                        i.epoch,
                        progress.unwrap_or_default()
                    )
                }
                _ => format!("put {key}"),
            },
        }
    }

    fn violation(&mut self, rev: Revision, what: String) {
        self.violations.push(format!("r{rev}: {what}"));
    }

    fn session_alive(&self, node: NodeId) -> bool {
        self.kv.contains_key(&self.keys.session(node))
    }

    fn check_revision(&mut self, rev: Revision, writer: &Writer, events: &[WatchEvent]) {
        // Checks against the state before the revision.
        match writer {
            Writer::Coord(id) => {
                let leader = self.keys.leader();
                // A campaign writes the leader key; every campaign, a standby's too, puts the
                // coordinator's own member key (`ctl status` lists the standbys from them).
                let own = self.keys.coord_member(id);
                let campaign = events.iter().any(|e| e.kv.key == leader)
                    || events.iter().all(|e| e.kv.key == own);
                let holder = self
                    .kv
                    .get(&leader)
                    .and_then(|kv| CoordSession::decode(&kv.value).ok())
                    .map(|s| s.id);
                if !campaign && holder.as_deref() != Some(id.as_str()) {
                    self.violation(
                        rev,
                        format!("{id} wrote while the leader key was held by {holder:?}"),
                    );
                }
            }
            Writer::Node(slot) => {
                for e in events {
                    let Ok(ck) = self.keys.parse_channel(&e.kv.key) else {
                        continue;
                    };
                    let ChannelOwner::Node(owner) = ck.owner else {
                        self.violation(rev, format!("proc{slot} wrote {}", e.kv.key));
                        continue;
                    };
                    if !self.session_alive(owner) {
                        self.violation(
                            rev,
                            format!("proc{slot} wrote {} after session {owner} ended", e.kv.key),
                        );
                    }
                    let before = self
                        .kv
                        .get(&e.kv.key)
                        .and_then(|kv| ChannelInfo::decode(&kv.value).ok());
                    let after = ChannelInfo::decode(&e.kv.value).ok();
                    match (e.kind, before, after) {
                        (EventKind::Put, None, _) => self.violation(
                            rev,
                            format!("proc{slot} created {} (a stale ack landed)", e.kv.key),
                        ),
                        (EventKind::Put, Some(b), Some(a)) if a.epoch != b.epoch => self
                            .violation(
                                rev,
                                format!(
                                    "proc{slot} wrote {} at epoch {} over epoch {} (stale ack or checkpoint)",
                                    e.kv.key, a.epoch, b.epoch
                                ),
                            ),
                        (EventKind::Delete, _, _) => {
                            self.violation(rev, format!("proc{slot} deleted {}", e.kv.key))
                        }
                        _ => {}
                    }
                }
            }
            Writer::Store => {
                for e in events {
                    if self.keys.parse_channel(&e.kv.key).is_ok() {
                        self.violation(rev, format!("a lease expiry touched {}", e.kv.key));
                    }
                }
            }
        }
        // Apply, then check the state after.
        let mut touched = BTreeMap::new();
        for e in events {
            if let Ok(ck) = self.keys.parse_channel(&e.kv.key) {
                let had = self.owners.get(&ck.channel).is_some_and(|o| !o.is_empty());
                touched.entry(ck.channel.clone()).or_insert(had);
                let owners = self.owners.entry(ck.channel.clone()).or_default();
                match e.kind {
                    EventKind::Put => {
                        owners.insert(ck.owner);
                    }
                    EventKind::Delete => {
                        owners.remove(&ck.owner);
                    }
                }
                if e.kind == EventKind::Put {
                    self.check_epoch(rev, &ck.channel, ck.owner, &e.kv.value);
                }
            }
            match e.kind {
                EventKind::Put => {
                    self.kv.insert(e.kv.key.clone(), e.kv.clone());
                }
                EventKind::Delete => {
                    self.kv.remove(&e.kv.key);
                }
            }
        }
        for (channel, had) in touched {
            let owners = self.owners.get(&channel).cloned().unwrap_or_default();
            if owners.len() > 1 {
                self.violation(
                    rev,
                    format!("{channel} has {} assignment keys: {owners:?}", owners.len()),
                );
            }
            // Only a coordinator, asked to, may make a channel appear or vanish.
            let allowed = |asked: &BTreeSet<ChannelName>| {
                matches!(writer, Writer::Coord(_)) && asked.contains(&channel)
            };
            let appeared = !had && !owners.is_empty();
            let vanished = had && owners.is_empty();
            if appeared && !allowed(&self.requested_adds) {
                self.violation(
                    rev,
                    format!("{channel} appeared without an add (by {writer})"),
                );
            }
            if vanished && !allowed(&self.requested_removes) {
                self.violation(
                    rev,
                    format!("{channel} vanished without a remove (by {writer})"),
                );
            }
        }
    }

    fn check_epoch(&mut self, rev: Revision, channel: &ChannelName, owner: ChannelOwner, v: &[u8]) {
        let info = match ChannelInfo::decode(v) {
            Ok(i) => i,
            Err(e) => {
                self.violation(rev, format!("{channel}: value does not decode: {e}"));
                return;
            }
        };
        match self.max_epoch.get(channel).copied() {
            Some((max, _)) if info.epoch < max => self.violation(
                rev,
                format!("{channel}: epoch went back from {max} to {}", info.epoch),
            ),
            // Parking keeps the epoch (no node owns it); any other new owner needs a new one.
            Some((max, by))
                if info.epoch == max && by != owner && owner != ChannelOwner::Remaining =>
            {
                self.violation(
                    rev,
                    format!("{channel}: epoch {max} reused by {owner} after {by}"),
                );
            }
            _ => {}
        }
        let entry = self
            .max_epoch
            .entry(channel.clone())
            .or_insert((info.epoch, owner));
        if info.epoch >= entry.0 {
            *entry = (info.epoch, owner);
        }
    }
}
