//! The node's outer loop: register, serve a session, and after a fence register again under a
//! new ID, until shutdown.
//!
//! Owns: the sequence of sessions, the alarm follower and the status counters that span
//! sessions. Must not: touch channels (the session does) or write keys itself.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chanwatch_store::{Clock, MetaStore, MIN_SESSION_TTL};
use tokio::sync::watch;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, error, info, warn};

use crate::config::{NodeConfig, NodeError, NodeStatus, Stop};
use crate::handler::ChannelHandler;
use crate::register::{register, REGISTER_BACKOFF};
use crate::session::{Session, SessionEnd};

/// Runs a node until `shutdown` completes: register, serve, fence and re-register as needed.
/// On shutdown it stops every channel and revokes its lease, so its channels move at once
/// ([`Stop::Now`]; [`run_until`] can also leave gracefully, [`Stop::Leave`]).
///
/// # Errors
/// As [`run_until`].
pub async fn run(
    store: Arc<dyn MetaStore>,
    handler: Arc<dyn ChannelHandler>,
    config: NodeConfig,
    clock: Clock,
    status: watch::Sender<NodeStatus>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), NodeError> {
    let (tx, rx) = watch::channel(Stop::Run);
    let signal = async move {
        shutdown.await;
        let _ = tx.send(Stop::Now);
        std::future::pending::<()>().await;
    };
    tokio::select! {
        r = run_until(store, handler, config, clock, status, rx) => r,
        () = signal => unreachable!("pending never completes"),
    }
}

/// Runs a node until `stop` asks it to end: register, serve, fence and re-register as needed.
/// [`Stop::Leave`] (SIGTERM) drains the node through the coordinator while it still runs its
/// channels and ends once none is left, or after [`NodeConfig::shutdown_timeout`];
/// [`Stop::Now`] (a second signal) stops every channel and revokes the lease at once.
///
/// # Errors
/// [`NodeError`] for a bad configuration only: a TTL below the minimum, or credentials or a
/// role etcd refuses before the first session. Every other store error (an outage, NOSPACE,
/// an expired auth token, a garbled ID counter) is logged once and retried with jittered
/// back-off, so a node started during a NOSPACE alarm registers once it is disarmed.
pub async fn run_until(
    store: Arc<dyn MetaStore>,
    handler: Arc<dyn ChannelHandler>,
    config: NodeConfig,
    clock: Clock,
    status: watch::Sender<NodeStatus>,
    mut stop: watch::Receiver<Stop>,
) -> Result<(), NodeError> {
    check(&config)?;
    #[cfg(feature = "planted-bugs")]
    if let Some(bug) = config.planted_bug {
        tracing::warn!(
            bug = bug.name(),
            "node: a planted bug is on: a safety mechanism is switched off to prove a check catches it; never run this outside a test"
        );
        config
            .metrics
            .planted_bug
            .with_label_values(&[bug.name()])
            .set(1);
    }
    // Not registered: nothing to drain, whichever stop is asked for.
    let shutdown = {
        let mut stop = stop.clone();
        async move {
            let _ = stop.wait_for(|s| *s != Stop::Run).await;
        }
    };
    tokio::pin!(shutdown);
    // Alarms (NOSPACE above all) for `chanwatch_etcd_alarm` and one log line each way.
    let _alarms = {
        let metrics = config.metrics.clone();
        AbortOnDropHandle::new(tokio::spawn(chanwatch_store::follow_alarms(
            store.clone(),
            ALARM_POLL,
            move |raised| metrics.set_alarms(raised),
        )))
    };
    let mut attempt = 0u32;
    let mut registered_once = false;
    let mut last_error: Option<String> = None;
    loop {
        let session = tokio::select! {
            biased;
            () = &mut shutdown => return Ok(()),
            s = register(&*store, &config, &clock) => s,
        };
        let session = match session {
            Ok(s) => {
                attempt = 0;
                last_error = None;
                registered_once = true;
                s
            }
            // Only a configuration error at start-up ends the node (wrong credentials, a
            // role without the node's keys): once it has run, an operator may be fixing
            // etcd's side, and the node waits for it like for any other store error.
            Err(e) if e.is_config() && !registered_once => return Err(NodeError::Store(e)),
            Err(e) => {
                attempt += 1;
                let wait = REGISTER_BACKOFF.wait(attempt, (clock.unix_ms(), attempt));
                // Say it once per kind of trouble, then quietly keep trying.
                let text = e.to_string();
                if last_error.as_deref() != Some(text.as_str()) {
                    if e.is_config() {
                        error!(error = %e, "node: etcd refuses the node's credentials or role; retrying until an operator fixes it");
                    } else {
                        warn!(error = %e, ?wait, "node: cannot register yet; retrying with back-off");
                    }
                    last_error = Some(text);
                } else {
                    debug!(error = %e, ?wait, attempt, "node: cannot register yet; retrying");
                }
                tokio::select! {
                    biased;
                    () = &mut shutdown => return Ok(()),
                    () = clock.sleep(wait) => continue,
                }
            }
        };
        config.metrics.sessions.inc();
        status.send_modify(|s| {
            s.id = Some(session.id);
            s.sessions += 1;
        });
        info!(node = %session.id, lease = session.lease, ttl = ?config.session_ttl, "node: session registered");
        let end = Session::new(store.clone(), handler.clone(), &config, clock, session)
            .serve(&mut stop, &status)
            .await;
        status.send_modify(|s| {
            s.id = None;
            s.paused = None;
        });
        match end {
            SessionEnd::Shutdown => return Ok(()),
            SessionEnd::Fenced(why) => {
                config.metrics.fences.inc();
                status.send_modify(|s| s.fences += 1);
                warn!(reason = %why, "node: fenced itself: every channel stopped; registering again under a new id");
            }
        }
    }
}

/// Refuses a configuration that cannot work.
pub(crate) fn check(config: &NodeConfig) -> Result<(), NodeError> {
    if config.session_ttl < MIN_SESSION_TTL {
        return Err(NodeError::Config(format!(
            "--session-ttl {:?} is below the minimum of {MIN_SESSION_TTL:?}",
            config.session_ttl
        )));
    }
    Ok(())
}

/// How often a node reads the store's alarms.
const ALARM_POLL: Duration = Duration::from_secs(5);
