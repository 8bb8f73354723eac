//! Bulk registration written off the leader's loop: the leader keeps serving while a list's
//! txns are in flight, and a name in flight is refused to every other add.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use chanwatch_core::planner::AdminError;
use chanwatch_core::{ChannelInfo, ChannelName, Epoch, VChannelInfo};
use chanwatch_store::{
    KeyRange, KeyValue, Lease, LeaseId, Limits, MetaStore, RangeResponse, Revision, StoreResult,
    Txn, TxnResponse, WatchStream,
};
use tokio::sync::Notify;

use crate::cluster::Cluster;

/// Holds every txn of more than 20 ops (a bulk list's packed puts) until released, and
/// answers it 500 ms after it commits (the nodes' watches see it and ack meanwhile).
struct HoldsBigTxns {
    inner: Arc<dyn MetaStore>,
    held: AtomicBool,
    release: Notify,
}

#[async_trait::async_trait]
impl MetaStore for HoldsBigTxns {
    async fn get(&self, key: &str) -> StoreResult<Option<KeyValue>> {
        self.inner.get(key).await
    }
    async fn range_keys(&self, keys: &KeyRange) -> StoreResult<RangeResponse> {
        self.inner.range_keys(keys).await
    }
    async fn txn(&self, txn: Txn) -> StoreResult<TxnResponse> {
        let big = txn.then.len() > 20;
        if big && self.held.load(Ordering::SeqCst) {
            self.release.notified().await;
        }
        let answer = self.inner.txn(txn).await;
        if big {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        answer
    }
    async fn watch_keys(&self, keys: &KeyRange, from: Revision) -> StoreResult<WatchStream> {
        self.inner.watch_keys(keys, from).await
    }
    async fn grant(&self, ttl: Duration) -> StoreResult<Lease> {
        self.inner.grant(ttl).await
    }
    async fn keepalive(&self, lease: LeaseId) -> StoreResult<Revision> {
        self.inner.keepalive(lease).await
    }
    async fn revoke(&self, lease: LeaseId) -> StoreResult<()> {
        self.inner.revoke(lease).await
    }
    async fn compact(&self, revision: Revision) -> StoreResult<()> {
        self.inner.compact(revision).await
    }
    fn limits(&self) -> &Limits {
        self.inner.limits()
    }
    fn describe(&self) -> String {
        "holds big txns".into()
    }
}

fn infos(prefix: &str, n: usize) -> Result<Vec<ChannelInfo>> {
    (0..n)
        .map(|i| {
            let name = ChannelName::new(format!("{prefix}{i:03}"))?;
            Ok(ChannelInfo::new(name, Epoch(0), 0, VChannelInfo::default()))
        })
        .collect()
}

/// While a list's txns are held in the store, the leader answers other requests (it used to
/// wait for the whole write), refuses a single add and another list naming a channel of
/// the held list (planned from the same view, it could land under a second node), and
/// queues a list of other names (lists are written one at a time); released (and answered after the nodes acked), the
/// held list is registered, every channel of both lists is `Watched` once, and the leader's
/// view says so at once (booking the late answer over the acks put its channels back to
/// `ToWatch` until the next relist). Every channel registered is in the leader's history.
pub async fn a_list_being_written_leaves_the_leader_serving_and_its_names_refused_elsewhere(
) -> Result<()> {
    let c = Cluster::embedded().await?;
    let store = Arc::new(HoldsBigTxns {
        inner: c.store.clone(),
        held: AtomicBool::new(true),
        release: Notify::new(),
    });
    let coord = c.spawn_coord_on("c1", store.clone(), |_| {});
    let nodes: Vec<_> = (0..2).map(|_| c.spawn_node()).collect();
    for n in &nodes {
        c.wait_node_id(n).await?;
    }
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 2).await?;

    let handle = coord.handle.clone();
    let held = tokio::spawn(async move {
        handle
            .add_channels(infos("held-", 40)?)
            .await
            .map_err(anyhow::Error::from)
    });
    // The list is planned and its txn is in the store, held.
    tokio::time::sleep(Duration::from_millis(200)).await;
    ensure!(
        !held.is_finished(),
        "the held list was answered before its write"
    );

    let nodes_seen = tokio::time::timeout(Duration::from_secs(2), coord.handle.nodes())
        .await
        .context("the leader did not answer while a list was being written")??;
    ensure!(nodes_seen.len() == 2, "{nodes_seen:?}");

    let one = tokio::time::timeout(
        Duration::from_secs(2),
        coord
            .handle
            .add_channel(ChannelName::new("held-007")?, VChannelInfo::default()),
    )
    .await
    .context("a single add waited for the held list")?;
    ensure!(
        one.as_ref()
            .is_err_and(|e| e.to_string().contains("held-007")),
        "a single add of a name in flight: {one:?}"
    );
    let overlap = tokio::time::timeout(
        Duration::from_secs(2),
        coord.handle.add_channels(infos("held-", 3)?),
    )
    .await
    .context("an overlapping list waited for the held list")?;
    match overlap {
        Err(chanwatch_coord::BulkError::Refused(r)) => ensure!(
            r.len() == 3
                && r.iter()
                    .all(|(_, e)| matches!(e, AdminError::AlreadyExists(_))),
            "{r:?}"
        ),
        other => anyhow::bail!("an overlapping list: {other:?}"),
    }
    // A list of other names is planned and queued: lists are written one at a time.
    let handle = coord.handle.clone();
    let other = tokio::spawn(async move {
        handle
            .add_channels(infos("free-", 5)?)
            .await
            .map_err(anyhow::Error::from)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    ensure!(
        !other.is_finished(),
        "a second list was written beside the held one"
    );
    store.held.store(false, Ordering::SeqCst);
    store.release.notify_waiters();
    let added = tokio::time::timeout(Duration::from_secs(5), held)
        .await
        .context("the held list was never answered")???;
    ensure!(added.len() == 40, "{} registered", added.len());
    let other = tokio::time::timeout(Duration::from_secs(5), other)
        .await
        .context("the queued list was never answered")???;
    ensure!(other.len() == 5, "{other:?}");
    // Well within a relist (`resync_interval` 2 s here): the view is the acks', not the
    // answer's.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rows = coord.handle.channels().await?;
    let behind: Vec<_> = rows
        .iter()
        .filter(|r| r.state != chanwatch_core::ChannelState::Watched)
        .map(|r| (r.channel.to_string(), r.state))
        .collect();
    ensure!(
        rows.len() == 45 && behind.is_empty(),
        "the leader's view, {} rows, not Watched: {behind:?}",
        rows.len()
    );
    c.wait_until(Duration::from_secs(20), "45 channels Watched once", |v| {
        v.all_watched_on_live_nodes(45)
    })
    .await?;
    // Registered by lists, the channels are in the leader's history like any add (`ctl
    // events`, `describe`): each with its registration, from no owner to `ToWatch`.
    let first = coord
        .handle
        .events()
        .channel(&ChannelName::new("held-007")?)
        .into_iter()
        .next()
        .context("held-007 has no history")?;
    ensure!(
        first.from.is_none() && first.state == Some(chanwatch_core::ChannelState::ToWatch),
        "held-007's first event: {first:?}"
    );
    let registered = coord
        .handle
        .events()
        .since(0)
        .iter()
        .filter(|e| e.from.is_none() && e.channel.is_some())
        .count();
    ensure!(
        registered == 45,
        "{registered} registrations in the history"
    );
    Ok(())
}
