//! `chanwatch bench failover`: an in-process cluster loses nodes at once; the time from session
//! loss to every moved channel `Watched`, against the floor the store allows.
//!
//! Owns: that workload and what it reports. Must not: assert on timings.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use chanwatch_store::{MetaStore, Txn, TxnOp};
use serde_json::json;

use super::{median, BenchFailoverArgs, StoreKind};

/// `chanwatch bench failover`: in-process coordinator and nodes over the chosen store; kill
/// nodes by revoking their leases (the instant of session loss), then time until every channel
/// they held is `Watched` on a live node. Also reports the coordinator's txns and the floor:
/// ceil(moved ops / max_txn_ops) x one 128-op txn + one ack round trip, measured on the store.
///
/// # Errors
/// Store errors, or a run that does not settle within 120 s.
pub async fn run(args: &BenchFailoverArgs) -> Result<()> {
    for &kill in &args.kill {
        failover_case(args, kill).await?;
    }
    Ok(())
}

async fn failover_case(args: &BenchFailoverArgs, kill: usize) -> Result<()> {
    use crate::inproc::InProc;
    use chanwatch_core::{ChannelInfo, ChannelOwner, ChannelState, Keys, NodeId};
    use chanwatch_node::SimulatedLoad;
    use chanwatch_store::EmbeddedStore;

    ensure!(
        kill < args.nodes,
        "--kill {kill} must leave at least one of {} nodes alive",
        args.nodes
    );
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let (mut seconds, mut txns, mut floors) = (Vec::new(), Vec::new(), Vec::new());
    let mut moved = 0;
    eprintln!(
        "bench failover: {} nodes, {} channels, kill {kill}, {} runs, store {:?}",
        args.nodes, args.channels, args.runs, args.store
    );
    for run in 0..args.runs.max(1) {
        let store: Arc<dyn MetaStore> = match args.store {
            StoreKind::Embedded => Arc::new(EmbeddedStore::new()),
            StoreKind::Etcd => args.etcd.connect().await?,
        };
        // The floor's parts, measured on this store now.
        let big: Vec<TxnOp> = (0..store.limits().max_txn_ops)
            .map(|j| TxnOp::put(format!("bench-floor/{j}"), vec![b'v'; 200]))
            .collect();
        let mut t128 = Vec::new();
        let mut t1 = Vec::new();
        for _ in 0..10 {
            let t = Instant::now();
            store.txn(Txn::new().and_then(big.clone())).await?;
            t128.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            store
                .txn(Txn::new().and_then([TxnOp::put("bench-floor/one", "v")]))
                .await?;
            t1.push(t.elapsed().as_secs_f64());
        }
        store
            .txn(Txn::new().and_then([TxnOp::delete_prefix("bench-floor/")]))
            .await?;

        let keys = Keys::new(format!("bench-{}-{kill}-{run}", std::process::id()))?;
        let timings = crate::inproc::Timings {
            session_ttl: Duration::from_secs(10),
            watch_timeout: Duration::from_secs(120),
            resync_interval: Duration::from_secs(60),
            tick: Duration::from_millis(100),
            progress_interval: Duration::from_secs(5),
        };
        let c = InProc::start_on(
            store.clone(),
            keys.clone(),
            timings,
            Arc::new(SimulatedLoad::default()),
            "bench".into(),
        )?;
        // On etcd each node has a connection of its own, as node processes do: 100 nodes'
        // watch streams and acks multiplexed on one HTTP/2 connection are not a deployment.
        let mut nodes = Vec::with_capacity(args.nodes);
        for _ in 0..args.nodes {
            nodes.push(match args.store {
                StoreKind::Embedded => c.spawn_node(),
                StoreKind::Etcd => c.spawn_node_on(args.etcd.connect().await?),
            });
        }
        let mut ids = Vec::new();
        for n in &nodes {
            ids.push(c.node_id(n).await?);
        }
        c.ready().await?;
        // Seeded `Watched` (running, acked): the set-up costs no load and no ack per
        // channel, which at 1,000,000 channels starved the nodes' keepalives on 2 cores. What
        // is measured (the victims' channels moved and acked) is the same.
        super::system::seed(&c, &ids, args.channels, ChannelState::Watched).await?;
        let deadline = Instant::now() + Duration::from_secs(300);
        while c.coord_metrics.channels_in(ChannelState::Watched) < args.channels as i64
            || c.handle.nodes().await.map(|n| n.len()).unwrap_or(0) < args.nodes
        {
            ensure!(Instant::now() < deadline, "setup did not settle");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        super::system::compact_history(store.as_ref()).await?;
        let victims: Vec<NodeId> = ids[..kill].to_vec();
        let mut leases = Vec::new();
        for v in &victims {
            if let Some(kv) = store.get(&keys.session(*v)).await? {
                leases.push(kv.lease.unwrap_or(0));
            }
        }
        let live: Vec<NodeId> = ids[kill..].to_vec();
        let held = {
            let list = store.range(&keys.channels_prefix()).await?;
            list.kvs
                .iter()
                .filter(|kv| {
                    keys.parse_channel(&kv.key).is_ok_and(
                        |ck| matches!(ck.owner, ChannelOwner::Node(n) if victims.contains(&n)),
                    )
                })
                .count()
        };
        for n in nodes.drain(..kill) {
            n.kill();
        }
        let committed0 = c.coord_metrics.txns_of("committed");
        let t0 = Instant::now();
        let samples0 = c.coord_metrics.failover_seconds.get_sample_count();
        // The sessions are lost together (all revokes in flight at once), as when one rack
        // fails; one by one, each revoke queued behind the failover work of the previous
        // and the loss itself was spread over up to a second.
        let revokes = futures_util::future::join_all(leases.iter().map(|l| store.revoke(*l))).await;
        for r in revokes {
            match r {
                // Already gone: the session is lost either way.
                Ok(()) | Err(chanwatch_store::StoreError::LeaseNotFound(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let revoked = t0.elapsed().as_secs_f64();
        // Done when the coordinator has seen every moved channel Watched on a live node (its
        // failover histogram gets one sample per victim). Polling that is free; polling the
        // store with a full range would itself slow a 2-core machine down.
        while c.coord_metrics.failover_seconds.get_sample_count() < samples0 + leases.len() as u64 {
            ensure!(
                t0.elapsed() < Duration::from_secs(120),
                "failover did not settle in 120 s"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let took = t0.elapsed().as_secs_f64();
        // Cross-check with the store: every channel Watched on a live node.
        let list = store.range(&keys.channels_prefix()).await?;
        let watched = list
            .kvs
            .iter()
            .filter(|kv| {
                keys.parse_channel(&kv.key)
                    .is_ok_and(|ck| matches!(ck.owner, ChannelOwner::Node(n) if live.contains(&n)))
                    && ChannelInfo::decode(&kv.value)
                        .is_ok_and(|i| i.state == ChannelState::Watched)
            })
            .count();
        ensure!(watched == args.channels, "the coordinator reported the failover done but the store shows {watched} of {} Watched", args.channels);
        let coord_txns = c.coord_metrics.txns_of("committed") - committed0;
        let max_ops = store.limits().max_txn_ops;
        let floor =
            ((2 * held).div_ceil(max_ops)) as f64 * median(t128.clone()) + median(t1.clone());
        eprintln!(
            "  run {run}: {held} channels moved and Watched in {took:.3} s (sessions revoked after {revoked:.3} s); {coord_txns} coordinator txns; floor {:.3} s",
            floor
        );
        moved = held;
        seconds.push(took);
        txns.push(coord_txns as f64);
        floors.push(floor);
        for n in nodes {
            n.stop().await;
        }
        c.shutdown().await;
        store
            .txn(Txn::new().and_then([TxnOp::delete_prefix(keys.all_prefix())]))
            .await?;
    }
    let secs = median(seconds.clone());
    let floor = median(floors);
    let coord_txns = median(txns);
    println!(
        "{}",
        json!({
            "bench": "failover",
            "store": format!("{:?}", args.store).to_lowercase(),
            "cores": cores,
            "nodes": args.nodes,
            "channels": args.channels,
            "killed": kill,
            "moved": moved,
            "runs": seconds.len(),
            "seconds_median": (secs * 1000.0).round() / 1000.0,
            "seconds_min": (seconds.iter().copied().fold(f64::MAX, f64::min) * 1000.0).round() / 1000.0,
            "seconds_max": (seconds.iter().copied().fold(0.0, f64::max) * 1000.0).round() / 1000.0,
            "coordinator_txns_median": coord_txns,
            "ops_per_txn": if coord_txns > 0.0 { ((2 * moved) as f64 / coord_txns * 10.0).round() / 10.0 } else { 0.0 },
            "floor_seconds": (floor * 1000.0).round() / 1000.0,
            "ratio_to_floor": (secs / floor.max(1e-9) * 100.0).round() / 100.0,
        })
    );
    Ok(())
}
