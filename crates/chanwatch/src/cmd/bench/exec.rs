//! `bench exec` (issue 14): the cost of `--exec` workers, in process on the embedded store
//! with one coordinator and one node.
//!
//! - **start**: `--channels` channels whose worker is a trivial child (`exec sleep`, load done
//!   at spawn): time from the first registration to every channel `Watched` with its child
//!   running; then the time to stop the node (SIGTERM to every child, each reaped).
//! - **memory**: the node process's resident memory grown per child (this process's `VmRSS`
//!   before and after; the children's own memory is theirs, and not counted).
//! - **commits/s**: `--commit-channels` channels committing as fast as they can for
//!   `--seconds`, through the agent API (a Python child per channel on one keep-alive HTTP
//!   connection) and through the in-process handler's `ctx.commit` — the same group commit.
//!
//! Owns: these workloads. Must not: assert on timings.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use chanwatch_core::{
    ChannelInfo, ChannelName, ChannelState, Checkpoint, Keys, NodeId, VChannelInfo,
};
use chanwatch_node::{ChannelContext, ChannelHandler, ExecHandler, ExecOptions, Node, NodeHandle};
use chanwatch_store::{EmbeddedStore, MetaStore};
use serde_json::json;

use super::BenchExecArgs;

/// The node process's resident memory, bytes.
fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}

/// A coordinator and one node running `handler`, on a fresh embedded store.
async fn cluster(
    handler: Arc<dyn ChannelHandler>,
) -> Result<(Arc<dyn MetaStore>, chanwatch_coord::CoordHandle, NodeHandle)> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let coord = chanwatch_coord::Coordinator::builder(store.clone()).spawn()?;
    let mut ready = coord.watch_status();
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;
    let node = Node::builder(store.clone()).handler(handler).spawn()?;
    let mut status = node.watch_status();
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.id.is_some())).await??;
    Ok((store, coord, node))
}

/// Registers `n` channels `x-00000…` and waits until all are `Watched`.
async fn add_all(coord: &chanwatch_coord::CoordHandle, n: usize) -> Result<()> {
    for i in 0..n {
        coord
            .add_channel(
                ChannelName::new(format!("x-{i:05}"))?,
                VChannelInfo::default(),
            )
            .await
            .map_err(|e| anyhow::anyhow!("add channel {i}: {e}"))?;
    }
    tracing::info!(channels = n, "bench exec: all registered");
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let rows = coord.channels().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        let watched = rows
            .iter()
            .filter(|r| r.state == ChannelState::Watched)
            .count();
        if watched == n {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("only {watched} of {n} channels Watched after 300 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The sum of every checkpoint's position: each committer commits 1, 2, 3, …
async fn committed(store: &dyn MetaStore) -> Result<u64> {
    let prefix = Keys::default().checkpoints_prefix();
    let mut sum = 0;
    for kv in store.range(&prefix).await?.kvs {
        let cp = Checkpoint::decode(&kv.value).context("checkpoint decodes")?;
        sum += cp.position.parse::<u64>().unwrap_or(0);
    }
    Ok(sum)
}

/// The in-process equivalent of the Python committer: commits 1, 2, 3, … for `secs`.
#[derive(Debug)]
struct Committer {
    secs: Duration,
}

#[async_trait]
impl ChannelHandler for Committer {
    async fn load(&self, ctx: ChannelContext) -> Result<(), String> {
        let secs = self.secs;
        tokio::spawn(async move {
            let end = Instant::now() + secs;
            let mut n = 0u64;
            while Instant::now() < end {
                if ctx
                    .commit((n + 1).to_string(), Some(json!({})))
                    .await
                    .is_ok()
                {
                    n += 1;
                }
            }
        });
        Ok(())
    }
    async fn release(&self, _node: NodeId, _info: &ChannelInfo) {}
    async fn pause(&self, _node: NodeId, _info: &ChannelInfo) {}
    async fn resume(&self, _node: NodeId, _info: &ChannelInfo) {}
}

const PYTHON: &str = r#"
import http.client, json, os, time
host, port = os.environ["CHANWATCH_AGENT_URL"][len("http://"):].split(":")
headers = {"Authorization": "Bearer " + os.environ["CHANWATCH_AGENT_TOKEN"], "Content-Type": "application/json"}
conn = http.client.HTTPConnection(host, int(port))
def post(path, body):
    conn.request("POST", path, body=json.dumps(body), headers=headers)
    r = conn.getresponse(); r.read(); return r.status
post("/ready", {})
end, n = time.monotonic() + SECS, 0
while time.monotonic() < end:
    if post("/commit", {"position": str(n + 1), "state": {}}) == 200:
        n += 1
time.sleep(3600)
"#;

/// Runs `bench exec`.
///
/// # Errors
/// A cluster that does not start or settle.
pub async fn run(args: &BenchExecArgs) -> Result<()> {
    // Start and memory.
    let exec = Arc::new(
        ExecHandler::bind(
            ExecOptions {
                ready_on_start: true,
                ..ExecOptions::new("exec sleep 3600")
            },
            "127.0.0.1:0",
        )
        .await?,
    );
    let (_store, coord, node) = cluster(exec.clone()).await?;
    let before = rss();
    let started = Instant::now();
    add_all(&coord, args.channels).await?;
    let start_secs = started.elapsed().as_secs_f64();
    let after = rss();
    let per_child = after.saturating_sub(before) as f64 / args.channels.max(1) as f64;
    let stopping = Instant::now();
    node.stop().await?;
    let stop_secs = stopping.elapsed().as_secs_f64();
    coord.stop().await?;
    eprintln!(
        "exec start: {} channels Watched with a child each in {start_secs:.2} s; node RSS +{:.1} KiB per child; stop (SIGTERM, reap all) {stop_secs:.2} s",
        args.channels,
        per_child / 1024.0
    );
    println!(
        "{}",
        json!({"bench": "exec-start", "channels": args.channels, "start_s": start_secs,
               "rss_per_child_bytes": per_child.round(), "stop_s": stop_secs})
    );

    // Commits per second: agent (Python children) vs in process.
    let secs = Duration::from_secs(args.seconds.max(1));
    // The script holds no single quote: it goes to the shell as one quoted word.
    let script = PYTHON.replace("SECS", &secs.as_secs().to_string());
    let exec = Arc::new(
        ExecHandler::bind(
            ExecOptions::new(format!("exec python3 -c '{script}'")),
            "127.0.0.1:0",
        )
        .await?,
    );
    let mut rates = Vec::new();
    for (what, handler) in [
        ("agent", exec as Arc<dyn ChannelHandler>),
        (
            "in-process",
            Arc::new(Committer { secs }) as Arc<dyn ChannelHandler>,
        ),
    ] {
        let (store, coord, node) = cluster(handler).await?;
        add_all(&coord, args.commit_channels).await?;
        // Every committer runs `secs` from its start; wait them out, plus a margin.
        tokio::time::sleep(secs + Duration::from_secs(2)).await;
        let total = committed(&*store).await?;
        let rate = total as f64 / secs.as_secs_f64();
        eprintln!(
            "exec commits ({what}): {} channels, {total} commits landed in {} s: {rate:.0}/s",
            args.commit_channels,
            secs.as_secs()
        );
        println!(
            "{}",
            json!({"bench": "exec-commits", "via": what, "channels": args.commit_channels,
                   "commits": total, "commits_per_s": rate.round()})
        );
        rates.push(rate);
        node.stop().await?;
        coord.stop().await?;
    }
    if let [agent, inproc] = rates[..] {
        eprintln!(
            "agent / in-process commit throughput: {:.2}",
            agent / inproc.max(1.0)
        );
    }
    Ok(())
}
