//! `chanwatch bench rolling-restart`: a planned rolling restart of real processes on a real
//! etcd — one coordinator and N `chanwatch node --handler-log` processes of this binary;
//! each node in turn gets SIGTERM, the bench waits for it to exit, starts a replacement
//! (a fresh ID) and waits until every channel is `Watched` and balance has stopped moving
//! (channels within their move cool-down stay put; the spread left is reported). After the
//! last restart it waits up to `--move-cooldown` (the coordinator's) and then some for balance
//! to close the spread (it holds off that long after a node left on purpose) and reports the
//! spread then, and the moves of that final balance with the rest.
//!
//! Reports, from the handler logs: per moved channel the time it ran nowhere (stop on the
//! old node → start on the new one; p50/p99/max), how many times a channel moved within one
//! restart (target ≤ 1), how long each node took to exit after SIGTERM; from the
//! coordinator's `/metrics`: failovers (target 0) and moves by cause; and the total time.
//! `--shutdown-timeout 0s` measures the behaviour before planned restarts (stop, revoke:
//! every channel of a restarted node fails over).
//!
//! Owns: the processes and their files (a temp dir), the handler-log arithmetic. Must not:
//! assert on the figures.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure, Context, Result};
use chanwatch_core::{ChannelInfo, ChannelOwner, ChannelState, Keys};
use serde_json::json;

use super::{median, BenchRollingRestartArgs};

/// A child process, killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn spawn(dir: &Path, name: &str, args: &[String]) -> Result<Proc> {
    let out = std::fs::File::create(dir.join(format!("{name}.out")))?;
    let child = Command::new(std::env::current_exe()?)
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .context("cannot start a chanwatch process")?;
    Ok(Proc(child))
}

/// The admin address of the coordinator that leads under `keys`, read from its leader key
/// once there is one (before `deadline`).
async fn leader_admin(
    store: &dyn chanwatch_store::MetaStore,
    keys: &Keys,
    deadline: Instant,
) -> Result<String> {
    loop {
        if let Ok(Some(kv)) = store.get(&keys.leader()).await {
            let session = chanwatch_core::CoordSession::decode(&kv.value)
                .map_err(|e| anyhow::anyhow!("{} does not decode: {e}", keys.leader()))?;
            return Ok(session.admin_addr);
        }
        ensure!(
            Instant::now() < deadline,
            "no coordinator became leader under {}",
            keys.root()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Percentile `p` (0..=100) of sorted `xs`.
fn pct(xs: &[f64], p: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let i = ((xs.len() as f64 - 1.0) * p / 100.0).round() as usize;
    xs[i.min(xs.len() - 1)]
}

/// One line of a handler log: (what, node, channel, epoch, unix ms).
fn parse(line: &str) -> Option<(String, u64, String, u64, u64)> {
    let mut f = line.split_whitespace();
    let what = f.next()?.to_owned();
    let node = f.next()?.parse().ok()?;
    let channel = f.next()?.to_owned();
    let epoch = f.next()?.parse().ok()?;
    let ms = f.next()?.parse().ok()?;
    Some((what, node, channel, epoch, ms))
}

/// One run's sorted gaps (ms) and the rest of what it measured.
type Measured = (Vec<f64>, RunResult);

/// What one run measured.
struct RunResult {
    gaps_ms: Vec<f64>,
    moved: usize,
    max_moves_per_restart: usize,
    exits_s: Vec<f64>,
    failovers: f64,
    drains: f64,
    balances: f64,
    total_s: f64,
    /// Max − min channels per node after the last restart.
    spread: usize,
    /// Max − min channels per node once balance is done (or `--move-cooldown` and then some
    /// have passed).
    spread_final: usize,
    /// Seconds from the last restart's settle to `spread_final`.
    final_s: f64,
}

/// `chanwatch bench rolling-restart`.
///
/// # Errors
/// etcd unreachable, a process that cannot start, a cluster that does not settle.
pub async fn run(args: &BenchRollingRestartArgs) -> Result<()> {
    let store = args.etcd.connect().await?;
    let endpoints = args.etcd.endpoints.join(",");
    eprintln!(
        "rolling restart: {} nodes, {} channels, --shutdown-timeout {:?}, {}, {} runs",
        args.nodes,
        args.channels,
        args.shutdown_timeout,
        if args.surge {
            "replacement first (--surge)"
        } else {
            "replacement after the exit"
        },
        args.runs
    );
    let mut results = Vec::new();
    for run in 0..args.runs {
        let root = format!("rr{}x{run}x{}", std::process::id(), unix_ms() % 100_000);
        let keys = Keys::new(root.clone()).map_err(|e| anyhow::anyhow!("{e}"))?;
        let r = one_run(args, &*store, &endpoints, &keys).await?;
        let mut gaps = r.gaps_ms.clone();
        gaps.sort_by(f64::total_cmp);
        eprintln!(
            "  run {run}: {} moves ({:.2} per channel); not running p50 {:.0} ms p99 {:.0} ms max {:.0} ms; max moves of one channel in one restart {}; node exit after SIGTERM median {:.2} s; failovers {}; drain {} balance {}; spread after {}, {} after {:.1} s more; total {:.1} s",
            r.moved, r.moved as f64 / args.channels.max(1) as f64, pct(&gaps, 50.0), pct(&gaps, 99.0), pct(&gaps, 100.0),
            r.max_moves_per_restart, median(r.exits_s.clone()), r.failovers, r.drains, r.balances, r.spread, r.spread_final, r.final_s, r.total_s
        );
        println!(
            "{}",
            json!({
                "bench": "rolling_restart", "run": run, "nodes": args.nodes, "channels": args.channels,
                "shutdown_timeout_s": args.shutdown_timeout.as_secs_f64(), "surge": args.surge,
                "moves": r.moved, "gap_p50_ms": pct(&gaps, 50.0), "gap_p99_ms": pct(&gaps, 99.0),
                "gap_max_ms": pct(&gaps, 100.0), "max_moves_per_channel_per_restart": r.max_moves_per_restart,
                "exit_median_s": median(r.exits_s.clone()), "failovers": r.failovers,
                "drain_moves": r.drains, "balance_moves": r.balances, "spread_after": r.spread, "total_s": r.total_s,
                "spread_final": r.spread_final, "final_s": r.final_s, "move_cooldown_s": args.move_cooldown.as_secs_f64(),
            })
        );
        results.push((gaps, r));
    }
    let med = |f: &dyn Fn(&Measured) -> f64| median(results.iter().map(f).collect());
    eprintln!(
        "median of {} runs: not running p50 {:.0} ms p99 {:.0} ms max {:.0} ms; moves {:.0}; max moves of a channel per restart {:.0}; failovers {:.0}; node exit {:.2} s; total {:.1} s",
        results.len(),
        med(&|(g, _)| pct(g, 50.0)),
        med(&|(g, _)| pct(g, 99.0)),
        med(&|(g, _)| pct(g, 100.0)),
        med(&|(_, r)| r.moved as f64),
        med(&|(_, r)| r.max_moves_per_restart as f64),
        med(&|(_, r)| r.failovers),
        med(&|(_, r)| median(r.exits_s.clone())),
        med(&|(_, r)| r.total_s),
    );
    Ok(())
}

async fn one_run(
    args: &BenchRollingRestartArgs,
    store: &dyn chanwatch_store::MetaStore,
    endpoints: &str,
    keys: &Keys,
) -> Result<RunResult> {
    let dir = std::env::temp_dir().join(format!("chanwatch-{}", keys.root()));
    std::fs::create_dir_all(&dir)?;
    let quiet = args.balance_quiet + Duration::from_secs(2);
    let ttl = format!("--session-ttl={}s", args.session_ttl.as_secs());
    let common = vec![
        format!("--endpoints={endpoints}"),
        format!("--root={}", keys.root()),
    ];
    // Port 0: the coordinator binds a free port itself and says it in its leader key.
    let mut coord_args = vec![
        "coord".to_owned(),
        "--admin=127.0.0.1:0".to_owned(),
        ttl.clone(),
    ];
    coord_args.extend(common.clone());
    coord_args.push(format!(
        "--balance-quiet={}ms",
        args.balance_quiet.as_millis()
    ));
    coord_args.push(format!(
        "--move-cooldown={}ms",
        args.move_cooldown.as_millis()
    ));
    let _coord = spawn(dir.as_path(), "coord", &coord_args)?;
    let mut logs: Vec<PathBuf> = Vec::new();
    let mut start_node = |i: usize| -> Result<Proc> {
        let log = dir.as_path().join(format!("node{i}.log"));
        logs.push(log.clone());
        let mut a = vec![
            "node".to_owned(),
            "--admin=127.0.0.1:0".to_owned(),
            format!("--handler-log={}", log.display()),
            format!("--shutdown-timeout={}ms", args.shutdown_timeout.as_millis()),
            ttl.clone(),
        ];
        a.extend(common.clone());
        spawn(dir.as_path(), &format!("node{i}"), &a)
    };
    let mut nodes: Vec<Proc> = Vec::new();
    for i in 0..args.nodes {
        nodes.push(start_node(i)?);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let admin = leader_admin(store, keys, deadline).await?;
    let http = reqwest::Client::new();
    let base = format!("http://{admin}/api/v1");
    loop {
        let n = match http.get(format!("{base}/nodes")).send().await {
            Ok(r) => r
                .json::<Vec<serde_json::Value>>()
                .await
                .map_or(0, |v| v.len()),
            Err(_) => 0,
        };
        if n >= args.nodes {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the leader never saw {} nodes",
            args.nodes
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for i in 0..args.channels {
        let name = format!("rr-{i:05}");
        loop {
            let r = http
                .post(format!("{base}/channels"))
                .json(&json!({ "name": name }))
                .send()
                .await;
            match r {
                Ok(r) if r.status().is_success() || r.status() == 409 => break,
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
    // Before the restarts: balanced, whatever it takes.
    while settle(store, keys, args.channels, args.nodes, quiet).await? > 1 {}
    let metric = |text: &str, cause: &str| -> f64 {
        let name = format!("chanwatch_reassignments_total{{cause=\"{cause}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&name)?.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let scrape = || async {
        match http.get(format!("http://{admin}/metrics")).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    };
    let before = scrape().await;
    let t0 = Instant::now();
    let mut windows = Vec::new();
    let mut exits_s = Vec::new();
    let mut spreads = Vec::new();
    for i in 0..args.nodes {
        let from_ms = unix_ms();
        if args.surge {
            // The replacement first: once the leader places on it, the drain fills it.
            nodes.push(start_node(args.nodes + i)?);
            wait_live(store, keys, args.nodes + 1).await?;
        }
        let mut old = nodes.remove(0);
        let pid = old.0.id();
        let sent = Instant::now();
        let ok = Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status()?
            .success();
        ensure!(ok, "kill -TERM {pid} failed");
        loop {
            if old.0.try_wait()?.is_some() {
                break;
            }
            if sent.elapsed() > args.shutdown_timeout + Duration::from_secs(30) {
                bail!("node{i} did not exit after SIGTERM");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        exits_s.push(sent.elapsed().as_secs_f64());
        if !args.surge {
            nodes.push(start_node(args.nodes + i)?);
        }
        spreads.push(settle(store, keys, args.channels, args.nodes, quiet).await?);
        windows.push((from_ms, unix_ms()));
    }
    let total_s = t0.elapsed().as_secs_f64();
    // The end: balance holds off for --move-cooldown after a node left on purpose, and
    // leaves channels that moved alone as long; wait that long (and then some) for it.
    let from_ms = unix_ms();
    let t_end = Instant::now();
    let until = t_end + args.move_cooldown + quiet + Duration::from_secs(10);
    let mut spread_final = spreads.last().copied().unwrap_or(0);
    while spread_final > 1 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(500)).await;
        spread_final = settle(store, keys, args.channels, args.nodes, quiet).await?;
    }
    let final_s = t_end.elapsed().as_secs_f64();
    windows.push((from_ms, unix_ms()));
    let after = scrape().await;
    let delta = |cause: &str| metric(&after, cause) - metric(&before, cause);
    // Handler logs: every stop → start of a channel on another node is one move.
    let mut events = Vec::new();
    for log in &logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        events.extend(text.lines().filter_map(parse));
    }
    events.sort_by_key(|e| e.4);
    let mut last_stop: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut gaps_ms = Vec::new();
    let mut moves: BTreeMap<(usize, String), usize> = BTreeMap::new();
    for (what, node, channel, _epoch, ms) in events {
        match what.as_str() {
            "stop" => {
                last_stop.insert(channel, (node, ms));
            }
            "start" => {
                if let Some((from, stop_ms)) = last_stop.remove(&channel) {
                    if from != node {
                        if let Some(w) = windows.iter().position(|(a, b)| ms >= *a && ms <= *b) {
                            gaps_ms.push(ms.saturating_sub(stop_ms) as f64);
                            *moves.entry((w, channel)).or_default() += 1;
                        }
                    }
                }
            }
            _ => {}
        }
    }
    drop(nodes);
    eprintln!("    logs in {}", dir.display());
    // Leave nothing behind in etcd.
    let _ = store
        .txn(
            chanwatch_store::Txn::new().and_then([chanwatch_store::TxnOp::delete_prefix(format!(
                "{}/",
                keys.root()
            ))]),
        )
        .await;
    Ok(RunResult {
        moved: gaps_ms.len(),
        gaps_ms,
        max_moves_per_restart: moves.values().copied().max().unwrap_or(0),
        exits_s,
        failovers: delta("failover"),
        drains: delta("drain"),
        balances: delta("balance"),
        total_s,
        spread: spreads.last().copied().unwrap_or(0),
        spread_final,
        final_s,
    })
}

/// Waits until `n` node sessions exist.
async fn wait_live(store: &dyn chanwatch_store::MetaStore, keys: &Keys, n: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while store.range(&keys.sessions_prefix()).await?.kvs.len() < n {
        ensure!(Instant::now() < deadline, "{n} nodes never registered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Waits until `nodes` nodes are live, every channel is `Watched` under one of them, and no
/// assignment key has changed for `quiet` (balance, which waits `--balance-quiet` after a
/// join, has done what it could: channels that moved within `--move-cooldown` wait, as an
/// operator's next restart would not). Returns the spread (max − min channels per node).
async fn settle(
    store: &dyn chanwatch_store::MetaStore,
    keys: &Keys,
    channels: usize,
    nodes: usize,
    quiet: Duration,
) -> Result<usize> {
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut last: Option<(i64, Instant)> = None;
    loop {
        let sessions = store.range(&keys.sessions_prefix()).await?;
        let live: Vec<u64> = sessions
            .kvs
            .iter()
            .filter_map(|kv| keys.parse_session(&kv.key).ok().map(|n| n.0))
            .collect();
        let list = store.range(&keys.channels_prefix()).await?;
        let mut per: BTreeMap<u64, usize> = live.iter().map(|n| (*n, 0)).collect();
        let mut watched = 0;
        for kv in &list.kvs {
            let (Ok(ck), Ok(info)) = (keys.parse_channel(&kv.key), ChannelInfo::decode(&kv.value))
            else {
                continue;
            };
            if let ChannelOwner::Node(n) = ck.owner {
                if info.state == ChannelState::Watched && live.contains(&n.0) {
                    watched += 1;
                    *per.entry(n.0).or_default() += 1;
                }
            }
        }
        let spread =
            per.values().max().copied().unwrap_or(0) - per.values().min().copied().unwrap_or(0);
        let newest = list.kvs.iter().map(|kv| kv.mod_revision).max().unwrap_or(0);
        if watched == channels && list.kvs.len() == channels && live.len() == nodes {
            match last {
                Some((rev, since)) if rev == newest => {
                    if since.elapsed() >= quiet {
                        return Ok(spread);
                    }
                }
                _ => last = Some((newest, Instant::now())),
            }
        } else {
            last = None;
        }
        ensure!(
            Instant::now() < deadline,
            "not settled in 180 s: {watched} of {channels} Watched, {} live nodes, spread {spread}",
            live.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
