//! The fault kinds of the chaos run, which of them a run injects (its mode), and in what
//! order: every kind of the mode once first, in an order shuffled by the run's seed, then
//! kinds drawn at random until the time is up. The run fails when a kind of its mode did not
//! run at all ([`Schedule::missing`]).

use std::collections::BTreeMap;

/// One kind of fault; [`FaultKind::ALL`] lists them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FaultKind {
    /// `kill -9` of a node; a new one starts.
    KillNode,
    /// `kill -9` of the leading coordinator; a new one starts.
    KillLeader,
    /// `SIGSTOP` of a node for TTL + 2 s, then `SIGCONT`.
    StopNode,
    /// A restart of one etcd member.
    RestartEtcd,
    /// `SIGSTOP` of one follower member for 5-10 s.
    FreezeMember,
    /// A compaction at the current revision.
    Compact,
    /// Every etcd member `kill -9`ed for 5-20 s, then restarted on its data.
    EtcdOutage,
    /// The quota filled until NOSPACE, held 5-10 s (the busiest node killed halfway).
    NoSpace,
    /// The node in the network namespace cut off from etcd for 5-15 s.
    Partition,
    /// nats-server `kill -9`ed, down 3-8 s, started again on its store.
    NatsRestart,
}

/// What a kind needs that a run may not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// The network namespace (root, `ip`, `iptables`).
    Netns,
    /// The data plane (`CHANWATCH_CHAOS_DATA` not `0`).
    DataPlane,
}

impl FaultKind {
    /// Every kind, in the order of the docs.
    pub const ALL: [FaultKind; 10] = [
        FaultKind::KillNode,
        FaultKind::KillLeader,
        FaultKind::StopNode,
        FaultKind::RestartEtcd,
        FaultKind::FreezeMember,
        FaultKind::Compact,
        FaultKind::EtcdOutage,
        FaultKind::NoSpace,
        FaultKind::Partition,
        FaultKind::NatsRestart,
    ];

    /// The name printed in the fault lines and accepted by `CHANWATCH_CHAOS_KINDS`.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::KillNode => "kill-node",
            FaultKind::KillLeader => "kill-leader",
            FaultKind::StopNode => "stop-node",
            FaultKind::RestartEtcd => "restart-etcd",
            FaultKind::FreezeMember => "freeze-member",
            FaultKind::Compact => "compact",
            FaultKind::EtcdOutage => "etcd-outage",
            FaultKind::NoSpace => "nospace",
            FaultKind::Partition => "partition",
            FaultKind::NatsRestart => "nats-restart",
        }
    }

    pub fn parse(name: &str) -> Option<FaultKind> {
        FaultKind::ALL.into_iter().find(|k| k.name() == name)
    }

    pub fn needs(self) -> Option<Needs> {
        match self {
            FaultKind::Partition => Some(Needs::Netns),
            FaultKind::NatsRestart => Some(Needs::DataPlane),
            _ => None,
        }
    }
}

impl std::fmt::Display for FaultKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `pad`, so that `{kind:<13}` aligns the fault lines.
        f.pad(self.name())
    }
}

/// The kinds a run injects (each of them must run) and the kinds it leaves out, with why.
#[derive(Debug)]
pub struct Mode {
    pub kinds: Vec<FaultKind>,
    pub left_out: Vec<(FaultKind, String)>,
}

impl Mode {
    /// `netns`: why there is no network namespace (None: there is one); `data`: whether the
    /// data plane runs; `only`: `CHANWATCH_CHAOS_KINDS`, comma-separated names.
    ///
    /// # Errors
    /// A name in `only` that is no kind, or no kind left to inject.
    pub fn new(netns: Option<&str>, data: bool, only: Option<&str>) -> Result<Mode, String> {
        let only = match only {
            None => None,
            Some(list) => {
                let mut named = Vec::new();
                for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                    named.push(FaultKind::parse(name).ok_or_else(|| {
                        format!(
                            "CHANWATCH_CHAOS_KINDS={list}: {name:?} is no fault kind (kinds: {})",
                            names(&FaultKind::ALL)
                        )
                    })?);
                }
                Some(named)
            }
        };
        let mut mode = Mode {
            kinds: Vec::new(),
            left_out: Vec::new(),
        };
        for kind in FaultKind::ALL {
            let why = match (kind.needs(), netns) {
                _ if only.as_ref().is_some_and(|o| !o.contains(&kind)) => {
                    Some("not in CHANWATCH_CHAOS_KINDS".to_owned())
                }
                (Some(Needs::Netns), Some(why)) => Some(format!("no network namespace: {why}")),
                (Some(Needs::DataPlane), _) if !data => {
                    Some("no data plane (CHANWATCH_CHAOS_DATA=0)".to_owned())
                }
                _ => None,
            };
            match why {
                Some(why) => mode.left_out.push((kind, why)),
                None => mode.kinds.push(kind),
            }
        }
        if mode.kinds.is_empty() {
            return Err(format!(
                "no fault kind to inject: {}",
                mode.left_out
                    .iter()
                    .map(|(k, why)| format!("{k} ({why})"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        Ok(mode)
    }
}

/// Names, space-separated.
pub fn names(kinds: &[FaultKind]) -> String {
    kinds.iter().map(|k| k.name()).collect::<Vec<_>>().join(" ")
}

/// The order of the faults (see the module docs) and how often each kind ran.
pub struct Schedule {
    kinds: Vec<FaultKind>,
    /// The first round, still to come, next last.
    round: Vec<FaultKind>,
    ran: BTreeMap<FaultKind, usize>,
}

impl Schedule {
    /// `rand(n)`: a number below `n` (the run's seeded generator).
    pub fn new(kinds: &[FaultKind], rand: &mut impl FnMut(u64) -> u64) -> Schedule {
        let mut round = kinds.to_vec();
        // Fisher-Yates.
        for i in (1..round.len()).rev() {
            let j = rand(i as u64 + 1) as usize;
            round.swap(i, j);
        }
        round.reverse();
        Schedule {
            kinds: kinds.to_vec(),
            round,
            ran: kinds.iter().map(|k| (*k, 0)).collect(),
        }
    }

    /// The first round's order, as it will run.
    pub fn first_round(&self) -> Vec<FaultKind> {
        self.round.iter().rev().copied().collect()
    }

    /// The next kind: the first round's next, else one at random.
    pub fn next(&mut self, rand: &mut impl FnMut(u64) -> u64) -> FaultKind {
        match self.round.pop() {
            Some(k) => k,
            None => self.kinds[rand(self.kinds.len() as u64) as usize],
        }
    }

    /// Whether the first round is over (every kind has been handed out once).
    pub fn first_round_done(&self) -> bool {
        self.round.is_empty()
    }

    /// Notes that a fault of this kind ran.
    pub fn ran(&mut self, kind: FaultKind) {
        *self.ran.entry(kind).or_default() += 1;
    }

    /// How often each kind of the mode ran.
    pub fn counts(&self) -> &BTreeMap<FaultKind, usize> {
        &self.ran
    }

    /// The kinds of the mode that did not run.
    pub fn missing(&self) -> Vec<FaultKind> {
        self.ran
            .iter()
            .filter(|(_, n)| **n == 0)
            .map(|(k, _)| *k)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xorshift(seed: u64) -> impl FnMut(u64) -> u64 {
        let mut s = seed | 1;
        move |n| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            s.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1)
        }
    }

    #[test]
    fn every_kind_has_a_name_that_parses_back() {
        for k in FaultKind::ALL {
            assert_eq!(FaultKind::parse(k.name()), Some(k));
        }
        assert_eq!(FaultKind::parse("kill"), None);
    }

    #[test]
    fn the_first_round_injects_every_kind_of_the_mode_once_then_kinds_at_random() {
        for seed in 0..50 {
            let mut rand = xorshift(seed);
            let mode = Mode::new(None, true, None).expect("a mode");
            assert_eq!(mode.kinds, FaultKind::ALL.to_vec());
            let mut s = Schedule::new(&mode.kinds, &mut rand);
            let mut first: Vec<FaultKind> = (0..mode.kinds.len())
                .map(|_| {
                    let k = s.next(&mut rand);
                    s.ran(k);
                    k
                })
                .collect();
            assert!(s.first_round_done());
            assert!(s.missing().is_empty());
            first.sort();
            assert_eq!(first, FaultKind::ALL.to_vec(), "seed {seed}");
            for _ in 0..20 {
                assert!(mode.kinds.contains(&s.next(&mut rand)));
            }
        }
    }

    #[test]
    fn a_mode_leaves_out_what_it_cannot_inject_and_says_why() {
        let mode = Mode::new(Some("not root"), false, None).expect("a mode");
        let out: Vec<FaultKind> = mode.left_out.iter().map(|(k, _)| *k).collect();
        assert_eq!(out, vec![FaultKind::Partition, FaultKind::NatsRestart]);
        assert!(mode.left_out[0].1.contains("not root"));
        assert_eq!(mode.kinds.len(), FaultKind::ALL.len() - 2);
        let mut rand = xorshift(7);
        let mut s = Schedule::new(&mode.kinds, &mut rand);
        let k = s.next(&mut rand);
        s.ran(k);
        assert_eq!(
            s.missing().len(),
            mode.kinds.len() - 1,
            "the others are missing"
        );
        let only = Mode::new(None, true, Some("partition, nospace")).expect("a mode");
        assert_eq!(only.kinds, vec![FaultKind::NoSpace, FaultKind::Partition]);
        assert!(Mode::new(None, true, Some("partition,bogus")).is_err());
        assert!(Mode::new(Some("no ip"), true, Some("partition")).is_err());
    }
}
