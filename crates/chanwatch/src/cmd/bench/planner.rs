//! `chanwatch bench planner`: the coordinator's view alone (no store, no nodes, no runtime)
//! at a given size — its memory per channel, a steady-state plan round, and the round that
//! moves the channels of nodes whose sessions went.
//!
//! Owns: that workload and what it reports. Must not: assert on timings.

use anyhow::{ensure, Result};
use serde_json::json;

use super::system::{round3, rss_bytes};
use super::{median, BenchPlannerArgs};

/// The coordinator's view alone: bytes of RSS per channel once `channels` assignments are
/// applied (as the coordinator holds them after its startup list), the time of one
/// steady-state plan round (nothing to change), which every store event batch and tick pays,
/// and the time of the round that moves the channels of `kill` nodes whose sessions went.
pub fn planner(args: &BenchPlannerArgs) -> Result<()> {
    use chanwatch_core::planner::{Planner, PlannerConfig};
    use chanwatch_core::{ChannelInfo, ChannelName, ChannelOwner, ChannelState, Epoch, Keys};
    use chanwatch_core::{NodeId, NodeSession, VChannelInfo};
    ensure!(
        (1..args.nodes).contains(&args.kill),
        "--kill {} with --nodes {}: kill at least one node and leave at least one alive",
        args.kill,
        args.nodes
    );
    eprintln!(
        "bench planner: {} channels on {} nodes, {} runs (no store, no nodes: the planner only)",
        args.channels, args.nodes, args.runs
    );
    // Memory freed by one run is reused by the next in the same process, so each run of
    // several is a fresh process of its own.
    if args.runs > 1 {
        let exe = std::env::current_exe()?;
        let (mut bytes, mut plan_ms, mut failover_ms) = (Vec::new(), Vec::new(), Vec::new());
        for run in 1..=args.runs {
            let out = std::process::Command::new(&exe)
                .args(["bench", "planner", "--runs", "1"])
                .args(["--channels", &args.channels.to_string()])
                .args(["--nodes", &args.nodes.to_string()])
                .args(["--kill", &args.kill.to_string()])
                .stderr(std::process::Stdio::null())
                .output()?;
            anyhow::ensure!(out.status.success(), "run {run} failed");
            let line: serde_json::Value = serde_json::from_slice(&out.stdout)?;
            let b = line["rss_bytes_per_channel_median"].as_f64().unwrap_or(0.0);
            let p = line["plan_round_ms_median"].as_f64().unwrap_or(0.0);
            let f = line["failover_round_ms_median"].as_f64().unwrap_or(0.0);
            eprintln!(
                "  run {run}: {b:.0} B RSS/channel, plan round {p:.2} ms, failover round {f:.2} ms"
            );
            bytes.push(b);
            plan_ms.push(p);
            failover_ms.push(f);
        }
        print_planner(args, [bytes, plan_ms, failover_ms], "; one process per run");
        return Ok(());
    }
    let keys = Keys::default();
    let mut bytes = Vec::new();
    let mut plan_ms = Vec::new();
    let mut failovers_ms = Vec::new();
    for run in 1..=args.runs.max(1) {
        let rss0 = rss_bytes();
        let mut state = Planner::new(keys.clone(), PlannerConfig::default());
        let mut rev = 1;
        for id in 1..=args.nodes as u64 {
            rev += 1;
            let session = NodeSession {
                id: NodeId(id),
                admin_addr: format!("10.0.0.{}:9871", id % 250),
                version: env!("CARGO_PKG_VERSION").to_owned(),
                started_at_ms: 1,
                capacity: 0,
                name: String::new(),
                extra: Default::default(),
            };
            state.apply_put(&keys.session(NodeId(id)), &session.encode(), rev);
        }
        for i in 0..args.channels {
            rev += 1;
            let name = ChannelName::new(format!("by-dev-rootcoord-dml_{i}_v0"))?;
            let node = NodeId(1 + (i % args.nodes.max(1)) as u64);
            let mut info = ChannelInfo::new(name.clone(), Epoch(1), 1, VChannelInfo::default());
            info.state = ChannelState::Watched;
            let key = keys.channel(ChannelOwner::Node(node), &name);
            state.apply_put(&key, &info.encode(), rev);
        }
        let per_channel = rss_bytes().saturating_sub(rss0) as f64 / args.channels.max(1) as f64;
        let mut rounds = Vec::new();
        for _ in 0..5 {
            let t = std::time::Instant::now();
            let txns = state.plan(2);
            rounds.push(t.elapsed().as_secs_f64() * 1e3);
            anyhow::ensure!(
                txns.is_empty(),
                "a settled view planned {} txns",
                txns.len()
            );
        }
        let round = median(rounds);
        // Then a failover: the sessions of nodes 1..=kill go, and one round plans their
        // channels away.
        let t = std::time::Instant::now();
        for id in 1..=args.kill as u64 {
            rev += 1;
            state.apply_delete(&keys.session(NodeId(id)), rev);
        }
        let gone_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = std::time::Instant::now();
        let txns = state.plan(3);
        let failover_ms = t.elapsed().as_secs_f64() * 1e3;
        let moved: usize = txns.iter().map(|t| t.transitions.len()).sum();
        eprintln!(
            "  run {run}: {per_channel:.0} B RSS/channel, plan round {round:.2} ms; {} \
             sessions gone {gone_ms:.2} ms, then the failover round {failover_ms:.2} ms \
             ({moved} channels, {} txns)",
            args.kill,
            txns.len()
        );
        bytes.push(per_channel);
        plan_ms.push(round);
        failovers_ms.push(failover_ms);
        drop(state);
    }
    print_planner(args, [bytes, plan_ms, failovers_ms], "");
    Ok(())
}

/// The planner bench's JSON line.
/// `figures` are, per run: RSS bytes per channel, steady round ms, failover round ms.
fn print_planner(args: &BenchPlannerArgs, figures: [Vec<f64>; 3], note: &str) {
    let [bytes, plan_ms, failover_ms] = figures;
    println!(
        "{}",
        json!({
            "bench": "planner", "channels": args.channels, "nodes": args.nodes,
            "kill": args.kill, "runs": bytes.len(),
            "rss_bytes_per_channel_median": median(bytes).round(),
            "plan_round_ms_median": round3(median(plan_ms)),
            "failover_round_ms_median": round3(median(failover_ms)),
            "note": format!("the coordinator's view only (Planner), no store, nodes or runtime{note}"),
        })
    );
}
