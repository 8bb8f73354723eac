//! `chanwatch coord` and `chanwatch node`: build the runtime from flags and run it until
//! Ctrl-C or SIGTERM.
//!
//! Must not: hold control-plane logic.

use std::sync::Arc;

use anyhow::{Context, Result};
use chanwatch_coord::{Coordinator, CoordinatorConfig};
use chanwatch_core::planner::PlannerConfig;
use chanwatch_core::Keys;
use chanwatch_store::Clock;
use tokio::sync::watch;
use tracing::info;

use crate::cli::{CoordArgs, NodeArgs, RootArg};

/// Completes on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    info!("shutdown requested");
}

pub fn keys(root: &RootArg) -> Result<Keys> {
    Keys::new(root.root.clone()).map_err(|e| anyhow::anyhow!("--root: {e}"))
}

/// A shutdown future that can be shared by several tasks.
fn shared_shutdown() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = tx.send(true);
    });
    rx
}

/// The admin token to require. Refuses to serve a non-loopback admin API without one: anyone
/// who can reach it could move every channel.
fn admin_token(
    listener: &tokio::net::TcpListener,
    token: Option<String>,
) -> Result<Option<String>> {
    let addr = listener.local_addr()?;
    match token {
        Some(t) if t.is_empty() => {
            anyhow::bail!("--admin-token is empty; give a secret or leave it out")
        }
        Some(t) => Ok(Some(t)),
        None if addr.ip().is_loopback() => Ok(None),
        None => anyhow::bail!(
            "refusing to serve the admin API on {addr} (not loopback) without --admin-token \
             (or CHANWATCH_ADMIN_TOKEN): anyone who reaches it could move every channel"
        ),
    }
}

/// Binds the admin listener; the address it reports is the real one (port 0 resolved).
async fn bind_admin(addr: &str) -> Result<(tokio::net::TcpListener, String)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on --admin {addr}; pick a free address"))?;
    let local = listener.local_addr()?.to_string();
    Ok((listener, local))
}

async fn wait_true(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|v| *v).await;
}

pub async fn coord(args: CoordArgs) -> Result<()> {
    let keys = keys(&args.root)?;
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
            planted_bug: args.plant.map(crate::cli::CoordPlantArg::planner_bug),
            ..PlannerConfig::default()
        },
        session_ttl: args.session_ttl,
        reconcile_interval: args.reconcile_interval,
        admin_addr: admin_addr.clone(),
        ..CoordinatorConfig::default()
    };
    info!(admin = %admin_addr, store = %store.describe(), id = %config.id, "coordinator starting");
    let stop = shared_shutdown();
    let registry = prometheus::Registry::new();
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
            token: admin_token(&listener, args.admin_token)?,
            allowed_hosts: args.admin_host,
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

pub async fn node(args: NodeArgs) -> Result<()> {
    let keys = keys(&args.root)?;
    let store = args.etcd.connect_waiting(&keys).await?;
    let (listener, admin_addr) = bind_admin(&args.admin).await?;
    let stop = shared_shutdown();
    info!(admin = %admin_addr, store = %store.describe(), "node starting");
    let load = args.test_load.simulated_load(args.load_delay);
    let handler: Arc<dyn chanwatch_node::ChannelHandler> = match &args.handler_log {
        None => Arc::new(load),
        Some(path) => Arc::new(
            chanwatch_node::AuditLog::open(load, path, Clock::system())
                .with_context(|| format!("cannot append to --handler-log {}", path.display()))?,
        ),
    };
    let planted_bug = args.plant.map(|p| match p {
        crate::cli::NodePlantArg::NoWatchProgress => chanwatch_node::PlantedBug::NoWatchProgress,
    });
    let node = chanwatch_node::Node::builder(store)
        .handler(handler)
        .config(chanwatch_node::NodeConfig {
            keys,
            session_ttl: args.session_ttl,
            progress_interval: args.progress_interval,
            admin_addr,
            planted_bug,
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

pub async fn standalone(args: crate::cli::StandaloneArgs) -> Result<()> {
    use chanwatch_core::{ChannelName, VChannelInfo};
    let (listener, admin_addr) = bind_admin(&args.admin).await?;
    let timings = crate::inproc::Timings {
        session_ttl: args.session_ttl,
        watch_timeout: std::time::Duration::from_secs(30),
        reconcile_interval: std::time::Duration::from_secs(10),
        tick: std::time::Duration::from_secs(1),
        progress_interval: std::time::Duration::from_secs(5),
    };
    let handler = Arc::new(args.test_load.simulated_load(args.load_delay));
    let token = admin_token(&listener, args.admin_token)?;
    let cluster = crate::inproc::InProc::start(timings, handler, admin_addr.clone())?;
    let stop = shared_shutdown();
    // The coordinator's registry, with the nodes' metrics added: one /metrics for both.
    let registry = cluster.handle.registry().clone();
    cluster.node_metrics.register(&registry)?;
    let api = chanwatch_coord::api::router(
        cluster.handle.clone(),
        chanwatch_coord::api::ApiOptions {
            registry,
            token,
            allowed_hosts: args.admin_host,
        },
    );
    let server = tokio::spawn(chanwatch_coord::api::serve(
        listener,
        api,
        wait_true(stop.clone()),
    ));
    let nodes: Vec<_> = (0..args.nodes).map(|_| cluster.spawn_node()).collect();
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
    for n in nodes {
        n.stop().await;
    }
    cluster.shutdown().await;
    server.await??;
    info!("standalone stopped");
    Ok(())
}
