//! `chanwatch standalone`: a coordinator and nodes in one process on the embedded store, with
//! the admin API, until Ctrl-C or SIGTERM.
//!
//! Owns: its flags (`Args`), wiring the in-process cluster to the admin API and one
//! `/metrics` (the nodes' labelled `node`, build and process metrics as `coord` has), the
//! read-only `GET /api/v1/checkpoints` it serves beside it (the embedded store's checkpoints,
//! for `audit --admin`), and each node's own admin HTTP on a loopback port of its own.
//! Must not: hold control-plane logic, or flags other subcommands share (those are in
//! `crate::flags`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use clap::Args as ClapArgs;
use tracing::info;

use super::lifecycle::{bind_admin, shared_shutdown, wait_true};
use crate::flags::{humantime_secs, AdminAccess, HandlerArgs, TestLoadArgs};

/// Flags of `standalone`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Nodes to run.
    #[arg(long, env = "CHANWATCH_NODES", default_value_t = 3)]
    pub nodes: usize,
    /// Channels to register at start (named ch-000, ch-001, ...).
    #[arg(long, env = "CHANWATCH_CHANNELS", default_value_t = 0)]
    pub channels: usize,
    /// Admin HTTP API address.
    #[arg(long, env = "CHANWATCH_ADMIN", default_value = "127.0.0.1:9870")]
    pub admin: String,
    #[command(flatten)]
    pub access: AdminAccess,
    /// Session lease TTL of the in-process nodes and coordinator.
    #[arg(long, env = "CHANWATCH_SESSION_TTL", value_parser = crate::flags::session_ttl, default_value = "10s")]
    pub session_ttl: Duration,
    /// How long each simulated channel load takes.
    #[arg(long, env = "CHANWATCH_LOAD_DELAY", value_parser = humantime_secs, default_value = "0s")]
    pub load_delay: Duration,
    #[command(flatten)]
    pub handler: HandlerArgs,
    #[command(flatten)]
    pub test_load: TestLoadArgs,
    /// Relative capacity of each in-process node (written in its session).
    #[arg(long, env = "CHANWATCH_CAPACITY", default_value_t = 1, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub capacity: u32,
}

/// Runs coordinator and nodes in this process until Ctrl-C or SIGTERM.
///
/// # Errors
/// Bad flags, an admin address that cannot be bound, a cluster that does not start.
pub async fn run(args: Args) -> Result<()> {
    use chanwatch_core::{ChannelName, VChannelInfo};
    let (listener, admin_addr) = bind_admin(&args.admin).await?;
    let timings = crate::inproc::Timings {
        session_ttl: args.session_ttl,
        watch_timeout: std::time::Duration::from_secs(30),
        resync_interval: std::time::Duration::from_secs(300),
        tick: std::time::Duration::from_secs(1),
        progress_interval: std::time::Duration::from_secs(5),
    };
    // The stream consumer's default log: a file log in the temp dir, kept across runs.
    let default_log = format!(
        "file:{}",
        std::env::temp_dir()
            .join("chanwatch-standalone-log")
            .display()
    );
    let handler: Arc<dyn chanwatch_node::ChannelHandler> =
        match args.handler.exec(&chanwatch_core::Keys::default()).await? {
            Some(exec) => Arc::new(exec),
            None => match args
                .handler
                .consumer(&chanwatch_core::Keys::default(), Some(default_log))
                .await?
            {
                Some(consumer) => Arc::new(consumer),
                None => Arc::new(args.test_load.simulated_load(args.load_delay)),
            },
        };
    let token = args.access.token_for(listener.local_addr()?)?;
    let cluster = crate::inproc::InProc::start(timings, handler, admin_addr.clone())?;
    let stop = shared_shutdown();
    let registry = metrics_registry(&cluster)?;
    let api = chanwatch_coord::api::router(
        cluster.handle.clone(),
        chanwatch_coord::api::ApiOptions {
            registry: registry.clone(),
            token,
            allowed_hosts: args.access.admin_host,
        },
    );
    let api = api.merge(checkpoints_route(
        cluster.store.clone(),
        cluster.keys.clone(),
    ));
    let server = tokio::spawn(chanwatch_coord::api::serve(
        listener,
        api,
        wait_true(stop.clone()),
    ));
    let mut nodes = Vec::with_capacity(args.nodes);
    for _ in 0..args.nodes {
        nodes.push(spawn_node(&cluster, args.capacity, &registry, &stop).await?);
    }
    cluster.ready().await?;
    for i in 0..args.channels {
        let name = ChannelName::new(format!("ch-{i:03}"))?;
        cluster
            .handle
            .add_channel(name, VChannelInfo::default())
            .await
            .map_err(|e| anyhow::anyhow!("registering channel {i}: {e}"))?;
    }
    info!(
        admin = %admin_addr,
        nodes = args.nodes,
        channels = args.channels,
        "standalone running on the embedded store; try: curl http://{admin_addr}/api/v1/channels ; Ctrl-C stops"
    );
    wait_true(stop).await;
    for (n, admin) in nodes {
        n.stop().await;
        let _ = admin.await;
    }
    cluster.shutdown().await;
    server.await??;
    info!("standalone stopped");
    Ok(())
}

/// A node with an admin HTTP of its own on a free loopback port (`/status`, `/readyz`,
/// `/metrics`), as a `node` process has: its session carries the address, so `ctl nodes`,
/// `ctl channels` (NODE SAYS) and the status page ask it whether it runs or has paused,
/// where without one they could only say "unknown".
///
/// # Errors
/// No loopback port to bind.
async fn spawn_node(
    cluster: &crate::inproc::InProc,
    capacity: u32,
    registry: &prometheus::Registry,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> Result<(
    crate::inproc::NodeProc,
    tokio::task::JoinHandle<std::io::Result<()>>,
)> {
    use anyhow::Context;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding a loopback port for an in-process node's admin HTTP")?;
    let addr = listener.local_addr()?.to_string();
    let node = cluster.spawn_node_at(capacity, addr);
    let router = chanwatch_node::admin::router(node.status.clone(), registry.clone());
    let server = tokio::spawn(chanwatch_coord::api::serve(
        listener,
        router,
        wait_true(stop.clone()),
    ));
    Ok((node, server))
}

/// One `/metrics` for the whole process, as `coord` and `node` export theirs: the
/// coordinator's registry with `chanwatch_build_info` and `process_*`, and the nodes' metrics
/// (one set for every in-process node) labelled `node` with the host name, the name a `node`
/// process has by default (`standalone` when there is none).
fn metrics_registry(cluster: &crate::inproc::InProc) -> Result<prometheus::Registry> {
    let registry = cluster.handle.registry().clone();
    super::lifecycle::register_process_metrics(&registry)?;
    let name = Some(super::node::host_name())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "standalone".to_owned());
    let nodes = super::node::labelled_registry(&name)?;
    cluster.node_metrics.register(&nodes)?;
    registry.register(Box::new(super::lifecycle::Gathered(nodes)))?;
    Ok(registry)
}

/// `GET /api/v1/checkpoints`: `{channel: checkpoint}` for every checkpoint in the embedded
/// store — what `audit --admin` reads, since no etcd holds a standalone's keys.
fn checkpoints_route(
    store: Arc<dyn chanwatch_store::MetaStore>,
    keys: chanwatch_core::Keys,
) -> axum::Router {
    use axum::http::StatusCode;
    use axum::response::IntoResponse;
    axum::Router::new().route(
        "/api/v1/checkpoints",
        axum::routing::get(move || {
            let (store, keys) = (store.clone(), keys.clone());
            async move {
                let prefix = keys.checkpoints_prefix();
                match store.range(&prefix).await {
                    Ok(kvs) => {
                        let mut out = serde_json::Map::new();
                        for kv in kvs.kvs {
                            let name = kv.key.strip_prefix(&prefix).unwrap_or(&kv.key).to_owned();
                            let value = serde_json::from_slice(&kv.value)
                                .unwrap_or(serde_json::Value::Null);
                            out.insert(name, value);
                        }
                        axum::Json(serde_json::Value::Object(out)).into_response()
                    }
                    Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
                }
            }
        }),
    )
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};

    /// The hidden switches themselves are tested with `node` (`cmd::node`).
    #[test]
    fn without_the_test_switches_standalone_runs_the_plain_load() {
        let plain = Cli::try_parse_from(["chanwatch", "standalone"]).expect("parses");
        let Command::Standalone(args) = plain.command else {
            panic!("not the standalone command");
        };
        let load = args.test_load.simulated_load(Duration::ZERO);
        assert!(load.fail_load.is_empty() && load.hang_load.is_empty());
    }
}
