//! Test helpers shared by the planner's modules (a [`World`] that feeds events the way the
//! runtime does), and the tests of the planner as a whole: balance converges, and every
//! round plans exactly what a scan of every channel would (the attention index is sound).

use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::keys::ChannelOwner;
use crate::types::{ChannelInfo, ChannelState, Epoch, VChannelInfo};

pub(super) fn name(s: &str) -> ChannelName {
    ChannelName::new(s).expect("valid")
}

fn session(id: u64) -> NodeSession {
    NodeSession {
        id: NodeId(id),
        admin_addr: String::new(),
        version: "t".into(),
        started_at_ms: 0,
        capacity: 0,
        name: String::new(),
        extra: Default::default(),
    }
}

/// A channel value of `weight` in `group`.
pub(super) fn weighted(
    ch: &str,
    state: ChannelState,
    weight: u32,
    group: Option<&str>,
) -> ChannelInfo {
    let mut i = info(ch, state, 1, 0);
    i.weight = weight;
    i.group = group.map(str::to_owned);
    i
}

pub(super) fn info(ch: &str, state: ChannelState, epoch: u64, start: u64) -> ChannelInfo {
    let mut i = ChannelInfo::new(name(ch), Epoch(epoch), start, VChannelInfo::default());
    i.state = state;
    i
}

pub(super) struct World {
    pub(super) state: Planner,
    pub(super) keys: Keys,
    pub(super) rev: i64,
}

impl World {
    pub(super) fn new(config: PlannerConfig) -> Self {
        let keys = Keys::default();
        World {
            state: Planner::new(keys.clone(), config),
            keys,
            rev: 100,
        }
    }
    pub(super) fn node(&mut self, id: u64) {
        self.rev += 1;
        let key = self.keys.session(NodeId(id));
        self.state.apply_put(&key, &session(id).encode(), self.rev);
    }
    /// Node `id` announces that it is leaving (a planned restart): its session is rewritten.
    pub(super) fn leaving(&mut self, id: u64) {
        self.rev += 1;
        let key = self.keys.session(NodeId(id));
        let mut s = session(id);
        s.set_leaving(true);
        self.state.apply_put(&key, &s.encode(), self.rev);
    }
    /// A node of `capacity` joins.
    pub(super) fn node_cap(&mut self, id: u64, capacity: u32) {
        self.rev += 1;
        let key = self.keys.session(NodeId(id));
        let mut s = session(id);
        s.capacity = capacity;
        self.state.apply_put(&key, &s.encode(), self.rev);
    }
    /// Nodes answer as the node machine does: `ToRelease` → `Released`, `ToWatch` →
    /// `Watched`.
    pub(super) fn answer(&mut self) {
        let entries: Vec<Entry> = self.state.entries().cloned().collect();
        for e in entries {
            let mut i = e.info.clone();
            i.state = match i.state {
                ChannelState::ToRelease => ChannelState::Released,
                ChannelState::ToWatch => ChannelState::Watched,
                other => other,
            };
            if i != e.info && e.owner != ChannelOwner::Remaining {
                self.put(e.owner, i);
            }
        }
    }
    /// Each node's load as a float, in node ID order.
    pub(super) fn load_values(&self) -> Vec<f64> {
        self.state.loads().iter().map(|(_, l)| l.value()).collect()
    }
    pub(super) fn kill(&mut self, id: u64) {
        self.state
            .apply_delete(&self.keys.session(NodeId(id)), self.rev);
    }
    pub(super) fn put(&mut self, owner: ChannelOwner, i: ChannelInfo) -> i64 {
        self.rev += 1;
        let key = self.keys.channel(owner, &i.channel);
        assert_eq!(self.state.apply_put(&key, &i.encode(), self.rev), None);
        self.rev
    }
    /// Plans and applies everything, as a runtime whose txns all succeed would.
    pub(super) fn settle(&mut self, now: u64) -> Vec<PlannedTxn> {
        let txns = self.state.plan(now);
        for t in &txns {
            self.rev += 1;
            self.state.applied(t, self.rev);
        }
        txns
    }
    /// An operator's move of `ch` to node `to` at time 0, applied as its txn succeeded.
    pub(super) fn move_to(&mut self, ch: &str, to: u64) -> PlannedTxn {
        let txn = self
            .state
            .move_channel(&name(ch), NodeId(to), 0)
            .expect("move");
        self.rev += 1;
        self.state.applied(&txn, self.rev);
        txn
    }
    pub(super) fn owner_of(&self, ch: &str) -> (ChannelOwner, ChannelState, Epoch) {
        let e = self.state.entry(&name(ch)).expect("exists");
        (e.owner, e.info.state, e.info.epoch)
    }
}

pub(super) fn n(id: u64) -> ChannelOwner {
    ChannelOwner::Node(NodeId(id))
}

#[test]
fn balance_converges_and_stops_moving() {
    let keys = Keys::default();
    let mut s = Planner::new(keys.clone(), PlannerConfig::default());
    let mut rev = 1;
    for id in 1..=2u64 {
        rev += 1;
        let sess = NodeSession {
            id: NodeId(id),
            admin_addr: String::new(),
            version: String::new(),
            started_at_ms: 0,
            capacity: 0,
            name: String::new(),
            extra: Default::default(),
        };
        s.apply_put(&keys.session(NodeId(id)), &sess.encode(), rev);
    }
    for i in 0..21 {
        let owner = ChannelOwner::Node(NodeId(1 + (i % 2)));
        let mut info = ChannelInfo::new(
            ChannelName::new(format!("c{i:02}")).expect("valid"),
            Epoch(1),
            0,
            VChannelInfo::default(),
        );
        info.state = ChannelState::Watched;
        rev += 1;
        s.apply_put(&keys.channel(owner, &info.channel), &info.encode(), rev);
    }
    rev += 1;
    let sess = NodeSession {
        id: NodeId(3),
        admin_addr: String::new(),
        version: String::new(),
        started_at_ms: 0,
        capacity: 0,
        name: String::new(),
        extra: Default::default(),
    };
    s.apply_put(&keys.session(NodeId(3)), &sess.encode(), rev);
    let mut total_moves = 0;
    for round in 0..50 {
        // A second per round: balance waits `balance_quiet_ms` after node 3 joined.
        let txns = s.plan(round * 1_000);
        for t in &txns {
            rev += 1;
            s.applied(t, rev);
            total_moves += t
                .transitions
                .iter()
                .filter(|t| t.state == Some(ChannelState::ToWatch))
                .count();
        }
        // Nodes answer: ToRelease -> Released, ToWatch -> Watched.
        let entries: Vec<Entry> = s.entries().cloned().collect();
        for e in entries {
            let mut info = e.info.clone();
            info.state = match info.state {
                ChannelState::ToRelease => ChannelState::Released,
                ChannelState::ToWatch => ChannelState::Watched,
                other => other,
            };
            if info != e.info {
                rev += 1;
                s.apply_put(&keys.channel(e.owner, &info.channel), &info.encode(), rev);
            }
        }
    }
    let loads: Vec<usize> = s
        .loads()
        .iter()
        .map(|(n, _)| s.loads().channels(n))
        .collect();
    assert_eq!(loads, [7, 7, 7]);
    // The incremental per-node counts agree with a full count.
    let mut brute: BTreeMap<NodeId, usize> = BTreeMap::new();
    for e in s.entries() {
        if let ChannelOwner::Node(n) = e.owner {
            *brute.entry(n).or_default() += 1;
        }
    }
    assert_eq!(brute.values().copied().collect::<Vec<_>>(), [7, 7, 7]);
    s.kill_for_test(NodeId(3));
    let failed_over = s.plan(100);
    for t in &failed_over {
        rev += 1;
        s.applied(t, rev);
    }
    let loads: Vec<usize> = s
        .loads()
        .iter()
        .map(|(n, _)| s.loads().channels(n))
        .collect();
    assert_eq!(loads, [11, 10], "failover keeps the counts right");
    assert_eq!(total_moves, 7, "moves beyond the minimum");
}

mod index {
    //! The attention index must make a round plan exactly what a scan of every channel
    //! would.
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        Up(u64),
        Down(u64),
        Put {
            ch: u8,
            owner: u64,
            state: ChannelState,
            epoch: u64,
        },
        Delete {
            ch: u8,
            owner: u64,
        },
        Plan {
            advance_ms: u64,
            apply: bool,
        },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1..5u64).prop_map(Step::Up),
            (1..5u64).prop_map(Step::Down),
            (
                0..8u8,
                0..5u64,
                proptest::sample::select(ChannelState::ALL.to_vec()),
                1..4u64
            )
                .prop_map(|(ch, owner, state, epoch)| Step::Put {
                    ch,
                    owner,
                    state,
                    epoch
                }),
            (0..8u8, 0..5u64).prop_map(|(ch, owner)| Step::Delete { ch, owner }),
            (0..20_000u64, any::<bool>())
                .prop_map(|(advance_ms, apply)| Step::Plan { advance_ms, apply }),
        ]
    }

    fn owner(id: u64) -> ChannelOwner {
        if id == 0 {
            ChannelOwner::Remaining
        } else {
            ChannelOwner::Node(NodeId(id))
        }
    }

    fn check(state: &Planner) {
        let expect: BTreeSet<ChannelName> = state
            .channels
            .iter()
            .filter(|(_, o)| {
                !(o.settled()
                    && o.values().all(
                        |e| matches!(e.owner, ChannelOwner::Node(n) if state.nodes.contains_key(&n)),
                    ))
            })
            .map(|(c, _)| c.clone())
            .collect();
        assert_eq!(state.attention, expect, "attention set out of step");
        let mut census = Census {
            by_state: [0; 5],
            remaining: 0,
        };
        for e in state.entries() {
            let i = ChannelState::ALL
                .iter()
                .position(|s| *s == e.info.state)
                .expect("a state");
            census.by_state[i] += 1;
            census.remaining += usize::from(e.owner == ChannelOwner::Remaining);
        }
        assert_eq!(state.census(), census, "census differs from a full count");
        // `balance_plan` must be the round a copy of the view would plan with no move
        // in flight and no limit.
        let mut sim = state.clone();
        sim.config.max_concurrent_moves = usize::MAX;
        sim.config.balance_quiet_ms = 0;
        sim.quiet_since_ms = 0;
        sim.moves.clear();
        sim.moved_at.clear();
        sim.troubled.clear();
        sim.avoid.clear();
        sim.plan_balance(0, &mut Vec::new());
        let expect: BTreeMap<ChannelName, NodeId> =
            sim.moves.iter().map(|(c, m)| (c.clone(), m.to)).collect();
        let got: BTreeMap<ChannelName, NodeId> = state
            .balance_plan()
            .into_iter()
            .map(|m| (m.channel, m.to))
            .collect();
        assert_eq!(got, expect, "balance plan differs from a round on a copy");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn rounds_plan_what_a_full_scan_plans(steps in proptest::collection::vec(step(), 1..60)) {
            let mut w = World::new(PlannerConfig::default());
            let mut now = 1_000u64;
            for s in steps {
                match s {
                    Step::Up(id) => w.node(id),
                    Step::Down(id) => w.kill(id),
                    Step::Put { ch, owner: o, state, epoch } => {
                        w.put(owner(o), info(&format!("c{ch}"), state, epoch, now));
                    }
                    Step::Delete { ch, owner: o } => {
                        let key = w.keys.channel(owner(o), &name(&format!("c{ch}")));
                        w.rev += 1;
                        w.state.apply_delete(&key, w.rev);
                    }
                    Step::Plan { advance_ms, apply } => {
                        now += advance_ms;
                        let mut full = w.state.clone();
                        full.attention = full.channels.keys().cloned().collect();
                        let expect = full.plan(now);
                        let got = w.state.plan(now);
                        prop_assert_eq!(&got, &expect);
                        prop_assert_eq!(&w.state.moves, &full.moves);
                        prop_assert_eq!(&w.state.avoid, &full.avoid);
                        if apply {
                            for t in &got {
                                w.rev += 1;
                                w.state.applied(t, w.rev);
                            }
                        }
                    }
                }
                check(&w.state);
            }
        }
    }
}
