//! Starting and stopping a coordinator as a library: [`Coordinator::builder`] →
//! [`CoordinatorBuilder::spawn`] → [`CoordHandle`]; and its settings,
//! [`CoordinatorConfig`].
//!
//! Owns: the settings, registering the metrics, and wiring a [`Coordinator`] to its
//! [`CoordHandle`].
//! Must not: campaign, plan or write (that is `election.rs`, `term.rs`, `execute.rs`).

use std::sync::Arc;
use std::time::Duration;

use chanwatch_core::planner::PlannerConfig;
use chanwatch_core::Keys;
use chanwatch_store::{millis, Clock, MetaStore};
use tracing::error;

use crate::handle::HandleEnds;
use crate::{CoordError, CoordHandle};

/// Settings of a coordinator.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// Key layout.
    pub keys: Keys,
    /// Planner settings (timeouts, limits, moves in flight).
    pub planner: PlannerConfig,
    /// Lease TTL of the leader key; a standby takes over within about this long.
    pub session_ttl: Duration,
    /// Full relist period (jittered: each wait is 80-100 % of it): a missed event can never
    /// stay unnoticed longer than this. A stalled watch is found sooner, from the revisions
    /// of the leader lease's keepalives that its progress has not reached.
    pub resync_interval: Duration,
    /// Period of the planner tick (timeouts).
    pub tick: Duration,
    /// The leader compacts the store this often, to the revision it saw one interval earlier
    /// (DESIGN.md §8); zero turns compaction off (then run etcd with auto-compaction).
    pub compact_interval: Duration,
    /// Txns in flight at once when a plan has several. 32: a failover of 1,000 channels (16
    /// packed move txns) goes out at once; with 8 the leader loop waited for two waves.
    pub pipeline: usize,
    /// Identifies this process in the leader key and logs.
    pub id: String,
    /// Admin API address written into the leader key (what `ctl` connects to).
    pub admin_addr: String,
    /// Where the coordinator's metrics go.
    pub metrics: Arc<crate::metrics::CoordMetrics>,
    /// etcd's `--quota-backend-bytes`, exported as `chanwatch_etcd_quota_bytes` when etcd does
    /// not say its own (before 3.6). Default: etcd's default, 2 GiB.
    pub quota_backend_bytes: u64,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            keys: Keys::default(),
            planner: PlannerConfig::default(),
            session_ttl: Duration::from_secs(10),
            resync_interval: Duration::from_secs(300),
            tick: Duration::from_secs(1),
            compact_interval: Duration::from_secs(600),
            pipeline: 32,
            id: format!("coord-{}", std::process::id()),
            admin_addr: String::new(),
            metrics: Arc::new(crate::metrics::CoordMetrics::new()),
            quota_backend_bytes: crate::upkeep::DEFAULT_QUOTA,
        }
    }
}

/// A coordinator not yet running: made by [`CoordinatorBuilder::build`] for callers that
/// drive it on their own task ([`Coordinator::run`]); most use
/// [`CoordinatorBuilder::spawn`].
pub struct Coordinator {
    store: Arc<dyn MetaStore>,
    config: CoordinatorConfig,
    clock: Clock,
    ends: HandleEnds,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("store", &self.store.describe())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for CoordinatorBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinatorBuilder")
            .field("store", &self.store.describe())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Coordinator {
    /// Starts configuring a coordinator on `store` (an [`chanwatch_store::EmbeddedStore`],
    /// or an [`chanwatch_store::EtcdStore`] shared with nothing that writes under its root).
    pub fn builder(store: Arc<dyn MetaStore>) -> CoordinatorBuilder {
        CoordinatorBuilder {
            store,
            config: CoordinatorConfig::default(),
            clock: Clock::system(),
            registry: None,
        }
    }

    /// Runs until stopped ([`CoordHandle::stop`], or every handle dropped): campaign, lead or
    /// stand by, and serve the handle's requests. On stop a leader revokes its lease so a
    /// standby takes over at once. Dropping this future unfinished is a crash: the lease
    /// stays until its TTL runs out.
    ///
    /// # Errors
    /// [`CoordError::Store`] only for a configuration error before the store ever answered;
    /// every other store error (outage, NOSPACE, refused credentials, ...) is logged and
    /// retried with jittered back-off.
    pub async fn run(self) -> Result<(), CoordError> {
        let (result, _ended) = self.drive().await;
        result
    }

    /// Runs, and hands back the end whose drop tells the handles it has ended.
    async fn drive(self) -> (Result<(), CoordError>, tokio::sync::watch::Sender<()>) {
        let Coordinator {
            store,
            config,
            clock,
            ends,
        } = self;
        let HandleEnds {
            requests,
            status,
            stop,
            ended,
            outcome: _,
            events,
        } = ends;
        let result = crate::election::run(
            store,
            config,
            clock,
            requests,
            status,
            events,
            stop.cancelled_owned(),
        )
        .await;
        (result, ended)
    }
}

/// Settings of a coordinator to start; see [`Coordinator::builder`]. Every setter has a
/// default (those of [`CoordinatorConfig::default`] and the system clock).
#[must_use = "a builder does nothing until spawn() or build()"]
pub struct CoordinatorBuilder {
    store: Arc<dyn MetaStore>,
    config: CoordinatorConfig,
    clock: Clock,
    registry: Option<prometheus::Registry>,
}

impl CoordinatorBuilder {
    /// Replaces every setting at once (the setters below change one each).
    pub fn config(mut self, config: CoordinatorConfig) -> Self {
        self.config = config;
        self
    }

    /// Key layout (the root under which everything lives).
    pub fn keys(mut self, keys: Keys) -> Self {
        self.config.keys = keys;
        self
    }

    /// Lease TTL of the leader key: a standby takes over within about this long.
    pub fn session_ttl(mut self, ttl: Duration) -> Self {
        self.config.session_ttl = ttl;
        self
    }

    /// Every planner setting at once (replaces what [`Self::watch_timeout`] and
    /// [`Self::release_timeout`] set: call it first).
    pub fn planner(mut self, planner: PlannerConfig) -> Self {
        self.config.planner = planner;
        self
    }

    /// How long a node may take to load a channel and ack it before it is reassigned.
    pub fn watch_timeout(mut self, timeout: Duration) -> Self {
        self.config.planner.watch_timeout_ms = millis(timeout);
        self
    }

    /// How long a node may take to release a channel before it is fenced (its lease
    /// revoked); must exceed the nodes' session TTL.
    pub fn release_timeout(mut self, timeout: Duration) -> Self {
        self.config.planner.release_timeout_ms = millis(timeout);
        self
    }

    /// Full relist period (jittered): a missed event can never stay unnoticed longer than this.
    pub fn resync_interval(mut self, interval: Duration) -> Self {
        self.config.resync_interval = interval;
        self
    }

    /// Period of the planner tick (timeouts).
    pub fn tick(mut self, tick: Duration) -> Self {
        self.config.tick = tick;
        self
    }

    /// How often the leader compacts the store, to the revision it saw one interval earlier;
    /// zero turns compaction off.
    pub fn compact_interval(mut self, interval: Duration) -> Self {
        self.config.compact_interval = interval;
        self
    }

    /// Identifies this process in the leader key and logs.
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.config.id = id.into();
        self
    }

    /// Admin API address written into the leader key (what `chanwatch ctl` connects to).
    pub fn admin_addr(mut self, addr: impl Into<String>) -> Self {
        self.config.admin_addr = addr.into();
        self
    }

    /// The clock (a test's, e.g. [`Clock::with_unix_base`] under a paused tokio clock).
    pub fn clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// The registry to register the coordinator's metrics in (default: a registry of its
    /// own); either way [`CoordHandle::registry`] returns it.
    pub fn registry(mut self, registry: prometheus::Registry) -> Self {
        self.registry = Some(registry);
        self
    }

    /// The coordinator and its handle, for callers that run it on a task of their own
    /// (a simulation that pauses it, a test that kills it).
    ///
    /// # Errors
    /// [`CoordError::Metrics`] when the registry already holds metrics of the same names.
    pub fn build(self) -> Result<(Coordinator, CoordHandle), CoordError> {
        let registry = self.registry.unwrap_or_default();
        self.config
            .metrics
            .register(&registry)
            .map_err(CoordError::Metrics)?;
        #[cfg(feature = "planted-bugs")]
        if let Some(bug) = self.config.planner.planted_bug {
            tracing::warn!(
                bug = bug.name(),
                "coord: a planted bug is on: a safety rule is switched off to prove a check catches it; never run this outside a test"
            );
            self.config
                .metrics
                .planted_bug
                .with_label_values(&[bug.name()])
                .set(1);
        }
        let reads = crate::handle::Reads {
            store: self.store.clone(),
            keys: self.config.keys.clone(),
            clock: self.clock,
        };
        let (handle, ends) = CoordHandle::pair(self.config.metrics.clone(), registry, reads);
        let coordinator = Coordinator {
            store: self.store,
            config: self.config,
            clock: self.clock,
            ends,
        };
        Ok((coordinator, handle))
    }

    /// Starts the coordinator on a task of the current tokio runtime and returns its handle.
    /// It runs until [`CoordHandle::stop`] or until every handle is dropped; a configuration
    /// error at start-up ends it early (see [`CoordHandle::stopped`]).
    ///
    /// # Errors
    /// [`CoordError::Metrics`] when the registry already holds metrics of the same names;
    /// [`CoordError::NoRuntime`] when called outside a tokio runtime.
    pub fn spawn(self) -> Result<CoordHandle, CoordError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| CoordError::NoRuntime)?;
        let (coordinator, handle) = self.build()?;
        let outcome = coordinator.ends.outcome.clone();
        runtime.spawn(async move {
            let (result, ended) = coordinator.drive().await;
            if let Err(e) = result {
                error!(error = %e, "coord: stopped");
                *outcome
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
            }
            drop(ended);
        });
        Ok(handle)
    }
}
