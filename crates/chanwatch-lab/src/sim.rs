//! `chanwatch-lab sim`: runs many seeds of the deterministic simulation in parallel, shows
//! progress, and prints a summary — or, for a failing seed, its violations, the tail of its
//! trace and the command that replays it.
//!
//! Owns: its flags (`Args`, the hidden `--plant`), running seeds in parallel and the summary.
//! Must not: simulate anything itself; `chanwatch-sim` does.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Result};
use chanwatch_sim::{run_seed, PlannerBug, PlantedBug, Report, SimOptions};

use clap::Args as ClapArgs;

/// Flags of `sim`.
#[derive(Debug, Clone, ClapArgs)]
pub struct Args {
    /// How many seeds to run (seeds START, START+1, ...).
    #[arg(long, env = "CHANWATCH_SIM_SEEDS", default_value_t = 100, allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(1..))]
    pub seeds: u64,
    /// First seed.
    #[arg(long, env = "CHANWATCH_SIM_START", default_value_t = 0)]
    pub start: u64,
    /// Run just this seed (replay a failure); with --trace, print its whole trace.
    #[arg(long, env = "CHANWATCH_SIM_SEED", conflicts_with_all = ["seeds", "start"])]
    pub seed: Option<u64>,
    /// Print every line of the trace as it happens (with --seed).
    #[arg(long, env = "CHANWATCH_SIM_TRACE", requires = "seed")]
    pub trace: bool,
    /// Fault steps per seed before the faults stop and the cluster must settle.
    #[arg(long, env = "CHANWATCH_SIM_STEPS", default_value_t = 300, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub steps: u32,
    /// Seeds run at once (default: one per core).
    #[arg(long, env = "CHANWATCH_SIM_JOBS", allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub jobs: Option<u64>,
    /// Also print the summary as one JSON line on stdout.
    #[arg(long, env = "CHANWATCH_SIM_JSON")]
    pub json: bool,
    /// Run the data plane too: every node consumes every channel from an in-memory log fed
    /// at a steady rate until the faults stop; the checker also proves checkpoints fenced,
    /// positions monotonic and every committed state exactly-once.
    #[arg(long, env = "CHANWATCH_SIM_DATA_PLANE")]
    pub data_plane: bool,
    /// Switch a safety mechanism off in every node, to see the checker catch it.
    #[arg(long, value_enum, hide = true)]
    pub plant: Option<PlantArg>,
}

/// Bugs `sim --plant` can switch on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlantArg {
    /// Nodes do not fence themselves when keepalives stop.
    NoFencing,
    /// Acks do not compare the mod revision or the session.
    UnguardedAck,
    /// The coordinator moves a channel stuck in ToRelease beside its live owner, and nodes
    /// ignore watch progress (either defence alone keeps one owner).
    ForceWithoutFence,
    /// Balance ignores failing-node back-offs, troubled nodes and cool-downs.
    BalanceIgnoresBackoff,
    /// Checkpoint commits do not compare the assignment's create revision (use with
    /// --data-plane).
    UnguardedCommit,
}

/// Runs the seeds; fails when any seed violated an invariant. Blocking: each seed runs on a
/// runtime of its own, on plain threads.
///
/// # Errors
/// A seed that violated an invariant, or bad flags.
pub fn run(args: &Args) -> Result<()> {
    let planted_bug = args.plant.and_then(|p| match p {
        PlantArg::NoFencing => Some(PlantedBug::NoFencing),
        PlantArg::UnguardedAck => Some(PlantedBug::UnguardedAck),
        PlantArg::ForceWithoutFence => Some(PlantedBug::NoWatchProgress),
        PlantArg::UnguardedCommit => Some(PlantedBug::UnguardedCommit),
        PlantArg::BalanceIgnoresBackoff => None,
    });
    let planner_bug = args.plant.and_then(|p| match p {
        PlantArg::ForceWithoutFence => Some(PlannerBug::ForceWithoutFence),
        PlantArg::BalanceIgnoresBackoff => Some(PlannerBug::BalanceIgnoresBackoff),
        _ => None,
    });
    let options = SimOptions {
        steps: args.steps,
        planted_bug,
        planner_bug,
        keep_trace: args.trace,
        echo_trace: args.trace,
        data_plane: args.data_plane,
        ..SimOptions::default()
    };
    let (first, count) = match args.seed {
        Some(s) => (s, 1),
        None => (args.start, args.seeds),
    };
    let jobs = args
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u64))
        .min(count.max(1));
    let started = Instant::now();
    let next = AtomicU64::new(0);
    let reports: Mutex<Vec<Report>> = Mutex::new(Vec::new());
    let error: Mutex<Option<String>> = Mutex::new(None);
    let done = AtomicU64::new(0);
    let failed = AtomicU64::new(0);
    let progress = count > 1 && !args.trace;
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= count {
                    return;
                }
                match run_seed(first + i, &options) {
                    Ok(r) => {
                        if !r.passed() {
                            failed.fetch_add(1, Ordering::SeqCst);
                        }
                        lock(&reports).push(r);
                    }
                    Err(e) => {
                        *lock(&error) = Some(format!("cannot build a runtime: {e}"));
                        return;
                    }
                }
                let d = done.fetch_add(1, Ordering::SeqCst) + 1;
                // On a terminal a bar redrawn in place; in a log, a line every tenth.
                let tty = std::io::stderr().is_terminal();
                let every = if tty { count / 100 } else { count / 10 }.max(1);
                if progress && (d == count || d % every == 0) {
                    let width = 30;
                    let filled = usize::try_from(d * width / count).unwrap_or(0);
                    eprint!(
                        "{}[{}{}] {d}/{count} seeds, {} failed, {:.0?}{}",
                        if tty { "\r" } else { "" },
                        "#".repeat(filled),
                        " ".repeat(30 - filled.min(30)),
                        failed.load(Ordering::SeqCst),
                        started.elapsed(),
                        if tty { "" } else { "\n" }
                    );
                    let _ = std::io::stderr().flush();
                }
            });
        }
    });
    if progress && std::io::stderr().is_terminal() {
        eprintln!();
    }
    if let Some(e) = lock(&error).take() {
        bail!("{e}");
    }
    let mut reports = std::mem::take(&mut *lock(&reports));
    reports.sort_by_key(|r| r.seed);
    summarize(&reports, args, started.elapsed().as_secs_f64())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn summarize(reports: &[Report], args: &Args, wall_secs: f64) -> Result<()> {
    let failed: Vec<&Report> = reports.iter().filter(|r| !r.passed()).collect();
    // By name, so the line and the JSON list the kinds alphabetically.
    let mut faults: BTreeMap<&str, u64> = BTreeMap::new();
    for r in reports {
        for (k, v) in &r.faults {
            *faults.entry(k.name()).or_default() += v;
        }
    }
    let mut settle: Vec<u64> = reports.iter().filter_map(|r| r.settle_ms).collect();
    settle.sort_unstable();
    let sim_secs: u64 = reports.iter().map(|r| r.sim_ms).sum::<u64>() / 1000;
    let total_faults: u64 = faults.values().sum();
    let first = reports.first().map_or(0, |r| r.seed);
    let last = reports.last().map_or(0, |r| r.seed);
    println!(
        "sim: seeds {first}..={last}: {} run, {} passed, {} failed; {} steps each; {total_faults} faults; {sim_secs} s simulated in {wall_secs:.1} s",
        reports.len(),
        reports.len() - failed.len(),
        failed.len(),
        args.steps
    );
    println!(
        "sim: settle after the faults stop: p50 {} ms, p99 {} ms, max {} ms",
        percentile(&settle, 0.5),
        percentile(&settle, 0.99),
        settle.last().copied().unwrap_or(0)
    );
    let list: Vec<String> = faults.iter().map(|(k, v)| format!("{k} {v}")).collect();
    println!("sim: faults: {}", list.join(", "));
    let judged: u64 = reports.iter().map(|r| r.departures_judged).sum();
    println!(
        "sim: planned restarts judged (undisturbed by other faults): {judged} of {}",
        faults.get("node-restart").copied().unwrap_or(0)
    );
    if args.json {
        let line = serde_json::json!({
            "seeds": reports.len(),
            "first_seed": first,
            "failed": failed.iter().map(|r| r.seed).collect::<Vec<_>>(),
            "steps": args.steps,
            "faults": faults,
            "departures_judged": judged,
            "settle_ms_p50": percentile(&settle, 0.5),
            "settle_ms_p99": percentile(&settle, 0.99),
            "simulated_s": sim_secs,
            "wall_s": wall_secs,
        });
        println!("{line}");
    }
    for r in failed.iter().take(3) {
        println!("\nseed {} FAILED:", r.seed);
        for v in r.violations.iter().take(10) {
            println!("  violation: {v}");
        }
        if !args.trace {
            println!("  last {} trace lines:", r.trace.len());
            for l in &r.trace {
                println!("    {l}");
            }
        }
        let plant = args
            .plant
            .map(|p| match p {
                PlantArg::NoFencing => " --plant no-fencing",
                PlantArg::UnguardedAck => " --plant unguarded-ack",
                PlantArg::ForceWithoutFence => " --plant force-without-fence",
                PlantArg::BalanceIgnoresBackoff => " --plant balance-ignores-backoff",
                PlantArg::UnguardedCommit => " --plant unguarded-commit",
            })
            .unwrap_or_default();
        let data = if args.data_plane { " --data-plane" } else { "" };
        println!(
            "  replay: cargo run --release -p chanwatch-lab -- sim --seed {} --steps {}{data}{plant} --trace",
            r.seed, args.steps
        );
    }
    if !failed.is_empty() {
        bail!(
            "{} of {} seeds violated an invariant (first: seed {})",
            failed.len(),
            reports.len(),
            failed[0].seed
        );
    }
    Ok(())
}
