//! What the long-running subcommands (`coord`, `node`, `standalone`) share while they run:
//! the shutdown signal (Ctrl-C or SIGTERM) and the admin listener.
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
