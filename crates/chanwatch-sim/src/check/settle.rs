//! What "settled" means after the faults stop, and single ownership in time from the
//! handler's intervals ([`overlaps`]).
//!
//! Owns: nothing of its own; methods of [`Checker`] and a free function over intervals.
//! Must not: drive the cluster.

use super::*;

impl Checker {
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
