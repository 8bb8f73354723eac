//! The planned-restart invariants (DESIGN §5 "Planned restart", issue 16), checked on every
//! revision: while a node leaves (SIGTERM: its session says `leaving`) and nothing else
//! happens, each channel it held moves at most once, and none fails over — its session ends
//! only after the coordinator moved every channel off. No overlap is the checker's general
//! rule and covers departures too.
//!
//! Owns: the departures under way, each with the channels the node held when it began and
//! how often each has been assigned since. A departure disturbed by any other fault or admin
//! request (a crash, a partition, a drain) is followed but not judged: those may move a
//! channel again or fail it over by design.
//! Must not: inject anything or read the store; the world tells it what began and what
//! disturbed, the checker feeds it revisions.

use std::collections::BTreeMap;

use chanwatch_core::{ChannelName, ChannelOwner, Keys, NodeId};
use chanwatch_store::{EventKind, KeyValue, WatchEvent};

/// One node leaving.
#[derive(Debug)]
struct Departure {
    /// Channels it held when it began → assignments of each elsewhere since.
    held: BTreeMap<ChannelName, u32>,
    /// Another fault or request happened meanwhile: not judged.
    disturbed: bool,
}

/// The departures under way. See the module docs.
#[derive(Debug, Default)]
pub struct Departures {
    active: BTreeMap<NodeId, Departure>,
    /// Departures that ended undisturbed (each judged).
    pub judged: u64,
}

impl Departures {
    /// Node `node` begins leaving; `kv` is the store as of now.
    pub fn begin(&mut self, keys: &Keys, kv: &BTreeMap<String, KeyValue>, node: NodeId) {
        let prefix = keys.owner_prefix(ChannelOwner::Node(node));
        let held = kv
            .range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
            .filter_map(|(k, _)| keys.parse_channel(k).ok().map(|ck| (ck.channel, 0)))
            .collect();
        // A node whose session already ended (its lease expired during a partition that
        // just healed) is failed over, not drained: not judged (seed 40001282 judged one).
        let alive = kv.contains_key(&keys.session(node));
        self.active.insert(
            node,
            Departure {
                held,
                disturbed: !alive,
            },
        );
    }

    /// Something else happened: no departure under way now is judged.
    pub fn disturb(&mut self) {
        for d in self.active.values_mut() {
            d.disturbed = true;
        }
    }

    /// Follows one revision; `kv` is the store after it. Returns what it breaks.
    pub fn observe(
        &mut self,
        keys: &Keys,
        kv: &BTreeMap<String, KeyValue>,
        events: &[WatchEvent],
    ) -> Vec<String> {
        if self.active.is_empty() {
            return Vec::new();
        }
        let mut found = Vec::new();
        for e in events {
            if e.kind == EventKind::Put && e.kv.version == 1 {
                let Ok(ck) = keys.parse_channel(&e.kv.key) else {
                    continue;
                };
                for (node, d) in &mut self.active {
                    if ck.owner == ChannelOwner::Node(*node) {
                        continue;
                    }
                    if let Some(n) = d.held.get_mut(&ck.channel) {
                        *n += 1;
                        if *n > 1 && !d.disturbed {
                            found.push(format!(
                                "planned restart: {} moved {n} times while node {node} left",
                                ck.channel
                            ));
                        }
                    }
                }
            }
            if e.kind == EventKind::Delete {
                let Ok(node) = keys.parse_session(&e.kv.key) else {
                    continue;
                };
                let Some(d) = self.active.remove(&node) else {
                    continue;
                };
                if d.disturbed {
                    continue;
                }
                self.judged += 1;
                let prefix = keys.owner_prefix(ChannelOwner::Node(node));
                let left: Vec<&String> = kv
                    .range(prefix.clone()..)
                    .take_while(|(k, _)| k.starts_with(&prefix))
                    .map(|(k, _)| k)
                    .collect();
                if !left.is_empty() {
                    found.push(format!(
                        "planned restart: node {node}'s session ended with {} channels still under it (they fail over): {left:?}",
                        left.len()
                    ));
                }
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: String, version: i64) -> KeyValue {
        KeyValue {
            key,
            value: Vec::new(),
            create_revision: 1,
            mod_revision: 1,
            version,
            lease: None,
        }
    }

    fn put(key: String) -> WatchEvent {
        WatchEvent {
            kind: EventKind::Put,
            kv: kv(key, 1),
        }
    }

    fn delete(key: String) -> WatchEvent {
        WatchEvent {
            kind: EventKind::Delete,
            kv: kv(key, 0),
        }
    }

    fn ch(s: &str) -> ChannelName {
        ChannelName::new(s).expect("valid")
    }

    /// The store with node 1's session and `a` and `b` under node 1.
    fn store(keys: &Keys) -> BTreeMap<String, KeyValue> {
        let node = ChannelOwner::Node(NodeId(1));
        [
            keys.session(NodeId(1)),
            keys.channel(node, &ch("a")),
            keys.channel(node, &ch("b")),
        ]
        .into_iter()
        .map(|k| (k.clone(), kv(k, 1)))
        .collect()
    }

    #[test]
    fn a_clean_departure_passes_and_a_second_move_or_a_failover_is_caught() {
        let keys = Keys::default();
        let (one, two, three) = (
            ChannelOwner::Node(NodeId(1)),
            ChannelOwner::Node(NodeId(2)),
            ChannelOwner::Node(NodeId(3)),
        );
        // Clean: each channel assigned elsewhere once, then the session ends with none left.
        let mut d = Departures::default();
        let kv0 = store(&keys);
        d.begin(&keys, &kv0, NodeId(1));
        let moved = [
            put(keys.channel(two, &ch("a"))),
            put(keys.channel(two, &ch("b"))),
        ];
        assert!(d.observe(&keys, &kv0, &moved).is_empty());
        let empty = BTreeMap::new();
        assert!(d
            .observe(&keys, &empty, &[delete(keys.session(NodeId(1)))])
            .is_empty());
        assert_eq!(d.judged, 1);

        // A channel moved twice while its node left.
        let mut d = Departures::default();
        d.begin(&keys, &kv0, NodeId(1));
        assert!(d.observe(&keys, &kv0, &moved[..1]).is_empty());
        let again = d.observe(&keys, &kv0, &[put(keys.channel(three, &ch("a")))]);
        assert_eq!(again.len(), 1, "{again:?}");

        // The session ends with a channel still under it: a failover.
        let mut d = Departures::default();
        d.begin(&keys, &kv0, NodeId(1));
        let left: BTreeMap<String, KeyValue> = kv0
            .iter()
            .filter(|(k, _)| **k == keys.channel(one, &ch("b")))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let found = d.observe(&keys, &left, &[delete(keys.session(NodeId(1)))]);
        assert_eq!(found.len(), 1, "{found:?}");

        // Disturbed by another fault: followed, not judged.
        let mut d = Departures::default();
        d.begin(&keys, &kv0, NodeId(1));
        d.disturb();
        assert!(d
            .observe(&keys, &left, &[delete(keys.session(NodeId(1)))])
            .is_empty());
        assert_eq!(d.judged, 0);

        // Asked to leave after its session had ended (expired in a partition): its
        // channels fail over by design; moving them twice is not judged.
        let mut d = Departures::default();
        let no_session: BTreeMap<String, KeyValue> = kv0
            .iter()
            .filter(|(k, _)| **k != keys.session(NodeId(1)))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        d.begin(&keys, &no_session, NodeId(1));
        assert!(d.observe(&keys, &no_session, &moved[..1]).is_empty());
        assert!(d
            .observe(&keys, &no_session, &[put(keys.channel(three, &ch("a")))])
            .is_empty());
    }
}
