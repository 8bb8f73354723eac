//! A plan round's puts acknowledged in one write (DESIGN §2 `round`, §4): the test plays the
//! coordinator on the embedded store, writing a node's assignments in several txns a few
//! milliseconds apart, and reads from the store how many writes acknowledged them.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use async_trait::async_trait;
use chanwatch_core::{
    ChannelInfo, ChannelName, ChannelOwner, ChannelState, Epoch, Keys, NodeId, RoundHint,
    VChannelInfo,
};
use chanwatch_node::{ChannelContext, ChannelHandler, Node};
use chanwatch_store::{EmbeddedStore, MetaStore, Txn, TxnOp};

/// Loads at once, after a progress report if `progress` (as `--load-delay`'s simulated load
/// does): a report is not the load's outcome, and must not end a round's hold.
struct Quick {
    progress: bool,
}

#[async_trait]
impl ChannelHandler for Quick {
    async fn load(&self, ctx: ChannelContext) -> Result<(), String> {
        if self.progress {
            ctx.progress(0);
            tokio::task::yield_now().await;
        }
        Ok(())
    }
    async fn release(&self, _node: NodeId, _info: &ChannelInfo) {}
    async fn pause(&self, _node: NodeId, _info: &ChannelInfo) {}
    async fn resume(&self, _node: NodeId, _info: &ChannelInfo) {}
}

/// Puts `names` on `node` in txns of `per_txn`, 3 ms apart, each value carrying `round`;
/// then waits until all are `Watched` and returns the mod revisions of their acks, and how
/// long after the last put they were all seen `Watched` (polled every 5 ms).
async fn assign(
    store: &dyn MetaStore,
    node: NodeId,
    names: &[&str],
    per_txn: usize,
    round: Option<RoundHint>,
) -> Result<(BTreeSet<i64>, Duration)> {
    let keys = Keys::default();
    let key = |c: &str| -> Result<String> {
        Ok(keys.channel(ChannelOwner::Node(node), &ChannelName::new(c)?))
    };
    for part in names.chunks(per_txn) {
        let mut puts = Vec::new();
        for c in part {
            let mut info =
                ChannelInfo::new(ChannelName::new(c)?, Epoch(1), 0, VChannelInfo::default());
            info.round = round;
            puts.push(TxnOp::put(key(c)?, info.encode()));
        }
        store.txn(Txn::new().and_then(puts)).await?;
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    let last = tokio::time::Instant::now() - Duration::from_millis(3);
    for _ in 0..400 {
        let mut revisions = BTreeSet::new();
        let mut watched = 0;
        for c in names {
            let kv = store.get(&key(c)?).await?.context("assigned")?;
            let info = ChannelInfo::decode(&kv.value)?;
            if info.state == ChannelState::Watched {
                ensure!(info.round.is_none(), "an ack carries no round: {info:?}");
                watched += 1;
                revisions.insert(kv.mod_revision);
            }
        }
        if watched == names.len() {
            return Ok((revisions, last.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    anyhow::bail!("{names:?} never all Watched")
}

#[tokio::test(start_paused = true)]
async fn a_rounds_channels_are_acknowledged_in_one_write_and_a_round_cut_short_still_is(
) -> Result<()> {
    rounds(false).await
}

#[tokio::test(start_paused = true)]
async fn a_rounds_channels_are_acknowledged_in_one_write_when_their_loads_report_progress(
) -> Result<()> {
    rounds(true).await
}

async fn rounds(progress: bool) -> Result<()> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let node = Node::builder(store.clone())
        .handler(Arc::new(Quick { progress }))
        .spawn()?;
    let mut status = node.watch_status();
    let id = tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.id.is_some()))
        .await??
        .id
        .context("registered")?;

    // Six channels of one round in three txns: one ack write.
    let round = |id, puts| Some(RoundHint { id, puts });
    let six = ["a1", "a2", "a3", "a4", "a5", "a6"];
    let (acks, _) = assign(&*store, id, &six, 2, round(1, 6)).await?;
    ensure!(
        acks.len() == 1,
        "one write for the round, got revisions {acks:?}"
    );

    // The same without the hint: each txn's puts are acknowledged as they come.
    let plain = ["b1", "b2", "b3", "b4", "b5", "b6"];
    let (acks, _) = assign(&*store, id, &plain, 2, None).await?;
    ensure!(
        acks.len() > 1,
        "without a round, one write per batch: {acks:?}"
    );

    // A round whose last puts never come (a refused txn): acked all the same, in one write,
    // once nothing of the round happened for the quiet period (20 ms; not the 200 ms cap).
    let cut = ["c1", "c2", "c3", "c4"];
    let (acks, after) = assign(&*store, id, &cut, 2, round(2, 10)).await?;
    ensure!(acks.len() == 1, "one write for what came: {acks:?}");
    ensure!(
        after <= Duration::from_millis(50),
        "acked {after:?} after the last put: the quiet period did not end the wait"
    );

    node.stop().await?;
    Ok(())
}
