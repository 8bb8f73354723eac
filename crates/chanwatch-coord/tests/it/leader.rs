//! Leader honesty, a fair leader loop and a coordinator that never exits on store trouble.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use chanwatch_coord::CoordStatus;
use chanwatch_core::{ChannelName, CoordSession, VChannelInfo};
use chanwatch_store::{
    EmbeddedStore, EventKind, FaultyStore, KeyRange, KeyValue, Layer, Layered, Lease, LeaseId,
    MetaStore, RangeResponse, Revision, StoreError, StoreResult, Txn, TxnOp, TxnResponse,
    WatchStream,
};
use futures_util::StreamExt;

use crate::cluster::{Backend, Cluster, Coord, TTL};

/// Whether the rendered metrics have this exact sample line.
fn has_line(text: &str, line: &str) -> bool {
    text.lines().any(|l| l == line)
}

/// Renders one coordinator's metrics.
fn render(coord: &Coord) -> String {
    let registry = prometheus::Registry::new();
    coord.metrics.register(&registry).expect("fresh registry");
    chanwatch_coord::metrics::render(&registry)
}

/// Who the leader key names now, if it decodes.
async fn key_holder(c: &Cluster) -> Result<Option<String>> {
    Ok(c.store
        .get(&c.keys.leader())
        .await?
        .and_then(|kv| CoordSession::decode(&kv.value).ok())
        .map(|s| s.id))
}

/// Checks, every 50 ms for `span`, that at most one coordinator says it leads (status,
/// `/readyz` and `chanwatch_leader`) and that one not leading exports no cluster gauges.
async fn never_two_leaders(coords: &[(&str, &Coord)], span: Duration) -> Result<()> {
    let deadline = tokio::time::Instant::now() + span;
    while tokio::time::Instant::now() < deadline {
        let mut leading = Vec::new();
        for (name, coord) in coords {
            let s: CoordStatus = coord.proc.status.borrow().clone();
            let text = render(coord);
            let gauge = has_line(&text, "chanwatch_leader 1");
            if s.ready || s.leader || gauge {
                leading.push(format!("{name} {s:?} gauge {gauge}"));
            } else {
                ensure!(
                    !text.contains("chanwatch_nodes_alive"),
                    "{name} does not lead but exports cluster gauges:\n{text}"
                );
            }
        }
        ensure!(leading.len() <= 1, "two leaders at once: {leading:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

pub async fn a_leader_whose_key_is_deleted_steps_down_at_once_and_one_leader_remains(
    c: Cluster,
) -> Result<()> {
    let a = c.spawn_coord("a");
    c.wait_leader_ready(&a).await?;
    let b = c.spawn_coord("b");
    let n = c.spawn_node();
    c.wait_node_id(&n).await?;
    c.wait_coord_nodes(&a, 1).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    ensure!(
        has_line(&render(&a), "chanwatch_nodes_alive 1"),
        "{}",
        render(&a)
    );
    ensure!(
        !render(&b).contains("chanwatch_nodes_alive"),
        "{}",
        render(&b)
    );
    // An operator deletes the key; the standby campaigns and wins.
    let resp = c
        .store
        .txn(Txn::new().and_then([TxnOp::delete(c.keys.leader())]))
        .await?;
    ensure!(resp.succeeded);
    let mut status = a.proc.status.clone();
    tokio::time::timeout(
        Duration::from_secs(1),
        status.wait_for(|s| s.terms > 1 || !s.ready),
    )
    .await
    .context("the deposed leader still says ready 1 s after its key was deleted")??;
    never_two_leaders(&[("a", &a), ("b", &b)], Duration::from_secs(5)).await?;
    // Exactly one leads now, and it is the one the key names.
    let holder = key_holder(&c)
        .await?
        .context("nobody holds the leader key")?;
    let (leader, other) = if holder == "a" { (&a, &b) } else { (&b, &a) };
    ensure!(
        leader.proc.status.borrow().ready,
        "the key's holder {holder} is not ready"
    );
    ensure!(has_line(&render(leader), "chanwatch_leader 1"));
    ensure!(!other.proc.status.borrow().ready);
    ensure!(has_line(&render(other), "chanwatch_leader 0"));
    Ok(())
}

pub async fn a_leader_key_with_no_lease_is_deleted_and_never_blocks_an_election(
    c: Cluster,
) -> Result<()> {
    // As `etcdctl put chanwatch/coord/leader junk` leaves it: no lease, a value that does
    // not decode.
    let key = c.keys.leader();
    c.store
        .txn(Txn::new().and_then([TxnOp::put(&key, b"junk".to_vec())]))
        .await?;
    let a = c.spawn_coord("a");
    let mut status = a.proc.status.clone();
    tokio::time::timeout(Duration::from_secs(3), status.wait_for(|s| s.ready))
        .await
        .context("a junk leader key with no lease blocked the election")??;
    ensure!(key_holder(&c).await?.as_deref() == Some("a"));
    // The same junk written over a live leader's key: it steps down, clears it, leads again.
    c.store
        .txn(Txn::new().and_then([TxnOp::put(&key, b"junk".to_vec())]))
        .await?;
    tokio::time::timeout(
        Duration::from_secs(3),
        status.wait_for(|s| s.terms == 2 && s.ready),
    )
    .await
    .context("a leader whose key was overwritten with junk never led again")??;
    let kv = c.store.get(&key).await?.context("no leader key")?;
    ensure!(kv.lease.is_some(), "the leader key has no lease: {kv:?}");
    ensure!(key_holder(&c).await?.as_deref() == Some("a"));
    Ok(())
}

/// A store whose first `fail` grants fail with `error()`, and which, once `expired` is set,
/// fails every call but keepalives as etcd does after its auth token died (renewals need
/// none). Everything else passes through.
pub(crate) struct FailingGrants {
    fail: AtomicU32,
    error: fn() -> StoreError,
    expired: AtomicBool,
}

impl FailingGrants {
    pub(crate) fn new(
        inner: Arc<dyn MetaStore>,
        fail: u32,
        error: fn() -> StoreError,
    ) -> Layered<Self> {
        let layer = FailingGrants {
            fail: AtomicU32::new(fail),
            error,
            expired: AtomicBool::new(false),
        };
        Layered::new(inner, layer)
    }

    fn token(&self) -> StoreResult<()> {
        if self.expired.load(Ordering::SeqCst) {
            return Err(StoreError::Unauthenticated("invalid auth token".into()));
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Layer for FailingGrants {
    async fn get(&self, inner: &dyn MetaStore, key: &str) -> StoreResult<Option<KeyValue>> {
        self.token()?;
        inner.get(key).await
    }
    async fn range_keys(
        &self,
        inner: &dyn MetaStore,
        keys: &KeyRange,
    ) -> StoreResult<RangeResponse> {
        self.token()?;
        inner.range_keys(keys).await
    }
    async fn txn(&self, inner: &dyn MetaStore, txn: Txn) -> StoreResult<TxnResponse> {
        self.token()?;
        inner.txn(txn).await
    }
    async fn watch_keys(
        &self,
        inner: &dyn MetaStore,
        keys: &KeyRange,
        from: Revision,
    ) -> StoreResult<WatchStream> {
        self.token()?;
        inner.watch_keys(keys, from).await
    }
    async fn grant(&self, inner: &dyn MetaStore, ttl: Duration) -> StoreResult<Lease> {
        self.token()?;
        let left = self.fail.load(Ordering::SeqCst);
        if left > 0 {
            self.fail.store(left - 1, Ordering::SeqCst);
            return Err((self.error)());
        }
        inner.grant(ttl).await
    }
    async fn revoke(&self, inner: &dyn MetaStore, lease: LeaseId) -> StoreResult<()> {
        self.token()?;
        inner.revoke(lease).await
    }
    fn describe(&self, _inner: &dyn MetaStore) -> String {
        "failing grants".into()
    }
}

pub async fn a_coordinator_waits_out_nospace_and_auth_errors_and_then_leads() -> Result<()> {
    let c = Cluster::embedded().await?;
    // What etcd's NOSPACE alarm and an expired auth token look like to the store layer today.
    let errors: [fn() -> StoreError; 2] = [
        || StoreError::RequestTooLarge { bytes: 0, max: 0 },
        || StoreError::Unauthenticated("invalid auth token".into()),
    ];
    for error in errors {
        let store = Arc::new(FailingGrants::new(c.store.clone(), 5, error));
        let coord = c.spawn_coord_on("raw", store, |_| {});
        let mut status = coord.proc.status.clone();
        tokio::time::timeout(Duration::from_secs(30), status.wait_for(|s| s.ready))
            .await
            .with_context(|| format!("never led after grants failed with {}", error()))?
            .map_err(|_| anyhow::anyhow!("the coordinator exited on a grant error: {}", error()))?;
        ensure!(!coord.proc.is_finished(), "the coordinator exited");
        coord.handle.stop().await?;
        coord.proc.ended().await??;
    }
    Ok(())
}

pub async fn a_configuration_error_at_start_up_stops_the_coordinator() -> Result<()> {
    let c = Cluster::embedded().await?;
    let store = Arc::new(FailingGrants::new(c.store.clone(), 1, || {
        StoreError::Config("unreadable TLS file".into())
    }));
    let coord = c.spawn_coord_on("raw", store, |_| {});
    match tokio::time::timeout(Duration::from_secs(10), coord.proc.ended()).await?? {
        Err(chanwatch_coord::CoordError::Store(StoreError::Config(_))) => Ok(()),
        other => bail!("expected a configuration error, got {other:?}"),
    }
}

pub async fn a_leader_that_cannot_list_resigns_so_a_standby_leads() -> Result<()> {
    let inner = EmbeddedStore::new();
    let c = Cluster::with_stores(Backend::Embedded(inner.clone()), Arc::new(inner.clone()));
    let sick = Arc::new(FailingGrants::new(c.store.clone(), 0, || {
        StoreError::Backend("unused".into())
    }));
    let a = c.spawn_coord_on("a", sick.clone(), |_| {});
    c.wait_leader_ready(&a).await?;
    let b = c.spawn_coord("b");
    let n = c.spawn_node();
    c.wait_node_id(&n).await?;
    // etcd restarts with auth on: every token dies and every watch breaks. The leader's
    // renewals still pass; nothing else does.
    sick.layer().expired.store(true, Ordering::SeqCst);
    inner.break_watches();
    // It resigns after a TTL of blindness; its key goes with its lease one TTL later at most.
    let mut status = b.proc.status.clone();
    tokio::time::timeout(
        TTL * 2 + Duration::from_secs(2),
        status.wait_for(|s| s.ready),
    )
    .await
    .context("the blind leader kept its key: no standby could lead")??;
    ensure!(
        !a.proc.status.borrow().ready,
        "the blind leader still says ready"
    );
    ensure!(key_holder(&c).await?.as_deref() == Some("b"));
    Ok(())
}

/// Every store event from `from` up to the store's revision now, in order.
async fn history(
    store: &dyn MetaStore,
    prefix: &str,
    from: Revision,
) -> Result<Vec<(EventKind, KeyValue)>> {
    let until = store.range(prefix).await?.revision;
    let mut stream = store.watch(prefix, from).await?;
    let mut out: Vec<(EventKind, KeyValue)> = Vec::new();
    let mut seen = from - 1;
    while seen < until {
        let batch = tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .context("history replay stalled")?
            .context("history replay ended")??;
        seen = batch.events.last().map_or(seen, |e| e.kv.mod_revision);
        out.extend(batch.events.into_iter().map(|e| (e.kind, e.kv)));
    }
    Ok(out)
}

/// An embedded cluster whose every call takes up to 2 ms, so that simulated time passes
/// while a flood of requests is served.
pub fn embedded_with_latency() -> Cluster {
    let inner = EmbeddedStore::new();
    let (faulty, faults) = FaultyStore::new(inner.clone());
    faults.latency(Duration::from_millis(2), 7);
    Cluster::with_stores(Backend::Embedded(inner), Arc::new(faulty))
}

pub async fn a_request_flood_beside_a_node_kill_fails_over_within_ttl_plus_1s_and_assigns_nothing_to_the_dead_node(
    c: Cluster,
) -> Result<()> {
    let coord = c.spawn_coord("c1");
    let nodes: Vec<_> = (0..3).map(|_| c.spawn_node()).collect();
    for n in &nodes {
        c.wait_node_id(n).await?;
    }
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 3).await?;
    c.add_channels(&coord, "base", 30).await?;
    c.wait_until(Duration::from_secs(20), "30 channels Watched", |v| {
        v.all_watched_on_live_nodes(30)
    })
    .await?;
    // A flood: more clients than the request queue holds, each registering channels.
    let stop = Arc::new(AtomicBool::new(false));
    let mut flood = Vec::new();
    for client in 0..300 {
        let handle = coord.handle.clone();
        let stop = stop.clone();
        flood.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                if let Ok(name) = ChannelName::new(format!("f{client:03}-{i:05}")) {
                    let _ = handle.add_channel(name, VChannelInfo::default()).await;
                }
                i += 1;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before_kill = c.store.range(&c.keys.leader()).await?.revision;
    let mut nodes = nodes.into_iter();
    let victim = nodes.next().context("no node")?;
    let dead = c.kill_node(victim).context("victim had no id")?;
    // The session expires at most TTL after the kill; failover must start within 1 s of it.
    tokio::time::sleep(TTL + Duration::from_secs(1)).await;
    let view = c.view().await?;
    let on_dead = view.on(dead).len();
    let failovers = coord.metrics.failover_seconds.get_sample_count();
    let gone = !view.nodes.iter().any(|n| n.id == dead.0);
    stop.store(true, Ordering::SeqCst);
    for f in flood {
        f.await?;
    }
    // The figures behind README.md's "a burst of admin requests cannot blind the leader"
    // (`--nocapture` shows them).
    eprintln!(
        "flood: {} channels registered during the flood; at kill + TTL + 1 s: {on_dead} on the dead node, failovers measured {failovers} (sum {:.3} s)",
        view.channels.len().saturating_sub(30),
        coord.metrics.failover_seconds.get_sample_sum()
    );
    ensure!(gone, "the dead node's session is still there");
    ensure!(
        on_dead == 0,
        "{on_dead} channels still on dead node {dead} TTL + 1 s after its kill, under a request flood"
    );
    // Nothing was assigned to the dead node once its session was gone.
    let events = history(&*c.store, &c.keys.all_prefix(), before_kill + 1).await?;
    let session = c.keys.session(dead);
    let died = events
        .iter()
        .find(|(k, kv)| *k == EventKind::Delete && kv.key == session)
        .map(|(_, kv)| kv.mod_revision)
        .context("no delete of the dead node's session")?;
    let owner_prefix = c
        .keys
        .owner_prefix(chanwatch_core::ChannelOwner::Node(dead));
    let late: Vec<&str> = events
        .iter()
        .filter(|(k, kv)| {
            *k == EventKind::Put && kv.mod_revision > died && kv.key.starts_with(&owner_prefix)
        })
        .map(|(_, kv)| kv.key.as_str())
        .collect();
    ensure!(
        late.is_empty(),
        "{} channels assigned to dead node {dead} after its session was deleted: {:?}",
        late.len(),
        &late[..late.len().min(5)]
    );
    let total = c.view().await?.channels.len();
    c.wait_until(
        Duration::from_secs(30),
        "every channel Watched on a live node",
        |v| v.all_watched_on_live_nodes(total),
    )
    .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while coord.metrics.failover_seconds.get_sample_count() == 0 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the failover was never measured (seen at TTL + 1 s: {failovers})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ensure!(
        c.handler.overlaps().is_empty(),
        "{:?}",
        c.handler.overlaps()
    );
    drop(nodes);
    Ok(())
}

pub async fn a_failover_found_by_a_relist_is_logged_and_measured() -> Result<()> {
    let inner = EmbeddedStore::new();
    let c = Cluster::with_stores(Backend::Embedded(inner.clone()), Arc::new(inner.clone()));
    // Only the coordinator's connection is cut; its lease outlives the cut.
    let (faulty, faults) = FaultyStore::new(inner.clone());
    let coord = c.spawn_coord_on("c1", Arc::new(faulty), |cfg| {
        cfg.session_ttl = Duration::from_secs(30);
    });
    let a = c.spawn_node();
    let b = c.spawn_node();
    c.wait_node_id(&a).await?;
    c.wait_node_id(&b).await?;
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 2).await?;
    c.add_channels(&coord, "ch", 10).await?;
    c.wait_until(Duration::from_secs(20), "10 channels Watched", |v| {
        v.all_watched_on_live_nodes(10)
    })
    .await?;
    ensure!(coord.metrics.failover_seconds.get_sample_count() == 0);
    // The coordinator is cut off while a node dies: it never sees the delete event.
    faults.partition(true);
    let dead = c.kill_node(a).context("no id")?;
    tokio::time::sleep(TTL + Duration::from_secs(1)).await;
    ensure!(
        c.store.get(&c.keys.session(dead)).await?.is_none(),
        "the session did not expire"
    );
    faults.partition(false);
    c.wait_until(
        Duration::from_secs(20),
        "10 channels Watched on the live node",
        |v| v.all_watched_on_live_nodes(10) && v.nodes.len() == 1,
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    ensure!(
        coord.metrics.failover_seconds.get_sample_count() == 1,
        "a failover found by a relist was not measured (chanwatch_failover_duration_seconds count {})",
        coord.metrics.failover_seconds.get_sample_count()
    );
    drop(b);
    Ok(())
}
