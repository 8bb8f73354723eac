//! `chanwatch bench data-failover`: nodes run the stream consumer on every channel while a
//! producer appends at a steady rate; one node dies. Reports the time from its session loss
//! until every channel it held has a checkpoint committed by its new owner, and the messages
//! the new owners re-read (what the dead node had read past its last landed commit).
//!
//! A workload of its own rather than a `--data` mode of `bench failover`: that one measures
//! the control plane (assignments `Watched`, against a floor of txn round trips, with a handler
//! that does nothing); this one needs a log, a producer and the checkpoints, and its end is
//! a commit, not an ack.
//!
//! Owns: that workload and what it reports. Must not: assert on timings.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use chanwatch_core::{ChannelInfo, ChannelName, ChannelOwner, ChannelState, Checkpoint, Keys};
use chanwatch_node::handler::consumer::{ConsumerOptions, StreamConsumer, StreamState};
use chanwatch_node::ChannelHandler;
use chanwatch_store::{EmbeddedStore, EventKind, MetaStore, Txn, TxnOp};
use chanwatch_stream::Log;
use futures_util::StreamExt;
use serde_json::json;

use super::consume::{payload, Backend};
use super::meter::{self, quantile, round3};
use super::{median, BenchDataFailoverArgs, StoreKind};
use crate::inproc::InProc;

/// Appends `rate` messages/s round-robin over `names` (in 10 ms ticks) until `stop`.
fn producer(
    log: Arc<dyn Log>,
    names: Vec<String>,
    rate: u64,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Result<u64>> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut seqs = vec![0u64; names.len()];
        let (mut i, mut sent, mut owed) = (0usize, 0u64, 0f64);
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            owed += rate as f64 / 100.0;
            while owed >= 1.0 {
                owed -= 1.0;
                seqs[i] += 1;
                log.append(&names[i], payload(seqs[i], 64)).await?;
                sent += 1;
                i = (i + 1) % names.len();
            }
        }
        Ok(sent)
    })
}

/// One run's figures.
struct Figures {
    moved: usize,
    p50: f64,
    p99: f64,
    max: f64,
    started_p50: f64,
    started_max: f64,
    reread_total: u64,
    reread_max: u64,
    produced_per_sec: f64,
}

/// `chanwatch bench data-failover`.
///
/// # Errors
/// Store or log errors, or a failover that does not settle in 120 s.
pub async fn run(args: &BenchDataFailoverArgs) -> Result<()> {
    ensure!(
        args.nodes >= 2,
        "--nodes must be at least 2 (one is killed)"
    );
    eprintln!(
        "bench data-failover: {} channels over {} nodes (one killed), producer {} msgs/s, commit interval {:?}, {} runs, store {:?}, log {}",
        args.channels, args.nodes, args.rate, args.commit_interval, args.runs, args.store,
        args.log.as_deref().unwrap_or("file:(temp dir)")
    );
    let machine = meter::machine();
    let mut figures = Vec::new();
    let mut kind = "file";
    for run in 0..args.runs.max(1) {
        let backend = Backend::fresh(args.log.as_deref(), "dfail", run)?;
        kind = backend.kind();
        let result = one_run(args, &backend, run).await;
        backend.remove().await;
        let f = result?;
        eprintln!(
            "  run {run}: {} channels moved; running again on a live node: p50 {:.3} s, max {:.3} s; committed again by the new owner: p50 {:.3} s, p99 {:.3} s, max {:.3} s; re-read {} messages ({} at most for one channel); producer {:.0} msgs/s",
            f.moved, f.started_p50, f.started_max, f.p50, f.p99, f.max, f.reread_total, f.reread_max, f.produced_per_sec
        );
        figures.push(f);
    }
    let med = |pick: fn(&Figures) -> f64| median(figures.iter().map(pick).collect());
    println!(
        "{}",
        json!({
            "bench": "data-failover",
            "store": format!("{:?}", args.store).to_lowercase(),
            "log": kind,
            "machine": machine,
            "nodes": args.nodes,
            "channels": args.channels,
            "rate_msgs_per_sec": args.rate,
            "commit_interval_ms": args.commit_interval.as_millis() as u64,
            "runs": figures.len(),
            "moved_median": med(|f| f.moved as f64),
            "recommit_p50_s_median": round3(med(|f| f.p50)),
            "recommit_p99_s_median": round3(med(|f| f.p99)),
            "recommit_max_s_median": round3(med(|f| f.max)),
            "restarted_p50_s_median": round3(med(|f| f.started_p50)),
            "restarted_max_s_median": round3(med(|f| f.started_max)),
            "producer_msgs_per_sec_median": med(|f| f.produced_per_sec).round(),
            "reread_messages_median": med(|f| f.reread_total as f64),
            "reread_max_per_channel_median": med(|f| f.reread_max as f64),
            "note": "from the dead node's session loss (lease revoked) to each moved channel's first checkpoint landed by its new owner; a new run commits once it has folded a new message and its commit interval (or 100 messages) has passed, so at a low rate per channel this includes waiting for the channel's next message; restarted = until the channel's run started on a live node (polled every 5 ms). Re-read = the dead node's folded count at the kill minus the count in the checkpoint the new owner resumed from",
        })
    );
    Ok(())
}

async fn one_run(args: &BenchDataFailoverArgs, backend: &Backend, run: usize) -> Result<Figures> {
    let store: Arc<dyn MetaStore> = match args.store {
        StoreKind::Embedded => Arc::new(EmbeddedStore::new()),
        StoreKind::Etcd => args.etcd.connect().await?,
    };
    let consumer = Arc::new(StreamConsumer::new(
        backend.open().await?,
        ConsumerOptions {
            commit_interval: args.commit_interval,
            ..ConsumerOptions::default()
        },
    ));
    let keys = Keys::new(format!("bench-dfail-{}-{run}", std::process::id()))?;
    let c = InProc::start_on(
        store.clone(),
        keys.clone(),
        super::system::timings(),
        consumer.clone(),
        "bench".into(),
    )?;
    let mut procs = Vec::new();
    for _ in 0..args.nodes {
        procs.push(match args.store {
            StoreKind::Embedded => c.spawn_node(),
            StoreKind::Etcd => c.spawn_node_on(args.etcd.connect().await?),
        });
    }
    let mut ids = Vec::new();
    for p in &procs {
        ids.push(c.node_id(p).await?);
    }
    c.ready().await?;
    super::system::seed(&c, &ids, args.channels, ChannelState::ToWatch).await?;
    let deadline = Instant::now() + Duration::from_secs(300);
    while c.coord_metrics.channels_in(ChannelState::Watched) < args.channels as i64 {
        ensure!(
            Instant::now() < deadline,
            "not all channels Watched in 300 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let names: Vec<String> = (0..args.channels).map(|i| format!("ch{i:06}")).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let t_prod = Instant::now();
    let prod = producer(backend.open().await?, names, args.rate, stop.clone());
    tokio::time::sleep(args.warmup).await;

    // The victim's channels and the checkpoints their next owner resumes from.
    let victim = ids[0];
    let held: Vec<ChannelInfo> = store
        .range(&keys.owner_prefix(ChannelOwner::Node(victim)))
        .await?
        .kvs
        .iter()
        .filter_map(|kv| ChannelInfo::decode(&kv.value).ok())
        .collect();
    let lease = store
        .get(&keys.session(victim))
        .await?
        .and_then(|kv| kv.lease)
        .unwrap_or(0);
    // The crash: the victim's runs stop reading and committing at once (paused: a dead
    // process does neither), its node task dies without revoking its lease, and the lease
    // is revoked now (the TTL running out, without waiting for it).
    let mut last_read: HashMap<ChannelName, StreamState> = HashMap::new();
    for info in &held {
        consumer.pause(victim, info).await;
        if let Some((_, state)) = consumer.folded(victim, &info.channel) {
            last_read.insert(info.channel.clone(), state);
        }
    }
    procs.remove(0).kill();
    let before = store.range(&keys.checkpoints_prefix()).await?;
    let mut committed: HashMap<ChannelName, u64> = HashMap::new();
    for kv in &before.kvs {
        if let (Ok(ch), Ok(cp)) = (
            keys.parse_checkpoint(&kv.key),
            Checkpoint::decode(&kv.value),
        ) {
            let count = cp
                .state
                .as_ref()
                .and_then(|s| StreamState::from_json(s).ok())
                .map_or(0, |s| s.count);
            committed.insert(ch, count);
        }
    }
    let mut watch = store
        .watch(&keys.checkpoints_prefix(), before.revision + 1)
        .await?;
    let t0 = Instant::now();
    match store.revoke(lease).await {
        Ok(()) | Err(chanwatch_store::StoreError::LeaseNotFound(_)) => {}
        Err(e) => return Err(e.into()),
    }
    let mut waiting: std::collections::HashSet<ChannelName> =
        held.iter().map(|i| i.channel.clone()).collect();
    let mut took = Vec::with_capacity(waiting.len());
    // When each moved channel's run started on a live node (polled every 5 ms).
    let live: Vec<_> = ids[1..].to_vec();
    let mut not_started = waiting.clone();
    let mut started = Vec::with_capacity(waiting.len());
    let mut poll = tokio::time::interval(Duration::from_millis(5));
    while !waiting.is_empty() || !not_started.is_empty() {
        let left = Duration::from_secs(120).saturating_sub(t0.elapsed());
        let next = tokio::select! {
            b = tokio::time::timeout(left, watch.next()) => b,
            _ = poll.tick() => {
                let now = t0.elapsed().as_secs_f64();
                not_started.retain(|ch| {
                    let on = live.iter().any(|n| consumer.folded(*n, ch).is_some());
                    if on {
                        started.push(now);
                    }
                    !on
                });
                ensure!(t0.elapsed() < Duration::from_secs(120), "{} moved channels did not start on a live node within 120 s", not_started.len());
                continue;
            }
        };
        let Ok(Some(batch)) = next else {
            anyhow::bail!(
                "{} moved channels had no commit by a new owner within 120 s",
                waiting.len()
            );
        };
        let batch = batch?;
        let now = t0.elapsed().as_secs_f64();
        for ev in batch.events {
            if ev.kind != EventKind::Put {
                continue;
            }
            if let Ok(ch) = keys.parse_checkpoint(&ev.kv.key) {
                // The victim's runs are paused, so every commit now is a new owner's.
                if waiting.remove(&ch) {
                    took.push(now);
                }
            }
        }
    }
    drop(watch);
    stop.store(true, Ordering::Relaxed);
    let produced = prod.await??;
    let produced_per_sec = produced as f64 / t_prod.elapsed().as_secs_f64();
    let mut reread = Vec::new();
    for info in &held {
        let read = last_read.get(&info.channel).map_or(0, |s| s.count);
        let landed = committed.get(&info.channel).copied().unwrap_or(0);
        reread.push(read.saturating_sub(landed));
    }
    took.sort_by(f64::total_cmp);
    started.sort_by(f64::total_cmp);
    // Teardown: the victim's paused runs end; the rest stop.
    for info in &held {
        consumer.release(victim, info).await;
    }
    for p in procs {
        p.stop().await;
    }
    c.shutdown().await;
    store
        .txn(Txn::new().and_then([TxnOp::delete_prefix(keys.all_prefix())]))
        .await?;
    Ok(Figures {
        moved: held.len(),
        p50: quantile(&took, 0.5),
        p99: quantile(&took, 0.99),
        max: quantile(&took, 1.0),
        started_p50: quantile(&started, 0.5),
        started_max: quantile(&started, 1.0),
        reread_total: reread.iter().sum(),
        reread_max: reread.iter().copied().max().unwrap_or(0),
        produced_per_sec,
    })
}
