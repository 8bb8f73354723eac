//! A whole chanwatch cluster inside a test: one store (embedded or a real etcd process),
//! coordinators and nodes as tasks, one recording handler shared by every node.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use chanwatch_coord::{CoordHandle, CoordStatus, Coordinator, CoordinatorConfig};
use chanwatch_core::planner::{ChannelRow, NodeRow, Planner, PlannerConfig};
use chanwatch_core::{ChannelName, ChannelState, Keys, NodeId, VChannelInfo};
use chanwatch_node::{NodeConfig, NodeStatus, RecordingHandler};
use chanwatch_store::{Clock, EmbeddedStore, EtcdConfig, EtcdStore, MetaStore};
use chanwatch_testkit::EtcdFixture;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

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

pub struct Proc<S> {
    pub status: watch::Receiver<S>,
    /// `None` for a coordinator: dropping its handle stops it.
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl<S> Proc<S> {
    /// Dies without cleaning up: no lease revoke, tasks dropped.
    pub fn kill(mut self) {
        self.stop.take();
        self.task.abort();
    }
    /// Graceful stop.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = self.task.await;
    }
}

pub struct Cluster {
    pub backend: Backend,
    pub store: Arc<dyn MetaStore>,
    pub clock: Clock,
    pub keys: Keys,
    pub handler: RecordingHandler,
}

pub struct Node {
    pub proc: Proc<NodeStatus>,
}

impl Node {
    pub fn id(&self) -> Option<NodeId> {
        self.proc.status.borrow().id
    }
}

pub struct Coord {
    pub proc: Proc<CoordStatus>,
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
        Cluster {
            backend,
            store,
            clock,
            keys: Keys::default(),
            handler: RecordingHandler::new(clock),
        }
    }

    pub fn coord_config(&self) -> CoordinatorConfig {
        CoordinatorConfig {
            keys: self.keys.clone(),
            planner: PlannerConfig {
                watch_timeout_ms: WATCH_TIMEOUT.as_millis() as u64,
                release_timeout_ms: WATCH_TIMEOUT.as_millis() as u64,
                fence_wait_ms: TTL.as_millis() as u64,
                balance_quiet_ms: 0,
                move_cooldown_ms: 0,
                failed_node_backoff_ms: 5_000,
                ..PlannerConfig::default()
            },
            session_ttl: TTL,
            reconcile_interval: Duration::from_secs(2),
            tick: Duration::from_millis(200),
            ..CoordinatorConfig::default()
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
        let mut config = self.coord_config();
        config.id = id.to_owned();
        config.admin_addr = format!("{id}.invalid:1");
        tweak(&mut config);
        let metrics = config.metrics.clone();
        // Built, not spawned: a test kills coordinators by aborting their task.
        let (coordinator, handle) = Coordinator::builder(store)
            .config(config)
            .clock(self.clock)
            .build()
            .expect("a registry of its own takes the metrics");
        let status = handle.watch_status();
        let task = tokio::spawn(async move {
            if let Err(e) = coordinator.run().await {
                panic!("coordinator failed: {e}");
            }
        });
        Coord {
            proc: Proc {
                status,
                stop: None,
                task,
            },
            handle,
            metrics,
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
        let config = NodeConfig {
            keys: self.keys.clone(),
            session_ttl: TTL,
            progress_interval: Duration::from_millis(300),
            planted_bug,
            ..NodeConfig::default()
        };
        let (status_tx, status) = watch::channel(NodeStatus::default());
        let (stop, stopped) = oneshot::channel::<()>();
        let clock = self.clock;
        let handler = Arc::new(self.handler.clone());
        let task = tokio::spawn(async move {
            let r = chanwatch_node::run(store, handler, config, clock, status_tx, async {
                let _ = stopped.await;
            })
            .await;
            if let Err(e) = r {
                panic!("node failed: {e}");
            }
        });
        Node {
            proc: Proc {
                status,
                stop: Some(stop),
                task,
            },
        }
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
        let mut status = node.proc.status.clone();
        let s = tokio::time::timeout(Duration::from_secs(20), status.wait_for(|s| s.id.is_some()))
            .await??;
        Ok(s.id.unwrap_or(NodeId(0)))
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
        let mut status = coord.proc.status.clone();
        tokio::time::timeout(Duration::from_secs(30), status.wait_for(|s| s.ready)).await??;
        Ok(())
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
