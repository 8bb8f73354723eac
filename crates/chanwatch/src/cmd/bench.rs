//! `chanwatch bench`: benchmarks that print one JSON line per result on stdout and a table on
//! stderr.
//!
//! Owns: the flags of every benchmark (`Args`, `What`, one `Bench*Args` each), choosing one,
//! and the median every benchmark reports. The workloads are in `store` (store floor),
//! `failover`, `system` (assign, balance, ack) and `planner` (the view alone); the data
//! plane's in `checkpoint` (fenced commits), `consume` (consumer throughput against a bare
//! reader) and `data_failover` (a consuming node killed under load), with their instruments
//! in `meter`; `exec` (`--exec` workers) and `exec_worker` (the compiled child it spawns);
//! `register`, `idle` and `rolling_restart` (real processes on etcd).
//! Must not: assert on timings (benchmarks report; they never fail for being slow).

use std::sync::Arc;

use anyhow::Result;
use chanwatch_store::{EmbeddedStore, MetaStore};
use clap::{Args as ClapArgs, Subcommand, ValueEnum};

use crate::flags::EtcdArgs;

mod checkpoint;
mod consume;
mod data_failover;
mod exec;
mod exec_worker;
mod failover;
mod idle;
mod meter;
mod planner;
mod register;
mod rolling_restart;
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
    /// Checkpoint commits: every channel's handler commits on a timer; commits/s landed,
    /// store txns/s spent on them (group commit), commit latency.
    Checkpoint(BenchCheckpointArgs),
    /// Consumer throughput of one node on a pre-filled log, beside a bare reader of the same
    /// stream in the same run.
    Consume(BenchConsumeArgs),
    /// A node consuming under a steady producer is killed: time until every moved channel
    /// commits again on its new owner, and the messages re-read.
    DataFailover(BenchDataFailoverArgs),
    /// `--exec` workers: time to start a child per channel, node memory per child, agent
    /// commits/s against the in-process handler's (embedded store, one node).
    Exec(BenchExecArgs),
    /// The compiled worker `bench exec` runs per channel (hidden): `POST /ready`, then commits
    /// 1, 2, 3, … through the agent for `--seconds` on one keep-alive connection, then idles.
    #[command(hide = true)]
    ExecWorker(BenchExecWorkerArgs),
    /// A settled cluster that nothing changes: etcd's requests/s and bytes/s by method (from
    /// its `/metrics`) and the process's CPU over an idle window, at each size.
    Idle(BenchIdleArgs),
    /// Planned rolling restart of real node processes on etcd: each node in turn gets
    /// SIGTERM and is replaced; time each moved channel ran nowhere, moves per channel per
    /// restart, failovers (`--shutdown-timeout 0s`: the behaviour before planned restarts).
    RollingRestart(BenchRollingRestartArgs),
    /// Registration: channels from `ctl add-channels --from-file` until all are Watched,
    /// against the floor of writing the same keys and acks in packed txns.
    Register(BenchRegisterArgs),
}

/// Flags of `bench register`.
#[derive(Debug, ClapArgs)]
pub struct BenchRegisterArgs {
    /// Which backend (`ctl add-channels` needs etcd; `--one-by-one` runs on either).
    #[arg(long, env = "CHANWATCH_BENCH_STORE", value_enum, default_value_t = StoreKind::Etcd)]
    pub store: StoreKind,
    /// Channels to register.
    #[arg(long, env = "CHANWATCH_BENCH_CHANNELS", default_value_t = 50_000)]
    pub channels: usize,
    /// Nodes (in-process, each with its own etcd connection).
    #[arg(long, env = "CHANWATCH_BENCH_NODES", default_value_t = 20)]
    pub nodes: usize,
    /// The old way instead of the file: one API call per channel, 16 clients.
    #[arg(long, env = "CHANWATCH_BENCH_ONE_BY_ONE")]
    pub one_by_one: bool,
    /// Repetitions; medians are reported.
    #[arg(long, env = "CHANWATCH_BENCH_RUNS", default_value_t = 3)]
    pub runs: usize,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Flags of `bench idle`.
#[derive(Debug, ClapArgs)]
pub struct BenchIdleArgs {
    /// Which backend to measure (etcd's counters only with `etcd`).
    #[arg(long, env = "CHANWATCH_BENCH_STORE", value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// Channel counts, one cluster each (comma-separated).
    #[arg(
        long,
        env = "CHANWATCH_BENCH_CHANNELS",
        value_delimiter = ',',
        default_value = "2000,20000"
    )]
    pub channels: Vec<usize>,
    /// Nodes.
    #[arg(long, env = "CHANWATCH_BENCH_NODES", default_value_t = 20)]
    pub nodes: usize,
    /// The idle window measured.
    #[arg(long, env = "CHANWATCH_BENCH_DURATION", value_parser = humantime::parse_duration, default_value = "120s")]
    pub duration: std::time::Duration,
    /// Wait after every channel is Watched, before the window.
    #[arg(long, env = "CHANWATCH_BENCH_SETTLE", value_parser = humantime::parse_duration, default_value = "10s")]
    pub settle: std::time::Duration,
    /// The coordinator's --resync-interval (the old behaviour: 10s).
    #[arg(long, env = "CHANWATCH_BENCH_RESYNC_INTERVAL", value_parser = humantime::parse_duration, default_value = "5m")]
    pub resync_interval: std::time::Duration,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Flags of `bench checkpoint`.
#[derive(Debug, ClapArgs)]
pub struct BenchCheckpointArgs {
    /// Which backend to measure.
    #[arg(long, env = "CHANWATCH_BENCH_STORE", value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// Channels, spread evenly over the nodes.
    #[arg(long, env = "CHANWATCH_BENCH_CHANNELS", default_value_t = 10_000)]
    pub channels: usize,
    /// Nodes (in-process tasks; on etcd each with a connection of its own).
    #[arg(long, env = "CHANWATCH_BENCH_NODES", default_value_t = 10)]
    pub nodes: usize,
    /// How often each channel commits.
    #[arg(long, env = "CHANWATCH_BENCH_COMMIT_EVERY", value_parser = humantime::parse_duration, default_value = "100ms")]
    pub commit_every: std::time::Duration,
    /// How long each run measures (after every channel is Watched and committing).
    #[arg(long, env = "CHANWATCH_BENCH_DURATION", value_parser = humantime::parse_duration, default_value = "10s")]
    pub duration: std::time::Duration,
    /// Every channel commits at the same instants (rounds of --commit-every), the group
    /// commit's best case; by default each channel's timer is offset by its name, spread
    /// over the period.
    #[arg(long, env = "CHANWATCH_BENCH_ALIGNED")]
    pub aligned: bool,
    /// Repetitions; medians are reported.
    #[arg(long, env = "CHANWATCH_BENCH_RUNS", default_value_t = 3)]
    pub runs: usize,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Flags of `bench consume`.
#[derive(Debug, ClapArgs)]
pub struct BenchConsumeArgs {
    /// The log: `file:DIR` (a fresh sub-dir per run, removed after) or `nats://HOST:PORT` (a
    /// fresh stream per run, deleted after). Default: a file log under the temp dir.
    #[arg(long, env = "CHANWATCH_BENCH_LOG")]
    pub log: Option<String>,
    /// Messages pre-filled per run, spread evenly over the channels (the default is
    /// 25,600 per channel: the ~0.1 s from the assignment to the run's start stays small
    /// beside the reading).
    #[arg(long, env = "CHANWATCH_BENCH_MESSAGES", default_value_t = 409_600)]
    pub messages: usize,
    /// Channels.
    #[arg(long, env = "CHANWATCH_BENCH_CHANNELS", default_value_t = 16)]
    pub channels: usize,
    /// Payload bytes per message (at least 8: the sequence number).
    #[arg(long, env = "CHANWATCH_BENCH_PAYLOAD", default_value_t = 64)]
    pub payload: usize,
    /// The consumer's --commit-every (messages; the node's default is 100): how much the
    /// commits, awaited between reads, cost the handler. Keep messages per channel a
    /// multiple of it and of 256 (the read batch), or the last commit waits out the 1 s
    /// commit interval and the figure measures that wait.
    #[arg(long, env = "CHANWATCH_BENCH_COMMIT_EVERY", default_value_t = 100)]
    pub commit_every: u64,
    /// Repetitions; medians are reported.
    #[arg(long, env = "CHANWATCH_BENCH_RUNS", default_value_t = 3)]
    pub runs: usize,
}

/// Flags of `bench data-failover`.
#[derive(Debug, ClapArgs)]
pub struct BenchDataFailoverArgs {
    /// Which metadata store.
    #[arg(long, env = "CHANWATCH_BENCH_STORE", value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// The log: `file:DIR` or `nats://HOST:PORT` (fresh sub-dir or stream per run). Default:
    /// a file log under the temp dir.
    #[arg(long, env = "CHANWATCH_BENCH_LOG")]
    pub log: Option<String>,
    /// Nodes before the kill; one is killed.
    #[arg(long, env = "CHANWATCH_BENCH_NODES", default_value_t = 2)]
    pub nodes: usize,
    /// Channels, spread evenly over the nodes (the killed node holds channels / nodes).
    #[arg(long, env = "CHANWATCH_BENCH_CHANNELS", default_value_t = 2000)]
    pub channels: usize,
    /// Messages per second the producer appends, over all channels.
    #[arg(long, env = "CHANWATCH_BENCH_RATE", default_value_t = 2000)]
    pub rate: u64,
    /// How long messages flow before the kill.
    #[arg(long, env = "CHANWATCH_BENCH_WARMUP", value_parser = humantime::parse_duration, default_value = "5s")]
    pub warmup: std::time::Duration,
    /// The consumer's --commit-interval (it also commits every 100 messages).
    #[arg(long, env = "CHANWATCH_BENCH_COMMIT_INTERVAL", value_parser = humantime::parse_duration, default_value = "1s")]
    pub commit_interval: std::time::Duration,
    /// Repetitions; medians are reported.
    #[arg(long, env = "CHANWATCH_BENCH_RUNS", default_value_t = 3)]
    pub runs: usize,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Flags of `bench exec`.
#[derive(Debug, ClapArgs)]
pub struct BenchExecArgs {
    /// Channels (one trivial child each) for the start and memory figures.
    #[arg(long, env = "CHANWATCH_BENCH_CHANNELS", default_value_t = 1000)]
    pub channels: usize,
    /// Channels committing at once for the commits/s figures (a Python child each).
    #[arg(long, env = "CHANWATCH_BENCH_COMMIT_CHANNELS", default_value_t = 16)]
    pub commit_channels: usize,
    /// How long the commits/s figures are measured, every committer running.
    #[arg(long, env = "CHANWATCH_BENCH_SECONDS", default_value_t = 5)]
    pub seconds: u64,
    /// Who commits: children through the agent — `python` (TCP), `compiled` (its Unix
    /// socket), `compiled-tcp` — or `in-process`; `compiled-ping`: the compiled children
    /// ask `GET /state` instead of committing (the agent's round-trip ceiling, no store).
    #[arg(
        long,
        env = "CHANWATCH_BENCH_VIA",
        value_delimiter = ',',
        default_value = "compiled-ping,python,compiled,compiled-tcp,in-process"
    )]
    pub via: Vec<String>,
    /// Repetitions of the commits/s figures; medians are reported.
    #[arg(long, env = "CHANWATCH_BENCH_RUNS", default_value_t = 3)]
    pub runs: usize,
    /// Which store the coordinator and node run on: the embedded one (the floor is then an
    /// in-memory commit) or etcd (`--endpoints`; each cluster under a root of its own).
    #[arg(long, env = "CHANWATCH_BENCH_STORE", value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Flags of the hidden `bench exec-worker` (the compiled child `bench exec` spawns).
#[derive(Debug, ClapArgs)]
pub struct BenchExecWorkerArgs {
    /// Talk to the agent over TCP even when it has a Unix socket.
    #[arg(long, env = "CHANWATCH_BENCH_TCP")]
    pub tcp: bool,
    /// Ask `GET /state` over and over instead of committing (the transport's ceiling).
    #[arg(long, env = "CHANWATCH_BENCH_PING")]
    pub ping: bool,
}

/// Flags of `bench planner`.
#[derive(Debug, ClapArgs)]
pub struct BenchPlannerArgs {
    /// Channels in the view.
    #[arg(long, env = "CHANWATCH_BENCH_CHANNELS", default_value_t = 100_000)]
    pub channels: usize,
    /// Live nodes in the view.
    #[arg(long, env = "CHANWATCH_BENCH_NODES", default_value_t = 1000)]
    pub nodes: usize,
    /// Sessions that go at once before the timed failover round (their channels move).
    #[arg(long, env = "CHANWATCH_BENCH_KILL", default_value_t = 1)]
    pub kill: usize,
    /// Repetitions; medians are reported.
    #[arg(long, env = "CHANWATCH_BENCH_RUNS", default_value_t = 5)]
    pub runs: usize,
}

/// Flags of `bench assign`.
#[derive(Debug, ClapArgs)]
pub struct BenchAssignArgs {
    /// Which backend to measure.
    #[arg(long, env = "CHANWATCH_BENCH_STORE", value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// Channels to register.
    #[arg(long, env = "CHANWATCH_BENCH_CHANNELS", default_value_t = 100_000)]
    pub channels: usize,
    /// Nodes (in-process tasks).
    #[arg(long, env = "CHANWATCH_BENCH_NODES", default_value_t = 1000)]
    pub nodes: usize,
    /// Repetitions; medians are reported.
    #[arg(long, env = "CHANWATCH_BENCH_RUNS", default_value_t = 5)]
    pub runs: usize,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Flags of `bench balance`.
#[derive(Debug, ClapArgs)]
pub struct BenchBalanceArgs {
    /// Which backend to measure.
    #[arg(long, env = "CHANWATCH_BENCH_STORE", value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// Nodes before the join.
    #[arg(long, env = "CHANWATCH_BENCH_NODES", default_value_t = 100)]
    pub nodes: usize,
    /// Channels, spread evenly over the first nodes.
    #[arg(long, env = "CHANWATCH_BENCH_CHANNELS", default_value_t = 10_000)]
    pub channels: usize,
    /// Nodes that join.
    #[arg(long, env = "CHANWATCH_BENCH_JOIN", default_value_t = 10)]
    pub join: usize,
    /// Most moves in flight (the coordinator's --max-concurrent-moves).
    #[arg(
        long,
        env = "CHANWATCH_BENCH_MAX_CONCURRENT_MOVES",
        default_value_t = 16
    )]
    pub max_concurrent_moves: usize,
    /// Repetitions; medians are reported.
    #[arg(long, env = "CHANWATCH_BENCH_RUNS", default_value_t = 5)]
    pub runs: usize,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Flags of `bench ack`.
#[derive(Debug, ClapArgs)]
pub struct BenchAckArgs {
    /// Which backend to measure.
    #[arg(long, env = "CHANWATCH_BENCH_STORE", value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// Nodes.
    #[arg(long, env = "CHANWATCH_BENCH_NODES", default_value_t = 10)]
    pub nodes: usize,
    /// Assignments committed at once.
    #[arg(long, env = "CHANWATCH_BENCH_CHANNELS", default_value_t = 1000)]
    pub channels: usize,
    /// Repetitions; medians are reported.
    #[arg(long, env = "CHANWATCH_BENCH_RUNS", default_value_t = 5)]
    pub runs: usize,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Flags of `bench failover`.
#[derive(Debug, ClapArgs)]
pub struct BenchFailoverArgs {
    /// Which backend to measure.
    #[arg(long, env = "CHANWATCH_BENCH_STORE", value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// Nodes before the kill.
    #[arg(long, env = "CHANWATCH_BENCH_NODES", default_value_t = 100)]
    pub nodes: usize,
    /// Channels, spread evenly over the nodes.
    #[arg(long, env = "CHANWATCH_BENCH_CHANNELS", default_value_t = 10_000)]
    pub channels: usize,
    /// Nodes killed at once; a comma-separated list runs each case.
    #[arg(
        long,
        env = "CHANWATCH_BENCH_KILL",
        value_delimiter = ',',
        default_value = "1,10"
    )]
    pub kill: Vec<usize>,
    /// Repetitions; the median is reported.
    #[arg(long, env = "CHANWATCH_BENCH_RUNS", default_value_t = 5)]
    pub runs: usize,
    /// Set-up: channels seeded per step, each step waiting until the coordinator and the
    /// nodes have taken in the channels so far (at 1,000,000 one burst starved the nodes'
    /// keepalives on 2 cores).
    #[arg(long, env = "CHANWATCH_BENCH_SEED_STEP", default_value_t = 8192)]
    pub seed_step: usize,
    /// Wait after the set-up settled, before the kill (what the set-up left behind —
    /// compaction, the last plan rounds — out of the measured window).
    #[arg(long, env = "CHANWATCH_BENCH_SETTLE", value_parser = humantime::parse_duration, default_value = "2s")]
    pub settle: std::time::Duration,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Flags of `bench rolling-restart` (always real etcd: `--endpoints`).
#[derive(Debug, ClapArgs)]
pub struct BenchRollingRestartArgs {
    /// Node processes (each restarted once per run).
    #[arg(long, env = "CHANWATCH_BENCH_NODES", default_value_t = 5)]
    pub nodes: usize,
    /// Channels.
    #[arg(long, env = "CHANWATCH_BENCH_CHANNELS", default_value_t = 500)]
    pub channels: usize,
    /// The nodes' --shutdown-timeout; 0s stops and revokes at once (before planned restarts).
    #[arg(long, env = "CHANWATCH_BENCH_SHUTDOWN_TIMEOUT", value_parser = crate::flags::humantime_secs, default_value = "60s")]
    pub shutdown_timeout: std::time::Duration,
    /// Session TTL of every process.
    #[arg(long, env = "CHANWATCH_BENCH_SESSION_TTL", value_parser = crate::flags::humantime_secs, default_value = "10s")]
    pub session_ttl: std::time::Duration,
    /// The coordinator's --balance-quiet.
    #[arg(long, env = "CHANWATCH_BENCH_BALANCE_QUIET", value_parser = crate::flags::humantime_secs, default_value = "2s")]
    pub balance_quiet: std::time::Duration,
    /// Start each replacement before the SIGTERM (and wait until it registered), as a
    /// rolling update with surge does: the drain then fills the new node.
    #[arg(long, env = "CHANWATCH_BENCH_SURGE")]
    pub surge: bool,
    /// Repetitions; medians are reported.
    #[arg(long, env = "CHANWATCH_BENCH_RUNS", default_value_t = 3)]
    pub runs: usize,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// The coordinator's --move-cooldown; after the last restart the bench waits this long
    /// (and then some) for balance to even out the replacements.
    #[arg(long, env = "CHANWATCH_BENCH_MOVE_COOLDOWN", value_parser = crate::flags::humantime_secs, default_value = "60s")]
    pub move_cooldown: std::time::Duration,
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
    #[arg(long, env = "CHANWATCH_BENCH_STORE", value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// Single-key CAS txns per run [default: 200000 embedded, 2000 etcd].
    #[arg(long, env = "CHANWATCH_BENCH_TXNS")]
    pub txns: Option<usize>,
    /// Concurrent tasks for the concurrent CAS figure.
    #[arg(long, env = "CHANWATCH_BENCH_CONCURRENCY", default_value_t = 64)]
    pub concurrency: usize,
    /// Operations per batched txn.
    #[arg(long, env = "CHANWATCH_BENCH_BATCH_OPS", default_value_t = 128)]
    pub batch_ops: usize,
    /// Repetitions; medians are reported.
    #[arg(long, env = "CHANWATCH_BENCH_RUNS", default_value_t = 5)]
    pub runs: usize,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Runs `bench exec-worker`, the compiled worker `bench exec` spawns per channel: a
/// blocking loop, called without a runtime (`cli::main`).
///
/// # Errors
/// See [`exec_worker::run`].
pub fn exec_worker(args: &BenchExecWorkerArgs) -> Result<()> {
    exec_worker::run(args)
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
        What::Planner(args) => planner::planner(&args),
        What::Ack(args) => system::ack(&args).await,
        What::Checkpoint(args) => checkpoint::run(&args).await,
        What::Consume(args) => consume::run(&args).await,
        What::DataFailover(args) => data_failover::run(&args).await,
        What::Exec(args) => exec::run(&args).await,
        // Run by `cli::main` before any runtime is built (it is a blocking loop, a thousand
        // of them at once); never from here.
        What::ExecWorker(_) => {
            anyhow::bail!("bench exec-worker runs without a runtime: call bench::exec_worker")
        }
        What::Idle(args) => idle::run(&args).await,
        What::RollingRestart(args) => rolling_restart::run(&args).await,
        What::Register(args) => register::run(&args).await,
    }
}

/// The median (upper middle for even counts); 0 for none.
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}
