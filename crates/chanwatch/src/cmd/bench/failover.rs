//! `chanwatch bench failover`: an in-process cluster loses nodes at once; the time from session
//! loss to every moved channel `Watched`, against the floor the store allows and against a
//! replay of the same writes straight to the store ([`replay`]), in the same run.
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
    let (mut replays, mut ratios, mut rss) = (Vec::new(), Vec::new(), Vec::new());
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

        let set_up = Instant::now();
        let keys = Keys::new(format!("bench-{}-{kill}-{run}", std::process::id()))?;
        let timings = crate::inproc::Timings {
            session_ttl: Duration::from_secs(10),
            watch_timeout: Duration::from_secs(120),
            // The coordinator's default: a full relist (at 1,000,000 channels, ~1 s under the
            // embedded store's lock and an O(channels) view rebuild) inside the measured
            // window would be measured too.
            resync_interval: Duration::from_secs(300),
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
        super::system::seed_paced(
            &c,
            &ids,
            args.channels,
            ChannelState::Watched,
            args.seed_step,
        )
        .await?;
        let deadline = Instant::now() + Duration::from_secs(300);
        while c.coord_metrics.channels_in(ChannelState::Watched) < args.channels as i64
            || c.handle.nodes().await.map(|n| n.len()).unwrap_or(0) < args.nodes
        {
            ensure!(Instant::now() < deadline, "setup did not settle");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        super::system::compact_history(store.as_ref()).await?;
        tokio::time::sleep(args.settle).await;
        eprintln!(
            "  run {run}: set-up done after {:.1} s; killing {kill}",
            set_up.elapsed().as_secs_f64()
        );
        // The whole process: coordinator, nodes and (embedded) store.
        rss.push(super::system::rss_bytes() as f64 / args.channels.max(1) as f64);
        let victims: Vec<NodeId> = ids[..kill].to_vec();
        let mut leases = Vec::new();
        for v in &victims {
            if let Some(kv) = store.get(&keys.session(*v)).await? {
                leases.push(kv.lease.unwrap_or(0));
            }
        }
        let live: Vec<NodeId> = ids[kill..].to_vec();
        // The victims' channels, with their owner: their prefixes only (a range of all
        // 1,000,000 holds the embedded store's lock for seconds, which stalled every
        // keepalive in the process).
        let mut held_by: Vec<(chanwatch_core::ChannelName, NodeId)> = Vec::new();
        for v in &victims {
            let list = store
                .range(&keys.owner_prefix(ChannelOwner::Node(*v)))
                .await?;
            held_by.extend(
                list.kvs
                    .iter()
                    .filter_map(|kv| keys.parse_channel(&kv.key).ok())
                    .map(|ck| (ck.channel, *v)),
            );
        }
        let held = held_by.len();
        // Dead before the clock starts, and gone: the victims' tasks (their sessions and
        // the runners of their channels, dropped with them) are wound down first. In one
        // process their teardown took ~3 ms of CPU inside the timed window (seen in a
        // profile of the failover), which a node dying on another machine does not cost.
        // Their leases (10 s TTL) live on until the revokes below.
        futures_util::future::join_all(nodes.drain(..kill).map(|n| n.kill_and_wait())).await;
        // The runners were aborted with the node task; they end when next polled.
        tokio::time::sleep(Duration::from_millis(50)).await;
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
        // Cross-check with the store: every channel Watched on a live node. One live node's
        // prefix at a time, so no read holds the embedded store for long.
        let mut watched = 0;
        // Where each moved channel went, for the replay.
        let mut now_on: std::collections::HashMap<chanwatch_core::ChannelName, NodeId> =
            std::collections::HashMap::new();
        let moving: std::collections::HashSet<&chanwatch_core::ChannelName> =
            held_by.iter().map(|(c, _)| c).collect();
        for n in &live {
            let list = store
                .range(&keys.owner_prefix(ChannelOwner::Node(*n)))
                .await?;
            for kv in &list.kvs {
                let Ok(ck) = keys.parse_channel(&kv.key) else {
                    continue;
                };
                if ChannelInfo::decode(&kv.value).is_ok_and(|i| i.state == ChannelState::Watched) {
                    watched += 1;
                }
                if moving.contains(&ck.channel) {
                    now_on.insert(ck.channel, *n);
                }
            }
        }
        ensure!(watched == args.channels, "the coordinator reported the failover done but the store shows {watched} of {} Watched", args.channels);
        let moves: Vec<_> = held_by
            .iter()
            .filter_map(|(c, from)| now_on.get(c).map(|to| (c.clone(), *from, *to)))
            .collect();
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
        // The coordinator first: nodes stopping under it would each be a failover (999 of
        // 1,000 channels each at 1,000,000), which took minutes.
        c.shutdown().await;
        futures_util::future::join_all(nodes.into_iter().map(|n| n.stop())).await;
        store
            .txn(Txn::new().and_then([TxnOp::delete_prefix(keys.all_prefix())]))
            .await?;
        // The same writes replayed straight to the store, on the same store, now idle.
        let etcd = args.etcd.clone();
        let kind = args.store;
        let shared = store.clone();
        let connect =
            move || -> futures_util::future::BoxFuture<'static, Result<Arc<dyn MetaStore>>> {
                let (etcd, shared) = (etcd.clone(), shared.clone());
                Box::pin(async move {
                    Ok(match kind {
                        StoreKind::Embedded => shared,
                        StoreKind::Etcd => etcd.connect().await?,
                    })
                })
            };
        let replayed = replay(store.clone(), connect, &moves, &format!("{kill}-{run}")).await?;
        eprintln!(
            "  run {run}: replay of its writes {replayed:.3} s; chanwatch / replay {:.2}",
            took / replayed.max(1e-9)
        );
        replays.push(replayed);
        ratios.push(took / replayed.max(1e-9));
    }
    let secs = median(seconds.clone());
    let replay_secs = median(replays);
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
            "replay_seconds_median": (replay_secs * 1000.0).round() / 1000.0,
            "ratio_to_replay_median": (median(ratios) * 100.0).round() / 100.0,
            "rss_bytes_per_channel_median": median(rss).round(),
            "note": "RSS is the whole process (coordinator, nodes and, embedded, the store), after set-up",
        })
    );
    Ok(())
}

/// The replay floor: the writes of a failover straight to the store, under a root of its
/// own — each moved channel seeded `Watched` under its dead owner and each dead owner's
/// session on a lease of its own (not timed); then the loss (the leases revoked, all at
/// once, as chanwatch's run revokes them) until a watch of the sessions has shown every
/// session gone; then the move txns (delete the old key, put `ToWatch` at the next epoch
/// under the new owner, each guarded by the old key's revision; packed as the coordinator
/// packs them, all in flight), and per receiving node one ack txn of all its channels once
/// its own watch (on a connection of its own, as a node has) has shown every put. Seconds
/// from the revokes until a watch of the whole root (the coordinator's view, on a
/// connection of its own) has shown every ack: chanwatch's clock starts at the same revokes
/// and stops when its coordinator has seen every moved channel `Watched`.
pub(super) async fn replay(
    store: Arc<dyn MetaStore>,
    connect: impl Fn() -> futures_util::future::BoxFuture<'static, Result<Arc<dyn MetaStore>>>,
    moves: &[(
        chanwatch_core::ChannelName,
        chanwatch_core::NodeId,
        chanwatch_core::NodeId,
    )],
    tag: &str,
) -> Result<f64> {
    use chanwatch_core::{ChannelInfo, ChannelOwner, ChannelState, Epoch, Keys, VChannelInfo};
    use chanwatch_store::{Compare, EventKind};
    use futures_util::StreamExt;
    use std::collections::BTreeMap;

    let keys = Keys::new(format!("bench-replay-{}-{tag}", std::process::id()))?;
    let now = chanwatch_store::Clock::system().unix_ms();
    let max_ops = store.limits().max_txn_ops;
    let info = |c: &chanwatch_core::ChannelName, epoch, state| {
        let mut i = ChannelInfo::new(c.clone(), Epoch(epoch), now, VChannelInfo::default());
        i.state = state;
        i.encode()
    };
    // Seed (not timed).
    let mut seeded = BTreeMap::new();
    for chunk in moves.chunks(max_ops) {
        let r = store
            .txn(Txn::new().and_then(chunk.iter().map(|(c, from, _)| {
                TxnOp::put(
                    keys.channel(ChannelOwner::Node(*from), c),
                    info(c, 1, ChannelState::Watched),
                )
            })))
            .await?;
        for (c, _, _) in chunk {
            seeded.insert(c.clone(), r.revision);
        }
    }
    // The dead nodes' sessions, each on a lease of its own, as the nodes had them.
    let mut leases = Vec::new();
    let dead: std::collections::BTreeSet<chanwatch_core::NodeId> =
        moves.iter().map(|(_, from, _)| *from).collect();
    for node in &dead {
        let lease = store.grant(Duration::from_secs(10)).await?;
        store
            .txn(Txn::new().and_then([TxnOp::put_with_lease(
                keys.session(*node),
                b"{}".to_vec(),
                lease.id,
            )]))
            .await?;
        leases.push(lease.id);
    }
    super::system::compact_history(store.as_ref()).await?;
    let start = store.range("\0").await?.revision + 1;
    // What the coordinator learns the loss and the acks from: a watch of the root, on a
    // connection of its own, started before the clock.
    let mut root = connect().await?.watch(&keys.all_prefix(), start).await?;
    // Each receiving node's watch, started before the clock.
    let mut by_node: BTreeMap<chanwatch_core::NodeId, usize> = BTreeMap::new();
    for (_, _, to) in moves {
        *by_node.entry(*to).or_default() += 1;
    }
    let mut acks = Vec::new();
    for (&node, &expect) in &by_node {
        let s = connect().await?;
        let prefix = keys.owner_prefix(ChannelOwner::Node(node));
        let mut watch = s.watch(&prefix, start).await?;
        acks.push(tokio::spawn(async move {
            let mut seen: BTreeMap<String, (i64, Vec<u8>)> = BTreeMap::new();
            while seen.len() < expect {
                let batch = tokio::time::timeout(Duration::from_secs(60), watch.next())
                    .await
                    .map_err(|_| anyhow::anyhow!("replay: node {node}'s puts never all came"))?
                    .ok_or_else(|| anyhow::anyhow!("replay: node {node}'s watch ended"))??;
                for ev in batch.events {
                    if ev.kind == EventKind::Put {
                        seen.insert(ev.kv.key.clone(), (ev.kv.mod_revision, ev.kv.value));
                    }
                }
            }
            let compares: Vec<Compare> = seen
                .iter()
                .map(|(k, (rev, _))| Compare::mod_revision(k.clone(), *rev))
                .collect();
            let puts: Vec<TxnOp> = seen
                .into_iter()
                .map(|(k, (_, v))| {
                    let mut i = ChannelInfo::decode(&v)?;
                    i.state = ChannelState::Watched;
                    Ok(TxnOp::put(k, i.encode()))
                })
                .collect::<Result<_>>()?;
            for (c, p) in compares.chunks(max_ops - 1).zip(puts.chunks(max_ops - 1)) {
                let r = s
                    .txn(Txn::new().when(c.to_vec()).and_then(p.to_vec()))
                    .await?;
                ensure!(r.succeeded, "replay: node {node}'s ack was refused");
            }
            anyhow::Ok(())
        }));
    }
    // The clock starts where chanwatch's does: at the loss (the same revokes, all in
    // flight at once); the moves go once the watch has shown every session gone.
    let t0 = Instant::now();
    let revoker = store.clone();
    let revokes = tokio::spawn(async move {
        futures_util::future::join_all(leases.iter().map(|l| revoker.revoke(*l))).await
    });
    // The coordinator's side: the losses, then the second put of every moved channel's new
    // key (the move puts it, the ack puts it again; the coordinator, too, decodes only the
    // acks). Aborted if the replay ends early.
    let (lost, losses_seen) = tokio::sync::oneshot::channel();
    let sessions = dead.len();
    let mut new_keys: std::collections::HashMap<String, u8> = moves
        .iter()
        .map(|(c, _, to)| (keys.channel(ChannelOwner::Node(*to), c), 0))
        .collect();
    let watcher = tokio::spawn(async move {
        async fn next(
            root: &mut chanwatch_store::WatchStream,
        ) -> Result<chanwatch_store::WatchBatch> {
            tokio::time::timeout(Duration::from_secs(60), root.next())
                .await
                .map_err(|_| anyhow::anyhow!("replay: the root's watch was silent for 60 s"))?
                .ok_or_else(|| anyhow::anyhow!("replay: the root's watch ended"))?
                .map_err(anyhow::Error::from)
        }
        let mut gone = 0;
        while gone < sessions {
            gone += next(&mut root)
                .await?
                .events
                .iter()
                .filter(|e| e.kind == EventKind::Delete)
                .count();
        }
        let _ = lost.send(t0.elapsed().as_secs_f64());
        let mut acked = 0;
        while acked < new_keys.len() {
            for e in next(&mut root).await?.events {
                if let (EventKind::Put, Some(n)) = (e.kind, new_keys.get_mut(&e.kv.key)) {
                    *n += 1;
                    acked += usize::from(*n == 2);
                }
            }
        }
        anyhow::Ok(t0.elapsed().as_secs_f64())
    });
    let mut watcher = AbortOnDrop(watcher);
    // Like the coordinator, it moves as soon as it has seen the losses, whether or not the
    // revokes have been answered yet.
    let Ok(detected) = losses_seen.await else {
        // The watcher ended before it saw them: say why.
        let why = match (&mut watcher.0).await {
            Ok(Err(e)) => e,
            Ok(Ok(_)) => anyhow::anyhow!("the root's watcher ended"),
            Err(e) => e.into(),
        };
        return Err(why.context("replay: waiting for the session deletes"));
    };
    // Packed as the planner packs a failover: guards + 2 ops per move within max_txn_ops - 1.
    let per_txn = (max_ops - 1) / 2;
    let txns: Vec<Txn> = moves
        .chunks(per_txn)
        .map(|chunk| {
            let compares = chunk.iter().map(|(c, from, _)| {
                Compare::mod_revision(keys.channel(ChannelOwner::Node(*from), c), seeded[c])
            });
            let deletes = chunk
                .iter()
                .map(|(c, from, _)| TxnOp::delete(keys.channel(ChannelOwner::Node(*from), c)));
            let puts = chunk.iter().map(|(c, _, to)| {
                TxnOp::put(
                    keys.channel(ChannelOwner::Node(*to), c),
                    info(c, 2, ChannelState::ToWatch),
                )
            });
            Txn::new()
                .when(compares.collect::<Vec<_>>())
                .and_then(deletes.chain(puts).collect::<Vec<_>>())
        })
        .collect();
    // All at once: the floor is what the store allows.
    let results = futures_util::future::join_all(txns.into_iter().map(|t| {
        let store = store.clone();
        async move { store.txn(t).await }
    }))
    .await;
    for r in results {
        ensure!(r?.succeeded, "replay: a move txn was refused");
    }
    eprintln!(
        "  replay: sessions seen gone after {detected:.3} s, its move txns landed after {:.3} s",
        t0.elapsed().as_secs_f64()
    );
    for a in acks {
        a.await??;
    }
    let acks_landed = t0.elapsed().as_secs_f64();
    let took = (&mut watcher.0).await??;
    eprintln!(
        "  replay: its acks landed after {acks_landed:.3} s, seen by its root watch after {took:.3} s"
    );
    for r in revokes.await? {
        r?;
    }
    store
        .txn(Txn::new().and_then([TxnOp::delete_prefix(keys.all_prefix())]))
        .await?;
    Ok(took)
}

/// A task aborted when its handle is dropped (the replay's watcher, when the replay ends
/// early with an error).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
