//! Starting and stopping a node from a Rust program: [`Node::builder`] → [`NodeHandle`].
//!
//! Owns: the wiring a program would otherwise repeat — config defaults, the metrics registry,
//! the status channel, the stop signal — and the handle's lifetime (dropping it stops the
//! node). Must not: add behaviour; it drives [`crate::run`] unchanged.

use std::sync::Arc;
use std::time::Duration;

use chanwatch_core::Keys;
use chanwatch_store::{Clock, MetaStore};
use tokio::sync::watch;

use crate::config::{NodeConfig, NodeError, NodeStatus, Stop};
use crate::handler::{ChannelHandler, SimulatedLoad};
use crate::metrics::NodeMetrics;

/// A chanwatch node: registers a session, runs the channels the coordinator assigns to it
/// through a [`ChannelHandler`], pauses them when it cannot reach the store.
///
/// ```
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use chanwatch_node::{Node, SimulatedLoad};
/// use chanwatch_store::EmbeddedStore;
///
/// let store = Arc::new(EmbeddedStore::new());
/// let node = Node::builder(store)
///     .handler(Arc::new(SimulatedLoad::default()))
///     .session_ttl(std::time::Duration::from_secs(5))
///     .spawn()?;
/// // ... a coordinator on the same store assigns channels to it ...
/// println!("node status: {:?}", node.status());
/// node.leave().await?; // a planned restart: the coordinator moves its channels off first
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Node;

impl Node {
    /// Starts describing a node on `store` (an [`EmbeddedStore`](chanwatch_store::EmbeddedStore)
    /// or an [`EtcdStore`](chanwatch_store::EtcdStore)).
    pub fn builder(store: Arc<dyn MetaStore>) -> NodeBuilder {
        NodeBuilder {
            store,
            handler: None,
            config: NodeConfig::default(),
            clock: Clock::system(),
            registry: None,
        }
    }
}

/// Settings of a node before it starts. Every setting has a working default; only the handler
/// is worth choosing (the default simulates loads).
#[must_use]
pub struct NodeBuilder {
    store: Arc<dyn MetaStore>,
    handler: Option<Arc<dyn ChannelHandler>>,
    config: NodeConfig,
    clock: Clock,
    registry: Option<prometheus::Registry>,
}

impl std::fmt::Debug for NodeBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeBuilder")
            .field("store", &self.store.describe())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl NodeBuilder {
    /// What runs each channel (default: [`SimulatedLoad`], which only pretends).
    pub fn handler(mut self, handler: Arc<dyn ChannelHandler>) -> Self {
        self.handler = Some(handler);
        self
    }

    /// The key layout, e.g. `Keys::new("myapp")` (default root `chanwatch`).
    pub fn keys(mut self, keys: Keys) -> Self {
        self.config.keys = keys;
        self
    }

    /// The session lease's TTL (default 10 s, minimum 2 s: [`chanwatch_store::MIN_SESSION_TTL`]).
    pub fn session_ttl(mut self, ttl: Duration) -> Self {
        self.config.session_ttl = ttl;
        self
    }

    /// How long before its lease could expire a node that cannot renew it pauses (default
    /// `max(1 s, ttl / 5)`).
    pub fn fence_margin(mut self, margin: Duration) -> Self {
        self.config.fence_margin = Some(margin);
        self
    }

    /// Least time between two progress writes of one load (default 5 s).
    pub fn progress_interval(mut self, every: Duration) -> Self {
        self.config.progress_interval = every;
        self
    }

    /// The admin address written into the session for operators (`ctl nodes`).
    pub fn admin_addr(mut self, addr: impl Into<String>) -> Self {
        self.config.admin_addr = addr.into();
        self
    }

    /// The node's stable name, written into the session (`ctl nodes`) and carried by its log
    /// lines as the span field `name` (default: none).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.config.name = name.into();
        self
    }

    /// Relative capacity written into the session (0: default).
    pub fn capacity(mut self, capacity: u32) -> Self {
        self.config.capacity = capacity;
        self
    }

    /// The clock (default: the system clock; tests pass a paused tokio clock).
    pub fn clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Registers the node's metrics in `registry` (default: a fresh registry of its own,
    /// see [`NodeHandle::registry`]).
    pub fn registry(mut self, registry: prometheus::Registry) -> Self {
        self.registry = Some(registry);
        self
    }

    /// Several nodes of one process share one set of metrics.
    pub fn metrics(mut self, metrics: Arc<NodeMetrics>) -> Self {
        self.config.metrics = metrics;
        self
    }

    /// Everything else at once (keeps the builder's handler, clock and registry).
    pub fn config(mut self, config: NodeConfig) -> Self {
        self.config = config;
        self
    }

    /// Starts the node on the current tokio runtime.
    ///
    /// # Errors
    /// [`NodeError::Config`] when the TTL is below the minimum or the metrics cannot be
    /// registered (already in the registry). Credentials etcd refuses show up in
    /// [`NodeHandle::stop`]'s result; every other store error is waited out.
    pub fn spawn(self) -> Result<NodeHandle, NodeError> {
        crate::runtime::check(&self.config)?;
        let registry = match self.registry {
            Some(r) => r,
            None => prometheus::Registry::new(),
        };
        self.config
            .metrics
            .register(&registry)
            .map_err(|e| NodeError::Config(format!("node metrics: {e}")))?;
        let handler = self
            .handler
            .unwrap_or_else(|| Arc::new(SimulatedLoad::default()));
        let (status_tx, status) = watch::channel(NodeStatus {
            name: self.config.name.clone(),
            ..NodeStatus::default()
        });
        let (stop, stopped) = watch::channel(Stop::Run);
        let metrics = self.config.metrics.clone();
        // Every log line of the node (its runners' included) carries its name.
        let span = if self.config.name.is_empty() {
            tracing::Span::none()
        } else {
            tracing::info_span!("node", name = %self.config.name)
        };
        let task = tokio::spawn(tracing::Instrument::instrument(
            crate::run_until(
                self.store,
                handler,
                self.config,
                self.clock,
                status_tx,
                stopped,
            ),
            span,
        ));
        Ok(NodeHandle {
            status,
            stop: Some(NodeStopper(Arc::new(stop))),
            task: Some(task),
            registry,
            metrics,
        })
    }
}

/// A running node. Dropping it stops the node (in the background: channels released, lease
/// revoked); [`stop`](Self::stop) does the same and waits.
#[derive(Debug)]
pub struct NodeHandle {
    status: watch::Receiver<NodeStatus>,
    stop: Option<NodeStopper>,
    task: Option<tokio::task::JoinHandle<Result<(), NodeError>>>,
    registry: prometheus::Registry,
    metrics: Arc<NodeMetrics>,
}

impl NodeHandle {
    /// The node's status now (ID, sessions, pause and why).
    #[must_use]
    pub fn status(&self) -> NodeStatus {
        self.status.borrow().clone()
    }

    /// The status as it changes (for `wait_for`, or an admin endpoint).
    #[must_use]
    pub fn watch_status(&self) -> watch::Receiver<NodeStatus> {
        self.status.clone()
    }

    /// The registry holding the node's metrics (serve it with [`crate::admin::router`]).
    #[must_use]
    pub fn registry(&self) -> &prometheus::Registry {
        &self.registry
    }

    /// The node's metrics.
    #[must_use]
    pub fn metrics(&self) -> &Arc<NodeMetrics> {
        &self.metrics
    }

    /// Waits until the node ends by itself — which it does only for a configuration error at
    /// start-up (credentials or a role etcd refuses), or once it has left after
    /// [`request_leave`](Self::request_leave); afterwards [`stop`](Self::stop) returns at
    /// once.
    ///
    /// # Errors
    /// That error ([`NodeError`]).
    pub async fn wait(&mut self) -> Result<(), NodeError> {
        match self.task.as_mut() {
            Some(task) => {
                let r = task
                    .await
                    .unwrap_or_else(|e| Err(NodeError::Task(e.to_string())));
                self.task = None;
                r
            }
            None => Ok(()),
        }
    }

    /// Leaves gracefully, for a planned restart, and waits until the node has ended: the
    /// session says `leaving`, the coordinator moves every channel off break-before-make
    /// while this node still runs it, and the node ends once none is left — or after
    /// [`NodeConfig::shutdown_timeout`], stopping what is left and revoking the session
    /// (those channels fail over). To be able to cut it short, call
    /// [`request_leave`](Self::request_leave), then [`wait`](Self::wait), and
    /// [`request_stop`](Self::request_stop) for the "second SIGTERM".
    ///
    /// # Errors
    /// The error that ended the node early, if one did ([`NodeError`]).
    pub async fn leave(mut self) -> Result<(), NodeError> {
        self.request_leave();
        self.join().await
    }

    /// Asks the node to leave gracefully (see [`leave`](Self::leave)) without waiting.
    pub fn request_leave(&self) {
        if let Some(stop) = &self.stop {
            stop.leave();
        }
    }

    /// Something to ask the node to leave or stop from elsewhere (a signal handler) while
    /// this handle waits in [`wait`](Self::wait).
    #[must_use]
    pub fn stopper(&self) -> Option<NodeStopper> {
        self.stop.clone()
    }

    /// Asks the node to stop at once (see [`stop`](Self::stop)) without waiting; during a
    /// [`request_leave`](Self::request_leave) this is the "second SIGTERM".
    pub fn request_stop(&self) {
        if let Some(stop) = &self.stop {
            stop.stop();
        }
    }

    /// Stops every channel, revokes the session (so its channels move at once) and waits.
    ///
    /// # Errors
    /// The error that ended the node early, if one did ([`NodeError`]).
    pub async fn stop(mut self) -> Result<(), NodeError> {
        self.request_stop();
        self.join().await
    }

    async fn join(&mut self) -> Result<(), NodeError> {
        match self.task.take() {
            Some(task) => task
                .await
                .unwrap_or_else(|e| Err(NodeError::Task(e.to_string()))),
            None => Ok(()),
        }
    }
}

impl Drop for NodeHandle {
    fn drop(&mut self) {
        // The task finishes stopping by itself; it needs the runtime to keep running.
        if let Some(stop) = self.stop.take() {
            stop.stop();
        }
    }
}

/// Asks a running node to leave or stop ([`NodeHandle::stopper`]); clones share the node.
#[derive(Debug, Clone)]
pub struct NodeStopper(Arc<watch::Sender<Stop>>);

impl NodeStopper {
    /// As [`NodeHandle::request_leave`]: a planned restart.
    pub fn leave(&self) {
        self.0.send_if_modified(|s| raise(s, Stop::Leave));
    }

    /// As [`NodeHandle::request_stop`]: stop at once.
    pub fn stop(&self) {
        self.0.send_if_modified(|s| raise(s, Stop::Now));
    }
}

/// Raises the stop level to `to` (levels only rise); whether it changed.
fn raise(level: &mut Stop, to: Stop) -> bool {
    let changed = *level < to;
    if changed {
        *level = to;
    }
    changed
}
