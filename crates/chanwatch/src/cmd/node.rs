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

use super::lifecycle::{bind_admin, shared_shutdown, wait_true};
use crate::flags::{humantime_secs, EtcdArgs, HandlerArgs, RootArg, TestLoadArgs};

#[derive(Debug, ClapArgs)]
pub struct Args {
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
    pub handler: HandlerArgs,
    #[command(flatten)]
    pub test_load: TestLoadArgs,
    /// This node's relative capacity: it gets channels of total weight in proportion (a
    /// node of capacity 2 takes twice what a node of 1 takes). Written in its session.
    #[arg(long, env = "CHANWATCH_CAPACITY", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub capacity: u32,
    /// Test only (hidden): switch a node safety mechanism off, so that a black-box test can
    /// check what stands behind it (tests/blackbox.rs). Never in production.
    #[arg(long, value_enum, hide = true)]
    pub plant: Option<PlantArg>,
}

/// Node safety mechanisms `node --plant` can switch off.
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
    let store = args.etcd.connect_waiting(&keys).await?;
    let (listener, admin_addr) = bind_admin(&args.admin).await?;
    let stop = shared_shutdown();
    info!(admin = %admin_addr, store = %store.describe(), "node starting");
    let handler = handler(&args).await?;
    let planted_bug = args.plant.map(|p| match p {
        PlantArg::NoWatchProgress => chanwatch_node::PlantedBug::NoWatchProgress,
    });
    let node = chanwatch_node::Node::builder(store)
        .handler(handler)
        .config(chanwatch_node::NodeConfig {
            keys,
            session_ttl: args.session_ttl,
            progress_interval: args.progress_interval,
            admin_addr,
            planted_bug,
            capacity: args.capacity,
            ..chanwatch_node::NodeConfig::default()
        })
        .spawn()?;
    let router = chanwatch_node::admin::router(node.watch_status(), node.registry().clone());
    let server = tokio::spawn(chanwatch_coord::api::serve(
        listener,
        router,
        wait_true(stop.clone()),
    ));
    let mut node = node;
    // The node ends by itself only for a configuration error at start-up.
    let ended = tokio::select! {
        () = wait_true(stop.clone()) => None,
        r = node.wait() => Some(r),
    };
    match ended {
        None => node.stop().await?,
        // The admin server goes with the process.
        Some(r) => return r.map_err(Into::into),
    }
    server.await??;
    Ok(())
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
