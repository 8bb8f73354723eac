//! `bench exec`: the cost of `--exec` workers, in process with one coordinator and
//! one node, on the embedded store or (`--store etcd`) on etcd, where a commit costs what it
//! costs in production and the agent's overhead is measured against that.
//!
//! - **start**: `--channels` channels whose worker is a trivial child (`exec sleep`, load done
//!   at spawn): time from the first registration to every channel `Watched` with its child
//!   running; then the time to stop the node (SIGTERM to every child, each reaped).
//! - **memory**: the node process's resident memory grown per child (this process's `VmRSS`
//!   before and after; the children's own memory is theirs, and not counted).
//! - **commits/s**: `--commit-channels` channels committing as fast as they can, through the
//!   agent API (a Python child per channel, and a compiled child per channel — this binary's
//!   hidden `bench exec-worker`, on the agent's Unix socket or over TCP — each on one
//!   keep-alive HTTP connection) and through the
//!   in-process handler's `ctx.commit` — the same group commit (`--via` picks; with
//!   `compiled-ping` the compiled children ask `GET /state` instead: the agent's round trips
//!   with no store behind them, counted by the agent — the transport's ceiling). Every
//!   committer commits from its start until it is stopped; once every channel is `Watched`
//!   and a second of warm-up has passed, the commits that land in `--seconds` are counted;
//!   `--runs` times each, medians. Beside each: commits per store txn (store revisions), and
//!   CPU per landed commit of the node's process (`/proc/self/stat`) and of the children
//!   (`/proc/PID/schedstat`: exact, where `stat` counts in 10 ms ticks), over the same
//!   window, to tell where the time goes; on etcd, its mean WAL fsync over the window (its
//!   `/metrics`), which tells a data dir on a disk from one on tmpfs, where etcd syncs
//!   nothing and the in-process path, bound by etcd's txns, runs faster than against any
//!   deployed etcd (the bench says so). (`--channels 0` skips the start figures.)
//!
//! Owns: these workloads. Must not: assert on timings.

use std::sync::atomic::{AtomicBool, Ordering};
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

use super::{meter, BenchExecArgs, StoreKind};

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
        // A loaded machine (a thousand Python children starting) can cost the coordinator
        // its leadership for a moment: try again, up to a minute.
        let mut tries = 0;
        loop {
            match coord
                .add_channel(
                    ChannelName::new(format!("x-{i:05}"))?,
                    VChannelInfo::default(),
                )
                .await
            {
                // Landed by an earlier try whose answer was lost.
                Ok(_)
                | Err(chanwatch_coord::ApiError::Admin(
                    chanwatch_core::planner::AdminError::AlreadyExists(_),
                )) => break,
                Err(e) if tries < 120 => {
                    tries += 1;
                    tracing::warn!(channel = i, error = %e, "bench exec: add channel failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => bail!("add channel {i}: {e}"),
            }
        }
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

/// The in-process equivalent of the agent's committers: commits 1, 2, 3, … until `stop`, or
/// until its run no longer owns the channel.
#[derive(Debug)]
struct Committer {
    stop: Arc<AtomicBool>,
}

#[async_trait]
impl ChannelHandler for Committer {
    async fn load(&self, ctx: ChannelContext) -> Result<(), String> {
        let stop = self.stop.clone();
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                match ctx.commit((n + 1).to_string(), Some(json!({}))).await {
                    Ok(()) => n += 1,
                    Err(chanwatch_node::CommitError::Fenced(_)) => return,
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
        });
        Ok(())
    }
    async fn release(&self, _node: NodeId, _info: &ChannelInfo) {}
    async fn pause(&self, _node: NodeId, _info: &ChannelInfo) {}
    async fn resume(&self, _node: NodeId, _info: &ChannelInfo) {}
}

/// The Python committer: commits 1, 2, 3, … on one keep-alive connection (`http.client`,
/// `TCP_NODELAY`) until the agent says its run is over (403, 409) or the node stops it.
const PYTHON: &str = r#"
import http.client, json, os, socket, sys
host, port = os.environ["CHANWATCH_AGENT_URL"][len("http://"):].split(":")
headers = {"Authorization": "Bearer " + os.environ["CHANWATCH_AGENT_TOKEN"], "Content-Type": "application/json"}
conn = http.client.HTTPConnection(host, int(port))
conn.connect()
# http.client writes the headers and the body apart: without this the body waits for the
# ACK from the agent for the headers (Nagle).
conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
def post(path, body):
    conn.request("POST", path, body=json.dumps(body), headers=headers)
    r = conn.getresponse(); r.read(); return r.status
post("/ready", {})
n = 0
while True:
    status = post("/commit", {"position": str(n + 1), "state": {}})
    if status == 200:
        n += 1
    elif status in (403, 409):
        sys.exit(0)
"#;

/// The store's revision: one per txn that wrote.
async fn revision(store: &dyn MetaStore) -> Result<i64> {
    Ok(store.range("\u{0}").await?.revision)
}

/// Who commits, and how it reaches its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// A Python child per channel (`http.client`, one keep-alive connection) through the agent.
    Python,
    /// A compiled child per channel (this binary's hidden `bench exec-worker`: blocking
    /// HTTP/1.1 on one keep-alive connection) through the agent's Unix socket.
    Compiled,
    /// The same over TCP (`CHANWATCH_AGENT_URL`).
    CompiledTcp,
    /// The compiled children asking `GET /state` instead of committing: the agent's round
    /// trips with no store behind them (counted by the agent), the transport's ceiling.
    CompiledPing,
    /// A task per channel calling `ctx.commit` in the node's process.
    InProcess,
}

impl Via {
    fn name(self) -> &'static str {
        match self {
            Via::Python => "agent-python",
            Via::Compiled => "agent-compiled",
            Via::CompiledTcp => "agent-compiled-tcp",
            Via::CompiledPing => "agent-compiled-ping",
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
    /// etcd's mean WAL fsync over the window, ms (`None`: not etcd, or its `/metrics` not
    /// read): whether its data is on a disk that syncs, which bounds the in-process path.
    fsync_ms: Option<f64>,
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

/// etcd's WAL fsyncs so far (seconds, count), or `None` — said once per process, as a
/// warning — when its `/metrics` cannot be read (then no run says which etcd it had).
async fn etcd_fsyncs(endpoints: &[String]) -> Option<(f64, f64)> {
    static SAID: AtomicBool = AtomicBool::new(false);
    match meter::etcd_wal_fsyncs(endpoints).await {
        Ok(f) => Some(f),
        Err(e) => {
            if !SAID.swap(true, Ordering::Relaxed) {
                tracing::warn!(error = %e, "bench exec: cannot read etcd's WAL fsyncs from its /metrics: the runs will not say whether its data is on a disk that syncs");
            }
            None
        }
    }
}

/// One sample of a commit run: what landed, the store's revision, and the CPU spent so far by
/// the node's process and by the running children.
struct Sample {
    committed: u64,
    revision: i64,
    node_cpu: f64,
    children_cpu: f64,
    /// etcd's WAL fsyncs so far (seconds, count), when it is etcd and says.
    fsyncs: Option<(f64, f64)>,
    at: Instant,
}

/// `channels` committers `via`, on a fresh cluster: once every channel is `Watched` (each
/// committer commits from its start until it is stopped) and a second of warm-up, the
/// commits that land in `secs`, with every committer running.
async fn commit_run(site: &Site<'_>, via: Via, channels: usize, secs: Duration) -> Result<Figures> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut exec: Option<Arc<ExecHandler>> = None;
    let handler: Arc<dyn ChannelHandler> = match via {
        Via::Python => {
            // The script holds no single quote: it goes to the shell as one quoted word.
            if PYTHON.contains('\'') {
                bail!(
                    "the bench's Python committer holds a single quote: the shell would split it"
                );
            }
            let h = Arc::new(
                ExecHandler::bind(
                    ExecOptions::new(format!("exec '{}' -c '{PYTHON}'", python())),
                    "127.0.0.1:0",
                )
                .await?,
            );
            exec = Some(h.clone());
            h
        }
        Via::Compiled | Via::CompiledTcp | Via::CompiledPing => {
            let exe = std::env::current_exe().context("this binary's path")?;
            let flag = match via {
                Via::CompiledTcp => " --tcp",
                Via::CompiledPing => " --ping",
                _ => "",
            };
            let h = Arc::new(
                ExecHandler::bind(
                    ExecOptions::new(format!("exec '{}' bench exec-worker{flag}", exe.display())),
                    "127.0.0.1:0",
                )
                .await?,
            );
            exec = Some(h.clone());
            h
        }
        Via::InProcess => Arc::new(Committer { stop: stop.clone() }),
    };
    let Started {
        store,
        keys,
        coord,
        node,
    } = site.cluster(handler).await?;
    let node_id = node.watch_status().borrow().id;
    add_all(&coord, channels).await?;
    let names: Vec<ChannelName> = (0..channels)
        .filter_map(|i| ChannelName::new(format!("x-{i:05}")).ok())
        .collect();
    let pids: Vec<u32> = match (&exec, node_id) {
        (Some(h), Some(id)) => names.iter().filter_map(|c| h.worker_pid(id, c)).collect(),
        _ => Vec::new(),
    };
    let sample = || async {
        // First, so that the window below is what it was before etcd's fsyncs were read
        // (an HTTP request to a busy etcd).
        let fsyncs = match site.args.store {
            StoreKind::Etcd => etcd_fsyncs(&site.args.etcd.endpoints).await,
            StoreKind::Embedded => None,
        };
        Ok::<_, anyhow::Error>(Sample {
            committed: match (via, &exec) {
                (Via::CompiledPing, Some(h)) => h.agent_requests(),
                _ => committed(&*store, &keys).await?,
            },
            revision: revision(&*store).await?,
            node_cpu: meter::cpu_secs(),
            children_cpu: pids.iter().map(|p| meter::cpu_of(*p)).sum(),
            fsyncs,
            at: Instant::now(),
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let s0 = sample().await?;
    tokio::time::sleep(secs).await;
    let s1 = sample().await?;
    stop.store(true, Ordering::Relaxed);
    node.stop().await?;
    coord.stop().await?;
    let landed = s1.committed.saturating_sub(s0.committed);
    let per = landed.max(1) as f64;
    Ok(Figures {
        commits_per_s: landed as f64 / s1.at.duration_since(s0.at).as_secs_f64(),
        commits_per_txn: landed as f64 / (s1.revision - s0.revision).max(1) as f64,
        node_us: (s1.node_cpu - s0.node_cpu) * 1e6 / per,
        client_us: (s1.children_cpu - s0.children_cpu) * 1e6 / per,
        fsync_ms: meter::mean_fsync_ms(s0.fsyncs, s1.fsyncs),
    })
}

/// The start, memory and stop figures: `--channels` trivial children.
async fn start(site: &Site<'_>, args: &BenchExecArgs) -> Result<()> {
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
    let Started { coord, node, .. } = site.cluster(exec.clone()).await?;
    let before = meter::rss_bytes();
    let started = Instant::now();
    add_all(&coord, args.channels).await?;
    let start_secs = started.elapsed().as_secs_f64();
    let after = meter::rss_bytes();
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

    Ok(())
}

/// A mean WAL fsync under this, ms, is storage that syncs nothing: tmpfs measured 0.001 ms
/// here, this machine's virtual disk 0.6.
const NO_SYNC_MS: f64 = 0.05;

/// Runs `bench exec`.
///
/// # Errors
/// A cluster that does not start or settle.
pub async fn run(args: &BenchExecArgs) -> Result<()> {
    let site = Site { args };
    if args.channels > 0 {
        start(&site, args).await?;
    }

    // Commits per second: the agent (Python children, compiled children) against the
    // in-process handler, `runs` times each, interleaved; medians.
    let secs = Duration::from_secs(args.seconds.max(1));
    let vias: Vec<Via> = args
        .via
        .iter()
        .map(|v| match v.as_str() {
            "python" => Ok(Via::Python),
            "compiled" => Ok(Via::Compiled),
            "compiled-tcp" => Ok(Via::CompiledTcp),
            "compiled-ping" => Ok(Via::CompiledPing),
            "in-process" => Ok(Via::InProcess),
            other => bail!(
                "--via {other}: want python, compiled, compiled-tcp, compiled-ping or in-process"
            ),
        })
        .collect::<Result<_>>()?;
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
        let fsyncs: Vec<f64> = fs.iter().filter_map(|f| f.fsync_ms).collect();
        let fsync_ms = (!fsyncs.is_empty()).then(|| super::median(fsyncs));
        if *via == Via::CompiledPing {
            eprintln!(
                "exec agent round trips, no commit ({}): {} channels, median {rate:.0}/s of runs [{}]; CPU per round trip: node {node_us:.0} µs, children {client_us:.0} µs",
                via.name(),
                args.commit_channels,
                runs.join(", ")
            );
            println!(
                "{}",
                json!({"bench": "exec-round-trips", "via": via.name(),
                       "channels": args.commit_channels, "runs": fs.len(),
                       "round_trips_per_s": rate.round(),
                       "node_cpu_us_per_round_trip": node_us.round(),
                       "child_cpu_us_per_round_trip": client_us.round()})
            );
        } else {
            let fsync = fsync_ms.map_or(String::new(), |ms| {
                format!("; etcd's WAL fsync {ms:.3} ms on average")
            });
            eprintln!(
                "exec commits ({}): {} channels, median {rate:.0}/s of runs [{}]; {per_txn:.1} commits per txn; CPU per commit: node {node_us:.0} µs, children {client_us:.0} µs{fsync}",
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
                       "child_cpu_us_per_commit": client_us.round(),
                       "etcd_wal_fsync_ms": fsync_ms.map(meter::round3)})
            );
        }
        // Not a timing: a via that did nothing at all has workers that did not run.
        if args.commit_channels > 0 && fs.iter().all(|f| f.commits_per_s <= 0.0) {
            bail!(
                "bench exec: nothing landed through {} in any run: its workers did not run (the node's log says why)",
                via.name()
            );
        }
        rates.push(rate);
    }
    let rate_of = |want: Via| vias.iter().position(|v| *v == want).map(|i| rates[i]);
    if let Some(ceiling) = rate_of(Via::CompiledPing) {
        // The ceiling is the compiled children's on the Unix socket: against those, and the
        // in-process path.
        for (via, rate) in vias.iter().zip(&rates) {
            if matches!(via, Via::Compiled | Via::InProcess) {
                eprintln!(
                    "{} commits / the agent's round-trip ceiling: {:.2}",
                    via.name(),
                    rate / ceiling.max(1.0)
                );
            }
        }
    }
    let fsyncs: Vec<f64> = all.iter().flatten().filter_map(|f| f.fsync_ms).collect();
    if !fsyncs.is_empty() && super::median(fsyncs.clone()) < NO_SYNC_MS {
        eprintln!(
            "note: etcd's WAL fsync took {:.3} ms on average: its data is on storage that syncs nothing (tmpfs?). In-process commits are bound by etcd's txns, so against this etcd they run faster than against any deployed one, and the agent, bound by CPU, does not; docs/BENCHMARKS.md judges the agent ÷ in-process ratio with etcd's data on a disk",
            super::median(fsyncs)
        );
    }
    if let Some(inproc) = rate_of(Via::InProcess) {
        for (via, rate) in vias.iter().zip(&rates) {
            if !matches!(via, Via::InProcess | Via::CompiledPing) {
                eprintln!(
                    "agent / in-process commit throughput ({}): {:.2}",
                    via.name(),
                    rate / inproc.max(1.0)
                );
            }
        }
    }
    Ok(())
}
