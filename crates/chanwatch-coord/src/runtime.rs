//! The leader loop and txn execution (election is in [`crate::election`]).
//!
//! Owns: the planner state while leader, the request channel of [`CoordHandle`], and the
//! leader's watch of its own key (it steps down the moment the key is no longer its own).
//! Must not: decide anything itself — every decision comes from the core planner.
//!
//! Longer than 600 lines because the loop, `apply`, `execute` and the txn building share one
//! `Term`'s private state; the request handle (about 250 lines) is the next thing to move
//! out, once the parallel edits of issue 11 have landed.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chanwatch_core::planner::{
    AdminError, ChannelRow, Guard, NodeRow, Op, PlannedMove, PlannedTxn, Planner, PlannerConfig,
    Transition,
};
use chanwatch_core::{ChannelName, Keys, NodeId, VChannelInfo};
use chanwatch_store::{
    Clock, Compare, EventKind, LeaseId, ListWatch, MetaStore, OpResponse, StoreError, Txn, TxnOp,
    Update,
};
use futures_util::StreamExt;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

/// Least time between two plans driven by store events (ticks and admin requests aside).
const PLAN_EVERY: Duration = Duration::from_millis(10);

/// Most admin requests served in one turn of the leader loop. Every turn ends by draining
/// the watch and planning when a plan is due, so a burst of requests delays a watch batch
/// (a dead node, an ack) by at most this many requests and one plan round.
const REQUESTS_PER_TURN: usize = 16;

/// Settings of a coordinator.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// Key layout.
    pub keys: Keys,
    /// Planner settings (timeouts, limits, moves in flight).
    pub planner: PlannerConfig,
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
            planner: PlannerConfig::default(),
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

/// How a term as leader ended.
pub(crate) enum TermEnd {
    Shutdown,
    Lost(String),
}

/// Answers a request with `err` without doing it.
pub(crate) fn refuse(req: Request, err: ApiError) {
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

/// One term as leader.
pub(crate) struct Term<'a> {
    store: Arc<dyn MetaStore>,
    config: &'a CoordinatorConfig,
    clock: Clock,
    leader_rev: i64,
    /// The lease our leader key is attached to: the key is ours while it has this lease and
    /// create revision `leader_rev`.
    lease: LeaseId,
    state: Planner,
    status: &'a watch::Sender<CoordStatus>,
    /// Sessions seen gone, with the channels they held, until those are all Watched again.
    failovers: Vec<(tokio::time::Instant, NodeId, Vec<ChannelName>)>,
    /// A request (drain, balance) wants a plan round; the loop runs it when its view is
    /// fresh (found by the simulation: a balance request right after an etcd outage planned
    /// from the stale view and fenced a node that was releasing).
    replan: bool,
    /// Since when etcd has refused our writes for lack of space (NOSPACE).
    writes_refused_since: Option<tokio::time::Instant>,
}

impl<'a> Term<'a> {
    /// A term that begins with our leader key created at `leader_rev` on `lease`.
    pub(crate) fn new(
        store: Arc<dyn MetaStore>,
        config: &'a CoordinatorConfig,
        clock: Clock,
        leader_rev: i64,
        lease: LeaseId,
        status: &'a watch::Sender<CoordStatus>,
    ) -> Self {
        Term {
            store,
            config,
            clock,
            leader_rev,
            lease,
            state: Planner::new(config.keys.clone(), config.planner.clone()),
            status,
            failovers: Vec::new(),
            replan: false,
            writes_refused_since: None,
        }
    }

    /// Leads until shutdown or until leadership is lost (lease lost, or the leader key
    /// deleted or replaced: seen on the watch at once).
    ///
    /// Each turn serves one ready source in order — the watch, the tick, a due plan, the
    /// reconcile, then up to [`REQUESTS_PER_TURN`] requests — then drains every watch batch
    /// already waiting and plans if a plan is due. So requests never blind the leader, and
    /// the watch cannot starve requests for longer than it takes to apply what is waiting.
    pub(crate) async fn lead(
        &mut self,
        requests: &mut mpsc::Receiver<Request>,
        lost: &CancellationToken,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> TermEnd {
        let mut lw = ListWatch::spawn(self.store.clone(), self.config.keys.all_prefix());
        let blind = lw.blind_since();
        // Since when the list-watch has been failing, as seen by the last tick.
        let mut away_since: Option<tokio::time::Instant> = None;
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
                update = lw.next() => {
                    let Some(update) = update else { return TermEnd::Lost("list-watch ended".into()) };
                    let relisted = matches!(update, Update::Reset { .. });
                    if let Err(why) = self.apply(update) {
                        return TermEnd::Lost(why);
                    }
                    // Timers stood still while the store was away; a new term starts with
                    // one watch timeout of grace, knowing nothing of what came before.
                    if relisted {
                        let now_ms = self.clock.unix_ms();
                        let away = match away_since.take() {
                            // Plus one TTL: nodes need a moment to see their assignments again
                            // (their list-watch may be in back-off) before a release is late.
                            Some(since) => self.clock.now().saturating_duration_since(since) + self.config.session_ttl,
                            None if !recovered => Duration::from_millis(self.config.planner.watch_timeout_ms),
                            None => Duration::ZERO,
                        };
                        if !away.is_zero() {
                            let ms = millis(away);
                            debug!(away_ms = ms, "coord: the store was away; timeouts wait as long");
                            self.state.store_was_away(now_ms, ms);
                        }
                    }
                    dirty = true;
                }
                _ = tick.tick() => {
                    dirty |= recovered;
                    ticked = true;
                    // A leader that cannot list or watch (e.g. its auth token expired while
                    // its lease renewals, which need none, still pass) plans from a stale
                    // view and holds the key from a standby that might do better: it steps
                    // down after a TTL of blindness, as it would after a TTL of failed
                    // renewals.
                    let since = *blind.borrow();
                    if let Some(since) = since {
                        away_since.get_or_insert(since);
                        let for_ = self.clock.now().saturating_duration_since(since);
                        if for_ >= self.config.session_ttl {
                            return TermEnd::Lost(format!(
                                "could not list or watch the store for {} ms (session TTL {} ms); resigning so a standby can lead",
                                for_.as_millis(),
                                self.config.session_ttl.as_millis()
                            ));
                        }
                    }
                }
                () = tokio::time::sleep_until(last_plan + plan_gap), if dirty && blind.borrow().is_none() => {}
                _ = reconcile.tick() => lw.relist(),
                Some(req) = requests.recv() => {
                    let mut next = Some(req);
                    let mut served = 0;
                    while let Some(req) = next.take() {
                        if !recovered {
                            refuse(req, ApiError::Store("the leader is still recovering; retry shortly".into()));
                        } else if let Err(why) = self.handle(req).await {
                            return TermEnd::Lost(why);
                        }
                        served += 1;
                        if served < REQUESTS_PER_TURN {
                            next = requests.try_recv().ok();
                        }
                    }
                    if std::mem::take(&mut self.replan) {
                        // Plan now (not after `plan_gap`), unless the view is stale.
                        dirty = true;
                        last_plan = self.clock.now() - plan_gap;
                    }
                }
            }
            // Whatever this turn served, what the watch delivered meanwhile is applied now.
            while let Some(more) = lw.try_next() {
                if let Err(why) = self.apply(more) {
                    return TermEnd::Lost(why);
                }
                dirty = true;
            }
            if dirty && !recovered {
                recovered = true;
                info!(
                    channels = self.state.channel_count(),
                    nodes = self.state.nodes().len(),
                    "coord: startup recovery listed the store"
                );
            }
            let restarts = lw.restarts();
            self.config
                .metrics
                .watch_restarts
                .inc_by(restarts - restarts_seen);
            restarts_seen = restarts;
            // No plan from a view the list-watch cannot refresh (the store is away): its
            // timers would fire on time that measured etcd's absence (see
            // `Planner::store_was_away`), and what it plans would be refused anyway.
            if dirty && self.clock.now() >= last_plan + plan_gap && blind.borrow().is_none() {
                last_plan = self.clock.now();
                dirty = false;
                // While etcd refuses writes (NOSPACE) nodes cannot ack: their timers stand
                // still, round by round, as they do while the store is away.
                // Until the next refusal: a round that writes nothing must not keep the
                // timers (and forgotten moves) frozen forever (found by the simulation: 16
                // balance moves whose txns NOSPACE refused blocked balance for good).
                if let Some(since) = self.writes_refused_since.take() {
                    let now = self.clock.now();
                    let ms = millis(now.saturating_duration_since(since));
                    self.state.store_was_away(self.clock.unix_ms(), ms);
                }
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

    /// Applies what the list-watch delivered. `Err` when it shows that the leader key is no
    /// longer ours (deleted, re-created by another campaign, or rewritten without our lease):
    /// the leader steps down at once instead of when its next txn is refused.
    fn apply(&mut self, update: Update) -> Result<(), String> {
        let leader_key = self.config.keys.leader();
        match update {
            Update::Reset { kvs, revision } => {
                debug!(keys = kvs.len(), revision, "coord: full list");
                self.config.metrics.relists.inc();
                match kvs.iter().find(|kv| kv.key == leader_key) {
                    Some(kv) => self.still_ours(kv)?,
                    None => {
                        return Err(format!(
                            "the leader key {leader_key} is gone (seen by a full list): deposed"
                        ))
                    }
                }
                // A session missing from the new list died while the watch was not looking:
                // it is a failover like one seen by a delete event (logged and measured).
                let listed: std::collections::BTreeSet<NodeId> = kvs
                    .iter()
                    .filter_map(|kv| self.config.keys.parse_session(&kv.key).ok())
                    .collect();
                let vanished: Vec<NodeId> = self
                    .state
                    .nodes()
                    .keys()
                    .filter(|id| !listed.contains(id))
                    .copied()
                    .collect();
                for id in vanished {
                    self.session_gone(id, "a full list");
                }
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
                    if ev.kv.key == leader_key {
                        match ev.kind {
                            EventKind::Put => self.still_ours(&ev.kv)?,
                            EventKind::Delete => {
                                return Err(format!(
                                "the leader key {leader_key} was deleted at revision {}: deposed",
                                ev.kv.mod_revision
                            ))
                            }
                        }
                    }
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
                                // Unknown when a refused txn already showed it gone.
                                if self.state.nodes().contains_key(&id) {
                                    self.session_gone(id, "a delete event");
                                }
                            }
                            self.state.apply_delete(&ev.kv.key, ev.kv.mod_revision);
                        }
                    }
                    self.state.caught_up(ev.kv.mod_revision);
                }
            }
        }
        Ok(())
    }

    /// `Err` unless `kv` (the leader key as the store holds it now) is still our key.
    fn still_ours(&self, kv: &chanwatch_store::KeyValue) -> Result<(), String> {
        if kv.create_revision != self.leader_rev {
            return Err(format!(
                "the leader key {} was re-created at revision {} (ours was created at {}): deposed",
                kv.key, kv.create_revision, self.leader_rev
            ));
        }
        if kv.lease != Some(self.lease) {
            return Err(format!(
                "the leader key {} was rewritten at revision {} without our lease {:x} (lease now {:x}): deposed",
                kv.key,
                kv.mod_revision,
                self.lease,
                kv.lease.unwrap_or(0)
            ));
        }
        Ok(())
    }

    /// Notes that node `id`'s session is gone (seen by `how`), so that the failover of the
    /// channels it held is logged and measured. Call before the view forgets the node.
    fn session_gone(&mut self, id: NodeId, how: &str) {
        let held: Vec<ChannelName> = self
            .state
            .entries()
            .filter(|e| e.owner == chanwatch_core::ChannelOwner::Node(id))
            .map(|e| e.info.channel.clone())
            .collect();
        info!(node = %id, channels = held.len(), seen_by = how, "coord: node session gone; its channels fail over");
        // Bounded: a storm of dead nodes must not grow this without limit.
        if !held.is_empty() && self.failovers.len() < 1024 {
            self.failovers.push((self.clock.now(), id, held));
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
                self.replan = true;
            }
            Request::Balance { dry_run, reply } => {
                let plan = self.state.balance_plan();
                drop(reply.send(Ok(plan)));
                self.replan |= !dry_run;
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
        let sessions = self.session_guards(t);
        compares.extend(sessions.iter().map(|n| Compare::exists(keys.session(*n))));
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
        reads.extend(sessions.iter().map(|n| TxnOp::get(keys.session(*n))));
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
        for (g, r) in t.guards.iter().zip(reads.by_ref()) {
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
        for (n, r) in self.session_guards(t).into_iter().zip(reads) {
            if matches!(r, OpResponse::Get { kv: None }) && self.state.nodes().contains_key(&n) {
                self.session_gone(n, "a refused txn");
                self.state
                    .apply_delete(&self.config.keys.session(n), resp.revision);
            }
        }
        Ok(())
    }

    /// Nodes a txn puts channel keys under: the txn also requires their sessions to exist,
    /// so nothing is assigned to a node that died before the watch told us (a put on a dead
    /// node is refused and the refusal's reads show the session gone). Empty when the
    /// compare and read lists have no room left (big planned txns; the next plan fixes
    /// those).
    fn session_guards(&self, t: &PlannedTxn) -> Vec<NodeId> {
        let nodes: std::collections::BTreeSet<NodeId> = t
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Put {
                    owner: chanwatch_core::ChannelOwner::Node(n),
                    ..
                } => Some(*n),
                _ => None,
            })
            .collect();
        let room = self
            .config
            .planner
            .max_txn_ops
            .min(self.store.limits().max_txn_ops);
        if t.guards.len() + 1 + nodes.len() > room {
            return Vec::new();
        }
        nodes.into_iter().collect()
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
                    if let Some(since) = self.writes_refused_since.take() {
                        // Nodes could not ack either while etcd refused writes: that time
                        // does not count against their releases and loads.
                        let away = self.clock.now().saturating_duration_since(since);
                        let ms = millis(away);
                        info!(refused_ms = ms, "coord: etcd takes writes again; timeouts wait as long as it refused them");
                        self.state.store_was_away(self.clock.unix_ms(), ms);
                    }
                }
                Ok(resp) => {
                    refused += 1;
                    self.refresh(&t, &resp)?;
                }
                Err(e) => {
                    if matches!(e, StoreError::NoSpace) {
                        self.writes_refused_since.get_or_insert(started);
                    }
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

/// Whole milliseconds of `d`, for the planner's `*_ms` inputs (saturating).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chanwatch_store::{EmbeddedStore, KeyValue};

    fn leader_kv(keys: &Keys, create_revision: i64, lease: Option<LeaseId>) -> KeyValue {
        KeyValue {
            key: keys.leader(),
            value: b"{}".to_vec(),
            create_revision,
            mod_revision: create_revision,
            version: 1,
            lease,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_list_deposes_the_leader_unless_the_key_is_its_own() {
        let config = CoordinatorConfig::default();
        let (status, _rx) = watch::channel(CoordStatus::default());
        let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
        let mut term = Term::new(store, &config, Clock::system(), 5, 0x77, &status);
        let reset = |kvs: Vec<KeyValue>| Update::Reset { kvs, revision: 9 };
        let keys = &config.keys;
        assert_eq!(
            term.apply(reset(vec![leader_kv(keys, 5, Some(0x77))])),
            Ok(())
        );
        for (case, kvs) in [
            ("gone", vec![]),
            ("re-created", vec![leader_kv(keys, 8, Some(0x78))]),
            ("rewritten without a lease", vec![leader_kv(keys, 5, None)]),
            (
                "rewritten on another lease",
                vec![leader_kv(keys, 5, Some(0x78))],
            ),
        ] {
            let why = term.apply(reset(kvs)).expect_err(case);
            assert!(
                why.contains("deposed") || why.contains("gone"),
                "{case}: {why}"
            );
        }
    }
}
