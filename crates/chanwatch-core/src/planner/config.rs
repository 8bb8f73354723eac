//! The planner's tunables ([`PlannerConfig`]) and the safety rules a test may switch off
//! ([`PlannerBug`]). Plain data: no logic here but the defaults.

use super::MaxLoad;

/// Tunables of the planner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannerConfig {
    /// A `ToWatch` with no progress for this long is reassigned.
    pub watch_timeout_ms: u64,
    /// A `ToRelease` not `Released` within this long is force-moved, once its owner is
    /// fenced: the planner asks the runtime to revoke the owner's session lease
    /// ([`Planner::take_fence_requests`]) instead of moving the channel beside it.
    ///
    /// [`Planner::take_fence_requests`]: crate::planner::Planner::take_fence_requests
    pub release_timeout_ms: u64,
    /// How long the channels of a node whose lease this coordinator revoked are held before
    /// they fail over: the node's session TTL, by which a node that could not hear of the
    /// revoke has fenced itself (it fences when no keepalive succeeded for `ttl - margin`).
    pub fence_wait_ms: u64,
    /// Balance starts no move for this long after a membership change (a node joined or
    /// left), a failed load or a timeout: the cluster settles before load is evened out.
    pub balance_quiet_ms: u64,
    /// A channel that moved (for any reason) is not picked by balance again for this long.
    pub move_cooldown_ms: u64,
    /// How long a node that failed or timed out a channel is avoided for that channel.
    pub failed_node_backoff_ms: u64,
    /// Most operations (and compares) in one txn, including the runtime's leader guard.
    pub max_txn_ops: usize,
    /// Most bytes of values in one txn, kept under etcd's request limit.
    pub max_txn_bytes: usize,
    /// Most balance/drain moves in flight at once.
    pub max_concurrent_moves: usize,
    /// Cold start: a leader that finds no channel under a live node places nothing until
    /// this many nodes are live (or `startup_grace_ms` has passed). 0: no wait.
    pub expected_nodes: usize,
    /// Cold start: the longest wait for `expected_nodes`.
    pub startup_grace_ms: u64,
    /// A safety rule switched off, to prove that a check catches it. Only in builds with the
    /// `planted-bugs` feature (the tests and the lab), never in the binary users get.
    #[cfg(feature = "planted-bugs")]
    pub planted_bug: Option<PlannerBug>,
    /// `--max-load`: no placement takes a node above this load (weights over capacity);
    /// what fits nowhere waits under `remaining` with a reason. `None`: no cap.
    pub max_load: Option<MaxLoad>,
    /// `--auto-balance`: balance runs on its own. Off, it runs only when asked
    /// ([`Planner::ask_balance`], `ctl balance`).
    ///
    /// [`Planner::ask_balance`]: crate::planner::Planner::ask_balance
    pub auto_balance: bool,
}

/// Safety rules of the planner a test can switch off ([`PlannerConfig::planted_bug`];
/// feature `planted-bugs`).
#[cfg(feature = "planted-bugs")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlannerBug {
    /// A release past the release timeout is moved at once, beside a live owner, as before
    /// DESIGN v2 (no fencing by lease revoke).
    ForceWithoutFence,
    /// Balance ignores failing-node back-offs, troubled nodes and cool-downs.
    BalanceIgnoresBackoff,
    /// The leader's runtime never checks its watch against its keepalives' revisions: a
    /// silent stall goes unnoticed until the resync (read by the coordinator's term, not by
    /// the planner).
    NoWatchStallCheck,
    /// The leader plans as soon as it sees a session loss, not once a burst of losses is over
    /// (read by the coordinator's term): a round may put channels on a node whose loss the
    /// next watch batch shows, and its txn is refused or the channels move twice.
    NoLossHold,
    /// The planner ignores that its view is known to be behind the store: it retries a
    /// failed channel on the node that failed it (its back-off over, no other candidate in
    /// view: a node that registered meanwhile is not seen), and it times out loads and
    /// releases whose acks the stale view may hide.
    IgnoreBehind,
}

#[cfg(feature = "planted-bugs")]
impl PlannerConfig {
    /// Whether `bug` is planted.
    pub fn planted(&self, bug: PlannerBug) -> bool {
        self.planted_bug == Some(bug)
    }
}

#[cfg(feature = "planted-bugs")]
impl PlannerBug {
    /// The bug's name, as its `--plant` value and its metric label say it.
    pub fn name(self) -> &'static str {
        match self {
            PlannerBug::ForceWithoutFence => "force-without-fence",
            PlannerBug::BalanceIgnoresBackoff => "balance-ignores-backoff",
            PlannerBug::NoWatchStallCheck => "no-watch-stall-check",
            PlannerBug::NoLossHold => "no-loss-hold",
            PlannerBug::IgnoreBehind => "ignore-behind",
        }
    }
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            watch_timeout_ms: 30_000,
            release_timeout_ms: 30_000,
            fence_wait_ms: 10_000,
            balance_quiet_ms: 5_000,
            move_cooldown_ms: 60_000,
            failed_node_backoff_ms: 30_000,
            max_txn_ops: 128,
            max_txn_bytes: 1024 * 1024,
            max_concurrent_moves: 16,
            #[cfg(feature = "planted-bugs")]
            planted_bug: None,
            expected_nodes: 0,
            startup_grace_ms: 10_000,
            max_load: None,
            auto_balance: true,
        }
    }
}
