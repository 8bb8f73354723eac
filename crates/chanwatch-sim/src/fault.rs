//! The kinds of fault (and admin request) the simulation injects, and how often each is
//! drawn.
//!
//! Owns: [`Fault`], its names (the words of the trace and the summary) and the weight table
//! ([`Fault::weight`], [`QUIET`]) from which every step draws with the seeded RNG (`draw`).
//! Must not: inject anything; `world` does, one function per kind (`world/process.rs`,
//! `world/store.rs`, `world/requests.rs`).

use std::fmt;
use std::str::FromStr;

use rand::RngExt;

/// One kind of fault or admin request. [`Fault::ALL`] lists them in the order of the weight
/// table; the [`Ord`] follows it too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    /// A planned restart (DESIGN §5): a node is asked to leave (SIGTERM) and a replacement
    /// starts under a fresh ID; the departure is judged (`departures.rs`) unless another
    /// fault disturbs it.
    NodeRestart,
    /// A node process dies without revoking its lease; a drain or a balance may follow during
    /// the failover.
    NodeCrash,
    /// A new node starts (up to [`crate::SimOptions::max_nodes`]).
    NodeStart,
    /// A node is frozen (SIGSTOP), often past the session TTL: on waking it must not ack
    /// anything. The only fault that excuses two owners at once.
    NodePause,
    /// The leader dies without revoking its lease.
    CoordCrash,
    /// A coordinator starts (while fewer than two run).
    CoordStart,
    /// A deposed leader: frozen past its TTL while a standby takes over, then running again
    /// with its old view.
    CoordPause,
    /// A node's keepalives fail.
    KeepaliveLoss,
    /// A process's keepalives are delayed.
    KeepaliveDelay,
    /// Every watch stream of the store breaks.
    WatchBreak,
    /// The store is compacted at a recent revision.
    Compaction,
    /// A process's txns fail.
    TxnFailures,
    /// Loads of one channel hang.
    HungLoad,
    /// An admin request adds a channel.
    ChannelAdd,
    /// An admin request removes a channel.
    ChannelRemove,
    /// An admin request drains a node.
    Drain,
    /// An admin request balances the cluster.
    Balance,
    /// A node's connection stalls: calls hang (neither fail nor land) while the process runs;
    /// its fencing must stop the channels before the lease can expire.
    NodeStall,
    /// A node is cut off from the store: every call fails and its watches end.
    NodePartition,
    /// The leader's watch stalls silently while its keepalives and txns work: it must find
    /// out from its keepalives' revisions and relist, not time out channels whose acks it
    /// cannot see.
    LeaderWatchStall,
    /// A node's watch silently stops delivering while keepalives and txns work, then the node
    /// is drained: its channels sit in ToRelease unseen, and a forced move must fence it
    /// first.
    WatchStall,
    /// Every load on a node fails for a while; balance must not feed its channels back.
    SickNode,
    /// Every load on a node reports its channel broken while it loads, then succeeds: each
    /// such run must stop before it is acknowledged `WatchFailed`.
    BreakingNode,
    /// The whole store goes away (etcd crash, restart, lost quorum); channels pause, none may
    /// move and no node may register again (invariant 9).
    StoreOutage,
    /// NOSPACE: writes with a put and lease grants are refused, deletes pass.
    Nospace,
    /// An expired auth token: every call of one process but keepalives fails.
    AuthExpired,
    /// A slow store for one process: every call takes up to 1.5 s.
    SlowStore,
}

/// Steps that inject nothing: the cluster just runs on. Out of [`DRAWS`], like each
/// [`Fault::weight`].
pub const QUIET: u32 = 38;

/// What one step draws from: [`QUIET`] plus every kind's weight.
pub const DRAWS: u32 = {
    let mut sum = QUIET;
    let mut i = 0;
    while i < Fault::ALL.len() {
        sum += Fault::ALL[i].weight();
        i += 1;
    }
    sum
};

impl Fault {
    /// Every kind, in the order of the weight table.
    pub const ALL: [Fault; 27] = [
        Fault::NodeRestart,
        Fault::NodeCrash,
        Fault::NodeStart,
        Fault::NodePause,
        Fault::CoordCrash,
        Fault::CoordStart,
        Fault::CoordPause,
        Fault::KeepaliveLoss,
        Fault::KeepaliveDelay,
        Fault::WatchBreak,
        Fault::Compaction,
        Fault::TxnFailures,
        Fault::HungLoad,
        Fault::ChannelAdd,
        Fault::ChannelRemove,
        Fault::Drain,
        Fault::Balance,
        Fault::NodeStall,
        Fault::NodePartition,
        Fault::LeaderWatchStall,
        Fault::WatchStall,
        Fault::SickNode,
        Fault::BreakingNode,
        Fault::StoreOutage,
        Fault::Nospace,
        Fault::AuthExpired,
        Fault::SlowStore,
    ];

    /// The weight table: how many of every [`DRAWS`] (128) steps draw this kind; the other
    /// [`QUIET`] (38) inject nothing. The summary counts what happened, not what was drawn:
    /// a kind drawn when it cannot happen (no node to crash, six nodes already) does nothing
    /// that step, and a drain or a balance also follows some node crashes (a drain every
    /// watch stall).
    ///
    /// The draw takes the quiet steps first, then walks [`Fault::ALL`] in order: reordering
    /// it or changing a weight changes the run every seed gives (the seeds named in tests,
    /// the replay commands of past failures).
    pub const fn weight(self) -> u32 {
        match self {
            Fault::NodeRestart => 2,
            Fault::NodeCrash => 5,
            Fault::NodeStart => 5,
            Fault::NodePause => 5,
            Fault::CoordCrash => 3,
            Fault::CoordStart => 4,
            Fault::CoordPause => 3,
            Fault::KeepaliveLoss => 5,
            Fault::KeepaliveDelay => 3,
            Fault::WatchBreak => 3,
            Fault::Compaction => 3,
            Fault::TxnFailures => 4,
            Fault::HungLoad => 3,
            Fault::ChannelAdd => 5,
            Fault::ChannelRemove => 3,
            Fault::Drain => 3,
            Fault::Balance => 3,
            Fault::NodeStall => 5,
            Fault::NodePartition => 3,
            Fault::LeaderWatchStall => 2,
            Fault::WatchStall => 6,
            Fault::SickNode => 2,
            Fault::BreakingNode => 2,
            Fault::StoreOutage => 2,
            Fault::Nospace => 2,
            Fault::AuthExpired => 2,
            Fault::SlowStore => 2,
        }
    }

    /// The kind's name in the trace (`fault node-crash: ...`) and the summary.
    pub const fn name(self) -> &'static str {
        match self {
            Fault::NodeRestart => "node-restart",
            Fault::NodeCrash => "node-crash",
            Fault::NodeStart => "node-start",
            Fault::NodePause => "node-pause",
            Fault::CoordCrash => "coord-crash",
            Fault::CoordStart => "coord-start",
            Fault::CoordPause => "coord-pause",
            Fault::KeepaliveLoss => "keepalive-loss",
            Fault::KeepaliveDelay => "keepalive-delay",
            Fault::WatchBreak => "watch-break",
            Fault::Compaction => "compaction",
            Fault::TxnFailures => "txn-failures",
            Fault::HungLoad => "hung-load",
            Fault::ChannelAdd => "channel-add",
            Fault::ChannelRemove => "channel-remove",
            Fault::Drain => "drain",
            Fault::Balance => "balance",
            Fault::NodeStall => "node-stall",
            Fault::NodePartition => "node-partition",
            Fault::LeaderWatchStall => "leader-watch-stall",
            Fault::WatchStall => "watch-stall",
            Fault::SickNode => "sick-node",
            Fault::BreakingNode => "breaking-node",
            Fault::StoreOutage => "store-outage",
            Fault::Nospace => "nospace",
            Fault::AuthExpired => "auth-expired",
            Fault::SlowStore => "slow-store",
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is no [`Fault`]'s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownFault(pub String);

impl fmt::Display for UnknownFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no fault kind is named {:?}", self.0)
    }
}

impl std::error::Error for UnknownFault {}

impl FromStr for Fault {
    type Err = UnknownFault;

    /// The kind named `s` ([`Fault::name`]).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Fault::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| UnknownFault(s.to_owned()))
    }
}

/// One step's draw from the weight table: a kind, or `None` for a quiet step.
pub(crate) fn draw(rng: &mut impl RngExt) -> Option<Fault> {
    let mut roll = rng.random_range(0..DRAWS);
    if roll < QUIET {
        return None;
    }
    roll -= QUIET;
    for f in Fault::ALL {
        if roll < f.weight() {
            return Some(f);
        }
        roll -= f.weight();
    }
    unreachable!("a roll below DRAWS falls in the table")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn the_table_draws_from_128_and_lists_each_kind_once_under_its_own_name() {
        assert_eq!(DRAWS, 128);
        let names: std::collections::BTreeSet<&str> = Fault::ALL.iter().map(|f| f.name()).collect();
        assert_eq!(names.len(), Fault::ALL.len());
        for f in Fault::ALL {
            assert_eq!(f.name().parse::<Fault>(), Ok(f));
            assert_eq!(f.to_string(), f.name());
        }
        assert_eq!(
            "no-such-fault".parse::<Fault>(),
            Err(UnknownFault("no-such-fault".into()))
        );
        let mut sorted = Fault::ALL;
        sorted.sort();
        assert_eq!(sorted, Fault::ALL, "the Ord follows the table");
    }

    #[test]
    fn draws_come_out_at_the_table_s_frequencies() {
        let mut rng = rand_xorshift::XorShiftRng::seed_from_u64(1);
        let n = 128_000;
        let mut counts = std::collections::BTreeMap::<Option<Fault>, u32>::new();
        for _ in 0..n {
            *counts.entry(draw(&mut rng)).or_default() += 1;
        }
        let expect = |w: u32| f64::from(w) * f64::from(n) / f64::from(DRAWS);
        let within = |got: u32, w: u32| (f64::from(got) - expect(w)).abs() < 0.1 * expect(w);
        let quiet = counts.get(&None).copied().unwrap_or(0);
        assert!(within(quiet, QUIET), "quiet: {quiet}");
        for f in Fault::ALL {
            let got = counts.get(&Some(f)).copied().unwrap_or(0);
            assert!(within(got, f.weight()), "{f}: {got} of {n}");
        }
    }
}
