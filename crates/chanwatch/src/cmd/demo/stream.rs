//! The demo's data plane: an embedded [`FileLog`] in a temp dir, every node running the
//! [`StreamConsumer`] recorded into an [`OwnershipLog`] (see [`Both`]), and a producer task
//! appending sequence-numbered messages in `produce`'s payload format while a node is killed.
//!
//! Owns: the handler pair, the demo's producer, and reading the committed checkpoints back.
//! Must not: decide anything (the coordinator and nodes do), or write checkpoints (only the
//! consumer's fenced commits do).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use async_trait::async_trait;
use chanwatch_core::{ChannelInfo, Checkpoint, Keys, NodeId};
use chanwatch_node::handler::{ConsumerOptions, StreamConsumer, StreamState};
use chanwatch_node::{ChannelContext, ChannelHandler, OwnershipLog};
use chanwatch_store::MetaStore;
use chanwatch_stream::{FileLog, FileLogOptions, Log, Position};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The stream consumer on every channel, each run recorded in an [`OwnershipLog`] (the
/// single-ownership audit): a load first takes `load_time`, reporting progress every tenth
/// (so the tour shows loading channels), then starts the consumer.
pub(super) struct Both {
    pub ownership: OwnershipLog,
    pub load_time: Duration,
    pub consumer: Arc<StreamConsumer>,
}

#[async_trait]
impl ChannelHandler for Both {
    async fn load(&self, ctx: ChannelContext) -> Result<(), String> {
        // Closed if the load fails or is dropped (a killed node's).
        let run = self.ownership.open_guarded(ctx.node, &ctx.info);
        for step in 0..10u8 {
            ctx.progress(step * 10);
            ctx.clock().sleep(self.load_time / 10).await;
        }
        self.consumer.load(ctx).await?;
        run.keep();
        Ok(())
    }

    async fn release(&self, node: NodeId, info: &ChannelInfo) {
        self.consumer.release(node, info).await;
        self.ownership.close_open(node, info);
    }

    async fn pause(&self, node: NodeId, info: &ChannelInfo) {
        self.consumer.pause(node, info).await;
        self.ownership.close_open(node, info);
    }

    async fn resume(&self, node: NodeId, info: &ChannelInfo) {
        self.ownership.open(node, info);
        self.consumer.resume(node, info).await;
    }
}

/// A file log in a fresh temp dir, removed on drop.
pub(super) struct TempLog {
    pub log: Arc<FileLog>,
    dir: PathBuf,
}

impl TempLog {
    pub fn open() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "chanwatch-demo-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        let log = FileLog::open(&dir, FileLogOptions::default())
            .with_context(|| format!("opening the demo's log in {}", dir.display()))?;
        Ok(TempLog {
            log: Arc::new(log),
            dir,
        })
    }
}

impl Drop for TempLog {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// When the demo's consumers commit: often, so that the tour stays short.
pub(super) fn consumer_options() -> ConsumerOptions {
    ConsumerOptions {
        commit_every: 20,
        commit_interval: Duration::from_millis(200),
        batch: 256,
    }
}

/// A producer appending round-robin to `channels` at `rate` messages/s until stopped; it
/// returns the fold of what it appended per channel, as `produce --out` records it.
pub(super) struct Producer {
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<Vec<StreamState>>>,
}

impl Producer {
    pub fn start(log: Arc<FileLog>, channels: Vec<String>, rate: f64) -> Self {
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut states = vec![StreamState::default(); channels.len()];
            let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
            let every = Duration::from_secs_f64(1.0 / rate);
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut i = 0;
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stopped.wait_for(|s| *s) => break,
                }
                let seq = states[i].count + 1;
                let p = crate::cmd::produce::payload(seq, 24, &mut rng);
                log.append(&channels[i], p.clone())
                    .await
                    .with_context(|| format!("appending to {}", channels[i]))?;
                states[i].fold(&p);
                i = (i + 1) % channels.len();
            }
            Ok(states)
        });
        Producer { stop, task }
    }

    /// Stops producing and returns what was produced per channel.
    pub async fn stop(self) -> Result<Vec<StreamState>> {
        let _ = self.stop.send(true);
        self.task.await.context("the producer task died")?
    }
}

/// The committed checkpoint of `channel` as (position, state), or the start when none.
pub(super) async fn committed(
    store: &dyn MetaStore,
    keys: &Keys,
    channel: &str,
) -> Result<(Position, StreamState)> {
    let name = chanwatch_core::ChannelName::new(channel)?;
    let Some(kv) = store.get(&keys.checkpoint(&name)).await? else {
        return Ok((Position::START, StreamState::default()));
    };
    let cp = Checkpoint::decode(&kv.value)?;
    let at: Position = cp
        .position
        .parse()
        .map_err(|e| anyhow::anyhow!("checkpoint of {channel}: {e}"))?;
    let state = match &cp.state {
        Some(v) => StreamState::from_json(v).map_err(anyhow::Error::msg)?,
        None => StreamState::default(),
    };
    Ok((at, state))
}

/// Waits up to `limit` until every channel's committed position is the log's end; returns
/// each channel's committed state then.
pub(super) async fn wait_caught_up(
    store: &dyn MetaStore,
    keys: &Keys,
    log: &dyn Log,
    channels: &[String],
    limit: Duration,
) -> Result<BTreeMap<String, StreamState>> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let mut out = BTreeMap::new();
        let mut behind = Vec::new();
        for c in channels {
            let end = log.end(c).await?;
            let (at, state) = committed(store, keys, c).await?;
            if at != end {
                behind.push(format!("{c} at {at} of {end}"));
            }
            out.insert(c.clone(), state);
        }
        if behind.is_empty() {
            return Ok(out);
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "committed checkpoints did not reach the log's end within {limit:?}: {}",
            behind.join(", ")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use chanwatch_core::Epoch;
    use chanwatch_store::{EmbeddedStore, Txn, TxnOp};

    use super::*;

    /// The re-read fold of a channel of the log.
    async fn reread(log: &dyn Log, channel: &str) -> StreamState {
        let mut s = StreamState::default();
        for m in log
            .read(channel, Position::START, 100_000, Duration::ZERO)
            .await
            .expect("reads")
        {
            s.fold(&m.payload);
        }
        s
    }

    async fn checkpoint(store: &dyn MetaStore, keys: &Keys, channel: &str, at: Position) {
        let state = StreamState {
            count: 3,
            max_seq: 3,
            digest: 42,
        };
        let cp = Checkpoint {
            epoch: Epoch(1),
            position: at.to_string(),
            state: Some(state.to_json()),
            updated_at_ms: 0,
            extra: serde_json::Map::new(),
        };
        let key = keys.checkpoint(&chanwatch_core::ChannelName::new(channel).expect("a name"));
        store
            .txn(Txn::new().and_then([TxnOp::put(key, cp.encode())]))
            .await
            .expect("writes");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_demo_producer_records_exactly_what_it_appended() {
        let log = TempLog::open().expect("log");
        let channels = vec!["a".to_owned(), "b".to_owned()];
        let p = Producer::start(log.log.clone(), channels.clone(), 2000.0);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let produced = p.stop().await.expect("produced");
        for (c, s) in channels.iter().zip(&produced) {
            assert!(s.count > 0, "{c} got nothing");
            assert_eq!(s.max_seq, s.count, "{c}: sequences 1, 2, 3…");
            assert_eq!(reread(&*log.log, c).await, *s, "{c}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_demo_waits_until_every_committed_checkpoint_reaches_the_logs_end() {
        let log = TempLog::open().expect("log");
        let store = EmbeddedStore::new();
        let keys = Keys::default();
        let channels = vec!["a".to_owned()];
        assert_eq!(
            committed(&store, &keys, "a").await.expect("reads"),
            (Position::START, StreamState::default())
        );
        let mut last = Position::START;
        for i in 1..=3u64 {
            last = log
                .log
                .append("a", crate::cmd::produce::payload(i, 4, &mut 1))
                .await
                .expect("appends");
        }
        let behind = wait_caught_up(
            &store,
            &keys,
            &*log.log,
            &channels,
            Duration::from_millis(100),
        )
        .await;
        assert!(behind.is_err(), "no checkpoint yet: behind");
        checkpoint(&store, &keys, "a", last).await;
        let end = wait_caught_up(&store, &keys, &*log.log, &channels, Duration::from_secs(1))
            .await
            .expect("caught up");
        assert_eq!(end["a"].count, 3);
        assert_eq!(end["a"].digest, 42, "the committed state, not a re-read");
    }
}
