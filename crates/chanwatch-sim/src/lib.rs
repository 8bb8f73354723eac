//! # chanwatch-sim
//!
//! Deterministic simulation of a whole cluster: two coordinators, a handful of nodes and the
//! embedded store, all in one single-threaded tokio runtime with paused time, driven by a
//! seeded RNG that injects faults (crashes, restarts, pauses past the TTL, a deposed leader
//! that keeps running, lost and delayed keepalives, broken watches, compaction, failed txns,
//! hung loads, channel adds and removes, drains and balances during failover; every kind and
//! how often it is drawn: [`Fault`]). After every step the [`check::Checker`] checks the
//! invariants of DESIGN.md §6 against every committed revision; after the faults stop, the
//! run must settle within `session_ttl + settle`.
//!
//! One seed fully determines a run: no wall clock (the clock is tokio's paused one with a
//! fixed Unix base), no OS randomness (the RNG is seeded, and the runtimes' own jitter is
//! hashed from names), no random task order (one thread, `biased` selects, ordered maps, no
//! tokio `watch` that several tasks wait on: it wakes them in an order drawn from an RNG
//! tokio seeds from the OS, so [`chanwatch_store::FaultyStore`]'s switches wake in order). The
//! same seed gives the same trace, byte for byte; a test checks it.
//!
//! With [`SimOptions::data_plane`], every node runs the stream consumer on a [`MemLog`] fed by
//! a producer task at a steady rate until the faults stop; without it nothing of the data
//! plane runs, and a seed's trace is what it was before the data plane existed.
//!
//! Owns: the driver ([`run_seed`]), the fault schedule and the trace.
//! Must not: reach into the coordinator or the nodes other than through their public entry
//! points, their stores (via [`chanwatch_store::FaultyStore`]) and their handler — a fault is
//! something a real process could suffer.

pub mod check;
mod departures;
pub mod fault;
mod memlog;
mod world;

pub use fault::Fault;
pub use memlog::MemLog;

use std::collections::{BTreeMap, VecDeque};
use std::hash::Hasher;

pub use chanwatch_core::planner::PlannerBug;
pub use chanwatch_node::PlantedBug;

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Fault steps before the faults stop and the run settles.
    pub steps: u32,
    /// Nodes at the start.
    pub nodes: usize,
    /// Most nodes alive at once.
    pub max_nodes: usize,
    /// Channels at the start.
    pub channels: usize,
    /// A safety mechanism switched off in every node (to prove the checker notices).
    pub planted_bug: Option<PlantedBug>,
    /// A safety rule switched off in every coordinator's planner.
    pub planner_bug: Option<PlannerBug>,
    /// Keep the whole trace (otherwise only its tail).
    pub keep_trace: bool,
    /// Print each trace line to stderr as it happens (to follow a run that hangs).
    pub echo_trace: bool,
    /// Run the data plane: nodes consume every channel from an in-memory log with the
    /// stream consumer while a producer appends to every channel until the faults stop; the
    /// checker then also proves checkpoints fenced, positions monotonic and every committed
    /// state exactly the fold of the log up to its position (invariants 3 and 8).
    pub data_plane: bool,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            steps: 300,
            nodes: 4,
            max_nodes: 6,
            channels: 24,
            planted_bug: None,
            planner_bug: None,
            keep_trace: false,
            echo_trace: false,
            data_plane: false,
        }
    }
}

/// What one seed did.
#[derive(Debug, Clone)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// Invariant violations (empty: the run passed).
    pub violations: Vec<String>,
    /// The trace (whole with `keep_trace`, else its last [`TRACE_TAIL`] lines).
    pub trace: Vec<String>,
    /// Hash of the whole trace: equal for two runs of one seed.
    pub trace_hash: u64,
    /// Lines in the whole trace.
    pub trace_lines: u64,
    /// Faults injected (and admin requests made), by kind.
    pub faults: BTreeMap<Fault, u64>,
    /// Simulated ms from the end of the faults until every invariant held.
    pub settle_ms: Option<u64>,
    /// Simulated ms of the whole run.
    pub sim_ms: u64,
    /// Store revisions written.
    pub revisions: i64,
    /// Planned restarts judged by the departure checks (undisturbed by other faults).
    pub departures_judged: u64,
}

impl Report {
    /// Whether no invariant was violated.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Lines of trace kept when the whole trace is not.
pub const TRACE_TAIL: usize = 60;

/// The trace: one line per injected fault, admin request and committed store event, stamped
/// with simulated time.
#[derive(Debug)]
struct Trace {
    lines: VecDeque<String>,
    keep_all: bool,
    echo: bool,
    hash: std::collections::hash_map::DefaultHasher,
    count: u64,
}

impl Trace {
    fn new(keep_all: bool, echo: bool) -> Self {
        Trace {
            lines: VecDeque::new(),
            keep_all,
            echo,
            hash: std::collections::hash_map::DefaultHasher::new(),
            count: 0,
        }
    }

    fn push(&mut self, t_ms: u64, text: &str) {
        let line = format!("{:>4}.{:03}s {text}", t_ms / 1000, t_ms % 1000);
        self.hash.write(line.as_bytes());
        self.count += 1;
        if self.echo {
            eprintln!("{line}");
        }
        if !self.keep_all && self.lines.len() == TRACE_TAIL {
            self.lines.pop_front();
        }
        self.lines.push_back(line);
    }
}

/// Runs one seed to the end, in a fresh single-threaded runtime with paused time.
///
/// # Errors
/// Only when the runtime cannot be built (out of threads or memory).
pub fn run_seed(seed: u64, options: &SimOptions) -> std::io::Result<Report> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?;
    Ok(rt.block_on(world::simulate(seed, options.clone())))
}
