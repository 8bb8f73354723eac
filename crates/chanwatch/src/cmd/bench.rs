//! `chanwatch bench`: benchmarks that print one JSON line per result on stdout and a table on
//! stderr.
//!
//! Owns: the flags of every benchmark (`Args`, `What`, one `Bench*Args` each), choosing one,
//! and the median every benchmark reports. The workloads are in `store` (store floor),
//! `failover`, `system` (assign, balance, ack, planner) and `exec` (`--exec` workers).
//! Must not: assert on timings (benchmarks report; they never fail for being slow).

use std::sync::Arc;

use anyhow::Result;
use chanwatch_store::{EmbeddedStore, MetaStore};
use clap::{Args as ClapArgs, Subcommand, ValueEnum};

use crate::flags::EtcdArgs;

mod exec;
mod failover;
mod store;
mod system;

/// Flags of `bench`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(subcommand)]
    pub what: What,
}

/// Which benchmark.
#[derive(Debug, Subcommand)]
pub enum What {
    /// Store floor: single-key CAS txns (serial and concurrent) and 128-op txns.
    Store(BenchStoreArgs),
    /// Failover: kill nodes, time from session loss to every moved channel Watched.
    Failover(BenchFailoverArgs),
    /// Assignment: register channels through the coordinator until all are Watched.
    Assign(BenchAssignArgs),
    /// Balance: nodes join a loaded cluster; time to max - min <= 1, moves vs the minimum.
    Balance(BenchBalanceArgs),
    /// Ack latency: assignments committed at once; for each, time from its PUT to its Watched PUT, both as one watcher sees them.
    Ack(BenchAckArgs),
    /// The coordinator's own cost: memory of its view and time of one plan round, with
    /// no store, nodes or network in the figure.
    Planner(BenchPlannerArgs),
    /// `--exec` workers: time to start a child per channel, node memory per child, agent
    /// commits/s against the in-process handler's (embedded store, one node).
    Exec(BenchExecArgs),
}

/// Flags of `bench exec`.
#[derive(Debug, ClapArgs)]
pub struct BenchExecArgs {
    /// Channels (one trivial child each) for the start and memory figures.
    #[arg(long, default_value_t = 1000)]
    pub channels: usize,
    /// Channels committing at once for the commits/s figures (a Python child each).
    #[arg(long, default_value_t = 16)]
    pub commit_channels: usize,
    /// How long each committer commits.
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
}

/// Flags of `bench planner`.
#[derive(Debug, ClapArgs)]
pub struct BenchPlannerArgs {
    /// Channels in the view.
    #[arg(long, default_value_t = 100_000)]
    pub channels: usize,
    /// Live nodes in the view.
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    /// Repetitions; medians are reported.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
}

/// Flags of `bench assign`.
#[derive(Debug, ClapArgs)]
pub struct BenchAssignArgs {
    /// Which backend to measure.
    #[arg(long, value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// Channels to register.
    #[arg(long, default_value_t = 100_000)]
    pub channels: usize,
    /// Nodes (in-process tasks).
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    /// Repetitions; medians are reported.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Flags of `bench balance`.
#[derive(Debug, ClapArgs)]
pub struct BenchBalanceArgs {
    /// Which backend to measure.
    #[arg(long, value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// Nodes before the join.
    #[arg(long, default_value_t = 100)]
    pub nodes: usize,
    /// Channels, spread evenly over the first nodes.
    #[arg(long, default_value_t = 10_000)]
    pub channels: usize,
    /// Nodes that join.
    #[arg(long, default_value_t = 10)]
    pub join: usize,
    /// Most moves in flight (the coordinator's --max-concurrent-moves).
    #[arg(long, default_value_t = 16)]
    pub max_concurrent_moves: usize,
    /// Repetitions; medians are reported.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Flags of `bench ack`.
#[derive(Debug, ClapArgs)]
pub struct BenchAckArgs {
    /// Which backend to measure.
    #[arg(long, value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// Nodes.
    #[arg(long, default_value_t = 10)]
    pub nodes: usize,
    /// Assignments committed at once.
    #[arg(long, default_value_t = 1000)]
    pub channels: usize,
    /// Repetitions; medians are reported.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Flags of `bench failover`.
#[derive(Debug, ClapArgs)]
pub struct BenchFailoverArgs {
    /// Which backend to measure.
    #[arg(long, value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// Nodes before the kill.
    #[arg(long, default_value_t = 100)]
    pub nodes: usize,
    /// Channels, spread evenly over the nodes.
    #[arg(long, default_value_t = 10_000)]
    pub channels: usize,
    /// Nodes killed at once; a comma-separated list runs each case.
    #[arg(long, value_delimiter = ',', default_value = "1,10")]
    pub kill: Vec<usize>,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Which backend a benchmark measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    Embedded,
    Etcd,
}

/// Flags of `bench store`.
#[derive(Debug, ClapArgs)]
pub struct BenchStoreArgs {
    /// Which backend to measure.
    #[arg(long, value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// Single-key CAS txns per run [default: 200000 embedded, 2000 etcd].
    #[arg(long)]
    pub txns: Option<usize>,
    /// Concurrent tasks for the concurrent CAS figure.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Operations per batched txn.
    #[arg(long, default_value_t = 128)]
    pub batch_ops: usize,
    /// Repetitions; medians are reported.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Runs the chosen benchmark.
///
/// # Errors
/// Store errors, or a run that does not settle in time.
pub async fn run(args: Args) -> Result<()> {
    match args.what {
        What::Store(args) => {
            let store: Arc<dyn MetaStore> = match args.store {
                StoreKind::Embedded => Arc::new(EmbeddedStore::new()),
                StoreKind::Etcd => args.etcd.connect().await?,
            };
            store::run(store, &args).await
        }
        What::Failover(args) => failover::run(&args).await,
        What::Assign(args) => system::assign(&args).await,
        What::Balance(args) => system::balance(&args).await,
        What::Planner(args) => system::planner(&args),
        What::Ack(args) => system::ack(&args).await,
        What::Exec(args) => exec::run(&args).await,
    }
}

/// The median (upper middle for even counts); 0 for none.
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}
