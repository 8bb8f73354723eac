//! A whole cluster in one process on the embedded store: what `standalone`, `demo` and the
//! benches run — one coordinator and nodes from the in-process harness
//! ([`chanwatch_cluster`]).
//!
//! Owns: the binary's choice of settings for that harness (planner timers scaled to the TTL,
//! the system clock, one set of node metrics) and its one coordinator.
//! Must not: wire processes itself (the harness does) or decide anything.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use chanwatch_cluster::{Cluster, CoordProc};
pub use chanwatch_cluster::{NodeProc, Timings};
use chanwatch_coord::CoordHandle;
use chanwatch_core::{Keys, NodeId};
use chanwatch_node::ChannelHandler;
use chanwatch_store::{Clock, EmbeddedStore, MetaStore};

/// How long `ready` and `node_id` wait.
const WAIT: Duration = Duration::from_secs(10);

pub struct InProc {
    pub store: Arc<dyn MetaStore>,
    pub keys: Keys,
    pub clock: Clock,
    pub handle: CoordHandle,
    /// The coordinator's metrics.
    pub coord_metrics: Arc<chanwatch_coord::CoordMetrics>,
    /// The metrics every in-process node shares.
    pub node_metrics: Arc<chanwatch_node::NodeMetrics>,
    cluster: Cluster,
    coord: CoordProc,
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
        let mut cluster = Cluster::new(store.clone(), keys.clone(), clock, &timings, handler);
        // Scaled to the (short) TTLs of demo and standalone.
        let ttl_ms = timings.session_ttl.as_millis() as u64;
        cluster.coord_config.planner.balance_quiet_ms = ttl_ms / 2;
        cluster.coord_config.planner.move_cooldown_ms = ttl_ms * 3;
        cluster.coord_config.admin_addr = admin_addr;
        let id = cluster.coord_config.id.clone();
        let coord = cluster.spawn_coord(&id)?;
        Ok(InProc {
            store,
            keys,
            clock,
            handle: coord.handle.clone(),
            coord_metrics: coord.metrics.clone(),
            node_metrics: cluster.node_metrics().clone(),
            cluster,
            coord,
        })
    }

    /// Starts a node; it registers under a fresh ID.
    pub fn spawn_node(&self) -> NodeProc {
        self.cluster.spawn_node()
    }

    /// A node on the common store whose session says `capacity` and the address of its
    /// admin HTTP (`admin_addr`, which the caller serves; empty: none).
    pub fn spawn_node_at(&self, capacity: u32, admin_addr: String) -> NodeProc {
        let cluster = &self.cluster;
        let mut config = cluster.node_config.clone();
        config.capacity = capacity;
        config.admin_addr = admin_addr;
        cluster.spawn_node_with(cluster.node_store(), cluster.handler.clone(), config)
    }

    /// A node with a store of its own (its own etcd connection, as a node process has).
    pub fn spawn_node_on(&self, store: Arc<dyn MetaStore>) -> NodeProc {
        let cluster = &self.cluster;
        cluster.spawn_node_with(store, cluster.handler.clone(), cluster.node_config.clone())
    }

    /// Waits until the node has an ID.
    pub async fn node_id(&self, node: &NodeProc) -> Result<NodeId> {
        Ok(node.wait_id(WAIT).await?)
    }

    /// Waits until the coordinator is leader and recovered.
    pub async fn ready(&self) -> Result<()> {
        Ok(self.coord.wait_ready(WAIT).await?)
    }

    /// Stops the coordinator (revoking its lease).
    pub async fn shutdown(self) {
        self.coord.stop().await;
    }
}
