//! `chanwatch node`: a node running the built-in simulated load, the stream consumer
//! (`--handler stream --log URL`) or a worker process per channel (`--exec CMD`), built from flags, run until Ctrl-C or SIGTERM.
//!
//! Owns: the node's flags (`Args`, the hidden `--plant`), its handler (simulated load or
//! stream consumer, with the optional `--handler-log` audit) and serving its admin HTTP.
//! Must not: hold node logic (the node crate does), or flags other subcommands share (those
//! are in `crate::flags`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use chanwatch_store::Clock;
use clap::Args as ClapArgs;
use tracing::info;

use super::lifecycle::{bind_admin, counted_signals, wait_true};
use crate::flags::{humantime_secs, EtcdArgs, HandlerArgs, RootArg, TestLoadArgs};

/// The node admin API's default address (the coordinator's is 9870).
pub const DEFAULT_NODE_ADMIN: &str = "127.0.0.1:9871";

#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub root: RootArg,
    /// Node admin HTTP address (/healthz, /readyz, /metrics, /status): a fixed port so that
    /// Prometheus can scrape it; port 0 picks a free port (several nodes on one host).
    #[arg(long, env = "CHANWATCH_NODE_ADMIN", default_value = DEFAULT_NODE_ADMIN)]
    pub admin: String,
    /// The node's stable name (default: the host name): shown by `ctl nodes` and the status
    /// page, carried by its log lines and, as the label `node`, by every metric it exports.
    /// Give each node on one host its own (e.g. the pod name of a StatefulSet).
    #[arg(long, env = "CHANWATCH_NODE_NAME")]
    pub name: Option<String>,
    /// Session lease TTL (minimum 2s): the node's channels move this long after it dies.
    #[arg(long, env = "CHANWATCH_SESSION_TTL", value_parser = crate::flags::session_ttl, default_value = "10s")]
    pub session_ttl: Duration,
    /// How long before its session lease could expire a node that cannot reach etcd pauses
    /// its channels (default: a fifth of the TTL, at least 1s). Larger pauses a cut-off node
    /// sooner: room for a pause that is slow to take effect or a clock that runs slow. Never
    /// below the default; at most a third of the TTL less 1s, beyond which two keepalives in
    /// a row that hang could pause a healthy node.
    #[arg(long, env = "CHANWATCH_FENCE_MARGIN", value_parser = humantime_secs)]
    pub fence_margin: Option<Duration>,
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
    pub handler: HandlerArgs,
    #[command(flatten)]
    pub test_load: TestLoadArgs,
    /// On SIGTERM (or Ctrl-C) the node asks the coordinator to move its channels off while
    /// it still runs them, and exits once none is left or after this long (then it stops
    /// what is left and revokes its lease: those fail over). A second signal stops at once.
    /// 0s: stop and revoke at once, as before planned restarts.
    #[arg(long, env = "CHANWATCH_SHUTDOWN_TIMEOUT", value_parser = humantime_secs, default_value = "60s")]
    pub shutdown_timeout: Duration,
    /// This node's relative capacity: it gets channels of total weight in proportion (a
    /// node of capacity 2 takes twice what a node of 1 takes). Written in its session.
    #[arg(long, env = "CHANWATCH_CAPACITY", default_value_t = 1, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub capacity: u32,
    /// Test only (hidden): switch a node safety mechanism off, so that a black-box test can
    /// check what stands behind it (tests/blackbox.rs). Only in builds with the
    /// `planted-bugs` feature.
    #[cfg(feature = "planted-bugs")]
    #[arg(long, value_enum, hide = true)]
    pub plant: Option<PlantArg>,
}

/// Node safety mechanisms `node --plant` can switch off.
#[cfg(feature = "planted-bugs")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlantArg {
    /// The node ignores watch progress: a watch that stalls silently goes unnoticed, and
    /// only the coordinator's fence keeps one owner.
    NoWatchProgress,
}

/// Runs a node until Ctrl-C or SIGTERM, or until a configuration error at start-up ends it.
///
/// # Errors
/// Bad flags, a refused etcd configuration, an admin address that cannot be bound, an
/// unwritable `--handler-log`.
pub async fn run(args: Args) -> Result<()> {
    let keys = args.root.keys()?;
    if let Some(margin) = args.fence_margin {
        crate::flags::check_fence_margin(args.session_ttl, margin).map_err(anyhow::Error::msg)?;
    }
    let store = args.etcd.connect_waiting(&keys).await?;
    let (listener, admin_addr) = bind_admin(&args.admin).await?;
    let mut signals = counted_signals();
    let (done_tx, done) = tokio::sync::watch::channel(false);
    let name = match &args.name {
        Some(n) => n.trim().to_owned(),
        None => host_name(),
    };
    anyhow::ensure!(
        !name.is_empty(),
        "--name is empty; give the node a name (default: the host name)"
    );
    info!(admin = %admin_addr, %name, store = %store.describe(), "node starting");
    let registry = labelled_registry(&name)?;
    super::lifecycle::register_process_metrics(&registry)?;
    let handler = handler(&args).await?;
    let node = chanwatch_node::Node::builder(store)
        .handler(handler)
        .config(chanwatch_node::NodeConfig {
            keys,
            session_ttl: args.session_ttl,
            fence_margin: args.fence_margin,
            progress_interval: args.progress_interval,
            shutdown_timeout: args.shutdown_timeout,
            admin_addr,
            name,
            #[cfg(feature = "planted-bugs")]
            planted_bug: args.plant.map(|p| match p {
                PlantArg::NoWatchProgress => chanwatch_node::PlantedBug::NoWatchProgress,
            }),
            capacity: args.capacity,
            ..chanwatch_node::NodeConfig::default()
        })
        .registry(registry)
        .spawn()?;
    let router = chanwatch_node::admin::router(node.watch_status(), node.registry().clone());
    let server = tokio::spawn(chanwatch_coord::api::serve(
        listener,
        router,
        wait_true(done),
    ));
    let mut node = node;
    let stopper = node.stopper();
    // The first signal: leave (the coordinator drains us); the second: stop at once. The
    // node ends by itself once it has left, or for a configuration error at start-up.
    let ended = {
        let wait = node.wait();
        tokio::pin!(wait);
        loop {
            tokio::select! {
                r = &mut wait => break r,
                Ok(()) = signals.changed() => {
                    let n = *signals.borrow_and_update();
                    if let Some(stopper) = &stopper {
                        if n == 1 {
                            info!(timeout = ?args.shutdown_timeout, "node: signal: leaving (a second signal stops at once)");
                            stopper.leave();
                        } else {
                            info!("node: second signal: stopping at once");
                            stopper.stop();
                        }
                    }
                }
            }
        }
    };
    let _ = done_tx.send(true);
    ended?;
    server.await??;
    Ok(())
}

/// A registry whose every metric carries the constant label `node="NAME"`, so that the
/// scrapes of many nodes can be told apart and summed.
///
/// # Errors
/// A name Prometheus refuses as a label value (none is: any UTF-8 will do).
pub fn labelled_registry(name: &str) -> Result<prometheus::Registry> {
    Ok(prometheus::Registry::new_custom(
        None,
        Some(std::collections::HashMap::from([(
            "node".to_owned(),
            name.to_owned(),
        )])),
    )?)
}

/// The host name (Linux: `/proc/sys/kernel/hostname`, else `$HOSTNAME`), or `""`.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

/// The node's handler from its flags: an `--exec` worker per channel, the stream consumer, or
/// the simulated load; wrapped in the handler log with `--handler-log`.
async fn handler(args: &Args) -> Result<Arc<dyn chanwatch_node::ChannelHandler>> {
    fn audited<H: chanwatch_node::ChannelHandler>(
        h: H,
        log: Option<&std::path::Path>,
    ) -> Result<Arc<dyn chanwatch_node::ChannelHandler>> {
        Ok(match log {
            None => Arc::new(h),
            Some(path) => Arc::new(
                chanwatch_node::AuditLog::open(h, path, Clock::system()).map_err(|e| {
                    anyhow::anyhow!("cannot append to --handler-log {}: {e}", path.display())
                })?,
            ),
        })
    }
    let log = args.handler_log.as_deref();
    let keys = args.root.keys()?;
    if let Some(exec) = args.handler.exec(&keys).await? {
        return audited(exec, log);
    }
    match args.handler.consumer(&keys, None).await? {
        Some(consumer) => audited(consumer, log),
        None => audited(args.test_load.simulated_load(args.load_delay), log),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_node_name_defaults_to_the_host_name_and_the_admin_port_is_fixed() {
        let cli = Cli::try_parse_from(["chanwatch", "node"]).expect("parses");
        let Command::Node(args) = cli.command else {
            panic!("not the node command");
        };
        assert_eq!(args.admin, "127.0.0.1:9871");
        assert_eq!(args.name, None, "resolved to the host name at start");
        assert!(!host_name().is_empty(), "this host has a name");
        let cli = Cli::try_parse_from(["chanwatch", "node", "--name", "db-3"]).expect("parses");
        let Command::Node(args) = cli.command else {
            panic!("not the node command");
        };
        assert_eq!(args.name.as_deref(), Some("db-3"));
    }

    #[test]
    fn every_node_metric_carries_the_node_label() {
        let registry = labelled_registry("db-3").expect("registry");
        chanwatch_node::NodeMetrics::new()
            .register(&registry)
            .expect("registers");
        let families = registry.gather();
        assert!(families.len() > 10, "{}", families.len());
        for f in &families {
            for m in f.get_metric() {
                assert!(
                    m.get_label()
                        .iter()
                        .any(|l| l.name() == "node" && l.value() == "db-3"),
                    "{} has no node label",
                    f.name()
                );
            }
        }
    }

    use clap::{CommandFactory, Parser};

    use super::*;
    use crate::cli::{Cli, Command};

    #[tokio::test]
    async fn exec_flags_reach_the_handler_and_help_explains_them() {
        let cli = Cli::try_parse_from([
            "chanwatch",
            "node",
            "--exec",
            "exec python3 w.py 'a b'",
            "--stop-grace",
            "1500ms",
            "--ready-on-start",
        ])
        .expect("parses");
        let Command::Node(args) = cli.command else {
            panic!("not the node command");
        };
        assert_eq!(
            args.handler.exec.as_deref(),
            Some("exec python3 w.py 'a b'")
        );
        assert_eq!(args.handler.stop_grace, Duration::from_millis(1500));
        assert!(args.handler.ready_on_start);
        let keys = chanwatch_core::Keys::default();
        let exec = args
            .handler
            .exec(&keys)
            .await
            .expect("binds")
            .expect("some");
        assert!(exec.agent_url().starts_with("http://127.0.0.1:"));
        let both = Cli::try_parse_from(["chanwatch", "node", "--exec", "w", "--handler", "stream"])
            .expect("parses");
        let Command::Node(args) = both.command else {
            panic!("not the node command");
        };
        assert!(
            args.handler.exec(&keys).await.is_err(),
            "--exec with --handler stream"
        );
        let mut help = Vec::new();
        let mut cmd = Cli::command();
        let node = cmd.find_subcommand_mut("node").expect("node subcommand");
        node.write_long_help(&mut help).expect("help renders");
        let help = String::from_utf8_lossy(&help);
        for want in [
            "--exec",
            "CHANWATCH_AGENT_TOKEN",
            "/commit",
            "--stop-grace",
            "--agent",
        ] {
            assert!(help.contains(want), "--help lacks {want}:\n{help}");
        }
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
    }
}
