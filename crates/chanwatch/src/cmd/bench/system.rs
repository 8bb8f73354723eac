//! `chanwatch bench assign|balance|ack`: whole-system benchmarks on an in-process cluster
//! (coordinator + node tasks) over the embedded store or a real etcd (`bench planner`, the
//! planner alone, is in `planner`).
//!
//! Owns: the workloads and what they report. Must not: assert on timings.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use chanwatch_core::{
    ChannelInfo, ChannelName, ChannelOwner, ChannelState, Epoch, Keys, NodeId, VChannelInfo,
};
use chanwatch_node::SimulatedLoad;
use chanwatch_store::{EmbeddedStore, EventKind, MetaStore, Txn, TxnOp};
use futures_util::StreamExt;
use serde_json::{json, Value};

use super::{median, BenchAckArgs, BenchAssignArgs, BenchBalanceArgs, StoreKind};
use crate::flags::EtcdArgs;
use crate::inproc::{InProc, NodeProc, Timings};

pub(crate) use super::meter::{cpu_secs, round3, rss_bytes};

/// Cores and, for etcd, the local `etcd --version` line.
pub(crate) fn machine(store: StoreKind) -> Value {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let etcd = (store == StoreKind::Etcd).then(|| {
        std::process::Command::new("etcd")
            .arg("--version")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.lines().next().map(str::to_owned))
            .unwrap_or_else(|| "unknown".into())
    });
    json!({ "cores": cores, "etcd": etcd })
}

pub(crate) async fn open(store: StoreKind, etcd: &EtcdArgs) -> Result<Arc<dyn MetaStore>> {
    Ok(match store {
        StoreKind::Embedded => Arc::new(EmbeddedStore::new()),
        StoreKind::Etcd => etcd.connect().await?,
    })
}

pub(crate) fn timings() -> Timings {
    Timings {
        session_ttl: Duration::from_secs(10),
        watch_timeout: Duration::from_secs(120),
        resync_interval: Duration::from_secs(60),
        tick: Duration::from_millis(100),
        progress_interval: Duration::from_secs(5),
    }
}

/// Compacts the store's history up to now (physically, so the work is done before the
/// measurement starts), as `--auto-compaction-retention` would: on etcd 3.4 the history that
/// one setup leaves (tens of thousands of revisions) made the next measurement 3–5× slower
/// (kill-10 failover: 0.31–0.49 s right after a compaction, 1.5–2 s without). Compaction
/// is global to an etcd: point the etcd benches only at an etcd of your own.
pub(crate) async fn compact_history(store: &dyn MetaStore) -> Result<()> {
    let now = store.range("\0").await?.revision;
    store.compact(now).await?;
    Ok(())
}

/// A cluster on its own root so runs never see each other's keys.
async fn cluster(
    store: Arc<dyn MetaStore>,
    run: usize,
    nodes: usize,
) -> Result<(InProc, Vec<NodeProc>, Vec<NodeId>)> {
    cluster_with(store, run, nodes, timings()).await
}

/// [`cluster`] with timings of its own.
pub(crate) async fn cluster_with(
    store: Arc<dyn MetaStore>,
    run: usize,
    nodes: usize,
    timings: Timings,
) -> Result<(InProc, Vec<NodeProc>, Vec<NodeId>)> {
    let keys = Keys::new(format!("bench-{}-{run}", std::process::id()))?;
    let c = InProc::start_on(
        store,
        keys,
        timings,
        Arc::new(SimulatedLoad::default()),
        "bench".into(),
    )?;
    let procs: Vec<NodeProc> = (0..nodes).map(|_| c.spawn_node()).collect();
    let mut ids = Vec::with_capacity(nodes);
    for p in &procs {
        ids.push(c.node_id(p).await?);
    }
    c.ready().await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if c.handle.nodes().await.map(|n| n.len()).unwrap_or(0) == nodes {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the coordinator never saw all {nodes} nodes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok((c, procs, ids))
}

pub(crate) async fn teardown(c: InProc, procs: Vec<NodeProc>) -> Result<()> {
    let store = c.store.clone();
    let prefix = c.keys.all_prefix();
    for p in procs {
        p.stop().await;
    }
    c.shutdown().await;
    store
        .txn(Txn::new().and_then([TxnOp::delete_prefix(prefix)]))
        .await?;
    Ok(())
}

/// Put operations for `channels` assignments in `state`, spread round-robin over `owners`.
pub(crate) fn seed_ops(
    keys: &Keys,
    owners: &[NodeId],
    channels: usize,
    now_ms: u64,
    state: ChannelState,
) -> Result<Vec<TxnOp>> {
    let mut ops = Vec::with_capacity(channels);
    for i in 0..channels {
        let owner = ChannelOwner::Node(owners[i % owners.len()]);
        let name = ChannelName::new(format!("ch{i:06}"))?;
        let mut info = ChannelInfo::new(name.clone(), Epoch(1), now_ms, VChannelInfo::default());
        info.state = state;
        ops.push(TxnOp::put(keys.channel(owner, &name), info.encode()));
    }
    Ok(ops)
}

/// Puts assignments straight into the store in big txns (set-up, not measured).
pub(crate) async fn seed(
    c: &InProc,
    owners: &[NodeId],
    channels: usize,
    state: ChannelState,
) -> Result<Vec<i64>> {
    let ops = seed_ops(&c.keys, owners, channels, c.clock.unix_ms(), state)?;
    let mut revs = Vec::new();
    for chunk in ops.chunks(c.store.limits().max_txn_ops) {
        revs.push(
            c.store
                .txn(Txn::new().and_then(chunk.to_vec()))
                .await?
                .revision,
        );
        // The embedded store answers at once: without a yield, 7,813 txns (1,000,000
        // channels) would hold this worker from the nodes' keepalives until the last one.
        tokio::task::yield_now().await;
    }
    Ok(revs)
}

/// [`seed`] in steps of `step` channels, each waiting until the coordinator counts the
/// channels seeded so far in `state` and the nodes run them (set-up, not measured). At
/// 1,000,000 channels on a shared 2-core machine the burst at once (7,813 txns) left the
/// coordinator's and the nodes' watches seconds behind their keepalives' revisions: they
/// paused, relisted and lost their leases, and the set-up never settled.
pub(crate) async fn seed_paced(
    c: &InProc,
    owners: &[NodeId],
    channels: usize,
    state: ChannelState,
    step: usize,
) -> Result<()> {
    let ops = seed_ops(&c.keys, owners, channels, c.clock.unix_ms(), state)?;
    let max_ops = c.store.limits().max_txn_ops;
    let mut done = 0;
    for part in ops.chunks(step.max(max_ops)) {
        for chunk in part.chunks(max_ops) {
            c.store.txn(Txn::new().and_then(chunk.to_vec())).await?;
            tokio::task::yield_now().await;
        }
        done += part.len();
        let deadline = Instant::now() + Duration::from_secs(120);
        while c.coord_metrics.channels_in(state) < done as i64
            || c.node_metrics.running.get() < done as i64
        {
            ensure!(
                Instant::now() < deadline,
                "set-up: {done} channels seeded, but after 120 s the coordinator counts {} {state:?} and the nodes run {}",
                c.coord_metrics.channels_in(state),
                c.node_metrics.running.get()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    Ok(())
}

/// Waits until the coordinator counts `n` channels Watched.
pub(crate) async fn until_watched(c: &InProc, n: usize, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    while c.coord_metrics.channels_in(ChannelState::Watched) < n as i64 {
        ensure!(
            Instant::now() < deadline,
            "not all {n} channels Watched within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// `chanwatch bench assign`.
///
/// # Errors
/// Store errors or a run that does not settle.
pub async fn assign(args: &BenchAssignArgs) -> Result<()> {
    let mut secs = Vec::new();
    let mut rss = Vec::new();
    let mut cpu = Vec::new();
    eprintln!(
        "bench assign: {} channels over {} nodes, {} runs, {:?}",
        args.channels, args.nodes, args.runs, args.store
    );
    for run in 0..args.runs.max(1) {
        let store = open(args.store, &args.etcd).await?;
        let (c, procs, _) = cluster(store, run, args.nodes).await?;
        let rss0 = rss_bytes();
        let cpu0 = cpu_secs();
        let t0 = Instant::now();
        // Several clients at once, as operators or an API gateway would; the leader
        // serialises them.
        let clients = 16;
        let mut tasks = Vec::new();
        for k in 0..clients {
            let handle = c.handle.clone();
            let n = args.channels;
            tasks.push(tokio::spawn(async move {
                for i in (k..n).step_by(clients) {
                    let name = ChannelName::new(format!("ch{i:06}"))?;
                    handle
                        .add_channel(name, VChannelInfo::default())
                        .await
                        .map_err(|e| anyhow::anyhow!("add_channel: {e}"))?;
                }
                anyhow::Ok(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        until_watched(&c, args.channels, Duration::from_secs(600)).await?;
        let took = t0.elapsed().as_secs_f64();
        let rss_per = rss_bytes().saturating_sub(rss0) as f64 / args.channels as f64;
        let cpu_per = (cpu_secs() - cpu0) * 1e6 / args.channels as f64;
        eprintln!(
            "  run {run}: {took:.2} s, {rss_per:.0} B RSS/channel, {cpu_per:.1} CPU us/channel"
        );
        secs.push(took);
        rss.push(rss_per);
        cpu.push(cpu_per);
        teardown(c, procs).await?;
    }
    println!(
        "{}",
        json!({
            "bench": "assign", "store": format!("{:?}", args.store).to_lowercase(),
            "machine": machine(args.store), "channels": args.channels, "nodes": args.nodes,
            "runs": secs.len(), "seconds_median": round3(median(secs.clone())),
            "channels_per_sec_median": (args.channels as f64 / median(secs)).round(),
            "rss_bytes_per_channel_median": median(rss).round(),
            "cpu_us_per_channel_median": round3(median(cpu)),
            "note": "RSS and CPU are the whole process: coordinator, nodes and (embedded) store",
        })
    );
    Ok(())
}

/// The fewest moves that reach max - min <= 1 from `counts` (old nodes) plus `join` empty
/// nodes: every node ends at floor or ceil of the mean; the fullest old nodes keep the ceil.
fn minimum_moves(counts: &[usize], join: usize) -> usize {
    let total: usize = counts.iter().sum();
    let nodes = counts.len() + join;
    let (base, extra) = (total / nodes, total % nodes);
    let mut sorted = counts.to_vec();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    sorted
        .iter()
        .enumerate()
        .map(|(i, c)| c.saturating_sub(base + usize::from(i < extra)))
        .sum()
}

/// `chanwatch bench balance`.
///
/// # Errors
/// Store errors or a run that does not settle.
pub async fn balance(args: &BenchBalanceArgs) -> Result<()> {
    let mut secs = Vec::new();
    let mut moves = Vec::new();
    let mut peaks = Vec::new();
    let mut minimum = 0;
    eprintln!(
        "bench balance: {} nodes with {} channels, {} join, {} runs, {:?}",
        args.nodes, args.channels, args.join, args.runs, args.store
    );
    for run in 0..args.runs.max(1) {
        let store = open(args.store, &args.etcd).await?;
        let (mut c, mut procs, ids) = cluster(store.clone(), run, args.nodes).await?;
        let _ = &mut c;
        seed(&c, &ids, args.channels, ChannelState::ToWatch).await?;
        until_watched(&c, args.channels, Duration::from_secs(600)).await?;
        let counts: Vec<usize> = c
            .handle
            .nodes()
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .iter()
            .map(|n| n.channels)
            .collect();
        minimum = minimum_moves(&counts, args.join);
        let before = c.coord_metrics.reassignments_of("balance");
        compact_history(store.as_ref()).await?;
        let t0 = Instant::now();
        for _ in 0..args.join {
            procs.push(c.spawn_node());
        }
        let mut peak = 0;
        let deadline = t0 + Duration::from_secs(600);
        loop {
            peak = peak.max(c.coord_metrics.moves_in_flight());
            let nodes = c.handle.nodes().await.map_err(|e| anyhow::anyhow!("{e}"))?;
            let (min, max) = nodes.iter().fold((usize::MAX, 0), |(lo, hi), n| {
                (lo.min(n.channels), hi.max(n.channels))
            });
            if nodes.len() == args.nodes + args.join
                && max <= min + 1
                && c.coord_metrics.moves_in_flight() == 0
                && c.coord_metrics.channels_in(ChannelState::Watched) == args.channels as i64
            {
                break;
            }
            ensure!(Instant::now() < deadline, "balance did not settle in 600 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let took = t0.elapsed().as_secs_f64();
        let made = c.coord_metrics.reassignments_of("balance") - before;
        let causes: Vec<(String, u64)> = [
            "assign", "failover", "park", "unpark", "timeout", "failed", "balance", "drain",
            "manual", "remove", "dedupe",
        ]
        .iter()
        .map(|k| (k.to_string(), c.coord_metrics.reassignments_of(k)))
        .filter(|(_, n)| *n > 0)
        .collect();
        eprintln!("  reassignments by cause: {causes:?}");
        eprintln!("  run {run}: balanced in {took:.2} s, {made} moves (minimum {minimum}), peak {peak} in flight");
        secs.push(took);
        moves.push(made as f64);
        peaks.push(peak as f64);
        teardown(c, procs).await?;
    }
    println!(
        "{}",
        json!({
            "bench": "balance", "store": format!("{:?}", args.store).to_lowercase(),
            "machine": machine(args.store), "nodes": args.nodes, "channels": args.channels,
            "join": args.join, "max_concurrent_moves": args.max_concurrent_moves,
            "runs": secs.len(), "seconds_median": round3(median(secs)),
            "moves_median": median(moves), "moves_minimum": minimum,
            "peak_moves_in_flight_median": median(peaks),
        })
    );
    Ok(())
}

/// `chanwatch bench ack`: commits `channels` ToWatch assignments at once (in 128-op txns)
/// and times, per channel, from its txn's commit to its Watched ack seen by a watcher.
///
/// # Errors
/// Store errors or a run that does not settle.
pub async fn ack(args: &BenchAckArgs) -> Result<()> {
    let mut p50s = Vec::new();
    let mut p99s = Vec::new();
    let mut maxes = Vec::new();
    let mut rtts = Vec::new();
    eprintln!(
        "bench ack: {} assignments over {} nodes, {} runs, {:?}",
        args.channels, args.nodes, args.runs, args.store
    );
    for run in 0..args.runs.max(1) {
        let store = open(args.store, &args.etcd).await?;
        let (c, procs, ids) = cluster(store.clone(), run, args.nodes).await?;
        // One txn round trip, for the ratio the targets use.
        let mut rtt = Vec::new();
        for i in 0..20 {
            let t = Instant::now();
            store
                .txn(Txn::new().and_then([TxnOp::put(
                    format!("{}rtt", c.keys.all_prefix()),
                    i.to_string(),
                )]))
                .await?;
            rtt.push(t.elapsed().as_secs_f64());
        }
        compact_history(store.as_ref()).await?;
        let start_rev = store.range("\0").await?.revision;
        let mut watch = store
            .watch(&c.keys.channels_prefix(), start_rev + 1)
            .await?;
        let t0 = Instant::now();
        let ops = seed_ops(
            &c.keys,
            &ids,
            args.channels,
            c.clock.unix_ms(),
            ChannelState::ToWatch,
        )?;
        // The assignments are written by another task while this one reads the watch, so
        // that every event is stamped when it arrives (reading only after the writes made
        // the first figures of this bench measure the bench itself).
        let max_ops = store.limits().max_txn_ops;
        let writer_store = store.clone();
        let writer = tokio::spawn(async move {
            for chunk in ops.chunks(max_ops) {
                writer_store
                    .txn(Txn::new().and_then(chunk.to_vec()))
                    .await?;
            }
            anyhow::Ok(())
        });
        // When each assignment's PUT was seen.
        let mut seen: BTreeMap<String, Instant> = BTreeMap::new();
        let mut lat = Vec::with_capacity(args.channels);
        let deadline = t0 + Duration::from_secs(300);
        while lat.len() < args.channels {
            let left = deadline.saturating_duration_since(Instant::now());
            let batch = tokio::time::timeout(left, watch.next()).await;
            let Ok(Some(Ok(batch))) = batch else {
                anyhow::bail!(
                    "acks did not all arrive within 300 s ({} of {})",
                    lat.len(),
                    args.channels
                );
            };
            let now = Instant::now();
            for ev in batch.events {
                if ev.kind != EventKind::Put {
                    continue;
                }
                let Ok(info) = ChannelInfo::decode(&ev.kv.value) else {
                    continue;
                };
                if info.state == ChannelState::ToWatch {
                    seen.insert(ev.kv.key.clone(), now);
                } else if info.state == ChannelState::Watched {
                    if let Some(at) = seen.get(&ev.kv.key) {
                        lat.push(now.saturating_duration_since(*at).as_secs_f64());
                    }
                }
            }
        }
        writer.await??;
        lat.sort_by(f64::total_cmp);
        let pick = |q: f64| lat[((lat.len() as f64 - 1.0) * q).round() as usize];
        let rtt_med = median(rtt);
        eprintln!(
            "  run {run}: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms, one txn {:.3} ms",
            pick(0.5) * 1e3,
            pick(0.99) * 1e3,
            pick(1.0) * 1e3,
            rtt_med * 1e3
        );
        p50s.push(pick(0.5));
        p99s.push(pick(0.99));
        maxes.push(pick(1.0));
        rtts.push(rtt_med);
        drop(watch);
        teardown(c, procs).await?;
    }
    let rtt = median(rtts);
    let p99 = median(p99s);
    println!(
        "{}",
        json!({
            "bench": "ack", "store": format!("{:?}", args.store).to_lowercase(),
            "machine": machine(args.store), "nodes": args.nodes, "channels": args.channels,
            "runs": maxes.len(),
            "p50_ms_median": round3(median(p50s) * 1e3), "p99_ms_median": round3(p99 * 1e3),
            "max_ms_median": round3(median(maxes) * 1e3), "txn_rtt_ms_median": round3(rtt * 1e3),
            "p99_over_rtt": round3(p99 / rtt.max(1e-9)),
        })
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::minimum_moves;

    #[test]
    fn minimum_moves_fill_the_new_nodes_to_the_mean() {
        // 100 nodes x 100 channels, 10 join: 10000 / 110 = 90 rem 100.
        assert_eq!(minimum_moves(&[100; 100], 10), 100 * 100 - (100 * 91));
        assert_eq!(minimum_moves(&[11, 10], 1), 7); // 21 over 3 = 7 each: 4 + 3 move
        assert_eq!(minimum_moves(&[3, 3, 3], 0), 0);
    }
}
