//! The leader's event history: every transition it commits and what it sees happen to nodes
//! (joined, left, drained, undrained, fenced), kept in memory for `ctl events` and
//! `ctl describe` (`GET /api/v1/events`, `GET /api/v1/channels/{name}`, `GET
//! /api/v1/nodes/{id}`).
//!
//! A bounded ring of the last [`HISTORY`] events, a short one per channel and per node (the
//! last [`PER_OBJECT`] each, for `describe`), and a broadcast for followers. Sequence numbers
//! grow by one per event. The history is the leader's own: a new leader starts a new one
//! ([`EventLog::begin`]), which `describe` says ("history since this leader took over at …").
//!
//! Owns: the history and its followers. Must not: decide or write anything (it only hears
//! what the term committed), or take a clock other than the term's [`Clock`].

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use chanwatch_core::planner::Transition;
use chanwatch_core::{ChannelName, ChannelState, NodeId};
use chanwatch_store::Clock;
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

/// Events kept in the ring.
pub const HISTORY: usize = 10_000;
/// Events kept per channel and per node.
pub const PER_OBJECT: usize = 20;

/// What an event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A channel transition the leader committed.
    Transition,
    /// Something that happened to a node.
    Node,
}

/// One event, as `GET /api/v1/events` sends it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Sequence number in this leader's history (from 1).
    pub seq: u64,
    /// When the leader committed or saw it (Unix ms, the leader's clock).
    pub time_ms: u64,
    /// The leader that recorded it (its `--id`).
    pub leader: String,
    /// Transition or node event.
    pub kind: EventKind,
    /// Why: a transition's cause (`assign`, `failover`, `manual`, …) or what happened to the
    /// node (`joined`, `left`, `drained`, `undrained`, `fenced`).
    pub cause: String,
    /// The channel (transitions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel: Option<ChannelName>,
    /// The node (node events).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u64>,
    /// Owner before: a node ID or `remaining` (`null`: a new channel).
    #[serde(default)]
    pub from: Option<String>,
    /// Owner after (`null`: removed).
    #[serde(default)]
    pub to: Option<String>,
    /// State written (`null`: removed, or a node event).
    #[serde(default)]
    pub state: Option<ChannelState>,
    /// Epoch written (transitions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// More about a node event (e.g. how its leaving was seen).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Whose history this is.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryInfo {
    /// The leader keeping it (`""` before any term).
    pub leader: String,
    /// When that leader took over (Unix ms).
    pub since_ms: u64,
    /// Sequence number of the oldest event kept (0: none yet).
    pub first_seq: u64,
    /// Sequence number of the newest event (0: none yet).
    pub last_seq: u64,
}

#[derive(Debug, Default)]
struct Inner {
    info: HistoryInfo,
    // Shared: one event sits in the ring, its channel's and up to two nodes' queues and the
    // broadcast; copied whole into each it cost ~24 allocations per transition, most of the
    // leader's work in a 1,000-channel failover after the txns themselves.
    ring: VecDeque<Arc<Event>>,
    channels: HashMap<ChannelName, VecDeque<Arc<Event>>>,
    nodes: HashMap<u64, VecDeque<Arc<Event>>>,
    capacity: usize,
}

/// The leader's bounded event history and its followers. Shared by the term (which records)
/// and the handle (which the API reads through).
#[derive(Debug)]
pub struct EventLog {
    inner: Mutex<Inner>,
    followers: broadcast::Sender<Arc<Event>>,
    clock: Clock,
}

fn push_bounded(q: &mut VecDeque<Arc<Event>>, e: Arc<Event>, cap: usize) {
    if q.len() >= cap {
        q.pop_front();
    }
    q.push_back(e);
}

impl EventLog {
    /// An empty history of at most [`HISTORY`] events, on `clock`.
    pub fn new(clock: Clock) -> Self {
        Self::with_capacity(clock, HISTORY)
    }

    /// An empty history of at most `capacity` events (at least 1).
    pub fn with_capacity(clock: Clock, capacity: usize) -> Self {
        let (followers, _) = broadcast::channel(1024);
        EventLog {
            inner: Mutex::new(Inner {
                capacity: capacity.max(1),
                ..Inner::default()
            }),
            followers,
            clock,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts a new history: `leader` took over now. What an earlier term recorded is
    /// dropped (it was another leader's, or this one's before it lost the key).
    pub fn begin(&self, leader: &str) {
        let mut g = self.lock();
        let capacity = g.capacity;
        *g = Inner {
            info: HistoryInfo {
                leader: leader.to_owned(),
                since_ms: self.clock.unix_ms(),
                first_seq: 0,
                last_seq: 0,
            },
            capacity,
            ..Inner::default()
        };
    }

    fn record(&self, mut e: Event) {
        let mut g = self.lock();
        g.info.last_seq += 1;
        e.seq = g.info.last_seq;
        e.leader.clone_from(&g.info.leader);
        let cap = g.capacity;
        let e = Arc::new(e);
        if let Some(c) = &e.channel {
            let q = g.channels.entry(c.clone()).or_default();
            push_bounded(q, e.clone(), PER_OBJECT);
        }
        let node = e.node.or_else(|| {
            // A transition is in the history of both nodes it touches.
            e.to.as_deref().and_then(|t| t.parse().ok())
        });
        if let Some(n) = node {
            push_bounded(g.nodes.entry(n).or_default(), e.clone(), PER_OBJECT);
        }
        if let Some(n) = e.from.as_deref().and_then(|f| f.parse::<u64>().ok()) {
            if Some(n) != node {
                push_bounded(g.nodes.entry(n).or_default(), e.clone(), PER_OBJECT);
            }
        }
        push_bounded(&mut g.ring, e.clone(), cap);
        g.info.first_seq = g.ring.front().map_or(0, |f| f.seq);
        // Channels keep their short history while the map holds at most twice the ring's
        // size; past that only the channels still in the ring keep theirs (memory bounded,
        // the pruning amortized).
        if g.channels.len() > 2 * cap {
            let in_ring: std::collections::HashSet<ChannelName> =
                g.ring.iter().filter_map(|e| e.channel.clone()).collect();
            g.channels.retain(|c, _| in_ring.contains(c));
        }
        if g.nodes.len() > 2 * cap {
            let in_ring: std::collections::HashSet<u64> =
                g.ring.iter().filter_map(|e| e.node).collect();
            g.nodes.retain(|n, _| in_ring.contains(n));
        }
        drop(g);
        // No follower is not an error.
        let _ = self.followers.send(e);
    }

    /// Records committed transitions.
    pub fn transitions(&self, transitions: &[Transition]) {
        self.transitions_with(transitions, |_| None);
    }

    /// Records `transitions`, each with the detail `detail` gives it (a failed channel's
    /// reason: what its node said).
    pub fn transitions_with(
        &self,
        transitions: &[Transition],
        detail: impl Fn(&Transition) -> Option<String>,
    ) {
        let time_ms = self.clock.unix_ms();
        for t in transitions {
            self.record(Event {
                seq: 0,
                time_ms,
                leader: String::new(),
                kind: EventKind::Transition,
                cause: t.cause.as_str().to_owned(),
                channel: Some(t.channel.clone()),
                node: None,
                from: t.from.map(|o| o.to_string()),
                to: t.to.map(|o| o.to_string()),
                state: t.state,
                epoch: Some(t.epoch.0),
                detail: detail(t),
            });
        }
    }

    /// Records that something (`what`: joined, left, drained, undrained, fenced) happened to
    /// `node`.
    pub fn node(&self, node: NodeId, what: &str, detail: Option<String>) {
        self.record(Event {
            seq: 0,
            time_ms: self.clock.unix_ms(),
            leader: String::new(),
            kind: EventKind::Node,
            cause: what.to_owned(),
            channel: None,
            node: Some(node.0),
            from: None,
            to: None,
            state: None,
            epoch: None,
            detail,
        });
    }

    /// Whose history this is and which sequence numbers it holds.
    pub fn info(&self) -> HistoryInfo {
        self.lock().info.clone()
    }

    /// The events with a sequence number of at least `since`, oldest first.
    pub fn since(&self, since: u64) -> Vec<Event> {
        let g = self.lock();
        g.ring
            .iter()
            .filter(|e| e.seq >= since)
            .map(|e| Event::clone(e))
            .collect()
    }

    /// The last events of `channel`, oldest first.
    pub fn channel(&self, channel: &ChannelName) -> Vec<Event> {
        self.lock()
            .channels
            .get(channel)
            .map(|q| q.iter().map(|e| Event::clone(e)).collect())
            .unwrap_or_default()
    }

    /// The last events of `node` (its own, and transitions to or from it), oldest first.
    pub fn node_history(&self, node: NodeId) -> Vec<Event> {
        self.lock()
            .nodes
            .get(&node.0)
            .map(|q| q.iter().map(|e| Event::clone(e)).collect())
            .unwrap_or_default()
    }

    /// The history from `since` and a receiver of every later event, taken together so that
    /// nothing falls between them; with the history's info at that moment.
    pub fn follow(&self, since: u64) -> (HistoryInfo, Vec<Event>, broadcast::Receiver<Arc<Event>>) {
        let g = self.lock();
        // Subscribed under the lock: `record` sends after releasing it, so every event is
        // either in the replay or sent to this receiver, never both or neither.
        let rx = self.followers.subscribe();
        let replay = g
            .ring
            .iter()
            .filter(|e| e.seq >= since)
            .map(|e| Event::clone(e))
            .collect();
        (g.info.clone(), replay, rx)
    }
}

#[cfg(test)]
mod tests {
    use chanwatch_core::planner::Cause;
    use chanwatch_core::{ChannelOwner, Epoch};

    use super::*;

    fn moved(channel: &str, from: u64, to: u64) -> Transition {
        Transition {
            channel: ChannelName::new(channel).expect("name"),
            cause: Cause::Manual,
            from: Some(ChannelOwner::Node(NodeId(from))),
            to: Some(ChannelOwner::Node(NodeId(to))),
            state: Some(ChannelState::ToWatch),
            epoch: Epoch(2),
        }
    }

    #[test]
    fn the_ring_keeps_the_newest_events_with_growing_sequence_numbers() {
        let log = EventLog::with_capacity(Clock::with_unix_base(1_000), 3);
        log.begin("coord-a");
        for i in 0..5 {
            log.transitions(&[moved(&format!("c{i}"), 1, 2)]);
        }
        let all = log.since(0);
        let seqs: Vec<u64> = all.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![3, 4, 5]);
        assert_eq!(all[0].channel.as_ref().map(ChannelName::as_str), Some("c2"));
        assert_eq!(all[0].leader, "coord-a");
        assert_eq!(all[0].cause, "manual");
        let info = log.info();
        assert_eq!((info.first_seq, info.last_seq), (3, 5));
        assert_eq!(log.since(5).len(), 1);
    }

    #[test]
    fn each_channel_and_node_keeps_its_last_events() {
        let log = EventLog::new(Clock::with_unix_base(1_000));
        log.begin("coord-a");
        for _ in 0..(PER_OBJECT + 5) {
            log.transitions(&[moved("a", 1, 2)]);
        }
        log.transitions(&[moved("b", 3, 4)]);
        log.node(NodeId(3), "drained", None);
        let a = ChannelName::new("a").expect("name");
        assert_eq!(log.channel(&a).len(), PER_OBJECT);
        assert_eq!(
            log.channel(&a).last().map(|e| e.seq),
            Some(PER_OBJECT as u64 + 5)
        );
        // Node 3: the move off it and its drain; node 4: the move onto it.
        let n3: Vec<String> = log
            .node_history(NodeId(3))
            .iter()
            .map(|e| e.cause.clone())
            .collect();
        assert_eq!(n3, vec!["manual", "drained"]);
        assert_eq!(log.node_history(NodeId(4)).len(), 1);
    }

    #[test]
    fn a_new_leader_starts_a_new_history() {
        let log = EventLog::new(Clock::with_unix_base(1_000));
        log.begin("coord-a");
        log.transitions(&[moved("a", 1, 2)]);
        log.begin("coord-b");
        assert!(log.since(0).is_empty());
        assert!(log
            .channel(&ChannelName::new("a").expect("name"))
            .is_empty());
        log.node(NodeId(1), "joined", None);
        let e = &log.since(0)[0];
        assert_eq!((e.seq, e.leader.as_str()), (1, "coord-b"));
        assert_eq!(log.info().leader, "coord-b");
    }

    #[tokio::test]
    async fn a_follower_gets_the_replay_then_every_new_event_once() {
        let log = EventLog::new(Clock::with_unix_base(1_000));
        log.begin("coord-a");
        log.transitions(&[moved("a", 1, 2), moved("b", 1, 2)]);
        let (_, replay, mut rx) = log.follow(2);
        assert_eq!(replay.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![2]);
        log.node(NodeId(2), "left", Some("a delete event".into()));
        let next = rx.recv().await.expect("event");
        assert_eq!((next.seq, next.cause.as_str()), (3, "left"));
        assert!(rx.try_recv().is_err());
    }
}
