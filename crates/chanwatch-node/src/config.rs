//! A node's settings, its status as others see it, and the errors that end it.
//!
//! Owns: [`NodeConfig`] (with the fence margin's default), [`Stop`], [`NodeStatus`], [`NodeError`] and
//! the test-only [`PlantedBug`]. Must not: hold behaviour — the runtime reads these.

use std::sync::Arc;
use std::time::Duration;

use chanwatch_core::{Keys, NodeId};
use chanwatch_store::StoreError;

/// Settings of a node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Key layout.
    pub keys: Keys,
    /// Lease TTL of the session (minimum 2 s: [`chanwatch_store::MIN_SESSION_TTL`]).
    pub session_ttl: Duration,
    /// How early, before the lease could expire, a node that cannot renew it stops its
    /// channels: `max(1 s, ttl / 5)` unless set.
    pub fence_margin: Option<Duration>,
    /// Least time between two progress writes of one load.
    pub progress_interval: Duration,
    /// Written into the session for operators.
    pub admin_addr: String,
    /// The node's stable name, written into the session (`node --name`; empty: none).
    pub name: String,
    /// Relative capacity written into the session.
    pub capacity: u32,
    /// How long a node asked to leave ([`Stop::Leave`], SIGTERM) waits for the coordinator
    /// to move its channels off before it stops them and revokes its lease anyway; zero
    /// stops and revokes at once (the behaviour before planned restarts).
    pub shutdown_timeout: Duration,
    /// Where the node's metrics go (shared by the nodes of one process).
    pub metrics: Arc<crate::metrics::NodeMetrics>,
    /// A safety mechanism switched off, so that a check (the simulation's checker, a
    /// black-box test through `node --plant`) can prove it notices. Only in builds with the
    /// `planted-bugs` feature (the tests and the lab), never in the binary users get.
    #[cfg(feature = "planted-bugs")]
    pub planted_bug: Option<PlantedBug>,
}

/// The planted bug the runtime consults, if any ([`planted!`](crate::planted)). Without the
/// `planted-bugs` feature it holds nothing and every bug reads as off.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Planted(#[cfg(feature = "planted-bugs")] pub(crate) Option<PlantedBug>);

impl Planted {
    /// What `config` plants.
    pub(crate) fn of(config: &NodeConfig) -> Self {
        #[cfg(feature = "planted-bugs")]
        let planted = Planted(config.planted_bug);
        #[cfg(not(feature = "planted-bugs"))]
        let planted = {
            let _ = config;
            Planted()
        };
        planted
    }
}

/// Safety mechanisms a test can switch off (see [`NodeConfig::planted_bug`]; feature
/// `planted-bugs`).
#[cfg(feature = "planted-bugs")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlantedBug {
    /// Keep running channels while keepalives fail, until the store says the lease is gone
    /// (no self-fencing at `ttl - margin`).
    NoFencing,
    /// Acknowledge without comparing the key's mod revision or the session.
    UnguardedAck,
    /// Ignore watch progress: a watch that stalls silently while keepalives succeed goes
    /// unnoticed (the node still pauses when keepalives or the list-watch fail).
    NoWatchProgress,
    /// Commit a checkpoint without comparing the assignment key's create revision: a run
    /// whose channel moved away can still land its commit while the session lives.
    UnguardedCommit,
}

#[cfg(feature = "planted-bugs")]
impl PlantedBug {
    /// The bug's name, as its `--plant` value and its metric label say it.
    pub fn name(self) -> &'static str {
        match self {
            PlantedBug::NoFencing => "no-fencing",
            PlantedBug::UnguardedAck => "unguarded-ack",
            PlantedBug::NoWatchProgress => "no-watch-progress",
            PlantedBug::UnguardedCommit => "unguarded-commit",
        }
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            keys: Keys::default(),
            session_ttl: Duration::from_secs(10),
            fence_margin: None,
            progress_interval: Duration::from_secs(5),
            admin_addr: String::new(),
            name: String::new(),
            capacity: 0,
            shutdown_timeout: Duration::from_secs(60),
            metrics: Arc::new(crate::metrics::NodeMetrics::new()),
            #[cfg(feature = "planted-bugs")]
            planted_bug: None,
        }
    }
}

impl NodeConfig {
    pub(crate) fn margin(&self) -> Duration {
        self.fence_margin
            .unwrap_or_else(|| chanwatch_store::fence_margin(self.session_ttl))
    }
}

/// What a running node is asked to do ([`crate::run_until`]): the levels only rise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum Stop {
    /// Keep running.
    #[default]
    Run,
    /// A planned restart: announce `leaving` in the session, keep running while the
    /// coordinator moves every channel off (break-before-make), exit when none is left or
    /// after [`NodeConfig::shutdown_timeout`] (then as [`Stop::Now`]).
    Leave,
    /// Stop every channel and revoke the lease at once (their channels fail over).
    Now,
}

/// Why a node stopped for good.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The configuration cannot work (fatal).
    #[error("bad node configuration: {0}")]
    Config(String),
    /// At start-up, the store refused the node's credentials or role (a configuration
    /// error; see [`StoreError::is_config`]). Every other store error is retried.
    /// (The store's words are in the message, so it is not also the `source`: an error
    /// chain printed them twice.)
    #[error("store refused the node: {0}")]
    Store(StoreError),
    /// The node's task panicked or was cancelled (a bug: please report it with the log).
    #[error("the node's task ended abnormally: {0}")]
    Task(String),
}

/// What a node shows to the outside (tests, admin API).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeStatus {
    /// The current session's node ID (`None` between sessions).
    pub id: Option<NodeId>,
    /// Sessions started so far (a re-registration after fencing makes a new one).
    pub sessions: u64,
    /// Times the node fenced itself.
    pub fences: u64,
    /// Why every channel is paused, while it is (the store is out of reach).
    pub paused: Option<String>,
    /// Times the node paused its channels.
    pub pauses: u64,
    /// The node's name (`node --name`; empty: none).
    pub name: String,
}

impl NodeStatus {
    /// Why the node is not ready to run channels (not registered, or paused), or `None`
    /// when it is: what `GET /readyz` answers.
    #[must_use]
    pub fn not_ready(&self) -> Option<String> {
        match (&self.id, &self.paused) {
            (None, _) => Some("not registered: no session in the store yet".into()),
            (Some(_), Some(why)) => Some(format!("paused: {why}")),
            (Some(_), None) => None,
        }
    }
}
