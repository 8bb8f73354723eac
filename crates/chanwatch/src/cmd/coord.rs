//! `chanwatch coord`: a coordinator built from flags, run until Ctrl-C or SIGTERM.
//!
//! Owns: the coordinator's flags (`Args`, the hidden `--plant`), turning them into a
//! `CoordinatorConfig`, its admin API and its etcd alarm gauge.
//! Must not: hold control-plane logic (the coord crate does), or flags other subcommands share
//! (those are in `crate::flags`).

use std::time::Duration;

use anyhow::Result;
use chanwatch_coord::{Coordinator, CoordinatorConfig};
use chanwatch_core::planner::PlannerConfig;
use clap::Args as ClapArgs;
use tracing::info;

use super::lifecycle::{bind_admin, shared_shutdown, wait_true};
use crate::flags::{humantime_secs, AdminAccess, EtcdArgs, RootArg};

#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub root: RootArg,
    /// Admin HTTP API address (loopback unless you mean otherwise).
    #[arg(long, env = "CHANWATCH_ADMIN", default_value = "127.0.0.1:9870")]
    pub admin: String,
    #[command(flatten)]
    pub access: AdminAccess,
    /// Leader lease TTL: a standby takes over within about this long after the leader dies.
    #[arg(long, env = "CHANWATCH_SESSION_TTL", value_parser = crate::flags::session_ttl, default_value = "10s")]
    pub session_ttl: Duration,
    /// A ToWatch assignment with no progress for this long is reassigned.
    #[arg(long, env = "CHANWATCH_WATCH_TIMEOUT", value_parser = humantime_secs, default_value = "30s")]
    pub watch_timeout: Duration,
    /// Period of the full relist that catches anything a watch missed (jittered: each wait
    /// is 80-100 % of it). A stalled watch is found sooner, from keepalive revisions its
    /// progress has not reached; a relist of 100,000 channels is tens of MB.
    #[arg(long, alias = "reconcile-interval", env = "CHANWATCH_RESYNC_INTERVAL", value_parser = humantime_secs, default_value = "5m")]
    pub resync_interval: Duration,
    /// The leader compacts etcd this often, to the revision it saw one interval earlier (one
    /// coordinator per interval, by a compare-and-swap on {root}/coord/compact). `0` turns it
    /// off: then run etcd with --auto-compaction-mode/--auto-compaction-retention.
    #[arg(long, env = "CHANWATCH_COMPACT_INTERVAL", value_parser = humantime_secs, default_value = "10m")]
    pub compact_interval: Duration,
    /// Most operations in one etcd txn (etcd's --max-txn-ops).
    #[arg(long, env = "CHANWATCH_MAX_TXN_OPS", default_value_t = 128, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(4..=10_000))]
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
    /// Cold start: a leader that finds no channel on a live node places nothing until this
    /// many nodes are live (or --startup-grace has passed), so the first node up does not
    /// get every channel. A leader taking over a running cluster never waits. 0: no wait.
    #[arg(long, env = "CHANWATCH_EXPECTED_NODES", default_value_t = 0)]
    pub expected_nodes: usize,
    /// Cold start: the longest wait for --expected-nodes.
    #[arg(long, env = "CHANWATCH_STARTUP_GRACE", value_parser = humantime_secs, default_value = "10s")]
    pub startup_grace: Duration,
    /// FOR TESTS: switch one safety rule of the planner off, to prove a black-box test
    /// catches it (tests/blackbox.rs). Only in builds with the `planted-bugs` feature.
    #[cfg(feature = "planted-bugs")]
    #[arg(long, value_enum, hide = true)]
    pub plant: Option<PlantArg>,
    /// No placement takes a node above this load (its channels' weights over its
    /// --capacity); what fits nowhere waits under `remaining` with the reason, so a cluster
    /// that lost most of its nodes does not crush the survivors. Unset: no cap.
    #[arg(long, env = "CHANWATCH_MAX_LOAD", value_parser = parse_max_load)]
    pub max_load: Option<chanwatch_core::planner::MaxLoad>,
    /// Balance runs on its own (`--auto-balance=false`: only when asked by `ctl balance`).
    #[arg(long, env = "CHANWATCH_AUTO_BALANCE", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub auto_balance: bool,
    /// etcd's --quota-backend-bytes, in bytes, exported as chanwatch_etcd_quota_bytes (for
    /// the db-near-quota alert) when etcd does not say its own (before 3.6).
    #[arg(long, env = "CHANWATCH_QUOTA_BACKEND_BYTES", default_value_t = chanwatch_coord::DEFAULT_QUOTA_BACKEND_BYTES)]
    pub quota_backend_bytes: u64,
}

/// `--max-load`: a positive number (e.g. `2`, `1.5`).
fn parse_max_load(s: &str) -> Result<chanwatch_core::planner::MaxLoad, String> {
    s.trim()
        .parse::<f64>()
        .ok()
        .and_then(chanwatch_core::planner::MaxLoad::from_f64)
        .filter(|m| m.milli > 0)
        .ok_or_else(|| format!("{s:?} is not a positive load; give e.g. 2 or 1.5"))
}

/// Planner bugs `coord --plant` can switch on (a subset of `chanwatch-lab sim --plant`).
#[cfg(feature = "planted-bugs")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlantArg {
    /// A channel stuck in ToRelease is moved beside its live owner, without fencing it.
    ForceWithoutFence,
    /// Balance ignores failing-node back-offs, troubled nodes and cool-downs.
    BalanceIgnoresBackoff,
    /// The leader does not check its watch against its keepalives' revisions.
    NoWatchStallCheck,
    /// The leader plans at the first session loss of a burst, not once the burst is over.
    NoLossHold,
    /// The planner ignores that the leader's view is known to be behind (retries a failed
    /// channel on its node, times out loads and releases whose acks it may not have seen).
    IgnoreBehind,
}

#[cfg(feature = "planted-bugs")]
impl PlantArg {
    /// The planner's switch.
    pub fn planner_bug(self) -> chanwatch_core::planner::PlannerBug {
        match self {
            PlantArg::ForceWithoutFence => chanwatch_core::planner::PlannerBug::ForceWithoutFence,
            PlantArg::BalanceIgnoresBackoff => {
                chanwatch_core::planner::PlannerBug::BalanceIgnoresBackoff
            }
            PlantArg::NoWatchStallCheck => chanwatch_core::planner::PlannerBug::NoWatchStallCheck,
            PlantArg::NoLossHold => chanwatch_core::planner::PlannerBug::NoLossHold,
            PlantArg::IgnoreBehind => chanwatch_core::planner::PlannerBug::IgnoreBehind,
        }
    }
}

/// Runs a coordinator until Ctrl-C or SIGTERM, or until a configuration error ends it.
///
/// # Errors
/// Bad flags, a refused etcd configuration, an admin address that cannot be bound.
pub async fn run(args: Args) -> Result<()> {
    let keys = args.root.keys()?;
    let store = args.etcd.connect_waiting(&keys).await?;
    let (listener, admin_addr) = bind_admin(&args.admin).await?;
    let config = CoordinatorConfig {
        keys,
        planner: PlannerConfig {
            watch_timeout_ms: args.watch_timeout.as_millis() as u64,
            release_timeout_ms: args.release_timeout.as_millis() as u64,
            // Nodes are expected to run with the coordinators' --session-ttl.
            fence_wait_ms: args.session_ttl.as_millis() as u64,
            balance_quiet_ms: args.balance_quiet.as_millis() as u64,
            move_cooldown_ms: args.move_cooldown.as_millis() as u64,
            failed_node_backoff_ms: args.watch_timeout.as_millis() as u64,
            max_txn_ops: args.max_txn_ops as usize,
            max_concurrent_moves: args.max_concurrent_moves,
            #[cfg(feature = "planted-bugs")]
            planted_bug: args.plant.map(PlantArg::planner_bug),
            expected_nodes: args.expected_nodes,
            startup_grace_ms: args.startup_grace.as_millis() as u64,
            max_load: args.max_load,
            auto_balance: args.auto_balance,
            ..PlannerConfig::default()
        },
        session_ttl: args.session_ttl,
        resync_interval: args.resync_interval,
        compact_interval: args.compact_interval,
        admin_addr: admin_addr.clone(),
        quota_backend_bytes: args.quota_backend_bytes,
        ..CoordinatorConfig::default()
    };
    info!(admin = %admin_addr, store = %store.describe(), id = %config.id, "coordinator starting");
    if args.release_timeout <= args.session_ttl {
        // Accepted (nodes may run a shorter TTL than this coordinator), but said: a node
        // whose release outlasts the timeout is fenced while it may still be stopping.
        tracing::warn!(
            release_timeout = ?args.release_timeout,
            session_ttl = ?args.session_ttl,
            "coord: --release-timeout is not longer than this coordinator's --session-ttl: if the nodes run that TTL too, it must be longer (a node still releasing a channel would be fenced: its lease revoked); e.g. 3 x the TTL"
        );
    }
    let stop = shared_shutdown();
    let registry = prometheus::Registry::new();
    super::lifecycle::register_process_metrics(&registry)?;
    let handle = Coordinator::builder(store.clone())
        .config(config)
        .registry(registry.clone())
        .spawn()?;
    // chanwatch_etcd_alarm on the coordinator too, with one log line when an alarm is
    // raised or cleared (nodes export their own).
    let alarm = prometheus::IntGaugeVec::new(
        prometheus::Opts::new(
            "chanwatch_etcd_alarm",
            "1 while etcd has raised an alarm of this type (NOSPACE: writes refused).",
        ),
        &["type"],
    )?;
    for kind in chanwatch_store::AlarmKind::ALL {
        alarm.with_label_values(&[kind.name()]).set(0);
    }
    registry.register(Box::new(alarm.clone()))?;
    let _alarms = tokio::spawn(chanwatch_store::follow_alarms(
        store.clone(),
        std::time::Duration::from_secs(5),
        move |raised| {
            for kind in chanwatch_store::AlarmKind::ALL {
                alarm
                    .with_label_values(&[kind.name()])
                    .set(i64::from(raised.contains(&kind)));
            }
        },
    ));
    let api = chanwatch_coord::api::router(
        handle.clone(),
        chanwatch_coord::api::ApiOptions {
            registry,
            token: args.access.token_for(listener.local_addr()?)?,
            allowed_hosts: args.access.admin_host,
        },
    );
    let server = tokio::spawn(chanwatch_coord::api::serve(
        listener,
        api,
        wait_true(stop.clone()),
    ));
    // Until Ctrl-C, or a configuration error that ends the coordinator by itself.
    tokio::select! {
        () = wait_true(stop) => handle.stop().await?,
        ended = handle.stopped() => ended?,
    }
    server.await??;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;
    use crate::cli::{Cli, Command};

    /// What the planted bugs do is tested in the planner and in tests/blackbox.rs.
    #[cfg(feature = "planted-bugs")]
    #[test]
    fn coord_plant_reaches_the_planner_and_stays_out_of_help() {
        use chanwatch_core::planner::PlannerBug;
        for (flag, bug) in [
            ("force-without-fence", PlannerBug::ForceWithoutFence),
            ("balance-ignores-backoff", PlannerBug::BalanceIgnoresBackoff),
            ("no-watch-stall-check", PlannerBug::NoWatchStallCheck),
            ("no-loss-hold", PlannerBug::NoLossHold),
            ("ignore-behind", PlannerBug::IgnoreBehind),
        ] {
            let cli = Cli::try_parse_from(["chanwatch", "coord", "--plant", flag]).expect("parses");
            let Command::Coord(args) = cli.command else {
                panic!("not the coord command");
            };
            assert_eq!(args.plant.map(PlantArg::planner_bug), Some(bug));
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

    /// `--max-load` takes a positive number; `--auto-balance` is on unless set false.
    #[test]
    fn max_load_and_auto_balance_parse() {
        let coord = |args: &[&str]| {
            let all = [&["chanwatch", "coord"][..], args].concat();
            match Cli::try_parse_from(all).map(|c| c.command) {
                Ok(Command::Coord(a)) => Ok((a.max_load.map(|m| m.milli), a.auto_balance)),
                Ok(_) => Err("not coord".to_owned()),
                Err(e) => Err(e.to_string()),
            }
        };
        assert_eq!(coord(&[]), Ok((None, true)));
        assert_eq!(
            coord(&["--max-load", "2.5", "--auto-balance=false"]),
            Ok((Some(2500), false))
        );
        assert_eq!(coord(&["--auto-balance"]), Ok((None, true)));
        for bad in ["0", "-1", "x", "nan"] {
            let e = coord(&[&format!("--max-load={bad}")]).expect_err(bad);
            assert!(e.contains("not a positive load"), "{bad}: {e}");
        }
    }
}
