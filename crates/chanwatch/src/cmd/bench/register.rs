//! `chanwatch bench register`: registering many channels until all are `Watched`, against
//! a floor measured in the same run on the same store.
//!
//! Owns: that workload and what it reports. The cluster is in this process (a coordinator
//! serving its admin API on a loopback port, nodes each with an etcd connection of their
//! own, as node processes have); the registration is the real `chanwatch ctl add-channels
//! --from-file` run as a child process (or, with `--one-by-one`, one API call per channel
//! from 16 clients: the old way). The floor writes the same keys and acks straight to the
//! store: the assignments in packed txns (127 puts, each guarded by its key's absence), then
//! the `Watched` acks in packed txns (each guarded by the assignment's revision), as many txns
//! in flight as the coordinator's default pipeline (`CoordinatorConfig::pipeline`, 32).
//! Must not: assert on timings.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use chanwatch_core::{
    ChannelInfo, ChannelName, ChannelOwner, ChannelState, Epoch, Keys, NodeId, VChannelInfo,
};
use chanwatch_node::SimulatedLoad;
use chanwatch_store::{Compare, MetaStore, Txn, TxnOp};
use futures_util::StreamExt;
use serde_json::json;

use super::system::{compact_history, machine, open, timings};
use super::{median, BenchRegisterArgs, StoreKind};
use crate::inproc::InProc;

/// Txns in flight in the floor: the coordinator's default `pipeline`, which the cluster
/// measured beside it runs with.
fn floor_pipeline() -> usize {
    chanwatch_coord::CoordinatorConfig::default().pipeline
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// `chanwatch bench register`.
///
/// # Errors
/// Store errors, a failed `ctl`, or a run that does not settle in 600 s.
pub async fn run(args: &BenchRegisterArgs) -> Result<()> {
    ensure!(
        args.store == StoreKind::Etcd || args.one_by_one,
        "bench register runs `ctl add-channels`, which reaches the cluster through etcd: pass \
         --store etcd (or --one-by-one, which uses the admin API alone)"
    );
    let (mut secs, mut ctl_secs, mut floors) = (Vec::new(), Vec::new(), Vec::new());
    eprintln!(
        "bench register: {} channels over {} nodes, {} runs, {:?}, {}",
        args.channels,
        args.nodes,
        args.runs,
        args.store,
        if args.one_by_one {
            "one API call per channel (16 clients)"
        } else {
            "ctl add-channels --from-file"
        }
    );
    let file = std::env::temp_dir().join(format!(
        "chanwatch-bench-register-{}.txt",
        std::process::id()
    ));
    let names: String = (0..args.channels).map(|i| format!("ch{i:06}\n")).collect();
    std::fs::write(&file, names)?;
    for run in 0..args.runs.max(1) {
        let store = open(args.store, &args.etcd).await?;
        compact_history(store.as_ref()).await?;
        let floor = floor(store.clone(), run, args.channels, args.nodes).await?;
        compact_history(store.as_ref()).await?;

        let keys = Keys::new(format!("bench-reg-{}-{run}", std::process::id()))?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let admin = listener.local_addr()?.to_string();
        let c = InProc::start_on(
            store.clone(),
            keys.clone(),
            timings(),
            Arc::new(SimulatedLoad::default()),
            admin.clone(),
        )?;
        let router = chanwatch_coord::api::router(
            c.handle.clone(),
            chanwatch_coord::api::ApiOptions::default(),
        );
        let server = tokio::spawn(chanwatch_coord::api::serve(
            listener,
            router,
            std::future::pending(),
        ));
        let mut nodes = Vec::with_capacity(args.nodes);
        for _ in 0..args.nodes {
            nodes.push(match args.store {
                StoreKind::Embedded => c.spawn_node(),
                StoreKind::Etcd => c.spawn_node_on(args.etcd.connect().await?),
            });
        }
        for n in &nodes {
            c.node_id(n).await?;
        }
        c.ready().await?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while c.handle.nodes().await.map(|n| n.len()).unwrap_or(0) < args.nodes {
            ensure!(
                Instant::now() < deadline,
                "the coordinator never saw every node"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        let t0 = Instant::now();
        if args.one_by_one {
            one_by_one(&admin, args.channels).await?;
        } else {
            let mut ctl = std::process::Command::new(std::env::current_exe()?);
            ctl.arg("ctl")
                .arg(format!("--endpoints={}", args.etcd.endpoints.join(",")))
                .arg(format!("--root={}", keys.root()))
                .arg("add-channels")
                .arg("--from-file")
                .arg(&file)
                .stderr(std::process::Stdio::inherit());
            let out = tokio::task::spawn_blocking(move || ctl.output())
                .await?
                .context("running chanwatch ctl add-channels")?;
            ensure!(
                out.status.success(),
                "ctl add-channels failed ({})",
                out.status
            );
        }
        let registered = t0.elapsed().as_secs_f64();
        let deadline = t0 + Duration::from_secs(600);
        while c.coord_metrics.channels_in(ChannelState::Watched) < args.channels as i64 {
            ensure!(Instant::now() < deadline, "not all Watched within 600 s");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = t0.elapsed().as_secs_f64();
        // Cross-check with the store.
        let list = store.range(&keys.channels_prefix()).await?;
        let watched = list
            .kvs
            .iter()
            .filter(|kv| {
                keys.parse_channel(&kv.key)
                    .is_ok_and(|ck| matches!(ck.owner, ChannelOwner::Node(_)))
                    && ChannelInfo::decode(&kv.value)
                        .is_ok_and(|i| i.state == ChannelState::Watched)
            })
            .count();
        ensure!(
            watched == args.channels,
            "the coordinator counts every channel Watched, the store {watched} of {}",
            args.channels
        );
        eprintln!(
            "  run {run}: all {} Watched in {took:.3} s (registration call(s) returned after \
             {registered:.3} s); floor {floor:.3} s; ratio {:.2}",
            args.channels,
            took / floor
        );
        secs.push(took);
        ctl_secs.push(registered);
        floors.push(floor);
        server.abort();
        super::system::teardown(c, nodes).await?;
    }
    let _ = std::fs::remove_file(&file);
    let s = median(secs.clone());
    let f = median(floors.clone());
    println!(
        "{}",
        json!({
            "bench": "register", "store": format!("{:?}", args.store).to_lowercase(),
            "machine": machine(args.store), "channels": args.channels, "nodes": args.nodes,
            "mode": if args.one_by_one { "one-by-one" } else { "add-channels" },
            "runs": secs.len(), "seconds_median": round3(s),
            "seconds": secs.iter().map(|x| round3(*x)).collect::<Vec<_>>(),
            "registration_call_seconds_median": round3(median(ctl_secs)),
            "floor_seconds_median": round3(f),
            "ratios": secs.iter().zip(&floors).map(|(s, f)| (s / f * 100.0).round() / 100.0).collect::<Vec<_>>(),
            "ratio_to_floor": (s / f.max(1e-9) * 100.0).round() / 100.0,
        })
    );
    Ok(())
}

/// The old way: one `POST /api/v1/channels` per channel, 16 clients at once.
async fn one_by_one(admin: &str, channels: usize) -> Result<()> {
    let clients = 16;
    let client = reqwest::Client::new();
    let url = format!("http://{admin}/api/v1/channels");
    let mut tasks = Vec::new();
    for k in 0..clients {
        let (client, url) = (client.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            for i in (k..channels).step_by(clients) {
                let resp = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(json!({ "name": format!("ch{i:06}") }).to_string())
                    .send()
                    .await?;
                ensure!(
                    resp.status().is_success(),
                    "add ch{i:06}: {}",
                    resp.status()
                );
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// The same keys and acks written straight to the store (see the module docs); seconds.
async fn floor(
    store: Arc<dyn MetaStore>,
    run: usize,
    channels: usize,
    nodes: usize,
) -> Result<f64> {
    let keys = Keys::new(format!("bench-reg-floor-{}-{run}", std::process::id()))?;
    let per_txn = store.limits().max_txn_ops.saturating_sub(1).max(1);
    let now = chanwatch_store::Clock::system().unix_ms();
    let infos: Vec<(String, ChannelInfo)> = (0..channels)
        .map(|i| {
            let name = ChannelName::new(format!("ch{i:06}"))?;
            let owner = ChannelOwner::Node(NodeId(1 + (i % nodes.max(1)) as u64));
            let info = ChannelInfo::new(name.clone(), Epoch(1), now, VChannelInfo::default());
            Ok((keys.channel(owner, &name), info))
        })
        .collect::<Result<_>>()?;
    let t0 = Instant::now();
    let adds: Vec<Txn> = infos
        .chunks(per_txn)
        .map(|chunk| {
            Txn::new()
                .when(chunk.iter().map(|(k, _)| Compare::absent(k.clone())))
                .and_then(chunk.iter().map(|(k, i)| TxnOp::put(k.clone(), i.encode())))
        })
        .collect();
    let revs = run_txns(&store, adds).await?;
    let acks: Vec<Txn> = infos
        .chunks(per_txn)
        .zip(revs)
        .map(|(chunk, rev)| {
            Txn::new()
                .when(
                    chunk
                        .iter()
                        .map(|(k, _)| Compare::mod_revision(k.clone(), rev)),
                )
                .and_then(chunk.iter().map(|(k, i)| {
                    let mut i = i.clone();
                    i.state = ChannelState::Watched;
                    TxnOp::put(k.clone(), i.encode())
                }))
        })
        .collect();
    run_txns(&store, acks).await?;
    let took = t0.elapsed().as_secs_f64();
    store
        .txn(Txn::new().and_then([TxnOp::delete_prefix(keys.all_prefix())]))
        .await?;
    Ok(took)
}

/// Runs `txns`, [`floor_pipeline`] at once; their revisions, in order.
async fn run_txns(store: &Arc<dyn MetaStore>, txns: Vec<Txn>) -> Result<Vec<i64>> {
    let results: Vec<_> = futures_util::stream::iter(txns.into_iter().map(|t| {
        let store = store.clone();
        async move { store.txn(t).await }
    }))
    .buffered(floor_pipeline())
    .collect()
    .await;
    let mut revs = Vec::with_capacity(results.len());
    for r in results {
        let r = r?;
        ensure!(r.succeeded, "a floor txn's compare failed");
        revs.push(r.revision);
    }
    Ok(revs)
}
