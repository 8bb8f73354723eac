//! The exec handler in a node on the embedded store (issue 14): a worker process sees the
//! node's pause through `GET /state` — `paused` while the store is away, `running` again after
//! — and the node stops it when the node stops.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use chanwatch_coord::Coordinator;
use chanwatch_core::{ChannelName, NodeId, VChannelInfo};
use chanwatch_node::{ExecHandler, ExecOptions, Node};
use chanwatch_store::{EmbeddedStore, MetaStore};

/// Waits until `path` holds `want` (its lines, in order), for up to 20 s.
async fn lines(path: &std::path::Path, want: &[&str]) -> Result<()> {
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.lines().collect::<Vec<_>>() == want {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(20) {
            bail!("{} holds {text:?}, not {want:?}", path.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_sees_the_nodes_pause_through_its_state_and_runs_again_after() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let states = dir.path().join("states");
    // Says ready, then appends each change of GET /state to the file.
    let worker = format!(
        r#"auth="Authorization: Bearer $CHANWATCH_AGENT_TOKEN"
curl -s -X POST -H "$auth" "$CHANWATCH_AGENT_URL/ready" >/dev/null
last=
while :; do
  case $(curl -s -H "$auth" "$CHANWATCH_AGENT_URL/state") in *paused*) s=paused ;; *running*) s=running ;; *) s=other ;; esac
  [ "$s" != "$last" ] && echo $s >> '{}'
  last=$s; sleep 0.05
done"#,
        states.display()
    );
    let embedded = Arc::new(EmbeddedStore::new());
    let store: Arc<dyn MetaStore> = embedded.clone();
    let coordinator = Coordinator::builder(store.clone()).spawn()?;
    let mut ready = coordinator.watch_status();
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;
    let exec = Arc::new(ExecHandler::bind(ExecOptions::new(worker), "127.0.0.1:0").await?);
    let node = Node::builder(store.clone())
        .handler(exec.clone())
        .session_ttl(Duration::from_secs(2))
        .spawn()?;
    let id: NodeId = tokio::time::timeout(
        Duration::from_secs(10),
        node.watch_status().wait_for(|s| s.id.is_some()),
    )
    .await??
    .id
    .context("the node has an id")?;
    let channel = ChannelName::new("e-0")?;
    coordinator
        .add_channel(channel.clone(), VChannelInfo::default())
        .await?;
    lines(&states, &["running"]).await?;
    let pid = exec.worker_pid(id, &channel).context("a worker runs")?;
    embedded.set_outage(true);
    lines(&states, &["running", "paused"]).await?;
    embedded.set_outage(false);
    lines(&states, &["running", "paused", "running"]).await?;
    assert_eq!(
        exec.worker_pid(id, &channel),
        Some(pid),
        "resumed warm, same worker"
    );
    node.stop().await?;
    assert!(exec.worker_pid(id, &channel).is_none());
    let proc = std::path::PathBuf::from(format!("/proc/{pid}/stat"));
    let gone = std::fs::read_to_string(&proc).map_or(true, |s| s.contains(") Z"));
    assert!(gone, "the worker outlived the node's stop");
    coordinator.stop().await?;
    Ok(())
}
