//! The session's keepalive task: renews the lease every ttl/3 (every 500 ms while failing) and
//! publishes each success for the watchdog.
//!
//! Owns: the renewal loop and its log lines. Must not: pause or stop channels itself (the
//! watchdog and the session do), except by cancelling the session's tokens when the store
//! says the lease is gone.

use std::sync::Arc;
use std::time::Duration;

use chanwatch_store::{Clock, MetaStore, StoreError};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::watchdog::Renewal;

/// Renews the lease every ttl/3 and publishes when the last successful renewal was sent
/// (the lease runs from when the store got it, which is no earlier). After a failure it
/// tries again every half second, so that a paused node learns within a second that the
/// store is back. Cancels `lost` and `fence` when the store says the lease no longer exists.
// Each argument is a different input or output of this one task; a struct would only wrap them.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn keepalive(
    store: Arc<dyn MetaStore>,
    lease: i64,
    ttl: Duration,
    clock: Clock,
    last_ok: watch::Sender<Renewal>,
    lost: CancellationToken,
    fence: CancellationToken,
    recovered: mpsc::UnboundedSender<()>,
) {
    const RETRY: Duration = Duration::from_millis(500);
    let period = ttl / 3;
    let mut failing = 0u32;
    loop {
        clock
            .sleep(if failing > 0 {
                RETRY.min(period)
            } else {
                period
            })
            .await;
        let sent = clock.now();
        let attempt = tokio::time::timeout(period, store.keepalive(lease)).await;
        let error = match attempt {
            Ok(Ok(revision)) => {
                if failing > 0 {
                    info!(lease, failures = failing, "node: keepalive succeeds again");
                    // The store is back: look at the assignments now, not after the
                    // list-watch's back-off (up to 5 s).
                    let _ = recovered.send(());
                }
                failing = 0;
                let _ = last_ok.send(Renewal { sent, revision });
                continue;
            }
            Ok(Err(StoreError::LeaseNotFound(_))) => {
                lost.cancel();
                fence.cancel();
                return;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {period:?}"),
        };
        failing += 1;
        // One line when the trouble starts, then one every 20 attempts (~10 s).
        if failing % 20 == 1 {
            warn!(lease, failures = failing, error = %error, "node: keepalive failed; retrying every 500 ms");
        }
    }
}
