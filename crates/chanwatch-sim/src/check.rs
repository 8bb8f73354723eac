//! The invariant checker of a simulation (DESIGN.md §6).
//!
//! Over 600 lines on purpose: one shadow of the key space that every invariant reads; each
//! check is a short method beside the others that use the same records.
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

    /// The whole store went away (no leader): from now until `grace` after it returns, no
    /// node that has a session now may register again, and none of its channels may be
    /// failed over (invariant 9, static stability).
    pub fn outage_began(&mut self, grace: std::time::Duration) {
        let mut nodes = BTreeSet::new();
        let mut procs = BTreeSet::new();
        // A node already being fenced (it did not release in time, before the outage) is
        // the fence's doing when it registers again, not the outage's.
        let fenced: BTreeSet<NodeId> = self
            .kv
            .keys()
            .filter_map(|k| self.keys.parse_fence(k).ok())
            .collect();
        for kv in self.kv.values() {
            if let Ok(id) = self.keys.parse_session(&kv.key) {
                if fenced.contains(&id) {
                    continue;
                }
                nodes.insert(id);
                if let Ok(s) = chanwatch_core::NodeSession::decode(&kv.value) {
                    procs.insert(s.admin_addr);
                }
            }
        }
        self.outage = Some(Outage {
            until: None,
            grace,
            nodes,
            procs,
        });
    }

    /// The store is back at `at`.
    pub fn outage_ended(&mut self, at: tokio::time::Instant) {
        if let Some(o) = &mut self.outage {
            o.until = Some(at);
        }
    }

    fn check_static_stability(
        &mut self,
        rev: Revision,
        at: tokio::time::Instant,
        writer: &Writer,
        events: &[WatchEvent],
    ) {
        let Some(o) = &self.outage else { return };
        if o.until.is_some_and(|u| at > u + o.grace) {
            self.outage = None;
            return;
        }
        let mut found = Vec::new();
        // A registration creates a session key; a leaving node rewriting its own session
        // (a planned restart) is not one.
        for e in events
            .iter()
            .filter(|e| e.kind == EventKind::Put && e.kv.version == 1)
        {
            if self.keys.parse_session(&e.kv.key).is_ok() {
                let proc = chanwatch_core::NodeSession::decode(&e.kv.value)
                    .map(|s| s.admin_addr)
                    .unwrap_or_default();
                if o.procs.contains(&proc) {
                    found.push(format!("static stability: {proc} registered again during or right after a store outage"));
                }
            }
        }
        if matches!(writer, Writer::Coord(_)) {
            for e in events.iter().filter(|e| e.kind == EventKind::Delete) {
                if let Ok(ck) = self.keys.parse_channel(&e.kv.key) {
                    if let ChannelOwner::Node(n) = ck.owner {
                        // A node asked to leave ends its session at its shutdown timeout
                        // whatever the store did meanwhile (the operator's bound; seed
                        // 40003819): its channels then fail over by design (DESIGN §5).
                        if o.nodes.contains(&n)
                            && !self.session_alive(n)
                            && !self.asked_to_leave.contains(&n)
                        {
                            found.push(format!("static stability: {} failed over from node {n} during or right after a store outage", ck.channel));
                        }
                    }
                }
            }
        }
        for f in found {
            self.violation(rev, f);
        }
    }

    /// No ping-pong (invariant 7): a coordinator does not put a channel back on a node that
    /// failed it within the back-off while another live, non-draining node that has not
    /// failed it could take it — judged from the store's true state, so a leader whose view
    /// is stale is not excused, and a failover is not either. (With every other node in its
    /// back-off, retrying on the same node once the planner's back-off passed is allowed.) A
    /// failure from before the current leader's term is excused (back-offs live in the
    /// leader's memory).
    fn check_churn(
        &mut self,
        rev: Revision,
        at: tokio::time::Instant,
        writer: &Writer,
        events: &[WatchEvent],
    ) {
        // The planner dates a back-off when it plans, before its txn commits: up to the
        // slowest store call of the simulation (`Fault::SlowStore`, 1.5 s) earlier.
        let backoff = self
            .failed_node_backoff
            .saturating_sub(std::time::Duration::from_millis(1_600));
        let leader = self.keys.leader();
        if events
            .iter()
            .any(|e| e.kind == EventKind::Put && e.kv.key == leader)
        {
            self.term_since = Some(at);
        }
        let term_since = self.term_since;
        // The back-off runs from when a failed channel left the node (it may sit there,
        // failed, until another node can take it).
        for e in events.iter().filter(|e| e.kind == EventKind::Delete) {
            let Ok(ck) = self.keys.parse_channel(&e.kv.key) else {
                continue;
            };
            let failed_here = self
                .kv
                .get(&e.kv.key)
                .and_then(|kv| ChannelInfo::decode(&kv.value).ok())
                .is_some_and(|i| i.state == ChannelState::WatchFailed);
            if let (ChannelOwner::Node(node), true) = (ck.owner, failed_here) {
                self.failed.insert((ck.channel.clone(), node), at);
            }
        }
        for e in events.iter().filter(|e| e.kind == EventKind::Put) {
            let Ok(ck) = self.keys.parse_channel(&e.kv.key) else {
                continue;
            };
            let (ChannelOwner::Node(node), Ok(info)) = (ck.owner, ChannelInfo::decode(&e.kv.value))
            else {
                continue;
            };
            let recent = |failed: &BTreeMap<(ChannelName, NodeId), tokio::time::Instant>,
                          n: NodeId| {
                failed
                    .get(&(ck.channel.clone(), n))
                    .is_some_and(|t| at < *t + backoff && term_since.map_or(true, |s| *t >= s))
            };
            match (writer, info.state) {
                (Writer::Node(_), ChannelState::WatchFailed) => {
                    self.failed.insert((ck.channel.clone(), node), at);
                }
                // Not even a failover goes back to a node inside its back-off for the
                // channel while another live node could take it — though the leader may not
                // see that node yet (a stale view): the channel waits under `remaining`
                // instead (DESIGN §6, invariant 7). With truly no other candidate, a retry
                // on the same node once the planner's back-off passed is allowed.
                (Writer::Coord(_), ChannelState::ToWatch) if recent(&self.failed, node) => {
                    let draining = self.draining();
                    let other = self
                        .kv
                        .keys()
                        .filter_map(|k| self.keys.parse_session(k).ok())
                        .find(|n| *n != node && !draining.contains(n) && !recent(&self.failed, *n));
                    if let Some(other) = other {
                        let ago =
                            at.saturating_duration_since(self.failed[&(ck.channel.clone(), node)]);
                        self.violation(
                            rev,
                            format!(
                                "ping-pong: {} put back on node {node} {} ms after it failed there, while node {other} could take it",
                                ck.channel,
                                ago.as_millis()
                            ),
                        );
                    }
                }
                _ => {}
            }
        }
    }

    /// Fenced checkpoints (invariant 3 for data): a put to `{root}/worker/checkpoint/{c}` lands only
    /// from the process whose live session owns `c`'s assignment key right before it, and a
    /// channel's committed position never goes back.
    fn check_checkpoints(&mut self, rev: Revision, writer: &Writer, events: &[WatchEvent]) {
        for e in events {
            let Ok(channel) = self.keys.parse_checkpoint(&e.kv.key) else {
                continue;
            };
            if e.kind == EventKind::Delete {
                self.positions.remove(&channel);
                continue;
            }
            let Writer::Node(slot) = writer else {
                self.violation(rev, format!("{writer} wrote the checkpoint of {channel}"));
                continue;
            };
            let proc = format!("proc{slot}");
            let owner = self
                .owners
                .get(&channel)
                .and_then(|o| o.iter().next().copied());
            let owner_proc = match owner {
                Some(ChannelOwner::Node(n)) => self
                    .kv
                    .get(&self.keys.session(n))
                    .and_then(|kv| chanwatch_core::NodeSession::decode(&kv.value).ok())
                    .map(|s| (n, s.admin_addr)),
                _ => None,
            };
            match owner_proc {
                Some((_, p)) if p == proc => {}
                other => self.violation(
                    rev,
                    format!(
                        "stale checkpoint: {proc} committed {channel} while its assignment is {}",
                        match (owner, other) {
                            (Some(o), Some((_, p))) => format!("on {o} ({p})"),
                            (Some(o), None) => format!("on {o} (no live session)"),
                            (None, _) => "gone".to_owned(),
                        }
                    ),
                ),
            }
            match chanwatch_core::Checkpoint::decode(&e.kv.value)
                .ok()
                .and_then(|cp| cp.position.parse::<u64>().ok())
            {
                Some(pos) => {
                    let last = self.positions.insert(channel.clone(), pos);
                    if let Some(last) = last.filter(|l| *l > pos) {
                        self.violation(
                            rev,
                            format!("{channel}: committed position went back from {last} to {pos} (by {proc})"),
                        );
                    }
                }
                None => self.violation(
                    rev,
                    format!("{channel}: checkpoint by {proc} has no numeric position"),
                ),
            }
        }
    }

    /// Data plane, after the producer stopped: why some present channel's committed position
    /// is not yet the end of its log (`None`: every one caught up).
    pub fn data_behind(&self, log: &crate::MemLog) -> Option<String> {
        let mut behind = Vec::new();
        for (channel, owners) in &self.owners {
            if owners.is_empty() {
                continue;
            }
            let end = log
                .messages(
                    channel.as_str(),
                    chanwatch_stream::Position::from_raw(u64::MAX),
                )
                .len() as u64;
            let at = self.positions.get(channel).copied().unwrap_or(0);
            if at != end {
                behind.push(format!("{channel} at {at} of {end}"));
            }
        }
        (!behind.is_empty())
            .then(|| format!("committed positions behind the log: {}", behind.join(", ")))
    }

    /// Invariant 8: every present channel's committed state is exactly the fold of its log up
    /// to its committed position. Each difference becomes a violation.
    pub fn check_data(&mut self, log: &crate::MemLog) {
        let mut found = Vec::new();
        for (channel, owners) in &self.owners {
            if owners.is_empty() {
                continue;
            }
            let Some(kv) = self.kv.get(&self.keys.checkpoint(channel)) else {
                if !log
                    .messages(channel.as_str(), chanwatch_stream::Position::from_raw(1))
                    .is_empty()
                {
                    found.push(format!("{channel}: messages in the log but no checkpoint"));
                }
                continue;
            };
            let cp = match chanwatch_core::Checkpoint::decode(&kv.value) {
                Ok(cp) => cp,
                Err(e) => {
                    found.push(format!("{channel}: checkpoint does not decode: {e}"));
                    continue;
                }
            };
            let Ok(at) = cp.position.parse::<chanwatch_stream::Position>() else {
                found.push(format!(
                    "{channel}: checkpoint position {:?} is not a position",
                    cp.position
                ));
                continue;
            };
            let mut expected = chanwatch_node::handler::StreamState::default();
            for m in log.messages(channel.as_str(), at) {
                expected.fold(&m);
            }
            let got = cp
                .state
                .as_ref()
                .map(chanwatch_node::handler::StreamState::from_json)
                .unwrap_or(Ok(chanwatch_node::handler::StreamState::default()));
            if got.as_ref() != Ok(&expected) {
                found.push(format!(
                    "not exactly-once: {channel} at {at} committed {got:?}, the log folds to {expected:?}"
                ));
            }
        }
        let rev = self.revision;
        for f in found {
            self.violation(rev, f);
        }
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

    /// Nodes with a drain mark now.
    pub fn draining(&self) -> BTreeSet<NodeId> {
        self.kv
            .keys()
            .filter_map(|k| self.keys.parse_drain(k).ok())
            .collect()
    }

    /// Why the cluster is not settled yet (`None`: settled). Settled means: the channels
    /// are exactly those added and not removed; each has one key; none is under a node
    /// without a session; each is `Watched` on a live node, or under `remaining` when no
    /// live node takes channels; the loads (weights over capacity) of the nodes that take
    /// channels are within the heaviest channel's weight over the smallest capacity
    /// (invariant 5); and draining nodes are empty unless every live node is draining.
    /// Channels in `ambiguous` (an add or remove with an unknown outcome) may be there or not.
    pub fn settled(
        &self,
        expected: &BTreeSet<ChannelName>,
        ambiguous: &BTreeSet<ChannelName>,
    ) -> Option<String> {
        let live: BTreeSet<NodeId> = self
            .kv
            .keys()
            .filter_map(|k| self.keys.parse_session(k).ok())
            .collect();
        let draining: BTreeSet<NodeId> = self
            .kv
            .keys()
            .filter_map(|k| self.keys.parse_drain(k).ok())
            .collect();
        let assignable: BTreeSet<NodeId> = live.difference(&draining).copied().collect();
        let present: BTreeSet<ChannelName> = self
            .owners
            .iter()
            .filter(|(_, o)| !o.is_empty())
            .map(|(c, _)| c.clone())
            .collect();
        let missing: Vec<_> = expected.difference(&present).collect();
        let extra: Vec<_> = present
            .iter()
            .filter(|c| !expected.contains(*c) && !ambiguous.contains(*c))
            .collect();
        if !missing.is_empty() || !extra.is_empty() {
            return Some(format!(
                "channels missing {missing:?}, unexpected {extra:?}"
            ));
        }
        // Invariant 5 by weight and capacity (DESIGN §5): loads are the weights of each
        // node's channels over its capacity; balanced when the spread is within the
        // heaviest channel's weight over the smallest capacity, as the planner counts.
        let capacity = |n: &NodeId| {
            self.kv
                .get(&self.keys.session(*n))
                .and_then(|kv| NodeSession::decode(&kv.value).ok())
                .map_or(1, |s| s.load_capacity())
        };
        let mut loads: BTreeMap<NodeId, Load> = assignable
            .iter()
            .map(|n| {
                (
                    *n,
                    Load {
                        weight: 0,
                        capacity: capacity(n),
                    },
                )
            })
            .collect();
        let mut heaviest = 1;
        for (key, kv) in &self.kv {
            let Ok(ck) = self.keys.parse_channel(key) else {
                continue;
            };
            let info = ChannelInfo::decode(&kv.value).ok();
            let state = info.as_ref().map(|i| i.state);
            let weight = info.as_ref().map_or(1, ChannelInfo::load_weight);
            heaviest = heaviest.max(weight);
            match ck.owner {
                ChannelOwner::Node(n) if !live.contains(&n) => {
                    return Some(format!(
                        "{} is under node {n}, which has no session",
                        ck.channel
                    ))
                }
                ChannelOwner::Node(n) => {
                    if state != Some(ChannelState::Watched) {
                        return Some(format!("{} on node {n} is {state:?}", ck.channel));
                    }
                    if let Some(l) = loads.get_mut(&n) {
                        l.weight += weight;
                    } else {
                        // A draining node: counted for the emptiness check below.
                        loads.insert(
                            n,
                            Load {
                                weight,
                                capacity: capacity(&n),
                            },
                        );
                    }
                }
                ChannelOwner::Remaining if !assignable.is_empty() => {
                    return Some(format!("{} is parked although nodes are alive", ck.channel))
                }
                ChannelOwner::Remaining => {}
            }
        }
        let counted: Vec<Load> = assignable
            .iter()
            .filter_map(|n| loads.get(n).copied())
            .collect();
        let min_capacity = counted.iter().map(|l| l.capacity).min().unwrap_or(1);
        if let (Some(max), Some(min)) = (counted.iter().max(), counted.iter().min()) {
            if !max.within(*min, heaviest, min_capacity) {
                let shown: BTreeMap<NodeId, String> = loads
                    .iter()
                    .map(|(n, l)| (*n, format!("{}/{}", l.weight, l.capacity)))
                    .collect();
                return Some(format!(
                    "unbalanced: loads {shown:?} (weight/capacity), spread over {heaviest}/{min_capacity}"
                ));
            }
        }
        // With every live node draining, there is nowhere to move to: channels stay put.
        for n in draining.iter().filter(|_| !assignable.is_empty()) {
            if loads.get(n).is_some_and(|l| l.weight > 0) {
                return Some(format!("draining node {n} still has channels"));
            }
        }
        None
    }
}

/// Pairs of runs of one channel on two nodes at the same instant that no fault excuses.
pub fn overlaps(intervals: &[Interval], excuses: &[Excuse]) -> Vec<String> {
    let mut by_channel: BTreeMap<&ChannelName, Vec<&Interval>> = BTreeMap::new();
    for i in intervals {
        by_channel.entry(&i.channel).or_default().push(i);
    }
    let mut out = Vec::new();
    for (channel, runs) in by_channel {
        for (k, a) in runs.iter().enumerate() {
            for b in &runs[k + 1..] {
                if a.node == b.node {
                    continue;
                }
                let from = a.start_ms.max(b.start_ms);
                let to = a
                    .end_ms
                    .unwrap_or(u64::MAX)
                    .min(b.end_ms.unwrap_or(u64::MAX));
                if from >= to {
                    continue;
                }
                let excused = excuses.iter().any(|x| {
                    x.from_ms <= to
                        && from <= x.to_ms
                        && match &x.scope {
                            Scope::Node(n) => *n == a.node || *n == b.node,
                        }
                });
                if !excused {
                    out.push(format!(
                        "{channel} ran on node {} (epoch {}) and node {} (epoch {}) at once during {}..{} ms",
                        a.node, a.epoch, b.node, b.epoch, from, to
                    ));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use chanwatch_core::{Checkpoint, NodeSession, VChannelInfo};
    use chanwatch_store::{EmbeddedStore, MetaStore, Txn, TxnOp};

    /// Writes `key = value` as `writer` and lets the checker see it.
    async fn write(
        store: &EmbeddedStore,
        writers: &Writers,
        checker: &mut Checker,
        writer: Writer,
        key: String,
        value: Vec<u8>,
    ) {
        let next = store.revision() + 1;
        writers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(next, writer);
        let r = store
            .txn(Txn::new().and_then([TxnOp::put(&key, value)]))
            .await;
        assert!(r.is_ok(), "{r:?}");
        checker.poll(&mut |_, _| {});
    }

    fn checkpoint(position: u64) -> Vec<u8> {
        Checkpoint {
            epoch: Epoch(1),
            position: position.to_string(),
            state: None,
            updated_at_ms: 0,
            extra: Default::default(),
        }
        .encode()
    }

    #[tokio::test(start_paused = true)]
    async fn checkpoints_only_from_the_owner_and_positions_only_forward() {
        let store = EmbeddedStore::new();
        let keys = Keys::default();
        let writers = Writers::default();
        let mut c = Checker::new(keys.clone(), store.observe(), writers.clone());
        let ch = ChannelName::new("ch-000").unwrap_or_else(|_| unreachable!());
        for (id, slot) in [(1, 0), (2, 1)] {
            let s = NodeSession {
                id: NodeId(id),
                admin_addr: format!("proc{slot}"),
                version: String::new(),
                started_at_ms: 0,
                capacity: 0,
                name: String::new(),
                extra: Default::default(),
            };
            write(
                &store,
                &writers,
                &mut c,
                Writer::Node(slot),
                keys.session(NodeId(id)),
                s.encode(),
            )
            .await;
        }
        c.requested_adds.insert(ch.clone());
        let info = ChannelInfo::new(ch.clone(), Epoch(1), 0, VChannelInfo::default());
        write(
            &store,
            &writers,
            &mut c,
            Writer::Coord("coord1".into()),
            keys.channel(ChannelOwner::Node(NodeId(1)), &ch),
            info.encode(),
        )
        .await;
        c.violations.retain(|v| !v.contains("leader key"));
        let cp = keys.checkpoint(&ch);
        write(
            &store,
            &writers,
            &mut c,
            Writer::Node(0),
            cp.clone(),
            checkpoint(10),
        )
        .await;
        assert_eq!(c.violations, Vec::<String>::new());
        write(
            &store,
            &writers,
            &mut c,
            Writer::Node(0),
            cp.clone(),
            checkpoint(7),
        )
        .await;
        assert!(
            c.violations
                .iter()
                .any(|v| v.contains("went back from 10 to 7")),
            "{:?}",
            c.violations
        );
        c.violations.clear();
        write(
            &store,
            &writers,
            &mut c,
            Writer::Node(1),
            cp,
            checkpoint(12),
        )
        .await;
        assert!(
            c.violations
                .iter()
                .any(|v| v.contains("stale checkpoint: proc1")),
            "{:?}",
            c.violations
        );
    }

    /// Invariant 5 is judged by weight over capacity: 4 channels on a node of capacity 2
    /// and 2 on one of capacity 1 are balanced; by count they would not be, and a heavy
    /// channel alone on one node is balanced against an empty one only within its weight.
    #[tokio::test(start_paused = true)]
    async fn settled_judges_balance_by_weight_over_capacity() {
        let store = EmbeddedStore::new();
        let keys = Keys::default();
        let writers = Writers::default();
        let mut c = Checker::new(keys.clone(), store.observe(), writers.clone());
        for (id, capacity) in [(1, 2), (2, 1)] {
            let s = NodeSession {
                id: NodeId(id),
                name: String::new(),
                admin_addr: format!("proc{id}"),
                version: String::new(),
                started_at_ms: 0,
                capacity,
                extra: Default::default(),
            };
            let key = keys.session(NodeId(id));
            write(
                &store,
                &writers,
                &mut c,
                Writer::Node(id as usize),
                key,
                s.encode(),
            )
            .await;
        }
        let expected: BTreeSet<ChannelName> = ["c0", "c1", "c2", "c3", "c4", "c5"]
            .into_iter()
            .filter_map(|n| ChannelName::new(n).ok())
            .collect();
        let key = |name: &str, node: u64| {
            let ch = ChannelName::new(name).unwrap_or_else(|_| unreachable!());
            keys.channel(ChannelOwner::Node(NodeId(node)), &ch)
        };
        let value = |name: &str| {
            let ch = ChannelName::new(name).unwrap_or_else(|_| unreachable!());
            let mut info = ChannelInfo::new(ch, Epoch(1), 0, VChannelInfo::default());
            info.state = ChannelState::Watched;
            info.encode()
        };
        let coord = || Writer::Coord("coord1".into());
        for name in ["c0", "c1", "c2", "c3", "c4", "c5"] {
            write(&store, &writers, &mut c, coord(), key(name, 1), value(name)).await;
        }
        let none = BTreeSet::new();
        // 6/2 = 3 vs 0/1: over one channel (1) on the smallest capacity (1).
        let why = c.settled(&expected, &none).expect("unbalanced");
        assert!(why.contains("unbalanced"), "{why}");
        for name in ["c4", "c5"] {
            let r = store
                .txn(Txn::new().and_then([TxnOp::delete(key(name, 1))]))
                .await;
            assert!(r.is_ok(), "{r:?}");
            c.poll(&mut |_, _| {});
            write(&store, &writers, &mut c, coord(), key(name, 2), value(name)).await;
        }
        // 4/2 = 2 vs 2/1 = 2: balanced by load, though 4 vs 2 by count.
        assert_eq!(c.settled(&expected, &none), None);
    }
}
