//! Election: campaign for `{root}/coord/leader`, keep the leader lease alive, stand by.
//!
//! Owns: the leader lease and its keepalive, the campaign loop (`run`), clearing a leader
//! key that no live lease holds, and the status and `chanwatch_leader` of a standby.
//! Must not: plan or write assignments (that is [`crate::term`]), or give up on
//! the store: every store error is retried with jittered back-off, except a configuration
//! error before the store ever answered (DESIGN §6 invariant 10).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chanwatch_core::CoordSession;
use chanwatch_store::{
    keep_lease, Backoff, Clock, Compare, EventKind, KeyValue, MetaStore, OpResponse, Renewal,
    StoreError, Txn, TxnOp,
};
use futures_util::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, error, info, warn};

use crate::coordinator::CoordinatorConfig;
use crate::handle::{refuse, ApiError, CoordStatus, Request};
use crate::term::{Term, TermEnd};

/// The wait after a failed store call: 200 ms, doubling up to 5 s.
const BACKOFF: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));

/// Why a coordinator could not start, or stopped for good.
#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    /// The store configuration is unusable (bad endpoint, unreadable TLS file) and the store
    /// never answered: fix the flags and start again. Every other store error is retried.
    /// (The store's words are in the message, so it is not also the `source`: an error
    /// chain printed them twice.)
    #[error("store refused the coordinator at start-up: {0}")]
    Store(StoreError),
    /// The metrics registry given to the builder refused the coordinator's metrics (it holds
    /// metrics of the same names already, e.g. another coordinator's): give each coordinator
    /// a registry of its own.
    #[error("the metrics registry refused the coordinator's metrics: {0}; give each coordinator a registry of its own")]
    Metrics(prometheus::Error),
    /// [`crate::CoordinatorBuilder::spawn`] was called outside a tokio runtime: call it from
    /// async code (e.g. under `#[tokio::main]`), or use `build()` and run the coordinator on
    /// a runtime of your choice.
    #[error("a coordinator must be spawned from within a tokio runtime; call spawn() from async code, or build() and run it yourself")]
    NoRuntime,
}

/// The wait before retry `attempt` (from 1) of the coordinator `id`: the jitter's seed is who
/// waits and how often, so coordinators spread out.
fn backoff(id: &str, attempt: u32) -> Duration {
    BACKOFF.wait(attempt, (id, attempt))
}

/// Logs a failed store call the way its kind deserves: an outage is a warning; anything
/// else (out of space, refused credentials, ...) needs an operator and is an error.
fn log_retry(what: &str, e: &StoreError, wait: Duration) {
    if e.is_retryable() {
        warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "coord: {what} failed; retrying");
    } else {
        error!(error = %e, retry_in_ms = wait.as_millis() as u64, "coord: {what} failed and needs an operator (see the error); retrying until it is fixed");
    }
}

/// What a standby makes of the leader key it found.
#[derive(Debug, PartialEq)]
enum LeaderKey {
    /// A live coordinator's key: stand by until it changes.
    Held(CoordSession),
    /// Attached to a lease but its value does not decode: no coordinator wrote it. It goes
    /// when its lease does; until then it is logged.
    Garbage(String),
    /// Attached to no lease (written by hand, e.g. `etcdctl put`): it would never expire
    /// and would block every election, so it is deleted.
    Unleased,
}

fn examine(kv: &KeyValue) -> LeaderKey {
    if kv.lease.unwrap_or(0) == 0 {
        return LeaderKey::Unleased;
    }
    match CoordSession::decode(&kv.value) {
        Ok(s) => LeaderKey::Held(s),
        Err(e) => LeaderKey::Garbage(e.to_string()),
    }
}

/// Runs a coordinator until `shutdown`: campaign, lead or stand by, and serve `requests`.
/// On shutdown a leader revokes its lease so a standby takes over at once.
///
/// # Errors
/// [`CoordError`] only for a configuration error before the store ever answered; every
/// other store error (outage, NOSPACE, refused credentials, ...) is logged and retried with
/// jittered back-off.
pub(crate) async fn run(
    store: Arc<dyn MetaStore>,
    config: CoordinatorConfig,
    clock: Clock,
    mut requests: mpsc::Receiver<Request>,
    status: watch::Sender<CoordStatus>,
    events: Arc<crate::events::EventLog>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), CoordError> {
    tokio::pin!(shutdown);
    let leader_key = config.keys.leader();
    // Every coordinator, leader or standby, under its campaign lease: `ctl status` lists them.
    let member_key = config.keys.coord_member(&config.id);
    let mut attempt = 0u32;
    // Whether the store ever granted us a lease: after that, no error is a start-up error.
    let mut answered = false;
    config.metrics.set_leader(false);
    loop {
        // A fresh lease per campaign: a leader that lost its lease must not reuse it.
        let lease = tokio::select! {
            biased;
            () = &mut shutdown => return Ok(()),
            l = store.grant(config.session_ttl) => l,
        };
        let lease = match lease {
            Ok(l) => l,
            Err(e @ StoreError::Config(_)) if !answered => return Err(CoordError::Store(e)),
            Err(e) => {
                attempt += 1;
                let wait = backoff(&config.id, attempt);
                log_retry("granting the leader lease", &e, wait);
                if serve_standby_until(&mut requests, &status, clock.sleep(wait), &mut shutdown)
                    .await
                {
                    return Ok(());
                }
                continue;
            }
        };
        answered = true;
        attempt = 0;
        let lost = CancellationToken::new();
        let (renewed_tx, renewals) = watch::channel(Renewal {
            sent: clock.now(),
            revision: 0,
        });
        let _keepalive = AbortOnDropHandle::new(tokio::spawn(keepalive(
            store.clone(),
            lease.id,
            config.session_ttl,
            clock,
            renewed_tx,
            lost.clone(),
        )));
        let mut failures = 0u32;
        let mut clear_failures = 0u32;
        loop {
            let me = CoordSession {
                id: config.id.clone(),
                admin_addr: config.admin_addr.clone(),
                started_at_ms: clock.unix_ms(),
                extra: Default::default(),
            };
            let campaign = store
                .txn(
                    Txn::new()
                        .when([Compare::absent(&leader_key)])
                        .and_then([
                            TxnOp::put_with_lease(&leader_key, me.encode(), lease.id),
                            TxnOp::put_with_lease(&member_key, me.encode(), lease.id),
                        ])
                        .or_else([
                            TxnOp::get(&leader_key),
                            TxnOp::put_with_lease(&member_key, me.encode(), lease.id),
                        ]),
                )
                .await;
            let resp = match campaign {
                Ok(r) => r,
                Err(e) => {
                    failures += 1;
                    let wait = backoff(&config.id, failures);
                    log_retry("campaigning", &e, wait);
                    if serve_standby_until(&mut requests, &status, clock.sleep(wait), &mut shutdown)
                        .await
                    {
                        return Ok(());
                    }
                    if lost.is_cancelled() {
                        break;
                    }
                    continue;
                }
            };
            failures = 0;
            if resp.succeeded {
                let leader_rev = resp.revision;
                info!(id = %config.id, leader_revision = leader_rev, "coord: elected leader");
                config.metrics.set_leader(true);
                status.send_modify(|s| {
                    s.leader = true;
                    s.ready = false;
                    s.leader_addr = Some(config.admin_addr.clone());
                    s.terms += 1;
                });
                let mut term =
                    Term::new(store.clone(), &config, clock, leader_rev, lease.id, &status);
                term.renewals = Some(renewals.clone());
                // A new leader starts a new history (`ctl describe` says since when).
                events.begin(&config.id);
                term.events = events.clone();
                let end = term.lead(&mut requests, &lost, &mut shutdown).await;
                drop(term);
                // Step down before anything else: a deposed leader must not look like one.
                config.metrics.set_leader(false);
                status.send_modify(|s| {
                    s.leader = false;
                    s.ready = false;
                    s.leader_addr = None;
                });
                match end {
                    TermEnd::Shutdown => {
                        info!("coord: shutting down; resigning leadership");
                        let _ = store.revoke(lease.id).await;
                        return Ok(());
                    }
                    TermEnd::Lost(why) => {
                        warn!(reason = %why, "coord: lost leadership; stepped down (not ready, chanwatch_leader 0); campaigning again");
                        let _ = store.revoke(lease.id).await;
                        break;
                    }
                }
            }
            // Standby: remember who leads, wait for the key to change.
            let leader = resp.responses.iter().find_map(|r| match r {
                OpResponse::Get { kv: Some(kv) } => Some(kv.clone()),
                _ => None,
            });
            let mut addr = None;
            if let Some(kv) = &leader {
                match examine(kv) {
                    LeaderKey::Held(s) => addr = Some(s.admin_addr),
                    LeaderKey::Garbage(why) => {
                        error!(key = %leader_key, lease = kv.lease.unwrap_or(0), error = %why, "coord: the leader key does not decode (no coordinator wrote it); waiting for its lease to expire, or delete the key");
                    }
                    LeaderKey::Unleased => {
                        if clear_unleased(&*store, &leader_key, kv).await {
                            clear_failures = 0;
                        } else {
                            // The key will not change by itself: wait, then try again.
                            clear_failures += 1;
                            let wait = clock.sleep(backoff(&config.id, clear_failures));
                            if serve_standby_until(&mut requests, &status, wait, &mut shutdown)
                                .await
                            {
                                return Ok(());
                            }
                            if lost.is_cancelled() {
                                break;
                            }
                        }
                        continue; // campaign again
                    }
                }
            }
            // Watch from the txn's revision, not from the key's mod revision: the key is known
            // to exist then, and an old mod revision may be compacted away, which would fail
            // the watch at once and spin the campaign (found by the simulation).
            let from = resp.revision;
            // Once per leader seen (the loop comes round when the leader key changes).
            info!(leader_admin = addr.as_deref().unwrap_or(""), "coord: standing by: another coordinator leads; this one takes over when its leader key goes");
            status.send_modify(|s| {
                s.leader = false;
                s.ready = false;
                s.leader_addr = addr;
            });
            let gone = leader_changed(&*store, &leader_key, from + 1);
            if serve_standby_until(&mut requests, &status, gone, &mut shutdown).await {
                return Ok(());
            }
            if lost.is_cancelled() {
                break;
            }
        }
    }
}

/// Deletes a leader key that no lease holds, guarded on its mod revision so a key rewritten
/// meanwhile is left alone. Returns whether it is gone (campaign again at once).
async fn clear_unleased(store: &dyn MetaStore, key: &str, kv: &KeyValue) -> bool {
    error!(
        key,
        value = %String::from_utf8_lossy(&kv.value),
        mod_revision = kv.mod_revision,
        "coord: the leader key is attached to no lease, so it would never expire and would block every election; deleting it"
    );
    let txn = Txn::new()
        .when([Compare::mod_revision(key, kv.mod_revision)])
        .and_then([TxnOp::delete(key)]);
    match store.txn(txn).await {
        Ok(r) if r.succeeded => {
            info!(key, "coord: deleted the unleased leader key; campaigning");
            true
        }
        Ok(_) => {
            info!(
                key,
                "coord: the unleased leader key changed meanwhile; looking again"
            );
            true
        }
        Err(e) => {
            warn!(key, error = %e, "coord: could not delete the unleased leader key; retrying");
            false
        }
    }
}

/// Waits until the leader key is deleted or rewritten (a campaign then looks at it again),
/// or the watch breaks: campaigning again is safe, after a pause so that a watch that keeps
/// failing cannot spin the campaign loop.
async fn leader_changed(store: &dyn MetaStore, key: &str, from: i64) {
    const RETRY: Duration = Duration::from_millis(500);
    let mut stream = match store.watch(key, from).await {
        Ok(s) => s,
        Err(_) => {
            tokio::time::sleep(RETRY).await;
            return;
        }
    };
    while let Some(item) = stream.next().await {
        match item {
            Ok(batch) => {
                if batch.events.iter().any(|e| e.kv.key == key) {
                    if batch
                        .events
                        .iter()
                        .any(|e| e.kv.key == key && e.kind == EventKind::Put)
                    {
                        debug!(
                            key,
                            "coord: the leader key was rewritten; looking at it again"
                        );
                    }
                    return;
                }
            }
            Err(_) => break,
        }
    }
    tokio::time::sleep(RETRY).await;
}

/// Answers requests with `NotLeader` until `until` completes. Returns true on shutdown.
pub(crate) async fn serve_standby_until(
    requests: &mut mpsc::Receiver<Request>,
    status: &watch::Sender<CoordStatus>,
    until: impl Future<Output = ()>,
    shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
) -> bool {
    tokio::pin!(until);
    loop {
        tokio::select! {
            biased;
            () = shutdown.as_mut() => return true,
            () = &mut until => return false,
            Some(req) = requests.recv() => {
                let leader_addr = status.borrow().leader_addr.clone();
                refuse(req, ApiError::NotLeader { leader_addr });
            }
        }
    }
}

/// Keeps the leader lease alive ([`keep_lease`], shared with the nodes), publishing each
/// renewal on `renewed_tx` (the term compares their revisions with its watch's progress);
/// cancels `lost` when the store says it is gone or it has not been renewed for
/// `ttl - margin` (a leader that cannot renew must stop writing before a standby may start).
async fn keepalive(
    store: Arc<dyn MetaStore>,
    lease: i64,
    ttl: Duration,
    clock: Clock,
    renewed_tx: watch::Sender<Renewal>,
    lost: CancellationToken,
) {
    let margin = chanwatch_store::fence_margin(ttl);
    let mut renewed = renewed_tx.subscribe();
    let keeper = keep_lease(store, lease, ttl, clock, renewed_tx, None, "coord");
    tokio::pin!(keeper);
    loop {
        let deadline = renewed.borrow_and_update().sent + ttl.saturating_sub(margin);
        tokio::select! {
            biased;
            // The store says the lease is gone.
            () = &mut keeper => break,
            changed = renewed.changed() => if changed.is_err() { break },
            () = clock.sleep_until(deadline) => {
                warn!(?ttl, "coord: the leader lease was not renewed for ttl - margin; stepping down");
                break;
            }
        }
    }
    lost.cancel();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(value: &[u8], lease: Option<i64>) -> KeyValue {
        KeyValue {
            key: "chanwatch/coord/leader".into(),
            value: value.to_vec(),
            create_revision: 5,
            mod_revision: 5,
            version: 1,
            lease,
        }
    }

    #[test]
    fn a_leader_key_without_a_lease_is_unleased_whatever_its_value() {
        let good = CoordSession {
            id: "a".into(),
            admin_addr: "x:1".into(),
            started_at_ms: 1,
            extra: Default::default(),
        };
        assert_eq!(examine(&kv(b"junk", None)), LeaderKey::Unleased);
        assert_eq!(examine(&kv(&good.encode(), Some(0))), LeaderKey::Unleased);
        assert!(matches!(
            examine(&kv(b"junk", Some(7))),
            LeaderKey::Garbage(_)
        ));
        assert_eq!(examine(&kv(&good.encode(), Some(7))), LeaderKey::Held(good));
    }

    #[test]
    fn the_backoff_differs_per_coordinator() {
        assert_ne!(backoff("a", 3), backoff("b", 3));
    }
}
