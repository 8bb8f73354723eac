//! Fenced checkpoints end to end on the embedded store (DESIGN §4): a run resumes
//! from the last commit, a moved channel's old run can no longer commit, and removing the
//! channel deletes its checkpoint.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use async_trait::async_trait;
use chanwatch_coord::Coordinator;
use chanwatch_core::{ChannelInfo, ChannelName, Checkpoint, Keys, NodeId, VChannelInfo};
use chanwatch_node::{ChannelContext, ChannelHandler, CommitError, Node};
use chanwatch_store::{
    EmbeddedStore, KeyValue, Layer, Layered, MetaStore, StoreError, StoreResult, Txn, TxnResponse,
};
use serde_json::json;

/// Keeps each run's context so the test can commit through it, and what it resumed from.
#[derive(Default)]
struct Keeper {
    runs: Mutex<BTreeMap<(u64, String), ChannelContext>>,
}

impl Keeper {
    fn run_on(&self, node: NodeId, channel: &str) -> Option<ChannelContext> {
        let runs = self.runs.lock().ok()?;
        runs.get(&(node.0, channel.to_owned())).cloned()
    }
}

#[async_trait]
impl ChannelHandler for Keeper {
    async fn load(&self, ctx: ChannelContext) -> Result<(), String> {
        let key = (ctx.node.0, ctx.info.channel.to_string());
        self.runs
            .lock()
            .map_err(|e| e.to_string())?
            .insert(key, ctx);
        Ok(())
    }
    async fn release(&self, _node: NodeId, _info: &ChannelInfo) {}
    async fn pause(&self, _node: NodeId, _info: &ChannelInfo) {}
    async fn resume(&self, _node: NodeId, _info: &ChannelInfo) {}
}

async fn wait_run(keeper: &Keeper, node: NodeId, channel: &str) -> Result<ChannelContext> {
    for _ in 0..400 {
        if let Some(ctx) = keeper.run_on(node, channel) {
            return Ok(ctx);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    bail!("{channel} never ran on node {node}")
}

async fn checkpoint(store: &dyn MetaStore, channel: &str) -> Result<Option<Checkpoint>> {
    let key = Keys::default().checkpoint(&ChannelName::new(channel)?);
    Ok(match store.get(&key).await? {
        Some(kv) => Some(Checkpoint::decode(&kv.value)?),
        None => None,
    })
}

#[tokio::test(start_paused = true)]
async fn a_moved_channel_resumes_from_its_last_commit_and_the_old_run_is_fenced() -> Result<()> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let keeper = Arc::new(Keeper::default());
    let coordinator = Coordinator::builder(store.clone()).spawn()?;
    let a = Node::builder(store.clone())
        .handler(keeper.clone())
        .session_ttl(Duration::from_secs(3))
        .spawn()?;
    let mut ready = coordinator.watch_status();
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;
    let mut a_status = a.watch_status();
    let a_id = tokio::time::timeout(
        Duration::from_secs(10),
        a_status.wait_for(|s| s.id.is_some()),
    )
    .await??
    .id
    .context("node a has an id")?;
    let c = ChannelName::new("c")?;
    coordinator
        .add_channel(c.clone(), VChannelInfo::default())
        .await?;
    let run_a = wait_run(&keeper, a_id, "c").await?;
    ensure!(
        run_a.resume().await?.is_none(),
        "a first run starts from the beginning"
    );

    run_a.commit("10", Some(json!({"count": 10}))).await?;
    run_a.commit("20", Some(json!({"count": 20}))).await?;
    let cp = checkpoint(&*store, "c").await?.context("committed")?;
    ensure!(
        cp.position == "20" && cp.state == Some(json!({"count": 20})),
        "{cp:?}"
    );

    // Node b joins; the channel moves to it (break-before-make).
    let b = Node::builder(store.clone())
        .handler(keeper.clone())
        .session_ttl(Duration::from_secs(3))
        .spawn()?;
    let mut b_status = b.watch_status();
    let b_id = tokio::time::timeout(
        Duration::from_secs(10),
        b_status.wait_for(|s| s.id.is_some()),
    )
    .await??
    .id
    .context("node b has an id")?;
    for _ in 0..200 {
        if coordinator.nodes().await?.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    coordinator.move_channel(c.clone(), b_id).await?;
    let run_b = wait_run(&keeper, b_id, "c").await?;
    let resume = run_b
        .resume()
        .await?
        .context("the new owner finds a checkpoint")?;
    ensure!(
        resume.position == "20" && resume.state == Some(json!({"count": 20})),
        "the new owner resumes from the last commit: {resume:?}"
    );

    // The old run commits late: refused, and the checkpoint stays.
    match run_a.commit("25", Some(json!({"count": 25}))).await {
        Err(CommitError::Fenced(_)) => {}
        other => bail!("a moved channel's old run must be fenced: {other:?}"),
    }
    ensure!(checkpoint(&*store, "c").await?.map(|c| c.position) == Some("20".into()));
    run_b.commit("30", None).await?;
    ensure!(checkpoint(&*store, "c").await?.map(|c| c.position) == Some("30".into()));
    // Each commit counted by its result, on the node whose run made it.
    let count = |n: &chanwatch_node::NodeHandle, r| n.metrics().commit_count(r);
    ensure!(
        (count(&a, "ok"), count(&a, "fenced"), count(&b, "ok")) == (2, 1, 1),
        "commits by result"
    );

    // Removing the channel removes its checkpoint.
    coordinator.remove_channel(c).await?;
    ensure!(
        checkpoint(&*store, "c").await?.is_none(),
        "deleted with the channel"
    );
    a.stop().await?;
    b.stop().await?;
    coordinator.stop().await?;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_state_over_64_kib_is_refused_before_it_is_sent() -> Result<()> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let keeper = Arc::new(Keeper::default());
    let coordinator = Coordinator::builder(store.clone()).spawn()?;
    let node = Node::builder(store.clone())
        .handler(keeper.clone())
        .spawn()?;
    let mut ready = coordinator.watch_status();
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;
    let mut status = node.watch_status();
    let id = tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.id.is_some()))
        .await??
        .id
        .context("id")?;
    coordinator
        .add_channel(ChannelName::new("big")?, VChannelInfo::default())
        .await?;
    let run = wait_run(&keeper, id, "big").await?;
    let huge = json!({ "blob": "x".repeat(70_000) });
    match run.commit("1", Some(huge)).await {
        Err(CommitError::TooLarge(n)) if n > 64 * 1024 => {}
        other => bail!("expected TooLarge: {other:?}"),
    }
    ensure!(node.metrics().commit_count("too_large") == 1);
    ensure!(node.metrics().commit_count("ok") == 0);
    Ok(())
}

/// The embedded store, except that once armed, the next txn of two or more writes is applied
/// and then answered with `Unavailable` (etcd killed after it applied a txn, before it
/// answered: the client cannot tell whether it landed).
struct LosesOneAnswer {
    armed: std::sync::atomic::AtomicBool,
    /// Gets to fail (`Unavailable`) after the lost answer: etcd going down meanwhile.
    failing_gets: std::sync::atomic::AtomicUsize,
    gets_to_fail: usize,
}

#[async_trait]
impl Layer for LosesOneAnswer {
    async fn get(&self, inner: &dyn MetaStore, key: &str) -> StoreResult<Option<KeyValue>> {
        let fail = self
            .failing_gets
            .fetch_update(
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
                |n| n.checked_sub(1),
            )
            .is_ok();
        if fail {
            return Err(StoreError::Unavailable {
                endpoints: "test".into(),
                message: "down".into(),
            });
        }
        inner.get(key).await
    }
    async fn txn(&self, inner: &dyn MetaStore, txn: Txn) -> StoreResult<TxnResponse> {
        let batch = txn.then.len() >= 2;
        let answer = inner.txn(txn).await;
        if batch && self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            self.failing_gets
                .store(self.gets_to_fail, std::sync::atomic::Ordering::SeqCst);
            return Err(StoreError::Unavailable {
                endpoints: "test".into(),
                message: "applied, answer lost".into(),
            });
        }
        answer
    }
    fn describe(&self, _inner: &dyn MetaStore) -> String {
        "embedded, loses one answer".into()
    }
}

/// Found by the chaos run's data plane: a group commit whose batch txn failed with an
/// unknown outcome is retried write by write; when the batch had landed, each retry's guard
/// saw the run's own write and the run was told `Fenced` — its consumer stopped for good
/// while the node still ran the channel. A refused commit whose key holds exactly what it
/// wrote is its own landed write.
#[tokio::test(start_paused = true)]
async fn a_group_commit_that_landed_but_got_no_answer_does_not_fence_its_runs() -> Result<()> {
    landed_without_answer(0).await
}

/// The same while the store is going down: the refused runs cannot read their checkpoint to
/// tell, so the outcome is unknown (`Unavailable`, reconciled by the next commit), not
/// `Fenced` (which stopped the consumer for good).
#[tokio::test(start_paused = true)]
async fn a_group_commit_that_landed_without_an_answer_is_unknown_while_the_store_is_down(
) -> Result<()> {
    landed_without_answer(2).await
}

async fn landed_without_answer(gets_to_fail: usize) -> Result<()> {
    let layer = LosesOneAnswer {
        armed: false.into(),
        failing_gets: 0.into(),
        gets_to_fail,
    };
    let layered = Arc::new(Layered::new(Arc::new(EmbeddedStore::new()), layer));
    let inner = layered.layer();
    let store: Arc<dyn MetaStore> = layered.clone();
    let keeper = Arc::new(Keeper::default());
    let coordinator = Coordinator::builder(store.clone()).spawn()?;
    let node = Node::builder(store.clone())
        .handler(keeper.clone())
        .spawn()?;
    let mut ready = coordinator.watch_status();
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;
    let mut status = node.watch_status();
    let id = tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.id.is_some()))
        .await??
        .id
        .context("id")?;
    for c in ["x", "y"] {
        coordinator
            .add_channel(ChannelName::new(c)?, VChannelInfo::default())
            .await?;
    }
    let (x, y) = (
        wait_run(&keeper, id, "x").await?,
        wait_run(&keeper, id, "y").await?,
    );
    x.commit("1", None).await?;
    y.commit("1", None).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    inner.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    // Sent together, so that they share one txn.
    let (a, b) = tokio::join!(x.commit("2", None), y.commit("2", None));
    ensure!(
        !inner.armed.load(std::sync::atomic::Ordering::SeqCst),
        "the two commits did not share a txn"
    );
    for (name, r) in [("x", a), ("y", b)] {
        ensure!(
            !matches!(r, Err(CommitError::Fenced(_))),
            "{name}: its own landed write fenced the run: {r:?}"
        );
    }
    x.commit("3", None).await?;
    y.commit("3", None).await?;
    for c in ["x", "y"] {
        ensure!(checkpoint(&*store, c).await?.map(|c| c.position) == Some("3".into()));
    }
    node.stop().await?;
    coordinator.stop().await?;
    Ok(())
}
