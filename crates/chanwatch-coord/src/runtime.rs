//! Election, the leader loop and txn execution.
//!
//! Owns: the leader lease and its keepalive, the planner state while leader, and the request
//! channel of [`CoordHandle`].
//! Must not: decide anything itself — every decision comes from the core planner.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chanwatch_core::coord::{
    AdminError, ChannelRow, CoordConfig, CoordState, Guard, NodeRow, Op, PlannedMove, PlannedTxn,
    Transition,
};
use chanwatch_core::{ChannelName, CoordSession, Keys, NodeId, VChannelInfo};
use chanwatch_store::{
    Clock, Compare, EventKind, ListWatch, MetaStore, OpResponse, StoreError, Txn, TxnOp, Update,
};
use futures_util::StreamExt;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

/// Least time between two plans driven by store events (ticks and admin requests aside).
const PLAN_EVERY: Duration = Duration::from_millis(10);

/// Settings of a coordinator.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// Key layout.
    pub keys: Keys,
    /// Planner settings (timeouts, limits, moves in flight).
    pub planner: CoordConfig,
    /// Lease TTL of the leader key; a standby takes over within about this long.
    pub session_ttl: Duration,
    /// Full relist period: a missed event can never stay unnoticed longer than this.
    pub reconcile_interval: Duration,
    /// Period of the planner tick (timeouts).
    pub tick: Duration,
    /// Txns in flight at once when a plan has several.
    pub pipeline: usize,
    /// Identifies this process in the leader key and logs.
    pub id: String,
    /// Admin API address written into the leader key (what `ctl` connects to).
    pub admin_addr: String,
    /// Where the coordinator's metrics go.
    pub metrics: Arc<crate::metrics::CoordMetrics>,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            keys: Keys::default(),
            planner: CoordConfig::default(),
            session_ttl: Duration::from_secs(10),
            reconcile_interval: Duration::from_secs(10),
            tick: Duration::from_secs(1),
            pipeline: 8,
            id: format!("coord-{}", std::process::id()),
            admin_addr: String::new(),
            metrics: Arc::new(crate::metrics::CoordMetrics::new()),
        }
    }
}

/// What the coordinator shows to the outside.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CoordStatus {
    /// This process holds the leader key.
    pub leader: bool,
    /// Leader and its startup recovery is done.
    pub ready: bool,
    /// The current leader's admin address, if known.
    pub leader_addr: Option<String>,
    /// Times this process became leader.
    pub terms: u64,
}

/// Why an admin request was refused. The HTTP API maps each to a status code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// Bad request content (4xx): what is wrong.
    #[error(transparent)]
    Admin(#[from] AdminError),
    /// This process is not the leader (503): where the leader is.
    #[error("this coordinator is not the leader{}", .leader_addr.as_ref().map(|a| format!("; the leader's admin API is at {a}")).unwrap_or_else(|| "; no leader is known yet, retry shortly".into()))]
    NotLeader {
        /// The leader's admin address, if known.
        leader_addr: Option<String>,
    },
    /// The change could not be written (503, retry).
    #[error("the store refused or failed the change: {0}; retry")]
    Store(String),
}

/// Requests from the admin API (or tests) to the coordinator loop.
// One request at a time crosses a bounded channel; boxing the vchannel would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Request {
    /// List channels.
    Channels(oneshot::Sender<Result<Vec<ChannelRow>, ApiError>>),
    /// List nodes.
    Nodes(oneshot::Sender<Result<Vec<NodeRow>, ApiError>>),
    /// Register a channel.
    Add {
        /// Its name.
        name: ChannelName,
        /// Its vchannel info.
        vchannel: VChannelInfo,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<Vec<Transition>, ApiError>>,
    },
    /// Remove a channel.
    Remove {
        /// Its name.
        name: ChannelName,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<Vec<Transition>, ApiError>>,
    },
    /// Move a channel to a node.
    Move {
        /// The channel.
        name: ChannelName,
        /// The target.
        to: NodeId,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<Vec<Transition>, ApiError>>,
    },
    /// Drain a node.
    Drain {
        /// The node.
        node: NodeId,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<(), ApiError>>,
    },
    /// Show (dry run) or start a balance.
    Balance {
        /// Only show the plan.
        dry_run: bool,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<Vec<PlannedMove>, ApiError>>,
    },
}

/// Talks to a running coordinator. Cheap to clone.
#[derive(Debug, Clone)]
pub struct CoordHandle {
    tx: mpsc::Sender<Request>,
    status: watch::Receiver<CoordStatus>,
}

impl CoordHandle {
    /// A handle and the receiving end for [`run`].
    pub fn new() -> (Self, mpsc::Receiver<Request>, watch::Sender<CoordStatus>) {
        let (tx, rx) = mpsc::channel(256);
        let (status_tx, status) = watch::channel(CoordStatus::default());
        (CoordHandle { tx, status }, rx, status_tx)
    }

    /// The latest status.
    pub fn status(&self) -> CoordStatus {
        self.status.borrow().clone()
    }

    /// A receiver that sees every status change.
    pub fn watch_status(&self) -> watch::Receiver<CoordStatus> {
        self.status.clone()
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, ApiError>>) -> Request,
    ) -> Result<T, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| ApiError::Store("the coordinator is shutting down".into()))?;
        rx.await
            .map_err(|_| ApiError::Store("the coordinator dropped the request".into()))?
    }

    /// Every channel with its owner and state.
    ///
    /// # Errors
    /// [`ApiError::NotLeader`] on a standby.
    pub async fn channels(&self) -> Result<Vec<ChannelRow>, ApiError> {
        self.ask(Request::Channels).await
    }

    /// Every live node.
    ///
    /// # Errors
    /// [`ApiError::NotLeader`] on a standby.
    pub async fn nodes(&self) -> Result<Vec<NodeRow>, ApiError> {
        self.ask(Request::Nodes).await
    }

    /// Registers a channel.
    ///
    /// # Errors
    /// Already exists, not leader, or the store failed.
    pub async fn add_channel(
        &self,
        name: ChannelName,
        vchannel: VChannelInfo,
    ) -> Result<Vec<Transition>, ApiError> {
        self.ask(|reply| Request::Add {
            name,
            vchannel,
            reply,
        })
        .await
    }

    /// Removes a channel.
    ///
    /// # Errors
    /// Unknown channel, not leader, or the store failed.
    pub async fn remove_channel(&self, name: ChannelName) -> Result<Vec<Transition>, ApiError> {
        self.ask(|reply| Request::Remove { name, reply }).await
    }

    /// Moves a channel to a node, break-before-make.
    ///
    /// # Errors
    /// Unknown channel or node, draining target, busy, not leader, or the store failed.
    pub async fn move_channel(
        &self,
        name: ChannelName,
        to: NodeId,
    ) -> Result<Vec<Transition>, ApiError> {
        self.ask(|reply| Request::Move { name, to, reply }).await
    }

    /// Drains a node.
    ///
    /// # Errors
    /// Unknown node or not leader.
    pub async fn drain(&self, node: NodeId) -> Result<(), ApiError> {
        self.ask(|reply| Request::Drain { node, reply }).await
    }

    /// The balance plan; unless `dry_run`, balance runs (it also runs on its own).
    ///
    /// # Errors
    /// Not leader.
    pub async fn balance(&self, dry_run: bool) -> Result<Vec<PlannedMove>, ApiError> {
        self.ask(|reply| Request::Balance { dry_run, reply }).await
    }
}

/// Why a coordinator stopped for good.
#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    /// The store refused us for a reason retrying cannot fix.
    #[error("store refused the coordinator: {0}")]
    Store(#[source] StoreError),
}

struct AbortOnDrop(JoinHandle<()>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

enum TermEnd {
    Shutdown,
    Lost(String),
}

/// Runs a coordinator until `shutdown`: campaign, lead or stand by, and serve `requests`.
/// On shutdown a leader revokes its lease so a standby takes over at once.
///
/// # Errors
/// [`CoordError`] for fatal store errors only; outages are retried.
pub async fn run(
    store: Arc<dyn MetaStore>,
    config: CoordinatorConfig,
    clock: Clock,
    mut requests: mpsc::Receiver<Request>,
    status: watch::Sender<CoordStatus>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), CoordError> {
    tokio::pin!(shutdown);
    let leader_key = config.keys.leader();
    let mut attempt = 0u32;
    loop {
        // A fresh lease per campaign: a leader that lost its lease must not reuse it.
        let lease = tokio::select! {
            biased;
            () = &mut shutdown => return Ok(()),
            l = store.grant(config.session_ttl) => l,
        };
        let lease = match lease {
            Ok(l) => l,
            Err(e) if e.is_retryable() => {
                attempt += 1;
                warn!(error = %e, "coord: cannot reach the store; retrying");
                let wait = Duration::from_millis(200 * u64::from(attempt.min(25)));
                if serve_standby_until(&mut requests, &status, clock.sleep(wait), &mut shutdown)
                    .await
                {
                    return Ok(());
                }
                continue;
            }
            Err(e) => return Err(CoordError::Store(e)),
        };
        attempt = 0;
        let lost = CancellationToken::new();
        let _keepalive = AbortOnDrop(tokio::spawn(keepalive(
            store.clone(),
            lease.id,
            config.session_ttl,
            clock,
            lost.clone(),
        )));
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
                        .and_then([TxnOp::put_with_lease(&leader_key, me.encode(), lease.id)])
                        .or_else([TxnOp::get(&leader_key)]),
                )
                .await;
            let resp = match campaign {
                Ok(r) => r,
                Err(e) => {
                    warn!(error = %e, "coord: campaign failed; retrying");
                    if serve_standby_until(
                        &mut requests,
                        &status,
                        clock.sleep(Duration::from_millis(500)),
                        &mut shutdown,
                    )
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
            if resp.succeeded {
                let leader_rev = resp.revision;
                info!(id = %config.id, leader_revision = leader_rev, "coord: elected leader");
                config.metrics.leader.set(1);
                status.send_modify(|s| {
                    s.leader = true;
                    s.ready = false;
                    s.leader_addr = Some(config.admin_addr.clone());
                    s.terms += 1;
                });
                let mut term = Term {
                    store: store.clone(),
                    config: &config,
                    clock,
                    leader_rev,
                    state: CoordState::new(config.keys.clone(), config.planner.clone()),
                    status: &status,
                    failovers: Vec::new(),
                };
                let end = term.lead(&mut requests, &lost, &mut shutdown).await;
                config.metrics.leader.set(0);
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
                        warn!(reason = %why, "coord: lost leadership; campaigning again");
                        let _ = store.revoke(lease.id).await;
                        break;
                    }
                }
            }
            // Standby: remember who leads, wait for the key to go.
            let leader = resp.responses.iter().find_map(|r| match r {
                chanwatch_store::OpResponse::Get { kv: Some(kv) } => Some(kv.clone()),
                _ => None,
            });
            // Watch from the txn's revision, not from the key's mod revision: the key is known
            // to exist then, and an old mod revision may be compacted away, which would fail
            // the watch at once and spin the campaign (found by the simulation).
            let addr = leader
                .as_ref()
                .and_then(|kv| CoordSession::decode(&kv.value).ok())
                .map(|s| s.admin_addr);
            let from = resp.revision;
            debug!(leader = ?addr, "coord: standing by");
            status.send_modify(|s| {
                s.leader = false;
                s.ready = false;
                s.leader_addr = addr;
            });
            let gone = leader_gone(&*store, &leader_key, from + 1);
            if serve_standby_until(&mut requests, &status, gone, &mut shutdown).await {
                return Ok(());
            }
            if lost.is_cancelled() {
                break;
            }
        }
    }
}

/// Waits until the leader key is deleted (or the watch breaks: campaigning again is safe,
/// after a pause so that a watch that keeps failing cannot spin the campaign loop).
async fn leader_gone(store: &dyn MetaStore, key: &str, from: i64) {
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
                if batch
                    .events
                    .iter()
                    .any(|e| e.kind == EventKind::Delete && e.kv.key == key)
                {
                    return;
                }
            }
            Err(_) => break,
        }
    }
    tokio::time::sleep(RETRY).await;
}

/// Answers requests with `NotLeader` until `until` completes. Returns true on shutdown.
async fn serve_standby_until(
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

fn refuse(req: Request, err: ApiError) {
    match req {
        Request::Channels(r) => drop(r.send(Err(err))),
        Request::Nodes(r) => drop(r.send(Err(err))),
        Request::Add { reply, .. }
        | Request::Remove { reply, .. }
        | Request::Move { reply, .. } => {
            drop(reply.send(Err(err)));
        }
        Request::Drain { reply, .. } => drop(reply.send(Err(err))),
        Request::Balance { reply, .. } => drop(reply.send(Err(err))),
    }
}

/// Renews the leader lease; cancels `lost` when it is gone or has not been renewed for
/// `ttl - margin` (a leader that cannot renew must stop writing before a standby may start).
async fn keepalive(
    store: Arc<dyn MetaStore>,
    lease: i64,
    ttl: Duration,
    clock: Clock,
    lost: CancellationToken,
) {
    let period = ttl / 3;
    let margin = (ttl / 5).max(Duration::from_secs(1));
    let mut last_ok = clock.now();
    loop {
        clock.sleep(period).await;
        // The lease runs from when the store got the renewal, which is no earlier than this.
        let sent = clock.now();
        match tokio::time::timeout(period, store.keepalive(lease)).await {
            Ok(Ok(())) => last_ok = sent,
            Ok(Err(StoreError::LeaseNotFound(_))) => {
                lost.cancel();
                return;
            }
            Ok(Err(e)) => warn!(error = %e, "coord: leader keepalive failed"),
            Err(_) => warn!("coord: leader keepalive timed out"),
        }
        if clock.now().saturating_duration_since(last_ok) + margin >= ttl {
            lost.cancel();
            return;
        }
    }
}

/// One term as leader.
struct Term<'a> {
    store: Arc<dyn MetaStore>,
    config: &'a CoordinatorConfig,
    clock: Clock,
    leader_rev: i64,
    state: CoordState,
    status: &'a watch::Sender<CoordStatus>,
    /// Sessions seen gone, with the channels they held, until those are all Watched again.
    failovers: Vec<(tokio::time::Instant, NodeId, Vec<ChannelName>)>,
}

impl Term<'_> {
    async fn lead(
        &mut self,
        requests: &mut mpsc::Receiver<Request>,
        lost: &CancellationToken,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> TermEnd {
        let mut lw = ListWatch::spawn(self.store.clone(), self.config.keys.all_prefix());
        let mut tick = tokio::time::interval(self.config.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut reconcile = tokio::time::interval(self.config.reconcile_interval);
        reconcile.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        reconcile.tick().await; // the first tick is immediate; the list-watch lists anyway
        let mut recovered = false;
        let mut restarts_seen = 0;
        // A plan walks every channel that needs attention (all of them during a burst), so
        // bursts of events (a failover's acks arrive one batch each) are planned together:
        // at most one plan per `PLAN_EVERY`.
        let mut dirty = false;
        let mut ticked = false;
        let mut last_plan = self.clock.now() - PLAN_EVERY;
        // A plan costs O(channels needing attention), which is every channel during a mass
        // registration; spacing plans by twice their own cost keeps planning to at most a
        // third of the time, so nodes and acks are not starved on a big cluster.
        let mut plan_gap = PLAN_EVERY;
        loop {
            tokio::select! {
                biased;
                () = shutdown.as_mut() => return TermEnd::Shutdown,
                () = lost.cancelled() => return TermEnd::Lost("leader lease lost or not renewed in time".into()),
                Some(req) = requests.recv() => {
                    if !recovered {
                        refuse(req, ApiError::Store("the leader is still recovering; retry shortly".into()));
                    } else if let Err(why) = self.handle(req).await {
                        return TermEnd::Lost(why);
                    }
                }
                update = lw.next() => {
                    let Some(update) = update else { return TermEnd::Lost("list-watch ended".into()) };
                    self.apply(update);
                    while let Some(more) = lw.try_next() {
                        self.apply(more);
                    }
                    if !recovered {
                        recovered = true;
                        info!(channels = self.state.channel_count(), nodes = self.state.nodes().len(), "coord: startup recovery listed the store");
                    }
                    dirty = true;
                }
                _ = tick.tick() => {
                    dirty |= recovered;
                    ticked = true;
                }
                () = tokio::time::sleep_until(last_plan + plan_gap), if dirty => {}
                _ = reconcile.tick() => lw.relist(),
            }
            let restarts = lw.restarts();
            self.config
                .metrics
                .watch_restarts
                .inc_by(restarts - restarts_seen);
            restarts_seen = restarts;
            if dirty && self.clock.now() >= last_plan + plan_gap {
                last_plan = self.clock.now();
                dirty = false;
                let txns = self.state.plan(self.clock.unix_ms());
                plan_gap =
                    PLAN_EVERY.max(self.clock.now().saturating_duration_since(last_plan) * 2);
                match self.execute(txns).await {
                    // Re-plan on the refreshed view without waiting for another event.
                    Ok(refused) => dirty |= refused > 0,
                    Err(why) => return TermEnd::Lost(why),
                }
                self.finish_failovers();
                self.config.metrics.observe(&self.state, ticked);
                ticked = false;
                if recovered && !self.status.borrow().ready {
                    self.status.send_modify(|s| s.ready = true);
                    info!("coord: recovered and ready");
                }
            }
        }
    }

    fn apply(&mut self, update: Update) {
        match update {
            Update::Reset { kvs, revision } => {
                debug!(keys = kvs.len(), revision, "coord: full list");
                self.config.metrics.relists.inc();
                self.state.reset(
                    kvs.iter()
                        .map(|kv| (kv.key.as_str(), kv.value.as_slice(), kv.mod_revision)),
                );
                self.state.caught_up(revision);
                for (key, why) in self.state.corrupt() {
                    error!(key, error = %why, "coord: value does not decode; leaving it alone");
                }
            }
            Update::Events(events) => {
                for ev in events {
                    match ev.kind {
                        EventKind::Put => {
                            if let Some(why) =
                                self.state
                                    .apply_put(&ev.kv.key, &ev.kv.value, ev.kv.mod_revision)
                            {
                                error!(key = ev.kv.key, error = %why, "coord: value does not decode; leaving it alone");
                            }
                        }
                        EventKind::Delete => {
                            if let Ok(id) = self.config.keys.parse_session(&ev.kv.key) {
                                let held: Vec<ChannelName> = self
                                    .state
                                    .entries()
                                    .filter(|e| e.owner == chanwatch_core::ChannelOwner::Node(id))
                                    .map(|e| e.info.channel.clone())
                                    .collect();
                                info!(node = %id, channels = held.len(), "coord: node session gone; its channels fail over");
                                // Bounded: a storm of dead nodes must not grow this without limit.
                                if !held.is_empty() && self.failovers.len() < 1024 {
                                    self.failovers.push((self.clock.now(), id, held));
                                }
                            }
                            self.state.apply_delete(&ev.kv.key, ev.kv.mod_revision);
                        }
                    }
                    self.state.caught_up(ev.kv.mod_revision);
                }
            }
        }
    }

    /// Observes the failover duration of every dead node whose channels are all Watched on
    /// another node (or removed) now.
    fn finish_failovers(&mut self) {
        let state = &self.state;
        let metrics = &self.config.metrics;
        let now = self.clock.now();
        self.failovers.retain(|(since, dead, held)| {
            let done = held.iter().all(|c| match state.entry(c) {
                None => true,
                Some(e) => {
                    e.info.state == chanwatch_core::ChannelState::Watched
                        && e.owner != chanwatch_core::ChannelOwner::Node(*dead)
                }
            });
            if done {
                let secs = now.saturating_duration_since(*since).as_secs_f64();
                metrics.failover_seconds.observe(secs);
                info!(node = %dead, channels = held.len(), seconds = secs, "coord: failover complete: every channel Watched elsewhere");
            }
            !done
        });
    }

    /// Handles an admin request. `Err` only when leadership was lost.
    async fn handle(&mut self, req: Request) -> Result<(), String> {
        let now = self.clock.unix_ms();
        match req {
            Request::Channels(reply) => drop(reply.send(Ok(self.state.channel_rows()))),
            Request::Nodes(reply) => drop(reply.send(Ok(self.state.node_rows()))),
            Request::Add {
                name,
                vchannel,
                reply,
            } => {
                let planned = self.state.add_channel(name, vchannel, now);
                self.run_one(planned, reply).await?;
            }
            Request::Remove { name, reply } => {
                let planned = self.state.remove_channel(&name);
                self.run_one(planned, reply).await?;
            }
            Request::Move { name, to, reply } => {
                let planned = self.state.move_channel(&name, to, now);
                self.run_one(planned, reply).await?;
            }
            Request::Drain { node, reply } => {
                let planned = self.state.drain(node);
                let (tx, rx) = oneshot::channel();
                self.run_one(planned, tx).await?;
                let result = match rx.await {
                    Ok(Ok(_)) => {
                        info!(node = %node, "coord: draining node");
                        Ok(())
                    }
                    Ok(Err(e)) => Err(e),
                    Err(_) => Err(ApiError::Store("drain request dropped".into())),
                };
                drop(reply.send(result));
                let txns = self.state.plan(now);
                self.execute(txns).await?;
            }
            Request::Balance { dry_run, reply } => {
                let plan = self.state.balance_plan();
                drop(reply.send(Ok(plan)));
                if !dry_run {
                    let txns = self.state.plan(now);
                    self.execute(txns).await?;
                }
            }
        }
        Ok(())
    }

    async fn run_one(
        &mut self,
        planned: Result<PlannedTxn, AdminError>,
        reply: oneshot::Sender<Result<Vec<Transition>, ApiError>>,
    ) -> Result<(), String> {
        let txn = match planned {
            Ok(t) => t,
            Err(e) => {
                drop(reply.send(Err(e.into())));
                return Ok(());
            }
        };
        let started = self.clock.now();
        let result = self.store.txn(self.to_store(&txn)).await;
        self.record_txn(&result, started);
        match result {
            Ok(r) if r.succeeded => {
                self.state.applied(&txn, r.revision);
                self.log_transitions(&txn);
                drop(reply.send(Ok(txn.transitions)));
                Ok(())
            }
            Ok(r) => {
                self.refresh(&txn, &r)?;
                drop(reply.send(Err(ApiError::Store(
                    "the channel changed meanwhile; retry".into(),
                ))));
                Ok(())
            }
            Err(e) => {
                drop(reply.send(Err(ApiError::Store(e.to_string()))));
                Ok(())
            }
        }
    }

    fn to_store(&self, t: &PlannedTxn) -> Txn {
        let keys = &self.config.keys;
        let mut compares = Vec::with_capacity(t.guards.len() + 1);
        compares.push(Compare::create_revision(keys.leader(), self.leader_rev));
        compares.extend(t.guards.iter().map(|g: &Guard| {
            let key = keys.channel(g.owner, &g.channel);
            if g.mod_revision == 0 {
                Compare::absent(key)
            } else {
                Compare::mod_revision(key, g.mod_revision)
            }
        }));
        // Deletes first, so one revision's events read "old key gone, new key there".
        let mut ops: Vec<TxnOp> = Vec::with_capacity(t.ops.len());
        for op in &t.ops {
            if let Op::Delete { owner, channel } = op {
                ops.push(TxnOp::delete(keys.channel(*owner, channel)));
            }
        }
        for op in &t.ops {
            match op {
                Op::Put { owner, info } => {
                    ops.push(TxnOp::put(
                        keys.channel(*owner, &info.channel),
                        info.encode(),
                    ));
                }
                Op::Drain { node } => {
                    let since = serde_json::json!({ "since_ms": self.clock.unix_ms() });
                    ops.push(TxnOp::put(keys.drain(*node), since.to_string()));
                }
                Op::Undrain { node } => ops.push(TxnOp::delete(keys.drain(*node))),
                Op::Fence { node } => {
                    let since = serde_json::json!({ "since_ms": self.clock.unix_ms() });
                    ops.push(TxnOp::put(keys.fence(*node), since.to_string()));
                }
                Op::Unfence { node } => ops.push(TxnOp::delete(keys.fence(*node))),
                Op::Delete { .. } => {}
            }
        }
        // When a compare fails, the same round trip returns what the keys hold now (leader
        // key first), so the view is fixed at once instead of when the watch catches up: a
        // single stale guard refuses a whole txn of ~127 channels, and a watch that lags
        // under load made a failover retry the same doomed txn for hundreds of ms.
        let mut reads = Vec::with_capacity(t.guards.len() + 1);
        reads.push(TxnOp::get(keys.leader()));
        reads.extend(
            t.guards
                .iter()
                .map(|g| TxnOp::get(keys.channel(g.owner, &g.channel))),
        );
        Txn::new().when(compares).and_then(ops).or_else(reads)
    }

    /// Brings the view up to date with what a refused txn read back. `Err` when the leader
    /// key is no longer ours.
    fn refresh(
        &mut self,
        t: &PlannedTxn,
        resp: &chanwatch_store::TxnResponse,
    ) -> Result<(), String> {
        let mut reads = resp.responses.iter();
        match reads.next() {
            Some(OpResponse::Get { kv: Some(kv) }) if kv.create_revision == self.leader_rev => {}
            Some(OpResponse::Get { .. }) => {
                return Err("the leader key belongs to someone else: deposed".into())
            }
            _ => return Ok(()),
        }
        let keys = &self.config.keys;
        for (g, r) in t.guards.iter().zip(reads) {
            let key = keys.channel(g.owner, &g.channel);
            let now = match r {
                OpResponse::Get { kv: Some(kv) } => kv.mod_revision,
                _ => 0,
            };
            if now != g.mod_revision {
                debug!(channel = %g.channel, owner = %g.owner, expected = g.mod_revision, found = now, "coord: stale guard");
            }
            match r {
                OpResponse::Get { kv: Some(kv) } => {
                    self.state.apply_put(&key, &kv.value, kv.mod_revision);
                }
                OpResponse::Get { kv: None } => self.state.apply_delete(&key, resp.revision),
                _ => {}
            }
        }
        Ok(())
    }

    /// Runs planned txns, up to `pipeline` at once, and returns how many were refused (the
    /// view was stale; it is refreshed). `Err` when leadership was lost.
    async fn execute(&mut self, txns: Vec<PlannedTxn>) -> Result<usize, String> {
        self.fence_nodes().await;
        if txns.is_empty() {
            return Ok(0);
        }
        let store = self.store.clone();
        let jobs: Vec<(PlannedTxn, Txn)> = txns
            .into_iter()
            .map(|t| {
                let s = self.to_store(&t);
                (t, s)
            })
            .collect();
        let clock = self.clock;
        let results: Vec<(
            PlannedTxn,
            Result<chanwatch_store::TxnResponse, StoreError>,
            tokio::time::Instant,
        )> = futures_util::stream::iter(jobs.into_iter().map(|(t, s)| {
            let store = store.clone();
            async move {
                let started = clock.now();
                (t, store.txn(s).await, started)
            }
        }))
        .buffer_unordered(self.config.pipeline.max(1))
        .collect()
        .await;
        let mut refused = 0;
        debug!(
            txns = results.len(),
            committed = results
                .iter()
                .filter(|(_, r, _)| r.as_ref().is_ok_and(|r| r.succeeded))
                .count(),
            "coord: executed a plan round"
        );
        for (t, r, started) in results {
            self.record_txn(&r, started);
            match r {
                Ok(resp) if resp.succeeded => {
                    self.state.applied(&t, resp.revision);
                    self.log_transitions(&t);
                }
                Ok(resp) => {
                    refused += 1;
                    self.refresh(&t, &resp)?;
                }
                Err(e) => {
                    warn!(error = %e, channels = t.transitions.len(), "coord: txn failed; the next plan retries")
                }
            }
        }
        if refused > 0 {
            debug!(
                refused,
                "coord: txns refused (stale view); refreshed the keys they guard"
            );
        }
        // Fence marks that just landed.
        self.fence_nodes().await;
        Ok(refused)
    }
}

impl Term<'_> {
    /// Revokes the session lease of every node the planner wants fenced: a node that did
    /// not release a channel within the release timeout, so that the channel can move
    /// without running beside it (DESIGN §3). A revoke that fails is asked for again by the
    /// planner; a session already gone needs none.
    async fn fence_nodes(&mut self) {
        let mut nodes = self.state.take_fence_requests();
        nodes.dedup();
        for node in nodes {
            let key = self.config.keys.session(node);
            let lease = match self.store.get(&key).await {
                Ok(Some(kv)) => kv.lease,
                Ok(None) => None,
                Err(e) => {
                    warn!(node = %node, error = %e, "coord: cannot read the session of a node to fence; retrying");
                    continue;
                }
            };
            let Some(lease) = lease else {
                continue; // the session is gone already
            };
            match self.store.revoke(lease).await {
                Ok(()) => {
                    warn!(
                        node = %node,
                        wait_ms = self.config.planner.fence_wait_ms,
                        "coord: node did not release a channel within the release timeout; revoked its session lease to fence it — its channels fail over once it has surely stopped them"
                    );
                    self.config.metrics.fences.inc();
                }
                Err(StoreError::LeaseNotFound(_)) => {}
                Err(e) => {
                    warn!(node = %node, error = %e, "coord: revoking the session lease of a node to fence failed; retrying");
                }
            }
        }
    }

    fn record_txn(
        &self,
        r: &Result<chanwatch_store::TxnResponse, StoreError>,
        started: tokio::time::Instant,
    ) {
        let m = &self.config.metrics;
        m.txn_seconds.observe(
            self.clock
                .now()
                .saturating_duration_since(started)
                .as_secs_f64(),
        );
        m.txn(match r {
            Ok(resp) if resp.succeeded => "committed",
            Ok(_) => "refused",
            Err(_) => "error",
        });
    }

    /// One log line and one counter per channel transition.
    fn log_transitions(&self, t: &PlannedTxn) {
        for tr in &t.transitions {
            // Releases are the first half of a move; count the move once, when it lands.
            if tr.state != Some(chanwatch_core::ChannelState::ToRelease) {
                self.config.metrics.reassigned(tr.cause.as_str());
            }
            info!(
                channel = %tr.channel,
                cause = tr.cause.as_str(),
                from = tr.from.map(|o| o.to_string()).unwrap_or_else(|| "-".into()),
                to = tr.to.map(|o| o.to_string()).unwrap_or_else(|| "-".into()),
                state = tr.state.map_or("deleted", |s| s.as_str()),
                epoch = %tr.epoch,
                "coord: channel transition"
            );
        }
    }
}
