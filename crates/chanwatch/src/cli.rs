//! Command-line definition and dispatch.
//!
//! Owns: flag names, defaults, `--help` texts, and turning flags into library configs.
//! Must not: implement behaviour beyond wiring.
//!
//! Over 600 lines because it is one documented argument struct per subcommand (each flag's
//! `--help` text is its documentation) plus the dispatch; there is no logic to split off.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use chanwatch_store::{EmbeddedStore, EtcdConfig, EtcdStore, MetaStore, TlsFiles};
use clap::{Args, Parser, Subcommand, ValueEnum};

/// chanwatch: the channel-assignment control plane of a sharded streaming database.
///
/// A coordinator assigns channels to nodes through etcd transactions; nodes watch their own
/// keys and start or stop channels. See the README for a walk-through.
#[derive(Debug, Parser)]
#[command(name = "chanwatch", version, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Flags shared by every subcommand.
#[derive(Debug, Args)]
pub struct Global {
    /// A TOML file of flag values (keys are long flag names, e.g. `session-ttl = "5s"`).
    /// Precedence: flags, then environment, then this file.
    #[arg(long, global = true, env = "CHANWATCH_CONFIG")]
    pub config: Option<PathBuf>,
    /// Log format: human-readable text or one JSON object per line.
    #[arg(long, global = true, env = "CHANWATCH_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// How to reach etcd (used by every subcommand that talks to a real store).
#[derive(Debug, Clone, Args)]
pub struct EtcdArgs {
    /// etcd endpoints, comma-separated.
    #[arg(
        long,
        env = "CHANWATCH_ENDPOINTS",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:2379"
    )]
    pub endpoints: Vec<String>,
    /// How long to wait for etcd to answer when connecting.
    #[arg(long, env = "CHANWATCH_CONNECT_TIMEOUT", value_parser = humantime_secs, default_value = "5s")]
    pub connect_timeout: Duration,
    /// etcd username (auth enabled).
    #[arg(long, env = "CHANWATCH_ETCD_USER", requires = "etcd_password")]
    pub etcd_user: Option<String>,
    /// etcd password.
    #[arg(
        long,
        env = "CHANWATCH_ETCD_PASSWORD",
        requires = "etcd_user",
        hide_env_values = true
    )]
    pub etcd_password: Option<String>,
    /// CA certificate (PEM) to verify etcd's TLS certificate.
    #[arg(long, env = "CHANWATCH_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS.
    #[arg(long, env = "CHANWATCH_ETCD_CERT", requires = "etcd_key")]
    pub etcd_cert: Option<PathBuf>,
    /// Client private key (PEM) for mutual TLS.
    #[arg(long, env = "CHANWATCH_ETCD_KEY", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
}

impl EtcdArgs {
    pub fn config(&self) -> EtcdConfig {
        let tls = (self.etcd_ca.is_some() || self.etcd_cert.is_some()).then(|| TlsFiles {
            ca: self.etcd_ca.clone(),
            cert: self.etcd_cert.clone(),
            key: self.etcd_key.clone(),
        });
        EtcdConfig {
            endpoints: self.endpoints.clone(),
            connect_timeout: self.connect_timeout,
            user: self.etcd_user.clone().zip(self.etcd_password.clone()),
            tls,
            ..EtcdConfig::default()
        }
    }

    /// Connects to etcd.
    ///
    /// # Errors
    /// One line saying which endpoints did not answer and what to check.
    pub async fn connect(&self) -> Result<Arc<dyn MetaStore>> {
        let store = EtcdStore::connect(self.config())
            .await
            .with_context(|| format!("etcd unreachable at {}", self.endpoints.join(",")))?;
        Ok(Arc::new(store))
    }

    /// Connects to etcd with a connection check that reads only under the root
    /// (`{root}/id/node`, readable by every part's role), so prefix-limited roles work.
    ///
    /// # Errors
    /// One line saying which endpoints did not answer and what to check.
    pub async fn connect_under(&self, keys: &chanwatch_core::Keys) -> Result<Arc<dyn MetaStore>> {
        let config = EtcdConfig {
            probe_key: Some(keys.node_id_counter()),
            ..self.config()
        };
        let store = EtcdStore::connect(config)
            .await
            .with_context(|| format!("etcd at {}", self.endpoints.join(",")))?;
        Ok(Arc::new(store))
    }

    /// Like [`Self::connect_under`], for long-running processes: while etcd is down, out of
    /// space or otherwise failing in a way that can pass, waits (logging why) and tries
    /// again; only a configuration error (bad URL, unreadable TLS file, refused credentials
    /// or role) ends it.
    ///
    /// # Errors
    /// The configuration error.
    pub async fn connect_waiting(&self, keys: &chanwatch_core::Keys) -> Result<Arc<dyn MetaStore>> {
        let config = EtcdConfig {
            probe_key: Some(keys.node_id_counter()),
            ..self.config()
        };
        let mut wait = Duration::from_millis(500);
        loop {
            match EtcdStore::connect(config.clone()).await {
                Ok(store) => return Ok(Arc::new(store)),
                Err(e) if !e.is_config() => {
                    tracing::warn!(error = %e, ?wait, "cannot connect to etcd yet; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(10));
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("etcd at {}", self.endpoints.join(",")))
                }
            }
        }
    }
}

/// Parses `10s`, `500ms`, `2m`, `1h 30m` (humantime syntax).
pub fn humantime_secs(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration ({e}); use e.g. 10s, 500ms, 2m"))
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// A scripted tour on the embedded store: nodes join, channels are assigned, a node dies,
    /// a node joins, a node drains, all die, one returns. Checks invariants at every step.
    Demo,
    /// Coordinator and nodes in one process on the embedded store, with the admin API.
    Standalone(StandaloneArgs),
    /// Run a coordinator: campaigns for leadership; the leader assigns channels to nodes.
    Coord(CoordArgs),
    /// Run a node: registers a session, runs the channels assigned to it.
    Node(NodeArgs),
    /// Inspect and change the cluster (reads etcd, sends changes to the leader).
    Ctl(CtlArgs),
    /// Benchmarks; one JSON line per result on stdout, a table on stderr.
    Bench(BenchArgs),
    /// Deterministic simulation: whole clusters (2 coordinators, nodes, embedded store) on
    /// simulated time under seeded random faults, checking the invariants of DESIGN.md §6
    /// after every step. The same seed always replays the same run.
    Sim(SimArgs),
}

/// Flags of `sim`.
#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// How many seeds to run (seeds START, START+1, ...).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    pub seeds: u64,
    /// First seed.
    #[arg(long, default_value_t = 0)]
    pub start: u64,
    /// Run just this seed (replay a failure); with --trace, print its whole trace.
    #[arg(long, conflicts_with_all = ["seeds", "start"])]
    pub seed: Option<u64>,
    /// Print every line of the trace as it happens (with --seed).
    #[arg(long, requires = "seed")]
    pub trace: bool,
    /// Fault steps per seed before the faults stop and the cluster must settle.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub steps: u32,
    /// Seeds run at once (default: one per core).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub jobs: Option<u64>,
    /// Also print the summary as one JSON line on stdout.
    #[arg(long)]
    pub json: bool,
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
}

/// The root prefix of every key.
#[derive(Debug, Clone, Args)]
pub struct RootArg {
    /// Prefix under which chanwatch keeps all its keys.
    #[arg(long, env = "CHANWATCH_ROOT", default_value = "chanwatch")]
    pub root: String,
}

#[derive(Debug, Args)]
pub struct StandaloneArgs {
    /// Nodes to run.
    #[arg(long, env = "CHANWATCH_NODES", default_value_t = 3)]
    pub nodes: usize,
    /// Channels to register at start (named ch-000, ch-001, ...).
    #[arg(long, env = "CHANWATCH_CHANNELS", default_value_t = 0)]
    pub channels: usize,
    /// Admin HTTP API address.
    #[arg(long, env = "CHANWATCH_ADMIN", default_value = "127.0.0.1:9870")]
    pub admin: String,
    /// Bearer token required for admin writes; mandatory when --admin is not loopback.
    #[arg(long, env = "CHANWATCH_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Host names the admin API answers to besides IP addresses and localhost (comma-separated,
    /// e.g. the DNS name Prometheus scrapes); any other Host header is refused (DNS rebinding).
    #[arg(long, env = "CHANWATCH_ADMIN_HOST", value_delimiter = ',')]
    pub admin_host: Vec<String>,
    /// Session lease TTL of the in-process nodes and coordinator.
    #[arg(long, env = "CHANWATCH_SESSION_TTL", value_parser = humantime_secs, default_value = "10s")]
    pub session_ttl: Duration,
    /// How long each simulated channel load takes.
    #[arg(long, env = "CHANWATCH_LOAD_DELAY", value_parser = humantime_secs, default_value = "0s")]
    pub load_delay: Duration,
    #[command(flatten)]
    pub test_load: TestLoadArgs,
}

/// Switches for black-box tests of the built-in simulated load, hidden from `--help`.
#[derive(Debug, Clone, Default, Args)]
pub struct TestLoadArgs {
    /// FOR TESTS: loads of channels matching these comma-separated globs (`*` = any run of
    /// characters) fail at once, so the channel becomes WatchFailed.
    #[arg(
        long,
        env = "CHANWATCH_FAIL_LOAD",
        hide = true,
        value_name = "GLOB,..."
    )]
    pub fail_load: Option<chanwatch_node::NamePatterns>,
    /// FOR TESTS: loads of matching channels never finish and report no progress.
    #[arg(
        long,
        env = "CHANWATCH_HANG_LOAD",
        hide = true,
        value_name = "GLOB,..."
    )]
    pub hang_load: Option<chanwatch_node::NamePatterns>,
    /// FOR TESTS: matching channels load, run for --fail-running-after, then report
    /// themselves broken (the node stops them and acknowledges WatchFailed).
    #[arg(
        long,
        env = "CHANWATCH_FAIL_RUNNING",
        hide = true,
        value_name = "GLOB,..."
    )]
    pub fail_running: Option<chanwatch_node::NamePatterns>,
    /// FOR TESTS: how long a --fail-running channel runs before it breaks.
    #[arg(long, env = "CHANWATCH_FAIL_RUNNING_AFTER", hide = true, value_parser = humantime_secs, default_value = "1s")]
    pub fail_running_after: Duration,
}

impl TestLoadArgs {
    /// The simulated load with these switches.
    pub fn simulated_load(&self, load_delay: Duration) -> chanwatch_node::SimulatedLoad {
        chanwatch_node::SimulatedLoad {
            load_delay,
            fail_load: self.fail_load.clone().unwrap_or_default(),
            hang_load: self.hang_load.clone().unwrap_or_default(),
            fail_running: self.fail_running.clone().unwrap_or_default(),
            fail_running_after: self.fail_running_after,
        }
    }
}

#[derive(Debug, Args)]
pub struct CoordArgs {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub root: RootArg,
    /// Admin HTTP API address (loopback unless you mean otherwise).
    #[arg(long, env = "CHANWATCH_ADMIN", default_value = "127.0.0.1:9870")]
    pub admin: String,
    /// Bearer token required for admin writes; mandatory when --admin is not loopback.
    #[arg(long, env = "CHANWATCH_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Host names the admin API answers to besides IP addresses and localhost (comma-separated,
    /// e.g. the DNS name Prometheus scrapes); any other Host header is refused (DNS rebinding).
    #[arg(long, env = "CHANWATCH_ADMIN_HOST", value_delimiter = ',')]
    pub admin_host: Vec<String>,
    /// Leader lease TTL: a standby takes over within about this long after the leader dies.
    #[arg(long, env = "CHANWATCH_SESSION_TTL", value_parser = humantime_secs, default_value = "10s")]
    pub session_ttl: Duration,
    /// A ToWatch assignment with no progress for this long is reassigned.
    #[arg(long, env = "CHANWATCH_WATCH_TIMEOUT", value_parser = humantime_secs, default_value = "30s")]
    pub watch_timeout: Duration,
    /// Period of the full relist that catches anything a watch missed.
    #[arg(long, env = "CHANWATCH_RECONCILE_INTERVAL", value_parser = humantime_secs, default_value = "10s")]
    pub reconcile_interval: Duration,
    /// Most operations in one etcd txn (etcd's --max-txn-ops).
    #[arg(long, env = "CHANWATCH_MAX_TXN_OPS", default_value_t = 128, value_parser = clap::value_parser!(u32).range(4..=10_000))]
    pub max_txn_ops: u32,
    /// Most balance/drain moves in flight at once.
    #[arg(long, env = "CHANWATCH_MAX_CONCURRENT_MOVES", default_value_t = 16)]
    pub max_concurrent_moves: usize,
    /// A channel asked to release (ToRelease) that is not Released within this long gets its
    /// node fenced: the leader revokes the node's session lease, and the node's channels move
    /// one session TTL later, when it has surely stopped them. Must exceed the nodes' TTL.
    #[arg(long, env = "CHANWATCH_RELEASE_TIMEOUT", value_parser = humantime_secs, default_value = "30s")]
    pub release_timeout: Duration,
    /// Balance starts no move for this long after a node joined or left, a load failed or a
    /// channel timed out, so that a disturbance is not answered with churn.
    #[arg(long, env = "CHANWATCH_BALANCE_QUIET", value_parser = humantime_secs, default_value = "5s")]
    pub balance_quiet: Duration,
    /// Balance does not move a channel that moved (for any reason) within this long.
    #[arg(long, env = "CHANWATCH_MOVE_COOLDOWN", value_parser = humantime_secs, default_value = "60s")]
    pub move_cooldown: Duration,
    /// FOR TESTS: switch one safety rule of the planner off, to prove a black-box test
    /// catches it (tests/blackbox.rs). Never in production.
    #[arg(long, value_enum, hide = true)]
    pub plant: Option<CoordPlantArg>,
}

/// Planner bugs `coord --plant` can switch on (a subset of [`PlantArg`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CoordPlantArg {
    /// A channel stuck in ToRelease is moved beside its live owner, without fencing it.
    ForceWithoutFence,
    /// Balance ignores failing-node back-offs, troubled nodes and cool-downs.
    BalanceIgnoresBackoff,
}

impl CoordPlantArg {
    /// The planner's switch.
    pub fn planner_bug(self) -> chanwatch_core::planner::PlannerBug {
        match self {
            CoordPlantArg::ForceWithoutFence => {
                chanwatch_core::planner::PlannerBug::ForceWithoutFence
            }
            CoordPlantArg::BalanceIgnoresBackoff => {
                chanwatch_core::planner::PlannerBug::BalanceIgnoresBackoff
            }
        }
    }
}

#[derive(Debug, Args)]
pub struct NodeArgs {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub root: RootArg,
    /// Node admin HTTP address (/healthz); port 0 picks a free port.
    #[arg(long, env = "CHANWATCH_NODE_ADMIN", default_value = "127.0.0.1:0")]
    pub admin: String,
    /// Session lease TTL (minimum 2s): the node's channels move this long after it dies.
    #[arg(long, env = "CHANWATCH_SESSION_TTL", value_parser = humantime_secs, default_value = "10s")]
    pub session_ttl: Duration,
    /// How long the built-in simulated load of a channel takes.
    #[arg(long, env = "CHANWATCH_LOAD_DELAY", value_parser = humantime_secs, default_value = "0s")]
    pub load_delay: Duration,
    /// Least time between two progress writes of one load.
    #[arg(long, env = "CHANWATCH_PROGRESS_INTERVAL", value_parser = humantime_secs, default_value = "5s")]
    pub progress_interval: Duration,
    /// Append a line to this file whenever a channel starts or stops running here
    /// (`start|stop|pause|resume NODE CHANNEL EPOCH UNIX_MS`), to audit single ownership.
    #[arg(long, env = "CHANWATCH_HANDLER_LOG")]
    pub handler_log: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub test_load: TestLoadArgs,
    /// Test only (hidden): switch a node safety mechanism off, so that a black-box test can
    /// check what stands behind it (tests/blackbox.rs). Never in production.
    #[arg(long, value_enum, hide = true)]
    pub plant: Option<NodePlantArg>,
}

/// Node safety mechanisms `node --plant` can switch off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NodePlantArg {
    /// The node ignores watch progress: a watch that stalls silently goes unnoticed, and
    /// only the coordinator's fence keeps one owner.
    NoWatchProgress,
}

#[derive(Debug, Args)]
pub struct CtlArgs {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub root: RootArg,
    /// Bearer token for the leader's admin API, when it requires one.
    #[arg(long, env = "CHANWATCH_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    #[command(subcommand)]
    pub what: CtlCommand,
}

#[derive(Debug, Subcommand)]
pub enum CtlCommand {
    /// List channels: channel, node (or remaining), state, epoch, age, and whether the node
    /// says it has paused them (asked over its admin HTTP; etcd cannot know).
    Channels {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// List live nodes, their channel counts and status (running, PAUSED, ? when the node
    /// did not answer its `/status`).
    Nodes {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Register a channel; the leader assigns it to the least-loaded node.
    AddChannel {
        /// Channel name: 1-255 characters of [A-Za-z0-9._-].
        name: String,
        /// What a node needs to restore it, as JSON (at most 64 KiB), e.g.
        /// '{"collection_id":7,"seek_position":"..."}'.
        #[arg(long)]
        vchannel: Option<String>,
    },
    /// Remove a channel; its node stops it at once.
    RemoveChannel {
        /// Channel name.
        name: String,
    },
    /// Move a channel to a node (break-before-make).
    Move {
        /// Channel name.
        name: String,
        /// Target node ID.
        #[arg(long)]
        to: u64,
    },
    /// Move every channel off a node and stop assigning to it.
    Drain {
        /// Node ID.
        node: u64,
    },
    /// Even out channels over nodes (max - min <= 1).
    Balance {
        /// Print the plan (channel, from, to) without moving anything.
        #[arg(long)]
        dry_run: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchWhat,
}

#[derive(Debug, Subcommand)]
pub enum BenchWhat {
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
}

#[derive(Debug, Args)]
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

#[derive(Debug, Args)]
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

#[derive(Debug, Args)]
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

#[derive(Debug, Args)]
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

#[derive(Debug, Args)]
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    Embedded,
    Etcd,
}

#[derive(Debug, Args)]
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

/// Sets up `tracing` with `RUST_LOG` (default `default_level`) in the chosen format.
pub fn init_logging(global: &Global, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match global.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Runs the chosen subcommand.
///
/// # Errors
/// Whatever the subcommand reports, as one line for the user.
pub async fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Demo => crate::demo::run().await,
        Command::Standalone(args) => crate::cmd::standalone(args).await,
        Command::Coord(args) => crate::cmd::coord(args).await,
        Command::Node(args) => crate::cmd::node(args).await,
        Command::Ctl(args) => crate::ctl::run(args).await,
        Command::Bench(b) => match b.what {
            BenchWhat::Store(args) => {
                let store: Arc<dyn MetaStore> = match args.store {
                    StoreKind::Embedded => Arc::new(EmbeddedStore::new()),
                    StoreKind::Etcd => args.etcd.connect().await?,
                };
                crate::bench::store(store, &args).await
            }
            BenchWhat::Failover(args) => crate::bench::failover(&args).await,
            BenchWhat::Assign(args) => crate::bench_system::assign(&args).await,
            BenchWhat::Balance(args) => crate::bench_system::balance(&args).await,
            BenchWhat::Planner(args) => crate::bench_system::planner(&args),
            BenchWhat::Ack(args) => crate::bench_system::ack(&args).await,
        },
        // Each seed runs on a runtime of its own, on plain threads.
        Command::Sim(args) => tokio::task::spawn_blocking(move || crate::sim::run(&args))
            .await
            .map_err(|e| anyhow::anyhow!("the simulation crashed: {e}"))?,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations_parse_with_units_and_refuse_garbage() {
        assert_eq!(humantime_secs("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(humantime_secs("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(humantime_secs("2m"), Ok(Duration::from_secs(120)));
        assert!(humantime_secs("ten").is_err());
        assert!(humantime_secs("5 parsecs").is_err());
        assert!(humantime_secs("").is_err());
    }

    /// What the switches make the load do is tested beside `SimulatedLoad`.
    #[test]
    fn the_hidden_test_switches_reach_the_simulated_load_and_stay_out_of_help() {
        let cli = Cli::try_parse_from([
            "chanwatch",
            "node",
            "--fail-load",
            "bad-*,worse",
            "--hang-load",
            "stuck*",
            "--fail-running",
            "brk",
            "--fail-running-after",
            "250ms",
        ])
        .expect("parses");
        let Command::Node(args) = cli.command else {
            panic!("not the node command");
        };
        let load = args.test_load.simulated_load(Duration::ZERO);
        assert!(load.fail_load.matches("bad-7") && load.fail_load.matches("worse"));
        assert!(load.hang_load.matches("stuck-1") && !load.hang_load.matches("ok"));
        assert!(load.fail_running.matches("brk") && !load.fail_running.matches("brk2"));
        assert_eq!(load.fail_running_after, Duration::from_millis(250));
        assert!(!load.fail_load.matches("ok-1"));
        let mut help = Vec::new();
        let mut cmd = Cli::command();
        let node = cmd.find_subcommand_mut("node").expect("node subcommand");
        node.write_long_help(&mut help).expect("help renders");
        let help = String::from_utf8_lossy(&help);
        assert!(
            !help.contains("fail-load")
                && !help.contains("hang-load")
                && !help.contains("fail-running"),
            "test switches must stay out of --help:\n{help}"
        );
        let plain = Cli::try_parse_from(["chanwatch", "standalone"]).expect("parses");
        let Command::Standalone(args) = plain.command else {
            panic!("not the standalone command");
        };
        let load = args.test_load.simulated_load(Duration::ZERO);
        assert!(load.fail_load.is_empty() && load.hang_load.is_empty());
    }

    /// What the planted bugs do is tested in the planner and in tests/blackbox.rs.
    #[test]
    fn coord_plant_reaches_the_planner_and_stays_out_of_help() {
        use chanwatch_core::planner::PlannerBug;
        for (flag, bug) in [
            ("force-without-fence", PlannerBug::ForceWithoutFence),
            ("balance-ignores-backoff", PlannerBug::BalanceIgnoresBackoff),
        ] {
            let cli = Cli::try_parse_from(["chanwatch", "coord", "--plant", flag]).expect("parses");
            let Command::Coord(args) = cli.command else {
                panic!("not the coord command");
            };
            assert_eq!(args.plant.map(CoordPlantArg::planner_bug), Some(bug));
        }
        let cli = Cli::try_parse_from(["chanwatch", "coord"]).expect("parses");
        let Command::Coord(args) = cli.command else {
            panic!("not the coord command");
        };
        assert_eq!(args.plant, None, "no bug unless asked for");
        let mut help = Vec::new();
        let mut cmd = Cli::command();
        let coord = cmd.find_subcommand_mut("coord").expect("coord subcommand");
        coord.write_long_help(&mut help).expect("help renders");
        let help = String::from_utf8_lossy(&help);
        assert!(
            !help.contains("plant"),
            "--plant must stay out of --help:\n{help}"
        );
    }
}
