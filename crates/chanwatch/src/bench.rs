//! `chanwatch bench`: whole-system benchmarks that print one JSON line per result.
//!
//! Owns: workload loops and the arithmetic of medians and percentiles.
//! Must not: assert on timings (benchmarks report; they never fail for being slow).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use chanwatch_store::{Compare, MetaStore, Txn, TxnOp};
use serde_json::json;

use crate::cli::{BenchStoreArgs, StoreKind};

/// Latency summary of one run.
struct Run {
    per_sec: f64,
    p50: Duration,
    p99: Duration,
}

fn summarize(mut lat: Vec<Duration>, elapsed: Duration, units: usize) -> Run {
    lat.sort_unstable();
    let pick = |q: f64| {
        let idx = ((lat.len() as f64 - 1.0) * q).round() as usize;
        lat.get(idx).copied().unwrap_or_default()
    };
    Run {
        per_sec: units as f64 / elapsed.as_secs_f64().max(1e-9),
        p50: pick(0.50),
        p99: pick(0.99),
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}

/// Serial single-key compare-and-swap txns: the latency floor of one coordinator decision.
async fn cas_serial(store: &dyn MetaStore, key: &str, n: usize) -> Result<Run> {
    let mut rev = store
        .txn(Txn::new().and_then([TxnOp::put(key, "0")]))
        .await?
        .revision;
    let mut lat = Vec::with_capacity(n);
    let start = Instant::now();
    for i in 0..n {
        let t = Instant::now();
        let resp = store
            .txn(
                Txn::new()
                    .when([Compare::mod_revision(key, rev)])
                    .and_then([TxnOp::put(key, i.to_string())]),
            )
            .await?;
        ensure!(
            resp.succeeded,
            "uncontended CAS failed: the store lost a write"
        );
        rev = resp.revision;
        lat.push(t.elapsed());
    }
    Ok(summarize(lat, start.elapsed(), n))
}

/// CAS txns from `tasks` concurrent tasks, each on its own key (no contention).
async fn cas_concurrent(store: Arc<dyn MetaStore>, n: usize, tasks: usize) -> Result<Run> {
    let per_task = n.div_ceil(tasks.max(1));
    let start = Instant::now();
    let mut handles = Vec::new();
    for t in 0..tasks.max(1) {
        let store = store.clone();
        handles.push(tokio::spawn(async move {
            let key = format!("bench/cas/{t}");
            let r = cas_serial(&*store, &key, per_task).await?;
            anyhow::Ok(r)
        }));
    }
    let mut p50s = Vec::new();
    let mut p99s = Vec::new();
    for h in handles {
        let r = h.await??;
        p50s.push(r.p50.as_secs_f64());
        p99s.push(r.p99.as_secs_f64());
    }
    let elapsed = start.elapsed();
    Ok(Run {
        per_sec: (per_task * tasks.max(1)) as f64 / elapsed.as_secs_f64().max(1e-9),
        p50: Duration::from_secs_f64(median(p50s)),
        p99: Duration::from_secs_f64(p99s.into_iter().fold(0.0, f64::max)),
    })
}

/// Txns of `ops` puts each, like a batch of channel moves.
async fn batched(store: &dyn MetaStore, txns: usize, ops: usize) -> Result<Run> {
    let value = vec![b'v'; 200];
    let mut lat = Vec::with_capacity(txns);
    let start = Instant::now();
    for i in 0..txns {
        let batch: Vec<TxnOp> = (0..ops)
            .map(|j| {
                TxnOp::put(
                    format!("bench/batch/{}", (i * ops + j) % 10_000),
                    value.clone(),
                )
            })
            .collect();
        let t = Instant::now();
        store.txn(Txn::new().and_then(batch)).await?;
        lat.push(t.elapsed());
    }
    Ok(summarize(lat, start.elapsed(), txns))
}

/// `chanwatch bench store`.
///
/// # Errors
/// Store errors during the run.
pub async fn store(store: Arc<dyn MetaStore>, args: &BenchStoreArgs) -> Result<()> {
    let default_txns = match args.store {
        StoreKind::Embedded => 200_000,
        StoreKind::Etcd => 2_000,
    };
    let txns = args.txns.unwrap_or(default_txns).max(1);
    // A batch txn costs about as much as 40-100 single ones; keep the run times comparable.
    let batch_txns = (txns / 40).max(10);
    let runs = args.runs.max(1);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    eprintln!(
        "bench store: backend {}, {cores} cores, {runs} runs, {txns} CAS txns, {batch_txns} txns of {} ops",
        store.describe(),
        args.batch_ops
    );
    let cases: [(&str, usize); 3] = [
        ("cas_serial", txns),
        ("cas_concurrent", txns),
        ("batch", batch_txns),
    ];
    for (case, n) in cases {
        let mut rates = Vec::new();
        let mut p50 = Vec::new();
        let mut p99 = Vec::new();
        for _ in 0..runs {
            let r = match case {
                "cas_serial" => cas_serial(&*store, "bench/serial", n).await?,
                "cas_concurrent" => cas_concurrent(store.clone(), n, args.concurrency).await?,
                _ => batched(&*store, n, args.batch_ops).await?,
            };
            rates.push(r.per_sec);
            p50.push(r.p50.as_secs_f64() * 1e6);
            p99.push(r.p99.as_secs_f64() * 1e6);
        }
        let line = json!({
            "bench": "store",
            "case": case,
            "store": store.describe(),
            "cores": cores,
            "runs": runs,
            "txns_per_run": n,
            "ops_per_txn": if case == "batch" { args.batch_ops } else { 1 },
            "concurrency": if case == "cas_concurrent" { args.concurrency } else { 1 },
            "txns_per_sec_median": median(rates.clone()).round(),
            "p50_us_median": (median(p50) * 10.0).round() / 10.0,
            "p99_us_median": (median(p99) * 10.0).round() / 10.0,
        });
        println!("{line}");
        eprintln!(
            "  {case:<15} {:>12.0} txn/s   p50 {:>9.1} us   p99 {:>9.1} us",
            line["txns_per_sec_median"].as_f64().unwrap_or(0.0),
            line["p50_us_median"].as_f64().unwrap_or(0.0),
            line["p99_us_median"].as_f64().unwrap_or(0.0),
        );
    }
    Ok(())
}

/// `chanwatch bench failover`: in-process coordinator and nodes over the chosen store; kill
/// nodes by revoking their leases (the instant of session loss), then time until every channel
/// they held is `Watched` on a live node.
///
/// # Errors
/// Store errors, or a run that does not settle within 120 s.
pub async fn failover(args: &crate::cli::BenchFailoverArgs) -> Result<()> {
    use chanwatch_coord::{CoordHandle, CoordinatorConfig};
    use chanwatch_core::{
        ChannelInfo, ChannelName, ChannelOwner, ChannelState, Epoch, Keys, NodeId,
    };
    use chanwatch_node::{NodeConfig, NodeStatus, SimulatedLoad};
    use chanwatch_store::{Clock, EmbeddedStore};
    use std::collections::BTreeMap;
    use tokio::sync::watch;

    ensure!(
        args.kill < args.nodes,
        "--kill must leave at least one node alive"
    );
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut seconds = Vec::new();
    let mut moved_counts = Vec::new();
    eprintln!(
        "bench failover: {} nodes, {} channels, kill {}, {} runs, store {:?}",
        args.nodes, args.channels, args.kill, args.runs, args.store
    );
    for run in 0..args.runs.max(1) {
        let store: Arc<dyn MetaStore> = match args.store {
            StoreKind::Embedded => Arc::new(EmbeddedStore::new()),
            StoreKind::Etcd => args.etcd.connect().await?,
        };
        let keys = Keys::new(format!("bench-{}-{run}", std::process::id()))?;
        let clock = Clock::system();
        let (handle, requests, status_tx) = CoordHandle::new();
        let (stop_tx, stop_rx) = watch::channel(false);
        let wait_stop = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|v| *v).await;
        };
        let coord_cfg = CoordinatorConfig {
            keys: keys.clone(),
            tick: Duration::from_millis(100),
            reconcile_interval: Duration::from_secs(30),
            ..CoordinatorConfig::default()
        };
        let coord = tokio::spawn(chanwatch_coord::run(
            store.clone(),
            coord_cfg,
            clock,
            requests,
            status_tx,
            wait_stop(stop_rx.clone()),
        ));
        let mut nodes = Vec::new();
        for _ in 0..args.nodes {
            let (tx, rx) = watch::channel(NodeStatus::default());
            let cfg = NodeConfig {
                keys: keys.clone(),
                ..NodeConfig::default()
            };
            let task = tokio::spawn(chanwatch_node::run(
                store.clone(),
                Arc::new(SimulatedLoad::default()),
                cfg,
                clock,
                tx,
                wait_stop(stop_rx.clone()),
            ));
            nodes.push((task, rx));
        }
        let mut ids = Vec::new();
        for (_, rx) in &mut nodes {
            let s = rx.wait_for(|s| s.id.is_some()).await?;
            ids.push(s.id.unwrap_or(NodeId(0)));
        }
        let mut status = handle.watch_status();
        status.wait_for(|s| s.ready).await?;
        // Seed assignments directly in big txns (setup, not measured).
        let mut ops = Vec::new();
        for i in 0..args.channels {
            let owner = ChannelOwner::Node(ids[i % ids.len()]);
            let name = ChannelName::new(format!("ch{i:06}"))?;
            let info =
                ChannelInfo::new(name.clone(), Epoch(1), clock.unix_ms(), Default::default());
            ops.push(TxnOp::put(keys.channel(owner, &name), info.encode()));
        }
        for chunk in ops.chunks(store.limits().max_txn_ops) {
            store.txn(Txn::new().and_then(chunk.to_vec())).await?;
        }
        let prefix = keys.channels_prefix();
        let all_watched = |kvs: &[chanwatch_store::KeyValue], live: &[NodeId]| -> usize {
            kvs.iter()
                .filter(|kv| {
                    let owner_ok = keys.parse_channel(&kv.key).is_ok_and(
                        |ck| matches!(ck.owner, ChannelOwner::Node(n) if live.contains(&n)),
                    );
                    owner_ok
                        && ChannelInfo::decode(&kv.value)
                            .is_ok_and(|i| i.state == ChannelState::Watched)
                })
                .count()
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while all_watched(&store.range(&prefix).await?.kvs, &ids) < args.channels {
            ensure!(Instant::now() < deadline, "setup did not settle");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Kill: abort the node tasks, then revoke their leases (= session loss, now).
        let victims: Vec<NodeId> = ids[..args.kill].to_vec();
        let mut leases = BTreeMap::new();
        for v in &victims {
            if let Some(kv) = store.get(&keys.session(*v)).await? {
                leases.insert(*v, kv.lease.unwrap_or(0));
            }
        }
        for (task, _) in nodes.drain(..args.kill) {
            task.abort();
        }
        let live: Vec<NodeId> = ids[args.kill..].to_vec();
        let moved = args.channels / args.nodes * args.kill;
        let t0 = Instant::now();
        for lease in leases.values() {
            store.revoke(*lease).await?;
        }
        loop {
            let list = store.range(&prefix).await?;
            if all_watched(&list.kvs, &live) == args.channels {
                break;
            }
            ensure!(
                t0.elapsed() < Duration::from_secs(120),
                "failover did not settle in 120 s"
            );
            // Polling costs etcd a full range; 10 ms keeps the probe from slowing the system.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let took = t0.elapsed();
        seconds.push(took.as_secs_f64());
        moved_counts.push(moved);
        eprintln!(
            "  run {run}: {moved} channels moved and Watched in {:.3} s",
            took.as_secs_f64()
        );
        let _ = stop_tx.send(true);
        let _ = coord.await;
        for (task, _) in nodes {
            let _ = task.await;
        }
        store
            .txn(Txn::new().and_then([TxnOp::delete_prefix(keys.all_prefix())]))
            .await?;
    }
    let line = json!({
        "bench": "failover",
        "store": format!("{:?}", args.store).to_lowercase(),
        "cores": cores,
        "nodes": args.nodes,
        "channels": args.channels,
        "killed": args.kill,
        "moved": moved_counts.first().copied().unwrap_or(0),
        "runs": seconds.len(),
        "seconds_median": (median(seconds.clone()) * 1000.0).round() / 1000.0,
        "seconds_min": (seconds.iter().copied().fold(f64::MAX, f64::min) * 1000.0).round() / 1000.0,
        "seconds_max": (seconds.iter().copied().fold(0.0, f64::max) * 1000.0).round() / 1000.0,
    });
    println!("{line}");
    Ok(())
}
