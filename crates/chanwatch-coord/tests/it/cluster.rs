//! A whole chanwatch cluster inside a test: one store (embedded or a real etcd process),
//! coordinators and nodes as tasks started by the testkit's harness
//! ([`chanwatch_cluster`]), one recording handler shared by every node; and what the
//! tests ask of it (the store's view decoded, waits, requests retried while not ready).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use chanwatch_cluster::{self as inproc, CoordProc, NodeProc, Timings};
use chanwatch_coord::{CoordHandle, CoordinatorConfig};
use chanwatch_core::planner::{ChannelRow, NodeRow, Planner, PlannerConfig};
use chanwatch_core::{ChannelName, ChannelState, Keys, NodeId, VChannelInfo};
use chanwatch_node::{NodeMetrics, RecordingHandler};
use chanwatch_store::{Clock, EmbeddedStore, EtcdConfig, EtcdStore, MetaStore};
use chanwatch_testkit::EtcdFixture;

/// Session TTL of every process in these tests.
pub const TTL: Duration = Duration::from_secs(3);
/// Watch timeout of the coordinators.
pub const WATCH_TIMEOUT: Duration = Duration::from_secs(4);

// One per test; boxing the fixture buys nothing.
#[allow(clippy::large_enum_variant)]
pub enum Backend {
    Embedded(EmbeddedStore),
    Etcd(EtcdFixture),
}

pub struct Cluster {
    pub backend: Backend,
    pub store: Arc<dyn MetaStore>,
    pub clock: Clock,
    pub keys: Keys,
    pub handler: RecordingHandler,
    /// The testkit's harness, which starts every process.
    harness: inproc::Cluster,
}

pub struct Node {
    pub proc: NodeProc,
}

impl Node {
    pub fn id(&self) -> Option<NodeId> {
        self.proc.id()
    }
}

pub struct Coord {
    pub proc: CoordProc,
    pub handle: CoordHandle,
    pub metrics: Arc<chanwatch_coord::CoordMetrics>,
}

impl Cluster {
    pub async fn embedded() -> Result<Self> {
        let store = EmbeddedStore::new();
        Ok(Self::with(
            Backend::Embedded(store.clone()),
            Arc::new(store),
        ))
    }

    pub async fn etcd() -> Result<Self> {
        let fixture = EtcdFixture::start().await?;
        let store = EtcdStore::connect(EtcdConfig {
            endpoints: vec![fixture.endpoint().to_owned()],
            ..EtcdConfig::default()
        })
        .await?;
        Ok(Self::with(Backend::Etcd(fixture), Arc::new(store)))
    }

    /// A cluster whose processes use `store` (e.g. a fault-injecting wrapper of the backend).
    pub fn with_stores(backend: Backend, store: Arc<dyn MetaStore>) -> Self {
        Self::with(backend, store)
    }

    fn with(backend: Backend, store: Arc<dyn MetaStore>) -> Self {
        // RUST_LOG=chanwatch=debug shows what the processes did when a scenario fails.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let clock = Clock::with_unix_base(1_700_000_000_000);
        let keys = Keys::default();
        let handler = RecordingHandler::new(clock);
        let timings = Timings {
            session_ttl: TTL,
            watch_timeout: WATCH_TIMEOUT,
            resync_interval: Duration::from_secs(2),
            tick: Duration::from_millis(200),
            progress_interval: Duration::from_millis(300),
        };
        let mut harness = inproc::Cluster::new(
            store.clone(),
            keys.clone(),
            clock,
            &timings,
            Arc::new(handler.clone()),
        );
        let planner = &mut harness.coord_config.planner;
        planner.balance_quiet_ms = 0;
        planner.move_cooldown_ms = 0;
        planner.failed_node_backoff_ms = 5_000;
        Cluster {
            backend,
            store,
            clock,
            keys,
            handler,
            harness,
        }
    }

    pub fn spawn_coord(&self, id: &str) -> Coord {
        self.spawn_coord_on(id, self.store.clone(), |_| {})
    }

    /// A coordinator on its own `store` (e.g. a fault-injecting wrapper) with `tweak`ed
    /// settings.
    pub fn spawn_coord_on(
        &self,
        id: &str,
        store: Arc<dyn MetaStore>,
        tweak: impl FnOnce(&mut CoordinatorConfig),
    ) -> Coord {
        let mut config = self.harness.coord_config(id);
        config.admin_addr = format!("{id}.invalid:1");
        tweak(&mut config);
        let proc = self
            .harness
            .spawn_coord_with(store, config)
            .expect("a registry of its own takes the metrics");
        Coord {
            handle: proc.handle.clone(),
            metrics: proc.metrics.clone(),
            proc,
        }
    }

    pub fn spawn_node(&self) -> Node {
        self.spawn_node_on(self.store.clone())
    }

    /// A node talking to the store through `store` (a `FaultyStore` of its own, say).
    pub fn spawn_node_on(&self, store: Arc<dyn MetaStore>) -> Node {
        self.spawn_node_with(store, None)
    }

    /// A node on `store` with a planted bug (e.g. `NoFencing`: a node that never pauses by
    /// itself, so that only the coordinator's fence keeps one owner).
    pub fn spawn_node_with(
        &self,
        store: Arc<dyn MetaStore>,
        planted_bug: Option<chanwatch_node::PlantedBug>,
    ) -> Node {
        let mut config = self.harness.node_config.clone();
        config.planted_bug = planted_bug;
        // Metrics of its own, as a node process has.
        config.metrics = Arc::new(NodeMetrics::new());
        let proc = self
            .harness
            .spawn_node_with(store, self.harness.handler.clone(), config);
        Node { proc }
    }

    /// Kills a node the hard way and tells the recorder its channels stopped now.
    pub fn kill_node(&self, node: Node) -> Option<NodeId> {
        let id = node.id();
        node.proc.kill();
        if let Some(id) = id {
            self.handler.mark_dead(id);
        }
        id
    }

    pub async fn wait_node_id(&self, node: &Node) -> Result<NodeId> {
        Ok(node.proc.wait_id(Duration::from_secs(20)).await?)
    }

    /// What the store holds now, decoded.
    pub async fn view(&self) -> Result<View> {
        let list = self.store.range(&self.keys.all_prefix()).await?;
        let mut state = Planner::new(self.keys.clone(), PlannerConfig::default());
        state.reset(
            list.kvs
                .iter()
                .map(|kv| (kv.key.as_str(), kv.value.as_slice(), kv.mod_revision)),
        );
        Ok(View {
            channels: state.channel_rows(),
            nodes: state.node_rows(),
            corrupt: state.corrupt().keys().cloned().collect(),
        })
    }

    /// Polls the store until `pred` holds, or fails after `timeout` with the last view.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&View) -> bool,
    ) -> Result<View> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let view = self.view().await?;
            if pred(&view) {
                return Ok(view);
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "not reached within {timeout:?}: {what}\nlast view: {:#?}",
                    view.channels
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn add_channels(&self, coord: &Coord, prefix: &str, n: usize) -> Result<()> {
        for i in 0..n {
            let name = ChannelName::new(format!("{prefix}{i:03}"))?;
            retry_not_ready(|| {
                coord
                    .handle
                    .add_channel(name.clone(), VChannelInfo::default())
            })
            .await?;
        }
        Ok(())
    }

    /// Waits until the coordinator itself sees `n` nodes (the store may show them earlier).
    pub async fn wait_coord_nodes(&self, coord: &Coord, n: usize) -> Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(nodes) = coord.handle.nodes().await {
                if nodes.len() == n {
                    return Ok(());
                }
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("the coordinator never saw {n} nodes");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn wait_leader_ready(&self, coord: &Coord) -> Result<()> {
        Ok(coord.proc.wait_ready(Duration::from_secs(30)).await?)
    }
}

/// Retries a request while the leader is still recovering.
pub async fn retry_not_ready<T, F, Fut>(f: F) -> Result<T>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, chanwatch_coord::ApiError>>,
{
    let mut last = None;
    for _ in 0..100 {
        match f().await {
            Ok(v) => return Ok(v),
            Err(
                e @ (chanwatch_coord::ApiError::NotLeader { .. }
                | chanwatch_coord::ApiError::Store(_)),
            ) => {
                last = Some(e);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
    bail!("request kept failing: {last:?}")
}

#[derive(Debug)]
pub struct View {
    pub channels: Vec<ChannelRow>,
    pub nodes: Vec<NodeRow>,
    pub corrupt: Vec<String>,
}

impl View {
    pub fn all_watched_on_live_nodes(&self, expected: usize) -> bool {
        let live: Vec<u64> = self.nodes.iter().map(|n| n.id).collect();
        self.channels.len() == expected
            && self.channels.iter().all(|c| {
                c.state == ChannelState::Watched && c.node.is_some_and(|n| live.contains(&n))
            })
    }

    pub fn counts(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.nodes.iter().map(|n| n.channels).collect();
        v.sort_unstable();
        v
    }

    pub fn on(&self, node: NodeId) -> Vec<ChannelName> {
        self.channels
            .iter()
            .filter(|c| c.node == Some(node.0))
            .map(|c| c.channel.clone())
            .collect()
    }
}
