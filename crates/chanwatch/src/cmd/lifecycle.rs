//! What the long-running subcommands (`coord`, `node`, `standalone`) share while they run:
//! the shutdown signal (Ctrl-C or SIGTERM), the admin listener, and the metrics every process
//! exports whatever its part (`chanwatch_build_info`, `process_*`).
//!
//! Owns: process lifetime plumbing. Must not: hold flags (those are in `crate::flags`) or
//! anything one subcommand alone needs.

use anyhow::{Context, Result};
use tokio::sync::watch;
use tracing::info;

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

/// Counts Ctrl-C and SIGTERM signals as they come (1 after the first, 2 after the second):
/// a node leaves gracefully on the first and stops at once on the second.
pub fn counted_signals() -> watch::Receiver<u32> {
    let (tx, rx) = watch::channel(0u32);
    tokio::spawn(async move {
        #[cfg(unix)]
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        loop {
            #[cfg(unix)]
            let term_recv = async {
                match term.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            #[cfg(not(unix))]
            let term_recv = std::future::pending::<()>();
            tokio::select! {
                r = tokio::signal::ctrl_c() => {
                    if r.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
                () = term_recv => {}
            }
            tx.send_modify(|n| *n += 1);
            if tx.is_closed() {
                return;
            }
        }
    });
    rx
}

/// A shutdown future that can be shared by several tasks.
pub fn shared_shutdown() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = tx.send(true);
    });
    rx
}

/// Binds the admin listener; the address it reports is the real one (port 0 resolved).
pub async fn bind_admin(addr: &str) -> Result<(tokio::net::TcpListener, String)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on --admin {addr}; pick a free address"))?;
    let local = listener.local_addr()?.to_string();
    Ok((listener, local))
}

/// Completes once `rx` holds `true` (or its sender is gone).
pub async fn wait_true(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|v| *v).await;
}

/// Registers what every process exports whatever its part: `chanwatch_build_info{version,
/// git_sha}` (always 1; `git_sha` only when built with `CHANWATCH_GIT_SHA` set, as the
/// Dockerfile does) and, on Linux, the process metrics (`process_cpu_seconds_total`,
/// `process_resident_memory_bytes`, `process_open_fds`, `process_start_time_seconds`, …).
///
/// # Errors
/// A metric of the same name already in `registry`.
pub fn register_process_metrics(registry: &prometheus::Registry) -> Result<()> {
    let mut opts = prometheus::Opts::new(
        "chanwatch_build_info",
        "Always 1; the labels say which build of chanwatch this process runs.",
    )
    .const_label("version", env!("CARGO_PKG_VERSION"));
    if let Some(sha) = option_env!("CHANWATCH_GIT_SHA").filter(|s| !s.is_empty()) {
        opts = opts.const_label("git_sha", sha);
    }
    let build = prometheus::IntGauge::with_opts(opts)?;
    build.set(1);
    registry.register(Box::new(build))?;
    #[cfg(target_os = "linux")]
    registry.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    ))?;
    Ok(())
}

/// Another registry's metrics, gathered into this one with that registry's labels applied:
/// how `standalone` serves its nodes' metrics (labelled `node`) beside its coordinator's on one
/// `/metrics`, as a `node` process labels its own.
pub struct Gathered(pub prometheus::Registry);

impl prometheus::core::Collector for Gathered {
    /// None: the inner registry checked its own descriptors when they were registered (only
    /// one `Gathered` may be registered in a registry).
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        Vec::new()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        self.0.gather()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_process_exports_its_build_and_process_metrics() {
        let registry = prometheus::Registry::new();
        register_process_metrics(&registry).expect("registers");
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .expect("encodes");
        let build = format!(
            "chanwatch_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        assert!(
            text.lines().any(|l| l.starts_with("chanwatch_build_info{")
                && l.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION")))
                && l.ends_with(" 1")),
            "no {build} in\n{text}"
        );
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_start_time_seconds",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(name)),
                "no {name} in\n{text}"
            );
        }
    }
}
