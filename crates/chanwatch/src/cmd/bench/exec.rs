//! `bench exec` (issue 14): the cost of `--exec` workers, in process with one coordinator and
//! one node, on the embedded store or (`--store etcd`) on etcd, where a commit costs what it
//! costs in production and the agent's overhead is measured against that.
//!
//! - **start**: `--channels` channels whose worker is a trivial child (`exec sleep`, load done
//!   at spawn): time from the first registration to every channel `Watched` with its child
//!   running; then the time to stop the node (SIGTERM to every child, each reaped).
//! - **memory**: the node process's resident memory grown per child (this process's `VmRSS`
//!   before and after; the children's own memory is theirs, and not counted).
//! - **commits/s**: `--commit-channels` channels committing as fast as they can for
//!   `--seconds`, through the agent API (a Python child per channel, and a compiled child per
//!   channel — this binary's hidden `bench exec-worker` — each on one keep-alive HTTP
//!   connection) and through the in-process handler's `ctx.commit` — the same group commit;
//!   `--runs` times each, medians. Beside each: commits per store txn (the embedded store's
//!   revisions: one per txn), and CPU per landed commit of the node's process and of the
//!   children (`/proc/self/stat`, the children's once reaped), to tell where the time goes.
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

use super::{BenchExecArgs, StoreKind};

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

/// Where a cluster of this bench runs: a fresh embedded store, or etcd under a fresh root.
struct Site<'a> {
    args: &'a BenchExecArgs,
}

/// A started cluster: its store, its keys, the coordinator and the one node.
struct Started {
    store: Arc<dyn MetaStore>,
    keys: Keys,
    coord: chanwatch_coord::CoordHandle,
    node: NodeHandle,
}

impl Site<'_> {
    /// A coordinator and one node running `handler`, on a fresh embedded store or, on etcd,
    /// under a root of their own (`bench-exec-{pid}-{n}`), each on its own connection.
    async fn cluster(&self, handler: Arc<dyn ChannelHandler>) -> Result<Started> {
        static CLUSTERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = CLUSTERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (keys, store, node_store): (Keys, Arc<dyn MetaStore>, Arc<dyn MetaStore>) =
            match self.args.store {
                StoreKind::Embedded => {
                    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
                    (Keys::default(), store.clone(), store)
                }
                StoreKind::Etcd => (
                    Keys::new(format!("bench-exec-{}-{n}", std::process::id()))?,
                    self.args.etcd.connect().await?,
                    self.args.etcd.connect().await?,
                ),
            };
        let coord = chanwatch_coord::Coordinator::builder(store.clone())
            .config(chanwatch_coord::CoordinatorConfig {
                keys: keys.clone(),
                ..chanwatch_coord::CoordinatorConfig::default()
            })
            .spawn()?;
        let mut ready = coord.watch_status();
        tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;
        let node = Node::builder(node_store)
            .handler(handler)
            .config(chanwatch_node::NodeConfig {
                keys: keys.clone(),
                ..chanwatch_node::NodeConfig::default()
            })
            .spawn()?;
        let mut status = node.watch_status();
        tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.id.is_some()))
            .await??;
        Ok(Started {
            store,
            keys,
            coord,
            node,
        })
    }
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
async fn committed(store: &dyn MetaStore, keys: &Keys) -> Result<u64> {
    let prefix = keys.checkpoints_prefix();
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

/// This process's CPU time and that of its reaped children, seconds (`/proc/self/stat`
/// utime + stime and cutime + cstime, at the usual 100 ticks per second).
fn cpu() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let f: Vec<f64> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .unwrap_or_default()
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    let at = |i: usize| f.get(i).copied().unwrap_or(0.0) / 100.0;
    (at(11) + at(12), at(13) + at(14))
}

/// The store's revision: one per txn that wrote.
async fn revision(store: &dyn MetaStore) -> Result<i64> {
    Ok(store.range("\u{0}").await?.revision)
}

/// Who commits, and how it reaches its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// A Python child per channel (`http.client`, one keep-alive connection) through the agent.
    Python,
    /// A compiled child per channel (this binary's hidden `bench exec-worker`: reqwest, one
    /// keep-alive connection) through the agent.
    Compiled,
    /// A task per channel calling `ctx.commit` in the node's process.
    InProcess,
}

impl Via {
    fn name(self) -> &'static str {
        match self {
            Via::Python => "agent-python",
            Via::Compiled => "agent-compiled",
            Via::InProcess => "in-process",
        }
    }
}

/// One run's figures.
#[derive(Debug, Clone, Copy, Default)]
struct Figures {
    commits_per_s: f64,
    commits_per_txn: f64,
    /// CPU of the node's process (agent, committer, group commit, the embedded store) per
    /// landed commit, µs.
    node_us: f64,
    /// CPU of the children per landed commit, µs (0 in process).
    client_us: f64,
}

/// The interpreter `python3` runs (not a version manager's shim, which costs a shell per
/// start).
fn python() -> String {
    std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "python3".to_owned())
}

/// `channels` committers `via` for `secs` each, on a fresh cluster.
async fn commit_run(site: &Site<'_>, via: Via, channels: usize, secs: Duration) -> Result<Figures> {
    let handler: Arc<dyn ChannelHandler> = match via {
        Via::Python => {
            // The script holds no single quote: it goes to the shell as one quoted word.
            let script = PYTHON.replace("SECS", &secs.as_secs().to_string());
            Arc::new(
                ExecHandler::bind(
                    ExecOptions::new(format!("exec '{}' -c '{script}'", python())),
                    "127.0.0.1:0",
                )
                .await?,
            )
        }
        Via::Compiled => {
            let exe = std::env::current_exe().context("this binary's path")?;
            Arc::new(
                ExecHandler::bind(
                    ExecOptions::new(format!(
                        "exec '{}' bench exec-worker --seconds {}",
                        exe.display(),
                        secs.as_secs()
                    )),
                    "127.0.0.1:0",
                )
                .await?,
            )
        }
        Via::InProcess => Arc::new(Committer { secs }),
    };
    let Started {
        store,
        keys,
        coord,
        node,
    } = site.cluster(handler).await?;
    let rev0 = revision(&*store).await?;
    let (cpu0, children0) = cpu();
    add_all(&coord, channels).await?;
    // Every committer runs `secs` from its start; wait them out, plus a margin.
    tokio::time::sleep(secs + Duration::from_secs(2)).await;
    let total = committed(&*store, &keys).await?;
    let rev1 = revision(&*store).await?;
    let (cpu1, _) = cpu();
    // Stopping the node reaps the children: their CPU is then in this process's cutime.
    node.stop().await?;
    coord.stop().await?;
    let (_, children1) = cpu();
    let landed = total.max(1) as f64;
    Ok(Figures {
        commits_per_s: total as f64 / secs.as_secs_f64(),
        commits_per_txn: total as f64 / (rev1 - rev0).max(1) as f64,
        node_us: (cpu1 - cpu0) * 1e6 / landed,
        client_us: (children1 - children0) * 1e6 / landed,
    })
}

/// The compiled child of `bench exec` (hidden `bench exec-worker`): see [`Via::Compiled`].
///
/// # Errors
/// Not run by `bench exec` (no agent in the environment), or the agent gone.
pub async fn worker(args: &super::BenchExecWorkerArgs) -> Result<()> {
    let url = std::env::var("CHANWATCH_AGENT_URL")
        .context("CHANWATCH_AGENT_URL is not set: `bench exec` runs this as its worker")?;
    let token = std::env::var("CHANWATCH_AGENT_TOKEN")
        .context("CHANWATCH_AGENT_TOKEN is not set: `bench exec` runs this as its worker")?;
    let client = reqwest::Client::new();
    let post = |path: &str, body: String| {
        client
            .post(format!("{url}{path}"))
            .bearer_auth(&token)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
    };
    post("/ready", "{}".into()).await?;
    let end = Instant::now() + Duration::from_secs(args.seconds);
    let mut n = 0u64;
    while Instant::now() < end {
        let r = post(
            "/commit",
            format!(r#"{{"position":"{}","state":{{}}}}"#, n + 1),
        )
        .await?;
        let ok = r.status() == reqwest::StatusCode::OK;
        // Read the answer to its end, so the connection is kept for the next request.
        r.bytes().await?;
        if ok {
            n += 1;
        }
    }
    // Idle until the node stops it.
    std::future::pending::<()>().await;
    Ok(())
}

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
    let site = Site { args };
    let Started { coord, node, .. } = site.cluster(exec.clone()).await?;
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

    // Commits per second: the agent (Python children, compiled children) against the
    // in-process handler, `runs` times each, interleaved; medians.
    let secs = Duration::from_secs(args.seconds.max(1));
    let vias = [Via::Python, Via::Compiled, Via::InProcess];
    let mut all: Vec<Vec<Figures>> = vec![Vec::new(); vias.len()];
    for run in 0..args.runs.max(1) {
        for (i, via) in vias.iter().enumerate() {
            let f = commit_run(&site, *via, args.commit_channels, secs).await?;
            tracing::info!(run, via = via.name(), ?f, "bench exec: commits");
            all[i].push(f);
        }
    }
    let med = |fs: &[Figures], f: fn(&Figures) -> f64| super::median(fs.iter().map(f).collect());
    let mut rates = Vec::new();
    for (via, fs) in vias.iter().zip(&all) {
        let rate = med(fs, |f| f.commits_per_s);
        let runs: Vec<String> = fs
            .iter()
            .map(|f| format!("{:.0}", f.commits_per_s))
            .collect();
        let (per_txn, node_us, client_us) = (
            med(fs, |f| f.commits_per_txn),
            med(fs, |f| f.node_us),
            med(fs, |f| f.client_us),
        );
        eprintln!(
            "exec commits ({}): {} channels, median {rate:.0}/s of runs [{}]; {per_txn:.1} commits per txn; CPU per commit: node {node_us:.0} µs, children {client_us:.0} µs",
            via.name(),
            args.commit_channels,
            runs.join(", ")
        );
        println!(
            "{}",
            json!({"bench": "exec-commits", "via": via.name(), "channels": args.commit_channels,
                   "runs": fs.len(), "commits_per_s": rate.round(),
                   "commits_per_txn": (per_txn * 10.0).round() / 10.0,
                   "node_cpu_us_per_commit": node_us.round(),
                   "child_cpu_us_per_commit": client_us.round()})
        );
        rates.push(rate);
    }
    if let [python, compiled, inproc] = rates[..] {
        eprintln!(
            "agent / in-process commit throughput: {:.2} with Python children, {:.2} with compiled children",
            python / inproc.max(1.0),
            compiled / inproc.max(1.0)
        );
    }
    Ok(())
}
