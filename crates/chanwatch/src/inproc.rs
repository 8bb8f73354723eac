//! A whole cluster in one process on the embedded store: what `standalone` and `demo` run.
//!
//! Owns: wiring a coordinator and nodes as tasks, and killing or stopping them.
//! Must not: decide anything; the coordinator and nodes do.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use chanwatch_coord::{CoordHandle, Coordinator, CoordinatorConfig};
use chanwatch_core::planner::PlannerConfig;
use chanwatch_core::{Keys, NodeId};
use chanwatch_node::{ChannelHandler, NodeConfig, NodeStatus};
use chanwatch_store::{Clock, EmbeddedStore, MetaStore};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// Timings of an in-process cluster.
#[derive(Debug, Clone)]
pub struct Timings {
    pub session_ttl: Duration,
    pub watch_timeout: Duration,
    pub reconcile_interval: Duration,
    pub tick: Duration,
    pub progress_interval: Duration,
}

pub struct NodeProc {
    pub status: watch::Receiver<NodeStatus>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl NodeProc {
    pub fn id(&self) -> Option<NodeId> {
        self.status.borrow().id
    }
    /// Dies without revoking its lease: its channels move after the TTL.
    pub fn kill(mut self) {
        self.stop.take();
        self.task.abort();
    }
    /// Stops its channels and revokes its lease.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = self.task.await;
    }
}

pub struct InProc {
    pub store: Arc<dyn MetaStore>,
    pub keys: Keys,
    pub clock: Clock,
    pub handle: CoordHandle,
    pub timings: Timings,
    /// The coordinator's metrics.
    pub coord_metrics: Arc<chanwatch_coord::CoordMetrics>,
    /// The metrics every in-process node shares.
    pub node_metrics: Arc<chanwatch_node::NodeMetrics>,
    handler: Arc<dyn ChannelHandler>,
}

impl InProc {
    /// Starts an embedded store and a coordinator (no nodes yet).
    pub fn start(
        timings: Timings,
        handler: Arc<dyn ChannelHandler>,
        admin_addr: String,
    ) -> Result<Self> {
        Self::start_on(
            Arc::new(EmbeddedStore::new()),
            Keys::default(),
            timings,
            handler,
            admin_addr,
        )
    }

    /// Starts a coordinator on `store` under `keys` (no nodes yet).
    pub fn start_on(
        store: Arc<dyn MetaStore>,
        keys: Keys,
        timings: Timings,
        handler: Arc<dyn ChannelHandler>,
        admin_addr: String,
    ) -> Result<Self> {
        let clock = Clock::system();
        let config = CoordinatorConfig {
            keys: keys.clone(),
            planner: PlannerConfig {
                watch_timeout_ms: timings.watch_timeout.as_millis() as u64,
                release_timeout_ms: timings.watch_timeout.as_millis() as u64,
                fence_wait_ms: timings.session_ttl.as_millis() as u64,
                // Scaled to the (short) TTLs of demo and standalone.
                balance_quiet_ms: timings.session_ttl.as_millis() as u64 / 2,
                move_cooldown_ms: timings.session_ttl.as_millis() as u64 * 3,
                failed_node_backoff_ms: timings.watch_timeout.as_millis() as u64,
                ..PlannerConfig::default()
            },
            session_ttl: timings.session_ttl,
            reconcile_interval: timings.reconcile_interval,
            tick: timings.tick,
            admin_addr,
            ..CoordinatorConfig::default()
        };
        let handle = Coordinator::builder(store.clone())
            .config(config)
            .clock(clock)
            .spawn()?;
        Ok(InProc {
            store,
            keys,
            clock,
            coord_metrics: handle.metrics().clone(),
            handle,
            timings,
            node_metrics: Arc::new(chanwatch_node::NodeMetrics::new()),
            handler,
        })
    }

    /// Starts a node; it registers under a fresh ID.
    pub fn spawn_node(&self) -> NodeProc {
        self.spawn_node_on(self.store.clone())
    }

    /// A node with a store of its own (its own etcd connection, as a node process has).
    pub fn spawn_node_on(&self, store: Arc<dyn MetaStore>) -> NodeProc {
        let config = NodeConfig {
            keys: self.keys.clone(),
            session_ttl: self.timings.session_ttl,
            progress_interval: self.timings.progress_interval,
            metrics: self.node_metrics.clone(),
            ..NodeConfig::default()
        };
        let (status_tx, status) = watch::channel(NodeStatus::default());
        let (stop, stopped) = oneshot::channel::<()>();
        let handler = self.handler.clone();
        let clock = self.clock;
        let task = tokio::spawn(async move {
            let shutdown = async {
                let _ = stopped.await;
            };
            if let Err(e) =
                chanwatch_node::run(store, handler, config, clock, status_tx, shutdown).await
            {
                tracing::error!(error = %e, "node stopped");
            }
        });
        NodeProc {
            status,
            stop: Some(stop),
            task,
        }
    }

    /// Waits until the node has an ID.
    pub async fn node_id(&self, node: &NodeProc) -> Result<NodeId> {
        let mut s = node.status.clone();
        let id = match tokio::time::timeout(Duration::from_secs(10), s.wait_for(|s| s.id.is_some()))
            .await
        {
            Ok(Ok(s)) => s.id.unwrap_or(NodeId(0)),
            _ => bail!("a node did not register within 10 s"),
        };
        Ok(id)
    }

    /// Waits until the coordinator is leader and recovered.
    pub async fn ready(&self) -> Result<()> {
        let mut s = self.handle.watch_status();
        let ready = matches!(
            tokio::time::timeout(Duration::from_secs(10), s.wait_for(|s| s.ready)).await,
            Ok(Ok(_))
        );
        if !ready {
            bail!("the coordinator did not become ready within 10 s");
        }
        Ok(())
    }

    /// Stops the coordinator (revoking its lease).
    pub async fn shutdown(self) {
        if let Err(e) = self.handle.stop().await {
            tracing::error!(error = %e, "coordinator stopped");
        }
    }
}
