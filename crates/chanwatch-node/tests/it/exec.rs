//! The exec handler in a node on the embedded store: a worker process sees the
//! node's pause through `GET /state` — `paused` while the store is away, `running` again after
//! — and the node stops it when the node stops; a worker's `POST /fail` before `/ready` ends
//! its load at once.

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

/// A worker that says it is broken (`POST /fail`) before it said it is ready ends its load at
/// once: the node acks `WatchFailed` with the worker's reason and kills it — long before the
/// coordinator's watch timeout (30 s), which is all that ended such a load before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_fails_before_it_is_ready_is_watch_failed_at_once() -> Result<()> {
    use chanwatch_core::{ChannelInfo, ChannelState, Keys};
    let dir = tempfile::tempdir()?;
    let pid_file = dir.path().join("pid");
    let worker = format!(
        r#"echo $$ > '{}'
curl -s -X POST -H "Authorization: Bearer $CHANWATCH_AGENT_TOKEN" -d '{{"reason": "no disk"}}' "$CHANWATCH_AGENT_URL/fail" >/dev/null
exec sleep 3600"#,
        pid_file.display()
    );
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let coordinator = Coordinator::builder(store.clone()).spawn()?;
    let mut ready = coordinator.watch_status();
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;
    let exec = Arc::new(ExecHandler::bind(ExecOptions::new(worker), "127.0.0.1:0").await?);
    let node = Node::builder(store.clone()).handler(exec.clone()).spawn()?;
    let started = Instant::now();
    coordinator
        .add_channel(ChannelName::new("f-0")?, VChannelInfo::default())
        .await?;
    let reason = loop {
        let failed = store
            .range(&Keys::default().channels_prefix())
            .await?
            .kvs
            .iter()
            .filter_map(|kv| ChannelInfo::decode(&kv.value).ok())
            .find(|i| i.state == ChannelState::WatchFailed);
        if let Some(info) = failed {
            break info.reason.unwrap_or_default();
        }
        if started.elapsed() > Duration::from_secs(10) {
            bail!("no WatchFailed 10 s after the worker's POST /fail");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(reason.contains("no disk"), "the reason: {reason}");
    let pid: u32 = std::fs::read_to_string(&pid_file)?.trim().parse()?;
    let proc = std::path::PathBuf::from(format!("/proc/{pid}/stat"));
    let started = Instant::now();
    while std::fs::read_to_string(&proc).is_ok_and(|s| !s.contains(") Z")) {
        if started.elapsed() > Duration::from_secs(5) {
            bail!("the worker {pid} still runs 5 s after its load failed");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node.stop().await?;
    coordinator.stop().await?;
    Ok(())
}
