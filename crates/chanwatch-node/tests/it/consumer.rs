//! The stream consumer end to end on the embedded store, with the file log and with a real
//! nats-server: messages are consumed while a channel moves and a node stops (and,
//! on NATS, while the server restarts), and every channel's committed state is exactly the
//! messages up to its committed position — none lost, none folded twice.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use bytes::Bytes;
use chanwatch_coord::Coordinator;
use chanwatch_core::{ChannelName, Checkpoint, Keys, NodeId, VChannelInfo};
use chanwatch_node::handler::{ConsumerOptions, StreamConsumer, StreamState};
use chanwatch_node::{Node, NodeHandle};
use chanwatch_store::{EmbeddedStore, MetaStore};
use chanwatch_stream::{FileLog, FileLogOptions, Log, Position};

const CHANNELS: [&str; 4] = ["s-0", "s-1", "s-2", "s-3"];

fn payload(seq: u64) -> Bytes {
    let mut p = seq.to_be_bytes().to_vec();
    p.extend_from_slice(&seq.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    Bytes::from(p)
}

async fn checkpoint(store: &dyn MetaStore, channel: &str) -> Result<Option<Checkpoint>> {
    let key = Keys::default().checkpoint(&ChannelName::new(channel)?);
    Ok(match store.get(&key).await? {
        Some(kv) => Some(Checkpoint::decode(&kv.value)?),
        None => None,
    })
}

/// The fold of the log's messages up to `upto`, re-read.
async fn expected(log: &dyn Log, channel: &str, upto: Position) -> Result<StreamState> {
    let mut state = StreamState::default();
    let mut at = Position::START;
    while at < upto {
        let batch = log.read(channel, at, 1024, Duration::ZERO).await?;
        ensure!(!batch.is_empty(), "{channel} ends before {upto}");
        for m in batch.iter().take_while(|m| m.position <= upto) {
            state.fold(&m.payload);
            at = m.position;
        }
        if batch.last().is_some_and(|m| m.position > upto) {
            break;
        }
    }
    Ok(state)
}

async fn spawn_node(
    store: &Arc<dyn MetaStore>,
    handler: Arc<StreamConsumer>,
) -> Result<(NodeHandle, NodeId)> {
    let node = Node::builder(store.clone())
        .handler(handler)
        .session_ttl(Duration::from_secs(2))
        .spawn()?;
    let mut status = node.watch_status();
    let id = tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.id.is_some()))
        .await??
        .id
        .context("the node has an id")?;
    Ok((node, id))
}

async fn produce(log: &dyn Log, from: u64, to: u64) -> Result<()> {
    for seq in from..to {
        for c in CHANNELS {
            log.append(c, payload(seq)).await?;
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumed_state_is_exactly_once_across_a_move_and_a_stopped_node() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let log: Arc<dyn Log> = Arc::new(FileLog::open(dir.path(), FileLogOptions::default())?);
    scenario(log, None).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumed_state_is_exactly_once_on_nats_across_a_move_a_stopped_node_and_a_server_restart(
) -> Result<()> {
    let nats = chanwatch_testkit::NatsFixture::start().await?;
    let log = chanwatch_stream::open(nats.url(), "consumer_it").await?;
    scenario(log, Some(nats)).await
}

/// Produces 3,000 messages to each of four channels in three phases: before node b joins and
/// one channel moves to it; before node a stops; and after (a nats-server, if given, restarts
/// just before the last phase). Then every channel's committed state must equal the fold of
/// the log up to its committed position, which must be the channel's end.
async fn scenario(
    log: Arc<dyn Log>,
    mut nats: Option<chanwatch_testkit::NatsFixture>,
) -> Result<()> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let options = ConsumerOptions {
        commit_every: 50,
        commit_interval: Duration::from_millis(100),
        ..ConsumerOptions::default()
    };
    let consumer = Arc::new(StreamConsumer::new(log.clone(), options));
    let coordinator = Coordinator::builder(store.clone()).spawn()?;
    let mut ready = coordinator.watch_status();
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;
    let (a, _a_id) = spawn_node(&store, consumer.clone()).await?;
    for c in CHANNELS {
        coordinator
            .add_channel(ChannelName::new(c)?, VChannelInfo::default())
            .await?;
    }
    produce(&*log, 1, 1001).await?;

    // Node b joins; one channel moves to it while messages still flow.
    let (b, b_id) = spawn_node(&store, consumer.clone()).await?;
    for _ in 0..200 {
        if coordinator.nodes().await?.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    coordinator
        .move_channel(ChannelName::new("s-0")?, b_id)
        .await?;
    produce(&*log, 1001, 2001).await?;
    // Node a stops mid-stream: its channels move to b and resume from a's last commits.
    a.stop().await?;
    if let Some(nats) = nats.as_mut() {
        nats.restart().await?;
    }
    produce(&*log, 2001, 3001).await?;

    let started = Instant::now();
    for c in CHANNELS {
        let end = log.end(c).await?;
        loop {
            let cp = checkpoint(&*store, c).await?;
            if let Some(cp) = cp.filter(|cp| cp.position.parse::<Position>().ok() == Some(end)) {
                let state = StreamState::from_json(cp.state.as_ref().context("has state")?)
                    .map_err(anyhow::Error::msg)?;
                let want = expected(&*log, c, end).await?;
                ensure!(state == want, "{c}: committed {state:?}, produced {want:?}");
                ensure!(
                    state.count == 3000 && state.max_seq == 3000,
                    "{c}: {state:?}"
                );
                break;
            }
            if started.elapsed() > Duration::from_secs(30) {
                bail!("{c} never caught up to {end}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    eprintln!(
        "every channel committed its last message {:?} after the last append",
        started.elapsed()
    );
    b.stop().await?;
    coordinator.stop().await?;
    Ok(())
}

/// The store goes away for a while mid-stream: the node pauses its channels, a paused run reads
/// nothing, commits do not land, and the consumer keeps its state and carries on once the
/// store is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_consumer_reads_nothing_and_keeps_its_state_through_a_store_outage() -> Result<()>
{
    let dir = tempfile::tempdir()?;
    let log: Arc<dyn Log> = Arc::new(FileLog::open(dir.path(), FileLogOptions::default())?);
    let embedded = Arc::new(EmbeddedStore::new());
    let store: Arc<dyn MetaStore> = embedded.clone();
    let consumer = Arc::new(StreamConsumer::new(
        log.clone(),
        ConsumerOptions {
            commit_every: 20,
            commit_interval: Duration::from_millis(100),
            ..ConsumerOptions::default()
        },
    ));
    let coordinator = Coordinator::builder(store.clone()).spawn()?;
    let mut ready = coordinator.watch_status();
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;
    let (a, a_id) = spawn_node(&store, consumer.clone()).await?;
    for c in CHANNELS {
        coordinator
            .add_channel(ChannelName::new(c)?, VChannelInfo::default())
            .await?;
    }
    produce(&*log, 1, 501).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    embedded.set_outage(true);
    let mut status = a.watch_status();
    tokio::time::timeout(
        Duration::from_secs(10),
        status.wait_for(|s| s.paused.is_some()),
    )
    .await??;
    // Paused: the runs read nothing more (their state stays in memory). A batch read just
    // before the pause reached the runner may still be folded: look once that has settled.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let s0 = ChannelName::new("s-0")?;
    let before = consumer.folded(a_id, &s0).context("s-0 runs on a")?;
    produce(&*log, 501, 1001).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = consumer
        .folded(a_id, &s0)
        .context("s-0 still loaded on a")?;
    ensure!(
        before == during,
        "a paused run read on: {before:?} -> {during:?}"
    );
    embedded.set_outage(false);
    produce(&*log, 1001, 1501).await?;
    let started = Instant::now();
    for c in CHANNELS {
        let end = log.end(c).await?;
        loop {
            let cp = checkpoint(&*store, c).await.ok().flatten();
            if let Some(cp) = cp.filter(|cp| cp.position.parse::<Position>().ok() == Some(end)) {
                let state = StreamState::from_json(cp.state.as_ref().context("has state")?)
                    .map_err(anyhow::Error::msg)?;
                ensure!(state == expected(&*log, c, end).await?, "{c}: {state:?}");
                ensure!(state.count == 1500, "{c}: {state:?}");
                break;
            }
            if started.elapsed() > Duration::from_secs(30) {
                bail!("{c} never caught up to {end} after the outage");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    a.stop().await?;
    coordinator.stop().await?;
    Ok(())
}
