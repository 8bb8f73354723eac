//! `chanwatch bench checkpoint`: every channel's handler commits `(position, state)` through
//! [`ChannelContext::commit`] on a timer; how many commits land, how many txns the store spends
//! on them (the nodes' group commit), and the commit latency the handler sees.
//!
//! Owns: that workload (its handler, [`Committing`]) and what it reports. Must not: assert on
//! timings.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use async_trait::async_trait;
use chanwatch_core::{ChannelInfo, ChannelName, ChannelState, Keys, NodeId};
use chanwatch_node::{ChannelContext, ChannelHandler, CommitError};
use chanwatch_store::{EmbeddedStore, MetaStore, Txn, TxnOp};
use serde_json::json;
use tokio::task::JoinHandle;

use super::meter::{self, quantile, round3, CountingStore};
use super::{median, BenchCheckpointArgs, StoreKind};
use crate::inproc::InProc;

/// What the committing handlers count while `recording` is on.
#[derive(Default)]
struct Stats {
    recording: AtomicBool,
    landed: AtomicU64,
    unavailable: AtomicU64,
    fenced: AtomicU64,
    /// Latency of each commit (landed or not), in seconds.
    latency: Mutex<Vec<f64>>,
}

/// A handler whose channels only commit: a counter as the position and a small state, every
/// `every`, each channel on its own timer: offset by its name so they do not all fire at once,
/// or, `aligned`, all on the rounds `base + k x every`.
struct Committing {
    every: Duration,
    aligned: bool,
    base: tokio::time::Instant,
    stats: Arc<Stats>,
    runs: Mutex<HashMap<(NodeId, ChannelName), JoinHandle<()>>>,
}

impl Committing {
    fn runs(&self) -> std::sync::MutexGuard<'_, HashMap<(NodeId, ChannelName), JoinHandle<()>>> {
        self.runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[async_trait]
impl ChannelHandler for Committing {
    async fn load(&self, ctx: ChannelContext) -> Result<(), String> {
        let resumed = ctx.resume().await.map_err(|e| e.to_string())?;
        let mut n: u64 = resumed.and_then(|cp| cp.position.parse().ok()).unwrap_or(0);
        let every = self.every;
        let stats = self.stats.clone();
        let offset = if self.aligned {
            Duration::ZERO
        } else {
            let h = chanwatch_node::handler::consumer::payload_hash(
                ctx.info.channel.as_str().as_bytes(),
            );
            Duration::from_micros(h % every.as_micros().max(1) as u64)
        };
        // The next round after now.
        let since = tokio::time::Instant::now().saturating_duration_since(self.base);
        let rounds = since.as_micros() / every.as_micros().max(1) + 1;
        let first = self.base + every * u32::try_from(rounds).unwrap_or(u32::MAX) + offset;
        let key = (ctx.node, ctx.info.channel.clone());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(first, every);
            // Skip, not Delay: a late commit must not shift the channel off its rounds.
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tick.tick().await;
                n += 1;
                let t = Instant::now();
                let r = ctx.commit(n.to_string(), Some(json!({ "count": n }))).await;
                let took = t.elapsed().as_secs_f64();
                if !stats.recording.load(Ordering::Relaxed) {
                    if matches!(r, Err(CommitError::Fenced(_))) {
                        return;
                    }
                    continue;
                }
                let counter = match &r {
                    Ok(()) => &stats.landed,
                    Err(CommitError::Fenced(_)) => &stats.fenced,
                    Err(_) => &stats.unavailable,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                stats
                    .latency
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(took);
                if matches!(r, Err(CommitError::Fenced(_))) {
                    return;
                }
            }
        });
        if let Some(old) = self.runs().insert(key, task) {
            old.abort();
        }
        Ok(())
    }

    async fn release(&self, node: NodeId, info: &ChannelInfo) {
        if let Some(t) = self.runs().remove(&(node, info.channel.clone())) {
            t.abort();
        }
    }

    /// Nothing to stop: a paused node holds commits itself (they answer `Unavailable`).
    async fn pause(&self, _node: NodeId, _info: &ChannelInfo) {}

    async fn resume(&self, _node: NodeId, _info: &ChannelInfo) {}
}

/// One run's figures.
struct Figures {
    commits_per_sec: f64,
    node_txns_per_sec: f64,
    etcd_txns_per_sec: Option<f64>,
    p50_ms: f64,
    p99_ms: f64,
    not_landed: u64,
}

/// `chanwatch bench checkpoint`.
///
/// # Errors
/// Store errors, or a cluster that does not settle.
pub async fn run(args: &BenchCheckpointArgs) -> Result<()> {
    ensure!(args.nodes > 0, "--nodes must be at least 1");
    let rate = 1.0 / args.commit_every.as_secs_f64().max(1e-6);
    eprintln!(
        "bench checkpoint: {} channels over {} nodes, each committing every {:?} ({rate:.1}/s), {:?} measured, {} runs, store {:?}",
        args.channels, args.nodes, args.commit_every, args.duration, args.runs, args.store
    );
    let mut figures = Vec::new();
    let mut max_ops = 0;
    for run in 0..args.runs.max(1) {
        let (f, ops) = one_run(args, run).await?;
        max_ops = ops;
        eprintln!(
            "  run {run}: {:.0} commits/s landed, {:.0} node txns/s, etcd {} txns/s, latency p50 {:.1} ms p99 {:.1} ms, {} not landed",
            f.commits_per_sec,
            f.node_txns_per_sec,
            f.etcd_txns_per_sec.map_or("n/a".into(), |t| format!("{t:.0}")),
            f.p50_ms,
            f.p99_ms,
            f.not_landed
        );
        figures.push(f);
    }
    let med = |pick: fn(&Figures) -> f64| median(figures.iter().map(pick).collect());
    let commits = med(|f| f.commits_per_sec);
    let node_txns = med(|f| f.node_txns_per_sec);
    let etcd_txns =
        (args.store == StoreKind::Etcd).then(|| med(|f| f.etcd_txns_per_sec.unwrap_or(0.0)));
    // The target's yardstick (docs/BENCHMARKS.md): one txn per node per commit round.
    let per_round = args.nodes as f64 * rate;
    // What the store's limits allow at best: a node's commits of one round need
    // ceil(channels per node x 2 guards / (max ops - 1 for the session guard)) txns.
    let per_node = args.channels.div_ceil(args.nodes);
    let guard_slots = max_ops.saturating_sub(1).max(2);
    let floor = args.nodes as f64 * rate * (2 * per_node).div_ceil(guard_slots) as f64;
    let spent = etcd_txns.unwrap_or(node_txns);
    let line = json!({
        "bench": "checkpoint",
        "store": format!("{:?}", args.store).to_lowercase(),
        "machine": meter::machine(),
        "channels": args.channels,
        "nodes": args.nodes,
        "commit_every_ms": args.commit_every.as_millis() as u64,
        "aligned": args.aligned,
        "seconds_measured": args.duration.as_secs_f64(),
        "runs": figures.len(),
        "commits_per_sec_median": commits.round(),
        "commits_per_sec_offered": (args.channels as f64 * rate).round(),
        "node_txns_per_sec_median": node_txns.round(),
        "etcd_txns_per_sec_median": etcd_txns.map(f64::round),
        "txns_per_node_round": round3(spent / per_round),
        "txns_floor_per_sec": floor.round(),
        "txns_over_floor": round3(spent / floor.max(1e-9)),
        "commit_p50_ms_median": round3(med(|f| f.p50_ms)),
        "commit_p99_ms_median": round3(med(|f| f.p99_ms)),
        "not_landed_median": med(|f| f.not_landed as f64),
        "max_txn_ops": max_ops,
        "note": "txns_per_node_round = txns/s / (nodes x commit rate), target <= 2; the floor is what the store's max txn ops allow (2 guards per commit + the session guard); etcd txns include the coordinator's; the coordinator watches [{root}/, {root}/worker/): no checkpoints",
    });
    println!("{line}");
    eprintln!(
        "  median: {commits:.0} commits/s of {:.0} offered; txns/s {spent:.0} = {:.2} per node round (floor {floor:.0}/s: {:.2}x); p50 {:.1} ms p99 {:.1} ms",
        args.channels as f64 * rate,
        spent / per_round,
        spent / floor.max(1e-9),
        med(|f| f.p50_ms),
        med(|f| f.p99_ms),
    );
    Ok(())
}

async fn one_run(args: &BenchCheckpointArgs, run: usize) -> Result<(Figures, usize)> {
    let store: Arc<dyn MetaStore> = match args.store {
        StoreKind::Embedded => Arc::new(EmbeddedStore::new()),
        StoreKind::Etcd => args.etcd.connect().await?,
    };
    let max_ops = store.limits().max_txn_ops;
    let stats = Arc::new(Stats::default());
    let handler = Arc::new(Committing {
        every: args.commit_every,
        aligned: args.aligned,
        base: tokio::time::Instant::now(),
        stats: stats.clone(),
        runs: Mutex::default(),
    });
    let keys = Keys::new(format!("bench-cp-{}-{run}", std::process::id()))?;
    let c = InProc::start_on(
        store.clone(),
        keys,
        super::system::timings(),
        handler,
        "bench".into(),
    )?;
    let node_txns = Arc::new(AtomicU64::new(0));
    let mut procs = Vec::with_capacity(args.nodes);
    for _ in 0..args.nodes {
        let own = match args.store {
            StoreKind::Embedded => store.clone(),
            // Each node its own connection, as node processes have.
            StoreKind::Etcd => args.etcd.connect().await?,
        };
        procs.push(c.spawn_node_on(CountingStore::wrap(own, node_txns.clone())));
    }
    let mut ids = Vec::with_capacity(args.nodes);
    for p in &procs {
        ids.push(c.node_id(p).await?);
    }
    c.ready().await?;
    super::system::seed(&c, &ids, args.channels, ChannelState::ToWatch).await?;
    let deadline = Instant::now() + Duration::from_secs(600);
    while c.coord_metrics.channels_in(ChannelState::Watched) < args.channels as i64 {
        ensure!(
            Instant::now() < deadline,
            "not all channels Watched in 600 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Every timer running, then measure.
    tokio::time::sleep(args.commit_every * 3 + Duration::from_secs(1)).await;
    let etcd0 = match args.store {
        StoreKind::Etcd => Some(meter::etcd_txns(&args.etcd.endpoints).await?),
        StoreKind::Embedded => None,
    };
    let txns0 = node_txns.load(Ordering::Relaxed);
    stats.recording.store(true, Ordering::Relaxed);
    let t0 = Instant::now();
    tokio::time::sleep(args.duration).await;
    stats.recording.store(false, Ordering::Relaxed);
    let secs = t0.elapsed().as_secs_f64();
    let txns = node_txns.load(Ordering::Relaxed) - txns0;
    let etcd = match (args.store, etcd0) {
        (StoreKind::Etcd, Some(before)) => {
            Some((meter::etcd_txns(&args.etcd.endpoints).await? - before) / secs)
        }
        _ => None,
    };
    let mut lat = std::mem::take(
        &mut *stats
            .latency
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    lat.sort_by(f64::total_cmp);
    let figures = Figures {
        commits_per_sec: stats.landed.load(Ordering::Relaxed) as f64 / secs,
        node_txns_per_sec: txns as f64 / secs,
        etcd_txns_per_sec: etcd,
        p50_ms: quantile(&lat, 0.5) * 1e3,
        p99_ms: quantile(&lat, 0.99) * 1e3,
        not_landed: stats.unavailable.load(Ordering::Relaxed)
            + stats.fenced.load(Ordering::Relaxed),
    };
    let prefix = c.keys.all_prefix();
    for p in procs {
        p.stop().await;
    }
    c.shutdown().await;
    store
        .txn(Txn::new().and_then([TxnOp::delete_prefix(prefix)]))
        .await?;
    if args.store == StoreKind::Etcd {
        super::system::compact_history(store.as_ref()).await?;
    }
    Ok((figures, max_ops))
}
