//! The checks of static stability and churn (invariants 9 and 7): what a store outage may not
//! cause (registrations again, failovers), and no ping-pong of a channel with a node that
//! just failed it.
//!
//! Owns: nothing of its own; methods of [`Checker`] over its shadow of the key space.
//! Must not: drive the cluster.

use super::*;

impl Checker {
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

    pub(super) fn check_static_stability(
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
    pub(super) fn check_churn(
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
}
