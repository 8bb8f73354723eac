//! A whole chanwatch cluster in one process: coordinators and nodes as tasks of this process,
//! on one store or each on a store of its own (a `FaultyStore`, say). The binary's `demo`,
//! `standalone` and benches, the coordinator's integration tests and the simulation all start
//! their processes here. A product crate: it holds no test code, and the shipped binary
//! depends on it.
//!
//! Owns: turning [`Timings`] into coordinator and node settings, spawning each process on a
//! task that can be frozen ([`Task::pause`], reached through both `CoordProc` and `NodeProc`), killed (no lease
//! revoke, as a crash) or stopped (channels released, lease revoked), and waiting until a
//! coordinator leads or a node has registered.
//! Must not: decide anything (the coordinator and the nodes do), pick a store, a clock or a
//! handler for its caller, or read a clock or randomness of its own: the simulation drives
//! these processes on paused time and its traces must not depend on this module.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chanwatch_coord::{
    CoordError, CoordHandle, CoordMetrics, CoordStatus, Coordinator, CoordinatorConfig,
};
use chanwatch_core::planner::PlannerConfig;
use chanwatch_core::{Keys, NodeId};
use chanwatch_node::{ChannelHandler, NodeConfig, NodeError, NodeMetrics, NodeStatus, Stop};
use chanwatch_store::{millis, Clock, MetaStore};
use thiserror::Error;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Why the harness could not start a process, or a wait ran out.
#[derive(Debug, Error)]
pub enum InProcError {
    /// The coordinator could not be built (its metrics clash with a registry's).
    #[error("could not start coordinator {id}: {source}; give it a fresh metrics set")]
    Coord {
        /// The coordinator's ID.
        id: String,
        /// What the builder said.
        source: CoordError,
    },
    /// A coordinator did not become leader and recover in time.
    #[error("coordinator {id} did not become ready within {after:?}; is another one leader, or the store away?")]
    NotReady {
        /// The coordinator's ID.
        id: String,
        /// How long we waited.
        after: Duration,
    },
    /// A node did not register in time.
    #[error("a node did not register within {after:?}; is the store reachable?")]
    NotRegistered {
        /// How long we waited.
        after: Duration,
    },
}

/// Timings of an in-process cluster.
#[derive(Debug, Clone)]
pub struct Timings {
    /// Session TTL of every coordinator and node.
    pub session_ttl: Duration,
    /// How long a node may take to acknowledge (also the release timeout).
    pub watch_timeout: Duration,
    /// How often a coordinator re-reads the whole view.
    pub resync_interval: Duration,
    /// A coordinator's timer tick.
    pub tick: Duration,
    /// Least time between two progress writes of one load.
    pub progress_interval: Duration,
}

impl Timings {
    /// Coordinator settings for these timings: the planner's watch and release timeouts are
    /// the watch timeout, a fenced channel waits one TTL, a node whose load failed is passed
    /// over for one watch timeout; every other planner setting is its default (set
    /// `planner.balance_quiet_ms` and `planner.move_cooldown_ms` to suit the TTL).
    #[must_use]
    pub fn coordinator_config(&self, keys: &Keys) -> CoordinatorConfig {
        let watch_timeout_ms = millis(self.watch_timeout);
        CoordinatorConfig {
            keys: keys.clone(),
            planner: PlannerConfig {
                watch_timeout_ms,
                release_timeout_ms: watch_timeout_ms,
                fence_wait_ms: millis(self.session_ttl),
                failed_node_backoff_ms: watch_timeout_ms,
                ..PlannerConfig::default()
            },
            session_ttl: self.session_ttl,
            resync_interval: self.resync_interval,
            tick: self.tick,
            ..CoordinatorConfig::default()
        }
    }

    /// Node settings for these timings (every other setting its default).
    #[must_use]
    pub fn node_config(&self, keys: &Keys) -> NodeConfig {
        NodeConfig {
            keys: keys.clone(),
            session_ttl: self.session_ttl,
            progress_interval: self.progress_interval,
            ..NodeConfig::default()
        }
    }
}

/// Runs `f` except while the gate says paused: a frozen process.
async fn pausable<T>(f: impl Future<Output = T>, mut gate: watch::Receiver<bool>) -> T {
    tokio::pin!(f);
    loop {
        if *gate.borrow_and_update() {
            if gate.changed().await.is_err() {
                return f.await;
            }
            continue;
        }
        tokio::select! {
            biased;
            out = &mut f => return out,
            changed = gate.changed() => if changed.is_err() { return f.await; },
        }
    }
}

/// The task of one process, which can be frozen: what [`CoordProc`] and [`NodeProc`] share
/// (they dereference to it).
#[derive(Debug)]
pub struct Task<T> {
    task: JoinHandle<T>,
    pause: watch::Sender<bool>,
}

impl<T: Send + 'static> Task<T> {
    /// Spawns `body` on a task of its own, not frozen.
    fn spawn(body: impl Future<Output = T> + Send + 'static) -> Self {
        let (pause, gate) = watch::channel(false);
        let task = tokio::spawn(pausable(body, gate));
        Task { task, pause }
    }
}

impl<T> Task<T> {
    /// Freezes (`true`) or thaws (`false`) it: a process stopped by the OS, or a long GC.
    pub fn pause(&self, paused: bool) {
        self.pause.send_replace(paused);
    }

    /// The switch that freezes it (`true`), for a fault's undo to thaw it later.
    #[must_use]
    pub fn pause_switch(&self) -> watch::Sender<bool> {
        self.pause.clone()
    }

    /// Whether it is frozen.
    #[must_use]
    pub fn paused(&self) -> bool {
        *self.pause.borrow()
    }

    /// Whether it has ended (killed, stopped, or failed).
    #[must_use]
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// The processes' common settings: each coordinator and node starts from these.
pub struct Cluster {
    /// The store every process uses unless it is given one of its own.
    pub store: Arc<dyn MetaStore>,
    /// The key layout.
    pub keys: Keys,
    /// The clock of every process.
    pub clock: Clock,
    /// Settings every coordinator starts from ([`Cluster::coord_config`] adds the ID and
    /// fresh metrics).
    pub coord_config: CoordinatorConfig,
    /// Settings every node starts from; its metrics are shared by every node.
    pub node_config: NodeConfig,
    /// The handler of every node unless one is given its own.
    pub handler: Arc<dyn ChannelHandler>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("store", &self.store.describe())
            .field("keys", &self.keys)
            .field("coord_config", &self.coord_config)
            .field("node_config", &self.node_config)
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// A cluster on `store` with `timings` (see [`Timings::coordinator_config`]); no process
    /// runs yet.
    pub fn new(
        store: Arc<dyn MetaStore>,
        keys: Keys,
        clock: Clock,
        timings: &Timings,
        handler: Arc<dyn ChannelHandler>,
    ) -> Self {
        Cluster {
            coord_config: timings.coordinator_config(&keys),
            node_config: timings.node_config(&keys),
            store,
            keys,
            clock,
            handler,
        }
    }

    /// The metrics every node shares (register them once where they are served).
    #[must_use]
    pub fn node_metrics(&self) -> &Arc<NodeMetrics> {
        &self.node_config.metrics
    }

    /// The settings of coordinator `id`: the common ones with this ID and metrics of its
    /// own.
    #[must_use]
    pub fn coord_config(&self, id: &str) -> CoordinatorConfig {
        CoordinatorConfig {
            id: id.to_owned(),
            metrics: Arc::new(CoordMetrics::new()),
            ..self.coord_config.clone()
        }
    }

    /// Starts coordinator `id` on the common store.
    ///
    /// # Errors
    /// [`InProcError::Coord`] when it cannot be built.
    pub fn spawn_coord(&self, id: &str) -> Result<CoordProc, InProcError> {
        self.spawn_coord_with(self.store.clone(), self.coord_config(id))
    }

    /// Starts a coordinator on `store` (its own connection, or a fault-injecting wrapper)
    /// with `config` (from [`Cluster::coord_config`], tweaked).
    ///
    /// # Errors
    /// [`InProcError::Coord`] when it cannot be built (metrics already registered).
    pub fn spawn_coord_with(
        &self,
        store: Arc<dyn MetaStore>,
        config: CoordinatorConfig,
    ) -> Result<CoordProc, InProcError> {
        let id = config.id.clone();
        let metrics = config.metrics.clone();
        // Built, not spawned: the task is ours, so that it can be paused and killed.
        let (coordinator, handle) = Coordinator::builder(store)
            .config(config)
            .clock(self.clock)
            .build()
            .map_err(|source| InProcError::Coord {
                id: id.clone(),
                source,
            })?;
        let name = id.clone();
        let task = Task::spawn(async move {
            let r = coordinator.run().await;
            if let Err(e) = &r {
                tracing::error!(coordinator = %name, error = %e, "in-process coordinator ended");
            }
            r
        });
        Ok(CoordProc {
            status: handle.watch_status(),
            handle,
            metrics,
            id,
            task,
        })
    }

    /// Starts a node on the common store (a client of its own, see [`Cluster::node_store`])
    /// with the common settings and handler; it registers under a fresh ID.
    pub fn spawn_node(&self) -> NodeProc {
        self.spawn_node_with(
            self.node_store(),
            self.handler.clone(),
            self.node_config.clone(),
        )
    }

    /// The store a new node uses: a client of its own where the store makes one cheaply (the
    /// embedded store: its keepalives then send progress to its own watch only, as with a
    /// connection of its own to etcd), else the common store.
    pub fn node_store(&self) -> Arc<dyn MetaStore> {
        self.store
            .new_client()
            .unwrap_or_else(|| self.store.clone())
    }

    /// Starts a node on `store` (its own connection, or a fault-injecting wrapper), with
    /// `handler` and `config` (from [`Cluster::node_config`], tweaked).
    pub fn spawn_node_with(
        &self,
        store: Arc<dyn MetaStore>,
        handler: Arc<dyn ChannelHandler>,
        config: NodeConfig,
    ) -> NodeProc {
        let (status_tx, status) = watch::channel(NodeStatus::default());
        let (stop, stopped) = watch::channel(Stop::Run);
        let clock = self.clock;
        let task = Task::spawn(async move {
            let r =
                chanwatch_node::run_until(store, handler, config, clock, status_tx, stopped).await;
            if let Err(e) = &r {
                tracing::error!(error = %e, "in-process node ended");
            }
            r
        });
        NodeProc {
            status,
            stop: Some(stop),
            task,
        }
    }
}

/// A coordinator running on a task of this process.
#[derive(Debug)]
pub struct CoordProc {
    /// Its status as it changes.
    pub status: watch::Receiver<CoordStatus>,
    /// Its handle (requests, status, stop).
    pub handle: CoordHandle,
    /// Its metrics.
    pub metrics: Arc<CoordMetrics>,
    id: String,
    task: Task<Result<(), CoordError>>,
}

impl std::ops::Deref for CoordProc {
    type Target = Task<Result<(), CoordError>>;
    fn deref(&self) -> &Self::Target {
        &self.task
    }
}

impl CoordProc {
    /// Its ID.
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Dies without cleaning up, as a crash: no lease revoke, tasks dropped.
    pub fn kill(self) {
        self.task.task.abort();
    }

    /// Stops it (a leader revokes its lease so a standby takes over at once) and waits. An
    /// error it ended with was logged when it ended.
    pub async fn stop(self) {
        self.pause(false);
        let _ = self.handle.stop().await;
        let _ = self.task.task.await;
    }

    /// Waits until it ends — by itself (a configuration error at start-up) or after
    /// [`CoordHandle::stop`] — and returns how [`Coordinator::run`] ended.
    ///
    /// # Errors
    /// A [`JoinError`](tokio::task::JoinError) when its task panicked; inside, the
    /// [`CoordError`] `run` returned.
    pub async fn ended(self) -> Result<Result<(), CoordError>, tokio::task::JoinError> {
        self.task.task.await
    }

    /// Waits up to `limit` until it leads and has recovered.
    ///
    /// # Errors
    /// [`InProcError::NotReady`] when it does not.
    pub async fn wait_ready(&self, limit: Duration) -> Result<(), InProcError> {
        let mut status = self.status.clone();
        let ready = matches!(
            tokio::time::timeout(limit, status.wait_for(|s| s.ready)).await,
            Ok(Ok(_))
        );
        if ready {
            Ok(())
        } else {
            Err(InProcError::NotReady {
                id: self.id.clone(),
                after: limit,
            })
        }
    }
}

/// A node running on a task of this process.
#[derive(Debug)]
pub struct NodeProc {
    /// Its status as it changes.
    pub status: watch::Receiver<NodeStatus>,
    stop: Option<watch::Sender<Stop>>,
    task: Task<Result<(), NodeError>>,
}

impl std::ops::Deref for NodeProc {
    type Target = Task<Result<(), NodeError>>;
    fn deref(&self) -> &Self::Target {
        &self.task
    }
}

impl NodeProc {
    /// Its ID once registered.
    #[must_use]
    pub fn id(&self) -> Option<NodeId> {
        self.status.borrow().id
    }

    /// Leaves for a planned restart ([`Stop::Leave`], SIGTERM): the coordinator moves its
    /// channels off while it runs them; it ends by itself once none is left, or after its
    /// shutdown timeout. Returns at once.
    pub fn leave(&self) {
        if let Some(s) = &self.stop {
            s.send_if_modified(|l| {
                let changed = *l < Stop::Leave;
                if changed {
                    *l = Stop::Leave;
                }
                changed
            });
        }
    }

    /// Dies without revoking its lease: its channels move after the TTL.
    pub fn kill(mut self) {
        // Aborted before the stop signal goes (dropped), so it cannot stop gracefully.
        self.task.task.abort();
        self.stop.take();
    }

    /// Dies as [`kill`](Self::kill) does, and waits until its task has ended: what it held
    /// (its session, its channels' runners) is dropped by then, so a benchmark that times
    /// what follows the death does not also time the teardown of the dead, which a node
    /// that died on another machine does not cost this one.
    pub async fn kill_and_wait(mut self) {
        self.task.task.abort();
        self.stop.take();
        let _ = (&mut self.task.task).await;
    }

    /// Stops its channels, revokes its lease and waits. An error that ended it early was
    /// logged when it ended.
    pub async fn stop(mut self) {
        self.pause(false);
        if let Some(s) = self.stop.take() {
            let _ = s.send(Stop::Now);
        }
        let _ = self.task.task.await;
    }

    /// Waits up to `limit` until it has registered, and returns its ID.
    ///
    /// # Errors
    /// [`InProcError::NotRegistered`] when it does not.
    pub async fn wait_id(&self, limit: Duration) -> Result<NodeId, InProcError> {
        let mut status = self.status.clone();
        let id = match tokio::time::timeout(limit, status.wait_for(|s| s.id.is_some())).await {
            Ok(Ok(s)) => s.id,
            _ => None,
        };
        id.ok_or(InProcError::NotRegistered { after: limit })
    }
}
