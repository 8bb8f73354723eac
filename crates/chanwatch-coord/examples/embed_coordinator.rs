//! Embeds a chanwatch coordinator in your own program.
//!
//! It runs on the embedded store (etcd's semantics, in memory), registers one channel through
//! the coordinator's handle, prints what the coordinator knows, and stops — in well under a
//! second. It exits non-zero when any of that does not happen as shown (CI runs it):
//!
//! ```sh
//! cargo run -p chanwatch-coord --example embed_coordinator
//! ```
//!
//! With no node alive the channel waits under `remaining`; a node (`chanwatch node`, or one
//! embedded with the `chanwatch-node` crate) sharing the store would be assigned it. Against
//! a real etcd, replace the store with `chanwatch_store::EtcdStore::connect(..)`.

use std::sync::Arc;
use std::time::Duration;

use chanwatch_coord::Coordinator;
use chanwatch_core::{ChannelName, VChannelInfo};
use chanwatch_store::{EmbeddedStore, MetaStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The store every coordinator and node of the cluster shares.
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());

    // Start a coordinator. Every setting has a default; these are the ones most programs set.
    let coordinator = Coordinator::builder(store)
        .id("example-coordinator")
        // A standby coordinator takes over within about this long if this one dies.
        .session_ttl(Duration::from_secs(5))
        // A node gets this long to load a channel and acknowledge it.
        .watch_timeout(Duration::from_secs(30))
        .spawn()?;

    // It campaigns for leadership, wins (it is alone), lists the store, then is ready.
    let mut status = coordinator.watch_status();
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.ready)).await??;
    println!("status: {:?}", coordinator.status());

    // What the admin HTTP API (`chanwatch_coord::api::router`) does, straight on the handle.
    let name = ChannelName::new("orders-0")?;
    let transitions = coordinator
        .add_channel(name.clone(), VChannelInfo::default())
        .await?;
    for t in &transitions {
        println!("transition: {t:?}");
    }
    if transitions.is_empty() {
        return Err("adding orders-0 changed nothing".into());
    }
    let rows = coordinator.channels().await?;
    for row in &rows {
        let node = row.node.map_or("remaining".to_owned(), |n| n.to_string());
        println!("channel {} on {node}: {}", row.channel, row.state);
    }
    // No node is alive: the channel waits under `remaining`.
    if !rows.iter().any(|r| r.channel == name && r.node.is_none()) {
        return Err(format!("orders-0 is not waiting under remaining: {rows:?}").into());
    }

    // Its metrics, registered for you (serve them on your own /metrics).
    let metrics = chanwatch_coord::metrics::render(coordinator.registry());
    let Some(leader) = metrics.lines().find(|l| l.starts_with("chanwatch_leader ")) else {
        return Err("the metrics have no chanwatch_leader".into());
    };
    println!("metric: {leader}");
    if leader != "chanwatch_leader 1" {
        return Err(format!("the coordinator does not say it leads: {leader}").into());
    }

    // Stop: the leader resigns (revokes its lease) so a standby would take over at once.
    // Dropping the last handle stops it too, without waiting.
    coordinator.stop().await?;
    let stopped = coordinator.status();
    println!("stopped: {stopped:?}");
    if stopped.leader {
        return Err("still leader after stop".into());
    }
    Ok(())
}
