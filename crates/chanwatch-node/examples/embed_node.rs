//! Embeds a chanwatch node, with a handler of your own, in your own program.
//!
//! The handler below is what a team writes: `load` starts consuming a channel (from its
//! checkpoint) and returns once it runs; `release` stops it; `pause` and `resume` bracket a
//! stretch in which the node cannot reach the store (stop every external effect, keep what is
//! loaded). Everything runs on the embedded store with a coordinator in the same process, and
//! stops by itself in a few seconds:
//!
//! ```sh
//! cargo run -p chanwatch-node --example embed_node
//! ```
//!
//! Against a real etcd, connect a `chanwatch_store::EtcdStore` instead and leave the
//! coordinator to `chanwatch coord`.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chanwatch_coord::Coordinator;
use chanwatch_core::{ChannelInfo, ChannelName, NodeId, VChannelInfo};
use chanwatch_node::{ChannelContext, ChannelHandler, Node};
use chanwatch_store::{EmbeddedStore, MetaStore};

/// A handler that "consumes" channels by remembering which ones run.
#[derive(Default)]
struct Printer {
    running: Mutex<BTreeSet<String>>,
}

#[async_trait]
impl ChannelHandler for Printer {
    async fn load(&self, ctx: ChannelContext) -> Result<(), String> {
        // Real work: open the stream, seek to the checkpoint, start a consumer task.
        ctx.progress(50); // shown by `ctl channels` while loading
        println!(
            "load    {} (epoch {}) on node {}",
            ctx.info.channel, ctx.info.epoch, ctx.node
        );
        self.running
            .lock()
            .map_err(|e| e.to_string())?
            .insert(ctx.info.channel.to_string());
        Ok(())
    }

    async fn release(&self, node: NodeId, info: &ChannelInfo) {
        println!("release {} on node {node}", info.channel);
        if let Ok(mut r) = self.running.lock() {
            r.remove(info.channel.as_str());
        }
    }

    async fn pause(&self, node: NodeId, info: &ChannelInfo) {
        println!(
            "pause   {} on node {node}: no effects until resume",
            info.channel
        );
    }

    async fn resume(&self, node: NodeId, info: &ChannelInfo) {
        println!("resume  {} on node {node}", info.channel);
    }
}

/// Runs the example (public so that a test runs it too: `tests/it/example.rs`).
#[tokio::main]
pub async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let handler = Arc::new(Printer::default());

    // The node: a fresh ID, a leased session, a watch of its own assignments.
    let node = Node::builder(store.clone())
        .handler(handler.clone())
        .session_ttl(Duration::from_secs(5))
        .spawn()?;
    // A coordinator on the same store assigns channels to live nodes.
    let coordinator = Coordinator::builder(store).spawn()?;
    let mut ready = coordinator.watch_status();
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;

    for name in ["orders-0", "orders-1", "orders-2"] {
        coordinator
            .add_channel(ChannelName::new(name)?, VChannelInfo::default())
            .await?;
    }
    // Wait until the node runs all three (acknowledged `Watched`).
    let all_running = async {
        loop {
            let rows = coordinator.channels().await?;
            if rows.iter().all(|r| r.state.as_str() == "Watched") && rows.len() == 3 {
                return Ok::<_, Box<dyn std::error::Error>>(rows);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let rows = tokio::time::timeout(Duration::from_secs(10), all_running).await??;
    for r in &rows {
        println!(
            "channel {} runs on node {:?} at epoch {}",
            r.channel, r.node, r.epoch
        );
    }
    println!("node status: {:?}", node.status());
    let running = handler.running.lock().map(|r| r.len()).unwrap_or(0);
    assert_eq!(running, 3, "the handler runs the three channels");

    // Stop the node first (its channels are released and its session revoked), then the
    // coordinator.
    node.stop().await?;
    coordinator.stop().await?;
    println!("stopped");
    Ok(())
}
