//! What the coordinator's list-watch covers: everything it follows under the root, and not
//! the data plane's checkpoints, which nodes commit many times a second per channel.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Result};
use chanwatch_core::{ChannelName, Keys};
use chanwatch_store::{
    KeyRange, Layer, Layered, MetaStore, RangeResponse, Revision, StoreResult, Txn, TxnOp,
    WatchStream,
};
use futures_util::StreamExt;

use crate::cluster::Cluster;

/// Passes everything through; counts the keys its watches and lists hand over, split into
/// checkpoints and the rest.
struct CountingReads {
    keys: Keys,
    checkpoints: Arc<AtomicU64>,
    others: Arc<AtomicU64>,
}

impl CountingReads {
    fn count(&self, key: &str) {
        let checkpoint = self.keys.parse_checkpoint(key).is_ok();
        let counter = if checkpoint {
            &self.checkpoints
        } else {
            &self.others
        };
        counter.fetch_add(1, Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl Layer for CountingReads {
    async fn range_keys(
        &self,
        inner: &dyn MetaStore,
        keys: &KeyRange,
    ) -> StoreResult<RangeResponse> {
        let list = inner.range_keys(keys).await?;
        for kv in &list.kvs {
            self.count(&kv.key);
        }
        Ok(list)
    }
    async fn watch_keys(
        &self,
        inner: &dyn MetaStore,
        keys: &KeyRange,
        from: Revision,
    ) -> StoreResult<WatchStream> {
        let stream = inner.watch_keys(keys, from).await?;
        let (k, checkpoints, others) = (
            self.keys.clone(),
            self.checkpoints.clone(),
            self.others.clone(),
        );
        Ok(Box::pin(stream.map(move |batch| {
            if let Ok(b) = &batch {
                for e in &b.events {
                    let counter = if k.parse_checkpoint(&e.kv.key).is_ok() {
                        &checkpoints
                    } else {
                        &others
                    };
                    counter.fetch_add(1, Ordering::SeqCst);
                }
            }
            batch
        })))
    }
    fn describe(&self, inner: &dyn MetaStore) -> String {
        format!("counting {}", inner.describe())
    }
}

pub async fn checkpoint_commits_never_reach_the_coordinators_watch(c: Cluster) -> Result<()> {
    let checkpoints = Arc::new(AtomicU64::new(0));
    let others = Arc::new(AtomicU64::new(0));
    let counting = CountingReads {
        keys: c.keys.clone(),
        checkpoints: checkpoints.clone(),
        others: others.clone(),
    };
    let store = Arc::new(Layered::new(c.store.clone(), counting));
    // Checkpoints already there when it lists, and more while it watches.
    let put = |i: usize| {
        let name = ChannelName::new(format!("cp{i:03}")).expect("name");
        TxnOp::put(
            c.keys.checkpoint(&name),
            br#"{"epoch":1,"position":"1"}"#.to_vec(),
        )
    };
    c.store.txn(Txn::new().and_then((0..20).map(put))).await?;
    let coord = c.spawn_coord_on("scoped", store, |_| {});
    c.wait_leader_ready(&coord).await?;
    for i in 20..120 {
        c.store.txn(Txn::new().and_then([put(i)])).await?;
    }
    // Its own writes come back on its watch: the watch is live, and it sees them.
    let before = others.load(Ordering::SeqCst);
    c.add_channels(&coord, "ch", 3).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while others.load(Ordering::SeqCst) <= before {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the coordinator's watch never handed over its own writes"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ensure!(
        checkpoints.load(Ordering::SeqCst) == 0,
        "the coordinator was handed {} checkpoint keys",
        checkpoints.load(Ordering::SeqCst)
    );
    coord.handle.stop().await?;
    Ok(())
}

/// Embedded only (paused clock): the leader's watch stalls silently (keepalives and txns
/// work, the watch delivers nothing) with the resync 5 minutes away. The leader finds out
/// from its keepalives' revisions, relists, and sees the node's acks long before its watch
/// timeout; without that it would see them only at the resync.
pub async fn a_leader_whose_watch_stalls_relists_by_itself_and_sees_the_acks() -> Result<()> {
    use chanwatch_store::{EmbeddedStore, FaultyStore};
    let inner = EmbeddedStore::new();
    let c = Cluster::with_stores(
        crate::cluster::Backend::Embedded(inner.clone()),
        Arc::new(inner.clone()) as Arc<dyn MetaStore>,
    );
    let (faulty, faults) = FaultyStore::new(inner);
    let coord = c.spawn_coord_on("c1", Arc::new(faulty), |config| {
        config.resync_interval = Duration::from_secs(300);
        config.planner.watch_timeout_ms = 30_000;
    });
    let node = c.spawn_node();
    c.wait_node_id(&node).await?;
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 1).await?;
    faults.stall_watches(true);
    c.add_channels(&coord, "late", 2).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let rows = coord.handle.channels().await?;
        if rows.len() == 2 && rows.iter().all(|r| r.state.as_str() == "Watched") {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the leader never saw the acks behind its stalled watch: {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ensure!(
        coord.metrics.watch_stalls.get() >= 1,
        "the stall was not counted"
    );
    faults.stall_watches(false);
    coord.handle.stop().await?;
    Ok(())
}
