//! A complete handler that keeps its place: it resumes each channel from its checkpoint,
//! commits `(position, state)` as it goes, stops when fenced, holds still while paused, and
//! reports a broken channel — the whole handler contract (docs/DESIGN.md §7). docs/EMBEDDING.md
//! "Write your own handler" walks through it.
//!
//! The "stream" is a counter: message `n` of a channel has the value `n`, and the handler's
//! state is the sum of the values it has applied. Two nodes run in this process beside a
//! coordinator, on the embedded store. Node 1 runs both channels for a while; then it stops,
//! node 2 takes them over from their checkpoints, and the example checks that every message was
//! applied exactly once (the sum is `1 + 2 + … + position`):
//!
//! ```sh
//! cargo run -p chanwatch-node --example checkpointed_handler
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chanwatch_coord::Coordinator;
use chanwatch_core::{ChannelInfo, ChannelName, NodeId, VChannelInfo};
use chanwatch_node::{ChannelContext, ChannelHandler, CommitError, Node};
use chanwatch_store::{EmbeddedStore, MetaStore};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Commit after this many messages.
const COMMIT_EVERY: u64 = 10;

/// One running channel: its consumer task and the switch `pause`/`resume` flip.
struct Run {
    task: JoinHandle<()>,
    paused: watch::Sender<bool>,
}

/// Runs each channel as a task that applies messages and commits its place.
#[derive(Default)]
struct Counter {
    runs: Mutex<HashMap<String, Run>>,
}

#[async_trait]
impl ChannelHandler for Counter {
    async fn load(&self, ctx: ChannelContext) -> Result<(), String> {
        if ctx.info.channel.as_str().ends_with("-bad") {
            // A channel that cannot load: it is written `WatchFailed` and moved elsewhere.
            return Err("this channel's source does not exist".into());
        }
        // Where to start: the last checkpoint of this channel, whoever wrote it.
        let (mut position, mut sum) = match ctx.resume().await {
            Ok(Some(cp)) => (
                cp.position.parse::<u64>().map_err(|e| e.to_string())?,
                cp.state.and_then(|s| s["sum"].as_u64()).unwrap_or(0),
            ),
            Ok(None) => (0, 0),
            Err(e) => return Err(format!("cannot read the checkpoint: {e}")),
        };
        println!(
            "node {}: {} resumes after message {position} (sum {sum})",
            ctx.node, ctx.info.channel
        );
        let name = ctx.info.channel.to_string();
        let (paused, mut is_paused) = watch::channel(false);
        let task = tokio::spawn(async move {
            loop {
                // Paused: no effects, no commits; the state stays in memory.
                if is_paused.wait_for(|p| !p).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await; // wait for a message
                position += 1;
                sum += position; // apply message `position`
                if position % COMMIT_EVERY != 0 {
                    continue;
                }
                match ctx
                    .commit(position.to_string(), Some(json!({ "sum": sum })))
                    .await
                {
                    Ok(()) => {}
                    // Another run owns the channel now: stop at once, commit nothing more.
                    Err(CommitError::Fenced(why)) => {
                        println!("{}: fenced ({why}); stopping", ctx.info.channel);
                        return;
                    }
                    // Nothing known to have landed: keep the state, commit again later.
                    Err(CommitError::Unavailable(_)) => {}
                    // The state grew too big to checkpoint: this channel cannot go on here.
                    Err(e @ CommitError::TooLarge(_)) => return ctx.fail(e.to_string()),
                }
            }
        });
        let run = Run { task, paused };
        self.runs
            .lock()
            .map_err(|e| e.to_string())?
            .insert(name, run);
        Ok(()) // it runs: the node acknowledges `Watched`
    }

    async fn release(&self, _node: NodeId, info: &ChannelInfo) {
        let run = self
            .runs
            .lock()
            .ok()
            .and_then(|mut r| r.remove(info.channel.as_str()));
        if let Some(run) = run {
            // Stop before returning: the node acks `Released` after this, and only then may
            // another node start the channel (break before make). Messages applied since
            // the last commit are applied again by the next owner, from the checkpoint, to
            // the checkpoint's state: exactly once in the committed state.
            run.task.abort();
            let _ = run.task.await;
        }
    }

    async fn pause(&self, _node: NodeId, info: &ChannelInfo) {
        self.set_paused(info, true);
    }

    async fn resume(&self, _node: NodeId, info: &ChannelInfo) {
        self.set_paused(info, false);
    }
}

impl Counter {
    fn set_paused(&self, info: &ChannelInfo, paused: bool) {
        if let Ok(runs) = self.runs.lock() {
            if let Some(run) = runs.get(info.channel.as_str()) {
                run.paused.send_replace(paused);
            }
        }
    }
}

/// Runs the example.
#[tokio::main]
pub async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let node = |store: &Arc<dyn MetaStore>| {
        Node::builder(store.clone())
            .handler(Arc::new(Counter::default()))
            .session_ttl(Duration::from_secs(5))
            .spawn()
    };
    let first = node(&store)?;
    let coordinator = Coordinator::builder(store.clone()).spawn()?;
    let mut ready = coordinator.watch_status();
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;
    let names = ["orders-0", "orders-1"];
    for name in names {
        coordinator
            .add_channel(ChannelName::new(name)?, VChannelInfo::default())
            .await?;
    }
    tokio::time::sleep(Duration::from_millis(600)).await;

    // A second node joins, the first stops: its channels move, and resume from their
    // checkpoints on the second.
    let second = node(&store)?;
    first.stop().await?;
    tokio::time::sleep(Duration::from_millis(600)).await;
    second.stop().await?;
    coordinator.stop().await?;

    for name in names {
        let key = chanwatch_core::Keys::default().checkpoint(&ChannelName::new(name)?);
        let kv = store.get(&key).await?.ok_or("no checkpoint")?;
        let cp: chanwatch_core::Checkpoint = serde_json::from_slice(&kv.value)?;
        let position: u64 = cp.position.parse()?;
        let sum = cp.state.and_then(|s| s["sum"].as_u64()).unwrap_or(0);
        println!(
            "{name}: committed position {position}, sum {sum}, epoch {}",
            cp.epoch
        );
        assert!(position >= COMMIT_EVERY, "{name} made progress");
        assert_eq!(
            sum,
            position * (position + 1) / 2,
            "{name}: every message applied exactly once"
        );
    }
    println!("exactly once through a move");
    Ok(())
}
